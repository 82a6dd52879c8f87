//! The PM options run end to end on real pool files: `pm_sync` (msync at commit points),
//! the latency and bandwidth emulation knobs, region growth past one pool, and the traffic
//! counters. (No wall-clock assertions: these machines are shared.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::{Db, Options, PmekvOptions};

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Db>();
};

/// `pmekv` (whose PM traffic the counts below describe; `native`'s capacity tier has its
/// own test in `tests/native.rs`).
fn opts() -> Options {
    Options::new()
        .preset(tierkv::Preset::Pmekv)
        .pm_pool_size(1 << 20)
        .pm_sync(true)
        .pm_write_latency_ns(200)
        .pm_write_bandwidth_mbps(2000)
        .pmekv(PmekvOptions {
            kv_log_size: 256 << 10,
            key_log_size: 256 << 10,
            writeback_interval_ms: 0,
            node_capacity: 16,
        })
}

#[test]
fn pm_sync_emulation_and_growth() {
    let t = tempdir();
    let db = Db::open(t.path(), opts()).unwrap();
    let mut m = Model::new();
    // ~1.5 MiB of values: more than one 1 MiB pool, so the region must grow.
    for i in 0..1500u32 {
        let k = format!("key{i:05}").into_bytes();
        let v = vec![(i % 251) as u8; 1000];
        db.put(&k, &v).unwrap();
        m.insert(k, v);
    }
    let s = db.stats();
    assert!(s.pm.pools >= 2, "region grew: {} pools", s.pm.pools);
    assert!(s.pm.persist_calls >= 3000, "two fences per put: {}", s.pm.persist_calls);
    assert!(s.pm.lines_persisted >= 1500 * 16, "every value line persisted: {}", s.pm.lines_persisted);
    assert!(s.pm.bytes_stored >= s.user_bytes_written);
    assert!(s.write_amp_pm > 1.0, "write amplification counts log and value lines: {}", s.write_amp_pm);
    assert_eq!(s.keys, 1500);
    assert!(s.dram_index_bytes > 1500 * 8);
    assert_matches(&db, &m, "before reopen");
    db.close().unwrap();
    drop(db);
    assert!(t.path().join("pm/pool-000001").exists());
    let db = Db::open(t.path(), opts()).unwrap();
    assert_matches(&db, &m, "after reopen");
}

#[test]
fn pm_path_elsewhere() {
    let t = tempdir();
    let pm = t.path().join("elsewhere");
    let o = || opts().pm_path(&pm);
    let db = Db::open(t.path().join("db"), o()).unwrap();
    db.put(b"k", b"v").unwrap();
    db.close().unwrap();
    drop(db);
    assert!(pm.join("pool-000000").exists());
    assert!(!t.path().join("db/pm").exists());
    let db = Db::open(t.path().join("db"), o()).unwrap();
    assert_eq!(db.get(b"k").unwrap(), Some(b"v".to_vec()));
}

/// Small pools and a PM capacity of `pools` of them.
fn capped(pools: u64) -> Options {
    opts().pm_sync(false).pm_write_latency_ns(0).pm_write_bandwidth_mbps(0).pm_capacity(pools << 20)
}

#[test]
fn optane_profile_delays_every_pm_read_and_dram_none() {
    let t = tempdir();
    let o = opts().pm_profile(tierkv::pm::PmProfile::Optane);
    assert_eq!((o.pm_read_latency_ns, o.pm_write_latency_ns, o.pm_write_bandwidth_mbps), (224, 0, 2300));
    let db = Db::open(t.path().join("optane"), o).unwrap();
    for i in 0..100u32 {
        db.put(format!("k{i:03}").as_bytes(), [7u8; 100]).unwrap();
    }
    let before = db.stats().pm.delayed_reads;
    for i in 0..100u32 {
        assert_eq!(db.get(format!("k{i:03}").as_bytes()).unwrap(), Some(vec![7u8; 100]));
    }
    let read = db.stats().pm.delayed_reads - before;
    assert!(read >= 100, "every get reads its value from PM through the delaying accessor: {read}");

    let db = Db::open(t.path().join("dram"), opts().pm_profile(tierkv::pm::PmProfile::Dram)).unwrap();
    db.put(b"k", b"v").unwrap();
    assert_eq!(db.get(b"k").unwrap(), Some(b"v".to_vec()));
    assert_eq!(db.stats().pm.delayed_reads, 0);
}

#[test]
fn pm_capacity_is_a_clear_error_and_the_store_stays_usable() {
    let t = tempdir();
    let db = Db::open(t.path(), capped(2)).unwrap();
    let mut m = Model::new();
    let mut full = None;
    for i in 0..4000u32 {
        let k = format!("key{i:05}").into_bytes();
        let v = vec![(i % 251) as u8; 1000];
        match db.put(&k, &v) {
            Ok(()) => {
                m.insert(k, v);
            }
            Err(e) => {
                full = Some((k, e));
                break;
            }
        }
    }
    let (k, e) = full.expect("4 MB of values cannot fit in 2 MiB of PM");
    assert!(matches!(e, tierkv::Error::PmFull(_)), "{e:?}");
    assert_eq!(db.get(&k).unwrap(), None, "the refused write wrote nothing");
    assert_eq!(db.stats().pm.pools, 2);
    assert_matches(&db, &m, "after PmFull");
    drop(db);
    // A larger capacity lets the same store grow again.
    let db = Db::open(t.path(), capped(3)).unwrap();
    assert_matches(&db, &m, "reopened");
    db.put(&k, b"fits now").unwrap();
    assert_eq!(db.stats().pm.pools, 3);
}

#[test]
fn pm_preallocate_reserves_the_capacity_and_growth_takes_the_spares() {
    use std::os::unix::fs::MetadataExt;
    let t = tempdir();
    let pm = t.path().join("pm");
    let o = || capped(4).pm_preallocate(true);
    let db = Db::open(t.path(), o()).unwrap();
    assert_eq!(db.stats().pm.pools, 1, "spares are not pools until taken");
    let mut inodes = Vec::new();
    for i in 1..4 {
        let spare = pm.join(format!("pool-{i:06}.tmp"));
        let md = std::fs::metadata(&spare).unwrap();
        assert_eq!(md.len(), 1 << 20, "{}", spare.display());
        assert!(md.blocks() * 512 >= 1 << 20, "{}: all blocks allocated ({} blocks)", spare.display(), md.blocks());
        inodes.push(md.ino());
    }
    assert!(!pm.join("pool-000004.tmp").exists(), "nothing past the capacity");
    let mut m = Model::new();
    for i in 0..1500u32 {
        let k = format!("key{i:05}").into_bytes();
        let v = vec![(i % 251) as u8; 1000];
        db.put(&k, &v).unwrap();
        m.insert(k, v);
    }
    assert!(db.stats().pm.pools >= 2, "the values need a second pool");
    db.close().unwrap();
    drop(db);
    // Growth (the writes, and the write-back at close) took spares: same files, renamed.
    let pools = (0..5).take_while(|i| pm.join(format!("pool-{i:06}")).exists()).count() as u64;
    assert!((2..=4).contains(&pools), "{pools} pools");
    for i in 1..pools as usize {
        let md = std::fs::metadata(pm.join(format!("pool-{i:06}"))).unwrap();
        assert_eq!(md.ino(), inodes[i - 1], "pool {i} is the spare made at open, not a new file");
        assert!(!pm.join(format!("pool-{i:06}.tmp")).exists());
    }
    // Spares left over are no pools: a reopen without preallocation sees the same store.
    let db = Db::open(t.path(), capped(4)).unwrap();
    assert_eq!(db.stats().pm.pools, pools);
    assert_matches(&db, &m, "reopened with spares present");
    drop(db);
    assert!(matches!(Db::open(t.path(), opts().pm_preallocate(true)), Err(tierkv::Error::InvalidArgument(_))));
}
