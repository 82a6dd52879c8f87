//! The `native` preset: tierkv's own design, multi-core from the start.
//!
//! Built from what the five papers and their successors teach: per-core logs (FlatStore),
//! the log *is* the memtable — no second write of a value (ListDB, Viper), a DRAM index
//! over PM (Viper, PMEKV, HPDK). `docs/design/native.md` argues the commit protocol and the
//! snapshot rules step by step; `docs/format/native.md` is the byte layout.
//!
//! # Write path: no shared lock
//! - The store has `shards` logs (default: twice the hardware threads, 4..=64). A writer
//!   takes a shard with `try_lock`, starting at its thread's own shard and moving on to the
//!   next free one; it blocks only when every shard is busy. The shard mutex is
//!   *ownership* of the shard's log tail, not a point where writers queue: with more shards
//!   than running threads a writer almost never waits (the design figure
//!   `shard_busy_skips` counts the shards found busy). The one other wait: while an index
//!   checkpoint pauses writers to take every shard at once (at most about 1 ms a pause,
//!   see [`checkpoint`]), a writer waits before it takes a shard.
//! - A put, a delete or a whole [`crate::WriteBatch`] is **one record**
//!   (`[crc | len | gen | count | seq]` then `count` entries `[crc | vlen | klen | kind |
//!   key | value]`), written straight into the shard's open segment, flushed line by line,
//!   and committed by **one fence** of the writing thread. The record checksum covers the
//!   header and every entry header; each entry's checksum covers its sequence number, key
//!   and value (so a point read verifies one entry, and recovery verifies the record whole:
//!   a batch is all or nothing).
//! - Sequence numbers come from one atomic counter (`fetch_add` of the batch size).
//! - After the fence the versions are linked into the index ([`index`]); the write returns
//!   once they are. Nothing else is written: there is no memtable to flush and no WAL.
//!
//! # Reads
//! `get` finds the key's slot in the hash index and walks its version chain without a lock
//! (epoch pins), takes the newest visible version, reads its log entry in PM and lends the
//! value in place (`get_with` allocates nothing). A read may see a write that is still
//! returning (it is durable already: versions are linked after the fence); it never sees
//! part of a batch.
//!
//! **Checksums are verified once per open, not on every read** (the choice a block cache
//! makes: RocksDB verifies a block when it loads it, then serves it from the cache). Every
//! record in the logs at open is verified when recovery replays it (a damaged one fails the
//! open, naming the pool file and offset); a record written since was encoded by this
//! process from the caller's buffers and is immutable in PM. A read then checks the entry's
//! structure (kind, lengths within the region) and that its key is the one looked up, which
//! catches an index pointing anywhere else. An iterator does less: for a version this
//! process wrote or already verified it reads no PM while it walks (the version's entry
//! size and the key's length place the value exactly), and `value()` reads only the value
//! bytes asked for ([`iter`]). `NativeOptions::verify_reads` verifies the
//! checksum of every value read as well (about 0.1 µs per KiB on the test machine), and
//! `check` always does. An open that loads an index checkpoint ([`checkpoint`]) does not
//! replay the records below its resume points: the versions it loads are marked
//! *unverified*, and the first read of one verifies its checksum.
//!
//! # Snapshots and iterators
//! Every write is numbered, and the index keeps versions, so a snapshot is a sequence
//! number: [`crate::Db::snapshot`] and every iterator read the newest version `<= s`. The
//! number a snapshot gets is the *published* sequence number: every write at or below it
//! has linked its versions. Each shard advertises the sequence number of the write in
//! flight on it (its *marker*); the published number is the smallest marker (or the next
//! sequence number) minus one, kept as a running maximum. Writers publish every 32 writes
//! per shard and a snapshot publishes when it is taken. Taking one first waits until every
//! write numbered below the counter at the call has linked (so it includes every write
//! acknowledged before it); writers never wait for snapshots. Old versions are cut when a writer of the key finds them below the newest
//! version every current and future snapshot can need ([`index`]'s trimming rule).
//!
//! # Conditional writes
//! `insert_if_absent`/`update_if_present` take their sequence number, wait until every
//! write numbered below it has completed (markers of the other shards), then decide on the
//! key's newest version below their number. Sequence order is then the linearization
//! order of every write to a key.
//!
//! # Log cleaning
//! Every superseded or shadowed entry adds its bytes to its slot's dead count. The cleaner
//! takes sealed segments whose dead share is at least half, the deadest first, copies
//! their live entries (a version still in some key's chain; and deletes of keys that have
//! no slot, which open drops but older puts of which may remain elsewhere) to the end of
//! the cleaning thread's shard log with their own sequence numbers, points the versions at
//! the copies, zeroes the segment's magic and retires it. A retired segment is reused once
//! no snapshot or iterator registered before its retirement lives and the epoch moved on
//! (a `get` may have read a location in it). It runs in `compact()`, and in a writer that
//! starts a new segment when half of the sealed log is dead or PM is short (fewer free
//! slots than shards and the region at its capacity): a short write stall, like LevelDB's,
//! that keeps the log within about twice its live data.
//!
//! # Capacity tier
//! Past `NativeOptions::dram_budget` or `pm_watermark` × `pm_capacity`, cold keys (CLOCK
//! bits) move to SSTables on disk under the shared LSM code and leave the index; reads of
//! them go to disk (bloom filters, usually one block). See [`cold`] for the protocol and
//! why a crash anywhere in a move is safe. A background thread runs moves and log cleaning
//! (`NativeOptions::background`); without it writers and `compact()` do.
//!
//! # What this version does not do yet (issue 22, stated in the closing note)
//! - An index that need not be rebuilt at open: an open loads the index checkpoint
//!   ([`checkpoint`]) and replays the logs after it, but still inserts every key into the
//!   DRAM maps.
//! - Dropping deletes and moved entries: one for a key that has no slot is kept forever.
//!
//! # Parameters
//! [`crate::options::NativeOptions`]: `shards` and `segment_size` (creation-only),
//! `verify_reads`, `dram_budget`, `pm_watermark`, `background`.

pub mod checkpoint;
mod cold;
pub mod delta;
mod index;
mod iter;
pub mod layout;
pub mod log;
mod recovery;
pub(crate) mod salvage;
mod scan;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_epoch as epoch;
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::batch::BatchOp;
use crate::counters::Counters;
use crate::engine::{Cond, Engine, EngineCtx, EngineSnapshot};
use crate::error::{Error, Result};
use crate::pm::Region;
use crate::poison::Poison;
use crate::stats::Stats;

use index::{Index, Linked, NewVersion};
use layout::{entry_header, entry_len, record_len, EntryIn, Kind, RecordHeader, ENTRY_HEADER_LEN, RECORD_HEADER_LEN};
use log::{create_segment, seal_segment, Geometry, OpenSeg, ShardLog, SlotAlloc};

/// Writes per shard between two publications of the published sequence number.
const PUBLISH_EVERY: u64 = 32;
/// A shard's marker when no write is in flight on it.
const IDLE: u64 = u64::MAX;

/// Counter indexes.
const C_USER_BYTES: usize = 0;
const C_RECORDS: usize = 1;
const C_BUSY_SKIPS: usize = 2;
const C_KEYS_ADDED: usize = 3;
const C_KEYS_REMOVED: usize = 4;
const C_SHADOWED: usize = 5;
const C_COND_WAITS: usize = 6;
const C_SEGMENTS: usize = 7;
const C_PREFAULTED: usize = 8;
/// A second set of counters (the first is full): the log cleaner's, then reads that
/// verified a version loaded from an index checkpoint.
const G_CLEANED: usize = 0;
const G_RELOCATED: usize = 1;
const G_RELOCATED_BYTES: usize = 2;
const G_DROPPED: usize = 3;
const G_CKPT_VERIFIED: usize = 4;
/// DRAM per index slot, measured for 16-byte keys: an entry in each of the two maps (~90
/// bytes each with the boxed key; the tree's key carries 16 more bytes, its head: see
/// [`index::TreeKey`]), the slot (mutex, head, CLOCK bit, in an `Arc`) and one version
/// (seq, loc, size, gate, next, flags).
const PER_SLOT_BYTES: u64 = 90 + (90 + 16) + 32 + 48;
/// A sealed segment is cleaned when at least this share of its bytes is dead.
const CLEAN_DEAD_RATIO: f64 = 0.5;

/// One write shard, on its own cache lines.
#[repr(align(128))]
struct Shard {
    log: Mutex<ShardLog>,
    /// A lower bound of the sequence number of the write in flight on this shard, or
    /// [`IDLE`].
    marker: AtomicU64,
}

/// A segment, as the log cleaner sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SegMeta {
    pub tag: layout::SegTag,
    pub span: u64,
    /// Bytes of records, once sealed (`None` while a shard appends to it).
    pub sealed: Option<u64>,
}

/// Live snapshots: sequence number → count, and the oldest, readable without the lock.
#[derive(Default)]
struct Snaps {
    live: Mutex<BTreeMap<u64, usize>>,
}

#[repr(align(128))]
struct Padded<T>(T);

pub(crate) struct Inner {
    region: Arc<Region>,
    geo: Geometry,
    db_id: u64,
    shards: Box<[Shard]>,
    alloc: Mutex<SlotAlloc>,
    /// Sealed and open segments by address (the log cleaner's candidates).
    segs: Mutex<BTreeMap<u64, SegMeta>>,
    /// Dead bytes of log entries per slot, one array per pool (made on first use).
    dead: Box<[std::sync::OnceLock<Box<[AtomicU64]>>]>,
    index: Index,
    next_seq: Padded<AtomicU64>,
    published: Padded<AtomicU64>,
    /// The oldest live snapshot's sequence number, or `u64::MAX`.
    oldest_snap: Padded<AtomicU64>,
    snaps: Snaps,
    poison: Arc<Poison>,
    closed: AtomicBool,
    counters: Counters<9>,
    gc_counters: Counters<5>,
    /// Set while a thread cleans (one cleaner at a time).
    cleaning: AtomicBool,
    /// Keys in the store when it was opened (tombstones excluded).
    keys_at_open: u64,
    /// Seconds the open took to replay the logs, in microseconds (a design figure).
    recovery_us: u64,
    /// Bytes of records replayed at open.
    replayed_bytes: u64,
    /// Microseconds of the open's phases: replay of the logs, merge and sort of the newest
    /// entries, index build.
    recovery_phases_us: [u64; 3],
    /// Verify every value read ([`crate::options::NativeOptions::verify_reads`]).
    verify_reads: bool,
    /// The capacity tier ([`cold`]).
    cold: cold::Cold,
    /// [`crate::options::NativeOptions::dram_budget`].
    dram_budget: u64,
    /// [`crate::options::NativeOptions::pm_watermark`].
    pm_watermark: f64,
    /// A background thread runs the capacity tier and the cleaner.
    background: bool,
    /// Wakes the background thread (`true`: work may be due).
    wake: Mutex<bool>,
    wake_cv: Condvar,
    /// Set to stop the background thread.
    stop: AtomicBool,
    /// Index checkpoints ([`checkpoint`]).
    ckpt: checkpoint::Checkpoints,
    /// Microseconds the background load of a checkpoint's entries took (0: none ran or
    /// it has not finished).
    load_us: AtomicU64,
    /// Test instrumentation ([`crate::Options::job_probe`]).
    probe: Option<Arc<crate::jobs::JobProbe>>,
}

/// What `Inner::prefault_ahead` did so far (inserter thread only).
#[derive(Default)]
struct Prefault {
    started: bool,
    /// Segments created when it last looked.
    seen: u64,
    /// Slots already faulted in.
    done: std::collections::HashSet<u64>,
}

/// The `native` engine.
pub struct Native {
    inner: Arc<Inner>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Moves new keys into the ordered index (see "Deferred tree inserts" in [`index`]).
    inserter: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Native {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Native").field("shards", &self.inner.shards.len()).finish()
    }
}

fn thread_shard() -> usize {
    thread_local! {
        static SHARD: usize = {
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            NEXT.fetch_add(1, Ordering::Relaxed)
        };
    }
    SHARD.with(|s| *s)
}

impl Native {
    /// Open (or create) the store described by `ctx`.
    pub fn open(ctx: EngineCtx) -> Result<Native> {
        let inner = Arc::new(recovery::open(&ctx)?);
        let worker = if inner.background {
            let me = inner.clone();
            Some(std::thread::Builder::new().name("tierkv-native".into()).spawn(move || me.worker_loop())?)
        } else {
            None
        };
        let me = inner.clone();
        let spawned = std::thread::Builder::new().name("tierkv-native-ix".into()).spawn(move || {
            me.load_index();
            let mut ahead = Prefault::default();
            me.index.run_inserter(&me.stop, || me.prefault_ahead(&mut ahead))
        });
        let inserter = match spawned {
            Ok(h) => h,
            Err(e) => {
                // Stop the worker started above: it holds the store open. (The inserter
                // runs whatever `background` says: it changes nothing a reader can see.)
                // No thread loads the index: whoever waits for the load stops waiting.
                inner.index.abandon_load();
                Native { inner, worker: Mutex::new(worker), inserter: Mutex::new(None) }.stop_worker();
                return Err(e.into());
            }
        };
        inner.index.set_inserter(inserter.thread().clone());
        Ok(Native { inner, worker: Mutex::new(worker), inserter: Mutex::new(Some(inserter)) })
    }

    /// Stop the background threads and wait for them.
    fn stop_worker(&self) {
        // The worker's flag first, so no new round starts (and a move in progress stops
        // after its current batch). Then the capacity tier's compaction, before joining:
        // it stops at its next safe point and discards its partial outputs. The worker may
        // be waiting for it (a move's ingest takes the LSM's job lock), so joining the
        // worker first would make the close wait for the whole compaction (seconds under
        // load; forever in the test that parks it: tests/cancel.rs).
        self.inner.stop.store(true, Ordering::Release);
        self.inner.signal();
        self.inner.cold.lsm.stop();
        if let Some(h) = self.worker.lock().take() {
            let _ = h.join();
        }
        if let Some(h) = self.inserter.lock().take() {
            self.inner.index.wake_inserter();
            let _ = h.join();
        }
    }
}

impl Drop for Native {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

impl Inner {
    /// Move the entries of the checkpoint the open loaded into the index (see "Background
    /// load" in [`index`]); runs first on the inserter thread.
    fn load_index(&self) {
        if self.index.loaded() {
            return;
        }
        let t = std::time::Instant::now();
        // A panic in the load must not leave waiters waiting for good.
        struct Abandon<'a>(&'a Index);
        impl Drop for Abandon<'_> {
            fn drop(&mut self) {
                self.0.abandon_load();
            }
        }
        let guard = Abandon(&self.index);
        self.index.load_base(&self.stop, self.probe.as_deref());
        drop(guard);
        if self.index.loaded() {
            self.load_us.store(t.elapsed().as_micros().max(1) as u64, Ordering::Relaxed);
        }
    }

    /// Take a shard: the thread's own if free, else the next free one, else wait for the
    /// thread's own.
    fn acquire_shard(&self) -> (usize, MutexGuard<'_, ShardLog>) {
        if self.ckpt.pause.0.load(Ordering::Acquire) {
            self.wait_for_checkpoint();
        }
        let n = self.shards.len();
        let pref = thread_shard() % n;
        for i in 0..n {
            let j = (pref + i) % n;
            if let Some(g) = self.shards[j].log.try_lock() {
                if i > 0 {
                    self.counters.add(C_BUSY_SKIPS, i as u64);
                }
                return (j, g);
            }
        }
        self.counters.add(C_BUSY_SKIPS, n as u64);
        (pref, self.shards[pref].log.lock())
    }

    /// Wait while a checkpoint pauses writers to take every shard (at most about a
    /// millisecond: see `Inner::hold_every_shard`). Holds no shard.
    #[cold]
    fn wait_for_checkpoint(&self) {
        let mut spins = 0u32;
        while self.ckpt.pause.0.load(Ordering::Acquire) {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Wake the background thread.
    fn signal(&self) {
        *self.wake.lock() = true;
        self.wake_cv.notify_one();
    }

    /// The background thread: every 100 ms, or when woken, move cold keys to disk while
    /// over the capacity tier's bound, take moved slots out of the index, and clean
    /// mostly dead segments. A failure poisons the store (a damaged segment is left for
    /// `check`, as a writer's cleaning leaves it).
    fn worker_loop(self: Arc<Self>) {
        loop {
            {
                let mut w = self.wake.lock();
                if !*w && !self.stop.load(Ordering::Acquire) {
                    self.wake_cv.wait_for(&mut w, std::time::Duration::from_millis(100));
                }
                *w = false;
            }
            if self.stop.load(Ordering::Acquire) || self.closed.load(Ordering::Acquire) {
                return;
            }
            if self.poison.is_set() {
                continue;
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.maintain()));
            match r {
                Ok(Ok(())) => {}
                Ok(Err(Error::Closed)) => {}
                // Short of PM, or a damaged entry (left for `check`): counted, tried again
                // later (writers short of PM get `PmFull`, as without this thread). Disk
                // failures of a move are counted inside it. Anything else (a PM write
                // failed) poisons the store, as it does in a writer.
                Ok(Err(e)) if matches!(e, Error::PmFull(_)) || e.is_corruption() => self.cold.failed(&e),
                Ok(Err(e)) => self.poison.set(format!("background move/clean failed: {e}")),
                Err(_) => self.poison.set("background move/clean panicked".into()),
            }
        }
    }

    /// Segments created since the open.
    fn segments_created(&self) -> u64 {
        self.counters.get(C_SEGMENTS)
    }

    /// One round of background work (see [`Inner::worker_loop`]): moves and cleaning,
    /// then an index checkpoint when enough new log was written since the last.
    fn maintain(&self) -> Result<()> {
        // The checkpoint runs whatever the log work returned (a persistent failure there
        // must not stop checkpoints, or the log replayed after a crash grows unbounded).
        let r = self.maintain_log();
        if self.ckpt.due(self.segments_created(), self.geo.stride) {
            // A failed checkpoint (the disk) is counted (`checkpoint_failures`); the logs
            // still hold everything, so the store goes on, and tries again after the next
            // `checkpoint_bytes` of log.
            let _ = self.checkpoint_round();
        }
        r
    }

    fn maintain_log(&self) -> Result<()> {
        // Moves and cleaning judge keys by the index: not before it holds them all (and not
        // waiting for that with a shard held).
        if !self.index.loaded() {
            return Ok(());
        }
        let over = self.over_budget(0.0);
        let pending = self.cold.has_pending();
        let dirty = self.mostly_dead() || self.pm_tight();
        if !over && !pending && !dirty {
            return Ok(());
        }
        let (_, mut log) = self.acquire_shard();
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let moved = if over || pending { self.move_cold(&mut log, true, false).map(|_| ()) } else { Ok(()) };
        // Clean even when the move failed (it may have failed for want of PM).
        if self.mostly_dead() || self.pm_tight() {
            self.clean(&mut log, 8)?;
        }
        moved
    }

    /// Fault in the segment slots writers will take next (the lowest free ones: see
    /// `SlotAlloc::take`), one per shard, whenever a segment was created since the last
    /// look — so a writer opening a fresh segment finds its pages mapped instead of taking
    /// a page fault every 4 KiB (measured: a quarter of a put's time in fillrandom). Runs on
    /// the inserter thread; pages of reused slots are mapped already and cost a walk.
    fn prefault_ahead(&self, st: &mut Prefault) {
        let made = self.counters.get(C_SEGMENTS);
        if st.started && made == st.seen {
            return;
        }
        st.started = true;
        st.seen = made;
        let next: Vec<u64> = self.alloc.lock().lowest_free(self.shards.len());
        for s in next {
            if st.done.insert(s) {
                // In 256 KiB steps: the call holds the process's memory-map lock (shared)
                // while it runs, and a thread that maps memory meanwhile waits for it.
                let (a, step) = (self.geo.addr(s), 256 << 10);
                let mut ok = true;
                for off in (0..self.geo.stride).step_by(step) {
                    ok &= self.region.populate(a + off, (self.geo.stride - off).min(step as u64));
                }
                if ok {
                    self.counters.add(C_PREFAULTED, 1);
                }
                if st.done.len() > 4096 {
                    st.done.clear();
                }
            }
        }
    }

    /// Take `span` free slots. Short of them, with segments retired and waiting only for
    /// the epoch to move on, it pushes the epoch (a few pins and flushes run the deferred
    /// retirements) before giving up with [`Error::PmFull`].
    fn take_slot(&self, span: u64) -> Result<u64> {
        let mut tries = 0;
        loop {
            let r = {
                let mut a = self.alloc.lock();
                a.reclaim(self.oldest_snap.0.load(Ordering::SeqCst));
                a.take(&self.geo, &self.region, span)
            };
            match r {
                Err(Error::PmFull(_)) if tries < 64 && self.alloc.lock().retired() > 0 => {
                    // Up to ~50 ms: other threads' pins must end for the epoch to move.
                    tries += 1;
                    epoch::pin().flush();
                    if tries < 16 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
                r => return r,
            }
        }
    }

    /// The region is at its capacity with fewer free slots than shards.
    fn pm_tight(&self) -> bool {
        let mut a = self.alloc.lock();
        a.reclaim(self.oldest_snap.0.load(Ordering::SeqCst));
        a.free_slots() < 2 * self.shards.len() && !self.region.can_grow()
    }

    /// DRAM of the index of PM-resident keys (an estimate per slot, see `stats_impl`).
    fn index_dram_bytes(&self) -> u64 {
        self.index.slots() as u64 * (PER_SLOT_BYTES + 16)
    }

    /// The largest sequence number at or below which every write has completed, ignoring
    /// the write in flight on shard `skip`. Read the counter first, then the markers: a
    /// writer stores its marker before it takes its number, so a number below the counter
    /// is either complete or covered by a marker seen here.
    fn visible(&self, skip: Option<usize>) -> u64 {
        let mut m = self.next_seq.0.load(Ordering::SeqCst);
        for (i, s) in self.shards.iter().enumerate() {
            if Some(i) != skip {
                m = m.min(s.marker.load(Ordering::SeqCst));
            }
        }
        m.saturating_sub(1)
    }

    /// Wait until every write numbered at or below `target` has completed (ignoring the
    /// write in flight on shard `skip`): spin briefly, then yield (the writers waited for
    /// are past their number and never wait for the caller). Returns whether it waited.
    fn wait_visible(&self, target: u64, skip: Option<usize>) -> bool {
        let mut spins = 0u32;
        while self.visible(skip) < target {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        spins > 0
    }

    /// Advance the published sequence number; returns it.
    fn publish(&self) -> u64 {
        let v = self.visible(None);
        self.published.0.fetch_max(v, Ordering::SeqCst).max(v)
    }

    /// Versions no current or future snapshot can need lie below the newest version `<=`
    /// this number.
    fn keep(&self) -> u64 {
        let h = self.published.0.load(Ordering::SeqCst);
        h.min(self.oldest_snap.0.load(Ordering::SeqCst))
    }

    /// Register a snapshot; returns its sequence number. It first registers the published
    /// number (so writers that trim from now on keep what it may need), then publishes and
    /// moves the registration up to the new number.
    fn register_snapshot(&self) -> u64 {
        // Every write acknowledged before this call took a number below `c`: wait until
        // all of them have linked (a writer in flight with a lower number, or with a marker
        // still at its lower bound, would otherwise hold the snapshot below writes that
        // already returned). The wait is for writers already past their fence or about to
        // take their number; none of them waits for a snapshot.
        let c = self.next_seq.0.load(Ordering::SeqCst);
        self.wait_visible(c - 1, None);
        let mut live = self.snaps.live.lock();
        let p = self.published.0.load(Ordering::SeqCst);
        *live.entry(p).or_insert(0) += 1;
        self.set_oldest(&live);
        let s = self.publish();
        if s != p {
            unregister(&mut live, p);
            *live.entry(s).or_insert(0) += 1;
            self.set_oldest(&live);
        }
        s
    }

    fn release_snapshot(&self, s: u64) {
        let mut live = self.snaps.live.lock();
        unregister(&mut live, s);
        self.set_oldest(&live);
    }

    fn set_oldest(&self, live: &BTreeMap<u64, usize>) {
        self.oldest_snap.0.store(live.keys().next().copied().unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        self.poison.check()
    }

    /// A version's `size` must be its log entry's length before the version is marked
    /// verified (a checkpoint entry whose size disagrees with the log it names is
    /// corruption, and must never place a value).
    fn same_size(&self, size: u32, key: &[u8], value: &[u8], loc: u64) -> Result<()> {
        if entry_len(key.len(), value.len()) == size as usize {
            Ok(())
        } else {
            Err(self.region.corruption(loc, "log entry's length differs from its index version's"))
        }
    }

    /// Read and check the entry of version `(seq, loc)` (its checksum too when `verify`:
    /// a version loaded from a checkpoint); it must be `key`'s.
    fn entry_value(&self, key: &[u8], seq: u64, loc: u64, verify: bool) -> Result<&[u8]> {
        let e = self.read_entry(seq, loc, verify)?;
        if e.key != key {
            return Err(self.region.corruption(loc, "index entry points at another key's log entry"));
        }
        Ok(e.value)
    }

    /// Read the log entry at `loc` with sequence number `seq`: its checksum verified with
    /// `verify_reads` (and always by `check`), its structure only otherwise (every record
    /// was verified when it was replayed or written; see the module docs).
    fn read_entry(&self, seq: u64, loc: u64, verify: bool) -> Result<layout::EntryOut<'_>> {
        let h = self.region.slice_checked(loc, ENTRY_HEADER_LEN, "log entry header")?;
        let vlen = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let klen = usize::from(u16::from_le_bytes([h[8], h[9]]));
        let all = self.region.slice_checked(loc, entry_len(klen, vlen), "log entry")?;
        if verify || self.verify_reads {
            layout::decode_entry(all, 0, seq).map_err(|d| self.region.corruption(loc, d))
        } else {
            layout::parse_entry(all, seq).map_err(|d| self.region.corruption(loc, d))
        }
    }

    fn write_impl(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.check_open()?;
        let body: usize = ops.iter().map(|op| entry_len(op.key().len(), op_value(op).len())).sum();
        let len = record_len(body) as u64;
        // Record and segment lengths are 32-bit fields.
        if len + layout::SEG_HEADER_LEN + self.geo.stride > u64::from(u32::MAX) {
            return Err(Error::InvalidArgument(format!("a write of {len} bytes exceeds the 4 GiB a record can hold")));
        }
        let span = (len + layout::SEG_HEADER_LEN).div_ceil(self.geo.stride);
        if span > self.geo.slots_per_pool - 1 {
            return Err(Error::InvalidArgument(format!(
                "a write of {len} bytes does not fit in one PM pool (raise pm_pool_size)"
            )));
        }
        let n = ops.len() as u64;
        let (si, mut log) = self.acquire_shard();
        // `close` sets the flag before it takes every shard to write the clean-close record:
        // a writer that got its shard after that must not append past the recorded ends.
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let shard = &self.shards[si];
        shard.marker.store(self.next_seq.0.load(Ordering::SeqCst), Ordering::SeqCst);
        let base = self.next_seq.0.fetch_add(n, Ordering::SeqCst);
        shard.marker.store(base, Ordering::SeqCst);
        let mut appending = false;
        let r = self.write_owned(&mut log, si, base, ops, cond, len, &mut appending);
        shard.marker.store(IDLE, Ordering::SeqCst);
        log.writes += 1;
        let publish = log.writes.is_multiple_of(PUBLISH_EVERY);
        drop(log);
        if publish {
            self.publish();
        }
        if let Err(e) = &r {
            // A failure before the append (a conditional write's read of the disk tier)
            // wrote nothing: the error goes to the caller only.
            // `Closed`: a writer short of PM waited for the background index load and the
            // store closed meanwhile; nothing was written either.
            if appending && !matches!(e, Error::PmFull(_) | Error::InvalidArgument(_) | Error::Closed) {
                self.poison.set(format!("a write failed: {e}"));
            }
        }
        r
    }

    /// The write on an owned shard whose marker is set, with sequence numbers
    /// `base..base + ops.len()`. Sets `appending` once it starts writing PM.
    #[allow(clippy::too_many_arguments)]
    fn write_owned(
        &self,
        log: &mut ShardLog,
        si: usize,
        base: u64,
        ops: &[BatchOp],
        cond: Cond,
        len: u64,
        appending: &mut bool,
    ) -> Result<bool> {
        if cond != Cond::None && !self.condition_holds(si, base, ops, cond)? {
            return Ok(false);
        }
        *appending = true;
        let user: u64 = ops.iter().map(|op| (op.key().len() + op_value(op).len()) as u64).sum();
        let mut entries = ops.iter().map(|op| EntryIn { kind: op_kind(op), key: op.key(), value: op_value(op) });
        let at = self.append(log, base, ops.len() as u32, len, &mut entries, true)?;
        self.counters.add(C_USER_BYTES, user);
        self.counters.add(C_RECORDS, 1);
        self.link_record(ops, base, at);
        Ok(true)
    }

    /// The dead-byte counter of the slot holding PM address `a`.
    fn dead_at(&self, a: u64) -> Option<&AtomicU64> {
        let slot = self.geo.slot_holding(a);
        let pool = (slot / self.geo.slots_per_pool) as usize;
        let arr =
            self.dead.get(pool)?.get_or_init(|| (0..self.geo.slots_per_pool).map(|_| AtomicU64::new(0)).collect());
        arr.get((slot % self.geo.slots_per_pool) as usize)
    }

    /// Count `bytes` at `a` as dead (superseded or shadowed log entries).
    fn add_dead(&self, a: u64, bytes: u64) {
        if let Some(d) = self.dead_at(a) {
            d.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// True when at least half of the bytes of sealed segments are dead (and at least four
    /// segments' worth): the log's space amplification reached 2×.
    fn mostly_dead(&self) -> bool {
        let (mut used, mut dead) = (0u64, 0u64);
        for (&a, m) in self.segs.lock().iter() {
            if let Some(u) = m.sealed {
                used += u;
                dead += self.dead_bytes(a, m.span).min(u);
            }
        }
        dead >= 4 * self.geo.stride && 2 * dead >= used
    }

    /// Dead bytes of the segment at `addr` of `span` slots.
    fn dead_bytes(&self, addr: u64, span: u64) -> u64 {
        (0..span).filter_map(|i| self.dead_at(addr + i * self.geo.stride)).map(|d| d.load(Ordering::Relaxed)).sum()
    }

    /// Append one record of `count` entries numbered from `base` (`len` bytes in all) to
    /// the owned shard `log`: entries straight into PM, then the header with the record
    /// checksum, one flush of its lines, one fence. Returns the record's PM address.
    fn append(
        &self,
        log: &mut ShardLog,
        base: u64,
        count: u32,
        len: u64,
        entries: &mut dyn Iterator<Item = EntryIn<'_>>,
        may_clean: bool,
    ) -> Result<u64> {
        let seg = self.reserve(log, len, may_clean)?;
        let at = seg.end();
        let mut rh = RecordHeader::new(len as u32, seg.tag, count, base);
        let mut pos = at + RECORD_HEADER_LEN as u64;
        for (i, e) in entries.enumerate() {
            let eh = entry_header(base + i as u64, &e);
            rh.add(&eh);
            // SAFETY: `[at, at + len)` lies in the open segment of the shard this thread
            // owns, beyond every published record: no other thread reads or writes it.
            unsafe {
                self.region.write(pos, &eh)?;
                self.region.write(pos + ENTRY_HEADER_LEN as u64, e.key)?;
                self.region.write(pos + (ENTRY_HEADER_LEN + e.key.len()) as u64, e.value)?;
            }
            pos += entry_len(e.key.len(), e.value.len()) as u64;
        }
        // SAFETY: as above.
        unsafe { self.region.write(at, &rh.finish())? };
        self.region.flush(at, len);
        self.region.fence();
        if let Some(o) = log.open.as_mut() {
            o.len += len;
        }
        Ok(at)
    }

    /// Clean up to `max` sealed segments with at least [`CLEAN_DEAD_RATIO`] of their bytes
    /// dead, the deadest first: copy their live entries to the end of the caller's shard
    /// log (same sequence numbers, so replay cannot tell a copy from its original), point
    /// the index at the copies, and retire the segments. One cleaner at a time; a call
    /// made while one runs (including from the cleaner's own appends) does nothing.
    /// Returns the segments cleaned. See `docs/design/native.md` ("Log cleaning").
    fn clean(&self, log: &mut ShardLog, max: usize) -> Result<usize> {
        // Liveness is judged by the index: not before it holds every key.
        self.index.wait_loaded()?;
        if self.cleaning.swap(true, Ordering::AcqRel) {
            return Ok(0);
        }
        let r = self.clean_some(log, max);
        self.cleaning.store(false, Ordering::Release);
        r
    }

    fn clean_some(&self, log: &mut ShardLog, max: usize) -> Result<usize> {
        let mut cands: Vec<(u64, SegMeta, f64)> = self
            .segs
            .lock()
            .iter()
            .filter_map(|(&a, m)| {
                let used = m.sealed?;
                let ratio = if used == 0 { 1.0 } else { self.dead_bytes(a, m.span) as f64 / used as f64 };
                (ratio >= CLEAN_DEAD_RATIO).then_some((a, *m, ratio))
            })
            .collect();
        cands.sort_by(|a, b| b.2.total_cmp(&a.2));
        cands.truncate(max);
        let mut cleaned = 0;
        for (addr, m, _) in cands {
            self.clean_segment(log, addr, &m)?;
            cleaned += 1;
        }
        Ok(cleaned)
    }

    fn clean_segment(&self, log: &mut ShardLog, addr: u64, m: &SegMeta) -> Result<()> {
        let used = m.sealed.unwrap_or(0);
        let base = addr + layout::SEG_HEADER_LEN;
        let data = self.region.slice_checked(base, used as usize, "segment")?;
        let mut entries = Vec::new();
        let (_, end) = scan::scan(data, 0, m.tag, Some(used as usize), &mut |rec, e| entries.push((rec, e)));
        if let scan::End::Damaged(d) = end {
            return Err(self.region.corruption(base, d));
        }
        for (rec, e) in entries {
            let loc = base + (rec + e.offset) as u64;
            let (keep, has_slot) = if e.kind == Kind::Moved {
                // A moved entry matters while the key has no slot or its slot still holds
                // the moved version (its removal waits for a snapshot): see [`cold`].
                (self.index.newest_seq(e.key).is_none_or(|n| n <= e.seq), false)
            } else {
                let (live, has_slot) = self.index.holds(e.key, e.seq, loc);
                // A delete whose key has no slot (open drops keys whose newest entry
                // deletes them) is kept: older puts of the key may still lie in other
                // segments.
                (live || (e.kind == Kind::Delete && !has_slot), has_slot)
            };
            if !keep {
                self.gc_counters.add(G_DROPPED, 1);
                continue;
            }
            let size = entry_len(e.key.len(), e.value.len()) as u64;
            let len = record_len(size as usize) as u64;
            let mut one = std::iter::once(EntryIn { kind: e.kind, key: e.key, value: e.value });
            let at = self.append(log, e.seq, 1, len, &mut one, false)?;
            let to = at + RECORD_HEADER_LEN as u64;
            if has_slot && self.index.relocate(e.key, e.seq, loc, to, size as u32) != Some(true) {
                // Superseded while it was copied, or an older version kept for a snapshot
                // (counted dead when it was superseded): the copy counts as dead.
                self.add_dead(to, size);
            }
            self.gc_counters.add(G_RELOCATED, 1);
            self.gc_counters.add(G_RELOCATED_BYTES, size);
        }
        // The copies are durable (each append fenced). Forget the segment in PM (its magic
        // zeroed and persisted: open no longer replays it), then retire its slots until no
        // reader can hold a location in them.
        self.region.store_u64_atomic(addr, 0)?;
        self.region.persist(addr, 8);
        self.segs.lock().remove(&addr);
        let ready = Arc::new(AtomicBool::new(false));
        {
            let r = ready.clone();
            let g = epoch::pin();
            g.defer(move || r.store(true, Ordering::Release));
            g.flush();
        }
        let freed_at = self.next_seq.0.load(Ordering::SeqCst);
        self.alloc.lock().retire(log::Retired { slot: self.geo.slot_holding(addr), span: m.span, freed_at, ready });
        self.gc_counters.add(G_CLEANED, 1);
        Ok(())
    }

    /// Link the versions of a committed record at `at` into the index.
    fn link_record(&self, ops: &[BatchOp], base: u64, at: u64) {
        let gate = (ops.len() > 1).then(|| Arc::new(AtomicBool::new(false)));
        let keep = self.keep();
        let mut loc = at + RECORD_HEADER_LEN as u64;
        for (i, op) in ops.iter().enumerate() {
            let tomb = matches!(op, BatchOp::Delete { .. });
            let size = entry_len(op.key().len(), op_value(op).len()) as u32;
            let v = NewVersion { seq: base + i as u64, loc, size, tomb, gate: gate.clone() };
            let linked = self.index.link(op.key(), v, keep);
            self.count_link(linked, tomb, loc, size);
            loc += u64::from(size);
        }
        if let Some(g) = gate {
            g.store(true, Ordering::Release);
        }
    }

    fn count_link(&self, linked: Linked, tomb: bool, loc: u64, size: u32) {
        match linked {
            Linked::Newest(prev) => {
                if let Some((ploc, psize, _)) = prev {
                    self.add_dead(ploc, u64::from(psize));
                }
                let was_live = prev.is_some_and(|(_, _, t)| !t);
                if was_live && tomb {
                    self.counters.add(C_KEYS_REMOVED, 1);
                } else if !was_live && !tomb {
                    self.counters.add(C_KEYS_ADDED, 1);
                }
            }
            Linked::Shadowed => {
                self.counters.add(C_SHADOWED, 1);
                self.add_dead(loc, u64::from(size));
            }
            Linked::Duplicate => {}
        }
    }

    /// Wait until every write numbered below `base` has completed, then decide `cond` on
    /// the key's newest version below `base`.
    fn condition_holds(&self, si: usize, base: u64, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        if self.wait_visible(base - 1, Some(si)) {
            self.counters.add(C_COND_WAITS, 1);
        }
        let Some(op) = ops.first() else { return Ok(true) };
        let guard = epoch::pin();
        let mg = index::MapGuard::new();
        let in_index = match self.index.lookup(op.key(), &mg) {
            Some(index::Found::Slot(s)) => s.find(base - 1, &guard).map(|v| !v.tomb),
            Some(index::Found::Base(e)) => (e.seq < base).then_some(!e.tomb),
            None => None,
        };
        // Not in the index: the disk tier decides (it holds only versions below `keep`,
        // below `base`).
        let present = match in_index {
            Some(p) => p,
            None => self.cold.get(op.key(), None)?.flatten().is_some(),
        };
        Ok(match cond {
            Cond::None => true,
            Cond::Absent => !present,
            Cond::Present => present,
        })
    }

    /// The shard's open segment with room for `len` bytes: seal the current one and start a
    /// new one when it has none.
    fn reserve(&self, log: &mut ShardLog, len: u64, may_clean: bool) -> Result<OpenSeg> {
        if let Some(o) = log.open {
            if o.len + len <= o.cap {
                return Ok(o);
            }
        }
        let span = (len + layout::SEG_HEADER_LEN).div_ceil(self.geo.stride);
        let low = {
            let mut a = self.alloc.lock();
            a.reclaim(self.oldest_snap.0.load(Ordering::SeqCst));
            a.free_slots() < self.shards.len() && !self.region.can_grow()
        };
        // Before the background load is done, a writer waits for it only when PM is short
        // (the cleaning below then has to run); the optional work is skipped.
        let loaded = self.index.loaded();
        if may_clean && loaded && !self.background && self.over_budget(0.0) {
            // No background thread: the writer that starts a segment moves one batch of
            // cold keys to disk. A failure (a damaged entry, a full disk) is counted and
            // skipped: the write goes on, the keys stay in PM.
            if let Err(e) = self.move_cold(log, false, false) {
                self.cold.failed(&e);
            }
        }
        if may_clean && (low || (loaded && !self.background && self.mostly_dead())) {
            // PM is short, or half the log is dead: the writer that starts a segment then
            // cleans a few first (like a write stall); what it frees becomes reusable once
            // no reader can hold it. A damaged segment is left for `check` and `compact`.
            if let Err(e) = self.clean(log, 4) {
                if !e.is_corruption() {
                    return Err(e);
                }
            }
        }
        if let Some(o) = log.open {
            if o.len + len <= o.cap {
                return Ok(o);
            }
        }
        let slot = self.take_slot(span)?;
        let addr = self.geo.addr(slot);
        debug_assert!(!self.segs.lock().contains_key(&addr), "slot {slot} handed out while in use");
        if let Some(o) = log.open.take() {
            seal_segment(&self.region, o.addr, o.tag.gen, o.len)?;
            if let Some(m) = self.segs.lock().get_mut(&o.addr) {
                m.sealed = Some(o.len);
            }
        }
        for i in 0..span {
            if let Some(d) = self.dead_at(addr + i * self.geo.stride) {
                d.store(0, Ordering::Relaxed);
            }
        }
        let gen = log.next_gen;
        let h = layout::SegHeader { shard: log.id, gen, span: span as u32, salt: rand::random(), db_id: self.db_id };
        create_segment(&self.region, addr, &h)?;
        log.next_gen += 1;
        self.counters.add(C_SEGMENTS, 1);
        self.segs.lock().insert(addr, SegMeta { tag: h.tag(), span, sealed: None });
        let o = OpenSeg { addr, tag: h.tag(), len: 0, cap: self.geo.capacity(span) };
        log.open = Some(o);
        if self.background {
            self.signal();
        }
        Ok(o)
    }

    fn stats_impl(&self) -> Stats {
        // Exact while the capacity tier is empty; with keys on disk, the PM-resident live
        // keys plus the disk tables' entries (an estimate from above: see [`cold`]).
        let tables = self.cold.lsm.tables();
        let keys = (self.keys_at_open + self.counters.get(C_KEYS_ADDED))
            .saturating_sub(self.counters.get(C_KEYS_REMOVED) + self.cold.removed_puts.load(Ordering::Relaxed))
            + tables.entries();
        let slots = self.index.slots() as u64;
        let cold_dram = tables.dram_bytes();
        let free_slots = self.alloc.lock().free_slots() as u64;
        let live_segments = self.segs.lock().len() as u64;
        Stats::engine(
            "native",
            self.region.stats(),
            self.counters.get(C_USER_BYTES),
            keys,
            self.index_dram_bytes() + cold_dram,
            &[
                ("shards", self.shards.len() as u64),
                ("records", self.counters.get(C_RECORDS)),
                ("shard_busy_skips", self.counters.get(C_BUSY_SKIPS)),
                ("shadowed_versions", self.counters.get(C_SHADOWED)),
                ("conditional_waits", self.counters.get(C_COND_WAITS)),
                ("segments_created", self.counters.get(C_SEGMENTS)),
                ("segments_prefaulted", self.counters.get(C_PREFAULTED)),
                ("segments_cleaned", self.gc_counters.get(G_CLEANED)),
                ("entries_relocated", self.gc_counters.get(G_RELOCATED)),
                ("bytes_relocated", self.gc_counters.get(G_RELOCATED_BYTES)),
                ("dead_entries_dropped", self.gc_counters.get(G_DROPPED)),
                ("checkpoint_versions_verified", self.gc_counters.get(G_CKPT_VERIFIED)),
                ("segments_retired", self.alloc.lock().retired() as u64),
                ("index_slots", slots),
                ("tree_inserts_by_inserter", self.index.moved_by_inserter.load(Ordering::Relaxed)),
                ("tree_inserts_by_drains", self.index.moved_by_drains.load(Ordering::Relaxed)),
                ("index_load_us", self.load_us.load(Ordering::Relaxed)),
                ("index_load_slots", self.index.loaded_by_load.load(Ordering::Relaxed)),
                ("index_base_reads", self.index.base_reads.load(Ordering::Relaxed)),
                ("index_load_waits", self.index.load_waits.load(Ordering::Relaxed)),
                ("free_segment_slots", free_slots),
                ("segments", live_segments),
                ("published_seq", self.published.0.load(Ordering::Relaxed)),
                ("live_snapshots", self.snaps.live.lock().values().sum::<usize>() as u64),
                ("recovery_us", self.recovery_us),
                ("recovery_replay_us", self.recovery_phases_us[0]),
                ("recovery_sort_us", self.recovery_phases_us[1]),
                ("recovery_index_us", self.recovery_phases_us[2]),
                ("replayed_bytes", self.replayed_bytes),
                ("recovery_checkpoint_entries", self.ckpt.loaded_entries),
                ("recovery_checkpoint_rejected", u64::from(self.ckpt.rejected.is_some())),
                ("recovery_checkpoint_stale_dropped", self.ckpt.stale_dropped),
                ("checkpoints_written", self.ckpt.written.load(Ordering::Relaxed)),
                ("checkpoint_failures", self.ckpt.failures.load(Ordering::Relaxed)),
                ("checkpoint_entries", self.ckpt.last_entries.load(Ordering::Relaxed)),
                ("checkpoint_us", self.ckpt.last_us.load(Ordering::Relaxed)),
                ("checkpoint_shard_retries", self.ckpt.shard_retries.load(Ordering::Relaxed)),
                ("checkpoint_pauses", self.ckpt.pauses.load(Ordering::Relaxed)),
                ("checkpoint_deltas_written", self.ckpt.deltas_written.load(Ordering::Relaxed)),
                ("checkpoint_delta_entries", self.ckpt.last_delta_entries.load(Ordering::Relaxed)),
                ("checkpoint_delta_us", self.ckpt.last_delta_us.load(Ordering::Relaxed)),
                ("recovery_deltas", self.ckpt.loaded_deltas),
                ("recovery_delta_entries", self.ckpt.loaded_delta_entries),
                ("recovery_delta_rejected", u64::from(self.ckpt.delta_rejected.is_some())),
                ("cold_keys_moved", self.cold.moved_keys.load(Ordering::Relaxed)),
                ("cold_batches", self.cold.moved_batches.load(Ordering::Relaxed)),
                ("cold_slots_removed", self.cold.removed_slots.load(Ordering::Relaxed)),
                ("cold_disk_reads", self.cold.disk_reads.load(Ordering::Relaxed)),
                ("cold_move_failures", self.cold.failures.load(Ordering::Relaxed)),
                ("cold_tables", tables.tables() as u64),
                ("cold_table_bytes", tables.bytes()),
                ("cold_dram_bytes", cold_dram),
                ("index_dram_bytes", self.index_dram_bytes()),
                ("pm_live_log_bytes", self.live_log_bytes()),
            ],
        )
    }

    /// Verify every segment's records and that every key's newest version points at its
    /// own intact entry.
    fn check_impl(&self) -> Result<Vec<String>> {
        // Not with every shard held: writers would stall for the whole load.
        self.index.wait_loaded()?;
        // Writers wait while the logs are read (they hold their shard while appending).
        let _logs: Vec<MutexGuard<'_, ShardLog>> = self.shards.iter().map(|s| s.log.lock()).collect();
        let mut problems = Vec::new();
        let mut newest: BTreeMap<Vec<u8>, (u64, Kind)> = BTreeMap::new();
        salvage::walk(&*self.region, &self.geo, self.db_id, self.shards.len() as u32, &mut |ev| match ev {
            salvage::Event::Entry { key, seq, kind, .. } => {
                let e = newest.entry(key.to_vec()).or_insert((seq, kind));
                if seq > e.0 || (seq == e.0 && kind == Kind::Moved) {
                    *e = (seq, kind);
                }
            }
            salvage::Event::Bad { addr, detail } => {
                let (file, off) = self.region.locate(addr);
                problems.push(format!("{}:{off}: {detail}", file.display()));
            }
            salvage::Event::Torn => {}
        })?;
        let guard = epoch::pin();
        let mg = index::MapGuard::new();
        let mut in_tree = 0usize;
        for (key, slot) in self.index.ascending(std::ops::Bound::Unbounded, &mg)? {
            in_tree += 1;
            let Some(v) = slot.find(u64::MAX, &guard) else { continue };
            if !v.tomb {
                match self.read_entry(v.seq, v.loc(), true) {
                    Ok(e) if e.key != key => {
                        problems.push(format!("index entry of {} points at another key", crate::escape(key)))
                    }
                    Ok(_) => {}
                    Err(e) => problems.push(format!("key {}: {e}", crate::escape(key))),
                }
            }
            match newest.get(key.as_ref()) {
                Some(&(seq, _)) if seq == v.seq => {}
                other => problems.push(format!(
                    "key {}: index holds sequence {} but the logs' newest is {:?}",
                    crate::escape(key),
                    v.seq,
                    other.map(|o| o.0)
                )),
            }
        }
        if in_tree != self.index.slots() {
            problems.push(format!("{in_tree} keys in the ordered index, {} in the hash index", self.index.slots()));
        }
        // A key whose newest log entry is a put must have a slot (only a moved entry lets
        // a key leave the index).
        for (key, (seq, kind)) in &newest {
            if *kind == Kind::Put && self.index.newest_seq(key).is_none() {
                problems.push(format!(
                    "key {}: its newest log entry (sequence {seq}) has no index slot",
                    crate::escape(key)
                ));
            }
        }
        problems.extend(self.cold.lsm.check()?.into_iter().map(|p| format!("capacity tier: {p}")));
        if let Err(e) = self.cold.lsm.health() {
            problems.push(format!("capacity tier: takes no more moves: {e}"));
        }
        Ok(problems)
    }

    /// Clean shutdown: seal nothing (the clean-close record gives each shard's log end),
    /// persist the record, and refuse further calls.
    fn close_impl(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Wait for writes in flight: they hold their shard.
        let logs: Vec<MutexGuard<'_, ShardLog>> = self.shards.iter().map(|s| s.log.lock()).collect();
        if self.poison.is_set() {
            return Ok(());
        }
        self.cold.lsm.close()?;
        // The index checkpoint the next open loads instead of replaying the logs (resuming
        // at every log's end). If it cannot be written, the close goes on: the logs hold
        // everything (counted in `checkpoint_failures`).
        // A close before the background load finished writes none: the index lacks keys,
        // and the checkpoint the open loaded stays valid (every record written since lies
        // after its resume points, and nothing was cleaned or moved meanwhile: both wait
        // for the load), so the next open loads it and replays this session's records.
        if self.index.loaded() {
            let resume = logs.iter().map(|l| checkpoint::resume_point(l)).collect();
            let header =
                checkpoint::Header { db_id: self.db_id, horizon: self.next_seq.0.load(Ordering::SeqCst), resume };
            // Not while a `compact` checkpoint still writes the temp file.
            let mut chain = self.ckpt.writing.lock();
            let _ = self.write_checkpoint(header, false, &mut chain);
        }
        let tails = logs
            .iter()
            .map(|l| match l.open {
                Some(o) => layout::Tail { gen: o.tag.gen, len: o.len as u32 },
                None => layout::Tail { gen: 0, len: 0 },
            })
            .collect();
        let clean = layout::Clean { next_seq: self.next_seq.0.load(Ordering::SeqCst), tails };
        let bytes = clean.encode();
        // SAFETY: every shard is held, so no writer runs; the clean-close area of the meta
        // slot is written only here and at open (invalidation), never concurrently.
        unsafe { self.region.write(layout::CLEAN_ADDR, &bytes)? };
        self.region.persist(layout::CLEAN_ADDR, bytes.len() as u64);
        self.region.sync_all()?;
        Ok(())
    }
}

fn unregister(live: &mut BTreeMap<u64, usize>, s: u64) {
    if let Some(n) = live.get_mut(&s) {
        *n -= 1;
        if *n == 0 {
            live.remove(&s);
        }
    }
}

fn op_kind(op: &BatchOp) -> Kind {
    match op {
        BatchOp::Put { .. } => Kind::Put,
        BatchOp::Delete { .. } => Kind::Delete,
    }
}

fn op_value(op: &BatchOp) -> &[u8] {
    match op {
        BatchOp::Put { value, .. } => value,
        BatchOp::Delete { .. } => &[],
    }
}

/// A registered snapshot of a `native` store: a sequence number and the disk tier's
/// tables as they were (see [`cold`]).
pub(crate) struct NativeSnapshot {
    inner: Arc<Inner>,
    seq: u64,
    cold: cold::ColdPin,
}

impl NativeSnapshot {
    fn new(inner: &Arc<Inner>) -> NativeSnapshot {
        let seq = inner.register_snapshot();
        NativeSnapshot { inner: inner.clone(), seq, cold: inner.cold.pin() }
    }

    /// The snapshot's iterator: the index cursor, merged with the pinned disk tables
    /// (older) when there are any.
    fn cursor(self) -> crate::iter::BoxedIter {
        if self.cold.view.is_empty() {
            return Box::new(iter::NativeIter::new(self));
        }
        let mut sources = self.cold.view.sources();
        sources.insert(0, Box::new(iter::NativeIter::new(self)));
        Box::new(crate::iter::MergingIterator::new(sources))
    }
}

impl Drop for NativeSnapshot {
    fn drop(&mut self) {
        self.inner.release_snapshot(self.seq);
        self.inner.cold.unpin(self.cold.gen);
    }
}

impl EngineSnapshot for NativeSnapshot {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        get_at(&self.inner, key, self.seq, Some(&self.cold.view), &mut |v| v.to_vec())
    }

    fn iter(&self) -> Result<crate::iter::BoxedIter> {
        Ok(NativeSnapshot::new_same(self).cursor())
    }
}

impl NativeSnapshot {
    /// Another registration of the same sequence number and tables (an iterator of a
    /// snapshot).
    fn new_same(s: &NativeSnapshot) -> NativeSnapshot {
        let mut live = s.inner.snaps.live.lock();
        *live.entry(s.seq).or_insert(0) += 1;
        s.inner.set_oldest(&live);
        drop(live);
        NativeSnapshot { inner: s.inner.clone(), seq: s.seq, cold: s.inner.cold.pin_again(&s.cold) }
    }
}

/// `key`'s value as of `at` (`u64::MAX`: the newest visible), handed to `f`: its newest
/// version at `at` in the index, else its entry on disk (`view`: a snapshot's tables).
fn get_at<T>(
    inner: &Inner,
    key: &[u8],
    at: u64,
    view: Option<&crate::lsm::TablesView>,
    f: &mut dyn FnMut(&[u8]) -> T,
) -> Result<Option<T>> {
    {
        let mg = index::MapGuard::new();
        // Pinned across the PM read, for either kind of hit: a segment the cleaner retired
        // is reused only after every reader pinned before the retirement has left.
        let guard = epoch::pin();
        match inner.index.lookup(key, &mg) {
            Some(index::Found::Slot(slot)) => {
                slot.touch();
                if let Some(v) = slot.find(at, &guard) {
                    if v.tomb {
                        return Ok(None);
                    }
                    let unverified = v.unverified();
                    let value = inner.entry_value(key, v.seq, v.loc(), unverified)?;
                    if unverified {
                        // Marked verified, the version's size is trusted to place its value
                        // (walks read no log entry for it): it must be its entry's.
                        inner.same_size(v.size, key, value, v.loc())?;
                        v.mark_verified();
                        inner.gc_counters.add(G_CKPT_VERIFIED, 1);
                    }
                    return Ok(Some(f(value)));
                }
            }
            // Not loaded yet (the background load after an open): a checkpoint's entry is
            // read and verified each time until its slot exists (a log tail's was verified
            // by replay).
            Some(index::Found::Base(e)) if e.seq <= at => {
                if e.tomb {
                    return Ok(None);
                }
                return Ok(Some(f(inner.entry_value(key, e.seq, e.loc, e.unverified)?)));
            }
            Some(index::Found::Base(_)) | None => {}
        }
    }
    Ok(inner.cold.get(key, view)?.flatten().map(|v| f(&v)))
}

impl Engine for Native {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.inner.check_open()?;
        get_at(&self.inner, key, u64::MAX, None, &mut |v| v.to_vec())
    }

    fn get_with(&self, key: &[u8], f: &mut dyn FnMut(&[u8])) -> Result<bool> {
        self.inner.check_open()?;
        Ok(get_at(&self.inner, key, u64::MAX, None, &mut |v| f(v))?.is_some())
    }

    fn write(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        self.inner.write_impl(ops, cond)
    }

    fn iter(&self) -> Result<crate::iter::BoxedIter> {
        self.inner.check_open()?;
        Ok(NativeSnapshot::new(&self.inner).cursor())
    }

    fn has_snapshots(&self) -> bool {
        true
    }

    fn snapshot(&self) -> Result<Arc<dyn EngineSnapshot>> {
        self.inner.check_open()?;
        Ok(Arc::new(NativeSnapshot::new(&self.inner)))
    }

    fn flush(&self) -> Result<()> {
        // Every acknowledged write is already in its final place.
        self.inner.check_open()
    }

    fn compact(&self) -> Result<()> {
        self.inner.check_open()?;
        let inner = &self.inner;
        {
            let (_, mut log) = inner.acquire_shard();
            inner.move_cold(&mut log, true, true)?;
            inner.clean(&mut log, usize::MAX)?;
            inner.alloc.lock().reclaim(inner.oldest_snap.0.load(Ordering::SeqCst));
        }
        inner.cold.lsm.flush(true)?;
        inner.checkpoint()
    }

    fn stats(&self) -> Stats {
        self.inner.stats_impl()
    }

    fn check(&self) -> Result<Vec<String>> {
        self.inner.check_impl()
    }

    fn close(&self) -> Result<()> {
        // A close during the background load writes no checkpoint (see `close_impl`), so
        // the next open replays everything written since the loaded one. Once that is
        // `checkpoint_bytes` or more, finish the load first (at most what an open used to
        // take), so repeated short sessions do not grow the replay without bound.
        let inner = &self.inner;
        if !inner.index.loaded()
            && inner.ckpt.tail_due(inner.replayed_bytes, inner.segments_created(), inner.geo.stride)
        {
            let _ = inner.index.wait_loaded();
        }
        self.stop_worker();
        self.inner.close_impl()
    }
}
