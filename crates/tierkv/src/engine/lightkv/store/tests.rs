#![allow(clippy::unwrap_used)]
use std::collections::BTreeMap;

use super::*;
use crate::fs::FaultFs;
use crate::pm::sim::SimDevice;
use crate::pm::{Backing, RegionConfig};

fn region(dev: &SimDevice, create: bool) -> Arc<Region> {
    Arc::new(Region::open(RegionConfig { create, ..RegionConfig::new(Backing::Sim(dev.clone()), 1 << 20, 5) }).unwrap())
}

/// Small leaves that split often, and room for every partition the workloads need (no
/// linked leaves, so no flush).
fn small() -> RhOptions {
    RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 4096 }
}

/// Small leaves and few partitions: full leaves are linked and flushed to SSTables.
fn flushing() -> RhOptions {
    RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 6 }
}

fn open(dev: &SimDevice, fs: &FaultFs, create: bool, o: RhOptions) -> Result<PwbStore> {
    PwbStore::open(region(dev, create), Arc::new(fs.clone()), Path::new("/t"), create, StoreConfig::inline(8192, o, 4))
}

type Model = BTreeMap<Vec<u8>, Vec<u8>>;

fn step(s: &PwbStore, m: &mut Model, i: u32) -> Result<()> {
    let k = format!("key{:03}", (i * 37) % 150).into_bytes();
    if i % 11 == 5 {
        // A batch over keys of different partitions: all or nothing after a crash.
        let k2 = format!("key{:03}", (i * 53 + 7) % 150).into_bytes();
        let k3 = format!("~zz{}", i % 40).into_bytes();
        let v = vec![(i % 7) as u8; 30];
        s.write_batch(&[(Kind::Put, &k, &v), (Kind::Delete, &k2, b""), (Kind::Put, &k3, &v)], Cond::None)?;
        m.insert(k.clone(), v.clone());
        m.remove(&k2);
        m.insert(k3, v);
        return Ok(());
    }
    if i % 7 == 3 {
        s.write(Kind::Delete, &k, b"")?;
        m.remove(&k);
    } else {
        let v = vec![(i % 251) as u8; 40 + (i as usize % 200)];
        s.write(Kind::Put, &k, &v)?;
        m.insert(k, v);
    }
    Ok(())
}

#[test]
fn superblock_golden_bytes() {
    let hex: String = encode_superblock(4 << 20).iter().map(|x| format!("{x:02x}")).collect();
    assert_eq!(hex, format!("544b564c4947485401000000000040000000000000{}9a5f7d58", "00".repeat(39)));
    assert_eq!(decode_superblock(&encode_superblock(4 << 20)), Ok(4 << 20));
    let mut bad = encode_superblock(4 << 20);
    bad[13] ^= 1;
    assert!(decode_superblock(&bad).unwrap_err().contains("checksum"));
}

#[test]
fn writes_read_back_and_survive_reopen_with_segments_recycled() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let s = open(&dev, &fs, true, small()).unwrap();
    let mut m = Model::new();
    for i in 0..3000 {
        step(&s, &mut m, i).unwrap();
    }
    assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
    let st = s.stats();
    assert!(st.segments_freed > 10, "overwrites free whole segments: {st:?}");
    drop(s);
    let s = open(&dev, &fs, false, small()).unwrap();
    assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
    assert!(s.stats().recovered_records > 0);
}

#[test]
fn full_leaves_are_flushed_to_tables_and_recovery_skips_what_they_cover() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let s = open(&dev, &fs, true, flushing()).unwrap();
    let mut m = Model::new();
    for i in 0..3000 {
        step(&s, &mut m, i).unwrap();
    }
    let st = s.stats();
    assert!(st.flushes > 20, "{st:?}");
    assert!(st.segments_freed > 10, "flushed records release their segments: {st:?}");
    let tables = fs.list(Path::new("/t")).unwrap().iter().filter(|n| n.ends_with(".sst")).count();
    let named: usize = s.state.read().chains.values().map(|c| c.leaves.len()).sum();
    assert_eq!(tables, named, "every table is named by a PM leaf, and only those remain");
    assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
    drop(s);
    let s = open(&dev, &fs, false, flushing()).unwrap();
    let st = s.stats();
    assert!(st.recovered_skipped > 0 || st.recovered_records == 0, "{st:?}");
    assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
    // More writes after recovery flush into the restored chains.
    for i in 3000..4000 {
        step(&s, &mut m, i).unwrap();
    }
    assert!(s.stats().flushes > 0);
    assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
}

#[test]
fn partition_compaction_merges_runs_of_equal_weight_and_bounds_write_amplification() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let s = open(&dev, &fs, true, flushing()).unwrap();
    let mut m = Model::new();
    for i in 0..6000 {
        step(&s, &mut m, i).unwrap();
    }
    let st = s.stats();
    assert!(st.compactions > 5, "{st:?}");
    assert!(st.compaction_dropped > 0, "superseded versions are dropped: {st:?}");
    // Every chain is a base-CS counter: weights ascend, fewer than CS leaves per weight.
    {
        let g = s.state.read();
        for c in g.chains.values() {
            let w: Vec<u32> = c.leaves.iter().map(|l| l.meta.cw).collect();
            assert!(w.windows(2).all(|x| x[0] <= x[1]), "weights ascend: {w:?}");
            for x in 0..=w.iter().copied().max().unwrap_or(0) {
                assert!(w.iter().filter(|&&y| y == x).count() < 4, "a full run was left unmerged: {w:?}");
            }
        }
    }
    // Only the tables the chains name are left.
    let tables = fs.list(Path::new("/t")).unwrap().iter().filter(|n| n.ends_with(".sst")).count();
    let named: usize = s.state.read().chains.values().map(|c| c.leaves.len()).sum();
    assert_eq!(tables, named);
    let wa = (st.flush_bytes + st.compaction_bytes) as f64 / st.flush_bytes as f64;
    let per_partition = st.flushes as f64 / 6.0;
    let bound = per_partition.log(4.0) + 1.0;
    eprintln!(
        "table write amplification {wa:.2} (log_4(N) + 1 = {bound:.2}, N = {per_partition:.1} flushes per partition)"
    );
    assert!(wa <= bound + 0.5, "WA {wa:.2} above log_CS(N) + 1 = {bound:.2}");
    assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
    drop(s);
    let s = open(&dev, &fs, false, flushing()).unwrap();
    assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
}

#[test]
fn write_amplification_on_a_growing_load_follows_log_cs_n_plus_one() {
    // New keys only (nothing is superseded): every flushed byte is rewritten once per
    // compaction level it climbs, so WA = (flush + compaction bytes) / flush bytes is
    // close to log_CS(N) + 1 for N flushes per partition.
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let o = RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 2 };
    let s = PwbStore::open(
        region(&dev, true),
        Arc::new(fs.clone()),
        Path::new("/t"),
        true,
        StoreConfig::inline(8192, o, 4),
    )
    .unwrap();
    for i in 0..5000u32 {
        let k = format!("{:08x}", i.wrapping_mul(2_654_435_761));
        s.write(Kind::Put, k.as_bytes(), &[7u8; 60]).unwrap();
    }
    let st = s.stats();
    let n = st.flushes as f64 / s.state.read().tree.partition_count() as f64;
    let wa = (st.flush_bytes + st.compaction_bytes) as f64 / st.flush_bytes as f64;
    let bound = n.log(4.0) + 1.0;
    eprintln!(
        "growing load: {} flushes, {} compactions, N = {n:.1} per partition, WA {wa:.2}, log_4(N) + 1 = {bound:.2}",
        st.flushes, st.compactions
    );
    assert!(wa <= bound + 0.05 && wa >= bound - 1.0, "WA {wa:.2} vs log_4(N) + 1 = {bound:.2}");
}

#[test]
fn the_flush_crash_workload_compacts() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let s = open(&dev, &fs, true, flushing()).unwrap();
    let mut m = Model::new();
    for i in 0..700 {
        step(&s, &mut m, i).unwrap();
    }
    assert!(s.stats().compactions > 0, "{:?}", s.stats());
}

fn crash_points(o: RhOptions, steps: u32, stride: usize) -> usize {
    let mut points = 0;
    for n in (1..100_000u64).step_by(stride) {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let s = open(&dev, &fs, true, o).unwrap();
        let f2 = fs.clone();
        dev.on_freeze(move || f2.freeze());
        dev.crash_before_fence(dev.fences() + n);
        let mut m = Model::new();
        let mut pending = None;
        for i in 0..steps {
            let mut next = m.clone();
            if step(&s, &mut next, i).is_err() || dev.crashed() {
                pending = Some(next);
                break;
            }
            m = next;
        }
        if pending.is_none() && !dev.crashed() {
            break;
        }
        drop(s);
        points += 1;
        let dev2 = dev.simulate_crash(n, 0.5);
        let fs2 = fs.crash();
        let s = open(&dev2, &fs2, false, o).unwrap_or_else(|e| panic!("crash point {n}: reopen failed: {e}"));
        let got: Model = s.dump().unwrap().into_iter().collect();
        let ok = got == m || pending.as_ref().is_some_and(|p| &got == p);
        assert!(ok, "crash point {n}: state is not the acknowledged writes");
        // The recovered store keeps working.
        s.write(Kind::Put, b"after", b"crash").unwrap();
        assert_eq!(s.get(b"after").unwrap().as_deref(), Some(&b"crash"[..]));
    }
    points
}

#[test]
fn a_crash_at_every_persist_point_keeps_every_acknowledged_write() {
    let points = crash_points(small(), 1200, 5);
    assert!(points > 200, "{points}");
    eprintln!("write buffer only: {points} crash points");
}

#[test]
fn a_crash_at_every_persist_point_of_flushes_keeps_every_acknowledged_write() {
    let points = crash_points(flushing(), 700, 3);
    assert!(points > 200, "{points}");
    eprintln!("with flushes: {points} crash points");
}

/// Thread `t`'s key `i`: first bytes spread over the byte range, so that after a few
/// splits the threads write to different partitions (different lanes).
fn lane_key(t: usize, i: u32) -> Vec<u8> {
    let mut k = vec![(t * 67 + 11) as u8, b'k'];
    k.extend_from_slice(format!("{:02}", (i * 7) % 40).as_bytes());
    k
}

/// What each thread wrote: (key, value or `None` for a delete, acknowledged before the
/// crash point froze the device).
type History = Vec<(Vec<u8>, Option<Vec<u8>>, bool)>;

/// `threads` writers, each putting and deleting its own keys through its partitions'
/// lanes; returns each thread's history. A write counts as acknowledged before the crash
/// when the device was still running after it returned (its fence came first).
fn lane_writers(s: &Arc<PwbStore>, dev: &SimDevice, threads: usize, per_thread: u32) -> Vec<History> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let s = s.clone();
                let dev = dev.clone();
                sc.spawn(move || {
                    let mut h = History::new();
                    for i in 0..per_thread {
                        let k = lane_key(t, i);
                        let v = (i % 9 != 4).then(|| vec![(t as u8) ^ (i as u8); 20 + (i as usize * 13) % 90]);
                        let r = match &v {
                            Some(v) => s.write(Kind::Put, &k, v),
                            None => s.write(Kind::Delete, &k, b""),
                        };
                        let acked = r.is_ok() && !dev.crashed();
                        h.push((k, v, acked));
                        if r.is_err() {
                            break;
                        }
                    }
                    h
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The recovered state against the histories: every key holds the value of its last
/// acknowledged write, or of a write issued after it (one in flight at the crash); no key
/// that was never written appears.
fn holds_acknowledged(got: &Model, hist: &[History]) -> std::result::Result<(), String> {
    // Each key's writes in order: (value or delete, acknowledged).
    type Writes<'a> = Vec<(&'a Option<Vec<u8>>, bool)>;
    let mut per_key: HashMap<&[u8], Writes<'_>> = HashMap::new();
    for h in hist {
        for (k, v, acked) in h {
            per_key.entry(k.as_slice()).or_default().push((v, *acked));
        }
    }
    for k in got.keys() {
        if !per_key.contains_key(k.as_slice()) {
            return Err(format!("key {k:?} was never written"));
        }
    }
    for (k, writes) in &per_key {
        let last = writes.iter().rposition(|w| w.1);
        let now = got.get(*k);
        let mut allowed: Vec<Option<&Vec<u8>>> = match last {
            Some(j) => writes[j..].iter().map(|w| w.0.as_ref()).collect(),
            None => std::iter::once(None).chain(writes.iter().map(|w| w.0.as_ref())).collect(),
        };
        allowed.dedup();
        if !allowed.contains(&now) {
            return Err(format!("key {k:?}: recovered {now:?}, allowed {allowed:?}"));
        }
    }
    Ok(())
}

fn concurrent_crash_points(o: RhOptions, threads: usize, per_thread: u32, stride: usize) -> usize {
    let mut points = 0;
    for n in (1..100_000u64).step_by(stride) {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let s = Arc::new(open(&dev, &fs, true, o).unwrap());
        let f2 = fs.clone();
        dev.on_freeze(move || f2.freeze());
        dev.crash_before_fence(dev.fences() + n);
        let hist = lane_writers(&s, &dev, threads, per_thread);
        if !dev.crashed() {
            // Every write finished before fence n: the whole run was covered.
            let got: Model = s.dump().unwrap().into_iter().collect();
            holds_acknowledged(&got, &hist).unwrap();
            assert_eq!(s.check().unwrap(), Vec::<String>::new());
            break;
        }
        drop(s);
        points += 1;
        let s = open(&dev.simulate_crash(n, 0.5), &fs.crash(), false, o)
            .unwrap_or_else(|e| panic!("crash point {n}: reopen failed: {e}"));
        let got: Model = s.dump().unwrap().into_iter().collect();
        if let Err(e) = holds_acknowledged(&got, &hist) {
            panic!("crash point {n}: {e}");
        }
        assert_eq!(s.check().unwrap(), Vec::<String>::new(), "crash point {n}");
        s.write(Kind::Put, b"after", b"crash").unwrap();
        assert_eq!(s.get(b"after").unwrap().as_deref(), Some(&b"crash"[..]));
    }
    points
}

#[test]
fn concurrent_writers_in_their_lanes_read_back_and_recover() {
    for o in [small(), flushing()] {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let s = Arc::new(open(&dev, &fs, true, o).unwrap());
        let hist = lane_writers(&s, &dev, 4, 600);
        let mut m = Model::new();
        for h in &hist {
            for (k, v, _) in h {
                match v {
                    Some(v) => m.insert(k.clone(), v.clone()),
                    None => m.remove(k),
                };
            }
        }
        assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
        assert_eq!(s.check().unwrap(), Vec::<String>::new());
        let parts = s.state.read().tree.partition_count();
        assert!(parts >= 4, "the threads' keys spread over partitions: {parts}");
        drop(s);
        let s = open(&dev.simulate_crash(0, 0.0), &fs.crash(), false, o).unwrap();
        assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
    }
}

#[test]
fn a_crash_at_every_persist_point_of_concurrent_writers_keeps_every_acknowledged_write() {
    let points = concurrent_crash_points(small(), 4, 150, 4);
    assert!(points > 100, "{points}");
    eprintln!("concurrent writers: {points} crash points");
}

#[test]
fn a_crash_at_every_persist_point_of_concurrent_writers_with_flushes_keeps_every_acknowledged_write() {
    let points = concurrent_crash_points(flushing(), 4, 150, 3);
    assert!(points > 100, "{points}");
    eprintln!("concurrent writers with flushes: {points} crash points");
}

fn open_cfg(dev: &SimDevice, fs: &FaultFs, create: bool, cfg: StoreConfig) -> PwbStore {
    PwbStore::open(region(dev, create), Arc::new(fs.clone()), Path::new("/t"), create, cfg).unwrap()
}

#[test]
fn a_clean_close_image_restores_the_dram_part_without_a_scan() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let cfg = StoreConfig::inline(8192, flushing(), 4);
    let s = open_cfg(&dev, &fs, true, cfg.clone());
    let mut m = Model::new();
    for i in 0..2000 {
        step(&s, &mut m, i).unwrap();
    }
    s.write_image().unwrap();
    let parts = s.state.read().tree.partition_count();
    drop(s);
    // Clean restart: nothing scanned, same partitions, same contents.
    let s = open_cfg(&dev, &fs, false, cfg.clone());
    let st = s.stats();
    assert_eq!((st.restored_from_image, st.recovered_records), (1, 0), "{st:?}");
    assert_eq!(s.state.read().tree.partition_count(), parts);
    assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
    assert_eq!(s.check().unwrap(), Vec::<String>::new());
    // The image was retired at open: writes after it, then a crash, recover by scanning.
    for i in 2000..2600 {
        step(&s, &mut m, i).unwrap();
    }
    drop(s);
    let s = open_cfg(&dev.simulate_crash(0, 0.0), &fs.crash(), false, cfg.clone());
    let st = s.stats();
    assert_eq!(st.restored_from_image, 0, "{st:?}");
    assert!(st.recovered_records > 0, "{st:?}");
    assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
}

#[test]
fn a_damaged_image_is_rejected_and_the_write_buffer_scanned() {
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let cfg = StoreConfig::inline(8192, flushing(), 4);
    let s = open_cfg(&dev, &fs, true, cfg.clone());
    let mut m = Model::new();
    for i in 0..1500 {
        step(&s, &mut m, i).unwrap();
    }
    s.write_image().unwrap();
    let at = s.region.load_u64_atomic(IMAGE_PTR_ADDR).unwrap();
    // Damage a byte in the middle of the image (its crc then fails).
    let len = image_len(s.region.slice(at, IMAGE_HEADER).unwrap()).unwrap() as u64;
    let victim = at + len / 2;
    let byte = s.region.slice(victim, 1).unwrap()[0];
    // SAFETY: test-only damage of a persisted image nobody reads concurrently.
    unsafe { s.region.write(victim, &[byte ^ 0x40]).unwrap() };
    s.region.persist(victim, 1);
    drop(s);
    let s = open_cfg(&dev.simulate_crash(0, 0.0), &fs.crash(), false, cfg);
    let st = s.stats();
    assert_eq!((st.image_rejected, st.restored_from_image), (1, 0), "{st:?}");
    assert!(st.recovered_records > 0);
    assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
}

/// Keys with shared prefixes, short keys and several first bytes, so that partitions
/// level-split (value sets with holes) and chains link and compact.
fn scan_key(i: u32) -> Vec<u8> {
    match i % 5 {
        0 => format!("user{:05}", (i * 7919) % 3000).into_bytes(),
        1 => format!("u{}", (i * 31) % 40).into_bytes(),
        2 => vec![b'u', b's', b'e', b'r', (i % 256) as u8],
        3 => format!("zz{:04}", (i * 13) % 500).into_bytes(),
        _ => vec![(i % 256) as u8],
    }
}

#[test]
fn scans_merge_partitions_and_tables_in_key_order() {
    for placement in [LightkvPlacement::Hybrid, LightkvPlacement::Dram, LightkvPlacement::Pm] {
        let dev = SimDevice::new();
        let fs = FaultFs::new();
        let o = RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 24 };
        let cfg = StoreConfig { placement, ..StoreConfig::inline(8192, o, 4) };
        let s = Arc::new(open_cfg(&dev, &fs, true, cfg));
        let mut m = Model::new();
        for i in 0..6000u32 {
            let k = scan_key(i);
            if i % 9 == 4 {
                s.write(Kind::Delete, &k, b"").unwrap();
                m.remove(&k);
            } else {
                let v = format!("v{i}").into_bytes();
                s.write(Kind::Put, &k, &v).unwrap();
                m.insert(k, v);
            }
        }
        let st = s.stats();
        let splits = s.state.read().tree.splits();
        assert!(st.flushes > 10 && st.compactions > 0 && splits.level > 0, "{st:?} {splits:?}");
        let mut rng = 12345u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let all: Vec<Vec<u8>> = m.keys().cloned().collect();
        for round in 0..300 {
            let a = scan_key(next() as u32 % 6000);
            let b = scan_key(next() as u32 % 6000);
            let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
            let start = match round % 3 {
                0 => Bound::Included(lo.as_slice()),
                1 => Bound::Excluded(lo.as_slice()),
                _ => Bound::Unbounded,
            };
            let end = match round % 4 {
                0 => Bound::Excluded(hi.as_slice()),
                1 => Bound::Included(hi.as_slice()),
                _ => Bound::Unbounded,
            };
            let max = [1, 3, 16, 100, 5000][round % 5];
            let want: Vec<(Vec<u8>, Vec<u8>)> =
                m.range::<[u8], _>((start, end)).take(max).map(|(k, v)| (k.clone(), v.clone())).collect();
            let got =
                crate::iter::collect_range(&mut *crate::engine::lightkv::iter::open(&s).unwrap(), start, end, max)
                    .unwrap();
            assert_eq!(got, want, "{placement:?} round {round}: {start:?}..{end:?} max {max}");
        }
        let everything = crate::iter::collect_range(
            &mut *crate::engine::lightkv::iter::open(&s).unwrap(),
            Bound::Unbounded,
            Bound::Unbounded,
            usize::MAX,
        );
        assert_eq!(everything.unwrap().len(), all.len());
        // Every key is found by get, in DRAM or PM leaves alike.
        for (k, v) in &m {
            assert_eq!(s.get(k).unwrap().as_ref(), Some(v));
        }
        let probes = s.stats().pm_leaf_probes;
        assert!(probes > 0, "gets reached PM leaves");
        assert_eq!(s.live_keys().unwrap(), m.len() as u64);
        assert_eq!(s.check().unwrap(), Vec::<String>::new(), "{placement:?}");
    }
}
