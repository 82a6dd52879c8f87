//! Recovery after a real crash: a child process opens the store the benchmark just measured,
//! writes more keys, reports that it has, and is killed with SIGKILL; the parent then times
//! the reopen. The same for every engine (tierkv presets, LevelDB, RocksDB), so the peers'
//! WAL replay is measured like tierkv's recovery.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::engine::{self, EngineSpec, Result};

/// The hidden `tierkv` subcommand the child runs.
pub const CHILD_CMD: &str = "bench-crash-child";
/// Keys the child writes before it reports.
pub const CHILD_WRITES: u64 = 1000;

/// Keys the child writes: a fixed pseudo-random walk over the loaded key space.
pub fn child_keys(num: u64, key_size: usize) -> impl Iterator<Item = Vec<u8>> {
    let mut x = 0u64;
    (0..CHILD_WRITES).map(move |_| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        crate::workload::db_bench_key(x % num.max(1), key_size)
    })
}

/// The child's work: open, write, report `ready` on stdout, wait to be killed.
pub fn child_main(spec: &EngineSpec, num: u64, key_size: usize, value_size: usize) -> Result<()> {
    let e = engine::open(spec)?;
    let v = vec![7u8; value_size];
    for k in child_keys(num, key_size) {
        e.put(&k, &v)?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// Run the child (`exe`) on the closed store of `spec`, SIGKILL it once it has written, and
/// return how long opening the store takes afterwards (seconds). The parent checks that the
/// child's last write is there.
pub fn measure(exe: &Path, spec: &EngineSpec, num: u64, key_size: usize, value_size: usize) -> Result<f64> {
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
        .arg(value_size.to_string());
    if spec.durable {
        cmd.arg("--durable");
    }
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().map_err(|e| e.to_string())?;
    let line = {
        let Some(out) = child.stdout.take() else { return Err("child has no stdout".into()) };
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line).map_err(|e| e.to_string())?;
        line
    };
    // `Child::kill` sends SIGKILL on Unix: no clean shutdown of any kind.
    let _ = child.kill();
    let _ = child.wait();
    if line.trim() != "ready" {
        return Err(format!("crash child for {} failed before writing", spec.name));
    }
    let t = Instant::now();
    let e = engine::open(spec)?;
    let seconds = t.elapsed().as_secs_f64();
    let last = child_keys(num, key_size).last().unwrap_or_default();
    match e.get(&last)? {
        Some(n) if n == value_size => Ok(seconds),
        _ => Err(format!("{}: the child's last acknowledged write is missing after the crash", spec.name)),
    }
}
