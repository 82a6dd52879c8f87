//! HoaKV's range reads: the HotStore's keys in order merged over the ColdStore's sources,
//! newest first, cold pointers resolved. See "Range reads: the iterator" in the module docs.

use std::collections::HashMap;
use std::ops::{Bound, Range};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::hot::{HotKeys, HotValue};
use super::layout::{self, ColdRef};
use super::Inner;
use crate::error::{Error, Result};
use crate::fs::FsFile;
use crate::iter::{BoxedIter, InternalIterator, MergingIterator};
use crate::lsm::ReadSampler;

/// Hot keys copied per HotStore lock by a seek.
const FIRST_BATCH: usize = 16;
/// Batches double while a walk goes on, up to this many keys.
const MAX_BATCH: usize = 1024;
/// A batch stops early once it holds this many bytes of keys.
const MAX_BATCH_BYTES: usize = 64 << 10;

/// A cursor over the hot keys (the HotStore's ordered key map), in key order. Keys are
/// copied out in batches under the HotStore lock (one lock per batch, none held between
/// calls; DRAM only) and the cursor re-positions by key when it runs off the batch. Hot
/// values are overwritten in place in PM, so they cannot be borrowed: [`HoaIter`] copies
/// the value of the hot entry the merge returns, and only that one ([`HoaIter::decode`]);
/// `value()` here is a placeholder (`Some(&[])`, or `None` for a hot tombstone).
///
/// Every lock also reads the HotStore's dirty-removal count: when it moved since the
/// iterator's ColdStore sources were made, a key may have left the HotStore for a ColdStore
/// write those sources do not hold, and `stale` tells the [`HoaIter`] to rebuild them.
struct HotCursor {
    inner: Arc<Inner>,
    epoch: u64,
    stale: Arc<AtomicBool>,
    batch: HotKeys,
    /// `batch.len()` when invalid.
    pos: usize,
    /// Hot keys may follow the batch (it was cut at `want` entries or read backward).
    more_fwd: bool,
    /// Hot keys may precede it.
    more_back: bool,
    want: usize,
    /// The batch's edge key when refilling past it.
    edge: Vec<u8>,
}

impl HotCursor {
    fn new(inner: Arc<Inner>, epoch: u64, stale: Arc<AtomicBool>) -> HotCursor {
        HotCursor {
            inner,
            epoch,
            stale,
            batch: HotKeys::default(),
            pos: 0,
            more_fwd: false,
            more_back: false,
            want: FIRST_BATCH,
            edge: Vec::new(),
        }
    }

    /// Copy the next batch from `from` on (or back); positions at its first entry (forward)
    /// or its last (backward). Returns whether more may follow in that direction.
    fn refill(&mut self, from: Bound<&[u8]>, forward: bool) -> bool {
        let more = {
            let hot = self.inner.hot.read();
            if hot.dirty_removals() != self.epoch {
                self.stale.store(true, Ordering::Relaxed);
            }
            hot.read_keys(from, forward, self.want, MAX_BATCH_BYTES, &mut self.batch)
        };
        self.want = (self.want * 2).min(MAX_BATCH);
        // An empty batch leaves `pos` at 0 = `len`: invalid.
        self.pos = if forward { 0 } else { self.batch.len().saturating_sub(1) };
        self.prefetch();
        more
    }

    /// Start loading the current entry's PM record into the CPU caches. The cursor reaches
    /// a hot key well before the merge returns it (the cold keys between come first), so
    /// by the time `HoaIter::decode` verifies and copies the record it is in cache. Only
    /// the entry the cursor stands on is prefetched, not the batch: most of a batch is
    /// never returned by a short scan. The address may be stale by then (a hint; the copy
    /// looks the key up again under the lock).
    fn prefetch(&self) {
        if self.batch.tomb(self.pos) {
            return;
        }
        if let Some((addr, len)) = self.batch.record_at(self.pos) {
            // No slice is formed: a writer may be writing that (stale) range meanwhile.
            self.inner.region.prefetch(addr, len.min(4096));
        }
    }

    fn seek_fwd(&mut self, from: Bound<&[u8]>) -> Result<()> {
        self.want = FIRST_BATCH;
        self.more_fwd = self.refill(from, true);
        self.more_back = !matches!(from, Bound::Unbounded);
        Ok(())
    }

    fn seek_back(&mut self, from: Bound<&[u8]>) -> Result<()> {
        self.want = FIRST_BATCH;
        self.more_back = self.refill(from, false);
        self.more_fwd = !matches!(from, Bound::Unbounded);
        Ok(())
    }
}

impl InternalIterator for HotCursor {
    fn valid(&self) -> bool {
        self.pos < self.batch.len()
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.seek_fwd(Bound::Included(key))
    }

    fn seek_to_first(&mut self) -> Result<()> {
        self.seek_fwd(Bound::Unbounded)
    }

    fn seek_to_last(&mut self) -> Result<()> {
        self.seek_back(Bound::Unbounded)
    }

    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.seek_back(Bound::Included(key))
    }

    fn next(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        if self.pos + 1 < self.batch.len() {
            self.pos += 1;
            self.prefetch();
        } else if self.more_fwd {
            let mut edge = std::mem::take(&mut self.edge);
            edge.clear();
            edge.extend_from_slice(self.batch.key(self.pos));
            self.more_fwd = self.refill(Bound::Excluded(&edge), true);
            self.edge = edge;
            self.more_back = true;
        } else {
            self.pos = self.batch.len();
        }
        Ok(())
    }

    fn prev(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        if self.pos > 0 {
            self.pos -= 1;
            self.prefetch();
        } else if self.more_back {
            let mut edge = std::mem::take(&mut self.edge);
            edge.clear();
            edge.extend_from_slice(self.batch.key(self.pos));
            self.more_back = self.refill(Bound::Excluded(&edge), false);
            self.edge = edge;
            self.more_fwd = true;
        } else {
            self.pos = self.batch.len();
        }
        Ok(())
    }

    fn key(&self) -> &[u8] {
        self.batch.key(self.pos)
    }

    fn value(&self) -> Option<&[u8]> {
        // The value itself is copied by `HoaIter::decode` when the merge returns this entry.
        (!self.batch.tomb(self.pos)).then_some(&[][..])
    }
}

/// What [`HoaIter::value`] returns for the current entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Val {
    /// Not positioned, or a failed move.
    Invalid,
    /// A tombstone.
    Tomb,
    /// An inline value: the merged entry's value after its tag.
    Inline,
    /// A cold pointer's value: `HoaIter::buf[HoaIter::vrange]`.
    Owned,
}

/// A move, replayed as a seek after the sources were rebuilt.
#[derive(Clone, Copy)]
enum Move<'a> {
    Seek(&'a [u8]),
    SeekForPrev(&'a [u8]),
    First,
    Last,
    /// The first entry after this key.
    After(&'a [u8]),
    /// The last entry before this key.
    Before(&'a [u8]),
}

fn apply(m: &mut MergingIterator, mv: Move<'_>) -> Result<()> {
    match mv {
        Move::Seek(k) => m.seek(k),
        Move::SeekForPrev(k) => m.seek_for_prev(k),
        Move::First => m.seek_to_first(),
        Move::Last => m.seek_to_last(),
        Move::After(k) => {
            m.seek(k)?;
            if m.valid() && m.key() == k {
                m.next()?;
            }
            Ok(())
        }
        Move::Before(k) => {
            m.seek_for_prev(k)?;
            if m.valid() && m.key() == k {
                m.prev()?;
            }
            Ok(())
        }
    }
}

/// The store's iterator ([`crate::engine::Engine::iter`]): a [`MergingIterator`] over the
/// [`HotCursor`] (newest) and the LSM's sources ([`crate::lsm::Lsm::sources`]), with cold
/// values decoded: inline ones borrowed from their source, pointers read from the cold vlog
/// into one reused buffer, through the value-log files this iterator holds open.
pub(super) struct HoaIter {
    inner: Arc<Inner>,
    merge: MergingIterator,
    stale: Arc<AtomicBool>,
    val: Val,
    /// The current pointer's value-log record (the value is `buf[vrange]`).
    buf: Vec<u8>,
    vrange: Range<usize>,
    /// Value-log files read so far, held open: group maintenance may remove a file after
    /// this iterator's sources pointed into it, and the open file stays readable.
    files: HashMap<u64, Arc<dyn FsFile>>,
    /// The key before the last step (a rebuild resumes after it).
    last: Vec<u8>,
    /// LevelDB's read sampling of the ColdStore's tables (seek compaction).
    sampler: ReadSampler,
}

impl std::fmt::Debug for HoaIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HoaIter").field("merge", &self.merge).field("val", &self.val).finish()
    }
}

/// The hot cursor (child 0) and the LSM's sources, newest first. The HotStore's
/// dirty-removal count is read before the LSM's sources are taken: a removal it does not
/// count came after, and its ColdStore write (made before the removal) is either in the
/// sources or detected.
fn sources(inner: &Arc<Inner>, stale: &Arc<AtomicBool>) -> MergingIterator {
    let epoch = inner.hot.read().dirty_removals();
    let mut children: Vec<BoxedIter> = vec![Box::new(HotCursor::new(inner.clone(), epoch, stale.clone()))];
    children.extend(inner.lsm.sources());
    MergingIterator::new(children)
}

/// The merge's child that is the [`HotCursor`].
const HOT_CHILD: usize = 0;

impl HoaIter {
    pub(super) fn new(inner: Arc<Inner>) -> HoaIter {
        let stale = Arc::new(AtomicBool::new(false));
        let merge = sources(&inner, &stale);
        HoaIter {
            inner,
            merge,
            stale,
            val: Val::Invalid,
            buf: Vec::new(),
            vrange: 0..0,
            files: HashMap::new(),
            last: Vec::new(),
            sampler: ReadSampler::default(),
        }
    }

    /// After a move: rebuild and replay it while a hot refill found the sources stale, then
    /// decode the value.
    fn settle(&mut self, r: Result<()>, redo: Move<'_>) -> Result<()> {
        let r = r.and_then(|()| loop {
            if self.stale.swap(false, Ordering::Relaxed) {
                self.inner.c.iter_rebuilds.fetch_add(1, Ordering::Relaxed);
                self.merge = sources(&self.inner, &self.stale);
                apply(&mut self.merge, redo)?;
                continue;
            }
            self.decode()?;
            if !self.stale.load(Ordering::Relaxed) {
                return Ok(());
            }
        });
        if r.is_err() {
            self.val = Val::Invalid;
        }
        r
    }

    fn decode(&mut self) -> Result<()> {
        self.val = Val::Invalid;
        if !self.merge.valid() {
            return Ok(());
        }
        let key = self.merge.key();
        // Every entry the walk stops at counts, tombstones included (LevelDB's `DBIter`).
        if self.sampler.returned(key.len() + self.merge.value().map_or(0, <[u8]>::len)) {
            self.inner.lsm.record_read_sample(key);
        }
        let Some(raw) = self.merge.value() else {
            self.val = Val::Tomb;
            return Ok(());
        };
        if self.merge.current_child() == Some(HOT_CHILD) {
            // A hot entry: copy its current value (verified) under the HotStore lock. A key
            // that left the HotStore since the batch was copied may have moved to a
            // ColdStore write these sources do not hold: rebuild them (`settle`).
            let got = self.inner.hot.read().read_value(key, &mut self.buf)?;
            match got {
                HotValue::Copied => {
                    self.vrange = 0..self.buf.len();
                    self.val = Val::Owned;
                }
                // Deleted since the batch was copied: a key written while the iterator lives.
                HotValue::Deleted => self.val = Val::Tomb,
                HotValue::Gone => self.stale.store(true, Ordering::Relaxed),
            }
            return Ok(());
        }
        match layout::decode_cold_ref(raw) {
            Ok(ColdRef::Inline(_)) => self.val = Val::Inline,
            Ok(ColdRef::Pointer(p)) => {
                let f = match self.files.get(&p.file) {
                    Some(f) => Some(f),
                    None => match self.inner.cold.reader(p.file) {
                        Some(f) => Some(&*self.files.entry(p.file).or_insert(f)),
                        None => None,
                    },
                };
                if let Some(f) = f {
                    self.vrange = self.inner.cold.read_into(&**f, key, p, &mut self.buf)?;
                    self.val = Val::Owned;
                } else {
                    // The file was removed before this iterator first read it: group
                    // maintenance relocated the value after the sources were made, and
                    // `resolve_current` looks the key up again (as a point read does,
                    // under the files gate).
                    let v = {
                        let _g = self.inner.files_gate.read();
                        self.inner.resolve_current(key, raw)?
                    };
                    match v {
                        Some(v) => {
                            self.vrange = 0..v.len();
                            self.buf = v;
                            self.val = Val::Owned;
                        }
                        // Deleted since: a key written while the iterator lives.
                        None => self.val = Val::Tomb,
                    }
                }
            }
            Err(d) => {
                return Err(Error::Corruption {
                    file: "LSM".into(),
                    offset: 0,
                    detail: format!("value of {}: {d}", crate::escape(key)),
                })
            }
        }
        Ok(())
    }

    /// A step: the current key is kept to replay the step after a rebuild.
    fn step(&mut self, forward: bool) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        let mut last = std::mem::take(&mut self.last);
        last.clear();
        last.extend_from_slice(self.merge.key());
        let r = if forward { self.merge.next() } else { self.merge.prev() };
        let r = self.settle(r, if forward { Move::After(&last) } else { Move::Before(&last) });
        self.last = last;
        r
    }
}

impl InternalIterator for HoaIter {
    fn valid(&self) -> bool {
        self.val != Val::Invalid
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        let r = self.merge.seek(key);
        self.settle(r, Move::Seek(key))
    }

    fn seek_to_first(&mut self) -> Result<()> {
        let r = self.merge.seek_to_first();
        self.settle(r, Move::First)
    }

    fn seek_to_last(&mut self) -> Result<()> {
        let r = self.merge.seek_to_last();
        self.settle(r, Move::Last)
    }

    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        let r = self.merge.seek_for_prev(key);
        self.settle(r, Move::SeekForPrev(key))
    }

    fn next(&mut self) -> Result<()> {
        self.step(true)
    }

    fn prev(&mut self) -> Result<()> {
        self.step(false)
    }

    fn key(&self) -> &[u8] {
        if self.valid() {
            self.merge.key()
        } else {
            &[]
        }
    }

    fn value(&self) -> Option<&[u8]> {
        match self.val {
            Val::Invalid | Val::Tomb => None,
            Val::Inline => self.merge.value().and_then(|v| v.get(1..)),
            Val::Owned => self.buf.get(self.vrange.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::collections::BTreeMap;
    use std::ops::Bound;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::super::tests::{open_with, put, stat};
    use super::super::Hoakv;
    use crate::batch::BatchOp;
    use crate::engine::{Cond, Engine};
    use crate::fs::FaultFs;
    use crate::iter::BoxedIter;
    use crate::lsm::test_walk::{full_walks, walk_model, Live};
    use crate::options::HoakvOptions;
    use crate::pm::sim::SimDevice;

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    fn key(i: u32) -> Vec<u8> {
        format!("k{i:04}").into_bytes()
    }

    /// A value of `len` bytes naming its key and version (over Value_Size 64: in the vlog).
    fn val(k: &[u8], n: u64, len: usize) -> Vec<u8> {
        let mut v = format!("{}:{n}:", String::from_utf8_lossy(k)).into_bytes();
        v.resize(len.max(v.len()), b'0' + (n % 10) as u8);
        v
    }

    fn it(h: &Hoakv) -> BoxedIter {
        h.iter().unwrap()
    }

    fn probe(r: &mut StdRng) -> Vec<u8> {
        let mut k = key(r.random_range(0..620));
        if r.random_bool(0.2) {
            k.push(b'!');
        }
        k
    }

    fn check_iter(h: &Hoakv, m: &Model, rng: &mut StdRng) {
        let mut i = it(h);
        full_walks(&mut *i, m, |_| true);
        walk_model(&mut *i, m, rng, 400, probe, |_| true);
        // A bounded scan over the iterator.
        let lo = key(rng.random_range(0..600));
        let got =
            crate::iter::collect_range(&mut *h.iter().unwrap(), Bound::Excluded(&lo), Bound::Unbounded, 37).unwrap();
        let want: Vec<_> = m
            .range::<Vec<u8>, _>((Bound::Excluded(&lo), Bound::Unbounded))
            .take(37)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(got, want);
    }

    /// Random puts, deletes, batches and reads (promotions, demotions) over a small
    /// store with forced flushes, compactions and value-group maintenance: every random
    /// interleaving of seeks and steps in both directions matches a model, across
    /// close and reopen.
    #[test]
    fn iterator_matches_a_model_through_promotions_compactions_and_reopen() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = HoakvOptions { hot_store_size: 16 << 10, heat_window: 1 << 30, ..crate::testing::hoakv_small() };
        let mut h = open_with(&dev, &fs, o.clone(), true);
        let mut m = Model::new();
        let mut rng = StdRng::seed_from_u64(5);
        let mut n = 0u64;
        for round in 0..6 {
            for _ in 0..700 {
                n += 1;
                let k = key(rng.random_range(0..600));
                match rng.random_range(0..20) {
                    0..=8 => {
                        let v = val(&k, n, rng.random_range(1..200));
                        put(&h, &k, &v);
                        m.insert(k, v);
                    }
                    9..=10 => {
                        assert!(h.write(&[BatchOp::Delete { key: k.clone() }], Cond::None).unwrap());
                        m.remove(&k);
                    }
                    11 => {
                        let mut ops = Vec::new();
                        for j in 0..rng.random_range(2..6) {
                            let k = key(rng.random_range(0..600));
                            if rng.random_bool(0.3) {
                                m.remove(&k);
                                ops.push(BatchOp::Delete { key: k });
                            } else {
                                let v = val(&k, n * 10 + j, rng.random_range(1..150));
                                m.insert(k.clone(), v.clone());
                                ops.push(BatchOp::Put { key: k, value: v });
                            }
                        }
                        assert!(h.write(&ops, Cond::None).unwrap());
                    }
                    _ => {
                        // Reads of a small hot set: promotions, and demotions of the
                        // coldest (dirty ones after writes to hot keys).
                        let k = key(rng.random_range(0..120));
                        assert_eq!(h.get(&k).unwrap(), m.get(&k).cloned());
                    }
                }
                if n.is_multiple_of(500) {
                    h.flush().unwrap();
                }
            }
            check_iter(&h, &m, &mut rng);
            if round % 2 == 1 {
                h.compact().unwrap();
                check_iter(&h, &m, &mut rng);
            }
            if round == 2 || round == 4 {
                h.close().unwrap();
                drop(h);
                h = open_with(&dev, &fs, o.clone(), false);
                check_iter(&h, &m, &mut rng);
            }
        }
        for what in ["promotions", "demotions", "hot_writes", "flushes", "compactions", "vlog_values"] {
            assert!(stat(&h, what) > 0, "the test exercises {what}");
        }
        assert!(stat(&h, "group_gcs") + stat(&h, "group_splits") > 0, "value groups were maintained");
        assert!(stat(&h, "hot_entries") > 0);
        assert!(h.check().unwrap().is_empty());
    }

    /// An iterator made before a compaction that replaces tables it reads, group
    /// maintenance that relocates the cold values and removes the vlog files it read
    /// pointers into, and dirty demotions of the hot keys ahead of it (their newest
    /// values written to a MemTable it does not hold) returns exactly the model.
    #[test]
    fn an_iterator_reads_on_through_compaction_gc_and_demotions() {
        let o = HoakvOptions {
            hot_store_size: 24 << 10,
            heat_window: 1 << 30,
            group_size: 64 << 10,
            ..crate::testing::hoakv_small()
        };
        let h = open_with(&SimDevice::new(), &FaultFs::new(), o, true);
        let mut m = Model::new();
        // 400 keys, most with vlog values, written twice (garbage for the GC).
        for r in 0..2u64 {
            for i in 0..400u32 {
                let k = key(i);
                let v = val(&k, r, if i % 5 == 0 { 20 } else { 100 + (i % 7) as usize });
                put(&h, &k, &v);
                m.insert(k, v);
            }
        }
        for i in (0..400u32).step_by(9) {
            assert!(h.write(&[BatchOp::Delete { key: key(i) }], Cond::None).unwrap());
            m.remove(&key(i));
        }
        // Every fourth key promoted by reads, then overwritten while hot: dirty hot keys
        // whose ColdStore version is older.
        for i in (0..400u32).step_by(4) {
            h.get(&key(i)).unwrap();
            h.get(&key(i)).unwrap();
        }
        let mut dirty = 0;
        for i in (0..400u32).step_by(4) {
            if h.hot_heat(&key(i)).unwrap().is_some() {
                let k = key(i);
                let v = val(&k, 7, 90);
                put(&h, &k, &v);
                m.insert(k, v);
                dirty += 1;
            }
        }
        assert!(dirty > 20, "{dirty} dirty hot keys");
        let files_before = h.inner.lsm.files().1;
        let tables_before: Vec<u64> = files_before.iter().map(|f| f.0).collect();
        assert!(tables_before.len() > 2, "tables for the iterator to read");
        let (freed0, dem0, clean0) = (stat(&h, "gc_bytes_freed"), stat(&h, "demotions"), stat(&h, "clean_demotions"));

        let mut i = it(&h);
        let want: Vec<(Vec<u8>, Vec<u8>)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut got = Vec::new();
        {
            let mut l = Live { it: &mut *i, keep: |_: &[u8]| true };
            l.first().unwrap();
            while got.len() < 20 {
                got.push(l.entry().unwrap());
                l.next().unwrap();
            }
            // Rewrite everything under the iterator.
            let compactions0 = stat(&h, "compactions");
            h.compact().unwrap();
            assert!(stat(&h, "compactions") > compactions0, "a compaction ran");
            let tables_after: Vec<u64> = h.inner.lsm.files().1.iter().map(|f| f.0).collect();
            // Tables at the bottom that overlap nothing above may stay; every table above
            // the bottom level is merged into new ones and its file removed.
            let bottom = files_before.iter().map(|f| f.1).max().unwrap();
            let above: Vec<u64> = files_before.iter().filter(|f| f.1 < bottom).map(|f| f.0).collect();
            assert!(!above.is_empty(), "tables above the bottom level: {files_before:?}");
            assert!(
                above.iter().all(|n| !tables_after.contains(n)),
                "every table above the bottom level was replaced: {files_before:?} -> {tables_after:?}"
            );
            assert!(stat(&h, "gc_bytes_freed") > freed0, "vlog files the iterator points into were removed");
            // Hotter keys take the HotStore: the dirty keys are demoted (their values
            // written back to the LSM's current MemTable).
            for r in 0..4 {
                for j in (1..400u32).step_by(4) {
                    h.get(&key(j)).unwrap();
                    if r == 3 {
                        assert_eq!(h.get(&key(j)).unwrap(), m.get(&key(j)).cloned());
                    }
                }
            }
            let dirty_demoted = (stat(&h, "demotions") - dem0) - (stat(&h, "clean_demotions") - clean0);
            assert!(dirty_demoted > 10, "{dirty_demoted} dirty demotions");
            while let Some(e) = l.entry() {
                got.push(e);
                l.next().unwrap();
            }
        }
        assert_eq!(got.len(), want.len());
        assert!(got == want, "the walk across compaction, GC and demotions differs from the model");
        assert!(stat(&h, "iter_rebuilds") > 0, "the iterator saw the demotions and rebuilt its sources");
        full_walks(&mut *i, &m, |_| true);
        walk_model(&mut *i, &m, &mut StdRng::seed_from_u64(3), 500, probe, |_| true);
        assert!(h.check().unwrap().is_empty());
    }

    /// Writers of a disjoint key set (hot and cold, so promotions and demotions run), readers of
    /// the untouched keys (clean promotions), and flushes and compactions run while iterators
    /// walk: every untouched key is returned exactly once with its value, in order, both ways.
    #[test]
    fn iterators_walk_untouched_keys_exactly_once_under_concurrent_writers() {
        let o = HoakvOptions {
            hot_store_size: 16 << 10,
            heat_window: 1 << 30,
            background: true,
            ..crate::testing::hoakv_small()
        };
        let h = open_with(&SimDevice::new(), &FaultFs::new(), o, true);
        let mut m = Model::new();
        for i in 0..500u32 {
            let k = format!("u{i:04}").into_bytes();
            let v = val(&k, 1, if i % 3 == 0 { 30 } else { 120 });
            put(&h, &k, &v);
            m.insert(k, v);
        }
        h.flush().unwrap();
        let untouched = |k: &[u8]| k.len() == 5;
        let stop = AtomicBool::new(false);
        let walks = AtomicU64::new(0);
        let (flushes0, compactions0) = (stat(&h, "flushes"), stat(&h, "compactions"));
        std::thread::scope(|s| {
            // Bounded, so the store stays small whatever the machine's speed.
            for t in 0..2u64 {
                let (h, stop) = (&h, &stop);
                s.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(100 + t);
                    for n in 0..20_000u64 {
                        if stop.load(Ordering::Relaxed) && n > 500 {
                            break;
                        }
                        // Between the untouched keys: "u0123w0" sorts after "u0123".
                        let k = format!("u{:04}w{t}", rng.random_range(0..500)).into_bytes();
                        if rng.random_bool(0.2) {
                            h.write(&[BatchOp::Delete { key: k }], Cond::None).unwrap();
                        } else {
                            let v = val(&k, n, rng.random_range(1..150));
                            h.write(&[BatchOp::Put { key: k, value: v }], Cond::None).unwrap();
                        }
                    }
                });
            }
            {
                let (h, stop) = (&h, &stop);
                s.spawn(move || {
                    let mut rng = StdRng::seed_from_u64(7);
                    for _ in 0..50_000 {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        h.get(format!("u{:04}", rng.random_range(0..120)).as_bytes()).unwrap();
                    }
                });
            }
            {
                let (h, stop, walks) = (&h, &stop, &walks);
                s.spawn(move || {
                    let mut last = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let w = walks.load(Ordering::Relaxed);
                        if w != last {
                            last = w;
                            if w % 2 == 0 {
                                h.compact().unwrap();
                            } else {
                                h.flush().unwrap();
                            }
                        }
                        std::thread::yield_now();
                    }
                });
            }
            let mut rng = StdRng::seed_from_u64(9);
            for _ in 0..8 {
                let mut i = it(&h);
                full_walks(&mut *i, &m, untouched);
                walk_model(
                    &mut *i,
                    &m,
                    &mut rng,
                    200,
                    |r| format!("u{:04}", r.random_range(0..510)).into_bytes(),
                    untouched,
                );
                walks.fetch_add(1, Ordering::Relaxed);
            }
            stop.store(true, Ordering::Relaxed);
        });
        assert!(stat(&h, "flushes") > flushes0, "flushes ran during the walks");
        assert!(stat(&h, "compactions") > compactions0, "compactions ran during the walks");
        for what in ["promotions", "demotions"] {
            assert!(stat(&h, what) > 0, "the test exercises {what}");
        }
        assert!(h.check().unwrap().is_empty());
    }

    /// Through the public API: `Db::iter` and `Snapshot::iter` over HoaKV return exactly the
    /// store as it was when they were made, both ways, while a writer overwrites and deletes
    /// every key (hot and cold ones) and flushes, compactions and group maintenance run.
    #[test]
    fn db_iterators_and_snapshots_see_exactly_their_snapshot_under_writers() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = HoakvOptions { hot_store_size: 16 << 10, heat_window: 1 << 30, ..crate::testing::hoakv_small() };
        let opts = crate::testing::sim_options(crate::Preset::Hoakv, &dev, &fs).hoakv(o);
        let db = crate::Db::open("/db", opts).unwrap();
        let mut m = Model::new();
        for i in 0..400u32 {
            let k = key(i);
            let v = val(&k, 1, if i % 4 == 0 { 20 } else { 100 });
            db.put(&k, &v).unwrap();
            m.insert(k, v);
        }
        // Hot keys, some dirty (overwritten while hot).
        for i in (0..400u32).step_by(5) {
            db.get(key(i)).unwrap();
            db.get(key(i)).unwrap();
        }
        for i in (0..400u32).step_by(10) {
            let (k, v) = (key(i), val(&key(i), 2, 90));
            db.put(&k, &v).unwrap();
            m.insert(k, v);
        }
        db.flush().unwrap();
        let snap = db.snapshot().unwrap();
        let mut it = db.iter().unwrap();
        let want: Vec<(Vec<u8>, Vec<u8>)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let (mut fwd, mut back) = (Vec::new(), Vec::new());
        let mut sit = snap.iter().unwrap();
        it.seek_to_first();
        sit.seek_to_last();
        let mut rng = StdRng::seed_from_u64(21);
        let mut n = 10u64;
        let mut m2 = m.clone();
        loop {
            // A few writes between steps: overwrites and deletes anywhere, ahead of both walks.
            for _ in 0..3 {
                n += 1;
                let k = key(rng.random_range(0..420));
                if rng.random_bool(0.3) {
                    db.delete(&k).unwrap();
                    m2.remove(&k);
                } else {
                    let v = val(&k, n, rng.random_range(1..160));
                    db.put(&k, &v).unwrap();
                    m2.insert(k, v);
                }
            }
            if n.is_multiple_of(150) {
                db.compact().unwrap();
            } else if n.is_multiple_of(50) {
                db.flush().unwrap();
            }
            let a = it.next().unwrap();
            let b = sit.prev().unwrap();
            if a.is_none() && b.is_none() {
                break;
            }
            fwd.extend(a);
            back.extend(b);
        }
        back.reverse();
        assert_eq!(fwd.len(), want.len(), "db.iter(): entry count");
        assert!(fwd == want, "db.iter() differs from the store as it was when it was made");
        assert!(back == want, "snapshot iterator (backward) differs from the snapshot");
        assert_eq!(snap.get(key(5)).unwrap(), m.get(&key(5)).cloned());
        let s = db.stats().design;
        for what in ["flushes", "compactions", "promotions"] {
            assert!(s.get(what).copied().unwrap_or(0) > 0, "the test exercises {what}");
        }
        assert!(s.get("group_gcs").copied().unwrap_or(0) + s.get("group_splits").copied().unwrap_or(0) > 0);
        // A new iterator sees the writes.
        let mut it = db.iter().unwrap();
        it.seek_to_first();
        let mut now = Vec::new();
        while let Some(e) = it.next().unwrap() {
            now.push(e);
        }
        assert!(now == m2.into_iter().collect::<Vec<_>>(), "a new iterator sees the writes");
    }
}
