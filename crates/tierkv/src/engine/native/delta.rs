//! Incremental index checkpoints (*deltas*): what bounds the log an open replays after a
//! crash without writing the whole index more often (byte layout:
//! `docs/format/native.md`, "Index checkpoint delta"; the argument: `docs/design/native.md`,
//! "Incremental checkpoints").
//!
//! A full checkpoint ([`super::checkpoint`]) costs about 41 bytes and a walk step per key
//! of the store, so it is written only every `checkpoint_bytes` of log (256 MiB), and a
//! crash just before the next one replays up to that much log: 0.41–0.50 s at one
//! million keys on this project's 2-core machine, most of it reading and checking
//! records. A delta costs what was written since the previous round instead. The
//! background thread runs a round every `checkpoint_bytes / ROUNDS_PER_FULL` of log
//! (32 MiB); each round writes a delta, except every [`ROUNDS_PER_FULL`]-th, which writes
//! a full checkpoint and starts a new chain (so full checkpoints keep their interval and
//! their cost). A round with no full checkpoint to build on writes a full one.
//!
//! **What a delta holds.** A delta file `NATIVE-DELTA-<id>` names the full checkpoint it
//! builds on (its horizon, entry count and entry checksum), the point of the logs it starts
//! from (the previous delta's end, or the checkpoint's own horizon and resume points) and
//! the point it ends at (a horizon and resume points, taken as a full checkpoint's step 1
//! takes them: every shard held at once). Its entries are, for every key with a record in
//! the logs between the two points, the newest such record — sequence number, PM
//! location, size and kind (put, delete or *moved*) — in key order: exactly what an open's
//! replay of that stretch of log would find ([`super::recovery`]). So an open that loads
//! the checkpoint and its chain of deltas, then replays the logs after the chain's end,
//! decides every key as an open that replayed the logs after the checkpoint would
//! ("Why any durable checkpoint stays usable" in [`super::checkpoint`]), with one
//! difference the argument in `native.md` handles: a record a delta lists may since have
//! been cleaned (its segment retired and reused). Its entry then always loses — to the
//! cleaner's copy, which lies after the delta's end (same number, later place), to a newer
//! version, or to the moved entry that sent the key to disk — or the open's check that
//! every winning entry lies within a segment's records rejects the chain.
//!
//! **Reading the records.** A round reads the records between the two points from PM
//! while writers go on (nothing in that stretch changes: a writer only appends past the
//! end point) and while the cleaner may retire segments of it. Each segment is read under
//! an epoch pin after checking it is still one of the store's segments: a segment retired
//! after that check is not reused before the pin ends (its slots are freed only after the
//! epoch moves past every pin held when it was retired). A segment retired before the
//! check is skipped; its live entries were copied past the round's end point (the cleaner
//! holds a shard for a whole pass, so no pass straddles the round's step 1). Records are
//! checked by their header checksum only (it covers every entry header): no value byte is
//! read, so a round costs about one cache line per record. Entries an open takes from a
//! delta are verified at their first read, as a checkpoint's are.
//!
//! **Failure.** Every delta is an accelerator: an open that finds a delta damaged, naming
//! another checkpoint, or not continuing the chain, uses the chain up to it and replays
//! the logs from there (the logs hold everything after any point a checkpoint or delta
//! names: nothing trims the log on their account). Files outside the chain are removed
//! before the store takes a write. A delta that fails (the disk, or damage in its
//! stretch) is counted as a checkpoint failure and the round writes a full checkpoint
//! instead (it reads no log record, so damage cannot stop the resume points moving).

use std::path::Path;
use std::sync::atomic::Ordering;

use crossbeam_epoch as epoch;

use crate::error::{Error, Result};
use crate::format::crc;
use crate::fs::Fs;

use super::checkpoint::{
    checked_header, decode_resumes, encode_entry_flags, encode_resumes, encode_trailer, for_each_raw, resume_point,
    u32_le, u64_le, verify_entries, RawEntry, Resume,
};
use super::index::{cmp_keys, head};
use super::layout::{self, Kind, SegHeader, SEG_HEADER_LEN};
use super::recovery::{newer, Newest};
use super::Inner;

/// File names of deltas: this prefix and the delta's id (ten digits).
pub const FILE_PREFIX: &str = "NATIVE-DELTA-";
/// Magic at the start of a delta file.
pub const MAGIC: &[u8; 8] = b"TKVNDLT\0";
/// Format version of delta files.
pub const VERSION: u32 = 1;
/// Checkpoint rounds per `checkpoint_bytes` of log: every one writes a delta but the
/// last, which writes a full checkpoint.
pub const ROUNDS_PER_FULL: u64 = 8;
/// The flags byte of a moved entry (0 put and 1 delete, as in a checkpoint).
pub const FLAG_MOVED: u8 = 2;

/// The full checkpoint a delta builds on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseId {
    /// Its horizon.
    pub horizon: u64,
    /// Its entry count.
    pub count: u64,
    /// Its entries' checksum, as stored (masked).
    pub crc: u32,
}

/// A point of the logs: a horizon and every shard's resume point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Point {
    pub horizon: u64,
    pub resume: Vec<Resume>,
}

/// A delta file's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The store's id.
    pub db_id: u64,
    /// The checkpoint the chain builds on.
    pub base: BaseId,
    /// Where the delta's stretch of log starts.
    pub from: Point,
    /// Where it ends.
    pub to: Point,
}

impl Header {
    /// Bytes of the header of a store of `shards` shards.
    pub fn encoded_len(shards: usize) -> usize {
        64 + 32 * shards + 8
    }

    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::encoded_len(self.from.resume.len()));
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.from.resume.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.db_id.to_le_bytes());
        b.extend_from_slice(&self.base.horizon.to_le_bytes());
        b.extend_from_slice(&self.base.count.to_le_bytes());
        b.extend_from_slice(&self.base.crc.to_le_bytes());
        b.extend_from_slice(&[0u8; 4]);
        b.extend_from_slice(&self.from.horizon.to_le_bytes());
        b.extend_from_slice(&self.to.horizon.to_le_bytes());
        encode_resumes(&mut b, &self.from.resume);
        encode_resumes(&mut b, &self.to.resume);
        let c = crc::masked(&b);
        b.extend_from_slice(&c.to_le_bytes());
        b.extend_from_slice(&[0u8; 4]);
        b
    }

    /// Decode the header at the start of `buf`, for a store of `shards` shards.
    pub fn decode(buf: &[u8], shards: usize) -> std::result::Result<Header, String> {
        let b = checked_header(buf, Self::encoded_len(shards), MAGIC, VERSION, shards)?;
        Ok(Header {
            db_id: u64_le(b, 16),
            base: BaseId { horizon: u64_le(b, 24), count: u64_le(b, 32), crc: u32_le(b, 40) },
            from: Point { horizon: u64_le(b, 48), resume: decode_resumes(&b[64..], shards) },
            to: Point { horizon: u64_le(b, 56), resume: decode_resumes(&b[64 + 16 * shards..], shards) },
        })
    }
}

/// A delta file whose header and entry checksum verified.
#[derive(Debug)]
pub struct Verified {
    pub header: Header,
    start: usize,
    end: usize,
    /// Entries, as the trailer says.
    pub count: u64,
}

/// Verify a delta file's header (store of `shards` shards, id `db_id`), length and entry
/// checksum; the entries are checked by [`for_each_entry`].
pub fn verify(buf: &[u8], shards: usize, db_id: u64) -> std::result::Result<Verified, String> {
    let header = Header::decode(buf, shards)?;
    if header.db_id != db_id {
        return Err(format!("written for store {:#x}, not {db_id:#x}", header.db_id));
    }
    let start = Header::encoded_len(shards);
    let (end, count, _) = verify_entries(buf, start)?;
    Ok(Verified { header, start, end, count })
}

/// Call `f` with every entry of a verified delta, in order, checking that each is whole,
/// keys strictly ascend, and the count matches the trailer's.
pub fn for_each_entry<'a>(
    buf: &'a [u8],
    v: &Verified,
    mut f: impl FnMut(RawEntry<'a>),
) -> std::result::Result<(), String> {
    for_each_raw(buf, v.start, v.end, v.count, FLAG_MOVED, |_, e| f(e))
}

/// Decode and verify a whole delta file (the golden-bytes test).
pub fn decode(buf: &[u8], shards: usize, db_id: u64) -> std::result::Result<(Header, Vec<RawEntry<'_>>), String> {
    let v = verify(buf, shards, db_id)?;
    let mut entries = Vec::new();
    for_each_entry(buf, &v, |e| entries.push(e))?;
    Ok((v.header, entries))
}

/// The kind of an entry's flags byte (checked by [`for_each_entry`]).
pub fn kind_of(flags: u8) -> Kind {
    match flags {
        0 => Kind::Put,
        1 => Kind::Delete,
        _ => Kind::Moved,
    }
}

fn flags_of(kind: Kind) -> u8 {
    match kind {
        Kind::Put => 0,
        Kind::Delete => 1,
        Kind::Moved => FLAG_MOVED,
    }
}

/// The file name of delta `id`.
pub fn file_name(id: u64) -> String {
    format!("{FILE_PREFIX}{id:010}")
}

/// The id in a delta file's name (`None`: not a delta's name, temp files included).
pub fn parse_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(FILE_PREFIX)?;
    if digits.len() != 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Ids of the delta files in `dir`, ascending.
pub(super) fn list(fs: &dyn Fs, dir: &Path) -> Result<Vec<u64>> {
    let mut ids: Vec<u64> = fs.list(dir)?.iter().filter_map(|n| parse_name(n)).collect();
    ids.sort_unstable();
    Ok(ids)
}

/// Remove every delta file (and delta temp file) in `dir` but those in `keep`.
pub(super) fn remove_except(fs: &dyn Fs, dir: &Path, keep: &[u64]) -> Result<()> {
    let mut removed = false;
    for name in fs.list(dir)? {
        let stem = name.strip_suffix(".tmp").unwrap_or(&name);
        let Some(id) = parse_name(stem) else { continue };
        if stem.len() != name.len() || !keep.contains(&id) {
            fs.remove(&dir.join(&name))?;
            removed = true;
        }
    }
    if removed {
        fs.sync_dir(dir)?;
    }
    Ok(())
}

/// The open store's chain: the full checkpoint it builds on, where it ends, its files.
#[derive(Debug, Default)]
pub(crate) struct Chain {
    /// The newest full checkpoint (`None`: none known; the next round writes one).
    pub base: Option<BaseId>,
    /// Where the chain ends: the last delta's end point, or the checkpoint's own.
    pub at: Option<Point>,
    /// Ids of the chain's deltas, oldest first.
    pub files: Vec<u64>,
    /// The id the next delta gets.
    pub next_id: u64,
}

impl Chain {
    /// A new chain on the full checkpoint `base`, written at `point`.
    pub fn restart(&mut self, base: BaseId, point: Point) {
        self.base = Some(base);
        self.at = Some(point);
        self.files.clear();
    }
}

/// A delta in a chain: its id, its bytes, its verified header.
pub(super) type Link<'a> = (u64, &'a [u8], Verified);

/// The deltas of `files` (id, bytes) that continue the checkpoint `base` from its point
/// `start`, in order, verified, and why any other file was left out.
pub(super) fn chain_of<'a>(
    files: &[(u64, &'a [u8])],
    shards: usize,
    db_id: u64,
    base: BaseId,
    start: &Point,
) -> (Vec<Link<'a>>, Option<String>) {
    let mut why = None;
    let mut cands = Vec::new();
    for &(id, buf) in files {
        match verify(buf, shards, db_id) {
            Ok(v) if v.header.base == base => cands.push((id, buf, v)),
            // Another checkpoint's (a crash before the removal after a new checkpoint).
            Ok(_) => {}
            Err(e) => why = Some(format!("{}: {e}", file_name(id))),
        }
    }
    let mut chain: Vec<Link<'a>> = Vec::new();
    let mut at = start.clone();
    while let Some(i) = cands.iter().position(|c| c.2.header.from == at && c.2.header.to != at) {
        let c = cands.swap_remove(i);
        at = c.2.header.to.clone();
        chain.push(c);
    }
    if let Some(c) = cands.first() {
        why.get_or_insert_with(|| format!("{}: does not continue the chain", file_name(c.0)));
    }
    (chain, why)
}

/// The newest record of every key in a stretch of the logs: the keys (one buffer) and,
/// sorted by key, each key's range in it with its newest entry.
struct Winners {
    keys: Vec<u8>,
    entries: Vec<(usize, usize, Newest)>,
}

impl Inner {
    /// One round of index checkpointing (the background thread, every
    /// `checkpoint_bytes / ROUNDS_PER_FULL` of log): a delta, or a full checkpoint when
    /// none is known to build on or the chain is [`ROUNDS_PER_FULL`] rounds long.
    pub(super) fn checkpoint_round(&self) -> Result<()> {
        // As a full checkpoint: moves and cleaning wait for the load too, so a close
        // during it (which writes nothing) leaves the chain the open loaded valid.
        self.index.wait_loaded()?;
        let mut chain = self.ckpt.writing.lock();
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        if chain.base.is_none() || chain.files.len() as u64 + 1 >= ROUNDS_PER_FULL {
            return self.checkpoint_locked(&mut chain);
        }
        match self.checkpoint_delta_locked(&mut chain) {
            // A delta that failed (counted) gives way to a full checkpoint, which reads no
            // log record: damage in the stretch must not stop the resume points moving.
            Err(e) if !matches!(e, Error::Closed) => self.checkpoint_locked(&mut chain),
            r => r,
        }
    }

    /// Write a delta now (tests; the background thread uses [`Inner::checkpoint_round`]).
    #[cfg(test)]
    pub(super) fn checkpoint_delta(&self) -> Result<()> {
        self.index.wait_loaded()?;
        let mut chain = self.ckpt.writing.lock();
        self.checkpoint_delta_locked(&mut chain)
    }

    fn checkpoint_delta_locked(&self, chain: &mut Chain) -> Result<()> {
        let (Some(base), Some(from)) = (chain.base, chain.at.clone()) else {
            return self.checkpoint_locked(chain);
        };
        let t0 = std::time::Instant::now();
        let segments = self.segments_created();
        let to = {
            let logs = self.hold_every_shard()?;
            Point {
                horizon: self.next_seq.0.load(Ordering::SeqCst),
                resume: logs.iter().map(|l| resume_point(l)).collect(),
            }
        };
        self.ckpt.segments_at_last.store(segments, Ordering::Relaxed);
        if to == from {
            // Nothing appended since the chain's end: no delta (two deltas starting at
            // one point would make the chain ambiguous).
            return Ok(());
        }
        let id = chain.next_id;
        let header = Header { db_id: self.db_id, base, from, to };
        let r =
            self.log_winners(&header.from.resume, &header.to.resume).and_then(|w| self.write_delta(id, &header, &w));
        match r {
            Ok(n) => {
                chain.files.push(id);
                chain.at = Some(header.to);
                chain.next_id = id + 1;
                self.ckpt.deltas_written.fetch_add(1, Ordering::Relaxed);
                self.ckpt.last_delta_entries.store(n, Ordering::Relaxed);
                self.ckpt.last_delta_us.store(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                if !matches!(e, Error::Closed) {
                    self.ckpt.failures.fetch_add(1, Ordering::Relaxed);
                }
                Err(e)
            }
        }
    }

    /// The newest record of every key between the resume points `from` and `to` (see the
    /// module docs, "Reading the records").
    fn log_winners(&self, from: &[Resume], to: &[Resume]) -> Result<Winners> {
        let mut keys = Vec::new();
        // Each key's range in `keys`, its first 16 bytes inline (the sort compares those
        // first), and its entry.
        let mut found: Vec<(usize, usize, (u64, u64), Newest)> = Vec::new();
        let list: Vec<(u64, super::SegMeta)> = self.segs.lock().iter().map(|(&a, &m)| (a, m)).collect();
        for (addr, m) in list {
            if self.stop.load(Ordering::Acquire) {
                return Err(Error::Closed);
            }
            let _pin = epoch::pin();
            // Still one of the store's segments (not retired since the list was taken).
            if self.segs.lock().get(&addr).map(|x| x.tag) != Some(m.tag) {
                continue;
            }
            let raw = self.region.slice_checked(addr, SEG_HEADER_LEN as usize, "segment header")?;
            // No magic: the cleaner zeroed it and is about to unlist the segment (retired:
            // skipped, as one unlisted already).
            let Some(h) = SegHeader::decode(raw).map_err(|d| self.region.corruption(addr, d))? else { continue };
            let (Some(f), Some(t)) = (from.get(h.shard as usize), to.get(h.shard as usize)) else {
                return Err(self.region.corruption(addr, "segment of a shard the store does not have"));
            };
            let gen = m.tag.gen;
            // Generations the stretch covers: from `f`'s on; up to `t`'s (to its resume
            // length), or below it when that shard had no open segment.
            if gen < f.gen || gen > t.gen || (gen == t.gen && t.seg.is_none()) {
                continue;
            }
            let start = match f.seg {
                Some((salt, len)) if gen == f.gen => {
                    if salt != m.tag.salt {
                        return Err(self.region.corruption(addr, "the delta's start names another segment"));
                    }
                    len as usize
                }
                _ => 0,
            };
            let end = match t.seg {
                Some((_, len)) if gen == t.gen => len as usize,
                _ => match m.sealed {
                    Some(l) => l as usize,
                    None => return Err(self.region.corruption(addr, "an unsealed segment before the log's end")),
                },
            };
            let base = addr + SEG_HEADER_LEN;
            let data = self.region.slice_checked(base, end, "segment")?;
            let mut pos = start;
            while pos < end {
                let rest = data.get(pos..).unwrap_or_default();
                let len = layout::decode_record_headers(rest, m.tag, |e| {
                    let off = keys.len();
                    keys.extend_from_slice(e.key);
                    let size = layout::entry_len(e.key.len(), e.value.len()) as u32;
                    let loc = base + (pos + e.offset) as u64;
                    found.push((off, e.key.len(), head(e.key), (e.seq, loc, e.kind, size)));
                })
                .map_err(|d| self.region.corruption(base + pos as u64, d))?;
                pos += len;
            }
        }
        // (Ranges of `keys` this function made.)
        let key = |off: usize, len: usize| &keys[off..off + len];
        // By key (stable: in the order read); of a key's run, the winner is the newest
        // by `newer`, the later read on a tie.
        found.sort_by(|a, b| cmp_keys(a.2, key(a.0, a.1), b.2, key(b.0, b.1)));
        let mut entries: Vec<(usize, usize, Newest)> = Vec::with_capacity(found.len());
        for (off, len, _, v) in found {
            match entries.last_mut() {
                Some(last) if key(last.0, last.1) == key(off, len) => {
                    if !newer(&last.2, &v) {
                        *last = (off, len, v);
                    }
                }
                _ => entries.push((off, len, v)),
            }
        }
        Ok(Winners { keys, entries })
    }

    /// Write delta `id`; returns its entries.
    fn write_delta(&self, id: u64, header: &Header, w: &Winners) -> Result<u64> {
        let fs = &self.ckpt.fs;
        let dir = &self.ckpt.dir;
        let name = file_name(id);
        let tmp = dir.join(format!("{name}.tmp"));
        let mut body = Vec::with_capacity(w.entries.len() * 48);
        for &(off, len, (seq, loc, kind, size)) in &w.entries {
            let k = w.keys.get(off..off + len).unwrap_or_default();
            encode_entry_flags(&mut body, k, seq, loc, size, flags_of(kind));
        }
        let mut f = fs.create(&tmp)?;
        f.append(&header.encode())?;
        f.append(&body)?;
        f.append(&encode_trailer(w.entries.len() as u64, crc32c::crc32c(&body)))?;
        f.sync()?;
        drop(f);
        fs.rename(&tmp, &dir.join(&name))?;
        fs.sync_dir(dir)?;
        Ok(w.entries.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(shards: u64) -> Header {
        let r =
            |g: u64| (0..shards).map(|i| Resume { gen: g + i, seg: (i % 2 == 0).then_some((0x5a5a, 128)) }).collect();
        Header {
            db_id: 9,
            base: BaseId { horizon: 40, count: 3, crc: 0xdead_beef },
            from: Point { horizon: 40, resume: r(2) },
            to: Point { horizon: 77, resume: r(5) },
        }
    }

    fn file(h: &Header, entries: &[RawEntry<'_>]) -> Vec<u8> {
        let mut b = h.encode();
        let mut body = Vec::new();
        for e in entries {
            encode_entry_flags(&mut body, e.0, e.1, e.2, e.3, e.4);
        }
        b.extend_from_slice(&body);
        b.extend_from_slice(&encode_trailer(entries.len() as u64, crc32c::crc32c(&body)));
        b
    }

    #[test]
    fn round_trip_and_every_flipped_byte_is_refused() {
        let h = header(2);
        let es: Vec<RawEntry<'_>> = vec![(b"a", 41, 4096, 40, 0), (b"b", 50, 8192, 33, 1), (b"c", 12, 9000, 20, 2)];
        let b = file(&h, &es);
        let (got, entries) = decode(&b, 2, 9).unwrap();
        assert_eq!(got, h);
        assert_eq!(entries, es);
        assert_eq!(kind_of(entries[2].4), Kind::Moved);
        assert!(decode(&b, 3, 9).is_err(), "another shard count");
        assert!(decode(&b, 2, 8).is_err(), "another store");
        let hl = Header::encoded_len(2);
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x04;
            // The header's two paddings and the trailer's are not covered.
            let padding =
                (44..48).contains(&i) || (hl - 4..hl).contains(&i) || (b.len() - 12..b.len() - 8).contains(&i);
            if !padding {
                assert!(decode(&bad, 2, 9).is_err(), "flip at {i} accepted");
            }
        }
        for cut in 0..b.len() {
            assert!(decode(&b[..cut], 2, 9).is_err(), "cut at {cut} accepted");
        }
        let bad_flags = file(&h, &[(b"a", 1, 64, 30, 3)]);
        assert!(decode(&bad_flags, 2, 9).unwrap_err().contains("flags"));
    }

    #[test]
    fn names_round_trip_and_temp_files_are_not_deltas() {
        assert_eq!(parse_name(&file_name(42)), Some(42));
        assert_eq!(parse_name("NATIVE-DELTA-0000000042.tmp"), None);
        assert_eq!(parse_name("NATIVE-CHECKPOINT"), None);
        assert_eq!(parse_name("NATIVE-DELTA-42"), None);
    }

    /// The chain follows `from` → `to` links from the checkpoint's point, skips files of
    /// another checkpoint, and stops at a gap (reporting it).
    #[test]
    fn the_chain_follows_links_and_stops_at_a_gap() {
        let base = BaseId { horizon: 40, count: 3, crc: 7 };
        let p = |h: u64| Point { horizon: h, resume: vec![Resume { gen: h, seg: None }] };
        let mk = |from: u64, to: u64, base: BaseId| {
            file(&Header { db_id: 9, base, from: p(from), to: p(to) }, &[(b"k", to, 64, 30, 0)])
        };
        let a = mk(40, 50, base);
        let b = mk(50, 60, base);
        let other = mk(60, 70, BaseId { crc: 8, ..base });
        let gap = mk(70, 80, base);
        let files: Vec<(u64, &[u8])> = vec![(3, &gap), (2, &b), (1, &a), (4, &other)];
        let (chain, why) = chain_of(&files, 1, 9, base, &p(40));
        assert_eq!(chain.iter().map(|c| c.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!(why.unwrap().contains("does not continue"));
        let mut damaged = a.clone();
        damaged[70] ^= 1;
        let files: Vec<(u64, &[u8])> = vec![(1, &damaged), (2, &b)];
        let (chain, why) = chain_of(&files, 1, 9, base, &p(40));
        assert!(chain.is_empty());
        assert!(why.is_some());
    }
}
