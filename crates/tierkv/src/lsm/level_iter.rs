//! [`LevelIter`]: one level >= 1 of the tree as one sorted run.

use std::sync::Arc;

use super::{Levels, TFile};
use crate::error::Result;
use crate::iter::InternalIterator;
use crate::sstable::TableIter;

/// LevelDB's two-level iterator over one level ≥ 1: its tables are sorted and do not
/// overlap, so the level is one sorted run; a seek binary-searches the tables' largest keys
/// and opens one [`TableIter`], and running off a table's end opens the next. The level
/// is read from the `Arc<Levels>` taken at creation (the tables stay pinned).
pub(super) struct LevelIter {
    levels: Arc<Levels>,
    level: usize,
    /// The table `cur` reads.
    idx: usize,
    cur: Option<TableIter>,
}

impl LevelIter {
    pub(super) fn new(levels: Arc<Levels>, level: usize) -> LevelIter {
        LevelIter { levels, level, idx: 0, cur: None }
    }

    fn files(&self) -> &[Arc<TFile>] {
        self.levels.levels.get(self.level).map_or(&[], Vec::as_slice)
    }

    /// Make table `i` the current one (kept when it is already), or none past the end.
    fn open(&mut self, i: usize) -> Option<&mut TableIter> {
        if self.cur.is_none() || self.idx != i {
            self.cur = self.files().get(i).map(|f| TableIter::new(f.table.clone(), true));
            self.idx = i;
        }
        self.cur.as_mut()
    }

    /// From table `i` on, the first entry (tables may only be empty in theory).
    fn forward_from(&mut self, mut i: usize) -> Result<()> {
        while let Some(t) = self.open(i) {
            t.seek_to_first()?;
            if t.valid() {
                return Ok(());
            }
            i += 1;
        }
        Ok(())
    }

    /// From table `i` back, the last entry.
    fn backward_from(&mut self, mut i: Option<usize>) -> Result<()> {
        while let Some(j) = i {
            if let Some(t) = self.open(j) {
                t.seek_to_last()?;
                if t.valid() {
                    return Ok(());
                }
            }
            i = j.checked_sub(1);
        }
        self.cur = None;
        Ok(())
    }

    /// Run `f` on the open table; on an error the level iterator is invalid.
    fn on_cur(&mut self, f: impl FnOnce(&mut TableIter) -> Result<()>) -> Result<()> {
        let Some(t) = self.cur.as_mut() else { return Ok(()) };
        let r = f(t);
        if r.is_err() {
            self.cur = None;
        }
        r
    }
}

impl InternalIterator for LevelIter {
    fn valid(&self) -> bool {
        self.cur.as_ref().is_some_and(TableIter::valid)
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        let i = self.files().partition_point(|f| f.meta.largest.as_slice() < key);
        match self.open(i) {
            None => Ok(()),
            Some(_) => {
                self.on_cur(|t| t.seek(key))?;
                if self.valid() {
                    Ok(())
                } else {
                    self.forward_from(i + 1)
                }
            }
        }
    }

    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        let i = self.files().partition_point(|f| f.meta.smallest.as_slice() <= key);
        let Some(j) = i.checked_sub(1) else {
            self.cur = None;
            return Ok(());
        };
        self.open(j);
        self.on_cur(|t| t.seek_for_prev(key))?;
        if self.valid() {
            Ok(())
        } else {
            self.backward_from(j.checked_sub(1))
        }
    }

    fn seek_to_first(&mut self) -> Result<()> {
        self.forward_from(0)
    }

    fn seek_to_last(&mut self) -> Result<()> {
        let n = self.files().len();
        self.backward_from(n.checked_sub(1))
    }

    fn next(&mut self) -> Result<()> {
        self.on_cur(TableIter::next)?;
        if self.cur.as_ref().is_some_and(|t| !t.valid()) {
            let i = self.idx + 1;
            self.forward_from(i)?;
        }
        Ok(())
    }

    fn prev(&mut self) -> Result<()> {
        self.on_cur(TableIter::prev)?;
        if self.cur.as_ref().is_some_and(|t| !t.valid()) {
            let i = self.idx.checked_sub(1);
            self.backward_from(i)?;
        }
        Ok(())
    }

    fn key(&self) -> &[u8] {
        self.cur.as_ref().map_or(&[], |t| t.key())
    }

    fn value(&self) -> Option<&[u8]> {
        self.cur.as_ref().and_then(|t| t.value())
    }
}
