//! `tierkv.Snapshot`: a consistent point-in-time view for reads ([`tierkv::Db::snapshot`]).

use std::sync::Arc;

use parking_lot::RwLock;
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::bytes_arg;
use crate::errors::IntoPy;
use crate::iter::{self, Mode, Range, RangeIterator};
use crate::shared::Shared;

/// A read-only view of the store as it was when `Db.snapshot()` was called: writes made
/// afterwards are not seen. Supports `snap[key]`, `get`, `in`, `items/keys/values` (same
/// arguments as `Db.items`) and iteration over keys. Close it (or use it as a context
/// manager) when done: while a snapshot lives the store keeps the versions it sees.
/// Raises `ClosedError` after `close()` or once its `Db` is closed.
#[pyclass(module = "tierkv", frozen)]
#[derive(Debug)]
pub struct Snapshot {
    slot: Arc<RwLock<Option<tierkv::Snapshot>>>,
    shared: Arc<Shared>,
}

impl Snapshot {
    /// Take a snapshot of the open store and register it. Called without the GIL.
    pub(crate) fn take(shared: &Arc<Shared>) -> tierkv::Result<Snapshot> {
        shared.with_db(|db| {
            let slot = Arc::new(RwLock::new(Some(db.snapshot()?)));
            shared.register_snapshot(&slot)?;
            Ok(Snapshot { slot, shared: shared.clone() })
        })
    }

    fn read<T>(&self, f: impl FnOnce(&tierkv::Snapshot) -> tierkv::Result<T>) -> tierkv::Result<T> {
        match self.slot.read().as_ref() {
            Some(s) => f(s),
            None => Err(tierkv::Error::Closed),
        }
    }

    fn lookup(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u8>>> {
        let key = bytes_arg(key, "key")?;
        let key = key.as_slice();
        py.detach(|| self.read(|s| s.get(key))).py_err(py)
    }

    fn range(&self, py: Python<'_>, range: Range) -> PyResult<RangeIterator> {
        let slot = py
            .detach(|| {
                let it = self.read(|s| s.iter_with(&range.opts))?;
                iter::make(&self.shared, &range, it)
            })
            .py_err(py)?;
        Ok(RangeIterator::new(slot, self.shared.clone()))
    }
}

#[pymethods]
impl Snapshot {
    /// The value of `key` in the snapshot; `KeyError` if it was absent.
    fn __getitem__<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        match self.lookup(py, key)? {
            Some(v) => Ok(PyBytes::new(py, &v)),
            None => Err(PyKeyError::new_err(key.clone().unbind())),
        }
    }

    /// The value of `key` in the snapshot, or `default`.
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

    fn __contains__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.lookup(py, key)?.is_some())
    }

    fn __iter__(&self, py: Python<'_>) -> PyResult<RangeIterator> {
        self.range(py, Range::parse(None, None, None, false, Mode::Keys)?)
    }

    /// `(key, value)` pairs of the snapshot; see `Db.items`.
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

    /// Keys of the snapshot; see `Db.items`.
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

    /// Values of the snapshot; see `Db.items`.
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

    /// Release the snapshot (idempotent). Iterators already made from it keep working.
    fn close(&self, py: Python<'_>) {
        py.detach(|| drop(self.slot.write().take()))
    }

    /// Whether the snapshot (or its Db) is closed.
    #[getter]
    fn closed(&self) -> bool {
        self.shared.is_closed() || self.slot.try_read().is_some_and(|s| s.is_none())
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("<tierkv.Snapshot{}>", if self.closed() { " closed" } else { "" })
    }
}
