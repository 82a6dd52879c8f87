//! SLM-DB's background jobs: flush (file creation + B+-tree insertion through a queue),
//! selective compaction (candidate selection, pick, merge), and the recovery of a job a
//! crash interrupted. See the module docs of [`super`].

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;

use super::complog::{self, CompLog, Job, LogEntry};
use super::memtable::{Memtable, KIND_PUT};
use super::{path_of, table_name, table_number, Inflight, Inner};
use crate::error::{Error, Result};
use crate::fs::Fs;
use crate::index::pbtree::Loc;
use crate::manifest::{Edit, FileMeta, Version};
use crate::sstable::{Kind, Table, TableBuilder, TableMeta};

/// One tree change: `key` to `new` (`None` removes it); with `src`, only if the key still
/// points at file `src` (a compaction's entry that a concurrent flush made obsolete is
/// skipped).
struct Item {
    key: Vec<u8>,
    new: Option<Loc>,
    src: Option<u64>,
}

/// One synced output file and the tree changes it brings.
struct Batch {
    output: Option<u64>,
    items: Vec<Item>,
}

/// What the insertion thread did.
#[derive(Default)]
struct Applied {
    /// Keys whose old version left a file, per file.
    decr: HashMap<u64, u64>,
    /// Entries of an output file that were not installed (obsolete by then), per file.
    skipped: HashMap<u64, u64>,
}

/// Map a key to a number for overlap ratios: the big-endian value of the 8 bytes after the
/// first `skip` bytes (zero-padded).
fn key_num(k: &[u8], skip: usize) -> f64 {
    let mut b = [0u8; 8];
    for (i, x) in k.iter().skip(skip).take(8).enumerate() {
        b[i] = *x;
    }
    u64::from_be_bytes(b) as f64
}

fn common_prefix(keys: &[&[u8]]) -> usize {
    let Some(first) = keys.first() else { return 0 };
    let mut n = first.len();
    for k in keys {
        n = n.min(first.iter().zip(k.iter()).take_while(|(a, b)| a == b).count());
    }
    n
}

/// SLM-DB's overlap ratio of key ranges `[s1, sp]` and `[t1, tq]` (§3.3), 0 when disjoint.
pub fn overlap_ratio(s: &FileMeta, t: &FileMeta) -> f64 {
    let (s1, sp, t1, tq) = (&s.smallest[..], &s.largest[..], &t.smallest[..], &t.largest[..]);
    if sp < t1 || tq < s1 {
        return 0.0;
    }
    let skip = common_prefix(&[s1, sp, t1, tq]);
    let (s1, sp, t1, tq) = (key_num(s1, skip), key_num(sp, skip), key_num(t1, skip), key_num(tq, skip));
    let den = sp.max(tq) - s1.min(t1);
    if den <= 0.0 {
        return 1.0; // both ranges are the same point
    }
    ((sp.min(tq) - s1.max(t1)) / den).max(0.0)
}

/// Choose the files of the next compaction from `version`'s candidates: the candidate with
/// the largest summed overlap ratio with the other candidates, plus the candidates that
/// overlap it (largest ratio first), at most `max` files.
pub fn pick(version: &Version, max: usize) -> Vec<u64> {
    let cands: Vec<(u64, &FileMeta)> =
        version.candidates.iter().filter_map(|n| version.files.get(n).map(|m| (*n, m))).collect();
    let mut best: Option<(f64, u64, &FileMeta)> = None;
    for &(s, sm) in &cands {
        let sum: f64 = cands.iter().filter(|(t, _)| *t != s).map(|(_, tm)| overlap_ratio(sm, tm)).sum();
        if best.is_none_or(|(b, _, _)| sum > b) {
            best = Some((sum, s, sm));
        }
    }
    let Some((_, s, sm)) = best else { return Vec::new() };
    let mut others: Vec<(f64, u64)> = cands
        .iter()
        .filter(|(t, _)| *t != s)
        .map(|(t, tm)| (overlap_ratio(sm, tm), *t))
        .filter(|(r, _)| *r > 0.0)
        .collect();
    others.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut out = vec![s];
    out.extend(others.into_iter().map(|(_, t)| t).take(max.saturating_sub(1)));
    out.sort_unstable();
    out
}

/// Streams a table's entries block by block (for merges).
struct TableIter {
    table: Arc<Table>,
    file: u64,
    next_block: usize,
    entries: Vec<(Vec<u8>, Vec<u8>)>,
    pos: usize,
}

impl TableIter {
    fn peek(&mut self) -> Result<Option<&(Vec<u8>, Vec<u8>)>> {
        while self.pos >= self.entries.len() {
            let Some(&(_, h)) = self.table.index().get(self.next_block) else { return Ok(None) };
            let b = self.table.read_block(h)?;
            self.entries.clear();
            for e in crate::sstable::block_entries(&b) {
                let e = e.map_err(|d| Error::corruption(self.table.path(), h.offset, d))?;
                if e.kind == Kind::Put {
                    self.entries.push((e.key.to_vec(), e.value.to_vec()));
                }
            }
            self.pos = 0;
            self.next_block += 1;
        }
        Ok(self.entries.get(self.pos))
    }
}

/// What the MANIFEST records of a table just written: every key live.
fn file_meta(meta: &TableMeta) -> FileMeta {
    FileMeta {
        total: meta.entries,
        live: meta.entries,
        size: meta.size,
        smallest: meta.smallest.clone(),
        largest: meta.largest.clone(),
        level: 0,
    }
}

/// Tree changes for the keys written to `file` (with their source files, for a merge).
fn items_of(meta: &TableMeta, file: u64, keys: Vec<(Vec<u8>, Option<u64>)>) -> Result<Vec<Item>> {
    keys.into_iter()
        .zip(meta.entry_block.iter().zip(&meta.entry_pos))
        .map(|((key, src), (&b, &pos))| {
            let h =
                meta.blocks.get(b as usize).ok_or_else(|| Error::InvalidArgument("entry block out of range".into()))?;
            Ok(Item { key, new: Some(Loc { file, offset: h.offset, size: h.size, entry: Some(pos) }), src })
        })
        .collect()
}

/// The files of `entries` that `pick` selects (a log's inputs or outputs).
fn log_files(entries: &[LogEntry], pick: impl Fn(&LogEntry) -> Option<u64>) -> Vec<u64> {
    entries.iter().filter_map(pick).collect()
}

impl Inner {
    fn alloc_file(&self) -> u64 {
        let mut vs = self.version.lock();
        let n = vs.version.next_file;
        vs.version.next_file += 1;
        n
    }

    fn builder(&self, n: u64) -> Result<TableBuilder> {
        TableBuilder::create(&self.fs, &path_of(&self.dir, n), self.opts.block_size, self.opts.bloom_bits_per_key)
    }

    /// Finish a table: fsync it and its directory entry, open it, add it to the cache.
    fn finish_table(&self, n: u64, b: TableBuilder) -> Result<TableMeta> {
        let meta = b.finish()?;
        self.fs.sync_dir(&self.dir)?;
        let t = Table::open_cached(&self.fs, &path_of(&self.dir, n), n, &self.cache)?;
        self.tables.write().insert(n, t);
        Ok(meta)
    }

    fn begin_log(&self, job: Job, first: &[LogEntry]) -> Result<CompLog> {
        let id = self.next_log_id.fetch_add(1, Ordering::Relaxed);
        let mut log = CompLog::begin(&self.region, &self.heap, id, job)?;
        for e in first {
            log.append(&self.region, &self.heap, e)?;
        }
        let head = log.head;
        self.update_root(|r| match job {
            Job::Flush(_) => r.flush_log = head,
            Job::Compaction => r.log = head,
        })?;
        Ok(log)
    }

    fn free_log(&self, segs: &[(u64, u64)]) {
        let mut h = self.heap.lock();
        for &(a, s) in segs {
            h.free(a, s);
        }
    }

    /// The B+-tree insertion thread's work: apply each batch as it arrives, logging every key
    /// that moves away from an existing file first. `logged` keys (from a log being rolled
    /// forward) are neither logged nor counted again.
    fn insert_batches(
        &self,
        log: &mut CompLog,
        rx: mpsc::Receiver<Batch>,
        logged: &HashSet<Vec<u8>>,
    ) -> Result<Applied> {
        let mut applied = Applied::default();
        for b in rx {
            if let Some(f) = b.output {
                log.append(&self.region, &self.heap, &LogEntry::Output(f))?;
            }
            // Few keys per write-lock hold, so readers never wait long behind the insertion thread.
            for chunk in b.items.chunks(8) {
                let mut tree = self.tree.write();
                for Item { key, new, src } in chunk {
                    let old = tree.get(&self.region, key)?;
                    // The same block: nothing moved (a roll-forward of a flush whose records
                    // an older version wrote without entry offsets, for one).
                    let unmoved = match (old, new) {
                        (Some(o), Some(n)) => o.same_place(n),
                        (o, n) => o.is_none() && n.is_none(),
                    };
                    if unmoved {
                        continue;
                    }
                    if src.is_some() && old.map(|l| l.file) != *src {
                        if let Some(f) = b.output {
                            *applied.skipped.entry(f).or_insert(0) += 1;
                        }
                        continue;
                    }
                    if let Some(o) = old {
                        if !logged.contains(key) {
                            log.append(&self.region, &self.heap, &LogEntry::Moved(o.file, key.clone()))?;
                            *applied.decr.entry(o.file).or_insert(0) += 1;
                        }
                    }
                    match new {
                        Some(l) => {
                            tree.put(&self.region, &self.heap, key, *l)?;
                        }
                        None => {
                            tree.remove(&self.region, &self.heap, key)?;
                        }
                    }
                }
            }
        }
        Ok(applied)
    }

    /// Run `produce` (file creation) on this thread and the insertion thread beside it,
    /// connected by a queue.
    fn pipeline(
        &self,
        log: &mut CompLog,
        logged: &HashSet<Vec<u8>>,
        produce: impl FnOnce(&mpsc::Sender<Batch>) -> Result<()>,
    ) -> Result<Applied> {
        let (tx, rx) = mpsc::channel::<Batch>();
        std::thread::scope(|s| {
            let h = s.spawn(|| self.insert_batches(log, rx, logged));
            let p = produce(&tx);
            drop(tx);
            let a = h.join().map_err(|_| Error::Poisoned("B+-tree insertion thread panicked".into()))?;
            p?;
            a
        })
    }

    /// Rotate a non-empty MemTable and flush everything (caller holds the writer lock).
    pub(super) fn flush_all(&self) -> Result<()> {
        if self.mem.read().active.keys() > 0 {
            self.rotate(0)?;
        }
        self.flush_imm()
    }

    /// Flush the Immutable MemTable, if any.
    pub(super) fn flush_imm(&self) -> Result<()> {
        self.poison_on_error("flush", || self.flush_imm_inner())
    }

    /// Run a background job; a failure poisons the store (as LevelDB's background error):
    /// its in-memory state may no longer match what is durable, so no write is accepted
    /// until a reopen recovers from the durable state. A job cancelled by `close` (which
    /// discarded its partial work) is not a failure.
    pub(super) fn poison_on_error(&self, what: &str, job: impl FnOnce() -> Result<()>) -> Result<()> {
        self.check_poisoned()?;
        let r = job();
        self.cancel.poison_failure(&self.poisoned, what, &r);
        r
    }

    fn flush_imm_inner(&self) -> Result<()> {
        let _job = self.flush_job.lock();
        let Some(imm) = self.mem.read().imm.clone() else { return Ok(()) };
        self.run_flush(&imm, None)
    }

    /// Flush `imm`. `resume` = (output file, keys already logged as moved, their
    /// decrements) when rolling forward a flush a crash interrupted.
    fn run_flush(&self, imm: &Arc<Memtable>, resume: Option<(Option<u64>, Vec<LogEntry>)>) -> Result<()> {
        let entries = imm.entries(&self.region)?;
        let deletes: Vec<Vec<u8>> =
            entries.iter().filter(|(_, n)| n.kind != KIND_PUT).map(|(k, _)| k.clone()).collect();
        let (out_file, carried) = match resume {
            Some((f, moved)) => (f, moved),
            None => (None, Vec::new()),
        };
        let logged: HashSet<Vec<u8>> = carried
            .iter()
            .filter_map(|e| match e {
                LogEntry::Moved(_, k) => Some(k.clone()),
                _ => None,
            })
            .collect();
        let mut decr: HashMap<u64, u64> = HashMap::new();
        for e in &carried {
            if let LogEntry::Moved(f, _) = e {
                *decr.entry(*f).or_insert(0) += 1;
            }
        }
        let puts = entries.iter().filter(|(_, n)| n.kind == KIND_PUT).count();
        let mut first = carried.clone();
        // Roll-forward: the output file exists and is synced; its keys' locations come from it.
        let existing: Option<(u64, Arc<Table>)> = match out_file {
            Some(f) => Some((f, self.table(f)?)),
            None => None,
        };
        if let Some((f, _)) = &existing {
            first.insert(0, LogEntry::Output(*f));
        }
        let mut log = self.begin_log(Job::Flush(imm.gen), &first)?;
        // The file this flush adds, as the MANIFEST will record it.
        let mut added: Option<(u64, FileMeta)> = None;
        let applied = self.pipeline(&mut log, &logged, |tx| {
            let mut items: Vec<Item> = Vec::with_capacity(entries.len());
            let mut output = None;
            if let Some((f, t)) = &existing {
                let mut m = FileMeta { total: t.entries(), live: t.entries(), size: t.size(), ..FileMeta::default() };
                t.for_each(|e, h, pos| {
                    if items.is_empty() {
                        m.smallest = e.key.to_vec();
                    }
                    m.largest = e.key.to_vec();
                    let new = Some(Loc { file: *f, offset: h.offset, size: h.size, entry: Some(pos) });
                    items.push(Item { key: e.key.to_vec(), new, src: None });
                    Ok(())
                })?;
                added = Some((*f, m));
            } else if puts > 0 {
                // File creation: the newest put of every key, in key order.
                let n = self.alloc_file();
                let mut b = self.builder(n)?;
                let mut keys = Vec::with_capacity(puts);
                for (k, node) in entries.iter().filter(|(_, n)| n.kind == KIND_PUT) {
                    b.add(Kind::Put, k, node.value)?;
                    keys.push((k.clone(), None));
                }
                let meta = self.finish_table(n, b)?;
                items = items_of(&meta, n, keys)?;
                output = Some(n);
                added = Some((n, file_meta(&meta)));
            }
            items.extend(deletes.iter().map(|k| Item { key: k.clone(), new: None, src: None }));
            items.sort_by(|a, b| a.key.cmp(&b.key));
            tx.send(Batch { output, items }).map_err(|_| Error::Poisoned("B+-tree insertion thread stopped".into()))
        })?;
        for (f, d) in applied.decr {
            *decr.entry(f).or_insert(0) += d;
        }
        // Commit: the MANIFEST edit.
        self.commit(imm.gen, added, &decr, &[], &[])?;
        // Release the log and the Immutable MemTable.
        self.update_root(|r| {
            r.flush_log = 0;
            if r.imm == imm.addr {
                r.imm = 0;
            }
        })?;
        self.free_log(log.segments());
        {
            let mut mem = self.mem.write();
            if mem.imm.as_ref().is_some_and(|m| Arc::ptr_eq(m, imm)) {
                mem.imm = None;
            }
        }
        // Iterators read the arena without a lock: one created before it left `mem` may
        // still read its nodes, so the free waits for those (pins).
        let now = self.pins.lock().park(vec![(imm.addr, imm.size)]);
        self.free_pm(now);
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        self.flushed_cv.notify_all();
        Ok(())
    }

    /// Log one MANIFEST edit: a flushed memtable generation (0 = none) and/or files added,
    /// live-count decrements, files removed; recomputes the live-ratio candidates.
    fn commit(
        &self,
        gen: u64,
        added: Option<(u64, FileMeta)>,
        decr: &HashMap<u64, u64>,
        more: &[(u64, FileMeta)],
        removed: &[u64],
    ) -> Result<()> {
        let mut vs = self.version.lock();
        let mut edits = Vec::new();
        if let Some((n, m)) = added {
            edits.push(Edit::AddFile(n, m));
        }
        for (n, m) in more {
            edits.push(Edit::AddFile(*n, m.clone()));
        }
        for (f, d) in decr {
            if let Some(m) = vs.version.files.get(f) {
                edits.push(Edit::SetLive(*f, m.live.saturating_sub(*d)));
            } else if let Some(inf) = self.inflight.lock().as_mut().filter(|i| i.outputs.contains(f)) {
                // An output of the compaction in flight: its count is settled at its commit.
                *inf.pending_decr.entry(*f).or_insert(0) += d;
            }
        }
        for f in removed {
            edits.push(Edit::RemoveFile(*f));
        }
        let mut after = vs.version.clone();
        after.apply(&edits);
        if self.opts.enable_live_ratio {
            for f in decr.keys() {
                if let Some(m) = after.files.get(f) {
                    if (m.live as f64) < self.opts.live_key_threshold * m.total as f64 && after.candidates.insert(*f) {
                        self.counters.cand_live_ratio.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        let cands: Vec<u64> = after.candidates.iter().copied().filter(|c| after.files.contains_key(c)).collect();
        after.candidates = cands.iter().copied().collect();
        edits.push(Edit::Candidates(cands));
        edits.push(Edit::NextFile(after.next_file));
        if gen > 0 {
            after.counter = after.counter.max(gen);
            edits.push(Edit::Counter(after.counter));
        }
        vs.log(&self.fs, &edits, after)
    }

    /// Leaf-node scan (§3.3): scan `leaf_scan_files` SSTables' worth of keys round-robin;
    /// more than `leaf_node_threshold` distinct files among them become candidates.
    fn leaf_scan(&self) -> Result<()> {
        let n = {
            let vs = self.version.lock();
            let files = vs.version.files.len() as u64;
            if files == 0 {
                return Ok(());
            }
            let live: u64 = vs.version.files.values().map(|m| m.live).sum();
            (self.opts.leaf_scan_files * (live / files).max(1)) as usize
        };
        let mut cursor = self.leaf_cursor.lock();
        let entries = {
            let tree = self.tree.read();
            tree.range(&self.region, &cursor, !cursor.is_empty(), None, n)?
        };
        *cursor = if entries.len() < n { Vec::new() } else { entries.last().map(|e| e.0.clone()).unwrap_or_default() };
        let files: BTreeSet<u64> = entries.iter().map(|(_, l)| l.file).collect();
        if files.len() > self.opts.leaf_node_threshold {
            let mut vs = self.version.lock();
            for f in files {
                if vs.version.files.contains_key(&f) && vs.version.candidates.insert(f) {
                    self.counters.cand_leaf_scan.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }

    /// Range-query sequentiality (§3.3): `files` are the files of the tree entries a scan
    /// returned, in key order; the sub-range with the most distinct files adds them when
    /// there are more than `seq_degree_threshold`.
    pub(super) fn note_sequentiality(&self, files: &[u64]) -> Result<()> {
        let mut worst: BTreeSet<u64> = BTreeSet::new();
        for sub in files.chunks(self.opts.seq_subrange_keys) {
            let u: BTreeSet<u64> = sub.iter().copied().collect();
            if u.len() > worst.len() {
                worst = u;
            }
        }
        if worst.len() <= self.opts.seq_degree_threshold {
            return Ok(());
        }
        let trigger = {
            let mut vs = self.version.lock();
            for f in worst {
                if vs.version.files.contains_key(&f) && vs.version.candidates.insert(f) {
                    self.counters.cand_seq_degree.fetch_add(1, Ordering::Relaxed);
                }
            }
            vs.version.candidates.len() >= self.opts.candidate_trigger
        };
        if trigger && self.opts.background {
            self.work.lock().compact = true;
            self.work_cv.notify_all();
        }
        Ok(())
    }

    /// A compaction round: a leaf scan, then merge the picked candidates; with `force`,
    /// repeat until no candidate is left.
    pub(super) fn maybe_compact(&self, force: bool) -> Result<()> {
        self.poison_on_error("compaction", || self.maybe_compact_inner(force))
    }

    fn maybe_compact_inner(&self, force: bool) -> Result<()> {
        let _job = self.compaction_job.lock();
        if self.opts.enable_leaf_scan {
            self.leaf_scan()?;
        }
        for _ in 0..10_000 {
            // No new compaction once cancelled.
            if self.cancel.is_cancelled() {
                break;
            }
            let inputs = pick(&self.version.lock().version, self.opts.max_merge_files);
            if inputs.is_empty() {
                break;
            }
            self.compact_locked(&inputs)?;
            if !force {
                break;
            }
        }
        Ok(())
    }

    /// Compact `inputs` (restart after a crash).
    pub(super) fn compact_files(&self, inputs: &[u64]) -> Result<()> {
        self.poison_on_error("compaction", || self.compact_files_inner(inputs))
    }

    fn compact_files_inner(&self, inputs: &[u64]) -> Result<()> {
        let _job = self.compaction_job.lock();
        let live: Vec<u64> = {
            let vs = self.version.lock();
            inputs.iter().copied().filter(|f| vs.version.files.contains_key(f)).collect()
        };
        if live.is_empty() {
            return Ok(());
        }
        self.compact_locked(&live)
    }

    /// Merge `inputs` into new files, keeping only entries the tree points at (caller holds
    /// the compaction lock). In background mode a MemTable that fills meanwhile is flushed
    /// in the middle of the merge (as LevelDB does), so writers do not wait for the merge.
    fn compact_locked(&self, inputs: &[u64]) -> Result<()> {
        let mut iters = Vec::with_capacity(inputs.len());
        for &f in inputs {
            iters.push(TableIter { table: self.table(f)?, file: f, next_block: 0, entries: Vec::new(), pos: 0 });
        }
        *self.inflight.lock() = Some(Inflight::default());
        let first: Vec<LogEntry> = inputs.iter().map(|&f| LogEntry::Input(f)).collect();
        let mut log = self.begin_log(Job::Compaction, &first)?;
        let mut outputs: Vec<(u64, FileMeta)> = Vec::new();
        // Every file this job creates, shipped or not (what a cancellation deletes).
        let mut created: Vec<u64> = Vec::new();
        let mut dropped = 0u64;
        let r = self.pipeline(&mut log, &HashSet::new(), |tx| {
            type Open = (u64, TableBuilder, Vec<(Vec<u8>, Option<u64>)>);
            let mut cur: Option<Open> = None;
            let ship = |(n, b, keys): Open, outputs: &mut Vec<(u64, FileMeta)>| {
                let meta = self.finish_table(n, b)?;
                if let Some(inf) = self.inflight.lock().as_mut() {
                    inf.outputs.insert(n);
                }
                outputs.push((n, file_meta(&meta)));
                let items = items_of(&meta, n, keys)?;
                tx.send(Batch { output: Some(n), items })
                    .map_err(|_| Error::Poisoned("B+-tree insertion thread stopped".into()))
            };
            let mut merged = 0u64;
            loop {
                merged += 1;
                // Safe point: every shipped output is applied to the tree and logged.
                self.cancel.every(merged)?;
                if self.opts.background && merged.is_multiple_of(64) && self.mem.read().imm.is_some() {
                    self.flush_imm()?;
                    self.counters.flushes_in_compaction.fetch_add(1, Ordering::Relaxed);
                }
                // The smallest current key over all inputs.
                let mut best: Option<(usize, Vec<u8>)> = None;
                for (i, it) in iters.iter_mut().enumerate() {
                    if let Some((k, _)) = it.peek()? {
                        if best.as_ref().is_none_or(|(_, b)| k < b) {
                            best = Some((i, k.clone()));
                        }
                    }
                }
                let Some((i, _)) = best else { break };
                let it = &mut iters[i];
                let Some((k, v)) = it.entries.get(it.pos).cloned() else { break };
                it.pos += 1;
                let valid = self.tree.read().get(&self.region, &k)?.map(|l| l.file) == Some(it.file);
                if !valid {
                    dropped += 1;
                    continue;
                }
                if cur.is_none() {
                    // Safe point: between output files.
                    self.cancel.point()?;
                    let n = self.alloc_file();
                    created.push(n);
                    cur = Some((n, self.builder(n)?, Vec::new()));
                }
                if let Some((_, b, keys)) = cur.as_mut() {
                    b.add(Kind::Put, &k, &v)?;
                    keys.push((k, Some(it.file)));
                    if b.approximate_size() >= self.opts.output_file_size {
                        if let Some(o) = cur.take() {
                            ship(o, &mut outputs)?;
                        }
                    }
                }
            }
            if let Some(o) = cur.take() {
                ship(o, &mut outputs)?;
            }
            Ok(())
        });
        let applied = self.cancel.on_cancel(r, || self.discard_compaction(&log, &created))?;
        self.commit_compaction(&outputs, inputs, &applied.skipped)?;
        self.update_root(|r| r.log = 0)?;
        self.free_log(log.segments());
        {
            let _t = self.tree.write();
            let mut tables = self.tables.write();
            for f in inputs {
                tables.remove(f);
            }
        }
        for &f in inputs {
            self.fs.remove(&path_of(&self.dir, f))?;
        }
        self.fs.sync_dir(&self.dir)?;
        let c = &self.counters;
        c.compactions.fetch_add(1, Ordering::Relaxed);
        c.compaction_inputs.fetch_add(inputs.len() as u64, Ordering::Relaxed);
        c.compaction_outputs.fetch_add(outputs.len() as u64, Ordering::Relaxed);
        c.entries_dropped.fetch_add(dropped, Ordering::Relaxed);
        Ok(())
    }

    /// Point every key a compaction moved into one of `outputs` (its log's `Moved`
    /// entries) back at its block in the old file. A key a flush moved on since stays where
    /// it is; returns those keys' old files with their counts (their live counts were not
    /// decremented: the flush saw the key leave an output, not its input).
    fn roll_back_moves(&self, entries: &[LogEntry], outputs: &HashSet<u64>) -> Result<HashMap<u64, u64>> {
        let mut moved_on: HashMap<u64, u64> = HashMap::new();
        let mut tree = self.tree.write();
        for e in entries {
            if let LogEntry::Moved(old, key) = e {
                if !tree.get(&self.region, key)?.is_some_and(|l| outputs.contains(&l.file)) {
                    *moved_on.entry(*old).or_insert(0) += 1;
                    continue;
                }
                let t = self.table(*old)?;
                let Some((_, _, h)) = t.find(key)? else {
                    return Err(Error::corruption(
                        t.path(),
                        0,
                        "a key the compaction log moved is missing from its old file",
                    ));
                };
                tree.put(
                    &self.region,
                    &self.heap,
                    key,
                    Loc { file: *old, offset: h.offset, size: h.size, entry: None },
                )?;
            }
        }
        Ok(moved_on)
    }

    /// Undo a compaction `close` cancelled before its commit, as recovery would after a
    /// crash but without restarting it: keys moved into its outputs point back at their
    /// inputs, the inputs' live counts lose the keys flushes moved on meanwhile, the log is
    /// released and every file it `created` is deleted. The store is then as if the
    /// compaction never ran (a crash during this is recovered from the log, which goes
    /// last but for the unreferenced files).
    fn discard_compaction(&self, log: &CompLog, created: &[u64]) -> Result<()> {
        let outputs: HashSet<u64> = created.iter().copied().collect();
        let (entries, _) = complog::read(&self.region, log.head)?;
        let moved_on = self.roll_back_moves(&entries, &outputs)?;
        self.inflight.lock().take();
        if !moved_on.is_empty() {
            self.commit(0, None, &moved_on, &[], &[])?;
        }
        self.update_root(|r| r.log = 0)?;
        self.free_log(log.segments());
        {
            let _t = self.tree.write();
            let mut tables = self.tables.write();
            for f in created {
                tables.remove(f);
            }
        }
        for &f in created {
            let p = path_of(&self.dir, f);
            if self.fs.exists(&p) {
                self.fs.remove(&p)?;
            }
        }
        Ok(self.fs.sync_dir(&self.dir)?)
    }

    /// The MANIFEST edit of a compaction: inputs out, outputs in with their live counts less
    /// the entries that were skipped or that flushes moved away meanwhile.
    fn commit_compaction(
        &self,
        outputs: &[(u64, FileMeta)],
        inputs: &[u64],
        skipped: &HashMap<u64, u64>,
    ) -> Result<()> {
        let mut vs = self.version.lock();
        let pending = self.inflight.lock().take().unwrap_or_default().pending_decr;
        let mut edits = Vec::new();
        for (n, m) in outputs {
            let gone = skipped.get(n).copied().unwrap_or(0) + pending.get(n).copied().unwrap_or(0);
            edits.push(Edit::AddFile(*n, FileMeta { live: m.total.saturating_sub(gone), ..m.clone() }));
        }
        for f in inputs {
            edits.push(Edit::RemoveFile(*f));
        }
        let mut after = vs.version.clone();
        after.apply(&edits);
        edits.push(Edit::Candidates(after.candidates.iter().copied().collect()));
        edits.push(Edit::NextFile(after.next_file));
        vs.log(&self.fs, &edits, after)
    }

    /// Set every file's live count to the number of tree entries pointing at it (after a
    /// compaction was rolled back: flushes that ran during it moved keys out of its outputs,
    /// which the rollback cannot attribute to the inputs).
    fn recount_live(&self) -> Result<()> {
        let counts = self.count_tree_entries()?;
        let mut vs = self.version.lock();
        let edits: Vec<Edit> = vs
            .version
            .files
            .iter()
            .filter_map(|(n, m)| {
                let c = counts.get(n).copied().unwrap_or(0);
                (c != m.live).then_some(Edit::SetLive(*n, c))
            })
            .collect();
        if edits.is_empty() {
            return Ok(());
        }
        let mut after = vs.version.clone();
        after.apply(&edits);
        vs.log(&self.fs, &edits, after)
    }

    fn count_tree_entries(&self) -> Result<HashMap<u64, u64>> {
        let mut live: HashMap<u64, u64> = HashMap::new();
        self.tree.read().for_each(&self.region, |_, loc| {
            *live.entry(loc.file).or_insert(0) += 1;
            Ok(())
        })?;
        Ok(live)
    }

    /// Steps 4–5 of recovery (module docs).
    pub(super) fn finish_recovery(&self) -> Result<()> {
        // File numbers never go backwards past a file that exists.
        let mut max_seen = 0;
        for name in self.fs.list(&self.dir)? {
            if let Some(n) = table_number(&name) {
                max_seen = max_seen.max(n);
            }
        }
        {
            let mut vs = self.version.lock();
            vs.version.next_file = vs.version.next_file.max(max_seen + 1);
        }
        let root = self.root.lock().0;
        let mut restart = None;
        let mut recount = false;
        // A compaction in flight: finished if its edit is durable, else rolled back (and
        // restarted below).
        if root.log != 0 {
            let (entries, segs) = complog::read(&self.region, root.log)?;
            if let Some(LogEntry::Begin(Job::Compaction)) = entries.first() {
                let inputs = log_files(&entries, |e| match e {
                    LogEntry::Input(f) => Some(*f),
                    _ => None,
                });
                let outputs: HashSet<u64> = log_files(&entries, |e| match e {
                    LogEntry::Output(f) => Some(*f),
                    _ => None,
                })
                .into_iter()
                .collect();
                let committed = {
                    let vs = self.version.lock();
                    inputs.iter().all(|f| !vs.version.files.contains_key(f))
                };
                if !committed {
                    self.roll_back_moves(&entries, &outputs)?;
                    recount = true;
                    restart = Some(inputs.clone());
                }
            }
            self.update_root(|r| r.log = 0)?;
            self.free_log(&segs);
        }
        // A flush in flight: rolled forward unless its edit is durable.
        if root.flush_log != 0 {
            let (entries, segs) = complog::read(&self.region, root.flush_log)?;
            let counter = self.version.lock().version.counter;
            match entries.first() {
                Some(LogEntry::Begin(Job::Flush(g))) if *g > counter => {
                    let imm = self.mem.read().imm.clone();
                    let imm = imm.filter(|m| m.gen == *g).ok_or_else(|| {
                        self.region
                            .corruption(root.flush_log, "compaction log names a flush of a MemTable that is gone")
                    })?;
                    let out = log_files(&entries, |e| match e {
                        LogEntry::Output(f) => Some(*f),
                        _ => None,
                    })
                    .first()
                    .copied();
                    let moved: Vec<LogEntry> =
                        entries.iter().filter(|e| matches!(e, LogEntry::Moved(..))).cloned().collect();
                    if let Some(f) = out {
                        let t = Table::open_cached(&self.fs, &path_of(&self.dir, f), f, &self.cache)?;
                        self.tables.write().insert(f, t);
                    }
                    // A new log replaces the old one (carrying its entries); then the old
                    // segments are free.
                    let _job = self.flush_job.lock();
                    self.run_flush(&imm, Some((out, moved)))?;
                    self.free_log(&segs);
                }
                _ => {
                    // A committed flush, or a log whose Begin never became durable.
                    self.update_root(|r| r.flush_log = 0)?;
                    self.free_log(&segs);
                }
            }
        }
        // A leftover Immutable MemTable: drop it if its flush is committed, else flush it.
        let imm = self.mem.read().imm.clone();
        if let Some(imm) = imm {
            if imm.gen <= self.version.lock().version.counter {
                self.update_root(|r| r.imm = 0)?;
                self.mem.write().imm = None;
                self.heap.lock().free(imm.addr, imm.size);
            } else {
                self.flush_imm()?;
            }
        }
        // Files no version references: outputs of a rolled-back job, or of a crash before
        // the job's log began.
        let live: HashSet<u64> = self.version.lock().version.files.keys().copied().collect();
        let mut removed = false;
        for name in self.fs.list(&self.dir)? {
            if let Some(n) = table_number(&name) {
                if !live.contains(&n) {
                    self.tables.write().remove(&n);
                    self.fs.remove(&self.dir.join(&name))?;
                    removed = true;
                }
            }
        }
        if removed {
            self.fs.sync_dir(&self.dir)?;
        }
        if recount {
            self.recount_live()?;
        }
        if let Some(inputs) = restart {
            if self.opts.background {
                self.work.lock().restart = Some(inputs);
            } else {
                self.compact_files(&inputs)?;
            }
        }
        Ok(())
    }

    /// `check`: every checksum (tree, memtables, SSTables), every tree entry resolves to its
    /// key in a live file, and every file's live-key count equals the tree entries pointing
    /// at it.
    pub(super) fn check_impl(&self) -> Result<Vec<String>> {
        let _c = self.compaction_job.lock();
        let _f = self.flush_job.lock();
        let mut problems = Vec::new();
        let tree = self.tree.read();
        problems.extend(tree.check(&self.region)?);
        {
            let mem = self.mem.read();
            problems.extend(mem.active.check(&self.region));
            if let Some(m) = &mem.imm {
                problems.extend(m.check(&self.region));
            }
        }
        let version = self.version.lock().version.clone();
        let mut live: HashMap<u64, u64> = HashMap::new();
        tree.for_each(&self.region, |k, loc| {
            *live.entry(loc.file).or_insert(0) += 1;
            if !version.files.contains_key(&loc.file) {
                problems.push(format!("key {} points at file {} not in the MANIFEST", crate::escape(k), loc.file));
            } else if let Err(e) = self.read_at(k, loc) {
                problems.push(e.to_string());
            }
            Ok(())
        })?;
        for (n, m) in &version.files {
            let got = live.get(n).copied().unwrap_or(0);
            if got != m.live {
                problems.push(format!("{}: MANIFEST says {} live keys, the B+-tree has {got}", table_name(*n), m.live));
            }
            match self.table(*n) {
                Ok(t) => {
                    if let Err(e) = t.for_each(|_, _, _| Ok(())) {
                        problems.push(e.to_string());
                    }
                }
                Err(e) => problems.push(e.to_string()),
            }
        }
        Ok(problems)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    /// A write still running when `close` stopped the worker, that needs a rotation while
    /// an Immutable MemTable waits for its flush: nobody else will flush it, so the write
    /// flushes it itself — it never waits for ever; every write succeeds and reads back.
    /// Before the fix it did; a write that does not return within 30 s fails the test.
    #[test]
    fn a_write_after_the_worker_stopped_does_not_wait_for_it() {
        use std::sync::Arc;

        use crate::engine::{Cond, Engine};
        let (dev, fs) = (crate::pm::sim::SimDevice::new(), crate::fs::FaultFs::new());
        let o = crate::testing::sim_options(crate::options::Preset::Slmdb, &dev, &fs)
            .slmdb(crate::options::SlmdbOptions { background: true, ..crate::testing::slmdb_small() });
        let db = Arc::new(super::super::Slmdb::open(crate::engine::test_ctx(&o, &fs, true, 5)).unwrap());
        db.stop_worker();
        let put = |db: &super::super::Slmdb, i: u32| {
            let op = crate::batch::BatchOp::Put { key: format!("k{i:05}").into_bytes(), value: vec![b'v'; 200] };
            db.write(&[op], Cond::None)
        };
        let mut i = 0;
        while db.inner.mem.read().imm.is_none() {
            assert!(i < 10_000, "no rotation");
            put(&db, i).unwrap();
            i += 1;
        }
        // Fill the new MemTable too: the write that needs the next rotation meets the
        // Immutable MemTable the stopped worker never flushed. Every write must succeed.
        let writer = db.clone();
        let last = crate::testing::returns("a write needing a rotation", move || {
            let active = writer.inner.mem.read().active.clone();
            let mut r = Err("no second rotation".to_string());
            for k in i..i + 10_000 {
                if let Err(e) = put(&writer, k) {
                    r = Err(format!("put {k}: {e}"));
                    break;
                }
                if !Arc::ptr_eq(&writer.inner.mem.read().active, &active) {
                    r = Ok(k);
                    break;
                }
            }
            r
        })
        .unwrap();
        for k in 0..=last {
            let got = db.get(format!("k{k:05}").as_bytes()).unwrap();
            assert_eq!(got.as_deref(), Some(&[b'v'; 200][..]), "key {k}");
        }
    }

    use super::*;

    fn meta(a: &str, b: &str) -> FileMeta {
        FileMeta {
            total: 10,
            live: 10,
            size: 1,
            smallest: a.as_bytes().to_vec(),
            largest: b.as_bytes().to_vec(),
            level: 0,
        }
    }

    #[test]
    fn overlap_ratio_follows_the_papers_formula() {
        // Ranges [k10, k30] and [k20, k40] over the same 8-byte window: (30-20)/(40-10) = 1/3
        // of the key space between them, computed on the big-endian numbers.
        let r = overlap_ratio(&meta("k10", "k30"), &meta("k20", "k40"));
        let n = |s: &str| key_num(s.as_bytes(), 1);
        let want = (n("k30") - n("k20")) / (n("k40") - n("k10"));
        assert!((r - want).abs() < 1e-12, "{r} vs {want}");
        assert_eq!(overlap_ratio(&meta("a", "b"), &meta("c", "d")), 0.0);
        assert_eq!(overlap_ratio(&meta("a", "z"), &meta("a", "z")), 1.0);
        assert_eq!(overlap_ratio(&meta("m", "m"), &meta("m", "m")), 1.0);
    }

    #[test]
    fn pick_takes_the_most_overlapping_candidate_and_its_overlapping_peers() {
        let mut v = Version::default();
        v.files.insert(1, meta("a", "z")); // overlaps 2, 3, 4: largest sum
        v.files.insert(2, meta("b", "f"));
        v.files.insert(3, meta("g", "k"));
        v.files.insert(4, meta("x", "y"));
        v.files.insert(5, meta("0", "1")); // overlaps nothing
        v.files.insert(6, meta("b", "c")); // not a candidate
        v.candidates = [1, 2, 3, 4, 5].into_iter().collect();
        assert_eq!(pick(&v, 10), vec![1, 2, 3, 4]);
        // The bound keeps the chosen file and its largest overlaps.
        let two = pick(&v, 2);
        assert_eq!(two.len(), 2);
        assert!(two.contains(&1));
        // A lone candidate (live-ratio garbage collection) is compacted by itself.
        v.candidates = [5].into_iter().collect();
        assert_eq!(pick(&v, 10), vec![5]);
        v.candidates.clear();
        assert!(pick(&v, 10).is_empty());
    }
}
