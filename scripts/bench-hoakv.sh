#!/usr/bin/env bash
# HoaKV's evaluation (papers/hoakv.txt §4) on the harness: hoakv against LevelDB and RocksDB
# in one run per table, zipfian θ = 0.99, 1 KiB values unless a sweep varies them. Writes
# tables and JSON to bench-results/hoakv/. Takes about 35 minutes on 2 cores.
#
#   main-t1, main-t8   load, read (YCSB C), update, scan, YCSB A, B, D; 1 and 8 client threads
#   hot                §4.4 Exp. 7: HotStore size (load, read)
#   group              §4.4 Exp. 8: GroupSize (load, read), with Value_Size 512 so that the
#                      1 KiB values are separated into the cold vlog (at the paper's 32 KB
#                      Value_Size no 1 KiB value reaches a group, and GroupSize is moot)
#   heatlimit          §4.4 Exp. 9: hot:cold proportion 0.05..0.95 (update), as the HotStore
#                      sized to that fraction of the loaded records (HeatLimit is the coldest
#                      hot key's heat, so the HotStore's share of the data sets it)
#   sweeps-t8          the HotStore sweep at 8 client threads (load, read, update)
#   vs-<size>          §4.4 Exp. 10: value sizes 256 B..32 KiB, 256 MB of data each
#                      (load, read, update)
# Extra arguments go to every `tierkv bench` call (e.g. --num, --dir, --pm-dir).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/deps.sh
# The peers' bundled C++ needs clang (see .cargo/config.toml).
export CC="${CC:-clang}" CXX="${CXX:-clang++}"
cargo build --release --locked -p tierkv-cli --features peers
out=bench-results/hoakv
mkdir -p "$out"
bench() {
  local name=$1
  shift
  echo "== $name" >&2
  ./target/release/tierkv bench --out "$out/$name.json" "$@" | tee "$out/$name.txt"
}
num=500000
peers=hoakv,leveldb,rocksdb
main=load,c,update,scan,a,b,d
bench main-t1 --num $num --engines $peers --workloads $main "$@"
bench main-t8 --num $num --engines $peers --workloads $main --threads 8 "$@"
bench hot --num $num --engines hoakv/hot=16,hoakv/hot=32,hoakv/hot=64,hoakv/hot=128,hoakv/hot=256,leveldb \
  --workloads load,c "$@"
bench group --num $num --engines hoakv/vs=512+group=16,hoakv/vs=512+group=32,hoakv/vs=512+group=64,hoakv/vs=512+group=128,hoakv/vs=512+group=256,leveldb \
  --workloads load,c "$@"
# A 1 KiB YCSB record takes a 2 x 1152-byte slot: 500,000 records = 1,099 MiB.
bench heatlimit --num $num --engines hoakv/hot=55,hoakv/hot=275,hoakv/hot=549,hoakv/hot=824,hoakv/hot=1044,leveldb \
  --workloads load,update "$@"
bench sweeps-t8 --num $num --threads 8 --engines hoakv/hot=16,hoakv/hot=64,hoakv/hot=256,hoakv/hot=549,hoakv/hot=1044,leveldb,rocksdb \
  --workloads load,c,update "$@"
for vs in 256:1000000 1024:250000 4096:64000 16384:16000 32768:8000; do
  bench "vs-${vs%%:*}" --num "${vs##*:}" --value-size "${vs%%:*}" --engines $peers --workloads load,c,update "$@"
done
echo "results: $out/" >&2
