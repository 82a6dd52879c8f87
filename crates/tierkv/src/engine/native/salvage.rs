//! Salvage of a `native` store for `tierkv repair` ([`crate::repair`]), and the log walk
//! `check` shares with it.
//!
//! The store's whole state is its logs: every intact record is a batch of entries with
//! sequence numbers, so salvage hands every entry of every verifying record to the sink
//! with its sequence number as the [`crate::repair::Order`] (sequence numbers are never reused; two
//! copies of one number — an entry and the log cleaner's copy of it — carry the same
//! content). The walk trusts nothing it cannot verify:
//! - the superblock, when it fails its checks, is reported and the geometry is taken from
//!   the options (as a new store would get it);
//! - every slot of every pool is visited; a segment header that fails its checks is
//!   reported and its slot skipped (its records' generation is unknown);
//! - a segment is scanned up to its seal, or to the end the clean-close record gives, or
//!   (the newest segment after a crash) to its first bad record, as at open
//!   ([`super::scan`]); a bad record where a crash leaves none is reported, and the scan
//!   resumes at the next intact record of the segment.
//!
//! What cannot be recovered: the entries of a damaged record (its keys are not
//! trustworthy: reported without a key) — the keys come back with their previous version
//! where an older record of them is intact, which the report covers; damage confined to
//! the last record of an unsealed segment after a crash looks like a torn write and is
//! dropped as at open.

use super::layout::{self, Clean, Kind, SegHeader, Superblock, SEG_HEADER_LEN};
use super::log::Geometry;
use super::scan::{intact_after, scan, End};
use crate::engine::media::{open_media, Media};
use crate::engine::EngineCtx;
use crate::error::Result;
use crate::fs::Fs;
use crate::iter::InternalIterator;
use crate::pm::{Region, POOL_HEADER_LEN};
use crate::repair::{Lost, SalvageSink};

/// Read access to PM images: the live region, or the pools salvage copied.
pub(crate) trait PmRead {
    /// `[addr, addr + len)` if it lies in one pool.
    fn read(&self, addr: u64, len: usize) -> Option<&[u8]>;
    /// Pools.
    fn pools(&self) -> usize;
    /// Bytes per pool.
    fn pool_size(&self) -> u64;
}

impl PmRead for Region {
    fn read(&self, addr: u64, len: usize) -> Option<&[u8]> {
        self.slice(addr, len)
    }
    fn pools(&self) -> usize {
        self.pool_count()
    }
    fn pool_size(&self) -> u64 {
        Region::pool_size(self)
    }
}

impl PmRead for Media {
    fn read(&self, addr: u64, len: usize) -> Option<&[u8]> {
        self.slice(addr, len)
    }
    fn pools(&self) -> usize {
        match self {
            Media::Mapped(r) => r.pool_count(),
            Media::Raw { pools, .. } => pools.len(),
        }
    }
    fn pool_size(&self) -> u64 {
        match self {
            Media::Mapped(r) => r.pool_size(),
            Media::Raw { pool_size, .. } => *pool_size,
        }
    }
}

/// What the walk finds.
pub(crate) enum Event<'a> {
    /// An entry of an intact record.
    Entry { key: &'a [u8], value: &'a [u8], seq: u64, kind: Kind },
    /// Something that fails its checks at `addr`.
    Bad { addr: u64, detail: String },
    /// A torn tail at `addr` (dropped, as at open).
    Torn,
}

/// Walk every segment of the store (see the module docs).
pub(crate) fn walk(pm: &dyn PmRead, g: &Geometry, db_id: u64, shards: u32, f: &mut dyn FnMut(Event<'_>)) -> Result<()> {
    let clean = pm
        .read(layout::CLEAN_ADDR, Clean::encoded_len(shards as usize))
        .and_then(|b| Clean::decode(b, shards as usize));
    for pool in 0..pm.pools() as u64 {
        let mut k = u64::from(pool == 0);
        while k < g.slots_per_pool {
            let addr = g.addr(pool * g.slots_per_pool + k);
            k += 1;
            let Some(raw) = pm.read(addr, SEG_HEADER_LEN as usize) else { continue };
            let h = match SegHeader::decode(raw) {
                Ok(None) => continue,
                Ok(Some(h)) => h,
                Err(detail) => {
                    f(Event::Bad { addr, detail });
                    continue;
                }
            };
            if h.db_id != db_id || h.shard >= shards || k - 1 + u64::from(h.span) > g.slots_per_pool {
                f(Event::Bad {
                    addr,
                    detail: format!("segment header of store {:#x}, shard {}, span {}", h.db_id, h.shard, h.span),
                });
                continue;
            }
            k += u64::from(h.span) - 1;
            let word = raw
                .get(layout::SEAL_OFFSET as usize..layout::SEAL_OFFSET as usize + 8)
                .map_or(0, |w| u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]));
            let sealed = match layout::decode_seal(h.gen, word) {
                Ok(s) => s,
                Err(detail) => {
                    f(Event::Bad { addr: addr + layout::SEAL_OFFSET, detail });
                    None
                }
            };
            let limit = sealed.or_else(|| {
                clean.as_ref().and_then(|c| c.tails.get(h.shard as usize)).filter(|t| t.gen == h.gen).map(|t| t.len)
            });
            let cap = g.capacity(u64::from(h.span));
            let base = addr + SEG_HEADER_LEN;
            let Some(data) = pm.read(base, cap as usize) else {
                f(Event::Bad { addr, detail: "segment runs past its pool".into() });
                continue;
            };
            let mut start = 0usize;
            loop {
                let (end, how) = scan(data, start, h.tag(), limit.map(|l| l as usize), &mut |_, e| {
                    f(Event::Entry { key: e.key, value: e.value, seq: e.seq, kind: e.kind })
                });
                match how {
                    End::Complete => break,
                    End::Torn => {
                        f(Event::Torn);
                        break;
                    }
                    End::Damaged(detail) => {
                        f(Event::Bad { addr: base + end as u64, detail });
                        match intact_after(data, end, h.tag()) {
                            Some(p) if limit.is_none_or(|l| p < l as usize) => start = p,
                            _ => break,
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Walk the store read-only and report every intact entry and every damaged record.
pub(crate) fn salvage(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<()> {
    let media = open_media(ctx, sink)?;
    let fallback = super::recovery::new_superblock(ctx, media.pool_size());
    let sb = match media.read(layout::SUPERBLOCK_ADDR, 64).map(Superblock::decode) {
        Some(Ok(sb)) => sb,
        other => {
            let (file, offset) = media.locate(layout::SUPERBLOCK_ADDR);
            let detail = match other {
                Some(Err(d)) => d,
                _ => "superblock unreadable".into(),
            };
            sink.lost(Lost { file, offset, key: None, detail: format!("{detail}; geometry taken from the options") });
            fallback
        }
    };
    let g = Geometry { stride: sb.stride, slots_per_pool: u64::from(sb.slots_per_pool), pool_size: media.pool_size() };
    if POOL_HEADER_LEN + g.stride * g.slots_per_pool > g.pool_size {
        let (file, offset) = media.locate(layout::SUPERBLOCK_ADDR);
        sink.lost(Lost { file, offset, key: None, detail: "geometry does not fit the pools; nothing read".into() });
        return Ok(());
    }
    let db_id = if ctx.db_id != 0 { ctx.db_id } else { sb.db_id };
    // The capacity tier: every entry of its tables at the lowest order (a key whose moved
    // entry in PM was lost still comes back), then each moved entry in PM brings the disk
    // entry of its key at its own sequence number (orders are `2 × seq`, `+ 1` for moved
    // entries: a moved entry wins over the put it moved).
    let cold_dir = ctx.dir.join(super::cold::COLD_DIR);
    let view = if ctx.fs.exists(&cold_dir.join("CURRENT")) {
        let mut lost_tables = Vec::new();
        let v =
            crate::lsm::TablesView::read_only(&ctx.fs, &cold_dir, &mut |p, d| lost_tables.push((p.to_path_buf(), d)));
        for (file, detail) in lost_tables {
            sink.lost(Lost { file, offset: 0, key: None, detail });
        }
        match v {
            Ok(v) => Some(v),
            Err(e) => {
                sink.lost(Lost { file: cold_dir.clone(), offset: 0, key: None, detail: e.to_string() });
                None
            }
        }
    } else {
        None
    };
    if let Some(v) = &view {
        let mut it = crate::iter::MergingIterator::new(v.sources());
        let mut r = it.seek_to_first();
        while r.is_ok() && it.valid() {
            sink.record(it.key(), it.value(), 0);
            r = it.next();
        }
        if let Err(e) = r {
            sink.lost(Lost { file: cold_dir.clone(), offset: 0, key: None, detail: e.to_string() });
        }
    }
    walk(&media, &g, db_id, sb.shards, &mut |ev| match ev {
        Event::Entry { key, value: _, seq, kind: Kind::Moved } => {
            let order = 2 * u128::from(seq) + 1;
            match view.as_ref().map(|v| v.get(key)) {
                Some(Ok(Some(v))) => sink.record(key, v.as_deref(), order),
                Some(Ok(None)) | None => sink.record(key, None, order),
                Some(Err(e)) => sink.lost(Lost {
                    file: cold_dir.clone(),
                    offset: 0,
                    key: Some(key.to_vec()),
                    detail: format!("the disk entry of a moved key: {e}"),
                }),
            }
        }
        Event::Entry { key, value, seq, kind } => {
            sink.record(key, (kind == Kind::Put).then_some(value), 2 * u128::from(seq))
        }
        Event::Bad { addr, detail } => {
            let (file, offset) = media.locate(addr);
            sink.lost(Lost { file, offset, key: None, detail });
        }
        Event::Torn => {}
    })
}
