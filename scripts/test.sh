#!/usr/bin/env bash
# The tierkv test command: formatting, lints, every test of the workspace, then `tierkv serve`
# against stock Redis clients (scripts/client-tests.sh: installs redis-tools, openssl and
# redis-py itself; needs Go for go-redis). The benchmark peers (C++) are not built here
# (feature `peers`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
./scripts/client-tests.sh
