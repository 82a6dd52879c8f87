//! A best-fit allocator of 64-byte-aligned PM extents with coalescing (shared by the presets).
//!
//! Its state lives only in DRAM. At open it is rebuilt from what the recovered index
//! references (values, KeyNodes, the directory): every other byte of the heap is free. So
//! there is no allocator metadata in PM to keep crash-consistent, and a block that was
//! allocated but never published before a crash is reclaimed automatically.
//!
//! Freed space is reused only when it is safe (see the `pmekv` module docs: frees are
//! deferred until a checkpoint no longer references the block).

use std::collections::{BTreeMap, BTreeSet};

use crate::pm::LINE;

/// Free-space map of the heap.
#[derive(Debug, Default)]
pub struct Heap {
    by_addr: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    /// Bytes of heap space (all pools).
    total: u64,
    /// Bytes free.
    free: u64,
}

impl Heap {
    /// An empty heap with no space.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add `[start, end)` as heap space, minus the allocated extents in `used` (sorted by
    /// address, inside the range). Returns the first overlapping extent, if any.
    pub fn add_space(&mut self, start: u64, end: u64, used: &[(u64, u64)]) -> Result<(), (u64, u64)> {
        self.total += end - start;
        let mut cur = start;
        for &(a, len) in used {
            if a < cur || a.checked_add(len).is_none_or(|e| e > end) {
                return Err((a, len));
            }
            if a > cur {
                self.insert_free(cur, a - cur);
            }
            cur = a + len;
        }
        if cur < end {
            self.insert_free(cur, end - cur);
        }
        Ok(())
    }

    fn insert_free(&mut self, addr: u64, len: u64) {
        self.by_addr.insert(addr, len);
        self.by_size.insert((len, addr));
        self.free += len;
    }

    fn remove_free(&mut self, addr: u64, len: u64) {
        self.by_addr.remove(&addr);
        self.by_size.remove(&(len, addr));
        self.free -= len;
    }

    /// Allocate `size` bytes (a multiple of 64), best fit. `None` when no extent is large
    /// enough.
    pub fn alloc(&mut self, size: u64) -> Option<u64> {
        debug_assert!(size.is_multiple_of(LINE) && size > 0);
        let &(len, addr) = self.by_size.range((size, 0)..).next()?;
        self.remove_free(addr, len);
        if len > size {
            self.insert_free(addr + size, len - size);
        }
        Some(addr)
    }

    /// Return `[addr, addr+size)` to the heap, merging with free neighbours.
    pub fn free(&mut self, addr: u64, size: u64) {
        let mut start = addr;
        let mut len = size;
        if let Some((&pa, &pl)) = self.by_addr.range(..addr).next_back() {
            if pa + pl == addr {
                self.remove_free(pa, pl);
                start = pa;
                len += pl;
            }
        }
        if let Some(&nl) = self.by_addr.get(&(addr + size)) {
            self.remove_free(addr + size, nl);
            len += nl;
        }
        self.insert_free(start, len);
    }

    /// Bytes of heap space.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes free.
    pub fn free_bytes(&self) -> u64 {
        self.free
    }

    /// True if any byte of `[addr, addr+len)` is free (used by `check`).
    pub fn overlaps_free(&self, addr: u64, len: u64) -> bool {
        if let Some((&fa, &fl)) = self.by_addr.range(..addr + len).next_back() {
            return fa + fl > addr;
        }
        false
    }
}

/// Allocate `size` bytes (rounded up to whole lines) from `heap`, adding a pool to `region`
/// (and its space to the heap) when no free extent is large enough.
pub fn alloc_or_grow(heap: &mut Heap, region: &super::Region, size: u64) -> crate::Result<u64> {
    let size = size.div_ceil(LINE) * LINE;
    let usable = region.pool_size() - super::POOL_HEADER_LEN;
    if size > usable {
        return Err(crate::Error::InvalidArgument(format!(
            "PM object of {size} bytes does not fit in a PM pool of {} bytes (raise pm_pool_size)",
            region.pool_size()
        )));
    }
    loop {
        if let Some(a) = heap.alloc(size) {
            return Ok(a);
        }
        let i = region.grow()?;
        let start = region.addr(i, super::POOL_HEADER_LEN);
        let end = region.addr(i + 1, 0);
        heap.add_space(start, end, &[]).map_err(|_| crate::Error::PmFull("new pool overlaps the heap".into()))?;
    }
}

/// Rebuild a heap that has no metadata of its own (the presets rebuild theirs at open):
/// every pool's space — from `first_start` in pool 0, after the header in the others — minus
/// the `used` extents. Overlapping extents, or one outside every pool's heap, are corruption.
pub fn rebuild(region: &super::Region, first_start: u64, mut used: Vec<(u64, u64)>) -> crate::Result<Heap> {
    used.sort_unstable();
    used.dedup();
    for w in used.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(region.corruption(w[1].0, "two PM objects overlap"));
        }
    }
    let mut h = Heap::new();
    let mut covered = 0;
    for i in 0..region.pool_count() {
        let start = if i == 0 { first_start } else { region.addr(i, super::POOL_HEADER_LEN) };
        let end = region.addr(i + 1, 0);
        let in_pool: Vec<(u64, u64)> = used.iter().copied().filter(|&(a, _)| a >= start && a < end).collect();
        covered += in_pool.len();
        h.add_space(start, end, &in_pool).map_err(|(a, _)| region.corruption(a, "PM object outside the heap"))?;
    }
    if covered != used.len() {
        return Err(region.corruption(0, "a PM object lies outside every pool's heap"));
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_split_and_coalesce() {
        let mut h = Heap::new();
        assert_eq!(h.add_space(0, 1024, &[(128, 64)]), Ok(()));
        assert_eq!(h.free_bytes(), 960);
        let a = h.alloc(128);
        assert_eq!(a, Some(0), "the 128-byte hole is the best fit");
        let b = h.alloc(256);
        assert_eq!(b, Some(192));
        h.free(0, 128);
        h.free(192, 256);
        h.free(128, 64);
        assert_eq!(h.free_bytes(), 1024);
        assert_eq!(h.alloc(1024), Some(0), "everything coalesced into one extent");
        assert_eq!(h.alloc(64), None);
    }

    #[test]
    fn overlapping_used_extents_are_reported() {
        let mut h = Heap::new();
        assert_eq!(h.add_space(0, 1024, &[(0, 128), (64, 64)]), Err((64, 64)));
        let mut h = Heap::new();
        assert_eq!(h.add_space(0, 1024, &[(1000, 64)]), Err((1000, 64)), "extent past the end");
    }
}
