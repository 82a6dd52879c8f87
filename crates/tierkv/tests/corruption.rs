//! Damaged persistent state: flipped, zeroed and truncated bytes in every PM structure and
//! file must give `Error::Corruption` (or the correct data, where a checksum lets recovery
//! skip a torn tail) — never a panic and never a wrong value.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;

use common::*;
use tierkv::engine::pmekv::layout::{self, Checkpoint, LogEntry, LogKind, Superblock};
use tierkv::fs::{FaultFs, Fs};
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Error, Preset};

const PRESET: Preset = Preset::Pmekv;

/// A store with some history, cleanly closed (or crashed with live logs when `live_log`).
fn build(live_log: bool) -> (SimDevice, FaultFs, Model) {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let db = Db::open(dir(), sim_options(PRESET, &dev, &fs)).unwrap();
    let mut m = Model::new();
    let steps = workload(7, 300, 120, false);
    for s in steps.iter().filter(|s| s.writes()) {
        model_apply(&mut m, s);
        db_apply(&db, s).unwrap();
    }
    db.flush().unwrap();
    if live_log {
        for i in 0..20u32 {
            let k = format!("live{i:03}").into_bytes();
            let v = format!("value-{i}").into_bytes();
            db.put(&k, &v).unwrap();
            m.insert(k, v);
        }
        db.simulate_process_crash();
        return (dev.simulate_crash(1, 0.0), fs.crash(), m);
    }
    db.close().unwrap();
    (dev, fs, m)
}

/// What opening a damaged store may do: fail with Corruption, or open and return, for
/// every key, either the right value or Corruption. Returns true if it opened.
fn verify_damaged(dev: &SimDevice, fs: &FaultFs, m: &Model, ctx: &str) -> bool {
    let db = match Db::open(dir(), sim_options(PRESET, dev, fs)) {
        Err(e) => {
            assert!(e.is_corruption(), "{ctx}: open failed with a non-corruption error: {e}");
            return false;
        }
        Ok(db) => db,
    };
    for (k, v) in m {
        match db.get(k) {
            Ok(Some(got)) => assert_eq!(&got, v, "{ctx}: wrong value for {}", tierkv::escape(k)),
            Ok(None) => panic!("{ctx}: key {} silently lost", tierkv::escape(k)),
            Err(e) => assert!(e.is_corruption(), "{ctx}: get failed with {e}"),
        }
    }
    let mut it = db.iter().unwrap();
    loop {
        match it.next() {
            Ok(Some((k, v))) => {
                assert_eq!(m.get(&k), Some(&v), "{ctx}: scan returned a wrong entry")
            }
            Ok(None) => break,
            Err(e) => {
                assert!(e.is_corruption(), "{ctx}: scan failed with {e}");
                break;
            }
        }
    }
    true
}

fn image(dev: &SimDevice) -> Vec<u8> {
    dev.durable_image(0).unwrap()
}

/// Named byte ranges of every live PM structure of a cleanly closed store.
fn structures(dev: &SimDevice, m: &Model) -> Vec<(String, u64, u64)> {
    let img = image(dev);
    let sb = Superblock::decode(&img[64..128]).unwrap();
    let slots: Vec<Option<Checkpoint>> =
        layout::CKPT_SLOT_ADDR.iter().map(|&a| Checkpoint::decode(&img[a as usize..a as usize + 64])).collect();
    let (active, ck) =
        slots.iter().enumerate().filter_map(|(i, c)| c.map(|c| (i, c))).max_by_key(|(_, c)| c.generation).unwrap();
    let mut out = vec![
        ("pool header".to_string(), 0, 64),
        ("superblock".to_string(), 64, 64),
        ("active checkpoint slot".to_string(), layout::CKPT_SLOT_ADDR[active], 64),
        ("directory".to_string(), ck.dir_addr, ck.dir_bytes),
    ];
    let _ = sb;
    let kns =
        layout::dir_decode(&img[ck.dir_addr as usize..(ck.dir_addr + ck.dir_bytes) as usize], ck.kn_count).unwrap();
    let mut values = 0;
    for (i, (a, l)) in kns.iter().enumerate() {
        out.push((format!("KeyNode {i}"), *a, *l as u64));
        let entries = layout::keynode_decode(&img[*a as usize..(*a + *l as u64) as usize]).unwrap();
        for (k, v) in entries.iter().take(2) {
            assert!(m.contains_key(&**k));
            out.push((format!("value of {}", tierkv::escape(k)), v.addr, layout::VALUE_HEADER + v.len as u64));
            values += 1;
        }
    }
    assert!(values > 10 && kns.len() > 5, "the store must have a real tree to damage");
    out
}

#[test]
fn flipped_bytes_in_every_pm_structure() {
    let (dev, fs, m) = build(false);
    let mut cases = 0;
    let mut opened = 0;
    for (name, addr, len) in structures(&dev, &m) {
        let step = (len / 9).max(1);
        let mut off = 0;
        while off < len {
            let copy = dev.simulate_crash(0, 0.0);
            let byte = image(&copy)[(addr + off) as usize];
            assert!(copy.poke(0, (addr + off) as usize, &[byte ^ 0x5a]));
            let ctx = format!("{name} byte {off} of {len}");
            if verify_damaged(&copy, &fs.crash(), &m, &ctx) {
                opened += 1;
                // A store that opened with a damaged value must say so in `check`.
                if name.starts_with("value") {
                    let db = Db::open(dir(), sim_options(PRESET, &copy, &fs.crash())).unwrap();
                    assert!(!db.check().unwrap().is_empty(), "{ctx}: check missed a damaged value");
                }
            }
            cases += 1;
            off += step;
        }
    }
    eprintln!("{cases} flipped-byte cases, {opened} opened with every key correct or reported corrupt");
    assert!(cases > 100);
}

#[test]
fn zeroed_records_are_corruption() {
    let (dev, fs, m) = build(false);
    for (name, addr, len) in structures(&dev, &m) {
        let copy = dev.simulate_crash(0, 0.0);
        assert!(copy.poke(0, addr as usize, &vec![0u8; len as usize]));
        let opened = verify_damaged(&copy, &fs.crash(), &m, &format!("zeroed {name}"));
        // A zeroed value is reported by get; a zeroed active checkpoint slot may fall back to
        // the older checkpoint plus the logs, which verify_damaged has proven correct.
        if !name.starts_with("value") && !name.contains("checkpoint slot") {
            assert!(!opened, "zeroed {name} must not open");
        }
    }
    // Both checkpoint slots gone: no valid checkpoint.
    let copy = dev.simulate_crash(0, 0.0);
    assert!(copy.poke(0, 128, &[0u8; 128]));
    assert!(!verify_damaged(&copy, &fs.crash(), &m, "both slots zeroed"));
}

#[test]
fn truncated_pool_is_corruption() {
    let (dev, fs, _m) = build(false);
    for len in [32usize, 4096, 600_000] {
        let copy = dev.simulate_crash(0, 0.0);
        assert!(copy.truncate_pool(0, len));
        let e = Db::open(dir(), sim_options(PRESET, &copy, &fs.crash())).expect_err("truncated pool must not open");
        assert!(e.is_corruption(), "pool cut to {len}: {e}");
    }
}

#[test]
fn damaged_options_file_is_corruption() {
    let (dev, fs, _m) = build(false);
    let path = dir().join("OPTIONS");
    for off in 0..32 {
        let f = fs.crash();
        let b = f.read_all(&path).unwrap()[off];
        f.poke(&path, off, &[b ^ 1]).unwrap();
        let e = Db::open(dir(), sim_options(PRESET, &dev, &f)).expect_err("damaged OPTIONS must not open");
        assert!(
            matches!(&e, Error::Corruption { file, offset, .. } if file == &path && *offset <= 32),
            "byte {off}: {e}"
        );
    }
    let f = fs.crash();
    f.truncate(&path, 20).unwrap();
    let e = Db::open(dir(), sim_options(PRESET, &dev, &f)).expect_err("truncated OPTIONS");
    assert!(e.is_corruption(), "{e}");
}

/// Live entries of one log ring of the crashed store, in sequence order: (seq, address).
fn log_entries(dev: &SimDevice, kind: LogKind) -> Vec<(u64, u64)> {
    let img = image(dev);
    let sb = Superblock::decode(&img[64..128]).unwrap();
    let (start, len) = if kind == LogKind::Key { sb.key_log } else { sb.kv_log };
    let mut out = Vec::new();
    let mut off = 0;
    while off < len {
        let a = (start + off) as usize;
        match LogEntry::decode(&img[a..(start + len) as usize], kind) {
            Some((e, flag)) if flag != 0 => {
                out.push((e.seq, start + off));
                off += LogEntry::size(e.key.len());
            }
            Some((e, _)) => off += LogEntry::size(e.key.len()),
            None => off += 64,
        }
    }
    out.sort();
    out
}

#[test]
fn damaged_live_log_entry_is_corruption_not_silent_loss() {
    let (dev, fs, m) = build(true);
    let entries = log_entries(&dev, LogKind::Key);
    assert!(entries.len() >= 20, "the crashed store has live key-log entries");
    // The newest 20 entries are the puts after the last checkpoint (older ones are covered
    // by it; their cleared KFlags were never persisted). Damage one in the middle of those.
    let (seq, mid) = entries[entries.len() - 10];
    // Only the key-log copy damaged: the key-value tier still holds the entry (its KVFlag
    // was cleared without a persist), so recovery is complete and correct.
    let copy = dev.simulate_crash(0, 0.0);
    assert!(copy.poke(0, (mid + 20) as usize, &[0xee]));
    let db = Db::open(dir(), sim_options(PRESET, &copy, &fs.crash())).unwrap();
    assert_matches(&db, &m, "key-log entry damaged, key-value log intact");
    drop(db);
    // Both copies damaged: the sequence gap is detected.
    let kv = log_entries(&dev, LogKind::KeyValue);
    let (_, kv_addr) = *kv.iter().find(|(s, _)| *s == seq).expect("the entry is in the key-value log too");
    let copy = dev.simulate_crash(0, 0.0);
    assert!(copy.poke(0, (mid + 20) as usize, &[0xee]));
    assert!(copy.poke(0, (kv_addr + 20) as usize, &[0xee]));
    let e =
        Db::open(dir(), sim_options(PRESET, &copy, &fs.crash())).expect_err("a lost middle log entry must not open");
    assert!(matches!(&e, Error::Corruption { detail, .. } if detail.contains("missing or damaged")), "{e}");
    // The undamaged store recovers everything.
    let db = Db::open(dir(), sim_options(PRESET, &dev.simulate_crash(0, 0.0), &fs.crash())).unwrap();
    assert_matches(&db, &m, "undamaged live log");
}

#[test]
fn check_reports_a_damaged_live_log_entry() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let db = Db::open(dir(), sim_options(PRESET, &dev, &fs)).unwrap();
    for i in 0..20u32 {
        db.put(format!("k{i:02}"), b"v").unwrap();
    }
    assert_eq!(db.check().unwrap(), Vec::<String>::new());
    let entries = log_entries(&dev, LogKind::Key);
    assert_eq!(entries.len(), 20, "no checkpoint yet: one live key-log entry per put");
    let (seq, addr) = entries[10];
    let at = addr as usize + 20;
    let b = image(&dev)[at];
    assert!(dev.poke(0, at, &[b ^ 0xff]));
    let problems = db.check().unwrap();
    assert!(
        problems.iter().any(|p| p.contains("key log") && p.contains(&format!("Some({seq})"))),
        "check must name the damaged entry {seq}: {problems:?}"
    );
}

#[test]
fn foreign_or_garbage_pool_files_are_corruption() {
    let t = tempdir();
    let a = t.path().join("a");
    let b = t.path().join("b");
    for d in [&a, &b] {
        let db = Db::open(d, tierkv::Options::new().pm_pool_size(4 << 20).pmekv(small_logs())).unwrap();
        db.put(b"k", d.to_string_lossy().as_bytes()).unwrap();
        db.close().unwrap();
    }
    // b's pool under a's directory: it belongs to another store.
    std::fs::copy(b.join("pm/pool-000000"), a.join("pm/pool-000000")).unwrap();
    let e = Db::open(&a, tierkv::Options::new().pmekv(small_logs())).expect_err("foreign pool");
    assert!(matches!(&e, Error::Corruption { detail, .. } if detail.contains("belongs to store")), "{e}");
    // Garbage of the right size.
    std::fs::write(a.join("pm/pool-000000"), vec![0x42u8; 4 << 20]).unwrap();
    let e = Db::open(&a, tierkv::Options::new().pmekv(small_logs())).expect_err("garbage pool");
    assert!(matches!(&e, Error::Corruption { detail, .. } if detail.contains("not a tierkv PM pool")), "{e}");
    // Too small.
    std::fs::write(a.join("pm/pool-000000"), b"tiny").unwrap();
    let e = Db::open(&a, tierkv::Options::new().pmekv(small_logs())).expect_err("tiny pool");
    assert!(e.is_corruption(), "{e}");
    // Missing.
    std::fs::remove_file(a.join("pm/pool-000000")).unwrap();
    let e = Db::open(&a, tierkv::Options::new().pmekv(small_logs())).expect_err("missing pool");
    assert!(matches!(&e, Error::Corruption { detail, .. } if detail.contains("missing")), "{e}");
    assert!(Path::new(&b).exists());
}

fn small_logs() -> tierkv::PmekvOptions {
    tierkv::PmekvOptions { kv_log_size: 256 << 10, key_log_size: 256 << 10, ..Default::default() }
}
