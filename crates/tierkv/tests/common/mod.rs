//! Shared test harness: one generic model of the API, run against every preset.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::{Path, PathBuf};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Options, Preset, WriteBatch};

/// Every preset; a new preset joins every generic test by being in `Preset::ALL`.
/// The presets the shared suites run on: all of them, or the comma-separated names in
/// `TIERKV_PRESETS` (to iterate on one design).
pub fn presets() -> &'static [Preset] {
    static P: std::sync::OnceLock<Vec<Preset>> = std::sync::OnceLock::new();
    P.get_or_init(|| match std::env::var("TIERKV_PRESETS") {
        Ok(names) => names.split(',').map(|n| n.trim().parse().expect("TIERKV_PRESETS names a preset")).collect(),
        Err(_) => Preset::ALL.to_vec(),
    })
}

/// Store directory used inside a `FaultFs`.
pub fn dir() -> PathBuf {
    PathBuf::from("/db")
}

/// Small, deterministic options on a simulated device and file system (shared with the fuzz
/// targets: [`tierkv::testing`]).
pub fn sim_options(preset: Preset, dev: &SimDevice, fs: &FaultFs) -> Options {
    tierkv::testing::sim_options(preset, dev, fs)
}

#[allow(unused_imports)]
pub use tierkv::testing::{hpdk_small, slmdb_small};

/// The reference model.
pub type Model = BTreeMap<Vec<u8>, Vec<u8>>;

/// One step of a random workload.
#[derive(Clone)]
pub enum Step {
    Put(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
    Batch(Vec<(Vec<u8>, Option<Vec<u8>>)>),
    InsertIfAbsent(Vec<u8>, Vec<u8>),
    UpdateIfPresent(Vec<u8>, Vec<u8>),
    Get(Vec<u8>),
    Scan(Option<Vec<u8>>, Option<Vec<u8>>),
    Seek(Vec<u8>),
    Flush,
    Reopen,
    Crash(u64, f64),
}

fn short(v: &[u8]) -> String {
    let e = tierkv::escape(&v[..v.len().min(24)]);
    if v.len() > 24 {
        format!("{e}..({} bytes)", v.len())
    } else {
        e
    }
}

impl std::fmt::Debug for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::Put(k, v) => write!(f, "Put({}, {})", short(k), short(v)),
            Step::Delete(k) => write!(f, "Delete({})", short(k)),
            Step::Batch(ops) => {
                write!(f, "Batch[")?;
                for (k, v) in ops {
                    match v {
                        Some(v) => write!(f, "put {}={} ", short(k), short(v))?,
                        None => write!(f, "del {} ", short(k))?,
                    }
                }
                write!(f, "]")
            }
            Step::InsertIfAbsent(k, v) => write!(f, "InsertIfAbsent({}, {})", short(k), short(v)),
            Step::UpdateIfPresent(k, v) => write!(f, "UpdateIfPresent({}, {})", short(k), short(v)),
            Step::Get(k) => write!(f, "Get({})", short(k)),
            Step::Scan(a, b) => write!(f, "Scan({:?}, {:?})", a.as_deref().map(short), b.as_deref().map(short)),
            Step::Seek(k) => write!(f, "Seek({})", short(k)),
            Step::Flush => write!(f, "Flush"),
            Step::Reopen => write!(f, "Reopen"),
            Step::Crash(s, e) => write!(f, "Crash({s}, {e})"),
        }
    }
}

impl Step {
    /// True for steps that change the store.
    pub fn writes(&self) -> bool {
        matches!(
            self,
            Step::Put(..) | Step::Delete(_) | Step::Batch(_) | Step::InsertIfAbsent(..) | Step::UpdateIfPresent(..)
        )
    }
}

pub fn key(rng: &mut SmallRng, space: u32) -> Vec<u8> {
    let i = rng.random_range(0..space);
    match i % 7 {
        0 if i == 0 => Vec::new(),
        1 => format!("k{i:05}-{}", "x".repeat((i % 40) as usize)).into_bytes(),
        2 => vec![0xff, (i >> 8) as u8, i as u8, 0],
        _ => format!("k{i:05}").into_bytes(),
    }
}

pub fn value(rng: &mut SmallRng, step: usize) -> Vec<u8> {
    let len = match rng.random_range(0..20) {
        0 => 0,
        1 => rng.random_range(1000..6000),
        _ => rng.random_range(1..200),
    };
    let mut v = format!("v{step}:").into_bytes();
    v.resize(len.max(v.len()), b'a' + (step % 26) as u8);
    v
}

/// A random workload. `crashes` enables Reopen/Crash steps.
pub fn workload(seed: u64, n: usize, space: u32, crashes: bool) -> Vec<Step> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|i| match rng.random_range(0..100) {
            0..=34 => Step::Put(key(&mut rng, space), value(&mut rng, i)),
            35..=44 => Step::Delete(key(&mut rng, space)),
            45..=54 => {
                let n = rng.random_range(1..6);
                Step::Batch(
                    (0..n)
                        .map(|_| {
                            (key(&mut rng, space), if rng.random_bool(0.75) { Some(value(&mut rng, i)) } else { None })
                        })
                        .collect(),
                )
            }
            55..=59 => Step::InsertIfAbsent(key(&mut rng, space), value(&mut rng, i)),
            60..=64 => Step::UpdateIfPresent(key(&mut rng, space), value(&mut rng, i)),
            65..=79 => Step::Get(key(&mut rng, space)),
            80..=84 => {
                let a = key(&mut rng, space);
                let b = key(&mut rng, space);
                let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
                Step::Scan(rng.random_bool(0.8).then_some(lo), rng.random_bool(0.8).then_some(hi))
            }
            85..=87 => Step::Seek(key(&mut rng, space)),
            88..=91 => Step::Flush,
            92..=95 if crashes => Step::Reopen,
            96..=99 if crashes => Step::Crash(rng.random(), [0.0, 0.5, 1.0][rng.random_range(0..3)]),
            _ => Step::Get(key(&mut rng, space)),
        })
        .collect()
}

/// Apply a write step to the model; returns the expected boolean result.
pub fn model_apply(m: &mut Model, step: &Step) -> bool {
    match step {
        Step::Put(k, v) => {
            m.insert(k.clone(), v.clone());
            true
        }
        Step::Delete(k) => {
            m.remove(k);
            true
        }
        Step::Batch(ops) => {
            for (k, v) in ops {
                match v {
                    Some(v) => m.insert(k.clone(), v.clone()),
                    None => m.remove(k),
                };
            }
            true
        }
        Step::InsertIfAbsent(k, v) => {
            if m.contains_key(k) {
                false
            } else {
                m.insert(k.clone(), v.clone());
                true
            }
        }
        Step::UpdateIfPresent(k, v) => {
            if m.contains_key(k) {
                m.insert(k.clone(), v.clone());
                true
            } else {
                false
            }
        }
        _ => true,
    }
}

/// Run a write step against the store; returns its boolean result.
pub fn db_apply(db: &Db, step: &Step) -> tierkv::Result<bool> {
    match step {
        Step::Put(k, v) => db.put(k, v).map(|_| true),
        Step::Delete(k) => db.delete(k).map(|_| true),
        Step::Batch(ops) => {
            let mut b = WriteBatch::new();
            for (k, v) in ops {
                match v {
                    Some(v) => b.put(k, v),
                    None => b.delete(k),
                };
            }
            db.write(b).map(|_| true)
        }
        Step::InsertIfAbsent(k, v) => db.insert_if_absent(k, v),
        Step::UpdateIfPresent(k, v) => db.update_if_present(k, v),
        Step::Flush => db.flush().map(|_| true),
        _ => Ok(true),
    }
}

/// Everything in the store, by a full scan.
pub fn dump(db: &Db) -> Model {
    db.scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Unbounded, Bound::Unbounded)).unwrap().map(|r| r.unwrap()).collect()
}

/// Assert the store holds exactly `m`, through scan, get and iter, and that check is clean.
pub fn assert_matches(db: &Db, m: &Model, ctx: &str) {
    let got = dump(db);
    if &got != m {
        let extra: Vec<_> = got.keys().filter(|k| !m.contains_key(*k)).map(|k| tierkv::escape(k)).take(5).collect();
        let missing: Vec<_> = m.keys().filter(|k| !got.contains_key(*k)).map(|k| tierkv::escape(k)).take(5).collect();
        let differ: Vec<_> = m
            .iter()
            .filter(|(k, v)| got.get(*k).is_some_and(|g| g != *v))
            .map(|(k, _)| tierkv::escape(k))
            .take(5)
            .collect();
        panic!("{ctx}: store differs from model: extra {extra:?}, missing {missing:?}, different {differ:?}");
    }
    for (k, v) in m.iter().take(50) {
        assert_eq!(db.get(k).unwrap().as_ref(), Some(v), "{ctx}: get {}", tierkv::escape(k));
    }
    let problems = db.check().unwrap();
    assert!(problems.is_empty(), "{ctx}: check found {problems:?}");
}

/// A fresh real directory for tests that need real files.
pub fn tempdir() -> tempfile::TempDir {
    let base = if Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" };
    tempfile::Builder::new().prefix("tierkv-test").tempdir_in(base).unwrap()
}

/// Lowercase hex of `b` (golden-bytes tests).
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `n` zero bytes in hex (golden-bytes tests).
pub fn zeros(n: usize) -> String {
    "00".repeat(n)
}

/// A crash point: just before the `n`-th PM fence, or just before the `n`-th file or
/// directory sync, counted from the end of open (1-based). PM and files freeze together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashAt {
    Fence(u64),
    Sync(u64),
    /// Just before the `n`-th PM event (store, flush or fence) of the strict model.
    Event(u64),
}

/// Options on a device and file system.
pub type OptsFn<'a> = &'a dyn Fn(&SimDevice, &FaultFs) -> Options;

/// A run of a workload up to a crash point.
pub struct CrashRun {
    pub dev: SimDevice,
    pub fs: FaultFs,
    /// Index of the step during which the crash point was reached (None: never reached).
    pub inflight: Option<usize>,
    /// Fences and syncs executed after open (the whole run when no crash point was hit).
    pub fences: u64,
    pub syncs: u64,
    pub events: u64,
}

/// Run the write steps of `steps` (and flushes) on a fresh store, crashing at `at`.
/// A device and file system that freeze together at either one's crash point. Call
/// [`unlink`] when done: the hooks hold each other's handles.
pub fn linked() -> (SimDevice, FaultFs) {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let f = fs.clone();
    dev.on_freeze(move || f.freeze());
    let d = dev.clone();
    fs.on_freeze(move || d.freeze());
    (dev, fs)
}

/// Replace the hooks [`linked`] set, freeing both handles.
pub fn unlink(dev: &SimDevice, fs: &FaultFs) {
    dev.on_freeze(|| {});
    fs.on_freeze(|| {});
}

pub fn crash_run(opts: OptsFn<'_>, steps: &[Step], at: Option<CrashAt>) -> CrashRun {
    let (dev, fs) = linked();
    let db = Db::open(dir(), opts(&dev, &fs)).unwrap();
    let (f0, s0, e0) = (dev.fences(), fs.sync_points(), dev.events());
    match at {
        Some(CrashAt::Fence(n)) => dev.crash_before_fence(f0 + n),
        Some(CrashAt::Sync(n)) => fs.crash_before_sync(n),
        Some(CrashAt::Event(n)) => dev.crash_before_event(e0 + n),
        None => {}
    }
    let mut inflight = None;
    for (i, s) in steps.iter().enumerate() {
        if s.writes() || matches!(s, Step::Flush) {
            db_apply(&db, s).unwrap();
        }
        if dev.crashed() || fs.frozen() {
            inflight = Some(i);
            break;
        }
    }
    let (fences, syncs, events) = (dev.fences() - f0, fs.sync_points() - s0, dev.events() - e0);
    db.simulate_process_crash();
    unlink(&dev, &fs);
    CrashRun { dev, fs, inflight, fences, syncs, events }
}

fn model_upto(steps: &[Step], n: usize) -> Model {
    let mut m = Model::new();
    for s in &steps[..n] {
        model_apply(&mut m, s);
    }
    m
}

/// Crash at `at`, reopen: the store holds the acknowledged writes plus all or none of the
/// step in flight, passes `check`, keeps working through more writes and another crash.
pub fn crash_check(opts: OptsFn<'_>, name: &str, steps: &[Step], at: CrashAt, seed: u64, frac: f64) {
    let r = crash_run(opts, steps, Some(at));
    let Some(i) = r.inflight else { panic!("{name}: crash point {at:?} not reached") };
    let n = match at {
        CrashAt::Fence(n) | CrashAt::Sync(n) | CrashAt::Event(n) => n,
    };
    let dev = r.dev.simulate_crash(seed ^ n, frac);
    let ctx = format!("{name} seed {seed} {at:?} (step {i}: {:?}) evict {frac}", steps[i]);
    verify_crash_state(opts, &ctx, steps, i, dev, &r.fs, &prefix_crash, seed.wrapping_add(n));
}

/// How a test crashes the file system: the durable state a crash leaves, for a seed.
pub type FsCrash<'a> = &'a dyn Fn(&FaultFs, u64) -> FaultFs;

/// The deterministic file crash: every file cut back to its synced prefix.
pub fn prefix_crash(fs: &FaultFs, _seed: u64) -> FaultFs {
    fs.crash()
}

/// Crash at `at` and verify every crash state of the strict PM model (each dirty line
/// holding some prefix of its stores) when there are at most `max_lines` dirty lines.
/// Returns the states verified (0 when there were more dirty lines).
pub fn crash_check_all_states(opts: OptsFn<'_>, name: &str, steps: &[Step], at: CrashAt, max_lines: usize) -> u64 {
    let r = crash_run(opts, steps, Some(at));
    let Some(i) = r.inflight else { panic!("{name}: crash point {at:?} not reached") };
    let Some(states) = r.dev.crash_states(max_lines) else { return 0 };
    let n = states.len() as u64;
    for (k, dev) in states.into_iter().enumerate() {
        let ctx = format!("{name} {at:?} (step {i}: {:?}) crash state {k} of {n}", steps[i]);
        verify_crash_state(opts, &ctx, steps, i, dev, &r.fs, &prefix_crash, k as u64);
    }
    n
}

/// Reopen `dev` (a crash state during step `i`) with what `crash_fs` leaves of the file
/// system `fs`: the store holds the acknowledged writes plus all or none of step `i`, passes
/// `check`, keeps working through more writes and another crash.
#[allow(clippy::too_many_arguments)]
pub fn verify_crash_state(
    opts: OptsFn<'_>,
    ctx: &str,
    steps: &[Step],
    i: usize,
    dev: SimDevice,
    fs: &FaultFs,
    crash_fs: FsCrash<'_>,
    seed: u64,
) {
    let before = model_upto(steps, i);
    let mut after = before.clone();
    model_apply(&mut after, &steps[i]);
    let fs = crash_fs(fs, seed);
    let db = Db::open(dir(), opts(&dev, &fs)).unwrap_or_else(|e| panic!("{ctx}: reopen failed: {e}"));
    let got = dump(&db);
    let mut m = if got == after {
        after
    } else {
        assert_matches(&db, &before, &format!("{ctx} (neither old nor new state)"));
        before
    };
    let problems = db.check().unwrap();
    assert!(problems.is_empty(), "{ctx}: check found {problems:?}");
    for s in steps.iter().skip(i + 1).filter(|s| s.writes()).take(8) {
        let want = model_apply(&mut m, s);
        assert_eq!(db_apply(&db, s).unwrap(), want, "{ctx}: after reopen {s:?}");
    }
    db.simulate_process_crash();
    let dev = dev.simulate_crash(seed, 0.5);
    let fs = crash_fs(&fs, seed.wrapping_add(1));
    let db = Db::open(dir(), opts(&dev, &fs)).unwrap_or_else(|e| panic!("{ctx}: second reopen failed: {e}"));
    assert_matches(&db, &m, &format!("{ctx}: second crash"));
}

/// Every file of the store in [`dir`] but those named in `skip`, those one directory down
/// (e.g. `native`'s `cold/`) included, as paths relative to it, sorted.
pub fn store_files(fs: &FaultFs, skip: &[&str]) -> Vec<String> {
    use tierkv::fs::Fs;
    let mut v = Vec::new();
    for n in fs.list(&dir()).unwrap() {
        if skip.contains(&n.as_str()) {
            continue;
        }
        if fs.read_all(&dir().join(&n)).is_ok() {
            v.push(n);
        } else if let Ok(sub) = fs.list(&dir().join(&n)) {
            v.extend(sub.into_iter().map(|s| format!("{n}/{s}")));
        }
    }
    v.sort();
    v
}
