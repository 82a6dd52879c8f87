#!/usr/bin/env bash
# The tierkv test command: formatting, lints, every test of the workspace, the Python
# package's tests against its wheel, then `tierkv serve` against stock Redis clients.
# Needs the Rust toolchain, Python 3 (>= 3.9) and Go; the benchmark peers (C++) are not
# built here (feature `peers`). The Python part makes its own virtual environment (installing
# Debian's python3-venv first if `python3 -m venv` cannot work and apt-get can fix that) and
# installs maturin, pytest and hypothesis into it from PyPI; scripts/client-tests.sh installs
# redis-tools, openssl and redis-py itself and builds its go-redis test with Go.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The engine's docs, private items included, with no broken link.
RUSTDOCFLAGS="-D warnings" cargo doc -p tierkv --no-deps --document-private-items --locked
cargo test --workspace --locked

# Python bindings (crates/tierkv-py): build the wheel with maturin (release profile; it
# shares the workspace's target directory), install it into a fresh virtual environment and
# run its pytest suite there.
venv=target/py-test-venv
if ! python3 -m venv --clear "$venv" >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "python3 -m venv failed: installing python3-venv" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    python3 -m venv --clear "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check 'maturin>=1.9.4,<2' pytest hypothesis
rm -rf target/py-wheels
"$venv/bin/maturin" build --release --locked -m crates/tierkv-py/Cargo.toml -o target/py-wheels
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check target/py-wheels/tierkv-*.whl
(cd crates/tierkv-py && "../../$venv/bin/python" -m pytest -p no:cacheprovider tests)

# `tierkv serve` against stock Redis clients (redis-py, go-redis, redis-cli).
./scripts/client-tests.sh

# Replication: 3 `tierkv serve --raft-*` processes, leader kill -9, linearizability check.
./scripts/raft-tests.sh
