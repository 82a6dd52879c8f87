//! tierkv: an embeddable, crash-safe key-value store for machines that mix DRAM,
//! persistent memory (PM) and SSDs, hosting published PM-aware designs as presets behind
//! one API.
//!
//! ```no_run
//! use tierkv::{Db, Options, Preset, WriteBatch};
//! # fn main() -> tierkv::Result<()> {
//! let db = Db::open("/tmp/tierkv-demo", Options::new().preset(Preset::Native))?;
//! db.put(b"key", b"value")?;
//! assert_eq!(db.get(b"key")?, Some(b"value".to_vec()));
//! let mut batch = WriteBatch::new();
//! batch.put(b"a", b"1").delete(b"key");
//! db.write(batch)?;
//! for item in db.scan(b"a".as_slice()..b"m".as_slice())? {
//!     let (k, v) = item?;
//!     println!("{k:?} = {v:?}");
//! }
//! db.close()?;
//! # Ok(()) }
//! ```
//!
//! Layout: [`pm`] (the PM region and its crash simulator), [`fs`] (the file seam and its
//! fault-injecting twin), [`format`](mod@format) (checksums, decoding), [`index`] (shared index
//! structures), [`engine`] (one module per preset), and the API types at the top level.
//!
//! Lints: `unwrap`/`expect` are denied in library code; decoding of persistent bytes goes
//! through the non-panicking [`format::Cursor`] instead of slice indexing.

pub mod batch;
pub(crate) mod counters;
pub mod db;
pub mod engine;
pub mod error;
pub mod format;
pub mod fs;
pub(crate) mod group;
pub mod index;
pub mod iter;
pub mod jobs;
pub(crate) mod lsm;
pub mod manifest;
pub mod options;
pub mod options_file;
pub mod pm;
pub(crate) mod poison;
pub mod repair;
pub(crate) mod snapshot;
pub mod sstable;
pub mod stats;
pub mod testing;

pub use batch::{BatchOp, WriteBatch};
pub use db::Db;
pub use db::Snapshot;
pub use error::{Error, Result};
pub use iter::{DbIterator, IterOptions, Scan};
pub use options::{
    HoakvOptions, HpdkOptions, LightkvOptions, LightkvPlacement, NativeOptions, Options, PmekvOptions, Preset,
    SlmdbOptions, WalRecovery,
};
pub use stats::Stats;

/// Render bytes for humans: printable ASCII as is, everything else (and `\`) as `\xNN`.
pub fn escape(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len());
    for &b in bytes {
        if (0x20..0x7f).contains(&b) && b != b'\\' {
            s.push(b as char);
        } else {
            s.push_str(&format!("\\x{b:02x}"));
        }
    }
    s
}

/// Inverse of [`escape`]: `\xNN` becomes the byte; `None` on a malformed escape.
pub fn unescape(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b.get(i) == Some(&b'\\') {
            if b.get(i + 1) != Some(&b'x') {
                return None;
            }
            let hex = std::str::from_utf8(b.get(i + 2..i + 4)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 4;
        } else {
            out.push(*b.get(i)?);
            i += 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn escape_round_trips() {
        let raw = b"a\\b\x00\xff\t z".to_vec();
        let e = super::escape(&raw);
        assert_eq!(e, "a\\x5cb\\x00\\xff\\x09 z");
        assert_eq!(super::unescape(&e), Some(raw));
        assert_eq!(super::unescape("\\q"), None);
    }
}
