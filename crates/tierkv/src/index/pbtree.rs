//! A persistent B+-tree in PM in the style of FAST & FAIR (Hwang et al., FAST '18), as
//! SLM-DB uses it: byte-string keys mapped to location objects {file, block offset, block
//! size}. Format: docs/format/slmdb.md ("B+-tree").
//!
//! # Structure
//! A node is 512 bytes: a 64-byte header (magic, level, `sibling`, `leftmost` child for inner
//! nodes, `low` = the separator record that names this node in its parent, checksum over the
//! immutable fields) and 56 slots of 8 bytes. Slots hold addresses of immutable *records*
//! (`crc | kind | klen | a | b | c | key`) in strictly increasing key order, terminated by a
//! zero slot; every slot after the terminator is zero. A leaf record holds a key and its
//! location (`a` = file, `b` = block offset, `c` = block size); an inner record a separator
//! key and the child (`a`) holding keys `>=` it. Because one slot is one 8-byte word, every
//! change to a node is a sequence of failure-atomic 8-byte stores:
//!
//! - **update** of a present key: write and persist a new record, store its address into the
//!   key's slot, persist (the old record is freed after);
//! - **insert** (FAST): write and persist the record, then shift the slots right one by one
//!   from the terminator down to the insert position (each 8-byte store copies its left
//!   neighbour), persisting a cache line before the shift moves into the line before it,
//!   and finally store the new address at the insert position. At every instant the slots
//!   read as the old or new sorted array with at most one adjacent duplicate, which readers
//!   skip ([`PTree::node_entries`]);
//! - **delete**: the mirror image, shifting left and zeroing the last slot;
//! - **split** (FAIR): a full node copies its upper half into a new node whose `sibling` is
//!   the old sibling and whose `low` is a new separator record, persists it, stores the new
//!   node into the old node's `sibling` (8 bytes, persisted), then truncates the old node by
//!   storing a zero at the split point (persisted) and zeroes the stale tail; the separator
//!   is then inserted into the parent the same way (a new root is built and published by
//!   one 8-byte store into the anchor).
//!
//! # Recovery
//! [`PTree::open`] repairs what a crash can leave (FAIR repairs lazily on the next write;
//! here it is done once at open so runtime readers never see it): in every node, adjacent
//! duplicates are removed and slots after the first zero are zeroed; a node whose sibling
//! carries a `low` key drops entries `>=` that key (a split that crashed before
//! truncating); and if the leaves reached by descending the inner nodes differ from the leaf
//! sibling chain, or the root has a sibling (a split that crashed before its parent insert),
//! the inner levels are rebuilt from the leaf chain and published with one 8-byte store
//! into the anchor. A crash during repair leaves the old tree, which is repaired again.
//!
//! # Concurrency
//! The tree is not internally synchronised: the owner holds it behind a lock (readers
//! shared, the single writer exclusive), as SLM-DB's LevelDB base does. PM space comes from
//! the shared [`Heap`]; records and nodes freed by an operation are returned right after the
//! store that unlinks them is persisted, since nothing durable refers to them any more.

use std::ops::Bound;

use parking_lot::Mutex;

use crate::error::Result;
use crate::format::crc;
use crate::pm::heap::{alloc_or_grow, Heap};
use crate::pm::Region;

/// Node size in bytes.
pub const NODE: u64 = 512;
/// Slots per node (the last is always the zero terminator).
pub const SLOTS: usize = 56;
/// Most entries a node holds.
pub const CAP: usize = SLOTS - 1;
/// Node magic.
pub const NODE_MAGIC: u32 = 0x4e54_4250; // "PBTN"
/// Record header bytes.
pub const REC_HEADER: u64 = 32;
const KIND_LEAF: u8 = 1;
const KIND_INNER: u8 = 2;

/// Where a key's current version lives on disk (SLM-DB's location object), plus where in
/// the block its entry starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Loc {
    /// SSTable file number.
    pub file: u64,
    /// Offset of the data block holding the key.
    pub offset: u64,
    /// Size of that block (checksum included).
    pub size: u32,
    /// Offset of the key's entry in the block's payload, when known: a reader decodes that
    /// entry alone, reading none before it (and can prefetch it). `None` in records written
    /// before the field existed and where a recovery path rebuilds a location from the
    /// block alone; readers then search the block (the paper's location object).
    pub entry: Option<u32>,
}

impl Loc {
    /// The record word that stores [`Loc::entry`]: offset + 1, 0 for none.
    fn entry_word(&self) -> u32 {
        // (An offset of u32::MAX cannot be stored: written as not known.)
        self.entry.and_then(|p| p.checked_add(1)).unwrap_or(0)
    }

    /// Whether `other` names the same block of the same file (the location object proper;
    /// the entry offset only speeds the read up).
    pub fn same_place(&self, other: &Loc) -> bool {
        (self.file, self.offset, self.size) == (other.file, other.offset, other.size)
    }
}

/// Encode a record: `crc u32 | kind u8 | 0 u8 | klen u16 | a u64 | b u64 | c u32 | d u32 |
/// key`. A leaf's `d` is its entry's offset in the block + 1 (0: not known); an inner
/// record's is 0.
pub fn encode_record(kind: u8, key: &[u8], a: u64, b: u64, c: u32, d: u32) -> Vec<u8> {
    let mut r = Vec::with_capacity(REC_HEADER as usize + key.len());
    r.extend_from_slice(&[0; 4]);
    r.push(kind);
    r.push(0);
    r.extend_from_slice(&(key.len() as u16).to_le_bytes());
    r.extend_from_slice(&a.to_le_bytes());
    r.extend_from_slice(&b.to_le_bytes());
    r.extend_from_slice(&c.to_le_bytes());
    r.extend_from_slice(&d.to_le_bytes());
    r.extend_from_slice(key);
    let c = crc::masked(r.get(4..).unwrap_or(&[]));
    if let Some(h) = r.get_mut(..4) {
        h.copy_from_slice(&c.to_le_bytes());
    }
    r
}

/// Encode a node header (64 bytes): `magic u32 | level u8 | 0 ×3 | crc u32 | 0 u32 |
/// sibling u64 | leftmost u64 | low u64 | 0 ×24`; the crc covers magic, level, leftmost and low.
pub fn encode_header(level: u8, sibling: u64, leftmost: u64, low: u64) -> [u8; 64] {
    let mut h = [0u8; 64];
    h[0..4].copy_from_slice(&NODE_MAGIC.to_le_bytes());
    h[4] = level;
    h[16..24].copy_from_slice(&sibling.to_le_bytes());
    h[24..32].copy_from_slice(&leftmost.to_le_bytes());
    h[32..40].copy_from_slice(&low.to_le_bytes());
    let c = crc::masked_parts(&[&h[0..8], &h[24..40]]);
    h[8..12].copy_from_slice(&c.to_le_bytes());
    h
}

/// A decoded node header.
#[derive(Debug, Clone, Copy)]
struct Header {
    level: u8,
    leftmost: u64,
    low: u64,
}

fn slot_addr(node: u64, i: usize) -> u64 {
    node + 64 + 8 * i as u64
}

/// A node's entries, without a heap allocation.
#[derive(Debug, Clone, Copy)]
pub struct Entries {
    buf: [u64; SLOTS],
    len: usize,
}

impl std::ops::Deref for Entries {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        &self.buf[..self.len]
    }
}

/// A path step: node and the index of the entry followed (-1 = leftmost).
type Path = Vec<(u64, isize)>;

/// The persistent B+-tree. See the module docs.
#[derive(Debug)]
pub struct PTree {
    /// Address of the anchor line: `magic u64 | root u64 | 0 ×48`.
    anchor: u64,
    root: u64,
    len: u64,
}

/// Anchor magic.
pub const ANCHOR_MAGIC: u64 = 0x524f_4f54_4254_4b54; // "TKTBTOOR"

impl PTree {
    /// Lay out an empty tree (one empty leaf) with its anchor at `anchor` (64 bytes the
    /// caller owns).
    pub fn create(region: &Region, heap: &Mutex<Heap>, anchor: u64) -> Result<PTree> {
        let leaf = new_node(region, heap, 0, 0, 0, 0, &[])?;
        let mut a = [0u8; 64];
        a[0..8].copy_from_slice(&ANCHOR_MAGIC.to_le_bytes());
        a[8..16].copy_from_slice(&leaf.to_le_bytes());
        // SAFETY: the anchor line belongs to the caller, who is creating the tree.
        unsafe { region.write(anchor, &a)? };
        region.persist(anchor, 64);
        Ok(PTree { anchor, root: leaf, len: 0 })
    }

    /// Open the tree anchored at `anchor` and list every PM extent it references (for
    /// rebuilding the heap). Call [`PTree::recover`] next, once the heap knows its free
    /// space, to repair what a crash left.
    pub fn open(region: &Region, anchor: u64) -> Result<(PTree, Vec<(u64, u64)>)> {
        let a = region.slice_checked(anchor, 16, "B+-tree anchor")?;
        let magic = u64::from_le_bytes(a.get(0..8).and_then(|s| s.try_into().ok()).unwrap_or([0; 8]));
        if magic != ANCHOR_MAGIC {
            return Err(region.corruption(anchor, "bad B+-tree anchor magic"));
        }
        let root = region.load_u64_atomic(anchor + 8)?;
        let t = PTree { anchor, root, len: 0 };
        let used = t.extents(region)?;
        Ok((t, used))
    }

    /// Repair what a crash left (module docs) and count the keys. Space the repair
    /// unlinks stays allocated until the next open rebuilds the heap.
    pub fn recover(&mut self, region: &Region, heap: &Mutex<Heap>) -> Result<()> {
        let leaves = self.repair(region, heap)?;
        let mut n = 0;
        for l in leaves {
            n += Self::node_entries(region, l)?.len() as u64;
        }
        self.len = n;
        Ok(())
    }

    /// Keys in the tree.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn header(&self, r: &Region, node: u64) -> Result<Header> {
        read_header(r, node)
    }

    /// A node's entries (record addresses), skipping the adjacent duplicate a shift leaves.
    /// The slots are read with one view: writers hold the tree exclusively (module docs).
    pub fn node_entries(r: &Region, node: u64) -> Result<Entries> {
        let raw = r.slice_checked(node + 64, 8 * SLOTS, "B+-tree node slots")?;
        let mut out = Entries { buf: [0; SLOTS], len: 0 };
        for w in raw.chunks_exact(8) {
            let v = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
            if v == 0 {
                break;
            }
            if out.len == 0 || out.buf[out.len - 1] != v {
                out.buf[out.len] = v;
                out.len += 1;
            }
        }
        Ok(out)
    }

    /// Descend to the leaf that holds `key`; returns the path (root first).
    fn descend(&self, r: &Region, key: &[u8]) -> Result<(u64, Path)> {
        self.descend_v(r, key, false)
    }

    /// [`Self::descend`], verifying the checksum of every record compared on the way when
    /// `verify` (a damaged key must not silently misdirect a search).
    fn descend_v(&self, r: &Region, key: &[u8], verify: bool) -> Result<(u64, Path)> {
        let mut node = self.root;
        let mut path = Path::new();
        for _ in 0..64 {
            let h = self.header(r, node)?;
            if h.level == 0 {
                return Ok((node, path));
            }
            let e = Self::node_entries(r, node)?;
            let i = upper_bound(r, &e, key, verify)? as isize - 1;
            path.push((node, i));
            node = if i < 0 { h.leftmost } else { record(r, e[i as usize])?.a };
        }
        Err(r.corruption(node, "B+-tree deeper than 64 levels (cycle?)"))
    }

    /// The location of `key`.
    ///
    /// A hit verifies the record it returns. A miss is confirmed by a second search that
    /// verifies every record it compares, so a damaged key is `Corruption`, never a silently
    /// missing key (misses pay for it; hits do not).
    pub fn get(&self, r: &Region, key: &[u8]) -> Result<Option<Loc>> {
        for verify in [false, true] {
            let (leaf, _) = self.descend_v(r, key, verify)?;
            let e = Self::node_entries(r, leaf)?;
            if let Ok(i) = find(r, &e, key, verify)? {
                let rec = record_verified(r, e[i])?;
                return Ok(Some(rec.loc()));
            }
        }
        Ok(None)
    }

    /// Map `key` to `loc`; returns the previous location.
    pub fn put(&mut self, r: &Region, heap: &Mutex<Heap>, key: &[u8], loc: Loc) -> Result<Option<Loc>> {
        let (leaf, path) = self.descend(r, key)?;
        let e = Self::node_entries(r, leaf)?;
        let rec =
            new_record(r, heap, &encode_record(KIND_LEAF, key, loc.file, loc.offset, loc.size, loc.entry_word()))?;
        match find(r, &e, key, false)? {
            Ok(i) => {
                let old = e[i];
                let prev = record(r, old)?;
                r.store_u64_atomic(slot_addr(leaf, i), rec)?;
                r.persist(slot_addr(leaf, i), 8);
                free_record(r, heap, old)?;
                Ok(Some(prev.loc()))
            }
            Err(i) => {
                self.insert_entry(r, heap, leaf, path, i, rec, key)?;
                self.len += 1;
                Ok(None)
            }
        }
    }

    /// Remove `key`; returns its location.
    pub fn remove(&mut self, r: &Region, heap: &Mutex<Heap>, key: &[u8]) -> Result<Option<Loc>> {
        let (leaf, _) = self.descend(r, key)?;
        let e = Self::node_entries(r, leaf)?;
        let Ok(i) = find(r, &e, key, false)? else { return Ok(None) };
        let old = e[i];
        let prev = record(r, old)?;
        // Shift left: slot[j] = slot[j+1], persisting a line before moving to the next.
        let n = e.len();
        for j in i..n - 1 {
            r.store_u64_atomic(slot_addr(leaf, j), e[j + 1])?;
            if (j + 1) % 8 == 0 || j + 1 == n - 1 {
                r.persist(slot_addr(leaf, j), 8);
            }
        }
        r.store_u64_atomic(slot_addr(leaf, n - 1), 0)?;
        r.persist(slot_addr(leaf, n - 1), 8);
        free_record(r, heap, old)?;
        self.len -= 1;
        Ok(Some(prev.loc()))
    }

    /// Insert record `rec` (key `key`) at index `i` of `node` (entries `e`), splitting when full.
    #[allow(clippy::too_many_arguments)]
    fn insert_entry(
        &mut self,
        r: &Region,
        heap: &Mutex<Heap>,
        node: u64,
        mut path: Path,
        i: usize,
        rec: u64,
        key: &[u8],
    ) -> Result<()> {
        let e = Self::node_entries(r, node)?;
        if e.len() < CAP {
            shift_insert(r, node, &e, i, rec)?;
            return Ok(());
        }
        // Split (FAIR). Leaves: the new node takes entries [m..); its separator is its first key.
        // Inner: entry m moves up; the new node's leftmost is entry m's child.
        let h = self.header(r, node)?;
        let m = e.len() / 2;
        let sibling = r.load_u64_atomic(node + 16)?;
        let (sep_key, new_left, upper): (Vec<u8>, u64, &[u64]) = if h.level == 0 {
            (record(r, e[m])?.key.to_vec(), 0, &e[m..])
        } else {
            let rm = record(r, e[m])?;
            (rm.key.to_vec(), rm.a, &e[m + 1..])
        };
        let new = alloc(r, heap, NODE)?;
        let sep = new_record(r, heap, &encode_record(KIND_INNER, &sep_key, new, 0, 0, 0))?;
        write_node(r, new, h.level, sibling, new_left, sep, upper)?;
        r.store_u64_atomic(node + 16, new)?;
        r.persist(node + 16, 8);
        r.store_u64_atomic(slot_addr(node, m), 0)?;
        r.persist(slot_addr(node, m), 8);
        for j in m + 1..e.len() {
            r.store_u64_atomic(slot_addr(node, j), 0)?;
        }
        r.persist(slot_addr(node, m), (8 * (e.len() - m)) as u64);
        // (In an inner split, entry m's record is not freed: it stays the `low` of its
        // child, now the new node's leftmost.)
        // Publish the separator in the parent (or a new root).
        match path.pop() {
            Some((parent, pi)) => {
                self.insert_entry(r, heap, parent, path, (pi + 1) as usize, sep, &sep_key)?;
            }
            None => {
                let root = alloc(r, heap, NODE)?;
                write_node(r, root, h.level + 1, 0, node, 0, &[sep])?;
                r.store_u64_atomic(self.anchor + 8, root)?;
                r.persist(self.anchor + 8, 8);
                self.root = root;
            }
        }
        // Now insert the pending entry into the half it belongs to.
        let target = if key >= sep_key.as_slice() { new } else { node };
        let te = Self::node_entries(r, target)?;
        let ti = upper_bound(r, &te, key, false)?;
        shift_insert(r, target, &te, ti, rec)
    }

    /// Up to `max` entries with keys in `[start, ..)` (or `(start, ..)` when `exclusive`),
    /// in key order, stopping before `end` (exclusive) when given.
    pub fn range(
        &self,
        r: &Region,
        start: &[u8],
        exclusive: bool,
        end: Option<&[u8]>,
        max: usize,
    ) -> Result<Vec<(Vec<u8>, Loc)>> {
        let from = if exclusive { Bound::Excluded(start) } else { Bound::Included(start) };
        let mut out = Vec::new();
        self.walk(r, from, true, max, |k, loc| {
            if end.is_some_and(|end| k >= end) {
                return false;
            }
            out.push((k.to_vec(), loc));
            true
        })?;
        Ok(out)
    }

    /// Call `f` on up to `max` entries beyond `from`, each record verified: ascending when
    /// `forward` (`Unbounded` = from the first key), else descending (`Unbounded` = from the
    /// last key, `Included(k)` = from the last key `<= k`). `f` returns false to stop.
    /// Returns true when the tree ran out of entries in that direction first.
    ///
    /// Forward, the walk follows the leaf chain. Backward (leaves have no left link), each
    /// leaf is found by a descent that takes, at every inner node, the last child whose
    /// separator is below the bound; the deepest separator taken is the leaf's lower bound,
    /// and the next leaf is found by a descent below it. Comparisons on the way verify the
    /// records they read, so a damaged key is `Corruption`, never a silently skipped range.
    pub fn walk(
        &self,
        r: &Region,
        from: Bound<&[u8]>,
        forward: bool,
        max: usize,
        mut f: impl FnMut(&[u8], Loc) -> bool,
    ) -> Result<bool> {
        let mut n = 0usize;
        if max == 0 {
            return Ok(false);
        }
        if forward {
            let start = match from {
                Bound::Included(k) | Bound::Excluded(k) => k,
                Bound::Unbounded => &[],
            };
            let (mut leaf, _) = self.descend_v(r, start, true)?;
            let mut first = true;
            let mut hops = 0u64;
            while leaf != 0 {
                let e = Self::node_entries(r, leaf)?;
                let at = match (first, from) {
                    (true, Bound::Included(k)) => lower_bound(r, &e, k, true)?,
                    (true, Bound::Excluded(k)) => upper_bound(r, &e, k, true)?,
                    _ => 0,
                };
                first = false;
                let recs = e.get(at..).unwrap_or(&[]);
                prefetch_records(r, recs.get(..max - n).unwrap_or(recs));
                for &a in recs {
                    let rec = record_verified(r, a)?;
                    n += 1;
                    if !f(rec.key, rec.loc()) || n >= max {
                        return Ok(false);
                    }
                }
                leaf = r.load_u64_atomic(leaf + 16)?;
                hops += 1;
                if hops > 1 << 40 {
                    return Err(r.corruption(leaf, "leaf chain does not end"));
                }
            }
            return Ok(true);
        }
        let mut bound: Option<Vec<u8>> = None; // Excluded(bound) after the first leaf
        for _ in 0..(1u64 << 40) {
            let b = match &bound {
                Some(k) => Bound::Excluded(k.as_slice()),
                None => from,
            };
            let (leaf, lo) = self.descend_below(r, b)?;
            let e = Self::node_entries(r, leaf)?;
            let end = match b {
                Bound::Unbounded => e.len(),
                Bound::Included(k) => upper_bound(r, &e, k, true)?,
                Bound::Excluded(k) => lower_bound(r, &e, k, true)?,
            };
            let recs = e.get(..end).unwrap_or(&[]);
            prefetch_records(r, recs.get(recs.len().saturating_sub(max - n)..).unwrap_or(recs));
            for &a in recs.iter().rev() {
                let rec = record_verified(r, a)?;
                n += 1;
                if !f(rec.key, rec.loc()) || n >= max {
                    return Ok(false);
                }
            }
            match lo {
                Some(lo) => bound = Some(lo),
                None => return Ok(true),
            }
        }
        Err(r.corruption(self.root, "backward walk does not end"))
    }

    /// Descend to the leaf holding the last key within `b` (`<= k`, `< k`, or the last
    /// key). Returns the leaf and its lower bound: the deepest separator taken on the way
    /// (every key of the leaf is `>=` it), `None` for the leftmost leaf.
    fn descend_below(&self, r: &Region, b: Bound<&[u8]>) -> Result<(u64, Option<Vec<u8>>)> {
        let mut node = self.root;
        let mut lo: Option<Vec<u8>> = None;
        for _ in 0..64 {
            let h = self.header(r, node)?;
            if h.level == 0 {
                return Ok((node, lo));
            }
            let e = Self::node_entries(r, node)?;
            let upto = match b {
                Bound::Unbounded => e.len(),
                Bound::Included(k) => upper_bound(r, &e, k, true)?,
                Bound::Excluded(k) => lower_bound(r, &e, k, true)?,
            };
            node = match upto.checked_sub(1).and_then(|i| e.get(i)) {
                Some(&a) => {
                    let rec = record_verified(r, a)?;
                    lo = Some(rec.key.to_vec());
                    rec.a
                }
                None => h.leftmost,
            };
        }
        Err(r.corruption(node, "B+-tree deeper than 64 levels (cycle?)"))
    }

    /// Call `f` on every entry in key order (in chunks, so memory stays bounded).
    pub fn for_each(&self, r: &Region, mut f: impl FnMut(&[u8], Loc) -> Result<()>) -> Result<()> {
        let mut start = Vec::new();
        let mut first = true;
        loop {
            let chunk = self.range(r, &start, !first, None, 4096)?;
            first = false;
            for (k, loc) in &chunk {
                f(k, *loc)?;
            }
            match chunk.last() {
                Some((k, _)) if chunk.len() == 4096 => start = k.clone(),
                _ => return Ok(()),
            }
        }
    }

    /// Every leaf in chain order, starting at the leftmost.
    fn leaf_chain(&self, r: &Region) -> Result<Vec<u64>> {
        let mut node = self.root;
        for _ in 0..64 {
            let h = self.header(r, node)?;
            if h.level == 0 {
                break;
            }
            node = h.leftmost;
        }
        let mut chain = Vec::new();
        let mut seen = std::collections::HashSet::new();
        while node != 0 {
            if !seen.insert(node) {
                return Err(r.corruption(node, "cycle in the B+-tree leaf chain"));
            }
            let h = self.header(r, node)?;
            if h.level != 0 {
                return Err(r.corruption(node, "inner node in the leaf chain"));
            }
            chain.push(node);
            node = r.load_u64_atomic(node + 16)?;
        }
        Ok(chain)
    }

    /// Nodes of every level, by descending the inner nodes (root first per level).
    fn descent_levels(&self, r: &Region) -> Result<Vec<Vec<u64>>> {
        let mut levels = vec![vec![self.root]];
        while let Some(cur) = levels.last() {
            let Some(&first) = cur.first() else { break };
            if self.header(r, first)?.level == 0 {
                break;
            }
            let mut next = Vec::new();
            for &n in cur {
                let h = self.header(r, n)?;
                next.push(h.leftmost);
                for &a in Self::node_entries(r, n)?.iter() {
                    next.push(record(r, a)?.a);
                }
            }
            if levels.len() > 64 {
                return Err(r.corruption(self.root, "B+-tree deeper than 64 levels"));
            }
            levels.push(next);
        }
        Ok(levels)
    }

    /// Every node of every level, by following the sibling chain from each level's
    /// leftmost node (a superset of what descent reaches: it includes the new half of a
    /// split whose separator never reached the parent).
    fn level_chains(&self, r: &Region) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut first = self.root;
        for _ in 0..64 {
            let h = self.header(r, first)?;
            let mut n = first;
            while n != 0 {
                if !seen.insert(n) {
                    return Err(r.corruption(n, "cycle in a B+-tree sibling chain"));
                }
                let nh = self.header(r, n)?;
                if nh.level != h.level {
                    return Err(r.corruption(n, "B+-tree sibling on another level"));
                }
                out.push(n);
                n = r.load_u64_atomic(n + 16)?;
            }
            if h.level == 0 {
                return Ok(out);
            }
            first = h.leftmost;
        }
        Err(r.corruption(self.root, "B+-tree deeper than 64 levels"))
    }

    /// Crash repair (module docs). Returns the leaf chain.
    fn repair(&mut self, r: &Region, heap: &Mutex<Heap>) -> Result<Vec<u64>> {
        // 1. Canonical slots and FAIR truncation, on every node of every level.
        for n in self.level_chains(r)? {
            self.canonicalize(r, n)?;
        }
        // 2. Inner levels agree with the leaf chain, and the root has no sibling?
        let chain = self.leaf_chain(r)?;
        let levels = self.descent_levels(r)?;
        let descent_leaves = levels.last().cloned().unwrap_or_default();
        let root_sibling = r.load_u64_atomic(self.root + 16)?;
        if descent_leaves != chain || root_sibling != 0 {
            self.rebuild_inner(r, heap, &chain)?;
        }
        Ok(chain)
    }

    /// Remove adjacent duplicates, zero the tail, and drop entries `>=` the sibling's low key.
    fn canonicalize(&self, r: &Region, node: u64) -> Result<()> {
        let raw: Vec<u64> = (0..SLOTS).map(|i| r.load_u64_atomic(slot_addr(node, i))).collect::<Result<_>>()?;
        let mut e = Self::node_entries(r, node)?.to_vec();
        let sib = r.load_u64_atomic(node + 16)?;
        if sib != 0 {
            let sh = self.header(r, sib)?;
            if sh.low != 0 {
                let low = record(r, sh.low)?.key.to_vec();
                let keep = lower_bound(r, &e, &low, true)?;
                e.truncate(keep);
            }
        }
        let mut want = e.clone();
        want.resize(SLOTS, 0);
        if want != raw {
            for (i, &v) in want.iter().enumerate() {
                if raw.get(i) != Some(&v) {
                    r.store_u64_atomic(slot_addr(node, i), v)?;
                }
            }
            r.persist(slot_addr(node, 0), 8 * SLOTS as u64);
        }
        Ok(())
    }

    /// Build fresh inner levels over `chain` and publish the new root with one store.
    fn rebuild_inner(&mut self, r: &Region, heap: &Mutex<Heap>, chain: &[u64]) -> Result<()> {
        // (child, separator record naming it; 0 for the leftmost)
        let mut level: Vec<(u64, u64)> = Vec::with_capacity(chain.len());
        for (i, &n) in chain.iter().enumerate() {
            let low = if i == 0 { 0 } else { self.header(r, n)?.low };
            if i > 0 && low == 0 {
                return Err(r.corruption(n, "B+-tree leaf after the first has no separator record"));
            }
            level.push((n, low));
        }
        let mut height = 1u8;
        let root = loop {
            if level.len() == 1 {
                break level[0].0;
            }
            let mut up: Vec<(u64, u64)> = Vec::new();
            for group in level.chunks(CAP + 1) {
                let node = alloc(r, heap, NODE)?;
                let (left, low) = group[0];
                let seps: Vec<u64> = group[1..].iter().map(|&(_, s)| s).collect();
                // Separator records point at their child already (`a`); an inner record
                // naming the new node is needed one level up, except for the leftmost.
                let up_sep = if low == 0 {
                    0
                } else {
                    let k = record(r, low)?.key.to_vec();
                    new_record(r, heap, &encode_record(KIND_INNER, &k, node, 0, 0, 0))?
                };
                write_node(r, node, height, 0, left, up_sep, &seps)?;
                up.push((node, up_sep));
            }
            // Link the new level's siblings.
            for w in up.windows(2) {
                r.store_u64_atomic(w[0].0 + 16, w[1].0)?;
                r.persist(w[0].0 + 16, 8);
            }
            level = up;
            height += 1;
        };
        r.store_u64_atomic(self.anchor + 8, root)?;
        r.persist(self.anchor + 8, 8);
        self.root = root;
        // Old inner nodes are unreachable now; their space is reclaimed when the heap is
        // rebuilt from the reachable extents (at the end of open).
        Ok(())
    }

    /// Every PM extent the tree uses: the nodes of every level's sibling chain, their
    /// entries' records and their separator (`low`) records.
    pub fn extents(&self, r: &Region) -> Result<Vec<(u64, u64)>> {
        let mut out = Vec::new();
        for n in self.level_chains(r)? {
            out.push((n, NODE));
            let h = self.header(r, n)?;
            if h.low != 0 {
                out.push((h.low, record_size(r, h.low)?));
            }
            for &a in Self::node_entries(r, n)?.iter() {
                out.push((a, record_size(r, a)?));
            }
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// Verify every node and record checksum and the key order; returns problems found.
    pub fn check(&self, r: &Region) -> Result<Vec<String>> {
        let mut problems = Vec::new();
        let mut prev: Option<Vec<u8>> = None;
        for l in self.leaf_chain(r)? {
            for &a in Self::node_entries(r, l)?.iter() {
                match record_verified(r, a) {
                    Ok(rec) => {
                        if prev.as_deref().is_some_and(|p| p >= rec.key) {
                            problems.push(format!("B+-tree leaf {l:#x}: keys out of order"));
                        }
                        prev = Some(rec.key.to_vec());
                    }
                    Err(e) => problems.push(e.to_string()),
                }
            }
        }
        for level in self.descent_levels(r)? {
            for n in level {
                if let Err(e) = self.header(r, n) {
                    problems.push(e.to_string());
                }
            }
        }
        Ok(problems)
    }
}

fn read_header(r: &Region, node: u64) -> Result<Header> {
    let h = r.slice_checked(node, 64, "B+-tree node")?;
    let u32_at = |o: usize| u32::from_le_bytes(h.get(o..o + 4).and_then(|s| s.try_into().ok()).unwrap_or([0; 4]));
    let u64_at = |o: usize| u64::from_le_bytes(h.get(o..o + 8).and_then(|s| s.try_into().ok()).unwrap_or([0; 8]));
    if u32_at(0) != NODE_MAGIC {
        return Err(r.corruption(node, "bad B+-tree node magic"));
    }
    let c = crc::masked_parts(&[h.get(0..8).unwrap_or(&[]), h.get(24..40).unwrap_or(&[])]);
    if c != u32_at(8) {
        return Err(r.corruption(node, "B+-tree node header checksum mismatch"));
    }
    Ok(Header { level: h.get(4).copied().unwrap_or(0), leftmost: u64_at(24), low: u64_at(32) })
}

/// A decoded record view.
#[derive(Debug)]
pub struct Rec<'a> {
    /// Key.
    pub key: &'a [u8],
    /// File (leaf) or child (inner).
    pub a: u64,
    /// Block offset (leaf).
    pub b: u64,
    /// Block size (leaf).
    pub c: u32,
    /// Entry offset in the block + 1, 0 when not known (leaf).
    pub d: u32,
}

impl Rec<'_> {
    /// A leaf record's location.
    fn loc(&self) -> Loc {
        Loc { file: self.a, offset: self.b, size: self.c, entry: self.d.checked_sub(1) }
    }
}

fn record(r: &Region, addr: u64) -> Result<Rec<'_>> {
    Ok(record_bytes(r, addr)?.0)
}

/// A record and all its bytes (one view of the region for both).
fn record_bytes(r: &Region, addr: u64) -> Result<(Rec<'_>, &[u8])> {
    let h = r.slice_checked(addr, REC_HEADER as usize, "B+-tree record")?;
    let klen = u16::from_le_bytes([h.get(6).copied().unwrap_or(0), h.get(7).copied().unwrap_or(0)]) as usize;
    let all = r.slice_checked(addr, REC_HEADER as usize + klen, "B+-tree record")?;
    let u64_at = |o: usize| u64::from_le_bytes(all.get(o..o + 8).and_then(|s| s.try_into().ok()).unwrap_or([0; 8]));
    let u32_at = |o: usize| u32::from_le_bytes(all.get(o..o + 4).and_then(|s| s.try_into().ok()).unwrap_or([0; 4]));
    let rec = Rec {
        key: all.get(REC_HEADER as usize..).unwrap_or(&[]),
        a: u64_at(8),
        b: u64_at(16),
        c: u32_at(24),
        d: u32_at(28),
    };
    Ok((rec, all))
}

/// Start loading the first line of every record a walk is about to read: records lie
/// wherever the PM heap put them, so reading them one by one waits for a miss at each;
/// requested together, the misses overlap.
fn prefetch_records(r: &Region, recs: &[u64]) {
    for &a in recs {
        r.prefetch(a, 64);
    }
}

fn record_verified(r: &Region, addr: u64) -> Result<Rec<'_>> {
    let (rec, all) = record_bytes(r, addr)?;
    let stored = u32::from_le_bytes(all.get(0..4).and_then(|s| s.try_into().ok()).unwrap_or([0; 4]));
    if crc::masked(all.get(4..).unwrap_or(&[])) != stored {
        return Err(r.corruption(addr, "B+-tree record checksum mismatch"));
    }
    Ok(rec)
}

fn record_size(r: &Region, addr: u64) -> Result<u64> {
    let rec = record(r, addr)?;
    Ok((REC_HEADER + rec.key.len() as u64).div_ceil(64) * 64)
}

fn alloc(r: &Region, heap: &Mutex<Heap>, size: u64) -> Result<u64> {
    alloc_or_grow(&mut heap.lock(), r, size)
}

/// Store an encoded record ([`encode_record`]) in fresh PM, persisted; returns its address.
fn new_record(r: &Region, heap: &Mutex<Heap>, bytes: &[u8]) -> Result<u64> {
    let addr = alloc(r, heap, bytes.len() as u64)?;
    // SAFETY: freshly allocated PM that no node references yet.
    unsafe { r.write(addr, bytes)? };
    r.persist(addr, bytes.len() as u64);
    Ok(addr)
}

fn free_record(r: &Region, heap: &Mutex<Heap>, addr: u64) -> Result<()> {
    let size = record_size(r, addr)?;
    heap.lock().free(addr, size);
    Ok(())
}

fn write_node(r: &Region, node: u64, level: u8, sibling: u64, leftmost: u64, low: u64, slots: &[u64]) -> Result<()> {
    let mut b = vec![0u8; NODE as usize];
    b[..64].copy_from_slice(&encode_header(level, sibling, leftmost, low));
    for (i, s) in slots.iter().take(CAP).enumerate() {
        let o = 64 + 8 * i;
        b[o..o + 8].copy_from_slice(&s.to_le_bytes());
    }
    // SAFETY: freshly allocated node that nothing references until it is published.
    unsafe { r.write(node, &b)? };
    r.persist(node, NODE);
    Ok(())
}

fn new_node(
    r: &Region,
    heap: &Mutex<Heap>,
    level: u8,
    sibling: u64,
    leftmost: u64,
    low: u64,
    s: &[u64],
) -> Result<u64> {
    let n = alloc(r, heap, NODE)?;
    write_node(r, n, level, sibling, leftmost, low, s)?;
    Ok(n)
}

/// FAST insert of `rec` at index `i` of `node`, whose entries are `e` (fewer than CAP).
fn shift_insert(r: &Region, node: u64, e: &[u64], i: usize, rec: u64) -> Result<()> {
    let n = e.len();
    // slot[j] = slot[j-1] for j = n down to i+1; persist the line of slot j before the shift
    // moves into the previous line.
    for j in (i + 1..=n).rev() {
        r.store_u64_atomic(slot_addr(node, j), e[j - 1])?;
        if j % 8 == 0 {
            r.persist(slot_addr(node, j), 8);
        }
    }
    r.store_u64_atomic(slot_addr(node, i), rec)?;
    r.persist(slot_addr(node, i), 8);
    Ok(())
}

/// Index of `key` in entries `e` (Ok) or where it would be inserted (Err).
fn find(r: &Region, e: &[u64], key: &[u8], verify: bool) -> Result<std::result::Result<usize, usize>> {
    let (mut lo, mut hi) = (0usize, e.len());
    while lo < hi {
        let mid = (lo + hi) / 2;
        let rec = if verify { record_verified(r, e[mid])? } else { record(r, e[mid])? };
        match rec.key.cmp(key) {
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
            std::cmp::Ordering::Equal => return Ok(Ok(mid)),
        }
    }
    Ok(Err(lo))
}

/// First index whose key is `> key`.
fn upper_bound(r: &Region, e: &[u64], key: &[u8], verify: bool) -> Result<usize> {
    Ok(match find(r, e, key, verify)? {
        Ok(i) => i + 1,
        Err(i) => i,
    })
}

/// First index whose key is `>= key`.
fn lower_bound(r: &Region, e: &[u64], key: &[u8], verify: bool) -> Result<usize> {
    Ok(match find(r, e, key, verify)? {
        Ok(i) | Err(i) => i,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    //! The tree alone on the PM crash simulator: crash before every fence of
    //! insert/update/delete/split sequences; the reopened, repaired tree holds exactly the
    //! state before or after the operation in flight, passes `check`, and keeps working.
    use std::collections::BTreeMap;

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::pm::sim::SimDevice;
    use crate::pm::{Backing, RegionConfig, POOL_HEADER_LEN};

    const ANCHOR: u64 = 64;
    const HEAP: u64 = 128;

    fn region(dev: &SimDevice, create: bool) -> Region {
        Region::open(RegionConfig { create, ..RegionConfig::new(Backing::Sim(dev.clone()), 1 << 20, 7) }).unwrap()
    }

    fn heap_for(r: &Region, mut used: Vec<(u64, u64)>) -> Mutex<Heap> {
        used.sort_unstable();
        let mut h = Heap::new();
        for i in 0..r.pool_count() {
            let start = if i == 0 { HEAP } else { r.addr(i, POOL_HEADER_LEN) };
            let end = r.addr(i + 1, 0);
            let mine: Vec<(u64, u64)> = used.iter().copied().filter(|&(a, _)| a >= start && a < end).collect();
            h.add_space(start, end, &mine).unwrap();
        }
        Mutex::new(h)
    }

    /// Regression (found by the corruption sweep): a damaged key in a leaf record made `get`
    /// miss the key silently. A miss is now confirmed by a verified search.
    #[test]
    fn a_damaged_record_key_is_corruption_not_a_miss() {
        let dev = SimDevice::new();
        let r = region(&dev, true);
        let heap = heap_for(&r, vec![]);
        let mut t = PTree::create(&r, &heap, ANCHOR).unwrap();
        for i in 0..200u64 {
            let k = format!("key{i:06}").into_bytes();
            t.put(&r, &heap, &k, Loc { file: i, offset: 0, size: 1, entry: None }).unwrap();
        }
        let (leaf, _) = t.descend(&r, b"key000100").unwrap();
        let e = PTree::node_entries(&r, leaf).unwrap();
        let hit = e.iter().copied().find(|a| record(&r, *a).unwrap().key == b"key000100").unwrap();
        // Flip the key's last byte: `key000100` becomes `key000101`'s twin.
        let at = hit + REC_HEADER + 8;
        let b = r.slice(at, 1).unwrap()[0];
        // SAFETY: single-threaded test; nothing else uses the region.
        unsafe { r.write(at, &[b ^ 1]).unwrap() };
        assert!(t.get(&r, b"key000100").unwrap_err().is_corruption());
        // The twin key reads its own record, or meets the damaged one: never a wrong value.
        match t.get(&r, b"key000101") {
            Ok(l) => assert_eq!(l.map(|l| l.file), Some(101)),
            Err(e) => assert!(e.is_corruption()),
        }
        assert_eq!(t.get(&r, b"key000150").unwrap().map(|l| l.file), Some(150), "other keys still read");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(Vec<u8>, u64),
        Del(Vec<u8>),
    }

    fn ops(seed: u64, n: usize, space: u32, del_pct: u32) -> Vec<Op> {
        let mut rng = SmallRng::seed_from_u64(seed);
        (0..n)
            .map(|i| {
                let k = format!("key{:06}", rng.random_range(0..space)).into_bytes();
                if rng.random_range(0..100) < del_pct {
                    Op::Del(k)
                } else {
                    Op::Put(k, i as u64 + 1)
                }
            })
            .collect()
    }

    type Model = BTreeMap<Vec<u8>, u64>;

    fn apply(t: &mut PTree, r: &Region, h: &Mutex<Heap>, m: &mut Model, op: &Op) {
        match op {
            Op::Put(k, f) => {
                let old = t
                    .put(
                        r,
                        h,
                        k,
                        Loc { file: *f, offset: *f * 10, size: 7, entry: (f % 3 != 0).then_some(*f as u32 * 3) },
                    )
                    .unwrap();
                assert_eq!(old.map(|l| l.file), m.insert(k.clone(), *f));
            }
            Op::Del(k) => {
                let old = t.remove(r, h, k).unwrap();
                assert_eq!(old.map(|l| l.file), m.remove(k));
            }
        }
    }

    fn contents(t: &PTree, r: &Region) -> Model {
        let all = t.range(r, b"", false, None, usize::MAX).unwrap();
        for (k, l) in &all {
            assert_eq!(t.get(r, k).unwrap(), Some(*l), "get disagrees with the leaf scan");
        }
        all.into_iter().map(|(k, l)| (k, l.file)).collect()
    }

    /// `walk` in both directions from every kind of bound, in batches of every size, over
    /// trees of several heights with deleted ranges (leaves emptied by deletes included),
    /// against the model.
    #[test]
    fn walk_matches_the_model_both_ways() {
        let dev = SimDevice::new();
        let r = region(&dev, true);
        let heap = heap_for(&r, vec![]);
        let mut t = PTree::create(&r, &heap, ANCHOR).unwrap();
        let mut m = Model::new();
        let mut rng = SmallRng::seed_from_u64(11);
        for (round, o) in [ops(1, 40, 60, 10), ops(2, 3000, 2500, 5), ops(3, 2500, 2500, 70)].iter().enumerate() {
            for op in o {
                apply(&mut t, &r, &heap, &mut m, op);
            }
            // A run of deletes empties whole leaves in the middle.
            if round == 1 {
                for i in 400..900u32 {
                    apply(&mut t, &r, &heap, &mut m, &Op::Del(format!("key{i:06}").into_bytes()));
                }
            }
            let keys: Vec<Vec<u8>> = m.keys().cloned().collect();
            for _ in 0..300 {
                let probe = format!("key{:06}", rng.random_range(0..2600u32)).into_bytes();
                let from = match rng.random_range(0..3) {
                    0 => Bound::Unbounded,
                    1 => Bound::Included(probe.as_slice()),
                    _ => Bound::Excluded(probe.as_slice()),
                };
                let forward = rng.random_bool(0.5);
                let max = [1usize, 7, 56, 200, usize::MAX][rng.random_range(0..5)];
                let mut got = Vec::new();
                let ran_out = t
                    .walk(&r, from, forward, max, |k, l| {
                        got.push((k.to_vec(), l.file));
                        true
                    })
                    .unwrap();
                let want: Vec<(Vec<u8>, u64)> = if forward {
                    m.range::<[u8], _>((from, Bound::Unbounded)).take(max).map(|(k, v)| (k.clone(), *v)).collect()
                } else {
                    m.range::<[u8], _>((Bound::Unbounded, from)).rev().take(max).map(|(k, v)| (k.clone(), *v)).collect()
                };
                assert_eq!(got, want, "round {round} from {from:?} forward {forward} max {max}");
                if got.len() < max {
                    assert!(ran_out, "fewer than asked means the tree ran out");
                }
            }
            assert!(!keys.is_empty());
        }
    }

    /// Crash before fence `n` (counted after creation); returns points verified, or None
    /// when the run ended before fence `n`.
    fn crash_at(o: &[Op], n: u64, frac: f64) -> Option<()> {
        let dev = SimDevice::new();
        let r = region(&dev, true);
        let heap = heap_for(&r, vec![]);
        let mut t = PTree::create(&r, &heap, ANCHOR).unwrap();
        dev.crash_before_fence(dev.fences() + n);
        let mut before = Model::new();
        let mut inflight = None;
        for (i, op) in o.iter().enumerate() {
            let mut after = before.clone();
            apply(&mut t, &r, &heap, &mut after, op);
            if dev.crashed() {
                inflight = Some((i, after));
                break;
            }
            before = after;
        }
        let (i, after) = inflight?;
        let dev2 = dev.simulate_crash(n, frac);
        let r2 = region(&dev2, false);
        let (mut t2, used) = PTree::open(&r2, ANCHOR).unwrap();
        let heap2 = heap_for(&r2, used);
        t2.recover(&r2, &heap2).unwrap();
        let got = contents(&t2, &r2);
        let ctx = format!("fence {n} op {i} {:?} evict {frac}", o[i]);
        assert!(got == before || got == after, "{ctx}: neither the old nor the new state");
        assert!(t2.check(&r2).unwrap().is_empty(), "{ctx}: check");
        assert_eq!(t2.len() as usize, got.len());
        // Keeps working: the rest of the ops.
        let mut m = got;
        for op in &o[i + 1..] {
            apply(&mut t2, &r2, &heap2, &mut m, op);
        }
        assert_eq!(contents(&t2, &r2), m, "{ctx}: after more ops");
        // And the space it uses is what a fresh open finds.
        let (_, used) = PTree::open(&r2, ANCHOR).unwrap();
        let mut sorted = used.clone();
        sorted.sort_unstable();
        for w in sorted.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{ctx}: overlapping extents");
        }
        Some(())
    }

    fn sweep(o: &[Op], step: u64) -> u64 {
        let mut n = 1;
        let mut points = 0;
        while crash_at(o, n, [0.0, 0.5, 1.0][(n % 3) as usize]).is_some() {
            points += 1;
            n += step;
        }
        points
    }

    #[test]
    fn crash_at_every_fence_of_leaf_splits_updates_and_deletes() {
        // 600 ops over 300 keys: leaf splits, a root split, updates and deletes.
        let o = ops(1, 600, 300, 25);
        let points = sweep(&o, 1);
        eprintln!("pbtree: {points} crash points (leaf level)");
        assert!(points > 1000);
    }

    #[test]
    fn crash_at_sampled_fences_of_inner_splits() {
        // 4000 inserts: more than 55 leaves, so inner nodes split and the root grows twice.
        let o = ops(2, 4000, 1_000_000, 0);
        let dev = SimDevice::new();
        let r = region(&dev, true);
        let heap = heap_for(&r, vec![]);
        let mut t = PTree::create(&r, &heap, ANCHOR).unwrap();
        let mut m = Model::new();
        for op in &o {
            apply(&mut t, &r, &heap, &mut m, op);
        }
        let height = t.descent_levels(&r).unwrap().len();
        assert!(height >= 3, "height {height}: no inner split exercised");
        let points = sweep(&o, 61);
        eprintln!("pbtree: {points} crash points (inner splits, every 61st fence)");
        assert!(points > 250);
    }

    #[test]
    fn readers_skip_the_duplicate_a_shift_leaves() {
        let dev = SimDevice::new();
        let r = region(&dev, true);
        let heap = heap_for(&r, vec![]);
        let mut t = PTree::create(&r, &heap, ANCHOR).unwrap();
        for i in [1u64, 3, 5] {
            t.put(&r, &heap, format!("k{i}").as_bytes(), Loc { file: i, offset: 0, size: 1, entry: None }).unwrap();
        }
        // Freeze a shift midway: slot 3 = slot 2 (a duplicate of "k5"), as an insert of "k4"
        // leaves it between its first and last store.
        let leaf = t.root;
        let e = PTree::node_entries(&r, leaf).unwrap();
        r.store_u64_atomic(slot_addr(leaf, 3), e[2]).unwrap();
        let got = t.range(&r, b"", false, None, 10).unwrap();
        let keys: Vec<&[u8]> = got.iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(keys, vec![b"k1".as_slice(), b"k3", b"k5"]);
        assert_eq!(t.get(&r, b"k5").unwrap().map(|l| l.file), Some(5));
        // Repair removes it for good.
        t.recover(&r, &heap).unwrap();
        assert_eq!(r.load_u64_atomic(slot_addr(leaf, 3)).unwrap(), 0);
    }
}
