//! Crash-point enumeration: random workloads run on the PM crash simulator and the
//! fault-injecting file system are crashed before every fence (all of them, for these
//! short runs), with random eviction of unpersisted lines; the reopened store must hold
//! exactly the acknowledged writes, plus all or none of the operation in flight (batches
//! included), pass `check`, and keep working through another crash.
//!
//! `TIERKV_SOAK=1` runs longer workloads and more seeds (≥ 10,000 crash points per preset).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Preset};

struct Run {
    dev: SimDevice,
    fs: FaultFs,
    /// Index of the step during which the crash point was reached (None: never reached).
    inflight: Option<usize>,
    /// Fences executed after open.
    fences: u64,
}

/// Run `steps` on a fresh store; with `crash_at`, freeze the device before that fence
/// (counted from the first fence after open, or from the very first with `during_open`).
fn run(preset: Preset, steps: &[Step], crash_at: Option<u64>, during_open: bool) -> Run {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let f = fs.clone();
    dev.on_freeze(move || f.freeze());
    if let (Some(n), true) = (crash_at, during_open) {
        dev.crash_before_fence(n);
    }
    let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
    let base = dev.fences();
    if during_open {
        db.simulate_process_crash();
        return Run { inflight: dev.crashed().then_some(0), fences: base, dev, fs };
    }
    if let Some(n) = crash_at {
        dev.crash_before_fence(base + n);
    }
    for (i, s) in steps.iter().enumerate() {
        if s.writes() || matches!(s, Step::Flush) {
            db_apply(&db, s).unwrap();
        }
        if dev.crashed() {
            db.simulate_process_crash();
            return Run { fences: dev.fences() - base, dev, fs, inflight: Some(i) };
        }
    }
    let fences = dev.fences() - base;
    db.simulate_process_crash();
    Run { dev, fs, inflight: None, fences }
}

fn model_upto(steps: &[Step], n: usize) -> Model {
    let mut m = Model::new();
    for s in &steps[..n] {
        model_apply(&mut m, s);
    }
    m
}

/// Crash at fence `n`, reopen, verify, keep working, crash again, verify.
fn check_point(preset: Preset, steps: &[Step], n: u64, seed: u64, frac: f64) {
    let r = run(preset, steps, Some(n), false);
    let Some(i) = r.inflight else { panic!("crash point {n} not reached") };
    let ctx = format!("{preset} seed {seed} fence {n} (step {i}: {:?}) evict {frac}", steps[i]);
    let before = model_upto(steps, i);
    let mut after = before.clone();
    model_apply(&mut after, &steps[i]);
    let dev = r.dev.simulate_crash(seed ^ n, frac);
    let fs = r.fs.crash();
    let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap_or_else(|e| panic!("{ctx}: reopen failed: {e}"));
    let got = dump(&db);
    let mut m = if got == after {
        after
    } else {
        assert_matches(&db, &before, &format!("{ctx} (neither old nor new state)"));
        before
    };
    let problems = db.check().unwrap();
    assert!(problems.is_empty(), "{ctx}: check found {problems:?}");
    // The reopened store keeps working: more writes, another crash, reopen.
    for s in steps.iter().skip(i + 1).filter(|s| s.writes()).take(8) {
        let want = model_apply(&mut m, s);
        assert_eq!(db_apply(&db, s).unwrap(), want, "{ctx}: after reopen {s:?}");
    }
    db.simulate_process_crash();
    let dev = dev.simulate_crash(seed.wrapping_add(n), 0.5);
    let fs = fs.crash();
    let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
    assert_matches(&db, &m, &format!("{ctx}: second crash"));
}

fn sweep(preset: Preset, seeds: std::ops::Range<u64>, steps: usize, sample: u64) -> u64 {
    let mut points = 0;
    for seed in seeds {
        let w = workload(seed, steps, 40, false);
        let total = run(preset, &w, None, false).fences;
        let mut n = 1;
        while n <= total {
            let frac = [0.0, 0.3, 1.0][(n % 3) as usize];
            check_point(preset, &w, n, seed, frac);
            points += 1;
            n += if sample > 1 { 1 + (seed * 7 + n) % sample } else { 1 };
        }
    }
    points
}

#[test]
fn crash_at_every_fence_every_preset() {
    let soak = std::env::var("TIERKV_SOAK").is_ok();
    for &preset in presets() {
        let want = if soak { 10_000 } else { 2_000 };
        let (seeds, steps, sample) = if soak { (40, 400, 3) } else { (26, 70, 1) };
        let mut points = sweep(preset, 0..seeds, steps, sample);
        // Designs with fewer fences per operation run more seeds until the floor is met.
        let mut seed = seeds;
        while points < want && seed < seeds * 10 {
            points += sweep(preset, seed..seed + 1, steps, sample);
            seed += 1;
        }
        eprintln!("{preset}: {points} crash points verified over {seed} seeds");
        assert!(points >= want, "{preset}: only {points} crash points exercised, want >= {want}");
    }
}

#[test]
fn crash_during_creation_every_preset() {
    for &preset in presets() {
        let total = run(preset, &[], None, true).fences;
        assert!(total > 0);
        eprintln!("{preset}: {total} crash points during store creation");
        for n in 1..=total {
            let r = run(preset, &[], Some(n), true);
            assert_eq!(r.inflight, Some(0), "{preset}: fence {n} during open not reached");
            let dev = r.dev.simulate_crash(n, 0.5);
            let fs = r.fs.crash();
            let db = Db::open(dir(), sim_options(preset, &dev, &fs))
                .unwrap_or_else(|e| panic!("{preset}: reopen after crash at creation fence {n}: {e}"));
            db.put(b"k", b"v").unwrap();
            assert_matches(
                &db,
                &[(b"k".to_vec(), b"v".to_vec())].into_iter().collect(),
                &format!("creation fence {n}"),
            );
        }
    }
}
