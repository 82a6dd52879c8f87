//! RH-Tree: LightKV's Radix-Hash Tree (LightKV §III-B..E), the global index of the `lightkv`
//! preset, as a reusable component.
//!
//! # Shape
//! Radix **inner nodes** each map one key byte (s = 8 bits) at their *depth* to 256 children
//! (a child is a leaf or a deeper inner node); consecutive byte values share a leaf, so a
//! leaf (a **partition**) owns a set of byte values at its inner node's depth. The root has
//! depth 0 and starts with two leaves, bytes 0..=127 and 128..=255 (the paper's N = 2).
//!
//! **Keys shorter than the depth.** Below the root an inner node at depth d only receives
//! keys whose bytes 0..d-1 equal its path; a key of length exactly d has no byte to route on,
//! so every inner node has one extra *end partition* for it (created on first use). The end
//! partition sorts before the node's 256 children, matching byte order, and holds at most one
//! distinct key (its whole key is the path), so it never splits.
//!
//! # Hash leaf nodes
//! A leaf is `normal` buckets plus an extra area of ⌈5 %⌉ of them (at least one bucket),
//! searched linearly. A [`Bucket`] is exactly 64 bytes: 4 signature slots (u32), 4 cache
//! slots (u32: four key bytes), 4 offset slots (u64: where the record is — the engine's
//! address in the PM write buffer or an SSTable). A key's bucket is chosen by two hash
//! functions; it goes to the first free slot of its first bucket, then of its second, then
//! of the extra area. Every signature hit is confirmed by a full-key comparison through the
//! caller's [`KeySource`].
//!
//! **Signature slot.** `hash29 << 3 | clen`: 29 bits of the key's hash and, in 3 bits, how
//! many of the four bytes of the cache window the key has (0..=4). The paper's slot is a bare
//! 32-bit hash; the 3 bits are what lets a split tell "key ends here" from "byte 0x00"
//! without reading the key. `0` is an empty slot, `u32::MAX` a deleted one (reused by later
//! inserts, as the paper's slot reuse).
//!
//! **Cache slot.** Key bytes `[base, base + 4)` where `base` is the leaf's depth rounded down
//! to a multiple of 4. A split decides where each entry goes from its cache slot alone (no
//! key read). A level split that moves entries to a depth that starts a new window (every
//! fourth level) first refreshes their cache slots from the full keys — the paper's "renews
//! the cache slot after four level splits".
//!
//! # Growth
//! A full top leaf, while there are fewer than `max_leaf_nodes` partitions:
//! - **normal split** when the new leaf would keep at least `t_normal` byte values: the
//!   upper half of the partition's values moves to a new leaf;
//! - else a **level split**: a new inner node on the next byte takes one byte value `v` of
//!   the partition (the only one, or the one with most entries), with two leaves (bytes
//!   0..=127 and 128..=255) and an end partition.
//!
//! Moved entries keep their bucket and slot position: both leaves have the same geometry and
//! the bucket depends only on the key, so no rehash (and no key read) is needed.
//! At `max_leaf_nodes` partitions (or when a partition already has linked leaves, whose
//! SSTables a split could not divide), [`RhTree::insert`] returns [`Insert::Full`]; the
//! engine then [`RhTree::link`]s a fresh top leaf in front of the full one and carries on.
//! Lookups search a partition's leaves newest first.

use crate::error::Result;
use crate::sstable::bloom;

/// Slots per bucket.
pub const SLOTS: usize = 4;
/// Children per inner node (s = 8 bits).
pub const FANOUT: usize = 256;
const EMPTY: u32 = 0;
const DELETED: u32 = u32::MAX;

/// One 64-byte bucket (one cache line), the unit a leaf is made of and copied to PM in.
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bucket {
    /// Signature slots: `hash29 << 3 | bytes in the cache window`; 0 empty, `u32::MAX` deleted.
    pub sig: [u32; SLOTS],
    /// Cache slots: four key bytes from the leaf's cache window, little-endian.
    pub cache: [u32; SLOTS],
    /// Offset slots: the record's address (engine-defined).
    pub off: [u64; SLOTS],
}

const _: () = assert!(std::mem::size_of::<Bucket>() == 64);

/// Reads the full key of an entry (for confirming signature hits and refreshing caches).
pub trait KeySource {
    /// The key of the record at `off`.
    fn key(&self, off: u64) -> Result<Vec<u8>>;
    /// Whether the record at `off` has key `key` (a lookup's probe; sources that can
    /// compare in place override it to copy nothing).
    fn key_eq(&self, off: u64, key: &[u8]) -> Result<bool> {
        Ok(self.key(off)? == key)
    }
}

impl<F: Fn(u64) -> Result<Vec<u8>>> KeySource for F {
    fn key(&self, off: u64) -> Result<Vec<u8>> {
        self(off)
    }
}

/// Options (the `lightkv` preset's RH-Tree settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RhOptions {
    /// Normal buckets per leaf (the extra area adds ⌈5 %⌉, at least one).
    pub leaf_buckets: usize,
    /// Fewest byte values a leaf keeps through a normal split (T_normal).
    pub t_normal: usize,
    /// Most partitions (leaf chains) before full leaves get linked successors.
    pub max_leaf_nodes: usize,
}

impl Default for RhOptions {
    /// 1,024 buckets (4,096 slots: about one 4 MiB segment of 1 KiB records at the paper's
    /// 0.9 load factor), T_normal = 4 (the paper's example), MAX_LEAF_NODES = 2048.
    fn default() -> Self {
        RhOptions { leaf_buckets: 1024, t_normal: 4, max_leaf_nodes: 2048 }
    }
}

#[derive(Debug, Clone, Copy)]
struct Hashes {
    b1: usize,
    b2: usize,
    sig29: u32,
}

fn hashes(key: &[u8], nb: usize) -> Hashes {
    let h = bloom::hash(key);
    let mut g = h ^ 0x9e37_79b9_7f4a_7c15;
    g ^= g >> 29;
    g = g.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    g ^= g >> 32;
    let sig29 = ((h >> 35) as u32).max(1);
    Hashes { b1: (h % nb as u64) as usize, b2: (g % nb as u64) as usize, sig29 }
}

/// The cache slot of `key` for a leaf at `depth`, and how many key bytes it holds.
fn cache_of(key: &[u8], depth: usize) -> (u32, u32) {
    let base = depth - depth % 4;
    let mut c = [0u8; 4];
    let mut n = 0;
    for (i, b) in c.iter_mut().enumerate() {
        if let Some(&k) = key.get(base + i) {
            *b = k;
            n += 1;
        }
    }
    (u32::from_le_bytes(c), n)
}

fn live(sig: u32) -> bool {
    sig != EMPTY && sig != DELETED
}

/// The key byte at `depth` from a cache slot (window base `depth - depth % 4`), or `None`
/// when the key ends before it.
fn cached_byte(sig: u32, cache: u32, depth: usize) -> Option<u8> {
    let i = depth % 4;
    ((i as u32) < (sig & 7)).then(|| (cache >> (8 * i)) as u8)
}

/// A hash leaf node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    buckets: Box<[Bucket]>,
    normal: usize,
    depth: usize,
    live: usize,
    extra_used: bool,
    /// Buckets changed since the last [`Leaf::take_dirty`], when tracked (an engine that
    /// mirrors the leaf elsewhere, e.g. LightKV_PM's PM images).
    dirty: Option<Vec<u32>>,
}

/// Where an entry sits in a leaf.
type Pos = (usize, usize);

impl Leaf {
    /// An empty leaf of `normal` buckets (+ the extra area) for a partition at `depth`.
    pub fn new(normal: usize, depth: usize) -> Leaf {
        let normal = normal.max(1);
        let extra = normal.div_ceil(20).max(1);
        Leaf {
            buckets: vec![Bucket::default(); normal + extra].into_boxed_slice(),
            normal,
            depth,
            live: 0,
            extra_used: false,
            dirty: None,
        }
    }

    /// Start (or stop) recording which buckets change.
    pub fn track_dirty(&mut self, on: bool) {
        self.dirty = on.then(Vec::new);
    }

    /// The buckets changed since the last call (sorted, each once); empty when untracked.
    pub fn take_dirty(&mut self) -> Vec<u32> {
        let mut d = self.dirty.as_mut().map(std::mem::take).unwrap_or_default();
        d.sort_unstable();
        d.dedup();
        d
    }

    fn mark(&mut self, b: usize) {
        if let Some(d) = &mut self.dirty {
            d.push(b as u32);
        }
    }

    /// Rebuild a leaf from its buckets (e.g. a copy read back from PM).
    pub fn from_buckets(buckets: Vec<Bucket>, normal: usize, depth: usize) -> Option<Leaf> {
        let extra = normal.div_ceil(20).max(1);
        if normal == 0 || buckets.len() != normal + extra {
            return None;
        }
        let live_n = buckets.iter().flat_map(|b| b.sig).filter(|&s| live(s)).count();
        let extra_used = buckets[normal..].iter().flat_map(|b| b.sig).any(|s| s != EMPTY);
        Some(Leaf { buckets: buckets.into_boxed_slice(), normal, depth, live: live_n, extra_used, dirty: None })
    }

    /// The buckets (normal, then extra), e.g. to copy the leaf to PM.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Live entries.
    pub fn live(&self) -> usize {
        self.live
    }

    /// Slots in the leaf.
    pub fn capacity(&self) -> usize {
        self.buckets.len() * SLOTS
    }

    /// The radix depth the leaf's cache window is taken at.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Normal buckets (the extra area is derived from it).
    pub fn normal(&self) -> usize {
        self.normal
    }

    /// True when an entry was ever placed in the extra area (lookups then search it).
    pub fn extra_used(&self) -> bool {
        self.extra_used
    }

    /// Offsets of every live entry.
    pub fn offsets(&self) -> impl Iterator<Item = u64> + '_ {
        self.buckets.iter().flat_map(|b| (0..SLOTS).filter(|&s| live(b.sig[s])).map(move |s| b.off[s]))
    }

    fn candidates(&self, h: &Hashes) -> impl Iterator<Item = usize> {
        let second = (h.b2 != h.b1).then_some(h.b2);
        let extra = if self.extra_used { self.normal..self.buckets.len() } else { 0..0 };
        std::iter::once(h.b1).chain(second).chain(extra)
    }

    fn find(&self, key: &[u8], h: &Hashes, src: &dyn KeySource) -> Result<Option<Pos>> {
        for b in self.candidates(h) {
            let bk = &self.buckets[b];
            for s in 0..SLOTS {
                if live(bk.sig[s]) && bk.sig[s] >> 3 == h.sig29 && src.key_eq(bk.off[s], key)? {
                    return Ok(Some((b, s)));
                }
            }
        }
        Ok(None)
    }

    fn free_slot(&self, h: &Hashes) -> Option<Pos> {
        let second = (h.b2 != h.b1).then_some(h.b2);
        for b in std::iter::once(h.b1).chain(second).chain(self.normal..self.buckets.len()) {
            for s in 0..SLOTS {
                if !live(self.buckets[b].sig[s]) {
                    return Some((b, s));
                }
            }
        }
        None
    }

    fn place(&mut self, (b, s): Pos, sig: u32, cache: u32, off: u64) {
        self.mark(b);
        let bk = &mut self.buckets[b];
        bk.sig[s] = sig;
        bk.cache[s] = cache;
        bk.off[s] = off;
        self.live += 1;
        if b >= self.normal {
            self.extra_used = true;
        }
    }

    fn take(&mut self, (b, s): Pos) -> (u32, u32, u64) {
        self.mark(b);
        let bk = &mut self.buckets[b];
        let e = (bk.sig[s], bk.cache[s], bk.off[s]);
        bk.sig[s] = EMPTY;
        bk.cache[s] = 0;
        bk.off[s] = 0;
        self.live -= 1;
        e
    }

    /// The offset of `key` in this leaf.
    pub fn get(&self, key: &[u8], src: &dyn KeySource) -> Result<Option<u64>> {
        let h = hashes(key, self.normal);
        Ok(self.find(key, &h, src)?.map(|(b, s)| self.buckets[b].off[s]))
    }

    fn live_positions(&self) -> Vec<Pos> {
        let mut v = Vec::with_capacity(self.live);
        for (b, bk) in self.buckets.iter().enumerate() {
            for s in 0..SLOTS {
                if live(bk.sig[s]) {
                    v.push((b, s));
                }
            }
        }
        v
    }
}

/// Build a leaf of `normal` buckets at `depth` holding `entries` (key, offset), each in one
/// of its own two buckets (never the extra area, so a lookup reads at most two buckets),
/// placed by cuckoo displacement: an entry whose buckets are both full takes a slot and
/// moves that slot's entry to its other bucket, up to a bounded number of moves. `None` when
/// the entries do not fit (the caller grows `normal`). Keys must be distinct.
pub fn build_leaf(entries: &[(Vec<u8>, u64)], depth: usize, normal: usize) -> Option<Leaf> {
    let normal = normal.max(1);
    let hs: Vec<Hashes> = entries.iter().map(|(k, _)| hashes(k, normal)).collect();
    // slots[b * SLOTS + s] = entry index + 1 (0 = empty)
    let mut slots = vec![0usize; normal * SLOTS];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..entries.len() {
        let mut cur = i;
        let mut bucket = hs[cur].b1;
        let mut placed = false;
        for _ in 0..500 {
            let h = &hs[cur];
            let free =
                [h.b1, h.b2].into_iter().find_map(|b| (0..SLOTS).find(|&s| slots[b * SLOTS + s] == 0).map(|s| (b, s)));
            if let Some((b, s)) = free {
                slots[b * SLOTS + s] = cur + 1;
                placed = true;
                break;
            }
            // Both full: evict a random slot of the bucket not just left, and move on.
            bucket = if bucket == h.b1 { h.b2 } else { h.b1 };
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let s = (rng % SLOTS as u64) as usize;
            let victim = slots[bucket * SLOTS + s] - 1;
            slots[bucket * SLOTS + s] = cur + 1;
            cur = victim;
            let vh = &hs[cur];
            // The victim goes to its other bucket next.
            bucket = if vh.b1 == bucket { vh.b1 } else { vh.b2 };
        }
        if !placed {
            return None;
        }
    }
    let mut leaf = Leaf::new(normal, depth);
    for (idx, &e) in slots.iter().enumerate() {
        if e > 0 {
            let (key, off) = &entries[e - 1];
            let (cache, clen) = cache_of(key, depth);
            leaf.place((idx / SLOTS, idx % SLOTS), hs[e - 1].sig29 << 3 | clen, cache, *off);
        }
    }
    Some(leaf)
}

/// Look `key` up in a leaf that is not in DRAM (a PM copy): `fetch(i)` reads bucket `i`.
/// The leaf has `normal` normal buckets, `buckets` in all, and searches its extra area when
/// `extra_used` ([`Leaf::extra_used`] of the leaf it was copied from). Only the key's two
/// buckets (and the extra area when used) are read, as [`Leaf::get`] does in DRAM.
pub fn probe(
    normal: usize,
    buckets: usize,
    extra_used: bool,
    key: &[u8],
    fetch: &mut dyn FnMut(usize) -> Result<Bucket>,
    src: &dyn KeySource,
) -> Result<Option<u64>> {
    let h = hashes(key, normal.max(1));
    let second = (h.b2 != h.b1).then_some(h.b2);
    let extra = if extra_used { normal..buckets } else { 0..0 };
    for b in std::iter::once(h.b1).chain(second).chain(extra) {
        let bk = fetch(b)?;
        for s in 0..SLOTS {
            if live(bk.sig[s]) && bk.sig[s] >> 3 == h.sig29 && src.key_eq(bk.off[s], key)? {
                return Ok(Some(bk.off[s]));
            }
        }
    }
    Ok(None)
}

/// The smallest key greater than every key starting with `prefix` (`None`: no such key).
fn successor(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut s = prefix.to_vec();
    while let Some(&last) = s.last() {
        if last < 255 {
            *s.last_mut()? += 1;
            return Some(s);
        }
        s.pop();
    }
    None
}

/// A partition id: an index into the tree's partitions. The id of a partition never changes
/// while the tree lives, except through [`RhTree::ensure_partition`] (recovery).
pub type PartitionId = u32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Child {
    Leaf(PartitionId),
    Inner(u32),
}

#[derive(Debug, Clone)]
struct Inner {
    depth: usize,
    /// The key bytes `0..depth` every key below this node starts with.
    prefix: Vec<u8>,
    children: Vec<Child>,
    end: Option<PartitionId>,
}

/// A partition: its top leaf (newest, indexes the write buffer) and its linked older leaves.
#[derive(Debug, Clone)]
pub struct Partition {
    /// The top leaf.
    pub top: TopLeaf,
    /// Older leaves the tree searches after the top leaf, newest first. The engine may move
    /// a leaf out of here once it lives elsewhere (e.g. a PM copy it searches itself).
    pub chain: Vec<Leaf>,
    /// The partition has had a leaf linked ([`RhTree::link`]) or was restored with linked
    /// leaves: it never splits again (its older leaves' SSTables cannot be divided by key).
    pub linked: bool,
    /// Engine-defined tag (e.g. where the partition's chain record lives); moves with the
    /// partition, whatever its id becomes. 0 by default.
    pub tag: u64,
    inner: u32,
    end: bool,
}

/// A partition's top leaf behind its own lock, so that an engine can change one partition's
/// top leaf while other threads use the tree (and other top leaves) through a shared
/// reference ([`RhTree::insert_shared`]). `&mut` paths reach it without locking
/// ([`TopLeaf::get_mut`]).
pub struct TopLeaf(parking_lot::RwLock<Leaf>);

impl TopLeaf {
    /// Wrap a leaf.
    pub fn new(leaf: Leaf) -> TopLeaf {
        TopLeaf(parking_lot::RwLock::new(leaf))
    }

    /// The leaf, shared.
    pub fn read(&self) -> parking_lot::RwLockReadGuard<'_, Leaf> {
        self.0.read()
    }

    /// The leaf, for changes through a shared tree.
    pub fn write(&self) -> parking_lot::RwLockWriteGuard<'_, Leaf> {
        self.0.write()
    }

    /// The leaf, through an exclusive tree (no locking).
    pub fn get_mut(&mut self) -> &mut Leaf {
        self.0.get_mut()
    }
}

impl Clone for TopLeaf {
    fn clone(&self) -> TopLeaf {
        TopLeaf::new(self.read().clone())
    }
}

impl std::fmt::Debug for TopLeaf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.read().fmt(f)
    }
}

/// A key range routed to one partition: `(lower, upper, partition)`, `upper` exclusive,
/// `None` = no upper bound (see [`RhTree::ranges`]).
pub type KeyRange = (Vec<u8>, Option<Vec<u8>>, PartitionId);

/// The outcome of [`RhTree::insert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Insert {
    /// A new entry in the partition's top leaf.
    Inserted(PartitionId),
    /// The key's entry in the top leaf now has the new offset; the old one is returned.
    Updated(PartitionId, u64),
    /// The top leaf is full and cannot split: [`RhTree::link`] a new top leaf and retry.
    Full(PartitionId),
}

/// Where a key stands in its partition's top leaf ([`RhTree::top_probe`]), for a later
/// [`RhTree::insert_probed`] that then compares no key. Valid while nobody else changes
/// that top leaf (the engine's per-partition writer lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The key's entry sits at (bucket, slot) of partition `0`'s top leaf.
    Present(PartitionId, usize, usize),
    /// The key has no entry in partition `0`'s top leaf.
    Absent(PartitionId),
}

/// What splits happened (for tests and stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SplitCounts {
    /// Normal splits.
    pub normal: u64,
    /// Level splits.
    pub level: u64,
    /// Entries whose cache slot was refreshed from the full key.
    pub refreshed: u64,
}

/// The tree.
#[derive(Debug, Clone)]
pub struct RhTree {
    opts: RhOptions,
    inners: Vec<Inner>,
    parts: Vec<Partition>,
    splits: SplitCounts,
    /// Partitions recreated by [`RhTree::ensure_partition`].
    restored: Vec<PartitionId>,
    /// New top leaves record their changed buckets ([`Leaf::take_dirty`]).
    track_dirty: bool,
}

/// Where a partition sits in the radix tree ([`RhTree::descriptor`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionDesc {
    /// Key bytes of the partition's inner node (its depth is the length).
    pub prefix: Vec<u8>,
    /// Byte values at that depth the partition owns (empty for an end partition).
    pub values: Vec<u8>,
    /// The end partition: the one key equal to `prefix`.
    pub end: bool,
}

impl RhTree {
    /// An empty tree: a root with two leaves.
    pub fn new(opts: RhOptions) -> RhTree {
        let mut t = RhTree {
            opts,
            inners: Vec::new(),
            parts: Vec::new(),
            splits: SplitCounts::default(),
            restored: Vec::new(),
            track_dirty: false,
        };
        t.new_inner(Vec::new());
        t
    }

    /// Record changed buckets in every top leaf from now on (existing ones included).
    pub fn set_track_dirty(&mut self, on: bool) {
        self.track_dirty = on;
        for p in self.parts.iter_mut() {
            p.top.get_mut().track_dirty(on);
        }
    }

    /// The options.
    pub fn options(&self) -> &RhOptions {
        &self.opts
    }

    /// Split counters.
    pub fn splits(&self) -> SplitCounts {
        self.splits
    }

    /// Number of partitions (leaf chains).
    pub fn partition_count(&self) -> usize {
        self.parts.len()
    }

    /// Partition `p`.
    pub fn partition(&self, p: PartitionId) -> &Partition {
        &self.parts[p as usize]
    }

    /// Partition `p`, mutable (the engine swaps chain leaves for their PM copies).
    pub fn partition_mut(&mut self, p: PartitionId) -> &mut Partition {
        &mut self.parts[p as usize]
    }

    fn new_partition(&mut self, inner: u32, end: bool) -> PartitionId {
        let depth = self.inners[inner as usize].depth;
        let mut top = Leaf::new(self.opts.leaf_buckets, depth);
        top.track_dirty(self.track_dirty);
        self.parts.push(Partition { top: TopLeaf::new(top), chain: Vec::new(), linked: false, tag: 0, inner, end });
        (self.parts.len() - 1) as PartitionId
    }

    /// A new inner node below `prefix` with two fresh leaves (bytes 0..=127, 128..=255).
    fn new_inner(&mut self, prefix: Vec<u8>) -> (u32, PartitionId, PartitionId) {
        let id = self.inners.len() as u32;
        self.inners.push(Inner { depth: prefix.len(), prefix, children: Vec::new(), end: None });
        let lo = self.new_partition(id, false);
        let hi = self.new_partition(id, false);
        let mut children = vec![Child::Leaf(lo); FANOUT];
        for c in children.iter_mut().skip(FANOUT / 2) {
            *c = Child::Leaf(hi);
        }
        self.inners[id as usize].children = children;
        (id, lo, hi)
    }

    /// The partition `key` belongs to, if it exists.
    pub fn route(&self, key: &[u8]) -> Option<PartitionId> {
        let mut n = 0usize;
        loop {
            let inner = &self.inners[n];
            match key.get(inner.depth) {
                None => return inner.end,
                Some(&b) => match inner.children[b as usize] {
                    Child::Leaf(p) => return Some(p),
                    Child::Inner(i) => n = i as usize,
                },
            }
        }
    }

    /// The partition `key` belongs to, creating its end partition if the key needs one (the
    /// partition a writer appends the key's record for).
    pub fn route_mut(&mut self, key: &[u8]) -> PartitionId {
        let mut n = 0usize;
        loop {
            let depth = self.inners[n].depth;
            match key.get(depth) {
                None => {
                    if let Some(p) = self.inners[n].end {
                        return p;
                    }
                    let p = self.new_partition(n as u32, true);
                    self.inners[n].end = Some(p);
                    return p;
                }
                Some(&b) => match self.inners[n].children[b as usize] {
                    Child::Leaf(p) => return p,
                    Child::Inner(i) => n = i as usize,
                },
            }
        }
    }

    /// The newest offset of `key`: its partition's leaves, newest first.
    pub fn get(&self, key: &[u8], src: &dyn KeySource) -> Result<Option<(PartitionId, u64)>> {
        let Some(p) = self.route(key) else { return Ok(None) };
        let part = &self.parts[p as usize];
        let top = part.top.read();
        for leaf in std::iter::once(&*top).chain(part.chain.iter()) {
            if let Some(off) = leaf.get(key, src)? {
                return Ok(Some((p, off)));
            }
        }
        Ok(None)
    }

    /// Index `key` at `off` in its partition's top leaf (splitting leaves as needed).
    pub fn insert(&mut self, key: &[u8], off: u64, src: &dyn KeySource) -> Result<Insert> {
        loop {
            let p = self.route_mut(key);
            let part = &mut self.parts[p as usize];
            let top = part.top.get_mut();
            let h = hashes(key, top.normal);
            if let Some((b, s)) = top.find(key, &h, src)? {
                let old = std::mem::replace(&mut top.buckets[b].off[s], off);
                top.mark(b);
                return Ok(Insert::Updated(p, old));
            }
            if let Some(pos) = top.free_slot(&h) {
                let (cache, clen) = cache_of(key, top.depth);
                top.place(pos, h.sig29 << 3 | clen, cache, off);
                return Ok(Insert::Inserted(p));
            }
            if part.end || part.linked || self.parts.len() >= self.opts.max_leaf_nodes {
                return Ok(Insert::Full(p));
            }
            self.split(p, src)?;
        }
    }

    /// Where `key` stands in its partition's top leaf (key comparisons against the source,
    /// nothing changed); `None` when no partition takes the key yet.
    pub fn top_probe(&self, key: &[u8], src: &dyn KeySource) -> Result<Option<Probe>> {
        let Some(p) = self.route(key) else { return Ok(None) };
        let top = self.parts[p as usize].top.read();
        let h = hashes(key, top.normal);
        Ok(Some(match top.find(key, &h, src)? {
            Some((b, s)) => Probe::Present(p, b, s),
            None => Probe::Absent(p),
        }))
    }

    /// [`RhTree::insert`] with the outcome of [`RhTree::top_probe`] taken on the same top
    /// leaf: no key is compared (a split may still read keys to refresh cache slots). A
    /// probe that no longer fits the leaf (its partition or slot changed) is ignored and
    /// the key searched for as by `insert`.
    pub fn insert_probed(&mut self, key: &[u8], off: u64, probe: Probe, src: &dyn KeySource) -> Result<Insert> {
        match probe {
            Probe::Present(p, b, s) => {
                let h = hashes(key, self.parts.get_mut(p as usize).map_or(1, |x| x.top.get_mut().normal));
                let fits = self.route(key) == Some(p)
                    && self.parts[p as usize]
                        .top
                        .get_mut()
                        .buckets
                        .get(b)
                        .is_some_and(|bk| s < SLOTS && live(bk.sig[s]) && bk.sig[s] >> 3 == h.sig29);
                if !fits {
                    return self.insert(key, off, src);
                }
                let top = self.parts[p as usize].top.get_mut();
                let old = std::mem::replace(&mut top.buckets[b].off[s], off);
                top.mark(b);
                Ok(Insert::Updated(p, old))
            }
            Probe::Absent(p) => {
                if self.route(key) != Some(p) {
                    return self.insert(key, off, src);
                }
                // Absent from the top leaf stays true through splits (they only move its
                // entries) and links (the new top leaf is empty).
                loop {
                    let p = self.route_mut(key);
                    let part = &mut self.parts[p as usize];
                    let top = part.top.get_mut();
                    let h = hashes(key, top.normal);
                    if let Some(pos) = top.free_slot(&h) {
                        let (cache, clen) = cache_of(key, top.depth);
                        top.place(pos, h.sig29 << 3 | clen, cache, off);
                        return Ok(Insert::Inserted(p));
                    }
                    if part.end || part.linked || self.parts.len() >= self.opts.max_leaf_nodes {
                        return Ok(Insert::Full(p));
                    }
                    self.split(p, src)?;
                }
            }
        }
    }

    /// [`RhTree::insert_probed`] through a shared tree, changing only the key's partition's
    /// top leaf (under its own lock): the caller must be the only one changing that leaf
    /// meanwhile. `None`, with nothing changed, when the insert needs more than one leaf
    /// slot — a split or a link — or the probe no longer fits; the caller then inserts
    /// through an exclusive tree.
    pub fn insert_shared(&self, key: &[u8], off: u64, probe: Probe) -> Option<Insert> {
        let (Probe::Present(p, ..) | Probe::Absent(p)) = probe;
        if self.route(key) != Some(p) {
            return None;
        }
        let mut top = self.parts.get(p as usize)?.top.write();
        let h = hashes(key, top.normal);
        match probe {
            Probe::Present(_, b, s) => {
                let fits =
                    top.buckets.get(b).is_some_and(|bk| s < SLOTS && live(bk.sig[s]) && bk.sig[s] >> 3 == h.sig29);
                if !fits {
                    return None;
                }
                let old = std::mem::replace(&mut top.buckets[b].off[s], off);
                top.mark(b);
                Some(Insert::Updated(p, old))
            }
            Probe::Absent(_) => {
                let pos = top.free_slot(&h)?;
                let (cache, clen) = cache_of(key, top.depth);
                top.place(pos, h.sig29 << 3 | clen, cache, off);
                Some(Insert::Inserted(p))
            }
        }
    }

    /// Remove `key`'s entry from its partition's top leaf (the slot is marked deleted and
    /// reused by later inserts). Returns the removed offset. Older linked leaves are not
    /// touched: when they may hold the key the engine indexes a tombstone record instead.
    pub fn remove_top(&mut self, key: &[u8], src: &dyn KeySource) -> Result<Option<u64>> {
        let Some(p) = self.route(key) else { return Ok(None) };
        let top = self.parts[p as usize].top.get_mut();
        let h = hashes(key, top.normal);
        let Some((b, s)) = top.find(key, &h, src)? else { return Ok(None) };
        let off = top.buckets[b].off[s];
        top.mark(b);
        top.buckets[b].sig[s] = DELETED;
        top.buckets[b].off[s] = 0;
        top.live -= 1;
        Ok(Some(off))
    }

    /// Make a fresh top leaf for `p`; the old top leaf becomes the newest linked leaf
    /// (returned index 0 of the chain).
    pub fn link(&mut self, p: PartitionId) {
        let part = &mut self.parts[p as usize];
        let mut fresh = Leaf::new(self.opts.leaf_buckets, part.top.get_mut().depth);
        fresh.track_dirty(self.track_dirty);
        let mut old = std::mem::replace(part.top.get_mut(), fresh);
        old.track_dirty(false);
        part.chain.insert(0, old);
        part.linked = true;
    }

    /// Partitions in key order (an end partition before its inner node's children; a
    /// partition whose byte values are split by a deeper inner node is listed at its first
    /// value).
    pub fn partitions_in_order(&self) -> Vec<PartitionId> {
        let mut out = Vec::with_capacity(self.parts.len());
        let mut seen = vec![false; self.parts.len()];
        self.walk(0, &mut out, &mut seen);
        out
    }

    fn walk(&self, n: usize, out: &mut Vec<PartitionId>, seen: &mut [bool]) {
        let inner = &self.inners[n];
        if let Some(p) = inner.end {
            out.push(p);
        }
        for c in &inner.children {
            match *c {
                Child::Leaf(p) => {
                    if !seen[p as usize] {
                        seen[p as usize] = true;
                        out.push(p);
                    }
                }
                Child::Inner(i) => self.walk(i as usize, out, seen),
            }
        }
    }

    /// Where partition `p` sits: the key prefix of its inner node, and either its byte
    /// values at that depth or (`end`) the single key equal to the prefix. Persisted for
    /// partitions with linked PM leaves, so recovery can rebuild them
    /// ([`RhTree::ensure_partition`]).
    pub fn descriptor(&self, p: PartitionId) -> PartitionDesc {
        let part = &self.parts[p as usize];
        let inner = &self.inners[part.inner as usize];
        PartitionDesc {
            prefix: inner.prefix.clone(),
            values: if part.end { Vec::new() } else { self.values_of(p) },
            end: part.end,
        }
    }

    /// The partition `d` describes, if the tree has exactly it.
    pub fn find_partition(&self, d: &PartitionDesc) -> Option<PartitionId> {
        let mut n = 0usize;
        for &b in &d.prefix {
            match self.inners[n].children[b as usize] {
                Child::Inner(j) => n = j as usize,
                Child::Leaf(_) => return None,
            }
        }
        let p = if d.end {
            self.inners[n].end?
        } else {
            match self.inners[n].children[*d.values.first()? as usize] {
                Child::Leaf(p) => p,
                Child::Inner(_) => return None,
            }
        };
        (self.descriptor(p) == *d).then_some(p)
    }

    /// The key range partition `p` may hold: every key `k` routed to it has
    /// `lower <= k` and, when `upper` is `Some(u)`, `k < u`. Other partitions' keys may fall
    /// inside (a value set with holes), so scans merge partitions by key.
    pub fn bounds(&self, p: PartitionId) -> (Vec<u8>, Option<Vec<u8>>) {
        let d = self.descriptor(p);
        if d.end {
            let mut up = d.prefix.clone();
            up.push(0);
            return (d.prefix, Some(up));
        }
        let (lo, hi) = (d.values.first().copied().unwrap_or(0), d.values.last().copied().unwrap_or(255));
        let mut lower = d.prefix.clone();
        lower.push(lo);
        let upper = if hi < 255 {
            let mut u = d.prefix.clone();
            u.push(hi + 1);
            Some(u)
        } else {
            successor(&d.prefix)
        };
        (lower, upper)
    }

    /// The key space cut into disjoint ranges in key order, each routed to one partition:
    /// `(lower, upper, p)` says every key `k` with `lower <= k` and (when `upper` is
    /// `Some(u)`) `k < u` routes to `p`. Consecutive byte values of one leaf form one range;
    /// an end partition's range holds exactly its one key. A partition whose byte values
    /// have holes (a level split took one) has one range per run of values. Keys that route
    /// nowhere (shorter than a depth with no end partition yet) are in no range.
    pub fn ranges(&self) -> Vec<KeyRange> {
        let mut out = Vec::with_capacity(self.parts.len() + self.inners.len());
        self.ranges_below(0, &mut out);
        out
    }

    fn ranges_below(&self, n: usize, out: &mut Vec<KeyRange>) {
        let inner = &self.inners[n];
        if let Some(p) = inner.end {
            let mut up = inner.prefix.clone();
            up.push(0);
            out.push((inner.prefix.clone(), Some(up), p));
        }
        let mut b = 0usize;
        while b < FANOUT {
            match inner.children[b] {
                Child::Inner(i) => {
                    self.ranges_below(i as usize, out);
                    b += 1;
                }
                Child::Leaf(p) => {
                    let mut e = b;
                    while e + 1 < FANOUT && inner.children[e + 1] == Child::Leaf(p) {
                        e += 1;
                    }
                    let mut lo = inner.prefix.clone();
                    lo.push(b as u8);
                    let hi = if e < FANOUT - 1 {
                        let mut u = inner.prefix.clone();
                        u.push(e as u8 + 1);
                        Some(u)
                    } else {
                        successor(&inner.prefix)
                    };
                    out.push((lo, hi, p));
                    b = e + 1;
                }
            }
        }
    }

    /// Recreate the partition `d` describes in a tree that holds no entries yet (recovery
    /// rebuilds partitions with linked PM leaves before it replays the write buffer): inner
    /// nodes are created along `d.prefix`, and the byte values `d.values` (or the end slot)
    /// are given to one new partition. Partitions left without values are dropped.
    /// Descriptors that overlap (a value already taken by another restored partition, or by
    /// an inner node on another restored path) are an error: they cannot come from one tree.
    /// The returned id is valid until the next restore (which may renumber partitions):
    /// attach the partition's data (its chain, its [`Partition::tag`]) right away.
    pub fn ensure_partition(&mut self, d: &PartitionDesc, linked: bool) -> std::result::Result<PartitionId, String> {
        if self.parts.iter().any(|p| p.top.read().live() > 0) {
            return Err("partitions can only be restored before any entry is indexed".into());
        }
        if (!d.end && d.values.is_empty()) || (d.end && !d.values.is_empty()) {
            return Err("a partition has byte values or is an end partition".into());
        }
        let mut n = 0usize;
        for (i, &b) in d.prefix.iter().enumerate() {
            n = match self.inners[n].children[b as usize] {
                Child::Inner(j) => j as usize,
                Child::Leaf(p) => {
                    if self.restored.contains(&p) {
                        return Err(format!("prefix byte {i} is taken by a restored partition"));
                    }
                    let (child, _, _) = self.new_inner(d.prefix[..=i].to_vec());
                    self.inners[n].children[b as usize] = Child::Inner(child);
                    self.drop_if_unreferenced(p);
                    child as usize
                }
            };
        }
        let q = self.new_partition(n as u32, d.end);
        if d.end {
            if self.inners[n].end.is_some_and(|e| self.restored.contains(&e)) {
                return Err("end partition restored twice".into());
            }
            let old = self.inners[n].end.replace(q);
            if let Some(o) = old {
                self.drop_if_unreferenced(o);
            }
        } else {
            let mut losers = Vec::new();
            for &v in &d.values {
                match self.inners[n].children[v as usize] {
                    Child::Leaf(p) if !self.restored.contains(&p) && p != q => {
                        self.inners[n].children[v as usize] = Child::Leaf(q);
                        losers.push(p);
                    }
                    _ => return Err(format!("byte value {v} below prefix {:?} is already taken", d.prefix)),
                }
            }
            losers.sort_unstable();
            losers.dedup();
            // Highest ids first: dropping one moves the last partition into its id, which
            // never disturbs a lower id still to be dropped.
            for p in losers.into_iter().rev() {
                self.drop_if_unreferenced(p);
            }
        }
        // Ids may have moved (dropped partitions are replaced by the last one): find q again.
        let q = match (d.end, d.values.first()) {
            (true, _) => self.inners[n].end,
            (false, Some(&v)) => match self.inners[n].children[v as usize] {
                Child::Leaf(p) => Some(p),
                Child::Inner(_) => None,
            },
            (false, None) => None,
        }
        .ok_or_else(|| "restored partition vanished".to_string())?;
        self.restored.push(q);
        self.parts[q as usize].linked = linked;
        Ok(q)
    }

    /// Drop partition `p` if no inner node refers to it any more (it must be empty).
    fn drop_if_unreferenced(&mut self, p: PartitionId) {
        let referenced = self.inners.iter().any(|i| i.end == Some(p) || i.children.contains(&Child::Leaf(p)));
        if !referenced {
            for r in self.restored.iter_mut() {
                if *r == (self.parts.len() - 1) as PartitionId {
                    *r = p;
                }
            }
            self.remove_partition(p);
        }
    }

    fn values_of(&self, p: PartitionId) -> Vec<u8> {
        let inner = &self.inners[self.parts[p as usize].inner as usize];
        (0..FANOUT).filter(|&v| inner.children[v] == Child::Leaf(p)).map(|v| v as u8).collect()
    }

    fn split(&mut self, p: PartitionId, src: &dyn KeySource) -> Result<()> {
        let values = self.values_of(p);
        let inner = self.parts[p as usize].inner;
        let d = self.inners[inner as usize].depth;
        let n = values.len();
        if n >= 2 && n / 2 >= self.opts.t_normal {
            // Normal split: the upper half of the values moves to a new leaf.
            let q = self.new_partition(inner, false);
            let first_moved = values[n - n / 2];
            for &v in &values[n - n / 2..] {
                self.inners[inner as usize].children[v as usize] = Child::Leaf(q);
            }
            for pos in self.parts[p as usize].top.get_mut().live_positions() {
                let bk = &self.parts[p as usize].top.get_mut().buckets[pos.0];
                let (sig, cache) = (bk.sig[pos.1], bk.cache[pos.1]);
                if cached_byte(sig, cache, d).is_some_and(|b| b >= first_moved) {
                    let (sig, cache, off) = self.parts[p as usize].top.get_mut().take(pos);
                    self.parts[q as usize].top.get_mut().place(pos, sig, cache, off);
                }
            }
            self.splits.normal += 1;
            return Ok(());
        }
        // Level split on byte value `v`: the only value, or the one with most entries.
        let v = if n == 1 {
            values[0]
        } else {
            let mut count = [0usize; FANOUT];
            let top = &*self.parts[p as usize].top.get_mut();
            for (b, s) in top.live_positions() {
                if let Some(x) = cached_byte(top.buckets[b].sig[s], top.buckets[b].cache[s], d) {
                    count[x as usize] += 1;
                }
            }
            values.iter().copied().max_by_key(|&x| (count[x as usize], std::cmp::Reverse(x))).unwrap_or(values[0])
        };
        let mut prefix = self.inners[inner as usize].prefix.clone();
        prefix.push(v);
        let (child, lo, hi) = self.new_inner(prefix);
        self.inners[inner as usize].children[v as usize] = Child::Inner(child);
        let refresh = (d + 1).is_multiple_of(4);
        for pos in self.parts[p as usize].top.get_mut().live_positions() {
            let bk = &self.parts[p as usize].top.get_mut().buckets[pos.0];
            let (sig, cache) = (bk.sig[pos.1], bk.cache[pos.1]);
            if cached_byte(sig, cache, d) != Some(v) {
                continue;
            }
            let (sig, mut cache, off) = self.parts[p as usize].top.get_mut().take(pos);
            let mut sig = sig;
            if refresh {
                let key = src.key(off)?;
                let (c, clen) = cache_of(&key, d + 1);
                cache = c;
                sig = (sig & !7) | clen;
                self.splits.refreshed += 1;
            }
            let dest = match cached_byte(sig, cache, d + 1) {
                None => {
                    if let Some(e) = self.inners[child as usize].end {
                        e
                    } else {
                        let e = self.new_partition(child, true);
                        self.inners[child as usize].end = Some(e);
                        e
                    }
                }
                Some(b) if (b as usize) < FANOUT / 2 => lo,
                Some(_) => hi,
            };
            self.parts[dest as usize].top.get_mut().place(pos, sig, cache, off);
        }
        if n == 1 {
            // `p` no longer owns any value: it becomes unreachable and empty. Reuse it as
            // the lower leaf of the new node instead, so partition ids stay dense.
            let lo_top = std::mem::replace(self.parts[lo as usize].top.get_mut(), Leaf::new(1, 0));
            let part = &mut self.parts[p as usize];
            *part.top.get_mut() = lo_top;
            part.inner = child;
            for c in self.inners[child as usize].children.iter_mut() {
                if *c == Child::Leaf(lo) {
                    *c = Child::Leaf(p);
                }
            }
            // `lo` is the newest partition or the one before `hi`: drop it by swapping the
            // last partition into its place.
            self.remove_partition(lo);
        }
        self.splits.level += 1;
        Ok(())
    }

    /// Remove an empty, unreferenced partition by moving the last one into its id.
    fn remove_partition(&mut self, gone: PartitionId) {
        let last = (self.parts.len() - 1) as PartitionId;
        if gone != last {
            self.parts.swap(gone as usize, last as usize);
            for inner in self.inners.iter_mut() {
                for c in inner.children.iter_mut() {
                    if *c == Child::Leaf(last) {
                        *c = Child::Leaf(gone);
                    }
                }
                if inner.end == Some(last) {
                    inner.end = Some(gone);
                }
            }
        }
        self.parts.pop();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// An append-only record log standing in for the write buffer: offset = index.
    #[derive(Default)]
    struct Log(std::cell::RefCell<Vec<Vec<u8>>>);

    impl Log {
        fn add(&self, k: &[u8]) -> u64 {
            let mut v = self.0.borrow_mut();
            v.push(k.to_vec());
            (v.len() - 1) as u64
        }
    }

    impl KeySource for Log {
        fn key(&self, off: u64) -> Result<Vec<u8>> {
            Ok(self.0.borrow()[off as usize].clone())
        }
    }

    fn small(max: usize) -> RhOptions {
        RhOptions { leaf_buckets: 2, t_normal: 4, max_leaf_nodes: max }
    }

    fn check_all(t: &RhTree, log: &Log, model: &HashMap<Vec<u8>, u64>) {
        for (k, off) in model {
            assert_eq!(t.get(k, log).unwrap().map(|x| x.1), Some(*off), "key {k:?}");
        }
        let total: usize = (0..t.partition_count() as u32).map(|p| t.partition(p).top.read().live()).sum();
        assert_eq!(total, model.len(), "live entries");
        // Every entry sits in the partition its key routes to.
        for p in 0..t.partition_count() as u32 {
            for off in t.partition(p).top.read().offsets() {
                let k = log.key(off).unwrap();
                assert_eq!(t.route(&k), Some(p), "entry {k:?} in the wrong partition");
            }
        }
        let order = t.partitions_in_order();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), t.partition_count(), "partitions_in_order lists each partition once");
        // The ranges ascend without overlapping, and every key lies in a range of its
        // partition.
        let rs = t.ranges();
        assert!(
            rs.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1.as_deref().is_some_and(|u| u <= w[1].0.as_slice())),
            "ranges ascend and do not overlap"
        );
        for k in model.keys() {
            let i = rs.partition_point(|r| r.1.as_deref().is_some_and(|u| u <= k.as_slice()));
            assert!(i < rs.len() && rs[i].0.as_slice() <= k.as_slice(), "key {k:?} is in no range");
            assert_eq!(Some(rs[i].2), t.route(k), "key {k:?} is in another partition's range");
        }
    }

    #[test]
    fn buckets_are_one_cache_line_and_leaves_have_an_extra_area() {
        assert_eq!(std::mem::size_of::<Bucket>(), 64);
        assert_eq!(std::mem::align_of::<Bucket>(), 64);
        let l = Leaf::new(1024, 0);
        assert_eq!(l.buckets().len(), 1024 + 52);
        assert_eq!(Leaf::new(2, 0).buckets().len(), 3);
    }

    #[test]
    fn normal_splits_divide_a_byte_range_without_reading_keys() {
        let log = Log::default();
        let mut t = RhTree::new(small(10_000));
        let mut m = HashMap::new();
        for i in 0..3000u32 {
            let k = i.wrapping_mul(2_654_435_761).to_be_bytes().to_vec();
            let off = log.add(&k);
            t.insert(&k, off, &log).unwrap();
            m.insert(k, off);
        }
        let s = t.splits();
        assert!(s.normal > 0 && s.level > 0, "{s:?}");
        // Splits at depth 0..=2 stay inside the first cache window: no key was re-read.
        assert_eq!(s.refreshed, 0, "{s:?}");
        check_all(&t, &log, &m);
    }

    #[test]
    fn level_splits_on_long_shared_prefixes_refresh_cache_slots() {
        let log = Log::default();
        let mut t = RhTree::new(small(10_000));
        let mut m = HashMap::new();
        for i in 0..800u32 {
            let k = format!("user:prefix:{i:05}").into_bytes();
            let off = log.add(&k);
            t.insert(&k, off, &log).unwrap();
            m.insert(k, off);
        }
        let s = t.splits();
        assert!(s.level >= 8, "{s:?}");
        assert!(s.refreshed > 0, "level splits past depth 4 must refresh caches: {s:?}");
        check_all(&t, &log, &m);
    }

    #[test]
    fn keys_shorter_than_the_radix_depth_live_in_end_partitions() {
        let log = Log::default();
        let mut t = RhTree::new(small(10_000));
        let mut m = HashMap::new();
        // Many keys under "a" force level splits below 'a'; then "", "a", "ab" end early.
        let mut keys: Vec<Vec<u8>> = (0..600u32).map(|i| format!("ab{i}").into_bytes()).collect();
        keys.extend([b"".to_vec(), b"a".to_vec(), b"ab".to_vec(), b"ab1".to_vec(), b"\0".to_vec(), vec![0xff; 3]]);
        for k in &keys {
            let off = log.add(k);
            t.insert(k, off, &log).unwrap();
            m.insert(k.clone(), off);
        }
        check_all(&t, &log, &m);
        let pa = t.route(b"a").unwrap();
        let pab = t.route(b"ab").unwrap();
        assert!(t.partition(pa).end && t.partition(pab).end, "short keys route to end partitions");
        assert_ne!(pa, pab);
        assert_eq!(t.partition(pab).top.read().live(), 1);
        // An end partition sorts before its node's children.
        let order = t.partitions_in_order();
        let pos = |p| order.iter().position(|&x| x == p).unwrap();
        assert!(pos(pa) < pos(t.route(b"ab5").unwrap()));
        assert!(pos(t.route(b"").unwrap()) < pos(pa));
    }

    #[test]
    fn at_max_leaf_nodes_full_leaves_get_linked_successors() {
        let log = Log::default();
        let mut t = RhTree::new(small(2));
        let mut m = HashMap::new();
        let mut links = 0;
        for i in 0..200u32 {
            let k = format!("k{i:04}").into_bytes();
            let off = log.add(&k);
            while let Insert::Full(p) = t.insert(&k, off, &log).unwrap() {
                t.link(p);
                links += 1;
            }
            m.insert(k, off);
        }
        assert_eq!(t.partition_count(), 2, "no split past MAX_LEAF_NODES");
        assert!(links > 10, "{links}");
        for (k, off) in &m {
            assert_eq!(t.get(k, &log).unwrap().map(|x| x.1), Some(*off));
        }
        // An update of a key in a linked leaf goes to the top leaf and shadows it.
        let k = b"k0000".to_vec();
        let off = log.add(&k);
        let r = loop {
            match t.insert(&k, off, &log).unwrap() {
                Insert::Full(p) => t.link(p),
                r => break r,
            }
        };
        assert!(matches!(r, Insert::Inserted(_)), "{r:?}");
        assert_eq!(t.get(&k, &log).unwrap().map(|x| x.1), Some(off));
    }

    #[test]
    fn deleted_slots_are_reused() {
        let log = Log::default();
        let mut t = RhTree::new(small(2));
        let cap = t.partition(0).top.read().capacity();
        // Fill partition 0 (bytes < 128) to Full.
        let mut keys = Vec::new();
        for i in 0u32.. {
            let k = format!("a{i}").into_bytes();
            let off = log.add(&k);
            if let Insert::Full(_) = t.insert(&k, off, &log).unwrap() {
                break;
            }
            keys.push(k);
        }
        assert!(keys.len() <= cap);
        for k in &keys {
            assert!(t.remove_top(k, &log).unwrap().is_some());
            assert_eq!(t.get(k, &log).unwrap(), None);
        }
        // As many new keys fit again, in the deleted slots: no Full, no split, no link.
        for i in 0..keys.len() {
            let k = format!("b{i}").into_bytes();
            let off = log.add(&k);
            assert!(matches!(t.insert(&k, off, &log).unwrap(), Insert::Inserted(0)));
        }
        assert_eq!(t.partition_count(), 2);
        assert!(t.partition(0).chain.is_empty());
    }

    #[test]
    fn partitions_are_restored_from_their_descriptors() {
        let log = Log::default();
        let mut t = RhTree::new(small(10_000));
        let mut keys: Vec<Vec<u8>> =
            (0..1500u32).map(|i| i.wrapping_mul(2_654_435_761).to_be_bytes().to_vec()).collect();
        keys.extend((0..400u32).map(|i| format!("user:prefix:{i:05}").into_bytes()));
        keys.extend([b"".to_vec(), b"u".to_vec(), b"user:".to_vec()]);
        for k in &keys {
            let off = log.add(k);
            t.insert(k, off, &log).unwrap();
        }
        // Restore every other partition (as if only they had linked PM leaves).
        let chosen: Vec<PartitionId> = (0..t.partition_count() as u32).step_by(2).collect();
        let descs: Vec<PartitionDesc> = chosen.iter().map(|&p| t.descriptor(p)).collect();
        assert!(descs.iter().any(|d| d.prefix.len() >= 4), "some restored partition is deep");
        let mut r = RhTree::new(small(10_000));
        for (i, d) in descs.iter().enumerate() {
            let q = r.ensure_partition(d, true).unwrap();
            assert_eq!(&r.descriptor(q), d);
            r.partition_mut(q).tag = i as u64 + 1;
        }
        // Tags move with their partitions while later restores drop and renumber others.
        let mut tagged = 0;
        for q in 0..r.partition_count() as u32 {
            let tag = r.partition(q).tag;
            if tag > 0 {
                assert_eq!(r.descriptor(q), descs[tag as usize - 1]);
                tagged += 1;
            }
        }
        assert_eq!(tagged, descs.len());
        // Every key of a restored partition routes to the partition with the same descriptor.
        for k in &keys {
            let p = t.route(k).unwrap();
            if chosen.contains(&p) {
                let q = r.route(k).unwrap();
                assert_eq!(r.descriptor(q), t.descriptor(p), "key {k:?}");
            }
        }
        // A descriptor that overlaps a restored one is refused; so is restoring after inserts.
        assert!(r.ensure_partition(&descs[0], true).is_err());
        let k = b"zz".to_vec();
        let off = log.add(&k);
        r.insert(&k, off, &log).unwrap();
        assert!(r.ensure_partition(&descs[1], true).is_err());
    }

    fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..3),
            proptest::collection::vec(any::<u8>(), 0..12),
            (0u16..400).prop_map(|i| format!("shared/long/prefix/{i}").into_bytes()),
            (0u16..300).prop_map(|i| {
                let mut v = vec![0u8; 5];
                v.extend(i.to_be_bytes());
                v
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn behaves_like_a_hash_map(ops in proptest::collection::vec((key_strategy(), any::<bool>()), 1..1500)) {
            let log = Log::default();
            let mut t = RhTree::new(RhOptions { leaf_buckets: 2, t_normal: 2, max_leaf_nodes: 100_000 });
            let mut m: HashMap<Vec<u8>, u64> = HashMap::new();
            for (k, del) in ops {
                if del {
                    let got = t.remove_top(&k, &log).unwrap();
                    prop_assert_eq!(got, m.remove(&k));
                } else {
                    let off = log.add(&k);
                    let r = t.insert(&k, off, &log).unwrap();
                    match m.insert(k.clone(), off) {
                        Some(old) => prop_assert!(matches!(r, Insert::Updated(_, o) if o == old)),
                        None => prop_assert!(matches!(r, Insert::Inserted(_))),
                    }
                }
                prop_assert_eq!(t.get(&k, &log).unwrap().map(|x| x.1), m.get(&k).copied());
            }
            check_all(&t, &log, &m);
        }
    }
}
