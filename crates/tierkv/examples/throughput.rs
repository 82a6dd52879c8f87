//! Single-thread put/get throughput of one preset, db_bench style (`fillrandom` then
//! `readrandom` over 16-byte keys). A stopgap until the benchmark harness (`tierkv bench`)
//! measures every preset against LevelDB and RocksDB in one run.
//!
//! ```text
//! cargo run --release -p tierkv --example throughput -- [--num N] [--value-size B] [--dir D]
//! ```

use std::time::Instant;

use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tierkv::{Db, Options};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let num: usize = arg(&args, "--num").map(|s| s.parse()).transpose()?.unwrap_or(200_000);
    let value_size: usize = arg(&args, "--value-size").map(|s| s.parse()).transpose()?.unwrap_or(1024);
    let base = arg(&args, "--dir").unwrap_or_else(|| {
        if std::path::Path::new("/dev/shm").is_dir() {
            "/dev/shm".into()
        } else {
            std::env::temp_dir().to_string_lossy().into_owned()
        }
    });
    let preset: tierkv::Preset = arg(&args, "--preset").unwrap_or_else(|| "pmekv".into()).parse()?;
    // SSTables (slmdb) go to --disk-dir (default: the temp directory), PM pools to --dir.
    let disk = arg(&args, "--disk-dir").unwrap_or_else(|| std::env::temp_dir().to_string_lossy().into_owned());
    let dir = tempfile::Builder::new().prefix("tierkv-throughput").tempdir_in(&disk)?;
    let pm = tempfile::Builder::new().prefix("tierkv-throughput-pm").tempdir_in(&base)?;
    let opts = || Options::new().preset(preset).pm_path(pm.path());

    let mut keys: Vec<[u8; 16]> = (0..num as u64)
        .map(|i| {
            let mut k = [0u8; 16];
            k[..8].copy_from_slice(&i.to_be_bytes());
            k[8..].copy_from_slice(&(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_be_bytes());
            k
        })
        .collect();
    let mut rng = SmallRng::seed_from_u64(42);
    keys.shuffle(&mut rng);
    let mut value = vec![0u8; value_size];
    rng.fill(&mut value[..]);

    let db = Db::open(dir.path(), opts())?;
    let t = Instant::now();
    for k in &keys {
        db.put(k, &value)?;
    }
    let put_s = t.elapsed().as_secs_f64();
    keys.shuffle(&mut rng);
    let t = Instant::now();
    let mut found = 0usize;
    for k in &keys {
        found += usize::from(db.get(k)?.is_some());
    }
    let get_s = t.elapsed().as_secs_f64();
    assert_eq!(found, num, "every key must be found");
    db.flush()?;
    let s = db.stats();
    let t = Instant::now();
    db.close()?;
    drop(db);
    let close_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let db = Db::open(dir.path(), opts())?;
    let open_s = t.elapsed().as_secs_f64();
    assert_eq!(db.stats().keys, num as u64);
    println!(
        "preset {} | {num} keys x {value_size} B values | PM in {base} | flush instruction {}",
        s.preset,
        tierkv::pm::FlushInstr::detect().name()
    );
    println!("fillrandom  {:>12.0} ops/s  ({:.2} s)", num as f64 / put_s, put_s);
    println!("readrandom  {:>12.0} ops/s  ({:.2} s)", num as f64 / get_s, get_s);
    println!(
        "PM write amplification {:.2} ({} B persisted for {} user B), DRAM index {} B",
        s.write_amp_pm, s.pm_bytes_written, s.user_bytes_written, s.dram_index_bytes
    );
    println!("disk write amplification {:.2}", s.write_amp_disk);
    for (k, v) in &s.design {
        println!("  {k} = {v}");
    }
    println!("clean close {close_s:.2} s, reopen {open_s:.2} s");
    Ok(())
}
