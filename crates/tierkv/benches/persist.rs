#![allow(clippy::unwrap_used, reason = "benchmark setup: a failure should abort the run")]
//! Production-mode cost of the PM layer: `Region::persist` against a bare loop of the same
//! flush instruction + SFENCE on the same mapping. The crash simulator must cost nothing
//! here: the ratio of the two should be ~1.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tierkv::pm::flush::{flush_line, sfence, FlushInstr};
use tierkv::pm::{Backing, Region, RegionConfig};

fn bench(c: &mut Criterion) {
    let base = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" };
    let dir = tempfile::Builder::new().prefix("tierkv-persist-bench").tempdir_in(base).unwrap();
    let region = Region::open(RegionConfig::new(Backing::Dir(dir.path().to_path_buf()), 64 << 20, 1)).unwrap();
    let instr = FlushInstr::detect();
    let area: u64 = 32 << 20;
    let start: u64 = 4096;
    let mut g = c.benchmark_group(format!("persist-{}", instr.name()));
    for size in [64u64, 256, 4096] {
        g.throughput(Throughput::Bytes(size));
        let data = vec![0xa5u8; size as usize];
        g.bench_with_input(BenchmarkId::new("region", size), &size, |b, &size| {
            let mut off = 0;
            b.iter(|| {
                let addr = start + off;
                // SAFETY: single-threaded benchmark owning the whole region.
                unsafe { region.write(addr, &data).unwrap() };
                region.persist(addr, size);
                off = (off + size) % area;
            })
        });
        let base_ptr = region.slice(start, area as usize).unwrap().as_ptr() as *mut u8;
        g.bench_with_input(BenchmarkId::new("bare", size), &size, |b, &size| {
            let mut off = 0;
            b.iter(|| {
                // SAFETY: `off + size <= area`, inside the mapping; single-threaded.
                unsafe {
                    let p = base_ptr.add(off as usize);
                    std::ptr::copy_nonoverlapping(data.as_ptr(), p, size as usize);
                    let mut l = 0;
                    while l < size {
                        flush_line(instr, p.add(l as usize));
                        l += 64;
                    }
                }
                sfence();
                off = (off + size) % area;
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
