//! The DRAM index of `native`: an ordered, lock-free-readable map from key to a chain of
//! versions, each `(sequence number, PM location of its log entry)`.
//!
//! - **Maps**: every key has one [`Slot`] (shared through an `Arc`), reachable from two
//!   maps of the `scc` crate: a `HashIndex` for point reads and writers (a lookup is one
//!   hash probe, lock-free, ~0.3 µs at 1 M keys here) and a `TreeIndex` (a lock-free B+-tree)
//!   for ordered iteration, keyed by [`TreeKey`] (the key with its first 16 bytes inline,
//!   so a search compares inside the tree's nodes instead of reading each key's heap copy). A key's slot goes into the hash when the key is first written,
//!   before its first version is linked; its tree insert is *deferred* (below). Overwrites
//!   touch only the slot. A key leaves the maps only when the capacity tier
//!   moved its newest version to disk ([`Index::remove`]): the slot is marked *gone*
//!   and taken out of both maps under its own lock and the key's *stripe* lock, which
//!   every creation of a slot also takes, so a writer never links into a slot that left
//!   the maps (it finds the mark under the slot lock and starts over) and never brings a
//!   gone slot back. Both maps may move their entries (a hash
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
//! - **Deferred tree inserts**: a B+-tree insert is the largest part of a first write of a
//!   key (measured: ~23 % of a put at 200,000 keys, most of it key comparisons), and only
//!   ordered walks need it. So the writer that creates a slot puts it in the hash and
//!   appends `(key, slot)` to one of [`PENDING`] *pending* lists (picked by key hash, so
//!   writers of different keys rarely share one); a background thread (the *inserter*,
//!   [`Index::run_inserter`]) moves pending slots into the tree. Every ordered walk
//!   ([`Index::ascending`], [`Index::descending`]) first *drains*: under the drain lock,
//!   which the inserter holds for each batch it moves, it moves every pending slot into the
//!   tree itself. A slot is appended before its first version is linked, and a version is
//!   published only after it is linked, so a walk that starts after a write was
//!   acknowledged (or published at its snapshot) finds the key: the slot is in the tree,
//!   in a list it drains, or in the batch the inserter is moving, which the drain lock
//!   makes it wait for. Slots removed meanwhile (the capacity tier) are skipped: the move
//!   checks the *gone* mark under the key's stripe, which removal holds. Two slots of one
//!   key are never both pending and not gone (a slot is created only when the key has none
//!   in the hash). Writers pay a short uncontended lock and a push; when a list grows past
//!   [`PENDING_HELP`] entries (the inserter is behind: more writers than cores), writers
//!   insert new slots into the tree themselves, as before, until the next drain, which
//!   bounds the lists without making any one writer drain thousands of them. On a
//!   many-core machine the inserter is one core's worth of tree inserts (its rate was not measured on its own); past
//!   that rate writers take over the work.
//! - **Background load** (after an open): inserting a million keys into both maps takes
//!   about a second here, far more than the rest of an open. So the open puts no key into
//!   the maps: it hands the checkpoint's entries and the log tail's winners over as two
//!   sorted arrays, the *base* ([`Index::set_base`]: the checkpoint file, mapped where the
//!   file system maps files, plus an 8-byte offset per entry; the tail's keys copied into
//!   one buffer; freed when the load ends). A tail entry wins over the checkpoint's entry
//!   of its key, which the base marks superseded. The inserter thread then moves the base
//!   into the maps, the tail's entries first, each array in key order
//!   ([`Index::load_base`]), a key at a time under its stripe, skipping keys that have a
//!   slot. (Until stop 50 the open inserted the tail's winners itself: 0.45–0.65 s of a
//!   1.7 s open after a crash that left a 242 MB tail of 1 KiB records.) Until it is done:
//!   - a point lookup ([`Index::lookup`]) that misses the hash binary-searches the base.
//!     It reads the base pointer before the hash, so a miss means the key had no slot at
//!     that moment, and its base entry was then its newest version; if the load had ended
//!     before, the slot would have been in the hash. A checkpoint's entry is verified
//!     (checksum) at every read, until its slot exists (a tail entry was verified by
//!     replay);
//!   - a writer creating a slot for a key with a base entry starts the chain with that
//!     entry, under the key's stripe (so snapshots taken before the write read it, and the
//!     write counts it as displaced); the load then skips the key;
//!   - everything that needs every key in the maps waits for the load: ordered walks
//!     (iterators, checkpoints, the capacity tier's hand, `check`), the log cleaner
//!     (liveness is judged by the index) and moves to disk. A close stops the load at a
//!     batch boundary and writes no checkpoint: the one the open loaded stays valid
//!     (every record written since lies after its resume points; nothing was cleaned or
//!     moved), so the next open loads it and replays this session's records.
//! - **Range positioning** ([`Index::ascending`], [`Index::descending`]): scc 3.8.8 positions
//!   a range at a start key by descending to a leaf and walking the leaf list back (forward,
//!   for a reverse range) until it finds a key at or below the start. When the start lies
//!   below the tree's smallest key (above its largest, reversed) that walk reaches the end
//!   of the list, and scc then retries from every child of every inner node on the path,
//!   each retry walking the list again: measured 650 ms for one such seek at 80,000 keys
//!   (`docs/design/scc-range-seek.md`), against ~1 µs for any other start. A store meets
//!   such starts often — a seek to the first key of a keyspace, a cleaner or checkpoint hand
//!   resuming after keys that left the index — so every ordered walk goes through these two
//!   functions, which read the tree's smallest (largest) key first (one descent along the
//!   edge) and start such a walk from the edge instead, skipping the keys below the start
//!   that writers may have added since. A walk from the edge uses scc's whole-tree `Iter`,
//!   not a `Range` with an unbounded start: such a `Range` starts at the edge leaf and
//!   returns nothing when that leaf is empty but still linked — which the capacity tier's
//!   removals leave behind (a removed edge leaf stays linked until a key lands in its range
//!   again) — while `Iter` steps over empty leaves.
//!
//! # Invariants
//! - A chain is sorted by strictly decreasing sequence number.
//! - A version with a sequence number at or below the published sequence number has an open
//!   gate.

use std::ops::Bound;
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
    /// Loaded from an index checkpoint: its log entry's checksum was not verified by this
    /// process yet (the next read verifies it; see `docs/design/native.md`, "Recovery").
    unverified: AtomicBool,
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

    /// Whether a read must verify its log entry's checksum first.
    #[inline]
    pub fn unverified(&self) -> bool {
        self.unverified.load(Ordering::Relaxed)
    }

    /// Its log entry's checksum was verified.
    #[inline]
    pub fn mark_verified(&self) {
        self.unverified.store(false, Ordering::Relaxed);
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
    /// CLOCK reference bit: set by reads and writes, cleared by the capacity tier's hand
    /// (a key found clear has not been used for a whole turn: it is cold).
    hot: AtomicBool,
    /// Taken out of the maps (its key's newest version moved to disk); set under `lock`.
    gone: AtomicBool,
    /// Sequence number of the version the capacity tier last moved to disk (0: none): a
    /// moved version waiting for its slot's removal is not moved again.
    pub moved: AtomicU64,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            lock: Mutex::new(()),
            head: Atomic::null(),
            hot: AtomicBool::new(true),
            gone: AtomicBool::new(false),
            moved: AtomicU64::new(0),
        }
    }

    /// A slot holding one version, as open loads it (not hot: the hand may move it at once).
    fn loaded(seq: u64, loc: u64, size: u32, tomb: bool, unverified: bool) -> Slot {
        let s = Slot::new();
        s.hot.store(false, Ordering::Relaxed);
        let v = Version {
            seq,
            loc: AtomicU64::new(loc),
            size,
            tomb,
            unverified: AtomicBool::new(unverified),
            gate: None,
            next: Atomic::null(),
        };
        s.head.store(Owned::new(v), Ordering::Release);
        s
    }

    /// Mark the key as used (a plain load first: no cache-line write when already set).
    #[inline]
    pub fn touch(&self) {
        if !self.hot.load(Ordering::Relaxed) {
            self.hot.store(true, Ordering::Relaxed);
        }
    }

    /// The CLOCK hand passes: whether the key was used since it last passed (and clear it).
    pub fn second_chance(&self) -> bool {
        self.hot.load(Ordering::Relaxed) && self.hot.swap(false, Ordering::Relaxed)
    }

    /// Taken out of the maps (see [`Index::remove`]).
    #[inline]
    pub fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
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

/// A key's version as open loads it: `(key, seq, loc, size, tomb, unverified)`.
pub(crate) type LoadEntry<'a> = (&'a [u8], u64, u64, u32, bool, bool);

/// The entries the open left for the background load (see "Background load" in the module
/// docs): a checkpoint's, read from the checkpoint file's bytes (mapped where the file
/// system maps files) through the offset of every entry in them, in key order (8 bytes
/// per key; the entries themselves are read from the file); and the log tail's winners
/// replayed after it, their keys copied into one buffer.
pub(crate) struct Base {
    /// The checkpoint file's bytes (`None`: the open loaded no checkpoint).
    buf: Option<super::checkpoint::FileBytes>,
    offs: Vec<u64>,
    /// Indexes (into `offs`, ascending) of the entries the log tail replayed after the
    /// checkpoint decided: the key's version in `tail` (or, for a key moved to disk or
    /// deleted, its absence) wins.
    superseded: Vec<usize>,
    /// The log tail's entries that get a slot, sorted by key, keys distinct: where each
    /// key lies in `tail_keys`, and its version (verified: replay checked its record).
    tail: Vec<(usize, u32, BaseEntry)>,
    tail_keys: Vec<u8>,
    /// Deletes get a slot (the capacity tier has tables they must hide).
    keep_tombs: bool,
    /// Entries that get a slot.
    wanted: usize,
}

/// A key's version in a [`Base`]: its newest when the checkpoint was written, or the
/// newest the log tail replayed after it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BaseEntry {
    pub seq: u64,
    pub loc: u64,
    /// Bytes of its log entry.
    pub size: u32,
    pub tomb: bool,
    /// Its log entry's checksum was not verified by this process (a checkpoint's or a
    /// delta's entry; a tail entry was verified by replay).
    pub unverified: bool,
}

/// A checkpoint's part of a [`Base`]: the file's bytes, where each entry starts (key
/// order, every offset parses: verified by [`super::checkpoint::for_each_entry`]), and the
/// indexes of the entries the tail superseded (ascending).
pub(crate) type CheckpointPart = (super::checkpoint::FileBytes, Vec<u64>, Vec<usize>);

impl Base {
    /// `ckpt`: the checkpoint's part, if any, with `ckpt_wanted` of its entries getting a
    /// slot; `tail`: the log tail's entries that get a slot, sorted by key, keys distinct
    /// (they win over the checkpoint's entries of their keys, which `ckpt` lists as
    /// superseded).
    pub fn new(ckpt: Option<CheckpointPart>, ckpt_wanted: usize, tail: &[LoadEntry<'_>], keep_tombs: bool) -> Base {
        let mut tail_keys = Vec::with_capacity(tail.iter().map(|e| e.0.len()).sum());
        let tail: Vec<(usize, u32, BaseEntry)> = tail
            .iter()
            .map(|&(key, seq, loc, size, tomb, unverified)| {
                let at = tail_keys.len();
                tail_keys.extend_from_slice(key);
                (at, key.len() as u32, BaseEntry { seq, loc, size, tomb, unverified })
            })
            .collect();
        let wanted = ckpt_wanted + tail.len();
        let (buf, offs, superseded) = match ckpt {
            Some((b, o, s)) => (Some(b), o, s),
            None => (None, Vec::new(), Vec::new()),
        };
        Base { buf, offs, superseded, tail, tail_keys, keep_tombs, wanted }
    }

    /// Tail entry `i`: its key and version.
    #[inline]
    fn tail_entry(&self, i: usize) -> Option<(&[u8], BaseEntry)> {
        let &(at, len, e) = self.tail.get(i)?;
        Some((self.tail_keys.get(at..at + len as usize)?, e))
    }

    /// Entry `i`: its key and version (`None` if it does not parse, which verification
    /// rules out).
    #[inline]
    fn entry(&self, i: usize) -> Option<(&[u8], BaseEntry)> {
        let at = usize::try_from(*self.offs.get(i)?).ok()?;
        let (key, seq, loc, size, tomb) = super::checkpoint::entry_at(self.buf.as_ref()?.bytes(), at).ok()?;
        Some((key, BaseEntry { seq, loc, size, tomb, unverified: true }))
    }

    /// The entry of `key` that gets a slot, if any (binary searches: the tail's entries
    /// first, which win over the checkpoint's).
    pub fn find(&self, key: &[u8]) -> Option<BaseEntry> {
        let (mut lo, mut hi) = (0usize, self.tail.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let (k, e) = self.tail_entry(mid)?;
            match k.cmp(key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(e),
            }
        }
        let (mut lo, mut hi) = (0usize, self.offs.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let (k, e) = self.entry(mid)?;
            match k.cmp(key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => {
                    let wanted = self.superseded.binary_search(&mid).is_err() && (!e.tomb || self.keep_tombs);
                    return wanted.then_some(e);
                }
            }
        }
        None
    }

    /// Entries that get a slot.
    pub fn wanted_count(&self) -> usize {
        self.wanted
    }
}

/// What a point lookup found (see [`Index::lookup`]).
pub(crate) enum Found<'g> {
    /// The key's slot.
    Slot(&'g Slot),
    /// The key's entry in the base the background load fills the maps from (a
    /// checkpoint's, a delta's or the replayed tail's), not loaded yet: its newest version.
    Base(BaseEntry),
}

/// Where the background load is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoadState {
    Loading,
    Done,
    /// Stopped by a close before it finished.
    Abandoned,
}

/// Entries the background load moves per batch (between checks of the stop flag).
const LOAD_BATCH: usize = 1024;

/// Stripes of the slot-creation lock.
const STRIPES: usize = 256;

/// Pending lists of slots waiting for their tree insert (at most 64: one bit each in
/// `Index::nonempty`).
pub(crate) const PENDING: usize = 64;

/// A pending list this long makes writers insert into the tree themselves until the next
/// drain (the inserter is behind).
pub(crate) const PENDING_HELP: usize = 4096;

/// A slot waiting for its tree insert.
type PendingSlot = (Box<[u8]>, Arc<Slot>);

#[repr(align(64))]
#[derive(Default)]
struct PendingList(Mutex<Vec<PendingSlot>>);

#[repr(align(64))]
#[derive(Default)]
struct Stripe(Mutex<()>);

/// The index.
pub(crate) struct Index {
    hash: HashIndex<Box<[u8]>, Arc<Slot>, foldhash::fast::RandomState>,
    tree: TreeIndex<TreeKey, Arc<Slot>>,
    /// Creation and removal of a key's slot hold its stripe (by key hash).
    stripes: Box<[Stripe]>,
    hasher: foldhash::fast::FixedState,
    /// Slots not yet in the tree (see "Deferred tree inserts").
    pending: Box<[PendingList]>,
    /// Bit `i`: pending list `i` may hold slots (set by the writer that finds it empty).
    nonempty: AtomicU64,
    /// Held while pending slots move into the tree.
    drain: Mutex<()>,
    /// Set by a writer whose pending list passed [`PENDING_HELP`]: until the next drain,
    /// writers insert new slots into the tree themselves.
    behind: AtomicBool,
    /// The inserter sleeps until a writer wakes it.
    parked: AtomicBool,
    /// The inserter thread, once it runs (for waking it).
    inserter: std::sync::OnceLock<std::thread::Thread>,
    /// Slots moved into the tree by the inserter / by walks and writers draining.
    pub moved_by_inserter: AtomicU64,
    pub moved_by_drains: AtomicU64,
    /// A checkpoint's entries not yet in the maps (null: none; see "Background load").
    base: Atomic<Base>,
    /// Set while `base` may be non-null (cleared after the load swapped it out).
    loading: AtomicBool,
    load_state: Mutex<LoadState>,
    load_cv: parking_lot::Condvar,
    /// Slots the background load created / reads served from the base.
    pub loaded_by_load: AtomicU64,
    pub base_reads: AtomicU64,
    /// Callers of [`Index::wait_loaded`] that found the load running and waited.
    pub load_waits: AtomicU64,
}

/// An ordered walk of the tree: whole-tree or positioned (see "Range positioning").
type Walk<'g> = Box<dyn Iterator<Item = (&'g TreeKey, &'g Arc<Slot>)> + 'g>;

/// The first 16 bytes of `key` as two big-endian integers, zero-padded: comparing heads
/// orders keys as comparing the keys would, up to ties (see [`TreeKey`]).
pub(crate) fn head(key: &[u8]) -> (u64, u64) {
    let mut b = [0u8; 16];
    let n = key.len().min(16);
    b[..n].copy_from_slice(&key[..n]);
    let v = u128::from_be_bytes(b);
    ((v >> 64) as u64, v as u64)
}

/// Byte order of two keys given their heads: the heads decide unless they tie; on a tie
/// two keys of at most 16 bytes differ only in length (the shorter is the other's prefix,
/// padded with zeros), and longer keys compare in full.
pub(crate) fn cmp_keys(a: (u64, u64), ak: &[u8], b: (u64, u64), bk: &[u8]) -> std::cmp::Ordering {
    a.cmp(&b).then_with(|| if ak.len() <= 16 && bk.len() <= 16 { ak.len().cmp(&bk.len()) } else { ak.cmp(bk) })
}

/// A key of the tree: the key with its [`head`] inline. The tree's searches compare keys
/// at every node; comparing heads reads the node alone, where comparing the keys read each
/// key's heap copy — a cache miss per comparison. Measured on this machine (1,000,000
/// random 16-byte keys, `scc::TreeIndex` alone, three rounds while another benchmark ran):
/// insert 2.2–2.9 µs per key with the boxed key, 1.3–2.0 µs with the head inline; lookup
/// 2.0–2.8 vs 1.5–1.6 µs. 16 more bytes per tree entry.
#[derive(Clone, Debug)]
pub(crate) struct TreeKey {
    head: (u64, u64),
    key: Box<[u8]>,
}

impl TreeKey {
    fn new(key: Box<[u8]>) -> TreeKey {
        TreeKey { head: head(&key), key }
    }

    /// The key.
    pub(crate) fn key(&self) -> &[u8] {
        &self.key
    }
}

impl PartialEq for TreeKey {
    fn eq(&self, o: &TreeKey) -> bool {
        self.head == o.head && self.key == o.key
    }
}

impl Eq for TreeKey {}

impl Ord for TreeKey {
    fn cmp(&self, o: &TreeKey) -> std::cmp::Ordering {
        cmp_keys(self.head, &self.key, o.head, &o.key)
    }
}

impl PartialOrd for TreeKey {
    fn partial_cmp(&self, o: &TreeKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// A borrowed key to search the tree with (its head computed once per search).
struct Probe<'a> {
    head: (u64, u64),
    key: &'a [u8],
}

impl<'a> Probe<'a> {
    fn new(key: &'a [u8]) -> Probe<'a> {
        Probe { head: head(key), key }
    }
}

impl scc::Equivalent<TreeKey> for Probe<'_> {
    fn equivalent(&self, k: &TreeKey) -> bool {
        self.head == k.head && *self.key == *k.key
    }
}

impl scc::Comparable<TreeKey> for Probe<'_> {
    fn compare(&self, k: &TreeKey) -> std::cmp::Ordering {
        cmp_keys(self.head, self.key, k.head, &k.key)
    }
}

/// A guard of the maps' memory (readers hold one while they use a slot reference).
pub(crate) type MapGuard = scc::Guard;

impl Index {
    pub fn new() -> Index {
        Index {
            hash: HashIndex::with_hasher(foldhash::fast::RandomState::default()),
            tree: TreeIndex::new(),
            stripes: (0..STRIPES).map(|_| Stripe::default()).collect(),
            hasher: foldhash::fast::FixedState::default(),
            pending: (0..PENDING).map(|_| PendingList::default()).collect(),
            nonempty: AtomicU64::new(0),
            drain: Mutex::new(()),
            behind: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            inserter: std::sync::OnceLock::new(),
            moved_by_inserter: AtomicU64::new(0),
            moved_by_drains: AtomicU64::new(0),
            base: Atomic::null(),
            loading: AtomicBool::new(false),
            load_state: Mutex::new(LoadState::Done),
            load_cv: parking_lot::Condvar::new(),
            loaded_by_load: AtomicU64::new(0),
            base_reads: AtomicU64::new(0),
            load_waits: AtomicU64::new(0),
        }
    }

    /// Hand the index a checkpoint's entries to load in the background ([`Index::load_base`]);
    /// until then lookups and new slots consult them. Open calls this before the store
    /// serves anything.
    pub fn set_base(&self, base: Base) {
        *self.load_state.lock() = LoadState::Loading;
        self.base.store(Owned::new(base), Ordering::Release);
        self.loading.store(true, Ordering::Release);
    }

    /// Whether every entry of the base is in the maps (or there was none).
    pub fn loaded(&self) -> bool {
        !self.loading.load(Ordering::Acquire) || *self.load_state.lock() == LoadState::Done
    }

    /// Mark a load that will not finish (its thread never ran, or stopped abnormally) as
    /// abandoned, waking whoever waits for it. No effect once done.
    pub fn abandon_load(&self) {
        let mut st = self.load_state.lock();
        if *st == LoadState::Loading {
            *st = LoadState::Abandoned;
            self.load_cv.notify_all();
        }
    }

    /// Wait until the base is loaded. `Error::Closed` if the load was stopped by a close
    /// (the maps then lack keys: nothing may walk them or judge a key by its absence).
    pub fn wait_loaded(&self) -> crate::error::Result<()> {
        if !self.loading.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut st = self.load_state.lock();
        if *st == LoadState::Loading {
            self.load_waits.fetch_add(1, Ordering::Relaxed);
        }
        while *st == LoadState::Loading {
            self.load_cv.wait(&mut st);
        }
        match *st {
            LoadState::Done => Ok(()),
            _ => Err(crate::error::Error::Closed),
        }
    }

    /// The background load: move every wanted base entry into both maps, in key order,
    /// a key at a time under its stripe, skipping keys that have a slot already (a writer
    /// made one, starting its chain with the base entry). Stops at a batch boundary when
    /// `stop` is set (the close then writes no checkpoint: the one loaded stays valid).
    /// Returns the slots it created.
    pub fn load_base(&self, stop: &AtomicBool, probe: Option<&crate::jobs::JobProbe>) -> u64 {
        // SAFETY: only this function unlinks and frees the base (and `Drop`, which cannot
        // run while `&self` is borrowed), so it outlives this call without a pin (a pin
        // held for the whole load would hold back the reclamation of trimmed versions).
        let Some(base) = (unsafe { self.base.load(Ordering::Acquire, epoch::unprotected()).as_ref() }) else {
            return 0;
        };
        let _room = self.hash.reserve(base.wanted_count());
        let mut made = 0u64;
        let mut skip = base.superseded.iter().peekable();
        // The tail's entries first (positions `0..tail`), then the checkpoint's.
        let (tail, total) = (base.tail.len(), base.tail.len() + base.offs.len());
        let mut i = 0;
        while i < total {
            let go = probe.is_none_or(|p| p.load_batch(&|| stop.load(Ordering::Acquire)));
            if !go || stop.load(Ordering::Acquire) {
                *self.load_state.lock() = LoadState::Abandoned;
                self.load_cv.notify_all();
                return made;
            }
            let end = (i + LOAD_BATCH).min(total);
            for j in i..end {
                let (key, e) = if j < tail {
                    let Some(te) = base.tail_entry(j) else { continue };
                    te
                } else {
                    if skip.next_if_eq(&&(j - tail)).is_some() {
                        continue;
                    }
                    let Some((key, e)) = base.entry(j - tail) else { continue };
                    if e.tomb && !base.keep_tombs {
                        continue;
                    }
                    (key, e)
                };
                let _stripe = self.stripe(key).lock();
                {
                    let g = MapGuard::new();
                    if self.hash.peek(key, &g).is_some() {
                        continue;
                    }
                }
                let slot = Arc::new(Slot::loaded(e.seq, e.loc, e.size, e.tomb, e.unverified));
                let _ = self.tree.insert_sync(TreeKey::new(key.into()), slot.clone());
                let _ = self.hash.insert_sync(key.into(), slot);
                made += 1;
            }
            self.loaded_by_load.store(made, Ordering::Relaxed);
            i = end;
        }
        // Every wanted entry is in the maps: lookups stop consulting the base.
        let g = epoch::pin();
        let old = self.base.swap(Shared::null(), Ordering::AcqRel, &g);
        self.loading.store(false, Ordering::Release);
        // SAFETY: `old` is unlinked; readers that loaded it hold a pin, so it is freed
        // after they leave.
        unsafe { g.defer_destroy(old) };
        *self.load_state.lock() = LoadState::Done;
        self.load_cv.notify_all();
        made
    }

    /// The unloaded base entry of `key` that gets a slot, if the load is not done.
    fn base_entry(&self, key: &[u8]) -> Option<BaseEntry> {
        if !self.loading.load(Ordering::Acquire) {
            return None;
        }
        let g = epoch::pin();
        let b = self.base.load(Ordering::Acquire, &g);
        // SAFETY: a base is freed only through `defer_destroy` after it was unlinked, so
        // it outlives the pin.
        unsafe { b.as_ref() }.and_then(|b| b.find(key))
    }

    /// Where `key`'s newest versions are: its slot, or (while the background load runs)
    /// its checkpoint entry (see "Background load" in the module docs for why the base
    /// pointer is read before the hash).
    #[inline]
    pub fn lookup<'g>(&'g self, key: &[u8], mg: &'g MapGuard) -> Option<Found<'g>> {
        if !self.loading.load(Ordering::Acquire) {
            return self.hash.peek(key, mg).map(|s| Found::Slot(s));
        }
        self.lookup_loading(key, mg)
    }

    #[cold]
    fn lookup_loading<'g>(&'g self, key: &[u8], mg: &'g MapGuard) -> Option<Found<'g>> {
        let eg = epoch::pin();
        let b = self.base.load(Ordering::Acquire, &eg);
        if let Some(s) = self.hash.peek(key, mg) {
            return Some(Found::Slot(s));
        }
        // SAFETY: as in `base_entry`.
        let e = unsafe { b.as_ref() }.and_then(|b| b.find(key))?;
        self.base_reads.fetch_add(1, Ordering::Relaxed);
        Some(Found::Base(e))
    }

    /// Move every slot pending when this is called into the tree (and wait for the ones
    /// the inserter is moving). Returns how many this call moved. Callers hold no stripe.
    pub fn drain(&self) -> usize {
        let _d = self.drain.lock();
        self.drain_locked()
    }

    /// [`Index::drain`] with the drain lock held.
    fn drain_locked(&self) -> usize {
        let bits = self.nonempty.swap(0, Ordering::AcqRel);
        if bits == 0 {
            self.behind.store(false, Ordering::Relaxed);
            return 0;
        }
        let mut moved = 0;
        let mut batch = Vec::new();
        for i in 0..PENDING {
            if bits & (1 << i) == 0 {
                continue;
            }
            std::mem::swap(&mut *self.pending[i].0.lock(), &mut batch);
            moved += batch.len();
            for (key, slot) in batch.drain(..) {
                let _stripe = self.stripe(&key).lock();
                // A slot removed while pending stays out (removal holds the stripe).
                if !slot.gone.load(Ordering::Acquire) {
                    let r = self.tree.insert_sync(TreeKey::new(key), slot);
                    debug_assert!(r.is_ok(), "a key had two live slots");
                }
            }
        }
        self.behind.store(false, Ordering::Relaxed);
        moved
    }

    /// Before an ordered walk: every slot created before now is in the tree.
    #[inline]
    fn drain_for_walk(&self) {
        let n = self.drain();
        if n > 0 {
            self.moved_by_drains.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// The inserter: move pending slots into the tree until `stop` is set. Polls every
    /// 100 µs while writes come; after ~6 ms without any it sleeps until a writer wakes it
    /// (or 50 ms pass: a missed wake-up only delays inserts, which walks drain anyway).
    ///
    /// `tick` runs once per round (the engine's other light background work).
    pub fn run_inserter(&self, stop: &AtomicBool, mut tick: impl FnMut()) {
        let mut idle = 0u32;
        while !stop.load(Ordering::Acquire) {
            let n = self.drain();
            tick();
            if n > 0 {
                self.moved_by_inserter.fetch_add(n as u64, Ordering::Relaxed);
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < 64 {
                std::thread::park_timeout(std::time::Duration::from_micros(100));
            } else {
                self.parked.store(true, Ordering::SeqCst);
                if self.nonempty.load(Ordering::SeqCst) == 0 && !stop.load(Ordering::Acquire) {
                    std::thread::park_timeout(std::time::Duration::from_millis(50));
                }
                self.parked.store(false, Ordering::Relaxed);
            }
        }
    }

    /// The inserter thread (for waking it).
    pub fn set_inserter(&self, t: std::thread::Thread) {
        let _ = self.inserter.set(t);
    }

    /// Wake the inserter (to stop it, or when work arrives while it sleeps).
    pub fn wake_inserter(&self) {
        if let Some(t) = self.inserter.get() {
            t.unpark();
        }
    }

    /// Queue a new slot for its tree insert. Caller holds the key's stripe.
    fn defer_insert(&self, key: &[u8], slot: Arc<Slot>, h: u64) {
        let i = (h >> 32) as usize % PENDING;
        let was_empty = {
            let mut l = self.pending[i].0.lock();
            let was_empty = l.is_empty();
            l.push((key.into(), slot));
            // Set under the list's lock, so that outside a drain every non-empty list has
            // its bit (a list found non-empty had its bit set by the writer that filled it).
            if was_empty {
                self.nonempty.fetch_or(1 << i, Ordering::AcqRel);
            }
            // Under the list lock too: a drain that empties this list afterwards clears it.
            if l.len() >= PENDING_HELP && !self.behind.load(Ordering::Relaxed) {
                self.behind.store(true, Ordering::Relaxed);
            }
            was_empty
        };
        if was_empty && self.parked.load(Ordering::Relaxed) {
            self.wake_inserter();
        }
    }

    fn stripe(&self, key: &[u8]) -> &Mutex<()> {
        self.stripe_of(self.key_hash(key))
    }

    #[inline]
    fn key_hash(&self, key: &[u8]) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(key)
    }

    #[inline]
    fn stripe_of(&self, h: u64) -> &Mutex<()> {
        &self.stripes[h as usize % STRIPES].0
    }

    /// Keys (slots), tombstoned ones included.
    pub fn slots(&self) -> usize {
        self.hash.len()
    }

    /// The slot of `key`, if any (tests; readers use [`Index::lookup`]).
    #[cfg(test)]
    pub fn get<'g>(&'g self, key: &[u8], guard: &'g MapGuard) -> Option<&'g Slot> {
        self.hash.peek(key, guard).map(|s| &**s)
    }

    /// Keys in ascending order from `from` on (see "Range positioning" in the module docs).
    pub fn ascending<'g>(
        &'g self,
        from: Bound<&'g [u8]>,
        guard: &'g MapGuard,
    ) -> crate::error::Result<impl Iterator<Item = (&'g [u8], &'g Arc<Slot>)> + 'g> {
        self.prepare_walk()?;
        Ok(self.ascending_drained(from, guard))
    }

    /// What [`Index::ascending`] does before it walks: wait for the load, then drain, so
    /// every slot whose creation this call is ordered after (by a lock both took, as a
    /// checkpoint's step 1 takes every shard) is in the tree, unless removed since.
    pub fn prepare_walk(&self) -> crate::error::Result<()> {
        self.wait_loaded()?;
        self.drain_for_walk();
        Ok(())
    }

    /// [`Index::ascending`] without its drain: the tree as it is, so only for a caller
    /// that called [`Index::prepare_walk`] after every slot it needs was created. A
    /// checkpoint walks in chunks and needs only the slots that existed at its step 1:
    /// it drains once, after step 1, not once per chunk (under many writers a drain per
    /// chunk waited for the drain lock and moved the writers' new slots, chunk after
    /// chunk: eight writers on two cores kept one checkpoint from finishing for seconds).
    pub fn ascending_drained<'g>(
        &'g self,
        from: Bound<&'g [u8]>,
        guard: &'g MapGuard,
    ) -> impl Iterator<Item = (&'g [u8], &'g Arc<Slot>)> + 'g {
        let from_edge = match from {
            Bound::Included(k) | Bound::Excluded(k) => {
                self.tree.iter(guard).next().is_none_or(|(min, _)| k <= min.key())
            }
            Bound::Unbounded => true,
        };
        let walk: Walk<'g> = if from_edge {
            Box::new(self.tree.iter(guard))
        } else {
            Box::new(self.tree.range::<Probe<'_>, _>((from.map(Probe::new), Bound::Unbounded), guard))
        };
        walk.map(|(k, s)| (k.key(), s)).skip_while(move |(k, _)| match from {
            Bound::Included(f) => *k < f,
            Bound::Excluded(f) => *k <= f,
            Bound::Unbounded => false,
        })
    }

    /// Keys in descending order from `to` down (see "Range positioning" in the module docs).
    pub fn descending<'g>(
        &'g self,
        to: Bound<&'g [u8]>,
        guard: &'g MapGuard,
    ) -> crate::error::Result<impl Iterator<Item = (&'g [u8], &'g Arc<Slot>)> + 'g> {
        self.wait_loaded()?;
        self.drain_for_walk();
        let from_edge = match to {
            Bound::Included(k) | Bound::Excluded(k) => {
                self.tree.iter(guard).next_back().is_none_or(|(max, _)| k >= max.key())
            }
            Bound::Unbounded => true,
        };
        let walk: Walk<'g> = if from_edge {
            Box::new(self.tree.iter(guard).rev())
        } else {
            Box::new(self.tree.range::<Probe<'_>, _>((Bound::Unbounded, to.map(Probe::new)), guard).rev())
        };
        Ok(walk.map(|(k, s)| (k.key(), s)).skip_while(move |(k, _)| match to {
            Bound::Included(t) => *k > t,
            Bound::Excluded(t) => *k >= t,
            Bound::Unbounded => false,
        }))
    }

    /// The slot of `key`, created if it has none. A new slot goes where walks find it (a
    /// pending list, or the tree when the inserter is behind) first and into the hash
    /// second: writers find slots through the hash, so no version is linked into a slot an
    /// iterator could not find. Creation holds the key's stripe, as removal does: a slot
    /// found under it is in the hash and not gone.
    fn slot(&self, key: &[u8]) -> Arc<Slot> {
        {
            let g = MapGuard::new();
            if let Some(s) = self.hash.peek(key, &g) {
                if !s.gone.load(Ordering::Acquire) {
                    return s.clone();
                }
            }
        }
        let h = self.key_hash(key);
        let _stripe = self.stripe_of(h).lock();
        {
            let g = MapGuard::new();
            if let Some(s) = self.hash.peek(key, &g) {
                return s.clone();
            }
        }
        // A key whose checkpoint entry is not loaded yet starts its chain with it (older
        // snapshots read it; linking reports it displaced). The load, under this stripe
        // too, then finds the slot and skips the entry.
        let mine = match self.base_entry(key) {
            Some(e) => {
                let s = Slot::loaded(e.seq, e.loc, e.size, e.tomb, e.unverified);
                s.hot.store(true, Ordering::Relaxed);
                Arc::new(s)
            }
            None => Arc::new(Slot::new()),
        };
        // Under the stripe no other live slot of `key` is in the hash, the tree or a
        // pending list (removal takes a slot out of both maps and marks it gone before it
        // lets the stripe go), so the insert succeeds and the deferred one will.
        if self.behind.load(Ordering::Relaxed) {
            // The inserter is behind (more writers than cores): insert as the writer.
            let _ = self.tree.insert_sync(TreeKey::new(key.into()), mine.clone());
            let _ = self.hash.insert_sync(key.into(), mine.clone());
        } else {
            // Pending first, hash second: other writers find the slot through the hash
            // without the stripe and may link and publish a version at once, so the slot
            // must already be where a walk's drain finds it (a drain that takes it now waits
            // for this stripe before its tree insert).
            self.defer_insert(key, mine.clone(), h);
            let _ = self.hash.insert_sync(key.into(), mine.clone());
        }
        mine
    }

    /// Take `key`'s slot out of both maps if its newest version is still the one with
    /// sequence number `seq` (the capacity tier moved it to disk). Returns the version's
    /// `(loc, size, tomb)` when the slot was removed (its log entry is dead now), else
    /// `None` (the key was written since: the slot stays and shadows the disk copy).
    pub fn remove(&self, key: &[u8], seq: u64) -> Option<(u64, u32, bool)> {
        let _stripe = self.stripe(key).lock();
        let slot = {
            let g = MapGuard::new();
            self.hash.peek(key, &g)?.clone()
        };
        let _l = slot.lock.lock();
        let eg = epoch::pin();
        let head = slot.head(&eg)?;
        if head.seq != seq {
            return None;
        }
        let out = (head.loc(), head.size, head.tomb);
        slot.gone.store(true, Ordering::Release);
        self.hash.remove_if_sync(key, |s| Arc::ptr_eq(s, &slot));
        self.tree.remove_if_sync(&Probe::new(key), |s| Arc::ptr_eq(s, &slot));
        Some(out)
    }

    /// Note that `key`'s version `seq` was moved to disk (see [`Slot::moved`]).
    pub fn mark_moved(&self, key: &[u8], seq: u64) {
        let g = MapGuard::new();
        if let Some(s) = self.hash.peek(key, &g) {
            s.moved.store(seq, Ordering::Relaxed);
        }
    }

    /// The sequence number of `key`'s newest version, if it has a slot.
    pub fn newest_seq(&self, key: &[u8]) -> Option<u64> {
        let g = MapGuard::new();
        let slot = self.hash.peek(key, &g)?;
        let eg = epoch::pin();
        slot.head(&eg).map(|h| h.seq)
    }

    /// The log cleaner moved `key`'s entry with sequence number `seq` from `from` to `to`:
    /// point the version at its new place. Returns `None` (the copy is dead) when no such
    /// version is in the chain any more, else whether it is the key's newest version (an
    /// older one is kept only for a snapshot, and its bytes are already counted dead).
    /// `size` is the copied entry's length: the version is marked verified only when its
    /// own size agrees (else a reader verifies it and reports the disagreement).
    pub fn relocate(&self, key: &[u8], seq: u64, from: u64, to: u64, size: u32) -> Option<bool> {
        let g = MapGuard::new();
        let slot = self.hash.peek(key, &g)?;
        let _l = slot.lock.lock();
        let eg = epoch::pin();
        let mut v = slot.head(&eg);
        let mut newest = true;
        while let Some(x) = v {
            if x.seq == seq {
                let moved = x.loc.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire).is_ok();
                if moved && x.size == size {
                    // The cleaner verified the record it copied.
                    x.mark_verified();
                }
                return moved.then_some(newest);
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
        if slot.gone.load(Ordering::Acquire) {
            // Removed after we found it: start over with a new slot (the disk copy the
            // removal left is older than `v`).
            drop(_l);
            return self.link(key, v, keep);
        }
        slot.touch();
        let guard = epoch::pin();
        let head = slot.head.load(Ordering::Acquire, &guard);
        let new = Owned::new(Version {
            seq: v.seq,
            loc: AtomicU64::new(v.loc),
            size: v.size,
            tomb: v.tomb,
            unverified: AtomicBool::new(false),
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

impl Drop for Index {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no reader holds the index, so an unloaded base (a load
        // stopped by a close) is freed here and nowhere else.
        unsafe {
            let b = self.base.swap(Shared::null(), Ordering::AcqRel, epoch::unprotected());
            if !b.is_null() {
                drop(b.into_owned());
            }
        }
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

    fn bound(kind: u8, k: &[u8]) -> Bound<&[u8]> {
        match kind % 3 {
            0 => Bound::Included(k),
            1 => Bound::Excluded(k),
            _ => Bound::Unbounded,
        }
    }

    proptest::proptest! {
        /// Ordered walks from any start — below the smallest key, above the largest, on a
        /// key, between keys, after keys left the index — give what a `BTreeSet` gives.
        #[test]
        fn ordered_walks_match_a_model(
            keys in proptest::collection::vec(0u16..2000, 0..300),
            gone in proptest::collection::vec(0u16..2000, 0..300),
            starts in proptest::collection::vec((0u16..2100, 0u8..3), 1..20),
        ) {
            let ix = Index::new();
            let mut model = std::collections::BTreeSet::new();
            for k in &keys {
                ix.link(&k.to_be_bytes(), v(1), 0);
                model.insert(k.to_be_bytes().to_vec());
            }
            for k in &gone {
                if model.remove(k.to_be_bytes().as_slice()) {
                    proptest::prop_assert!(ix.remove(&k.to_be_bytes(), 1).is_some());
                }
            }
            let mg = MapGuard::new();
            for (s, kind) in &starts {
                let sk = s.to_be_bytes();
                let b = bound(*kind, &sk);
                let want: Vec<&Vec<u8>> = model.range::<[u8], _>((b, Bound::Unbounded)).collect();
                let got: Vec<&[u8]> = ix.ascending(b, &mg).unwrap().map(|(k, _)| k).collect();
                proptest::prop_assert_eq!(got.len(), want.len());
                proptest::prop_assert!(got.iter().zip(&want).all(|(g, w)| *g == &w[..]));
                let want: Vec<&Vec<u8>> = model.range::<[u8], _>((Bound::Unbounded, b)).rev().collect();
                let got: Vec<&[u8]> = ix.descending(b, &mg).unwrap().map(|(k, _)| k).collect();
                proptest::prop_assert_eq!(got.len(), want.len());
                proptest::prop_assert!(got.iter().zip(&want).all(|(g, w)| *g == &w[..]));
            }
        }
    }

    /// Keys whose heads tie: up to 16 bytes of one shared prefix, then up to 8 bytes from
    /// {0x00, 0x01, 0xff} (a key and the same key with zeros appended; keys sharing 16
    /// bytes and differing after them).
    fn tie_keys() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let tail = proptest::collection::vec(prop_oneof![Just(0u8), Just(1u8), Just(0xffu8)], 0..8);
        (prop_oneof![Just(16usize), 0usize..=16], tail).prop_map(|(n, tail)| {
            let mut k = b"sixteen-byte-pfx"[..n].to_vec();
            k.extend(tail);
            k
        })
    }

    proptest::proptest! {
        /// The tree key orders keys as their bytes do (heads that tie included).
        #[test]
        fn tree_keys_order_as_bytes(a in tie_keys(), b in tie_keys()) {
            let (ta, tb) = (TreeKey::new(a.clone().into()), TreeKey::new(b.clone().into()));
            proptest::prop_assert_eq!(ta.cmp(&tb), a.cmp(&b));
            proptest::prop_assert_eq!(ta == tb, a == b);
            proptest::prop_assert_eq!(scc::Comparable::compare(&Probe::new(&a), &tb), a.cmp(&b));
            proptest::prop_assert_eq!(scc::Equivalent::equivalent(&Probe::new(&a), &tb), a == b);
        }

        /// Ordered walks over keys whose heads tie match a `BTreeSet`, from any start, after
        /// removals.
        #[test]
        fn ordered_walks_over_tied_heads_match_a_model(
            keys in proptest::collection::vec(tie_keys(), 0..200),
            gone in proptest::collection::vec(tie_keys(), 0..50),
            starts in proptest::collection::vec((tie_keys(), 0u8..3), 1..10),
        ) {
            let ix = Index::new();
            let mut model = std::collections::BTreeSet::new();
            for k in &keys {
                ix.link(k, v(1), 0);
                model.insert(k.clone());
            }
            for k in &gone {
                if model.remove(k) {
                    proptest::prop_assert!(ix.remove(k, 1).is_some());
                }
            }
            let mg = MapGuard::new();
            for (s, kind) in &starts {
                let b = bound(*kind, s);
                let want: Vec<&Vec<u8>> = model.range::<[u8], _>((b, Bound::Unbounded)).collect();
                let got: Vec<&[u8]> = ix.ascending(b, &mg).unwrap().map(|(k, _)| k).collect();
                proptest::prop_assert_eq!(got.len(), want.len());
                proptest::prop_assert!(got.iter().zip(&want).all(|(g, w)| *g == &w[..]));
                let want: Vec<&Vec<u8>> = model.range::<[u8], _>((Bound::Unbounded, b)).rev().collect();
                let got: Vec<&[u8]> = ix.descending(b, &mg).unwrap().map(|(k, _)| k).collect();
                proptest::prop_assert_eq!(got.len(), want.len());
                proptest::prop_assert!(got.iter().zip(&want).all(|(g, w)| *g == &w[..]));
            }
        }
    }

    /// The layout of `docs/design/scc-range-seek.md` (20,000 hashes and one sorted set as the
    /// server stores them): a seek below the smallest key, which scc alone answers by walking
    /// every leaf many times over (~650 ms), finds the first key; so does a reverse walk from
    /// above the largest. Not timed — the test finishes in milliseconds with the workaround
    /// and in seconds without it.
    #[test]
    fn walks_from_outside_the_keys_find_the_edges() {
        let ix = Index::new();
        let mut keys = Vec::new();
        for i in 0..20_000u64 {
            let user = format!("user{}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15) % 10_000_000_000_000);
            for tag in [&b"\xffh"[..], b"\xffm", b"\xffo\0\0\0\x08_indices\0\0\0\0\0\0\0\x05", b"\xffz"] {
                let mut k = tag.to_vec();
                k.extend_from_slice(user.as_bytes());
                ix.link(&k, v(1), 0);
                keys.push(k);
            }
        }
        keys.sort();
        let mg = MapGuard::new();
        for _ in 0..20 {
            let first = ix.ascending(Bound::Included(b"\xff"), &mg).unwrap().next().map(|(k, _)| k.to_vec());
            assert_eq!(first.as_ref(), keys.first());
            let last = ix.descending(Bound::Included(b"\xff\xff"), &mg).unwrap().next().map(|(k, _)| k.to_vec());
            assert_eq!(last.as_ref(), keys.last());
        }
    }

    /// Walks from the edges while the edge leaves empty out (the capacity tier removes keys
    /// from the tree; scc leaves an emptied edge leaf linked), against a `BTreeSet`.
    #[test]
    fn walks_from_the_edges_while_edge_leaves_empty_out() {
        let ix = Index::new();
        let mut model = std::collections::BTreeSet::new();
        for i in 0..400u32 {
            ix.link(&i.to_be_bytes(), v(1), 0);
            model.insert(i.to_be_bytes().to_vec());
        }
        let check = |ix: &Index, model: &std::collections::BTreeSet<Vec<u8>>| {
            let mg = MapGuard::new();
            let (Some(min), Some(max)) = (model.first().cloned(), model.last().cloned()) else { return };
            let all: Vec<Vec<u8>> = model.iter().cloned().collect();
            let rev: Vec<Vec<u8>> = model.iter().rev().cloned().collect();
            let up = |b| ix.ascending(b, &mg).unwrap().map(|(k, _)| k.to_vec()).collect::<Vec<_>>();
            let down = |b| ix.descending(b, &mg).unwrap().map(|(k, _)| k.to_vec()).collect::<Vec<_>>();
            assert_eq!(up(Bound::Unbounded), all);
            assert_eq!(up(Bound::Included(&min[..])), all);
            assert_eq!(up(Bound::Excluded(&min[..])), all[1..].to_vec());
            assert_eq!(down(Bound::Unbounded), rev);
            assert_eq!(down(Bound::Included(&max[..])), rev);
            assert_eq!(down(Bound::Excluded(&max[..])), rev[1..].to_vec());
        };
        // From the top, then from the bottom, one key at a time.
        for i in (200..400u32).rev() {
            assert!(ix.remove(&i.to_be_bytes(), 1).is_some());
            model.remove(&i.to_be_bytes()[..]);
            check(&ix, &model);
        }
        for i in 0..199u32 {
            assert!(ix.remove(&i.to_be_bytes(), 1).is_some());
            model.remove(&i.to_be_bytes()[..]);
            check(&ix, &model);
        }
    }

    #[test]
    fn new_keys_wait_in_pending_lists_and_every_walk_drains_them_first() {
        let ix = Index::new();
        let mut keys: Vec<u32> = (0..1000).map(|i| i * 7919 % 1000).collect();
        keys.dedup();
        for (i, k) in keys.iter().enumerate() {
            ix.link(&k.to_be_bytes(), v(i as u64 + 1), 0);
        }
        // No inserter runs here: every new slot is in the hash and pending, none in the tree.
        assert_eq!(ix.slots(), 1000);
        assert_eq!(ix.tree.len(), 0);
        let mg = MapGuard::new();
        let walked: Vec<Vec<u8>> = ix.ascending(Bound::Unbounded, &mg).unwrap().map(|(k, _)| k.to_vec()).collect();
        let want: Vec<Vec<u8>> = (0..1000u32).map(|k| k.to_be_bytes().to_vec()).collect();
        assert_eq!(walked, want);
        assert_eq!(ix.moved_by_drains.load(Ordering::Relaxed), 1000);
        // A key written after that walk is found by the next one, in either direction.
        ix.link(&5000u32.to_be_bytes(), v(2000), 0);
        let top = ix.descending(Bound::Unbounded, &mg).unwrap().next().map(|(k, _)| k.to_vec());
        assert_eq!(top, Some(5000u32.to_be_bytes().to_vec()));
        assert_eq!(ix.moved_by_drains.load(Ordering::Relaxed), 1001);
    }

    #[test]
    fn a_slot_removed_while_pending_never_reaches_the_tree() {
        let ix = Index::new();
        ix.link(b"k", v(1), 0);
        ix.link(b"other", v(2), 0);
        assert_eq!(ix.remove(b"k", 1), Some((100, 10, false)));
        let mg = MapGuard::new();
        let keys =
            |ix: &Index| ix.ascending(Bound::Unbounded, &mg).unwrap().map(|(k, _)| k.to_vec()).collect::<Vec<_>>();
        assert_eq!(keys(&ix), vec![b"other".to_vec()]);
        // Written again: a new slot, pending, then in the tree with only its new version.
        ix.link(b"k", v(3), 0);
        assert_eq!(keys(&ix), vec![b"k".to_vec(), b"other".to_vec()]);
        let (_, slot) = ix.ascending(Bound::Unbounded, &mg).unwrap().next().unwrap();
        let g = epoch::pin();
        assert_eq!(slot.head(&g).map(|h| h.seq), Some(3));
        assert_eq!(chain(&ix, b"k"), vec![3]);
    }

    #[test]
    fn walks_find_every_key_created_before_them_while_the_inserter_and_writers_run() {
        const WRITERS: u64 = 3;
        const PER: u64 = 20_000;
        let ix = Index::new();
        let stop = AtomicBool::new(false);
        let acked: Vec<AtomicU64> = (0..WRITERS).map(|_| AtomicU64::new(0)).collect();
        let key = |w: u64, i: u64| (i * WRITERS + w).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_be_bytes();
        // Stops the inserter however the scope ends (a failed check must not hang it).
        struct Stop<'a>(&'a Index, &'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.1.store(true, Ordering::Release);
                self.0.wake_inserter();
            }
        }
        std::thread::scope(|s| {
            let ins = s.spawn(|| ix.run_inserter(&stop, || {}));
            ix.set_inserter(ins.thread().clone());
            let _stop = Stop(&ix, &stop);
            let writers: Vec<_> = (0..WRITERS)
                .map(|w| {
                    let (ix, acked) = (&ix, &acked);
                    s.spawn(move || {
                        for i in 0..PER {
                            ix.link(&key(w, i), v(w * PER + i + 1), 0);
                            acked[w as usize].store(i + 1, Ordering::Release);
                        }
                    })
                })
                .collect();
            let mut walks = 0;
            while walks < 5 || writers.iter().any(|h| !h.is_finished()) {
                let seen: Vec<u64> = acked.iter().map(|a| a.load(Ordering::Acquire)).collect();
                let mg = MapGuard::new();
                let found: std::collections::HashSet<Vec<u8>> =
                    ix.ascending(Bound::Unbounded, &mg).unwrap().map(|(k, _)| k.to_vec()).collect();
                for w in 0..WRITERS {
                    for i in 0..seen[w as usize] {
                        assert!(found.contains(&key(w, i)[..]), "walk {walks}: writer {w}'s key {i} missing");
                    }
                }
                walks += 1;
            }
        });
        let mg = MapGuard::new();
        assert_eq!(ix.ascending(Bound::Unbounded, &mg).unwrap().count() as u64, WRITERS * PER);
        let (by_inserter, by_drains) =
            (ix.moved_by_inserter.load(Ordering::Relaxed), ix.moved_by_drains.load(Ordering::Relaxed));
        assert!(by_inserter + by_drains <= WRITERS * PER, "a slot was moved twice");
    }
}
