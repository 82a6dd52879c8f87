//! Media profiles: what emulated PM costs on top of the DRAM it runs on.
//!
//! tierkv runs on machines without Optane: a pool file on `/dev/shm` (or any page-cache
//! backed file) behaves like DRAM. A profile adds the extra costs of a real PM device to the
//! region's accessors, as the papers did with their own emulation knobs (SLM-DB added 300 /
//! 500 / 900 ns per persisted line):
//!
//! - **reads**: every read view of PM ([`super::Region::slice`],
//!   [`super::Region::load_u64_atomic`]) spins for `read_latency_ns` — the one accessor that
//!   every PM read in tierkv goes through;
//! - **writes**: every persisted 64-byte line spins for `write_latency_ns`, and write-back is
//!   throttled to `write_bandwidth_mbps` ([`super::Region::flush`]).
//!
//! # The `optane` figures
//!
//! First-generation Intel Optane DC Persistent Memory (Apache Pass), one non-interleaved
//! DIMM, as characterised by Yang, Kim, Hoseinzadeh, Izraelevitz and Swanson, "An Empirical
//! Guide to the Behavior and Use of Scalable Persistent Memory", FAST '20 (and the longer
//! Izraelevitz et al., arXiv:1903.05714, "Basic Performance Measurements of the Intel Optane
//! DC Persistent Memory Module"):
//!
//! - random 64-byte load latency 305 ns against 81 ns for DRAM: **+224 ns per read access**.
//!   (Sequential loads are cheaper, 169 ns, because the DIMM merges adjacent requests into
//!   256-byte XPLines; tierkv charges the random figure to every access, an upper bound for
//!   scans that read neighbouring records.)
//! - persisted stores (store + `clwb` + `sfence`) complete in the memory controller's
//!   ADR-protected write-pending queue at about DRAM's latency, so the profile adds **no
//!   extra per-line write latency**; what limits Optane writes is bandwidth:
//! - write bandwidth of one DIMM about 2.3 GB/s (6.6 GB/s for reads; six interleaved DIMMs
//!   reach 13.9 GB/s writes): **2,300 MB/s**.
//!
//! The `dram` profile adds nothing (the default).

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// A PM media profile (see the module docs for the figures and their source).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PmProfile {
    /// PM emulated on DRAM, no extra cost (default).
    #[default]
    Dram,
    /// First-generation Optane DC PM, one DIMM (Yang et al., FAST '20).
    Optane,
}

impl PmProfile {
    /// Every profile, in documentation order.
    pub const ALL: [PmProfile; 2] = [PmProfile::Dram, PmProfile::Optane];

    /// The profile's name (`dram`, `optane`).
    pub fn name(self) -> &'static str {
        match self {
            PmProfile::Dram => "dram",
            PmProfile::Optane => "optane",
        }
    }

    /// Extra latency of one PM read access, in ns.
    pub fn read_latency_ns(self) -> u64 {
        match self {
            PmProfile::Dram => 0,
            PmProfile::Optane => 305 - 81,
        }
    }

    /// Extra latency per persisted 64-byte line, in ns.
    pub fn write_latency_ns(self) -> u64 {
        0
    }

    /// Write bandwidth cap in MB/s (0 = none).
    pub fn write_bandwidth_mbps(self) -> u64 {
        match self {
            PmProfile::Dram => 0,
            PmProfile::Optane => 2_300,
        }
    }
}

impl fmt::Display for PmProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PmProfile {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        PmProfile::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown PM profile `{s}` (known: dram, optane)")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_is_an_error() {
        for p in PmProfile::ALL {
            assert_eq!(p.name().parse::<PmProfile>().ok(), Some(p));
        }
        assert!(matches!("nvdimm".parse::<PmProfile>(), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn dram_adds_nothing_optane_adds_the_published_costs() {
        let d = PmProfile::Dram;
        assert_eq!((d.read_latency_ns(), d.write_latency_ns(), d.write_bandwidth_mbps()), (0, 0, 0));
        let o = PmProfile::Optane;
        assert_eq!((o.read_latency_ns(), o.write_latency_ns(), o.write_bandwidth_mbps()), (224, 0, 2_300));
    }
}
