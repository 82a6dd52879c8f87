#!/usr/bin/env bash
# Install what building the benchmark peers needs, if missing (Debian 12, as root):
# clang + libclang (bindgen for the rocksdb crate), cmake + g++ (LevelDB's bundled source),
# the DejaVu font the plots' text is drawn with, and redis-server + redis-tools
# (redis-benchmark) for `tierkv bench --server`.
# The core crate needs none of this.
set -euo pipefail
need=()
command -v clang >/dev/null 2>&1 || need+=(clang)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v g++ >/dev/null 2>&1 || need+=(g++)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)  # plot text
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)     # bench --server peer
command -v redis-benchmark >/dev/null 2>&1 || need+=(redis-tools)   # bench --server load
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing build dependencies: ${need[*]} (run as root, or: sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
  echo "installing: ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q "${need[@]}"
fi
