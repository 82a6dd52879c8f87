//! Index checkpoints: the DRAM index written to a file, so an open loads it instead of
//! replaying every log record (byte layout: `docs/format/native.md`, "Index checkpoint";
//! the argument: `docs/design/native.md`, "Recovery").
//!
//! A checkpoint is a file `<dir>/NATIVE-CHECKPOINT`: a header with each shard's *resume
//! point* (a log position) and a *horizon* (a sequence number), then one entry per index
//! slot — key, sequence number, PM location and size of the key's newest version, whether
//! it is a delete — in key order, then a trailer with the entry count and a checksum of
//! the entries.
//!
//! **Writing** (a background round every [`crate::options::NativeOptions::checkpoint_bytes`]
//! of new log, [`crate::Db::compact`], and a clean close):
//! 1. With every shard held at once (writers pause for the few microseconds it takes): each
//!    shard's resume point is its log's end, the horizon is the next sequence number. No
//!    write is in flight, so every write numbered below the horizon is linked in the index
//!    (a writer links before it releases its shard), and every record appended later lies
//!    after a resume point. The shards are taken with `try_lock`; at a busy one every
//!    shard held is released and the next round waits a little
//!    ([`Inner::hold_every_shard`]): a checkpoint never holds one shard while it waits for
//!    another, so a shard busy for long (a move to disk, a `compact`) stalls no writer
//!    of the others.
//! 2. With the shards released (a clean close keeps them held), the index's pending tree
//!    inserts are drained once and the
//!    ordered index is walked in chunks (an epoch pin per chunk, never across file I/O;
//!    no drain per chunk) and each slot's newest version is written, except a
//!    version the capacity tier moved to disk (its slot waits for removal; the moved entry
//!    decides) and slots already removed.
//! 3. The file is written as `NATIVE-CHECKPOINT.tmp`, fsynced, renamed over the previous
//!    one and the directory fsynced. A crash before the rename leaves the previous
//!    checkpoint in place.
//!
//! **Why any durable checkpoint stays usable** (so an open never depends on the newest one,
//! and a checkpoint that fails its checks is simply ignored — the logs alone always
//! recover the store, as without checkpoints): open replays, per shard, the records after
//! the resume point (the rest of that segment and every segment of a later generation),
//! and merges them with the checkpoint by sequence number. What the walk wrote is each
//! key's newest version as of some moment after step 1. Records after the resume points
//! are (a) writes numbered at or above the horizon, (b) the log cleaner's copies, with the
//! original's number, and (c) moved entries, with the moved version's number. So:
//! - a tail entry numbered above the checkpoint's for its key is newer: it wins;
//! - a tail entry with the same number as the checkpoint's is a copy of it (at a new
//!   place: the tail's location wins, the checkpoint's may lie in a segment cleaned and
//!   reused since), or its moved entry (the key goes to disk, as at every open);
//! - a tail put or delete numbered below the horizon whose key has no checkpoint entry is
//!   a copy of a version that was not its key's newest when the walk passed (the cleaner
//!   copies every version still in a chain — older ones kept for a snapshot or not
//!   trimmed yet — and deletes of keys without a slot): it is ignored. (A key without a
//!   checkpoint entry had no slot created before step 1 still in the tree when the walk
//!   passed, or a moved newest version; any write of it in a slot created later is
//!   numbered at or above the horizon; the moved entry that decides it lies before a
//!   resume point, or in the tail, where it wins.) Tests reach both kinds of copy
//!   (`docs/design/native.md`, "Index checkpoints").
//! - a checkpoint location in a segment the cleaner retired after step 1 always has a
//!   tail copy: the cleaner holds a shard for a whole pass, so a pass that relocated an
//!   entry before step 1 finished before it (the walk then reads the new location) and
//!   one after it appended its copies after the resume points.
//!
//! Entries below a resume point are never read at open, so damage there is found by
//! `check` (which walks every record), not by an open that loads a checkpoint.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crossbeam_epoch as epoch;
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::format::crc;
use crate::fs::{CountingFs, Fs};

use super::index::MapGuard;
use super::Inner;

/// File name of the checkpoint, in the store directory.
pub const FILE_NAME: &str = "NATIVE-CHECKPOINT";
/// Magic at the start of the file.
pub const MAGIC: &[u8; 8] = b"TKVNCKP\0";
/// Format version of the checkpoint file.
pub const VERSION: u32 = 1;
/// Fixed bytes of an entry (before its key).
pub const ENTRY_FIXED: usize = 25;
/// Bytes of the trailer.
pub const TRAILER_LEN: usize = 16;
/// The length field of a shard without an open segment.
const NO_SEGMENT: u32 = u32::MAX;
/// Slots walked under one epoch pin.
const CHUNK: usize = 4096;
/// Rounds of step 1 that only spin before writers are paused.
const SPIN_ROUNDS: u32 = 8;
/// Longest step 1 keeps writers paused before it waits for the busy shard alone.
const PAUSE_LIMIT: std::time::Duration = std::time::Duration::from_millis(1);

/// The header: where replay resumes and what the walk may miss.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The store's id (the superblock's).
    pub db_id: u64,
    /// Every write numbered below it was in the index when the walk started.
    pub horizon: u64,
    /// Per shard: where its replay resumes.
    pub resume: Vec<Resume>,
}

/// Where replay of one shard's log resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// Segments of older generations are not replayed; younger ones are, whole.
    pub gen: u64,
    /// `Some((salt, len))`: the shard's open segment had generation `gen` and this salt,
    /// and replay resumes at byte `len` of its records. `None`: the shard had no open
    /// segment; `gen` is the generation its next one got.
    pub seg: Option<(u32, u32)>,
}

impl Header {
    /// Bytes of the header of a store of `shards` shards.
    pub fn encoded_len(shards: usize) -> usize {
        32 + 16 * shards + 8
    }

    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::encoded_len(self.resume.len()));
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.resume.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.db_id.to_le_bytes());
        b.extend_from_slice(&self.horizon.to_le_bytes());
        encode_resumes(&mut b, &self.resume);
        let c = crc::masked(&b);
        b.extend_from_slice(&c.to_le_bytes());
        b.extend_from_slice(&[0u8; 4]);
        b
    }

    /// Decode the header at the start of `buf`, for a store of `shards` shards.
    pub fn decode(buf: &[u8], shards: usize) -> std::result::Result<Header, String> {
        let b = checked_header(buf, Self::encoded_len(shards), MAGIC, VERSION, shards)?;
        let resume = decode_resumes(&b[32..], shards);
        Ok(Header { db_id: u64_le(b, 16), horizon: u64_le(b, 24), resume })
    }
}

/// The `len`-byte header at the start of `buf` of an index file (a checkpoint or a
/// delta), after the checks both get: `magic`, the header checksum (its last 8 bytes:
/// the masked CRC-32C of the rest, 4 zero bytes), format `version` (bytes 8..12) and
/// the store's shard count (bytes 12..16).
pub(super) fn checked_header<'a>(
    buf: &'a [u8],
    len: usize,
    magic: &[u8; 8],
    version: u32,
    shards: usize,
) -> std::result::Result<&'a [u8], String> {
    let b = buf.get(..len).ok_or("shorter than its header")?;
    if &b[..8] != magic {
        return Err("bad magic".into());
    }
    if u32_le(b, len - 8) != crc::masked(&b[..len - 8]) {
        return Err("header checksum mismatch".into());
    }
    if u32_le(b, 8) != version {
        return Err(format!("format version {} (this build reads {version})", u32_le(b, 8)));
    }
    if u32_le(b, 12) as usize != shards {
        return Err(format!("written for {} shards, the store has {shards}", u32_le(b, 12)));
    }
    Ok(b)
}

/// The little-endian `u32` at `o` of a header [`checked_header`] returned (in bounds).
pub(super) fn u32_le(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// The little-endian `u64` at `o` of a header [`checked_header`] returned (in bounds).
pub(super) fn u64_le(b: &[u8], o: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(w)
}

/// Append each shard's resume point (16 bytes each: generation, length, salt).
pub(super) fn encode_resumes(b: &mut Vec<u8>, resume: &[Resume]) {
    for t in resume {
        let (salt, len) = t.seg.unwrap_or((0, NO_SEGMENT));
        b.extend_from_slice(&t.gen.to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&salt.to_le_bytes());
    }
}

/// The `shards` resume points at the start of `b` (which holds at least `16 × shards`
/// bytes: the caller checked the length).
pub(super) fn decode_resumes(b: &[u8], shards: usize) -> Vec<Resume> {
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    (0..shards)
        .map(|i| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[16 * i..16 * i + 8]);
            let (len, salt) = (u32_at(16 * i + 8), u32_at(16 * i + 12));
            Resume { gen: u64::from_le_bytes(w), seg: (len != NO_SEGMENT).then_some((salt, len)) }
        })
        .collect()
}

/// One checkpoint entry: `(key, seq, loc, size, delete)`, the shape the index is loaded from.
pub type Entry<'a> = (&'a [u8], u64, u64, u32, bool);

/// Append the encoding of one entry to `out`.
pub fn encode_entry(out: &mut Vec<u8>, key: &[u8], seq: u64, loc: u64, size: u32, tomb: bool) {
    encode_entry_flags(out, key, seq, loc, size, u8::from(tomb));
}

/// Append the encoding of one entry with flags byte `flags` (0 put, 1 delete; a delta
/// file also has 2, moved: see [`super::delta`]).
pub fn encode_entry_flags(out: &mut Vec<u8>, key: &[u8], seq: u64, loc: u64, size: u32, flags: u8) {
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(&size.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&loc.to_le_bytes());
    out.push(flags);
    out.extend_from_slice(key);
}

/// The trailer after `count` entries whose bytes have crc32c `body_crc` (unmasked).
pub fn encode_trailer(count: u64, body_crc: u32) -> [u8; TRAILER_LEN] {
    let mut t = [0u8; TRAILER_LEN];
    t[..4].copy_from_slice(&crc::mask(body_crc).to_le_bytes());
    t[8..].copy_from_slice(&count.to_le_bytes());
    t
}

/// A whole checkpoint file, decoded and verified.
#[derive(Debug)]
pub struct Decoded<'a> {
    pub header: Header,
    /// Sorted by key, keys distinct.
    pub entries: Vec<Entry<'a>>,
}

/// Decode and verify a checkpoint file of a store of `shards` shards with id `db_id`:
/// checksums, the entry count, keys strictly ascending.
/// (The golden-bytes test reads files through it; open uses [`verify`] and [`for_each_entry`].)
pub fn decode(buf: &[u8], shards: usize, db_id: u64) -> std::result::Result<Decoded<'_>, String> {
    let v = verify(buf, shards, db_id)?;
    let mut entries = Vec::new();
    for_each_entry(buf, &v, |_, e| entries.push(e))?;
    let Verified { header, .. } = v;
    Ok(Decoded { header, entries })
}

/// A checkpoint file whose header and checksum verified: the header and where its
/// entries lie.
#[derive(Debug)]
pub struct Verified {
    pub header: Header,
    start: usize,
    end: usize,
    /// Entries, as the trailer says.
    pub count: u64,
    /// The entries' checksum, as stored (masked): with the horizon and the count, what a
    /// delta file names as the checkpoint it builds on.
    pub body_crc: u32,
}

/// Verify a checkpoint file's header (for a store of `shards` shards with id `db_id`),
/// length and entry checksum; the entries are checked by [`for_each_entry`].
pub fn verify(buf: &[u8], shards: usize, db_id: u64) -> std::result::Result<Verified, String> {
    let header = Header::decode(buf, shards)?;
    if header.db_id != db_id {
        return Err(format!("written for store {:#x}, not {db_id:#x}", header.db_id));
    }
    let start = Header::encoded_len(shards);
    let (end, count, body_crc) = verify_entries(buf, start)?;
    Ok(Verified { header, start, end, count, body_crc })
}

/// Check the trailer of a file whose entries start at `start` (a checkpoint's or a
/// delta's): their checksum. Returns where they end, the count the trailer gives, and the
/// checksum as stored.
pub(super) fn verify_entries(buf: &[u8], start: usize) -> std::result::Result<(usize, u64, u32), String> {
    if buf.len() < start + TRAILER_LEN {
        return Err("shorter than its header and trailer".into());
    }
    let end = buf.len() - TRAILER_LEN;
    let trailer = &buf[end..];
    let stored = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
    if stored != crc::masked(&buf[start..end]) {
        return Err("entry checksum mismatch".into());
    }
    let mut w = [0u8; 8];
    w.copy_from_slice(&trailer[8..16]);
    Ok((end, u64::from_le_bytes(w), stored))
}

/// The entry starting at byte `at` of `buf` (its fixed fields, then its key), if it lies
/// within `buf` and its flags byte is valid.
#[inline]
pub fn entry_at(buf: &[u8], at: usize) -> std::result::Result<Entry<'_>, String> {
    let (key, seq, loc, size, flags) = entry_at_flags(buf, at, 1)?;
    Ok((key, seq, loc, size, flags == 1))
}

/// The entry starting at byte `at` of `buf` with its flags byte, which must be at most
/// `max_flags`.
#[inline]
pub fn entry_at_flags(buf: &[u8], at: usize, max_flags: u8) -> std::result::Result<RawEntry<'_>, String> {
    let f = buf.get(at..at + ENTRY_FIXED).ok_or("entry cut short")?;
    let klen = u32::from_le_bytes([f[0], f[1], f[2], f[3]]) as usize;
    let size = u32::from_le_bytes([f[4], f[5], f[6], f[7]]);
    let mut w = [0u8; 8];
    w.copy_from_slice(&f[8..16]);
    let seq = u64::from_le_bytes(w);
    w.copy_from_slice(&f[16..24]);
    let loc = u64::from_le_bytes(w);
    let flags = f[24];
    if flags > max_flags {
        return Err(format!("entry flags {flags:#x}"));
    }
    let key = buf.get(at + ENTRY_FIXED..at + ENTRY_FIXED + klen).ok_or("entry key cut short")?;
    Ok((key, seq, loc, size, flags))
}

/// An entry with its flags byte: `(key, seq, loc, size, flags)`.
pub type RawEntry<'a> = (&'a [u8], u64, u64, u32, u8);

/// Call `f` with every entry of a verified checkpoint (and the byte offset where the entry
/// starts), in order, checking that each is whole, keys strictly ascend, and the count
/// matches the trailer's.
pub fn for_each_entry<'a>(
    buf: &'a [u8],
    v: &Verified,
    mut f: impl FnMut(usize, Entry<'a>),
) -> std::result::Result<(), String> {
    for_each_raw(buf, v.start, v.end, v.count, 1, |at, (k, s, l, z, flags)| f(at, (k, s, l, z, flags == 1)))
}

/// [`for_each_entry`] over the entries in `buf[start..end]`, `count` of them, with flags
/// up to `max_flags`.
pub(super) fn for_each_raw<'a>(
    buf: &'a [u8],
    start: usize,
    end: usize,
    count: u64,
    max_flags: u8,
    mut f: impl FnMut(usize, RawEntry<'a>),
) -> std::result::Result<(), String> {
    let body = buf.get(..end).ok_or("entries cut short")?;
    let mut pos = start;
    let mut seen = 0u64;
    let mut prev: Option<&[u8]> = None;
    while pos < end {
        let e = entry_at_flags(body, pos, max_flags)?;
        if prev.is_some_and(|p| p >= e.0) {
            return Err("entries out of key order".into());
        }
        prev = Some(e.0);
        let next = pos + ENTRY_FIXED + e.0.len();
        f(pos, e);
        seen += 1;
        pos = next;
    }
    if seen != count {
        return Err(format!("{seen} entries, the trailer says {count}"));
    }
    Ok(())
}

/// A checkpoint file's bytes: mapped where the file system maps files (the file is never
/// changed once renamed into place; a newer checkpoint replaces its name, not its bytes),
/// else read into memory.
pub(crate) enum FileBytes {
    Mapped(Box<dyn crate::fs::FsFile>),
    Read(Vec<u8>),
}

impl FileBytes {
    pub fn bytes(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(f) => f.mapped().unwrap_or_default(),
            FileBytes::Read(v) => v,
        }
    }
}

/// Checkpoint state of an open store.
pub(super) struct Checkpoints {
    pub(super) fs: CountingFs,
    pub(super) dir: PathBuf,
    /// Write one after this many bytes of new log segments (0: only at close and compact).
    every: u64,
    /// Segments created when the last checkpoint started.
    pub(super) segments_at_last: AtomicU64,
    /// One writer at a time; the chain of deltas on the newest checkpoint.
    pub(super) writing: Mutex<super::delta::Chain>,
    /// Delta files written ([`super::delta`]).
    pub deltas_written: AtomicU64,
    /// Entries of the last delta written.
    pub last_delta_entries: AtomicU64,
    /// Microseconds the last delta took.
    pub last_delta_us: AtomicU64,
    /// Delta files the open loaded, and their entries.
    pub loaded_deltas: u64,
    pub loaded_delta_entries: u64,
    /// Why the open left delta files out of its chain, if it did.
    pub delta_rejected: Option<String>,
    pub written: AtomicU64,
    pub failures: AtomicU64,
    pub last_entries: AtomicU64,
    pub last_us: AtomicU64,
    /// Entries the open loaded from a checkpoint (0: none used).
    pub loaded_entries: u64,
    /// Rounds of step 1 that found a shard busy, released every shard and backed off.
    pub shard_retries: AtomicU64,
    /// Set while step 1 keeps writers from taking shards ([`Inner::hold_every_shard`]).
    pub(super) pause: super::Padded<AtomicBool>,
    /// Times step 1 paused writers.
    pub pauses: AtomicU64,
    /// Tail entries the open dropped by the horizon rule (copies of versions that were not
    /// their key's newest; see the module docs).
    pub stale_dropped: u64,
    /// Why the open ignored the checkpoint file it found, if it did.
    pub rejected: Option<String>,
}

impl Checkpoints {
    pub(super) fn new(fs: CountingFs, dir: &Path, every: u64) -> Checkpoints {
        Checkpoints {
            fs,
            dir: dir.to_path_buf(),
            every,
            segments_at_last: AtomicU64::new(0),
            writing: Mutex::new(super::delta::Chain::default()),
            deltas_written: AtomicU64::new(0),
            last_delta_entries: AtomicU64::new(0),
            last_delta_us: AtomicU64::new(0),
            loaded_deltas: 0,
            loaded_delta_entries: 0,
            delta_rejected: None,
            written: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            last_entries: AtomicU64::new(0),
            last_us: AtomicU64::new(0),
            loaded_entries: 0,
            shard_retries: AtomicU64::new(0),
            pause: super::Padded(AtomicBool::new(false)),
            pauses: AtomicU64::new(0),
            stale_dropped: 0,
            rejected: None,
        }
    }

    pub(super) fn path(dir: &Path) -> PathBuf {
        dir.join(FILE_NAME)
    }

    /// The checkpoint file's bytes, if there is one (`Ok(None)`: none): mapped (no copy;
    /// an open of a million keys reads 40 MB) where the file system maps files.
    pub(super) fn read(fs: &dyn Fs, dir: &Path) -> Result<Option<FileBytes>> {
        let p = Self::path(dir);
        if !fs.exists(&p) {
            return Ok(None);
        }
        read_file(fs, &p).map(Some)
    }

    /// Remove a checkpoint, and every delta file, a new store must not meet (a directory
    /// reused for a new store), or that an open rejected.
    pub(super) fn remove_stale(fs: &dyn Fs, dir: &Path) -> Result<()> {
        let p = Self::path(dir);
        if fs.exists(&p) {
            fs.remove(&p)?;
            fs.sync_dir(dir)?;
        }
        super::delta::remove_except(fs, dir, &[])
    }

    /// Whether the log since the checkpoint the open loaded — `replayed` bytes at open plus
    /// `segments` new segments of `segment_bytes` — reached the checkpoint interval.
    pub(super) fn tail_due(&self, replayed: u64, segments: u64, segment_bytes: u64) -> bool {
        self.every > 0 && replayed.saturating_add(segments.saturating_mul(segment_bytes)) >= self.every
    }

    /// Whether enough new log was written since the last checkpoint or delta for the next
    /// round: `checkpoint_bytes / ROUNDS_PER_FULL` ([`super::delta::ROUNDS_PER_FULL`];
    /// `segments`: segments created so far, `segment_bytes`: their size).
    pub(super) fn due(&self, segments: u64, segment_bytes: u64) -> bool {
        self.every > 0
            && segments.saturating_sub(self.segments_at_last.load(Ordering::Relaxed)).saturating_mul(segment_bytes)
                >= (self.every / super::delta::ROUNDS_PER_FULL).max(1)
    }
}

/// A file's bytes: mapped where the file system maps files, else read.
pub(super) fn read_file(fs: &dyn Fs, p: &Path) -> Result<FileBytes> {
    let f = fs.open_immutable(p)?;
    if let Some(m) = f.mapped() {
        f.note_read(m.len() as u64);
        return Ok(FileBytes::Mapped(f));
    }
    Ok(FileBytes::Read(fs.read_all(p)?))
}

impl Inner {
    /// Write a checkpoint while writers go on (see the module docs). `Error::Closed` when
    /// the store started closing meanwhile (the partial file is left as `.tmp`).
    pub(super) fn checkpoint(&self) -> Result<()> {
        // The walk needs every key; wait here, before step 1 holds the shards.
        self.index.wait_loaded()?;
        let mut chain = self.ckpt.writing.lock();
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        self.checkpoint_locked(&mut chain)
    }

    /// [`Inner::checkpoint`] with the writer's lock held.
    pub(super) fn checkpoint_locked(&self, chain: &mut super::delta::Chain) -> Result<()> {
        let segments = self.segments_created();
        let (resume, horizon) = {
            let logs = self.hold_every_shard()?;
            (logs.iter().map(|l| resume_point(l)).collect::<Vec<_>>(), self.next_seq.0.load(Ordering::SeqCst))
        };
        self.ckpt.segments_at_last.store(segments, Ordering::Relaxed);
        self.write_checkpoint(Header { db_id: self.db_id, horizon, resume }, true, chain)
    }

    /// Every shard's log, held at once (step 1 of a checkpoint), taken without ever
    /// waiting for a shard while holding another. A round `try_lock`s every shard in
    /// turn; at a busy one it releases all it holds and backs off:
    /// - the first [`SPIN_ROUNDS`] rounds spin (up to 256 hints);
    /// - then it *pauses* writers ([`Checkpoints::pause`]: a writer does not take a shard
    ///   while it is set) and retries after a `yield`, so the writes in flight drain out
    ///   (without the pause, writers in tight loops kept some shard busy at every try:
    ///   80 s without a checkpoint in the four-writer test);
    /// - past [`PAUSE_LIMIT`] of pause a shard is busy for long (a move to disk fsyncing
    ///   its table, a `compact`, a cleaning pass, a preempted writer): the pause ends and
    ///   it waits for that shard alone, holding none, then starts over.
    ///
    /// So writers wait at most about [`PAUSE_LIMIT`] per pause, and never for a shard
    /// the checkpoint holds while it waits for another. `Error::Closed` once the store
    /// is closing (the close holds every shard and then waits for this checkpoint).
    pub(super) fn hold_every_shard(&self) -> Result<Vec<parking_lot::MutexGuard<'_, super::log::ShardLog>>> {
        /// Lifts the pause however the call ends.
        struct Lift<'a>(&'a AtomicBool);
        impl Drop for Lift<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _lift = Lift(&self.ckpt.pause.0);
        let mut round = 0u32;
        let mut paused_at: Option<std::time::Instant> = None;
        loop {
            let mut held = Vec::with_capacity(self.shards.len());
            let mut busy = None;
            for (i, s) in self.shards.iter().enumerate() {
                match s.log.try_lock() {
                    Some(g) => held.push(g),
                    None => {
                        busy = Some(i);
                        break;
                    }
                }
            }
            let Some(busy) = busy else { return Ok(held) };
            drop(held);
            self.ckpt.shard_retries.fetch_add(1, Ordering::Relaxed);
            if self.closed.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            round += 1;
            if round <= SPIN_ROUNDS {
                for _ in 0..1u32 << round {
                    std::hint::spin_loop();
                }
                continue;
            }
            match paused_at {
                None => {
                    self.ckpt.pause.0.store(true, Ordering::SeqCst);
                    self.ckpt.pauses.fetch_add(1, Ordering::Relaxed);
                    paused_at = Some(std::time::Instant::now());
                }
                Some(t) if t.elapsed() >= PAUSE_LIMIT => {
                    self.ckpt.pause.0.store(false, Ordering::Release);
                    paused_at = None;
                    round = 0;
                    // Wait for the busy shard alone (in slices: the close may take it
                    // and keep it).
                    loop {
                        if self.closed.load(Ordering::Acquire) {
                            return Err(Error::Closed);
                        }
                        if self.shards[busy].log.try_lock_for(std::time::Duration::from_millis(1)).is_some() {
                            break;
                        }
                    }
                    continue;
                }
                Some(_) => {}
            }
            std::thread::yield_now();
        }
    }

    /// Walk the index and write the checkpoint file for `header`. `stoppable`: give up
    /// when the background thread is told to stop (the close writes its own). Once it is
    /// durable it starts a new `chain` of deltas, and the old chain's files are removed
    /// (they name another checkpoint: an open would ignore them anyway).
    pub(super) fn write_checkpoint(
        &self,
        header: Header,
        stoppable: bool,
        chain: &mut super::delta::Chain,
    ) -> Result<()> {
        let t0 = std::time::Instant::now();
        let point = super::delta::Point { horizon: header.horizon, resume: header.resume.clone() };
        let r = self.write_checkpoint_file(header, stoppable);
        match &r {
            Ok((n, body_crc)) => {
                self.ckpt.written.fetch_add(1, Ordering::Relaxed);
                self.ckpt.last_entries.store(*n, Ordering::Relaxed);
                self.ckpt.last_us.store(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                let base = super::delta::BaseId { horizon: point.horizon, count: *n, crc: *body_crc };
                chain.restart(base, point);
                // A removal that fails leaves files an open ignores and removes.
                let _ = super::delta::remove_except(&self.ckpt.fs, &self.ckpt.dir, &[]);
            }
            Err(Error::Closed) => {}
            Err(_) => {
                self.ckpt.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        r.map(|_| ())
    }

    /// Returns the entries written and their checksum (masked, as stored).
    fn write_checkpoint_file(&self, header: Header, stoppable: bool) -> Result<(u64, u32)> {
        let fs = &self.ckpt.fs;
        let path = Checkpoints::path(&self.ckpt.dir);
        let tmp = self.ckpt.dir.join(format!("{FILE_NAME}.tmp"));
        let mut f = fs.create(&tmp)?;
        f.append(&header.encode())?;
        let mut body_crc = 0u32;
        let mut count = 0u64;
        let mut buf = Vec::with_capacity(1 << 20);
        let mut after: Option<Vec<u8>> = None;
        // One drain, after step 1: every slot the walk must write (of a write numbered
        // below the horizon) was queued before step 1 ended (a writer queues its slot
        // before it links, and links before it releases its shard); a slot created later
        // holds only writes at or above the horizon, which the log after the resume points
        // holds (the chunks may still meet it: it is written like any other). That needs
        // the background load done before step 1 (a slot started from the loaded base
        // holds an older entry): every caller waits for it first.
        self.index.prepare_walk()?;
        loop {
            if stoppable && self.stop.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            buf.clear();
            let mut seen = 0usize;
            {
                let mg = MapGuard::new();
                let eg = epoch::pin();
                let lower = match after.as_deref() {
                    Some(k) => std::ops::Bound::Excluded(k),
                    None => std::ops::Bound::Unbounded,
                };
                let mut last = None;
                for (k, slot) in self.index.ascending_drained(lower, &mg) {
                    seen += 1;
                    last = Some(k);
                    if let Some(h) = slot.head(&eg) {
                        if !slot.is_gone() && slot.moved.load(Ordering::Relaxed) != h.seq {
                            encode_entry(&mut buf, k, h.seq, h.loc(), h.size, h.tomb);
                            count += 1;
                        }
                    }
                    if seen == CHUNK {
                        break;
                    }
                }
                after = last.map(|k| k.to_vec());
            }
            body_crc = crc32c::crc32c_append(body_crc, &buf);
            f.append(&buf)?;
            if seen < CHUNK {
                break;
            }
        }
        f.append(&encode_trailer(count, body_crc))?;
        f.sync()?;
        drop(f);
        fs.rename(&tmp, &path)?;
        fs.sync_dir(&self.ckpt.dir)?;
        Ok((count, crc::mask(body_crc)))
    }
}

/// Where replay of a shard resumes after a checkpoint taken now: the end of its open
/// segment, or the start of the next generation when it has none.
pub(super) fn resume_point(l: &super::log::ShardLog) -> Resume {
    match l.open {
        Some(o) => Resume { gen: o.tag.gen, seg: Some((o.tag.salt, o.len as u32)) },
        None => Resume { gen: l.next_gen, seg: None },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(entries: &[Entry<'_>], shards: usize) -> Vec<u8> {
        let resume =
            (0..shards as u64).map(|g| Resume { gen: g + 1, seg: (g % 2 == 0).then_some((0xabcd, 64)) }).collect();
        let h = Header { db_id: 9, horizon: 77, resume };
        let mut b = h.encode();
        let mut body = Vec::new();
        for e in entries {
            encode_entry(&mut body, e.0, e.1, e.2, e.3, e.4);
        }
        b.extend_from_slice(&body);
        b.extend_from_slice(&encode_trailer(entries.len() as u64, crc32c::crc32c(&body)));
        b
    }

    #[test]
    fn round_trip_and_every_flipped_byte_is_refused() {
        let es: Vec<Entry<'_>> = vec![(b"a", 3, 4096, 40, false), (b"bc", 9, 8192, 33, true)];
        let b = file(&es, 2);
        let d = decode(&b, 2, 9).unwrap();
        assert_eq!(d.entries, es);
        assert_eq!(d.header.horizon, 77);
        assert_eq!(d.header.resume[0], Resume { gen: 1, seg: Some((0xabcd, 64)) });
        assert_eq!(d.header.resume[1], Resume { gen: 2, seg: None });
        assert!(decode(&b, 3, 9).is_err(), "another shard count");
        assert!(decode(&b, 2, 8).is_err(), "another store");
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x04;
            // The header's and trailer's padding is not covered; everything else is.
            let hl = Header::encoded_len(2);
            let padding = (hl - 4..hl).contains(&i) || (b.len() - 12..b.len() - 8).contains(&i);
            if !padding {
                assert!(decode(&bad, 2, 9).is_err(), "flip at {i} accepted");
            }
        }
        for cut in 0..b.len() {
            assert!(decode(&b[..cut], 2, 9).is_err(), "cut at {cut} accepted");
        }
    }

    #[test]
    fn unordered_or_duplicate_keys_are_refused() {
        let b = file(&[(b"b", 1, 64, 30, false), (b"a", 2, 128, 30, false)], 1);
        assert!(decode(&b, 1, 9).unwrap_err().contains("order"));
        let b = file(&[(b"a", 1, 64, 30, false), (b"a", 2, 128, 30, false)], 1);
        assert!(decode(&b, 1, 9).is_err());
    }
}
