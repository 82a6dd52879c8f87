//! The write buffer's sorted view, and the pins that let iterators read the write buffer
//! without a lock (deferred reclamation).
//!
//! # The sorted view
//! The RH-Tree's leaves are hash tables: they answer a get, never a range. [`SortedView`]
//! is a DRAM B-tree of every key a DRAM leaf (a top leaf or an unflushed linked leaf)
//! indexes, mapped to the write-buffer address of its newest record — exactly the DRAM
//! part of the store a get sees, in key order. It is kept on every write under the state
//! lock (one B-tree update per indexed entry, a key copy only for a key new to the view),
//! so a range read never sorts the write buffer: it seeks the view in O(log n).
//! Partitions hold disjoint keys, so one view serves every partition and survives splits
//! (which move entries between leaves, never between keys and records).
//!
//! # Retired entries
//! A flush moves a leaf's records into an SSTable. An iterator that pinned the table list
//! before that flush does not see the new table, so it must still find those keys in the
//! view. A flush therefore *retires* its entries with a stamp instead of removing them;
//! an iterator skips entries retired before it was created (its table list has their
//! table) and reads the others. A retired entry is removed once no iterator older than its
//! stamp remains (or at once when no iterator is open). A write to the key makes its entry
//! live again.
//!
//! # Deferred reclamation of write-buffer segments
//! Iterators borrow keys and values straight from the write buffer in PM. A segment whose
//! last record was superseded is freed at once in PM (its directory slot cleared, so a
//! crash forgets it), but its extent goes back to the PM heap — where it could be reused
//! and overwritten — only when no iterator created before the free is still open.
//!
//! # Stamps
//! `gen` counts events (flush retirements, segment frees) under the state lock; an
//! iterator's pin is the `gen` at its creation. An event stamped `s` happened after every
//! pin `g <= s` was taken and before every pin `g > s`: it waits for the pins `<= s`.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;

use parking_lot::Mutex;

/// One key of the view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ViewEnt {
    /// Write-buffer address of the newest record's entry.
    pub(crate) off: u64,
    /// 0 while a DRAM leaf indexes the record; else the stamp of the flush that put it in a
    /// table.
    pub(crate) retired: u64,
}

/// The sorted view and the deferred work that waits for old iterators.
#[derive(Debug)]
pub(crate) struct SortedView {
    map: BTreeMap<Vec<u8>, ViewEnt>,
    /// Key bytes held (for stats).
    key_bytes: u64,
    /// The next stamp (from 1: 0 means "live" in [`ViewEnt::retired`]).
    gen: u64,
    /// Retired entries waiting for removal: (stamp, key, address).
    retired: VecDeque<(u64, Vec<u8>, u64)>,
    /// Freed segment extents waiting to go back to the heap: (stamp, address, size).
    frees: VecDeque<(u64, u64, u64)>,
}

impl Default for SortedView {
    fn default() -> Self {
        SortedView { map: BTreeMap::new(), key_bytes: 0, gen: 1, retired: VecDeque::new(), frees: VecDeque::new() }
    }
}

/// True when work stamped `stamp` may run: no iterator pinned at or before it is open.
fn due(stamp: u64, oldest_pin: Option<u64>) -> bool {
    oldest_pin.is_none_or(|g| g > stamp)
}

impl SortedView {
    /// `key`'s newest record is now at `off` (live).
    pub(crate) fn put(&mut self, key: &[u8], off: u64) {
        match self.map.get_mut(key) {
            Some(e) => *e = ViewEnt { off, retired: 0 },
            None => {
                self.key_bytes += key.len() as u64;
                self.map.insert(key.to_vec(), ViewEnt { off, retired: 0 });
            }
        }
    }

    fn remove_if(&mut self, key: &[u8], want: ViewEnt) {
        if self.map.get(key) == Some(&want) {
            self.map.remove(key);
            self.key_bytes -= key.len() as u64;
        }
    }

    /// The current pin value: what an iterator created now records.
    pub(crate) fn gen(&self) -> u64 {
        self.gen
    }

    /// A stamp for an event that iterators open now must not see happen.
    pub(crate) fn stamp(&mut self) -> u64 {
        let s = self.gen;
        self.gen += 1;
        s
    }

    /// A flush (stamped `stamp`) put `key`'s record at `off` in a table: retire the entry if
    /// it is still that record's (a newer DRAM record keeps it live).
    pub(crate) fn retire(&mut self, stamp: u64, key: &[u8], off: u64, oldest_pin: Option<u64>) {
        let live = ViewEnt { off, retired: 0 };
        if due(stamp, oldest_pin) {
            self.remove_if(key, live);
        } else if let Some(e) = self.map.get_mut(key).filter(|e| **e == live) {
            e.retired = stamp;
            self.retired.push_back((stamp, key.to_vec(), off));
        }
    }

    /// The segment extent `(addr, size)` was freed by an event stamped `stamp`: returns it
    /// when it may go back to the heap now, else keeps it for [`SortedView::reclaim`].
    pub(crate) fn free_extent(&mut self, stamp: u64, addr: u64, size: u64, oldest_pin: Option<u64>) -> bool {
        if due(stamp, oldest_pin) {
            return true;
        }
        self.frees.push_back((stamp, addr, size));
        false
    }

    /// Run the deferred work no open iterator needs any more; returns the extents to give
    /// back to the heap.
    pub(crate) fn reclaim(&mut self, oldest_pin: Option<u64>) -> Vec<(u64, u64)> {
        while let Some((s, _, _)) = self.retired.front() {
            if !due(*s, oldest_pin) {
                break;
            }
            if let Some((s, k, off)) = self.retired.pop_front() {
                self.remove_if(&k, ViewEnt { off, retired: s });
            }
        }
        let mut out = Vec::new();
        while self.frees.front().is_some_and(|f| due(f.0, oldest_pin)) {
            if let Some((_, a, l)) = self.frees.pop_front() {
                out.push((a, l));
            }
        }
        out
    }

    /// True when deferred work is waiting.
    pub(crate) fn has_deferred(&self) -> bool {
        !self.retired.is_empty() || !self.frees.is_empty()
    }

    /// Up to `want` addresses from `from` on (ascending when `forward`, else descending),
    /// skipping entries retired before pin `pin` (that iterator reads them from their
    /// table).
    pub(crate) fn fill(&self, from: Bound<&[u8]>, forward: bool, pin: u64, want: usize, out: &mut Vec<u64>) {
        out.clear();
        let visible = |e: &ViewEnt| e.retired == 0 || e.retired >= pin;
        if forward {
            let r = self.map.range::<[u8], _>((from, Bound::Unbounded));
            out.extend(r.map(|(_, e)| e).filter(|e| visible(e)).map(|e| e.off).take(want));
        } else {
            let r = self.map.range::<[u8], _>((Bound::Unbounded, from)).rev();
            out.extend(r.map(|(_, e)| e).filter(|e| visible(e)).map(|e| e.off).take(want));
        }
    }

    /// Every entry (checks): key, address, retired stamp.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (&[u8], ViewEnt)> + '_ {
        self.map.iter().map(|(k, e)| (k.as_slice(), *e))
    }

    /// Keys held, retired ones included.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// DRAM the view takes, approximately (keys, B-tree slots, deferred work).
    pub(crate) fn approx_bytes(&self) -> u64 {
        self.key_bytes + self.map.len() as u64 * 56 + (self.retired.len() + self.frees.len()) as u64 * 40
    }

    /// Deferred items waiting (retired entries, extents).
    pub(crate) fn deferred(&self) -> (usize, usize) {
        (self.retired.len(), self.frees.len())
    }
}

/// The pins of open iterators: pin value → how many iterators hold it.
#[derive(Debug, Default)]
pub(crate) struct Pins(Mutex<BTreeMap<u64, usize>>);

impl Pins {
    /// Register an iterator created at `gen` (call with the state lock held, so that no
    /// event is stamped between reading `gen` and this).
    pub(crate) fn pin(&self, gen: u64) {
        *self.0.lock().entry(gen).or_insert(0) += 1;
    }

    /// An iterator pinned at `gen` is gone.
    pub(crate) fn unpin(&self, gen: u64) {
        let mut m = self.0.lock();
        if let Some(n) = m.get_mut(&gen) {
            *n -= 1;
            if *n == 0 {
                m.remove(&gen);
            }
        }
    }

    /// The oldest open pin.
    pub(crate) fn oldest(&self) -> Option<u64> {
        self.0.lock().keys().next().copied()
    }

    /// Open iterators.
    pub(crate) fn count(&self) -> usize {
        self.0.lock().values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retired_entries_stay_for_older_iterators_only() {
        let mut v = SortedView::default();
        v.put(b"a", 100);
        v.put(b"b", 200);
        let pin = v.gen();
        let s = v.stamp();
        v.retire(s, b"a", 100, Some(pin));
        // A flush of an older record of "b" leaves the newer one live.
        v.retire(s, b"b", 150, Some(pin));
        let mut out = Vec::new();
        v.fill(Bound::Unbounded, true, pin, 10, &mut out);
        assert_eq!(out, vec![100, 200], "the iterator older than the flush still sees a");
        v.fill(Bound::Unbounded, true, v.gen(), 10, &mut out);
        assert_eq!(out, vec![200], "a newer iterator reads a from its table");
        assert!(v.reclaim(Some(pin)).is_empty());
        assert_eq!(v.len(), 2);
        v.reclaim(None);
        assert_eq!(v.len(), 1);
        // A write revives a retired entry; the pending removal then leaves it alone.
        let s = v.stamp();
        v.retire(s, b"b", 200, Some(s));
        v.put(b"b", 300);
        v.reclaim(None);
        v.fill(Bound::Included(b"b"), false, v.gen(), 10, &mut out);
        assert_eq!(out, vec![300]);
    }

    #[test]
    fn extents_wait_for_every_older_pin() {
        let mut v = SortedView::default();
        let p1 = v.gen();
        let s = v.stamp();
        assert!(!v.free_extent(s, 4096, 64, Some(p1)));
        assert!(v.free_extent(s, 8192, 64, Some(v.gen())), "no iterator older than the free");
        assert!(v.reclaim(Some(p1)).is_empty());
        assert_eq!(v.reclaim(Some(s + 1)), vec![(4096, 64)]);
        assert!(!v.has_deferred());
    }
}
