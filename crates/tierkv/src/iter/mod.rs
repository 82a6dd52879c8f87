//! The read path: internal iterators, the merging iterator, and the public iterators.
//!
//! The stack follows LevelDB and Pebble (see `docs/design/read-path.md`):
//!
//! - [`InternalIterator`]: a bidirectional cursor over one *source* — a memtable, a PM
//!   structure, an SSTable, a level — in key order. Entries may be tombstones
//!   (`value() == None`). `key()`/`value()` borrow from the source (a pinned block, PM, a
//!   frozen buffer); nothing is copied to step.
//! - [`MergingIterator`]: the union of several sources, the newest first. Where sources hold
//!   the same key, the entry of the newest one is the merged entry and the others are
//!   skipped (there are no sequence numbers inside a preset: source order *is* recency).
//! - Each preset's [`crate::engine::Engine::iter`] returns its sources merged: one
//!   `InternalIterator` over the whole store as the preset sees it.
//! - [`DbIterator`] (public) lays the store's snapshot overlay ([`crate::snapshot`]) over it,
//!   hides tombstones, and applies bounds and a prefix. [`Scan`] is a forward `DbIterator`
//!   as a Rust iterator.
//!
//! Errors: a move returns `Err` and leaves the iterator invalid (LevelDB keeps a sticky
//! `status()`; a `Result` per move is the Rust form of the same contract).

mod db_iter;
mod merge;
mod vec;

pub use db_iter::{prefix_end, DbIterator, IterOptions, Scan};
pub use merge::MergingIterator;
pub use vec::VecIter;

use crate::error::Result;

/// A cursor over one source's entries in ascending key order (unsigned byte order), each
/// key at most once. Moving returns `Err` on a read or checksum failure; the iterator is
/// then invalid. `next`/`prev`/`key`/`value` require [`valid`](Self::valid).
pub trait InternalIterator: Send {
    /// True when positioned at an entry.
    fn valid(&self) -> bool;
    /// Position at the first entry with key `>= key`.
    fn seek(&mut self, key: &[u8]) -> Result<()>;
    /// Position at the first entry.
    fn seek_to_first(&mut self) -> Result<()>;
    /// Position at the last entry.
    fn seek_to_last(&mut self) -> Result<()>;
    /// Move to the following entry.
    fn next(&mut self) -> Result<()>;
    /// Move to the preceding entry.
    fn prev(&mut self) -> Result<()>;
    /// The current key.
    fn key(&self) -> &[u8];
    /// The current value; `None` for a tombstone.
    fn value(&self) -> Option<&[u8]>;

    /// Position at the last entry with key `<= key`.
    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.seek(key)?;
        if !self.valid() {
            self.seek_to_last()
        } else if self.key() > key {
            self.prev()
        } else {
            Ok(())
        }
    }
}

impl<T: InternalIterator + ?Sized> InternalIterator for Box<T> {
    fn valid(&self) -> bool {
        (**self).valid()
    }
    fn seek(&mut self, key: &[u8]) -> Result<()> {
        (**self).seek(key)
    }
    fn seek_to_first(&mut self) -> Result<()> {
        (**self).seek_to_first()
    }
    fn seek_to_last(&mut self) -> Result<()> {
        (**self).seek_to_last()
    }
    fn next(&mut self) -> Result<()> {
        (**self).next()
    }
    fn prev(&mut self) -> Result<()> {
        (**self).prev()
    }
    fn key(&self) -> &[u8] {
        (**self).key()
    }
    fn value(&self) -> Option<&[u8]> {
        (**self).value()
    }
    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        (**self).seek_for_prev(key)
    }
}

/// A boxed source, as presets hand them around.
pub type BoxedIter = Box<dyn InternalIterator>;

/// Up to `max` live entries of `[start, end)` read through `it`, in key order, tombstones
/// skipped: a bounded range scan over a preset's own iterator (tests).
#[cfg(test)]
pub(crate) fn collect_range(
    it: &mut dyn InternalIterator,
    start: std::ops::Bound<&[u8]>,
    end: std::ops::Bound<&[u8]>,
    max: usize,
) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    use std::ops::Bound;
    match start {
        Bound::Unbounded => it.seek_to_first()?,
        Bound::Included(k) => it.seek(k)?,
        Bound::Excluded(k) => {
            it.seek(k)?;
            if it.valid() && it.key() == k {
                it.next()?;
            }
        }
    }
    let mut out = Vec::new();
    while it.valid() && out.len() < max {
        let k = it.key();
        let inside = match end {
            Bound::Included(e) => k <= e,
            Bound::Excluded(e) => k < e,
            Bound::Unbounded => true,
        };
        if !inside {
            break;
        }
        if let Some(v) = it.value() {
            out.push((k.to_vec(), v.to_vec()));
        }
        it.next()?;
    }
    Ok(out)
}

/// Owned entries, tombstones as `None` (tests).
#[cfg(test)]
pub(crate) type OwnedEntries = Vec<(Vec<u8>, Option<Vec<u8>>)>;

/// A test value that names its key and version (a value under the wrong key, or a stale
/// one, is caught), `20..max_len` bytes long.
#[cfg(test)]
pub(crate) fn versioned_value(k: &[u8], ver: u64, rng: &mut impl rand::Rng, max_len: usize) -> Vec<u8> {
    let mut v = format!("{}:{ver}:", String::from_utf8_lossy(k)).into_bytes();
    let len = rng.random_range(20..max_len);
    v.resize(len.max(v.len()), b'a' + (ver % 26) as u8);
    v
}

/// Every entry of `it`, forward, tombstones included (tests of the presets' iterators).
#[cfg(test)]
pub(crate) fn collect_forward(it: &mut dyn InternalIterator) -> Result<OwnedEntries> {
    let mut out = Vec::new();
    it.seek_to_first()?;
    while it.valid() {
        out.push((it.key().to_vec(), it.value().map(<[u8]>::to_vec)));
        it.next()?;
    }
    Ok(out)
}
