//! The `OPTIONS` record: which preset a directory holds, its identity, and whether its
//! creation finished (docs/format/options.md).

use crate::format::{crc, Cursor};
use crate::options::Preset;

/// File name inside the store directory.
pub const OPTIONS_FILE: &str = "OPTIONS";
const MAGIC: &[u8; 8] = b"TIERKVDB";
const VERSION: u32 = 1;
/// Encoded size.
pub const RECORD_LEN: usize = 32;

/// Creation state. Never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// 1: the store is being created; its PM and files may be incomplete and are laid out
    /// afresh at the next open.
    Creating,
    /// 2: the store exists; missing PM or files are an error.
    Ready,
}

/// The decoded record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionsRecord {
    /// The preset.
    pub preset: Preset,
    /// Random identity, also written into every PM pool header.
    pub db_id: u64,
    /// Creation state.
    pub state: RecordState,
}

impl OptionsRecord {
    /// 32 bytes.
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[0..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.preset.id().to_le_bytes());
        b[16..24].copy_from_slice(&self.db_id.to_le_bytes());
        let state: u32 = match self.state {
            RecordState::Creating => 1,
            RecordState::Ready => 2,
        };
        b[24..28].copy_from_slice(&state.to_le_bytes());
        let c = crc::masked(&b[0..28]);
        b[28..32].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Decode; the error carries the offset of the bad field and what is wrong.
    pub fn decode(b: &[u8]) -> Result<OptionsRecord, (u64, String)> {
        let mut c = Cursor::new(b);
        let short = || (b.len() as u64, format!("record is {} bytes, expected {RECORD_LEN}", b.len()));
        if b.len() != RECORD_LEN {
            return Err(short());
        }
        if c.bytes(8).ok_or_else(short)? != MAGIC {
            return Err((0, "not a tierkv OPTIONS file (bad magic)".into()));
        }
        let version = c.u32().ok_or_else(short)?;
        let preset = c.u32().ok_or_else(short)?;
        let db_id = c.u64().ok_or_else(short)?;
        let state = c.u32().ok_or_else(short)?;
        let stored = c.u32().ok_or_else(short)?;
        if stored != crc::masked(b.get(0..28).ok_or_else(short)?) {
            return Err((28, "checksum mismatch".into()));
        }
        if version != VERSION {
            return Err((8, format!("unsupported OPTIONS version {version}")));
        }
        let preset = Preset::from_id(preset).ok_or((12, format!("unknown preset id {preset}")))?;
        let state = match state {
            1 => RecordState::Creating,
            2 => RecordState::Ready,
            s => return Err((24, format!("unknown state {s}"))),
        };
        Ok(OptionsRecord { preset, db_id, state })
    }
}
