//! The mechanisms of `native`, each shown running: writers on several shards, crash
//! recovery of concurrent writers under the strict PM model, snapshot isolation and the
//! reclamation of old versions, conditional writes under races, records larger than a
//! segment, and the strict end a clean close gives every log.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};

use crossbeam_epoch as epoch;

use super::Native;
use crate::batch::BatchOp;
use crate::engine::{Cond, Engine};
use crate::fs::FaultFs;
use crate::options::{NativeOptions, Options, Preset};
use crate::pm::sim::{CrashModel, SimDevice};

fn opts(dev: &SimDevice, fs: &FaultFs) -> Options {
    crate::testing::sim_options(Preset::Native, dev, fs)
}

fn open(o: &Options, fs: &FaultFs, fresh: bool) -> crate::Result<Native> {
    Native::open(crate::engine::test_ctx(o, fs, fresh, 7))
}

fn design(e: &Native, name: &str) -> u64 {
    e.stats().design.get(name).copied().unwrap_or_else(|| panic!("no design figure {name}"))
}

fn put(k: &[u8], v: &[u8]) -> BatchOp {
    BatchOp::Put { key: k.to_vec(), value: v.to_vec() }
}

/// Versions in `key`'s chain, newest first.
fn chain(e: &Native, key: &[u8]) -> Vec<u64> {
    let g = epoch::pin();
    let mg = super::index::MapGuard::new();
    let Some(slot) = e.inner.index.get(key, &mg) else { return vec![] };
    let mut out = Vec::new();
    let mut v = slot.head(&g);
    while let Some(x) = v {
        out.push(x.seq);
        v = x.older(&g);
    }
    out
}

/// Writer `w`'s version `i` of its key `k`: the version is readable back from the value.
fn val(w: usize, k: usize, i: u32) -> Vec<u8> {
    let mut v = format!("w{w}k{k}v{i:06}#").into_bytes();
    v.resize(40 + (i as usize * 37) % 300, b'x');
    v
}

fn version_of(v: &[u8]) -> u32 {
    let s = std::str::from_utf8(v).unwrap();
    let i = s.find('v').unwrap();
    s[i + 1..i + 7].parse().unwrap()
}

/// Four writers put and batch their own keys while the strict model crashes the device at
/// a PM event; every write acknowledged before the crash must be there after reopening
/// (a newer version of the same writer is fine: it may have landed unacknowledged), and a
/// batch shows all its keys at one version.
#[test]
fn concurrent_writers_use_several_shards_and_every_acknowledged_write_survives_a_crash() {
    for (round, point) in [400u64, 1500, 3000, 4200, 5600, 7000].into_iter().enumerate() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let o = opts(&dev, &fs);
        let e = Arc::new(open(&o, &fs, true).unwrap());
        let start = dev.events();
        dev.crash_before_event(start + point);
        let acked: Vec<BTreeMap<usize, u32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|w| {
                    let e = e.clone();
                    let dev = dev.clone();
                    s.spawn(move || {
                        let mut acked = BTreeMap::new();
                        for i in 0..400u32 {
                            let k = (i as usize * 7 + w) % 10;
                            let ops: Vec<BatchOp> = if i.is_multiple_of(5) {
                                (0..3).map(|j| put(format!("w{w}-b{j}").as_bytes(), &val(w, 100 + j, i))).collect()
                            } else {
                                vec![put(format!("w{w}-{k}").as_bytes(), &val(w, k, i))]
                            };
                            e.write(&ops, Cond::None).unwrap();
                            if !dev.crashed() {
                                if i.is_multiple_of(5) {
                                    acked.insert(100, i);
                                } else {
                                    acked.insert(k, i);
                                }
                            }
                        }
                        acked
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(dev.crashed(), "round {round}: crash point {point} not reached");
        assert!(design(&e, "shard_busy_skips") > 0 || design(&e, "segments_created") >= 2, "writers shared one shard");
        drop(e);
        let dev2 = dev.simulate_crash_with(round as u64, CrashModel::strict(0.5));
        let o2 = opts(&dev2, &fs);
        let e2 = open(&o2, &fs, false).unwrap();
        for (w, keys) in acked.iter().enumerate() {
            for (&k, &i) in keys {
                if k == 100 {
                    let got: Vec<u32> = (0..3)
                        .map(|j| version_of(&e2.get(format!("w{w}-b{j}").as_bytes()).unwrap().expect("batch key lost")))
                        .collect();
                    assert!(got.iter().all(|&g| g == got[0]), "round {round}: batch torn: {got:?}");
                    assert!(got[0] >= i, "round {round}: acknowledged batch {i} of writer {w} lost (got {})", got[0]);
                } else {
                    let v = e2.get(format!("w{w}-{k}").as_bytes()).unwrap().expect("acknowledged key lost");
                    assert!(
                        version_of(&v) >= i,
                        "round {round}: writer {w} key {k}: acked {i}, got {}",
                        version_of(&v)
                    );
                }
            }
        }
        assert!(e2.check().unwrap().is_empty());
    }
}

/// A snapshot reads its point in time while writers overwrite; the versions it needed are
/// cut from the chains once it is dropped and the keys are written again.
#[test]
fn snapshots_keep_their_view_and_old_versions_are_reclaimed_after_them() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = Arc::new(open(&opts(&dev, &fs), &fs, true).unwrap());
    for k in 0..20u32 {
        e.write(&[put(format!("k{k:02}").as_bytes(), b"v0")], Cond::None).unwrap();
    }
    let snap = e.snapshot().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let e = e.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) || n < 200 {
                let k = n % 20;
                e.write(&[put(format!("k{k:02}").as_bytes(), format!("v{}", n + 1).as_bytes())], Cond::None).unwrap();
                if n.is_multiple_of(7) {
                    e.write(&[BatchOp::Delete { key: format!("k{k:02}").into_bytes() }], Cond::None).unwrap();
                }
                n += 1;
            }
        })
    };
    for _ in 0..50 {
        for k in 0..20u32 {
            assert_eq!(snap.get(format!("k{k:02}").as_bytes()).unwrap().as_deref(), Some(b"v0".as_slice()));
        }
        let mut it = snap.iter().unwrap();
        it.seek_to_first().unwrap();
        let mut n = 0;
        while it.valid() {
            assert_eq!(it.value(), Some(b"v0".as_slice()));
            n += 1;
            it.next().unwrap();
        }
        assert_eq!(n, 20);
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    // The snapshot kept one old version per key alive.
    assert!((0..20).any(|k| chain(&e, format!("k{k:02}").as_bytes()).len() >= 2));
    drop(snap);
    assert_eq!(design(&e, "live_snapshots"), 0);
    // Writes after the release (and a publication) trim every chain down to what a reader
    // without a snapshot needs.
    for round in 0..40u32 {
        for k in 0..20u32 {
            e.write(&[put(format!("k{k:02}").as_bytes(), format!("r{round}").as_bytes())], Cond::None).unwrap();
        }
    }
    for k in 0..20u32 {
        let c = chain(&e, format!("k{k:02}").as_bytes());
        assert!(c.len() <= 2, "key {k}: {} versions kept after the snapshot was dropped", c.len());
    }
}

/// Racing `insert_if_absent`s of one key (and plain puts of others in between) have exactly
/// one winner per key, and the value stored is the winner's.
#[test]
fn racing_conditional_inserts_have_one_winner() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = Arc::new(open(&opts(&dev, &fs), &fs, true).unwrap());
    let barrier = Arc::new(Barrier::new(4));
    let wins: Vec<Vec<u32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4u8)
            .map(|t| {
                let e = e.clone();
                let barrier = barrier.clone();
                s.spawn(move || {
                    barrier.wait();
                    let mut won = Vec::new();
                    for k in 0..100u32 {
                        let op = put(format!("c{k}").as_bytes(), &[b'a' + t; 30]);
                        if e.write(&[op], Cond::Absent).unwrap() {
                            won.push(k);
                        }
                        e.write(&[put(format!("p{t}-{k}").as_bytes(), b"x")], Cond::None).unwrap();
                    }
                    won
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for k in 0..100u32 {
        let winners: Vec<usize> = (0..4).filter(|&t| wins[t].contains(&k)).collect();
        assert_eq!(winners.len(), 1, "key c{k}: winners {winners:?}");
        let v = e.get(format!("c{k}").as_bytes()).unwrap().unwrap();
        assert_eq!(v, vec![b'a' + winners[0] as u8; 30]);
    }
    // update_if_present sees a delete made before it.
    e.write(&[BatchOp::Delete { key: b"c0".to_vec() }], Cond::None).unwrap();
    assert!(!e.write(&[put(b"c0", b"z")], Cond::Present).unwrap());
    assert!(e.write(&[put(b"c1", b"z")], Cond::Present).unwrap());
}

/// A record larger than a segment slot gets a run of slots; logs, seals and the run survive
/// a reopen, and so does a crash right after it.
#[test]
fn a_record_larger_than_a_segment_spans_slots() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let o = opts(&dev, &fs).native(NativeOptions { shards: 2, verify_reads: true, ..crate::testing::native_small() });
    let e = open(&o, &fs, true).unwrap();
    let big: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
    let o = o.max_value_size(64 << 10);
    e.write(&[put(b"small", b"s")], Cond::None).unwrap();
    e.write(&[put(b"big", &big)], Cond::None).unwrap();
    e.write(&[put(b"after", b"a")], Cond::None).unwrap();
    assert!(design(&e, "segments_created") >= 2);
    drop(e);
    let dev2 = dev.simulate_crash_with(1, CrashModel::strict(0.5));
    let e2 = open(&opts(&dev2, &fs).native(o.native.clone()), &fs, false).unwrap();
    assert_eq!(e2.get(b"big").unwrap(), Some(big));
    assert_eq!(e2.get(b"after").unwrap().as_deref(), Some(b"a".as_slice()));
    assert!(e2.check().unwrap().is_empty());
}

/// After a clean close every log's end is known: damage in the last record of an open
/// segment is corruption. After a crash the same bytes are a torn tail: dropped, reported.
#[test]
fn a_clean_close_makes_every_log_end_strict() {
    for clean in [true, false] {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let o = opts(&dev, &fs).native(NativeOptions { shards: 1, ..crate::testing::native_small() });
        let e = open(&o, &fs, true).unwrap();
        e.write(&[put(b"a", b"first")], Cond::None).unwrap();
        e.write(&[put(b"b", b"second-value")], Cond::None).unwrap();
        let loc = {
            let g = epoch::pin();
            let mg = super::index::MapGuard::new();
            e.inner.index.get(b"b", &mg).unwrap().head(&g).unwrap().loc()
        };
        if clean {
            e.close().unwrap();
        }
        drop(e);
        let dev2 = if clean { dev.clone() } else { dev.simulate_crash_with(3, CrashModel::strict(0.0)) };
        // The last byte of the value of "b": inside its entry, covered by its checksum.
        let at = loc + 12 + 1 + 11;
        let pool = (at / o.pm_pool_size) as usize;
        let off = (at % o.pm_pool_size) as usize;
        let old = dev2.durable_image(pool).unwrap()[off];
        assert!(dev2.poke(pool, off, &[old ^ 0x40]));
        if clean {
            // The open loads the index checkpoint and does not replay the record: the
            // first read of "b" verifies its checksum (a version loaded from a checkpoint
            // is unverified), and `check` finds it.
            let (dev3, fs3) = (dev2.simulate_crash_with(0, CrashModel::strict(0.0)), fs.crash());
            let o2 = opts(&dev2, &fs).native(o.native.clone());
            let e2 = open(&o2, &fs, false).unwrap();
            assert_eq!(design(&e2, "recovery_checkpoint_entries"), 2);
            assert_eq!(e2.get(b"a").unwrap().as_deref(), Some(b"first".as_slice()));
            let err = e2.get(b"b").expect_err("a damaged value was returned");
            assert!(err.is_corruption(), "{err}");
            let mut it = e2.iter().unwrap();
            assert!(it.seek_to_first().is_err(), "an iterator returned a damaged value");
            drop(it);
            assert!(!e2.check().unwrap().is_empty());
            drop(e2);
            // Without the checkpoint the open replays the logs: the end is strict.
            crate::fs::Fs::remove(&fs3, &std::path::Path::new("/db").join(super::checkpoint::FILE_NAME)).unwrap();
            let err = open(&opts(&dev3, &fs3).native(o.native.clone()), &fs3, false).err();
            let err = err.expect("damage after a clean close must not open");
            assert!(err.is_corruption(), "{err}");
        } else {
            let ctx = crate::engine::test_ctx(&opts(&dev2, &fs).native(o.native.clone()), &fs, false, 7);
            let report = ctx.recovery.clone();
            let e2 = Native::open(ctx).unwrap();
            assert_eq!(e2.get(b"a").unwrap().as_deref(), Some(b"first".as_slice()));
            assert_eq!(e2.get(b"b").unwrap(), None, "the torn last write is dropped");
            assert!(report.lock().iter().any(|d| d.reason == crate::format::log::DropReason::TornTail));
        }
    }
}

/// Small segments, a workload that overwrites and deletes: returns the store and the model.
fn churn(e: &Native, rounds: u32) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut m = BTreeMap::new();
    for r in 0..rounds {
        for k in 0..120u32 {
            let key = format!("g{k:03}").into_bytes();
            if (k + r) % 9 == 0 {
                e.write(&[BatchOp::Delete { key: key.clone() }], Cond::None).unwrap();
                m.remove(&key);
            } else {
                let v = format!("r{r}-k{k}-").repeat(20).into_bytes();
                e.write(&[put(&key, &v)], Cond::None).unwrap();
                m.insert(key, v);
            }
        }
    }
    m
}

fn assert_model(e: &Native, m: &BTreeMap<Vec<u8>, Vec<u8>>, ctx: &str) {
    for k in 0..120u32 {
        let key = format!("g{k:03}").into_bytes();
        assert_eq!(e.get(&key).unwrap(), m.get(&key).cloned(), "{ctx}: key {k}");
    }
}

/// Overwrites and deletes leave segments mostly dead; `compact` copies their live entries
/// forward and retires them. Every value (and every delete) holds, in the running store,
/// after a clean reopen, and after a crash that drops the clean-close record.
#[test]
fn log_cleaning_reclaims_dead_segments_and_keeps_every_live_entry() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let o = opts(&dev, &fs);
    let e = open(&o, &fs, true).unwrap();
    let m = churn(&e, 6);
    let before = design(&e, "segments");
    e.compact().unwrap();
    assert!(design(&e, "segments_cleaned") > 0, "nothing cleaned");
    assert!(design(&e, "dead_entries_dropped") > 0);
    assert!(design(&e, "segments") < before, "cleaning did not shrink the log ({before} segments)");
    assert_model(&e, &m, "after cleaning");
    assert!(e.check().unwrap().is_empty());
    // More writes reuse retired slots once no reader holds them.
    let m = {
        let mut m2 = m.clone();
        for r in 0..4u32 {
            for k in 0..120u32 {
                let key = format!("g{k:03}").into_bytes();
                let v = format!("s{r}-k{k}-").repeat(20).into_bytes();
                e.write(&[put(&key, &v)], Cond::None).unwrap();
                m2.insert(key, v);
            }
            e.compact().unwrap();
        }
        m2
    };
    assert_model(&e, &m, "after reuse");
    // A crash (no clean close), then a clean close and reopen.
    drop(e);
    let dev2 = dev.simulate_crash_with(5, CrashModel::strict(0.5));
    let e2 = open(&opts(&dev2, &fs), &fs, false).unwrap();
    assert_model(&e2, &m, "after a crash");
    assert!(e2.check().unwrap().is_empty());
    // Cleaning after the reopen (deletes of keys the open dropped are kept).
    e2.compact().unwrap();
    assert_model(&e2, &m, "after cleaning a reopened store");
    e2.close().unwrap();
    drop(e2);
    let e3 = open(&opts(&dev2, &fs), &fs, false).unwrap();
    assert_model(&e3, &m, "after a clean reopen");
}

/// A snapshot and an iterator made before cleaning read their view through it; the
/// segments cleaned under them are not reused while they live.
#[test]
fn readers_keep_their_view_across_cleaning_and_hold_retired_segments() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&opts(&dev, &fs), &fs, true).unwrap();
    let m0 = churn(&e, 2);
    let snap = e.snapshot().unwrap();
    let mut it = snap.iter().unwrap();
    it.seek_to_first().unwrap();
    let first = (it.key().to_vec(), it.value().map(<[u8]>::to_vec));
    let _m1 = churn(&e, 5);
    e.compact().unwrap();
    assert!(design(&e, "segments_cleaned") > 0);
    assert!(design(&e, "segments_retired") > 0, "retired segments reused under a live iterator");
    for (k, v) in &m0 {
        assert_eq!(snap.get(k).unwrap().as_ref(), Some(v), "snapshot lost its version");
    }
    assert_eq!(first.1.as_ref(), m0.get(&first.0));
    let mut n = 1;
    it.next().unwrap();
    while it.valid() {
        if let Some(v) = it.value() {
            assert_eq!(Some(&v.to_vec()), m0.get(it.key()), "iterator value changed under cleaning");
            n += 1;
        }
        it.next().unwrap();
    }
    assert_eq!(n, m0.len());
    drop(it);
    drop(snap);
    // Once the readers are gone (and the epoch moved on), later writes reuse the slots.
    let mut reused = false;
    for _ in 0..200 {
        churn(&e, 1);
        if design(&e, "segments_retired") == 0 {
            reused = true;
            break;
        }
    }
    assert!(reused, "retired segments never became reusable");
}

/// A crash at PM events of a cleaning pass (strict model): afterwards every key has its
/// value, deleted keys stay deleted.
#[test]
fn a_crash_anywhere_in_cleaning_loses_nothing() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let o = opts(&dev, &fs);
    let e = open(&o, &fs, true).unwrap();
    let m = churn(&e, 6);
    drop(e);
    // Count the events of one cleaning pass on a copy of the store.
    let probe = dev.simulate_crash_with(0, CrashModel::strict(0.0));
    let pfs = fs.crash();
    let ep = open(&opts(&probe, &pfs), &pfs, false).unwrap();
    let start = probe.events();
    ep.compact().unwrap();
    let events = probe.events() - start;
    assert!(design(&ep, "segments_cleaned") > 0 && events > 10);
    drop(ep);
    for (i, at) in (1..events).step_by((events as usize / 12).max(1)).enumerate() {
        let d = dev.simulate_crash_with(100, CrashModel::strict(0.0));
        // Files crash with the device (the index checkpoint `compact` writes at its end).
        let cfs = fs.crash();
        let f2 = cfs.clone();
        d.on_freeze(move || f2.freeze());
        let e = open(&opts(&d, &cfs), &cfs, false).unwrap();
        d.crash_before_event(d.events() + at);
        let _ = e.compact();
        assert!(d.crashed(), "event {at} not reached");
        drop(e);
        let after = d.simulate_crash_with(i as u64, CrashModel::strict(0.5));
        let afs = cfs.crash();
        let e2 = open(&opts(&after, &afs), &afs, false).unwrap();
        assert_model(&e2, &m, &format!("crash at cleaning event {at} of {events}"));
        assert!(e2.check().unwrap().is_empty());
    }
}

/// Without `compact`, writers clean as they go once half of the log is dead: the log stays
/// within about twice the live data however long the churn runs.
#[test]
fn writers_keep_the_log_within_twice_the_live_data() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&opts(&dev, &fs), &fs, true).unwrap();
    let mut m = BTreeMap::new();
    let mut peak = 0;
    for _ in 0..10 {
        m = churn(&e, 5);
        peak = peak.max(design(&e, "segments"));
    }
    assert!(design(&e, "segments_cleaned") > 0, "writers never cleaned");
    // Live data: 120 keys of ~400 bytes (~48 KiB) in 16 KiB segments: 3–4 segments; twice
    // that, plus an open segment per shard and the cleaning batch, stays under 20.
    assert!(peak < 20, "the log grew to {peak} segments: {:?}", e.stats().design);
    // Regression: copies of versions kept only for a snapshot (or for the publication lag)
    // were counted live, so fully dead segments showed ~42 % dead and were never cleaned
    // (21 segments for ~3 of live data).
    assert_model(&e, &m, "after the churn");
}

/// `native` with a DRAM budget of `slots` index slots and no background thread.
fn cold_opts(dev: &SimDevice, fs: &FaultFs, slots: u64) -> Options {
    opts(dev, fs)
        .native(NativeOptions { dram_budget: slots * (super::PER_SLOT_BYTES + 16), ..crate::testing::native_small() })
}

fn ck(i: u32) -> Vec<u8> {
    format!("c{i:05}").into_bytes()
}

fn cv(i: u32, round: u32) -> Vec<u8> {
    format!("r{round}-{i}-").repeat(12).into_bytes()
}

/// Put keys `0..n` (round 0); returns the model.
fn fill_cold(e: &Native, n: u32) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut m = BTreeMap::new();
    for i in 0..n {
        e.write(&[put(&ck(i), &cv(i, 0))], Cond::None).unwrap();
        m.insert(ck(i), cv(i, 0));
    }
    m
}

/// Every key of the model through `get` and through an ordered walk (forward), and no
/// other key.
fn assert_cold_model(e: &Native, m: &BTreeMap<Vec<u8>, Vec<u8>>, ctx: &str) {
    for (k, v) in m {
        assert_eq!(e.get(k).unwrap().as_ref(), Some(v), "{ctx}: get {}", String::from_utf8_lossy(k));
    }
    let mut it = e.iter().unwrap();
    it.seek_to_first().unwrap();
    let mut seen = Vec::new();
    while it.valid() {
        if let Some(v) = it.value() {
            seen.push((it.key().to_vec(), v.to_vec()));
        }
        it.next().unwrap();
    }
    let want: Vec<_> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    assert_eq!(seen.len(), want.len(), "{ctx}: the walk saw {} keys, the model has {}", seen.len(), want.len());
    assert!(seen == want, "{ctx}: the walk differs from the model");
}

/// Past its DRAM budget the store moves cold keys to disk tables (and out of the index);
/// they read back through `get` and iterators, overwrites and deletes of moved keys win
/// over their disk copies, keys read often stay in PM, and all of it holds after a clean
/// reopen and after a crash.
#[test]
fn cold_keys_move_to_disk_and_read_back() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let o = cold_opts(&dev, &fs, 100);
    let e = open(&o, &fs, true).unwrap();
    let mut m = BTreeMap::new();
    // Keys 0..20 are read between the passes of the hand: they stay hot.
    for i in 0..1500u32 {
        e.write(&[put(&ck(i), &cv(i, 0))], Cond::None).unwrap();
        m.insert(ck(i), cv(i, 0));
        if i >= 20 && i % 10 == 0 {
            for j in 0..20u32 {
                assert_eq!(e.get(&ck(j)).unwrap(), Some(cv(j, 0)));
            }
        }
    }
    for _ in 0..3 {
        for i in 0..20u32 {
            assert_eq!(e.get(&ck(i)).unwrap(), Some(cv(i, 0)));
        }
        e.compact().unwrap();
    }
    let moved = design(&e, "cold_keys_moved");
    assert!(moved >= 1300, "only {moved} keys moved: {:?}", e.stats().design);
    assert!(design(&e, "cold_slots_removed") >= 1300);
    assert!(design(&e, "index_slots") <= 200, "the index kept {} slots", design(&e, "index_slots"));
    assert!(design(&e, "cold_tables") > 0 && design(&e, "cold_table_bytes") > 0);
    for i in 0..20u32 {
        assert!(e.inner.index.newest_seq(&ck(i)).is_some(), "hot key {i} left PM");
    }
    assert_cold_model(&e, &m, "after the move");
    let reads = design(&e, "cold_disk_reads");
    assert!(reads > 0, "no read went to disk");
    // Overwrite and delete keys that live on disk now.
    for i in (100..1500u32).step_by(7) {
        e.write(&[put(&ck(i), &cv(i, 1))], Cond::None).unwrap();
        m.insert(ck(i), cv(i, 1));
    }
    for i in (103..1500u32).step_by(11) {
        e.write(&[BatchOp::Delete { key: ck(i) }], Cond::None).unwrap();
        m.remove(&ck(i));
    }
    // Conditional writes consult the disk tier.
    let absent = !m.contains_key(&ck(1001));
    assert_eq!(e.write(&[put(&ck(1001), b"no")], Cond::Absent).unwrap(), absent);
    if absent {
        m.insert(ck(1001), b"no".to_vec());
    }
    assert!(e.write(&[put(&ck(1002), &cv(1002, 2))], Cond::Present).unwrap() == m.contains_key(&ck(1002)));
    if m.contains_key(&ck(1002)) {
        m.insert(ck(1002), cv(1002, 2));
    }
    assert_cold_model(&e, &m, "after overwrites and deletes of moved keys");
    // Move again (the new versions and the deletes go to disk too), clean the log.
    e.compact().unwrap();
    e.compact().unwrap();
    assert!(design(&e, "cold_keys_moved") > moved);
    assert_cold_model(&e, &m, "after the second move");
    assert!(e.check().unwrap().is_empty(), "{:?}", e.check().unwrap());
    // A crash: the moved entries in PM send the keys to disk again.
    drop(e);
    let dev2 = dev.simulate_crash_with(3, CrashModel::strict(0.5));
    let e2 = open(&cold_opts(&dev2, &fs, 100), &fs, false).unwrap();
    assert!(design(&e2, "index_slots") < 600, "recovery put moved keys back into the index");
    assert_cold_model(&e2, &m, "after a crash");
    assert!(e2.check().unwrap().is_empty(), "{:?}", e2.check().unwrap());
    e2.close().unwrap();
    drop(e2);
    let e3 = open(&cold_opts(&dev2, &fs, 100), &fs, false).unwrap();
    assert_cold_model(&e3, &m, "after a clean reopen");
}

/// A snapshot taken before keys move reads them through the moves (the slots wait for it
/// to end), and one taken after overwrites of moved keys reads the disk copies.
#[test]
fn snapshots_read_through_moves_to_disk() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&cold_opts(&dev, &fs, 50), &fs, true).unwrap();
    let m0 = fill_cold(&e, 600);
    // Writers moved some keys already; their slots leave now (no snapshot lives).
    e.inner.remove_moved();
    let (moved, removed) = (design(&e, "cold_keys_moved"), design(&e, "cold_slots_removed"));
    let snap = e.snapshot().unwrap();
    e.compact().unwrap();
    e.compact().unwrap();
    assert!(design(&e, "cold_keys_moved") > moved + 100, "{moved} → {}", design(&e, "cold_keys_moved"));
    assert_eq!(design(&e, "cold_slots_removed"), removed, "slots removed under a snapshot older than their move");
    for (k, v) in &m0 {
        assert_eq!(snap.get(k).unwrap().as_ref(), Some(v));
    }
    drop(snap);
    e.compact().unwrap();
    assert!(design(&e, "cold_slots_removed") > removed + 100, "slots not removed once the snapshot ended");
    // Keys now on disk; a snapshot, then overwrites: the snapshot reads the disk copies.
    let snap = e.snapshot().unwrap();
    let mut m1 = m0.clone();
    for i in (0..600u32).step_by(3) {
        e.write(&[put(&ck(i), &cv(i, 1))], Cond::None).unwrap();
        m1.insert(ck(i), cv(i, 1));
    }
    e.compact().unwrap();
    e.compact().unwrap();
    let mut it = snap.iter().unwrap();
    it.seek_to_first().unwrap();
    let mut n = 0;
    while it.valid() {
        assert_eq!(Some(&it.value().unwrap().to_vec()), m0.get(it.key()));
        n += 1;
        it.next().unwrap();
    }
    assert_eq!(n, m0.len());
    for (k, v) in &m0 {
        assert_eq!(snap.get(k).unwrap().as_ref(), Some(v));
    }
    drop(it);
    drop(snap);
    assert_cold_model(&e, &m1, "after the snapshot ended");
}

/// A crash at PM events of a `compact` that moves keys to disk and cleans (strict model,
/// and the file layer dropping what was not fsynced): afterwards every key has its value.
#[test]
fn a_crash_anywhere_in_a_move_to_disk_loses_nothing() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&cold_opts(&dev, &fs, 40), &fs, true).unwrap();
    let mut m = fill_cold(&e, 400);
    for i in (0..400u32).step_by(5) {
        e.write(&[BatchOp::Delete { key: ck(i) }], Cond::None).unwrap();
        m.remove(&ck(i));
    }
    e.close().unwrap();
    drop(e);
    // Count the PM events of one pass on a copy of the store (devices and file systems
    // are copied: `crash` keeps what is durable).
    let probe = dev.simulate_crash_with(0, CrashModel::strict(0.0));
    let pfs = fs.crash();
    let ep = open(&cold_opts(&probe, &pfs, 40), &pfs, false).unwrap();
    let start = probe.events();
    ep.compact().unwrap();
    let events = probe.events() - start;
    assert!(design(&ep, "cold_keys_moved") > 100 && events > 50, "{events} events");
    drop(ep);
    let mut points = 0;
    for (i, at) in (1..events).step_by((events as usize / 16).max(1)).enumerate() {
        let d = dev.simulate_crash_with(100, CrashModel::strict(0.0));
        let cfs = fs.crash();
        let f2 = cfs.clone();
        d.on_freeze(move || f2.freeze());
        let e = open(&cold_opts(&d, &cfs, 40), &cfs, false).unwrap();
        d.crash_before_event(d.events() + at);
        let _ = e.compact();
        assert!(d.crashed(), "event {at} not reached");
        drop(e);
        let afs = cfs.crash();
        let after = d.simulate_crash_with(i as u64, CrashModel::strict(0.5));
        let e2 = open(&cold_opts(&after, &afs, 40), &afs, false).unwrap();
        assert_cold_model(&e2, &m, &format!("crash at move event {at} of {events}"));
        assert!(e2.check().unwrap().is_empty(), "{:?}", e2.check().unwrap());
        points += 1;
    }
    assert!(points >= 10);
}

/// A clean close writes an index checkpoint; the next open loads it and replays no log
/// record; the store reads as before, and `check` (which walks every record) agrees.
#[test]
fn a_clean_reopen_loads_the_checkpoint_and_replays_no_log() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&opts(&dev, &fs), &fs, true).unwrap();
    let m = churn(&e, 6);
    let slots = design(&e, "index_slots");
    e.close().unwrap();
    assert_eq!(design(&e, "checkpoints_written"), 1);
    assert_eq!(design(&e, "checkpoint_entries"), slots);
    drop(e);
    let e2 = open(&opts(&dev, &fs), &fs, false).unwrap();
    assert_eq!(design(&e2, "recovery_checkpoint_entries"), slots);
    assert_eq!(design(&e2, "replayed_bytes"), 0, "a clean open replayed log records");
    assert_model(&e2, &m, "after a clean reopen from the checkpoint");
    assert!(e2.check().unwrap().is_empty());
    // Writes after it, a crash: the old checkpoint plus the tails written since.
    let mut m2 = m.clone();
    for k in (0..120u32).step_by(7) {
        let key = format!("g{k:03}").into_bytes();
        let v = format!("late-{k}").into_bytes();
        e2.write(&[put(&key, &v)], Cond::None).unwrap();
        m2.insert(key, v);
    }
    e2.write(&[BatchOp::Delete { key: b"g001".to_vec() }], Cond::None).unwrap();
    m2.remove(b"g001".as_slice());
    drop(e2);
    let dev3 = dev.simulate_crash_with(3, CrashModel::strict(0.5));
    let e3 = open(&opts(&dev3, &fs), &fs, false).unwrap();
    assert_eq!(design(&e3, "recovery_checkpoint_entries"), slots);
    assert!(design(&e3, "replayed_bytes") > 0);
    assert_model(&e3, &m2, "after a crash, from the checkpoint and the tails");
    assert!(e3.check().unwrap().is_empty());
}

/// A damaged checkpoint is ignored (counted), and the logs alone recover the store.
#[test]
fn a_damaged_checkpoint_is_ignored_and_the_logs_recover_the_store() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let o = opts(&dev, &fs);
    let e = open(&o, &fs, true).unwrap();
    let m = churn(&e, 4);
    e.close().unwrap();
    drop(e);
    let path = std::path::Path::new("/db").join(super::checkpoint::FILE_NAME);
    let len = crate::fs::Fs::read_all(&fs, &path).unwrap().len();
    fs.poke(&path, len / 2, &[0xff, 0x00, 0xee]).unwrap();
    let e2 = open(&o, &fs, false).unwrap();
    assert_eq!(design(&e2, "recovery_checkpoint_rejected"), 1);
    assert_eq!(design(&e2, "recovery_checkpoint_entries"), 0);
    assert!(design(&e2, "replayed_bytes") > 0);
    assert_model(&e2, &m, "after a reopen that ignored the damaged checkpoint");
}

/// The case the checkpoint's horizon exists for: around a checkpoint, the capacity tier
/// moves keys to disk (moved entries carry old sequence numbers; some slots wait for a
/// snapshot before they leave), and after it the log cleaner copies versions only a
/// snapshot needs; a crash then replays those tails after the checkpoint. No stale copy
/// may come back as a key's value, and no moved key may lose its disk copy.
#[test]
fn tails_after_a_checkpoint_with_copies_of_old_versions_and_moves_recover_exactly() {
    // Without deltas, and with one after each phase (then the copies and moves reach the
    // open from deltas, and some deltas list records cleaned after they were written).
    for deltas in [false, true] {
        tails_with_copies_and_moves(deltas);
    }
}

fn tails_with_copies_and_moves(deltas: bool) {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let o = cold_opts(&dev, &fs, 300);
    let e = open(&o, &fs, true).unwrap();
    let mut m = fill_cold(&e, 400);
    let compact_log = |e: &Native| {
        let (_, mut log) = e.inner.acquire_shard();
        e.inner.move_cold(&mut log, true, true).unwrap();
        e.inner.clean(&mut log, usize::MAX).unwrap();
    };
    // Moves whose slots wait for a snapshot while the checkpoint is written.
    let s0 = e.snapshot().unwrap();
    compact_log(&e);
    let pending = design(&e, "cold_keys_moved") - design(&e, "cold_slots_removed");
    assert!(pending > 0, "no slot waits for removal: {:?}", e.stats().design);
    e.inner.checkpoint().unwrap();
    drop(s0);
    let (relocated, moved) = (design(&e, "entries_relocated"), design(&e, "cold_keys_moved"));
    // After it: overwrites and deletes under a snapshot (the cleaner copies the versions
    // the snapshot needs), and more moves.
    let s1 = e.snapshot().unwrap();
    for round in 1..=2 {
        for i in (0..400u32).step_by(2) {
            e.write(&[put(&ck(i), &cv(i, round))], Cond::None).unwrap();
            m.insert(ck(i), cv(i, round));
        }
    }
    for i in (1..400u32).step_by(7) {
        e.write(&[BatchOp::Delete { key: ck(i) }], Cond::None).unwrap();
        m.remove(&ck(i));
    }
    let delta = |e: &Native| {
        if deltas {
            e.inner.checkpoint_delta().unwrap();
        }
    };
    delta(&e);
    compact_log(&e);
    delta(&e);
    assert!(design(&e, "entries_relocated") > relocated, "nothing copied after the checkpoint");
    assert_eq!(s1.get(&ck(0)).unwrap(), Some(cv(0, 0)));
    drop(s1);
    for i in 400..700u32 {
        e.write(&[put(&ck(i), &cv(i, 3))], Cond::None).unwrap();
        m.insert(ck(i), cv(i, 3));
    }
    delta(&e);
    compact_log(&e);
    assert!(design(&e, "cold_keys_moved") > moved, "nothing moved after the checkpoint");
    let written = design(&e, "checkpoint_deltas_written");
    assert_eq!(written, if deltas { 3 } else { 0 });
    drop(e);
    let fs2 = fs.crash();
    let dev2 = dev.simulate_crash_with(1, CrashModel::strict(0.5));
    let e2 = open(&cold_opts(&dev2, &fs2, 300), &fs2, false).unwrap();
    assert!(design(&e2, "recovery_checkpoint_entries") > 0, "the checkpoint was not used");
    assert_eq!(design(&e2, "recovery_deltas"), written, "{:?}", e2.inner.ckpt.delta_rejected);
    assert_cold_model(&e2, &m, "after a crash: checkpoint + tails with old copies and moves");
    assert!(e2.check().unwrap().is_empty(), "{:?}", e2.check().unwrap());
}

/// Four writers put their own keys (60 each, versions readable back from the values)
/// while the calling thread runs `step` `rounds` times, each once the writers have made
/// 50 more records (so none runs before they start). Returns each writer's last
/// acknowledged version of each of its keys.
fn under_four_writers(
    e: &Arc<Native>,
    rounds: usize,
    step: impl Fn(&Native) -> crate::Result<()>,
) -> Vec<BTreeMap<usize, u32>> {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|w| {
                let e = e.clone();
                let stop = &stop;
                s.spawn(move || {
                    let mut last = BTreeMap::new();
                    let mut i = 0u32;
                    while !stop.load(Ordering::Relaxed) || i < 400 {
                        let k = (i as usize * 7 + w) % 60;
                        e.write(&[put(format!("w{w}-{k:02}").as_bytes(), &val(w, k, i))], Cond::None).unwrap();
                        last.insert(k, i);
                        i += 1;
                    }
                    last
                })
            })
            .collect();
        let r: crate::Result<Vec<()>> = (0..rounds)
            .map(|_| {
                let records = e.inner.counters.get(super::C_RECORDS);
                while e.inner.counters.get(super::C_RECORDS) < records + 50 {
                    std::thread::yield_now();
                }
                step(e)
            })
            .collect();
        stop.store(true, Ordering::Relaxed);
        r.unwrap();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every write [`under_four_writers`] acknowledged reads back at its version.
fn assert_acknowledged(e: &Native, last: &[BTreeMap<usize, u32>]) {
    for (w, keys) in last.iter().enumerate() {
        for (&k, &i) in keys {
            let got = e.get(format!("w{w}-{k:02}").as_bytes()).unwrap().expect("acknowledged key lost");
            assert_eq!(version_of(&got), i, "writer {w} key {k}");
        }
    }
    assert!(e.check().unwrap().is_empty());
}

/// Checkpoints written while four writers go on (and clean the log as they go): after a
/// crash, every acknowledged write is there.
#[test]
fn checkpoints_written_under_concurrent_writers_recover_every_acknowledged_write() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = Arc::new(open(&opts(&dev, &fs), &fs, true).unwrap());
    let last = under_four_writers(&e, 5, |e| e.inner.checkpoint());
    assert!(design(&e, "checkpoints_written") >= 5);
    assert!(design(&e, "segments_cleaned") > 0, "writers never cleaned: {:?}", e.stats().design);
    drop(e);
    let dev2 = dev.simulate_crash_with(2, CrashModel::strict(0.5));
    let e2 = open(&opts(&dev2, &fs), &fs, false).unwrap();
    assert!(design(&e2, "recovery_checkpoint_entries") > 0, "checkpoint not used: {:?}", e2.inner.ckpt.rejected);
    assert_acknowledged(&e2, &last);
}

/// One shard (so the log's order is the order of the calls), 16 KiB segments, no
/// background thread, and a DRAM budget of one byte: every cold key moves to disk.
fn one_shard_cold_opts(dev: &SimDevice, fs: &FaultFs) -> Options {
    opts(dev, fs).native(NativeOptions { shards: 1, dram_budget: 1, ..crate::testing::native_small() })
}

/// PM address of `key`'s newest version.
fn newest_loc(e: &Native, key: &[u8]) -> u64 {
    let g = epoch::pin();
    let mg = super::index::MapGuard::new();
    e.inner.index.get(key, &mg).and_then(|s| s.head(&g)).map(|v| v.loc()).expect("key has no version")
}

/// Address of the segment holding PM address `loc`.
fn segment_of(e: &Native, loc: u64) -> u64 {
    e.inner.geo.addr(e.inner.geo.slot_holding(loc))
}

/// Put filler keys (recorded in `m`) until the log has sealed the segment at `seg` and
/// started another.
fn fill_until_sealed(e: &Native, seg: u64, m: &mut BTreeMap<Vec<u8>, Vec<u8>>) {
    for i in 0..1000u32 {
        let (k, v) = (format!("f{i:04}").into_bytes(), cv(i, 9));
        e.write(&[put(&k, &v)], Cond::None).unwrap();
        m.insert(k.clone(), v);
        if segment_of(e, newest_loc(e, &k)) != seg {
            return;
        }
    }
    panic!("the segment was never sealed");
}

/// Publish, then move every cold key whose newest version no reader needs any more (two
/// turns of the CLOCK hand: the first clears the reference bits of keys just written).
fn move_all_cold(e: &Native) {
    e.inner.publish();
    let (_, mut log) = e.inner.acquire_shard();
    e.inner.move_cold(&mut log, true, true).unwrap();
}

/// Clean exactly the sealed segment at `addr` (the cleaner's pass over one candidate).
fn clean_one(e: &Native, addr: u64) {
    let (_, mut log) = e.inner.acquire_shard();
    let meta = *e.inner.segs.lock().get(&addr).expect("the segment was cleaned already");
    assert!(meta.sealed.is_some(), "the segment is still open");
    e.inner.clean_segment(&mut log, addr, &meta).unwrap();
}

/// The horizon rule (a tail put or delete numbered below the checkpoint's horizon, of a
/// key the checkpoint does not have, is dropped at open), reached through the review's
/// case: a key is deleted and the delete moves to disk (the slot leaves), the key is put
/// again and that moves too, a checkpoint is written (without the key), and then the
/// cleaner copies the old delete (it keeps deletes of keys without a slot) past the
/// resume point. After a crash that copy must not hide the disk copy of the put.
#[test]
fn the_horizon_rule_drops_an_old_delete_copied_after_a_checkpoint() {
    // Without and with a delta written after the copy (the copy then reaches the open
    // from the delta, not the replayed tail).
    for delta in [false, true] {
        horizon_rule_old_delete(delta);
    }
}

fn horizon_rule_old_delete(delta: bool) {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&one_shard_cold_opts(&dev, &fs), &fs, true).unwrap();
    let mut m = BTreeMap::new();
    e.write(&[put(b"K", b"first")], Cond::None).unwrap();
    e.write(&[BatchOp::Delete { key: b"K".to_vec() }], Cond::None).unwrap();
    let seg = segment_of(&e, newest_loc(&e, b"K"));
    fill_until_sealed(&e, seg, &mut m);
    move_all_cold(&e);
    assert!(e.inner.index.newest_seq(b"K").is_none(), "the delete did not move: {:?}", e.stats().design);
    e.write(&[put(b"K", b"second")], Cond::None).unwrap();
    m.insert(b"K".to_vec(), b"second".to_vec());
    move_all_cold(&e);
    assert!(e.inner.index.newest_seq(b"K").is_none(), "the second put did not move");
    // A key that stays in PM, so the checkpoint has an entry (and its use shows).
    e.write(&[put(b"H", b"hot")], Cond::None).unwrap();
    m.insert(b"H".to_vec(), b"hot".to_vec());
    e.inner.checkpoint().unwrap();
    assert_eq!(design(&e, "checkpoint_entries"), 1);
    let relocated = design(&e, "entries_relocated");
    clean_one(&e, seg);
    assert_eq!(design(&e, "entries_relocated"), relocated + 1, "the cleaner copied more than the old delete");
    if delta {
        e.inner.checkpoint_delta().unwrap();
        assert_eq!(design(&e, "checkpoint_delta_entries"), 1, "the delta holds more than the copy");
    }
    assert_cold_model(&e, &m, "before the crash");
    drop(e);
    let fs2 = fs.crash();
    let dev2 = dev.simulate_crash_with(1, CrashModel::strict(0.5));
    let e2 = open(&one_shard_cold_opts(&dev2, &fs2), &fs2, false).unwrap();
    assert_eq!(design(&e2, "recovery_checkpoint_entries"), 1, "the checkpoint was not used");
    assert_eq!(design(&e2, "recovery_deltas"), u64::from(delta));
    assert_cold_model(&e2, &m, "after a crash: checkpoint + a tail holding the old delete");
    assert_eq!(design(&e2, "recovery_checkpoint_stale_dropped"), 1, "the rule did not drop the old delete");
    assert!(e2.check().unwrap().is_empty(), "{:?}", e2.check().unwrap());
}

/// The horizon rule's other case: a key's newest version moves to disk while a snapshot
/// keeps its slot in the index (with the older version still in its chain: nothing trimmed
/// it), a checkpoint is written (without the key: its newest version moved), and the
/// cleaner then copies the older version (it is in the chain) past the resume point.
/// After a crash that copy must not come back as the key's value.
#[test]
fn the_horizon_rule_drops_an_old_put_copied_after_a_checkpoint() {
    for delta in [false, true] {
        horizon_rule_old_put(delta);
    }
}

fn horizon_rule_old_put(delta: bool) {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&one_shard_cold_opts(&dev, &fs), &fs, true).unwrap();
    let mut m = BTreeMap::new();
    e.write(&[put(b"K", b"first")], Cond::None).unwrap();
    let seg = segment_of(&e, newest_loc(&e, b"K"));
    fill_until_sealed(&e, seg, &mut m);
    e.write(&[put(b"K", b"second")], Cond::None).unwrap();
    m.insert(b"K".to_vec(), b"second".to_vec());
    assert_eq!(chain(&e, b"K").len(), 2, "the older version was trimmed");
    let snap = e.snapshot().unwrap();
    move_all_cold(&e);
    {
        let g = epoch::pin();
        let mg = super::index::MapGuard::new();
        let slot = e.inner.index.get(b"K", &mg).expect("the slot left under the snapshot");
        let head = slot.head(&g).unwrap().seq;
        assert_eq!(slot.moved.load(Ordering::Relaxed), head, "the newest version did not move");
    }
    e.write(&[put(b"H", b"hot")], Cond::None).unwrap();
    m.insert(b"H".to_vec(), b"hot".to_vec());
    e.inner.checkpoint().unwrap();
    assert_eq!(design(&e, "checkpoint_entries"), 1);
    let relocated = design(&e, "entries_relocated");
    clean_one(&e, seg);
    assert!(design(&e, "entries_relocated") > relocated, "nothing copied");
    assert_eq!(chain(&e, b"K").len(), 2);
    if delta {
        e.inner.checkpoint_delta().unwrap();
    }
    drop(snap);
    drop(e);
    let fs2 = fs.crash();
    let dev2 = dev.simulate_crash_with(2, CrashModel::strict(0.5));
    let e2 = open(&one_shard_cold_opts(&dev2, &fs2), &fs2, false).unwrap();
    assert_eq!(design(&e2, "recovery_checkpoint_entries"), 1, "the checkpoint was not used");
    assert_eq!(design(&e2, "recovery_deltas"), u64::from(delta));
    assert_cold_model(&e2, &m, "after a crash: checkpoint + a tail holding the old put");
    assert!(design(&e2, "recovery_checkpoint_stale_dropped") >= 1);
    assert!(e2.check().unwrap().is_empty(), "{:?}", e2.check().unwrap());
}

/// Keys whose newest version is still marked unverified (loaded from a checkpoint, not
/// read since).
fn unverified_versions(e: &Native) -> usize {
    let g = epoch::pin();
    let mg = super::index::MapGuard::new();
    e.inner
        .index
        .ascending(std::ops::Bound::Unbounded, &mg)
        .unwrap()
        .filter(|(_, s)| s.head(&g).is_some_and(|v| v.unverified()))
        .count()
}

/// After an open from a checkpoint, a scan verifies each version it reads once and marks
/// it verified: a second scan (either direction) and point reads verify nothing again.
#[test]
fn a_scan_after_a_checkpoint_open_verifies_each_version_once() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&opts(&dev, &fs), &fs, true).unwrap();
    let m = churn(&e, 3);
    e.close().unwrap();
    drop(e);
    let e2 = open(&opts(&dev, &fs), &fs, false).unwrap();
    assert!(design(&e2, "recovery_checkpoint_entries") >= m.len() as u64, "the checkpoint was not used");
    assert_eq!(unverified_versions(&e2), m.len());
    assert_eq!(design(&e2, "checkpoint_versions_verified"), 0);
    let walk = |forward: bool| {
        let mut it = e2.iter().unwrap();
        let mut seen = 0;
        if forward {
            it.seek_to_first().unwrap();
        } else {
            it.seek_to_last().unwrap();
        }
        while it.valid() {
            assert_eq!(it.value().map(<[u8]>::to_vec), m.get(it.key()).cloned());
            seen += 1;
            if forward {
                it.next().unwrap();
            } else {
                it.prev().unwrap();
            }
        }
        assert_eq!(seen, m.len());
    };
    walk(false);
    assert_eq!(design(&e2, "checkpoint_versions_verified"), m.len() as u64);
    assert_eq!(unverified_versions(&e2), 0, "the scan left versions marked unverified");
    walk(true);
    assert_model(&e2, &m, "after the scans");
    assert_eq!(design(&e2, "checkpoint_versions_verified"), m.len() as u64, "later reads verified again");
}

/// A checkpoint that finds a shard busy for long (here held by the test, as a move to disk
/// holds one while its table fsyncs) holds no other shard while it waits: writes go on
/// through the other shards, and the checkpoint completes once the shard is free.
#[test]
fn a_checkpoint_waiting_for_a_busy_shard_stalls_no_writer() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = Arc::new(open(&opts(&dev, &fs), &fs, true).unwrap());
    let last = e.inner.shards.len() - 1;
    let busy = e.inner.shards[last].log.lock();
    let ckpt = {
        let e = e.clone();
        std::thread::spawn(move || e.inner.checkpoint())
    };
    while design(&e, "checkpoint_shard_retries") == 0 {
        std::thread::yield_now();
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let writer = {
        let e = e.clone();
        std::thread::spawn(move || {
            for i in 0..200u32 {
                e.write(&[put(format!("k{i:03}").as_bytes(), b"v")], Cond::None).unwrap();
            }
            let _ = tx.send(());
        })
    };
    // Not a timing bound: a checkpoint that held the other shards while it waited for this
    // one would keep the writer from ever finishing (it is released after the wait).
    let wrote = rx.recv_timeout(std::time::Duration::from_secs(30)).is_ok();
    assert!(!ckpt.is_finished(), "the checkpoint ran without the busy shard");
    drop(busy);
    writer.join().unwrap();
    ckpt.join().unwrap().unwrap();
    assert!(wrote, "writes stalled while the checkpoint waited for a busy shard");
    assert_eq!(design(&e, "checkpoints_written"), 1);
    for i in 0..200u32 {
        assert_eq!(e.get(format!("k{i:03}").as_bytes()).unwrap().as_deref(), Some(b"v".as_slice()));
    }
}

fn bk(i: u32) -> Vec<u8> {
    format!("k{i:04}").into_bytes()
}

/// The test options, with the capacity tier (`cold`: most keys move to disk) or without
/// (no DRAM bound: every key stays in PM and the index).
fn tier_opts(dev: &SimDevice, fs: &FaultFs, cold: bool) -> Options {
    let mut o = opts(dev, fs);
    if !cold {
        o.native.dram_budget = 0;
    }
    o
}

/// A store of keys k0000..k2999 (every third overwritten, every seventh deleted), closed
/// cleanly: its next open loads the checkpoint. Returns the model.
fn checkpointed_store(dev: &SimDevice, fs: &FaultFs, cold: bool) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let e = open(&tier_opts(dev, fs, cold), fs, true).unwrap();
    let mut m = BTreeMap::new();
    for i in 0..3000u32 {
        let v = format!("a{i}-").repeat(8).into_bytes();
        e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
        m.insert(bk(i), v);
    }
    for i in (0..3000u32).step_by(3) {
        let v = format!("b{i}-").repeat(5).into_bytes();
        e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
        m.insert(bk(i), v);
    }
    for i in (0..3000u32).step_by(7) {
        e.write(&[BatchOp::Delete { key: bk(i) }], Cond::None).unwrap();
        m.remove(&bk(i));
    }
    e.close().unwrap();
    assert_eq!(design(&e, "checkpoints_written"), 1);
    m
}

/// Every key's value by iterator (ascending).
fn walk_all(it: &mut crate::iter::BoxedIter) -> Vec<(Vec<u8>, Vec<u8>)> {
    use crate::iter::InternalIterator;
    let mut out = Vec::new();
    it.seek_to_first().unwrap();
    while it.valid() {
        if let Some(v) = it.value() {
            out.push((it.key().to_vec(), v.to_vec()));
        }
        it.next().unwrap();
    }
    out
}

fn loading_opts(dev: &SimDevice, fs: &FaultFs, batches: u64, cold: bool) -> (Options, Arc<crate::jobs::JobProbe>) {
    let probe = crate::jobs::JobProbe::new();
    probe.limit_loads(batches);
    let mut o = tier_opts(dev, fs, cold);
    o.job_probe = Some(probe.clone());
    (o, probe)
}

/// After a checkpoint open the index fills in the background; meanwhile (the load held
/// after its first batch of 1,024 entries) reads come from the loaded slots or the
/// checkpoint's entries, writes to keys not loaded yet start their chains with the
/// checkpoint entry (a snapshot taken before them still reads it), conditional writes see
/// keys not loaded, and an iterator waits for the load and then sees every key.
#[test]
fn a_checkpoint_open_serves_reads_and_writes_while_the_index_loads() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let mut m = checkpointed_store(&dev, &fs, false);
    let (o, probe) = loading_opts(&dev, &fs, 1, false);
    let e = Arc::new(open(&o, &fs, false).unwrap());
    assert!(
        !e.inner.index.loaded(),
        "the load ran past the batches it was allowed: {:?}",
        e.stats().design.iter().filter(|(k, _)| k.contains("recovery") || k.contains("load")).collect::<Vec<_>>()
    );
    for i in 0..3000u32 {
        assert_eq!(e.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "key {i} while loading");
    }
    assert!(
        design(&e, "index_base_reads") >= 1000,
        "reads did not come from the checkpoint entries: {:?}",
        e.stats()
            .design
            .iter()
            .filter(|(k, _)| k.contains("recovery") || k.contains("load") || k.contains("base"))
            .collect::<Vec<_>>()
    );
    let snap = e.snapshot().unwrap();
    let before = m.clone();
    for i in (0..3000u32).step_by(5) {
        let v = format!("c{i}").into_bytes();
        e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
        m.insert(bk(i), v);
    }
    for i in (1..3000u32).step_by(11) {
        e.write(&[BatchOp::Delete { key: bk(i) }], Cond::None).unwrap();
        m.remove(&bk(i));
    }
    for i in 3000..3100u32 {
        e.write(&[put(&bk(i), b"new")], Cond::None).unwrap();
        m.insert(bk(i), b"new".to_vec());
    }
    // k2998 is present (not loaded yet), k2996 was deleted before the close.
    assert!(m.contains_key(&bk(2998)) && !m.contains_key(&bk(2996)));
    assert!(!e.write(&[put(&bk(2998), b"x")], Cond::Absent).unwrap(), "an unloaded key looked absent");
    assert!(e.write(&[put(&bk(2996), b"y")], Cond::Absent).unwrap(), "a deleted key looked present");
    m.insert(bk(2996), b"y".to_vec());
    assert!(!e.inner.index.loaded());
    // A key not loaded and overwritten: its chain holds the new version over the
    // checkpoint's.
    assert_eq!(chain(&e, &bk(2995)).len(), 2, "the overwrite of an unloaded key lost its older version");
    for i in 0..3100u32 {
        assert_eq!(e.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "key {i} after writes while loading");
        assert_eq!(snap.get(&bk(i)).unwrap(), before.get(&bk(i)).cloned(), "key {i} in the snapshot");
    }
    // An iterator started now waits for the load (released once it waits) and sees every
    // key.
    let waits = e.inner.index.load_waits.load(Ordering::Relaxed);
    let walker = {
        let e = e.clone();
        std::thread::spawn(move || walk_all(&mut e.iter().unwrap()))
    };
    let t = std::time::Instant::now();
    while e.inner.index.load_waits.load(Ordering::Relaxed) == waits {
        assert!(t.elapsed() < std::time::Duration::from_secs(60), "the iterator did not wait for the load");
        std::thread::yield_now();
    }
    probe.limit_loads(u64::MAX);
    let walked = walker.join().unwrap();
    assert_eq!(walked, m.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<Vec<_>>());
    assert!(e.inner.index.loaded());
    // The load's time is recorded just after it publishes its end (which let the walk
    // finish), so it may lag the walk by a moment.
    let t = std::time::Instant::now();
    while design(&e, "index_load_us") == 0 {
        assert!(t.elapsed() < std::time::Duration::from_secs(60), "the load's time was never recorded");
        std::thread::yield_now();
    }
    // The load skipped the keys writers had made slots for.
    let loaded = design(&e, "index_load_slots");
    assert!(loaded > 1000 && loaded < 2571, "the load made {loaded} slots");
    assert_eq!(
        walk_all(&mut snap.iter().unwrap()),
        before.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<Vec<_>>()
    );
    assert!(e.check().unwrap().is_empty());
    drop(snap);
    e.close().unwrap();
    drop(e);
    let e2 = open(&tier_opts(&dev, &fs, false), &fs, false).unwrap();
    e2.inner.index.wait_loaded().unwrap();
    for i in 0..3100u32 {
        assert_eq!(e2.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "key {i} after a clean reopen");
    }
    assert!(e2.check().unwrap().is_empty());
}

/// A crash leaves a log tail. The open inserts none of it into the maps itself: the tail's
/// winners become the base of the background load, beside the checkpoint's entries (or
/// alone, in a store that has no checkpoint). With the load held after one batch the
/// store serves every key from them (the tail's overwrites and deletes of checkpoint keys
/// included), a write to an unloaded tail key chains over its tail version, a conditional
/// write sees it, a crash while loading loses nothing, and once the load is released a walk
/// sees every key. With the capacity tier too (moved entries in the tail).
#[test]
fn a_crash_open_loads_the_log_tail_in_the_background() {
    for (with_ckpt, cold) in [(true, false), (false, false), (true, true)] {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let mut m = if with_ckpt { checkpointed_store(&dev, &fs, cold) } else { BTreeMap::new() };
        let e = open(&tier_opts(&dev, &fs, cold), &fs, !with_ckpt).unwrap();
        e.inner.index.wait_loaded().unwrap();
        for i in (0..4000u32).step_by(2) {
            let v = format!("t{i}").into_bytes();
            e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
            m.insert(bk(i), v);
        }
        for i in (1..4000u32).step_by(9) {
            e.write(&[BatchOp::Delete { key: bk(i) }], Cond::None).unwrap();
            m.remove(&bk(i));
        }
        drop(e);
        let dev = dev.simulate_crash_with(5, CrashModel::strict(0.5));
        let (o, probe) = loading_opts(&dev, &fs, 1, cold);
        let e = Arc::new(open(&o, &fs, false).unwrap());
        let tag = format!("checkpoint: {with_ckpt}, cold: {cold}");
        assert!(design(&e, "replayed_bytes") > 0, "{tag}: no tail was replayed");
        assert!(!e.inner.index.loaded(), "{tag}: the load ran past the batch it was allowed");
        if !cold {
            // One batch of the load at most: the open itself made no slot.
            assert!(e.inner.index.slots() <= 1024, "{tag}: {} slots before the load", e.inner.index.slots());
        }
        for i in 0..4000u32 {
            assert_eq!(e.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "{tag}: key {i} while loading");
        }
        if !cold {
            // Every key the one batch did not load (the batch may run before or after
            // these reads) is read from the base.
            let unloaded = m.len() as u64 - 1024;
            assert!(design(&e, "index_base_reads") >= unloaded, "{tag}: reads did not come from the base");
        }
        let snap = e.snapshot().unwrap();
        let before = m.clone();
        // k3996 was put by the tail, sorts after the first batch, and is overwritten now.
        assert_eq!(m.get(&bk(3996)), Some(&b"t3996".to_vec()));
        for i in (0..4000u32).step_by(6) {
            let v = format!("w{i}").into_bytes();
            e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
            m.insert(bk(i), v);
        }
        if !cold {
            assert_eq!(chain(&e, &bk(3996)).len(), 2, "{tag}: the overwrite of an unloaded tail key lost its version");
        }
        assert!(m.contains_key(&bk(3998)), "{tag}");
        assert!(!e.write(&[put(&bk(3998), b"x")], Cond::Absent).unwrap(), "{tag}: an unloaded tail key looked absent");
        for i in 0..4000u32 {
            assert_eq!(e.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "{tag}: key {i} after writes while loading");
            assert_eq!(snap.get(&bk(i)).unwrap(), before.get(&bk(i)).cloned(), "{tag}: key {i} in the snapshot");
        }
        drop(snap);
        // A crash while loading: the next open replays it all again.
        let e = Arc::try_unwrap(e).unwrap_or_else(|_| panic!("{tag}: the engine is still shared"));
        drop(e);
        let dev = dev.simulate_crash_with(6, CrashModel::strict(0.5));
        let (o, probe2) = loading_opts(&dev, &fs, 1, cold);
        drop(probe);
        let e = open(&o, &fs, false).unwrap();
        for i in 0..4000u32 {
            assert_eq!(e.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "{tag}: key {i} after a crash while loading");
        }
        probe2.limit_loads(u64::MAX);
        e.inner.index.wait_loaded().unwrap();
        assert_eq!(
            walk_all(&mut e.iter().unwrap()),
            m.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<Vec<_>>(),
            "{tag}: the walk after the load"
        );
        assert!(e.check().unwrap().is_empty(), "{tag}");
        e.close().unwrap();
    }
}

/// A close (or a crash) before the background load finished: the close writes no
/// checkpoint (the one loaded stays, byte for byte) and the next open replays the
/// records written since; nothing is lost. With and without keys on disk (the capacity
/// tier: deletes in the checkpoint then hide disk entries).
#[test]
fn a_close_or_crash_during_the_background_load_loses_nothing() {
    for (crash, cold) in [(false, false), (true, false), (false, true), (true, true)] {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let mut m = checkpointed_store(&dev, &fs, cold);
        let ckpt_file = super::checkpoint::Checkpoints::path(std::path::Path::new("/db"));
        let ckpt_before = crate::fs::Fs::read_all(&fs, &ckpt_file).unwrap();
        let (o, probe) = loading_opts(&dev, &fs, 0, cold);
        let e = open(&o, &fs, false).unwrap();
        for i in (0..3000u32).step_by(4) {
            let v = format!("d{i}").into_bytes();
            e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
            m.insert(bk(i), v);
        }
        for i in (2..3000u32).step_by(13) {
            e.write(&[BatchOp::Delete { key: bk(i) }], Cond::None).unwrap();
            m.remove(&bk(i));
        }
        assert!(!e.inner.index.loaded());
        let dev = if crash {
            drop(e);
            dev.simulate_crash_with(5, CrashModel::strict(0.5))
        } else {
            e.close().unwrap();
            assert_eq!(probe.jobs_cancelled(), 0);
            assert!(!e.inner.index.loaded(), "the load finished although the close stopped it");
            assert_eq!(design(&e, "checkpoints_written"), 0);
            dev
        };
        let ckpt_after = crate::fs::Fs::read_all(&fs, &ckpt_file).unwrap();
        assert!(ckpt_before == ckpt_after, "the checkpoint changed (crash: {crash}, cold: {cold})");
        let e2 = open(&tier_opts(&dev, &fs, cold), &fs, false).unwrap();
        assert!(design(&e2, "replayed_bytes") > 0, "the records written during the load were not replayed");
        for i in 0..3000u32 {
            assert_eq!(e2.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "key {i} (crash: {crash}, cold: {cold})");
        }
        e2.inner.index.wait_loaded().unwrap();
        assert!(e2.check().unwrap().is_empty());
    }
}

/// A close during the background load, once the log since the loaded checkpoint reached
/// `checkpoint_bytes`, lets the load finish and writes a checkpoint (repeated short
/// sessions would otherwise replay an ever longer tail); the next open replays nothing.
#[test]
fn a_close_during_the_load_with_a_long_tail_finishes_it_and_writes_a_checkpoint() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let mut m = checkpointed_store(&dev, &fs, false);
    let (mut o, probe) = loading_opts(&dev, &fs, 0, false);
    o.native.checkpoint_bytes = 1;
    let e = open(&o, &fs, false).unwrap();
    for i in (0..3000u32).step_by(9) {
        let v = format!("e{i}").into_bytes();
        e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
        m.insert(bk(i), v);
    }
    assert!(!e.inner.index.loaded());
    let e = Arc::new(e);
    // The load is released only once the close waits for it.
    let waits = e.inner.index.load_waits.load(Ordering::Relaxed);
    let closer = {
        let e = e.clone();
        std::thread::spawn(move || e.close())
    };
    let t = std::time::Instant::now();
    while e.inner.index.load_waits.load(Ordering::Relaxed) == waits {
        assert!(t.elapsed() < std::time::Duration::from_secs(60), "the close did not wait for the load");
        std::thread::yield_now();
    }
    probe.limit_loads(u64::MAX);
    closer.join().unwrap().unwrap();
    assert!(e.inner.index.loaded(), "the close stopped the load");
    assert_eq!(design(&e, "checkpoints_written"), 1);
    drop(e);
    let e2 = open(&tier_opts(&dev, &fs, false), &fs, false).unwrap();
    assert_eq!(design(&e2, "replayed_bytes"), 0, "the close's checkpoint did not cover the session");
    for i in 0..3000u32 {
        assert_eq!(e2.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "key {i}");
    }
}

/// A walk over versions this process wrote reads no log entry in PM (the version's entry
/// size places the value); `value()` reads the bytes it is asked for, and they are the
/// values written. After a reopen from an index checkpoint the loaded versions are
/// unverified, so the first walk reads and verifies their entries, and the next reads
/// none again. (PM reads are counted by the emulated read latency, 1 ns per access.)
#[test]
fn walks_read_no_log_entry_for_versions_this_process_wrote_or_verified() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let mut o = opts(&dev, &fs);
    o.pm_read_latency_ns = 1;
    // Every key stays in PM (no capacity-tier moves to count around).
    o.native.dram_budget = 0;
    let e = open(&o, &fs, true).unwrap();
    let m = put_keys(&e, 300);
    let reads = |e: &Native| e.inner.region.stats().delayed_reads;
    let keys_only = |e: &Native| {
        let mut it = e.iter().unwrap();
        it.seek_to_first().unwrap();
        let mut n = 0;
        while it.valid() {
            assert!(m.contains_key(it.key()));
            n += 1;
            it.next().unwrap();
        }
        assert_eq!(n, m.len());
    };
    let before = reads(&e);
    keys_only(&e);
    assert_eq!(reads(&e), before, "a key-only walk read PM");
    let mut it = e.iter().unwrap();
    it.seek_to_first().unwrap();
    for (k, v) in &m {
        assert_eq!((it.key(), it.value()), (k.as_slice(), Some(v.as_slice())));
        it.next().unwrap();
    }
    assert!(!it.valid());
    drop(it);
    assert_eq!(reads(&e), before + m.len() as u64, "one PM read per value asked for");

    // A clean close writes an index checkpoint; the reopen loads it (versions unverified).
    e.close().unwrap();
    drop(e);
    let e = open(&o, &fs, false).unwrap();
    let before = reads(&e);
    keys_only(&e);
    let first = reads(&e) - before;
    assert!(first >= m.len() as u64, "the first walk after the reopen verified the entries ({first} reads)");
    assert_eq!(design(&e, "checkpoint_versions_verified"), m.len() as u64);
    let before = reads(&e);
    keys_only(&e);
    assert_eq!(reads(&e), before, "the second walk read PM");
}

/// Put `key0000`, `key0001`, ... (`n` keys, one write each); returns the model.
fn put_keys(e: &Native, n: u32) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut m = BTreeMap::new();
    for i in 0..n {
        let (k, v) = (format!("key{i:04}").into_bytes(), val(0, i as usize, i));
        e.write(&[put(&k, &v)], Cond::None).unwrap();
        m.insert(k, v);
    }
    m
}

/// A checkpoint entry whose size disagrees with the log entry it names (its checksums
/// valid: a writer bug, not media damage) is reported as corruption by reads and walks
/// alike, and is never marked verified: a walk would otherwise place a value from the
/// wrong size and return bytes that are not the value.
#[test]
fn a_checkpoint_version_whose_size_disagrees_with_its_log_entry_is_reported_never_placed() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let mut o = opts(&dev, &fs);
    o.native.dram_budget = 0;
    let e = open(&o, &fs, true).unwrap();
    let mut m = put_keys(&e, 50);
    let (shards, db_id) = (e.inner.shards.len(), e.inner.db_id);
    e.close().unwrap();
    drop(e);
    // Re-encode the checkpoint with key0010's entry 8 bytes longer than its log entry
    // (checksums valid), through the format's own encoder; same length, written in place.
    use super::checkpoint::{decode, encode_entry, encode_trailer, FILE_NAME};
    let path = std::path::Path::new("/db").join(FILE_NAME);
    let buf = crate::fs::Fs::read_all(&fs, &path).unwrap();
    let d = decode(&buf, shards, db_id).unwrap();
    let mut body = Vec::new();
    for &(k, seq, loc, size, tomb) in &d.entries {
        encode_entry(&mut body, k, seq, loc, if k == b"key0010" { size + 8 } else { size }, tomb);
    }
    let mut out = d.header.encode();
    out.extend_from_slice(&body);
    out.extend_from_slice(&encode_trailer(d.entries.len() as u64, crc32c::crc32c(&body)));
    assert_eq!((out.len(), d.entries.len()), (buf.len(), 50));
    fs.poke(&path, 0, &out).unwrap();

    let e = open(&o, &fs, false).unwrap();
    assert_eq!(design(&e, "recovery_checkpoint_entries"), 50, "the rewritten checkpoint was loaded");
    let walk = |e: &Native, m: &BTreeMap<Vec<u8>, Vec<u8>>| {
        let mut it = e.iter().unwrap();
        let mut r = it.seek_to_first();
        while r.is_ok() && it.valid() {
            assert_eq!(it.value(), m.get(it.key()).map(Vec::as_slice), "a walk returned a wrong value");
            r = it.next();
        }
        r
    };
    let reported = |e: &Native, m: &BTreeMap<Vec<u8>, Vec<u8>>, ctx: &str| {
        for round in 0..2 {
            assert!(
                matches!(walk(e, m), Err(crate::Error::Corruption { .. })),
                "{ctx} {round}: the walk passed the entry"
            );
            assert!(
                matches!(e.get(b"key0010"), Err(crate::Error::Corruption { .. })),
                "{ctx} {round}: a point read trusted the version's size"
            );
        }
        for (k, v) in m.iter().filter(|(k, _)| k.as_slice() != b"key0010") {
            assert_eq!(e.get(k).unwrap().as_deref(), Some(v.as_slice()), "{ctx}");
        }
    };
    reported(&e, &m, "after the open");
    // The log cleaner copies the entry forward once every other key is overwritten (its
    // segments then mostly dead); the copy's length is the log entry's, not the version's,
    // so the relocated version is not marked verified either.
    let loc = |e: &Native| {
        let (g, mg) = (epoch::pin(), super::index::MapGuard::new());
        e.inner.index.get(b"key0010", &mg).and_then(|s| s.head(&g).map(|v| v.loc()))
    };
    let before = loc(&e);
    for r in 1..7u32 {
        for (i, (k, v)) in m.iter_mut().enumerate().filter(|(_, (k, _))| k.as_slice() != b"key0010") {
            *v = val(1, i, r);
            e.write(&[put(k, v)], Cond::None).unwrap();
        }
    }
    e.compact().unwrap();
    assert!(design(&e, "entries_relocated") > 0 && loc(&e) != before, "the cleaner did not move key0010's entry");
    reported(&e, &m, "after cleaning");
}

/// Delta files in the test store's directory, by id.
fn delta_ids(fs: &FaultFs) -> Vec<u64> {
    super::delta::list(fs, std::path::Path::new("/db")).unwrap()
}

/// Incremental checkpoints: after a full checkpoint, deltas cover the log written since;
/// after a crash the open loads the checkpoint and the chain of deltas and replays only
/// the log after the chain's end. The reopened store continues the chain (a delta from
/// where the loaded chain ends), and a second crash recovers through all of it.
#[test]
fn deltas_bound_the_log_replayed_after_a_crash() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let o = tier_opts(&dev, &fs, false);
    let e = open(&o, &fs, true).unwrap();
    let mut m = BTreeMap::new();
    let write_round = |e: &Native, r: u32, m: &mut BTreeMap<Vec<u8>, Vec<u8>>| {
        for i in (r % 3..2000u32).step_by(3) {
            let v = format!("r{r}-{i}-").repeat(6).into_bytes();
            e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
            m.insert(bk(i), v);
        }
        for i in (r..2000u32).step_by(11) {
            e.write(&[BatchOp::Delete { key: bk(i) }], Cond::None).unwrap();
            m.remove(&bk(i));
        }
    };
    write_round(&e, 0, &mut m);
    e.inner.checkpoint().unwrap();
    let mut written_after = 0u64;
    for r in 1..=3 {
        let before = e.inner.counters.get(super::C_USER_BYTES);
        write_round(&e, r, &mut m);
        written_after += e.inner.counters.get(super::C_USER_BYTES) - before;
        e.inner.checkpoint_delta().unwrap();
        assert_eq!(design(&e, "checkpoint_deltas_written"), u64::from(r));
        assert!(design(&e, "checkpoint_delta_entries") > 0);
    }
    assert_eq!(delta_ids(&fs), vec![1, 2, 3]);
    // A short tail after the chain.
    for i in 0..50u32 {
        e.write(&[put(&bk(i), b"tail")], Cond::None).unwrap();
        m.insert(bk(i), b"tail".to_vec());
    }
    drop(e);
    let fs2 = fs.crash();
    let dev2 = dev.simulate_crash_with(11, CrashModel::strict(0.5));
    let e2 = open(&tier_opts(&dev2, &fs2, false), &fs2, false).unwrap();
    assert_eq!(design(&e2, "recovery_deltas"), 3, "rejected: {:?}", e2.inner.ckpt.delta_rejected);
    assert!(design(&e2, "recovery_delta_entries") > 0);
    assert!(
        design(&e2, "replayed_bytes") < written_after / 4,
        "replayed {} bytes; {written_after} were written after the checkpoint",
        design(&e2, "replayed_bytes")
    );
    let all: Vec<_> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    assert!(walk_all(&mut e2.iter().unwrap()) == all, "the walk after a chain open differs from the model");
    for i in 0..2000u32 {
        assert_eq!(e2.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "key {i}");
    }
    assert!(e2.check().unwrap().is_empty(), "{:?}", e2.check().unwrap());
    // The reopened store continues the chain from where it ended.
    write_round(&e2, 4, &mut m);
    e2.inner.checkpoint_delta().unwrap();
    assert_eq!(delta_ids(&fs2), vec![1, 2, 3, 4]);
    write_round(&e2, 5, &mut m);
    drop(e2);
    let fs3 = fs2.crash();
    let dev3 = dev2.simulate_crash_with(12, CrashModel::strict(0.5));
    let e3 = open(&tier_opts(&dev3, &fs3, false), &fs3, false).unwrap();
    assert_eq!(design(&e3, "recovery_deltas"), 4);
    for i in 0..2000u32 {
        assert_eq!(e3.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "second crash: key {i}");
    }
    assert!(e3.check().unwrap().is_empty());
    // A full checkpoint starts a new chain and removes the old one's files.
    e3.inner.checkpoint().unwrap();
    assert!(delta_ids(&fs3).is_empty());
}

/// The background rounds: a round without a full checkpoint to build on writes one; then
/// deltas, a full checkpoint every `ROUNDS_PER_FULL`-th round (removing the old chain).
#[test]
fn rounds_write_deltas_and_a_full_checkpoint_every_eighth() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&tier_opts(&dev, &fs, false), &fs, true).unwrap();
    let rounds = super::delta::ROUNDS_PER_FULL;
    for r in 0..=rounds {
        for i in 0..100u32 {
            e.write(&[put(&bk(i + 100 * r as u32), b"v")], Cond::None).unwrap();
        }
        e.inner.checkpoint_round().unwrap();
        let (full, deltas) = (design(&e, "checkpoints_written"), design(&e, "checkpoint_deltas_written"));
        match r {
            0 => assert_eq!((full, deltas), (1, 0), "no base: a full checkpoint"),
            r if r < rounds => assert_eq!((full, deltas), (1, r), "round {r}"),
            _ => assert_eq!((full, deltas), (2, rounds - 1), "round {r}: the chain is long enough"),
        }
        let files = delta_ids(&fs).len() as u64;
        assert_eq!(files, if r == rounds { 0 } else { r }, "round {r}: delta files");
    }
}

/// A damaged delta: the open uses the chain up to it, replays the logs from there, and
/// removes it and every delta after it before the store takes a write.
#[test]
fn a_damaged_delta_cuts_the_chain_and_the_logs_recover_the_rest() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&tier_opts(&dev, &fs, false), &fs, true).unwrap();
    let mut m = BTreeMap::new();
    for r in 0..4u32 {
        for i in (r..900u32).step_by(2) {
            let v = format!("d{r}-{i}").into_bytes();
            e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
            m.insert(bk(i), v);
        }
        e.write(&[BatchOp::Delete { key: bk(r * 7) }], Cond::None).unwrap();
        m.remove(&bk(r * 7));
        if r == 0 {
            e.inner.checkpoint().unwrap();
        } else {
            e.inner.checkpoint_delta().unwrap();
        }
    }
    drop(e);
    let path = std::path::Path::new("/db").join(super::delta::file_name(2));
    let len = crate::fs::Fs::read_all(&fs, &path).unwrap().len();
    fs.poke(&path, len / 2, &[0xff, 0x00, 0xee]).unwrap();
    let dev2 = dev.simulate_crash_with(3, CrashModel::strict(0.5));
    let e2 = open(&tier_opts(&dev2, &fs, false), &fs, false).unwrap();
    assert_eq!(
        design(&e2, "recovery_deltas"),
        1,
        "the chain up to the damaged delta: {:?}",
        e2.inner.ckpt.delta_rejected
    );
    assert_eq!(design(&e2, "recovery_delta_rejected"), 1);
    assert!(e2.inner.ckpt.delta_rejected.as_deref().unwrap_or("").contains("checksum"));
    assert_eq!(delta_ids(&fs), vec![1], "the damaged delta and the one after it are removed");
    for i in 0..900u32 {
        assert_eq!(e2.get(&bk(i)).unwrap(), m.get(&bk(i)).cloned(), "key {i}");
    }
    assert!(e2.check().unwrap().is_empty());
}

/// Random histories of puts, deletes, snapshots held across moves to disk and cleaning
/// (so the cleaner copies old versions and deletes past checkpoints and deltas), full
/// checkpoints, deltas and background-style rounds, then a crash: the open (checkpoint,
/// chain, tail) reads exactly the model through `get` and an ordered walk, and `check`
/// is clean.
#[test]
fn random_histories_with_deltas_recover_exactly() {
    use rand::{Rng, SeedableRng};
    let mut chains = 0;
    for seed in 0..10u64 {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let o = cold_opts(&dev, &fs, 150);
        let e = open(&o, &fs, true).unwrap();
        let mut m = BTreeMap::new();
        let mut snaps = Vec::new();
        for step in 0..60u32 {
            match rng.random_range(0..12u32) {
                0..=5 => {
                    for _ in 0..rng.random_range(1..80u32) {
                        let i = rng.random_range(0..400u32);
                        if rng.random_bool(0.15) {
                            e.write(&[BatchOp::Delete { key: ck(i) }], Cond::None).unwrap();
                            m.remove(&ck(i));
                        } else {
                            e.write(&[put(&ck(i), &cv(i, step))], Cond::None).unwrap();
                            m.insert(ck(i), cv(i, step));
                        }
                    }
                }
                6 => {
                    if snaps.len() < 2 && rng.random_bool(0.6) {
                        snaps.push(e.snapshot().unwrap());
                    } else if !snaps.is_empty() {
                        snaps.remove(0);
                    }
                }
                7 | 8 => {
                    e.inner.publish();
                    let (_, mut log) = e.inner.acquire_shard();
                    e.inner.move_cold(&mut log, true, true).unwrap();
                    e.inner.clean(&mut log, usize::MAX).unwrap();
                }
                9 => e.inner.checkpoint_round().unwrap(),
                10 => e.inner.checkpoint_delta().unwrap(),
                _ => {
                    if rng.random_bool(0.3) {
                        e.inner.checkpoint().unwrap();
                    }
                }
            }
        }
        drop(snaps);
        let ctx = format!("seed {seed}");
        assert_cold_model(&e, &m, &format!("{ctx}: before the crash"));
        drop(e);
        let fs2 = fs.crash();
        let dev2 = dev.simulate_crash_with(seed, CrashModel::strict(0.5));
        let e2 = open(&cold_opts(&dev2, &fs2, 150), &fs2, false).unwrap();
        assert_eq!(design(&e2, "recovery_delta_rejected"), 0, "{ctx}: {:?}", e2.inner.ckpt.delta_rejected);
        assert_eq!(design(&e2, "recovery_checkpoint_rejected"), 0, "{ctx}: {:?}", e2.inner.ckpt.rejected);
        chains += u64::from(design(&e2, "recovery_deltas") > 0);
        assert_cold_model(&e2, &m, &format!("{ctx}: after the crash"));
        assert!(e2.check().unwrap().is_empty(), "{ctx}: {:?}", e2.check().unwrap());
    }
    assert!(chains >= 5, "only {chains} of the runs recovered through a chain of deltas");
}

/// Deltas written while four writers go on (and clean the log as they go, so segments
/// of a delta's stretch are retired while the round reads it): after a crash, every
/// acknowledged write is there.
#[test]
fn deltas_written_under_concurrent_writers_recover_every_acknowledged_write() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = Arc::new(open(&opts(&dev, &fs), &fs, true).unwrap());
    let last = under_four_writers(&e, 8, |e| e.inner.checkpoint_round());
    assert_eq!(design(&e, "checkpoints_written"), 1);
    assert_eq!(design(&e, "checkpoint_deltas_written"), 7);
    assert!(design(&e, "segments_cleaned") > 0, "writers never cleaned: {:?}", e.stats().design);
    drop(e);
    let dev2 = dev.simulate_crash_with(2, CrashModel::strict(0.5));
    let e2 = open(&opts(&dev2, &fs), &fs, false).unwrap();
    assert!(design(&e2, "recovery_checkpoint_entries") > 0, "checkpoint not used: {:?}", e2.inner.ckpt.rejected);
    assert_eq!(design(&e2, "recovery_deltas"), 7, "chain not used: {:?}", e2.inner.ckpt.delta_rejected);
    assert_acknowledged(&e2, &last);
}

/// A one-shard store (no DRAM bound) with a full checkpoint, then two deltas over a round
/// of overwrites each, then a crash that keeps every acknowledged write: returns the
/// options, the crashed device and file system, and the model.
fn store_with_two_deltas(salt: u64) -> (Options, SimDevice, FaultFs, BTreeMap<Vec<u8>, Vec<u8>>) {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let native = NativeOptions { shards: 1, dram_budget: 0, ..crate::testing::native_small() };
    let e = open(&opts(&dev, &fs).native(native.clone()), &fs, true).unwrap();
    let mut m = BTreeMap::new();
    for r in 0..3u32 {
        for i in (r..300u32).step_by(r as usize + 1) {
            let v = format!("{salt}-r{r}-{i}").into_bytes();
            e.write(&[put(&bk(i), &v)], Cond::None).unwrap();
            m.insert(bk(i), v);
        }
        if r == 0 {
            e.inner.checkpoint().unwrap();
        } else {
            e.inner.checkpoint_delta().unwrap();
        }
    }
    assert_eq!(delta_ids(&fs), vec![1, 2]);
    drop(e);
    let (fs2, dev2) = (fs.crash(), dev.simulate_crash_with(salt, CrashModel::strict(0.0)));
    (opts(&dev2, &fs2).native(native), dev2, fs2, m)
}

/// Rewrite delta `id` (checksums valid, through the format's own encoders) after `f`
/// changed its header or entries.
fn rewrite_delta(
    fs: &FaultFs,
    id: u64,
    f: impl FnOnce(&mut super::delta::Header, &mut Vec<(Vec<u8>, u64, u64, u32, u8)>),
) {
    let path = std::path::Path::new("/db").join(super::delta::file_name(id));
    let buf = crate::fs::Fs::read_all(fs, &path).unwrap();
    let shards = u32::from_le_bytes(buf[12..16].try_into().unwrap()) as usize;
    let db_id = u64::from_le_bytes(buf[16..24].try_into().unwrap());
    let (mut h, raw) = super::delta::decode(&buf, shards, db_id).unwrap();
    let mut entries: Vec<_> = raw.iter().map(|e| (e.0.to_vec(), e.1, e.2, e.3, e.4)).collect();
    f(&mut h, &mut entries);
    let mut body = Vec::new();
    for (k, seq, loc, size, flags) in &entries {
        super::checkpoint::encode_entry_flags(&mut body, k, *seq, *loc, *size, *flags);
    }
    let mut out = h.encode();
    out.extend_from_slice(&body);
    out.extend_from_slice(&super::checkpoint::encode_trailer(entries.len() as u64, crc32c::crc32c(&body)));
    assert_eq!(out.len(), buf.len(), "the rewrite must keep the file's length");
    fs.poke(&path, 0, &out).unwrap();
}

/// Every key of the model reads back, and an ordered walk returns exactly the model.
fn assert_reads_model(e: &Native, m: &BTreeMap<Vec<u8>, Vec<u8>>, ctx: &str) {
    for (k, v) in m {
        assert_eq!(e.get(k).unwrap().as_deref(), Some(v.as_slice()), "{ctx}: key {}", crate::escape(k));
    }
    let all: Vec<_> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    assert!(walk_all(&mut e.iter().unwrap()) == all, "{ctx}: the walk differs from the model");
    assert!(e.check().unwrap().is_empty(), "{ctx}: {:?}", e.check().unwrap());
}

/// An open takes a delta's entries unverified (their records are not replayed): a value
/// damaged in PM after the delta listed it is reported as corruption at its first read,
/// by `get`, by a walk and by `check`, never returned.
#[test]
fn a_damaged_value_a_delta_lists_is_reported_at_its_first_read() {
    let (o, dev, fs, m) = store_with_two_deltas(1);
    // bk(2)'s newest version was written in round 2: the second delta lists it.
    let e = open(&o, &fs, false).unwrap();
    assert_eq!(design(&e, "recovery_deltas"), 2, "{:?}", e.inner.ckpt.delta_rejected);
    assert_eq!(design(&e, "replayed_bytes"), 0, "the logs after the chain's end are empty");
    e.inner.index.wait_loaded().unwrap();
    let loc = newest_loc(&e, &bk(2));
    drop(e);
    let v = &m[&bk(2)];
    // The last byte of the value: inside the entry, covered by its checksum.
    let at = loc + (super::layout::ENTRY_HEADER_LEN + bk(2).len() + v.len() - 1) as u64;
    let (pool, off) = ((at / o.pm_pool_size) as usize, (at % o.pm_pool_size) as usize);
    let dev2 = dev.simulate_crash_with(0, CrashModel::strict(0.0));
    let old = dev2.durable_image(pool).unwrap()[off];
    assert!(dev2.poke(pool, off, &[old ^ 0x40]));
    let fs2 = fs.crash();
    let e2 = open(&opts(&dev2, &fs2).native(o.native.clone()), &fs2, false).unwrap();
    assert_eq!(design(&e2, "recovery_deltas"), 2, "the damage is not seen at the open");
    for round in 0..2 {
        let err = e2.get(&bk(2)).expect_err("a damaged value was returned");
        assert!(err.is_corruption(), "read {round}: {err}");
    }
    let mut it = e2.iter().unwrap();
    assert!(it.seek_to_first().is_err(), "a walk returned a damaged value");
    drop(it);
    assert!(!e2.check().unwrap().is_empty(), "check missed the damaged value");
    for (k, v) in m.iter().filter(|(k, _)| **k != bk(2)) {
        assert_eq!(e2.get(k).unwrap().as_deref(), Some(v.as_slice()));
    }
}

/// A chain whose end does not fit the logs (its last delta names another segment as
/// where to resume): the open drops the chain, loads the checkpoint alone, replays the
/// logs after it, and removes every delta file before the store takes a write.
#[test]
fn a_chain_whose_end_does_not_fit_the_logs_is_dropped_for_the_checkpoint_alone() {
    let (o, _dev, fs, m) = store_with_two_deltas(2);
    rewrite_delta(&fs, 2, |h, _| {
        let (salt, len) = h.to.resume[0].seg.expect("the shard's segment is open");
        h.to.resume[0].seg = Some((salt ^ 1, len));
    });
    let e = open(&o, &fs, false).unwrap();
    let why = e.inner.ckpt.delta_rejected.clone().unwrap_or_default();
    assert!(why.contains("another segment"), "{why}");
    assert_eq!(design(&e, "recovery_deltas"), 0);
    assert_eq!(design(&e, "recovery_delta_rejected"), 1);
    assert_eq!(design(&e, "recovery_checkpoint_rejected"), 0, "{:?}", e.inner.ckpt.rejected);
    assert_eq!(design(&e, "recovery_checkpoint_entries"), 300, "the checkpoint was used");
    assert!(design(&e, "replayed_bytes") > 0, "the logs after the checkpoint were replayed");
    assert!(delta_ids(&fs).is_empty(), "the chain's files are removed");
    assert_reads_model(&e, &m, "checkpoint alone");
}

/// A delta entry that wins but lies outside every segment's records (a delta of another
/// state of the logs): the open drops the chain for the checkpoint alone, as above.
#[test]
fn a_winning_delta_entry_outside_every_segment_drops_the_chain() {
    let (o, _dev, fs, m) = store_with_two_deltas(3);
    let beyond = o.pm_pool_size * 64;
    rewrite_delta(&fs, 1, |_, entries| entries[0].2 = beyond);
    let e = open(&o, &fs, false).unwrap();
    let why = e.inner.ckpt.delta_rejected.clone().unwrap_or_default();
    assert!(why.contains("outside every segment"), "{why}");
    assert_eq!(design(&e, "recovery_deltas"), 0);
    assert_eq!(design(&e, "recovery_checkpoint_entries"), 300, "the checkpoint was used");
    assert!(delta_ids(&fs).is_empty());
    assert_reads_model(&e, &m, "checkpoint alone");
}

/// A round with nothing appended since the chain's end writes no delta (two deltas from
/// one point would make the chain ambiguous) and does not count toward the full one.
#[test]
fn a_round_with_nothing_appended_writes_nothing() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let e = open(&tier_opts(&dev, &fs, false), &fs, true).unwrap();
    e.write(&[put(b"a", b"1")], Cond::None).unwrap();
    e.inner.checkpoint_round().unwrap();
    assert_eq!(design(&e, "checkpoints_written"), 1);
    e.write(&[put(b"b", b"2")], Cond::None).unwrap();
    e.inner.checkpoint_round().unwrap();
    for _ in 0..2 * super::delta::ROUNDS_PER_FULL {
        e.inner.checkpoint_round().unwrap();
        e.inner.checkpoint_delta().unwrap();
    }
    assert_eq!((design(&e, "checkpoints_written"), design(&e, "checkpoint_deltas_written")), (1, 1));
    assert_eq!(delta_ids(&fs), vec![1]);
    e.write(&[put(b"c", b"3")], Cond::None).unwrap();
    e.inner.checkpoint_round().unwrap();
    assert_eq!(delta_ids(&fs), vec![1, 2], "a write since: the next round writes a delta");
}
