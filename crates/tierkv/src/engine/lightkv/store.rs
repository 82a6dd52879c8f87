//! LightKV's write buffer store: the RH-Tree over PM write-buffer segments, with recovery
//! by segment scan (§V) — the core the `lightkv` engine adds flush, linked PM leaves and
//! compaction to (docs/design/lightkv.md). No SSTables yet: every record lives in the PWB.
//!
//! # PM layout (docs/format/lightkv.md)
//! Pool 0: superblock at 64 (`TKVLIGHT`, version, segment size, crc), the segment-id counter
//! at 128 (an 8-byte word bumped and persisted before an id is used, so ids are never
//! reused even after segments are freed), the segment directory at 4096 (`SEG_SLOTS` slots
//! of `addr u64 | id u64`; a slot is live when its id is non-zero), and the PM heap after it.
//!
//! # Write path
//! One writer lock. A put routes its key to a partition, appends a record to the partition's
//! active segment (a new segment when it is full), persists it with one fence, and indexes it
//! in the RH-Tree (linking a new top leaf when a full leaf cannot split). Deletes append a
//! tombstone and index it: a tombstone must outlive every older record of its key in the
//! PWB, and an indexed tombstone keeps its segment alive. Each segment counts the index
//! entries pointing into it; an inactive segment whose count reaches zero is freed (its slot
//! cleared with an atomic store, then its extent returned to the heap).
//!
//! # Recovery
//! Read the directory, verify each live segment's header, rebuild the heap from the live
//! extents, scan every segment (a torn tail ends a segment; damage before valid records is
//! `Corruption`), and re-index all records in sequence order. Segments left with no entry
//! are freed.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::pwb::{self, Kind};
use crate::error::{Error, Result};
use crate::format::crc;
use crate::index::rhtree::{Insert, KeySource, PartitionId, RhOptions, RhTree};
use crate::pm::heap::{self, Heap};
use crate::pm::Region;

/// Superblock address.
pub const SUPERBLOCK_ADDR: u64 = 64;
/// Segment-id counter address.
pub const ID_COUNTER_ADDR: u64 = 128;
/// Segment directory address.
pub const DIR_ADDR: u64 = 4096;
/// Directory slots (most live segments).
pub const SEG_SLOTS: u64 = 8192;
/// Bytes per directory slot.
pub const SLOT_LEN: u64 = 16;
/// First heap byte in pool 0.
pub const HEAP_START: u64 = DIR_ADDR + SEG_SLOTS * SLOT_LEN;
const SB_MAGIC: &[u8; 8] = b"TKVLIGHT";
const VERSION: u32 = 1;

/// Encode the superblock.
pub fn encode_superblock(seg_size: u64) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(SB_MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[12..20].copy_from_slice(&seg_size.to_le_bytes());
    let c = crc::masked(&b[..60]);
    b[60..].copy_from_slice(&c.to_le_bytes());
    b
}

/// Decode the superblock: the segment size.
pub fn decode_superblock(b: &[u8]) -> std::result::Result<u64, String> {
    if b.len() < 64 || &b[..8] != SB_MAGIC {
        return Err("not a lightkv superblock (bad magic)".into());
    }
    if crc::masked(&b[..60]) != u32::from_le_bytes([b[60], b[61], b[62], b[63]]) {
        return Err("superblock checksum mismatch".into());
    }
    let v = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if v != VERSION {
        return Err(format!("unsupported lightkv layout version {v}"));
    }
    let mut s = [0u8; 8];
    s.copy_from_slice(&b[12..20]);
    Ok(u64::from_le_bytes(s))
}

#[derive(Debug)]
struct Seg {
    slot: u64,
    id: u64,
    pos: u64,
    live: u64,
    active: bool,
}

#[derive(Debug)]
struct State {
    tree: RhTree,
    /// Segments by base address.
    segs: BTreeMap<u64, Seg>,
    /// Each partition's active segment.
    active: std::collections::HashMap<PartitionId, u64>,
    free_slots: Vec<u64>,
    next_seq: u64,
}

/// Counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Live segments.
    pub segments: u64,
    /// Segments freed since open.
    pub segments_freed: u64,
    /// Records scanned at the last recovery.
    pub recovered_records: u64,
}

/// The write buffer store.
#[derive(Debug)]
pub struct PwbStore {
    region: Arc<Region>,
    heap: Mutex<Heap>,
    state: RwLock<State>,
    seg_size: u64,
    stats: Mutex<StoreStats>,
}

/// Reads keys of records straight from PM (records are verified when written or recovered).
struct Keys<'a>(&'a Region);

fn record_header(r: &Region, addr: u64) -> Result<(Kind, usize, usize)> {
    let h = r.slice_checked(addr, pwb::RECORD_HEADER, "PWB record")?;
    let kind = if h[16] == 1 { Kind::Delete } else { Kind::Put };
    let klen = u16::from_le_bytes([h[17], h[18]]) as usize;
    let vlen = u32::from_le_bytes([h[19], h[20], h[21], h[22]]) as usize;
    Ok((kind, klen, vlen))
}

impl KeySource for Keys<'_> {
    fn key(&self, off: u64) -> Result<Vec<u8>> {
        let (_, klen, _) = record_header(self.0, off)?;
        Ok(self.0.slice_checked(off + pwb::RECORD_HEADER as u64, klen, "PWB record key")?.to_vec())
    }
}

impl PwbStore {
    /// Open the store in `region` (creating the layout when `create`).
    pub fn open(region: Arc<Region>, create: bool, seg_size: u64, tree: RhOptions) -> Result<PwbStore> {
        if create {
            let sb = encode_superblock(seg_size);
            // SAFETY: the layout area of a new store; nobody else uses the region yet.
            unsafe { region.write(SUPERBLOCK_ADDR, &sb)? };
            region.persist(SUPERBLOCK_ADDR, 64);
        }
        let sb = region.slice_checked(SUPERBLOCK_ADDR, 64, "lightkv superblock")?;
        let seg_size = decode_superblock(sb).map_err(|d| region.corruption(SUPERBLOCK_ADDR, d))?;
        let mut segs = BTreeMap::new();
        let mut free_slots = Vec::new();
        for i in (0..SEG_SLOTS).rev() {
            let a = DIR_ADDR + i * SLOT_LEN;
            let id = region.load_u64_atomic(a + 8)?;
            if id == 0 {
                free_slots.push(i);
                continue;
            }
            let addr = region.load_u64_atomic(a)?;
            let h = region.slice_checked(addr, pwb::HEADER_LEN, "PWB segment header")?;
            match pwb::decode_header(h) {
                Ok((hid, size)) if hid == id && size == seg_size => {}
                Ok(_) => return Err(region.corruption(addr, "segment header does not match its directory slot")),
                Err(d) => return Err(region.corruption(addr, d)),
            }
            segs.insert(addr, Seg { slot: i, id, pos: 0, live: 0, active: false });
        }
        let used: Vec<(u64, u64)> = segs.keys().map(|&a| (a, seg_size)).collect();
        let heap = heap::rebuild(&region, HEAP_START, used)?;
        // Replay every record in sequence order.
        let mut recs: Vec<(u64, u64, Vec<u8>)> = Vec::new();
        for (&addr, seg) in segs.iter_mut() {
            let bytes = region.slice_checked(addr, seg_size as usize, "PWB segment")?;
            let (rs, end) = pwb::scan(bytes, seg.id).map_err(|(off, d)| region.corruption(addr + off as u64, d))?;
            seg.pos = end as u64;
            for r in rs {
                recs.push((r.seq, addr + r.off as u64, r.key.to_vec()));
            }
        }
        recs.sort_unstable_by_key(|r| r.0);
        let next_seq = recs.last().map_or(1, |r| r.0 + 1);
        let mut st = State { tree: RhTree::new(tree), segs, active: Default::default(), free_slots, next_seq };
        let n = recs.len() as u64;
        for (_, addr, key) in recs {
            Self::index(&region, &mut st, &key, addr)?;
        }
        let s = PwbStore {
            region,
            heap: Mutex::new(heap),
            state: RwLock::new(st),
            seg_size,
            stats: Mutex::new(StoreStats { recovered_records: n, ..StoreStats::default() }),
        };
        {
            let mut st = s.state.write();
            let dead: Vec<u64> = st.segs.iter().filter(|(_, g)| g.live == 0).map(|(&a, _)| a).collect();
            for a in dead {
                s.free_segment(&mut st, a)?;
            }
        }
        Ok(s)
    }

    fn seg_of(st: &State, addr: u64) -> Option<u64> {
        st.segs.range(..=addr).next_back().map(|(&a, _)| a)
    }

    /// Index the record at `addr` for `key`; keeps segment entry counts.
    fn index(region: &Region, st: &mut State, key: &[u8], addr: u64) -> Result<()> {
        let keys = Keys(region);
        loop {
            match st.tree.insert(key, addr, &keys)? {
                Insert::Full(p) => st.tree.link(p),
                Insert::Inserted(_) => break,
                Insert::Updated(_, old) => {
                    if let Some(g) = Self::seg_of(st, old).and_then(|a| st.segs.get_mut(&a)) {
                        g.live = g.live.saturating_sub(1);
                    }
                    break;
                }
            }
        }
        if let Some(g) = Self::seg_of(st, addr).and_then(|a| st.segs.get_mut(&a)) {
            g.live += 1;
        }
        Ok(())
    }

    fn free_segment(&self, st: &mut State, addr: u64) -> Result<()> {
        let Some(g) = st.segs.remove(&addr) else { return Ok(()) };
        let slot = DIR_ADDR + g.slot * SLOT_LEN;
        self.region.store_u64_atomic(slot + 8, 0)?;
        self.region.persist(slot + 8, 8);
        self.heap.lock().free(addr, self.seg_size);
        st.free_slots.push(g.slot);
        self.stats.lock().segments_freed += 1;
        Ok(())
    }

    fn new_segment(&self, st: &mut State) -> Result<u64> {
        let slot = st
            .free_slots
            .pop()
            .ok_or_else(|| Error::PmFull(format!("all {SEG_SLOTS} PWB segment slots are in use")))?;
        let addr = match heap::alloc_or_grow(&mut self.heap.lock(), &self.region, self.seg_size) {
            Ok(a) => a,
            Err(e) => {
                st.free_slots.push(slot);
                return Err(e);
            }
        };
        let id = self.region.load_u64_atomic(ID_COUNTER_ADDR)? + 1;
        self.region.store_u64_atomic(ID_COUNTER_ADDR, id)?;
        self.region.persist(ID_COUNTER_ADDR, 8);
        let h = pwb::encode_header(id, self.seg_size);
        // SAFETY: a freshly allocated extent; only this writer (under the state lock) uses it.
        unsafe { self.region.write(addr, &h)? };
        // The first record position must not hold a record of this id: clear it, so a stale
        // record of an extent's earlier life (another id) is all that can be there.
        // SAFETY: as above.
        unsafe { self.region.write(addr + pwb::HEADER_LEN as u64, &[0u8; 8])? };
        self.region.persist(addr, pwb::HEADER_LEN as u64 + 8);
        let sa = DIR_ADDR + slot * SLOT_LEN;
        self.region.store_u64_atomic(sa, addr)?;
        self.region.persist(sa, 8);
        self.region.store_u64_atomic(sa + 8, id)?;
        self.region.persist(sa + 8, 8);
        st.segs.insert(addr, Seg { slot, id, pos: pwb::HEADER_LEN as u64, live: 0, active: true });
        Ok(addr)
    }

    /// Append a record and index it. Durable when it returns.
    pub fn write(&self, kind: Kind, key: &[u8], value: &[u8]) -> Result<()> {
        let mut st = self.state.write();
        let p = st.tree.route_mut(key);
        let size = pwb::record_size(key.len(), value.len()) as u64;
        if size > self.seg_size - pwb::HEADER_LEN as u64 {
            return Err(Error::InvalidArgument(format!(
                "a record of {size} bytes does not fit in a {}-byte PWB segment",
                self.seg_size
            )));
        }
        let seg = match st.active.get(&p).copied() {
            Some(a) if st.segs.get(&a).is_some_and(|g| g.pos + size <= self.seg_size) => a,
            old => {
                if let Some(a) = old {
                    if let Some(g) = st.segs.get_mut(&a) {
                        g.active = false;
                        if g.live == 0 {
                            self.free_segment(&mut st, a)?;
                        }
                    }
                }
                let a = self.new_segment(&mut st)?;
                st.active.insert(p, a);
                a
            }
        };
        let seq = st.next_seq;
        let (id, pos) = st
            .segs
            .get(&seg)
            .map(|g| (g.id, g.pos))
            .ok_or_else(|| Error::Poisoned("active segment vanished".into()))?;
        let rec = pwb::encode_record(id, seq, kind, key, value);
        let addr = seg + pos;
        // SAFETY: bytes past the segment's write position belong to this writer alone
        // (under the state lock); readers only follow index entries to persisted records.
        unsafe { self.region.write(addr, &rec)? };
        self.region.persist(addr, rec.len() as u64);
        st.next_seq += 1;
        if let Some(g) = st.segs.get_mut(&seg) {
            g.pos += rec.len() as u64;
        }
        Self::index(&self.region, &mut st, key, addr)?;
        // A segment whose last entry was just superseded, and that takes no more writes, goes.
        let dead: Vec<u64> = st.segs.iter().filter(|(_, g)| g.live == 0 && !g.active).map(|(&a, _)| a).collect();
        for a in dead {
            self.free_segment(&mut st, a)?;
        }
        Ok(())
    }

    /// The newest value of `key` (`None` if absent or deleted).
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let st = self.state.read();
        let Some((_, addr)) = st.tree.get(key, &Keys(&self.region))? else { return Ok(None) };
        let (kind, klen, vlen) = record_header(&self.region, addr)?;
        if kind == Kind::Delete {
            return Ok(None);
        }
        let at = addr + (pwb::RECORD_HEADER + klen) as u64;
        Ok(Some(self.region.slice_checked(at, vlen, "PWB record value")?.to_vec()))
    }

    /// Every live key and value, sorted (tests and checks; not the scan path).
    pub fn dump(&self) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let st = self.state.read();
        let mut keys = std::collections::BTreeSet::new();
        for p in st.tree.partitions_in_order() {
            let part = st.tree.partition(p);
            for leaf in std::iter::once(&part.top).chain(part.chain.iter()) {
                for off in leaf.offsets() {
                    keys.insert(Keys(&self.region).key(off)?);
                }
            }
        }
        drop(st);
        let mut out = Vec::new();
        for k in keys {
            if let Some(v) = self.get(&k)? {
                out.push((k, v));
            }
        }
        Ok(out)
    }

    /// Counters.
    pub fn stats(&self) -> StoreStats {
        let mut s = *self.stats.lock();
        s.segments = self.state.read().segs.len() as u64;
        s
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::BTreeMap;

    use super::*;
    use crate::pm::sim::SimDevice;
    use crate::pm::{Backing, RegionConfig};

    fn region(dev: &SimDevice, create: bool) -> Arc<Region> {
        Arc::new(
            Region::open(RegionConfig {
                backing: Backing::Sim(dev.clone()),
                pool_size: 1 << 20,
                db_id: 5,
                sync: false,
                write_latency_ns: 0,
                write_bandwidth_mbps: 0,
                create,
                health: Default::default(),
            })
            .unwrap(),
        )
    }

    /// Small leaves that split often, and room for every partition the workloads need (no
    /// linked leaves: those arrive with the flush, which is not built yet).
    fn small() -> RhOptions {
        RhOptions { leaf_buckets: 4, t_normal: 4, max_leaf_nodes: 4096 }
    }

    type Model = BTreeMap<Vec<u8>, Vec<u8>>;

    fn step(s: &PwbStore, m: &mut Model, i: u32) -> Result<()> {
        let k = format!("key{:03}", (i * 37) % 150).into_bytes();
        if i % 7 == 3 {
            s.write(Kind::Delete, &k, b"")?;
            m.remove(&k);
        } else {
            let v = vec![(i % 251) as u8; 40 + (i as usize % 200)];
            s.write(Kind::Put, &k, &v)?;
            m.insert(k, v);
        }
        Ok(())
    }

    #[test]
    fn superblock_golden_bytes() {
        let hex: String = encode_superblock(4 << 20).iter().map(|x| format!("{x:02x}")).collect();
        assert_eq!(hex, format!("544b564c4947485401000000000040000000000000{}9a5f7d58", "00".repeat(39)));
        assert_eq!(decode_superblock(&encode_superblock(4 << 20)), Ok(4 << 20));
        let mut bad = encode_superblock(4 << 20);
        bad[13] ^= 1;
        assert!(decode_superblock(&bad).unwrap_err().contains("checksum"));
    }

    #[test]
    fn writes_read_back_and_survive_reopen_with_segments_recycled() {
        let dev = SimDevice::new();
        let s = PwbStore::open(region(&dev, true), true, 8192, small()).unwrap();
        let mut m = Model::new();
        for i in 0..3000 {
            step(&s, &mut m, i).unwrap();
        }
        assert_eq!(s.dump().unwrap(), m.clone().into_iter().collect::<Vec<_>>());
        let st = s.stats();
        assert!(st.segments_freed > 10, "overwrites free whole segments: {st:?}");
        drop(s);
        let s = PwbStore::open(region(&dev, false), false, 8192, small()).unwrap();
        assert_eq!(s.dump().unwrap(), m.into_iter().collect::<Vec<_>>());
        assert!(s.stats().recovered_records > 0);
    }

    #[test]
    fn a_crash_at_every_persist_point_keeps_every_acknowledged_write() {
        let mut points = 0;
        for n in (1..6000u64).step_by(5) {
            let dev = SimDevice::new();
            let s = PwbStore::open(region(&dev, true), true, 4096, small()).unwrap();
            let fences_at_open = dev.fences();
            dev.crash_before_fence(fences_at_open + n);
            let mut m = Model::new();
            let mut pending = None;
            for i in 0..1200 {
                let mut next = m.clone();
                if step(&s, &mut next, i).is_err() || dev.crashed() {
                    pending = Some(next);
                    break;
                }
                m = next;
            }
            if pending.is_none() && !dev.crashed() {
                break;
            }
            drop(s);
            points += 1;
            let dev2 = dev.simulate_crash(n, 0.5);
            let s = PwbStore::open(region(&dev2, false), false, 4096, small())
                .unwrap_or_else(|e| panic!("crash point {n}: reopen failed: {e}"));
            let got: Model = s.dump().unwrap().into_iter().collect();
            let ok = got == m || pending.as_ref().is_some_and(|p| &got == p);
            assert!(ok, "crash point {n}: state is not the acknowledged writes");
            // The recovered store keeps working.
            s.write(Kind::Put, b"after", b"crash").unwrap();
            assert_eq!(s.get(b"after").unwrap().as_deref(), Some(&b"crash"[..]));
        }
        assert!(points > 200, "{points}");
        eprintln!("{points} crash points");
    }
}
