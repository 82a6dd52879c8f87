//! HoaKV's persistent layouts (docs/format/hoakv.md): the PM superblock and vTable
//! directory, vTable headers, hot records (two halves per slot), cold value-log records,
//! the LSM value tag (inline value or cold-vlog pointer) and the `GROUPS` file.

use crate::format::{crc, Cursor};

/// Superblock address (right after pool 0's header).
pub const SUPERBLOCK_ADDR: u64 = 64;
/// An 8-byte word: 1 while a ColdStore MANIFEST commit is in flight, else 0. At open, a
/// torn last MANIFEST record is a crash's only when this says a commit was in flight;
/// otherwise it is damage.
pub const INFLIGHT_ADDR: u64 = 128;
/// vTable directory: slot `i` holds the sealed address of vTable `i` (0: none).
pub const DIR_ADDR: u64 = 192;
/// Layout version.
pub const VERSION: u32 = 1;
const SB_MAGIC: &[u8; 8] = b"TKVHOAK\x01";
const VT_MAGIC: &[u8; 8] = b"TKVVTAB\x01";
/// Bytes of a vTable header; slots follow it.
pub const VT_HEADER: u64 = 64;
/// Bytes of a hot record header (before key and value).
pub const HOT_HEADER: usize = 24;
/// Hot record kinds.
pub const HOT_PUT: u8 = 1;
/// A hot tombstone (a deleted hot key).
pub const HOT_DELETE: u8 = 2;
/// Cold value-log file magic.
pub const VLOG_MAGIC: &[u8; 8] = b"TKVCVLG\x01";
/// Bytes of a cold value-log record header (before key and value).
pub const VLOG_HEADER: usize = 10;
const GROUPS_MAGIC: &[u8; 8] = b"TKVGRPS\x01";
/// LSM value tag: the value follows inline.
pub const TAG_INLINE: u8 = 0;
/// LSM value tag: a cold value-log pointer follows.
pub const TAG_POINTER: u8 = 1;
/// Bytes of a tagged pointer.
pub const POINTER_LEN: usize = 21;

/// Seal a value below 2^48 into a self-checking 8-byte word (directory entries and slot
/// selectors): the top 16 bits are `0x8000 | (crc32c of the value's 6 bytes & 0x7fff)`. 0
/// means "none"; any single damaged byte of a sealed word makes it neither 0 nor valid.
pub fn seal_word(v: u64) -> u64 {
    let low = v & ((1 << 48) - 1);
    let c = u64::from(crc32c::crc32c(&low.to_le_bytes()[..6]) & 0x7fff);
    ((0x8000 | c) << 48) | low
}

/// Open a sealed word: `Ok(None)` for 0, `Ok(Some(v))` for a valid word, `Err` otherwise.
#[allow(clippy::result_unit_err)]
pub fn open_word(w: u64) -> Result<Option<u64>, ()> {
    if w == 0 {
        return Ok(None);
    }
    let v = w & ((1 << 48) - 1);
    if seal_word(v) == w {
        Ok(Some(v))
    } else {
        Err(())
    }
}

/// Slots of a vTable of `vtable_size` bytes in size class `class` (half size): the
/// header, one 8-byte selector per slot (rounded up to whole lines), then the slots of two
/// halves each.
pub fn slots_per(vtable_size: u64, class: u32) -> u32 {
    let slot = 2 * u64::from(class);
    let mut n = (vtable_size - VT_HEADER) / (slot + 8);
    while n > 0 && VT_HEADER + selectors_len(n) + n * slot > vtable_size {
        n -= 1;
    }
    n as u32
}

/// Bytes of the selector array of `n` slots.
pub fn selectors_len(n: u64) -> u64 {
    crate::format::align_up(n * 8, 64)
}

/// Offset in its vTable of the selector of `slot`.
pub fn selector_offset(slot: u32) -> u64 {
    VT_HEADER + u64::from(slot) * 8
}

/// Offset in its vTable of `half` of `slot`, for a vTable of `nslots` slots of class
/// `class`: the header, the selectors, then two halves per slot.
pub fn half_offset(nslots: u32, class: u32, slot: u32, half: u8) -> u64 {
    VT_HEADER
        + selectors_len(u64::from(nslots))
        + u64::from(slot) * 2 * u64::from(class)
        + u64::from(half) * u64::from(class)
}

/// The vTable directory length a new store gets for a HotStore of `capacity` bytes in
/// vTables of `vtable_size` bytes (room for twice the vTables the capacity needs, plus 32).
pub fn dir_slots_for(capacity: u64, vtable_size: u64) -> u32 {
    (capacity / vtable_size.max(1) + 1).saturating_mul(2).saturating_add(32).min(65_535) as u32
}

/// First heap byte in pool 0 for a directory of `slots` entries.
pub fn heap_start(slots: u32) -> u64 {
    crate::format::align_up(DIR_ADDR + u64::from(slots) * 8, 64)
}

/// Encode the superblock: magic, version, vTable size, directory slots, crc.
pub fn encode_superblock(vtable_size: u64, dir_slots: u32) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(SB_MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[12..20].copy_from_slice(&vtable_size.to_le_bytes());
    b[20..24].copy_from_slice(&dir_slots.to_le_bytes());
    let c = crc::masked(&b[..60]);
    b[60..].copy_from_slice(&c.to_le_bytes());
    b
}

/// Decode the superblock: (vTable size, directory slots).
pub fn decode_superblock(b: &[u8]) -> Result<(u64, u32), String> {
    if b.len() < 64 || &b[..8] != SB_MAGIC {
        return Err("not a hoakv superblock (bad magic)".into());
    }
    if crc::masked(&b[..60]) != u32::from_le_bytes([b[60], b[61], b[62], b[63]]) {
        return Err("superblock checksum mismatch".into());
    }
    let mut c = Cursor::new(&b[8..24]);
    match (c.u32(), c.u64(), c.u32()) {
        (Some(VERSION), Some(vt), Some(slots)) if vt >= 4096 && vt.is_multiple_of(64) && slots > 0 => Ok((vt, slots)),
        (Some(v), ..) if v != VERSION => Err(format!("unsupported hoakv layout version {v}")),
        _ => Err("superblock fields out of range".into()),
    }
}

/// Encode a vTable header: magic, directory slot, half-slot size (the class), crc.
pub fn encode_vtable_header(id: u32, class: u32) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[..8].copy_from_slice(VT_MAGIC);
    b[8..12].copy_from_slice(&id.to_le_bytes());
    b[12..16].copy_from_slice(&class.to_le_bytes());
    let c = crc::masked(&b[..60]);
    b[60..].copy_from_slice(&c.to_le_bytes());
    b
}

/// Decode a vTable header: (directory slot, class).
pub fn decode_vtable_header(b: &[u8]) -> Result<(u32, u32), String> {
    if b.len() < 64 || &b[..8] != VT_MAGIC {
        return Err("not a vTable (bad magic)".into());
    }
    if crc::masked(&b[..60]) != u32::from_le_bytes([b[60], b[61], b[62], b[63]]) {
        return Err("vTable header checksum mismatch".into());
    }
    let id = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    let class = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
    if class < 64 || !class.is_multiple_of(64) {
        return Err(format!("vTable class {class} is not a positive multiple of 64"));
    }
    Ok((id, class))
}

/// The half-slot size class holding `need` bytes: multiples of 64 up to 512, then eight
/// steps per power of two (at most 12.5 % slack).
pub fn class_for(need: usize) -> u32 {
    let n = need.max(64) as u64;
    let c = if n <= 512 {
        n.div_ceil(64) * 64
    } else {
        let p = 1u64 << (63 - (n - 1).leading_zeros());
        let step = (p / 8).max(64);
        n.div_ceil(step) * step
    };
    c as u32
}

/// Bytes a hot record of `key` and `value` needs in one half.
pub fn hot_need(klen: usize, vlen: usize) -> usize {
    HOT_HEADER + klen + vlen
}

/// Encode a hot record half: `crc u32 | kind u8 | 0 u8 | klen u16 | vlen u32 | 0 u32 |
/// seq u64 | key | value` (crc: masked crc32c of everything after it).
pub fn encode_hot(seq: u64, key: &[u8], value: Option<&[u8]>) -> Vec<u8> {
    let v = value.unwrap_or_default();
    let mut b = Vec::with_capacity(hot_need(key.len(), v.len()));
    b.extend_from_slice(&[0; 4]);
    b.push(if value.is_some() { HOT_PUT } else { HOT_DELETE });
    b.push(0);
    b.extend_from_slice(&(key.len() as u16).to_le_bytes());
    b.extend_from_slice(&(v.len() as u32).to_le_bytes());
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(key);
    b.extend_from_slice(v);
    let c = crc::masked(&b[4..]);
    b[..4].copy_from_slice(&c.to_le_bytes());
    b
}

/// A decoded hot record half.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotRecord<'a> {
    /// Sequence number of the write.
    pub seq: u64,
    /// The key.
    pub key: &'a [u8],
    /// The value (`None`: a hot tombstone).
    pub value: Option<&'a [u8]>,
}

/// Decode the hot record half at the start of `half` (a whole half: `class` bytes), or
/// `None` when it holds no valid record (free, never written, or torn).
pub fn decode_hot(half: &[u8]) -> Option<HotRecord<'_>> {
    let mut c = Cursor::new(half);
    let stored = c.u32()?;
    let kind = c.u8()?;
    c.skip(1)?;
    let kl = c.u16()? as usize;
    let vl = c.u32()? as usize;
    c.skip(4)?;
    let seq = c.u64()?;
    let key = c.bytes(kl)?;
    let value = c.bytes(vl)?;
    let body = half.get(4..HOT_HEADER + kl + vl)?;
    if crc::masked(body) != stored {
        return None;
    }
    match kind {
        HOT_PUT => Some(HotRecord { seq, key, value: Some(value) }),
        HOT_DELETE if vl == 0 => Some(HotRecord { seq, key, value: None }),
        _ => None,
    }
}

/// Encode a cold value-log record: `crc u32 | klen u16 | vlen u32 | key | value` (crc:
/// masked crc32c of everything after it).
pub fn encode_vlog(key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(VLOG_HEADER + key.len() + value.len());
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(&(key.len() as u16).to_le_bytes());
    b.extend_from_slice(&(value.len() as u32).to_le_bytes());
    b.extend_from_slice(key);
    b.extend_from_slice(value);
    let c = crc::masked(&b[4..]);
    b[..4].copy_from_slice(&c.to_le_bytes());
    b
}

/// Decode a whole cold value-log record: (key, value).
pub fn decode_vlog(b: &[u8]) -> Result<(&[u8], &[u8]), String> {
    let mut c = Cursor::new(b);
    let short = || "truncated value-log record".to_string();
    let stored = c.u32().ok_or_else(short)?;
    let kl = c.u16().ok_or_else(short)? as usize;
    let vl = c.u32().ok_or_else(short)? as usize;
    let key = c.bytes(kl).ok_or_else(short)?;
    let value = c.bytes(vl).ok_or_else(short)?;
    if crc::masked(&b[4..VLOG_HEADER + kl + vl]) != stored {
        return Err("value-log record checksum mismatch".into());
    }
    Ok((key, value))
}

/// Where a cold value lives: value-log file, record offset, record length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pointer {
    /// Value-log file number.
    pub file: u64,
    /// Offset of the record in the file.
    pub offset: u64,
    /// Bytes of the whole record.
    pub len: u32,
}

/// An LSM value: the user's value inline, or a pointer into the cold value log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColdValue {
    /// The value itself.
    Inline(Vec<u8>),
    /// A cold value-log pointer.
    Pointer(Pointer),
}

/// Encode an inline LSM value: tag 0 then the value.
pub fn encode_inline(v: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(1 + v.len());
    b.push(TAG_INLINE);
    b.extend_from_slice(v);
    b
}

/// Encode a pointer LSM value: tag 1, file u64, offset u64, record length u32.
pub fn encode_pointer(p: Pointer) -> Vec<u8> {
    let mut b = Vec::with_capacity(POINTER_LEN);
    b.push(TAG_POINTER);
    b.extend_from_slice(&p.file.to_le_bytes());
    b.extend_from_slice(&p.offset.to_le_bytes());
    b.extend_from_slice(&p.len.to_le_bytes());
    b
}

/// An LSM value as [`decode_cold_ref`] sees it: the inline value borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColdRef<'a> {
    /// The value itself.
    Inline(&'a [u8]),
    /// A cold value-log pointer.
    Pointer(Pointer),
}

/// Decode an LSM value.
pub fn decode_cold(b: &[u8]) -> Result<ColdValue, String> {
    Ok(match decode_cold_ref(b)? {
        ColdRef::Inline(v) => ColdValue::Inline(v.to_vec()),
        ColdRef::Pointer(p) => ColdValue::Pointer(p),
    })
}

/// Decode an LSM value without copying an inline one.
pub fn decode_cold_ref(b: &[u8]) -> Result<ColdRef<'_>, String> {
    match b.split_first() {
        Some((&TAG_INLINE, v)) => Ok(ColdRef::Inline(v)),
        Some((&TAG_POINTER, rest)) if rest.len() == POINTER_LEN - 1 => {
            let mut c = Cursor::new(rest);
            match (c.u64(), c.u64(), c.u32()) {
                (Some(file), Some(offset), Some(len)) if (len as usize) >= VLOG_HEADER => {
                    Ok(ColdRef::Pointer(Pointer { file, offset, len }))
                }
                _ => Err("malformed value-log pointer".into()),
            }
        }
        Some((t, _)) => Err(format!("unknown LSM value tag {t}")),
        None => Err("empty LSM value (no tag)".into()),
    }
}

/// One value group as the `GROUPS` file records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRec {
    /// Group id.
    pub gid: u32,
    /// Smallest key of the group's range (the range ends at the next group's `lo`).
    pub lo: Vec<u8>,
    /// Value-log files holding the group's values; the first is the one new values go to.
    pub files: Vec<u64>,
}

/// The value-group table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupsRec {
    /// Next group id to hand out.
    pub next_gid: u32,
    /// Next value-log file number to hand out.
    pub next_file: u64,
    /// Groups by `lo`; the first has an empty `lo`.
    pub groups: Vec<GroupRec>,
}

/// Encode the `GROUPS` file: magic, next gid, next file, count, groups (gid u32, lo (u32
/// len + bytes), file count u32, files u64…), then a masked crc32c of everything before.
pub fn encode_groups(g: &GroupsRec) -> Vec<u8> {
    let mut b = GROUPS_MAGIC.to_vec();
    b.extend_from_slice(&g.next_gid.to_le_bytes());
    b.extend_from_slice(&g.next_file.to_le_bytes());
    b.extend_from_slice(&(g.groups.len() as u32).to_le_bytes());
    for r in &g.groups {
        b.extend_from_slice(&r.gid.to_le_bytes());
        b.extend_from_slice(&(r.lo.len() as u32).to_le_bytes());
        b.extend_from_slice(&r.lo);
        b.extend_from_slice(&(r.files.len() as u32).to_le_bytes());
        for f in &r.files {
            b.extend_from_slice(&f.to_le_bytes());
        }
    }
    let c = crc::masked(&b);
    b.extend_from_slice(&c.to_le_bytes());
    b
}

/// Decode the `GROUPS` file, checking that ranges are sorted and start at the empty key
/// and that every group has a file.
pub fn decode_groups(b: &[u8]) -> Result<GroupsRec, String> {
    if b.len() < 12 || &b[..8] != GROUPS_MAGIC {
        return Err("not a GROUPS file (bad magic)".into());
    }
    let (body, c) = b.split_at(b.len() - 4);
    if crc::masked(body) != u32::from_le_bytes([c[0], c[1], c[2], c[3]]) {
        return Err("GROUPS checksum mismatch".into());
    }
    let mut c = Cursor::new(&body[8..]);
    let short = || "truncated GROUPS file".to_string();
    let next_gid = c.u32().ok_or_else(short)?;
    let next_file = c.u64().ok_or_else(short)?;
    let n = c.u32().ok_or_else(short)? as usize;
    if n == 0 || n > c.remaining() / 12 {
        return Err(format!("GROUPS claims {n} groups"));
    }
    let mut groups = Vec::with_capacity(n);
    for _ in 0..n {
        let gid = c.u32().ok_or_else(short)?;
        let l = c.u32().ok_or_else(short)? as usize;
        let lo = c.bytes(l).ok_or_else(short)?.to_vec();
        let nf = c.u32().ok_or_else(short)? as usize;
        if nf == 0 || nf > c.remaining() / 8 {
            return Err(format!("group {gid} claims {nf} files"));
        }
        let files = (0..nf).map(|_| c.u64().ok_or_else(short)).collect::<Result<Vec<_>, _>>()?;
        groups.push(GroupRec { gid, lo, files });
    }
    if c.remaining() != 0 {
        return Err("trailing bytes in GROUPS".into());
    }
    if !groups[0].lo.is_empty() || groups.windows(2).any(|w| w[0].lo >= w[1].lo) {
        return Err("GROUPS ranges are not sorted from the empty key".into());
    }
    Ok(GroupsRec { next_gid, next_file, groups })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_damage_is_detected() {
        let r = encode_hot(9, b"key", Some(b"value"));
        let mut half = r.clone();
        half.resize(128, 0);
        assert_eq!(decode_hot(&half), Some(HotRecord { seq: 9, key: b"key", value: Some(b"value") }));
        let t = encode_hot(10, b"key", None);
        assert_eq!(decode_hot(&t).map(|r| r.value), Some(None));
        for i in 0..r.len() {
            let mut bad = half.clone();
            bad[i] ^= 0x10;
            assert_ne!(decode_hot(&bad), decode_hot(&half), "flip at byte {i} went unnoticed");
        }
        assert_eq!(decode_hot(&[0u8; 128]), None, "a zeroed half is free");
        let v = encode_vlog(b"k", b"vv");
        assert_eq!(decode_vlog(&v), Ok((b"k".as_slice(), b"vv".as_slice())));
        let mut bad = v.clone();
        bad[11] ^= 1;
        assert!(decode_vlog(&bad).is_err());
        let p = Pointer { file: 3, offset: 8, len: 13 };
        assert_eq!(decode_cold(&encode_pointer(p)), Ok(ColdValue::Pointer(p)));
        assert_eq!(decode_cold(&encode_inline(b"x")), Ok(ColdValue::Inline(b"x".to_vec())));
        assert!(decode_cold(&[7, 1]).is_err());
        assert!(decode_cold(&[]).is_err());
        let g = GroupsRec {
            next_gid: 3,
            next_file: 9,
            groups: vec![
                GroupRec { gid: 0, lo: vec![], files: vec![4, 1] },
                GroupRec { gid: 2, lo: b"m".to_vec(), files: vec![7] },
            ],
        };
        assert_eq!(decode_groups(&encode_groups(&g)), Ok(g.clone()));
        let mut bad = encode_groups(&g);
        bad[20] ^= 1;
        assert!(decode_groups(&bad).is_err());
        let (vt, slots) = decode_superblock(&encode_superblock(2 << 20, 96)).unwrap_or_default();
        assert_eq!((vt, slots), (2 << 20, 96));
        assert_eq!(decode_vtable_header(&encode_vtable_header(5, 1152)), Ok((5, 1152)));
    }

    #[test]
    fn size_classes_waste_at_most_an_eighth() {
        for need in 1..70_000 {
            let c = class_for(need) as usize;
            assert!(c >= need && c.is_multiple_of(64), "{need} -> {c}");
            assert!(c <= 64 || (c - need) * 8 <= c.max(512), "{need} -> {c}");
        }
        assert_eq!(class_for(hot_need(16, 1024)), 1152);
    }
}
