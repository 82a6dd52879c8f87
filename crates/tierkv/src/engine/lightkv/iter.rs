//! LightKV's range reads: the store-wide [`InternalIterator`] (see "Range reads: the
//! iterator" in the preset's module docs).
//!
//! Two sources, merged newest first by [`MergingIterator`]:
//! - [`BufferIter`]: the write buffer in key order — a cursor over the [`SortedView`]
//!   (the DRAM B-tree of every key a DRAM leaf indexes) that reads a small batch of
//!   record addresses per short state-lock acquisition and re-positions by key between
//!   batches; keys and values are borrowed from the records in PM.
//! - [`TableWalker`]: the SSTables of the chained partitions, walked range by range in key
//!   order ([`crate::index::rhtree::RhTree::ranges`]); within a range, the partition's
//!   tables merged newest first, each a [`TableIter`] opened when the walk enters the range.
//!
//! Every write-buffer record is newer than every table entry of its key (a flush moves the
//! oldest DRAM leaf to the newest table), so the buffer is the newer child.
//!
//! [`SortedView`]: super::view::SortedView

use std::ops::Bound;
use std::sync::Arc;

use super::pwb;
use super::store::PwbStore;
use crate::error::Result;
use crate::iter::{BoxedIter, InternalIterator, MergingIterator};
use crate::sstable::{Table, TableIter};

/// Addresses read per lock acquisition right after a seek (a short scan reads few).
const FIRST_BATCH: usize = 8;
/// Largest batch (doubling from [`FIRST_BATCH`] while a walk goes on in one direction).
const MAX_BATCH: usize = 256;
/// Records prefetched this many entries ahead of the current one.
const PREFETCH: usize = 3;
/// Bytes of a record prefetched: its entry header, which is all of it the cursor may name
/// before reading the lengths (the cache line it starts holds the start of the key too).
const PREFETCH_BYTES: usize = pwb::ENTRY_HEADER;

/// One range of a chained partition and its tables, newest first.
#[derive(Debug)]
pub(crate) struct Run {
    /// Lowest key of the range.
    pub(crate) lo: Vec<u8>,
    /// Every key of the range is below this (`None`: no bound).
    pub(crate) hi: Option<Vec<u8>>,
    /// The partition's tables, newest first.
    pub(crate) tables: Arc<Vec<Arc<Table>>>,
}

/// The chained partitions' ranges in key order: what an iterator's table side reads, fixed
/// at its creation (the `Arc<Table>`s keep the files readable after a compaction).
pub(crate) type TableRuns = Vec<Run>;

/// A whole-store cursor over `store` (see the module docs).
pub(crate) fn open(store: &Arc<PwbStore>) -> Result<BoxedIter> {
    let (gen, runs) = store.pin_and_runs()?;
    let buffer = BufferIter {
        pin: Pin { store: store.clone(), gen },
        batch: Vec::new(),
        pos: 0,
        forward: true,
        want: FIRST_BATCH,
        cur: None,
        scratch: Vec::new(),
    };
    if runs.is_empty() {
        return Ok(Box::new(buffer));
    }
    let tables = TableWalker { runs, i: 0, it: None };
    Ok(Box::new(MergingIterator::new(vec![Box::new(buffer), Box::new(tables)])))
}

/// An open iterator's pin ([`super::view`]): while it lives, no write-buffer extent freed
/// after its creation is reused, and the flushes after it leave their sorted-view entries.
struct Pin {
    store: Arc<PwbStore>,
    gen: u64,
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.store.pins.unpin(self.gen);
        self.store.reclaim_if_idle();
    }
}

/// The current record of a [`BufferIter`], decoded and verified: where its key and value
/// are in PM.
#[derive(Debug, Clone, Copy)]
struct Cur {
    key: u64,
    klen: usize,
    value: u64,
    vlen: usize,
    put: bool,
}

/// The write buffer in key order: a cursor over the store's sorted view.
///
/// It holds no lock between calls: each refill takes the state lock for reading, copies up
/// to `want` record addresses from the view (starting after the current key, so entries
/// added or removed meanwhile are simply met or not), and lets it go. The records
/// themselves are read in place: the pin keeps their segments from being reused.
pub(crate) struct BufferIter {
    pin: Pin,
    /// Record addresses in walking order (ascending when `forward`).
    batch: Vec<u64>,
    pos: usize,
    forward: bool,
    /// Size of the next refill in the current direction.
    want: usize,
    cur: Option<Cur>,
    /// The current key, copied only to re-position a refill.
    scratch: Vec<u8>,
}

impl std::fmt::Debug for BufferIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferIter").field("pin", &self.pin.gen).field("batch", &self.batch.len()).finish()
    }
}

impl BufferIter {
    fn invalidate(&mut self) {
        self.cur = None;
        self.batch.clear();
        self.pos = 0;
    }

    /// Decode and verify the record at `batch[pos]`.
    fn settle(&mut self) -> Result<()> {
        let Some(&off) = self.batch.get(self.pos) else {
            self.invalidate();
            return Ok(());
        };
        let r = self.pin.store.region();
        super::store::count_entry_read();
        // Records sit in PM in write order, not key order: start loading the one a few
        // steps ahead.
        let ahead = self.batch.get(self.pos + PREFETCH).and_then(|&a| r.slice(a, PREFETCH_BYTES));
        if let Some(b) = ahead {
            crate::pm::flush::prefetch(b);
        }
        let decoded = (|| {
            let h = r.slice_checked(off, pwb::ENTRY_HEADER, "PWB entry")?;
            let (klen, vlen) = pwb::entry_lens(h).ok_or_else(|| r.corruption(off, "PWB entry header cut short"))?;
            let put = h.get(4) == Some(&(pwb::Kind::Put as u8));
            let len = pwb::ENTRY_HEADER + klen + vlen;
            // Verified once per open region (`crate::pm::checked`): an entry a walk met
            // before is read no further than its header and key.
            r.checked().verify_once(off, len, 0, || {
                let b = r.slice_checked(off, len, "PWB entry")?;
                let (kind, _, _, _) =
                    pwb::decode_entry(b).ok_or_else(|| r.corruption(off, "PWB entry checksum mismatch"))?;
                debug_assert_eq!(kind == pwb::Kind::Put, put);
                Ok(())
            })?;
            let key = off + pwb::ENTRY_HEADER as u64;
            Ok(Cur { key, klen, value: key + klen as u64, vlen, put })
        })();
        match decoded {
            Ok(c) => {
                self.cur = Some(c);
                Ok(())
            }
            Err(e) => {
                self.invalidate();
                Err(e)
            }
        }
    }

    /// Refill from `from` in `forward` order and position at the batch's first record.
    fn fill(&mut self, from: Bound<&[u8]>, forward: bool, want: usize) -> Result<()> {
        self.forward = forward;
        self.want = want;
        self.pin.store.view_fill(from, forward, self.pin.gen, want, &mut self.batch);
        self.pos = 0;
        self.settle()
    }

    /// Refill from just past the current key in `forward` order.
    fn refill_past_current(&mut self, forward: bool, want: usize) -> Result<()> {
        let mut k = std::mem::take(&mut self.scratch);
        k.clear();
        k.extend_from_slice(self.key());
        let r = self.fill(Bound::Excluded(&k), forward, want);
        self.scratch = k;
        r
    }

    /// Step in `forward` order (`next` or `prev`).
    fn step(&mut self, forward: bool) -> Result<()> {
        if self.cur.is_none() {
            return Ok(());
        }
        if self.forward == forward {
            if self.pos + 1 < self.batch.len() {
                self.pos += 1;
                return self.settle();
            }
            let want = (self.want * 2).min(MAX_BATCH);
            return self.refill_past_current(forward, want);
        }
        self.refill_past_current(forward, FIRST_BATCH)
    }
}

impl InternalIterator for BufferIter {
    fn valid(&self) -> bool {
        self.cur.is_some()
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.fill(Bound::Included(key), true, FIRST_BATCH)
    }

    fn seek_to_first(&mut self) -> Result<()> {
        self.fill(Bound::Unbounded, true, FIRST_BATCH)
    }

    fn seek_to_last(&mut self) -> Result<()> {
        self.fill(Bound::Unbounded, false, FIRST_BATCH)
    }

    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.fill(Bound::Included(key), false, FIRST_BATCH)
    }

    fn next(&mut self) -> Result<()> {
        self.step(true)
    }

    fn prev(&mut self) -> Result<()> {
        self.step(false)
    }

    fn key(&self) -> &[u8] {
        self.cur.and_then(|c| self.pin.store.region().slice(c.key, c.klen)).unwrap_or(&[])
    }

    fn value(&self) -> Option<&[u8]> {
        let c = self.cur.filter(|c| c.put)?;
        Some(self.pin.store.region().slice(c.value, c.vlen).unwrap_or(&[]))
    }
}

/// The chained partitions' tables in key order: one [`Run`] at a time, its tables merged
/// newest first (a lone table read directly).
pub(crate) struct TableWalker {
    runs: Arc<TableRuns>,
    /// The run `it` reads (`runs.len()` when none).
    i: usize,
    it: Option<BoxedIter>,
}

impl std::fmt::Debug for TableWalker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableWalker").field("runs", &self.runs.len()).field("run", &self.i).finish()
    }
}

/// Position `it` at its last entry below `hi`.
fn seek_below(it: &mut BoxedIter, hi: Option<&[u8]>) -> Result<()> {
    match hi {
        None => it.seek_to_last(),
        Some(h) => {
            it.seek_for_prev(h)?;
            if it.valid() && it.key() == h {
                it.prev()?;
            }
            Ok(())
        }
    }
}

impl TableWalker {
    /// Open run `i` (unpositioned); past the last run, none.
    fn open(&mut self, i: usize) {
        self.i = i.min(self.runs.len());
        self.it = self.runs.get(i).map(|r| -> BoxedIter {
            match r.tables.as_slice() {
                [t] => Box::new(TableIter::new(t.clone(), true)),
                ts => Box::new(MergingIterator::new(
                    ts.iter().map(|t| Box::new(TableIter::new(t.clone(), true)) as BoxedIter).collect(),
                )),
            }
        });
    }

    fn fail<T>(&mut self, e: crate::Error) -> Result<T> {
        self.it = None;
        self.i = self.runs.len();
        Err(e)
    }

    /// Run `f` on the open run's iterator; an error leaves the walker invalid.
    fn with(&mut self, f: impl FnOnce(&mut BoxedIter, &Run) -> Result<()>) -> Result<()> {
        let runs = self.runs.clone();
        let (Some(it), Some(run)) = (self.it.as_mut(), runs.get(self.i)) else { return Ok(()) };
        match f(it, run) {
            Ok(()) => Ok(()),
            Err(e) => self.fail(e),
        }
    }

    /// True when the open run's iterator is at a key inside the run.
    fn inside(&self) -> bool {
        match (self.it.as_ref(), self.runs.get(self.i)) {
            (Some(it), Some(run)) if it.valid() => {
                let k = it.key();
                k >= run.lo.as_slice() && run.hi.as_deref().is_none_or(|h| k < h)
            }
            _ => false,
        }
    }

    /// Moving forward: settle on the first entry inside a run, from the open run on. A key
    /// past the run (the partition's next range, across a hole) or no key moves the walk
    /// to the next run, at its lower bound. (A key below the run cannot follow a seek to
    /// at least its lower bound; it is treated the same way, so the walk always advances.)
    fn forward_fix(&mut self) -> Result<()> {
        while self.it.is_some() && !self.inside() {
            self.open(self.i + 1);
            self.with(|it, run| it.seek(&run.lo))?;
        }
        Ok(())
    }

    /// Moving backward: settle on the last entry inside a run, from the open run down.
    fn backward_fix(&mut self) -> Result<()> {
        while self.it.is_some() && !self.inside() {
            match self.i.checked_sub(1) {
                Some(i) => {
                    self.open(i);
                    self.with(|it, run| seek_below(it, run.hi.as_deref()))?;
                }
                None => self.open(self.runs.len()),
            }
        }
        Ok(())
    }
}

impl InternalIterator for TableWalker {
    fn valid(&self) -> bool {
        self.inside()
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        let i = self.runs.partition_point(|r| r.hi.as_deref().is_some_and(|h| h <= key));
        self.open(i);
        self.with(|it, run| it.seek(key.max(run.lo.as_slice())))?;
        self.forward_fix()
    }

    fn seek_to_first(&mut self) -> Result<()> {
        self.open(0);
        self.with(|it, run| it.seek(&run.lo))?;
        self.forward_fix()
    }

    fn seek_to_last(&mut self) -> Result<()> {
        self.open(self.runs.len().saturating_sub(1));
        self.with(|it, run| seek_below(it, run.hi.as_deref()))?;
        self.backward_fix()
    }

    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        let n = self.runs.partition_point(|r| r.lo.as_slice() <= key);
        let Some(i) = n.checked_sub(1) else {
            self.open(self.runs.len());
            return Ok(());
        };
        self.open(i);
        self.with(|it, run| match run.hi.as_deref() {
            Some(h) if h <= key => seek_below(it, Some(h)),
            _ => it.seek_for_prev(key),
        })?;
        self.backward_fix()
    }

    fn next(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        self.with(|it, _| it.next())?;
        self.forward_fix()
    }

    fn prev(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        self.with(|it, _| it.prev())?;
        self.backward_fix()
    }

    fn key(&self) -> &[u8] {
        self.it.as_ref().map_or(&[], |it| it.key())
    }

    fn value(&self) -> Option<&[u8]> {
        self.it.as_ref()?.value()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, Ordering};

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::batch::BatchOp;
    use crate::engine::lightkv::store::StoreConfig;
    use crate::engine::lightkv::Lightkv;
    use crate::engine::{Cond, Engine, EngineCtx};
    use crate::fs::{CountingFs, FaultFs, Fs};
    use crate::index::rhtree::RhOptions;
    use crate::pm::sim::SimDevice;
    use crate::pm::{Backing, Region, RegionConfig};
    use crate::Preset;

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;
    type Raw = Vec<(Vec<u8>, Option<Vec<u8>>)>;

    fn ctx(dev: &SimDevice, fs: &FaultFs, fresh: bool, background: bool, max_leaf_nodes: usize) -> EngineCtx {
        let mut opts = crate::testing::sim_options(Preset::Lightkv, dev, fs);
        opts.lightkv.background = background;
        opts.lightkv.max_leaf_nodes = max_leaf_nodes;
        EngineCtx {
            dir: PathBuf::from("/lightkv-iter"),
            opts,
            fs: CountingFs::new(Arc::new(fs.clone())),
            db_id: 77,
            fresh,
            pm_health: Arc::default(),
            recovery: Arc::default(),
        }
    }

    /// Keys with shared prefixes, short keys (end partitions), empty and 0xff keys, so that
    /// partitions level-split (byte-value sets with holes) and chains link and compact.
    fn key(rng: &mut SmallRng) -> Vec<u8> {
        let i: u32 = rng.random_range(0..400);
        match rng.random_range(0..6) {
            0 => format!("user{:04}", i).into_bytes(),
            1 => format!("u{}", i % 40).into_bytes(),
            2 => vec![b'u', b's', b'e', b'r', (i % 256) as u8],
            3 => format!("zz{:03}", i % 300).into_bytes(),
            4 => vec![0xff; (i % 4) as usize],
            _ => vec![(i % 256) as u8],
        }
    }

    fn value(rng: &mut SmallRng, i: usize) -> Vec<u8> {
        let mut v = format!("v{i}-").into_bytes();
        v.resize(v.len() + rng.random_range(0..120), b'x');
        v
    }

    /// One random write (put, delete or batch) applied to the engine and the model.
    fn write(e: &dyn Engine, m: &mut Model, rng: &mut SmallRng, i: usize) {
        let n = if rng.random_range(0..8) == 0 { rng.random_range(2..5) } else { 1 };
        let mut ops = Vec::new();
        for j in 0..n {
            let k = key(rng);
            if rng.random_range(0..5) == 0 {
                ops.push(BatchOp::Delete { key: k });
            } else {
                ops.push(BatchOp::Put { key: k, value: value(rng, i * 10 + j) });
            }
        }
        assert!(e.write(&ops, Cond::None).unwrap());
        for op in ops {
            match op {
                BatchOp::Put { key, value } => m.insert(key, value),
                BatchOp::Delete { key } => m.remove(&key),
            };
        }
    }

    fn entry(it: &BoxedIter) -> (Vec<u8>, Option<Vec<u8>>) {
        (it.key().to_vec(), it.value().map(<[u8]>::to_vec))
    }

    /// Every entry forward, then every entry backward (reversed): the two must agree.
    fn walk_both_ways(it: &mut BoxedIter) -> Raw {
        let fwd = crate::iter::collect_forward(&mut **it).unwrap();
        let mut bwd = Vec::new();
        it.seek_to_last().unwrap();
        while it.valid() {
            bwd.push(entry(it));
            it.prev().unwrap();
        }
        bwd.reverse();
        assert_eq!(fwd, bwd, "forward and backward walks differ");
        assert!(fwd.windows(2).all(|w| w[0].0 < w[1].0), "keys ascend, each once");
        fwd
    }

    /// The raw entries hold exactly the model's live entries; tombstones only of absent keys.
    fn assert_live(raw: &Raw, m: &Model) {
        let live: Model = raw.iter().filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v))).collect();
        assert_eq!(live.len(), m.len(), "live entry count");
        assert!(live == *m, "live entries differ from the model");
        assert!(raw.iter().all(|(k, v)| v.is_some() || !m.contains_key(k)), "a tombstone hides a live key");
    }

    fn skip_tombstones(it: &mut BoxedIter, forward: bool) {
        while it.valid() && it.value().is_none() {
            if forward {
                it.next().unwrap();
            } else {
                it.prev().unwrap();
            }
        }
    }

    /// Random seeks and steps in both directions (tombstones skipped as the Db layer does)
    /// against the model's sorted entries.
    fn navigate(it: &mut BoxedIter, m: &Model, rng: &mut SmallRng, steps: usize) {
        let want: Vec<(&Vec<u8>, &Vec<u8>)> = m.iter().collect();
        let mut pos: Option<usize> = None;
        for step in 0..steps {
            match rng.random_range(0..10) {
                0..=2 => {
                    if pos.is_some() {
                        it.next().unwrap();
                        skip_tombstones(it, true);
                        pos = pos.map(|p| p + 1).filter(|&p| p < want.len());
                    }
                }
                3..=5 => {
                    if pos.is_some() {
                        it.prev().unwrap();
                        skip_tombstones(it, false);
                        pos = pos.and_then(|p| p.checked_sub(1));
                    }
                }
                6 | 7 => {
                    let mut k = key(rng);
                    if rng.random_range(0..2) == 0 {
                        k.push(rng.random_range(0..=255));
                    }
                    if rng.random_range(0..2) == 0 {
                        it.seek(&k).unwrap();
                        skip_tombstones(it, true);
                        let p = want.partition_point(|e| e.0.as_slice() < k.as_slice());
                        pos = (p < want.len()).then_some(p);
                    } else {
                        it.seek_for_prev(&k).unwrap();
                        skip_tombstones(it, false);
                        pos = want.partition_point(|e| e.0.as_slice() <= k.as_slice()).checked_sub(1);
                    }
                }
                8 => {
                    it.seek_to_first().unwrap();
                    skip_tombstones(it, true);
                    pos = (!want.is_empty()).then_some(0);
                }
                _ => {
                    it.seek_to_last().unwrap();
                    skip_tombstones(it, false);
                    pos = want.len().checked_sub(1);
                }
            }
            assert_eq!(it.valid(), pos.is_some(), "step {step}");
            if let Some(p) = pos {
                assert_eq!(it.key(), want[p].0.as_slice(), "step {step}");
                assert_eq!(it.value(), Some(want[p].1.as_slice()), "step {step}");
            }
        }
    }

    fn check(e: &Lightkv, m: &Model, rng: &mut SmallRng) {
        let mut it = e.iter().unwrap();
        assert_live(&walk_both_ways(&mut it), m);
        navigate(&mut it, m, rng, 400);
        // A bounded scan over the iterator.
        let lo = key(rng);
        let want: Vec<(Vec<u8>, Vec<u8>)> =
            m.range(lo.clone()..).take(7).map(|(k, v)| (k.clone(), v.clone())).collect();
        assert_eq!(
            crate::iter::collect_range(&mut *e.iter().unwrap(), Bound::Included(&lo), Bound::Unbounded, 7).unwrap(),
            want
        );
    }

    /// (a) The model test: random writes with flushes and compactions (inline and on the
    /// background threads), random walks after each round, then across a clean close and
    /// reopen and a crash and reopen.
    #[test]
    fn iterator_matches_a_model_across_flushes_compactions_and_reopens() {
        for seed in 0..4u64 {
            let background = seed % 2 == 1;
            let mut rng = SmallRng::seed_from_u64(seed);
            let (dev, fs) = (SimDevice::new(), FaultFs::new());
            // Few partitions (long chains), or more (level splits: byte-value sets with holes).
            let parts = if seed < 2 { 6 } else { 24 };
            let e = Lightkv::open(ctx(&dev, &fs, true, background, parts)).unwrap();
            let mut m = Model::new();
            let mut i = 0;
            for round in 0..6 {
                for _ in 0..250 {
                    write(&e, &mut m, &mut rng, i);
                    i += 1;
                }
                match round % 3 {
                    0 => e.flush().unwrap(),
                    1 => e.compact().unwrap(),
                    _ => {}
                }
                check(&e, &m, &mut rng);
            }
            let st = e.store.stats();
            eprintln!("model seed {seed}: {st:?} level splits {}", figure(&e.store, "level_splits"));
            assert!(st.flushes > 10 && st.compactions > 0, "seed {seed}: {st:?}");
            assert!(parts < 24 || figure(&e.store, "level_splits") > 0, "seed {seed}: no level split");
            assert_eq!(e.check().unwrap(), Vec::<String>::new());
            // A clean close (image restore), then a crash (write-buffer scan).
            e.close().unwrap();
            drop(e);
            let e = Lightkv::open(ctx(&dev, &fs, false, background, parts)).unwrap();
            assert_eq!(e.store.stats().restored_from_image, 1);
            check(&e, &m, &mut rng);
            for _ in 0..200 {
                write(&e, &mut m, &mut rng, i);
                i += 1;
            }
            e.flush().unwrap();
            check(&e, &m, &mut rng);
            drop(e);
            let e = Lightkv::open(ctx(&dev.simulate_crash(0, 0.0), &fs.crash(), false, background, parts)).unwrap();
            check(&e, &m, &mut rng);
            assert_eq!(e.check().unwrap(), Vec::<String>::new());
        }
    }

    /// A walk verifies each write-buffer entry it meets once per open region: walking the
    /// same store again (no flush in between) verifies nothing more and still matches the
    /// model; a reopen verifies again.
    #[test]
    fn walks_verify_each_buffer_entry_once_per_open() {
        let mut rng = SmallRng::seed_from_u64(11);
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let e = Lightkv::open(ctx(&dev, &fs, true, false, 24)).unwrap();
        let mut m = Model::new();
        for i in 0..300 {
            write(&e, &mut m, &mut rng, i);
        }
        let verified = |e: &Lightkv| e.store.region().checked().verified();
        assert_eq!(verified(&e), 0, "point reads and writes do not use the memo");
        assert_live(&walk_both_ways(&mut e.iter().unwrap()), &m);
        let first = verified(&e);
        assert!(first > 0, "the walk read write-buffer entries");
        assert_live(&walk_both_ways(&mut e.iter().unwrap()), &m);
        navigate(&mut e.iter().unwrap(), &m, &mut rng, 300);
        assert_eq!(verified(&e), first, "the second walk verified nothing");
        e.close().unwrap();
        drop(e);
        let e = Lightkv::open(ctx(&dev, &fs, false, false, 24)).unwrap();
        assert_eq!(verified(&e), 0);
        assert_live(&walk_both_ways(&mut e.iter().unwrap()), &m);
        assert!(verified(&e) > 0, "a reopen verifies again");
    }

    fn region(dev: &SimDevice) -> Arc<Region> {
        Arc::new(Region::open(RegionConfig::new(Backing::Sim(dev.clone()), 1 << 20, 5)).unwrap())
    }

    fn figure(s: &PwbStore, name: &str) -> u64 {
        s.shape().into_iter().find(|x| x.0 == name).map_or(0, |x| x.1)
    }

    /// Flush every queued leaf and compact what the flushes made due (what the engine's
    /// threads do), in the calling thread.
    fn drain(s: &PwbStore) {
        while let Some(slot) = s.flush_one().unwrap() {
            s.compact_chain(slot).unwrap();
        }
    }

    /// (b) An iterator reads on, and returns exactly the entries of its creation, while the
    /// flushes and compactions after it move its write-buffer records into tables, delete
    /// the tables it reads and free its records' segments — and while new writes allocate
    /// segments where freed ones were.
    #[test]
    fn an_iterator_survives_the_flushes_and_compactions_that_rewrite_what_it_reads() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        // Flushes are queued (no threads): the test runs them itself.
        let cfg = StoreConfig { background: true, ..StoreConfig::inline(8192, small_tree(), 4) };
        let s = Arc::new(PwbStore::open(region(&dev), Arc::new(fs.clone()), Path::new("/t"), true, cfg).unwrap());
        let mut m = Model::new();
        let mut rng = SmallRng::seed_from_u64(9);
        let put = |s: &PwbStore, m: &mut Model, k: Vec<u8>, v: Vec<u8>| {
            s.write(pwb::Kind::Put, &k, &v).unwrap();
            m.insert(k, v);
        };
        for i in 0..1500usize {
            let k = format!("key{:03}", rng.random_range(0..300)).into_bytes();
            if i % 9 == 4 {
                s.write(pwb::Kind::Delete, &k, b"").unwrap();
                m.remove(&k);
            } else {
                put(&s, &mut m, k, value(&mut rng, i));
            }
            if s.pending_flushes() >= 4 {
                drain(&s);
            }
        }
        // Leave leaves queued, so that the flushes run after the iterator is created.
        let mut i = 1500;
        while s.pending_flushes() < 3 {
            let k = format!("key{:03}", rng.random_range(0..300)).into_bytes();
            put(&s, &mut m, k, value(&mut rng, i));
            i += 1;
        }
        let tables_before: BTreeSet<String> = fs.list(Path::new("/t")).unwrap().into_iter().collect();
        let compactions = s.stats().compactions;
        let mut it = s.iter().unwrap();
        let want: Vec<(Vec<u8>, Vec<u8>)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        // Read a third, then rewrite the store under the iterator.
        it.seek_to_first().unwrap();
        let mut got = Vec::new();
        while it.valid() && got.len() < want.len() / 3 {
            if let Some(v) = it.value() {
                got.push((it.key().to_vec(), v.to_vec()));
            }
            it.next().unwrap();
        }
        drain(&s);
        // Write other keys of the same partitions (`key…x`: the iterated keys stay as they
        // were), flushing as the engine's thread would, until every table the iterator
        // listed has been merged away and deleted.
        let new_key = |k: u32| format!("key{k:03}x").into_bytes();
        let mut rounds = 0;
        while tables_before.iter().any(|t| fs.list(Path::new("/t")).unwrap().contains(t)) && rounds < 50 {
            for k in 0..300 {
                s.write(pwb::Kind::Put, &new_key(k), format!("later{rounds}").as_bytes()).unwrap();
                if s.pending_flushes() >= 4 {
                    drain(&s);
                }
            }
            drain(&s);
            rounds += 1;
        }
        let now: BTreeSet<String> = fs.list(Path::new("/t")).unwrap().into_iter().collect();
        assert!(tables_before.iter().all(|t| !now.contains(t)), "every table the iterator read was deleted");
        assert!(s.stats().compactions > compactions);
        assert!(figure(&s, "deferred_segment_frees") > 0, "freed segments wait for the iterator");
        assert_eq!(figure(&s, "iterators_open"), 1);
        // The rest of the walk, and both directions over everything, see the entries of the
        // iterator's creation (the new keys may show or not: they were written meanwhile).
        let old = |k: &[u8]| k.last() != Some(&b'x');
        while it.valid() {
            if let (true, Some(v)) = (old(it.key()), it.value()) {
                got.push((it.key().to_vec(), v.to_vec()));
            }
            it.next().unwrap();
        }
        assert!(got == want, "the walk across the rewrite returned other entries");
        let raw: Raw = walk_both_ways(&mut it).into_iter().filter(|e| old(&e.0)).collect();
        assert_live(&raw, &m);
        // Once it is gone, the deferred work runs, and a new iterator sees the new keys.
        drop(it);
        s.write(pwb::Kind::Put, b"zzz", b"1").unwrap();
        m.insert(b"zzz".to_vec(), b"1".to_vec());
        assert_eq!((figure(&s, "deferred_segment_frees"), figure(&s, "deferred_view_entries")), (0, 0));
        assert_eq!(figure(&s, "iterators_open"), 0);
        for k in 0..300 {
            m.insert(new_key(k), format!("later{}", rounds - 1).into_bytes());
        }
        let mut it = s.iter().unwrap();
        assert_live(&walk_both_ways(&mut it), &m);
        navigate(&mut it, &m, &mut rng, 300);
        assert_eq!(s.check().unwrap(), Vec::<String>::new());
    }

    fn small_tree() -> RhOptions {
        RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 6 }
    }

    /// (c) Writers change a disjoint set of keys, interleaved with the walked ones, while
    /// iterators walk the store and the background threads flush and compact: every
    /// untouched key is returned exactly once, in order, with its value, both ways.
    #[test]
    fn concurrent_writers_never_hide_or_repeat_untouched_keys() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let e = Arc::new(Lightkv::open(ctx(&dev, &fs, true, true, 6)).unwrap());
        let mut m = Model::new();
        for i in 0..400u32 {
            let k = format!("k{i:04}a").into_bytes();
            let v = format!("value-{i}").into_bytes();
            e.write(&[BatchOp::Put { key: k.clone(), value: v.clone() }], Cond::None).unwrap();
            m.insert(k, v);
        }
        e.flush().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..2u64)
            .map(|t| {
                let (e, stop) = (e.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(t);
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let k = format!("k{:04}b{t}", rng.random_range(0..400)).into_bytes();
                        let op = if rng.random_range(0..4) == 0 {
                            BatchOp::Delete { key: k }
                        } else {
                            BatchOp::Put { key: k, value: vec![b'w'; rng.random_range(10..200)] }
                        };
                        e.write(&[op], Cond::None).unwrap();
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let flushes = e.store.stats().flushes;
        let untouched = |k: &[u8]| k.last() == Some(&b'a');
        let want: Vec<(Vec<u8>, Vec<u8>)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut rng = SmallRng::seed_from_u64(99);
        let mut passes = 0;
        while passes < 20 || (e.store.stats().flushes < flushes + 20 && passes < 3000) {
            let mut it = e.iter().unwrap();
            let forward = passes % 2 == 0;
            let mut seen: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
            let mut last: Option<Vec<u8>> = None;
            if forward {
                it.seek_to_first().unwrap();
            } else {
                it.seek_to_last().unwrap();
            }
            while it.valid() {
                let k = it.key().to_vec();
                if let Some(l) = &last {
                    assert!(if forward { *l < k } else { *l > k }, "pass {passes}: keys out of order");
                }
                assert!(untouched(&k) || k.get(k.len().saturating_sub(2)) == Some(&b'b'), "a foreign key");
                if untouched(&k) {
                    seen.push((k.clone(), it.value().expect("untouched keys are live").to_vec()));
                }
                last = Some(k);
                if forward {
                    it.next().unwrap();
                } else {
                    it.prev().unwrap();
                }
            }
            if !forward {
                seen.reverse();
            }
            assert!(seen == want, "pass {passes}: the untouched keys differ ({} of {})", seen.len(), want.len());
            // Seeks land on the untouched key they name.
            for _ in 0..20 {
                let (k, v) = &want[rng.random_range(0..want.len())];
                it.seek(k).unwrap();
                assert_eq!((it.key(), it.value()), (k.as_slice(), Some(v.as_slice())));
                it.seek_for_prev(k).unwrap();
                assert_eq!((it.key(), it.value()), (k.as_slice(), Some(v.as_slice())));
            }
            passes += 1;
        }
        stop.store(true, Ordering::Relaxed);
        let written: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum();
        assert!(written > 0);
        let st = e.store.stats();
        eprintln!("concurrent: {passes} passes, {written} writes, {st:?}");
        assert!(st.flushes >= flushes + 20 && st.compactions > 0, "background work ran meanwhile: {st:?}");
        assert_eq!(e.check().unwrap(), Vec::<String>::new());
    }

    /// Entries read through a write buffer's worth of writes: what a range read costs
    /// after writes. (e) Range reads interleaved with writes never sort the write buffer:
    /// the sorted view is built once, by the first iterator, and each short scan after a
    /// write decodes about as many write-buffer entries as it returns (re-sorting a
    /// partition's buffer, as the old scan did after every write, reads every key in it).
    /// After many writes with no range read the view is dropped (writes stop paying for
    /// it), and the next iterator rebuilds it, once.
    #[test]
    fn range_reads_after_writes_do_not_sort_the_write_buffer() {
        use crate::engine::lightkv::store::PWB_ENTRIES_READ;
        let reads = || PWB_ENTRIES_READ.with(std::cell::Cell::get);
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        // Large leaves, two partitions at most: the whole load stays in the write buffer.
        let tree = RhOptions { leaf_buckets: 1024, t_normal: 4, max_leaf_nodes: 2 };
        let cfg = StoreConfig::inline(64 << 10, tree, 4);
        let s = Arc::new(PwbStore::open(region(&dev), Arc::new(fs.clone()), Path::new("/t"), true, cfg).unwrap());
        let mut m = Model::new();
        let mut rng = SmallRng::seed_from_u64(5);
        let k = |i: u32| format!("key{i:05}").into_bytes();
        for i in 0..1500u32 {
            let v = value(&mut rng, i as usize);
            s.write(pwb::Kind::Put, &k(i), &v).unwrap();
            m.insert(k(i), v);
        }
        assert_eq!(s.stats().flushes, 0, "the load is all in the write buffer");
        assert_eq!(figure(&s, "sorted_view_active"), 0, "writes skip the view until a range read needs it");
        let mut per_scan = Vec::new();
        for round in 0..200usize {
            // A write, then a 10-entry scan from a random key.
            let i = rng.random_range(0..1500u32);
            let v = value(&mut rng, round);
            s.write(pwb::Kind::Put, &k(i), &v).unwrap();
            m.insert(k(i), v);
            let from = k(rng.random_range(0..1500u32));
            let before = reads();
            let got = crate::iter::collect_range(&mut *open(&s).unwrap(), Bound::Included(&from), Bound::Unbounded, 10)
                .unwrap();
            per_scan.push(reads() - before);
            let want: Vec<(Vec<u8>, Vec<u8>)> =
                m.range(from.clone()..).take(10).map(|(k, v)| (k.clone(), v.clone())).collect();
            assert!(got == want, "round {round}: the scan returned other entries");
        }
        let keys = figure(&s, "sorted_view_keys");
        assert!(keys >= 1500, "the view holds the whole buffer ({keys} keys)");
        assert_eq!(figure(&s, "sorted_view_builds"), 1, "one build, by the first scan");
        // The first scan built the view (it read every buffered key); each later one reads
        // the ten entries it returns and the one it stops at.
        assert!(per_scan[0] >= 1500, "the build read the buffer: {}", per_scan[0]);
        let most = per_scan[1..].iter().copied().max().unwrap_or(0);
        assert!(most <= 12, "a scan after a write read {most} write-buffer entries");
        // Writes with no range read: the view goes idle and is dropped; the next
        // iterator rebuilds it and sees every write made meanwhile.
        let mut i = 0;
        while figure(&s, "sorted_view_active") == 1 && i < 20_000 {
            let v = value(&mut rng, i);
            s.write(pwb::Kind::Put, &k(i as u32 % 1500), &v).unwrap();
            m.insert(k(i as u32 % 1500), v);
            i += 1;
        }
        assert_eq!(figure(&s, "sorted_view_active"), 0, "the idle view was dropped after {i} writes");
        assert_eq!(figure(&s, "sorted_view_keys"), 0);
        let mut it = s.iter().unwrap();
        assert_live(&walk_both_ways(&mut it), &m);
        drop(it);
        assert_eq!(figure(&s, "sorted_view_builds"), 2);
        assert_eq!(s.check().unwrap(), Vec::<String>::new());
    }

    /// (d) Through the public API: a `Db` iterator and a snapshot's iterators see exactly
    /// the store of the snapshot — while two writers overwrite and delete every key and
    /// add new ones, and flushes and compactions (on the background threads and forced
    /// by the writers) move the write buffer into tables and merge them.
    #[test]
    fn db_iterators_and_snapshots_see_exactly_their_snapshot_under_writers() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let mut opts = crate::testing::sim_options(Preset::Lightkv, &dev, &fs);
        opts.lightkv.background = true;
        let db = Arc::new(crate::Db::open("/db", opts).unwrap());
        let key = |i: u32| format!("k{i:04}").into_bytes();
        let mut m = Model::new();
        let mut rng = SmallRng::seed_from_u64(3);
        for i in 0..1200u32 {
            let v = value(&mut rng, i as usize);
            db.put(key(i), &v).unwrap();
            m.insert(key(i), v);
            if i % 7 == 3 {
                db.delete(key(i / 2)).unwrap();
                m.remove(&key(i / 2));
            }
        }
        let design = |db: &crate::Db, name: &str| db.stats().design.get(name).copied().unwrap_or(0);
        let (flushes, compactions) = (design(&db, "flushes"), design(&db, "compactions"));
        let snap = db.snapshot().unwrap();
        let mut old = db.iter().unwrap();
        let want: Vec<(Vec<u8>, Vec<u8>)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        // The first third through the old iterator before the writers start.
        let mut got = Vec::new();
        while got.len() < want.len() / 3 {
            let (k, v) = old.next_ref().unwrap().expect("entries left");
            got.push((k.to_vec(), v.to_vec()));
        }
        let writers: Vec<_> = (0..2u32)
            .map(|t| {
                let db = db.clone();
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(u64::from(t) + 10);
                    for n in 0..3000u32 {
                        let i = rng.random_range(0..1300u32);
                        match rng.random_range(0..4) {
                            0 => db.delete(key(i)).unwrap(),
                            1 => db.put(format!("k{i:04}{t}").into_bytes(), b"new").unwrap(),
                            _ => db.put(key(i), format!("w{t}-{n}").into_bytes()).unwrap(),
                        }
                        if n % 700 == 699 {
                            db.compact().unwrap();
                        }
                    }
                })
            })
            .collect();
        // Walk snapshot iterators (made while the writers run) both ways until they stop.
        let walk = |it: &mut crate::DbIterator, forward: bool| {
            let mut out = Vec::new();
            if forward {
                it.seek_to_first();
                while let Some((k, v)) = it.next_ref().unwrap() {
                    out.push((k.to_vec(), v.to_vec()));
                }
            } else {
                it.seek_to_last();
                while let Some((k, v)) = it.prev_ref().unwrap() {
                    out.push((k.to_vec(), v.to_vec()));
                }
                out.reverse();
            }
            out
        };
        let mut passes = 0;
        while passes < 4 || (!writers.iter().all(std::thread::JoinHandle::is_finished) && passes < 200) {
            let mut it = snap.iter().unwrap();
            assert!(walk(&mut it, passes % 2 == 0) == want, "pass {passes}: the snapshot's iterator differs");
            passes += 1;
        }
        for w in writers {
            w.join().unwrap();
        }
        // The old iterator goes on from where it was, then both ways over everything.
        while let Some((k, v)) = old.next_ref().unwrap() {
            got.push((k.to_vec(), v.to_vec()));
        }
        assert!(got == want, "the iterator made before the writes returned other entries");
        assert!(walk(&mut old, false) == want && walk(&mut old, true) == want);
        for (k, v) in want.iter().step_by(37) {
            old.seek(k);
            assert_eq!(old.next_ref().unwrap(), Some((k.as_slice(), v.as_slice())));
            old.seek_for_prev(k);
            assert_eq!(old.prev_ref().unwrap(), Some((k.as_slice(), v.as_slice())));
        }
        drop((old, snap));
        assert!(design(&db, "flushes") > flushes + 2, "flushes ran under the iterators");
        assert!(design(&db, "compactions") > compactions, "compactions ran under the iterators");
        // The store itself moved on: a new iterator sees the writers' changes.
        let now = walk(&mut db.iter().unwrap(), true);
        assert!(now != want && now.iter().any(|e| e.1 == b"new"));
        assert_eq!(db.check().unwrap(), Vec::<String>::new());
    }
}
