//! `tierkv.open()` and `tierkv.Db`.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::batch::WriteBatch;
use crate::convert::{self, bytes_arg};
use crate::errors::IntoPy;
use crate::iter::{self, Mode, Range, RangeIterator};
use crate::shared::Shared;
use crate::snapshot::Snapshot;

/// Open (creating if missing) the store in directory `path`.
///
/// `preset` picks the design (`tierkv.PRESETS`); a directory remembers its preset and
/// reopening it with another raises `InvalidArgument`. Keyword options mirror
/// `tierkv::Options`: top-level fields by name (`create_if_missing`, `error_if_exists`,
/// `pm_path`, `pm_sync`, `pm_capacity`, `pm_pool_size`, `pm_profile`, `max_key_size`,
/// `max_value_size`, `wal_recovery`, `pm_write_latency_ns`, ...), each preset's own options
/// as a dict named after it (`native={"shards": 8}`). Unknown options raise `TypeError`.
///
/// Use the result as a context manager (`with tierkv.open(p) as db:`) or call `close()`.
/// Raises `LockedError` if the store is open elsewhere, `CorruptionError` if its data is
/// damaged.
#[pyfunction]
#[pyo3(signature = (path, preset = "native", **options))]
pub fn open(py: Python<'_>, path: PathBuf, preset: &str, options: Option<&Bound<'_, PyDict>>) -> PyResult<Db> {
    let opts = convert::options(py, preset, options)?;
    let db = py.detach(|| tierkv::Db::open(&path, opts)).py_err(py)?;
    let preset = db.preset().name();
    Ok(Db { shared: Shared::new(db), path, preset })
}

/// An open tierkv store: a persistent, ordered mapping of bytes to bytes.
///
/// `db[key] = value` (durable when it returns), `db[key]` (`KeyError` if absent),
/// `db.get(key, default)`, `key in db`, `del db[key]`, `write_batch()` for atomic groups of
/// writes, `items/keys/values(start=, stop=, prefix=, reverse=)` for ordered ranges,
/// `snapshot()` for a point-in-time view, `stats()`, `check()`, `compact()`, `close()`.
/// Keys and values are `bytes`; any buffer (`bytearray`, `memoryview`, ...) is accepted as
/// input, `str` is refused with `TypeError`.
///
/// A `Db` may be shared between threads: every store call releases the GIL, so calls from
/// several threads run in parallel. `close()` waits for calls in flight; later calls, and
/// iterators or snapshots still open, raise `ClosedError`. A store still open when the
/// interpreter exits is closed by an `atexit` hook.
#[pyclass(module = "tierkv", frozen)]
#[derive(Debug)]
pub struct Db {
    shared: Arc<Shared>,
    path: PathBuf,
    preset: &'static str,
}

impl Db {
    fn lookup(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u8>>> {
        let key = bytes_arg(key, "key")?;
        let key = key.as_slice();
        py.detach(|| self.shared.with_db(|db| db.get(key))).py_err(py)
    }

    fn range(&self, py: Python<'_>, range: Range) -> PyResult<RangeIterator> {
        let shared = &self.shared;
        let slot = py
            .detach(|| {
                shared.with_db(|db| {
                    let it = db.iter_with(&range.opts)?;
                    iter::make(shared, &range, it)
                })
            })
            .py_err(py)?;
        Ok(RangeIterator::new(slot, shared.clone()))
    }
}

#[pymethods]
impl Db {
    /// The value of `key`; `KeyError` if absent.
    fn __getitem__<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        match self.lookup(py, key)? {
            Some(v) => Ok(PyBytes::new(py, &v)),
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    /// Set `key` to `value`; durable (to the preset's promise: at least a process crash)
    /// when it returns.
    fn __setitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.put(py, key, value)
    }

    /// Remove `key`. Like `dict.pop(key, None)`, removing an absent key is not an error (the
    /// store would need a read before every delete to say).
    fn __delitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        self.delete(py, key)
    }

    fn __contains__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.lookup(py, key)?.is_some())
    }

    /// Iterate over the keys, in order (a consistent snapshot as of the call).
    fn __iter__(&self, py: Python<'_>) -> PyResult<RangeIterator> {
        self.range(py, Range::parse(None, None, None, false, Mode::Keys)?)
    }

    /// The value of `key`, or `default` if absent.
    #[pyo3(signature = (key, default = None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(match self.lookup(py, key)? {
            Some(v) => Some(PyBytes::new(py, &v).into_any()),
            None => default,
        })
    }

    /// Set `key` to `value` (same as `db[key] = value`).
    fn put(&self, py: Python<'_>, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let (k, v) = (bytes_arg(key, "key")?, bytes_arg(value, "value")?);
        let (k, v) = (k.as_slice(), v.as_slice());
        py.detach(|| self.shared.with_db(|db| db.put(k, v))).py_err(py)
    }

    /// Remove `key`; no error if it is absent.
    fn delete(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = bytes_arg(key, "key")?;
        let k = k.as_slice();
        py.detach(|| self.shared.with_db(|db| db.delete(k))).py_err(py)
    }

    /// Set `key` only if it is absent; returns whether it was written. Atomic with respect
    /// to concurrent writers.
    fn insert_if_absent(&self, py: Python<'_>, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (k, v) = (bytes_arg(key, "key")?, bytes_arg(value, "value")?);
        let (k, v) = (k.as_slice(), v.as_slice());
        py.detach(|| self.shared.with_db(|db| db.insert_if_absent(k, v))).py_err(py)
    }

    /// Set `key` only if it is present; returns whether it was written.
    fn update_if_present(&self, py: Python<'_>, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (k, v) = (bytes_arg(key, "key")?, bytes_arg(value, "value")?);
        let (k, v) = (k.as_slice(), v.as_slice());
        py.detach(|| self.shared.with_db(|db| db.update_if_present(k, v))).py_err(py)
    }

    /// A new, empty `WriteBatch` for this store (a context manager: atomic on exit,
    /// discarded if the block raises).
    fn write_batch(&self) -> WriteBatch {
        WriteBatch::new(self.shared.clone())
    }

    /// `(key, value)` pairs in key order (`reverse=True`: descending), as of the call.
    ///
    /// `start` is inclusive and `stop` exclusive, like a slice; `prefix` keeps only keys
    /// starting with it (combined with the bounds). The iterator sees a consistent snapshot
    /// made by this call: later writes are not seen.
    #[pyo3(signature = (start = None, stop = None, prefix = None, reverse = false))]
    fn items(
        &self,
        py: Python<'_>,
        start: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        prefix: Option<&Bound<'_, PyAny>>,
        reverse: bool,
    ) -> PyResult<RangeIterator> {
        self.range(py, Range::parse(start, stop, prefix, reverse, Mode::Items)?)
    }

    /// Keys in order; same arguments as `items`.
    #[pyo3(signature = (start = None, stop = None, prefix = None, reverse = false))]
    fn keys(
        &self,
        py: Python<'_>,
        start: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        prefix: Option<&Bound<'_, PyAny>>,
        reverse: bool,
    ) -> PyResult<RangeIterator> {
        self.range(py, Range::parse(start, stop, prefix, reverse, Mode::Keys)?)
    }

    /// Values in key order; same arguments as `items`.
    #[pyo3(signature = (start = None, stop = None, prefix = None, reverse = false))]
    fn values(
        &self,
        py: Python<'_>,
        start: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        prefix: Option<&Bound<'_, PyAny>>,
        reverse: bool,
    ) -> PyResult<RangeIterator> {
        self.range(py, Range::parse(start, stop, prefix, reverse, Mode::Values)?)
    }

    /// A consistent point-in-time view for reads (every preset offers one: `native` keeps
    /// versions of its own, the others record old values while a snapshot lives). Close it
    /// when done.
    fn snapshot(&self, py: Python<'_>) -> PyResult<Snapshot> {
        py.detach(|| Snapshot::take(&self.shared)).py_err(py)
    }

    /// Counters since open as a dict: preset, user/PM/disk bytes, write amplification,
    /// live keys, DRAM index bytes, raw PM counters (`pm`) and the preset's own figures
    /// (`design`). Raises `ClosedError` once closed.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stats = py.detach(|| self.shared.with_db(|db| Ok(db.stats()))).py_err(py)?;
        let json = serde_json::to_value(&stats)
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("stats: {e}")))?;
        convert::json_to_py(py, &json)
    }

    /// Verify every checksum and the agreement of index and data; returns the problems
    /// found (an empty list when the store is sound).
    fn check<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let problems = py.detach(|| self.shared.with_db(|db| db.check())).py_err(py)?;
        PyList::new(py, problems)
    }

    /// Run compaction / garbage collection now.
    fn compact(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.shared.with_db(|db| db.compact())).py_err(py)
    }

    /// Force the preset's pending background work (write-back, memtable flush) now.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.shared.with_db(|db| db.flush())).py_err(py)
    }

    /// Clean shutdown (idempotent). Waits for calls in flight; ends every iterator and
    /// snapshot of this store (they raise `ClosedError` from then on). The directory can be
    /// opened again when it returns.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.shared.close()).py_err(py)
    }

    /// Whether `close()` has been called.
    #[getter]
    fn closed(&self) -> bool {
        self.shared.is_closed()
    }

    /// The store directory.
    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// The preset the store runs.
    #[getter]
    fn preset(&self) -> &'static str {
        self.preset
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Close the store (the exception of the block, if any, propagates).
    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "<tierkv.Db path={:?} preset={} {}>",
            self.path.display().to_string(),
            self.preset,
            if self.closed() { "closed" } else { "open" }
        )
    }
}
