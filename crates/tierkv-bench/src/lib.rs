//! tierkv's benchmark harness (issue: benchmark harness). This crate holds everything that
//! may link peer engines, so the core `tierkv` crate never does.
//!
//! - [`workload`]: db_bench key streams and YCSB's request distributions;
//! - [`api`]: the one trait every engine implements; [`engine`]: the engines by name — every
//!   tierkv preset, the `limit` floor, and (feature `peers`, used by the main job) LevelDB and
//!   RocksDB in `peers`, which depends on `api` only;
//! - [`child`]: recovery after a real crash (a child process writing fresh keys, killed with
//!   SIGKILL at a random moment; every write it acknowledged is verified after the reopen);
//! - [`run`]: workloads, client threads, latency histograms; [`report`]: table and JSON;
//!   [`plot`]: SVG/PNG charts;
//!   [`cli`]: `tierkv bench`; [`server`]: `tierkv bench --server` (RESP servers, redis-benchmark,
//!   YCSB over RESP).
//!
//! Fairness (what is and is not like-for-like):
//! - durability: by default the peers do not sync their WAL (as in the papers) and tierkv
//!   persists to PM with flush+fence but no msync — both survive a process crash, neither a
//!   power loss on non-DAX media. `--durable` makes the peers fsync every write and tierkv
//!   msync its PM (`pm_sync`): both then survive power loss;
//! - media: tierkv's PM pools live in `--pm-dir` (default /dev/shm, i.e. DRAM standing in for
//!   PM, as the papers' emulation does), the peers' files in `--dir` (default the temp
//!   directory). Put `--dir` on tmpfs too to compare the designs without the SSD;
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
