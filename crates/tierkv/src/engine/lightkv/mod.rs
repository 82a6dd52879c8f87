//! The `lightkv` preset (LightKV, MSST 2020): in progress, not yet a preset. Built so far:
//! the persistent write buffer's segment format ([`pwb`]) and the write-buffer store
//! ([`store`]: RH-Tree over PM segments, segment recycling, recovery by segment scan, crash
//! tested at every persist point); the RH-Tree index is [`crate::index::rhtree`]. Next: the
//! flush of full leaves to SSTables with PM leaf copies, partition compaction, the preset
//! itself. The plan is in docs/design/lightkv.md.

pub mod leaf;
pub mod pwb;
pub mod store;
