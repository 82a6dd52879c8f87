//! The kill -9 soak (RocksDB's `db_crashtest.py` in miniature): a stress process writes and
//! reads a store from several threads and is killed with SIGKILL at a random moment; the
//! driver reopens the store, verifies every key against the acknowledged state, runs `check`,
//! and starts the next cycle on the same store.
//!
//! Values are verifiable: each encodes its key, a per-key sequence number and a checksum.
//! Each writer thread owns the keys `i ≡ thread (mod threads)`, so a key's sequence numbers
//! grow one at a time. After a write is acknowledged, the writer records the key's sequence
//! number in an *expected-state* file beside the store (one `u64` per key, written with
//! `pwrite`, so it survives the kill in the page cache). Whether sequence number `s` of key `k`
//! is a put or a delete is a function of `(k, s)`, so the driver knows what the in-flight
//! operation (`acked + 1`) would have left. After a kill, key `k` must read as its acknowledged
//! operation, or as the in-flight one; anything else (a lost acknowledged write, a torn or
//! misdirected value, a resurrected delete) fails the soak.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tierkv::{Db, HpdkOptions, LightkvOptions, NativeOptions, Options, Preset, SlmdbOptions};

use crate::api::Result;

/// The hidden `tierkv` subcommand the stress process runs.
pub const STRESS_CMD: &str = "soak-stress";

/// What to soak.
#[derive(Debug, Clone)]
pub struct SoakArgs {
    /// Store directory (created; must not hold another store).
    pub dir: PathBuf,
    /// The preset.
    pub preset: Preset,
    /// Kill/reopen/verify cycles.
    pub cycles: u64,
    /// Keys in the key space.
    pub keys: u64,
    /// Writer threads (as many readers run beside them).
    pub threads: usize,
    /// The stress process runs this long before the kill, at least ...
    pub min_ms: u64,
    /// ... and at most.
    pub max_ms: u64,
    /// Seed of the kill times and the stress processes' streams.
    pub seed: u64,
}

/// Options that make every preset's background work (flushes, merges, compactions,
/// write-back) run often within a short cycle.
pub fn soak_options(preset: Preset) -> Options {
    Options::new()
        .preset(preset)
        .pm_pool_size(64 << 20)
        .slmdb(SlmdbOptions { memtable_size: 1 << 20, output_file_size: 256 << 10, ..SlmdbOptions::default() })
        .hpdk(HpdkOptions { memtable_size: 256 << 10, vlog_pool_size: 4 << 20, ..HpdkOptions::default() })
        .lightkv(LightkvOptions {
            max_leaf_nodes: 16,
            leaf_buckets: 64,
            segment_size: 256 << 10,
            ..LightkvOptions::default()
        })
        // native: small segments (the log cleaner runs), a checkpoint every MiB of log (kills
        // land during checkpoints and opens replay checkpoint + tails), and a DRAM budget
        // below the index's size (the capacity tier moves keys to SSTables and back).
        .native(NativeOptions {
            segment_size: 256 << 10,
            checkpoint_bytes: 1 << 20,
            dram_budget: 2 << 20,
            ..NativeOptions::default()
        })
}

fn key(i: u64) -> Vec<u8> {
    format!("soak{i:08}").into_bytes()
}

fn mix(i: u64, seq: u64) -> u64 {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seq.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    x ^= x >> 31;
    x.wrapping_mul(0x94d0_49bb_1331_11eb)
}

/// Is operation `seq` of key `i` a delete? (One in eight; never the first.)
pub fn is_delete(i: u64, seq: u64) -> bool {
    seq > 1 && mix(i, seq).is_multiple_of(8)
}

/// The value of operation `seq` of key `i`: `key | seq | padding | crc`, 24..=600 bytes.
pub fn value(i: u64, seq: u64) -> Vec<u8> {
    let mut v = key(i);
    v.push(b'|');
    v.extend_from_slice(&seq.to_le_bytes());
    let pad = (mix(i, seq) % 580) as usize;
    v.extend(std::iter::repeat_n(b'a' + (seq % 26) as u8, pad));
    let c = crc32c::crc32c(&v);
    v.extend_from_slice(&c.to_le_bytes());
    v
}

/// The sequence number a value of key `i` encodes, if it is intact and names `i`.
pub fn decode(i: u64, v: &[u8]) -> Option<u64> {
    let k = key(i);
    let (body, c) = v.split_at(v.len().checked_sub(4)?);
    if crc32c::crc32c(body).to_le_bytes() != c || !body.starts_with(&k) || body.get(k.len()) != Some(&b'|') {
        return None;
    }
    let s = body.get(k.len() + 1..k.len() + 9)?;
    Some(u64::from_le_bytes(s.try_into().ok()?))
}

fn state_path(dir: &Path) -> PathBuf {
    let mut p = dir.as_os_str().to_owned();
    p.push(".expected");
    PathBuf::from(p)
}

fn read_state(dir: &Path, keys: u64) -> Result<Vec<u64>> {
    let b = std::fs::read(state_path(dir)).map_err(|e| format!("expected-state file: {e}"))?;
    if b.len() as u64 != keys * 8 {
        return Err(format!("expected-state file holds {} bytes, want {}", b.len(), keys * 8));
    }
    Ok(b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
}

/// The stress process: writers and readers until killed. Prints `ready` once the store is
/// open.
pub fn stress_main(dir: &Path, preset: Preset, keys: u64, threads: usize, seed: u64) -> Result<()> {
    let db = Arc::new(Db::open(dir, soak_options(preset)).map_err(|e| e.to_string())?);
    let state = read_state(dir, keys)?;
    let file = Arc::new(
        std::fs::OpenOptions::new().write(true).open(state_path(dir)).map_err(|e| format!("expected state: {e}"))?,
    );
    let threads = threads.max(1) as u64;
    let mut handles = Vec::new();
    for t in 0..threads {
        let (wdb, file) = (db.clone(), file.clone());
        let mut seqs: Vec<(u64, u64)> =
            (0..keys).filter(|i| i % threads == t).map(|i| (i, state[i as usize])).collect();
        handles.push(std::thread::spawn(move || -> Result<()> {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ t);
            if seqs.is_empty() {
                return Ok(());
            }
            loop {
                let j = rng.random_range(0..seqs.len());
                let (i, acked) = seqs[j];
                let s = acked + 1;
                if is_delete(i, s) {
                    wdb.delete(key(i)).map_err(|e| e.to_string())?;
                } else {
                    wdb.put(key(i), value(i, s)).map_err(|e| e.to_string())?;
                }
                file.write_all_at(&s.to_le_bytes(), i * 8).map_err(|e| e.to_string())?;
                seqs[j].1 = s;
            }
        }));
        let db = db.clone();
        handles.push(std::thread::spawn(move || -> Result<()> {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ (t + 1000));
            loop {
                let i = rng.random_range(0..keys);
                if let Some(v) = db.get(key(i)).map_err(|e| e.to_string())? {
                    if decode(i, &v).is_none() {
                        return Err(format!("key {i}: read a value that does not verify ({} bytes)", v.len()));
                    }
                }
            }
        }));
    }
    println!("ready");
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err("a stress thread panicked".into()),
        }
    }
    Ok(())
}

/// What one cycle saw.
#[derive(Debug, Clone)]
pub struct Cycle {
    /// Milliseconds the stress process ran before the kill.
    pub ran_ms: u64,
    /// Seconds to reopen the store.
    pub recovery_s: f64,
    /// Writes acknowledged during the cycle.
    pub acked: u64,
    /// In-flight writes that turned out to have landed.
    pub inflight_landed: u64,
}

/// Verify every key of the reopened store against `state`; bring `state` forward to the
/// in-flight writes that landed. Returns how many did.
fn verify(db: &Db, state: &mut [u64]) -> Result<u64> {
    let mut landed = 0;
    for (i, acked) in state.iter_mut().enumerate() {
        let i = i as u64;
        let got = db.get(key(i)).map_err(|e| format!("key {i}: {e}"))?;
        let next = *acked + 1;
        let ok_seq = |s: u64| -> bool {
            if s == *acked && *acked > 0 && !is_delete(i, s) {
                return true;
            }
            s == next && !is_delete(i, next)
        };
        match got {
            Some(v) => {
                let s = decode(i, &v).ok_or_else(|| format!("key {i}: value does not verify ({} bytes)", v.len()))?;
                if !ok_seq(s) {
                    return Err(format!("key {i}: read operation {s}, acknowledged {acked}"));
                }
                if s == next {
                    *acked = next;
                    landed += 1;
                }
            }
            None => {
                let absent_ok = *acked == 0 || is_delete(i, *acked);
                if is_delete(i, next) && !absent_ok {
                    *acked = next;
                    landed += 1;
                } else if !absent_ok {
                    return Err(format!("key {i}: missing, but operation {acked} (a put) was acknowledged"));
                }
            }
        }
    }
    Ok(landed)
}

/// Run the soak. `exe` is the `tierkv` binary (it runs [`STRESS_CMD`]). `report` gets a
/// line per cycle.
pub fn soak(exe: &Path, a: &SoakArgs, mut report: impl FnMut(u64, &Cycle)) -> Result<Vec<Cycle>> {
    std::fs::create_dir_all(&a.dir).map_err(|e| e.to_string())?;
    if std::fs::read_dir(&a.dir).map_err(|e| e.to_string())?.next().is_some() {
        return Err(format!("{} is not empty", a.dir.display()));
    }
    let keys = a.keys.max(1);
    std::fs::write(state_path(&a.dir), vec![0u8; keys as usize * 8]).map_err(|e| e.to_string())?;
    drop(Db::open(&a.dir, soak_options(a.preset)).map_err(|e| e.to_string())?);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(a.seed);
    let mut out = Vec::new();
    for c in 0..a.cycles {
        let before: u64 = read_state(&a.dir, keys)?.iter().sum();
        let mut child = Command::new(exe)
            .arg(STRESS_CMD)
            .arg("--dir")
            .arg(&a.dir)
            .arg("--preset")
            .arg(a.preset.name())
            .arg("--keys")
            .arg(keys.to_string())
            .arg("--threads")
            .arg(a.threads.to_string())
            .arg("--seed")
            .arg((a.seed ^ (c + 1).wrapping_mul(0x9e37_79b9)).to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        if let Some(o) = child.stdout.take() {
            BufReader::new(o).read_line(&mut line).map_err(|e| e.to_string())?;
        }
        if line.trim() != "ready" {
            let _ = child.kill();
            let st = child.wait().map_err(|e| e.to_string())?;
            return Err(format!("cycle {c}: the stress process failed to open the store ({st})"));
        }
        let ran_ms = rng.random_range(a.min_ms..=a.max_ms.max(a.min_ms));
        std::thread::sleep(Duration::from_millis(ran_ms));
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            return Err(format!("cycle {c}: the stress process stopped by itself ({st}) before the kill"));
        }
        // `Child::kill` is SIGKILL on Unix.
        child.kill().map_err(|e| e.to_string())?;
        let _ = child.wait();
        let mut state = read_state(&a.dir, keys)?;
        let t = Instant::now();
        let db = Db::open(&a.dir, soak_options(a.preset)).map_err(|e| format!("cycle {c}: reopen failed: {e}"))?;
        let recovery_s = t.elapsed().as_secs_f64();
        let landed = verify(&db, &mut state).map_err(|e| format!("cycle {c}: {e}"))?;
        let problems = db.check().map_err(|e| format!("cycle {c}: check: {e}"))?;
        if !problems.is_empty() {
            return Err(format!("cycle {c}: check found {problems:?}"));
        }
        db.close().map_err(|e| format!("cycle {c}: close: {e}"))?;
        drop(db);
        let bytes: Vec<u8> = state.iter().flat_map(|s| s.to_le_bytes()).collect();
        std::fs::write(state_path(&a.dir), bytes).map_err(|e| e.to_string())?;
        let after: u64 = state.iter().sum();
        let cy = Cycle { ran_ms, recovery_s, acked: after - before - landed, inflight_landed: landed };
        report(c, &cy);
        out.push(cy);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_verify_and_name_their_key_and_sequence() {
        let v = value(7, 42);
        assert_eq!(decode(7, &v), Some(42));
        assert_eq!(decode(8, &v), None, "another key's value");
        let mut bad = v.clone();
        bad[12] ^= 1;
        assert_eq!(decode(7, &bad), None, "a flipped byte");
        assert_eq!(decode(7, &v[..v.len() - 1]), None, "a torn value");
        assert!(!is_delete(3, 1), "the first operation is a put");
        let deletes = (2..1000).filter(|s| is_delete(3, *s)).count();
        assert!((80..170).contains(&deletes), "{deletes} deletes in 998 operations");
    }
}
