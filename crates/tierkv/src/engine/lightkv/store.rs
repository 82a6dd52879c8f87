//! LightKV's store core: the RH-Tree over PM write-buffer segments, the flush of full leaves
//! to SSTables with persistent leaf copies (Fig. 6), partition compaction (§III-F), the
//! sorted view and table list range reads use ([`super::iter`], [`super::view`]), and
//! recovery by segment scan or from a clean-shutdown image (§V). The engine
//! ([`super::Lightkv`]) adds the background threads around it (docs/design/lightkv.md).
//!
//! # PM layout (docs/format/lightkv.md)
//! Pool 0: superblock at 64 (`TKVLIGHT`, version, segment size, crc), the segment-id counter
//! at 128 (an 8-byte word bumped and persisted before an id is used, so ids are never
//! reused even after segments are freed), the clean-shutdown image pointer at 192 (0 when
//! the DRAM part must be rebuilt by scanning), the segment directory at 4096 (`SEG_SLOTS`
//! slots of `addr u64 | id u64`; a slot is live when its id is non-zero), the chain directory
//! (`CHAIN_SLOTS` 8-byte addresses of chain records, 0 = empty), and the PM heap after it.
//!
//! # Write path
//! A put routes its key to a partition, appends a record to the partition's active segment
//! (a new segment when it is full; a write larger than a segment gets a segment of its own
//! size), persists it with one fence, and indexes it in the RH-Tree. A batch is one record
//! (atomic), in the first key's partition's segment.
//!
//! **Writers in parallel: partition lanes.** Each partition has a writer lock, its *lane*
//! (partition id modulo [`LANES`]; two partitions may share one). A single put or delete
//! holds its partition's lane for the whole write and the state lock only briefly
//! ([`PwbStore::write_in_lane`]): shared while it probes the top leaf for its key (the key
//! comparisons, which read and verify PM records), picks its write position and takes a
//! sequence number; none while it encodes, writes and persists its record (page faults and
//! the fence); shared again while it indexes the entry at the probed slot (no key
//! compared): the partition's top leaf has its own lock ([`rhtree::TopLeaf`]) and the
//! segments' write positions and entry counts are atomics ([`PwbStore::index_shared`]).
//! Only an entry that needs a split or a link, a segment to free, dropping an idle sorted
//! view, or the LightKV_PM images takes the exclusive lock for that last step (the sorted
//! view has its own lock). So writers of
//! different partitions probe, persist and index in parallel. A batch, and a key that needs a new end
//! partition, holds every lane ([`PwbStore::write_exclusive`]), as do the clean-shutdown
//! image and `check` (no record is then between its append and its index update). Lock
//! order: lanes (ascending), then the state lock, then the small mutexes.
//!
//! What keeps recovery exact with the PM layout unchanged (format version 1):
//! - *A segment still has one writer at a time.* A segment is only ever the active segment
//!   of one partition, and only the holder of that partition's lane appends to it or
//!   replaces it. So records of one segment are persisted in order and a torn record is
//!   still always the last of its segment: a bad record followed by a verifying one is still
//!   damage (`Corruption`), never a crash. (Writers of different partitions write different
//!   segments: one partition's torn record never sits before another's completed one.)
//! - *Per partition, index order is sequence order.* A writer takes its sequence number
//!   under its partition's lane and indexes before releasing it; a split of a partition
//!   happens inside an index step, under its lane, and a waiting writer re-routes its key
//!   after taking a lane (a moved key retries in its new partition's lane). Sequence
//!   numbers of different partitions interleave freely, but recovery only compares them
//!   within a partition: a linked leaf's `seq_hi` (the sequence number before the record
//!   that overflowed it) still bounds exactly the partition's records indexed before the
//!   link, and replay in sequence order re-indexes each partition's records in the order
//!   they were indexed (partitions do not interact). A crash may keep a write of one
//!   partition and lose a concurrent, unacknowledged one with a lower sequence number of
//!   another partition; both were in flight, and each is whole or absent.
//!
//! Deletes append a tombstone and index it: a tombstone must outlive every older record of
//! its key in the PWB and every older SSTable of its partition. Each segment counts the index
//! entries pointing into it; an inactive segment whose count reaches zero is freed (its slot
//! cleared with an atomic store, then its extent returned to the heap).
//!
//! # Flush (Fig. 6)
//! When a full top leaf cannot split, [`RhTree::link`] puts a fresh top leaf in front of it
//! and the full leaf is queued for flushing; it stays searchable in DRAM meanwhile, pointing
//! at its write-buffer records. The flush (a background thread, or the writer when
//! `background` is off) takes a partition's oldest unflushed leaf, sorts its records into an
//! SSTable (fsynced, directory synced), re-points the leaf at the table's entries
//! (`1 << 63 | table << 32 | block << 12 | entry`), copies it to PM, then writes a new chain
//! record (the partition's descriptor and its PM leaves, newest first) and commits it with
//! one 8-byte store into the partition's chain slot. Only then does the DRAM leaf give way to
//! the PM one and are the records' segments released. A crash before the commit leaves an
//! orphan table (deleted at open) and unreferenced PM extents (the heap is rebuilt from what
//! is referenced); the records are still in the write buffer. After it, recovery skips the
//! partition's records at or below the newest PM leaf's `seq_hi`: each of them is in a table
//! or superseded by one that is.
//!
//! # Compaction (§III-F)
//! After a flush commit, the partition's PM leaves are checked for `compaction_size` (CS)
//! adjacent leaves of equal compaction weight; their tables are merged by a streaming k-way
//! merge (newest wins; tombstones dropped when the run ends at the partition's oldest leaf)
//! into one table of weight + 1, whose leaf is rebuilt from the output's keys. The new chain
//! record replaces the run by the output leaf; the inputs' tables and PM leaves are freed
//! after the commit. Flushes only add leaves at the head of a chain and one compaction runs
//! at a time, so a picked run is still in place at its commit.
//!
//! # Reads
//! A get routes the key to its partition and searches its leaves newest first: the top leaf
//! and unflushed leaves in DRAM, then the PM leaves (in PM, or in DRAM with
//! [`LightkvPlacement::Dram`]); the first hit decides (a tombstone means absent). A PM leaf
//! is probed in place: only the key's two buckets (and the extra area if the leaf used it)
//! are read. Table entries are read through the block cache. Range reads: see "Range
//! reads: the iterator" in [`super`]; while range reads use it, every write also updates
//! the sorted view, a flush commit retires its records' view entries, and a freed
//! segment's extent waits for the iterators created before the free.
//!
//! # Recovery
//! Read both directories; rebuild each chained partition from its descriptor
//! ([`RhTree::ensure_partition`]) with its PM leaves; rebuild the heap from the live extents.
//! With a valid clean-shutdown image, restore every partition's place, top leaf, active
//! segment and the segments' write positions from it, then clear the image pointer before
//! the store takes a write (a later crash scans). Without one, scan every segment (a torn
//! tail ends a segment; damage before valid records is `Corruption`) and re-index the
//! records in sequence order, skipping those a flush covered. Segments left with no entry
//! are freed; tables no leaf names are deleted.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard, RwLock, RwLockWriteGuard};

use super::iter::{Run, TableRuns};
use super::leaf::{
    self, decode_bucket, decode_chain, decode_image, decode_leaf, encode_chain, encode_image, encode_leaf, image_len,
    leaf_len, Chain, Image, LeafMeta, IMAGE_HEADER, LEAF_HEADER,
};
use super::pwb::{self, Kind};
use super::view::{Pins, SortedView};
use crate::engine::Cond;
use crate::error::{Error, Result};
use crate::format::crc;
use crate::fs::Fs;
use crate::index::rhtree::{self, Insert, KeySource, Leaf, PartitionDesc, PartitionId, Probe, RhOptions, RhTree};
use crate::iter::{BoxedIter, InternalIterator};
use crate::options::LightkvPlacement;
use crate::pm::heap::{self, Heap};
use crate::pm::Region;
use crate::poison::Poison;
use crate::sstable::{self, block_entries, BlockCache, Table, TableBuilder, TableCursor};

/// Superblock address.
pub const SUPERBLOCK_ADDR: u64 = 64;
/// Segment-id counter address.
pub const ID_COUNTER_ADDR: u64 = 128;
/// Clean-shutdown image pointer address.
pub const IMAGE_PTR_ADDR: u64 = 192;
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
/// Unflushed leaves (all partitions) beyond which a writer waits for the flush thread.
pub const MAX_PENDING_FLUSHES: usize = 8;
/// Writer lanes: partition `p` appends under lane `p % LANES` (see "Write path").
pub const LANES: usize = 128;

pub(crate) fn sst_off(table: u64, block: usize, entry: usize) -> u64 {
    SST_FLAG | (table & 0x7fff_ffff) << 32 | (block as u64 & 0xf_ffff) << 12 | (entry as u64 & 0xfff)
}

pub(crate) fn split_sst(off: u64) -> (u64, usize, usize) {
    ((off >> 32) & 0x7fff_ffff, ((off >> 12) & 0xf_ffff) as usize, (off & 0xfff) as usize)
}

/// File name of SSTable `n`.
pub fn table_path(dir: &Path, n: u64) -> PathBuf {
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

/// How the store is configured (the `lightkv` preset's options, resolved).
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Segment size for a new store (an existing one keeps its own).
    pub seg_size: u64,
    /// RH-Tree geometry.
    pub tree: RhOptions,
    /// Compaction size CS.
    pub compaction_size: usize,
    /// Leaf placement.
    pub placement: LightkvPlacement,
    /// SSTable block size.
    pub block_size: usize,
    /// Block cache bytes.
    pub block_cache: u64,
    /// Flush and compaction run on background threads (the engine's); else in the writer.
    pub background: bool,
    /// Test instrumentation of the compactions ([`crate::Options::job_probe`]).
    pub job_probe: Option<Arc<crate::jobs::JobProbe>>,
}

impl StoreConfig {
    /// A configuration for tests: no background threads, no block cache.
    pub fn inline(seg_size: u64, tree: RhOptions, compaction_size: usize) -> StoreConfig {
        StoreConfig {
            seg_size,
            tree,
            compaction_size,
            placement: LightkvPlacement::Hybrid,
            block_size: 4096,
            block_cache: 0,
            background: false,
            job_probe: None,
        }
    }
}

#[derive(Debug)]
struct Seg {
    slot: u64,
    id: u64,
    size: u64,
    /// Write position (advanced by the holder of the owning partition's lane).
    pos: AtomicU64,
    /// Index entries pointing into the segment (changed under the state lock, shared by
    /// lane writers' in-place updates).
    live: AtomicU64,
    active: bool,
}

/// A linked leaf whose records are in an SSTable, with its PM copy.
#[derive(Debug, Clone)]
pub(crate) struct PmLeaf {
    addr: u64,
    len: u64,
    meta: LeafMeta,
    normal: usize,
    buckets: usize,
    depth: usize,
    extra_used: bool,
    live: usize,
    /// The DRAM copy searched instead of the PM one ([`LightkvPlacement::Dram`]).
    dram: Option<Arc<Leaf>>,
}

#[derive(Debug, Clone)]
struct ChainInfo {
    /// The chain record's extent.
    record: (u64, u64),
    desc: PartitionDesc,
    /// PM leaves, newest first.
    leaves: Vec<PmLeaf>,
}

#[derive(Debug)]
struct State {
    tree: RhTree,
    /// Segments by base address.
    segs: BTreeMap<u64, Seg>,
    /// Each partition's active segment.
    active: HashMap<PartitionId, u64>,
    free_slots: Vec<u64>,
    /// The next record's sequence number (taken by writers under their partition's lane).
    next_seq: AtomicU64,
    /// Chained partitions by chain slot (a partition's `tag` is its slot + 1).
    chains: HashMap<u64, ChainInfo>,
    free_chain_slots: Vec<u64>,
    /// Segments whose entry count dropped to zero since the last sweep.
    emptied: Vec<u64>,
    /// Unflushed linked leaves: partition → `seq_hi` of each, oldest first (the tree's
    /// chain holds the leaves themselves, newest first).
    unflushed: HashMap<PartitionId, VecDeque<u64>>,
    /// Partitions in the order their leaves were linked: one entry per unflushed leaf.
    flush_queue: VecDeque<PartitionId>,
    /// Bumped whenever the partitions change shape (splits, new partitions).
    epoch: u64,
    /// Bumped whenever a chain record is committed (the iterators' table list changes).
    chain_ver: u64,
    /// Every key the DRAM leaves index, sorted, with its newest record (range reads). Its
    /// own lock: lane writers update it under the shared state lock.
    view: Mutex<SortedView>,
    /// Recovery is re-indexing the write buffer: no segment may be freed yet (one whose
    /// count drops to zero may still hold records not replayed).
    replaying: bool,
    /// LightKV_PM: each partition's top-leaf image in PM (extent).
    images: HashMap<PartitionId, (u64, u64)>,
    /// LightKV_PM: the images of each partition's unflushed linked leaves, newest first.
    chain_images: HashMap<PartitionId, Vec<(u64, u64)>>,
    /// Partitions whose top leaf changed since the images were last brought up to date.
    touched: Vec<PartitionId>,
    /// LightKV_PM: live entries of each top leaf when its image was last written.
    image_live: HashMap<PartitionId, usize>,
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
    /// 1 when the last open restored the clean-shutdown image instead of scanning.
    pub restored_from_image: u64,
    /// 1 when the last open found an image it could not use (damaged) and scanned instead.
    pub image_rejected: u64,
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
    /// Writes that waited for the flush thread.
    pub write_stalls: u64,
    /// PM leaf probes (lookups that reached a linked leaf).
    pub pm_leaf_probes: u64,
}

/// Background work requests (the engine's threads wait on them).
#[derive(Debug, Default)]
pub(crate) struct Work {
    pub(crate) compact: VecDeque<u64>,
    pub(crate) stop: bool,
}

/// What a cached table list is valid for: (shape epoch, chain version).
type RunsVersion = (u64, u64);

/// The write buffer store.
pub struct PwbStore {
    region: Arc<Region>,
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    cfg: StoreConfig,
    cache: Option<Arc<BlockCache>>,
    tables: Mutex<HashMap<u64, Arc<Table>>>,
    heap: Mutex<Heap>,
    state: RwLock<State>,
    /// Per-partition writer locks (partition id modulo [`LANES`]); taken before `state`.
    lanes: Box<[Mutex<()>]>,
    /// Unflushed leaves as of the last write or flush commit (writers' wake-up hint).
    queued: AtomicUsize,
    seg_size: u64,
    next_table: AtomicU64,
    stats: Mutex<StoreStats>,
    /// Open iterators' pins (see [`super::view`]).
    pub(crate) pins: Pins,
    /// The sorted view's write count when the last iterator was created (its idle rule).
    view_used: AtomicU64,
    /// The iterators' table list, for (shape epoch, chain version).
    runs_cache: Mutex<Option<(RunsVersion, Arc<TableRuns>)>>,
    /// Serialises flush builds (the flush thread; `flush()`/close in the caller).
    flush_job: Mutex<()>,
    /// Serialises compactions.
    compact_job: Mutex<()>,
    pub(crate) work: Mutex<Work>,
    pub(crate) work_cv: Condvar,
    /// Signalled after every flush commit (writers waiting for room, `flush()`).
    flushed_cv: Condvar,
    flushed_mu: Mutex<()>,
    pub(crate) poisoned: Poison,
    /// Set by `close`/drop before the workers are joined; compactions check it.
    pub(crate) cancel: crate::jobs::Cancel,
    user_bytes: crate::counters::Counters<1>,
    /// PM leaf probes, counted per thread (every get may bump it).
    probes: crate::counters::Counters<1>,
}

impl std::fmt::Debug for PwbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PwbStore").field("dir", &self.dir).field("seg_size", &self.seg_size).finish()
    }
}

/// Reads keys for the RH-Tree from the write buffer or from SSTables. A key read verifies
/// the entry's checksum (a damaged key must not turn a hit into a silent miss, or misplace
/// an entry in a split). A comparison of a write-buffer entry compares the key bytes in
/// place first and verifies the checksum only when they differ: equal bytes (after equal
/// 29-bit signatures) are the key, and a caller that goes on to read the entry's value
/// verifies it then ([`PwbStore::with_entry`]); different bytes may be damage, so the
/// checksum decides between a miss and `Corruption`. (An update thus supersedes an entry
/// whose value is damaged without reading it; recovery's scan or `check` still finds the
/// damaged record.) This keeps the writers' probes from checksumming every value they
/// compare against (most of a probe's cost with 1 KiB values).
struct Keys<'a>(&'a PwbStore);

#[cfg(test)]
thread_local! {
    /// Write-buffer entries this thread decoded (tests: what a range read costs).
    pub(crate) static PWB_ENTRIES_READ: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Count one write-buffer entry decoded by this thread (tests only; nothing in a release
/// build).
#[inline]
pub(crate) fn count_entry_read() {
    #[cfg(test)]
    PWB_ENTRIES_READ.with(|c| c.set(c.get() + 1));
}

impl KeySource for Keys<'_> {
    fn key(&self, off: u64) -> Result<Vec<u8>> {
        self.0.with_entry(off, |_, k, _| k.to_vec())
    }
    fn key_eq(&self, off: u64, key: &[u8]) -> Result<bool> {
        if off & SST_FLAG == 0 && self.0.raw_key(off).is_some_and(|k| k == key) {
            return Ok(true);
        }
        self.0.with_entry(off, |_, k, _| k == key)
    }
}

/// A record read back: (kind, key, value).
type Rec = (Kind, Vec<u8>, Vec<u8>);

/// Keys of a new table with their entries' offset slots, in key order.
type KeyOffsets = Vec<(Vec<u8>, u64)>;

fn sst_kind(k: Kind) -> sstable::Kind {
    match k {
        Kind::Put => sstable::Kind::Put,
        Kind::Delete => sstable::Kind::Delete,
    }
}

fn pwb_kind(k: sstable::Kind) -> Kind {
    match k {
        sstable::Kind::Put => Kind::Put,
        sstable::Kind::Delete => Kind::Delete,
    }
}

/// A flush picked from the queue: partition `p`'s oldest unflushed leaf.
struct FlushJob {
    p: PartitionId,
    leaf: Leaf,
    seq_hi: u64,
}

/// A table and the PM leaf that points into it, written but not committed.
struct Built {
    table: Arc<Table>,
    leaf: PmLeaf,
    /// A flush's records (key, write-buffer address): their sorted-view entries retire at
    /// the commit. Empty for a compaction.
    flushed: Vec<(Vec<u8>, u64)>,
}

/// A compaction picked from a chain: the run of leaves to merge.
struct CompactJob {
    slot: u64,
    inputs: Vec<PmLeaf>,
    bottom: bool,
}

impl PwbStore {
    /// Open the store: PM layout in `region` (created when `create`), SSTables in `dir`.
    pub fn open(region: Arc<Region>, fs: Arc<dyn Fs>, dir: &Path, create: bool, cfg: StoreConfig) -> Result<PwbStore> {
        if create {
            let sb = encode_superblock(cfg.seg_size);
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
            let size = match pwb::decode_header(h) {
                Ok((hid, size)) if hid == id && size >= seg_size && size.is_multiple_of(64) => size,
                Ok(_) => return Err(region.corruption(addr, "segment header does not match its directory slot")),
                Err(d) => return Err(region.corruption(addr, d)),
            };
            used.push((addr, size));
            segs.insert(
                addr,
                Seg { slot: i, id, size, pos: AtomicU64::new(0), live: AtomicU64::new(0), active: false },
            );
        }
        // Chained partitions: descriptor and PM leaves.
        let mut t = RhTree::new(cfg.tree);
        let mut chains = HashMap::new();
        let mut free_chain_slots = Vec::new();
        let mut referenced_tables = std::collections::BTreeSet::new();
        let mut restored: Vec<(u64, Vec<Leaf>)> = Vec::new();
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
                if leaf.depth() != chain.desc.prefix.len() {
                    return Err(region.corruption(la, "PM leaf depth differs from its partition's"));
                }
                used.push((la, line_round(len as u64)));
                referenced_tables.insert(meta.table);
                leaves.push(pm_leaf(la, len as u64, meta, &leaf, cfg.placement));
                dram.push(leaf);
            }
            t.ensure_partition(&chain.desc, true).map_err(|d| region.corruption(ra, d))?;
            restored.push((slot, dram));
            chains.insert(slot, ChainInfo { record: (ra, rlen as u64), desc: chain.desc, leaves });
        }
        // Ids may change while partitions are restored: attach the tags once all are in.
        for (slot, _) in &restored {
            let d = &chains[slot].desc;
            let q =
                t.find_partition(d).ok_or_else(|| region.corruption(CHAIN_DIR_ADDR + slot * 8, "chain overlaps"))?;
            t.partition_mut(q).tag = slot + 1;
        }
        // The clean-shutdown image, if the last close wrote one.
        // It only saves the scan: a damaged or unreadable one is dropped, and the write buffer
        // is scanned instead.
        let img_addr = region.load_u64_atomic(IMAGE_PTR_ADDR)?;
        let mut image_rejected = 0;
        let image = if img_addr != 0 {
            let read = || -> std::result::Result<(Image, usize), String> {
                let h = region.slice(img_addr, IMAGE_HEADER).ok_or("image pointer outside PM")?;
                let len = image_len(h)?;
                let b = region.slice(img_addr, len).ok_or("image runs outside PM")?;
                Ok((decode_image(b)?, len))
            };
            match read() {
                Ok((img, len)) if !used.iter().any(|&(a, l)| a < img_addr + len as u64 && img_addr < a + l) => {
                    used.push((img_addr, line_round(len as u64)));
                    Some((img, len))
                }
                _ => {
                    image_rejected = 1;
                    None
                }
            }
        } else {
            None
        };
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
        let st = State {
            tree: t,
            segs,
            active: HashMap::new(),
            free_slots,
            next_seq: AtomicU64::new(1),
            chains,
            free_chain_slots,
            emptied: Vec::new(),
            unflushed: HashMap::new(),
            flush_queue: VecDeque::new(),
            epoch: 0,
            chain_ver: 0,
            view: Mutex::new(SortedView::default()),
            replaying: false,
            images: HashMap::new(),
            chain_images: HashMap::new(),
            touched: Vec::new(),
            image_live: HashMap::new(),
        };
        let cache = (cfg.block_cache > 0).then(|| BlockCache::new(cfg.block_cache));
        let s = PwbStore {
            region,
            fs,
            dir: dir.to_path_buf(),
            cache,
            tables: Mutex::new(HashMap::new()),
            heap: Mutex::new(heap),
            state: RwLock::new(st),
            lanes: (0..LANES).map(|_| Mutex::new(())).collect(),
            queued: AtomicUsize::new(0),
            seg_size,
            next_table: AtomicU64::new(next_table),
            stats: Mutex::new(StoreStats::default()),
            pins: Pins::default(),
            view_used: AtomicU64::new(0),
            runs_cache: Mutex::new(None),
            flush_job: Mutex::new(()),
            compact_job: Mutex::new(()),
            work: Mutex::new(Work::default()),
            work_cv: Condvar::new(),
            flushed_cv: Condvar::new(),
            flushed_mu: Mutex::new(()),
            poisoned: Poison::default(),
            cancel: crate::jobs::Cancel::new(cfg.job_probe.clone()),
            user_bytes: Default::default(),
            probes: Default::default(),
            cfg,
        };
        s.stats.lock().image_rejected = image_rejected;
        let pm = s.cfg.placement == LightkvPlacement::Pm;
        match image {
            Some((img, len)) => s.restore_image(img, img_addr, len)?,
            None => {
                if img_addr != 0 {
                    // A rejected image: retire its pointer before the store takes a write.
                    s.region.store_u64_atomic(IMAGE_PTR_ADDR, 0)?;
                    s.region.persist(IMAGE_PTR_ADDR, 8);
                }
                s.replay()?
            }
        }
        if pm {
            // Images written while recovery replayed (untracked) may be stale: start afresh.
            let mut st = s.state.write();
            for (_, (a, l)) in std::mem::take(&mut st.images) {
                s.heap.lock().free(a, line_round(l));
            }
            st.image_live.clear();
            st.tree.set_track_dirty(true);
            s.sync_images(&mut st, true)?;
        }
        Ok(s)
    }

    /// Rebuild the DRAM part from the clean-shutdown image, then retire the image (cleared
    /// before any write, so a later crash recovers by scanning).
    fn restore_image(&self, img: Image, img_addr: u64, len: usize) -> Result<()> {
        let bad = |d: String| self.region.corruption(img_addr, d);
        let mut st = self.state.write();
        for (d, _, _) in &img.partitions {
            if st.tree.find_partition(d).is_none() {
                st.tree.ensure_partition(d, false).map_err(|e| bad(format!("index image: {e}")))?;
            }
        }
        for (d, active, leaf) in img.partitions {
            let p = st.tree.find_partition(&d).ok_or_else(|| bad("index image partitions overlap".into()))?;
            if leaf.depth() != d.prefix.len() {
                return Err(bad("index image leaf does not fit its partition".into()));
            }
            for off in leaf.offsets() {
                match Self::seg_of(&st, off).and_then(|a| st.segs.get_mut(&a)) {
                    Some(g) if off & SST_FLAG == 0 => *g.live.get_mut() += 1,
                    _ => return Err(bad(format!("index image entry {off:#x} points outside the write buffer"))),
                }
            }
            *st.tree.partition_mut(p).top.get_mut() = leaf;
            if active != 0 {
                let g = st.segs.get_mut(&active).ok_or_else(|| bad("index image names a missing segment".into()))?;
                g.active = true;
                st.active.insert(p, active);
            }
        }
        for (a, pos) in img.segments {
            let g = st.segs.get_mut(&a).ok_or_else(|| bad("index image names a missing segment".into()))?;
            if pos < pwb::HEADER_LEN as u64 || pos > g.size {
                return Err(bad(format!("index image write position {pos} outside its segment")));
            }
            *g.pos.get_mut() = pos;
        }
        *st.next_seq.get_mut() = img.next_seq;
        st.emptied = st.segs.iter().filter(|(_, g)| g.live.load(Ordering::Relaxed) == 0).map(|(&a, _)| a).collect();
        // Retire the image before the store takes a write.
        self.region.store_u64_atomic(IMAGE_PTR_ADDR, 0)?;
        self.region.persist(IMAGE_PTR_ADDR, 8);
        self.heap.lock().free(img_addr, line_round(len as u64));
        self.free_emptied(&mut st)?;
        self.stats.lock().restored_from_image = 1;
        Ok(())
    }

    /// Rebuild the DRAM part by scanning every segment and re-indexing its records in
    /// sequence order.
    fn replay(&self) -> Result<()> {
        let mut st = self.state.write();
        // (seq, entry index, entry address, key)
        let mut recs: Vec<(u64, usize, u64, Vec<u8>)> = Vec::new();
        let seg_list: Vec<(u64, u64, u64)> = st.segs.iter().map(|(&a, g)| (a, g.id, g.size)).collect();
        for (addr, id, size) in seg_list {
            let bytes = self.region.slice_checked(addr, size as usize, "PWB segment")?;
            let (rs, end) = pwb::scan(bytes, id).map_err(|(off, d)| self.region.corruption(addr + off as u64, d))?;
            if let Some(g) = st.segs.get_mut(&addr) {
                *g.pos.get_mut() = end as u64;
            }
            for r in rs {
                for (i, e) in r.entries.iter().enumerate() {
                    recs.push((r.seq, i, addr + e.off as u64, e.key.to_vec()));
                }
            }
        }
        recs.sort_unstable_by_key(|r| (r.0, r.1));
        *st.next_seq.get_mut() = recs.last().map_or(1, |r| r.0 + 1);
        st.replaying = true;
        let total = recs.len() as u64;
        let mut skipped = 0;
        for (seq, _, addr, key) in recs {
            let covered = st.tree.route(&key).is_some_and(|p| {
                let tag = st.tree.partition(p).tag;
                tag > 0
                    && st.chains.get(&(tag - 1)).and_then(|c| c.leaves.first()).is_some_and(|l| seq <= l.meta.seq_hi)
            });
            if covered {
                skipped += 1;
                continue;
            }
            self.index(&mut st, &key, addr, seq, true, None)?;
        }
        {
            let mut c = self.stats.lock();
            c.recovered_records = total;
            c.recovered_skipped = skipped;
        }
        // Every segment is inactive after recovery: those no entry points into go.
        st.replaying = false;
        st.emptied = st.segs.iter().filter(|(_, g)| g.live.load(Ordering::Relaxed) == 0).map(|(&a, _)| a).collect();
        self.free_emptied(&mut st)
    }

    fn keys(&self) -> Keys<'_> {
        Keys(self)
    }

    fn table(&self, n: u64) -> Result<Arc<Table>> {
        if let Some(t) = self.tables.lock().get(&n) {
            return Ok(t.clone());
        }
        let path = table_path(&self.dir, n);
        let t = match &self.cache {
            Some(c) => Table::open_cached(self.fs.as_ref(), &path, n, c)?,
            None => Table::open(self.fs.as_ref(), &path)?,
        };
        self.tables.lock().insert(n, t.clone());
        Ok(t)
    }

    /// The entry an index entry names, verified and lent to `f` in place: a write-buffer
    /// entry from PM, an SSTable entry from its (cached) block. The caller holds the state
    /// lock, so a write-buffer segment cannot be freed meanwhile.
    fn with_entry<R>(&self, off: u64, f: impl FnOnce(Kind, &[u8], &[u8]) -> R) -> Result<R> {
        if off & SST_FLAG != 0 {
            let (n, block, entry) = split_sst(off);
            let t = self.table(n)?;
            let bad = |d: &str| Error::corruption(t.path(), 0, format!("RH-Tree entry {off:#x}: {d}"));
            let h = t.index().get(block).map(|x| x.1).ok_or_else(|| bad("no such block"))?;
            let payload = t.read_block_cached(h)?;
            let e = block_entries(&payload)
                .nth(entry)
                .ok_or_else(|| bad("no such entry"))?
                .map_err(|d| Error::corruption(t.path(), h.offset, d))?;
            return Ok(f(pwb_kind(e.kind), e.key, e.value));
        }
        count_entry_read();
        let r = &self.region;
        let h = r.slice_checked(off, pwb::ENTRY_HEADER, "PWB entry")?;
        let (klen, vlen) = pwb::entry_lens(h).ok_or_else(|| r.corruption(off, "PWB entry header cut short"))?;
        let b = r.slice_checked(off, pwb::ENTRY_HEADER + klen + vlen, "PWB entry")?;
        let (kind, k, v, _) = pwb::decode_entry(b).ok_or_else(|| r.corruption(off, "PWB entry checksum mismatch"))?;
        Ok(f(kind, k, v))
    }

    /// The key bytes of the write-buffer entry at `off`, unverified (see [`Keys`]); `None`
    /// when its header or key lies outside PM.
    fn raw_key(&self, off: u64) -> Option<&[u8]> {
        let (klen, _) = pwb::entry_lens(self.region.slice(off, pwb::ENTRY_HEADER)?)?;
        self.region.slice(off + pwb::ENTRY_HEADER as u64, klen)
    }

    /// The record an index entry names, wherever it is, copied out.
    fn record(&self, off: u64) -> Result<Rec> {
        self.with_entry(off, |kind, k, v| (kind, k.to_vec(), v.to_vec()))
    }

    fn seg_of(st: &State, addr: u64) -> Option<u64> {
        st.segs.range(..=addr).next_back().map(|(&a, _)| a)
    }

    /// One entry no longer points at the write-buffer record at `addr`.
    fn release(st: &mut State, addr: u64) {
        if let Some(a) = Self::seg_of(st, addr) {
            if let Some(g) = st.segs.get_mut(&a) {
                let live = g.live.get_mut();
                *live = live.saturating_sub(1);
                if *live == 0 {
                    st.emptied.push(a);
                }
            }
        }
    }

    /// Free the segments whose count dropped to zero and that take no more writes.
    fn free_emptied(&self, st: &mut State) -> Result<()> {
        if st.replaying {
            return Ok(());
        }
        for a in std::mem::take(&mut st.emptied) {
            if st.segs.get(&a).is_some_and(|g| g.live.load(Ordering::Relaxed) == 0 && !g.active) {
                self.free_segment(st, a)?;
            }
        }
        Ok(())
    }

    /// Index the record at `addr` for `key` (sequence `seq`), keeping segment entry counts.
    /// A full leaf that cannot split is linked behind a fresh one and queued for flushing;
    /// `inline` flushes it right away (recovery, or no background threads).
    /// `probe` is where the key stood in its top leaf, taken by the writer under its lane
    /// ([`RhTree::top_probe`]): the insert then compares no key.
    fn index(&self, st: &mut State, key: &[u8], addr: u64, seq: u64, inline: bool, probe: Option<Probe>) -> Result<()> {
        let shape = Self::shape_key(st);
        let probing = probe.is_some();
        let mut probe = probe;
        // True when the key's top-leaf entry was updated: the sorted view has the key.
        let known = loop {
            let outcome = match probe.take() {
                Some(pr) => st.tree.insert_probed(key, addr, pr, &self.keys())?,
                None => st.tree.insert(key, addr, &self.keys())?,
            };
            match outcome {
                Insert::Full(p) => {
                    Self::touch(st, p);
                    if self.cfg.placement == LightkvPlacement::Pm {
                        // The full leaf's image becomes its linked leaf's image, up to date.
                        self.sync_images(st, false)?;
                        if let Some(img) = st.images.remove(&p) {
                            st.chain_images.entry(p).or_default().insert(0, img);
                        }
                        st.image_live.remove(&p);
                    }
                    st.tree.link(p);
                    // The record being indexed (and the rest of its batch) is not in the
                    // linked leaf: the flush covers sequence numbers below it.
                    st.unflushed.entry(p).or_default().push_back(seq - 1);
                    st.flush_queue.push_back(p);
                    if inline {
                        self.flush_next_locked(st)?;
                    } else if probing {
                        // The new top leaf is empty.
                        probe = Some(Probe::Absent(p));
                    }
                }
                Insert::Inserted(p) => {
                    Self::touch(st, p);
                    break false;
                }
                Insert::Updated(p, old) => {
                    Self::touch(st, p);
                    if old & SST_FLAG == 0 {
                        Self::release(st, old);
                    }
                    break true;
                }
            }
        };
        if Self::shape_key(st) != shape {
            st.epoch += 1;
        }
        if let Some(g) = Self::seg_of(st, addr).and_then(|a| st.segs.get_mut(&a)) {
            *g.live.get_mut() += 1;
        }
        st.view.get_mut().put(key, addr, known);
        Ok(())
    }

    /// What changes when partitions split or appear.
    fn shape_key(st: &State) -> (usize, u64, u64) {
        let sp = st.tree.splits();
        (st.tree.partition_count(), sp.normal, sp.level)
    }

    /// Partition `p`'s DRAM leaves changed.
    fn touch(st: &mut State, p: PartitionId) {
        st.touched.push(p);
    }

    /// LightKV_PM: bring the top leaves' PM images up to date — each changed bucket written
    /// and persisted; a whole new image where a partition has none yet, where its top leaf
    /// was replaced, or (`full`) after partitions changed shape. Images of partitions that
    /// no longer exist are freed.
    fn sync_images(&self, st: &mut State, full: bool) -> Result<()> {
        if self.cfg.placement != LightkvPlacement::Pm {
            st.touched.clear();
            return Ok(());
        }
        let n = st.tree.partition_count() as PartitionId;
        let parts: Vec<PartitionId> = if full {
            let gone: Vec<PartitionId> = st.images.keys().copied().filter(|&p| p >= n).collect();
            for p in gone {
                if let Some((a, l)) = st.images.remove(&p) {
                    self.heap.lock().free(a, line_round(l));
                }
                st.image_live.remove(&p);
            }
            st.touched.clear();
            (0..n).collect()
        } else {
            let mut t = std::mem::take(&mut st.touched);
            t.sort_unstable();
            t.dedup();
            t
        };
        for p in parts {
            let dirty = st.tree.partition_mut(p).top.get_mut().take_dirty();
            let top_guard = st.tree.partition(p).top.read();
            let top = &*top_guard;
            let want = (LEAF_HEADER + top.buckets().len() * 64) as u64;
            let live = top.live();
            // After a change of shape a partition may hold another leaf than its image shows
            // (a level split can hand it a new one): any sign of change rewrites it whole.
            let same = !full || (st.image_live.get(&p) == Some(&live) && dirty.is_empty());
            match st.images.get(&p).copied() {
                Some((a, len)) if len == want && same => {
                    for b in dirty {
                        let b = b as usize;
                        let at = a + (LEAF_HEADER + 64 * b) as u64;
                        // SAFETY: the image is this partition's alone; readers probe it only
                        // under the state lock, which the caller holds for writing.
                        unsafe { self.region.write(at, &leaf::bucket_bytes(&top.buckets()[b]))? };
                        self.region.persist(at, 64);
                    }
                }
                old => {
                    let bytes = encode_leaf(top, top.normal(), LeafMeta { table: 0, cw: 0, seq_hi: 0 });
                    let a = self.put_extent(&bytes)?;
                    if let Some((oa, ol)) = old {
                        self.heap.lock().free(oa, line_round(ol));
                    }
                    st.images.insert(p, (a, bytes.len() as u64));
                }
            }
            st.image_live.insert(p, live);
        }
        Ok(())
    }

    /// Probe a leaf image in PM (LightKV_PM), shaped like `leaf`.
    fn image_get(&self, img: (u64, u64), leaf: &Leaf, key: &[u8], src: &dyn KeySource) -> Result<Option<u64>> {
        let region = &self.region;
        let mut fetch = |i: usize| -> Result<rhtree::Bucket> {
            let b = region.slice_checked(img.0 + (LEAF_HEADER + 64 * i) as u64, 64, "PM leaf image bucket")?;
            Ok(decode_bucket(b))
        };
        rhtree::probe(leaf.normal(), leaf.buckets().len(), leaf.extra_used(), key, &mut fetch, src)
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

    /// The next flush in the queue: the oldest unflushed leaf of the partition linked first.
    fn next_flush(&self, st: &State) -> Result<Option<FlushJob>> {
        let Some(&p) = st.flush_queue.front() else { return Ok(None) };
        let leaf = st.tree.partition(p).chain.last().cloned();
        let seq_hi = st.unflushed.get(&p).and_then(|q| q.front().copied());
        match (leaf, seq_hi) {
            (Some(leaf), Some(seq_hi)) => Ok(Some(FlushJob { p, leaf, seq_hi })),
            _ => Err(Error::Poisoned("lightkv: the flush queue names a partition with no unflushed leaf".into())),
        }
    }

    /// Write a table of `recs` (sorted by key) and return, for each key, its entry's offset.
    fn write_table(&self, recs: impl Iterator<Item = Result<Rec>>) -> Result<(u64, Arc<Table>, KeyOffsets)> {
        let n = self.next_table.fetch_add(1, Ordering::Relaxed);
        let path = table_path(&self.dir, n);
        let mut b = TableBuilder::create(self.fs.as_ref(), &path, self.cfg.block_size, 0)?;
        for r in recs {
            let (kind, k, v) = match r {
                Ok(rec) => rec,
                Err(e) => {
                    drop(b);
                    // A compaction cancelled at a safe point: its only output is this
                    // table, not yet named by any leaf.
                    return self.cancel.on_cancel(Err(e), || Ok(self.fs.remove(&path)?));
                }
            };
            b.add(sst_kind(kind), &k, &v)?;
        }
        b.finish()?;
        self.fs.sync_dir(&self.dir)?;
        let table = self.table(n)?;
        let mut offs = Vec::with_capacity(table.entries() as usize);
        for (bi, (_, h)) in table.index().iter().enumerate() {
            let payload = table.read_block(*h)?;
            for (ei, e) in block_entries(&payload).enumerate() {
                let e = e.map_err(|d| Error::corruption(table.path(), h.offset, d))?;
                offs.push((e.key.to_vec(), sst_off(n, bi, ei)));
            }
        }
        Ok((n, table, offs))
    }

    /// Write the flush's SSTable and the PM copy of its leaf (no state lock needed: the
    /// leaf's records stay pinned until the commit releases them).
    fn build_flush(&self, job: &FlushJob) -> Result<Built> {
        let mut recs: Vec<(u64, Rec)> = Vec::with_capacity(job.leaf.live());
        for off in job.leaf.offsets() {
            if off & SST_FLAG != 0 {
                return Err(Error::Poisoned("a linked leaf being flushed already points at a table".into()));
            }
            recs.push((off, self.record(off)?));
        }
        recs.sort_by(|a, b| a.1 .1.cmp(&b.1 .1));
        let (n, table, offs) = self.write_table(recs.iter().map(|r| Ok(r.1.clone())))?;
        if offs.len() != recs.len() || offs.iter().zip(&recs).any(|(o, r)| o.0 != r.1 .1) {
            return Err(Error::corruption(table.path(), 0, "a flushed key is missing from its new table"));
        }
        let leaf = pm_leaf_of(&offs, job.leaf.depth());
        // Every record of the partition up to `seq_hi` is in this table or superseded by one
        // that is: recovery may skip them all.
        let meta = LeafMeta { table: n, cw: 0, seq_hi: job.seq_hi };
        let lb = encode_leaf(&leaf, leaf.normal(), meta);
        let la = self.put_extent(&lb)?;
        let flushed = recs.into_iter().map(|(off, (_, k, _))| (k, off)).collect();
        Ok(Built { leaf: pm_leaf(la, lb.len() as u64, meta, &leaf, self.cfg.placement), table, flushed })
    }

    /// Write a new chain record for `slot` and commit it (one 8-byte store); frees the old
    /// record. Returns the record's extent.
    fn commit_chain(&self, st: &mut State, slot: u64, desc: &PartitionDesc, leaves: &[PmLeaf]) -> Result<(u64, u64)> {
        let rb = encode_chain(&Chain { desc: desc.clone(), leaves: leaves.iter().map(|l| l.addr).collect() });
        let ra = self.put_extent(&rb)?;
        let sa = CHAIN_DIR_ADDR + slot * 8;
        self.region.store_u64_atomic(sa, ra)?;
        self.region.persist(sa, 8);
        if let Some(old) = st.chains.get(&slot) {
            self.heap.lock().free(old.record.0, line_round(old.record.1));
        }
        st.chain_ver += 1;
        Ok((ra, rb.len() as u64))
    }

    /// Commit a built flush: the PM leaf joins the chain record, the DRAM leaf gives way to
    /// it, and the leaf's records are released. Returns the chain slot.
    fn commit_flush(&self, st: &mut State, job: FlushJob, b: Built) -> Result<u64> {
        let p = job.p;
        let tag = st.tree.partition(p).tag;
        let (slot, new_slot) = match tag.checked_sub(1) {
            Some(s) if st.chains.contains_key(&s) => (s, false),
            _ => (
                *st.free_chain_slots
                    .last()
                    .ok_or_else(|| Error::PmFull(format!("all {CHAIN_SLOTS} chain slots are in use")))?,
                true,
            ),
        };
        let desc = st.tree.descriptor(p);
        let mut leaves = st.chains.get(&slot).map(|c| c.leaves.clone()).unwrap_or_default();
        leaves.insert(0, b.leaf);
        let record = self.commit_chain(st, slot, &desc, &leaves)?;
        if new_slot {
            st.free_chain_slots.pop();
        }
        st.chains.insert(slot, ChainInfo { record, desc, leaves });
        let part = st.tree.partition_mut(p);
        part.tag = slot + 1;
        part.chain.pop();
        if let Some(img) = st.chain_images.get_mut(&p).and_then(|v| v.pop()) {
            self.heap.lock().free(img.0, line_round(img.1));
        }
        if let Some(q) = st.unflushed.get_mut(&p) {
            q.pop_front();
            if q.is_empty() {
                st.unflushed.remove(&p);
            }
        }
        st.flush_queue.pop_front();
        self.queued.store(st.flush_queue.len(), Ordering::Relaxed);
        Self::touch(st, p);
        // The records are in the table: their sorted-view entries retire (iterators that
        // listed the tables before this commit still read them from the write buffer).
        let stamp = st.view.get_mut().stamp();
        let oldest = self.pins.oldest();
        for (k, off) in &b.flushed {
            st.view.get_mut().retire(stamp, k, *off, oldest);
        }
        for off in job.leaf.offsets() {
            Self::release(st, off);
        }
        self.free_emptied(st)?;
        self.reclaim(st);
        let mut c = self.stats.lock();
        c.flushes += 1;
        c.flush_bytes += b.table.size();
        Ok(slot)
    }

    /// Flush the next queued leaf with the state lock held (recovery, inline mode), then
    /// compact its chain as far as it goes. A failure leaves the state as it was before
    /// the failed step (the flush stays queued), so the store can go on.
    fn flush_next_locked(&self, st: &mut State) -> Result<()> {
        let Some(job) = self.next_flush(st)? else { return Ok(()) };
        let b = self.build_flush(&job)?;
        let slot = self.commit_or_discard(b, |b| self.commit_flush(st, job, b))?;
        while let Some(job) = self.pick_compaction(st, slot) {
            let b = self.build_compaction(&job)?;
            self.commit_or_discard(b.0, |x| self.commit_compaction(st, job, (x, b.1)))?;
        }
        Ok(())
    }

    /// Run `commit` on a built table and leaf; if it fails before committing, the table
    /// file and the leaf's PM extent are released (nothing refers to them).
    fn commit_or_discard<T>(&self, b: Built, commit: impl FnOnce(Built) -> Result<T>) -> Result<T> {
        let (addr, len, table) = (b.leaf.addr, b.leaf.len, b.leaf.meta.table);
        let r = commit(b);
        if r.is_err() && !self.state_names_leaf(addr) {
            self.heap.lock().free(addr, line_round(len));
            self.tables.lock().remove(&table);
            let _ = self.fs.remove(&table_path(&self.dir, table));
        }
        r
    }

    /// True when a committed chain names the PM leaf at `addr`. Only called where the
    /// state lock is already held by the caller or not needed; reads PM only.
    fn state_names_leaf(&self, addr: u64) -> bool {
        (0..CHAIN_SLOTS).any(|slot| {
            self.region
                .load_u64_atomic(CHAIN_DIR_ADDR + slot * 8)
                .ok()
                .filter(|&ra| ra != 0)
                .and_then(|ra| read_chain(&self.region, ra).ok())
                .is_some_and(|(c, _)| c.leaves.contains(&addr))
        })
    }

    /// Flush one queued leaf without blocking writers while the table is written (the
    /// flush thread, `flush()`). Returns the chain slot it committed to, or `None` when the
    /// queue was empty.
    pub(crate) fn flush_one(&self) -> Result<Option<u64>> {
        let _g = self.flush_job.lock();
        let Some(job) = self.next_flush(&self.state.read())? else { return Ok(None) };
        let b = self.build_flush(&job)?;
        let slot = {
            let mut st = self.state.write();
            self.commit_or_discard(b, |b| self.commit_flush(&mut st, job, b))?
        };
        self.flushed_cv.notify_all();
        Ok(Some(slot))
    }

    /// The first run of `compaction_size` adjacent PM leaves of equal weight in `slot`'s
    /// chain. Weights ascend along a chain but flushes may add leaves in front while a run
    /// is merged, so the run is searched for rather than assumed at the head.
    fn pick_compaction(&self, st: &State, slot: u64) -> Option<CompactJob> {
        let cs = self.cfg.compaction_size;
        let c = st.chains.get(&slot)?;
        let ls = &c.leaves;
        // A run whose merged leaf could not be one PM extent (at most half a pool) is left
        // alone: the chain grows instead (see "Data skew" in docs/design/lightkv.md).
        let fits = |run: &[PmLeaf]| {
            let keys: usize = run.iter().map(|l| l.live).sum();
            let buckets = (keys * 100).div_ceil(rhtree::SLOTS * 85) * 5 / 4 + 1;
            ((LEAF_HEADER + buckets * 64) as u64) <= self.region.pool_size() / 2
        };
        (0..ls.len().saturating_sub(cs - 1))
            .find(|&i| ls[i..i + cs].iter().all(|l| l.meta.cw == ls[i].meta.cw) && fits(&ls[i..i + cs]))
            .map(|i| CompactJob { slot, inputs: ls[i..i + cs].to_vec(), bottom: i + cs == ls.len() })
    }

    /// Merge the run's tables into one (streaming; newest input wins) and write its leaf.
    fn build_compaction(&self, job: &CompactJob) -> Result<(Built, u64)> {
        let mut curs = Vec::with_capacity(job.inputs.len());
        for l in &job.inputs {
            curs.push(TableCursor::seek(self.table(l.meta.table)?, Bound::Unbounded, false)?);
        }
        let mut seen = 0u64;
        let mut steps = 0u64;
        let bottom = job.bottom;
        let merged = std::iter::from_fn(|| loop {
            steps += 1;
            // The smallest key; among equal keys the newest input (lowest index) wins.
            let mut best: Option<usize> = None;
            for (i, c) in curs.iter().enumerate() {
                if let Some(e) = c.peek() {
                    if best.is_none_or(|b| curs[b].peek().is_some_and(|x| e.1 < x.1)) {
                        best = Some(i);
                    }
                }
            }
            let b = best?;
            let e = curs[b].peek().cloned()?;
            for c in curs.iter_mut() {
                while c.peek().is_some_and(|x| x.1 == e.1) {
                    seen += 1;
                    if let Err(err) = c.advance() {
                        return Some(Err(err));
                    }
                }
            }
            // Safe point: nothing but the output table exists yet (`write_table` discards it).
            if let Err(err) = self.cancel.every(steps - 1) {
                return Some(Err(err));
            }
            if bottom && e.0 == sstable::Kind::Delete {
                // Nothing older in this partition: the tombstone has nothing left to hide.
                continue;
            }
            return Some(Ok((pwb_kind(e.0), e.1, e.2)));
        });
        let (n, table, offs) = self.write_table(merged)?;
        // The output leaf: entries pointing at the new table.
        let leaf = pm_leaf_of(&offs, job.inputs[0].depth);
        let meta = LeafMeta { table: n, cw: job.inputs[0].meta.cw + 1, seq_hi: job.inputs[0].meta.seq_hi };
        let lb = encode_leaf(&leaf, leaf.normal(), meta);
        let la = self.put_extent(&lb)?;
        let dropped = seen - offs.len() as u64;
        let leaf = pm_leaf(la, lb.len() as u64, meta, &leaf, self.cfg.placement);
        Ok((Built { leaf, table, flushed: Vec::new() }, dropped))
    }

    /// Commit a built compaction: the run is replaced by the output leaf in a new chain
    /// record; the inputs' leaves and tables are freed.
    fn commit_compaction(&self, st: &mut State, job: CompactJob, (b, dropped): (Built, u64)) -> Result<()> {
        let info = st
            .chains
            .get(&job.slot)
            .cloned()
            .ok_or_else(|| Error::Poisoned("lightkv: a compacted chain vanished".into()))?;
        let first = job.inputs[0].addr;
        let cs = job.inputs.len();
        let i = info
            .leaves
            .iter()
            .position(|l| l.addr == first)
            .filter(|&i| {
                info.leaves.get(i..i + cs).is_some_and(|r| r.iter().zip(&job.inputs).all(|(a, b)| a.addr == b.addr))
            })
            .ok_or_else(|| Error::Poisoned("lightkv: a compaction's inputs moved in their chain".into()))?;
        let mut leaves = info.leaves.clone();
        leaves.splice(i..i + cs, [b.leaf]);
        let record = self.commit_chain(st, job.slot, &info.desc, &leaves)?;
        st.chains.insert(job.slot, ChainInfo { record, desc: info.desc, leaves });
        {
            let mut h = self.heap.lock();
            for l in &job.inputs {
                h.free(l.addr, line_round(l.len));
            }
        }
        for l in &job.inputs {
            self.tables.lock().remove(&l.meta.table);
            self.fs.remove(&table_path(&self.dir, l.meta.table))?;
        }
        let mut c = self.stats.lock();
        c.compactions += 1;
        c.compaction_bytes += b.table.size();
        c.compaction_dropped += dropped;
        Ok(())
    }

    /// Compact `slot`'s chain as far as it goes without blocking writers while tables are
    /// merged (the compaction thread, `compact()`). Returns the compactions done.
    pub(crate) fn compact_chain(&self, slot: u64) -> Result<u64> {
        let _g = self.compact_job.lock();
        let mut done = 0;
        loop {
            // No new compaction once cancelled (close's own flushes end up here too).
            if self.cancel.is_cancelled() {
                return Ok(done);
            }
            let Some(job) = self.pick_compaction(&self.state.read(), slot) else { return Ok(done) };
            let (b, dropped) = self.build_compaction(&job)?;
            let mut st = self.state.write();
            self.commit_or_discard(b, |b| self.commit_compaction(&mut st, job, (b, dropped)))?;
            done += 1;
        }
    }

    /// Every chain slot (for `compact()`).
    pub(crate) fn chain_slots(&self) -> Vec<u64> {
        self.state.read().chains.keys().copied().collect()
    }

    /// Unflushed leaves waiting for the flush thread.
    pub(crate) fn pending_flushes(&self) -> usize {
        self.state.read().flush_queue.len()
    }

    /// Wait until a flush commits (or `timeout`).
    pub(crate) fn wait_flushed(&self, timeout: std::time::Duration) {
        let mut g = self.flushed_mu.lock();
        self.flushed_cv.wait_for(&mut g, timeout);
    }

    /// Wake writers waiting for room.
    pub(crate) fn notify_flushed(&self) {
        self.flushed_cv.notify_all();
    }

    fn free_segment(&self, st: &mut State, addr: u64) -> Result<()> {
        let Some(g) = st.segs.remove(&addr) else { return Ok(()) };
        let slot = DIR_ADDR + g.slot * SLOT_LEN;
        self.region.store_u64_atomic(slot + 8, 0)?;
        self.region.persist(slot + 8, 8);
        // Iterators open since before this free may still borrow its records: the extent
        // goes back to the heap once they are gone (see `super::view`).
        let stamp = st.view.get_mut().stamp();
        if st.view.get_mut().free_extent(stamp, addr, g.size, self.pins.oldest()) {
            self.heap.lock().free(addr, g.size);
        }
        st.free_slots.push(g.slot);
        self.stats.lock().segments_freed += 1;
        Ok(())
    }

    /// Run the deferred work of [`super::view`] that no open iterator needs any more.
    fn reclaim(&self, st: &mut State) {
        if !st.view.get_mut().has_deferred() {
            return;
        }
        let extents = st.view.get_mut().reclaim(self.pins.oldest());
        if !extents.is_empty() {
            let mut h = self.heap.lock();
            for (a, l) in extents {
                h.free(a, l);
            }
        }
    }

    /// An iterator was dropped: run the deferred work it held back, unless a writer holds
    /// the state lock (its next write or flush does it then).
    pub(crate) fn reclaim_if_idle(&self) {
        if let Some(mut st) = self.state.try_write() {
            self.reclaim(&mut st);
        }
    }

    /// A new active segment of `size` bytes, in `extent` when the caller allocated it (a
    /// lane writer does, outside the state lock: growing the PM region is a syscall).
    fn new_segment(&self, st: &mut State, size: u64, extent: Option<u64>) -> Result<u64> {
        let Some(slot) = st.free_slots.pop() else {
            if let Some(a) = extent {
                self.heap.lock().free(a, size);
            }
            return Err(Error::PmFull(format!("all {SEG_SLOTS} PWB segment slots are in use")));
        };
        let addr = match extent.map_or_else(|| self.alloc(size), Ok) {
            Ok(a) => a,
            Err(e) => {
                st.free_slots.push(slot);
                return Err(e);
            }
        };
        let id = self.region.load_u64_atomic(ID_COUNTER_ADDR)? + 1;
        self.region.store_u64_atomic(ID_COUNTER_ADDR, id)?;
        self.region.persist(ID_COUNTER_ADDR, 8);
        let h = pwb::encode_header(id, size);
        // SAFETY: a freshly allocated extent; only this writer (under the state lock) uses it.
        unsafe { self.region.write(addr, &h)? };
        self.region.persist(addr, pwb::HEADER_LEN as u64);
        let sa = DIR_ADDR + slot * SLOT_LEN;
        self.region.store_u64_atomic(sa, addr)?;
        self.region.persist(sa, 8);
        self.region.store_u64_atomic(sa + 8, id)?;
        self.region.persist(sa + 8, 8);
        st.segs.insert(
            addr,
            Seg { slot, id, size, pos: AtomicU64::new(pwb::HEADER_LEN as u64), live: AtomicU64::new(0), active: true },
        );
        Ok(addr)
    }

    /// Append one put or delete and index it. Durable when it returns.
    pub fn write(&self, kind: Kind, key: &[u8], value: &[u8]) -> Result<()> {
        self.write_batch(&[(kind, key, value)], Cond::None).map(|_| ())
    }

    /// Wait while the flush thread is too far behind.
    fn wait_for_room(&self) -> Result<()> {
        if !self.cfg.background {
            return Ok(());
        }
        let mut stalled = false;
        while self.pending_flushes() >= MAX_PENDING_FLUSHES {
            self.poisoned.check()?;
            if !stalled {
                stalled = true;
                self.stats.lock().write_stalls += 1;
            }
            self.wait_flushed(std::time::Duration::from_millis(20));
        }
        Ok(())
    }

    /// Append `ops` as one record (atomic: after a crash all or none of them are there), in
    /// the active segment of the first key's partition, and index each. Durable when it
    /// returns. With a condition (one op), returns false and writes nothing unless it holds.
    ///
    /// A single put or delete of a key some partition takes runs in its partition's lane
    /// ([`PwbStore::write_in_lane`]): writers of other partitions append, persist and probe
    /// meanwhile. A batch (or a key that needs a new end partition) holds every lane.
    pub fn write_batch(&self, ops: &[pwb::Op<'_>], cond: Cond) -> Result<bool> {
        self.poisoned.check()?;
        let Some(first) = ops.first() else { return Ok(true) };
        self.wait_for_room()?;
        if !self.cfg.background {
            // Leaves linked by earlier writes are flushed before this write's record is
            // appended: a failed flush (a full PM device) then fails this write with nothing
            // of it written, and leaves the store as it was.
            let mut st = self.state.write();
            self.poisoned.check()?;
            while !st.flush_queue.is_empty() {
                self.flush_next_locked(&mut st)?;
            }
        }
        let done = if ops.len() == 1 { self.write_in_lane(first, cond)? } else { None };
        let done = match done {
            Some(d) => d,
            None => {
                let _lanes = self.lock_lanes();
                self.write_exclusive(ops, cond)?
            }
        };
        if done && self.cfg.background && self.pending_flushes_hint() {
            // Under the work lock, so the flush thread cannot miss it between its check of
            // the queue and its wait.
            let _w = self.work.lock();
            self.work_cv.notify_all();
        }
        Ok(done)
    }

    /// Every writer lane, in order (batches, the clean-shutdown image, `check`): no
    /// single-partition writer is between its reservation and its index update meanwhile.
    fn lock_lanes(&self) -> Vec<MutexGuard<'_, ()>> {
        self.lanes.iter().map(|l| l.lock()).collect()
    }

    /// True when a leaf may be waiting for the flush thread (a lock-free hint).
    fn pending_flushes_hint(&self) -> bool {
        self.queued.load(Ordering::Relaxed) > 0
    }

    /// One put or delete in its partition's lane; `None` when no partition takes the key
    /// yet (the caller then takes every lane). Three steps:
    /// 1. lane of the key's partition `p`, then the state lock *shared*: check the route
    ///    (a split of `p` since the lane was chosen: retry in the new one), the condition,
    ///    probe the top leaf for the key ([`RhTree::top_probe`], the key comparisons that
    ///    read and verify PM records), pick the write position in `p`'s active segment
    ///    (a new segment under the exclusive lock, rarely) and take a sequence number;
    /// 2. no state lock: encode the record, write it at the position (page faults land
    ///    here), persist it (flush + fence);
    /// 3. the state lock shared ([`PwbStore::index_shared`]) — or exclusive when the entry
    ///    needs a split, a link, an idle sorted view dropped or LightKV_PM's images: advance the write
    ///    position, index the entry with the probe's outcome (no key compared), the counts.
    ///
    /// Only `p`'s lane holder appends to `p`'s active segment, changes which one it is, or
    /// changes `p`'s top leaf (splits included), so the probe and the position stay valid
    /// and a segment still has one writer at a time: a torn record is always its last.
    fn write_in_lane(&self, op: &pwb::Op<'_>, cond: Cond) -> Result<Option<bool>> {
        let key = op.1;
        let Some(mut p) = self.state.read().tree.route(key) else { return Ok(None) };
        loop {
            let lane = self.lanes[p as usize % LANES].lock();
            let mut st = self.state.read();
            self.poisoned.check()?;
            match st.tree.route(key) {
                Some(q) if q == p => {}
                Some(q) => {
                    p = q;
                    continue;
                }
                None => return Ok(None),
            }
            if cond != Cond::None {
                let exists = self.get_locked(&st, key)?.is_some();
                if exists != (cond == Cond::Present) {
                    return Ok(Some(false));
                }
            }
            let probe = st
                .tree
                .top_probe(key, &self.keys())?
                .ok_or_else(|| Error::Poisoned("lightkv: a routed key lost its partition".into()))?;
            let size = pwb::record_size([(op.1.len(), op.2.len())]) as u64;
            let room = st
                .active
                .get(&p)
                .and_then(|&a| st.segs.get(&a).map(|g| (a, g.id, g.pos.load(Ordering::Relaxed), g.size)))
                .filter(|r| r.2 + size <= r.3)
                .map(|r| (r.0, r.1, r.2));
            let (seg, id, pos) = match room {
                Some(r) => r,
                None => {
                    drop(st);
                    // The extent first, without the state lock (the heap may grow the region).
                    let extent = self.alloc(self.segment_size_for(size))?;
                    let mut w = self.state.write();
                    if let Err(e) = self.poisoned.check() {
                        self.heap.lock().free(extent, self.segment_size_for(size));
                        return Err(e);
                    }
                    let a = self.switch_segment(&mut w, p, size, Some(extent))?;
                    let r = w
                        .segs
                        .get(&a)
                        .map(|g| (a, g.id, g.pos.load(Ordering::Relaxed)))
                        .ok_or_else(|| Error::Poisoned("lightkv: a new segment vanished".into()))?;
                    st = RwLockWriteGuard::downgrade(w);
                    r
                }
            };
            let seq = st.next_seq.fetch_add(1, Ordering::Relaxed);
            drop(st);
            let (rec, offs) = pwb::encode_record(id, seq, std::slice::from_ref(op));
            let addr = seg + pos;
            // SAFETY: bytes past the write position of `p`'s active segment belong to the
            // holder of `p`'s lane alone (this writer); the segment stays allocated while it
            // is active, and only that holder deactivates it; readers only follow index
            // entries to persisted records, and `check` holds every lane.
            unsafe { self.region.write(addr, &rec)? };
            self.region.persist(addr, rec.len() as u64);
            let len = rec.len() as u64;
            let entry = addr + offs.first().copied().unwrap_or(0) as u64;
            let shared = {
                let st = self.state.read();
                self.index_shared(&st, key, seg, entry, len, probe)
            };
            match shared {
                Some(emptied) => {
                    if let Some(a) = emptied {
                        let mut st = self.state.write();
                        st.emptied.push(a);
                        if let Err(e) = self.free_emptied(&mut st) {
                            self.poisoned.set(format!("lightkv write failed after its record was persisted: {e}"));
                            return Err(e);
                        }
                        self.reclaim(&mut st);
                    }
                    self.user_bytes.add(0, (op.1.len() + op.2.len()) as u64);
                }
                None => {
                    let mut st = self.state.write();
                    self.after_append(&mut st, std::slice::from_ref(op), seg, addr, len, &offs, seq, Some(probe))?;
                }
            }
            drop(lane);
            return Ok(Some(true));
        }
    }

    /// Step 3 of [`PwbStore::write_in_lane`] without the exclusive state lock, when the entry
    /// only takes or updates one slot of its partition's top leaf (no split, no link) and no
    /// PM leaf image is kept (LightKV_PM): the top leaf changes under its own lock
    /// ([`RhTree::insert_shared`]; the lane makes this writer its only writer), the
    /// segment's write position and entry counts are atomics, the sorted view has its own
    /// lock. `None`, with
    /// nothing changed, when the exclusive path is needed; else the segment an update left
    /// with no entry (to be freed under the exclusive lock), if any.
    fn index_shared(
        &self,
        st: &State,
        key: &[u8],
        seg: u64,
        entry: u64,
        len: u64,
        probe: Probe,
    ) -> Option<Option<u64>> {
        if self.cfg.placement == LightkvPlacement::Pm || st.replaying {
            return None;
        }
        {
            // A view that writes should stop keeping is dropped on the exclusive path.
            let v = st.view.lock();
            if v.idle(self.view_used.load(Ordering::Relaxed)) && self.pins.count() == 0 {
                return None;
            }
        }
        let g = st.segs.get(&seg)?;
        let outcome = st.tree.insert_shared(key, entry, probe)?;
        g.pos.fetch_add(len, Ordering::Relaxed);
        g.live.fetch_add(1, Ordering::Relaxed);
        st.view.lock().put(key, entry, matches!(outcome, Insert::Updated(..)));
        let mut emptied = None;
        if let Insert::Updated(_, old) = outcome {
            if old & SST_FLAG == 0 {
                if let Some((&a, og)) = st.segs.range(..=old).next_back() {
                    let before =
                        og.live.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_sub(1)));
                    if before == Ok(1) {
                        emptied = Some(a);
                    }
                }
            }
        }
        self.queued.store(st.flush_queue.len(), Ordering::Relaxed);
        Some(emptied)
    }

    /// Partition `p`'s active segment has no room for `size` bytes (or there is none): it
    /// takes no more writes (freed if nothing points into it) and a new one is made active.
    fn switch_segment(&self, st: &mut State, p: PartitionId, size: u64, extent: Option<u64>) -> Result<u64> {
        if let Some(a) = st.active.remove(&p) {
            if let Some(g) = st.segs.get_mut(&a) {
                g.active = false;
                if *g.live.get_mut() == 0 {
                    self.free_segment(st, a)?;
                }
            }
        }
        let a = self.new_segment(st, self.segment_size_for(size), extent)?;
        st.active.insert(p, a);
        Ok(a)
    }

    /// The size of a new segment that must take a record of `size` bytes.
    fn segment_size_for(&self, size: u64) -> u64 {
        (size + pwb::HEADER_LEN as u64).next_multiple_of(64).max(self.seg_size)
    }

    /// A write with every lane held (batches, keys that need a new end partition): the
    /// whole write under the exclusive state lock.
    fn write_exclusive(&self, ops: &[pwb::Op<'_>], cond: Cond) -> Result<bool> {
        let Some(first) = ops.first() else { return Ok(true) };
        let mut st = self.state.write();
        self.poisoned.check()?;
        if cond != Cond::None {
            let exists = self.get_locked(&st, first.1)?.is_some();
            if exists != (cond == Cond::Present) {
                return Ok(false);
            }
        }
        let shape = Self::shape_key(&st);
        let p = st.tree.route_mut(first.1);
        if Self::shape_key(&st) != shape {
            st.epoch += 1;
        }
        let size = pwb::record_size(ops.iter().map(|o| (o.1.len(), o.2.len()))) as u64;
        let seg = match st.active.get(&p).copied() {
            Some(a) if st.segs.get(&a).is_some_and(|g| g.pos.load(Ordering::Relaxed) + size <= g.size) => a,
            _ => self.switch_segment(&mut st, p, size, None)?,
        };
        let (id, pos) = st
            .segs
            .get(&seg)
            .map(|g| (g.id, g.pos.load(Ordering::Relaxed)))
            .ok_or_else(|| Error::Poisoned("active segment vanished".into()))?;
        let seq = st.next_seq.fetch_add(1, Ordering::Relaxed);
        let (rec, offs) = pwb::encode_record(id, seq, ops);
        let addr = seg + pos;
        // SAFETY: bytes past the segment's write position belong to this writer alone
        // (every lane and the state lock held); readers only follow index entries to
        // persisted records.
        unsafe { self.region.write(addr, &rec)? };
        self.region.persist(addr, rec.len() as u64);
        self.after_append(&mut st, ops, seg, addr, rec.len() as u64, &offs, seq, None)?;
        Ok(true)
    }

    /// After a record is persisted (state lock exclusive): advance its segment's write
    /// position, index its entries, and the bookkeeping. The record is durable: a failure
    /// here leaves the store's DRAM state behind its PM state, so it poisons the store
    /// (reopen recovers the record).
    #[allow(clippy::too_many_arguments)]
    fn after_append(
        &self,
        st: &mut State,
        ops: &[pwb::Op<'_>],
        seg: u64,
        addr: u64,
        len: u64,
        offs: &[usize],
        seq: u64,
        probe: Option<Probe>,
    ) -> Result<()> {
        let r = (|| {
            if let Some(g) = st.segs.get_mut(&seg) {
                *g.pos.get_mut() += len;
            }
            let shape = Self::shape_key(st);
            for (op, off) in ops.iter().zip(offs) {
                self.index(st, op.1, addr + *off as u64, seq, false, probe)?;
            }
            let reshaped = Self::shape_key(st) != shape;
            self.sync_images(st, reshaped)?;
            // A segment whose last entry was just superseded, and that takes no more
            // writes, goes.
            self.free_emptied(st)?;
            self.reclaim(st);
            // No range read for long, none open: writes stop keeping the sorted view.
            if st.view.get_mut().idle(self.view_used.load(Ordering::Relaxed)) && self.pins.count() == 0 {
                self.reclaim(st);
                st.view.get_mut().deactivate();
            }
            Ok(())
        })();
        if let Err(e) = r {
            self.poisoned.set(format!("lightkv write failed after its record was persisted: {e}"));
            return Err(e);
        }
        let user: u64 = ops.iter().map(|o| (o.1.len() + o.2.len()) as u64).sum();
        self.user_bytes.add(0, user);
        self.queued.store(st.flush_queue.len(), Ordering::Relaxed);
        Ok(())
    }

    /// Search a PM leaf for `key`.
    fn pm_leaf_get(&self, l: &PmLeaf, key: &[u8], src: &dyn KeySource) -> Result<Option<u64>> {
        if let Some(d) = &l.dram {
            return d.get(key, src);
        }
        let region = &self.region;
        let mut fetch = |i: usize| -> Result<rhtree::Bucket> {
            let b = region.slice_checked(l.addr + (LEAF_HEADER + 64 * i) as u64, 64, "PM leaf bucket")?;
            Ok(decode_bucket(b))
        };
        rhtree::probe(l.normal, l.buckets, l.extra_used, key, &mut fetch, src)
    }

    /// The newest version of `key` with the state lock held: `Some(value)` for a put.
    fn get_locked(&self, st: &State, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let mut out = None;
        self.get_locked_with(st, key, &mut |v| out = Some(v.to_vec()))?;
        Ok(out)
    }

    /// The newest version of `key` with the state lock held, lent to `f` in place when it is
    /// a put. Returns whether it is. Probes compare keys in place; nothing is copied.
    fn get_locked_with(&self, st: &State, key: &[u8], f: &mut dyn FnMut(&[u8])) -> Result<bool> {
        let keys = self.keys();
        let dram = if self.cfg.placement == LightkvPlacement::Pm {
            self.images_get(st, key, &keys)?
        } else {
            st.tree.get(key, &keys)?.map(|x| x.1)
        };
        let off = match dram {
            Some(off) => Some(off),
            None => self.chain_get(st, key, &keys)?,
        };
        let Some(off) = off else { return Ok(false) };
        self.with_entry(off, |kind, _, v| {
            if kind == Kind::Put {
                f(v);
            }
            kind == Kind::Put
        })
    }

    /// [`PwbStore::get`], the value lent to `f` in place. Returns whether the key exists.
    pub fn get_with(&self, key: &[u8], f: &mut dyn FnMut(&[u8])) -> Result<bool> {
        let st = self.state.read();
        self.get_locked_with(&st, key, f)
    }

    /// LightKV_PM: search `key`'s partition's top leaf and unflushed leaves in their PM
    /// images, newest first.
    fn images_get(&self, st: &State, key: &[u8], src: &dyn KeySource) -> Result<Option<u64>> {
        let Some(p) = st.tree.route(key) else { return Ok(None) };
        let part = st.tree.partition(p);
        let missing = || Error::Poisoned("lightkv: a leaf has no PM image".into());
        let top = st.images.get(&p).copied().ok_or_else(missing)?;
        if let Some(off) = self.image_get(top, &part.top.read(), key, src)? {
            return Ok(Some(off));
        }
        let imgs = st.chain_images.get(&p).map(|v| v.as_slice()).unwrap_or(&[]);
        if imgs.len() != part.chain.len() {
            return Err(missing());
        }
        for (img, leaf) in imgs.iter().zip(&part.chain) {
            if let Some(off) = self.image_get(*img, leaf, key, src)? {
                return Ok(Some(off));
            }
        }
        Ok(None)
    }

    /// Search `key`'s partition's PM leaves, newest first.
    fn chain_get(&self, st: &State, key: &[u8], src: &dyn KeySource) -> Result<Option<u64>> {
        let Some(p) = st.tree.route(key) else { return Ok(None) };
        let tag = st.tree.partition(p).tag;
        let Some(c) = tag.checked_sub(1).and_then(|s| st.chains.get(&s)) else { return Ok(None) };
        let mut probes = 0;
        let mut hit = None;
        for l in &c.leaves {
            probes += 1;
            if let Some(off) = self.pm_leaf_get(l, key, src)? {
                hit = Some(off);
                break;
            }
        }
        self.probes.add(0, probes);
        Ok(hit)
    }

    /// The newest value of `key` (`None` if absent or deleted).
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let st = self.state.read();
        self.get_locked(&st, key)
    }

    /// Every live key and value, sorted (tests and checks; not the scan path).
    pub fn dump(&self) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let st = self.state.read();
        let mut keys = std::collections::BTreeSet::new();
        for p in st.tree.partitions_in_order() {
            let part = st.tree.partition(p);
            let top = part.top.read();
            for leaf in std::iter::once(&*top).chain(part.chain.iter()) {
                for off in leaf.offsets() {
                    keys.insert(self.keys().key(off)?);
                }
            }
            if let Some(c) = part.tag.checked_sub(1).and_then(|s| st.chains.get(&s)) {
                for l in &c.leaves {
                    self.table(l.meta.table)?.for_each(|e, _| {
                        keys.insert(e.key.to_vec());
                        Ok(())
                    })?;
                }
            }
        }
        let mut out = Vec::new();
        for k in keys {
            if let Some(v) = self.get_locked(&st, &k)? {
                out.push((k, v));
            }
        }
        Ok(out)
    }

    /// Live keys: the store's entries whose newest version is a put (a full iteration).
    pub fn live_keys(self: &Arc<Self>) -> Result<u64> {
        let mut it = self.iter()?;
        it.seek_to_first()?;
        let mut n = 0u64;
        while it.valid() {
            n += u64::from(it.value().is_some());
            it.next()?;
        }
        Ok(n)
    }

    /// A cursor over the whole store, tombstones as `None` (see [`super::iter`]).
    pub fn iter(self: &Arc<Self>) -> Result<BoxedIter> {
        super::iter::open(self)
    }

    /// A new iterator's pin and table list, taken under one state-lock acquisition: the
    /// flushes the list includes are exactly those stamped before the pin. Builds the
    /// sorted view first if writes are not keeping it (see [`super::view`]).
    pub(crate) fn pin_and_runs(&self) -> Result<(u64, Arc<TableRuns>)> {
        {
            let st = self.state.read();
            let active = st.view.lock().active();
            if active {
                return self.pin_locked(&st);
            }
        }
        let mut st = self.state.write();
        if !st.view.get_mut().active() {
            self.build_view(&mut st)?;
        }
        self.pin_locked(&st)
    }

    fn pin_locked(&self, st: &State) -> Result<(u64, Arc<TableRuns>)> {
        let runs = self.table_runs(st)?;
        let view = st.view.lock();
        let gen = view.gen();
        self.pins.pin(gen);
        self.view_used.store(view.writes(), Ordering::Relaxed);
        Ok((gen, runs))
    }

    /// Build the sorted view from the DRAM leaves: every key they index (read from its
    /// record once), with its newest record (the top leaf, then the unflushed leaves newest
    /// first), sorted once.
    fn build_view(&self, st: &mut State) -> Result<()> {
        // (key, leaf rank: 0 = newest, address)
        let mut ents: Vec<(Vec<u8>, usize, u64)> = Vec::new();
        for p in st.tree.partitions_in_order() {
            let part = st.tree.partition(p);
            let top = part.top.read();
            for (rank, leaf) in std::iter::once(&*top).chain(part.chain.iter()).enumerate() {
                for off in leaf.offsets() {
                    if off & SST_FLAG != 0 {
                        return Err(Error::Poisoned(format!("lightkv: a DRAM leaf names table entry {off:#x}")));
                    }
                    ents.push((self.keys().key(off)?, rank, off));
                }
            }
        }
        ents.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        // `dedup_by` keeps the first of equal keys: the newest leaf's.
        ents.dedup_by(|later, first| later.0 == first.0);
        st.view.get_mut().build(ents.into_iter().map(|(k, _, off)| (k, off)).collect());
        Ok(())
    }

    /// The chained partitions' ranges with their tables (newest first), in key order;
    /// cached until partitions change shape or a chain record is committed.
    fn table_runs(&self, st: &State) -> Result<Arc<TableRuns>> {
        let ver = (st.epoch, st.chain_ver);
        if let Some((v, r)) = &*self.runs_cache.lock() {
            if *v == ver {
                return Ok(r.clone());
            }
        }
        let mut by_slot: HashMap<u64, Arc<Vec<Arc<Table>>>> = HashMap::new();
        let mut runs = Vec::new();
        for (lo, hi, p) in st.tree.ranges() {
            let Some(slot) = st.tree.partition(p).tag.checked_sub(1) else { continue };
            let Some(c) = st.chains.get(&slot).filter(|c| !c.leaves.is_empty()) else { continue };
            let tables = match by_slot.get(&slot) {
                Some(t) => t.clone(),
                None => {
                    let t: Vec<Arc<Table>> =
                        c.leaves.iter().map(|l| self.table(l.meta.table)).collect::<Result<_>>()?;
                    let t = Arc::new(t);
                    by_slot.insert(slot, t.clone());
                    t
                }
            };
            runs.push(Run { lo, hi, tables });
        }
        let runs = Arc::new(runs);
        *self.runs_cache.lock() = Some((ver, runs.clone()));
        Ok(runs)
    }

    /// Copy up to `want` record addresses of the sorted view from `from` on for an iterator
    /// pinned at `pin` (a short read lock; see [`super::view::SortedView::fill`]).
    pub(crate) fn view_fill(&self, from: Bound<&[u8]>, forward: bool, pin: u64, want: usize, out: &mut Vec<u64>) {
        self.state.read().view.lock().fill(from, forward, pin, want, out);
    }

    /// Counters.
    pub fn stats(&self) -> StoreStats {
        let mut s = *self.stats.lock();
        s.segments = self.state.read().segs.len() as u64;
        s.pm_leaf_probes = self.probes.get(0);
        s
    }

    /// Index shape figures for `Stats::design`: (name, value).
    pub fn shape(&self) -> Vec<(&'static str, u64)> {
        let (heap_total, heap_free) = {
            let h = self.heap.lock();
            (h.total(), h.free_bytes())
        };
        let st = self.state.read();
        let chains: Vec<usize> = st.chains.values().map(|c| c.leaves.len()).collect();
        let splits = st.tree.splits();
        let pm_leaf_bytes: u64 = st.chains.values().flat_map(|c| c.leaves.iter()).map(|l| l.len).sum();
        let top_live: u64 =
            st.tree.partitions_in_order().iter().map(|&p| st.tree.partition(p).top.read().live() as u64).sum();
        let dram_leaves = st.tree.partition_count()
            + st.tree.partitions_in_order().iter().map(|&p| st.tree.partition(p).chain.len()).sum::<usize>();
        let dram_leaf_bytes =
            (dram_leaves * (self.cfg.tree.leaf_buckets + self.cfg.tree.leaf_buckets.div_ceil(20)) * 64) as u64
                + if self.cfg.placement == LightkvPlacement::Dram { pm_leaf_bytes } else { 0 };
        let tables: u64 = chains.iter().sum::<usize>() as u64;
        let table_bytes: u64 = {
            let t = self.tables.lock();
            st.chains
                .values()
                .flat_map(|c| c.leaves.iter())
                .filter_map(|l| t.get(&l.meta.table))
                .map(|t| t.size())
                .sum()
        };
        let view = st.view.lock();
        vec![
            ("partitions", st.tree.partition_count() as u64),
            ("chained_partitions", st.chains.len() as u64),
            ("sstables", tables),
            ("sstable_bytes_open", table_bytes),
            ("chain_length_max", chains.iter().copied().max().unwrap_or(0) as u64),
            ("chain_length_mean_x100", if chains.is_empty() { 0 } else { (tables * 100) / chains.len() as u64 }),
            ("pm_leaf_bytes", pm_leaf_bytes),
            ("pm_leaf_entries", st.chains.values().flat_map(|c| c.leaves.iter()).map(|l| l.live as u64).sum()),
            ("dram_leaf_bytes", dram_leaf_bytes),
            ("top_leaf_entries", top_live),
            ("unflushed_leaves", st.flush_queue.len() as u64),
            ("normal_splits", splits.normal),
            ("level_splits", splits.level),
            ("cache_slot_refreshes", splits.refreshed),
            ("pwb_segments", st.segs.len() as u64),
            ("pm_heap_bytes", heap_total),
            ("pm_heap_free_bytes", heap_free),
            ("sorted_view_active", u64::from(view.active())),
            ("sorted_view_builds", view.builds()),
            ("sorted_view_keys", view.len() as u64),
            ("sorted_view_bytes", view.approx_bytes()),
            ("iterators_open", self.pins.count() as u64),
            ("deferred_view_entries", view.deferred().0 as u64),
            ("deferred_segment_frees", view.deferred().1 as u64),
        ]
    }

    /// User bytes written since open.
    pub fn user_bytes(&self) -> u64 {
        self.user_bytes.get(0)
    }

    /// Verify every PM structure, table and index entry; returns the problems found.
    pub fn check(&self) -> Result<Vec<String>> {
        // No writer between its append and its index update: segments scan to their end.
        let _lanes = self.lock_lanes();
        let _f = self.flush_job.lock();
        let _c = self.compact_job.lock();
        let st = self.state.read();
        let mut problems = Vec::new();
        for (&a, g) in &st.segs {
            match self.region.slice_checked(a, g.size as usize, "PWB segment") {
                Ok(b) => {
                    if let Err((off, d)) = pwb::scan(b, g.id) {
                        problems.push(format!("PWB segment at {a:#x}+{off}: {d}"));
                    }
                }
                Err(e) => problems.push(e.to_string()),
            }
        }
        for (slot, c) in &st.chains {
            match read_chain(&self.region, c.record.0) {
                Ok((ch, _))
                    if ch.leaves == c.leaves.iter().map(|l| l.addr).collect::<Vec<_>>() && ch.desc == c.desc => {}
                Ok(_) => problems.push(format!("chain slot {slot}: the PM chain record differs from the DRAM chain")),
                Err(e) => problems.push(e.to_string()),
            }
            for l in &c.leaves {
                let leaf = self
                    .region
                    .slice_checked(l.addr, l.len as usize, "PM leaf")
                    .and_then(|b| decode_leaf(b).map_err(|d| self.region.corruption(l.addr, d)));
                let leaf = match leaf {
                    Ok((leaf, _)) => leaf,
                    Err(e) => {
                        problems.push(e.to_string());
                        continue;
                    }
                };
                let mut n = 0u64;
                let r = self.table(l.meta.table).and_then(|t| {
                    t.for_each(|_, _| {
                        n += 1;
                        Ok(())
                    })
                });
                if let Err(e) = r {
                    problems.push(e.to_string());
                } else if n != leaf.live() as u64 {
                    problems.push(format!("table {} holds {n} entries, its PM leaf {}", l.meta.table, leaf.live()));
                }
            }
        }
        // LightKV_PM: every leaf image holds exactly its DRAM leaf's buckets.
        if self.cfg.placement == LightkvPlacement::Pm {
            for p in st.tree.partitions_in_order() {
                let part = st.tree.partition(p);
                let imgs = std::iter::once(st.images.get(&p).copied())
                    .chain(st.chain_images.get(&p).into_iter().flatten().map(|x| Some(*x)));
                let top = part.top.read();
                for (img, leaf) in imgs.zip(std::iter::once(&*top).chain(part.chain.iter())) {
                    let Some((a, len)) = img else {
                        problems.push(format!("partition {p}: a leaf has no PM image"));
                        continue;
                    };
                    let same = self.region.slice(a, len as usize).is_some_and(|b| {
                        b.len() == LEAF_HEADER + leaf.buckets().len() * 64
                            && leaf.buckets().iter().enumerate().all(|(i, bk)| {
                                b[LEAF_HEADER + 64 * i..LEAF_HEADER + 64 * i + 64] == leaf::bucket_bytes(bk)
                            })
                    });
                    if !same {
                        problems.push(format!("partition {p}: a PM leaf image differs from its leaf"));
                    }
                }
            }
        }
        // Every index entry resolves to a record of a key that routes back to its partition
        // and that the index finds there.
        for p in st.tree.partitions_in_order() {
            let part = st.tree.partition(p);
            let mut offs: Vec<u64> =
                std::iter::once(&*part.top.read()).chain(part.chain.iter()).flat_map(|l| l.offsets()).collect();
            if let Some(c) = part.tag.checked_sub(1).and_then(|s| st.chains.get(&s)) {
                for l in &c.leaves {
                    if let Some(d) = &l.dram {
                        offs.extend(d.offsets());
                    }
                }
            }
            for off in offs {
                match self.record(off) {
                    Ok((_, k, _)) => {
                        if st.tree.route(&k) != Some(p) {
                            problems.push(format!(
                                "key {:?} is indexed in the wrong partition",
                                String::from_utf8_lossy(&k)
                            ));
                        }
                    }
                    Err(e) => problems.push(e.to_string()),
                }
            }
        }
        // While active, the sorted view maps exactly the keys the DRAM leaves index to their
        // newest record there (retired entries aside: they wait for old iterators); while
        // inactive it is empty and no iterator is open.
        let view = st.view.lock();
        if !view.active() {
            if view.len() != 0 || self.pins.count() != 0 {
                problems.push("sorted view: inactive, yet it holds keys or iterators are open".into());
            }
            return Ok(problems);
        }
        let mut newest: HashMap<Vec<u8>, u64> = HashMap::new();
        for p in st.tree.partitions_in_order() {
            let part = st.tree.partition(p);
            let top = part.top.read();
            for off in std::iter::once(&*top).chain(part.chain.iter()).flat_map(|l| l.offsets()) {
                if let Ok((_, k, _)) = self.record(off) {
                    newest.entry(k).or_insert(off);
                }
            }
        }
        for (k, e) in view.entries().filter(|(_, e)| e.retired == 0) {
            if newest.remove(k) != Some(e.off) {
                problems.push(format!(
                    "sorted view: key {:?} maps to {:#x}, not to its newest DRAM-indexed record",
                    String::from_utf8_lossy(k),
                    e.off
                ));
            }
        }
        for k in newest.keys() {
            problems.push(format!("sorted view: key {:?} is missing", String::from_utf8_lossy(k)));
        }
        Ok(problems)
    }

    /// Clean shutdown: with no flush pending (the caller drained the queue), write the image
    /// of every partition's place and top leaf and commit it with one 8-byte store.
    pub fn write_image(&self) -> Result<()> {
        // No writer between its append and its index update (its record would lie past the
        // write position the image saves, and be lost at the next open).
        let _lanes = self.lock_lanes();
        let st = self.state.write();
        if !st.flush_queue.is_empty() {
            return Ok(());
        }
        let partitions = st
            .tree
            .partitions_in_order()
            .into_iter()
            .map(|p| {
                (
                    st.tree.descriptor(p),
                    st.active.get(&p).copied().unwrap_or(0),
                    st.tree.partition(p).top.read().clone(),
                )
            })
            .collect();
        let img = Image {
            next_seq: st.next_seq.load(Ordering::Relaxed),
            segments: st.segs.iter().map(|(&a, g)| (a, g.pos.load(Ordering::Relaxed))).collect(),
            partitions,
        };
        let b = encode_image(&img);
        let a = self.put_extent(&b)?;
        self.region.store_u64_atomic(IMAGE_PTR_ADDR, a)?;
        self.region.persist(IMAGE_PTR_ADDR, 8);
        Ok(())
    }

    /// The configuration.
    pub(crate) fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// The PM region.
    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }
}

/// The leaf a flush or compaction writes to PM for `offs` (a new table's keys and offset
/// slots), every key in one of its own two buckets (cuckoo placement,
/// [`rhtree::build_leaf`]). A PM leaf is never changed, so it needs no extra area: a probe
/// then reads at most two buckets, hit or miss (a leaf copied as it was in DRAM, where a
/// full leaf spills into its extra area, would make every miss read the whole area).
pub(crate) fn pm_leaf_of(offs: &[(Vec<u8>, u64)], depth: usize) -> Leaf {
    // Cuckoo placement fills two-choice, four-slot buckets to about 90 %: start at 85 % load
    // and grow by an eighth until every key fits.
    let mut normal = (offs.len() * 100).div_ceil(rhtree::SLOTS * 85).max(1);
    loop {
        if let Some(l) = rhtree::build_leaf(offs, depth, normal) {
            return l;
        }
        normal += normal.div_ceil(8);
    }
}

/// A PM leaf's DRAM descriptor (and DRAM copy with [`LightkvPlacement::Dram`]).
fn pm_leaf(addr: u64, len: u64, meta: LeafMeta, leaf: &Leaf, placement: LightkvPlacement) -> PmLeaf {
    PmLeaf {
        addr,
        len,
        meta,
        normal: leaf.normal(),
        buckets: leaf.buckets().len(),
        depth: leaf.depth(),
        extra_used: leaf.extra_used(),
        live: leaf.live(),
        dram: (placement == LightkvPlacement::Dram).then(|| Arc::new(leaf.clone())),
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
                read_latency_ns: 0,
                capacity: 0,
                preallocate: false,
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
        PwbStore::open(
            region(dev, create),
            Arc::new(fs.clone()),
            Path::new("/t"),
            create,
            StoreConfig::inline(8192, o, 4),
        )
    }

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    fn step(s: &PwbStore, m: &mut Model, i: u32) -> Result<()> {
        let k = format!("key{:03}", (i * 37) % 150).into_bytes();
        if i % 11 == 5 {
            // A batch over keys of different partitions: all or nothing after a crash.
            let k2 = format!("key{:03}", (i * 53 + 7) % 150).into_bytes();
            let k3 = format!("~zz{}", i % 40).into_bytes();
            let v = vec![(i % 7) as u8; 30];
            s.write_batch(&[(Kind::Put, &k, &v), (Kind::Delete, &k2, b""), (Kind::Put, &k3, &v)], Cond::None)?;
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
                let w: Vec<u32> = c.leaves.iter().map(|l| l.meta.cw).collect();
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
        let s = PwbStore::open(
            region(&dev, true),
            Arc::new(fs.clone()),
            Path::new("/t"),
            true,
            StoreConfig::inline(8192, o, 4),
        )
        .unwrap();
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

    /// Thread `t`'s key `i`: first bytes spread over the byte range, so that after a few
    /// splits the threads write to different partitions (different lanes).
    fn lane_key(t: usize, i: u32) -> Vec<u8> {
        let mut k = vec![(t * 67 + 11) as u8, b'k'];
        k.extend_from_slice(format!("{:02}", (i * 7) % 40).as_bytes());
        k
    }

    /// What each thread wrote: (key, value or `None` for a delete, acknowledged before the
    /// crash point froze the device).
    type History = Vec<(Vec<u8>, Option<Vec<u8>>, bool)>;

    /// `threads` writers, each putting and deleting its own keys through its partitions'
    /// lanes; returns each thread's history. A write counts as acknowledged before the crash
    /// when the device was still running after it returned (its fence came first).
    fn lane_writers(s: &Arc<PwbStore>, dev: &SimDevice, threads: usize, per_thread: u32) -> Vec<History> {
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let s = s.clone();
                    let dev = dev.clone();
                    sc.spawn(move || {
                        let mut h = History::new();
                        for i in 0..per_thread {
                            let k = lane_key(t, i);
                            let v = (i % 9 != 4).then(|| vec![(t as u8) ^ (i as u8); 20 + (i as usize * 13) % 90]);
                            let r = match &v {
                                Some(v) => s.write(Kind::Put, &k, v),
                                None => s.write(Kind::Delete, &k, b""),
                            };
                            let acked = r.is_ok() && !dev.crashed();
                            h.push((k, v, acked));
                            if r.is_err() {
                                break;
                            }
                        }
                        h
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// The recovered state against the histories: every key holds the value of its last
    /// acknowledged write, or of a write issued after it (one in flight at the crash); no key
    /// that was never written appears.
    fn holds_acknowledged(got: &Model, hist: &[History]) -> std::result::Result<(), String> {
        // Each key's writes in order: (value or delete, acknowledged).
        type Writes<'a> = Vec<(&'a Option<Vec<u8>>, bool)>;
        let mut per_key: HashMap<&[u8], Writes<'_>> = HashMap::new();
        for h in hist {
            for (k, v, acked) in h {
                per_key.entry(k.as_slice()).or_default().push((v, *acked));
            }
        }
        for k in got.keys() {
            if !per_key.contains_key(k.as_slice()) {
                return Err(format!("key {k:?} was never written"));
            }
        }
        for (k, writes) in &per_key {
            let last = writes.iter().rposition(|w| w.1);
            let now = got.get(*k);
            let mut allowed: Vec<Option<&Vec<u8>>> = match last {
                Some(j) => writes[j..].iter().map(|w| w.0.as_ref()).collect(),
                None => std::iter::once(None).chain(writes.iter().map(|w| w.0.as_ref())).collect(),
            };
            allowed.dedup();
            if !allowed.contains(&now) {
                return Err(format!("key {k:?}: recovered {now:?}, allowed {allowed:?}"));
            }
        }
        Ok(())
    }

    fn concurrent_crash_points(o: RhOptions, threads: usize, per_thread: u32, stride: usize) -> usize {
        let mut points = 0;
        for n in (1..100_000u64).step_by(stride) {
            let dev = SimDevice::new();
            let fs = FaultFs::new();
            let s = Arc::new(open(&dev, &fs, true, o).unwrap());
            let f2 = fs.clone();
            dev.on_freeze(move || f2.freeze());
            dev.crash_before_fence(dev.fences() + n);
            let hist = lane_writers(&s, &dev, threads, per_thread);
            if !dev.crashed() {
                // Every write finished before fence n: the whole run was covered.
                let got: Model = s.dump().unwrap().into_iter().collect();
                holds_acknowledged(&got, &hist).unwrap();
                assert_eq!(s.check().unwrap(), Vec::<String>::new());
                break;
            }
            drop(s);
            points += 1;
            let s = open(&dev.simulate_crash(n, 0.5), &fs.crash(), false, o)
                .unwrap_or_else(|e| panic!("crash point {n}: reopen failed: {e}"));
            let got: Model = s.dump().unwrap().into_iter().collect();
            if let Err(e) = holds_acknowledged(&got, &hist) {
                panic!("crash point {n}: {e}");
            }
            assert_eq!(s.check().unwrap(), Vec::<String>::new(), "crash point {n}");
            s.write(Kind::Put, b"after", b"crash").unwrap();
            assert_eq!(s.get(b"after").unwrap().as_deref(), Some(&b"crash"[..]));
        }
        points
    }

    #[test]
    fn concurrent_writers_in_their_lanes_read_back_and_recover() {
        for o in [small(), flushing()] {
            let dev = SimDevice::new();
            let fs = FaultFs::new();
            let s = Arc::new(open(&dev, &fs, true, o).unwrap());
            let hist = lane_writers(&s, &dev, 4, 600);
            let mut m = Model::new();
            for h in &hist {
                for (k, v, _) in h {
                    match v {
                        Some(v) => m.insert(k.clone(), v.clone()),
                        None => m.remove(k),
                    };
                }
            }
            assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
            assert_eq!(s.check().unwrap(), Vec::<String>::new());
            let parts = s.state.read().tree.partition_count();
            assert!(parts >= 4, "the threads' keys spread over partitions: {parts}");
            drop(s);
            let s = open(&dev.simulate_crash(0, 0.0), &fs.crash(), false, o).unwrap();
            assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_crash_at_every_persist_point_of_concurrent_writers_keeps_every_acknowledged_write() {
        let points = concurrent_crash_points(small(), 4, 150, 4);
        assert!(points > 100, "{points}");
        eprintln!("concurrent writers: {points} crash points");
    }

    #[test]
    fn a_crash_at_every_persist_point_of_concurrent_writers_with_flushes_keeps_every_acknowledged_write() {
        let points = concurrent_crash_points(flushing(), 4, 150, 3);
        assert!(points > 100, "{points}");
        eprintln!("concurrent writers with flushes: {points} crash points");
    }

    fn open_cfg(dev: &SimDevice, fs: &FaultFs, create: bool, cfg: StoreConfig) -> PwbStore {
        PwbStore::open(region(dev, create), Arc::new(fs.clone()), Path::new("/t"), create, cfg).unwrap()
    }

    #[test]
    fn a_clean_close_image_restores_the_dram_part_without_a_scan() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let cfg = StoreConfig::inline(8192, flushing(), 4);
        let s = open_cfg(&dev, &fs, true, cfg.clone());
        let mut m = Model::new();
        for i in 0..2000 {
            step(&s, &mut m, i).unwrap();
        }
        s.write_image().unwrap();
        let parts = s.state.read().tree.partition_count();
        drop(s);
        // Clean restart: nothing scanned, same partitions, same contents.
        let s = open_cfg(&dev, &fs, false, cfg.clone());
        let st = s.stats();
        assert_eq!((st.restored_from_image, st.recovered_records), (1, 0), "{st:?}");
        assert_eq!(s.state.read().tree.partition_count(), parts);
        assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
        assert_eq!(s.check().unwrap(), Vec::<String>::new());
        // The image was retired at open: writes after it, then a crash, recover by scanning.
        for i in 2000..2600 {
            step(&s, &mut m, i).unwrap();
        }
        drop(s);
        let s = open_cfg(&dev.simulate_crash(0, 0.0), &fs.crash(), false, cfg.clone());
        let st = s.stats();
        assert_eq!(st.restored_from_image, 0, "{st:?}");
        assert!(st.recovered_records > 0, "{st:?}");
        assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn a_damaged_image_is_rejected_and_the_write_buffer_scanned() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let cfg = StoreConfig::inline(8192, flushing(), 4);
        let s = open_cfg(&dev, &fs, true, cfg.clone());
        let mut m = Model::new();
        for i in 0..1500 {
            step(&s, &mut m, i).unwrap();
        }
        s.write_image().unwrap();
        let at = s.region.load_u64_atomic(IMAGE_PTR_ADDR).unwrap();
        // Damage a byte in the middle of the image (its crc then fails).
        let len = image_len(s.region.slice(at, IMAGE_HEADER).unwrap()).unwrap() as u64;
        let victim = at + len / 2;
        let byte = s.region.slice(victim, 1).unwrap()[0];
        // SAFETY: test-only damage of a persisted image nobody reads concurrently.
        unsafe { s.region.write(victim, &[byte ^ 0x40]).unwrap() };
        s.region.persist(victim, 1);
        drop(s);
        let s = open_cfg(&dev.simulate_crash(0, 0.0), &fs.crash(), false, cfg);
        let st = s.stats();
        assert_eq!((st.image_rejected, st.restored_from_image), (1, 0), "{st:?}");
        assert!(st.recovered_records > 0);
        assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
    }

    /// Keys with shared prefixes, short keys and several first bytes, so that partitions
    /// level-split (value sets with holes) and chains link and compact.
    fn scan_key(i: u32) -> Vec<u8> {
        match i % 5 {
            0 => format!("user{:05}", (i * 7919) % 3000).into_bytes(),
            1 => format!("u{}", (i * 31) % 40).into_bytes(),
            2 => vec![b'u', b's', b'e', b'r', (i % 256) as u8],
            3 => format!("zz{:04}", (i * 13) % 500).into_bytes(),
            _ => vec![(i % 256) as u8],
        }
    }

    #[test]
    fn scans_merge_partitions_and_tables_in_key_order() {
        for placement in [LightkvPlacement::Hybrid, LightkvPlacement::Dram, LightkvPlacement::Pm] {
            let dev = SimDevice::new();
            let fs = FaultFs::new();
            let o = RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 24 };
            let cfg = StoreConfig { placement, ..StoreConfig::inline(8192, o, 4) };
            let s = Arc::new(open_cfg(&dev, &fs, true, cfg));
            let mut m = Model::new();
            for i in 0..6000u32 {
                let k = scan_key(i);
                if i % 9 == 4 {
                    s.write(Kind::Delete, &k, b"").unwrap();
                    m.remove(&k);
                } else {
                    let v = format!("v{i}").into_bytes();
                    s.write(Kind::Put, &k, &v).unwrap();
                    m.insert(k, v);
                }
            }
            let st = s.stats();
            let splits = s.state.read().tree.splits();
            assert!(st.flushes > 10 && st.compactions > 0 && splits.level > 0, "{st:?} {splits:?}");
            let mut rng = 12345u64;
            let mut next = || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let all: Vec<Vec<u8>> = m.keys().cloned().collect();
            for round in 0..300 {
                let a = scan_key(next() as u32 % 6000);
                let b = scan_key(next() as u32 % 6000);
                let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
                let start = match round % 3 {
                    0 => Bound::Included(lo.as_slice()),
                    1 => Bound::Excluded(lo.as_slice()),
                    _ => Bound::Unbounded,
                };
                let end = match round % 4 {
                    0 => Bound::Excluded(hi.as_slice()),
                    1 => Bound::Included(hi.as_slice()),
                    _ => Bound::Unbounded,
                };
                let max = [1, 3, 16, 100, 5000][round % 5];
                let want: Vec<(Vec<u8>, Vec<u8>)> =
                    m.range::<[u8], _>((start, end)).take(max).map(|(k, v)| (k.clone(), v.clone())).collect();
                let got =
                    crate::iter::collect_range(&mut *crate::engine::lightkv::iter::open(&s).unwrap(), start, end, max)
                        .unwrap();
                assert_eq!(got, want, "{placement:?} round {round}: {start:?}..{end:?} max {max}");
            }
            let everything = crate::iter::collect_range(
                &mut *crate::engine::lightkv::iter::open(&s).unwrap(),
                Bound::Unbounded,
                Bound::Unbounded,
                usize::MAX,
            );
            assert_eq!(everything.unwrap().len(), all.len());
            // Every key is found by get, in DRAM or PM leaves alike.
            for (k, v) in &m {
                assert_eq!(s.get(k).unwrap().as_ref(), Some(v));
            }
            let probes = s.stats().pm_leaf_probes;
            assert!(probes > 0, "gets reached PM leaves");
            assert_eq!(s.live_keys().unwrap(), m.len() as u64);
            assert_eq!(s.check().unwrap(), Vec::<String>::new(), "{placement:?}");
        }
    }
}
