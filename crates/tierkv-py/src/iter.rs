//! `tierkv.RangeIterator`: what `items()`, `keys()` and `values()` return.
//!
//! Each iterator is a tierkv [`tierkv::DbIterator`], a consistent snapshot of the store as
//! of the call that made it. Entries are fetched in chunks with the GIL released: the first
//! refill fetches 2 entries, each later one twice as many up to 128 (and at most 512 KiB of
//! keys and values), so `next(it)` on a fresh iterator costs little and a long scan crosses
//! the GIL boundary about once per 128 entries. Taking an already fetched entry never waits
//! for a lock while holding the GIL (it only tries the lock; if another thread holds it, the
//! call releases the GIL and waits).

use std::collections::VecDeque;
use std::ops::Bound as RangeBound;
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::convert::bytes_arg;
use crate::errors::IntoPy;
use crate::shared::Shared;

const FIRST_CHUNK: usize = 2;
const MAX_CHUNK: usize = 128;
const MAX_CHUNK_BYTES: usize = 512 << 10;

/// What an iterator yields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Items,
    Keys,
    Values,
}

#[derive(Debug)]
enum Entry {
    Item(Vec<u8>, Vec<u8>),
    One(Vec<u8>),
}

/// Range and direction of an iterator, from `items(start=, stop=, prefix=, reverse=)`.
#[derive(Debug)]
pub(crate) struct Range {
    pub(crate) opts: tierkv::IterOptions,
    reverse: bool,
    mode: Mode,
}

impl Range {
    /// `start` inclusive, `stop` exclusive (as Python slices), `prefix` intersected with them.
    pub(crate) fn parse(
        start: Option<&Bound<'_, PyAny>>,
        stop: Option<&Bound<'_, PyAny>>,
        prefix: Option<&Bound<'_, PyAny>>,
        reverse: bool,
        mode: Mode,
    ) -> PyResult<Range> {
        let owned = |o: Option<&Bound<'_, PyAny>>, what: &str| -> PyResult<Option<Vec<u8>>> {
            match o {
                Some(o) if !o.is_none() => Ok(Some(bytes_arg(o, what)?.as_slice().to_vec())),
                _ => Ok(None),
            }
        };
        let opts = tierkv::IterOptions {
            lower: owned(start, "start")?.map_or(RangeBound::Unbounded, RangeBound::Included),
            upper: owned(stop, "stop")?.map_or(RangeBound::Unbounded, RangeBound::Excluded),
            prefix: owned(prefix, "prefix")?,
        };
        Ok(Range { opts, reverse, mode })
    }
}

/// The tierkv iterator and the entries fetched ahead. Emptied (`None` in its slot) by the
/// store's `close()`.
#[derive(Debug)]
pub(crate) struct IterCore {
    /// `None` once the walk ended (or the iterator was closed by the user).
    it: Option<tierkv::DbIterator>,
    reverse: bool,
    mode: Mode,
    buf: VecDeque<Entry>,
    /// An error met while fetching ahead, raised once the entries before it are taken.
    pending: Option<tierkv::Error>,
    chunk: usize,
}

impl IterCore {
    fn new(mut it: tierkv::DbIterator, range: &Range) -> IterCore {
        if range.reverse {
            it.seek_to_last();
        }
        IterCore {
            it: Some(it),
            reverse: range.reverse,
            mode: range.mode,
            buf: VecDeque::new(),
            pending: None,
            chunk: FIRST_CHUNK,
        }
    }

    /// Fetch the next chunk (without the GIL).
    fn fill(&mut self) {
        let Some(it) = self.it.as_mut() else { return };
        let (mut bytes, mut end) = (0usize, false);
        while self.buf.len() < self.chunk && bytes < MAX_CHUNK_BYTES {
            let step = if self.reverse { it.prev_ref() } else { it.next_ref() };
            match step {
                Ok(Some((k, v))) => {
                    bytes += k.len() + v.len();
                    self.buf.push_back(match self.mode {
                        Mode::Items => Entry::Item(k.to_vec(), v.to_vec()),
                        Mode::Keys => Entry::One(k.to_vec()),
                        Mode::Values => Entry::One(v.to_vec()),
                    });
                }
                Ok(None) => {
                    end = true;
                    break;
                }
                Err(e) => {
                    self.pending = Some(e);
                    end = true;
                    break;
                }
            }
        }
        if end {
            // Done: let go of the snapshot (and of the store's pinned state) now.
            self.it = None;
        }
        self.chunk = (self.chunk * 2).min(MAX_CHUNK);
    }

    fn next_entry(&mut self) -> tierkv::Result<Option<Entry>> {
        if self.buf.is_empty() {
            self.fill();
        }
        match self.buf.pop_front() {
            Some(e) => Ok(Some(e)),
            None => match self.pending.take() {
                Some(e) => Err(e),
                None => Ok(None),
            },
        }
    }
}

/// Wrap `it` (made from a `Db` or a `Snapshot` over `range`) and register it with the store,
/// so that `close()` can end it; `Error::Closed` (and `it` dropped) if the store is closing.
/// Called without the GIL.
pub(crate) fn make(
    shared: &Arc<Shared>,
    range: &Range,
    it: tierkv::DbIterator,
) -> tierkv::Result<Arc<Mutex<Option<IterCore>>>> {
    let slot = Arc::new(Mutex::new(Some(IterCore::new(it, range))));
    shared.register_iter(&slot)?;
    Ok(slot)
}

/// An iterator over a consistent snapshot of the store, in key order (or reverse key
/// order), made by `Db.items()`, `Db.keys()`, `Db.values()` or the same methods of a
/// `Snapshot`. Raises `ClosedError` once its `Db` is closed; `close()` ends it early.
#[pyclass(module = "tierkv", frozen)]
#[derive(Debug)]
pub struct RangeIterator {
    slot: Arc<Mutex<Option<IterCore>>>,
    /// Keeps the store open while the iterator lives (see `shared`).
    _owner: Arc<Shared>,
}

impl RangeIterator {
    pub(crate) fn new(slot: Arc<Mutex<Option<IterCore>>>, owner: Arc<Shared>) -> RangeIterator {
        RangeIterator { slot, _owner: owner }
    }
}

#[pymethods]
impl RangeIterator {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(slf: &Bound<'py, Self>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = slf.py();
        let this = slf.get();
        // Fast path: an entry fetched ahead, taken only if the lock is free right now.
        let ready = match this.slot.try_lock() {
            Some(mut g) => match g.as_mut() {
                None => return Err(crate::errors::closed(py, "the Db of this iterator")),
                Some(core) => core.buf.pop_front(),
            },
            None => None,
        };
        let entry = match ready {
            Some(e) => Some(e),
            None => py
                .detach(|| match this.slot.lock().as_mut() {
                    None => Err(tierkv::Error::Closed),
                    Some(core) => core.next_entry(),
                })
                .py_err(py)?,
        };
        Ok(match entry {
            None => None,
            Some(Entry::One(b)) => Some(PyBytes::new(py, &b).into_any()),
            Some(Entry::Item(k, v)) => Some(PyTuple::new(py, [PyBytes::new(py, &k), PyBytes::new(py, &v)])?.into_any()),
        })
    }

    /// End the iteration now and release what it holds; later `next()` raises
    /// `StopIteration`.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(core) = self.slot.lock().as_mut() {
                core.it = None;
                core.buf.clear();
                core.pending = None;
            }
        })
    }

    fn __repr__(&self) -> &'static str {
        "<tierkv.RangeIterator>"
    }
}
