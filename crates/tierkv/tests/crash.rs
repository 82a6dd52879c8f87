//! Crash-point enumeration: random workloads run on the PM crash simulator and the
//! fault-injecting file system are crashed before every PM fence, and before every file or
//! directory sync (all of them, for these short runs), with random eviction of unpersisted
//! lines; the reopened store must hold
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

/// Crash at every fence (`files` false) or every file sync (`files` true) of `seeds`
/// random workloads, or at a sample of them (`sample` > 1). Returns the points verified.
fn sweep(preset: Preset, seeds: std::ops::Range<u64>, steps: usize, sample: u64, files: bool) -> u64 {
    let opts = move |d: &SimDevice, f: &FaultFs| sim_options(preset, d, f);
    let mut points = 0;
    for seed in seeds {
        let w = workload(seed, steps, 40, false);
        let r = crash_run(&opts, &w, None);
        let total = if files { r.syncs } else { r.fences };
        let mut n = 1;
        while n <= total {
            let frac = [0.0, 0.3, 1.0][(n % 3) as usize];
            let at = if files { CrashAt::Sync(n) } else { CrashAt::Fence(n) };
            crash_check(&opts, preset.name(), &w, at, seed, frac);
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
        let mut points = sweep(preset, 0..seeds, steps, sample, false);
        // Designs with fewer fences per operation run more seeds until the floor is met.
        let mut seed = seeds;
        while points < want && seed < seeds * 10 {
            points += sweep(preset, seed..seed + 1, steps, sample, false);
            seed += 1;
        }
        eprintln!("{preset}: {points} crash points verified over {seed} seeds");
        assert!(points >= want, "{preset}: only {points} crash points exercised, want >= {want}");
    }
}

/// Open a fresh store, crashing before PM fence `n` (or file sync `n`, with `files`)
/// counted from the very start; returns the crashed device and file system, or `None`
/// when open finished first, with the fences and syncs open took.
fn crash_open(preset: Preset, at: Option<u64>, files: bool) -> (SimDevice, FaultFs, bool, u64, u64) {
    let (dev, fs) = linked();
    match (at, files) {
        (Some(n), false) => dev.crash_before_fence(n),
        (Some(n), true) => fs.crash_before_sync(n),
        (None, _) => {}
    }
    let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
    let crashed = dev.crashed() || fs.frozen();
    let (fences, syncs) = (dev.fences(), fs.sync_points());
    db.simulate_process_crash();
    unlink(&dev, &fs);
    (dev, fs, crashed, fences, syncs)
}

/// A crash at every fence and every file sync of store creation leaves a store that opens
/// (empty) and works.
#[test]
fn crash_during_creation_every_preset() {
    for &preset in presets() {
        let (_, _, _, fences, syncs) = crash_open(preset, None, false);
        assert!(fences + syncs > 0);
        eprintln!("{preset}: {fences} fences and {syncs} file syncs during store creation");
        for (files, total) in [(false, fences), (true, syncs)] {
            for n in 1..=total {
                let (dev, fs, crashed, _, _) = crash_open(preset, Some(n), files);
                assert!(crashed, "{preset}: crash point {n} (files {files}) during open not reached");
                let dev = dev.simulate_crash(n, 0.5);
                let fs = fs.crash();
                let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap_or_else(|e| {
                    panic!("{preset}: reopen after crash at creation point {n} (files {files}): {e}")
                });
                db.put(b"k", b"v").unwrap();
                assert_matches(
                    &db,
                    &[(b"k".to_vec(), b"v".to_vec())].into_iter().collect(),
                    &format!("creation point {n} (files {files})"),
                );
            }
        }
    }
}

/// A crash at every file or directory sync of short random workloads (the file-side commit
/// points: WAL, tables, MANIFEST, value-log files, group tables), with PM frozen at the
/// same instant.
#[test]
fn crash_at_every_file_sync_every_preset() {
    let soak = std::env::var("TIERKV_SOAK").is_ok();
    for &preset in presets() {
        let (seeds, steps, sample) = if soak { (40, 300, 2) } else { (12, 60, 1) };
        let points = sweep(preset, 0..seeds, steps, sample, true);
        eprintln!("{preset}: {points} file-sync crash points verified over {seeds} seeds");
        // pmekv and native live in PM only: they sync no file after creation.
        if !matches!(preset, Preset::Pmekv | Preset::Native) {
            assert!(points > 0, "{preset}: no file syncs exercised");
        }
    }
}

/// Crash points at PM stores and flushes, not only at fences: a sample of every store,
/// flush and fence of short random workloads (the strict model's events), each reopened
/// from a random crash state with torn lines.
#[test]
fn crash_at_sampled_stores_and_flushes_every_preset() {
    let soak = std::env::var("TIERKV_SOAK").is_ok();
    for &preset in presets() {
        let opts = move |d: &SimDevice, f: &FaultFs| sim_options(preset, d, f);
        let (seeds, steps, want) = if soak { (40u64, 300, 10_000u64) } else { (8, 60, 400) };
        let mut points = 0u64;
        for seed in 0..seeds {
            let w = workload(1000 + seed, steps, 40, false);
            let total = crash_run(&opts, &w, None).events;
            // About want/seeds points per workload, spread over all its events.
            let stride = (total * seeds / want).max(1);
            let mut n = 1 + seed % stride;
            while n <= total {
                let frac = [0.3, 1.0, 0.6][(n % 3) as usize];
                crash_check(&opts, preset.name(), &w, CrashAt::Event(n), seed, frac);
                points += 1;
                n += stride;
            }
        }
        eprintln!("{preset}: {points} store/flush/fence crash points verified");
        assert!(points >= want * 9 / 10, "{preset}: only {points} event crash points");
    }
}

/// Exhaustive mode: for short workloads, every crash state (every combination of store
/// prefixes over the dirty lines, up to 10 dirty lines) at every fence.
#[test]
fn every_crash_state_at_every_fence_of_short_workloads_every_preset() {
    for &preset in presets() {
        let opts = move |d: &SimDevice, f: &FaultFs| sim_options(preset, d, f);
        let (mut states, mut points, mut skipped) = (0u64, 0u64, 0u64);
        for seed in 0..3u64 {
            let w = workload(2000 + seed, 12, 20, false);
            let total = crash_run(&opts, &w, None).fences;
            for n in 1..=total {
                let k = crash_check_all_states(&opts, preset.name(), &w, CrashAt::Fence(n), 10);
                if k == 0 {
                    skipped += 1;
                } else {
                    states += k;
                    points += 1;
                }
            }
        }
        eprintln!(
            "{preset}: {states} crash states at {points} fences enumerated ({skipped} fences had > 10 dirty lines)"
        );
        assert!(points > 0 && states > points, "{preset}: nothing enumerated");
    }
}
