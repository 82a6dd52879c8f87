//! The engines a benchmark run measures, built by name ([`open`]): every tierkv preset and
//! the `limit` pseudo-engine live here; the peers (LevelDB, RocksDB) in `crate::peers` (the `peers` feature).
//! All implement [`crate::api::BenchEngine`].

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::path::{Path, PathBuf};

use crate::api::{BenchEngine, Result, Usage};
use parking_lot::{Mutex, RwLock};
use tierkv::pm::{Backing, PmProfile, Region, RegionConfig, LINE, POOL_HEADER_LEN};
use tierkv::{Db, HoakvOptions, HpdkOptions, LightkvOptions, LightkvPlacement, Options, Preset, SlmdbOptions};

/// How to build engines for one run.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct EngineSpec {
    /// Engine name: a preset name, or `limit`.
    pub name: String,
    /// Disk directory for the store.
    pub dir: PathBuf,
    /// Directory for PM pool files.
    pub pm_dir: PathBuf,
    /// Power-loss durability ([`durability`]): peers fsync every write; tierkv presets
    /// msync PM (`pm_sync`) and sync their WALs (`hpdk`'s and `hoakv`'s `sync_wal`);
    /// `limit` msyncs what it persists.
    pub durable: bool,
    /// PM capacity in bytes (`--pm-budget`): tierkv presets get `pm_capacity` and
    /// `pm_preallocate` (every pool created and faulted at open), `limit` the same through
    /// its region. `None`: PM grows without a bound, pools are created as needed.
    #[serde(default)]
    pub pm_budget: Option<u64>,
    /// PM device profile (`--pm-profile`): `dram` (no added latency, the default) or
    /// `optane`.
    #[serde(default)]
    pub pm_profile: Option<String>,
    /// The DRAM budget in bytes (`--dram-budget`): `native` gets half of it as its
    /// `dram_budget` (its capacity tier moves cold keys to disk past it, so the index of a
    /// store larger than DRAM fits; the other half is for the process, the block cache and
    /// the page cache). The other designs have no such bound.
    #[serde(default)]
    pub dram_budget: Option<u64>,
}

impl EngineSpec {
    /// The PM profile ([`EngineSpec::pm_profile`], default `dram`).
    pub fn profile(&self) -> Result<PmProfile> {
        self.pm_profile.as_deref().unwrap_or("dram").parse().map_err(|e: tierkv::Error| e.to_string())
    }
}

/// The peers' names (engines that keep everything on disk and have no PM).
pub fn is_peer(name: &str) -> bool {
    matches!(name, "leveldb" | "rocksdb")
}

/// The crash an engine's acknowledged writes survive, as the report states it: without
/// `durable`, a process crash (peers: WAL written, not fsynced; tierkv: PM persisted by
/// flush+fence, WALs written); with it, a power loss of the medium (peers fsync every
/// write; tierkv msyncs PM and syncs its WALs) — emulated only when PM is on tmpfs, where
/// msync has no medium to write to.
pub fn durability(name: &str, durable: bool, pm_on_tmpfs: bool) -> String {
    match (durable, is_peer(name), pm_on_tmpfs) {
        (false, _, _) => "process-crash".into(),
        (true, true, _) => "power-loss".into(),
        (true, false, true) => "power-loss (emulated: PM on tmpfs)".into(),
        (true, false, false) => "power-loss".into(),
    }
}

/// Names `--engines` accepts: every preset this build hosts, `limit`, and the peers (when
/// built with the `peers` feature).
pub fn known_engines() -> Vec<String> {
    let mut v: Vec<String> = Preset::ALL.iter().map(|p| p.name().to_string()).collect();
    v.push("limit".into());
    if cfg!(feature = "peers") {
        v.push("leveldb".into());
        v.push("rocksdb".into());
    }
    v
}

/// Build the engine `spec.name`.
pub fn open(spec: &EngineSpec) -> Result<Box<dyn BenchEngine>> {
    match spec.name.as_str() {
        "limit" => return Ok(Box::new(Limit::open(spec)?)),
        #[cfg(feature = "peers")]
        "leveldb" => return Ok(Box::new(crate::peers::LevelDb::open(&spec.dir, spec.durable)?)),
        #[cfg(feature = "peers")]
        "rocksdb" => return Ok(Box::new(crate::peers::RocksDb::open(&spec.dir, spec.durable)?)),
        _ => {}
    }
    let (base, schemes) = match spec.name.split_once('/') {
        Some((b, s)) => (b, Some(s)),
        None => (spec.name.as_str(), None),
    };
    let preset: Preset = base.parse().map_err(|e: tierkv::Error| e.to_string())?;
    let mut opts = Options::new().preset(preset).pm_path(&spec.pm_dir).pm_sync(spec.durable);
    if let Some(s) = schemes {
        apply_variant(&mut opts, preset, s)?;
    }
    // Like for like with the peers' fsync: the designs' own WALs are synced too (after the
    // variant, which replaces the design's options).
    opts.hpdk.sync_wal = spec.durable;
    opts.hoakv.sync_wal = spec.durable;
    opts = opts.pm_profile(spec.profile()?);
    if let Some(b) = spec.pm_budget {
        opts = opts.pm_capacity(b).pm_preallocate(true);
    }
    if let Some(b) = spec.dram_budget {
        opts.native.dram_budget = b / 2;
    }
    Ok(Box::new(Tierkv::open(spec.name.clone(), opts, &spec.dir)?))
}

/// Apply the variant `s` of an engine named `<preset>/<s>` to `opts`: SLM-DB's scheme list
/// ([`slmdb_schemes`]), HPDK's ablation ([`hpdk_variant`]) or LightKV's settings
/// ([`lightkv_variant`]).
pub fn apply_variant(opts: &mut Options, preset: Preset, s: &str) -> Result<()> {
    match preset {
        Preset::Hpdk => opts.hpdk = hpdk_variant(s)?,
        Preset::Lightkv => opts.lightkv = lightkv_variant(s)?,
        Preset::Hoakv => opts.hoakv = hoakv_variant(s)?,
        _ => opts.slmdb = slmdb_schemes(preset, s)?,
    }
    Ok(())
}

/// LightKV's §VI-F sensitivity settings for an engine named `lightkv/<settings>`: a
/// `+`-joined list of `dram` (LightKV_DRAM: every leaf searched in DRAM), `pm` (LightKV_PM:
/// every leaf searched in PM), `hybrid` (the default placement), `leaves=N` (MAX_LEAF_NODES), `cs=N` (compaction size) and `seg=N`
/// (segment size in KiB), e.g. `lightkv/leaves=64+cs=8`.
pub fn lightkv_variant(s: &str) -> Result<LightkvOptions> {
    let mut o = LightkvOptions::default();
    for part in s.split('+') {
        let num = |v: &str| v.parse::<u64>().map_err(|_| format!("lightkv setting `{part}`: `{v}` is not a number"));
        match part.split_once('=') {
            None if part == "dram" => o.placement = LightkvPlacement::Dram,
            None if part == "pm" => o.placement = LightkvPlacement::Pm,
            None if part == "hybrid" => o.placement = LightkvPlacement::Hybrid,
            Some(("leaves", v)) => o.max_leaf_nodes = num(v)? as usize,
            Some(("cs", v)) => o.compaction_size = num(v)? as usize,
            Some(("seg", v)) => o.segment_size = num(v)? << 10,
            _ => {
                return Err(format!(
                    "unknown lightkv setting `{part}` (known: dram, pm, hybrid, leaves=N, cs=N, seg=KiB)"
                ))
            }
        }
    }
    Ok(o)
}

/// HoaKV's §4.4 parameters for an engine named `hoakv/<settings>`: a `+`-joined list of
/// `hot=MiB` (HotStore size), `group=MiB` (GroupSize), `vs=bytes` (Value_Size),
/// `window=N` (heat window in operations) and `mem=MiB` (MemTable size), e.g.
/// `hoakv/hot=16+vs=512`.
pub fn hoakv_variant(s: &str) -> Result<HoakvOptions> {
    let mut o = HoakvOptions::default();
    for part in s.split('+') {
        let num = |v: &str| v.parse::<u64>().map_err(|_| format!("hoakv setting `{part}`: `{v}` is not a number"));
        match part.split_once('=') {
            Some(("hot", v)) => o.hot_store_size = num(v)? << 20,
            Some(("group", v)) => o.group_size = num(v)? << 20,
            Some(("vs", v)) => o.value_size = num(v)? as usize,
            Some(("window", v)) => o.heat_window = num(v)?,
            Some(("mem", v)) => o.memtable_size = num(v)? << 20,
            _ => {
                return Err(format!(
                    "unknown hoakv setting `{part}` (known: hot=MiB, group=MiB, vs=bytes, window=N, mem=MiB)"
                ))
            }
        }
    }
    Ok(o)
}

/// HPDK's Fig. 7 ablations for an engine named `hpdk/<variant>`: `nt` (no DRAM B+-tree: a
/// GET searches the level) or `ngc` (no live-item-rate merge).
pub fn hpdk_variant(s: &str) -> Result<HpdkOptions> {
    match s {
        "nt" => Ok(HpdkOptions { use_btree: false, ..HpdkOptions::default() }),
        "ngc" => Ok(HpdkOptions { enable_merge: false, ..HpdkOptions::default() }),
        _ => Err(format!("unknown hpdk variant `{s}` (known: nt, ngc)")),
    }
}

/// SLM-DB's compaction candidate selection schemes for an engine named `slmdb/<schemes>`
/// (the §6.5 ablation): `none`, or a `+`-joined subset of `live` (live-key ratio), `leaf`
/// (leaf-node scans) and `seq` (sequentiality degree per range query).
pub fn slmdb_schemes(preset: Preset, s: &str) -> Result<SlmdbOptions> {
    if preset != Preset::Slmdb {
        return Err(format!("`{}/{s}`: only slmdb takes a scheme list", preset.name()));
    }
    let mut o = SlmdbOptions {
        enable_live_ratio: false,
        enable_leaf_scan: false,
        enable_seq_degree: false,
        ..SlmdbOptions::default()
    };
    if s == "none" {
        return Ok(o);
    }
    for part in s.split('+') {
        match part {
            "live" => o.enable_live_ratio = true,
            "leaf" => o.enable_leaf_scan = true,
            "seq" => o.enable_seq_degree = true,
            _ => return Err(format!("unknown slmdb scheme `{part}` (known: live, leaf, seq, none)")),
        }
    }
    Ok(o)
}

/// A tierkv preset.
#[derive(Debug)]
pub struct Tierkv {
    name: String,
    db: Option<Db>,
    opts: Options,
    dir: PathBuf,
    /// The statistics [`BenchEngine::usage`] read last, for `space` and `design` right
    /// after it (some presets count live keys by walking their data: one walk, not three);
    /// `design` clears it.
    last: Mutex<Option<tierkv::Stats>>,
}

impl Tierkv {
    fn open(name: String, opts: Options, dir: &Path) -> Result<Tierkv> {
        let db = Db::open(dir, opts.clone()).map_err(|e| e.to_string())?;
        Ok(Tierkv { name, db: Some(db), opts, dir: dir.to_path_buf(), last: Mutex::new(None) })
    }

    /// The statistics `usage` read, or fresh ones.
    fn stats(&self) -> Option<tierkv::Stats> {
        if let Some(s) = self.last.lock().clone() {
            return Some(s);
        }
        self.db().ok().map(Db::stats)
    }

    fn db(&self) -> Result<&Db> {
        self.db.as_ref().ok_or_else(|| "store is closed".to_string())
    }
}

impl BenchEngine for Tierkv {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.db()?.put(key, value).map_err(|e| e.to_string())
    }
    fn get(&self, key: &[u8]) -> Result<Option<usize>> {
        Ok(self.db()?.get(key).map_err(|e| e.to_string())?.map(|v| v.len()))
    }
    fn get_value(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.db()?.get(key).map_err(|e| e.to_string())
    }
    fn scan(&self, start: &[u8], n: usize) -> Result<usize> {
        // Borrowed entries, as the peers' scans read them (see `crate::api::BenchEngine::scan`).
        let mut it = self.db()?.iter().map_err(|e| e.to_string())?;
        it.seek(start);
        let (mut count, mut bytes) = (0, 0);
        while count < n {
            let Some((k, v)) = it.next_ref().map_err(|e| e.to_string())? else { break };
            bytes += k.len() + v.len();
            count += 1;
        }
        std::hint::black_box(bytes);
        Ok(count)
    }
    fn usage(&self) -> Usage {
        let Ok(db) = self.db() else { return Usage::default() };
        let s = db.stats();
        *self.last.lock() = Some(s.clone());
        Usage {
            pm_bytes_written: s.pm_bytes_written,
            disk_bytes_written: s.disk_bytes_written,
            user_bytes_written: s.user_bytes_written,
            dram_index_bytes: s.dram_index_bytes,
            pm_space: s.pm.capacity,
        }
    }
    fn reopen(&mut self) -> Result<f64> {
        if let Some(db) = self.db.take() {
            db.close().map_err(|e| e.to_string())?;
        }
        let t = std::time::Instant::now();
        self.db = Some(Db::open(&self.dir, self.opts.clone()).map_err(|e| e.to_string())?);
        Ok(t.elapsed().as_secs_f64())
    }
    fn crash_reopen(&mut self) -> Result<()> {
        if let Some(db) = self.db.take() {
            db.simulate_process_crash();
        }
        self.db = Some(Db::open(&self.dir, self.opts.clone()).map_err(|e| e.to_string())?);
        Ok(())
    }
    fn space(&self) -> u64 {
        let Some(s) = self.stats() else { return 0 };
        let heap = |k: &str| s.design.get(k).copied().unwrap_or(0);
        // PM in use (heap minus free space), plus the disk files of the presets that keep
        // SSTables on disk.
        let pm = heap("heap_bytes").saturating_sub(heap("heap_free_bytes"))
            + heap("pm_heap_bytes").saturating_sub(heap("pm_heap_free_bytes"));
        pm + dir_bytes(&self.dir)
    }
    fn design(&self) -> std::collections::BTreeMap<String, u64> {
        // The last reader of the cached statistics (the harness asks usage, space, design).
        let cached = self.last.lock().take();
        cached.or_else(|| self.stats()).map(|s| s.design).unwrap_or_default()
    }
}

/// Bytes of the files directly in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// The physical limit: the work no design can avoid. A write appends the record (key
/// length, key, value) to a PM region and persists it (one write-back per line, one
/// fence); a read is a DRAM hash-map lookup plus one PM access that checks the key and
/// copies the value out. No ordering, no crash consistency, no index persistence: every
/// real engine does at least this much.
///
/// The DRAM index is as small as a hash index gets, so that `limit` fits the DRAM budgets
/// of `--paper` like the designs must: 16 bytes per key (record address, record length,
/// a 32-bit fingerprint) under the key's 64-bit hash. Two keys with one hash but different
/// fingerprints go to a small overflow map of whole keys; one hash *and* fingerprint
/// (96 bits) for two keys is taken as one key (odds about n²/2⁹⁷).
pub struct Limit {
    region: Region,
    tail: Mutex<u64>,
    index: RwLock<HashMap<u64, Slot, BuildHasherDefault<IdHasher>>>,
    overflow: RwLock<HashMap<Vec<u8>, Slot>>,
    hasher: std::hash::RandomState,
    user_bytes: std::sync::atomic::AtomicU64,
}

/// Where a record lives, and its key's fingerprint.
#[derive(Debug, Clone, Copy)]
struct Slot {
    addr: u64,
    len: u32,
    fingerprint: u32,
}

/// The identity hash for keys that are hashes already.
#[derive(Debug, Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

/// Bytes of the record header (the key length).
const LIMIT_HEADER: u64 = 2;

impl std::fmt::Debug for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limit").field("region", &self.region).field("keys", &self.index.read().len()).finish()
    }
}

impl Limit {
    fn open(spec: &EngineSpec) -> Result<Limit> {
        // The same PM as the presets get: profile, capacity, preallocation, msync.
        let profile = spec.profile()?;
        let region = Region::open(RegionConfig {
            backing: Backing::Dir(spec.pm_dir.join("limit")),
            pool_size: 256 << 20,
            db_id: 1,
            sync: spec.durable,
            write_latency_ns: profile.write_latency_ns(),
            write_bandwidth_mbps: profile.write_bandwidth_mbps(),
            read_latency_ns: profile.read_latency_ns(),
            capacity: spec.pm_budget.unwrap_or(0),
            preallocate: spec.pm_budget.is_some(),
            create: true,
            health: Default::default(),
        })
        .map_err(|e| e.to_string())?;
        Ok(Limit {
            region,
            tail: Mutex::new(POOL_HEADER_LEN),
            index: RwLock::new(HashMap::default()),
            overflow: RwLock::new(HashMap::new()),
            hasher: std::hash::RandomState::new(),
            user_bytes: Default::default(),
        })
    }

    /// The key's 64-bit hash and 32-bit fingerprint (two independent hashes).
    fn hashes(&self, key: &[u8]) -> (u64, u32) {
        use std::hash::BuildHasher;
        let h = self.hasher.hash_one(key);
        (h, crc32c::crc32c(key))
    }

    fn find(&self, key: &[u8]) -> Option<Slot> {
        let (h, fp) = self.hashes(key);
        match self.index.read().get(&h) {
            Some(s) if s.fingerprint == fp => Some(*s),
            Some(_) => self.overflow.read().get(key).copied(),
            None => None,
        }
    }
}

impl BenchEngine for Limit {
    fn name(&self) -> String {
        "limit".into()
    }
    fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        let klen = u16::try_from(key.len()).map_err(|_| "limit: key longer than 64 KiB")?;
        let len = LIMIT_HEADER + key.len() as u64 + value.len() as u64;
        let addr = {
            let mut tail = self.tail.lock();
            let pool = self.region.pool_size();
            let mut at = *tail;
            if at % pool + len > pool {
                let next = self.region.grow().map_err(|e| e.to_string())?;
                at = self.region.addr(next, POOL_HEADER_LEN);
            }
            *tail = (at + len).div_ceil(LINE) * LINE;
            at
        };
        // SAFETY: `addr..addr+len` was reserved above for this call alone.
        unsafe {
            self.region.write(addr, &klen.to_le_bytes()).map_err(|e| e.to_string())?;
            self.region.write(addr + LIMIT_HEADER, key).map_err(|e| e.to_string())?;
            self.region.write(addr + LIMIT_HEADER + key.len() as u64, value).map_err(|e| e.to_string())?;
        }
        self.region.persist(addr, len);
        let slot = Slot { addr, len: len as u32, fingerprint: 0 };
        let (h, fp) = self.hashes(key);
        let mut index = self.index.write();
        match index.get_mut(&h) {
            Some(s) if s.fingerprint == fp => *s = Slot { fingerprint: fp, ..slot },
            Some(_) => {
                self.overflow.write().insert(key.to_vec(), slot);
            }
            None => {
                index.insert(h, Slot { fingerprint: fp, ..slot });
            }
        }
        drop(index);
        self.user_bytes.fetch_add((key.len() + value.len()) as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    fn get(&self, key: &[u8]) -> Result<Option<usize>> {
        Ok(self.get_value(key)?.map(|v| v.len()))
    }
    fn get_value(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let Some(s) = self.find(key) else { return Ok(None) };
        // One PM access: the key is checked and the value copied from the same record.
        let rec = self.region.slice(s.addr, s.len as usize).ok_or("limit: record outside region")?;
        let stored = rec.get(LIMIT_HEADER as usize..LIMIT_HEADER as usize + key.len());
        let klen = rec.get(..2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
        if klen != Some(key.len()) || stored != Some(key) {
            return Err("limit: the record under a key holds another key".into());
        }
        Ok(rec.get(LIMIT_HEADER as usize + key.len()..).map(<[u8]>::to_vec))
    }
    fn scan(&self, _start: &[u8], _n: usize) -> Result<usize> {
        Err("limit has no ordered index".into())
    }
    fn usage(&self) -> Usage {
        let s = self.region.stats();
        Usage {
            pm_bytes_written: s.lines_persisted * LINE,
            disk_bytes_written: 0,
            user_bytes_written: self.user_bytes.load(std::sync::atomic::Ordering::Relaxed),
            // hashbrown: the slot (8-byte hash + 16-byte slot) and one control byte per bucket.
            dram_index_bytes: self.index.read().capacity() as u64 * 25,
            pm_space: s.capacity,
        }
    }
    fn reopen(&mut self) -> Result<f64> {
        Err("limit keeps its index in DRAM only; it has no recovery".into())
    }
    fn recovers(&self) -> bool {
        false
    }
}
