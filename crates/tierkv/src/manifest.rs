//! The MANIFEST (shared): an append-only log of version edits describing a store's
//! SSTables (docs/format/manifest.md).
//!
//! A version is the set of live files, each with its key range, size and `{total, live}`
//! key counts, the compaction candidate list, the next file number and a design counter
//! (`slmdb`: the generation of the last memtable whose flush is committed). An edit changes
//! some of these; [`Manifest::log`] appends it as one checksummed record and fsyncs, which is
//! the edit's commit point.
//!
//! `CURRENT` names the live manifest. Opening a store always starts a new manifest holding
//! one snapshot of the recovered version, then switches `CURRENT` to it atomically (write
//! temp, fsync, rename, fsync dir) and removes the old one; the same switch happens when the
//! manifest grows past 4 MiB. So a torn tail is never appended to.
//!
//! Recovery reads every record; a record that runs past the end of the file, or whose
//! checksum fails and that ends exactly at the end of the file or shows a zero-filled lost
//! page, is a torn tail (the crash hit the append; [`crate::format::read_frames_at`]) and is
//! dropped. Any other bad record is [`Error::Corruption`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::Cursor;
use crate::fs::{Fs, FsFile};

/// Manifest file magic (first record's payload starts after an 8-byte file header).
pub const MAGIC: &[u8; 8] = b"TKVMAN\0\x01";
/// Switch to a fresh manifest once the live one is larger than this.
pub const MAX_SIZE: u64 = 4 << 20;

/// What the version knows of one SSTable.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FileMeta {
    /// Keys written to the file.
    pub total: u64,
    /// Keys of the file the index still points at.
    pub live: u64,
    /// File size in bytes.
    pub size: u64,
    /// Smallest key.
    pub smallest: Vec<u8>,
    /// Largest key.
    pub largest: Vec<u8>,
    /// LSM level (0 for designs with one level). Level 0 is encoded as tag 1, any other
    /// level as tag 7, so manifests of single-level designs are unchanged.
    pub level: u32,
}

/// The state a manifest describes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Version {
    /// Live files by number.
    pub files: BTreeMap<u64, FileMeta>,
    /// Compaction candidates (file numbers).
    pub candidates: BTreeSet<u64>,
    /// Next file number to hand out.
    pub next_file: u64,
    /// Design counter (slmdb: last memtable generation whose flush is committed).
    pub counter: u64,
}

/// One change to a [`Version`]. Tags on disk never renumber.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit {
    /// Tag 1: a new file at level 0; tag 7: a new file at another level (the same edit
    /// with the level written first).
    AddFile(u64, FileMeta),
    /// Tag 2: a file is gone.
    RemoveFile(u64),
    /// Tag 3: a file's live-key count.
    SetLive(u64, u64),
    /// Tag 4: the candidate list, replaced whole.
    Candidates(Vec<u64>),
    /// Tag 5: the next file number.
    NextFile(u64),
    /// Tag 6: the design counter.
    Counter(u64),
}

impl Version {
    /// Apply `edits` in order.
    pub fn apply(&mut self, edits: &[Edit]) {
        for e in edits {
            match e {
                Edit::AddFile(n, m) => {
                    self.files.insert(*n, m.clone());
                }
                Edit::RemoveFile(n) => {
                    self.files.remove(n);
                    self.candidates.remove(n);
                }
                Edit::SetLive(n, l) => {
                    if let Some(f) = self.files.get_mut(n) {
                        f.live = *l;
                    }
                }
                Edit::Candidates(c) => self.candidates = c.iter().copied().collect(),
                Edit::NextFile(n) => self.next_file = *n,
                Edit::Counter(c) => self.counter = *c,
            }
        }
    }

    /// (files, live keys, total keys, candidates, file bytes) over every file.
    pub fn summary(&self) -> (u64, u64, u64, u64, u64) {
        let f = &self.files;
        (
            f.len() as u64,
            f.values().map(|m| m.live).sum(),
            f.values().map(|m| m.total).sum(),
            self.candidates.len() as u64,
            f.values().map(|m| m.size).sum(),
        )
    }

    /// The edits that rebuild this version from nothing.
    pub fn snapshot(&self) -> Vec<Edit> {
        let mut v = vec![Edit::NextFile(self.next_file), Edit::Counter(self.counter)];
        v.extend(self.files.iter().map(|(n, m)| Edit::AddFile(*n, m.clone())));
        v.push(Edit::Candidates(self.candidates.iter().copied().collect()));
        v
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// Encode edits as one record payload.
pub fn encode_edits(edits: &[Edit]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in edits {
        match e {
            Edit::AddFile(n, m) => {
                if m.level == 0 {
                    out.push(1);
                } else {
                    out.push(7);
                    out.extend_from_slice(&m.level.to_le_bytes());
                }
                for v in [*n, m.total, m.live, m.size] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                put_bytes(&mut out, &m.smallest);
                put_bytes(&mut out, &m.largest);
            }
            Edit::RemoveFile(n) => {
                out.push(2);
                out.extend_from_slice(&n.to_le_bytes());
            }
            Edit::SetLive(n, l) => {
                out.push(3);
                out.extend_from_slice(&n.to_le_bytes());
                out.extend_from_slice(&l.to_le_bytes());
            }
            Edit::Candidates(c) => {
                out.push(4);
                out.extend_from_slice(&(c.len() as u32).to_le_bytes());
                for n in c {
                    out.extend_from_slice(&n.to_le_bytes());
                }
            }
            Edit::NextFile(n) => {
                out.push(5);
                out.extend_from_slice(&n.to_le_bytes());
            }
            Edit::Counter(n) => {
                out.push(6);
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
    }
    out
}

/// Decode a record payload.
pub fn decode_edits(p: &[u8]) -> std::result::Result<Vec<Edit>, String> {
    let mut c = Cursor::new(p);
    let mut out = Vec::new();
    let short = || "truncated edit".to_string();
    while c.remaining() > 0 {
        let tag = c.u8().ok_or_else(short)?;
        let e = match tag {
            1 | 7 => {
                let level = if tag == 7 { c.u32().ok_or_else(short)? } else { 0 };
                let n = c.u64().ok_or_else(short)?;
                let total = c.u64().ok_or_else(short)?;
                let live = c.u64().ok_or_else(short)?;
                let size = c.u64().ok_or_else(short)?;
                let l = c.u32().ok_or_else(short)? as usize;
                let smallest = c.bytes(l).ok_or_else(short)?.to_vec();
                let l = c.u32().ok_or_else(short)? as usize;
                let largest = c.bytes(l).ok_or_else(short)?.to_vec();
                Edit::AddFile(n, FileMeta { total, live, size, smallest, largest, level })
            }
            2 => Edit::RemoveFile(c.u64().ok_or_else(short)?),
            3 => Edit::SetLive(c.u64().ok_or_else(short)?, c.u64().ok_or_else(short)?),
            4 => {
                let n = c.u32().ok_or_else(short)? as usize;
                if n > c.remaining() / 8 {
                    return Err(short());
                }
                Edit::Candidates((0..n).map(|_| c.u64().ok_or_else(short)).collect::<std::result::Result<_, _>>()?)
            }
            5 => Edit::NextFile(c.u64().ok_or_else(short)?),
            6 => Edit::Counter(c.u64().ok_or_else(short)?),
            t => return Err(format!("unknown edit tag {t}")),
        };
        out.push(e);
    }
    Ok(out)
}

pub use crate::format::frame;

/// The live manifest, open for appending.
#[derive(Debug)]
pub struct Manifest {
    dir: PathBuf,
    number: u64,
    file: Box<dyn FsFile>,
    size: u64,
}

fn manifest_name(n: u64) -> String {
    format!("MANIFEST-{n:06}")
}

impl Manifest {
    /// Start manifest `number` holding `version`'s snapshot and make it current.
    pub fn create(fs: &dyn Fs, dir: &Path, number: u64, version: &Version) -> Result<Manifest> {
        let path = dir.join(manifest_name(number));
        let mut file = fs.create(&path)?;
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&frame(&encode_edits(&version.snapshot())));
        file.append(&bytes)?;
        file.sync()?;
        fs.sync_dir(dir)?;
        fs.write_atomic(&dir.join("CURRENT"), format!("{}\n", manifest_name(number)).as_bytes())?;
        Ok(Manifest { dir: dir.to_path_buf(), number, file, size: bytes.len() as u64 })
    }

    /// True when `dir` has a `CURRENT` file.
    pub fn exists(fs: &dyn Fs, dir: &Path) -> bool {
        fs.exists(&dir.join("CURRENT"))
    }

    /// Read the current manifest of `dir`: the recovered version, the manifest number, and
    /// whether a torn last record was dropped (the caller decides whether a torn append was
    /// possible: only while a commit was in flight).
    pub fn recover(fs: &dyn Fs, dir: &Path) -> Result<(Version, u64, bool)> {
        let cur_path = dir.join("CURRENT");
        let cur = fs.read_all(&cur_path)?;
        let name = std::str::from_utf8(&cur)
            .ok()
            .and_then(|s| s.strip_suffix('\n'))
            .filter(|s| s.starts_with("MANIFEST-"))
            .ok_or_else(|| Error::corruption(&cur_path, 0, "CURRENT does not name a manifest"))?;
        let number: u64 = name
            .trim_start_matches("MANIFEST-")
            .parse()
            .map_err(|_| Error::corruption(&cur_path, 0, "CURRENT names a malformed manifest"))?;
        let path = dir.join(name);
        if !fs.exists(&path) {
            return Err(Error::corruption(&path, 0, "the manifest named by CURRENT is missing"));
        }
        let data = fs.read_all(&path)?;
        let (version, torn) = parse(&data).map_err(|(off, d)| Error::corruption(&path, off, d))?;
        Ok((version, number, torn))
    }

    /// Append `edits` as one record and fsync: the commit point of the edit. Switches to a
    /// new manifest (holding `after`, the version with the edits applied) when this one has
    /// grown past [`MAX_SIZE`].
    pub fn log(&mut self, fs: &dyn Fs, edits: &[Edit], after: &Version) -> Result<()> {
        if self.size > MAX_SIZE {
            let old = self.dir.join(manifest_name(self.number));
            *self = Manifest::create(fs, &self.dir, self.number + 1, after)?;
            let _ = fs.remove(&old);
            return Ok(());
        }
        let rec = frame(&encode_edits(edits));
        self.file.append(&rec)?;
        self.file.sync()?;
        self.size += rec.len() as u64;
        Ok(())
    }

    /// This manifest's number.
    pub fn number(&self) -> u64 {
        self.number
    }

    /// File name of manifest `n`.
    pub fn name(n: u64) -> String {
        manifest_name(n)
    }
}

/// Parse a whole manifest file: the version, and whether a torn last record was dropped.
/// Errors carry the offset of the bad record.
pub fn parse(data: &[u8]) -> std::result::Result<(Version, bool), (u64, String)> {
    if data.get(..8) != Some(MAGIC.as_slice()) {
        return Err((0, "bad manifest magic".into()));
    }
    let mut v = Version::default();
    let (records, torn) = crate::format::read_frames_at(data.get(8..).unwrap_or(&[]), 8)
        .map_err(|(off, d)| (off + 8, format!("manifest {d}")))?;
    for (off, payload) in &records {
        let edits = decode_edits(payload).map_err(|d| (off + 8, d))?;
        v.apply(&edits);
    }
    let records = records.len();
    if records == 0 {
        return Err((8, "manifest holds no complete record".into()));
    }
    Ok((v, torn))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Version {
        let mut v = Version { next_file: 9, counter: 3, ..Default::default() };
        v.apply(&[
            Edit::AddFile(
                4,
                FileMeta { total: 10, live: 7, size: 4096, smallest: b"a".to_vec(), largest: b"m".to_vec(), level: 0 },
            ),
            Edit::AddFile(
                5,
                FileMeta { total: 5, live: 5, size: 999, smallest: b"c".to_vec(), largest: b"z".to_vec(), level: 0 },
            ),
            Edit::AddFile(
                6,
                FileMeta { total: 3, live: 3, size: 512, smallest: b"b".to_vec(), largest: b"d".to_vec(), level: 2 },
            ),
            Edit::Candidates(vec![4]),
        ]);
        v
    }

    #[test]
    fn snapshot_round_trips_and_torn_tail_is_dropped() {
        let v = sample();
        let mut data = MAGIC.to_vec();
        data.extend_from_slice(&frame(&encode_edits(&v.snapshot())));
        assert_eq!(parse(&data), Ok((v.clone(), false)));
        let edit = frame(&encode_edits(&[Edit::RemoveFile(4)]));
        // Every strict prefix of the second record is a torn tail: the first state survives.
        for cut in 0..edit.len() {
            let mut d = data.clone();
            d.extend_from_slice(&edit[..cut]);
            assert_eq!(parse(&d), Ok((v.clone(), cut > 0)), "cut {cut}");
        }
        let mut full = data.clone();
        full.extend_from_slice(&edit);
        let mut want = v.clone();
        want.apply(&[Edit::RemoveFile(4)]);
        assert_eq!(parse(&full), Ok((want, false)));
        // A damaged record followed by another is corruption, not a torn tail.
        let mut bad = data.clone();
        let mut e2 = edit.clone();
        e2[9] ^= 1;
        bad.extend_from_slice(&e2);
        bad.extend_from_slice(&edit);
        assert!(parse(&bad).is_err());
        // A damaged first record is an error too (nothing to recover).
        let mut first = data.clone();
        first[20] ^= 0x40;
        assert!(parse(&first).is_err());
    }
}
