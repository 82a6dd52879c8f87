//! Bad input is refused with a clear error and writes nothing: over-limit keys and values,
//! bad options, missing or unusable directories, a store that is already open, a closed
//! handle.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Error, Options, PmekvOptions, WriteBatch};

fn fresh() -> (Db, SimDevice, FaultFs) {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let db = Db::open(dir(), sim_options(tierkv::Preset::Pmekv, &dev, &fs)).unwrap();
    (db, dev, fs)
}

fn invalid(r: tierkv::Result<impl std::fmt::Debug>) {
    match r {
        Err(Error::InvalidArgument(msg)) => assert!(!msg.is_empty()),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn over_limit_keys_and_values_write_nothing() {
    for &preset in presets() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
        let big_key = vec![b'k'; 65_536];
        let ok_key = vec![b'k'; 65_535];
        let big_val = vec![0u8; (16 << 10) + 1];
        invalid(db.put(&big_key, b"v"));
        invalid(db.get(&big_key));
        invalid(db.delete(&big_key));
        invalid(db.put(b"k", &big_val));
        invalid(db.insert_if_absent(b"k", &big_val));
        invalid(db.update_if_present(&big_key, b"v"));
        let mut b = WriteBatch::new();
        b.put(b"fine", b"v").put(b"k", &big_val);
        invalid(db.write(b));
        assert_eq!(dump(&db).len(), 0, "{preset}: nothing may be written");
        // The largest legal key works.
        db.put(&ok_key, b"v").unwrap();
        assert_eq!(db.get(&ok_key).unwrap(), Some(b"v".to_vec()));
        // Reopen: still only the legal key.
        db.simulate_process_crash();
        let db = Db::open(dir(), sim_options(preset, &dev.simulate_crash(3, 1.0), &fs.crash())).unwrap();
        assert_eq!(dump(&db).into_keys().collect::<Vec<_>>(), vec![ok_key]);
    }
}

#[test]
fn default_value_limit_is_64_mib() {
    let t = tempdir();
    let opts = Options::new().pmekv(PmekvOptions { writeback_interval_ms: 0, ..Default::default() });
    let db = Db::open(t.path(), opts).unwrap();
    invalid(db.put(b"k", vec![0u8; (64 << 20) + 1]));
    assert_eq!(db.get(b"k").unwrap(), None);
    let v = vec![7u8; 64 << 20];
    db.put(b"k", &v).unwrap();
    assert_eq!(db.get(b"k").unwrap().map(|x| x.len()), Some(64 << 20));
}

#[test]
fn batch_larger_than_the_log_is_refused() {
    let (db, _dev, _fs) = fresh();
    let mut b = WriteBatch::new();
    for i in 0..5000u32 {
        b.put(format!("key-{i:08}"), b"v");
    }
    invalid(db.write(b));
    assert!(dump(&db).is_empty());
}

#[test]
fn bad_options_are_refused() {
    let t = tempdir();
    invalid(Db::open(t.path(), Options::new().pm_pool_size(1000)));
    invalid(Db::open(t.path(), Options::new().max_key_size(70_000)));
    invalid(Db::open(t.path(), Options::new().max_value_size((64 << 20) + 1)));
    let pmekv = || Options::new().preset(tierkv::Preset::Pmekv);
    invalid(Db::open(t.path(), pmekv().pmekv(PmekvOptions { node_capacity: 2, ..Default::default() })));
    invalid(Db::open(t.path(), pmekv().pmekv(PmekvOptions { key_log_size: 100, ..Default::default() })));
    // Logs that do not fit the pool.
    invalid(Db::open(
        t.path().join("small"),
        pmekv().pm_pool_size(1 << 20).pmekv(PmekvOptions { key_log_size: 1 << 20, ..Default::default() }),
    ));
    // The default preset's own.
    invalid(Db::open(
        t.path(),
        Options::new().native(tierkv::NativeOptions { pm_watermark: 0.99, ..Default::default() }),
    ));
    invalid(Db::open(
        t.path(),
        Options::new().native(tierkv::NativeOptions { segment_size: 5000, ..Default::default() }),
    ));
    assert!("nope".parse::<tierkv::Preset>().is_err());
}

#[test]
fn missing_unusable_and_locked_directories() {
    let t = tempdir();
    invalid(Db::open(t.path().join("absent"), Options::new().create_if_missing(false)));
    assert!(!t.path().join("absent").exists(), "nothing may be created");
    // A regular file where the directory should be.
    let file = t.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    assert!(matches!(Db::open(&file, Options::new()), Err(Error::Io(_))));
    // A directory that cannot be created.
    assert!(matches!(Db::open("/proc/tierkv-cannot-exist/db", Options::new()), Err(Error::Io(_))));
    // Already open.
    let d = t.path().join("db");
    let opts = || {
        let logs = PmekvOptions { kv_log_size: 256 << 10, key_log_size: 256 << 10, ..Default::default() };
        Options::new().pm_pool_size(4 << 20).pmekv(logs)
    };
    let db = Db::open(&d, opts()).unwrap();
    assert!(matches!(Db::open(&d, opts()), Err(Error::Locked(_))));
    db.close().unwrap();
    drop(db);
    let db = Db::open(&d, opts()).unwrap();
    // error_if_exists.
    drop(db);
    invalid(Db::open(&d, opts().error_if_exists(true)));
}

#[test]
fn unknown_preset_in_options_record_is_corruption() {
    let (db, dev, fs) = fresh();
    db.close().unwrap();
    drop(db);
    let path = dir().join("OPTIONS");
    // Rewrite the record with preset id 99 and a valid checksum.
    let mut rec = tierkv::fs::Fs::read_all(&fs, &path).unwrap();
    rec[12..16].copy_from_slice(&99u32.to_le_bytes());
    let c = tierkv::format::crc::masked(&rec[0..28]);
    rec[28..32].copy_from_slice(&c.to_le_bytes());
    fs.poke(&path, 0, &rec).unwrap();
    let e = Db::open(dir(), sim_options(tierkv::Preset::Pmekv, &dev, &fs)).expect_err("unknown preset id");
    assert!(matches!(&e, Error::Corruption { detail, .. } if detail.contains("unknown preset id 99")), "{e}");
}

#[test]
fn closed_handle_refuses_calls() {
    let (db, _dev, _fs) = fresh();
    db.put(b"a", b"1").unwrap();
    db.close().unwrap();
    assert!(matches!(db.put(b"a", b"2"), Err(Error::Closed)));
    assert!(matches!(db.get(b"a"), Err(Error::Closed)));
    assert!(matches!(db.scan::<std::ops::RangeFull>(..), Err(Error::Closed)));
    db.close().unwrap();
}

#[test]
fn injected_fs_faults_surface_as_errors_at_open() {
    // pmekv touches files only at open (OPTIONS); every fault there must be an error, never
    // a panic, and a later clean open must work.
    for n in 1..12 {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        fs.fail_after(n, tierkv::fs::FaultKind::Eio, false);
        match Db::open(dir(), sim_options(tierkv::Preset::Pmekv, &dev, &fs)) {
            Ok(db) => {
                db.put(b"k", b"v").unwrap();
                assert_eq!(db.get(b"k").unwrap(), Some(b"v".to_vec()));
            }
            Err(e) => {
                assert!(matches!(e, Error::Io(_)), "fault at op {n}: {e}");
                fs.clear_faults();
                let db = Db::open(dir(), sim_options(tierkv::Preset::Pmekv, &dev, &fs)).unwrap();
                db.put(b"k", b"v").unwrap();
            }
        }
    }
}

#[test]
fn a_store_of_a_newer_format_version_is_refused_by_name() {
    for &preset in presets() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
        db.put(b"k", b"v").unwrap();
        db.close().unwrap();
        drop(db);
        // A well-formed OPTIONS record (valid checksum) written by a newer tierkv.
        let path = dir().join("OPTIONS");
        let mut rec = tierkv::fs::Fs::read_all(&fs, &path).unwrap();
        rec[8..12].copy_from_slice(&2u32.to_le_bytes());
        let c = tierkv::format::crc::masked(&rec[0..28]);
        rec[28..32].copy_from_slice(&c.to_le_bytes());
        tierkv::fs::Fs::write_atomic(&fs, &path, &rec).unwrap();
        let e = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap_err();
        assert!(e.to_string().contains("unsupported OPTIONS version 2"), "{preset}: {e}");
    }
}
