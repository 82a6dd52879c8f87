#!/usr/bin/env bash
# The tierkv test command: formatting, lints, then every test of the workspace.
# Needs only the Rust toolchain: the benchmark peers (C++) are not built here (feature `peers`).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
