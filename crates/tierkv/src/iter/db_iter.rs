//! The public iterators: [`DbIterator`] and [`Scan`].
//!
//! A `DbIterator` is a snapshot ([`crate::snapshot`]) plus the preset's merged cursor
//! ([`crate::engine::Engine::iter`]). Each step moves the preset's cursor, then asks the
//! snapshot's undo map for the nearest key written since the snapshot was taken (skipped
//! entirely while the map is empty, the common case: one atomic load); the nearer of the
//! two is the next entry, and an undo entry's version is the snapshot's. Tombstones and
//! keys absent at the snapshot are skipped; bounds end the walk.
//!
//! Isolation: the iterator sees the store as it was when it was created — a consistent
//! snapshot. Writes made afterwards, by any thread, are not seen; a batch is seen whole or
//! not at all.
//!
//! The cursor model is a *gap* between entries, as `java.util.ListIterator`:
//! [`DbIterator::seek`] puts the gap before the first key `>= key`,
//! [`DbIterator::seek_for_prev`] after the last key `<= key`, and [`DbIterator::next`] /
//! [`DbIterator::prev`] return the entry after / before the gap and move past it. So
//! `next` then `prev` return the same entry. Seeks are lazy: their errors surface from the
//! following `next`/`prev`.

use std::ops::Bound;
use std::sync::Arc;

use super::{BoxedIter, InternalIterator};
use crate::error::Result;
use crate::snapshot::SnapshotRef;

/// Bounds and prefix of an iterator ([`crate::Db::iter_with`]).
#[derive(Debug, Clone)]
pub struct IterOptions {
    /// Smallest key returned.
    pub lower: Bound<Vec<u8>>,
    /// Largest key returned.
    pub upper: Bound<Vec<u8>>,
    /// Only keys starting with this (combined with the bounds).
    pub prefix: Option<Vec<u8>>,
}

impl Default for IterOptions {
    fn default() -> IterOptions {
        IterOptions { lower: Bound::Unbounded, upper: Bound::Unbounded, prefix: None }
    }
}

impl IterOptions {
    /// Keys in `[lower, upper)`.
    pub fn range(lower: &[u8], upper: &[u8]) -> IterOptions {
        IterOptions { lower: Bound::Included(lower.to_vec()), upper: Bound::Excluded(upper.to_vec()), prefix: None }
    }

    /// Keys starting with `prefix`.
    pub fn prefix(prefix: &[u8]) -> IterOptions {
        IterOptions { prefix: Some(prefix.to_vec()), ..IterOptions::default() }
    }

    /// The effective bounds: the given ones intersected with the prefix's range.
    fn bounds(&self) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
        let (mut lo, mut hi) = (self.lower.clone(), self.upper.clone());
        if let Some(p) = &self.prefix {
            let plo = Bound::Included(p.clone());
            if lower_is_tighter(&plo, &lo) {
                lo = plo;
            }
            if let Some(succ) = prefix_end(p) {
                let phi = Bound::Excluded(succ);
                if upper_is_tighter(&phi, &hi) {
                    hi = phi;
                }
            }
        }
        (lo, hi)
    }
}

/// The smallest key after every key starting with `prefix`; `None` if there is none
/// (`prefix` is empty or all `0xff`).
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut s = prefix.to_vec();
    while let Some(last) = s.pop() {
        if last < 0xff {
            s.push(last + 1);
            return Some(s);
        }
    }
    None
}

fn lower_is_tighter(a: &Bound<Vec<u8>>, b: &Bound<Vec<u8>>) -> bool {
    match (a, b) {
        (_, Bound::Unbounded) => true,
        (Bound::Unbounded, _) => false,
        (Bound::Included(x) | Bound::Excluded(x), Bound::Included(y) | Bound::Excluded(y)) if x != y => x > y,
        (Bound::Excluded(_), _) => true,
        _ => false,
    }
}

fn upper_is_tighter(a: &Bound<Vec<u8>>, b: &Bound<Vec<u8>>) -> bool {
    match (a, b) {
        (_, Bound::Unbounded) => true,
        (Bound::Unbounded, _) => false,
        (Bound::Included(x) | Bound::Excluded(x), Bound::Included(y) | Bound::Excluded(y)) if x != y => x < y,
        (Bound::Excluded(_), _) => true,
        _ => false,
    }
}

fn above_lower(k: &[u8], lo: &Bound<Vec<u8>>) -> bool {
    match lo {
        Bound::Unbounded => true,
        Bound::Included(l) => k >= l.as_slice(),
        Bound::Excluded(l) => k > l.as_slice(),
    }
}

fn below_upper(k: &[u8], hi: &Bound<Vec<u8>>) -> bool {
    match hi {
        Bound::Unbounded => true,
        Bound::Included(h) => k <= h.as_slice(),
        Bound::Excluded(h) => k < h.as_slice(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Forward,
    Reverse,
}

/// Where the current entry lives.
#[derive(Debug)]
enum Cur {
    None,
    /// The preset cursor's entry.
    Engine,
    /// A version from the undo map.
    Undo(Vec<u8>, Vec<u8>),
}

/// A positioned iterator over the snapshot: the preset's cursor resolved against the undo
/// map, tombstones and out-of-bounds keys skipped.
struct Resolved {
    e: BoxedIter,
    /// The undo overlay, for presets without versions (`None`: the cursor is a snapshot).
    snap: Option<SnapshotRef>,
    dir: Dir,
    cur: Cur,
    lo: Bound<Vec<u8>>,
    hi: Bound<Vec<u8>>,
    /// The current key, copied when stepping (reused buffer).
    scratch: Vec<u8>,
}

impl Resolved {
    fn valid(&self) -> bool {
        !matches!(self.cur, Cur::None)
    }

    fn key(&self) -> &[u8] {
        match &self.cur {
            Cur::None => &[],
            Cur::Engine => self.e.key(),
            Cur::Undo(k, _) => k,
        }
    }

    fn value(&self) -> &[u8] {
        match &self.cur {
            Cur::None => &[],
            Cur::Engine => self.e.value().unwrap_or(&[]),
            Cur::Undo(_, v) => v,
        }
    }

    fn fail<T>(&mut self, e: crate::Error) -> Result<T> {
        self.cur = Cur::None;
        Err(e)
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        let target = match &self.lo {
            Bound::Included(l) | Bound::Excluded(l) if key < l.as_slice() => l.clone(),
            _ => key.to_vec(),
        };
        if let Err(e) = self.e.seek(&target) {
            return self.fail(e);
        }
        self.dir = Dir::Forward;
        self.resolve(Bound::Included(&target), true)
    }

    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        let target = match &self.hi {
            Bound::Included(h) | Bound::Excluded(h) if key > h.as_slice() => h.clone(),
            _ => key.to_vec(),
        };
        if let Err(e) = self.e.seek_for_prev(&target) {
            return self.fail(e);
        }
        self.dir = Dir::Reverse;
        self.resolve(Bound::Included(&target), false)
    }

    fn seek_to_first(&mut self) -> Result<()> {
        match self.lo.clone() {
            Bound::Included(l) | Bound::Excluded(l) => self.seek(&l),
            Bound::Unbounded => {
                if let Err(e) = self.e.seek_to_first() {
                    return self.fail(e);
                }
                self.dir = Dir::Forward;
                self.resolve(Bound::Unbounded, true)
            }
        }
    }

    fn seek_to_last(&mut self) -> Result<()> {
        match self.hi.clone() {
            Bound::Included(h) | Bound::Excluded(h) => self.seek_for_prev(&h),
            Bound::Unbounded => {
                if let Err(e) = self.e.seek_to_last() {
                    return self.fail(e);
                }
                self.dir = Dir::Reverse;
                self.resolve(Bound::Unbounded, false)
            }
        }
    }

    /// Step past the current entry, forward or back.
    fn step(&mut self, forward: bool) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        let mut k = std::mem::take(&mut self.scratch);
        k.clear();
        k.extend_from_slice(self.key());
        let want = if forward { Dir::Forward } else { Dir::Reverse };
        let r = (|| {
            if self.dir != want {
                // The preset cursor sits on the other side of the gap: re-seek it.
                if forward {
                    self.e.seek(&k)?;
                } else {
                    self.e.seek_for_prev(&k)?;
                }
                self.dir = want;
            }
            if self.e.valid() && self.e.key() == k.as_slice() {
                if forward {
                    self.e.next()?;
                } else {
                    self.e.prev()?;
                }
            }
            Ok(())
        })();
        if let Err(e) = r {
            self.scratch = k;
            return self.fail(e);
        }
        let r = self.resolve(Bound::Excluded(&k), forward);
        self.scratch = k;
        r
    }

    /// Settle on the first visible entry from `from` in the walk's direction: the nearer of
    /// the preset cursor's entry and the undo map's next key (the undo map's version wins a
    /// tie). The preset cursor must already be positioned at or past `from`.
    fn resolve(&mut self, from: Bound<&[u8]>, forward: bool) -> Result<()> {
        // Past the first skipped entry, the walk continues after the key skipped.
        let mut skipped: Option<Vec<u8>> = None;
        loop {
            let from = match &skipped {
                Some(k) => Bound::Excluded(k.as_slice()),
                None => from,
            };
            let undo = self.snap.as_ref().and_then(|s| s.neighbour(from, forward));
            let ek = self.e.valid().then(|| self.e.key());
            // The nearer of the two; the undo map's version wins a tie.
            let from_undo = match (&undo, ek) {
                (None, None) => {
                    self.cur = Cur::None;
                    return Ok(());
                }
                (Some((uk, _)), Some(ek)) => {
                    if forward {
                        uk.as_slice() <= ek
                    } else {
                        uk.as_slice() >= ek
                    }
                }
                (some, _) => some.is_some(),
            };
            let key: &[u8] = match (&undo, ek) {
                (Some((uk, _)), _) if from_undo => uk,
                (_, Some(ek)) => ek,
                _ => &[],
            };
            let ahead_ok = if forward { below_upper(key, &self.hi) } else { above_lower(key, &self.lo) };
            if !ahead_ok {
                self.cur = Cur::None;
                return Ok(());
            }
            let behind_ok = if forward { above_lower(key, &self.lo) } else { below_upper(key, &self.hi) };
            match undo {
                Some((uk, uv)) if from_undo => {
                    if let (Some(v), true) = (uv, behind_ok) {
                        self.cur = Cur::Undo(uk, v);
                        return Ok(());
                    }
                    // Absent at the snapshot: step the preset cursor too if it is here.
                    if self.e.valid() && self.e.key() == uk.as_slice() {
                        let r = if forward { self.e.next() } else { self.e.prev() };
                        if let Err(e) = r {
                            return self.fail(e);
                        }
                    }
                    skipped = Some(uk);
                }
                _ => {
                    if behind_ok && self.e.value().is_some() {
                        self.cur = Cur::Engine;
                        return Ok(());
                    }
                    let mut buf = skipped.take().unwrap_or_default();
                    buf.clear();
                    buf.extend_from_slice(self.e.key());
                    skipped = Some(buf);
                    let r = if forward { self.e.next() } else { self.e.prev() };
                    if let Err(e) = r {
                        return self.fail(e);
                    }
                }
            }
        }
    }
}

/// Where the gap is.
#[derive(Debug)]
enum Gap {
    /// A seek not yet done.
    Seek(Vec<u8>),
    SeekForPrev(Vec<u8>),
    /// Before the resolved iterator's current entry.
    Before,
    /// After it.
    After,
    /// Before the first entry / past the last.
    Start,
    End,
}

/// A seekable, bidirectional iterator over a consistent snapshot of the store
/// ([`crate::Db::iter`]). Starts before the first key. See the module docs for the
/// cursor model.
pub struct DbIterator {
    r: Resolved,
    gap: Gap,
    /// The store's directory lock: the store is not reopened (and its PM not reused) while
    /// this iterator may borrow from it.
    _lock: Arc<dyn crate::fs::FsLock>,
}

impl std::fmt::Debug for DbIterator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbIterator").field("gap", &self.gap).finish()
    }
}

impl DbIterator {
    pub(crate) fn new(
        e: BoxedIter,
        snap: Option<SnapshotRef>,
        lock: Arc<dyn crate::fs::FsLock>,
        opts: &IterOptions,
    ) -> DbIterator {
        let (lo, hi) = opts.bounds();
        let r = Resolved { e, snap, dir: Dir::Forward, cur: Cur::None, lo, hi, scratch: Vec::new() };
        DbIterator { r, gap: Gap::Start, _lock: lock }
    }

    /// Put the gap before the first key `>= key`.
    pub fn seek(&mut self, key: &[u8]) {
        self.gap = Gap::Seek(key.to_vec());
    }

    /// Put the gap after the last key `<= key`.
    pub fn seek_for_prev(&mut self, key: &[u8]) {
        self.gap = Gap::SeekForPrev(key.to_vec());
    }

    /// Put the gap before the first key.
    pub fn seek_to_first(&mut self) {
        self.gap = Gap::Start;
    }

    /// Put the gap after the last key.
    pub fn seek_to_last(&mut self) {
        self.gap = Gap::End;
    }

    /// The next entry, borrowed until the iterator moves; `None` at the end.
    pub fn next_ref(&mut self) -> Result<Option<(&[u8], &[u8])>> {
        self.cross(true)
    }

    /// The previous entry, borrowed until the iterator moves; `None` at the start.
    pub fn prev_ref(&mut self) -> Result<Option<(&[u8], &[u8])>> {
        self.cross(false)
    }

    /// Return the entry after (`forward`) or before the gap and move the gap past it.
    fn cross(&mut self, forward: bool) -> Result<Option<(&[u8], &[u8])>> {
        let (behind, past) = if forward { (Gap::After, Gap::End) } else { (Gap::Before, Gap::Start) };
        let r =
            match std::mem::replace(&mut self.gap, Gap::End) {
                // A seek whose gap is on the walk's side: position there.
                Gap::Seek(k) if forward => self.r.seek(&k),
                Gap::SeekForPrev(k) if !forward => self.r.seek_for_prev(&k),
                // A seek whose gap is on the other side of its key: position, then step past
                // the key itself if present.
                Gap::Seek(k) | Gap::SeekForPrev(k) => {
                    let r = if forward { self.r.seek(&k) } else { self.r.seek_for_prev(&k) };
                    r.and_then(|()| {
                        if self.r.valid() && self.r.key() == k.as_slice() {
                            self.r.step(forward)
                        } else {
                            Ok(())
                        }
                    })
                }
                Gap::Start if forward => self.r.seek_to_first(),
                Gap::End if !forward => self.r.seek_to_last(),
                Gap::Start | Gap::End => {
                    self.gap = past;
                    return Ok(None);
                }
                // The current entry is on the walk's side of the gap: return it.
                Gap::Before if forward => Ok(()),
                Gap::After if !forward => Ok(()),
                Gap::Before | Gap::After => self.r.step(forward),
            };
        r?;
        Ok(if self.r.valid() {
            self.gap = behind;
            Some((self.r.key(), self.r.value()))
        } else {
            self.gap = past;
            None
        })
    }

    /// The next entry (copied), or `None` at the end.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        Ok(self.next_ref()?.map(|(k, v)| (k.to_vec(), v.to_vec())))
    }

    /// The previous entry (copied), or `None` at the start.
    pub fn prev(&mut self) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        Ok(self.prev_ref()?.map(|(k, v)| (k.to_vec(), v.to_vec())))
    }
}

/// The iterator returned by [`crate::Db::scan`]: a forward [`DbIterator`] over a range.
/// After an error it returns `None`.
pub struct Scan {
    it: DbIterator,
    failed: bool,
}

impl std::fmt::Debug for Scan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scan").field("it", &self.it).finish()
    }
}

impl Scan {
    pub(crate) fn new(it: DbIterator) -> Scan {
        Scan { it, failed: false }
    }
}

impl Iterator for Scan {
    type Item = Result<(Vec<u8>, Vec<u8>)>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        match self.it.next() {
            Ok(e) => e.map(Ok),
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::iter::VecIter;
    use crate::snapshot::Overlay;

    /// A directory lock that locks nothing (the unit tests have no store directory).
    #[derive(Debug)]
    struct NoLock;
    impl crate::fs::FsLock for NoLock {}

    type Map = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

    #[derive(Debug, Clone)]
    enum Op {
        Next,
        Prev,
        Seek(Vec<u8>),
        SeekForPrev(Vec<u8>),
        First,
        Last,
    }

    fn key() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(0u8..4, 0..3)
    }

    fn map() -> impl Strategy<Value = Map> {
        proptest::collection::btree_map(
            key(),
            proptest::option::weighted(0.8, proptest::collection::vec(any::<u8>(), 0..2)),
            0..16,
        )
    }

    fn bound() -> impl Strategy<Value = Bound<Vec<u8>>> {
        prop_oneof![Just(Bound::Unbounded), key().prop_map(Bound::Included), key().prop_map(Bound::Excluded)]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Next),
            4 => Just(Op::Prev),
            1 => key().prop_map(Op::Seek),
            1 => key().prop_map(Op::SeekForPrev),
            1 => Just(Op::First),
            1 => Just(Op::Last),
        ]
    }

    proptest! {
        /// The gap cursor over a snapshot, with bounds and a prefix, against a model: the
        /// preset cursor shows the store *after* writes made since the snapshot, and the
        /// undo records those writes made must bring back exactly the snapshot's entries.
        #[test]
        fn gap_cursor_over_a_snapshot_matches_the_model(
            at_snapshot in map(),
            writes in proptest::collection::vec((key(), proptest::option::of(proptest::collection::vec(any::<u8>(), 0..2))), 0..8),
            lower in bound(),
            upper in bound(),
            prefix in proptest::option::weighted(0.3, proptest::collection::vec(0u8..4, 0..2)),
            ops in proptest::collection::vec(op(), 1..30),
        ) {
            let overlay = Arc::new(Overlay::default());
            let snap = overlay.snapshot();
            let mut now = at_snapshot.clone();
            for (k, v) in writes {
                let g = overlay.begin_write();
                let seq = g.must_record().expect("a snapshot lives");
                overlay.record(seq, vec![(k.clone(), now.get(&k).cloned().flatten())]);
                now.insert(k, v);
            }
            let opts = IterOptions { lower: lower.clone(), upper: upper.clone(), prefix: prefix.clone() };
            let want: Vec<(Vec<u8>, Vec<u8>)> = at_snapshot
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.clone()?)))
                .filter(|(k, _)| above_lower(k, &lower) && below_upper(k, &upper))
                .filter(|(k, _)| prefix.as_ref().is_none_or(|p| k.starts_with(p)))
                .collect();
            let lock: Arc<dyn crate::fs::FsLock> = Arc::new(NoLock);
            let mut it = DbIterator::new(Box::new(VecIter::from_vec(now.into_iter().collect())), Some(snap), lock, &opts);
            let mut gap = 0usize;
            for op in ops {
                match op {
                    Op::Next => {
                        let got = it.next().unwrap();
                        prop_assert_eq!(got.as_ref(), want.get(gap));
                        gap = (gap + 1).min(want.len());
                    }
                    Op::Prev => {
                        let got = it.prev().unwrap();
                        let w = gap.checked_sub(1).map(|g| &want[g]);
                        prop_assert_eq!(got.as_ref(), w);
                        gap = gap.saturating_sub(1);
                    }
                    Op::Seek(k) => { it.seek(&k); gap = want.partition_point(|e| e.0 < k); }
                    Op::SeekForPrev(k) => { it.seek_for_prev(&k); gap = want.partition_point(|e| e.0 <= k); }
                    Op::First => { it.seek_to_first(); gap = 0; }
                    Op::Last => { it.seek_to_last(); gap = want.len(); }
                }
            }
        }
    }

    #[test]
    fn prefix_end_is_the_first_key_past_the_prefix() {
        assert_eq!(prefix_end(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(prefix_end(b"a\xff"), Some(b"b".to_vec()));
        assert_eq!(prefix_end(b"\xff\xff"), None);
        assert_eq!(prefix_end(b""), None);
    }
}
