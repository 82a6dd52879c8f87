//! Regression (fs page model): a crash during a MANIFEST append whose page was never written back but whose size was committed (zeros where the record was) made slmdb refuse to open with "manifest record checksum mismatch".
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::{FaultFs, Fs};
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Preset};

fn current_manifest(fs: &FaultFs) -> std::path::PathBuf {
    let cur = fs.read_all(&dir().join("CURRENT")).unwrap();
    dir().join(String::from_utf8(cur).unwrap().trim())
}

#[test]
fn zero_filled_manifest_tail_of_an_inflight_flush_is_torn() {
    let preset = Preset::Slmdb;
    let opts = move |d: &SimDevice, f: &FaultFs| sim_options(preset, d, f);
    let w = workload(0, 60, 40, false);
    let total = crash_run(&opts, &w, None).syncs;
    let mut checked = 0;
    for n in 1..=total {
        let r = crash_run(&opts, &w, Some(CrashAt::Sync(n)));
        let Some(i) = r.inflight else { continue };
        let fs = r.fs.crash();
        let path = current_manifest(&fs);
        let synced = fs.read_all(&path).unwrap().len();
        // Only crash points inside a MANIFEST append: the volatile file is longer.
        if r.fs.read_all(&path).map_or(0, |d| d.len()) <= synced {
            continue;
        }
        // The committed size covers a page that was never written: zeros.
        fs.poke(&path, synced, &[0u8; 100]).unwrap();
        let db = Db::open(dir(), opts(&r.dev.simulate_crash(n, 0.0), &fs))
            .unwrap_or_else(|e| panic!("sync point {n}: reopen failed: {e}"));
        let mut before = Model::new();
        for s in &w[..i] {
            model_apply(&mut before, s);
        }
        let mut after = before.clone();
        model_apply(&mut after, &w[i]);
        let got = dump(&db);
        assert!(got == before || got == after, "sync point {n}: neither the old nor the new state");
        checked += 1;
    }
    assert!(checked > 0, "no crash point inside a MANIFEST append");
}
