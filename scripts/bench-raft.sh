#!/usr/bin/env bash
# Replicated SET over RESP (issue 25's figure): redis-benchmark SET with 50 clients against
# the leader of a 3-node `tierkv serve --raft-*` cluster on 127.0.0.1, then against one
# unreplicated `tierkv serve` (same binary, same preset, default options), one after the
# other on the same machine. Prints redis-benchmark's throughput and latency summary for
# each. All three nodes share this machine's cores, so the replicated figure includes the
# followers' CPU. Needs a release build (cargo build --release -p tierkv-cli) and
# redis-tools. Usage: scripts/bench-raft.sh [REQUESTS] [CLIENTS] [VALUE_BYTES]
# (default 100000 50 100).
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-100000}"; c="${2:-50}"; d="${3:-100}"
bin="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/release/tierkv"
work="$(mktemp -d /tmp/bench-raft.XXXXXX)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
head -c 32 /dev/urandom | base64 > "$work/secret"
peers="1=127.0.0.1:17101,2=127.0.0.1:17102,3=127.0.0.1:17103"

wait_listening() { # log file
    for _ in $(seq 200); do grep -q listening "$1" 2>/dev/null && return 0; sleep 0.1; done
    echo "server did not start: $(cat "$1")" >&2; exit 1
}
bench() { # label, port
    echo "== $1"
    redis-benchmark -p "$2" -t set -n "$n" -c "$c" -r "$n" -d "$d" 2>/dev/null | tr '\r' '\n' \
        | grep -A4 -E 'throughput summary' | grep -vE '^\s*$'
}

for id in 1 2 3; do
    "$bin" serve --dir "$work/n$id" --port $((17110 + id)) --raft-id "$id" \
        --raft-addr "127.0.0.1:$((17100 + id))" --raft-peers "$peers" \
        --cluster-secret-file "$work/secret" > "$work/n$id.log" 2>&1 &
    pids+=($!)
done
for id in 1 2 3; do wait_listening "$work/n$id.log"; done
leader=""
for _ in $(seq 100); do
    leader="$("$bin" cluster status --raft-addr 127.0.0.1:17101 --cluster-secret-file "$work/secret" 2>/dev/null \
        | sed -n 's/^ *"leader": *\([0-9]\+\).*/\1/p')"
    [ -n "$leader" ] && break
    sleep 0.2
done
[ -n "$leader" ] || { echo "no leader elected" >&2; exit 1; }
uptime
bench "3-node raft cluster, leader = node $leader (SET, $c clients, $d B values)" $((17110 + leader))
for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
wait 2>/dev/null || true
pids=()

"$bin" serve --dir "$work/single" --port 17120 > "$work/single.log" 2>&1 &
pids+=($!)
wait_listening "$work/single.log"
uptime
bench "one unreplicated node (SET, $c clients, $d B values)" 17120
