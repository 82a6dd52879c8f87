//! Fixed PM layout of an SLM-DB store in pool 0 (docs/format/slmdb.md): superblock, two
//! root slots, the B+-tree anchor; the heap follows.

use crate::format::{crc, Cursor};
use crate::pm::POOL_HEADER_LEN;

/// Format version of the SLM-DB PM layout. Bump on any incompatible change. 2: leaf
/// records name their entry's offset in the block (`docs/format/slmdb.md`); a version-1
/// store is upgraded at open ([`decode_superblock`] accepts both).
pub const FORMAT_VERSION: u32 = 2;
/// The oldest version this code opens.
pub const OLDEST_VERSION: u32 = 1;
/// Superblock address.
pub const SUPERBLOCK_ADDR: u64 = POOL_HEADER_LEN;
/// The two root slots.
pub const ROOT_SLOTS: [u64; 2] = [128, 192];
/// The B+-tree anchor line.
pub const ANCHOR_ADDR: u64 = 256;
/// First heap byte of pool 0.
pub const HEAP_START: u64 = 320;
const SUPER_MAGIC: &[u8; 8] = b"TKVSLMDB";
const ROOT_MAGIC: &[u8; 4] = b"ROOT";

/// Encode the superblock (64 bytes): `magic[8] | version u32 | 0 u32 | memtable_size u64 |
/// 0 ×36 | crc u32` (crc over the first 60 bytes).
pub fn encode_superblock(memtable_size: u64) -> [u8; 64] {
    encode_superblock_version(memtable_size, FORMAT_VERSION)
}

/// [`encode_superblock`] with another version (tests of older stores).
pub fn encode_superblock_version(memtable_size: u64, version: u32) -> [u8; 64] {
    let mut b = [0u8; 64];
    b[0..8].copy_from_slice(SUPER_MAGIC);
    b[8..12].copy_from_slice(&version.to_le_bytes());
    b[16..24].copy_from_slice(&memtable_size.to_le_bytes());
    let c = crc::masked(&b[..60]);
    b[60..64].copy_from_slice(&c.to_le_bytes());
    b
}

/// Decode the superblock: the memtable size it was created with, and its format version
/// (from [`OLDEST_VERSION`] to [`FORMAT_VERSION`]).
pub fn decode_superblock(b: &[u8]) -> Result<(u64, u32), String> {
    let mut c = Cursor::new(b);
    if c.bytes(8) != Some(SUPER_MAGIC.as_slice()) {
        return Err("bad SLM-DB superblock magic".into());
    }
    let stored = u32::from_le_bytes(b.get(60..64).and_then(|s| s.try_into().ok()).unwrap_or([0; 4]));
    if crc::masked(b.get(..60).unwrap_or(&[])) != stored {
        return Err("SLM-DB superblock checksum mismatch".into());
    }
    let v = c.u32().ok_or("short superblock")?;
    if !(OLDEST_VERSION..=FORMAT_VERSION).contains(&v) {
        return Err(format!("unsupported SLM-DB format version {v}"));
    }
    c.skip(4);
    Ok((c.u64().ok_or("short superblock")?, v))
}

/// The root record: where the memtables and the compaction log are. Written into the
/// older of two slots and persisted; the valid slot with the higher generation is current.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Root {
    /// Update counter.
    pub gen: u64,
    /// Arena of the MemTable (0 = none).
    pub active: u64,
    /// Arena of the Immutable MemTable (0 = none).
    pub imm: u64,
    /// First segment of the compaction log (0 = no job in flight).
    pub log: u64,
    /// Generation the next memtable gets.
    pub next_mem_gen: u64,
    /// First segment of the flush's compaction log (0 = no flush in flight). A flush may
    /// run while a compaction is in flight (as LevelDB flushes its Immutable MemTable in the
    /// middle of a compaction), so each has its own log.
    pub flush_log: u64,
}

impl Root {
    /// `magic[4] | crc u32 | gen u64 | active u64 | imm u64 | log u64 | next_mem_gen u64 |
    /// flush_log u64 | 0 ×8` (crc over bytes 8..56).
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..4].copy_from_slice(ROOT_MAGIC);
        for (i, v) in [self.gen, self.active, self.imm, self.log, self.next_mem_gen, self.flush_log].iter().enumerate()
        {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        let c = crc::masked(&b[8..56]);
        b[4..8].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Decode a slot; `None` when it holds no valid record.
    pub fn decode(b: &[u8]) -> Option<Root> {
        let mut c = Cursor::new(b);
        if c.bytes(4)? != ROOT_MAGIC {
            return None;
        }
        let stored = c.u32()?;
        if crc::masked(b.get(8..56)?) != stored {
            return None;
        }
        Some(Root {
            gen: c.u64()?,
            active: c.u64()?,
            imm: c.u64()?,
            log: c.u64()?,
            next_mem_gen: c.u64()?,
            flush_log: c.u64()?,
        })
    }
}
