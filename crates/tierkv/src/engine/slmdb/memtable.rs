//! SLM-DB's persistent MemTable: a skiplist whose bottom level lives in PM (Algorithm 1),
//! with the upper levels volatile.
//!
//! # Layout (docs/format/slmdb.md, "MemTable arena")
//! A memtable owns one *arena*, a contiguous PM extent: a 64-byte header
//! (`magic | generation | size | head | crc`) and nodes appended after it. A node is
//! `next u64 | seq u64 | batch_n u32 | batch_i u32 | klen u32 | vlen u32 | kind u8 | 0 ×3 |
//! crc u32 | key | value`, 8-byte aligned; the crc covers everything after `next`.
//!
//! The bottom level is a singly linked list from `head`, ordered by key ascending and, for
//! one key, by sequence number descending (newest first). An insert follows Algorithm 1:
//! the node is written and written back, its `next` set to its predecessor's `next` and
//! persisted (the fence also covers the node), then the predecessor's 8-byte `next` is
//! stored and persisted. An update is an insert of a
//! newer node in front of the old one: values are never modified in place.
//!
//! # Writers
//! Writers claim node space with an atomic bump of the arena's fill mark (in any order), so
//! a lone put or delete ([`Memtable::put_one`]) writes and writes back its node *before*
//! taking the index lock, with a sequence number drawn from the store's counter; the lock
//! covers the check of the key's newest node here, the link (two 8-byte stores, each
//! persisted) and the upper levels' update (and, when the key was overtaken, the header's
//! rewrite). The store holds its MemTable state shared across the write, so a rotation
//! waits for it.
//! A key's nodes must stay newest first (recovery rejects any other order, and reads take
//! the first): if a newer node of the key linked while this one was written, the node
//! draws a fresh number under the lock and its header is rewritten before it is linked —
//! the write that links last is the newest, and nothing could have observed the older
//! number. A batch ([`Memtable::apply`]) draws its numbers under the lock, so it is newer
//! than everything linked, and a conditional write decides on the key's newest node here
//! (or, when this memtable has none, on what lies below, found before the lock) in the
//! same critical section as its link. Claimed space whose node is never linked (a crash, an
//! error before the link) is dead: no link reaches it.
//!
//! # Upper levels
//! The volatile upper levels are a DRAM ordered map from each key to its newest and oldest
//! node (the oldest node of the previous key is the predecessor an insert needs). A
//! `BTreeMap` plays the part of the skiplist's upper levels: both are volatile search
//! structures over the persistent bottom level, rebuilt from it at open.
//!
//! # Batches
//! All nodes of a [`crate::WriteBatch`] carry the batch's first sequence number implicitly
//! (`seq - batch_i`) and its size `batch_n`; they are linked one by one. At open, a batch
//! with fewer than `batch_n` reachable nodes was in flight at the crash (never
//! acknowledged): its nodes are unlinked, so a batch is all or nothing.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use crate::error::Result;
use crate::format::{crc, Cursor};
use crate::index::bplus::Batch;
use crate::pm::Region;

/// Arena header magic.
pub const ARENA_MAGIC: u64 = 0x4e45_5241_4d4d_4c53; // "SLMMAREN"
/// Node header bytes (before key and value).
pub const NODE_HEADER: u64 = 40;
/// Kind byte of a put.
pub const KIND_PUT: u8 = 0;
/// Kind byte of a delete.
pub const KIND_DEL: u8 = 1;

/// Bytes a node of this key and value takes in an arena.
pub fn node_size(klen: usize, vlen: usize) -> u64 {
    (NODE_HEADER + klen as u64 + vlen as u64).div_ceil(8) * 8
}

/// Encode a node (with `next` = `next`).
pub fn encode_node(next: u64, seq: u64, batch_n: u32, batch_i: u32, kind: u8, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(node_size(key.len(), value.len()) as usize);
    b.extend_from_slice(&next.to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&batch_n.to_le_bytes());
    b.extend_from_slice(&batch_i.to_le_bytes());
    b.extend_from_slice(&(key.len() as u32).to_le_bytes());
    b.extend_from_slice(&(value.len() as u32).to_le_bytes());
    b.extend_from_slice(&[kind, 0, 0, 0]);
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(key);
    b.extend_from_slice(value);
    let c = crc::masked_parts(&[b.get(8..36).unwrap_or(&[]), key, value]);
    if let Some(s) = b.get_mut(36..40) {
        s.copy_from_slice(&c.to_le_bytes());
    }
    b.resize(node_size(key.len(), value.len()) as usize, 0);
    b
}

/// Encode an arena header (64 bytes).
pub fn encode_arena_header(gen: u64, size: u64) -> [u8; 64] {
    let mut h = [0u8; 64];
    h[0..8].copy_from_slice(&ARENA_MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&gen.to_le_bytes());
    h[16..24].copy_from_slice(&size.to_le_bytes());
    let c = crc::masked(&h[0..24]);
    h[32..36].copy_from_slice(&c.to_le_bytes());
    h
}

/// A decoded node.
#[derive(Debug, Clone, Copy)]
pub struct Node<'a> {
    /// Next node address (0 = end).
    pub next: u64,
    /// Sequence number.
    pub seq: u64,
    /// Ops in the node's batch.
    pub batch_n: u32,
    /// The node's index in its batch.
    pub batch_i: u32,
    /// Put or delete.
    pub kind: u8,
    /// Key.
    pub key: &'a [u8],
    /// Value (empty for a delete).
    pub value: &'a [u8],
}

/// Read and verify the node at `addr`.
pub fn read_node(r: &Region, addr: u64) -> Result<Node<'_>> {
    read_node_impl(r, addr, true)
}

/// Read a node without verifying its checksum: for nodes this process linked, or verified
/// when the MemTable was recovered (lengths are still bounds-checked). `check` verifies all.
pub fn read_node_trusted(r: &Region, addr: u64) -> Result<Node<'_>> {
    read_node_impl(r, addr, false)
}

fn read_node_impl(r: &Region, addr: u64, verify: bool) -> Result<Node<'_>> {
    let bad = |d: &str| r.corruption(addr, d.to_string());
    // `next` is linked by writers with an 8-byte atomic store while readers walk the list:
    // it is read atomically, and the plain view starts after it (ThreadSanitizer found the
    // mixed access).
    r.slice_checked(addr, NODE_HEADER as usize, "memtable node")?;
    let next = r.load_u64_atomic(addr)?;
    let h = r.slice_checked(addr + 8, NODE_HEADER as usize - 8, "memtable node")?;
    let mut c = Cursor::new(h);
    let seq = c.u64().ok_or_else(|| bad("short node"))?;
    let batch_n = c.u32().ok_or_else(|| bad("short node"))?;
    let batch_i = c.u32().ok_or_else(|| bad("short node"))?;
    let klen = c.u32().ok_or_else(|| bad("short node"))? as usize;
    let vlen = c.u32().ok_or_else(|| bad("short node"))? as usize;
    let kind = c.u8().ok_or_else(|| bad("short node"))?;
    c.skip(3);
    let stored = c.u32().ok_or_else(|| bad("short node"))?;
    if klen > 65_535 || vlen > (1 << 30) {
        return Err(bad("memtable node lengths out of range"));
    }
    let all = r.slice_checked(addr, NODE_HEADER as usize + klen + vlen, "memtable node")?;
    let key = all.get(NODE_HEADER as usize..NODE_HEADER as usize + klen).unwrap_or(&[]);
    let value = all.get(NODE_HEADER as usize + klen..).unwrap_or(&[]);
    if kind > KIND_DEL || (verify && crc::masked_parts(&[h.get(0..28).unwrap_or(&[]), key, value]) != stored) {
        return Err(bad("memtable node checksum mismatch"));
    }
    Ok(Node { next, seq, batch_n, batch_i, kind, key, value })
}

/// DRAM one upper-level entry takes: the key's bytes, its `Vec` header and the slot.
fn index_entry_bytes(key: &[u8]) -> u64 {
    (key.len() + std::mem::size_of::<Vec<u8>>() + std::mem::size_of::<Slot>()) as u64
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    newest: u64,
    oldest: u64,
}

/// A persistent memtable. See the module docs.
#[derive(Debug)]
pub struct Memtable {
    /// Arena address.
    pub addr: u64,
    /// Arena size.
    pub size: u64,
    /// Generation (memtables are numbered in creation order).
    pub gen: u64,
    index: RwLock<BTreeMap<Vec<u8>, Slot>>,
    used: AtomicU64,
    /// DRAM held by the upper levels: key bytes plus one map entry per key (the map's own
    /// node overhead is not counted).
    index_bytes: AtomicU64,
}

/// A node written but not yet linked ([`Memtable::prepare`]).
#[derive(Debug)]
pub struct Prepared<'o> {
    node: u64,
    seq: u64,
    op: Op<'o>,
}

/// What [`Memtable::apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied (`true`), or its condition failed (`false`).
    Done(bool),
    /// The nodes do not fit; nothing changed.
    Full,
}

/// The value of the node at `addr` (`None` for a delete).
pub fn node_value(r: &Region, addr: u64) -> Result<Option<Vec<u8>>> {
    let n = read_node_trusted(r, addr)?;
    Ok((n.kind == KIND_PUT).then(|| n.value.to_vec()))
}

/// One write to apply.
#[derive(Debug, Clone, Copy)]
pub struct Op<'a> {
    /// Put or delete.
    pub kind: u8,
    /// Key.
    pub key: &'a [u8],
    /// Value.
    pub value: &'a [u8],
}

impl Memtable {
    fn empty(addr: u64, size: u64, gen: u64) -> Memtable {
        Memtable {
            addr,
            size,
            gen,
            index: RwLock::new(BTreeMap::new()),
            used: AtomicU64::new(64),
            index_bytes: AtomicU64::new(0),
        }
    }

    /// Lay out an empty memtable in the arena `[addr, addr+size)`.
    pub fn create(r: &Region, addr: u64, size: u64, gen: u64) -> Result<Memtable> {
        let h = encode_arena_header(gen, size);
        // SAFETY: the arena was just allocated for this memtable; nothing else refers to it.
        unsafe { r.write(addr, &h)? };
        r.persist(addr, 64);
        Ok(Memtable::empty(addr, size, gen))
    }

    /// Recover the memtable in the arena at `addr`: verify every reachable node, unlink the
    /// nodes of an incomplete batch, rebuild the upper levels. Returns it with the highest
    /// sequence number it holds.
    pub fn recover(r: &Region, addr: u64) -> Result<(Memtable, u64)> {
        let h = r.slice_checked(addr, 64, "memtable arena header")?;
        let mut c = Cursor::new(h);
        let (magic, gen, size) = (c.u64(), c.u64(), c.u64());
        let stored = u32::from_le_bytes(h.get(32..36).and_then(|s| s.try_into().ok()).unwrap_or([0; 4]));
        if magic != Some(ARENA_MAGIC) || crc::masked(h.get(0..24).unwrap_or(&[])) != stored {
            return Err(r.corruption(addr, "bad memtable arena header"));
        }
        let (gen, size) = (gen.unwrap_or(0), size.unwrap_or(0));
        if r.slice(addr, size as usize).is_none() || size < 64 {
            return Err(r.corruption(addr, "memtable arena size outside the PM region"));
        }
        let head = addr + 24;
        // Walk the bottom level.
        let mut nodes: Vec<(u64, u64)> = Vec::new(); // (pred next-word, node)
        let mut batches: HashMap<u64, (u32, u32)> = HashMap::new(); // base -> (n, seen)
        let mut pred = head;
        let mut cur = r.load_u64_atomic(head)?;
        let mut prev: Option<(Vec<u8>, u64)> = None;
        while cur != 0 {
            if cur < addr + 64 || cur >= addr + size {
                return Err(r.corruption(pred, "memtable link points outside its arena"));
            }
            let n = read_node(r, cur)?;
            if let Some((pk, ps)) = &prev {
                if (pk.as_slice(), std::cmp::Reverse(*ps)) >= (n.key, std::cmp::Reverse(n.seq)) {
                    return Err(r.corruption(cur, "memtable nodes out of order"));
                }
            }
            prev = Some((n.key.to_vec(), n.seq));
            let base = n.seq.wrapping_sub(n.batch_i as u64);
            let e = batches.entry(base).or_insert((n.batch_n, 0));
            e.1 += 1;
            nodes.push((pred, cur));
            pred = cur;
            cur = n.next;
            if nodes.len() as u64 > size / NODE_HEADER {
                return Err(r.corruption(addr, "memtable list does not end"));
            }
        }
        // Unlink incomplete batches (back to front, so each predecessor is still linked).
        let incomplete: Vec<u64> = batches.iter().filter(|(_, (n, seen))| seen < n).map(|(base, _)| *base).collect();
        let mut keep = vec![true; nodes.len()];
        if !incomplete.is_empty() {
            for i in (0..nodes.len()).rev() {
                let node = nodes[i].1;
                let n = read_node(r, node)?;
                if incomplete.contains(&n.seq.wrapping_sub(n.batch_i as u64)) {
                    // The live predecessor: the nearest kept node before i, or head.
                    let p = (0..i).rev().find(|&j| keep[j]).map_or(head, |j| nodes[j].1);
                    let p = if p == head { head } else { p };
                    r.store_u64_atomic(p, n.next)?;
                    r.persist(p, 8);
                    keep[i] = false;
                }
            }
        }
        let m = Memtable::empty(addr, size, gen);
        let mut max_seq = 0;
        let mut used = 64;
        {
            let mut idx = m.index.write();
            for (i, &(_, node)) in nodes.iter().enumerate() {
                let n = read_node(r, node)?;
                used = used.max(node - addr + node_size(n.key.len(), n.value.len()));
                if !keep[i] {
                    continue;
                }
                max_seq = max_seq.max(n.seq);
                match idx.get_mut(n.key) {
                    Some(s) => s.oldest = node,
                    None => {
                        idx.insert(n.key.to_vec(), Slot { newest: node, oldest: node });
                        m.index_bytes.fetch_add(index_entry_bytes(n.key), Ordering::Relaxed);
                    }
                }
            }
        }
        m.used.store(used, Ordering::Relaxed);
        Ok((m, max_seq))
    }

    /// Bytes of the arena in use.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// True if nodes of `bytes` more bytes fit.
    pub fn fits(&self, bytes: u64) -> bool {
        self.used() + bytes <= self.size
    }

    /// DRAM bytes held by the upper levels (see the field).
    pub fn index_bytes(&self) -> u64 {
        self.index_bytes.load(Ordering::Relaxed)
    }

    /// Distinct keys.
    pub fn keys(&self) -> usize {
        self.index.read().len()
    }

    /// Claim `size` bytes of the arena for a node no one can reach yet; its address, or
    /// `None` when the arena is full. Lock-free: writers claim space in any order, and a
    /// node is reachable only once linked ([`Memtable::link`]).
    fn reserve(&self, size: u64) -> Option<u64> {
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| (u + size <= self.size).then_some(u + size))
            .ok()
            .map(|u| self.addr + u)
    }

    /// Link the written node at `node` (its bytes flushed, not yet fenced, by this thread)
    /// in front of `key`'s older nodes, or where `key` belongs: its `next` is stored and
    /// persisted (the fence also covers the node's flushed bytes), then its predecessor's
    /// `next` (Algorithm 1). Caller holds the index lock exclusively.
    fn link(&self, idx: &mut BTreeMap<Vec<u8>, Slot>, r: &Region, node: u64, key: &[u8]) -> Result<()> {
        let pred = idx.range::<[u8], _>((Bound::Unbounded, Bound::Excluded(key))).next_back();
        let pred_word = pred.map_or(self.addr + 24, |(_, s)| s.oldest);
        let next = r.load_u64_atomic(pred_word)?;
        r.store_u64_atomic(node, next)?;
        r.persist(node, 8);
        r.store_u64_atomic(pred_word, node)?;
        r.persist(pred_word, 8);
        match idx.get_mut(key) {
            Some(s) => s.newest = node,
            None => {
                idx.insert(key.to_vec(), Slot { newest: node, oldest: node });
                self.index_bytes.fetch_add(index_entry_bytes(key), Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Insert `ops` as one batch, its sequence numbers taken from `seqs` under the index
    /// lock (so they exceed those of every node already linked). With `cond = Some((want,
    /// below))`, the batch applies only if the first op's key exists (`want`) or not: its
    /// newest node here decides, or when this memtable has none, `below` — whether the key
    /// exists in what lies below this memtable, which the caller found beforehand and which
    /// cannot change while it holds the MemTables (writes reach only the active one). The
    /// check and the inserts are one critical section, so no write of that key links in
    /// between. [`Applied::Full`] when the nodes do not fit (nothing changed). A failure
    /// part way (a PM error) leaves the nodes linked before it in place.
    pub fn apply(&self, r: &Region, seqs: &AtomicU64, ops: &[Op<'_>], cond: Option<(bool, bool)>) -> Result<Applied> {
        let need: u64 = ops.iter().map(|o| node_size(o.key.len(), o.value.len())).sum();
        let mut idx = self.index.write();
        if let (Some((want, below)), Some(first)) = (cond, ops.first()) {
            let present = match idx.get(first.key) {
                Some(s) => read_node_trusted(r, s.newest)?.kind == KIND_PUT,
                None => below,
            };
            if present != want {
                return Ok(Applied::Done(false));
            }
        }
        let Some(mut node) = self.reserve(need) else { return Ok(Applied::Full) };
        let seq = seqs.fetch_add(ops.len() as u64, Ordering::Relaxed);
        let n = ops.len() as u32;
        for (i, op) in ops.iter().enumerate() {
            let size = node_size(op.key.len(), op.value.len());
            let bytes = encode_node(0, seq + i as u64, n, i as u32, op.kind, op.key, op.value);
            // SAFETY: `[node, node+size)` lies in space `reserve` gave this call alone; no
            // link reaches it yet.
            unsafe { r.write(node, &bytes)? };
            r.flush(node, size);
            self.link(&mut idx, r, node, op.key)?;
            node += size;
        }
        Ok(Applied::Done(true))
    }

    /// Insert one op (an unconditional put or delete) holding the index lock only to link
    /// it: [`Memtable::prepare`], then [`Memtable::commit`]. `Some(renumbered)` once linked;
    /// `None` when the node does not fit (nothing changed). The caller holds the store's
    /// MemTable state shared across the call (see `prepare`).
    pub fn put_one(&self, r: &Region, seqs: &AtomicU64, op: Op<'_>) -> Result<Option<bool>> {
        match self.prepare(r, seqs, op)? {
            Some(p) => self.commit(r, seqs, p).map(Some),
            None => Ok(None),
        }
    }

    /// Reserve, write and flush the node of `op` with a sequence number taken now, outside
    /// the index lock; `None` when it does not fit. The node is unreachable until
    /// [`Memtable::commit`] links it (a reserved node never committed is dead space, and
    /// unreachable after a crash). The caller must commit on the same thread (the link's
    /// fence is what makes this thread's flushes of the node durable) and hold the store's
    /// MemTable state shared from prepare to commit (a rotation then waits, so the arena is
    /// neither flushed nor freed under the write).
    fn prepare<'o>(&self, r: &Region, seqs: &AtomicU64, op: Op<'o>) -> Result<Option<Prepared<'o>>> {
        let size = node_size(op.key.len(), op.value.len());
        let Some(node) = self.reserve(size) else { return Ok(None) };
        let seq = seqs.fetch_add(1, Ordering::Relaxed);
        let bytes = encode_node(0, seq, 1, 0, op.kind, op.key, op.value);
        // SAFETY: `[node, node+size)` lies in space `reserve` gave this call alone; no link
        // reaches it yet.
        unsafe { r.write(node, &bytes)? };
        r.flush(node, size);
        Ok(Some(Prepared { node, seq, op }))
    }

    /// Link a prepared node under the index lock. If a newer node of the key was linked
    /// since it was prepared (a higher sequence number), the node first takes a fresh
    /// number and its header is rewritten, so a key's nodes stay newest first and the write
    /// that links last wins. Returns whether it was renumbered.
    fn commit(&self, r: &Region, seqs: &AtomicU64, p: Prepared<'_>) -> Result<bool> {
        let Prepared { node, seq, op } = p;
        let mut idx = self.index.write();
        let mut renumbered = false;
        if let Some(s) = idx.get(op.key) {
            if read_node_trusted(r, s.newest)?.seq > seq {
                let seq = seqs.fetch_add(1, Ordering::Relaxed);
                let bytes = encode_node(0, seq, 1, 0, op.kind, op.key, op.value);
                let head = bytes.get(8..NODE_HEADER as usize).unwrap_or(&[]);
                // SAFETY: the node is still unreachable (not linked).
                unsafe { r.write(node + 8, head)? };
                r.flush(node + 8, NODE_HEADER - 8);
                renumbered = true;
            }
        }
        self.link(&mut idx, r, node, op.key)?;
        Ok(renumbered)
    }

    /// The newest entry of `key`: `Some(None)` for a delete, `Some(Some(v))` for a put.
    pub fn get(&self, r: &Region, key: &[u8]) -> Result<Option<Option<Vec<u8>>>> {
        let idx = self.index.read();
        let Some(s) = idx.get(key) else { return Ok(None) };
        let n = read_node_trusted(r, s.newest)?;
        Ok(Some((n.kind == KIND_PUT).then(|| n.value.to_vec())))
    }

    /// Up to `max` keys in the bounds, in order, with their newest node (read its value
    /// with [`node_value`] while the MemTable is alive).
    pub fn range(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, max: usize) -> Vec<(Vec<u8>, u64)> {
        let idx = self.index.read();
        idx.range::<[u8], _>((start, end)).take(max).map(|(k, s)| (k.clone(), s.newest)).collect()
    }

    /// Copy up to `n` keys beyond `from` with their newest node into `out`, under one short
    /// read lock of the upper levels (a read-ahead cursor's refill, see
    /// [`crate::index::bplus::BatchSource`]); true when the MemTable has no more.
    pub fn fill(&self, from: Bound<&[u8]>, forward: bool, n: usize, out: &mut Batch<u64>) -> bool {
        crate::index::bplus::fill_from_map(&self.index.read(), from, forward, n, out, |s| s.newest)
    }

    /// Every key's newest entry in order (for a flush): `(key, kind, value)`.
    pub fn entries<'r>(&self, r: &'r Region) -> Result<Vec<(Vec<u8>, Node<'r>)>> {
        let idx = self.index.read();
        idx.iter().map(|(k, s)| Ok((k.clone(), read_node(r, s.newest)?))).collect()
    }

    /// Verify every node of the bottom level; returns problems.
    pub fn check(&self, r: &Region) -> Vec<String> {
        let mut problems = Vec::new();
        let mut cur = r.load_u64_atomic(self.addr + 24).unwrap_or(0);
        let mut count = 0usize;
        while cur != 0 && problems.is_empty() {
            match read_node(r, cur) {
                Ok(n) => cur = n.next,
                Err(e) => problems.push(e.to_string()),
            }
            count += 1;
            if count as u64 > self.size / NODE_HEADER {
                problems.push("memtable list does not end".into());
            }
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pm::sim::SimDevice;
    use crate::pm::{Backing, RegionConfig};

    fn region(dev: &SimDevice, create: bool) -> Region {
        Region::open(RegionConfig { create, ..RegionConfig::new(Backing::Sim(dev.clone()), 1 << 20, 7) }).unwrap()
    }

    /// A fresh device, its region, and an empty memtable of `size` bytes at 4096.
    fn fresh(size: u64) -> (SimDevice, Region, Memtable) {
        let dev = SimDevice::new();
        let r = region(&dev, true);
        let m = Memtable::create(&r, 4096, size, 1).unwrap();
        (dev, r, m)
    }

    fn put<'a>(key: &'a [u8], value: &'a [u8]) -> Op<'a> {
        Op { kind: KIND_PUT, key, value }
    }

    /// The newest value and every node's sequence number of `key`, walking the list.
    fn chain(r: &Region, m: &Memtable, key: &[u8]) -> (Option<Vec<u8>>, Vec<u64>) {
        let newest = m.get(r, key).unwrap().flatten();
        let mut seqs = Vec::new();
        let mut cur = r.load_u64_atomic(m.addr + 24).unwrap();
        while cur != 0 {
            let n = read_node(r, cur).unwrap();
            if n.key == key {
                seqs.push(n.seq);
            }
            cur = n.next;
        }
        (newest, seqs)
    }

    /// A lone write prepared (numbered) before a newer write of its key linked is
    /// renumbered at its commit: it wins, the key's nodes stay newest first, and a recovery
    /// from the crash image of PM (after a fence: every link durable) accepts the order
    /// and finds the same newest value and highest number. A write of another key, or one
    /// whose key gained no newer node, keeps its number.
    #[test]
    fn a_lone_write_overtaken_by_a_newer_one_of_its_key_is_renumbered_and_wins() {
        let (dev, r, m) = fresh(64 * 1024);
        let seqs = AtomicU64::new(10);
        let a = m.prepare(&r, &seqs, put(b"k", b"first")).unwrap().unwrap();
        let other = m.prepare(&r, &seqs, put(b"j", b"other")).unwrap().unwrap();
        assert_eq!(m.apply(&r, &seqs, &[put(b"k", b"batch"), put(b"l", b"x")], None).unwrap(), Applied::Done(true));
        assert_eq!(chain(&r, &m, b"k"), (Some(b"batch".to_vec()), vec![12]));
        assert!(m.commit(&r, &seqs, a).unwrap(), "overtaken: renumbered");
        assert!(!m.commit(&r, &seqs, other).unwrap(), "its key has no newer node");
        assert_eq!(chain(&r, &m, b"k"), (Some(b"first".to_vec()), vec![14, 12]));
        assert_eq!(chain(&r, &m, b"j"), (Some(b"other".to_vec()), vec![11]));
        // A later write of the key, prepared after the renumbering, needs none.
        assert_eq!(m.put_one(&r, &seqs, put(b"k", b"second")).unwrap(), Some(false));
        assert_eq!(chain(&r, &m, b"k"), (Some(b"second".to_vec()), vec![15, 14, 12]));
        r.fence();
        let r2 = region(&dev.simulate_crash(1, 0.5), false);
        let (back, max) = Memtable::recover(&r2, 4096).unwrap();
        assert_eq!(max, 15);
        assert_eq!(back.get(&r2, b"k").unwrap(), Some(Some(b"second".to_vec())));
        assert_eq!(back.keys(), 3);
    }

    /// A prepared node never committed is unreachable: the list, a recovery and the
    /// arena's accounting after recovery do not see it; space is claimed by each prepare.
    #[test]
    fn a_prepared_node_never_committed_is_not_in_the_memtable() {
        let (dev, r, m) = fresh(64 * 1024);
        let seqs = AtomicU64::new(1);
        assert_eq!(m.put_one(&r, &seqs, put(b"a", b"1")).unwrap(), Some(false));
        let used = m.used();
        let _lost = m.prepare(&r, &seqs, put(b"b", b"2")).unwrap().unwrap();
        assert_eq!(m.used(), used + node_size(1, 1));
        assert_eq!(m.get(&r, b"b").unwrap(), None);
        r.fence();
        let crashed = dev.simulate_crash(2, 1.0);
        let (back, max) = Memtable::recover(&region(&crashed, false), 4096).unwrap();
        assert_eq!((back.keys(), max, back.used()), (1, 1, used));
    }

    /// A conditional batch decides on the key's newest node in this memtable when it has
    /// one, else on what the caller found below; a node that does not fit leaves the
    /// memtable unchanged.
    #[test]
    fn a_conditional_apply_checks_this_memtable_then_below() {
        let (_dev, r, m) = fresh(1024);
        let seqs = AtomicU64::new(1);
        // "old" exists below this memtable, "new" does not.
        assert_eq!(m.apply(&r, &seqs, &[put(b"old", b"v")], Some((false, true))).unwrap(), Applied::Done(false));
        assert_eq!(m.apply(&r, &seqs, &[put(b"old", b"v")], Some((true, true))).unwrap(), Applied::Done(true));
        assert_eq!(m.apply(&r, &seqs, &[put(b"new", b"v")], Some((true, false))).unwrap(), Applied::Done(false));
        assert_eq!(m.apply(&r, &seqs, &[put(b"new", b"v")], Some((false, false))).unwrap(), Applied::Done(true));
        // Once this memtable holds the key, its newest node decides, not what lies below.
        assert_eq!(m.apply(&r, &seqs, &[put(b"new", b"w")], Some((true, false))).unwrap(), Applied::Done(true));
        // A delete in this memtable makes the key absent whatever lies below.
        let del = Op { kind: KIND_DEL, key: b"old", value: &[] };
        assert_eq!(m.apply(&r, &seqs, &[del], None).unwrap(), Applied::Done(true));
        assert_eq!(m.apply(&r, &seqs, &[put(b"old", b"w")], Some((true, true))).unwrap(), Applied::Done(false));
        let before = (m.used(), m.keys(), seqs.load(Ordering::Relaxed));
        let big = vec![0u8; 2048];
        assert_eq!(m.apply(&r, &seqs, &[put(b"x", &big)], None).unwrap(), Applied::Full);
        assert_eq!(m.put_one(&r, &seqs, put(b"x", &big)).unwrap(), None);
        assert_eq!((m.used(), m.keys(), seqs.load(Ordering::Relaxed)), before);
    }
}
