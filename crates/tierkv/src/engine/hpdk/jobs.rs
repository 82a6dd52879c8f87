//! HPDK's background jobs and recovery: flush (level compression + B+-tree update), the
//! live-item-rate dynamic merge (Algorithm 1), the B+-tree recovery file, and open.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, RwLock};

use super::layout::{self, Dump, Slot, TSlot};
use super::vlog::{scan_pool, PoolCount, PoolInfo, State, Vlog};
use super::{
    dump_name, tv, untv, wal_name, Counters, Inner, Mem, MemState, PmTable, VersionState, Work, Writer, MERGE_LOG,
    TOMB, TREE_NODE,
};
use crate::engine::EngineCtx;
use crate::error::{Error, Result};
use crate::fs::Fs;
use crate::index::bplus::BPlusTree;
use crate::manifest::{Edit, FileMeta, Manifest, Version};
use crate::pm::heap::alloc_or_grow;
use crate::pm::{PmFile, Region};
use crate::sstable::{Kind, Table, TableBuilder};

/// Tree updates applied per write-lock hold.
const CHUNK: usize = 256;

/// The `covered` number of a B+-tree recovery file's name.
pub(crate) fn dump_number(name: &str) -> Option<u64> {
    name.strip_prefix("BTREE-")?.parse().ok()
}

/// The generation of a WAL file's name.
pub(crate) fn wal_number(name: &str) -> Option<u64> {
    name.strip_prefix("wal-")?.strip_suffix(".log")?.parse().ok()
}

/// Candidates of a version: tables whose live-item rate is below `threshold`.
pub(crate) fn candidates(v: &Version, threshold: f64) -> Vec<u64> {
    v.files
        .iter()
        .filter(|(_, m)| m.total > 0 && (m.live as f64) < threshold * m.total as f64)
        .map(|(n, _)| *n)
        .collect()
}

impl Inner {
    /// Rotate a non-empty MemTable and flush everything (caller holds the writer lock).
    pub(crate) fn flush_all(&self, w: &mut Writer) -> Result<()> {
        if !self.mem.read().active.map.read().is_empty() {
            self.rotate(w)?;
        }
        self.flush_imm()
    }

    /// Place a finished table image in PM: extent, bytes, directory slot, all persisted.
    fn place_table(&self, number: u64, bytes: &[u8]) -> Result<Arc<PmTable>> {
        let size = bytes.len() as u64;
        let addr = alloc_or_grow(&mut self.heap.lock(), &self.region, size)?;
        // SAFETY: a freshly allocated extent nobody else knows yet.
        unsafe { self.region.write(addr, bytes)? };
        self.region.flush(addr, size);
        self.region.fence();
        let mut tables = self.tables.write();
        let slot = (0..layout::DIR_SLOTS as u16)
            .find(|s| !tables.contains_key(s))
            .ok_or_else(|| Error::PmFull(format!("all {} SSTable slots are in use", layout::DIR_SLOTS)))?;
        let ts = TSlot { slot, number, addr, size: size as u32 };
        let sa = layout::TDIR_ADDR + u64::from(slot) * layout::SLOT_LEN;
        // SAFETY: table slots are written under the tables write lock (and by open).
        unsafe { self.region.write(sa, &layout::encode_tslot(&ts))? };
        self.region.persist(sa, layout::SLOT_LEN);
        let t = open_pm_table(&self.region, &ts)?;
        tables.insert(slot, t.clone());
        Ok(t)
    }

    /// Free a table: directory slot zeroed (persisted), extent back to the heap.
    fn free_table(&self, t: &PmTable) -> Result<()> {
        let sa = layout::TDIR_ADDR + u64::from(t.slot) * layout::SLOT_LEN;
        self.tables.write().remove(&t.slot);
        // SAFETY: the slot belongs to a table no version references any more.
        unsafe { self.region.write(sa, &[0u8; 32])? };
        self.region.persist(sa, layout::SLOT_LEN);
        self.heap.lock().free(t.addr, t.size.div_ceil(64) * 64);
        Ok(())
    }

    fn next_number(&self) -> u64 {
        let mut v = self.version.lock();
        let n = v.version.next_file;
        v.version.next_file += 1;
        n
    }

    /// Flush the Immutable MemTable, if any (§III-C): one SSTable into PM, the entries into
    /// the B+-tree, then the MANIFEST commit.
    pub(crate) fn flush_imm(&self) -> Result<()> {
        self.poison_on_error("flush", || self.flush_imm_inner())
    }

    /// Run a background job; a failure poisons the store (as LevelDB's background error):
    /// its in-memory state may no longer match what is durable, so no write is accepted
    /// until a reopen recovers from the durable state. A merge cancelled by `close` (which
    /// discarded its partial work) is not a failure.
    pub(crate) fn poison_on_error(&self, what: &str, job: impl FnOnce() -> Result<()>) -> Result<()> {
        self.poisoned.check()?;
        let r = job();
        self.cancel.poison_failure(&self.poisoned, what, &r);
        r
    }

    fn flush_imm_inner(&self) -> Result<()> {
        let _job = self.flush_job.lock();
        let Some(imm) = self.mem.read().imm.clone() else { return Ok(()) };
        // The Immutable MemTable no longer changes: read it in place.
        let map = imm.map.read();
        let entries: Vec<(&Vec<u8>, u64)> = map.iter().map(|(k, a)| (k, *a)).collect();
        let mut edits = Vec::new();
        let mut decr_pools: BTreeMap<u16, i64> = BTreeMap::new();
        if !entries.is_empty() {
            let number = self.next_number();
            let mut b = TableBuilder::in_memory(self.opts.block_size, self.opts.bloom_bits_per_key);
            for (k, a) in &entries {
                if *a == TOMB {
                    b.add(Kind::Delete, k, &[])?;
                } else {
                    b.add(Kind::Put, k, &layout::vaddr_bytes(*a))?;
                }
            }
            let (meta, bytes) = b.finish_mem()?;
            let t = self.place_table(number, &bytes)?;
            let mut live = entries.iter().filter(|e| e.1 != TOMB).count() as u64;
            let mut decr_tables: HashMap<u16, u64> = HashMap::new();
            if self.opts.use_btree {
                live = 0;
                let mut incr_pools: BTreeMap<u16, i64> = BTreeMap::new();
                for chunk in entries.chunks(CHUNK) {
                    let mut tree = self.tree.write();
                    for (k, a) in chunk {
                        let old = if *a == TOMB {
                            tree.remove(k).map(|(v, _)| v)
                        } else {
                            live += 1;
                            *incr_pools.entry(layout::split_vaddr(*a).0).or_insert(0) += 1;
                            tree.insert(k, tv(*a, t.slot)).0
                        };
                        if let Some(o) = old {
                            let (oa, os) = untv(o);
                            *decr_tables.entry(os).or_insert(0) += 1;
                            *decr_pools.entry(layout::split_vaddr(oa).0).or_insert(0) -= 1;
                        }
                    }
                }
                self.vlog.tree_refs(&incr_pools);
            }
            let tables = self.tables.read();
            let mut v = self.version.lock();
            let mut after = v.version.clone();
            after.files.insert(
                number,
                FileMeta {
                    total: meta.entries,
                    live,
                    size: meta.size,
                    smallest: meta.smallest,
                    largest: meta.largest,
                    level: 0,
                },
            );
            edits.push(Edit::AddFile(number, after.files[&number].clone()));
            // A merge output not installed yet is not in the version: its live count is
            // taken from the tree when it installs.
            for (slot, n) in decr_tables {
                let Some(old) = tables.get(&slot) else { continue };
                if let Some(m) = after.files.get_mut(&old.number) {
                    m.live = m.live.saturating_sub(n);
                    edits.push(Edit::SetLive(old.number, m.live));
                }
            }
            drop(tables);
            after.counter = imm.gen;
            after.candidates = candidates(&after, self.opts.live_rate_threshold).into_iter().collect();
            edits.push(Edit::Counter(after.counter));
            edits.push(Edit::NextFile(after.next_file));
            edits.push(Edit::Candidates(after.candidates.iter().copied().collect()));
            commit(&mut v, &self.fs, &edits, after)?;
        } else {
            let mut v = self.version.lock();
            let mut after = v.version.clone();
            after.counter = imm.gen;
            commit(&mut v, &self.fs, &[Edit::Counter(imm.gen)], after)?;
        }
        // Committed: references the flush removed may now let a pool be reused.
        self.vlog.tree_refs(&decr_pools);
        self.vlog.release_mem(&imm.refs.lock());
        self.mem.write().imm = None;
        let _ = self.fs.remove(&self.dir.join(wal_name(imm.gen)));
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        let ready = self.version.lock().version.candidates.len() >= self.opts.merge_trigger;
        if ready && self.opts.enable_merge && self.opts.use_btree && self.opts.background {
            self.signal(|w| w.merge = true);
        }
        self.flushed_cv.notify_all();
        Ok(())
    }

    /// Merge the candidate set when it has reached the trigger (or, with `force`, whenever
    /// it is non-empty).
    pub(crate) fn maybe_merge(&self, force: bool) -> Result<()> {
        // No new merge once cancelled (close's own flushes end up here too).
        if !self.opts.enable_merge || !self.opts.use_btree || self.cancel.is_cancelled() {
            return Ok(());
        }
        let cands: Vec<u64> = self.version.lock().version.candidates.iter().copied().collect();
        if cands.is_empty() || (!force && cands.len() < self.opts.merge_trigger) {
            return Ok(());
        }
        self.merge_tables(&cands)
    }

    /// Algorithm 1 over `inputs` (table numbers).
    pub(crate) fn merge_tables(&self, inputs: &[u64]) -> Result<()> {
        self.poison_on_error("merge", || self.merge_tables_inner(inputs))
    }

    fn merge_tables_inner(&self, inputs: &[u64]) -> Result<()> {
        let _job = self.merge_job.lock();
        let r = self.merge_locked(inputs);
        self.cancel.on_cancel(r, || self.discard_merge())
    }

    /// A merge `close` cancelled: every safe point precedes the output's placement in PM,
    /// so the merge log is all it wrote (and the next open would restart the merge from
    /// it). Removed, the store is as if the merge never began.
    fn discard_merge(&self) -> Result<()> {
        let log = self.dir.join(MERGE_LOG);
        if self.fs.exists(&log) {
            self.fs.remove(&log)?;
        }
        Ok(self.fs.sync_dir(&self.dir)?)
    }

    /// Algorithm 1 (caller holds the merge lock). Safe points: before each input table and
    /// every `CHECK_EVERY` items while reading, filtering and sorting them into the output;
    /// none from the output's placement in PM on (the tree then points at it: the commit
    /// step).
    fn merge_locked(&self, inputs: &[u64]) -> Result<()> {
        let by_number: HashMap<u64, Arc<PmTable>> =
            self.tables.read().values().map(|t| (t.number, t.clone())).collect();
        let (dead, rest): (Vec<u64>, Vec<u64>) = {
            let v = self.version.lock();
            let present: Vec<u64> = inputs.iter().copied().filter(|n| v.version.files.contains_key(n)).collect();
            present.into_iter().partition(|n| v.version.files.get(n).is_some_and(|m| m.live == 0))
        };
        if dead.is_empty() && rest.is_empty() {
            return Ok(());
        }
        let all: Vec<u64> = dead.iter().chain(rest.iter()).copied().collect();
        // Number the output while no flush is in progress: every table numbered below it is
        // fully applied to the tree, every later flush is numbered above it.
        let number = {
            let _f = self.flush_job.lock();
            self.next_number()
        };
        self.fs.write_atomic(&self.dir.join(MERGE_LOG), &layout::encode_merge_log(&all, number))?;
        // Lines 10-20: merge-sort the inputs, keep items the tree still points at.
        let mut items: Vec<(Vec<u8>, u64, u16)> = Vec::new();
        let mut scanned = 0u64;
        for n in &rest {
            self.cancel.point()?;
            let t = by_number.get(n).ok_or_else(|| {
                Error::corruption(
                    self.dir.join(crate::manifest::Manifest::name(0)),
                    0,
                    format!("merge input table {n} is not open"),
                )
            })?;
            t.table.for_each(|e, h, _| {
                scanned += 1;
                self.cancel.every(scanned)?;
                if e.kind == Kind::Put {
                    let a = layout::vaddr_from(e.value)
                        .ok_or_else(|| Error::corruption(t.table.path(), h.offset, "malformed value address"))?;
                    items.push((e.key.to_vec(), a, t.slot));
                }
                Ok(())
            })?;
        }
        let mut kept: Vec<(Vec<u8>, u64, u16)> = Vec::with_capacity(items.len());
        for chunk in items.chunks(CHUNK) {
            self.cancel.point()?;
            let tree = self.tree.read();
            kept.extend(chunk.iter().filter(|(k, a, s)| tree.get(k) == Some(&tv(*a, *s))).cloned());
        }
        kept.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut out: Option<(Arc<PmTable>, FileMeta)> = None;
        let mut live = 0u64;
        if !kept.is_empty() {
            let mut b = TableBuilder::in_memory(self.opts.block_size, self.opts.bloom_bits_per_key);
            for (i, (k, a, _)) in kept.iter().enumerate() {
                self.cancel.every(i as u64 + 1)?;
                b.add(Kind::Put, k, &layout::vaddr_bytes(*a))?;
            }
            let (meta, bytes) = b.finish_mem()?;
            // The last safe point: from here the merge runs to its commit.
            self.cancel.point()?;
            let t = self.place_table(number, &bytes)?;
            // Lines 16-17: write to the new table while updating the tree's table part.
            for chunk in kept.chunks(CHUNK) {
                let mut tree = self.tree.write();
                for (k, a, s) in chunk {
                    if tree.get(k) == Some(&tv(*a, *s)) {
                        tree.insert(k, tv(*a, t.slot));
                        live += 1;
                    }
                }
            }
            let fm = FileMeta {
                total: meta.entries,
                live,
                size: meta.size,
                smallest: meta.smallest,
                largest: meta.largest,
                level: 0,
            };
            out = Some((t, fm));
        }
        // Line 21: InstallMergeResult, with the writes that raced with the merge settled.
        {
            let _f = self.flush_job.lock();
            // The install-time check: flushes that ran during the merge may have overwritten
            // items it moved. No flush runs now, so the tree says exactly which of the
            // output's items are live.
            if let Some((t, fm)) = &mut out {
                let tree = self.tree.read();
                let now = kept.iter().filter(|(k, a, _)| tree.get(k) == Some(&tv(*a, t.slot))).count() as u64;
                self.counters.install_conflicts.fetch_add(fm.live.saturating_sub(now), Ordering::Relaxed);
                fm.live = now;
            }
            let mut v = self.version.lock();
            let mut after = v.version.clone();
            let mut edits = Vec::new();
            for n in &all {
                after.files.remove(n);
                edits.push(Edit::RemoveFile(*n));
            }
            if let Some((_, fm)) = &out {
                after.files.insert(number, fm.clone());
                edits.push(Edit::AddFile(number, fm.clone()));
            }
            after.candidates = candidates(&after, self.opts.live_rate_threshold).into_iter().collect();
            edits.push(Edit::NextFile(after.next_file));
            edits.push(Edit::Candidates(after.candidates.iter().copied().collect()));
            // The recovery file first: the merge dropped tombstones, so the state after the
            // commit cannot be rebuilt from the remaining tables alone.
            self.write_dump(&after)?;
            commit(&mut v, &self.fs, &edits, after)?;
        }
        self.remove_old_dumps()?;
        for n in &all {
            if let Some(t) = by_number.get(n) {
                self.free_table(t)?;
            }
        }
        self.fs.remove(&self.dir.join(MERGE_LOG))?;
        self.fs.sync_dir(&self.dir)?;
        let c = &self.counters;
        c.merges.fetch_add(1, Ordering::Relaxed);
        c.merge_inputs.fetch_add(all.len() as u64, Ordering::Relaxed);
        c.dead_tables_freed.fetch_add(dead.len() as u64, Ordering::Relaxed);
        c.items_kept.fetch_add(kept.len() as u64, Ordering::Relaxed);
        c.items_dropped.fetch_add(scanned - kept.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Write the B+-tree recovery file for version `after` (caller holds the flush lock, so
    /// every table numbered below `after.next_file` is applied to the tree).
    pub(crate) fn write_dump(&self, after: &Version) -> Result<()> {
        let covered = after.next_file.saturating_sub(1);
        let by_slot: HashMap<u16, u64> = self.tables.read().values().map(|t| (t.slot, t.number)).collect();
        let mut d = Dump {
            covered,
            tables: after.files.keys().copied().collect(),
            pools: self.vlog.snapshot(),
            entries: Vec::new(),
        };
        {
            let tree = self.tree.read();
            d.entries.reserve(tree.len());
            for (k, v) in tree.range_from(std::ops::Bound::Unbounded) {
                let (a, s) = untv(*v);
                let n = by_slot.get(&s).copied().ok_or_else(|| {
                    Error::corruption(
                        self.dir.join(dump_name(covered)),
                        0,
                        format!("tree entry points at unknown table slot {s}"),
                    )
                })?;
                d.entries.push((k.to_vec(), a, n));
            }
        }
        self.fs.write_atomic(&self.dir.join(dump_name(covered)), &layout::encode_dump(&d))?;
        self.dump.store(covered, Ordering::Release);
        self.counters.dumps.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Remove recovery files older than the newest.
    fn remove_old_dumps(&self) -> Result<()> {
        if !self.opts.use_btree {
            // No recovery file was written or chosen by this session (`self.dump` is not
            // one); the store's own stays for the next open with the tree.
            return Ok(());
        }
        // Not "all but the highest-numbered": a merge a crash cut before its commit leaves a
        // recovery file numbered above the committed version; keeping it and removing the
        // matching one made the next open fail ("no usable B+-tree recovery file").
        let keep = self.dump.load(Ordering::Acquire);
        let ns: Vec<u64> =
            self.fs.list(&self.dir)?.iter().filter_map(|n| dump_number(n)).filter(|n| *n != keep).collect();
        for n in ns {
            self.fs.remove(&self.dir.join(dump_name(n)))?;
        }
        Ok(())
    }

    /// Clean shutdown: flush the MemTables and write the recovery file.
    pub(crate) fn close_impl(&self) -> Result<()> {
        self.poisoned.check()?;
        {
            let mut w = self.writer.lock();
            self.flush_all(&mut w)?;
        }
        let _m = self.merge_job.lock();
        if self.opts.use_btree {
            let _f = self.flush_job.lock();
            let v = self.version.lock().version.clone();
            self.write_dump(&v)?;
        }
        self.remove_old_dumps()?;
        self.region.sync_all()?;
        Ok(())
    }

    /// Verify every table, every value the tree and the MemTables point at, and the live
    /// counts.
    pub(crate) fn check_impl(&self) -> Result<Vec<String>> {
        let _m = self.merge_job.lock();
        let _f = self.flush_job.lock();
        let mut problems = Vec::new();
        let v = self.version.lock().version.clone();
        let tables: HashMap<u16, Arc<PmTable>> = self.tables.read().clone();
        let by_number: HashMap<u64, &Arc<PmTable>> = tables.values().map(|t| (t.number, t)).collect();
        for (n, m) in &v.files {
            let Some(t) = by_number.get(n) else {
                problems.push(format!("table {n} of the MANIFEST has no PM extent"));
                continue;
            };
            let mut count = 0u64;
            if let Err(e) = t.table.for_each(|_, _, _| {
                count += 1;
                Ok(())
            }) {
                problems.push(e.to_string());
            } else if count != m.total {
                problems.push(format!("table {n} holds {count} items, the MANIFEST says {}", m.total));
            }
        }
        if self.opts.use_btree {
            let tree = self.tree.read();
            if let Err(e) = tree.check_invariants() {
                problems.push(format!("B+-tree: {e}"));
            }
            let mut live: HashMap<u16, u64> = HashMap::new();
            for (k, val) in tree.range_from(std::ops::Bound::Unbounded) {
                let (a, s) = untv(*val);
                *live.entry(s).or_insert(0) += 1;
                if let Err(e) = self.vlog.read(&self.region, a) {
                    problems.push(format!("key {:?}: {e}", String::from_utf8_lossy(k)));
                }
            }
            for (s, n) in live {
                match tables.get(&s) {
                    None => problems.push(format!("{n} tree entries point at table slot {s}, which holds no table")),
                    Some(t) => {
                        let want = v.files.get(&t.number).map_or(0, |m| m.live);
                        if want != n {
                            problems.push(format!(
                                "table {}: {n} live items in the tree, the MANIFEST says {want}",
                                t.number
                            ));
                        }
                    }
                }
            }
        }
        let mem = self.mem.read();
        for m in std::iter::once(&mem.active).chain(mem.imm.iter()) {
            for (k, a) in m.map.read().iter() {
                if *a != TOMB {
                    if let Err(e) = self.vlog.read(&self.region, *a) {
                        problems.push(format!("MemTable key {:?}: {e}", String::from_utf8_lossy(k)));
                    }
                }
            }
        }
        Ok(problems)
    }
}

/// Log `edits` and make `after` current.
fn commit(v: &mut VersionState, fs: &dyn Fs, edits: &[Edit], after: Version) -> Result<()> {
    v.manifest.log(fs, edits, &after)?;
    v.version = after;
    Ok(())
}

fn open_pm_table(region: &Arc<Region>, ts: &TSlot) -> Result<Arc<PmTable>> {
    let file = PmFile::new(region.clone(), ts.addr, u64::from(ts.size))?;
    let (pool_file, off) = region.locate(ts.addr);
    let label = pool_file.with_file_name(format!(
        "{}@{off:#x}(table {})",
        pool_file.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
        ts.number
    ));
    let table = Table::open_file(Box::new(file), &label)?;
    Ok(Arc::new(PmTable { number: ts.number, slot: ts.slot, addr: ts.addr, size: u64::from(ts.size), table }))
}

/// The value-log pool size a new store uses: `configured`, or up to 1 % less when that lets
/// a whole number of value pools tile a PM pool's heap exactly. Each PM pool starts with a
/// 64-byte header, so the paper's 128 MiB value pools never fit twice in a 256 MiB PM pool:
/// every PM pool would hold one value pool and leave ~128 MiB that only tables can use —
/// half the PM lost (measured: 17 PM pools of 256 MiB for 2.1 GB of values). Shrunk by 64
/// bytes, two fit.
pub(crate) fn tiled_vlog_pool_size(configured: u64, pm_pool_size: u64) -> u64 {
    let usable = pm_pool_size.saturating_sub(crate::pm::POOL_HEADER_LEN);
    if configured == 0 || configured > usable {
        return configured;
    }
    let per_pool = usable.div_ceil(configured);
    let tiled = usable / per_pool / crate::pm::LINE * crate::pm::LINE;
    if tiled >= configured - configured / 100 {
        tiled.min(configured)
    } else {
        configured
    }
}

/// Open or create the store: everything but the flush of recovered WAL entries. Returns the
/// inputs of an interrupted merge to restart.
pub(crate) fn open_inner(ctx: &EngineCtx) -> Result<(Inner, Option<Vec<u64>>)> {
    let region = Arc::new(crate::engine::open_region(ctx)?);
    let fs: &dyn Fs = &ctx.fs;
    let dir = &ctx.dir;
    let mut opts = ctx.opts.hpdk.clone();
    if ctx.fresh {
        for name in fs.list(dir)? {
            if dump_number(&name).is_some()
                || wal_number(&name).is_some()
                || name.starts_with("MANIFEST-")
                || name == MERGE_LOG
            {
                fs.remove(&dir.join(&name))?;
            }
        }
        fs.write_atomic(&dir.join(dump_name(0)), &layout::encode_dump(&Dump::default()))?;
        opts.vlog_pool_size = tiled_vlog_pool_size(opts.vlog_pool_size, region.pool_size());
        // SAFETY: the store is being created; nothing else uses the region.
        unsafe { region.write(layout::SUPERBLOCK_ADDR, &layout::encode_superblock(opts.vlog_pool_size))? };
        region.persist(layout::SUPERBLOCK_ADDR, 64);
        region.sync_all()?;
    } else {
        let sb = region.slice_checked(layout::SUPERBLOCK_ADDR, 64, "superblock")?;
        opts.vlog_pool_size =
            layout::decode_superblock(sb).map_err(|d| region.corruption(layout::SUPERBLOCK_ADDR, d))?;
    }
    // Directories.
    let mut pools: Vec<Option<PoolInfo>> = Vec::new();
    let mut tslots: Vec<TSlot> = Vec::new();
    let mut used: Vec<(u64, u64)> = Vec::new();
    for base in [layout::VDIR_ADDR, layout::TDIR_ADDR] {
        let all = region.slice_checked(base, (layout::DIR_SLOTS * layout::SLOT_LEN) as usize, "directory")?;
        for (i, b) in all.chunks(layout::SLOT_LEN as usize).enumerate() {
            match layout::decode_slot(b, i as u16) {
                Slot::Free => {}
                Slot::Pool(p) if base == layout::VDIR_ADDR => {
                    if pools.len() <= i {
                        pools.resize(i + 1, None);
                    }
                    pools[i] = Some(PoolInfo { addr: p.addr, cap: p.cap, gen: p.gen });
                    used.push((p.addr, u64::from(p.cap).div_ceil(64) * 64));
                }
                Slot::Table(t) if base == layout::TDIR_ADDR => tslots.push(t),
                _ => {
                    return Err(
                        region.corruption(base + i as u64 * layout::SLOT_LEN, "directory slot of the wrong kind")
                    )
                }
            }
        }
    }
    // MANIFEST.
    let (mut version, manifest_no) = if ctx.fresh {
        (Version { next_file: 1, ..Version::default() }, 0)
    } else {
        if !Manifest::exists(fs, dir) {
            return Err(Error::corruption(dir.join("CURRENT"), 0, "the store's MANIFEST is missing"));
        }
        // A torn last record is a commit the crash interrupted; what it committed is still
        // recoverable from the WAL (removed only after the commit) or the merge log.
        let (v, n, _torn) = Manifest::recover(fs, dir)?;
        (v, n)
    };
    // Tables: the MANIFEST's, found in the directory; other slots are orphans to free.
    let mut tables: HashMap<u16, Arc<PmTable>> = HashMap::new();
    for ts in &tslots {
        let sa = layout::TDIR_ADDR + u64::from(ts.slot) * layout::SLOT_LEN;
        if version.files.contains_key(&ts.number) {
            used.push((ts.addr, u64::from(ts.size).div_ceil(64) * 64));
            tables.insert(ts.slot, open_pm_table(&region, ts)?);
        } else {
            // SAFETY: open is single-threaded.
            unsafe { region.write(sa, &[0u8; 32])? };
            region.persist(sa, layout::SLOT_LEN);
        }
    }
    let by_number: HashMap<u64, Arc<PmTable>> = tables.values().map(|t| (t.number, t.clone())).collect();
    for n in version.files.keys() {
        if !by_number.contains_key(n) {
            return Err(
                region.corruption(layout::TDIR_ADDR, format!("table {n} of the MANIFEST has no directory slot in PM"))
            );
        }
    }
    // Heap: every pool's space minus the extents in use.
    let heap = Mutex::new(crate::pm::heap::rebuild(&region, layout::HEAP_START, used)?);
    // Merge log.
    let mut restart = None;
    let mlog = dir.join(MERGE_LOG);
    if fs.exists(&mlog) {
        let (inputs, _out) =
            layout::decode_merge_log(&fs.read_all(&mlog)?).map_err(|d| Error::corruption(&mlog, 0, d))?;
        if inputs.iter().all(|n| version.files.contains_key(n)) {
            restart = Some(inputs);
        } else {
            fs.remove(&mlog)?;
        }
    }
    // The B+-tree: recovery file + replay of newer tables.
    let mut tree: BPlusTree<u64> = BPlusTree::new(TREE_NODE);
    let mut dump_kept = 0u64;
    let mut dump_pools: HashMap<u16, (u32, u32, u32)> = HashMap::new();
    if opts.use_btree {
        let mut names: Vec<u64> = fs.list(dir)?.iter().filter_map(|n| dump_number(n)).collect();
        names.sort_unstable_by(|a, b| b.cmp(a));
        let mut chosen: Option<Dump> = None;
        let mut why = String::from("no B+-tree recovery file exists");
        for n in &names {
            let p = dir.join(dump_name(*n));
            let d = match layout::decode_dump(&fs.read_all(&p)?) {
                Ok(d) => d,
                Err((off, e)) => {
                    why = format!("{} at offset {off}: {e}", p.display());
                    continue;
                }
            };
            let live_upto: Vec<u64> = version.files.keys().copied().filter(|f| *f <= d.covered).collect();
            if live_upto == d.tables {
                chosen = Some(d);
                break;
            }
            why = format!("{} was taken against tables {:?}, the MANIFEST has {:?}", p.display(), d.tables, live_upto);
        }
        let Some(d) = chosen else {
            return Err(Error::corruption(
                dir.join(dump_name(names.first().copied().unwrap_or(0))),
                0,
                format!("no usable B+-tree recovery file: {why}"),
            ));
        };
        let mut leaf = Vec::with_capacity(TREE_NODE / 2);
        let mut leaves = Vec::new();
        for (k, a, n) in d.entries {
            let t = by_number.get(&n).ok_or_else(|| {
                Error::corruption(
                    dir.join(dump_name(d.covered)),
                    0,
                    format!("entry points at table {n}, which is not live"),
                )
            })?;
            leaf.push((k.into_boxed_slice(), tv(a, t.slot)));
            if leaf.len() == TREE_NODE * 3 / 4 {
                leaves.push((std::mem::take(&mut leaf), ()));
            }
        }
        if !leaf.is_empty() {
            leaves.push((leaf, ()));
        }
        tree = BPlusTree::from_leaves(TREE_NODE, leaves).ok_or_else(|| {
            Error::corruption(dir.join(dump_name(d.covered)), 0, "recovery file entries are not in key order")
        })?;
        dump_kept = d.covered;
        for (no, gen, u, t) in d.pools {
            dump_pools.insert(no, (gen, u, t));
        }
        // Newer tables in number order (= age order: see the merge's numbering).
        let newer: BTreeMap<u64, &Arc<PmTable>> =
            by_number.iter().filter(|(n, _)| **n > d.covered).map(|(n, t)| (*n, t)).collect();
        for t in newer.values() {
            t.table.for_each(|e, h, _| {
                match e.kind {
                    Kind::Put => {
                        let a = layout::vaddr_from(e.value)
                            .ok_or_else(|| Error::corruption(t.table.path(), h.offset, "malformed value address"))?;
                        tree.insert(e.key, tv(a, t.slot));
                    }
                    Kind::Delete => {
                        tree.remove(e.key);
                    }
                }
                Ok(())
            })?;
        }
        // Live counts, recounted from the tree.
        let mut live: HashMap<u16, u64> = HashMap::new();
        for (_, v) in tree.range_from(std::ops::Bound::Unbounded) {
            *live.entry(untv(*v).1).or_insert(0) += 1;
        }
        for t in by_number.values() {
            if let Some(m) = version.files.get_mut(&t.number) {
                m.live = live.get(&t.slot).copied().unwrap_or(0);
            }
        }
        version.candidates = candidates(&version, opts.live_rate_threshold).into_iter().collect();
    }
    // Value pools: write positions (recovery file, then a scan of what follows), references.
    let mut st = State { next_gen: 1, ..State::default() };
    for (no, p) in pools.iter().enumerate() {
        let Some(p) = p else { continue };
        let (from, total) = match dump_pools.get(&(no as u16)) {
            Some(&(g, u, t)) if g == p.gen => (u, t),
            _ => (0, 0),
        };
        let (used, total) = scan_pool(&region, p, from, total);
        st.counts.insert(no as u16, PoolCount { used, total, ..PoolCount::default() });
        st.next_gen = st.next_gen.max(p.gen + 1);
        if st.active.is_none_or(|a| pools[a as usize].is_some_and(|q| q.gen < p.gen)) {
            st.active = Some(no as u16);
        }
    }
    for (_, v) in tree.range_from(std::ops::Bound::Unbounded) {
        let no = layout::split_vaddr(untv(*v).0).0;
        st.counts.entry(no).or_default().tree_refs += 1;
    }
    // WAL: generations not yet flushed are replayed into a MemTable flushed at open.
    let mut wals: Vec<u64> = fs.list(dir)?.iter().filter_map(|n| wal_number(n)).collect();
    wals.sort_unstable();
    let recovered = Mem::new(version.counter.max(wals.last().copied().unwrap_or(0)));
    let mut live = Vec::new();
    for g in &wals {
        let p = dir.join(wal_name(*g));
        if *g <= version.counter {
            fs.remove(&p)?;
        } else {
            live.push(p);
        }
    }
    // Not `whole_older`: rotation does not sync the old WAL, and the session that wrote
    // it may have run without `sync_wal`, so any WAL may end in a torn tail.
    crate::format::log::replay_logs(fs, &live, ctx.opts.wal_recovery, false, &ctx.recovery, |p, off, payload| {
        let ops =
            layout::decode_wal_payload(payload).ok_or_else(|| Error::corruption(p, off, "malformed WAL record"))?;
        for (k, a) in ops {
            recovered.insert(&k, a.unwrap_or(TOMB));
        }
        Ok(())
    })?;
    for (no, n) in recovered.refs.lock().iter() {
        st.counts.entry(*no).or_default().mem_refs += n;
    }
    let wal_gen = recovered.gen + 1;
    let wal = fs.create(&dir.join(wal_name(wal_gen)))?;
    fs.sync_dir(dir)?;
    let manifest = Manifest::create(fs, dir, manifest_no + 1, &version)?;
    if manifest_no > 0 {
        let _ = fs.remove(&dir.join(Manifest::name(manifest_no)));
    }
    let empty = recovered.map.read().is_empty();
    let imm = (!empty).then(|| Arc::new(recovered));
    let vlog = Vlog {
        pools: RwLock::new(pools),
        state: Mutex::new(st),
        pool_size: opts.vlog_pool_size,
        reuse: opts.use_btree,
    };
    let inner = Inner {
        region,
        heap,
        fs: ctx.fs.clone(),
        dir: dir.clone(),
        writer: Mutex::new(Writer { wal, wal_gen }),
        commits: crate::group::Queue::default(),
        mem: RwLock::new(MemState { active: Arc::new(Mem::new(wal_gen)), imm }),
        tree: RwLock::new(tree),
        vlog,
        version: Mutex::new(VersionState { version, manifest }),
        tables: RwLock::new(tables),
        flush_job: Mutex::new(()),
        merge_job: Mutex::new(()),
        work: Mutex::new(Work::default()),
        work_cv: Condvar::new(),
        flushed_cv: Condvar::new(),
        flushed_mu: Mutex::new(()),
        poisoned: crate::poison::Poison::default(),
        cancel: crate::jobs::Cancel::new(ctx.opts.job_probe.clone()),
        user_bytes: Default::default(),
        counters: Counters::default(),
        dump: AtomicU64::new(dump_kept),
        opts,
    };
    Ok((inner, restart))
}

#[cfg(test)]
mod tests {
    use super::tiled_vlog_pool_size;
    use crate::engine::Engine;

    /// `close` finds an Immutable MemTable nobody flushed and its workers already stopped
    /// — the state of a flush worker that saw `stop` before the flush it had just been
    /// asked for (seen once in the full suite: `iter_concurrency`'s hpdk test hung in
    /// `close`). `close` flushes it itself, and the reopened store has every key. Before
    /// the fix `close` waited for the stopped worker for ever; a close that does not
    /// return within 30 s fails the test (a correct one returns in milliseconds).
    #[test]
    fn close_flushes_an_immutable_memtable_its_stopped_workers_left() {
        use crate::engine::hpdk::Hpdk;
        use crate::fs::FaultFs;
        use crate::options::{HpdkOptions, Preset};
        use crate::pm::sim::SimDevice;
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = crate::testing::sim_options(Preset::Hpdk, &dev, &fs)
            .hpdk(HpdkOptions { background: true, ..crate::testing::hpdk_small() });
        let db = std::sync::Arc::new(Hpdk::open(crate::engine::test_ctx(&o, &fs, true, 7)).unwrap());
        db.stop_workers();
        let key = |i: u32| format!("k{i:05}").into_bytes();
        let put = |db: &Hpdk, i: u32| {
            let op = crate::batch::BatchOp::Put { key: key(i), value: vec![b'v'; 200] };
            db.write(&[op], crate::engine::Cond::None).unwrap();
        };
        let mut i = 0;
        // Write until a rotation left an Immutable MemTable, and one more key after it.
        while db.inner.mem.read().imm.is_none() {
            assert!(i < 10_000, "no rotation");
            put(&db, i);
            i += 1;
        }
        put(&db, i);
        let closer = db.clone();
        crate::testing::returns("close()", move || closer.close()).unwrap();
        drop(db);
        let db = Hpdk::open(crate::engine::test_ctx(&o, &fs, false, 7)).unwrap();
        for k in 0..=i {
            assert_eq!(db.get(&key(k)).unwrap().as_deref(), Some(&[b'v'; 200][..]), "key {k}");
        }
    }

    #[test]
    fn value_pools_tile_a_pm_pool() {
        // The defaults: two value pools per 256 MiB PM pool, 64 bytes smaller each.
        assert_eq!(tiled_vlog_pool_size(128 << 20, 256 << 20), (128 << 20) - 64);
        assert_eq!(tiled_vlog_pool_size(64 << 20, 256 << 20), (64 << 20) - 64);
        // Shrinking by more than 1 % is not done: 100 MiB stays (three would be 85 MiB).
        assert_eq!(tiled_vlog_pool_size(100 << 20, 256 << 20), 100 << 20);
        // Already tiling (with room left over for tables) or larger than a PM pool: as given.
        assert_eq!(tiled_vlog_pool_size(60 << 20, 256 << 20), 60 << 20);
        assert_eq!(tiled_vlog_pool_size(512 << 20, 256 << 20), 512 << 20);
        for (c, p) in [(128u64 << 20, 256u64 << 20), (512 << 10, 1 << 20), (64 << 10, 1 << 20)] {
            let t = tiled_vlog_pool_size(c, p);
            assert!(t.is_multiple_of(64) && t <= c && t >= c - c / 100, "{c} in {p}: {t}");
        }
    }
}
