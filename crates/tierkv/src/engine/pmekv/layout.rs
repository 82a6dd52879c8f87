//! Byte layouts of every PMEKV structure in PM (docs/format/pmekv.md is the reference;
//! the golden-bytes tests pin these encoders to it).
//!
//! All integers are little-endian. All checksums are masked crc32c ([`crate::format::crc`]).
//! Everything that is allocated starts on a 64-byte line.

use crate::format::{align_up, crc, Cursor};
use crate::pm::{LINE, POOL_HEADER_LEN};

/// Format version of the PMEKV layout. Bump on any incompatible change.
pub const FORMAT_VERSION: u32 = 1;

/// Superblock: right after the pool header of pool 0.
pub const SUPERBLOCK_ADDR: u64 = POOL_HEADER_LEN;
/// The two checkpoint slots.
pub const CKPT_SLOT_ADDR: [u64; 2] = [128, 192];
/// Where the KV log starts in pool 0.
pub const LOGS_START: u64 = 4096;
const SUPER_MAGIC: &[u8; 8] = b"TKVPMEKV";
const CKPT_MAGIC: &[u8; 4] = b"CKPT";
const KN_MAGIC: &[u8; 4] = b"KNOD";
const DIR_MAGIC: &[u8; 4] = b"KDIR";

/// Operation codes, equal to the paper's non-zero KVFlag/KFlag values. Never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// 1: insertion of a new key.
    Insert = 1,
    /// 2: deletion.
    Delete = 2,
    /// 3: update of an existing key.
    Update = 3,
}

impl Op {
    fn from_u8(v: u8) -> Option<Op> {
        match v {
            1 => Some(Op::Insert),
            2 => Some(Op::Delete),
            3 => Some(Op::Update),
            _ => None,
        }
    }
}

/// Which log an entry belongs to (mixed into its checksum so entries cannot be confused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum LogKind {
    /// The key-value log (first tier).
    KeyValue = 1,
    /// The key log (second tier).
    Key = 2,
}

/// Geometry recorded in the superblock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    /// Format version.
    pub version: u32,
    /// Preset id (5 = pmekv).
    pub preset: u32,
    /// KV log ring.
    pub kv_log: (u64, u64),
    /// Key log ring.
    pub key_log: (u64, u64),
    /// First heap byte in pool 0.
    pub heap_start: u64,
}

impl Superblock {
    /// Geometry for new stores.
    pub fn new(kv_log_len: u64, key_log_len: u64) -> Self {
        let kv = (LOGS_START, kv_log_len);
        let key = (LOGS_START + kv_log_len, key_log_len);
        Superblock {
            version: FORMAT_VERSION,
            preset: 5,
            kv_log: kv,
            key_log: key,
            heap_start: align_up(key.0 + key.1, 4096),
        }
    }

    /// 64 bytes.
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(SUPER_MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.preset.to_le_bytes());
        b[16..24].copy_from_slice(&self.kv_log.0.to_le_bytes());
        b[24..32].copy_from_slice(&self.kv_log.1.to_le_bytes());
        b[32..40].copy_from_slice(&self.key_log.0.to_le_bytes());
        b[40..48].copy_from_slice(&self.key_log.1.to_le_bytes());
        b[48..56].copy_from_slice(&self.heap_start.to_le_bytes());
        let c = crc::masked(&b[0..56]);
        b[56..60].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Decode; `Err` says what is wrong.
    pub fn decode(b: &[u8]) -> Result<Superblock, String> {
        let mut c = Cursor::new(b);
        let magic = c.bytes(8).ok_or("short superblock")?;
        if magic != SUPER_MAGIC {
            return Err("not a pmekv store (bad superblock magic)".into());
        }
        let version = c.u32().ok_or("short superblock")?;
        let preset = c.u32().ok_or("short superblock")?;
        let kv = (c.u64().ok_or("short")?, c.u64().ok_or("short")?);
        let key = (c.u64().ok_or("short")?, c.u64().ok_or("short")?);
        let heap_start = c.u64().ok_or("short")?;
        let stored = c.u32().ok_or("short")?;
        if stored != crc::masked(b.get(0..56).ok_or("short")?) {
            return Err("superblock checksum mismatch".into());
        }
        if version != FORMAT_VERSION {
            return Err(format!("unsupported pmekv format version {version} (this build reads {FORMAT_VERSION})"));
        }
        if kv.0 != LOGS_START
            || key.0 != kv.0 + kv.1
            || heap_start < key.0 + key.1
            || !kv.1.is_multiple_of(LINE)
            || !key.1.is_multiple_of(LINE)
        {
            return Err("superblock geometry is inconsistent".into());
        }
        Ok(Superblock { version, preset, kv_log: kv, key_log: key, heap_start })
    }
}

/// A checkpoint record: which KeyNodes make up the last written-back index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Checkpoint {
    /// Increases by one per checkpoint; the valid slot with the larger one wins.
    pub generation: u64,
    /// Every operation with sequence number <= `seq` is reflected in the KeyNodes.
    pub seq: u64,
    /// Address of the KeyNode directory.
    pub dir_addr: u64,
    /// Allocated bytes of the directory.
    pub dir_bytes: u64,
    /// Number of KeyNodes.
    pub kn_count: u64,
    /// Number of keys.
    pub key_count: u64,
}

impl Checkpoint {
    /// 64 bytes.
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..4].copy_from_slice(CKPT_MAGIC);
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.dir_addr.to_le_bytes());
        b[32..40].copy_from_slice(&self.dir_bytes.to_le_bytes());
        b[40..48].copy_from_slice(&self.kn_count.to_le_bytes());
        b[48..56].copy_from_slice(&self.key_count.to_le_bytes());
        let c = crc::masked(&b[8..64]);
        b[4..8].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Decode; `None` for an invalid (never written or torn) slot.
    pub fn decode(b: &[u8]) -> Option<Checkpoint> {
        let mut c = Cursor::new(b);
        if c.bytes(4)? != CKPT_MAGIC {
            return None;
        }
        let stored = c.u32()?;
        if stored != crc::masked(b.get(8..64)?) {
            return None;
        }
        Some(Checkpoint {
            generation: c.u64()?,
            seq: c.u64()?,
            dir_addr: c.u64()?,
            dir_bytes: c.u64()?,
            kn_count: c.u64()?,
            key_count: c.u64()?,
        })
    }
}

/// Header bytes of a value record.
pub const VALUE_HEADER: u64 = 8;

/// Allocation size of a value record holding `len` bytes.
pub fn value_alloc_size(len: usize) -> u64 {
    align_up(VALUE_HEADER + len as u64, LINE)
}

/// Encode the 8-byte header of the value record of `key`.
///
/// The checksum covers the key (which is not stored in the record) as well as the length
/// and the value, so a pointer that reaches another key's value — for instance through
/// space reused after a stale checkpoint — can never verify.
pub fn value_header(key: &[u8], value: &[u8]) -> [u8; 8] {
    let len = (value.len() as u32).to_le_bytes();
    let klen = (key.len() as u32).to_le_bytes();
    let c = crc::masked_parts(&[&klen, key, &len, value]);
    let mut h = [0u8; 8];
    h[0..4].copy_from_slice(&c.to_le_bytes());
    h[4..8].copy_from_slice(&len);
    h
}

/// Verify the value record of `key` (`rec` = header + value); returns the value or what is
/// wrong.
pub fn value_verify<'a>(rec: &'a [u8], key: &[u8], expect_len: u32) -> Result<&'a [u8], String> {
    let mut c = Cursor::new(rec);
    let stored = c.u32().ok_or("short value record")?;
    let len = c.u32().ok_or("short value record")?;
    if len != expect_len {
        return Err(format!("value record holds {len} bytes, index says {expect_len}"));
    }
    let value = c.bytes(len as usize).ok_or("value record runs past its allocation")?;
    let klen = (key.len() as u32).to_le_bytes();
    if stored != crc::masked_parts(&[&klen, key, &len.to_le_bytes(), value]) {
        return Err("value checksum mismatch (damaged, or not this key's value)".into());
    }
    Ok(value)
}

/// Fixed bytes of a log entry before the key.
pub const LOG_ENTRY_HEADER: u64 = 48;

/// A decoded log entry (either tier).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// Sequence number.
    pub seq: u64,
    /// Operation.
    pub op: Op,
    /// Value address (0 for deletes).
    pub value_addr: u64,
    /// Value length.
    pub value_len: u32,
    /// Entries in the batch this entry belongs to (KV log), 1 in the key log.
    pub batch_len: u32,
    /// Index of this entry in its batch.
    pub batch_index: u32,
    /// The key.
    pub key: Vec<u8>,
}

impl LogEntry {
    /// Bytes this entry occupies in its ring.
    pub fn size(key_len: usize) -> u64 {
        align_up(LOG_ENTRY_HEADER + key_len as u64, LINE)
    }

    /// Encode with its flag word set to the op (the paper's "not yet done" state).
    pub fn encode(&self, kind: LogKind) -> Vec<u8> {
        let mut b = vec![0u8; Self::size(self.key.len()) as usize];
        b[0] = self.op as u8;
        b[12..16].copy_from_slice(&(self.key.len() as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.value_addr.to_le_bytes());
        b[32..36].copy_from_slice(&self.value_len.to_le_bytes());
        b[36..40].copy_from_slice(&self.batch_len.to_le_bytes());
        b[40..44].copy_from_slice(&self.batch_index.to_le_bytes());
        b[44] = self.op as u8;
        let end = LOG_ENTRY_HEADER as usize + self.key.len();
        b[48..end].copy_from_slice(&self.key);
        let c = crc::masked_parts(&[&[kind as u8], &b[12..end]]);
        b[8..12].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Decode the entry at the start of `b` (which runs to the end of the ring).
    /// Returns the entry and its flag, or `None` if no valid entry starts here.
    pub fn decode(b: &[u8], kind: LogKind) -> Option<(LogEntry, u8)> {
        let mut c = Cursor::new(b);
        let flag = c.u64()?;
        let stored = c.u32()?;
        let key_len = c.u32()? as usize;
        if key_len > crate::options::MAX_KEY_SIZE {
            return None;
        }
        let end = LOG_ENTRY_HEADER as usize + key_len;
        let covered = b.get(12..end)?;
        if stored != crc::masked_parts(&[&[kind as u8], covered]) {
            return None;
        }
        let seq = c.u64()?;
        let value_addr = c.u64()?;
        let value_len = c.u32()?;
        let batch_len = c.u32()?;
        let batch_index = c.u32()?;
        let op = Op::from_u8(c.u8()?)?;
        c.skip(3)?;
        let key = c.bytes(key_len)?.to_vec();
        let entry = LogEntry { seq, op, value_addr, value_len, batch_len, batch_index, key };
        Some((entry, (flag & 0xff) as u8))
    }
}

/// One entry of a KeyNode: key → value location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValueRef {
    /// Address of the value record.
    pub addr: u64,
    /// Value length in bytes.
    pub len: u32,
}

/// Encode a KeyNode holding `entries` (sorted). Returns the bytes (64-byte multiple).
pub fn keynode_encode<'a>(entries: impl Iterator<Item = (&'a [u8], ValueRef)>, count: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + count * 32);
    b.extend_from_slice(KN_MAGIC);
    b.extend_from_slice(&[0u8; 4]);
    b.extend_from_slice(&(count as u32).to_le_bytes());
    b.extend_from_slice(&[0u8; 4]);
    for (k, v) in entries {
        b.extend_from_slice(&(k.len() as u16).to_le_bytes());
        b.extend_from_slice(k);
        b.extend_from_slice(&v.addr.to_le_bytes());
        b.extend_from_slice(&v.len.to_le_bytes());
    }
    let total = b.len() as u32;
    b[12..16].copy_from_slice(&total.to_le_bytes());
    let c = crc::masked(&b[8..]);
    b[4..8].copy_from_slice(&c.to_le_bytes());
    b.resize(align_up(b.len() as u64, LINE) as usize, 0);
    b
}

/// Entries of a KeyNode (or LeadNode): keys with their value locations.
pub type NodeEntries = Vec<(Box<[u8]>, ValueRef)>;

/// Decode a KeyNode from `b` (its allocation). Returns its entries in order.
pub fn keynode_decode(b: &[u8]) -> Result<NodeEntries, String> {
    let mut c = Cursor::new(b);
    if c.bytes(4).ok_or("short KeyNode")? != KN_MAGIC {
        return Err("bad KeyNode magic".into());
    }
    let stored = c.u32().ok_or("short KeyNode")?;
    let count = c.u32().ok_or("short KeyNode")? as usize;
    let total = c.u32().ok_or("short KeyNode")? as usize;
    let body = b.get(8..total).ok_or("KeyNode length runs past its allocation")?;
    if stored != crc::masked(body) {
        return Err("KeyNode checksum mismatch".into());
    }
    // Each entry takes at least 14 bytes (klen, addr, len): a count the body cannot hold is
    // refused before anything is allocated for it (fuzzing found a checksummed count of
    // 2^31 that made the decoder ask for 34 GB).
    if count > body.len() / 14 {
        return Err(format!("KeyNode claims {count} entries in {} bytes", body.len()));
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let kl = c.u16().ok_or("KeyNode entry truncated")? as usize;
        let key = c.bytes(kl).ok_or("KeyNode entry truncated")?;
        let addr = c.u64().ok_or("KeyNode entry truncated")?;
        let len = c.u32().ok_or("KeyNode entry truncated")?;
        out.push((Box::from(key), ValueRef { addr, len }));
    }
    if c.pos() != total {
        return Err("KeyNode entries do not fill its length".into());
    }
    Ok(out)
}

/// Encode the KeyNode directory: the KeyNodes of a checkpoint, in key order.
pub fn dir_encode(kns: &[(u64, u32)]) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + kns.len() * 16);
    b.extend_from_slice(DIR_MAGIC);
    b.extend_from_slice(&[0u8; 4]);
    b.extend_from_slice(&(kns.len() as u64).to_le_bytes());
    for (addr, bytes) in kns {
        b.extend_from_slice(&addr.to_le_bytes());
        b.extend_from_slice(&bytes.to_le_bytes());
        b.extend_from_slice(&[0u8; 4]);
    }
    let c = crc::masked(&b[8..]);
    b[4..8].copy_from_slice(&c.to_le_bytes());
    b.resize(align_up(b.len() as u64, LINE) as usize, 0);
    b
}

/// Decode a directory of `count` KeyNodes from `b`.
pub fn dir_decode(b: &[u8], count: u64) -> Result<Vec<(u64, u32)>, String> {
    let mut c = Cursor::new(b);
    if c.bytes(4).ok_or("short directory")? != DIR_MAGIC {
        return Err("bad KeyNode directory magic".into());
    }
    let stored = c.u32().ok_or("short directory")?;
    let n = c.u64().ok_or("short directory")?;
    if n != count {
        return Err(format!("directory lists {n} KeyNodes, checkpoint says {count}"));
    }
    let len = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_mul(16))
        .and_then(|x| x.checked_add(16))
        .ok_or("directory too large")?;
    let body = b.get(8..len).ok_or("directory runs past its allocation")?;
    if stored != crc::masked(body) {
        return Err("directory checksum mismatch".into());
    }
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let addr = c.u64().ok_or("short directory")?;
        let bytes = c.u32().ok_or("short directory")?;
        c.skip(4).ok_or("short directory")?;
        out.push((addr, bytes));
    }
    Ok(out)
}

/// Size of a directory allocation for `n` KeyNodes.
pub fn dir_alloc_size(n: usize) -> u64 {
    align_up(16 + 16 * n as u64, LINE)
}
