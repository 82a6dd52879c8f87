//! HoaKV scenarios through the `Db` API: a crash at every persist point (PM fence) and at
//! every file or directory sync of a promotion with its demotion (on a write and on a read),
//! of a value-group split and of a value-group garbage collection, each found on a dry run
//! by the design counters that operation moves. The reopened store must hold the state
//! before or after the operation (nothing else), pass `check`, and keep working.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, HoakvOptions, Preset};

#[derive(Debug, Clone)]
enum Op {
    Put(Vec<u8>, Vec<u8>),
    Get(Vec<u8>),
}

fn apply(db: &Db, m: &mut Model, op: &Op) -> tierkv::Result<()> {
    match op {
        Op::Put(k, v) => {
            db.put(k, v)?;
            m.insert(k.clone(), v.clone());
        }
        Op::Get(k) => {
            assert_eq!(db.get(k)?.as_ref(), m.get(k), "get {}", tierkv::escape(k));
        }
    }
    Ok(())
}

fn opts(dev: &SimDevice, fs: &FaultFs, o: &HoakvOptions) -> tierkv::Options {
    sim_options(Preset::Hoakv, dev, fs).hoakv(o.clone())
}

fn design(db: &Db, what: &str) -> u64 {
    db.stats().design.get(what).copied().unwrap_or(0)
}

/// Open a fresh store on a linked device and file system and apply `ops`.
fn build(o: &HoakvOptions, ops: &[Op]) -> (SimDevice, FaultFs, Db, Model) {
    let (dev, fs) = linked();
    let db = Db::open(dir(), opts(&dev, &fs, o)).unwrap();
    let mut m = Model::new();
    for op in ops {
        apply(&db, &mut m, op).unwrap();
    }
    (dev, fs, db, m)
}

/// The first operation of `ops` that moves every counter of `moves` (dry run), with the
/// fences and file syncs it takes.
fn find_target(o: &HoakvOptions, ops: &[Op], moves: &[&str]) -> (usize, u64, u64) {
    let (dev, fs, db, _) = build(o, &[]);
    let mut m = Model::new();
    for (i, op) in ops.iter().enumerate() {
        let before: Vec<u64> = moves.iter().map(|w| design(&db, w)).collect();
        let (f0, s0) = (dev.fences(), fs.sync_points());
        apply(&db, &mut m, op).unwrap();
        let (f, s) = (dev.fences() - f0, fs.sync_points() - s0);
        if moves.iter().zip(&before).all(|(w, b)| design(&db, w) > *b) {
            db.simulate_process_crash();
            unlink(&dev, &fs);
            return (i, f, s);
        }
    }
    panic!("no operation moved {moves:?}");
}

/// Crash at every fence and every file sync of `ops[target]`, after `ops[..target]`.
/// Returns the crash points verified and the file syncs the operation takes.
fn crash_every_point(name: &str, o: &HoakvOptions, ops: &[Op], moves: &[&str]) -> (u64, u64) {
    let (target, fences, syncs) = find_target(o, ops, moves);
    assert!(fences + syncs > 0, "{name}: the operation persists nothing");
    let mut points = 0;
    for (files, total) in [(false, fences), (true, syncs)] {
        for n in 1..=total {
            for frac in [0.0, 1.0] {
                let (dev, fs, db, before) = build(o, &ops[..target]);
                if files {
                    fs.crash_before_sync(n);
                } else {
                    dev.crash_before_fence(dev.fences() + n);
                }
                let mut after = before.clone();
                let _ = apply(&db, &mut after, &ops[target]);
                assert!(dev.crashed() || fs.frozen(), "{name}: crash point {n} (files {files}) not reached");
                db.simulate_process_crash();
                unlink(&dev, &fs);
                let ctx = format!(
                    "{name}: crash before {} {n} of {:?}, evict {frac}",
                    if files { "sync" } else { "fence" },
                    ops[target]
                );
                let dev = dev.simulate_crash(n, frac);
                let fs = fs.crash();
                let db = Db::open(dir(), opts(&dev, &fs, o)).unwrap_or_else(|e| panic!("{ctx}: reopen: {e}"));
                let got = dump(&db);
                let mut m = if got == after { after } else { before };
                assert_matches(&db, &m, &ctx);
                // The store keeps working: the operation again, more writes, another crash.
                let mut m2 = m.clone();
                if let Op::Put(k, v) = &ops[target] {
                    db.put(k, v).unwrap();
                    m2.insert(k.clone(), v.clone());
                }
                db.put(b"after", b"crash").unwrap();
                m2.insert(b"after".to_vec(), b"crash".to_vec());
                m = m2;
                db.simulate_process_crash();
                let db = Db::open(dir(), opts(&dev.simulate_crash(n + 1, 0.5), &fs.crash(), o)).unwrap();
                assert_matches(&db, &m, &format!("{ctx}: second crash"));
                points += 1;
            }
        }
    }
    eprintln!("{name}: {fences} fences and {syncs} file syncs, {points} crash points verified");
    (points, syncs)
}

fn k(i: u32) -> Vec<u8> {
    format!("k{i:03}").into_bytes()
}

fn v(i: u32, round: u32, len: usize) -> Vec<u8> {
    let mut b = format!("v{i}.{round}:").into_bytes();
    b.resize(len, b'a' + (i % 26) as u8);
    b
}

/// A full 32 KiB HotStore of keys read twice (clean: the ColdStore holds their values),
/// half of them then written (dirty), then `extra` accessed until it is promoted; the
/// demotion batch (1/32 of the store) takes several victims.
fn promotion_ops(vlen: usize, read: bool) -> (HoakvOptions, Vec<Op>) {
    let o = HoakvOptions { hot_store_size: 32 << 10, heat_window: 1 << 30, ..tierkv::testing::hoakv_small() };
    let mut ops: Vec<Op> = (0..160).map(|i| Op::Put(k(i), v(i, 0, vlen))).collect();
    // The first read promotes (clean); then every other key is written instead of read
    // again (dirty), so the coldest keys — one heat for all — are of both kinds.
    ops.extend((0..128).map(|i| Op::Get(k(i))));
    ops.extend((0..128).map(|i| if i % 2 == 0 { Op::Put(k(i), v(i, 1, vlen)) } else { Op::Get(k(i)) }));
    let extra = 150;
    for round in 2..12 {
        ops.push(if read { Op::Get(k(extra)) } else { Op::Put(k(extra), v(extra, round, vlen)) });
    }
    (o, ops)
}

#[test]
fn crash_at_every_persist_point_of_a_promotion_with_demotion() {
    let mut points = 0;
    // Inline cold values and values over Value_Size (the demotion appends them to the cold
    // vlog, synced before the WAL); promotion by a write (the new value goes to the
    // HotStore only) and by a read (the current value is copied there).
    for (vlen, read) in [(40, false), (40, true), (100, false), (100, true)] {
        let (o, ops) = promotion_ops(vlen, read);
        let name = format!("promotion by {} of {vlen}-byte values", if read { "read" } else { "write" });
        // The batch demotes dirty victims (written to the ColdStore, synced) and clean
        // ones (nothing written back).
        let (n, syncs) = crash_every_point(&name, &o, &ops, &["promotions", "clean_demotions"]);
        assert!(syncs > 0, "{name}: no dirty victim was written back");
        points += n;
    }
    assert!(points >= 40, "{points} crash points");
}

#[test]
fn crash_at_every_persist_point_of_a_group_split_and_a_group_gc() {
    // No promotions: every value stays in the ColdStore; values over Value_Size (64) go to
    // the cold vlog; 16 KiB groups. The first maintenance splits (live > GroupSize / 2);
    // rewriting the keys of one half then makes garbage that a collection reclaims.
    let o = HoakvOptions { promote_min_heat: u16::MAX, ..tierkv::testing::hoakv_small() };
    let mut ops: Vec<Op> = (0..40).map(|i| Op::Put(k(i), v(i, 0, 700))).collect();
    let (split, _) = crash_every_point("group split", &o, &ops, &["group_splits"]);
    for round in 1..6 {
        ops.extend((0..20).map(|i| Op::Put(k(i), v(i, round, 700))));
    }
    let (gc, _) = crash_every_point("group gc", &o, &ops, &["group_gcs"]);
    assert!(split >= 10 && gc >= 10, "split {split}, gc {gc} crash points");
}

/// Regression (found in review): the background compaction worker and callers of
/// `compact()` picked jobs from the same version without holding the job lock; the second
/// re-ran a stale job, re-adding a table the first had moved or rewriting removed tables, so
/// one level held overlapping tables and reads returned old pointers into value-log files
/// GC had removed. Writers, readers that promote and demote keys, and threads calling
/// `compact()` run beside the background worker; afterwards every key reads back its last
/// value and `check` finds nothing.
#[test]
fn concurrent_compactions_never_run_a_stale_job() {
    use std::sync::Arc;
    for seed in 0..4u64 {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = HoakvOptions { background: true, sync_wal: false, ..tierkv::testing::hoakv_small() };
        let db = Arc::new(Db::open("/db", opts(&dev, &fs, &o)).unwrap());
        let threads: Vec<_> = (0..3u64)
            .map(|t| {
                let db = db.clone();
                std::thread::spawn(move || {
                    // Thread t owns the keys i with i % 3 == t; returns their last values.
                    let mut last = std::collections::BTreeMap::new();
                    let mut x = seed * 31 + t + 1;
                    for n in 0..3000u32 {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        let i = ((x >> 33) as u32 % 100) * 3 + t as u32;
                        if n % 4 == 3 {
                            let _ = db.get(k(i)).unwrap();
                        } else {
                            let val = v(i, n, 40 + (x >> 40) as usize % 300);
                            db.put(k(i), &val).unwrap();
                            last.insert(i, val);
                        }
                        if n % 200 == 199 {
                            db.compact().unwrap();
                        }
                    }
                    last
                })
            })
            .collect();
        let mut want = std::collections::BTreeMap::new();
        for t in threads {
            want.extend(t.join().unwrap());
        }
        for (i, val) in &want {
            assert_eq!(db.get(k(*i)).unwrap().as_ref(), Some(val), "seed {seed}: key {i}");
        }
        assert_eq!(db.check().unwrap(), Vec::<String>::new(), "seed {seed}");
        assert!(design(&db, "compactions") > 0, "seed {seed}: compactions ran");
    }
}
