//! The `pmekv` preset: PMEKV (Micromachines 2020, `papers/pmekv.txt`).
//!
//! # What the paper describes, and what runs here
//! - **Key index tree in DRAM** (§4.2): a B+-tree ([`crate::index::bplus`]) whose leaves —
//!   the paper's *LeadNodes* — hold keys and *Value_Pointers* (here a [`layout::ValueRef`]:
//!   PM address + length). Inner nodes route; leaves are linked for interval traversal.
//! - **Values in PM** (§4.2): a value heap ([`crate::pm::heap`]) in the PM region; a value record is
//!   `crc32c | len | bytes`, 64-byte aligned, never modified after it is published. The
//!   paper's "replace the data in place" update is done out of place (new record, pointer
//!   swing, old record freed later): an in-place overwrite could be torn by a crash and
//!   lose both versions, which the issue forbids ("either the old or the new value").
//! - **KeyNodes in PM** (§4.2): compact copies of LeadNodes (`count | {key, value pointer}`),
//!   written back periodically (every `writeback_interval_ms`, when the key log is half
//!   full, at `flush()` and at `close()`). Only *dirty* LeadNodes are rewritten; clean ones
//!   keep their KeyNode. The paper chains KeyNodes with a `next` pointer; here their order
//!   is kept in a *directory* written with each checkpoint, so a clean KeyNode is reused
//!   unchanged across checkpoints (a `next` pointer would force rewriting a clean node
//!   whenever its successor changes). The directory is the chain.
//! - **Two-tier log** (§4.5), both tiers as rings in PM ([`log`]):
//!   - *key-value log* entries `(key, KVFlag)` (plus sequence number, value pointer and
//!     batch position): written before the index changes, `KVFlag` = 1 insert, 2 delete,
//!     3 update; set to 0 once the key tier holds the change;
//!   - *key log* entries `(key, Value_Pointer, KFlag)`: written after the index changes,
//!     `KFlag` = 1/2/3; set to 0 when the LeadNode has been written back as a KeyNode.
//!
//!   Recovery rebuilds the tree from the KeyNodes and replays every entry whose flag is
//!   non-zero and whose sequence number is above the checkpoint's, in sequence order
//!   (replay is idempotent, so an entry present in both tiers is harmless).
//! - **Operations** (§4.3): insert, search, delete, update and interval traversal are the
//!   B+-tree operations plus one PM read of the value; delete removes the key from its
//!   LeadNode and adjusts the tree (empty leaves are removed, sparse ones merged).
//! - **Short I/O stack** (§4.4): the paper adds system calls to a modified kernel so the
//!   NVM device runs the store. Here the "short stack" is the engine addressing its PM
//!   region directly through a mapping: no system call, file-system read path or page-cache
//!   copy sits on the data path. The HTM the paper mentions is replaced by a lock (below).
//!
//! # Write protocol and crash consistency
//! A write (one op, or a [`crate::WriteBatch`]) runs:
//! 1. each value is written to freshly allocated heap space (from the writer's allocation
//!    arena, see Concurrency), flushed and fenced by the writer's own thread (the commit
//!    fence may be another thread's, see group commit);
//! 2. under the state lock, the batch's operations are applied to the tree (below), its
//!    key-value log entries are written and flushed, then **one fence**: this is the commit
//!    point. A batch is *committed* iff all its entries
//!    (sequence numbers `base..base+n`) and their values are intact, so a crash before the
//!    fence leaves none of it visible and a crash after leaves all of it: batches are atomic
//!    without a separate commit record;
//! 3. key-log entries are written, flushed and fenced;
//! 4. KVFlags are set to 0 with 8-byte stores that are *not* persisted: if they are lost, a
//!    recovery merely replays the entry again, which is idempotent. This saves a fence per
//!    write over the paper's order and changes nothing that can be observed.
//!
//! The call returns after step 4, so every acknowledged write is durable against a process
//! crash (and, with `pm_sync`, against power loss on a non-DAX file system).
//!
//! The tree changes in step 2 *before* the commit fence: each operation is applied as it is
//! classified (the old value `insert`/`remove` return decides insert / update / delete, one
//! descent per operation instead of a lookup and then the update). Nothing reads the tree
//! while the state lock is held exclusively, so only the outcome of the critical section can
//! be observed; a logging failure before the fence undoes the changes from the old values,
//! newest first (`Inner::commit_group`), and nothing of the group is visible.
//!
//! A checkpoint (KeyNode write-back) writes the dirty KeyNodes and a new directory, fences,
//! then writes the checkpoint record into the older of two 64-byte slots and fences; the
//! valid slot with the higher generation wins at open, so a torn record falls back to the
//! previous checkpoint. Only then are the replaced KeyNodes, the old directory and values
//! overwritten or deleted before the checkpoint freed, and the key log's flags cleared.
//! Freed space is never reused while any durable state could still refer to it.
//!
//! # Concurrency
//! One `RwLock` guards the tree and the logs: `get` takes it shared, and so does an
//! iterator, for one batch of keys at a time (below). Writers copy their
//! values into PM *before* taking the lock (so value copies run in parallel). The
//! background write-back holds it in upgradable mode while writing KeyNodes (readers
//! continue, writers wait) and exclusively only to install the result. The heap allocator
//! has its own mutex, which writers take only to refill their *allocation arenas*
//! (`Inner::alloc_value`: 8 arenas dealt to threads round robin, each bumping through a
//! 64 KiB chunk of heap space under its own mutex; measured before them, the heap mutex
//! was 14 % of a writer's CPU at 2 writers). Arena space not yet handed out is free space
//! no durable state refers to: a crash forgets it, as it forgets any unpublished
//! allocation. A checkpoint holds the heap mutex per KeyNode allocation only.
//!
//! **Group commit** (LevelDB's writer queue; the paper says only that PMEKV allows
//! concurrent access). Steps 2–4 of concurrent writers do not take turns on the lock one
//! by one: a writer whose values are in PM joins a commit queue; the writer at its front
//! becomes the *leader*, takes the exclusive lock once for the batches queued behind it
//! (at most 64, and within half of each log) and runs steps 2–4 for them as one logged
//! unit — their key-value log entries carry consecutive sequence numbers with one
//! `batch_len`/`batch_index` numbering over the whole group, so recovery sees the group as
//! one batch — with **one** commit fence and one key-log fence for all. Then it hands each
//! writer its result and the next writer at the front leads. Each batch keeps its own
//! semantics: conditions and insert/update/delete are decided in queue order against the
//! tree as the group's earlier batches leave it. Nothing of a group is acknowledged before
//! its fence, so making the group all-or-nothing after a crash loses no acknowledged write
//! and keeps every batch atomic. A lone writer is a group of one: the same steps as before.
//! The design figures `group_commits` and `group_committed_batches` show the grouping.
//! A waiting writer spins briefly, then yields for up to 100 µs, and only then blocks
//! (RocksDB's adaptive wait): with every follower blocking at once, 2 writers ran at 0.48×
//! one writer's `fillrandom` on the 2-core test machine (each commit paid a futex wake-up);
//! with the adaptive wait, 1.13–1.14× (200,000 × 1 KiB; 8 writers 0.98–1.01×).
//!
//! # Range reads: the iterator
//! `Engine::iter` returns an `iter::PmekvIter`. The store has one source, the key index
//! tree, so there is nothing to merge.
//! - **Keys, copied in batches.** The tree changes in place under the state lock, so the
//!   iterator holds nothing borrowed from it between calls: a
//!   [`crate::index::bplus::ReadAhead`] cursor takes the lock shared once per refill,
//!   re-positions by key (strictly after the last key returned, or before the first) and
//!   copies a batch of keys and value pointers (32 entries after a seek, doubling to 512
//!   along a walk). Moving within the batch takes no lock. Writers and the write-back wait
//!   at most for one batch copy; a key not written while the iterator lives is in every
//!   batch whose range covers it, so it is returned exactly once with its value.
//! - **Values, borrowed from PM and pinned.** `value()` borrows the value record in place,
//!   verified (checksum over key, length and value) the first time an iterator of this
//!   open store moves onto it: a memo of verified records ([`crate::pm::checked`], keyed
//!   by address, length and a hash of the key) lets later walks skip the check and read
//!   none of the record's bytes until `value()` is used. No value is copied. A value replaced or deleted after the batch was copied is freed only
//!   at a checkpoint (the deferred frees); a checkpoint while an iterator registered
//!   before it lives *parks* those frees (`pm::pins::Pins`, epochs as in HPDK's value log) and
//!   the last such iterator to be dropped frees them. An iterator registered after the
//!   checkpoint cannot reach them: they left the tree before it. Parking only delays the
//!   DRAM heap's reuse of space that no durable state refers to, so crash consistency is
//!   unchanged; a crash forgets the parked list and open rebuilds the heap. (Copying values
//!   out under the lock instead would cost a value copy per entry and hold writers for
//!   it; pinning costs a mutex per iterator creation and drop.) The design figures
//!   `iterators_live`, `frees_held_for_iterators` and `frees_ever_held_for_iterators` show it.
//! - **Prefetch.** Values are in the heap in write order, not key order: the iterator
//!   prefetches the value record 3 entries ahead in its batch (the pointer gives its
//!   length) unless the memo knows it, and the memo's set 6 entries ahead, so a walk
//!   overlaps the memory misses of consecutive values.
//! - **Cost.** A seek: one descent under the shared lock and a batch copy of keys; `next`:
//!   amortised O(1) (a step in the batch, a memo probe; one checksum per record per open); no allocation per
//!   entry (batch buffers are reused). Every range read (`Db::scan`, `Db::iter`,
//!   snapshots) goes through it.
//!
//! # Shutdown
//! The only background job is the periodic write-back of dirty LeadNodes, bounded by the
//! dirty set and run to completion: `close()` stops its thread between rounds and does a
//! final write-back itself, so it has no cancellation point ([`crate::jobs`]).
//!
//! # Parameters
//! The paper gives no sizes; defaults are in [`crate::options::PmekvOptions`]. Values are
//! limited to one PM pool (`pm_pool_size` minus 72 bytes) besides the global 64 MiB limit.

#[cfg(test)]
mod group_tests;
mod iter;
pub mod layout;
pub mod log;
mod recovery;
pub(crate) mod salvage;

use std::collections::HashSet;
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock, RwLockUpgradableReadGuard};

use crate::batch::BatchOp;
use crate::engine::{Cond, Engine, EngineCtx};
use crate::error::{Error, Result};
use crate::index::bplus::{BPlusTree, LeafMeta, NodeId};
use crate::pm::heap::Heap;
use crate::pm::{Region, POOL_HEADER_LEN};
use crate::stats::Stats;
use layout::{Checkpoint, LogEntry, LogKind, Op, Superblock, ValueRef};
use log::Ring;

/// Per-LeadNode state: where its KeyNode is and whether it changed since.
#[derive(Debug, Default, Clone, Copy)]
pub struct LeafInfo {
    /// Address and size of the KeyNode written for this leaf, if any.
    pub kn: Option<(u64, u32)>,
    /// Changed since its KeyNode was written.
    pub dirty: bool,
}

impl LeafMeta for LeafInfo {
    fn touched(&mut self) {
        self.dirty = true;
    }
}

type Tree = BPlusTree<ValueRef, LeafInfo>;

/// Everything the state lock guards.
#[derive(Debug)]
struct State {
    tree: Tree,
    kv_log: Ring,
    key_log: Ring,
    /// Sequence number of the next operation.
    next_seq: u64,
    ckpt: Checkpoint,
    ckpt_slot: usize,
    /// KeyNodes of the current checkpoint, in order.
    kn_set: Vec<(u64, u32)>,
    /// Extents no longer referenced by the tree, to free once a checkpoint covers them.
    deferred: Vec<(u64, u64)>,
    /// Key-log entries written since the last checkpoint (their KFlags are cleared after
    /// the next one).
    key_log_entries: Vec<u64>,
}

struct Inner {
    region: Region,
    sb: Superblock,
    heap: Mutex<Heap>,
    /// Value allocation arenas: a writer bump-allocates its values from its arena's chunk
    /// and takes the heap mutex only to refill it ([`Inner::alloc_value`]).
    arenas: Box<[Mutex<Arena>]>,
    state: RwLock<State>,
    user_bytes: crate::counters::Counters<1>,
    checkpoints: AtomicU64,
    poisoned: crate::poison::Poison,
    bg_stop: Mutex<bool>,
    bg_cv: Condvar,
    background: bool,
    /// Live iterators and the value frees they hold back ([`crate::pm::pins::Pins`]).
    pins: Mutex<crate::pm::pins::Pins>,
    /// Writers waiting to commit, oldest first; the front one leads ([`crate::group`]).
    commits: crate::group::Queue<Pending>,
    /// Group commits, and the batches they committed.
    group_commits: AtomicU64,
    grouped_batches: AtomicU64,
    /// Tests: fail the next group's logging before its first key-value log entry.
    #[cfg(test)]
    fail_next_log: std::sync::atomic::AtomicBool,
}

/// The PMEKV engine. See the module docs.
pub struct Pmekv {
    inner: Arc<Inner>,
    bg: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Pmekv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pmekv").field("region", &self.inner.region).finish()
    }
}

/// Most batches one leader commits at once.
const MAX_GROUP: usize = 64;

/// Value allocation arenas ([`Inner::alloc_value`]); a thread keeps the one it was given.
const ARENAS: usize = 8;
/// Bytes an arena takes from the heap at once.
const ARENA_CHUNK: u64 = 64 << 10;
/// An arena takes a chunk only while the heap has this many chunks' worth free, so near
/// a full device the arenas hold back little (values are then allocated one by one).
const ARENA_MIN_FREE_CHUNKS: u64 = 4;

/// The unused rest of a chunk of heap space one arena hands out values from.
#[derive(Debug, Default)]
struct Arena {
    next: u64,
    end: u64,
}

/// The arena of the calling thread: threads are dealt arenas round robin as they first
/// write.
fn arena_slot() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = NEXT.fetch_add(1, Ordering::Relaxed) % ARENAS;
    }
    SLOT.with(|s| *s)
}

/// One writer's batch in the commit queue ([`crate::group`]), its values already in PM.
#[derive(Debug)]
struct Pending {
    /// Keys with their new value (`None`: delete), in batch order.
    items: Vec<(Vec<u8>, Option<ValueRef>)>,
    cond: Cond,
    /// User bytes of the batch (statistics).
    user: u64,
    /// Log bytes the batch needs (one entry per op).
    log_bytes: u64,
}

type Group = [Arc<crate::group::Entry<Pending>>];

/// A checkpoint's work done under a shared lock, installed under the exclusive lock.
struct Plan {
    ckpt: Checkpoint,
    slot: usize,
    kn_set: Vec<(u64, u32)>,
    written: Vec<(NodeId, (u64, u32))>,
}

impl Pmekv {
    /// Open (or create, when `ctx.fresh`) a PMEKV store.
    pub fn open(ctx: EngineCtx) -> Result<Pmekv> {
        let interval = ctx.opts.pmekv.writeback_interval_ms;
        let inner = Arc::new(recovery::open(&ctx)?);
        let bg = if interval > 0 {
            let i = inner.clone();
            let handle = std::thread::Builder::new()
                .name("tierkv-pmekv-writeback".into())
                .spawn(move || background_loop(i, Duration::from_millis(interval)))?;
            Some(handle)
        } else {
            None
        };
        Ok(Pmekv { inner, bg: Mutex::new(bg) })
    }

    fn stop_background(&self) {
        *self.inner.bg_stop.lock() = true;
        self.inner.bg_cv.notify_all();
        if let Some(h) = self.bg.lock().take() {
            let _ = h.join();
        }
    }
}

fn background_loop(inner: Arc<Inner>, interval: Duration) {
    loop {
        {
            let mut stop = inner.bg_stop.lock();
            if *stop {
                return;
            }
            inner.bg_cv.wait_for(&mut stop, interval);
            if *stop {
                return;
            }
        }
        if inner.poisoned.is_set() {
            return;
        }
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.checkpoint_background()));
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => inner.poison(format!("background KeyNode write-back failed: {e}")),
            Err(_) => inner.poison("background KeyNode write-back panicked".into()),
        }
    }
}

impl Inner {
    fn poison(&self, why: String) {
        self.poisoned.set(why);
    }

    fn check_poisoned(&self) -> Result<()> {
        self.poisoned.check()
    }

    /// Run `f`; if it fails, poison the store (used after the commit point, where a failure
    /// leaves DRAM and PM out of step).
    fn poison_on_err<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.poison(e.to_string());
        }
        r
    }

    /// Allocate `size` bytes of PM, adding a pool when the heap is full.
    fn alloc(&self, heap: &mut Heap, size: u64) -> Result<u64> {
        let usable = self.region.pool_size() - POOL_HEADER_LEN;
        if size > usable {
            return Err(Error::InvalidArgument(format!(
                "record of {size} bytes does not fit in a PM pool of {} bytes (raise pm_pool_size)",
                self.region.pool_size()
            )));
        }
        loop {
            if let Some(a) = heap.alloc(size) {
                return Ok(a);
            }
            let i = self.region.grow()?;
            let start = self.region.addr(i, POOL_HEADER_LEN);
            let end = self.region.addr(i + 1, 0);
            heap.add_space(start, end, &[]).map_err(|_| Error::PmFull("new pool overlaps the heap".into()))?;
        }
    }

    /// Allocate a value record of `size` bytes (a multiple of 64) from the calling thread's
    /// arena, refilling it with a chunk from the heap (under the heap mutex) when it runs
    /// out. A value larger than a quarter chunk, or one asked for while the heap is nearly
    /// full, is allocated from the heap directly (growing the region as [`Inner::alloc`]
    /// does). Space an arena holds and has not handed out is free space no durable state
    /// refers to: a crash forgets it (open rebuilds the heap from what the index
    /// references), and a refill returns the old chunk's tail to the heap. A freed value
    /// goes back to the heap, wherever it was allocated.
    fn alloc_value(&self, size: u64) -> Result<u64> {
        let mut a = match self.arenas.get(arena_slot()) {
            Some(a) => a.lock(),
            None => return self.alloc(&mut self.heap.lock(), size),
        };
        if a.end - a.next >= size {
            let addr = a.next;
            a.next += size;
            return Ok(addr);
        }
        let mut heap = self.heap.lock();
        if size <= ARENA_CHUNK / 4 && heap.free_bytes() >= ARENA_MIN_FREE_CHUNKS * ARENA_CHUNK {
            if let Some(chunk) = heap.alloc(ARENA_CHUNK) {
                if a.end > a.next {
                    heap.free(a.next, a.end - a.next);
                }
                a.next = chunk + size;
                a.end = chunk + ARENA_CHUNK;
                return Ok(chunk);
            }
        }
        self.alloc(&mut heap, size)
    }

    /// Write the concatenation of `bytes` at `addr`, a block allocated by the caller and not
    /// yet published, and flush it (no fence).
    fn write_at(&self, addr: u64, bytes: &[&[u8]]) -> Result<()> {
        let mut off = addr;
        for b in bytes {
            // SAFETY: the block at `addr` was allocated by this thread and is published to
            // no other thread (no index or log entry refers to it) until this write is done.
            unsafe { self.region.write(off, b)? };
            off += b.len() as u64;
        }
        self.region.flush(addr, off - addr);
        Ok(())
    }

    fn read_value(&self, key: &[u8], v: ValueRef) -> Result<Vec<u8>> {
        self.value_slice(key, v).map(<[u8]>::to_vec)
    }

    /// The verified value bytes in PM (valid while the caller keeps the slot allocated:
    /// under the state lock, as `get` does).
    fn value_slice(&self, key: &[u8], v: ValueRef) -> Result<&[u8]> {
        let rec = self.region.slice_checked(v.addr, (layout::VALUE_HEADER + v.len as u64) as usize, "value record")?;
        layout::value_verify(rec, key, v.len).map_err(|d| self.region.corruption(v.addr, d))
    }

    fn write_impl(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.check_poisoned()?;
        let need: u64 = ops.iter().map(|o| LogEntry::size(o.key().len())).sum();
        let kv_cap = self.sb.kv_log.1;
        let key_cap = self.sb.key_log.1;
        if need > kv_cap / 2 || need > key_cap / 2 {
            return Err(Error::InvalidArgument(format!(
                "batch needs {need} bytes of log, more than half of the key-value log ({kv_cap}) or key log ({key_cap}); split it"
            )));
        }
        // 1. Values, outside the state lock: allocate from the thread's arena, then copy
        //    and flush without any lock, so concurrent writers place and copy their values
        //    in parallel.
        let mut vals: Vec<Option<ValueRef>> = Vec::with_capacity(ops.len());
        for op in ops {
            let v = match op {
                BatchOp::Put { value, .. } => match self.alloc_value(layout::value_alloc_size(value.len())) {
                    Ok(addr) => Some(ValueRef { addr, len: value.len() as u32 }),
                    Err(e) => {
                        self.free_values(vals.iter().flatten());
                        return Err(e);
                    }
                },
                BatchOp::Delete { .. } => None,
            };
            vals.push(v);
        }
        for (op, v) in ops.iter().zip(&vals) {
            if let (BatchOp::Put { key, value }, Some(v)) = (op, v) {
                if let Err(e) = self.write_at(v.addr, &[&layout::value_header(key, value), value]) {
                    self.free_values(vals.iter().flatten());
                    return Err(e);
                }
            }
        }
        // A fence orders only the flushes of the thread that issues it, and another writer
        // (the leader) issues the commit fence: this writer's values must be durable first.
        if vals.iter().any(Option::is_some) {
            self.region.fence();
        }

        let items = ops.iter().zip(vals).map(|(op, v)| (op.key().to_vec(), v)).collect();
        let user = ops.iter().map(BatchOp::user_bytes).sum();
        let budget = self.sb.kv_log.1.min(self.sb.key_log.1) / 2;
        // A group stays within half of each log (a batch alone already is).
        let joins = |g: &Group, next: &Pending| {
            g.len() < MAX_GROUP && g.iter().map(|e| e.item.log_bytes).sum::<u64>() + next.log_bytes <= budget
        };
        self.commits.submit(Pending { items, cond, user, log_bytes: need }, joins, |g| self.commit_group(g))
    }

    /// Free the PM value records of a batch that will not be committed.
    fn release(&self, w: &Pending) {
        self.free_values(w.items.iter().filter_map(|(_, v)| v.as_ref()));
    }

    /// Return value records that no batch will reference to the heap.
    fn free_values<'a>(&self, vals: impl IntoIterator<Item = &'a ValueRef>) {
        let mut heap = self.heap.lock();
        for v in vals {
            heap.free(v.addr, layout::value_alloc_size(v.len as usize));
        }
    }

    /// Commit `group` (queued batches, oldest first) under the exclusive state lock as one
    /// logged unit: one run of key-value log entries and one fence. Returns each batch's
    /// result.
    ///
    /// Each operation is applied to the tree *as it is classified*: `insert`/`remove` return
    /// the key's old value, which decides its log code (insert / update / delete of a present
    /// key; a delete of an absent key is dropped) — one tree descent per operation, where a
    /// lookup followed by the update took two. This is safe because nothing reads the tree
    /// while the lock is held exclusively: the order of tree changes and log writes inside
    /// the critical section cannot be observed, only its outcome. If logging fails before
    /// the commit fence, the changes are undone in reverse order from the old values, so the
    /// tree is as it was and nothing of the group is visible.
    fn commit_group(&self, group: &Group) -> Vec<Result<bool>> {
        let mut out: Vec<Option<Result<bool>>> = group.iter().map(|_| None).collect();
        let mut st = self.state.write();
        let release_all = |e: &Error| {
            for w in group {
                self.release(&w.item);
            }
            group.iter().map(|_| Err(e.duplicate())).collect::<Vec<_>>()
        };
        if let Err(e) = self.check_poisoned() {
            return release_all(&e);
        }
        // The key log must have room for every entry the group can log (bounded by its
        // operations). The checkpoint that makes room writes KeyNodes from the tree, so it
        // runs before the group changes the tree.
        let bound = group.iter().flat_map(|e| e.item.items.iter()).map(|(k, _)| LogEntry::size(k.len()));
        if !st.key_log.fits(bound) {
            if let Err(e) = self.checkpoint_exclusive(&mut st) {
                if matches!(e, Error::Poisoned(_)) || self.poisoned.is_set() {
                    return group.iter().map(|_| Err(e.duplicate())).collect();
                }
                return release_all(&e);
            }
        }
        // Classify and apply in queue order: conditions and codes see the tree as the
        // group's earlier batches leave it.
        let mut entries: Vec<(LogEntry, Option<ValueRef>)> = Vec::new();
        // The value each entry's key had before it (its undo, and the deferred free).
        let mut olds: Vec<Option<ValueRef>> = Vec::new();
        let mut committed: Vec<usize> = Vec::new();
        for (gi, w) in group.iter().map(|e| &e.item).enumerate() {
            if let (Some((first, _)), Cond::Absent | Cond::Present) = (w.items.first(), w.cond) {
                if st.tree.get(first).is_some() != (w.cond == Cond::Present) {
                    self.release(w);
                    out[gi] = Some(Ok(false));
                    continue;
                }
            }
            let before = entries.len();
            for (k, v) in &w.items {
                let (code, old) = match v {
                    Some(v) => match st.tree.insert(k, *v).0 {
                        Some(old) => (Op::Update, Some(old)),
                        None => (Op::Insert, None),
                    },
                    None => match st.tree.remove(k) {
                        Some((old, _)) => (Op::Delete, Some(old)),
                        None => continue,
                    },
                };
                let (value_addr, value_len) = v.map_or((0, 0), |v| (v.addr, v.len));
                let e =
                    LogEntry { seq: 0, op: code, value_addr, value_len, batch_len: 0, batch_index: 0, key: k.clone() };
                entries.push((e, *v));
                olds.push(old);
            }
            if entries.len() == before {
                // Only deletes of absent keys: nothing to log.
                self.release(w);
                out[gi] = Some(Ok(true));
            } else {
                committed.push(gi);
            }
        }
        let fail_all = |out: &mut Vec<Option<Result<bool>>>, e: &Error| {
            for &gi in &committed {
                out[gi] = Some(Err(e.duplicate()));
            }
        };
        if !entries.is_empty() {
            if let Err(e) = self.commit_entries(&mut st, &mut entries) {
                if !matches!(e, Error::Poisoned(_)) && !self.poisoned.is_set() {
                    // Failed before the commit point: undo the tree changes, newest first,
                    // and free the group's values.
                    for ((e, _), old) in entries.iter().zip(&olds).rev() {
                        match old {
                            Some(old) => {
                                st.tree.insert(&e.key, *old);
                            }
                            None => {
                                st.tree.remove(&e.key);
                            }
                        }
                    }
                    for &gi in &committed {
                        self.release(&group[gi].item);
                    }
                }
                fail_all(&mut out, &e);
            } else {
                // The replaced values are freed once a checkpoint no longer references them.
                st.deferred.extend(olds.iter().flatten().map(|o| (o.addr, layout::value_alloc_size(o.len as usize))));
                self.group_commits.fetch_add(1, Ordering::Relaxed);
                self.grouped_batches.fetch_add(committed.len() as u64, Ordering::Relaxed);
                self.user_bytes.add(0, committed.iter().map(|&gi| group[gi].item.user).sum());
                for &gi in &committed {
                    out[gi] = Some(Ok(true));
                }
                if st.key_log.used() > st.key_log.capacity() / 2 {
                    if self.background {
                        self.bg_cv.notify_one();
                    } else {
                        let r = self.checkpoint_exclusive(&mut st);
                        if let Err(e) = self.poison_on_err(r) {
                            fail_all(&mut out, &e);
                        }
                    }
                }
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::Poisoned("pmekv: a batch of a group commit got no result".into()))))
            .collect()
    }

    /// Log `entries` (the group's, in order, already applied to the tree) as one unit:
    /// sequence numbers, the key-value log entries and the commit fence, the key log, the
    /// cleared KVFlags. An error before the fence leaves nothing of them durable (the caller
    /// undoes the tree); one after it poisons the store. The key log's room was made by the
    /// caller.
    fn commit_entries(&self, st: &mut State, entries: &mut [(LogEntry, Option<ValueRef>)]) -> Result<()> {
        #[cfg(test)]
        if self.fail_next_log.swap(false, Ordering::Relaxed) {
            return Err(Error::InvalidArgument("injected failure before the key-value log (test)".into()));
        }
        st.kv_log.clear();
        let base = st.next_seq;
        let n = entries.len() as u32;
        for (i, (e, _)) in entries.iter_mut().enumerate() {
            e.seq = base + i as u64;
            e.batch_len = n;
            e.batch_index = i as u32;
        }
        // 2. Key-value log, then the commit fence.
        let mut kv_addrs = Vec::with_capacity(entries.len());
        for (e, _) in entries.iter() {
            let size = LogEntry::size(e.key.len());
            let addr = st
                .kv_log
                .reserve(size)
                .ok_or_else(|| Error::InvalidArgument("batch does not fit in the key-value log".into()))?;
            let bytes = e.encode(LogKind::KeyValue);
            // SAFETY: log space between head and tail belongs to the writer holding the
            // state lock exclusively; readers never read the logs.
            unsafe { self.region.write(addr, &bytes)? };
            self.region.flush(addr, size);
            kv_addrs.push(addr);
        }
        self.region.fence();
        st.next_seq = base + entries.len() as u64;

        // 3. The key log (the tree already holds the group).
        let r = self.log_keys(st, entries);
        self.poison_on_err(r)?;
        // 4. KVFlag := 0 (not persisted; see module docs).
        for a in kv_addrs {
            let r = self.region.store_u64_atomic(a, 0);
            self.poison_on_err(r)?;
        }
        st.kv_log.clear();
        Ok(())
    }

    fn log_keys(&self, st: &mut State, entries: &[(LogEntry, Option<ValueRef>)]) -> Result<()> {
        for (e, _) in entries {
            let size = LogEntry::size(e.key.len());
            let addr = st
                .key_log
                .reserve(size)
                .ok_or_else(|| Error::Poisoned("key log full after a check that it fits".into()))?;
            // SAFETY: as for the key-value log: the exclusive state lock owns the log space.
            unsafe { self.region.write(addr, &e.encode(LogKind::Key))? };
            self.region.flush(addr, size);
            st.key_log_entries.push(addr);
        }
        self.region.fence();
        Ok(())
    }

    /// Checkpoint while holding the state lock exclusively.
    fn checkpoint_exclusive(&self, st: &mut State) -> Result<()> {
        if let Some(plan) = self.checkpoint_prepare(st)? {
            self.checkpoint_install(st, plan)?;
        }
        Ok(())
    }

    /// Checkpoint from the background thread: KeyNodes are written under the upgradable
    /// lock (readers continue), the result is installed under the exclusive lock.
    fn checkpoint_background(&self) -> Result<()> {
        let g = self.state.upgradable_read();
        let Some(plan) = self.checkpoint_prepare(&g)? else {
            return Ok(());
        };
        let mut w = RwLockUpgradableReadGuard::upgrade(g);
        self.checkpoint_install(&mut w, plan)
    }

    /// Write the dirty KeyNodes, the directory and the checkpoint record. Returns `None`
    /// when nothing changed since the last checkpoint.
    fn checkpoint_prepare(&self, st: &State) -> Result<Option<Plan>> {
        let seq = st.next_seq.saturating_sub(1);
        if seq == st.ckpt.seq && st.deferred.is_empty() && st.key_log.used() == 0 {
            return Ok(None);
        }
        let mut kn_set = Vec::new();
        let mut written = Vec::new();
        let mut fresh: Vec<(u64, u64)> = Vec::new();
        // The heap mutex is held per allocation, not across the KeyNode writes: writers
        // allocate their values meanwhile.
        let write_new = |bytes: &[u8]| -> Result<u64> {
            let addr = self.alloc(&mut self.heap.lock(), bytes.len() as u64)?;
            self.write_at(addr, &[bytes])?;
            Ok(addr)
        };
        let result = (|| -> Result<(u64, u64)> {
            for id in st.tree.leaf_ids() {
                let Some(leaf) = st.tree.leaf(id) else {
                    continue;
                };
                if leaf.keys.is_empty() {
                    continue;
                }
                match leaf.meta.kn {
                    Some(kn) if !leaf.meta.dirty => kn_set.push(kn),
                    _ => {
                        let it = leaf.keys.iter().zip(leaf.vals.iter().copied());
                        let bytes = layout::keynode_encode(it, leaf.keys.len());
                        let addr = write_new(&bytes)?;
                        fresh.push((addr, bytes.len() as u64));
                        let kn = (addr, bytes.len() as u32);
                        kn_set.push(kn);
                        written.push((id, kn));
                    }
                }
            }
            let dir = layout::dir_encode(&kn_set);
            let dir_addr = write_new(&dir)?;
            fresh.push((dir_addr, dir.len() as u64));
            Ok((dir_addr, dir.len() as u64))
        })();
        let (dir_addr, dir_bytes) = match result {
            Ok(d) => d,
            Err(e) => {
                let mut heap = self.heap.lock();
                for (a, l) in fresh {
                    heap.free(a, l);
                }
                return Err(e);
            }
        };
        self.region.fence();
        let ckpt = Checkpoint {
            generation: st.ckpt.generation + 1,
            seq,
            dir_addr,
            dir_bytes,
            kn_count: kn_set.len() as u64,
            key_count: st.tree.len() as u64,
        };
        let slot = 1 - st.ckpt_slot;
        let slot_addr = layout::CKPT_SLOT_ADDR[slot];
        // SAFETY: the checkpoint slots are written only by checkpoints, which are serialised
        // by the state lock (upgradable or exclusive); nothing reads them after open.
        unsafe { self.region.write(slot_addr, &ckpt.encode())? };
        self.region.persist(slot_addr, 64);
        Ok(Some(Plan { ckpt, slot, kn_set, written }))
    }

    /// The checkpoint is durable: free what it no longer references, mark leaves clean,
    /// clear the key log.
    fn checkpoint_install(&self, st: &mut State, plan: Plan) -> Result<()> {
        let keep: HashSet<u64> = plan.kn_set.iter().map(|k| k.0).collect();
        {
            let mut heap = self.heap.lock();
            for &(a, l) in &st.kn_set {
                if !keep.contains(&a) {
                    heap.free(a, l as u64);
                }
            }
            if st.ckpt.dir_addr != 0 {
                heap.free(st.ckpt.dir_addr, st.ckpt.dir_bytes);
            }
            // Values: iterators read them without the state lock, so those a live
            // iterator may still read wait for it (KeyNodes and directories are never
            // read by iterators).
            let deferred = std::mem::take(&mut st.deferred);
            for (a, l) in self.pins.lock().park(deferred) {
                heap.free(a, l);
            }
        }
        for (id, kn) in plan.written {
            if let Some(m) = st.tree.leaf_meta_mut(id) {
                m.kn = Some(kn);
                m.dirty = false;
            }
        }
        st.kn_set = plan.kn_set;
        st.ckpt = plan.ckpt;
        st.ckpt_slot = plan.slot;
        // KFlag := 0 for every key-log entry the checkpoint covers (not persisted: entries at
        // or below the checkpoint's sequence number are ignored by recovery anyway).
        for a in std::mem::take(&mut st.key_log_entries) {
            self.region.store_u64_atomic(a, 0)?;
        }
        st.key_log.clear();
        self.checkpoints.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn check_impl(&self) -> Result<Vec<String>> {
        let st = self.state.read();
        let mut problems = Vec::new();
        if let Err(e) = st.tree.check_invariants() {
            problems.push(format!("key index tree: {e}"));
        }
        let heap = self.heap.lock();
        let mut used: Vec<(u64, u64, String)> = Vec::new();
        for (k, v) in st.tree.range_from(Bound::Unbounded) {
            if let Err(e) = self.read_value(k, *v) {
                problems.push(format!("key {}: {e}", crate::escape(k)));
            }
            used.push((v.addr, layout::value_alloc_size(v.len as usize), format!("value of key {}", crate::escape(k))));
        }
        // The checkpoint on PM must decode and agree with the DRAM state it claims to cover.
        match recovery::load_checkpoint(&self.region, &st.ckpt) {
            Ok(leaves) => {
                let n: usize = leaves.iter().map(|l| l.0.len()).sum();
                if n as u64 != st.ckpt.key_count {
                    problems.push(format!(
                        "checkpoint lists {n} keys in its KeyNodes, its record says {}",
                        st.ckpt.key_count
                    ));
                }
            }
            Err(e) => problems.push(format!("checkpoint: {e}")),
        }
        for &(a, l) in &st.kn_set {
            used.push((a, l as u64, "KeyNode".into()));
        }
        used.push((st.ckpt.dir_addr, st.ckpt.dir_bytes, "KeyNode directory".into()));
        for &(a, l) in &st.deferred {
            used.push((a, l, "deferred free".into()));
        }
        used.sort();
        for w in used.windows(2) {
            if let [a, b] = w {
                if a.0 + a.1 > b.0 {
                    problems.push(format!("{} at {:#x} overlaps {} at {:#x}", a.2, a.0, b.2, b.0));
                }
            }
        }
        for (a, l, what) in &used {
            if heap.overlaps_free(*a, *l) {
                problems.push(format!("{what} at {a:#x} lies in free heap space"));
            }
        }
        // What recovery relies on: every operation since the checkpoint has an intact key-log
        // entry, i.e. the live entries' sequence numbers are exactly ckpt.seq+1 .. next_seq.
        let mut live: Vec<u64> = st
            .key_log
            .scan(&self.region)
            .into_iter()
            .filter(|(e, flag, _)| *flag != 0 && e.seq > st.ckpt.seq)
            .map(|(e, _, _)| e.seq)
            .collect();
        live.sort_unstable();
        live.dedup();
        if !live.iter().copied().eq(st.ckpt.seq + 1..st.next_seq) {
            let missing = (st.ckpt.seq + 1..st.next_seq).find(|s| live.binary_search(s).is_err());
            problems.push(format!(
                "key log: live entries for sequence numbers {}..{} expected, {} found (first missing or damaged: {missing:?})",
                st.ckpt.seq + 1,
                st.next_seq,
                live.len()
            ));
        }
        Ok(problems)
    }
}

/// Apply one logged operation to the tree, deferring the free of the replaced value.
fn apply(st: &mut State, key: &[u8], op: Op, v: Option<ValueRef>) {
    let old = match (op, v) {
        (Op::Insert | Op::Update, Some(v)) => st.tree.insert(key, v).0,
        _ => st.tree.remove(key).map(|(old, _)| old),
    };
    if let Some(old) = old {
        st.deferred.push((old.addr, layout::value_alloc_size(old.len as usize)));
    }
}

impl Engine for Pmekv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let st = self.inner.state.read();
        match st.tree.get(key) {
            Some(v) => self.inner.read_value(key, *v).map(Some),
            None => Ok(None),
        }
    }

    fn get_with(&self, key: &[u8], f: &mut dyn FnMut(&[u8])) -> Result<bool> {
        // The state lock keeps the slot from being freed (a free happens under its write
        // side) while `f` reads the value in place.
        let st = self.inner.state.read();
        match st.tree.get(key) {
            Some(v) => {
                f(self.inner.value_slice(key, *v)?);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn write(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.inner.write_impl(ops, cond)
    }

    fn iter(&self) -> Result<crate::iter::BoxedIter> {
        Ok(Box::new(iter::PmekvIter::new(&self.inner)))
    }

    fn flush(&self) -> Result<()> {
        self.inner.check_poisoned()?;
        let mut st = self.inner.state.write();
        let r = self.inner.checkpoint_exclusive(&mut st);
        self.inner.poison_on_err(r)
    }

    fn compact(&self) -> Result<()> {
        // PMEKV has no compaction: space is reclaimed as it is freed. A checkpoint releases
        // every deferred free.
        self.flush()
    }

    fn stats(&self) -> Stats {
        let st = self.inner.state.read();
        let heap = self.inner.heap.lock();
        let pm = self.inner.region.stats();
        let pins = self.inner.pins.lock();
        let design = [
            ("leaves", st.tree.leaf_ids().len() as u64),
            ("keynodes", st.kn_set.len() as u64),
            ("checkpoints", self.inner.checkpoints.load(Ordering::Relaxed)),
            ("group_commits", self.inner.group_commits.load(Ordering::Relaxed)),
            ("group_committed_batches", self.inner.grouped_batches.load(Ordering::Relaxed)),
            ("checkpoint_seq", st.ckpt.seq),
            ("key_log_bytes_used", st.key_log.used()),
            ("heap_bytes", heap.total()),
            ("heap_free_bytes", heap.free_bytes()),
            ("deferred_frees", st.deferred.len() as u64),
            ("iterators_live", pins.live() as u64),
            ("frees_held_for_iterators", pins.held() as u64),
            ("frees_ever_held_for_iterators", pins.ever_held()),
        ];
        let user = self.inner.user_bytes.get(0);
        Stats::engine("pmekv", pm, user, st.tree.len() as u64, st.tree.dram_bytes() as u64, &design)
    }

    fn check(&self) -> Result<Vec<String>> {
        self.inner.check_impl()
    }

    fn close(&self) -> Result<()> {
        self.stop_background();
        self.inner.check_poisoned()?;
        let mut st = self.inner.state.write();
        self.inner.checkpoint_exclusive(&mut st)?;
        self.inner.region.sync_all()?;
        Ok(())
    }
}

impl Drop for Pmekv {
    fn drop(&mut self) {
        self.stop_background();
    }
}
