//! Group commit: writers queued while one holds the state lock commit as one unit, each
//! batch keeps its condition and its atomicity, and a crash at any PM event of a group
//! leaves every batch whole or absent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::batch::BatchOp;
use crate::engine::pmekv::Pmekv;
use crate::engine::{Cond, Engine};
use crate::fs::FaultFs;
use crate::options::{Options, Preset};
use crate::pm::sim::{CrashModel, SimDevice};

fn open(o: &Options, fs: &FaultFs, fresh: bool) -> Pmekv {
    Pmekv::open(crate::engine::test_ctx(o, fs, fresh, 9)).unwrap()
}

fn design(e: &Pmekv, name: &str) -> u64 {
    e.stats().design.get(name).copied().unwrap_or_else(|| panic!("no design figure {name}"))
}

/// Writer `j`'s batch: three puts of its own keys (and, for odd `j`, a delete of a key
/// writer 0 puts).
fn batch(j: usize) -> Vec<BatchOp> {
    let mut b: Vec<BatchOp> = (0..3)
        .map(|i| BatchOp::Put {
            key: format!("b{j}-{i}").into_bytes(),
            value: format!("v{j}-{i}").repeat(20).into_bytes(),
        })
        .collect();
    if j % 2 == 1 {
        b.push(BatchOp::Delete { key: b"b0-0".to_vec() });
    }
    b
}

/// Hold the state lock while `writers` batches and two `insert_if_absent`s of one key
/// queue up, then let them go. Returns which of the two conditional inserts won.
fn queued_group(e: &Arc<Pmekv>, writers: usize) -> Vec<bool> {
    let hold = e.inner.state.read();
    let mut handles = Vec::new();
    for j in 0..writers {
        let e = e.clone();
        handles.push(std::thread::spawn(move || e.write(&batch(j), Cond::None).map(|_| None)));
    }
    for t in 0..2u8 {
        let e = e.clone();
        handles.push(std::thread::spawn(move || {
            let op = BatchOp::Put { key: b"dup".to_vec(), value: vec![b'a' + t; 40] };
            e.write(&[op], Cond::Absent).map(Some)
        }));
    }
    // Wait (not a timing assertion: a guard against a hang) until every writer is queued.
    let deadline = Instant::now() + Duration::from_secs(60);
    while e.inner.commits.len() < writers + 2 {
        assert!(Instant::now() < deadline, "writers did not queue");
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(hold);
    handles.into_iter().filter_map(|h| h.join().unwrap().unwrap()).collect()
}

#[test]
fn queued_writers_commit_as_one_group_and_keep_their_conditions() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let o = crate::testing::sim_options(Preset::Pmekv, &dev, &fs);
    let e = Arc::new(open(&o, &fs, true));
    let won = queued_group(&e, 5);
    assert_eq!(won.iter().filter(|&&w| w).count(), 1, "exactly one insert_if_absent wins: {won:?}");
    // The first writer in line leads and takes whoever is queued when it looks (usually
    // itself alone); the next leader takes the rest at once. Six batches commit (the losing
    // insert_if_absent logs nothing) in at most two groups.
    assert!((1..=2).contains(&design(&e, "group_commits")), "{}", design(&e, "group_commits"));
    assert_eq!(design(&e, "group_committed_batches"), 6);
    let check = |e: &Pmekv| {
        for j in 0..5 {
            for i in 0..3 {
                let k = format!("b{j}-{i}").into_bytes();
                let want = format!("v{j}-{i}").repeat(20).into_bytes();
                let got = e.get(&k).unwrap();
                // b0-0 is deleted by writers 1 and 3 unless writer 0 came after both.
                if k == b"b0-0" {
                    assert!(got.is_none() || got == Some(want));
                } else {
                    assert_eq!(got, Some(want), "{}", String::from_utf8_lossy(&k));
                }
            }
        }
        assert!(e.get(b"dup").unwrap().is_some());
    };
    check(&e);
    let before: Vec<_> = [b"b0-0".as_slice(), b"dup"].iter().map(|k| e.get(k).unwrap()).collect();
    // Every acknowledged write survives a crash.
    let e = Arc::try_unwrap(e).ok().unwrap();
    drop(e);
    let dev2 = dev.simulate_crash(5, 0.5);
    let o2 = crate::testing::sim_options(Preset::Pmekv, &dev2, &fs);
    let e = open(&o2, &fs.crash(), false);
    check(&e);
    let after: Vec<_> = [b"b0-0".as_slice(), b"dup"].iter().map(|k| e.get(k).unwrap()).collect();
    assert_eq!(before, after);
}

/// A crash at every PM event of a group commit (strict model: unflushed lines land or not,
/// stores torn): after recovery every batch of the group is whole or absent.
#[test]
fn a_crash_anywhere_in_a_group_leaves_every_batch_whole_or_absent() {
    let writers = 4;
    // The events of one run, to know the range to crash in.
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let o = crate::testing::sim_options(Preset::Pmekv, &dev, &fs);
    let e = Arc::new(open(&o, &fs, true));
    let start = dev.events();
    queued_group(&e, writers);
    let span = dev.events() - start;
    drop(e);
    assert!(span > 20, "{span} events");
    let mut crashed = 0;
    for n in (1..=span).step_by(3) {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let o = crate::testing::sim_options(Preset::Pmekv, &dev, &fs);
        let e = Arc::new(open(&o, &fs, true));
        dev.crash_before_event(dev.events() + n);
        queued_group(&e, writers);
        crashed += u64::from(dev.crashed());
        drop(e);
        let after = dev.simulate_crash_with(n, CrashModel::strict(0.5));
        let o2 = crate::testing::sim_options(Preset::Pmekv, &after, &fs);
        let e = open(&o2, &fs.crash(), false);
        for j in 0..writers {
            // b{j}-1 and b{j}-2 are written only by batch j: both or neither.
            let got: Vec<bool> = (1..3).map(|i| e.get(format!("b{j}-{i}").as_bytes()).unwrap().is_some()).collect();
            assert!(got[0] == got[1], "crash at event {n}: batch {j} is torn: {got:?}");
        }
        assert!(e.check().unwrap().is_empty(), "crash at event {n}");
    }
    assert!(crashed > 0, "no crash point was reached");
}

/// Logging that fails before the commit fence undoes the group's tree changes (an
/// overwrite, a delete and an insert, applied as they were classified): every key reads as
/// before, the group's values are back in the heap, and the store writes on and recovers.
#[test]
fn a_group_failing_before_its_fence_leaves_the_tree_as_it_was() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let o = crate::testing::sim_options(Preset::Pmekv, &dev, &fs);
    let e = open(&o, &fs, true);
    let put = |k: &str, v: &str| BatchOp::Put { key: k.as_bytes().to_vec(), value: v.repeat(30).into_bytes() };
    assert!(e.write(&[put("a", "1"), put("b", "2"), put("c", "3")], Cond::None).unwrap());
    let before: Vec<_> = ["a", "b", "c", "d"].iter().map(|k| e.get(k.as_bytes()).unwrap()).collect();
    let free_before = design(&e, "heap_free_bytes");
    e.inner.fail_next_log.store(true, std::sync::atomic::Ordering::Relaxed);
    let batch = [put("a", "10"), BatchOp::Delete { key: b"b".to_vec() }, put("d", "4"), put("a", "11")];
    assert!(e.write(&batch, Cond::None).is_err());
    let after: Vec<_> = ["a", "b", "c", "d"].iter().map(|k| e.get(k.as_bytes()).unwrap()).collect();
    assert_eq!(before, after, "a failed group changed the tree");
    // The group's values came from the writer's arena (its chunk taken by the first
    // write): freed, they are heap space again.
    let values: u64 = [60, 30, 60].iter().map(|&n| super::layout::value_alloc_size(n)).sum();
    assert_eq!(design(&e, "heap_free_bytes"), free_before + values, "the failed group's values were not freed");
    assert!(e.check().unwrap().is_empty(), "{:?}", e.check().unwrap());
    assert!(e.write(&[put("e", "5")], Cond::None).unwrap());
    drop(e);
    let dev2 = dev.simulate_crash(3, 0.5);
    let o2 = crate::testing::sim_options(Preset::Pmekv, &dev2, &fs);
    let e = open(&o2, &fs.crash(), false);
    let reopened: Vec<_> = ["a", "b", "c", "d"].iter().map(|k| e.get(k.as_bytes()).unwrap()).collect();
    assert_eq!(before, reopened);
    assert_eq!(e.get(b"e").unwrap(), Some("5".repeat(30).into_bytes()));
    assert!(e.check().unwrap().is_empty());
}

/// Writers allocating from their arenas and committing in groups, through inline
/// checkpoints: every acknowledged write reads back, no value overlaps another or lies in
/// free heap space (`check`), and after a crash recovery keeps every acknowledged write.
#[test]
fn concurrent_writers_with_arenas_keep_every_acknowledged_write_across_a_crash() {
    let (dev, fs) = (SimDevice::new(), FaultFs::new());
    let o = crate::testing::sim_options(Preset::Pmekv, &dev, &fs);
    let e = Arc::new(open(&o, &fs, true));
    let threads = 4;
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let e = e.clone();
            std::thread::spawn(move || {
                let mut model = std::collections::BTreeMap::new();
                for i in 0..600u32 {
                    let k = format!("t{t}-{:03}", i % 97).into_bytes();
                    if i % 11 == 5 {
                        assert!(e.write(&[BatchOp::Delete { key: k.clone() }], Cond::None).unwrap());
                        model.remove(&k);
                    } else {
                        let v = vec![b'a' + (i % 26) as u8; 100 + (i as usize * 37) % 900];
                        assert!(e.write(&[BatchOp::Put { key: k.clone(), value: v.clone() }], Cond::None).unwrap());
                        model.insert(k, v);
                    }
                }
                model
            })
        })
        .collect();
    let mut model = std::collections::BTreeMap::new();
    for h in handles {
        model.extend(h.join().unwrap());
    }
    assert!(design(&e, "checkpoints") > 0, "no checkpoint ran among the writers");
    let dump = |e: &Pmekv| {
        let mut it = e.iter().unwrap();
        let mut all = std::collections::BTreeMap::new();
        it.seek_to_first().unwrap();
        while it.valid() {
            all.insert(it.key().to_vec(), it.value().unwrap().to_vec());
            it.next().unwrap();
        }
        all
    };
    assert_eq!(dump(&e), model);
    assert!(e.check().unwrap().is_empty(), "{:?}", e.check().unwrap());
    let e = Arc::try_unwrap(e).ok().unwrap();
    drop(e);
    let dev2 = dev.simulate_crash(11, 0.5);
    let o2 = crate::testing::sim_options(Preset::Pmekv, &dev2, &fs);
    let e = open(&o2, &fs.crash(), false);
    assert_eq!(dump(&e), model, "after a crash");
    assert!(e.check().unwrap().is_empty());
}
