//! SLM-DB's compaction log in PM (§3.3, §5): what an in-flight flush or compaction has done
//! to the B+-tree, so recovery can make the tree and the live-key counts consistent.
//!
//! # Layout (docs/format/slmdb.md, "Compaction log")
//! A log is a chain of segments allocated from the PM heap. A segment starts with a 64-byte
//! header `magic u64 | log id u64 | next segment u64 | size u64 | crc u32` (crc over magic,
//! id and size; `next` is an 8-byte pointer stored after the next segment is persisted),
//! followed by entries `crc u32 | type u8 | 0 u8 | klen u16 | a u64 | log id u64 | key`,
//! 8-byte aligned, each persisted before the change it describes. The log id (unique per
//! log) is part of every entry's checksum, so bytes left in reused PM by an older log never
//! read as entries of this one; the first entry that fails its checksum ends the log (a
//! torn append is the tail).
//!
//! Entry types (never renumber): 1 `Begin` (`a` = kind: 1 flush, 2 compaction; key = the
//! flushed memtable generation as 8 bytes for a flush), 2 `Input` (`a` = file), 3 `Output`
//! (`a` = file), 4 `Moved` (`a` = the key's old file, key = the key).

use parking_lot::Mutex;

use crate::error::Result;
use crate::format::{crc, Cursor};
use crate::pm::heap::{alloc_or_grow, Heap};
use crate::pm::Region;

/// Segment magic.
pub const SEG_MAGIC: u64 = 0x474f_4c50_4d4f_434c; // "LCOMPLOG"
/// Default segment size.
pub const SEG_SIZE: u64 = 64 << 10;
/// Entry header bytes.
pub const ENTRY_HEADER: u64 = 24;

/// What an entry records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogEntry {
    /// The log's purpose: flush of memtable `gen`, or a compaction.
    Begin(Job),
    /// A file being merged.
    Input(u64),
    /// A new file written by the job.
    Output(u64),
    /// `key` moved away from `old_file` (its tree entry changes or goes).
    Moved(u64, Vec<u8>),
}

/// The job a log belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// Flush of the memtable of this generation.
    Flush(u64),
    /// Selective compaction.
    Compaction,
}

/// Encode a segment header.
pub fn encode_seg_header(id: u64, size: u64) -> [u8; 64] {
    let mut h = [0u8; 64];
    h[0..8].copy_from_slice(&SEG_MAGIC.to_le_bytes());
    h[8..16].copy_from_slice(&id.to_le_bytes());
    h[24..32].copy_from_slice(&size.to_le_bytes());
    let c = crc::masked_parts(&[&h[0..16], &h[24..32]]);
    h[32..36].copy_from_slice(&c.to_le_bytes());
    h
}

/// Encode an entry of log `id`.
pub fn encode_entry(id: u64, e: &LogEntry) -> Vec<u8> {
    let (ty, a, key): (u8, u64, Vec<u8>) = match e {
        LogEntry::Begin(Job::Flush(g)) => (1, 1, g.to_le_bytes().to_vec()),
        LogEntry::Begin(Job::Compaction) => (1, 2, Vec::new()),
        LogEntry::Input(f) => (2, *f, Vec::new()),
        LogEntry::Output(f) => (3, *f, Vec::new()),
        LogEntry::Moved(f, k) => (4, *f, k.clone()),
    };
    let mut b = Vec::with_capacity(ENTRY_HEADER as usize + key.len() + 8);
    b.extend_from_slice(&[0; 4]);
    b.push(ty);
    b.push(0);
    b.extend_from_slice(&(key.len() as u16).to_le_bytes());
    b.extend_from_slice(&a.to_le_bytes());
    b.extend_from_slice(&id.to_le_bytes());
    b.extend_from_slice(&key);
    let c = crc::masked(b.get(4..).unwrap_or(&[]));
    if let Some(s) = b.get_mut(0..4) {
        s.copy_from_slice(&c.to_le_bytes());
    }
    let len = b.len().div_ceil(8) * 8;
    b.resize(len, 0);
    b
}

/// Segments of a log: (address, size).
pub type Segments = Vec<(u64, u64)>;

/// An open log being appended to.
#[derive(Debug)]
pub struct CompLog {
    /// First segment (what the root points at).
    pub head: u64,
    id: u64,
    segs: Vec<(u64, u64)>,
    tail: u64,
    tail_end: u64,
}

impl CompLog {
    /// Start a log with its `Begin` entry. It becomes live when the caller stores `head`
    /// into the root.
    pub fn begin(r: &Region, heap: &Mutex<Heap>, id: u64, job: Job) -> Result<CompLog> {
        let head = new_segment(r, heap, id, SEG_SIZE)?;
        let mut l = CompLog { head, id, segs: vec![(head, SEG_SIZE)], tail: head + 64, tail_end: head + SEG_SIZE };
        l.append(r, heap, &LogEntry::Begin(job))?;
        Ok(l)
    }

    /// Append an entry and persist it.
    pub fn append(&mut self, r: &Region, heap: &Mutex<Heap>, e: &LogEntry) -> Result<()> {
        let b = encode_entry(self.id, e);
        // Keep room for a zero word after the entry: the reader stops at a zero crc+type.
        if self.tail + b.len() as u64 + 8 > self.tail_end {
            let size = SEG_SIZE.max((64 + b.len() as u64 + 8).div_ceil(64) * 64);
            let seg = new_segment(r, heap, self.id, size)?;
            let last = self.segs.last().map_or(self.head, |s| s.0);
            r.store_u64_atomic(last + 16, seg)?;
            r.persist(last + 16, 8);
            self.segs.push((seg, size));
            self.tail = seg + 64;
            self.tail_end = seg + size;
        }
        // SAFETY: log space past the tail belongs to the single job that owns this log.
        unsafe { r.write(self.tail, &b)? };
        r.persist(self.tail, b.len() as u64);
        self.tail += b.len() as u64;
        Ok(())
    }

    /// The segments (address, size), to free once the log is no longer referenced.
    pub fn segments(&self) -> &[(u64, u64)] {
        &self.segs
    }
}

fn new_segment(r: &Region, heap: &Mutex<Heap>, id: u64, size: u64) -> Result<u64> {
    let seg = alloc_or_grow(&mut heap.lock(), r, size)?;
    // The header, and a zero word where the first entry goes (old bytes are never entries
    // of this log, but zeroing the first word makes an empty segment read as empty).
    let mut b = encode_seg_header(id, size).to_vec();
    b.extend_from_slice(&[0u8; 8]);
    // SAFETY: freshly allocated space, referenced by nothing yet.
    unsafe { r.write(seg, &b)? };
    r.persist(seg, b.len() as u64);
    Ok(seg)
}

/// Read the log whose first segment is `head`: its entries and its segments.
pub fn read(r: &Region, head: u64) -> Result<(Vec<LogEntry>, Segments)> {
    let mut out = Vec::new();
    let mut segs = Vec::new();
    let mut seg = head;
    let mut id = None;
    while seg != 0 {
        let h = r.slice_checked(seg, 64, "compaction log segment")?;
        let mut c = Cursor::new(h);
        let (magic, sid, next, size) = (c.u64(), c.u64(), c.u64(), c.u64());
        let stored = u32::from_le_bytes(h.get(32..36).and_then(|s| s.try_into().ok()).unwrap_or([0; 4]));
        let want = crc::masked_parts(&[h.get(0..16).unwrap_or(&[]), h.get(24..32).unwrap_or(&[])]);
        if magic != Some(SEG_MAGIC) || want != stored || (id.is_some() && id != sid) {
            return Err(r.corruption(seg, "bad compaction log segment header"));
        }
        id = sid;
        let size = size.unwrap_or(0);
        let body = r.slice_checked(seg, size as usize, "compaction log segment")?;
        segs.push((seg, size));
        let mut off = 64usize;
        while let Some((e, len)) = decode_entry(body.get(off..).unwrap_or(&[]), sid.unwrap_or(0)) {
            out.push(e);
            off += len;
        }
        seg = next.unwrap_or(0);
        if segs.len() > 1 << 20 {
            return Err(r.corruption(head, "compaction log chain does not end"));
        }
    }
    Ok((out, segs))
}

/// Decode one entry of log `id` at the start of `b`; `None` at the end of the log.
pub fn decode_entry(b: &[u8], id: u64) -> Option<(LogEntry, usize)> {
    let mut c = Cursor::new(b);
    let stored = c.u32()?;
    let ty = c.u8()?;
    c.skip(1)?;
    let klen = c.u16()? as usize;
    let a = c.u64()?;
    let eid = c.u64()?;
    let key = c.bytes(klen)?;
    let body = b.get(4..ENTRY_HEADER as usize + klen)?;
    if eid != id || crc::masked(body) != stored {
        return None;
    }
    let e = match (ty, a) {
        (1, 1) => LogEntry::Begin(Job::Flush(u64::from_le_bytes(key.try_into().ok()?))),
        (1, 2) => LogEntry::Begin(Job::Compaction),
        (2, f) => LogEntry::Input(f),
        (3, f) => LogEntry::Output(f),
        (4, f) => LogEntry::Moved(f, key.to_vec()),
        _ => return None,
    };
    Some((e, (ENTRY_HEADER as usize + klen).div_ceil(8) * 8))
}
