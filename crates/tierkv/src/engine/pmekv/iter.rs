//! PMEKV's range reads: [`PmekvIter`], the cursor `Engine::iter` returns; the frees of
//! values a live iterator may still read wait in [`crate::pm::pins::Pins`] (design in the
//! module docs of [`super`], "Range reads: the iterator").

use std::ops::Bound;
use std::sync::Arc;

use super::{layout, Inner, ValueRef};
use crate::error::Result;
use crate::index::bplus::{Batch, BatchSource, ReadAhead};
use crate::iter::InternalIterator;

/// Value records prefetched ahead of the current entry.
const PREFETCH: isize = 3;

/// The key index tree, read by key under the shared state lock.
struct TreeSource(Arc<Inner>);

impl BatchSource for TreeSource {
    type V = ValueRef;
    fn fill(&self, from: Bound<&[u8]>, forward: bool, n: usize, out: &mut Batch<ValueRef>) -> bool {
        self.0.state.read().tree.fill_batch(from, forward, n, out, |v| *v)
    }
}

/// The store's entries in key order: the key index tree through a read-ahead cursor, each
/// value verified and borrowed from PM.
pub(crate) struct PmekvIter {
    inner: Arc<Inner>,
    cur: ReadAhead<TreeSource>,
    /// This iterator's registration in [`crate::pm::pins::Pins`].
    epoch: u64,
    /// Where the current value's bytes are (None: invalid).
    val: Option<(u64, usize)>,
    /// False after a move failed (the iterator is then invalid).
    ok: bool,
}

impl std::fmt::Debug for PmekvIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PmekvIter").field("epoch", &self.epoch).field("valid", &self.valid()).finish()
    }
}

impl Drop for PmekvIter {
    fn drop(&mut self) {
        let free = self.inner.pins.lock().deregister(self.epoch);
        if !free.is_empty() {
            let mut heap = self.inner.heap.lock();
            for (a, l) in free {
                heap.free(a, l);
            }
        }
    }
}

impl PmekvIter {
    /// A cursor over the store. Registers before reading any address, so every value it
    /// can reach is either in the tree or held back by [`crate::pm::pins::Pins`] while it lives.
    pub(crate) fn new(inner: &Arc<Inner>) -> PmekvIter {
        let epoch = inner.pins.lock().register();
        PmekvIter { inner: inner.clone(), cur: ReadAhead::new(TreeSource(inner.clone())), epoch, val: None, ok: true }
    }

    /// Prefetch the value record `ahead` entries away (values are in PM in write order,
    /// not key order: each step of a walk reads a record far from the last), unless this
    /// process already verified it (the walk then reads none of its bytes).
    fn prefetch_at(&self, ahead: isize) {
        if let Some(v) = self.cur.peek(ahead) {
            if !self.inner.region.checked().knows(v.addr) {
                self.inner.region.prefetch(v.addr, (layout::VALUE_HEADER + u64::from(v.len)) as usize);
            }
        }
    }

    /// Prefetch the memo set of the value record `ahead` entries away, which
    /// [`PmekvIter::prefetch_at`] reads a few steps later.
    fn prefetch_memo(&self, ahead: isize) {
        if let Some(v) = self.cur.peek(ahead) {
            self.inner.region.checked().prefetch(v.addr);
        }
    }

    /// After a seek: prefetch the records of the next entries in direction `dir`.
    fn after_seek(&mut self, dir: isize) -> Result<()> {
        for d in 0..=2 * PREFETCH {
            self.prefetch_memo(d * dir);
        }
        self.settle()?;
        for d in 1..=PREFETCH {
            self.prefetch_at(d * dir);
        }
        Ok(())
    }

    /// After a step in direction `dir`: prefetch one more record ahead.
    fn after_step(&mut self, dir: isize) -> Result<()> {
        self.prefetch_memo(2 * PREFETCH * dir);
        self.settle()?;
        self.prefetch_at(PREFETCH * dir);
        Ok(())
    }

    /// After a move: verify the current value record in place (once per open region).
    fn settle(&mut self) -> Result<()> {
        self.val = None;
        self.ok = true;
        let Some(v) = self.cur.val().copied() else { return Ok(()) };
        let len = (layout::VALUE_HEADER + u64::from(v.len)) as usize;
        let region = &self.inner.region;
        // Verified once per open region (`crate::pm::checked`): a record a walk met before
        // is not read again until `value` is asked for. The key is the memo's salt: the
        // checksum binds the record to its key, so an index entry naming a record verified
        // for another key misses the memo and fails the check.
        let salt = u64::from(crc32c::crc32c(self.cur.key()));
        let r = region
            .checked()
            .verify_once(v.addr, len, salt, || {
                let rec = region.slice_checked(v.addr, len, "value record")?;
                layout::value_verify(rec, self.cur.key(), v.len).map(|_| ()).map_err(|d| region.corruption(v.addr, d))
            })
            .map(|_| (v.addr + layout::VALUE_HEADER, v.len as usize));
        match r {
            Ok(at) => {
                self.val = Some(at);
                Ok(())
            }
            Err(e) => {
                self.ok = false;
                Err(e)
            }
        }
    }
}

impl InternalIterator for PmekvIter {
    fn valid(&self) -> bool {
        self.ok && self.cur.valid()
    }
    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.cur.seek(key);
        self.after_seek(1)
    }
    fn seek_to_first(&mut self) -> Result<()> {
        self.cur.seek_to_first();
        self.after_seek(1)
    }
    fn seek_to_last(&mut self) -> Result<()> {
        self.cur.seek_to_last();
        self.after_seek(-1)
    }
    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.cur.seek_for_prev(key);
        self.after_seek(-1)
    }
    fn next(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        self.cur.next();
        self.after_step(1)
    }
    fn prev(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        self.cur.prev();
        self.after_step(-1)
    }
    fn key(&self) -> &[u8] {
        if self.ok {
            self.cur.key()
        } else {
            &[]
        }
    }
    fn value(&self) -> Option<&[u8]> {
        let (at, len) = self.val?;
        // `settle` verified the record at this range, and its extent is not freed while
        // this iterator lives (Pins), so the bytes are still the verified value.
        self.inner.region.slice(at, len)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use crate::batch::BatchOp;
    use crate::engine::hpdk::iter::check::{full_walks, random_moves, Model};
    use crate::engine::pmekv::{layout, Pmekv, ValueRef};
    use crate::engine::{Cond, Engine};
    use crate::fs::FaultFs;
    use crate::options::{Options, PmekvOptions, Preset};
    use crate::pm::sim::SimDevice;

    fn open(o: &Options, fs: &FaultFs, fresh: bool) -> Pmekv {
        Pmekv::open(crate::engine::test_ctx(o, fs, fresh, 9)).unwrap()
    }

    fn key(i: u32) -> Vec<u8> {
        format!("k{i:05}").into_bytes()
    }

    fn value(k: &[u8], ver: u64, rng: &mut SmallRng) -> Vec<u8> {
        crate::iter::versioned_value(k, ver, rng, 600)
    }

    fn design(e: &Pmekv, name: &str) -> u64 {
        e.stats().design.get(name).copied().unwrap_or_else(|| panic!("no design figure {name}"))
    }

    fn churn(e: &Pmekv, m: &mut Model, rng: &mut SmallRng, ops: usize, keys: u32, ver: &mut u64) {
        for i in 0..ops {
            let n = if rng.random_bool(0.2) { rng.random_range(2..8) } else { 1 };
            let mut batch = Vec::new();
            let mut after = m.clone();
            for _ in 0..n {
                let k = key(rng.random_range(0..keys));
                *ver += 1;
                if rng.random_bool(0.25) {
                    after.remove(&k);
                    batch.push(BatchOp::Delete { key: k });
                } else {
                    let v = value(&k, *ver, rng);
                    after.insert(k.clone(), v.clone());
                    batch.push(BatchOp::Put { key: k, value: v });
                }
            }
            assert!(e.write(&batch, Cond::None).unwrap());
            *m = after;
            if i % 89 == 17 {
                e.flush().unwrap();
            }
        }
    }

    /// (a) The iterator against a model: random writes and batches with checkpoints (and
    /// the leaf splits and merges of a small node capacity), then random interleavings of
    /// every move, before and after a close and reopen.
    #[test]
    fn iterator_matches_model() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = crate::testing::sim_options(Preset::Pmekv, &dev, &fs);
        let mut rng = SmallRng::seed_from_u64(21);
        let mut m = Model::new();
        let mut ver = 0;
        let e = open(&o, &fs, true);
        for _ in 0..4 {
            churn(&e, &mut m, &mut rng, 600, 500, &mut ver);
            let mut it = e.iter().unwrap();
            full_walks(&mut *it, &m);
            random_moves(&mut *it, &m, &mut rng, 3000);
        }
        assert!(design(&e, "checkpoints") > 0);
        e.close().unwrap();
        drop(e);
        let e = open(&o, &fs, false);
        let mut it = e.iter().unwrap();
        full_walks(&mut *it, &m);
        random_moves(&mut *it, &m, &mut rng, 2000);
        let (lo, hi) = (key(100), key(300));
        let got = crate::iter::collect_range(
            &mut *e.iter().unwrap(),
            std::ops::Bound::Included(&lo),
            std::ops::Bound::Excluded(&hi),
            40,
        )
        .unwrap();
        let want: Vec<(Vec<u8>, Vec<u8>)> = m.range(lo..hi).take(40).map(|(k, v)| (k.clone(), v.clone())).collect();
        assert_eq!(got, want, "bounded scan");
    }

    /// The value records a walk verified are memoised for this open region (later walks
    /// read none of their bytes until `value` is asked for), and only those: a reopen
    /// starts with none, so its first walk verifies every record again.
    #[test]
    fn a_walk_verifies_each_record_once_per_open() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = crate::testing::sim_options(Preset::Pmekv, &dev, &fs);
        let mut rng = SmallRng::seed_from_u64(5);
        let (mut m, mut ver) = (Model::new(), 0);
        let e = open(&o, &fs, true);
        churn(&e, &mut m, &mut rng, 300, 200, &mut ver);
        let entries = |e: &Pmekv| -> Vec<(Vec<u8>, ValueRef)> {
            e.inner.state.read().tree.range_from(std::ops::Bound::Unbounded).map(|(k, v)| (k.to_vec(), *v)).collect()
        };
        let memoised = |e: &Pmekv| {
            let r = &e.inner.region;
            let len = |v: &ValueRef| (layout::VALUE_HEADER + u64::from(v.len)) as usize;
            let salt = |k: &[u8]| u64::from(crc32c::crc32c(k));
            entries(e).iter().filter(|(k, v)| r.checked().contains(v.addr, len(v), salt(k))).count()
        };
        let verified = |e: &Pmekv| e.inner.region.checked().verified() as usize;
        let live = |e: &Pmekv| entries(e).len();
        assert!(live(&e) > 0);
        assert_eq!(memoised(&e), 0, "no walk yet");
        // A walk of the first half memoises exactly its records.
        let half = key(100);
        let mut it = e.iter().unwrap();
        it.seek_to_first().unwrap();
        let mut walked = 0;
        while it.valid() && it.key() < half.as_slice() {
            assert_eq!(it.value(), m.get(it.key()).map(|v| v.as_slice()));
            walked += 1;
            it.next().unwrap();
        }
        drop(it);
        // (The walk stops one entry past the half: that record was verified too.)
        assert_eq!(memoised(&e), walked + 1);
        assert_eq!(verified(&e), walked + 1, "one check per record");
        full_walks(&mut *e.iter().unwrap(), &m);
        assert_eq!(memoised(&e), live(&e), "a full walk verified every record");
        assert_eq!(verified(&e), live(&e), "and checked none twice");
        full_walks(&mut *e.iter().unwrap(), &m);
        assert_eq!(verified(&e), live(&e), "a second full walk checked nothing");
        e.close().unwrap();
        drop(e);
        let e = open(&o, &fs, false);
        assert_eq!(memoised(&e), 0, "a reopen trusts nothing it did not verify");
        full_walks(&mut *e.iter().unwrap(), &m);
        assert_eq!(memoised(&e), live(&e));
        assert_eq!(verified(&e), live(&e));
    }

    /// (b) Checkpoints that free the values an iterator holds addresses of (keys
    /// overwritten and deleted while it walks) do not free them under it: untouched keys
    /// come back exactly, written ones as one of their versions, and the held frees are
    /// released when it is dropped. Without writes, a checkpoint under the iterator
    /// changes nothing it returns.
    #[test]
    fn checkpoint_frees_wait_for_iterators() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = crate::testing::sim_options(Preset::Pmekv, &dev, &fs);
        let e = open(&o, &fs, true);
        let mut rng = SmallRng::seed_from_u64(4);
        let mut m = Model::new();
        let mut ver = 0;
        churn(&e, &mut m, &mut rng, 800, 600, &mut ver);
        let mut it = e.iter().unwrap();
        it.seek(&key(250)).unwrap();
        e.flush().unwrap();
        crate::engine::hpdk::iter::check::continue_forward(&mut *it, &m, &key(250));
        random_moves(&mut *it, &m, &mut rng, 1000);
        full_walks(&mut *it, &m);
        drop(it);

        let odd = |k: &[u8]| k.last().is_some_and(|b| (b - b'0') % 2 == 1);
        let stable: Vec<(Vec<u8>, Vec<u8>)> =
            m.iter().filter(|(k, _)| !odd(k)).map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut it = e.iter().unwrap();
        it.seek_to_first().unwrap();
        let (mut got, mut rounds) = (Vec::new(), 0);
        while it.valid() {
            let k = it.key().to_vec();
            let v = it.value().map(<[u8]>::to_vec);
            if odd(&k) {
                let prefix = format!("{}:", String::from_utf8_lossy(&k));
                assert!(v.is_some_and(|v| v.starts_with(prefix.as_bytes())), "a value that is no version of its key");
            } else {
                got.push((k, v.unwrap_or_default()));
            }
            it.next().unwrap();
            if rounds < 30 {
                rounds += 1;
                for i in (1..600u32).step_by(2) {
                    ver += 1;
                    let k = key(i);
                    let op = if rng.random_bool(0.3) {
                        BatchOp::Delete { key: k }
                    } else {
                        let v = value(&k, ver, &mut rng);
                        BatchOp::Put { key: k, value: v }
                    };
                    e.write(&[op], Cond::None).unwrap();
                }
                e.flush().unwrap();
            }
        }
        assert!(got == stable, "untouched keys differ from the model");
        assert!(design(&e, "frees_held_for_iterators") > 0, "the checkpoints held frees back");
        assert_eq!(design(&e, "iterators_live"), 1);
        drop(it);
        assert_eq!(design(&e, "frees_held_for_iterators"), 0, "released with the last iterator");
        assert_eq!(design(&e, "iterators_live"), 0);
        assert!(e.check().unwrap().is_empty());
    }

    /// (c) Writers change a disjoint key set (with background write-back) while iterators
    /// walk both ways: every untouched key is returned exactly once, in order, with its
    /// value.
    #[test]
    fn concurrent_writers_do_not_disturb_untouched_keys() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = crate::testing::sim_options(Preset::Pmekv, &dev, &fs).pmekv(PmekvOptions {
            node_capacity: 8,
            kv_log_size: 256 << 10,
            key_log_size: 256 << 10,
            writeback_interval_ms: 1,
        });
        let e = Arc::new(open(&o, &fs, true));
        let mut rng = SmallRng::seed_from_u64(6);
        let mut m = Model::new();
        for i in (0..2000u32).step_by(2) {
            let k = key(i);
            let v = value(&k, 1, &mut rng);
            e.write(&[BatchOp::Put { key: k.clone(), value: v.clone() }], Cond::None).unwrap();
            m.insert(k, v);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..2u64)
            .map(|t| {
                let (e, stop) = (e.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(200 + t);
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) || n < 2000 {
                        let k = key(rng.random_range(0..1000u32) * 2 + 1);
                        let op = if rng.random_bool(0.3) {
                            BatchOp::Delete { key: k }
                        } else {
                            let v = value(&k, n, &mut rng);
                            BatchOp::Put { key: k, value: v }
                        };
                        e.write(&[op], Cond::None).unwrap();
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let want: Vec<(Vec<u8>, Vec<u8>)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for pass in 0..6 {
            let mut it = e.iter().unwrap();
            let forward = pass % 2 == 0;
            if forward {
                it.seek_to_first().unwrap();
            } else {
                it.seek_to_last().unwrap();
            }
            let mut got: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
            let mut last: Option<Vec<u8>> = None;
            while it.valid() {
                let k = it.key().to_vec();
                if let Some(l) = &last {
                    assert!(if forward { k > *l } else { k < *l }, "pass {pass}: keys out of order");
                }
                let v = it.value().map(<[u8]>::to_vec).unwrap_or_default();
                if k.last().is_some_and(|b| (b - b'0').is_multiple_of(2)) {
                    got.push((k.clone(), v));
                } else {
                    let prefix = format!("{}:", String::from_utf8_lossy(&k));
                    assert!(v.starts_with(prefix.as_bytes()), "pass {pass}: a value that is no version of its key");
                }
                last = Some(k);
                if forward {
                    it.next().unwrap();
                } else {
                    it.prev().unwrap();
                }
            }
            if !forward {
                got.reverse();
            }
            assert_eq!(got.len(), want.len(), "pass {pass}: untouched keys returned");
            assert!(got == want, "pass {pass}: untouched keys differ");
        }
        stop.store(true, Ordering::Relaxed);
        let written: u64 = writers.into_iter().map(|w| w.join().unwrap()).sum();
        assert!(written >= 4000);
        assert!(design(&e, "checkpoints") > 0, "write-backs ran during the walks");
    }
}
