//! tierkv's benchmark harness (issue: benchmark harness). This crate holds everything that
//! may link peer engines, so the core `tierkv` crate never does.
//!
//! Present so far: the workload generators ([`workload`]), reproducing LevelDB's db_bench
//! key streams and YCSB's request distributions.

pub mod cli;
pub mod engine;
pub mod report;
pub mod run;
pub mod workload;
