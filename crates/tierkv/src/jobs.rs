//! Cancellation of background work: the token every preset's jobs check at their safe
//! points, and the probe tests use to watch (and pause) them.
//!
//! `close()` and `Drop` set the store's [`Cancel`] *before* joining its worker threads.
//! A long job (a compaction, a merge, a value-log GC) calls [`Cancel::point`] between its
//! output files and every [`CHECK_EVERY`] entries; once the token is set the call returns
//! `Err(Error::Closed)`, which the job propagates with `?` up to the place that knows its
//! partial work. There [`Cancel::on_cancel`] recognises it (the token is set and the error
//! is `Closed`: nothing else inside an engine returns `Closed`), runs the job's discard
//! (delete unreferenced outputs, undo tree changes not yet committed), counts the
//! cancellation and passes the error on. Callers treat it as the `Cancelled` outcome, not a
//! failure: [`Cancel::is_cancellation`] keeps it from poisoning the store, a worker thread
//! simply exits, and a foreground `compact()` racing `close()` returns `Error::Closed`.
//!
//! No job checks inside a commit step (a MANIFEST edit and what must be installed with it):
//! a cancelled job stops only where a crash would also be recoverable, and leaves the
//! store as before the job (or, for a job that commits in steps, as after its last step).
//! Full design: `docs/design/background-work.md`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// Entries a job processes between two checks: small enough that a job over 64 MiB of
/// input stops within a few milliseconds (256 entries of at most 16 KiB in the scaled-down
/// tests, a few MiB of copying in production).
pub(crate) const CHECK_EVERY: u64 = 256;

/// A store's shutdown flag for its background jobs. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Cancel {
    flag: AtomicBool,
    /// Jobs that observed the flag and stopped (`Stats::design["jobs_cancelled"]`).
    cancelled: AtomicU64,
    probe: Option<Arc<JobProbe>>,
}

impl Cancel {
    /// A token reporting to `probe` (tests; `None` in production).
    pub(crate) fn new(probe: Option<Arc<JobProbe>>) -> Cancel {
        Cancel { probe, ..Cancel::default() }
    }

    /// Ask every job to stop at its next safe point (and wake a job the probe paused).
    pub(crate) fn cancel(&self) {
        self.flag.store(true, Ordering::Release);
        if let Some(p) = &self.probe {
            p.wake();
        }
    }

    /// True once [`Cancel::cancel`] ran.
    #[inline]
    pub(crate) fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// A safe point: `Err(Error::Closed)` once cancelled. Only call where the job can stop
    /// and discard its partial work.
    #[inline]
    pub(crate) fn point(&self) -> Result<()> {
        if let Some(p) = &self.probe {
            p.at_safe_point(self);
        }
        if self.is_cancelled() {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// [`Cancel::point`] every [`CHECK_EVERY`]th call (`i` counts the job's entries).
    #[inline]
    pub(crate) fn every(&self, i: u64) -> Result<()> {
        if i.is_multiple_of(CHECK_EVERY) {
            self.point()
        } else {
            Ok(())
        }
    }

    /// True when `e` is this token's cancellation (not a failure: no poisoning).
    pub(crate) fn is_cancellation(&self, e: &Error) -> bool {
        matches!(e, Error::Closed) && self.is_cancelled()
    }

    /// The end of a job: when `r` is a cancellation, run `discard` (remove the job's
    /// unreferenced outputs, undo its uncommitted changes) and count it. A failing discard
    /// is returned instead (the store must then be poisoned: its state is unknown).
    pub(crate) fn on_cancel<T>(&self, r: Result<T>, discard: impl FnOnce() -> Result<()>) -> Result<T> {
        match r {
            Err(e) if self.is_cancellation(&e) => {
                discard()?;
                self.cancelled.fetch_add(1, Ordering::Relaxed);
                if let Some(p) = &self.probe {
                    p.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                Err(e)
            }
            r => r,
        }
    }

    /// Poison the store with `what`'s failure `r`, unless it is a cancellation (which is
    /// not a failure).
    pub(crate) fn poison_failure<T>(&self, poison: &crate::poison::Poison, what: &str, r: &Result<T>) {
        if let Err(e) = r {
            if !self.is_cancellation(e) {
                poison.set(format!("{what} failed: {e}"));
            }
        }
    }

    /// Jobs cancelled so far.
    pub(crate) fn jobs_cancelled(&self) -> u64 {
        self.cancelled.load(Ordering::Relaxed)
    }
}

/// Test instrumentation of background jobs ([`crate::Options::job_probe`]): counts safe
/// points passed and jobs cancelled, and, once armed with [`JobProbe::pause_at`], parks the
/// job that reaches the chosen safe point until the store is closed, so a test can close
/// the store in the middle of a job deterministically (no sleeps, no timing).
#[derive(Debug)]
pub struct JobProbe {
    /// Park at this safe point (counted over the probe's life from 1); 0 = never.
    pause_at: AtomicU64,
    state: Mutex<ProbeState>,
    cv: Condvar,
    points: AtomicU64,
    cancelled: AtomicU64,
    /// Batches a background index load may still take (`u64::MAX`: no limit; see
    /// [`JobProbe::limit_loads`]).
    loads_allowed: AtomicU64,
    loads: Mutex<()>,
    loads_cv: Condvar,
}

#[derive(Debug, Default)]
struct ProbeState {
    paused: bool,
    woken: bool,
}

impl Default for JobProbe {
    fn default() -> Self {
        JobProbe {
            pause_at: AtomicU64::new(0),
            state: Mutex::default(),
            cv: Condvar::new(),
            points: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            loads_allowed: AtomicU64::new(u64::MAX),
            loads: Mutex::new(()),
            loads_cv: Condvar::new(),
        }
    }
}

impl JobProbe {
    /// A probe that counts (and parks nothing until armed).
    pub fn new() -> Arc<JobProbe> {
        Arc::new(JobProbe::default())
    }

    /// Let a background index load (`native` after a checkpoint open) take `n` more
    /// batches and then wait until this is called again (`u64::MAX`: no limit) or the
    /// store closes, so a test can read and write while the index is half loaded.
    pub fn limit_loads(&self, n: u64) {
        let _g = self.loads.lock();
        self.loads_allowed.store(n, Ordering::Relaxed);
        self.loads_cv.notify_all();
    }

    /// Called by a background index load before each batch: waits while the batches
    /// allowed are used up, unless `stop()` says the store is closing. Returns `false`
    /// when stopped.
    pub fn load_batch(&self, stop: &dyn Fn() -> bool) -> bool {
        let mut g = self.loads.lock();
        loop {
            if stop() {
                return false;
            }
            let n = self.loads_allowed.load(Ordering::Relaxed);
            if n == u64::MAX {
                return true;
            }
            if n > 0 {
                self.loads_allowed.store(n - 1, Ordering::Relaxed);
                return true;
            }
            // A timeout: `stop` is a flag, not a notification of this condvar.
            self.loads_cv.wait_for(&mut g, std::time::Duration::from_millis(5));
        }
    }

    /// Arm the probe: the job reaching the `n`-th safe point from now (`n` ≥ 1, counted
    /// over every job of the store) parks until the store's token is cancelled (its
    /// `close()` or drop); every other safe point passes.
    pub fn pause_at(&self, n: u64) {
        self.pause_at.store(self.safe_points() + n.max(1), Ordering::Relaxed);
    }

    /// Block until a job is parked at the chosen safe point.
    pub fn wait_paused(&self) {
        let mut s = self.state.lock();
        while !s.paused && !s.woken {
            self.cv.wait(&mut s);
        }
    }

    /// Whether a job is parked at the chosen safe point now.
    pub fn is_paused(&self) -> bool {
        self.state.lock().paused
    }

    /// Let [`JobProbe::wait_paused`] return without a parked job (a test's job finished
    /// before reaching the chosen safe point) and park nothing more.
    pub fn release(&self) {
        self.pause_at.store(0, Ordering::Relaxed);
        self.wake();
    }

    /// Safe points passed by every job so far.
    pub fn safe_points(&self) -> u64 {
        self.points.load(Ordering::Relaxed)
    }

    /// Jobs that observed a cancellation and stopped.
    pub fn jobs_cancelled(&self) -> u64 {
        self.cancelled.load(Ordering::Relaxed)
    }

    fn at_safe_point(&self, cancel: &Cancel) {
        let n = self.points.fetch_add(1, Ordering::Relaxed) + 1;
        if n != self.pause_at.load(Ordering::Relaxed) {
            return;
        }
        let mut s = self.state.lock();
        s.paused = true;
        self.cv.notify_all();
        while !s.woken && !cancel.is_cancelled() {
            self.cv.wait(&mut s);
        }
        s.paused = false;
    }

    fn wake(&self) {
        self.state.lock().woken = true;
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancelled_point_is_closed_and_counted_once_discarded() {
        let c = Cancel::new(None);
        assert!(c.point().is_ok());
        assert!(c.every(1).is_ok());
        c.cancel();
        assert!(c.every(1).is_ok(), "only every CHECK_EVERY-th entry checks");
        let r: Result<()> = c.point();
        let mut discarded = false;
        let r = c.on_cancel(r, || {
            discarded = true;
            Ok(())
        });
        assert!(matches!(r, Err(Error::Closed)));
        assert!(discarded);
        assert_eq!(c.jobs_cancelled(), 1);
        // Another error is not a cancellation and discards nothing.
        let r: Result<()> = Err(Error::InvalidArgument("x".into()));
        assert!(matches!(c.on_cancel(r, || panic!("discarded a failure")), Err(Error::InvalidArgument(_))));
        assert_eq!(c.jobs_cancelled(), 1);
    }

    #[test]
    fn the_probe_parks_the_first_job_until_cancel() {
        let probe = JobProbe::new();
        probe.pause_at(1);
        let c = Arc::new(Cancel::new(Some(probe.clone())));
        let c2 = c.clone();
        let h = std::thread::spawn(move || c2.on_cancel(c2.point(), || Ok(())));
        probe.wait_paused();
        c.cancel();
        assert!(matches!(h.join().ok(), Some(Err(Error::Closed))));
        assert_eq!(probe.jobs_cancelled(), 1);
        assert_eq!(probe.safe_points(), 1);
        // Later points pass without parking.
        assert!(c.point().is_err());
        assert_eq!(probe.safe_points(), 2);
    }
}
