//! Segments and the per-shard logs of `native`.
//!
//! The region is cut into segment slots ([`super::layout`]). A shard's log is a chain of
//! segments ordered by generation; its *open* segment is the one it appends to. A record
//! never straddles segments: when one does not fit, the open segment is **sealed** (its
//! length stored in the seal word and persisted) before the next segment's header is
//! written, so every segment of a shard but the last is sealed. A record larger than a slot
//! gets a segment of several contiguous slots of one pool (`span`).
//!
//! Creating a segment: header bytes 8..64 are stored and persisted, then the magic is
//! stored with an 8-byte atomic store and persisted. A slot with the magic therefore has a
//! complete header; a header that does not verify is damage, never a torn creation.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::pm::Region;

use super::layout::{self, SegHeader, SEAL_OFFSET, SEG_HEADER_LEN};

/// Slot geometry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub stride: u64,
    pub slots_per_pool: u64,
    pub pool_size: u64,
}

impl Geometry {
    /// PM address of slot `s`.
    pub fn addr(&self, s: u64) -> u64 {
        (s / self.slots_per_pool) * self.pool_size
            + crate::pm::POOL_HEADER_LEN
            + (s % self.slots_per_pool) * self.stride
    }

    /// The slot at PM address `a`, if `a` is a slot start.
    #[cfg(test)]
    pub fn slot_of(&self, a: u64) -> Option<u64> {
        let pool = a / self.pool_size;
        let off = (a % self.pool_size).checked_sub(crate::pm::POOL_HEADER_LEN)?;
        (off.is_multiple_of(self.stride) && off / self.stride < self.slots_per_pool)
            .then_some(pool * self.slots_per_pool + off / self.stride)
    }

    /// The slot holding PM address `a` (a segment's start or any byte of its records).
    pub fn slot_holding(&self, a: u64) -> u64 {
        let pool = a / self.pool_size;
        let off = (a % self.pool_size).saturating_sub(crate::pm::POOL_HEADER_LEN);
        pool * self.slots_per_pool + (off / self.stride).min(self.slots_per_pool - 1)
    }

    /// Bytes of records a segment of `span` slots holds.
    pub fn capacity(&self, span: u64) -> u64 {
        span * self.stride - SEG_HEADER_LEN
    }
}

/// A segment the log cleaner emptied, waiting until no reader can still hold a location
/// in it.
#[derive(Debug)]
pub(crate) struct Retired {
    /// Its first slot and span.
    pub slot: u64,
    pub span: u64,
    /// The next sequence number when it was retired: a snapshot or iterator registered at
    /// or below it may have read locations in it.
    pub freed_at: u64,
    /// Set once every epoch-pinned reader of that time has unpinned (a `get` between
    /// loading a location and reading it).
    pub ready: Arc<AtomicBool>,
}

/// Free slots, retired segments, and growth of the region when there are none.
#[derive(Debug, Default)]
pub(crate) struct SlotAlloc {
    free: BTreeSet<u64>,
    /// Slots of pools the allocator knows (`pools * slots_per_pool`).
    known: u64,
    retired: Vec<Retired>,
}

impl SlotAlloc {
    /// The allocator over `region`'s current pools, every slot free but those in `used`
    /// and the meta slot (slot 0).
    pub fn new(g: &Geometry, pools: usize, used: &BTreeSet<u64>) -> SlotAlloc {
        let known = pools as u64 * g.slots_per_pool;
        let free = (1..known).filter(|s| !used.contains(s)).collect();
        SlotAlloc { free, known, retired: Vec::new() }
    }

    /// Free slots.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Segments retired and not yet reusable.
    pub fn retired(&self) -> usize {
        self.retired.len()
    }

    /// Hand a cleaned segment back (reusable once no reader can hold a location in it).
    pub fn retire(&mut self, r: Retired) {
        self.retired.push(r);
    }

    /// Make retired segments free whose readers are gone: every live snapshot or iterator
    /// is newer than the retirement (`oldest_snapshot > freed_at`) and the epoch moved on.
    pub fn reclaim(&mut self, oldest_snapshot: u64) -> usize {
        let mut n = 0;
        let free = &mut self.free;
        self.retired.retain(|r| {
            let reusable = r.ready.load(Ordering::Acquire) && oldest_snapshot > r.freed_at;
            if reusable {
                free.extend(r.slot..r.slot + r.span);
                n += 1;
            }
            !reusable
        });
        n
    }

    /// The `n` lowest free slots (those `take` hands out next, one-slot segments).
    pub fn lowest_free(&self, n: usize) -> Vec<u64> {
        self.free.iter().take(n).copied().collect()
    }

    /// Take `span` contiguous free slots of one pool; grows the region when none are free.
    pub fn take(&mut self, g: &Geometry, region: &Region, span: u64) -> Result<u64> {
        if span > g.slots_per_pool - 1 {
            return Err(Error::InvalidArgument(format!(
                "a record of {span} segment slots does not fit in one PM pool of {} slots (raise pm_pool_size)",
                g.slots_per_pool
            )));
        }
        loop {
            if let Some(s) = self.find_run(g, span) {
                for i in s..s + span {
                    self.free.remove(&i);
                }
                return Ok(s);
            }
            let p = region.grow()? as u64;
            let first = p * g.slots_per_pool;
            self.known = self.known.max(first + g.slots_per_pool);
            for s in first..first + g.slots_per_pool {
                if s != 0 {
                    self.free.insert(s);
                }
            }
        }
    }

    fn find_run(&self, g: &Geometry, span: u64) -> Option<u64> {
        if span == 1 {
            return self.free.iter().next().copied();
        }
        let mut run_start = None;
        let mut prev = None;
        for &s in &self.free {
            let contiguous = prev.is_some_and(|p| p + 1 == s && p / g.slots_per_pool == s / g.slots_per_pool);
            if !contiguous {
                run_start = Some(s);
            }
            prev = Some(s);
            if let Some(r) = run_start {
                if s + 1 - r == span {
                    return Some(r);
                }
            }
        }
        None
    }
}

/// The segment a shard appends to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpenSeg {
    /// PM address of its header.
    pub addr: u64,
    /// Its generation and salt.
    pub tag: layout::SegTag,
    /// Bytes of records written.
    pub len: u64,
    /// Bytes of records it can hold.
    pub cap: u64,
}

impl OpenSeg {
    /// PM address of the first byte after its records.
    pub fn end(&self) -> u64 {
        self.addr + SEG_HEADER_LEN + self.len
    }
}

/// A shard's log state (owned by the writer holding the shard).
#[derive(Debug)]
pub(crate) struct ShardLog {
    pub id: u32,
    pub open: Option<OpenSeg>,
    /// Generation the shard's next segment gets.
    pub next_gen: u64,
    /// Writes made on this shard since open (paces publication).
    pub writes: u64,
}

/// Create a segment of `span` slots at `addr` for `shard`: header persisted, then its
/// magic (see the module docs).
pub(crate) fn create_segment(region: &Region, addr: u64, h: &SegHeader) -> Result<()> {
    let bytes = h.encode();
    // SAFETY: the slots were just taken from the allocator: no other thread reads or writes
    // them until the segment is published to the shard that owns it.
    unsafe { region.write(addr + 8, &bytes[8..])? };
    region.persist(addr + 8, SEG_HEADER_LEN - 8);
    region.store_u64_atomic(addr, layout::SEG_MAGIC_WORD)?;
    region.persist(addr, 8);
    Ok(())
}

/// Seal the segment at `addr` of generation `gen` at `len` bytes of records.
pub(crate) fn seal_segment(region: &Region, addr: u64, gen: u64, len: u64) -> Result<()> {
    let len = u32::try_from(len).map_err(|_| Error::InvalidArgument("segment longer than 4 GiB".into()))?;
    region.store_u64_atomic(addr + SEAL_OFFSET, layout::seal_word(gen, len))?;
    region.persist(addr + SEAL_OFFSET, 8);
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn slot_addresses_round_trip_and_skip_pool_headers() {
        let g = Geometry { stride: 4096, slots_per_pool: 15, pool_size: 65536 };
        for s in 0..45 {
            assert_eq!(g.slot_of(g.addr(s)), Some(s));
            assert!(g.addr(s) % g.pool_size >= 64);
            assert!(g.addr(s) % g.pool_size + g.stride <= g.pool_size);
        }
        assert_eq!(g.slot_of(g.addr(3) + 8), None);
    }

    #[test]
    fn runs_of_slots_stay_inside_one_pool() {
        let g = Geometry { stride: 4096, slots_per_pool: 4, pool_size: 16384 + 64 };
        let used: BTreeSet<u64> = [2].into_iter().collect();
        // Pool 0: slot 0 is meta, 1 free, 2 used, 3 free; pool 1: 4..8 free.
        let a = SlotAlloc { free: [1, 3, 4, 5, 6, 7].into_iter().collect(), known: 8, retired: Vec::new() };
        assert_eq!(a.find_run(&g, 2), Some(4), "3 and 4 are contiguous numbers but in two pools");
        assert_eq!(a.find_run(&g, 1), Some(1));
        assert_eq!(a.find_run(&g, 4), Some(4));
        assert_eq!(a.find_run(&g, 5), None);
        let b = SlotAlloc::new(&g, 2, &used);
        assert_eq!(b.free_slots(), 6);
    }
}
