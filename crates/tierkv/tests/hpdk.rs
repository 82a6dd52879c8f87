//! HPDK's own mechanisms: the live-item-rate merge picks exactly the tables under the
//! threshold and leaves the tree pointing only at live items; fully dead tables are freed
//! without a rewrite (and deleted keys stay deleted after a crash); value pools are reused
//! once all their items die; value-log damage is a typed error; a crash at every persist
//! point of a merge recovers; the NT / NGC ablations answer like the full design.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, HpdkOptions, Preset};

fn opts(dev: &SimDevice, fs: &FaultFs, o: HpdkOptions) -> tierkv::Options {
    sim_options(Preset::Hpdk, dev, fs).hpdk(o)
}

/// No automatic merge: the tests decide when it runs.
fn manual() -> HpdkOptions {
    HpdkOptions { merge_trigger: 1000, memtable_size: 1 << 20, ..hpdk_small() }
}

fn d(db: &Db, k: &str) -> u64 {
    db.stats().design.get(k).copied().unwrap_or_else(|| panic!("no design stat {k}"))
}

fn key(i: u32) -> Vec<u8> {
    format!("key{i:05}").into_bytes()
}

fn val(i: u32, round: u32) -> Vec<u8> {
    format!("value-{i}-{round}-{}", "x".repeat(40)).into_bytes()
}

fn put_range(db: &Db, m: &mut Model, r: std::ops::Range<u32>, round: u32) {
    for i in r {
        db.put(key(i), val(i, round)).unwrap();
        m.insert(key(i), val(i, round));
    }
    db.flush().unwrap();
}

/// Four tables: #1 (100 items, 40 live after #2 overwrites 60: rate 0.4 → candidate), #2
/// (60 live), #3 (100 items, 60 live after #4: rate 0.6 → not a candidate), #4 (40 live).
fn four_tables(db: &Db) -> Model {
    let mut m = Model::new();
    put_range(db, &mut m, 0..100, 0);
    put_range(db, &mut m, 0..60, 1);
    put_range(db, &mut m, 200..300, 0);
    put_range(db, &mut m, 200..240, 1);
    m
}

#[test]
fn merge_picks_exactly_the_tables_below_the_live_rate_and_keeps_only_live_items() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
    let m = four_tables(&db);
    assert_eq!(d(&db, "sstables"), 4);
    assert_eq!(d(&db, "total_items_in_sstables"), 300);
    assert_eq!(d(&db, "live_items_in_sstables"), 200);
    assert_eq!(d(&db, "merge_candidates"), 1, "only table #1 is under 0.5");
    db.compact().unwrap();
    assert_eq!(d(&db, "merges"), 1);
    assert_eq!(d(&db, "merge_input_tables"), 1, "table #3 (rate 0.6) was not merged");
    assert_eq!(d(&db, "merge_items_kept"), 40, "the 40 items #2 did not overwrite");
    assert_eq!(d(&db, "merge_items_dropped"), 60);
    assert_eq!(d(&db, "sstables"), 4, "#1 replaced by the merge output");
    assert_eq!(d(&db, "total_items_in_sstables"), 240);
    assert_eq!(d(&db, "live_items_in_sstables"), 200);
    assert_eq!(d(&db, "merge_candidates"), 0);
    // `check` compares every table's live count with the tree entries pointing at it and
    // reads every value the tree points at.
    assert_eq!(db.check().unwrap(), Vec::<String>::new());
    assert_matches(&db, &m, "after the merge");
    db.simulate_process_crash();
    let db = Db::open(dir(), opts(&dev.simulate_crash(1, 0.0), &fs.crash(), manual())).unwrap();
    assert_matches(&db, &m, "after a crash following the merge");
    assert_eq!(db.check().unwrap(), Vec::<String>::new());
}

#[test]
fn fully_dead_tables_are_freed_and_deleted_keys_stay_deleted() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
    let mut m = Model::new();
    put_range(&db, &mut m, 0..50, 0);
    put_range(&db, &mut m, 100..110, 0);
    for i in 0..50 {
        db.delete(key(i)).unwrap();
        m.remove(&key(i));
    }
    db.flush().unwrap();
    // #1: 50 items, none live; #3: 50 tombstones (never live).
    assert_eq!(d(&db, "merge_candidates"), 2);
    db.compact().unwrap();
    assert_eq!(d(&db, "merge_dead_tables_freed"), 2);
    assert_eq!(d(&db, "merge_items_kept"), 0);
    assert_eq!(d(&db, "sstables"), 1);
    assert_matches(&db, &m, "after freeing dead tables");
    // The tombstones are gone with their table: recovery must not bring the keys back.
    db.simulate_process_crash();
    let db = Db::open(dir(), opts(&dev.simulate_crash(2, 0.5), &fs.crash(), manual())).unwrap();
    assert_matches(&db, &m, "after a crash");
    db.close().unwrap();
    drop(db);
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
    assert_matches(&db, &m, "after a clean reopen");
}

#[test]
fn value_pools_are_reused_once_all_their_items_die() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let o = HpdkOptions { memtable_size: 16 << 10, vlog_pool_size: 64 << 10, ..manual() };
    let db = Db::open(dir(), opts(&dev, &fs, o.clone())).unwrap();
    let mut m = Model::new();
    // 20 keys x 1 KiB, overwritten 30 times: ~600 KiB of values through 64 KiB pools.
    for round in 0..30u32 {
        for i in 0..20u32 {
            let v = vec![b'a' + (round % 26) as u8; 1000 + i as usize];
            db.put(key(i), &v).unwrap();
            m.insert(key(i), v);
        }
        db.flush().unwrap();
    }
    let pools = d(&db, "value_pools");
    let reused = d(&db, "value_pools_reused");
    assert!(reused > 0, "no pool was reused");
    assert!(pools <= 3, "{pools} pools for 20 live values of 1 KiB: dead pools were not reused");
    assert_matches(&db, &m, "after pool reuse");
    assert_eq!(db.check().unwrap(), Vec::<String>::new());
    db.simulate_process_crash();
    let db = Db::open(dir(), opts(&dev.simulate_crash(3, 0.3), &fs.crash(), o)).unwrap();
    assert_matches(&db, &m, "after a crash");
}

#[test]
fn value_log_damage_is_a_typed_error() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
    db.put(b"a", b"FIND-ME-IN-THE-VALUE-LOG").unwrap();
    db.put(b"b", b"another value").unwrap();
    db.close().unwrap();
    drop(db);
    let mut hit = None;
    for p in 0..dev.pool_count() {
        let img = dev.durable_image(p).unwrap();
        if let Some(off) = img.windows(24).position(|w| w == b"FIND-ME-IN-THE-VALUE-LOG") {
            hit = Some((p, off));
        }
    }
    let (pool, off) = hit.expect("value not found in PM");
    let copy = dev.simulate_crash(0, 0.0);
    assert!(copy.poke(pool, off + 3, b"#"));
    let db = Db::open(dir(), opts(&copy, &fs, manual())).unwrap();
    let e = db.get(b"a").unwrap_err();
    assert!(e.is_corruption(), "{e}");
    assert!(e.to_string().contains("checksum"), "{e}");
    assert_eq!(db.get(b"b").unwrap().as_deref(), Some(&b"another value"[..]));
    let problems = db.check().unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    drop(db);
    // A damaged size field points the record past the pool: also corruption, no panic.
    let copy = dev.simulate_crash(0, 0.0);
    assert!(copy.poke(pool, off - 4, &[0xff, 0xff, 0xff, 0x7f]));
    let db = Db::open(dir(), opts(&copy, &fs, manual())).unwrap();
    assert!(db.get(b"a").unwrap_err().is_corruption());
}

#[test]
fn crash_at_every_persist_point_of_a_merge() {
    // Fences the merge takes, counted on a dry run.
    // Two states: the four tables, and one where the merge frees a table of tombstones
    // whose keys an older, unmerged table still holds (a recovery that replayed that table
    // without the matching recovery file would bring them back).
    for tombstones in [false, true] {
        merge_crash_points(tombstones);
    }
}

fn merge_crash_points(tombstones: bool) {
    let build = || {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let f = fs.clone();
        dev.on_freeze(move || f.freeze());
        let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
        let m = if tombstones {
            let mut m = Model::new();
            put_range(&db, &mut m, 0..100, 0);
            for i in 0..30 {
                db.delete(key(i)).unwrap();
                m.remove(&key(i));
            }
            db.flush().unwrap();
            assert_eq!(d(&db, "merge_candidates"), 1, "only the table of tombstones");
            m
        } else {
            four_tables(&db)
        };
        (dev, fs, db, m)
    };
    let (dev, _fs, db, _) = build();
    let before = dev.fences();
    db.compact().unwrap();
    let total = dev.fences() - before;
    assert!(total >= 1, "a merge persists its output and frees its inputs");
    for n in 1..=total {
        for frac in [0.0, 1.0] {
            let (dev, fs, db, m) = build();
            dev.crash_before_fence(dev.fences() + n);
            let _ = db.compact();
            assert!(dev.crashed(), "fence {n} not reached");
            db.simulate_process_crash();
            let dev = dev.simulate_crash(n, frac);
            let fs = fs.crash();
            let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap_or_else(|e| panic!("fence {n}: {e}"));
            assert_matches(&db, &m, &format!("crash at merge fence {n} evict {frac}"));
            assert_eq!(db.check().unwrap(), Vec::<String>::new(), "fence {n}");
            // The merge happened, or was restarted at open, or its inputs are still there
            // as candidates; either way another compact leaves no candidate.
            db.compact().unwrap();
            assert_eq!(d(&db, "merge_candidates"), 0, "fence {n}");
            assert_matches(&db, &m, &format!("fence {n}: after compacting again"));
        }
    }
    eprintln!("{total} merge fences crashed at, twice each");
    // The merge's file-system steps (merge log, recovery file, MANIFEST commit, removals):
    // every operation from the n-th on fails, as if the machine stopped there; what was
    // synced survives.
    let mut n = 1;
    loop {
        let (dev, fs, db, m) = build();
        fs.fail_after(n, tierkv::fs::FaultKind::Eio, true);
        let r = db.compact();
        db.simulate_process_crash();
        if r.is_ok() {
            break;
        }
        fs.clear_faults();
        let dev = dev.simulate_crash(n, 0.5);
        let fs = fs.crash();
        let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap_or_else(|e| panic!("fs op {n}: {e}"));
        assert_matches(&db, &m, &format!("merge cut at file operation {n}"));
        assert_eq!(db.check().unwrap(), Vec::<String>::new(), "fs op {n}");
        db.compact().unwrap();
        assert_eq!(d(&db, "merge_candidates"), 0, "fs op {n}");
        assert_matches(&db, &m, &format!("fs op {n}: after compacting again"));
        n += 1;
    }
    assert!(n > 4, "the merge's file operations were cut at only {} points", n - 1);
    eprintln!("{} merge file operations cut at", n - 1);
}

#[test]
fn restart_after_clean_close_replays_nothing_and_after_a_crash_replays_newer_tables() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
    let m = four_tables(&db);
    db.close().unwrap();
    drop(db);
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
    assert_eq!(d(&db, "flushes"), 0, "a clean restart replays no WAL");
    assert_matches(&db, &m, "clean restart");
    let mut m2 = m.clone();
    db.put(b"zz-unflushed", b"only in the WAL").unwrap();
    m2.insert(b"zz-unflushed".to_vec(), b"only in the WAL".to_vec());
    db.simulate_process_crash();
    let db = Db::open(dir(), opts(&dev.simulate_crash(4, 0.0), &fs.crash(), manual())).unwrap();
    assert_eq!(d(&db, "flushes"), 1, "the WAL was replayed and flushed at open");
    assert_matches(&db, &m2, "after crash");
}

#[test]
fn ablations_answer_like_the_full_design() {
    for (name, o) in [
        ("nt", HpdkOptions { use_btree: false, ..hpdk_small() }),
        ("ngc", HpdkOptions { enable_merge: false, ..hpdk_small() }),
    ] {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = Db::open(dir(), opts(&dev, &fs, o.clone())).unwrap();
        let mut m = Model::new();
        for s in workload(7, 600, 60, false) {
            let want = model_apply(&mut m, &s);
            if s.writes() {
                assert_eq!(db_apply(&db, &s).unwrap(), want, "{name}: {s:?}");
            } else if matches!(s, Step::Flush) {
                db.flush().unwrap();
            }
        }
        db.flush().unwrap();
        assert_matches(&db, &m, name);
        assert!(d(&db, "sstables") > 1, "{name}: the level has several tables");
        assert_eq!(d(&db, "merges"), 0, "{name}: no merge runs");
        if name == "nt" {
            assert_eq!(d(&db, "tree_keys"), 0, "HPDK-NT keeps no tree");
            assert!(d(&db, "nt_tables_probed") > 0);
        }
        db.close().unwrap();
        drop(db);
        // Switching the ablation off again rebuilds the tree from the tables.
        let db = Db::open(dir(), opts(&dev, &fs, hpdk_small())).unwrap();
        assert_matches(&db, &m, &format!("{name} reopened as full hpdk"));
    }
}

#[test]
fn a_pool_referenced_only_by_the_memtable_is_not_reused() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
    let mut m = Model::new();
    // 200 KiB of distinct values through 64 KiB pools, nothing flushed: every pool holds
    // live values known only to the MemTable.
    for i in 0..200u32 {
        let v = vec![b'a' + (i % 26) as u8; 1024];
        db.put(key(i), &v).unwrap();
        m.insert(key(i), v);
    }
    assert_eq!(d(&db, "flushes"), 0);
    assert_eq!(d(&db, "value_pools_reused"), 0);
    assert!(d(&db, "value_pools") >= 4);
    assert_matches(&db, &m, "unflushed values across pools");
}

#[test]
fn background_merges_race_with_flushes_and_readers() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let t = tempdir();
    let o = tierkv::Options::new().preset(Preset::Hpdk).pm_pool_size(8 << 20).hpdk(HpdkOptions {
        memtable_size: 16 << 10,
        vlog_pool_size: 256 << 10,
        block_size: 512,
        merge_trigger: 2,
        ..HpdkOptions::default()
    });
    let db = Arc::new(Db::open(t.path(), o.clone()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    // Values name their key and round, so a reader can tell a torn or misdirected read.
    let reader = {
        let (db, stop) = (db.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for i in (0..800u32).step_by(7) {
                    if let Some(v) = db.get(key(i)).unwrap() {
                        let want = format!("{}-", String::from_utf8_lossy(&key(i)));
                        assert!(v.starts_with(want.as_bytes()), "{} read {:?}", i, String::from_utf8_lossy(&v));
                        reads += 1;
                    }
                }
            }
            reads
        })
    };
    let writers: Vec<_> = (0..2u32)
        .map(|w| {
            let db = db.clone();
            std::thread::spawn(move || {
                let mut m = Model::new();
                for round in 0..25u32 {
                    for i in (w * 400)..(w * 400 + 400) {
                        let v = format!("{}-{round}-{}", String::from_utf8_lossy(&key(i)), "p".repeat(30)).into_bytes();
                        db.put(key(i), &v).unwrap();
                        m.insert(key(i), v);
                    }
                }
                m
            })
        })
        .collect();
    let mut m = Model::new();
    for w in writers {
        m.extend(w.join().unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
    db.flush().unwrap();
    assert!(d(&db, "merges") > 0, "no background merge ran");
    eprintln!(
        "merges {} flushes {} install conflicts {} stalls {}",
        d(&db, "merges"),
        d(&db, "flushes"),
        d(&db, "merge_install_conflicts"),
        d(&db, "write_stalls")
    );
    assert_matches(&db, &m, "after the race");
    assert_eq!(db.check().unwrap(), Vec::<String>::new());
    Arc::try_unwrap(db).unwrap().close().unwrap();
    let db = Db::open(t.path(), o).unwrap();
    assert_matches(&db, &m, "after reopen");
    assert_eq!(db.check().unwrap(), Vec::<String>::new());
}

#[test]
fn unsynced_wal_survives_a_process_crash_and_synced_wal_survives_power_loss() {
    for sync_wal in [false, true] {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = HpdkOptions { sync_wal, ..manual() };
        let db = Db::open(dir(), opts(&dev, &fs, o.clone())).unwrap();
        let mut m = Model::new();
        put_range(&db, &mut m, 0..50, 0);
        for i in 50..80 {
            db.put(key(i), val(i, 0)).unwrap();
            m.insert(key(i), val(i, 0));
        }
        db.simulate_process_crash();
        // A process crash: PM keeps every persisted line, the page cache keeps every
        // written (even unsynced) byte.
        let dev = dev.simulate_crash(5, 0.5);
        let db = Db::open(dir(), opts(&dev, &fs, o.clone())).unwrap();
        assert_matches(&db, &m, &format!("process crash, sync_wal {sync_wal}"));
        db.simulate_process_crash();
        // Power loss: unsynced file data is gone too. Only a synced WAL keeps the unflushed
        // writes; without it, the store still opens with a prefix of them.
        let db = Db::open(dir(), opts(&dev.simulate_crash(6, 0.5), &fs.crash(), o)).unwrap();
        let got = dump(&db);
        if sync_wal {
            assert_eq!(got, m, "power loss with sync_wal");
        } else {
            for i in 0..50 {
                assert!(got.contains_key(&key(i)), "flushed key {i} lost");
            }
        }
    }
}

/// Regression (found reading the code for the salvage walk): close removed every B+-tree
/// recovery file but the highest-numbered one. A merge that a crash cut after writing its
/// recovery file and before its commit leaves one numbered above the committed version;
/// close then kept that stale file, removed the one matching the MANIFEST, and the next open
/// failed with "no usable B+-tree recovery file". Now the file kept is the one last written
/// (or chosen at open).
#[test]
fn a_stale_recovery_file_from_a_cut_merge_is_not_the_one_kept() {
    use tierkv::engine::hpdk::{dump_name, layout};
    use tierkv::fs::Fs;
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
    let m = four_tables(&db);
    db.close().unwrap();
    drop(db);
    let mut dumps: Vec<u64> =
        fs.list(&dir()).unwrap().iter().filter_map(|n| n.strip_prefix("BTREE-").and_then(|s| s.parse().ok())).collect();
    assert_eq!(dumps.len(), 1);
    let n = dumps.pop().unwrap();
    // What a merge cut before its commit leaves: a file numbered past the version.
    let stale = layout::Dump { covered: n + 5, tables: vec![n + 5], ..Default::default() };
    fs.write_atomic(&dir().join(dump_name(n + 5)), &layout::encode_dump(&stale)).unwrap();
    for round in 0..2 {
        let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap_or_else(|e| panic!("open {round}: {e}"));
        assert_matches(&db, &m, "after a stale recovery file");
        db.close().unwrap();
    }
    assert!(!fs.exists(&dir().join(dump_name(n + 5))), "the stale file is removed at close");
}

/// Review finding: a session without the B+-tree (`use_btree` false) removed every recovery
/// file at close (it kept "the one it wrote", and it wrote none), so the next open with the
/// tree refused the store.
#[test]
fn a_session_without_the_tree_keeps_the_recovery_file() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap();
    let m = four_tables(&db);
    db.close().unwrap();
    drop(db);
    let db = Db::open(dir(), opts(&dev, &fs, HpdkOptions { use_btree: false, ..manual() })).unwrap();
    assert_matches(&db, &m, "without the tree");
    db.close().unwrap();
    drop(db);
    let db = Db::open(dir(), opts(&dev, &fs, manual())).unwrap_or_else(|e| panic!("with the tree again: {e}"));
    assert_matches(&db, &m, "with the tree again");
}

#[test]
fn value_pools_tile_pm_pools_instead_of_leaving_half_of_each_to_tables() {
    // Two 512 KiB value pools would not fit a 1 MiB PM pool after its 64-byte header; the
    // store shrinks them by 64 bytes so they do, and PM holds the values in about half the
    // PM pools it took before (measured with the defaults: 17 PM pools of 256 MiB for
    // 17 value pools of 128 MiB).
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let o = HpdkOptions { memtable_size: 64 << 10, vlog_pool_size: 512 << 10, ..manual() };
    let db = Db::open(dir(), opts(&dev, &fs, o.clone())).unwrap();
    let mut m = Model::new();
    for i in 0..6000u32 {
        let v = vec![(i % 251) as u8; 1000];
        db.put(key(i), &v).unwrap();
        m.insert(key(i), v);
    }
    db.flush().unwrap();
    let value_pools = d(&db, "value_pools");
    let pm_pools = db.stats().pm.pools;
    assert!(value_pools >= 11, "{value_pools} value pools for 6 MB of values");
    assert!(
        pm_pools <= value_pools / 2 + 3,
        "{pm_pools} PM pools for {value_pools} value pools: value pools do not tile PM pools"
    );
    assert_matches(&db, &m, "after filling");
    db.close().unwrap();
    drop(db);
    // The size is a property of the store (its superblock), kept across reopen.
    let db = Db::open(dir(), opts(&dev, &fs, o)).unwrap();
    assert_matches(&db, &m, "after reopen");
    for i in 6000..7000u32 {
        db.put(key(i), [7u8; 1000]).unwrap();
    }
    assert_eq!(db.check().unwrap(), Vec::<String>::new());
}
