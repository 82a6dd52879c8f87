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
//! record: crc u32 | len u32 | seq u64 | count u32 | entry × count | pad to 8
//! entry:  crc u32 (of kind .. value) | kind u8 | klen u16 | vlen u32 | key | value
//! ```
//!
//! A record is one write: a put, a delete, or a whole batch (so a batch is atomic: its
//! record verifies entirely or not at all). Index entries point at an *entry* inside its
//! record, and carries its own checksum so that a read through the index verifies just the
//! entry it needs (the record checksum is what recovery verifies). `len` counts the bytes after the `len` field (seq .. last entry, unpadded). The
//! record crc covers the segment id and `len ..` the last entry, so a record left behind by
//! an earlier segment in a reused extent never verifies as one of this segment's.
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
/// Record header size (crc, len, seq, count).
pub const RECORD_HEADER: usize = 4 + 4 + 8 + 4;
/// Entry header size (crc, kind, klen, vlen).
pub const ENTRY_HEADER: usize = 4 + 1 + 2 + 4;
pub(crate) const MAGIC: &[u8; 8] = b"TKVLKSEG";
const VERSION: u32 = 1;

/// A record's kind. Never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A value.
    Put = 0,
    /// A deletion.
    Delete = 1,
}

/// One write of a record: kind, key, value.
pub type Op<'a> = (Kind, &'a [u8], &'a [u8]);

/// The bytes a record of `entries` (kind, key, value) occupies (padded).
pub fn record_size(entries: impl IntoIterator<Item = (usize, usize)>) -> usize {
    let body: usize = entries.into_iter().map(|(k, v)| ENTRY_HEADER + k + v).sum();
    (RECORD_HEADER + body).next_multiple_of(8)
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

/// Encode a record of segment `seg_id` holding `entries` (padded to 8 bytes). Returns the
/// bytes and each entry's offset inside them.
pub fn encode_record(seg_id: u64, seq: u64, entries: &[Op<'_>]) -> (Vec<u8>, Vec<usize>) {
    let size = record_size(entries.iter().map(|e| (e.1.len(), e.2.len())));
    let mut r = Vec::with_capacity(size);
    r.extend_from_slice(&[0u8; 8]);
    r.extend_from_slice(&seq.to_le_bytes());
    r.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    let mut offs = Vec::with_capacity(entries.len());
    for (kind, key, value) in entries {
        let at = r.len();
        offs.push(at);
        r.extend_from_slice(&[0u8; 4]);
        r.push(*kind as u8);
        r.extend_from_slice(&(key.len() as u16).to_le_bytes());
        r.extend_from_slice(&(value.len() as u32).to_le_bytes());
        r.extend_from_slice(key);
        r.extend_from_slice(value);
        let c = crc::masked(&r[at + 4..]);
        r[at..at + 4].copy_from_slice(&c.to_le_bytes());
    }
    let len = (r.len() - 8) as u32;
    r[4..8].copy_from_slice(&len.to_le_bytes());
    let c = crc::masked_parts(&[&seg_id.to_le_bytes(), &r[4..]]);
    r[0..4].copy_from_slice(&c.to_le_bytes());
    r.resize(size, 0);
    (r, offs)
}

/// One entry of a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<'a> {
    /// Offset of the entry in the segment (what index entries point at).
    pub off: usize,
    /// Put or delete.
    pub kind: Kind,
    /// The key.
    pub key: &'a [u8],
    /// The value (empty for a delete).
    pub value: &'a [u8],
}

/// A record read from a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<'a> {
    /// Offset in the segment.
    pub off: usize,
    /// Padded size.
    pub size: usize,
    /// Global sequence number (replay order across segments).
    pub seq: u64,
    /// Its entries, in write order.
    pub entries: Vec<Entry<'a>>,
}

/// The key and value lengths an entry header claims.
pub fn entry_lens(h: &[u8]) -> Option<(usize, usize)> {
    let h = h.get(..ENTRY_HEADER)?;
    Some((u16::from_le_bytes([h[5], h[6]]) as usize, u32::from_le_bytes([h[7], h[8], h[9], h[10]]) as usize))
}

/// Decode and verify the entry at the start of `b`: (kind, key, value, bytes used); `None`
/// when it is malformed or its checksum does not match.
pub fn decode_entry(b: &[u8]) -> Option<(Kind, &[u8], &[u8], usize)> {
    let h = b.get(..ENTRY_HEADER)?;
    let kind = match h[4] {
        0 => Kind::Put,
        1 => Kind::Delete,
        _ => return None,
    };
    let (klen, vlen) = entry_lens(h)?;
    if kind == Kind::Delete && vlen != 0 {
        return None;
    }
    let end = ENTRY_HEADER.checked_add(klen)?.checked_add(vlen)?;
    let body = b.get(ENTRY_HEADER..end)?;
    if u32::from_le_bytes([h[0], h[1], h[2], h[3]]) != crc::masked(&b[4..end]) {
        return None;
    }
    Some((kind, &body[..klen], &body[klen..], end))
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
    let count = u32::from_le_bytes([body[8], body[9], body[10], body[11]]) as usize;
    if count == 0 || count > body.len() / ENTRY_HEADER {
        return None;
    }
    let mut entries = Vec::with_capacity(count);
    let mut at = 12;
    for _ in 0..count {
        let (kind, key, value, used) = decode_entry(&body[at..])?;
        entries.push(Entry { off: off + 8 + at, kind, key, value });
        at += used;
    }
    if at != len {
        return None;
    }
    Some(Record { off, size: (8 + len).next_multiple_of(8), seq: u64::from_le_bytes(s), entries })
}

/// Every record of segment `seg_id` in `seg` (header included), and the end of the log.
/// `Err((offset, detail))` when a bad record is followed by a good one (damage, not a tear).
pub fn scan(seg: &[u8], seg_id: u64) -> Result<(Vec<Record<'_>>, usize), (usize, String)> {
    let mut out = Vec::new();
    let mut off = HEADER_LEN;
    while let Some(r) = record_at(seg, seg_id, off) {
        off += r.size;
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

    fn segment(id: u64, recs: &[(u64, &[Op<'_>])]) -> Vec<u8> {
        let mut s = vec![0u8; 4096];
        s[..HEADER_LEN].copy_from_slice(&encode_header(id, 4096));
        let mut off = HEADER_LEN;
        for (seq, entries) in recs {
            let (r, _) = encode_record(id, *seq, entries);
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
        // Checked against an independent crc32c.
        let (r, offs) = encode_record(7, 3, &[(Kind::Put, b"k", b"vv"), (Kind::Delete, b"d", b"")]);
        assert_eq!(
            hex(&r),
            "68f9990c26000000030000000000000002000000014fb43b000100020000006b76766f01b37001010000000000640000"
        );
        assert_eq!(offs, vec![20, 34]);
    }

    #[test]
    fn scan_reads_back_batches_and_stops_at_a_torn_tail() {
        let mut s = segment(
            9,
            &[
                (1, &[(Kind::Put, b"a", b"1")]),
                (2, &[(Kind::Delete, b"b", b""), (Kind::Put, b"c", b"3")]),
                (5, &[(Kind::Put, b"", b"x")]),
            ],
        );
        assert_eq!(decode_header(&s).unwrap(), (9, 4096));
        let (recs, end) = scan(&s, 9).unwrap();
        let got: Vec<(u64, Kind, &[u8])> =
            recs.iter().flat_map(|r| r.entries.iter().map(move |e| (r.seq, e.kind, e.key))).collect();
        assert_eq!(
            got,
            vec![
                (1, Kind::Put, &b"a"[..]),
                (2, Kind::Delete, &b"b"[..]),
                (2, Kind::Put, &b"c"[..]),
                (5, Kind::Put, &b""[..])
            ]
        );
        // An entry offset points at its entry.
        let e = &recs[1].entries[1];
        assert_eq!(decode_entry(&s[e.off..]).map(|x| (x.0, x.1, x.2)), Some((Kind::Put, &b"c"[..], &b"3"[..])));
        // Tear the last record: the scan ends before it, without error; a torn batch is
        // dropped whole.
        let last = recs[2].off;
        let second = recs[1].off;
        drop(recs);
        s[last + 24] ^= 0xff;
        let (recs, end2) = scan(&s, 9).unwrap();
        assert_eq!((recs.len(), end2), (2, last));
        assert!(end > end2);
        drop(recs);
        let mut t = s.clone();
        t[last..].fill(0);
        t[second + 34] ^= 1;
        assert_eq!(scan(&t, 9).unwrap().0.len(), 1, "a damaged batch is not half applied");
    }

    #[test]
    fn damage_before_valid_records_is_corruption_and_stale_records_never_verify() {
        let mut s = segment(9, &[(1, &[(Kind::Put, b"a", b"1")]), (2, &[(Kind::Put, b"b", b"2")])]);
        s[HEADER_LEN + 9] ^= 1;
        let e = scan(&s, 9).unwrap_err();
        assert_eq!(e.0, HEADER_LEN);
        // The same bytes read as segment 10 (an extent reused by a new segment): nothing.
        let s = segment(9, &[(1, &[(Kind::Put, b"a", b"1")])]);
        assert_eq!(scan(&s, 10).unwrap().0.len(), 0);
        assert!(decode_header(&s[..10]).is_err());
        let mut bad = s.clone();
        bad[8] = 2;
        assert!(decode_header(&bad).unwrap_err().contains("checksum"));
    }
}
