//! [`Options`]: how a store is opened, with a documented default for every field.
//!
//! Fields marked *creation-only* shape the persistent format: they are recorded when a store
//! is created and the recorded value wins on every later open (changing them later has no
//! effect). All other fields may change between opens.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::Error;
pub use crate::format::log::WalRecovery;
use crate::fs::Fs;
use crate::pm::sim::SimDevice;

/// Largest key tierkv accepts, and the default of [`Options::max_key_size`].
pub const MAX_KEY_SIZE: usize = 65_535;
/// Largest value tierkv accepts, and the default of [`Options::max_value_size`].
pub const MAX_VALUE_SIZE: usize = 64 << 20;

/// The storage design a store runs. A directory remembers its preset; opening it with
/// another preset fails with [`Error::PresetMismatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Preset {
    /// PMEKV (Micromachines 2020): DRAM B+-tree of key → value pointer, values in a PM heap,
    /// KeyNodes persisted in PM, two-tier log. See [`crate::engine::pmekv`].
    Pmekv,
    /// SLM-DB (FAST '19): PM skiplist MemTable without a WAL, persistent B+-tree in PM over
    /// one level of SSTables on disk, selective compaction. See [`crate::engine::slmdb`].
    Slmdb,
    /// HPDK (`papers/hpdk.txt`): DRAM B+-tree over one level of key-address SSTables in PM,
    /// values in PM value-log pools, live-item-rate merge.
    Hpdk,
    /// LightKV (MSST 2020): RH-Tree (radix inner nodes over hash leaves) as the global index,
    /// a PM write buffer of one segment per partition, SSTables compacted per partition. See
    /// [`crate::engine::lightkv`].
    Lightkv,
    /// HoaKV (Electronics 2023): hot/cold separation by access heat, a cuckoo-hashed hot
    /// index over a PM hot vlog, a leveled LSM cold store with partial KV separation and
    /// value groups. See [`crate::engine::hoakv`].
    Hoakv,
    /// tierkv's own design, and the default: per-shard PM logs written without a shared
    /// lock, a concurrent ordered DRAM index of versions with lock-free reads, native
    /// snapshots, cold keys moved to SSTables on disk. See [`crate::engine::native`].
    #[default]
    Native,
}

impl Preset {
    /// Every preset this build hosts.
    pub const ALL: &'static [Preset] =
        &[Preset::Pmekv, Preset::Slmdb, Preset::Hpdk, Preset::Lightkv, Preset::Hoakv, Preset::Native];

    /// The preset's command-line / on-disk name.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Pmekv => "pmekv",
            Preset::Slmdb => "slmdb",
            Preset::Hpdk => "hpdk",
            Preset::Lightkv => "lightkv",
            Preset::Hoakv => "hoakv",
            Preset::Native => "native",
        }
    }

    /// Stable numeric id written to disk. Never renumber.
    pub(crate) fn id(self) -> u32 {
        match self {
            Preset::Pmekv => 5,
            Preset::Slmdb => 1,
            Preset::Hpdk => 2,
            Preset::Lightkv => 3,
            Preset::Hoakv => 4,
            Preset::Native => 6,
        }
    }

    pub(crate) fn from_id(id: u32) -> Option<Preset> {
        Preset::ALL.iter().copied().find(|p| p.id() == id)
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Preset::ALL.iter().copied().find(|p| p.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
            Error::InvalidArgument(format!("unknown preset `{s}` (known: {})", names.join(", ")))
        })
    }
}

/// Options of the `native` preset.
#[derive(Debug, Clone)]
pub struct NativeOptions {
    /// Write shards: per-shard PM logs a writer appends to without a shared lock.
    /// *Creation-only* (recorded in the superblock). 0 (the default) = twice the machine's
    /// hardware threads, at least 4 and at most 64. Range 0..=1024.
    pub shards: usize,
    /// Size of a log segment, the unit in which PM is given to a shard's log (a record
    /// larger than a segment takes several contiguous ones of one pool). *Creation-only.*
    /// Default 4 MiB; a multiple of 4 KiB, at least 16 KiB. A store whose `pm_pool_size`
    /// is under 4 segments gets segments of a quarter pool.
    pub segment_size: u64,
    /// Verify the checksum of every value a read returns. Default `false`: every record is
    /// verified once per open instead — when recovery replays it, or (records written
    /// since) as it is written from the caller's buffer — and reads check only the entry's
    /// structure and key, as a block cache serves verified blocks (see the module docs of
    /// [`crate::engine::native`]). `true` costs a checksum over every value read (about
    /// 0.1 µs per KiB here). May change between opens.
    pub verify_reads: bool,
    /// DRAM the index of PM-resident keys may use, in bytes (about 300 bytes per key plus
    /// the key; see `Stats::dram_bytes`). Past it, the capacity tier moves cold keys
    /// (CLOCK: not read or written for a whole turn of its hand) to SSTables on disk,
    /// where a key costs its share of a table's index block and bloom filter (about 10
    /// bits plus a few bytes). 0 (the default) = no DRAM bound. May change between opens.
    pub dram_budget: u64,
    /// Share of [`Options::pm_capacity`] the live log data may fill before the capacity
    /// tier moves cold keys to disk (it moves them until 10 points below). Ignored when
    /// `pm_capacity` is 0 (no PM bound). Default 0.7; range 0.1..=0.95. May change
    /// between opens.
    pub pm_watermark: f64,
    /// Run the capacity tier and the log cleaner on a background thread (checked every
    /// 100 ms and when a shard starts a segment). `false`: only [`crate::Db::compact`]
    /// and writers short of PM run them (tests that want every move in the calling
    /// thread). Default `true`.
    pub background: bool,
    /// Write an index checkpoint (`docs/format/native.md`) on the background thread after
    /// this many bytes of new log segments, and an incremental one (a *delta*: the keys
    /// written since the previous round) after every eighth of it, so an open after a
    /// crash loads the checkpoint and its deltas and replays only the logs written after
    /// the last. A clean close and [`crate::Db::compact`] always write a full one, and the
    /// next open loads it instead of replaying the logs. 0 = only at close and compact.
    /// Default 256 MiB (an open after a crash then replays at most about 32 MiB of log
    /// plus up to seven deltas; each full checkpoint costs a walk of the index and about
    /// 25 bytes plus the key per key written to disk, each delta the same per key written
    /// since the previous round). May change between opens.
    pub checkpoint_bytes: u64,
}

impl Default for NativeOptions {
    fn default() -> Self {
        NativeOptions {
            shards: 0,
            segment_size: 4 << 20,
            verify_reads: false,
            dram_budget: 0,
            pm_watermark: 0.7,
            background: true,
            checkpoint_bytes: 256 << 20,
        }
    }
}

/// Options of the `pmekv` preset. Defaults follow the paper where it gives one.
#[derive(Debug, Clone)]
pub struct PmekvOptions {
    /// Keys per LeadNode (B+-tree leaf) and per inner node. The paper gives no figure;
    /// default 64 (a KeyNode of 16-byte keys then fits in ~2 KiB of PM). Range 4..=1024.
    pub node_capacity: usize,
    /// Size of the key-value log ring in PM. *Creation-only.* Default 4 MiB, at least
    /// 256 KiB. A single
    /// [`crate::WriteBatch`] must fit in it (else [`Error::InvalidArgument`]).
    pub kv_log_size: u64,
    /// Size of the key log ring in PM. *Creation-only.* Default 32 MiB, at least 256 KiB.
    /// When it is half full
    /// the dirty LeadNodes are written back as KeyNodes; when full, writers wait for that.
    pub key_log_size: u64,
    /// Period of the background KeyNode write-back, in milliseconds. Default 1000.
    /// 0 disables the background thread: write-back then runs in the writing thread when the
    /// key log is half full, and at `flush()`/`close()` (deterministic; used by tests).
    pub writeback_interval_ms: u64,
}

impl Default for PmekvOptions {
    fn default() -> Self {
        Self { node_capacity: 64, kv_log_size: 4 << 20, key_log_size: 32 << 20, writeback_interval_ms: 1000 }
    }
}

/// Options of the `slmdb` preset. Defaults are the paper's (§6.1) where it gives one.
#[derive(Debug, Clone)]
pub struct SlmdbOptions {
    /// Size of a MemTable arena in PM. Default 64 MiB (the paper's). At least 64 KiB, and
    /// at most `pm_pool_size` − 4 KiB. *Creation-only* (recorded in the superblock). A single
    /// write larger than this gets an arena of its own size.
    pub memtable_size: u64,
    /// SSTable data block size. Default 4 KiB (LevelDB's, which SLM-DB keeps).
    pub block_size: usize,
    /// Bloom filter bits per key written into SSTables. Default 0: SLM-DB finds keys with
    /// its B+-tree and never consults a filter, so it writes none.
    pub bloom_bits_per_key: u32,
    /// DRAM block cache for SSTable reads, in bytes. Default 8 MiB (LevelDB's default
    /// `block_cache`, which SLM-DB inherits); 0 disables it.
    pub block_cache_size: u64,
    /// Target size of an SSTable written by compaction. Default 2 MiB (LevelDB 1.20's
    /// `max_file_size`, which SLM-DB inherits). Flushes write one file per MemTable.
    pub output_file_size: u64,
    /// Live-key ratio below which a file becomes a compaction candidate. Default 0.7.
    pub live_key_threshold: f64,
    /// Leaf-node scan: keys scanned per compaction = this many SSTables' worth (average
    /// keys per file). Default 2.
    pub leaf_scan_files: u64,
    /// Leaf-node scan: more distinct files than this among the scanned keys makes them all
    /// candidates. Default 10.
    pub leaf_node_threshold: usize,
    /// Range-query sequentiality: keys per sub-range. Default 30.
    pub seq_subrange_keys: usize,
    /// Range-query sequentiality: more distinct files than this in a sub-range makes them
    /// candidates. Default 8.
    pub seq_degree_threshold: usize,
    /// Enable the live-key-ratio selection scheme. Default true.
    pub enable_live_ratio: bool,
    /// Enable the leaf-node-scan selection scheme. Default true.
    pub enable_leaf_scan: bool,
    /// Enable the sequentiality-degree-per-range-query selection scheme. Default true.
    pub enable_seq_degree: bool,
    /// Most files merged by one compaction. The paper bounds it without a figure; default 10.
    pub max_merge_files: usize,
    /// Candidates added by range queries beyond which a compaction is scheduled without
    /// waiting for the next flush. Default 10.
    pub candidate_trigger: usize,
    /// Run flush and compaction on background threads (the paper's design). Default true.
    /// `false` runs them in the writing thread when a MemTable fills, and at `flush()` /
    /// `compact()` (deterministic; crash tests use it).
    pub background: bool,
}

impl Default for SlmdbOptions {
    fn default() -> Self {
        Self {
            memtable_size: 64 << 20,
            block_size: 4096,
            bloom_bits_per_key: 0,
            block_cache_size: 8 << 20,
            output_file_size: 2 << 20,
            live_key_threshold: 0.7,
            leaf_scan_files: 2,
            leaf_node_threshold: 10,
            seq_subrange_keys: 30,
            seq_degree_threshold: 8,
            enable_live_ratio: true,
            enable_leaf_scan: true,
            enable_seq_degree: true,
            max_merge_files: 10,
            candidate_trigger: 10,
            background: true,
        }
    }
}

/// Options of the `hpdk` preset (`papers/hpdk.txt`). Defaults are the paper's.
#[derive(Debug, Clone)]
pub struct HpdkOptions {
    /// Bytes of key-address entries a DRAM MemTable holds before it becomes immutable and is
    /// flushed (paper §V-A: 4 MB, LevelDB's default).
    pub memtable_size: u64,
    /// Size of one value-log pool in PM (paper §III-D: 128 MB). *Creation-only.* At most
    /// 4 GiB (a value address holds a 4-byte offset). A new store makes its pools up to 1 %
    /// smaller when that lets a whole number of them tile a PM pool (see the `hpdk` module
    /// docs): the largest value then shrinks by as much.
    pub vlog_pool_size: u64,
    /// fsync the WAL of key-address pairs after every write (paper §IV-B: off by default, as
    /// LevelDB). Off, an acknowledged write survives a process crash; on, also power loss.
    pub sync_wal: bool,
    /// An SSTable whose live-item rate falls below this joins the merge candidate set
    /// (paper §V-A: 0.5).
    pub live_rate_threshold: f64,
    /// Candidate-set size at which a merge runs (the paper leaves the value open).
    pub merge_trigger: usize,
    /// Data block size of the key-address SSTables.
    pub block_size: usize,
    /// Bloom filter bits per key in the SSTables (0 = none, LevelDB's default). Only the
    /// `use_btree = false` ablation reads SSTables on a GET.
    pub bloom_bits_per_key: u32,
    /// Keep the DRAM B+-tree (false = the paper's HPDK-NT ablation: a GET searches the level,
    /// newest table first; no merges, since merges validate items through the tree).
    pub use_btree: bool,
    /// Run the live-item-rate merge (false = the paper's HPDK-NGC ablation).
    pub enable_merge: bool,
    /// Run flushes and merges on background threads (false: in the writing thread, for
    /// deterministic tests).
    pub background: bool,
}

impl Default for HpdkOptions {
    fn default() -> Self {
        Self {
            memtable_size: 4 << 20,
            vlog_pool_size: 128 << 20,
            sync_wal: false,
            live_rate_threshold: 0.5,
            merge_trigger: 4,
            block_size: 4096,
            bloom_bits_per_key: 0,
            use_btree: true,
            enable_merge: true,
            background: true,
        }
    }
}

/// Where the `lightkv` preset keeps its RH-Tree leaves (LightKV §III-E and the §VI-F
/// placement study). The radix inner nodes are in DRAM in every variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LightkvPlacement {
    /// LightKV: each partition's top leaf in DRAM; older (linked) leaves in PM, searched
    /// there.
    #[default]
    Hybrid,
    /// LightKV_DRAM: every leaf searched in DRAM (the PM copies of linked leaves are still
    /// written, for recovery).
    Dram,
    /// LightKV_PM: every leaf in PM. Each top leaf (and each linked leaf waiting for its
    /// flush) has a PM image: every bucket a write changes is written to it and persisted,
    /// and every lookup probes the images in PM. The insert path still finds its slot in a
    /// DRAM mirror of the top leaf (documented in docs/design/lightkv.md).
    Pm,
}

/// Options of the `lightkv` preset (LightKV, MSST 2020). Defaults are the paper's (§VI-A).
#[derive(Debug, Clone)]
pub struct LightkvOptions {
    /// MAX_LEAF_NODES: most partitions; beyond it a full leaf gets a linked successor and its
    /// records are flushed to an SSTable. Default 2048. At least 2.
    pub max_leaf_nodes: usize,
    /// Normal buckets per hash leaf (4 slots each; the extra area adds 5 %). Default 1,024:
    /// 4,096 slots, about one 4 MiB segment of 1 KiB records at the paper's 0.9 load factor.
    pub leaf_buckets: usize,
    /// T_normal: fewest byte values a leaf keeps through a normal split. Default 4.
    pub t_normal: usize,
    /// Size of one write-buffer segment in PM. *Creation-only.* Default 4 MiB. A write
    /// larger than a segment gets a segment of its own size.
    pub segment_size: u64,
    /// Compaction size CS: SSTables of equal compaction weight merged at once. Default 4.
    pub compaction_size: usize,
    /// Leaf placement (LightKV / LightKV_DRAM / LightKV_PM). Default hybrid.
    pub placement: LightkvPlacement,
    /// SSTable data block size. Default 4 KiB.
    pub block_size: usize,
    /// DRAM block cache for SSTable reads. Default 8 MiB (LevelDB's, which LightKV builds on).
    pub block_cache_size: u64,
    /// Run flushes and compactions on two background threads (the paper's). `false` runs them
    /// in the writing thread (deterministic; crash tests use it).
    pub background: bool,
}

impl Default for LightkvOptions {
    fn default() -> Self {
        Self {
            max_leaf_nodes: 2048,
            leaf_buckets: 1024,
            t_normal: 4,
            segment_size: 4 << 20,
            compaction_size: 4,
            placement: LightkvPlacement::Hybrid,
            block_size: 4096,
            block_cache_size: 8 << 20,
            background: true,
        }
    }
}

/// Options of the `hoakv` preset (HoaKV, Electronics 2023, `papers/hoakv.txt`). Defaults
/// are the paper's where it gives one; sizes the paper gives for 100 GB of data on a
/// 64 GB machine are scaled to this project's 2-core, 24 GiB machines and few-GB runs
/// (each such default says so).
#[derive(Debug, Clone)]
pub struct HoakvOptions {
    /// HotStore size: bytes of hot-vlog slots (both halves of each) at most. The paper uses
    /// 4–16 GB next to 100 GB of data (4–16 %); default 64 MiB.
    pub hot_store_size: u64,
    /// Size of one vTable of the hot vlog in PM (paper: 2 MB). *Creation-only.* At most half
    /// a PM pool, a multiple of 64, at least 4 KiB.
    pub vtable_size: u64,
    /// E: hash functions of the cuckoo hot index (paper: three hashes). 1..=8.
    pub hash_functions: usize,
    /// N: buckets of the hot index; 0 derives one per 2 KiB of HotStore (the paper's ~80 %
    /// bucket use at 1 KiB records, whose slots take 2.3 KiB).
    pub hot_buckets: usize,
    /// T: the heat window, in operations (reads and writes). Every T operations all heats
    /// are halved, so a key's heat counts its accesses over roughly the last 2T
    /// operations. The paper gives no figure; default 1,048,576.
    pub heat_window: u64,
    /// Fewest accesses within the window before a cold key may be promoted, even while the
    /// HotStore has room (HeatLimit 0). Default 2: a key seen once is not hot.
    pub promote_min_heat: u16,
    /// Value_Size: cold values longer than this go to the cold vlog, shorter ones stay in
    /// the LSM (paper §4.2: 32 KB).
    pub value_size: usize,
    /// GroupSize: a value group whose files exceed this is garbage-collected, and split at
    /// its median key when its live values still exceed half of it. The paper uses 20–40 GB
    /// next to 100 GB of data; default 64 MiB.
    pub group_size: u64,
    /// Most keys the cold index tracks heat for. Default 1,048,576.
    pub cold_index_capacity: u64,
    /// MemTable size of the ColdStore's LSM (paper §4.1: 64 MB).
    pub memtable_size: u64,
    /// Target bytes of LSM level 1 (LevelDB's 10 MiB; levels grow 10×).
    pub level1_size: u64,
    /// LSM compaction output file size (LevelDB's 2 MiB).
    pub target_file_size: u64,
    /// SSTable data block size (LevelDB's 4 KiB).
    pub block_size: usize,
    /// Bloom filter bits per key (paper §4.1: 10).
    pub bloom_bits_per_key: u32,
    /// Block cache (paper §4.1: 20 MB for HoaKV).
    pub block_cache_size: u64,
    /// fsync the WAL after every write (LevelDB's default: off). Hot writes go to PM and are
    /// always durable; demotions always sync.
    pub sync_wal: bool,
    /// Run LSM flushes/compactions and value-group GC on background threads (the paper's
    /// single GC thread). `false` runs them in the writing thread (deterministic tests).
    pub background: bool,
}

impl Default for HoakvOptions {
    fn default() -> Self {
        Self {
            hot_store_size: 64 << 20,
            vtable_size: 2 << 20,
            hash_functions: 3,
            hot_buckets: 0,
            heat_window: 1 << 20,
            promote_min_heat: 2,
            value_size: 32 << 10,
            group_size: 64 << 20,
            cold_index_capacity: 1 << 20,
            memtable_size: 64 << 20,
            level1_size: 10 << 20,
            target_file_size: 2 << 20,
            block_size: 4096,
            bloom_bits_per_key: 10,
            block_cache_size: 20 << 20,
            sync_wal: false,
            background: true,
        }
    }
}

/// How to open a store. Build with [`Options::new`] and the chained setters.
#[derive(Clone)]
pub struct Options {
    /// The design to run. Default [`Preset::Native`].
    pub preset: Preset,
    /// Create the directory and store if missing. Default `true`.
    pub create_if_missing: bool,
    /// Fail if the store already exists. Default `false`.
    pub error_if_exists: bool,
    /// Where the PM pool files live. Default `<dir>/pm`. Point it at a DAX mount for real PM
    /// or at `/dev/shm/...` to emulate PM in DRAM. The directory records the identity of its
    /// pool, so a wrong path is detected at open.
    pub pm_path: Option<PathBuf>,
    /// Also `msync` PM at commit points, so acknowledged writes survive power loss on a file
    /// system without DAX. Default `false` (writes survive a process crash only).
    pub pm_sync: bool,
    /// Emulated extra latency per persisted 64-byte line, in ns (SLM-DB §6.1 used 300/500/900).
    /// Default 0.
    pub pm_write_latency_ns: u64,
    /// Emulated PM write bandwidth cap in MB/s; 0 = unlimited. Default 0.
    pub pm_write_bandwidth_mbps: u64,
    /// Emulated extra latency of every PM read access, in ns (Optane's random load costs
    /// about 224 ns more than DRAM's, see [`crate::pm::profile`]). Default 0.
    /// [`Options::pm_profile`] sets it with the two write knobs above.
    pub pm_read_latency_ns: u64,
    /// PM capacity: most bytes of PM pools the store may use (rounded down to whole pools,
    /// at least one); a write that needs more fails with [`crate::Error::PmFull`].
    /// 0 = no limit but the region's 4,096 pools. Default 0. May change
    /// between opens (a store already larger keeps its pools but cannot grow).
    pub pm_capacity: u64,
    /// Reserve the whole [`Options::pm_capacity`] at open: pool files not created yet are
    /// created and fully allocated as spares (`pool-NNNNNN.tmp`, docs/format/pm-pool.md),
    /// so the PM device's pages are all allocated before the first write (what a real PM
    /// namespace is) and growth never allocates on the write path. Requires `pm_capacity`
    /// and pool files (ignored with a simulated device). Default `false`.
    pub pm_preallocate: bool,
    /// Size of each PM pool file: a power of two from 1 MiB to 1 TiB (addresses split into
    /// pool and offset with a shift). *Creation-only.* Default 256 MiB. The region grows by
    /// adding pools; a single value must fit in one pool.
    pub pm_pool_size: u64,
    /// Largest accepted key, at most [`MAX_KEY_SIZE`] (the default).
    pub max_key_size: usize,
    /// Largest accepted value, at most [`MAX_VALUE_SIZE`] (the default, 64 MiB).
    pub max_value_size: usize,
    /// What opening does with damaged write-ahead-log records (`hpdk`'s and `hoakv`'s WAL
    /// files). Default [`WalRecovery::TolerateTornTail`]: a torn tail is dropped, any other
    /// damage is [`crate::Error::Corruption`]. [`crate::Db::recovery_report`] lists what
    /// was dropped.
    pub wal_recovery: WalRecovery,
    /// Options of the `pmekv` preset.
    pub pmekv: PmekvOptions,
    /// Options of the `native` preset.
    pub native: NativeOptions,
    /// Options of the `slmdb` preset.
    pub slmdb: SlmdbOptions,
    /// Options of the `hpdk` preset.
    pub hpdk: HpdkOptions,
    /// Options of the `lightkv` preset.
    pub lightkv: LightkvOptions,
    /// Options of the `hoakv` preset.
    pub hoakv: HoakvOptions,
    /// File-system seam (tests inject [`crate::fs::FaultFs`]). Default: the real file system.
    pub fs: Option<Arc<dyn Fs>>,
    /// Simulated PM device (tests). When set, PM lives in the crash simulator instead of
    /// pool files and `pm_path` is ignored. Default `None`.
    pub pm_device: Option<SimDevice>,
    /// Where a failed msync of PM is recorded; tests share one to inject msync failures
    /// ([`crate::pm::PmHealth::fail_msync_after`]). Default `None`: a fresh record per open.
    pub pm_health: Option<Arc<crate::pm::PmHealth>>,
    /// Instrumentation of background jobs (tests): counts their safe points and
    /// cancellations and can park one until `close()` ([`crate::jobs::JobProbe`]).
    /// Default `None`.
    pub job_probe: Option<Arc<crate::jobs::JobProbe>>,
}

impl fmt::Debug for Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Options")
            .field("preset", &self.preset)
            .field("create_if_missing", &self.create_if_missing)
            .field("error_if_exists", &self.error_if_exists)
            .field("pm_path", &self.pm_path)
            .field("pm_sync", &self.pm_sync)
            .field("pm_write_latency_ns", &self.pm_write_latency_ns)
            .field("pm_write_bandwidth_mbps", &self.pm_write_bandwidth_mbps)
            .field("pm_read_latency_ns", &self.pm_read_latency_ns)
            .field("pm_capacity", &self.pm_capacity)
            .field("pm_preallocate", &self.pm_preallocate)
            .field("pm_pool_size", &self.pm_pool_size)
            .field("max_key_size", &self.max_key_size)
            .field("max_value_size", &self.max_value_size)
            .field("wal_recovery", &self.wal_recovery)
            .field("pmekv", &self.pmekv)
            .field("native", &self.native)
            .field("slmdb", &self.slmdb)
            .field("hpdk", &self.hpdk)
            .field("lightkv", &self.lightkv)
            .field("hoakv", &self.hoakv)
            .field("fs", &self.fs.as_ref().map(|_| "custom"))
            .field("pm_device", &self.pm_device.as_ref().map(|_| "simulated"))
            .field("pm_health", &self.pm_health.as_ref().map(|_| "shared"))
            .field("job_probe", &self.job_probe.as_ref().map(|_| "set"))
            .finish()
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            preset: Preset::default(),
            create_if_missing: true,
            error_if_exists: false,
            pm_path: None,
            pm_sync: false,
            pm_write_latency_ns: 0,
            pm_write_bandwidth_mbps: 0,
            pm_read_latency_ns: 0,
            pm_capacity: 0,
            pm_preallocate: false,
            pm_pool_size: 256 << 20,
            max_key_size: MAX_KEY_SIZE,
            max_value_size: MAX_VALUE_SIZE,
            wal_recovery: WalRecovery::default(),
            pmekv: PmekvOptions::default(),
            native: NativeOptions::default(),
            slmdb: SlmdbOptions::default(),
            hpdk: HpdkOptions::default(),
            lightkv: LightkvOptions::default(),
            hoakv: HoakvOptions::default(),
            fs: None,
            pm_device: None,
            pm_health: None,
            job_probe: None,
        }
    }
}

impl Options {
    /// Defaults, as documented on each field.
    pub fn new() -> Self {
        Self::default()
    }
    /// Set [`Options::preset`].
    pub fn preset(mut self, preset: Preset) -> Self {
        self.preset = preset;
        self
    }
    /// Set [`Options::create_if_missing`].
    pub fn create_if_missing(mut self, v: bool) -> Self {
        self.create_if_missing = v;
        self
    }
    /// Set [`Options::error_if_exists`].
    pub fn error_if_exists(mut self, v: bool) -> Self {
        self.error_if_exists = v;
        self
    }
    /// Set [`Options::pm_path`].
    pub fn pm_path(mut self, p: impl Into<PathBuf>) -> Self {
        self.pm_path = Some(p.into());
        self
    }
    /// Set [`Options::wal_recovery`].
    pub fn wal_recovery(mut self, mode: WalRecovery) -> Self {
        self.wal_recovery = mode;
        self
    }
    /// Set [`Options::pm_sync`].
    pub fn pm_sync(mut self, v: bool) -> Self {
        self.pm_sync = v;
        self
    }
    /// Set [`Options::pm_write_latency_ns`].
    pub fn pm_write_latency_ns(mut self, v: u64) -> Self {
        self.pm_write_latency_ns = v;
        self
    }
    /// Set [`Options::pm_write_bandwidth_mbps`].
    pub fn pm_write_bandwidth_mbps(mut self, v: u64) -> Self {
        self.pm_write_bandwidth_mbps = v;
        self
    }
    /// Set [`Options::pm_read_latency_ns`].
    pub fn pm_read_latency_ns(mut self, v: u64) -> Self {
        self.pm_read_latency_ns = v;
        self
    }
    /// Emulate the media `profile`: sets [`Options::pm_read_latency_ns`],
    /// [`Options::pm_write_latency_ns`] and [`Options::pm_write_bandwidth_mbps`] to its
    /// figures ([`crate::pm::profile`]).
    pub fn pm_profile(mut self, profile: crate::pm::PmProfile) -> Self {
        self.pm_read_latency_ns = profile.read_latency_ns();
        self.pm_write_latency_ns = profile.write_latency_ns();
        self.pm_write_bandwidth_mbps = profile.write_bandwidth_mbps();
        self
    }
    /// Set [`Options::pm_capacity`] (bytes).
    pub fn pm_capacity(mut self, v: u64) -> Self {
        self.pm_capacity = v;
        self
    }
    /// Set [`Options::pm_preallocate`].
    pub fn pm_preallocate(mut self, v: bool) -> Self {
        self.pm_preallocate = v;
        self
    }
    /// Set [`Options::pm_pool_size`].
    pub fn pm_pool_size(mut self, v: u64) -> Self {
        self.pm_pool_size = v;
        self
    }
    /// Set [`Options::max_key_size`].
    pub fn max_key_size(mut self, v: usize) -> Self {
        self.max_key_size = v;
        self
    }
    /// Set [`Options::max_value_size`].
    pub fn max_value_size(mut self, v: usize) -> Self {
        self.max_value_size = v;
        self
    }
    /// Set [`Options::native`].
    pub fn native(mut self, v: NativeOptions) -> Self {
        self.native = v;
        self
    }
    /// Set [`Options::pmekv`].
    pub fn pmekv(mut self, v: PmekvOptions) -> Self {
        self.pmekv = v;
        self
    }
    /// Set [`Options::slmdb`].
    pub fn slmdb(mut self, v: SlmdbOptions) -> Self {
        self.slmdb = v;
        self
    }
    /// Set [`Options::hpdk`].
    pub fn hpdk(mut self, v: HpdkOptions) -> Self {
        self.hpdk = v;
        self
    }
    /// Set [`Options::lightkv`].
    pub fn lightkv(mut self, v: LightkvOptions) -> Self {
        self.lightkv = v;
        self
    }

    /// Set [`Options::hoakv`].
    pub fn hoakv(mut self, v: HoakvOptions) -> Self {
        self.hoakv = v;
        self
    }

    /// Set [`Options::fs`].
    pub fn fs(mut self, fs: Arc<dyn Fs>) -> Self {
        self.fs = Some(fs);
        self
    }
    /// Set [`Options::job_probe`].
    pub fn job_probe(mut self, probe: Arc<crate::jobs::JobProbe>) -> Self {
        self.job_probe = Some(probe);
        self
    }
    /// Set [`Options::pm_device`].
    pub fn pm_device(mut self, dev: SimDevice) -> Self {
        self.pm_device = Some(dev);
        self
    }

    /// Reject option values no store can run with.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.max_key_size > MAX_KEY_SIZE {
            return bad(format!("max_key_size {} exceeds {MAX_KEY_SIZE}", self.max_key_size));
        }
        if self.max_value_size > MAX_VALUE_SIZE {
            return bad(format!("max_value_size {} exceeds {MAX_VALUE_SIZE}", self.max_value_size));
        }
        if self.pm_pool_size < (1 << 20) || self.pm_pool_size > (1 << 40) || !self.pm_pool_size.is_power_of_two() {
            return bad(format!("pm_pool_size {} must be a power of two between 1 MiB and 1 TiB", self.pm_pool_size));
        }
        if self.pm_preallocate && self.pm_capacity == 0 {
            return bad("pm_preallocate needs pm_capacity (how much PM to reserve)".into());
        }
        let n = &self.native;
        if n.shards > 1024 {
            return bad(format!("native.shards {} exceeds 1024", n.shards));
        }
        if self.preset == Preset::Native && (n.segment_size < (16 << 10) || !n.segment_size.is_multiple_of(4096)) {
            return bad(format!("native.segment_size {} must be a multiple of 4 KiB, at least 16 KiB", n.segment_size));
        }
        if !(0.1..=0.95).contains(&n.pm_watermark) {
            return bad(format!("native.pm_watermark {} must be within 0.1..=0.95", n.pm_watermark));
        }
        let p = &self.pmekv;
        if !(4..=1024).contains(&p.node_capacity) {
            return bad(format!("pmekv.node_capacity {} not in 4..=1024", p.node_capacity));
        }
        for (name, v) in [("kv_log_size", p.kv_log_size), ("key_log_size", p.key_log_size)] {
            // At least 256 KiB, so that one operation on the largest key (64 KiB) always
            // fits in half a ring.
            if v < 256 << 10 || !v.is_multiple_of(64) {
                return bad(format!("pmekv.{name} {v} must be a multiple of 64 and at least 256 KiB"));
            }
        }
        let s = &self.slmdb;
        if s.memtable_size < (64 << 10) || !s.memtable_size.is_multiple_of(64) {
            return bad(format!(
                "slmdb.memtable_size {} must be a multiple of 64 and at least 64 KiB",
                s.memtable_size
            ));
        }
        if self.preset == Preset::Slmdb && s.memtable_size > self.pm_pool_size - 4096 {
            return bad(format!(
                "slmdb.memtable_size {} does not fit in a PM pool of {} bytes (raise pm_pool_size)",
                s.memtable_size, self.pm_pool_size
            ));
        }
        if !(256..=(1 << 20)).contains(&s.block_size) {
            return bad(format!("slmdb.block_size {} not in 256..=1 MiB", s.block_size));
        }
        if !(0.0..=1.0).contains(&s.live_key_threshold) {
            return bad(format!("slmdb.live_key_threshold {} not in 0..=1", s.live_key_threshold));
        }
        if s.max_merge_files < 1 || s.seq_subrange_keys < 1 || s.output_file_size < 4096 {
            return bad("slmdb: max_merge_files and seq_subrange_keys must be >= 1, output_file_size >= 4096".into());
        }
        let h = &self.hpdk;
        if h.memtable_size < (16 << 10) {
            return bad(format!("hpdk.memtable_size {} must be at least 16 KiB", h.memtable_size));
        }
        if h.vlog_pool_size < (64 << 10) || h.vlog_pool_size > (4 << 30) {
            return bad(format!("hpdk.vlog_pool_size {} not in 64 KiB..=4 GiB", h.vlog_pool_size));
        }
        if self.preset == Preset::Hpdk && h.vlog_pool_size > self.pm_pool_size - (1 << 19) {
            return bad(format!(
                "hpdk.vlog_pool_size {} does not fit in a PM pool of {} bytes (raise pm_pool_size)",
                h.vlog_pool_size, self.pm_pool_size
            ));
        }
        if !(256..=(1 << 20)).contains(&h.block_size) {
            return bad(format!("hpdk.block_size {} not in 256..=1 MiB", h.block_size));
        }
        if !(0.0..=1.0).contains(&h.live_rate_threshold) || h.merge_trigger < 1 {
            return bad("hpdk: live_rate_threshold must be in 0..=1 and merge_trigger >= 1".into());
        }
        let l = &self.lightkv;
        if l.max_leaf_nodes < 2 || l.max_leaf_nodes > 1 << 20 {
            return bad(format!("lightkv.max_leaf_nodes {} not in 2..=1048576", l.max_leaf_nodes));
        }
        if !(1..=(1 << 16)).contains(&l.leaf_buckets) || l.t_normal < 1 || l.compaction_size < 2 {
            return bad("lightkv: leaf_buckets must be in 1..=65536, t_normal >= 1, compaction_size >= 2".into());
        }
        if l.segment_size < (64 << 10) || !l.segment_size.is_multiple_of(64) {
            return bad(format!(
                "lightkv.segment_size {} must be a multiple of 64 and at least 64 KiB",
                l.segment_size
            ));
        }
        if self.preset == Preset::Lightkv && l.segment_size > self.pm_pool_size / 2 {
            return bad(format!(
                "lightkv.segment_size {} must be at most half a PM pool of {} bytes (raise pm_pool_size)",
                l.segment_size, self.pm_pool_size
            ));
        }
        if !(256..=(1 << 20)).contains(&l.block_size) {
            return bad(format!("lightkv.block_size {} not in 256..=1 MiB", l.block_size));
        }
        let h = &self.hoakv;
        if h.vtable_size < 4096 || !h.vtable_size.is_multiple_of(64) || h.vtable_size > (1 << 30) {
            return bad(format!("hoakv.vtable_size {} must be a multiple of 64 in 4 KiB..=1 GiB", h.vtable_size));
        }
        if self.preset == Preset::Hoakv && h.vtable_size > self.pm_pool_size / 2 {
            return bad(format!(
                "hoakv.vtable_size {} must be at most half a PM pool of {} bytes (raise pm_pool_size)",
                h.vtable_size, self.pm_pool_size
            ));
        }
        if !(1..=8).contains(&h.hash_functions) || h.hot_buckets > (1 << 30) || h.heat_window < 1 {
            return bad("hoakv: hash_functions must be in 1..=8, hot_buckets at most 2^30, heat_window >= 1".into());
        }
        if h.group_size < 4096 || h.memtable_size < 4096 || h.level1_size < 4096 || h.target_file_size < 1024 {
            return bad(
                "hoakv: group_size, memtable_size and level1_size must be >= 4 KiB, target_file_size >= 1 KiB".into()
            );
        }
        if !(256..=(1 << 20)).contains(&h.block_size) {
            return bad(format!("hoakv.block_size {} not in 256..=1 MiB", h.block_size));
        }
        Ok(())
    }
}
