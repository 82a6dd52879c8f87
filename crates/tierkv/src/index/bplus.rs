//! A DRAM B+-tree over byte-string keys, shared by the presets (PMEKV's key index tree,
//! HPDK's DRAM B+-tree).
//!
//! Nodes live in an arena and are addressed by [`NodeId`]. Leaves are doubly linked in key
//! order and carry a caller-defined [`LeafMeta`] (PMEKV keeps there the PM location of the
//! leaf's KeyNode and a dirty flag); the tree calls [`LeafMeta::touched`] on every leaf whose
//! entries change, including both halves of a split and the survivor of a merge.
//!
//! # Invariants
//! - Every leaf's keys are strictly increasing; leaf `n.next`'s first key is greater than
//!   `n`'s last key.
//! - An inner node has `keys.len() + 1` children; every key in `children[i]` is `< keys[i]`
//!   and every key in `children[i + 1]` is `>= keys[i]`.
//! - Only the root may be an empty leaf. Leaves hold at most `capacity` entries and inner
//!   nodes at most `capacity` keys. Deletion removes empty nodes and merges a leaf that
//!   falls under a quarter full into its right sibling when both fit in half a node; inner
//!   nodes are not rebalanced (they only shrink to one child), which keeps deletes cheap and
//!   costs at most one extra level after mass deletion.
//!
//! # Keys
//! Each node packs its keys into one buffer of its own ([`Keys`]): a walk over a leaf reads
//! consecutive bytes. With one heap allocation per key (before), keys lay wherever the
//! allocator put them in insertion order, and copying a batch of keys out of the leaves (a
//! range read's refill, [`BPlusTree::fill_batch`]) missed the cache at nearly every key:
//! 26 % of pmekv's `seekrandom` samples were that copy (perf, 500,000 × 1 KiB). Measured
//! after (`tierkv bench --engines pmekv,hpdk --workloads fillrandom,seekrandom,readrandom
//! --num 500000`, two interleaved pairs): pmekv `seekrandom` 40,270 / 36,563 → 49,529 /
//! 50,241 scans/s, `readrandom` 538,767 / 546,734 → 602,100 / 661,352; hpdk unchanged
//! (32,397 / 34,442 → 31,894 / 34,335 scans/s; not profiled). A key
//! costs its bytes, an 8-byte span and an 8-byte prefix (was: a 16-byte box, the
//! allocator's rounding and header, and the prefix).
//!
//! # Thread safety
//! The tree is a plain data structure (`&mut self` to modify); presets wrap it in a lock.

use std::ops::Bound;

/// The entries of one leaf and its meta, as [`BPlusTree::from_leaves`] takes them.
pub type LeafEntries<V, M> = (Vec<(Box<[u8]>, V)>, M);

/// Index of a node in the arena.
pub type NodeId = u32;

/// The keys of a node, sorted, their bytes packed in one buffer of the node's own, each
/// with an inline 8-byte big-endian prefix.
///
/// Searches compare prefixes first and read a key's bytes only when prefixes tie; a walk
/// over a leaf (a range read's batch copy) reads the node's keys from consecutive bytes,
/// not from one heap allocation per key scattered in insertion order. Zero padding keeps
/// prefix order consistent with byte order: `prefix(a) < prefix(b)` implies `a < b`.
///
/// # Invariants
/// - `spans[i]` is the `(offset, length)` of the `i`-th smallest key in `buf`; `pfx[i]` is
///   its prefix; spans do not overlap.
/// - `dead` is the number of bytes of `buf` no span covers (keys removed since the last
///   repack). A removal that leaves more dead bytes than live ones (and more than
///   [`REPACK_MIN`]) repacks the buffer, so `buf` stays under twice the live key bytes plus
///   [`REPACK_MIN`] and each removed byte is copied O(1) times amortised.
/// - Offsets fit in `u32`: the tree holds keys of at most [`MAX_KEY`] bytes and nodes of at
///   most [`MAX_CAPACITY`] (+ 1 during a split) keys, so `buf` stays far below 4 GiB.
#[derive(Debug, Default, Clone)]
pub struct Keys {
    buf: Vec<u8>,
    spans: Vec<(u32, u32)>,
    pfx: Vec<u64>,
    dead: usize,
}

/// Dead bytes a node's key buffer may hold before a removal repacks it, whatever its size.
const REPACK_MIN: usize = 256;

/// Longest key the tree holds (the store-wide limit, [`crate::options::MAX_KEY_SIZE`]).
pub const MAX_KEY: usize = crate::options::MAX_KEY_SIZE;

/// Largest node capacity; [`BPlusTree::new`] clamps to it.
pub const MAX_CAPACITY: usize = 4096;

/// The 8-byte big-endian, zero-padded prefix of `k`.
#[inline]
fn prefix(k: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = k.len().min(8);
    b[..n].copy_from_slice(&k[..n]);
    u64::from_be_bytes(b)
}

impl Keys {
    fn with_capacity(n: usize) -> Self {
        Keys { buf: Vec::new(), spans: Vec::with_capacity(n), pfx: Vec::with_capacity(n), dead: 0 }
    }

    fn from_keys<'a>(keys: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut out = Keys::default();
        for k in keys {
            out.push(k);
        }
        out
    }

    /// Number of keys.
    #[inline]
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// True when the node holds no key.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    #[inline]
    fn bytes(&self, (at, len): (u32, u32)) -> &[u8] {
        let (at, len) = (at as usize, len as usize);
        // The invariants make every span lie inside `buf`; an empty slice would only mean
        // a broken invariant, which `check_invariants` reports.
        self.buf.get(at..at + len).unwrap_or(&[])
    }

    /// The `i`-th smallest key.
    #[inline]
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        self.spans.get(i).map(|&s| self.bytes(s))
    }

    /// The smallest key.
    pub fn first(&self) -> Option<&[u8]> {
        self.get(0)
    }

    /// The largest key.
    pub fn last(&self) -> Option<&[u8]> {
        self.len().checked_sub(1).and_then(|i| self.get(i))
    }

    /// The keys in ascending order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &[u8]> + ExactSizeIterator + '_ {
        self.spans.iter().map(|&s| self.bytes(s))
    }

    /// Copy `k` to the end of the buffer; its span.
    fn store(&mut self, k: &[u8]) -> (u32, u32) {
        debug_assert!(k.len() <= MAX_KEY, "key of {} bytes", k.len());
        let at = self.buf.len();
        self.buf.extend_from_slice(k);
        // Within u32 by the invariants (at most MAX_CAPACITY + 1 keys of MAX_KEY bytes,
        // dead bytes at most the live ones plus REPACK_MIN).
        (at as u32, k.len() as u32)
    }

    fn push(&mut self, k: &[u8]) {
        let span = self.store(k);
        self.pfx.push(prefix(k));
        self.spans.push(span);
    }

    fn insert(&mut self, i: usize, k: &[u8]) {
        let span = self.store(k);
        self.pfx.insert(i, prefix(k));
        self.spans.insert(i, span);
    }

    /// Remove the `i`-th key; its length.
    fn remove(&mut self, i: usize) -> usize {
        self.pfx.remove(i);
        let (_, len) = self.spans.remove(i);
        self.forget(len as usize);
        len as usize
    }

    /// `len` more bytes of the buffer are dead; repack once they outweigh the live ones.
    fn forget(&mut self, len: usize) {
        self.dead += len;
        if self.dead > REPACK_MIN && self.dead > self.buf.len() - self.dead {
            #[cfg(test)]
            tests::REPACKS.with(|r| r.set(r.get() + 1));
            self.repack();
        }
    }

    /// Remove and return the largest key.
    fn pop(&mut self) -> Option<Box<[u8]>> {
        let span = self.spans.pop()?;
        self.pfx.pop();
        let k: Box<[u8]> = self.bytes(span).into();
        self.forget(k.len());
        Some(k)
    }

    /// Rewrite the buffer with the live keys only, in key order.
    fn repack(&mut self) {
        let mut buf = Vec::with_capacity(self.buf.len() - self.dead);
        for s in self.spans.iter_mut() {
            let (at, len) = (s.0 as usize, s.1 as usize);
            let start = buf.len();
            buf.extend_from_slice(self.buf.get(at..at + len).unwrap_or(&[]));
            *s = (start as u32, s.1);
        }
        self.buf = buf;
        self.dead = 0;
    }

    /// Move the keys from `at` on into a new `Keys` (packed), keeping the rest (repacked).
    fn split_off(&mut self, at: usize) -> Keys {
        let right = Keys::from_keys(self.spans[at..].iter().map(|&s| self.bytes(s)));
        for &(_, len) in &self.spans[at..] {
            self.dead += len as usize;
        }
        self.spans.truncate(at);
        self.pfx.truncate(at);
        self.repack();
        right
    }

    /// Move all of `other`'s keys (all greater than this node's) to the end.
    fn append(&mut self, other: &mut Keys) {
        for k in other.iter() {
            self.push(k);
        }
        *other = Keys::default();
    }

    #[inline]
    fn cmp_at(&self, i: usize, key: &[u8], kp: u64) -> std::cmp::Ordering {
        match self.pfx[i].cmp(&kp) {
            std::cmp::Ordering::Equal => self.bytes(self.spans[i]).cmp(key),
            o => o,
        }
    }

    /// Number of keys `< key` (with `inclusive`, `<= key`).
    #[inline]
    fn rank(&self, key: &[u8], inclusive: bool) -> usize {
        let kp = prefix(key);
        let (mut lo, mut hi) = (0, self.spans.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            let o = self.cmp_at(mid, key, kp);
            if o == std::cmp::Ordering::Less || (inclusive && o == std::cmp::Ordering::Equal) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// True when every prefix matches its key, every span lies inside the buffer without
    /// overlapping another, `dead` counts the rest of the buffer, and the dead bytes are at
    /// most the live ones (or [`REPACK_MIN`]).
    fn consistent(&self) -> bool {
        if self.spans.len() != self.pfx.len() {
            return false;
        }
        let mut spans: Vec<(u32, u32)> = self.spans.clone();
        spans.sort_unstable();
        let mut end = 0usize;
        let mut live = 0usize;
        for (at, len) in spans {
            let (at, len) = (at as usize, len as usize);
            if at < end || at + len > self.buf.len() {
                return false;
            }
            end = at + len;
            live += len;
        }
        live + self.dead == self.buf.len()
            && self.dead <= live.max(REPACK_MIN)
            && self.iter().zip(&self.pfx).all(|(k, p)| prefix(k) == *p)
    }

    /// `Ok(i)` if `key` is at `i`, else `Err(i)` where it would be inserted.
    #[inline]
    fn find(&self, key: &[u8]) -> Result<usize, usize> {
        let i = self.rank(key, false);
        if self.get(i) == Some(key) {
            Ok(i)
        } else {
            Err(i)
        }
    }
}

/// Per-leaf state kept by the owner of the tree.
pub trait LeafMeta: Default {
    /// The leaf's entries changed.
    fn touched(&mut self) {}
}

impl LeafMeta for () {}

/// A leaf: sorted keys with their values.
#[derive(Debug)]
pub struct Leaf<V, M> {
    /// Keys, strictly increasing.
    pub keys: Keys,
    /// Values, parallel to `keys`.
    pub vals: Vec<V>,
    /// Next leaf in key order.
    pub next: Option<NodeId>,
    /// Previous leaf in key order.
    pub prev: Option<NodeId>,
    /// Owner state.
    pub meta: M,
}

#[derive(Debug)]
enum Node<V, M> {
    Inner { keys: Keys, children: Vec<NodeId> },
    Leaf(Leaf<V, M>),
    Free,
}

/// Position of an entry: leaf and index inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pos {
    /// The leaf.
    pub leaf: NodeId,
    /// Index in the leaf.
    pub idx: usize,
}

/// The B+-tree. See the module docs.
#[derive(Debug)]
pub struct BPlusTree<V, M = ()> {
    nodes: Vec<Node<V, M>>,
    free: Vec<NodeId>,
    root: NodeId,
    capacity: usize,
    len: usize,
    key_bytes: usize,
}

impl<V, M: LeafMeta> BPlusTree<V, M> {
    /// An empty tree whose nodes hold up to `capacity` entries (clamped to 4..=[`MAX_CAPACITY`]).
    /// Keys must be at most [`MAX_KEY`] bytes.
    pub fn new(capacity: usize) -> Self {
        let leaf = Leaf { keys: Keys::default(), vals: Vec::new(), next: None, prev: None, meta: M::default() };
        BPlusTree {
            nodes: vec![Node::Leaf(leaf)],
            free: Vec::new(),
            root: 0,
            capacity: capacity.clamp(4, MAX_CAPACITY),
            len: 0,
            key_bytes: 0,
        }
    }

    /// Build a tree whose leaves are exactly `leaves`, in order. Each leaf must be non-empty,
    /// sorted, hold at most `capacity` entries, and lie entirely above the previous one;
    /// returns `None` otherwise.
    pub fn from_leaves(capacity: usize, leaves: Vec<LeafEntries<V, M>>) -> Option<Self> {
        let mut t = Self::new(capacity);
        if leaves.is_empty() {
            return Some(t);
        }
        t.nodes.clear();
        let mut level: Vec<(Box<[u8]>, NodeId)> = Vec::with_capacity(leaves.len());
        let mut last_key: Option<Box<[u8]>> = None;
        let n = leaves.len();
        for (i, (entries, meta)) in leaves.into_iter().enumerate() {
            if entries.is_empty() || entries.len() > t.capacity {
                return None;
            }
            let mut keys = Keys::with_capacity(entries.len());
            let mut vals = Vec::with_capacity(entries.len());
            for (k, v) in entries {
                if last_key.as_ref().is_some_and(|l| **l >= *k) {
                    return None;
                }
                last_key = Some(k.clone());
                t.key_bytes += k.len();
                keys.push(&k);
                vals.push(v);
            }
            t.len += keys.len();
            let id = i as NodeId;
            let first: Box<[u8]> = keys.first().unwrap_or_default().into();
            let prev = if i == 0 { None } else { Some(id - 1) };
            let next = if i + 1 == n { None } else { Some(id + 1) };
            t.nodes.push(Node::Leaf(Leaf { keys, vals, next, prev, meta }));
            level.push((first, id));
        }
        // Build inner levels bottom-up, `capacity` children per node at most.
        while level.len() > 1 {
            let mut up = Vec::with_capacity(level.len() / t.capacity + 1);
            for chunk in level.chunks(t.capacity) {
                let first = chunk.first().map(|c| c.0.clone()).unwrap_or_default();
                let children: Vec<NodeId> = chunk.iter().map(|c| c.1).collect();
                let keys = Keys::from_keys(chunk.iter().skip(1).map(|c| &*c.0));
                let id = t.nodes.len() as NodeId;
                t.nodes.push(Node::Inner { keys, children });
                up.push((first, id));
            }
            level = up;
        }
        t.root = level.first().map(|l| l.1).unwrap_or(0);
        Some(t)
    }

    /// Entries in the tree.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Node capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Approximate DRAM footprint in bytes (keys, values, node overhead).
    pub fn dram_bytes(&self) -> usize {
        // Per entry: its span and prefix in the node's `Keys`, its value; key bytes packed.
        let entry = std::mem::size_of::<(u32, u32)>() + std::mem::size_of::<u64>() + std::mem::size_of::<V>();
        self.key_bytes + self.len * entry + self.nodes.len() * std::mem::size_of::<Node<V, M>>()
    }

    fn alloc(&mut self, node: Node<V, M>) -> NodeId {
        if let Some(id) = self.free.pop() {
            self.nodes[id as usize] = node;
            id
        } else {
            self.nodes.push(node);
            (self.nodes.len() - 1) as NodeId
        }
    }

    fn release(&mut self, id: NodeId) {
        self.nodes[id as usize] = Node::Free;
        self.free.push(id);
    }

    /// The leaf `id` (None if `id` is not a leaf).
    pub fn leaf(&self, id: NodeId) -> Option<&Leaf<V, M>> {
        match self.nodes.get(id as usize) {
            Some(Node::Leaf(l)) => Some(l),
            _ => None,
        }
    }

    /// The leaf `id`, mutably (for its meta; keys must not be reordered).
    pub fn leaf_meta_mut(&mut self, id: NodeId) -> Option<&mut M> {
        match self.nodes.get_mut(id as usize) {
            Some(Node::Leaf(l)) => Some(&mut l.meta),
            _ => None,
        }
    }

    fn leaf_mut(&mut self, id: NodeId) -> &mut Leaf<V, M> {
        match &mut self.nodes[id as usize] {
            Node::Leaf(l) => l,
            _ => unreachable_leaf(),
        }
    }

    /// The leftmost leaf.
    pub fn first_leaf(&self) -> NodeId {
        let mut id = self.root;
        while let Node::Inner { children, .. } = &self.nodes[id as usize] {
            id = children[0];
        }
        id
    }

    /// Ids of all leaves, in key order.
    pub fn leaf_ids(&self) -> Vec<NodeId> {
        let mut out = Vec::new();
        let mut cur = Some(self.first_leaf());
        while let Some(id) = cur {
            out.push(id);
            cur = self.leaf(id).and_then(|l| l.next);
        }
        out
    }

    /// Descend to the leaf that holds (or would hold) `key`, recording the path.
    fn descend(&self, key: &[u8], path: &mut Vec<(NodeId, usize)>) -> NodeId {
        let mut id = self.root;
        loop {
            match &self.nodes[id as usize] {
                Node::Inner { keys, children } => {
                    let idx = keys.rank(key, true);
                    path.push((id, idx));
                    id = children[idx];
                }
                _ => return id,
            }
        }
    }

    /// Descend to the leaf that holds (or would hold) `key`, without recording the path.
    fn find_leaf(&self, key: &[u8]) -> NodeId {
        let mut id = self.root;
        while let Some(Node::Inner { keys, children }) = self.nodes.get(id as usize) {
            match children.get(keys.rank(key, true)) {
                Some(c) => id = *c,
                None => break,
            }
        }
        id
    }

    /// The rightmost leaf.
    fn last_leaf(&self) -> NodeId {
        let mut id = self.root;
        while let Some(Node::Inner { children, .. }) = self.nodes.get(id as usize) {
            match children.last() {
                Some(c) => id = *c,
                None => break,
            }
        }
        id
    }

    /// The value of `key`.
    pub fn get(&self, key: &[u8]) -> Option<&V> {
        let leaf = self.leaf(self.find_leaf(key))?;
        leaf.keys.find(key).ok().and_then(|i| leaf.vals.get(i))
    }

    /// Insert or replace; returns the old value and the leaf now holding `key`.
    pub fn insert(&mut self, key: &[u8], val: V) -> (Option<V>, NodeId) {
        let mut path = Vec::new();
        let leaf_id = self.descend(key, &mut path);
        let cap = self.capacity;
        let leaf = self.leaf_mut(leaf_id);
        let pos = match leaf.keys.find(key) {
            Ok(i) => {
                leaf.meta.touched();
                let old = std::mem::replace(&mut leaf.vals[i], val);
                return (Some(old), leaf_id);
            }
            Err(i) => i,
        };
        leaf.keys.insert(pos, key);
        leaf.vals.insert(pos, val);
        leaf.meta.touched();
        self.len += 1;
        self.key_bytes += key.len();
        if self.leaf_mut(leaf_id).keys.len() <= cap {
            return (None, leaf_id);
        }
        // Split the leaf: the upper half moves to a new right sibling.
        let (right_keys, right_vals, old_next) = {
            let l = self.leaf_mut(leaf_id);
            let mid = l.keys.len() / 2;
            (l.keys.split_off(mid), l.vals.split_off(mid), l.next)
        };
        let sep: Box<[u8]> = right_keys.first().unwrap_or_default().into();
        let key_goes_right = key >= &*sep;
        let mut meta = M::default();
        meta.touched();
        let right = self.alloc(Node::Leaf(Leaf {
            keys: right_keys,
            vals: right_vals,
            next: old_next,
            prev: Some(leaf_id),
            meta,
        }));
        self.leaf_mut(leaf_id).next = Some(right);
        if let Some(n) = old_next {
            self.leaf_mut(n).prev = Some(right);
        }
        self.insert_separator(path, sep, right);
        (None, if key_goes_right { right } else { leaf_id })
    }

    /// Insert `(sep, right)` into the parent at the end of `path`, splitting upwards.
    fn insert_separator(&mut self, mut path: Vec<(NodeId, usize)>, mut sep: Box<[u8]>, mut right: NodeId) {
        let cap = self.capacity;
        loop {
            let Some((parent, idx)) = path.pop() else {
                // The root split: grow a level.
                let old_root = self.root;
                self.root = self.alloc(Node::Inner { keys: Keys::from_keys([&*sep]), children: vec![old_root, right] });
                return;
            };
            let Node::Inner { keys, children } = &mut self.nodes[parent as usize] else {
                return;
            };
            keys.insert(idx, &sep);
            children.insert(idx + 1, right);
            if keys.len() <= cap {
                return;
            }
            let mid = keys.len() / 2;
            let right_keys = keys.split_off(mid + 1);
            let up = keys.pop().unwrap_or_default();
            let right_children = children.split_off(mid + 1);
            sep = up;
            right = self.alloc(Node::Inner { keys: right_keys, children: right_children });
        }
    }

    /// Remove `key`; returns its value and the leaf it was in (which may since have been
    /// removed from the tree, if it became empty or was merged away).
    pub fn remove(&mut self, key: &[u8]) -> Option<(V, NodeId)> {
        let mut path = Vec::new();
        let leaf_id = self.descend(key, &mut path);
        let leaf = self.leaf_mut(leaf_id);
        let i = leaf.keys.find(key).ok()?;
        let klen = leaf.keys.remove(i);
        let v = leaf.vals.remove(i);
        leaf.meta.touched();
        self.len -= 1;
        self.key_bytes -= klen;
        let remaining = self.leaf_mut(leaf_id).keys.len();
        if remaining == 0 {
            if !path.is_empty() {
                self.unlink_leaf(leaf_id);
                self.remove_child(path);
            }
        } else if remaining < self.capacity / 4 {
            self.try_merge_right(leaf_id, &path);
        }
        Some((v, leaf_id))
    }

    fn unlink_leaf(&mut self, id: NodeId) {
        let (prev, next) = {
            let l = self.leaf_mut(id);
            (l.prev, l.next)
        };
        if let Some(p) = prev {
            self.leaf_mut(p).next = next;
        }
        if let Some(n) = next {
            self.leaf_mut(n).prev = prev;
        }
        self.release(id);
    }

    /// Remove the child at the end of `path` from its parent, recursively removing parents
    /// that become empty and collapsing a root with one child.
    fn remove_child(&mut self, mut path: Vec<(NodeId, usize)>) {
        while let Some((parent, idx)) = path.pop() {
            let Node::Inner { keys, children } = &mut self.nodes[parent as usize] else {
                return;
            };
            children.remove(idx);
            if !keys.is_empty() {
                keys.remove(idx.saturating_sub(1));
            }
            if !children.is_empty() {
                break;
            }
            if path.is_empty() {
                // The root lost its last child: the tree is empty.
                self.release(parent);
                let leaf = Leaf { keys: Keys::default(), vals: Vec::new(), next: None, prev: None, meta: M::default() };
                self.root = self.alloc(Node::Leaf(leaf));
                return;
            }
            self.release(parent);
        }
        self.collapse_root();
    }

    fn collapse_root(&mut self) {
        while let Node::Inner { children, .. } = &self.nodes[self.root as usize] {
            if children.len() != 1 {
                return;
            }
            let only = children[0];
            let old = self.root;
            self.root = only;
            self.release(old);
        }
    }

    /// Merge the right sibling (same parent) into `leaf_id` if both fit in half a node.
    fn try_merge_right(&mut self, leaf_id: NodeId, path: &[(NodeId, usize)]) {
        let Some(&(parent, idx)) = path.last() else {
            return;
        };
        let Node::Inner { children, .. } = &self.nodes[parent as usize] else {
            return;
        };
        let Some(&sib) = children.get(idx + 1) else {
            return;
        };
        let (a, b) = (self.leaf_mut(leaf_id).keys.len(), self.leaf_mut(sib).keys.len());
        if a + b > self.capacity / 2 {
            return;
        }
        let (mut keys, vals, next) = {
            let s = self.leaf_mut(sib);
            (std::mem::take(&mut s.keys), std::mem::take(&mut s.vals), s.next)
        };
        let l = self.leaf_mut(leaf_id);
        l.keys.append(&mut keys);
        l.vals.extend(vals);
        l.next = next;
        l.meta.touched();
        if let Some(n) = next {
            self.leaf_mut(n).prev = Some(leaf_id);
        }
        self.release(sib);
        if let Node::Inner { keys, children } = &mut self.nodes[parent as usize] {
            children.remove(idx + 1);
            keys.remove(idx);
        }
        self.collapse_root();
    }

    /// Position of the first entry with key >= `key` (or > when `exclusive`).
    pub fn seek(&self, key: &[u8], exclusive: bool) -> Option<Pos> {
        let leaf_id = self.find_leaf(key);
        let leaf = self.leaf(leaf_id)?;
        let idx = if exclusive { leaf.keys.rank(key, true) } else { leaf.keys.rank(key, false) };
        self.normalize(Pos { leaf: leaf_id, idx })
    }

    /// Position of the first entry.
    pub fn first(&self) -> Option<Pos> {
        self.normalize(Pos { leaf: self.first_leaf(), idx: 0 })
    }

    /// Position of the first entry of the range's start bound.
    pub fn seek_bound(&self, start: Bound<&[u8]>) -> Option<Pos> {
        match start {
            Bound::Unbounded => self.first(),
            Bound::Included(k) => self.seek(k, false),
            Bound::Excluded(k) => self.seek(k, true),
        }
    }

    /// Move past empty tails of leaves.
    fn normalize(&self, mut pos: Pos) -> Option<Pos> {
        loop {
            let leaf = self.leaf(pos.leaf)?;
            if pos.idx < leaf.keys.len() {
                return Some(pos);
            }
            pos = Pos { leaf: leaf.next?, idx: 0 };
        }
    }

    /// The entry at `pos`.
    pub fn entry(&self, pos: Pos) -> Option<(&[u8], &V)> {
        let leaf = self.leaf(pos.leaf)?;
        Some((leaf.keys.get(pos.idx)?, leaf.vals.get(pos.idx)?))
    }

    /// The position after `pos`.
    pub fn next_pos(&self, pos: Pos) -> Option<Pos> {
        self.normalize(Pos { leaf: pos.leaf, idx: pos.idx + 1 })
    }

    /// Iterate entries from `start` in key order.
    pub fn range_from<'a>(&'a self, start: Bound<&[u8]>) -> impl Iterator<Item = (&'a [u8], &'a V)> + 'a {
        let mut pos = self.seek_bound(start);
        std::iter::from_fn(move || {
            let p = pos?;
            let e = self.entry(p);
            pos = self.next_pos(p);
            e
        })
    }

    /// Push onto `out` up to `n` entries (values mapped by `map`) in one pass over the
    /// leaves: from `from` ascending when `forward` (`Unbounded` = the first entry), else
    /// descending from `from` (`Unbounded` = the last entry; `Included(k)` = the last entry
    /// `<= k`). Returns true when no entries are left past the last one pushed in that
    /// direction (fewer than `n` were pushed); false when `n` were pushed.
    ///
    /// Cost: one descent, then a copy of each key into `out` (no allocation once `out` has
    /// grown).
    pub fn fill_batch<W: Copy>(
        &self,
        from: Bound<&[u8]>,
        forward: bool,
        n: usize,
        out: &mut Batch<W>,
        map: impl Fn(&V) -> W,
    ) -> bool {
        let mut left = n;
        if forward {
            let mut pos = self.seek_bound(from);
            while let Some(p) = pos {
                let Some(leaf) = self.leaf(p.leaf) else { return true };
                for (k, v) in leaf.keys.iter().zip(leaf.vals.iter()).skip(p.idx).take(left) {
                    out.push(k, map(v));
                    left -= 1;
                }
                if left == 0 {
                    return false;
                }
                pos = leaf.next.map(|l| Pos { leaf: l, idx: 0 });
            }
        } else {
            // `upto`: the entries of the leaf before this index are still to visit.
            let (mut id, mut upto) = match from {
                Bound::Unbounded => {
                    let id = self.last_leaf();
                    (Some(id), self.leaf(id).map_or(0, |l| l.keys.len()))
                }
                Bound::Included(k) | Bound::Excluded(k) => {
                    let id = self.find_leaf(k);
                    let inclusive = matches!(from, Bound::Included(_));
                    (Some(id), self.leaf(id).map_or(0, |l| l.keys.rank(k, inclusive)))
                }
            };
            while let Some(l) = id {
                let Some(leaf) = self.leaf(l) else { return true };
                let upto_c = upto.min(leaf.keys.len());
                let take = upto_c.min(left);
                let lo = upto_c - take;
                for (k, v) in leaf.keys.iter().zip(leaf.vals.iter()).take(upto_c).skip(lo).rev() {
                    out.push(k, map(v));
                }
                left -= take;
                if left == 0 {
                    return false;
                }
                id = leaf.prev;
                upto = usize::MAX;
            }
        }
        true
    }

    /// Check the invariants; returns a description of the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut count = 0usize;
        let mut last: Option<&[u8]> = None;
        for id in self.leaf_ids() {
            let leaf = self.leaf(id).ok_or("leaf chain reaches a non-leaf")?;
            if leaf.keys.len() != leaf.vals.len() {
                return Err(format!("leaf {id}: {} keys, {} values", leaf.keys.len(), leaf.vals.len()));
            }
            if !leaf.keys.consistent() {
                return Err(format!("leaf {id}: key prefixes out of step with keys"));
            }
            if leaf.keys.is_empty() && id != self.root {
                return Err(format!("non-root leaf {id} is empty"));
            }
            for k in leaf.keys.iter() {
                if last.is_some_and(|l| l >= k) {
                    return Err(format!("leaf {id}: keys out of order"));
                }
                last = Some(k);
            }
            count += leaf.keys.len();
        }
        if count != self.len {
            return Err(format!("leaves hold {count} entries, tree counts {}", self.len));
        }
        self.check_node(self.root, None, None)
    }

    fn check_node(&self, id: NodeId, lo: Option<&[u8]>, hi: Option<&[u8]>) -> Result<(), String> {
        match &self.nodes[id as usize] {
            Node::Free => Err(format!("node {id} is free but reachable")),
            Node::Leaf(l) => {
                if let (Some(lo), Some(first)) = (lo, l.keys.first()) {
                    if first < lo {
                        return Err(format!("leaf {id} below its separator"));
                    }
                }
                if let (Some(hi), Some(last)) = (hi, l.keys.last()) {
                    if last >= hi {
                        return Err(format!("leaf {id} above its separator"));
                    }
                }
                Ok(())
            }
            Node::Inner { keys, children } => {
                if !keys.consistent() {
                    return Err(format!("inner {id}: key prefixes out of step with keys"));
                }
                if children.len() != keys.len() + 1 {
                    return Err(format!("inner {id}: {} keys, {} children", keys.len(), children.len()));
                }
                for (i, c) in children.iter().enumerate() {
                    let clo = if i == 0 { lo } else { keys.get(i - 1) };
                    let chi = if i == keys.len() { hi } else { keys.get(i) };
                    self.check_node(*c, clo, chi)?;
                }
                Ok(())
            }
        }
    }
}

/// Entries copied out of a structure under its lock: keys packed into one buffer, values
/// (small `Copy` handles: addresses) beside them. Reused between fills, so a cursor that
/// reads ahead allocates nothing once its buffers have grown.
#[derive(Debug)]
pub struct Batch<W> {
    keys: Vec<u8>,
    /// (start of the key in `keys`, its length, value).
    ents: Vec<(usize, usize, W)>,
}

impl<W> Default for Batch<W> {
    fn default() -> Self {
        Batch { keys: Vec::new(), ents: Vec::new() }
    }
}

impl<W> Batch<W> {
    /// Append an entry.
    pub fn push(&mut self, key: &[u8], val: W) {
        let at = self.keys.len();
        self.keys.extend_from_slice(key);
        self.ents.push((at, key.len(), val));
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.ents.len()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.ents.is_empty()
    }

    fn clear(&mut self) {
        self.keys.clear();
        self.ents.clear();
    }

    fn key(&self, i: usize) -> &[u8] {
        self.ents.get(i).and_then(|&(at, len, _)| self.keys.get(at..at + len)).unwrap_or(&[])
    }

    fn val(&self, i: usize) -> Option<&W> {
        self.ents.get(i).map(|e| &e.2)
    }
}

/// A sorted key → handle structure behind a lock that a [`ReadAhead`] cursor reads from.
pub trait BatchSource: Send {
    /// The value handle copied per entry (an address).
    type V: Copy + Send;
    /// Under one short lock, push onto `out` up to `n` entries beyond `from`: ascending
    /// when `forward` (`Unbounded` = from the first entry), else descending (`Unbounded` =
    /// from the last; `Included(k)` = from the last entry `<= k`). Returns true when fewer
    /// than `n` were pushed because the source has no more in that direction.
    fn fill(&self, from: Bound<&[u8]>, forward: bool, n: usize, out: &mut Batch<Self::V>) -> bool;
}

/// [`BatchSource::fill`] over an ordered map of key → `T` (a MemTable's index): pushes up to
/// `n` entries beyond `from` in the direction asked, each handle made by `f`; true when the
/// map had fewer.
pub fn fill_from_map<T, W>(
    map: &std::collections::BTreeMap<Vec<u8>, T>,
    from: Bound<&[u8]>,
    forward: bool,
    n: usize,
    out: &mut Batch<W>,
    f: impl Fn(&T) -> W,
) -> bool {
    let before = out.len();
    if forward {
        for (k, v) in map.range::<[u8], _>((from, Bound::Unbounded)).take(n) {
            out.push(k, f(v));
        }
    } else {
        for (k, v) in map.range::<[u8], _>((Bound::Unbounded, from)).rev().take(n) {
            out.push(k, f(v));
        }
    }
    out.len() - before < n
}

/// First read-ahead after a seek (entries).
const READ_AHEAD_FIRST: usize = 32;
/// Largest read-ahead (entries); each refill in one direction doubles it up to this.
const READ_AHEAD_MAX: usize = 512;

/// A bidirectional cursor over a mutable structure shared with writers (a B+-tree, a
/// MemTable): it holds no lock between calls. Each refill takes the source's lock once,
/// re-positions by key (strictly after the last key it returned, or before the first) and
/// copies a batch of keys and value handles; moving inside the batch takes no lock.
///
/// # Invariants
/// - The batch is in ascending key order; `pos` indexes it (`pos == len` is invalid).
/// - `more_fwd`/`more_back`: the source may hold entries after the batch's last key /
///   before its first (false only when a fill in that direction ran out, or started at
///   the source's end).
///
/// Under concurrent writes, a key not written while the cursor lives is in every batch
/// whose key range covers it, and consecutive batches cover adjacent ranges, so a walk in
/// either direction returns it exactly once; a key written meanwhile may show any version
/// or none.
#[derive(Debug)]
pub struct ReadAhead<S: BatchSource> {
    src: S,
    batch: Batch<S::V>,
    pos: usize,
    more_fwd: bool,
    more_back: bool,
    n: usize,
    scratch: Vec<u8>,
    fills: u64,
}

impl<S: BatchSource> ReadAhead<S> {
    /// A cursor over `src`, unpositioned.
    pub fn new(src: S) -> Self {
        ReadAhead {
            src,
            batch: Batch::default(),
            pos: 0,
            more_fwd: false,
            more_back: false,
            n: READ_AHEAD_FIRST,
            scratch: Vec::new(),
            fills: 0,
        }
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.src
    }

    /// Refills so far (one lock acquisition each).
    pub fn fills(&self) -> u64 {
        self.fills
    }

    /// True when positioned at an entry.
    pub fn valid(&self) -> bool {
        self.pos < self.batch.len()
    }

    /// The current key (empty when invalid).
    pub fn key(&self) -> &[u8] {
        self.batch.key(self.pos)
    }

    /// The current value handle.
    pub fn val(&self) -> Option<&S::V> {
        self.batch.val(self.pos)
    }

    /// The value handle `ahead` entries past the current one in the batch (backward when
    /// negative), if the batch holds it: for prefetching what the next moves will read.
    pub fn peek(&self, ahead: isize) -> Option<&S::V> {
        self.batch.val(self.pos.checked_add_signed(ahead)?)
    }

    /// Replace the batch with one read from `from`, in `forward` order; `fresh` restarts the
    /// read-ahead size (a seek), else it doubles (a walk).
    fn load(&mut self, from: Bound<&[u8]>, forward: bool, fresh: bool) {
        self.n = if fresh { READ_AHEAD_FIRST } else { (self.n * 2).min(READ_AHEAD_MAX) };
        self.batch.clear();
        self.fills += 1;
        let exhausted = self.src.fill(from, forward, self.n, &mut self.batch);
        let edge = matches!(from, Bound::Unbounded);
        if forward {
            self.pos = 0;
            self.more_fwd = !exhausted;
            self.more_back = !edge;
        } else {
            self.batch.ents.reverse();
            self.pos = self.batch.len().saturating_sub(1);
            self.more_back = !exhausted;
            self.more_fwd = !edge;
        }
    }

    /// Load the batch beyond the current key (strictly after it when `forward`).
    fn load_beyond(&mut self, forward: bool) {
        let mut k = std::mem::take(&mut self.scratch);
        k.clear();
        k.extend_from_slice(self.key());
        self.load(Bound::Excluded(&k), forward, false);
        self.scratch = k;
    }

    fn invalidate(&mut self) {
        self.pos = self.batch.len();
    }

    /// Position at the first entry `>= key`.
    pub fn seek(&mut self, key: &[u8]) {
        self.load(Bound::Included(key), true, true);
    }

    /// Position at the last entry `<= key`.
    pub fn seek_for_prev(&mut self, key: &[u8]) {
        self.load(Bound::Included(key), false, true);
    }

    /// Position at the first entry.
    pub fn seek_to_first(&mut self) {
        self.load(Bound::Unbounded, true, true);
    }

    /// Position at the last entry.
    pub fn seek_to_last(&mut self) {
        self.load(Bound::Unbounded, false, true);
    }

    /// Move to the following entry.
    pub fn next(&mut self) {
        if !self.valid() {
            return;
        }
        if self.pos + 1 < self.batch.len() {
            self.pos += 1;
        } else if self.more_fwd {
            self.load_beyond(true);
        } else {
            self.invalidate();
        }
    }

    /// Move to the preceding entry.
    pub fn prev(&mut self) {
        if !self.valid() {
            return;
        }
        if self.pos > 0 {
            self.pos -= 1;
        } else if self.more_back {
            self.load_beyond(false);
        } else {
            self.invalidate();
        }
    }
}

#[cold]
fn unreachable_leaf() -> ! {
    // Only reached if a caller passes a non-leaf id obtained from this tree's own descent,
    // which the invariants rule out.
    panic!("B+-tree invariant violated: expected a leaf")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;

    thread_local! {
        /// Repacks on this thread that dead bytes triggered (a test's own count).
        pub(super) static REPACKS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    #[derive(Default, Debug)]
    struct Touch(u32);
    impl LeafMeta for Touch {
        fn touched(&mut self) {
            self.0 += 1;
        }
    }

    #[test]
    fn random_ops_match_btreemap() {
        for cap in [4usize, 5, 16, 64] {
            let mut rng = SmallRng::seed_from_u64(cap as u64);
            let mut t: BPlusTree<u64, Touch> = BPlusTree::new(cap);
            let mut m = BTreeMap::new();
            for step in 0..20_000u64 {
                let k = rng.random_range(0..2_000u32).to_be_bytes().to_vec();
                if rng.random_bool(0.6) {
                    assert_eq!(t.insert(&k, step).0, m.insert(k.clone(), step));
                } else {
                    assert_eq!(t.remove(&k).map(|x| x.0), m.remove(&k));
                }
                if step % 997 == 0 {
                    t.check_invariants()
                        .map_err(|e| format!("cap {cap} step {step}: {e}"))
                        .unwrap_or_else(|e| panic!("{e}"));
                    let got: Vec<(Vec<u8>, u64)> =
                        t.range_from(Bound::Unbounded).map(|(k, v)| (k.to_vec(), *v)).collect();
                    let want: Vec<(Vec<u8>, u64)> = m.iter().map(|(k, v)| (k.clone(), *v)).collect();
                    assert_eq!(got, want);
                }
            }
            // Drain everything: the tree must end empty and valid.
            let keys: Vec<Vec<u8>> = m.keys().cloned().collect();
            for k in keys {
                assert!(t.remove(&k).is_some());
            }
            assert!(t.is_empty());
            assert_eq!(t.check_invariants(), Ok(()));
        }
    }

    /// Keys of 14 to 78 bytes sharing a 10-byte head (so searches compare past the inline
    /// prefix) under inserts and removes: the tree matches a `BTreeMap`, the invariant
    /// check (run every 50 steps) finds every node's key buffer consistent, with dead bytes
    /// at most the live ones, and removals did trigger repacks (counted).
    #[test]
    fn variable_length_keys_match_btreemap_through_repacks() {
        for cap in [4usize, 16, 64] {
            let mut rng = SmallRng::seed_from_u64(100 + cap as u64);
            let mut t: BPlusTree<u64> = BPlusTree::new(cap);
            let mut m = BTreeMap::new();
            let repacks = REPACKS.with(|r| r.get());
            for step in 0..6_000u64 {
                // 400 keys of 14 to 78 bytes, all sharing a 10-byte head.
                let n = rng.random_range(0..400u32);
                let mut k = b"user/0000/".to_vec();
                k.extend_from_slice(&n.to_be_bytes());
                k.resize(14 + (n as usize % 5) * 16, b'x');
                if rng.random_bool(0.55) {
                    assert_eq!(t.insert(&k, step).0, m.insert(k.clone(), step));
                } else {
                    assert_eq!(t.remove(&k).map(|x| x.0), m.remove(&k));
                }
                if step % 50 == 0 {
                    assert_eq!(t.check_invariants(), Ok(()), "cap {cap} step {step}");
                }
            }
            let got: Vec<(Vec<u8>, u64)> = t.range_from(Bound::Unbounded).map(|(k, v)| (k.to_vec(), *v)).collect();
            let want: Vec<(Vec<u8>, u64)> = m.iter().map(|(k, v)| (k.clone(), *v)).collect();
            assert_eq!(got, want);
            for (k, v) in &m {
                assert_eq!(t.get(k), Some(v));
            }
            assert!(REPACKS.with(|r| r.get()) > repacks, "cap {cap}: no removal repacked a node");
        }
    }

    /// A tree behind a lock, as the presets hold it.
    struct Locked(std::sync::Arc<parking_lot::RwLock<BPlusTree<u64>>>);
    impl BatchSource for Locked {
        type V = u64;
        fn fill(&self, from: Bound<&[u8]>, forward: bool, n: usize, out: &mut Batch<u64>) -> bool {
            self.0.read().fill_batch(from, forward, n, out, |v| *v)
        }
    }

    /// `fill_batch` in both directions from every kind of bound matches a `BTreeMap`.
    #[test]
    fn fill_batch_matches_btreemap() {
        let mut rng = SmallRng::seed_from_u64(7);
        for cap in [4usize, 8, 64] {
            let mut t: BPlusTree<u64> = BPlusTree::new(cap);
            let mut m = BTreeMap::new();
            for i in 0..600u64 {
                let k = rng.random_range(0..400u32).to_be_bytes().to_vec();
                if rng.random_bool(0.7) {
                    t.insert(&k, i);
                    m.insert(k, i);
                } else {
                    t.remove(&k);
                    m.remove(&k);
                }
            }
            for _ in 0..300 {
                let k = rng.random_range(0..420u32).to_be_bytes().to_vec();
                let n = rng.random_range(1..40usize);
                let from = match rng.random_range(0..3) {
                    0 => Bound::Unbounded,
                    1 => Bound::Included(k.as_slice()),
                    _ => Bound::Excluded(k.as_slice()),
                };
                for forward in [true, false] {
                    let mut b = Batch::default();
                    let done = t.fill_batch(from, forward, n, &mut b, |v| *v);
                    let want: Vec<(Vec<u8>, u64)> = if forward {
                        m.range::<[u8], _>((from, Bound::Unbounded)).take(n).map(|(k, v)| (k.clone(), *v)).collect()
                    } else {
                        m.range::<[u8], _>((Bound::Unbounded, from))
                            .rev()
                            .take(n)
                            .map(|(k, v)| (k.clone(), *v))
                            .collect()
                    };
                    let got: Vec<(Vec<u8>, u64)> =
                        (0..b.len()).map(|i| (b.key(i).to_vec(), *b.val(i).unwrap_or(&u64::MAX))).collect();
                    assert_eq!(got, want, "cap {cap} from {from:?} forward {forward} n {n}");
                    assert_eq!(done, want.len() < n);
                }
            }
        }
    }

    /// A read-ahead cursor walks both ways, across batch boundaries and direction changes,
    /// exactly as the model; and a writer changing other keys between its moves does not
    /// make it skip or repeat the keys it leaves alone.
    #[test]
    fn read_ahead_cursor_matches_model_under_writes() {
        let mut rng = SmallRng::seed_from_u64(11);
        let tree = std::sync::Arc::new(parking_lot::RwLock::new(BPlusTree::<u64>::new(4)));
        let mut m = BTreeMap::new();
        // Even keys are stable; odd keys are written while the cursor walks.
        for i in (0..2000u32).step_by(2) {
            tree.write().insert(&i.to_be_bytes(), u64::from(i));
            m.insert(i.to_be_bytes().to_vec(), u64::from(i));
        }
        let mut c = ReadAhead::new(Locked(tree.clone()));
        c.seek_to_first();
        let mut seen = Vec::new();
        while c.valid() {
            seen.push((c.key().to_vec(), *c.val().unwrap_or(&0)));
            let odd = rng.random_range(0..1000u32) * 2 + 1;
            if rng.random_bool(0.5) {
                tree.write().insert(&odd.to_be_bytes(), 1);
            } else {
                tree.write().remove(&odd.to_be_bytes());
            }
            c.next();
        }
        let even: Vec<(Vec<u8>, u64)> =
            seen.iter().filter(|(k, _)| k.last().is_some_and(|b| b % 2 == 0)).cloned().collect();
        assert_eq!(even, m.iter().map(|(k, v)| (k.clone(), *v)).collect::<Vec<_>>());
        assert!(seen.windows(2).all(|w| w[0].0 < w[1].0), "strictly ascending");
        // Backward the same, from the end.
        c.seek_to_last();
        let mut back = Vec::new();
        while c.valid() {
            if c.key().last().is_some_and(|b| b % 2 == 0) {
                back.push(c.key().to_vec());
            }
            let odd = rng.random_range(0..1000u32) * 2 + 1;
            tree.write().insert(&odd.to_be_bytes(), 1);
            c.prev();
        }
        back.reverse();
        assert_eq!(back, m.keys().cloned().collect::<Vec<_>>());
        assert!(c.fills() > 10, "the walk crossed batch boundaries");
        // Random moves on a quiet tree match positions in the model.
        let want: Vec<Vec<u8>> = tree.read().range_from(Bound::Unbounded).map(|(k, _)| k.to_vec()).collect();
        let mut pos: Option<usize> = None;
        for _ in 0..5000 {
            match rng.random_range(0..10) {
                0..=3 => {
                    c.next();
                    pos = pos.map(|p| p + 1).filter(|&p| p < want.len());
                }
                4..=7 => {
                    c.prev();
                    pos = pos.and_then(|p| p.checked_sub(1));
                }
                8 => {
                    let k = rng.random_range(0..2100u32).to_be_bytes();
                    c.seek(&k);
                    let p = want.partition_point(|e| e.as_slice() < &k[..]);
                    pos = (p < want.len()).then_some(p);
                }
                _ => {
                    let k = rng.random_range(0..2100u32).to_be_bytes();
                    c.seek_for_prev(&k);
                    pos = want.partition_point(|e| e.as_slice() <= &k[..]).checked_sub(1);
                }
            }
            assert_eq!(c.valid(), pos.is_some());
            if let Some(p) = pos {
                assert_eq!(c.key(), want[p].as_slice());
            }
        }
    }

    #[test]
    fn seek_bounds() {
        let mut t: BPlusTree<u32> = BPlusTree::new(4);
        for i in (0..100u32).step_by(2) {
            t.insert(&i.to_be_bytes(), i);
        }
        let from = |b: Bound<&[u8]>| t.range_from(b).next().map(|(_, v)| *v);
        assert_eq!(from(Bound::Included(&7u32.to_be_bytes())), Some(8));
        assert_eq!(from(Bound::Included(&8u32.to_be_bytes())), Some(8));
        assert_eq!(from(Bound::Excluded(&8u32.to_be_bytes())), Some(10));
        assert_eq!(from(Bound::Excluded(&98u32.to_be_bytes())), None);
        assert_eq!(from(Bound::Unbounded), Some(0));
        assert_eq!(t.get(&[]), None, "empty key absent");
    }

    #[test]
    fn split_touches_both_halves_and_from_leaves_round_trips() {
        let mut t: BPlusTree<u32, Touch> = BPlusTree::new(4);
        for i in 0..5u32 {
            t.insert(&i.to_be_bytes(), i);
        }
        let ids = t.leaf_ids();
        assert_eq!(ids.len(), 2);
        assert!(ids.iter().all(|id| t.leaf(*id).is_some_and(|l| l.meta.0 > 0)));
        let leaves: Vec<LeafEntries<u32, Touch>> = ids
            .iter()
            .filter_map(|id| t.leaf(*id))
            .map(|l| (l.keys.iter().map(Box::from).zip(l.vals.iter().copied()).collect(), Touch(0)))
            .collect();
        let r = BPlusTree::from_leaves(4, leaves).unwrap_or_else(|| panic!("valid leaves"));
        assert_eq!(r.check_invariants(), Ok(()));
        assert_eq!(r.len(), 5);
        assert_eq!(r.get(&3u32.to_be_bytes()), Some(&3));
        let unsorted = vec![(vec![(Box::from(&b"b"[..]), 1u32)], ()), (vec![(Box::from(&b"a"[..]), 2u32)], ())];
        assert!(BPlusTree::from_leaves(4, unsorted).is_none(), "overlapping leaves refused");
    }
}
