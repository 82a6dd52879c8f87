//! The snapshot file: a point-in-time copy of the state machine's store, with the applied
//! state it corresponds to (`docs/format/raft.md`, "Snapshot file").
//!
//! ```text
//! magic "TKVRSNAP" | header length u32 | header record (codec::encode_snapshot_header)
//! { key length u32 | value length u32 | key | value }*
//! 0xFFFFFFFF | entry count u64 | masked crc32c of every byte before it
//! ```
//!
//! The same bytes are the current snapshot on disk (`<dir>/raft/snapshot/current.snap`) and
//! the stream openraft sends to a lagging follower in chunks; the receiver verifies the whole
//! file (trailer checksum and count) before it touches its store. Written with a buffered
//! writer and `fsync`ed, then renamed into place (and the directory `fsync`ed), so the current
//! snapshot is always a complete one.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use crate::codec::{self, AppliedState, DecodeError};

/// First bytes of every snapshot file.
pub const MAGIC: &[u8; 8] = b"TKVRSNAP";
/// The key length that marks the trailer.
const END: u32 = u32::MAX;

/// Why a snapshot file could not be written or read.
#[derive(Debug)]
pub enum SnapshotError {
    /// The file system.
    Io(std::io::Error),
    /// The bytes are not a valid snapshot.
    Corrupt(String),
}

impl std::fmt::Display for SnapshotError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SnapshotError::Io(e) => write!(f, "snapshot file: {e}"),
            SnapshotError::Corrupt(m) => write!(f, "corrupt snapshot: {m}"),
        }
    }
}

impl std::error::Error for SnapshotError {}

impl From<std::io::Error> for SnapshotError {
    fn from(e: std::io::Error) -> Self {
        SnapshotError::Io(e)
    }
}

impl From<DecodeError> for SnapshotError {
    fn from(e: DecodeError) -> Self {
        SnapshotError::Corrupt(e.0)
    }
}

/// One entry of a snapshot: key and value.
pub type KeyValue = (Vec<u8>, Vec<u8>);

/// Writes a snapshot file.
#[derive(Debug)]
pub struct SnapshotWriter {
    w: BufWriter<File>,
    crc: u32,
    count: u64,
}

impl SnapshotWriter {
    /// Start a snapshot in `file` (truncated by the caller) with its header.
    pub fn new(file: File, id: &str, applied: &AppliedState) -> Result<SnapshotWriter, SnapshotError> {
        let mut s = SnapshotWriter { w: BufWriter::with_capacity(1 << 20, file), crc: 0, count: 0 };
        let header = codec::encode_snapshot_header(id, applied);
        s.put(MAGIC)?;
        s.put(&(header.len() as u32).to_le_bytes())?;
        s.put(&header)?;
        Ok(s)
    }

    fn put(&mut self, b: &[u8]) -> Result<(), SnapshotError> {
        self.crc = crc32c::crc32c_append(self.crc, b);
        self.w.write_all(b)?;
        Ok(())
    }

    /// Add one entry (keys in any order; the builder writes them in key order).
    pub fn add(&mut self, key: &[u8], value: &[u8]) -> Result<(), SnapshotError> {
        if key.len() > tierkv::options::MAX_KEY_SIZE || value.len() > tierkv::options::MAX_VALUE_SIZE {
            return Err(SnapshotError::Corrupt(format!("entry too large: key {} bytes", key.len())));
        }
        self.put(&(key.len() as u32).to_le_bytes())?;
        self.put(&(value.len() as u32).to_le_bytes())?;
        self.put(key)?;
        self.put(value)?;
        self.count += 1;
        Ok(())
    }

    /// Write the trailer and `fsync`; returns the number of entries.
    pub fn finish(mut self) -> Result<u64, SnapshotError> {
        self.put(&END.to_le_bytes())?;
        let count = self.count;
        self.put(&count.to_le_bytes())?;
        let c = tierkv::format::crc::mask(self.crc);
        self.w.write_all(&c.to_le_bytes())?;
        let f = self.w.into_inner().map_err(|e| SnapshotError::Io(e.into_error()))?;
        f.sync_all()?;
        Ok(count)
    }
}

/// Reads a snapshot file front to back, verifying the trailer at the end.
#[derive(Debug)]
pub struct SnapshotReader {
    r: BufReader<File>,
    crc: u32,
    count: u64,
    done: bool,
}

impl SnapshotReader {
    /// Open `file` (positioned at its start): read and check the magic and header.
    pub fn new(file: File) -> Result<(SnapshotReader, String, AppliedState), SnapshotError> {
        let mut s = SnapshotReader { r: BufReader::with_capacity(1 << 20, file), crc: 0, count: 0, done: false };
        let magic = s.take(8)?;
        if magic != MAGIC {
            return Err(SnapshotError::Corrupt("bad magic".into()));
        }
        let n = s.u32()? as usize;
        if n > 64 << 20 {
            return Err(SnapshotError::Corrupt(format!("header length {n}")));
        }
        let header = s.take(n)?;
        let (id, applied) = codec::decode_snapshot_header(&header)?;
        Ok((s, id, applied))
    }

    /// Open the file at `path`.
    pub fn open(path: &Path) -> Result<(SnapshotReader, String, AppliedState), SnapshotError> {
        SnapshotReader::new(File::open(path)?)
    }

    fn take(&mut self, n: usize) -> Result<Vec<u8>, SnapshotError> {
        let mut b = vec![0u8; n];
        self.r.read_exact(&mut b).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => SnapshotError::Corrupt("truncated".into()),
            _ => SnapshotError::Io(e),
        })?;
        self.crc = crc32c::crc32c_append(self.crc, &b);
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, SnapshotError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The next entry; `None` after the trailer, which has then been verified (count and
    /// checksum). Entries returned before a failed verification must not be trusted: callers
    /// verify the whole file ([`verify`]) before applying any of it.
    pub fn next_entry(&mut self) -> Result<Option<KeyValue>, SnapshotError> {
        if self.done {
            return Ok(None);
        }
        let klen = self.u32()?;
        if klen == END {
            let b = self.take(8)?;
            let mut a = [0u8; 8];
            a.copy_from_slice(&b);
            let count = u64::from_le_bytes(a);
            let want = tierkv::format::crc::mask(self.crc);
            let mut c = [0u8; 4];
            self.r.read_exact(&mut c).map_err(|_| SnapshotError::Corrupt("truncated trailer".into()))?;
            if u32::from_le_bytes(c) != want {
                return Err(SnapshotError::Corrupt("checksum mismatch".into()));
            }
            if count != self.count {
                return Err(SnapshotError::Corrupt(format!("trailer says {count} entries, found {}", self.count)));
            }
            let mut rest = [0u8; 1];
            if self.r.read(&mut rest)? != 0 {
                return Err(SnapshotError::Corrupt("bytes after the trailer".into()));
            }
            self.done = true;
            return Ok(None);
        }
        let vlen = self.u32()?;
        if klen as usize > tierkv::options::MAX_KEY_SIZE || vlen as usize > tierkv::options::MAX_VALUE_SIZE {
            return Err(SnapshotError::Corrupt(format!("entry lengths {klen}/{vlen} beyond tierkv's limits")));
        }
        let key = self.take(klen as usize)?;
        let value = self.take(vlen as usize)?;
        self.count += 1;
        Ok(Some((key, value)))
    }
}

/// Read the whole file at `path` and check it; returns its id, applied state and entry count.
pub fn verify(path: &Path) -> Result<(String, AppliedState, u64), SnapshotError> {
    let (mut r, id, applied) = SnapshotReader::open(path)?;
    let mut n = 0u64;
    while r.next_entry()?.is_some() {
        n += 1;
    }
    Ok((id, applied, n))
}

/// `fsync` a directory (after a rename in it).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, entries: &[(&[u8], &[u8])]) {
        let f = File::create(path).expect("create");
        let mut w = SnapshotWriter::new(f, "s1", &AppliedState::default()).expect("writer");
        for (k, v) in entries {
            w.add(k, v).expect("add");
        }
        assert_eq!(w.finish().expect("finish"), entries.len() as u64);
    }

    /// Golden bytes (docs/format/raft.md): an empty-membership snapshot of one entry.
    #[test]
    fn golden_snapshot_file() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("s");
        write(&p, &[(b"k", b"v")]);
        let b = std::fs::read(&p).expect("read");
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        assert_eq!(
            hex,
            "544b5652534e4150150000000102000000733100000000000000000000bcfd525001000000010000006b76ffffffff0100000000000000e1e4d393"
        );
        let (id, applied, n) = verify(&p).expect("verify");
        assert_eq!((id.as_str(), applied, n), ("s1", AppliedState::default(), 1));
    }

    #[test]
    fn every_damage_is_detected() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("s");
        write(&p, &[(b"alpha", b"1"), (b"beta", b"22"), (b"gamma", b"")]);
        let good = std::fs::read(&p).expect("read");
        assert_eq!(verify(&p).expect("verify").2, 3);
        let q = d.path().join("bad");
        for i in 0..good.len() {
            let mut b = good.clone();
            b[i] ^= 0x01;
            std::fs::write(&q, &b).expect("write");
            assert!(verify(&q).is_err(), "flip at byte {i} accepted");
            std::fs::write(&q, &good[..i]).expect("write");
            assert!(verify(&q).is_err(), "truncation at {i} accepted");
        }
        let mut b = good.clone();
        b.push(0);
        std::fs::write(&q, &b).expect("write");
        assert!(verify(&q).is_err(), "trailing byte accepted");
    }
}
