//! The `Db` API of every preset against a `BTreeMap`, on the PM crash simulator and the
//! fault-injecting file system: puts, deletes, batches, conditional writes, gets, scans,
//! flush, compact, clean reopen and crash (a random subset of unpersisted PM lines evicted,
//! unsynced file data dropped). After a crash the store must hold exactly the acknowledged
//! writes.
#![no_main]
use std::collections::BTreeMap;
use std::path::PathBuf;

use libfuzzer_sys::fuzz_target;
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Options, Preset, WriteBatch};

fn options(preset: Preset, dev: &SimDevice, fs: &FaultFs) -> Options {
    tierkv::testing::sim_options(preset, dev, fs)
}

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
}

fn key(b: u8) -> Vec<u8> {
    format!("k{:02}", b % 48).into_bytes()
}

fn value(b: u8, len: u8) -> Vec<u8> {
    vec![b'a' + b % 26; usize::from(len) * 8]
}

fn all(db: &Db) -> BTreeMap<Vec<u8>, Vec<u8>> {
    db.scan(..).expect("scan").map(|e| e.expect("scan entry")).collect()
}

fuzz_target!(|data: &[u8]| {
    let mut input = Bytes(data);
    let Some(p) = input.byte() else { return };
    let preset = Preset::ALL[usize::from(p) % Preset::ALL.len()];
    let dir = PathBuf::from("/db");
    let mut dev = SimDevice::new();
    let mut fs = FaultFs::new();
    let mut db = Db::open(&dir, options(preset, &dev, &fs)).expect("open");
    let mut m: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut ops = 0;
    while let Some(op) = input.byte() {
        ops += 1;
        if ops > 200 {
            break;
        }
        let (a, b) = (input.byte().unwrap_or(0), input.byte().unwrap_or(0));
        match op % 11 {
            0 | 1 => {
                db.put(key(a), value(a, b)).expect("put");
                m.insert(key(a), value(a, b));
            }
            2 => {
                db.delete(key(a)).expect("delete");
                m.remove(&key(a));
            }
            3 => {
                let mut w = WriteBatch::new();
                w.put(key(a), value(b, a));
                w.delete(key(b));
                db.write(w).expect("batch");
                m.insert(key(a), value(b, a));
                m.remove(&key(b));
            }
            4 => {
                let added = db.insert_if_absent(key(a), value(b, 3)).expect("insert_if_absent");
                assert_eq!(added, !m.contains_key(&key(a)));
                m.entry(key(a)).or_insert_with(|| value(b, 3));
            }
            5 => {
                let updated = db.update_if_present(key(a), value(b, 5)).expect("update_if_present");
                assert_eq!(updated, m.contains_key(&key(a)));
                if let Some(v) = m.get_mut(&key(a)) {
                    *v = value(b, 5);
                }
            }
            6 => assert_eq!(db.get(key(a)).expect("get"), m.get(&key(a)).cloned()),
            7 => match a % 2 {
                0 => db.flush().expect("flush"),
                _ => db.compact().expect("compact"),
            },
            8 => assert_eq!(all(&db), m, "scan"),
            9 => {
                db.close().expect("close");
                drop(db);
                db = Db::open(&dir, options(preset, &dev, &fs)).expect("reopen");
            }
            _ => {
                db.simulate_process_crash();
                dev = dev.simulate_crash(u64::from(a), f64::from(b) / 255.0);
                fs = fs.crash();
                db = Db::open(&dir, options(preset, &dev, &fs)).expect("open after crash");
                assert_eq!(all(&db), m, "{preset}: state after a crash");
                assert!(db.check().expect("check").is_empty(), "{preset}: check after a crash");
            }
        }
    }
    assert_eq!(all(&db), m, "{preset}: final state");
});
