//! HPDK's range reads: [`HpdkIter`], the cursor `Engine::iter` returns (design in the
//! module docs of [`super`], "Range reads: the iterator").

use std::ops::Bound;
use std::sync::Arc;

use super::vlog::{PoolInfo, Vlog};
use super::{layout, untv, Inner, Mem, TOMB};
use crate::error::Result;
use crate::index::bplus::{Batch, BatchSource, ReadAhead};
use crate::iter::{BoxedIter, InternalIterator, MergingIterator};
use crate::sstable::TableIter;

/// A value address as the sources report it: its 6 bytes (the SSTable encoding), `None` for
/// a delete.
type Addr = Option<[u8; 6]>;

fn addr_of(a: u64) -> Addr {
    (a != TOMB).then(|| layout::vaddr_bytes(a))
}

/// A MemTable (the active one, shared with writers, or a frozen one) read by key under its
/// map's read lock.
struct MemSource(Arc<Mem>);

impl BatchSource for MemSource {
    type V = Addr;
    fn fill(&self, from: Bound<&[u8]>, forward: bool, n: usize, out: &mut Batch<Addr>) -> bool {
        crate::index::bplus::fill_from_map(&self.0.map.read(), from, forward, n, out, |a| addr_of(*a))
    }
}

/// The DRAM B+-tree, read by key under its read lock.
struct TreeSource(Arc<Inner>);

impl BatchSource for TreeSource {
    type V = Addr;
    fn fill(&self, from: Bound<&[u8]>, forward: bool, n: usize, out: &mut Batch<Addr>) -> bool {
        self.0.tree.read().fill_batch(from, forward, n, out, |v| Some(layout::vaddr_bytes(untv(*v).0)))
    }
}

/// Entries ahead of the current one whose memo set (`crate::pm::checked`) is prefetched.
const PREFETCH_MEMO: isize = 6;
/// Entries ahead of the current one whose record header is prefetched, unless the memo
/// knows a record there (its length then comes from the memo: nothing of it is read).
const PREFETCH_HEAD: isize = 5;
/// Entries ahead of the current one whose whole record is prefetched (its header, fetched
/// two moves earlier, gives the length), unless the memo knows a record there.
const PREFETCH_RECORD: isize = 3;

/// How much of a record [`AddrCursor::prefetch_at`] asks for.
#[derive(Clone, Copy)]
enum Ahead {
    Head,
    Memo,
    Record,
}

/// A read-ahead cursor as an [`InternalIterator`] of key → address bytes. Values sit in
/// the value log in write order, not key order, so each step of a walk reads a record far
/// from the last: the cursor prefetches the records of the entries it will step onto.
struct AddrCursor<S: BatchSource<V = Addr>> {
    cur: ReadAhead<S>,
    inner: Arc<Inner>,
    pools: Vec<Option<PoolInfo>>,
}

impl<S: BatchSource<V = Addr>> AddrCursor<S> {
    fn new(src: S, inner: &Arc<Inner>) -> Self {
        AddrCursor { cur: ReadAhead::new(src), inner: inner.clone(), pools: Vec::new() }
    }

    /// The record of the entry `ahead` entries away: its header, its memo set, or all of it.
    fn prefetch_at(&mut self, ahead: isize, what: Ahead) {
        let Some(Some(b)) = self.cur.peek(ahead).copied() else { return };
        let Some(a) = layout::vaddr_from(&b) else { return };
        let (no, off) = layout::split_vaddr(a);
        let info = match self.pools.get(no as usize) {
            Some(Some(p)) => *p,
            _ => {
                let Ok(p) = self.inner.vlog.pool_info(&self.inner.region, a) else { return };
                if self.pools.len() <= no as usize {
                    self.pools.resize(no as usize + 1, None);
                }
                if let Some(slot) = self.pools.get_mut(no as usize) {
                    *slot = Some(p);
                }
                p
            }
        };
        let at = info.addr + u64::from(off);
        let region = &self.inner.region;
        match what {
            Ahead::Memo => return region.checked().prefetch(at),
            // A record verified here before is placed from the memo: none of it is read.
            _ if region.checked().knows(at) => return,
            Ahead::Head => return region.prefetch(at, 4),
            Ahead::Record => {}
        }
        // The address came from a source after this iterator pinned the value log, so
        // its pool is not reused: the header read is of a written record (its length is
        // only a hint here; `Vlog::locate_once` verifies the record when it is read).
        let Some(h) = region.slice(at, 4) else { return };
        let size = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let room = u64::from(info.cap).saturating_sub(u64::from(off)) as usize;
        region.prefetch(at, (size + layout::RECORD_OVERHEAD as usize).min(room));
    }

    fn prefetch(&mut self, dir: isize) {
        if self.cur.valid() {
            self.prefetch_at(PREFETCH_RECORD * dir, Ahead::Record);
            self.prefetch_at(PREFETCH_HEAD * dir, Ahead::Head);
            self.prefetch_at(PREFETCH_MEMO * dir, Ahead::Memo);
        }
    }
}

impl<S: BatchSource<V = Addr>> InternalIterator for AddrCursor<S> {
    fn valid(&self) -> bool {
        self.cur.valid()
    }
    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.cur.seek(key);
        for d in 0..=PREFETCH_MEMO {
            self.prefetch_at(d, Ahead::Memo);
        }
        for d in 1..PREFETCH_HEAD {
            self.prefetch_at(d, Ahead::Head);
        }
        Ok(())
    }
    fn seek_to_first(&mut self) -> Result<()> {
        self.cur.seek_to_first();
        self.prefetch(1);
        Ok(())
    }
    fn seek_to_last(&mut self) -> Result<()> {
        self.cur.seek_to_last();
        self.prefetch(-1);
        Ok(())
    }
    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.cur.seek_for_prev(key);
        for d in 0..=PREFETCH_MEMO {
            self.prefetch_at(-d, Ahead::Memo);
        }
        for d in 1..PREFETCH_HEAD {
            self.prefetch_at(-d, Ahead::Head);
        }
        Ok(())
    }
    fn next(&mut self) -> Result<()> {
        self.cur.next();
        self.prefetch(1);
        Ok(())
    }
    fn prev(&mut self) -> Result<()> {
        self.cur.prev();
        self.prefetch(-1);
        Ok(())
    }
    fn key(&self) -> &[u8] {
        self.cur.key()
    }
    fn value(&self) -> Option<&[u8]> {
        self.cur.val().and_then(|a| a.as_ref()).map(|a| &a[..])
    }
}

/// The store's entries: the sources merged (newest first) to key → address, and each
/// current address resolved to its value record in the value log, verified and borrowed
/// from PM.
pub(crate) struct HpdkIter {
    inner: Arc<Inner>,
    src: BoxedIter,
    /// This iterator's registration with the value log: no pool it may read is reused
    /// until it is dropped.
    epoch: u64,
    /// Pools met so far (stable while pinned: a pool changes only when reused).
    pools: Vec<Option<PoolInfo>>,
    /// Where the current value's bytes are in PM (None: invalid, or a delete).
    val: Option<(u64, usize)>,
    /// False after a move failed (the iterator is then invalid).
    ok: bool,
}

impl std::fmt::Debug for HpdkIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HpdkIter").field("epoch", &self.epoch).field("valid", &self.valid()).finish()
    }
}

impl Drop for HpdkIter {
    fn drop(&mut self) {
        self.inner.vlog.unpin(self.epoch);
    }
}

impl HpdkIter {
    /// A cursor over the store as `inner` holds it now.
    pub(crate) fn new(inner: &Arc<Inner>) -> HpdkIter {
        // Pin first: every address read from here on is of a pool referenced at or after
        // this moment, which therefore cannot be reused while the iterator lives.
        let epoch = inner.vlog.pin();
        let (active, imm) = {
            let m = inner.mem.read();
            (m.active.clone(), m.imm.clone())
        };
        // Newest first. A source empty now holds only keys written after this moment,
        // which the contract lets the iterator miss: it is left out.
        let mut children: Vec<BoxedIter> = Vec::with_capacity(3);
        for m in std::iter::once(active).chain(imm) {
            if !m.map.read().is_empty() {
                children.push(Box::new(AddrCursor::new(MemSource(m), inner)));
            }
        }
        if inner.opts.use_btree {
            if !inner.tree.read().is_empty() {
                children.push(Box::new(AddrCursor::new(TreeSource(inner.clone()), inner)));
            }
        } else {
            // HPDK-NT: level 0, newest table first (it runs no merge, so no table is freed
            // under the iterator).
            for t in inner.level_newest_first() {
                children.push(Box::new(TableIter::new(t.table.clone(), false)));
            }
        }
        let src: BoxedIter = if children.len() == 1 {
            children.pop().unwrap_or_else(|| Box::new(crate::iter::VecIter::from_vec(Vec::new())))
        } else {
            Box::new(MergingIterator::new(children))
        };
        HpdkIter { inner: inner.clone(), src, epoch, pools: Vec::new(), val: None, ok: true }
    }

    /// The pool address `a` names, from the cache or the value log's table.
    fn pool(&mut self, a: u64) -> Result<PoolInfo> {
        let no = layout::split_vaddr(a).0 as usize;
        if let Some(Some(p)) = self.pools.get(no) {
            return Ok(*p);
        }
        let p = self.inner.vlog.pool_info(&self.inner.region, a)?;
        if self.pools.len() <= no {
            self.pools.resize(no + 1, None);
        }
        if let Some(slot) = self.pools.get_mut(no) {
            *slot = Some(p);
        }
        Ok(p)
    }

    /// After a move: resolve the current entry's value, or record the failure.
    fn settle(&mut self, r: Result<()>) -> Result<()> {
        self.val = None;
        let r = r.and_then(|()| {
            if !self.src.valid() {
                return Ok(());
            }
            let Some(b) = self.src.value() else { return Ok(()) };
            let a = layout::vaddr_from(b).ok_or_else(|| {
                self.inner
                    .region
                    .corruption(0, format!("malformed value address for key {}", crate::escape(self.src.key())))
            })?;
            let info = self.pool(a)?;
            self.val = Some(Vlog::locate_once(&self.inner.region, &info, a)?);
            Ok(())
        });
        self.ok = r.is_ok();
        r
    }
}

impl InternalIterator for HpdkIter {
    fn valid(&self) -> bool {
        self.ok && self.src.valid()
    }
    fn seek(&mut self, key: &[u8]) -> Result<()> {
        let r = self.src.seek(key);
        self.settle(r)
    }
    fn seek_to_first(&mut self) -> Result<()> {
        let r = self.src.seek_to_first();
        self.settle(r)
    }
    fn seek_to_last(&mut self) -> Result<()> {
        let r = self.src.seek_to_last();
        self.settle(r)
    }
    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        let r = self.src.seek_for_prev(key);
        self.settle(r)
    }
    fn next(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        let r = self.src.next();
        self.settle(r)
    }
    fn prev(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        let r = self.src.prev();
        self.settle(r)
    }
    fn key(&self) -> &[u8] {
        if self.ok {
            self.src.key()
        } else {
            &[]
        }
    }
    fn value(&self) -> Option<&[u8]> {
        let (at, len) = self.val?;
        // `settle` verified the record at this range (so it lies in the region), and the
        // pool is pinned: the bytes stay as verified while this iterator lives.
        self.inner.region.slice(at, len)
    }
}

/// Checks shared by the iterator tests of the presets built on [`crate::index::bplus`].
#[cfg(test)]
pub(crate) mod check {
    use std::collections::BTreeMap;

    use rand::rngs::SmallRng;
    use rand::Rng;

    use crate::iter::InternalIterator;

    pub(crate) type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    /// Step over deletes in the direction of travel (as the public iterator does).
    fn skip(it: &mut dyn InternalIterator, forward: bool) {
        while it.valid() && it.value().is_none() {
            if forward {
                it.next().unwrap();
            } else {
                it.prev().unwrap();
            }
        }
    }

    /// Every live entry, forward then backward, must equal the model.
    pub(crate) fn full_walks(it: &mut dyn InternalIterator, model: &Model) {
        let want: Vec<(Vec<u8>, Vec<u8>)> = model.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut got = Vec::new();
        it.seek_to_first().unwrap();
        skip(it, true);
        while it.valid() {
            got.push((it.key().to_vec(), it.value().unwrap_or_default().to_vec()));
            it.next().unwrap();
            skip(it, true);
        }
        assert_eq!(got.len(), want.len(), "forward walk: entry count");
        assert!(got == want, "forward walk differs from the model");
        let mut back = Vec::new();
        it.seek_to_last().unwrap();
        skip(it, false);
        while it.valid() {
            back.push((it.key().to_vec(), it.value().unwrap_or_default().to_vec()));
            it.prev().unwrap();
            skip(it, false);
        }
        back.reverse();
        assert!(back == want, "backward walk differs from the model");
    }

    /// Walk on from where a `seek(from)` made before left `it`: the rest of the model.
    pub(crate) fn continue_forward(it: &mut dyn InternalIterator, model: &Model, from: &[u8]) {
        skip(it, true);
        for (k, v) in model.range::<[u8], _>((std::ops::Bound::Included(from), std::ops::Bound::Unbounded)) {
            assert!(it.valid(), "ended early");
            assert_eq!(it.key(), k.as_slice());
            assert!(it.value() == Some(v.as_slice()), "value differs");
            it.next().unwrap();
            skip(it, true);
        }
        assert!(!it.valid(), "entries past the model's last");
    }

    /// `steps` random moves (seeks of every kind, next, prev, direction changes), each
    /// compared with the model's position.
    pub(crate) fn random_moves(it: &mut dyn InternalIterator, model: &Model, rng: &mut SmallRng, steps: usize) {
        let want: Vec<(&Vec<u8>, &Vec<u8>)> = model.iter().collect();
        it.seek_to_first().unwrap();
        skip(it, true);
        let mut pos: Option<usize> = (!want.is_empty()).then_some(0);
        for step in 0..steps {
            let probe = |rng: &mut SmallRng| -> Vec<u8> {
                if !want.is_empty() && rng.random_bool(0.5) {
                    let k = want[rng.random_range(0..want.len())].0.clone();
                    if rng.random_bool(0.5) {
                        return k;
                    }
                    let mut k = k;
                    k.push(0);
                    return k;
                }
                format!("k{:05}", rng.random_range(0..3000u32)).into_bytes()
            };
            let what;
            match rng.random_range(0..16) {
                0..=5 => {
                    what = "next";
                    if pos.is_some() {
                        it.next().unwrap();
                        skip(it, true);
                        pos = pos.map(|p| p + 1).filter(|&p| p < want.len());
                    }
                }
                6..=11 => {
                    what = "prev";
                    if pos.is_some() {
                        it.prev().unwrap();
                        skip(it, false);
                        pos = pos.and_then(|p| p.checked_sub(1));
                    }
                }
                12 => {
                    what = "seek";
                    let k = probe(rng);
                    it.seek(&k).unwrap();
                    skip(it, true);
                    let p = want.partition_point(|e| *e.0 < k);
                    pos = (p < want.len()).then_some(p);
                }
                13 => {
                    what = "seek_for_prev";
                    let k = probe(rng);
                    it.seek_for_prev(&k).unwrap();
                    skip(it, false);
                    pos = want.partition_point(|e| *e.0 <= k).checked_sub(1);
                }
                14 => {
                    what = "seek_to_first";
                    it.seek_to_first().unwrap();
                    skip(it, true);
                    pos = (!want.is_empty()).then_some(0);
                }
                _ => {
                    what = "seek_to_last";
                    it.seek_to_last().unwrap();
                    skip(it, false);
                    pos = want.len().checked_sub(1);
                }
            }
            assert_eq!(it.valid(), pos.is_some(), "step {step} ({what})");
            if let Some(p) = pos {
                assert_eq!(it.key(), want[p].0.as_slice(), "step {step} ({what})");
                assert!(it.value() == Some(want[p].1.as_slice()), "step {step} ({what}): value differs");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::check::{full_walks, random_moves, Model};
    use crate::batch::BatchOp;
    use crate::engine::hpdk::Hpdk;
    use crate::engine::{Cond, Engine};
    use crate::fs::FaultFs;
    use crate::options::{HpdkOptions, Options, Preset};
    use crate::pm::sim::SimDevice;

    fn opts(dev: &SimDevice, fs: &FaultFs, h: HpdkOptions) -> Options {
        crate::testing::sim_options(Preset::Hpdk, dev, fs).hpdk(h)
    }

    fn open(o: &Options, fs: &FaultFs, fresh: bool) -> Hpdk {
        Hpdk::open(crate::engine::test_ctx(o, fs, fresh, 7)).unwrap()
    }

    fn key(i: u32) -> Vec<u8> {
        format!("k{i:05}").into_bytes()
    }

    fn value(k: &[u8], ver: u64, rng: &mut SmallRng) -> Vec<u8> {
        crate::iter::versioned_value(k, ver, rng, 600)
    }

    fn design(e: &Hpdk, name: &str) -> u64 {
        e.stats().design.get(name).copied().unwrap_or_else(|| panic!("no design figure {name}"))
    }

    /// Random puts, deletes and batches with flushes and merges in between.
    fn churn(e: &Hpdk, m: &mut Model, rng: &mut SmallRng, ops: usize, keys: u32, ver: &mut u64) {
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
            match i % 97 {
                13 => e.flush().unwrap(),
                61 => e.compact().unwrap(),
                _ => {}
            }
        }
    }

    fn configs() -> Vec<(&'static str, HpdkOptions)> {
        let small = crate::testing::hpdk_small();
        vec![
            ("hpdk", small.clone()),
            ("hpdk-nt", HpdkOptions { use_btree: false, ..small.clone() }),
            ("hpdk-ngc", HpdkOptions { enable_merge: false, ..small }),
        ]
    }

    /// (a) The iterator against a model: random writes with flushes, merges and pool reuse,
    /// then random interleavings of every move, before and after a close and reopen.
    #[test]
    fn iterator_matches_model() {
        for (name, h) in configs() {
            let (dev, fs) = (SimDevice::new(), FaultFs::new());
            let o = opts(&dev, &fs, h);
            let mut rng = SmallRng::seed_from_u64(name.len() as u64);
            let mut m = Model::new();
            let mut ver = 0;
            let e = open(&o, &fs, true);
            for round in 0..4 {
                churn(&e, &mut m, &mut rng, 600, 300, &mut ver);
                let mut it = e.iter().unwrap();
                let all = crate::iter::collect_forward(&mut *it).unwrap();
                let live: Vec<(Vec<u8>, Vec<u8>)> = all.into_iter().filter_map(|(k, v)| Some((k, v?))).collect();
                assert!(live.iter().eq(m.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<Vec<_>>().iter()));
                full_walks(&mut *it, &m);
                random_moves(&mut *it, &m, &mut rng, 3000);
                let got =
                    crate::iter::collect_range(&mut *it, std::ops::Bound::Unbounded, std::ops::Bound::Unbounded, 50)
                        .unwrap();
                let want: Vec<(Vec<u8>, Vec<u8>)> = m.iter().take(50).map(|(k, v)| (k.clone(), v.clone())).collect();
                assert_eq!(got, want, "{name} round {round}: collect_range");
            }
            if name == "hpdk" {
                assert!(design(&e, "merges") > 0, "merges ran");
                assert!(design(&e, "value_pools_reused") > 0, "pools were reused");
            }
            e.close().unwrap();
            drop(e);
            let e = open(&o, &fs, false);
            let mut it = e.iter().unwrap();
            full_walks(&mut *it, &m);
            random_moves(&mut *it, &m, &mut rng, 2000);
            // A bounded scan, as a loop over the iterator.
            let lo = key(300);
            let hi = key(500);
            let got = crate::iter::collect_range(
                &mut *e.iter().unwrap(),
                std::ops::Bound::Excluded(&lo),
                std::ops::Bound::Included(&hi),
                1000,
            )
            .unwrap();
            let want: Vec<(Vec<u8>, Vec<u8>)> = m
                .range::<[u8], _>((std::ops::Bound::Excluded(&lo[..]), std::ops::Bound::Included(&hi[..])))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            assert_eq!(got, want, "{name}: bounded scan after reopen");
        }
    }

    /// A walk verifies each value record it meets once per open region: walking the same
    /// store again verifies nothing more (the values still match the model), and a reopen
    /// verifies them again.
    #[test]
    fn walks_verify_each_record_once_per_open() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let mut o = opts(&dev, &fs, crate::testing::hpdk_small());
        // PM reads are counted through the emulated read latency (1 ns per access).
        o.pm_read_latency_ns = 1;
        let e = open(&o, &fs, true);
        let mut rng = SmallRng::seed_from_u64(8);
        let (mut m, mut ver) = (Model::new(), 0);
        churn(&e, &mut m, &mut rng, 500, 300, &mut ver);
        let verified = |e: &Hpdk| e.inner.region.checked().verified();
        let reads = |e: &Hpdk| e.inner.region.stats().delayed_reads;
        let key_walk = |e: &Hpdk| {
            let mut it = e.iter().unwrap();
            it.seek_to_first().unwrap();
            let mut n = 0;
            while it.valid() {
                n += usize::from(m.contains_key(it.key()));
                it.next().unwrap();
            }
            assert_eq!(n, m.len());
        };
        assert_eq!(verified(&e), 0, "point reads and writes do not use the memo");
        full_walks(&mut *e.iter().unwrap(), &m);
        let first = verified(&e);
        assert!(first >= m.len() as u64, "every live value was verified ({first} checks, {} keys)", m.len());
        full_walks(&mut *e.iter().unwrap(), &m);
        random_moves(&mut *e.iter().unwrap(), &m, &mut rng, 500);
        assert_eq!(verified(&e), first, "the second walk verified nothing");
        // Known records are placed from the memo: a walk that does not read the values'
        // bytes reads no PM at all (`value()` borrows through a PM read).
        let before = reads(&e);
        key_walk(&e);
        assert_eq!(reads(&e), before, "a walk over known records read PM");
        full_walks(&mut *e.iter().unwrap(), &m);
        assert!(reads(&e) > before, "and `value()` does read it");
        e.close().unwrap();
        drop(e);
        let e = open(&o, &fs, false);
        assert_eq!(verified(&e), 0);
        full_walks(&mut *e.iter().unwrap(), &m);
        assert!(verified(&e) >= m.len() as u64, "a reopen verifies again");
    }

    /// (b) An iterator created before a flush and a merge that free the tables and
    /// MemTables it was created over, and rewrite the tree, still returns exactly the
    /// model; and the value pools it may read are not reused under it while other keys
    /// are overwritten, though they are once it is dropped.
    #[test]
    fn iterator_survives_flush_merge_and_pool_reuse() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = opts(&dev, &fs, crate::testing::hpdk_small());
        let e = open(&o, &fs, true);
        let mut rng = SmallRng::seed_from_u64(3);
        let mut m = Model::new();
        let mut ver = 0;
        churn(&e, &mut m, &mut rng, 800, 600, &mut ver);
        let merges = design(&e, "merges");
        let freed = design(&e, "merge_input_tables");
        // Part 1: no writes while it lives; the flush and merge rewrite what it reads.
        let mut it = e.iter().unwrap();
        it.seek(&key(100)).unwrap();
        e.flush().unwrap();
        e.compact().unwrap();
        assert!(design(&e, "merges") > merges && design(&e, "merge_input_tables") > freed, "a merge freed tables");
        super::check::continue_forward(&mut *it, &m, &key(100));
        random_moves(&mut *it, &m, &mut rng, 1500);
        full_walks(&mut *it, &m);
        drop(it);

        // Part 2: keys with an even number stay; the odd ones are overwritten and deleted
        // many times while the iterator walks, which makes the pools holding their old
        // values idle while the iterator holds their addresses (read ahead in a batch).
        let odd = |k: &[u8]| k.last().is_some_and(|b| (b - b'0') % 2 == 1);
        let stable: Model = m.iter().filter(|(k, _)| !odd(k)).map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut it = e.iter().unwrap();
        it.seek_to_first().unwrap();
        let mut got = Vec::new();
        let mut seen_other: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        let deferred = design(&e, "value_pool_reuse_deferred_by_iterators");
        let mut round = 0;
        while it.valid() {
            let k = it.key().to_vec();
            if let Some(v) = it.value() {
                if odd(&k) {
                    seen_other.insert(k, v.to_vec());
                } else {
                    got.push((k, v.to_vec()));
                }
            }
            it.next().unwrap();
            if round < 40 {
                round += 1;
                for i in (1..600u32).step_by(2) {
                    ver += 1;
                    let k = key(i);
                    if rng.random_bool(0.3) {
                        e.write(&[BatchOp::Delete { key: k }], Cond::None).unwrap();
                    } else {
                        let v = value(&k, ver, &mut rng);
                        e.write(&[BatchOp::Put { key: k, value: v }], Cond::None).unwrap();
                    }
                }
                e.compact().unwrap();
            }
        }
        let want: Vec<(Vec<u8>, Vec<u8>)> = stable.into_iter().collect();
        assert!(got == want, "stable keys differ from the model");
        // Keys written meanwhile show one of their versions: the value names its key.
        for (k, v) in &seen_other {
            let prefix = format!("{}:", String::from_utf8_lossy(k));
            assert!(v.starts_with(prefix.as_bytes()), "a value that is no version of its key");
        }
        assert!(
            design(&e, "value_pool_reuse_deferred_by_iterators") > deferred,
            "an idle pool was kept for the iterator"
        );
        drop(it);
        let reused = design(&e, "value_pools_reused");
        for r in 0..20u64 {
            for i in (1..600u32).step_by(2) {
                let k = key(i);
                let v = value(&k, 1_000_000 + r, &mut rng);
                e.write(&[BatchOp::Put { key: k, value: v }], Cond::None).unwrap();
            }
            e.compact().unwrap();
        }
        assert!(design(&e, "value_pools_reused") > reused, "pools are reused again once no iterator lives");
    }

    /// (c) Writers change a disjoint key set (with background flushes and merges) while
    /// iterators walk both ways: every untouched key is returned exactly once, in order,
    /// with its value.
    #[test]
    fn concurrent_writers_do_not_disturb_untouched_keys() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = opts(&dev, &fs, HpdkOptions { background: true, ..crate::testing::hpdk_small() });
        let e = Arc::new(open(&o, &fs, true));
        let mut rng = SmallRng::seed_from_u64(5);
        // Stable keys are even, written once before; writers own the odd ones.
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
                    let mut rng = SmallRng::seed_from_u64(100 + t);
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) || n < 2000 {
                        let k = key(rng.random_range(0..1000u32) * 2 + 1);
                        if rng.random_bool(0.3) {
                            e.write(&[BatchOp::Delete { key: k }], Cond::None).unwrap();
                        } else {
                            let v = value(&k, n, &mut rng);
                            e.write(&[BatchOp::Put { key: k, value: v }], Cond::None).unwrap();
                        }
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let even = |k: &[u8]| k.last().is_some_and(|b| (b - b'0').is_multiple_of(2));
        let want: Vec<(Vec<u8>, Vec<u8>)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for pass in 0..6 {
            let mut it = e.iter().unwrap();
            let mut got = Vec::new();
            let forward = pass % 2 == 0;
            if forward {
                it.seek_to_first().unwrap();
            } else {
                it.seek_to_last().unwrap();
            }
            let mut last: Option<Vec<u8>> = None;
            while it.valid() {
                let k = it.key().to_vec();
                if let Some(l) = &last {
                    assert!(if forward { k > *l } else { k < *l }, "pass {pass}: keys out of order");
                }
                if even(&k) {
                    got.push((k.clone(), it.value().map(<[u8]>::to_vec).unwrap_or_default()));
                } else if let Some(v) = it.value() {
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
        assert!(design(&e, "flushes") > 0, "flushes ran during the walks");
    }
}
