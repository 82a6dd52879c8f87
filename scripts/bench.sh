#!/usr/bin/env bash
# tierkv's main job: the default benchmark comparison (release build). Writes the table and
# JSON to bench-results/. Extra arguments go to `tierkv bench` (see `tierkv bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/deps.sh
cargo build --release --locked -p tierkv-cli --features peers
mkdir -p bench-results
./target/release/tierkv bench --out bench-results/results.json "$@" | tee bench-results/table.txt
echo "results: bench-results/table.txt, bench-results/results.json"
