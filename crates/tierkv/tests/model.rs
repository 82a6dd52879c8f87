//! Random operation sequences (put, delete, batch, conditional writes, get, scan, seek,
//! flush, clean reopen, crash) against a `BTreeMap`, for every preset.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::ops::Bound;

use common::*;
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Preset};

fn run(preset: Preset, seed: u64, steps: usize) {
    let mut dev = SimDevice::new();
    let mut fs = FaultFs::new();
    let mut db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
    let mut m = Model::new();
    for (i, step) in workload(seed, steps, 300, true).iter().enumerate() {
        let ctx = format!("{preset} seed {seed} step {i} {step:?}");
        match step {
            Step::Get(k) => assert_eq!(db.get(k).unwrap(), m.get(k).cloned(), "{ctx}"),
            Step::Scan(lo, hi) => {
                let lo_b = lo.as_deref().map_or(Bound::Unbounded, Bound::Included);
                let hi_b = hi.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
                let got: Vec<_> = db.scan((lo_b, hi_b)).unwrap().map(|r| r.unwrap()).collect();
                let want: Vec<_> = m.range::<[u8], _>((lo_b, hi_b)).map(|(k, v)| (k.clone(), v.clone())).collect();
                assert_eq!(got, want, "{ctx}");
            }
            Step::Seek(k) => {
                let mut it = db.iter().unwrap();
                it.seek(k);
                let got: Vec<_> = (0..3).filter_map(|_| it.next().unwrap()).collect();
                let want: Vec<_> = m.range(k.clone()..).take(3).map(|(k, v)| (k.clone(), v.clone())).collect();
                assert_eq!(got, want, "{ctx}");
            }
            Step::Reopen => {
                db.close().unwrap();
                drop(db);
                db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
                assert_matches(&db, &m, &ctx);
            }
            Step::Crash(s, frac) => {
                // Every acknowledged write must survive, whatever the caches evicted.
                db.simulate_process_crash();
                dev = dev.simulate_crash(*s, *frac);
                fs = fs.crash();
                db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
                assert_matches(&db, &m, &ctx);
            }
            w => {
                let want = model_apply(&mut m, w);
                assert_eq!(db_apply(&db, w).unwrap(), want, "{ctx}");
            }
        }
    }
    assert_matches(&db, &m, &format!("{preset} seed {seed} end"));
}

#[test]
fn model_random_sequences_every_preset() {
    let seeds: u64 = std::env::var("TIERKV_MODEL_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
    for &preset in presets() {
        for seed in 0..seeds {
            run(preset, seed, 800);
        }
    }
}

#[test]
fn empty_key_and_empty_value_round_trip() {
    for &preset in presets() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
        db.put(b"", b"").unwrap();
        db.put(b"a", b"").unwrap();
        assert_eq!(db.get(b"").unwrap(), Some(Vec::new()));
        assert_eq!(dump(&db).len(), 2);
        db.delete(b"").unwrap();
        assert_eq!(db.get(b"").unwrap(), None);
        assert!(db.insert_if_absent(b"", b"x").unwrap());
        assert!(!db.insert_if_absent(b"", b"y").unwrap());
        assert!(db.update_if_present(b"", b"z").unwrap());
        assert!(!db.update_if_present(b"nope", b"z").unwrap());
        assert_eq!(db.get(b"").unwrap(), Some(b"z".to_vec()));
    }
}

#[test]
fn stats_keys_counts_live_keys_exactly() {
    // Overwrites and deletes, with and without flushes in between: `keys` is the number of
    // live keys, never a sum over structures that hold the same key twice.
    for &preset in presets() {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        // `native` counts keys exactly while its capacity tier holds none (no DRAM budget
        // here); with keys on disk `keys` is an estimate (engine::native::cold, "Costs").
        let o = sim_options(preset, &dev, &fs)
            .native(tierkv::NativeOptions { dram_budget: 0, ..tierkv::testing::native_small() });
        let db = Db::open(dir(), o).unwrap();
        let mut m = Model::new();
        for round in 0..4u32 {
            for i in 0..300u32 {
                let k = format!("k{:04}", (i * 7 + round * 13) % 400);
                if i % 5 == 0 {
                    db.delete(&k).unwrap();
                    m.remove(k.as_bytes());
                } else {
                    db.put(&k, vec![round as u8; 200]).unwrap();
                    m.insert(k.into_bytes(), vec![round as u8; 200]);
                }
            }
            assert_eq!(db.stats().keys, m.len() as u64, "{preset} round {round} before flush");
            db.flush().unwrap();
            assert_eq!(db.stats().keys, m.len() as u64, "{preset} round {round} after flush");
        }
    }
}
