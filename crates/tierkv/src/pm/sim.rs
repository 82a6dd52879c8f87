//! The PM crash simulator ("tracked mode"), with a strict persistence model.
//!
//! A [`SimDevice`] stands in for a PM device. A [`super::Region`] opened on it stores into a
//! *volatile image* (what software sees: the CPU caches over PM), while a separate *durable
//! image* stands for the media. The model is x86's persistency model with ADR and
//! CLWB/CLFLUSHOPT (Px86, Raad et al., POPL '20), which the PM crash-consistency checkers
//! use (Yat, Jaaru, Chipmunk; see docs/design/crash-testing.md):
//!
//! - **Flush captures, fence commits.** `flush` of a line records the line's content *at
//!   that moment* (the stores made to it so far) in the flushing thread's pending set; a
//!   store to the line after the flush is not covered by it. `fence` makes the calling
//!   thread's pending lines durable, and only those: an SFENCE orders the issuing core's
//!   write-backs, not another core's. When two flushed copies of one line reach the media,
//!   the one flushed later wins.
//! - **Any dirty line may be evicted at any moment.** At a crash, every line with stores
//!   that no fence made durable independently may or may not have reached the media.
//! - **Stores to one line persist in order; nothing larger than 8 bytes is atomic.** A line
//!   that reached the media holds its durable content plus a *prefix* of the stores made to
//!   it since (Px86: writes to the same cache line persist in program order), and the last
//!   store of that prefix may be *torn*: any subset of its aligned 8-byte words landed (a
//!   `memcpy` is a string of stores with no order among themselves). So an 8-byte aligned
//!   store is failure-atomic, a record of several words is not, and a design may rely on the
//!   order of its separate stores into one line (FAST & FAIR's shifts do).
//!
//! Crash points: every store ([`super::Region::write`], [`super::Region::store_u64_atomic`]),
//! flush and fence is an *event*, numbered from 1; fences are also numbered on their own.
//! [`SimDevice::crash_before_event`] / [`SimDevice::crash_before_fence`] arm the device to
//! freeze just before that event takes effect: the durable image stops changing and the
//! stores not yet durable are captured, so a test can run a workload (with background
//! threads), stop when [`SimDevice::crashed`] turns true, and reopen from
//! [`SimDevice::simulate_crash`] (a random crash state) or [`SimDevice::crash_states`]
//! (every crash state, for small cases).
//!
//! What the model does not cover: a line written back by a flush with a content older than
//! the flush (hardware cannot); stores that pass through non-temporal paths (tierkv issues
//! none); the media failing. To bound memory, a line with more than 64 stores not yet
//! durable has its two oldest merged into one (the state between them is then not
//! generated: fewer states, never a state that could not happen).
//!
//! # Thread safety
//! Every store of a simulated region goes through the device ([`SimDevice::store`],
//! [`SimDevice::store_u64`]) under the device lock, and the simulator reads the volatile image
//! only under that lock, so the simulator adds no data race to the region's contract
//! (writers own the bytes they write; readers of words that change use atomics). Tracked
//! mode serialises PM stores; production mode pays nothing.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::ThreadId;

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::flush::LINE;

const LINE_LEN: usize = LINE as usize;
const WORD: usize = 8;
/// Stores kept per line before the two oldest are merged.
const MAX_LOG: usize = 64;

/// One pool of the simulated device.
struct SimPool {
    /// Volatile image, allocated raw so the region may read through a raw pointer while this
    /// struct is shared; written only under the device lock.
    ptr: *mut u8,
    len: usize,
    durable: Vec<u8>,
}

// SAFETY: `ptr` owns a heap allocation that lives as long as the `SimPool`; the pointer
// itself may move between threads. Writes to the bytes happen only under the device lock
// (module docs), reads follow the region's contract.
unsafe impl Send for SimPool {}

impl SimPool {
    fn new(len: usize, init: Option<&[u8]>) -> SimPool {
        let layout = Self::layout(len);
        // SAFETY: `layout` has non-zero size (`len.max(1)`).
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
        // 4096 alignment like a page-aligned mapping.
        Layout::from_size_align(len.max(1), 4096).unwrap_or(Layout::new::<u8>())
    }
}

impl Drop for SimPool {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { dealloc(self.ptr, Self::layout(self.len)) }
    }
}

/// One store's bytes within one line (a store spanning lines has one per line).
#[derive(Clone)]
struct LineStore {
    /// Global store order.
    seq: u64,
    /// Bit `i`: byte `i` of the line is written.
    mask: u64,
    data: [u8; LINE_LEN],
    /// False for merged stores (they land together or not at all).
    tearable: bool,
}

impl LineStore {
    fn apply(&self, line: &mut [u8], words: u8) {
        for (i, b) in line.iter_mut().enumerate() {
            if self.mask & (1u64 << i) != 0 && words & (1u8 << (i / WORD)) != 0 {
                *b = self.data[i];
            }
        }
    }
}

/// The stores made to one line that the durable image does not hold yet, oldest first.
type Log = Vec<LineStore>;

/// Line `line` of a pool image.
fn line_of(image: &mut [u8], line: usize) -> Option<&mut [u8]> {
    image.get_mut(line * LINE_LEN..(line + 1) * LINE_LEN)
}

/// Apply the first `n` stores of `log` whole onto `dst` (a line).
fn apply_prefix(log: &[LineStore], n: usize, dst: &mut [u8]) {
    for st in log.iter().take(n) {
        st.apply(dst, u8::MAX);
    }
}

/// A line written back by `flush`, not yet made durable by its thread's fence.
#[derive(Clone, Copy)]
struct Flushed {
    pool: usize,
    line: usize,
    /// The flush covers the line's stores up to this sequence number.
    upto: u64,
}

/// The durable side of a device, and what may still land: the state a crash leaves.
#[derive(Clone)]
struct Media {
    durable: Vec<Vec<u8>>,
    logs: HashMap<(usize, usize), Log>,
}

/// Where an armed device freezes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Armed {
    Fence(u64),
    Event(u64),
    Background(u64),
}

/// True in tierkv's background threads (named `tierkv-*`).
fn in_background() -> bool {
    std::thread::current().name().is_some_and(|n| n.starts_with("tierkv-"))
}

struct SimState {
    pools: Vec<SimPool>,
    /// Per line, the stores not yet durable.
    logs: HashMap<(usize, usize), Log>,
    /// Each thread's flushed, unfenced lines.
    pending: HashMap<ThreadId, Vec<Flushed>>,
    store_seq: u64,
    fences: u64,
    events: u64,
    /// Events in background threads.
    bg_events: u64,
    armed: Option<Armed>,
    frozen: Option<Media>,
    on_freeze: Option<Box<dyn Fn() + Send>>,
    /// Most pools the device holds (a full PM medium); `None`: unbounded.
    max_pools: Option<usize>,
}

impl SimState {
    fn new(pools: Vec<SimPool>, max_pools: Option<usize>) -> SimState {
        SimState {
            pools,
            logs: HashMap::new(),
            pending: HashMap::new(),
            store_seq: 0,
            fences: 0,
            events: 0,
            bg_events: 0,
            armed: None,
            frozen: None,
            on_freeze: None,
            max_pools,
        }
    }

    fn media(&self) -> Media {
        Media { durable: self.pools.iter().map(|p| p.durable.clone()).collect(), logs: self.logs.clone() }
    }

    fn capture(&mut self) {
        if self.frozen.is_none() {
            self.frozen = Some(self.media());
        }
    }

    /// Count an event (a store, flush or fence); freeze when it is the armed one. Returns
    /// true when the device is frozen (the event must not reach the durable image).
    fn event(&mut self, is_fence: bool) -> bool {
        if self.frozen.is_some() {
            return true;
        }
        self.events += 1;
        if is_fence {
            self.fences += 1;
        }
        let bg = in_background();
        if bg {
            self.bg_events += 1;
        }
        let hit = match self.armed {
            Some(Armed::Event(n)) => self.events == n,
            Some(Armed::Fence(n)) => is_fence && self.fences == n,
            Some(Armed::Background(n)) => bg && self.bg_events == n,
            None => false,
        };
        if hit {
            self.capture();
            if let Some(f) = &self.on_freeze {
                f();
            }
        }
        hit
    }

    /// Record a store of `bytes` at `off` of `pool` in the line logs (the volatile image is
    /// written by the caller).
    fn log_store(&mut self, pool: usize, off: usize, bytes: &[u8]) {
        self.store_seq += 1;
        let seq = self.store_seq;
        let mut pos = 0;
        while pos < bytes.len() {
            let at = off + pos;
            let line = at / LINE_LEN;
            let in_line = at % LINE_LEN;
            let n = (LINE_LEN - in_line).min(bytes.len() - pos);
            let mut st = LineStore { seq, mask: 0, data: [0; LINE_LEN], tearable: true };
            st.data[in_line..in_line + n].copy_from_slice(&bytes[pos..pos + n]);
            st.mask = if n == LINE_LEN { u64::MAX } else { ((1u64 << n) - 1) << in_line };
            let log = self.logs.entry((pool, line)).or_default();
            log.push(st);
            if log.len() > MAX_LOG {
                let second = log.remove(1);
                if let Some(first) = log.first_mut() {
                    for i in 0..LINE_LEN {
                        if second.mask & (1u64 << i) != 0 {
                            first.data[i] = second.data[i];
                        }
                    }
                    first.mask |= second.mask;
                    first.seq = second.seq;
                    first.tearable = false;
                }
            }
            pos += n;
        }
    }
}

impl Media {
    /// Dirty lines in a fixed order (so that a seed picks the same state every time).
    fn dirty(&self) -> Vec<((usize, usize), &Log)> {
        let mut d: Vec<_> = self.logs.iter().filter(|(_, l)| !l.is_empty()).map(|(k, l)| (*k, l)).collect();
        d.sort_unstable_by_key(|(k, _)| *k);
        d
    }
}

/// How likely each kind of partial persistence is in a simulated crash state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrashModel {
    /// Chance that a dirty line reached the media (with a prefix of its stores).
    pub evict: f64,
    /// Chance that the last store of a landed prefix is torn (a random subset of its words).
    pub tear: f64,
}

impl CrashModel {
    /// Dirty lines land with chance `evict`; a quarter of the landed prefixes end torn.
    pub fn strict(evict: f64) -> CrashModel {
        CrashModel { evict, tear: 0.25 }
    }
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
            .field("events", &s.events)
            .field("fences", &s.fences)
            .field("armed", &s.armed)
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
        SimDevice { state: Arc::new(Mutex::new(SimState::new(Vec::new(), None))) }
    }

    /// Call `f` when the armed crash point is reached (e.g. to freeze a
    /// [`crate::fs::FaultFs`] at the same instant, so files and PM crash together). `f` runs
    /// under the device lock: it must not call back into this device.
    pub fn on_freeze(&self, f: impl Fn() + Send + 'static) {
        self.state.lock().on_freeze = Some(Box::new(f));
    }

    /// Freeze the device now, as a crash point reached elsewhere (a file sync) would: nothing
    /// stored, flushed or fenced from now on reaches the media. Does not call the
    /// [`SimDevice::on_freeze`] hook.
    pub fn freeze(&self) {
        self.state.lock().capture();
    }

    /// Freeze the device just before fence number `n` (1-based) takes effect.
    pub fn crash_before_fence(&self, n: u64) {
        self.state.lock().armed = Some(Armed::Fence(n));
    }

    /// Freeze the device just before event number `n` (1-based; stores, flushes and fences
    /// all count) takes effect.
    pub fn crash_before_event(&self, n: u64) {
        self.state.lock().armed = Some(Armed::Event(n));
    }

    /// Freeze the device just before the `n`-th event (1-based) made by one of tierkv's
    /// background threads (named `tierkv-*`: flushes, merges, compactions, write-back).
    pub fn crash_before_background_event(&self, n: u64) {
        self.state.lock().armed = Some(Armed::Background(n));
    }

    /// Events made by background threads so far.
    pub fn background_events(&self) -> u64 {
        self.state.lock().bg_events
    }

    /// Make the device full at `n` pools: the region's next grow beyond them fails with
    /// [`crate::Error::PmFull`] (a full PM medium). Kept across [`SimDevice::simulate_crash`].
    pub fn limit_pools(&self, n: usize) {
        self.state.lock().max_pools = Some(n);
    }

    /// Fences executed so far.
    pub fn fences(&self) -> u64 {
        self.state.lock().fences
    }

    /// Events (stores, flushes, fences) so far: each one a crash point.
    pub fn events(&self) -> u64 {
        self.state.lock().events
    }

    /// True once the armed crash point has been reached (or [`SimDevice::freeze`] called).
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

    /// Overwrite bytes of pool `pool` in both images and in every store not yet durable
    /// (corruption tests: every crash state holds them). A store may have the device open,
    /// but no thread may be using it during the call. Returns false if the range is outside
    /// the pool.
    pub fn poke(&self, pool: usize, off: usize, bytes: &[u8]) -> bool {
        let mut s = self.state.lock();
        let Some(p) = s.pools.get_mut(pool) else {
            return false;
        };
        let Some(end) = off.checked_add(bytes.len()).filter(|&e| e <= p.len) else {
            return false;
        };
        // SAFETY: `off..end` is inside the pool's allocation (checked above); stores happen
        // only under the device lock, which is held, and no thread reads these bytes during
        // the call (caller contract).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.ptr.add(off), bytes.len()) };
        p.durable[off..end].copy_from_slice(bytes);
        for ((lp, line), log) in s.logs.iter_mut() {
            let start = line * LINE_LEN;
            if *lp != pool || start + LINE_LEN <= off || start >= end {
                continue;
            }
            for st in log.iter_mut() {
                for i in 0..LINE_LEN {
                    let at = start + i;
                    if at >= off && at < end && st.mask & (1u64 << i) != 0 {
                        st.data[i] = bytes[at - off];
                    }
                }
            }
        }
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
        s.logs.retain(|(lp, _), _| *lp != pool);
        true
    }

    /// The media as the crash left it (now, if no crash point was reached).
    fn crash_media(&self) -> (Media, Option<usize>) {
        let s = self.state.lock();
        (s.frozen.clone().unwrap_or_else(|| s.media()), s.max_pools)
    }

    fn device_from(images: Vec<Vec<u8>>, max_pools: Option<usize>) -> SimDevice {
        let pools = images.iter().map(|im| SimPool::new(im.len(), Some(im))).collect();
        SimDevice { state: Arc::new(Mutex::new(SimState::new(pools, max_pools))) }
    }

    /// The device a power failure would leave now (or at the armed crash point, if it was
    /// reached), in the strict model ([`CrashModel::strict`]): the durable image, plus each
    /// dirty line with chance `evict_fraction` holding a prefix of its stores (the last one
    /// torn in a quarter of the cases). Chosen by `seed`; the result is a fresh, unarmed
    /// device.
    pub fn simulate_crash(&self, seed: u64, evict_fraction: f64) -> SimDevice {
        self.simulate_crash_with(seed, CrashModel::strict(evict_fraction))
    }

    /// [`SimDevice::simulate_crash`] with an explicit [`CrashModel`].
    pub fn simulate_crash_with(&self, seed: u64, model: CrashModel) -> SimDevice {
        let (media, max_pools) = self.crash_media();
        let mut images = media.durable.clone();
        let mut rng = SmallRng::seed_from_u64(seed);
        let evict = model.evict.clamp(0.0, 1.0);
        let tear = model.tear.clamp(0.0, 1.0);
        for ((pool, line), log) in media.dirty() {
            if !rng.random_bool(evict) {
                continue;
            }
            let Some(dst) = images.get_mut(pool).and_then(|im| line_of(im, line)) else {
                continue;
            };
            // A prefix of at least one store; its last store may be torn.
            let p = rng.random_range(1..=log.len());
            apply_prefix(log, p - 1, dst);
            if let Some(last) = log.get(p - 1) {
                let words = if last.tearable && rng.random_bool(tear) { rng.random::<u8>() } else { u8::MAX };
                last.apply(dst, words);
            }
        }
        Self::device_from(images, max_pools)
    }

    /// Number of dirty lines the crash left (lines whose content differs between crash
    /// states).
    pub fn dirty_lines(&self) -> usize {
        self.crash_media().0.dirty().len()
    }

    /// Every crash state of the device, if it has at most `max_lines` dirty lines: each
    /// dirty line holds its durable content plus some prefix of its stores (whole stores:
    /// torn stores are left to [`SimDevice::simulate_crash`]). `None` when there are more
    /// dirty lines, or more than 4,096 states.
    pub fn crash_states(&self, max_lines: usize) -> Option<Vec<SimDevice>> {
        let (media, max_pools) = self.crash_media();
        let dirty = media.dirty();
        if dirty.len() > max_lines {
            return None;
        }
        let mut total: usize = 1;
        for (_, log) in &dirty {
            total = total.checked_mul(log.len() + 1).filter(|&t| t <= 4096)?;
        }
        let mut out = Vec::with_capacity(total);
        for state in 0..total {
            let mut images = media.durable.clone();
            let mut n = state;
            for ((pool, line), log) in &dirty {
                let p = n % (log.len() + 1);
                n /= log.len() + 1;
                if let Some(dst) = images.get_mut(*pool).and_then(|im| line_of(im, *line)) {
                    apply_prefix(log, p, dst);
                }
            }
            out.push(Self::device_from(images, max_pools));
        }
        Some(out)
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

    /// Store `bytes` at `off` of pool `pool` in the volatile image (an event). Returns false
    /// when the range is outside the pool.
    pub(super) fn store(&self, pool: usize, off: usize, bytes: &[u8]) -> bool {
        let mut s = self.state.lock();
        s.event(false);
        let Some(p) = s.pools.get(pool) else {
            return false;
        };
        if off.checked_add(bytes.len()).is_none_or(|e| e > p.len) {
            return false;
        }
        // SAFETY: `off..off+len` is inside the pool's allocation (checked above); the device
        // lock is held, so no other store runs concurrently, and the region's contract keeps
        // readers off these bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.ptr.add(off), bytes.len()) };
        s.log_store(pool, off, bytes);
        true
    }

    /// Atomic 8-byte store of `v` at `off` (8-byte aligned) of pool `pool` (an event).
    /// Returns false when the word is outside the pool or unaligned.
    pub(super) fn store_u64(&self, pool: usize, off: usize, v: u64) -> bool {
        let mut s = self.state.lock();
        s.event(false);
        let Some(p) = s.pools.get(pool) else {
            return false;
        };
        if !off.is_multiple_of(8) || off.checked_add(8).is_none_or(|e| e > p.len) {
            return false;
        }
        // SAFETY: the word is inside the allocation and 8-byte aligned (the allocation is
        // 4096-aligned, `off % 8 == 0`); concurrent readers of this word use atomic loads
        // (region contract), and every store runs under the device lock.
        let word = unsafe { &*(p.ptr.add(off) as *const AtomicU64) };
        word.store(v, Ordering::Release);
        s.log_store(pool, off, &v.to_le_bytes());
        true
    }

    /// The calling thread writes back lines `[off, off+len)` of pool `pool` (an event): each
    /// line's stores so far join the thread's pending set, durable at its next fence.
    pub(super) fn flush(&self, pool: usize, off: u64, len: u64) {
        if len == 0 {
            return;
        }
        let mut s = self.state.lock();
        if s.event(false) {
            return;
        }
        let first = (off / LINE) as usize;
        let end = (off + len).div_ceil(LINE) as usize;
        let upto = s.store_seq;
        let mut copies = Vec::new();
        for line in first..end {
            if s.logs.get(&(pool, line)).is_some_and(|l| !l.is_empty()) {
                copies.push(Flushed { pool, line, upto });
            }
        }
        let mine = s.pending.entry(std::thread::current().id()).or_default();
        mine.retain(|f| f.pool != pool || f.line < first || f.line >= end);
        mine.extend(copies);
    }

    /// A fence by the calling thread (an event): its flushed lines become durable.
    pub(super) fn fence(&self) {
        let mut s = self.state.lock();
        if s.event(true) {
            return;
        }
        let Some(mine) = s.pending.remove(&std::thread::current().id()) else {
            return;
        };
        let SimState { pools, logs, .. } = &mut *s;
        for f in mine {
            let Some(log) = logs.get_mut(&(f.pool, f.line)) else {
                continue;
            };
            let n = log.iter().take_while(|st| st.seq <= f.upto).count();
            if n == 0 {
                continue;
            }
            if let Some(dst) = pools.get_mut(f.pool).and_then(|p| line_of(&mut p.durable, f.line)) {
                apply_prefix(log, n, dst);
            }
            log.drain(..n);
            if log.is_empty() {
                logs.remove(&(f.pool, f.line));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn dev_with_pool() -> SimDevice {
        let d = SimDevice::new();
        d.add_pool(4096).unwrap();
        d
    }

    fn durable(d: &SimDevice) -> Vec<u8> {
        d.durable_image(0).unwrap()
    }

    #[test]
    fn a_store_after_the_flush_is_not_made_durable_by_the_fence() {
        let d = dev_with_pool();
        assert!(d.store(0, 0, &[1; 8]));
        d.flush(0, 0, 8);
        assert!(d.store(0, 8, &[2; 8]));
        d.fence();
        let img = durable(&d);
        assert_eq!(&img[0..8], &[1; 8], "flushed content is durable");
        assert_eq!(&img[8..16], &[0; 8], "stored after the flush: not durable");
        let dead = d.simulate_crash_with(0, CrashModel { evict: 0.0, tear: 0.0 });
        assert_eq!(&dead.durable_image(0).unwrap()[8..16], &[0; 8]);
    }

    #[test]
    fn a_fence_orders_only_its_own_threads_flushes() {
        let d = dev_with_pool();
        assert!(d.store(0, 0, &[7; 8]));
        d.flush(0, 0, 8);
        let d2 = d.clone();
        std::thread::spawn(move || d2.fence()).join().unwrap();
        assert_eq!(&durable(&d)[0..8], &[0; 8], "another thread's fence made a line durable");
        // The flushed copy may still have landed at a crash.
        let landed = d.simulate_crash_with(0, CrashModel { evict: 1.0, tear: 0.0 });
        assert_eq!(&landed.durable_image(0).unwrap()[0..8], &[7; 8]);
        d.fence();
        assert_eq!(&durable(&d)[0..8], &[7; 8]);
    }

    #[test]
    fn the_later_flush_of_a_line_wins() {
        let d = dev_with_pool();
        assert!(d.store(0, 0, &[1; 8]));
        d.flush(0, 0, 8);
        let d2 = d.clone();
        std::thread::spawn(move || {
            assert!(d2.store(0, 0, &[2; 8]));
            d2.flush(0, 0, 8);
            d2.fence();
        })
        .join()
        .unwrap();
        d.fence();
        assert_eq!(&durable(&d)[0..8], &[2; 8], "an older flushed copy overwrote a newer durable one");
    }

    #[test]
    fn torn_lines_mix_whole_words_only() {
        let d = dev_with_pool();
        assert!(d.store(0, 0, &[0xab; 64]));
        let mut seen_mixed = false;
        for seed in 0..64 {
            let c = d.simulate_crash_with(seed, CrashModel { evict: 1.0, tear: 1.0 });
            let img = c.durable_image(0).unwrap();
            for w in img[0..64].chunks(8) {
                assert!(w == [0xab; 8] || w == [0; 8], "a word was torn inside: {w:?}");
            }
            let new = img[0..64].chunks(8).filter(|w| w[0] == 0xab).count();
            seen_mixed |= new > 0 && new < 8;
        }
        assert!(seen_mixed, "tearing never produced a mixed line");
    }

    #[test]
    fn separate_stores_to_one_line_persist_in_order() {
        let d = dev_with_pool();
        for w in 0..4u8 {
            d.store_u64(0, w as usize * 8, u64::from(w) + 1);
        }
        let mut prefixes = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let img = d.simulate_crash_with(seed, CrashModel { evict: 1.0, tear: 1.0 }).durable_image(0).unwrap();
            let landed: Vec<bool> = (0..4).map(|w| img[w * 8] != 0).collect();
            let n = landed.iter().take_while(|&&l| l).count();
            assert!(landed[n..].iter().all(|&l| !l), "a later store landed before an earlier one: {landed:?}");
            prefixes.insert(n);
        }
        assert_eq!(prefixes.len(), 5, "every prefix (a torn single-word store lands as none): {prefixes:?}");
        let states = d.crash_states(1).unwrap();
        assert_eq!(states.len(), 5, "durable plus four prefixes");
    }

    #[test]
    fn exhaustive_states_cover_every_subset() {
        let d = dev_with_pool();
        for i in 0..3 {
            assert!(d.store(0, i * 64, &[i as u8 + 1; 4]));
        }
        assert_eq!(d.dirty_lines(), 3);
        let states = d.crash_states(10).unwrap();
        assert_eq!(states.len(), 8);
        let mut seen = std::collections::BTreeSet::new();
        for s in &states {
            let img = s.durable_image(0).unwrap();
            seen.insert((img[0], img[64], img[128]));
        }
        assert_eq!(seen.len(), 8, "every subset of the three dirty lines");
        assert!(d.crash_states(2).is_none(), "more dirty lines than allowed");
    }

    #[test]
    fn an_event_crash_point_freezes_before_the_store() {
        let d = dev_with_pool();
        d.crash_before_event(3);
        assert!(d.store(0, 0, &[1; 8])); // event 1
        d.flush(0, 0, 8); // event 2
        d.fence(); // event 3: frozen before it
        assert!(d.crashed());
        assert_eq!(d.events(), 3);
        let none = d.simulate_crash_with(0, CrashModel { evict: 0.0, tear: 0.0 });
        assert_eq!(&none.durable_image(0).unwrap()[0..8], &[0; 8], "the fence did not happen");
        let all = d.simulate_crash_with(0, CrashModel { evict: 1.0, tear: 0.0 });
        assert_eq!(&all.durable_image(0).unwrap()[0..8], &[1; 8], "the flushed copy may have landed");
    }
}
