//! The error type of every fallible tierkv call.
//!
//! Corruption is always a typed error naming where it was found; tierkv never panics on
//! data read from disk or persistent memory and never returns silently wrong data.

use std::path::PathBuf;

/// Result alias used throughout tierkv.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a tierkv call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system I/O error (disk file, PM pool file, directory).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),

    /// Persistent data failed a checksum or structural check.
    ///
    /// `file` names the file or PM pool, `offset` the byte offset of the damaged record.
    #[error("corruption in {} at offset {offset}: {detail}", file.display())]
    Corruption {
        /// The file (or PM pool file) holding the bad record.
        file: PathBuf,
        /// Byte offset of the record inside `file`.
        offset: u64,
        /// What check failed.
        detail: String,
    },

    /// The caller passed something tierkv refuses (over-limit key or value, bad option).
    /// Nothing was written.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The directory was created with another preset.
    #[error("preset mismatch: the directory holds a `{stored}` store, but `{requested}` was requested")]
    PresetMismatch {
        /// Preset recorded in the directory.
        stored: String,
        /// Preset the caller asked for.
        requested: String,
    },

    /// The store refuses further writes after an earlier failure it cannot recover from in
    /// place (a failed sync, a panic in a background thread). Reopen the store.
    #[error("store is poisoned by an earlier failure ({0}); reopen it")]
    Poisoned(String),

    /// The persistent-memory region is full and cannot grow.
    #[error("persistent memory region is full: {0}")]
    PmFull(String),

    /// The store is already open in this or another process.
    #[error("store directory {} is locked by another open handle", .0.display())]
    Locked(PathBuf),

    /// The store has been closed.
    #[error("store is closed")]
    Closed,
}

impl Error {
    /// Shorthand for [`Error::Corruption`].
    pub(crate) fn corruption(file: impl Into<PathBuf>, offset: u64, detail: impl Into<String>) -> Self {
        Error::Corruption { file: file.into(), offset, detail: detail.into() }
    }

    /// True for [`Error::Corruption`].
    pub fn is_corruption(&self) -> bool {
        matches!(self, Error::Corruption { .. })
    }

    /// The same error for another caller (an I/O error keeps its kind and message), for
    /// work done once on behalf of several callers, such as a group commit.
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::Io(e) => Error::Io(std::io::Error::new(e.kind(), e.to_string())),
            Error::Corruption { file, offset, detail } => {
                Error::Corruption { file: file.clone(), offset: *offset, detail: detail.clone() }
            }
            Error::InvalidArgument(s) => Error::InvalidArgument(s.clone()),
            Error::PresetMismatch { stored, requested } => {
                Error::PresetMismatch { stored: stored.clone(), requested: requested.clone() }
            }
            Error::Poisoned(s) => Error::Poisoned(s.clone()),
            Error::PmFull(s) => Error::PmFull(s.clone()),
            Error::Locked(p) => Error::Locked(p.clone()),
            Error::Closed => Error::Closed,
        }
    }
}
