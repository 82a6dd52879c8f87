//! Range scans and iterators.
//!
//! Both read the engine in chunks — 16 entries first, doubling up to [`CHUNK`] — so a short
//! scan reads little more than it returns and a long one amortises the locking. Each chunk is
//! a consistent copy
//! taken under the engine's read lock, and the next chunk starts strictly after the last
//! key returned. So every key that exists for the whole scan is returned exactly once
//! with its newest value at the time its chunk was read; a key deleted before the scan
//! started is never returned; the scan never holds a lock while the caller runs.

use std::collections::VecDeque;
use std::ops::Bound;
use std::sync::Arc;

use crate::db::owned;
use crate::engine::Engine;
use crate::error::Result;

/// Largest number of entries fetched per engine call.
pub const CHUNK: usize = 256;
const FIRST_CHUNK: usize = 16;

type Entry = (Vec<u8>, Vec<u8>);

/// The iterator returned by [`crate::Db::scan`].
pub struct Scan {
    engine: Arc<dyn Engine>,
    next_start: Option<Bound<Vec<u8>>>,
    end: Bound<Vec<u8>>,
    buf: VecDeque<Entry>,
    chunk: usize,
}

impl std::fmt::Debug for Scan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scan").field("buffered", &self.buf.len()).finish()
    }
}

impl Scan {
    pub(crate) fn new(engine: Arc<dyn Engine>, start: Bound<Vec<u8>>, end: Bound<Vec<u8>>) -> Scan {
        Scan { engine, next_start: Some(start), end, buf: VecDeque::new(), chunk: FIRST_CHUNK }
    }

    fn refill(&mut self) -> Result<()> {
        let Some(start) = self.next_start.take() else {
            return Ok(());
        };
        let want = self.chunk;
        let chunk = self.engine.scan_chunk(owned(start.as_ref()), owned(self.end.as_ref()), want)?;
        if chunk.len() == want {
            self.next_start = chunk.last().map(|(k, _)| Bound::Excluded(k.clone()));
        }
        self.chunk = (want * 2).min(CHUNK);
        self.buf.extend(chunk);
        Ok(())
    }
}

impl Iterator for Scan {
    type Item = Result<Entry>;
    fn next(&mut self) -> Option<Self::Item> {
        if self.buf.is_empty() {
            if let Err(e) = self.refill() {
                self.next_start = None;
                return Some(Err(e));
            }
        }
        self.buf.pop_front().map(Ok)
    }
}

/// A seekable iterator over the whole store ([`crate::Db::iter`]).
pub struct DbIterator {
    scan: Scan,
}

impl std::fmt::Debug for DbIterator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbIterator").finish()
    }
}

impl DbIterator {
    pub(crate) fn new(engine: Arc<dyn Engine>) -> DbIterator {
        DbIterator { scan: Scan::new(engine, Bound::Unbounded, Bound::Unbounded) }
    }

    /// Position before the first key `>= key`.
    pub fn seek(&mut self, key: &[u8]) {
        self.scan.buf.clear();
        self.scan.chunk = FIRST_CHUNK;
        self.scan.next_start = Some(Bound::Included(key.to_vec()));
    }

    /// Position before the first key.
    pub fn seek_to_first(&mut self) {
        self.scan.buf.clear();
        self.scan.chunk = FIRST_CHUNK;
        self.scan.next_start = Some(Bound::Unbounded);
    }

    /// The next entry, or `None` at the end.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<Entry>> {
        self.scan.next().transpose()
    }
}
