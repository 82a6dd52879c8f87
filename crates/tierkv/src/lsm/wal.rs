//! The write-ahead log of the leveled LSM (docs/format/lsm.md).
//!
//! One file per MemTable generation, `wal-NNNNNN.log`, a sequence of framed records
//! (`length u32 | masked crc32c u32 | payload`, [`crate::format::frame`]). One record is one
//! atomic batch:
//! ```text
//! seq u64 | count u32 | count × (kind u8 | klen u32 | vlen u32 | key | value)
//! ```
//! `kind` is 0 for a put and 1 for a delete (whose `vlen` is 0). `seq` is the caller's
//! sequence number of the batch (HoaKV compares it with its hot records at recovery).
//! Which bad record is a torn tail and what open does with damage is
//! [`crate::format::log`]'s rule and the store's [`crate::WalRecovery`] mode.

use crate::format::Cursor;

/// One operation of a batch: key and value (`None` deletes).
pub type Op = (Vec<u8>, Option<Vec<u8>>);

/// A decoded batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The caller's sequence number.
    pub seq: u64,
    /// The operations, in order.
    pub ops: Vec<Op>,
}

/// File name of WAL generation `g`.
pub fn name(g: u64) -> String {
    format!("wal-{g:06}.log")
}

/// The generation a WAL file name carries.
pub fn number(name: &str) -> Option<u64> {
    name.strip_prefix("wal-")?.strip_suffix(".log")?.parse().ok()
}

/// Encode one batch as a framed record ([`crate::format::frame`] of its payload), in one
/// buffer of the exact size.
pub fn encode_framed(seq: u64, ops: &[(&[u8], Option<&[u8]>)]) -> Vec<u8> {
    let size: usize = 12 + ops.iter().map(|(k, v)| 9 + k.len() + v.map_or(0, <[u8]>::len)).sum::<usize>();
    let mut out = Vec::with_capacity(8 + size);
    out.extend_from_slice(&[0; 8]);
    encode_into(&mut out, seq, ops.iter().copied());
    let len = (out.len() - 8) as u32;
    let c = crate::format::crc::masked(out.get(8..).unwrap_or_default());
    out[..4].copy_from_slice(&len.to_le_bytes());
    out[4..8].copy_from_slice(&c.to_le_bytes());
    out
}

/// Encode one batch as a record payload (not yet framed; tests).
#[cfg(test)]
pub fn encode<'a>(seq: u64, ops: impl ExactSizeIterator<Item = (&'a [u8], Option<&'a [u8]>)>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    encode_into(&mut out, seq, ops);
    out
}

fn encode_into<'a>(out: &mut Vec<u8>, seq: u64, ops: impl ExactSizeIterator<Item = (&'a [u8], Option<&'a [u8]>)>) {
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(ops.len() as u32).to_le_bytes());
    for (k, v) in ops {
        out.push(u8::from(v.is_none()));
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.map_or(0, |v| v.len()) as u32).to_le_bytes());
        out.extend_from_slice(k);
        if let Some(v) = v {
            out.extend_from_slice(v);
        }
    }
}

/// Decode a record payload.
pub fn decode(p: &[u8]) -> Result<Batch, String> {
    let (seq, ops) = decode_borrowed(p)?;
    Ok(Batch { seq, ops: ops.into_iter().map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec))).collect() })
}

/// [`decode`], the keys and values borrowed from `p`: (sequence number, operations).
pub fn decode_borrowed(p: &[u8]) -> Result<BorrowedBatch<'_>, String> {
    let mut c = Cursor::new(p);
    let short = || "truncated WAL batch".to_string();
    let seq = c.u64().ok_or_else(short)?;
    let n = c.u32().ok_or_else(short)? as usize;
    if n > c.remaining() / 9 {
        return Err(format!("WAL batch claims {n} operations in {} bytes", c.remaining()));
    }
    let mut ops = Vec::with_capacity(n);
    for _ in 0..n {
        let kind = c.u8().ok_or_else(short)?;
        let kl = c.u32().ok_or_else(short)? as usize;
        let vl = c.u32().ok_or_else(short)? as usize;
        let k = c.bytes(kl).ok_or_else(short)?;
        let v = c.bytes(vl).ok_or_else(short)?;
        let v = match kind {
            0 => Some(v),
            1 if vl == 0 => None,
            _ => return Err(format!("bad WAL operation kind {kind}")),
        };
        ops.push((k, v));
    }
    if c.remaining() != 0 {
        return Err("trailing bytes after a WAL batch".into());
    }
    Ok((seq, ops))
}

/// A batch's sequence number and its operations, borrowed from a record payload.
pub type BorrowedBatch<'a> = (u64, Vec<(&'a [u8], Option<&'a [u8]>)>);

/// Every complete batch of a WAL file's bytes, and whether a torn tail was dropped (tests).
#[cfg(test)]
pub fn parse(data: &[u8]) -> Result<(Vec<Batch>, bool), (u64, String)> {
    let (frames, torn) = crate::format::read_frames(data)?;
    let mut out = Vec::with_capacity(frames.len());
    for (off, p) in frames {
        out.push(decode(p).map_err(|d| (off, d))?);
    }
    Ok((out, torn))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::frame;

    #[test]
    fn batches_round_trip_and_a_torn_tail_is_dropped() {
        let a = encode(7, [(b"k1".as_slice(), Some(b"v1".as_slice())), (b"k2".as_slice(), None)].into_iter());
        let b = encode(8, [(b"k3".as_slice(), Some(b"".as_slice()))].into_iter());
        let mut data = frame(&a);
        data.extend_from_slice(&frame(&b));
        let (got, torn) = parse(&data).map_err(|e| e.1).unwrap_or_default();
        assert!(!torn);
        assert_eq!(
            got,
            vec![
                Batch { seq: 7, ops: vec![(b"k1".to_vec(), Some(b"v1".to_vec())), (b"k2".to_vec(), None)] },
                Batch { seq: 8, ops: vec![(b"k3".to_vec(), Some(Vec::new()))] },
            ]
        );
        for cut in 1..frame(&b).len() {
            let (got, torn) = parse(&data[..data.len() - cut]).map_err(|e| e.1).unwrap_or_default();
            assert_eq!((got.len(), torn), (1, true), "cut {cut}");
        }
        assert!(decode(&a[..a.len() - 1]).is_err());
        let mut bad = a.clone();
        bad[12] = 5;
        assert!(decode(&bad).is_err(), "unknown kind");
        assert_eq!(number(&name(42)), Some(42));
    }

    #[test]
    fn encode_framed_is_the_frame_of_the_payload() {
        let big = vec![7u8; 3000];
        let ops: [(&[u8], Option<&[u8]>); 3] = [(b"k1", Some(b"v1")), (b"", None), (b"k3", Some(&big))];
        let framed = encode_framed(9, &ops);
        assert_eq!(framed, frame(&encode(9, ops.iter().copied())));
        assert_eq!(framed.capacity(), framed.len(), "one buffer of the exact size");
    }
}
