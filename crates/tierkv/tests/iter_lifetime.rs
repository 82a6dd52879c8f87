//! An iterator or snapshot that outlives its `Db` handle keeps the store locked: the store
//! cannot be reopened — and its PM reused by the new handle's recovery — while they may
//! still borrow from it. (Found in review: a reopened hpdk/pmekv store overwrote value
//! records an old iterator still read.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use tierkv::{Db, Error, Options, Preset};

fn open(dir: &std::path::Path, pm: &std::path::Path, p: Preset) -> tierkv::Result<Db> {
    Db::open(dir.join("db"), Options::new().preset(p).pm_path(pm))
}

#[test]
fn an_iterator_or_snapshot_alive_keeps_the_store_from_being_reopened() {
    for &p in Preset::ALL {
        let (d, pm) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let db = open(d.path(), pm.path(), p).unwrap();
        for i in 0..200u32 {
            db.put(format!("k{i:05}"), vec![i as u8; 100]).unwrap();
        }
        let mut it = db.iter().unwrap();
        it.seek_to_first();
        assert_eq!(it.next().unwrap().unwrap().0, b"k00000");
        let snap = db.snapshot().unwrap();
        drop(db);
        assert!(matches!(open(d.path(), pm.path(), p), Err(Error::Locked(_))), "{p}: reopened under a live iterator");
        // The old iterator still reads what it pinned.
        let (k, v) = it.next().unwrap().unwrap();
        assert_eq!((k.as_slice(), v.len()), (&b"k00001"[..], 100), "{p}");
        drop(it);
        assert!(matches!(open(d.path(), pm.path(), p), Err(Error::Locked(_))), "{p}: reopened under a live snapshot");
        assert_eq!(snap.get("k00007").unwrap(), Some(vec![7u8; 100]), "{p}");
        drop(snap);
        let db = open(d.path(), pm.path(), p).unwrap();
        assert_eq!(db.get("k00199").unwrap(), Some(vec![199u8; 100]), "{p}");
        db.close().unwrap();
    }
}
