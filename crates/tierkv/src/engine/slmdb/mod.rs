//! The `slmdb` preset: SLM-DB (Kaiyrakhmet et al., FAST '19, `papers/slmdb.txt`).
//!
//! # What runs here
//! - **Persistent MemTable** (§3.1, Algorithm 1) — [`memtable`]: MemTable and Immutable
//!   MemTable are skiplists whose bottom level lives in PM, linked with persisted 8-byte
//!   pointer stores; no WAL; the volatile upper levels are rebuilt at open.
//! - **Persistent B+-tree** (§3.2) — [`crate::index::pbtree`], FAST & FAIR style, mapping
//!   full byte-string keys to location objects {file, block offset, block size}. The paper
//!   converts string keys to integers; we store the keys (the issue forbids a lossy
//!   conversion). The location object also names the entry's offset in its block (a word
//!   the record had spare; "Choices").
//! - **Single level of SSTables** ([`crate::sstable`]) with the shared MANIFEST
//!   ([`crate::manifest`]) recording each file's `{total, live}` keys and the candidate list.
//! - **Flush** (§3.2 "Building a B+-tree") — [`jobs`]: a file-creation step writes the
//!   Immutable MemTable's newest puts to one SSTable and fsyncs it, then hands the keys through
//!   a queue to a B+-tree insertion thread; deletes remove keys from the tree; the live count
//!   of a file holding a key's old version is decremented; then the MANIFEST edit is logged
//!   and the Immutable MemTable freed. The SSTable carries no deletion markers: the tree is
//!   the authority on which keys exist.
//! - **Selective compaction** (§3.3) — [`jobs`]: candidates come from the live-key ratio
//!   (< `live_key_threshold`), round-robin leaf-node scans (`leaf_scan_files` SSTables' worth
//!   of keys; > `leaf_node_threshold` distinct files) and the sequentiality degree of range
//!   queries (sub-ranges of `seq_subrange_keys`; > `seq_degree_threshold` files); each can
//!   be switched off. The candidate with the largest summed overlap ratio is merged with the
//!   candidates that overlap it (at most `max_merge_files`), keeping only entries the tree
//!   still points at; outputs are cut at `output_file_size` and each is handed to the
//!   insertion thread as soon as it is synced.
//! - **Compaction log in PM** (§3.3, §5) — [`complog`]: `Moved(key, old file)` for every key
//!   a job repoints, plus the job's inputs and outputs.
//! - **Get** (§4): MemTable → Immutable MemTable → B+-tree → one block read. **Range query**:
//!   B+-tree iterator merged with both MemTable iterators ("Range reads", below).
//!   `insert_if_absent` / `update_if_present` look the key up the same way (the B+-tree
//!   answers existence without disk I/O).
//!
//! # Crash consistency
//! PM holds a superblock, two root slots (MemTable arenas, compaction log, next MemTable
//! generation; the valid slot with the higher generation wins), the tree anchor and the heap.
//! An acknowledged write is a persisted, linked MemTable node. Recovery:
//! 1. reads the root, rebuilds the PM heap from what the root, the tree, the arenas and the
//!    log reference, and repairs the tree ([`crate::index::pbtree`]);
//! 2. reads the MANIFEST (torn tail dropped) and opens every live SSTable;
//! 3. recovers both MemTables (unlinking a batch that was only partly linked);
//! 4. resolves the in-flight jobs from their compaction logs (compaction first): a **flush** whose MemTable
//!    generation the MANIFEST already records is finished (log dropped); otherwise it is
//!    rolled forward — its SSTable was synced before the log began, so every key of the
//!    Immutable MemTable is re-applied to the tree idempotently (a key logged as moved is
//!    not logged or decremented twice) and the edit committed. A **compaction** whose inputs
//!    the MANIFEST no longer lists is finished (inputs deleted); otherwise it is rolled back —
//!    each moved key is pointed back at its block in the old file (found through that file's
//!    index), the outputs are deleted — and restarted on the same inputs (§5);
//! 5. flushes a leftover Immutable MemTable, deletes SSTables no version references and,
//!    after a rollback, recounts every file's live keys from the tree.
//!
//! # Shutdown
//! `close()` and drop set the store's [`crate::jobs::Cancel`] before joining the worker. A
//! compaction checks it before each output file and every 256 merged entries (the flush
//! in its middle and flushes themselves are not cancelled: a flush is one MemTable, and
//! close leaves both MemTables in PM rather than flush them). A write still running when
//! the worker stopped that needs a rotation flushes the waiting Immutable MemTable itself
//! (it waited for ever before: `jobs::tests::a_write_after_the_worker_stopped_does_not_wait_for_it`);
//! that flush may land after close's final PM sync — such a write is not promised (see
//! `Db::close`). A cancelled compaction stops with its shipped outputs applied to the
//! tree and logged; it then does what recovery does after a crash, without the restart:
//! keys moved into its outputs point back at their blocks in the inputs, the inputs lose
//! the live keys flushes moved on meanwhile (one MANIFEST edit), the compaction log is
//! released and every output file is deleted. The store is as if it never ran
//! (`jobs_cancelled` counts it); a crash during that undo is recovered from the log.
//!
//! # Choices where the paper is silent
//! - **Locations name their entry.** The paper's location object names the block; a read
//!   then searches the block for the key. Ours also names where the key's entry starts in
//!   the block (the leaf record's spare word, `docs/format/slmdb.md`), so a point read and
//!   the range cursor decode that one entry (checking its key) instead of every entry before
//!   it — with 1 KiB values each entry header is a cache miss of its own, and the range
//!   cursor can prefetch the exact entry ahead of time. A record without it (written before
//!   the field, or by a compaction's roll-back) reads as the paper's location object.
//! - Flushes are serialised and compactions are serialised; in background mode a flush runs
//!   in the middle of a compaction when a MemTable fills (as LevelDB flushes inside a long
//!   compaction). The compaction then installs an entry only if the key still points at its
//!   input, output live counts are settled at its commit, and each job has its own log in
//!   the root. A writer that fills the MemTable while the Immutable one is still being
//!   flushed waits (a stall).
//! - **Writers.** The paper's MemTable takes one writer at a time (as LevelDB's). Here a
//!   lone unconditional put or delete — most writes — takes no lock of its own: it holds
//!   the MemTable state (`mem`) shared, writes its node (its 1 KiB copy and the write-back
//!   of its lines) in arena space claimed with an atomic bump, then takes the MemTable's
//!   index lock only to link it (`memtable`, "Writers": the numbering rule that keeps a
//!   key's nodes newest first).
//!   Batches and conditional writes take the `writer` lock and apply under the index lock
//!   (numbers drawn there; a condition decided there, from what lies below the active
//!   memtable looked up before that lock: the index lock is never held while the tree's
//!   is taken, as `stats` takes them the other way round), and MemTable rotation takes the
//!   `writer` lock and then the MemTable state's write lock, which waits for every lone
//!   writer still writing into the old MemTable (they hold its read side). The design
//!   figure `writes_renumbered` counts the lone writes that were overtaken by a newer write
//!   of their key. Measured (`tierkv bench --engines slmdb --threads 1,2,8 --workloads
//!   fillrandom --num 200000`, two interleaved pairs, 2 / 8 threads relative to 1): every
//!   writer under the `writer` lock 0.91 / 1.01 and 0.78 / 0.83; the lone-write path 1.09 /
//!   1.06 and 1.11 / 1.05 (p99 at 8 threads 7.6–8.7 µs before, 100–111 µs after: eight
//!   threads on two cores now wait on the index lock, a `parking_lot` lock, where they
//!   slept on the `writer` futex before). Tried and not kept: the index lock as a `std`
//!   `RwLock` (futex) — two interleaved pairs of the same sweep: p99 at 8 threads 12.5 µs
//!   against 108–116 µs, but 8 writers fell to 0.95–0.96× one writer (243,969–253,668
//!   puts/s against 272,036–283,629).
//!
//!   History: the `writer` lock is a `std::sync::Mutex` (a futex: a short spin, then
//!   sleep), not `parking_lot`'s, whose waiters spin and then call `sched_yield` before they
//!   sleep: with every write under it, 8 writers on this 2-core machine spent ~14 % of the
//!   samples in task switches, yields, the scheduler's spin unlocks and `lock_slow`, and
//!   fillrandom fell below one writer's (three interleaved pairs, 2 / 4 / 8 threads
//!   relative to 1: `parking_lot` 0.95 / 0.94 / 0.90, 1.05 / 0.90 / 0.94, 0.81 / 0.81 /
//!   0.83; `std` 0.76 / 1.06 / 1.24, 0.87 / 1.28 / 1.23, 1.02 / 0.91 / 1.22). Tried and not
//!   kept: every writer through the shared group-commit queue (`crate::group`, as pmekv's);
//!   two writers gained (0.89–0.96× one writer → 1.03–1.14×), eight lost (0.99–1.05× →
//!   0.91–1.07×, p99 7 µs → 261–273 µs: eight waiters yielding on two cores delay the
//!   leader).
//! - SSTables are memory-mapped where the file system allows (as LevelDB maps its tables);
//!   elsewhere an 8 MiB block cache (LevelDB's default) holds verified data blocks.
//! - MemTable reads trust nodes (all verified at recovery; `check` verifies them again).
//! - The PM heap has no persistent metadata (as in `pmekv`): it is rebuilt at open, so space
//!   allocated but not yet linked at a crash is reclaimed.
//! - Key-range overlap ratios need numbers; a key maps to the big-endian value of its first
//!   8 bytes after the prefix the compared ranges share.
//! - Point readers hold the tree's read lock while reading a block, so a compaction can
//!   delete its inputs once it has taken the write lock after its commit. Iterators hold no
//!   lock between calls: they keep the tables they read open instead (below).
//!
//! # Range reads: the iterator
//! `Engine::iter` returns an `iter::SlmdbIter`: the paper's range query, three sources
//! merged newest first by [`crate::iter::MergingIterator`] — the MemTable, the Immutable
//! MemTable (when one exists at creation) and the B+-tree.
//! - **MemTables.** A read-ahead cursor ([`crate::index::bplus::ReadAhead`]) copies a batch
//!   of keys and newest-node addresses from the volatile upper levels under their read lock
//!   (32 after a seek, doubling to 512) and re-positions by key between batches; writers
//!   wait at most for one batch copy. The value is borrowed from the node in PM (nodes are
//!   never modified once linked; trusted as `get` trusts them). A delete shows as a
//!   tombstone and hides the older versions below it.
//! - **B+-tree.** The same cursor over the tree ([`crate::index::pbtree::PTree::walk`]:
//!   forward along the leaf chain, backward by descents below each leaf's lower bound),
//!   records verified, copying keys and location objects — never a node address, so
//!   splits and the frees of records and nodes by later writes cannot touch it. Values are
//!   read from the SSTable block a location names: the block verified in place in the
//!   mapped file (at its first read by the open table; a block cache lookup only for a
//!   file that is not mapped, since slmdb never caches a mapped table's blocks) ([`crate::sstable::DecodedBlock`]). The tree's files
//!   overlap (every flush spans the key space), so a walk meets runs of keys from a few
//!   files' blocks in turn; the cursor keeps the last eight decoded blocks (a slot reused
//!   least recently used first), so a block is loaded once per walk, not once per run of its
//!   keys (keeping only the last block re-verified a block at nearly every key: half of a
//!   range read's time, measured; the paper's get reads a block per key). Keys a MemTable
//!   shadows are still resolved by the tree cursor as it steps past them. The cursor
//!   prefetches the entry (or, for a location without its entry, the first bytes of the
//!   block) named four entries ahead in its batch (after a seek or a refill, of the first
//!   four), decodes only the entry its location names, and finds a block's verified bit from its handle through the
//!   table's slot table ([`crate::sstable`], "Reading"), not a search. The merge over the
//!   three sources keeps the tree cursor current after one comparison while its next key
//!   precedes both MemTables' ([`crate::iter::MergingIterator`]): the tree holds nearly
//!   every key. Measured together with the shared changes (seekrandom, 500,000 × 1 KiB,
//!   three interleaved runs per binary): 16.8k / 11.5k / 15.3k scans/s before the slot
//!   table, 17.2k / 15.4k / 19.6k after; 15.5–17.1k / 18.3–18.7k before / after the merge's
//!   runner-up test.
//! - **Pinned.** (1) The MemTable `Arc`s taken at creation. A flush frees the Immutable
//!   MemTable's PM arena after it left `mem`; an iterator registered before that
//!   (`pm::pins::Pins`, as pmekv's value slots) may still read its nodes, so the free is
//!   *parked* until the last such iterator drops. An iterator registered after the free
//!   cannot have taken that MemTable (it registers first, then reads `mem`). (2) The
//!   SSTables of the current tree batch, as `Arc<Table>` (open files, maps) taken under the
//!   tree's read lock in the refill — a compaction drops a table from `tables` only under
//!   the tree's write lock, after repointing its keys — and the table of the current block:
//!   a compaction deleting those files does not disturb the walk. A batch's locations may
//!   be stale by then; the old file still holds the same value (compaction moves values,
//!   never changes them). The design figures `iterators_live`, `frees_held_for_iterators`
//!   and `frees_ever_held_for_iterators` show the parking.
//! - **Contract.** A key not written while the iterator lives keeps its newest version in
//!   the source it was in at creation (a flush adds it to the tree before the Immutable
//!   MemTable leaves `mem`, and the iterator holds that MemTable), so it is returned exactly
//!   once with its value; a key written meanwhile may show any version or none.
//! - **Sequentiality degree** (§3.3). The tree cursor counts the files of the entries it
//!   serves (the merge asks it for their value; keys a MemTable shadows read no file) in
//!   sub-ranges of `seq_subrange_keys`. A range query runs from a seek to the next seek or
//!   the drop; when it is done, the files of its worst sub-range (most distinct files) are
//!   added to the candidates if there are more than `seq_degree_threshold` of them.
//! - **Errors.** A damaged tree record, node, block or a location naming no table is
//!   `Corruption` (the file and offset, or the PM pool and offset) from the move that met
//!   it; the iterator is then invalid.

pub mod complog;
mod iter;
mod jobs;
pub mod layout;
pub mod memtable;
pub(crate) mod salvage;

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::batch::BatchOp;
use crate::engine::{Cond, Engine, EngineCtx};
use crate::error::{Error, Result};
use crate::fs::{CountingFs, Fs};
use crate::index::pbtree::{Loc, PTree};
use crate::manifest::{Manifest, Version};
use crate::options::SlmdbOptions;
use crate::pm::heap::{alloc_or_grow, Heap};
use crate::pm::{Region, POOL_HEADER_LEN};
use crate::sstable::{block_find, entry_at, BlockCache, Handle, Kind, Table};
use crate::stats::Stats;
use layout::Root;
use memtable::Memtable;

/// The two memtables.
#[derive(Debug)]
struct MemState {
    active: Arc<Memtable>,
    imm: Option<Arc<Memtable>>,
}

/// The MANIFEST and the version it describes.
#[derive(Debug)]
struct VersionState {
    version: Version,
    manifest: Manifest,
}

impl VersionState {
    /// Log `edits` (the commit point) and make `after` (the version with them applied)
    /// current.
    fn log(&mut self, fs: &dyn Fs, edits: &[crate::manifest::Edit], after: Version) -> Result<()> {
        self.manifest.log(fs, edits, &after)?;
        self.version = after;
        Ok(())
    }
}

/// Figures reported in `Stats::design`.
#[derive(Debug, Default)]
struct Counters {
    flushes: AtomicU64,
    compactions: AtomicU64,
    compaction_inputs: AtomicU64,
    compaction_outputs: AtomicU64,
    entries_dropped: AtomicU64,
    cand_live_ratio: AtomicU64,
    cand_leaf_scan: AtomicU64,
    cand_seq_degree: AtomicU64,
    write_stalls: AtomicU64,
    /// Lone writes renumbered at their link: a newer write of the key linked first.
    writes_renumbered: AtomicU64,
    flushes_in_compaction: AtomicU64,
}

/// Bookkeeping of a compaction in flight.
#[derive(Debug, Default)]
struct Inflight {
    outputs: std::collections::HashSet<u64>,
    pending_decr: HashMap<u64, u64>,
}

/// Work for the background thread.
#[derive(Debug, Default)]
struct Work {
    flush: bool,
    compact: bool,
    stop: bool,
    /// Inputs of a compaction interrupted by a crash, to restart first.
    restart: Option<Vec<u64>>,
}

struct Inner {
    region: Region,
    heap: Mutex<Heap>,
    fs: CountingFs,
    dir: PathBuf,
    opts: SlmdbOptions,
    mem: RwLock<MemState>,
    /// Serialises MemTable rotation and the writes that do not take the lone-op path (a
    /// `std` mutex: see "Choices").
    writer: std::sync::Mutex<()>,
    /// The next sequence number.
    next_seq: AtomicU64,
    tree: RwLock<PTree>,
    version: Mutex<VersionState>,
    tables: RwLock<HashMap<u64, Arc<Table>>>,
    cache: Arc<BlockCache>,
    root: Mutex<(Root, usize)>,
    /// Serialises flushes. Lock order: `compaction_job` before `flush_job`.
    flush_job: Mutex<()>,
    /// Serialises compactions (a flush may run in the middle of one).
    compaction_job: Mutex<()>,
    /// The compaction in flight: its output files, and live keys flushes moved away from
    /// them before its commit.
    inflight: Mutex<Option<Inflight>>,
    work: Mutex<Work>,
    work_cv: Condvar,
    /// Signalled when an Immutable MemTable is gone.
    flushed_cv: Condvar,
    flushed_mu: Mutex<()>,
    leaf_cursor: Mutex<Vec<u8>>,
    poisoned: crate::poison::Poison,
    /// Set by `close`/drop before the worker is joined; compactions check it.
    cancel: crate::jobs::Cancel,
    user_bytes: crate::counters::Counters<1>,
    next_log_id: AtomicU64,
    counters: Counters,
    /// Live iterators and the MemTable arenas whose free waits for them.
    pins: Mutex<crate::pm::pins::Pins>,
}

/// The SLM-DB engine. See the module docs.
pub struct Slmdb {
    inner: Arc<Inner>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Slmdb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slmdb").field("region", &self.inner.region).finish()
    }
}

/// File name of SSTable `n`.
pub fn table_name(n: u64) -> String {
    format!("{n:06}.sst")
}

fn table_number(name: &str) -> Option<u64> {
    name.strip_suffix(".sst")?.parse().ok()
}

impl Slmdb {
    /// Open (or create, when `ctx.fresh`) an SLM-DB store.
    pub fn open(ctx: EngineCtx) -> Result<Slmdb> {
        let inner = Arc::new(open_inner(&ctx)?);
        inner.finish_recovery()?;
        let worker = if inner.opts.background {
            let i = inner.clone();
            Some(std::thread::Builder::new().name("tierkv-slmdb-bg".into()).spawn(move || worker_loop(i))?)
        } else {
            None
        };
        Ok(Slmdb { inner, worker: Mutex::new(worker) })
    }

    fn stop_worker(&self) {
        self.inner.cancel.cancel();
        self.inner.work.lock().stop = true;
        self.inner.work_cv.notify_all();
        if let Some(h) = self.worker.lock().take() {
            let _ = h.join();
        }
    }
}

impl Drop for Slmdb {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

fn worker_loop(inner: Arc<Inner>) {
    loop {
        let (flush, compact, restart) = {
            let mut w = inner.work.lock();
            while !w.stop && !w.flush && !w.compact && w.restart.is_none() {
                inner.work_cv.wait(&mut w);
            }
            if w.stop {
                return;
            }
            let r = (w.flush, w.compact, w.restart.take());
            w.flush = false;
            w.compact = false;
            r
        };
        if inner.poisoned.is_set() {
            inner.flushed_cv.notify_all();
            return;
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<()> {
            if let Some(inputs) = restart {
                inner.compact_files(&inputs)?;
            }
            if flush {
                inner.flush_imm()?;
                inner.maybe_compact(false)?;
            } else if compact {
                inner.maybe_compact(false)?;
            }
            Ok(())
        }));
        match r {
            Ok(Ok(())) => {}
            // Stopped by close at a safe point, its partial work discarded: not a failure.
            Ok(Err(e)) if inner.cancel.is_cancellation(&e) => {}
            Ok(Err(e)) => inner.poison(format!("background flush/compaction failed: {e}")),
            Err(_) => inner.poison("background flush/compaction panicked".into()),
        }
        inner.flushed_cv.notify_all();
    }
}

/// Steps 1–3 of recovery (module docs): region, heap, tree, manifest, tables, memtables.
fn open_inner(ctx: &EngineCtx) -> Result<Inner> {
    let o = &ctx.opts;
    let region = crate::engine::open_region(ctx)?;
    let fs: &dyn Fs = &ctx.fs;
    let heap = Mutex::new(Heap::new());
    let mut opts = o.slmdb.clone();
    let (root, slot, tree, version, manifest_no) = if ctx.fresh {
        // Lay out a new store. The superblock goes last: a store whose superblock is valid
        // is fully laid out.
        heap.lock().add_space(layout::HEAP_START, region.pool_size(), &[]).map_err(|_| bad_layout(&region))?;
        for i in 1..region.pool_count() {
            heap.lock()
                .add_space(region.addr(i, POOL_HEADER_LEN), region.addr(i + 1, 0), &[])
                .map_err(|_| bad_layout(&region))?;
        }
        let tree = PTree::create(&region, &heap, layout::ANCHOR_ADDR)?;
        let root = Root { gen: 1, next_mem_gen: 1, ..Root::default() };
        // SAFETY: the store is being created; nothing else uses the region.
        unsafe {
            region.write(layout::ROOT_SLOTS[0], &root.encode())?;
            region.write(layout::ROOT_SLOTS[1], &[0u8; 64])?;
        }
        region.flush(layout::ROOT_SLOTS[0], 128);
        region.fence();
        // SAFETY: as above.
        unsafe { region.write(layout::SUPERBLOCK_ADDR, &layout::encode_superblock(opts.memtable_size))? };
        region.persist(layout::SUPERBLOCK_ADDR, 64);
        region.sync_all()?;
        for name in fs.list(&ctx.dir)? {
            if table_number(&name).is_some() || name.starts_with("MANIFEST-") {
                fs.remove(&ctx.dir.join(&name))?;
            }
        }
        (root, 0, tree, Version { next_file: 1, ..Version::default() }, 0)
    } else {
        let sb = region.slice_checked(layout::SUPERBLOCK_ADDR, 64, "superblock")?;
        let (memtable_size, version) =
            layout::decode_superblock(sb).map_err(|d| region.corruption(layout::SUPERBLOCK_ADDR, d))?;
        opts.memtable_size = memtable_size;
        if version < layout::FORMAT_VERSION {
            // A version-1 store: its records read as before (no entry offsets); the records
            // this code writes carry them, which version-1 code's salvage reads as damaged,
            // so the store says it is version 2 before any is written (one persisted line).
            // SAFETY: the superblock line is this store's alone; no reader holds it.
            unsafe { region.write(layout::SUPERBLOCK_ADDR, &layout::encode_superblock(memtable_size))? };
            region.persist(layout::SUPERBLOCK_ADDR, 64);
        }
        let (root, slot) = pick_root(&region)?;
        let (tree, mut used) = PTree::open(&region, layout::ANCHOR_ADDR)?;
        for arena in [root.active, root.imm] {
            if arena != 0 {
                let h = region.slice_checked(arena + 16, 8, "memtable arena")?;
                let size = u64::from_le_bytes(h.try_into().map_err(|_| bad_layout(&region))?);
                used.push((arena, size.div_ceil(64) * 64));
            }
        }
        for log in [root.log, root.flush_log] {
            if log != 0 {
                let (_, segs) = complog::read(&region, log)?;
                used.extend(segs);
            }
        }
        *heap.lock() = crate::pm::heap::rebuild(&region, layout::HEAP_START, used)?;
        let mut tree = tree;
        tree.recover(&region, &heap)?;
        if !Manifest::exists(fs, &ctx.dir) {
            return Err(Error::corruption(ctx.dir.join("CURRENT"), 0, "the store's MANIFEST is missing"));
        }
        let (version, n, torn) = Manifest::recover(fs, &ctx.dir)?;
        if torn && root.log == 0 && root.flush_log == 0 {
            // A record is appended only while a job's log is live in PM; with none, a bad
            // last record is damage, not a torn append, and dropping it would lose a commit.
            return Err(Error::corruption(
                ctx.dir.join(Manifest::name(n)),
                0,
                "the MANIFEST's last record is damaged and no commit was in flight",
            ));
        }
        (root, slot, tree, version, n)
    };
    let manifest = Manifest::create(fs, &ctx.dir, manifest_no + 1, &version)?;
    if manifest_no > 0 {
        let _ = fs.remove(&ctx.dir.join(Manifest::name(manifest_no)));
    }
    let cache = BlockCache::new(opts.block_cache_size);
    let mut tables = HashMap::new();
    for &n in version.files.keys() {
        tables.insert(n, Table::open_cached(fs, &ctx.dir.join(table_name(n)), n, &cache)?);
    }
    // Memtables.
    let mut next_seq = 1;
    let mut recover_mt = |addr: u64| -> Result<Option<Arc<Memtable>>> {
        if addr == 0 {
            return Ok(None);
        }
        let (m, max) = Memtable::recover(&region, addr)?;
        next_seq = next_seq.max(max + 1);
        Ok(Some(Arc::new(m)))
    };
    let active = recover_mt(root.active)?;
    let imm = recover_mt(root.imm)?;
    let (mut root, mut slot) = (root, slot);
    let active = match active {
        Some(a) => a,
        None => {
            // No MemTable yet (a new store, or a crash right after creation): make one.
            let size = opts.memtable_size;
            let addr = alloc_or_grow(&mut heap.lock(), &region, size)?;
            let m = Memtable::create(&region, addr, size, root.next_mem_gen)?;
            root.active = addr;
            root.next_mem_gen += 1;
            root.gen += 1;
            slot = 1 - slot;
            write_root(&region, slot, &root)?;
            Arc::new(m)
        }
    };
    Ok(Inner {
        region,
        heap,
        fs: ctx.fs.clone(),
        dir: ctx.dir.clone(),
        opts,
        mem: RwLock::new(MemState { active, imm }),
        writer: std::sync::Mutex::new(()),
        next_seq: AtomicU64::new(next_seq),
        tree: RwLock::new(tree),
        version: Mutex::new(VersionState { version, manifest }),
        tables: RwLock::new(tables),
        cache,
        root: Mutex::new((root, slot)),
        flush_job: Mutex::new(()),
        compaction_job: Mutex::new(()),
        inflight: Mutex::new(None),
        work: Mutex::new(Work::default()),
        work_cv: Condvar::new(),
        flushed_cv: Condvar::new(),
        flushed_mu: Mutex::new(()),
        leaf_cursor: Mutex::new(Vec::new()),
        poisoned: crate::poison::Poison::default(),
        cancel: crate::jobs::Cancel::new(ctx.opts.job_probe.clone()),
        user_bytes: Default::default(),
        next_log_id: AtomicU64::new(rand::random::<u64>() | 1),
        counters: Counters::default(),
        pins: Mutex::new(crate::pm::pins::Pins::default()),
    })
}

/// Write `root` into slot `slot` and persist it.
fn write_root(region: &Region, slot: usize, root: &Root) -> Result<()> {
    let addr = layout::ROOT_SLOTS[slot];
    // SAFETY: the root slots are written only here, by open (single-threaded) or under the
    // root mutex.
    unsafe { region.write(addr, &root.encode())? };
    region.persist(addr, 64);
    Ok(())
}

fn bad_layout(region: &Region) -> Error {
    region.corruption(0, "PM layout overlaps itself")
}

fn pick_root(region: &Region) -> Result<(Root, usize)> {
    let mut best: Option<(Root, usize)> = None;
    for (i, &a) in layout::ROOT_SLOTS.iter().enumerate() {
        if let Some(r) = Root::decode(region.slice_checked(a, 64, "root slot")?) {
            if best.is_none_or(|(b, _)| r.gen > b.gen) {
                best = Some((r, i));
            }
        }
    }
    best.ok_or_else(|| region.corruption(layout::ROOT_SLOTS[0], "no valid root record in either slot"))
}

impl Inner {
    fn poison(&self, why: String) {
        self.poisoned.set(why);
    }

    fn check_poisoned(&self) -> Result<()> {
        self.poisoned.check()
    }

    /// Write the root with `f` applied into the other slot and persist it.
    fn update_root(&self, f: impl FnOnce(&mut Root)) -> Result<()> {
        let mut g = self.root.lock();
        let mut r = g.0;
        f(&mut r);
        r.gen += 1;
        let slot = 1 - g.1;
        write_root(&self.region, slot, &r)?;
        *g = (r, slot);
        Ok(())
    }

    /// Return PM extents to the heap (MemTable arenas a live iterator may read wait in the
    /// pins instead, see "Range reads: the iterator").
    fn free_pm(&self, extents: Vec<(u64, u64)>) {
        if extents.is_empty() {
            return;
        }
        let mut heap = self.heap.lock();
        for (a, l) in extents {
            heap.free(a, l);
        }
    }

    /// A new, empty memtable able to hold `need` bytes of nodes. A write larger than a
    /// memtable gets one with a memtable's worth of room beyond it: lone writers may claim
    /// space in it before the write that rotated does, and an arena sized to the write
    /// alone would then never fit it.
    fn new_memtable(&self, need: u64) -> Result<Memtable> {
        let size = if need + 64 > self.opts.memtable_size {
            (need + 64 + self.opts.memtable_size).div_ceil(64) * 64
        } else {
            self.opts.memtable_size
        };
        let addr = alloc_or_grow(&mut self.heap.lock(), &self.region, size)?;
        let gen = self.root.lock().0.next_mem_gen;
        Memtable::create(&self.region, addr, size, gen)
    }

    fn table(&self, n: u64) -> Result<Arc<Table>> {
        self.tables
            .read()
            .get(&n)
            .cloned()
            .ok_or_else(|| Error::corruption(self.dir.join(table_name(n)), 0, "B+-tree points at an unknown SSTable"))
    }

    /// Read `key`'s value from the block `loc` names (caller holds the tree read lock).
    fn read_at(&self, key: &[u8], loc: Loc) -> Result<Vec<u8>> {
        let t = self.table(loc.file)?;
        let h = Handle { offset: loc.offset, size: loc.size };
        match t.block_ref(h, true)? {
            Some(b) => value_in(&t, b, key, loc),
            None => value_in(&t, &t.read_block_cached(h)?, key, loc),
        }
    }

    /// The newest MemTable entry of `key` (MemTable, then Immutable MemTable): `Some(None)`
    /// for a delete, `None` when neither holds the key.
    fn mem_get(&self, key: &[u8]) -> Result<Option<Option<Vec<u8>>>> {
        let mem = self.mem.read();
        if let Some(v) = mem.active.get(&self.region, key)? {
            return Ok(Some(v));
        }
        match &mem.imm {
            Some(imm) => imm.get(&self.region, key),
            None => Ok(None),
        }
    }

    fn get_impl(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        if let Some(v) = self.mem_get(key)? {
            return Ok(v);
        }
        let tree = self.tree.read();
        match tree.get(&self.region, key)? {
            Some(loc) => self.read_at(key, loc).map(Some),
            None => Ok(None),
        }
    }

    fn write_impl(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.check_poisoned()?;
        let mops: Vec<memtable::Op<'_>> = ops
            .iter()
            .map(|o| match o {
                BatchOp::Put { key, value } => memtable::Op { kind: memtable::KIND_PUT, key, value },
                BatchOp::Delete { key } => memtable::Op { kind: memtable::KIND_DEL, key, value: &[] },
            })
            .collect();
        let Some(&first) = mops.first() else { return Ok(true) };
        let need: u64 = mops.iter().map(|o| memtable::node_size(o.key.len(), o.value.len())).sum();
        let user: u64 = mops.iter().map(|o| (o.key.len() + o.value.len()) as u64).sum();
        // One unconditional op: written before the active memtable's index lock, which it
        // holds only to link ("Choices": writers); the MemTable state is held shared
        // throughout (the `if let` keeps its guard), so a rotation waits for it.
        if mops.len() == 1 && cond == Cond::None {
            loop {
                if let Some(renumbered) = self.mem.read().active.put_one(&self.region, &self.next_seq, first)? {
                    if renumbered {
                        self.counters.writes_renumbered.fetch_add(1, Ordering::Relaxed);
                    }
                    self.user_bytes.add(0, user);
                    return Ok(true);
                }
                let _w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
                if !self.mem.read().active.fits(need) {
                    self.rotate(need)?;
                }
            }
        }
        let _w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let mem = self.mem.read();
            // For a conditional write: whether the key exists below the active memtable
            // (Immutable MemTable, then the tree: no disk read). Found before the active
            // memtable's index lock (that lock is never held while taking the tree's), and
            // stable while `mem` is held: writes reach only the active memtable, and a flush
            // moves the Immutable MemTable's keys into the tree but drops it from `mem` only
            // under the write lock.
            let cond = match cond {
                Cond::None => None,
                Cond::Absent | Cond::Present => {
                    let below =
                        match mem.imm.as_ref().map(|imm| imm.get(&self.region, first.key)).transpose()?.flatten() {
                            Some(v) => v.is_some(),
                            None => self.tree.read().get(&self.region, first.key)?.is_some(),
                        };
                    Some((cond == Cond::Present, below))
                }
            };
            match mem.active.apply(&self.region, &self.next_seq, &mops, cond)? {
                memtable::Applied::Done(done) => {
                    if done {
                        self.user_bytes.add(0, user);
                    }
                    return Ok(done);
                }
                memtable::Applied::Full => {}
            }
            drop(mem);
            self.rotate(need)?;
        }
    }

    /// Make the full MemTable immutable and start a new one (waiting for the previous
    /// Immutable MemTable's flush first). Caller holds the writer lock.
    fn rotate(&self, need: u64) -> Result<()> {
        if self.opts.background && self.mem.read().imm.is_some() {
            self.counters.write_stalls.fetch_add(1, Ordering::Relaxed);
        }
        loop {
            if self.mem.read().imm.is_none() {
                break;
            }
            // Once `close` stopped the worker nobody else flushes: a write still running
            // then flushes here instead of waiting for ever.
            if self.opts.background && !self.work.lock().stop {
                let mut g = self.flushed_mu.lock();
                if self.mem.read().imm.is_some() {
                    self.work.lock().flush = true;
                    self.work_cv.notify_all();
                    self.flushed_cv.wait_for(&mut g, std::time::Duration::from_millis(50));
                }
                drop(g);
                self.check_poisoned()?;
            } else {
                self.flush_imm()?;
            }
        }
        let m = Arc::new(self.new_memtable(need)?);
        let old = self.mem.read().active.clone();
        self.update_root(|r| {
            r.imm = old.addr;
            r.active = m.addr;
            r.next_mem_gen = m.gen + 1;
        })?;
        {
            let mut mem = self.mem.write();
            mem.imm = Some(old);
            mem.active = m;
        }
        if self.opts.background {
            self.work.lock().flush = true;
            self.work_cv.notify_all();
        } else {
            self.flush_imm()?;
            self.maybe_compact(false)?;
        }
        Ok(())
    }

    fn close_impl(&self) -> Result<()> {
        self.check_poisoned()?;
        // A clean shutdown leaves the MemTables in PM (they are persistent; no WAL to
        // replay) and syncs PM for power-loss durability on non-DAX media.
        let _c = self.compaction_job.lock();
        let _f = self.flush_job.lock();
        self.region.sync_all()?;
        Ok(())
    }

    fn stats_impl(&self) -> Stats {
        let pm = self.region.stats();
        let (files, live, total, cands, disk) = self.version.lock().version.summary();
        // Live keys = tree keys, plus MemTable puts of keys the tree lacks, minus MemTable
        // deletes of keys it has (newest MemTable version of each key). Locks in the scan's
        // order: MemTables, then tree.
        let (keys, mem_keys, mem_bytes, mem_index) = {
            let m = self.mem.read();
            let tree = self.tree.read();
            let all = (Bound::Unbounded, Bound::Unbounded);
            let active = m.active.range(all.0, all.1, usize::MAX);
            let imm = m.imm.as_ref().map_or(Vec::new(), |i| i.range(all.0, all.1, usize::MAX));
            let mut newest: BTreeMap<Vec<u8>, u64> = imm.into_iter().collect();
            newest.extend(active);
            let mut live = tree.len() as i64;
            for (k, node) in &newest {
                let put = memtable::read_node_trusted(&self.region, *node).map(|n| n.kind == memtable::KIND_PUT);
                let in_tree = tree.get(&self.region, k).map(|l| l.is_some());
                match (put, in_tree) {
                    (Ok(true), Ok(false)) => live += 1,
                    (Ok(false), Ok(true)) => live -= 1,
                    _ => {}
                }
            }
            let imm = m.imm.as_ref();
            (
                live.max(0) as u64,
                m.active.keys() as u64 + imm.map_or(0, |i| i.keys() as u64),
                m.active.used() + imm.map_or(0, |i| i.used()),
                m.active.index_bytes() + imm.map_or(0, |i| i.index_bytes()),
            )
        };
        let pins = self.pins.lock();
        let heap = self.heap.lock();
        let c = &self.counters;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let design = [
            ("sstables", files),
            ("sstable_bytes", disk),
            ("live_keys_in_sstables", live),
            ("total_keys_in_sstables", total),
            ("compaction_candidates", cands),
            ("memtable_keys", mem_keys),
            ("memtable_bytes", mem_bytes),
            ("flushes", ld(&c.flushes)),
            ("compactions", ld(&c.compactions)),
            ("compaction_input_files", ld(&c.compaction_inputs)),
            ("compaction_output_files", ld(&c.compaction_outputs)),
            ("compaction_entries_dropped", ld(&c.entries_dropped)),
            ("candidates_live_ratio", ld(&c.cand_live_ratio)),
            ("candidates_leaf_scan", ld(&c.cand_leaf_scan)),
            ("candidates_seq_degree", ld(&c.cand_seq_degree)),
            ("write_stalls", ld(&c.write_stalls)),
            ("writes_renumbered", ld(&c.writes_renumbered)),
            ("flushes_during_compaction", ld(&c.flushes_in_compaction)),
            ("jobs_cancelled", self.cancel.jobs_cancelled()),
            ("pm_heap_bytes", heap.total()),
            ("pm_heap_free_bytes", heap.free_bytes()),
            ("block_cache_bytes", self.cache.bytes()),
            ("iterators_live", pins.live() as u64),
            ("frees_held_for_iterators", pins.held() as u64),
            ("frees_ever_held_for_iterators", pins.ever_held()),
        ];
        // The index is in PM; DRAM holds the MemTables' volatile upper levels.
        Stats::engine("slmdb", pm, self.user_bytes.get(0), keys, mem_index, &design)
    }
}

/// The value of `key` in block payload `b` of table `t` (which `loc` names): the entry at
/// the offset `loc` names, else (a location without one) found by a search of the block.
fn value_in(t: &Table, b: &[u8], key: &[u8], loc: Loc) -> Result<Vec<u8>> {
    let bad = |d: String| Error::corruption(t.path(), loc.offset, d);
    let e = match loc.entry {
        Some(pos) => Some(entry_at(b, pos as usize).map_err(bad)?.0).filter(|e| e.key == key),
        None => block_find(b, key).map_err(bad)?,
    };
    match e {
        Some(e) if e.kind == Kind::Put => Ok(e.value.to_vec()),
        _ => Err(Error::corruption(t.path(), loc.offset, "the B+-tree points at a block without the key")),
    }
}

impl Engine for Slmdb {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.inner.get_impl(key)
    }

    fn write(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.inner.write_impl(ops, cond)
    }

    fn iter(&self) -> Result<crate::iter::BoxedIter> {
        Ok(Box::new(iter::SlmdbIter::new(&self.inner)))
    }

    fn flush(&self) -> Result<()> {
        self.inner.check_poisoned()?;
        let _w = self.inner.writer.lock().unwrap_or_else(|e| e.into_inner());
        self.inner.flush_all()
    }

    fn compact(&self) -> Result<()> {
        self.inner.check_poisoned()?;
        let _w = self.inner.writer.lock().unwrap_or_else(|e| e.into_inner());
        self.inner.flush_all()?;
        self.inner.maybe_compact(true)
    }

    fn stats(&self) -> Stats {
        self.inner.stats_impl()
    }

    fn check(&self) -> Result<Vec<String>> {
        self.inner.check_impl()
    }

    fn close(&self) -> Result<()> {
        self.stop_worker();
        self.inner.close_impl()
    }
}

pub(crate) fn path_of(dir: &Path, n: u64) -> PathBuf {
    dir.join(table_name(n))
}
