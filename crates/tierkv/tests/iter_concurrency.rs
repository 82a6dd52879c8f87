//! Iterators under concurrent writers and background work, for every preset with its own
//! iterator: readers make random moves (next, prev, seek, seek_for_prev, seek_to_first,
//! seek_to_last) through `DbIterator`s while two writers overwrite and delete the odd keys
//! and force compactions. The even keys are never written after the load, so every
//! iterator must return each of them exactly once, in order, with its value, in both
//! directions and across direction changes; an odd key, when returned, carries its own
//! value. The test also shows the writers and the background work ran during the reads.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::testing::{hoakv_small, hpdk_small, sim_options, slmdb_small};
use tierkv::{Db, HoakvOptions, HpdkOptions, LightkvOptions, PmekvOptions, Preset, SlmdbOptions};

const N: u32 = 3000;

fn key(i: u32) -> Vec<u8> {
    format!("k{i:05}").into_bytes()
}

/// A value that names its key (so a value returned under the wrong key is caught).
fn val(i: u32, round: u64, len: usize) -> Vec<u8> {
    let mut v = format!("k{i:05}:{round}:").into_bytes();
    v.resize(len.max(v.len()), b'a' + (round % 26) as u8);
    v
}

fn is_stable(k: &[u8]) -> bool {
    k.last().is_some_and(|d| (d - b'0').is_multiple_of(2))
}

/// The design counter that counts the preset's background work (flush, checkpoint, …).
fn background_counter(p: Preset) -> &'static str {
    match p {
        Preset::Hpdk => "flushes",
        Preset::Pmekv => "checkpoints",
        Preset::Hoakv => "flushes",
        Preset::Slmdb => "flushes",
        Preset::Lightkv => "flushes",
        other => panic!("no background counter named for {other}"),
    }
}

fn run(preset: Preset) {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let o = sim_options(preset, &dev, &fs)
        .hpdk(HpdkOptions { background: true, ..hpdk_small() })
        .pmekv(PmekvOptions {
            node_capacity: 8,
            kv_log_size: 256 << 10,
            key_log_size: 256 << 10,
            writeback_interval_ms: 1,
        })
        .hoakv(HoakvOptions { background: true, ..hoakv_small() })
        .slmdb(SlmdbOptions { background: true, ..slmdb_small() })
        // Leaves of 64 slots, at most 32 partitions: 3000 keys fill leaves, so overwrites
        // flush and compact while the readers walk (lightkv_small's 20-slot leaves make
        // thousands of tiny tables, minutes of work under the fault-injecting file system).
        .lightkv(LightkvOptions {
            background: true,
            leaf_buckets: 16,
            max_leaf_nodes: 32,
            segment_size: 64 << 10,
            block_size: 4096,
            ..LightkvOptions::default()
        });
    let db = Arc::new(Db::open("/db", o).unwrap());
    let mut rng = SmallRng::seed_from_u64(1);
    let mut stable = Vec::new();
    for i in 0..N {
        let v = val(i, 0, rng.random_range(20..400));
        db.put(key(i), &v).unwrap();
        if i.is_multiple_of(2) {
            stable.push((key(i), v));
        }
    }
    let stable = Arc::new(stable);
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..2u64)
        .map(|t| {
            let (db, stop, writes) = (db.clone(), stop.clone(), writes.clone());
            std::thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(10 + t);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let i = rng.random_range(0..N / 2) * 2 + 1;
                    if rng.random_bool(0.3) {
                        db.delete(key(i)).unwrap();
                    } else {
                        db.put(key(i), val(i, n + 1, rng.random_range(20..400))).unwrap();
                    }
                    n += 1;
                    writes.fetch_add(1, Ordering::Relaxed);
                    if n.is_multiple_of(500) {
                        db.compact().unwrap();
                    }
                }
            })
        })
        .collect();
    let counter = background_counter(preset);
    let design = |db: &Db| db.stats().design.get(counter).copied().unwrap_or(0);
    let (writes_before, background_before) = (writes.load(Ordering::Relaxed), design(&db));
    let readers: Vec<_> = (0..2u64)
        .map(|t| {
            let (db, stable) = (db.clone(), stable.clone());
            std::thread::spawn(move || walk(&db, &stable, preset, 100 + t))
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }
    let (writes_during, background_during) =
        (writes.load(Ordering::Relaxed) - writes_before, design(&db) - background_before);
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    assert!(writes_during > 100, "{preset}: only {writes_during} writes ran during the reads");
    assert!(background_during > 0, "{preset}: no {counter} during the reads");
}

/// Random moves over fresh iterators; `g` counts the stable keys before the gap.
fn walk(db: &Db, stable: &[(Vec<u8>, Vec<u8>)], preset: Preset, seed: u64) {
    let mut rng = SmallRng::seed_from_u64(seed);
    for round in 0..60 {
        let mut it = db.iter().unwrap();
        let mut g = 0usize;
        for step in 0..2000 {
            let at = format!("{preset} round {round} step {step}");
            match rng.random_range(0..20) {
                0..8 => match it.next_ref().unwrap() {
                    Some((k, v)) if is_stable(k) => {
                        let want = stable.get(g).unwrap_or_else(|| panic!("{at}: next past the end gave {k:?}"));
                        assert_eq!((k, v), (&want.0[..], &want.1[..]), "{at}: next");
                        g += 1;
                    }
                    Some((k, v)) => assert!(v.starts_with(k), "{at}: {k:?} has another key's value"),
                    None => assert_eq!(g, stable.len(), "{at}: next ended early"),
                },
                8..16 => match it.prev_ref().unwrap() {
                    Some((k, v)) if is_stable(k) => {
                        assert!(g > 0, "{at}: prev before the start gave {k:?}");
                        let want = &stable[g - 1];
                        assert_eq!((k, v), (&want.0[..], &want.1[..]), "{at}: prev");
                        g -= 1;
                    }
                    Some((k, v)) => assert!(v.starts_with(k), "{at}: {k:?} has another key's value"),
                    None => assert_eq!(g, 0, "{at}: prev ended early"),
                },
                16 => {
                    let k = key(rng.random_range(0..N + 5));
                    it.seek(&k);
                    g = stable.partition_point(|e| e.0 < k);
                }
                17 => {
                    let k = key(rng.random_range(0..N + 5));
                    it.seek_for_prev(&k);
                    g = stable.partition_point(|e| e.0 <= k);
                }
                18 => {
                    it.seek_to_first();
                    g = 0;
                }
                _ => {
                    it.seek_to_last();
                    g = stable.len();
                }
            }
        }
    }
}

#[test]
fn hpdk_iterators_under_writers_and_background_work() {
    run(Preset::Hpdk);
}

#[test]
fn pmekv_iterators_under_writers_and_background_work() {
    run(Preset::Pmekv);
}

#[test]
fn hoakv_iterators_under_writers_and_background_work() {
    run(Preset::Hoakv);
}

#[test]
fn slmdb_iterators_under_writers_and_background_work() {
    run(Preset::Slmdb);
}

#[test]
fn lightkv_iterators_under_writers_and_background_work() {
    run(Preset::Lightkv);
}
