#!/usr/bin/env bash
# `tierkv serve` against stock clients and real processes (issue 23): redis-py 8 (default
# settings, RESP3), go-redis v9, redis-cli (plain and --tls), AUTH/NOAUTH/WRONGPASS, protected
# mode's DENIED from a non-loopback address (in a private network namespace), no password in
# `ps`, expiry across kill -9, and kill -9 during transactions. Called by scripts/test.sh
# after `cargo test` built the binary; installs what it needs (Debian 12, as root):
# redis-tools, openssl, util-linux/iproute2 (unshare, ip), python3-venv; redis-py from PyPI
# into target/client-venv; go-redis through the Go module proxy (Go must be installed).
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
[ -x "$target/debug/tierkv" ] || cargo build --locked -p tierkv-cli
export TIERKV_BIN="$(cd "$target" && pwd)/debug/tierkv"

need=()
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v openssl >/dev/null || need+=(openssl)
command -v unshare >/dev/null || need+=(util-linux)
command -v ip >/dev/null || need+=(iproute2)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    echo "client tests: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

venv="$target/client-venv"
if ! "$venv/bin/python" -c 'import redis, pytest, sys; sys.exit(0 if redis.__version__.startswith("8.") else 1)' 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q 'redis==8.*' 'pytest==8.*'
fi

pki="$(mktemp -d)"
trap 'rm -rf "$pki"' EXIT
(
    cd "$pki"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=tierkv test CA" -keyout ca.key -out ca.crt 2>/dev/null
    echo "subjectAltName=DNS:localhost,IP:127.0.0.1" > ext
    for n in server client; do
        openssl req -newkey rsa:2048 -nodes -subj "/CN=$n" -keyout $n.key -out $n.csr 2>/dev/null
        openssl x509 -req -in $n.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile ext -out $n.crt 2>/dev/null
    done
)
export TIERKV_TEST_PKI="$pki"

echo "== redis-py $("$venv/bin/python" -c 'import redis; print(redis.__version__)') and redis-cli $(redis-cli --version | cut -d' ' -f2)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider crates/tierkv-server/tests/clients/test_redis_py.py

if command -v go >/dev/null; then
    echo "== go-redis v9 ($(go version | cut -d' ' -f3))"
    (cd crates/tierkv-server/tests/clients/go && go test -count=1 ./...)
else
    echo "client tests: go is not installed, so go-redis is not tested" >&2
    exit 1
fi
