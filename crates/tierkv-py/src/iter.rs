//! `tierkv.RangeIterator`: what `items()`, `keys()` and `values()` return.
//!
//! Each iterator is a tierkv [`tierkv::DbIterator`], a consistent snapshot of the store as
//! of the call that made it. Entries are fetched in chunks with the GIL released: the first
//! refill fetches 2 entries, each later one twice as many up to 128 (and at most 512 KiB of
//! keys and values), so `next(it)` on a fresh iterator costs little and a long scan crosses
//! the GIL boundary about once per 128 entries. Taking an already fetched entry never waits
//! for a lock while holding the GIL (it only tries the lock; if another thread holds it, the
//! call releases the GIL and waits for it).

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

/// An entry taken from the fetched chunk: the key (or the value alone), and the value for
/// `items()`.
type Taken<'py> = (Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>);

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
///
/// Fetched entries are copied into one buffer (`data`, reused from chunk to chunk) and
/// described by `spans`: no allocation per entry until the Python objects are made.
#[derive(Debug)]
pub(crate) struct IterCore {
    /// `None` once the walk ended (or the iterator was closed by the user).
    it: Option<tierkv::DbIterator>,
    reverse: bool,
    mode: Mode,
    data: Vec<u8>,
    /// `(start in data, key length, value length)` of each entry not yet taken; the key
    /// (or the value alone, for `values()`) first.
    spans: VecDeque<(usize, usize, usize)>,
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
            data: Vec::new(),
            spans: VecDeque::new(),
            pending: None,
            chunk: FIRST_CHUNK,
        }
    }

    /// Fetch the next chunk (without the GIL), once the previous one is taken.
    fn fill(&mut self) {
        if !self.spans.is_empty() {
            return;
        }
        if self.data.capacity() > 4 * MAX_CHUNK_BYTES {
            // A huge value passed by: do not keep its buffer for the rest of the walk.
            self.data = Vec::new();
        }
        self.data.clear();
        let Some(it) = self.it.as_mut() else { return };
        let mut end = false;
        while self.spans.len() < self.chunk && self.data.len() < MAX_CHUNK_BYTES {
            let step = if self.reverse { it.prev_ref() } else { it.next_ref() };
            match step {
                Ok(Some((k, v))) => {
                    let at = self.data.len();
                    let (kl, vl) = match self.mode {
                        Mode::Items => {
                            self.data.extend_from_slice(k);
                            self.data.extend_from_slice(v);
                            (k.len(), v.len())
                        }
                        Mode::Keys => {
                            self.data.extend_from_slice(k);
                            (k.len(), 0)
                        }
                        Mode::Values => {
                            self.data.extend_from_slice(v);
                            (v.len(), 0)
                        }
                    };
                    self.spans.push_back((at, kl, vl));
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

    /// The next fetched entry as `bytes` (key and value for `items()`), `None` if none is
    /// fetched. Called with the slot's lock held, so it makes only `bytes` objects, which
    /// are not tracked by the garbage collector: no collection (no `__del__`, no Python
    /// code that could come back to this iterator) can run while the lock is held.
    fn take<'py>(&mut self, py: Python<'py>) -> Option<Taken<'py>> {
        let (at, kl, vl) = self.spans.pop_front()?;
        let bytes = |from: usize, len: usize| PyBytes::new(py, self.data.get(from..from + len).unwrap_or_default());
        Some(match self.mode {
            Mode::Items => (bytes(at, kl), Some(bytes(at + kl, vl))),
            Mode::Keys | Mode::Values => (bytes(at, kl), None),
        })
    }

    /// Nothing fetched and nothing more to fetch.
    fn exhausted(&self) -> bool {
        self.spans.is_empty() && self.it.is_none()
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
        loop {
            // Take a fetched entry if the lock is free right now (never wait for it with the
            // GIL held: a thread refilling holds it without the GIL).
            if let Some(mut g) = this.slot.try_lock() {
                let Some(core) = g.as_mut() else {
                    return Err(crate::errors::closed(py, "the Db of this iterator"));
                };
                if let Some((first, second)) = core.take(py) {
                    drop(g);
                    // The tuple is made after the lock is released (it may start a collection).
                    return Ok(Some(match second {
                        None => first.into_any(),
                        Some(v) => PyTuple::new(py, [first, v])?.into_any(),
                    }));
                }
                if core.exhausted() {
                    let pending = core.pending.take();
                    drop(g);
                    // Raised after the lock is released (making the exception allocates).
                    return match pending {
                        Some(e) => Err(crate::errors::to_py(py, e)),
                        None => Ok(None),
                    };
                }
            }
            // Refill (or wait for the thread holding the lock) without the GIL.
            py.detach(|| match this.slot.lock().as_mut() {
                None => Err(tierkv::Error::Closed),
                Some(core) => {
                    core.fill();
                    Ok(())
                }
            })
            .py_err(py)?;
        }
    }

    /// End the iteration now and release what it holds; later `next()` raises
    /// `StopIteration`.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(core) = self.slot.lock().as_mut() {
                core.it = None;
                core.spans.clear();
                core.pending = None;
            }
        })
    }

    fn __repr__(&self) -> &'static str {
        "<tierkv.RangeIterator>"
    }
}
