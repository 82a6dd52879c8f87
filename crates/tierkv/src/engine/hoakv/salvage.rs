//! Salvage of a `hoakv` store for `tierkv repair` ([`crate::repair`]): a read-only walk of
//! every persistent structure that holds data, trusting no index it cannot verify.
//!
//! # What is walked
//! - **HotStore (PM)**: the superblock, every vTable directory entry, each vTable's header
//!   and every slot selector; a slot whose (sealed) selector is non-zero is live and the
//!   half it names must decode (checksum) with the selector's sequence number. Only those
//!   records are reported: a free slot (selector 0) and the other half of a live slot hold
//!   superseded or stale records (an older version of the key, or a key that has moved on)
//!   and are never read as data. vTables no directory entry names (unpublished, or freed
//!   when empty) are not walked either.
//! - **ColdStore (files)**: the MANIFEST (every record that verifies is applied; damaged
//!   ones are skipped and reported), the SSTables it lists (shared
//!   [`salvage_sstable`]: index-guided, or block discovery by checksum when the footer or
//!   index is damaged), and the WALs newer than the MANIFEST's flushed generation
//!   (`format::log::read_log` in `SkipDamaged` mode, then `lsm::wal::decode`). WALs up to
//!   that generation are flushed already: recovery deletes them, so does salvage (ignores
//!   them: their operations, compared by sequence number, would beat the newer versions the
//!   tables hold). Tables the MANIFEST does not list are leftovers of an interrupted flush or
//!   compaction and are ignored — unless the MANIFEST was damaged (below).
//! - **Cold value log**: an LSM value that is a pointer is resolved by reading the record it
//!   names (`vlog-NNNNNN.log`) and checking its checksum and key. Only a pointer that could
//!   be the key's newest version is resolved (a pointer shadowed by a newer hot record,
//!   inline value or delete may name a value-log file group GC removed, as the live store
//!   allows); a failing pointer is reported lost with its key and the next older version
//!   is tried. The `GROUPS` file is not needed: pointers name their files.
//!
//! # Order (newest wins)
//! The read path decides between the tiers: a hot record beats every LSM version of its
//! key, except that recovery replays a WAL operation whose batch sequence number is higher
//! than the hot record's (a crash between the synced WAL write and the in-place hot
//! update). Inside the LSM, the WALs (not yet flushed) beat the tables, level-0 tables are
//! newest by file number, and a deeper level is older than every shallower one. So:
//! - hot record of sequence number `s`: `2^127 | s << 33 | 1 << 32` (wins a tie with a WAL
//!   batch of the same number, as recovery's `hot seq >= batch seq` does);
//! - operation `i` of a WAL batch of sequence number `s`: `2^127 | s << 33 | i` (later
//!   operations of one batch win, as in the MemTable);
//! - entry of table `n` at level `l`: `(2^32 - 1 - l) << 64 | n`.
//!
//! # What is reported lost, and what cannot be recovered
//! - A live slot whose named half fails: lost with its key when the key can be trusted (the
//!   other half verifies with the same key and key length, or the key read from the damaged
//!   half is one the ColdStore names), else without a key. Its older versions (LSM) may
//!   come back. The other half of the slot is not used as a fallback: after a demotion and
//!   a re-promotion into the same slot it can be older than the LSM's version.
//! - A damaged selector: a sealed word differs from what was written; if exactly one of
//!   "free" (0) and the seals of the slot's verifying halves lies within one damaged byte of
//!   it, that is taken as the selector (the half still verifies by its own checksum); else
//!   the keys of the verifying halves are reported lost (without a key when none verifies).
//! - A damaged directory entry: the heap is searched (vTables are allocated in
//!   `vtable_size` steps from each pool's heap start) for vTable headers carrying its
//!   directory slot that no other entry names; their live slots are walked. None found: lost
//!   without a key (unless the word is one damaged byte away from 0: an unused entry).
//! - A damaged vTable header: the slot size class is inferred (the class under which the
//!   most live selectors name a verifying half); none fits: lost without a key.
//! - A damaged superblock: the vTable size and directory length are taken from the options
//!   the store is opened with (`hoakv.vtable_size`, `hoakv.hot_store_size`), as at creation.
//! - A PM region that does not open (a damaged pool header, a store id that cannot be
//!   checked) is read raw: the pool files (or the simulator's images) directly, after
//!   checking that the pool belongs to this store (its store id, or one damaged byte from
//!   it). A pool that cannot be read or belongs to another store: lost without a key; the
//!   files are still salvaged.
//! - A damaged MANIFEST record: lost without a key. The table set is then uncertain: the
//!   tables on disk that no intact record lists are salvaged too, as level-0 tables by file
//!   number (a flush's table is exactly that; a compaction's output may then win over an
//!   older-numbered level-0 table, which the keyless loss allows). A torn last record while
//!   the PM "commit in flight" word is set is an interrupted commit and is dropped silently,
//!   as recovery does. No MANIFEST at all: every table on disk is salvaged that way and
//!   every WAL replayed.
//! - A damaged table block or WAL record: lost without a key (the keys inside cannot be
//!   trusted). A WAL's torn tail is reported too (the remains of a write a crash
//!   interrupted, or damage to the last record: they look alike). A batch whose other
//!   operations verify is kept even when one of its values (a pointer) is lost.
//! - A pointer whose value-log record is missing, past the end of its file, fails its
//!   checksum or names another key: lost with the key. (Recovery drops a WAL batch whose
//!   pointer finds no value, and every later batch: with an unsynced WAL that is the torn
//!   tail a power loss leaves. Salvage keeps the later batches: they verify, and their
//!   writes were acknowledged.)

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::cold::vlog_name;
use super::layout::{self, ColdValue, HotRecord, Pointer};
use crate::engine::EngineCtx;
use crate::error::Result;
use crate::format::crc;
use crate::format::log::{read_log, DropReason, WalRecovery};
use crate::fs::{Fs, FsFile};
use crate::lsm::{table_name, wal};
use crate::manifest::{decode_edits, Manifest, Version};
use crate::pm::Region;
use crate::repair::{salvage_sstable, Lost, Order, SalvageSink};
use crate::sstable::Kind;

/// Records with sequence numbers (hot records, WAL operations) rank above every table.
const SEQ_TIER: Order = 1 << 127;

/// Order of a hot record of sequence number `seq`.
fn hot_order(seq: u64) -> Order {
    SEQ_TIER | (u128::from(seq) << 33) | (1 << 32)
}

/// Order of operation `op` of a WAL batch of sequence number `seq`.
fn wal_order(seq: u64, op: u32) -> Order {
    SEQ_TIER | (u128::from(seq) << 33) | u128::from(op)
}

/// Order of an entry of table `number` at `level`.
fn table_order(level: u32, number: u64) -> Order {
    (u128::from(u32::MAX - level) << 64) | u128::from(number)
}

/// True when `a` and `b` differ in at most one byte.
fn one_byte_apart(a: u64, b: u64) -> bool {
    (a ^ b).to_le_bytes().iter().filter(|&&x| x != 0).count() <= 1
}

fn le_u64(b: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?))
}

fn le_u32(b: &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(..4)?.try_into().ok()?))
}

fn table_number(name: &str) -> Option<u64> {
    name.strip_suffix(".sst")?.parse().ok()
}

fn manifest_number(name: &str) -> Option<u64> {
    name.strip_prefix("MANIFEST-")?.parse().ok()
}

// ---------------------------------------------------------------------------------------
// PM access: the region, or the raw pool images when the region refuses to open.

/// A pool read without the region.
enum RawData {
    /// The simulator's durable image.
    Mem(Vec<u8>),
    /// A pool file, read on demand (pools are large).
    File(std::fs::File, u64),
}

struct RawPool {
    path: PathBuf,
    data: RawData,
}

/// Where PM bytes come from.
enum Pm {
    Region(Region),
    Raw { pool_size: u64, pools: Vec<RawPool> },
}

impl Pm {
    fn pool_size(&self) -> u64 {
        match self {
            Pm::Region(r) => r.pool_size(),
            Pm::Raw { pool_size, .. } => *pool_size,
        }
    }

    fn pool_count(&self) -> usize {
        match self {
            Pm::Region(r) => r.pool_count(),
            Pm::Raw { pools, .. } => pools.len(),
        }
    }

    /// `len` bytes at global offset `addr`, if they lie inside one pool.
    fn read(&self, addr: u64, len: usize) -> Option<Cow<'_, [u8]>> {
        match self {
            Pm::Region(r) => r.slice(addr, len).map(Cow::Borrowed),
            Pm::Raw { pool_size, pools } => {
                let pool = pools.get(usize::try_from(addr / pool_size).ok()?)?;
                let off = addr % pool_size;
                let end = off.checked_add(len as u64).filter(|&e| e <= *pool_size)?;
                match &pool.data {
                    RawData::Mem(v) => v.get(usize::try_from(off).ok()?..usize::try_from(end).ok()?).map(Cow::Borrowed),
                    RawData::File(f, flen) => {
                        if end > *flen {
                            return None;
                        }
                        let mut buf = vec![0u8; len];
                        f.read_exact_at(&mut buf, off).ok()?;
                        Some(Cow::Owned(buf))
                    }
                }
            }
        }
    }

    fn word(&self, addr: u64) -> Option<u64> {
        le_u64(&self.read(addr, 8)?)
    }

    /// The pool file and offset in it of global offset `addr` (as the region's corruption
    /// errors name them).
    fn locate(&self, addr: u64) -> (PathBuf, u64) {
        match self {
            Pm::Region(r) => r.locate(addr),
            Pm::Raw { pool_size, pools } => {
                let i = addr / pool_size;
                let path = usize::try_from(i)
                    .ok()
                    .and_then(|i| pools.get(i))
                    .map_or_else(|| PathBuf::from(format!("<pm>/pool-{i:06}")), |p| p.path.clone());
                (path, addr % pool_size)
            }
        }
    }
}

/// Whether a pool header (its first 64 bytes) lets the pool be read as this store's: its
/// store id is `db_id` (or differs in one damaged byte when the header fails its checksum);
/// any pool when the store id is unknown (0).
fn pool_is_ours(h: &[u8], db_id: u64) -> std::result::Result<(), String> {
    let (Some(id), Some(stored)) = (h.get(24..32).and_then(le_u64), h.get(32..36).and_then(le_u32)) else {
        return Err("the pool is shorter than its header".into());
    };
    let intact = h.get(..32).is_some_and(|b| crc::masked(b) == stored);
    match (db_id, intact) {
        (0, _) => Ok(()),
        (_, true) if id == db_id => Ok(()),
        (_, true) => Err(format!("the pool belongs to store {id:#x}, not {db_id:#x}")),
        (_, false) if one_byte_apart(id, db_id) => Ok(()),
        (_, false) => Err("the pool header is damaged and its store id is not this store's".into()),
    }
}

// ---------------------------------------------------------------------------------------
// The walk.

struct Walk<'a> {
    ctx: &'a EngineCtx,
    sink: &'a mut dyn SalvageSink,
    /// Per key: the order of its newest record that needs no value-log read (hot record,
    /// inline value, delete). Pointers at or below it are never read.
    floor: HashMap<Vec<u8>, Order>,
    /// LSM pointers, resolved at the end (only those above their key's floor).
    pending: Vec<(Vec<u8>, Order, Pointer)>,
    /// Every key a verified ColdStore record names (corroborates keys read from damaged hot
    /// records).
    cold_keys: HashSet<Vec<u8>>,
}

impl Walk<'_> {
    fn lost(&mut self, file: &Path, offset: u64, key: Option<&[u8]>, detail: impl Into<String>) {
        self.sink.lost(Lost { file: file.to_path_buf(), offset, key: key.map(<[u8]>::to_vec), detail: detail.into() });
    }

    fn pm_lost(&mut self, pm: &Pm, addr: u64, key: Option<&[u8]>, detail: impl Into<String>) {
        let (file, off) = pm.locate(addr);
        self.lost(&file, off, key, detail);
    }

    /// An intact record whose value is at hand.
    fn put(&mut self, key: &[u8], value: Option<&[u8]>, order: Order) {
        self.sink.record(key, value, order);
        match self.floor.get_mut(key) {
            Some(f) => *f = (*f).max(order),
            None => {
                self.floor.insert(key.to_vec(), order);
            }
        }
    }

    /// An intact ColdStore record: a delete (`None`) or a tagged LSM value.
    fn cold(&mut self, key: &[u8], raw: Option<&[u8]>, order: Order, file: &Path, offset: u64) {
        if !self.cold_keys.contains(key) {
            self.cold_keys.insert(key.to_vec());
        }
        match raw.map(layout::decode_cold) {
            None => self.put(key, None, order),
            Some(Ok(ColdValue::Inline(v))) => self.put(key, Some(&v), order),
            Some(Ok(ColdValue::Pointer(p))) => self.pending.push((key.to_vec(), order, p)),
            Some(Err(d)) => self.lost(file, offset, Some(key), format!("LSM value: {d}")),
        }
    }

    // --- PM ------------------------------------------------------------------------------

    /// The PM region, or its raw pools when it does not open; `None` (reported) when
    /// neither can be read.
    fn open_pm(&mut self) -> Option<Pm> {
        let err = match crate::engine::open_region(self.ctx) {
            Ok(r) => return Some(Pm::Region(r)),
            Err(e) => e,
        };
        let o = &self.ctx.opts;
        let mut pools: Vec<RawPool> = Vec::new();
        let mut pool_size = 0u64;
        let mut reported = false;
        for i in 0.. {
            let (path, data, len) = match &o.pm_device {
                Some(dev) => {
                    let Some(img) = dev.durable_image(i) else { break };
                    let len = img.len() as u64;
                    (PathBuf::from(format!("<sim>/pool-{i:06}")), RawData::Mem(img), len)
                }
                None => {
                    let dir = o.pm_path.clone().unwrap_or_else(|| self.ctx.dir.join("pm"));
                    let path = dir.join(format!("pool-{i:06}"));
                    if !path.exists() {
                        break;
                    }
                    let opened = std::fs::File::open(&path).and_then(|f| Ok((f.metadata()?.len(), f)));
                    match opened {
                        Ok((len, f)) => (path, RawData::File(f, len), len),
                        Err(e) => {
                            self.lost(&path, 0, None, format!("PM pool unreadable ({e}): its hot records are lost"));
                            reported = true;
                            break;
                        }
                    }
                }
            };
            if i == 0 {
                pool_size = if len.is_power_of_two() && len >= 4096 { len } else { o.pm_pool_size };
            }
            let header = match &data {
                RawData::Mem(v) => v.get(..64).map(<[u8]>::to_vec),
                RawData::File(f, _) => {
                    let mut b = vec![0u8; 64];
                    f.read_exact_at(&mut b, 0).ok().map(|_| b)
                }
            };
            if let Err(d) = pool_is_ours(header.as_deref().unwrap_or_default(), self.ctx.db_id) {
                self.lost(&path, 0, None, format!("PM region does not open ({err}) and {d}: its hot records are lost"));
                reported = true;
                break;
            }
            pools.push(RawPool { path, data });
        }
        if pools.is_empty() {
            if !reported {
                let path = match &o.pm_device {
                    Some(_) => PathBuf::from("<sim>/pool-000000"),
                    None => o.pm_path.clone().unwrap_or_else(|| self.ctx.dir.join("pm")).join("pool-000000"),
                };
                self.lost(&path, 0, None, format!("PM region does not open ({err}): every hot record is lost"));
            }
            return None;
        }
        Some(Pm::Raw { pool_size, pools })
    }

    /// Walk the HotStore: every live slot of every published vTable.
    fn walk_hot(&mut self, pm: &Pm) {
        let sb_addr = layout::SUPERBLOCK_ADDR;
        let sb = pm.read(sb_addr, 64).map(|b| b.into_owned()).unwrap_or_default();
        let (vt_size, slots) = match layout::decode_superblock(&sb) {
            Ok(g) => g,
            Err(d) => {
                let genuine =
                    sb.get(..60).zip(sb.get(60..64).and_then(le_u32)).is_some_and(|(b, c)| crc::masked(b) == c);
                if genuine {
                    self.pm_lost(pm, sb_addr, None, format!("hoakv superblock: {d}; the HotStore cannot be read"));
                    return;
                }
                // Damaged: the geometry a store created with these options has.
                let h = &self.ctx.opts.hoakv;
                (h.vtable_size, layout::dir_slots_for(h.hot_store_size, h.vtable_size))
            }
        };
        let mut tables: Vec<(u32, u64)> = Vec::new();
        let mut damaged: Vec<(u32, u64)> = Vec::new();
        for id in 0..slots {
            let da = layout::DIR_ADDR + u64::from(id) * 8;
            let Some(w) = pm.word(da) else {
                self.pm_lost(pm, da, None, "vTable directory runs past the PM region");
                break;
            };
            match layout::open_word(w) {
                Ok(None) => {}
                Ok(Some(addr)) => tables.push((id, addr)),
                Err(()) => damaged.push((id, w)),
            }
        }
        if !damaged.is_empty() {
            let claimed: HashSet<u64> = tables.iter().map(|t| t.1).collect();
            let found = self.find_vtables(pm, vt_size, slots);
            for (id, w) in damaged {
                let cands: Vec<u64> =
                    found.iter().filter(|(i, a)| *i == id && !claimed.contains(a)).map(|t| t.1).collect();
                if cands.is_empty() {
                    if !one_byte_apart(w, 0) {
                        self.pm_lost(
                            pm,
                            layout::DIR_ADDR + u64::from(id) * 8,
                            None,
                            format!("damaged vTable directory entry {id}, and no vTable of that slot found"),
                        );
                    }
                    continue;
                }
                tables.extend(cands.into_iter().map(|a| (id, a)));
            }
        }
        for (id, addr) in tables {
            self.walk_vtable(pm, id, addr, vt_size);
        }
    }

    /// Every address in the PM heaps where a vTable can start and a verifying header is:
    /// (directory slot, address).
    fn find_vtables(&self, pm: &Pm, vt_size: u64, slots: u32) -> Vec<(u32, u64)> {
        let mut out = Vec::new();
        let ps = pm.pool_size();
        for i in 0..pm.pool_count() as u64 {
            let mut a = if i == 0 { layout::heap_start(slots) } else { i * ps + crate::pm::POOL_HEADER_LEN };
            while a.saturating_add(vt_size) <= (i + 1) * ps {
                if let Some(Ok((id, _))) = pm.read(a, 64).map(|h| layout::decode_vtable_header(&h)) {
                    out.push((id, a));
                }
                a += vt_size;
            }
        }
        out
    }

    /// Walk one vTable: its live slots' records.
    fn walk_vtable(&mut self, pm: &Pm, id: u32, addr: u64, vt_size: u64) {
        let Some(tb) = pm.read(addr, vt_size as usize) else {
            self.pm_lost(pm, addr, None, format!("vTable {id} lies outside the PM region"));
            return;
        };
        let class = match layout::decode_vtable_header(tb.get(..64).unwrap_or_default()) {
            Ok((_, class)) => class,
            Err(d) => match infer_class(&tb, vt_size) {
                Inferred::Class(c) => c,
                Inferred::Empty => return,
                Inferred::Unknown => {
                    self.pm_lost(pm, addr, None, format!("vTable {id}: {d}, and no slot size fits its selectors"));
                    return;
                }
            },
        };
        let n = layout::slots_per(vt_size, class);
        for s in 0..n {
            let so = layout::selector_offset(s);
            let Some(w) = tb.get(so as usize..so as usize + 8).and_then(le_u64) else { break };
            let half_at = |h: u8| layout::half_offset(n, class, s, h);
            let half = |h: u8| tb.get(half_at(h) as usize..(half_at(h) + u64::from(class)) as usize);
            let dec = |h: u8| half(h).and_then(layout::decode_hot);
            match layout::open_word(w) {
                Ok(None) => {}
                Ok(Some(sel)) => {
                    let (seq, h) = (sel >> 1, (sel & 1) as u8);
                    match dec(h).filter(|r| r.seq == seq) {
                        Some(r) => self.put(r.key, r.value, hot_order(r.seq)),
                        None => {
                            let other = dec(1 - h).map(|r| r.key);
                            let key = half(h).and_then(|b| self.trusted_key(b, other));
                            self.pm_lost(
                                pm,
                                addr + half_at(h),
                                key.as_deref(),
                                "hot record does not match its selector (damaged)",
                            );
                        }
                    }
                }
                Err(()) => {
                    // Which of "free" and the verifying halves' selectors is one byte away?
                    let halves: [Option<HotRecord<'_>>; 2] = [dec(0), dec(1)];
                    let mut cands: Vec<Option<usize>> = Vec::new();
                    if one_byte_apart(w, 0) {
                        cands.push(None);
                    }
                    for (h, r) in halves.iter().enumerate() {
                        if let Some(r) = r {
                            if one_byte_apart(w, layout::seal_word((r.seq << 1) | h as u64)) {
                                cands.push(Some(h));
                            }
                        }
                    }
                    match cands.as_slice() {
                        [None] => {}
                        [Some(h)] => {
                            if let Some(r) = halves.get(*h).copied().flatten() {
                                self.put(r.key, r.value, hot_order(r.seq));
                            }
                        }
                        _ => {
                            let keys: Vec<&[u8]> = halves.iter().flatten().map(|r| r.key).collect();
                            let detail = "damaged hot slot selector: which half is current cannot be told";
                            if keys.is_empty() {
                                self.pm_lost(pm, addr + so, None, detail);
                            }
                            for k in keys {
                                self.pm_lost(pm, addr + so, Some(k), detail);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The key of a damaged hot record, when it can be trusted: the other half of the slot
    /// verifies with the same key (length and bytes), or the key read is one the ColdStore
    /// names.
    fn trusted_key(&self, half: &[u8], other: Option<&[u8]>) -> Option<Vec<u8>> {
        let kl = half.get(6..8).map(|b| usize::from(u16::from_le_bytes([b[0], b[1]])))?;
        let key = half.get(layout::HOT_HEADER..layout::HOT_HEADER + kl)?;
        if other == Some(key) || self.cold_keys.contains(key) {
            return Some(key.to_vec());
        }
        None
    }

    // --- Files ---------------------------------------------------------------------------

    /// Walk the ColdStore's files: MANIFEST, tables, WALs.
    fn walk_files(&mut self, inflight: bool) -> Result<()> {
        let ctx = self.ctx;
        let names = ctx.fs.list(&ctx.dir)?;
        let (version, certain) = self.read_manifest(&names, inflight)?;
        let on_disk: BTreeSet<u64> = names.iter().filter_map(|n| table_number(n)).collect();
        let mut tables: Vec<(u64, u32)> = Vec::new();
        for (&n, m) in &version.files {
            if on_disk.contains(&n) {
                tables.push((n, m.level));
            } else {
                self.lost(&ctx.dir.join(table_name(n)), 0, None, "a table the MANIFEST names is missing");
            }
        }
        if !certain {
            tables.extend(on_disk.iter().filter(|n| !version.files.contains_key(n)).map(|&n| (n, 0)));
        }
        for (n, level) in tables {
            let path = ctx.dir.join(table_name(n));
            let data = ctx.fs.read_all(&path)?;
            let mut entries: Vec<(Kind, Vec<u8>, Vec<u8>, u64)> = Vec::new();
            salvage_sstable(
                &data,
                &path,
                |e, off| entries.push((e.kind, e.key.to_vec(), e.value.to_vec(), off)),
                &mut *self.sink,
            );
            let order = table_order(level, n);
            for (kind, k, v, off) in entries {
                self.cold(&k, (kind == Kind::Put).then_some(v.as_slice()), order, &path, off);
            }
        }
        let mut gens: Vec<u64> = names.iter().filter_map(|n| wal::number(n)).filter(|&g| g > version.counter).collect();
        gens.sort_unstable();
        let newest = gens.last().copied();
        for g in gens {
            let path = ctx.dir.join(wal::name(g));
            let data = ctx.fs.read_all(&path)?;
            let r = match read_log(&data, 0, WalRecovery::SkipDamaged) {
                Ok(r) => r,
                Err((o, d)) => {
                    self.lost(&path, o, None, format!("WAL {d}"));
                    continue;
                }
            };
            for &(off, p) in &r.records {
                match wal::decode(p) {
                    Ok(b) => {
                        for (i, (k, v)) in b.ops.iter().enumerate() {
                            let i = u32::try_from(i).unwrap_or(u32::MAX);
                            self.cold(k, v.as_deref(), wal_order(b.seq, i), &path, off);
                        }
                    }
                    Err(d) => self.lost(&path, off, None, format!("WAL batch: {d}")),
                }
            }
            for &(off, len, reason) in &r.dropped {
                let what = match (reason, Some(g) == newest) {
                    (DropReason::TornTail, true) => {
                        "torn tail of the newest WAL (the remains of a write a crash interrupted, or a damaged last record)"
                    }
                    (DropReason::TornTail, false) => "damaged last record of a WAL synced whole before the next one started",
                    _ => "damaged WAL record",
                };
                self.lost(&path, off, None, format!("{what} ({len} bytes)"));
            }
        }
        Ok(())
    }

    /// The version the MANIFEST describes (every intact record applied), and whether it is
    /// certain (no record was damaged or dropped).
    fn read_manifest(&mut self, names: &[String], inflight: bool) -> Result<(Version, bool)> {
        let ctx = self.ctx;
        let current = ctx.dir.join("CURRENT");
        let named = ctx
            .fs
            .read_all(&current)
            .ok()
            .and_then(|c| std::str::from_utf8(&c).ok().and_then(|s| s.strip_suffix('\n')).and_then(manifest_number))
            .filter(|&n| names.iter().any(|x| *x == Manifest::name(n)));
        // CURRENT damaged or naming a missing file: the newest MANIFEST on disk (a newer one
        // than CURRENT names holds the same version or one with a commit applied whose files
        // are all there).
        let number = named.or_else(|| names.iter().filter_map(|n| manifest_number(n)).max());
        let Some(number) = number else {
            self.lost(&current, 0, None, "no MANIFEST: table levels and the flushed WAL generation are unknown");
            return Ok((Version::default(), false));
        };
        let path = ctx.dir.join(Manifest::name(number));
        let data = ctx.fs.read_all(&path)?;
        let body = data.get(8..).unwrap_or_default();
        let mut v = Version::default();
        let mut certain = true;
        let mut applied = false;
        match read_log(body, 8, WalRecovery::SkipDamaged) {
            Ok(r) => {
                for &(off, p) in &r.records {
                    match decode_edits(p) {
                        Ok(e) => {
                            v.apply(&e);
                            applied = true;
                        }
                        Err(d) => {
                            certain = false;
                            self.lost(&path, off + 8, None, format!("MANIFEST record: {d}"));
                        }
                    }
                }
                for &(off, len, reason) in &r.dropped {
                    if reason == DropReason::TornTail && inflight {
                        continue; // an interrupted commit: not committed, recovery drops it too
                    }
                    certain = false;
                    self.lost(
                        &path,
                        off + 8,
                        None,
                        format!("damaged MANIFEST record ({len} bytes): the table set it changed is uncertain"),
                    );
                }
            }
            Err((o, d)) => {
                certain = false;
                self.lost(&path, o + 8, None, format!("MANIFEST {d}"));
            }
        }
        if !applied {
            certain = false;
            if body.is_empty() {
                self.lost(&path, 0, None, "the MANIFEST holds no record");
            }
        }
        Ok((v, certain))
    }

    // --- Value log -----------------------------------------------------------------------

    /// Resolve the pointers that may be their key's newest version, newest first; the first
    /// that reads back is the key's value, each failing one is reported lost.
    fn resolve(&mut self) -> Result<()> {
        let mut pending = std::mem::take(&mut self.pending);
        pending.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut files: HashMap<u64, Option<Box<dyn FsFile>>> = HashMap::new();
        let mut done: Option<Vec<u8>> = None;
        for (key, order, p) in pending {
            if done.as_ref() == Some(&key) || self.floor.get(&key).is_some_and(|&f| f >= order) {
                done = Some(key);
                continue;
            }
            match self.read_value(&mut files, &key, p)? {
                Ok(v) => {
                    self.sink.record(&key, Some(&v), order);
                    done = Some(key);
                }
                Err(d) => {
                    let path = self.ctx.dir.join(vlog_name(p.file));
                    self.lost(&path, p.offset, Some(&key), d);
                }
            }
        }
        Ok(())
    }

    /// The value `p` points at for `key` (checksum and key checked); `Ok(Err)` when it
    /// cannot be read back.
    fn read_value(
        &self,
        files: &mut HashMap<u64, Option<Box<dyn FsFile>>>,
        key: &[u8],
        p: Pointer,
    ) -> Result<std::result::Result<Vec<u8>, String>> {
        let fs = &self.ctx.fs;
        let f = match files.entry(p.file) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let path = self.ctx.dir.join(vlog_name(p.file));
                e.insert(if fs.exists(&path) { Some(fs.open_immutable(&path)?) } else { None })
            }
        };
        let Some(f) = f else {
            return Ok(Err("pointer into a value-log file that does not exist".into()));
        };
        let flen = f.len()?;
        if p.offset.checked_add(u64::from(p.len)).is_none_or(|e| e > flen) {
            return Ok(Err("value-log record past the end of the file".into()));
        }
        let mut buf = vec![0u8; p.len as usize];
        let mut got = 0usize;
        while got < buf.len() {
            let n = f.read_at(p.offset + got as u64, buf.get_mut(got..).unwrap_or_default())?;
            if n == 0 {
                return Ok(Err("value-log record past the end of the file".into()));
            }
            got += n;
        }
        Ok(match layout::decode_vlog(&buf) {
            Ok((k, _)) if k != key => Err("value-log record belongs to another key".into()),
            Ok((_, v)) => Ok(v.to_vec()),
            Err(d) => Err(d),
        })
    }
}

/// What the selectors of a vTable with a damaged header say its class is.
enum Inferred {
    /// The class under which the most live selectors name a verifying half.
    Class(u32),
    /// No live selector under some class: the vTable holds nothing.
    Empty,
    /// No class fits.
    Unknown,
}

/// Infer the half size of a vTable whose header fails (`tb`: the whole vTable).
fn infer_class(tb: &[u8], vt_size: u64) -> Inferred {
    let mut best: Option<(u32, std::cmp::Reverse<u32>, u32)> = None;
    let mut empty = false;
    let max = vt_size.saturating_sub(2 * layout::VT_HEADER) / 2;
    for c in (64..=max).step_by(64) {
        let Ok(class) = u32::try_from(c) else { break };
        if layout::class_for(class as usize) != class {
            continue;
        }
        let n = layout::slots_per(vt_size, class);
        let (mut hits, mut bad) = (0u32, 0u32);
        for s in 0..n {
            let so = layout::selector_offset(s) as usize;
            match tb.get(so..so + 8).and_then(le_u64).map(layout::open_word) {
                Some(Ok(None)) => {}
                Some(Ok(Some(sel))) => {
                    let h = (sel & 1) as u8;
                    let at = layout::half_offset(n, class, s, h);
                    let rec = tb.get(at as usize..(at + u64::from(class)) as usize).and_then(layout::decode_hot);
                    if rec.is_some_and(|r| r.seq == sel >> 1) {
                        hits += 1;
                    } else {
                        bad += 1;
                    }
                }
                _ => bad += 1,
            }
        }
        if hits == 0 && bad == 0 {
            empty = true;
        }
        let score = (hits, std::cmp::Reverse(bad), class);
        if hits > 0 && best.as_ref().is_none_or(|b| (score.0, score.1) > (b.0, b.1)) {
            best = Some(score);
        }
    }
    match best {
        Some((_, _, c)) => Inferred::Class(c),
        None if empty => Inferred::Empty,
        None => Inferred::Unknown,
    }
}

/// Walk the store read-only and report every intact record and every damaged one.
pub(crate) fn salvage(ctx: &EngineCtx, sink: &mut dyn SalvageSink) -> Result<()> {
    let mut w = Walk { ctx, sink, floor: HashMap::new(), pending: Vec::new(), cold_keys: HashSet::new() };
    let pm = w.open_pm();
    // A torn last MANIFEST record is an interrupted commit only while this word is set.
    let inflight = pm.as_ref().and_then(|p| p.word(layout::INFLIGHT_ADDR)).is_some_and(|v| v != 0);
    w.walk_files(inflight)?;
    if let Some(pm) = &pm {
        w.walk_hot(pm);
    }
    w.resolve()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::*;
    use crate::fs::FaultFs;
    use crate::options::{HoakvOptions, Options};
    use crate::pm::sim::SimDevice;
    use crate::repair::Salvaged;
    use crate::{Db, Preset};

    fn dir() -> PathBuf {
        PathBuf::from("/db")
    }

    fn opts(dev: &SimDevice, fs: &FaultFs, h: HoakvOptions) -> Options {
        crate::testing::sim_options(Preset::Hoakv, dev, fs).hoakv(h)
    }

    fn salvaged(dev: &SimDevice, fs: &FaultFs, h: &HoakvOptions) -> Salvaged {
        crate::repair::salvage(&dir(), &opts(dev, fs, h.clone()), false).unwrap()
    }

    fn live(s: &Salvaged) -> Vec<(Vec<u8>, Vec<u8>)> {
        s.live().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }

    fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
        hay.windows(needle.len()).position(|w| w == needle)
    }

    /// Stale records are never data: the other half of a live slot (an older value, here
    /// of a key deleted by a hot tombstone), a freed slot after a demotion (the key was then
    /// deleted in the ColdStore), and a WAL the MANIFEST says is flushed but that is still
    /// on disk (its operation is older than the table version).
    #[test]
    fn stale_records_are_not_resurrected() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        // Four 128-byte hot slots: promotions past them demote.
        let h = HoakvOptions { hot_store_size: 4 * 128, heat_window: 1 << 30, ..crate::testing::hoakv_small() };
        let db = Db::open(dir(), opts(&dev, &fs, h.clone())).unwrap();
        // "a": hot (second write promotes), updated in place, then deleted while hot.
        db.put("a", "A-old-1").unwrap();
        db.put("a", "A-STALE-2").unwrap();
        db.put("a", "A-STALE-3").unwrap();
        db.delete("a").unwrap();
        db.flush().unwrap();
        // "w": cold only (one write); its WAL is kept aside and put back after the flush.
        db.put("w", "W-STALE-old").unwrap();
        let wal_name = fs.list(&dir()).unwrap().into_iter().filter(|n| wal::number(n).is_some()).max().unwrap();
        let stale_wal = fs.read_all(&dir().join(&wal_name)).unwrap();
        assert!(find(&stale_wal, b"W-STALE-old").is_some());
        db.flush().unwrap();
        // Hot keys b, c, d, e, written in both halves; then hotter keys demote some of
        // them and reuse their slots (half 0), which leaves half 1 stale in a live slot.
        for k in ["b", "c", "d", "e"] {
            for r in 1..=3 {
                db.put(k, format!("{k}-STALE-{r}")).unwrap();
            }
        }
        for i in 0..4 {
            for _ in 0..4 {
                db.put(format!("x{i}"), format!("x{i}-value")).unwrap();
            }
        }
        assert!(db.stats().design.get("demotions").copied().unwrap_or(0) > 0, "a demotion ran");
        // The demoted keys are deleted in the ColdStore (the others in the HotStore).
        for k in ["b", "c", "d", "e"] {
            db.delete(k).unwrap();
        }
        db.put("w", "W-new").unwrap();
        db.flush().unwrap();
        let want: Vec<(Vec<u8>, Vec<u8>)> = db.scan(..).unwrap().map(|r| r.unwrap()).collect();
        db.close().unwrap();
        drop(db);
        // The stale records are there to be found.
        let img = dev.durable_image(0).unwrap();
        assert!(find(&img, b"A-STALE-3").is_some());
        assert!(["b", "c", "d", "e"].iter().any(|k| find(&img, format!("{k}-STALE-3").as_bytes()).is_some()));
        let mut f = fs.create(&dir().join(&wal_name)).unwrap();
        f.append(&stale_wal).unwrap();
        f.sync().unwrap();
        let s = salvaged(&dev, &fs, &h);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), want);
        assert!(want.iter().any(|(k, v)| k == b"w" && v == b"W-new"));
        assert!(!want.iter().any(|(k, _)| ["a", "b", "c", "d", "e"].contains(&std::str::from_utf8(k).unwrap())));
    }

    /// A damaged value-log record is reported with the key whose newest version points at
    /// it; the key has no older version here, so it is gone (the other key is intact).
    #[test]
    fn a_damaged_cold_value_is_reported_with_its_key() {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let h = HoakvOptions { promote_min_heat: u16::MAX, ..crate::testing::hoakv_small() };
        let db = Db::open(dir(), opts(&dev, &fs, h.clone())).unwrap();
        db.put("small", "inline").unwrap();
        db.put("big", vec![b'Z'; 300]).unwrap();
        db.flush().unwrap();
        db.close().unwrap();
        drop(db);
        let name = fs.list(&dir()).unwrap().into_iter().find(|n| {
            n.starts_with("vlog-") && { find(&fs.read_all(&dir().join(n)).unwrap(), &[b'Z'; 300]).is_some() }
        });
        let name = name.unwrap();
        let data = fs.read_all(&dir().join(&name)).unwrap();
        let at = find(&data, &[b'Z'; 300]).unwrap() + 100;
        fs.poke(&dir().join(&name), at, b"Y").unwrap();
        let s = salvaged(&dev, &fs, &h);
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        assert_eq!(s.lost[0].key.as_deref(), Some(b"big".as_slice()));
        assert_eq!(s.lost[0].file, dir().join(&name));
        assert_eq!(live(&s), vec![(b"small".to_vec(), b"inline".to_vec())]);
    }

    /// One store with one hot key ("hot": its older value is in the ColdStore), and where
    /// its PM structures are.
    struct HotStore {
        dev: SimDevice,
        fs: FaultFs,
        h: HoakvOptions,
        vtable: usize,
        selector: usize,
        half: usize,
    }

    fn hot_store() -> HotStore {
        let (dev, fs) = (SimDevice::new(), FaultFs::new());
        let h = crate::testing::hoakv_small();
        let db = Db::open(dir(), opts(&dev, &fs, h.clone())).unwrap();
        db.put("cold", "c").unwrap();
        db.put("hot", "H-old").unwrap();
        db.put("hot", "H-new").unwrap();
        db.close().unwrap();
        drop(db);
        let slots = layout::dir_slots_for(h.hot_store_size, h.vtable_size);
        let vt = layout::heap_start(slots);
        let class = layout::class_for(layout::hot_need(3, 5));
        let n = layout::slots_per(h.vtable_size, class);
        let img = dev.durable_image(0).unwrap();
        assert_eq!(layout::decode_vtable_header(&img[vt as usize..vt as usize + 64]), Ok((0, class)));
        let half = (vt + layout::half_offset(n, class, 0, 0)) as usize;
        assert_eq!(layout::decode_hot(&img[half..half + class as usize]).map(|r| r.value), Some(Some(&b"H-new"[..])));
        let selector = (vt + layout::selector_offset(0)) as usize;
        HotStore { dev, fs, h, vtable: vt as usize, selector, half }
    }

    fn want_all() -> Vec<(Vec<u8>, Vec<u8>)> {
        vec![(b"cold".to_vec(), b"c".to_vec()), (b"hot".to_vec(), b"H-new".to_vec())]
    }

    /// Damage the hot store's PM at `off` (xor `x`) and salvage.
    fn damaged(st: &HotStore, off: usize, x: u8) -> Salvaged {
        let copy = st.dev.simulate_crash(0, 0.0);
        let img = copy.durable_image(0).unwrap();
        assert!(copy.poke(0, off, &[img[off] ^ x]));
        salvaged(&copy, &st.fs, &st.h)
    }

    #[test]
    fn an_undamaged_hot_store_salvages_whole() {
        let st = hot_store();
        let s = salvaged(&st.dev, &st.fs, &st.h);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), want_all());
    }

    /// A damaged hot record is reported with its key (the ColdStore names it); the key's
    /// older version comes back.
    #[test]
    fn a_damaged_hot_record_is_reported_with_its_key() {
        let st = hot_store();
        let s = damaged(&st, st.half + layout::HOT_HEADER + 3 + 2, 0x5a);
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        assert_eq!(s.lost[0].key.as_deref(), Some(b"hot".as_slice()));
        assert_eq!(s.lost[0].file, PathBuf::from("<sim>/pool-000000"));
        assert_eq!(s.lost[0].offset, st.half as u64);
        assert_eq!(live(&s), vec![(b"cold".to_vec(), b"c".to_vec()), (b"hot".to_vec(), b"H-old".to_vec())]);
    }

    /// Damage the HotStore's structures that index the records — a selector, the vTable
    /// header, its directory entry, the superblock, the pool header — one byte at a time:
    /// every record is still found and nothing is lost.
    #[test]
    fn damaged_hot_store_indexes_are_read_through() {
        let st = hot_store();
        let dir_entry = layout::DIR_ADDR as usize;
        let cases = [
            ("selector", st.selector),
            ("selector top byte", st.selector + 7),
            ("vTable header magic", st.vtable),
            ("vTable header class", st.vtable + 12),
            ("vTable header checksum", st.vtable + 60),
            ("directory entry", dir_entry + 1),
            ("directory entry top byte", dir_entry + 7),
            ("superblock vTable size", layout::SUPERBLOCK_ADDR as usize + 13),
            ("superblock checksum", layout::SUPERBLOCK_ADDR as usize + 61),
            ("pool header magic", 2),
            ("pool header store id", 27),
            ("pool header checksum", 33),
        ];
        for (what, off) in cases {
            for x in [0x01, 0x5a, 0xff] {
                let s = damaged(&st, off, x);
                assert!(s.lost.is_empty(), "{what} ^ {x:#x}: {:?}", s.lost);
                assert_eq!(live(&s), want_all(), "{what} ^ {x:#x}");
            }
        }
        // A free slot's selector damaged: nothing was there, nothing is lost.
        let s = damaged(&st, st.selector + 8 + 2, 0x5a);
        assert!(s.lost.is_empty(), "{:?}", s.lost);
        assert_eq!(live(&s), want_all());
    }

    /// A pool of another store is not salvaged (its records are not this store's data).
    #[test]
    fn a_foreign_pool_is_not_read() {
        let st = hot_store();
        let o = Options { preset: Preset::Hoakv, ..opts(&st.dev, &st.fs, st.h.clone()) };
        let ctx = EngineCtx {
            dir: dir(),
            opts: o,
            fs: crate::fs::CountingFs::new(Arc::new(st.fs.clone())),
            db_id: 0x1234_5678_9abc_def1,
            fresh: false,
            pm_health: Arc::default(),
            recovery: Arc::default(),
        };
        let mut s = Salvaged::default();
        salvage(&ctx, &mut s).unwrap();
        assert_eq!(s.lost.len(), 1, "{:?}", s.lost);
        assert!(s.lost[0].key.is_none() && s.lost[0].detail.contains("belongs to store"), "{:?}", s.lost);
        assert_eq!(live(&s), vec![(b"cold".to_vec(), b"c".to_vec()), (b"hot".to_vec(), b"H-old".to_vec())]);
    }
}
