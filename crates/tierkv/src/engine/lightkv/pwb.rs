//! LightKV's persistent write buffer (PWB, §III-A/D): append-only PM segments, one active per
//! partition, holding the KV records the RH-Tree's top leaves point at. There is no WAL: a
//! put is durable once its record is persisted in a segment.
//!
//! # Layout (docs/format/lightkv.md)
//! A segment is one PM extent: a 64-byte header, then records from offset 64, each padded to
//! 8 bytes.
//!
//! ```text
//! header: magic "TKVLKSEG" | version u32 = 1 | segment id u64 | size u64 | crc u32 (of bytes 0..28)
//! record: crc u32 | len u32 | seq u64 | kind u8 | klen u16 | vlen u32 | key | value | pad to 8
//! ```
//!
//! `len` counts the bytes after the `len` field (seq .. value, unpadded). The record crc covers
//! the segment id and `len .. value`, so a record left behind by an earlier segment in a
//! reused extent never verifies as one of this segment's.
//!
//! # Where the log ends
//! The write position is not persisted separately (that would cost a second persist per put).
//! A scan stops at the first position that does not hold a verifying record: a zero `len`
//! (never written), or a record torn by a crash. Records are appended one at a time by the
//! partition's single writer and each is persisted before the put is acknowledged, so a torn
//! record is always the last one. So if any verifying record follows a bad one, the bad one is
//! damage, not a torn tail, and the scan reports `Corruption` instead of silently dropping the
//! acknowledged records after it.

use crate::format::crc;

/// Segment header size.
pub const HEADER_LEN: usize = 64;
/// Record header size (crc, len, seq, kind, klen, vlen).
pub const RECORD_HEADER: usize = 4 + 4 + 8 + 1 + 2 + 4;
const MAGIC: &[u8; 8] = b"TKVLKSEG";
const VERSION: u32 = 1;

/// A record's kind. Never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A value.
    Put = 0,
    /// A deletion.
    Delete = 1,
}

/// The bytes a record of `klen`/`vlen` occupies (padded).
pub fn record_size(klen: usize, vlen: usize) -> usize {
    (RECORD_HEADER + klen + vlen).next_multiple_of(8)
}

/// Encode a segment header.
pub fn encode_header(seg_id: u64, size: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..20].copy_from_slice(&seg_id.to_le_bytes());
    h[20..28].copy_from_slice(&size.to_le_bytes());
    let c = crc::masked(&h[0..28]);
    h[28..32].copy_from_slice(&c.to_le_bytes());
    h
}

/// Decode a segment header: (segment id, size), or what is wrong with it.
pub fn decode_header(h: &[u8]) -> Result<(u64, u64), String> {
    if h.len() < HEADER_LEN {
        return Err("segment shorter than its header".into());
    }
    if &h[0..8] != MAGIC {
        return Err("not a LightKV PWB segment (bad magic)".into());
    }
    let le32 = |a: usize| u32::from_le_bytes([h[a], h[a + 1], h[a + 2], h[a + 3]]);
    let le64 = |a: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[a..a + 8]);
        u64::from_le_bytes(b)
    };
    if le32(28) != crc::masked(&h[0..28]) {
        return Err("segment header checksum mismatch".into());
    }
    let v = le32(8);
    if v != VERSION {
        return Err(format!("unsupported segment format version {v} (this build reads {VERSION})"));
    }
    Ok((le64(12), le64(20)))
}

/// Encode a record of segment `seg_id` (padded to 8 bytes).
pub fn encode_record(seg_id: u64, seq: u64, kind: Kind, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(record_size(key.len(), value.len()));
    let len = (RECORD_HEADER - 8 + key.len() + value.len()) as u32;
    r.extend_from_slice(&[0u8; 4]);
    r.extend_from_slice(&len.to_le_bytes());
    r.extend_from_slice(&seq.to_le_bytes());
    r.push(kind as u8);
    r.extend_from_slice(&(key.len() as u16).to_le_bytes());
    r.extend_from_slice(&(value.len() as u32).to_le_bytes());
    r.extend_from_slice(key);
    r.extend_from_slice(value);
    let c = crc::masked_parts(&[&seg_id.to_le_bytes(), &r[4..]]);
    r[0..4].copy_from_slice(&c.to_le_bytes());
    r.resize(record_size(key.len(), value.len()), 0);
    r
}

/// A record read from a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<'a> {
    /// Offset in the segment.
    pub off: usize,
    /// Global sequence number (replay order across segments).
    pub seq: u64,
    /// Put or delete.
    pub kind: Kind,
    /// The key.
    pub key: &'a [u8],
    /// The value (empty for a delete).
    pub value: &'a [u8],
}

/// Decode the record at `off` if one of segment `seg_id` verifies there.
pub fn record_at(seg: &[u8], seg_id: u64, off: usize) -> Option<Record<'_>> {
    let hdr = seg.get(off..off.checked_add(RECORD_HEADER)?)?;
    let stored = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let len = u32::from_le_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]) as usize;
    if len < RECORD_HEADER - 8 {
        return None;
    }
    let body = seg.get(off + 8..(off + 8).checked_add(len)?)?;
    if stored != crc::masked_parts(&[&seg_id.to_le_bytes(), &hdr[4..8], body]) {
        return None;
    }
    let mut s = [0u8; 8];
    s.copy_from_slice(&body[0..8]);
    let kind = match body[8] {
        0 => Kind::Put,
        1 => Kind::Delete,
        _ => return None,
    };
    let klen = u16::from_le_bytes([body[9], body[10]]) as usize;
    let vlen = u32::from_le_bytes([body[11], body[12], body[13], body[14]]) as usize;
    if 15 + klen + vlen != len || (kind == Kind::Delete && vlen != 0) {
        return None;
    }
    Some(Record { off, seq: u64::from_le_bytes(s), kind, key: &body[15..15 + klen], value: &body[15 + klen..] })
}

/// Every record of segment `seg_id` in `seg` (header included), and the end of the log.
/// `Err((offset, detail))` when a bad record is followed by a good one (damage, not a tear).
pub fn scan(seg: &[u8], seg_id: u64) -> Result<(Vec<Record<'_>>, usize), (usize, String)> {
    let mut out = Vec::new();
    let mut off = HEADER_LEN;
    while let Some(r) = record_at(seg, seg_id, off) {
        off += record_size(r.key.len(), r.value.len());
        out.push(r);
    }
    let end = off;
    let mut probe = off + 8;
    while probe + RECORD_HEADER <= seg.len() {
        if record_at(seg, seg_id, probe).is_some() {
            return Err((end, format!("damaged record at offset {end} is followed by a valid record at {probe}")));
        }
        probe += 8;
    }
    Ok((out, end))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn segment(id: u64, recs: &[(u64, Kind, &[u8], &[u8])]) -> Vec<u8> {
        let mut s = vec![0u8; 4096];
        s[..HEADER_LEN].copy_from_slice(&encode_header(id, 4096));
        let mut off = HEADER_LEN;
        for (seq, kind, k, v) in recs {
            let r = encode_record(id, *seq, *kind, k, v);
            s[off..off + r.len()].copy_from_slice(&r);
            off += r.len();
        }
        s
    }

    #[test]
    fn golden_bytes() {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(
            hex(&encode_header(7, 4 << 20)),
            format!("544b564c4b5345470100000007000000000000000000400000000000b611b259{}", "00".repeat(32))
        );
        assert_eq!(
            hex(&encode_record(7, 3, Kind::Put, b"k", b"vv")),
            "c5412657120000000300000000000000000100020000006b7676000000000000"
        );
    }

    #[test]
    fn scan_reads_back_records_and_stops_at_a_torn_tail() {
        let mut s = segment(9, &[(1, Kind::Put, b"a", b"1"), (2, Kind::Delete, b"b", b""), (5, Kind::Put, b"", b"x")]);
        assert_eq!(decode_header(&s).unwrap(), (9, 4096));
        let (recs, end) = scan(&s, 9).unwrap();
        assert_eq!(
            recs.iter().map(|r| (r.seq, r.kind, r.key)).collect::<Vec<_>>(),
            vec![(1, Kind::Put, &b"a"[..]), (2, Kind::Delete, &b"b"[..]), (5, Kind::Put, &b""[..])]
        );
        // Tear the last record: the scan ends before it, without error.
        let last = recs[2].off;
        drop(recs);
        s[last + 20] ^= 0xff;
        let (recs, end2) = scan(&s, 9).unwrap();
        assert_eq!((recs.len(), end2), (2, last));
        assert!(end > end2);
    }

    #[test]
    fn damage_before_valid_records_is_corruption_and_stale_records_never_verify() {
        let mut s = segment(9, &[(1, Kind::Put, b"a", b"1"), (2, Kind::Put, b"b", b"2")]);
        s[HEADER_LEN + 9] ^= 1;
        let e = scan(&s, 9).unwrap_err();
        assert_eq!(e.0, HEADER_LEN);
        // The same bytes read as segment 10 (an extent reused by a new segment): nothing.
        let s = segment(9, &[(1, Kind::Put, b"a", b"1")]);
        assert_eq!(scan(&s, 10).unwrap().0.len(), 0);
        assert!(decode_header(&s[..10]).is_err());
        let mut bad = s.clone();
        bad[8] = 2;
        assert!(decode_header(&bad).unwrap_err().contains("checksum"));
    }
}
