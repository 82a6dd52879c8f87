//! The `hoakv` preset: HoaKV (Liu et al., Electronics 2023, `papers/hoakv.txt`).
//!
//! # What runs here
//! - **Heat** (§3.2): every read and write of a key counts one access. Heat is the access
//!   count over a sliding window of `heat_window` operations (a logical clock, so tests do
//!   not depend on machine speed): each time the window moves on, every heat is halved and
//!   cold keys whose heat reaches 0 leave the cold index. Hot keys keep their heat in the
//!   hot index entry, cold keys in the cold index.
//! - **HotStore** (§3.2–3.3) — [`hot`]: the hot vlog of 2 MiB vTables in PM, the DRAM
//!   cuckoo hot index (N buckets, E hash functions, overflow chains, entry {keyTag,
//!   vTable, slot, heat, next}), the heat-sorted list with the insertion step, and an
//!   ordered map of the hot keys for scans. A write to a hot key rewrites its slot in place
//!   (crash-safe: the other half of the slot, see [`hot`]); no WAL is written for it.
//! - **Algorithm 1**: a cold key whose heat exceeds HeatLimit (the smallest heat in the
//!   HotStore once it is full, 0 before) and has been seen `promote_min_heat` times is
//!   promoted — on a read with its current value, on a write with the new value (which then
//!   goes only to the HotStore). When the HotStore has no room, the coldest hot keys are
//!   demoted first (below).
//! - **ColdStore** — [`crate::lsm`]: WAL + MemTable + a LevelDB-style leveled LSM on the
//!   shared SSTable format and MANIFEST. HoaKV is built on LevelDB (§1: "We implemented a
//!   HoaKV prototype on LevelDB"), so the ColdStore compacts as LevelDB does, seek
//!   compaction included: point reads that search past a table (value-group maintenance's
//!   lookups too), and range reads' samples (`HoaIter`'s `ReadSampler`: about one entry per
//!   MiB of the merge's keys and values; a hot entry counts its key only, a value-log
//!   pointer its 21 bytes), spend its seek allowance (`seek_compactions` in the design
//!   figures).
//! - **Partial KV separation** (§3.4, Algorithm 2): an LSM value is tagged; values longer
//!   than `value_size` are appended to the cold vlog and the LSM keeps a pointer, shorter
//!   ones stay inline ([`layout`]).
//! - **Dynamic value groups** (§3.5) — [`cold`]: cold-vlog values live in groups by key
//!   range. A group whose files pass `group_size` is maintained by the GC thread: the
//!   group starts a new file, its old files are scanned, a record is live when the LSM
//!   still points at it; if the live values exceed half of `group_size` the group splits at
//!   the median live key (two groups with non-overlapping ranges), else the live values are
//!   copied into one new file (garbage collection). The pointers are then rewritten in one
//!   synced LSM batch and the old files removed.
//! - **Cold index** (§3.6): per group, key → heat ([`cold`]).
//! - **Range reads**: the hot keys in order (ordered map) merged over the LSM's sources,
//!   hot entries winning; see below.
//!
//! # Range reads: the iterator
//! [`Engine::iter`] returns `iter::HoaIter`: a [`crate::iter::MergingIterator`] over, newest
//! first,
//! - the **HotStore** (`HotCursor`): the hot keys in key order from the HotStore's ordered key
//!   map (kept on every promotion, demotion, insert and removal; no scan of the cuckoo
//!   table). The cursor copies *keys only* (with each entry's tombstone flag, from the DRAM
//!   index) in batches under the HotStore lock — 16 on a seek, doubling up to 1,024 as a
//!   walk goes on, cut at 64 KiB — and re-positions by key past the batch's edge when it
//!   runs off it; the lock is held for one batch copy, never between calls. Hot values are
//!   overwritten in place in PM (the other half of the slot, then the selector flips), so a
//!   borrowed value could change under the reader: when the merge *returns* a hot entry,
//!   `HoaIter` copies its current value under the lock (one hash probe, the record
//!   verified — what a point read pays). Only returned entries are read: copying and
//!   verifying whole batches of values (the previous design) spent a quarter of a short
//!   scan's time on hot values the scan never returned (measured, 200,000 × 1 KiB). The
//!   cursor prefetches the record of the hot key it stands on, which it reaches well before
//!   the merge returns it. A hot key that left the HotStore between its batch and its value
//!   copy makes the iterator rebuild its sources (below). The trade-off: a walk that
//!   returns every hot key (a full scan) now pays one lock and one hash probe per hot entry
//!   instead of one lock per batch — `readseq` at 500,000 × 1 KiB measured 13–18% slower
//!   than with value batches, while `seekrandom` (100 entries) got 15–25% faster. Copying
//!   values in batches once a walk runs past its first key batch would give both (not
//!   done yet).
//! - the **ColdStore**'s sources ([`crate::lsm::Lsm::sources`]): MemTable and Immutable
//!   MemTable (lock-free skiplists of versioned entries, borrowed from their nodes), each
//!   level-0 table, one concatenating iterator per deeper level, entries borrowed from
//!   pinned blocks.
//!
//! Hot beats cold for a key, as [`Engine::get`] resolves it (a hot record, tombstone
//! included, is the key's newest version). A cold value is decoded only where the merge
//! stops: an inline one is borrowed from its source (no copy); a cold-vlog pointer's record
//! is read into one reused buffer (checksum and key verified) and the value borrowed from
//! it.
//!
//! **What is pinned.** The MemTables (`Arc<Mem>`: a flushed MemTable lives on while an
//! iterator holds it) and the LSM version's tables (`Arc<Table>`s, each holding its file
//! open: a compaction that removes a file does not stop a live iterator reading it). The
//! value-log files an iterator has read from are held open by it (`Arc<dyn FsFile>`, taken
//! from the vlog's readers on first use, one lookup per file, not per entry): group
//! maintenance that removes one does not break the pointers into it that the iterator's
//! pinned sources still hold. A pointer into a file removed *before* the iterator first
//! used it (its value relocated by group maintenance since the sources were made) is
//! resolved as a point read resolves it: under the files gate, the key looked up again
//! (HotStore, then the current LSM). Reclamation is thus deferred by reference counts alone
//! — the last iterator to drop a table or vlog file closes it — and nothing waits for an
//! iterator: flushes, compactions, group maintenance and writers run unhindered.
//!
//! **Keys that move without a write.** Writes to keys the iterator has not reached may or
//! may not show (the engine contract; the snapshot overlay in [`crate::Db`] gives the
//! snapshot). The one move that could make an *unwritten* key wrong is a key leaving the
//! HotStore: a dirty demotion writes the value to the ColdStore (which, after a MemTable
//! switch, the iterator's pinned sources do not hold) and then drops the hot record; a hot
//! batch copied after that would miss the key and the pinned ColdStore would show its
//! older version. So the HotStore counts dirty removals (a clean hot key's value is the
//! ColdStore's newest version already); the iterator reads the count before it takes the
//! LSM's sources, and each hot batch reads it under the same lock: when it moved, the
//! iterator rebuilds its sources (hot cursor and LSM) and replays the move as a seek from
//! the last key it returned (`iter_rebuilds` in the design figures). The same rebuild
//! runs when the value copy of a returned hot entry finds the key no longer hot (it left
//! between its key batch and its value copy, clean or dirty): the rebuilt sources hold it
//! wherever it went. A promotion (by a read: clean) and group maintenance's pointer
//! rewrites leave the value unchanged.
//!
//! **Costs.** A seek: one HotStore lock (a `BTreeMap` range of 16 keys), a skiplist
//! search per MemTable, a block per level-0 table and per deeper level (binary searches of
//! table bounds, index and block; a block of a mapped table file is verified in place at
//! its first read and borrowed, see [`crate::sstable::DecodedBlock`]). A step: O(1) amortised per source plus
//! the merge's one comparison per source and a copy of the current key (the replay point);
//! one HotStore lock per batch of hot keys and one per hot entry returned; no lock for
//! cold entries. Only returned hot values are copied, and cold-vlog values are read (one
//! positional read per value, into the reused buffer). Every range read (`Db::scan`,
//! `Db::iter`, snapshots) goes through this iterator.
//!
//! # Durability and recovery
//! Every write gets a sequence number; hot records and WAL batches carry it.
//! - A hot write is durable when its half is persisted (PM), whatever `sync_wal` says.
//! - A cold write follows `sync_wal` (LevelDB's semantics: off, it survives a process
//!   crash, not power loss).
//! - A batch touching a hot key is written whole to the WAL (synced) before its hot keys
//!   are updated in place, so it is atomic: at recovery a WAL operation newer than the
//!   key's hot record (a crash between the WAL and the PM updates) replaces it.
//! - Demotion writes the victims' values to the ColdStore, syncs the WAL (and the cold vlog
//!   first), and only then invalidates their hot records, so a demoted value is never only
//!   in volatile state. Victims are demoted in batches of 1/32 of the HotStore, so the sync
//!   is paid once per batch. The WAL and every cold vlog file start their write-back every
//!   MiB as they fill ([`crate::fs::create_log`]), so the sync — all other writers wait
//!   for it — finds at most about a MiB per file not yet handed to the device (plus pages
//!   in flight), not every cold write since the last demotion. A *clean* victim — promoted
//!   by a read and not written since — is not written back: the LSM still holds that
//!   value as its newest version (group maintenance keeps a clean hot key's cold value
//!   live), so invalidating the hot record is the whole demotion (the value keeps the
//!   durability it had as a cold write; see [`hot`]).
//! - Recovery: the MANIFEST gives the tables, the hot index is rebuilt from the hot
//!   records (key + checksum + sequence number per record), the WALs newer than the last
//!   flush are replayed except operations older than the key's hot record; hot records
//!   older than a replayed operation are invalidated; the replayed operations are flushed
//!   to a table before the first new write. Every acknowledged write is then readable from
//!   exactly one place: the HotStore when the key is hot there, else the ColdStore.
//! - A full PM device never fails a write here: the HotStore is a cache of hot keys
//!   with the ColdStore behind it. A promotion that finds no PM for its slot is refused
//!   (the key stays cold; `promotions_refused`); a hot key whose grown record finds no
//!   slot is written to the ColdStore like a batch with hot keys (WAL synced) and its hot
//!   record is then dropped (`hot_overflows`).
//! - A crash during group maintenance leaves the new files listed with the old ones (the
//!   group table is rewritten before the pointers change); old files are removed only
//!   after the pointer batch is synced. Files no group lists are removed at open.
//!
//! # Shutdown
//! `close()` and drop set the store's [`crate::jobs::Cancel`], shared with the ColdStore
//! LSM, before joining the workers. LSM compactions check it as [`crate::lsm`] describes.
//! Value-group maintenance checks it every 256 records while it finds the live values and
//! while it copies them, and last before its relocation files are synced and listed; a
//! cancelled one leaves its group sealed (a committed step: the new appender file is
//! listed) and removes the relocation files no group lists. `jobs_cancelled` counts both.
//!
//! # Choices where the paper is silent or we differ
//! - The paper keeps the HotStore "on disk"; here the hot vlog is in PM (SPEC), and each
//!   slot has two halves for the crash-safe in-place update, so a hot record takes twice
//!   its size class (`hot_store_size` counts both halves).
//! - Cuckoo placement does not displace entries (the paper describes none): an entry goes
//!   to the first empty bucket among `h_1..h_E`, else it is chained to `h_E`.
//! - Heat is 16 bits (saturating), not persistent (recovered hot keys start at heat 1,
//!   most recently written first).
//! - `promote_min_heat` (default 2) keeps keys seen once out of the HotStore while it is
//!   not full; without it every first read would promote a key and load would fill the
//!   HotStore with the first keys written.
//! - Demotion is batched (above); the paper demotes one key per promotion.
//! - Split: the paper reads the keys of a group's large values from the SSTables; here the
//!   group's value-log files are scanned and each record checked against the LSM (WiscKey's
//!   GC check), which finds the same live set. The median is the middle live key.
//! - A group's GC and split relocate values into new files; the group's range is locked
//!   only while it switches to a new file (writers of other groups and of small values
//!   never wait). The paper locks the whole group during the split.
//! - The paper allocates a MemTable per group; here one LSM serves every group.
//! - Writers in parallel (the paper measures 32 threads and says nothing of locking):
//!   a write holds the writer lock *shared* plus the stripe locks of its keys (1,024
//!   stripes by `crc32c(key)`, taken in index order), so writes of one key are ordered — a
//!   key's hot record and WAL batches carry increasing sequence numbers, which recovery
//!   compares — and writes of different keys proceed together into the HotStore (its own
//!   reader-writer lock) and the ColdStore (whose WAL append is the only serialised step,
//!   [`crate::lsm::Lsm::write`]). Whatever changes *other* keys takes the writer lock
//!   exclusively: a promotion that must demote the coldest keys, group maintenance's
//!   barrier and its pointer rewrites. A write that promotes its key while the HotStore has
//!   room does it under the shared lock (room check and insert under one HotStore lock);
//!   one that needs a demotion stops before writing anything and retries exclusively, its
//!   heat counted once (every exclusive acquisition parks the other writers: taking and
//!   releasing it was 12 % of the cycles at 2 writers when every promotion took it).
//!   The HotStore's lock is taken shared by whatever only looks (is the key hot, is there
//!   room, a read that counts no access, iterators), exclusively by what changes the index
//!   (promotions, demotions, decay, reads that count an access, the flip that ends an
//!   update). An update of a hot key writes its new record into the inactive half of its
//!   slot and persists the selector under the *shared* lock ([`hot::Hot::stage_update`]:
//!   the key's stripe and the shared writer lock keep every other writer of that slot
//!   out), then flips the index entry under the exclusive lock; only a record that outgrew
//!   its slot is moved under the exclusive lock. A cold write first asks the HotStore's
//!   lock-free filter ([`hot::HotFilter`]) whether its key may be hot, and takes the lock
//!   only when it may: the answer is exact for a key whose stripe the writer holds, since
//!   only that stripe's holder or the exclusive writer lock make a key hot or cold. With
//!   one mutex over the HotStore, held through each hot update's PM write, two writers
//!   parked on it for 2 % of their writes, each park a futex sleep and wake (tens of
//!   microseconds on a VM, more when the holder was descheduled) while the process left
//!   0.7 of its 2 cores idle (`tierkv bench --threads 1,2`, cores busy 1.30 at 2 writers).
//!   With 64 stripes (one byte each, one cache line) two writers met on a stripe about
//!   once in 64 writes; 1,024 make that rare and spread them over 16 lines.

pub mod cold;
pub mod heat;
pub mod hot;
mod iter;
pub mod layout;
pub(crate) mod salvage;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::batch::BatchOp;
use crate::engine::{Cond, Engine, EngineCtx};
use crate::error::{Error, Result};
use crate::iter::BoxedIter;
use crate::lsm::{Lsm, LsmOptions};
use crate::options::HoakvOptions;
use crate::pm::Region;
use crate::poison::Poison;
use crate::stats::Stats;
use cold::{ColdVlog, Group};
use hot::{Hot, HotGet};
use layout::{ColdValue, Pointer};

const HOT_READS: usize = 0;
const COLD_READS: usize = 1;
const HOT_WRITES: usize = 2;
const COLD_WRITES: usize = 3;

/// Counters reported in `Stats::design`.
#[derive(Debug, Default)]
struct Counters {
    /// Per-operation counts, bumped by every get and put: per thread, not a shared line
    /// ([`HOT_READS`], [`COLD_READS`], [`HOT_WRITES`], [`COLD_WRITES`]).
    per_op: crate::counters::Counters<4>,
    promotions: AtomicU64,
    /// Promotions a full PM device refused (the key stayed cold).
    promotions_refused: AtomicU64,
    /// Hot keys moved to the ColdStore because their grown record found no PM slot.
    hot_overflows: AtomicU64,
    demotions: AtomicU64,
    /// Demoted keys whose value the ColdStore held already (nothing written back).
    clean_demotions: AtomicU64,
    demotion_batches: AtomicU64,
    vlog_values: AtomicU64,
    inline_values: AtomicU64,
    group_splits: AtomicU64,
    group_gcs: AtomicU64,
    gc_values_moved: AtomicU64,
    gc_bytes_freed: AtomicU64,
    decays: AtomicU64,
    recovered_stale_hot: AtomicU64,
    recovered_ops: AtomicU64,
    /// Times an iterator rebuilt its ColdStore sources (a dirty hot key left the HotStore
    /// while it walked; see `iter`).
    iter_rebuilds: AtomicU64,
}

#[derive(Debug, Default)]
struct Work {
    groups: BTreeSet<u32>,
    stop: bool,
}

/// Key stripes of the write path ([`Inner::stripes`]).
const STRIPES: usize = 1024;

/// What a write under the writer lock came to.
enum Step {
    /// Written (or refused by its condition: `false`), with the value groups now due for
    /// maintenance.
    Done(bool, Vec<Arc<Group>>),
    /// The key is to be promoted (with this heat, already counted): retry exclusively.
    Promote(u16),
}

struct Inner {
    opts: HoakvOptions,
    region: Arc<Region>,
    hot: RwLock<Hot>,
    /// The HotStore's filter of keys that may be hot, asked without its lock by writes
    /// (which hold their keys' stripes, or the exclusive writer lock on a retry, so the
    /// answer stays true for their keys).
    hot_filter: Arc<hot::HotFilter>,
    lsm: Arc<Lsm>,
    cold: Arc<ColdVlog>,
    /// Writers hold it shared (with their keys' [`Inner::stripes`]); promotions, demotions,
    /// group maintenance's barrier and pointer rewrites take it exclusively.
    writer: RwLock<()>,
    /// Per-key write locks (a key's stripe is `crc32c(key) % STRIPES`): writes of one key
    /// are ordered, writes of different keys run in parallel.
    stripes: Box<[Mutex<()>]>,
    /// One group maintenance at a time.
    maint: Mutex<()>,
    /// Readers hold it shared from an LSM lookup to the value-log read it leads to; the
    /// maintenance takes it exclusively to remove value-log files (WiscKey's GC race).
    files_gate: RwLock<()>,
    seq: AtomicU64,
    clock: AtomicU64,
    next_decay: AtomicU64,
    poison: Arc<Poison>,
    /// Set by `close`/drop before the workers are joined; shared with the LSM. Group
    /// maintenance and LSM compactions check it.
    cancel: Arc<crate::jobs::Cancel>,
    user_bytes: crate::counters::Counters<1>,
    c: Counters,
    work: Mutex<Work>,
    work_cv: Condvar,
}

/// The HoaKV engine. See the module docs.
pub struct Hoakv {
    inner: Arc<Inner>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Hoakv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hoakv").field("region", &self.inner.region).finish()
    }
}

/// What group maintenance did (tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Maintenance {
    /// Nothing to do (no old files).
    Nothing,
    /// Live values copied into one new file.
    Collected {
        /// Live values moved.
        moved: usize,
        /// Bytes of old files removed.
        freed: u64,
    },
    /// The group was split at `median`.
    Split {
        /// The boundary key: the new group starts here.
        median: Vec<u8>,
        /// Live values moved.
        moved: usize,
    },
}

fn lsm_options(ctx: &EngineCtx) -> LsmOptions {
    let o = &ctx.opts.hoakv;
    LsmOptions {
        memtable_size: o.memtable_size,
        level1_size: o.level1_size,
        target_file_size: o.target_file_size,
        block_size: o.block_size,
        bloom_bits_per_key: o.bloom_bits_per_key,
        block_cache_size: o.block_cache_size,
        sync_wal: o.sync_wal,
        background: o.background,
        wal_recovery: ctx.opts.wal_recovery,
        recovery_log: ctx.recovery.clone(),
        ..LsmOptions::default()
    }
}

impl Hoakv {
    /// Open (or create, when `ctx.fresh`) a HoaKV store.
    pub fn open(ctx: EngineCtx) -> Result<Hoakv> {
        let opts = ctx.opts.hoakv.clone();
        let region = Arc::new(crate::engine::open_region(&ctx)?);
        let mut hot = Hot::open(
            region.clone(),
            ctx.fresh,
            opts.hot_store_size,
            opts.vtable_size,
            opts.hash_functions,
            opts.hot_buckets,
        )?;
        let cold = Arc::new(ColdVlog::open(ctx.fs.clone(), &ctx.dir, ctx.fresh, opts.cold_index_capacity)?);
        let poison = Arc::new(Poison::default());
        let cancel = Arc::new(crate::jobs::Cancel::new(ctx.opts.job_probe.clone()));
        let inflight = region.load_u64_atomic(layout::INFLIGHT_ADDR)? != 0;
        let (lsm, batches) =
            Lsm::open(ctx.fs.clone(), &ctx.dir, lsm_options(&ctx), ctx.fresh, poison.clone(), cancel.clone(), &|| {
                inflight
            })?;
        let lsm = Arc::new(lsm);
        let r2 = region.clone();
        lsm.set_commit_hook(Arc::new(move |on| {
            r2.store_u64_atomic(layout::INFLIGHT_ADDR, u64::from(on))?;
            r2.persist(layout::INFLIGHT_ADDR, 8);
            Ok(())
        }));
        let c2 = cold.clone();
        lsm.set_before_durable(Arc::new(move || c2.sync()));
        let batches = drop_batches_past_lost_values(&cold, batches, opts.sync_wal, &ctx.dir)?;
        // Replay: operations older than the key's hot record are superseded by it; a hot
        // record older than a replayed operation is stale and invalidated.
        let seqs = hot.seqs();
        let mut max_seq = hot.max_seq();
        let mut ops = Vec::new();
        let mut stale = HashSet::new();
        for b in batches {
            max_seq = max_seq.max(b.seq);
            for (k, v) in b.ops {
                match seqs.get(&k) {
                    Some(&hs) if hs >= b.seq => continue,
                    Some(_) => {
                        stale.insert(k.clone());
                    }
                    None => {}
                }
                ops.push((k, v));
            }
        }
        let c = Counters::default();
        c.recovered_ops.store(ops.len() as u64, Ordering::Relaxed);
        c.recovered_stale_hot.store(stale.len() as u64, Ordering::Relaxed);
        for k in &stale {
            hot.remove_key(k)?;
        }
        lsm.finish_recovery(ops)?;
        let inner = Arc::new(Inner {
            region,
            hot_filter: hot.filter(),
            hot: RwLock::new(hot),
            lsm,
            cold,
            writer: RwLock::new(()),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            maint: Mutex::new(()),
            files_gate: RwLock::new(()),
            seq: AtomicU64::new(max_seq + 1),
            clock: AtomicU64::new(0),
            next_decay: AtomicU64::new(opts.heat_window),
            poison,
            cancel,
            user_bytes: Default::default(),
            c,
            work: Mutex::new(Work::default()),
            work_cv: Condvar::new(),
            opts,
        });
        let worker = if inner.opts.background {
            let i = inner.clone();
            Some(std::thread::Builder::new().name("tierkv-hoakv-gc".into()).spawn(move || i.worker_loop())?)
        } else {
            None
        };
        Ok(Hoakv { inner, worker: Mutex::new(worker) })
    }

    fn stop_worker(&self) {
        self.inner.cancel.cancel();
        self.inner.work.lock().stop = true;
        self.inner.work_cv.notify_all();
        if let Some(h) = self.worker.lock().take() {
            let _ = h.join();
        }
        self.inner.lsm.stop();
    }

    /// Maintain value group `gid` now (garbage collection or split; tests and tools).
    pub fn maintain_group(&self, gid: u32) -> Result<Maintenance> {
        let g = self.inner.cold.groups().into_iter().find(|g| g.gid == gid);
        match g {
            Some(g) => self.inner.maintain(&g),
            None => Err(Error::InvalidArgument(format!("no value group {gid}"))),
        }
    }

    /// The value groups: (gid, lo, bytes of its files).
    pub fn groups(&self) -> Vec<(u32, Vec<u8>, u64)> {
        let c = &self.inner.cold;
        c.groups().iter().map(|g| (g.gid, g.lo.clone(), c.group_bytes(g))).collect()
    }

    /// Whether `key` is in the HotStore, and its heat there.
    pub fn hot_heat(&self, key: &[u8]) -> Result<Option<u16>> {
        self.inner.hot.read().heat_of(key)
    }

    /// The raw LSM value of `key` (tests: inline or pointer).
    pub fn cold_value(&self, key: &[u8]) -> Result<Option<ColdValue>> {
        match self.inner.lsm.get(key)? {
            Some(Some(v)) => Ok(Some(layout::decode_cold(&v).map_err(Error::InvalidArgument)?)),
            _ => Ok(None),
        }
    }

    /// The heat list is sorted hottest first (tests).
    pub fn heat_order_ok(&self) -> bool {
        self.inner.hot.read().order_ok()
    }
}

impl Drop for Hoakv {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

impl Inner {
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// One access on the logical clock; halves every heat when the window moves on.
    fn tick(&self) {
        let t = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        let nd = self.next_decay.load(Ordering::Relaxed);
        if t >= nd
            && self
                .next_decay
                .compare_exchange(nd, nd + self.opts.heat_window, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.hot.write().decay();
            self.cold.decay();
            self.c.decays.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Decode an LSM value into the user's value (reading the cold vlog for a pointer).
    fn resolve(&self, key: &[u8], raw: &[u8]) -> Result<Vec<u8>> {
        match layout::decode_cold(raw) {
            Ok(ColdValue::Inline(v)) => Ok(v),
            Ok(ColdValue::Pointer(p)) => self.cold.read(key, p),
            Err(d) => Err(Error::Corruption {
                file: "LSM".into(),
                offset: 0,
                detail: format!("value of {}: {d}", crate::escape(key)),
            }),
        }
    }

    fn cold_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let _g = self.files_gate.read();
        match self.lsm.get(key)? {
            Some(Some(raw)) => self.resolve_current(key, &raw),
            _ => Ok(None),
        }
    }

    /// [`Inner::resolve`], for a value read without the writer lock. A pointer into a file
    /// a group maintenance removed can only be a hot key's shadowed cold version (the
    /// maintenance rewrites every other pointer first): the key changed place since the
    /// caller looked, so it is looked up again (HotStore, then LSM). `None`: deleted since.
    fn resolve_current(&self, key: &[u8], raw: &[u8]) -> Result<Option<Vec<u8>>> {
        match self.resolve(key, raw) {
            Ok(v) => Ok(Some(v)),
            Err(e) => {
                let gone = matches!(layout::decode_cold(raw), Ok(ColdValue::Pointer(p)) if !self.cold.has_file(p.file));
                if !gone {
                    return Err(e);
                }
                match self.hot.read().peek(key)? {
                    HotGet::Value(v) => return Ok(Some(v)),
                    HotGet::Deleted => return Ok(None),
                    HotGet::Miss => {}
                }
                match self.lsm.get(key)? {
                    Some(Some(now)) if now != raw => self.resolve(key, &now).map(Some),
                    Some(None) | None => Ok(None),
                    Some(Some(_)) => Err(e),
                }
            }
        }
    }

    /// True when a cold key with this heat and record size passes HeatLimit.
    fn should_promote(&self, klen: usize, vlen: usize, heat: u16) -> bool {
        if heat < self.opts.promote_min_heat {
            return false;
        }
        let hot = self.hot.read();
        match hot.slot_bytes(klen, vlen) {
            Some(need) if need <= self.opts.hot_store_size => heat > hot.heat_limit(need),
            _ => false,
        }
    }

    fn get_impl(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.tick();
        match self.hot.write().get(key, true)? {
            HotGet::Value(v) => {
                self.c.per_op.add(HOT_READS, 1);
                return Ok(Some(v));
            }
            HotGet::Deleted => {
                self.c.per_op.add(HOT_READS, 1);
                return Ok(None);
            }
            HotGet::Miss => {}
        }
        self.c.per_op.add(COLD_READS, 1);
        let v = self.cold_get(key)?;
        if let Some(val) = &v {
            let heat = self.cold.bump(key);
            if self.should_promote(key.len(), val.len(), heat) && !self.poison.is_set() {
                let _w = self.writer.write();
                if !self.hot.read().contains(key)? {
                    // The value again, under the writer lock: a write may have come between.
                    if let Some(cur) = self.cold_get(key)? {
                        // Clean: the ColdStore keeps this value. A full PM device leaves the
                        // key cold; the read has its value.
                        self.promote(key, Some(&cur), heat, true)?;
                    }
                }
            }
        }
        Ok(v)
    }

    /// Whether `key` has a value (no heat counted).
    fn exists(&self, key: &[u8]) -> Result<bool> {
        match self.hot.read().peek(key)? {
            HotGet::Value(_) => return Ok(true),
            HotGet::Deleted => return Ok(false),
            HotGet::Miss => {}
        }
        Ok(matches!(self.lsm.get(key)?, Some(Some(_))))
    }

    /// Make `key` hot with `value`; demotes the coldest keys first when there is no room.
    /// Caller holds the writer lock exclusively. `clean`: `value` is the ColdStore's current value (a
    /// promotion by a read). `false`: the PM device is full, the key stays
    /// cold (nothing of it was written; the caller writes it to the ColdStore).
    fn promote(&self, key: &[u8], value: Option<&[u8]>, heat: u16, clean: bool) -> Result<bool> {
        let need = {
            let hot = self.hot.read();
            let Some(need) = hot.slot_bytes(key.len(), value.map_or(0, <[u8]>::len)) else { return Ok(false) };
            if hot.room() < need {
                Some(need)
            } else {
                None
            }
        };
        if let Some(need) = need {
            self.demote(need.max(self.opts.hot_store_size / 32))?;
        }
        let seq = self.next_seq();
        let r = self.hot.write().insert(key, value, seq, heat, clean);
        self.promoted(key, r)
    }

    /// The end of a promotion, given the HotStore insert's result: the key leaves the cold
    /// index (`true`), or a full PM device refused it (`false`, counted).
    fn promoted(&self, key: &[u8], insert: Result<()>) -> Result<bool> {
        match insert {
            Ok(()) => {}
            Err(Error::PmFull(_)) => {
                self.c.promotions_refused.fetch_add(1, Ordering::Relaxed);
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
        self.cold.forget(key);
        self.c.promotions.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// A write's promotion of its own key that needs no demotion, under the shared writer
    /// lock and the key's stripe: the room check and the insert happen under one HotStore
    /// lock, so no other key is touched. `None`: no room (the caller retries exclusively,
    /// where [`Inner::promote`] demotes); `Some(false)`: refused (a full PM device).
    fn promote_if_room(&self, key: &[u8], value: &[u8], heat: u16) -> Result<Option<bool>> {
        let mut hot = self.hot.write();
        let Some(need) = hot.slot_bytes(key.len(), value.len()) else { return Ok(Some(false)) };
        if hot.room() < need {
            return Ok(None);
        }
        let seq = self.next_seq();
        let r = hot.insert(key, Some(value), seq, heat, false);
        drop(hot);
        self.promoted(key, r).map(Some)
    }

    /// Demote the coldest hot keys until `bytes` of slots are free: their values go to the
    /// ColdStore (synced), then their hot records are invalidated. Clean victims (promoted
    /// by a read, never written since) are already there. Caller holds the writer lock
    /// exclusively.
    fn demote(&self, bytes: u64) -> Result<()> {
        let victims = self.hot.write().take_coldest(bytes)?;
        if victims.is_empty() {
            return Ok(());
        }
        let mut enc: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::with_capacity(victims.len());
        for v in victims.iter().filter(|v| !v.clean) {
            let val = match &v.value {
                Some(val) => Some(self.encode_cold(&v.key, val)?),
                None => None,
            };
            enc.push((v.key.clone(), val));
        }
        if !enc.is_empty() {
            let ops: Vec<(&[u8], Option<&[u8]>)> = enc.iter().map(|(k, v)| (k.as_slice(), v.as_deref())).collect();
            let seq = self.next_seq();
            self.lsm.write(seq, &ops, true)?;
        }
        self.c.clean_demotions.fetch_add((victims.len() - enc.len()) as u64, Ordering::Relaxed);
        if let Err(e) = self.hot.write().remove(&victims) {
            self.poison.set(format!("demotion failed after its values reached the ColdStore: {e}"));
            return Err(e);
        }
        for v in &victims {
            self.cold.remember(&v.key, v.heat);
        }
        self.c.demotions.fetch_add(victims.len() as u64, Ordering::Relaxed);
        self.c.demotion_batches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The LSM value of a cold write (Algorithm 2): a pointer for a value longer than
    /// Value_Size (appended to its group's vlog file), else the value inline.
    fn encode_cold(&self, key: &[u8], value: &[u8]) -> Result<Vec<u8>> {
        if value.len() > self.opts.value_size {
            let p = self.cold.append(key, value, false)?;
            self.c.vlog_values.fetch_add(1, Ordering::Relaxed);
            Ok(layout::encode_pointer(p))
        } else {
            self.c.inline_values.fetch_add(1, Ordering::Relaxed);
            Ok(layout::encode_inline(value))
        }
    }

    fn write_impl(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.poison.check()?;
        for _ in ops {
            self.tick();
        }
        // Shared writer lock and the keys' stripes; a write that promotes its key retries
        // under the exclusive lock (promotion demotes other keys), its heat counted once.
        let step = {
            let _w = self.writer.read();
            let _s = self.lock_stripes(ops);
            self.write_locked(ops, cond, None)?
        };
        let (ok, due) = match step {
            Step::Done(ok, due) => (ok, due),
            Step::Promote(heat) => {
                let _w = self.writer.write();
                match self.write_locked(ops, cond, Some(heat))? {
                    Step::Done(ok, due) => (ok, due),
                    Step::Promote(_) => return Err(Error::Poisoned("hoakv: promotion asked twice".into())),
                }
            }
        };
        for g in due {
            if self.opts.background {
                self.work.lock().groups.insert(g.gid);
                self.work_cv.notify_all();
            } else {
                self.maintain(&g)?;
            }
        }
        Ok(ok)
    }

    /// The stripes of `ops`' keys, locked in index order.
    fn lock_stripes(&self, ops: &[BatchOp]) -> Vec<parking_lot::MutexGuard<'_, ()>> {
        let mut idx: Vec<usize> = ops.iter().map(|o| crc32c::crc32c(o.key()) as usize % STRIPES).collect();
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().filter_map(|i| self.stripes.get(i)).map(|m| m.lock()).collect()
    }

    /// A write under the writer lock: shared with the keys' stripes (`exclusive_heat` is
    /// `None`), or exclusive with the heat the shared attempt counted. In shared mode a
    /// write that would promote its key stops before writing anything and asks for the
    /// exclusive lock.
    fn write_locked(&self, ops: &[BatchOp], cond: Cond, exclusive_heat: Option<u16>) -> Result<Step> {
        fn value_of(o: &BatchOp) -> Option<&[u8]> {
            match o {
                BatchOp::Put { value, .. } => Some(value.as_slice()),
                BatchOp::Delete { .. } => None,
            }
        }
        let due = {
            if let (Some(first), Cond::Absent | Cond::Present) = (ops.first(), cond) {
                if self.exists(first.key())? != (cond == Cond::Present) {
                    return Ok(Step::Done(false, Vec::new()));
                }
            }
            if ops.is_empty() {
                return Ok(Step::Done(true, Vec::new()));
            }
            let user: u64 = ops.iter().map(BatchOp::user_bytes).sum();
            // Most cold keys are told apart without the HotStore's lock: no hot key shares
            // their filter counter, and only this write (holding their stripes) or an
            // exclusive writer could make them hot.
            let hot_keys: Vec<bool> = if ops.iter().any(|o| self.hot_filter.may_contain(o.key())) {
                let hot = self.hot.read();
                ops.iter().map(|o| hot.contains(o.key())).collect::<Result<_>>()?
            } else {
                vec![false; ops.len()]
            };
            // A hot key whose new record needs a slot a full PM device cannot give: written
            // to the ColdStore (synced) below, then its hot record dropped.
            let mut overflow = false;
            if ops.len() == 1 {
                let (key, value) = (ops[0].key(), value_of(&ops[0]));
                if hot_keys[0] {
                    let seq = self.next_seq();
                    // The PM write under the shared HotStore lock (this key's stripe and
                    // the shared writer lock keep its slot ours), the flip exclusive.
                    let staged = self.hot.read().stage_update(key, value, seq);
                    let r = match staged {
                        // PM holds a version the index does not name: no going on.
                        Ok(Some(s)) => {
                            self.hot.write().finish_update(s).inspect_err(|e| self.poison.set(e.to_string()))
                        }
                        Ok(None) => self.hot.write().update(key, value, seq),
                        Err(e) => Err(e),
                    };
                    match r {
                        Ok(()) => {
                            self.c.per_op.add(HOT_WRITES, 1);
                            self.user_bytes.add(0, user);
                            return Ok(Step::Done(true, Vec::new()));
                        }
                        Err(Error::PmFull(_)) => overflow = true,
                        Err(e) => return Err(e),
                    }
                } else {
                    let heat = match exclusive_heat {
                        Some(h) => h,
                        None => self.cold.bump(key),
                    };
                    if let Some(v) = value {
                        if self.should_promote(key.len(), v.len(), heat) {
                            let promoted = match exclusive_heat {
                                // Shared: only a promotion that demotes nobody.
                                None => match self.promote_if_room(key, v, heat)? {
                                    Some(p) => p,
                                    None => return Ok(Step::Promote(heat)),
                                },
                                Some(_) => self.promote(key, Some(v), heat, false)?,
                            };
                            if promoted {
                                self.c.per_op.add(HOT_WRITES, 1);
                                self.user_bytes.add(0, user);
                                return Ok(Step::Done(true, Vec::new()));
                            }
                        }
                    }
                }
            } else {
                for (o, &h) in ops.iter().zip(&hot_keys) {
                    if !h {
                        self.cold.bump(o.key());
                    }
                }
            }
            // The ColdStore gets the whole batch; a batch with hot keys is synced before
            // they are updated in place (the WAL then proves which version is newer).
            let any_hot = hot_keys.iter().any(|&h| h);
            let mut enc: Vec<(&[u8], Option<Vec<u8>>)> = Vec::with_capacity(ops.len());
            for o in ops {
                let v = match value_of(o) {
                    Some(v) => Some(self.encode_cold(o.key(), v)?),
                    None => None,
                };
                enc.push((o.key(), v));
            }
            let lops: Vec<(&[u8], Option<&[u8]>)> = enc.iter().map(|(k, v)| (*k, v.as_deref())).collect();
            let seq = self.next_seq();
            self.lsm.write(seq, &lops, any_hot)?;
            self.c.per_op.add(COLD_WRITES, ops.len() as u64);
            if any_hot {
                // One update per hot key, its last operation: two halves written with the
                // batch's one sequence number would tie at recovery.
                // A full PM device (no slot for a grown record): the key becomes cold, its
                // logged operation is then its newest version (at recovery too: the WAL
                // batch is newer than the hot record, which is invalidated anyway).
                let mut hot = self.hot.write();
                let mut done: HashSet<&[u8]> = HashSet::new();
                for (o, &h) in ops.iter().zip(&hot_keys).rev() {
                    if h && done.insert(o.key()) {
                        let r = match overflow {
                            true => Err(None),
                            false => hot.update(o.key(), value_of(o), seq).map_err(Some),
                        };
                        let r = match r {
                            Ok(()) => Ok(()),
                            Err(None | Some(Error::PmFull(_))) => {
                                self.c.hot_overflows.fetch_add(1, Ordering::Relaxed);
                                hot.remove_key(o.key()).map(|_| ())
                            }
                            Err(Some(e)) => Err(e),
                        };
                        if let Err(e) = r {
                            self.poison.set(format!("hot update of a logged batch failed: {e}"));
                            return Err(e);
                        }
                    }
                }
            }
            self.user_bytes.add(0, user);
            // Groups whose files outgrew GroupSize.
            let mut due = Vec::new();
            for o in ops {
                if value_of(o).is_some_and(|v| v.len() > self.opts.value_size) {
                    let g = self.cold.group_for(o.key());
                    if self.cold.group_bytes(&g) > self.opts.group_size
                        && !due.iter().any(|x: &Arc<Group>| x.gid == g.gid)
                    {
                        due.push(g);
                    }
                }
            }
            due
        };
        Ok(Step::Done(true, due))
    }

    fn worker_loop(self: Arc<Self>) {
        loop {
            let gid = {
                let mut w = self.work.lock();
                loop {
                    if w.stop {
                        return;
                    }
                    if let Some(g) = w.groups.pop_first() {
                        break g;
                    }
                    self.work_cv.wait(&mut w);
                }
            };
            if self.poison.is_set() {
                return;
            }
            let Some(g) = self.cold.groups().into_iter().find(|g| g.gid == gid) else { continue };
            if self.cold.group_bytes(&g) <= self.opts.group_size {
                continue;
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.maintain(&g)));
            match r {
                Ok(r) => self.cancel.poison_failure(&self.poison, "value-group maintenance", &r),
                Err(_) => self.poison.set("value-group maintenance panicked".into()),
            }
        }
    }

    /// Garbage-collect group `g`, splitting it at its median live key when its live values
    /// exceed half of GroupSize. See the module docs for the crash-safety order.
    fn maintain(&self, g: &Arc<Group>) -> Result<Maintenance> {
        let _m = self.maint.lock();
        let r = self.maintain_locked(g);
        // Cancelled before its relocation files were listed: they are the only trace (the
        // seal's new appender file is listed and in use).
        self.cancel.on_cancel(r, || self.cold.remove_unlisted().map(|_| ()))
    }

    /// [`Inner::maintain`] under the maintenance lock. Safe points: every `CHECK_EVERY`
    /// records while finding the live values and while copying them, and before the
    /// relocation files are synced and listed; none after (the commit steps).
    fn maintain_locked(&self, g: &Arc<Group>) -> Result<Maintenance> {
        if g.files.lock().len() <= 1 && self.cold.group_bytes(g) <= 8 {
            return Ok(Maintenance::Nothing);
        }
        let old = self.cold.seal(g)?;
        // Barrier: every cold write that appended to an old file has reached the LSM.
        drop(self.writer.write());
        let lo = g.lo.clone();
        let hi = self.cold.range_end(g);
        let in_range = |k: &[u8]| k >= lo.as_slice() && hi.as_ref().is_none_or(|h| k < h.as_slice());
        let mut live: Vec<(Vec<u8>, Pointer)> = Vec::new();
        let mut seen = 0u64;
        // A dirty hot key's cold version is shadowed (and rewritten at its demotion): not
        // live. A clean one's is its current value: live.
        for &f in &old {
            for (k, p) in self.cold.records(f)? {
                seen += 1;
                self.cancel.every(seen)?;
                if in_range(&k)
                    && self.lsm.get(&k)? == Some(Some(layout::encode_pointer(p)))
                    && !self.hot.read().dirty(&k)?
                {
                    live.push((k, p));
                }
            }
        }
        live.sort_by(|a, b| a.0.cmp(&b.0));
        live.dedup_by(|a, b| a.0 == b.0);
        let live_bytes: u64 = live.iter().map(|(_, p)| u64::from(p.len)).sum();
        let split = live.len() >= 2 && live_bytes * 2 > self.opts.group_size;
        let median = split.then(|| live[live.len() / 2].0.clone());
        let (mut a, na) = self.cold.relocation_file()?;
        let mut b = if split { Some(self.cold.relocation_file()?) } else { None };
        let mut moves = Vec::with_capacity(live.len());
        for (k, p) in &live {
            self.cancel.every(moves.len() as u64 + 1)?;
            let v = self.cold.read(k, *p)?;
            let right = median.as_ref().is_some_and(|m| k >= m);
            let np = match (&mut b, right) {
                (Some((bf, _)), true) => self.cold.append_to(bf, k, &v)?,
                _ => self.cold.append_to(&mut a, k, &v)?,
            };
            moves.push((k.clone(), *p, np));
        }
        // The last safe point: from here the relocation is committed step by step.
        self.cancel.point()?;
        self.cold.finish_file(a)?;
        let mut touched: Vec<Arc<Group>> = vec![g.clone()];
        let outcome = match (b, &median) {
            (Some((bf, nb)), Some(m)) => {
                self.cold.finish_file(bf)?;
                let ng = self.cold.split(g, m.clone(), na, nb, &old)?;
                touched.push(ng);
                self.c.group_splits.fetch_add(1, Ordering::Relaxed);
                Maintenance::Split { median: m.clone(), moved: moves.len() }
            }
            _ => {
                self.cold.add_file(g, na)?;
                self.c.group_gcs.fetch_add(1, Ordering::Relaxed);
                Maintenance::Collected { moved: moves.len(), freed: 0 }
            }
        };
        // Rewrite the pointers still current (a write may have replaced some meanwhile). Keys
        // hot with a newer value than the ColdStore's (dirty) are left alone: the rewrite
        // carries a new sequence number, which at recovery would override their newer hot
        // record. A clean hot key's value is the same either way.
        {
            let _w = self.writer.write();
            let mut enc = Vec::new();
            for (k, oldp, np) in &moves {
                if self.lsm.get(k)? == Some(Some(layout::encode_pointer(*oldp))) && !self.hot.read().dirty(k)? {
                    enc.push((k.clone(), layout::encode_pointer(*np)));
                }
            }
            if !enc.is_empty() {
                let ops: Vec<(&[u8], Option<&[u8]>)> =
                    enc.iter().map(|(k, v)| (k.as_slice(), Some(v.as_slice()))).collect();
                let seq = self.next_seq();
                self.lsm.write(seq, &ops, true)?;
            }
        }
        self.c.gc_values_moved.fetch_add(moves.len() as u64, Ordering::Relaxed);
        let freed = {
            let _g = self.files_gate.write();
            self.cold.drop_files(&touched, &old)?
        };
        self.c.gc_bytes_freed.fetch_add(freed, Ordering::Relaxed);
        Ok(match outcome {
            Maintenance::Collected { moved, .. } => Maintenance::Collected { moved, freed },
            o => o,
        })
    }

    fn live_keys(&self) -> Result<u64> {
        let hot = self.hot.read();
        let hot_keys: HashMap<Vec<u8>, u64> = hot.seqs();
        let live_hot = hot.live();
        drop(hot);
        let mut n = live_hot;
        self.lsm.for_each_live(|k, _| {
            if !hot_keys.contains_key(k) {
                n += 1;
            }
            Ok(())
        })?;
        Ok(n)
    }

    fn check_impl(&self) -> Result<Vec<String>> {
        let mut p = self.lsm.check()?;
        p.extend(self.hot.read().check());
        p.extend(self.cold.check());
        let mut bad = Vec::new();
        let _g = self.files_gate.read();
        let hot_keys = self.hot.read().seqs();
        self.lsm.for_each_live(|k, raw| {
            if hot_keys.contains_key(k) {
                // Shadowed by the hot record; its cold value may point into a value-log file
                // a group maintenance removed (it is rewritten at the key's demotion).
                return Ok(());
            }
            match layout::decode_cold(raw) {
                Ok(ColdValue::Inline(_)) => {}
                Ok(ColdValue::Pointer(ptr)) => {
                    if let Err(e) = self.cold.read(k, ptr) {
                        bad.push(format!("cold value of {}: {e}", crate::escape(k)));
                    }
                }
                Err(d) => bad.push(format!("LSM value of {}: {d}", crate::escape(k))),
            }
            Ok(())
        })?;
        p.extend(bad);
        Ok(p)
    }

    fn stats_impl(&self) -> Stats {
        let (figs, heat_limit, (heap_used, heap_free), dup, hot_dram) = {
            let h = self.hot.read();
            (h.figures(), h.heat_limit(2048), h.heap_bytes(), h.recovered_duplicates, h.dram_bytes())
        };
        let c = &self.c;
        let l = &self.lsm.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut design: Vec<(String, u64)> = vec![
            ("hot_entries".into(), figs.entries),
            ("hot_used_bytes".into(), figs.used_bytes),
            ("hot_vtables".into(), figs.vtables),
            ("hot_overflow_entries".into(), figs.overflow),
            ("hot_buckets".into(), figs.buckets),
            ("heat_limit".into(), u64::from(heat_limit)),
            ("hot_reads".into(), c.per_op.get(HOT_READS)),
            ("cold_reads".into(), c.per_op.get(COLD_READS)),
            ("hot_writes".into(), c.per_op.get(HOT_WRITES)),
            ("cold_writes".into(), c.per_op.get(COLD_WRITES)),
            ("promotions".into(), r(&c.promotions)),
            ("promotions_refused".into(), r(&c.promotions_refused)),
            ("hot_overflows".into(), r(&c.hot_overflows)),
            ("demotions".into(), r(&c.demotions)),
            ("clean_demotions".into(), r(&c.clean_demotions)),
            ("demotion_batches".into(), r(&c.demotion_batches)),
            ("vlog_values".into(), r(&c.vlog_values)),
            ("inline_values".into(), r(&c.inline_values)),
            ("vlog_bytes".into(), self.cold.total_bytes()),
            ("groups".into(), self.cold.groups().len() as u64),
            ("group_splits".into(), r(&c.group_splits)),
            ("group_gcs".into(), r(&c.group_gcs)),
            ("gc_values_moved".into(), r(&c.gc_values_moved)),
            ("gc_bytes_freed".into(), r(&c.gc_bytes_freed)),
            ("jobs_cancelled".into(), self.cancel.jobs_cancelled()),
            ("cold_index_entries".into(), self.cold.index_entries()),
            ("heat_decays".into(), r(&c.decays)),
            ("recovered_ops".into(), r(&c.recovered_ops)),
            ("recovered_stale_hot".into(), r(&c.recovered_stale_hot)),
            ("iter_rebuilds".into(), r(&c.iter_rebuilds)),
            ("recovered_duplicate_slots".into(), dup),
            ("flushes".into(), r(&l.flushes)),
            ("compactions".into(), r(&l.compactions)),
            ("seek_compactions".into(), r(&l.seek_compactions)),
            ("trivial_moves".into(), r(&l.trivial_moves)),
            ("compaction_read_bytes".into(), r(&l.compact_read)),
            ("compaction_written_bytes".into(), r(&l.compact_written)),
            ("tombstones_dropped".into(), r(&l.tombstones_dropped)),
            ("write_stalls".into(), r(&l.write_stalls)),
            ("pm_heap_bytes".into(), heap_used + heap_free),
            ("pm_heap_free_bytes".into(), heap_free),
        ];
        for (i, (n, b)) in self.lsm.level_shape().into_iter().enumerate() {
            design.push((format!("level{i}_tables"), n as u64));
            design.push((format!("level{i}_bytes"), b));
        }
        let design: Vec<(&str, u64)> = design.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let dram = hot_dram + self.lsm.mem_bytes() + self.cold.index_entries() * 48;
        let keys = self.live_keys().unwrap_or(0);
        Stats::engine("hoakv", self.region.stats(), self.user_bytes.get(0), keys, dram, &design)
    }
}

impl Engine for Hoakv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.inner.get_impl(key)
    }

    fn write(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.inner.write_impl(ops, cond)
    }

    fn iter(&self) -> Result<BoxedIter> {
        Ok(Box::new(iter::HoaIter::new(self.inner.clone())))
    }

    fn flush(&self) -> Result<()> {
        self.inner.poison.check()?;
        self.inner.lsm.flush(false)
    }

    fn compact(&self) -> Result<()> {
        self.inner.poison.check()?;
        self.inner.lsm.compact_all()?;
        for g in self.inner.cold.groups() {
            self.inner.maintain(&g)?;
        }
        Ok(())
    }

    fn stats(&self) -> Stats {
        self.inner.stats_impl()
    }

    fn check(&self) -> Result<Vec<String>> {
        self.inner.check_impl()
    }

    fn close(&self) -> Result<()> {
        self.inner.poison.check()?;
        self.stop_worker();
        self.inner.lsm.close()?;
        self.inner.cold.sync()?;
        self.inner.region.sync_all()?;
        Ok(())
    }
}

/// The WAL batches to replay: all of them, unless one points at a cold value-log record
/// that is not there (past the end of its file, or failing its checksum). A WAL that is
/// not synced per write (`sync_wal` false) can come back from a power loss with a page
/// whose value-log page was lost (the value log is synced before the WAL, never after, so
/// a pointer is durable only with its value): that batch and every later one are a torn
/// tail, the writes a power loss took (found by the page model of `FaultFs`). With a synced
/// WAL only the last batch can be in that state (its write was never acknowledged); a bad
/// pointer in an earlier one is damage. Pointers into files that no longer exist are left
/// to the reader (a value relocated by group GC).
fn drop_batches_past_lost_values(
    cold: &ColdVlog,
    mut batches: Vec<crate::lsm::wal::Batch>,
    sync_wal: bool,
    dir: &std::path::Path,
) -> Result<Vec<crate::lsm::wal::Batch>> {
    let last = batches.len().saturating_sub(1);
    let bad = batches.iter().position(|b| {
        b.ops.iter().any(|(k, v)| match v.as_deref().map(layout::decode_cold) {
            Some(Ok(ColdValue::Pointer(p))) => cold.has_file(p.file) && cold.read(k, p).is_err(),
            _ => false,
        })
    });
    if let Some(i) = bad {
        if sync_wal && i != last {
            return Err(Error::corruption(
                dir,
                0,
                "a synced WAL batch points at a cold value-log record that is missing or damaged",
            ));
        }
        batches.truncate(i);
    }
    Ok(batches)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::fs::{CountingFs, FaultFs, Fs};
    use crate::pm::sim::SimDevice;

    pub(super) fn open_with(dev: &SimDevice, fs: &FaultFs, o: HoakvOptions, fresh: bool) -> Hoakv {
        let opts = crate::testing::sim_options(crate::Preset::Hoakv, dev, fs).hoakv(o);
        let cfs = CountingFs::new(Arc::new(fs.clone()));
        let dir = std::path::PathBuf::from("/h");
        if fresh {
            cfs.create_dir_all(&dir).unwrap();
        }
        Hoakv::open(EngineCtx {
            dir,
            opts,
            fs: cfs,
            db_id: 7,
            fresh,
            pm_health: Arc::default(),
            recovery: Arc::default(),
        })
        .unwrap()
    }

    pub(super) fn put(h: &Hoakv, k: &[u8], v: &[u8]) {
        assert!(h.write(&[BatchOp::Put { key: k.to_vec(), value: v.to_vec() }], Cond::None).unwrap());
    }

    pub(super) fn stat(h: &Hoakv, k: &str) -> u64 {
        h.stats().design.get(k).copied().unwrap_or(0)
    }

    /// Algorithm 1: a key read often enough crosses HeatLimit and is promoted; when the
    /// HotStore is full, the coldest hot keys are demoted into the ColdStore, and the heat
    /// list stays sorted hottest first.
    #[test]
    fn a_key_crossing_heat_limit_is_promoted_and_the_coldest_demoted() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = HoakvOptions { hot_store_size: 8 << 10, heat_window: 1 << 30, ..crate::testing::hoakv_small() };
        let h = open_with(&dev, &fs, o, true);
        for i in 0..64u32 {
            put(&h, format!("k{i:03}").as_bytes(), &[b'v'; 40]);
        }
        assert_eq!(stat(&h, "promotions"), 0, "a key seen once is not hot");
        // 256-byte slots in an 8 KiB store: 32 hot keys. The put counted one access; the
        // first read (heat 2) promotes, the second makes heat 3.
        for _ in 0..2 {
            for i in 0..32u32 {
                h.get(format!("k{i:03}").as_bytes()).unwrap();
            }
        }
        assert_eq!(stat(&h, "promotions"), 32);
        assert_eq!(h.hot_heat(b"k000").unwrap(), Some(3));
        assert!(h.hot_heat(b"k040").unwrap().is_none());
        h.get(b"k000").unwrap();
        // HeatLimit is now 3 (the full store's coldest): k040 is promoted once its heat
        // exceeds it, at 4, and a batch of the coldest hot keys is demoted for it.
        for heat in 2..=3u16 {
            h.get(b"k040").unwrap();
            assert!(h.hot_heat(b"k040").unwrap().is_none(), "heat {heat} does not exceed HeatLimit 3");
        }
        h.get(b"k040").unwrap();
        assert_eq!(h.hot_heat(b"k040").unwrap(), Some(4));
        assert!(stat(&h, "demotions") >= 1, "the HotStore was full: someone was demoted");
        assert_eq!(h.hot_heat(b"k000").unwrap(), Some(4), "the hottest key stays");
        assert!(h.heat_order_ok());
        // Demoted keys are cold again, with their values.
        let demoted: Vec<u32> =
            (1..32).filter(|i| h.hot_heat(format!("k{i:03}").as_bytes()).unwrap().is_none()).collect();
        assert_eq!(demoted.len() as u64, stat(&h, "demotions"));
        for i in demoted {
            let k = format!("k{i:03}");
            assert!(matches!(h.cold_value(k.as_bytes()).unwrap(), Some(ColdValue::Inline(_))));
            assert_eq!(h.get(k.as_bytes()).unwrap(), Some(vec![b'v'; 40]));
        }
        // A hot write is an in-place update (no WAL), and survives a crash.
        put(&h, b"k000", b"new");
        assert!(h.check().unwrap().is_empty());
        drop(h);
        let h = open_with(&dev.simulate_crash(1, 0.5), &fs.crash(), crate::testing::hoakv_small(), false);
        assert_eq!(h.get(b"k000").unwrap(), Some(b"new".to_vec()));
        assert_eq!(h.get(b"k040").unwrap(), Some(vec![b'v'; 40]));
    }

    /// A clean hot key (promoted by a read) keeps its cold value: group maintenance relocates
    /// it like a cold key's, and demotion writes nothing back but reads it from there.
    #[test]
    fn clean_hot_keys_survive_group_maintenance_and_demote_without_a_write() {
        // 700-byte values (over Value_Size 64: in the cold vlog), 1,536-byte hot slots: a
        // HotStore of exactly four, 16 KiB groups.
        let o = HoakvOptions { hot_store_size: 4 * 1536, heat_window: 1 << 30, ..crate::testing::hoakv_small() };
        let h = open_with(&SimDevice::new(), &FaultFs::new(), o, true);
        let k = |i: u32| format!("k{i:02}").into_bytes();
        let v = |i: u32, r: u8| vec![r.wrapping_add(i as u8); 700];
        for i in 0..20 {
            put(&h, &k(i), &v(i, 0));
        }
        for i in 0..4 {
            assert_eq!(h.get(&k(i)).unwrap(), Some(v(i, 0)));
            assert!(h.hot_heat(&k(i)).unwrap().is_some(), "k{i} promoted by its second access");
        }
        // Overwrites push the group past GroupSize: maintenance moves every live value,
        // the clean hot keys' included, and removes the old files.
        let before = stat(&h, "gc_values_moved");
        for r in 1..4u8 {
            for i in 10..20 {
                put(&h, &k(i), &v(i, r));
            }
        }
        assert!(stat(&h, "group_gcs") + stat(&h, "group_splits") >= 1);
        assert!(stat(&h, "gc_values_moved") - before >= 14, "the four clean hot keys' values moved too");
        // Hotter keys take the four slots; the clean victims are not written back (reads and
        // promotions write PM only; a dirty victim would write the WAL).
        let disk = h.stats().disk_bytes_written;
        for i in 4..8 {
            h.get(&k(i)).unwrap();
            h.get(&k(i)).unwrap();
        }
        assert_eq!(stat(&h, "clean_demotions"), 4);
        assert_eq!(h.stats().disk_bytes_written, disk, "a clean demotion writes nothing");
        for i in 0..4 {
            assert!(h.hot_heat(&k(i)).unwrap().is_none(), "k{i} demoted");
            assert_eq!(h.get(&k(i)).unwrap(), Some(v(i, 0)), "k{i} read back from the relocated cold value");
        }
        assert!(h.check().unwrap().is_empty());
    }

    /// Algorithm 2: cold values longer than Value_Size go to the cold vlog (the LSM keeps a
    /// pointer), shorter ones stay inline.
    #[test]
    fn large_cold_values_go_to_the_vlog_small_ones_inline() {
        let h = open_with(&SimDevice::new(), &FaultFs::new(), crate::testing::hoakv_small(), true);
        put(&h, b"small", &[1; 64]);
        put(&h, b"large", &[2; 65]);
        assert!(matches!(h.cold_value(b"small").unwrap(), Some(ColdValue::Inline(v)) if v == vec![1; 64]));
        assert!(matches!(h.cold_value(b"large").unwrap(), Some(ColdValue::Pointer(_))));
        assert_eq!(h.get(b"large").unwrap(), Some(vec![2; 65]));
        assert_eq!((stat(&h, "vlog_values"), stat(&h, "inline_values")), (1, 1));
    }

    /// A group over GroupSize splits at its median live key into two groups with
    /// non-overlapping ranges; garbage collection reclaims overwritten values.
    #[test]
    fn a_group_over_group_size_splits_at_the_median_and_gc_reclaims_space() {
        // No promotions here: every value stays in the ColdStore.
        let o = HoakvOptions { group_size: 1 << 20, promote_min_heat: u16::MAX, ..crate::testing::hoakv_small() };
        let h = open_with(&SimDevice::new(), &FaultFs::new(), o, true);
        // 200 live values of 1 KiB, written twice: 400 KiB of files, 200 KiB live.
        for round in 0..2u8 {
            for i in 0..200u32 {
                put(&h, format!("g{i:04}").as_bytes(), &[round; 1000]);
            }
        }
        let before = h.groups();
        assert_eq!(before.len(), 1);
        assert!(before[0].2 > 400_000);
        // Garbage collection: live 200 KiB < GroupSize / 2: one group, half the bytes.
        match h.maintain_group(0).unwrap() {
            Maintenance::Collected { moved, freed } => {
                assert_eq!(moved, 200);
                assert!(freed > 400_000, "freed {freed}");
            }
            m => panic!("expected a collection, got {m:?}"),
        }
        let after = h.groups();
        assert!(after[0].2 < 220_000, "group bytes after GC: {}", after[0].2);
        for i in 0..200u32 {
            assert_eq!(h.get(format!("g{i:04}").as_bytes()).unwrap(), Some(vec![1; 1000]));
        }
        // Now a smaller GroupSize makes the same live set a split: at the median key.
        drop(h);
        let o = HoakvOptions { group_size: 150 << 10, promote_min_heat: u16::MAX, ..crate::testing::hoakv_small() };
        let h = open_with(&SimDevice::new(), &FaultFs::new(), o, true);
        for i in 0..200u32 {
            put(&h, format!("g{i:04}").as_bytes(), &[3; 1000]);
        }
        // Writes past GroupSize triggered the maintenance (inline in this mode).
        assert_eq!(stat(&h, "group_splits"), 1);
        let g = h.groups();
        assert_eq!(g.len(), 2);
        assert!(g[0].1.is_empty() && g[1].1.as_slice() > b"g0000".as_slice());
        // The boundary is the median of the live keys present at the split.
        let split_at = String::from_utf8(g[1].1.clone()).unwrap();
        let n: u32 = split_at[1..].parse().unwrap();
        let live_then = stat(&h, "gc_values_moved") as u32;
        assert_eq!(n, live_then / 2, "median of {live_then} keys");
        for i in 0..200u32 {
            assert_eq!(h.get(format!("g{i:04}").as_bytes()).unwrap(), Some(vec![3; 1000]));
        }
        assert!(h.check().unwrap().is_empty());
        let scanned = crate::iter::collect_range(
            &mut *h.iter().unwrap(),
            std::ops::Bound::Unbounded,
            std::ops::Bound::Unbounded,
            1000,
        )
        .unwrap();
        assert_eq!(scanned.len(), 200);
    }

    /// Writes of keys in different stripes do not wait for each other; a write of a key
    /// whose stripe is held waits for it.
    #[test]
    fn writers_of_different_keys_do_not_wait_for_each_other() {
        let h = Arc::new(open_with(&SimDevice::new(), &FaultFs::new(), crate::testing::hoakv_small(), true));
        let stripe = |k: &[u8]| crc32c::crc32c(k) as usize % STRIPES;
        let a = b"key-a".to_vec();
        let b = (0..).map(|i| format!("key-b{i}").into_bytes()).find(|k| stripe(k) != stripe(&a)).unwrap();
        let held = h.inner.stripes[stripe(&a)].lock();
        // b's write completes while a's stripe is held (it would hang otherwise: the
        // channel's timeout turns a hang into a failure).
        let (tx, rx) = std::sync::mpsc::channel();
        let h2 = h.clone();
        let b2 = b.clone();
        std::thread::spawn(move || {
            put(&h2, &b2, b"vb");
            tx.send(()).unwrap();
        });
        rx.recv_timeout(std::time::Duration::from_secs(60)).expect("a write of another stripe waited");
        let h3 = h.clone();
        let writer_a = std::thread::spawn(move || put(&h3, b"key-a", b"va"));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!writer_a.is_finished(), "a write went past its key's held stripe");
        drop(held);
        writer_a.join().unwrap();
        assert_eq!(h.get(b"key-a").unwrap(), Some(b"va".to_vec()));
        assert_eq!(h.get(&b).unwrap(), Some(b"vb".to_vec()));
    }

    /// Four writers over shared and private keys, with reads promoting keys into a small
    /// HotStore (so promotions and demotions run against the writers): every key ends with
    /// its last write, before and after a crash.
    #[test]
    fn concurrent_writers_with_promotions_keep_every_last_write() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        // A short heat window: heats halve every 256 accesses, so the hot set keeps changing.
        let o = HoakvOptions { hot_store_size: 16 << 10, heat_window: 256, ..crate::testing::hoakv_small() };
        let h = Arc::new(open_with(&dev, &fs, o.clone(), true));
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let h = h.clone();
                std::thread::spawn(move || {
                    let mut last = std::collections::BTreeMap::new();
                    for i in 0..400u32 {
                        // Each thread owns keys t, t+4, …; reads of them heat them up.
                        let k = format!("k{:03}", (i * 7 + t) % 40 * 4 + t).into_bytes();
                        let v = format!("{t}-{i}-").repeat(1 + (i % 30) as usize).into_bytes();
                        if i % 5 == 4 {
                            let b = vec![
                                BatchOp::Put { key: k.clone(), value: v.clone() },
                                BatchOp::Delete { key: format!("gone{t}").into_bytes() },
                            ];
                            assert!(h.write(&b, Cond::None).unwrap());
                        } else {
                            put(&h, &k, &v);
                        }
                        last.insert(k.clone(), v);
                        for _ in 0..3 {
                            h.get(&k).unwrap();
                        }
                    }
                    last
                })
            })
            .collect();
        let mut want = std::collections::BTreeMap::new();
        for t in threads {
            want.extend(t.join().unwrap());
        }
        assert!(
            stat(&h, "promotions") > 0 && stat(&h, "demotions") > 0,
            "no promotion or demotion ran: {:?}",
            h.stats().design
        );
        for (k, v) in &want {
            assert_eq!(h.get(k).unwrap().as_ref(), Some(v), "{}", String::from_utf8_lossy(k));
        }
        assert!(h.check().unwrap().is_empty());
        drop(Arc::try_unwrap(h).ok().unwrap());
        let h = open_with(&dev.simulate_crash(3, 0.3), &fs.crash(), o, false);
        for (k, v) in &want {
            assert_eq!(h.get(k).unwrap().as_ref(), Some(v), "after a crash: {}", String::from_utf8_lossy(k));
        }
    }
}
