//! `tierkv bench`: parse flags, run every engine × value size × workload, report.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::cgroup::{self, MemCgroup};
use crate::engine::{self, EngineSpec};
use crate::job::{self, Event, Job, Phase};
use crate::report::{self, EngineInfo, Failure, MemoryUse, Recovery, Report, Setup};
use crate::run::{self, Loaded, Outcome, Params, Workload};

/// Parsed `tierkv bench` flags.
#[derive(Debug, Clone)]
pub struct BenchArgs {
    /// `--num`: records, and operations per load or overwrite workload.
    pub num: u64,
    /// `--reads`: operations per read, scan and YCSB run workload (`None`: `num`).
    pub reads: Option<u64>,
    /// `--time-cap`: seconds after which a workload stops (reported as capped).
    pub time_cap: Option<f64>,
    /// `--dram-budget` in MiB: every engine runs in a child process confined to this much
    /// memory (page cache included) by a memory cgroup ([`crate::job`]).
    pub dram_budget_mib: Option<u64>,
    /// `--pm-budget` in MiB: PM capacity per engine, preallocated at open.
    pub pm_budget_mib: Option<u64>,
    /// `--pm-profile`: `dram` (default) or `optane`.
    pub pm_profile: String,
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
    /// `--repeat`: rounds of the whole comparison (every engine, thread count and value
    /// size, each on a fresh store); the report keeps each measurement's median round
    /// ([`report::median_rounds`]). 1 (the default) is one round, reported as measured.
    pub repeat: usize,
    /// `--ycsb-fresh`: the YCSB workloads run on a fresh store (see [`run::segments`]).
    pub ycsb_fresh: bool,
    /// The `tierkv` executable, to run the crash child ([`crate::child`]) and, under
    /// `--dram-budget`, the job children ([`crate::job`]). Without it, only engines that
    /// can simulate a crash in-process (the tierkv presets) report recovery after a crash,
    /// and `--dram-budget` is an error.
    pub crash_exe: Option<PathBuf>,
    /// `--crash-writes`: the crash child is killed once this many of its writes were
    /// acknowledged (`None`: a random number in `1..=`[`crate::child::CHILD_WRITES`]).
    pub crash_writes: Option<u64>,
}

impl Default for BenchArgs {
    fn default() -> Self {
        BenchArgs {
            num: 500_000,
            reads: None,
            time_cap: None,
            dram_budget_mib: None,
            pm_budget_mib: None,
            pm_profile: "dram".into(),
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
            repeat: 1,
            ycsb_fresh: false,
            crash_exe: None,
            crash_writes: None,
        }
    }
}

impl BenchArgs {
    /// `--paper`: the papers' regime — data many times the DRAM budget (524,288 × 4 KiB
    /// db_bench records, then as many YCSB records in a fresh store, each 8× the 256 MiB
    /// budget), Optane's latencies, every engine, the db_bench and YCSB workloads, reads
    /// bounded and every workload capped at 120 s. 4 KiB values rather than the papers'
    /// 1 KiB: the DRAM-indexed designs keep 150–250 bytes of DRAM per key, more than 1/8 of
    /// a 1 KiB record, so at 1 KiB no budget 8× under the data holds their indexes (see
    /// `docs/design/bench.md`). Sized to finish in about an hour on 2 cores. Explicit flags
    /// override any of these.
    pub fn paper() -> BenchArgs {
        BenchArgs {
            num: 524_288,
            value_sizes: vec![4096],
            reads: Some(100_000),
            time_cap: Some(120.0),
            dram_budget_mib: Some(256),
            pm_budget_mib: Some(8192),
            pm_profile: "optane".into(),
            workloads: parse_workloads(PAPER_WORKLOADS).unwrap_or_default(),
            ycsb_fresh: true,
            engines: engine::known_engines()
                .into_iter()
                .map(|e| if e == "hoakv" { PAPER_HOAKV.to_string() } else { e })
                .collect(),
            ..BenchArgs::default()
        }
    }
}

/// HoaKV in `--paper`: its ColdStore MemTable at 16 MiB instead of the paper's 64 MB. With
/// 4 KiB values (under Value_Size, so they stay in the LSM) two 64 MiB MemTables, the block
/// cache and the cold index kept ~250 MB of heap (measured RssAnon), and the OOM killer
/// stopped it at the 256 MiB budget; at 16 MiB it holds ~95 MB.
pub const PAPER_HOAKV: &str = "hoakv/mem=16";

/// The workloads of `--paper`.
pub const PAPER_WORKLOADS: &str =
    "fillrandom,readrandom,seekrandom,overwrite,ycsb-load,ycsb-a,ycsb-b,ycsb-c,ycsb-d,ycsb-e,ycsb-f";

/// The progress bar of one workload (drawn on stderr when it is a terminal).
pub fn progress_bar(p: &Params, w: Workload, name: &str, tag: &str) -> indicatif::ProgressBar {
    let n = p.ops_of(w);
    let bar =
        indicatif::ProgressBar::new(if matches!(w, Workload::Seekrandom | Workload::YcsbScan) { n / 10 } else { n });
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>28} [{bar:40}] {human_pos}/{human_len} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("{name} {} B {}{tag}", p.value_size, w.name()));
    bar
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

/// What the engines of a run produced so far.
#[derive(Default)]
struct Acc {
    outcomes: Vec<Outcome>,
    recovery: Vec<Recovery>,
    memory: Vec<MemoryUse>,
    failures: Vec<Failure>,
}

/// Create `dir` (and its parents) if missing.
fn ensure_dir(dir: &Path, flag: &str) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{flag} {}: {e}", dir.display()))
}

/// Run the benchmark; prints the table and writes JSON if asked. Returns the report.
pub fn run(a: &BenchArgs) -> Result<Report, String> {
    let shm = Path::new("/dev/shm");
    let disk_base = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    ensure_dir(&disk_base, "--dir")?;
    let pm_base = a.pm_dir.clone().unwrap_or_else(|| if shm.is_dir() { shm.to_path_buf() } else { disk_base.clone() });
    ensure_dir(&pm_base, "--pm-dir")?;
    if a.threads.is_empty() || a.threads.contains(&0) {
        return Err("--threads: give one or more counts, each at least 1".into());
    }
    if a.repeat == 0 {
        return Err("--repeat: give a number of rounds, at least 1".into());
    }
    if a.crash_writes == Some(0) {
        return Err("--crash-writes: give a number of writes, at least 1".into());
    }
    a.pm_profile.parse::<tierkv::pm::PmProfile>().map_err(|e| format!("--pm-profile: {e}"))?;
    let pm_on_tmpfs = cgroup::is_tmpfs(&pm_base);
    let has_pm = a.engines.iter().any(|e| !engine::is_peer(e));
    if a.durable && pm_on_tmpfs && has_pm {
        eprintln!("PM on tmpfs: power loss is emulated only (msync is a no-op there)");
    }
    let mut setup = Setup {
        dram_budget_bytes: a.dram_budget_mib.map(|m| m << 20),
        pm_budget_bytes: a.pm_budget_mib.map(|m| m << 20),
        pm_profile: a.pm_profile.clone(),
        dir: disk_base.display().to_string(),
        pm_dir: pm_base.display().to_string(),
        pm_on_tmpfs,
        durable: a.durable,
        cgroup: None,
    };
    let confined = match a.dram_budget_mib {
        None => None,
        Some(0) => return Err("--dram-budget: give a size in MiB".into()),
        Some(mib) => {
            if cgroup::is_tmpfs(&disk_base) {
                return Err(format!(
                    "--dram-budget: --dir {} is on tmpfs, whose pages are DRAM the budget cannot reclaim; \
                     put the data on a disk file system",
                    disk_base.display()
                ));
            }
            let exe = a.crash_exe.clone().ok_or("--dram-budget needs the tierkv executable to run job children")?;
            // Fail before any work when the controller is missing.
            let (_, version) = cgroup::parent()?;
            setup.cgroup = Some(version);
            Some((exe, mib << 20))
        }
    };
    let base = Params {
        num: a.num,
        reads: a.reads,
        time_cap_seconds: a.time_cap,
        value_size: a.value_sizes.first().copied().unwrap_or(0),
        key_size: a.key_size,
        scan_len: a.scan_len,
        seed: a.seed,
        threads: a.threads.first().copied().unwrap_or(1),
        ycsb_fresh: a.ycsb_fresh,
        crash_writes: a.crash_writes,
    };
    let mut acc = Acc::default();
    // Rounds outermost: a noisy spell of the machine falls on every engine of a round
    // rather than on one engine's every measurement.
    for _round in 0..a.repeat {
        for &value_size in &a.value_sizes {
            for name in &a.engines {
                for (step, &threads) in a.threads.iter().enumerate() {
                    let params = Params { value_size, threads, ..base.clone() };
                    let disk = tempfile::Builder::new()
                        .prefix("tierkv-bench-")
                        .tempdir_in(&disk_base)
                        .map_err(|e| format!("--dir {}: {e}", disk_base.display()))?;
                    let pm = tempfile::Builder::new()
                        .prefix("tierkv-bench-pm-")
                        .tempdir_in(&pm_base)
                        .map_err(|e| format!("--pm-dir {}: {e}", pm_base.display()))?;
                    let spec = EngineSpec {
                        name: name.clone(),
                        dir: disk.path().join("db"),
                        pm_dir: pm.path().to_path_buf(),
                        durable: a.durable,
                        pm_budget: a.pm_budget_mib.map(|m| m << 20),
                        pm_profile: Some(a.pm_profile.clone()),
                        dram_budget: a.dram_budget_mib.map(|m| m << 20),
                    };
                    match &confined {
                        Some((exe, limit)) => run_confined(a, exe, &spec, &params, step == 0, *limit, &mut acc)?,
                        None => run_in_process(a, &spec, &params, step == 0, &mut acc)?,
                    }
                }
            }
        }
    }
    if a.repeat > 1 {
        report::median_rounds(&mut acc.outcomes, &mut acc.recovery, &mut acc.memory);
    }
    // Group by value size, then workload order, then engine order.
    let mut outcomes = acc.outcomes;
    outcomes.sort_by_key(|o| {
        let wi = a.workloads.iter().position(|w| *w == o.workload).unwrap_or(usize::MAX);
        let ei = a.engines.iter().position(|e| *e == o.engine).unwrap_or(usize::MAX);
        let ti = a.threads.iter().position(|&t| t == o.threads).unwrap_or(usize::MAX);
        (o.value_size, wi, ti, ei)
    });
    let engines = a
        .engines
        .iter()
        .map(|e| EngineInfo { engine: e.clone(), durability: engine::durability(e, a.durable, pm_on_tmpfs) })
        .collect();
    let rep = Report {
        schema: report::SCHEMA,
        params: base,
        setup,
        engines,
        outcomes,
        recovery: acc.recovery,
        memory: acc.memory,
        failures: acc.failures,
    };
    print!("{}", report::table(&rep));
    if let Some(out) = &a.out {
        let dir = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        ensure_dir(dir, "--out")?;
        let json = serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?;
        std::fs::write(out, json).map_err(|e| format!("{}: {e}", out.display()))?;
        eprintln!("wrote {}", out.display());
        match crate::plot::write_all(&rep, dir, &crate::plot::prefix_for(out)) {
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

/// One engine × value size × thread count in this process (no `--dram-budget`).
fn run_in_process(a: &BenchArgs, spec: &EngineSpec, params: &Params, first: bool, acc: &mut Acc) -> Result<(), String> {
    let name = &spec.name;
    let segments = run::segments(&a.workloads, params.ycsb_fresh);
    let mut e = engine::open(spec)?;
    for (i, seg) in segments.iter().enumerate() {
        if i > 0 {
            drop(e);
            wipe(spec)?;
            e = engine::open(spec)?;
        }
        let mut loaded = Loaded::default();
        for &w in seg {
            let bar = progress_bar(params, w, name, &thread_tag(&a.threads, params.threads));
            let o = run::run_with_progress(e.as_ref(), w, params, &mut loaded, &bar);
            bar.finish_and_clear();
            if let Some(o) = o? {
                acc.outcomes.push(o);
            }
        }
    }
    // Recovery is measured once per engine and value size (the sweep's first count).
    if !first || !e.recovers() {
        return Ok(());
    }
    let t = Instant::now();
    let open = reopen_to_first_read(e.as_mut(), a.key_size)
        .map_err(|err| format!("{name}: reopen after the workloads failed: {err}"))?;
    let seconds = (t.elapsed().as_secs_f64(), open);
    let crashed = match &a.crash_exe {
        Some(exe) => {
            drop(e);
            crate::child::measure(exe, spec, params.num, a.key_size, params.value_size, params.crash_writes)
        }
        None => crate::child::measure_in_process(e.as_mut(), a.key_size, params.value_size, params.crash_writes),
    };
    let crash = match crashed {
        Ok(r) => Some(r),
        // An acknowledged write lost by a crash fails the run.
        Err(crate::child::CrashError::Lost(msg)) => {
            return Err(format!("recovery after a crash lost acknowledged writes: {msg}"))
        }
        Err(crate::child::CrashError::NotMeasured(err)) => {
            if a.crash_exe.is_some() {
                eprintln!("warning: {name}: recovery after a crash not measured: {err}");
            }
            None
        }
    };
    acc.recovery.push(recovery_row(spec, params, seconds, crash));
    Ok(())
}

/// Remove an engine's store (its disk directory and its PM pools) so the next open starts
/// empty (`--ycsb-fresh`).
fn wipe(spec: &EngineSpec) -> Result<(), String> {
    match std::fs::remove_dir_all(&spec.dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("removing {}: {e}", spec.dir.display())),
    }
    let entries = std::fs::read_dir(&spec.pm_dir).map_err(|e| format!("{}: {e}", spec.pm_dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| format!("{}: {e}", spec.pm_dir.display()))?.path();
        let r = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
        r.map_err(|e| format!("removing {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Clean close and open of `e`, then reads of db_bench's keys 0, 1, 2, ... until one is
/// present (at most 64; a store without them times 64 misses): the seconds from the
/// open's start to the first value served (the close not included).
pub fn reopen_to_first_read(e: &mut dyn crate::api::BenchEngine, key_size: usize) -> Result<f64, String> {
    let open = e.reopen()?;
    let t = Instant::now();
    for i in 0..64u64 {
        if e.get_value(&crate::workload::db_bench_key(i, key_size))?.is_some() {
            break;
        }
    }
    Ok(open + t.elapsed().as_secs_f64())
}

fn recovery_row(
    spec: &EngineSpec,
    params: &Params,
    (seconds, open_seconds): (f64, f64),
    crash: Option<crate::child::CrashRecovery>,
) -> Recovery {
    Recovery {
        engine: spec.name.clone(),
        value_size: params.value_size,
        seconds,
        open_seconds: Some(open_seconds),
        after_crash_seconds: crash.as_ref().map(|c| c.seconds),
        verified_keys: crash.as_ref().map(|c| c.verified),
        acknowledged_keys: crash.as_ref().map(|c| c.acknowledged),
        after_crash_figures: crash.map(|c| c.figures).unwrap_or_default(),
    }
}

/// One engine × value size × thread count in job children confined to a memory cgroup of
/// `limit` bytes ([`crate::job`]): the workloads, then (`first`) recovery after a crash.
/// A child that fails (e.g. stopped by the OOM killer) is recorded in `acc.failures` and
/// the run goes on; a lost acknowledged write fails the run.
fn run_confined(
    a: &BenchArgs,
    exe: &Path,
    spec: &EngineSpec,
    params: &Params,
    first: bool,
    limit: u64,
    acc: &mut Acc,
) -> Result<(), String> {
    let name = &spec.name;
    // The guard removes the group on every way out of this function.
    let cg = MemCgroup::create(limit)?;
    // One job child per segment (a fresh store each, `--ycsb-fresh`), in the same group;
    // the clean reopen is timed after the last.
    let segments = run::segments(&a.workloads, params.ycsb_fresh);
    let mut job = Job {
        spec: spec.clone(),
        params: params.clone(),
        workloads: Vec::new(),
        procs: Some(cg.procs_file()),
        phase: Phase::Workloads { reopen: false },
        crash_exe: None,
    };
    let mut events = Vec::new();
    let mut failed = None;
    let mut pm_bytes = 0;
    for (i, seg) in segments.iter().enumerate() {
        if i > 0 {
            pm_bytes = pm_bytes.max(cgroup::allocated_bytes(&spec.pm_dir));
            if let Err(why) = wipe(spec) {
                failed = Some(why);
                break;
            }
        }
        job.workloads = seg.clone();
        job.phase = Phase::Workloads { reopen: first && i + 1 == segments.len() };
        let ran = job::spawn(exe, &job)?;
        events.extend(ran.events.iter().cloned());
        failed = ran.failure();
        if failed.is_some() {
            break;
        }
    }
    let (peak, major_faults) = (cg.peak(), cg.major_faults());
    let fail = |what: &str, why: String, acc: &mut Acc| {
        let oom = cg.oom_kills().unwrap_or(0) > 0;
        let why = if oom { format!("{why} (the OOM killer stopped it at the DRAM budget)") } else { why };
        eprintln!("warning: {name} {} B: {what} failed: {why}", params.value_size);
        acc.failures.push(Failure {
            engine: name.clone(),
            value_size: params.value_size,
            threads: params.threads,
            what: format!("{what}: {why}"),
        });
    };
    let mut reopen = None;
    let mut disk_bytes_read = 0;
    for ev in events {
        match ev {
            Event::Outcome(o) => {
                disk_bytes_read += o.disk_bytes_read;
                acc.outcomes.push(*o);
            }
            Event::Reopen(s, open) => reopen = Some((s, open)),
            _ => {}
        }
    }
    if let Some(why) = failed.clone() {
        fail("workloads", why, acc);
    }
    let mut recovery_peak = None;
    if let (true, None, Some(seconds)) = (first, &failed, reopen) {
        let reset = cg.reset_peak();
        let rjob = Job { phase: Phase::Recovery, crash_exe: Some(exe.to_path_buf()), ..job };
        let rec = job::spawn(exe, &rjob)?;
        recovery_peak = if reset { cg.peak() } else { None };
        let mut crash = None;
        for ev in &rec.events {
            match ev {
                Event::Crash(r) => crash = Some(r.clone()),
                Event::Lost(m) => return Err(format!("recovery after a crash lost acknowledged writes: {m}")),
                Event::CrashNotMeasured(m) => eprintln!("warning: {name}: recovery after a crash not measured: {m}"),
                _ => {}
            }
        }
        if let Some(why) = rec.failure() {
            fail("recovery", why, acc);
        }
        acc.recovery.push(recovery_row(spec, params, seconds, crash));
    }
    acc.memory.push(MemoryUse {
        engine: name.clone(),
        value_size: params.value_size,
        threads: params.threads,
        limit_bytes: limit,
        peak_bytes: peak,
        recovery_peak_bytes: recovery_peak,
        at_limit: peak.is_some_and(|p| p as f64 >= limit as f64 * 0.98),
        pm_bytes: pm_bytes.max(cgroup::allocated_bytes(&spec.pm_dir)),
        major_faults,
        disk_bytes_read,
        oom_kills: cg.oom_kills(),
    });
    Ok(())
}
