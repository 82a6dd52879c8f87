//! The file seam: everything an engine writes to disk goes through [`Fs`].
//!
//! [`RealFs`] is the operating system; [`FaultFs`] is an in-memory file system for tests
//! that forgets unsynced data at a simulated crash (cleanly, or page by page like a real
//! file system: [`crash_model`]) and fails chosen operations with EIO or
//! ENOSPC (like LevelDB's fault-injection env). [`CountingFs`] wraps any `Fs` and counts
//! bytes written and read, for write-amplification accounting.

pub mod crash_model;
mod fault;
mod real;

use std::fmt::Debug;
use std::io;
use std::path::Path;
use std::sync::Arc;

pub use crash_model::CrashMode;
pub use fault::{FaultFs, FaultKind};
pub use real::RealFs;

/// A file opened through an [`Fs`]: append-only writes, positional reads.
pub trait FsFile: Send + Sync + Debug {
    /// Append `data` at the end.
    fn append(&mut self, data: &[u8]) -> io::Result<()>;
    /// Read up to `buf.len()` bytes at `off`; returns how many were read (0 at end).
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// Make everything appended so far durable (fsync).
    fn sync(&mut self) -> io::Result<()>;
    /// Current length.
    fn len(&self) -> io::Result<u64>;
    /// True when empty.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// The whole file as memory, when it was opened with [`Fs::open_immutable`] on a file
    /// system that maps files. Reads through it are not counted by [`CountingFs`]; callers
    /// count them with [`FsFile::note_read`].
    fn mapped(&self) -> Option<&[u8]> {
        None
    }
    /// Account `n` bytes read through [`FsFile::mapped`].
    fn note_read(&self, _n: u64) {}
    /// Ask the file system to start writing `len` bytes at `off` back to the device now,
    /// without waiting for them (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`). A hint
    /// only: it makes nothing durable (only [`FsFile::sync`] does), so a file system that
    /// models durability ignores it. It makes a later `sync` wait for less.
    fn start_writeback(&self, _off: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
}

/// An append-only file that starts the write-back of what was appended whenever another
/// `every` bytes are waiting (RocksDB's `bytes_per_sync`/`wal_bytes_per_sync`), so the
/// next [`FsFile::sync`] finds at most about `every` dirty bytes instead of everything
/// since the last one. A log that is synced now and then (a WAL before a MemTable switch,
/// a demotion's sync) otherwise pays for the whole backlog inside the sync, with its
/// writer lock held.
#[derive(Debug)]
pub struct WritebackAhead {
    inner: Box<dyn FsFile>,
    every: u64,
    /// Bytes below this offset were handed to the write-back (or synced).
    started: u64,
    /// The inner file's length, kept here (asking a fault-injecting file takes a lock).
    len: u64,
}

/// Logs that are synced now and then (the LSM's WAL, HoaKV's cold value log) start the
/// write-back of their records every this many bytes (RocksDB's `wal_bytes_per_sync`), so a
/// sync — at a MemTable switch, for a synced batch, for HoaKV's demotions, each with writers
/// held up — finds at most about this much not yet handed to the device (it still waits for
/// pages in flight) instead of every byte since the last one. Measured in a 2-thread HoaKV
/// fill: its writers slept in these syncs (about 100 ms per MemTable switch) and in the
/// commit queue and writer lock behind them.
pub const LOG_WRITEBACK_EVERY: u64 = 1 << 20;

/// Create (or truncate) the log file `path` on `fs`: appends start their write-back every
/// [`LOG_WRITEBACK_EVERY`] bytes ([`WritebackAhead`]).
pub fn create_log(fs: &dyn Fs, path: &Path) -> io::Result<Box<dyn FsFile>> {
    Ok(Box::new(WritebackAhead::new(fs.create(path)?, LOG_WRITEBACK_EVERY)?))
}

/// Page size the write-back hints are aligned to: the last, partial page is left alone
/// (it is written again by the next append).
const WRITEBACK_ALIGN: u64 = 4096;

impl WritebackAhead {
    /// Wrap `inner`, starting the write-back every `every` bytes (0: never; hints cover
    /// whole 4 KiB pages only).
    pub fn new(inner: Box<dyn FsFile>, every: u64) -> io::Result<WritebackAhead> {
        let len = inner.len()?;
        Ok(WritebackAhead { inner, every, started: len - len % WRITEBACK_ALIGN, len })
    }
}

impl FsFile for WritebackAhead {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.inner.append(data)?;
        self.len += data.len() as u64;
        if self.every > 0 && self.len - self.started >= self.every {
            let end = self.len - self.len % WRITEBACK_ALIGN;
            // Only whole pages (`every` below a page may leave none yet; a zero length
            // would mean "to the end of the file" to `sync_file_range`).
            if end > self.started {
                // A failed hint costs only the overlap it would have bought.
                let _ = self.inner.start_writeback(self.started, end - self.started);
                self.started = end;
            }
        }
        Ok(())
    }
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read_at(off, buf)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.inner.sync()?;
        self.started = self.len - self.len % WRITEBACK_ALIGN;
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.len)
    }
    fn mapped(&self) -> Option<&[u8]> {
        self.inner.mapped()
    }
    fn note_read(&self, n: u64) {
        self.inner.note_read(n)
    }
    fn start_writeback(&self, off: u64, len: u64) -> io::Result<()> {
        self.inner.start_writeback(off, len)
    }
}

/// A held exclusive lock on a store directory; released when dropped.
pub trait FsLock: Send + Sync + Debug {}

/// File-system operations an engine needs.
pub trait Fs: Send + Sync + Debug {
    /// Create `path` and its parents as directories.
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Create (or truncate) `path` for appending.
    fn create(&self, path: &Path) -> io::Result<Box<dyn FsFile>>;
    /// Open an existing file for reading and appending.
    fn open(&self, path: &Path) -> io::Result<Box<dyn FsFile>>;
    /// Open a file that will never change again (a finished SSTable) for reading. The real
    /// file system maps it (like LevelDB's mmap'd table files), so reads cost no system call.
    fn open_immutable(&self, path: &Path) -> io::Result<Box<dyn FsFile>> {
        self.open(path)
    }
    /// True when `path` exists.
    fn exists(&self, path: &Path) -> bool;
    /// Atomically rename `from` to `to` (replacing `to`). Durable after [`Fs::sync_dir`].
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Remove a file.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Names of the entries of `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Make the directory's entries (creations, renames, removals) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Take an exclusive lock on `path` (created if missing). Fails with
    /// `io::ErrorKind::WouldBlock` when another handle holds it.
    fn lock(&self, path: &Path) -> io::Result<Box<dyn FsLock>>;

    /// The whole content of `path`.
    fn read_all(&self, path: &Path) -> io::Result<Vec<u8>> {
        let f = self.open(path)?;
        let len = usize::try_from(f.len()?).map_err(|_| io::Error::other("file too large"))?;
        let mut buf = vec![0u8; len];
        let mut done = 0;
        while done < len {
            let n = f.read_at(done as u64, &mut buf[done..])?;
            if n == 0 {
                buf.truncate(done);
                break;
            }
            done += n;
        }
        Ok(buf)
    }

    /// Replace `path` atomically with `data`: write a temp file, fsync, rename, fsync dir.
    fn write_atomic(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
        tmp_name.push(".tmp");
        let tmp = dir.join(tmp_name);
        let mut f = self.create(&tmp)?;
        f.append(data)?;
        f.sync()?;
        drop(f);
        self.rename(&tmp, path)?;
        self.sync_dir(dir)
    }
}

/// Bytes moved through a [`CountingFs`], counted per thread (every SSTable block read
/// bumps one; a shared atomic would bounce its line between reader threads).
#[derive(Debug, Default)]
pub struct IoCounters(crate::counters::Counters<3>);

impl IoCounters {
    const WRITTEN: usize = 0;
    const READ: usize = 1;
    const SYNCS: usize = 2;

    /// Bytes appended to files.
    pub fn bytes_written(&self) -> u64 {
        self.0.get(Self::WRITTEN)
    }
    /// Bytes read from files.
    pub fn bytes_read(&self) -> u64 {
        self.0.get(Self::READ)
    }
    /// fsync calls (files and directories).
    pub fn syncs(&self) -> u64 {
        self.0.get(Self::SYNCS)
    }
}

/// An [`Fs`] that counts the bytes its files write and read.
#[derive(Debug, Clone)]
pub struct CountingFs {
    inner: Arc<dyn Fs>,
    counters: Arc<IoCounters>,
}

impl CountingFs {
    /// Wrap `inner`.
    pub fn new(inner: Arc<dyn Fs>) -> Self {
        CountingFs { inner, counters: Arc::new(IoCounters::default()) }
    }
    /// The counters.
    pub fn counters(&self) -> &IoCounters {
        &self.counters
    }
}

#[derive(Debug)]
struct CountingFile {
    inner: Box<dyn FsFile>,
    counters: Arc<IoCounters>,
}

impl FsFile for CountingFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.inner.append(data)?;
        self.counters.0.add(IoCounters::WRITTEN, data.len() as u64);
        Ok(())
    }
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read_at(off, buf)?;
        self.counters.0.add(IoCounters::READ, n as u64);
        Ok(n)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.counters.0.add(IoCounters::SYNCS, 1);
        self.inner.sync()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn mapped(&self) -> Option<&[u8]> {
        self.inner.mapped()
    }
    fn note_read(&self, n: u64) {
        self.counters.0.add(IoCounters::READ, n);
    }
    fn start_writeback(&self, off: u64, len: u64) -> io::Result<()> {
        self.inner.start_writeback(off, len)
    }
}

impl Fs for CountingFs {
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        self.inner.create_dir_all(path)
    }
    fn create(&self, path: &Path) -> io::Result<Box<dyn FsFile>> {
        Ok(Box::new(CountingFile { inner: self.inner.create(path)?, counters: self.counters.clone() }))
    }
    fn open(&self, path: &Path) -> io::Result<Box<dyn FsFile>> {
        Ok(Box::new(CountingFile { inner: self.inner.open(path)?, counters: self.counters.clone() }))
    }
    fn open_immutable(&self, path: &Path) -> io::Result<Box<dyn FsFile>> {
        Ok(Box::new(CountingFile { inner: self.inner.open_immutable(path)?, counters: self.counters.clone() }))
    }
    fn exists(&self, path: &Path) -> bool {
        self.inner.exists(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        self.inner.remove(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.inner.list(dir)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.counters.0.add(IoCounters::SYNCS, 1);
        self.inner.sync_dir(dir)
    }
    fn lock(&self, path: &Path) -> io::Result<Box<dyn FsLock>> {
        self.inner.lock(path)
    }
}

/// fsync a directory of the real file system.
pub fn sync_dir_path(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Mutex;

    /// A file that records the write-back hints it gets.
    #[derive(Debug, Default)]
    struct Hints {
        len: u64,
        hints: Arc<Mutex<Vec<(u64, u64)>>>,
    }

    impl FsFile for Hints {
        fn append(&mut self, data: &[u8]) -> io::Result<()> {
            self.len += data.len() as u64;
            Ok(())
        }
        fn read_at(&self, _off: u64, _buf: &mut [u8]) -> io::Result<usize> {
            Ok(0)
        }
        fn sync(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn len(&self) -> io::Result<u64> {
            Ok(self.len)
        }
        fn start_writeback(&self, off: u64, len: u64) -> io::Result<()> {
            self.hints.lock().unwrap().push((off, len));
            Ok(())
        }
    }

    #[test]
    fn writeback_ahead_hints_every_n_bytes_in_whole_pages_and_restarts_after_a_sync() {
        let hints = Arc::new(Mutex::new(Vec::new()));
        let inner = Hints { len: 5000, hints: hints.clone() };
        // An existing file: its whole pages count as handed over already.
        let mut f = WritebackAhead::new(Box::new(inner), 10_000).unwrap();
        for _ in 0..30 {
            f.append(&[7; 1000]).unwrap();
        }
        // 5,000 + 30,000 bytes: a hint once 10,000 bytes wait past the last one (at 15,000,
        // 23,000 and 31,000), each up to the last whole page: contiguous, no overlap.
        assert_eq!(*hints.lock().unwrap(), vec![(4096, 8192), (12288, 8192), (20480, 8192)]);
        assert_eq!(f.len().unwrap(), 35_000);
        f.sync().unwrap();
        hints.lock().unwrap().clear();
        for _ in 0..7 {
            f.append(&[7; 1000]).unwrap();
        }
        // After the sync, bytes count from the sync's last whole page (32,768): 42,000 is
        // 9,232 past it, no hint yet; 43,000 is past 10,000.
        assert!(hints.lock().unwrap().is_empty());
        f.append(&[7; 1000]).unwrap();
        assert_eq!(*hints.lock().unwrap(), vec![(32768, 8192)]);
    }

    #[test]
    fn writeback_ahead_never_hints_an_empty_range() {
        let hints = Arc::new(Mutex::new(Vec::new()));
        let mut f = WritebackAhead::new(Box::new(Hints { hints: hints.clone(), ..Hints::default() }), 100).unwrap();
        for _ in 0..100 {
            f.append(&[1; 100]).unwrap();
        }
        // Every 100 bytes is due, but a hint waits for a whole page past the last one.
        let h = hints.lock().unwrap().clone();
        assert_eq!(h, vec![(0, 4096), (4096, 4096)]);
    }

    #[test]
    fn the_real_file_system_takes_write_back_hints() {
        let d = tempfile::tempdir().unwrap();
        let mut f = WritebackAhead::new(RealFs.create(&d.path().join("log")).unwrap(), 8192).unwrap();
        for i in 0..64u8 {
            f.append(&[i; 1000]).unwrap();
        }
        f.sync().unwrap();
        let mut buf = [0u8; 1000];
        assert_eq!(f.read_at(63_000, &mut buf).unwrap(), 1000);
        assert_eq!(buf, [63; 1000]);
        // The hint itself (the wrapper drops its hints' errors), on a range that starts in
        // the file and runs past its end.
        RealFs.open(&d.path().join("log")).unwrap().start_writeback(0, 1 << 20).unwrap();
    }
}
