//! The `lightkv` preset: LightKV (Han, Jiang, Xiong, MSST 2020, `papers/lightkv.txt`).
//!
//! # What runs here
//! - **RH-Tree** (§III-B..E) — [`crate::index::rhtree`]: radix inner nodes on 8-bit key
//!   chunks over hash leaf nodes of 64-byte buckets; normal and level splits decided from the
//!   cache slots; MAX_LEAF_NODES, after which a full leaf gets a linked successor.
//! - **Persistent write buffer** (§III-A/D) — [`pwb`]: one append-only PM segment (4 MiB) per
//!   partition; a put appends its checksummed record, persists it, and updates the top leaf.
//!   No WAL: the write buffer is the log. Writers of different partitions append, persist
//!   and index in parallel, each in its partition's *lane* (see "Write path" in [`store`]).
//! - **Flush** (Fig. 6) and **partition compaction** (§III-F) — [`store`]: a full leaf that
//!   cannot split is linked behind a fresh top leaf and queued; the flush thread sorts its
//!   records into an SSTable, copies the leaf to PM pointing at the table, and swaps it in
//!   with one 8-byte commit once the table is durable. CS (4) leaves of equal compaction
//!   weight are merged by the compaction thread into one of weight + 1. Two background
//!   threads, as in the paper's evaluation.
//! - **Placement** (§III-E, §VI-F) — [`crate::LightkvPlacement`]: radix tree and top leaves in
//!   DRAM, linked leaves searched in PM (LightKV); everything in DRAM (LightKV_DRAM); every
//!   leaf searched in PM, top leaves' changed buckets persisted to PM images (LightKV_PM).
//! - **Recovery** (§V): the chain directory gives the PM leaves and tables as they are; the
//!   DRAM part is rebuilt by scanning the write buffer, or restored from the image a clean
//!   close writes (`restored_from_image` in stats).
//!
//! # Range reads: the iterator
//! [`Engine::iter`] ([`iter`]) is a [`crate::iter::MergingIterator`] of two sources, the
//! newer first (a write-buffer record is always newer than every table entry of its key:
//! flushes move the oldest DRAM leaf into the newest table):
//! - **The write buffer in key order** ([`iter::BufferIter`]). The RH-Tree's hash leaves
//!   cannot answer a range, so the store keeps a *sorted view* ([`view::SortedView`]): a
//!   DRAM B-tree of every key a DRAM leaf (top or unflushed) indexes, mapped to its newest
//!   record's write-buffer address. The first iterator builds it from the DRAM leaves (one
//!   pass, one sort); from then on every write updates it (one B-tree descent; a key copy
//!   only when the key is new to the view), so a range read never sorts a partition's
//!   write buffer (the old scan did, after every write). After many writes with no range
//!   read (more than the view's keys, at least 65,536) and no iterator open, the next write
//!   drops it again: a store that takes no range reads pays nothing for it on puts (keeping
//!   it on every write had halved `fillrandom`). One view serves all partitions (their keys
//!   are disjoint) and is unaffected by splits.
//!   The cursor holds no lock between calls: each refill takes the state lock for reading,
//!   copies up to 8 record *addresses* after the current key (doubling to 256 while the
//!   walk goes on in one direction), and lets go; entries added or removed meanwhile are
//!   met or not (only keys written meanwhile can be affected). Keys and values are
//!   borrowed from the records in PM, each record's checksum verified the first time a
//!   cursor of this open store reaches it (remembered in [`crate::pm::checked`]: later
//!   walks read only its header and key; the record three entries ahead is prefetched:
//!   records sit in write order);
//!   nothing is copied per entry but the address.
//! - **The chained partitions' SSTables** ([`iter::TableWalker`]): the radix tree's key
//!   ranges in key order ([`crate::index::rhtree::RhTree::ranges`] — a partition whose
//!   byte values have holes has one range per run), those of partitions with PM leaves
//!   kept with their tables, newest first. The walk opens a range's tables when it enters
//!   it — one [`crate::sstable::TableIter`] (one pinned, verified block at a time, entries
//!   borrowed from it), or several merged — and at its end moves to the next range
//!   (backwards likewise). The list is fixed when the iterator is created (cached in the
//!   store until a chain commit or a split) and holds `Arc<Table>`s: a compaction that
//!   deletes a table leaves the iterator's handle readable.
//!
//! What is pinned, and how background work goes on meanwhile ([`view`]): the iterator
//! registers a *pin* (a stamp counter value) with its table list, under one state-lock
//! acquisition (a read lock; a write lock only when it must build the view first). A
//! flush that commits later *retires* its records' view entries instead of removing them:
//! older iterators (whose table list lacks the new table) still read them, newer ones skip
//! them; they go once no older pin remains. A write-buffer segment freed later is cleared
//! in PM at once (a crash forgets it) but its extent returns to the PM heap, where it
//! could be overwritten, only once every older iterator is dropped. Tables are pinned by
//! the `Arc<Table>`s of the list, each holding its open file: a compaction that deletes a
//! table's file leaves it readable to the iterators that listed it. So flushes,
//! compactions and writers never wait for an iterator (the lock is held for a refill or a
//! registration, never between calls), and an iterator never reads a reused byte; a
//! long-lived iterator only delays the reuse of freed PM and the removal of retired view
//! entries (`deferred_segment_frees`, `deferred_view_entries`, `iterators_open` in stats;
//! `sorted_view_active`, `sorted_view_builds` show the view's state).
//!
//! Cost: seek — one B-tree descent under a read lock, a binary search of the ranges and a
//! block index search per table of the partition, a block read (cached) each; next —
//! amortised O(1): an address from the batch, a PM entry's checksum, a step in a pinned
//! block, and the merge's key comparisons (a refill per 256 buffer entries). Reverse steps
//! cost the same. The first iterator after an idle spell pays the build — every
//! DRAM-indexed key read once, one sort — under the state write lock (writers wait for
//! it); it comes at most once per view-size writes, so it adds O(log n) per write
//! amortised. While active the view costs a write one B-tree update and DRAM: the
//! buffered keys plus about 56 bytes each (`sorted_view_bytes`, counted in the DRAM index
//! figure).
//!
//! # Shutdown
//! `close()` and drop set the store's [`crate::jobs::Cancel`] before joining the workers.
//! A partition compaction checks it at its first merged entry and every 256 after, and
//! before each further compaction of a chain; the output leaf and the chain record (the
//! commit) come after the table is written, so a cancelled compaction has made only its
//! table, which it deletes (`jobs_cancelled`). Leaf flushes are not cancelled (one
//! segment each, and close flushes anyway).
//!
//! # Choices where the paper is silent
//! See docs/design/lightkv.md. In short: deletes index a tombstone record (dropped when a
//! compaction reaches the partition's oldest table); a batch is one write-buffer record in
//! the first key's partition's segment; a write larger than a segment gets a segment of its
//! own size; writers wait when more than [`store::MAX_PENDING_FLUSHES`] leaves are queued
//! for flushing (once `close` stopped the flush thread, such a write fails with `Closed`
//! instead); a partition that has linked leaves never splits, so a hot key range grows a
//! longer chain (compaction keeps it at about CS × log_CS(N) leaves; `chain_length_max` in
//! stats shows it).

pub(crate) mod iter;
pub mod leaf;
pub mod pwb;
pub(crate) mod salvage;
pub mod store;
pub(crate) mod view;

use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::batch::BatchOp;
use crate::engine::{open_region, Cond, Engine, EngineCtx};
use crate::error::Result;
use crate::index::rhtree::RhOptions;
use crate::stats::Stats;
use store::{PwbStore, StoreConfig};

/// The LightKV engine. See the module docs.
pub struct Lightkv {
    store: Arc<PwbStore>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Lightkv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lightkv").field("store", &self.store).finish()
    }
}

impl Lightkv {
    /// Open (or create, when `ctx.fresh`) a LightKV store.
    pub fn open(ctx: EngineCtx) -> Result<Lightkv> {
        let o = &ctx.opts.lightkv;
        let cfg = StoreConfig {
            seg_size: o.segment_size,
            tree: RhOptions { leaf_buckets: o.leaf_buckets, t_normal: o.t_normal, max_leaf_nodes: o.max_leaf_nodes },
            compaction_size: o.compaction_size,
            placement: o.placement,
            block_size: o.block_size,
            block_cache: o.block_cache_size,
            background: o.background,
            job_probe: ctx.opts.job_probe.clone(),
        };
        let region = Arc::new(open_region(&ctx)?);
        let store = Arc::new(PwbStore::open(region, Arc::new(ctx.fs.clone()), &ctx.dir, ctx.fresh, cfg)?);
        let mut workers = Vec::new();
        if store.config().background {
            for (name, compactor) in [("tierkv-lightkv-flush", false), ("tierkv-lightkv-compact", true)] {
                let s = store.clone();
                workers.push(std::thread::Builder::new().name(name.into()).spawn(move || worker_loop(s, compactor))?);
            }
        }
        Ok(Lightkv { store, workers: Mutex::new(workers) })
    }

    fn stop_workers(&self) {
        self.store.cancel.cancel();
        self.store.work.lock().stop = true;
        self.store.work_cv.notify_all();
        for h in self.workers.lock().drain(..) {
            let _ = h.join();
        }
        self.store.notify_flushed();
    }

    /// Flush every queued leaf in the calling thread; compactions they make due are queued
    /// for the compaction thread (or run here without background threads).
    fn drain_flushes(&self) -> Result<()> {
        while let Some(slot) = self.store.flush_one()? {
            self.after_flush(slot)?;
        }
        Ok(())
    }

    fn after_flush(&self, slot: u64) -> Result<()> {
        if self.workers.lock().is_empty() {
            self.store.compact_chain(slot)?;
        } else {
            let mut w = self.store.work.lock();
            w.compact.push_back(slot);
            self.store.work_cv.notify_all();
        }
        Ok(())
    }
}

impl Drop for Lightkv {
    fn drop(&mut self) {
        self.stop_workers();
    }
}

fn worker_loop(s: Arc<PwbStore>, compactor: bool) {
    loop {
        let slot = {
            let mut w = s.work.lock();
            loop {
                if w.stop {
                    return;
                }
                if compactor {
                    if let Some(slot) = w.compact.pop_front() {
                        break Some(slot);
                    }
                } else if s.pending_flushes() > 0 {
                    break None;
                }
                s.work_cv.wait_for(&mut w, std::time::Duration::from_millis(50));
            }
        };
        if s.poisoned.is_set() {
            s.notify_flushed();
            return;
        }
        let what = if compactor { "compaction" } else { "flush" };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<()> {
            match slot {
                Some(slot) => s.compact_chain(slot).map(|_| ()),
                None => {
                    if let Some(slot) = s.flush_one()? {
                        let mut w = s.work.lock();
                        w.compact.push_back(slot);
                        s.work_cv.notify_all();
                    }
                    Ok(())
                }
            }
        }));
        match r {
            Ok(r) => s.cancel.poison_failure(&s.poisoned, &format!("background {what}"), &r),
            Err(_) => s.poisoned.set(format!("background {what} panicked")),
        }
        s.notify_flushed();
    }
}

impl Engine for Lightkv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.store.get(key)
    }

    fn get_with(&self, key: &[u8], f: &mut dyn FnMut(&[u8])) -> Result<bool> {
        self.store.get_with(key, f)
    }

    fn write(&self, ops: &[BatchOp], cond: Cond) -> Result<bool> {
        let pops: Vec<pwb::Op<'_>> = ops
            .iter()
            .map(|o| match o {
                BatchOp::Put { key, value } => (pwb::Kind::Put, key.as_slice(), value.as_slice()),
                BatchOp::Delete { key } => (pwb::Kind::Delete, key.as_slice(), &[][..]),
            })
            .collect();
        self.store.write_batch(&pops, cond)
    }

    fn iter(&self) -> Result<crate::iter::BoxedIter> {
        self.store.iter()
    }

    fn flush(&self) -> Result<()> {
        self.store.poisoned.check()?;
        self.drain_flushes()
    }

    fn compact(&self) -> Result<()> {
        self.store.poisoned.check()?;
        self.drain_flushes()?;
        for slot in self.store.chain_slots() {
            self.store.compact_chain(slot)?;
        }
        Ok(())
    }

    fn stats(&self) -> Stats {
        let s = &self.store;
        let c = s.stats();
        let mut design: Vec<(&str, u64)> = vec![
            ("flushes", c.flushes),
            ("flush_bytes", c.flush_bytes),
            ("compactions", c.compactions),
            ("compaction_bytes", c.compaction_bytes),
            ("compaction_dropped_entries", c.compaction_dropped),
            ("segments_freed", c.segments_freed),
            ("recovered_records", c.recovered_records),
            ("recovered_skipped", c.recovered_skipped),
            ("restored_from_image", c.restored_from_image),
            ("image_rejected", c.image_rejected),
            ("write_stalls", c.write_stalls),
            ("pm_leaf_probes", c.pm_leaf_probes),
            ("jobs_cancelled", s.cancel.jobs_cancelled()),
        ];
        let shape = s.shape();
        let figure = |name: &str| shape.iter().find(|x| x.0 == name).map_or(0, |x| x.1);
        // DRAM: the leaves and the write buffer's sorted view (range reads).
        let dram = figure("dram_leaf_bytes") + figure("sorted_view_bytes");
        design.extend(shape);
        let keys = s.live_keys().unwrap_or(0);
        Stats::engine("lightkv", s.region().stats(), s.user_bytes(), keys, dram, &design)
    }

    fn check(&self) -> Result<Vec<String>> {
        self.store.check()
    }

    fn close(&self) -> Result<()> {
        self.store.poisoned.check()?;
        self.drain_flushes()?;
        self.stop_workers();
        self.store.poisoned.check()?;
        self.store.write_image()?;
        self.store.region().sync_all()?;
        Ok(())
    }
}

#[cfg(test)]
mod close_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::sync::Arc;

    use super::Lightkv;
    use crate::batch::BatchOp;
    use crate::engine::{Cond, Engine};
    use crate::error::Error;

    /// A write still running when `close` stopped the workers, with the flush queue full:
    /// nothing drains it any more, so the write fails with `Closed` instead of waiting for
    /// ever (as it did before). A write that does not return within 30 s fails the test.
    #[test]
    fn a_write_with_the_flush_queue_full_after_close_fails_instead_of_waiting() {
        let (dev, fs) = (crate::pm::sim::SimDevice::new(), crate::fs::FaultFs::new());
        let o = crate::testing::sim_options(crate::Preset::Lightkv, &dev, &fs)
            .lightkv(crate::options::LightkvOptions { background: true, ..crate::testing::lightkv_small() });
        let db = Arc::new(Lightkv::open(crate::engine::test_ctx(&o, &fs, true, 9)).unwrap());
        db.stop_workers();
        let writer = db.clone();
        let failed = crate::testing::returns("writes with the flush queue full", move || {
            (0..200_000u32).find_map(|i| {
                let op = BatchOp::Put { key: format!("k{i:06}").into_bytes(), value: vec![b'v'; 200] };
                writer.write(&[op], Cond::None).err().map(|e| (i, e))
            })
        });
        assert!(
            matches!(failed, Some((_, Error::Closed))),
            "expected a Closed error once the queue filled: {failed:?}"
        );
        assert!(db.store.pending_flushes() >= super::store::MAX_PENDING_FLUSHES);
    }
}
