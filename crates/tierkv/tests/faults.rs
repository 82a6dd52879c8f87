//! I/O fault injection on every preset: EIO or ENOSPC at every file operation a random
//! workload performs (flushes, merges and compactions included), once or from then on. The
//! failing call returns an error, never a panic; no write acknowledged before or after the
//! fault is lost (checked after a process crash and reopen); and the reopened store works.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::{FaultFs, FaultKind};
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Preset};

/// Run `steps` with a fault at file operation `n` (counted from the end of open). Returns
/// false once `n` is past the workload's last file operation.
fn fault_point(preset: Preset, steps: &[Step], n: u64, kind: FaultKind, sticky: bool) -> bool {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
    fs.fail_after(n, kind, sticky);
    let ctx = format!("{preset} fault {kind:?} sticky {sticky} at fs op {n}");
    // `sure`: every acknowledged write. The first failing step may or may not have taken
    // effect; after it the store may refuse everything (poisoned), so the run stops there.
    let mut sure = Model::new();
    let mut failed: Option<&Step> = None;
    for s in steps.iter().filter(|s| s.writes() || matches!(s, Step::Flush)) {
        if let Err(e) = db_apply(&db, s) {
            assert!(!e.is_corruption(), "{ctx}: a fault reported as corruption: {e}");
            failed = Some(s);
            break;
        }
        model_apply(&mut sure, s);
    }
    let Some(failed) = failed else { return false };
    db.simulate_process_crash();
    fs.clear_faults();
    // A process crash: PM keeps persisted lines (and, at random, some others), files keep
    // what was written.
    let dev = dev.simulate_crash(n, 0.5);
    let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap_or_else(|e| panic!("{ctx}: reopen failed: {e}"));
    let got = dump(&db);
    let mut with = sure.clone();
    model_apply(&mut with, failed);
    assert!(got == sure || got == with, "{ctx}: store differs from the acknowledged writes");
    assert_eq!(db.check().unwrap(), Vec::<String>::new(), "{ctx}");
    db.put(b"after-fault", b"works").unwrap();
    assert_eq!(db.get(b"after-fault").unwrap().as_deref(), Some(&b"works"[..]), "{ctx}");
    true
}

#[test]
fn file_faults_at_every_operation_lose_no_acknowledged_write() {
    for &preset in presets() {
        let w = workload(11, 160, 40, false);
        let mut points = 0;
        for (kind, sticky) in [(FaultKind::Eio, true), (FaultKind::Enospc, false)] {
            let mut n = 1;
            while fault_point(preset, &w, n, kind, sticky) {
                n += 1;
                points += 1;
            }
        }
        eprintln!("{preset}: {points} file-operation fault points");
    }
}

#[test]
fn a_failed_sync_poisons_the_store_until_reopen() {
    // A one-shot fault at each of the first file operations of a flush (slmdb, hpdk) or of a
    // put (hpdk's WAL: append, then fsync): the call fails; afterwards the store either
    // refuses writes with `Poisoned` (state in memory may differ from what is durable) or,
    // when the failure changed nothing, keeps working, and nothing acknowledged is lost.
    let mut poisoned = 0;
    for preset in [Preset::Slmdb, Preset::Hpdk, Preset::Lightkv] {
        for n in 1..=6 {
            for flush in [true, false] {
                let dev = SimDevice::new();
                let fs = FaultFs::new();
                let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
                let mut m = Model::new();
                for i in 0..50u32 {
                    db.put(format!("k{i}"), vec![b'v'; 100]).unwrap();
                    m.insert(format!("k{i}").into_bytes(), vec![b'v'; 100]);
                }
                fs.fail_after(n, FaultKind::Eio, false);
                let r = if flush { db.flush() } else { db.put(b"x", b"y") };
                if r.is_ok() {
                    continue;
                }
                let ctx = format!("{preset} flush {flush} fault at op {n}");
                match db.put(b"z", b"z") {
                    Err(tierkv::Error::Poisoned(_)) => poisoned += 1,
                    Err(e) => panic!("{ctx}: {e}"),
                    Ok(()) => {
                        m.insert(b"z".to_vec(), b"z".to_vec());
                    }
                }
                db.simulate_process_crash();
                let db = Db::open(dir(), sim_options(preset, &dev.simulate_crash(n, 0.0), &fs)).unwrap();
                let got = dump(&db);
                let mut with = m.clone();
                with.insert(b"x".to_vec(), b"y".to_vec());
                assert!(got == m || (!flush && got == with), "{ctx}: acknowledged writes lost");
                db.put(b"after", b"reopen").unwrap();
            }
        }
    }
    assert!(poisoned > 0, "no failure poisoned the store");
    eprintln!("{poisoned} failures left the store poisoned until reopen");
    // hpdk's WAL fsync failing (op 2 of a put with sync_wal) must poison.
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let db = Db::open(dir(), sim_options(Preset::Hpdk, &dev, &fs)).unwrap();
    fs.fail_after(2, FaultKind::Eio, false);
    assert!(db.put(b"a", b"b").is_err());
    assert!(matches!(db.put(b"c", b"d"), Err(tierkv::Error::Poisoned(_))));
}

/// Write distinct keys with 1 KiB values until a write fails; returns the acknowledged
/// writes and the error.
fn fill_until_error(db: &Db, limit: u32) -> (Model, tierkv::Error) {
    let mut m = Model::new();
    for i in 0..limit {
        let (k, v) = (format!("key{i:08}"), vec![(i % 251) as u8; 1000]);
        match db.put(&k, &v) {
            Ok(()) => {
                m.insert(k.into_bytes(), v);
            }
            Err(e) => return (m, e),
        }
    }
    panic!("{}: {limit} writes of 1 KiB never filled the device", db.preset());
}

#[test]
fn a_full_pm_device_fails_the_write_and_keeps_every_acknowledged_one() {
    // HoaKV keeps only its bounded HotStore in PM, and new keys start cold (on disk): this
    // workload of fresh keys never fills PM there (its own test follows).
    for &preset in presets().iter().filter(|&&p| p != Preset::Hoakv) {
        let dev = SimDevice::new();
        dev.limit_pools(3);
        let fs = FaultFs::new();
        let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
        let (mut m, err) = fill_until_error(&db, 200_000);
        let ctx = format!("{preset} after {} acknowledged writes", m.len());
        assert!(matches!(err, tierkv::Error::PmFull(_)), "{ctx}: expected PmFull, got {err}");
        // Nothing acknowledged is lost, and the store still reads and checks clean.
        for (k, v) in m.iter().step_by(7) {
            assert_eq!(db.get(k).unwrap().as_ref(), Some(v), "{ctx}");
        }
        assert_eq!(dump(&db), m, "{ctx}: the failed write changed the store");
        // A later write fails the same way, or is refused as poisoned when the failure hit
        // a background step (a flush) whose in-memory state is only settled by a reopen, or
        // succeeds when the failed step released what it had allocated (lightkv: a
        // compaction's output) and the write fits; then it must be kept like any other.
        let poisoned = match db.put(b"one-more", vec![1u8; 1000]) {
            Err(tierkv::Error::PmFull(_)) => false,
            Err(tierkv::Error::Poisoned(_)) => true,
            Ok(()) => {
                m.insert(b"one-more".to_vec(), vec![1u8; 1000]);
                false
            }
            Err(e) => panic!("{ctx}: write on a full device returned {e}"),
        };
        if !poisoned {
            assert_eq!(db.check().unwrap(), Vec::<String>::new(), "{ctx}");
        }
        db.simulate_process_crash();
        // After a crash, with room again, every acknowledged write is there and writes work.
        let dev = dev.simulate_crash(1, 0.5);
        dev.limit_pools(8);
        let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap_or_else(|e| panic!("{ctx}: reopen: {e}"));
        assert_eq!(dump(&db), m, "{ctx}: after reopen");
        assert_eq!(db.check().unwrap(), Vec::<String>::new(), "{ctx}: after reopen");
        db.put(b"after", b"room").unwrap();
        eprintln!("{ctx}: {err} (poisoned: {poisoned})");
    }
}

/// HoaKV keeps only its bounded HotStore in PM, with the ColdStore behind it: on a full PM
/// device a promotion is refused (the key stays cold) and a hot key whose grown record finds
/// no slot moves to the ColdStore. No write fails, none is lost, before or after a crash.
#[test]
fn hoakv_on_a_full_pm_device_keeps_keys_cold_and_loses_nothing() {
    if !presets().contains(&Preset::Hoakv) {
        return;
    }
    let dev = SimDevice::new();
    dev.limit_pools(2);
    let fs = FaultFs::new();
    // A HotStore far larger than the device, and the heat window wide enough that every
    // rewritten key is a promotion candidate.
    let hoakv =
        tierkv::HoakvOptions { hot_store_size: 64 << 20, heat_window: 1 << 30, ..tierkv::testing::hoakv_small() };
    let opts = |d: &SimDevice| sim_options(Preset::Hoakv, d, &fs).hoakv(hoakv.clone());
    let db = Db::open(dir(), opts(&dev)).unwrap();
    let mut m = Model::new();
    let d = |db: &Db, k: &str| db.stats().design.get(k).copied().unwrap_or(0);
    // Every key written twice: the second write promotes it while PM lasts.
    for i in 0..2500u32 {
        let k = format!("key{i:05}").into_bytes();
        for round in 0..2u8 {
            let v = vec![round; 600];
            db.put(&k, &v).unwrap_or_else(|e| panic!("write {i}.{round} on a full device: {e}"));
            m.insert(k.clone(), v);
        }
    }
    let (promoted, refused) = (d(&db, "promotions"), d(&db, "promotions_refused"));
    assert!(promoted > 100 && refused > 100, "promotions {promoted}, refused {refused}: PM filled up");
    // Hot keys whose records grow past their class need a new slot: none is left.
    let hot: Vec<Vec<u8>> = m.keys().take(400).cloned().collect();
    for k in &hot {
        let v = vec![9u8; 1400];
        db.put(k, &v).unwrap();
        m.insert(k.clone(), v);
    }
    let overflows = d(&db, "hot_overflows");
    assert!(overflows > 0, "no hot key overflowed to the ColdStore");
    assert_eq!(dump(&db), m);
    assert_eq!(db.check().unwrap(), Vec::<String>::new());
    db.simulate_process_crash();
    let dev = dev.simulate_crash(3, 0.5);
    let db = Db::open(dir(), opts(&dev)).unwrap();
    assert_eq!(dump(&db), m, "after a crash");
    assert_eq!(db.check().unwrap(), Vec::<String>::new(), "after a crash");
    db.put(b"after", b"crash").unwrap();
    eprintln!("hoakv on a full device: {promoted} promotions, {refused} refused, {overflows} hot overflows");
}

#[test]
fn a_failed_msync_fails_the_write_and_poisons_the_store() {
    // Real pool files with `pm_sync`: every fence msyncs. An injected msync failure fails the
    // write that sees it with an I/O error, every later write with `Poisoned`; a reopened
    // store has every acknowledged write and works.
    for &preset in presets() {
        for after in [0u64, 1, 3, 10] {
            let tmp = tempfile::tempdir().unwrap();
            let health = std::sync::Arc::new(tierkv::pm::PmHealth::default());
            let mut opts = sim_options(preset, &SimDevice::new(), &FaultFs::new());
            opts.pm_device = None;
            opts.fs = None;
            opts.pm_sync = true;
            let mut m = Model::new();
            let ctx = format!("{preset} msync fails after {after}");
            {
                let db = Db::open(tmp.path(), tierkv::Options { pm_health: Some(health.clone()), ..opts.clone() })
                    .unwrap_or_else(|e| panic!("{ctx}: open: {e}"));
                for i in 0..20u32 {
                    db.put(format!("a{i}"), b"acknowledged").unwrap();
                    m.insert(format!("a{i}").into_bytes(), b"acknowledged".to_vec());
                }
                health.fail_msync_after(after);
                let mut first = None;
                for i in 0..200u32 {
                    // HoaKV writes PM only for hot keys: rewrite the written keys, which their
                    // second access promotes into the HotStore.
                    let k = if preset == Preset::Hoakv { format!("a{}", i % 20) } else { format!("b{i}") };
                    match db.put(&k, b"maybe") {
                        Ok(()) => {
                            m.insert(k.into_bytes(), b"maybe".to_vec());
                        }
                        Err(e) => {
                            // The failed write may or may not have reached PM.
                            m.remove(k.as_bytes());
                            first = Some(e);
                            break;
                        }
                    }
                }
                let first = first.unwrap_or_else(|| panic!("{ctx}: no write failed"));
                assert!(matches!(first, tierkv::Error::Io(_)), "{ctx}: first failure {first}");
                assert!(matches!(db.put(b"c", b"d"), Err(tierkv::Error::Poisoned(_))), "{ctx}");
                assert!(matches!(db.delete(b"a1"), Err(tierkv::Error::Poisoned(_))), "{ctx}");
                // Reads still work.
                if let Some(v) = m.get(b"a3".as_slice()) {
                    assert_eq!(db.get(b"a3").unwrap().as_ref(), Some(v), "{ctx}");
                }
                db.simulate_process_crash();
            }
            let db = Db::open(tmp.path(), opts).unwrap_or_else(|e| panic!("{ctx}: reopen: {e}"));
            let got = dump(&db);
            for (k, v) in &m {
                assert_eq!(got.get(k), Some(v), "{ctx}: acknowledged write lost");
            }
            db.put(b"after", b"reopen").unwrap();
            db.close().unwrap();
        }
    }
}

#[test]
fn a_read_only_file_system_fails_writes_and_open_clearly() {
    for &preset in presets() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
        let w = workload(5, 200, 60, false);
        let mut m = Model::new();
        for s in w.iter().filter(|s| s.writes() || matches!(s, Step::Flush)) {
            db_apply(&db, s).unwrap();
            model_apply(&mut m, s);
        }
        // The kernel remounts the file system read-only (errors=remount-ro).
        fs.set_read_only(true);
        let ctx = format!("{preset} on a read-only file system");
        let mut failures = 0;
        for i in 0..400u32 {
            let (k, v) = (format!("ro{i:04}"), vec![7u8; 300]);
            match db.put(&k, &v) {
                Ok(()) => {
                    m.insert(k.into_bytes(), v);
                }
                Err(e) => {
                    assert!(!e.is_corruption(), "{ctx}: {e}");
                    failures += 1;
                }
            }
        }
        match db.flush() {
            Ok(()) => {}
            Err(e) => {
                assert!(!e.is_corruption(), "{ctx}: flush: {e}");
                failures += 1;
            }
        }
        // Reads of everything acknowledged keep working.
        for (k, v) in m.iter().step_by(5) {
            assert_eq!(db.get(k).unwrap().as_ref(), Some(v), "{ctx}");
        }
        db.simulate_process_crash();
        // Opening on the read-only file system is a clear error naming the cause.
        let e = Db::open(dir(), sim_options(preset, &dev, &fs)).expect_err("opened on a read-only fs");
        assert!(e.to_string().contains("Read-only file system"), "{ctx}: {e}");
        assert!(e.to_string().contains("/db/LOCK"), "{ctx}: {e}");
        fs.set_read_only(false);
        let db = Db::open(dir(), sim_options(preset, &dev.simulate_crash(9, 0.5), &fs.crash())).unwrap();
        let got = dump(&db);
        for (k, v) in &m {
            assert_eq!(got.get(k), Some(v), "{ctx}: acknowledged write lost");
        }
        db.put(b"after", b"writable").unwrap();
        eprintln!("{ctx}: {failures} writes refused, {} acknowledged kept", m.len());
    }
}

#[test]
fn a_panic_in_a_background_thread_poisons_the_store_instead_of_hanging_it() {
    // The background flush panics at its MANIFEST commit (lightkv: when it creates its
    // SSTable): writes are then refused with `Poisoned` naming the panic (never a hang, never
    // an abort), and a reopened store has every acknowledged write.
    for preset in [Preset::Slmdb, Preset::Hpdk, Preset::Lightkv] {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let mut opts = sim_options(preset, &dev, &fs);
        opts.slmdb.background = true;
        opts.hpdk.background = true;
        opts.lightkv.background = true;
        let db = Db::open(dir(), opts.clone()).unwrap();
        fs.panic_on(if preset == Preset::Lightkv { ".sst" } else { "MANIFEST" });
        let mut m = Model::new();
        let mut why = None;
        for i in 0..50_000u32 {
            let (k, v) = (format!("k{i:06}"), vec![(i % 251) as u8; 100]);
            match db.put(&k, &v) {
                Ok(()) => {
                    m.insert(k.into_bytes(), v);
                }
                Err(tierkv::Error::Poisoned(w)) => {
                    why = Some(w);
                    break;
                }
                Err(e) => panic!("{preset}: {e}"),
            }
        }
        let why = why.unwrap_or_else(|| panic!("{preset}: the background panic did not poison the store"));
        assert!(why.contains("panicked"), "{preset}: {why}");
        assert!(matches!(db.flush(), Err(tierkv::Error::Poisoned(_))), "{preset}");
        db.simulate_process_crash();
        let db = Db::open(dir(), sim_options(preset, &dev.simulate_crash(3, 0.5), &fs.crash())).unwrap();
        let got = dump(&db);
        for (k, v) in &m {
            assert_eq!(got.get(k), Some(v), "{preset}: acknowledged write lost");
        }
        db.put(b"after", b"reopen").unwrap();
        eprintln!("{preset}: poisoned after {} acknowledged writes: {why}", m.len());
    }
}
