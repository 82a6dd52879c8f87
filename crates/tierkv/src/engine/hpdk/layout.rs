//! HPDK's persistent layouts (docs/format/hpdk.md): the PM superblock, the value-pool and
//! SSTable directories, value-log records, WAL records, the B+-tree recovery file and the
//! merge log.

use crate::format::{crc, Cursor};

/// Superblock address (right after pool 0's header).
pub const SUPERBLOCK_ADDR: u64 = 64;
/// Value-pool directory: slot `i` describes value pool `i`.
pub const VDIR_ADDR: u64 = 128;
/// Slots of each directory.
pub const DIR_SLOTS: u64 = 4096;
/// Bytes of a directory slot.
pub const SLOT_LEN: u64 = 32;
/// SSTable directory: slot `i` describes the table whose B+-tree "pool number" is `i`.
pub const TDIR_ADDR: u64 = VDIR_ADDR + DIR_SLOTS * SLOT_LEN;
/// First byte of the PM heap in pool 0.
pub const HEAP_START: u64 = TDIR_ADDR + DIR_SLOTS * SLOT_LEN;

const SB_MAGIC: &[u8; 8] = b"TKVHPDK\0";
/// Layout version.
pub const VERSION: u32 = 1;

const KIND_VPOOL: u8 = 1;
const KIND_TABLE: u8 = 2;

/// Bytes a value record adds to its value: 4-byte size + 4-byte checksum.
pub const RECORD_OVERHEAD: u64 = 8;

/// Encode the superblock: magic, version, directory slots, value-pool size, crc.
pub fn encode_superblock(vpool_size: u64) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(SB_MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&(DIR_SLOTS as u32).to_le_bytes());
    b[16..24].copy_from_slice(&vpool_size.to_le_bytes());
    let c = crc::masked(&b[..60]);
    b[60..].copy_from_slice(&c.to_le_bytes());
    b
}

/// Decode the superblock; returns the value-pool size.
pub fn decode_superblock(b: &[u8]) -> Result<u64, String> {
    if b.len() < 64 || &b[..8] != SB_MAGIC {
        return Err("not an hpdk superblock (bad magic)".into());
    }
    let stored = u32::from_le_bytes([b[60], b[61], b[62], b[63]]);
    if crc::masked(&b[..60]) != stored {
        return Err("superblock checksum mismatch".into());
    }
    let mut c = Cursor::new(&b[8..24]);
    let (v, slots, size) = (c.u32(), c.u32(), c.u64());
    match (v, slots, size) {
        (Some(VERSION), Some(s), Some(size)) if u64::from(s) == DIR_SLOTS => Ok(size),
        (Some(v), ..) if v != VERSION => Err(format!("unsupported hpdk layout version {v}")),
        _ => Err("superblock fields out of range".into()),
    }
}

/// A value pool's directory slot: written whole when the pool is created or reused, never
/// updated in place otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VSlot {
    /// Pool number (= slot index).
    pub no: u16,
    /// Activation generation: larger for the pool activated later; mixed into every record
    /// checksum, so records of a reused pool's earlier life never verify.
    pub gen: u32,
    /// Region address of the pool's extent.
    pub addr: u64,
    /// Capacity in bytes.
    pub cap: u32,
}

/// A table's directory slot: written when the table is placed, zeroed when it is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TSlot {
    /// Slot index: the table's 2-byte "SSTable pool number" in the B+-tree.
    pub slot: u16,
    /// MANIFEST file number.
    pub number: u64,
    /// Region address of the table's extent.
    pub addr: u64,
    /// Table bytes.
    pub size: u32,
}

fn seal(b: &mut [u8; 32]) {
    let c = crc::masked(&b[..28]);
    b[28..].copy_from_slice(&c.to_le_bytes());
}

/// Encode a value-pool slot.
pub fn encode_vslot(s: &VSlot) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[0] = KIND_VPOOL;
    b[2..4].copy_from_slice(&s.no.to_le_bytes());
    b[4..8].copy_from_slice(&s.gen.to_le_bytes());
    b[8..16].copy_from_slice(&s.addr.to_le_bytes());
    b[16..20].copy_from_slice(&s.cap.to_le_bytes());
    seal(&mut b);
    b
}

/// Encode a table slot.
pub fn encode_tslot(s: &TSlot) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[0] = KIND_TABLE;
    b[2..4].copy_from_slice(&s.slot.to_le_bytes());
    b[8..16].copy_from_slice(&s.addr.to_le_bytes());
    b[16..20].copy_from_slice(&s.size.to_le_bytes());
    b[20..28].copy_from_slice(&s.number.to_le_bytes());
    seal(&mut b);
    b
}

/// A decoded slot. A slot of kind 0, or whose checksum fails (a write torn by a crash:
/// slots are written only before what they describe is committed, or when it is freed), is
/// free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// Unused.
    Free,
    /// A value pool.
    Pool(VSlot),
    /// An SSTable.
    Table(TSlot),
}

/// Decode slot `index` of a directory from its 32 bytes.
pub fn decode_slot(b: &[u8], index: u16) -> Slot {
    if b.len() < 32 || b[0] == 0 {
        return Slot::Free;
    }
    let stored = u32::from_le_bytes([b[28], b[29], b[30], b[31]]);
    if crc::masked(&b[..28]) != stored {
        return Slot::Free;
    }
    let u16at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let u32at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let u64at =
        |i: usize| u64::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3], b[i + 4], b[i + 5], b[i + 6], b[i + 7]]);
    if u16at(2) != index {
        return Slot::Free;
    }
    match b[0] {
        KIND_VPOOL => Slot::Pool(VSlot { no: index, gen: u32at(4), addr: u64at(8), cap: u32at(16) }),
        KIND_TABLE => Slot::Table(TSlot { slot: index, addr: u64at(8), size: u32at(16), number: u64at(20) }),
        _ => Slot::Free,
    }
}

/// The fields of slot `index` of the value-pool directory (`tables` false) or the table
/// directory, read as that directory's kind *without* checking the kind byte, the index
/// field or the checksum (salvage of a damaged slot: whatever it describes must then verify
/// by its own checksums). `None` for a slot of all zeros (never written, or freed).
pub(crate) fn decode_slot_unverified(b: &[u8], index: u16, tables: bool) -> Option<Slot> {
    let b = b.get(..32)?;
    if b.iter().all(|x| *x == 0) {
        return None;
    }
    let mut c = Cursor::new(&b[4..28]);
    let (w4, a8, w16) = (c.u32()?, c.u64()?, c.u32()?);
    Some(if tables {
        Slot::Table(TSlot { slot: index, addr: a8, size: w16, number: c.u64()? })
    } else {
        Slot::Pool(VSlot { no: index, gen: w4, addr: a8, cap: w16 })
    })
}

/// The checksum of a value record of pool generation `gen`.
pub fn record_crc(gen: u32, value: &[u8]) -> u32 {
    crc::masked_parts(&[&gen.to_le_bytes(), &(value.len() as u32).to_le_bytes(), value])
}

/// Encode a value record `size u32 | value | crc u32` into `out`.
pub fn encode_record(gen: u32, value: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
    out.extend_from_slice(&record_crc(gen, value).to_le_bytes());
}

/// A value address: 2-byte pool number and 4-byte offset (paper Fig. 3), kept in the low 48
/// bits of a `u64`.
pub fn vaddr(pool: u16, off: u32) -> u64 {
    (u64::from(pool) << 32) | u64::from(off)
}

/// Pool number and offset of a value address.
pub fn split_vaddr(a: u64) -> (u16, u32) {
    ((a >> 32) as u16, a as u32)
}

/// The 6 bytes of a value address as stored in SSTables and the WAL.
pub fn vaddr_bytes(a: u64) -> [u8; 6] {
    let b = a.to_le_bytes();
    [b[0], b[1], b[2], b[3], b[4], b[5]]
}

/// Decode 6 address bytes.
pub fn vaddr_from(b: &[u8]) -> Option<u64> {
    if b.len() != 6 {
        return None;
    }
    let mut w = [0u8; 8];
    w[..6].copy_from_slice(b);
    Some(u64::from_le_bytes(w))
}

/// One operation of a WAL record: a key with a value address, or a deletion (`None`).
pub type WalOp = (Vec<u8>, Option<u64>);

/// Encode a WAL record of one write (a batch is one record, so it replays whole or not at
/// all): `len u32 | crc u32 | payload`, payload = `count u32` then per op `kind u8 | klen u16
/// | key | [address 6 bytes]`.
pub fn encode_wal(ops: &[(&[u8], Option<u64>)]) -> Vec<u8> {
    let mut p = Vec::with_capacity(4 + ops.iter().map(|o| o.0.len() + 9).sum::<usize>());
    p.extend_from_slice(&(ops.len() as u32).to_le_bytes());
    for (k, a) in ops {
        p.push(u8::from(a.is_none()));
        p.extend_from_slice(&(k.len() as u16).to_le_bytes());
        p.extend_from_slice(k);
        if let Some(a) = a {
            p.extend_from_slice(&vaddr_bytes(*a));
        }
    }
    crate::format::frame(&p)
}

/// Decode one WAL record's payload (checksum already verified; torn-tail and damage
/// handling is [`crate::format::log`]'s).
pub fn decode_wal_payload(p: &[u8]) -> Option<Vec<WalOp>> {
    let mut c = Cursor::new(p);
    let n = c.u32()? as usize;
    let mut ops = Vec::with_capacity(n.min(p.len()));
    for _ in 0..n {
        let kind = c.u8()?;
        let klen = c.u16()? as usize;
        let k = c.bytes(klen)?.to_vec();
        match kind {
            0 => ops.push((k, Some(vaddr_from(c.bytes(6)?)?))),
            1 => ops.push((k, None)),
            _ => return None,
        }
    }
    (c.remaining() == 0).then_some(ops)
}

const DUMP_MAGIC: &[u8; 8] = b"TKVHBT\0\x01";

/// What a B+-tree recovery file holds (paper §IV-B): the tree's entries as of the moment
/// every table numbered `<= covered` was applied, the set of tables live then, and the value
/// area's state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dump {
    /// Every table numbered at most this is reflected in the entries.
    pub covered: u64,
    /// Table numbers live (in the MANIFEST) at the dump, all `<= covered`.
    pub tables: Vec<u64>,
    /// Value pools: (number, generation, bytes used, records written).
    pub pools: Vec<(u16, u32, u32, u32)>,
    /// Tree entries in key order: key, value address, table number.
    pub entries: Vec<(Vec<u8>, u64, u64)>,
}

/// Encode a dump: header, sections, one trailing crc over everything before it.
pub fn encode_dump(d: &Dump) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + d.entries.iter().map(|e| e.0.len() + 16).sum::<usize>());
    b.extend_from_slice(DUMP_MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&d.covered.to_le_bytes());
    b.extend_from_slice(&(d.tables.len() as u32).to_le_bytes());
    for t in &d.tables {
        b.extend_from_slice(&t.to_le_bytes());
    }
    b.extend_from_slice(&(d.pools.len() as u32).to_le_bytes());
    for (no, gen, used, total) in &d.pools {
        b.extend_from_slice(&no.to_le_bytes());
        b.extend_from_slice(&gen.to_le_bytes());
        b.extend_from_slice(&used.to_le_bytes());
        b.extend_from_slice(&total.to_le_bytes());
    }
    b.extend_from_slice(&(d.entries.len() as u64).to_le_bytes());
    for (k, a, t) in &d.entries {
        b.extend_from_slice(&(k.len() as u16).to_le_bytes());
        b.extend_from_slice(k);
        b.extend_from_slice(&vaddr_bytes(*a));
        b.extend_from_slice(&t.to_le_bytes());
    }
    let c = crc::masked(&b);
    b.extend_from_slice(&c.to_le_bytes());
    b
}

/// Decode a dump; `Err((offset, detail))` on damage.
pub fn decode_dump(b: &[u8]) -> Result<Dump, (u64, String)> {
    if b.len() < 12 || &b[..8] != DUMP_MAGIC {
        return Err((0, "not a B+-tree recovery file (bad magic)".into()));
    }
    let n = b.len() - 4;
    let stored = u32::from_le_bytes([b[n], b[n + 1], b[n + 2], b[n + 3]]);
    if crc::masked(&b[..n]) != stored {
        return Err((n as u64, "recovery file checksum mismatch".into()));
    }
    let mut c = Cursor::new(&b[8..n]);
    let bad = |c: &Cursor<'_>| (8 + c.pos() as u64, "malformed recovery file".to_string());
    let v = c.u32().ok_or_else(|| bad(&c))?;
    if v != VERSION {
        return Err((8, format!("unsupported recovery file version {v}")));
    }
    let mut d = Dump { covered: c.u64().ok_or_else(|| bad(&c))?, ..Dump::default() };
    let nt = c.u32().ok_or_else(|| bad(&c))?;
    for _ in 0..nt {
        d.tables.push(c.u64().ok_or_else(|| bad(&c))?);
    }
    let np = c.u32().ok_or_else(|| bad(&c))?;
    for _ in 0..np {
        let p = (|| Some((c.u16()?, c.u32()?, c.u32()?, c.u32()?)))().ok_or_else(|| bad(&c))?;
        d.pools.push(p);
    }
    let ne = c.u64().ok_or_else(|| bad(&c))?;
    d.entries.reserve(ne.min(c.remaining() as u64 / 16) as usize);
    for _ in 0..ne {
        let e = (|| {
            let kl = c.u16()? as usize;
            let k = c.bytes(kl)?.to_vec();
            let a = vaddr_from(c.bytes(6)?)?;
            Some((k, a, c.u64()?))
        })()
        .ok_or_else(|| bad(&c))?;
        d.entries.push(e);
    }
    if c.remaining() != 0 {
        return Err(bad(&c));
    }
    Ok(d)
}

const MERGE_MAGIC: &[u8; 8] = b"TKVHMG\0\x01";

/// Encode the merge log: the inputs of the merge in flight and its output's number.
pub fn encode_merge_log(inputs: &[u64], output: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(MERGE_MAGIC);
    b.extend_from_slice(&output.to_le_bytes());
    b.extend_from_slice(&(inputs.len() as u32).to_le_bytes());
    for i in inputs {
        b.extend_from_slice(&i.to_le_bytes());
    }
    let c = crc::masked(&b);
    b.extend_from_slice(&c.to_le_bytes());
    b
}

/// Decode the merge log: (inputs, output).
pub fn decode_merge_log(b: &[u8]) -> Result<(Vec<u64>, u64), String> {
    if b.len() < 24 || &b[..8] != MERGE_MAGIC {
        return Err("not a merge log (bad magic)".into());
    }
    let n = b.len() - 4;
    if crc::masked(&b[..n]) != u32::from_le_bytes([b[n], b[n + 1], b[n + 2], b[n + 3]]) {
        return Err("merge log checksum mismatch".into());
    }
    let mut c = Cursor::new(&b[8..n]);
    let out = c.u64().ok_or("short merge log")?;
    let k = c.u32().ok_or("short merge log")?;
    let mut ins = Vec::new();
    for _ in 0..k {
        ins.push(c.u64().ok_or("short merge log")?);
    }
    Ok((ins, out))
}
