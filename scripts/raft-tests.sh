#!/usr/bin/env bash
# Replication (issue 25) with real processes: a 3-node `tierkv serve --raft-*` cluster on
# 127.0.0.1 whose leader is killed with SIGKILL repeatedly while go-redis clients write and
# read; every acknowledged write must be on every node afterwards, and the clients' history
# must pass porcupine's linearizability check (crates/tierkv-raft/tests/killtest). Called by
# scripts/test.sh after `cargo test` built the binary; needs Go (modules from the proxy).
# TIERKV_KILL_ROUNDS=N kills the leader N times (default 3, about 15 s).
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
[ -x "$target/debug/tierkv" ] || cargo build --locked -p tierkv-cli
export TIERKV_BIN="$(cd "$target" && pwd)/debug/tierkv"
if ! command -v go >/dev/null; then
    echo "raft tests: go is not installed" >&2
    exit 1
fi
echo "== raft: 3 processes, leader killed ${TIERKV_KILL_ROUNDS:-3} times, porcupine"
(cd crates/tierkv-raft/tests/killtest && go test -count=1 -v ./...)
