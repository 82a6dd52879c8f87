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
use tierkv::{Db, HpdkOptions, Options, PmekvOptions, Preset, SlmdbOptions, WriteBatch};

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
        // The background work of each design really ran while the threads did.
        let what = match preset {
            Preset::Slmdb | Preset::Hpdk => "flushes",
            _ => "checkpoints",
        };
        let n = db.stats().design.get(what).copied().unwrap_or(0);
        assert!(n > 0, "{preset}: background {what} never ran");
        Arc::try_unwrap(db).unwrap().close().unwrap();
        let db = Db::open(t.path(), opts(preset)).unwrap();
        assert_matches(&db, &model, &format!("{preset} after reopen"));
    }
}
