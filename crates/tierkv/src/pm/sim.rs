//! The PM crash simulator ("tracked mode").
//!
//! A [`SimDevice`] stands in for a PM device. A [`super::Region`] opened on it stores into a
//! *volatile image* (the CPU caches plus PM, as software sees it), while a separate *durable
//! image* receives a 64-byte line only when the region writes it back and fences
//! (`flush` records the line as pending; `fence` makes pending lines durable).
//!
//! [`SimDevice::simulate_crash`] returns the device a power failure would leave: the durable
//! image, plus a random fraction of the lines that differ from the volatile image (caches
//! evict dirty lines at will, and a flushed-but-unfenced line may or may not have landed).
//! Because dirty lines are found by comparing images, stores pay nothing for tracking; only
//! `flush`/`fence` differ from production mode.
//!
//! Crash points: every fence is numbered from 1. [`SimDevice::crash_before_fence`] arms the
//! device to freeze at fence `n`: the durable image stops changing and the volatile image is
//! captured *before* that fence takes effect, so a test can run a workload, stop it when
//! [`SimDevice::crashed`] turns true, and reopen from `simulate_crash`.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::flush::LINE;

/// One pool of the simulated device.
struct SimPool {
    /// Volatile image, allocated raw so the region may write through a raw pointer while
    /// this struct is shared; only ever accessed through `ptr`.
    ptr: *mut u8,
    len: usize,
    durable: Vec<u8>,
}

// SAFETY: `ptr` owns a heap allocation that lives as long as the `SimPool`; the pointer
// itself may move between threads. Concurrent access to the bytes follows the region's
// contract (writers own the ranges they write).
unsafe impl Send for SimPool {}

impl SimPool {
    fn new(len: usize, init: Option<&[u8]>) -> SimPool {
        let layout = Self::layout(len);
        // SAFETY: `layout` has non-zero size (pools are at least one line).
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        let mut durable = vec![0u8; len];
        if let Some(init) = init {
            let n = init.len().min(len);
            // SAFETY: `ptr` is a fresh allocation of `len >= n` bytes, `init` holds `n`.
            unsafe { std::ptr::copy_nonoverlapping(init.as_ptr(), ptr, n) };
            durable[..n].copy_from_slice(&init[..n]);
        }
        SimPool { ptr, len, durable }
    }

    fn layout(len: usize) -> Layout {
        // 4096 alignment like a page-aligned mapping; len > 0 checked by callers.
        Layout::from_size_align(len.max(1), 4096).unwrap_or(Layout::new::<u8>())
    }

    fn volatile(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for SimPool {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { dealloc(self.ptr, Self::layout(self.len)) }
    }
}

struct Frozen {
    volatile: Vec<Vec<u8>>,
    durable: Vec<Vec<u8>>,
}

struct SimState {
    pools: Vec<SimPool>,
    /// Pending (flushed, not yet fenced) line ranges: (pool, first line, end line).
    pending: Vec<(usize, u64, u64)>,
    fences: u64,
    crash_at: Option<u64>,
    frozen: Option<Frozen>,
    on_freeze: Option<Box<dyn Fn() + Send>>,
    /// Most pools the device holds (a full PM medium); `None`: unbounded.
    max_pools: Option<usize>,
}

/// A simulated PM device for crash testing. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct SimDevice {
    state: Arc<Mutex<SimState>>,
}

impl fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.state.lock();
        f.debug_struct("SimDevice")
            .field("pools", &s.pools.len())
            .field("fences", &s.fences)
            .field("crash_at", &s.crash_at)
            .field("crashed", &s.frozen.is_some())
            .finish()
    }
}

impl Default for SimDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl SimDevice {
    /// An empty device (no pools yet; the region adds them).
    pub fn new() -> SimDevice {
        SimDevice {
            state: Arc::new(Mutex::new(SimState {
                pools: Vec::new(),
                pending: Vec::new(),
                fences: 0,
                crash_at: None,
                frozen: None,
                on_freeze: None,
                max_pools: None,
            })),
        }
    }

    /// Call `f` when the armed crash point is reached (e.g. to freeze a
    /// [`crate::fs::FaultFs`] at the same instant, so files and PM crash together).
    pub fn on_freeze(&self, f: impl Fn() + Send + 'static) {
        self.state.lock().on_freeze = Some(Box::new(f));
    }

    /// Freeze the device now, as a crash point reached elsewhere (a file sync) would: nothing
    /// persisted from now on becomes durable. Does not call the [`SimDevice::on_freeze`]
    /// hook.
    pub fn freeze(&self) {
        let mut s = self.state.lock();
        if s.frozen.is_none() {
            let volatile = s.pools.iter().map(|p| p.volatile().to_vec()).collect();
            let durable = s.pools.iter().map(|p| p.durable.clone()).collect();
            s.frozen = Some(Frozen { volatile, durable });
            s.pending.clear();
        }
    }

    /// Freeze the device just before fence number `n` (1-based) takes effect.
    pub fn crash_before_fence(&self, n: u64) {
        self.state.lock().crash_at = Some(n);
    }

    /// Make the device full at `n` pools: the region's next grow beyond them fails with
    /// [`crate::Error::PmFull`] (a full PM medium). Kept across [`SimDevice::simulate_crash`].
    pub fn limit_pools(&self, n: usize) {
        self.state.lock().max_pools = Some(n);
    }

    /// Fences executed so far (each one a crash point).
    pub fn fences(&self) -> u64 {
        self.state.lock().fences
    }

    /// True once the armed crash point has been reached.
    pub fn crashed(&self) -> bool {
        self.state.lock().frozen.is_some()
    }

    /// Number of pools.
    pub fn pool_count(&self) -> usize {
        self.state.lock().pools.len()
    }

    /// A copy of pool `i`'s durable image.
    pub fn durable_image(&self, i: usize) -> Option<Vec<u8>> {
        self.state.lock().pools.get(i).map(|p| p.durable.clone())
    }

    /// Overwrite bytes of pool `pool` in both images (corruption tests). A store may have the
    /// device open, but no thread may be using it during the call. Returns false if the range
    /// is outside the pool.
    pub fn poke(&self, pool: usize, off: usize, bytes: &[u8]) -> bool {
        let mut s = self.state.lock();
        let Some(p) = s.pools.get_mut(pool) else {
            return false;
        };
        let Some(end) = off.checked_add(bytes.len()).filter(|&e| e <= p.len) else {
            return false;
        };
        // SAFETY: `off..end` is inside the pool's allocation (checked above); no thread uses a
        // store on this device during the call (caller contract), so nothing else accesses
        // these bytes concurrently.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.ptr.add(off), bytes.len()) };
        p.durable[off..end].copy_from_slice(bytes);
        true
    }

    /// Cut pool `pool` to `len` bytes in both images (truncation tests). Use only while no
    /// store has the device open.
    pub fn truncate_pool(&self, pool: usize, len: usize) -> bool {
        let mut s = self.state.lock();
        let Some(p) = s.pools.get(pool) else {
            return false;
        };
        if len > p.len || len == 0 {
            return false;
        }
        let mut image = p.durable.clone();
        image.truncate(len);
        s.pools[pool] = SimPool::new(len, Some(&image));
        true
    }

    /// The device a power failure would leave now (or at the armed crash point, if it was
    /// reached): the durable image plus each differing ("dirty") line with probability
    /// `evict_fraction`, chosen by `seed`. The result is a fresh, unarmed device.
    pub fn simulate_crash(&self, seed: u64, evict_fraction: f64) -> SimDevice {
        let s = self.state.lock();
        let mut rng = SmallRng::seed_from_u64(seed);
        let (volatile, durable): (Vec<Vec<u8>>, Vec<Vec<u8>>) = match &s.frozen {
            Some(f) => (f.volatile.clone(), f.durable.clone()),
            None => (
                s.pools.iter().map(|p| p.volatile().to_vec()).collect(),
                s.pools.iter().map(|p| p.durable.clone()).collect(),
            ),
        };
        let mut pools = Vec::with_capacity(durable.len());
        for (mut image, vol) in durable.into_iter().zip(volatile) {
            let line = LINE as usize;
            let mut off = 0;
            while off < image.len() {
                let end = (off + line).min(image.len());
                if image[off..end] != vol[off..end] && rng.random_bool(evict_fraction.clamp(0.0, 1.0)) {
                    image[off..end].copy_from_slice(&vol[off..end]);
                }
                off = end;
            }
            pools.push(SimPool::new(image.len(), Some(&image)));
        }
        SimDevice {
            state: Arc::new(Mutex::new(SimState {
                pools,
                pending: Vec::new(),
                fences: 0,
                crash_at: None,
                frozen: None,
                on_freeze: None,
                max_pools: s.max_pools,
            })),
        }
    }

    // ---- used by the region ----

    /// Add a zeroed pool of `len` bytes; returns its index and volatile base pointer, or
    /// `None` when the device is full ([`SimDevice::limit_pools`]).
    pub(super) fn add_pool(&self, len: usize) -> Option<(usize, *mut u8)> {
        let mut s = self.state.lock();
        if s.max_pools.is_some_and(|m| s.pools.len() >= m) {
            return None;
        }
        let pool = SimPool::new(len, None);
        let ptr = pool.ptr;
        s.pools.push(pool);
        Some((s.pools.len() - 1, ptr))
    }

    /// Base pointer and length of pool `i`.
    pub(super) fn pool(&self, i: usize) -> Option<(*mut u8, usize)> {
        self.state.lock().pools.get(i).map(|p| (p.ptr, p.len))
    }

    /// Record lines `[off, off+len)` of pool `pool` as written back, not yet fenced.
    pub(super) fn flush(&self, pool: usize, off: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = off / LINE;
        let end = (off + len).div_ceil(LINE);
        self.state.lock().pending.push((pool, first, end));
    }

    /// A fence: a crash point, then pending lines become durable.
    pub(super) fn fence(&self) {
        let mut s = self.state.lock();
        if s.frozen.is_some() {
            s.pending.clear();
            return;
        }
        s.fences += 1;
        if s.crash_at == Some(s.fences) {
            let volatile = s.pools.iter().map(|p| p.volatile().to_vec()).collect();
            let durable = s.pools.iter().map(|p| p.durable.clone()).collect();
            s.frozen = Some(Frozen { volatile, durable });
            s.pending.clear();
            if let Some(f) = &s.on_freeze {
                f();
            }
            return;
        }
        let pending = std::mem::take(&mut s.pending);
        for (pool, first, end) in pending {
            let Some(p) = s.pools.get_mut(pool) else {
                continue;
            };
            let start = (first * LINE) as usize;
            let stop = ((end * LINE) as usize).min(p.len);
            if start >= stop {
                continue;
            }
            // SAFETY: `start..stop` is inside the pool allocation (clamped to `len`); the
            // bytes are read while the writer that flushed them is at its fence.
            let src = unsafe { std::slice::from_raw_parts(p.ptr.add(start), stop - start) };
            let src = src.to_vec();
            p.durable[start..stop].copy_from_slice(&src);
        }
    }
}
