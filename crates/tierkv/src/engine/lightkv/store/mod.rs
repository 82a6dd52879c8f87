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

mod flush;
mod recovery;
mod write;

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
                    self.table(l.meta.table)?.for_each(|e, _, _| {
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
                    t.for_each(|_, _, _| {
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
mod tests;
