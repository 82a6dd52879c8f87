//! The papers' regime (issue 21): a DRAM budget enforced by a memory cgroup around a job
//! child, bounded reads, the time cap, durability levels, PM on tmpfs detected, `--dir`
//! created. No wall-clock thresholds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use tierkv_bench::cgroup::{self, MemCgroup};
use tierkv_bench::cli::{parse_engines, parse_workloads, run, BenchArgs};
use tierkv_bench::run::Workload;

const CHILD: &str = env!("CARGO_BIN_EXE_tierkv-bench-child");

/// The tests that create groups run one at a time: each checks that none of this
/// process's groups is left.
static GROUPS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Whether this machine lets the harness create memory cgroups; prints why not.
fn cgroups_writable() -> bool {
    match MemCgroup::create(64 << 20) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIPPED: memory cgroups are not writable here: {e}");
            false
        }
    }
}

/// The groups of this process left under the harness's parent group.
fn our_groups() -> Vec<String> {
    let (dir, _) = cgroup::parent().unwrap();
    let mine = format!("{}{}-", cgroup::PREFIX, std::process::id());
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&mine))
        .collect()
}

#[test]
fn a_job_child_runs_under_a_small_budget_and_its_group_is_removed() {
    let _one = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
    if !cgroups_writable() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("res").join("paper.json");
    let a = BenchArgs {
        num: 3000,
        reads: Some(500),
        value_sizes: vec![1024],
        engines: parse_engines("pmekv,hpdk,limit").unwrap(),
        workloads: parse_workloads("fillrandom,readrandom,seekrandom").unwrap(),
        dir: Some(t.path().join("disk")),
        pm_dir: Some(t.path().join("pm")),
        out: Some(out.clone()),
        dram_budget_mib: Some(64),
        crash_exe: Some(CHILD.into()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    assert!(rep.failures.is_empty(), "{:?}", rep.failures);
    assert_eq!(rep.memory.len(), 3);
    for m in &rep.memory {
        assert_eq!(m.limit_bytes, 64 << 20);
        let peak = m.peak_bytes.expect("the kernel records the peak");
        assert!(peak > 0 && peak <= m.limit_bytes, "{}: peak {peak} over the limit", m.engine);
        assert!(m.recovery_peak_bytes.is_none_or(|p| p <= m.limit_bytes), "{}", m.engine);
        // The PM pools exist and are not part of the charge.
        assert!(m.pm_bytes > 0, "{}: PM pools", m.engine);
        assert_eq!(m.oom_kills.unwrap_or(0), 0, "{}", m.engine);
    }
    // The workloads ran in the children and came back whole.
    for e in ["pmekv", "hpdk", "limit"] {
        let mine: Vec<_> = rep.outcomes.iter().filter(|o| o.engine == e).collect();
        let want = if e == "limit" { 2 } else { 3 };
        assert_eq!(mine.len(), want, "{e}");
        for o in mine {
            assert!(o.ops > 0 && !o.capped, "{e} {:?}", o.workload);
        }
    }
    // Recovery after a crash, measured under the budget: every acknowledged key recovered.
    assert_eq!(rep.recovery.len(), 2);
    for r in &rep.recovery {
        let (ack, got) = (r.acknowledged_keys.unwrap(), r.verified_keys.unwrap());
        assert!(ack >= 1 && got == ack, "{}: {got} of {ack}", r.engine);
        assert!(r.after_crash_seconds.is_some());
    }
    assert!(our_groups().is_empty(), "groups left behind: {:?}", our_groups());
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(json["schema"], 2);
    assert_eq!(json["setup"]["dram_budget_bytes"], 64u64 << 20);
    for m in json["memory"].as_array().unwrap() {
        for f in ["limit_bytes", "peak_bytes", "pm_bytes", "at_limit", "disk_bytes_read"] {
            assert!(!m[f].is_null(), "memory lacks {f}: {m}");
        }
    }
    let table = tierkv_bench::report::table(&rep);
    assert!(table.contains("memory: DRAM budget") && table.contains(" / "), "{table}");
}

#[test]
fn a_failing_job_is_reported_and_its_group_removed() {
    let _one = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
    if !cgroups_writable() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let a = BenchArgs {
        num: 100,
        engines: vec!["no-such-engine".into()],
        workloads: parse_workloads("fillrandom").unwrap(),
        dir: Some(t.path().to_path_buf()),
        pm_dir: Some(t.path().to_path_buf()),
        dram_budget_mib: Some(64),
        crash_exe: Some(CHILD.into()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    assert_eq!(rep.failures.len(), 1, "{:?}", rep.failures);
    assert!(rep.failures[0].what.contains("no-such-engine"), "{:?}", rep.failures);
    assert!(tierkv_bench::report::table(&rep).contains("FAILED"));
    assert!(our_groups().is_empty(), "groups left behind: {:?}", our_groups());
}

#[test]
fn a_group_is_removed_when_its_guard_drops_and_stale_ones_at_the_next_start() {
    let _one = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
    if !cgroups_writable() {
        return;
    }
    let g = MemCgroup::create(32 << 20).unwrap();
    let path = g.path().to_path_buf();
    assert!(path.is_dir());
    assert!(std::fs::read_to_string(g.procs_file()).is_ok());
    drop(g);
    assert!(!path.exists(), "{} left behind", path.display());
    // A group named for a process that no longer exists is stale.
    let (dir, _) = cgroup::parent().unwrap();
    let stale = dir.join(format!("{}{}-0", cgroup::PREFIX, u32::MAX - 7));
    std::fs::create_dir(&stale).unwrap();
    let g = MemCgroup::create(32 << 20).unwrap();
    assert!(!stale.exists(), "stale group kept");
    drop(g);
}

#[test]
fn dram_budget_refuses_data_on_tmpfs() {
    let shm = Path::new("/dev/shm");
    if !cgroup::is_tmpfs(shm) {
        eprintln!("SKIPPED: /dev/shm is not tmpfs here");
        return;
    }
    let t = tempfile::tempdir_in(shm).unwrap();
    let a = BenchArgs {
        num: 10,
        dir: Some(t.path().to_path_buf()),
        dram_budget_mib: Some(64),
        crash_exe: Some(CHILD.into()),
        ..Default::default()
    };
    let err = run(&a).unwrap_err();
    assert!(err.contains("tmpfs"), "{err}");
}

#[test]
fn tmpfs_is_detected() {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let shm_is_tmpfs = mounts.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        f.get(1) == Some(&"/dev/shm") && f.get(2) == Some(&"tmpfs")
    });
    assert_eq!(cgroup::is_tmpfs(Path::new("/dev/shm")), shm_is_tmpfs);
    assert!(!cgroup::is_tmpfs(Path::new("/proc")), "procfs is not tmpfs");
    assert!(!cgroup::is_tmpfs(Path::new("/no/such/dir")));
    // The durability the report states follows it.
    use tierkv_bench::engine::durability;
    assert_eq!(durability("hpdk", true, true), "power-loss (emulated: PM on tmpfs)");
    assert_eq!(durability("hpdk", true, false), "power-loss");
    assert_eq!(durability("leveldb", true, true), "power-loss");
    assert_eq!(durability("limit", false, true), "process-crash");
}

#[test]
fn reads_bound_the_read_phases_only() {
    let t = tempfile::tempdir().unwrap();
    let a = BenchArgs {
        num: 1000,
        reads: Some(120),
        engines: parse_engines("pmekv,limit").unwrap(),
        workloads: parse_workloads("fillrandom,readrandom,seekrandom,overwrite,load,a,e").unwrap(),
        dir: Some(t.path().to_path_buf()),
        pm_dir: Some(t.path().to_path_buf()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    for o in &rep.outcomes {
        let want = match o.workload {
            Workload::Fillrandom | Workload::Overwrite | Workload::YcsbLoad => 1000,
            Workload::Seekrandom => 12,
            _ => 120,
        };
        assert_eq!((o.ops, o.planned_ops), (want, want), "{} {:?}", o.engine, o.workload);
        assert!(!o.capped);
    }
}

#[test]
fn the_time_cap_stops_a_workload_and_marks_it() {
    let t = tempfile::tempdir().unwrap();
    let base = BenchArgs {
        num: 2000,
        engines: parse_engines("pmekv").unwrap(),
        workloads: parse_workloads("fillrandom,readrandom").unwrap(),
        dir: Some(t.path().to_path_buf()),
        pm_dir: Some(t.path().to_path_buf()),
        ..Default::default()
    };
    // A cap already over when the workload starts: nothing runs, both are capped.
    let rep = run(&BenchArgs { time_cap: Some(0.0), ..base.clone() }).unwrap();
    assert_eq!(rep.outcomes.len(), 2);
    for o in &rep.outcomes {
        assert!(o.capped && o.ops < o.planned_ops, "{:?}: {} of {}", o.workload, o.ops, o.planned_ops);
    }
    let table = tierkv_bench::report::table(&rep);
    assert!(table.contains("*capped"), "{table}");
    // A cap nothing reaches changes nothing.
    let rep = run(&BenchArgs { time_cap: Some(1e6), ..base }).unwrap();
    for o in &rep.outcomes {
        assert!(!o.capped && o.ops == o.planned_ops, "{:?}", o.workload);
    }
}

#[test]
fn durable_runs_state_their_level_and_missing_dirs_are_created() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("a").join("b");
    let out = t.path().join("o").join("x.json");
    let a = BenchArgs {
        num: 200,
        durable: true,
        engines: parse_engines("hpdk,hoakv,limit").unwrap(),
        workloads: parse_workloads("fillrandom,readrandom").unwrap(),
        dir: Some(dir.clone()),
        pm_dir: Some(t.path().join("pm")),
        out: Some(out.clone()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    assert!(dir.is_dir() && out.is_file());
    let tmp = cgroup::is_tmpfs(t.path());
    for e in &rep.engines {
        let want = if tmp { "power-loss (emulated: PM on tmpfs)" } else { "power-loss" };
        assert_eq!(e.durability, want, "{}", e.engine);
    }
    // Plots of a report not named results.json carry its stem.
    if Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        assert!(t.path().join("o").join("x-throughput-1024.svg").is_file());
    }
}

#[test]
fn paper_preset_is_the_papers_regime() {
    let p = BenchArgs::paper();
    let budget = p.dram_budget_mib.unwrap() << 20;
    let data = p.num * (p.key_size + p.value_sizes[0]) as u64;
    assert!(data >= 8 * budget, "data {data} is not 8x the budget {budget}");
    assert_eq!(p.pm_profile, "optane");
    assert!(p.reads.is_some() && p.time_cap.is_some() && p.pm_budget_mib.is_some());
    assert_eq!(p.workloads.len(), 11);
    assert!(p.ycsb_fresh);
    // Every preset (HoaKV with a MemTable the budget holds) and `limit`.
    for e in ["slmdb", "hpdk", "lightkv", "hoakv/mem=16", "pmekv", "limit"] {
        assert!(p.engines.iter().any(|x| x == e), "{e} missing from {:?}", p.engines);
    }
    assert!(parse_engines(&p.engines.join(",")).is_ok());
}

#[test]
fn ycsb_fresh_splits_the_workloads_where_ycsb_follows_db_bench() {
    use tierkv_bench::run::segments;
    let ws = parse_workloads("fillrandom,readrandom,load,a,c").unwrap();
    assert_eq!(segments(&ws, false), vec![ws.clone()]);
    assert_eq!(segments(&ws, true), vec![ws[..2].to_vec(), ws[2..].to_vec()]);
    // Only a db_bench → YCSB change starts a fresh store.
    let only_ycsb = parse_workloads("load,a").unwrap();
    assert_eq!(segments(&only_ycsb, true), vec![only_ycsb.clone()]);
    let back = parse_workloads("load,fillrandom,load").unwrap();
    assert_eq!(segments(&back, true), vec![back[..2].to_vec(), back[2..].to_vec()]);
    assert!(segments(&[], true).is_empty());
}

/// Space used by `engine` after `workload` in `rep`.
fn space_after(rep: &tierkv_bench::report::Report, engine: &str, w: Workload) -> u64 {
    rep.outcomes.iter().find(|o| o.engine == engine && o.workload == w).unwrap().space_bytes
}

#[test]
fn ycsb_fresh_runs_ycsb_on_an_empty_store() {
    let t = tempfile::tempdir().unwrap();
    let base = BenchArgs {
        num: 3000,
        reads: Some(300),
        engines: parse_engines("pmekv").unwrap(),
        workloads: parse_workloads("fillrandom,readrandom,load,c").unwrap(),
        dir: Some(t.path().join("disk")),
        pm_dir: Some(t.path().join("pm")),
        ..Default::default()
    };
    let shared = run(&base).unwrap();
    let fresh = run(&BenchArgs { ycsb_fresh: true, ..base }).unwrap();
    assert!(fresh.params.ycsb_fresh && !shared.params.ycsb_fresh);
    // The fresh store holds only the YCSB records: the db_bench ones are gone.
    let (s, f) = (space_after(&shared, "pmekv", Workload::YcsbLoad), space_after(&fresh, "pmekv", Workload::YcsbLoad));
    assert!(f < s, "fresh {f} vs shared {s}");
    for rep in [&shared, &fresh] {
        for o in &rep.outcomes {
            assert_eq!(o.ops, o.planned_ops, "{:?}", o.workload);
        }
        // Every YCSB read found its record in both layouts (fillrandom draws keys with
        // repeats, so readrandom misses some in both).
        let c = rep.outcomes.iter().find(|o| o.workload == Workload::YcsbC).unwrap();
        assert_eq!(c.found, c.ops);
        let r = rep.outcomes.iter().find(|o| o.workload == Workload::Readrandom).unwrap();
        assert!(r.found > 0);
        assert_eq!(rep.recovery.len(), 1);
    }
}

#[test]
fn ycsb_fresh_under_a_budget_runs_one_job_per_store_in_one_group() {
    let _one = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
    if !cgroups_writable() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let a = BenchArgs {
        num: 2000,
        reads: Some(200),
        engines: parse_engines("hpdk").unwrap(),
        workloads: parse_workloads("fillrandom,readrandom,load,c").unwrap(),
        dir: Some(t.path().join("disk")),
        pm_dir: Some(t.path().join("pm")),
        dram_budget_mib: Some(64),
        pm_budget_mib: Some(64),
        ycsb_fresh: true,
        crash_exe: Some(CHILD.into()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    assert!(rep.failures.is_empty(), "{:?}", rep.failures);
    assert_eq!(rep.outcomes.len(), 4);
    for o in &rep.outcomes {
        assert_eq!(o.ops, o.planned_ops, "{:?}", o.workload);
        match o.workload {
            Workload::YcsbC => assert_eq!(o.found, o.ops),
            Workload::Readrandom => assert!(o.found > 0),
            _ => {}
        }
    }
    // One memory row (one group) for both stores, and recovery measured after the last.
    assert_eq!(rep.memory.len(), 1);
    // The group saw both stores' use (the peak is recorded, and PM pools were allocated).
    let m = &rep.memory[0];
    assert!(m.peak_bytes.is_some_and(|p| p > 0 && p <= m.limit_bytes), "{m:?}");
    assert!(m.pm_bytes > 0, "{m:?}");
    assert_eq!(rep.recovery.len(), 1);
    let r = &rep.recovery[0];
    assert_eq!(r.verified_keys, r.acknowledged_keys);
    assert!(our_groups().is_empty(), "groups left behind: {:?}", our_groups());
}

/// Ratios from 0.2× to 2,000× LevelDB (a trimmed `--paper` report) plot on a log axis, where
/// the smallest bar still shows; a narrow span keeps the linear axis.
#[test]
fn a_wide_span_of_ratios_is_plotted_on_a_log_axis() {
    if !Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        eprintln!("SKIPPED: no DejaVu font for plot text");
        return;
    }
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/wide-span.json");
    let rep: tierkv_bench::report::Report = serde_json::from_slice(&std::fs::read(fixture).unwrap()).unwrap();
    let t = tempfile::tempdir().unwrap();
    let files = tierkv_bench::plot::write_all(&rep, t.path(), "wide-").unwrap();
    let svg = files.iter().find(|f| f.extension().is_some_and(|x| x == "svg")).unwrap();
    let text = std::fs::read_to_string(svg).unwrap();
    assert!(text.contains("(log scale)"), "no log axis");
    // Narrow: only fillrandom of pmekv and leveldb (6.7×).
    let mut narrow = rep.clone();
    narrow.outcomes.retain(|o| o.workload == Workload::Fillrandom && (o.engine == "pmekv" || o.engine == "leveldb"));
    narrow.engines.retain(|e| e.engine == "pmekv" || e.engine == "leveldb");
    let files = tierkv_bench::plot::write_all(&narrow, t.path(), "narrow-").unwrap();
    let svg = files.iter().find(|f| f.extension().is_some_and(|x| x == "svg")).unwrap();
    assert!(!std::fs::read_to_string(svg).unwrap().contains("(log scale)"));
}
