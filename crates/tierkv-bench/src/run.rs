//! Running workloads against an engine and measuring them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::api::{BenchEngine, Result, Usage};
use crate::workload::{db_bench_key, scan_len, ycsb_key, Latest, ScrambledZipfian};

/// The workloads, named as in db_bench and YCSB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    /// `num` puts of sequential keys.
    Fillseq,
    /// `num` puts of uniformly random keys.
    Fillrandom,
    /// `num` puts of uniformly random keys over existing data.
    Overwrite,
    /// `num` (or `--reads`) gets of uniformly random keys.
    Readrandom,
    /// One pass over the whole store in key order.
    Readseq,
    /// `num / 10` (or `--reads / 10`) range reads of `scan_len` entries from random keys.
    Seekrandom,
    /// YCSB load: `num` inserts of hashed `user…` keys.
    YcsbLoad,
    /// YCSB A: 50% read, 50% update, zipfian.
    YcsbA,
    /// YCSB B: 95% read, 5% update, zipfian.
    YcsbB,
    /// YCSB C: 100% read, zipfian.
    YcsbC,
    /// YCSB D: 95% read, 5% insert, latest.
    YcsbD,
    /// YCSB E: 95% scan (uniform 1..=100 entries), 5% insert, zipfian.
    YcsbE,
    /// YCSB F: 50% read, 50% read-modify-write, zipfian.
    YcsbF,
    /// `--threads` readers doing readrandom while one writer overwrites random keys as fast
    /// as it can (db_bench); read latency is reported.
    Readwhilewriting,
    /// 100% updates of existing keys, zipfian (HoaKV §4.2's update micro-benchmark).
    YcsbUpdate,
    /// `num / 10` scans of uniform 1..=100 entries from zipfian start keys (HoaKV §4.2's
    /// scan micro-benchmark: workload E without its inserts).
    YcsbScan,
}

impl Workload {
    /// Every workload, in a sensible run order.
    pub const ALL: &'static [Workload] = &[
        Workload::Fillseq,
        Workload::Fillrandom,
        Workload::Overwrite,
        Workload::Readrandom,
        Workload::Readseq,
        Workload::Seekrandom,
        Workload::YcsbLoad,
        Workload::YcsbA,
        Workload::YcsbB,
        Workload::YcsbC,
        Workload::YcsbD,
        Workload::YcsbE,
        Workload::YcsbF,
        Workload::Readwhilewriting,
        Workload::YcsbUpdate,
        Workload::YcsbScan,
    ];

    /// Command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Fillseq => "fillseq",
            Workload::Fillrandom => "fillrandom",
            Workload::Overwrite => "overwrite",
            Workload::Readrandom => "readrandom",
            Workload::Readseq => "readseq",
            Workload::Seekrandom => "seekrandom",
            Workload::YcsbLoad => "ycsb-load",
            Workload::YcsbA => "ycsb-a",
            Workload::YcsbB => "ycsb-b",
            Workload::YcsbC => "ycsb-c",
            Workload::YcsbD => "ycsb-d",
            Workload::YcsbE => "ycsb-e",
            Workload::YcsbF => "ycsb-f",
            Workload::Readwhilewriting => "readwhilewriting",
            Workload::YcsbUpdate => "ycsb-update",
            Workload::YcsbScan => "ycsb-scan",
        }
    }

    /// Parse a command-line name (`load`, `a`..`f`, `update` and `scan` are accepted for
    /// YCSB).
    pub fn parse(s: &str) -> Option<Workload> {
        let s = match s {
            "load" => "ycsb-load",
            "update" => "ycsb-update",
            "scan" => "ycsb-scan",
            "a" | "b" | "c" | "d" | "e" | "f" => {
                return Workload::ALL.iter().copied().find(|w| w.name() == format!("ycsb-{s}"))
            }
            other => other,
        };
        Workload::ALL.iter().copied().find(|w| w.name() == s)
    }

    /// Whether the workload is one of YCSB's (load included), which use YCSB's key space.
    pub fn is_ycsb(self) -> bool {
        self == Workload::YcsbLoad || self.is_ycsb_run()
    }

    /// Whether the workload is a YCSB run workload (A-F, update, scan: after a load).
    pub fn is_ycsb_run(self) -> bool {
        matches!(
            self,
            Workload::YcsbA
                | Workload::YcsbB
                | Workload::YcsbC
                | Workload::YcsbD
                | Workload::YcsbE
                | Workload::YcsbF
                | Workload::YcsbUpdate
                | Workload::YcsbScan
        )
    }

    /// Whether the workload's operation count is `--reads` (when given) rather than `--num`:
    /// every workload that does not load or overwrite the key space.
    pub fn is_read_phase(self) -> bool {
        !matches!(
            self,
            Workload::Fillseq | Workload::Fillrandom | Workload::Overwrite | Workload::YcsbLoad | Workload::Readseq
        )
    }

    fn needs_scan(self) -> bool {
        matches!(self, Workload::Readseq | Workload::Seekrandom | Workload::YcsbE | Workload::YcsbScan)
    }
}

/// Parameters shared by every workload of a run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Params {
    /// Records (and operations per load or overwrite workload).
    pub num: u64,
    /// Operations of each read, scan and YCSB run workload (`--reads`); `None`: `num`.
    #[serde(default)]
    pub reads: Option<u64>,
    /// Per-workload time cap in seconds (`--time-cap`): a workload still running then
    /// stops, and its throughput is over the operations it completed (marked `capped`).
    #[serde(default)]
    pub time_cap_seconds: Option<f64>,
    /// Value size in bytes.
    pub value_size: usize,
    /// db_bench key size in bytes.
    pub key_size: usize,
    /// Entries per `seekrandom` range read.
    pub scan_len: usize,
    /// Seed of every random stream (the same for every engine).
    pub seed: u64,
    /// Client threads (readers for `readwhilewriting`).
    pub threads: usize,
    /// The YCSB workloads run on a fresh, empty store rather than on the one the db_bench
    /// workloads filled (`--ycsb-fresh`, set by `--paper`), so no more than `num` records
    /// ever live in a store.
    #[serde(default)]
    pub ycsb_fresh: bool,
    /// Acknowledged writes after which the crash child is killed (`--crash-writes`);
    /// `None`: a random number in `1..=`[`crate::child::CHILD_WRITES`]. A large count
    /// measures recovery with a long log tail to replay.
    #[serde(default)]
    pub crash_writes: Option<u64>,
}

impl Params {
    /// Operations workload `w` is to do before scans count a tenth: `reads` for read phases
    /// when given, `num` otherwise.
    pub fn ops_of(&self, w: Workload) -> u64 {
        match self.reads {
            Some(r) if w.is_read_phase() => r,
            _ => self.num,
        }
    }
}

/// Latency summary in nanoseconds.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Latency {
    /// Mean.
    pub mean_ns: f64,
    /// Median.
    pub p50_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// 99.9th percentile.
    pub p999_ns: u64,
    /// Maximum.
    pub max_ns: u64,
}

/// The measurement of one workload on one engine.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Outcome {
    /// Engine name.
    pub engine: String,
    /// Workload.
    pub workload: Workload,
    /// Value size.
    pub value_size: usize,
    /// Operations performed (a scan counts once).
    pub ops: u64,
    /// Operations the workload was to do (`num`, or `--reads` for read phases; scans: a
    /// tenth). Less than that in `ops` only when `capped`.
    #[serde(default)]
    pub planned_ops: u64,
    /// The workload ran into `--time-cap` and was stopped: `ops_per_sec` is over the
    /// operations it completed.
    #[serde(default)]
    pub capped: bool,
    /// Wall time of the whole workload.
    pub seconds: f64,
    /// Operations per second.
    pub ops_per_sec: f64,
    /// Per-operation latency.
    pub latency: Latency,
    /// Latency CDF: (quantile, ns) at 1%..99% in 1% steps, 99.5%, 99.9%, 99.99%, 100%.
    pub cdf: Vec<(f64, u64)>,
    /// Reads that found their key.
    pub found: u64,
    /// Resource usage during this workload (deltas), and space/DRAM after it.
    pub usage: Usage,
    /// Client threads.
    pub threads: usize,
    /// Writes done by the background writer (`readwhilewriting` only).
    pub background_writes: u64,
    /// Space the store occupies after the workload (disk files for the peers, PM in use for
    /// tierkv; `limit`: 0).
    pub space_bytes: u64,
    /// PM bytes written / user bytes written during the workload.
    pub write_amp_pm: f64,
    /// Disk bytes written / user bytes written during the workload.
    pub write_amp_disk: f64,
    /// Bytes the benchmark process read from storage during the workload (`read_bytes` of
    /// `/proc/self/io`: page-cache misses, mapped-file faults and readahead). Near 0 while
    /// the data fits the page cache; under `--dram-budget` it shows what the budget costs.
    #[serde(default)]
    pub disk_bytes_read: u64,
    /// CPU time the benchmark process spent during the workload, in seconds (user + system,
    /// every thread: the clients and the engine's background work). Over `seconds` it is the
    /// number of cores the workload kept busy; over `ops` the CPU cost of an operation
    /// (`readwhilewriting`: the background writer's CPU included, its writes not counted).
    /// The kernel brings a running thread's time up to date at its ticks and switches, so a
    /// workload of a few milliseconds can be off by a tick per busy thread.
    #[serde(default)]
    pub cpu_seconds: f64,
    /// The design's own figures after the workload (tierkv presets: promotions, flushes,
    /// merges, …; counters are totals since open).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub design: std::collections::BTreeMap<String, u64>,
    /// Under `--repeat N` (N > 1): ops/s of every round, in round order; the rest of this
    /// outcome is the median round's. Empty (and absent from the JSON) for one round.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rounds: Vec<f64>,
}

/// The workloads split into the runs that share one store: all of them, or with
/// `ycsb_fresh` a new segment (a fresh store) wherever a YCSB workload follows a db_bench one
/// (so that segment must start with `ycsb-load`: a YCSB run workload on the fresh store
/// reports "needs ycsb-load first").
pub fn segments(workloads: &[Workload], ycsb_fresh: bool) -> Vec<Vec<Workload>> {
    let mut out: Vec<Vec<Workload>> = Vec::new();
    for &w in workloads {
        let fresh = ycsb_fresh && w.is_ycsb() && out.last().and_then(|s| s.last()).is_some_and(|p| !p.is_ycsb());
        match out.last_mut() {
            Some(seg) if !fresh => seg.push(w),
            _ => out.push(vec![w]),
        }
    }
    out
}

/// What the store holds so far (for reads and YCSB), carried between workloads.
#[derive(Debug, Default, Clone)]
pub struct Loaded {
    /// db_bench key range loaded.
    pub db_bench: u64,
    /// YCSB records inserted (key numbers `0..ycsb`).
    pub ycsb: u64,
}

/// Operations between progress-bar updates.
pub const PROGRESS_STEP: u64 = 1024;

struct Meter<'a> {
    hist: Histogram<u64>,
    bar: &'a indicatif::ProgressBar,
    pending: u64,
}

impl<'a> Meter<'a> {
    fn new(bar: &'a indicatif::ProgressBar) -> Result<Meter<'a>> {
        let hist = Histogram::new_with_bounds(1, 60_000_000_000, 3).map_err(|e| e.to_string())?;
        Ok(Meter { hist, bar, pending: 0 })
    }
    #[inline]
    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        let ns = t.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        let _ = self.hist.record(ns.max(1));
        self.pending += 1;
        if self.pending == PROGRESS_STEP {
            self.bar.inc(self.pending);
            self.pending = 0;
        }
        r
    }
}

fn value(rng: &mut SmallRng, size: usize) -> Vec<u8> {
    let mut v = vec![0u8; size];
    rng.fill(&mut v[..]);
    v
}

/// Run `w` on `e` with `p.threads` client threads. `loaded` is updated with what the
/// workload inserted.
pub fn run(e: &dyn BenchEngine, w: Workload, p: &Params, loaded: &mut Loaded) -> Result<Option<Outcome>> {
    run_with_progress(e, w, p, loaded, &indicatif::ProgressBar::hidden())
}

/// [`run`], advancing `bar` as operations complete (in steps of [`PROGRESS_STEP`]).
pub fn run_with_progress(
    e: &dyn BenchEngine,
    w: Workload,
    p: &Params,
    loaded: &mut Loaded,
    bar: &indicatif::ProgressBar,
) -> Result<Option<Outcome>> {
    if w.needs_scan() && e.name() == "limit" {
        return Ok(None);
    }
    if w.is_ycsb_run() && loaded.ycsb == 0 {
        return Err(format!("{} needs ycsb-load first", w.name()));
    }
    let threads = if w == Workload::Readseq { 1 } else { p.threads.max(1) };
    let before = e.usage();
    let read0 = crate::cgroup::process_read_bytes();
    let cpu0 = crate::cgroup::process_cpu_seconds();
    let total = p.ops_of(w);
    let deadline = p.time_cap_seconds.map(|s| Instant::now() + std::time::Duration::from_secs_f64(s.max(0.0)));
    let inserted = AtomicU64::new(loaded.ycsb);
    let stop = AtomicBool::new(false);
    // readwhilewriting: the readers start once the writer's first write is done, so that
    // every read overlaps writing however the threads are scheduled.
    let writing = AtomicBool::new(w != Workload::Readwhilewriting);
    let start = Instant::now();
    let (results, background) = std::thread::scope(|s| {
        let writer = (w == Workload::Readwhilewriting).then(|| {
            let (stop, writing) = (&stop, &writing);
            s.spawn(move || -> Result<u64> {
                let mut rng = SmallRng::seed_from_u64(p.seed ^ 0x5752_4954_4552);
                let buf = value(&mut rng, p.value_size);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) && deadline.is_none_or(|d| Instant::now() < d) {
                    let r = e.put(&db_bench_key(rng.random_range(0..p.num), p.key_size), &buf);
                    writing.store(true, Ordering::Release);
                    r?;
                    n += 1;
                }
                Ok(n)
            })
        });
        // Thread t does `ops` operations; sequential workloads give it keys first..first+ops.
        let share = |t: u64| total / threads as u64 + u64::from(t < total % threads as u64);
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let first = (0..t as u64).map(share).sum::<u64>();
                let ops = share(t as u64);
                let (inserted, writing) = (&inserted, &writing);
                s.spawn(move || {
                    while !writing.load(Ordering::Acquire) {
                        std::thread::yield_now();
                    }
                    let range = first..first + ops;
                    worker(e, w, p, t, range, inserted, bar, deadline)
                })
            })
            .collect();
        let results: Vec<Result<Worked>> =
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("worker thread panicked".into()))).collect();
        stop.store(true, Ordering::Relaxed);
        let background = writer.map(|h| h.join().unwrap_or_else(|_| Err("writer thread panicked".into())));
        (results, background)
    });
    let seconds = start.elapsed().as_secs_f64();
    let cpu_seconds = (crate::cgroup::process_cpu_seconds() - cpu0).max(0.0);
    let background_writes = background.transpose()?.unwrap_or(0);
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).map_err(|e| e.to_string())?;
    let (mut ops, mut found, mut capped) = (0u64, 0u64, false);
    // YCSB load: the records inserted without a gap (a capped thread leaves one).
    let (mut prefix, mut gapless) = (0u64, true);
    for r in results {
        let r = r?;
        ops += r.ops;
        found += r.found;
        capped |= r.capped;
        if gapless {
            prefix += r.ops;
            gapless = !r.capped;
        }
        hist.add(&r.hist).map_err(|e| e.to_string())?;
    }
    match w {
        Workload::Fillseq | Workload::Fillrandom | Workload::Overwrite => loaded.db_bench = loaded.db_bench.max(p.num),
        Workload::YcsbLoad => loaded.ycsb = loaded.ycsb.max(prefix),
        _ => loaded.ycsb = inserted.load(Ordering::Relaxed),
    }
    let planned_ops = match w {
        Workload::Readseq => ops,
        Workload::Seekrandom | Workload::YcsbScan => (0..threads as u64)
            .map(|t| (total / threads as u64 + u64::from(t < total % threads as u64)) / 10)
            .map(|n| n.max(1))
            .sum(),
        _ => total,
    };
    let after = e.usage();
    let usage = Usage {
        pm_bytes_written: after.pm_bytes_written.saturating_sub(before.pm_bytes_written),
        disk_bytes_written: after.disk_bytes_written.saturating_sub(before.disk_bytes_written),
        user_bytes_written: after.user_bytes_written.saturating_sub(before.user_bytes_written),
        dram_index_bytes: after.dram_index_bytes,
        pm_space: after.pm_space,
    };
    let user = usage.user_bytes_written as f64;
    let ratio = |x: u64| if user > 0.0 { x as f64 / user } else { 0.0 };
    Ok(Some(Outcome {
        engine: e.name(),
        workload: w,
        value_size: p.value_size,
        ops,
        planned_ops,
        capped,
        seconds,
        ops_per_sec: if seconds > 0.0 { ops as f64 / seconds } else { 0.0 },
        latency: Latency {
            mean_ns: hist.mean(),
            p50_ns: hist.value_at_quantile(0.5),
            p99_ns: hist.value_at_quantile(0.99),
            p999_ns: hist.value_at_quantile(0.999),
            max_ns: hist.max(),
        },
        cdf: (1..100)
            .map(|q| q as f64 / 100.0)
            .chain([0.995, 0.999, 0.9999, 1.0])
            .map(|q| (q, hist.value_at_quantile(q)))
            .collect(),
        found,
        threads,
        background_writes,
        space_bytes: e.space(),
        write_amp_pm: ratio(usage.pm_bytes_written),
        write_amp_disk: ratio(usage.disk_bytes_written),
        disk_bytes_read: crate::cgroup::process_read_bytes().saturating_sub(read0),
        cpu_seconds,
        design: e.design(),
        rounds: Vec::new(),
        usage,
    }))
}

struct Worked {
    ops: u64,
    found: u64,
    hist: Histogram<u64>,
    /// Stopped by the time cap.
    capped: bool,
}

/// Operations between checks of the time cap.
const CAP_CHECK: u64 = 64;

/// One client thread's share (`ops` operations) of workload `w`, until `deadline`.
#[allow(clippy::too_many_arguments)]
fn worker(
    e: &dyn BenchEngine,
    w: Workload,
    p: &Params,
    t: usize,
    range: std::ops::Range<u64>,
    inserted: &AtomicU64,
    bar: &indicatif::ProgressBar,
    deadline: Option<Instant>,
) -> Result<Worked> {
    let mut capped = false;
    // True when the time cap has passed (checked every CAP_CHECK operations).
    let mut over = |done: u64| {
        if done.is_multiple_of(CAP_CHECK) && deadline.is_some_and(|d| Instant::now() >= d) {
            capped = true;
        }
        capped
    };
    let seed = p.seed ^ (w as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (t as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut rng = SmallRng::seed_from_u64(seed);
    let buf = value(&mut rng, p.value_size);
    let mut m = Meter::new(bar)?;
    let mut done = 0u64;
    let mut found = 0u64;
    let n = p.num;
    let key_db = |i: u64| db_bench_key(i, p.key_size);
    let (first, ops) = (range.start, range.end - range.start);
    match w {
        Workload::Fillseq | Workload::Fillrandom | Workload::Overwrite => {
            for i in 0..ops {
                if over(done) {
                    break;
                }
                let k = if w == Workload::Fillseq { key_db(first + i) } else { key_db(rng.random_range(0..n)) };
                m.time(|| e.put(&k, &buf))?;
                done += 1;
            }
        }
        Workload::Readrandom | Workload::Readwhilewriting => {
            for _ in 0..ops {
                if over(done) {
                    break;
                }
                let k = key_db(rng.random_range(0..n));
                found += u64::from(m.time(|| e.get(&k))?.is_some());
                done += 1;
            }
        }
        Workload::Readseq => {
            found = m.time(|| e.scan(b"", usize::MAX))? as u64;
            done = found.max(1);
        }
        Workload::Seekrandom => {
            for _ in 0..(ops / 10).max(1) {
                if over(done) {
                    break;
                }
                let k = key_db(rng.random_range(0..n));
                found += m.time(|| e.scan(&k, p.scan_len))? as u64;
                done += 1;
            }
        }
        Workload::YcsbLoad => {
            for i in 0..ops {
                if over(done) {
                    break;
                }
                let k = ycsb_key(first + i);
                m.time(|| e.insert(&k, &buf))?;
                done += 1;
            }
        }
        _ => {
            let mut count = inserted.load(Ordering::Relaxed);
            let mut zipf = ScrambledZipfian::new(count);
            let mut latest = Latest::new(count);
            // Scans are counted like seekrandom's: a tenth of the operations.
            let ops = if w == Workload::YcsbScan { (ops / 10).max(1) } else { ops };
            for _ in 0..ops {
                if over(done) {
                    break;
                }
                let r: f64 = rng.random();
                let pick = |rng: &mut SmallRng, z: &ScrambledZipfian| ycsb_key(z.next(rng));
                match w {
                    Workload::YcsbA | Workload::YcsbB | Workload::YcsbC | Workload::YcsbUpdate => {
                        let read = match w {
                            Workload::YcsbA => 0.5,
                            Workload::YcsbB => 0.95,
                            Workload::YcsbUpdate => 0.0,
                            _ => 1.0,
                        };
                        let k = pick(&mut rng, &zipf);
                        if r < read {
                            found += u64::from(m.time(|| e.get(&k))?.is_some());
                        } else {
                            m.time(|| e.put(&k, &buf))?;
                        }
                    }
                    Workload::YcsbD => {
                        if r < 0.95 {
                            let k = ycsb_key(latest.next(&mut rng));
                            found += u64::from(m.time(|| e.get(&k))?.is_some());
                        } else {
                            let k = ycsb_key(inserted.fetch_add(1, Ordering::Relaxed));
                            m.time(|| e.insert(&k, &buf))?;
                            count = inserted.load(Ordering::Relaxed);
                            latest.grow_to(count);
                        }
                    }
                    Workload::YcsbE | Workload::YcsbScan => {
                        if r < 0.95 || w == Workload::YcsbScan {
                            let k = pick(&mut rng, &zipf);
                            let len = scan_len(&mut rng, 100) as usize;
                            found += m.time(|| e.scan(&k, len))? as u64;
                        } else {
                            let k = ycsb_key(inserted.fetch_add(1, Ordering::Relaxed));
                            m.time(|| e.insert(&k, &buf))?;
                            count = inserted.load(Ordering::Relaxed);
                            zipf = ScrambledZipfian::new(count);
                        }
                    }
                    _ => {
                        // F: read-modify-write is one timed operation (read, then write back).
                        let k = pick(&mut rng, &zipf);
                        if r < 0.5 {
                            found += u64::from(m.time(|| e.get(&k))?.is_some());
                        } else {
                            m.time(|| -> Result<()> {
                                e.get(&k)?;
                                e.put(&k, &buf)
                            })?;
                        }
                    }
                }
                done += 1;
            }
        }
    }
    Ok(Worked { ops: done, found, hist: m.hist, capped })
}
