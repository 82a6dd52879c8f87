//! Regression (fs page model): with hoakv's default unsynced WAL, a power loss that kept the WAL's page but lost the cold value-log page its record points at left a store whose reads failed with "value-log record past the end of the file".
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::{FaultFs, Fs};
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, HoakvOptions, Preset};

fn opts(dev: &SimDevice, fs: &FaultFs) -> tierkv::Options {
    sim_options(Preset::Hoakv, dev, fs).hoakv(HoakvOptions { sync_wal: false, ..tierkv::testing::hoakv_small() })
}

#[test]
fn a_wal_record_whose_cold_value_was_lost_is_a_torn_tail() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs)).unwrap();
    db.put(b"synced", [b's'; 200]).unwrap();
    db.flush().unwrap();
    // Values over 64 bytes go to the cold value log; neither it nor the WAL is synced.
    for i in 0..5u8 {
        db.put([b'k', i], [i; 300]).unwrap();
    }
    db.simulate_process_crash();
    // The file system after a power loss: the WAL's pages written back, the value log's not.
    let after = fs.crash();
    let mut wals = 0;
    for name in fs.list(&dir()).unwrap().into_iter().filter(|n| n.starts_with("wal-")) {
        let path = dir().join(&name);
        let (Ok(full), Ok(kept)) = (fs.read_all(&path), after.read_all(&path)) else { continue };
        if full.len() > kept.len() {
            after.poke(&path, kept.len(), &full[kept.len()..]).unwrap();
            wals += 1;
        }
    }
    assert!(wals > 0, "no unsynced WAL bytes to keep");
    let db = Db::open(dir(), opts(&dev.simulate_crash(1, 0.0), &after)).unwrap();
    // The unsynced writes are gone (their values were); nothing fails to read.
    let model: Model = [(b"synced".to_vec(), vec![b's'; 200])].into_iter().collect();
    assert_matches(&db, &model, "after the power loss");
}
