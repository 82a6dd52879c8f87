//! [`Stats`]: counters every preset reports.

use std::collections::BTreeMap;

use crate::pm::PmStats;

/// Counters of a store since it was opened.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Stats {
    /// The preset.
    pub preset: String,
    /// User bytes written (keys + values of puts, keys of deletes).
    pub user_bytes_written: u64,
    /// Bytes written back to PM (64 × lines persisted): what reaches the medium.
    pub pm_bytes_written: u64,
    /// Raw PM counters.
    pub pm: PmStats,
    /// Bytes appended to disk files.
    pub disk_bytes_written: u64,
    /// Bytes read from disk files.
    pub disk_bytes_read: u64,
    /// `pm_bytes_written / user_bytes_written` (0 when nothing was written).
    pub write_amp_pm: f64,
    /// `disk_bytes_written / user_bytes_written` (0 when nothing was written).
    pub write_amp_disk: f64,
    /// Live keys.
    pub keys: u64,
    /// Bytes of DRAM held by the index.
    pub dram_index_bytes: u64,
    /// Design-specific figures (names documented by each preset).
    pub design: BTreeMap<String, u64>,
}

impl Stats {
    /// A preset's figures: `Db::stats` adds the file seam's byte counters and the ratios.
    pub(crate) fn engine(
        preset: &str,
        pm: PmStats,
        user_bytes_written: u64,
        keys: u64,
        dram_index_bytes: u64,
        design: &[(&str, u64)],
    ) -> Stats {
        Stats {
            preset: preset.into(),
            user_bytes_written,
            pm_bytes_written: pm.lines_persisted * crate::pm::LINE,
            pm,
            keys,
            // The read path's memo of verified PM records is index-like DRAM too.
            dram_index_bytes: dram_index_bytes + pm.checked_memo_bytes,
            design: design.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            ..Stats::default()
        }
    }

    /// Fill in the write-amplification ratios from the byte counters.
    pub fn finish(mut self) -> Self {
        let user = self.user_bytes_written as f64;
        if user > 0.0 {
            self.write_amp_pm = self.pm_bytes_written as f64 / user;
            self.write_amp_disk = self.disk_bytes_written as f64 / user;
        }
        self
    }
}
