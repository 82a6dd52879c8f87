#!/usr/bin/env bash
# tierkv's main job until the benchmark harness lands: build release, run the pmekv
# throughput example (PM emulated in /dev/shm), and a short CLI session.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p tierkv-cli
cargo run --release --locked -q -p tierkv --example throughput -- "$@"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
bin=target/release/tierkv
$bin put --dir "$dir/db" greeting "hello, persistent memory"
printf 'from stdin' | $bin put --dir "$dir/db" 'bin\x00key' -
echo "--- scan"; $bin scan --dir "$dir/db"
echo "--- get greeting"; $bin get --dir "$dir/db" greeting; echo
echo "--- check"; $bin check --dir "$dir/db"
