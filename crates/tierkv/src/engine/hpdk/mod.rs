//! The `hpdk` preset: HPDK (Liu et al., IEEE TC 2024, `papers/hpdk.txt`).
//!
//! # What runs here
//! - **Value log in PM** (§III-D) — [`vlog`]: values are appended to value-log pools (PM
//!   extents of `vlog_pool_size`, 128 MiB by default), one pool open for writes at a time;
//!   a record is `size u32 | value | crc u32`; a value's address is a 2-byte pool number and
//!   a 4-byte offset. Each pool counts its live items; a pool whose count reaches zero is
//!   reused when the open pool fills.
//! - **Write path** (§IV-A): value → value log (persisted) → address; the key-address pair →
//!   WAL (a file; fsynced only with `sync_wal`, as in the paper and LevelDB) → DRAM MemTable
//!   of key → address. A full MemTable becomes the Immutable MemTable, which a background
//!   thread flushes.
//! - **Level compression** (§III-B): a flush writes the Immutable MemTable's key-address
//!   pairs as one SSTable (the shared format, [`crate::sstable`]) into its own PM extent —
//!   one table per PM "pool", as the paper's PMDK pools — in a single level 0; there is no
//!   level-to-level compaction. The MANIFEST ([`crate::manifest`]) records each table with
//!   its total and live item counts and the merge candidate set.
//! - **DRAM B+-tree** (§III-C, Fig. 3) — [`crate::index::bplus`]: the newest key → {6-byte
//!   value address, 2-byte SSTable pool number}, updated during the flush; deletes remove the
//!   key. A GET reads MemTable → Immutable MemTable → tree → value log, never an SSTable.
//! - **Live-item-rate dynamic merge** (§III-E, Algorithm 1) — [`jobs`]: a table whose live
//!   rate falls below `live_rate_threshold` (0.5) joins the candidate set; at
//!   `merge_trigger` candidates a background merge frees fully dead tables, merge-sorts the
//!   rest, keeps the items whose tree entry still points at them (address *and* table),
//!   writes them to a new table and repoints the tree. Flushes may overwrite a moved item
//!   before the merge installs; at install (`InstallMergeResult`), with no flush running, the
//!   output's live count is taken from the tree, so such races never leave it wrong.
//!   A merge log file makes a crash mid-merge restart it.
//! - **Recovery** (§IV-B): MANIFEST + the newest usable B+-tree recovery file (written by
//!   every merge and at clean shutdown) + replay of the tables newer than it + WAL replay.
//!   Value pools' write positions come from the recovery file and a scan of what follows;
//!   live counts are recounted from the tree.
//! - **Ablations** (Fig. 7): `use_btree = false` is HPDK-NT (a GET searches the level, newest
//!   table first), `enable_merge = false` is HPDK-NGC.
//! - **Range reads**: the two MemTables merged with the B+-tree; values read from the log
//!   (below).
//!
//! # Concurrent writers
//! A write has three steps: (1) its values into the value log, persisted; (2) its
//! key-address pairs as one WAL record; (3) the MemTable. Step 1 of an unconditional write
//! runs before the writer lock is taken, under the value log's own lock only, so one
//! writer's value copy and flush overlap another's WAL `write` system call and MemTable
//! insert (a two-stage pipeline; the value log and the WAL are each still one
//! append-ordered log). A conditional write (`put_if_absent`…) runs all three under the
//! writer lock, as before, so nothing is written when its condition fails.
//!
//! Crash consistency is unchanged. The value log is still appended in one order with no
//! gap (each append writes, flushes and fences its records under the value-log lock
//! before it advances the pool's write position, so recovery's scan finds every record
//! before the position); the WAL record, written only after its values are durable, is
//! still the commit point, and it names its values by address, so WAL order need not
//! follow value-log order. What a crash can leave is what it could before: values no WAL
//! record names (garbage: live counts come from the tree and the WAL replay). A value
//! appended but not yet logged counts as a MemTable reference of its pool from the append
//! on (`mem_refs`), whichever MemTable it then lands in, so its pool cannot be reused
//! meanwhile. The writer re-checks the poison flag after taking the writer lock: a WAL
//! write that failed meanwhile may have left a torn record, after which nothing may be
//! appended.
//!
//! Steps 2 and 3 of unconditional writes are group-committed (LevelDB's writer queue,
//! [`crate::group`]): writers whose values are logged queue their WAL records; the one at
//! the front takes the writer lock once, appends the queued records (up to 1 MiB) with one
//! `write`, and inserts their pairs into the MemTable in queue order, the order of the
//! records in the WAL (the MemTable keeps no sequence numbers, so a key written twice in a
//! group must end with its later address, as recovery's replay would). Before, every
//! writer took the writer lock around its own `write` system call; at 8 threads on 2
//! cores the lock's holder was often descheduled mid-call while the others spun and
//! yielded (`sched_yield` was 17 % of the samples; fillrandom at 8 threads 0.93× one
//! thread). A member returns only after its group's append and inserts; a failed append
//! fails (and poisons) the whole group. A full MemTable is rotated before the append, not
//! after, so a failed rotation fails only writes that wrote nothing.
//!
//! # Shutdown
//! `close()` and drop set the store's [`crate::jobs::Cancel`] before joining the workers.
//! A merge checks it before each input table, every 256 items read, filtered or added to
//! the output, and last before the output is placed in PM; from the placement on (the
//! tree points at the new table) it runs to its commit. A cancelled merge has written
//! only its merge log, which it removes: the store is as before the merge
//! (`jobs_cancelled`). Flushes are not cancelled (close flushes the MemTables anyway).
//! The flush worker returns on `stop` even when a flush was just asked of it, so once the
//! workers are stopped a rotation (close's own, or a write still running) flushes the
//! waiting Immutable MemTable itself rather than wait for them (it waited for ever before:
//! `jobs::tests::close_flushes_an_immutable_memtable_its_stopped_workers_left`).
//!
//! # Choices where the paper is silent or we differ
//! - The value log and the tables share one PM heap ([`crate::pm::heap`]); a two-level
//!   directory in pool 0 (docs/format/hpdk.md) names each value pool's extent and
//!   generation and each table's extent and number. The heap has no metadata of its own: it
//!   is rebuilt at open from the directories.
//! - A pool is reused only when no tree entry and no MemTable entry refers to it, and only
//!   after the flush that removed the last reference is committed in the MANIFEST — so no
//!   state a crash can return to still needs its bytes. A record's checksum covers the
//!   pool's generation, so a reused pool's old records never verify as new ones.
//! - The recovery file is written *before* the merge's MANIFEST commit and lists the tables
//!   it was taken against; at open the newest file whose table list equals the MANIFEST's
//!   tables up to the file's `covered` number is used. A merge drops tombstones, so a
//!   recovery without the matching file could resurrect deleted keys: no usable file is
//!   `Corruption`. A new store writes an empty one.
//! - Tables carry tombstones (needed to replay tables newer than the recovery file); a
//!   tombstone is never live, so a table of deletes is an immediate merge candidate.
//! - Recovered WAL entries are flushed to a table during open, and the WALs removed.
//! - Clean shutdown flushes the MemTables and writes the recovery file, so restart replays
//!   nothing (the paper's "normal exit").
//! - HPDK-NT keeps no tree, so its flushes count no live items and it runs no merge (the
//!   merge validates items through the tree) and reuses no pool.
//! - A GET holds the MemTable or tree read lock while it copies a value out of PM, so a
//!   pool cannot be reused under it; an iterator pins pools instead (below).
//! - The merge candidate-set threshold is not given in the paper; we use 4.
//! - A new store makes its value pools up to 1 % smaller than `vlog_pool_size` when that lets
//!   them tile a PM pool exactly (the default 128 MiB becomes 128 MiB − 64 B, two per 256 MiB
//!   PM pool): every PM pool starts with a 64-byte header, and at the exact size each PM pool
//!   held one value pool and ~128 MiB only tables could use, so PM filled at twice the
//!   values' size. The size used is the one in the superblock.
//!
//! # Range reads: the iterator
//! `Engine::iter` returns an `iter::HpdkIter`: a [`crate::iter::MergingIterator`] of
//! key → value address over, newest first, the MemTable, the Immutable MemTable and the
//! DRAM B+-tree (HPDK-NT: the level's SSTables, newest first, as
//! [`crate::sstable::TableIter`]s), and on top of it the resolution of the current entry's
//! address to its record in the value log.
//! - **Sources.** The iterator takes the two MemTables as they are when it is created
//!   (`Arc`s: a MemTable that is flushed meanwhile stays readable, and its entries stay
//!   what they were) and the tree itself. A source empty at creation is left out: whatever
//!   reaches it later was written after the iterator started. Every key not written while
//!   the iterator lives is in one of these sources for its whole life with the same
//!   address, so the merge returns it with its value.
//! - **Mutable DRAM structures, copied in batches.** The MemTable maps and the tree are
//!   changed in place under their locks, so nothing borrowed from them survives a call.
//!   Each is read through a [`crate::index::bplus::ReadAhead`] cursor: a refill takes the
//!   read lock once, re-positions by key (strictly after the last key returned, or before
//!   the first) and copies a batch of keys and 8-byte addresses (32 entries after a seek,
//!   doubling to 512 along a walk); moving within the batch takes no lock. Writers, flushes
//!   and merges wait at most for one batch copy. A merge rewrites only the tree's table
//!   part, never a value's address, so it changes nothing an iterator returns.
//! - **Values, pinned and borrowed.** Values are not copied: `value()` borrows the record's
//!   bytes in PM, verified (bounds; checksum the first time an iterator of this open store
//!   meets the record, remembered in [`crate::pm::checked`] by address, length and pool
//!   generation, so later walks read only the record's header). The
//!   iterator registers an epoch with the value log at creation (`Vlog::pin`); a pool
//!   whose live count falls to zero is not reused while an iterator registered before
//!   that moment lives (another idle pool, or a new extent, is taken instead;
//!   `value_pool_reuse_deferred_by_iterators` in the design figures counts it). An
//!   iterator registered later cannot hold an address into that pool, since no source
//!   refers to it any more. The pool table is cached per iterator (a pinned pool's
//!   location and generation do not change). HPDK-NT reuses no pool and frees no table.
//! - **Prefetch.** The log holds values in write order, so consecutive keys' records are
//!   far apart and each step would wait for memory: a cursor prefetches the record header
//!   of the entry 6 steps ahead in its batch and the whole record (length from that
//!   header) 3 steps ahead, so a walk overlaps those misses (about 2× on a 200k × 1 KiB
//!   `seek` + 100 `next` micro-benchmark).
//! - **Cost.** A seek: one descent of each source under its lock plus a batch copy of
//!   keys; a `next`: amortised O(1) (a step in a batch, a comparison per source in the
//!   merge, one checksum of the value read); no allocation per entry (batch buffers are
//!   reused). Every range read (`Db::scan`, `Db::iter`, snapshots) goes through it.

pub(crate) mod iter;
pub mod jobs;
pub mod layout;
pub(crate) mod salvage;
pub mod vlog;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::batch::BatchOp;
use crate::engine::{Cond, Engine, EngineCtx};
use crate::error::{Error, Result};
use crate::fs::{CountingFs, Fs, FsFile};
use crate::index::bplus::BPlusTree;
use crate::manifest::{Manifest, Version};
use crate::options::HpdkOptions;
use crate::pm::heap::Heap;
use crate::pm::Region;
use crate::sstable::{Kind, Table};
use crate::stats::Stats;
use vlog::Vlog;

/// A write's key-address pairs (`None`: a delete) and its encoded WAL record.
type Logged<'a> = (Vec<(&'a [u8], Option<u64>)>, Vec<u8>);

/// MemTable value of a deletion.
pub(crate) const TOMB: u64 = u64::MAX;
/// Entries per B+-tree node.
const TREE_NODE: usize = 64;
/// DRAM bytes charged per MemTable entry besides its key (address, map node).
const MEM_ENTRY_OVERHEAD: u64 = 48;

/// A DRAM MemTable of key → value address (or [`TOMB`]), with the WAL generation that
/// logs it and how many of its entries point into each value pool.
#[derive(Debug)]
pub(crate) struct Mem {
    pub(crate) map: RwLock<BTreeMap<Vec<u8>, u64>>,
    pub(crate) bytes: AtomicU64,
    pub(crate) gen: u64,
    pub(crate) refs: Mutex<HashMap<u16, u64>>,
}

impl Mem {
    fn new(gen: u64) -> Mem {
        Mem { map: RwLock::new(BTreeMap::new()), bytes: AtomicU64::new(0), gen, refs: Mutex::new(HashMap::new()) }
    }

    fn insert(&self, key: &[u8], a: u64) {
        let mut m = self.map.write();
        if m.insert(key.to_vec(), a).is_none() {
            self.bytes.fetch_add(key.len() as u64 + MEM_ENTRY_OVERHEAD, Ordering::Relaxed);
        }
        if a != TOMB {
            *self.refs.lock().entry(layout::split_vaddr(a).0).or_insert(0) += 1;
        }
    }
}

#[derive(Debug)]
pub(crate) struct MemState {
    pub(crate) active: Arc<Mem>,
    pub(crate) imm: Option<Arc<Mem>>,
}

impl MemState {
    /// The newest entry of `key`: the MemTable's, else the Immutable MemTable's.
    fn lookup(&self, key: &[u8]) -> Option<u64> {
        let hit = self.active.map.read().get(key).copied();
        hit.or_else(|| self.imm.as_ref().and_then(|m| m.map.read().get(key).copied()))
    }
}

/// A table of level 0, placed in PM.
#[derive(Debug)]
pub(crate) struct PmTable {
    pub(crate) number: u64,
    pub(crate) slot: u16,
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) table: Arc<Table>,
}

/// The MANIFEST and its version.
#[derive(Debug)]
pub(crate) struct VersionState {
    pub(crate) version: Version,
    pub(crate) manifest: Manifest,
}

/// The writer's state: the open WAL.
#[derive(Debug)]
pub(crate) struct Writer {
    pub(crate) wal: Box<dyn FsFile>,
    pub(crate) wal_gen: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Work {
    pub(crate) flush: bool,
    pub(crate) merge: bool,
    pub(crate) stop: bool,
    pub(crate) restart: Option<Vec<u64>>,
}

/// Figures reported in `Stats::design`.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) flushes: AtomicU64,
    pub(crate) merges: AtomicU64,
    pub(crate) merge_inputs: AtomicU64,
    pub(crate) dead_tables_freed: AtomicU64,
    pub(crate) items_kept: AtomicU64,
    pub(crate) items_dropped: AtomicU64,
    pub(crate) install_conflicts: AtomicU64,
    pub(crate) dumps: AtomicU64,
    pub(crate) write_stalls: AtomicU64,
    /// Bumped by gets (per thread, not a shared line).
    pub(crate) nt_tables_probed: crate::counters::Counters<1>,
}

pub(crate) struct Inner {
    pub(crate) region: Arc<Region>,
    pub(crate) heap: Mutex<Heap>,
    pub(crate) fs: CountingFs,
    pub(crate) dir: PathBuf,
    pub(crate) opts: HpdkOptions,
    pub(crate) writer: Mutex<Writer>,
    /// Unconditional writes queue here for the writer lock (group commit): one leader
    /// appends the group's WAL records in one `write` and inserts its pairs.
    pub(crate) commits: crate::group::Queue<Pending>,
    pub(crate) mem: RwLock<MemState>,
    /// key → value address << 16 | table slot.
    pub(crate) tree: RwLock<BPlusTree<u64>>,
    pub(crate) vlog: Vlog,
    pub(crate) version: Mutex<VersionState>,
    /// Tables by slot (committed ones, and the merge output in flight).
    pub(crate) tables: RwLock<HashMap<u16, Arc<PmTable>>>,
    /// Serialises flushes; a merge takes it to number its output and to install.
    pub(crate) flush_job: Mutex<()>,
    pub(crate) merge_job: Mutex<()>,
    pub(crate) work: Mutex<Work>,
    pub(crate) work_cv: Condvar,
    pub(crate) flushed_cv: Condvar,
    pub(crate) flushed_mu: Mutex<()>,
    pub(crate) poisoned: crate::poison::Poison,
    /// Set by `close`/drop before the workers are joined; merges check it.
    pub(crate) cancel: crate::jobs::Cancel,
    pub(crate) user_bytes: crate::counters::Counters<1>,
    pub(crate) counters: Counters,
    /// Number of the recovery file that matches the committed version (the last one
    /// written, or the one open chose): the only one `remove_old_dumps` keeps.
    pub(crate) dump: AtomicU64,
}

/// An unconditional write waiting for its group's commit: its WAL record, and the
/// key-address pairs (`TOMB`: a delete) the leader inserts into the MemTable in queue order
/// (the order of the records in the WAL, which recovery replays).
#[derive(Debug)]
pub(crate) struct Pending {
    rec: Vec<u8>,
    pairs: Vec<(Vec<u8>, u64)>,
}

/// Most WAL bytes one group commit appends (a leader stops taking queued writes there).
const MAX_GROUP_BYTES: usize = 1 << 20;

/// Pack a tree value: value address and table slot.
pub(crate) fn tv(addr: u64, slot: u16) -> u64 {
    (addr << 16) | u64::from(slot)
}

/// Unpack a tree value.
pub(crate) fn untv(v: u64) -> (u64, u16) {
    (v >> 16, v as u16)
}

/// File name of WAL generation `g`.
pub fn wal_name(g: u64) -> String {
    format!("wal-{g:06}.log")
}

/// File name of the recovery file covering tables up to `n`.
pub fn dump_name(n: u64) -> String {
    format!("BTREE-{n:06}")
}

/// File name of the merge log.
pub const MERGE_LOG: &str = "MERGE.log";

/// The HPDK engine. See the module docs.
pub struct Hpdk {
    inner: Arc<Inner>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Hpdk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hpdk").field("region", &self.inner.region).finish()
    }
}

impl Hpdk {
    /// Open (or create, when `ctx.fresh`) an HPDK store.
    pub fn open(ctx: EngineCtx) -> Result<Hpdk> {
        let (inner, restart) = jobs::open_inner(&ctx)?;
        let inner = Arc::new(inner);
        inner.flush_imm()?;
        let mut workers = Vec::new();
        if inner.opts.background {
            inner.work.lock().restart = restart;
            for (name, merge) in [("tierkv-hpdk-flush", false), ("tierkv-hpdk-merge", true)] {
                let i = inner.clone();
                workers.push(std::thread::Builder::new().name(name.into()).spawn(move || worker_loop(i, merge))?);
            }
            inner.work_cv.notify_all();
        } else if let Some(inputs) = restart {
            inner.merge_tables(&inputs)?;
        }
        Ok(Hpdk { inner, workers: Mutex::new(workers) })
    }

    fn stop_workers(&self) {
        self.inner.cancel.cancel();
        self.inner.work.lock().stop = true;
        self.inner.work_cv.notify_all();
        for h in self.workers.lock().drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for Hpdk {
    fn drop(&mut self) {
        self.stop_workers();
    }
}

fn worker_loop(inner: Arc<Inner>, merger: bool) {
    loop {
        let restart = {
            let mut w = inner.work.lock();
            loop {
                if w.stop {
                    return;
                }
                if merger && (w.merge || w.restart.is_some()) {
                    w.merge = false;
                    break w.restart.take();
                }
                if !merger && w.flush {
                    w.flush = false;
                    break None;
                }
                inner.work_cv.wait(&mut w);
            }
        };
        if inner.poisoned.is_set() {
            inner.flushed_cv.notify_all();
            return;
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<()> {
            if merger {
                if let Some(inputs) = restart {
                    inner.merge_tables(&inputs)?;
                }
                inner.maybe_merge(false)
            } else {
                inner.flush_imm()
            }
        }));
        match r {
            Ok(Ok(())) => {}
            // Stopped by close at a safe point, its partial work discarded: not a failure.
            Ok(Err(e)) if inner.cancel.is_cancellation(&e) => {}
            Ok(Err(e)) => {
                inner.poisoned.set(format!("background {} failed: {e}", if merger { "merge" } else { "flush" }))
            }
            Err(_) => inner.poisoned.set(format!("background {} panicked", if merger { "merge" } else { "flush" })),
        }
        inner.flushed_cv.notify_all();
    }
}

impl Inner {
    pub(crate) fn signal(&self, f: impl FnOnce(&mut Work)) {
        f(&mut self.work.lock());
        self.work_cv.notify_all();
    }

    /// The newest MemTable entry of `key`, read while the MemTable lock is held: `Some(None)`
    /// for a delete.
    /// The newest value of `key` lent to `f` from the value log in PM (no copy), under the
    /// MemTable or tree read lock that found its address (so its pool cannot be reused
    /// meanwhile). Returns whether the key exists.
    fn get_with_impl(&self, key: &[u8], f: &mut dyn FnMut(&[u8])) -> Result<bool> {
        {
            let mem = self.mem.read();
            match mem.lookup(key) {
                None => {}
                Some(TOMB) => return Ok(false),
                Some(a) => return self.vlog.read_with(&self.region, a, f).map(|()| true),
            }
        }
        if self.opts.use_btree {
            let tree = self.tree.read();
            return match tree.get(key) {
                Some(&v) => self.vlog.read_with(&self.region, untv(v).0, f).map(|()| true),
                None => Ok(false),
            };
        }
        // HPDK-NT: search level 0, newest table first (it reuses no value pool).
        match self.level_get(key)? {
            Some(a) => self.vlog.read_with(&self.region, a, f).map(|()| true),
            None => Ok(false),
        }
    }

    fn get_impl(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let mut out = None;
        self.get_with_impl(key, &mut |v| out = Some(v.to_vec()))?;
        Ok(out)
    }

    /// HPDK-NT's lookup: the newest table holding `key` decides.
    fn level_get(&self, key: &[u8]) -> Result<Option<u64>> {
        let tables = self.level_newest_first();
        for t in tables {
            self.counters.nt_tables_probed.add(0, 1);
            if let Some((kind, v)) = t.table.get(key)? {
                return match kind {
                    Kind::Delete => Ok(None),
                    Kind::Put => layout::vaddr_from(&v)
                        .map(Some)
                        .ok_or_else(|| Error::corruption(t.table.path(), 0, "malformed value address")),
                };
            }
        }
        Ok(None)
    }

    /// Level 0, newest table first. HPDK-NT runs no merge, so the only table not yet in the
    /// MANIFEST is the one a flush is committing, whose entries the Immutable MemTable (read
    /// first) still holds.
    fn level_newest_first(&self) -> Vec<Arc<PmTable>> {
        let mut t: Vec<Arc<PmTable>> = self.tables.read().values().cloned().collect();
        t.sort_unstable_by_key(|x| std::cmp::Reverse(x.number));
        t
    }

    /// True when `key` exists (no value read).
    fn exists(&self, key: &[u8]) -> Result<bool> {
        if let Some(a) = self.mem.read().lookup(key) {
            return Ok(a != TOMB);
        }
        if self.opts.use_btree {
            Ok(self.tree.read().get(key).is_some())
        } else {
            Ok(self.level_get(key)?.is_some())
        }
    }

    fn write_impl(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.poisoned.check()?;
        if ops.is_empty() {
            return Ok(true);
        }
        // 1. Values into the value log, persisted. An unconditional write appends them
        // before it takes the writer lock (see "Concurrent writers" in the module docs); a
        // conditional one decides and appends under it, so that nothing is written for a
        // write whose condition fails.
        let conditional = matches!(cond, Cond::Absent | Cond::Present);
        let user: u64 = ops.iter().map(BatchOp::user_bytes).sum();
        if !conditional {
            // Steps 2 and 3 by the group's leader (see "Concurrent writers").
            let (wops, rec) = self.log_values(ops)?;
            let pairs = wops.iter().map(|(k, a)| (k.to_vec(), a.unwrap_or(TOMB))).collect();
            let joins = |g: &[Arc<crate::group::Entry<Pending>>], next: &Pending| {
                g.iter().map(|e| e.item.rec.len()).sum::<usize>() + next.rec.len() <= MAX_GROUP_BYTES
            };
            self.commits.submit(Pending { rec, pairs }, joins, |g| match self.commit_group(g) {
                Ok(()) => g.iter().map(|_| Ok(true)).collect(),
                Err(e) => g.iter().map(|_| Err(e.duplicate())).collect(),
            })?;
            self.user_bytes.add(0, user);
            return Ok(true);
        }
        let mut w = self.writer.lock();
        // A WAL write that failed meanwhile may have left a torn record: append nothing.
        self.poisoned.check()?;
        self.make_room(&mut w)?;
        if self.exists(ops[0].key())? != (cond == Cond::Present) {
            return Ok(false);
        }
        let (wops, rec) = self.log_values(ops)?;
        // 2. Key-address pairs into the WAL (one record: the batch replays whole or not).
        self.wal_append(&mut w, &rec)?;
        // 3. The MemTable.
        {
            let mem = self.mem.read();
            for (k, a) in &wops {
                mem.active.insert(k, a.unwrap_or(TOMB));
            }
        }
        self.user_bytes.add(0, user);
        Ok(true)
    }

    /// Before a write's WAL append (writer lock held): a full active MemTable is made
    /// immutable and a new one and WAL started ([`Inner::rotate`]). Rotating *before* the
    /// append (LevelDB's `MakeRoomForWrite`) means a rotation that fails (a flush that
    /// failed and poisoned, a WAL file that cannot be created) fails writes that wrote
    /// nothing; rotating after told a writer whose record was durable and visible that it
    /// had failed. A MemTable can go past its size by one write (or one group).
    fn make_room(&self, w: &mut Writer) -> Result<()> {
        if self.mem.read().active.bytes.load(Ordering::Relaxed) >= self.opts.memtable_size {
            self.rotate(w)?;
        }
        Ok(())
    }

    /// Append WAL bytes (whole records), synced when the options ask. A failure poisons:
    /// the bytes may be partly in the file, and later records would follow garbage.
    fn wal_append(&self, w: &mut Writer, bytes: &[u8]) -> Result<()> {
        if let Err(e) = w.wal.append(bytes).and_then(|_| if self.opts.sync_wal { w.wal.sync() } else { Ok(()) }) {
            self.poisoned.set(format!("WAL write failed: {e}"));
            return Err(e.into());
        }
        Ok(())
    }

    /// A group leader's commit (steps 2 and 3 for every queued write in `group`, oldest
    /// first): under the writer lock, their WAL records in one append, then their pairs
    /// into the MemTable in the same order, so a key written twice in one group ends with
    /// its later value in memory as in the WAL's replay.
    fn commit_group(&self, group: &[Arc<crate::group::Entry<Pending>>]) -> Result<()> {
        let mut w = self.writer.lock();
        // A WAL write that failed meanwhile may have left a torn record: append nothing.
        self.poisoned.check()?;
        self.make_room(&mut w)?;
        let joined;
        let bytes: &[u8] = match group {
            [one] => &one.item.rec,
            _ => {
                joined = group.iter().flat_map(|e| e.item.rec.iter().copied()).collect::<Vec<u8>>();
                &joined
            }
        };
        self.wal_append(&mut w, bytes)?;
        {
            let mem = self.mem.read();
            for e in group {
                for (k, a) in &e.item.pairs {
                    mem.active.insert(k, *a);
                }
            }
        }
        Ok(())
    }

    /// Step 1 of a write: its values into the value log, persisted (one fence), and its WAL
    /// record encoded. Returns the key-address pairs (`None`: a delete) and the record.
    fn log_values<'a>(&self, ops: &'a [BatchOp]) -> Result<Logged<'a>> {
        let values: Vec<&[u8]> = ops
            .iter()
            .filter_map(|o| match o {
                BatchOp::Put { value, .. } => Some(value.as_slice()),
                BatchOp::Delete { .. } => None,
            })
            .collect();
        let addrs = self.vlog.append(self, &values)?;
        let mut it = addrs.into_iter();
        let wops: Vec<(&[u8], Option<u64>)> = ops
            .iter()
            .map(|o| match o {
                BatchOp::Put { key, .. } => (key.as_slice(), it.next()),
                BatchOp::Delete { key } => (key.as_slice(), None),
            })
            .collect();
        let rec = layout::encode_wal(&wops);
        Ok((wops, rec))
    }

    /// Make the active MemTable immutable (waiting for the previous one's flush) and start a
    /// new MemTable and WAL. Caller holds the writer lock.
    pub(crate) fn rotate(&self, w: &mut Writer) -> Result<()> {
        if self.mem.read().imm.is_some() {
            if self.opts.background {
                self.counters.write_stalls.fetch_add(1, Ordering::Relaxed);
            }
            loop {
                if self.mem.read().imm.is_none() {
                    break;
                }
                // Once `close` stopped the workers nobody else flushes (the flush worker
                // returns on `stop` even with a flush asked for): flush here.
                if self.opts.background && !self.work.lock().stop {
                    let mut g = self.flushed_mu.lock();
                    if self.mem.read().imm.is_some() {
                        self.signal(|w| w.flush = true);
                        self.flushed_cv.wait_for(&mut g, std::time::Duration::from_millis(50));
                    }
                    drop(g);
                    self.poisoned.check()?;
                } else {
                    self.flush_imm()?;
                }
            }
        }
        let gen = w.wal_gen + 1;
        let path = self.dir.join(wal_name(gen));
        let wal = self.fs.create(&path)?;
        if self.opts.sync_wal {
            self.fs.sync_dir(&self.dir)?;
        }
        w.wal = wal;
        w.wal_gen = gen;
        {
            let mut mem = self.mem.write();
            let old = std::mem::replace(&mut mem.active, Arc::new(Mem::new(gen)));
            mem.imm = Some(old);
        }
        if self.opts.background {
            self.signal(|w| w.flush = true);
        } else {
            self.flush_imm()?;
            self.maybe_merge(false)?;
        }
        Ok(())
    }

    fn stats_impl(&self) -> Stats {
        let pm = self.region.stats();
        let (files, live, total, cands, bytes) = self.version.lock().version.summary();
        // Live keys = tree keys, plus MemTable puts of keys the tree lacks, minus MemTable
        // deletes of keys it has (the newest MemTable version of each key counts). Locks in
        // the scan's order: MemTables, tree, maps.
        let (keys, tree_bytes, live_keys, mem_keys, mem_bytes) = {
            let m = self.mem.read();
            let t = self.tree.read();
            let active = m.active.map.read();
            let imm = m.imm.as_ref().map(|i| i.map.read());
            let mut live = t.len() as i64;
            let mut count = |k: &[u8], a: u64| match (a != TOMB, t.get(k).is_some()) {
                (true, false) => live += 1,
                (false, true) => live -= 1,
                _ => {}
            };
            for (k, a) in active.iter() {
                count(k, *a);
            }
            for (k, a) in imm.iter().flat_map(|i| i.iter()) {
                if !active.contains_key(k) {
                    count(k, *a);
                }
            }
            let imm_bytes = m.imm.as_ref().map_or(0, |i| i.bytes.load(Ordering::Relaxed));
            (
                t.len() as u64,
                t.dram_bytes() as u64,
                live.max(0) as u64,
                active.len() as u64 + imm.as_ref().map_or(0, |i| i.len() as u64),
                m.active.bytes.load(Ordering::Relaxed) + imm_bytes,
            )
        };
        let vs = self.vlog.stats();
        let heap = self.heap.lock();
        let c = &self.counters;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let design = [
            ("sstables", files),
            ("sstable_bytes", bytes),
            ("live_items_in_sstables", live),
            ("total_items_in_sstables", total),
            ("merge_candidates", cands),
            ("memtable_keys", mem_keys),
            ("memtable_bytes", mem_bytes),
            ("tree_keys", keys),
            ("flushes", ld(&c.flushes)),
            ("merges", ld(&c.merges)),
            ("jobs_cancelled", self.cancel.jobs_cancelled()),
            ("merge_input_tables", ld(&c.merge_inputs)),
            ("merge_dead_tables_freed", ld(&c.dead_tables_freed)),
            ("merge_items_kept", ld(&c.items_kept)),
            ("merge_items_dropped", ld(&c.items_dropped)),
            ("merge_install_conflicts", ld(&c.install_conflicts)),
            ("recovery_files_written", ld(&c.dumps)),
            ("write_stalls", ld(&c.write_stalls)),
            ("nt_tables_probed", c.nt_tables_probed.get(0)),
            ("value_pools", vs.pools),
            ("value_pools_reused", vs.reused),
            ("value_pool_live_items", vs.live),
            ("value_records_written", vs.records),
            ("value_pool_reuse_deferred_by_iterators", vs.reuse_deferred),
            ("pm_heap_bytes", heap.total()),
            ("pm_heap_free_bytes", heap.free_bytes()),
        ];
        Stats::engine("hpdk", pm, self.user_bytes.get(0), live_keys, tree_bytes + mem_bytes, &design)
    }
}

impl Engine for Hpdk {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.inner.get_impl(key)
    }

    fn get_with(&self, key: &[u8], f: &mut dyn FnMut(&[u8])) -> Result<bool> {
        self.inner.get_with_impl(key, f)
    }

    fn write(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.inner.write_impl(ops, cond)
    }

    fn iter(&self) -> Result<crate::iter::BoxedIter> {
        Ok(Box::new(iter::HpdkIter::new(&self.inner)))
    }

    fn flush(&self) -> Result<()> {
        self.inner.poisoned.check()?;
        let mut w = self.inner.writer.lock();
        self.inner.flush_all(&mut w)
    }

    fn compact(&self) -> Result<()> {
        self.inner.poisoned.check()?;
        let mut w = self.inner.writer.lock();
        self.inner.flush_all(&mut w)?;
        self.inner.maybe_merge(true)
    }

    fn stats(&self) -> Stats {
        self.inner.stats_impl()
    }

    fn check(&self) -> Result<Vec<String>> {
        self.inner.check_impl()
    }

    fn close(&self) -> Result<()> {
        self.stop_workers();
        self.inner.close_impl()
    }
}
