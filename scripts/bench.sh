#!/usr/bin/env bash
# tierkv's main job: the default benchmark comparison (release build). Writes the table and
# JSON to bench-results/. Extra arguments go to `tierkv bench` (see `tierkv bench --help`).
#
# `./scripts/bench.sh --paper` runs the papers' regime instead (data 8x a DRAM budget
# enforced by a memory cgroup, Optane PM profile; about an hour on 2 cores, needs root for
# the cgroup) and writes its own files, so the default run's stay: bench-results/paper.txt,
# paper.json and paper-throughput-1024.{svg,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/deps.sh
# The peers' bundled C++ needs clang (see .cargo/config.toml).
export CC="${CC:-clang}" CXX="${CXX:-clang++}"
cargo build --release --locked -p tierkv-cli --features peers
mkdir -p bench-results
name=results
table=table
for arg in "$@"; do
    if [ "$arg" = "--paper" ]; then
        name=paper
        table=paper
    fi
done
./target/release/tierkv bench --out "bench-results/$name.json" "$@" | tee "bench-results/$table.txt"
echo "results: bench-results/$table.txt, bench-results/$name.json"
