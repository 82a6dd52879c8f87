//! Regression tests of `native` found by review (each fails on the first version):
//! - a scan, iterator or snapshot taken right after a thread's own put returned missed it
//!   while other threads wrote (the snapshot number stopped below writes in flight);
//! - a write racing `Db::close` could be acknowledged after the clean-close record was
//!   written, and then be lost at reopen (or make the reopen fail).
//!
//! And the segment prefaulting of the inserter thread on real pool files.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Mutex};

use tierkv::fs::FaultFs;
use tierkv::options::{NativeOptions, Preset};
use tierkv::pm::sim::SimDevice;
use tierkv::Db;

/// Writes acknowledged to the writers: (key, value) in order.
type Acked = Arc<Mutex<Vec<(Vec<u8>, Vec<u8>)>>>;

fn opts(dev: &SimDevice, fs: &FaultFs, pool: u64, segment: u64) -> tierkv::Options {
    tierkv::testing::sim_options(Preset::Native, dev, fs).pm_pool_size(pool).native(NativeOptions {
        shards: 4,
        segment_size: segment,
        ..tierkv::testing::native_small()
    })
}

#[test]
fn a_scan_and_a_snapshot_see_the_callers_own_acknowledged_put() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let db = Arc::new(Db::open("/db", opts(&dev, &fs, 64 << 20, 1 << 20)).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let noise: Vec<_> = (0..2)
        .map(|t| {
            let (db, stop) = (db.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    db.put(format!("n{t}-{}", i % 100), [7u8; 100]).unwrap();
                    i += 1;
                }
            })
        })
        .collect();
    let (mut miss_scan, mut miss_snap) = (0, 0);
    let n = 4000u32;
    for i in 0..n {
        let k = format!("mine-{i:06}");
        db.put(&k, b"v").unwrap();
        let mut it = db.iter().unwrap();
        it.seek(k.as_bytes());
        match it.next_ref().unwrap() {
            Some((kk, _)) if kk == k.as_bytes() => {}
            _ => miss_scan += 1,
        }
        if i % 4 == 0 && db.snapshot().unwrap().get(&k).unwrap().is_none() {
            miss_snap += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for h in noise {
        h.join().unwrap();
    }
    assert_eq!((miss_scan, miss_snap), (0, 0), "own puts missed by the next scan / snapshot");
}

#[test]
fn a_write_racing_close_is_refused_or_kept() {
    for round in 0..30u32 {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let o = opts(&dev, &fs, 1 << 20, 16 << 10);
        let db = Arc::new(Db::open("/db", o.clone()).unwrap());
        let acked: Acked = Arc::default();
        let bar = Arc::new(Barrier::new(9));
        let hs: Vec<_> = (0..8)
            .map(|t| {
                let (db, acked, bar) = (db.clone(), acked.clone(), bar.clone());
                std::thread::spawn(move || {
                    bar.wait();
                    for i in 0..100_000u32 {
                        let k = format!("t{t}-{}", i % 50).into_bytes();
                        let v = format!("v{i:08}-{}", "x".repeat(200)).into_bytes();
                        match db.put(&k, &v) {
                            Ok(()) => acked.lock().unwrap().push((k, v)),
                            Err(_) => break,
                        }
                    }
                })
            })
            .collect();
        bar.wait();
        std::thread::sleep(std::time::Duration::from_millis(2 + u64::from(round % 5)));
        db.close().unwrap();
        for h in hs {
            h.join().unwrap();
        }
        drop(db);
        let want: BTreeMap<Vec<u8>, Vec<u8>> = acked.lock().unwrap().iter().cloned().collect();
        let db2 = Db::open("/db", o).unwrap_or_else(|e| panic!("round {round}: reopen after a clean close: {e}"));
        for (k, v) in &want {
            assert_eq!(db2.get(k).unwrap().as_deref(), Some(v.as_slice()), "round {round}: acknowledged write lost");
        }
    }
}

/// With `pm_capacity` set, live log data past `pm_watermark` of it moves to disk: four
/// times the PM capacity in values fits, every value reads back (also after a reopen),
/// and PM never runs out. (No background thread: writers move as they start segments.)
#[test]
fn data_four_times_the_pm_capacity_fits_through_the_capacity_tier() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let o = || {
        tierkv::testing::sim_options(Preset::Native, &dev, &fs)
            .pm_pool_size(1 << 20)
            .pm_capacity(2 << 20)
            .native(NativeOptions { dram_budget: 0, ..tierkv::testing::native_small() })
    };
    let db = Db::open("/db", o()).unwrap();
    let mut m = std::collections::BTreeMap::new();
    for i in 0..8000u32 {
        let k = format!("key{:05}", (i * 7919) % 8000).into_bytes();
        let v = vec![(i % 251) as u8; 1000];
        db.put(&k, &v).unwrap_or_else(|e| panic!("put {i}: {e} {:?}", db.stats().design));
        m.insert(k, v);
    }
    let s = db.stats();
    let d = |k: &str| s.design.get(k).copied().unwrap_or(0);
    assert!(d("cold_keys_moved") > 4000, "{:?}", s.design);
    assert!(s.pm.pools <= 2);
    assert!(d("pm_live_log_bytes") <= 2 << 20, "{:?}", s.design);
    for (k, v) in &m {
        assert_eq!(db.get(k).unwrap().as_ref(), Some(v));
    }
    assert!(db.check().unwrap().is_empty());
    db.close().unwrap();
    drop(db);
    let db = Db::open("/db", o()).unwrap();
    let n = db.scan(..).unwrap().map(|r| r.unwrap()).filter(|(k, v)| m.get(k) == Some(v)).count();
    assert_eq!(n, m.len());
}

/// On real pool files the inserter thread faults in the segment slots writers take next
/// (`segments_prefaulted`), and what was written reads back unchanged.
#[test]
fn the_segments_writers_take_next_are_faulted_in_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let o = tierkv::Options::new().preset(Preset::Native).pm_pool_size(16 << 20).native(NativeOptions {
        shards: 4,
        segment_size: 256 << 10,
        ..NativeOptions::default()
    });
    let db = Db::open(dir.path(), o.clone()).unwrap();
    let design = |db: &Db, name: &str| db.stats().design.get(name).copied().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut i = 0u32;
    // Writes until the inserter has faulted in segments beyond the first ones (it runs
    // on its own schedule: poll, never time it).
    while design(&db, "segments_prefaulted") < 8 {
        assert!(std::time::Instant::now() < deadline, "no segment was faulted in ahead");
        for _ in 0..64 {
            db.put(format!("k{i:08}"), vec![(i % 251) as u8; 1000]).unwrap();
            i += 1;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(design(&db, "segments_created") >= 2);
    db.close().unwrap();
    drop(db);
    let db = Db::open(dir.path(), o).unwrap();
    for j in (0..i).step_by(97) {
        assert_eq!(db.get(format!("k{j:08}")).unwrap(), Some(vec![(j % 251) as u8; 1000]));
    }
}
