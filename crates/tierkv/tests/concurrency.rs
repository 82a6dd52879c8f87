//! Several writer and reader threads on one store (real PM pool files, background
//! write-back running): no reader ever sees a torn or foreign value, and the final state
//! equals the model, before and after a reopen.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tierkv::{Db, HoakvOptions, HpdkOptions, LightkvOptions, Options, PmekvOptions, Preset, SlmdbOptions, WriteBatch};

fn opts(preset: Preset) -> Options {
    Options::new()
        .preset(preset)
        .pm_pool_size(8 << 20)
        .pmekv(PmekvOptions {
            node_capacity: 16,
            kv_log_size: 256 << 10,
            key_log_size: 256 << 10,
            writeback_interval_ms: 2,
        })
        // SLM-DB with its background flush/compaction threads and MemTables small enough to
        // flush many times during the run.
        .slmdb(SlmdbOptions {
            memtable_size: 128 << 10,
            block_size: 512,
            output_file_size: 16 << 10,
            ..SlmdbOptions::default()
        })
        // HPDK with its flush and merge threads, small MemTables and value pools.
        .hpdk(HpdkOptions {
            memtable_size: 64 << 10,
            vlog_pool_size: 1 << 20,
            block_size: 512,
            ..HpdkOptions::default()
        })
        // LightKV with its flush and compaction threads, leaves small enough to be linked,
        // flushed and compacted many times during the run.
        .lightkv(LightkvOptions {
            max_leaf_nodes: 8,
            leaf_buckets: 8,
            segment_size: 64 << 10,
            block_size: 512,
            ..LightkvOptions::default()
        })
        // HoaKV with its LSM and value-group threads, a HotStore small enough to demote,
        // MemTables that flush and values that reach the cold vlog and split groups.
        .hoakv(HoakvOptions {
            hot_store_size: 128 << 10,
            vtable_size: 32 << 10,
            heat_window: 512,
            value_size: 48,
            group_size: 64 << 10,
            memtable_size: 64 << 10,
            level1_size: 128 << 10,
            target_file_size: 32 << 10,
            block_size: 512,
            ..HoakvOptions::default()
        })
}

fn val(key: &[u8], version: u32, len: usize) -> Vec<u8> {
    let mut v = key.to_vec();
    v.extend_from_slice(format!("#{version}#").as_bytes());
    v.resize(v.len() + len, b'0' + (version % 10) as u8);
    v
}

#[test]
fn writers_and_readers_agree_with_the_model() {
    for &preset in presets() {
        let t = tempdir();
        let db = Arc::new(Db::open(t.path(), opts(preset)).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let db = db.clone();
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(100 + r);
                    let mut reads = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let k = format!("w{}-{:04}", rng.random_range(0..4), rng.random_range(0..300)).into_bytes();
                        if let Some(v) = db.get(&k).unwrap() {
                            assert!(v.starts_with(&k), "value of another key returned");
                        }
                        if reads.is_multiple_of(50) {
                            let mut last: Option<Vec<u8>> = None;
                            for item in db.scan::<std::ops::RangeFull>(..).unwrap() {
                                let (k, v) = item.unwrap();
                                assert!(v.starts_with(&k), "scan paired a key with another's value");
                                assert!(last.as_ref().is_none_or(|l| *l < k), "scan out of order or repeated");
                                last = Some(k);
                            }
                        }
                        reads += 1;
                    }
                    reads
                })
            })
            .collect();
        let writers: Vec<_> = (0..4u64)
            .map(|w| {
                let db = db.clone();
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(w);
                    let mut m = Model::new();
                    for i in 0..3000u32 {
                        let k = format!("w{w}-{:04}", rng.random_range(0..300)).into_bytes();
                        match rng.random_range(0..10) {
                            0 => {
                                db.delete(&k).unwrap();
                                m.remove(&k);
                            }
                            1 => {
                                let mut b = WriteBatch::new();
                                for j in 0..4 {
                                    let k2 = format!("w{w}-{:04}", (i + j * 7) % 300).into_bytes();
                                    let v = val(&k2, i, 10);
                                    b.put(&k2, &v);
                                    m.insert(k2, v);
                                }
                                db.write(b).unwrap();
                            }
                            2 => {
                                let v = val(&k, i, 5);
                                let added = db.insert_if_absent(&k, &v).unwrap();
                                assert_eq!(added, !m.contains_key(&k));
                                if added {
                                    m.insert(k, v);
                                }
                            }
                            _ => {
                                let v = val(&k, i, rng.random_range(0..600));
                                db.put(&k, &v).unwrap();
                                m.insert(k, v);
                            }
                        }
                    }
                    m
                })
            })
            .collect();
        let mut model = Model::new();
        for w in writers {
            model.extend(w.join().unwrap());
        }
        stop.store(true, Ordering::Relaxed);
        let reads: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
        assert!(reads > 0);
        assert_matches(&db, &model, &format!("{preset} after concurrent run"));
        // The background work of each design really ran while the threads did (native has
        // none: its logs rolled over to new segments while the threads wrote).
        let what = match preset {
            Preset::Slmdb | Preset::Hpdk | Preset::Lightkv | Preset::Hoakv => "flushes",
            Preset::Native => "segments_created",
            _ => "checkpoints",
        };
        let n = db.stats().design.get(what).copied().unwrap_or(0);
        assert!(n > 0, "{preset}: background {what} never ran");
        if preset == Preset::Lightkv {
            let c = db.stats().design.get("compactions").copied().unwrap_or(0);
            assert!(c > 0, "lightkv: no partition compaction ran during the concurrent run");
        }
        if preset == Preset::Hoakv {
            let d = db.stats().design;
            for what in ["compactions", "promotions", "demotions", "vlog_values", "hot_writes"] {
                assert!(d.get(what).copied().unwrap_or(0) > 0, "hoakv: no {what} during the concurrent run: {d:?}");
            }
        }
        Arc::try_unwrap(db).unwrap().close().unwrap();
        let db = Db::open(t.path(), opts(preset)).unwrap();
        assert_matches(&db, &model, &format!("{preset} after reopen"));
    }
}

/// Per-key linearizability on single-writer registers, sampled: each writer owns its keys
/// and publishes, per key, the highest version it has *started* (before the write) and the
/// highest *acknowledged* (after). A reader that reads key `k` must see a version between
/// the acknowledged version it observed before the read and the started version it observes
/// after it, and never an older version than one it saw before (reads do not go back in
/// time), while flushes, merges, compactions and write-back run in the background. Deletes
/// are versions too (odd multiples of 7 delete), so "absent" is checked like a value.
#[test]
fn sampled_keys_are_linearizable_registers() {
    use std::sync::atomic::AtomicU64;
    const KEYS: usize = 64;
    const WRITERS: usize = 2;
    let is_del = |v: u64| v.is_multiple_of(7) && v % 2 == 1;
    for &preset in presets() {
        let t = tempdir();
        let db = Arc::new(Db::open(t.path(), opts(preset)).unwrap());
        let started: Arc<Vec<AtomicU64>> = Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect());
        let acked: Arc<Vec<AtomicU64>> = Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let key = |i: usize| format!("lin{i:03}").into_bytes();
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (db, started, acked) = (db.clone(), started.clone(), acked.clone());
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(w as u64);
                    // Filler keys make the MemTables fill and the background work run.
                    for n in 0..6000u64 {
                        let i = rng.random_range(0..KEYS / WRITERS) * WRITERS + w;
                        let v = started[i].load(Ordering::Relaxed) + 1;
                        started[i].store(v, Ordering::SeqCst);
                        let k = format!("lin{i:03}").into_bytes();
                        if is_del(v) {
                            db.delete(&k).unwrap();
                        } else {
                            db.put(&k, val(&k, v as u32, 40)).unwrap();
                        }
                        acked[i].store(v, Ordering::SeqCst);
                        let f = format!("fill{w}-{:05}", n % 3000).into_bytes();
                        db.put(&f, val(&f, n as u32, 200)).unwrap();
                    }
                })
            })
            .collect();
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (db, started, acked, stop) = (db.clone(), started.clone(), acked.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut rng = SmallRng::seed_from_u64(100 + r);
                    let mut seen = [0u64; KEYS];
                    let mut reads = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let i = rng.random_range(0..KEYS);
                        let k = key(i);
                        let lo = acked[i].load(Ordering::SeqCst);
                        let got = db.get(&k).unwrap();
                        let hi = started[i].load(Ordering::SeqCst);
                        let version = match got {
                            Some(v) => {
                                let s = String::from_utf8_lossy(&v).into_owned();
                                let body = s
                                    .strip_prefix(&format!("lin{i:03}#"))
                                    .unwrap_or_else(|| panic!("foreign value {s}"));
                                let n: u64 = body.split('#').next().unwrap().parse().unwrap();
                                assert_eq!(v, val(&k, n as u32, 40), "torn value");
                                assert!(!is_del(n), "key {i}: a value for delete version {n}");
                                assert!(
                                    lo <= n && n <= hi,
                                    "key {i}: read version {n}, acknowledged {lo}, started {hi}"
                                );
                                assert!(n >= seen[i], "key {i}: read went back from version {} to {n}", seen[i]);
                                n
                            }
                            // Absent: some delete version in [max(acknowledged, seen), started],
                            // or nothing acknowledged or seen yet.
                            None => {
                                let from = lo.max(seen[i]).max(1);
                                match (from..=hi).rev().find(|v| is_del(*v)) {
                                    Some(d) => d,
                                    None if lo == 0 && seen[i] == 0 => 0,
                                    None => panic!(
                                        "key {i}: absent, but no delete in [{from}, {hi}] (acknowledged {lo}, seen {})",
                                        seen[i]
                                    ),
                                }
                            }
                        };
                        seen[i] = seen[i].max(version);
                        reads += 1;
                    }
                    reads
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let reads: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
        assert!(reads > 1000, "{preset}: only {reads} checked reads");
        assert!(db.check().unwrap().is_empty());
        eprintln!("{preset}: {reads} linearizability-checked reads");
    }
}
