//! The cold value log and its dynamic value groups (HoaKV §3.4–3.6).
//!
//! Values larger than `Value_Size` live in value-log files (`vlog-NNNNNN.log`, records
//! `crc | klen | vlen | key | value`); the LSM keeps the key and a pointer {file, offset,
//! record length}. Every value belongs to a group by key range: group `g` covers
//! `[lo_g, lo_{g+1})`. A group has one file new values are appended to (its first) and may
//! list older files (previous active files, files shared with its sibling after a split).
//! The `GROUPS` file (written atomically: temp, fsync, rename, fsync dir) records the
//! ranges and file lists; a file not listed by any group is removed at open.
//!
//! The cold index of the paper (`{heat, key, GID}`, in buckets by GID with chained
//! overflow entries) is a DRAM hash map of key → heat per group. It is bounded
//! (`cold_index_capacity` entries); the sliding window halves every heat and drops the ones
//! that reach 0.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::layout::{self, GroupRec, GroupsRec, Pointer};
use crate::error::{Error, Result};
use crate::fs::{CountingFs, Fs, FsFile};

/// A group's cold index: key → heat, hashed with crc32c (hardware) instead of SipHash: the
/// index is bumped on every cold read and write, and its keys are not attacker-chosen
/// beyond what the store's own hashing (bloom filters, hot index) already accepts.
pub type HeatMap = HashMap<Vec<u8>, u16, std::hash::BuildHasherDefault<KeyHasher>>;

/// crc32c of the bytes written, spread over 64 bits (hash tables use the top bits too).
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u32);

impl std::hash::Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = crc32c::crc32c_append(self.0, bytes);
    }

    fn finish(&self) -> u64 {
        (u64::from(self.0) | (u64::from(self.0) << 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
}

/// Name of the group table file.
pub const GROUPS: &str = "GROUPS";

/// File name of value-log file `n`.
pub fn vlog_name(n: u64) -> String {
    format!("vlog-{n:06}.log")
}

fn vlog_number(name: &str) -> Option<u64> {
    name.strip_prefix("vlog-")?.strip_suffix(".log")?.parse().ok()
}

/// The file a group appends to.
#[derive(Debug)]
pub struct Appender {
    file: Box<dyn FsFile>,
    number: u64,
    len: u64,
    dirty: bool,
}

/// One value group.
#[derive(Debug)]
pub struct Group {
    /// Group id.
    pub gid: u32,
    /// Smallest key of its range.
    pub lo: Vec<u8>,
    /// Files holding its values; `files[0]` is the appender's.
    pub files: Mutex<Vec<u64>>,
    appender: Mutex<Appender>,
    /// The cold index bucket: key → heat.
    pub heat: Mutex<HeatMap>,
}

/// The group table and the value-log files.
#[derive(Debug)]
pub struct ColdVlog {
    fs: CountingFs,
    dir: PathBuf,
    /// Groups by `lo`.
    groups: RwLock<Vec<Arc<Group>>>,
    next_gid: AtomicU32,
    next_file: AtomicU64,
    /// Readers of every value-log file, by number.
    readers: RwLock<HashMap<u64, Arc<dyn FsFile>>>,
    /// Bytes of every value-log file, by number.
    sizes: RwLock<HashMap<u64, u64>>,
    /// Serialises writers of `GROUPS`.
    table_lock: Mutex<()>,
    index_entries: AtomicU64,
    index_capacity: u64,
}

impl ColdVlog {
    /// Open (or create) the value log of `dir`. Every group gets a fresh file to append to
    /// (a crash may have left a torn record at the end of the old one, which is never
    /// appended to again).
    pub fn open(fs: CountingFs, dir: &Path, fresh: bool, index_capacity: u64) -> Result<ColdVlog> {
        let path = dir.join(GROUPS);
        let rec = if fresh || !fs.exists(&path) {
            if !fresh {
                return Err(Error::corruption(&path, 0, "the GROUPS file is missing"));
            }
            GroupsRec {
                next_gid: 1,
                next_file: 1,
                groups: vec![GroupRec { gid: 0, lo: Vec::new(), files: Vec::new() }],
            }
        } else {
            let data = fs.read_all(&path)?;
            layout::decode_groups(&data).map_err(|d| Error::corruption(&path, 0, d))?
        };
        let cv = ColdVlog {
            fs,
            dir: dir.to_path_buf(),
            groups: RwLock::new(Vec::new()),
            next_gid: AtomicU32::new(rec.next_gid),
            next_file: AtomicU64::new(rec.next_file),
            readers: RwLock::new(HashMap::new()),
            sizes: RwLock::new(HashMap::new()),
            table_lock: Mutex::new(()),
            index_entries: AtomicU64::new(0),
            index_capacity,
        };
        let listed: HashSet<u64> = rec.groups.iter().flat_map(|g| g.files.iter().copied()).collect();
        for name in cv.fs.list(dir)? {
            if let Some(n) = vlog_number(&name) {
                if !listed.contains(&n) {
                    cv.fs.remove(&dir.join(&name))?;
                }
            }
        }
        for &n in &listed {
            let p = dir.join(vlog_name(n));
            if !cv.fs.exists(&p) {
                return Err(Error::corruption(&p, 0, "a value-log file GROUPS lists is missing"));
            }
            let f = cv.fs.open_immutable(&p)?;
            cv.sizes.write().insert(n, f.len()?);
            cv.readers.write().insert(n, Arc::from(f));
        }
        let mut groups = Vec::new();
        for g in rec.groups {
            let (appender, number) = cv.new_file()?;
            let mut files = vec![number];
            files.extend(g.files);
            groups.push(Arc::new(Group {
                gid: g.gid,
                lo: g.lo,
                files: Mutex::new(files),
                appender: Mutex::new(appender),
                heat: Mutex::new(HeatMap::default()),
            }));
        }
        *cv.groups.write() = groups;
        cv.write_table()?;
        Ok(cv)
    }

    /// Create value-log file with a fresh number (synced, name durable).
    fn new_file(&self) -> Result<(Appender, u64)> {
        let n = self.next_file.fetch_add(1, Ordering::Relaxed);
        let p = self.dir.join(vlog_name(n));
        // A log like the WAL (a demotion syncs both): its write-back starts as it fills.
        let mut f = crate::fs::create_log(&self.fs, &p)?;
        f.append(layout::VLOG_MAGIC)?;
        f.sync()?;
        self.fs.sync_dir(&self.dir)?;
        let r = self.fs.open(&p)?;
        self.readers.write().insert(n, Arc::from(r));
        self.sizes.write().insert(n, 8);
        Ok((Appender { file: f, number: n, len: 8, dirty: false }, n))
    }

    /// Write `GROUPS` from the current groups.
    fn write_table(&self) -> Result<()> {
        let _g = self.table_lock.lock();
        let rec = Self::groups_rec(&self.groups.read(), &self.next_gid, &self.next_file);
        self.fs.write_atomic(&self.dir.join(GROUPS), &layout::encode_groups(&rec))?;
        Ok(())
    }

    fn groups_rec(gs: &[Arc<Group>], next_gid: &AtomicU32, next_file: &AtomicU64) -> GroupsRec {
        GroupsRec {
            next_gid: next_gid.load(Ordering::Relaxed),
            next_file: next_file.load(Ordering::Relaxed),
            groups: gs
                .iter()
                .map(|g| GroupRec { gid: g.gid, lo: g.lo.clone(), files: g.files.lock().clone() })
                .collect(),
        }
    }

    /// The group whose range holds `key`.
    pub fn group_for(&self, key: &[u8]) -> Arc<Group> {
        let gs = self.groups.read();
        let i = gs.partition_point(|g| g.lo.as_slice() <= key).saturating_sub(1);
        gs[i].clone()
    }

    /// Every group, by range.
    pub fn groups(&self) -> Vec<Arc<Group>> {
        self.groups.read().clone()
    }

    /// The end of `g`'s range (the next group's `lo`), if any.
    pub fn range_end(&self, g: &Group) -> Option<Vec<u8>> {
        let gs = self.groups.read();
        gs.iter().position(|x| x.gid == g.gid).and_then(|i| gs.get(i + 1)).map(|n| n.lo.clone())
    }

    /// Append `key`'s `value` to its group's file (fsynced when `sync`).
    pub fn append(&self, key: &[u8], value: &[u8], sync: bool) -> Result<Pointer> {
        let g = self.group_for(key);
        let rec = layout::encode_vlog(key, value);
        let mut a = g.appender.lock();
        a.file.append(&rec)?;
        if sync {
            a.file.sync()?;
        } else {
            a.dirty = true;
        }
        let p = Pointer { file: a.number, offset: a.len, len: rec.len() as u32 };
        a.len += rec.len() as u64;
        self.sizes.write().insert(a.number, a.len);
        Ok(p)
    }

    /// fsync every appender with unsynced records (before a WAL sync or a flush makes
    /// pointers to them durable).
    pub fn sync(&self) -> Result<()> {
        for g in self.groups() {
            let mut a = g.appender.lock();
            if a.dirty {
                a.file.sync()?;
                a.dirty = false;
            }
        }
        Ok(())
    }

    /// True when value-log file `n` exists (is listed or not yet removed).
    pub fn has_file(&self, n: u64) -> bool {
        self.readers.read().contains_key(&n)
    }

    /// Read the value `p` points at, checking the record's checksum and key.
    pub fn read(&self, key: &[u8], p: Pointer) -> Result<Vec<u8>> {
        let f = self.reader(p.file).ok_or_else(|| {
            Error::corruption(
                self.dir.join(vlog_name(p.file)),
                p.offset,
                "pointer into a value-log file that does not exist",
            )
        })?;
        let mut buf = Vec::new();
        let r = self.read_into(&*f, key, p, &mut buf)?;
        buf.truncate(r.end);
        buf.drain(..r.start);
        Ok(buf)
    }

    /// The reader of value-log file `n`, while the file is listed or not yet removed. A
    /// holder (an iterator) can read on after group maintenance removes the file: the open
    /// file stays readable.
    pub fn reader(&self, n: u64) -> Option<Arc<dyn FsFile>> {
        self.readers.read().get(&n).cloned()
    }

    /// Read the record `p` points at from `f` (the reader of `p.file`) into `buf`,
    /// checking its checksum and key; returns where the value is in `buf`. `buf` is reused:
    /// no allocation once it has grown to the record size.
    pub fn read_into(&self, f: &dyn FsFile, key: &[u8], p: Pointer, buf: &mut Vec<u8>) -> Result<Range<usize>> {
        let path = || self.dir.join(vlog_name(p.file));
        buf.clear();
        buf.resize(p.len as usize, 0);
        let mut got = 0;
        while let Some(rest) = buf.get_mut(got..).filter(|r| !r.is_empty()) {
            let n = f.read_at(p.offset + got as u64, rest)?;
            if n == 0 {
                return Err(Error::corruption(path(), p.offset, "value-log record past the end of the file"));
            }
            got += n;
        }
        let (k, v) = layout::decode_vlog(buf).map_err(|d| Error::corruption(path(), p.offset, d))?;
        if k != key {
            return Err(Error::corruption(path(), p.offset, "value-log record belongs to another key"));
        }
        let start = layout::VLOG_HEADER + k.len();
        Ok(start..start + v.len())
    }

    /// Every record of file `n` in order: (key, pointer). Stops at the first record that does
    /// not verify (a torn tail: files are never appended to after a crash).
    pub fn records(&self, n: u64) -> Result<Vec<(Vec<u8>, Pointer)>> {
        let path = self.dir.join(vlog_name(n));
        let data = self.fs.read_all(&path)?;
        if data.get(..8) != Some(layout::VLOG_MAGIC.as_slice()) {
            return Err(Error::corruption(&path, 0, "bad value-log magic"));
        }
        let mut out = Vec::new();
        let mut off = 8usize;
        while off + layout::VLOG_HEADER <= data.len() {
            let kl = u16::from_le_bytes([data[off + 4], data[off + 5]]) as usize;
            let vl = u32::from_le_bytes([data[off + 6], data[off + 7], data[off + 8], data[off + 9]]) as usize;
            let end = off + layout::VLOG_HEADER + kl + vl;
            let Some(rec) = data.get(off..end) else { break };
            let Ok((k, _)) = layout::decode_vlog(rec) else { break };
            out.push((k.to_vec(), Pointer { file: n, offset: off as u64, len: (end - off) as u32 }));
            off = end;
        }
        Ok(out)
    }

    /// Bytes of the files `g` lists.
    pub fn group_bytes(&self, g: &Group) -> u64 {
        let s = self.sizes.read();
        g.files.lock().iter().map(|f| s.get(f).copied().unwrap_or(0)).sum()
    }

    /// Start maintaining `g`: it gets a new file to append to; returns the files it listed
    /// before, which the maintenance cleans. Appends in flight hold the appender lock, taken
    /// here, so none is still writing to an old file afterwards. Records appended to the old
    /// file and not yet synced are synced first: [`ColdVlog::sync`] only reaches the current
    /// appenders, and WAL records pointing at those values may become durable later
    /// (regression: `crash_background`, a crash after a group seal lost values whose
    /// pointers were durable).
    pub fn seal(&self, g: &Group) -> Result<Vec<u64>> {
        let (fresh, number) = self.new_file()?;
        let old = {
            let mut files = g.files.lock();
            let old = files.clone();
            files.insert(0, number);
            old
        };
        // The new file is listed durably before anything is appended to it: a file no group
        // lists is removed at open, and a value appended to it could already have a durable
        // pointer (regression: `crash_background`, "pointer into a value-log file that does
        // not exist" after a crash during group maintenance).
        self.write_table()?;
        let mut a = g.appender.lock();
        if a.dirty {
            a.file.sync()?;
            a.dirty = false;
        }
        *a = fresh;
        Ok(old)
    }

    /// A new file for relocated values (not an appender).
    pub fn relocation_file(&self) -> Result<(Appender, u64)> {
        self.new_file()
    }

    /// Append a relocated record to `a`.
    pub fn append_to(&self, a: &mut Appender, key: &[u8], value: &[u8]) -> Result<Pointer> {
        let rec = layout::encode_vlog(key, value);
        a.file.append(&rec)?;
        let p = Pointer { file: a.number, offset: a.len, len: rec.len() as u32 };
        a.len += rec.len() as u64;
        self.sizes.write().insert(a.number, a.len);
        Ok(p)
    }

    /// fsync a relocation file.
    pub fn finish_file(&self, mut a: Appender) -> Result<()> {
        a.file.sync()?;
        Ok(())
    }

    /// Garbage collection of `g` moved its live values to `reloc`: list it (after the
    /// appender's file). Writes `GROUPS`.
    pub fn add_file(&self, g: &Group, reloc: u64) -> Result<()> {
        g.files.lock().insert(1, reloc);
        self.write_table()
    }

    /// Split `g` at `median`: `g` keeps `[lo, median)` and lists `left`; a new group takes
    /// `[median, end)` with a new appender, listing `right`, `g`'s appender file (values of
    /// its range appended since the seal) and the files being cleaned (`old`, until the
    /// pointers are rewritten). The cold index bucket is divided by range. Writes `GROUPS`.
    pub fn split(&self, g: &Group, median: Vec<u8>, left: u64, right: u64, old: &[u64]) -> Result<Arc<Group>> {
        let (appender, number) = self.new_file()?;
        // `GROUPS` listing the new group is made durable before writers can route to it
        // (the groups lock is held until then; lock order: table, then groups, as in
        // `write_table`): its appender's file would otherwise be removed at open while
        // pointers into it could be durable already.
        let _t = self.table_lock.lock();
        let mut gs = self.groups.write();
        let i = gs
            .iter()
            .position(|x| x.gid == g.gid)
            .ok_or_else(|| Error::InvalidArgument("splitting an unknown group".into()))?;
        let shared = {
            let mut files = g.files.lock();
            files.insert(1, left);
            files[0]
        };
        let mut files = vec![number, right, shared];
        files.extend_from_slice(old);
        let moved: HeatMap = {
            let mut h = g.heat.lock();
            let keys: Vec<Vec<u8>> = h.keys().filter(|k| k.as_slice() >= median.as_slice()).cloned().collect();
            keys.into_iter().filter_map(|k| h.remove(&k).map(|v| (k, v))).collect()
        };
        let ng = Arc::new(Group {
            gid: self.next_gid.fetch_add(1, Ordering::Relaxed),
            lo: median,
            files: Mutex::new(files),
            appender: Mutex::new(appender),
            heat: Mutex::new(moved),
        });
        gs.insert(i + 1, ng.clone());
        let rec = Self::groups_rec(&gs, &self.next_gid, &self.next_file);
        self.fs.write_atomic(&self.dir.join(GROUPS), &layout::encode_groups(&rec))?;
        drop(gs);
        Ok(ng)
    }

    /// The pointers of `groups`' values in `old` are rewritten: those groups stop listing
    /// the files; files no group lists any more (a sibling may still hold values in one)
    /// are removed. Writes `GROUPS`. Returns the bytes freed.
    pub fn drop_files(&self, groups: &[Arc<Group>], old: &[u64]) -> Result<u64> {
        for g in groups {
            g.files.lock().retain(|f| !old.contains(f));
        }
        self.write_table()?;
        self.remove_unlisted()
    }

    /// Remove the value-log files no group lists any more.
    pub fn remove_unlisted(&self) -> Result<u64> {
        let listed: HashSet<u64> = self.groups.read().iter().flat_map(|g| g.files.lock().clone()).collect();
        let gone: Vec<u64> = self.readers.read().keys().copied().filter(|n| !listed.contains(n)).collect();
        let mut freed = 0;
        for n in gone {
            self.readers.write().remove(&n);
            freed += self.sizes.write().remove(&n).unwrap_or(0);
            self.fs.remove(&self.dir.join(vlog_name(n)))?;
        }
        Ok(freed)
    }

    /// Count an access to cold `key`; returns its heat (0 when the index is full and the
    /// key is not in it).
    pub fn bump(&self, key: &[u8]) -> u16 {
        let g = self.group_for(key);
        let mut h = g.heat.lock();
        if let Some(v) = h.get_mut(key) {
            *v = v.saturating_add(1);
            return *v;
        }
        if self.index_entries.load(Ordering::Relaxed) >= self.index_capacity {
            return 0;
        }
        h.insert(key.to_vec(), 1);
        self.index_entries.fetch_add(1, Ordering::Relaxed);
        1
    }

    /// Forget `key` in the cold index (it became hot).
    pub fn forget(&self, key: &[u8]) {
        let g = self.group_for(key);
        if g.heat.lock().remove(key).is_some() {
            self.index_entries.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Record a demoted key with its heat.
    pub fn remember(&self, key: &[u8], heat: u16) {
        let g = self.group_for(key);
        if g.heat.lock().insert(key.to_vec(), heat.max(1)).is_none() {
            self.index_entries.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The sliding window moved on: halve every heat, drop zeros.
    pub fn decay(&self) {
        let mut n = 0;
        for g in self.groups() {
            let mut h = g.heat.lock();
            h.retain(|_, v| {
                *v /= 2;
                *v > 0
            });
            n += h.len() as u64;
        }
        self.index_entries.store(n, Ordering::Relaxed);
    }

    /// Entries in the cold index.
    pub fn index_entries(&self) -> u64 {
        self.index_entries.load(Ordering::Relaxed)
    }

    /// Bytes of every value-log file.
    pub fn total_bytes(&self) -> u64 {
        self.sizes.read().values().sum()
    }

    /// Check the group table against the files (every listed file readable).
    pub fn check(&self) -> Vec<String> {
        let mut p = Vec::new();
        let gs = self.groups.read();
        if gs.first().is_none_or(|g| !g.lo.is_empty()) || gs.windows(2).any(|w| w[0].lo >= w[1].lo) {
            p.push("value groups do not cover the key space in order".into());
        }
        let readers = self.readers.read();
        for g in gs.iter() {
            for f in g.files.lock().iter() {
                if !readers.contains_key(f) {
                    p.push(format!("group {} lists value-log file {f}, which is not open", g.gid));
                }
            }
        }
        p
    }
}
