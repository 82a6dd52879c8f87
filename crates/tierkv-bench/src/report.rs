//! Output of a run: an aligned table on stdout and JSON.
//!
//! Every throughput is also shown relative to LevelDB's on the same workload and value size
//! (the papers' normalisation) and as a fraction of the `limit` pseudo-engine's, when those
//! engines took part and support the workload.

use std::fmt::Write;

use crate::run::{Outcome, Params};

/// Schema version of the JSON report: 2 added `engines`, `memory`, `failures`, `setup`,
/// the outcomes' `planned_ops`, `capped` and `disk_bytes_read`, and the recoveries'
/// `acknowledged_keys`.
pub const SCHEMA: u32 = 2;

/// Everything a run produced.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Report {
    /// Schema version of this JSON ([`SCHEMA`]; bumped on incompatible changes).
    pub schema: u32,
    /// Parameters (value size varies per outcome).
    pub params: Params,
    /// The regime: budgets, PM profile, where the files lived.
    pub setup: Setup,
    /// Per engine: its durability level and configuration.
    pub engines: Vec<EngineInfo>,
    /// One entry per engine × workload × value size.
    pub outcomes: Vec<Outcome>,
    /// Recovery time (clean close + reopen after the run) per engine and value size.
    pub recovery: Vec<Recovery>,
    /// Under `--dram-budget`: what each engine's memory cgroup saw.
    pub memory: Vec<MemoryUse>,
    /// Engines (or phases) that failed without failing the run (under `--dram-budget`,
    /// e.g. a child the OOM killer stopped); what they finished before is in `outcomes`.
    pub failures: Vec<Failure>,
}

/// The regime of a run.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Setup {
    /// `--dram-budget` in bytes (memory cgroup limit per engine, page cache included).
    pub dram_budget_bytes: Option<u64>,
    /// `--pm-budget` in bytes (PM capacity per engine, preallocated).
    pub pm_budget_bytes: Option<u64>,
    /// `--pm-profile`.
    pub pm_profile: String,
    /// Directory of the disk files.
    pub dir: String,
    /// Directory of the PM pools.
    pub pm_dir: String,
    /// The PM directory is on tmpfs (DRAM standing in for PM; msync writes nothing).
    pub pm_on_tmpfs: bool,
    /// `--durable`.
    pub durable: bool,
    /// The cgroup interface used (`v1`, `v2`), under `--dram-budget`.
    pub cgroup: Option<crate::cgroup::Version>,
}

/// One engine of the run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EngineInfo {
    /// Engine name.
    pub engine: String,
    /// The crash its acknowledged writes survive: `process-crash`, `power-loss`, or
    /// `power-loss (emulated: PM on tmpfs)` ([`crate::engine::durability`]).
    pub durability: String,
}

/// What an engine's memory cgroup saw (`--dram-budget`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct MemoryUse {
    /// Engine.
    pub engine: String,
    /// Value size.
    pub value_size: usize,
    /// Client threads.
    pub threads: usize,
    /// The cgroup limit in bytes: the DRAM budget (heap, page cache, kernel memory).
    pub limit_bytes: u64,
    /// Peak charge during the workloads (v1 `memory.max_usage_in_bytes`, v2
    /// `memory.peak`); `None` when the kernel does not record it.
    pub peak_bytes: Option<u64>,
    /// Peak charge during the recovery phase (v1: the peak is reset before it; v2 kernels
    /// that cannot reset report the lifetime peak again).
    pub recovery_peak_bytes: Option<u64>,
    /// The peak reached the limit (within 2%): the engine ran under memory pressure.
    pub at_limit: bool,
    /// PM bytes the engine's pools occupy (allocated blocks of the pool files) — charged
    /// outside the budget, to the harness.
    pub pm_bytes: u64,
    /// Major page faults in the group (its `memory.stat`), the workloads' phase.
    pub major_faults: Option<u64>,
    /// Bytes read from disk by the workloads (sum of the outcomes' `disk_bytes_read`).
    pub disk_bytes_read: u64,
    /// Processes the OOM killer stopped in the group.
    pub oom_kills: Option<u64>,
}

/// An engine, or one phase of it, that failed.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Failure {
    /// Engine.
    pub engine: String,
    /// Value size.
    pub value_size: usize,
    /// Client threads.
    pub threads: usize,
    /// What failed and why.
    pub what: String,
}

/// Time to close cleanly and reopen a loaded store.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Recovery {
    /// Engine.
    pub engine: String,
    /// Value size.
    pub value_size: usize,
    /// Seconds for a clean close + open after the workloads.
    pub seconds: f64,
    /// Of `seconds`, those from the start of the open to its first served read (a get).
    #[serde(default)]
    pub open_seconds: Option<f64>,
    /// Seconds from `open` to the first served read after a crash: a child process wrote
    /// fresh keys to the store and was killed with SIGKILL at a random moment (without the `tierkv` executable, e.g. in tests: a simulated crash, for
    /// the engines that can simulate one in-process).
    pub after_crash_seconds: Option<f64>,
    /// Keys the crashed writer had acknowledged that were verified (present, with their
    /// values) after the reopen; `None` when recovery after a crash was not measured.
    pub verified_keys: Option<u64>,
    /// Writes the crashed writer had acknowledged; `verified_keys` must equal it (a lost
    /// acknowledged write fails the run).
    pub acknowledged_keys: Option<u64>,
    /// The engine's own figures of the recovery after the crash (`native`: `replayed_bytes`,
    /// `recovery_deltas`, `recovery_us`, …; empty for the peers).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub after_crash_figures: std::collections::BTreeMap<String, u64>,
}

/// `--repeat`: collapse each measurement's rounds into its median round. Outcomes are
/// grouped by engine, workload, value size and thread count (in the order they first
/// appear); the one kept is the round with the median ops/s (the lower of the middle two
/// for an even count), its latencies, usage and design figures unchanged, with every
/// round's ops/s in `rounds` in round order. Ratios in the table are then ratios of
/// medians (each engine's median round on its own: the rounds behind a ratio may differ;
/// `rounds` has them all). A recovery row (per engine and value size) is the round with
/// the median clean-reopen `seconds`, its SIGKILL figures that round's; a memory row (per
/// engine, value size and threads) the round with the highest peak. Failures are all
/// kept, one line per round that failed.
pub fn median_rounds(outcomes: &mut Vec<Outcome>, recovery: &mut Vec<Recovery>, memory: &mut Vec<MemoryUse>) {
    let key = |o: &Outcome| (o.engine.clone(), o.workload, o.value_size, o.threads);
    *outcomes = groups(std::mem::take(outcomes), key)
        .into_iter()
        .filter_map(|g| {
            let rounds: Vec<f64> = g.iter().map(|o| o.ops_per_sec).collect();
            let mut o = median_by(g, |o| o.ops_per_sec)?;
            o.rounds = rounds;
            Some(o)
        })
        .collect();
    *recovery = groups(std::mem::take(recovery), |r| (r.engine.clone(), r.value_size))
        .into_iter()
        .filter_map(|g| median_by(g, |r| r.seconds))
        .collect();
    *memory = groups(std::mem::take(memory), |m| (m.engine.clone(), m.value_size, m.threads))
        .into_iter()
        .filter_map(|g| g.into_iter().max_by_key(|m| m.peak_bytes.unwrap_or(0)))
        .collect();
}

/// `items` grouped by `key`, groups in order of first appearance, items in order.
fn groups<T, K: PartialEq>(items: Vec<T>, key: impl Fn(&T) -> K) -> Vec<Vec<T>> {
    let mut out: Vec<(K, Vec<T>)> = Vec::new();
    for it in items {
        let k = key(&it);
        match out.iter_mut().find(|(g, _)| *g == k) {
            Some((_, v)) => v.push(it),
            None => out.push((k, vec![it])),
        }
    }
    out.into_iter().map(|(_, v)| v).collect()
}

/// The item with the median `by` (the lower of the middle two for an even count).
fn median_by<T>(mut items: Vec<T>, by: impl Fn(&T) -> f64) -> Option<T> {
    items.sort_by(|a, b| by(a).total_cmp(&by(b)));
    let mid = items.len().checked_sub(1)? / 2;
    Some(items.swap_remove(mid))
}

fn fmt_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.1}ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1}us", ns / 1e3)
    } else {
        format!("{ns:.0}ns")
    }
}

/// The aligned table.
pub fn table(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:>7} {:<10} {:>3} {:>12} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>9}",
        "workload",
        "value",
        "engine",
        "thr",
        "ops/s",
        "x leveldb",
        "x limit",
        "mean",
        "p50",
        "p99",
        "p99.9",
        "WA pm",
        "WA disk",
        "disk rd"
    );
    let mut last: Option<(&str, usize, usize)> = None;
    for o in &r.outcomes {
        let group = (o.workload.name(), o.value_size, o.threads);
        if last.is_some_and(|l| l != group) {
            out.push('\n');
        }
        last = Some(group);
        let relative = |engine: &str| {
            let base = r
                .outcomes
                .iter()
                .find(|x| {
                    x.engine == engine
                        && x.workload == o.workload
                        && x.value_size == o.value_size
                        && x.threads == o.threads
                })
                .map(|x| x.ops_per_sec);
            match base {
                Some(b) if b > 0.0 => format!("{:.2}", o.ops_per_sec / b),
                _ => "-".into(),
            }
        };
        let wa = |x: f64| if o.usage.user_bytes_written > 0 { format!("{x:.2}") } else { "-".into() };
        let ops = if o.capped { format!("{:.0}*capped", o.ops_per_sec) } else { format!("{:.0}", o.ops_per_sec) };
        let _ = writeln!(
            out,
            "{:<16} {:>7} {:<10} {:>3} {:>12} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7} {:>9}",
            o.workload.name(),
            o.value_size,
            o.engine,
            o.threads,
            ops,
            relative("leveldb"),
            relative("limit"),
            fmt_ns(o.latency.mean_ns),
            fmt_ns(o.latency.p50_ns as f64),
            fmt_ns(o.latency.p99_ns as f64),
            fmt_ns(o.latency.p999_ns as f64),
            wa(o.write_amp_pm),
            wa(o.write_amp_disk),
            fmt_bytes(o.disk_bytes_read),
        );
    }
    if r.outcomes.iter().any(|o| o.capped) {
        let cap = r.params.time_cap_seconds.unwrap_or(0.0);
        let _ = writeln!(out, "\n*capped: stopped by --time-cap {cap} s; ops/s over the operations completed:");
        for o in r.outcomes.iter().filter(|o| o.capped) {
            let _ = writeln!(
                out,
                "  {:<16} {:<10} {} of {} operations in {:.0} s",
                o.workload.name(),
                o.engine,
                o.ops,
                o.planned_ops,
                o.seconds
            );
        }
    }
    out.push_str(&rounds(r));
    out.push_str(&sweep(r));
    for o in r.outcomes.iter().filter(|o| o.background_writes > 0) {
        let _ = writeln!(
            out,
            "\n{} {} B: the background writer did {} writes during the reads",
            o.engine, o.value_size, o.background_writes
        );
    }
    if !r.recovery.is_empty() {
        let _ = writeln!(
            out,
            "\nrecovery: clean close + reopen (of which open to first served read) | after SIGKILL of a writer \
             process: open to first served read, keys recovered / acknowledged"
        );
        for rec in &r.recovery {
            let crash = match (rec.after_crash_seconds, rec.verified_keys, rec.acknowledged_keys) {
                (Some(s), Some(v), Some(a)) => format!("{s:.3} s, {v} / {a} keys"),
                (Some(s), _, _) => format!("{s:.3} s"),
                _ => "not measured".to_string(),
            };
            let open = rec.open_seconds.map_or(String::new(), |s| format!(" (open {s:.3} s)"));
            let _ =
                writeln!(out, "  {:<10} value {:>6}: {:.3} s{open} | {crash}", rec.engine, rec.value_size, rec.seconds);
        }
    }
    out.push_str(&memory(r));
    if !r.engines.is_empty() {
        let _ = writeln!(out, "\ndurability (what an acknowledged write survives):");
        for e in &r.engines {
            let _ = writeln!(out, "  {:<10} {}", e.engine, e.durability);
        }
    }
    for f in &r.failures {
        let _ = writeln!(out, "\nFAILED: {} value {} threads {}: {}", f.engine, f.value_size, f.threads, f.what);
    }
    out
}

/// Bytes in KiB/MiB/GiB.
pub fn fmt_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.1}G", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.1}M", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.0}K", b / 1024.0)
    } else {
        format!("{b:.0}")
    }
}

/// The memory section (`--dram-budget`): per engine, the cgroup's limit and peak, PM apart.
pub fn memory(r: &Report) -> String {
    let mut out = String::new();
    if r.memory.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\nmemory: DRAM budget per engine (memory cgroup {}, page cache included); PM pools charged outside it",
        r.setup.cgroup.map_or("-", |v| if v == crate::cgroup::Version::V1 { "v1" } else { "v2" })
    );
    let _ = writeln!(
        out,
        "  {:<10} {:>7} {:>3} {:>9} {:>9} {:>9} {:>8} {:>9} {:>11} {:>9} {:>4}",
        "engine", "value", "thr", "limit", "peak", "rec peak", "at lim", "PM", "maj faults", "disk rd", "oom"
    );
    for m in &r.memory {
        let opt = |x: Option<u64>| x.map_or("-".to_string(), fmt_bytes);
        let _ = writeln!(
            out,
            "  {:<10} {:>7} {:>3} {:>9} {:>9} {:>9} {:>8} {:>9} {:>11} {:>9} {:>4}",
            m.engine,
            m.value_size,
            m.threads,
            fmt_bytes(m.limit_bytes),
            opt(m.peak_bytes),
            opt(m.recovery_peak_bytes),
            if m.at_limit { "yes" } else { "no" },
            fmt_bytes(m.pm_bytes),
            m.major_faults.map_or("-".to_string(), |x| x.to_string()),
            fmt_bytes(m.disk_bytes_read),
            m.oom_kills.map_or("-".to_string(), |x| x.to_string()),
        );
    }
    out
}

/// Under `--repeat`: every round's ops/s per measurement and their spread.
pub fn rounds(r: &Report) -> String {
    let mut out = String::new();
    let Some(n) = r.outcomes.iter().map(|o| o.rounds.len()).max().filter(|&n| n > 1) else { return out };
    let _ = writeln!(
        out,
        "\nrounds (--repeat {n}): ops/s of each round, in order; the rows above are each measurement's median round"
    );
    for o in r.outcomes.iter().filter(|o| o.rounds.len() > 1) {
        let each: Vec<String> = o.rounds.iter().map(|v| format!("{v:.0}")).collect();
        let (lo, hi) = o.rounds.iter().fold((f64::MAX, 0f64), |(l, h), &v| (l.min(v), h.max(v)));
        let spread =
            if o.ops_per_sec > 0.0 { format!("{:.0}%", (hi - lo) / o.ops_per_sec * 100.0) } else { "-".into() };
        let _ = writeln!(
            out,
            "  {:<16} {:>7} {:<10} {:>3}: {} (max − min: {spread} of the median)",
            o.workload.name(),
            o.value_size,
            o.engine,
            o.threads,
            each.join(" / ")
        );
    }
    out
}

/// One table of the thread sweep: `title`, a header naming `counts`, and a row per engine,
/// workload and value size (in the report's order) whose cell at each count is
/// `cell(that row's outcome at the count, at the first count)`, or `-` without one.
fn sweep_table(
    r: &Report,
    title: &str,
    counts: &[usize],
    base: usize,
    cell: impl Fn(&Outcome, Option<&Outcome>) -> Option<String>,
) -> String {
    let mut out = format!("\n{title}\n");
    let _ = write!(out, "{:<16} {:>7} {:<10}", "workload", "value", "engine");
    for c in counts {
        let _ = write!(out, " {:>18}", format!("{c} thr"));
    }
    out.push('\n');
    let mut seen = std::collections::HashSet::new();
    for o in &r.outcomes {
        if !seen.insert((o.workload.name(), o.value_size, o.engine.as_str())) {
            continue;
        }
        let at = |t: usize| {
            r.outcomes.iter().find(|x| {
                x.engine == o.engine && x.workload == o.workload && x.value_size == o.value_size && x.threads == t
            })
        };
        let _ = write!(out, "{:<16} {:>7} {:<10}", o.workload.name(), o.value_size, o.engine);
        for &c in counts {
            let text = at(c).and_then(|x| cell(x, at(base))).unwrap_or_else(|| "-".into());
            let _ = write!(out, " {text:>18}");
        }
        out.push('\n');
    }
    out
}

/// The median of sorted values (the mean of the middle two for an even count).
fn median_sorted(v: &[f64]) -> f64 {
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The thread sweep, when the run had more than one thread count: per engine, workload and
/// value size, the throughput at each count and its ratio to the smallest count's.
///
/// Under `--repeat`, each count's ratio to the first count's within each round, and the
/// median of those ratios with their range. A round runs an engine's counts back to back,
/// so a ratio within one round is between measurements seconds apart; the ratio of two
/// medians can pair a fast spell of the machine with a slow one (rounds of one
/// measurement here spread 30–60 % on a shared VM).
///
/// Then, per count, the cores the workload kept busy (process CPU time over wall time) and
/// the CPU time an operation cost. That table says why a curve bends: a count whose
/// cores-busy is already near the machine's cores has no CPU left to scale into, and CPU
/// per operation that grows with the count is time spent contending (locks, shared cache
/// lines), not working.
pub fn sweep(r: &Report) -> String {
    let mut counts: Vec<usize> = r.outcomes.iter().map(|o| o.threads).collect();
    counts.sort_unstable();
    counts.dedup();
    if counts.len() < 2 {
        return String::new();
    }
    let first = counts[0];
    let mut out = sweep_table(
        r,
        &format!("thread sweep: ops/s at each count (ratio to {first} thread(s))"),
        &counts,
        first,
        |x, b| {
            Some(match b.map(|b| b.ops_per_sec) {
                Some(b) if b > 0.0 => format!("{:.0} ({:.2}x)", x.ops_per_sec, x.ops_per_sec / b),
                _ => format!("{:.0}", x.ops_per_sec),
            })
        },
    );
    if r.outcomes.iter().any(|o| o.rounds.len() > 1) {
        out.push_str(&sweep_table(
            r,
            &format!("ratio to {first} thread(s) within each round: median of the rounds' ratios [lowest, highest]"),
            &counts[1..],
            first,
            |x, b| {
                let base = &b?.rounds;
                let mut ratios: Vec<f64> =
                    base.iter().zip(&x.rounds).filter(|(b, _)| **b > 0.0).map(|(b, v)| v / b).collect();
                ratios.sort_by(f64::total_cmp);
                let (lo, hi) = (ratios.first()?, ratios.last()?);
                (ratios.len() == base.len() && ratios.len() > 1)
                    .then(|| format!("{:.2}x [{lo:.2}, {hi:.2}]", median_sorted(&ratios)))
            },
        ));
    }
    out.push_str(&sweep_table(
        r,
        &format!(
            "cores busy (process CPU time / wall time) and CPU time per operation at each count ({} cores here)",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        ),
        &counts,
        first,
        |x, _| {
            (x.seconds > 0.0 && x.ops > 0 && x.cpu_seconds > 0.0)
                .then(|| format!("{:.2}, {}", x.cpu_seconds / x.seconds, fmt_ns(x.cpu_seconds * 1e9 / x.ops as f64)))
        },
    ));
    out
}
