//! Opening a `native` store: create it, or find every segment and replay the logs into the
//! index, one worker thread per shard (up to the machine's hardware threads).
//!
//! 1. The superblock gives the geometry (it overrides the options: creation-only).
//! 2. Every slot's header is read: a slot without the segment magic is free; a header that
//!    does not verify, names another store, a shard the store does not have, or a run of
//!    slots beyond its pool is [`Error::Corruption`].
//! 3. Each shard's segments are ordered by generation. Every one but the newest must be
//!    sealed. The newest, when unsealed, ends where the clean-close record says (a clean
//!    close) or at its first bad record (a crash; see [`super::scan`]).
//! 4. Workers replay shards in parallel, each keeping the newest entry of every key it sees
//!    in a map of its own (keys borrowed from PM, no copy); the maps are merged by sequence
//!    number, so the order in which shards replay does not matter (a *moved* entry wins
//!    over a put or delete of its own sequence number). Keys whose newest entry is moved
//!    live on disk and get no slot; keys whose newest entry is a delete are dropped, or
//!    kept as tombstones when the disk tier has tables (the delete must hide them). The
//!    survivors, sorted by key (each key's first 16 bytes inline, so the sort does not
//!    read the keys in PM at every comparison), go to the index as the *base* of its
//!    background load (see "Background load" in [`super::index`]): the store serves
//!    reads from them while the inserter thread fills the maps. Replaying into the live
//!    index instead (a link per record) took 1.83 s for 1.5 M records of 500,000 keys
//!    here; most of it hash probes and tree inserts repeated for every overwrite.
//! 5. The next sequence number is one past the highest seen (or the clean-close record's).
//!    The clean-close record is invalidated before the store accepts a write.
//!
//! With an index checkpoint ([`super::checkpoint`]) that passes its checks, step 4 replays
//! each shard only from the checkpoint's resume point and merges the result with the
//! checkpoint's entries ([`with_checkpoint`], [`overlay_tail`]); one that fails them is removed and the
//! logs are replayed whole.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::engine::EngineCtx;
use crate::error::{Error, Result};
use crate::format::log::{DropReason, Dropped};
use crate::pm::Region;

use super::checkpoint::{self, Checkpoints};
use super::index::{Base, Index, LoadEntry};
use super::layout::{self, Clean, Kind, SegHeader, Superblock, SEG_HEADER_LEN};
use super::log::{Geometry, OpenSeg, ShardLog, SlotAlloc};
use super::scan::{scan, End};
use super::{Inner, Padded, Shard, Snaps, IDLE};

/// A segment found at open.
#[derive(Debug, Clone, Copy)]
pub(super) struct Seg {
    pub addr: u64,
    pub tag: layout::SegTag,
    pub span: u32,
    /// Bytes of records when sealed.
    pub sealed: Option<u32>,
}

/// The geometry a new store gets from its options.
pub(super) fn new_superblock(ctx: &EngineCtx, pool_size: u64) -> Superblock {
    let o = &ctx.opts.native;
    let shards = if o.shards == 0 {
        let hw = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        (2 * hw).clamp(4, 64)
    } else {
        o.shards
    };
    let slots = (pool_size / o.segment_size).max(4);
    let stride = ((pool_size - crate::pm::POOL_HEADER_LEN) / slots) & !(crate::pm::LINE - 1);
    Superblock { shards: shards as u32, stride, slots_per_pool: slots as u32, db_id: ctx.db_id }
}

/// Geometry of a superblock on `region`, checked against the pool size.
pub(super) fn geometry(region: &Region, sb: &Superblock) -> Result<Geometry> {
    let g = Geometry { stride: sb.stride, slots_per_pool: u64::from(sb.slots_per_pool), pool_size: region.pool_size() };
    if crate::pm::POOL_HEADER_LEN + g.stride * g.slots_per_pool > g.pool_size || g.stride < 2 * SEG_HEADER_LEN {
        return Err(region.corruption(layout::SUPERBLOCK_ADDR, "superblock geometry does not fit the PM pools"));
    }
    Ok(g)
}

/// Every segment of the region, by shard (unordered). Also the slots they cover.
pub(super) fn find_segments(region: &Region, g: &Geometry, sb: &Superblock) -> Result<(Vec<Vec<Seg>>, BTreeSet<u64>)> {
    let mut by_shard: Vec<Vec<Seg>> = vec![Vec::new(); sb.shards as usize];
    let mut used = BTreeSet::new();
    for pool in 0..region.pool_count() as u64 {
        let mut k = u64::from(pool == 0);
        while k < g.slots_per_pool {
            let slot = pool * g.slots_per_pool + k;
            let addr = g.addr(slot);
            let raw = region.slice_checked(addr, SEG_HEADER_LEN as usize, "segment header")?;
            let h = match SegHeader::decode(raw).map_err(|d| region.corruption(addr, d))? {
                None => {
                    k += 1;
                    continue;
                }
                Some(h) => h,
            };
            let bad = |d: String| region.corruption(addr, d);
            if h.db_id != sb.db_id {
                return Err(bad(format!("segment of store {:#x}, not {:#x}", h.db_id, sb.db_id)));
            }
            if h.shard >= sb.shards {
                return Err(bad(format!("segment of shard {} in a store of {} shards", h.shard, sb.shards)));
            }
            if k + u64::from(h.span) > g.slots_per_pool {
                return Err(bad(format!("segment of {} slots runs past its pool", h.span)));
            }
            let word = region.load_u64_atomic(addr + layout::SEAL_OFFSET)?;
            let sealed = layout::decode_seal(h.gen, word).map_err(bad)?;
            if sealed.is_some_and(|l| u64::from(l) > g.capacity(u64::from(h.span))) {
                return Err(region.corruption(addr, "seal length beyond the segment"));
            }
            let shard = by_shard.get_mut(h.shard as usize).ok_or_else(|| region.corruption(addr, "shard"))?;
            shard.push(Seg { addr, tag: h.tag(), span: h.span, sealed });
            used.extend(slot..slot + u64::from(h.span));
            k += u64::from(h.span);
        }
    }
    Ok((by_shard, used))
}

/// The newest entry of a key seen by a replay: sequence number, location, kind, size.
pub(super) type Newest = (u64, u64, Kind, u32);

/// Keys with their newest entries, sorted by key (`true`: taken from a checkpoint,
/// unverified).
type Merged<'a> = Vec<(&'a [u8], Newest, bool)>;

/// Whether entry `a` replaces `b` as a key's newest: a higher sequence number, or a moved
/// entry over a put or delete of the same number.
#[inline]
pub(super) fn newer(a: &Newest, b: &Newest) -> bool {
    a.0 > b.0 || (a.0 == b.0 && a.2 == Kind::Moved && b.2 != Kind::Moved)
}

/// What replaying one shard found.
#[derive(Debug, Default)]
struct Replayed<'a> {
    open: Option<OpenSeg>,
    next_gen: u64,
    /// One past the highest sequence number seen.
    seq_end: u64,
    bytes: u64,
    /// Segments replayed: address → (generation, span, bytes of records, sealed).
    segs: Vec<(u64, layout::SegTag, u64, u64, bool)>,
    /// Every key's newest entry, with the key's head ([`super::index::head`]).
    newest: HashMap<&'a [u8], ((u64, u64), Newest), foldhash::fast::RandomState>,
    dropped: Vec<Dropped>,
}

pub(super) fn open(ctx: &EngineCtx) -> Result<Inner> {
    let t0 = Instant::now();
    let region = Arc::new(crate::engine::open_region(ctx)?);
    // The store predates the capacity tier (format version 2) or is new: the tier is made.
    let mut create_cold = ctx.fresh;
    let sb = if ctx.fresh {
        let sb = new_superblock(ctx, region.pool_size());
        let b = sb.encode();
        // SAFETY: the store is being created; nothing else uses the region yet.
        unsafe { region.write(layout::SUPERBLOCK_ADDR, &b)? };
        region.persist(layout::SUPERBLOCK_ADDR, 64);
        sb
    } else {
        let raw = region.slice_checked(layout::SUPERBLOCK_ADDR, 64, "superblock")?;
        let sb = Superblock::decode(raw).map_err(|d| region.corruption(layout::SUPERBLOCK_ADDR, d))?;
        if sb.db_id != ctx.db_id {
            return Err(region.corruption(layout::SUPERBLOCK_ADDR, "superblock of another store"));
        }
        let version = raw.get(8..12).map_or(0, |v| u32::from_le_bytes([v[0], v[1], v[2], v[3]]));
        create_cold = version < layout::FORMAT_VERSION;
        if version < layout::FORMAT_VERSION {
            // An older version's store is a valid store of this one: mark it as this one's.
            let b = sb.encode();
            // SAFETY: the store is being opened; nothing else uses the region yet.
            unsafe { region.write(layout::SUPERBLOCK_ADDR, &b)? };
            region.persist(layout::SUPERBLOCK_ADDR, 64);
        }
        sb
    };
    let geo = geometry(&region, &sb)?;
    let (mut by_shard, used) = find_segments(&region, &geo, &sb)?;
    for segs in &mut by_shard {
        segs.sort_by_key(|s| s.tag.gen);
        if let Some(w) = segs.windows(2).find(|w| w[0].tag.gen == w[1].tag.gen) {
            return Err(
                region.corruption(w[1].addr, format!("two segments of generation {} in one shard", w[1].tag.gen))
            );
        }
    }
    let poison = Arc::new(crate::poison::Poison::default());
    let cancel = Arc::new(crate::jobs::Cancel::new(ctx.opts.job_probe.clone()));
    let nshards = sb.shards as usize;
    let mut ckpt_state = Checkpoints::new(ctx.fs.clone(), &ctx.dir, ctx.opts.native.checkpoint_bytes);
    let mut rejected = None;
    let mut ckpt_buf = None;
    // Delta files (see `delta`): read with the checkpoint; an unreadable one is left out
    // of the chain like a damaged one.
    let mut delta_rejected = None;
    let delta_files: Vec<(u64, checkpoint::FileBytes)> = if ctx.fresh {
        Vec::new()
    } else {
        read_deltas(ctx).unwrap_or_else(|e| {
            delta_rejected = Some(format!("unreadable: {e}"));
            Vec::new()
        })
    };
    let delta_bytes: Vec<(u64, &[u8])> = delta_files.iter().map(|(id, b)| (*id, b.bytes())).collect();
    let clean_raw = region.slice_checked(layout::CLEAN_ADDR, Clean::encoded_len(nshards), "clean-close record")?;
    let clean = Clean::decode(clean_raw, nshards);
    // The capacity tier's LSM opens (disk reads, file creation, fsyncs) on a thread of its
    // own while this one reads the checkpoint and the logs: the two share nothing.
    let open_cold =
        || super::cold::Cold::open(ctx, create_cold, Arc::new(crate::poison::Poison::default()), cancel.clone());
    let (cold, recovered) = std::thread::scope(|s| {
        let spawned = std::thread::Builder::new().name("tierkv-native-open".into()).spawn_scoped(s, open_cold);
        let recovered = (|| -> Result<_> {
            // The index checkpoint, if there is a usable one (one that fails its checks is
            // ignored: the logs alone recover the store).
            ckpt_buf = if ctx.fresh {
                Checkpoints::remove_stale(&ctx.fs, &ctx.dir)?;
                None
            } else {
                // An unreadable checkpoint is rejected like a damaged one.
                Checkpoints::read(&ctx.fs, &ctx.dir).unwrap_or_else(|e| {
                    rejected = Some(format!("unreadable: {e}"));
                    None
                })
            };
            let loaded = match ckpt_buf.as_ref().map(|b| b.bytes()) {
                Some(b) => {
                    let mut r = with_checkpoint(b, &delta_bytes, &region, &geo, sb.db_id, &by_shard, clean.as_ref())?;
                    if let Err(Reject::Chain(why)) = r {
                        // The chain does not fit: the checkpoint alone, and the logs after it.
                        delta_rejected = Some(why);
                        r = with_checkpoint(b, &[], &region, &geo, sb.db_id, &by_shard, clean.as_ref())?;
                    }
                    r.map_err(|e| match e {
                        Reject::Checkpoint(why) | Reject::Chain(why) => rejected = Some(why),
                    })
                    .ok()
                }
                None => None,
            };
            let (rep, merged, base) = match loaded {
                Some(fc) => {
                    ckpt_state.loaded_entries = fc.offs.len() as u64;
                    ckpt_state.stale_dropped = fc.stale;
                    ckpt_state.loaded_deltas = fc.chain.len() as u64;
                    ckpt_state.loaded_delta_entries = fc.delta_entries;
                    if delta_rejected.is_none() {
                        delta_rejected = fc.chain_why.clone();
                    }
                    // Delta files outside the chain go before the store takes a write (a
                    // later one's resume points could be misread once generations are
                    // handed out again, as a rejected checkpoint's).
                    super::delta::remove_except(&ctx.fs, &ctx.dir, &fc.chain)?;
                    let chain = ckpt_state.writing.get_mut();
                    chain.restart(fc.base_id, fc.base_point.clone());
                    chain.at = Some(fc.chain_end.clone());
                    chain.files = fc.chain.clone();
                    let FromCheckpoint { rep, tail, offs, superseded, live, puts, deletes, .. } = fc;
                    (rep, tail, Some((offs, superseded, live, puts, deletes)))
                }
                None => {
                    if rejected.is_some() || !delta_bytes.is_empty() {
                        // Removed before the store takes a write: generations may be handed out
                        // again from here on (a cleaned newest segment's), which an old resume
                        // point would misread.
                        Checkpoints::remove_stale(&ctx.fs, &ctx.dir)?;
                    }
                    let mut rep = replay_all(&region, &geo, &by_shard, clean.as_ref(), None)?;
                    let tail = std::mem::take(&mut rep.tail);
                    (rep, tail, None)
                }
            };
            Ok((rep, merged, base))
        })();
        let cold = match spawned {
            Ok(h) => {
                h.join().unwrap_or_else(|_| Err(Error::InvalidArgument("opening the capacity tier panicked".into())))
            }
            // No thread: open it here.
            Err(_) => open_cold(),
        };
        (cold, recovered)
    });
    let cold = cold?;
    let (rep, merged, base) = recovered?;
    ckpt_state.rejected = rejected;
    ckpt_state.delta_rejected = delta_rejected;
    ckpt_state.writing.get_mut().next_id = delta_files.iter().map(|f| f.0 + 1).max().unwrap_or(1);
    drop(delta_bytes);
    let AllReplayed { logs, seq_end, bytes, segs: seg_list, dropped, t_replay, .. } = rep;
    ctx.recovery.lock().extend(dropped);
    let t_replay = t_replay.duration_since(t0);
    // Live bytes per slot (of the newest entries; deletes kept count as live: the log
    // cleaner keeps them too), for the dead-byte counters of the cleaner. The checkpoint's
    // entries were counted in its pass.
    let (base, mut live_bytes, ckpt_puts, ckpt_deletes) = match base {
        Some((offs, sup, live, puts, deletes)) => (Some((offs, sup)), live, puts, deletes),
        None => (None, vec![0u64; region.pool_count() * geo.slots_per_pool as usize], 0, 0),
    };
    for (_, v, _) in &merged {
        if let Some(b) = live_bytes.get_mut(geo.slot_holding(v.1) as usize) {
            *b += u64::from(v.3);
        }
    }
    let keep_tombs = cold.nonempty();
    let mut keys = ckpt_puts;
    let live: Vec<LoadEntry<'_>> = merged
        .into_iter()
        .filter(|(_, v, _)| v.2 == Kind::Put || (v.2 == Kind::Delete && keep_tombs))
        .map(|(k, (seq, loc, kind, size), unverified)| (k, seq, loc, size, kind == Kind::Delete, unverified))
        .collect();
    keys += live.iter().filter(|e| !e.4).count() as u64;
    let t_sort = t0.elapsed();
    let index = Index::new();
    // The log tail's winners and the checkpoint's entries go into the maps in the
    // background (see "Background load" in `index`); until then lookups and new slots
    // consult them. (Inserting a long tail here took most of an open after a crash.)
    let (ckpt, ckpt_wanted) = match (base, ckpt_buf) {
        (Some((offs, sup)), Some(buf)) => {
            (Some((buf, offs, sup)), ckpt_puts + if keep_tombs { ckpt_deletes } else { 0 })
        }
        _ => (None, 0),
    };
    if ckpt_wanted > 0 || !live.is_empty() {
        index.set_base(Base::new(ckpt, ckpt_wanted as usize, &live, keep_tombs));
    }
    drop(live);
    let phases_us = [t_replay, t_sort - t_replay, t0.elapsed() - t_sort].map(|d| d.as_micros() as u64);
    if clean.is_some() {
        region.store_u64_atomic(layout::CLEAN_ADDR, 0)?;
        region.persist(layout::CLEAN_ADDR, 8);
    }
    let alloc = SlotAlloc::new(&geo, region.pool_count(), &used);
    let shards = logs.into_iter().map(|l| Shard { log: Mutex::new(l), marker: AtomicU64::new(IDLE) }).collect();
    let dead: Box<[std::sync::OnceLock<Box<[AtomicU64]>>]> =
        (0..crate::pm::MAX_POOLS).map(|_| std::sync::OnceLock::new()).collect();
    let mut segs = std::collections::BTreeMap::new();
    for (addr, tag, span, used, sealed) in seg_list {
        // Everything of a segment that is not a newest entry is dead: the segment's first
        // slot carries the count (the cleaner sums a segment's slots).
        let live: u64 = (0..span)
            .map(|i| live_bytes.get(geo.slot_holding(addr + i * geo.stride) as usize).copied().unwrap_or(0))
            .sum();
        let slot = geo.slot_holding(addr);
        let pool = (slot / geo.slots_per_pool) as usize;
        if let Some(arr) = dead.get(pool) {
            let arr = arr.get_or_init(|| (0..geo.slots_per_pool).map(|_| AtomicU64::new(0)).collect());
            if let Some(d) = arr.get((slot % geo.slots_per_pool) as usize) {
                d.store(used.saturating_sub(live), Ordering::Relaxed);
            }
        }
        segs.insert(addr, super::SegMeta { tag, span, sealed: sealed.then_some(used) });
    }
    Ok(Inner {
        region,
        geo,
        db_id: sb.db_id,
        shards,
        alloc: Mutex::new(alloc),
        segs: Mutex::new(segs),
        dead,
        index,
        next_seq: Padded(AtomicU64::new(seq_end)),
        published: Padded(AtomicU64::new(seq_end - 1)),
        oldest_snap: Padded(AtomicU64::new(u64::MAX)),
        snaps: Snaps::default(),
        poison,
        closed: Default::default(),
        counters: Default::default(),
        gc_counters: Default::default(),
        cleaning: Default::default(),
        keys_at_open: keys,
        recovery_us: t0.elapsed().as_micros() as u64,
        recovery_phases_us: phases_us,
        replayed_bytes: bytes,
        verify_reads: ctx.opts.native.verify_reads,
        cold,
        dram_budget: ctx.opts.native.dram_budget,
        pm_watermark: ctx.opts.native.pm_watermark,
        background: ctx.opts.native.background,
        wake: Mutex::new(false),
        wake_cv: parking_lot::Condvar::new(),
        stop: AtomicBool::new(false),
        ckpt: ckpt_state,
        load_us: AtomicU64::new(0),
        probe: ctx.opts.job_probe.clone(),
    })
}

/// Replay shard `id`'s segments (ordered by generation): the newest entry of every key.
fn replay_shard<'a>(
    region: &'a Region,
    g: &Geometry,
    id: usize,
    segs: &[Seg],
    clean: Option<&Clean>,
    from: Option<checkpoint::Resume>,
) -> Result<Replayed<'a>> {
    // Generations stay above the checkpoint's resume point even when the newest segments
    // were cleaned since (else a new segment could get a generation the resume point
    // skips).
    let next_gen = segs.last().map_or(1, |s| s.tag.gen + 1).max(from.map_or(0, |f| f.gen + 1));
    let mut out = Replayed { next_gen, ..Replayed::default() };
    let tail = clean.and_then(|c| c.tails.get(id).copied());
    for (i, seg) in segs.iter().enumerate() {
        let newest = i + 1 == segs.len();
        // After a checkpoint: segments before its resume point are not read (a sealed
        // one: only every shard's newest can be unsealed, and the resume point's segment
        // is at most that), the resume point's segment from its offset on.
        let start = match from {
            Some(f) if seg.tag.gen < f.gen && seg.sealed.is_some() => {
                let used = u64::from(seg.sealed.unwrap_or(0));
                out.segs.push((seg.addr, seg.tag, u64::from(seg.span), used, true));
                continue;
            }
            Some(f) if seg.tag.gen == f.gen => f.seg.map_or(0, |(_, len)| len as usize),
            _ => 0,
        };
        let limit = match seg.sealed {
            Some(l) => Some(l as usize),
            None if !newest => {
                return Err(region.corruption(seg.addr, "an unsealed segment is not its shard's newest"));
            }
            None => match tail {
                Some(t) if t.gen == seg.tag.gen => Some(t.len as usize),
                Some(t) => {
                    return Err(region.corruption(
                        seg.addr,
                        format!("the clean-close record ends shard {id} in generation {}, not {}", t.gen, seg.tag.gen),
                    ))
                }
                None => None,
            },
        };
        let cap = g.capacity(u64::from(seg.span));
        let base = seg.addr + SEG_HEADER_LEN;
        let data = region.slice_checked(base, cap as usize, "segment")?;
        if start > limit.unwrap_or(data.len()) {
            return Err(region.corruption(
                seg.addr,
                format!("the index checkpoint resumes shard {id} at byte {start}, past the segment's records"),
            ));
        }
        let (end, how) = scan(data, start, seg.tag, limit, &mut |rec, e| {
            let loc = base + (rec + e.offset) as u64;
            out.seq_end = out.seq_end.max(e.seq.saturating_add(1));
            let size = layout::entry_len(e.key.len(), e.value.len()) as u32;
            let v = (e.seq, loc, e.kind, size);
            // The key's head is taken now, while the key is in the cache (the merge sorts
            // by it).
            let n = &mut out.newest.entry(e.key).or_insert_with(|| (super::index::head(e.key), v)).1;
            if newer(&v, n) {
                *n = v;
            }
        });
        out.bytes += (end - start) as u64;
        match how {
            End::Complete => {}
            End::Torn => out.dropped.push(Dropped {
                file: region.locate(base + end as u64).0,
                offset: region.locate(base + end as u64).1,
                len: cap - end as u64,
                reason: DropReason::TornTail,
            }),
            End::Damaged(d) => return Err(region.corruption(base + end as u64, d)),
        }
        if newest && seg.sealed.is_none() {
            out.open = Some(OpenSeg { addr: seg.addr, tag: seg.tag, len: end as u64, cap });
        }
        out.segs.push((seg.addr, seg.tag, u64::from(seg.span), end as u64, seg.sealed.is_some()));
    }
    Ok(out)
}

/// Decide the keys the replayed log tails (sorted, newest entry per key) share with the
/// checkpoint, as argued in [`super::checkpoint`]: the larger sequence number wins; on a
/// tie the tail's (a copy at a new place, or the moved entry); a tail put or delete
/// numbered below `horizon` of a key the checkpoint does not have is a copy of a version
/// that was not the key's newest, and is dropped. A checkpoint entry (`offs`: where each
/// starts in the checkpoint's bytes `buf`) that a tail entry beats is *superseded*; one
/// that beats the tail entry stays (loaded later, unverified: its record was not
/// replayed).
///
/// Returns the tail entries that win (sorted), the superseded entries' indexes
/// (ascending), and how many tail entries the horizon rule dropped. Both are sorted by
/// key, so each tail entry is searched for from where the previous one was found, with
/// steps that double and then halve (a galloping merge): a long tail costs about one pass
/// over the checkpoint's entries rather than a whole binary search per entry. The
/// checkpoint's entries are not copied.
fn overlay_tail<'a>(buf: &[u8], offs: &[u64], tail: Merged<'a>, horizon: u64) -> (Merged<'a>, Vec<usize>, u64) {
    let key_at = |o: u64| {
        usize::try_from(o).ok().and_then(|at| checkpoint::entry_at(buf, at).ok()).map_or((&[][..], 0), |e| (e.0, e.1))
    };
    let mut out = Vec::with_capacity(tail.len());
    let mut superseded = Vec::new();
    let mut dropped = 0u64;
    // Every entry of `offs` below `lo` has a key below the next tail entry's.
    let mut lo = 0usize;
    for te in tail {
        // Gallop from `lo` to an entry whose key is not below this one's, then search
        // the bracket: the first such entry lies in `from..=to`.
        let (mut from, mut probe, mut step) = (lo, lo, 1usize);
        while probe < offs.len() && key_at(offs[probe]).0 < te.0 {
            from = probe + 1;
            probe = probe.saturating_add(step);
            step = step.saturating_mul(2);
        }
        let to = probe.min(offs.len());
        let i = from + offs[from..to].partition_point(|&o| key_at(o).0 < te.0);
        lo = i;
        let found = if i < offs.len() && key_at(offs[i]).0 == te.0 { Ok(i) } else { Err(i) };
        match found {
            Ok(i) => {
                if key_at(offs[i]).1 > te.1 .0 {
                    continue;
                }
                superseded.push(i);
                out.push(te);
            }
            Err(_) if te.1 .0 < horizon && te.1 .2 != Kind::Moved => dropped += 1,
            Err(_) => out.push(te),
        }
    }
    (out, superseded, dropped)
}

/// Every delta file of the store's directory (see [`super::delta`]), by id.
fn read_deltas(ctx: &EngineCtx) -> Result<Vec<(u64, checkpoint::FileBytes)>> {
    let mut out = Vec::new();
    for id in super::delta::list(&ctx.fs, &ctx.dir)? {
        out.push((id, checkpoint::read_file(&ctx.fs, &ctx.dir.join(super::delta::file_name(id)))?));
    }
    Ok(out)
}

/// Why an open does not use what it found.
enum Reject {
    /// The checkpoint (the logs are replayed whole).
    Checkpoint(String),
    /// The chain of deltas (the checkpoint alone is tried).
    Chain(String),
}

/// Two layers of newest entries merged, each sorted by key: of a key in both, `newer`'s
/// entry wins unless `older`'s is newer by [`newer`] (on a tie, `newer`'s is the copy at a
/// later place).
fn merge_layers<'a>(older: Merged<'a>, newer_layer: Merged<'a>) -> Merged<'a> {
    if older.is_empty() {
        return newer_layer;
    }
    if newer_layer.is_empty() {
        return older;
    }
    let mut out = Vec::with_capacity(older.len() + newer_layer.len());
    let mut a = older.into_iter().peekable();
    let mut b = newer_layer.into_iter().peekable();
    loop {
        let take_a = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) => match x.0.cmp(y.0) {
                std::cmp::Ordering::Less => true,
                std::cmp::Ordering::Greater => false,
                std::cmp::Ordering::Equal => {
                    let (x, y) = (a.next(), b.next());
                    if let (Some(x), Some(y)) = (x, y) {
                        out.push(if newer(&x.1, &y.1) { x } else { y });
                    }
                    continue;
                }
            },
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => break,
        };
        out.extend(if take_a { a.next() } else { b.next() });
    }
    out
}

/// What an open from a checkpoint found.
struct FromCheckpoint<'a> {
    /// The replay of the log tails after the resume points.
    rep: AllReplayed<'a>,
    /// The tail entries that win over the checkpoint (sorted by key; verified).
    tail: Merged<'a>,
    /// Where each checkpoint entry starts in the file's bytes (key order).
    offs: Vec<u64>,
    /// Indexes of the checkpoint entries the tail decided (ascending).
    superseded: Vec<usize>,
    /// Live bytes per segment slot of the checkpoint entries not superseded.
    live: Vec<u64>,
    /// Of those entries: puts, deletes.
    puts: u64,
    deletes: u64,
    /// Tail entries the horizon rule dropped.
    stale: u64,
    /// The checkpoint, and the point of the logs it was written at.
    base_id: super::delta::BaseId,
    base_point: super::delta::Point,
    /// The deltas used (ids, oldest first), their entries, and where the chain ends.
    chain: Vec<u64>,
    /// Why delta files were left out of the chain, if any were.
    chain_why: Option<String>,
    delta_entries: u64,
    chain_end: super::delta::Point,
}

/// Recover from the checkpoint file `buf` and the chain of delta files it has among
/// `deltas` ([`super::delta`]): verify them, replay the tails after the chain's end (the
/// checkpoint's resume points when there is no delta), merge the deltas' entries and the
/// tails' (later wins: [`merge_layers`]), then in one pass over the checkpoint's entries
/// note where each starts, check it lies within a segment's records and count its live
/// bytes; then decide the keys the deltas and tails share with it ([`overlay_tail`]).
/// `Ok(Err(Reject::Checkpoint))` when the checkpoint does not fit the logs (its checks,
/// damage met only because of where it resumed, an entry outside every segment): the
/// caller then replays the logs whole; `Ok(Err(Reject::Chain))` when the chain does not
/// fit them (the caller then tries the checkpoint alone).
fn with_checkpoint<'a>(
    buf: &[u8],
    deltas: &[(u64, &'a [u8])],
    region: &'a Region,
    geo: &Geometry,
    db_id: u64,
    by_shard: &[Vec<Seg>],
    clean: Option<&Clean>,
) -> Result<std::result::Result<FromCheckpoint<'a>, Reject>> {
    let v = match checkpoint::verify(buf, by_shard.len(), db_id) {
        Ok(v) => v,
        Err(why) => return Ok(Err(Reject::Checkpoint(why))),
    };
    if let Err(why) = fits(&v.header, by_shard, clean) {
        return Ok(Err(Reject::Checkpoint(why)));
    }
    let base_id = super::delta::BaseId { horizon: v.header.horizon, count: v.count, crc: v.body_crc };
    let base_point = super::delta::Point { horizon: v.header.horizon, resume: v.header.resume.clone() };
    let (chain, chain_why) = super::delta::chain_of(deltas, by_shard.len(), db_id, base_id, &base_point);
    let chain_end = chain.last().map_or_else(|| base_point.clone(), |c| c.2.header.to.clone());
    let end_header = checkpoint::Header { db_id, horizon: chain_end.horizon, resume: chain_end.resume.clone() };
    if let Err(why) = fits(&end_header, by_shard, clean) {
        return Ok(Err(Reject::Chain(format!("its end: {why}"))));
    }
    // The deltas' entries, one layer per delta, oldest first (unverified: their records
    // were not replayed).
    let mut layers: Merged<'a> = Vec::new();
    let mut delta_entries = 0u64;
    for (id, dbuf, dv) in &chain {
        let mut layer: Merged<'a> = Vec::with_capacity(usize::try_from(dv.count).unwrap_or(0).min(dbuf.len() / 25));
        let r = super::delta::for_each_entry(dbuf, dv, |(k, seq, loc, size, flags)| {
            layer.push((k, (seq, loc, super::delta::kind_of(flags), size), true));
        });
        if let Err(why) = r {
            return Ok(Err(Reject::Chain(format!("{}: {why}", super::delta::file_name(*id)))));
        }
        delta_entries += layer.len() as u64;
        layers = merge_layers(layers, layer);
    }
    let chain: Vec<u64> = chain.iter().map(|c| c.0).collect();
    let mut rep = match replay_all(region, geo, by_shard, clean, Some(&chain_end.resume)) {
        Ok(r) => r,
        // Damage met only because of where the checkpoint (or the chain) resumed (an
        // offset that is not a record boundary): it is of another state of the logs
        // (damage in the logs themselves fails the whole replay too, as without
        // checkpoints).
        Err(e) if e.is_corruption() && !chain.is_empty() => {
            return Ok(Err(Reject::Chain(format!("its end does not fit the logs: {e}"))))
        }
        Err(e) if e.is_corruption() => {
            return Ok(Err(Reject::Checkpoint(format!("its resume points do not fit the logs: {e}"))))
        }
        Err(e) => return Err(e),
    };
    rep.tail = merge_layers(layers, std::mem::take(&mut rep.tail));
    let ranges = record_ranges(&rep.segs, geo, region.pool_count());
    let cap = usize::try_from(v.count).unwrap_or(0).min(buf.len() / checkpoint::ENTRY_FIXED);
    let mut offs: Vec<u64> = Vec::with_capacity(cap);
    let mut live = vec![0u64; ranges.len()];
    let (mut puts, mut deletes) = (0u64, 0u64);
    // Entries outside every segment's records: the checkpoint does not fit, unless the
    // tail supersedes them (a location in a segment cleaned and reused since).
    let mut misfits = Vec::new();
    let pass = checkpoint::for_each_entry(buf, &v, |at, (_, _, loc, size, tomb)| {
        let slot = geo.slot_holding(loc) as usize;
        let (lo, hi) = ranges.get(slot).copied().unwrap_or((0, 0));
        if loc < lo || loc.saturating_add(u64::from(size)) > hi {
            misfits.push(offs.len());
        } else if let Some(l) = live.get_mut(slot) {
            *l += u64::from(size);
        }
        if tomb {
            deletes += 1;
        } else {
            puts += 1;
        }
        offs.push(at as u64);
    });
    if let Err(why) = pass {
        return Ok(Err(Reject::Checkpoint(why)));
    }
    let (tail, superseded, stale) = overlay_tail(buf, &offs, std::mem::take(&mut rep.tail), v.header.horizon);
    if let Some(&i) = misfits.iter().find(|i| superseded.binary_search(i).is_err()) {
        let e = offs.get(i).and_then(|&o| checkpoint::entry_at(buf, o as usize).ok());
        let (key, loc) = e.map_or((&[][..], 0), |e| (e.0, e.2));
        let why = format!("key {}: its entry at {loc:#x} lies outside every segment's records", crate::escape(key));
        // With a chain, a delta may be what superseded the misfit in a run that worked:
        // the checkpoint alone decides.
        return Ok(Err(if chain.is_empty() { Reject::Checkpoint(why) } else { Reject::Chain(why) }));
    }
    // Every winning delta entry must lie within a segment's records (see `delta`: one
    // that was cleaned since always loses).
    if let Some(e) = tail.iter().find(|e| {
        e.2 && e.1 .2 != Kind::Moved && {
            let (lo, hi) = ranges.get(geo.slot_holding(e.1 .1) as usize).copied().unwrap_or((0, 0));
            e.1 .1 < lo || e.1 .1.saturating_add(u64::from(e.1 .3)) > hi
        }
    }) {
        return Ok(Err(Reject::Chain(format!(
            "key {}: its delta entry at {:#x} lies outside every segment's records",
            crate::escape(e.0),
            e.1 .1
        ))));
    }
    // The superseded entries are neither live nor counted.
    for &i in &superseded {
        let Some(e) = offs.get(i).and_then(|&o| checkpoint::entry_at(buf, o as usize).ok()) else { continue };
        if misfits.binary_search(&i).is_err() {
            if let Some(l) = live.get_mut(geo.slot_holding(e.2) as usize) {
                *l = l.saturating_sub(u64::from(e.3));
            }
        }
        if e.4 {
            deletes -= 1;
        } else {
            puts -= 1;
        }
    }
    rep.seq_end = rep.seq_end.max(v.header.horizon).max(chain_end.horizon);
    Ok(Ok(FromCheckpoint {
        rep,
        tail,
        offs,
        superseded,
        live,
        puts,
        deletes,
        stale,
        base_id,
        base_point,
        chain,
        chain_why,
        delta_entries,
        chain_end,
    }))
}

/// Whether a checkpoint's header fits the logs found: its horizon is not beyond the
/// clean-close record's next number, and where a shard still has the segment its resume
/// point names, it is that segment (same salt) and long enough. A checkpoint of another
/// state of the store (files restored without the PM pools they belong to) fails here.
fn fits(h: &checkpoint::Header, by_shard: &[Vec<Seg>], clean: Option<&Clean>) -> std::result::Result<(), String> {
    if let Some(c) = clean {
        if h.horizon > c.next_seq {
            return Err(format!("horizon {} beyond the logs' next sequence number {}", h.horizon, c.next_seq));
        }
    }
    for (i, (r, segs)) in h.resume.iter().zip(by_shard).enumerate() {
        let Some((salt, len)) = r.seg else { continue };
        if let Some(s) = segs.iter().find(|s| s.tag.gen == r.gen) {
            if s.tag.salt != salt {
                return Err(format!("shard {i}: its segment of generation {} is another segment", r.gen));
            }
            let end = s.sealed.or_else(|| clean.and_then(|c| c.tails.get(i)).filter(|t| t.gen == r.gen).map(|t| t.len));
            if end.is_some_and(|l| l < len) {
                return Err(format!("shard {i}: resumes at byte {len}, past the end of its segment"));
            }
        }
    }
    Ok(())
}

/// What replaying every shard found.
struct AllReplayed<'a> {
    logs: Vec<ShardLog>,
    /// One past the highest sequence number seen (or the clean-close record's).
    seq_end: u64,
    bytes: u64,
    /// The newest entry of every key in the replayed records, sorted by key (`false`:
    /// verified).
    tail: Vec<(&'a [u8], Newest, bool)>,
    /// Every segment: address, tag, span, bytes of records, sealed.
    segs: Vec<(u64, layout::SegTag, u64, u64, bool)>,
    dropped: Vec<Dropped>,
    /// When the replay (before the merge of the shards' maps) ended.
    t_replay: Instant,
}

/// Replay every shard (from the checkpoint's resume points when given) in parallel, one
/// worker per hardware thread, and merge the shards' newest entries.
fn replay_all<'a>(
    region: &'a Region,
    geo: &Geometry,
    by_shard: &[Vec<Seg>],
    clean: Option<&Clean>,
    resume: Option<&[checkpoint::Resume]>,
) -> Result<AllReplayed<'a>> {
    let nshards = by_shard.len();
    let results: Mutex<Vec<Option<Result<Replayed<'a>>>>> = Mutex::new((0..nshards).map(|_| None).collect());
    let next = AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).min(nshards).max(1);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(segs) = by_shard.get(i) else { break };
                let from = resume.and_then(|r| r.get(i).copied());
                let r = replay_shard(region, geo, i, segs, clean, from);
                if let Some(slot) = results.lock().get_mut(i) {
                    *slot = Some(r);
                }
            });
        }
    });
    let mut out = AllReplayed {
        logs: Vec::with_capacity(nshards),
        seq_end: clean.map_or(1, |c| c.next_seq).max(1),
        bytes: 0,
        tail: Vec::new(),
        segs: Vec::new(),
        dropped: Vec::new(),
        t_replay: Instant::now(),
    };
    let mut maps = Vec::with_capacity(nshards);
    for (i, r) in results.into_inner().into_iter().enumerate() {
        let r = r.ok_or_else(|| Error::InvalidArgument("a recovery worker did not report".into()))??;
        out.seq_end = out.seq_end.max(r.seq_end);
        out.bytes += r.bytes;
        out.dropped.extend(r.dropped);
        out.logs.push(ShardLog { id: i as u32, open: r.open, next_gen: r.next_gen, writes: 0 });
        maps.push(r.newest);
        out.segs.extend(r.segs);
    }
    out.t_replay = Instant::now();
    // Merge by sorting: every shard's entries in one array, sorted by key with each key's
    // head inline (the keys lie in PM one record apart: a sort comparing them in place
    // took a cache miss per comparison, most of the merge after a crash with a 240 MB
    // tail), then the newest entry of each key kept.
    let mut keyed: Vec<((u64, u64), &'a [u8], Newest)> = Vec::with_capacity(maps.iter().map(|m| m.len()).sum());
    for m in maps {
        keyed.extend(m.into_iter().map(|(k, (h, v))| (h, k, v)));
    }
    keyed.sort_unstable_by(|a, b| super::index::cmp_keys(a.0, a.1, b.0, b.1));
    let mut tail: Merged<'a> = Vec::with_capacity(keyed.len());
    for (_, k, v) in keyed {
        match tail.last_mut() {
            Some(last) if last.0 == k => {
                if newer(&v, &last.1) {
                    last.1 = v;
                }
            }
            _ => tail.push((k, v, false)),
        }
    }
    out.tail = tail;
    Ok(out)
}

/// Per segment slot, the byte range of its segment's records (`(0, 0)`: no segment).
fn record_ranges(segs: &[(u64, layout::SegTag, u64, u64, bool)], geo: &Geometry, pools: usize) -> Vec<(u64, u64)> {
    let mut ranges = vec![(0u64, 0u64); pools * geo.slots_per_pool as usize];
    for &(addr, _, span, used, _) in segs {
        let base = addr + SEG_HEADER_LEN;
        for i in 0..span {
            if let Some(r) = ranges.get_mut(geo.slot_holding(addr + i * geo.stride) as usize) {
                *r = (base, base + used);
            }
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The plain form of [`overlay_tail`]: a whole binary search per tail entry.
    fn overlay_reference<'a>(
        buf: &[u8],
        offs: &[u64],
        tail: Merged<'a>,
        horizon: u64,
    ) -> (Merged<'a>, Vec<usize>, u64) {
        let key_at = |o: u64| checkpoint::entry_at(buf, o as usize).map(|e| (e.0, e.1)).unwrap();
        let (mut out, mut sup, mut dropped) = (Vec::new(), Vec::new(), 0);
        for te in tail {
            match offs.binary_search_by(|&o| key_at(o).0.cmp(te.0)) {
                Ok(i) if key_at(offs[i]).1 > te.1 .0 => {}
                Ok(i) => {
                    sup.push(i);
                    out.push(te);
                }
                Err(_) if te.1 .0 < horizon && te.1 .2 != Kind::Moved => dropped += 1,
                Err(_) => out.push(te),
            }
        }
        (out, sup, dropped)
    }

    proptest! {
        /// The galloping merge decides every tail entry as a binary search would, over
        /// checkpoints and tails of any overlap (keys of 0 to 20 bytes, so the sort's
        /// inline heads tie and differ in length too).
        #[test]
        fn overlay_gallops_to_the_same_decisions(
            ckpt in proptest::collection::btree_map(proptest::collection::vec(0u8..4, 0..20), 1u64..100, 0..300),
            tail in proptest::collection::btree_map(proptest::collection::vec(0u8..4, 0..20), (1u64..100, any::<bool>()), 0..300),
            horizon in 0u64..100,
        ) {
            let mut buf = Vec::new();
            let mut offs = Vec::new();
            for (k, &seq) in &ckpt {
                offs.push(buf.len() as u64);
                checkpoint::encode_entry(&mut buf, k, seq, 4096, 64, false);
            }
            // The tail as replay sorts it: by head, then by key.
            let mut t: Vec<((u64, u64), &[u8], Newest)> = tail
                .iter()
                .map(|(k, &(seq, moved))| {
                    (super::super::index::head(k), &k[..], (seq, 0, if moved { Kind::Moved } else { Kind::Put }, 64))
                })
                .collect();
            t.reverse();
            t.sort_unstable_by(|a, b| super::super::index::cmp_keys(a.0, a.1, b.0, b.1));
            let merged: Merged<'_> = t.into_iter().map(|(_, k, v)| (k, v, false)).collect();
            let keys: Vec<&[u8]> = merged.iter().map(|e| e.0).collect();
            prop_assert!(keys.windows(2).all(|w| w[0] < w[1]), "the head sort is the keys' byte order");
            let got = overlay_tail(&buf, &offs, merged.clone(), horizon);
            let want = overlay_reference(&buf, &offs, merged, horizon);
            prop_assert_eq!(got.1, want.1);
            prop_assert_eq!(got.2, want.2);
            prop_assert_eq!(got.0, want.0);
        }
    }
}
