//! Crash points under a real file system's crash model ([`CrashMode::Pages`]): unsynced
//! pages kept or lost one by one (lost ones reading as zeros or cutting the file), file
//! lengths anywhere from synced to current, unsynced directory changes kept or lost group by
//! group (renames atomically). The workloads of `tests/common` run on every preset, crashed
//! before every file or directory sync and before a sample of PM fences (the file system
//! then holds whatever the run wrote but never synced), each point under several seeds of
//! the model; the reopened store must hold the acknowledged writes plus all or none of the
//! operation in flight, pass `check`, and survive another such crash.
//!
//! `TIERKV_SOAK=1` runs longer workloads, more seeds and every fourth fence.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::{CrashMode, FaultFs};
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Preset};

/// Crash at `at`, reopen from the file system [`CrashMode::Pages`] leaves with `fs_seed`:
/// the store holds the acknowledged writes plus all or none of the step in flight, passes
/// `check`, keeps working, and survives a second such crash.
fn check_point(opts: OptsFn<'_>, name: &str, steps: &[Step], at: CrashAt, fs_seed: u64) {
    let r = crash_run(opts, steps, Some(at));
    let Some(i) = r.inflight else { panic!("{name}: crash point {at:?} not reached") };
    let ctx = format!("{name} {at:?} fs seed {fs_seed} (step {i}: {:?})", steps[i]);
    let dev = r.dev.simulate_crash(fs_seed, 0.5);
    verify_crash_state(opts, &ctx, steps, i, dev, &r.fs, &|f, s| f.crash_with(s, CrashMode::Pages), fs_seed);
}

struct Plan {
    seeds: u64,
    steps: usize,
    /// Model seeds per crash point.
    fs_seeds: u64,
    /// Every `fence_every`-th fence is a crash point too.
    fence_every: u64,
}

fn sweep(preset: Preset, p: &Plan) -> (u64, u64) {
    let opts = move |d: &SimDevice, f: &FaultFs| sim_options(preset, d, f);
    let (mut syncs, mut fences) = (0, 0);
    for seed in 0..p.seeds {
        let w = workload(seed, p.steps, 40, false);
        let r = crash_run(&opts, &w, None);
        let mut points: Vec<CrashAt> = (1..=r.syncs).map(CrashAt::Sync).collect();
        let offset = seed % p.fence_every;
        points.extend((1..=r.fences).filter(|n| n % p.fence_every == offset).map(CrashAt::Fence));
        for at in points {
            for k in 0..p.fs_seeds {
                let n = match at {
                    CrashAt::Sync(n) | CrashAt::Fence(n) | CrashAt::Event(n) => n,
                };
                check_point(&opts, preset.name(), &w, at, seed << 32 ^ n << 8 ^ k);
            }
            match at {
                CrashAt::Sync(_) => syncs += 1,
                CrashAt::Fence(_) | CrashAt::Event(_) => fences += 1,
            }
        }
    }
    (syncs, fences)
}

#[test]
fn crash_points_under_the_page_model_every_preset() {
    let soak = std::env::var("TIERKV_SOAK").is_ok();
    let plan = if soak {
        Plan { seeds: 30, steps: 200, fs_seeds: 3, fence_every: 4 }
    } else {
        Plan { seeds: 12, steps: 80, fs_seeds: 3, fence_every: 10 }
    };
    for &preset in presets() {
        let t = std::time::Instant::now();
        let (syncs, fences) = sweep(preset, &plan);
        eprintln!(
            "{preset}: {syncs} file-sync and {fences} fence crash points x {} model seeds in {:.1?}",
            plan.fs_seeds,
            t.elapsed()
        );
        assert!(syncs + fences > 0, "{preset}: no crash points exercised");
    }
}

/// With the designs' default unsynced WALs (hpdk, hoakv: `sync_wal` false), a power loss may
/// lose acknowledged writes, but never a part of the history in the middle: after a crash at
/// the end of a run under the page model (unsynced WAL pages kept or lost one by one, with
/// zero-filled holes) the store opens, passes `check` and holds the writes of some prefix of
/// the run, no earlier than its last flush (hoakv: every key holds a value it had since the
/// last flush: its hot writes reach PM at once, so a power loss is not a prefix).
#[test]
fn unsynced_wals_lose_a_suffix_never_a_middle() {
    let seeds = if std::env::var("TIERKV_SOAK").is_ok() { 200 } else { 30 };
    for &preset in presets().iter().filter(|p| matches!(p, Preset::Hpdk | Preset::Hoakv)) {
        let opts = move |d: &SimDevice, f: &FaultFs| {
            let mut o = sim_options(preset, d, f);
            match preset {
                Preset::Hpdk => o = o.hpdk(tierkv::HpdkOptions { sync_wal: false, ..hpdk_small() }),
                _ => o = o.hoakv(tierkv::HoakvOptions { sync_wal: false, ..tierkv::testing::hoakv_small() }),
            }
            o
        };
        let mut longest = 0;
        for seed in 0..seeds {
            let w = workload(seed, 80, 40, false);
            let r = crash_run(&opts, &w, None);
            // Every prefix of the history, from the last flush on.
            let last_flush = w.iter().rposition(|s| matches!(s, Step::Flush)).map_or(0, |i| i + 1);
            let mut m = Model::new();
            let mut prefixes = Vec::new();
            for (i, s) in w.iter().enumerate() {
                if i >= last_flush {
                    prefixes.push((i, m.clone()));
                }
                model_apply(&mut m, s);
            }
            prefixes.push((w.len(), m));
            for k in 0..3 {
                let fs_seed = seed << 8 ^ k;
                let ctx = format!("{preset} seed {seed} fs seed {fs_seed}");
                let dev = r.dev.simulate_crash(fs_seed, 0.5);
                let fs = r.fs.crash_with(fs_seed, CrashMode::Pages);
                let db = Db::open(dir(), opts(&dev, &fs)).unwrap_or_else(|e| panic!("{ctx}: reopen failed: {e}"));
                let got = dump(&db);
                match prefixes.iter().find(|(_, m)| *m == got) {
                    Some((n, _)) => longest = longest.max(w.len() - n),
                    // HoaKV writes hot keys to PM (durable at once) and cold ones to the
                    // WAL: a power loss with an unsynced WAL keeps later hot writes and
                    // loses earlier cold ones. Each key must still hold a value it had
                    // since the last flush (never garbage, never an older value).
                    None if preset == Preset::Hoakv => {
                        let keys: std::collections::BTreeSet<&Vec<u8>> =
                            prefixes.iter().flat_map(|(_, m)| m.keys()).chain(got.keys()).collect();
                        for k in keys {
                            assert!(
                                prefixes.iter().any(|(_, m)| m.get(k) == got.get(k)),
                                "{ctx}: key {} holds a value it never had since the last flush",
                                tierkv::escape(k)
                            );
                        }
                    }
                    None => panic!(
                        "{ctx}: the store holds no prefix of the history (since the last flush, step {last_flush})"
                    ),
                }
                let problems = db.check().unwrap();
                assert!(problems.is_empty(), "{ctx}: check found {problems:?}");
            }
        }
        eprintln!("{preset}: unsynced WAL crashes lost at most a suffix (the longest lost: {longest} steps)");
    }
}
