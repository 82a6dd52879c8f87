//! The PM pools of a store read for salvage ([`crate::repair`]): mapped through a
//! [`Region`] when the region opens, else copied raw with each pool header checked here.

use std::path::PathBuf;

use super::EngineCtx;
use crate::error::{Error, Result};
use crate::format::Cursor;
use crate::pm::{encode_pool_header, Region, LINE, MAX_POOLS, POOL_HEADER_LEN};
use crate::repair::{Lost, SalvageSink};

/// The PM pools, read-only: mapped through a [`Region`] when it opens, else copied raw.
pub(crate) enum Media {
    Mapped(Region),
    Raw {
        /// Pool images (empty for a pool that is not read).
        pools: Vec<Vec<u8>>,
        /// Their file names, for reports.
        names: Vec<PathBuf>,
        pool_size: u64,
    },
}

impl Media {
    pub(crate) fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        match self {
            Media::Mapped(r) => r.slice(addr, len),
            Media::Raw { pools, pool_size, .. } => {
                let i = usize::try_from(addr / pool_size).ok()?;
                let off = usize::try_from(addr % pool_size).ok()?;
                pools.get(i)?.get(off..off.checked_add(len)?)
            }
        }
    }

    /// File and in-file offset of a global address (as [`Region::corruption`] names them).
    pub(crate) fn locate(&self, addr: u64) -> (PathBuf, u64) {
        match self {
            Media::Mapped(r) => r.locate(addr),
            Media::Raw { names, pool_size, .. } => {
                let i = addr / pool_size;
                let name = usize::try_from(i)
                    .ok()
                    .and_then(|i| names.get(i))
                    .cloned()
                    .unwrap_or_else(|| PathBuf::from(format!("<pm>/pool-{i:06}")));
                (name, addr % pool_size)
            }
        }
    }
}

/// Open the region; when it refuses, copy the pools raw and check their headers here.
pub(crate) fn open_media(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<Media> {
    let err = match super::open_region(ctx) {
        Ok(r) => return Ok(Media::Mapped(r)),
        Err(e) => e,
    };
    let mut pools: Vec<Vec<u8>> = Vec::new();
    let mut names: Vec<PathBuf> = Vec::new();
    match &ctx.opts.pm_device {
        Some(dev) => {
            for i in 0..dev.pool_count() {
                if let Some(img) = dev.durable_image(i) {
                    pools.push(img);
                    names.push(PathBuf::from(format!("<sim>/pool-{i:06}")));
                }
            }
        }
        None => {
            let dir = ctx.opts.pm_path.clone().unwrap_or_else(|| ctx.dir.join("pm"));
            for i in 0..MAX_POOLS {
                let p = dir.join(format!("pool-{i:06}"));
                if !p.exists() {
                    break;
                }
                let data = std::fs::read(&p)
                    .map_err(|e| Error::Io(std::io::Error::new(e.kind(), format!("{}: {e}", p.display()))))?;
                pools.push(data);
                names.push(p);
            }
        }
    }
    let Some(first) = pools.first() else {
        return Err(err);
    };
    // Pool size and store id: the caller's, else pool 0's header when it verifies.
    let own = first.get(..POOL_HEADER_LEN as usize).and_then(header_fields).filter(|h| h.verifies);
    if let Some(h) = own.filter(|h| ctx.db_id == 0 && h.db != 0) {
        // The store's id is unknown (its OPTIONS record is damaged): pool 0 names it.
        if let Ok(r) = super::open_region(&EngineCtx { db_id: h.db, ..ctx.clone() }) {
            return Ok(Media::Mapped(r));
        }
    }
    let pool_size = own.map_or(first.len() as u64, |h| h.size).max(LINE);
    let db = if ctx.db_id != 0 { Some(ctx.db_id) } else { own.map(|h| h.db) };
    let mut explained = false;
    for (i, pool) in pools.iter_mut().enumerate() {
        let name = names.get(i).cloned().unwrap_or_default();
        let lost = |detail: String| Lost { file: name.clone(), offset: 0, key: None, detail };
        match pool.get(..POOL_HEADER_LEN as usize).and_then(header_fields) {
            None => {
                sink.lost(lost(format!("pool of {} bytes is shorter than its header; not read", pool.len())));
                pool.clear();
                explained = true;
            }
            Some(h) if !h.verifies => {
                sink.lost(lost("pool header fails its checksum (damaged); the pool is read anyway".into()));
                explained = true;
            }
            Some(h) if h.index as usize != i || h.size != pool_size || db.is_some_and(|d| d != h.db) => {
                sink.lost(lost(format!(
                    "pool header names pool {} of {} bytes of store {:#x}; expected pool {i} of {pool_size} bytes{}: \
                     a pool of another store or position, not read",
                    h.index,
                    h.size,
                    h.db,
                    db.map_or(String::new(), |d| format!(" of store {d:#x}")),
                )));
                pool.clear();
                explained = true;
            }
            Some(_) if pool.len() as u64 != pool_size => {
                sink.lost(lost(format!(
                    "pool is {} bytes, its header says {pool_size}: bytes past the end are lost",
                    pool.len()
                )));
                explained = true;
            }
            Some(_) => {}
        }
    }
    if !explained {
        let (file, offset, detail) = match err {
            Error::Corruption { file, offset, detail } => (file, offset, detail),
            e => (names.first().cloned().unwrap_or_default(), 0, e.to_string()),
        };
        sink.lost(Lost {
            file,
            offset,
            key: None,
            detail: format!("the PM region does not open ({detail}); read raw"),
        });
    }
    Ok(Media::Raw { pools, names, pool_size })
}

/// The fields of a pool header, and whether it verifies (docs/format/pm-pool.md).
#[derive(Debug, Clone, Copy)]
struct PoolHeader {
    index: u32,
    size: u64,
    db: u64,
    verifies: bool,
}

fn header_fields(h: &[u8]) -> Option<PoolHeader> {
    let mut c = Cursor::new(h);
    c.skip(12)?;
    let index = c.u32()?;
    let size = c.u64()?;
    let db = c.u64()?;
    // A header is exactly what the region writes for its own fields.
    let verifies = h.get(..36) == encode_pool_header(index, size, db).get(..36);
    Some(PoolHeader { index, size, db, verifies })
}
