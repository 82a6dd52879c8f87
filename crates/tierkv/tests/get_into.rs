//! `Db::get_into` answers like `Db::get` on every preset, and on the presets that lend values
//! in place (`pmekv`, `hpdk`, `lightkv`) a loop of reads into one warmed buffer allocates nothing: a
//! counting global allocator (per thread) shows it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::*;
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Preset};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

fn key(i: u32) -> Vec<u8> {
    format!("key{i:06}").into_bytes()
}

fn value(i: u32) -> Vec<u8> {
    vec![(i % 251) as u8; 50 + (i % 300) as usize]
}

#[test]
fn get_into_matches_get_on_every_preset() {
    for &preset in Preset::ALL {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
        for i in 0..2000u32 {
            db.put(key(i), value(i)).unwrap();
        }
        for i in (0..2000u32).step_by(3) {
            db.delete(key(i)).unwrap();
        }
        db.flush().unwrap();
        let mut buf = b"stale".to_vec();
        for i in 0..2100u32 {
            let want = db.get(key(i)).unwrap();
            let found = db.get_into(key(i), &mut buf).unwrap();
            assert_eq!(found, want.is_some(), "{preset:?} key {i}");
            assert_eq!(buf, want.unwrap_or_default(), "{preset:?} key {i}");
        }
        assert!(matches!(db.get_into(vec![0u8; 70_000], &mut buf), Err(tierkv::Error::InvalidArgument(_))));
    }
}

/// Reads into one warmed buffer allocate nothing on the presets that lend values in place
/// (pmekv from its PM heap; hpdk from its PM value log, found through the MemTable or, after
/// a flush, the DRAM B+-tree; lightkv from its PM write buffer, its probes comparing keys in
/// place).
#[test]
fn lending_presets_get_into_allocates_nothing_once_the_buffer_is_large_enough() {
    for (preset, flush) in
        [(Preset::Pmekv, false), (Preset::Hpdk, false), (Preset::Hpdk, true), (Preset::Lightkv, false)]
    {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        // lightkv with leaves large enough that the 1000 keys stay in the write buffer (an
        // SSTable read that misses the block cache allocates the block it reads).
        let lightkv =
            tierkv::LightkvOptions { leaf_buckets: 64, max_leaf_nodes: 64, ..tierkv::testing::lightkv_small() };
        let db = Db::open(dir(), sim_options(preset, &dev, &fs).lightkv(lightkv)).unwrap();
        for i in 0..1000u32 {
            db.put(key(i), value(i)).unwrap();
        }
        if flush {
            db.flush().unwrap();
        }
        let keys: Vec<Vec<u8>> = (0..1000u32).map(key).collect();
        let mut buf = Vec::with_capacity(1024);
        let before = allocs();
        let mut found = 0;
        for k in &keys {
            found += u32::from(db.get_into(k, &mut buf).unwrap());
        }
        let during = allocs() - before;
        assert_eq!(found, 1000, "{preset:?}");
        assert_eq!(during, 0, "{preset:?} (flushed: {flush}): 1000 reads into one buffer allocated {during} times");
        // The counter works: `get` allocates the value it returns.
        let before = allocs();
        for k in &keys {
            assert!(db.get(k).unwrap().is_some());
        }
        assert!(allocs() - before >= 1000);
    }
}
