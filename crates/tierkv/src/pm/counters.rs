//! Exact traffic counters without a locked read-modify-write on the persist path.
//!
//! Each live thread owns one of [`SHARDS`] slots (process-wide, recycled when the thread
//! exits). A counter has one cache-line-padded shard per slot; the owning thread updates
//! its shard with a plain relaxed load and store, which is exact because no other thread
//! writes it, and costs no `lock`-prefixed instruction. Threads beyond [`SHARDS`] share a
//! last shard updated with `fetch_add`. Reading sums the shards.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

/// Threads with an exclusive shard.
pub const SHARDS: usize = 64;
const SHARED: usize = SHARDS;

static FREE: Mutex<Vec<usize>> = Mutex::new(Vec::new());
static NEXT: AtomicUsize = AtomicUsize::new(0);

struct Slot(usize);

impl Slot {
    fn acquire() -> Slot {
        if let Some(s) = FREE.lock().pop() {
            return Slot(s);
        }
        let s = NEXT.fetch_add(1, Ordering::Relaxed);
        Slot(if s < SHARDS { s } else { SHARED })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.0 < SHARDS {
            // The mutex orders this thread's last counter stores before the next owner's.
            FREE.lock().push(self.0);
        }
    }
}

thread_local! {
    static SLOT: Slot = Slot::acquire();
}

#[inline]
fn slot() -> usize {
    SLOT.try_with(|s| s.0).unwrap_or(SHARED)
}

#[derive(Default)]
#[repr(align(64))]
struct Shard {
    v: [AtomicU64; COUNTERS],
}

/// Counters per region.
pub const COUNTERS: usize = 4;

/// [`COUNTERS`] counters (index 0..COUNTERS), sharded per thread.
pub struct Counters {
    shards: Box<[Shard]>,
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries((0..COUNTERS).map(|i| self.get(i))).finish()
    }
}

impl Default for Counters {
    fn default() -> Self {
        Counters { shards: (0..=SHARDS).map(|_| Shard::default()).collect() }
    }
}

impl Counters {
    /// Add `n` to counter `i` (0..COUNTERS).
    #[inline]
    pub fn add(&self, i: usize, n: u64) {
        let s = slot();
        let Some(c) = self.shards.get(s).and_then(|sh| sh.v.get(i)) else { return };
        if s == SHARED {
            c.fetch_add(n, Ordering::Relaxed);
        } else {
            c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
        }
    }

    /// Current value of counter `i`.
    pub fn get(&self, i: usize) -> u64 {
        self.shards.iter().filter_map(|sh| sh.v.get(i)).map(|c| c.load(Ordering::Relaxed)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn exact_under_many_threads_including_more_than_the_shards() {
        let c = Arc::new(Counters::default());
        let threads: Vec<_> = (0..SHARDS + 16)
            .map(|_| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        c.add(0, 1);
                        c.add(2, 3);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(c.get(0), (SHARDS as u64 + 16) * 1000);
        assert_eq!(c.get(1), 0);
        assert_eq!(c.get(2), (SHARDS as u64 + 16) * 3000);
    }
}
