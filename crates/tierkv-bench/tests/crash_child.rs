//! The bench's crash child: a real child process writes fresh keys, reports each one as it
//! is acknowledged, and is killed with SIGKILL; the parent reopens and verifies every
//! acknowledged key. A write reported but never made must fail the check.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use tierkv_bench::child::{self, CrashError, Hooks};
use tierkv_bench::cli::{parse_workloads, run, BenchArgs};
use tierkv_bench::engine::{self, EngineSpec};

const CHILD: &str = env!("CARGO_BIN_EXE_tierkv-bench-child");

/// A fresh store of `preset` with one key loaded, closed.
fn loaded(t: &tempfile::TempDir, preset: &str, tag: &str) -> EngineSpec {
    let s = EngineSpec {
        name: preset.into(),
        dir: t.path().join(format!("{preset}-{tag}")).join("db"),
        pm_dir: t.path().join(format!("{preset}-{tag}-pm")),
        ..Default::default()
    };
    std::fs::create_dir_all(&s.pm_dir).unwrap();
    let e = engine::open(&s).unwrap();
    e.put(b"loaded", b"before the child").unwrap();
    drop(e);
    s
}

#[test]
fn every_preset_recovers_every_acknowledged_write_of_a_killed_child() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("r.json");
    let presets: Vec<String> = tierkv::Preset::ALL.iter().map(|p| p.name().to_string()).collect();
    let a = BenchArgs {
        num: 300,
        value_sizes: vec![100],
        engines: presets.clone(),
        workloads: parse_workloads("fillrandom").unwrap(),
        dir: Some(t.path().to_path_buf()),
        pm_dir: Some(t.path().to_path_buf()),
        out: Some(out.clone()),
        crash_exe: Some(CHILD.into()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    assert_eq!(rep.recovery.len(), presets.len());
    for r in &rep.recovery {
        assert!(r.after_crash_seconds.is_some(), "{}: not measured", r.engine);
        assert!(r.verified_keys.is_some_and(|n| n >= 1), "{}: verified {:?}", r.engine, r.verified_keys);
    }
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    for r in json["recovery"].as_array().unwrap() {
        assert!(r["verified_keys"].as_u64().is_some_and(|n| n >= 1), "JSON: {r}");
    }
}

/// `--crash-writes`: the child is killed once that many writes were acknowledged — past the
/// few thousand it writes by default, so the long-tail measurement really has its tail —
/// and every acknowledged write (a few more may be in the pipe at the kill) is verified.
#[test]
fn crash_writes_sets_how_many_writes_the_child_makes_before_the_kill() {
    let t = tempfile::tempdir().unwrap();
    let n = child::CHILD_MAX_WRITES + 2000;
    let a = BenchArgs {
        num: 100,
        value_sizes: vec![100],
        engines: vec!["native".into()],
        workloads: parse_workloads("fillrandom").unwrap(),
        dir: Some(t.path().to_path_buf()),
        pm_dir: Some(t.path().to_path_buf()),
        crash_exe: Some(CHILD.into()),
        crash_writes: Some(n),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    let r = &rep.recovery[0];
    let acked = r.acknowledged_keys.unwrap();
    assert!(acked >= n, "killed after {acked} acknowledged writes, asked for {n}");
    assert_eq!(r.verified_keys, Some(acked));
    assert!(run(&BenchArgs { crash_writes: Some(0), ..a }).unwrap_err().contains("--crash-writes"));
}

#[test]
fn a_write_acknowledged_but_never_made_fails_the_check() {
    let t = tempfile::tempdir().unwrap();
    for preset in ["hpdk", "pmekv"] {
        // Honest child: every acknowledged key is there.
        let s = loaded(&t, preset, "honest");
        let ok = child::measure_with(CHILD.as_ref(), &s, 10, 16, 64, Hooks { kill_after: Some(40), drop_write: None })
            .unwrap_or_else(|e| panic!("{preset}: {e}"));
        assert!(ok.verified >= 40, "{preset}: verified {}", ok.verified);
        // Lying child, on a store of its own: write 1040 is reported but never made.
        let s = loaded(&t, preset, "lying");
        let hooks = Hooks { kill_after: Some(1100), drop_write: Some(1040) };
        let err = child::measure_with(CHILD.as_ref(), &s, 10, 16, 64, hooks);
        match err {
            Err(CrashError::Lost(msg)) => {
                assert!(msg.contains("~crash0000001040") && msg.contains("1 of "), "{preset}: {msg}")
            }
            other => panic!("{preset}: a lost acknowledged write was not reported: {other:?}"),
        }
    }
}
