//! In-memory and persistent index structures shared by the presets.

pub mod bplus;
pub mod pbtree;
pub mod rhtree;
