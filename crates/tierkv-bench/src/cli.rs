//! `tierkv bench`: parse flags, run every engine × value size × workload, report.

use std::path::PathBuf;
use std::time::Instant;

use crate::engine::{self, EngineSpec};
use crate::report::{self, Recovery, Report};
use crate::run::{self, Loaded, Params, Workload};

/// Parsed `tierkv bench` flags.
#[derive(Debug, Clone)]
pub struct BenchArgs {
    /// `--num`: records and operations per workload.
    pub num: u64,
    /// `--value-size`: one run per size.
    pub value_sizes: Vec<usize>,
    /// `--key-size` (db_bench keys).
    pub key_size: usize,
    /// `--scan-len` for seekrandom.
    pub scan_len: usize,
    /// `--engines`.
    pub engines: Vec<String>,
    /// `--workloads`, in order.
    pub workloads: Vec<Workload>,
    /// `--seed`.
    pub seed: u64,
    /// `--dir`: where disk files go (a fresh subdirectory per engine and size).
    pub dir: Option<PathBuf>,
    /// `--pm-dir`: where PM pools go (default under /dev/shm when present).
    pub pm_dir: Option<PathBuf>,
    /// `--out`: JSON path.
    pub out: Option<PathBuf>,
    /// `--threads`: client threads (readers for readwhilewriting); more than one count is a
    /// thread sweep (a fresh store per count).
    pub threads: Vec<usize>,
    /// `--durable`: peers fsync every write; tierkv msyncs PM.
    pub durable: bool,
    /// The `tierkv` executable, to run the crash child ([`crate::child`]). Without it, only
    /// engines that can simulate a crash in-process (the tierkv presets) report recovery
    /// after a crash.
    pub crash_exe: Option<PathBuf>,
}

impl Default for BenchArgs {
    fn default() -> Self {
        BenchArgs {
            num: 500_000,
            value_sizes: vec![1024],
            key_size: 16,
            scan_len: 100,
            engines: engine::known_engines(),
            workloads: ["fillrandom", "readrandom", "seekrandom", "overwrite", "ycsb-load", "ycsb-a", "ycsb-c"]
                .iter()
                .filter_map(|w| Workload::parse(w))
                .collect(),
            seed: 301,
            dir: None,
            pm_dir: None,
            out: None,
            threads: vec![1],
            durable: false,
            crash_exe: None,
        }
    }
}

/// ` (N threads)` in a sweep's progress lines, nothing otherwise.
fn thread_tag(sweep: &[usize], threads: usize) -> String {
    if sweep.len() > 1 {
        format!(" ({threads} threads)")
    } else {
        String::new()
    }
}

/// Parse `--workloads a,b,c`.
pub fn parse_workloads(s: &str) -> Result<Vec<Workload>, String> {
    s.split(',').map(|w| Workload::parse(w.trim()).ok_or_else(|| format!("unknown workload `{w}`"))).collect()
}

/// Parse `--engines a,b` against the known engines.
pub fn parse_engines(s: &str) -> Result<Vec<String>, String> {
    let known = engine::known_engines();
    s.split(',')
        .map(|e| {
            let e = e.trim().to_string();
            if let Some((base, schemes)) = e.split_once('/') {
                let preset: tierkv::Preset = base.parse().map_err(|err: tierkv::Error| err.to_string())?;
                engine::apply_variant(&mut tierkv::Options::new(), preset, schemes)?;
                return Ok(e);
            }
            if known.contains(&e) {
                Ok(e)
            } else {
                Err(format!("unknown engine `{e}` (known: {})", known.join(", ")))
            }
        })
        .collect()
}

/// Run the benchmark; prints the table and writes JSON if asked. Returns the report.
pub fn run(a: &BenchArgs) -> Result<Report, String> {
    let shm = std::path::Path::new("/dev/shm");
    let disk_base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let pm_base = a.pm_dir.clone().unwrap_or_else(|| if shm.is_dir() { shm.to_path_buf() } else { disk_base.clone() });
    let mut outcomes = Vec::new();
    let mut recovery = Vec::new();
    let base = Params {
        num: a.num,
        value_size: a.value_sizes.first().copied().unwrap_or(0),
        key_size: a.key_size,
        scan_len: a.scan_len,
        seed: a.seed,
        threads: a.threads.first().copied().unwrap_or(1),
    };
    if a.threads.is_empty() || a.threads.contains(&0) {
        return Err("--threads: give one or more counts, each at least 1".into());
    }
    for &value_size in &a.value_sizes {
        for name in &a.engines {
            for (step, &threads) in a.threads.iter().enumerate() {
                let params = Params { value_size, threads, ..base.clone() };
                let disk = tempfile::Builder::new()
                    .prefix("tierkv-bench-")
                    .tempdir_in(&disk_base)
                    .map_err(|e| e.to_string())?;
                let pm = tempfile::Builder::new()
                    .prefix("tierkv-bench-pm-")
                    .tempdir_in(&pm_base)
                    .map_err(|e| e.to_string())?;
                let spec = EngineSpec {
                    name: name.clone(),
                    dir: disk.path().join("db"),
                    pm_dir: pm.path().to_path_buf(),
                    durable: a.durable,
                };
                let mut e = engine::open(&spec)?;
                let mut loaded = Loaded::default();
                for &w in &a.workloads {
                    let bar = indicatif::ProgressBar::new(a.num);
                    bar.set_style(
                        indicatif::ProgressStyle::with_template(
                            "{prefix:>28} [{bar:40}] {human_pos}/{human_len} eta {eta}",
                        )
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                        .progress_chars("=> "),
                    );
                    bar.set_prefix(format!("{name} {value_size} B {}{}", w.name(), thread_tag(&a.threads, threads)));
                    let o = run::run_with_progress(e.as_ref(), w, &params, &mut loaded, &bar);
                    bar.finish_and_clear();
                    if let Some(o) = o? {
                        outcomes.push(o);
                    }
                }
                // Recovery is measured once per engine and value size (the sweep's first count).
                if step == 0 && e.recovers() {
                    let t = Instant::now();
                    e.reopen().map_err(|err| format!("{name}: reopen after the workloads failed: {err}"))?;
                    let seconds = t.elapsed().as_secs_f64();
                    let crashed = match &a.crash_exe {
                        Some(exe) => {
                            drop(e);
                            crate::child::measure(exe, &spec, a.num, a.key_size, value_size)
                        }
                        None => crate::child::measure_in_process(e.as_mut(), a.key_size, value_size),
                    };
                    let (after_crash_seconds, verified_keys) = match crashed {
                        Ok(r) => (Some(r.seconds), Some(r.verified)),
                        // An acknowledged write lost by a crash fails the run.
                        Err(crate::child::CrashError::Lost(msg)) => {
                            return Err(format!("recovery after a crash lost acknowledged writes: {msg}"))
                        }
                        Err(crate::child::CrashError::NotMeasured(err)) => {
                            if a.crash_exe.is_some() {
                                eprintln!("warning: {name}: recovery after a crash not measured: {err}");
                            }
                            (None, None)
                        }
                    };
                    recovery.push(Recovery {
                        engine: name.clone(),
                        value_size,
                        seconds,
                        after_crash_seconds,
                        verified_keys,
                    });
                }
            }
        }
    }
    // Group by value size, then workload order, then engine order.
    outcomes.sort_by_key(|o| {
        let wi = a.workloads.iter().position(|w| *w == o.workload).unwrap_or(usize::MAX);
        let ei = a.engines.iter().position(|e| *e == o.engine).unwrap_or(usize::MAX);
        let ti = a.threads.iter().position(|&t| t == o.threads).unwrap_or(usize::MAX);
        (o.value_size, wi, ti, ei)
    });
    let rep = Report { schema: 1, params: base, outcomes, recovery };
    print!("{}", report::table(&rep));
    if let Some(out) = &a.out {
        let json = serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?;
        std::fs::write(out, json).map_err(|e| format!("{}: {e}", out.display()))?;
        eprintln!("wrote {}", out.display());
        let dir = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        match crate::plot::write_all(&rep, dir) {
            Ok(files) => {
                for f in files {
                    eprintln!("wrote {}", f.display());
                }
            }
            // Plots are a convenience: a missing font must not lose the measurements.
            Err(err) => eprintln!("warning: no plots: {err}"),
        }
    }
    Ok(rep)
}
