//! The `lightkv` preset (LightKV, MSST 2020): in progress, not yet a preset. Built so far:
//! the persistent write buffer's segment format ([`pwb`]), PM leaf copies and chain records
//! ([`leaf`]), and the store core ([`store`]: RH-Tree over PM segments, segment recycling,
//! flush of full leaves to SSTables, partition compaction, recovery by segment scan; crash
//! tested at every persist point); the RH-Tree index is [`crate::index::rhtree`]. Next:
//! scans, background threads, the preset itself. The plan is in docs/design/lightkv.md.

pub mod leaf;
pub mod pwb;
pub mod store;
