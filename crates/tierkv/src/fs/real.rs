//! [`RealFs`]: the operating system's file system.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::{Fs, FsFile, FsLock};

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealFs;

#[derive(Debug)]
struct RealFile {
    file: File,
    len: u64,
}

impl FsFile for RealFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, self.len)?;
        self.len += data.len() as u64;
        Ok(())
    }
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.file.read_at(buf, off)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.len)
    }
    fn start_writeback(&self, off: u64, len: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        // A zero length would mean "to the end of the file".
        let (Ok(off), Ok(len @ 1..)) = (libc::off64_t::try_from(off), libc::off64_t::try_from(len)) else {
            return Ok(());
        };
        // SAFETY: a plain system call on a descriptor this file owns; it reads no memory
        // of ours.
        let r = unsafe { libc::sync_file_range(self.file.as_raw_fd(), off, len, libc::SYNC_FILE_RANGE_WRITE) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// A finished, never-again-modified file, mapped read-only.
#[derive(Debug)]
struct MappedFile {
    _file: File,
    map: Option<memmap2::Mmap>,
}

impl FsFile for MappedFile {
    fn append(&mut self, _data: &[u8]) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::PermissionDenied, "file was opened as immutable"))
    }
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        let data = self.mapped().unwrap_or(&[]);
        let start = usize::try_from(off).unwrap_or(usize::MAX).min(data.len());
        let n = buf.len().min(data.len() - start);
        buf[..n].copy_from_slice(&data[start..start + n]);
        Ok(n)
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.mapped().map_or(0, |m| m.len() as u64))
    }
    fn mapped(&self) -> Option<&[u8]> {
        Some(self.map.as_deref().unwrap_or(&[]))
    }
}

#[derive(Debug)]
struct RealLock {
    _file: File,
}
impl FsLock for RealLock {}

impl Fs for RealFs {
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }
    fn create(&self, path: &Path) -> io::Result<Box<dyn FsFile>> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        Ok(Box::new(RealFile { file, len: 0 }))
    }
    fn open(&self, path: &Path) -> io::Result<Box<dyn FsFile>> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len();
        Ok(Box::new(RealFile { file, len }))
    }
    fn open_immutable(&self, path: &Path) -> io::Result<Box<dyn FsFile>> {
        let file = OpenOptions::new().read(true).open(path)?;
        // An empty file cannot be mapped; it reads as empty.
        let map = if file.metadata()?.len() == 0 {
            None
        } else {
            // SAFETY: the file is finished and never written again by tierkv, and the store
            // directory is locked against other tierkv processes; it is only ever unlinked,
            // which leaves the mapping valid. (Another program truncating a store's files
            // under it is outside what any storage engine can defend against.)
            let map = unsafe { memmap2::Mmap::map(&file)? };
            // Reads of a finished table are block-sized and mostly random (point reads,
            // seeks): the kernel's default readahead around each fault pulls in up to 128 KiB
            // per 4 KiB block, which under a memory budget smaller than the data evicts the
            // pages just read (the thrash LevelDB shows on its mapped tables; measured here
            // before this: slmdb read 538 GB from disk for 1M keys under 128 MiB). Advice
            // only: a kernel that refuses it leaves the default.
            let _ = map.advise(memmap2::Advice::Random);
            Some(map)
        };
        Ok(Box::new(MappedFile { _file: file, map }))
    }
    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for e in std::fs::read_dir(dir)? {
            names.push(e?.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        super::sync_dir_path(dir)
    }
    fn lock(&self, path: &Path) -> io::Result<Box<dyn FsLock>> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        match file.try_lock() {
            Ok(()) => Ok(Box::new(RealLock { _file: file })),
            Err(std::fs::TryLockError::WouldBlock) => Err(io::Error::from(io::ErrorKind::WouldBlock)),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        }
    }
}
