//! A LevelDB-style leveled LSM tree on the shared SSTable format and MANIFEST: the
//! ColdStore of `hoakv`, and a reusable component (an in-tree LevelDB-like baseline later).
//!
//! # What runs here
//! - **Write path**: a batch is one WAL record ([`wal`]; fsynced only with `sync_wal`, as
//!   LevelDB's default) and then goes into the DRAM MemTable ([`mem`]: a lock-free skiplist
//!   of versioned entries, key → value or tombstone; readers never wait for the writer).
//!   Concurrent writers share one WAL append (group commit) and then insert their own
//!   batches into the MemTable in parallel ([`Lsm::write`]). A
//!   MemTable past `memtable_size` becomes the Immutable MemTable and a new MemTable and WAL
//!   generation start (the old WAL is synced first, so a power loss never keeps a later
//!   WAL without the earlier one's tail); a background thread flushes it (each key's newest
//!   version). The WAL starts the write-back of its records every
//!   [`crate::fs::LOG_WRITEBACK_EVERY`] bytes ([`crate::fs::create_log`]), so those syncs —
//!   and HoaKV's demotion syncs, taken under its exclusive writer lock — find at most about
//!   a MiB not yet handed to the device (plus pages still in flight), not everything since
//!   the last sync (up to a whole MemTable's worth: 4 MiB by default, 64 MiB in HoaKV).
//! - **Flush**: the Immutable MemTable becomes one level-0 SSTable (tombstones kept). The
//!   MANIFEST edit adding it also records its WAL generation as flushed (the version's
//!   `counter`), which is the commit point; the WALs up to it are then removed.
//! - **Levels**: level 0 holds overlapping tables (newest searched first); levels 1.. hold
//!   sorted runs of non-overlapping tables, level `n` sized `level1_size × fanout^(n-1)`.
//! - **Compaction** (LevelDB's `PickCompaction`): a score per level (level 0: tables /
//!   `l0_compaction_trigger`; level n: bytes / its target); the level with the highest score
//!   ≥ 1 is compacted. Level 0 compacts all its tables with the overlapping level-1 tables;
//!   level n compacts one table — the next after the level's compaction pointer, round
//!   robin through the key space — with the overlapping tables of level n+1. One input and
//!   nothing overlapping below is a trivial move (a MANIFEST edit, no I/O). Outputs are cut
//!   at `target_file_size`; a tombstone is dropped when no deeper level holds its key's
//!   range. The MANIFEST edit (inputs removed, outputs added at n+1) is the commit point.
//! - **Seek compaction** (LevelDB's `allowed_seeks`): a table allows `size / 16 KiB` seeks
//!   (at least 100). A point read ([`Lsm::get`], [`TablesView::get`]: an owner's reads, and
//!   hoakv's value-group maintenance, which looks up each record it scans, as LevelDB's
//!   `Get` would) that searches a second table (its key range holds the key; a bloom
//!   filter's "no" counts as a search, as in LevelDB) charges one to the first table it
//!   searched. A range read that samples (hoakv's iterator; [`Lsm::iter`] and native's do
//!   not) picks about one entry per MiB of keys and values its sources return
//!   ([`ReadSampler`]) and charges the first of the tables holding that key when two or more
//!   do ([`Lsm::record_read_sample`]). A table whose allowance is spent becomes the one
//!   seek compaction due (if another is due, it claims the place at a later charge), and is
//!   compacted into the next level (level 0: all of it, as above) when no level's score is
//!   ≥ 1 (`seek_compactions`). A table no longer in the current version is not charged
//!   (reads through an older view: a snapshot's). This is what moves a read-mostly store's
//!   level 0 and upper levels down once writes stop; without it their tables stayed until
//!   the next write-driven compaction, and every read merged or probed them
//!   (`docs/design/read-path.md`, "Seek compaction"). The allowances live in DRAM only
//!   (reset at open, and for a table a trivial move carries down), as LevelDB's. Charging
//!   is one relaxed atomic subtraction on the table; the read that makes a table due wakes
//!   the compaction thread ([`Lsm::wake_for_seeks`]). With `background` off, compactions
//!   run in the writing thread at a MemTable rotation, an ingest or a flush/compact, and
//!   pick the table due there.
//! - **Reads**: MemTable → Immutable MemTable → level 0 newest first → one table per level
//!   (binary search on the largest keys); bloom filters (10 bits/key) and a block cache.
//!   Range reads: [`Lsm::iter`] (below).
//! - **Back-pressure**: writers wait while level 0 holds `l0_stop_writes` tables or the
//!   Immutable MemTable is still being flushed (counted as `write_stalls`).
//!
//! # Range reads: the iterator
//! [`Lsm::sources`] lists the tree's sources newest first, each an [`InternalIterator`];
//! [`Lsm::iter`] merges them ([`MergingIterator`], the newest source winning a key):
//! - the MemTable and the Immutable MemTable ([`MemIter`]): a cursor holding a
//!   reference-counted skiplist node, keys and values borrowed from it, no lock (the
//!   skiplist is lock-free; nodes are never removed, an overwrite adds a newer version);
//!   the `Arc<Mem>` keeps a MemTable alive after its flush. The active one is read live: an
//!   entry written after the cursor passed its place is not seen, a later one may be.
//! - each level-0 table, newest first, as a [`TableIter`] (one verified block pinned,
//!   entries borrowed from it, blocks through the block cache);
//! - each non-empty level ≥ 1 as one `LevelIter` (LevelDB's two-level iterator): a seek
//!   binary-searches the level's largest keys and opens one table's [`TableIter`]; running
//!   off a table opens the next.
//!
//! The tables come from the `Arc<Levels>` taken when the iterator is made (after the
//! MemTables: a flush installs its table before dropping the Immutable MemTable, so an
//! entry is always in one or the other). Each `Arc<Table>` holds its file open, so the
//! iterator reads on after a compaction removed the file; nothing is locked between calls.
//! Costs: a seek is O(log n) per source (skiplist search, binary search of the level, of
//! the table's index, of the block); a step is O(1) amortised per source plus the merge's
//! linear pass over the sources; no entry is copied.
//!
//! # Shutdown
//! [`Lsm::stop`] (and drop) set the owner's [`crate::jobs::Cancel`] before joining the
//! worker. A compaction checks it before each output table and every 256 merged entries;
//! nothing names the outputs before the MANIFEST edit, so a cancelled one deletes them,
//! restores the level's compaction pointer and leaves the version untouched. Flushes are
//! not cancelled (close flushes the MemTable anyway). Once stopped, a write or flush still
//! running no longer waits for the worker: an Immutable MemTable it would wait for is
//! flushed in its own thread (poison checked first, a failure poisons, as the worker's),
//! and level 0's stop-writes depth no longer stalls writes (it waited for ever before:
//! `tests::writes_after_the_background_thread_stopped_flush_themselves`).
//!
//! # Recovery
//! The MANIFEST gives the tables (with levels) and the last flushed WAL generation; newer
//! WALs are read by [`Lsm::open`] and handed to the caller, which filters them (HoaKV drops
//! operations its hot store already holds newer) and gives them back to
//! [`Lsm::finish_recovery`]: they are flushed to a level-0 table and the WALs removed before
//! the first new write. Tables not named in the MANIFEST are leftovers of an interrupted
//! flush or compaction and are removed.

mod level_iter;
mod mem;
#[cfg(test)]
pub(crate) mod test_walk;
pub mod wal;

use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::error::{Error, Result};
use crate::fs::{CountingFs, Fs, FsFile};
use crate::iter::{BoxedIter, InternalIterator, MergingIterator};
use crate::jobs::Cancel;
use crate::manifest::{Edit, FileMeta, Manifest, Version};
use crate::poison::Poison;
use crate::sstable::{BlockCache, Kind, Table, TableBuilder, TableCursor, TableIter};
use level_iter::LevelIter;
use mem::{Mem, MemIter};

/// Sizes and policies of a leveled LSM. The defaults are LevelDB's.
#[derive(Debug, Clone)]
pub struct LsmOptions {
    /// MemTable bytes before it is flushed.
    pub memtable_size: u64,
    /// Level-0 tables that make level 0's compaction score 1 (LevelDB: 4).
    pub l0_compaction_trigger: usize,
    /// Level-0 tables at which writers wait for compaction (LevelDB: 12).
    pub l0_stop_writes: usize,
    /// Target bytes of level 1 (LevelDB: 10 MiB).
    pub level1_size: u64,
    /// Size ratio between adjacent levels (LevelDB: 10).
    pub fanout: u64,
    /// Levels, level 0 included (LevelDB: 7).
    pub max_levels: usize,
    /// Compaction output tables are cut at this size (LevelDB: 2 MiB).
    pub target_file_size: u64,
    /// SSTable data block size.
    pub block_size: usize,
    /// Bloom filter bits per key.
    pub bloom_bits_per_key: u32,
    /// Block cache bytes.
    pub block_cache_size: u64,
    /// fsync the WAL after every batch.
    pub sync_wal: bool,
    /// Flush and compact on a background thread (false: in the writing thread).
    pub background: bool,
    /// What open does with damaged WAL records.
    pub wal_recovery: crate::format::log::WalRecovery,
    /// Where open reports the WAL ranges it dropped.
    pub recovery_log: crate::format::log::RecoveryLog,
}

impl Default for LsmOptions {
    fn default() -> Self {
        Self {
            memtable_size: 4 << 20,
            l0_compaction_trigger: 4,
            l0_stop_writes: 12,
            level1_size: 10 << 20,
            fanout: 10,
            max_levels: 7,
            target_file_size: 2 << 20,
            block_size: 4096,
            bloom_bits_per_key: 10,
            block_cache_size: 8 << 20,
            sync_wal: false,
            background: true,
            wal_recovery: Default::default(),
            recovery_log: Default::default(),
        }
    }
}

#[derive(Debug)]
struct MemState {
    active: Arc<Mem>,
    imm: Option<Arc<Mem>>,
}

/// A table of the current version.
#[derive(Debug)]
struct TFile {
    number: u64,
    meta: FileMeta,
    table: Arc<Table>,
    /// LevelDB's seek allowance: reads charged to this table (see "Seek compaction" in the
    /// module docs) before it is due for compaction. Starts at one per `SEEK_BYTES` of
    /// table, at least `MIN_SEEKS`; a table made by a trivial move starts afresh.
    allowed_seeks: AtomicI64,
    /// Set once a compaction (or a trivial move) took the table out of the current
    /// version: reads through an older view (a snapshot's) no longer charge it.
    removed: AtomicBool,
}

/// Bytes of table per allowed seek (LevelDB's 16 KiB). LevelDB's argument: a seek costs
/// about 10 ms, and compacting 1 MiB does about 25 MiB of I/O (the next level's
/// overlapping tables read and rewritten) at 100 MB/s, so a seek costs what compacting
/// ~40 KiB does; allowing one per 16 KiB errs towards compacting.
const SEEK_BYTES: u64 = 16 << 10;
/// Least allowed seeks of a table (LevelDB: 100).
const MIN_SEEKS: u64 = 100;

impl TFile {
    fn new(number: u64, meta: FileMeta, table: Arc<Table>) -> Arc<TFile> {
        let allowed = (meta.size / SEEK_BYTES).max(MIN_SEEKS);
        Arc::new(TFile {
            number,
            meta,
            table,
            allowed_seeks: AtomicI64::new(allowed as i64),
            removed: AtomicBool::new(false),
        })
    }
}

/// The table whose seek allowance ran out, shared by every version of one tree.
#[derive(Debug, Default)]
struct SeekDue {
    /// [`pack_due`] of the table due, 0 for none (table numbers start at 1).
    due: AtomicU64,
    /// Set when `due` is: the next [`Lsm::wake_for_seeks`] signals the compaction thread.
    fresh: AtomicBool,
}

/// `due`'s encoding of table `number` at `level`: the level in the top 8 bits (table
/// numbers stay far below 2^56).
fn pack_due(level: usize, number: u64) -> u64 {
    (level as u64) << 56 | (number & ((1 << 56) - 1))
}

/// (level, table number) of a [`pack_due`] value.
fn unpack_due(packed: u64) -> (usize, u64) {
    ((packed >> 56) as usize, packed & ((1 << 56) - 1))
}

/// The tables readers see: level 0 newest first, levels 1.. by smallest key.
#[derive(Debug, Default, Clone)]
struct Levels {
    levels: Vec<Vec<Arc<TFile>>>,
    /// Shared by the versions (a clone keeps it): the seek compaction due, if any.
    seek: Arc<SeekDue>,
}

impl Levels {
    /// Every table whose key range holds `key`, in the order a point read searches them:
    /// level 0 newest first, then the one table per deeper level.
    fn holding<'a>(&'a self, key: &'a [u8]) -> impl Iterator<Item = (usize, &'a Arc<TFile>)> + 'a {
        let l0 = self.levels.first().into_iter().flatten().map(|f| (0, f));
        let l0 = l0.filter(move |(_, f)| key >= f.meta.smallest.as_slice() && key <= f.meta.largest.as_slice());
        let deeper = self.levels.iter().enumerate().skip(1).filter_map(move |(l, lvl)| {
            let i = lvl.partition_point(|f| f.meta.largest.as_slice() < key);
            lvl.get(i).filter(|f| f.meta.smallest.as_slice() <= key).map(|f| (l, f))
        });
        l0.chain(deeper)
    }

    /// Charge one seek to table `f` of level `l`; once its allowance is spent it becomes
    /// the seek compaction due, unless another table already is: then it tries again at
    /// each of its next charges (as LevelDB's), until it is picked. A table no longer in
    /// the current version (read through a snapshot's older view) is not charged: it
    /// cannot be compacted, and would only keep waking the compaction thread.
    fn charge(&self, l: usize, f: &TFile) {
        if f.removed.load(Ordering::Relaxed) {
            return;
        }
        let before = f.allowed_seeks.fetch_sub(1, Ordering::Relaxed);
        if before <= 1 && self.seek.due.load(Ordering::Relaxed) == 0 {
            let packed = pack_due(l, f.number);
            if self.seek.due.compare_exchange(0, packed, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                self.seek.fresh.store(true, Ordering::Release);
            }
        }
    }

    fn bytes(&self, l: usize) -> u64 {
        self.levels.get(l).map_or(0, |v| v.iter().map(|f| f.meta.size).sum())
    }

    /// Tables of level `l` (≥ 1) overlapping `[lo, hi]`.
    fn overlapping(&self, l: usize, lo: &[u8], hi: &[u8]) -> Vec<Arc<TFile>> {
        self.levels
            .get(l)
            .map(|v| {
                v.iter()
                    .filter(|f| f.meta.smallest.as_slice() <= hi && f.meta.largest.as_slice() >= lo)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[derive(Debug)]
struct VersionState {
    version: Version,
    manifest: Manifest,
}

#[derive(Debug)]
struct Writer {
    wal: Box<dyn FsFile>,
    gen: u64,
}

#[derive(Debug, Default)]
struct Work {
    pending: bool,
    stop: bool,
}

/// Figures reported in the owner's `Stats::design` (prefix `lsm_`).
#[derive(Debug, Default)]
pub struct LsmCounters {
    /// MemTables flushed.
    pub flushes: AtomicU64,
    /// Compactions run (trivial moves included).
    pub compactions: AtomicU64,
    /// Compactions that only moved a table down a level.
    pub trivial_moves: AtomicU64,
    /// Table bytes read by compactions.
    pub compact_read: AtomicU64,
    /// Table bytes written by compactions.
    pub compact_written: AtomicU64,
    /// Tombstones dropped by compactions.
    pub tombstones_dropped: AtomicU64,
    /// Times a writer waited for a flush or for level 0 to shrink.
    pub write_stalls: AtomicU64,
    /// Entries written by [`Lsm::ingest`].
    pub ingested: AtomicU64,
    /// Compactions picked because a table's seek allowance ran out (counted in
    /// `compactions` too when they run).
    pub seek_compactions: AtomicU64,
}

/// A picked compaction.
#[derive(Debug)]
struct Job {
    level: usize,
    inputs: Vec<Arc<TFile>>,
    below: Vec<Arc<TFile>>,
}

/// Most bytes of WAL records one group commit appends (LevelDB's 1 MiB).
const MAX_GROUP_BYTES: usize = 1 << 20;

/// One writer's WAL record in the commit queue.
#[derive(Debug)]
struct Record {
    /// The framed record.
    bytes: Vec<u8>,
    /// Fsync the WAL after it.
    sync: bool,
    /// Set by the leader once the record is in the WAL: the MemTable of that WAL, with
    /// this writer counted on it ([`Mem::add_writers`]); the writer inserts its own
    /// operations into it after its turn.
    mem: std::sync::OnceLock<Arc<Mem>>,
}

/// The leveled LSM tree. See the module docs.
pub struct Lsm {
    fs: CountingFs,
    dir: PathBuf,
    opts: LsmOptions,
    writer: Mutex<Writer>,
    /// Writers queued for the WAL ([`Lsm::write`]).
    commits: crate::group::Queue<Record>,
    mem: RwLock<MemState>,
    current: RwLock<Arc<Levels>>,
    /// The versions' shared seek-compaction state (read without the `current` lock).
    seek: Arc<SeekDue>,
    version: Mutex<VersionState>,
    cache: Arc<BlockCache>,
    /// Serialises flushes and compactions (one background job at a time, as LevelDB).
    job: Mutex<Vec<Vec<u8>>>,
    work: Mutex<Work>,
    work_cv: Condvar,
    done_mu: Mutex<()>,
    done_cv: Condvar,
    poison: Arc<Poison>,
    /// The owner's shutdown token: compactions stop at their safe points once it is set.
    cancel: Arc<Cancel>,
    /// Counters.
    pub counters: LsmCounters,
    worker: Mutex<Option<JoinHandle<()>>>,
    before_durable: RwLock<Option<DurableHook>>,
    commit_hook: RwLock<Option<CommitHook>>,
}

/// Called with `true` before a MANIFEST commit is appended and `false` once it is durable,
/// so the owner can tell a torn last record (a crash during the commit) from damage.
pub type CommitHook = Arc<dyn Fn(bool) -> Result<()> + Send + Sync>;

/// Called before the LSM makes WAL records or tables durable (a WAL fsync, a flush): the
/// owner syncs what they point at (HoaKV: its cold value-log files).
pub type DurableHook = Arc<dyn Fn() -> Result<()> + Send + Sync>;

impl std::fmt::Debug for Lsm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lsm").field("dir", &self.dir).finish()
    }
}

/// The tables of one version of the tree, pinned: each `Arc<Table>` keeps its file
/// readable after a compaction removed it, so a reader holding a view sees the tables as
/// they were when it was taken, for as long as it likes, without blocking compactions.
/// (The MemTables are not part of it: [`Lsm::ingest`] users never write through them.)
#[derive(Clone, Debug)]
pub struct TablesView(Arc<Levels>);

impl TablesView {
    /// The newest entry of `key` in the view's tables: `Some(None)` for a tombstone,
    /// `None` when absent. Bloom filters first; at most one table per level ≥ 1.
    ///
    /// A read that searches a second table charges one seek to the first it searched
    /// (LevelDB's rule; "Seek compaction" in the module docs).
    pub fn get(&self, key: &[u8]) -> Result<Option<Option<Vec<u8>>>> {
        let cur = &self.0;
        let mut first = None;
        for (n, (l, f)) in cur.holding(key).enumerate() {
            match (n, first) {
                (0, _) => first = Some((l, f)),
                (1, Some((l0, f0))) => cur.charge(l0, f0),
                _ => {}
            }
            if let Some(e) = f.table.get_cached(key)? {
                return Ok(Some(kind_value(e)));
            }
        }
        Ok(None)
    }

    /// LevelDB's read sampling for range reads (`Version::RecordReadSample`): when two or
    /// more tables hold `key` in their ranges, charge a seek to the first. An iterator
    /// calls it about once per MiB it returns ([`ReadSampler`]).
    pub fn record_read_sample(&self, key: &[u8]) {
        let cur = &self.0;
        let mut tables = cur.holding(key);
        if let (Some((l, f)), Some(_)) = (tables.next(), tables.next()) {
            cur.charge(l, f);
        }
    }

    /// The tables named by the MANIFEST in `dir`, opened read-only (tools that salvage a
    /// store: nothing is created, removed or rewritten). A torn last MANIFEST record is
    /// dropped; tables that fail to open are reported to `lost` and left out.
    pub fn read_only(fs: &dyn Fs, dir: &Path, lost: &mut dyn FnMut(&Path, String)) -> Result<TablesView> {
        let (version, _, _) = Manifest::recover(fs, dir)?;
        let cache = BlockCache::new(1 << 20);
        let levels_n = version.files.values().map(|m| m.level as usize + 1).max().unwrap_or(0).max(2);
        let mut levels = Levels { levels: vec![Vec::new(); levels_n], seek: Arc::default() };
        for (&n, m) in &version.files {
            let path = dir.join(table_name(n));
            match Table::open_cached(fs, &path, n, &cache) {
                Ok(table) => {
                    if let Some(l) = levels.levels.get_mut(m.level as usize) {
                        l.push(TFile::new(n, m.clone(), table));
                    }
                }
                Err(e) => lost(&path, e.to_string()),
            }
        }
        sort_levels(&mut levels);
        Ok(TablesView(Arc::new(levels)))
    }

    /// No table at all.
    pub fn is_empty(&self) -> bool {
        self.0.levels.iter().all(Vec::is_empty)
    }

    /// Entries of the view's tables (tombstones and copies shadowed by newer tables
    /// included: an upper bound of the keys they hold).
    pub fn entries(&self) -> u64 {
        self.0.levels.iter().flatten().map(|f| f.meta.total).sum()
    }

    /// Tables in the view.
    pub fn tables(&self) -> usize {
        self.0.levels.iter().map(Vec::len).sum()
    }

    /// Bytes of the view's tables.
    pub fn bytes(&self) -> u64 {
        (0..self.0.levels.len()).map(|l| self.0.bytes(l)).sum()
    }

    /// DRAM the view's tables hold for their index blocks and bloom filters.
    pub fn dram_bytes(&self) -> u64 {
        self.0.levels.iter().flatten().map(|f| f.table.dram_bytes()).sum()
    }

    /// The view's tables as internal iterators, newest first (level-0 tables newest
    /// first, then one concatenating iterator per level ≥ 1); merged, newest wins.
    pub fn sources(&self) -> Vec<BoxedIter> {
        let cur = &self.0;
        let mut out: Vec<BoxedIter> = Vec::new();
        for f in cur.levels.first().into_iter().flatten() {
            out.push(Box::new(TableIter::new(f.table.clone(), true)));
        }
        for l in 1..cur.levels.len() {
            if !cur.levels[l].is_empty() {
                out.push(Box::new(LevelIter::new(cur.clone(), l)));
            }
        }
        out
    }
}

/// Decides when a range read samples the key it returned (LevelDB's `DBIter`): about
/// once per MiB of keys and values, at a random period in [0, 2 MiB) so that scans of
/// one shape do not always sample the same keys. The owner then calls
/// [`Lsm::record_read_sample`].
#[derive(Debug)]
pub struct ReadSampler {
    left: i64,
    rng: rand::rngs::SmallRng,
}

/// Mean bytes returned between two read samples (LevelDB's `kReadBytesPeriod`).
const READ_SAMPLE_BYTES: u64 = 1 << 20;

impl Default for ReadSampler {
    fn default() -> Self {
        use rand::{Rng, SeedableRng};
        // Seeded from the thread's generator (seeded once per thread): no system call per
        // iterator.
        let mut rng = rand::rngs::SmallRng::from_rng(&mut rand::rng());
        let left = rng.random_range(0..2 * READ_SAMPLE_BYTES) as i64;
        ReadSampler { left, rng }
    }
}

impl ReadSampler {
    /// Count an entry of `bytes` (key and value) returned; true when its key is to be
    /// sampled.
    pub fn returned(&mut self, bytes: usize) -> bool {
        use rand::Rng;
        self.left -= bytes as i64;
        if self.left >= 0 {
            return false;
        }
        while self.left < 0 {
            self.left += self.rng.random_range(0..2 * READ_SAMPLE_BYTES) as i64;
        }
        true
    }
}

/// File name of table `n`.
pub fn table_name(n: u64) -> String {
    format!("{n:06}.sst")
}

fn table_number(name: &str) -> Option<u64> {
    name.strip_suffix(".sst")?.parse().ok()
}

impl Lsm {
    /// Open (or create, when `fresh`) the LSM in `dir`. Returns it with the WAL batches
    /// not yet flushed, oldest first, which the caller filters and hands to
    /// [`Lsm::finish_recovery`] before any write. The WAL files are fsynced here, so what
    /// the caller saw stays durable.
    ///
    /// `torn_ok` is asked when the MANIFEST's last record is torn: true when a commit was
    /// in flight (see [`CommitHook`]) and the record is dropped, false when it is damage
    /// ([`Error::Corruption`]).
    pub fn open(
        fs: CountingFs,
        dir: &Path,
        opts: LsmOptions,
        fresh: bool,
        poison: Arc<Poison>,
        cancel: Arc<Cancel>,
        torn_ok: &dyn Fn() -> bool,
    ) -> Result<(Lsm, Vec<wal::Batch>)> {
        let (version, manifest) = if fresh {
            let v = Version { next_file: 1, ..Version::default() };
            let m = Manifest::create(&fs, dir, 1, &v)?;
            (v, m)
        } else {
            if !Manifest::exists(&fs, dir) {
                return Err(Error::corruption(dir.join("CURRENT"), 0, "the store's MANIFEST is missing"));
            }
            let (v, number, torn) = Manifest::recover(&fs, dir)?;
            if torn && !torn_ok() {
                return Err(Error::corruption(
                    dir.join(Manifest::name(number)),
                    0,
                    "the MANIFEST's last record is damaged (no commit was in flight)",
                ));
            }
            let m = Manifest::create(&fs, dir, number + 1, &v)?;
            let _ = fs.remove(&dir.join(Manifest::name(number)));
            (v, m)
        };
        let cache = BlockCache::new(opts.block_cache_size);
        let mut levels = Levels { levels: vec![Vec::new(); opts.max_levels.max(2)], seek: Arc::default() };
        for (&n, m) in &version.files {
            let l = m.level as usize;
            if l >= levels.levels.len() {
                return Err(Error::corruption(
                    dir.join(Manifest::name(manifest.number())),
                    0,
                    format!("table {n} at level {l}: the store has {} levels", levels.levels.len()),
                ));
            }
            let path = dir.join(table_name(n));
            if !fs.exists(&path) {
                return Err(Error::corruption(&path, 0, "a table the MANIFEST names is missing"));
            }
            let table = Table::open_cached(&fs, &path, n, &cache)?;
            levels.levels[l].push(TFile::new(n, m.clone(), table));
        }
        sort_levels(&mut levels);
        // Leftover tables and WALs.
        let mut wals = Vec::new();
        for name in fs.list(dir)? {
            if let Some(n) = table_number(&name) {
                if !version.files.contains_key(&n) {
                    fs.remove(&dir.join(&name))?;
                }
            } else if let Some(g) = wal::number(&name) {
                if g <= version.counter {
                    fs.remove(&dir.join(&name))?;
                } else {
                    wals.push(g);
                }
            }
        }
        wals.sort_unstable();
        // Only the newest WAL was being appended to; the older ones were synced whole
        // before the next one started.
        let mut batches = Vec::new();
        let paths: Vec<_> = wals.iter().map(|&g| dir.join(wal::name(g))).collect();
        crate::format::log::replay_logs(
            &fs,
            &paths,
            opts.wal_recovery,
            true,
            &opts.recovery_log,
            |p, off, payload| {
                batches.push(wal::decode(payload).map_err(|d| Error::corruption(p, off, d))?);
                Ok(())
            },
        )?;
        for path in &paths {
            fs.open(path)?.sync()?;
        }
        let gen = wals.last().copied().unwrap_or(version.counter).max(version.counter) + 1;
        let wal_path = dir.join(wal::name(gen));
        let wal_file = crate::fs::create_log(&fs, &wal_path)?;
        fs.sync_dir(dir)?;
        let lsm = Lsm {
            fs,
            dir: dir.to_path_buf(),
            writer: Mutex::new(Writer { wal: wal_file, gen }),
            commits: crate::group::Queue::default(),
            mem: RwLock::new(MemState { active: Arc::new(Mem::new(gen)), imm: None }),
            seek: levels.seek.clone(),
            current: RwLock::new(Arc::new(levels)),
            version: Mutex::new(VersionState { version, manifest }),
            cache,
            job: Mutex::new(vec![Vec::new(); opts.max_levels.max(2)]),
            work: Mutex::new(Work::default()),
            work_cv: Condvar::new(),
            done_mu: Mutex::new(()),
            done_cv: Condvar::new(),
            poison,
            cancel,
            counters: LsmCounters::default(),
            worker: Mutex::new(None),
            before_durable: RwLock::new(None),
            commit_hook: RwLock::new(None),
            opts,
        };
        Ok((lsm, batches))
    }

    /// Flush the recovered operations `ops` (in order; later ones win) to a level-0 table,
    /// commit it with every recovered WAL generation, remove those WALs, and start the
    /// background thread. Call once, after [`Lsm::open`], before any write.
    pub fn finish_recovery(self: &Arc<Self>, ops: Vec<wal::Op>) -> Result<()> {
        let gen = self.writer.lock().gen;
        if !ops.is_empty() {
            let m = Mem::new(gen - 1);
            for (k, v) in &ops {
                m.insert(k, v.as_deref());
            }
            self.mem.write().imm = Some(Arc::new(m));
            self.flush_imm()?;
        } else if self.version.lock().version.counter < gen - 1 {
            self.commit(vec![Edit::Counter(gen - 1)])?;
        }
        for name in self.fs.list(&self.dir)? {
            if wal::number(&name).is_some_and(|g| g < gen) {
                self.fs.remove(&self.dir.join(&name))?;
            }
        }
        self.maybe_compact_inline()?;
        if self.opts.background {
            let me = self.clone();
            let h = std::thread::Builder::new().name("tierkv-lsm".into()).spawn(move || me.worker_loop())?;
            *self.worker.lock() = Some(h);
            self.signal();
        }
        Ok(())
    }

    /// Install the hook run around MANIFEST commits. Call before [`Lsm::finish_recovery`].
    pub fn set_commit_hook(&self, f: CommitHook) {
        *self.commit_hook.write() = Some(f);
    }

    /// Install the hook run before WAL syncs and flushes. Call before
    /// [`Lsm::finish_recovery`].
    pub fn set_before_durable(&self, f: DurableHook) {
        *self.before_durable.write() = Some(f);
    }

    fn prepare_durable(&self) -> Result<()> {
        let h = self.before_durable.read().clone();
        match h {
            Some(f) => f(),
            None => Ok(()),
        }
    }

    fn maybe_compact_inline(&self) -> Result<()> {
        if !self.opts.background {
            while self.compact_once()? {}
        }
        Ok(())
    }

    fn signal(&self) {
        self.work.lock().pending = true;
        self.work_cv.notify_all();
    }

    fn worker_loop(self: Arc<Self>) {
        loop {
            {
                let mut w = self.work.lock();
                while !w.pending && !w.stop {
                    self.work_cv.wait(&mut w);
                }
                if w.stop {
                    return;
                }
                w.pending = false;
            }
            if self.poison.is_set() {
                self.done_cv.notify_all();
                return;
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<()> {
                self.flush_imm()?;
                while !self.work.lock().stop && self.compact_once()? {
                    if self.mem.read().imm.is_some() {
                        self.flush_imm()?;
                    }
                }
                Ok(())
            }));
            match r {
                Ok(r) => self.cancel.poison_failure(&self.poison, "background LSM flush/compaction", &r),
                Err(_) => self.poison.set("background LSM flush/compaction panicked".into()),
            }
            self.done_cv.notify_all();
        }
    }

    /// Stop the background thread: cancel its current job (the owner's token) and wait
    /// for it to stop at its next safe point.
    pub fn stop(&self) {
        self.cancel.cancel();
        self.work.lock().stop = true;
        self.work_cv.notify_all();
        if let Some(h) = self.worker.lock().take() {
            let _ = h.join();
        }
    }

    /// Append `ops` as one batch with sequence number `seq` (fsynced with `sync_wal` or
    /// `sync`), then apply it to the MemTable.
    ///
    /// Writers of different keys may call this concurrently: it is LevelDB's group commit
    /// ([`crate::group`]) for the WAL, and RocksDB's concurrent MemTable writes for the
    /// rest. Each writer encodes its record before queueing; the leader takes the writer
    /// lock once for the queued records (up to [`MAX_GROUP_BYTES`]), appends them with one
    /// `write` (and one `fsync` if any asks for it), and — still under the writer lock —
    /// hands every member of the group the active MemTable, counted as a pending writer on
    /// it (`mem::Mem::add_writers`). Then the queue moves on, and each writer inserts its *own*
    /// operations into that MemTable (a lock-free skiplist) in parallel with the others and
    /// with the next group's WAL append. A MemTable switch happens under the writer lock,
    /// so a batch always lands in the MemTable of the WAL it was appended to; the flush
    /// waits until that MemTable's pending writers are done (`mem::Mem::wait_writers`) before
    /// it reads it, so no batch whose WAL a flush removes is missing from its table.
    /// Writes of *one* key must be ordered by the caller (their WAL order is then their
    /// MemTable order: a writer returns only after its insert).
    ///
    /// Visibility: the LSM's reads have no sequence-number snapshot — a read returns the
    /// newest version of a key that is in a MemTable — so what must hold is that a write is
    /// readable once `write` returns, and that a read never sees a write that is not in the
    /// WAL (a crash could lose it). Both hold: a writer inserts only after the leader's
    /// append (and fsync, when asked) and returns after its insert. The writes of one group
    /// are concurrent (none was acknowledged before another was submitted), so no order
    /// among them is owed to a reader; a batch's own operations become visible one by one,
    /// as they did when the leader inserted them (the callers that need a batch atomic
    /// to readers — HoaKV — serialise the keys' writers and readers themselves).
    pub fn write(&self, seq: u64, ops: &[(&[u8], Option<&[u8]>)], sync: bool) -> Result<()> {
        self.poison.check()?;
        let rec = Record {
            bytes: wal::encode_framed(seq, ops),
            sync: sync || self.opts.sync_wal,
            mem: std::sync::OnceLock::new(),
        };
        let joins = |g: &[Arc<crate::group::Entry<Record>>], next: &Record| {
            g.iter().map(|e| e.item.bytes.len()).sum::<usize>() + next.bytes.len() <= MAX_GROUP_BYTES
        };
        let (r, me) = self.commits.submit_keep(rec, joins, |g| match self.write_group(g) {
            Ok(()) => g.iter().map(|_| Ok(true)).collect(),
            Err(e) => g.iter().map(|_| Err(e.duplicate())).collect(),
        });
        if let Some(mem) = me.item.mem.get() {
            // The claim is released after the inserts (or if one panics), never before.
            let claim = mem::WriterClaim(mem.clone());
            if r.is_ok() {
                for (k, v) in ops {
                    claim.0.insert(k, *v);
                }
            }
            drop(claim);
        }
        r.map(|_| ())
    }

    /// The leader's part of [`Lsm::write`] for `group`: the WAL append, and each member
    /// handed the MemTable to insert into.
    fn write_group(&self, group: &[Arc<crate::group::Entry<Record>>]) -> Result<()> {
        let mut w = self.writer.lock();
        self.make_room(&mut w)?;
        let sync = group.iter().any(|e| e.item.sync);
        if sync {
            self.prepare_durable()?;
        }
        let joined;
        let bytes: &[u8] = match group {
            [one] => &one.item.bytes,
            _ => {
                joined = group.iter().flat_map(|e| e.item.bytes.iter().copied()).collect::<Vec<u8>>();
                &joined
            }
        };
        if let Err(e) = w.wal.append(bytes).and_then(|_| if sync { w.wal.sync() } else { Ok(()) }) {
            self.poison.set(format!("WAL write failed: {e}"));
            return Err(e.into());
        }
        // Counted before the writer lock is released: a switch (under that lock) that
        // makes this MemTable immutable happens after the count, so its flush waits.
        let mem = self.mem.read().active.clone();
        mem.add_writers(group.len());
        for e in group {
            if e.item.mem.set(mem.clone()).is_err() {
                // A record is in one group only; never reached. Uncount it so no flush
                // waits for an insert that will not come.
                drop(mem::WriterClaim(mem.clone()));
            }
        }
        drop(w);
        Ok(())
    }

    /// Before a write: rotate a full MemTable, wait while level 0 is too deep.
    fn make_room(&self, w: &mut Writer) -> Result<()> {
        loop {
            let l0 = self.current.read().levels[0].len();
            // Once stopped, nothing compacts level 0: the write goes on past the limit.
            if self.opts.background && l0 >= self.opts.l0_stop_writes && !self.stopped() {
                self.counters.write_stalls.fetch_add(1, Ordering::Relaxed);
                self.wait_background()?;
                continue;
            }
            if self.mem.read().active.bytes.load(Ordering::Relaxed) < self.opts.memtable_size {
                return Ok(());
            }
            return self.rotate(w);
        }
    }

    /// The background thread was told to stop ([`Lsm::stop`], close, drop).
    fn stopped(&self) -> bool {
        self.work.lock().stop
    }

    /// Wait for the background thread to flush the Immutable MemTable — or, once it is
    /// stopped and will flush nothing, flush it here, as the thread would (a poisoned tree
    /// refuses; a failure poisons it).
    fn wait_or_flush(&self) -> Result<()> {
        if !self.stopped() {
            return self.wait_background();
        }
        self.poison.check()?;
        let r = self.flush_imm();
        self.cancel.poison_failure(&self.poison, "LSM flush after stop", &r);
        r
    }

    fn wait_background(&self) -> Result<()> {
        let mut g = self.done_mu.lock();
        self.signal();
        self.done_cv.wait_for(&mut g, std::time::Duration::from_millis(20));
        drop(g);
        self.poison.check()
    }

    /// Make the MemTable immutable and start a new one with a new WAL.
    fn rotate(&self, w: &mut Writer) -> Result<()> {
        if self.mem.read().imm.is_some() {
            if self.opts.background {
                self.counters.write_stalls.fetch_add(1, Ordering::Relaxed);
                while self.mem.read().imm.is_some() {
                    // Once stopped, the background thread flushes nothing: flush here
                    // rather than wait for ever.
                    self.wait_or_flush()?;
                }
            } else {
                self.flush_imm()?;
            }
        }
        let gen = w.gen + 1;
        let wal = crate::fs::create_log(&self.fs, &self.dir.join(wal::name(gen)))?;
        if self.opts.sync_wal {
            self.fs.sync_dir(&self.dir)?;
        }
        // The old WAL's tail must be durable before the new one can hold later batches
        // that recovery would replay without it.
        self.prepare_durable()?;
        if let Err(e) = w.wal.sync() {
            self.poison.set(format!("WAL sync failed: {e}"));
            return Err(e.into());
        }
        w.wal = wal;
        w.gen = gen;
        {
            let mut m = self.mem.write();
            let old = std::mem::replace(&mut m.active, Arc::new(Mem::new(gen)));
            m.imm = Some(old);
        }
        if self.opts.background {
            self.signal();
        } else {
            self.flush_imm()?;
            self.maybe_compact_inline()?;
        }
        Ok(())
    }

    /// The newest entry of `key`: `Some(None)` for a tombstone, `None` when absent.
    pub fn get(&self, key: &[u8]) -> Result<Option<Option<Vec<u8>>>> {
        {
            let m = self.mem.read();
            if let Some(v) = m.active.get(key) {
                return Ok(Some(v));
            }
            if let Some(v) = m.imm.as_ref().and_then(|imm| imm.get(key)) {
                return Ok(Some(v));
            }
        }
        let r = self.tables().get(key);
        self.wake_for_seeks();
        r
    }

    /// Charge a range read's sampled key to the current version's tables
    /// ([`TablesView::record_read_sample`]) and wake the compaction thread if a table's
    /// allowance ran out.
    pub fn record_read_sample(&self, key: &[u8]) {
        self.tables().record_read_sample(key);
        self.wake_for_seeks();
    }

    /// Wake the compaction thread when a read ran a table's seek allowance out (reads
    /// through a [`TablesView`] charge it; their owner calls this after them). One
    /// relaxed load when nothing is due.
    pub fn wake_for_seeks(&self) {
        let seek = &self.seek;
        if seek.fresh.load(Ordering::Relaxed) && seek.fresh.swap(false, Ordering::AcqRel) && self.opts.background {
            self.signal();
        }
    }

    /// The tables of the current version, pinned (see [`TablesView`]).
    pub fn tables(&self) -> TablesView {
        TablesView(self.current.read().clone())
    }

    /// Write `entries` (sorted by key, keys distinct; `None` is a tombstone) as one new
    /// level-0 table and commit it: the table is fsynced, then named in the MANIFEST (the
    /// commit point), then installed as the newest table, so it shadows every older one.
    /// No WAL and no MemTable are involved (the caller's own log holds the entries until
    /// this returns). Returns the entries written. Runs under the job lock, so it waits
    /// for a running flush or compaction; a background compaction is signalled after.
    pub fn ingest(&self, entries: &mut dyn Iterator<Item = Result<(Vec<u8>, Option<Vec<u8>>)>>) -> Result<u64> {
        self.poison.check()?;
        let job = self.job.lock();
        let n = self.next_number();
        let mut b = self.new_builder(n)?;
        let mut count = 0u64;
        let mut last: Option<Vec<u8>> = None;
        for e in entries {
            let (k, v) = e?;
            if last.as_ref().is_some_and(|l| *l >= k) {
                return Err(Error::InvalidArgument("ingested entries must be sorted by key, keys distinct".into()));
            }
            match &v {
                Some(v) => b.add(Kind::Put, &k, v)?,
                None => b.add(Kind::Delete, &k, &[])?,
            }
            count += 1;
            last = Some(k);
        }
        if count == 0 {
            drop(b);
            let _ = self.fs.remove(&self.dir.join(table_name(n)));
            return Ok(0);
        }
        let meta = b.finish()?;
        self.fs.sync_dir(&self.dir)?;
        let fm = FileMeta {
            total: meta.entries,
            live: meta.entries,
            size: meta.size,
            smallest: meta.smallest,
            largest: meta.largest,
            level: 0,
        };
        let next = self.version.lock().version.next_file;
        // From the MANIFEST record on, a failure leaves the durable table set and the one
        // in memory possibly apart (a table named on disk but not read here would shadow
        // newer copies at the next open): the tree is poisoned, no further change lands.
        let installed = self.commit(vec![Edit::AddFile(n, fm.clone()), Edit::NextFile(next)]).and_then(|()| {
            let t = self.open_table(n, fm)?;
            let mut levels = (**self.current.read()).clone();
            levels.levels[0].insert(0, t);
            *self.current.write() = Arc::new(levels);
            Ok(())
        });
        if let Err(e) = installed {
            self.poison.set(format!("an ingested table could not be committed and installed: {e}"));
            return Err(e);
        }
        self.counters.ingested.fetch_add(count, Ordering::Relaxed);
        drop(job);
        if self.opts.background {
            self.signal();
        } else {
            self.maybe_compact_inline()?;
        }
        Ok(count)
    }

    /// The sources of the tree, newest first, each an [`InternalIterator`]: the MemTable,
    /// the Immutable MemTable, each level-0 table (newest first), then one concatenating
    /// iterator per non-empty level ≥ 1. Merged (newest wins), they are the tree's contents;
    /// tombstones show as `None`. See [`Lsm::iter`] for what is pinned.
    pub fn sources(&self) -> Vec<BoxedIter> {
        // The MemTables before the levels: a flush installs its table before it drops the
        // Immutable MemTable, so every entry is in one of the two (possibly both).
        let (active, imm) = {
            let m = self.mem.read();
            (m.active.clone(), m.imm.clone())
        };
        let tables = self.tables().sources();
        let mut out: Vec<BoxedIter> = Vec::with_capacity(2 + tables.len());
        out.push(Box::new(MemIter::new(active)));
        if let Some(imm) = imm {
            out.push(Box::new(MemIter::new(imm)));
        }
        out.extend(tables);
        out
    }

    /// A cursor over the whole tree: [`Lsm::sources`] merged, newest first. It pins the
    /// MemTables (`Arc`) and the version's tables (the `Arc<Levels>` taken now, whose
    /// `Arc<Table>`s keep files readable after a compaction removes them); it holds no lock
    /// between calls. The active MemTable is read live (entries written later may show).
    pub fn iter(&self) -> MergingIterator {
        MergingIterator::new(self.sources())
    }

    /// Flush the MemTable now and wait for it (and, with `compact`, run every compaction
    /// whose score is ≥ 1).
    pub fn flush(&self, compact: bool) -> Result<()> {
        {
            let mut w = self.writer.lock();
            if self.mem.read().active.bytes.load(Ordering::Relaxed) > 0 {
                self.rotate(&mut w)?;
            }
        }
        if self.opts.background {
            while self.mem.read().imm.is_some() {
                self.wait_or_flush()?;
            }
        } else {
            self.flush_imm()?;
        }
        if compact {
            while self.compact_once()? {}
        }
        Ok(())
    }

    /// Compact everything down: flush, then compact every level with data into the next
    /// until one level holds all tables.
    pub fn compact_all(&self) -> Result<()> {
        self.flush(true)?;
        loop {
            // Pick and run under the job lock: a job picked from a version another
            // compaction has since changed would re-add or re-merge tables it removed.
            let mut pointers = self.job.lock();
            let cur = self.current.read().clone();
            let nonempty: Vec<usize> = (0..cur.levels.len()).filter(|&l| !cur.levels[l].is_empty()).collect();
            if nonempty.len() <= 1 && cur.levels[0].is_empty() {
                return Ok(());
            }
            let Some(&l) = nonempty.first() else { return Ok(()) };
            if l + 1 >= cur.levels.len() {
                return Ok(());
            }
            let inputs = cur.levels[l].clone();
            let (lo, hi) = range_of(&inputs);
            let below = cur.overlapping(l + 1, &lo, &hi);
            self.run_job(&mut pointers, Job { level: l, inputs, below })?;
        }
    }

    fn commit(&self, edits: Vec<Edit>) -> Result<()> {
        let hook = self.commit_hook.read().clone();
        let mut vs = self.version.lock();
        let mut after = vs.version.clone();
        after.apply(&edits);
        if let Some(h) = &hook {
            h(true)?;
        }
        let VersionState { manifest, .. } = &mut *vs;
        manifest.log(&self.fs, &edits, &after)?;
        vs.version = after;
        if let Some(h) = &hook {
            h(false)?;
        }
        Ok(())
    }

    fn next_number(&self) -> u64 {
        let mut vs = self.version.lock();
        let n = vs.version.next_file;
        vs.version.next_file += 1;
        n
    }

    fn new_builder(&self, n: u64) -> Result<TableBuilder> {
        TableBuilder::create(
            &self.fs,
            &self.dir.join(table_name(n)),
            self.opts.block_size,
            self.opts.bloom_bits_per_key,
        )
    }

    fn open_table(&self, n: u64, meta: FileMeta) -> Result<Arc<TFile>> {
        let table = Table::open_cached(&self.fs, &self.dir.join(table_name(n)), n, &self.cache)?;
        Ok(TFile::new(n, meta, table))
    }

    /// Flush the Immutable MemTable (if any) to a level-0 table.
    fn flush_imm(&self) -> Result<()> {
        let _job = self.job.lock();
        let Some(imm) = self.mem.read().imm.clone() else { return Ok(()) };
        // Writers whose batches are in this MemTable's WAL insert them after the switch.
        imm.wait_writers();
        self.prepare_durable()?;
        let mut added = Vec::new();
        if !imm.is_empty() {
            let n = self.next_number();
            let mut b = self.new_builder(n)?;
            imm.for_each_newest(|k, v| match v {
                Some(v) => b.add(Kind::Put, k, v),
                None => b.add(Kind::Delete, k, &[]),
            })?;
            let meta = b.finish()?;
            self.fs.sync_dir(&self.dir)?;
            let fm = FileMeta {
                total: meta.entries,
                live: meta.entries,
                size: meta.size,
                smallest: meta.smallest,
                largest: meta.largest,
                level: 0,
            };
            added.push((n, fm));
        }
        let next = self.version.lock().version.next_file;
        let mut edits: Vec<Edit> = added.iter().map(|(n, m)| Edit::AddFile(*n, m.clone())).collect();
        edits.push(Edit::NextFile(next));
        edits.push(Edit::Counter(imm.gen));
        self.commit(edits)?;
        {
            let mut levels = (**self.current.read()).clone();
            for (n, m) in added {
                let t = self.open_table(n, m)?;
                levels.levels[0].insert(0, t);
            }
            *self.current.write() = Arc::new(levels);
        }
        self.mem.write().imm = None;
        for name in self.fs.list(&self.dir)? {
            if wal::number(&name).is_some_and(|g| g <= imm.gen) {
                let _ = self.fs.remove(&self.dir.join(&name));
            }
        }
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The compaction LevelDB would pick now, if any score is ≥ 1.
    fn pick(&self, cur: &Levels, pointers: &[Vec<u8>]) -> Option<Job> {
        let mut best: Option<(f64, usize)> = None;
        for l in 0..cur.levels.len() - 1 {
            let score = if l == 0 {
                cur.levels[0].len() as f64 / self.opts.l0_compaction_trigger.max(1) as f64
            } else {
                cur.bytes(l) as f64 / self.level_target(l) as f64
            };
            if score >= 1.0 && best.is_none_or(|(s, _)| score > s) {
                best = Some((score, l));
            }
        }
        let Some((_, l)) = best else { return self.pick_seek(cur) };
        let inputs = if l == 0 {
            cur.levels[0].clone()
        } else {
            let lvl = &cur.levels[l];
            let p = pointers.get(l).cloned().unwrap_or_default();
            let f = lvl.iter().find(|f| p.is_empty() || f.meta.largest > p).or_else(|| lvl.first())?;
            vec![f.clone()]
        };
        let (lo, hi) = range_of(&inputs);
        let below = cur.overlapping(l + 1, &lo, &hi);
        Some(Job { level: l, inputs, below })
    }

    /// LevelDB's seek compaction, when no level's score is ≥ 1: the table whose seek
    /// allowance ran out, with the overlapping tables of the next level (level 0: all
    /// its tables, as a score-picked level-0 compaction). Nothing when that table is gone
    /// (compacted since) or in the last level.
    fn pick_seek(&self, cur: &Levels) -> Option<Job> {
        let packed = cur.seek.due.swap(0, Ordering::AcqRel);
        let (l, n) = unpack_due(packed);
        if packed == 0 || l + 1 >= cur.levels.len() {
            return None;
        }
        let f = cur.levels[l].iter().find(|f| f.number == n)?;
        let inputs = if l == 0 { cur.levels[0].clone() } else { vec![f.clone()] };
        let (lo, hi) = range_of(&inputs);
        let below = cur.overlapping(l + 1, &lo, &hi);
        self.counters.seek_compactions.fetch_add(1, Ordering::Relaxed);
        Some(Job { level: l, inputs, below })
    }

    fn level_target(&self, l: usize) -> u64 {
        let mut t = self.opts.level1_size;
        for _ in 1..l {
            t = t.saturating_mul(self.opts.fanout);
        }
        t
    }

    /// Run one compaction if one is due; true when one ran.
    fn compact_once(&self) -> Result<bool> {
        // The job is picked under the lock it runs under (see `compact_all`): two threads
        // (the background worker and a caller of `compact`) must not both run a job picked
        // from the same version — the second would re-add a table the first moved, or
        // rewrite tables the first removed, leaving overlapping tables in one level.
        let mut pointers = self.job.lock();
        // No new compaction once cancelled (close's own flushes end up here too).
        if self.cancel.is_cancelled() {
            return Ok(false);
        }
        let cur = self.current.read().clone();
        match self.pick(&cur, &pointers) {
            Some(j) => {
                self.run_job(&mut pointers, j)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Run `job`, picked from the current version while `pointers` (the job lock) was held.
    fn run_job(&self, pointers: &mut [Vec<u8>], job: Job) -> Result<()> {
        let out_level = job.level + 1;
        let (_, hi) = range_of(&job.inputs);
        let pointer = pointers.get(job.level).cloned().unwrap_or_default();
        if let Some(p) = pointers.get_mut(job.level) {
            *p = hi.clone();
        }
        self.counters.compactions.fetch_add(1, Ordering::Relaxed);
        let removed: Vec<u64> = job.inputs.iter().chain(&job.below).map(|f| f.number).collect();
        if job.inputs.len() == 1 && job.below.is_empty() {
            let f = &job.inputs[0];
            let meta = FileMeta { level: out_level as u32, ..f.meta.clone() };
            self.commit(vec![Edit::RemoveFile(f.number), Edit::AddFile(f.number, meta.clone())])?;
            let mut levels = (**self.current.read()).clone();
            levels.levels[job.level].retain(|x| x.number != f.number);
            levels.levels[out_level].push(TFile::new(f.number, meta, f.table.clone()));
            sort_levels(&mut levels);
            *self.current.write() = Arc::new(levels);
            f.removed.store(true, Ordering::Relaxed);
            self.counters.trivial_moves.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let mut created = Vec::new();
        let r = self.write_outputs(&job, out_level, &mut created);
        let outs = self.cancel.on_cancel(r, || {
            // Nothing refers to the outputs yet: delete them; the round robin resumes here.
            if let Some(p) = pointers.get_mut(job.level) {
                *p = pointer;
            }
            for n in &created {
                let p = self.dir.join(table_name(*n));
                if self.fs.exists(&p) {
                    self.fs.remove(&p)?;
                }
            }
            Ok(self.fs.sync_dir(&self.dir)?)
        })?;
        let next = self.version.lock().version.next_file;
        let mut edits: Vec<Edit> = removed.iter().map(|&n| Edit::RemoveFile(n)).collect();
        edits.extend(outs.iter().map(|(n, m)| Edit::AddFile(*n, m.clone())));
        edits.push(Edit::NextFile(next));
        self.commit(edits)?;
        let mut levels = (**self.current.read()).clone();
        for l in &mut levels.levels {
            l.retain(|f| !removed.contains(&f.number));
        }
        for (n, m) in outs {
            self.counters.compact_written.fetch_add(m.size, Ordering::Relaxed);
            let t = self.open_table(n, m)?;
            levels.levels[out_level].push(t);
        }
        sort_levels(&mut levels);
        *self.current.write() = Arc::new(levels);
        for f in job.inputs.iter().chain(&job.below) {
            f.removed.store(true, Ordering::Relaxed);
        }
        for n in removed {
            let _ = self.fs.remove(&self.dir.join(table_name(n)));
        }
        Ok(())
    }

    /// Merge `job`'s tables into new tables for `out_level` (numbers pushed to `created`
    /// as they are made). Safe points: before each output table and every `CHECK_EVERY`
    /// entries; nothing refers to the outputs until the caller's MANIFEST edit.
    fn write_outputs(&self, job: &Job, out_level: usize, created: &mut Vec<u64>) -> Result<Vec<(u64, FileMeta)>> {
        let cur = self.current.read().clone();
        // Newest first: for level 0 the inputs are already newest first; then the level below.
        let mut curs = Vec::new();
        for f in job.inputs.iter().chain(&job.below) {
            self.counters.compact_read.fetch_add(f.meta.size, Ordering::Relaxed);
            curs.push(TableCursor::seek(f.table.clone(), Bound::Unbounded, false)?);
        }
        let deeper: Vec<&Vec<Arc<TFile>>> = cur.levels.iter().skip(out_level + 1).collect();
        let base_for = |k: &[u8]| {
            deeper.iter().all(|lvl| {
                let i = lvl.partition_point(|f| f.meta.largest.as_slice() < k);
                lvl.get(i).is_none_or(|f| f.meta.smallest.as_slice() > k)
            })
        };
        let mut outs: Vec<(u64, FileMeta)> = Vec::new();
        let mut builder: Option<(u64, TableBuilder)> = None;
        let mut merged = 0u64;
        loop {
            merged += 1;
            self.cancel.every(merged)?;
            let mut best: Option<usize> = None;
            for (i, c) in curs.iter().enumerate() {
                if let Some(e) = c.peek() {
                    if best.is_none_or(|b| curs_key_lt(e, &curs[b])) {
                        best = Some(i);
                    }
                }
            }
            let Some(b) = best else { break };
            let Some(e) = curs[b].peek().cloned() else { break };
            for c in curs.iter_mut() {
                while c.peek().is_some_and(|x| x.1 == e.1) {
                    c.advance()?;
                }
            }
            if e.0 == Kind::Delete && base_for(&e.1) {
                self.counters.tombstones_dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if builder.is_none() {
                self.cancel.point()?;
                let n = self.next_number();
                created.push(n);
                builder = Some((n, self.new_builder(n)?));
            }
            if let Some((_, bld)) = builder.as_mut() {
                bld.add(e.0, &e.1, &e.2)?;
                if bld.approximate_size() >= self.opts.target_file_size {
                    if let Some((n, bld)) = builder.take() {
                        outs.push((n, finish_meta(bld, out_level)?));
                    }
                }
            }
        }
        if let Some((n, bld)) = builder.take() {
            outs.push((n, finish_meta(bld, out_level)?));
        }
        self.fs.sync_dir(&self.dir)?;
        Ok(outs)
    }

    /// `Err(Poisoned)` once a background job or an ingest failed (the tree takes no more
    /// changes; its committed tables stay readable).
    pub fn health(&self) -> Result<()> {
        self.poison.check()
    }

    /// Tables and bytes per level.
    pub fn level_shape(&self) -> Vec<(usize, u64)> {
        let cur = self.current.read().clone();
        (0..cur.levels.len()).map(|l| (cur.levels[l].len(), cur.bytes(l))).collect()
    }

    /// DRAM held by the MemTables.
    pub fn mem_bytes(&self) -> u64 {
        let m = self.mem.read();
        m.active.bytes.load(Ordering::Relaxed) + m.imm.as_ref().map_or(0, |i| i.bytes.load(Ordering::Relaxed))
    }

    /// Every live entry, in key order (tools, `check`, exact key counts).
    pub fn for_each_live(&self, mut f: impl FnMut(&[u8], &[u8]) -> Result<()>) -> Result<()> {
        let mut it = self.iter();
        it.seek_to_first()?;
        while it.valid() {
            if let Some(v) = it.value() {
                f(it.key(), v)?;
            }
            it.next()?;
        }
        Ok(())
    }

    /// Verify every table (checksums, order, ranges against the MANIFEST) and the level
    /// invariants. Returns the problems found.
    pub fn check(&self) -> Result<Vec<String>> {
        let cur = self.current.read().clone();
        let mut problems = Vec::new();
        for (l, lvl) in cur.levels.iter().enumerate() {
            for (i, f) in lvl.iter().enumerate() {
                let mut first: Option<Vec<u8>> = None;
                let mut last: Option<Vec<u8>> = None;
                let mut n = 0u64;
                if let Err(e) = f.table.for_each(|e, _, _| {
                    if first.is_none() {
                        first = Some(e.key.to_vec());
                    }
                    last = Some(e.key.to_vec());
                    n += 1;
                    Ok(())
                }) {
                    problems.push(format!("table {} (level {l}): {e}", f.number));
                    continue;
                }
                if n != f.meta.total
                    || first.as_deref().unwrap_or_default() != f.meta.smallest.as_slice()
                    || last.as_deref().unwrap_or_default() != f.meta.largest.as_slice()
                {
                    problems.push(format!("table {} (level {l}) differs from its MANIFEST entry", f.number));
                }
                if l > 0 && i > 0 && lvl[i - 1].meta.largest >= f.meta.smallest {
                    problems.push(format!("level {l}: tables {} and {} overlap", lvl[i - 1].number, f.number));
                }
            }
        }
        Ok(problems)
    }

    /// Clean shutdown: stop the background thread, flush the MemTable, sync.
    pub fn close(&self) -> Result<()> {
        self.stop();
        let mut w = self.writer.lock();
        if self.mem.read().active.bytes.load(Ordering::Relaxed) > 0 || self.mem.read().imm.is_some() {
            if self.mem.read().imm.is_some() {
                self.flush_imm()?;
            }
            let gen = w.gen + 1;
            let wal = crate::fs::create_log(&self.fs, &self.dir.join(wal::name(gen)))?;
            w.wal.sync()?;
            w.wal = wal;
            w.gen = gen;
            {
                let mut m = self.mem.write();
                let old = std::mem::replace(&mut m.active, Arc::new(Mem::new(gen)));
                m.imm = Some(old);
            }
            self.flush_imm()?;
        }
        self.prepare_durable()?;
        w.wal.sync()?;
        self.fs.sync_dir(&self.dir)?;
        Ok(())
    }

    /// The WAL generations still on disk and the tables of the version (tests).
    #[cfg(test)]
    pub fn files(&self) -> (std::collections::BTreeSet<u64>, Vec<(u64, u32)>) {
        let v = self.version.lock().version.clone();
        let wals = self.fs.list(&self.dir).unwrap_or_default().iter().filter_map(|n| wal::number(n)).collect();
        (wals, v.files.iter().map(|(n, m)| (*n, m.level)).collect())
    }
}

impl Drop for Lsm {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.work.lock().stop = true;
        self.work_cv.notify_all();
    }
}

fn kind_value(e: (Kind, Vec<u8>)) -> Option<Vec<u8>> {
    match e.0 {
        Kind::Put => Some(e.1),
        Kind::Delete => None,
    }
}

/// True when cursor entry `e` sorts before the head of `other` (ties keep the earlier,
/// newer source).
fn curs_key_lt(e: &crate::sstable::CursorEntry, other: &TableCursor) -> bool {
    other.peek().is_none_or(|o| e.1 < o.1)
}

fn finish_meta(b: TableBuilder, level: usize) -> Result<FileMeta> {
    let m = b.finish()?;
    Ok(FileMeta {
        total: m.entries,
        live: m.entries,
        size: m.size,
        smallest: m.smallest,
        largest: m.largest,
        level: level as u32,
    })
}

fn range_of(files: &[Arc<TFile>]) -> (Vec<u8>, Vec<u8>) {
    let lo = files.iter().map(|f| f.meta.smallest.clone()).min().unwrap_or_default();
    let hi = files.iter().map(|f| f.meta.largest.clone()).max().unwrap_or_default();
    (lo, hi)
}

fn sort_levels(l: &mut Levels) {
    if let Some(l0) = l.levels.first_mut() {
        l0.sort_by_key(|f| std::cmp::Reverse(f.number));
    }
    for lvl in l.levels.iter_mut().skip(1) {
        lvl.sort_by(|a, b| a.meta.smallest.cmp(&b.meta.smallest));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::fs::FaultFs;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;

    fn small() -> LsmOptions {
        LsmOptions {
            memtable_size: 4 << 10,
            level1_size: 16 << 10,
            fanout: 4,
            max_levels: 5,
            target_file_size: 4 << 10,
            block_size: 256,
            block_cache_size: 64 << 10,
            sync_wal: true,
            background: false,
            ..LsmOptions::default()
        }
    }

    fn open(fs: &FaultFs, fresh: bool) -> (Arc<Lsm>, Vec<wal::Batch>) {
        open_with(fs, fresh, small())
    }

    fn open_with(fs: &FaultFs, fresh: bool, opts: LsmOptions) -> (Arc<Lsm>, Vec<wal::Batch>) {
        let cfs = CountingFs::new(Arc::new(fs.clone()));
        let d = Path::new("/lsm");
        if fresh {
            cfs.create_dir_all(d).unwrap();
        }
        let (l, b) = Lsm::open(cfs, d, opts, fresh, Arc::new(Poison::default()), Arc::default(), &|| true).unwrap();
        (Arc::new(l), b)
    }

    /// Writes and flushes still running after the background thread stopped (close, drop,
    /// an owner's `stop`): a rotation that meets an Immutable MemTable flushes it itself,
    /// level 0 past its stop-writes depth no longer stalls writes, and `flush` flushes
    /// rather than wait — they waited for ever before. One that does not finish within
    /// 30 s fails the test.
    #[test]
    fn writes_after_the_background_thread_stopped_flush_themselves() {
        let opts = LsmOptions { background: true, l0_stop_writes: 2, ..small() };
        let (l, _) = open_with(&FaultFs::new(), true, opts);
        l.finish_recovery(Vec::new()).unwrap();
        l.stop();
        let writer = l.clone();
        crate::testing::returns("writes after the stop", move || {
            (0..2000u64).try_for_each(|i| {
                let k = format!("k{i:05}").into_bytes();
                writer.write(i + 1, &[(k.as_slice(), Some(&[b'v'; 100][..]))], false)
            })
        })
        .unwrap();
        assert!(l.current.read().levels[0].len() > 2, "level 0 passed its stop-writes depth");
        // A flush (as `Db::flush` or `compact` in flight during a close) does not wait either.
        let k = b"last".to_vec();
        l.write(2001, &[(k.as_slice(), Some(&b"v"[..]))], false).unwrap();
        let flusher = l.clone();
        crate::testing::returns("a flush after the stop", move || flusher.flush(false)).unwrap();
        assert!(l.mem.read().imm.is_none());
        for i in 0..2000u64 {
            let k = format!("k{i:05}").into_bytes();
            assert_eq!(l.get(&k).unwrap().flatten().as_deref(), Some(&[b'v'; 100][..]), "key {i}");
        }
    }

    /// Two overlapping level-0 tables (even keys, then odd keys over the same range) and
    /// a third alone in its range (`z…`), level 0 kept below its compaction trigger.
    fn seek_tree() -> (Arc<Lsm>, BTreeMap<Vec<u8>, Vec<u8>>) {
        let opts = LsmOptions { l0_compaction_trigger: 100, l0_stop_writes: 200, memtable_size: 1 << 20, ..small() };
        let (l, _) = open_with(&FaultFs::new(), true, opts);
        l.finish_recovery(Vec::new()).unwrap();
        let mut model = BTreeMap::new();
        let mut seq = 0;
        for keys in [
            (0..1000).step_by(2).map(|i| format!("k{i:05}")).collect::<Vec<_>>(),
            (1..1000).step_by(2).map(|i| format!("k{i:05}")).collect(),
            (0..50).map(|i| format!("z{i:05}")).collect(),
        ] {
            for k in keys {
                seq += 1;
                l.write(seq, &[(k.as_bytes(), Some(&[b'v'; 40][..]))], false).unwrap();
                model.insert(k.into_bytes(), vec![b'v'; 40]);
            }
            l.flush(false).unwrap();
        }
        assert_eq!(l.level_shape()[0].0, 3);
        (l, model)
    }

    fn l0_numbers(l: &Lsm) -> Vec<u64> {
        l.current.read().levels[0].iter().map(|f| f.number).collect()
    }

    /// LevelDB's seek compaction: a point read that searches a second table charges a
    /// seek to the first one it searched (level 0 newest first); a table whose allowance
    /// (100 for a small table) is spent is compacted once no level's score asks for a
    /// compaction, and the reads then search one table. A read found in the first table
    /// it searches charges nothing.
    #[test]
    fn a_table_reads_search_past_is_compacted_once_its_seek_allowance_is_spent() {
        let (l, model) = seek_tree();
        let [_, newer, _] = l0_numbers(&l)[..] else { panic!("three tables") };
        // Odd keys are found in the newer k-table, the first searched: no charge at all.
        for i in 0..500 {
            assert!(l.get(format!("k{:05}", i * 2 + 1).as_bytes()).unwrap().is_some());
        }
        // Even keys: the newer k-table is searched first, then the older one: one seek each
        // (k00000 lies below the newer table's range: it searches one table, no charge).
        for i in 0..100 {
            assert!(l.get(format!("k{:05}", i * 2).as_bytes()).unwrap().is_some());
        }
        l.flush(true).unwrap();
        assert_eq!(l.counters.compactions.load(Ordering::Relaxed), 0, "99 seeks do not spend 100");
        let f = l.current.read().levels[0].iter().find(|f| f.number == newer).cloned().unwrap();
        assert_eq!(f.allowed_seeks.load(Ordering::Relaxed), 1);
        assert!(l.get(b"k00200").unwrap().is_some());
        assert_eq!(l.current.read().seek.due.load(Ordering::Relaxed), newer, "level 0, table {newer} due");
        l.flush(true).unwrap();
        assert_eq!(l.counters.seek_compactions.load(Ordering::Relaxed), 1);
        assert!(l.counters.compactions.load(Ordering::Relaxed) >= 1);
        assert!(l0_numbers(&l).is_empty(), "level 0 (all of it, as LevelDB) compacted into level 1");
        for (k, v) in &model {
            assert_eq!(l.get(k).unwrap().flatten().as_ref(), Some(v));
        }
        // Level 1's tables do not overlap: every read now searches one table, and charges
        // nothing.
        assert!(untouched(&l), "no table charged");
        assert!(l.check().unwrap().is_empty());
    }

    /// Every table of the current version still has its whole allowance.
    fn untouched(l: &Lsm) -> bool {
        let cur = l.current.read().clone();
        cur.levels
            .iter()
            .flatten()
            .all(|f| f.allowed_seeks.load(Ordering::Relaxed) == (f.meta.size / SEEK_BYTES).max(MIN_SEEKS) as i64)
    }

    /// The due table's level and number survive their packing, for every level.
    #[test]
    fn a_due_table_packs_its_level_and_number() {
        for l in 0..8 {
            for n in [1, 2, 1 << 20, (1 << 56) - 1] {
                assert_eq!(unpack_due(pack_due(l, n)), (l, n));
            }
        }
    }

    /// Range reads charge seeks through read samples: a sampled key held by two or more
    /// tables' ranges charges the first (newest); a key only one table holds charges
    /// nothing. A hundred samples spend a small table's allowance and compact it.
    #[test]
    fn read_samples_of_keys_two_tables_hold_lead_to_a_seek_compaction() {
        let (l, _) = seek_tree();
        for _ in 0..1000 {
            l.record_read_sample(b"z00007"); // only the z-table holds it
        }
        l.flush(true).unwrap();
        assert_eq!(l.counters.compactions.load(Ordering::Relaxed), 0);
        let before = l.tables();
        for _ in 0..100 {
            l.record_read_sample(b"k00010"); // both k-tables hold it in their ranges
        }
        l.flush(true).unwrap();
        assert_eq!(l.counters.seek_compactions.load(Ordering::Relaxed), 1);
        assert!(l0_numbers(&l).is_empty());
        // A view taken before the compaction (a snapshot's) still searches the removed
        // level-0 tables: it charges none of them, and makes nothing due.
        let allowances = |v: &TablesView| -> Vec<i64> {
            v.0.levels.iter().flatten().map(|f| f.allowed_seeks.load(Ordering::Relaxed)).collect()
        };
        let held = allowances(&before);
        for i in 0..500 {
            assert!(before.get(format!("k{:05}", i * 2).as_bytes()).unwrap().is_some());
            before.record_read_sample(b"k00010");
        }
        assert_eq!(allowances(&before), held, "removed tables are not charged");
        assert_eq!(l.current.read().seek.due.load(Ordering::Relaxed), 0);
    }

    /// The sampler picks about one entry per MiB returned: 64 MiB of 1 KiB entries give
    /// about 64 samples (the period is uniform in [0, 2 MiB): 64 ± 5 or so).
    #[test]
    fn the_read_sampler_samples_about_once_per_mib() {
        let mut s = ReadSampler::default();
        let n = (0..65_536).filter(|_| s.returned(1024)).count();
        assert!((40..=90).contains(&n), "{n} samples");
    }

    fn verify(l: &Lsm, model: &BTreeMap<Vec<u8>, Vec<u8>>, rng: &mut rand::rngs::StdRng) {
        for k in 0..400u32 {
            let key = format!("k{:05}", k * 7 % 1000).into_bytes();
            let got = l.get(&key).unwrap().flatten();
            assert_eq!(got.as_ref(), model.get(&key), "{}", String::from_utf8_lossy(&key));
        }
        let mut all = Vec::new();
        l.for_each_live(|k, v| {
            all.push((k.to_vec(), v.to_vec()));
            Ok(())
        })
        .unwrap();
        let want: Vec<_> = model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        assert_eq!(all, want);
        let mut it = l.iter();
        test_walk::full_walks(&mut it, model, |_| true);
        test_walk::walk_model(
            &mut it,
            model,
            rng,
            300,
            |r| format!("k{:05}", r.random_range(0..1001)).into_bytes(),
            |_| true,
        );
    }

    /// Random puts and deletes over a model, through flushes and leveled compactions,
    /// across reopen: reads and scans agree with the model, level 1.. stay sorted runs,
    /// data reaches level 2 and deeper, and compactions drop tombstones.
    #[test]
    fn leveled_lsm_matches_a_model_through_compactions_and_reopen() {
        let fs = FaultFs::new();
        let (mut l, _) = open(&fs, true);
        l.finish_recovery(Vec::new()).unwrap();
        let mut model = BTreeMap::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (mut compactions, mut dropped, mut written) = (0, 0, 0);
        for round in 0..4u64 {
            for i in 0..3000u64 {
                let key = format!("k{:05}", rng.random_range(0..1000)).into_bytes();
                if rng.random_bool(0.2) {
                    l.write(round * 10_000 + i, &[(&key, None)], false).unwrap();
                    model.remove(&key);
                } else {
                    let v = vec![b'a' + (i % 26) as u8; rng.random_range(1..120)];
                    l.write(round * 10_000 + i, &[(&key, Some(&v))], false).unwrap();
                    model.insert(key, v);
                }
            }
            verify(&l, &model, &mut rng);
            assert!(l.check().unwrap().is_empty());
            let c = &l.counters;
            compactions += c.compactions.load(Ordering::Relaxed);
            dropped += c.tombstones_dropped.load(Ordering::Relaxed);
            written += c.compact_written.load(Ordering::Relaxed);
            l.close().unwrap();
            drop(l);
            let (l2, batches) = open(&fs, false);
            assert!(batches.is_empty(), "a clean close leaves nothing to replay");
            l2.finish_recovery(Vec::new()).unwrap();
            l = l2;
            verify(&l, &model, &mut rng);
        }
        let shape = l.level_shape();
        assert!(shape.iter().skip(2).any(|&(n, _)| n > 0), "data reached level 2+: {shape:?}");
        assert!(compactions > 10, "{compactions} compactions");
        assert!(dropped > 0 && written > 0);
        // Level sizes respect their targets after compaction settles (score < 1).
        for (lvl, &(_, bytes)) in shape.iter().enumerate().skip(1).take(shape.len() - 2) {
            assert!(bytes < 2 * l.level_target(lvl), "level {lvl} holds {bytes}");
        }
        l.compact_all().unwrap();
        let nonempty = l.level_shape().iter().filter(|s| s.0 > 0).count();
        assert_eq!(nonempty, 1, "compact_all leaves one level");
        verify(&l, &model, &mut rng);
    }

    /// An iterator made before a compaction that removes every table it reads (and a flush
    /// of the MemTable it reads) returns exactly the entries it was made over, both ways.
    #[test]
    fn an_iterator_reads_on_after_compaction_removes_its_tables() {
        let fs = FaultFs::new();
        let (l, _) = open(&fs, true);
        l.finish_recovery(Vec::new()).unwrap();
        let mut model = BTreeMap::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for i in 0..4000u64 {
            let key = format!("k{:05}", rng.random_range(0..1000)).into_bytes();
            if rng.random_bool(0.15) {
                l.write(i, &[(&key, None)], false).unwrap();
                model.remove(&key);
            } else {
                let v = format!("value-{i}-{}", "x".repeat(rng.random_range(0..60))).into_bytes();
                l.write(i, &[(&key, Some(&v))], false).unwrap();
                model.insert(key, v);
            }
        }
        let before: Vec<u64> = l.files().1.iter().map(|f| f.0).collect();
        assert!(before.len() > 3 && l.mem_bytes() > 0, "tables and a MemTable to read");
        let mut it = l.iter();
        let want: Vec<(Vec<u8>, Vec<u8>)> = model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut got = Vec::new();
        {
            let mut live = test_walk::Live { it: &mut it, keep: |_: &[u8]| true };
            live.first().unwrap();
            while got.len() < want.len() / 2 {
                got.push(live.entry().unwrap());
                live.next().unwrap();
            }
            l.compact_all().unwrap();
            let after: Vec<u64> = l.files().1.iter().map(|f| f.0).collect();
            let gone: Vec<u64> = before.iter().copied().filter(|n| !after.contains(n)).collect();
            assert!(!gone.is_empty(), "the compaction replaced tables the iterator reads");
            assert!(gone.iter().all(|n| !fs.exists(&Path::new("/lsm").join(table_name(*n)))));
            assert_eq!(l.mem_bytes(), 0, "the MemTable was flushed");
            while let Some(e) = live.entry() {
                got.push(e);
                live.next().unwrap();
            }
        }
        assert!(got == want, "the walk across the compaction differs from the model");
        test_walk::full_walks(&mut it, &model, |_| true);
        test_walk::walk_model(
            &mut it,
            &model,
            &mut rng,
            500,
            |r| format!("k{:05}", r.random_range(0..1001)).into_bytes(),
            |_| true,
        );
    }

    /// Concurrent writers insert their own batches after the group's WAL append, through
    /// MemTable switches every few writes (inline flushes, then a background thread): each
    /// write is readable as soon as `write` returns, a concurrent reader never sees a key's
    /// value go back to an older one, no flush loses a batch still being inserted, and after
    /// a crash recovery returns every acknowledged write.
    #[test]
    fn parallel_memtable_inserts_lose_no_acknowledged_write() {
        use std::sync::atomic::AtomicBool;
        for background in [false, true] {
            let fs = FaultFs::new();
            let cfs = CountingFs::new(Arc::new(fs.clone()));
            let d = Path::new("/lsm");
            cfs.create_dir_all(d).unwrap();
            let opts = LsmOptions { background, memtable_size: 2 << 10, ..small() };
            let poison = Arc::new(Poison::default());
            let (l, _) = Lsm::open(cfs, d, opts.clone(), true, poison, Arc::default(), &|| true).unwrap();
            let l = Arc::new(l);
            l.finish_recovery(Vec::new()).unwrap();
            let seq = Arc::new(AtomicU64::new(1));
            let stop = Arc::new(AtomicBool::new(false));
            const THREADS: u32 = 4;
            const WRITES: u32 = 800;
            const KEYS: u32 = 20;
            let key = |t: u32, k: u32| format!("t{t}-k{k:03}").into_bytes();
            let value = |i: u32| {
                let mut v = i.to_be_bytes().to_vec();
                v.resize(40, b'v');
                v
            };
            let reader = {
                let (l, stop) = (l.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut last = std::collections::HashMap::new();
                    let mut reads = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        for t in 0..THREADS {
                            let k = key(t, (reads % u64::from(KEYS)) as u32);
                            if let Some(Some(v)) = l.get(&k).unwrap() {
                                let i = u32::from_be_bytes(v[..4].try_into().unwrap());
                                let prev = last.insert(k.clone(), i).unwrap_or(0);
                                assert!(i >= prev, "{} went back from {prev} to {i}", String::from_utf8_lossy(&k));
                            }
                        }
                        reads += 1;
                    }
                    reads
                })
            };
            let writers: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (l, seq) = (l.clone(), seq.clone());
                    std::thread::spawn(move || {
                        for i in 1..=WRITES {
                            let (k, v) = (key(t, i % KEYS), value(i));
                            l.write(seq.fetch_add(1, Ordering::Relaxed), &[(&k, Some(&v))], false).unwrap();
                            assert_eq!(l.get(&k).unwrap(), Some(Some(v)), "own write not readable");
                        }
                    })
                })
                .collect();
            for w in writers {
                w.join().unwrap();
            }
            stop.store(true, Ordering::Relaxed);
            assert!(reader.join().unwrap() > 0);
            assert!(l.counters.flushes.load(Ordering::Relaxed) > 20, "the MemTable switched often");
            // Each thread's last write of key k.
            let want = |_t: u32, k: u32| value((1..=WRITES).filter(|i| i % KEYS == k).max().unwrap());
            for t in 0..THREADS {
                for k in 0..KEYS {
                    assert_eq!(l.get(&key(t, k)).unwrap(), Some(Some(want(t, k))), "background {background}");
                }
            }
            // A crash now (synced WAL): the flushed tables and the WAL replay hold every write.
            let crashed = fs.crash();
            l.stop();
            drop(l);
            let cfs = CountingFs::new(Arc::new(crashed));
            let (l, batches) = Lsm::open(cfs, d, opts, false, Arc::default(), Arc::default(), &|| true).unwrap();
            let l = Arc::new(l);
            let ops: Vec<wal::Op> = batches.into_iter().flat_map(|b| b.ops).collect();
            l.finish_recovery(ops).unwrap();
            for t in 0..THREADS {
                for k in 0..KEYS {
                    assert_eq!(l.get(&key(t, k)).unwrap(), Some(Some(want(t, k))), "after the crash");
                }
            }
        }
    }

    /// Unflushed batches come back from the WAL after a crash (synced WAL), in order; the
    /// caller's filtered ops are flushed and the WALs removed.
    #[test]
    fn wal_batches_are_recovered_and_flushed() {
        let fs = FaultFs::new();
        let (l, _) = open(&fs, true);
        l.finish_recovery(Vec::new()).unwrap();
        l.write(1, &[(b"a", Some(b"1")), (b"b", Some(b"2"))], false).unwrap();
        l.write(2, &[(b"a", None)], false).unwrap();
        let crashed = fs.crash();
        drop(l);
        let (l, batches) = open(&crashed, false);
        assert_eq!(batches.iter().map(|b| b.seq).collect::<Vec<_>>(), vec![1, 2]);
        let ops: Vec<wal::Op> = batches.into_iter().flat_map(|b| b.ops).collect();
        l.finish_recovery(ops).unwrap();
        assert_eq!(l.get(b"a").unwrap(), Some(None));
        assert_eq!(l.get(b"b").unwrap(), Some(Some(b"2".to_vec())));
        let (wals, tables) = l.files();
        assert_eq!(wals.len(), 1, "only the new WAL remains: {wals:?}");
        assert_eq!(tables.len(), 1);
        drop(l);
        let (_l, batches) = open(&crashed.crash(), false);
        assert!(batches.is_empty());
    }
}
