//! The HotStore (HoaKV §3.2–3.3): the hot vlog of fixed-size vTables in PM, the DRAM hot
//! index (N buckets, cuckoo placement over E hash functions, overflow chains), the
//! heat-sorted list and an ordered map of the hot keys for scans.
//!
//! # Hot vlog
//! A vTable (`vtable_size`, 2 MiB by default) holds slots of one size class. A slot has two
//! halves and an 8-byte *selector* (sealed, self-checking: [`layout::seal_word`]) naming
//! the current half and its sequence number; 0 means free. An update of a hot key whose
//! record still fits the class writes the *other* half, persists it, then stores and
//! persists the selector (failure-atomic): the old value survives a crash until the new one
//! is durable, and the slot is reused in place (the paper's recycle of the invalid value)
//! without allocation or log. Freeing a slot is one selector store of 0. Recovery reads
//! each selector: the half it names must verify (checksum, same sequence number), else the
//! store is corrupt — a damaged hot record is reported, never silently replaced by an
//! older cold version. Per key, the slot with the higher sequence number wins (a crash
//! between a relocation's two selector stores leaves two); the other is freed.
//!
//! vTables are published in a PM directory (one sealed 8-byte word each) after their
//! header is persisted and their selectors zeroed; a vTable whose slots are all free is
//! unpublished and its extent returned to the PM heap (when its class has another vTable
//! with room).
//!
//! # Hot index
//! Entry `{keyTag u16, vTable u16, slot u32, heat u16, next u32}` plus the current half and
//! the position in the heat list. Placement tries the buckets `h_1(key) … h_E(key) mod N` for
//! an empty one (cuckoo placement without displacement, as the paper describes); when all
//! are taken the entry is chained to bucket `h_E`. A lookup walks `h_E … h_1`, compares the
//! keyTag (upper 16 bits of another hash) and then the full key from the PM record. The
//! E hash functions are derived by double hashing from two crc32c hashes of the key.
//!
//! # Heat
//! Each entry has a 16-bit heat, kept in the heat-sorted order ([`super::heat`]), hottest
//! first; a heat increase is the paper's insertion step (done in O(1), see there).
//! HeatLimit is the heat of the order's tail once the store has filled, 0 before (see
//! [`Hot::heat_limit`]). Heat is not persistent: recovered entries start at 1.
//!
//! # Clean entries
//! An entry promoted by a read is *clean* until it is written: the ColdStore still holds its
//! value as the key's newest version (only a write changes that, and a write to a hot key
//! clears the flag). Group maintenance treats a clean hot key's cold value as live and
//! relocates it like a cold key's (a rewritten pointer that recovery finds newer than the
//! hot record names the same value), so that value stays readable. Demoting a clean entry
//! writes nothing back: its hot record is invalidated and the LSM version is again the
//! newest. Recovered entries are not clean (recovery may have skipped their older WAL
//! operation).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::{Bound, Range};
use std::sync::Arc;

use super::heat::HeatOrder;
use super::layout::{self, HotRecord};
use crate::error::{Error, Result};
use crate::pm::heap::{self, Heap};
use crate::pm::Region;

const NONE: u32 = u32::MAX;

/// A recovered hot record's place: (seq, vTable, slot, half, tombstone).
type Found = (u64, u16, u32, u8, bool);

/// Hot keys copied out under the HotStore lock, in key order ([`Hot::read_keys`]): the
/// keys in one reused buffer (no allocation per entry once it has grown) and each entry's
/// tombstone flag, from the DRAM index. No value: a range read fetches the value of the hot
/// entry it returns, and only that one, with [`Hot::read_value`].
#[derive(Debug, Default)]
pub struct HotKeys {
    buf: Vec<u8>,
    /// Per entry: where its key is in `buf`, and whether it is a tombstone.
    ents: Vec<(Range<usize>, bool)>,
    /// Per entry: where its record was in PM when the batch was copied (address, bytes) —
    /// a prefetch hint only, never read through.
    recs: Vec<(u64, usize)>,
}

impl HotKeys {
    fn clear(&mut self) {
        self.buf.clear();
        self.ents.clear();
        self.recs.clear();
    }

    fn push(&mut self, k: &[u8], tomb: bool, rec: (u64, usize)) {
        let ko = self.buf.len();
        self.buf.extend_from_slice(k);
        self.ents.push((ko..self.buf.len(), tomb));
        self.recs.push(rec);
    }

    /// Where entry `i`'s record was when the batch was copied (a prefetch hint).
    pub fn record_at(&self, i: usize) -> Option<(u64, usize)> {
        self.recs.get(i).copied()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.ents.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.ents.is_empty()
    }

    /// Key of entry `i` (empty past the end).
    pub fn key(&self, i: usize) -> &[u8] {
        self.ents.get(i).and_then(|e| self.buf.get(e.0.clone())).unwrap_or(&[])
    }

    /// True when entry `i` is a hot tombstone (or past the end).
    pub fn tomb(&self, i: usize) -> bool {
        self.ents.get(i).is_none_or(|e| e.1)
    }
}

/// A hot key's value as [`Hot::read_value`] found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HotValue {
    /// The key is no longer hot.
    Gone,
    /// A hot tombstone.
    Deleted,
    /// Copied into the caller's buffer.
    Copied,
}

/// One hot index entry.
#[derive(Debug, Clone)]
struct Entry {
    tag: u16,
    vt: u16,
    slot: u32,
    half: u8,
    tomb: bool,
    next: u32,
    seq: u64,
    bucket: u32,
    /// Promoted by a read and not written since: the ColdStore still holds this value, so
    /// a demotion need not write it back.
    clean: bool,
}

/// Which keys may be hot, asked without the HotStore's lock: one counter per hash of the
/// key (a counting filter with one hash), raised when a key is linked into the index and
/// lowered when it is unlinked, both under the HotStore's exclusive lock (so updates never
/// race each other). A zero counter means no hot key hashes there: the key is not hot. A
/// counter that reaches 255 stays there (lowering it could later read zero for a key
/// still hot); it only costs a lock for the keys that share it.
///
/// What a zero is worth depends on the caller: it is exact only for a key whose hotness
/// nobody can change meanwhile (the write path holds the key's stripe and the engine's
/// writer lock, and only those or the exclusive writer lock make a key hot or cold; the
/// link or unlink that set the counter happened before the caller took them).
#[derive(Debug)]
pub struct HotFilter {
    counts: Box<[std::sync::atomic::AtomicU8]>,
}

impl HotFilter {
    /// One counter per 64 bytes of slot capacity, a power of two between 4 Ki and 4 Mi: a
    /// hot slot takes at least 128 bytes (two halves of at least 64), so there are at least
    /// two counters per key the capacity can hold, at most one byte of DRAM per 64 bytes of
    /// HotStore (1 MiB for the default 64 MiB).
    pub fn for_capacity(capacity: u64) -> HotFilter {
        let n = (capacity / 64).clamp(1 << 12, 1 << 22).next_power_of_two() as usize;
        HotFilter { counts: (0..n).map(|_| std::sync::atomic::AtomicU8::new(0)).collect() }
    }

    fn slot(&self, key: &[u8]) -> &std::sync::atomic::AtomicU8 {
        // The high half of a 64-bit multiply depends on every bit of the checksum (its low
        // bits alone would make keys that share a counter share a write stripe too).
        // `counts.len()` is a power of two; the index is in bounds.
        let h = (u64::from(crc32c::crc32c(key)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize;
        &self.counts[h & (self.counts.len() - 1)]
    }

    /// False when `key` is not hot (see the type's docs for when that is exact).
    pub fn may_contain(&self, key: &[u8]) -> bool {
        self.slot(key).load(std::sync::atomic::Ordering::Relaxed) != 0
    }

    fn add(&self, key: &[u8]) {
        let c = self.slot(key);
        let v = c.load(std::sync::atomic::Ordering::Relaxed);
        if v < u8::MAX {
            c.store(v + 1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn remove(&self, key: &[u8]) {
        let c = self.slot(key);
        let v = c.load(std::sync::atomic::Ordering::Relaxed);
        if v != 0 && v < u8::MAX {
            c.store(v - 1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// DRAM bytes of the counters.
    pub fn dram_bytes(&self) -> u64 {
        self.counts.len() as u64
    }
}

/// An update written to PM by [`Hot::stage_update`] that the index does not name yet.
#[derive(Debug)]
#[must_use = "a staged update is visible to recovery but not to readers until finished"]
pub struct Staged {
    idx: u32,
    vt: u16,
    slot: u32,
    half: u8,
    seq: u64,
    tomb: bool,
}

#[derive(Debug)]
struct VTable {
    addr: u64,
    class: u32,
    nslots: u32,
    free: Vec<u32>,
    used: u32,
}

impl VTable {
    fn half_addr(&self, slot: u32, half: u8) -> u64 {
        self.addr + layout::half_offset(self.nslots, self.class, slot, half)
    }

    fn sel_addr(&self, slot: u32) -> u64 {
        self.addr + layout::selector_offset(slot)
    }
}

/// What the store looks like (stats, tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HotFigures {
    /// Hot entries (tombstones included).
    pub entries: u64,
    /// Bytes of slots in use (both halves).
    pub used_bytes: u64,
    /// Published vTables.
    pub vtables: u64,
    /// Entries chained behind a bucket's first entry.
    pub overflow: u64,
    /// Buckets.
    pub buckets: u64,
}

/// A hot key's state as a lookup sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HotGet {
    /// Not hot.
    Miss,
    /// Hot, deleted.
    Deleted,
    /// Hot with this value.
    Value(Vec<u8>),
}

/// A hot record read back for demotion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Victim {
    /// The key.
    pub key: Vec<u8>,
    /// Its value (`None`: a hot tombstone).
    pub value: Option<Vec<u8>>,
    /// Its heat when it was demoted.
    pub heat: u16,
    /// The ColdStore holds this value already: demotion writes nothing back.
    pub clean: bool,
    idx: u32,
}

/// The DRAM side of the HotStore, under one lock.
#[derive(Debug)]
pub struct Hot {
    region: Arc<Region>,
    /// Which keys may be hot, readable without the HotStore's lock ([`HotFilter`]).
    filter: Arc<HotFilter>,
    heap: Heap,
    vtable_size: u64,
    dir_slots: u32,
    capacity: u64,
    e: usize,
    buckets: Vec<u32>,
    entries: Vec<Entry>,
    free_entries: Vec<u32>,
    order: HeatOrder,
    keys: BTreeMap<Vec<u8>, u32>,
    vtables: Vec<Option<VTable>>,
    /// Per class: vTables with a free slot.
    open: HashMap<u32, BTreeSet<u16>>,
    used_bytes: u64,
    /// The store has been full (a demotion ran, or a recovered store is within 1/16 of its
    /// capacity): HeatLimit is the smallest heat from now on.
    filled: bool,
    live: u64,
    /// Entries dropped from the index that were not clean (a dirty demotion, a hot overflow,
    /// a stale record at recovery): each changed where the key's newest value lives, to the
    /// ColdStore. Iterators compare it to tell when their ColdStore sources are too old
    /// (see `super::iter`). A clean entry's removal changes nothing there: not counted.
    dirty_removals: u64,
    /// Slots whose PM record lost to a newer one at recovery (invalidated).
    pub recovered_duplicates: u64,
}

fn hashes(key: &[u8]) -> (u32, u32, u16) {
    let a = crc32c::crc32c_append(0x9e37_79b9, key);
    let b = crc32c::crc32c_append(0x85eb_ca6b, key) | 1;
    let t = crc32c::crc32c_append(0xc2b2_ae35, key);
    (a, b, (t >> 16) as u16)
}

impl Hot {
    /// Open (or create) the HotStore in `region`: `capacity` bytes of slots at most,
    /// `vtable_size` vTables, `e` hash functions over `buckets` buckets (0: derived).
    pub fn open(
        region: Arc<Region>,
        create: bool,
        capacity: u64,
        vtable_size: u64,
        e: usize,
        buckets: usize,
    ) -> Result<Hot> {
        let want_slots = layout::dir_slots_for(capacity, vtable_size);
        if create {
            let sb = layout::encode_superblock(vtable_size, want_slots);
            let zero = vec![0u8; want_slots as usize * 8];
            // SAFETY: a new store's layout area; nobody else uses the region yet.
            unsafe {
                region.write(layout::DIR_ADDR, &zero)?;
                region.write(layout::SUPERBLOCK_ADDR, &sb)?;
            }
            region.persist(layout::DIR_ADDR, zero.len() as u64);
            region.persist(layout::SUPERBLOCK_ADDR, 64);
        }
        let sb = region.slice_checked(layout::SUPERBLOCK_ADDR, 64, "hoakv superblock")?;
        let (vtable_size, dir_slots) =
            layout::decode_superblock(sb).map_err(|d| region.corruption(layout::SUPERBLOCK_ADDR, d))?;
        let nb = if buckets > 0 { buckets } else { ((capacity / 2048).max(64) as usize).next_power_of_two() };
        let mut hot = Hot {
            heap: Heap::new(),
            vtable_size,
            dir_slots,
            capacity,
            e: e.clamp(1, 8),
            buckets: vec![NONE; nb],
            entries: Vec::new(),
            free_entries: Vec::new(),
            order: HeatOrder::default(),
            keys: BTreeMap::new(),
            vtables: (0..dir_slots).map(|_| None).collect(),
            open: HashMap::new(),
            used_bytes: 0,
            filled: false,
            live: 0,
            dirty_removals: 0,
            recovered_duplicates: 0,
            region,
            filter: Arc::new(HotFilter::for_capacity(capacity)),
        };
        hot.recover()?;
        hot.filled = hot.used_bytes >= hot.capacity - hot.capacity / 16;
        Ok(hot)
    }

    /// Rebuild the index from the vTables' selectors and records.
    fn recover(&mut self) -> Result<()> {
        let r = self.region.clone();
        let mut extents = Vec::new();
        // key → (seq, vt, slot, half, tomb)
        let mut best: HashMap<Vec<u8>, Found> = HashMap::new();
        let mut losers: Vec<(u16, u32)> = Vec::new();
        for id in 0..self.dir_slots {
            let da = layout::DIR_ADDR + u64::from(id) * 8;
            let Some(addr) = layout::open_word(r.load_u64_atomic(da)?)
                .map_err(|_| r.corruption(da, "damaged vTable directory entry"))?
            else {
                continue;
            };
            let h = r.slice_checked(addr, 64, "vTable header")?;
            let (hid, class) = layout::decode_vtable_header(h).map_err(|d| r.corruption(addr, d))?;
            if hid != id {
                return Err(r.corruption(addr, format!("vTable in directory slot {id} says it is {hid}")));
            }
            r.slice_checked(addr, self.vtable_size as usize, "vTable")?;
            extents.push((addr, self.vtable_size));
            let nslots = layout::slots_per(self.vtable_size, class);
            let mut vt = VTable { addr, class, nslots, free: Vec::new(), used: 0 };
            for s in (0..nslots).rev() {
                let sa = vt.sel_addr(s);
                let sel = layout::open_word(r.load_u64_atomic(sa)?)
                    .map_err(|_| r.corruption(sa, "damaged hot slot selector"))?;
                let Some(sel) = sel else {
                    vt.free.push(s);
                    continue;
                };
                let (seq, half) = (sel >> 1, (sel & 1) as u8);
                let a = vt.half_addr(s, half);
                let b = r.slice_checked(a, class as usize, "hot record")?;
                let rec = layout::decode_hot(b)
                    .filter(|rec| rec.seq == seq)
                    .ok_or_else(|| r.corruption(a, "hot record does not match its selector (damaged)"))?;
                let cand = (rec.seq, id as u16, s, half, rec.value.is_none());
                match best.get(rec.key) {
                    Some(old) if old.0 >= rec.seq => losers.push((id as u16, s)),
                    Some(old) => {
                        losers.push((old.1, old.2));
                        best.insert(rec.key.to_vec(), cand);
                    }
                    None => {
                        best.insert(rec.key.to_vec(), cand);
                    }
                }
                vt.used += 1;
            }
            self.vtables[id as usize] = Some(vt);
        }
        self.heap = heap::rebuild(&r, layout::heap_start(self.dir_slots), extents)?;
        for (vt, slot) in losers {
            self.recovered_duplicates += 1;
            self.invalidate(vt, slot)?;
            if let Some(t) = self.vtables[vt as usize].as_mut() {
                t.used -= 1;
                t.free.push(slot);
            }
        }
        let mut all: Vec<(Vec<u8>, Found)> = best.into_iter().collect();
        // Most recently written first: the best proxy for heat that survives a restart.
        all.sort_by_key(|(_, c)| std::cmp::Reverse(c.0));
        for (key, (seq, vt, slot, half, tomb)) in all {
            let class = self.vtables[vt as usize].as_ref().map_or(0, |t| t.class);
            self.used_bytes += 2 * u64::from(class);
            self.link(&key, vt, slot, half, tomb, seq, 1, false);
        }
        for (id, vt) in self.vtables.iter().enumerate() {
            if let Some(vt) = vt {
                if !vt.free.is_empty() {
                    self.open.entry(vt.class).or_default().insert(id as u16);
                }
            }
        }
        Ok(())
    }

    fn slots_per(&self, class: u32) -> u32 {
        layout::slots_per(self.vtable_size, class)
    }

    fn vt(&self, id: u16) -> Result<&VTable> {
        self.vtables
            .get(id as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::InvalidArgument("hot entry names a missing vTable".into()))
    }

    /// Write `rec` into `half` of a slot, persist, then make it current (selector).
    fn write_half(&self, vt: u16, slot: u32, half: u8, seq: u64, rec: &[u8]) -> Result<()> {
        let t = self.vt(vt)?;
        let a = t.half_addr(slot, half);
        // SAFETY: the slot belongs to the entry being written (or was just allocated) and
        // the half is not the current one, so no reader reads it (readers read the half
        // the index names, under the HotStore lock). Its only writers are writes of the
        // entry's key: under the HotStore lock held exclusively, or shared from
        // [`Hot::stage_update`], whose caller holds the key's write stripe (see there).
        unsafe { self.region.write(a, rec)? };
        self.region.persist(a, rec.len() as u64);
        let sa = t.sel_addr(slot);
        self.region.store_u64_atomic(sa, layout::seal_word((seq << 1) | u64::from(half)))?;
        self.region.persist(sa, 8);
        Ok(())
    }

    fn bucket_of(&self, h: (u32, u32, u16), i: usize) -> u32 {
        h.0.wrapping_add((i as u32).wrapping_mul(h.1)) % self.buckets.len() as u32
    }

    /// Insert an index entry (the PM record exists already) at the tail of the heat order.
    #[allow(clippy::too_many_arguments)]
    fn link(&mut self, key: &[u8], vt: u16, slot: u32, half: u8, tomb: bool, seq: u64, heat: u16, clean: bool) -> u32 {
        let h = hashes(key);
        let mut bucket = self.bucket_of(h, self.e - 1);
        for i in 0..self.e {
            let b = self.bucket_of(h, i);
            if self.buckets[b as usize] == NONE {
                bucket = b;
                break;
            }
        }
        let e = Entry { tag: h.2, vt, slot, half, tomb, next: self.buckets[bucket as usize], seq, bucket, clean };
        let idx = match self.free_entries.pop() {
            Some(i) => {
                self.entries[i as usize] = e;
                i
            }
            None => {
                self.entries.push(e);
                (self.entries.len() - 1) as u32
            }
        };
        self.buckets[bucket as usize] = idx;
        self.order.insert(idx, heat);
        self.keys.insert(key.to_vec(), idx);
        self.filter.add(key);
        if !tomb {
            self.live += 1;
        }
        idx
    }

    /// The filter of the keys that may be hot, kept by this store (shared so that callers
    /// can ask it without the HotStore's lock).
    pub fn filter(&self) -> Arc<HotFilter> {
        self.filter.clone()
    }

    fn record(&self, idx: u32) -> Result<HotRecord<'_>> {
        let e = &self.entries[idx as usize];
        let vt = self.vt(e.vt)?;
        let a = vt.half_addr(e.slot, e.half);
        let b = self.region.slice_checked(a, vt.class as usize, "hot record")?;
        layout::decode_hot(b).ok_or_else(|| self.region.corruption(a, "hot record checksum mismatch"))
    }

    /// The key bytes of entry `idx`'s record, unverified (bounds-checked).
    fn raw_key(&self, idx: u32) -> Result<&[u8]> {
        let e = &self.entries[idx as usize];
        let vt = self.vt(e.vt)?;
        let a = vt.half_addr(e.slot, e.half);
        let b = self.region.slice_checked(a, vt.class as usize, "hot record")?;
        let kl = b.get(6..8).map_or(0, |x| usize::from(u16::from_le_bytes([x[0], x[1]])));
        b.get(layout::HOT_HEADER..layout::HOT_HEADER + kl)
            .ok_or_else(|| self.region.corruption(a, "hot record key length past its slot"))
    }

    /// The index entry of `key`, if hot. A candidate whose key bytes differ is verified
    /// (checksum) before it is passed over: a damaged key must not make a hot key look
    /// cold (its older cold version would be served). A matching key is verified by
    /// whoever reads the record.
    fn find(&self, key: &[u8]) -> Result<Option<u32>> {
        let h = hashes(key);
        for i in (0..self.e).rev() {
            let b = self.bucket_of(h, i);
            let mut cur = self.buckets[b as usize];
            while cur != NONE {
                let e = &self.entries[cur as usize];
                if e.tag == h.2 {
                    if self.raw_key(cur)? == key {
                        return Ok(Some(cur));
                    }
                    self.record(cur)?;
                }
                cur = e.next;
            }
        }
        Ok(None)
    }

    /// True when `key` is hot and not clean: its hot record is newer than the ColdStore's
    /// version, which group maintenance must then leave alone (see the module docs).
    pub fn dirty(&self, key: &[u8]) -> Result<bool> {
        Ok(self.find(key)?.is_some_and(|i| !self.entries[i as usize].clean))
    }

    /// True when `key` is hot (tombstones included); its record verifies.
    pub fn contains(&self, key: &[u8]) -> Result<bool> {
        match self.find(key)? {
            Some(idx) => self.record(idx).map(|_| true),
            None => Ok(false),
        }
    }

    /// Look `key` up; with `touch`, count an access (heat + 1, insertion step).
    pub fn get(&mut self, key: &[u8], touch: bool) -> Result<HotGet> {
        let Some(idx) = self.find(key)? else { return Ok(HotGet::Miss) };
        if touch {
            self.touch(idx);
        }
        self.value_at(idx)
    }

    /// Look `key` up without counting an access (a shared borrow: callers hold the
    /// HotStore's lock shared).
    pub fn peek(&self, key: &[u8]) -> Result<HotGet> {
        match self.find(key)? {
            Some(idx) => self.value_at(idx),
            None => Ok(HotGet::Miss),
        }
    }

    fn value_at(&self, idx: u32) -> Result<HotGet> {
        let r = self.record(idx)?;
        Ok(match r.value {
            Some(v) => HotGet::Value(v.to_vec()),
            None => HotGet::Deleted,
        })
    }

    fn touch(&mut self, idx: u32) {
        self.order.touch(idx);
    }

    /// HeatLimit: the smallest heat in the store once it has filled up, else 0 (while a new
    /// record of `need` bytes still fits a store that never filled). The room a demotion
    /// batch leaves does not lower the bar: without this, every key seen
    /// `promote_min_heat` times would be promoted into that room and demoted again.
    pub fn heat_limit(&self, need: u64) -> u16 {
        if !self.filled && self.used_bytes + need <= self.capacity {
            return 0;
        }
        self.order.min_heat().unwrap_or(0)
    }

    /// Slot bytes a record of this size takes, or `None` when it can never be hot (its
    /// slot would not fit a vTable).
    pub fn slot_bytes(&self, klen: usize, vlen: usize) -> Option<u64> {
        let class = layout::class_for(layout::hot_need(klen, vlen));
        (self.slots_per(class) >= 1).then_some(2 * u64::from(class))
    }

    /// Bytes still free under the capacity.
    pub fn room(&self) -> u64 {
        self.capacity.saturating_sub(self.used_bytes)
    }

    /// The first half of an update under the HotStore lock held *shared*: write `key`'s
    /// new record (value or tombstone, sequence number `seq`) into the other half of its
    /// slot and persist the slot's selector, so PM holds the new version (recovery picks
    /// the half the selector names). The index still names the old half, which readers
    /// go on reading, until [`Hot::finish_update`] flips it under the exclusive lock.
    /// `Ok(None)`: the key is not hot, or the record does not fit its slot (the caller
    /// updates under the exclusive lock, [`Hot::update`], which moves it).
    ///
    /// The caller must hold, until `finish_update` returns, what keeps every other writer
    /// of this entry out: the key's write stripe (no other write of the key, including the
    /// removal of a batch's hot key that found no room) and the engine's writer lock
    /// (demotions take it exclusively), or that lock exclusively. Whatever allocates,
    /// frees or moves slots needs the HotStore's lock exclusively, so it waits for the
    /// shared lock this runs under. Nothing else writes the inactive half or moves the slot.
    pub fn stage_update(&self, key: &[u8], value: Option<&[u8]>, seq: u64) -> Result<Option<Staged>> {
        let Some(idx) = self.find(key)? else { return Ok(None) };
        let e = &self.entries[idx as usize];
        let rec = layout::encode_hot(seq, key, value);
        if rec.len() > self.vt(e.vt)?.class as usize {
            return Ok(None);
        }
        let half = 1 - e.half;
        self.write_half(e.vt, e.slot, half, seq, &rec)?;
        Ok(Some(Staged { idx, vt: e.vt, slot: e.slot, half, seq, tomb: value.is_none() }))
    }

    /// The second half of an update begun by [`Hot::stage_update`]: the index names the
    /// new half, and the access is counted. Refuses (poisoning is the caller's) when the
    /// entry is not where the staging left it, which the caller's locks rule out.
    pub fn finish_update(&mut self, s: Staged) -> Result<()> {
        let en = self
            .entries
            .get_mut(s.idx as usize)
            .filter(|e| e.vt == s.vt && e.slot == s.slot && e.half == 1 - s.half)
            .ok_or_else(|| Error::Poisoned("hoakv: a staged hot update's entry moved before it was finished".into()))?;
        let was_tomb = en.tomb;
        en.half = s.half;
        en.seq = s.seq;
        en.tomb = s.tomb;
        en.clean = false;
        self.touch(s.idx);
        self.adjust_live(was_tomb, s.tomb);
        Ok(())
    }

    /// Write `key`'s new value (or tombstone) with sequence number `seq`: into the other
    /// half of its slot when it fits, else into a new slot (the old one freed after). The
    /// key must be hot. Counts an access.
    pub fn update(&mut self, key: &[u8], value: Option<&[u8]>, seq: u64) -> Result<()> {
        let idx = self.find(key)?.ok_or_else(|| Error::InvalidArgument("update of a key that is not hot".into()))?;
        self.touch(idx);
        let rec = layout::encode_hot(seq, key, value);
        let e = self.entries[idx as usize].clone();
        let class = self.vt(e.vt)?.class;
        if rec.len() <= class as usize {
            let half = 1 - e.half;
            self.write_half(e.vt, e.slot, half, seq, &rec)?;
            let en = &mut self.entries[idx as usize];
            en.half = half;
            en.seq = seq;
            en.tomb = value.is_none();
            en.clean = false;
            self.adjust_live(e.tomb, value.is_none());
            return Ok(());
        }
        // Relocate: the new slot first (the higher sequence number wins at recovery), then
        // free the old one.
        let new_class = layout::class_for(rec.len());
        let (vt, slot) = self.alloc_slot(new_class)?;
        if let Err(err) = self.write_half(vt, slot, 0, seq, &rec) {
            let _ = self.release_slot(vt, slot);
            return Err(err);
        }
        self.release_slot(e.vt, e.slot)?;
        self.used_bytes = self.used_bytes - 2 * u64::from(class) + 2 * u64::from(new_class);
        let en = &mut self.entries[idx as usize];
        en.vt = vt;
        en.slot = slot;
        en.half = 0;
        en.seq = seq;
        en.tomb = value.is_none();
        en.clean = false;
        self.adjust_live(e.tomb, value.is_none());
        Ok(())
    }

    fn adjust_live(&mut self, was_tomb: bool, is_tomb: bool) {
        match (was_tomb, is_tomb) {
            (true, false) => self.live += 1,
            (false, true) => self.live -= 1,
            _ => {}
        }
    }

    /// Make `key` hot with `value` (or a tombstone), sequence number `seq` and `heat`. The
    /// caller made room (see [`Hot::heat_limit`], [`Hot::take_coldest`]).
    /// `clean`: the value was just read from the ColdStore, which keeps it.
    pub fn insert(&mut self, key: &[u8], value: Option<&[u8]>, seq: u64, heat: u16, clean: bool) -> Result<()> {
        let rec = layout::encode_hot(seq, key, value);
        let class = layout::class_for(rec.len());
        let (vt, slot) = self.alloc_slot(class)?;
        if let Err(e) = self.write_half(vt, slot, 0, seq, &rec) {
            let _ = self.release_slot(vt, slot);
            return Err(e);
        }
        self.used_bytes += 2 * u64::from(class);
        self.link(key, vt, slot, 0, value.is_none(), seq, heat, clean);
        Ok(())
    }

    /// The coldest entries, from the tail of the heat order, until `bytes` of slots would
    /// be freed (at least one entry). They stay hot until [`Hot::remove`].
    pub fn take_coldest(&mut self, bytes: u64) -> Result<Vec<Victim>> {
        self.filled = true;
        let mut out = Vec::new();
        let mut freed = 0;
        for idx in self.order.coldest() {
            if freed >= bytes && !out.is_empty() {
                break;
            }
            let e = &self.entries[idx as usize];
            let class = self.vtables[e.vt as usize].as_ref().map_or(0, |t| t.class);
            freed += 2 * u64::from(class);
            let r = self.record(idx)?;
            out.push(Victim {
                key: r.key.to_vec(),
                value: r.value.map(<[u8]>::to_vec),
                heat: self.order.heat(idx),
                clean: e.clean,
                idx,
            });
        }
        Ok(out)
    }

    /// Demote `victims` (from [`Hot::take_coldest`]): invalidate their records in PM and
    /// drop them from the index. Call only once their values are durable in the ColdStore.
    pub fn remove(&mut self, victims: &[Victim]) -> Result<()> {
        for v in victims {
            self.unlink(v.idx, &v.key)?;
        }
        Ok(())
    }

    /// Drop `key` from the HotStore (its record invalidated), if hot.
    pub fn remove_key(&mut self, key: &[u8]) -> Result<bool> {
        match self.find(key)? {
            Some(idx) => {
                self.unlink(idx, key)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn unlink(&mut self, idx: u32, key: &[u8]) -> Result<()> {
        let e = self.entries[idx as usize].clone();
        let class = self.vtables[e.vt as usize].as_ref().map_or(0, |t| t.class);
        self.release_slot(e.vt, e.slot)?;
        self.used_bytes -= 2 * u64::from(class);
        // Bucket chain.
        let b = e.bucket as usize;
        if self.buckets[b] == idx {
            self.buckets[b] = e.next;
        } else {
            let mut cur = self.buckets[b];
            while cur != NONE {
                let n = self.entries[cur as usize].next;
                if n == idx {
                    self.entries[cur as usize].next = e.next;
                    break;
                }
                cur = n;
            }
        }
        // Heat list.
        self.order.remove(idx);
        self.keys.remove(key);
        if !e.tomb {
            self.live -= 1;
        }
        if !e.clean {
            self.dirty_removals += 1;
        }
        self.free_entries.push(idx);
        self.filter.remove(key);
        Ok(())
    }

    /// Free a slot in PM: its selector becomes 0 (persisted).
    fn invalidate(&mut self, vt: u16, slot: u32) -> Result<()> {
        let Some(t) = self.vtables[vt as usize].as_ref() else { return Ok(()) };
        let sa = t.sel_addr(slot);
        self.region.store_u64_atomic(sa, 0)?;
        self.region.persist(sa, 8);
        Ok(())
    }

    fn release_slot(&mut self, vt: u16, slot: u32) -> Result<()> {
        self.invalidate(vt, slot)?;
        let Some(t) = self.vtables[vt as usize].as_mut() else { return Ok(()) };
        t.used -= 1;
        t.free.push(slot);
        let class = t.class;
        let empty = t.used == 0;
        let set = self.open.entry(class).or_default();
        set.insert(vt);
        if empty && set.len() > 1 {
            set.remove(&vt);
            let addr = t.addr;
            self.region.store_u64_atomic(layout::DIR_ADDR + u64::from(vt) * 8, 0)?;
            self.region.persist(layout::DIR_ADDR + u64::from(vt) * 8, 8);
            self.vtables[vt as usize] = None;
            self.heap.free(addr, self.vtable_size);
        }
        Ok(())
    }

    fn alloc_slot(&mut self, class: u32) -> Result<(u16, u32)> {
        if let Some(&vt) = self.open.get(&class).and_then(|s| s.iter().next()) {
            if let Some(t) = self.vtables[vt as usize].as_mut() {
                if let Some(slot) = t.free.pop() {
                    t.used += 1;
                    if t.free.is_empty() {
                        if let Some(s) = self.open.get_mut(&class) {
                            s.remove(&vt);
                        }
                    }
                    return Ok((vt, slot));
                }
            }
        }
        if self.slots_per(class) == 0 {
            return Err(Error::InvalidArgument(format!("a hot record of class {class} does not fit a vTable")));
        }
        let id = self
            .vtables
            .iter()
            .position(Option::is_none)
            .ok_or_else(|| Error::PmFull(format!("all {} vTable directory slots are in use", self.dir_slots)))?;
        let addr = heap::alloc_or_grow(&mut self.heap, &self.region, self.vtable_size)?;
        let n = self.slots_per(class);
        let mut head = layout::encode_vtable_header(id as u32, class).to_vec();
        head.resize((layout::VT_HEADER + layout::selectors_len(u64::from(n))) as usize, 0);
        // SAFETY: a fresh heap extent, not yet published; HotStore lock held. Header and
        // zeroed selectors (every slot free) are persisted before the directory names it.
        unsafe { self.region.write(addr, &head)? };
        self.region.persist(addr, head.len() as u64);
        let da = layout::DIR_ADDR + id as u64 * 8;
        self.region.store_u64_atomic(da, layout::seal_word(addr))?;
        self.region.persist(da, 8);
        let mut free: Vec<u32> = (0..n).rev().collect();
        let slot = free.pop().unwrap_or(0);
        let vt = VTable { addr, class, nslots: n, free, used: 1 };
        if !vt.free.is_empty() {
            self.open.entry(class).or_default().insert(id as u16);
        }
        self.vtables[id] = Some(vt);
        Ok((id as u16, slot))
    }

    /// Halve every heat (the sliding window moved on). The order is unchanged.
    pub fn decay(&mut self) {
        self.order.halve();
    }

    /// Hot keys after `from` (`forward`), or the ones just before it, copied into `out` in
    /// key order with their tombstone flags: up to `max` entries, and no more once
    /// `max_bytes` of keys are copied (at least one entry). Returns true when entries were
    /// left out (more may follow). DRAM only: no PM record is read.
    pub fn read_keys(
        &self,
        from: Bound<&[u8]>,
        forward: bool,
        max: usize,
        max_bytes: usize,
        out: &mut HotKeys,
    ) -> bool {
        out.clear();
        let max = max.max(1);
        // One allocation per batch size, not a doubling series: a range read's iterator
        // starts with empty buffers (growing them was 3 % of seekrandom's samples).
        let n = max.min(self.keys.len());
        out.ents.reserve(n);
        out.recs.reserve(n);
        out.buf.reserve(n.saturating_mul(32).min(max_bytes));
        let mut fwd;
        let mut back;
        let it: &mut dyn Iterator<Item = (&Vec<u8>, &u32)> = if forward {
            fwd = self.keys.range::<[u8], _>((from, Bound::Unbounded));
            &mut fwd
        } else {
            back = self.keys.range::<[u8], _>((Bound::Unbounded, from)).rev();
            &mut back
        };
        let mut more = false;
        for (k, &idx) in &mut *it {
            if out.len() >= max || (!out.is_empty() && out.buf.len() >= max_bytes) {
                more = true;
                break;
            }
            let e = self.entries.get(idx as usize);
            let rec = e
                .and_then(|e| Some((e, self.vtables.get(e.vt as usize)?.as_ref()?)))
                .map_or((0, 0), |(e, vt)| (vt.half_addr(e.slot, e.half), vt.class as usize));
            out.push(k, e.is_none_or(|e| e.tomb), rec);
        }
        if !forward {
            // The batch is in key order whichever way it was read.
            out.ents.reverse();
            out.recs.reverse();
        }
        more
    }

    /// Copy hot `key`'s value into `out` (replacing its contents), its record verified
    /// (checksum): one hash probe and one record read, what a point read pays.
    pub fn read_value(&self, key: &[u8], out: &mut Vec<u8>) -> Result<HotValue> {
        let Some(idx) = self.find(key)? else { return Ok(HotValue::Gone) };
        let r = self.record(idx)?;
        Ok(match r.value {
            Some(v) => {
                out.clear();
                out.extend_from_slice(v);
                HotValue::Copied
            }
            None => HotValue::Deleted,
        })
    }

    /// Dirty entries dropped from the index so far (see the field).
    pub fn dirty_removals(&self) -> u64 {
        self.dirty_removals
    }

    /// Every hot key with its sequence number (recovery).
    pub fn seqs(&self) -> HashMap<Vec<u8>, u64> {
        self.keys.iter().map(|(k, &i)| (k.clone(), self.entries[i as usize].seq)).collect()
    }

    /// The highest sequence number of any hot record.
    pub fn max_seq(&self) -> u64 {
        self.keys.values().map(|&i| self.entries[i as usize].seq).max().unwrap_or(0)
    }

    /// Live (non-tombstone) hot keys.
    pub fn live(&self) -> u64 {
        self.live
    }

    /// Shape figures.
    pub fn figures(&self) -> HotFigures {
        let overflow =
            self.keys.values().filter(|&&i| self.buckets[self.entries[i as usize].bucket as usize] != i).count();
        HotFigures {
            entries: self.keys.len() as u64,
            used_bytes: self.used_bytes,
            vtables: self.vtables.iter().flatten().count() as u64,
            overflow: overflow as u64,
            buckets: self.buckets.len() as u64,
        }
    }

    /// The heat of `key`, if hot.
    pub fn heat_of(&self, key: &[u8]) -> Result<Option<u16>> {
        Ok(self.find(key)?.map(|i| self.order.heat(i)))
    }

    /// True when the heat list is sorted hottest first (tests, `check`).
    pub fn order_ok(&self) -> bool {
        self.order.check()
    }

    /// DRAM held by the index and the ordered key map.
    pub fn dram_bytes(&self) -> u64 {
        let keys: u64 = self.keys.keys().map(|k| k.len() as u64 + 48).sum();
        (self.buckets.len() * 4 + self.entries.len() * std::mem::size_of::<Entry>()) as u64
            + self.order.dram_bytes()
            + self.filter.dram_bytes()
            + keys
    }

    /// Verify every hot record (checksum, key, index agreement); returns the problems.
    pub fn check(&self) -> Vec<String> {
        let mut p = Vec::new();
        for (k, &i) in &self.keys {
            match self.record(i) {
                Ok(r) if r.key == k.as_slice() => {}
                Ok(_) => p.push(format!("hot entry of {} points at another key's record", crate::escape(k))),
                Err(e) => p.push(format!("hot record of {}: {e}", crate::escape(k))),
            }
            match self.find(k) {
                Ok(Some(j)) if j == i => {}
                _ => p.push(format!("hot key {} is not found through the hash index", crate::escape(k))),
            }
            if !self.filter.may_contain(k) {
                p.push(format!("hot key {} is missing from the hot-key filter", crate::escape(k)));
            }
        }
        if !self.order_ok() {
            p.push("hot heat list is out of order".into());
        }
        p
    }

    /// PM heap figures: (bytes in use by vTables, free bytes).
    pub fn heap_bytes(&self) -> (u64, u64) {
        (self.heap.total() - self.heap.free_bytes(), self.heap.free_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::HotFilter;

    /// A key is reported while linked and not after its unlink; a counter shared by more
    /// keys than it can count stays raised for good (never a false "not hot").
    #[test]
    fn the_filter_counts_links_and_saturates() {
        let f = HotFilter::for_capacity(0);
        assert_eq!(f.dram_bytes(), 1 << 12, "the smallest filter");
        assert!(!f.may_contain(b"k"));
        f.add(b"k");
        f.add(b"k");
        assert!(f.may_contain(b"k"));
        f.remove(b"k");
        assert!(f.may_contain(b"k"), "one link left");
        f.remove(b"k");
        assert!(!f.may_contain(b"k"), "both unlinked");
        for _ in 0..300 {
            f.add(b"s");
        }
        for _ in 0..300 {
            f.remove(b"s");
        }
        assert!(f.may_contain(b"s"), "a saturated counter is never lowered");
        // Keys that hash elsewhere are unaffected: of 1,000 other keys most read zero.
        let zero = (0..1000u32).filter(|i| !f.may_contain(&i.to_le_bytes())).count();
        assert!(zero >= 990, "{zero}");
        assert_eq!(HotFilter::for_capacity(64 << 20).dram_bytes(), 1 << 20, "one counter per 64 bytes");
        assert_eq!(HotFilter::for_capacity(u64::MAX).dram_bytes(), 1 << 22, "at most 4 Mi counters");
    }
}
