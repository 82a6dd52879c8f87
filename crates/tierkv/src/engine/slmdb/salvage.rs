//! Salvage of a `slmdb` store for `tierkv repair` ([`crate::repair`]).
//!
//! BASE-BRANCH PLACEHOLDER: replaced by the real walk before this reaches main.

use crate::engine::EngineCtx;
use crate::error::{Error, Result};
use crate::repair::SalvageSink;

/// Walk the store read-only and report every intact record and every damaged one.
pub(crate) fn salvage(_ctx: &EngineCtx, _sink: &mut dyn SalvageSink) -> Result<()> {
    Err(Error::InvalidArgument("repair of slmdb is not implemented yet".into()))
}
