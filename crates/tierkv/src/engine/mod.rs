//! The internal engine trait every preset implements, and the dispatcher that opens one.
//!
//! [`crate::Db`] does what is common to all presets (argument limits, the options record,
//! the directory lock, iterators, poisoning after a close) and hands each call to an
//! [`Engine`]. A preset is a composition of the shared parts (`pm`, `fs`, `index`, `format`)
//! behind this trait.

pub mod hoakv;
pub mod hpdk;
pub mod lightkv;
pub(crate) mod media;
pub mod native;
pub mod pmekv;
pub mod slmdb;

use std::path::PathBuf;
use std::sync::Arc;

use crate::batch::BatchOp;
use crate::error::Result;
use crate::fs::CountingFs;
use crate::options::{Options, Preset};
use crate::pm::{Backing, Region, RegionConfig};
use crate::stats::Stats;

/// Precondition of a single-operation write (SLM-DB's conditional inserts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cond {
    /// Unconditional.
    None,
    /// Only if the key is absent (`insert_if_absent`).
    Absent,
    /// Only if the key is present (`update_if_present`).
    Present,
}

/// What an engine gets at open.
#[derive(Debug, Clone)]
pub struct EngineCtx {
    /// The store directory.
    pub dir: PathBuf,
    /// The caller's options (validated).
    pub opts: Options,
    /// The file seam, counting bytes.
    pub fs: CountingFs,
    /// The store's identity (from the options record).
    pub db_id: u64,
    /// True when the store is being created (no data exists yet).
    pub fresh: bool,
    /// Where the PM region records a failed msync ([`Db`](crate::Db) checks it).
    pub pm_health: Arc<crate::pm::PmHealth>,
    /// Where open reports the log ranges it dropped ([`crate::Db::recovery_report`]).
    pub recovery: crate::format::log::RecoveryLog,
}

/// Operations every preset provides. Keys and values are already checked against limits.
pub trait Engine: Send + Sync {
    /// The newest value of `key`.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// The newest value of `key`, lent to `f` (borrowed from PM or a pinned block where the
    /// preset can; no allocation on those presets). Returns whether the key exists (`f` is
    /// called exactly once if so). The default goes through [`Engine::get`].
    fn get_with(&self, key: &[u8], f: &mut dyn FnMut(&[u8])) -> Result<bool> {
        match self.get(key)? {
            Some(v) => {
                f(&v);
                Ok(true)
            }
            None => Ok(false),
        }
    }
    /// Apply `ops` atomically. With a condition (only for one op), returns false and writes
    /// nothing when it does not hold.
    fn write(&self, ops: &[BatchOp], cond: Cond) -> Result<bool>;
    /// A cursor over the whole store: the preset's sources merged (see [`crate::iter`]).
    ///
    /// The contract [`crate::Db`]'s snapshot overlay relies on: every key that is not
    /// written while the iterator lives is returned exactly once, with its value, in key
    /// order, in both directions; a key written meanwhile may show any of its versions or
    /// none (the overlay supplies the snapshot's version). Tombstones may show as `None`.
    /// The iterator must not block writers or background work for its lifetime (no lock
    /// held between calls) and must keep working when they run. Range reads of every kind
    /// (`Db::scan`, `Db::iter`, snapshots) go through it.
    fn iter(&self) -> Result<crate::iter::BoxedIter>;
    /// True when the preset keeps versions and offers [`Engine::snapshot`]: [`crate::Db`]
    /// then uses the preset's snapshots for every snapshot and iterator and records no undo
    /// ([`crate::snapshot`]) on writes.
    fn has_snapshots(&self) -> bool {
        false
    }
    /// A consistent point-in-time view (only when [`Engine::has_snapshots`]).
    fn snapshot(&self) -> Result<Arc<dyn EngineSnapshot>> {
        Err(crate::Error::InvalidArgument("this preset keeps no versions of its own".into()))
    }
    /// Finish pending background work that makes the state compact to recover (write-back,
    /// flush of memtables).
    fn flush(&self) -> Result<()>;
    /// Run compaction / garbage collection now.
    fn compact(&self) -> Result<()>;
    /// Counters.
    fn stats(&self) -> Stats;
    /// Verify every checksum and index↔data agreement; returns the problems found.
    fn check(&self) -> Result<Vec<String>>;
    /// Clean shutdown: stop background threads, make everything durable.
    fn close(&self) -> Result<()>;
}

/// A point-in-time view kept by a preset that versions its data ([`Engine::snapshot`]).
/// Dropping it releases the versions only it needed.
pub trait EngineSnapshot: Send + Sync {
    /// `key`'s value at the snapshot.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// A cursor over the store at the snapshot (the contract of [`Engine::iter`], but every
    /// key shows its version at the snapshot, whatever is written meanwhile).
    fn iter(&self) -> Result<crate::iter::BoxedIter>;
}

/// An engine context on a fault-injecting file system (`/db`, created), for the presets'
/// module tests.
#[cfg(test)]
pub(crate) fn test_ctx(opts: &Options, fs: &crate::fs::FaultFs, fresh: bool, db_id: u64) -> EngineCtx {
    use crate::fs::Fs;
    let dir = PathBuf::from("/db");
    fs.create_dir_all(&dir).unwrap();
    EngineCtx {
        dir,
        opts: opts.clone(),
        fs: CountingFs::new(Arc::new(fs.clone())),
        db_id,
        fresh,
        pm_health: Default::default(),
        recovery: Default::default(),
    }
}

/// Open the PM region of a store: pool files under `pm_path` (default `<dir>/pm`), or the
/// simulated device. An existing store whose first pool is missing is corruption (a changed
/// `pm_path` or a wiped medium), never silently a new empty region.
pub(crate) fn open_region(ctx: &EngineCtx) -> Result<Region> {
    let o = &ctx.opts;
    let backing = match &o.pm_device {
        Some(dev) => Backing::Sim(dev.clone()),
        None => Backing::Dir(o.pm_path.clone().unwrap_or_else(|| ctx.dir.join("pm"))),
    };
    if let Backing::Dir(p) = &backing {
        if !ctx.fresh && !p.join("pool-000000").exists() {
            return Err(crate::Error::Corruption {
                file: p.join("pool-000000"),
                offset: 0,
                detail: "the store's PM pool is missing (was pm_path changed, or the PM medium wiped?)".into(),
            });
        }
    }
    Region::open(RegionConfig {
        backing,
        pool_size: o.pm_pool_size,
        db_id: ctx.db_id,
        sync: o.pm_sync,
        write_latency_ns: o.pm_write_latency_ns,
        write_bandwidth_mbps: o.pm_write_bandwidth_mbps,
        read_latency_ns: o.pm_read_latency_ns,
        capacity: o.pm_capacity,
        preallocate: o.pm_preallocate,
        create: ctx.fresh,
        health: ctx.pm_health.clone(),
    })
}

/// Open the engine of `preset`.
pub fn open(preset: Preset, ctx: EngineCtx) -> Result<Arc<dyn Engine>> {
    match preset {
        Preset::Pmekv => Ok(Arc::new(pmekv::Pmekv::open(ctx)?)),
        Preset::Slmdb => Ok(Arc::new(slmdb::Slmdb::open(ctx)?)),
        Preset::Hpdk => Ok(Arc::new(hpdk::Hpdk::open(ctx)?)),
        Preset::Lightkv => Ok(Arc::new(lightkv::Lightkv::open(ctx)?)),
        Preset::Hoakv => Ok(Arc::new(hoakv::Hoakv::open(ctx)?)),
        Preset::Native => Ok(Arc::new(native::Native::open(ctx)?)),
    }
}

/// Salvage every intact record of a `preset` store (read-only; see [`crate::repair`]).
pub(crate) fn salvage(preset: Preset, ctx: &EngineCtx, sink: &mut dyn crate::repair::SalvageSink) -> Result<()> {
    match preset {
        Preset::Pmekv => pmekv::salvage::salvage(ctx, sink),
        Preset::Slmdb => slmdb::salvage::salvage(ctx, sink),
        Preset::Hpdk => hpdk::salvage::salvage(ctx, sink),
        Preset::Lightkv => lightkv::salvage::salvage(ctx, sink),
        Preset::Hoakv => hoakv::salvage::salvage(ctx, sink),
        Preset::Native => native::salvage::salvage(ctx, sink),
    }
}
