//! HPDK's value log (§III-D): fixed-size pools in PM, appended like a log, one open for
//! writes; each pool counts the live items that refer to it and is reused once none do
//! (docs/format/hpdk.md).
//!
//! A pool's live count is split in two: `tree_refs`, the B+-tree entries pointing into it
//! (changed by flushes; decrements are applied only after the flush's MANIFEST commit), and
//! `mem_refs`, the MemTable entries written into it (released when their MemTable's flush
//! commits). A pool is reused only when both are zero, so no state a crash could return to
//! still refers to it.
//!
//! Iterators read values in place, without a lock, so a pool must also outlive every
//! iterator that may still hold an address into it. Each iterator registers an *epoch*
//! ([`Vlog::pin`]) before it reads any address; a pool records the epoch at which its
//! references last fell to zero (`idle_since`). An iterator registered after that moment
//! can never obtain an address into the pool (no source holds one any more), so the pool
//! is reusable once every live iterator is newer than its `idle_since`; until then
//! `switch_pool` takes another idle pool or a new extent.

use std::collections::BTreeMap;

use parking_lot::{Mutex, RwLock};

use super::layout::{self, VSlot, RECORD_OVERHEAD};
use super::Inner;
use crate::error::{Error, Result};
use crate::pm::heap::alloc_or_grow;
use crate::pm::Region;

/// Where a pool is and which life of it is current.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolInfo {
    /// Region address of the pool's extent.
    pub addr: u64,
    /// Capacity in bytes.
    pub cap: u32,
    /// Generation (mixed into record checksums).
    pub gen: u32,
}

/// Per-pool counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCount {
    /// B+-tree entries pointing into the pool.
    pub tree_refs: u64,
    /// MemTable entries written into the pool.
    pub mem_refs: u64,
    /// Bytes appended (the write position).
    pub used: u32,
    /// Records appended.
    pub total: u32,
    /// Iterator epoch at which both reference counts were last seen at zero.
    pub idle_since: u64,
}

#[derive(Debug, Default)]
pub(crate) struct State {
    pub(crate) active: Option<u16>,
    pub(crate) counts: BTreeMap<u16, PoolCount>,
    pub(crate) next_gen: u32,
    pub(crate) reused: u64,
    pub(crate) records: u64,
    /// The newest iterator epoch handed out.
    pub(crate) epoch: u64,
    /// Live iterators by epoch (how many registered at each).
    pub(crate) readers: BTreeMap<u64, usize>,
    /// Times a pool with no references was not reused because an iterator may read it.
    pub(crate) reuse_deferred: u64,
}

impl State {
    /// Note that pool `no`'s references may have fallen to zero.
    fn settle(&mut self, no: u16) {
        let epoch = self.epoch;
        if let Some(c) = self.counts.get_mut(&no) {
            if c.tree_refs == 0 && c.mem_refs == 0 {
                c.idle_since = epoch;
            }
        }
    }
}

/// Value-log figures for `Stats`.
#[derive(Debug, Clone, Copy, Default)]
pub struct VlogStats {
    /// Pools in use.
    pub pools: u64,
    /// Times a pool was reused.
    pub reused: u64,
    /// Live items over all pools.
    pub live: u64,
    /// Records appended since open.
    pub records: u64,
    /// Idle pools not reused because a live iterator might still read them.
    pub reuse_deferred: u64,
}

/// The value log.
#[derive(Debug, Default)]
pub struct Vlog {
    /// Pool table by number (read by every GET).
    pub(crate) pools: RwLock<Vec<Option<PoolInfo>>>,
    pub(crate) state: Mutex<State>,
    /// Pool capacity for new pools.
    pub(crate) pool_size: u64,
    /// Pools may be reused (false when no tree keeps exact counts: HPDK-NT).
    pub(crate) reuse: bool,
}

impl Vlog {
    /// Read and verify the value at address `a`.
    pub fn read(&self, region: &Region, a: u64) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.read_with(region, a, &mut |v| out = v.to_vec())?;
        Ok(out)
    }

    /// The value at address `a`, verified and lent to `f` in place (the caller keeps its
    /// pool from being reused while `f` runs).
    pub fn read_with(&self, region: &Region, a: u64, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let info = self.pool_info(region, a)?;
        let (at, len) = Self::locate(region, &info, a)?;
        f(region.slice_checked(at, len, "value record")?);
        Ok(())
    }

    /// The pool that address `a` names.
    pub(crate) fn pool_info(&self, region: &Region, a: u64) -> Result<PoolInfo> {
        let no = layout::split_vaddr(a).0;
        let info = self.pools.read().get(no as usize).copied().flatten();
        info.ok_or_else(|| {
            region.corruption(0, format!("value address {a:#x} names value pool {no}, which does not exist"))
        })
    }

    /// Verify the record at address `a` in pool `info`; returns where its value bytes are
    /// (region address, length). A point read: it reads the whole value anyway, so the
    /// memo would save only the checksum (not measured), and point reads must not
    /// allocate (`tests/get_into.rs`) while the memo's first insert does.
    pub(crate) fn locate(region: &Region, info: &PoolInfo, a: u64) -> Result<(u64, usize)> {
        Self::locate_with(region, info, a, false)
    }

    /// As [`Vlog::locate`], but a record this open region already verified is not verified
    /// again (`crate::pm::checked`), and its length comes from the memo: a range read's
    /// walk then reads none of it.
    pub(crate) fn locate_once(region: &Region, info: &PoolInfo, a: u64) -> Result<(u64, usize)> {
        Self::locate_with(region, info, a, true)
    }

    fn locate_with(region: &Region, info: &PoolInfo, a: u64, memo: bool) -> Result<(u64, usize)> {
        let (no, off) = layout::split_vaddr(a);
        let at = info.addr + u64::from(off);
        let bad = |d: &str| region.corruption(at, format!("value pool {no} offset {off}: {d}"));
        if u64::from(off) + RECORD_OVERHEAD > u64::from(info.cap) {
            return Err(bad("value address past the end of the pool"));
        }
        // A record this open region verified under the pool's current generation: its
        // length comes from the memo, and nothing of it is read until the value is.
        if let Some(len) = memo.then(|| region.checked().lookup(at, u64::from(info.gen))).flatten() {
            let len = len as u64;
            if len >= RECORD_OVERHEAD && u64::from(off) + len <= u64::from(info.cap) {
                return Ok((at + 4, (len - RECORD_OVERHEAD) as usize));
            }
        }
        let h = region.slice_checked(at, 4, "value record")?;
        let size = u64::from(u32::from_le_bytes([h[0], h[1], h[2], h[3]]));
        if u64::from(off) + RECORD_OVERHEAD + size > u64::from(info.cap) {
            return Err(bad("value record runs past the end of the pool"));
        }
        let verify = || {
            let rec = region.slice_checked(at + 4, size as usize + 4, "value record")?;
            let (v, c) = rec.split_at(size as usize);
            if layout::record_crc(info.gen, v) != u32::from_le_bytes([c[0], c[1], c[2], c[3]]) {
                return Err(bad("value record checksum mismatch"));
            }
            Ok(())
        };
        if memo {
            // The pool's generation is the salt: the checksum binds a record to it, so an
            // address of a reused pool's earlier generation misses the memo and fails.
            region.checked().verify_once(at, (size + RECORD_OVERHEAD) as usize, u64::from(info.gen), verify)?;
        } else {
            verify()?;
        }
        Ok((at + 4, size as usize))
    }

    /// Register an iterator: until [`Vlog::unpin`] with the returned epoch, no pool it may
    /// read from is reused.
    pub(crate) fn pin(&self) -> u64 {
        let mut st = self.state.lock();
        st.epoch += 1;
        let e = st.epoch;
        *st.readers.entry(e).or_insert(0) += 1;
        e
    }

    /// Deregister the iterator of epoch `e`.
    pub(crate) fn unpin(&self, e: u64) {
        let mut st = self.state.lock();
        if let Some(n) = st.readers.get_mut(&e) {
            *n -= 1;
            if *n == 0 {
                st.readers.remove(&e);
            }
        }
    }

    /// Append `values` (persisted with one fence) and return their addresses. Writers call
    /// it with or without the writer lock (see "Concurrent writers" in the preset's docs);
    /// the value log's own lock orders the appends.
    pub(crate) fn append(&self, inner: &Inner, values: &[&[u8]]) -> Result<Vec<u64>> {
        if values.is_empty() {
            return Ok(Vec::new());
        }
        let region = &inner.region;
        let mut st = self.state.lock();
        let mut out = Vec::with_capacity(values.len());
        let mut buf = Vec::new();
        // The open pool (number and where it is), looked up again only after a switch.
        let mut open = st.active.and_then(|no| Some((no, self.pools.read().get(no as usize).copied().flatten()?)));
        for v in values {
            let need = v.len() as u64 + RECORD_OVERHEAD;
            if need > self.pool_size {
                return Err(Error::InvalidArgument(format!(
                    "value of {} bytes does not fit in a value-log pool of {} bytes",
                    v.len(),
                    self.pool_size
                )));
            }
            let fits = open.is_some_and(|(no, i)| {
                st.counts.get(&no).is_some_and(|c| u64::from(c.used) + need <= u64::from(i.cap))
            });
            if !fits {
                open = Some(self.switch_pool(inner, &mut st)?);
            }
            let (no, info) = open.ok_or_else(|| Error::PmFull("no open value pool".into()))?;
            let c = st.counts.entry(no).or_default();
            buf.clear();
            layout::encode_record(info.gen, v, &mut buf);
            let at = info.addr + u64::from(c.used);
            // SAFETY: `[at, at+len)` lies past the open pool's write position, which only this
            // writer (holding the value-log lock) touches. No address past that position was
            // handed out in this generation; addresses of a reused pool's earlier generation
            // were, and no one reads them any more: `switch_pool` reuses a pool only when no
            // index refers to it and every iterator that could hold such an address (those
            // registered before the pool went idle) has dropped (the epoch pins).
            unsafe { region.write(at, &buf)? };
            region.flush(at, buf.len() as u64);
            out.push(layout::vaddr(no, c.used));
            c.used += buf.len() as u32;
            c.total += 1;
            // Until its MemTable is flushed, the entry refers to the pool.
            c.mem_refs += 1;
            st.records += 1;
        }
        region.fence();
        Ok(out)
    }

    /// Open another pool: a reusable one (no references), or a new one. Returns it.
    fn switch_pool(&self, inner: &Inner, st: &mut State) -> Result<(u16, PoolInfo)> {
        let region = &inner.region;
        let active = st.active;
        let reusable = if self.reuse {
            // The oldest live iterator; pools idle since before it registered stay.
            let oldest = st.readers.keys().next().copied();
            let idle = |no: &u16, c: &PoolCount| Some(*no) != active && c.tree_refs == 0 && c.mem_refs == 0;
            let r = st.counts.iter().find(|(no, c)| idle(no, c) && oldest.is_none_or(|o| o > c.idle_since));
            if r.is_none() && st.counts.iter().any(|(no, c)| idle(no, c)) {
                st.reuse_deferred += 1;
            }
            r.map(|(no, _)| *no)
        } else {
            None
        };
        let gen = st.next_gen;
        let (no, addr, cap) = match reusable {
            Some(no) => {
                let i = self
                    .pools
                    .read()
                    .get(no as usize)
                    .copied()
                    .flatten()
                    .ok_or_else(|| Error::PmFull("reused pool vanished".into()))?;
                st.reused += 1;
                (no, i.addr, i.cap)
            }
            None => {
                let no = {
                    let p = self.pools.read();
                    (0..layout::DIR_SLOTS as usize).find(|&i| p.get(i).copied().flatten().is_none()).ok_or_else(
                        || Error::PmFull(format!("all {} value-pool slots are in use", layout::DIR_SLOTS)),
                    )?
                };
                let addr = alloc_or_grow(&mut inner.heap.lock(), region, self.pool_size)?;
                (no as u16, addr, self.pool_size as u32)
            }
        };
        let slot = VSlot { no, gen, addr, cap };
        let sa = layout::VDIR_ADDR + u64::from(no) * layout::SLOT_LEN;
        // SAFETY: directory slots are written only by the writer holding the value-log lock
        // (and by open); readers use the DRAM pool table.
        unsafe { region.write(sa, &layout::encode_vslot(&slot))? };
        region.persist(sa, layout::SLOT_LEN);
        let info = PoolInfo { addr, cap, gen };
        {
            let mut p = self.pools.write();
            if p.len() <= no as usize {
                p.resize(no as usize + 1, None);
            }
            p[no as usize] = Some(info);
        }
        st.counts.insert(no, PoolCount::default());
        st.active = Some(no);
        st.next_gen = gen + 1;
        Ok((no, info))
    }

    /// Add `n` tree references to each pool of `d` (positive) or remove them.
    pub(crate) fn tree_refs(&self, d: &BTreeMap<u16, i64>) {
        let mut st = self.state.lock();
        for (no, n) in d {
            let c = st.counts.entry(*no).or_default();
            c.tree_refs = c.tree_refs.saturating_add_signed(*n);
            st.settle(*no);
        }
    }

    /// Release the MemTable references `r`.
    pub(crate) fn release_mem(&self, r: &std::collections::HashMap<u16, u64>) {
        let mut st = self.state.lock();
        for (no, n) in r {
            if let Some(c) = st.counts.get_mut(no) {
                c.mem_refs = c.mem_refs.saturating_sub(*n);
            }
            st.settle(*no);
        }
    }

    /// (number, generation, used, total) of every pool, for the recovery file.
    pub(crate) fn snapshot(&self) -> Vec<(u16, u32, u32, u32)> {
        let st = self.state.lock();
        let p = self.pools.read();
        st.counts
            .iter()
            .filter_map(|(no, c)| p.get(*no as usize).copied().flatten().map(|i| (*no, i.gen, c.used, c.total)))
            .collect()
    }

    /// Figures for `Stats`.
    pub fn stats(&self) -> VlogStats {
        let st = self.state.lock();
        VlogStats {
            pools: st.counts.len() as u64,
            reused: st.reused,
            live: st.counts.values().map(|c| c.tree_refs + c.mem_refs).sum(),
            records: st.records,
            reuse_deferred: st.reuse_deferred,
        }
    }
}

/// Scan pool `info` from offset `from`: the end of the last record that verifies, and the
/// records found. Used at open to find write positions after a crash.
pub fn scan_pool(region: &Region, info: &PoolInfo, mut from: u32, mut total: u32) -> (u32, u32) {
    let cap = u64::from(info.cap);
    loop {
        let off = u64::from(from);
        if off + RECORD_OVERHEAD > cap {
            break;
        }
        let Some(h) = region.slice(info.addr + off, 4) else { break };
        let size = u64::from(u32::from_le_bytes([h[0], h[1], h[2], h[3]]));
        if off + RECORD_OVERHEAD + size > cap {
            break;
        }
        let Some(rec) = region.slice(info.addr + off + 4, size as usize + 4) else { break };
        let (v, c) = rec.split_at(size as usize);
        if layout::record_crc(info.gen, v) != u32::from_le_bytes([c[0], c[1], c[2], c[3]]) {
            break;
        }
        from += (size + RECORD_OVERHEAD) as u32;
        total += 1;
    }
    (from, total)
}
