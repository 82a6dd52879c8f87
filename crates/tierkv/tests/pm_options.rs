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

fn opts() -> Options {
    Options::new().pm_pool_size(1 << 20).pm_sync(true).pm_write_latency_ns(200).pm_write_bandwidth_mbps(2000).pmekv(
        PmekvOptions { kv_log_size: 256 << 10, key_log_size: 256 << 10, writeback_interval_ms: 0, node_capacity: 16 },
    )
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
