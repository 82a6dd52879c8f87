//! Salvage of a `slmdb` store for `tierkv repair` ([`crate::repair`]).
//!
//! The walk reads the store read-only (PM through the region, files through the store's file
//! seam) and never runs recovery: nothing is unlinked, repaired or deleted.
//!
//! # What is walked
//! - **PM region.** Opened as recovery opens it. When a pool header fails its checks (or
//!   the store's identity is unknown because `OPTIONS` is damaged), the pools are copied
//!   into a private in-memory device with fresh headers and read from there, so one
//!   damaged 64-byte header does not cost the MemTables and the B+-tree. A pool whose
//!   intact header names another store is never read.
//! - **Root slots** ([`layout::Root`]): the valid slot with the higher generation. When the
//!   other slot holds damaged bytes, the survivor may be one update behind the damaged one;
//!   the only update that matters here is a MemTable rotation, so PM is also scanned for
//!   MemTable arenas created after the survivor (`gen >= next_mem_gen`).
//! - **MemTables** (the root's MemTable and Immutable MemTable, plus arenas found by that
//!   scan): each bottom-level list is followed from its head and every node verified with
//!   [`memtable::read_node`]; a batch with fewer reachable nodes than its size was in flight
//!   at a crash and is not reported (recovery unlinks it). An Immutable MemTable whose
//!   generation the MANIFEST's counter already covers was flushed and is skipped (recovery
//!   drops it). A node that fails its checksum is reported lost and the walk goes on through
//!   its `next` pointer (which the checksum does not cover); a link that leaves the arena, or
//!   leads to a node out of key order, ends the walk and is reported lost.
//! - **B+-tree** (SLM-DB's index, the authority on which keys SSTables hold, since SSTables
//!   carry no deletion markers): leaves are found by descending from the root through
//!   verified inner records *and* by following the leaf sibling chain, so damage to an inner
//!   node or to one sibling pointer is bridged by the other path. Every slot's record is
//!   verified (re-encoded with [`encode_record`]); each leaf covers the key range its
//!   parent's separators (or its own `low` record and its sibling's) give it. Damaged or
//!   misplaced slots leave *holes* between the neighbouring keys, unreadable leaves leave
//!   *gaps* in the key space.
//! - **SSTables** (shared format, [`salvage_sstable`]): the block each tree entry names is
//!   read, verified and searched for the key. Only when the tree has holes or gaps are all
//!   the live SSTables scanned (see below).
//! - **MANIFEST**: read (damaged records skipped) for the flush counter, and, when it reads
//!   cleanly and no job is in flight, for each file's live-key count: the B+-tree must have
//!   exactly that many entries pointing at the file. When every count matches, the tree walk
//!   provably found every live entry, and holes and gaps it met (a damaged node header or
//!   sibling pointer, garbage in an unused slot) cost nothing and are not reported. A count
//!   that does not match is reported lost (without a key) even when the walk saw no damage.
//!
//! The compaction logs are not needed: a compaction copies values, so whether a key points
//! at a compaction's input or output its value is the same; a flush in flight is covered by
//! its Immutable MemTable, which is reported.
//!
//! # Order (newest wins)
//! From newest to oldest tier ([`Order`] bits):
//! 1. MemTable nodes: `2^127 | generation << 64 | sequence number`. A newer MemTable has a
//!    larger generation; within one, a newer node a larger sequence number. Deletes are
//!    reported as deletes and hide everything below.
//! 2. Entries the B+-tree names (`2^126`): one per key, the key's current SSTable version.
//!    Keys the tree does not hold are deleted (or were never flushed), so SSTable entries
//!    without a tree entry — stale versions, deleted keys — are **not** reported: they would
//!    come back.
//! 3. A damaged tree record whose key is corroborated (its key lies between its neighbours
//!    and some SSTable holds it): the version in the block the record names when that block
//!    has the key, else the one in the newest file (`2^125 | file number`). The key is
//!    reported lost.
//! 4. Where the tree cannot say which keys exist (a gap or an uncorroborated hole) but the
//!    MANIFEST's live counts are exact, each file's number of entries missing from the tree
//!    is known. In those key ranges (keys the tree does not hold), a file the tree lacks no
//!    entry of holds only stale versions and deleted keys: dropped. A file whose entries
//!    there are exactly as many as it lacks holds just its lost entries: kept at tier 2, each
//!    reported lost with its key.
//! 5. Otherwise (no exact counts, or a file with more entries there than it lacks) every
//!    SSTable entry of those files in those key ranges is kept (`2^124 | file number`: the
//!    newest file wins),
//!    as LevelDB's repair keeps what tables hold. This may bring back a key deleted there or
//!    an older version of a key (file numbers follow version order except when a background
//!    flush races a compaction); both are covered by the lost record reported (without a
//!    key) for the gap or hole.
//!
//! # What cannot be recovered
//! - A key whose SSTable block fails its checksum, or whose block lacks it, is reported
//!   lost with its key and dropped — not rolled back to an older version the tree no longer
//!   names (that version may be one a later delete removed).
//! - Past a MemTable link that leaves its arena the rest of that list is lost (reported
//!   without keys): the arena cannot be scanned for the tail, since reused PM holds stale
//!   nodes of older MemTables that verify as well.
//! - The `next` words of MemTable nodes and the slots and sibling pointers of tree nodes are
//!   not checksummed (they are changed by 8-byte atomic stores). A pointer damaged into
//!   another valid object is caught by key order, by the checks above, and (for the tree) by
//!   the MANIFEST live counts; one damaged into exactly zero silently shortens a MemTable
//!   list, as it would for recovery.
//! - With both root slots damaged, the MemTables are found by scanning for arenas newer than
//!   the MANIFEST's counter (reported lost, without a key, since the scan cannot be sure).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;

use super::layout::{self, Root};
use super::memtable::{self, encode_arena_header, ARENA_MAGIC, KIND_PUT, NODE_HEADER};
use super::{path_of, table_number};
use crate::engine::EngineCtx;
use crate::error::{Error, Result};
use crate::format::log::{read_log, WalRecovery};
use crate::format::Cursor;
use crate::fs::Fs;
use crate::index::pbtree::{encode_header, encode_record, Loc, PTree, NODE, NODE_MAGIC, REC_HEADER, SLOTS};
use crate::manifest::{decode_edits, Manifest, Version, MAGIC as MANIFEST_MAGIC};
use crate::pm::sim::SimDevice;
use crate::pm::{encode_pool_header, Backing, Region, RegionConfig, POOL_HEADER_LEN};
use crate::repair::{salvage_sstable, Lost, Order, SalvageSink};
use crate::sstable::Kind;

/// Tier of the entries the B+-tree names (module docs, "Order").
const TREE_ORDER: Order = 1 << 126;
/// Tier of a damaged tree record's corroborated key (plus the file number).
const HOLE_TIER: Order = 1 << 125;
/// Tier of SSTable entries kept where the tree has a gap (plus the file number).
const GAP_TIER: Order = 1 << 124;
/// Kind byte of a leaf record (docs/format/slmdb.md, "B+-tree").
const REC_LEAF: u8 = 1;
/// Kind byte of an inner (separator) record.
const REC_INNER: u8 = 2;

/// The order of a MemTable node of generation `gen` with sequence number `seq`.
fn mem_order(gen: u64, seq: u64) -> Order {
    (1 << 127) | (u128::from(gen.min(u64::MAX >> 1)) << 64) | u128::from(seq)
}

/// Walk the store read-only and report every intact record and every damaged one (module
/// docs).
pub(crate) fn salvage(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<()> {
    let man = read_manifest(ctx)?;
    let pm = open_pm(ctx, sink)?;
    let mut quiescent = false;
    let tree = match &pm {
        Some(pm) => {
            let roots = read_roots(&pm.region);
            quiescent = roots.trusted && roots.best.is_some_and(|r| r.log == 0 && r.flush_log == 0);
            walk_memtables(pm, &roots, man.as_ref(), sink);
            walk_tree(&pm.region)
        }
        None => TreeWalk::default(),
    };
    // The live counts are exact only when the MANIFEST read cleanly and no job was in flight.
    let counts = man.as_ref().filter(|m| m.exact && quiescent).map(|m| &m.version);
    salvage_tables(ctx, pm.as_ref(), tree, man.as_ref(), counts, sink)
}

// ---------------------------------------------------------------------------------------
// PM region and naming

/// The PM region being read, and the file name of each pool for lost records.
struct Pm {
    region: Region,
    /// Pool file names (the real ones when the region is a private copy).
    paths: Vec<PathBuf>,
}

impl Pm {
    /// A lost record at global PM offset `addr`.
    fn lost(&self, addr: u64, key: Option<Vec<u8>>, detail: impl Into<String>) -> Lost {
        let (file, offset) = self.region.locate(addr);
        let pool = usize::try_from(addr / self.region.pool_size()).unwrap_or(usize::MAX);
        let file = self.paths.get(pool).cloned().unwrap_or(file);
        Lost { file, offset, key, detail: detail.into() }
    }
}

/// Where the pools of the store live: their directory, or `None` on the simulator.
fn pool_dir(ctx: &EngineCtx) -> Option<PathBuf> {
    match &ctx.opts.pm_device {
        Some(_) => None,
        None => Some(ctx.opts.pm_path.clone().unwrap_or_else(|| ctx.dir.join("pm"))),
    }
}

fn pool_path(ctx: &EngineCtx, i: usize) -> PathBuf {
    match pool_dir(ctx) {
        Some(d) => d.join(format!("pool-{i:06}")),
        None => PathBuf::from(format!("<sim>/pool-{i:06}")),
    }
}

/// Open the PM region (see the module docs for the private copy made when a pool header is
/// damaged). `None`, with a lost record, when no region can be read.
fn open_pm(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<Option<Pm>> {
    let first = match crate::engine::open_region(ctx) {
        Ok(region) => {
            let paths = (0..region.pool_count()).map(|i| region.locate(region.addr(i, 0)).0).collect();
            return Ok(Some(Pm { region, paths }));
        }
        Err(e) => e,
    };
    let whole_pm_lost = |sink: &mut dyn SalvageSink, why: String| {
        sink.lost(Lost {
            file: pool_path(ctx, 0),
            offset: 0,
            key: None,
            detail: format!("{why}: the MemTables and the B+-tree are lost; SSTable contents are kept (module docs)"),
        })
    };
    // The pools' bytes, from the simulator's durable images or the pool files.
    let mut images: Vec<Vec<u8>> = Vec::new();
    match (&ctx.opts.pm_device, pool_dir(ctx)) {
        (Some(dev), _) => images.extend((0..dev.pool_count()).map_while(|i| dev.durable_image(i))),
        (None, Some(dir)) => {
            for i in 0.. {
                let p = dir.join(format!("pool-{i:06}"));
                if !p.exists() {
                    break;
                }
                images.push(
                    std::fs::read(&p)
                        .map_err(|e| Error::Io(std::io::Error::new(e.kind(), format!("{}: {e}", p.display()))))?,
                );
            }
        }
        (None, None) => {}
    }
    let size = images.first().map_or(0, Vec::len);
    if !size.is_power_of_two() || size < 4096 || images.iter().any(|i| i.len() != size) {
        whole_pm_lost(sink, format!("the PM region cannot be opened ({first})"));
        return Ok(None);
    }
    for (i, img) in images.iter().enumerate() {
        let h = img.get(..POOL_HEADER_LEN as usize).unwrap_or(&[]);
        let mut c = Cursor::new(h);
        c.skip(16);
        let (Some(pool_size), Some(db)) = (c.u64(), c.u64()) else { continue };
        let intact = encode_pool_header(i as u32, pool_size, db).get(..36) == h.get(..36);
        if intact && ctx.db_id != 0 && db != ctx.db_id {
            whole_pm_lost(sink, format!("PM pool {i} belongs to store {db:#x}, not {:#x}", ctx.db_id));
            return Ok(None);
        }
    }
    let dev = SimDevice::new();
    let region = Region::open(RegionConfig::new(Backing::Sim(dev.clone()), size as u64, ctx.db_id))?;
    for _ in 1..images.len() {
        region.grow()?;
    }
    for (i, img) in images.iter().enumerate() {
        if !dev.poke(i, POOL_HEADER_LEN as usize, img.get(POOL_HEADER_LEN as usize..).unwrap_or(&[])) {
            whole_pm_lost(sink, format!("the PM region cannot be copied ({first})"));
            return Ok(None);
        }
    }
    let paths = (0..images.len()).map(|i| pool_path(ctx, i)).collect();
    Ok(Some(Pm { region, paths }))
}

// ---------------------------------------------------------------------------------------
// MANIFEST

/// What the MANIFEST says.
struct Man {
    version: Version,
    /// Read whole: `CURRENT` named it, every record verified and decoded.
    exact: bool,
}

/// Read the current MANIFEST, skipping damaged records (`exact` is then false); `None`
/// when there is none to read.
fn read_manifest(ctx: &EngineCtx) -> Result<Option<Man>> {
    let (fs, dir) = (&ctx.fs, &ctx.dir);
    let names = fs.list(dir)?;
    let newest = names.iter().filter_map(|n| n.strip_prefix("MANIFEST-")?.parse::<u64>().ok()).max();
    let current = fs
        .read_all(&dir.join("CURRENT"))
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|s| s.strip_suffix('\n')?.strip_prefix("MANIFEST-")?.parse::<u64>().ok())
        .filter(|n| names.contains(&Manifest::name(*n)));
    let (n, mut exact) = match (current, newest) {
        (Some(c), _) => (c, true),
        (None, Some(n)) => (n, false),
        (None, None) => return Ok(None),
    };
    let data = match fs.read_all(&dir.join(Manifest::name(n))) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    exact &= data.get(..8) == Some(MANIFEST_MAGIC.as_slice());
    let Ok(read) = read_log(data.get(8..).unwrap_or(&[]), 8, WalRecovery::SkipDamaged) else { return Ok(None) };
    exact &= read.dropped.is_empty();
    if read.records.is_empty() {
        return Ok(None);
    }
    let mut version = Version::default();
    for (_, payload) in &read.records {
        match decode_edits(payload) {
            Ok(edits) => version.apply(&edits),
            Err(_) => exact = false,
        }
    }
    Ok(Some(Man { version, exact }))
}

// ---------------------------------------------------------------------------------------
// Root and MemTables

/// The root slots.
struct Roots {
    /// The valid slot with the higher generation.
    best: Option<Root>,
    /// No slot holds damaged bytes (each is valid or blank).
    trusted: bool,
}

fn read_roots(r: &Region) -> Roots {
    let mut best: Option<Root> = None;
    let mut trusted = true;
    for &a in &layout::ROOT_SLOTS {
        match r.slice(a, 64) {
            Some(b) => match Root::decode(b) {
                Some(root) => {
                    if best.is_none_or(|x| root.gen > x.gen) {
                        best = Some(root);
                    }
                }
                None => trusted &= b.iter().all(|&x| x == 0),
            },
            None => trusted = false,
        }
    }
    Roots { best, trusted }
}

/// Generation and size of the verified arena header `h` (64 bytes).
fn arena_header(h: &[u8]) -> Option<(u64, u64)> {
    let mut c = Cursor::new(h);
    if c.u64()? != ARENA_MAGIC {
        return None;
    }
    let (gen, size) = (c.u64()?, c.u64()?);
    let want = encode_arena_header(gen, size);
    (want.get(..24) == h.get(..24) && want.get(32..36) == h.get(32..36)).then_some((gen, size))
}

/// Every verified arena header in the PM heap with a generation of at least `min_gen`.
fn scan_arenas(r: &Region, min_gen: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for i in 0..r.pool_count() {
        let start = if i == 0 { layout::HEAP_START } else { r.addr(i, POOL_HEADER_LEN) };
        let end = r.addr(i + 1, 0);
        let mut a = start;
        while a + 64 <= end {
            if let Some((gen, _)) = r.slice(a, 64).and_then(arena_header) {
                if gen >= min_gen {
                    out.push((a, gen));
                }
            }
            a += 64;
        }
    }
    out
}

fn walk_memtables(pm: &Pm, roots: &Roots, man: Option<&Man>, sink: &mut dyn SalvageSink) {
    let counter = man.map(|m| m.version.counter);
    let Some(root) = roots.best else {
        if roots.trusted {
            return; // both slots blank: the store never had a MemTable
        }
        match counter {
            Some(c) => {
                sink.lost(pm.lost(
                    layout::ROOT_SLOTS[0],
                    None,
                    "both root slots fail their checks: the MemTables are looked for by scanning PM for arenas \
                     newer than the last flushed one",
                ));
                for (a, gen) in scan_arenas(&pm.region, c.saturating_add(1)) {
                    walk_arena(pm, a, gen, None, sink);
                }
            }
            None => sink.lost(pm.lost(
                layout::ROOT_SLOTS[0],
                None,
                "both root slots fail their checks and the MANIFEST is unreadable: the MemTables are lost",
            )),
        }
        return;
    };
    let newest = root.next_mem_gen.saturating_sub(1);
    let mut walked = HashSet::new();
    if root.active != 0 {
        walked.insert(root.active);
        walk_arena(pm, root.active, newest, None, sink);
    }
    if root.imm != 0 && walked.insert(root.imm) {
        walk_arena(pm, root.imm, newest.saturating_sub(1), counter, sink);
    }
    if !roots.trusted {
        // The damaged slot may be the newer one: a MemTable it published is newer than
        // everything the surviving slot names.
        for (a, gen) in scan_arenas(&pm.region, root.next_mem_gen) {
            if walked.insert(a) {
                walk_arena(pm, a, gen, counter, sink);
            }
        }
    }
}

/// A verified MemTable node.
struct MemNode {
    key: Vec<u8>,
    value: Vec<u8>,
    seq: u64,
    base: u64,
    kind: u8,
}

/// Report the nodes of the MemTable arena at `addr` (module docs). `gen_hint` orders its
/// nodes when its header is damaged; with `flushed_upto`, an arena whose generation is at
/// most that counter was flushed and is skipped.
fn walk_arena(pm: &Pm, addr: u64, gen_hint: u64, flushed_upto: Option<u64>, sink: &mut dyn SalvageSink) {
    let r = &pm.region;
    let head_word = addr + 24;
    let Some(h) = r.slice(addr, 64) else {
        sink.lost(pm.lost(addr, None, "MemTable arena lies outside the PM region"));
        return;
    };
    let pool_end = (addr / r.pool_size() + 1) * r.pool_size();
    let (gen, end, verified) = match arena_header(h) {
        Some((gen, size)) if size >= 64 && r.slice(addr, size as usize).is_some() => (gen, addr + size, true),
        // The header is damaged: its generation is unknown (`gen_hint` keeps the MemTable
        // below the newer one), its end is bounded by the pool. Its `head` is read anyway,
        // and it is walked even if it may have been flushed (its nodes are then the newest
        // versions of their keys all the same: no newer MemTable was flushed after it).
        _ => (gen_hint, pool_end, false),
    };
    if verified && flushed_upto.is_some_and(|c| gen <= c) {
        return; // flushed: recovery drops it, the tree holds its result
    }
    let mut head = match r.load_u64_atomic(head_word) {
        Ok(h) => h,
        Err(_) => return,
    };
    let lo = addr + 64;
    let ok_ptr = |p: u64| p >= lo && p.saturating_add(NODE_HEADER) <= end && p.is_multiple_of(8);
    let limit = (end - lo) / NODE_HEADER + 1;
    let mut nodes: Vec<MemNode> = Vec::new();
    let mut batches: HashMap<u64, (u32, u32)> = HashMap::new();
    let mut seen: HashSet<u64> = HashSet::new();
    let mut prev: Option<(Vec<u8>, u64)> = None;
    let mut pred = head_word;
    while head != 0 {
        let cur = head;
        if !ok_ptr(cur) || !seen.insert(cur) || seen.len() as u64 > limit {
            sink.lost(pm.lost(
                pred,
                None,
                format!("MemTable link points outside its arena or back into the list ({cur:#x}): the rest of the list is lost"),
            ));
            break;
        }
        match memtable::read_node(r, cur) {
            Ok(n) => {
                let in_order = prev
                    .as_ref()
                    .is_none_or(|(pk, ps)| (pk.as_slice(), std::cmp::Reverse(*ps)) < (n.key, std::cmp::Reverse(n.seq)));
                if !in_order {
                    sink.lost(pm.lost(
                        pred,
                        None,
                        "MemTable link leads to a node out of key order: the rest of the list is lost",
                    ));
                    break;
                }
                let base = n.seq.wrapping_sub(u64::from(n.batch_i));
                batches.entry(base).or_insert((n.batch_n, 0)).1 += 1;
                nodes.push(MemNode { key: n.key.to_vec(), value: n.value.to_vec(), seq: n.seq, base, kind: n.kind });
                prev = Some((n.key.to_vec(), n.seq));
                pred = cur;
                head = n.next;
            }
            Err(_) => {
                // The checksum does not cover `next`: go on through it. The node's batch
                // fields (unverified) still count towards its batch when readable.
                let guess = memtable::read_node_trusted(r, cur).ok();
                let probably = guess.map(|g| format!(" (its key reads {})", crate::escape(g.key))).unwrap_or_default();
                sink.lost(pm.lost(cur, None, format!("MemTable node fails its checksum{probably}")));
                if let Some(g) = guess {
                    batches.entry(g.seq.wrapping_sub(u64::from(g.batch_i))).or_insert((g.batch_n, 0)).1 += 1;
                }
                pred = cur;
                head = match guess {
                    Some(g) => g.next,
                    None => r.load_u64_atomic(cur).unwrap_or(0),
                };
            }
        }
    }
    for n in &nodes {
        // A batch with fewer reachable nodes than its size was in flight at a crash (never
        // acknowledged): recovery unlinks it.
        if batches.get(&n.base).is_some_and(|(size, seen)| seen >= size) {
            let value = (n.kind == KIND_PUT).then_some(n.value.as_slice());
            sink.record(&n.key, value, mem_order(gen, n.seq));
        }
    }
}

// ---------------------------------------------------------------------------------------
// B+-tree

/// A position on the key line: `(0, [], 0)` is before every key, `(2, [], 0)` after every
/// key; `(1, k, 0)` is just before key `k`, `(1, k, 1)` just after it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Pos(u8, Vec<u8>, u8);

impl Pos {
    fn start() -> Pos {
        Pos(0, Vec::new(), 0)
    }
    fn end() -> Pos {
        Pos(2, Vec::new(), 0)
    }
    fn before(k: &[u8]) -> Pos {
        Pos(1, k.to_vec(), 0)
    }
    fn after(k: &[u8]) -> Pos {
        Pos(1, k.to_vec(), 1)
    }
}

impl std::fmt::Display for Pos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            0 => f.write_str("-inf"),
            2 => f.write_str("+inf"),
            _ if self.2 == 0 => write!(f, "[{}", crate::escape(&self.1)),
            _ => write!(f, "({}", crate::escape(&self.1)),
        }
    }
}

/// `[a, b)` on the key line: holds key `k` when `a <= before(k)` and `after(k) <= b`.
type Span = (Pos, Pos);

fn span_text(s: &Span) -> String {
    format!("{} .. {}", s.0, s.1)
}

/// Sort and merge overlapping spans.
fn merge_spans(mut v: Vec<Span>) -> Vec<Span> {
    v.retain(|s| s.0 < s.1);
    v.sort();
    let mut out: Vec<Span> = Vec::with_capacity(v.len());
    for s in v {
        match out.last_mut() {
            Some(l) if s.0 <= l.1 => {
                if s.1 > l.1 {
                    l.1 = s.1;
                }
            }
            _ => out.push(s),
        }
    }
    out
}

/// True when one of `spans` (merged) holds `key`.
fn in_spans(spans: &[Span], key: &[u8]) -> bool {
    let (b, a) = (Pos::before(key), Pos::after(key));
    let i = spans.partition_point(|s| s.0 <= b);
    i > 0 && spans.get(i - 1).is_some_and(|s| a <= s.1)
}

/// The parts of the key line no span covers.
fn complement(covered: &[Span]) -> Vec<Span> {
    let mut out = Vec::new();
    let mut cur = Pos::start();
    for s in covered {
        if s.0 > cur {
            out.push((cur.clone(), s.0.clone()));
        }
        if s.1 > cur {
            cur = s.1.clone();
        }
    }
    if cur < Pos::end() {
        out.push((cur, Pos::end()));
    }
    out
}

/// A decoded node header.
#[derive(Debug, Clone, Copy)]
struct NodeHdr {
    /// Magic and checksum verify.
    ok: bool,
    level: u8,
    sibling: u64,
    leftmost: u64,
    low: u64,
}

/// The header of the node at `addr` (`None` when no node can be there).
fn node_hdr(r: &Region, addr: u64) -> Option<NodeHdr> {
    if addr == 0 || !addr.is_multiple_of(64) {
        return None;
    }
    r.slice(addr, NODE as usize)?;
    let h = r.slice(addr, 64)?;
    let mut c = Cursor::new(h);
    let magic = c.u32()?;
    let level = c.u8()?;
    c.skip(3)?;
    let stored = c.bytes(4)?;
    c.skip(4)?;
    let (sibling, leftmost, low) = (c.u64()?, c.u64()?, c.u64()?);
    let ok = magic == NODE_MAGIC && encode_header(level, sibling, leftmost, low).get(8..12) == Some(stored);
    Some(NodeHdr { ok, level, sibling, leftmost, low })
}

/// A decoded tree record.
#[derive(Debug, Clone)]
struct RecView {
    /// Checksum (and padding) verify.
    ok: bool,
    kind: u8,
    key: Vec<u8>,
    a: u64,
    b: u64,
    c: u32,
    /// Entry offset + 1 (0: not known).
    d: u32,
}

impl RecView {
    fn loc(&self) -> Loc {
        Loc { file: self.a, offset: self.b, size: self.c, entry: self.d.checked_sub(1) }
    }
}

/// The record at `addr` (`None` when no record can be there).
fn record_at(r: &Region, addr: u64) -> Option<RecView> {
    if addr == 0 || !addr.is_multiple_of(64) {
        return None;
    }
    let h = r.slice(addr, REC_HEADER as usize)?;
    let mut c = Cursor::new(h);
    c.skip(4)?;
    let kind = c.u8()?;
    c.skip(1)?;
    let klen = c.u16()? as usize;
    let (a, b, cc, d) = (c.u64()?, c.u64()?, c.u32()?, c.u32()?);
    let all = r.slice(addr, REC_HEADER as usize + klen)?;
    let key = all.get(REC_HEADER as usize..)?.to_vec();
    let ok = encode_record(kind, &key, a, b, cc, d).as_slice() == all;
    Some(RecView { ok, kind, key, a, b, c: cc, d })
}

/// A stretch of a leaf where entries may be missing.
#[derive(Debug, Clone)]
struct Hole {
    /// PM address of the first damaged slot.
    addr: u64,
    /// The keys it may hide.
    span: Span,
    /// Keys and locations read from damaged records in it (unverified).
    guesses: Vec<(Vec<u8>, Loc)>,
    detail: String,
}

/// What the tree walk found.
#[derive(Debug, Default)]
struct TreeWalk {
    /// Verified entries of the readable leaves, within each leaf's range.
    entries: BTreeMap<Vec<u8>, Loc>,
    /// Keys with two entries that disagree (one is kept).
    conflicts: BTreeSet<Vec<u8>>,
    /// Key ranges readable leaves cover (merged).
    coverage: Vec<Span>,
    /// Damaged stretches inside readable leaves.
    holes: Vec<Hole>,
}

/// What is known of a leaf from the path that found it.
#[derive(Debug, Clone, Default)]
struct LeafCtx {
    lo: Option<Pos>,
    hi: Option<Pos>,
}

struct Walker<'r> {
    r: &'r Region,
    leaves: BTreeMap<u64, LeafCtx>,
    inner_seen: HashSet<u64>,
}

fn min_pos(a: Option<Pos>, b: Option<Pos>) -> Option<Pos> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn max_pos(a: Option<Pos>, b: Option<Pos>) -> Option<Pos> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

impl Walker<'_> {
    /// Descend from `node`, which holds keys in `[lo, hi)` (`None`: unknown) and sits at
    /// level `expect` (when the parent is verified).
    fn visit(&mut self, node: u64, lo: Option<Pos>, hi: Option<Pos>, expect: Option<u8>, depth: u32) {
        if depth > 64 {
            return;
        }
        let Some(h) = node_hdr(self.r, node) else { return };
        // (is a leaf, the level children must have when known)
        let (leaf, child_level) = if h.ok {
            if expect.is_some_and(|l| l != h.level) {
                return;
            }
            (h.level == 0, h.level.checked_sub(1))
        } else {
            match expect {
                Some(l) => (l == 0, l.checked_sub(1)),
                // A root whose header is damaged: its records tell leaf from inner.
                None => match self.first_record_kind(node) {
                    Some(REC_LEAF) => (true, None),
                    Some(REC_INNER) => (false, None),
                    _ => return,
                },
            }
        };
        if leaf {
            let e = self.leaves.entry(node).or_default();
            if e.lo.is_none() && e.hi.is_none() {
                *e = LeafCtx { lo, hi };
            }
            return;
        }
        if !self.inner_seen.insert(node) {
            return;
        }
        let Ok(slots) = PTree::node_entries(self.r, node) else { return };
        // Separators in order; `None` where the record is damaged or out of order.
        let mut seps: Vec<Option<(Vec<u8>, u64)>> = Vec::with_capacity(slots.len());
        let mut last: Option<Vec<u8>> = None;
        for &a in slots.iter() {
            match record_at(self.r, a) {
                Some(rec) if rec.ok && rec.kind == REC_INNER && last.as_ref().is_none_or(|l| *l < rec.key) => {
                    last = Some(rec.key.clone());
                    seps.push(Some((rec.key, rec.a)));
                }
                _ => seps.push(None),
            }
        }
        let bound_at = |i: usize| -> Option<Pos> {
            match seps.get(i) {
                Some(Some((k, _))) => Some(Pos::before(k)),
                Some(None) => None,
                None => hi.clone(),
            }
        };
        let mut children: Vec<(u64, Option<Pos>, Option<Pos>)> = Vec::new();
        if h.ok {
            children.push((h.leftmost, lo.clone(), bound_at(0)));
        }
        for (i, s) in seps.iter().enumerate() {
            if let Some((k, child)) = s {
                children.push((*child, Some(Pos::before(k)), bound_at(i + 1)));
            }
        }
        for (child, clo, chi) in children {
            self.visit(child, clo, chi, child_level, depth + 1);
        }
    }

    /// Kind of the first verified record among `node`'s slots.
    fn first_record_kind(&self, node: u64) -> Option<u8> {
        let slots = PTree::node_entries(self.r, node).ok()?;
        slots.iter().find_map(|&a| record_at(self.r, a).filter(|r| r.ok).map(|r| r.kind))
    }

    /// Add every leaf reachable through sibling pointers from the leaves found so far.
    fn follow_chains(&mut self) {
        let mut work: Vec<u64> = self.leaves.keys().copied().collect();
        while let Some(l) = work.pop() {
            let Some(sib) = node_hdr(self.r, l).map(|h| h.sibling) else { continue };
            if sib == 0 || self.leaves.contains_key(&sib) {
                continue;
            }
            if node_hdr(self.r, sib).is_some_and(|h| h.ok && h.level == 0) {
                self.leaves.insert(sib, LeafCtx::default());
                work.push(sib);
            }
        }
    }

    /// The key `low` record of leaf `node` names, when it verifies and names this node.
    fn low_key(&self, node: u64, h: &NodeHdr) -> Option<Pos> {
        if h.low == 0 {
            return h.ok.then(Pos::start);
        }
        record_at(self.r, h.low).filter(|r| r.ok && r.a == node).map(|r| Pos::before(&r.key))
    }
}

/// One slot of a leaf.
enum Item {
    /// Key, location, slot address.
    Rec(Vec<u8>, Loc, u64),
    /// Slot address, a guess at its key and location, why.
    Bad(u64, Option<(Vec<u8>, Loc)>, &'static str),
    Zero(u64),
}

/// A run of damaged slots being collected into a [`Hole`]: the first slot's address, the
/// guesses read from its damaged records, why each slot is damaged.
type Pending = (u64, Vec<(Vec<u8>, Loc)>, Vec<&'static str>);

/// Indices of a longest strictly increasing subsequence of `keys` (at most [`SLOTS`]).
fn increasing(keys: &[&[u8]]) -> Vec<usize> {
    let n = keys.len();
    // (length of the best run ending here, its previous index)
    let mut best: Vec<(usize, Option<usize>)> = vec![(1, None); n];
    for i in 0..n {
        for j in 0..i {
            if keys[j] < keys[i] && best[j].0 + 1 > best[i].0 {
                best[i] = (best[j].0 + 1, Some(j));
            }
        }
    }
    let mut cur = (0..n).max_by_key(|&i| (best[i].0, std::cmp::Reverse(i)));
    let mut out = Vec::new();
    while let Some(i) = cur {
        out.push(i);
        cur = best[i].1;
    }
    out.reverse();
    out
}

/// Walk the B+-tree (module docs): entries, coverage and holes.
fn walk_tree(r: &Region) -> TreeWalk {
    let mut out = TreeWalk::default();
    let Ok(root) = r.load_u64_atomic(layout::ANCHOR_ADDR + 8) else { return out };
    let mut w = Walker { r, leaves: BTreeMap::new(), inner_seen: HashSet::new() };
    w.visit(root, Some(Pos::start()), Some(Pos::end()), None, 0);
    w.follow_chains();
    let mut coverage = Vec::new();
    for (&node, ctx) in &w.leaves {
        let Some(h) = node_hdr(r, node) else { continue };
        let lo_known = max_pos(ctx.lo.clone(), w.low_key(node, &h));
        let from_sib = if h.sibling == 0 {
            Some(Pos::end())
        } else if w.leaves.contains_key(&h.sibling) {
            node_hdr(r, h.sibling).filter(|s| s.low != 0).and_then(|s| w.low_key(h.sibling, &s))
        } else {
            None
        };
        let hi_known = min_pos(ctx.hi.clone(), from_sib);
        leaf(r, node, lo_known, hi_known, &mut out, &mut coverage);
    }
    out.coverage = merge_spans(coverage);
    out
}

/// Read leaf `node` whose range is `[lo, hi)` where known; add its entries, holes and
/// coverage.
fn leaf(r: &Region, node: u64, lo: Option<Pos>, hi: Option<Pos>, out: &mut TreeWalk, coverage: &mut Vec<Span>) {
    let Some(raw) = r.slice(node + 64, 8 * SLOTS) else { return };
    let mut items: Vec<Item> = Vec::with_capacity(SLOTS);
    let mut last = 0u64;
    for (i, w) in raw.chunks_exact(8).enumerate() {
        let v = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        let slot = node + 64 + 8 * i as u64;
        if v != 0 && v == last {
            continue; // the adjacent duplicate a shift leaves
        }
        last = v;
        if v == 0 {
            items.push(Item::Zero(slot));
            continue;
        }
        items.push(match record_at(r, v) {
            Some(rec) if rec.ok && rec.kind == REC_LEAF => {
                let inside = lo.as_ref().is_none_or(|l| *l <= Pos::before(&rec.key))
                    && hi.as_ref().is_none_or(|h| Pos::after(&rec.key) <= *h);
                if !inside {
                    // Outside the leaf's range: the stale upper half of a split that the
                    // crash left before truncating (its entries are in the sibling).
                    continue;
                }
                Item::Rec(rec.key.clone(), rec.loc(), slot)
            }
            Some(rec) if rec.ok => Item::Bad(slot, None, "slot names a record that is not a leaf entry"),
            Some(rec) => {
                let loc = rec.loc();
                Item::Bad(slot, Some((rec.key, loc)), "B+-tree record fails its checksum")
            }
            None => Item::Bad(slot, None, "B+-tree slot holds no record address"),
        });
    }
    while matches!(items.last(), Some(Item::Zero(_))) {
        items.pop();
    }
    // Entries out of key order are misplaced slots.
    let rec_idx: Vec<usize> =
        items.iter().enumerate().filter_map(|(i, it)| matches!(it, Item::Rec(..)).then_some(i)).collect();
    let keys: Vec<&[u8]> = rec_idx
        .iter()
        .filter_map(|&i| match items.get(i) {
            Some(Item::Rec(k, ..)) => Some(k.as_slice()),
            _ => None,
        })
        .collect();
    let keep: HashSet<usize> = increasing(&keys).into_iter().filter_map(|j| rec_idx.get(j).copied()).collect();
    for (i, it) in items.iter_mut().enumerate() {
        if let Item::Rec(_, _, slot) = it {
            if !keep.contains(&i) {
                *it = Item::Bad(*slot, None, "B+-tree entry out of key order");
            }
        }
    }
    let first = items.iter().find_map(|it| match it {
        Item::Rec(k, ..) => Some(Pos::before(k)),
        _ => None,
    });
    let lastk = items.iter().rev().find_map(|it| match it {
        Item::Rec(k, ..) => Some(Pos::after(k)),
        _ => None,
    });
    let (Some(lower), Some(upper)) = (lo.or(first), hi.or(lastk)) else { return };
    if lower < upper {
        coverage.push((lower.clone(), upper.clone()));
    }
    // Entries, and holes between them.
    let mut prev = lower;
    let mut pending: Option<Pending> = None;
    let mut close = |pending: &mut Option<Pending>, from: &Pos, to: Pos| {
        if let Some((addr, guesses, why)) = pending.take() {
            let span = (from.clone(), to);
            let guesses: Vec<(Vec<u8>, Loc)> =
                guesses.into_iter().filter(|(k, _)| span.0 <= Pos::before(k) && Pos::after(k) <= span.1).collect();
            let mut why: Vec<&str> = why;
            why.dedup();
            out.holes.push(Hole { addr, span, guesses, detail: why.join("; ") });
        }
    };
    for it in items {
        match it {
            Item::Rec(k, loc, _) => {
                close(&mut pending, &prev, Pos::before(&k));
                prev = Pos::after(&k);
                match out.entries.get(&k) {
                    Some(old) if *old != loc => {
                        out.conflicts.insert(k);
                    }
                    Some(_) => {}
                    None => {
                        out.entries.insert(k, loc);
                    }
                }
            }
            Item::Bad(slot, guess, why) => {
                let p = pending.get_or_insert_with(|| (slot, Vec::new(), Vec::new()));
                p.1.extend(guess);
                p.2.push(why);
            }
            Item::Zero(slot) => {
                let p = pending.get_or_insert_with(|| (slot, Vec::new(), Vec::new()));
                p.2.push("a zero slot in the middle of a B+-tree leaf");
            }
        }
    }
    close(&mut pending, &prev, upper);
}

// ---------------------------------------------------------------------------------------
// SSTables

/// Collects the lost blocks [`salvage_sstable`] reports (the keys they cost are known from
/// the tree; see [`salvage_tables`]).
#[derive(Default)]
struct Blocks(Vec<Lost>);

impl SalvageSink for Blocks {
    fn record(&mut self, _key: &[u8], _value: Option<&[u8]>, _order: Order) {}
    fn lost(&mut self, lost: Lost) {
        self.0.push(lost);
    }
}

/// A version of a key found in an SSTable: (file, block offset, value).
type Found = (u64, u64, Vec<u8>);

/// An SSTable entry kept for a key range the tree cannot speak for: (key, value, file).
type Candidate = (Vec<u8>, Vec<u8>, u64);

/// Resolve the tree's entries in the SSTables, decide what the tree's damage costs, and
/// keep SSTable entries where the tree cannot say (module docs). `counts`: the version whose
/// live counts the tree must match, when they are exact.
fn salvage_tables(
    ctx: &EngineCtx,
    pm: Option<&Pm>,
    tree: TreeWalk,
    man: Option<&Man>,
    counts: Option<&Version>,
    sink: &mut dyn SalvageSink,
) -> Result<()> {
    let pm_lost = |addr: u64, key: Option<Vec<u8>>, detail: String| match pm {
        Some(pm) => pm.lost(addr, key, detail),
        None => Lost { file: pool_path(ctx, 0), offset: addr, key, detail },
    };
    let TreeWalk { entries, conflicts, coverage, holes } = tree;
    let gaps = complement(&coverage);
    // Does the tree hold exactly the entries the MANIFEST counts?
    let mut per_file: BTreeMap<u64, u64> = BTreeMap::new();
    for loc in entries.values() {
        *per_file.entry(loc.file).or_insert(0) += 1;
    }
    let counted = counts.map(|v| {
        let files: BTreeSet<u64> = per_file.keys().chain(v.files.keys()).copied().collect();
        files
            .into_iter()
            .filter_map(|f| {
                let (got, want) = (per_file.get(&f).copied().unwrap_or(0), v.files.get(&f).map_or(0, |m| m.live));
                (got != want).then_some((f, got, want))
            })
            .collect::<Vec<_>>()
    });
    let (holes, gaps) = match &counted {
        // Every live entry was found: what the walk could not read held none.
        Some(bad) if bad.is_empty() => (Vec::new(), Vec::new()),
        Some(bad) if holes.is_empty() && gaps.is_empty() => {
            let list: Vec<String> = bad.iter().map(|(f, got, want)| format!("{f}: {got} of {want}")).collect();
            sink.lost(pm_lost(
                layout::ANCHOR_ADDR,
                None,
                format!(
                    "the B+-tree's entries per SSTable disagree with the MANIFEST's live counts ({}): entries may be \
                     missing",
                    list.join(", ")
                ),
            ));
            (holes, gaps)
        }
        _ => (holes, gaps),
    };
    for k in &conflicts {
        sink.lost(pm_lost(
            layout::ANCHOR_ADDR,
            Some(k.clone()),
            "two B+-tree entries for the key disagree (one is kept)".into(),
        ));
    }
    let scan = !holes.is_empty() || !gaps.is_empty();
    let names = ctx.fs.list(&ctx.dir)?;
    let on_disk: BTreeSet<u64> = names.iter().filter_map(|n| table_number(n)).collect();
    // Where SSTable entries without a tree entry may be kept: only MANIFEST files when it is
    // readable whole (others are leftovers recovery deletes).
    let gap_files: BTreeSet<u64> = match man {
        _ if !scan => BTreeSet::new(),
        Some(m) if m.exact => m.version.files.keys().copied().collect(),
        _ => on_disk.clone(),
    };
    let wide = merge_spans(gaps.iter().cloned().chain(holes.iter().map(|h| h.span.clone())).collect());
    let guessed: HashSet<Vec<u8>> = holes.iter().flat_map(|h| h.guesses.iter().map(|g| g.0.clone())).collect();
    let mut by_file: BTreeMap<u64, HashMap<&[u8], Loc>> = BTreeMap::new();
    for (k, loc) in &entries {
        by_file.entry(loc.file).or_default().insert(k.as_slice(), *loc);
    }
    let mut files: BTreeSet<u64> = by_file.keys().copied().collect();
    files.extend(&gap_files);
    files.extend(holes.iter().flat_map(|h| h.guesses.iter().map(|g| g.1.file)).filter(|f| on_disk.contains(f)));
    let mut fallback: Vec<Candidate> = Vec::new();
    let mut found: HashMap<Vec<u8>, Vec<Found>> = HashMap::new();
    let mut damaged_blocks: Vec<Lost> = Vec::new();
    let none = HashMap::new();
    for f in files {
        let path = path_of(&ctx.dir, f);
        let want = by_file.get(&f).unwrap_or(&none);
        let data = if on_disk.contains(&f) {
            match ctx.fs.read_all(&path) {
                Ok(d) => Some(d),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(Error::Io(std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))),
            }
        } else {
            None
        };
        let Some(data) = data else {
            let mut keys: Vec<(&&[u8], &Loc)> = want.iter().collect();
            keys.sort_by_key(|(k, _)| **k);
            for (k, loc) in keys {
                sink.lost(Lost {
                    file: path.clone(),
                    offset: loc.offset,
                    key: Some(k.to_vec()),
                    detail: "the SSTable the B+-tree names for the key is missing".into(),
                });
            }
            continue;
        };
        let mut resolved: HashSet<Vec<u8>> = HashSet::new();
        let mut blocks = Blocks::default();
        let keep_gap = gap_files.contains(&f);
        salvage_sstable(
            &data,
            &path,
            |e, blk| {
                if e.kind != Kind::Put {
                    return; // SLM-DB writes none
                }
                if want.get(e.key).is_some_and(|l| l.offset == blk) && resolved.insert(e.key.to_vec()) {
                    sink.record(e.key, Some(e.value), TREE_ORDER);
                }
                if guessed.contains(e.key) {
                    found.entry(e.key.to_vec()).or_default().push((f, blk, e.value.to_vec()));
                }
                if keep_gap && in_spans(&wide, e.key) {
                    fallback.push((e.key.to_vec(), e.value.to_vec(), f));
                }
            },
            &mut blocks,
        );
        let mut missing: Vec<(&&[u8], &Loc)> = want.iter().filter(|(k, _)| !resolved.contains(**k)).collect();
        missing.sort_by_key(|(k, _)| **k);
        for (k, loc) in missing {
            sink.lost(Lost {
                file: path.clone(),
                offset: loc.offset,
                key: Some(k.to_vec()),
                detail: "the SSTable block the B+-tree names for the key fails its checksum or lacks the key".into(),
            });
        }
        damaged_blocks.extend(blocks.0);
    }
    // Holes: a guessed key some SSTable holds is the key the damaged record held.
    let mut keyed: Vec<(&Hole, &Vec<u8>, Loc, Option<&Found>)> = Vec::new();
    let mut vague: Vec<&Hole> = Vec::new();
    for h in &holes {
        match h.guesses.iter().find_map(|(k, loc)| Some((k, loc, found.get(k)?))) {
            Some((k, loc, versions)) => {
                let best = versions
                    .iter()
                    .find(|v| v.0 == loc.file && v.1 == loc.offset)
                    .or_else(|| versions.iter().max_by_key(|v| v.0));
                keyed.push((h, k, *loc, best));
            }
            None => vague.push(h),
        }
    }
    let uncertain = merge_spans(gaps.iter().cloned().chain(vague.iter().map(|h| h.span.clone())).collect());
    // With exact live counts, how many entries the tree lacks is known per file. In the
    // uncertain ranges (keys the tree does not hold), a file lacking none holds only stale
    // versions or deleted keys; a file holding exactly as many entries as it lacks holds just
    // its lost entries; any other file is ambiguous. `None`: the counts cannot tell.
    let split: Option<(Vec<&Candidate>, BTreeSet<u64>)> = counts.filter(|_| !uncertain.is_empty()).and_then(|v| {
        let mut have = per_file.clone();
        for (_, _, loc, best) in &keyed {
            match best {
                Some(b) if b.0 == loc.file => *have.entry(b.0).or_insert(0) += 1,
                _ => return None,
            }
        }
        if have.keys().any(|f| !v.files.contains_key(f)) {
            return None;
        }
        let mut cands: BTreeMap<u64, Vec<&Candidate>> = BTreeMap::new();
        for c in fallback.iter().filter(|c| in_spans(&uncertain, &c.0) && !entries.contains_key(&c.0)) {
            cands.entry(c.2).or_default().push(c);
        }
        let (mut exact, mut ambiguous) = (Vec::new(), BTreeSet::new());
        for (f, m) in &v.files {
            let lacking = m.live.checked_sub(have.get(f).copied().unwrap_or(0))?;
            let c = cands.get(f).map_or(&[][..], Vec::as_slice);
            if lacking == 0 {
                continue;
            }
            if c.len() as u64 == lacking {
                exact.extend(c.iter().copied());
            } else {
                ambiguous.insert(*f);
            }
        }
        let distinct: HashSet<&Vec<u8>> = exact.iter().map(|c| &c.0).collect();
        (distinct.len() == exact.len()).then_some((exact, ambiguous))
    });
    for (h, k, _, best) in &keyed {
        if let Some((file, _, value)) = best {
            sink.record(k, Some(value), HOLE_TIER | u128::from(*file));
        }
        sink.lost(pm_lost(
            h.addr,
            Some(k.to_vec()),
            format!("{} (the key's value is taken from SSTable {})", h.detail, best.map_or(0, |b| b.0)),
        ));
    }
    // The files whose entries in the uncertain ranges are kept (`None`: all).
    let ambiguous = match split {
        Some((exact, ambiguous)) => {
            for (k, v, f) in exact {
                sink.record(k, Some(v), TREE_ORDER);
                let h = vague.iter().find(|h| in_spans(std::slice::from_ref(&h.span), k));
                sink.lost(pm_lost(
                    h.map_or(layout::ANCHOR_ADDR, |h| h.addr),
                    Some(k.clone()),
                    format!(
                        "{}: the key's B+-tree entry is unreadable; restored from SSTable {f}, which the MANIFEST's \
                         live-key counts show holds it",
                        h.map_or("no readable B+-tree leaf covers the key", |h| h.detail.as_str())
                    ),
                ));
            }
            Some(ambiguous)
        }
        None => None,
    };
    if uncertain.is_empty() || ambiguous.as_ref().is_some_and(BTreeSet::is_empty) {
        return Ok(());
    }
    let kept = match &ambiguous {
        Some(files) => {
            let list: Vec<String> = files.iter().map(u64::to_string).collect();
            format!("SSTable entries of {} there are kept", list.join(", "))
        }
        None => "SSTable entries there are kept".to_string(),
    };
    for h in &vague {
        sink.lost(pm_lost(
            h.addr,
            None,
            format!(
                "{}: B+-tree entries in {} may be lost; {kept}, so deleted or overwritten keys there may come back",
                h.detail,
                span_text(&h.span)
            ),
        ));
    }
    for g in &gaps {
        sink.lost(pm_lost(
            layout::ANCHOR_ADDR,
            None,
            format!(
                "no readable B+-tree leaf covers keys {}: {kept}, so deleted or overwritten keys there may come back",
                span_text(g)
            ),
        ));
    }
    let kept_file = |f: u64| ambiguous.as_ref().is_none_or(|a| a.contains(&f));
    for (k, v, f) in &fallback {
        if kept_file(*f) && in_spans(&uncertain, k) {
            sink.record(k, Some(v), GAP_TIER | u128::from(*f));
        }
    }
    // A damaged block of those files may have held keys of those ranges.
    let kept_paths: Option<HashSet<PathBuf>> =
        ambiguous.as_ref().map(|a| a.iter().map(|&f| path_of(&ctx.dir, f)).collect());
    for l in damaged_blocks {
        if kept_paths.as_ref().is_none_or(|p| p.contains(&l.file)) {
            sink.lost(l);
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::fs::FaultFs;
    use crate::options::{Options, Preset};
    use crate::repair::{salvage as run_salvage, Salvaged};
    use crate::{Db, WriteBatch};

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    fn dir() -> PathBuf {
        PathBuf::from("/db")
    }

    /// Small options with compaction switched off, so old SSTables keep stale versions and
    /// deleted keys.
    fn opts(dev: &SimDevice, fs: &FaultFs) -> Options {
        let mut o = crate::testing::sim_options(Preset::Slmdb, dev, fs);
        o.slmdb.enable_live_ratio = false;
        o.slmdb.enable_leaf_scan = false;
        o.slmdb.enable_seq_degree = false;
        o
    }

    fn key(i: usize) -> Vec<u8> {
        format!("key{i:04}").into_bytes()
    }

    fn val(tag: &str, i: usize) -> Vec<u8> {
        format!("{tag}-{i}").into_bytes()
    }

    /// Two flushed generations (the second overwrites half the keys and deletes a quarter
    /// of the first's), then MemTable writes left in PM at close (puts, a delete, a batch).
    fn build(dev: &SimDevice, fs: &FaultFs) -> Model {
        let db = Db::open(dir(), opts(dev, fs)).unwrap();
        let mut m = Model::new();
        for i in 0..200 {
            db.put(key(i), val("a", i)).unwrap();
            m.insert(key(i), val("a", i));
        }
        db.flush().unwrap();
        for i in 0..100 {
            db.put(key(i), val("b", i)).unwrap();
            m.insert(key(i), val("b", i));
        }
        for i in 100..150 {
            db.delete(key(i)).unwrap();
            m.remove(&key(i));
        }
        db.flush().unwrap();
        for i in 150..160 {
            db.put(key(i), val("c", i)).unwrap();
            m.insert(key(i), val("c", i));
        }
        db.delete(key(160)).unwrap();
        m.remove(&key(160));
        let mut b = WriteBatch::new();
        b.put(key(300), b"batch").delete(key(1));
        db.write(b).unwrap();
        m.insert(key(300), b"batch".to_vec());
        m.remove(&key(1));
        db.close().unwrap();
        m
    }

    fn salvage_of(dev: &SimDevice, fs: &FaultFs) -> Salvaged {
        run_salvage(&dir(), &opts(dev, fs), false).unwrap()
    }

    fn live(s: &Salvaged) -> Model {
        s.live().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }

    /// A read view of the device's region (the store is closed).
    fn region(dev: &SimDevice) -> Region {
        let img = dev.durable_image(0).unwrap();
        let db = u64::from_le_bytes(img[24..32].try_into().unwrap());
        Region::open(RegionConfig {
            create: false,
            ..RegionConfig::new(Backing::Sim(dev.clone()), img.len() as u64, db)
        })
        .unwrap()
    }

    /// The leaves in chain order.
    fn leaves(r: &Region) -> Vec<u64> {
        let mut n = r.load_u64_atomic(layout::ANCHOR_ADDR + 8).unwrap();
        loop {
            let h = node_hdr(r, n).unwrap();
            if h.level == 0 {
                break;
            }
            n = h.leftmost;
        }
        let mut out = Vec::new();
        while n != 0 {
            out.push(n);
            n = node_hdr(r, n).unwrap().sibling;
        }
        out
    }

    /// The record addresses of a leaf's entries.
    fn records(r: &Region, leaf: u64) -> Vec<(u64, RecView)> {
        PTree::node_entries(r, leaf).unwrap().iter().map(|&a| (a, record_at(r, a).unwrap())).collect()
    }

    fn poke(dev: &SimDevice, addr: u64, xor: u8) {
        let img = dev.durable_image(0).unwrap();
        assert!(dev.poke(0, addr as usize, &[img[addr as usize] ^ xor]));
    }

    #[test]
    fn the_newest_version_wins_and_deleted_keys_stay_deleted() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let m = build(&dev, &fs);
        // The first SSTable still holds the overwritten and the deleted keys.
        let first = fs.read_all(&path_of(&dir(), 1)).unwrap();
        assert!(first.windows(7).any(|w| w == b"key0120"), "the stale versions this test needs are gone");
        let s = salvage_of(&dev, &fs);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), m);
    }

    #[test]
    fn a_damaged_block_costs_exactly_its_keys() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let m = build(&dev, &fs);
        // The second SSTable's first block holds live keys ("b" versions).
        fs.poke(&path_of(&dir(), 2), 20, b"!").unwrap();
        let s = salvage_of(&dev, &fs);
        assert!(!s.lost.is_empty());
        let lost: BTreeSet<Vec<u8>> = s.lost.iter().map(|l| l.key.clone().expect("every loss has its key")).collect();
        let got = live(&s);
        for (k, v) in &m {
            if !lost.contains(k) {
                assert_eq!(got.get(k), Some(v), "{}", crate::escape(k));
            }
        }
        for k in &lost {
            assert!(!got.contains_key(k), "a lost key is dropped, not rolled back to an older version");
        }
    }

    #[test]
    fn a_damaged_tree_record_is_reported_with_its_key_and_read_through_its_location() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let m = build(&dev, &fs);
        let r = region(&dev);
        let leaf = leaves(&r)[1];
        let (addr, rec) = records(&r, leaf)[3].clone();
        drop(r);
        poke(&dev, addr + 26, 0x01); // the high bytes of the block size: the crc fails
        let s = salvage_of(&dev, &fs);
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        assert_eq!(s.lost[0].key.as_deref(), Some(rec.key.as_slice()));
        assert_eq!(live(&s), m, "the key's block still holds its current version");
    }

    #[test]
    fn a_damaged_leaf_header_costs_nothing() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let m = build(&dev, &fs);
        let r = region(&dev);
        let ls = leaves(&r);
        assert!(ls.len() >= 3, "the tree needs inner nodes for this test");
        drop(r);
        poke(&dev, ls[1] + 33, 0x40); // its `low` pointer
        poke(&dev, ls[2] + 17, 0x40); // the next leaf's sibling pointer
        let s = salvage_of(&dev, &fs);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), m);
    }

    #[test]
    fn a_garbage_leaf_slot_is_restored_by_the_live_counts_or_its_range_kept_from_sstables() {
        for damaged_manifest in [false, true] {
            for next_to_deleted in [false, true] {
                let ctx = format!("manifest damaged {damaged_manifest}, next to deleted keys {next_to_deleted}");
                let (dev, fs) = (SimDevice::new(), FaultFs::new());
                let m = build(&dev, &fs);
                let r = region(&dev);
                // A slot in the middle of a run of live keys, or the one of key0150, whose
                // left neighbour is key0099: the deleted key0100..0149 lie between them.
                let (slot, hidden) = if next_to_deleted {
                    leaves(&r)
                        .into_iter()
                        .find_map(|l| {
                            let i = records(&r, l).iter().position(|(_, rec)| rec.key == key(150))?;
                            Some((l + 64 + 8 * i as u64, key(150)))
                        })
                        .unwrap()
                } else {
                    let l = leaves(&r)[1];
                    let recs = records(&r, l);
                    let i = recs.len() / 2;
                    (l + 64 + 8 * i as u64, recs[i].1.key.clone())
                };
                drop(r);
                poke(&dev, slot, 0x5a); // the slot no longer holds a record address
                if damaged_manifest {
                    let name = fs.list(&dir()).unwrap().into_iter().find(|n| n.starts_with("MANIFEST-")).unwrap();
                    let len = fs.read_all(&dir().join(&name)).unwrap().len();
                    fs.poke(&dir().join(&name), len - 3, b"~").unwrap();
                }
                let s = salvage_of(&dev, &fs);
                let got = live(&s);
                // Nothing acknowledged is lost, and nothing appears that nobody wrote: a key
                // that comes back is a deleted one with the value it had.
                for (k, v) in &m {
                    assert_eq!(got.get(k), Some(v), "{ctx}: {}", crate::escape(k));
                }
                for (k, v) in &got {
                    if !m.contains_key(k) {
                        let i: usize = std::str::from_utf8(&k[3..]).unwrap().parse().unwrap();
                        assert!((100..150).contains(&i) && *v == val("a", i), "{ctx}: {}", crate::escape(k));
                        assert!(s.lost.iter().any(|l| l.key.is_none()), "{ctx}: a key came back unreported");
                    }
                }
                if !damaged_manifest && !next_to_deleted {
                    // Exact counts and no stale entry in the hole: the entry the tree lacks is
                    // known, and reported with its key.
                    assert_eq!(s.lost.len(), 1, "{ctx}: {:?}", s.lost);
                    assert_eq!(s.lost[0].key.as_ref(), Some(&hidden), "{ctx}");
                    assert_eq!(got, m, "{ctx}");
                }
                if damaged_manifest {
                    assert!(s.lost.iter().any(|l| l.key.is_none()), "{ctx}: {:?}", s.lost);
                }
            }
        }
    }

    #[test]
    fn an_incomplete_memtable_batch_is_not_replayed() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let m = build(&dev, &fs);
        let db = Db::open(dir(), opts(&dev, &fs)).unwrap();
        let mut b = WriteBatch::new();
        b.put(b"zz-1", b"x").put(b"zz-2", b"y").put(key(0), b"z");
        db.write(b).unwrap();
        db.close().unwrap();
        drop(db);
        // Unlink the batch's last node (as a crash before its link was persisted leaves it).
        let r = region(&dev);
        let root = read_roots(&r).best.unwrap();
        let mut pred = root.active + 24;
        let mut cur = r.load_u64_atomic(pred).unwrap();
        let mut unlinked = false;
        while cur != 0 {
            let n = memtable::read_node(&r, cur).unwrap();
            if n.key == b"zz-2" {
                let next = n.next.to_le_bytes();
                drop(r);
                assert!(dev.poke(0, pred as usize, &next));
                unlinked = true;
                break;
            }
            pred = cur;
            cur = n.next;
        }
        assert!(unlinked);
        let s = salvage_of(&dev, &fs);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), m, "no write of the incomplete batch is reported");
        // The other direction: the store itself agrees.
        let db = Db::open(dir(), opts(&dev, &fs)).unwrap();
        let got: Model = db.scan(..).unwrap().map(|r| r.unwrap()).collect();
        db.close().unwrap();
        assert_eq!(got, m);
    }

    #[test]
    fn a_damaged_memtable_node_is_reported_and_the_list_goes_on() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let m = build(&dev, &fs);
        let r = region(&dev);
        let root = read_roots(&r).best.unwrap();
        let mut cur = r.load_u64_atomic(root.active + 24).unwrap();
        let mut target = None;
        while cur != 0 {
            let n = memtable::read_node(&r, cur).unwrap();
            if n.key == key(155) {
                target = Some(cur);
            }
            cur = n.next;
        }
        drop(r);
        poke(&dev, target.unwrap() + NODE_HEADER + 2, 0x21); // a key byte
        let s = salvage_of(&dev, &fs);
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        let got = live(&s);
        for (k, v) in &m {
            if *k != key(155) {
                assert_eq!(got.get(k), Some(v), "{}", crate::escape(k));
            }
        }
    }

    #[test]
    fn a_damaged_pool_header_or_root_slot_is_read_around() {
        for (what, addr) in [("pool header", 10u64), ("current root slot", 0)] {
            let (dev, fs) = (SimDevice::new(), FaultFs::new());
            let m = build(&dev, &fs);
            let addr = if addr == 0 {
                let r = region(&dev);
                let best = read_roots(&r).best.unwrap();
                let slot = layout::ROOT_SLOTS
                    .into_iter()
                    .find(|&a| Root::decode(r.slice(a, 64).unwrap()) == Some(best))
                    .unwrap();
                slot + 20
            } else {
                addr
            };
            poke(&dev, addr, 0x10);
            let s = salvage_of(&dev, &fs);
            assert!(s.lost.is_empty(), "{what}: {:?}", s.lost);
            assert_eq!(live(&s), m, "{what}");
        }
    }

    #[test]
    fn spans_and_increasing_runs() {
        let ks = |v: &[&'static str]| -> Vec<&'static [u8]> { v.iter().map(|s| s.as_bytes()).collect() };
        assert_eq!(increasing(&ks(&["a", "c", "b", "d"])), vec![0, 1, 3]);
        assert_eq!(increasing(&ks(&["a", "z", "b", "c"])), vec![0, 2, 3]);
        assert!(increasing(&[]).is_empty());
        let cov = merge_spans(vec![
            (Pos::start(), Pos::after(b"c")),
            (Pos::before(b"b"), Pos::after(b"e")),
            (Pos::before(b"m"), Pos::end()),
        ]);
        assert_eq!(cov.len(), 2);
        let gaps = complement(&cov);
        assert_eq!(gaps, vec![(Pos::after(b"e"), Pos::before(b"m"))]);
        assert!(in_spans(&gaps, b"f") && in_spans(&gaps, b"e\0"));
        assert!(!in_spans(&gaps, b"e") && !in_spans(&gaps, b"m") && !in_spans(&gaps, b""));
        assert_eq!(complement(&[]), vec![(Pos::start(), Pos::end())]);
        assert!(in_spans(&complement(&[]), b""));
    }
}
