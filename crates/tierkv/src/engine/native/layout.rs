//! Byte layouts of every `native` structure in PM (docs/format/native.md is the reference;
//! the golden-bytes tests pin these encoders to it).
//!
//! All integers are little-endian; all checksums are masked crc32c ([`crate::format::crc`]).
//!
//! The region is cut into *segment slots* of `stride` bytes: pool `p` holds slots
//! `0..slots_per_pool` at `p * pool_size + 64 + k * stride` (after the pool header). Slot 0
//! of pool 0 is the *meta slot* (superblock and clean-close record); every other slot is a
//! log segment or free.

use crate::format::{crc, Cursor};
use crate::pm::{LINE, POOL_HEADER_LEN};

/// Format version of the `native` layout. Bump on any incompatible change.
/// History: 1 (first version); 2 (segment salt in the header and in every record
/// checksum; seal word moved to offset 48); 3 (entry kind 3, *moved*: the capacity tier).
/// A version-1 store is refused at open. A version-2 store is a valid version-3 store:
/// it is opened, and its superblock rewritten as version 3 (so an older build refuses it
/// by version instead of failing on a kind-3 entry).
pub const FORMAT_VERSION: u32 = 3;
/// The oldest version this build opens.
pub const MIN_READ_VERSION: u32 = 2;

/// The superblock: first thing in the meta slot.
pub const SUPERBLOCK_ADDR: u64 = POOL_HEADER_LEN;
/// The clean-close record, after the superblock.
pub const CLEAN_ADDR: u64 = POOL_HEADER_LEN + 64;
const SUPER_MAGIC: &[u8; 8] = b"TKVNATV\0";
const SEG_MAGIC: &[u8; 8] = b"TKVNSEG\0";
/// The segment magic as the little-endian word stored last when a segment is created.
pub const SEG_MAGIC_WORD: u64 = u64::from_le_bytes(*SEG_MAGIC);
const CLEAN_MAGIC: &[u8; 8] = b"TKVNCLN\0";

/// Bytes of a segment header; records start after it.
pub const SEG_HEADER_LEN: u64 = 64;
/// Offset of the 8-byte seal word inside a segment header.
pub const SEAL_OFFSET: u64 = 48;
/// Bytes of a record header.
pub const RECORD_HEADER_LEN: usize = 24;
/// Bytes of an entry header.
pub const ENTRY_HEADER_LEN: usize = 12;
/// Records start and end on 8-byte boundaries.
pub const RECORD_ALIGN: u64 = 8;

/// Entry kinds. Never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// 1: the key is set to the value.
    Put = 1,
    /// 2: the key is deleted (the value is empty).
    Delete = 2,
    /// 3: the key's entry with this sequence number moved to the capacity tier (the
    /// store's SSTables on disk); the value is empty. At replay it wins over a put or
    /// delete of the same sequence number, and a key whose newest entry is one has no
    /// entry in the DRAM index.
    Moved = 3,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        match v {
            1 => Some(Kind::Put),
            2 => Some(Kind::Delete),
            3 => Some(Kind::Moved),
            _ => None,
        }
    }
}

/// Geometry fixed at creation, recorded in the superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    /// Number of write shards (per-shard logs).
    pub shards: u32,
    /// Distance between segment slots (a multiple of 64).
    pub stride: u64,
    /// Slots per pool.
    pub slots_per_pool: u32,
    /// The store's identity (also in every pool header).
    pub db_id: u64,
}

impl Superblock {
    /// Encode (64 bytes).
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(SUPER_MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.shards.to_le_bytes());
        b[16..24].copy_from_slice(&self.stride.to_le_bytes());
        b[24..28].copy_from_slice(&self.slots_per_pool.to_le_bytes());
        b[32..40].copy_from_slice(&self.db_id.to_le_bytes());
        let c = crc::masked(&b[0..40]);
        b[40..44].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Decode; `Err(detail)` when the bytes are not a valid superblock.
    pub fn decode(b: &[u8]) -> Result<Superblock, String> {
        let mut c = Cursor::new(b);
        let magic = c.bytes(8).ok_or("superblock truncated")?;
        if magic != SUPER_MAGIC {
            return Err("bad superblock magic (not a native store, or damaged)".into());
        }
        let version = c.u32().ok_or("superblock truncated")?;
        let shards = c.u32().ok_or("superblock truncated")?;
        let stride = c.u64().ok_or("superblock truncated")?;
        let slots_per_pool = c.u32().ok_or("superblock truncated")?;
        c.skip(4).ok_or("superblock truncated")?;
        let db_id = c.u64().ok_or("superblock truncated")?;
        let stored = c.u32().ok_or("superblock truncated")?;
        let want = crc::masked(b.get(0..40).ok_or("superblock truncated")?);
        if stored != want {
            return Err(format!("superblock checksum mismatch (stored {stored:#x}, computed {want:#x})"));
        }
        if !(MIN_READ_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(format!(
                "unsupported native format version {version} (this build reads {MIN_READ_VERSION} to {FORMAT_VERSION})"
            ));
        }
        if shards == 0 || shards > 1024 || stride == 0 || !stride.is_multiple_of(LINE) || slots_per_pool < 2 {
            return Err(format!("implausible geometry: {shards} shards, stride {stride}, {slots_per_pool} slots"));
        }
        Ok(Superblock { shards, stride, slots_per_pool, db_id })
    }
}

/// What ties a record to the segment it was written in: the segment's generation (low 32
/// bits in every record header) and its random salt (mixed into every record checksum), so
/// neither the records of an earlier life of a reused slot nor a record that a value
/// happens to contain verify as records of this segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegTag {
    /// The segment's generation.
    pub gen: u64,
    /// The segment's salt.
    pub salt: u32,
}

/// A segment header (the seal word is separate: it changes after the header is written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegHeader {
    /// The shard whose log the segment belongs to.
    pub shard: u32,
    /// The segment's position in its shard's log (1, 2, ...): unique per shard.
    pub gen: u64,
    /// Slots covered (1, or more for a record larger than one slot).
    pub span: u32,
    /// Random, chosen when the segment is created.
    pub salt: u32,
    /// The store's identity.
    pub db_id: u64,
}

impl SegHeader {
    /// Encode the 64 header bytes (seal word zero: open).
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(SEG_MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.shard.to_le_bytes());
        b[16..24].copy_from_slice(&self.gen.to_le_bytes());
        b[24..32].copy_from_slice(&self.db_id.to_le_bytes());
        b[32..36].copy_from_slice(&self.span.to_le_bytes());
        b[36..40].copy_from_slice(&self.salt.to_le_bytes());
        let c = crc::masked(&b[0..40]);
        b[40..44].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// The tag of its records.
    pub fn tag(&self) -> SegTag {
        SegTag { gen: self.gen, salt: self.salt }
    }

    /// Decode. `Ok(None)`: no segment magic (a free slot). `Err`: the magic is there but
    /// the header does not verify (the magic is stored last, so this is damage).
    pub fn decode(b: &[u8]) -> Result<Option<SegHeader>, String> {
        if b.get(0..8) != Some(SEG_MAGIC.as_slice()) {
            return Ok(None);
        }
        let mut c = Cursor::new(b);
        c.skip(8).ok_or("segment header truncated")?;
        let version = c.u32().ok_or("segment header truncated")?;
        let shard = c.u32().ok_or("segment header truncated")?;
        let gen = c.u64().ok_or("segment header truncated")?;
        let db_id = c.u64().ok_or("segment header truncated")?;
        let span = c.u32().ok_or("segment header truncated")?;
        let salt = c.u32().ok_or("segment header truncated")?;
        let stored = c.u32().ok_or("segment header truncated")?;
        let want = crc::masked(b.get(0..40).ok_or("segment header truncated")?);
        if stored != want {
            return Err(format!("segment header checksum mismatch (stored {stored:#x}, computed {want:#x})"));
        }
        if !(MIN_READ_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(format!("unsupported segment version {version}"));
        }
        if span == 0 || gen == 0 {
            return Err(format!("implausible segment header: gen {gen}, span {span}"));
        }
        Ok(Some(SegHeader { shard, gen, span, salt, db_id }))
    }
}

/// The seal word of a segment of generation `gen` whose records fill `len` bytes: the
/// length in the low half, a checksum of `(gen, len)` in the high half. Zero is "open".
pub fn seal_word(gen: u64, len: u32) -> u64 {
    let c = crc::masked_parts(&[&gen.to_le_bytes(), &len.to_le_bytes()]);
    (u64::from(c) << 32) | u64::from(len)
}

/// Decode a seal word: `Ok(None)` open, `Ok(Some(len))` sealed, `Err` damaged.
pub fn decode_seal(gen: u64, word: u64) -> Result<Option<u32>, String> {
    if word == 0 {
        return Ok(None);
    }
    let len = (word & 0xffff_ffff) as u32;
    if seal_word(gen, len) != word {
        return Err(format!("segment seal word {word:#018x} does not verify"));
    }
    Ok(Some(len))
}

/// The entry at the start of `b` (at least its header and the key and value it claims),
/// parsed without checking its checksum: for reads of entries verified earlier (see
/// `NativeOptions::verify_reads`). `Err` when the header is not an entry's.
pub fn parse_entry(b: &[u8], seq: u64) -> Result<EntryOut<'_>, String> {
    let h = b.get(..ENTRY_HEADER_LEN).ok_or("entry header truncated")?;
    let vlen = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
    let klen = usize::from(u16::from_le_bytes([h[8], h[9]]));
    let kind = Kind::from_u8(h[10]).ok_or("unknown entry kind")?;
    let key = b.get(ENTRY_HEADER_LEN..ENTRY_HEADER_LEN + klen).ok_or("entry key runs past its range")?;
    let value =
        b.get(ENTRY_HEADER_LEN + klen..ENTRY_HEADER_LEN + klen + vlen).ok_or("entry value runs past its range")?;
    if h[11] != 0 || (kind != Kind::Put && vlen != 0) {
        return Err("malformed entry header".into());
    }
    Ok(EntryOut { seq, kind, offset: 0, key, value })
}

/// One operation of a record, for encoding.
#[derive(Debug, Clone, Copy)]
pub struct EntryIn<'a> {
    /// Put or delete.
    pub kind: Kind,
    /// The key.
    pub key: &'a [u8],
    /// The value (empty for a delete).
    pub value: &'a [u8],
}

/// Encoded size of an entry.
pub fn entry_len(key: usize, value: usize) -> usize {
    ENTRY_HEADER_LEN + key + value
}

/// Encoded size of a record whose entries take `entries` bytes (rounded to 8).
pub fn record_len(entries: usize) -> usize {
    (RECORD_HEADER_LEN + entries).next_multiple_of(RECORD_ALIGN as usize)
}

/// The 12-byte header of an entry with sequence number `seq` (its checksum covers the
/// sequence number, the rest of the header, the key and the value).
pub fn entry_header(seq: u64, e: &EntryIn<'_>) -> [u8; ENTRY_HEADER_LEN] {
    let mut h = [0u8; ENTRY_HEADER_LEN];
    h[4..8].copy_from_slice(&(e.value.len() as u32).to_le_bytes());
    h[8..10].copy_from_slice(&(e.key.len() as u16).to_le_bytes());
    h[10] = e.kind as u8;
    let c = crc::masked_parts(&[&seq.to_le_bytes(), &h[4..12], e.key, e.value]);
    h[0..4].copy_from_slice(&c.to_le_bytes());
    h
}

/// A record header being built: the fields first, then each entry header folded into the
/// checksum (which covers the header from byte 4 and every entry header, whose own
/// checksums cover the keys and values), then [`RecordHeader::finish`].
#[derive(Debug, Clone, Copy)]
pub struct RecordHeader {
    h: [u8; RECORD_HEADER_LEN],
    crc: u32,
}

impl RecordHeader {
    /// A record of `len` bytes and `count` entries from sequence number `seq`, in the
    /// segment `tag`.
    pub fn new(len: u32, tag: SegTag, count: u32, seq: u64) -> RecordHeader {
        let mut h = [0u8; RECORD_HEADER_LEN];
        h[4..8].copy_from_slice(&len.to_le_bytes());
        h[8..12].copy_from_slice(&(tag.gen as u32).to_le_bytes());
        h[12..16].copy_from_slice(&count.to_le_bytes());
        h[16..24].copy_from_slice(&seq.to_le_bytes());
        let crc = crc32c::crc32c_append(crc32c::crc32c(&tag.salt.to_le_bytes()), &h[4..24]);
        RecordHeader { h, crc }
    }

    /// Fold in the next entry's header.
    pub fn add(&mut self, entry_header: &[u8; ENTRY_HEADER_LEN]) {
        self.crc = crc32c::crc32c_append(self.crc, entry_header);
    }

    /// The header bytes.
    pub fn finish(mut self) -> [u8; RECORD_HEADER_LEN] {
        self.h[0..4].copy_from_slice(&crc::mask(self.crc).to_le_bytes());
        self.h
    }
}

/// Encode a whole record (tests and the golden-bytes test; the write path writes the same
/// bytes piece by piece straight into PM).
pub fn encode_record(tag: SegTag, seq: u64, entries: &[EntryIn<'_>]) -> Vec<u8> {
    let body: usize = entries.iter().map(|e| entry_len(e.key.len(), e.value.len())).sum();
    let len = record_len(body);
    let hdrs: Vec<[u8; ENTRY_HEADER_LEN]> =
        entries.iter().enumerate().map(|(i, e)| entry_header(seq.wrapping_add(i as u64), e)).collect();
    let mut rh = RecordHeader::new(len as u32, tag, entries.len() as u32, seq);
    for h in &hdrs {
        rh.add(h);
    }
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&rh.finish());
    for (h, e) in hdrs.iter().zip(entries) {
        out.extend_from_slice(h);
        out.extend_from_slice(e.key);
        out.extend_from_slice(e.value);
    }
    out.resize(len, 0);
    out
}

/// A decoded entry, borrowing from the record bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryOut<'a> {
    /// Its sequence number.
    pub seq: u64,
    /// Put or delete.
    pub kind: Kind,
    /// Offset of the entry in the record.
    pub offset: usize,
    /// The key.
    pub key: &'a [u8],
    /// The value.
    pub value: &'a [u8],
}

/// The length a record at the start of `b` claims, if it is plausible for a record of a
/// segment of generation `gen` (a cheap filter before the checksum).
pub fn claimed_len(b: &[u8], gen: u64) -> Option<usize> {
    let mut c = Cursor::new(b);
    c.skip(4)?;
    let len = c.u32()? as usize;
    let g = c.u32()?;
    let count = c.u32()?;
    if g != gen as u32
        || count == 0
        || len < RECORD_HEADER_LEN + ENTRY_HEADER_LEN
        || !len.is_multiple_of(RECORD_ALIGN as usize)
        || len > b.len()
    {
        return None;
    }
    Some(len)
}

/// Decode and verify the record at the start of `b` (a segment's remaining bytes) for the
/// segment `tag`; calls `f` for every entry once the whole record verified. Returns the
/// record's length and first sequence number. `Err(detail)`: not a valid record.
pub fn decode_record<'a>(b: &'a [u8], tag: SegTag, f: impl FnMut(EntryOut<'a>)) -> Result<(usize, u64), String> {
    decode_record_with(b, tag, true, f)
}

/// [`decode_record`], checking each entry's own checksum only when `check_entries`.
fn decode_record_with<'a>(
    b: &'a [u8],
    tag: SegTag,
    check_entries: bool,
    mut f: impl FnMut(EntryOut<'a>),
) -> Result<(usize, u64), String> {
    let len = claimed_len(b, tag.gen).ok_or("no plausible record header")?;
    let rec = b.get(..len).ok_or("record runs past the segment")?;
    let mut c = Cursor::new(rec);
    let stored = c.u32().ok_or("truncated")?;
    c.skip(4).ok_or("truncated")?;
    c.skip(4).ok_or("truncated")?;
    let count = c.u32().ok_or("truncated")?;
    let seq = c.u64().ok_or("truncated")?;
    let mut rc = crc32c::crc32c_append(crc32c::crc32c(&tag.salt.to_le_bytes()), rec.get(4..24).ok_or("truncated")?);
    let mut pos = RECORD_HEADER_LEN;
    let mut entries = Vec::with_capacity(count.min(1024) as usize);
    for i in 0..u64::from(count) {
        let h = rec.get(pos..pos + ENTRY_HEADER_LEN).ok_or("entry header runs past the record")?;
        let e = if check_entries {
            decode_entry(rec, pos, seq.wrapping_add(i))?
        } else {
            EntryOut {
                offset: pos,
                ..parse_entry(rec.get(pos..).ok_or("entry runs past the record")?, seq.wrapping_add(i))?
            }
        };
        rc = crc32c::crc32c_append(rc, h);
        pos += entry_len(e.key.len(), e.value.len());
        entries.push(e);
    }
    if crc::mask(rc) != stored {
        return Err(format!("record checksum mismatch (stored {stored:#x}, computed {:#x})", crc::mask(rc)));
    }
    if record_len(pos - RECORD_HEADER_LEN) != len {
        return Err(format!("record length {len} does not match its {count} entries"));
    }
    for e in entries {
        f(e);
    }
    Ok((len, seq))
}

/// The record at the start of `b` (segment `tag`) checked by its header checksum only —
/// it covers the record header and every entry header — and not by its entries' own
/// checksums, so no value byte is read: for the index's incremental checkpoints, which
/// list records this process appended (their entries are verified at their first read
/// after an open that loads them). Calls `f` for every entry once the header verified;
/// returns the record's length.
pub fn decode_record_headers<'a>(b: &'a [u8], tag: SegTag, f: impl FnMut(EntryOut<'a>)) -> Result<usize, String> {
    decode_record_with(b, tag, false, f).map(|(len, _)| len)
}

/// Decode and verify the entry at `pos` of `b` with sequence number `seq`.
pub fn decode_entry(b: &[u8], pos: usize, seq: u64) -> Result<EntryOut<'_>, String> {
    let h = b.get(pos..pos + ENTRY_HEADER_LEN).ok_or("entry header truncated")?;
    let mut c = Cursor::new(h);
    let stored = c.u32().ok_or("entry header truncated")?;
    let vlen = c.u32().ok_or("entry header truncated")? as usize;
    let klen = usize::from(c.u16().ok_or("entry header truncated")?);
    let kind = Kind::from_u8(c.u8().ok_or("entry header truncated")?).ok_or("unknown entry kind")?;
    let kstart = pos + ENTRY_HEADER_LEN;
    let key = b.get(kstart..kstart + klen).ok_or("entry key runs past the record")?;
    let value = b.get(kstart + klen..kstart + klen + vlen).ok_or("entry value runs past the record")?;
    let want = crc::masked_parts(&[&seq.to_le_bytes(), &h[4..12], key, value]);
    if want != stored {
        return Err(format!("entry checksum mismatch (stored {stored:#x}, computed {want:#x})"));
    }
    if kind != Kind::Put && vlen != 0 {
        return Err("delete or moved entry with a value".into());
    }
    Ok(EntryOut { seq, kind, offset: pos, key, value })
}

/// One shard's log end at a clean close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tail {
    /// Generation of the shard's open segment (0: the shard has none).
    pub gen: u64,
    /// Bytes of records in it.
    pub len: u32,
}

/// The clean-close record: each shard's log end, and the next sequence number. Valid only
/// until the store is written again (open invalidates it before the first write).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clean {
    /// The next sequence number.
    pub next_seq: u64,
    /// Per shard.
    pub tails: Vec<Tail>,
}

impl Clean {
    /// Bytes the record takes for `shards` shards.
    pub fn encoded_len(shards: usize) -> usize {
        32 + shards * 16
    }

    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::encoded_len(self.tails.len()));
        b.extend_from_slice(CLEAN_MAGIC);
        b.extend_from_slice(&(self.tails.len() as u32).to_le_bytes());
        b.extend_from_slice(&[0u8; 4]);
        b.extend_from_slice(&self.next_seq.to_le_bytes());
        for t in &self.tails {
            b.extend_from_slice(&t.gen.to_le_bytes());
            b.extend_from_slice(&t.len.to_le_bytes());
            b.extend_from_slice(&[0u8; 4]);
        }
        let c = crc::masked(&b);
        b.extend_from_slice(&c.to_le_bytes());
        b.extend_from_slice(&[0u8; 4]);
        b
    }

    /// Decode: `None` when there is no valid record (not cleanly closed, or damaged).
    pub fn decode(b: &[u8], shards: usize) -> Option<Clean> {
        let n = Self::encoded_len(shards);
        let b = b.get(..n)?;
        if b.get(0..8)? != CLEAN_MAGIC {
            return None;
        }
        let body = b.get(..n - 8)?;
        let mut c = Cursor::new(b);
        c.skip(8)?;
        if c.u32()? as usize != shards {
            return None;
        }
        c.skip(4)?;
        let next_seq = c.u64()?;
        let mut tails = Vec::with_capacity(shards);
        for _ in 0..shards {
            let gen = c.u64()?;
            let len = c.u32()?;
            c.skip(4)?;
            tails.push(Tail { gen, len });
        }
        (c.u32()? == crc::masked(body)).then_some(Clean { next_seq, tails })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn record_round_trip_and_every_damage_is_caught() {
        let entries = [
            EntryIn { kind: Kind::Put, key: b"alpha", value: b"one" },
            EntryIn { kind: Kind::Delete, key: b"beta", value: b"" },
        ];
        let tag = SegTag { gen: 7, salt: 0x5a17 };
        let rec = encode_record(tag, 100, &entries);
        let mut seen = Vec::new();
        let (len, seq) =
            decode_record(&rec, tag, |e| seen.push((e.seq, e.kind, e.key.to_vec(), e.value.to_vec()))).unwrap();
        assert_eq!((len, seq), (rec.len(), 100));
        assert_eq!(seen[0], (100, Kind::Put, b"alpha".to_vec(), b"one".to_vec()));
        assert_eq!(seen[1], (101, Kind::Delete, b"beta".to_vec(), vec![]));
        // Another generation's segment does not accept it (stale records of a reused slot),
        // nor a segment of the same generation with another salt (another shard's).
        assert!(decode_record(&rec, SegTag { gen: 8, ..tag }, |_| {}).is_err());
        assert!(decode_record(&rec, SegTag { salt: 1, ..tag }, |_| {}).is_err());
        for i in 0..rec.len() - 3 {
            let mut bad = rec.clone();
            bad[i] ^= 0x10;
            let mut called = false;
            let r = decode_record(&bad, tag, |_| called = true);
            // Padding bytes are not covered; everything else is.
            if i < RECORD_HEADER_LEN + 2 * ENTRY_HEADER_LEN + 5 + 3 + 4 {
                assert!(r.is_err(), "flip at {i} accepted");
                assert!(!called);
            }
        }
    }

    #[test]
    fn seal_words_verify() {
        assert_eq!(decode_seal(3, 0).unwrap(), None);
        assert_eq!(decode_seal(3, seal_word(3, 4096)).unwrap(), Some(4096));
        assert!(decode_seal(4, seal_word(3, 4096)).is_err());
        assert!(decode_seal(3, seal_word(3, 4096) ^ 1).is_err());
    }

    #[test]
    fn clean_record_round_trip() {
        let c = Clean { next_seq: 42, tails: vec![Tail { gen: 3, len: 100 }, Tail { gen: 0, len: 0 }] };
        let b = c.encode();
        assert_eq!(b.len(), Clean::encoded_len(2));
        assert_eq!(Clean::decode(&b, 2), Some(c));
        assert_eq!(Clean::decode(&b, 3), None);
        let mut bad = b.clone();
        bad[20] ^= 1;
        assert_eq!(Clean::decode(&bad, 2), None);
    }
}
