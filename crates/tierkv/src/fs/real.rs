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
