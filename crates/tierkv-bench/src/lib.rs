//! tierkv's benchmark harness (issue: benchmark harness). This crate holds everything that
//! may link peer engines, so the core `tierkv` crate never does.
//!
//! - [`workload`]: db_bench key streams and YCSB's request distributions;
//! - [`api`]: the one trait every engine implements; [`engine`]: the engines by name — every
//!   tierkv preset, the `limit` floor, and (feature `peers`, used by the main job) LevelDB and
//!   RocksDB in `peers`, which depends on `api` only;
//! - [`child`]: recovery after a real crash (a child process writing fresh keys, killed with
//!   SIGKILL at a random moment; every write it acknowledged is verified after the reopen);
//! - [`cgroup`]: memory cgroups for `--dram-budget`; [`job`]: an engine's workloads and
//!   recovery in child processes confined to one;
//! - [`run`]: workloads, client threads, latency histograms, `--reads` and `--time-cap`;
//!   [`report`]: table and JSON; [`plot`]: SVG/PNG charts;
//!   [`cli`]: `tierkv bench` (and its `--paper` preset); [`server`]: `tierkv bench --server`
//!   (RESP servers, redis-benchmark, YCSB over RESP).
//!
//! The method — DRAM budget, PM outside it, the Optane profile, durability levels, what the
//! recovery clock contains, the time cap, the JSON fields — is in `docs/design/bench.md`.
//!
//! Fairness (what is and is not like-for-like):
//! - durability, stated per engine in the report ([`engine::durability`]): by default the
//!   peers do not sync their WAL (as in the papers) and tierkv persists to PM with
//!   flush+fence but no msync and writes its WALs without fsync — all survive a process
//!   crash, none a power loss on non-DAX media. `--durable` makes the peers fsync every
//!   write, tierkv msync its PM (`pm_sync`) and sync `hpdk`'s and `hoakv`'s WALs
//!   (`sync_wal`), and `limit` msync what it persists: all then survive power loss of the
//!   medium — emulated only when PM is on tmpfs, which the run prints and the JSON states;
//! - media: tierkv's PM pools live in `--pm-dir` (default /dev/shm, i.e. DRAM standing in for
//!   PM, as the papers' emulation does; `--pm-profile optane` adds Optane's read latency and
//!   write bandwidth), the peers' files in `--dir` (default the temp directory);
//! - memory: by default nothing is confined and the peers run from the page cache;
//!   `--dram-budget` confines every engine (page cache included) to the same budget, PM
//!   pages apart;
//! - caching: the peers run with their default caches (LevelDB 8 MiB block cache, RocksDB's
//!   default) and the OS page cache; tierkv reads PM directly;
//! - the same seeded key and request streams are used for every engine.

pub mod api;
pub mod cgroup;
pub mod child;
pub mod cli;
pub mod engine;
pub mod job;
#[cfg(feature = "peers")]
pub mod peers;
pub mod plot;
pub mod report;
pub mod run;
pub mod server;
pub mod soak;
pub mod workload;
