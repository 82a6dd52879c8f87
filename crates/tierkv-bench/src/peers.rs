//! The peers: LevelDB (1.22, built from leveldb-sys's bundled source) and RocksDB (built
//! from the `rocksdb` crate's bundled source), both release builds, configured as the papers
//! configure them: no compression, bloom filters of 10 bits per key, a write buffer of
//! [`WRITE_BUFFER`] (SPEC: the MemTable size of our designs), and the WAL not synced — or
//! synced on every write with `--durable` (then tierkv runs with `pm_sync`).
//!
//! Disk bytes written are the process's `wchar` deltas from `/proc/self/io` (every byte the
//! engine hands to `write(2)`, WAL and compaction included); DRAM is each engine's own
//! memory estimate (memtables + table readers / block cache).

use std::ffi::{CStr, CString};
use std::os::raw::c_char;
use std::path::{Path, PathBuf};
use std::ptr;

use crate::api::{BenchEngine, Result, Usage};

/// Write buffer (MemTable) size given to both peers.
pub const WRITE_BUFFER: usize = 64 << 20;

/// Bytes this process has passed to `write(2)` so far (`wchar` of `/proc/self/io`).
pub fn process_wchar() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("wchar:").and_then(|v| v.trim().parse().ok())))
        .unwrap_or(0)
}

fn dir_size(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| rd.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

// ---------------------------------------------------------------- LevelDB

use leveldb_sys as ldb;

/// LevelDB through its C API.
pub struct LevelDb {
    db: *mut ldb::leveldb_t,
    options: *mut ldb::leveldb_options_t,
    filter: *mut ldb::leveldb_filterpolicy_t,
    cache: *mut ldb::leveldb_cache_t,
    write: *mut ldb::leveldb_writeoptions_t,
    read: *mut ldb::leveldb_readoptions_t,
    path: PathBuf,
    wchar0: u64,
    user_bytes: std::sync::atomic::AtomicU64,
}

// SAFETY: LevelDB's `DB` is documented thread-safe for concurrent reads and writes; the
// option objects are only read after construction.
unsafe impl Send for LevelDb {}
// SAFETY: as above.
unsafe impl Sync for LevelDb {}

impl std::fmt::Debug for LevelDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LevelDb").field("path", &self.path).finish()
    }
}

fn take_err(err: *mut c_char) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: LevelDB sets `err` to a malloc'ed NUL-terminated string, which we free.
    let msg = unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned();
    // SAFETY: `err` came from LevelDB's allocator.
    unsafe { ldb::leveldb_free(err as *mut std::ffi::c_void) };
    Err(format!("leveldb: {msg}"))
}

impl LevelDb {
    /// Open (creating) a LevelDB at `path`; `sync` makes every write fsync its WAL.
    pub fn open(path: &Path, sync: bool) -> Result<LevelDb> {
        std::fs::create_dir_all(path).map_err(|e| e.to_string())?;
        let name = CString::new(path.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: plain C API calls; every object created here is destroyed in Drop.
        unsafe {
            let options = ldb::leveldb_options_create();
            ldb::leveldb_options_set_create_if_missing(options, 1);
            ldb::leveldb_options_set_compression(options, ldb::Compression::No);
            ldb::leveldb_options_set_write_buffer_size(options, WRITE_BUFFER);
            let filter = ldb::leveldb_filterpolicy_create_bloom(10);
            ldb::leveldb_options_set_filter_policy(options, filter);
            let cache = ldb::leveldb_cache_create_lru(8 << 20);
            ldb::leveldb_options_set_cache(options, cache);
            ldb::leveldb_options_set_max_open_files(options, 10_000);
            let write = ldb::leveldb_writeoptions_create();
            ldb::leveldb_writeoptions_set_sync(write, u8::from(sync));
            let read = ldb::leveldb_readoptions_create();
            let mut err: *mut c_char = ptr::null_mut();
            let db = ldb::leveldb_open(options, name.as_ptr(), &mut err);
            let mut me = LevelDb {
                db,
                options,
                filter,
                cache,
                write,
                read,
                path: path.to_path_buf(),
                wchar0: process_wchar(),
                user_bytes: Default::default(),
            };
            if let Err(e) = take_err(err) {
                me.db = ptr::null_mut();
                return Err(e);
            }
            Ok(me)
        }
    }

    fn property(&self, name: &str) -> Option<u64> {
        let name = CString::new(name).ok()?;
        // SAFETY: `db` is open; the returned string is malloc'ed by LevelDB and freed here.
        unsafe {
            let v = ldb::leveldb_property_value(self.db, name.as_ptr());
            if v.is_null() {
                return None;
            }
            let s = CStr::from_ptr(v).to_string_lossy().trim().parse().ok();
            ldb::leveldb_free(v as *mut std::ffi::c_void);
            s
        }
    }

    fn close_db(&mut self) {
        if !self.db.is_null() {
            // SAFETY: `db` is open and closed exactly once.
            unsafe { ldb::leveldb_close(self.db) };
            self.db = ptr::null_mut();
        }
    }
}

impl Drop for LevelDb {
    fn drop(&mut self) {
        self.close_db();
        // SAFETY: created in `open`, destroyed once; the DB no longer uses them.
        unsafe {
            ldb::leveldb_readoptions_destroy(self.read);
            ldb::leveldb_writeoptions_destroy(self.write);
            ldb::leveldb_options_destroy(self.options);
            ldb::leveldb_filterpolicy_destroy(self.filter);
            ldb::leveldb_cache_destroy(self.cache);
        }
    }
}

impl BenchEngine for LevelDb {
    fn name(&self) -> String {
        "leveldb".into()
    }
    fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: `db` is open; key and value are valid for their lengths during the call.
        unsafe {
            ldb::leveldb_put(
                self.db,
                self.write,
                key.as_ptr() as *const c_char,
                key.len(),
                value.as_ptr() as *const c_char,
                value.len(),
                &mut err,
            )
        };
        take_err(err)?;
        self.user_bytes.fetch_add((key.len() + value.len()) as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    fn get(&self, key: &[u8]) -> Result<Option<usize>> {
        Ok(self.get_value(key)?.map(|v| v.len()))
    }
    fn get_value(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let mut err: *mut c_char = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: as for put; the returned buffer is malloc'ed by LevelDB and freed here.
        let v = unsafe {
            ldb::leveldb_get(self.db, self.read, key.as_ptr() as *const c_char, key.len(), &mut len, &mut err)
        };
        take_err(err)?;
        if v.is_null() {
            return Ok(None);
        }
        // SAFETY: `v` holds `len` bytes; copy them out as every engine does, then free.
        let copy = unsafe { std::slice::from_raw_parts(v as *const u8, len) }.to_vec();
        // SAFETY: allocated by LevelDB.
        unsafe { ldb::leveldb_free(v as *mut std::ffi::c_void) };
        Ok(Some(copy))
    }
    fn scan(&self, start: &[u8], n: usize) -> Result<usize> {
        // SAFETY: iterator created, used and destroyed here while `db` is open; the key and
        // value stay in place (only their lengths are read).
        unsafe {
            let it = ldb::leveldb_create_iterator(self.db, self.read);
            ldb::leveldb_iter_seek(it, start.as_ptr() as *const c_char, start.len());
            let (mut count, mut bytes) = (0, 0);
            while count < n && ldb::leveldb_iter_valid(it) != 0 {
                let (mut kl, mut vl) = (0usize, 0usize);
                // The binding declares the length out-parameters `*const`, but LevelDB writes
                // them: pass pointers derived from mutable locals.
                ldb::leveldb_iter_key(it, std::ptr::addr_of_mut!(kl).cast_const());
                ldb::leveldb_iter_value(it, std::ptr::addr_of_mut!(vl).cast_const());
                bytes += kl + vl;
                count += 1;
                ldb::leveldb_iter_next(it);
            }
            ldb::leveldb_iter_destroy(it);
            std::hint::black_box(bytes);
            Ok(count)
        }
    }
    fn usage(&self) -> Usage {
        Usage {
            pm_bytes_written: 0,
            disk_bytes_written: process_wchar().saturating_sub(self.wchar0),
            user_bytes_written: self.user_bytes.load(std::sync::atomic::Ordering::Relaxed),
            dram_index_bytes: self.property("leveldb.approximate-memory-usage").unwrap_or(0),
            pm_space: 0,
        }
    }
    fn reopen(&mut self) -> Result<f64> {
        self.close_db();
        let t = std::time::Instant::now();
        let name = CString::new(self.path.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
        let mut err: *mut c_char = ptr::null_mut();
        // SAFETY: the options outlive the DB (destroyed in Drop after close).
        self.db = unsafe { ldb::leveldb_open(self.options, name.as_ptr(), &mut err) };
        take_err(err)?;
        Ok(t.elapsed().as_secs_f64())
    }
    fn space(&self) -> u64 {
        dir_size(&self.path)
    }
}

// ---------------------------------------------------------------- RocksDB

/// RocksDB through the `rocksdb` crate.
pub struct RocksDb {
    db: Option<rocksdb::DB>,
    opts: rocksdb::Options,
    write: rocksdb::WriteOptions,
    path: PathBuf,
    wchar0: u64,
    user_bytes: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for RocksDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksDb").field("path", &self.path).finish()
    }
}

impl RocksDb {
    /// Open (creating) a RocksDB at `path`; `sync` makes every write fsync its WAL.
    pub fn open(path: &Path, sync: bool) -> Result<RocksDb> {
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        opts.set_compression_type(rocksdb::DBCompressionType::None);
        opts.set_write_buffer_size(WRITE_BUFFER);
        let mut table = rocksdb::BlockBasedOptions::default();
        table.set_bloom_filter(10.0, false);
        opts.set_block_based_table_factory(&table);
        let mut write = rocksdb::WriteOptions::default();
        write.set_sync(sync);
        let db = rocksdb::DB::open(&opts, path).map_err(|e| format!("rocksdb: {e}"))?;
        Ok(RocksDb {
            db: Some(db),
            opts,
            write,
            path: path.to_path_buf(),
            wchar0: process_wchar(),
            user_bytes: Default::default(),
        })
    }

    fn db(&self) -> Result<&rocksdb::DB> {
        self.db.as_ref().ok_or_else(|| "rocksdb: closed".to_string())
    }
}

impl BenchEngine for RocksDb {
    fn name(&self) -> String {
        "rocksdb".into()
    }
    fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.db()?.put_opt(key, value, &self.write).map_err(|e| format!("rocksdb: {e}"))?;
        self.user_bytes.fetch_add((key.len() + value.len()) as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    fn get(&self, key: &[u8]) -> Result<Option<usize>> {
        Ok(self.get_value(key)?.map(|v| v.len()))
    }
    fn get_value(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.db()?.get(key).map_err(|e| format!("rocksdb: {e}"))
    }
    fn scan(&self, start: &[u8], n: usize) -> Result<usize> {
        let mut it = self.db()?.raw_iterator();
        it.seek(start);
        let (mut count, mut bytes) = (0, 0);
        while count < n {
            let (Some(k), Some(v)) = (it.key(), it.value()) else { break };
            bytes += k.len() + v.len();
            count += 1;
            it.next();
        }
        it.status().map_err(|e| format!("rocksdb: {e}"))?;
        std::hint::black_box(bytes);
        Ok(count)
    }
    fn usage(&self) -> Usage {
        let prop = |n: &str| self.db().ok().and_then(|d| d.property_int_value(n).ok().flatten()).unwrap_or(0);
        Usage {
            pm_bytes_written: 0,
            disk_bytes_written: process_wchar().saturating_sub(self.wchar0),
            user_bytes_written: self.user_bytes.load(std::sync::atomic::Ordering::Relaxed),
            dram_index_bytes: prop("rocksdb.cur-size-all-mem-tables") + prop("rocksdb.estimate-table-readers-mem"),
            pm_space: 0,
        }
    }
    fn reopen(&mut self) -> Result<f64> {
        self.db = None;
        let t = std::time::Instant::now();
        self.db = Some(rocksdb::DB::open(&self.opts, &self.path).map_err(|e| format!("rocksdb: {e}"))?);
        Ok(t.elapsed().as_secs_f64())
    }
    fn space(&self) -> u64 {
        dir_size(&self.path)
    }
}
