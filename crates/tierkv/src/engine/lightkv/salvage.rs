//! Salvage of a `lightkv` store for `tierkv repair` ([`crate::repair`]): a read-only walk of
//! the persistent write buffer (PWB), the chain records and PM leaves, and the SSTables,
//! that hands every intact record to the sink with an [`Order`] under which the newest
//! version of each key wins, exactly as recovery and reads decide it.
//!
//! # What is walked
//! - **PM** through the region ([`open_region`]; nothing is written). When the region does
//!   not open (a damaged pool header, or an unknown store identity), the pool files are read
//!   as they stand and every pool whose header fails is reported lost (without a key): its
//!   contents are still walked, record by record, under their own checksums. A pool whose
//!   intact header names another store is not read.
//! - **PWB segments**: the segment directory's live slots (`id ≠ 0`) whose header carries
//!   the slot's id. Every record whose checksum verifies *for that segment id* is kept; a
//!   record of an earlier segment left in a recycled extent never verifies (its crc was taken
//!   with another id), so freed and recycled space is never read as live data. Freed
//!   segments are not walked. A bad record followed by a good one is damage; so is a bad
//!   record before the segment's write position when the clean-shutdown image gives it
//!   (without the image, see [`tail_record`]).
//! - **Chains and PM leaves**: every chain slot's record (the partition's descriptor and its
//!   PM leaves, newest first) and each leaf's header (its table, compaction weight and
//!   `seq_hi`). A leaf is the index of its table, nothing more: when its checksum fails,
//!   the leaf is rebuilt from its table exactly as a flush or compaction built it
//!   ([`store::pm_leaf_of`]) and its header is trusted when the rebuilt leaf reproduces the
//!   stored header and checksum (the damage was in the buckets: nothing is lost).
//! - **SSTables** named by the leaves, through the shared [`salvage_sstable`].
//!
//! The clean-shutdown image (written by a clean close, cleared by open) holds no data; it is
//! used only as evidence: it lists every live segment with its write position (so a damaged
//! last record, and a directory slot that no longer names its segment, are told apart from
//! the end of the log and from a damaged empty slot), and its top leaves carry a 29-bit
//! signature of the key at every PWB entry they index, which names the key of a damaged
//! entry. A verified PM leaf does the same for the keys of a damaged table block.
//!
//! # Order (the newest version wins)
//! Recovery replays the PWB records of each partition *above* its newest PM leaf's `seq_hi`
//! in sequence order, over the partition's tables, searched newest leaf first; records at
//! or below `seq_hi` are skipped (each is in a table or superseded by one that is).
//! - A PWB entry: `2 << 96 | seq << 32 | entry index` (later entries of one batch win). An
//!   entry of a key whose partition has a chain is skipped when `seq ≤ seq_hi` of the
//!   chain's newest leaf, as recovery skips it: such a record can be older than the key's
//!   table version, and its delete may have been dropped by a compaction that reached the
//!   partition's oldest table, so reporting it could resurrect or roll back the key.
//! - A table entry: `1 << 96 | seq_hi << 32 | (2³² − 1 − chain position)`, the `seq_hi` made
//!   non-increasing along the chain (it is, for intact leaves); tables are below every PWB
//!   entry, and in chain order within a partition (partitions hold disjoint keys).
//! - A table no chain names is an orphan of a crash between a table's write and its commit,
//!   or between a compaction's commit and the removal of its inputs: recovery deletes it and
//!   so does salvage ignore it, unless a chain or leaf could not be read. Then such tables
//!   are salvaged too (they may be the unreadable chain's): ordered by the `seq_hi` of a
//!   verifying PM leaf naming them if the heap still holds one, else below every other
//!   table by table number.
//!
//! # What cannot be recovered (reported, never hidden)
//! - A damaged PWB record is dropped whole (a batch is atomic); each of its entries is
//!   reported with its key when the entry's own checksum verifies or the image names it,
//!   otherwise one key-less [`Lost`] covers the bytes.
//! - A damaged table block loses its entries; each key the table's PM leaf confirms (29-bit
//!   signature at the entry's exact slot) is reported, and the block without keys unless
//!   the leaf accounts for every missing entry. Damage in a table's index or footer loses
//!   nothing when the blocks found by their checksums hold every entry the leaf names (and
//!   only those are kept).
//! - A chain record that does not verify: the partition's descriptor and leaves are
//!   unknown. The heap is searched for an intact older record of a partition no other chain
//!   holds (adopted when all its leaves and tables are intact); its PWB records are then
//!   judged by that record's `seq_hi`, or by none. Reported without a key.
//! - A PM leaf whose header cannot be verified: its table is read as the header names it,
//!   and the chain's coverage bound falls back to a plausible header value or the newest
//!   verified older leaf's (reported without a key: older values may come back).
//! - Without a clean-shutdown image (after a crash), a damaged last record of a segment
//!   looks like a write torn by the crash: it is reported (a torn write, never acknowledged,
//!   is reported with it) when its header still looks like the segment's next write or its
//!   entries still verify, and it verifies as no earlier segment's record. Damage that
//!   garbles both its sequence number and its entries passes for a torn write, as it does
//!   for recovery.
//! - A segment whose header is damaged is walked with its directory slot's id (records
//!   verify with it); a directory slot that no longer names its segment is resolved by the
//!   image's segment list, else by the segment header carrying the slot's id or at the
//!   slot's address (reported without a key: without the image it is a guess).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use super::leaf::{self, Image, LeafMeta, CHAIN_MAGIC, IMAGE_HEADER, LEAF_HEADER, LEAF_MAGIC};
use super::pwb::{self, Kind};
use super::store::{
    self, CHAIN_DIR_ADDR, CHAIN_SLOTS, DIR_ADDR, HEAP_START, ID_COUNTER_ADDR, IMAGE_PTR_ADDR, SEG_SLOTS, SLOT_LEN,
    SUPERBLOCK_ADDR,
};
use crate::engine::{open_region, EngineCtx};
use crate::error::{Error, Result};
use crate::format::crc;
use crate::fs::Fs;
use crate::index::rhtree::{Leaf, PartitionDesc};
use crate::pm::{encode_pool_header, Region, POOL_HEADER_LEN};
use crate::repair::{salvage_sstable, Lost, Order, SalvageSink};
use crate::sstable;

/// Walk the store read-only and report every intact record and every damaged one.
pub(crate) fn salvage(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<()> {
    walk(ctx, sink).map(|_| ())
}

/// What a walk saw (for tests).
#[derive(Debug, Default)]
#[cfg_attr(not(test), allow(dead_code))]
struct Walked {
    /// PWB segments walked.
    segments: u64,
    /// SSTables walked.
    tables: u64,
    /// PWB entries skipped because a flush covered them (as recovery skips them).
    covered: u64,
    /// Those entries: (key, value or delete, order) — tests check that reporting them
    /// would roll keys back or resurrect them.
    #[cfg(test)]
    covered_entries: Vec<(Vec<u8>, Option<Vec<u8>>, Order)>,
}

fn walk(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<Walked> {
    let mut out = Walked::default();
    let pm = open_pm(ctx, sink);
    let mut chains: Vec<ChainRef> = Vec::new();
    let mut recs: Vec<PwbRec<'_>> = Vec::new();
    // Without PM nothing says which tables are current: all of them are salvaged.
    let mut incomplete = pm.is_none();
    if let Some(pm) = &pm {
        let image = load_image(pm);
        recs = walk_pwb(pm, image.as_ref(), sink, &mut out);
        incomplete |= read_chains(ctx, pm, &mut chains, sink);
    }
    let max_seq = recs.iter().map(|r| r.seq).max().unwrap_or(0);
    let mut claimed: HashSet<u64> = HashSet::new();
    let mut unknown: Vec<(usize, usize, u64)> = Vec::new();
    if let Some(pm) = &pm {
        salvage_chain_tables(ctx, pm, &mut chains, max_seq, &mut claimed, &mut unknown, sink, &mut out)?;
    }
    incomplete |= !unknown.is_empty();
    let cov = Coverage::new(&chains);
    for r in &recs {
        if cov.covers(r.key, r.seq) {
            out.covered += 1;
            #[cfg(test)]
            out.covered_entries.push((
                r.key.to_vec(),
                (r.kind == Kind::Put).then(|| r.value.to_vec()),
                pwb_order(r.seq, r.idx),
            ));
            continue;
        }
        sink.record(r.key, (r.kind == Kind::Put).then_some(r.value), pwb_order(r.seq, r.idx));
    }
    if incomplete {
        salvage_unclaimed_tables(ctx, pm.as_ref(), &chains, &claimed, &unknown, sink, &mut out)?;
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Orders.

/// PWB entries rank above every table entry.
const PWB_CLASS: Order = 2 << 96;
/// Table entries of a chain (or of a table a PM leaf in the heap dates) rank above tables
/// dated by nothing but their number.
const TABLE_CLASS: Order = 1 << 96;

fn pwb_order(seq: u64, idx: usize) -> Order {
    PWB_CLASS | Order::from(seq) << 32 | (idx as Order & 0xffff_ffff)
}

fn table_order(seq_hi: u64, pos: usize) -> Order {
    TABLE_CLASS | Order::from(seq_hi) << 32 | (0xffff_ffff - (pos as Order).min(0xffff_ffff))
}

// ---------------------------------------------------------------------------------------
// PM access: the mapped region, or the pool files' bytes when it does not open.

enum Pm {
    Mapped(Region),
    Raw { pools: Vec<(PathBuf, Vec<u8>)>, size: u64 },
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn le64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

impl Pm {
    fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        match self {
            Pm::Mapped(r) => r.slice(addr, len),
            Pm::Raw { pools, size } => {
                let i = usize::try_from(addr / size).ok()?;
                let off = usize::try_from(addr % size).ok()?;
                pools.get(i)?.1.get(off..off.checked_add(len)?)
            }
        }
    }

    fn word(&self, addr: u64) -> Option<u64> {
        le64(self.slice(addr, 8)?, 0)
    }

    fn pool_count(&self) -> usize {
        match self {
            Pm::Mapped(r) => r.pool_count(),
            Pm::Raw { pools, .. } => pools.len(),
        }
    }

    fn pool_size(&self) -> u64 {
        match self {
            Pm::Mapped(r) => r.pool_size(),
            Pm::Raw { size, .. } => *size,
        }
    }

    /// A [`Lost`] at PM address `addr`, named by pool file and offset as the preset's
    /// corruption errors name it.
    fn lost(&self, addr: u64, key: Option<Vec<u8>>, detail: String) -> Lost {
        let (file, offset) = match self {
            Pm::Mapped(r) => r.locate(addr),
            Pm::Raw { pools, size } => {
                let i = (addr / size) as usize;
                let file = pools.get(i).map_or_else(|| PathBuf::from(format!("<pm>/pool-{i:06}")), |(p, _)| p.clone());
                (file, addr % size)
            }
        };
        Lost { file, offset, key, detail }
    }

    /// Every 64-byte line of the PM heaps (every PM object starts on one) whose bytes
    /// start with `magic`.
    fn lines_starting_with(&self, magic: &[u8]) -> Vec<u64> {
        let size = self.pool_size();
        let mut out = Vec::new();
        for i in 0..self.pool_count() as u64 {
            let start = if i == 0 { HEAP_START } else { i * size + POOL_HEADER_LEN };
            let end = (i + 1) * size;
            let Some(b) = end.checked_sub(start).and_then(|n| self.slice(start, n as usize)) else { continue };
            for (j, line) in b.chunks(64).enumerate() {
                if line.starts_with(magic) {
                    out.push(start + 64 * j as u64);
                }
            }
        }
        out
    }
}

fn pm_dir(ctx: &EngineCtx) -> PathBuf {
    ctx.opts.pm_path.clone().unwrap_or_else(|| ctx.dir.join("pm"))
}

/// The store's PM: the region, or (when it does not open) the pool files as they stand.
fn open_pm(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Option<Pm> {
    let err = match open_region(ctx) {
        Ok(r) => return Some(Pm::Mapped(r)),
        Err(e) => e,
    };
    let (efile, eoff, edetail) = match &err {
        Error::Corruption { file, offset, detail } => (file.clone(), *offset, detail.clone()),
        e => (pm_dir(ctx).join("pool-000000"), 0, e.to_string()),
    };
    let mut images: Vec<(PathBuf, Vec<u8>)> = Vec::new();
    match &ctx.opts.pm_device {
        Some(dev) => {
            for i in 0..dev.pool_count() {
                let Some(b) = dev.durable_image(i) else { break };
                images.push((PathBuf::from(format!("<sim>/pool-{i:06}")), b));
            }
        }
        None => {
            let dir = pm_dir(ctx);
            for i in 0.. {
                let p = dir.join(format!("pool-{i:06}"));
                if !p.exists() {
                    break;
                }
                match std::fs::read(&p) {
                    Ok(b) => images.push((p, b)),
                    Err(e) => {
                        sink.lost(Lost {
                            file: p,
                            offset: 0,
                            key: None,
                            detail: format!("PM pool cannot be read ({e}): it and every later pool are lost"),
                        });
                        break;
                    }
                }
            }
        }
    }
    let size = images.first().map_or(0, |p| p.1.len() as u64);
    if !size.is_power_of_two() || size <= HEAP_START {
        sink.lost(Lost {
            file: efile,
            offset: eoff,
            key: None,
            detail: format!("the PM region cannot be read ({edetail}): the write buffer and PM leaves are lost"),
        });
        return None;
    }
    let mut pools = Vec::new();
    for (i, (path, bytes)) in images.into_iter().enumerate() {
        if bytes.len() as u64 != size {
            sink.lost(Lost {
                file: path,
                offset: 0,
                key: None,
                detail: format!("PM pool is {} bytes, not {size}: it and every later pool are lost", bytes.len()),
            });
            break;
        }
        let want = encode_pool_header(i as u32, size, ctx.db_id);
        let h = bytes.get(..36).unwrap_or(&[]);
        if h != &want[..36] {
            let crc_ok = h.get(..8) == want.get(..8)
                && h.get(..32).zip(le32(h, 32)).is_some_and(|(b, c)| crc::masked(b) == c)
                && h.get(..24) == want.get(..24);
            if crc_ok && ctx.db_id != 0 {
                sink.lost(Lost {
                    file: path,
                    offset: 0,
                    key: None,
                    detail: "PM pool belongs to another store: it and every later pool are not read".into(),
                });
                break;
            }
            if !crc_ok {
                sink.lost(Lost {
                    file: path.clone(),
                    offset: 0,
                    key: None,
                    detail: format!(
                        "PM pool header is damaged ({edetail}); the pool was read as it stands, every record under \
                         its own checksum"
                    ),
                });
            }
        }
        pools.push((path, bytes));
    }
    Some(Pm::Raw { pools, size })
}

/// The clean-shutdown image, when the last close wrote one and it verifies.
fn load_image(pm: &Pm) -> Option<Image> {
    let at = pm.word(IMAGE_PTR_ADDR).filter(|&a| a != 0)?;
    let len = leaf::image_len(pm.slice(at, IMAGE_HEADER)?).ok()?;
    leaf::decode_image(pm.slice(at, len)?).ok()
}

/// True when `key` belongs to the partition `d` describes.
fn desc_contains(d: &PartitionDesc, key: &[u8]) -> bool {
    key.starts_with(&d.prefix)
        && if d.end {
            key.len() == d.prefix.len()
        } else {
            key.get(d.prefix.len()).is_some_and(|b| d.values.contains(b))
        }
}

/// True when `leaf` indexes `key` at exactly `off` (a 29-bit signature and the slot's
/// offset confirm a key read from damaged bytes).
fn leaf_names(leaf: &Leaf, off: u64, key: &[u8]) -> bool {
    let src = |o: u64| -> Result<Vec<u8>> {
        let mut k = key.to_vec();
        if o != off {
            k.push(0);
        }
        Ok(k)
    };
    matches!(leaf.get(key, &src), Ok(Some(o)) if o == off)
}

// ---------------------------------------------------------------------------------------
// The persistent write buffer.

/// One intact PWB entry.
#[derive(Debug)]
struct PwbRec<'a> {
    seq: u64,
    idx: usize,
    kind: Kind,
    key: &'a [u8],
    value: &'a [u8],
}

/// The segment header at `addr`: (id, size).
fn segment_at(pm: &Pm, addr: u64) -> std::result::Result<(u64, u64), String> {
    let h = pm.slice(addr, pwb::HEADER_LEN).ok_or_else(|| format!("address {addr:#x} is outside the PM region"))?;
    let (id, size) = pwb::decode_header(h)?;
    let fits = usize::try_from(size).ok().and_then(|n| pm.slice(addr, n)).is_some();
    if size < (pwb::HEADER_LEN + pwb::RECORD_HEADER) as u64 || !size.is_multiple_of(64) || !fits {
        return Err(format!("segment header claims {size} bytes"));
    }
    Ok((id, size))
}

/// Find the live segments and walk them; returns their intact entries.
fn walk_pwb<'a>(pm: &'a Pm, image: Option<&Image>, sink: &mut dyn SalvageSink, out: &mut Walked) -> Vec<PwbRec<'a>> {
    // (address, id, size)
    let mut segs: Vec<(u64, u64, u64)> = Vec::new();
    let mut suspicious: Vec<(u64, u64, u64, String)> = Vec::new();
    for slot in 0..SEG_SLOTS {
        let sa = DIR_ADDR + slot * SLOT_LEN;
        let (Some(addr), Some(id)) = (pm.word(sa), pm.word(sa + 8)) else { continue };
        if id == 0 {
            continue;
        }
        match segment_at(pm, addr) {
            Ok((hid, size)) if hid == id => {
                if !segs.iter().any(|s| s.0 == addr) {
                    segs.push((addr, id, size));
                }
            }
            Ok((hid, _)) => suspicious.push((slot, addr, id, format!("the header there is segment {hid}'s"))),
            Err(d) => suspicious.push((slot, addr, id, d)),
        }
    }
    match image {
        // The image lists every live segment (a clean close wrote it, and nothing changed
        // since): a slot that names none of them was a free slot, damaged.
        Some(img) => {
            for &(a, _) in &img.segments {
                if segs.iter().any(|s| s.0 == a) {
                    continue;
                }
                match segment_at(pm, a) {
                    Ok((hid, size)) => segs.push((a, hid, size)),
                    Err(d) => {
                        let slot_id = suspicious.iter().find(|s| s.1 == a).map(|s| s.2);
                        match slot_id {
                            // The directory's id still verifies the records, and the image's
                            // write position tells where they end: nothing is lost.
                            Some(id) => segs.push((a, id, guess_size(pm, a, img))),
                            None => sink.lost(pm.lost(
                                a,
                                None,
                                format!("PWB segment listed by the clean-shutdown image is unreadable ({d})"),
                            )),
                        }
                    }
                }
            }
        }
        None if !suspicious.is_empty() => {
            let found: Vec<(u64, u64, u64)> = pm
                .lines_starting_with(pwb::MAGIC)
                .into_iter()
                .filter_map(|a| segment_at(pm, a).ok().map(|(id, size)| (a, id, size)))
                .collect();
            for (slot, addr, id, why) in suspicious {
                if segs.iter().any(|s| s.0 == addr) {
                    // Another slot names the segment at this address (one slot per
                    // segment): a free slot, whose id word was damaged.
                    continue;
                }
                let mut cands: Vec<(u64, u64, u64)> = Vec::new();
                // The slot's address was damaged: its id names the segment.
                cands.extend(found.iter().copied().filter(|f| f.1 == id));
                match segment_at(pm, addr) {
                    // The slot's id was damaged (or a free slot's was): the header at its
                    // address names the segment (a freed one only holds stale records,
                    // each older than a live or flushed version of its key).
                    Ok((hid, size)) => cands.push((addr, hid, size)),
                    // The header was damaged: the slot's id still verifies its records.
                    Err(_) if addr != 0 => {
                        if let Some(size) = superblock_seg_size(pm) {
                            if pm.slice(addr, size as usize).is_some() {
                                cands.push((addr, id, size));
                            }
                        }
                    }
                    Err(_) => {}
                }
                cands.retain(|c| !segs.iter().any(|s| s.0 == c.0 || s.1 == c.1));
                cands.sort_unstable();
                cands.dedup();
                if cands.is_empty() && addr == 0 {
                    // A slot that never named a segment, with a damaged id word.
                    continue;
                }
                let walked: Vec<String> = cands.iter().map(|c| format!("segment {} at {:#x}", c.1, c.0)).collect();
                sink.lost(pm.lost(
                    DIR_ADDR + slot * SLOT_LEN,
                    None,
                    format!(
                        "PWB directory slot {slot} (segment {id} at {addr:#x}) does not match its segment ({why}); \
                         walked instead: [{}]",
                        walked.join(", ")
                    ),
                ));
                segs.extend(cands);
            }
        }
        None => {}
    }
    let mut recs = Vec::new();
    let mut tails = Vec::new();
    for (addr, id, size) in segs {
        let pos = image.and_then(|img| img.segments.iter().find(|s| s.0 == addr)).map(|s| s.1);
        if let Some(t) = walk_segment(pm, addr, id, size, pos, image, &mut recs, sink) {
            tails.push(t);
        }
        out.segments += 1;
    }
    let max_seq = recs.iter().map(|r| r.seq).max().unwrap_or(0);
    let counter = pm.word(ID_COUNTER_ADDR).unwrap_or(0);
    for t in tails {
        tail_record(pm, &t, max_seq, counter, sink);
    }
    recs
}

/// Where a segment's log ends when no image gives its write position: (segment address,
/// id, size, offset, sequence number of its last intact record).
struct Tail {
    base: u64,
    id: u64,
    size: u64,
    off: usize,
    prev_seq: Option<u64>,
}

fn superblock_seg_size(pm: &Pm) -> Option<u64> {
    store::decode_superblock(pm.slice(SUPERBLOCK_ADDR, 64)?).ok()
}

/// A size to walk a segment whose header is damaged: the store's segment size, at least
/// up to the write position the image gives.
fn guess_size(pm: &Pm, addr: u64, img: &Image) -> u64 {
    let pos = img.segments.iter().find(|s| s.0 == addr).map_or(0, |s| s.1);
    let size = superblock_seg_size(pm).unwrap_or(0).max(pos.next_multiple_of(64));
    let room = pm.pool_size() - addr % pm.pool_size();
    size.min(room)
}

/// Walk one segment: its intact entries go to `recs`, damaged records to `sink`. Returns
/// where its log ends when that is for [`tail_record`] to judge (no image).
#[allow(clippy::too_many_arguments)]
fn walk_segment<'a>(
    pm: &'a Pm,
    base: u64,
    id: u64,
    size: u64,
    pos: Option<u64>,
    image: Option<&Image>,
    recs: &mut Vec<PwbRec<'a>>,
    sink: &mut dyn SalvageSink,
) -> Option<Tail> {
    let Some(seg) = usize::try_from(size).ok().and_then(|n| pm.slice(base, n)) else {
        sink.lost(pm.lost(base, None, format!("PWB segment {id} of {size} bytes runs outside the PM region")));
        return None;
    };
    let pos = pos.and_then(|p| usize::try_from(p).ok()).map(|p| p.min(seg.len()));
    let mut off = pwb::HEADER_LEN;
    let mut prev_seq = None;
    while off + pwb::RECORD_HEADER <= seg.len() {
        if let Some(r) = pwb::record_at(seg, id, off) {
            for (idx, e) in r.entries.iter().enumerate() {
                recs.push(PwbRec { seq: r.seq, idx, kind: e.kind, key: e.key, value: e.value });
            }
            prev_seq = Some(r.seq);
            off += r.size;
            continue;
        }
        let next = (off + 8..)
            .step_by(8)
            .take_while(|p| p + pwb::RECORD_HEADER <= seg.len())
            .find(|&p| pwb::record_at(seg, id, p).is_some());
        let end = match (next, pos) {
            (Some(n), _) => n,
            (None, Some(p)) if off < p => p,
            (None, Some(_)) => break,
            (None, None) => return Some(Tail { base, id, size, off, prev_seq }),
        };
        let (named, complete) = name_entries(seg, base, off, end, image);
        for (at, key) in named {
            sink.lost(pm.lost(
                base + at as u64,
                Some(key),
                format!("PWB record at segment {id} offset {off} fails its checksum: this write is dropped"),
            ));
        }
        if !complete {
            sink.lost(pm.lost(
                base + off as u64,
                None,
                format!("{} bytes of PWB segment {id} hold no verifying record (keys unreadable)", end - off),
            ));
        }
        if next.is_none() {
            break;
        }
        off = end;
    }
    None
}

/// The keys of the entries of the damaged record(s) in `seg[off..end)`: each entry whose
/// own checksum verifies, or whose key the image indexes at its address. `complete` when
/// every entry up to `end` was named.
fn name_entries(seg: &[u8], base: u64, off: usize, end: usize, image: Option<&Image>) -> (Vec<(usize, Vec<u8>)>, bool) {
    let mut named = Vec::new();
    let mut at = off + pwb::RECORD_HEADER;
    while at + pwb::ENTRY_HEADER <= end {
        let Some(b) = seg.get(at..end) else { break };
        if let Some((_, k, _, used)) = pwb::decode_entry(b) {
            named.push((at, k.to_vec()));
            at += used;
            continue;
        }
        let Some((klen, vlen)) = pwb::entry_lens(b) else { break };
        let Some(k) = b.get(pwb::ENTRY_HEADER..pwb::ENTRY_HEADER + klen) else { break };
        let by_image = image.is_some_and(|img| {
            img.partitions.iter().any(|(d, _, leaf)| desc_contains(d, k) && leaf_names(leaf, base + at as u64, k))
        });
        if !by_image || pwb::ENTRY_HEADER + klen + vlen > b.len() {
            break;
        }
        named.push((at, k.to_vec()));
        at += pwb::ENTRY_HEADER + klen + vlen;
    }
    let complete = at > off + pwb::RECORD_HEADER && at.next_multiple_of(8) == end;
    (named, complete)
}

/// Without an image, the log of a segment ends at the first bytes that hold no record of
/// it: never written (zero), stale bytes of a recycled extent, a write torn by a crash (never
/// acknowledged) — or a damaged last write. The last is reported (and a torn write with it,
/// which looks the same) when its header looks like the segment's next write (a sequence
/// number after the segment's last intact record and at most one past the newest seen plus
/// one per writer lane — writers of other lanes may have had later numbers in flight — a
/// plausible entry count), or when its entries all verify and fill the length it claims;
/// either way only when it does not verify as a record of another segment (stale bytes).
fn tail_record(pm: &Pm, t: &Tail, max_seq: u64, counter: u64, sink: &mut dyn SalvageSink) {
    let Some(seg) = usize::try_from(t.size).ok().and_then(|n| pm.slice(t.base, n)) else { return };
    let off = t.off;
    let Some(h) = seg.get(off..off + pwb::RECORD_HEADER) else { return };
    if h.iter().all(|&b| b == 0) {
        return;
    }
    let (Some(len), Some(seq), Some(count)) = (le32(h, 4), le64(h, 8), le32(h, 16)) else { return };
    let room = (seg.len() - off) / pwb::ENTRY_HEADER;
    let stale = || (1..=counter.min(1 << 16)).any(|i| i != t.id && pwb::record_at(seg, i, off).is_some());
    // The header looks like this segment's next write (the damage is elsewhere in it)...
    let next_write = seq != 0
        && seq <= max_seq.saturating_add(1 + super::store::LANES as u64)
        && t.prev_seq.is_none_or(|p| seq > p)
        && count != 0
        && count as usize <= room
        && (t.prev_seq.is_some() || !stale());
    // ...or its entries all verify and fill the length it claims (the damage is in its
    // checksum, sequence number or count), and it is no record of an earlier segment.
    let whole = || {
        let Some(claimed) = (off + 8).checked_add(len as usize).filter(|&e| e <= seg.len()) else { return false };
        let mut at = off + pwb::RECORD_HEADER;
        while at < claimed {
            match seg.get(at..claimed).and_then(pwb::decode_entry) {
                Some((_, _, _, used)) => at += used,
                None => return false,
            }
        }
        at == claimed && at > off + pwb::RECORD_HEADER && !stale()
    };
    if !next_write && !whole() {
        return;
    }
    let end = (off + 8)
        .checked_add(len as usize)
        .filter(|&e| len >= 12 && e <= seg.len())
        .map_or(seg.len(), |e| e.next_multiple_of(8).min(seg.len()));
    let (named, complete) = name_entries(seg, t.base, off, end, None);
    let what = format!(
        "the PWB write at segment {} offset {off}, after its last intact one, fails its checksum: dropped (a write \
         torn by a crash, never acknowledged, looks the same)",
        t.id
    );
    for (at, key) in named {
        sink.lost(pm.lost(t.base + at as u64, Some(key), what.clone()));
    }
    if !complete {
        sink.lost(pm.lost(t.base + off as u64, None, format!("{what}; its keys are unreadable")));
    }
}

// ---------------------------------------------------------------------------------------
// Chains, PM leaves and their tables.

/// A PM leaf's header fields (as stored; verified only with the leaf).
#[derive(Debug, Clone, Copy)]
struct Hdr {
    table: u64,
    cw: u32,
    seq_hi: u64,
    depth: usize,
    raw: [u8; LEAF_HEADER],
}

impl Hdr {
    fn parse(h: &[u8]) -> Option<Hdr> {
        leaf::leaf_len(h).ok()?;
        Some(Hdr {
            table: le64(h, 24)?,
            cw: le32(h, 32)?,
            seq_hi: le64(h, 36)?,
            depth: le32(h, 16)? as usize,
            raw: h.get(..LEAF_HEADER)?.try_into().ok()?,
        })
    }
}

/// A PM leaf a chain names.
#[derive(Debug)]
struct LeafRef {
    addr: u64,
    hdr: Option<Hdr>,
    /// The leaf, when its checksum verifies (or its header was confirmed by a rebuild).
    leaf: Option<Leaf>,
    /// Why it does not verify.
    err: String,
}

fn read_leaf(pm: &Pm, addr: u64) -> LeafRef {
    let head = pm.slice(addr, LEAF_HEADER);
    let hdr = head.and_then(Hdr::parse);
    let r = (|| -> std::result::Result<Leaf, String> {
        let h = head.ok_or("PM leaf outside the PM region")?;
        let len = leaf::leaf_len(h)?;
        let b = pm.slice(addr, len).ok_or("PM leaf runs outside the PM region")?;
        Ok(leaf::decode_leaf(b)?.0)
    })();
    match r {
        Ok(l) => LeafRef { addr, hdr, leaf: Some(l), err: String::new() },
        Err(err) => LeafRef { addr, hdr, leaf: None, err },
    }
}

/// A partition with PM leaves.
#[derive(Debug)]
struct ChainRef {
    desc: PartitionDesc,
    /// Newest first.
    leaves: Vec<LeafRef>,
    /// The partition's PWB entries at or below this sequence number are covered.
    covered_to: Option<u64>,
}

fn read_chain(pm: &Pm, addr: u64) -> std::result::Result<leaf::Chain, String> {
    let head = pm.slice(addr, 17).ok_or("chain record outside the PM region")?;
    let plen = head.get(13..15).map_or(0, |b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let vlen = head.get(15..17).map_or(0, |b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let at = 17 + plen + vlen;
    let n = pm.slice(addr + at as u64, 4).and_then(|b| le32(b, 0)).ok_or("chain record runs outside the PM region")?
        as usize;
    if n > 1 << 20 {
        return Err(format!("chain record claims {n} leaves"));
    }
    let b = pm.slice(addr, at + 4 + 8 * n + 4).ok_or("chain record runs outside the PM region")?;
    Ok(leaf::decode_chain(b)?.0)
}

fn chain_ref(pm: &Pm, c: leaf::Chain) -> ChainRef {
    ChainRef { desc: c.desc, leaves: c.leaves.iter().map(|&a| read_leaf(pm, a)).collect(), covered_to: None }
}

/// Read every chain; true when one could not be read (some tables are then unclaimed).
fn read_chains(ctx: &EngineCtx, pm: &Pm, chains: &mut Vec<ChainRef>, sink: &mut dyn SalvageSink) -> bool {
    let mut bad: Vec<(u64, u64, String)> = Vec::new();
    let mut referenced = HashSet::new();
    for slot in 0..CHAIN_SLOTS {
        let Some(ra) = pm.word(CHAIN_DIR_ADDR + slot * 8).filter(|&a| a != 0) else { continue };
        match read_chain(pm, ra) {
            Ok(c) => {
                referenced.insert(ra);
                chains.push(chain_ref(pm, c));
            }
            Err(d) => bad.push((slot, ra, d)),
        }
    }
    if bad.is_empty() {
        return false;
    }
    // An intact chain record of a partition no chain slot names: the lost slot's, or an
    // older record of the partition whose current record is damaged. Adopt, per partition,
    // the newest whose leaves and tables are all intact.
    let mut best: Vec<(u64, ChainRef)> = Vec::new();
    for a in pm.lines_starting_with(CHAIN_MAGIC) {
        if referenced.contains(&a) {
            continue;
        }
        let Ok(c) = read_chain(pm, a) else { continue };
        if chains.iter().any(|k| k.desc == c.desc) {
            continue;
        }
        let c = chain_ref(pm, c);
        let intact = !c.leaves.is_empty()
            && c.leaves.iter().all(|l| {
                l.leaf.is_some() && l.hdr.is_some_and(|h| ctx.fs.exists(&store::table_path(&ctx.dir, h.table)))
            });
        let newest = c.leaves.first().and_then(|l| l.hdr).map_or(0, |h| h.seq_hi);
        if !intact {
            continue;
        }
        match best.iter_mut().find(|b| b.1.desc == c.desc) {
            Some(b) if b.0 >= newest => {}
            Some(b) => *b = (newest, c),
            None => best.push((newest, c)),
        }
    }
    let adopted: Vec<String> = best
        .iter()
        .map(|(_, c)| format!("prefix {} values {:?} end {}", crate::escape(&c.desc.prefix), c.desc.values, c.desc.end))
        .collect();
    for (slot, ra, d) in bad {
        let in_heap = ra.is_multiple_of(64)
            && (ra >= HEAP_START || ra >= pm.pool_size())
            && ra % pm.pool_size() >= POOL_HEADER_LEN
            && pm.slice(ra, 64).is_some();
        let guess = if adopted.is_empty() && !in_heap {
            "; no intact record of an unknown partition is in the PM heap: most likely a damaged empty slot"
        } else {
            ""
        };
        sink.lost(pm.lost(
            CHAIN_DIR_ADDR + slot * 8,
            None,
            format!(
                "chain slot {slot}: the record at {ra:#x} is unreadable ({d}); its partition's tables and \
                 flush bound are unknown (adopted from intact records in the PM heap: [{}]){guess}",
                adopted.join("; ")
            ),
        ));
    }
    chains.extend(best.into_iter().map(|b| b.1));
    true
}

/// One table entry salvaged, with its block and place in the block.
#[derive(Debug)]
struct TEntry {
    block: u64,
    idx: usize,
    put: bool,
    key: Vec<u8>,
    value: Vec<u8>,
}

/// What the shared SSTable salvage found in one table.
#[derive(Debug, Default)]
struct TableSalvage {
    entries: Vec<TEntry>,
    lost: Vec<Lost>,
    /// Data blocks (offset, size with crc), when the footer and index verify.
    index: Option<Vec<(u64, usize)>>,
}

#[derive(Default)]
struct Capture(Vec<Lost>);

impl SalvageSink for Capture {
    fn record(&mut self, _: &[u8], _: Option<&[u8]>, _: Order) {}
    fn lost(&mut self, lost: Lost) {
        self.0.push(lost);
    }
}

/// The data blocks of a table whose footer and index verify (the same decoding as
/// [`salvage_sstable`]'s).
fn table_index(data: &[u8]) -> Option<Vec<(u64, usize)>> {
    let foot = data.get(data.len().checked_sub(sstable::FOOTER_LEN)?..)?;
    let (ih, _, _) = sstable::decode_footer(foot).ok()?;
    let s = usize::try_from(ih.offset).ok()?;
    let b = data.get(s..s.checked_add(ih.size as usize)?)?;
    let (p, c) = b.split_at(b.len().checked_sub(4)?);
    if crc::masked(p).to_le_bytes() != c {
        return None;
    }
    let mut c = crate::format::Cursor::new(p);
    let mut v = Vec::new();
    while c.remaining() > 0 {
        let klen = c.u16()? as usize;
        c.skip(klen)?;
        v.push((c.u64()?, c.u32()? as usize));
    }
    Some(v)
}

impl TableSalvage {
    fn run(data: &[u8], path: &Path) -> TableSalvage {
        let mut cap = Capture::default();
        let mut entries = Vec::new();
        let mut last = None;
        let mut idx = 0usize;
        salvage_sstable(
            data,
            path,
            |e, block| {
                if last != Some(block) {
                    last = Some(block);
                    idx = 0;
                }
                entries.push(TEntry {
                    block,
                    idx,
                    put: e.kind == sstable::Kind::Put,
                    key: e.key.to_vec(),
                    value: e.value.to_vec(),
                });
                idx += 1;
            },
            &mut cap,
        );
        TableSalvage { entries, lost: cap.0, index: table_index(data) }
    }

    /// Block offset → block number (the index's order; without an index, the order of the
    /// blocks found).
    fn block_numbers(&self) -> HashMap<u64, usize> {
        match &self.index {
            Some(ix) => ix.iter().enumerate().map(|(i, b)| (b.0, i)).collect(),
            None => {
                let mut m = HashMap::new();
                for e in &self.entries {
                    let n = m.len();
                    m.entry(e.block).or_insert(n);
                }
                m
            }
        }
    }

    /// The PM leaf table `n` would get, when every block verified ([`store::pm_leaf_of`]).
    fn rebuild_leaf(&self, n: u64, depth: usize) -> Option<Leaf> {
        if !self.lost.is_empty() || self.index.is_none() {
            return None;
        }
        let bn = self.block_numbers();
        let offs: Option<Vec<(Vec<u8>, u64)>> =
            self.entries.iter().map(|e| Some((e.key.clone(), store::sst_off(n, *bn.get(&e.block)?, e.idx)))).collect();
        Some(store::pm_leaf_of(&offs?, depth))
    }

    /// Entries to keep: all of them, except that without a verified index (blocks found by
    /// their checksums alone) a verified leaf must confirm each one.
    fn kept<'s>(&'s self, n: u64, leaf: Option<&'s Leaf>) -> impl Iterator<Item = &'s TEntry> + 's {
        let bn = if self.index.is_none() && leaf.is_some() { Some(self.block_numbers()) } else { None };
        self.entries.iter().filter(move |e| match (&bn, leaf) {
            (Some(bn), Some(l)) => {
                bn.get(&e.block).is_some_and(|&b| leaf_names(l, store::sst_off(n, b, e.idx), &e.key))
            }
            _ => true,
        })
    }

    /// Report what was lost: by key when the table's verified PM leaf names every entry
    /// that is missing (nothing at all when none is), else as the shared salvage said.
    fn report_lost(self, data: &[u8], path: &Path, n: u64, leaf: Option<&Leaf>, sink: &mut dyn SalvageSink) {
        if self.lost.is_empty() {
            return;
        }
        let Some(leaf) = leaf else {
            self.lost.into_iter().for_each(|l| sink.lost(l));
            return;
        };
        let bn = self.block_numbers();
        let have: HashMap<(usize, usize), &[u8]> =
            self.entries.iter().filter_map(|e| Some(((*bn.get(&e.block)?, e.idx), e.key.as_slice()))).collect();
        // Keys read (unverified) from the blocks that failed.
        let mut cands: HashMap<(usize, usize), (Vec<u8>, u64)> = HashMap::new();
        if let Some(ix) = &self.index {
            for l in &self.lost {
                let Some(&b) = bn.get(&l.offset) else { continue };
                let Some(&(o, size)) = ix.get(b) else { continue };
                let Some(payload) = usize::try_from(o).ok().and_then(|s| data.get(s..s + size.saturating_sub(4)))
                else {
                    continue;
                };
                for (i, k) in lenient_keys(payload).into_iter().enumerate() {
                    cands.insert((b, i), (k, o));
                }
            }
        }
        let mut named: Vec<(Vec<u8>, u64)> = Vec::new();
        let mut unnamed = 0usize;
        for off in leaf.offsets() {
            let (t, b, i) = store::split_sst(off);
            if t != n & 0x7fff_ffff {
                unnamed += 1;
                continue;
            }
            if let Some(k) = have.get(&(b, i)) {
                unnamed += usize::from(!leaf_names(leaf, off, k));
                continue;
            }
            match cands.get(&(b, i)) {
                Some((k, o)) if leaf_names(leaf, off, k) => named.push((k.clone(), *o)),
                _ => unnamed += 1,
            }
        }
        for (k, o) in named {
            sink.lost(Lost {
                file: path.to_path_buf(),
                offset: o,
                key: Some(k),
                detail: "data block fails its checksum; the key is named by the table's PM leaf, its value is lost"
                    .into(),
            });
        }
        if unnamed > 0 {
            self.lost.into_iter().for_each(|l| sink.lost(l));
        }
    }
}

/// The keys of a data block that failed its checksum, read as far as the entries still
/// parse (the kind byte is not checked: it may be the damaged one). Unverified: a PM leaf
/// must confirm each.
fn lenient_keys(payload: &[u8]) -> Vec<Vec<u8>> {
    let mut c = crate::format::Cursor::new(payload);
    let mut keys = Vec::new();
    while c.remaining() > 0 {
        let Some(k) = (|| {
            c.u8()?;
            let klen = c.u16()? as usize;
            let vlen = c.u32()? as usize;
            let k = c.bytes(klen)?;
            c.skip(vlen)?;
            Some(k)
        })() else {
            break;
        };
        keys.push(k.to_vec());
    }
    keys
}

/// Read a file; `None` when it does not exist.
fn read_file(ctx: &EngineCtx, path: &Path) -> Result<Option<Vec<u8>>> {
    match ctx.fs.read_all(path) {
        Ok(d) => Ok(Some(d)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::Io(e)),
    }
}

/// Salvage the tables the chains name, in chain order; sets each chain's coverage bound.
/// Leaves whose table is unknown go to `unknown` as (chain, position, order seq).
#[allow(clippy::too_many_arguments)]
fn salvage_chain_tables(
    ctx: &EngineCtx,
    pm: &Pm,
    chains: &mut [ChainRef],
    max_seq: u64,
    claimed: &mut HashSet<u64>,
    unknown: &mut Vec<(usize, usize, u64)>,
    sink: &mut dyn SalvageSink,
    out: &mut Walked,
) -> Result<()> {
    for l in chains.iter().flat_map(|c| c.leaves.iter()) {
        if let (Some(_), Some(h)) = (&l.leaf, l.hdr) {
            claimed.insert(h.table);
        }
    }
    for (ci, c) in chains.iter_mut().enumerate() {
        let mut newer: Option<u64> = None;
        for (p, l) in c.leaves.iter_mut().enumerate() {
            let eff = match (l.hdr.map(|h| h.seq_hi), newer) {
                (Some(s), Some(e)) => s.min(e),
                (Some(s), None) => s,
                (None, e) => e.unwrap_or(0),
            };
            newer = Some(eff);
            let table = match l.hdr {
                Some(h) if l.leaf.is_some() => Some(h),
                Some(h) if !claimed.contains(&h.table) && ctx.fs.exists(&store::table_path(&ctx.dir, h.table)) => {
                    claimed.insert(h.table);
                    Some(h)
                }
                _ => None,
            };
            let Some(h) = table else {
                sink.lost(pm.lost(
                    l.addr,
                    None,
                    format!("PM leaf at chain position {p} is unreadable ({}): its table is unknown", l.err),
                ));
                unknown.push((ci, p, eff));
                continue;
            };
            let path = store::table_path(&ctx.dir, h.table);
            let Some(data) = read_file(ctx, &path)? else {
                sink.lost(pm.lost(l.addr, None, format!("the table {} this PM leaf names is missing", path.display())));
                continue;
            };
            out.tables += 1;
            let ts = TableSalvage::run(&data, &path);
            if l.leaf.is_none() {
                // Damage in the buckets only: the leaf rebuilt from its intact table
                // reproduces the stored header (and with it the checksum).
                if let Some(rebuilt) = ts.rebuild_leaf(h.table, h.depth) {
                    let meta = LeafMeta { table: h.table, cw: h.cw, seq_hi: h.seq_hi };
                    let enc = leaf::encode_leaf(&rebuilt, rebuilt.normal(), meta);
                    if enc.get(..LEAF_HEADER) == Some(&h.raw[..]) {
                        l.leaf = Some(rebuilt);
                    }
                }
            }
            if l.leaf.is_none() {
                sink.lost(pm.lost(
                    l.addr,
                    None,
                    format!(
                        "PM leaf at chain position {p} does not verify ({}); its table {} was read as the unverified \
                         header names it",
                        l.err, h.table
                    ),
                ));
            }
            let order = table_order(eff, p);
            for e in ts.kept(h.table, l.leaf.as_ref()) {
                sink.record(&e.key, e.put.then_some(e.value.as_slice()), order);
            }
            ts.report_lost(&data, &path, h.table, l.leaf.as_ref(), sink);
        }
        // Recovery skips the partition's records at or below the newest leaf's seq_hi. When
        // that leaf cannot be verified: its header value if plausible, else the newest
        // verified leaf's (a lower bound: a covered record may come back, never a live one
        // be skipped).
        let lower = c.leaves.iter().filter(|l| l.leaf.is_some()).filter_map(|l| l.hdr.map(|h| h.seq_hi)).max();
        c.covered_to = match c.leaves.first() {
            Some(l) if l.leaf.is_some() => l.hdr.map(|h| h.seq_hi),
            Some(LeafRef { hdr: Some(h), .. }) if h.seq_hi >= lower.unwrap_or(0) && h.seq_hi < max_seq => {
                Some(h.seq_hi)
            }
            _ => lower,
        };
    }
    Ok(())
}

/// Tables no chain claims, salvaged when some chain or leaf could not be read.
fn salvage_unclaimed_tables(
    ctx: &EngineCtx,
    pm: Option<&Pm>,
    chains: &[ChainRef],
    claimed: &HashSet<u64>,
    unknown: &[(usize, usize, u64)],
    sink: &mut dyn SalvageSink,
    out: &mut Walked,
) -> Result<()> {
    let mut tables: Vec<u64> = ctx
        .fs
        .list(&ctx.dir)?
        .iter()
        .filter_map(|n| n.strip_suffix(".sst")?.parse::<u64>().ok())
        .filter(|n| !claimed.contains(n))
        .collect();
    tables.sort_unstable();
    if tables.is_empty() {
        return Ok(());
    }
    // Verifying PM leaves still in the heap that name them give their age.
    let mut seq_of: HashMap<u64, u64> = HashMap::new();
    if let Some(pm) = pm {
        for a in pm.lines_starting_with(LEAF_MAGIC) {
            if let LeafRef { leaf: Some(_), hdr: Some(h), .. } = read_leaf(pm, a) {
                if tables.contains(&h.table) {
                    let s = seq_of.entry(h.table).or_insert(h.seq_hi);
                    *s = (*s).max(h.seq_hi);
                }
            }
        }
    }
    // One unreadable leaf and one unclaimed table: most likely its own.
    let single = if unknown.len() == 1 && tables.len() == 1 { unknown.first().copied() } else { None };
    for n in tables {
        let path = store::table_path(&ctx.dir, n);
        let Some(data) = read_file(ctx, &path)? else { continue };
        out.tables += 1;
        let ts = TableSalvage::run(&data, &path);
        let order = match (seq_of.get(&n), single) {
            (Some(&s), _) => table_order(s, usize::MAX),
            (None, Some((ci, p, eff)))
                if chains.get(ci).is_some_and(|c| ts.entries.iter().all(|e| desc_contains(&c.desc, &e.key))) =>
            {
                table_order(eff, p)
            }
            _ => Order::from(n),
        };
        for e in &ts.entries {
            sink.record(&e.key, e.put.then_some(e.value.as_slice()), order);
        }
        ts.report_lost(&data, &path, n, None, sink);
    }
    Ok(())
}

/// Which PWB entries a flush covered: per chained partition, its bound.
struct Coverage<'a> {
    by_prefix: HashMap<&'a [u8], Vec<(&'a PartitionDesc, u64)>>,
    lens: Vec<usize>,
}

impl<'a> Coverage<'a> {
    fn new(chains: &'a [ChainRef]) -> Coverage<'a> {
        let mut by_prefix: HashMap<&'a [u8], Vec<(&'a PartitionDesc, u64)>> = HashMap::new();
        for c in chains {
            if let Some(h) = c.covered_to {
                by_prefix.entry(c.desc.prefix.as_slice()).or_default().push((&c.desc, h));
            }
        }
        let mut lens: Vec<usize> = by_prefix.keys().map(|p| p.len()).collect();
        lens.sort_unstable();
        lens.dedup();
        Coverage { by_prefix, lens }
    }

    fn covers(&self, key: &[u8], seq: u64) -> bool {
        for &l in &self.lens {
            let Some(p) = key.get(..l) else { break };
            if let Some(v) = self.by_prefix.get(p) {
                if let Some((_, h)) = v.iter().find(|(d, _)| desc_contains(d, key)) {
                    return seq <= *h;
                }
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Arc;

    use super::*;
    use crate::fs::{CountingFs, FaultFs, Fs};
    use crate::options_file::{OptionsRecord, OPTIONS_FILE};
    use crate::pm::sim::SimDevice;
    use crate::repair::Salvaged;
    use crate::{Db, Preset, WriteBatch};

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    fn dir() -> PathBuf {
        PathBuf::from("/lightkv-salvage")
    }

    fn ctx(dev: &SimDevice, fs: &FaultFs) -> EngineCtx {
        let opts = crate::testing::sim_options(Preset::Lightkv, dev, fs);
        let cfs = CountingFs::new(Arc::new(fs.clone()));
        let rec = OptionsRecord::decode(&cfs.read_all(&dir().join(OPTIONS_FILE)).unwrap()).unwrap();
        EngineCtx {
            dir: dir(),
            opts,
            fs: cfs,
            db_id: rec.db_id,
            fresh: false,
            pm_health: Arc::default(),
            recovery: Arc::default(),
        }
    }

    /// A store whose keys are overwritten and deleted across many flushes and compactions
    /// (batches included), closed cleanly.
    fn build() -> (SimDevice, FaultFs, Model) {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = Db::open(dir(), crate::testing::sim_options(Preset::Lightkv, &dev, &fs)).unwrap();
        let mut m = Model::new();
        for i in 0..1500u32 {
            let k = format!("k{:03}", (i * 7) % 120).into_bytes();
            if i % 5 == 3 {
                db.delete(&k).unwrap();
                m.remove(&k);
            } else if i % 13 == 6 {
                let k2 = format!("k{:03}", (i * 11) % 120).into_bytes();
                let v = format!("b{i}").into_bytes();
                let mut b = WriteBatch::new();
                b.put(&k, &v);
                b.delete(&k2);
                db.write(b).unwrap();
                m.insert(k, v);
                m.remove(&k2);
            } else {
                let v = format!("v{i}-{}", "x".repeat((i % 50) as usize)).into_bytes();
                db.put(&k, &v).unwrap();
                m.insert(k, v);
            }
            if i % 400 == 399 {
                db.flush().unwrap();
            }
        }
        db.compact().unwrap();
        db.close().unwrap();
        (dev, fs, m)
    }

    fn salvage_all(dev: &SimDevice, fs: &FaultFs) -> (Salvaged, Walked) {
        let mut s = Salvaged::default();
        let w = walk(&ctx(dev, fs), &mut s).unwrap();
        (s, w)
    }

    fn live(s: &Salvaged) -> Model {
        s.live().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }

    /// Keys that differ between `got` and `m` are all reported lost by key, and no lost
    /// record lacks its key.
    fn only_reported_keys_differ(s: &Salvaged, m: &Model) {
        assert!(s.lost.iter().all(|l| l.key.is_some()), "a lost record without its key: {:?}", s.lost);
        let lost: BTreeSet<&Vec<u8>> = s.lost.iter().filter_map(|l| l.key.as_ref()).collect();
        let got = live(s);
        for k in m.keys().chain(got.keys()) {
            if m.get(k) != got.get(k) {
                assert!(lost.contains(k), "key {} differs but was not reported", crate::escape(k));
            }
        }
    }

    #[test]
    fn an_undamaged_store_salvages_to_exactly_its_state() {
        let (dev, fs, m) = build();
        let (s, w) = salvage_all(&dev, &fs);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), m);
        assert!(w.segments > 0 && w.tables > 0 && w.covered > 0, "{w:?}");
    }

    #[test]
    fn flush_covered_records_are_skipped_so_no_stale_version_comes_back() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = Db::open(dir(), crate::testing::sim_options(Preset::Lightkv, &dev, &fs)).unwrap();
        let mut m = Model::new();
        let hot = |i: u32| format!("a{:03}", [0, 2, 3, 4, 5, 6, 7, 8, 9][(i % 9) as usize] + 10 * (i / 9 % 20));
        let put = |db: &Db, m: &mut Model, i: u32| {
            let (k, v) = (hot(i), format!("v{i}-{}", "x".repeat(900)));
            db.put(&k, &v).unwrap();
            m.insert(k.into_bytes(), v.into_bytes());
        };
        // A batch whose record lands in the cold partition's segment (its first key's) and
        // also writes `a001`: the cold key, never overwritten or flushed, keeps that segment
        // (and the stale `a001` in it) alive.
        let mut b = WriteBatch::new();
        b.put([0xf0, b'c'], b"cold");
        b.put(b"a001", b"old");
        db.write(b).unwrap();
        m.insert(vec![0xf0, b'c'], b"cold".to_vec());
        for i in 0..300 {
            put(&db, &mut m, i);
        }
        // `a001` is deleted; its partition stays hot, so the delete is flushed and its
        // segment recycled.
        db.delete(b"a001").unwrap();
        m.remove(&b"a001"[..]);
        for i in 300..2300 {
            put(&db, &mut m, i);
        }
        db.compact().unwrap();
        db.close().unwrap();
        drop(db);
        let (s, w) = salvage_all(&dev, &fs);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), m);
        // The write buffer still holds the batch's covered `a001`; reported as live data it
        // would bring the deleted key back.
        assert!(w.covered_entries.iter().any(|e| e.0 == b"a001" && e.1.as_deref() == Some(&b"old"[..])), "{w:?}");
        let mut wrong = Salvaged::default();
        walk(&ctx(&dev, &fs), &mut wrong).unwrap();
        for (k, v, o) in &w.covered_entries {
            wrong.record(k, v.as_deref(), *o);
        }
        assert_eq!(live(&wrong).get(&b"a001"[..]), Some(&b"old".to_vec()), "the deleted key would come back");
    }

    #[test]
    fn a_crashed_store_salvages_to_what_recovery_opens() {
        // No clean-shutdown image: the end of each segment's log is found by checksums
        // alone, as recovery finds it.
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = Db::open(dir(), crate::testing::sim_options(Preset::Lightkv, &dev, &fs)).unwrap();
        let mut checked = 0;
        for i in 0..1200u32 {
            let k = format!("k{:03}", (i * 13) % 150);
            if i % 6 == 1 {
                db.delete(&k).unwrap();
            } else {
                db.put(&k, format!("v{i}-{}", "y".repeat((i % 70) as usize))).unwrap();
            }
            if i % 150 == 149 {
                for evict in [0.0, 0.5, 1.0] {
                    let (d, f) = (dev.simulate_crash(u64::from(i), evict), fs.crash());
                    let (s, _) = salvage_all(&d, &f);
                    assert!(s.lost.is_empty(), "{i}: {:?}", s.lost);
                    let (d2, f2) = (d.simulate_crash(0, 0.0), f.crash());
                    let reopened = Db::open(dir(), crate::testing::sim_options(Preset::Lightkv, &d2, &f2)).unwrap();
                    let want: Model = reopened.scan(..).unwrap().map(|r| r.unwrap()).collect();
                    assert_eq!(live(&s), want, "{i}: salvage differs from recovery");
                    checked += 1;
                }
            }
        }
        assert!(checked > 0);
    }

    #[test]
    fn after_a_crash_a_damaged_last_write_is_reported_not_taken_for_a_torn_one() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = Db::open(dir(), crate::testing::sim_options(Preset::Lightkv, &dev, &fs)).unwrap();
        let mut m = Model::new();
        for i in 0..300u32 {
            let (k, v) = (format!("k{:03}", (i * 13) % 90), format!("v{i}-{}", "z".repeat((i % 40) as usize)));
            db.put(&k, &v).unwrap();
            m.insert(k.into_bytes(), v.into_bytes());
        }
        let (d, f) = (dev.simulate_crash(1, 0.0), fs.crash());
        drop(db);
        // The newest write: the last record of its segment, no image to say where the log ends.
        let (at, key) = {
            let pm = open_pm(&ctx(&d, &f), &mut Salvaged::default()).unwrap();
            let mut newest: Option<(u64, u64, Vec<u8>)> = None;
            for slot in 0..SEG_SLOTS {
                let sa = DIR_ADDR + slot * SLOT_LEN;
                let (addr, id) = (pm.word(sa).unwrap(), pm.word(sa + 8).unwrap());
                if id == 0 {
                    continue;
                }
                let (_, size) = segment_at(&pm, addr).unwrap();
                let (rs, _) = pwb::scan(pm.slice(addr, size as usize).unwrap(), id).unwrap();
                if let Some(r) = rs.last().filter(|r| newest.as_ref().is_none_or(|n| r.seq > n.0)) {
                    let e = r.entries.last().unwrap();
                    newest = Some((r.seq, addr + (e.off + pwb::ENTRY_HEADER + e.key.len()) as u64, e.key.to_vec()));
                }
            }
            let (_, at, key) = newest.unwrap();
            (at as usize, key)
        };
        let img = d.durable_image(0).unwrap();
        assert!(d.poke(0, at, &[img[at] ^ 0x5a]));
        let (s, _) = salvage_all(&d, &f);
        assert!(!s.lost.is_empty(), "a damaged last write taken for the end of the log");
        assert_ne!(live(&s).get(&key), m.get(&key));
    }

    #[test]
    fn a_damaged_pwb_value_is_reported_with_its_key() {
        let (dev, fs, m) = build();
        // A write-buffer entry holding the newest version of its key (the image's top
        // leaves index exactly those), with a value.
        let (addr, key) = {
            let pm = open_pm(&ctx(&dev, &fs), &mut Salvaged::default()).unwrap();
            let img = load_image(&pm).expect("a clean close writes the image");
            let found = img.partitions.iter().flat_map(|p| p.2.offsets()).find_map(|off| {
                let b = pm.slice(off, pwb::ENTRY_HEADER)?;
                let (klen, vlen) = pwb::entry_lens(b)?;
                let (kind, k, v, _) = pwb::decode_entry(pm.slice(off, pwb::ENTRY_HEADER + klen + vlen)?)?;
                (kind == Kind::Put && !v.is_empty() && m.get(k).map(|x| x.as_slice()) == Some(v))
                    .then(|| (off + (pwb::ENTRY_HEADER + klen) as u64, k.to_vec()))
            });
            found.expect("a live PWB entry with a value")
        };
        let img = dev.durable_image(0).unwrap();
        assert!(dev.poke(0, addr as usize, &[img[addr as usize] ^ 0x5a]));
        let (s, _) = salvage_all(&dev, &fs);
        assert!(s.lost.iter().any(|l| l.key.as_ref() == Some(&key)), "{:?}", s.lost);
        only_reported_keys_differ(&s, &m);
        assert_ne!(live(&s).get(&key), m.get(&key), "the damaged write is dropped");
    }

    #[test]
    fn a_damaged_table_block_is_reported_by_the_keys_its_pm_leaf_names() {
        let (dev, fs, m) = build();
        let mut names = fs.list(&dir()).unwrap();
        names.retain(|n| n.ends_with(".sst"));
        names.sort();
        let mut damaged = 0;
        for name in names {
            let path = dir().join(&name);
            let data = fs.read_all(&path).unwrap();
            let ix = table_index(&data).unwrap();
            // The last payload byte of a block ending in a put with a value: the block's
            // keys still parse, its checksum fails.
            let Some(at) = ix.iter().find_map(|&(o, size)| {
                let p = data.get(o as usize..o as usize + size - 4)?;
                let last = sstable::block_entries(p).map_while(|e| e.ok()).last()?;
                (last.kind == sstable::Kind::Put && !last.value.is_empty()).then_some(o as usize + size - 5)
            }) else {
                continue;
            };
            let copy = fs.crash();
            copy.poke(&path, at, &[data[at] ^ 0x21]).unwrap();
            let (s, _) = salvage_all(&dev.simulate_crash(0, 0.0), &copy);
            assert!(!s.lost.is_empty(), "{name}: damage went unnoticed");
            only_reported_keys_differ(&s, &m);
            damaged += 1;
        }
        assert!(damaged > 0);
    }

    #[test]
    fn damage_in_a_pm_leafs_buckets_or_a_pool_header_loses_nothing() {
        let (dev, fs, m) = build();
        let leaf_addr = {
            let pm = open_pm(&ctx(&dev, &fs), &mut Salvaged::default()).unwrap();
            (0..CHAIN_SLOTS)
                .filter_map(|s| pm.word(CHAIN_DIR_ADDR + s * 8).filter(|&a| a != 0))
                .find_map(|a| read_chain(&pm, a).ok()?.leaves.first().copied())
                .expect("a chain")
        };
        let img = dev.durable_image(0).unwrap();
        let at = leaf_addr as usize + LEAF_HEADER + 70;
        let d = dev.simulate_crash(0, 0.0);
        assert!(d.poke(0, at, &[img[at] ^ 0x5a]));
        let (s, _) = salvage_all(&d, &fs);
        assert!(s.lost.is_empty(), "the leaf is rebuilt from its table: {:?}", s.lost);
        assert_eq!(live(&s), m);
        // A damaged header byte is caught (and its table still read).
        let d = dev.simulate_crash(0, 0.0);
        let at = leaf_addr as usize + 33;
        assert!(d.poke(0, at, &[img[at] ^ 0x5a]));
        let (s, _) = salvage_all(&d, &fs);
        assert!(s.lost.iter().any(|l| l.key.is_none()), "{:?}", s.lost);
        // A damaged pool header: the pool is read as it stands.
        let d = dev.simulate_crash(0, 0.0);
        assert!(d.poke(0, 20, &[img[20] ^ 0x5a]));
        let (s, _) = salvage_all(&d, &fs);
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        assert_eq!(live(&s), m);
    }
}
