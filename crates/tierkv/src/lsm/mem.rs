//! The MemTable: a lock-free skiplist of versioned entries, and its iterator.
//!
//! # Why versions
//! An overwrite does not replace a key's entry: it adds one with a higher version (as
//! LevelDB's memtable keys carry a sequence number). `crossbeam-skiplist` replaces an entry
//! by first marking the old node removed and then linking the new one, so a reader between
//! the two would find *neither* and fall through to an older table's version (or resurrect
//! a deleted value). With versions, the old entry stays readable until the newer one is
//! linked: a point read returns the key's newest version at every instant, and an iterator
//! never loses a key to a concurrent overwrite. Older versions cost memory until the flush
//! (counted in `bytes`, so they also bring the flush forward) and are not written to the
//! table.
//!
//! # Keys in the node
//! A skiplist search compares the sought key with one node per step, and those nodes are
//! scattered over the heap: every comparison is a cache miss. Keys (and values) of up to
//! 24 bytes are held in the node itself, not behind a second pointer, so a comparison
//! touches one line, not two (a MemTable of 500,000 16-byte keys: a seek and ten steps
//! took 4.8 µs instead of 7.8 µs, measured apart; hoakv's ColdStore keeps its whole cold
//! key set in its 64 MiB MemTable, where `memcmp` was a fifth of its range reads' time in
//! stop 46's profile and 9 % in stop 47's, on another machine). Longer keys and values
//! spill to the heap as before. An entry is charged its node (key, version and value
//! fields, reference count, an average tower of two links) plus any spilled bytes —
//! closer to what it takes than the old charge (key + value + 48), which left out the
//! two allocations behind each entry; allocator size classes are still not counted.
//!
//! # Invariants
//! - Entries are ordered by key ascending, then version descending: the first entry of a
//!   key is its newest.
//! - Nothing is ever removed from the map: a node lives as long as the [`Mem`].
//! - Versions grow with every insert into one `Mem` (one atomic counter). Inserts of
//!   different keys may run concurrently; inserts of one key are ordered by the LSM's
//!   caller (so a key's newer write gets the higher version).
//! - A MemTable is flushed only once every writer the group commit counted on it
//!   ([`Mem::add_writers`]) has inserted its batch and released its [`WriterClaim`].

use std::borrow::Borrow;
use std::cmp::Ordering as CmpOrdering;
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_skiplist::map::Entry as SkipEntry;
use crossbeam_skiplist::SkipMap;
use smallvec::SmallVec;

use crate::error::Result;
use crate::iter::InternalIterator;

/// Key or value bytes held in the skiplist node itself up to this length; longer ones
/// spill to the heap.
const INLINE: usize = 24;

/// Key or value bytes: inline in the node up to [`INLINE`] bytes.
type Bytes = SmallVec<[u8; INLINE]>;

/// DRAM bytes charged per MemTable entry besides spilled key and value bytes: the node's
/// key, version and value fields, its reference count and height, and an average tower of
/// two links (crossbeam-skiplist's towers have 1 + geometric(1/2) levels).
const MEM_ENTRY_OVERHEAD: u64 =
    (std::mem::size_of::<MemKey>() + std::mem::size_of::<Option<Bytes>>() + 3 * std::mem::size_of::<usize>()) as u64;

/// Heap bytes a key or value of `len` bytes takes besides its node.
fn spilled(len: usize) -> u64 {
    if len > INLINE {
        len as u64
    } else {
        0
    }
}

/// A MemTable key: the user key and the entry's version. The key bytes sit in the node
/// (short keys): a skiplist search compares them without a second pointer to follow.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct MemKey {
    key: Bytes,
    ver: u64,
}

/// What the skiplist compares: a user key and a version, borrowed. Lookups compare a
/// `(&[u8], u64)` with the stored [`MemKey`]s through it, so no key is allocated to search.
pub(super) trait KeyVer {
    fn parts(&self) -> (&[u8], u64);
}

impl KeyVer for MemKey {
    fn parts(&self) -> (&[u8], u64) {
        (&self.key, self.ver)
    }
}

impl KeyVer for (&[u8], u64) {
    fn parts(&self) -> (&[u8], u64) {
        *self
    }
}

fn cmp_parts(a: (&[u8], u64), b: (&[u8], u64)) -> CmpOrdering {
    a.0.cmp(b.0).then(b.1.cmp(&a.1))
}

impl PartialEq for dyn KeyVer + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn KeyVer + '_ {}

impl PartialOrd for dyn KeyVer + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

impl Ord for dyn KeyVer + '_ {
    fn cmp(&self, other: &Self) -> CmpOrdering {
        cmp_parts(self.parts(), other.parts())
    }
}

impl PartialOrd for MemKey {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

impl Ord for MemKey {
    fn cmp(&self, other: &Self) -> CmpOrdering {
        cmp_parts(self.parts(), other.parts())
    }
}

impl<'a> Borrow<dyn KeyVer + 'a> for MemKey {
    fn borrow(&self) -> &(dyn KeyVer + 'a) {
        self
    }
}

type Entry<'a> = SkipEntry<'a, MemKey, Option<Bytes>>;

/// A MemTable: key → value (`None`: tombstone), with its WAL generation. See the module
/// docs.
pub(super) struct Mem {
    map: SkipMap<MemKey, Option<Bytes>>,
    next_ver: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) gen: u64,
    /// Writers whose batches are in this MemTable's WAL but who may not have inserted
    /// them yet (see [`Mem::add_writers`]).
    writers: AtomicUsize,
}

/// One writer's claim on a [`Mem`] it is still to insert into: released (the count taken
/// back) when dropped, after the inserts, or on a panic.
pub(super) struct WriterClaim(pub(super) Arc<Mem>);

impl Drop for WriterClaim {
    fn drop(&mut self) {
        self.0.writers.fetch_sub(1, Ordering::Release);
    }
}

impl std::fmt::Debug for Mem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mem").field("gen", &self.gen).field("bytes", &self.bytes).finish()
    }
}

impl Mem {
    pub(super) fn new(gen: u64) -> Mem {
        Mem {
            map: SkipMap::new(),
            next_ver: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            gen,
            writers: AtomicUsize::new(0),
        }
    }

    /// Count `n` writers that will insert into this MemTable (the group commit's leader,
    /// under the LSM's writer lock, for its group once their WAL records are appended).
    /// Each hands its count back by dropping a [`WriterClaim`].
    pub(super) fn add_writers(&self, n: usize) {
        self.writers.fetch_add(n, Ordering::Relaxed);
    }

    /// Wait until every writer counted by [`Mem::add_writers`] has inserted its batch (the
    /// flush, before it reads an Immutable MemTable). Writers insert without any lock, so
    /// this only waits for them to be scheduled: spin briefly, then yield.
    pub(super) fn wait_writers(&self) {
        let mut spins = 0u32;
        while self.writers.load(Ordering::Acquire) != 0 {
            if spins < 100 {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Add `k`'s newest version. Callers order inserts of one key (see the module docs).
    pub(super) fn insert(&self, k: &[u8], v: Option<&[u8]>) {
        let add = spilled(k.len()) + v.map_or(0, |v| spilled(v.len())) + MEM_ENTRY_OVERHEAD;
        let ver = self.next_ver.fetch_add(1, Ordering::Relaxed);
        self.map.insert(MemKey { key: Bytes::from_slice(k), ver }, v.map(Bytes::from_slice));
        self.bytes.fetch_add(add, Ordering::Relaxed);
    }

    /// The newest entry of `k` at or after `k` (the first entry `>= (k, newest)`).
    fn newest_at_or_after(&self, k: &[u8]) -> Option<Entry<'_>> {
        self.map.lower_bound(Bound::Included(&(k, u64::MAX) as &dyn KeyVer))
    }

    /// `k`'s newest value: `Some(None)` for a tombstone, `None` when absent.
    pub(super) fn get(&self, k: &[u8]) -> Option<Option<Vec<u8>>> {
        self.newest_at_or_after(k)
            .filter(|e| e.key().key.as_slice() == k)
            .map(|e| e.value().as_deref().map(<[u8]>::to_vec))
    }

    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Every key's newest entry, in key order (the flush).
    pub(super) fn for_each_newest(&self, mut f: impl FnMut(&[u8], Option<&[u8]>) -> Result<()>) -> Result<()> {
        let mut prev: Option<Entry<'_>> = None;
        for e in self.map.iter() {
            if prev.as_ref().is_some_and(|p| p.key().key == e.key().key) {
                continue;
            }
            f(&e.key().key, e.value().as_deref())?;
            prev = Some(e);
        }
        Ok(())
    }
}

/// An [`InternalIterator`] over one MemTable, read live, each key at its newest version:
/// keys and values are borrowed from the skiplist node the cursor holds (nodes are never
/// removed, see the module docs). A seek is one skiplist search; `next` walks the bottom
/// level past the current key's older versions; `prev` and the backward seeks search twice
/// (the previous key, then its newest version). An entry written after the cursor passed
/// its place is not seen, a later one may be.
pub struct MemIter {
    /// Borrows the map inside `mem`, which this cursor owns (see `Drop`).
    cur: Option<Entry<'static>>,
    mem: Arc<Mem>,
}

impl std::fmt::Debug for MemIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemIter").field("gen", &self.mem.gen).field("valid", &self.cur.is_some()).finish()
    }
}

impl MemIter {
    pub(super) fn new(mem: Arc<Mem>) -> MemIter {
        MemIter { cur: None, mem }
    }

    /// Keep `e` (an entry of `self.mem.map`) as the position.
    fn set(&mut self, e: Option<Entry<'_>>) {
        // SAFETY: `e` borrows the skiplist inside `self.mem`, an `Arc` this cursor owns and
        // never replaces, so the map lives (at a fixed heap address) as long as the cursor;
        // `Drop` releases the entry before the `Arc`. The `'static` entry never leaves the
        // cursor: `key`/`value` hand out borrows bounded by `&self`, and every entry made
        // from it (`clone`, moves) is stored back into `self.cur` or dropped in the method.
        let e = e.map(|e| unsafe { std::mem::transmute::<Entry<'_>, Entry<'static>>(e) });
        self.cur = e;
    }

    /// Position at the newest version of the last key `<= key` (`Included`) or `< key`
    /// (`Excluded`).
    fn back_to(&mut self, bound: Bound<&[u8]>) {
        let mem = self.mem.clone();
        // The last entry before `(key, newest)` (excluded) or up to `(key, oldest)`
        // (included) is some version of the key wanted; then its newest.
        let last = match bound {
            Bound::Included(k) => mem.map.upper_bound(Bound::Included(&(k, 0u64) as &dyn KeyVer)),
            Bound::Excluded(k) => mem.map.upper_bound(Bound::Excluded(&(k, u64::MAX) as &dyn KeyVer)),
            Bound::Unbounded => mem.map.back(),
        };
        let newest = last.and_then(|e| mem.newest_at_or_after(&e.key().key));
        self.set(newest);
    }
}

impl Drop for MemIter {
    fn drop(&mut self) {
        // The entry borrows `self.mem`'s map: release it first (field order says the same).
        self.cur = None;
    }
}

impl InternalIterator for MemIter {
    fn valid(&self) -> bool {
        self.cur.is_some()
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        let mem = self.mem.clone();
        self.set(mem.newest_at_or_after(key));
        Ok(())
    }

    fn seek_to_first(&mut self) -> Result<()> {
        let mem = self.mem.clone();
        self.set(mem.map.front());
        Ok(())
    }

    fn seek_to_last(&mut self) -> Result<()> {
        self.back_to(Bound::Unbounded);
        Ok(())
    }

    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.back_to(Bound::Included(key));
        Ok(())
    }

    fn next(&mut self) -> Result<()> {
        let Some(cur) = self.cur.take() else { return Ok(()) };
        let mut e = cur.clone();
        self.cur = loop {
            if !e.move_next() {
                break None;
            }
            if e.key().key != cur.key().key {
                break Some(e);
            }
        };
        Ok(())
    }

    fn prev(&mut self) -> Result<()> {
        let Some(cur) = self.cur.take() else { return Ok(()) };
        let mem = self.mem.clone();
        let k: &[u8] = &cur.key().key;
        let last = mem.map.upper_bound(Bound::Excluded(&(k, u64::MAX) as &dyn KeyVer));
        let newest = last.and_then(|e| mem.newest_at_or_after(&e.key().key));
        drop(cur);
        self.set(newest);
        Ok(())
    }

    fn key(&self) -> &[u8] {
        self.cur.as_ref().map_or(&[], |e| e.key().key.as_slice())
    }

    fn value(&self) -> Option<&[u8]> {
        self.cur.as_ref().and_then(|e| e.value().as_deref())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::BTreeMap;

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// Overwrites and deletes keep versions: point reads, the flush walk and the iterator
    /// see each key's newest version once, both ways (a cursor that stepped into an older
    /// version would return a key twice or an overwritten value).
    #[test]
    fn newest_versions_only_through_reads_flush_walk_and_iterator() {
        let m = Arc::new(Mem::new(1));
        let mut model: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        let mut rng = StdRng::seed_from_u64(3);
        for i in 0..3000u32 {
            // Keys of 4 to 40 bytes and values of 0 to 50: inline in the node and spilled.
            let n = rng.random_range(0..200);
            let k = format!("k{n:03}{}", "x".repeat(n % 7 * 6)).into_bytes();
            let v = rng.random_bool(0.8).then(|| {
                let mut v = format!("v{i}").into_bytes();
                v.resize(rng.random_range(0..=50), b'.');
                v
            });
            m.insert(&k, v.as_deref());
            model.insert(k, v);
        }
        for (k, v) in &model {
            assert_eq!(m.get(k).as_ref(), Some(v));
        }
        assert_eq!(m.get(b"k"), None);
        let mut walked = Vec::new();
        m.for_each_newest(|k, v| {
            walked.push((k.to_vec(), v.map(<[u8]>::to_vec)));
            Ok(())
        })
        .unwrap();
        let want: Vec<_> = model.clone().into_iter().collect();
        assert_eq!(walked, want);
        let mut it = MemIter::new(m.clone());
        let mut got = Vec::new();
        it.seek_to_first().unwrap();
        while it.valid() {
            got.push((it.key().to_vec(), it.value().map(<[u8]>::to_vec)));
            it.next().unwrap();
        }
        assert_eq!(got, want);
        got.clear();
        it.seek_to_last().unwrap();
        while it.valid() {
            got.push((it.key().to_vec(), it.value().map(<[u8]>::to_vec)));
            it.prev().unwrap();
        }
        got.reverse();
        assert_eq!(got, want);
        for _ in 0..300 {
            let n = rng.random_range(0..201);
            let mut p = format!("k{n:03}{}", "x".repeat(n % 5 * 8)).into_bytes();
            if rng.random_bool(0.3) {
                p.push(b'!');
            }
            it.seek(&p).unwrap();
            let w = model.range(p.clone()..).next();
            assert_eq!(
                it.valid().then(|| (it.key().to_vec(), it.value().map(<[u8]>::to_vec))),
                w.map(|(k, v)| (k.clone(), v.clone()))
            );
            it.seek_for_prev(&p).unwrap();
            let w = model.range(..=p.clone()).next_back();
            assert_eq!(
                it.valid().then(|| (it.key().to_vec(), it.value().map(<[u8]>::to_vec))),
                w.map(|(k, v)| (k.clone(), v.clone()))
            );
        }
    }

    /// Short keys and values live in the node and are charged as the node; longer ones are
    /// charged their heap bytes besides.
    #[test]
    fn entries_are_charged_their_node_and_spilled_bytes() {
        let m = Mem::new(1);
        let charged = || m.bytes.load(Ordering::Relaxed);
        m.insert(&[7; INLINE], Some(&[1; INLINE]));
        assert_eq!(charged(), MEM_ENTRY_OVERHEAD);
        m.insert(b"t", None);
        assert_eq!(charged(), 2 * MEM_ENTRY_OVERHEAD);
        m.insert(&[8; INLINE + 1], Some(&[2; 100]));
        assert_eq!(charged(), 3 * MEM_ENTRY_OVERHEAD + (INLINE as u64 + 1) + 100);
        assert_eq!(m.get(&[8; INLINE + 1]), Some(Some(vec![2; 100])));
        assert_eq!(m.get(&[7; INLINE]), Some(Some(vec![1; INLINE])));
        assert_eq!(m.get(b"t"), Some(None));
    }

    /// A reader never misses a key while a writer overwrites it (crossbeam's in-place
    /// replace unlinks the old node before linking the new one; versions keep both).
    #[test]
    fn a_key_being_overwritten_is_always_found() {
        let m = Arc::new(Mem::new(1));
        m.insert(b"k", Some(b"0"));
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let (m2, stop2) = (m.clone(), &stop);
            s.spawn(move || {
                for i in 1..20_000u32 {
                    m2.insert(b"k", Some(i.to_string().as_bytes()));
                }
                stop2.store(true, Ordering::Relaxed);
            });
            let mut it = MemIter::new(m.clone());
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) || reads < 1000 {
                assert!(m.get(b"k").is_some(), "a point read missed the key");
                it.seek(b"k").unwrap();
                assert!(it.valid() && it.key() == b"k", "a seek missed the key");
                reads += 1;
            }
        });
    }
}
