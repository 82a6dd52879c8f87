//! A LevelDB-style leveled LSM tree on the shared SSTable format and MANIFEST: the
//! ColdStore of `hoakv`, and a reusable component (an in-tree LevelDB-like baseline later).
//!
//! # What runs here
//! - **Write path**: a batch is one WAL record ([`wal`]; fsynced only with `sync_wal`, as
//!   LevelDB's default) and then goes into the DRAM MemTable (a `BTreeMap` of key → value or
//!   tombstone). A MemTable past `memtable_size` becomes the Immutable MemTable and a new
//!   MemTable and WAL generation start; a background thread flushes it.
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
//! - **Reads**: MemTable → Immutable MemTable → level 0 newest first → one table per level
//!   (binary search on the largest keys); bloom filters (10 bits/key) and a block cache.
//!   Range scans k-way merge MemTable ranges with table cursors, newest source winning.
//! - **Back-pressure**: writers wait while level 0 holds `l0_stop_writes` tables or the
//!   Immutable MemTable is still being flushed (counted as `write_stalls`).
//!
//! # Recovery
//! The MANIFEST gives the tables (with levels) and the last flushed WAL generation; newer
//! WALs are read by [`Lsm::open`] and handed to the caller, which filters them (HoaKV drops
//! operations its hot store already holds newer) and gives them back to
//! [`Lsm::finish_recovery`]: they are flushed to a level-0 table and the WALs removed before
//! the first new write. Tables not named in the MANIFEST are leftovers of an interrupted
//! flush or compaction and are removed.

pub mod wal;

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::engine::Poison;
use crate::error::{Error, Result};
use crate::fs::{CountingFs, Fs, FsFile};
use crate::manifest::{Edit, FileMeta, Manifest, Version};
use crate::sstable::{BlockCache, Kind, Table, TableBuilder, TableCursor};

/// DRAM bytes charged per MemTable entry besides key and value (map node, lengths).
const MEM_ENTRY_OVERHEAD: u64 = 48;

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

/// A MemTable: key → value (`None`: tombstone), with its WAL generation.
#[derive(Debug)]
struct Mem {
    map: RwLock<BTreeMap<Vec<u8>, Option<Vec<u8>>>>,
    bytes: AtomicU64,
    gen: u64,
}

impl Mem {
    fn new(gen: u64) -> Mem {
        Mem { map: RwLock::new(BTreeMap::new()), bytes: AtomicU64::new(0), gen }
    }

    fn insert(&self, k: &[u8], v: Option<&[u8]>) {
        let add = k.len() as u64 + v.map_or(0, |v| v.len() as u64) + MEM_ENTRY_OVERHEAD;
        self.map.write().insert(k.to_vec(), v.map(<[u8]>::to_vec));
        self.bytes.fetch_add(add, Ordering::Relaxed);
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
}

/// The tables readers see: level 0 newest first, levels 1.. by smallest key.
#[derive(Debug, Default, Clone)]
struct Levels {
    levels: Vec<Vec<Arc<TFile>>>,
}

impl Levels {
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
}

/// A picked compaction.
#[derive(Debug)]
struct Job {
    level: usize,
    inputs: Vec<Arc<TFile>>,
    below: Vec<Arc<TFile>>,
}

/// The leveled LSM tree. See the module docs.
pub struct Lsm {
    fs: CountingFs,
    dir: PathBuf,
    opts: LsmOptions,
    writer: Mutex<Writer>,
    mem: RwLock<MemState>,
    current: RwLock<Arc<Levels>>,
    version: Mutex<VersionState>,
    cache: Arc<BlockCache>,
    /// Serialises flushes and compactions (one background job at a time, as LevelDB).
    job: Mutex<Vec<Vec<u8>>>,
    work: Mutex<Work>,
    work_cv: Condvar,
    done_mu: Mutex<()>,
    done_cv: Condvar,
    poison: Arc<Poison>,
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

/// File name of table `n`.
pub fn table_name(n: u64) -> String {
    format!("{n:06}.sst")
}

fn table_number(name: &str) -> Option<u64> {
    name.strip_suffix(".sst")?.parse().ok()
}

fn in_end(k: &[u8], end: Bound<&[u8]>) -> bool {
    match end {
        Bound::Included(e) => k <= e,
        Bound::Excluded(e) => k < e,
        Bound::Unbounded => true,
    }
}

/// The entries of a MemTable range, at most `n` of them, and whether more remain.
fn mem_range(m: &Mem, lo: Bound<&[u8]>, end: Bound<&[u8]>, n: usize) -> (Vec<wal::Op>, bool) {
    let map = m.map.read();
    let mut it = map.range::<[u8], _>((lo, end));
    let out: Vec<_> = it.by_ref().take(n).map(|(k, v)| (k.clone(), v.clone())).collect();
    let more = it.next().is_some();
    (out, more)
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
        let mut levels = Levels { levels: vec![Vec::new(); opts.max_levels.max(2)] };
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
            levels.levels[l].push(Arc::new(TFile { number: n, meta: m.clone(), table }));
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
        let wal_file = fs.create(&wal_path)?;
        fs.sync_dir(dir)?;
        let lsm = Lsm {
            fs,
            dir: dir.to_path_buf(),
            writer: Mutex::new(Writer { wal: wal_file, gen }),
            mem: RwLock::new(MemState { active: Arc::new(Mem::new(gen)), imm: None }),
            current: RwLock::new(Arc::new(levels)),
            version: Mutex::new(VersionState { version, manifest }),
            cache,
            job: Mutex::new(vec![Vec::new(); opts.max_levels.max(2)]),
            work: Mutex::new(Work::default()),
            work_cv: Condvar::new(),
            done_mu: Mutex::new(()),
            done_cv: Condvar::new(),
            poison,
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
                Ok(Ok(())) => {}
                Ok(Err(e)) => self.poison.set(format!("background LSM flush/compaction failed: {e}")),
                Err(_) => self.poison.set("background LSM flush/compaction panicked".into()),
            }
            self.done_cv.notify_all();
        }
    }

    /// Stop the background thread (waiting for its current job).
    pub fn stop(&self) {
        self.work.lock().stop = true;
        self.work_cv.notify_all();
        if let Some(h) = self.worker.lock().take() {
            let _ = h.join();
        }
    }

    /// Append `ops` as one batch with sequence number `seq` (fsynced with `sync_wal` or
    /// `sync`), then apply it to the MemTable. The caller serialises writers.
    pub fn write(&self, seq: u64, ops: &[(&[u8], Option<&[u8]>)], sync: bool) -> Result<()> {
        self.poison.check()?;
        let mut w = self.writer.lock();
        self.make_room(&mut w)?;
        let rec = wal::encode_framed(seq, ops);
        let sync = sync || self.opts.sync_wal;
        if sync {
            self.prepare_durable()?;
        }
        if let Err(e) = w.wal.append(&rec).and_then(|_| if sync { w.wal.sync() } else { Ok(()) }) {
            self.poison.set(format!("WAL write failed: {e}"));
            return Err(e.into());
        }
        let mem = self.mem.read();
        for (k, v) in ops {
            mem.active.insert(k, *v);
        }
        Ok(())
    }

    /// Before a write: rotate a full MemTable, wait while level 0 is too deep.
    fn make_room(&self, w: &mut Writer) -> Result<()> {
        loop {
            let l0 = self.current.read().levels[0].len();
            if self.opts.background && l0 >= self.opts.l0_stop_writes {
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
                    self.wait_background()?;
                }
            } else {
                self.flush_imm()?;
            }
        }
        let gen = w.gen + 1;
        let wal = self.fs.create(&self.dir.join(wal::name(gen)))?;
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
            if let Some(v) = m.active.map.read().get(key) {
                return Ok(Some(v.clone()));
            }
            if let Some(imm) = &m.imm {
                if let Some(v) = imm.map.read().get(key) {
                    return Ok(Some(v.clone()));
                }
            }
        }
        let cur = self.current.read().clone();
        for f in &cur.levels[0] {
            if key >= f.meta.smallest.as_slice() && key <= f.meta.largest.as_slice() {
                if let Some(e) = f.table.get_cached(key)? {
                    return Ok(Some(kind_value(e)));
                }
            }
        }
        for lvl in cur.levels.iter().skip(1) {
            let i = lvl.partition_point(|f| f.meta.largest.as_slice() < key);
            if let Some(f) = lvl.get(i) {
                if f.meta.smallest.as_slice() <= key {
                    if let Some(e) = f.table.get_cached(key)? {
                        return Ok(Some(kind_value(e)));
                    }
                }
            }
        }
        Ok(None)
    }

    /// Up to `max` live entries of `[start, end)` in key order (tombstones resolved).
    pub fn scan(&self, start: Bound<&[u8]>, end: Bound<&[u8]>, max: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut out = Vec::new();
        let (active, imm) = {
            let m = self.mem.read();
            (m.active.clone(), m.imm.clone())
        };
        let cur = self.current.read().clone();
        let mut lo: Bound<Vec<u8>> = start.map(<[u8]>::to_vec);
        while out.len() < max {
            let want = (max - out.len()).max(16);
            // Sources newest first: MemTable, Immutable MemTable, level 0, levels 1...
            let mut mems = Vec::new();
            let mut limit: Option<Vec<u8>> = None;
            for m in std::iter::once(&active).chain(imm.iter()) {
                let (ents, more) = mem_range(m, lo.as_ref().map(Vec::as_slice), end, want);
                if more {
                    let last = ents.last().map(|e| e.0.clone()).unwrap_or_default();
                    if limit.as_ref().is_none_or(|l| &last < l) {
                        limit = Some(last);
                    }
                }
                mems.push(ents.into_iter().peekable());
            }
            let lo_b = lo.as_ref().map(Vec::as_slice);
            let mut curs = Vec::new();
            for f in &cur.levels[0] {
                curs.push(Source::from(TableCursor::seek(f.table.clone(), lo_b, true)?));
            }
            for lvl in cur.levels.iter().skip(1) {
                let first = match lo_b {
                    Bound::Unbounded => 0,
                    Bound::Included(k) | Bound::Excluded(k) => lvl.partition_point(|f| f.meta.largest.as_slice() < k),
                };
                curs.push(LevelCursor::new(lvl[first.min(lvl.len())..].to_vec(), lo_b)?.into_cursor()?);
            }
            loop {
                // The smallest key over all sources; ties go to the newest source.
                let mut best: Option<(Vec<u8>, Option<Vec<u8>>)> = None;
                for m in &mut mems {
                    if let Some((k, v)) = m.peek() {
                        if best.as_ref().is_none_or(|b| k < &b.0) {
                            best = Some((k.clone(), v.clone()));
                        }
                    }
                }
                for c in &mut curs {
                    if let Some(e) = c.peek()? {
                        if best.as_ref().is_none_or(|b| e.1 < b.0) {
                            best = Some((e.1.clone(), (e.0 == Kind::Put).then(|| e.2.clone())));
                        }
                    }
                }
                let Some((k, v)) = best else { break };
                if !in_end(&k, end) || limit.as_ref().is_some_and(|l| &k > l) {
                    break;
                }
                for m in &mut mems {
                    if m.peek().is_some_and(|e| e.0 == k) {
                        m.next();
                    }
                }
                for c in &mut curs {
                    c.skip_key(&k)?;
                }
                if let Some(v) = v {
                    out.push((k, v));
                }
                if out.len() >= max {
                    break;
                }
            }
            match limit {
                Some(l) if out.len() < max => lo = Bound::Excluded(l),
                _ => break,
            }
        }
        Ok(out)
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
                self.wait_background()?;
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
            self.run_job(Job { level: l, inputs, below })?;
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
        Ok(Arc::new(TFile { number: n, meta, table }))
    }

    /// Flush the Immutable MemTable (if any) to a level-0 table.
    fn flush_imm(&self) -> Result<()> {
        let _job = self.job.lock();
        let Some(imm) = self.mem.read().imm.clone() else { return Ok(()) };
        self.prepare_durable()?;
        let map = imm.map.read();
        let mut added = Vec::new();
        if !map.is_empty() {
            let n = self.next_number();
            let mut b = self.new_builder(n)?;
            for (k, v) in map.iter() {
                match v {
                    Some(v) => b.add(Kind::Put, k, v)?,
                    None => b.add(Kind::Delete, k, &[])?,
                }
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
            added.push((n, fm));
        }
        drop(map);
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
        let (_, l) = best?;
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

    fn level_target(&self, l: usize) -> u64 {
        let mut t = self.opts.level1_size;
        for _ in 1..l {
            t = t.saturating_mul(self.opts.fanout);
        }
        t
    }

    /// Run one compaction if one is due; true when one ran.
    fn compact_once(&self) -> Result<bool> {
        let job = {
            let pointers = self.job.lock().clone();
            let cur = self.current.read().clone();
            self.pick(&cur, &pointers)
        };
        match job {
            Some(j) => {
                self.run_job(j)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn run_job(&self, job: Job) -> Result<()> {
        let mut pointers = self.job.lock();
        let out_level = job.level + 1;
        let (_, hi) = range_of(&job.inputs);
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
            levels.levels[out_level].push(Arc::new(TFile { number: f.number, meta, table: f.table.clone() }));
            sort_levels(&mut levels);
            *self.current.write() = Arc::new(levels);
            self.counters.trivial_moves.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
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
        loop {
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
                let n = self.next_number();
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
        drop(pointers);
        for n in removed {
            let _ = self.fs.remove(&self.dir.join(table_name(n)));
        }
        Ok(())
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
        let mut lo: Bound<Vec<u8>> = Bound::Unbounded;
        loop {
            let chunk = self.scan(lo.as_ref().map(Vec::as_slice), Bound::Unbounded, 4096)?;
            for (k, v) in &chunk {
                f(k, v)?;
            }
            match chunk.last() {
                Some((k, _)) if chunk.len() == 4096 => lo = Bound::Excluded(k.clone()),
                _ => return Ok(()),
            }
        }
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
                if let Err(e) = f.table.for_each(|e, _| {
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
            let wal = self.fs.create(&self.dir.join(wal::name(gen)))?;
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

/// A cursor over a sorted run of non-overlapping tables (one level ≥ 1), opening the next
/// table when one ends.
struct LevelCursor {
    files: Vec<Arc<TFile>>,
    next: usize,
    cur: Option<TableCursor>,
}

impl LevelCursor {
    fn new(files: Vec<Arc<TFile>>, lo: Bound<&[u8]>) -> Result<LevelCursor> {
        let mut c = LevelCursor { files, next: 0, cur: None };
        if let Some(f) = c.files.first().cloned() {
            c.cur = Some(TableCursor::seek(f.table.clone(), lo, true)?);
            c.next = 1;
        }
        Ok(c)
    }

    fn into_cursor(self) -> Result<Source> {
        Ok(Source::Level(self))
    }
}

/// A scan source over tables.
enum Source {
    Level(LevelCursor),
    Table(TableCursor),
}

impl From<TableCursor> for Source {
    fn from(c: TableCursor) -> Source {
        Source::Table(c)
    }
}

impl Source {
    fn peek(&mut self) -> Result<Option<&crate::sstable::CursorEntry>> {
        match self {
            Source::Table(c) => Ok(c.peek()),
            Source::Level(l) => {
                loop {
                    let empty = l.cur.as_ref().is_none_or(|c| c.peek().is_none());
                    if !empty || l.next >= l.files.len() {
                        break;
                    }
                    let f = l.files[l.next].clone();
                    l.next += 1;
                    l.cur = Some(TableCursor::seek(f.table.clone(), Bound::Unbounded, true)?);
                }
                Ok(l.cur.as_ref().and_then(|c| c.peek()))
            }
        }
    }

    fn skip_key(&mut self, k: &[u8]) -> Result<()> {
        while self.peek()?.is_some_and(|e| e.1 == k) {
            match self {
                Source::Table(c) => c.advance()?,
                Source::Level(l) => {
                    if let Some(c) = l.cur.as_mut() {
                        c.advance()?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::fs::FaultFs;
    use rand::{Rng, SeedableRng};

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
        let cfs = CountingFs::new(Arc::new(fs.clone()));
        let d = Path::new("/lsm");
        if fresh {
            cfs.create_dir_all(d).unwrap();
        }
        let (l, b) = Lsm::open(cfs, d, small(), fresh, Arc::new(Poison::default()), &|| true).unwrap();
        (Arc::new(l), b)
    }

    fn verify(l: &Lsm, model: &BTreeMap<Vec<u8>, Vec<u8>>, rng: &mut rand::rngs::StdRng) {
        for k in 0..400u32 {
            let key = format!("k{:05}", k * 7 % 1000).into_bytes();
            let got = l.get(&key).unwrap().flatten();
            assert_eq!(got.as_ref(), model.get(&key), "{}", String::from_utf8_lossy(&key));
        }
        let all = l.scan(Bound::Unbounded, Bound::Unbounded, usize::MAX).unwrap();
        let want: Vec<_> = model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        assert_eq!(all, want);
        for _ in 0..50 {
            let a = format!("k{:05}", rng.random_range(0..1000)).into_bytes();
            let max = rng.random_range(1..60);
            let got = l.scan(Bound::Included(&a), Bound::Unbounded, max).unwrap();
            let want: Vec<_> = model.range(a.clone()..).take(max).map(|(k, v)| (k.clone(), v.clone())).collect();
            assert_eq!(got, want);
        }
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
