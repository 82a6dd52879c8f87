//! The persistent-memory region: every PM access in tierkv goes through [`Region`].
//!
//! A region is a sequence of equally sized *pools*. In production each pool is a file
//! (`pool-000000`, `pool-000001`, ... under the PM path) mapped `MAP_SHARED` (with
//! `MAP_SYNC` when the file system supports DAX); in tracked mode each pool lives in a
//! [`sim::SimDevice`]. Addresses are 64-bit *global offsets*: pool `i` covers
//! `[i * pool_size, (i + 1) * pool_size)`. Offsets never become raw pointers that outlive
//! the region; pools are only added, never remapped, so views stay valid while the region
//! lives. Every pool starts with a 64-byte header (docs/format/pm-pool.md).
//!
//! # Thread safety
//! Readers take views with [`Region::slice`]. Writes are `unsafe`: the writer guarantees that
//! no other thread reads or writes the same bytes concurrently. The engines uphold this by
//! writing only freshly allocated space, or log space owned by the single writer, and by
//! publishing a location (through a lock or an 8-byte atomic store) only after its bytes are
//! written. 8-byte words that are read while they may change use
//! [`Region::store_u64_atomic`] / [`Region::load_u64_atomic`].
//!
//! # Persistence
//! [`Region::flush`] writes lines back (CLWB, CLFLUSHOPT or CLFLUSH, see [`flush`]),
//! [`Region::fence`] orders them (SFENCE); [`Region::persist`] is both. With `sync` the
//! fence is followed by `msync` of the flushed pages, for power-loss durability on a file
//! system without DAX. A fence cannot fail (the instructions it stands for cannot), so a
//! failed msync is recorded in the region's [`PmHealth`], which the store checks before it
//! acknowledges a write.

pub mod checked;
pub mod flush;
pub mod heap;
pub(crate) mod pins;
pub mod profile;
pub mod sim;

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::format::crc;
pub use flush::{FlushInstr, LINE};
pub use profile::PmProfile;
use sim::SimDevice;

/// Bytes at the start of every pool reserved for the pool header.
pub const POOL_HEADER_LEN: u64 = 64;
/// Most pools a region may have.
pub const MAX_POOLS: usize = 4096;
const POOL_MAGIC: &[u8; 8] = b"TKVPOOL\0";
const POOL_VERSION: u32 = 1;

/// Where a region's pools live.
#[derive(Debug, Clone)]
pub enum Backing {
    /// Pool files in this directory.
    Dir(PathBuf),
    /// The crash simulator.
    Sim(SimDevice),
}

/// How to open a [`Region`].
#[derive(Debug, Clone)]
pub struct RegionConfig {
    /// Where the pools live.
    pub backing: Backing,
    /// Pool size for new regions (existing regions keep theirs).
    pub pool_size: u64,
    /// Identity of the owning store, written into every pool header and checked at open.
    pub db_id: u64,
    /// `msync` flushed pages at every fence.
    pub sync: bool,
    /// Emulated latency per persisted line (ns).
    pub write_latency_ns: u64,
    /// Emulated bandwidth cap (MB/s, 0 = none).
    pub write_bandwidth_mbps: u64,
    /// Emulated extra latency of every read access (ns), see [`profile`].
    pub read_latency_ns: u64,
    /// Most bytes of pools the region may hold (0 = up to [`MAX_POOLS`] pools); growing
    /// past it is [`Error::PmFull`]. At least one pool is always allowed.
    pub capacity: u64,
    /// Reserve the whole `capacity` at open: every pool not yet created gets its file
    /// created and fully allocated as a spare (`pool-NNNNNN.tmp`), which [`Region::grow`]
    /// later takes instead of allocating. Pool-file backing only; needs `capacity`.
    pub preallocate: bool,
    /// Create the first pool when none exists.
    pub create: bool,
    /// Where a failed msync is recorded (shared with the owning store).
    pub health: Arc<PmHealth>,
}

impl RegionConfig {
    /// A region of `pool_size` pools on `backing` for store `db_id`, created when missing:
    /// no msync, no emulated latency or bandwidth limit, no capacity bound, nothing
    /// preallocated (change fields with struct update syntax).
    pub fn new(backing: Backing, pool_size: u64, db_id: u64) -> RegionConfig {
        RegionConfig {
            backing,
            pool_size,
            db_id,
            sync: false,
            write_latency_ns: 0,
            write_bandwidth_mbps: 0,
            read_latency_ns: 0,
            capacity: 0,
            preallocate: false,
            create: true,
            health: Default::default(),
        }
    }
}

/// Health of PM write-back to its medium, shared by a [`Region`] and the store that owns it.
///
/// With `sync` every fence msyncs what it flushed; a failed msync cannot be returned from the
/// fence, so it is recorded here, sticky. As after a failed fsync, what reached the medium is
/// then unknown (the kernel may have dropped the dirty pages), so the store refuses every
/// further write until it is reopened ([`crate::Error::Poisoned`]).
#[derive(Debug, Default)]
pub struct PmHealth {
    /// Set (with `failed`) at the first failure: the per-write check is one atomic load.
    any_failed: std::sync::atomic::AtomicBool,
    failed: Mutex<Option<String>>,
    /// Fault seam: successful msyncs left before every msync fails with EIO.
    fail_after: Mutex<Option<u64>>,
}

impl PmHealth {
    /// The first msync failure, if any.
    pub fn failure(&self) -> Option<String> {
        if !self.any_failed.load(Ordering::Acquire) {
            return None;
        }
        self.failed.lock().clone()
    }

    /// Fault injection (tests): let `n` more msyncs succeed, then fail every one with EIO.
    pub fn fail_msync_after(&self, n: u64) {
        *self.fail_after.lock() = Some(n);
    }

    /// msync `[ptr, ptr+len)`, recording a failure.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be page aligned at `ptr` and inside a live mapping.
    unsafe fn msync(&self, ptr: *mut u8, len: usize) -> std::io::Result<()> {
        let injected = {
            let mut f = self.fail_after.lock();
            match f.as_mut() {
                Some(0) => true,
                Some(n) => {
                    *n -= 1;
                    false
                }
                None => false,
            }
        };
        let r = if injected {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        } else {
            // SAFETY: the caller's contract.
            let rc = unsafe { libc::msync(ptr as *mut libc::c_void, len, libc::MS_SYNC) };
            if rc == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        if let Err(e) = &r {
            let mut f = self.failed.lock();
            if f.is_none() {
                *f = Some(format!("msync of PM failed: {e}"));
                self.any_failed.store(true, Ordering::Release);
            }
        }
        r
    }
}

/// Counters of PM traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PmStats {
    /// Bytes written by stores.
    pub bytes_stored: u64,
    /// Cache lines written back.
    pub lines_persisted: u64,
    /// Fences (persist calls).
    pub persist_calls: u64,
    /// Read accesses that paid an emulated read latency.
    pub delayed_reads: u64,
    /// Records whose checksum a reader verified and memoised ([`checked`]).
    pub records_checked: u64,
    /// DRAM held by the memo of verified records ([`checked`]; 0 until first used).
    pub checked_memo_bytes: u64,
    /// Pools in the region.
    pub pools: u64,
    /// Bytes of PM mapped.
    pub capacity: u64,
}

struct Pool {
    base: *mut u8,
    len: u64,
    path: PathBuf,
    _map: Option<Mapping>,
}

// SAFETY: `base` points into a mapping (or simulator allocation) owned by the pool or the
// region's `SimDevice`, alive as long as the pool; access to the bytes follows the region's
// thread-safety contract above.
unsafe impl Send for Pool {}
// SAFETY: as above; `&Pool` only hands out the pointer, never unsynchronised interior state.
unsafe impl Sync for Pool {}

/// A persistent-memory region. See the module docs.
pub struct Region {
    pools: Box<[OnceLock<Pool>]>,
    npools: AtomicUsize,
    pool_size: u64,
    /// log2(pool_size): pool sizes are powers of two, so address arithmetic is a shift.
    pool_shift: u32,
    db_id: u64,
    backing: Backing,
    grow_lock: Mutex<()>,
    instr: FlushInstr,
    sync: bool,
    latency_ns: u64,
    read_latency_ns: u64,
    bandwidth_bps: u64,
    /// Most pools `grow` may reach (from `capacity`).
    max_pools: usize,
    throttle: Mutex<Instant>,
    health: Arc<PmHealth>,
    /// 0: bytes stored, 1: lines persisted, 2: persist calls (fences), 3: delayed reads.
    counters: crate::counters::Counters<4>,
    /// Records this open region's readers already verified (see [`checked`]).
    checked: checked::Checked,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("pools", &self.pool_count())
            .field("pool_size", &self.pool_size)
            .field("instr", &self.instr)
            .finish()
    }
}

fn pool_file(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("pool-{i:06}"))
}

/// Where pool `i` is prepared before it is renamed into place (also a preallocated spare).
fn spare_file(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("pool-{i:06}.tmp"))
}

/// Encode a pool header (64 bytes).
pub fn encode_pool_header(index: u32, pool_size: u64, db_id: u64) -> [u8; 64] {
    let mut h = [0u8; 64];
    h[0..8].copy_from_slice(POOL_MAGIC);
    h[8..12].copy_from_slice(&POOL_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&index.to_le_bytes());
    h[16..24].copy_from_slice(&pool_size.to_le_bytes());
    h[24..32].copy_from_slice(&db_id.to_le_bytes());
    let c = crc::masked(&h[0..32]);
    h[32..36].copy_from_slice(&c.to_le_bytes());
    h
}

impl Region {
    /// Open (or create) a region.
    pub fn open(cfg: RegionConfig) -> Result<Region> {
        if !cfg.pool_size.is_power_of_two() || cfg.pool_size < 4096 {
            return Err(Error::InvalidArgument(format!(
                "PM pool size {} is not a power of two >= 4096",
                cfg.pool_size
            )));
        }
        let instr = FlushInstr::detect();
        let mut pools: Vec<OnceLock<Pool>> = Vec::with_capacity(MAX_POOLS);
        pools.resize_with(MAX_POOLS, OnceLock::new);
        let mut region = Region {
            pools: pools.into_boxed_slice(),
            npools: AtomicUsize::new(0),
            pool_size: cfg.pool_size,
            pool_shift: cfg.pool_size.trailing_zeros(),
            db_id: cfg.db_id,
            backing: cfg.backing.clone(),
            grow_lock: Mutex::new(()),
            instr,
            sync: cfg.sync,
            latency_ns: cfg.write_latency_ns,
            read_latency_ns: cfg.read_latency_ns,
            max_pools: MAX_POOLS,
            bandwidth_bps: cfg.write_bandwidth_mbps.saturating_mul(1_000_000),
            throttle: Mutex::new(Instant::now()),
            health: cfg.health.clone(),
            counters: Default::default(),
            checked: checked::Checked::new(),
        };
        let existing = region.attach_existing(cfg.create)?;
        // An existing region keeps its pool size, so the pool budget is computed after attach.
        if cfg.capacity > 0 {
            region.max_pools =
                usize::try_from(cfg.capacity / region.pool_size).unwrap_or(MAX_POOLS).clamp(1, MAX_POOLS);
        }
        if existing == 0 {
            if !cfg.create {
                return Err(Error::InvalidArgument("PM region has no pools".into()));
            }
            region.grow()?;
        }
        if cfg.preallocate {
            if cfg.capacity == 0 {
                return Err(Error::InvalidArgument("PM preallocation needs a PM capacity".into()));
            }
            region.reserve_spares()?;
        }
        Ok(region)
    }

    /// Create (allocated, unmapped) spare files for every pool up to the capacity that does
    /// not exist yet. Spares carry no header: [`Region::grow`] writes it when it takes one.
    fn reserve_spares(&self) -> Result<()> {
        let Backing::Dir(dir) = &self.backing else { return Ok(()) };
        for i in self.pool_count()..self.max_pools {
            let tmp = spare_file(dir, i);
            let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&tmp)?;
            prepare_spare(&file, self.pool_size)?;
        }
        crate::fs::sync_dir_path(dir)?;
        Ok(())
    }

    /// Map every existing pool and verify its header. Returns how many there are.
    ///
    /// With `creating`, a pool whose header was never made durable (all zero: a crash hit
    /// the creation of a store) gets its header written now instead of being refused.
    fn attach_existing(&mut self, creating: bool) -> Result<usize> {
        let mut i = 0usize;
        loop {
            let pool = match &self.backing {
                Backing::Dir(dir) => {
                    let path = pool_file(dir, i);
                    if !path.exists() {
                        break;
                    }
                    let file = OpenOptions::new().read(true).write(true).open(&path)?;
                    let len = file.metadata()?.len();
                    if i == 0 {
                        if !len.is_power_of_two() {
                            return Err(Error::corruption(
                                &path,
                                0,
                                format!("pool file is {len} bytes, not a power of two"),
                            ));
                        }
                        self.pool_size = len;
                        self.pool_shift = len.trailing_zeros();
                    }
                    if len != self.pool_size || len < POOL_HEADER_LEN {
                        return Err(Error::corruption(
                            &path,
                            0,
                            format!("pool file is {len} bytes, expected {}", self.pool_size),
                        ));
                    }
                    let map = map_file(&file, len)?;
                    let base = map.ptr;
                    Pool { base, len, path, _map: Some(map) }
                }
                Backing::Sim(dev) => {
                    let Some((base, len)) = dev.pool(i) else {
                        break;
                    };
                    if i == 0 {
                        if !len.is_power_of_two() {
                            return Err(Error::corruption(
                                format!("<sim>/pool-{i:06}"),
                                0,
                                "pool size is not a power of two",
                            ));
                        }
                        self.pool_size = len as u64;
                        self.pool_shift = len.trailing_zeros();
                    }
                    let path = PathBuf::from(format!("<sim>/pool-{i:06}"));
                    if len as u64 != self.pool_size || (len as u64) < POOL_HEADER_LEN {
                        return Err(Error::corruption(
                            path,
                            0,
                            format!("pool is {len} bytes, expected {}", self.pool_size),
                        ));
                    }
                    Pool { base, len: len as u64, path, _map: None }
                }
            };
            // SAFETY: the pool is at least POOL_HEADER_LEN bytes and no writer exists yet.
            let blank =
                unsafe { std::slice::from_raw_parts(pool.base, POOL_HEADER_LEN as usize) }.iter().all(|&b| b == 0);
            if creating && blank {
                let h = encode_pool_header(i as u32, pool.len, self.db_id);
                if let Backing::Sim(dev) = &self.backing {
                    dev.store(i, 0, &h);
                    dev.flush(i, 0, POOL_HEADER_LEN);
                    dev.fence();
                } else if let Some(m) = &pool._map {
                    // SAFETY: the pool is at least POOL_HEADER_LEN bytes, no other reference
                    // to it exists yet (the region is being opened).
                    unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), pool.base, h.len()) };
                    // SAFETY: the whole live mapping.
                    unsafe { self.health.msync(m.ptr, m.len) }?;
                }
            }
            self.check_header(i, &pool)?;
            if i >= MAX_POOLS {
                return Err(Error::corruption(pool.path, 0, "more pools than a region may have"));
            }
            let _ = self.pools[i].set(pool);
            i += 1;
            self.npools.store(i, Ordering::Release);
        }
        Ok(i)
    }

    fn check_header(&self, i: usize, pool: &Pool) -> Result<()> {
        // SAFETY: the pool is at least POOL_HEADER_LEN bytes (checked by the caller) and no
        // writer exists yet.
        let h = unsafe { std::slice::from_raw_parts(pool.base, POOL_HEADER_LEN as usize) };
        let bad = |d: String| Err(Error::corruption(&pool.path, 0, d));
        if &h[0..8] != POOL_MAGIC {
            return bad("not a tierkv PM pool (bad magic)".into());
        }
        let stored = u32::from_le_bytes([h[32], h[33], h[34], h[35]]);
        if stored != crc::masked(&h[0..32]) {
            return bad("pool header checksum mismatch".into());
        }
        let version = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        if version != POOL_VERSION {
            return bad(format!("unsupported pool format version {version}"));
        }
        let index = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
        let size = u64::from_le_bytes([h[16], h[17], h[18], h[19], h[20], h[21], h[22], h[23]]);
        let db = u64::from_le_bytes([h[24], h[25], h[26], h[27], h[28], h[29], h[30], h[31]]);
        if index as usize != i || size != pool.len {
            return bad(format!("pool header says index {index} size {size}, file is index {i} size {}", pool.len));
        }
        if db != self.db_id {
            return bad(format!("pool belongs to store {db:#x}, not {:#x}", self.db_id));
        }
        Ok(())
    }

    /// Add one pool; returns its index.
    pub fn grow(&self) -> Result<usize> {
        let _g = self.grow_lock.lock();
        let i = self.npools.load(Ordering::Acquire);
        if i >= self.max_pools {
            return Err(Error::PmFull(format!(
                "region already has {i} pools of {} bytes, its capacity",
                self.pool_size
            )));
        }
        let pool = match &self.backing {
            Backing::Dir(dir) => {
                std::fs::create_dir_all(dir)?;
                let path = pool_file(dir, i);
                let tmp = spare_file(dir, i);
                let made = (|| -> Result<Mapping> {
                    // A spare of the right size (preallocated, or left by a crash inside
                    // this function, which writes only the header below) is taken as it is:
                    // its pages are already allocated and charged where they were made.
                    let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&tmp)?;
                    prepare_spare(&file, self.pool_size)?;
                    let map = map_file(&file, self.pool_size)?;
                    let header = encode_pool_header(i as u32, self.pool_size, self.db_id);
                    // SAFETY: fresh mapping of pool_size >= 64 bytes; nobody else sees it yet.
                    unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), map.ptr, 64) };
                    // SAFETY: the whole live mapping.
                    unsafe { self.health.msync(map.ptr, map.len) }?;
                    file.sync_all()?;
                    std::fs::rename(&tmp, &path)?;
                    crate::fs::sync_dir_path(dir)?;
                    Ok(map)
                })();
                let map = match made {
                    Ok(m) => m,
                    Err(e) => {
                        let _ = std::fs::remove_file(&tmp);
                        return Err(e);
                    }
                };
                let base = map.ptr;
                Pool { base, len: self.pool_size, path, _map: Some(map) }
            }
            Backing::Sim(dev) => {
                let (idx, base) = dev.add_pool(self.pool_size as usize).ok_or_else(|| {
                    Error::PmFull(format!("the PM device is full ({i} pools of {} bytes)", self.pool_size))
                })?;
                let header = encode_pool_header(idx as u32, self.pool_size, self.db_id);
                dev.store(idx, 0, &header);
                dev.flush(idx, 0, 64);
                dev.fence();
                Pool { base, len: self.pool_size, path: PathBuf::from(format!("<sim>/pool-{idx:06}")), _map: None }
            }
        };
        let _ = self.pools[i].set(pool);
        self.npools.store(i + 1, Ordering::Release);
        Ok(i)
    }

    /// True while [`Region::grow`] may add a pool (the capacity is not reached).
    pub fn can_grow(&self) -> bool {
        self.pool_count() < self.max_pools
    }

    /// Bytes the region may reach ([`RegionConfig::capacity`] rounded to whole pools), or 0
    /// when it has no bound but the pool count.
    pub fn capacity(&self) -> u64 {
        if self.max_pools >= MAX_POOLS {
            0
        } else {
            self.max_pools as u64 * self.pool_size
        }
    }

    /// Number of pools.
    pub fn pool_count(&self) -> usize {
        self.npools.load(Ordering::Acquire)
    }

    /// Size of each pool.
    pub fn pool_size(&self) -> u64 {
        self.pool_size
    }

    /// The flush instruction in use.
    pub fn flush_instr(&self) -> FlushInstr {
        self.instr
    }

    /// Global offset of byte `off` of pool `pool`.
    pub fn addr(&self, pool: usize, off: u64) -> u64 {
        pool as u64 * self.pool_size + off
    }

    /// File and in-file offset of a global offset (for error messages).
    pub fn locate(&self, addr: u64) -> (PathBuf, u64) {
        let i = (addr / self.pool_size) as usize;
        match self.pools.get(i).and_then(|p| p.get()) {
            Some(p) => (p.path.clone(), addr % self.pool_size),
            None => (PathBuf::from(format!("<pm>/pool-{i:06}")), addr % self.pool_size),
        }
    }

    /// A [`Error::Corruption`] at global offset `addr`.
    pub fn corruption(&self, addr: u64, detail: impl Into<String>) -> Error {
        let (file, off) = self.locate(addr);
        Error::corruption(file, off, detail)
    }

    /// Pool and base pointer for `[addr, addr+len)`, if it lies inside one mapped pool.
    #[inline]
    fn resolve(&self, addr: u64, len: u64) -> Option<*mut u8> {
        let i = (addr >> self.pool_shift) as usize;
        let off = addr & (self.pool_size - 1);
        let end = off.checked_add(len)?;
        let pool = self.pools.get(i)?.get()?;
        if end > pool.len {
            return None;
        }
        // SAFETY: `off < end <= pool.len`, so the result stays inside the pool mapping.
        Some(unsafe { pool.base.add(off as usize) })
    }

    /// Whether `[addr, addr+len)` lies inside one mapped pool (reads nothing, pays no
    /// emulated latency).
    #[inline]
    pub fn contains_range(&self, addr: u64, len: usize) -> bool {
        self.resolve(addr, len as u64).is_some()
    }

    /// A read view of `[addr, addr+len)`, or `None` if the range is not inside one pool.
    /// With an emulated read latency ([`profile`]) every call pays it once.
    #[inline]
    pub fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let p = self.resolve(addr, len as u64)?;
        self.read_delay();
        // SAFETY: `resolve` checked the range lies in a live mapping that outlives `&self`;
        // concurrent writers never touch bytes other threads read (module contract).
        Some(unsafe { std::slice::from_raw_parts(p, len) })
    }

    /// Ask the CPU to start loading the first cache lines of `[addr, addr+len)` (at most
    /// `len` bytes, rounded to lines) so that later reads of it overlap their misses. A
    /// hint only: it reads nothing, pays no emulated latency (the read that follows does),
    /// and a range outside the region is ignored.
    #[inline]
    pub fn prefetch(&self, addr: u64, len: usize) {
        if let Some(p) = self.resolve(addr, len as u64) {
            flush::prefetch_range(p, len);
        }
    }

    /// The memo of records this region's readers already verified ([`checked`]).
    #[inline]
    pub fn checked(&self) -> &checked::Checked {
        &self.checked
    }

    /// Like [`Region::slice`], but a range outside the region is [`Error::Corruption`]
    /// (for offsets that came from persistent data).
    pub fn slice_checked(&self, addr: u64, len: usize, what: &str) -> Result<&[u8]> {
        self.slice(addr, len)
            .ok_or_else(|| self.corruption(addr, format!("{what}: range of {len} bytes is outside the PM region")))
    }

    /// Store `bytes` at `addr` (not yet persistent).
    ///
    /// # Safety
    /// No other thread may read or write `[addr, addr+bytes.len())` concurrently.
    pub unsafe fn write(&self, addr: u64, bytes: &[u8]) -> Result<()> {
        let p = self.resolve(addr, bytes.len() as u64).ok_or_else(|| {
            Error::InvalidArgument(format!("PM write of {} bytes at {addr:#x} outside region", bytes.len()))
        })?;
        match &self.backing {
            Backing::Sim(dev) => {
                dev.store((addr >> self.pool_shift) as usize, (addr & (self.pool_size - 1)) as usize, bytes);
            }
            // SAFETY: range checked by `resolve`; exclusivity guaranteed by the caller.
            Backing::Dir(_) => unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) },
        }
        self.counters.add(0, bytes.len() as u64);
        Ok(())
    }

    /// Failure-atomic 8-byte store (not yet persistent). `addr` must be 8-byte aligned.
    pub fn store_u64_atomic(&self, addr: u64, v: u64) -> Result<()> {
        let p = self.atomic_ptr(addr)?;
        match &self.backing {
            Backing::Sim(dev) => {
                dev.store_u64((addr >> self.pool_shift) as usize, (addr & (self.pool_size - 1)) as usize, v);
            }
            Backing::Dir(_) => p.store(v, Ordering::Release),
        }
        self.counters.add(0, 8);
        Ok(())
    }

    /// Atomic 8-byte load, pairing with [`Region::store_u64_atomic`].
    pub fn load_u64_atomic(&self, addr: u64) -> Result<u64> {
        let w = self.atomic_ptr(addr)?;
        self.read_delay();
        Ok(w.load(Ordering::Acquire))
    }

    /// The emulated extra latency of one read access (nothing on the `dram` profile).
    #[inline]
    fn read_delay(&self) {
        if self.read_latency_ns > 0 {
            self.counters.add(3, 1);
            spin_for(Duration::from_nanos(self.read_latency_ns));
        }
    }

    fn atomic_ptr(&self, addr: u64) -> Result<&AtomicU64> {
        if !addr.is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!("atomic PM access at unaligned offset {addr:#x}")));
        }
        let p = self.resolve(addr, 8).ok_or_else(|| self.corruption(addr, "atomic word outside the PM region"))?;
        // SAFETY: `p` is 8-byte aligned (pools are page aligned, `addr % 8 == 0`), inside a
        // live mapping that outlives `&self`, and every concurrent access to this word goes
        // through an atomic (module contract).
        Ok(unsafe { &*(p as *const AtomicU64) })
    }

    /// Write back the lines of `[addr, addr+len)` without a fence.
    pub fn flush(&self, addr: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = addr & !(LINE - 1);
        let end = addr.saturating_add(len);
        let lines = (end - first).div_ceil(LINE);
        self.counters.add(1, lines);
        match &self.backing {
            Backing::Sim(dev) => {
                let i = (addr >> self.pool_shift) as usize;
                dev.flush(i, addr & (self.pool_size - 1), len);
            }
            Backing::Dir(_) => {
                let Some(base) = self.resolve(first, end - first) else {
                    return;
                };
                for l in 0..lines {
                    // SAFETY: every line start is inside `[first, end)`, which `resolve`
                    // found inside a live mapping.
                    unsafe { flush::flush_line(self.instr, base.add((l * LINE) as usize)) };
                }
                if self.sync {
                    self.msync(first, end - first);
                }
            }
        }
        self.emulate(lines);
    }

    /// Order all earlier flushes and stores (SFENCE). A crash point in tracked mode.
    pub fn fence(&self) {
        self.counters.add(2, 1);
        match &self.backing {
            Backing::Sim(dev) => dev.fence(),
            Backing::Dir(_) => flush::sfence(),
        }
    }

    /// [`Region::flush`] then [`Region::fence`].
    pub fn persist(&self, addr: u64, len: u64) {
        self.flush(addr, len);
        self.fence();
    }

    /// Fault in the pages of `[addr, addr+len)` for writing ahead of their first use
    /// (`MADV_POPULATE_WRITE`, Linux 5.14+), so that the thread that first stores there takes
    /// no page faults. A hint: nothing is written, and it does nothing on a simulated device
    /// or a range outside one pool. Returns whether the kernel did it (an older kernel
    /// answers `EINVAL`).
    pub fn populate(&self, addr: u64, len: u64) -> bool {
        if !matches!(self.backing, Backing::Dir(_)) || len == 0 {
            return false;
        }
        let page = 4096u64;
        let start = addr & !(page - 1);
        let end = addr.saturating_add(len);
        let Some(p) = self.resolve(start, end - start) else { return false };
        // SAFETY: a page-aligned range inside a live mapping; MADV_POPULATE_WRITE only
        // fills page tables (as a write fault would) and changes no byte of the file.
        unsafe { libc::madvise(p.cast(), (end - start) as usize, libc::MADV_POPULATE_WRITE) == 0 }
    }

    fn msync(&self, addr: u64, len: u64) {
        let page = 4096u64;
        let start = addr & !(page - 1);
        let end = addr + len;
        if let Some(p) = self.resolve(start, end - start) {
            // SAFETY: page-aligned range inside a live mapping. A failure is recorded in
            // `health`, which the store checks before acknowledging a write.
            let _ = unsafe { self.health.msync(p, (end - start) as usize) };
        }
    }

    /// msync every pool (clean shutdown, and commit points with `pm_sync`).
    pub fn sync_all(&self) -> Result<()> {
        for i in 0..self.pool_count() {
            if let Some(Pool { _map: Some(m), .. }) = self.pools[i].get() {
                // SAFETY: the whole live mapping.
                unsafe { self.health.msync(m.ptr, m.len) }?;
            }
        }
        Ok(())
    }

    fn emulate(&self, lines: u64) {
        if self.latency_ns > 0 {
            spin_for(Duration::from_nanos(self.latency_ns.saturating_mul(lines)));
        }
        if self.bandwidth_bps > 0 {
            let cost = Duration::from_secs_f64((lines * LINE) as f64 / self.bandwidth_bps as f64);
            let until = {
                let mut next = self.throttle.lock();
                let now = Instant::now();
                if *next < now {
                    *next = now;
                }
                *next += cost;
                *next
            };
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
    }

    /// Traffic counters.
    pub fn stats(&self) -> PmStats {
        PmStats {
            bytes_stored: self.counters.get(0),
            lines_persisted: self.counters.get(1),
            persist_calls: self.counters.get(2),
            delayed_reads: self.counters.get(3),
            records_checked: self.checked.verified(),
            checked_memo_bytes: self.checked.dram_bytes(),
            pools: self.pool_count() as u64,
            capacity: self.pool_count() as u64 * self.pool_size,
        }
    }
}

fn spin_for(d: Duration) {
    let start = Instant::now();
    while start.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Make `file` a spare of `len` bytes with every block reserved, unless it already is one
/// (its length is `len` and its allocated blocks cover it: a spare an earlier open or
/// grow reserved). Reserving again is not free: on tmpfs (the emulated PM's usual home) a
/// second `posix_fallocate` over pages that were reserved and never written zero-fills
/// every one of them — measured 0.38–0.62 s per 256 MiB spare at a reopen of a store with
/// `pm_preallocate` and an 8 GiB capacity (strace of two reopens; such reopens took
/// 5.8–11.5 s to the first read, perf put 48 % of the samples in that zeroing).
fn prepare_spare(file: &std::fs::File, len: u64) -> Result<()> {
    let meta = file.metadata()?;
    if reserved(&meta, len) {
        return Ok(());
    }
    if meta.len() != len {
        file.set_len(0)?;
    }
    reserve(file, len)
}

/// Whether a file of these metadata is `len` bytes long with blocks allocated for all of
/// them (`st_blocks` counts 512-byte units).
fn reserved(meta: &std::fs::Metadata, len: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    meta.len() == len && meta.blocks().saturating_mul(512) >= len
}

/// Size `file` to `len` bytes with its blocks reserved (`posix_fallocate`), so a full file
/// system is an `ENOSPC` error here rather than a SIGBUS on a later store into a sparse page
/// of the mapping. File systems without fallocate fall back to a sparse `set_len`.
fn reserve(file: &std::fs::File, len: u64) -> Result<()> {
    use std::os::fd::AsRawFd;
    let n = libc::off_t::try_from(len).map_err(|_| Error::InvalidArgument("pool too large".into()))?;
    // SAFETY: plain system call on a file descriptor we own.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, n) };
    match rc {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => Ok(file.set_len(len)?),
        e => Err(Error::Io(std::io::Error::from_raw_os_error(e))),
    }
}

/// A shared file mapping. memmap2 offers no `MAP_SYNC`, so pools are mapped with libc
/// directly: `MAP_SHARED_VALIDATE | MAP_SYNC` on a DAX file system, else `MAP_SHARED`.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `map_file`; no view outlives the
        // region that owns this mapping.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// Map `len` bytes of `file` shared, with MAP_SYNC when the file system supports DAX.
fn map_file(file: &std::fs::File, len: u64) -> Result<Mapping> {
    use std::os::fd::AsRawFd;
    const MAP_SHARED_VALIDATE: libc::c_int = 0x03;
    const MAP_SYNC: libc::c_int = 0x80000;
    let len = usize::try_from(len).map_err(|_| Error::InvalidArgument("pool too large to map".into()))?;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // SAFETY: mapping a file opened read-write by this process, length = file length; a
    // failure is reported as MAP_FAILED and handled. The store directory is locked, so no
    // other process truncates the file under the mapping.
    let mut p =
        unsafe { libc::mmap(std::ptr::null_mut(), len, prot, MAP_SHARED_VALIDATE | MAP_SYNC, file.as_raw_fd(), 0) };
    let dax = p != libc::MAP_FAILED;
    if !dax {
        // SAFETY: as above, without MAP_SYNC.
        p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), 0) };
    }
    if p == libc::MAP_FAILED {
        return Err(Error::Io(std::io::Error::last_os_error()));
    }
    Ok(Mapping { ptr: p as *mut u8, len })
}

/// An immutable extent of a region seen through the file seam, so the shared readers (the
/// SSTable reader) work on data kept in PM. Reads are views of the mapping, never copies
/// ([`crate::fs::FsFile::mapped`]).
#[derive(Debug)]
pub struct PmFile {
    region: std::sync::Arc<Region>,
    addr: u64,
    len: u64,
}

impl PmFile {
    /// The extent `[addr, addr+len)` of `region`; it must lie inside one pool.
    pub fn new(region: std::sync::Arc<Region>, addr: u64, len: u64) -> Result<PmFile> {
        let n = usize::try_from(len).map_err(|_| region.corruption(addr, "PM extent too large"))?;
        region.slice_checked(addr, n, "PM extent")?;
        Ok(PmFile { region, addr, len })
    }
}

impl crate::fs::FsFile for PmFile {
    fn append(&mut self, _data: &[u8]) -> std::io::Result<()> {
        Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, "PM extents are immutable"))
    }
    fn read_at(&self, off: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        self.region.read_delay();
        let data = self.mapped().unwrap_or(&[]);
        let start = usize::try_from(off).unwrap_or(usize::MAX).min(data.len());
        let n = buf.len().min(data.len() - start);
        buf[..n].copy_from_slice(&data[start..start + n]);
        Ok(n)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.len)
    }
    /// The extent as memory, without the emulated read latency: a reader that borrows a
    /// block from it calls it once per access, and pays the latency once per block
    /// through [`crate::fs::FsFile::note_read`].
    fn mapped(&self) -> Option<&[u8]> {
        let p = self.region.resolve(self.addr, self.len)?;
        // SAFETY: `resolve` checked the extent lies in a live mapping that outlives the
        // region, which `self` keeps alive; extents are immutable once written.
        Some(unsafe { std::slice::from_raw_parts(p, self.len as usize) })
    }
    fn note_read(&self, _n: u64) {
        self.region.read_delay();
    }
}

#[cfg(test)]
mod populate_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn region(backing: Backing) -> Region {
        Region::open(RegionConfig::new(backing, 4 << 20, 7)).unwrap()
    }

    #[test]
    fn populate_maps_pages_without_changing_a_byte() {
        let dir = tempfile::tempdir().unwrap();
        let r = region(Backing::Dir(dir.path().join("pm")));
        let at = POOL_HEADER_LEN + 5000;
        // SAFETY: no other thread uses the region.
        unsafe { r.write(at, b"kept as written").unwrap() };
        let before: Vec<u8> = r.slice(POOL_HEADER_LEN, 1 << 20).unwrap().to_vec();
        // Linux >= 5.14 does it (this project's machines run newer kernels).
        assert!(r.populate(POOL_HEADER_LEN, 1 << 20), "MADV_POPULATE_WRITE refused");
        assert_eq!(r.slice(POOL_HEADER_LEN, 1 << 20).unwrap(), &before[..]);
        assert_eq!(r.slice(at, 15).unwrap(), b"kept as written");
        // Outside the region: refused, nothing happens.
        assert!(!r.populate(64 << 20, 4096));
    }

    /// A spare is reserved once: a file of the right length whose blocks are all allocated
    /// is taken as it is (its bytes kept: no second `posix_fallocate`, which zero-fills
    /// reserved-but-unwritten tmpfs pages), a sparse or short one is reserved.
    #[test]
    fn a_reserved_spare_is_not_reserved_again_and_a_sparse_one_is() {
        use std::io::{Read, Seek, Write};
        let dir = tempfile::tempdir().unwrap();
        let len = 1u64 << 20;
        let open = |name: &str| {
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(dir.path().join(name)).unwrap()
        };
        let mut f = open("a");
        prepare_spare(&f, len).unwrap();
        assert!(reserved(&f.metadata().unwrap(), len));
        // Mark it, prepare it again: the mark stays (set_len(0) or a re-reservation of a
        // written page would not keep it on every file system, a skipped one does).
        f.write_all(b"mark").unwrap();
        prepare_spare(&f, len).unwrap();
        let mut head = [0u8; 4];
        f.rewind().unwrap();
        f.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"mark");
        // Sparse at the right length: not reserved until prepared.
        let g = open("b");
        g.set_len(len).unwrap();
        assert!(!reserved(&g.metadata().unwrap(), len), "a sparse file counted as reserved");
        prepare_spare(&g, len).unwrap();
        assert!(reserved(&g.metadata().unwrap(), len));
        // The wrong length: resized and reserved.
        let h = open("c");
        h.set_len(len / 2).unwrap();
        prepare_spare(&h, len).unwrap();
        assert_eq!(h.metadata().unwrap().len(), len);
        assert!(reserved(&h.metadata().unwrap(), len));
    }
}
