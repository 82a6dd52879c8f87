//! Recovery after a real crash: a child process opens the store the benchmark just measured
//! and writes keys nobody wrote before, reporting each one on stdout (a pipe) as soon as
//! its write is acknowledged; the parent kills it with SIGKILL at a random moment (after a
//! random number of acknowledgements, while the child is in the middle of further writes),
//! reopens the store, times the reopen up to the first served read, and then verifies that
//! every acknowledged key is there with its value. A lost or wrong key fails the run. The
//! same for every engine (tierkv presets, LevelDB, RocksDB), so the peers' WAL replay is
//! measured like tierkv's recovery.
//!
//! Protocol (one line per `write(2)`, so a kill never leaves half a line that parses):
//! `ready` after open; `ack <key hex> <crc32c of the value, hex>` after each acknowledged
//! write; `done` if the child ran out of keys before it was killed.
//!
//! Keys are `~crash` + a 10-digit counter (padded with `x` to `--key-size` when that is
//! longer): db_bench keys are all digits and YCSB keys start with `user`, so no workload
//! wrote them. Values are a per-key pseudo-random pattern, so a stale or misplaced value
//! fails the check too.
//!
//! Recovery time is `open` up to the first successful read (of the first acknowledged key);
//! the verification of every other key is not part of it.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::api::{BenchEngine, Result};
use crate::engine::{self, EngineSpec};

/// The hidden `tierkv` subcommand the child runs.
pub const CHILD_CMD: &str = "bench-crash-child";
/// The parent kills the child after a random number of acknowledgements in
/// `1..=CHILD_WRITES`.
pub const CHILD_WRITES: u64 = 1000;
/// Keys the child writes at most (it then reports `done` and waits to be killed).
pub const CHILD_MAX_WRITES: u64 = 4 * CHILD_WRITES;
/// Test hook (environment of the child): report the write with this index as acknowledged
/// without making it, as a store that loses an acknowledged write would. The parent's check
/// must catch it.
pub const DROP_ENV: &str = "TIERKV_BENCH_CHILD_DROP";

/// Fresh key number `i` of the crash child.
pub fn child_key(i: u64, key_size: usize) -> Vec<u8> {
    let mut k = format!("~crash{i:010}").into_bytes();
    if k.len() < key_size {
        k.resize(key_size, b'x');
    }
    k
}

/// The value the child writes under key number `i`.
pub fn child_value(i: u64, value_size: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..value_size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

/// Write one protocol line in a single `write(2)`.
fn say(line: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(format!("{line}\n").as_bytes()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())
}

/// The child's work: open, report `ready`, write up to `max_writes` fresh keys reporting
/// each acknowledged one, and wait to be killed. `_num` is the size of the loaded key
/// space (kept for the command line; fresh keys do not depend on it).
pub fn child_main(spec: &EngineSpec, _num: u64, key_size: usize, value_size: usize, max_writes: u64) -> Result<()> {
    let drop: Option<u64> = std::env::var(DROP_ENV).ok().and_then(|v| v.parse().ok());
    let e = engine::open(spec)?;
    say("ready")?;
    for i in 0..max_writes {
        let (k, v) = (child_key(i, key_size), child_value(i, value_size));
        if drop != Some(i) {
            e.put(&k, &v)?;
        }
        say(&format!("ack {} {:08x}", hex(&k), crc32c::crc32c(&v)))?;
    }
    say("done")?;
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// Recovery after a crash, measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CrashRecovery {
    /// Seconds from `open` to the first served read, nothing else: the writer was killed
    /// and reaped before the clock starts, and the check of the other keys runs after it
    /// stops.
    pub seconds: f64,
    /// Writes the killed writer had acknowledged.
    pub acknowledged: u64,
    /// Acknowledged keys found after the reopen with their acknowledged values (equal to
    /// `acknowledged`, or the measurement is [`CrashError::Lost`]).
    pub verified: u64,
    /// The reopened store's own figures of its recovery (its design figures named
    /// `recovery_*`, and `replayed_bytes`; none for the peers), read after the check.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub figures: BTreeMap<String, u64>,
}

/// Why a crash recovery was not measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CrashError {
    /// The measurement could not be made (the child failed, the engine cannot be crashed):
    /// reported as not measured.
    NotMeasured(String),
    /// An acknowledged write was lost or changed by the crash: the run fails.
    Lost(String),
}

impl std::fmt::Display for CrashError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CrashError::NotMeasured(m) | CrashError::Lost(m) => f.write_str(m),
        }
    }
}

fn not_measured(e: impl std::fmt::Display) -> CrashError {
    CrashError::NotMeasured(e.to_string())
}

/// Test hooks for [`measure_with`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Hooks {
    /// Make the child report write `i` without making it ([`DROP_ENV`]).
    pub drop_write: Option<u64>,
    /// Kill after this many acknowledgements instead of a random number.
    pub kill_after: Option<u64>,
}

/// Run the child (`exe`) on the closed store of `spec`, SIGKILL it after `kill_after`
/// acknowledged writes (`None`: a random number of them in `1..=CHILD_WRITES`), reopen,
/// and verify every write it acknowledged.
pub fn measure(
    exe: &Path,
    spec: &EngineSpec,
    num: u64,
    key_size: usize,
    value_size: usize,
    kill_after: Option<u64>,
) -> std::result::Result<CrashRecovery, CrashError> {
    measure_with(exe, spec, num, key_size, value_size, Hooks { kill_after, drop_write: None })
}

/// Keys the child may write when the parent kills it after `kill_after` acknowledgements:
/// enough that it is still writing at the kill.
pub fn child_max_writes(kill_after: Option<u64>) -> u64 {
    kill_after.map_or(CHILD_MAX_WRITES, |n| n.saturating_add(CHILD_MAX_WRITES))
}

/// [`measure`] with test hooks.
pub fn measure_with(
    exe: &Path,
    spec: &EngineSpec,
    num: u64,
    key_size: usize,
    value_size: usize,
    hooks: Hooks,
) -> std::result::Result<CrashRecovery, CrashError> {
    let mut cmd = Command::new(exe);
    cmd.arg(CHILD_CMD)
        .arg("--engine")
        .arg(&spec.name)
        .arg("--dir")
        .arg(&spec.dir)
        .arg("--pm-dir")
        .arg(&spec.pm_dir)
        .arg("--num")
        .arg(num.to_string())
        .arg("--key-size")
        .arg(key_size.to_string())
        .arg("--value-size")
        .arg(value_size.to_string())
        .arg("--max-writes")
        .arg(child_max_writes(hooks.kill_after).to_string());
    if spec.durable {
        cmd.arg("--durable");
    }
    // The writer opens the store as the benchmark did: same PM capacity and profile.
    if let Some(b) = spec.pm_budget {
        cmd.arg("--pm-budget").arg(b.to_string());
    }
    if let Some(p) = &spec.pm_profile {
        cmd.arg("--pm-profile").arg(p);
    }
    match hooks.drop_write {
        Some(i) => cmd.env(DROP_ENV, i.to_string()),
        None => cmd.env_remove(DROP_ENV),
    };
    let kill_after = hooks.kill_after.unwrap_or_else(|| rand::random_range(1..=CHILD_WRITES)).max(1);
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().map_err(not_measured)?;
    let Some(out) = child.stdout.take() else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(not_measured("child has no stdout"));
    };
    let mut acked: BTreeMap<Vec<u8>, u32> = BTreeMap::new();
    let mut ready = false;
    let mut killed = false;
    let mut bad_line = None;
    // Read until EOF: after the kill, the pipe still holds every line written before it.
    for line in BufReader::new(out).lines() {
        let Ok(line) = line else { break };
        let mut w = line.split_whitespace();
        match (w.next(), w.next(), w.next()) {
            (Some("ready"), None, None) => ready = true,
            (Some("ack"), Some(k), Some(h)) => match (unhex(k), u32::from_str_radix(h, 16)) {
                (Some(k), Ok(h)) => {
                    acked.insert(k, h);
                }
                _ => bad_line = Some(line.clone()),
            },
            (Some("done"), None, None) => {}
            _ => bad_line = Some(line.clone()),
        }
        if !killed && (acked.len() as u64 >= kill_after || line == "done") {
            // `Child::kill` sends SIGKILL on Unix: no clean shutdown of any kind.
            let _ = child.kill();
            killed = true;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    if let Some(l) = bad_line {
        return Err(not_measured(format!("{}: crash child wrote an unexpected line: {l:?}", spec.name)));
    }
    if !ready || acked.is_empty() {
        return Err(not_measured(format!("crash child for {} failed before acknowledging a write", spec.name)));
    }
    let t = Instant::now();
    let e = engine::open(spec).map_err(not_measured)?;
    verify_after_open(e.as_ref(), &spec.name, t, &acked)
}

/// Serve the first read (the clock `t` started before `open`), then check every
/// acknowledged key: present, with a value whose crc32c is the acknowledged one.
pub fn verify_after_open(
    e: &dyn BenchEngine,
    name: &str,
    t: Instant,
    acked: &BTreeMap<Vec<u8>, u32>,
) -> std::result::Result<CrashRecovery, CrashError> {
    let mut first = None;
    let mut lost = Vec::new();
    let mut wrong = Vec::new();
    for (k, want) in acked {
        let got = e.get_value(k).map_err(|err| not_measured(format!("{name}: reading back after the crash: {err}")))?;
        if first.is_none() {
            first = Some(t.elapsed().as_secs_f64());
        }
        match got {
            None => lost.push(k),
            Some(v) if crc32c::crc32c(&v) != *want => wrong.push(k),
            Some(_) => {}
        }
    }
    if !lost.is_empty() || !wrong.is_empty() {
        let show = |v: &[&Vec<u8>]| {
            v.iter().take(5).map(|k| String::from_utf8_lossy(k).into_owned()).collect::<Vec<_>>().join(", ")
        };
        return Err(CrashError::Lost(format!(
            "{name}: {} of {} acknowledged writes lost after the crash ({}), {} with a wrong value ({})",
            lost.len(),
            acked.len(),
            show(&lost),
            wrong.len(),
            show(&wrong)
        )));
    }
    let figures = e.design().into_iter().filter(|(k, _)| k.starts_with("recovery_") || k == "replayed_bytes").collect();
    Ok(CrashRecovery {
        seconds: first.unwrap_or_else(|| t.elapsed().as_secs_f64()),
        acknowledged: acked.len() as u64,
        verified: (acked.len() - lost.len() - wrong.len()) as u64,
        figures,
    })
}

/// The in-process variant, for engines that can simulate a crash (the tierkv presets,
/// without the `tierkv` executable): write `writes` fresh keys (`None`: `CHILD_WRITES`), drop
/// the store as a killed process would, reopen and verify.
pub fn measure_in_process(
    e: &mut dyn BenchEngine,
    key_size: usize,
    value_size: usize,
    writes: Option<u64>,
) -> std::result::Result<CrashRecovery, CrashError> {
    let mut acked = BTreeMap::new();
    for i in 0..writes.unwrap_or(CHILD_WRITES) {
        let (k, v) = (child_key(i, key_size), child_value(i, value_size));
        e.put(&k, &v).map_err(not_measured)?;
        acked.insert(k, crc32c::crc32c(&v));
    }
    let t = Instant::now();
    e.crash_reopen().map_err(not_measured)?;
    let name = e.name();
    verify_after_open(e, &name, t, &acked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_keys_are_fresh_and_values_differ() {
        let k = child_key(7, 16);
        assert_eq!(k, b"~crash0000000007");
        assert!(!k.iter().all(u8::is_ascii_digit) && !k.starts_with(b"user"));
        assert_eq!(child_key(7, 20), b"~crash0000000007xxxx");
        assert_ne!(child_value(1, 64), child_value(2, 64));
        assert_eq!(unhex(&hex(&k)), Some(k));
    }
}
