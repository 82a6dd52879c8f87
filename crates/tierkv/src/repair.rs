//! Salvage and repair of a damaged store (`tierkv repair --dir D`; LevelDB's `RepairDB`,
//! RocksDB's `ldb repair`).
//!
//! A damaged record makes reads of the keys behind it (and every scan over them) fail with
//! `Error::Corruption`, and damage in a structure read at open makes the store refuse to
//! open at all. Repair gets a working store back with everything that still verifies:
//!
//! 1. **Salvage** ([`salvage`]): each preset walks its own persistent structures *read-only*
//!    (`engine::<preset>::salvage`), without trusting any index it cannot verify, and hands
//!    every record whose checksum verifies to a [`SalvageSink`] as `(key, value or delete,
//!    order)`, and every record that fails its checks as a [`Lost`] (its key when the key
//!    is readable, its file and offset always). The newest intact record of each key wins
//!    (largest [`Order`]); a delete that wins removes the key.
//! 2. **Rebuild** ([`rebuild`]): a fresh store of the same preset is written with the
//!    salvaged keys, in key order, in write batches, and closed cleanly.
//! 3. **Swap** ([`repair`], real file system): the rebuild happens in `<dir>.repair-tmp`
//!    (and `<pm_path>.repair-tmp` when the PM pools live outside the store directory); the
//!    damaged store is then renamed to `<dir>.damaged-<unix seconds>` (likewise its pools)
//!    and the rebuilt one into its place. The damaged copy is kept for forensics, never
//!    deleted. The repaired store is reopened and `check`ed before repair reports success.
//!
//! What repair cannot promise, stated in its report rather than hidden:
//! - a key whose newest record was lost may come back with an older value, or a deleted key
//!   whose delete record was lost may come back (LevelDB's repair has the same limit); both
//!   only where a [`Lost`] is reported — for that key, or without a key when it was
//!   unreadable;
//! - salvage holds the newest version of every key in memory (a store larger than memory
//!   cannot be repaired in this version);
//! - a crash during the swap leaves both directories on disk under their temporary names;
//!   nothing is deleted, and the report of the interrupted run names them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::engine::EngineCtx;
use crate::error::{Error, Result};
use crate::fs::{CountingFs, Fs, FsLock, RealFs};
use crate::options::Options;
use crate::options_file::{OptionsRecord, OPTIONS_FILE};
use crate::{Db, Preset, WriteBatch};

/// The age of a salvaged record: larger is newer. Two records of one key with the same
/// order must carry the same content (a preset derives it from its sequence numbers, or
/// from the position of the structure in its newest-first search order).
pub type Order = u128;

/// A record salvage could not keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    /// The file (or PM pool file) holding it.
    pub file: PathBuf,
    /// Its byte offset in `file`.
    pub offset: u64,
    /// Its key, when the key was readable.
    pub key: Option<Vec<u8>>,
    /// What failed.
    pub detail: String,
}

/// Where a preset's salvage walk reports what it finds.
pub trait SalvageSink {
    /// An intact record: `key`'s value (`None`: deleted) as of `order`.
    fn record(&mut self, key: &[u8], value: Option<&[u8]>, order: Order);
    /// A record that fails its checks.
    fn lost(&mut self, lost: Lost);
}

/// What salvage found: the newest intact version of every key, and what was lost.
#[derive(Debug, Default)]
pub struct Salvaged {
    /// key → (order, value; `None` when the newest intact record deletes it).
    pub newest: BTreeMap<Vec<u8>, (Order, Option<Vec<u8>>)>,
    /// Intact records seen (every version, not only the newest).
    pub records: u64,
    /// Records that failed their checks.
    pub lost: Vec<Lost>,
}

impl SalvageSink for Salvaged {
    fn record(&mut self, key: &[u8], value: Option<&[u8]>, order: Order) {
        self.records += 1;
        match self.newest.get_mut(key) {
            Some(cur) if cur.0 >= order => {}
            Some(cur) => *cur = (order, value.map(<[u8]>::to_vec)),
            None => {
                self.newest.insert(key.to_vec(), (order, value.map(<[u8]>::to_vec)));
            }
        }
    }
    fn lost(&mut self, lost: Lost) {
        self.lost.push(lost);
    }
}

impl Salvaged {
    /// The live keys and values repair keeps, in key order.
    pub fn live(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.newest.iter().filter_map(|(k, (_, v))| v.as_deref().map(|v| (k.as_slice(), v)))
    }
}

/// What [`repair`] did.
#[derive(Debug)]
pub struct RepairReport {
    /// The preset of the store.
    pub preset: Preset,
    /// Intact records salvaged (all versions).
    pub records: u64,
    /// Live keys in the repaired store.
    pub keys: u64,
    /// What was dropped.
    pub lost: Vec<Lost>,
    /// Where the damaged store (and its pools, when outside it) now lives.
    pub damaged_copy: Vec<PathBuf>,
    /// `check` of the repaired store (empty: clean).
    pub problems: Vec<String>,
}

/// Read the preset and store id of `dir` (`opts.fs` or the real file system). A store
/// whose `OPTIONS` record is damaged can still be salvaged when the caller names the
/// preset (`opts.preset`); its id is then read from the first PM pool's header (bytes
/// 24..32, docs/format/pm-pool.md) when that file exists, so the pools still open. When it
/// cannot be read the id is 0, the region refuses the pools, and each preset's walk reads
/// the pool bytes directly, checking each pool header itself.
fn identity(fs: &dyn Fs, dir: &Path, opts: &Options, preset_given: bool) -> Result<(Preset, u64)> {
    let path = dir.join(OPTIONS_FILE);
    if !fs.exists(&path) {
        return Err(Error::InvalidArgument(format!("{} holds no tierkv store (no OPTIONS file)", dir.display())));
    }
    let raw = fs.read_all(&path)?;
    match OptionsRecord::decode(&raw) {
        Ok(rec) => {
            if preset_given && rec.preset != opts.preset {
                return Err(Error::PresetMismatch {
                    stored: rec.preset.to_string(),
                    requested: opts.preset.to_string(),
                });
            }
            Ok((rec.preset, rec.db_id))
        }
        Err(_) if preset_given => {
            let pool = opts.pm_path.clone().unwrap_or_else(|| dir.join("pm")).join("pool-000000");
            let mut head = [0u8; 32];
            let id = std::fs::File::open(&pool)
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
                .ok()
                .and_then(|()| head.get(24..32).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes))
                .unwrap_or(0);
            Ok((opts.preset, id))
        }
        Err((off, d)) => Err(Error::Corruption {
            file: path,
            offset: off,
            detail: format!("{d}; name the preset (--preset) to repair the store anyway"),
        }),
    }
}

/// Salvage every intact record of the store in `dir` (read-only; the store must not be
/// open). `preset_given`: `opts.preset` names the preset even if `OPTIONS` is readable
/// (it must then agree).
pub fn salvage(dir: &Path, opts: &Options, preset_given: bool) -> Result<Salvaged> {
    salvage_locked(dir, opts, preset_given).map(|(s, _, _)| s)
}

/// [`salvage`], returning the store's preset and the store lock, still held.
fn salvage_locked(dir: &Path, opts: &Options, preset_given: bool) -> Result<(Salvaged, Preset, Box<dyn FsLock>)> {
    let base: Arc<dyn Fs> = opts.fs.clone().unwrap_or_else(|| Arc::new(RealFs));
    let fs = CountingFs::new(base);
    let (preset, db_id) = identity(&fs, dir, opts, preset_given)?;
    let lock = fs.lock(&dir.join("LOCK")).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock => Error::Locked(dir.to_path_buf()),
        _ => Error::Io(e),
    })?;
    let ctx = EngineCtx {
        dir: dir.to_path_buf(),
        opts: Options { preset, ..opts.clone() },
        fs,
        db_id,
        fresh: false,
        pm_health: Arc::default(),
        recovery: Arc::default(),
    };
    let mut out = Salvaged::default();
    crate::engine::salvage(preset, &ctx, &mut out)?;
    Ok((out, preset, lock))
}

/// Write `s`'s live keys into a new store at `dir` (which must not hold one) with `opts`,
/// and close it cleanly.
pub fn rebuild(s: &Salvaged, dir: &Path, opts: &Options) -> Result<u64> {
    let db = Db::open(dir, Options { create_if_missing: true, error_if_exists: true, ..opts.clone() })?;
    let (mut batch, mut bytes, mut keys) = (WriteBatch::new(), 0usize, 0u64);
    for (k, v) in s.live() {
        batch.put(k, v);
        bytes += k.len() + v.len();
        keys += 1;
        if bytes >= 1 << 20 || batch.len() >= 1024 {
            db.write(std::mem::take(&mut batch))?;
            bytes = 0;
        }
    }
    if !batch.is_empty() {
        db.write(batch)?;
    }
    db.flush()?;
    db.close()?;
    Ok(keys)
}

fn with_suffix(p: &Path, suffix: &str) -> PathBuf {
    let mut s = p.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// Repair the store in `dir` on the real file system: salvage, rebuild beside it, swap
/// (module docs). `opts` are the options the store is opened with (`pm_path`, preset
/// options); `preset_given` as in [`salvage`].
pub fn repair(dir: &Path, opts: &Options, preset_given: bool) -> Result<RepairReport> {
    if opts.fs.is_some() || opts.pm_device.is_some() {
        return Err(Error::InvalidArgument(
            "repair swaps directories on the real file system; use salvage and rebuild with a custom file system"
                .into(),
        ));
    }
    let canon = |p: &Path| {
        std::fs::canonicalize(p).map_err(|e| Error::Io(std::io::Error::new(e.kind(), format!("{}: {e}", p.display()))))
    };
    let dir = &canon(dir).map_err(|e| {
        Error::InvalidArgument(format!(
            "{e} (if an earlier repair was interrupted, its rebuilt store is `<dir>.repair-tmp` and \
             the damaged one `<dir>.damaged-*`)"
        ))
    })?;
    let pm_path = opts.pm_path.as_deref().map(canon).transpose()?;
    // The store stays locked until the rebuilt one is in its place: nobody writes to the
    // damaged store after its records were read (the lock follows the directory's rename).
    let (s, preset, lock) = salvage_locked(dir, opts, preset_given)?;
    let opts = Options { preset, pm_path: pm_path.clone(), ..opts.clone() };
    let pm_outside = pm_path.clone().filter(|p| !p.starts_with(dir));
    let tmp = with_suffix(dir, ".repair-tmp");
    // Pools inside the store directory move with it; pools outside get their own temporary.
    let tmp_pm = match (&pm_path, &pm_outside) {
        (_, Some(p)) => Some(with_suffix(p, ".repair-tmp")),
        (Some(p), None) => p.strip_prefix(dir).ok().map(|rel| tmp.join(rel)),
        (None, None) => None,
    };
    for p in std::iter::once(&tmp).chain(tmp_pm.as_ref()) {
        if p.exists() {
            std::fs::remove_dir_all(p)
                .map_err(|e| Error::Io(std::io::Error::new(e.kind(), format!("{}: {e}", p.display()))))?;
        }
    }
    let new_opts = Options { pm_path: tmp_pm.clone(), ..opts.clone() };
    let keys = rebuild(&s, &tmp, &new_opts)?;
    // Swap: the damaged store aside, the rebuilt one in.
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut damaged = vec![with_suffix(dir, &format!(".damaged-{stamp}"))];
    let rename = |from: &Path, to: &Path| {
        std::fs::rename(from, to).map_err(|e| {
            Error::Io(std::io::Error::new(e.kind(), format!("rename {} to {}: {e}", from.display(), to.display())))
        })
    };
    rename(dir, &damaged[0])?;
    if let (Some(pm), Some(tpm)) = (&pm_outside, &tmp_pm) {
        let d = with_suffix(pm, &format!(".damaged-{stamp}"));
        rename(pm, &d)?;
        damaged.push(d);
        rename(tpm, pm)?;
        if let Some(parent) = pm.parent().filter(|p| !p.as_os_str().is_empty()) {
            RealFs.sync_dir(parent)?;
        }
    }
    rename(&tmp, dir)?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        RealFs.sync_dir(parent)?;
    }
    drop(lock);
    let db = Db::open(dir, Options { create_if_missing: false, ..opts.clone() })?;
    let problems = db.check()?;
    db.close()?;
    Ok(RepairReport { preset, records: s.records, keys, lost: s.lost, damaged_copy: damaged, problems })
}

/// Salvage an SSTable's bytes (`data`, the whole file; `path` names it): every entry of
/// every data block whose checksum verifies goes to `each(entry, block offset)`, each block
/// that does not to `lost`. The index (when footer and index verify) gives the block
/// boundaries; without it, blocks are found by scanning: a block ends where the 4 bytes
/// after a whole entry are the checksum of the bytes since the block's start.
pub fn salvage_sstable(
    data: &[u8],
    path: &Path,
    mut each: impl FnMut(crate::sstable::Entry<'_>, u64),
    sink: &mut dyn SalvageSink,
) {
    use crate::format::crc;
    use crate::sstable::{block_entries, decode_footer, FOOTER_LEN};
    let lost = |sink: &mut dyn SalvageSink, offset: usize, key: Option<Vec<u8>>, detail: String| {
        sink.lost(Lost { file: path.to_path_buf(), offset: offset as u64, key, detail })
    };
    let verified = |s: usize, e: usize| -> Option<&[u8]> {
        let b = data.get(s..e)?;
        let (p, c) = b.split_at(b.len().checked_sub(4)?);
        (crc::masked(p).to_le_bytes() == c).then_some(p)
    };
    // The index, when the footer and index block verify.
    let index: Option<Vec<(Vec<u8>, usize, usize)>> = (|| {
        let foot = data.get(data.len().checked_sub(FOOTER_LEN)?..)?;
        let (ih, _, _) = decode_footer(foot).ok()?;
        let is = usize::try_from(ih.offset).ok()?;
        let p = verified(is, is.checked_add(ih.size as usize)?)?;
        let mut c = crate::format::Cursor::new(p);
        let mut v = Vec::new();
        while c.remaining() > 0 {
            let klen = c.u16()? as usize;
            let k = c.bytes(klen)?.to_vec();
            let off = usize::try_from(c.u64()?).ok()?;
            let size = c.u32()? as usize;
            v.push((k, off, off.checked_add(size)?));
        }
        Some(v)
    })();
    let whole = |p: &[u8]| block_entries(p).all(|e| e.is_ok());
    if let Some(index) = index {
        for (last, s, e) in index {
            match verified(s, e).filter(|p| whole(p)) {
                Some(p) => block_entries(p).flatten().for_each(|en| each(en, s as u64)),
                None => lost(
                    sink,
                    s,
                    None,
                    format!("data block fails its checksum (its keys end at {})", crate::escape(&last)),
                ),
            }
        }
        return;
    }
    // No usable index: find blocks by their checksums.
    // Entries must ascend inside a block, so a run of zeros (which parses as empty-key
    // entries) fails at its second entry instead of costing a checksum per boundary.
    let block_at = |s: usize| -> Option<usize> {
        let mut c = crate::format::Cursor::new(data.get(s..)?);
        let mut prev: Option<&[u8]> = None;
        loop {
            if c.remaining() >= 4 && verified(s, s + c.pos() + 4).is_some() && c.pos() > 0 {
                return Some(s + c.pos() + 4);
            }
            let _kind = c.u8().filter(|k| *k <= 1)?;
            let klen = c.u16()? as usize;
            let vlen = c.u32()? as usize;
            let key = c.bytes(klen)?;
            if prev.is_some_and(|p| p >= key) {
                return None;
            }
            prev = Some(key);
            c.skip(vlen)?;
        }
    };
    let end = data.len().saturating_sub(FOOTER_LEN);
    let mut s = 0usize;
    let mut bad_from: Option<usize> = None;
    let mut prev_last: Option<Vec<u8>> = None;
    // A found block counts only if its keys ascend and follow the previous block's: an
    // index or filter block whose bytes happen to parse as entries with a matching
    // checksum is not data.
    let ascending = |p: &[u8], prev: &Option<Vec<u8>>| {
        let mut last = prev.clone();
        block_entries(p).all(|e| {
            e.is_ok_and(|e| {
                let ok = last.as_deref().is_none_or(|l| l < e.key);
                last = Some(e.key.to_vec());
                ok
            })
        })
    };
    while s < end {
        if let Some(e) = block_at(s).filter(|&e| verified(s, e).is_some_and(|p| ascending(p, &prev_last))) {
            if let Some(b) = bad_from.take() {
                lost(sink, b, None, format!("{} damaged bytes (no verifying block)", s - b));
            }
            if let Some(p) = verified(s, e) {
                block_entries(p).flatten().for_each(|en| {
                    prev_last = Some(en.key.to_vec());
                    each(en, s as u64)
                });
            }
            s = e;
        } else {
            bad_from.get_or_insert(s);
            s += 1;
        }
    }
    if let Some(b) = bad_from {
        // The index and filter blocks after the data blocks land here too.
        lost(
            sink,
            b,
            None,
            format!("footer or index damaged; {} trailing bytes hold no verifying data block", end - b),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sstable::{Kind, TableBuilder};

    fn table() -> Vec<u8> {
        let mut b = TableBuilder::in_memory(256, 10);
        for i in 0..60u32 {
            let (k, v) = (format!("key-{i:03}"), format!("value-{i}-{}", "x".repeat(30)));
            let kind = if i % 10 == 9 { Kind::Delete } else { Kind::Put };
            let v = if kind == Kind::Delete { String::new() } else { v };
            b.add(kind, k.as_bytes(), v.as_bytes()).map_err(|e| e.to_string()).unwrap_or_default();
        }
        b.finish_mem().map(|(_, d)| d).unwrap_or_default()
    }

    fn run(data: &[u8]) -> (Vec<String>, Salvaged) {
        let mut s = Salvaged::default();
        let mut keys = Vec::new();
        salvage_sstable(
            data,
            Path::new("t.sst"),
            |e, _| keys.push(String::from_utf8_lossy(e.key).into_owned()),
            &mut s,
        );
        (keys, s)
    }

    #[test]
    fn sstable_salvage_keeps_every_verifying_block_with_or_without_the_index() {
        let data = table();
        let (keys, s) = run(&data);
        assert_eq!(keys.len(), 60);
        assert!(s.lost.is_empty());
        // A damaged data block: its keys are lost, every other block kept.
        let mut d = data.clone();
        d[300] ^= 1;
        let (keys, s) = run(&d);
        assert!(keys.len() < 60 && keys.len() >= 50, "{}", keys.len());
        assert_eq!(s.lost.len(), 1);
        assert!(s.lost[0].offset <= 300);
        // A damaged footer: the blocks are found by their checksums, all of them.
        let mut d = data.clone();
        let n = d.len();
        d[n - 10] ^= 1;
        let (keys, s) = run(&d);
        assert_eq!(keys.len(), 60, "every data block found without the index");
        assert_eq!(s.lost.len(), 1, "the damaged index/footer region: {:?}", s.lost);
        // Both: a damaged footer and a damaged data block.
        d[300] ^= 1;
        let (keys, s) = run(&d);
        assert!(keys.len() >= 50 && keys.len() < 60, "{}", keys.len());
        assert_eq!(s.lost.len(), 2, "{:?}", s.lost);
        let mut sorted = keys.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted, keys, "no entry twice, in key order");
    }

    /// Review finding: with the index unusable, a run of zeros (empty-key entries) cost a
    /// checksum over the whole prefix at every entry boundary from every start byte.
    #[test]
    fn sstable_salvage_of_zeros_without_an_index_is_linear() {
        let mut d = table();
        let n = d.len();
        let mut zeros = vec![0u8; 256 << 10];
        zeros.extend_from_slice(&d[n - 48..]);
        d.truncate(n - 48);
        d.extend_from_slice(&zeros);
        let n = d.len();
        d[n - 10] ^= 1; // footer damaged: the scan path
        let (keys, s) = run(&d);
        assert_eq!(keys.len(), 60);
        assert!(!s.lost.is_empty());
    }
}
