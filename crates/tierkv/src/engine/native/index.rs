//! The DRAM index of `native`: an ordered, lock-free-readable map from key to a chain of
//! versions, each `(sequence number, PM location of its log entry)`.
//!
//! - **Maps**: every key has one [`Slot`] (shared through an `Arc`), reachable from two
//!   maps of the `scc` crate: a `HashIndex` for point reads and writers (a lookup is one
//!   hash probe, lock-free, ~0.3 µs at 1 M keys here) and a `TreeIndex` (a lock-free B+-tree)
//!   for ordered iteration. A key is put in both when it is first written, before its first
//!   version is linked, so a reader that can see a version can find the key in either map.
//!   Overwrites touch only the slot. Keys are never removed in this version (a deleted key
//!   keeps its slot with a tombstone version). Both maps may move their entries (a hash
//!   resize, a leaf split) and hand out references to stale copies: the value is an `Arc`,
//!   so every copy points at the one slot and no update is lost.
//! - **Chain**: a slot's `head` points to its newest version; each version points to the
//!   next older one. Versions are immutable once linked (the `next` pointer aside, which only
//!   trimming cuts). Readers walk the chain under a `crossbeam_epoch` guard without any lock.
//! - **Writers of one key** take the slot's mutex for the pointer swaps only (no PM access,
//!   flush or allocation but the version itself under it). Writers of different keys never
//!   meet. A version is linked in sequence order: a writer whose sequence number is lower
//!   than the head's (it lost a race with a later writer of the same key) links its version
//!   below the newer one, so the chain is always sorted newest first.
//! - **Batches**: every version of a write batch of more than one entry shares a *gate*
//!   that opens (one release store) once the whole batch is linked; readers without a
//!   snapshot skip versions whose gate is closed, so a batch becomes visible at once.
//! - **Trimming** (reclaiming versions no reader can need): when a writer links a version
//!   it cuts the chain below the newest version with a sequence number `<= keep`, where
//!   `keep` is the smaller of the oldest live snapshot and the store's *published* sequence
//!   number (every write at or below it has completed). Every current and future snapshot
//!   reads at or above `keep`, so what is cut is unreachable by any snapshot; cut versions
//!   are freed through the epoch, after every reader that might be walking them has left.
//!   The argument that `keep` is safe is in `docs/design/native.md` ("Snapshots").
//!
//! # Invariants
//! - A chain is sorted by strictly decreasing sequence number.
//! - A version with a sequence number at or below the published sequence number has an open
//!   gate.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};
use parking_lot::Mutex;
use scc::{HashIndex, TreeIndex};

/// One version of a key.
pub(crate) struct Version {
    /// Its sequence number.
    pub seq: u64,
    /// PM address of its log entry; changes only when the log cleaner moves the entry
    /// (same bytes, same sequence number, new place).
    loc: AtomicU64,
    /// Bytes of its log entry.
    pub size: u32,
    /// A delete.
    pub tomb: bool,
    /// Set for versions of a multi-entry batch: open once the whole batch is linked.
    gate: Option<Arc<AtomicBool>>,
    next: Atomic<Version>,
}

impl Version {
    /// PM address of its log entry.
    #[inline]
    pub fn loc(&self) -> u64 {
        self.loc.load(Ordering::Acquire)
    }

    /// Visible to a reader without a snapshot (its batch, if any, is wholly linked).
    #[inline]
    pub fn visible(&self) -> bool {
        self.gate.as_ref().is_none_or(|g| g.load(Ordering::Acquire))
    }

    /// The next older version.
    #[inline]
    pub fn older<'g>(&self, guard: &'g Guard) -> Option<&'g Version> {
        let n = self.next.load(Ordering::Acquire, guard);
        // SAFETY: versions reachable from a slot under a pinned guard are freed only through
        // `defer_destroy` after they were unlinked, so they outlive `guard`.
        unsafe { n.as_ref() }
    }
}

/// The versions of one key.
pub(crate) struct Slot {
    lock: Mutex<()>,
    head: Atomic<Version>,
}

impl Slot {
    fn new() -> Slot {
        Slot { lock: Mutex::new(()), head: Atomic::null() }
    }

    /// The newest version.
    #[inline]
    pub fn head<'g>(&self, guard: &'g Guard) -> Option<&'g Version> {
        let h = self.head.load(Ordering::Acquire, guard);
        // SAFETY: as in `Version::older`.
        unsafe { h.as_ref() }
    }

    /// The newest version a reader at `at` sees: sequence number `<= at` and, for a reader
    /// without a snapshot (`at == u64::MAX`), an open gate.
    #[inline]
    pub fn find<'g>(&self, at: u64, guard: &'g Guard) -> Option<&'g Version> {
        let mut v = self.head(guard);
        while let Some(x) = v {
            if x.seq <= at && (at != u64::MAX || x.visible()) {
                return Some(x);
            }
            v = x.older(guard);
        }
        None
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // SAFETY: a slot is dropped when the last `Arc` to it goes: no map holds it and no
        // reader can reach it (readers hold a map guard, which keeps a copy of the `Arc`
        // alive), so no one walks the chain; every version is owned by the chain.
        unsafe {
            let g = epoch::unprotected();
            let mut cur = self.head.load(Ordering::Relaxed, g);
            while !cur.is_null() {
                let next = cur.deref().next.load(Ordering::Relaxed, g);
                drop(cur.into_owned());
                cur = next;
            }
        }
    }
}

/// A version to link.
#[derive(Clone)]
pub(crate) struct NewVersion {
    pub seq: u64,
    pub loc: u64,
    /// Bytes of its log entry.
    pub size: u32,
    pub tomb: bool,
    pub gate: Option<Arc<AtomicBool>>,
}

/// What linking a version displaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Linked {
    /// It is the key's newest version; the previous newest was this one (`Some((loc,
    /// size, tomb))`) or the key had none.
    Newest(Option<(u64, u32, bool)>),
    /// A newer version was already linked: this one is dead on arrival.
    Shadowed,
    /// A version with the same sequence number was already there (replay of a record seen
    /// twice): nothing linked.
    Duplicate,
}

/// The index.
pub(crate) struct Index {
    hash: HashIndex<Box<[u8]>, Arc<Slot>, foldhash::fast::RandomState>,
    tree: TreeIndex<Box<[u8]>, Arc<Slot>>,
}

/// A guard of the maps' memory (readers hold one while they use a slot reference).
pub(crate) type MapGuard = scc::Guard;

impl Index {
    pub fn new() -> Index {
        Index { hash: HashIndex::with_hasher(foldhash::fast::RandomState::default()), tree: TreeIndex::new() }
    }

    /// Keys (slots), tombstoned ones included.
    pub fn slots(&self) -> usize {
        self.hash.len()
    }

    /// The slot of `key`, if any.
    #[inline]
    pub fn get<'g>(&'g self, key: &[u8], guard: &'g MapGuard) -> Option<&'g Slot> {
        self.hash.peek(key, guard).map(|s| &**s)
    }

    /// The ordered map (iterators).
    pub fn tree(&self) -> &TreeIndex<Box<[u8]>, Arc<Slot>> {
        &self.tree
    }

    /// The slot of `key`, created (in both maps) if it has none. A new slot goes into the
    /// tree first and into the hash second: writers find slots through the hash, so no
    /// version is linked into a slot an iterator could not find.
    fn slot(&self, key: &[u8]) -> Arc<Slot> {
        {
            let g = MapGuard::new();
            if let Some(s) = self.hash.peek(key, &g) {
                return s.clone();
            }
        }
        let mine = Arc::new(Slot::new());
        let s = match self.tree.insert_sync(key.into(), mine.clone()) {
            Ok(()) => mine,
            // Another writer created it first: use its slot.
            Err(_) => {
                let g = MapGuard::new();
                match self.tree.peek(key, &g) {
                    Some(s) => s.clone(),
                    None => mine,
                }
            }
        };
        self.hash.entry_sync(key.into()).or_insert_with(|| s.clone()).get().clone()
    }

    /// Fill an empty index with one version per key: `(key, seq, loc)`, sorted by key,
    /// keys distinct, no deletes. The tree and the hash are filled by two threads at once.
    /// Nothing else may use the index meanwhile (open).
    pub fn bulk_load(&self, entries: &[(&[u8], u64, u64, u32)]) {
        let slots: Vec<Arc<Slot>> = entries
            .iter()
            .map(|&(_, seq, loc, size)| {
                let s = Slot::new();
                let v = Version { seq, loc: AtomicU64::new(loc), size, tomb: false, gate: None, next: Atomic::null() };
                s.head.store(Owned::new(v), Ordering::Release);
                Arc::new(s)
            })
            .collect();
        // Grown once, up front (held until the end: the reservation lapses when dropped).
        let _room = self.hash.reserve(entries.len());
        std::thread::scope(|s| {
            s.spawn(|| {
                for (e, slot) in entries.iter().zip(&slots) {
                    let _ = self.tree.insert_sync(e.0.into(), slot.clone());
                }
            });
            for (e, slot) in entries.iter().zip(&slots) {
                let _ = self.hash.insert_sync(e.0.into(), slot.clone());
            }
        });
    }

    /// The log cleaner moved `key`'s entry with sequence number `seq` from `from` to `to`:
    /// point the version at its new place. Returns `None` (the copy is dead) when no such
    /// version is in the chain any more, else whether it is the key's newest version (an
    /// older one is kept only for a snapshot, and its bytes are already counted dead).
    pub fn relocate(&self, key: &[u8], seq: u64, from: u64, to: u64) -> Option<bool> {
        let g = MapGuard::new();
        let slot = self.hash.peek(key, &g)?;
        let _l = slot.lock.lock();
        let eg = epoch::pin();
        let mut v = slot.head(&eg);
        let mut newest = true;
        while let Some(x) = v {
            if x.seq == seq {
                return x.loc.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire).ok().map(|_| newest);
            }
            if x.seq < seq {
                return None;
            }
            newest = false;
            v = x.older(&eg);
        }
        None
    }

    /// Whether `key` has a version with sequence number `seq` at `loc` (a live entry for the
    /// log cleaner), and whether the key has a slot at all.
    pub fn holds(&self, key: &[u8], seq: u64, loc: u64) -> (bool, bool) {
        let g = MapGuard::new();
        let Some(slot) = self.hash.peek(key, &g) else { return (false, false) };
        let eg = epoch::pin();
        let mut v = slot.head(&eg);
        while let Some(x) = v {
            if x.seq == seq {
                return (x.loc() == loc, true);
            }
            if x.seq < seq {
                break;
            }
            v = x.older(&eg);
        }
        (false, true)
    }

    /// Link `v` into `key`'s chain in sequence order, then trim the chain below the newest
    /// version `<= keep` (see the module docs).
    pub fn link(&self, key: &[u8], v: NewVersion, keep: u64) -> Linked {
        let slot = self.slot(key);
        let _l = slot.lock.lock();
        let guard = epoch::pin();
        let head = slot.head.load(Ordering::Acquire, &guard);
        let new = Owned::new(Version {
            seq: v.seq,
            loc: AtomicU64::new(v.loc),
            size: v.size,
            tomb: v.tomb,
            gate: v.gate,
            next: Atomic::null(),
        });
        // SAFETY: chain versions outlive the guard (see `Version::older`).
        let linked = match unsafe { head.as_ref() } {
            None => {
                slot.head.store(new, Ordering::Release);
                Linked::Newest(None)
            }
            Some(h) if h.seq < v.seq => {
                new.next.store(head, Ordering::Relaxed);
                slot.head.store(new, Ordering::Release);
                Linked::Newest(Some((h.loc(), h.size, h.tomb)))
            }
            Some(h) => {
                // Find the last version newer than `v`; link below it.
                let mut at = h;
                loop {
                    if at.seq == v.seq {
                        return Linked::Duplicate;
                    }
                    match at.older(&guard) {
                        Some(n) if n.seq >= v.seq => at = n,
                        _ => break,
                    }
                }
                if at.seq == v.seq {
                    return Linked::Duplicate;
                }
                new.next.store(at.next.load(Ordering::Acquire, &guard), Ordering::Relaxed);
                at.next.store(new, Ordering::Release);
                Linked::Shadowed
            }
        };
        trim(slot.head.load(Ordering::Acquire, &guard), keep, &guard);
        linked
    }
}

/// Cut the chain starting at `head` below its newest version `<= keep`; the cut versions
/// are freed once no pinned reader can hold them. Caller holds the slot lock.
fn trim(head: Shared<'_, Version>, keep: u64, guard: &Guard) {
    // SAFETY: chain versions outlive the guard (see `Version::older`).
    let mut cur = unsafe { head.as_ref() };
    while let Some(c) = cur {
        if c.seq <= keep {
            let mut rest = c.next.swap(Shared::null(), Ordering::AcqRel, guard);
            while !rest.is_null() {
                // SAFETY: `rest` was unlinked above (no new reader can reach it); readers
                // already on it are pinned, and `defer_destroy` waits for them.
                unsafe {
                    let next = rest.deref().next.load(Ordering::Acquire, guard);
                    guard.defer_destroy(rest);
                    rest = next;
                }
            }
            return;
        }
        cur = c.older(guard);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn v(seq: u64) -> NewVersion {
        NewVersion { seq, loc: seq * 100, size: 10, tomb: false, gate: None }
    }

    fn chain(ix: &Index, key: &[u8]) -> Vec<u64> {
        let g = epoch::pin();
        let mg = MapGuard::new();
        let e = ix.get(key, &mg).unwrap();
        let mut out = Vec::new();
        let mut cur = e.head(&g);
        while let Some(x) = cur {
            out.push(x.seq);
            cur = x.older(&g);
        }
        out
    }

    #[test]
    fn versions_link_in_sequence_order_and_trim_below_keep() {
        let ix = Index::new();
        assert_eq!(ix.link(b"k", v(5), 0), Linked::Newest(None));
        assert_eq!(ix.link(b"k", v(9), 0), Linked::Newest(Some((500, 10, false))));
        // A writer that lost the race links below the newer version.
        assert_eq!(ix.link(b"k", v(7), 0), Linked::Shadowed);
        assert_eq!(ix.link(b"k", v(7), 0), Linked::Duplicate);
        assert_eq!(chain(&ix, b"k"), vec![9, 7, 5]);
        // keep = 7: the newest version <= 7 stays, everything below goes.
        ix.link(b"k", v(10), 7);
        assert_eq!(chain(&ix, b"k"), vec![10, 9, 7]);
        ix.link(b"k", v(11), u64::MAX);
        assert_eq!(chain(&ix, b"k"), vec![11]);
    }

    #[test]
    fn readers_see_a_batch_only_when_its_gate_opens() {
        let ix = Index::new();
        ix.link(b"k", v(1), 0);
        let gate = Arc::new(AtomicBool::new(false));
        ix.link(b"k", NewVersion { gate: Some(gate.clone()), ..v(2) }, 0);
        let g = epoch::pin();
        let mg = MapGuard::new();
        let e = ix.get(b"k", &mg).unwrap();
        assert_eq!(e.find(u64::MAX, &g).unwrap().seq, 1);
        // A snapshot reader at 2 is only ever created once the gate is open; at 1 it sees 1.
        assert_eq!(e.find(1, &g).unwrap().seq, 1);
        gate.store(true, Ordering::Release);
        assert_eq!(e.find(u64::MAX, &g).unwrap().seq, 2);
    }
}
