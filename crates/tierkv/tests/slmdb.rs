//! SLM-DB: scenarios in which each compaction candidate selection scheme must pick specific
//! files, the merge result, crash during flush and compaction at every persist point of a
//! small case (with unsynced file data dropped), and damaged SSTable / MANIFEST bytes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tierkv::fs::{FaultFs, Fs};
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Options, Preset, SlmdbOptions};

fn opts(dev: &SimDevice, fs: &FaultFs, s: SlmdbOptions) -> Options {
    sim_options(Preset::Slmdb, dev, fs).slmdb(s)
}

/// Only the named schemes on; big compaction outputs so one merge makes one file.
fn schemes(live: bool, leaf: bool, seq: bool) -> SlmdbOptions {
    SlmdbOptions {
        enable_live_ratio: live,
        enable_leaf_scan: leaf,
        enable_seq_degree: seq,
        output_file_size: 1 << 20,
        ..slmdb_small()
    }
}

fn stat(db: &Db, name: &str) -> u64 {
    *db.stats().design.get(name).unwrap_or_else(|| panic!("no design stat {name}"))
}

fn sst_files(fs: &FaultFs) -> Vec<u64> {
    let mut v: Vec<u64> =
        fs.list(&dir()).unwrap().iter().filter_map(|n| n.strip_suffix(".sst").and_then(|n| n.parse().ok())).collect();
    v.sort_unstable();
    v
}

fn kv(i: u32, round: u32) -> (Vec<u8>, Vec<u8>) {
    (format!("k{i:05}").into_bytes(), format!("v{i}-{round}-{}", "x".repeat(80)).into_bytes())
}

#[test]
fn live_key_ratio_picks_the_file_with_garbage_and_merge_drops_obsolete_entries() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, schemes(true, false, false))).unwrap();
    let mut m = Model::new();
    for i in 0..200 {
        let (k, v) = kv(i, 0);
        db.put(&k, &v).unwrap();
        m.insert(k, v);
    }
    db.flush().unwrap(); // file 1: 200 keys
    assert_eq!(sst_files(&fs), vec![1]);
    for i in 0..100 {
        let (k, v) = kv(i, 1);
        db.put(&k, &v).unwrap();
        m.insert(k, v);
    }
    // File 2 takes 100 keys from file 1: live ratio 100/200 = 0.5 < 0.7, so file 1 (and only
    // it: file 2 is all live) is a candidate and is merged alone into file 3, dropping the
    // 100 entries the tree no longer points at.
    db.flush().unwrap();
    assert_eq!(stat(&db, "candidates_live_ratio"), 1);
    assert_eq!(stat(&db, "compactions"), 1);
    assert_eq!(stat(&db, "compaction_input_files"), 1);
    assert_eq!(stat(&db, "compaction_output_files"), 1);
    assert_eq!(stat(&db, "compaction_entries_dropped"), 100);
    assert_eq!(sst_files(&fs), vec![2, 3]);
    assert_eq!(stat(&db, "live_keys_in_sstables"), 200);
    assert_eq!(stat(&db, "total_keys_in_sstables"), 200);
    assert_matches(&db, &m, "after live-ratio compaction");
    db.close().unwrap();
    drop(db);
    let db = Db::open(dir(), opts(&dev, &fs, schemes(true, false, false))).unwrap();
    assert_matches(&db, &m, "reopened");
}

/// `files` flushes whose keys interleave: key `i` goes to flush `i % files`.
fn interleaved(db: &Db, m: &mut Model, files: u32, per_file: u32) {
    for f in 0..files {
        for j in 0..per_file {
            let (k, v) = kv(j * files + f, 0);
            db.put(&k, &v).unwrap();
            m.insert(k, v);
        }
        db.flush().unwrap();
    }
}

#[test]
fn leaf_node_scan_picks_the_files_a_scan_sees_and_merges_the_most_overlapping() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    // Scan 11 files' worth of keys: with at most 11 files of 20 keys, every scan covers
    // the whole tree, so what it sees does not depend on where the round-robin cursor is.
    let o = SlmdbOptions { leaf_scan_files: 11, ..schemes(false, true, false) };
    let db = Db::open(dir(), opts(&dev, &fs, o)).unwrap();
    let mut m = Model::new();
    // Ten files of interleaved keys (key j*11+f in file f): a scan sees 10 files, not more
    // than the threshold (10): no candidate.
    for f in 0..11 {
        for j in 0..20 {
            let (k, v) = kv(j * 11 + f, 0);
            db.put(&k, &v).unwrap();
            m.insert(k, v);
        }
        db.flush().unwrap();
        if f < 10 {
            assert_eq!(stat(&db, "candidates_leaf_scan"), 0, "after {} files", f + 1);
            assert_eq!(stat(&db, "compactions"), 0);
        }
    }
    // The eleventh: the scan after its flush sees 11 distinct files (> 10), all become
    // candidates; they all overlap fully, so the merge takes the bounded 10 of them.
    assert_eq!(stat(&db, "candidates_leaf_scan"), 11);
    assert_eq!(stat(&db, "compactions"), 1);
    assert_eq!(stat(&db, "compaction_input_files"), 10);
    assert_eq!(stat(&db, "compaction_entries_dropped"), 0);
    assert_eq!(stat(&db, "compaction_candidates"), 1, "the eleventh candidate waits");
    let files = sst_files(&fs);
    assert_eq!(files.len(), 2, "one input left and one merged output: {files:?}");
    assert_eq!(files[1], 12, "the output is the next file number");
    assert_matches(&db, &m, "after leaf-scan compaction");
}

#[test]
fn range_query_sequentiality_adds_the_files_of_a_scattered_sub_range() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, schemes(false, false, true))).unwrap();
    let mut m = Model::new();
    interleaved(&db, &mut m, 9, 10);
    assert_eq!(stat(&db, "compaction_candidates"), 0);
    // 30 consecutive keys come from 9 files (> 8): the scan adds those 9.
    let got: Vec<_> = db.scan(b"k".as_slice()..).unwrap().take(30).map(|r| r.unwrap()).collect();
    assert_eq!(got.len(), 30);
    assert_eq!(stat(&db, "candidates_seq_degree"), 9);
    assert_eq!(stat(&db, "compaction_candidates"), 9);
    db.compact().unwrap();
    assert_eq!(stat(&db, "compactions"), 1);
    assert_eq!(stat(&db, "compaction_input_files"), 9);
    assert_eq!(sst_files(&fs), vec![10]);
    // Now a scan reads from one file: no new candidates.
    let _: Vec<_> = db.scan(b"k".as_slice()..).unwrap().take(30).collect();
    assert_eq!(stat(&db, "candidates_seq_degree"), 9);
    assert_matches(&db, &m, "after sequentiality compaction");
}

#[test]
fn switched_off_schemes_select_nothing() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, schemes(false, false, false))).unwrap();
    let mut m = Model::new();
    interleaved(&db, &mut m, 12, 10);
    for i in 0..60 {
        let (k, v) = kv(i, 1);
        db.put(&k, &v).unwrap();
        m.insert(k, v);
    }
    db.flush().unwrap();
    let _: Vec<_> = db.scan(b"k".as_slice()..).unwrap().take(100).collect();
    db.compact().unwrap();
    assert_eq!(stat(&db, "compactions"), 0);
    assert_eq!(stat(&db, "compaction_candidates"), 0);
    assert_eq!(sst_files(&fs).len(), 13);
    assert_matches(&db, &m, "no compaction");
}

/// Steps of the crash case: puts that flush twice and trigger a live-ratio compaction.
#[derive(Debug, Clone)]
enum S {
    Put(u32, u32),
    Del(u32),
    Flush,
}

fn case() -> Vec<S> {
    let mut v = Vec::new();
    for i in 0..40 {
        v.push(S::Put(i, 0));
    }
    v.push(S::Flush);
    for i in 0..30 {
        v.push(if i % 5 == 4 { S::Del(i) } else { S::Put(i, 1) });
    }
    v.push(S::Flush); // file 1 falls below 0.7 live: compaction
    for i in 35..45 {
        v.push(S::Put(i, 2));
    }
    v
}

fn apply(db: &Db, m: &mut Model, s: &S) {
    match s {
        S::Put(i, r) => {
            let (k, v) = kv(*i, *r);
            db.put(&k, &v).unwrap();
            m.insert(k, v);
        }
        S::Del(i) => {
            let (k, _) = kv(*i, 0);
            db.delete(&k).unwrap();
            m.remove(&k);
        }
        S::Flush => db.flush().unwrap(),
    }
}

#[test]
fn crash_at_every_persist_point_of_flush_and_compaction() {
    let steps = case();
    let o = |dev: &SimDevice, fs: &FaultFs| opts(dev, fs, schemes(true, false, false));
    // A clean run: count fences, and make sure the case flushes and compacts.
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), o(&dev, &fs)).unwrap();
    let base = dev.fences();
    let mut m = Model::new();
    for s in &steps {
        apply(&db, &mut m, s);
    }
    assert_eq!(stat(&db, "flushes"), 2);
    assert_eq!(stat(&db, "compactions"), 1);
    let total = dev.fences() - base;
    drop(db);
    let mut points = 0;
    for n in 1..=total {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let f = fs.clone();
        dev.on_freeze(move || f.freeze());
        let db = Db::open(dir(), o(&dev, &fs)).unwrap();
        dev.crash_before_fence(dev.fences() + n);
        let mut before = Model::new();
        let mut inflight = None;
        for (i, s) in steps.iter().enumerate() {
            let mut after = before.clone();
            apply(&db, &mut after, s);
            if dev.crashed() {
                inflight = Some((i, after));
                break;
            }
            before = after;
        }
        let (i, after) = inflight.unwrap_or_else(|| panic!("crash point {n} not reached"));
        db.simulate_process_crash();
        for frac in [0.0, 0.5, 1.0] {
            let dev2 = dev.simulate_crash(n, frac);
            let fs2 = fs.crash();
            let ctx = format!("fence {n} (step {i}: {:?}) evict {frac}", steps[i]);
            let db = Db::open(dir(), o(&dev2, &fs2)).unwrap_or_else(|e| panic!("{ctx}: reopen: {e}"));
            let got = dump(&db);
            assert!(got == before || got == after, "{ctx}: neither the old nor the new state");
            let problems = db.check().unwrap();
            assert!(problems.is_empty(), "{ctx}: check: {problems:?}");
            // The recovered store keeps working: finish the case, crash again, verify.
            let mut m = got;
            for s in &steps[i + 1..] {
                apply(&db, &mut m, s);
            }
            db.simulate_process_crash();
            let dev3 = dev2.simulate_crash(n + 1, 0.5);
            let db = Db::open(dir(), o(&dev3, &fs2.crash())).unwrap();
            assert_matches(&db, &m, &format!("{ctx}: second crash"));
            points += 1;
        }
    }
    eprintln!("slmdb flush/compaction case: {points} crash states verified ({total} fences)");
    assert!(total > 100);
}

fn damaged_file_gives_corruption(name: &str, offsets: &[usize]) {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, schemes(true, false, false))).unwrap();
    let mut m = Model::new();
    for s in case().iter().take(71) {
        apply(&db, &mut m, s);
    }
    db.close().unwrap();
    drop(db);
    let path = dir().join(name);
    let len = fs.read_all(&path).unwrap().len();
    for &off in offsets {
        let off = off.min(len - 1);
        let (dev2, fs2) = (dev.simulate_crash(0, 0.0), fs.crash());
        let orig = fs2.read_all(&path).unwrap()[off];
        fs2.poke(&path, off, &[orig ^ 0x5a]).unwrap();
        match Db::open(dir(), opts(&dev2, &fs2, schemes(true, false, false))) {
            Err(e) => assert!(e.is_corruption(), "{name}@{off}: open failed with {e}"),
            Ok(db) => {
                let mut bad = 0;
                for (k, v) in &m {
                    match db.get(k) {
                        Ok(got) => assert_eq!(got.as_ref(), Some(v), "{name}@{off}: wrong value"),
                        Err(e) => {
                            assert!(e.is_corruption(), "{name}@{off}: {e}");
                            bad += 1;
                        }
                    }
                }
                // Every byte is under a checksum: the damage is reported somewhere.
                let problems = db.check().unwrap();
                assert!(!problems.is_empty(), "{name}@{off}: check missed the damage (gets failing: {bad})");
            }
        }
    }
}

#[test]
fn damaged_sstable_and_manifest_bytes_are_typed_errors() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, schemes(true, false, false))).unwrap();
    let mut m = Model::new();
    for s in case().iter().take(71) {
        apply(&db, &mut m, s);
    }
    let files = sst_files(&fs);
    db.close().unwrap();
    drop(db);
    let table = format!("{:06}.sst", files[0]);
    let len = fs.read_all(&dir().join(&table)).unwrap().len();
    let offs: Vec<usize> = (0..len).step_by(37).chain([len - 1, len - 48, len - 60]).collect();
    damaged_file_gives_corruption(&table, &offs);
    let cur = String::from_utf8(fs.read_all(&dir().join("CURRENT")).unwrap()).unwrap();
    let manifest = cur.trim_end().to_string();
    let mlen = fs.read_all(&dir().join(&manifest)).unwrap().len();
    // Every byte of the manifest's single snapshot record (the file is rewritten at open).
    let moffs: Vec<usize> = (0..mlen).collect();
    damaged_file_gives_corruption(&manifest, &moffs);
}

/// Background threads on (flushes run in the middle of compactions): one writer overwrites
/// keys while flushes and compactions run; the device is frozen at a random fence. The
/// reopened store holds every write acknowledged before the freeze (and at most the one in
/// flight), and `check` (live counts included) is clean.
#[test]
fn crash_with_background_flush_during_compaction() {
    let o = |dev: &SimDevice, fs: &FaultFs| {
        opts(dev, fs, SlmdbOptions { background: true, output_file_size: 8 << 10, ..schemes(true, true, false) })
    };
    let writes: Vec<(Vec<u8>, Vec<u8>)> = (0..3000u32)
        .map(|i| kv((i * 7919) % 600, i))
        .map(|(k, mut v)| {
            (k, {
                v.extend_from_slice(&[b'p'; 200]);
                v
            })
        })
        .collect();
    // A run without a crash: it must flush inside a compaction at least once.
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), o(&dev, &fs)).unwrap();
    let base = dev.fences();
    for (k, v) in &writes {
        db.put(k, v).unwrap();
    }
    db.flush().unwrap();
    let total = dev.fences() - base;
    let during = stat(&db, "flushes_during_compaction");
    let compactions = stat(&db, "compactions");
    assert!(compactions > 0);
    let mut m = Model::new();
    for (k, v) in &writes {
        m.insert(k.clone(), v.clone());
    }
    assert_matches(&db, &m, "no crash");
    db.close().unwrap();
    drop(db);
    eprintln!("background run: {compactions} compactions, {during} flushes during a compaction, {total} fences");
    assert!(during > 0, "no flush ran inside a compaction");
    let mut crashed_after_interleaving = 0;
    for (i, n) in (1..=60u64).map(|i| i * total / 61).enumerate() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let f = fs.clone();
        dev.on_freeze(move || f.freeze());
        let db = Db::open(dir(), o(&dev, &fs)).unwrap();
        dev.crash_before_fence(dev.fences() + n);
        let mut acked = 0;
        for (k, v) in &writes {
            if dev.crashed() {
                break;
            }
            if db.put(k, v).is_err() {
                break;
            }
            if !dev.crashed() {
                acked += 1;
            }
        }
        if stat(&db, "flushes_during_compaction") > 0 {
            crashed_after_interleaving += 1;
        }
        db.simulate_process_crash();
        let dev2 = dev.simulate_crash(n, [0.0, 0.5, 1.0][i % 3]);
        let db = Db::open(dir(), o(&dev2, &fs.crash())).unwrap_or_else(|e| panic!("fence {n}: reopen: {e}"));
        let got = dump(&db);
        let prefix = |j: usize| -> Model {
            let mut m = Model::new();
            for (k, v) in &writes[..j] {
                m.insert(k.clone(), v.clone());
            }
            m
        };
        assert!(
            got == prefix(acked) || got == prefix((acked + 1).min(writes.len())),
            "fence {n}: recovered state is not the {acked} acknowledged writes (+1)"
        );
        let problems = db.check().unwrap();
        assert!(problems.is_empty(), "fence {n}: {problems:?}");
    }
    eprintln!("{crashed_after_interleaving} of 60 crash points came after a flush inside a compaction");
}

/// On the real file system SSTables are mapped; a damaged data block is still a typed
/// error for `get` and `scan`, and `check` names it.
#[test]
fn damaged_block_in_a_mapped_sstable_is_corruption() {
    let t = tempdir();
    let o = || Options::new().preset(Preset::Slmdb).pm_pool_size(1 << 20).slmdb(slmdb_small());
    let db = Db::open(t.path(), o()).unwrap();
    for i in 0..50 {
        let (k, v) = kv(i, 0);
        db.put(&k, &v).unwrap();
    }
    db.flush().unwrap();
    db.close().unwrap();
    drop(db);
    let sst = t.path().join("000001.sst");
    let mut bytes = std::fs::read(&sst).unwrap();
    bytes[20] ^= 0x40; // inside the first data block
    std::fs::write(&sst, &bytes).unwrap();
    let db = Db::open(t.path(), o()).unwrap();
    let (k0, _) = kv(0, 0);
    assert!(db.get(&k0).unwrap_err().is_corruption());
    let first = db.scan::<std::ops::RangeFull>(..).unwrap().next().unwrap();
    assert!(first.unwrap_err().is_corruption());
    let (k49, v49) = kv(49, 0);
    assert_eq!(db.get(&k49).unwrap(), Some(v49), "other blocks still read");
    let problems = db.check().unwrap();
    assert!(problems.iter().any(|p| p.contains("checksum")), "{problems:?}");
}

/// §3.3: "once the range query operation is done, we find the sub-range with the maximum
/// number of unique files" and only *those* files become candidates. A 60-key query whose
/// first sub-range spans 9 files and whose second spans 10 other files adds the 10 files of
/// the worst sub-range, not all 19.
#[test]
fn range_query_sequentiality_adds_only_the_worst_sub_range() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, schemes(false, false, true))).unwrap();
    let mut m = Model::new();
    // Keys 0..30 spread over 9 files, keys 30..60 over 10 further files.
    for (lo, hi, files) in [(0u32, 30u32, 9u32), (30, 60, 10)] {
        for f in 0..files {
            for i in (lo..hi).filter(|i| (i - lo) % files == f) {
                let (k, v) = kv(i, 0);
                db.put(&k, &v).unwrap();
                m.insert(k, v);
            }
            db.flush().unwrap();
        }
    }
    assert_eq!(sst_files(&fs).len(), 19);
    assert_eq!(stat(&db, "candidates_seq_degree"), 0);
    let got: Vec<_> = db.scan(b"k".as_slice()..).unwrap().take(60).map(|r| r.unwrap()).collect();
    assert_eq!(got.len(), 60);
    assert_eq!(stat(&db, "candidates_seq_degree"), 10, "only the worst sub-range's files");
    assert_matches(&db, &m, "after the scan");
}

/// The sequentiality degree counts the files a range query *reads*: keys the MemTable
/// serves (newer versions of keys whose older versions sit in scattered files) read no
/// file, so a query over them adds no candidate.
#[test]
fn range_query_sequentiality_ignores_keys_served_by_the_memtable() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let db = Db::open(dir(), opts(&dev, &fs, schemes(false, false, true))).unwrap();
    let mut m = Model::new();
    interleaved(&db, &mut m, 9, 10);
    // The first 40 keys overwritten: their newest versions are in the MemTable.
    for i in 0..40 {
        let (k, v) = kv(i, 1);
        db.put(&k, &v).unwrap();
        m.insert(k, v);
    }
    let got: Vec<_> = db.scan(b"k".as_slice()..).unwrap().take(30).map(|r| r.unwrap()).collect();
    assert_eq!(got.len(), 30);
    assert!(got.iter().all(|(k, v)| m.get(k) == Some(v)));
    assert_eq!(stat(&db, "candidates_seq_degree"), 0, "no file was read for these 30 keys");
    assert_matches(&db, &m, "after the scan");
}
