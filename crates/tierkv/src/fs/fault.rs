//! [`FaultFs`]: an in-memory file system that loses unsynced data at a simulated crash and
//! fails chosen operations.
//!
//! Durability model (that of a POSIX file system without data journaling guarantees):
//! - appended bytes are durable once the file is `sync`ed;
//! - a created, renamed or removed name is durable once its directory is `sync_dir`ed;
//! - directories themselves are durable when created (a simplification: tierkv creates its
//!   directories once, before anything that needs them).
//!
//! [`FaultFs::crash_with`] returns the file system a crash would leave, in one of two
//! models ([`CrashMode`], described in [`super::crash_model`]): `Prefix` keeps exactly the
//! durable names, each file cut back to its synced length; `Pages` is a real file system's
//! range of outcomes (unsynced pages kept or lost one by one, lost ones reading as zeros or
//! cutting the file, unsynced directory changes kept or lost group by group, renames
//! atomically). [`FaultFs::crash`] uses the instance's mode ([`FaultFs::set_crash_mode`],
//! inherited by the crashed copy; default `Prefix`, or `Pages` when the environment variable
//! `TIERKV_FS_CRASH=pages` is set, so whole suites can run under the stricter model) with a
//! seed derived from the instance's seed and how many crashes and syncs it has seen.
//!
//! A crash point ([`FaultFs::crash_before_sync`], [`FaultFs::freeze`]) snapshots the
//! volatile state (names and file lengths) at that instant: what the process writes after it
//! never reached the file system, so no model may keep it.
//!
//! Fault injection: [`FaultFs::fail_after`] makes the n-th operation from now (every `Fs` and
//! file call counts) fail with EIO or ENOSPC, once or from then on.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use super::crash_model::{self, CrashMode};
use super::{Fs, FsFile, FsLock};

/// Which error an injected fault returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// EIO.
    Eio,
    /// ENOSPC.
    Enospc,
}

impl FaultKind {
    fn error(self) -> io::Error {
        match self {
            FaultKind::Eio => io::Error::from_raw_os_error(libc::EIO),
            FaultKind::Enospc => io::Error::from_raw_os_error(libc::ENOSPC),
        }
    }
}

#[derive(Debug, Default, Clone)]
struct MemFile {
    data: Vec<u8>,
    synced: usize,
}

#[derive(Debug)]
struct State {
    files: HashMap<u64, MemFile>,
    names: BTreeMap<PathBuf, u64>,
    durable_names: BTreeMap<PathBuf, u64>,
    dirs: BTreeSet<PathBuf>,
    locks: BTreeSet<PathBuf>,
    next_id: u64,
    ops: u64,
    fault: Option<(u64, FaultKind, bool)>,
    /// After a crash point: nothing more becomes durable.
    frozen: bool,
    /// A read-only file system: every operation that would change it fails with EROFS.
    read_only: bool,
    /// Panic at the next operation on a path containing this (tests of background panics).
    panic_on: Option<String>,
    /// Durability points (file and directory syncs) so far.
    sync_points: u64,
    /// Freeze just before this durability point takes effect.
    crash_at_sync: Option<u64>,
    /// Called when that crash point is reached (e.g. to freeze a PM device too).
    on_freeze: Option<FreezeHook>,
    /// The volatile state at the crash point: names and file lengths (files are
    /// append-only, so a length is a snapshot of the content).
    frozen_view: Option<(BTreeMap<PathBuf, u64>, HashMap<u64, usize>)>,
    /// The model [`FaultFs::crash`] uses, and its seed.
    crash_mode: CrashMode,
    crash_seed: u64,
    /// Crashes taken of this instance (varies the seed of each).
    crashes: u64,
}

/// The default crash model: `TIERKV_FS_CRASH` (`prefix` or `pages`, optionally `:seed`).
fn env_crash_mode() -> (CrashMode, u64) {
    static MODE: std::sync::OnceLock<(CrashMode, u64)> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| {
        let v = std::env::var("TIERKV_FS_CRASH").unwrap_or_default();
        let (m, seed) = v.split_once(':').unwrap_or((v.as_str(), "0"));
        (CrashMode::parse(m).unwrap_or(CrashMode::Prefix), seed.trim().parse().unwrap_or(0))
    })
}

/// A callback run when a crash point armed with [`FaultFs::crash_before_sync`] is reached.
struct FreezeHook(Box<dyn Fn() + Send>);

impl std::fmt::Debug for FreezeHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FreezeHook")
    }
}

impl Default for State {
    fn default() -> Self {
        let (crash_mode, crash_seed) = env_crash_mode();
        State {
            files: HashMap::new(),
            names: BTreeMap::new(),
            durable_names: BTreeMap::new(),
            dirs: BTreeSet::new(),
            locks: BTreeSet::new(),
            next_id: 0,
            ops: 0,
            fault: None,
            frozen: false,
            read_only: false,
            panic_on: None,
            sync_points: 0,
            crash_at_sync: None,
            on_freeze: None,
            frozen_view: None,
            crash_mode,
            crash_seed,
            crashes: 0,
        }
    }
}

impl State {
    /// Stop making anything durable and remember the volatile state of this instant.
    fn freeze(&mut self) {
        if !self.frozen {
            self.frozen = true;
            let lens = self.files.iter().map(|(id, f)| (*id, f.data.len())).collect();
            self.frozen_view = Some((self.names.clone(), lens));
        }
    }

    /// Count one operation; return the injected error if it is due.
    fn tick(&mut self) -> io::Result<()> {
        self.ops += 1;
        if let Some((at, kind, sticky)) = self.fault {
            if self.ops >= at {
                if !sticky {
                    self.fault = None;
                }
                return Err(kind.error());
            }
        }
        Ok(())
    }

    /// Panic if a panic was armed for `path` (disarming it first, so the unwinding code and
    /// later operations proceed).
    fn maybe_panic(&mut self, path: &Path) {
        if self.panic_on.as_deref().is_some_and(|p| path.to_string_lossy().contains(p)) {
            self.panic_on = None;
            panic!("FaultFs: injected panic at an operation on {}", path.display());
        }
    }

    /// A durability point (a file or directory sync): a crash point. Returns true when the
    /// file system is frozen (nothing becomes durable).
    fn sync_point(&mut self) -> bool {
        if !self.frozen {
            self.sync_points += 1;
            if self.crash_at_sync == Some(self.sync_points) {
                self.freeze();
                if let Some(f) = &self.on_freeze {
                    (f.0)();
                }
            }
        }
        self.frozen
    }

    /// [`State::tick`] for an operation that changes the file system.
    fn tick_write(&mut self) -> io::Result<()> {
        self.tick()?;
        if self.read_only {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        Ok(())
    }
}

/// The fault-injecting in-memory file system. Cheap to clone (shared handle).
#[derive(Debug, Clone, Default)]
pub struct FaultFs {
    state: Arc<Mutex<State>>,
}

impl FaultFs {
    /// An empty file system.
    pub fn new() -> Self {
        Self::default()
    }

    /// Fail the `n`-th operation from now (1 = the next one) with `kind`; with `sticky`, every
    /// operation from then on fails too.
    pub fn fail_after(&self, n: u64, kind: FaultKind, sticky: bool) {
        let mut s = self.state.lock();
        let at = s.ops + n.max(1);
        s.fault = Some((at, kind, sticky));
    }

    /// Make the file system read-only (as a kernel remount after errors does): from now on,
    /// creating, appending, syncing, renaming, removing and locking fail with EROFS; reads
    /// keep working. `false` makes it writable again.
    pub fn set_read_only(&self, on: bool) {
        self.state.lock().read_only = on;
    }

    /// Panic in the thread making the next operation on a path containing `fragment` (a
    /// file created, opened, renamed or removed there, or written or synced through a handle
    /// opened there): tests that a panic in a background job poisons the store.
    pub fn panic_on(&self, fragment: &str) {
        self.state.lock().panic_on = Some(fragment.to_string());
    }

    /// Freeze the file system just before its `n`-th durability point from now (file or
    /// directory sync, 1-based) takes effect, and call the hook set by
    /// [`FaultFs::on_freeze`]: a crash point between two syncs.
    pub fn crash_before_sync(&self, n: u64) {
        let mut s = self.state.lock();
        s.crash_at_sync = Some(s.sync_points + n);
    }

    /// Call `f` when the crash point armed by [`FaultFs::crash_before_sync`] is reached.
    pub fn on_freeze(&self, f: impl Fn() + Send + 'static) {
        self.state.lock().on_freeze = Some(FreezeHook(Box::new(f)));
    }

    /// Durability points (file and directory syncs) so far.
    pub fn sync_points(&self) -> u64 {
        self.state.lock().sync_points
    }

    /// True once frozen (a crash point was reached here or elsewhere).
    pub fn frozen(&self) -> bool {
        self.state.lock().frozen
    }

    /// Stop injecting faults.
    pub fn clear_faults(&self) {
        self.state.lock().fault = None;
    }

    /// Stop making anything durable (a crash point was reached elsewhere, e.g. in PM); the
    /// next [`FaultFs::crash`] returns the state as of now.
    pub fn freeze(&self) {
        self.state.lock().freeze();
    }

    /// The model [`FaultFs::crash`] uses from now on, with the seed its crashes derive
    /// theirs from. Crashed copies inherit both.
    pub fn set_crash_mode(&self, mode: CrashMode, seed: u64) {
        let mut s = self.state.lock();
        s.crash_mode = mode;
        s.crash_seed = seed;
    }

    /// The file system a crash would leave now, in this instance's model
    /// ([`FaultFs::set_crash_mode`]; `Prefix` unless `TIERKV_FS_CRASH` says otherwise). The
    /// result shares nothing with `self`.
    pub fn crash(&self) -> FaultFs {
        let (mode, seed) = {
            let mut s = self.state.lock();
            s.crashes += 1;
            let mix = s.crash_seed ^ s.crashes.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ s.sync_points.rotate_left(32);
            (s.crash_mode, mix)
        };
        self.crash_with(seed, mode)
    }

    /// The file system a crash would leave now under `mode`, its random choices drawn from
    /// `seed` (see [`super::crash_model`]). The result shares nothing with `self`.
    pub fn crash_with(&self, seed: u64, mode: CrashMode) -> FaultFs {
        let s = self.state.lock();
        let mut rng = crash_model::rng(seed);
        let (cur_names, lens) = match &s.frozen_view {
            Some((n, l)) => (n, Some(l)),
            None => (&s.names, None),
        };
        let names = crash_model::crash_names(&s.durable_names, cur_names, mode, &mut rng);
        let mut files = HashMap::new();
        for id in names.values() {
            if files.contains_key(id) {
                continue;
            }
            if let Some(f) = s.files.get(id) {
                // A file created after the crash point has no length in the snapshot: empty.
                let len = lens.map_or(f.data.len(), |l| l.get(id).copied().unwrap_or(0));
                let visible = f.data.get(..len).unwrap_or(&f.data);
                let data = crash_model::crash_file(visible, f.synced, mode, &mut rng);
                let synced = data.len();
                files.insert(*id, MemFile { data, synced });
            }
        }
        let state = State {
            files,
            names: names.clone(),
            durable_names: names,
            dirs: s.dirs.clone(),
            next_id: s.next_id,
            read_only: s.read_only,
            crash_mode: s.crash_mode,
            crash_seed: s.crash_seed,
            crashes: s.crashes,
            ..State::default()
        };
        FaultFs { state: Arc::new(Mutex::new(state)) }
    }

    /// Overwrite bytes of `path` (durably), for corruption tests.
    pub fn poke(&self, path: &Path, off: usize, bytes: &[u8]) -> io::Result<()> {
        let mut s = self.state.lock();
        let id = *s.names.get(path).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let f = s.files.get_mut(&id).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let end = off + bytes.len();
        if end > f.data.len() {
            f.data.resize(end, 0);
        }
        f.data[off..end].copy_from_slice(bytes);
        f.synced = f.synced.max(end);
        Ok(())
    }

    /// Cut `path` to `len` bytes (durably), for truncation tests.
    pub fn truncate(&self, path: &Path, len: usize) -> io::Result<()> {
        let mut s = self.state.lock();
        let id = *s.names.get(path).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let f = s.files.get_mut(&id).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        f.data.truncate(len);
        f.synced = f.synced.min(len);
        Ok(())
    }
}

#[derive(Debug)]
struct FaultFile {
    state: Arc<Mutex<State>>,
    id: u64,
    path: PathBuf,
}

impl FsFile for FaultFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        let mut s = self.state.lock();
        s.maybe_panic(&self.path);
        s.tick_write()?;
        let f = s.files.get_mut(&self.id).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        f.data.extend_from_slice(data);
        Ok(())
    }
    fn read_at(&self, off: u64, buf: &mut [u8]) -> io::Result<usize> {
        let mut s = self.state.lock();
        s.tick()?;
        let f = s.files.get(&self.id).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let off = usize::try_from(off).unwrap_or(usize::MAX);
        if off >= f.data.len() {
            return Ok(0);
        }
        let n = buf.len().min(f.data.len() - off);
        buf[..n].copy_from_slice(&f.data[off..off + n]);
        Ok(n)
    }
    fn sync(&mut self) -> io::Result<()> {
        let mut s = self.state.lock();
        s.maybe_panic(&self.path);
        s.tick_write()?;
        let frozen = s.sync_point();
        let f = s.files.get_mut(&self.id).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        if !frozen {
            f.synced = f.data.len();
        }
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        let s = self.state.lock();
        Ok(s.files.get(&self.id).map_or(0, |f| f.data.len() as u64))
    }
}

#[derive(Debug)]
struct FaultLock {
    state: Arc<Mutex<State>>,
    path: PathBuf,
}
impl FsLock for FaultLock {}
impl Drop for FaultLock {
    fn drop(&mut self) {
        self.state.lock().locks.remove(&self.path);
    }
}

fn parent(path: &Path) -> PathBuf {
    path.parent().map(Path::to_path_buf).unwrap_or_default()
}

impl Fs for FaultFs {
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut s = self.state.lock();
        s.tick_write()?;
        let mut p = Some(path);
        while let Some(d) = p {
            if d.as_os_str().is_empty() {
                break;
            }
            s.dirs.insert(d.to_path_buf());
            p = d.parent();
        }
        Ok(())
    }
    fn create(&self, path: &Path) -> io::Result<Box<dyn FsFile>> {
        let mut s = self.state.lock();
        s.maybe_panic(path);
        s.tick_write()?;
        if !s.dirs.contains(&parent(path)) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        s.next_id += 1;
        let id = s.next_id;
        s.files.insert(id, MemFile::default());
        s.names.insert(path.to_path_buf(), id);
        Ok(Box::new(FaultFile { state: self.state.clone(), id, path: path.to_path_buf() }))
    }
    fn open(&self, path: &Path) -> io::Result<Box<dyn FsFile>> {
        let mut s = self.state.lock();
        s.maybe_panic(path);
        s.tick()?;
        let id = *s.names.get(path).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        Ok(Box::new(FaultFile { state: self.state.clone(), id, path: path.to_path_buf() }))
    }
    fn exists(&self, path: &Path) -> bool {
        let s = self.state.lock();
        s.names.contains_key(path) || s.dirs.contains(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.state.lock();
        s.maybe_panic(from);
        s.tick_write()?;
        let id = s.names.remove(from).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        s.names.insert(to.to_path_buf(), id);
        Ok(())
    }
    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut s = self.state.lock();
        s.maybe_panic(path);
        s.tick_write()?;
        s.names.remove(path).map(|_| ()).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut s = self.state.lock();
        s.tick()?;
        if !s.dirs.contains(dir) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let mut out: Vec<String> = s
            .names
            .keys()
            .chain(s.dirs.iter())
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        out.sort();
        out.dedup();
        Ok(out)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut s = self.state.lock();
        s.tick_write()?;
        if s.sync_point() {
            return Ok(());
        }
        let in_dir = |p: &PathBuf| p.parent() == Some(dir);
        s.durable_names.retain(|p, _| !in_dir(p));
        let current: Vec<(PathBuf, u64)> =
            s.names.iter().filter(|(p, _)| in_dir(p)).map(|(p, i)| (p.clone(), *i)).collect();
        s.durable_names.extend(current);
        Ok(())
    }
    fn lock(&self, path: &Path) -> io::Result<Box<dyn FsLock>> {
        let mut s = self.state.lock();
        s.tick_write()?;
        if !s.locks.insert(path.to_path_buf()) {
            return Err(io::Error::from(io::ErrorKind::WouldBlock));
        }
        Ok(Box::new(FaultLock { state: self.state.clone(), path: path.to_path_buf() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_keeps_only_synced_bytes_and_synced_names() -> io::Result<()> {
        let fs = FaultFs::new();
        let d = Path::new("/db");
        fs.create_dir_all(d)?;
        let mut a = fs.create(&d.join("a"))?;
        a.append(b"hello")?;
        a.sync()?;
        a.append(b" world")?;
        fs.sync_dir(d)?;
        let mut b = fs.create(&d.join("b"))?;
        b.append(b"unsynced name")?;
        b.sync()?;
        let after = fs.crash();
        assert_eq!(after.read_all(&d.join("a"))?, b"hello");
        assert!(!after.exists(&d.join("b")), "name never synced to the directory");
        Ok(())
    }

    #[test]
    fn rename_is_durable_only_after_sync_dir() -> io::Result<()> {
        let fs = FaultFs::new();
        let d = Path::new("/db");
        fs.create_dir_all(d)?;
        fs.write_atomic(&d.join("CURRENT"), b"one")?;
        let mut t = fs.create(&d.join("tmp"))?;
        t.append(b"two")?;
        t.sync()?;
        fs.rename(&d.join("tmp"), &d.join("CURRENT"))?;
        assert_eq!(fs.read_all(&d.join("CURRENT"))?, b"two");
        assert_eq!(fs.crash().read_all(&d.join("CURRENT"))?, b"one");
        Ok(())
    }

    #[test]
    fn page_model_loses_unsynced_names_and_nothing_written_after_the_crash_point() -> io::Result<()> {
        let d = Path::new("/db");
        let (mut vanished, mut kept) = (false, false);
        for seed in 0..64 {
            let fs = FaultFs::new();
            fs.create_dir_all(d)?;
            let mut a = fs.create(&d.join("a"))?;
            a.append(&[1u8; 10_000])?;
            a.sync()?;
            fs.crash_before_sync(1);
            a.append(&[2u8; 9000])?;
            a.sync()?; // the crash point: frozen before this sync
            a.append(&[3u8; 100])?; // after the crash: never on disk
            drop(a);
            fs.rename(&d.join("a"), &d.join("b"))?;
            let after = fs.crash_with(seed, CrashMode::Pages);
            // The rename came after the crash point: `a` is never renamed; its name was
            // never synced either, so it is there or not.
            assert!(!after.exists(&d.join("b")), "seed {seed}");
            if !after.exists(&d.join("a")) {
                vanished = true;
                continue;
            }
            kept = true;
            let data = after.read_all(&d.join("a"))?;
            assert!(data.len() >= 10_000 && data.len() <= 19_000, "seed {seed}: {}", data.len());
            assert!(data[..10_000].iter().all(|&b| b == 1), "seed {seed}: synced bytes lost");
            assert!(data[10_000..].iter().all(|&b| b == 2 || b == 0), "seed {seed}: garbage or later data");
        }
        assert!(vanished && kept);
        Ok(())
    }

    #[test]
    fn injected_faults_fire_once_or_sticky() -> io::Result<()> {
        let fs = FaultFs::new();
        fs.create_dir_all(Path::new("/d"))?;
        fs.fail_after(2, FaultKind::Enospc, false);
        let mut f = fs.create(Path::new("/d/f"))?;
        let e = f.append(b"x").err().map(|e| e.raw_os_error());
        assert_eq!(e, Some(Some(libc::ENOSPC)));
        f.append(b"y")?;
        fs.fail_after(1, FaultKind::Eio, true);
        assert!(f.sync().is_err());
        assert!(f.sync().is_err(), "sticky fault keeps failing");
        fs.clear_faults();
        f.sync()?;
        assert_eq!(fs.read_all(Path::new("/d/f"))?, b"y");
        Ok(())
    }
}
