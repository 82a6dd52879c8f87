//! [`VecIter`]: an [`InternalIterator`] over an owned, sorted list of entries.
//!
//! For sources that are small and copied once under their owner's lock (a partition's
//! frozen write-buffer view, the hot keys of a range) and for tests.

use std::sync::Arc;

use super::InternalIterator;
use crate::error::Result;

/// Entries sorted by key, each key once; `None` values are tombstones.
pub type Entries = Vec<(Vec<u8>, Option<Vec<u8>>)>;

/// An iterator over a shared sorted entry list (cloning the `Arc` shares it between
/// iterators without copying).
#[derive(Debug, Clone)]
pub struct VecIter {
    entries: Arc<Entries>,
    /// `entries.len()` when invalid.
    pos: usize,
}

impl VecIter {
    /// Iterate `entries`, which must be sorted by key with no key twice (debug-checked).
    pub fn new(entries: Arc<Entries>) -> VecIter {
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0), "VecIter entries must be sorted and unique");
        let pos = entries.len();
        VecIter { entries, pos }
    }

    /// Iterate an owned list (see [`VecIter::new`]).
    pub fn from_vec(entries: Entries) -> VecIter {
        VecIter::new(Arc::new(entries))
    }

    fn invalidate(&mut self) {
        self.pos = self.entries.len();
    }
}

impl InternalIterator for VecIter {
    fn valid(&self) -> bool {
        self.pos < self.entries.len()
    }
    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.pos = self.entries.partition_point(|e| e.0.as_slice() < key);
        Ok(())
    }
    fn seek_to_first(&mut self) -> Result<()> {
        self.pos = 0;
        Ok(())
    }
    fn seek_to_last(&mut self) -> Result<()> {
        self.pos = self.entries.len().checked_sub(1).unwrap_or(self.entries.len());
        Ok(())
    }
    fn next(&mut self) -> Result<()> {
        self.pos = (self.pos + 1).min(self.entries.len());
        Ok(())
    }
    fn prev(&mut self) -> Result<()> {
        match self.pos.checked_sub(1) {
            Some(p) if self.valid() => self.pos = p,
            _ => self.invalidate(),
        }
        Ok(())
    }
    fn key(&self) -> &[u8] {
        self.entries.get(self.pos).map_or(&[], |e| e.0.as_slice())
    }
    fn value(&self) -> Option<&[u8]> {
        self.entries.get(self.pos).and_then(|e| e.1.as_deref())
    }
    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        let n = self.entries.partition_point(|e| e.0.as_slice() <= key);
        match n.checked_sub(1) {
            Some(p) => self.pos = p,
            None => self.invalidate(),
        }
        Ok(())
    }
}
