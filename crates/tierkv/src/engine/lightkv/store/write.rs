//! The write path: partition lanes, segment appends, the index step (see "Write path" in
//! [`super`]).

use super::*;

impl PwbStore {
    /// A new active segment of `size` bytes, in `extent` when the caller allocated it (a
    /// lane writer does, outside the state lock: growing the PM region is a syscall).
    pub(super) fn new_segment(&self, st: &mut State, size: u64, extent: Option<u64>) -> Result<u64> {
        let Some(slot) = st.free_slots.pop() else {
            if let Some(a) = extent {
                self.heap.lock().free(a, size);
            }
            return Err(Error::PmFull(format!("all {SEG_SLOTS} PWB segment slots are in use")));
        };
        let addr = match extent.map_or_else(|| self.alloc(size), Ok) {
            Ok(a) => a,
            Err(e) => {
                st.free_slots.push(slot);
                return Err(e);
            }
        };
        let id = self.region.load_u64_atomic(ID_COUNTER_ADDR)? + 1;
        self.region.store_u64_atomic(ID_COUNTER_ADDR, id)?;
        self.region.persist(ID_COUNTER_ADDR, 8);
        let h = pwb::encode_header(id, size);
        // SAFETY: a freshly allocated extent; only this writer (under the state lock) uses it.
        unsafe { self.region.write(addr, &h)? };
        self.region.persist(addr, pwb::HEADER_LEN as u64);
        let sa = DIR_ADDR + slot * SLOT_LEN;
        self.region.store_u64_atomic(sa, addr)?;
        self.region.persist(sa, 8);
        self.region.store_u64_atomic(sa + 8, id)?;
        self.region.persist(sa + 8, 8);
        st.segs.insert(
            addr,
            Seg { slot, id, size, pos: AtomicU64::new(pwb::HEADER_LEN as u64), live: AtomicU64::new(0), active: true },
        );
        Ok(addr)
    }

    /// Append one put or delete and index it. Durable when it returns.
    pub fn write(&self, kind: Kind, key: &[u8], value: &[u8]) -> Result<()> {
        self.write_batch(&[(kind, key, value)], Cond::None).map(|_| ())
    }

    /// Wait while the flush thread is too far behind.
    pub(super) fn wait_for_room(&self) -> Result<()> {
        if !self.cfg.background {
            return Ok(());
        }
        let mut stalled = false;
        while self.pending_flushes() >= MAX_PENDING_FLUSHES {
            self.poisoned.check()?;
            // `close` stopped the flush thread: nothing drains the queue any more, and a
            // write still running then fails (it waited for ever before).
            if self.work.lock().stop {
                return Err(crate::error::Error::Closed);
            }
            if !stalled {
                stalled = true;
                self.stats.lock().write_stalls += 1;
            }
            self.wait_flushed(std::time::Duration::from_millis(20));
        }
        Ok(())
    }

    /// Append `ops` as one record (atomic: after a crash all or none of them are there), in
    /// the active segment of the first key's partition, and index each. Durable when it
    /// returns. With a condition (one op), returns false and writes nothing unless it holds.
    ///
    /// A single put or delete of a key some partition takes runs in its partition's lane
    /// ([`PwbStore::write_in_lane`]): writers of other partitions append, persist and probe
    /// meanwhile. A batch (or a key that needs a new end partition) holds every lane.
    pub fn write_batch(&self, ops: &[pwb::Op<'_>], cond: Cond) -> Result<bool> {
        self.poisoned.check()?;
        let Some(first) = ops.first() else { return Ok(true) };
        self.wait_for_room()?;
        if !self.cfg.background {
            // Leaves linked by earlier writes are flushed before this write's record is
            // appended: a failed flush (a full PM device) then fails this write with nothing
            // of it written, and leaves the store as it was.
            let mut st = self.state.write();
            self.poisoned.check()?;
            while !st.flush_queue.is_empty() {
                self.flush_next_locked(&mut st)?;
            }
        }
        let done = if ops.len() == 1 { self.write_in_lane(first, cond)? } else { None };
        let done = match done {
            Some(d) => d,
            None => {
                let _lanes = self.lock_lanes();
                self.write_exclusive(ops, cond)?
            }
        };
        if done && self.cfg.background && self.pending_flushes_hint() {
            // Under the work lock, so the flush thread cannot miss it between its check of
            // the queue and its wait.
            let _w = self.work.lock();
            self.work_cv.notify_all();
        }
        Ok(done)
    }

    /// Every writer lane, in order (batches, the clean-shutdown image, `check`): no
    /// single-partition writer is between its reservation and its index update meanwhile.
    pub(super) fn lock_lanes(&self) -> Vec<MutexGuard<'_, ()>> {
        self.lanes.iter().map(|l| l.lock()).collect()
    }

    /// True when a leaf may be waiting for the flush thread (a lock-free hint).
    pub(super) fn pending_flushes_hint(&self) -> bool {
        self.queued.load(Ordering::Relaxed) > 0
    }

    /// One put or delete in its partition's lane; `None` when no partition takes the key
    /// yet (the caller then takes every lane). Three steps:
    /// 1. lane of the key's partition `p`, then the state lock *shared*: check the route
    ///    (a split of `p` since the lane was chosen: retry in the new one), the condition,
    ///    probe the top leaf for the key ([`RhTree::top_probe`], the key comparisons that
    ///    read and verify PM records), pick the write position in `p`'s active segment
    ///    (a new segment under the exclusive lock, rarely) and take a sequence number;
    /// 2. no state lock: encode the record, write it at the position (page faults land
    ///    here), persist it (flush + fence);
    /// 3. the state lock shared ([`PwbStore::index_shared`]) — or exclusive when the entry
    ///    needs a split, a link, an idle sorted view dropped or LightKV_PM's images: advance the write
    ///    position, index the entry with the probe's outcome (no key compared), the counts.
    ///
    /// Only `p`'s lane holder appends to `p`'s active segment, changes which one it is, or
    /// changes `p`'s top leaf (splits included), so the probe and the position stay valid
    /// and a segment still has one writer at a time: a torn record is always its last.
    pub(super) fn write_in_lane(&self, op: &pwb::Op<'_>, cond: Cond) -> Result<Option<bool>> {
        let key = op.1;
        let Some(mut p) = self.state.read().tree.route(key) else { return Ok(None) };
        loop {
            let lane = self.lanes[p as usize % LANES].lock();
            let mut st = self.state.read();
            self.poisoned.check()?;
            match st.tree.route(key) {
                Some(q) if q == p => {}
                Some(q) => {
                    p = q;
                    continue;
                }
                None => return Ok(None),
            }
            if cond != Cond::None {
                let exists = self.get_locked(&st, key)?.is_some();
                if exists != (cond == Cond::Present) {
                    return Ok(Some(false));
                }
            }
            let probe = st
                .tree
                .top_probe(key, &self.keys())?
                .ok_or_else(|| Error::Poisoned("lightkv: a routed key lost its partition".into()))?;
            let size = pwb::record_size([(op.1.len(), op.2.len())]) as u64;
            let room = st
                .active
                .get(&p)
                .and_then(|&a| st.segs.get(&a).map(|g| (a, g.id, g.pos.load(Ordering::Relaxed), g.size)))
                .filter(|r| r.2 + size <= r.3)
                .map(|r| (r.0, r.1, r.2));
            let (seg, id, pos) = match room {
                Some(r) => r,
                None => {
                    drop(st);
                    // The extent first, without the state lock (the heap may grow the region).
                    let extent = self.alloc(self.segment_size_for(size))?;
                    let mut w = self.state.write();
                    if let Err(e) = self.poisoned.check() {
                        self.heap.lock().free(extent, self.segment_size_for(size));
                        return Err(e);
                    }
                    let a = self.switch_segment(&mut w, p, size, Some(extent))?;
                    let r = w
                        .segs
                        .get(&a)
                        .map(|g| (a, g.id, g.pos.load(Ordering::Relaxed)))
                        .ok_or_else(|| Error::Poisoned("lightkv: a new segment vanished".into()))?;
                    st = RwLockWriteGuard::downgrade(w);
                    r
                }
            };
            let seq = st.next_seq.fetch_add(1, Ordering::Relaxed);
            drop(st);
            let (rec, offs) = pwb::encode_record(id, seq, std::slice::from_ref(op));
            let addr = seg + pos;
            // SAFETY: bytes past the write position of `p`'s active segment belong to the
            // holder of `p`'s lane alone (this writer); the segment stays allocated while it
            // is active, and only that holder deactivates it; readers only follow index
            // entries to persisted records, and `check` holds every lane.
            unsafe { self.region.write(addr, &rec)? };
            self.region.persist(addr, rec.len() as u64);
            let len = rec.len() as u64;
            let entry = addr + offs.first().copied().unwrap_or(0) as u64;
            let shared = {
                let st = self.state.read();
                self.index_shared(&st, key, seg, entry, len, probe)
            };
            match shared {
                Some(emptied) => {
                    if let Some(a) = emptied {
                        let mut st = self.state.write();
                        st.emptied.push(a);
                        if let Err(e) = self.free_emptied(&mut st) {
                            self.poisoned.set(format!("lightkv write failed after its record was persisted: {e}"));
                            return Err(e);
                        }
                        self.reclaim(&mut st);
                    }
                    self.user_bytes.add(0, (op.1.len() + op.2.len()) as u64);
                }
                None => {
                    let mut st = self.state.write();
                    self.after_append(&mut st, std::slice::from_ref(op), seg, addr, len, &offs, seq, Some(probe))?;
                }
            }
            drop(lane);
            return Ok(Some(true));
        }
    }

    /// Step 3 of [`PwbStore::write_in_lane`] without the exclusive state lock, when the entry
    /// only takes or updates one slot of its partition's top leaf (no split, no link) and no
    /// PM leaf image is kept (LightKV_PM): the top leaf changes under its own lock
    /// ([`RhTree::insert_shared`]; the lane makes this writer its only writer), the
    /// segment's write position and entry counts are atomics, the sorted view has its own
    /// lock. `None`, with
    /// nothing changed, when the exclusive path is needed; else the segment an update left
    /// with no entry (to be freed under the exclusive lock), if any.
    pub(super) fn index_shared(
        &self,
        st: &State,
        key: &[u8],
        seg: u64,
        entry: u64,
        len: u64,
        probe: Probe,
    ) -> Option<Option<u64>> {
        if self.cfg.placement == LightkvPlacement::Pm || st.replaying {
            return None;
        }
        {
            // A view that writes should stop keeping is dropped on the exclusive path.
            let v = st.view.lock();
            if v.idle(self.view_used.load(Ordering::Relaxed)) && self.pins.count() == 0 {
                return None;
            }
        }
        let g = st.segs.get(&seg)?;
        let outcome = st.tree.insert_shared(key, entry, probe)?;
        g.pos.fetch_add(len, Ordering::Relaxed);
        g.live.fetch_add(1, Ordering::Relaxed);
        st.view.lock().put(key, entry, matches!(outcome, Insert::Updated(..)));
        let mut emptied = None;
        if let Insert::Updated(_, old) = outcome {
            if old & SST_FLAG == 0 {
                if let Some((&a, og)) = st.segs.range(..=old).next_back() {
                    let before =
                        og.live.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_sub(1)));
                    if before == Ok(1) {
                        emptied = Some(a);
                    }
                }
            }
        }
        self.queued.store(st.flush_queue.len(), Ordering::Relaxed);
        Some(emptied)
    }

    /// Partition `p`'s active segment has no room for `size` bytes (or there is none): it
    /// takes no more writes (freed if nothing points into it) and a new one is made active.
    pub(super) fn switch_segment(&self, st: &mut State, p: PartitionId, size: u64, extent: Option<u64>) -> Result<u64> {
        if let Some(a) = st.active.remove(&p) {
            if let Some(g) = st.segs.get_mut(&a) {
                g.active = false;
                if *g.live.get_mut() == 0 {
                    self.free_segment(st, a)?;
                }
            }
        }
        let a = self.new_segment(st, self.segment_size_for(size), extent)?;
        st.active.insert(p, a);
        Ok(a)
    }

    /// The size of a new segment that must take a record of `size` bytes.
    pub(super) fn segment_size_for(&self, size: u64) -> u64 {
        (size + pwb::HEADER_LEN as u64).next_multiple_of(64).max(self.seg_size)
    }

    /// A write with every lane held (batches, keys that need a new end partition): the
    /// whole write under the exclusive state lock.
    pub(super) fn write_exclusive(&self, ops: &[pwb::Op<'_>], cond: Cond) -> Result<bool> {
        let Some(first) = ops.first() else { return Ok(true) };
        let mut st = self.state.write();
        self.poisoned.check()?;
        if cond != Cond::None {
            let exists = self.get_locked(&st, first.1)?.is_some();
            if exists != (cond == Cond::Present) {
                return Ok(false);
            }
        }
        let shape = Self::shape_key(&st);
        let p = st.tree.route_mut(first.1);
        if Self::shape_key(&st) != shape {
            st.epoch += 1;
        }
        let size = pwb::record_size(ops.iter().map(|o| (o.1.len(), o.2.len()))) as u64;
        let seg = match st.active.get(&p).copied() {
            Some(a) if st.segs.get(&a).is_some_and(|g| g.pos.load(Ordering::Relaxed) + size <= g.size) => a,
            _ => self.switch_segment(&mut st, p, size, None)?,
        };
        let (id, pos) = st
            .segs
            .get(&seg)
            .map(|g| (g.id, g.pos.load(Ordering::Relaxed)))
            .ok_or_else(|| Error::Poisoned("active segment vanished".into()))?;
        let seq = st.next_seq.fetch_add(1, Ordering::Relaxed);
        let (rec, offs) = pwb::encode_record(id, seq, ops);
        let addr = seg + pos;
        // SAFETY: bytes past the segment's write position belong to this writer alone
        // (every lane and the state lock held); readers only follow index entries to
        // persisted records.
        unsafe { self.region.write(addr, &rec)? };
        self.region.persist(addr, rec.len() as u64);
        self.after_append(&mut st, ops, seg, addr, rec.len() as u64, &offs, seq, None)?;
        Ok(true)
    }

    /// After a record is persisted (state lock exclusive): advance its segment's write
    /// position, index its entries, and the bookkeeping. The record is durable: a failure
    /// here leaves the store's DRAM state behind its PM state, so it poisons the store
    /// (reopen recovers the record).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn after_append(
        &self,
        st: &mut State,
        ops: &[pwb::Op<'_>],
        seg: u64,
        addr: u64,
        len: u64,
        offs: &[usize],
        seq: u64,
        probe: Option<Probe>,
    ) -> Result<()> {
        let r = (|| {
            if let Some(g) = st.segs.get_mut(&seg) {
                *g.pos.get_mut() += len;
            }
            let shape = Self::shape_key(st);
            for (op, off) in ops.iter().zip(offs) {
                self.index(st, op.1, addr + *off as u64, seq, false, probe)?;
            }
            let reshaped = Self::shape_key(st) != shape;
            self.sync_images(st, reshaped)?;
            // A segment whose last entry was just superseded, and that takes no more
            // writes, goes.
            self.free_emptied(st)?;
            self.reclaim(st);
            // No range read for long, none open: writes stop keeping the sorted view.
            if st.view.get_mut().idle(self.view_used.load(Ordering::Relaxed)) && self.pins.count() == 0 {
                self.reclaim(st);
                st.view.get_mut().deactivate();
            }
            Ok(())
        })();
        if let Err(e) = r {
            self.poisoned.set(format!("lightkv write failed after its record was persisted: {e}"));
            return Err(e);
        }
        let user: u64 = ops.iter().map(|o| (o.1.len() + o.2.len()) as u64).sum();
        self.user_bytes.add(0, user);
        self.queued.store(st.flush_queue.len(), Ordering::Relaxed);
        Ok(())
    }
}
