//! Small, deterministic options on the PM crash simulator and the fault-injecting file
//! system, shared by the test suites and the fuzz targets. Not for production use: the sizes
//! are chosen so that short workloads flush, merge, compact and split nodes.

use std::sync::Arc;

use crate::fs::FaultFs;
use crate::options::{
    HoakvOptions, HpdkOptions, LightkvOptions, NativeOptions, Options, PmekvOptions, Preset, SlmdbOptions,
};
use crate::pm::sim::SimDevice;

/// Every preset scaled down, on `dev` and `fs`: 1 MiB PM pools, values up to 16 KiB.
pub fn sim_options(preset: Preset, dev: &SimDevice, fs: &FaultFs) -> Options {
    Options::new()
        .preset(preset)
        .pm_device(dev.clone())
        .fs(Arc::new(fs.clone()))
        .pm_pool_size(1 << 20)
        .max_value_size(16 << 10)
        .pmekv(PmekvOptions {
            node_capacity: 8,
            kv_log_size: 256 << 10,
            key_log_size: 256 << 10,
            writeback_interval_ms: 0,
        })
        .native(native_small())
        .slmdb(slmdb_small())
        .hpdk(hpdk_small())
        .lightkv(lightkv_small())
        .hoakv(hoakv_small())
}

/// `native` scaled down so that small tests fill, seal and chain segments: 4 shards of
/// 16 KiB segments (a 16 KiB value takes a segment of two slots), and a DRAM budget of
/// about 200 index slots, so that every shared suite with more keys runs the capacity
/// tier (cold keys moved to SSTables). No background thread: writers starting a segment
/// and `compact` move and clean, so crash points are deterministic.
pub fn native_small() -> NativeOptions {
    NativeOptions {
        shards: 4,
        segment_size: 16 << 10,
        dram_budget: 200 * 292,
        background: false,
        ..NativeOptions::default()
    }
}

/// HoaKV scaled down so that small tests promote and demote keys, separate values into the
/// cold vlog, split and collect value groups and compact LSM levels: a 48 KiB HotStore of
/// 16 KiB vTables, a 64-operation heat window, values over 64 bytes in the cold vlog,
/// 16 KiB groups, 4 KiB MemTables and tables, a synced WAL (the crash tests drop unsynced
/// file data: power loss), everything in the calling thread.
pub fn hoakv_small() -> HoakvOptions {
    HoakvOptions {
        hot_store_size: 48 << 10,
        vtable_size: 16 << 10,
        heat_window: 64,
        value_size: 64,
        group_size: 16 << 10,
        memtable_size: 4 << 10,
        level1_size: 16 << 10,
        target_file_size: 4 << 10,
        block_size: 256,
        block_cache_size: 64 << 10,
        sync_wal: true,
        background: false,
        ..HoakvOptions::default()
    }
}

/// LightKV scaled down so that small tests split leaves, link and flush them and compact
/// partitions: leaves of 4 buckets (20 slots), at most 6 partitions, 64 KiB segments,
/// 256-byte blocks, everything in the calling thread.
pub fn lightkv_small() -> LightkvOptions {
    LightkvOptions {
        max_leaf_nodes: 6,
        leaf_buckets: 4,
        segment_size: 64 << 10,
        block_size: 256,
        block_cache_size: 64 << 10,
        background: false,
        ..LightkvOptions::default()
    }
}

/// HPDK scaled down so that small tests flush, merge and reuse value pools: 16 KiB
/// MemTables, 64 KiB value pools, 256-byte blocks, a merge at 2 candidates, a synced WAL
/// (the crash tests drop unsynced file data: power loss), everything in the calling thread.
pub fn hpdk_small() -> HpdkOptions {
    HpdkOptions {
        memtable_size: 16 << 10,
        vlog_pool_size: 64 << 10,
        block_size: 256,
        merge_trigger: 2,
        sync_wal: true,
        background: false,
        ..HpdkOptions::default()
    }
}

/// SLM-DB scaled down so that small tests flush, compact and split tree nodes: 64 KiB
/// MemTables, 256-byte blocks, 4 KiB compaction outputs, everything in the calling thread.
pub fn slmdb_small() -> SlmdbOptions {
    SlmdbOptions {
        memtable_size: 64 << 10,
        block_size: 256,
        output_file_size: 4096,
        background: false,
        ..SlmdbOptions::default()
    }
}

/// The preset's own point lookup, without [`crate::Db::get`]'s checks (key limit, closed
/// handle): what the `db_get` criterion bench compares `Db::get` with, to show the cost the
/// `Db` layer adds.
pub fn engine_get(db: &crate::Db, key: &[u8]) -> crate::Result<Option<Vec<u8>>> {
    db.engine_get_unchecked(key)
}

/// Run `f` on a thread of its own and return its result, or panic naming `what` when it
/// has not returned within 30 s (or panicked): a hang detector for tests of code that must
/// not wait for ever (not a timing assertion — correct code returns in milliseconds; a
/// hung thread is left behind).
pub fn returns<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    use std::sync::mpsc::RecvTimeoutError;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(30)) {
        Ok(r) => r,
        Err(RecvTimeoutError::Timeout) => panic!("{what} did not return within 30 s"),
        Err(RecvTimeoutError::Disconnected) => panic!("{what} panicked"),
    }
}
