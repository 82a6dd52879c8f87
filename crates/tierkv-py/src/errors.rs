//! The exception hierarchy and the mapping from [`tierkv::Error`].
//!
//! ```text
//! tierkv.Error(Exception)                 every error raised by the store
//! ├── tierkv.CorruptionError              damaged persistent data (.file, .offset, .detail)
//! ├── tierkv.InvalidArgument(ValueError)  over-limit key/value, bad option, preset mismatch
//! ├── tierkv.PmFullError                  the persistent-memory region is full
//! ├── tierkv.PoisonedError                refused after an earlier unrecoverable failure
//! ├── tierkv.ClosedError                  the Db (or snapshot) was closed
//! └── tierkv.LockedError                  the store is open in another handle or process
//! ```
//!
//! `InvalidArgument` derives from both `tierkv.Error` and `ValueError`, which a single-base
//! `create_exception!` cannot express, so every class is made at module init by calling
//! `type(name, bases, namespace)` and kept in a [`PyOnceLock`]. I/O errors (and any variant
//! a later tierkv adds) are raised as `tierkv.Error` itself, with the OS error's message.
//! Python's own conventions stay: a missing key is `KeyError`, a `str` key `TypeError`.

use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The exception classes, made once per process at module init.
struct Classes {
    error: Py<PyType>,
    corruption: Py<PyType>,
    invalid: Py<PyType>,
    pm_full: Py<PyType>,
    poisoned: Py<PyType>,
    closed: Py<PyType>,
    locked: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// `type(name, bases, {"__module__": "tierkv", "__doc__": doc})`.
fn make_class<'py>(
    py: Python<'py>,
    name: &str,
    bases: Vec<Bound<'py, PyType>>,
    doc: &str,
) -> PyResult<Bound<'py, PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "tierkv")?;
    ns.set_item("__doc__", doc)?;
    let bases = PyTuple::new(py, bases)?;
    let class = py.get_type::<PyType>().call1((name, bases, ns))?;
    Ok(class.cast_into::<PyType>()?)
}

/// Make the classes (once) and add them to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let classes = CLASSES.get_or_try_init(py, || -> PyResult<Classes> {
        let error =
            make_class(py, "Error", vec![py.get_type::<PyException>()], "Base class of every error tierkv raises.")?;
        let sub = |name: &str, doc: &str| make_class(py, name, vec![error.clone()], doc).map(Bound::unbind);
        Ok(Classes {
            corruption: sub(
                "CorruptionError",
                "Persistent data failed a checksum or structural check. Attributes: file, offset, detail.",
            )?,
            invalid: make_class(
                py,
                "InvalidArgument",
                vec![error.clone(), py.get_type::<PyValueError>()],
                "tierkv refused an argument (over-limit key or value, bad option, another preset's \
                 directory); nothing was written. Also a ValueError.",
            )?
            .unbind(),
            pm_full: sub("PmFullError", "The persistent-memory region is full and cannot grow.")?,
            poisoned: sub(
                "PoisonedError",
                "The store refuses writes after an earlier failure it cannot recover from in place; reopen it.",
            )?,
            closed: sub("ClosedError", "The Db (or the snapshot) has been closed.")?,
            locked: sub("LockedError", "The store directory is open in another handle or process.")?,
            error: error.unbind(),
        })
    })?;
    for (name, class) in [
        ("Error", &classes.error),
        ("CorruptionError", &classes.corruption),
        ("InvalidArgument", &classes.invalid),
        ("PmFullError", &classes.pm_full),
        ("PoisonedError", &classes.poisoned),
        ("ClosedError", &classes.closed),
        ("LockedError", &classes.locked),
    ] {
        m.add(name, class.bind(py))?;
    }
    Ok(())
}

fn raise(py: Python<'_>, pick: impl FnOnce(&Classes) -> &Py<PyType>, msg: String) -> PyErr {
    match CLASSES.get(py) {
        Some(c) => PyErr::from_type(pick(c).bind(py).clone(), msg),
        // Unreachable once the module is imported (the classes are made by its init).
        None => PyRuntimeError::new_err(msg),
    }
}

/// The Python exception for a tierkv error.
pub(crate) fn to_py(py: Python<'_>, e: tierkv::Error) -> PyErr {
    let msg = e.to_string();
    match e {
        tierkv::Error::Corruption { file, offset, detail } => {
            let err = raise(py, |c| &c.corruption, msg);
            let value = err.value(py);
            // Attributes are a convenience: a failure to set one must not hide the error.
            let _ = value.setattr("file", file.to_string_lossy().into_owned());
            let _ = value.setattr("offset", offset);
            let _ = value.setattr("detail", detail);
            err
        }
        tierkv::Error::InvalidArgument(_) | tierkv::Error::PresetMismatch { .. } => raise(py, |c| &c.invalid, msg),
        tierkv::Error::PmFull(_) => raise(py, |c| &c.pm_full, msg),
        tierkv::Error::Poisoned(_) => raise(py, |c| &c.poisoned, msg),
        tierkv::Error::Closed => raise(py, |c| &c.closed, msg),
        tierkv::Error::Locked(_) => raise(py, |c| &c.locked, msg),
        _ => raise(py, |c| &c.error, msg),
    }
}

/// `ClosedError` with a message naming what was closed.
pub(crate) fn closed(py: Python<'_>, what: &str) -> PyErr {
    raise(py, |c| &c.closed, format!("{what} is closed"))
}

/// `InvalidArgument` with `msg`.
pub(crate) fn invalid(py: Python<'_>, msg: String) -> PyErr {
    raise(py, |c| &c.invalid, msg)
}

/// Map the error of a tierkv result to its Python exception.
pub(crate) trait IntoPy<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPy<T> for tierkv::Result<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}
