//! The shared DRAM B+-tree: insert and point lookup of 16-byte keys (db_bench format, whose
//! first 8 bytes are mostly equal: the worst case for the inline prefixes) and of 16-byte
//! random keys, 64 entries per node.
#![allow(clippy::unwrap_used, reason = "benchmark setup: a failure should abort the run")]

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tierkv::index::bplus::BPlusTree;

const N: usize = 200_000;

fn keys(kind: &str) -> Vec<Vec<u8>> {
    let mut rng = SmallRng::seed_from_u64(7);
    let mut v: Vec<Vec<u8>> = match kind {
        "dbbench" => (0..N).map(|i| format!("{i:016}").into_bytes()).collect(),
        _ => (0..N).map(|_| rng.random::<[u8; 16]>().to_vec()).collect(),
    };
    v.shuffle(&mut rng);
    v
}

fn bench(c: &mut Criterion) {
    for kind in ["dbbench", "random"] {
        let ks = keys(kind);
        let mut g = c.benchmark_group(format!("bplus-{kind}"));
        g.sample_size(10);
        g.bench_function(format!("insert {N}"), |b| {
            b.iter_batched(
                || BPlusTree::<u64>::new(64),
                |mut t| {
                    for (i, k) in ks.iter().enumerate() {
                        t.insert(k, i as u64);
                    }
                    t
                },
                BatchSize::LargeInput,
            )
        });
        let mut t = BPlusTree::<u64>::new(64);
        for (i, k) in ks.iter().enumerate() {
            t.insert(k, i as u64);
        }
        let mut order = ks.clone();
        order.shuffle(&mut SmallRng::seed_from_u64(8));
        g.bench_function(format!("get {N}"), |b| b.iter(|| order.iter().filter(|k| t.get(k).is_some()).count()));
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
