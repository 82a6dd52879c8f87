//! The interface every engine under test implements (tierkv presets, the `limit` floor, the
//! peers), and the figures it reports. [`crate::engine`] builds engines by name; the engines
//! themselves depend only on this module.

/// Result of engine calls (errors are reported, not recovered).
pub type Result<T> = std::result::Result<T, String>;

/// Resource figures an engine reports after a workload.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    /// Bytes written back to PM.
    pub pm_bytes_written: u64,
    /// Bytes written to disk files.
    pub disk_bytes_written: u64,
    /// User bytes written (keys + values).
    pub user_bytes_written: u64,
    /// DRAM held by the index.
    pub dram_index_bytes: u64,
    /// PM reserved by the engine.
    pub pm_space: u64,
}

/// One engine under test.
pub trait BenchEngine: Send + Sync {
    /// Display name.
    fn name(&self) -> String;
    /// Insert or overwrite.
    fn put(&self, key: &[u8], value: &[u8]) -> Result<()>;
    /// Insert a new record (YCSB's insert). Default: [`BenchEngine::put`]; engines whose
    /// insert differs from an update (the RESP client: YCSB's binding also indexes the key)
    /// override it.
    fn insert(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.put(key, value)
    }
    /// Read; returns the value length if found (the value itself is copied out, then dropped).
    fn get(&self, key: &[u8]) -> Result<Option<usize>>;
    /// Read; returns the value itself (the crash check compares it with what was
    /// acknowledged).
    fn get_value(&self, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Read up to `n` entries from `start` in key order; returns how many were read. Every
    /// engine reads each entry in place (its key and value borrowed from the iterator, their
    /// lengths summed), copying neither: the work a range query's consumer does first.
    fn scan(&self, start: &[u8], n: usize) -> Result<usize>;
    /// Resource usage since open.
    fn usage(&self) -> Usage;
    /// Clean close, then open again; the store must still hold its data. Returns the
    /// seconds the open took (the close not included).
    fn reopen(&mut self) -> Result<f64>;
    /// False for engines without recovery (`limit`): the run skips their recovery figures.
    /// For every other engine a failed reopen fails the run.
    fn recovers(&self) -> bool {
        true
    }
    /// Bytes of disk space the store occupies.
    fn space(&self) -> u64 {
        0
    }
    /// The design's own figures (tierkv's `Stats::design`: promotions, flushes, …); empty
    /// for the peers.
    fn design(&self) -> std::collections::BTreeMap<String, u64> {
        std::collections::BTreeMap::new()
    }
    /// Drop the store as a killed process would (no clean shutdown), then open it again.
    /// Engines that cannot simulate that in-process return an error and are reported as
    /// not measured.
    fn crash_reopen(&mut self) -> Result<()> {
        Err(format!("{} cannot simulate a crash in-process", self.name()))
    }
}
