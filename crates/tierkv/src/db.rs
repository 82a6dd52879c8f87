//! [`Db`]: the public handle, common to every preset.

use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::batch::{BatchOp, WriteBatch};
use crate::engine::{self, Cond, Engine, EngineCtx};
use crate::error::{Error, Result};
use crate::fs::{CountingFs, Fs, FsLock, RealFs};
use crate::iter::{BoxedIter, DbIterator, IterOptions, Scan};
use crate::options::Options;
use crate::options_file::{OptionsRecord, RecordState, OPTIONS_FILE};
use crate::snapshot::{Overlay, SnapshotRef};
use crate::stats::Stats;

/// An open store. `Send + Sync`: share it between threads (e.g. in an `Arc`).
///
/// The hot path takes no lock of its own: `get` is a key-length check, one load of the
/// `closed` flag (a line no one writes until close) and the preset's lookup; a write adds
/// the PM-health flag and the snapshot gate's read side on the thread's own stripe
/// ([`crate::snapshot`]).
pub struct Db {
    engine: Arc<dyn Engine>,
    /// Set by `close` (and by a simulated crash): every later call is refused.
    closed: AtomicBool,
    /// Snapshots and the undo records that keep them consistent (presets without versions).
    overlay: Arc<Overlay>,
    /// The preset keeps versions: snapshots and iterators are its own, writes record no undo.
    engine_snapshots: bool,
    opts: Options,
    dir: PathBuf,
    fs: CountingFs,
    /// A failed msync of PM (recorded by the region) fails the write that sees it first and
    /// poisons every later one: what reached the medium is unknown.
    pm_health: Arc<crate::pm::PmHealth>,
    pm_failure_reported: AtomicBool,
    /// Log ranges the open dropped.
    recovery: Vec<crate::format::log::Dropped>,
    /// The directory lock, shared with every iterator and snapshot: they may borrow PM and
    /// files this handle mapped, so the store cannot be opened again (and its PM reused by
    /// the new handle's recovery) until the last of them is dropped.
    lock: Arc<dyn FsLock>,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db").field("dir", &self.dir).field("preset", &self.opts.preset).finish()
    }
}

impl Db {
    /// Open the store in `dir`, creating it if `opts.create_if_missing` (the default).
    pub fn open(dir: impl AsRef<Path>, opts: Options) -> Result<Db> {
        opts.validate()?;
        let dir = dir.as_ref().to_path_buf();
        let base: Arc<dyn Fs> = opts.fs.clone().unwrap_or_else(|| Arc::new(RealFs));
        let fs = CountingFs::new(base);
        if !fs.exists(&dir) {
            if !opts.create_if_missing {
                return Err(Error::InvalidArgument(format!("store directory {} does not exist", dir.display())));
            }
            fs.create_dir_all(&dir)?;
        }
        let lock_path = dir.join("LOCK");
        // The lock is an `flock` on `LOCK`. A process that forks (another thread spawning a
        // child) shares the lock with the child until the child execs and closes the
        // descriptor, so a handle closed just before can look held for a moment: retry
        // for up to 200 ms before reporting `Locked`.
        let mut tries = 0;
        let lock = loop {
            match fs.lock(&lock_path) {
                Ok(l) => break l,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && tries < 40 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Err(Error::Locked(dir.clone())),
                Err(e) => {
                    return Err(Error::Io(std::io::Error::new(
                        e.kind(),
                        format!("cannot lock {}: {e}", lock_path.display()),
                    )))
                }
            }
        };
        let path = dir.join(OPTIONS_FILE);
        let (record, fresh) = if fs.exists(&path) {
            let raw = fs.read_all(&path)?;
            let rec = OptionsRecord::decode(&raw).map_err(|(off, d)| Error::corruption(&path, off, d))?;
            if rec.preset != opts.preset {
                return Err(Error::PresetMismatch {
                    stored: rec.preset.to_string(),
                    requested: opts.preset.to_string(),
                });
            }
            if rec.state == RecordState::Ready && opts.error_if_exists {
                return Err(Error::InvalidArgument(format!("store {} already exists", dir.display())));
            }
            let fresh = rec.state == RecordState::Creating;
            (rec, fresh)
        } else {
            let rec =
                OptionsRecord { preset: opts.preset, db_id: rand::random::<u64>() | 1, state: RecordState::Creating };
            fs.write_atomic(&path, &rec.encode())?;
            (rec, true)
        };
        let pm_health = opts.pm_health.clone().unwrap_or_default();
        let ctx = EngineCtx {
            dir: dir.clone(),
            opts: opts.clone(),
            fs: fs.clone(),
            db_id: record.db_id,
            fresh,
            pm_health: pm_health.clone(),
            recovery: Default::default(),
        };
        let recovery = ctx.recovery.clone();
        let engine = engine::open(opts.preset, ctx)?;
        if fresh {
            let ready = OptionsRecord { state: RecordState::Ready, ..record };
            fs.write_atomic(&path, &ready.encode())?;
        }
        let recovery = std::mem::take(&mut *recovery.lock());
        Ok(Db {
            engine_snapshots: engine.has_snapshots(),
            engine,
            closed: AtomicBool::new(false),
            overlay: Arc::default(),
            opts,
            dir,
            fs,
            pm_health,
            pm_failure_reported: AtomicBool::new(false),
            recovery,
            lock: Arc::from(lock),
        })
    }

    /// The log ranges this open dropped instead of replaying: torn tails, and under
    /// [`crate::WalRecovery::PointInTime`] or [`crate::WalRecovery::SkipDamaged`] the damaged
    /// records and what followed them. Empty after a clean shutdown.
    pub fn recovery_report(&self) -> &[crate::format::log::Dropped] {
        &self.recovery
    }

    /// The preset recorded in `dir`, or `None` if no store exists there (real file system).
    pub fn stored_preset(dir: impl AsRef<Path>) -> Result<Option<crate::Preset>> {
        let path = dir.as_ref().join(OPTIONS_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let raw = RealFs.read_all(&path)?;
        let rec = OptionsRecord::decode(&raw).map_err(|(off, d)| Error::corruption(&path, off, d))?;
        Ok(Some(rec.preset))
    }

    fn engine(&self) -> Result<&dyn Engine> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        Ok(self.engine.as_ref())
    }

    /// `Err` once PM write-back failed: an I/O error the first time, `Poisoned` after.
    fn check_pm_health(&self) -> Result<()> {
        let Some(why) = self.pm_health.failure() else { return Ok(()) };
        if self.pm_failure_reported.swap(true, Ordering::AcqRel) {
            Err(Error::Poisoned(why))
        } else {
            Err(Error::Io(std::io::Error::other(format!("{why}; the store refuses writes until reopened"))))
        }
    }

    /// Run a write-side call on the engine; it succeeds only if PM write-back was healthy
    /// before and after it.
    fn guarded<T>(&self, f: impl FnOnce(&dyn Engine) -> Result<T>) -> Result<T> {
        self.check_pm_health()?;
        let r = f(self.engine()?);
        self.check_pm_health()?;
        r
    }

    /// Hand a write to the engine; it is acknowledged only if PM write-back stayed healthy.
    /// While snapshots live, the keys' current values are recorded first.
    fn engine_write(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        if self.engine_snapshots {
            return self.guarded(|e| e.write(ops, cond));
        }
        self.guarded(|e| {
            let gate = self.overlay.begin_write();
            if let Some(seq) = gate.must_record() {
                // Each distinct key once: its value before the whole batch.
                let mut seen = std::collections::HashSet::with_capacity(ops.len());
                let mut olds: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::with_capacity(ops.len());
                for op in ops {
                    if seen.insert(op.key()) {
                        olds.push((op.key().to_vec(), e.get(op.key())?));
                    }
                }
                self.overlay.record(seq, olds);
            }
            e.write(ops, cond)
        })
    }

    fn check_key(&self, key: &[u8]) -> Result<()> {
        if key.len() > self.opts.max_key_size {
            return Err(Error::InvalidArgument(format!(
                "key of {} bytes exceeds the limit of {}",
                key.len(),
                self.opts.max_key_size
            )));
        }
        Ok(())
    }

    fn check_value(&self, value: &[u8]) -> Result<()> {
        if value.len() > self.opts.max_value_size {
            return Err(Error::InvalidArgument(format!(
                "value of {} bytes exceeds the limit of {}",
                value.len(),
                self.opts.max_value_size
            )));
        }
        Ok(())
    }

    fn check_op(&self, op: &BatchOp) -> Result<()> {
        self.check_key(op.key())?;
        if let BatchOp::Put { value, .. } = op {
            self.check_value(value)?;
        }
        Ok(())
    }

    /// Set `key` to `value`. Durable (see the preset's docs) when it returns.
    pub fn put(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<()> {
        let op = BatchOp::Put { key: key.as_ref().to_vec(), value: value.as_ref().to_vec() };
        self.check_op(&op)?;
        self.engine_write(std::slice::from_ref(&op), Cond::None).map(|_| ())
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let key = key.as_ref();
        self.check_key(key)?;
        self.engine()?.get(key)
    }

    /// The value of `key` copied into `out` (cleared first; its capacity is reused, so a
    /// loop of reads into one buffer allocates nothing once it is large enough — on presets
    /// that lend values in place, `pmekv` today; the others copy from an owned value).
    /// Returns whether the key exists; `out` is left empty when it does not.
    pub fn get_into(&self, key: impl AsRef<[u8]>, out: &mut Vec<u8>) -> Result<bool> {
        let key = key.as_ref();
        self.check_key(key)?;
        out.clear();
        self.engine()?.get_with(key, &mut |v| out.extend_from_slice(v))
    }

    /// The preset's lookup alone (see [`crate::testing::engine_get`]).
    pub(crate) fn engine_get_unchecked(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.engine.get(key)
    }

    /// Remove `key` (no error if absent).
    pub fn delete(&self, key: impl AsRef<[u8]>) -> Result<()> {
        let op = BatchOp::Delete { key: key.as_ref().to_vec() };
        self.check_op(&op)?;
        self.engine_write(std::slice::from_ref(&op), Cond::None).map(|_| ())
    }

    /// Set `key` only if it is absent; returns whether it was written ("insert if not
    /// exists", SLM-DB). Atomic with respect to concurrent writers.
    pub fn insert_if_absent(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<bool> {
        let op = BatchOp::Put { key: key.as_ref().to_vec(), value: value.as_ref().to_vec() };
        self.check_op(&op)?;
        self.engine_write(std::slice::from_ref(&op), Cond::Absent)
    }

    /// Set `key` only if it is present; returns whether it was written ("insert if exists").
    pub fn update_if_present(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<bool> {
        let op = BatchOp::Put { key: key.as_ref().to_vec(), value: value.as_ref().to_vec() };
        self.check_op(&op)?;
        self.engine_write(std::slice::from_ref(&op), Cond::Present)
    }

    /// Apply a batch atomically: after a crash all of it is visible or none.
    pub fn write(&self, batch: WriteBatch) -> Result<()> {
        for op in &batch.ops {
            self.check_op(op)?;
        }
        if batch.is_empty() {
            return Ok(());
        }
        self.engine_write(&batch.ops, Cond::None).map(|_| ())
    }

    /// Entries with keys in `range`, in key order, as of the call (a consistent snapshot).
    pub fn scan<'a, R: RangeBounds<&'a [u8]>>(&self, range: R) -> Result<Scan> {
        let opts = IterOptions {
            lower: range.start_bound().map(|k| k.to_vec()),
            upper: range.end_bound().map(|k| k.to_vec()),
            prefix: None,
        };
        Ok(Scan::new(self.iter_with(&opts)?))
    }

    /// An iterator over a consistent snapshot of the whole store, before the first key;
    /// `seek` moves it (see [`DbIterator`]).
    pub fn iter(&self) -> Result<DbIterator> {
        self.iter_with(&IterOptions::default())
    }

    /// An iterator limited to `opts`' bounds and prefix.
    pub fn iter_with(&self, opts: &IterOptions) -> Result<DbIterator> {
        if self.engine_snapshots {
            // The preset's cursor is a snapshot of its own.
            return Ok(DbIterator::new(self.engine_iter()?, None, self.lock.clone(), opts));
        }
        let snap = self.overlay.snapshot();
        Ok(DbIterator::new(self.engine_iter()?, Some(snap), self.lock.clone(), opts))
    }

    /// The preset's merged cursor. Made after the snapshot was registered, so every write
    /// it might see has recorded its undo first.
    fn engine_iter(&self) -> Result<BoxedIter> {
        self.engine()?.iter()
    }

    /// A consistent point-in-time view for reads: [`Snapshot::get`] and
    /// [`Snapshot::iter`] see the store as it was at this call. Writers keep running; while
    /// a snapshot lives each write records the old values of its keys (see
    /// [`crate::snapshot`]), so drop snapshots when done.
    pub fn snapshot(&self) -> Result<Snapshot> {
        let e = self.engine()?;
        let view = if self.engine_snapshots {
            View::Engine(e.snapshot()?)
        } else {
            View::Overlay { snap: self.overlay.snapshot(), engine: self.engine.clone() }
        };
        Ok(Snapshot { view, lock: self.lock.clone() })
    }

    /// Force the preset's pending background work (write-back, memtable flush) now.
    pub fn flush(&self) -> Result<()> {
        self.guarded(|e| e.flush())
    }

    /// Force compaction / garbage collection now. A `compact()` racing [`Db::close`] (or
    /// the handle's drop) is cancelled like the background jobs: a job in flight stops at
    /// its next safe point, discards its partial work and the call returns
    /// [`Error::Closed`]; between jobs it starts no new one and returns `Ok`
    /// (`docs/design/background-work.md`).
    pub fn compact(&self) -> Result<()> {
        self.guarded(|e| e.compact())
    }

    /// Counters (see [`Stats`]).
    pub fn stats(&self) -> Stats {
        let mut s = match self.engine() {
            Ok(e) => e.stats(),
            Err(_) => Stats { preset: self.opts.preset.to_string(), ..Stats::default() },
        };
        let c = self.fs.counters();
        s.disk_bytes_written += c.bytes_written();
        s.disk_bytes_read += c.bytes_read();
        s.finish()
    }

    /// Verify every checksum and the agreement of index and data; returns the problems
    /// found (empty when the store is sound).
    pub fn check(&self) -> Result<Vec<String>> {
        self.engine()?.check()
    }

    /// The store directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The preset this store runs.
    pub fn preset(&self) -> crate::Preset {
        self.opts.preset
    }

    /// Clean shutdown. Later calls on this handle return [`Error::Closed`]. Calls already
    /// running finish on the closed engine (as they may fail, their writes are not
    /// promised); iterators and snapshots read on what they pinned. The store can be opened
    /// again once this handle *and* its iterators and snapshots are dropped; until then
    /// [`Db::open`] returns [`Error::Locked`] (they may still borrow its PM).
    pub fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.engine.close()
    }
}

impl Db {
    /// Drop the handle *without* a clean shutdown, as if the process had been killed: no
    /// final write-back, no flush, background threads stopped where they are. For crash
    /// tests (pair it with [`crate::pm::sim::SimDevice::simulate_crash`] and
    /// [`crate::fs::FaultFs::crash`]).
    pub fn simulate_process_crash(self) {
        self.closed.store(true, Ordering::Release);
        drop(self);
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

/// A consistent point-in-time view of a store ([`Db::snapshot`]).
pub struct Snapshot {
    view: View,
    /// Keeps the store from being reopened while the snapshot lives (see [`Db`]'s `lock`).
    lock: Arc<dyn FsLock>,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot").finish()
    }
}

/// How a snapshot reads.
enum View {
    /// The preset's current state and the undo overlay ([`crate::snapshot`]).
    Overlay { snap: SnapshotRef, engine: Arc<dyn Engine> },
    /// The preset's own versions.
    Engine(Arc<dyn engine::EngineSnapshot>),
}

impl Snapshot {
    /// The value `key` had when the snapshot was taken.
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>> {
        let key = key.as_ref();
        match &self.view {
            View::Engine(s) => s.get(key),
            View::Overlay { snap, engine } => {
                // The preset first, then the undo map: a write that changed the value read
                // has recorded before applying.
                let now = engine.get(key)?;
                Ok(match snap.lookup(key) {
                    Some(old) => old,
                    None => now,
                })
            }
        }
    }

    /// An iterator over the snapshot (see [`DbIterator`]).
    pub fn iter(&self) -> Result<DbIterator> {
        self.iter_with(&IterOptions::default())
    }

    /// An iterator over the snapshot limited to `opts`.
    pub fn iter_with(&self, opts: &IterOptions) -> Result<DbIterator> {
        match &self.view {
            View::Engine(s) => Ok(DbIterator::new(s.iter()?, None, self.lock.clone(), opts)),
            View::Overlay { snap, engine } => {
                Ok(DbIterator::new(engine.iter()?, Some(snap.another()), self.lock.clone(), opts))
            }
        }
    }
}
