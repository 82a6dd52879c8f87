//! `tierkv.WriteBatch`: puts and deletes applied atomically ([`tierkv::Db::write`]).

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::convert::bytes_arg;
use crate::errors::IntoPy;
use crate::shared::Shared;

/// Puts and deletes collected in memory and applied atomically: after a crash all of them
/// are visible or none. Made by `Db.write_batch()`; as a context manager it commits when
/// the block ends normally and discards everything if the block raises:
///
/// ```python
/// with db.write_batch() as b:
///     b.put(b"a", b"1")
///     b.delete(b"b")
/// ```
///
/// Outside a `with` block call `commit()`. A batch can be reused after a commit or
/// `clear()`. Later operations on the same key win.
#[pyclass(module = "tierkv", frozen)]
#[derive(Debug)]
pub struct WriteBatch {
    ops: Mutex<tierkv::WriteBatch>,
    shared: Arc<Shared>,
}

impl WriteBatch {
    pub(crate) fn new(shared: Arc<Shared>) -> WriteBatch {
        WriteBatch { ops: Mutex::new(tierkv::WriteBatch::new()), shared }
    }
}

#[pymethods]
impl WriteBatch {
    /// Add `key = value` to the batch.
    fn put(&self, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let (k, v) = (bytes_arg(key, "key")?, bytes_arg(value, "value")?);
        // Held with the GIL, briefly, by code that never releases the GIL while holding it.
        self.ops.lock().put(k.as_slice(), v.as_slice());
        Ok(())
    }

    /// Add the deletion of `key` (no error if it is absent).
    fn delete(&self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = bytes_arg(key, "key")?;
        self.ops.lock().delete(k.as_slice());
        Ok(())
    }

    fn __setitem__(&self, key: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.put(key, value)
    }

    fn __delitem__(&self, key: &Bound<'_, PyAny>) -> PyResult<()> {
        self.delete(key)
    }

    /// Operations collected so far.
    fn __len__(&self) -> usize {
        self.ops.lock().len()
    }

    /// Drop the operations collected so far.
    fn clear(&self) {
        self.ops.lock().clear();
    }

    /// Apply the operations atomically and empty the batch. Durable when it returns. If
    /// the store refuses the batch (`InvalidArgument` for an over-limit key or value, ...),
    /// nothing of it is written and it is discarded.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        let ops = std::mem::take(&mut *self.ops.lock());
        py.detach(|| self.shared.with_db(|db| db.write(ops))).py_err(py)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Commit if the block ended normally; discard the batch if it raised.
    #[pyo3(signature = (exc_type, *_rest))]
    fn __exit__(&self, py: Python<'_>, exc_type: &Bound<'_, PyAny>, _rest: &Bound<'_, PyTuple>) -> PyResult<bool> {
        if exc_type.is_none() {
            self.commit(py)?;
        } else {
            self.clear();
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("<tierkv.WriteBatch of {} operations>", self.ops.lock().len())
    }
}
