//! `Db::get` against the preset's own lookup (`tierkv::testing::engine_get`), for every
//! preset, on the same store and the same random keys (all present, 100-byte values): the
//! difference is what the `Db` layer adds per read (the key-limit check, the closed-handle
//! flag), and `Db::get_into` (the value copied into a reused buffer: no allocation on
//! presets that lend values in place). Stores live in a temporary directory, PM pools on /dev/shm when present.
#![allow(clippy::unwrap_used, reason = "benchmark setup: a failure should abort the run")]

use criterion::{criterion_group, criterion_main, Criterion};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tierkv::{Db, Options, Preset};

const N: u64 = 50_000;

/// db_bench's key: `i` in 16 decimal digits (no allocation, so the loop measures the get).
fn key(mut i: u64) -> [u8; 16] {
    let mut k = [b'0'; 16];
    for d in k.iter_mut().rev() {
        *d = b'0' + (i % 10) as u8;
        i /= 10;
    }
    k
}

fn bench(c: &mut Criterion) {
    let shm = std::path::Path::new("/dev/shm");
    for preset in Preset::ALL {
        let disk = tempfile::tempdir().unwrap();
        let pm = if shm.is_dir() { tempfile::tempdir_in(shm).unwrap() } else { tempfile::tempdir().unwrap() };
        let db = Db::open(disk.path().join("db"), Options::new().preset(*preset).pm_path(pm.path())).unwrap();
        for i in 0..N {
            db.put(key(i), [i as u8; 100]).unwrap();
        }
        let mut g = c.benchmark_group(format!("get-{}", preset.name()));
        g.sample_size(20);
        let mut rng = SmallRng::seed_from_u64(11);
        g.bench_function("Db::get", |b| {
            b.iter(|| {
                let v = db.get(key(rng.random_range(0..N))).unwrap();
                assert!(v.is_some());
                v
            })
        });
        let mut rng = SmallRng::seed_from_u64(11);
        let mut buf = Vec::with_capacity(128);
        g.bench_function("Db::get_into", |b| {
            b.iter(|| {
                assert!(db.get_into(key(rng.random_range(0..N)), &mut buf).unwrap());
                buf.len()
            })
        });
        let mut rng = SmallRng::seed_from_u64(11);
        g.bench_function("preset lookup", |b| {
            b.iter(|| {
                let v = tierkv::testing::engine_get(&db, &key(rng.random_range(0..N))).unwrap();
                assert!(v.is_some());
                v
            })
        });
        g.finish();
        db.close().unwrap();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
