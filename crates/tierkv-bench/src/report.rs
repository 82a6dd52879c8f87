//! Output of a run: an aligned table on stdout and JSON.
//!
//! Every throughput is also shown relative to LevelDB's on the same workload and value size
//! (the papers' normalisation) and as a fraction of the `limit` pseudo-engine's, when those
//! engines took part and support the workload.

use std::fmt::Write;

use crate::run::{Outcome, Params};

/// Everything a run produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Schema version of this JSON (bump on incompatible changes).
    pub schema: u32,
    /// Parameters (value size varies per outcome).
    pub params: Params,
    /// One entry per engine × workload × value size.
    pub outcomes: Vec<Outcome>,
    /// Recovery time (clean close + reopen after the run) per engine and value size.
    pub recovery: Vec<Recovery>,
}

/// Time to close cleanly and reopen a loaded store.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Recovery {
    /// Engine.
    pub engine: String,
    /// Value size.
    pub value_size: usize,
    /// Seconds for close + open.
    pub seconds: f64,
    /// Seconds from `open` to the first served read after a crash: a child process wrote
    /// fresh keys to the store and was killed with SIGKILL at a random moment (without the `tierkv` executable, e.g. in tests: a simulated crash, for
    /// the engines that can simulate one in-process).
    pub after_crash_seconds: Option<f64>,
    /// Keys the crashed writer had acknowledged that were verified (present, with their
    /// values) after the reopen; `None` when recovery after a crash was not measured.
    pub verified_keys: Option<u64>,
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
        "{:<16} {:>7} {:<10} {:>3} {:>12} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7}",
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
        "WA disk"
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
        let _ = writeln!(
            out,
            "{:<16} {:>7} {:<10} {:>3} {:>12.0} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7}",
            o.workload.name(),
            o.value_size,
            o.engine,
            o.threads,
            o.ops_per_sec,
            relative("leveldb"),
            relative("limit"),
            fmt_ns(o.latency.mean_ns),
            fmt_ns(o.latency.p50_ns as f64),
            fmt_ns(o.latency.p99_ns as f64),
            fmt_ns(o.latency.p999_ns as f64),
            wa(o.write_amp_pm),
            wa(o.write_amp_disk),
        );
    }
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
            "\nrecovery after the run: clean close + reopen | reopen after a crash (writer process killed with SIGKILL)"
        );
        for rec in &r.recovery {
            let crash = rec.after_crash_seconds.map_or("not measured".to_string(), |s| format!("{s:.3} s"));
            let _ = writeln!(out, "  {:<10} value {:>6}: {:.3} s | {crash}", rec.engine, rec.value_size, rec.seconds);
        }
    }
    out
}

/// The thread sweep, when the run had more than one thread count: per engine, workload and
/// value size, the throughput at each count and its ratio to the smallest count's.
pub fn sweep(r: &Report) -> String {
    let mut counts: Vec<usize> = r.outcomes.iter().map(|o| o.threads).collect();
    counts.sort_unstable();
    counts.dedup();
    let mut out = String::new();
    if counts.len() < 2 {
        return out;
    }
    let _ = write!(out, "\nthread sweep: ops/s at each count (ratio to {} thread(s))\n", counts[0]);
    let _ = write!(out, "{:<16} {:>7} {:<10}", "workload", "value", "engine");
    for c in &counts {
        let _ = write!(out, " {:>18}", format!("{c} thr"));
    }
    out.push('\n');
    let mut seen = std::collections::HashSet::new();
    for o in &r.outcomes {
        if !seen.insert((o.workload.name(), o.value_size, o.engine.as_str())) {
            continue;
        }
        let at = |t: usize| {
            r.outcomes
                .iter()
                .find(|x| {
                    x.engine == o.engine && x.workload == o.workload && x.value_size == o.value_size && x.threads == t
                })
                .map(|x| x.ops_per_sec)
        };
        let _ = write!(out, "{:<16} {:>7} {:<10}", o.workload.name(), o.value_size, o.engine);
        let base = at(counts[0]);
        for &c in &counts {
            let cell = match (at(c), base) {
                (Some(v), Some(b)) if b > 0.0 => format!("{v:.0} ({:.2}x)", v / b),
                (Some(v), _) => format!("{v:.0}"),
                (None, _) => "-".into(),
            };
            let _ = write!(out, " {cell:>18}");
        }
        out.push('\n');
    }
    out
}
