//! Corruption sweep over every preset: a store is built (flushes, merges, compactions
//! included) and closed cleanly; then, one at a time, a byte of its PM image or of one of its
//! files is flipped or zeroed, or a file is truncated, at offsets sampled over every region
//! (headers, checksums, payloads, tails). The damaged store must either refuse to open with
//! `Error::Corruption`, or open and return for every key its correct value or
//! `Error::Corruption` — never a panic, a wrong value or a silently missing key; `check` must
//! not call a damaged store clean while a read fails.
//!
//! `TIERKV_SOAK=1` samples densely.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Preset};

fn build(preset: Preset) -> (SimDevice, FaultFs, Model) {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let db = Db::open(dir(), sim_options(preset, &dev, &fs)).unwrap();
    let mut m = Model::new();
    for s in workload(21, 400, 80, false) {
        if s.writes() {
            model_apply(&mut m, &s);
            db_apply(&db, &s).unwrap();
        } else if matches!(s, Step::Flush) {
            db.flush().unwrap();
        }
    }
    db.compact().unwrap();
    db.close().unwrap();
    drop(db);
    (dev, fs, m)
}

/// Outcome of reading a damaged store: `true` when the damage was reported somewhere.
fn verify(preset: Preset, dev: &SimDevice, fs: &FaultFs, m: &Model, ctx: &str) -> bool {
    let db = match Db::open(dir(), sim_options(preset, dev, fs)) {
        Err(e) => {
            assert!(e.is_corruption(), "{ctx}: open failed with a non-corruption error: {e}");
            return true;
        }
        Ok(db) => db,
    };
    let mut reported = false;
    for (k, v) in m {
        match db.get(k) {
            Ok(Some(got)) => assert_eq!(&got, v, "{ctx}: wrong value for {}", tierkv::escape(k)),
            Ok(None) => panic!("{ctx}: key {} silently lost", tierkv::escape(k)),
            Err(e) => {
                assert!(e.is_corruption(), "{ctx}: get failed with {e}");
                reported = true;
            }
        }
    }
    match db.scan(..) {
        Err(e) => {
            assert!(e.is_corruption(), "{ctx}: scan failed with {e}");
            reported = true;
        }
        Ok(it) => {
            let mut n = 0;
            for item in it {
                match item {
                    Ok((k, v)) => {
                        assert_eq!(m.get(&k), Some(&v), "{ctx}: scan returned a wrong entry");
                        n += 1;
                    }
                    Err(e) => {
                        assert!(e.is_corruption(), "{ctx}: scan failed with {e}");
                        reported = true;
                        n = m.len();
                        break;
                    }
                }
            }
            assert_eq!(n, m.len(), "{ctx}: scan silently skipped entries");
        }
    }
    match db.check() {
        Ok(p) => {
            if reported {
                assert!(!p.is_empty(), "{ctx}: reads failed but check found nothing");
            }
            reported |= !p.is_empty();
        }
        Err(e) => {
            assert!(e.is_corruption(), "{ctx}: check failed with {e}");
            reported = true;
        }
    }
    drop(db);
    reported
}

/// Offsets to damage in a region of `len` bytes: the first and last 64 bytes densely, the
/// rest every `stride` bytes.
fn offsets(len: usize, stride: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..len.min(64)).collect();
    v.extend((64..len.saturating_sub(64)).step_by(stride));
    v.extend(len.saturating_sub(64).max(64)..len);
    v
}

#[test]
fn damaged_bytes_in_every_structure_of_every_preset() {
    let soak = std::env::var("TIERKV_SOAK").is_ok();
    for &preset in presets() {
        let (dev, fs, m) = build(preset);
        let (mut cases, mut reported) = (0u64, 0u64);
        // PM: pool 0 up to the end of what the store wrote (zeros beyond are free heap).
        let img = dev.durable_image(0).unwrap();
        let used = img.iter().rposition(|b| *b != 0).map_or(0, |p| p + 1);
        for off in offsets(used, if soak { 7 } else { 199 }) {
            for how in 0..2 {
                let copy = dev.simulate_crash(0, 0.0);
                let byte = img[off];
                let new = if how == 0 { byte ^ 0x5a } else { 0 };
                if new == byte {
                    continue;
                }
                assert!(copy.poke(0, off, &[new]));
                let ctx = format!("{preset}: PM pool 0 offset {off} {byte:#04x} -> {new:#04x}");
                cases += 1;
                reported += u64::from(verify(preset, &copy, &fs.crash(), &m, &ctx));
            }
        }
        // Files.
        let names = fs_files(&fs);
        for name in &names {
            let data = tierkv::fs::Fs::read_all(&fs, &dir().join(name)).unwrap();
            for off in offsets(data.len(), if soak { 3 } else { 61 }) {
                let copy = fs.crash();
                assert!(copy.poke(&dir().join(name), off, &[data[off] ^ 0x21]).is_ok());
                let ctx = format!("{preset}: file {name} offset {off}");
                cases += 1;
                reported += u64::from(verify(preset, &dev.simulate_crash(0, 0.0), &copy, &m, &ctx));
            }
            for len in [0, data.len() / 2, data.len().saturating_sub(1)] {
                let copy = fs.crash();
                copy.truncate(&dir().join(name), len).unwrap();
                let ctx = format!("{preset}: file {name} cut to {len} of {}", data.len());
                cases += 1;
                reported += u64::from(verify(preset, &dev.simulate_crash(0, 0.0), &copy, &m, &ctx));
            }
        }
        eprintln!("{preset}: {cases} damaged stores ({reported} reported as corruption, the rest read correctly); files {names:?}");
        assert!(reported > 0);
    }
}

fn fs_files(fs: &FaultFs) -> Vec<String> {
    store_files(fs, &["LOCK"])
}
