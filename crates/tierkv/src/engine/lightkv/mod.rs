//! The `lightkv` preset (LightKV, MSST 2020): in progress. Built so far: the persistent
//! write buffer's segment format ([`pwb`]); the RH-Tree index is [`crate::index::rhtree`].
//! The engine plan is in docs/design/lightkv.md.

pub mod pwb;
