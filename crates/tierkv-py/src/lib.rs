//! `import tierkv`: the Python bindings of tierkv.
//!
//! ```python
//! import tierkv
//! with tierkv.open("/data/kv", preset="native") as db:
//!     db[b"k"] = b"v"                   # durable when it returns
//!     assert db[b"k"] == b"v"
//!     with db.write_batch() as b:       # atomic on exit; discarded if the block raises
//!         b.put(b"a", b"1"); b.delete(b"k")
//!     for k, v in db.items(start=b"a", stop=b"m"): ...
//! ```
//!
//! Layout: [`errors`] (the exception hierarchy and the mapping from [`tierkv::Error`]),
//! [`convert`] (bytes arguments, `open()`'s keyword options, `stats()`), [`shared`] (the
//! store handle shared by a `Db` and everything made from it, and what `close()` does),
//! [`db`], [`batch`], [`snapshot`] and [`iter`] (the Python classes).
//!
//! # Threads and the GIL
//!
//! Every call into the store (open, get, put, delete, batch commit, snapshot reads, each
//! iterator refill, stats, check, compact, flush, close) runs inside [`Python::detach`]: the
//! GIL is released, so Python threads using one `Db` run their store calls in parallel. No
//! Rust lock is ever waited for while the GIL is held (a thread that holds a lock never needs
//! the GIL to release it), so there is no lock-order deadlock between the two. Arguments
//! borrowed into a detached call are immutable `bytes` (other buffers are copied first).
//!
//! # Building: why this crate needs no `extension-module` feature
//!
//! PyO3 0.30 deprecates its `extension-module` feature: a Python extension must not link
//! `libpython`, and the build script learns that from the `PYO3_BUILD_EXTENSION_MODULE`
//! environment variable, which maturin (>= 1.9.4) sets. The workspace's
//! `.cargo/config.toml` sets it too, so `cargo build/clippy/test --workspace` compile this
//! crate like maturin does, and never need a `libpython` to link against (Debian's
//! `python3` ships none without `python3-dev`); the crate is a `cdylib` whose Rust test and
//! doctest targets are disabled, because a test binary would have to embed an interpreter.
//! Its tests are the Python ones in `tests/`, run by `scripts/test.sh` against the wheel
//! that `maturin build --release` makes, installed into a fresh virtual environment.

use pyo3::prelude::*;

pub mod batch;
pub mod convert;
pub mod db;
pub mod errors;
pub mod iter;
pub mod shared;
pub mod snapshot;

/// tierkv: an embeddable, crash-safe key-value store for DRAM, persistent memory and SSDs.
///
/// Open a store with `tierkv.open(path, preset="native", **options)`; keys and values are
/// bytes. See `help(tierkv.Db)`.
#[pymodule(name = "tierkv")]
fn tierkv_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    let presets: Vec<&str> = tierkv::Preset::ALL.iter().map(|p| p.name()).collect();
    m.add("PRESETS", pyo3::types::PyTuple::new(py, presets)?)?;
    m.add_function(wrap_pyfunction!(db::open, m)?)?;
    m.add_class::<db::Db>()?;
    m.add_class::<batch::WriteBatch>()?;
    m.add_class::<snapshot::Snapshot>()?;
    m.add_class::<iter::RangeIterator>()?;
    errors::register(m)?;
    // Close the stores still open when the interpreter exits (see `shared`).
    let hook = wrap_pyfunction!(close_all_at_exit, m)?;
    py.import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}

/// Close every tierkv store still open (registered with `atexit`).
#[pyfunction]
fn close_all_at_exit(py: Python<'_>) {
    py.detach(shared::close_all_at_exit)
}
