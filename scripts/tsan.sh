#!/usr/bin/env bash
# The concurrency tests and the PM crash simulator under background threads, under ThreadSanitizer (nightly toolchain with rust-src; not in CI).
set -euo pipefail
cd "$(dirname "$0")/.."
rustup component add rust-src --toolchain nightly >/dev/null
TSAN_OPTIONS="suppressions=$PWD/scripts/tsan-suppressions.txt ${TSAN_OPTIONS:-}" \
RUSTFLAGS="-Zsanitizer=thread" CARGO_TARGET_DIR=target/tsan \
  cargo +nightly test -Zbuild-std --target x86_64-unknown-linux-gnu -p tierkv --test concurrency --test crash_background -- --test-threads=1
