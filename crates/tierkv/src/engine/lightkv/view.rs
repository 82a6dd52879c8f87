//! The write buffer's sorted view, and the pins that let iterators read the write buffer
//! without a lock (deferred reclamation).
//!
//! # The sorted view
//! The RH-Tree's leaves are hash tables: they answer a get, never a range. [`SortedView`]
//! is a DRAM B-tree of every key a DRAM leaf (a top leaf or an unflushed linked leaf)
//! indexes, mapped to the write-buffer address of its newest record — exactly the DRAM
//! part of the store a get sees, in key order. While it is *active* it is kept on every
//! write under the state lock (one B-tree update per indexed entry; a key copy only for a
//! key new to the view), so a range read never sorts the write buffer: it seeks the view
//! in O(log n). Partitions hold disjoint keys, so one view serves every partition and
//! survives splits (which move entries between leaves, never between keys and records).
//!
//! # Built on demand, dropped when idle
//! A B-tree update costs a write about as much as the rest of a put (measured: keeping it
//! on every write halved `fillrandom`), and a store that takes no range reads has no use
//! for it. So the view starts *inactive* (writes skip it: one branch), and the first
//! iterator builds it from the DRAM leaves in one pass (every DRAM-indexed key read once,
//! one sort: [`SortedView::build`]). From then on writes keep it. Once
//! [`SortedView::idle`] — more writes since the last iterator was created than
//! `max(IDLE_WRITES, keys in the view)` — and with no iterator open, the next write drops it
//! again. A build costs O(n log n) for the n keys in DRAM and happens at most once per n
//! writes without a range read, so it adds O(log n) per write amortised, never more than
//! keeping the view would; a workload of range reads keeps it active and never sorts.
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
//!
//! # Invariants
//! - An open pin implies an active view (pins are taken after the build, under the state
//!   lock; the view is dropped only with no pin open).
//! - Active: every key a DRAM leaf indexes has a live entry naming its newest DRAM-indexed
//!   record, and every other entry is retired, waiting for an older pin.

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

/// Writes without a range read after which an unused view is dropped (at least; a larger
/// view waits for as many writes as it holds keys).
#[cfg(not(test))]
const IDLE_WRITES: u64 = 1 << 16;
/// Small in tests, so that the model tests drop and rebuild the view.
#[cfg(test)]
const IDLE_WRITES: u64 = 512;

/// The sorted view and the deferred work that waits for old iterators.
#[derive(Debug)]
pub(crate) struct SortedView {
    /// False while writes skip the view (see the module docs).
    active: bool,
    /// Writes the view took since it was built.
    writes: u64,
    /// Views built (stats, tests).
    builds: u64,
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
        SortedView {
            active: false,
            writes: 0,
            builds: 0,
            map: BTreeMap::new(),
            key_bytes: 0,
            gen: 1,
            retired: VecDeque::new(),
            frees: VecDeque::new(),
        }
    }
}

/// True when work stamped `stamp` may run: no iterator pinned at or before it is open.
fn due(stamp: u64, oldest_pin: Option<u64>) -> bool {
    oldest_pin.is_none_or(|g| g > stamp)
}

impl SortedView {
    /// True while writes keep the view (a range read may use it).
    pub(crate) fn active(&self) -> bool {
        self.active
    }

    /// Make the view active with `entries`: every DRAM-indexed key with its newest record,
    /// sorted by key, each key once.
    pub(crate) fn build(&mut self, entries: Vec<(Vec<u8>, u64)>) {
        self.key_bytes = entries.iter().map(|e| e.0.len() as u64).sum();
        // Sorted input: the B-tree is built in one pass.
        self.map = entries.into_iter().map(|(k, off)| (k, ViewEnt { off, retired: 0 })).collect();
        self.retired.clear();
        self.active = true;
        self.writes = 0;
        self.builds += 1;
    }

    /// Views built so far.
    pub(crate) fn builds(&self) -> u64 {
        self.builds
    }

    /// Writes the view has taken since it was built.
    pub(crate) fn writes(&self) -> u64 {
        self.writes
    }

    /// True when the view has gone unused long enough to drop: more writes since the last
    /// iterator was created (`writes` was [`SortedView::writes`] then) than it holds keys,
    /// and at least `IDLE_WRITES`.
    pub(crate) fn idle(&self, writes_at_last_use: u64) -> bool {
        self.active && self.writes.saturating_sub(writes_at_last_use) > IDLE_WRITES.max(self.map.len() as u64)
    }

    /// Stop keeping the view (no iterator may be open: see the invariants).
    pub(crate) fn deactivate(&mut self) {
        self.active = false;
        self.map = BTreeMap::new();
        self.retired.clear();
        self.key_bytes = 0;
    }

    /// `key`'s newest record is now at `off` (live). `known`: the key is in the view
    /// already (its top-leaf entry was updated), so no key copy or insert is needed.
    pub(crate) fn put(&mut self, key: &[u8], off: u64, known: bool) {
        if !self.active {
            return;
        }
        self.writes += 1;
        let ent = ViewEnt { off, retired: 0 };
        if known {
            if let Some(e) = self.map.get_mut(key) {
                *e = ent;
                return;
            }
        }
        // One descent: a key already present keeps its stored copy.
        if self.map.insert(key.to_vec(), ent).is_none() {
            self.key_bytes += key.len() as u64;
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
        if !self.active {
            return;
        }
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
        v.build(vec![(b"a".to_vec(), 100)]);
        v.put(b"b", 200, false);
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
        v.put(b"b", 300, true);
        v.reclaim(None);
        v.fill(Bound::Included(b"b"), false, v.gen(), 10, &mut out);
        assert_eq!(out, vec![300]);
    }

    #[test]
    fn an_inactive_view_ignores_writes_and_an_idle_one_can_be_dropped() {
        let mut v = SortedView::default();
        v.put(b"a", 100, false);
        v.retire(v.gen(), b"a", 100, None);
        assert_eq!((v.active(), v.len(), v.writes()), (false, 0, 0), "writes skip an inactive view");
        v.build(vec![(b"a".to_vec(), 100), (b"b".to_vec(), 200)]);
        assert_eq!((v.active(), v.len(), v.builds()), (true, 2, 1));
        // A "known" key missing from the view (an invariant broken) is still inserted.
        v.put(b"c", 300, true);
        let mut out = Vec::new();
        v.fill(Bound::Unbounded, true, v.gen(), 10, &mut out);
        assert_eq!(out, vec![100, 200, 300]);
        let used = v.writes();
        for i in 0..IDLE_WRITES {
            v.put(b"a", 1000 + i, true);
        }
        assert!(!v.idle(used), "idle only after more than IDLE_WRITES writes");
        v.put(b"a", 7, true);
        assert!(v.idle(used) && !v.idle(v.writes()));
        v.deactivate();
        assert_eq!((v.active(), v.len(), v.approx_bytes()), (false, 0, 0));
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
