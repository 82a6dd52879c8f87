#!/usr/bin/env bash
# redis-benchmark SET/GET against `tierkv serve` (preset native, default options) and
# redis-server 7 with AOF (appendfsync everysec and always), each plain, with AUTH and with
# TLS, then YCSB load + A-F over RESP (`tierkv bench --server`: the same three servers, plain,
# --server-auth and --server-tls): the figures of issue 23's closing note. `uptime` is
# printed before each part (the machine is shared). Needs a release build of tierkv
# (cargo build --release -p tierkv-cli), redis-server, redis-tools and openssl.
# Usage: scripts/bench-serve.sh [REQUESTS] [CLIENTS] [YCSB_RECORDS]   (default 100000 50 20000;
# YCSB_RECORDS 0 skips YCSB)
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-100000}"; c="${2:-50}"; ycsb="${3:-20000}"
bin="${CARGO_TARGET_DIR:-target}/release/tierkv"
work="$(mktemp -d /tmp/bench-serve.XXXXXX)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
(
    cd "$work"
    openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "/CN=bench CA" -keyout ca.key -out ca.crt 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout s.key -out s.csr 2>/dev/null
    echo "subjectAltName=DNS:localhost,IP:127.0.0.1" > ext
    openssl x509 -req -in s.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -extfile ext -out s.crt 2>/dev/null
    echo "bench-password" > pw
)
port=17000
run() { # name, port, extra redis-benchmark args...
    local name="$1" p="$2"; shift 2
    for pipe in 1 16; do
        printf '%-28s -P %-2s ' "$name" "$pipe"
        redis-benchmark -p "$p" -t set,get -n "$n" -c "$c" -P "$pipe" -r "$n" -d 100 -q "$@" 2>/dev/null \
            | tr '\r' '\n' | grep -E '^(SET|GET): [0-9]' | sed 's/ requests per second,/ rps/' | paste -sd' ' -
    done
}
start_tierkv() { # name, extra serve args...
    local name="$1"; shift
    port=$((port + 1))
    "$bin" serve --dir "$work/$name" --preset native "$@" > "$work/$name.out" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do grep -q listening "$work/$name.out" 2>/dev/null && break; sleep 0.1; done
}
start_redis() { # name, fsync, extra args...
    local name="$1" fsync="$2"; shift 2
    port=$((port + 1))
    mkdir -p "$work/$name"
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly yes --appendfsync "$fsync" \
        --dir "$work/$name" --daemonize no --logfile "$work/$name.log" "$@" &
    pids+=($!)
    sleep 0.5
}
tls=(--tls --cacert "$work/ca.crt")
echo "redis-benchmark -t set,get -n $n -c $c -r $n -d 100 (-P 1 and -P 16); $(uptime)"
start_tierkv plain --port "$((port + 1))"; run "tierkv native" "$port"
start_tierkv auth --port "$((port + 1))" --requirepass-file "$work/pw"; run "tierkv native +AUTH" "$port" -a bench-password
start_tierkv tls --port 0 --tls-port "$((port + 1))" --tls-cert-file "$work/s.crt" --tls-key-file "$work/s.key"
run "tierkv native +TLS" "$port" "${tls[@]}"
start_redis everysec everysec; run "redis aof everysec" "$port"
start_redis always always; run "redis aof always" "$port"
start_redis auth everysec --requirepass bench-password; run "redis aof everysec +AUTH" "$port" -a bench-password
start_redis tls everysec --port 0 --tls-port "$((port + 1))" --tls-cert-file "$work/s.crt" --tls-key-file "$work/s.key" \
    --tls-ca-cert-file "$work/ca.crt" --tls-auth-clients no
run "redis aof everysec +TLS" "$port" "${tls[@]}"
start_redis always-auth always --requirepass bench-password; run "redis aof always +AUTH" "$port" -a bench-password
start_redis always-tls always --port 0 --tls-port "$((port + 1))" --tls-cert-file "$work/s.crt" --tls-key-file "$work/s.key" \
    --tls-ca-cert-file "$work/ca.crt" --tls-auth-clients no
run "redis aof always +TLS" "$port" "${tls[@]}"
if [ "$ycsb" -gt 0 ]; then
    for mode in "" --server-auth --server-tls; do
        echo; echo "== YCSB over RESP ${mode:-plain}; $(uptime)"
        "$bin" bench --server --engines native --server-redis always,everysec --requests 0 --ycsb-num "$ycsb" \
            --dir "$work" $mode 2>/dev/null
    done
fi
