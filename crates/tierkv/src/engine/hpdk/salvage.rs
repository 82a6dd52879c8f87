//! Salvage of a `hpdk` store for `tierkv repair` ([`crate::repair`]): a read-only walk of
//! every structure that holds data, rebuilding the state recovery would reach
//! (docs/design/hpdk.md, "Repair: the salvage walk").
//!
//! # What holds data, and what is walked
//! - **Value pools** (PM heap extents named by the value-pool directory): `size | value |
//!   crc`, the crc over the pool's generation too. Records carry no key, so they are reached
//!   only through the addresses below; every address that decides a key's value is verified
//!   (record inside its pool, checksum with the pool's generation). A failing one is
//!   [`Lost`] with its key.
//! - **PM directories**: a slot whose checksum verifies names a pool (extent, generation)
//!   or a table (extent, number). A slot that fails is free to open (slots are written
//!   before what they describe is committed); salvage keeps its fields as they stand and
//!   tries them only where committed data needs the slot: a value address naming a pool
//!   without an intact slot is looked for at the damaged slot's extent, with its generation
//!   or one a recovery file lists for the pool (capacity from the superblock when it
//!   verifies), and accepted only when the record verifies there; a MANIFEST table without an
//!   intact slot is read from a damaged slot still holding its number, block checksums
//!   deciding what is kept.
//! - **B+-tree recovery files** `BTREE-N` (one checksum over the whole file): the tree —
//!   key → value address — as of every table numbered `<= N`. Tombstones are not in it: the
//!   merge drops them, which is why the tables numbered `<= N` cannot stand in for it.
//! - **Tables** (the shared SSTable format in PM extents): key → 6-byte value address, or a
//!   tombstone. Salvaged block by block with [`salvage_sstable`]; a damaged block is
//!   [`Lost`] without a key (its keys are not readable).
//! - **WALs** `wal-N.log`: one framed record per write call, key → address or delete; read
//!   with [`read_log`] in [`WalRecovery::SkipDamaged`] mode: a damaged record is [`Lost`]
//!   without a key (its detail names the keys its bytes seem to hold), later records are
//!   kept. A torn tail is dropped unreported, as open drops it (in any WAL: rotation does
//!   not sync the old one, see `jobs::open_inner`).
//! - **MANIFEST** (the one `CURRENT` names; if `CURRENT` is unreadable, the newest
//!   `MANIFEST-N` holding a record): the committed tables with their live-item counts, and
//!   the newest flushed WAL generation (older WALs are not replayed). Read record by record;
//!   a damaged record is [`Lost`] without a key, the others are applied.
//! - Not walked: the merge log (a merge changes which table holds an item, never the key →
//!   value mapping), the pools' free space, and the tables numbered `<=` the recovery file
//!   used (superseded by it: their stale puts would bring deleted keys back).
//!
//! # The state rebuilt, and the order
//! Open's rule, kept whenever the MANIFEST allows it: the newest recovery file that decodes
//! and whose table list equals the MANIFEST's tables numbered `<=` its `covered`, then the
//! tables numbered above `covered` in number order (= age order: a merge numbers its output
//! while no flush runs), then the WALs of generations above the MANIFEST's counter in
//! generation order, records and operations in file order. Every version is given the next
//! [`Order`] in that sequence, so a later source always wins. The tables above `covered`
//! are those of the table *directory* (plus any MANIFEST table found only in a damaged
//! slot): besides the MANIFEST's, that adds only uncommitted outputs (whose items the WAL or
//! the merge inputs hold too, with the same values) and the inputs of a committed merge
//! whose newer recovery file is damaged (still in their slots: inputs are freed only after
//! the old recovery file is removed) — which are exactly what that older file needs.
//!
//! Without such a recovery file:
//! - MANIFEST intact (a torn last record allowed): every MANIFEST table is replayed in
//!   number order, then the WALs. Tombstones dropped by merges may then let a deleted key
//!   come back from an older table. The MANIFEST's live-item counts tell where: the tree the
//!   replay builds holds every live item (nothing newer hides it) plus the resurrected keys,
//!   so a table with more keys in that tree than its live count holds resurrected keys, and
//!   every key taken from it is reported [`Lost`] (with its key, and its value kept: most of
//!   them are live). Where every count matches, the rebuilt state is exact and nothing is
//!   reported. (This also salvages a store open refuses because its only recovery file does
//!   not match: see the preset bug noted in the design doc.)
//! - MANIFEST damaged, missing, or with a cut last record while no recovery file matches
//!   (the cut record may be a damaged commit): the newest recovery file that decodes is used
//!   anyway, else every table in the directory; a [`Lost`] without a key says the rebuilt
//!   state may be off.
//!
//! Only the newest version of each key is read and handed to the sink. When its value
//! fails, the key is reported [`Lost`] and the next older version the walk saw (a delete
//! included) is tried in turn: an older value comes back, as the framework allows for a
//! lost key. Older versions failing too are not reported again (their pools may well have
//! been reused since).
//!
//! # PM without its region
//! The PM region is opened as open does (mapped, nothing written: `ctx.fresh` is false). If
//! it cannot be opened (a damaged pool header), the pools' bytes are read directly (pool
//! files, or the simulator's durable image — what a closed or crashed store holds): records
//! verify by themselves, so a damaged header loses nothing. A pool whose intact header names
//! another store is not used (its values are reported lost through their keys).
//!
//! # What cannot be recovered
//! - Values whose record fails, or whose pool cannot be found (no intact slot, and the
//!   damaged one names a place where the record does not verify): the key is reported lost,
//!   and an older version seen by the walk comes back if one verifies.
//! - Keys of a damaged table block or WAL record: reported without keys.
//! - A damaged last WAL record looks exactly like a crash's torn tail (the shared log rule)
//!   and is dropped as open drops it, unreported.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use super::jobs::{dump_number, wal_number};
use super::layout::{self, Dump, Slot, TSlot, VSlot, RECORD_OVERHEAD};
use super::{dump_name, wal_name};
use crate::engine::EngineCtx;
use crate::error::{Error, Result};
use crate::format::log::{read_log, DropReason, WalRecovery};
use crate::format::Cursor;
use crate::fs::Fs;
use crate::manifest::{self, Version};
use crate::pm::{Region, MAX_POOLS, POOL_HEADER_LEN};
use crate::repair::{salvage_sstable, Lost, Order, SalvageSink};
use crate::sstable::Kind;

/// Walk the store read-only and report every intact record and every damaged one.
pub(crate) fn salvage(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<()> {
    let pm = Pm::open(ctx, sink);
    let mut dirs = Dirs::read(&pm);
    let man = read_manifest(ctx, sink)?;
    let dumps = read_dumps(ctx)?;
    for (no, gen, _, _) in dumps.iter().filter_map(|d| d.1.as_ref().ok()).flat_map(|d| &d.pools) {
        dirs.gens.entry(*no).or_default().insert(*gen);
    }
    let mut walk = Walk::default();
    let version = man.as_ref().map(|m| &m.version);
    let matching = version.and_then(|v| {
        dumps.iter().find_map(|(_, d)| {
            let d = d.as_ref().ok()?;
            let upto: Vec<u64> = v.files.keys().copied().filter(|f| *f <= d.covered).collect();
            (upto == d.tables).then_some(d)
        })
    });
    let trusted = man.as_ref().is_some_and(|m| !m.damaged);
    let newest_decoded = dumps.iter().find_map(|(p, d)| d.as_ref().ok().map(|d| (p, d)));
    // What the live-count check needs (no usable recovery file, intact MANIFEST).
    let mut count_check: Option<(&Version, PathBuf, u64, String)> = None;
    let base: Option<&Dump> = match (matching, newest_decoded) {
        (Some(d), _) => Some(d),
        (None, _) if trusted && man.as_ref().is_some_and(|m| m.torn_at.is_none()) => None,
        (None, Some((path, d))) => {
            let (file, offset) = match &man {
                Some(Man { path, torn_at: Some(o), .. }) => (path.clone(), *o),
                _ => (path.clone(), 0),
            };
            sink.lost(Lost {
                file,
                offset,
                key: None,
                detail: format!(
                    "no B+-tree recovery file matches the MANIFEST's tables (its last commit may be cut or \
                     damaged); the state is rebuilt from {} and the tables above {}: keys changed by the \
                     commits in doubt may be off",
                    path.display(),
                    d.covered
                ),
            });
            Some(d)
        }
        (None, None) => None,
    };
    match base {
        Some(d) => {
            for (k, a, _) in &d.entries {
                walk.push(k, Some(*a), Src::Dump);
            }
            let mut newer: Vec<&TSlot> = dirs.tables.iter().filter(|t| t.number > d.covered).collect();
            // The MANIFEST's tables among them (a damaged slot is tried as it stands).
            for n in version.into_iter().flat_map(|v| v.files.keys()).filter(|n| **n > d.covered) {
                if !newer.iter().any(|t| t.number == *n) {
                    match dirs.damaged_table(*n) {
                        Some(t) => newer.push(t),
                        None => no_slot(&pm, *n, sink),
                    }
                }
            }
            newer.sort_unstable_by_key(|t| (t.number, t.slot));
            for t in newer {
                walk.table(&pm, t, sink);
            }
        }
        None => {
            // No recovery file to start from: replay tables from the start.
            let (file, offset, why) = match dumps.first() {
                Some((p, Err((o, e)))) => (p.clone(), *o, format!("the B+-tree recovery file is damaged ({e})")),
                Some((p, Ok(_))) => (p.clone(), 0, "no B+-tree recovery file matches the MANIFEST".to_string()),
                None => (ctx.dir.join(dump_name(0)), 0, "no B+-tree recovery file exists".to_string()),
            };
            match man.as_ref().filter(|m| !m.damaged) {
                Some(m) => {
                    let by_number: HashMap<u64, &TSlot> = dirs.tables.iter().map(|t| (t.number, t)).collect();
                    let mut damaged_tables = BTreeSet::new();
                    for n in m.version.files.keys() {
                        match by_number.get(n).copied().or_else(|| dirs.damaged_table(*n)) {
                            Some(t) => {
                                if !walk.table(&pm, t, sink) {
                                    damaged_tables.insert(*n);
                                }
                            }
                            None => no_slot(&pm, *n, sink),
                        }
                    }
                    count_check = Some((&m.version, file, offset, why));
                    walk.bad_tables = walk.over_live(&m.version, &damaged_tables);
                }
                None => {
                    sink.lost(Lost {
                        file,
                        offset,
                        key: None,
                        detail: format!(
                            "{why}, and the MANIFEST is damaged or missing: every table in PM is replayed in \
                             number order; keys deleted before a merge may come back"
                        ),
                    });
                    let mut all: Vec<&TSlot> = dirs.tables.iter().collect();
                    all.sort_unstable_by_key(|t| (t.number, t.slot));
                    for t in all {
                        walk.table(&pm, t, sink);
                    }
                }
            }
        }
    }
    // WALs of generations not yet flushed.
    let counter = version.map_or(0, |v| v.counter);
    walk.wals(ctx, counter, sink)?;
    if let Some((v, file, offset, why)) = count_check {
        walk.report_suspects(v, &file, offset, &why, sink);
    }
    walk.resolve(&pm, &dirs, sink);
    Ok(())
}

/// Report that MANIFEST table `n` has no directory slot: its items are lost.
fn no_slot(pm: &Pm, n: u64, sink: &mut dyn SalvageSink) {
    let (file, offset) = pm.locate(layout::TDIR_ADDR);
    sink.lost(Lost {
        file,
        offset,
        key: None,
        detail: format!("table {n} of the MANIFEST has no directory slot in PM (its items are lost)"),
    });
}

/// The PM region, or (when it cannot be opened) the raw bytes of its pools.
enum Pm {
    Region(Region),
    Raw { pools: Vec<Vec<u8>>, pool_size: u64, names: Vec<PathBuf> },
}

impl Pm {
    /// Open the region read-only in effect (`ctx.fresh` is false: nothing is written); on
    /// failure read the pools' bytes directly.
    fn open(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Pm {
        match crate::engine::open_region(ctx) {
            Ok(r) => Pm::Region(r),
            Err(e) => Pm::raw(ctx, &e, sink),
        }
    }

    fn raw(ctx: &EngineCtx, why: &Error, sink: &mut dyn SalvageSink) -> Pm {
        let mut images: Vec<(PathBuf, std::result::Result<Vec<u8>, String>)> = Vec::new();
        match (&ctx.opts.pm_device, &ctx.opts.pm_path) {
            (Some(dev), _) => {
                for i in 0..dev.pool_count().min(MAX_POOLS) {
                    let img = dev.durable_image(i).ok_or_else(|| "the simulated pool is gone".to_string());
                    images.push((PathBuf::from(format!("<sim>/pool-{i:06}")), img));
                }
            }
            (None, p) => {
                let d = p.clone().unwrap_or_else(|| ctx.dir.join("pm"));
                for i in 0..MAX_POOLS {
                    let path = d.join(format!("pool-{i:06}"));
                    if !path.exists() {
                        break;
                    }
                    let img = std::fs::read(&path).map_err(|e| e.to_string());
                    images.push((path, img));
                }
            }
        }
        let pool_size = images.first().and_then(|(_, i)| i.as_ref().ok()).map_or(0, |i| i.len() as u64);
        let mut pools = Vec::with_capacity(images.len());
        let mut names = Vec::with_capacity(images.len());
        for (i, (path, img)) in images.into_iter().enumerate() {
            let problem = match &img {
                Err(e) => Some(format!("PM pool cannot be read ({e})")),
                Ok(b) if b.len() as u64 != pool_size || (b.len() as u64) < POOL_HEADER_LEN => {
                    Some(format!("PM pool is {} bytes, pool 0 is {pool_size}", b.len()))
                }
                Ok(b) => foreign(b, i, ctx.db_id).map(|db| format!("PM pool belongs to store {db:#x}, not this one")),
            };
            match (problem, img) {
                (None, Ok(b)) => pools.push(b),
                (p, _) => {
                    sink.lost(Lost {
                        file: path.clone(),
                        offset: 0,
                        key: None,
                        detail: format!("{}; values in it are lost", p.unwrap_or_default()),
                    });
                    pools.push(Vec::new());
                }
            }
            names.push(path);
        }
        if pools.first().is_none_or(|p| p.is_empty()) {
            let (file, offset, detail) = match why {
                Error::Corruption { file, offset, detail } => (file.clone(), *offset, detail.clone()),
                e => (PathBuf::from("pool-000000"), 0, e.to_string()),
            };
            sink.lost(Lost {
                file,
                offset,
                key: None,
                detail: format!("the PM region cannot be read ({detail}): tables and values in PM are lost"),
            });
        }
        Pm::Raw { pools, pool_size, names }
    }

    /// `[addr, addr + len)`, if it lies inside one readable pool.
    fn slice(&self, addr: u64, len: usize) -> Option<&[u8]> {
        match self {
            Pm::Region(r) => r.slice(addr, len),
            Pm::Raw { pools, pool_size, .. } => {
                let i = usize::try_from(addr.checked_div(*pool_size)?).ok()?;
                let off = usize::try_from(addr % pool_size).ok()?;
                pools.get(i)?.get(off..off.checked_add(len)?)
            }
        }
    }

    /// Pool file and offset in it of a region address (as the preset's errors name them).
    fn locate(&self, addr: u64) -> (PathBuf, u64) {
        match self {
            Pm::Region(r) => r.locate(addr),
            Pm::Raw { pool_size, names, .. } => {
                let (i, off) = match addr.checked_div(*pool_size) {
                    Some(i) => (i, addr % pool_size),
                    None => (0, addr),
                };
                let name = usize::try_from(i).ok().and_then(|i| names.get(i)).cloned();
                (name.unwrap_or_else(|| PathBuf::from(format!("<pm>/pool-{i:06}"))), off)
            }
        }
    }
}

/// `Some(store id)` when pool `i`'s header is intact and names a store other than `db_id`
/// (`db_id` 0: unknown, anything goes).
fn foreign(b: &[u8], i: usize, db_id: u64) -> Option<u64> {
    let h = b.get(..36)?;
    let db = u64::from_le_bytes(h.get(24..32)?.try_into().ok()?);
    let intact = crate::pm::encode_pool_header(i as u32, b.len() as u64, db).get(..36) == Some(h);
    (intact && db_id != 0 && db != db_id).then_some(db)
}

/// The PM directories: value pools by number, and the tables placed in PM.
#[derive(Default)]
struct Dirs {
    pools: HashMap<u16, VSlot>,
    tables: Vec<TSlot>,
    /// Slots whose checksum fails, read as they stand (see [`Dirs::read`]).
    damaged_pools: HashMap<u16, VSlot>,
    damaged_tables: Vec<TSlot>,
    /// Other generations a pool may have had (from the recovery files).
    gens: HashMap<u16, BTreeSet<u32>>,
    /// The superblock's value-pool size (every pool's capacity), when it verifies.
    pool_size: Option<u32>,
}

impl Dirs {
    /// Every slot whose checksum verifies (a slot that fails is free: slots are written
    /// before what they describe is committed; a damaged slot of committed data shows as a
    /// value address naming a missing pool, or a MANIFEST table without a slot). The slots
    /// that fail are kept aside as they stand: a value address naming a pool without an
    /// intact slot is looked for where the damaged slot says (with its generation, or one a
    /// recovery file lists), and accepted only when the record verifies there.
    fn read(pm: &Pm) -> Dirs {
        let mut d = Dirs::default();
        for i in 0..layout::DIR_SLOTS as u16 {
            let at = |base: u64| base + u64::from(i) * layout::SLOT_LEN;
            if let Some(b) = pm.slice(at(layout::VDIR_ADDR), 32) {
                match layout::decode_slot(b, i) {
                    Slot::Pool(p) => {
                        d.pools.insert(i, p);
                    }
                    _ => {
                        if let Some(Slot::Pool(p)) = layout::decode_slot_unverified(b, i, false) {
                            d.damaged_pools.insert(i, p);
                        }
                    }
                }
            }
            if let Some(b) = pm.slice(at(layout::TDIR_ADDR), 32) {
                match layout::decode_slot(b, i) {
                    Slot::Table(t) => d.tables.push(t),
                    _ => {
                        if let Some(Slot::Table(t)) = layout::decode_slot_unverified(b, i, true) {
                            d.damaged_tables.push(t);
                        }
                    }
                }
            }
        }
        d.pool_size = pm
            .slice(layout::SUPERBLOCK_ADDR, 64)
            .and_then(|b| layout::decode_superblock(b).ok())
            .and_then(|s| u32::try_from(s).ok());
        d
    }

    /// Where to look for the values of pool `no`: its intact slot, else what its damaged
    /// slot and the recovery files say.
    fn places(&self, no: u16) -> Vec<VSlot> {
        if let Some(p) = self.pools.get(&no) {
            return vec![*p];
        }
        let Some(p) = self.damaged_pools.get(&no) else { return Vec::new() };
        let cap = self.pool_size.unwrap_or(p.cap);
        let mut gens = vec![p.gen];
        gens.extend(self.gens.get(&no).into_iter().flatten().filter(|g| **g != p.gen));
        gens.into_iter().map(|gen| VSlot { gen, cap, ..*p }).collect()
    }

    /// The table numbered `n` whose slot is damaged, if its number field still reads `n`
    /// (its blocks must then verify by their own checksums).
    fn damaged_table(&self, n: u64) -> Option<&TSlot> {
        self.damaged_tables.iter().find(|t| t.number == n)
    }
}

/// The MANIFEST as read.
struct Man {
    path: PathBuf,
    version: Version,
    /// A record failed (its edits are missing from `version`).
    damaged: bool,
    /// Offset of a cut last record (a crash's torn append, or damage that looks like one).
    torn_at: Option<u64>,
}

/// Read the MANIFEST named by `CURRENT` (else the newest one holding a record), record by
/// record: damaged records are reported and skipped.
fn read_manifest(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<Option<Man>> {
    let fs: &dyn Fs = &ctx.fs;
    let dir = &ctx.dir;
    let current = fs
        .read_all(&dir.join("CURRENT"))
        .ok()
        .and_then(|c| std::str::from_utf8(&c).ok().and_then(|s| s.strip_suffix('\n')).map(str::to_string))
        .and_then(|s| s.strip_prefix("MANIFEST-").and_then(|n| n.parse::<u64>().ok()))
        .filter(|n| fs.exists(&dir.join(manifest::Manifest::name(*n))));
    let candidates: Vec<u64> = match current {
        Some(n) => vec![n],
        None => {
            let mut ns: Vec<u64> =
                fs.list(dir)?.iter().filter_map(|n| n.strip_prefix("MANIFEST-").and_then(|n| n.parse().ok())).collect();
            ns.sort_unstable_by(|a, b| b.cmp(a));
            ns
        }
    };
    for n in candidates {
        let path = dir.join(manifest::Manifest::name(n));
        let data = fs.read_all(&path)?;
        let body = data.get(8..).unwrap_or(&[]);
        let r = read_log(body, 8, WalRecovery::SkipDamaged).unwrap_or_default();
        if r.records.is_empty() && current.is_none() {
            // A manifest whose creation a crash cut (CURRENT never named it): an older one
            // is current.
            continue;
        }
        let mut m = Man { path: path.clone(), version: Version::default(), damaged: false, torn_at: None };
        let mut lost = |offset: u64, detail: String| {
            sink.lost(Lost {
                file: path.clone(),
                offset,
                key: None,
                detail: format!(
                    "{detail}: the edits it held (tables added or removed, live counts, the flushed WAL \
                     generation) are unknown"
                ),
            })
        };
        for (off, payload) in &r.records {
            match manifest::decode_edits(payload) {
                Ok(edits) => m.version.apply(&edits),
                Err(e) => {
                    m.damaged = true;
                    lost(off + 8, format!("MANIFEST record verifies but does not decode ({e})"));
                }
            }
        }
        for &(off, len, reason) in &r.dropped {
            if reason == DropReason::TornTail {
                m.torn_at = Some(off + 8);
            } else {
                m.damaged = true;
                lost(off + 8, format!("MANIFEST record damaged ({len} bytes skipped)"));
            }
        }
        if r.records.is_empty() {
            m.damaged = true;
            lost(8, "the MANIFEST holds no intact record".into());
        }
        return Ok(Some(m));
    }
    sink.lost(Lost {
        file: dir.join("CURRENT"),
        offset: 0,
        key: None,
        detail: "no readable MANIFEST: which tables are committed and which WALs are flushed is unknown".into(),
    });
    Ok(None)
}

/// Every recovery file, newest first, decoded or with its damage.
type Dumps = Vec<(PathBuf, std::result::Result<Dump, (u64, String)>)>;

fn read_dumps(ctx: &EngineCtx) -> Result<Dumps> {
    let mut ns: Vec<u64> = ctx.fs.list(&ctx.dir)?.iter().filter_map(|n| dump_number(n)).collect();
    ns.sort_unstable_by(|a, b| b.cmp(a));
    let mut out = Vec::with_capacity(ns.len());
    for n in ns {
        let p = ctx.dir.join(dump_name(n));
        let d = layout::decode_dump(&ctx.fs.read_all(&p)?);
        out.push((p, d));
    }
    Ok(out)
}

/// Where a version of a key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
    /// The recovery file.
    Dump,
    /// The table of this number.
    Table(u64),
    /// A WAL record.
    Wal,
}

impl std::fmt::Display for Src {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Src::Dump => f.write_str("the B+-tree recovery file"),
            Src::Table(n) => write!(f, "table {n}"),
            Src::Wal => f.write_str("the WAL"),
        }
    }
}

/// One version of a key: a value address or a delete, and its source.
#[derive(Debug, Clone, Copy)]
struct Ver {
    op: Option<u64>,
    src: Src,
}

/// Every version of every key, in the order recovery applies them.
#[derive(Default)]
struct Walk {
    keys: BTreeMap<Vec<u8>, Vec<(Order, Ver)>>,
    seq: Order,
    /// Tables holding more keys of the replayed tree than their live count (no recovery
    /// file): the keys taken from them may be deleted keys brought back.
    bad_tables: BTreeSet<u64>,
}

impl Walk {
    fn push(&mut self, key: &[u8], op: Option<u64>, src: Src) {
        self.seq += 1;
        let v = Ver { op, src };
        match self.keys.get_mut(key) {
            Some(vs) => vs.push((self.seq, v)),
            None => {
                self.keys.insert(key.to_vec(), vec![(self.seq, v)]);
            }
        }
    }

    /// Replay table `t`: every entry of every block that verifies. False when something of
    /// it was lost.
    fn table(&mut self, pm: &Pm, t: &TSlot, sink: &mut dyn SalvageSink) -> bool {
        let (file, base) = pm.locate(t.addr);
        let Some(data) = pm.slice(t.addr, t.size as usize) else {
            sink.lost(Lost {
                file,
                offset: base,
                key: None,
                detail: format!("table {} ({} bytes) does not lie inside the PM region", t.number, t.size),
            });
            return false;
        };
        let mut bad = Vec::new();
        let mut ts = TableSink { inner: sink, base, number: t.number, lost: false };
        salvage_sstable(
            data,
            &file,
            |e, off| match e.kind {
                Kind::Put => match layout::vaddr_from(e.value) {
                    Some(a) => self.push(e.key, Some(a), Src::Table(t.number)),
                    None => bad.push((e.key.to_vec(), off)),
                },
                Kind::Delete => self.push(e.key, None, Src::Table(t.number)),
            },
            &mut ts,
        );
        let intact = !ts.lost && bad.is_empty();
        for (key, off) in bad {
            sink.lost(Lost {
                file: file.clone(),
                offset: base + off,
                key: Some(key),
                detail: format!("table {}: an entry's value address is malformed", t.number),
            });
        }
        intact
    }

    /// Replay the WALs of generations above `counter`, oldest first.
    fn wals(&mut self, ctx: &EngineCtx, counter: u64, sink: &mut dyn SalvageSink) -> Result<()> {
        let mut gens: Vec<u64> = ctx.fs.list(&ctx.dir)?.iter().filter_map(|n| wal_number(n)).collect();
        gens.retain(|g| *g > counter);
        gens.sort_unstable();
        for g in &gens {
            let path = ctx.dir.join(wal_name(*g));
            let data = ctx.fs.read_all(&path)?;
            let r = match read_log(&data, 0, WalRecovery::SkipDamaged) {
                Ok(r) => r,
                Err((off, d)) => {
                    sink.lost(Lost { file: path, offset: off, key: None, detail: format!("WAL {d}") });
                    continue;
                }
            };
            for &(off, payload) in &r.records {
                match layout::decode_wal_payload(payload) {
                    Some(ops) => {
                        for (k, a) in ops {
                            self.push(&k, a, Src::Wal);
                        }
                    }
                    None => sink.lost(Lost {
                        file: path.clone(),
                        offset: off,
                        key: None,
                        detail: "WAL record verifies but does not decode".into(),
                    }),
                }
            }
            for &(off, len, reason) in &r.dropped {
                if reason == DropReason::TornTail {
                    continue; // what a crash leaves of unacknowledged (or unsynced) writes, as open decides
                }
                let hint = usize::try_from(off).ok().map(|o| key_hints(&data, o, len)).unwrap_or_default();
                sink.lost(Lost {
                    file: path.clone(),
                    offset: off,
                    key: None,
                    detail: format!("WAL record damaged ({len} bytes skipped){hint}"),
                });
            }
        }
        Ok(())
    }

    /// Tables holding more keys of the tree replayed from the tables (the newest version of
    /// each key, if a put) than the MANIFEST's live count for them. Tables that lost blocks
    /// are left out (their count is low, and their loss is reported already).
    fn over_live(&self, v: &Version, damaged: &BTreeSet<u64>) -> BTreeSet<u64> {
        let mut count: HashMap<u64, u64> = HashMap::new();
        for vs in self.keys.values() {
            if let Some((_, Ver { op: Some(_), src: Src::Table(n) })) = vs.last() {
                *count.entry(*n).or_insert(0) += 1;
            }
        }
        count
            .into_iter()
            .filter(|(n, c)| !damaged.contains(n) && *c > v.files.get(n).map_or(0, |m| m.live))
            .map(|(n, _)| n)
            .collect()
    }

    /// Report every key whose newest version comes from a table of `bad_tables`.
    fn report_suspects(&self, v: &Version, file: &Path, offset: u64, why: &str, sink: &mut dyn SalvageSink) {
        for (k, vs) in &self.keys {
            if let Some((_, Ver { op: Some(_), src: Src::Table(n) })) = vs.last() {
                if self.bad_tables.contains(n) {
                    let live = v.files.get(n).map_or(0, |m| m.live);
                    sink.lost(Lost {
                        file: file.to_path_buf(),
                        offset,
                        key: Some(k.clone()),
                        detail: format!(
                            "{why}: rebuilt from the tables, where table {n} holds more keys than its {live} \
                             live items; this key may have been deleted (its delete dropped by a merge)"
                        ),
                    });
                }
            }
        }
    }

    /// Hand the newest version of every key to the sink, its value read and verified; when
    /// it fails, report the key and fall back to older versions.
    fn resolve(&self, pm: &Pm, dirs: &Dirs, sink: &mut dyn SalvageSink) {
        for (k, vs) in &self.keys {
            let mut reported = false;
            for (order, v) in vs.iter().rev() {
                let Some(a) = v.op else {
                    sink.record(k, None, *order);
                    break;
                };
                match read_value(pm, dirs, a) {
                    Ok(val) => {
                        sink.record(k, Some(val), *order);
                        break;
                    }
                    Err((at, why)) => {
                        if !reported {
                            let (file, offset) = pm.locate(at);
                            let (no, off) = layout::split_vaddr(a);
                            sink.lost(Lost {
                                file,
                                offset,
                                key: Some(k.clone()),
                                detail: format!(
                                    "value of the newest version (from {}, value pool {no} offset {off}): {why}",
                                    v.src
                                ),
                            });
                            reported = true;
                        }
                    }
                }
            }
        }
    }
}

/// A table's block losts, renamed to the pool file and offset the table lies at.
struct TableSink<'a> {
    inner: &'a mut dyn SalvageSink,
    base: u64,
    number: u64,
    lost: bool,
}

impl SalvageSink for TableSink<'_> {
    fn record(&mut self, key: &[u8], value: Option<&[u8]>, order: Order) {
        self.inner.record(key, value, order);
    }
    fn lost(&mut self, l: Lost) {
        self.lost = true;
        self.inner.lost(Lost {
            offset: self.base + l.offset,
            detail: format!("table {}: {}", self.number, l.detail),
            ..l
        });
    }
}

/// Read and verify the value record at address `a` (pool number : offset); on failure the
/// region address to blame and why.
fn read_value<'a>(pm: &'a Pm, dirs: &Dirs, a: u64) -> std::result::Result<&'a [u8], (u64, String)> {
    let (no, off) = layout::split_vaddr(a);
    let places = dirs.places(no);
    let intact = dirs.pools.contains_key(&no);
    let mut first = None;
    for p in &places {
        match read_record(pm, p, off) {
            Ok(v) => return Ok(v),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    let slot = layout::VDIR_ADDR + u64::from(no) * layout::SLOT_LEN;
    Err(match (first, intact) {
        (Some(e), true) => e,
        (Some((_, e)), false) => (
            slot,
            format!("value pool {no}'s directory slot is damaged, and the place it names holds no such value ({e})"),
        ),
        (None, _) => (slot, format!("value pool {no} has no directory slot (its place in PM is unknown)")),
    })
}

/// Read and verify the record at offset `off` of pool `p`.
fn read_record<'a>(pm: &'a Pm, p: &VSlot, off: u32) -> std::result::Result<&'a [u8], (u64, String)> {
    let at = p.addr.saturating_add(u64::from(off));
    let cap = u64::from(p.cap);
    if u64::from(off) + RECORD_OVERHEAD > cap {
        return Err((p.addr, "value address past the end of the pool".into()));
    }
    let size = pm
        .slice(at, 4)
        .and_then(|h| Cursor::new(h).u32())
        .ok_or_else(|| (at, "value record outside the PM region".to_string()))?;
    if u64::from(off) + RECORD_OVERHEAD + u64::from(size) > cap {
        return Err((at, "value record runs past the end of the pool".into()));
    }
    let len = (size as usize).checked_add(4).ok_or_else(|| (at, "value record too large".to_string()))?;
    let rec = pm.slice(at + 4, len).ok_or_else(|| (at, "value record outside the PM region".to_string()))?;
    let (v, c) = rec.split_at(size as usize);
    if Cursor::new(c).u32() != Some(layout::record_crc(p.gen, v)) {
        return Err((at, "value record checksum mismatch".into()));
    }
    Ok(v)
}

/// The keys the bytes of a damaged WAL record (at `off`, `len` bytes skipped) seem to
/// hold, for the report: the operations decoded until they stop making sense.
fn key_hints(data: &[u8], off: usize, len: u64) -> String {
    let end = usize::try_from(len).ok().and_then(|l| off.checked_add(l)).map_or(data.len(), |e| e.min(data.len()));
    let Some(p) = data.get(off.saturating_add(8)..end) else { return String::new() };
    let mut c = Cursor::new(p);
    let mut keys = Vec::new();
    let n = c.u32().unwrap_or(0);
    for _ in 0..n.min(16) {
        let Some(kind) = c.u8().filter(|k| *k <= 1) else { break };
        let Some(k) = c.u16().and_then(|l| c.bytes(l as usize)) else { break };
        keys.push(crate::escape(k));
        if kind == 0 && c.skip(6).is_none() {
            break;
        }
    }
    if keys.is_empty() {
        String::new()
    } else {
        format!("; its bytes seem to hold keys {}", keys.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use crate::fs::{FaultFs, Fs};
    use crate::pm::sim::SimDevice;
    use crate::repair::{salvage, Salvaged};
    use crate::{Db, Options, Preset};

    fn dir() -> PathBuf {
        PathBuf::from("/db")
    }

    fn opts(dev: &SimDevice, fs: &FaultFs) -> Options {
        crate::testing::sim_options(Preset::Hpdk, dev, fs)
    }

    fn run(dev: &SimDevice, fs: &FaultFs) -> Salvaged {
        salvage(&dir(), &opts(dev, fs), false).unwrap()
    }

    fn live(s: &Salvaged) -> Vec<(Vec<u8>, Vec<u8>)> {
        s.live().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }

    fn names(fs: &FaultFs, prefix: &str) -> Vec<String> {
        let mut n: Vec<String> = fs.list(&dir()).unwrap().into_iter().filter(|n| n.starts_with(prefix)).collect();
        n.sort();
        n
    }

    fn poke_file(fs: &FaultFs, name: &str, off: usize) {
        let p = dir().join(name);
        let b = fs.read_all(&p).unwrap()[off];
        fs.poke(&p, off, &[b ^ 0x21]).unwrap();
    }

    /// Offset of `needle` in PM pool 0's durable image.
    fn find(dev: &SimDevice, needle: &[u8]) -> usize {
        let img = dev.durable_image(0).unwrap();
        img.windows(needle.len()).position(|w| w == needle).unwrap()
    }

    fn key(i: usize) -> Vec<u8> {
        format!("keep-{i:03}").into_bytes()
    }

    /// Table 1: `dead` and 20 live keys; table 2: the delete of `dead` (no live item: a
    /// merge frees it, dropping the tombstone, while table 1 keeps the stale put).
    fn stale_put_store() -> (SimDevice, FaultFs) {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = Db::open(dir(), opts(&dev, &fs)).unwrap();
        db.put(b"dead", b"deleted value").unwrap();
        for i in 0..20 {
            db.put(key(i), b"live value").unwrap();
        }
        db.flush().unwrap();
        db.delete(b"dead").unwrap();
        db.flush().unwrap();
        db.compact().unwrap();
        assert_eq!(db.get(b"dead").unwrap(), None);
        db.close().unwrap();
        drop(db);
        (dev, fs)
    }

    #[test]
    fn a_deleted_key_is_not_brought_back_from_a_table_the_merge_left() {
        let (dev, fs) = stale_put_store();
        let s = run(&dev, &fs);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert!(s.newest.get(b"dead".as_slice()).is_none_or(|v| v.1.is_none()), "the stale put came back");
        assert_eq!(s.live().count(), 20);
        // Without the recovery file the tables are replayed: table 1's live count shows it
        // holds a key too many, and its keys are reported (the stale put among them).
        let dumps = names(&fs, "BTREE-");
        assert_eq!(dumps.len(), 1);
        let copy = fs.crash();
        poke_file(&copy, &dumps[0], 20);
        let s = run(&dev.simulate_crash(0, 0.0), &copy);
        let lost: Vec<&[u8]> = s.lost.iter().map(|l| l.key.as_deref().unwrap()).collect();
        assert!(lost.contains(&b"dead".as_slice()), "{:?}", s.lost);
        assert_eq!(s.live().filter(|(k, _)| k.starts_with(b"keep-")).count(), 20);
    }

    #[test]
    fn a_damaged_value_is_reported_with_its_key_and_an_older_version_kept() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = Db::open(dir(), opts(&dev, &fs)).unwrap();
        db.put(b"k1", b"old value of k1").unwrap();
        db.put(b"k2", b"value of k2").unwrap();
        db.flush().unwrap();
        db.put(b"k1", b"new value of k1").unwrap();
        db.put(b"k3", b"value of k3").unwrap();
        // Crashed with the newest writes in the WAL (table 1 is newer than the empty
        // recovery file), then closed cleanly (everything in the recovery file).
        let crashed = (dev.simulate_crash(0, 0.0), fs.crash());
        db.close().unwrap();
        drop(db);
        let cases = [
            (&crashed, b"new value of k1".as_slice(), b"k1".as_slice(), Some(b"old value of k1".as_slice())),
            (&crashed, b"value of k3", b"k3", None),
            (&(dev.simulate_crash(0, 0.0), fs.crash()), b"new value of k1", b"k1", None),
        ];
        for (i, ((dev, fs), value, k, kept)) in cases.into_iter().enumerate() {
            let copy = dev.simulate_crash(0, 0.0);
            let at = find(dev, value) + 3;
            assert!(copy.poke(0, at, &[value[3] ^ 0x5a]));
            let s = run(&copy, &fs.crash());
            assert_eq!(s.lost.len(), 1, "case {i}: {:?}", s.lost);
            assert_eq!(s.lost[0].key.as_deref(), Some(k), "case {i}");
            assert!(s.lost[0].file.ends_with("pool-000000"), "case {i}: {:?}", s.lost[0]);
            assert_eq!(s.newest.get(k).and_then(|v| v.1.as_deref()), kept, "case {i}");
            let k2 = s.newest.get(b"k2".as_slice()).and_then(|v| v.1.as_deref());
            assert_eq!(k2, Some(b"value of k2".as_slice()), "case {i}");
        }
    }

    #[test]
    fn damaged_metadata_that_holds_no_data_loses_nothing() {
        let (dev, fs) = stale_put_store();
        let want = live(&run(&dev, &fs));
        // A pool header (the region does not open: the pools are read directly), and CURRENT
        // (the newest MANIFEST is read).
        let copy = dev.simulate_crash(0, 0.0);
        let img = dev.durable_image(0).unwrap();
        assert!(copy.poke(0, 3, &[img[3] ^ 0x5a]));
        let s = run(&copy, &fs.crash());
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), want);
        let copy = fs.crash();
        poke_file(&copy, "CURRENT", 2);
        let s = run(&dev.simulate_crash(0, 0.0), &copy);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), want);
    }

    #[test]
    fn a_damaged_manifest_record_is_reported_and_the_recovery_file_still_used() {
        let (dev, fs) = stale_put_store();
        let want = live(&run(&dev, &fs));
        let m = names(&fs, "MANIFEST-");
        let copy = fs.crash();
        poke_file(&copy, &m[0], 12);
        let s = run(&dev.simulate_crash(0, 0.0), &copy);
        assert!(!s.lost.is_empty() && s.lost.iter().all(|l| l.key.is_none()), "{:?}", s.lost);
        assert_eq!(live(&s), want);
    }

    #[test]
    fn unflushed_writes_come_from_the_wal_and_flushed_generations_are_not_replayed() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let db = Db::open(dir(), opts(&dev, &fs)).unwrap();
        db.put(b"k", b"v1").unwrap();
        let wal = names(&fs, "wal-").pop().unwrap();
        let stale = fs.read_all(&dir().join(&wal)).unwrap();
        db.flush().unwrap();
        db.put(b"k", b"v2").unwrap();
        db.flush().unwrap();
        db.put(b"w", b"in the WAL only").unwrap();
        db.delete(b"gone").unwrap();
        // A crash: the WAL holds the last writes; and an older, flushed generation is back
        // (as if the crash came between a flush's commit and the removal of its WAL).
        let (dev2, fs2) = (dev.simulate_crash(0, 0.0), fs.crash());
        drop(db);
        fs2.write_atomic(&dir().join(&wal), &stale).unwrap();
        let s = run(&dev2, &fs2);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), vec![(b"k".to_vec(), b"v2".to_vec()), (b"w".to_vec(), b"in the WAL only".to_vec())]);
        assert!(s.newest.get(b"gone".as_slice()).is_some_and(|v| v.1.is_none()));
    }

    #[test]
    fn a_damaged_pool_slot_is_read_as_it_stands_and_its_values_verified() {
        let (dev, fs) = stale_put_store();
        let want = live(&run(&dev, &fs));
        let img = dev.durable_image(0).unwrap();
        let slot = super::layout::VDIR_ADDR as usize;
        // The checksum, the generation (a recovery file lists it), the kind byte: every value
        // still verifies. The address: the values cannot be found, each key is reported.
        for (field, found) in [(28, true), (5, true), (0, true), (10, false)] {
            let copy = dev.simulate_crash(0, 0.0);
            assert!(copy.poke(0, slot + field, &[img[slot + field] ^ 0x5a]));
            let s = run(&copy, &fs.crash());
            if found {
                assert!(s.lost.is_empty(), "field {field}: {:?}", s.lost);
                assert_eq!(live(&s), want);
            } else {
                assert_eq!(s.lost.len(), want.len(), "field {field}: {:?}", s.lost);
                assert!(s.lost.iter().all(|l| l.key.is_some() && l.detail.contains("damaged")), "{:?}", s.lost);
            }
        }
    }

    #[test]
    fn a_store_open_refuses_for_want_of_a_recovery_file_is_salvaged_from_its_tables() {
        // Close removes every recovery file but the highest-numbered one. A merge that a
        // crash cut before its commit leaves one numbered above what the MANIFEST knows;
        // after a restart that closes before the merge reruns, it is the one kept, and open
        // refuses the store. The tables, checked against the MANIFEST's live counts, give
        // the state back.
        let (dev, fs) = stale_put_store();
        let want = live(&run(&dev, &fs));
        let old = names(&fs, "BTREE-").pop().unwrap();
        let n: u64 = old.trim_start_matches("BTREE-").parse().unwrap();
        let stale = super::layout::Dump { covered: n + 1, tables: vec![n + 1], ..Default::default() };
        fs.write_atomic(&dir().join(super::dump_name(n + 1)), &super::layout::encode_dump(&stale)).unwrap();
        fs.remove(&dir().join(&old)).unwrap();
        assert!(Db::open(dir(), opts(&dev, &fs)).is_err());
        let s = run(&dev, &fs);
        // The stale put of `dead` makes its table hold a key too many: its keys are reported.
        assert!(s.lost.iter().all(|l| l.key.is_some()), "{:?}", s.lost);
        assert!(s.lost.iter().any(|l| l.key.as_deref() == Some(b"dead".as_slice())));
        let got: Vec<_> = live(&s).into_iter().filter(|(k, _)| k.as_slice() != b"dead").collect();
        assert_eq!(got, want);
    }

    #[test]
    fn key_hints_read_what_they_can() {
        let rec = super::layout::encode_wal(&[(b"alpha".as_slice(), Some(7)), (b"beta", None)]);
        let h = super::key_hints(&rec, 0, rec.len() as u64);
        assert!(h.contains("alpha, beta"), "{h}");
        assert_eq!(super::key_hints(&rec, rec.len(), 0), "");
    }
}
