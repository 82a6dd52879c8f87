//! Snapshots for every preset: the undo overlay.
//!
//! None of the five papers keeps versions: their memtables, PM trees and hot stores are
//! updated in place. A consistent view is still what a user expects of an iterator (a
//! write made after the iterator was created is not seen by it), and of
//! [`crate::Db::snapshot`]. The store gets it from one mechanism above the presets, in the
//! spirit of InnoDB's undo-based read views:
//!
//! - Every live snapshot has a sequence number `s`, the write counter at its creation.
//!   While at least one snapshot lives, every write takes a number `w > s` when it
//!   begins, reads the *current* value of each key it touches, and records it in the
//!   **undo map** under `w` — before the write reaches the preset.
//! - The value of `k` as of `s` is then: the old value in the first record appended for
//!   `k` by a write numbered above `s`, if there is one (`None`: absent); else the
//!   preset's current value (the key was not written since `s`).
//! - An iterator is a snapshot plus the preset's own cursor ([`crate::engine::Engine::iter`]),
//!   merged with the undo map: undo keys supply the snapshot's version, including keys
//!   deleted since (which the preset no longer has), and hide keys inserted since.
//!
//! Why it is exact: a snapshot is registered under the **gate**, which waits for every
//! write in flight, so a write numbered above `s` began after `s` existed and one numbered
//! at or below it had finished. A write records before it applies. So the first record
//! appended for `k` after `s` holds a value read before any write after `s` was applied to
//! `k` (such a write would have appended its own record first): `k`'s value at `s`. And
//! whoever reads the preset's new value and then consults the undo map finds the record.

//! Cost: nothing is recorded while no snapshot lives — a write pays one uncontended
//! read-lock of its thread's gate stripe (its own cache line) and one atomic load. While
//! snapshots live, each written key costs a point read of the preset and an undo record;
//! records are dropped as soon as no live snapshot needs them. Creating a snapshot takes
//! every stripe of the gate exclusively, so it waits for the writes in flight.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

/// Stripes of the gate: writers take the read side of one (their thread's), snapshot
/// creation takes all. A power of two.
const GATE_STRIPES: usize = 16;

#[repr(align(128))]
#[derive(Debug, Default)]
struct Stripe(RwLock<()>);

/// One recorded old value: the writing sequence number and the value before it.
type Record = (u64, Option<Vec<u8>>);

#[derive(Debug, Default)]
struct State {
    /// Live snapshots: sequence number → count.
    snaps: BTreeMap<u64, usize>,
    /// Key → records, in the order they were appended (not necessarily by number).
    undo: BTreeMap<Vec<u8>, Vec<Record>>,
}

/// The overlay of one store.
#[derive(Debug)]
pub(crate) struct Overlay {
    gate: Box<[Stripe]>,
    /// Live snapshots (read by every write).
    live: AtomicUsize,
    /// Keys in the undo map (read by iterators to skip the lookup when zero).
    undo_keys: AtomicUsize,
    seq: AtomicU64,
    state: Mutex<State>,
}

impl Default for Overlay {
    fn default() -> Overlay {
        Overlay {
            gate: (0..GATE_STRIPES).map(|_| Stripe::default()).collect(),
            live: AtomicUsize::new(0),
            undo_keys: AtomicUsize::new(0),
            seq: AtomicU64::new(0),
            state: Mutex::new(State::default()),
        }
    }
}

fn stripe_of_thread() -> usize {
    thread_local! {
        static STRIPE: usize = {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            NEXT.fetch_add(1, Ordering::Relaxed) % GATE_STRIPES
        };
    }
    STRIPE.with(|s| *s)
}

/// A write in flight: holds the caller's gate stripe until dropped.
pub(crate) struct WriteGuard<'a> {
    _stripe: RwLockReadGuard<'a, ()>,
    /// The write's sequence number when it must record undo.
    record_as: Option<u64>,
}

impl WriteGuard<'_> {
    /// `Some(seq)` when snapshots live and the write must record the old values first.
    pub(crate) fn must_record(&self) -> Option<u64> {
        self.record_as
    }
}

impl Overlay {
    /// Enter a write. Keep the guard until the write has reached the preset.
    pub(crate) fn begin_write(&self) -> WriteGuard<'_> {
        let stripe = self.gate[stripe_of_thread()].0.read();
        let record_as = (self.live.load(Ordering::SeqCst) > 0).then(|| self.seq.fetch_add(1, Ordering::SeqCst) + 1);
        WriteGuard { _stripe: stripe, record_as }
    }

    /// Record the values `olds` had before write `seq`.
    pub(crate) fn record(&self, seq: u64, olds: Vec<(Vec<u8>, Option<Vec<u8>>)>) {
        let mut st = self.state.lock();
        for (k, old) in olds {
            st.undo.entry(k).or_default().push((seq, old));
        }
        self.undo_keys.store(st.undo.len(), Ordering::SeqCst);
    }

    /// Register a snapshot of the current state.
    pub(crate) fn snapshot(self: &Arc<Self>) -> SnapshotRef {
        let guards: Vec<_> = self.gate.iter().map(|s| s.0.write()).collect();
        let seq = self.seq.load(Ordering::SeqCst);
        *self.state.lock().snaps.entry(seq).or_insert(0) += 1;
        self.live.fetch_add(1, Ordering::SeqCst);
        drop(guards);
        SnapshotRef { overlay: self.clone(), seq }
    }

    fn release(&self, seq: u64) {
        let mut st = self.state.lock();
        if let Some(n) = st.snaps.get_mut(&seq) {
            *n -= 1;
            if *n == 0 {
                st.snaps.remove(&seq);
            }
        }
        self.live.fetch_sub(1, Ordering::SeqCst);
        match st.snaps.keys().next().copied() {
            None => st.undo.clear(),
            Some(oldest) => st.undo.retain(|_, recs| {
                recs.retain(|r| r.0 > oldest);
                !recs.is_empty()
            }),
        }
        self.undo_keys.store(st.undo.len(), Ordering::SeqCst);
    }

    /// The version as of `seq` of `key`, if it was written since: `Some(old)`.
    fn lookup(&self, key: &[u8], seq: u64) -> Option<Option<Vec<u8>>> {
        if self.undo_keys.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let st = self.state.lock();
        st.undo.get(key).and_then(|recs| as_of(recs, seq))
    }

    /// The first undo key after `from` (forward) or before it (backward) that was written
    /// since `seq`, with its version as of `seq`.
    fn neighbour(&self, from: Bound<&[u8]>, forward: bool, seq: u64) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
        if self.undo_keys.load(Ordering::SeqCst) == 0 {
            return None;
        }
        let st = self.state.lock();
        let pick = |(k, recs): (&Vec<u8>, &Vec<Record>)| as_of(recs, seq).map(|v| (k.clone(), v));
        if forward {
            st.undo.range::<[u8], _>((from, Bound::Unbounded)).find_map(pick)
        } else {
            st.undo.range::<[u8], _>((Bound::Unbounded, from)).rev().find_map(pick)
        }
    }
}

/// The old value in the first record appended by a write numbered above `seq`.
fn as_of(recs: &[Record], seq: u64) -> Option<Option<Vec<u8>>> {
    recs.iter().find(|r| r.0 > seq).map(|r| r.1.clone())
}

/// A registered snapshot; released on drop.
#[derive(Debug)]
pub(crate) struct SnapshotRef {
    overlay: Arc<Overlay>,
    seq: u64,
}

impl SnapshotRef {
    /// Another registration of the same point in time (for an iterator over a
    /// [`crate::Snapshot`]); no gate needed, as this one keeps its records alive.
    pub(crate) fn another(&self) -> SnapshotRef {
        *self.overlay.state.lock().snaps.entry(self.seq).or_insert(0) += 1;
        self.overlay.live.fetch_add(1, Ordering::SeqCst);
        SnapshotRef { overlay: self.overlay.clone(), seq: self.seq }
    }

    /// Resolve `key` as of this snapshot: `Some(v)` when the overlay decides, `None` when
    /// the preset's current value is the snapshot's.
    pub(crate) fn lookup(&self, key: &[u8]) -> Option<Option<Vec<u8>>> {
        self.overlay.lookup(key, self.seq)
    }

    /// See [`Overlay::neighbour`].
    pub(crate) fn neighbour(&self, from: Bound<&[u8]>, forward: bool) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
        self.overlay.neighbour(from, forward, self.seq)
    }
}

impl Drop for SnapshotRef {
    fn drop(&mut self) {
        self.overlay.release(self.seq);
    }
}
