//! Flushes of full leaves to SSTables with their PM leaf copies (Fig. 6) and partition
//! compaction (§III-F): build without the state lock, commit under it (see "Flush" and
//! "Compaction" in [`super`]).

use super::*;

impl PwbStore {
    /// The next flush in the queue: the oldest unflushed leaf of the partition linked first.
    pub(super) fn next_flush(&self, st: &State) -> Result<Option<FlushJob>> {
        let Some(&p) = st.flush_queue.front() else { return Ok(None) };
        let leaf = st.tree.partition(p).chain.last().cloned();
        let seq_hi = st.unflushed.get(&p).and_then(|q| q.front().copied());
        match (leaf, seq_hi) {
            (Some(leaf), Some(seq_hi)) => Ok(Some(FlushJob { p, leaf, seq_hi })),
            _ => Err(Error::Poisoned("lightkv: the flush queue names a partition with no unflushed leaf".into())),
        }
    }

    /// Write a table of `recs` (sorted by key) and return, for each key, its entry's offset.
    pub(super) fn write_table(&self, recs: impl Iterator<Item = Result<Rec>>) -> Result<(u64, Arc<Table>, KeyOffsets)> {
        let n = self.next_table.fetch_add(1, Ordering::Relaxed);
        let path = table_path(&self.dir, n);
        let mut b = TableBuilder::create(self.fs.as_ref(), &path, self.cfg.block_size, 0)?;
        for r in recs {
            let (kind, k, v) = match r {
                Ok(rec) => rec,
                Err(e) => {
                    drop(b);
                    // A compaction cancelled at a safe point: its only output is this
                    // table, not yet named by any leaf.
                    return self.cancel.on_cancel(Err(e), || Ok(self.fs.remove(&path)?));
                }
            };
            b.add(sst_kind(kind), &k, &v)?;
        }
        b.finish()?;
        self.fs.sync_dir(&self.dir)?;
        let table = self.table(n)?;
        let mut offs = Vec::with_capacity(table.entries() as usize);
        for (bi, (_, h)) in table.index().iter().enumerate() {
            let payload = table.read_block(*h)?;
            for (ei, e) in block_entries(&payload).enumerate() {
                let e = e.map_err(|d| Error::corruption(table.path(), h.offset, d))?;
                offs.push((e.key.to_vec(), sst_off(n, bi, ei)));
            }
        }
        Ok((n, table, offs))
    }

    /// Write the flush's SSTable and the PM copy of its leaf (no state lock needed: the
    /// leaf's records stay pinned until the commit releases them).
    pub(super) fn build_flush(&self, job: &FlushJob) -> Result<Built> {
        let mut recs: Vec<(u64, Rec)> = Vec::with_capacity(job.leaf.live());
        for off in job.leaf.offsets() {
            if off & SST_FLAG != 0 {
                return Err(Error::Poisoned("a linked leaf being flushed already points at a table".into()));
            }
            recs.push((off, self.record(off)?));
        }
        recs.sort_by(|a, b| a.1 .1.cmp(&b.1 .1));
        let (n, table, offs) = self.write_table(recs.iter().map(|r| Ok(r.1.clone())))?;
        if offs.len() != recs.len() || offs.iter().zip(&recs).any(|(o, r)| o.0 != r.1 .1) {
            return Err(Error::corruption(table.path(), 0, "a flushed key is missing from its new table"));
        }
        let leaf = pm_leaf_of(&offs, job.leaf.depth());
        // Every record of the partition up to `seq_hi` is in this table or superseded by one
        // that is: recovery may skip them all.
        let meta = LeafMeta { table: n, cw: 0, seq_hi: job.seq_hi };
        let lb = encode_leaf(&leaf, leaf.normal(), meta);
        let la = self.put_extent(&lb)?;
        let flushed = recs.into_iter().map(|(off, (_, k, _))| (k, off)).collect();
        Ok(Built { leaf: pm_leaf(la, lb.len() as u64, meta, &leaf, self.cfg.placement), table, flushed })
    }

    /// Write a new chain record for `slot` and commit it (one 8-byte store); frees the old
    /// record. Returns the record's extent.
    pub(super) fn commit_chain(
        &self,
        st: &mut State,
        slot: u64,
        desc: &PartitionDesc,
        leaves: &[PmLeaf],
    ) -> Result<(u64, u64)> {
        let rb = encode_chain(&Chain { desc: desc.clone(), leaves: leaves.iter().map(|l| l.addr).collect() });
        let ra = self.put_extent(&rb)?;
        let sa = CHAIN_DIR_ADDR + slot * 8;
        self.region.store_u64_atomic(sa, ra)?;
        self.region.persist(sa, 8);
        if let Some(old) = st.chains.get(&slot) {
            self.heap.lock().free(old.record.0, line_round(old.record.1));
        }
        st.chain_ver += 1;
        Ok((ra, rb.len() as u64))
    }

    /// Commit a built flush: the PM leaf joins the chain record, the DRAM leaf gives way to
    /// it, and the leaf's records are released. Returns the chain slot.
    pub(super) fn commit_flush(&self, st: &mut State, job: FlushJob, b: Built) -> Result<u64> {
        let p = job.p;
        let tag = st.tree.partition(p).tag;
        let (slot, new_slot) = match tag.checked_sub(1) {
            Some(s) if st.chains.contains_key(&s) => (s, false),
            _ => (
                *st.free_chain_slots
                    .last()
                    .ok_or_else(|| Error::PmFull(format!("all {CHAIN_SLOTS} chain slots are in use")))?,
                true,
            ),
        };
        let desc = st.tree.descriptor(p);
        let mut leaves = st.chains.get(&slot).map(|c| c.leaves.clone()).unwrap_or_default();
        leaves.insert(0, b.leaf);
        let record = self.commit_chain(st, slot, &desc, &leaves)?;
        if new_slot {
            st.free_chain_slots.pop();
        }
        st.chains.insert(slot, ChainInfo { record, desc, leaves });
        let part = st.tree.partition_mut(p);
        part.tag = slot + 1;
        part.chain.pop();
        if let Some(img) = st.chain_images.get_mut(&p).and_then(|v| v.pop()) {
            self.heap.lock().free(img.0, line_round(img.1));
        }
        if let Some(q) = st.unflushed.get_mut(&p) {
            q.pop_front();
            if q.is_empty() {
                st.unflushed.remove(&p);
            }
        }
        st.flush_queue.pop_front();
        self.queued.store(st.flush_queue.len(), Ordering::Relaxed);
        Self::touch(st, p);
        // The records are in the table: their sorted-view entries retire (iterators that
        // listed the tables before this commit still read them from the write buffer).
        let stamp = st.view.get_mut().stamp();
        let oldest = self.pins.oldest();
        for (k, off) in &b.flushed {
            st.view.get_mut().retire(stamp, k, *off, oldest);
        }
        for off in job.leaf.offsets() {
            Self::release(st, off);
        }
        self.free_emptied(st)?;
        self.reclaim(st);
        let mut c = self.stats.lock();
        c.flushes += 1;
        c.flush_bytes += b.table.size();
        Ok(slot)
    }

    /// Flush the next queued leaf with the state lock held (recovery, inline mode), then
    /// compact its chain as far as it goes. A failure leaves the state as it was before
    /// the failed step (the flush stays queued), so the store can go on.
    pub(super) fn flush_next_locked(&self, st: &mut State) -> Result<()> {
        let Some(job) = self.next_flush(st)? else { return Ok(()) };
        let b = self.build_flush(&job)?;
        let slot = self.commit_or_discard(b, |b| self.commit_flush(st, job, b))?;
        while let Some(job) = self.pick_compaction(st, slot) {
            let b = self.build_compaction(&job)?;
            self.commit_or_discard(b.0, |x| self.commit_compaction(st, job, (x, b.1)))?;
        }
        Ok(())
    }

    /// Run `commit` on a built table and leaf; if it fails before committing, the table
    /// file and the leaf's PM extent are released (nothing refers to them).
    pub(super) fn commit_or_discard<T>(&self, b: Built, commit: impl FnOnce(Built) -> Result<T>) -> Result<T> {
        let (addr, len, table) = (b.leaf.addr, b.leaf.len, b.leaf.meta.table);
        let r = commit(b);
        if r.is_err() && !self.state_names_leaf(addr) {
            self.heap.lock().free(addr, line_round(len));
            self.tables.lock().remove(&table);
            let _ = self.fs.remove(&table_path(&self.dir, table));
        }
        r
    }

    /// True when a committed chain names the PM leaf at `addr`. Only called where the
    /// state lock is already held by the caller or not needed; reads PM only.
    pub(super) fn state_names_leaf(&self, addr: u64) -> bool {
        (0..CHAIN_SLOTS).any(|slot| {
            self.region
                .load_u64_atomic(CHAIN_DIR_ADDR + slot * 8)
                .ok()
                .filter(|&ra| ra != 0)
                .and_then(|ra| read_chain(&self.region, ra).ok())
                .is_some_and(|(c, _)| c.leaves.contains(&addr))
        })
    }

    /// Flush one queued leaf without blocking writers while the table is written (the
    /// flush thread, `flush()`). Returns the chain slot it committed to, or `None` when the
    /// queue was empty.
    pub(crate) fn flush_one(&self) -> Result<Option<u64>> {
        let _g = self.flush_job.lock();
        let Some(job) = self.next_flush(&self.state.read())? else { return Ok(None) };
        let b = self.build_flush(&job)?;
        let slot = {
            let mut st = self.state.write();
            self.commit_or_discard(b, |b| self.commit_flush(&mut st, job, b))?
        };
        self.flushed_cv.notify_all();
        Ok(Some(slot))
    }

    /// The first run of `compaction_size` adjacent PM leaves of equal weight in `slot`'s
    /// chain. Weights ascend along a chain but flushes may add leaves in front while a run
    /// is merged, so the run is searched for rather than assumed at the head.
    pub(super) fn pick_compaction(&self, st: &State, slot: u64) -> Option<CompactJob> {
        let cs = self.cfg.compaction_size;
        let c = st.chains.get(&slot)?;
        let ls = &c.leaves;
        // A run whose merged leaf could not be one PM extent (at most half a pool) is left
        // alone: the chain grows instead (see "Data skew" in docs/design/lightkv.md).
        let fits = |run: &[PmLeaf]| {
            let keys: usize = run.iter().map(|l| l.live).sum();
            let buckets = (keys * 100).div_ceil(rhtree::SLOTS * 85) * 5 / 4 + 1;
            ((LEAF_HEADER + buckets * 64) as u64) <= self.region.pool_size() / 2
        };
        (0..ls.len().saturating_sub(cs - 1))
            .find(|&i| ls[i..i + cs].iter().all(|l| l.meta.cw == ls[i].meta.cw) && fits(&ls[i..i + cs]))
            .map(|i| CompactJob { slot, inputs: ls[i..i + cs].to_vec(), bottom: i + cs == ls.len() })
    }

    /// Merge the run's tables into one (streaming; newest input wins) and write its leaf.
    pub(super) fn build_compaction(&self, job: &CompactJob) -> Result<(Built, u64)> {
        let mut curs = Vec::with_capacity(job.inputs.len());
        for l in &job.inputs {
            curs.push(TableCursor::seek(self.table(l.meta.table)?, Bound::Unbounded, false)?);
        }
        let mut seen = 0u64;
        let mut steps = 0u64;
        let bottom = job.bottom;
        let merged = std::iter::from_fn(|| loop {
            steps += 1;
            // The smallest key; among equal keys the newest input (lowest index) wins.
            let mut best: Option<usize> = None;
            for (i, c) in curs.iter().enumerate() {
                if let Some(e) = c.peek() {
                    if best.is_none_or(|b| curs[b].peek().is_some_and(|x| e.1 < x.1)) {
                        best = Some(i);
                    }
                }
            }
            let b = best?;
            let e = curs[b].peek().cloned()?;
            for c in curs.iter_mut() {
                while c.peek().is_some_and(|x| x.1 == e.1) {
                    seen += 1;
                    if let Err(err) = c.advance() {
                        return Some(Err(err));
                    }
                }
            }
            // Safe point: nothing but the output table exists yet (`write_table` discards it).
            if let Err(err) = self.cancel.every(steps - 1) {
                return Some(Err(err));
            }
            if bottom && e.0 == sstable::Kind::Delete {
                // Nothing older in this partition: the tombstone has nothing left to hide.
                continue;
            }
            return Some(Ok((pwb_kind(e.0), e.1, e.2)));
        });
        let (n, table, offs) = self.write_table(merged)?;
        // The output leaf: entries pointing at the new table.
        let leaf = pm_leaf_of(&offs, job.inputs[0].depth);
        let meta = LeafMeta { table: n, cw: job.inputs[0].meta.cw + 1, seq_hi: job.inputs[0].meta.seq_hi };
        let lb = encode_leaf(&leaf, leaf.normal(), meta);
        let la = self.put_extent(&lb)?;
        let dropped = seen - offs.len() as u64;
        let leaf = pm_leaf(la, lb.len() as u64, meta, &leaf, self.cfg.placement);
        Ok((Built { leaf, table, flushed: Vec::new() }, dropped))
    }

    /// Commit a built compaction: the run is replaced by the output leaf in a new chain
    /// record; the inputs' leaves and tables are freed.
    pub(super) fn commit_compaction(&self, st: &mut State, job: CompactJob, (b, dropped): (Built, u64)) -> Result<()> {
        let info = st
            .chains
            .get(&job.slot)
            .cloned()
            .ok_or_else(|| Error::Poisoned("lightkv: a compacted chain vanished".into()))?;
        let first = job.inputs[0].addr;
        let cs = job.inputs.len();
        let i = info
            .leaves
            .iter()
            .position(|l| l.addr == first)
            .filter(|&i| {
                info.leaves.get(i..i + cs).is_some_and(|r| r.iter().zip(&job.inputs).all(|(a, b)| a.addr == b.addr))
            })
            .ok_or_else(|| Error::Poisoned("lightkv: a compaction's inputs moved in their chain".into()))?;
        let mut leaves = info.leaves.clone();
        leaves.splice(i..i + cs, [b.leaf]);
        let record = self.commit_chain(st, job.slot, &info.desc, &leaves)?;
        st.chains.insert(job.slot, ChainInfo { record, desc: info.desc, leaves });
        {
            let mut h = self.heap.lock();
            for l in &job.inputs {
                h.free(l.addr, line_round(l.len));
            }
        }
        for l in &job.inputs {
            self.tables.lock().remove(&l.meta.table);
            self.fs.remove(&table_path(&self.dir, l.meta.table))?;
        }
        let mut c = self.stats.lock();
        c.compactions += 1;
        c.compaction_bytes += b.table.size();
        c.compaction_dropped += dropped;
        Ok(())
    }

    /// Compact `slot`'s chain as far as it goes without blocking writers while tables are
    /// merged (the compaction thread, `compact()`). Returns the compactions done.
    pub(crate) fn compact_chain(&self, slot: u64) -> Result<u64> {
        let _g = self.compact_job.lock();
        let mut done = 0;
        loop {
            // No new compaction once cancelled (close's own flushes end up here too).
            if self.cancel.is_cancelled() {
                return Ok(done);
            }
            let Some(job) = self.pick_compaction(&self.state.read(), slot) else { return Ok(done) };
            let (b, dropped) = self.build_compaction(&job)?;
            let mut st = self.state.write();
            self.commit_or_discard(b, |b| self.commit_compaction(&mut st, job, (b, dropped)))?;
            done += 1;
        }
    }

    /// Every chain slot (for `compact()`).
    pub(crate) fn chain_slots(&self) -> Vec<u64> {
        self.state.read().chains.keys().copied().collect()
    }

    /// Unflushed leaves waiting for the flush thread.
    pub(crate) fn pending_flushes(&self) -> usize {
        self.state.read().flush_queue.len()
    }

    /// Wait until a flush commits (or `timeout`).
    pub(crate) fn wait_flushed(&self, timeout: std::time::Duration) {
        let mut g = self.flushed_mu.lock();
        self.flushed_cv.wait_for(&mut g, timeout);
    }

    /// Wake writers waiting for room.
    pub(crate) fn notify_flushed(&self) {
        self.flushed_cv.notify_all();
    }
}
