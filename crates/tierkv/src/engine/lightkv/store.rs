//! LightKV's store core: the RH-Tree over PM write-buffer segments, the flush of full leaves
//! to SSTables with persistent leaf copies (Fig. 6), and recovery by segment scan (§V) — what
//! the `lightkv` engine adds compaction, scans and background threads to
//! (docs/design/lightkv.md).
//!
//! # PM layout (docs/format/lightkv.md)
//! Pool 0: superblock at 64 (`TKVLIGHT`, version, segment size, crc), the segment-id counter
//! at 128 (an 8-byte word bumped and persisted before an id is used, so ids are never
//! reused even after segments are freed), the segment directory at 4096 (`SEG_SLOTS` slots
//! of `addr u64 | id u64`; a slot is live when its id is non-zero), the chain directory
//! (`CHAIN_SLOTS` 8-byte addresses of chain records, 0 = empty), and the PM heap after it.
//!
//! # Flush (Fig. 6)
//! When a full top leaf cannot split, it is linked behind a fresh top leaf and flushed at
//! once, by the writer (the engine will move this to a background thread): its records are
//! sorted into an SSTable (fsynced, directory synced), the leaf is re-pointed at the table's
//! entries (`1 << 63 | table << 32 | block << 12 | entry`) and copied to PM, then a new chain
//! record (the partition's descriptor and its PM leaves, newest first) is written and
//! committed by one 8-byte store into the partition's chain slot. Only then are the records'
//! segments released. A crash before the commit leaves an orphan table (deleted at open) and
//! unreferenced PM extents (the heap is rebuilt from what is referenced); the records are
//! still in the write buffer. After it, recovery skips the partition's records at or below
//! the newest leaf's `seq_hi`: each of them is in a table or superseded.
//!
//! # Write path
//! One writer lock. A put routes its key to a partition, appends a record to the partition's
//! active segment (a new segment when it is full), persists it with one fence, and indexes it
//! in the RH-Tree (linking a new top leaf when a full leaf cannot split). Deletes append a
//! tombstone and index it: a tombstone must outlive every older record of its key in the
//! PWB, and an indexed tombstone keeps its segment alive. Each segment counts the index
//! entries pointing into it; an inactive segment whose count reaches zero is freed (its slot
//! cleared with an atomic store, then its extent returned to the heap).
//!
//! # Recovery
//! Read both directories; rebuild each chained partition from its descriptor
//! ([`RhTree::ensure_partition`]) with its PM leaves; rebuild the heap from the live extents;
//! scan every segment (a torn tail ends a segment; damage before valid records is
//! `Corruption`) and re-index the records in sequence order, skipping those a flush covered.
//! Segments left with no entry are freed; tables no leaf names are deleted.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::leaf::{decode_chain, decode_leaf, encode_chain, encode_leaf, leaf_len, Chain, LeafMeta, LEAF_HEADER};
use super::pwb::{self, Kind};
use crate::error::{Error, Result};
use crate::format::crc;
use crate::fs::Fs;
use crate::index::rhtree::{Insert, KeySource, PartitionId, RhOptions, RhTree};
use crate::pm::heap::{self, Heap};
use crate::pm::Region;
use crate::sstable::{block_entries, Table, TableBuilder};

/// Superblock address.
pub const SUPERBLOCK_ADDR: u64 = 64;
/// Segment-id counter address.
pub const ID_COUNTER_ADDR: u64 = 128;
/// Segment directory address.
pub const DIR_ADDR: u64 = 4096;
/// Directory slots (most live segments).
pub const SEG_SLOTS: u64 = 8192;
/// Bytes per directory slot.
pub const SLOT_LEN: u64 = 16;
/// Chain directory address.
pub const CHAIN_DIR_ADDR: u64 = DIR_ADDR + SEG_SLOTS * SLOT_LEN;
/// Chain directory slots (most partitions with linked leaves).
pub const CHAIN_SLOTS: u64 = 4096;
/// First heap byte in pool 0.
pub const HEAP_START: u64 = CHAIN_DIR_ADDR + CHAIN_SLOTS * 8;
/// Offset-slot flag: the entry is in an SSTable (`table << 32 | block << 12 | entry`).
pub const SST_FLAG: u64 = 1 << 63;
const SST_BLOCK: usize = 4096;

fn sst_off(table: u64, block: usize, entry: usize) -> u64 {
    SST_FLAG | (table & 0x7fff_ffff) << 32 | (block as u64 & 0xf_ffff) << 12 | (entry as u64 & 0xfff)
}

fn split_sst(off: u64) -> (u64, usize, usize) {
    ((off >> 32) & 0x7fff_ffff, ((off >> 12) & 0xf_ffff) as usize, (off & 0xfff) as usize)
}

fn table_path(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("{n:06}.sst"))
}

fn line_round(n: u64) -> u64 {
    n.div_ceil(64) * 64
}
const SB_MAGIC: &[u8; 8] = b"TKVLIGHT";
const VERSION: u32 = 1;

/// Encode the superblock.
pub fn encode_superblock(seg_size: u64) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(SB_MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[12..20].copy_from_slice(&seg_size.to_le_bytes());
    let c = crc::masked(&b[..60]);
    b[60..].copy_from_slice(&c.to_le_bytes());
    b
}

/// Decode the superblock: the segment size.
pub fn decode_superblock(b: &[u8]) -> std::result::Result<u64, String> {
    if b.len() < 64 || &b[..8] != SB_MAGIC {
        return Err("not a lightkv superblock (bad magic)".into());
    }
    if crc::masked(&b[..60]) != u32::from_le_bytes([b[60], b[61], b[62], b[63]]) {
        return Err("superblock checksum mismatch".into());
    }
    let v = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if v != VERSION {
        return Err(format!("unsupported lightkv layout version {v}"));
    }
    let mut s = [0u8; 8];
    s.copy_from_slice(&b[12..20]);
    Ok(u64::from_le_bytes(s))
}

#[derive(Debug)]
struct Seg {
    slot: u64,
    id: u64,
    pos: u64,
    live: u64,
    active: bool,
}

#[derive(Debug)]
struct State {
    tree: RhTree,
    /// Segments by base address.
    segs: BTreeMap<u64, Seg>,
    /// Each partition's active segment.
    active: std::collections::HashMap<PartitionId, u64>,
    free_slots: Vec<u64>,
    next_seq: u64,
    /// Chained partitions by chain slot (a partition's `tag` is its slot + 1).
    chains: HashMap<u64, ChainInfo>,
    free_chain_slots: Vec<u64>,
    next_table: u64,
    /// Segments whose entry count dropped to zero since the last sweep (candidates for
    /// freeing, so a write never scans every segment).
    emptied: Vec<u64>,
}

#[derive(Debug, Clone)]
struct ChainInfo {
    /// The chain record's extent.
    record: (u64, u64),
    /// PM leaves, newest first: extent and what the leaf says of its table.
    leaves: Vec<(u64, u64, LeafMeta)>,
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Live segments.
    pub segments: u64,
    /// Segments freed since open.
    pub segments_freed: u64,
    /// Records scanned at the last recovery.
    pub recovered_records: u64,
    /// Records recovery skipped because a flush had put them in a table.
    pub recovered_skipped: u64,
    /// Leaves flushed to SSTables.
    pub flushes: u64,
    /// Bytes of tables written by flushes.
    pub flush_bytes: u64,
    /// Partition compactions.
    pub compactions: u64,
    /// Bytes of tables written by compactions.
    pub compaction_bytes: u64,
    /// Table entries compactions dropped (superseded versions, tombstones at the bottom).
    pub compaction_dropped: u64,
}

/// The write buffer store.
pub struct PwbStore {
    region: Arc<Region>,
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    tables: Mutex<HashMap<u64, Arc<Table>>>,
    heap: Mutex<Heap>,
    state: RwLock<State>,
    seg_size: u64,
    /// Compaction size CS: leaves of equal compaction weight merged at once (§III-F).
    compaction_size: usize,
    stats: Mutex<StoreStats>,
}

impl std::fmt::Debug for PwbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PwbStore").field("dir", &self.dir).field("seg_size", &self.seg_size).finish()
    }
}

/// Reads keys from the write buffer (records are verified when written or recovered) or from
/// SSTables (every block read is verified).
struct Keys<'a>(&'a PwbStore);

/// The entry header at `addr`: (kind, key length, value length).
fn entry_header(r: &Region, addr: u64) -> Result<(Kind, usize, usize)> {
    let h = r.slice_checked(addr, pwb::ENTRY_HEADER, "PWB entry")?;
    let kind = if h[0] == 1 { Kind::Delete } else { Kind::Put };
    let klen = u16::from_le_bytes([h[1], h[2]]) as usize;
    let vlen = u32::from_le_bytes([h[3], h[4], h[5], h[6]]) as usize;
    Ok((kind, klen, vlen))
}

impl KeySource for Keys<'_> {
    fn key(&self, off: u64) -> Result<Vec<u8>> {
        if off & SST_FLAG != 0 {
            return Ok(self.0.sst_entry(off)?.1);
        }
        let r = &self.0.region;
        let (_, klen, _) = entry_header(r, off)?;
        Ok(r.slice_checked(off + pwb::ENTRY_HEADER as u64, klen, "PWB entry key")?.to_vec())
    }
}

/// A PWB entry read back: (kind, key, value).
type PwbRecord = (Kind, Vec<u8>, Vec<u8>);

impl PwbStore {
    /// Open the store: PM layout in `region` (created when `create`), SSTables in `dir`.
    pub fn open(
        region: Arc<Region>,
        fs: Arc<dyn Fs>,
        dir: &Path,
        create: bool,
        seg_size: u64,
        tree: RhOptions,
        compaction_size: usize,
    ) -> Result<PwbStore> {
        if create {
            let sb = encode_superblock(seg_size);
            // SAFETY: the layout area of a new store; nobody else uses the region yet.
            unsafe { region.write(SUPERBLOCK_ADDR, &sb)? };
            region.persist(SUPERBLOCK_ADDR, 64);
        }
        let sb = region.slice_checked(SUPERBLOCK_ADDR, 64, "lightkv superblock")?;
        let seg_size = decode_superblock(sb).map_err(|d| region.corruption(SUPERBLOCK_ADDR, d))?;
        let mut used: Vec<(u64, u64)> = Vec::new();
        // Segments.
        let mut segs = BTreeMap::new();
        let mut free_slots = Vec::new();
        for i in (0..SEG_SLOTS).rev() {
            let a = DIR_ADDR + i * SLOT_LEN;
            let id = region.load_u64_atomic(a + 8)?;
            if id == 0 {
                free_slots.push(i);
                continue;
            }
            let addr = region.load_u64_atomic(a)?;
            let h = region.slice_checked(addr, pwb::HEADER_LEN, "PWB segment header")?;
            match pwb::decode_header(h) {
                Ok((hid, size)) if hid == id && size == seg_size => {}
                Ok(_) => return Err(region.corruption(addr, "segment header does not match its directory slot")),
                Err(d) => return Err(region.corruption(addr, d)),
            }
            used.push((addr, seg_size));
            segs.insert(addr, Seg { slot: i, id, pos: 0, live: 0, active: false });
        }
        // Chained partitions: descriptor and PM leaves.
        let mut t = RhTree::new(tree);
        let mut chains = HashMap::new();
        let mut free_chain_slots = Vec::new();
        let mut referenced_tables = std::collections::BTreeSet::new();
        for slot in (0..CHAIN_SLOTS).rev() {
            let ra = region.load_u64_atomic(CHAIN_DIR_ADDR + slot * 8)?;
            if ra == 0 {
                free_chain_slots.push(slot);
                continue;
            }
            let (chain, rlen) = read_chain(&region, ra)?;
            used.push((ra, line_round(rlen as u64)));
            let mut leaves = Vec::new();
            let mut dram = Vec::new();
            for &la in &chain.leaves {
                let h = region.slice_checked(la, LEAF_HEADER, "PM leaf header")?;
                let len = leaf_len(h).map_err(|d| region.corruption(la, d))?;
                let b = region.slice_checked(la, len, "PM leaf")?;
                let (leaf, meta) = decode_leaf(b).map_err(|d| region.corruption(la, d))?;
                used.push((la, line_round(len as u64)));
                referenced_tables.insert(meta.table);
                leaves.push((la, len as u64, meta));
                dram.push(leaf);
            }
            let q = t.ensure_partition(&chain.desc).map_err(|d| region.corruption(ra, d))?;
            let part = t.partition_mut(q);
            part.chain = dram;
            part.tag = slot + 1;
            chains.insert(slot, ChainInfo { record: (ra, rlen as u64), leaves });
        }
        let heap = heap::rebuild(&region, HEAP_START, used)?;
        // Tables: delete those no leaf names (a crash hit a flush before its commit).
        let mut next_table = referenced_tables.iter().next_back().map_or(1, |n| n + 1);
        if create {
            fs.create_dir_all(dir)?;
        }
        for name in fs.list(dir)? {
            if let Some(n) = name.strip_suffix(".sst").and_then(|n| n.parse::<u64>().ok()) {
                next_table = next_table.max(n + 1);
                if !referenced_tables.contains(&n) {
                    fs.remove(&dir.join(&name))?;
                }
            }
        }
        // Replay every record in sequence order.
        // (seq, entry index, entry address, key)
        let mut recs: Vec<(u64, usize, u64, Vec<u8>)> = Vec::new();
        for (&addr, seg) in segs.iter_mut() {
            let bytes = region.slice_checked(addr, seg_size as usize, "PWB segment")?;
            let (rs, end) = pwb::scan(bytes, seg.id).map_err(|(off, d)| region.corruption(addr + off as u64, d))?;
            seg.pos = end as u64;
            for r in rs {
                for (i, e) in r.entries.iter().enumerate() {
                    recs.push((r.seq, i, addr + e.off as u64, e.key.to_vec()));
                }
            }
        }
        recs.sort_unstable_by_key(|r| (r.0, r.1));
        let next_seq = recs.last().map_or(1, |r| r.0 + 1);
        let st = State {
            tree: t,
            segs,
            active: Default::default(),
            free_slots,
            next_seq,
            chains,
            free_chain_slots,
            next_table,
            emptied: Vec::new(),
        };
        let s = PwbStore {
            region,
            fs,
            dir: dir.to_path_buf(),
            tables: Mutex::new(HashMap::new()),
            heap: Mutex::new(heap),
            state: RwLock::new(st),
            seg_size,
            compaction_size: compaction_size.max(2),
            stats: Mutex::new(StoreStats { recovered_records: recs.len() as u64, ..StoreStats::default() }),
        };
        {
            let mut st = s.state.write();
            let mut skipped = 0;
            for (seq, _, addr, key) in recs {
                let covered = st.tree.route(&key).is_some_and(|p| {
                    let tag = st.tree.partition(p).tag;
                    tag > 0
                        && st.chains.get(&(tag - 1)).and_then(|c| c.leaves.first()).is_some_and(|l| seq <= l.2.seq_hi)
                });
                if covered {
                    skipped += 1;
                    continue;
                }
                s.index(&mut st, &key, addr, seq)?;
            }
            s.stats.lock().recovered_skipped = skipped;
            // Every segment is inactive after recovery: those no entry points into go.
            st.emptied = st.segs.iter().filter(|(_, g)| g.live == 0).map(|(&a, _)| a).collect();
            s.free_emptied(&mut st)?;
        }
        Ok(s)
    }

    fn keys(&self) -> Keys<'_> {
        Keys(self)
    }

    fn table(&self, n: u64) -> Result<Arc<Table>> {
        if let Some(t) = self.tables.lock().get(&n) {
            return Ok(t.clone());
        }
        let t = Table::open(self.fs.as_ref(), &table_path(&self.dir, n))?;
        self.tables.lock().insert(n, t.clone());
        Ok(t)
    }

    /// The entry an SSTable offset slot names: (kind, key, value).
    fn sst_entry(&self, off: u64) -> Result<(Kind, Vec<u8>, Vec<u8>)> {
        let (n, block, entry) = split_sst(off);
        let t = self.table(n)?;
        let bad = |d: &str| Error::corruption(t.path(), 0, format!("RH-Tree entry {off:#x}: {d}"));
        let h = t.index().get(block).map(|x| x.1).ok_or_else(|| bad("no such block"))?;
        let payload = t.read_block(h)?;
        let e = block_entries(&payload)
            .nth(entry)
            .ok_or_else(|| bad("no such entry"))?
            .map_err(|d| Error::corruption(t.path(), h.offset, d))?;
        let kind = match e.kind {
            crate::sstable::Kind::Put => Kind::Put,
            crate::sstable::Kind::Delete => Kind::Delete,
        };
        Ok((kind, e.key.to_vec(), e.value.to_vec()))
    }

    fn pwb_record(&self, addr: u64) -> Result<PwbRecord> {
        let (kind, klen, vlen) = entry_header(&self.region, addr)?;
        let body = self.region.slice_checked(addr + pwb::ENTRY_HEADER as u64, klen + vlen, "PWB entry body")?;
        Ok((kind, body[..klen].to_vec(), body[klen..].to_vec()))
    }

    fn seg_of(st: &State, addr: u64) -> Option<u64> {
        st.segs.range(..=addr).next_back().map(|(&a, _)| a)
    }

    /// One entry no longer points at the write-buffer record at `addr`.
    fn release(st: &mut State, addr: u64) {
        if let Some(a) = Self::seg_of(st, addr) {
            if let Some(g) = st.segs.get_mut(&a) {
                g.live = g.live.saturating_sub(1);
                if g.live == 0 {
                    st.emptied.push(a);
                }
            }
        }
    }

    /// Free the segments whose count dropped to zero and that take no more writes.
    fn free_emptied(&self, st: &mut State) -> Result<()> {
        for a in std::mem::take(&mut st.emptied) {
            if st.segs.get(&a).is_some_and(|g| g.live == 0 && !g.active) {
                self.free_segment(st, a)?;
            }
        }
        Ok(())
    }

    /// Index the record at `addr` for `key`, keeping segment entry counts; a full leaf that
    /// cannot split is linked behind a fresh one and flushed.
    /// `seq` is the sequence number of the record being indexed.
    fn index(&self, st: &mut State, key: &[u8], addr: u64, seq: u64) -> Result<()> {
        loop {
            match st.tree.insert(key, addr, &self.keys())? {
                Insert::Full(p) => {
                    st.tree.link(p);
                    // The record being indexed (and the rest of its batch) is not in the
                    // linked leaf: the flush covers sequence numbers below it.
                    self.flush_chain_head(st, p, seq - 1)?;
                }
                Insert::Inserted(_) => break,
                Insert::Updated(_, old) => {
                    if old & SST_FLAG == 0 {
                        Self::release(st, old);
                    }
                    break;
                }
            }
        }
        if let Some(g) = Self::seg_of(st, addr).and_then(|a| st.segs.get_mut(&a)) {
            g.live += 1;
        }
        Ok(())
    }

    fn alloc(&self, len: u64) -> Result<u64> {
        heap::alloc_or_grow(&mut self.heap.lock(), &self.region, len)
    }

    /// Write `bytes` to a new PM extent and persist them.
    fn put_extent(&self, bytes: &[u8]) -> Result<u64> {
        let a = self.alloc(bytes.len() as u64)?;
        // SAFETY: a freshly allocated extent nobody else refers to yet.
        unsafe { self.region.write(a, bytes)? };
        self.region.persist(a, bytes.len() as u64);
        Ok(a)
    }

    /// Flush partition `p`'s newest linked leaf (its write-buffer records) to an SSTable,
    /// copy the leaf to PM pointing at the table, and commit a new chain record.
    fn flush_chain_head(&self, st: &mut State, p: PartitionId, seq_hi: u64) -> Result<()> {
        let leaf = st
            .tree
            .partition(p)
            .chain
            .first()
            .cloned()
            .ok_or_else(|| Error::Poisoned("flush of an empty chain".into()))?;
        let mut recs: Vec<(u64, PwbRecord)> = Vec::with_capacity(leaf.live());
        for off in leaf.offsets() {
            if off & SST_FLAG != 0 {
                return Err(Error::Poisoned("a linked leaf being flushed already points at a table".into()));
            }
            recs.push((off, self.pwb_record(off)?));
        }
        recs.sort_by(|a, b| a.1 .1.cmp(&b.1 .1));
        let n = st.next_table;
        st.next_table += 1;
        let path = table_path(&self.dir, n);
        let mut b = TableBuilder::create(self.fs.as_ref(), &path, SST_BLOCK, 0)?;
        for (_, (kind, k, v)) in &recs {
            let kind = match kind {
                Kind::Put => crate::sstable::Kind::Put,
                Kind::Delete => crate::sstable::Kind::Delete,
            };
            b.add(kind, k, v)?;
        }
        b.finish()?;
        self.fs.sync_dir(&self.dir)?;
        let table = self.table(n)?;
        let mut loc: HashMap<Vec<u8>, u64> = HashMap::with_capacity(recs.len());
        for (bi, (_, h)) in table.index().iter().enumerate() {
            let payload = table.read_block(*h)?;
            for (ei, e) in block_entries(&payload).enumerate() {
                let e = e.map_err(|d| Error::corruption(table.path(), h.offset, d))?;
                loc.insert(e.key.to_vec(), sst_off(n, bi, ei));
            }
        }
        let by_addr: HashMap<u64, u64> = recs.iter().filter_map(|(a, r)| loc.get(&r.1).map(|&o| (*a, o))).collect();
        if by_addr.len() != recs.len() {
            return Err(Error::corruption(&path, 0, "a flushed key is missing from its new table"));
        }
        let mut pm_leaf = leaf.clone();
        pm_leaf.remap(|old| by_addr.get(&old).copied().unwrap_or(old));
        // Every record of the partition below `seq_hi` is in this table or superseded by one
        // that is: recovery may skip them all.
        let meta = LeafMeta { table: n, cw: 0, seq_hi };
        let lb = encode_leaf(&pm_leaf, st.tree.options().leaf_buckets, meta);
        let la = self.put_extent(&lb)?;
        let tag = st.tree.partition(p).tag;
        let (slot, mut leaves) = match tag.checked_sub(1).and_then(|s| st.chains.get(&s).map(|c| (s, c.leaves.clone())))
        {
            Some(x) => x,
            None => {
                let s = st
                    .free_chain_slots
                    .pop()
                    .ok_or_else(|| Error::PmFull(format!("all {CHAIN_SLOTS} chain slots are in use")))?;
                (s, Vec::new())
            }
        };
        leaves.insert(0, (la, lb.len() as u64, meta));
        let chain = Chain { desc: st.tree.descriptor(p), leaves: leaves.iter().map(|l| l.0).collect() };
        let rb = encode_chain(&chain);
        let ra = self.put_extent(&rb)?;
        // Commit.
        let sa = CHAIN_DIR_ADDR + slot * 8;
        self.region.store_u64_atomic(sa, ra)?;
        self.region.persist(sa, 8);
        if let Some(old) = st.chains.insert(slot, ChainInfo { record: (ra, rb.len() as u64), leaves }) {
            self.heap.lock().free(old.record.0, line_round(old.record.1));
        }
        let part = st.tree.partition_mut(p);
        part.tag = slot + 1;
        part.chain[0] = pm_leaf;
        for (a, _) in &recs {
            Self::release(st, *a);
        }
        self.free_emptied(st)?;
        {
            let mut c = self.stats.lock();
            c.flushes += 1;
            c.flush_bytes += table.size();
        }
        // §III-F: CS leaves of equal compaction weight at the head of the chain merge into
        // one of weight + 1, and that may complete a run one weight up.
        while self.compact_head(st, p, slot)? {}
        Ok(())
    }

    /// Merge the chain's `CS` newest leaves if they have equal compaction weight. Weights
    /// ascend along a chain (every new leaf has weight 0 and a merge replaces a run at the
    /// head), so equal-weight runs always start at the head. Returns whether it merged.
    fn compact_head(&self, st: &mut State, p: PartitionId, slot: u64) -> Result<bool> {
        let cs = self.compaction_size;
        let Some(info) = st.chains.get(&slot).cloned() else { return Ok(false) };
        if info.leaves.len() < cs || info.leaves[..cs].iter().any(|l| l.2.cw != info.leaves[0].2.cw) {
            return Ok(false);
        }
        let inputs = &info.leaves[..cs];
        let bottom = info.leaves.len() == cs;
        // Newest version of each key across the inputs (newest input first).
        let mut merged: BTreeMap<Vec<u8>, (crate::sstable::Kind, Vec<u8>)> = BTreeMap::new();
        let mut seen = 0u64;
        for l in inputs {
            let t = self.table(l.2.table)?;
            t.for_each(|e, _| {
                seen += 1;
                merged.entry(e.key.to_vec()).or_insert_with(|| (e.kind, e.value.to_vec()));
                Ok(())
            })?;
        }
        if bottom {
            // Nothing older in this partition: tombstones have nothing left to hide.
            merged.retain(|_, (k, _)| *k == crate::sstable::Kind::Put);
        }
        let n = st.next_table;
        st.next_table += 1;
        let path = table_path(&self.dir, n);
        let mut b = TableBuilder::create(self.fs.as_ref(), &path, SST_BLOCK, 0)?;
        for (k, (kind, v)) in &merged {
            b.add(*kind, k, v)?;
        }
        b.finish()?;
        self.fs.sync_dir(&self.dir)?;
        let table = self.table(n)?;
        // The output leaf: as many normal buckets as the inputs together (doubled until every
        // key fits), entries pointing at the new table.
        let depth = st.tree.partition(p).top.depth();
        let mut normal: usize = st.tree.partition(p).chain[..cs].iter().map(|l| l.normal()).sum();
        let mut offs = Vec::with_capacity(merged.len());
        for (bi, (_, h)) in table.index().iter().enumerate() {
            let payload = table.read_block(*h)?;
            for (ei, e) in block_entries(&payload).enumerate() {
                let e = e.map_err(|d| Error::corruption(table.path(), h.offset, d))?;
                offs.push((e.key.to_vec(), sst_off(n, bi, ei)));
            }
        }
        let leaf = loop {
            let mut l = crate::index::rhtree::Leaf::new(normal, depth);
            if offs.iter().all(|(k, o)| l.add_new(k, *o)) {
                break l;
            }
            normal *= 2;
        };
        let meta = LeafMeta { table: n, cw: inputs[0].2.cw + 1, seq_hi: inputs[0].2.seq_hi };
        let lb = encode_leaf(&leaf, leaf.normal(), meta);
        let la = self.put_extent(&lb)?;
        let mut leaves = vec![(la, lb.len() as u64, meta)];
        leaves.extend_from_slice(&info.leaves[cs..]);
        let rb = encode_chain(&Chain { desc: st.tree.descriptor(p), leaves: leaves.iter().map(|l| l.0).collect() });
        let ra = self.put_extent(&rb)?;
        // Commit.
        let sa = CHAIN_DIR_ADDR + slot * 8;
        self.region.store_u64_atomic(sa, ra)?;
        self.region.persist(sa, 8);
        {
            let mut h = self.heap.lock();
            h.free(info.record.0, line_round(info.record.1));
            for l in inputs {
                h.free(l.0, line_round(l.1));
            }
        }
        st.chains.insert(slot, ChainInfo { record: (ra, rb.len() as u64), leaves });
        st.tree.partition_mut(p).chain.splice(..cs, [leaf]);
        for l in inputs {
            self.tables.lock().remove(&l.2.table);
            self.fs.remove(&table_path(&self.dir, l.2.table))?;
        }
        let mut c = self.stats.lock();
        c.compactions += 1;
        c.compaction_bytes += table.size();
        c.compaction_dropped += seen - merged.len() as u64;
        Ok(true)
    }

    fn free_segment(&self, st: &mut State, addr: u64) -> Result<()> {
        let Some(g) = st.segs.remove(&addr) else { return Ok(()) };
        let slot = DIR_ADDR + g.slot * SLOT_LEN;
        self.region.store_u64_atomic(slot + 8, 0)?;
        self.region.persist(slot + 8, 8);
        self.heap.lock().free(addr, self.seg_size);
        st.free_slots.push(g.slot);
        self.stats.lock().segments_freed += 1;
        Ok(())
    }

    fn new_segment(&self, st: &mut State) -> Result<u64> {
        let slot = st
            .free_slots
            .pop()
            .ok_or_else(|| Error::PmFull(format!("all {SEG_SLOTS} PWB segment slots are in use")))?;
        let addr = match self.alloc(self.seg_size) {
            Ok(a) => a,
            Err(e) => {
                st.free_slots.push(slot);
                return Err(e);
            }
        };
        let id = self.region.load_u64_atomic(ID_COUNTER_ADDR)? + 1;
        self.region.store_u64_atomic(ID_COUNTER_ADDR, id)?;
        self.region.persist(ID_COUNTER_ADDR, 8);
        let h = pwb::encode_header(id, self.seg_size);
        // SAFETY: a freshly allocated extent; only this writer (under the state lock) uses it.
        unsafe { self.region.write(addr, &h)? };
        self.region.persist(addr, pwb::HEADER_LEN as u64);
        let sa = DIR_ADDR + slot * SLOT_LEN;
        self.region.store_u64_atomic(sa, addr)?;
        self.region.persist(sa, 8);
        self.region.store_u64_atomic(sa + 8, id)?;
        self.region.persist(sa + 8, 8);
        st.segs.insert(addr, Seg { slot, id, pos: pwb::HEADER_LEN as u64, live: 0, active: true });
        Ok(addr)
    }

    /// Append one put or delete and index it. Durable when it returns.
    pub fn write(&self, kind: Kind, key: &[u8], value: &[u8]) -> Result<()> {
        self.write_batch(&[(kind, key, value)])
    }

    /// Append `ops` as one record (atomic: after a crash all or none of them are there),
    /// in the active segment of the first key's partition, and index each. Durable when it
    /// returns.
    pub fn write_batch(&self, ops: &[pwb::Op<'_>]) -> Result<()> {
        let Some(first) = ops.first() else { return Ok(()) };
        let mut st = self.state.write();
        let p = st.tree.route_mut(first.1);
        let size = pwb::record_size(ops.iter().map(|o| (o.1.len(), o.2.len()))) as u64;
        if size > self.seg_size - pwb::HEADER_LEN as u64 {
            return Err(Error::InvalidArgument(format!(
                "a write of {size} bytes does not fit in a {}-byte PWB segment",
                self.seg_size
            )));
        }
        let seg = match st.active.get(&p).copied() {
            Some(a) if st.segs.get(&a).is_some_and(|g| g.pos + size <= self.seg_size) => a,
            old => {
                if let Some(a) = old {
                    if let Some(g) = st.segs.get_mut(&a) {
                        g.active = false;
                        if g.live == 0 {
                            self.free_segment(&mut st, a)?;
                        }
                    }
                }
                let a = self.new_segment(&mut st)?;
                st.active.insert(p, a);
                a
            }
        };
        let seq = st.next_seq;
        let (id, pos) = st
            .segs
            .get(&seg)
            .map(|g| (g.id, g.pos))
            .ok_or_else(|| Error::Poisoned("active segment vanished".into()))?;
        let (rec, offs) = pwb::encode_record(id, seq, ops);
        let addr = seg + pos;
        // SAFETY: bytes past the segment's write position belong to this writer alone
        // (under the state lock); readers only follow index entries to persisted records.
        unsafe { self.region.write(addr, &rec)? };
        self.region.persist(addr, rec.len() as u64);
        st.next_seq += 1;
        if let Some(g) = st.segs.get_mut(&seg) {
            g.pos += rec.len() as u64;
        }
        for (op, off) in ops.iter().zip(offs) {
            self.index(&mut st, op.1, addr + off as u64, seq)?;
        }
        // A segment whose last entry was just superseded, and that takes no more writes, goes.
        self.free_emptied(&mut st)?;
        Ok(())
    }

    /// The newest value of `key` (`None` if absent or deleted).
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let st = self.state.read();
        let Some((_, off)) = st.tree.get(key, &self.keys())? else { return Ok(None) };
        let (kind, value) = if off & SST_FLAG != 0 {
            let (kind, _, v) = self.sst_entry(off)?;
            (kind, v)
        } else {
            let (kind, _, v) = self.pwb_record(off)?;
            (kind, v)
        };
        Ok((kind == Kind::Put).then_some(value))
    }

    /// Every live key and value, sorted (tests and checks; not the scan path).
    pub fn dump(&self) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let st = self.state.read();
        let mut keys = std::collections::BTreeSet::new();
        for p in st.tree.partitions_in_order() {
            let part = st.tree.partition(p);
            for leaf in std::iter::once(&part.top).chain(part.chain.iter()) {
                for off in leaf.offsets() {
                    keys.insert(self.keys().key(off)?);
                }
            }
        }
        drop(st);
        let mut out = Vec::new();
        for k in keys {
            if let Some(v) = self.get(&k)? {
                out.push((k, v));
            }
        }
        Ok(out)
    }

    /// Counters.
    pub fn stats(&self) -> StoreStats {
        let mut s = *self.stats.lock();
        s.segments = self.state.read().segs.len() as u64;
        s
    }
}

/// Read the chain record at `addr`: the record and its length.
fn read_chain(region: &Region, addr: u64) -> Result<(Chain, usize)> {
    let head = region.slice_checked(addr, 17, "chain record")?;
    let (plen, vlen) =
        (u16::from_le_bytes([head[13], head[14]]) as usize, u16::from_le_bytes([head[15], head[16]]) as usize);
    let at = 17 + plen + vlen;
    let nb = region.slice_checked(addr + at as u64, 4, "chain record")?;
    let n = u32::from_le_bytes([nb[0], nb[1], nb[2], nb[3]]) as usize;
    if n > 1 << 20 {
        return Err(region.corruption(addr, format!("chain record claims {n} leaves")));
    }
    let len = at + 4 + 8 * n + 4;
    let b = region.slice_checked(addr, len, "chain record")?;
    decode_chain(b).map_err(|d| region.corruption(addr, d))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::BTreeMap;

    use super::*;
    use crate::fs::FaultFs;
    use crate::pm::sim::SimDevice;
    use crate::pm::{Backing, RegionConfig};

    fn region(dev: &SimDevice, create: bool) -> Arc<Region> {
        Arc::new(
            Region::open(RegionConfig {
                backing: Backing::Sim(dev.clone()),
                pool_size: 1 << 20,
                db_id: 5,
                sync: false,
                write_latency_ns: 0,
                write_bandwidth_mbps: 0,
                create,
                health: Default::default(),
            })
            .unwrap(),
        )
    }

    /// Small leaves that split often, and room for every partition the workloads need (no
    /// linked leaves, so no flush).
    fn small() -> RhOptions {
        RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 4096 }
    }

    /// Small leaves and few partitions: full leaves are linked and flushed to SSTables.
    fn flushing() -> RhOptions {
        RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 6 }
    }

    fn open(dev: &SimDevice, fs: &FaultFs, create: bool, o: RhOptions) -> Result<PwbStore> {
        PwbStore::open(region(dev, create), Arc::new(fs.clone()), Path::new("/t"), create, 8192, o, 4)
    }

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    fn step(s: &PwbStore, m: &mut Model, i: u32) -> Result<()> {
        let k = format!("key{:03}", (i * 37) % 150).into_bytes();
        if i % 11 == 5 {
            // A batch over keys of different partitions: all or nothing after a crash.
            let k2 = format!("key{:03}", (i * 53 + 7) % 150).into_bytes();
            let k3 = format!("~zz{}", i % 40).into_bytes();
            let v = vec![(i % 7) as u8; 30];
            s.write_batch(&[(Kind::Put, &k, &v), (Kind::Delete, &k2, b""), (Kind::Put, &k3, &v)])?;
            m.insert(k.clone(), v.clone());
            m.remove(&k2);
            m.insert(k3, v);
            return Ok(());
        }
        if i % 7 == 3 {
            s.write(Kind::Delete, &k, b"")?;
            m.remove(&k);
        } else {
            let v = vec![(i % 251) as u8; 40 + (i as usize % 200)];
            s.write(Kind::Put, &k, &v)?;
            m.insert(k, v);
        }
        Ok(())
    }

    #[test]
    fn superblock_golden_bytes() {
        let hex: String = encode_superblock(4 << 20).iter().map(|x| format!("{x:02x}")).collect();
        assert_eq!(hex, format!("544b564c4947485401000000000040000000000000{}9a5f7d58", "00".repeat(39)));
        assert_eq!(decode_superblock(&encode_superblock(4 << 20)), Ok(4 << 20));
        let mut bad = encode_superblock(4 << 20);
        bad[13] ^= 1;
        assert!(decode_superblock(&bad).unwrap_err().contains("checksum"));
    }

    #[test]
    fn writes_read_back_and_survive_reopen_with_segments_recycled() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let s = open(&dev, &fs, true, small()).unwrap();
        let mut m = Model::new();
        for i in 0..3000 {
            step(&s, &mut m, i).unwrap();
        }
        assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
        let st = s.stats();
        assert!(st.segments_freed > 10, "overwrites free whole segments: {st:?}");
        drop(s);
        let s = open(&dev, &fs, false, small()).unwrap();
        assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
        assert!(s.stats().recovered_records > 0);
    }

    #[test]
    fn full_leaves_are_flushed_to_tables_and_recovery_skips_what_they_cover() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let s = open(&dev, &fs, true, flushing()).unwrap();
        let mut m = Model::new();
        for i in 0..3000 {
            step(&s, &mut m, i).unwrap();
        }
        let st = s.stats();
        assert!(st.flushes > 20, "{st:?}");
        assert!(st.segments_freed > 10, "flushed records release their segments: {st:?}");
        let tables = fs.list(Path::new("/t")).unwrap().iter().filter(|n| n.ends_with(".sst")).count();
        let named: usize = s.state.read().chains.values().map(|c| c.leaves.len()).sum();
        assert_eq!(tables, named, "every table is named by a PM leaf, and only those remain");
        assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
        drop(s);
        let s = open(&dev, &fs, false, flushing()).unwrap();
        let st = s.stats();
        assert!(st.recovered_skipped > 0 || st.recovered_records == 0, "{st:?}");
        assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
        // More writes after recovery flush into the restored chains.
        for i in 3000..4000 {
            step(&s, &mut m, i).unwrap();
        }
        assert!(s.stats().flushes > 0);
        assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn partition_compaction_merges_runs_of_equal_weight_and_bounds_write_amplification() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let s = open(&dev, &fs, true, flushing()).unwrap();
        let mut m = Model::new();
        for i in 0..6000 {
            step(&s, &mut m, i).unwrap();
        }
        let st = s.stats();
        assert!(st.compactions > 5, "{st:?}");
        assert!(st.compaction_dropped > 0, "superseded versions are dropped: {st:?}");
        // Every chain is a base-CS counter: weights ascend, fewer than CS leaves per weight.
        {
            let g = s.state.read();
            for c in g.chains.values() {
                let w: Vec<u32> = c.leaves.iter().map(|l| l.2.cw).collect();
                assert!(w.windows(2).all(|x| x[0] <= x[1]), "weights ascend: {w:?}");
                for x in 0..=w.iter().copied().max().unwrap_or(0) {
                    assert!(w.iter().filter(|&&y| y == x).count() < 4, "a full run was left unmerged: {w:?}");
                }
            }
        }
        // Only the tables the chains name are left.
        let tables = fs.list(Path::new("/t")).unwrap().iter().filter(|n| n.ends_with(".sst")).count();
        let named: usize = s.state.read().chains.values().map(|c| c.leaves.len()).sum();
        assert_eq!(tables, named);
        let wa = (st.flush_bytes + st.compaction_bytes) as f64 / st.flush_bytes as f64;
        let per_partition = st.flushes as f64 / 6.0;
        let bound = per_partition.log(4.0) + 1.0;
        eprintln!("table write amplification {wa:.2} (log_4(N) + 1 = {bound:.2}, N = {per_partition:.1} flushes per partition)");
        assert!(wa <= bound + 0.5, "WA {wa:.2} above log_CS(N) + 1 = {bound:.2}");
        assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
        drop(s);
        let s = open(&dev, &fs, false, flushing()).unwrap();
        assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn write_amplification_on_a_growing_load_follows_log_cs_n_plus_one() {
        // New keys only (nothing is superseded): every flushed byte is rewritten once per
        // compaction level it climbs, so WA = (flush + compaction bytes) / flush bytes is
        // close to log_CS(N) + 1 for N flushes per partition.
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let o = RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 2 };
        let s = PwbStore::open(region(&dev, true), Arc::new(fs.clone()), Path::new("/t"), true, 8192, o, 4).unwrap();
        for i in 0..5000u32 {
            let k = format!("{:08x}", i.wrapping_mul(2_654_435_761));
            s.write(Kind::Put, k.as_bytes(), &[7u8; 60]).unwrap();
        }
        let st = s.stats();
        let n = st.flushes as f64 / s.state.read().tree.partition_count() as f64;
        let wa = (st.flush_bytes + st.compaction_bytes) as f64 / st.flush_bytes as f64;
        let bound = n.log(4.0) + 1.0;
        eprintln!(
            "growing load: {} flushes, {} compactions, N = {n:.1} per partition, WA {wa:.2}, log_4(N) + 1 = {bound:.2}",
            st.flushes, st.compactions
        );
        assert!(wa <= bound + 0.05 && wa >= bound - 1.0, "WA {wa:.2} vs log_4(N) + 1 = {bound:.2}");
    }

    #[test]
    fn the_flush_crash_workload_compacts() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let s = open(&dev, &fs, true, flushing()).unwrap();
        let mut m = Model::new();
        for i in 0..700 {
            step(&s, &mut m, i).unwrap();
        }
        assert!(s.stats().compactions > 0, "{:?}", s.stats());
    }

    fn crash_points(o: RhOptions, steps: u32, stride: usize) -> usize {
        let mut points = 0;
        for n in (1..100_000u64).step_by(stride) {
            let dev = SimDevice::new();
            let fs = FaultFs::new();
            let s = open(&dev, &fs, true, o).unwrap();
            let f2 = fs.clone();
            dev.on_freeze(move || f2.freeze());
            dev.crash_before_fence(dev.fences() + n);
            let mut m = Model::new();
            let mut pending = None;
            for i in 0..steps {
                let mut next = m.clone();
                if step(&s, &mut next, i).is_err() || dev.crashed() {
                    pending = Some(next);
                    break;
                }
                m = next;
            }
            if pending.is_none() && !dev.crashed() {
                break;
            }
            drop(s);
            points += 1;
            let dev2 = dev.simulate_crash(n, 0.5);
            let fs2 = fs.crash();
            let s = open(&dev2, &fs2, false, o).unwrap_or_else(|e| panic!("crash point {n}: reopen failed: {e}"));
            let got: Model = s.dump().unwrap().into_iter().collect();
            let ok = got == m || pending.as_ref().is_some_and(|p| &got == p);
            assert!(ok, "crash point {n}: state is not the acknowledged writes");
            // The recovered store keeps working.
            s.write(Kind::Put, b"after", b"crash").unwrap();
            assert_eq!(s.get(b"after").unwrap().as_deref(), Some(&b"crash"[..]));
        }
        points
    }

    #[test]
    fn a_crash_at_every_persist_point_keeps_every_acknowledged_write() {
        let points = crash_points(small(), 1200, 5);
        assert!(points > 200, "{points}");
        eprintln!("write buffer only: {points} crash points");
    }

    #[test]
    fn a_crash_at_every_persist_point_of_flushes_keeps_every_acknowledged_write() {
        let points = crash_points(flushing(), 700, 3);
        assert!(points > 200, "{points}");
        eprintln!("with flushes: {points} crash points");
    }
}
