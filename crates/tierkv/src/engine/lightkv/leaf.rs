//! Persistent copies of RH-Tree leaves (§III-D/E, Fig. 6): once a full top leaf's records are
//! in an SSTable, the leaf is copied to PM with its offsets pointing into that table, and the
//! partition's *chain record* lists its PM leaves. Both are written once and never modified
//! (copy-on-write): a new chain record replaces the old one with one 8-byte pointer store.
//!
//! ```text
//! leaf:  magic "TKVLKLEF" | version u32 = 1 | normal u32 | depth u32 | buckets u32 | table u64
//!        | cw u32 | seq_hi u64 | pad to 60 | crc u32 (header 0..60 + every bucket)
//!        then `buckets` × 64-byte buckets: sig u32 × 4 | cache u32 × 4 | off u64 × 4
//! chain: magic "TKVLKCHN" | version u32 = 1 | end u8 | prefix len u16 | values u16 | prefix
//!        | values | leaves u32 | leaf address u64 × leaves (newest first) | crc u32 (all before)
//! ```
//!
//! `table` is the SSTable the leaf's entries point into, `cw` its compaction weight, `seq_hi`
//! the highest write-buffer sequence number the table holds (recovery skips records of the
//! partition at or below it).

use crate::format::crc;
use crate::index::rhtree::{Bucket, Leaf, PartitionDesc, SLOTS};

/// Leaf header size.
pub const LEAF_HEADER: usize = 64;
pub(crate) const LEAF_MAGIC: &[u8; 8] = b"TKVLKLEF";
pub(crate) const CHAIN_MAGIC: &[u8; 8] = b"TKVLKCHN";
const VERSION: u32 = 1;

/// What a persistent leaf says about its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeafMeta {
    /// SSTable number.
    pub table: u64,
    /// Compaction weight of the table.
    pub cw: u32,
    /// Highest write-buffer sequence number in the table.
    pub seq_hi: u64,
}

fn le32(b: &[u8], a: usize) -> u32 {
    u32::from_le_bytes([b[a], b[a + 1], b[a + 2], b[a + 3]])
}

fn le64(b: &[u8], a: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[a..a + 8]);
    u64::from_le_bytes(x)
}

/// Encode `leaf` with `meta`.
pub fn encode_leaf(leaf: &Leaf, normal: usize, meta: LeafMeta) -> Vec<u8> {
    let bs = leaf.buckets();
    let mut out = vec![0u8; LEAF_HEADER + bs.len() * 64];
    out[0..8].copy_from_slice(LEAF_MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(normal as u32).to_le_bytes());
    out[16..20].copy_from_slice(&(leaf.depth() as u32).to_le_bytes());
    out[20..24].copy_from_slice(&(bs.len() as u32).to_le_bytes());
    out[24..32].copy_from_slice(&meta.table.to_le_bytes());
    out[32..36].copy_from_slice(&meta.cw.to_le_bytes());
    out[36..44].copy_from_slice(&meta.seq_hi.to_le_bytes());
    for (i, b) in bs.iter().enumerate() {
        let o = LEAF_HEADER + i * 64;
        for s in 0..SLOTS {
            out[o + 4 * s..o + 4 * s + 4].copy_from_slice(&b.sig[s].to_le_bytes());
            out[o + 16 + 4 * s..o + 20 + 4 * s].copy_from_slice(&b.cache[s].to_le_bytes());
            out[o + 32 + 8 * s..o + 40 + 8 * s].copy_from_slice(&b.off[s].to_le_bytes());
        }
    }
    let c = crc::masked_parts(&[&out[0..60], &out[LEAF_HEADER..]]);
    out[60..64].copy_from_slice(&c.to_le_bytes());
    out
}

/// The 64 bytes of one bucket, as a leaf stores it.
pub fn bucket_bytes(b: &Bucket) -> [u8; 64] {
    let mut o = [0u8; 64];
    for s in 0..SLOTS {
        o[4 * s..4 * s + 4].copy_from_slice(&b.sig[s].to_le_bytes());
        o[16 + 4 * s..20 + 4 * s].copy_from_slice(&b.cache[s].to_le_bytes());
        o[32 + 8 * s..40 + 8 * s].copy_from_slice(&b.off[s].to_le_bytes());
    }
    o
}

/// Decode one 64-byte bucket (`b` is at least 64 bytes).
pub fn decode_bucket(b: &[u8]) -> Bucket {
    let mut bk = Bucket::default();
    for s in 0..SLOTS {
        bk.sig[s] = le32(b, 4 * s);
        bk.cache[s] = le32(b, 16 + 4 * s);
        bk.off[s] = le64(b, 32 + 8 * s);
    }
    bk
}

/// Bytes a leaf with this header occupies (header included), from its first 64 bytes.
pub fn leaf_len(header: &[u8]) -> Result<usize, String> {
    if header.len() < LEAF_HEADER || &header[0..8] != LEAF_MAGIC {
        return Err("not a LightKV PM leaf (bad magic)".into());
    }
    let n = le32(header, 20) as usize;
    if n == 0 || n > 1 << 20 {
        return Err(format!("PM leaf claims {n} buckets"));
    }
    Ok(LEAF_HEADER + n * 64)
}

/// Decode a leaf written by [`encode_leaf`].
pub fn decode_leaf(b: &[u8]) -> Result<(Leaf, LeafMeta), String> {
    let len = leaf_len(b)?;
    if b.len() < len {
        return Err(format!("PM leaf of {len} bytes is cut short at {}", b.len()));
    }
    if le32(b, 60) != crc::masked_parts(&[&b[0..60], &b[LEAF_HEADER..len]]) {
        return Err("PM leaf checksum mismatch".into());
    }
    let v = le32(b, 8);
    if v != VERSION {
        return Err(format!("unsupported PM leaf version {v}"));
    }
    let (normal, depth, n) = (le32(b, 12) as usize, le32(b, 16) as usize, le32(b, 20) as usize);
    let buckets = (0..n).map(|i| decode_bucket(&b[LEAF_HEADER + i * 64..LEAF_HEADER + i * 64 + 64])).collect();
    let leaf = Leaf::from_buckets(buckets, normal, depth).ok_or("PM leaf geometry does not add up")?;
    Ok((leaf, LeafMeta { table: le64(b, 24), cw: le32(b, 32), seq_hi: le64(b, 36) }))
}

/// A partition's chain record: where it sits and its PM leaves, newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// The partition's place in the radix tree.
    pub desc: PartitionDesc,
    /// PM addresses of its leaves, newest first.
    pub leaves: Vec<u64>,
}

/// Encode a chain record.
pub fn encode_chain(c: &Chain) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + c.desc.prefix.len() + c.desc.values.len() + 8 * c.leaves.len());
    out.extend_from_slice(CHAIN_MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(u8::from(c.desc.end));
    out.extend_from_slice(&(c.desc.prefix.len() as u16).to_le_bytes());
    out.extend_from_slice(&(c.desc.values.len() as u16).to_le_bytes());
    out.extend_from_slice(&c.desc.prefix);
    out.extend_from_slice(&c.desc.values);
    out.extend_from_slice(&(c.leaves.len() as u32).to_le_bytes());
    for a in &c.leaves {
        out.extend_from_slice(&a.to_le_bytes());
    }
    let cr = crc::masked(&out);
    out.extend_from_slice(&cr.to_le_bytes());
    out
}

/// Decode a chain record from the start of `b`; returns it and its length.
pub fn decode_chain(b: &[u8]) -> Result<(Chain, usize), String> {
    let short = || "chain record cut short".to_string();
    if b.len() < 17 || &b[0..8] != CHAIN_MAGIC {
        return Err("not a LightKV chain record (bad magic)".into());
    }
    let plen = u16::from_le_bytes([b[13], b[14]]) as usize;
    let vlen = u16::from_le_bytes([b[15], b[16]]) as usize;
    let at = 17 + plen + vlen;
    let n = b.get(at..at + 4).map(|x| le32(x, 0) as usize).ok_or_else(short)?;
    let end = at.checked_add(4).and_then(|x| x.checked_add(n.checked_mul(8)?)).ok_or_else(short)?;
    let stored = b.get(end..end + 4).map(|x| le32(x, 0)).ok_or_else(short)?;
    if stored != crc::masked(&b[..end]) {
        return Err("chain record checksum mismatch".into());
    }
    let v = le32(b, 8);
    if v != VERSION {
        return Err(format!("unsupported chain record version {v}"));
    }
    let is_end = match b[12] {
        0 => false,
        1 => true,
        x => return Err(format!("chain record end flag {x}")),
    };
    let desc = PartitionDesc { prefix: b[17..17 + plen].to_vec(), values: b[17 + plen..at].to_vec(), end: is_end };
    let leaves = (0..n).map(|i| le64(b, at + 4 + 8 * i)).collect();
    Ok((Chain { desc, leaves }, end + 4))
}

/// The clean-shutdown image of the DRAM part of the index (§V: "a clean shutdown persists
/// the DRAM part so restart is instant"): every partition's place and top leaf, its active
/// segment, and every segment's write position.
///
/// ```text
/// image: magic "TKVLKIMG" | version u32 = 1 | len u64 (whole image) | next_seq u64
///        | segments u32 | partitions u32
///        | segments × (addr u64 | write position u64)
///        | partitions × (end u8 | prefix len u16 | values u16 | prefix | values
///                         | active segment u64 (0 = none) | leaf len u32 | leaf (as a PM leaf))
///        | crc u32 (all before)
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// The next write-buffer sequence number.
    pub next_seq: u64,
    /// Segment base addresses and write positions.
    pub segments: Vec<(u64, u64)>,
    /// Partitions: place, active segment (0 = none), top leaf.
    pub partitions: Vec<(PartitionDesc, u64, Leaf)>,
}

/// Bytes of the image header (magic .. partitions).
pub const IMAGE_HEADER: usize = 36;
const IMAGE_MAGIC: &[u8; 8] = b"TKVLKIMG";

/// Encode an image.
pub fn encode_image(img: &Image) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(IMAGE_MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    out.extend_from_slice(&img.next_seq.to_le_bytes());
    out.extend_from_slice(&(img.segments.len() as u32).to_le_bytes());
    out.extend_from_slice(&(img.partitions.len() as u32).to_le_bytes());
    for (a, pos) in &img.segments {
        out.extend_from_slice(&a.to_le_bytes());
        out.extend_from_slice(&pos.to_le_bytes());
    }
    for (d, active, leaf) in &img.partitions {
        out.push(u8::from(d.end));
        out.extend_from_slice(&(d.prefix.len() as u16).to_le_bytes());
        out.extend_from_slice(&(d.values.len() as u16).to_le_bytes());
        out.extend_from_slice(&d.prefix);
        out.extend_from_slice(&d.values);
        out.extend_from_slice(&active.to_le_bytes());
        let lb = encode_leaf(leaf, leaf.normal(), LeafMeta { table: 0, cw: 0, seq_hi: 0 });
        out.extend_from_slice(&(lb.len() as u32).to_le_bytes());
        out.extend_from_slice(&lb);
    }
    let len = (out.len() + 4) as u64;
    out[12..20].copy_from_slice(&len.to_le_bytes());
    let c = crc::masked(&out);
    out.extend_from_slice(&c.to_le_bytes());
    out
}

/// The image's total length from its header.
pub fn image_len(h: &[u8]) -> Result<usize, String> {
    if h.len() < IMAGE_HEADER || &h[0..8] != IMAGE_MAGIC {
        return Err("not a LightKV index image (bad magic)".into());
    }
    let len = le64(h, 12);
    if len < IMAGE_HEADER as u64 + 4 || len > 1 << 40 {
        return Err(format!("index image claims {len} bytes"));
    }
    Ok(len as usize)
}

/// Decode an image written by [`encode_image`].
pub fn decode_image(b: &[u8]) -> Result<Image, String> {
    let len = image_len(b)?;
    if b.len() < len {
        return Err(format!("index image of {len} bytes is cut short at {}", b.len()));
    }
    if le32(b, len - 4) != crc::masked(&b[..len - 4]) {
        return Err("index image checksum mismatch".into());
    }
    let v = le32(b, 8);
    if v != VERSION {
        return Err(format!("unsupported index image version {v}"));
    }
    let body = &b[..len - 4];
    let short = || "index image is malformed (field past its end)".to_string();
    let mut c = crate::format::Cursor::new(body);
    c.bytes(20).ok_or_else(short)?;
    let next_seq = c.u64().ok_or_else(short)?;
    let nseg = c.u32().ok_or_else(short)? as usize;
    let npart = c.u32().ok_or_else(short)? as usize;
    if nseg > body.len() / 16 || npart > body.len() / 9 {
        return Err(format!("index image claims {nseg} segments and {npart} partitions"));
    }
    let mut segments = Vec::with_capacity(nseg);
    for _ in 0..nseg {
        segments.push((c.u64().ok_or_else(short)?, c.u64().ok_or_else(short)?));
    }
    let mut partitions = Vec::with_capacity(npart);
    for _ in 0..npart {
        let end = c.u8().ok_or_else(short)? != 0;
        let plen = c.u16().ok_or_else(short)? as usize;
        let nv = c.u16().ok_or_else(short)? as usize;
        let prefix = c.bytes(plen).ok_or_else(short)?.to_vec();
        let values = c.bytes(nv).ok_or_else(short)?.to_vec();
        let active = c.u64().ok_or_else(short)?;
        let ll = c.u32().ok_or_else(short)? as usize;
        let (leaf, _) = decode_leaf(c.bytes(ll).ok_or_else(short)?)?;
        partitions.push((PartitionDesc { prefix, values, end }, active, leaf));
    }
    if c.remaining() != 0 {
        return Err("index image has trailing bytes".into());
    }
    Ok(Image { next_seq, segments, partitions })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::index::rhtree::{Insert, RhOptions, RhTree};

    #[test]
    fn image_golden_bytes_round_trip_and_damage() {
        let img = Image {
            next_seq: 9,
            segments: vec![(4096, 200)],
            partitions: vec![(
                PartitionDesc { prefix: b"a".to_vec(), values: vec![0, 1], end: false },
                4096,
                Leaf::new(1, 1),
            )],
        };
        let b = encode_image(&img);
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        // Computed independently (Python, crc32c): header, one segment, one partition with an
        // empty two-bucket leaf, crc.
        let want = format!(
            "544b564c4b494d47010000000c01000000000000090000000000000001000000010000000010000000000000c800000000000000\
             00010002006100010010000000000000c0000000\
             544b564c4b4c454601000000010000000100000002000000{}a484c8d7{}3cad9c8d",
            "00".repeat(36),
            "00".repeat(128)
        );
        assert_eq!(hex, want);
        assert_eq!(image_len(&b), Ok(b.len()));
        assert_eq!(decode_image(&b), Ok(img));
        for i in [0, 9, 13, 30, 60, b.len() / 2, b.len() - 1] {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(decode_image(&bad).is_err(), "damage at {i} went unnoticed");
        }
        assert!(decode_image(&b[..b.len() - 1]).is_err());
    }

    #[test]
    fn leaves_and_chains_round_trip_and_reject_damage() {
        let keys: Vec<Vec<u8>> = (0..40u32).map(|i| format!("k{i}").into_bytes()).collect();
        let src = |off: u64| -> crate::Result<Vec<u8>> { Ok(keys[off as usize].clone()) };
        let mut t = RhTree::new(RhOptions { leaf_buckets: 8, t_normal: 4, max_leaf_nodes: 2 });
        for (i, k) in keys.iter().enumerate() {
            while let Insert::Full(p) = t.insert(k, i as u64, &src).unwrap() {
                t.link(p);
            }
        }
        let p = t.route(b"k1").unwrap();
        let top = t.partition(p).top.read();
        let leaf = &*top;
        let meta = LeafMeta { table: 12, cw: 2, seq_hi: 99 };
        let enc = encode_leaf(leaf, 8, meta);
        assert_eq!(leaf_len(&enc).unwrap(), enc.len());
        let (back, m) = decode_leaf(&enc).unwrap();
        assert_eq!((&back, m), (leaf, meta));
        assert_eq!(back.get(b"k1", &src).unwrap(), leaf.get(b"k1", &src).unwrap());
        for i in [0, 9, 25, 60, 64, 100, enc.len() - 1] {
            let mut bad = enc.clone();
            bad[i] ^= 0x10;
            assert!(decode_leaf(&bad).is_err(), "flip at {i} undetected");
        }
        assert!(decode_leaf(&enc[..enc.len() - 1]).is_err());

        let c = Chain { desc: t.descriptor(p), leaves: vec![4096, 8192] };
        let e = encode_chain(&c);
        assert_eq!(decode_chain(&e).unwrap(), (c.clone(), e.len()));
        let golden =
            Chain { desc: PartitionDesc { prefix: b"a".to_vec(), values: vec![0, 1], end: false }, leaves: vec![64] };
        let hex: String = encode_chain(&golden).iter().map(|x| format!("{x:02x}")).collect();
        // Checked against an independent crc32c.
        assert_eq!(hex, "544b564c4b43484e0100000000010002006100010100000040000000000000001a44c888");
        for i in 0..e.len() {
            let mut bad = e.clone();
            bad[i] ^= 0x01;
            assert!(decode_chain(&bad).is_err(), "flip at {i} undetected");
        }
    }
}
