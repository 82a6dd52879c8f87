//! SLM-DB's range reads: [`SlmdbIter`], the cursor `Engine::iter` returns — the paper's
//! range query, the B+-tree iterator merged with the two MemTable iterators (design in the
//! module docs of [`super`], "Range reads: the iterator").

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};

/// Table numbers are small integers: hashed with foldhash, not SipHash (SipHash hashing
/// and these maps' inserts were ~7 % of a range read's samples).
type Fast = foldhash::fast::RandomState;
use std::ops::Bound;
use std::sync::Arc;

use super::memtable::{self, Memtable};
use super::{path_of, Inner};
use crate::error::{Error, Result};
use crate::index::bplus::{Batch, BatchSource, ReadAhead};
use crate::index::pbtree::Loc;
use crate::iter::{BoxedIter, InternalIterator, MergingIterator};
use crate::sstable::{DecodedBlock, EntryAt, Handle, Kind, Table};

/// A MemTable's volatile upper levels, read by key under their read lock: key → newest node.
struct MemSource(Arc<Memtable>);

impl BatchSource for MemSource {
    type V = u64;
    fn fill(&self, from: Bound<&[u8]>, forward: bool, n: usize, out: &mut Batch<u64>) -> bool {
        self.0.fill(from, forward, n, out)
    }
}

/// One MemTable (the active one, shared with writers, or the Immutable one) in key order:
/// keys copied in batches, each entry's node read in PM when the cursor moves onto it, the
/// value borrowed from the node. The arena is pinned ([`crate::pm::pins::Pins`]) by the
/// [`SlmdbIter`] that owns this cursor, so the node stays as written while it lives.
struct MemCursor {
    cur: ReadAhead<MemSource>,
    inner: Arc<Inner>,
    /// The current value's bytes in PM; `None` when invalid or a delete.
    val: Option<(u64, usize)>,
    /// False after a move failed (the cursor is then invalid).
    ok: bool,
}

impl MemCursor {
    fn new(inner: &Arc<Inner>, m: Arc<Memtable>) -> MemCursor {
        MemCursor { cur: ReadAhead::new(MemSource(m)), inner: inner.clone(), val: None, ok: true }
    }

    /// After a move: read the current node (a put's value range, or a delete).
    fn settle(&mut self) -> Result<()> {
        self.val = None;
        self.ok = true;
        let Some(&addr) = self.cur.val() else { return Ok(()) };
        // Nodes are trusted as in `get` (verified at recovery; `check` verifies them).
        match memtable::read_node_trusted(&self.inner.region, addr) {
            Ok(n) => {
                if n.kind == memtable::KIND_PUT {
                    self.val = Some((addr + memtable::NODE_HEADER + n.key.len() as u64, n.value.len()));
                }
                Ok(())
            }
            Err(e) => {
                self.ok = false;
                Err(e)
            }
        }
    }
}

impl InternalIterator for MemCursor {
    fn valid(&self) -> bool {
        self.ok && self.cur.valid()
    }
    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.cur.seek(key);
        self.settle()
    }
    fn seek_to_first(&mut self) -> Result<()> {
        self.cur.seek_to_first();
        self.settle()
    }
    fn seek_to_last(&mut self) -> Result<()> {
        self.cur.seek_to_last();
        self.settle()
    }
    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.cur.seek_for_prev(key);
        self.settle()
    }
    fn next(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        self.cur.next();
        self.settle()
    }
    fn prev(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        self.cur.prev();
        self.settle()
    }
    fn key(&self) -> &[u8] {
        if self.ok {
            self.cur.key()
        } else {
            &[]
        }
    }
    fn value(&self) -> Option<&[u8]> {
        if !self.valid() {
            return None;
        }
        // `settle` read this node inside the region, and its arena is not freed while the
        // owning iterator lives (pins): the bytes are the node's value.
        match self.val? {
            (_, 0) => Some(&[]),
            (at, len) => self.inner.region.slice(at, len),
        }
    }
}

/// The persistent B+-tree, read by key under its read lock: key → location object. Each
/// refill also takes the tables the batch points into.
struct TreeSource {
    inner: Arc<Inner>,
    /// The tables of the current batch, taken under the tree's read lock: a compaction
    /// drops a table from the store's map only under the tree's write lock, after it
    /// repointed the table's keys, so every location a batch holds names a table that is
    /// in the map then. Holding the `Arc` keeps the file open after the compaction deleted
    /// its name.
    tables: RefCell<HashMap<u64, Arc<Table>, Fast>>,
    /// A failure of the last refill (a damaged tree record, an unknown table), for the
    /// cursor to report: `BatchSource::fill` cannot return one.
    err: RefCell<Option<Error>>,
}

impl BatchSource for TreeSource {
    type V = Loc;
    fn fill(&self, from: Bound<&[u8]>, forward: bool, n: usize, out: &mut Batch<Loc>) -> bool {
        let tree = self.inner.tree.read();
        let mut files: HashSet<u64, Fast> = HashSet::default();
        let mut last = None;
        let walked = tree.walk(&self.inner.region, from, forward, n, |k, loc| {
            if last != Some(loc.file) {
                files.insert(loc.file);
                last = Some(loc.file);
            }
            out.push(k, loc);
            true
        });
        let r = walked.and_then(|exhausted| {
            let all = self.inner.tables.read();
            let mut mine = self.tables.borrow_mut();
            mine.clear();
            for f in files {
                let t = all.get(&f).ok_or_else(|| {
                    Error::corruption(path_of(&self.inner.dir, f), 0, "B+-tree points at an unknown SSTable")
                })?;
                mine.insert(f, t.clone());
            }
            Ok(exhausted)
        });
        match r {
            Ok(exhausted) => exhausted,
            Err(e) => {
                *self.err.borrow_mut() = Some(e);
                true
            }
        }
    }
}

/// Decoded blocks a [`TreeCursor`] keeps.
const KEPT_BLOCKS: usize = 8;
/// How far ahead in its batch a [`TreeCursor`] prefetches blocks.
const PREFETCH_AHEAD: isize = 4;
/// Bytes of a block prefetched.
const PREFETCH_BYTES: usize = 64;

/// One decoded block a [`TreeCursor`] keeps, pinned with its table. Blocks stay in their
/// slot: moving them to keep an order (the 136-byte structs shifted on every new block)
/// was 3.5 % of a range read's samples once locations named their entries.
struct Kept {
    /// (file, block offset); `None` while the slot holds no block (a load failed).
    id: Option<(u64, u64)>,
    /// The cursor's move count when the block last served an entry (the slot of the
    /// smallest is reused).
    used: u64,
    block: DecodedBlock,
    /// Index in the block's entry table of the entry last found by a search (`None` before
    /// the first): where the next search starts.
    at: Option<usize>,
    /// The entry last served from the block (found by a search, or at the offset its
    /// location names).
    cur: Option<EntryAt>,
}

/// The B+-tree in key order, each entry's value read from the SSTable block its location
/// names. The tree's files overlap (SLM-DB has one level; every flush spans the key space),
/// so a walk meets the keys of several files interleaved — a run of keys from one block,
/// then from another file's block, then from the first again. The cursor keeps the last
/// [`KEPT_BLOCKS`] decoded blocks (the least recently used one's slot is reused) and serves
/// every key of a block from it: each block is read and verified once per walk, not once per
/// run of its keys (keeping only the last block re-read and re-verified a block at nearly
/// every key, half of a range read's time, measured).
///
/// A location that names its entry's offset in the block (every location a flush or
/// compaction writes; `Loc::entry`) is served by decoding that entry alone, and the cursor
/// prefetches that entry's first line [`PREFETCH_AHEAD`] keys ahead; one without (a record
/// from before the field) searches the block from its first entry, and the cursor
/// prefetches the block's first line. With 1 KiB values a block holds ~4 entries, each
/// header on a cache line of its own: the search was a chain of dependent misses, and
/// naming the entry made `seekrandom` at 500,000 keys 25 % faster (measured, stop 46).
struct TreeCursor {
    cur: ReadAhead<TreeSource>,
    /// Decoded blocks (at most [`KEPT_BLOCKS`]), in no order.
    blocks: Vec<Kept>,
    /// The slot in `blocks` of the current entry's block (`usize::MAX`: none).
    slot: usize,
    /// Moves resolved so far (stamps `Kept::used`).
    tick: u64,
    /// False after a move failed (the cursor is then invalid).
    ok: bool,
    /// Files of the entries this cursor *served* (whose value the merge asked for; keys a
    /// MemTable shadows read no file) in the current sub-range (§3.3, sequentiality degree
    /// of range queries). Filled by `value`, hence the cell.
    seq: RefCell<Vec<u64>>,
    /// The current entry was counted in `seq` (reset by every move).
    counted: Cell<bool>,
    /// The distinct files of the worst sub-range of the current query (since the last
    /// seek): §3.3 adds only those, once the query is done.
    worst: Vec<u64>,
    /// `cur.fills()` at the last settle: a change means a new batch to prefetch from.
    filled: u64,
}

impl TreeCursor {
    fn new(inner: &Arc<Inner>) -> TreeCursor {
        let src = TreeSource { inner: inner.clone(), tables: RefCell::default(), err: RefCell::default() };
        TreeCursor {
            cur: ReadAhead::new(src),
            blocks: Vec::with_capacity(KEPT_BLOCKS),
            slot: usize::MAX,
            tick: 0,
            ok: true,
            seq: RefCell::default(),
            counted: Cell::new(false),
            worst: Vec::new(),
            filled: 0,
        }
    }

    fn inner(&self) -> &Arc<Inner> {
        &self.cur.source().inner
    }

    /// Close the current sub-range: its distinct files replace the query's worst so far
    /// when there are more of them.
    fn end_subrange(&mut self) {
        let files = std::mem::take(&mut *self.seq.borrow_mut());
        let mut distinct: Vec<u64> = files;
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() > self.worst.len() {
            self.worst = distinct;
        }
    }

    /// The sequentiality check of §3.3 once a range query is done (the next seek, or the
    /// drop): the files of its worst sub-range become compaction candidates when there are
    /// more than `seq_degree_threshold` of them.
    fn end_query(&mut self) -> Result<()> {
        self.end_subrange();
        let worst = std::mem::take(&mut self.worst);
        if worst.len() > self.inner().opts.seq_degree_threshold {
            self.inner().note_sequentiality(&worst)?;
        }
        Ok(())
    }

    /// After a move (`seek`: a new range query begins): resolve the current entry's value.
    fn settle(&mut self, seek: bool, forward: bool) -> Result<()> {
        let r = self.resolve(seek);
        self.ok = r.is_ok();
        // A new batch (every seek loads one, and a walk refills) starts the pipeline:
        // every entry up to the prefetch distance; a step within the batch adds the one at
        // the distance.
        let fresh = self.cur.fills() != self.filled;
        self.filled = self.cur.fills();
        if self.ok {
            let first = if fresh { 1 } else { PREFETCH_AHEAD };
            for d in first..=PREFETCH_AHEAD {
                self.prefetch(if forward { d } else { -d });
            }
        }
        r
    }

    /// Start loading the entry `ahead` places on in the batch — its header and key, at the
    /// offset its location names; for a location without one, the block's first line: a
    /// walk meets a different file's block at nearly every key, and each is a cache miss
    /// (the entry's line; without the offset, the block's first line and then each entry
    /// header the search crosses), so the next ones are requested while this one is served.
    fn prefetch(&self, ahead: isize) {
        let Some(&loc) = self.cur.peek(ahead) else { return };
        if let Some(t) = self.cur.source().tables.borrow().get(&loc.file) {
            let h = Handle { offset: loc.offset, size: loc.size };
            match loc.entry {
                // The entry's own header and key: the only bytes `resolve` reads.
                Some(pos) => t.prefetch_in_block(h, pos, PREFETCH_BYTES),
                None => t.prefetch_block(h, PREFETCH_BYTES),
            }
        }
    }

    fn resolve(&mut self, seek: bool) -> Result<()> {
        self.counted.set(false);
        if seek {
            self.end_query()?;
        } else if self.seq.borrow().len() >= self.inner().opts.seq_subrange_keys.max(1) {
            self.end_subrange();
        }
        if let Some(e) = self.cur.source().err.borrow_mut().take() {
            return Err(e);
        }
        self.slot = usize::MAX;
        let Some(&loc) = self.cur.val() else { return Ok(()) };
        self.tick += 1;
        let id = Some((loc.file, loc.offset));
        let slot = match self.blocks.iter().position(|b| b.id == id) {
            Some(i) => i,
            None => {
                let t = self.cur.source().tables.borrow().get(&loc.file).cloned().ok_or_else(|| {
                    Error::corruption(
                        path_of(&self.inner().dir, loc.file),
                        loc.offset,
                        "B+-tree points at an unknown SSTable",
                    )
                })?;
                // A free slot, else the least recently used block's (its entry table's
                // allocation is reused).
                let i = if self.blocks.len() < KEPT_BLOCKS {
                    self.blocks.push(Kept { id: None, used: 0, block: DecodedBlock::default(), at: None, cur: None });
                    self.blocks.len() - 1
                } else {
                    (0..self.blocks.len()).min_by_key(|&i| self.blocks[i].used).unwrap_or(0)
                };
                let Some(k) = self.blocks.get_mut(i) else { return Ok(()) };
                (k.id, k.at, k.cur) = (None, None, None);
                // slmdb's reads never put a mapped table's blocks in the cache (`read_at`
                // reads them in place): a lookup there would miss (2 % of seekrandom).
                k.block.load(&t, Handle { offset: loc.offset, size: loc.size }, !t.is_mapped())?;
                k.id = id;
                i
            }
        };
        let Some(k) = self.blocks.get_mut(slot) else { return Ok(()) };
        k.used = self.tick;
        k.cur = None;
        let key = self.cur.key();
        let found = match loc.entry {
            // The location names the entry: decode it alone, and check it is the key's.
            Some(pos) => Some(k.block.entry_at(pos as usize)?).filter(|e| k.block.key_of(e) == key),
            None => {
                let i = find_entry(&mut k.block, k.at, key)?;
                k.at = i.or(k.at);
                i.and_then(|i| k.block.entry(i))
            }
        };
        match found {
            Some(e) if e.kind() == Kind::Put => {
                k.cur = Some(e);
                self.slot = slot;
                Ok(())
            }
            _ => Err(Error::corruption(
                path_of(&self.inner().dir, loc.file),
                loc.offset,
                "the B+-tree points at a block without the key",
            )),
        }
    }
}

/// The entry of `b` holding `key`, if any. A walk steps to a neighbour of the entry last
/// served (`at`): those are tried first (decoding at most one more entry); a seek searches
/// the block.
fn find_entry(b: &mut DecodedBlock, at: Option<usize>, key: &[u8]) -> Result<Option<usize>> {
    if let Some(at) = at {
        for i in [Some(at + 1), at.checked_sub(1), Some(at)].into_iter().flatten() {
            if b.decode_to(i)? && b.key(i) == key {
                return Ok(Some(i));
            }
        }
    }
    let i = b.lower_bound(key)?;
    Ok((i < b.decoded() && b.key(i) == key).then_some(i))
}

impl Drop for TreeCursor {
    fn drop(&mut self) {
        // The query is done (its candidates only; nothing to report).
        let _ = self.end_query();
    }
}

impl InternalIterator for TreeCursor {
    fn valid(&self) -> bool {
        self.ok && self.cur.valid()
    }
    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.cur.seek(key);
        self.settle(true, true)
    }
    fn seek_to_first(&mut self) -> Result<()> {
        self.cur.seek_to_first();
        self.settle(true, true)
    }
    fn seek_to_last(&mut self) -> Result<()> {
        self.cur.seek_to_last();
        self.settle(true, false)
    }
    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.cur.seek_for_prev(key);
        self.settle(true, false)
    }
    fn next(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        self.cur.next();
        self.settle(false, true)
    }
    fn prev(&mut self) -> Result<()> {
        if !self.valid() {
            return Ok(());
        }
        self.cur.prev();
        self.settle(false, false)
    }
    fn key(&self) -> &[u8] {
        if self.ok {
            self.cur.key()
        } else {
            &[]
        }
    }
    fn value(&self) -> Option<&[u8]> {
        if !self.valid() {
            return None;
        }
        let v = self.blocks.get(self.slot).and_then(|k| k.cur.as_ref().and_then(|e| k.block.value_of(e)));
        // The merge asks only the source whose entry it serves: count that entry's file once.
        if !self.counted.get() && self.inner().opts.enable_seq_degree {
            if let (Some(_), Some(loc)) = (v, self.cur.val()) {
                self.seq.borrow_mut().push(loc.file);
                self.counted.set(true);
            }
        }
        v
    }
}

/// The store's entries: the MemTable, the Immutable MemTable (if any) and the B+-tree,
/// merged newest first. Registered with the store's pins for its lifetime, so the
/// MemTable arenas it reads are not reused under it.
pub(crate) struct SlmdbIter {
    inner: Arc<Inner>,
    src: MergingIterator,
    /// This iterator's registration in [`crate::pm::pins::Pins`].
    epoch: u64,
}

impl std::fmt::Debug for SlmdbIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlmdbIter").field("epoch", &self.epoch).field("valid", &self.valid()).finish()
    }
}

impl Drop for SlmdbIter {
    fn drop(&mut self) {
        let free = self.inner.pins.lock().deregister(self.epoch);
        self.inner.free_pm(free);
    }
}

impl SlmdbIter {
    /// A cursor over the store as `inner` holds it now. Registers before it takes the
    /// MemTables, so an arena a flush frees is either one it never saw or parked for it.
    pub(crate) fn new(inner: &Arc<Inner>) -> SlmdbIter {
        let epoch = inner.pins.lock().register();
        let (active, imm) = {
            let m = inner.mem.read();
            (m.active.clone(), m.imm.clone())
        };
        let mut children: Vec<BoxedIter> = Vec::with_capacity(3);
        for m in std::iter::once(active).chain(imm) {
            children.push(Box::new(MemCursor::new(inner, m)));
        }
        children.push(Box::new(TreeCursor::new(inner)));
        SlmdbIter { inner: inner.clone(), src: MergingIterator::new(children), epoch }
    }
}

impl InternalIterator for SlmdbIter {
    fn valid(&self) -> bool {
        self.src.valid()
    }
    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.src.seek(key)
    }
    fn seek_to_first(&mut self) -> Result<()> {
        self.src.seek_to_first()
    }
    fn seek_to_last(&mut self) -> Result<()> {
        self.src.seek_to_last()
    }
    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.src.seek_for_prev(key)
    }
    fn next(&mut self) -> Result<()> {
        self.src.next()
    }
    fn prev(&mut self) -> Result<()> {
        self.src.prev()
    }
    fn key(&self) -> &[u8] {
        self.src.key()
    }
    fn value(&self) -> Option<&[u8]> {
        self.src.value()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use crate::batch::BatchOp;
    use crate::engine::hpdk::iter::check::{continue_forward, full_walks, random_moves, Model};
    use crate::engine::slmdb::Slmdb;
    use crate::engine::{Cond, Engine};
    use crate::fs::{FaultFs, Fs};
    use crate::iter::InternalIterator;
    use crate::options::{Options, Preset, SlmdbOptions};
    use crate::pm::sim::SimDevice;

    fn opts(dev: &SimDevice, fs: &FaultFs, s: SlmdbOptions) -> Options {
        crate::testing::sim_options(Preset::Slmdb, dev, fs).slmdb(s)
    }

    fn open(o: &Options, fs: &FaultFs, fresh: bool) -> Slmdb {
        Slmdb::open(crate::engine::test_ctx(o, fs, fresh, 5)).unwrap()
    }

    fn key(i: u32) -> Vec<u8> {
        format!("k{i:05}").into_bytes()
    }

    fn value(k: &[u8], ver: u64, rng: &mut SmallRng) -> Vec<u8> {
        crate::iter::versioned_value(k, ver, rng, 300)
    }

    fn design(e: &Slmdb, name: &str) -> u64 {
        e.stats().design.get(name).copied().unwrap_or_else(|| panic!("no design figure {name}"))
    }

    fn sst_files(fs: &FaultFs) -> BTreeSet<u64> {
        fs.list(&PathBuf::from("/db"))
            .unwrap()
            .iter()
            .filter_map(|n| n.strip_suffix(".sst").and_then(|n| n.parse().ok()))
            .collect()
    }

    /// Every key of the B+-tree with its location.
    fn tree_locs(e: &Slmdb) -> Vec<(Vec<u8>, super::Loc)> {
        e.inner.tree.read().range(&e.inner.region, b"", false, None, usize::MAX).unwrap()
    }

    /// Rewrite every `step`-th location of `locs` without its entry offset, as a record
    /// written before the field existed.
    fn forget_offsets(e: &Slmdb, locs: &[(Vec<u8>, super::Loc)], step: usize) {
        let inner = &e.inner;
        let mut tree = inner.tree.write();
        for (k, loc) in locs.iter().step_by(step) {
            tree.put(&inner.region, &inner.heap, k, super::Loc { entry: None, ..*loc }).unwrap();
        }
    }

    /// Random puts, deletes and batches with flushes and compactions in between.
    fn churn(e: &Slmdb, m: &mut Model, rng: &mut SmallRng, ops: usize, keys: u32, ver: &mut u64) {
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

    fn check_all(e: &Slmdb, m: &Model, rng: &mut SmallRng, what: &str) {
        let mut it = e.iter().unwrap();
        let all = crate::iter::collect_forward(&mut *it).unwrap();
        let live: Vec<(Vec<u8>, Vec<u8>)> = all.into_iter().filter_map(|(k, v)| Some((k, v?))).collect();
        let want: Vec<(Vec<u8>, Vec<u8>)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        assert!(live == want, "{what}: forward collection differs from the model");
        full_walks(&mut *it, m);
        random_moves(&mut *it, m, rng, 2000);
    }

    /// (a) The iterator against a model: random writes and batches with flushes, selective
    /// compactions and tree splits in between, then random interleavings of every move
    /// (seek, seek_for_prev, both directions); again after a clean reopen and after a
    /// crash (PM lines not persisted lost or evicted, unsynced file data dropped).
    #[test]
    fn iterator_matches_model() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = opts(&dev, &fs, crate::testing::slmdb_small());
        let mut rng = SmallRng::seed_from_u64(17);
        let mut m = Model::new();
        let mut ver = 0;
        let e = open(&o, &fs, true);
        for round in 0..4 {
            churn(&e, &mut m, &mut rng, 700, 400, &mut ver);
            check_all(&e, &m, &mut rng, &format!("round {round}"));
        }
        assert!(design(&e, "flushes") > 0, "flushes ran");
        assert!(design(&e, "compactions") > 0, "compactions ran");
        e.close().unwrap();
        drop(e);
        let e = open(&o, &fs, false);
        check_all(&e, &m, &mut rng, "reopened");
        churn(&e, &mut m, &mut rng, 300, 400, &mut ver);
        // A crash: drop the engine without closing, keep what was durable.
        drop(e);
        let (dev2, fs2) = (dev.simulate_crash(3, 0.3), fs.crash());
        let e = open(&opts(&dev2, &fs2, crate::testing::slmdb_small()), &fs2, false);
        check_all(&e, &m, &mut rng, "after a crash");
        assert!(e.check().unwrap().is_empty());
    }

    /// (b) An iterator stays valid, and returns the store as it was, while a flush frees
    /// the MemTable arena it reads and a compaction deletes every SSTable it was created
    /// over: the untouched (even) keys come back exactly, the keys written meanwhile as one
    /// of their versions; the arena's free waits for the iterator and happens when it is
    /// dropped.
    #[test]
    fn iterator_survives_flush_and_compaction_that_free_its_sources() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = opts(&dev, &fs, crate::testing::slmdb_small());
        let e = open(&o, &fs, true);
        let mut rng = SmallRng::seed_from_u64(8);
        let mut m = Model::new();
        for i in 0..600u32 {
            let k = key(i);
            let v = value(&k, 0, &mut rng);
            e.write(&[BatchOp::Put { key: k.clone(), value: v.clone() }], Cond::None).unwrap();
            m.insert(k, v);
        }
        e.flush().unwrap();
        // Some (odd) keys only in the MemTable the iterator takes.
        for i in (5..600u32).step_by(10) {
            let k = key(i);
            let v = value(&k, 1, &mut rng);
            e.write(&[BatchOp::Put { key: k.clone(), value: v.clone() }], Cond::None).unwrap();
            m.insert(k, v);
        }
        let before = sst_files(&fs);
        assert!(!before.is_empty());
        let (flushes, compactions) = (design(&e, "flushes"), design(&e, "compactions"));

        // Part 1: nothing written while it lives; a flush frees the MemTable it holds.
        let mut it = e.iter().unwrap();
        it.seek(&key(100)).unwrap();
        e.flush().unwrap();
        assert!(design(&e, "flushes") > flushes);
        assert_eq!(design(&e, "frees_held_for_iterators"), 1, "the flushed MemTable's arena waits");
        continue_forward(&mut *it, &m, &key(100));
        full_walks(&mut *it, &m);
        drop(it);
        assert_eq!(design(&e, "frees_held_for_iterators"), 0, "freed with the iterator");

        // Part 2: the odd keys are overwritten and deleted while the iterator walks; the
        // files it was created over fall below the live-key ratio and are compacted away.
        let stable: Vec<(Vec<u8>, Vec<u8>)> =
            m.iter().filter(|(k, _)| !odd(k)).map(|(k, v)| (k.clone(), v.clone())).collect();
        let before = sst_files(&fs);
        let mut it = e.iter().unwrap();
        it.seek_to_first().unwrap();
        let mut got = Vec::new();
        let mut round = 0u64;
        while it.valid() {
            let k = it.key().to_vec();
            match it.value() {
                Some(v) if !odd(&k) => got.push((k, v.to_vec())),
                Some(v) => {
                    let prefix = format!("{}:", String::from_utf8_lossy(&k));
                    assert!(v.starts_with(prefix.as_bytes()), "a value that is no version of its key");
                }
                None => assert!(odd(&k), "an untouched key shows as deleted"),
            }
            it.next().unwrap();
            if round < 3 {
                round += 1;
                for i in (1..600u32).step_by(2) {
                    let k = key(i);
                    let op = if rng.random_bool(0.3) {
                        BatchOp::Delete { key: k }
                    } else {
                        BatchOp::Put { value: value(&k, 10 + round, &mut rng), key: k }
                    };
                    e.write(&[op], Cond::None).unwrap();
                }
                e.compact().unwrap();
            }
        }
        assert!(got == stable, "untouched keys differ from the model");
        assert!(design(&e, "compactions") > compactions, "compactions ran");
        let after = sst_files(&fs);
        assert!(
            before.is_disjoint(&after),
            "every file the iterator was created over was deleted: {before:?} {after:?}"
        );
        assert!(design(&e, "frees_ever_held_for_iterators") >= 2, "flushed arenas waited for the iterator");
        assert_eq!(design(&e, "iterators_live"), 1);
        // Walk the whole view again through the deleted files' open handles.
        let mut back = Vec::new();
        it.seek_to_last().unwrap();
        while it.valid() {
            if let (false, Some(v)) = (odd(it.key()), it.value()) {
                back.push((it.key().to_vec(), v.to_vec()));
            }
            it.prev().unwrap();
        }
        back.reverse();
        assert!(back == stable, "backward walk after the compaction differs");
        drop(it);
        assert_eq!(design(&e, "iterators_live"), 0);
        assert_eq!(design(&e, "frees_held_for_iterators"), 0, "released with the last iterator");
        assert!(e.check().unwrap().is_empty());
    }

    fn odd(k: &[u8]) -> bool {
        k.last().is_some_and(|b| (b - b'0') % 2 == 1)
    }

    /// (c) Writers change a disjoint key set (background flushes and compactions) while
    /// iterators walk both ways: every untouched key is returned exactly once, in order,
    /// with its value.
    #[test]
    fn concurrent_writers_do_not_disturb_untouched_keys() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = opts(
            &dev,
            &fs,
            SlmdbOptions { background: true, memtable_size: 32 << 10, ..crate::testing::slmdb_small() },
        );
        let e = Arc::new(open(&o, &fs, true));
        let mut rng = SmallRng::seed_from_u64(5);
        let mut m = Model::new();
        for i in (0..2000u32).step_by(2) {
            let k = key(i);
            let v = value(&k, 1, &mut rng);
            e.write(&[BatchOp::Put { key: k.clone(), value: v.clone() }], Cond::None).unwrap();
            m.insert(k, v);
        }
        let flushes = design(&e, "flushes");
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..2u64)
            .map(|t| {
                let (e, stop) = (e.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(100 + t);
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) || n < 2000 {
                        let k = key(rng.random_range(0..1000u32) * 2 + 1);
                        let op = if rng.random_bool(0.3) {
                            BatchOp::Delete { key: k }
                        } else {
                            BatchOp::Put { value: value(&k, n + 2, &mut rng), key: k }
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
            let mut got = Vec::new();
            let mut last: Option<Vec<u8>> = None;
            while it.valid() {
                let k = it.key().to_vec();
                if let Some(l) = &last {
                    assert!(if forward { k > *l } else { k < *l }, "pass {pass}: keys out of order");
                }
                if !odd(&k) {
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
        assert!(design(&e, "flushes") > flushes, "flushes ran during the walks");
    }

    /// Lone writes link under the MemTable's own lock only, numbered before it: four
    /// threads writing 16 shared keys (puts, deletes, and put-if-absent, which takes the
    /// serialised path) across MemTable rotations and background flushes, in rounds until
    /// some lone write was overtaken by a newer write of its key and renumbered. Each key
    /// ends as the last write (put, delete, or put-if-absent that applied) one of the
    /// threads made to it — an older write of a thread that wrote the key again would be a
    /// lost update — and a clean reopen and a reopen after a crash (every write
    /// acknowledged, so all durable) both open and read what the live store read. (Most
    /// overtaken nodes have been flushed by the reopen, so whether the renumbered header
    /// reached PM is checked by `memtable`'s deterministic test, not here.)
    #[test]
    fn concurrent_lone_writes_of_shared_keys_end_as_some_threads_last_write() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let so = SlmdbOptions { background: true, memtable_size: 32 << 10, ..crate::testing::slmdb_small() };
        let o = opts(&dev, &fs, so.clone());
        let e = Arc::new(open(&o, &fs, true));
        type Last = HashMap<Vec<u8>, Option<Vec<u8>>>;
        let mut lasts: Vec<Last> = vec![HashMap::new(); 4];
        for round in 0..20u64 {
            let writers: Vec<_> = (0..4u64)
                .map(|t| {
                    let e = e.clone();
                    let mut last = std::mem::take(&mut lasts[t as usize]);
                    std::thread::spawn(move || {
                        let mut rng = SmallRng::seed_from_u64(200 + t + 10 * round);
                        for n in 0..1500u64 {
                            let k = key(rng.random_range(0..16u32));
                            let v = value(&k, (round * 4 + t) * 10_000 + n, &mut rng);
                            match rng.random_range(0..10) {
                                0 => {
                                    assert!(e.write(&[BatchOp::Delete { key: k.clone() }], Cond::None).unwrap());
                                    last.insert(k, None);
                                }
                                1..=2 => {
                                    let op = BatchOp::Put { key: k.clone(), value: v.clone() };
                                    if e.write(&[op], Cond::Absent).unwrap() {
                                        last.insert(k, Some(v));
                                    }
                                }
                                _ => {
                                    assert!(e
                                        .write(&[BatchOp::Put { key: k.clone(), value: v.clone() }], Cond::None)
                                        .unwrap());
                                    last.insert(k, Some(v));
                                }
                            }
                        }
                        last
                    })
                })
                .collect();
            for (t, w) in writers.into_iter().enumerate() {
                lasts[t] = w.join().unwrap();
            }
            if design(&e, "writes_renumbered") > 0 {
                break;
            }
        }
        assert!(design(&e, "writes_renumbered") > 0, "no lone write was overtaken in 20 rounds");
        assert!(design(&e, "flushes") > 0, "rotations and flushes ran during the writes");
        let read = |e: &Slmdb| -> Vec<Option<Vec<u8>>> { (0..16u32).map(|i| e.get(&key(i)).unwrap()).collect() };
        let live = read(&e);
        for (i, v) in live.iter().enumerate() {
            let k = key(i as u32);
            let candidates: Vec<&Option<Vec<u8>>> = lasts.iter().filter_map(|l| l.get(&k)).collect();
            assert!(candidates.contains(&v), "key {i}: not the last write of any thread");
        }
        // A crash image taken now (the engine is not closed first). PM and files are two
        // images taken one after the other: the job locks (in `check`'s order) keep a
        // background flush or compaction from running between them — one that did would
        // leave an image no crash can (the B+-tree from before a compaction, the MANIFEST
        // from after it: "points at file N not in the MANIFEST", seen in repeated runs).
        let (dev2, fs2) = {
            let _c = e.inner.compaction_job.lock();
            let _f = e.inner.flush_job.lock();
            (dev.simulate_crash(9, 0.5), fs.crash())
        };
        let e = Arc::into_inner(e).unwrap();
        e.close().unwrap();
        drop(e);
        let e = open(&o, &fs, false);
        assert_eq!(read(&e), live, "after a clean reopen");
        assert!(e.check().unwrap().is_empty());
        drop(e);
        let e = open(&opts(&dev2, &fs2, so), &fs2, false);
        assert_eq!(read(&e), live, "after a crash");
        {
            let p = e.check().unwrap();
            assert!(p.is_empty(), "{p:?}");
        }
    }

    /// An empty store, a store of tombstones only and one key: every positioning move
    /// lands where the model says (seek_to_last on an empty store is invalid, not a panic;
    /// seek_for_prev at a key equal to an entry returns it).
    #[test]
    fn edge_positions_on_tiny_stores() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = opts(&dev, &fs, crate::testing::slmdb_small());
        let e = open(&o, &fs, true);
        let mut it = e.iter().unwrap();
        it.seek_to_last().unwrap();
        assert!(!it.valid());
        it.seek_for_prev(b"zzz").unwrap();
        assert!(!it.valid());
        it.seek(b"").unwrap();
        assert!(!it.valid());
        it.seek_to_first().unwrap();
        assert!(!it.valid());
        drop(it);
        e.write(&[BatchOp::Put { key: key(1), value: b"v1".to_vec() }], Cond::None).unwrap();
        e.flush().unwrap();
        e.write(&[BatchOp::Delete { key: key(1) }], Cond::None).unwrap();
        e.write(&[BatchOp::Put { key: key(2), value: b"v2".to_vec() }], Cond::None).unwrap();
        let mut it = e.iter().unwrap();
        it.seek_for_prev(&key(2)).unwrap();
        assert!(it.valid() && it.key() == key(2).as_slice() && it.value() == Some(&b"v2"[..]));
        it.prev().unwrap();
        assert!(it.valid() && it.key() == key(1).as_slice() && it.value().is_none(), "the tombstone hides the tree");
        it.prev().unwrap();
        assert!(!it.valid());
        it.seek_to_last().unwrap();
        assert_eq!(it.key(), key(2).as_slice());
        it.next().unwrap();
        assert!(!it.valid());
    }

    /// Flushes and compactions write locations that name their entry's offset in the
    /// block; reads decode that entry alone. A location without one (a record written
    /// before the field existed) reads the same through a search of the block; one naming
    /// another key's entry is `Corruption`, for `get` and for the iterator.
    #[test]
    fn locations_name_their_entries_and_records_without_one_read_the_same() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        // Blocks of several entries, so most entries start past a block's first byte.
        let o = opts(&dev, &fs, SlmdbOptions { block_size: 2048, ..crate::testing::slmdb_small() });
        let e = open(&o, &fs, true);
        let mut rng = SmallRng::seed_from_u64(5);
        let mut m = Model::new();
        let mut ver = 0;
        churn(&e, &mut m, &mut rng, 3000, 400, &mut ver);
        e.flush().unwrap();
        e.compact().unwrap();
        let inner = &e.inner;
        let locs = tree_locs(&e);
        assert!(locs.len() > 100, "the tree holds the flushed keys: {}", locs.len());
        let tables = inner.tables.read().clone();
        for (k, loc) in &locs {
            let pos = loc.entry.unwrap_or_else(|| panic!("no entry offset for {k:?}"));
            let t = &tables[&loc.file];
            let b = t.read_block(crate::sstable::Handle { offset: loc.offset, size: loc.size }).unwrap();
            let (ent, _) = crate::sstable::entry_at(&b, pos as usize).unwrap();
            assert_eq!(ent.key, k.as_slice(), "the offset names the key's entry");
        }
        assert!(locs.iter().filter(|(_, l)| l.entry > Some(0)).count() > locs.len() / 2, "most entries are not first");
        // Every other record as an old one (no offset): reads search the block.
        forget_offsets(&e, &locs, 2);
        for (k, v) in &m {
            assert_eq!(e.get(k).unwrap().as_ref(), Some(v));
        }
        check_all(&e, &m, &mut rng, "half the locations without an entry offset");
        // A location naming a neighbour's entry in the same block: corruption.
        let (k, loc, other) = locs
            .windows(2)
            .find_map(|w| {
                let ((k, a), (_, b)) = (&w[0], &w[1]);
                (a.file == b.file && a.offset == b.offset && m.contains_key(k)).then_some((k.clone(), *a, b.entry))
            })
            .expect("two neighbours in one block");
        inner.tree.write().put(&inner.region, &inner.heap, &k, super::Loc { entry: other, ..loc }).unwrap();
        // (The MemTables hold none of the tree's keys after the flush.)
        let err = e.get(&k).unwrap_err();
        assert!(err.is_corruption(), "{err}");
        let mut it = e.iter().unwrap();
        let err = it.seek(&k).unwrap_err();
        assert!(err.is_corruption(), "{err}");
    }

    /// A version-1 store (superblock version 1, no record naming its entry's offset) opens
    /// and reads every key, and its superblock says version 2 once it is open (its
    /// version-1 salvage would misread the records this code writes).
    #[test]
    fn a_version_1_store_opens_and_is_marked_version_2() {
        use super::super::layout;
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = opts(&dev, &fs, crate::testing::slmdb_small());
        let e = open(&o, &fs, true);
        let mut rng = SmallRng::seed_from_u64(9);
        let mut m = Model::new();
        let mut ver = 0;
        churn(&e, &mut m, &mut rng, 800, 200, &mut ver);
        e.flush().unwrap();
        let version = |e: &Slmdb| {
            let sb = e.inner.region.slice(layout::SUPERBLOCK_ADDR, 64).unwrap();
            layout::decode_superblock(sb).unwrap().1
        };
        assert_eq!(version(&e), 2);
        forget_offsets(&e, &tree_locs(&e), 1);
        {
            let inner = &e.inner;
            let sb = layout::encode_superblock_version(inner.opts.memtable_size, 1);
            // SAFETY: test-only rewrite of the superblock line; nothing else reads it now.
            unsafe { inner.region.write(layout::SUPERBLOCK_ADDR, &sb).unwrap() };
            inner.region.persist(layout::SUPERBLOCK_ADDR, 64);
        }
        assert_eq!(version(&e), 1);
        e.close().unwrap();
        drop(e);
        let e = open(&o, &fs, false);
        assert_eq!(version(&e), 2, "upgraded at open");
        for (k, v) in &m {
            assert_eq!(e.get(k).unwrap().as_ref(), Some(v));
        }
        check_all(&e, &m, &mut rng, "a version-1 store");
        churn(&e, &mut m, &mut rng, 400, 200, &mut ver);
        check_all(&e, &m, &mut rng, "a version-1 store after writes");
        assert!(e.check().unwrap().is_empty());
    }

    /// (d) A damaged SSTable block the iterator reads is `Corruption` naming the file and
    /// the block's offset, not a panic or a wrong value.
    #[test]
    fn a_damaged_block_is_corruption_naming_the_file() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = opts(&dev, &fs, crate::testing::slmdb_small());
        let e = open(&o, &fs, true);
        let mut rng = SmallRng::seed_from_u64(2);
        for i in 0..300u32 {
            let k = key(i);
            e.write(&[BatchOp::Put { value: value(&k, 0, &mut rng), key: k }], Cond::None).unwrap();
        }
        e.flush().unwrap();
        let f = *sst_files(&fs).iter().next().unwrap();
        let path = PathBuf::from("/db").join(super::super::table_name(f));
        fs.poke(&path, 20, b"\xff\xff").unwrap();
        let mut it = e.iter().unwrap();
        let err = it.seek_to_first().unwrap_err();
        assert!(err.is_corruption(), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(&super::super::table_name(f)), "names the file: {msg}");
        assert!(!it.valid());
    }
}
