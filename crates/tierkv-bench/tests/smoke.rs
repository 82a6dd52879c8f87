//! Every engine runs every workload on a tiny dataset, and the JSON report has the schema
//! downstream tools read. No wall-clock thresholds. With `--features peers` the same tests
//! cover LevelDB and RocksDB (they are in `known_engines()`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use tierkv_bench::cli::{parse_engines, parse_workloads, run, BenchArgs};
use tierkv_bench::engine::known_engines;
use tierkv_bench::run::Workload;

#[test]
fn every_engine_every_workload_tiny() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("results.json");
    let a = BenchArgs {
        num: 400,
        value_sizes: vec![100, 1024],
        workloads: Workload::ALL.to_vec(),
        dir: Some(t.path().to_path_buf()),
        pm_dir: Some(t.path().to_path_buf()),
        out: Some(out.clone()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    for e in known_engines() {
        for &vs in &[100usize, 1024] {
            let mine: Vec<_> = rep.outcomes.iter().filter(|o| o.engine == e && o.value_size == vs).collect();
            // `limit` has no ordered index: it skips the scan workloads.
            let want = if e == "limit" { Workload::ALL.len() - 4 } else { Workload::ALL.len() };
            assert_eq!(mine.len(), want, "{e} {vs}");
            for o in &mine {
                assert!(o.ops > 0 && o.ops_per_sec > 0.0, "{e} {:?}", o.workload);
                assert!(o.latency.p50_ns <= o.latency.p99_ns && o.latency.p99_ns <= o.latency.p999_ns);
                match o.workload {
                    // fillseq loaded every db_bench key, so every random read finds its key.
                    Workload::Readrandom => assert_eq!(o.found, o.ops, "{e}: readrandom misses"),
                    Workload::Readseq => assert_eq!(o.found, 400, "{e}: the db_bench keys (YCSB loads later)"),
                    Workload::YcsbC => assert_eq!(o.found, o.ops, "{e}: ycsb-c reads loaded keys"),
                    // Every operation is a write of one value; every scan starts at a loaded
                    // key and reads 1..=100 entries.
                    Workload::YcsbUpdate => {
                        assert!(o.usage.user_bytes_written >= o.ops * vs as u64, "{e}: ycsb-update writes")
                    }
                    Workload::YcsbScan => {
                        assert!(o.found >= o.ops && o.found <= o.ops * 100, "{e}: ycsb-scan read {}", o.found)
                    }
                    Workload::Fillseq | Workload::YcsbLoad => {
                        let keys: u64 = if o.workload == Workload::Fillseq {
                            400 * 16
                        } else {
                            (0..400).map(|i| tierkv_bench::workload::ycsb_key(i).len() as u64).sum()
                        };
                        assert_eq!(o.usage.user_bytes_written, keys + 400 * vs as u64, "{e} {:?}", o.workload);
                        // Every value byte reaches the medium: PM for tierkv and limit (limit
                        // persists only values), the WAL on disk for the peers.
                        let medium = o.usage.pm_bytes_written + o.usage.disk_bytes_written;
                        assert!(medium >= 400 * vs as u64, "{e}: values reach the medium")
                    }
                    _ => {}
                }
            }
        }
    }
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(json["schema"], 2);
    // Every engine states its durability level; without --durable, a process crash.
    let engines = json["engines"].as_array().unwrap();
    assert_eq!(engines.len(), known_engines().len());
    for e in engines {
        assert_eq!(e["durability"], "process-crash", "{e}");
    }
    assert!(json["setup"]["pm_on_tmpfs"].is_boolean() && json["memory"].as_array().is_some_and(|m| m.is_empty()));
    assert_eq!(json["params"]["num"], 400);
    let first = &json["outcomes"][0];
    for field in [
        "engine",
        "workload",
        "value_size",
        "ops",
        "planned_ops",
        "capped",
        "seconds",
        "ops_per_sec",
        "found",
        "write_amp_pm",
        "write_amp_disk",
        "disk_bytes_read",
    ] {
        assert!(!first[field].is_null(), "JSON outcome lacks `{field}`");
    }
    for field in ["mean_ns", "p50_ns", "p99_ns", "p999_ns", "max_ns"] {
        assert!(first["latency"][field].is_number(), "JSON latency lacks `{field}`");
    }
    for field in ["pm_bytes_written", "disk_bytes_written", "user_bytes_written", "dram_index_bytes", "pm_space"] {
        assert!(first["usage"][field].is_number(), "JSON usage lacks `{field}`");
    }
    assert_eq!(first["workload"], "fillseq", "workloads are named as on the command line");
    assert!(json["outcomes"].as_array().is_some_and(|o| o.iter().any(|x| x["workload"] == "ycsb-load")));
    assert!(json["recovery"].as_array().is_some_and(|r| !r.is_empty()));
    for rec in json["recovery"].as_array().into_iter().flatten() {
        let crash = &rec["after_crash_seconds"];
        match rec["engine"].as_str() {
            // tierkv presets reopen after a simulated crash (log replay); the peers cannot
            // be crashed in-process and report nothing rather than a made-up figure.
            Some(e) if tierkv::Preset::ALL.iter().any(|p| p.name() == e) => {
                assert!(crash.is_number(), "{e}: {crash}");
                assert!(rec["verified_keys"].as_u64().is_some_and(|n| n > 0), "{e}: {rec}");
            }
            Some(e) => assert!(crash.is_null(), "{e}: {crash}"),
            None => panic!("recovery entry without engine"),
        }
    }
    assert!(first["cdf"].as_array().is_some_and(|c| c.len() == 103), "CDF points");
    // Plots next to the JSON (they need a TrueType font; without one the run only warns).
    if std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        for f in [
            "throughput-100.svg",
            "throughput-1024.png",
            "latency-cdf-readwhilewriting-100.svg",
            "latency-cdf-readwhilewriting-1024.png",
        ] {
            let len = std::fs::metadata(t.path().join(f)).map(|m| m.len()).unwrap_or(0);
            assert!(len > 1000, "plot {f} missing or empty ({len} bytes)");
        }
    }
}

#[test]
fn flag_parsing() {
    assert_eq!(
        parse_workloads("load,a,ycsb-f,readseq").unwrap(),
        vec![Workload::YcsbLoad, Workload::YcsbA, Workload::YcsbF, Workload::Readseq]
    );
    assert!(parse_workloads("fillrandom,nope").is_err());
    assert!(parse_engines("pmekv,limit").is_ok());
    assert!(parse_engines("leveldb2").is_err());
}

#[test]
fn two_threads_and_readwhilewriting() {
    let t = tempfile::tempdir().unwrap();
    let a = BenchArgs {
        num: 1000,
        threads: vec![2],
        workloads: parse_workloads("fillseq,readrandom,readwhilewriting,load,d,e").unwrap(),
        dir: Some(t.path().to_path_buf()),
        pm_dir: Some(t.path().to_path_buf()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    for o in &rep.outcomes {
        assert_eq!(o.threads, 2);
        match o.workload {
            // The two fillseq threads split the key range: every key exists.
            Workload::Readrandom => assert_eq!(o.found, 1000, "{}", o.engine),
            // The writer only overwrites existing keys, so readers always find theirs.
            Workload::Readwhilewriting => {
                assert_eq!((o.ops, o.found), (1000, 1000), "{}", o.engine);
                assert!(o.background_writes > 0, "{}: the writer ran", o.engine);
            }
            _ => assert!(o.ops > 0),
        }
    }
}

/// `--threads 1,2`: every engine runs every workload once per count;
/// recovery is measured once per engine; the table prints the sweep with ratios.
#[test]
fn thread_sweep_runs_every_count_and_prints_ratios() {
    let t = tempfile::tempdir().unwrap();
    let a = BenchArgs {
        num: 600,
        threads: vec![1, 2],
        engines: parse_engines("pmekv,lightkv").unwrap(),
        workloads: parse_workloads("fillrandom,readrandom").unwrap(),
        dir: Some(t.path().to_path_buf()),
        pm_dir: Some(t.path().to_path_buf()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    for e in ["pmekv", "lightkv"] {
        for th in [1usize, 2] {
            let mine: Vec<_> = rep.outcomes.iter().filter(|o| o.engine == e && o.threads == th).collect();
            assert_eq!(mine.len(), 2, "{e} at {th} threads");
            let read = mine.iter().find(|o| o.workload == Workload::Readrandom).unwrap();
            assert!(read.found > 0, "{e} {th}: the reads found what the fill wrote");
            // The workloads cost CPU time, and no more than every thread busy all along
            // (the clients plus a background thread each at most, generously), give or take
            // the kernel's accounting of threads still running when it is read (a
            // scheduler tick each: these workloads take about a millisecond).
            assert!(mine.iter().map(|o| o.cpu_seconds).sum::<f64>() > 0.0, "{e} {th}: no CPU time measured");
            for o in &mine {
                let most = o.seconds * (th + 8) as f64 + 0.05 * (th + 8) as f64;
                assert!(
                    o.cpu_seconds <= most,
                    "{e} {th} {:?}: {} s of CPU in {} s",
                    o.workload,
                    o.cpu_seconds,
                    o.seconds
                );
            }
        }
        assert_eq!(rep.recovery.iter().filter(|r| r.engine == e).count(), 1, "{e}: recovery once");
    }
    let table = tierkv_bench::report::table(&rep);
    assert!(table.contains("thread sweep"), "{table}");
    let line = table.lines().find(|l| l.starts_with("fillrandom") && l.contains("pmekv") && l.contains("x)")).unwrap();
    assert!(line.contains("(1.00x)"), "{line}");
    let cores = table.split("cores busy").nth(1).unwrap_or_else(|| panic!("no cores-busy table: {table}"));
    let line = cores.lines().find(|l| l.starts_with("fillrandom") && l.contains("lightkv")).unwrap();
    assert_eq!(line.matches(", ").count(), 2, "cores and CPU per operation at 1 and 2 threads: {line}");
    assert!(run(&BenchArgs { threads: vec![0], ..a.clone() }).is_err(), "0 threads is refused");
}

/// `--repeat 3`: every measurement runs three times; the report keeps one outcome per
/// measurement — the median round, every round's ops/s in `rounds` — one recovery per
/// engine, and the table lists the rounds. One round keeps the report as it was (no
/// `rounds` in the JSON). Zero rounds is refused.
#[test]
fn repeat_keeps_the_median_round_and_lists_every_round() {
    let t = tempfile::tempdir().unwrap();
    let a = BenchArgs {
        num: 500,
        threads: vec![1, 2],
        repeat: 3,
        engines: parse_engines("pmekv,native").unwrap(),
        workloads: parse_workloads("fillrandom,readrandom").unwrap(),
        dir: Some(t.path().to_path_buf()),
        pm_dir: Some(t.path().to_path_buf()),
        ..Default::default()
    };
    let rep = run(&a).unwrap();
    assert_eq!(rep.outcomes.len(), 2 * 2 * 2, "one outcome per engine, workload and thread count");
    for o in &rep.outcomes {
        assert_eq!(o.rounds.len(), 3, "{} {:?}", o.engine, o.workload);
        let mut sorted = o.rounds.clone();
        sorted.sort_by(f64::total_cmp);
        assert_eq!(o.ops_per_sec, sorted[1], "the median round is the one kept");
    }
    for e in ["pmekv", "native"] {
        assert_eq!(rep.recovery.iter().filter(|r| r.engine == e).count(), 1, "{e}: one recovery row");
    }
    let table = tierkv_bench::report::table(&rep);
    assert!(table.contains("rounds (--repeat 3)"), "{table}");
    let line = table
        .lines()
        .find(|l| l.trim_start().starts_with("readrandom") && l.contains("native") && l.contains(" / "))
        .unwrap();
    assert_eq!(line.matches(" / ").count(), 2, "{line}");
    // The sweep's ratios paired within each round: the median of the three rounds' ratios
    // of 2 threads to 1, with the lowest and highest.
    let rounds = |t: usize| {
        let o =
            rep.outcomes.iter().find(|o| o.engine == "pmekv" && o.workload == Workload::Fillrandom && o.threads == t);
        o.unwrap().rounds.clone()
    };
    let mut ratios: Vec<f64> = rounds(1).iter().zip(rounds(2)).map(|(b, v)| v / b).collect();
    ratios.sort_by(f64::total_cmp);
    let paired = table.split("within each round").nth(1).unwrap_or_else(|| panic!("no paired ratios: {table}"));
    let line = paired.lines().find(|l| l.starts_with("fillrandom") && l.contains("pmekv")).unwrap();
    let want = format!("{:.2}x [{:.2}, {:.2}]", ratios[1], ratios[0], ratios[2]);
    assert!(line.contains(&want), "{line} should hold {want}");
    let one = run(&BenchArgs { repeat: 1, threads: vec![1], ..a.clone() }).unwrap();
    assert!(one.outcomes.iter().all(|o| o.rounds.is_empty()));
    assert!(!serde_json::to_string(&one).unwrap().contains("\"rounds\""));
    assert!(run(&BenchArgs { repeat: 0, ..a.clone() }).is_err(), "0 rounds is refused");
}
