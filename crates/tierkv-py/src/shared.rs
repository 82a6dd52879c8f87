//! The store handle shared by a `Db` and everything made from it, and what `close()` does.
//!
//! # Invariants
//!
//! - `db` is `Some` until `close()`. Every store call holds its read side for the length of
//!   the call (inside [`pyo3::Python::detach`]); `close()` takes the write side, so it waits
//!   for the calls in flight and no call starts on a closed store — they get `ClosedError`.
//! - Every iterator and snapshot is registered in `children` while it is made (under the read
//!   side, or under `children`' lock with `closed` checked). `close()` sets `closed`, takes
//!   the list and empties each child's slot: a tierkv iterator or snapshot borrows the store's
//!   persistent memory and holds its directory lock, so all of them are dropped before the
//!   store is, and the directory can be reopened as soon as `close()` returns. A Python
//!   iterator or snapshot whose slot is empty raises `ClosedError`.
//! - Lock order: `db` → `children` → a child's slot. A child's slot is never held while
//!   taking `children` or `db` (`close()` releases `children` before it visits the slots).
//! - Objects made from a `Db` keep the `Shared` alive (an `Arc`): a store is closed by
//!   `close()`, by leaving its `with` block, when the `Db` and everything made from it are
//!   gone, or at interpreter exit ([`close_all_at_exit`], an `atexit` hook: CPython does not
//!   promise to free module globals at exit, and a store that is not closed is recovered as
//!   after a crash at its next open — correct, but slower for the presets that replay logs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};

use crate::iter::IterCore;

/// What `close()` must empty.
#[derive(Debug)]
enum Child {
    Iter(Weak<Mutex<Option<IterCore>>>),
    Snapshot(Weak<RwLock<Option<tierkv::Snapshot>>>),
}

impl Child {
    fn alive(&self) -> bool {
        match self {
            Child::Iter(w) => w.strong_count() > 0,
            Child::Snapshot(w) => w.strong_count() > 0,
        }
    }
}

#[derive(Debug, Default)]
struct Children {
    closed: bool,
    list: Vec<Child>,
    /// Length at which dead entries are pruned next (amortised: doubles with the live ones).
    prune_at: usize,
}

/// Every store this process opened, for [`close_all_at_exit`].
static OPEN: Mutex<Vec<Weak<Shared>>> = Mutex::new(Vec::new());

/// Close every store still open (the `atexit` hook). A store opened by another process
/// (this one is a child made by `os.fork()` that exits through the interpreter) is left
/// alone: its owner still uses it. Call without the GIL.
pub(crate) fn close_all_at_exit() {
    let open = std::mem::take(&mut *OPEN.lock());
    for shared in open.iter().filter_map(Weak::upgrade) {
        if shared.pid == std::process::id() {
            // Nothing to report to at exit; the store is crash-safe if this fails.
            let _ = shared.close();
        }
    }
}

/// The open store and its live iterators and snapshots.
#[derive(Debug)]
pub(crate) struct Shared {
    db: RwLock<Option<tierkv::Db>>,
    /// Set when `close()` starts (read with the GIL held, so never a lock).
    closing: AtomicBool,
    children: Mutex<Children>,
    /// The process that opened the store.
    pid: u32,
}

impl Shared {
    pub(crate) fn new(db: tierkv::Db) -> Arc<Shared> {
        let shared = Arc::new(Shared {
            db: RwLock::new(Some(db)),
            closing: AtomicBool::new(false),
            children: Mutex::new(Children::default()),
            pid: std::process::id(),
        });
        let mut open = OPEN.lock();
        open.retain(|w| w.strong_count() > 0);
        open.push(Arc::downgrade(&shared));
        shared
    }

    /// Run `f` on the open store; `Error::Closed` once closed. Call without the GIL.
    pub(crate) fn with_db<T>(&self, f: impl FnOnce(&tierkv::Db) -> tierkv::Result<T>) -> tierkv::Result<T> {
        match self.db.read().as_ref() {
            Some(db) => f(db),
            None => Err(tierkv::Error::Closed),
        }
    }

    /// `close()` has been called (it may still be finishing).
    pub(crate) fn is_closed(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    fn register(&self, child: Child) -> tierkv::Result<()> {
        let mut c = self.children.lock();
        if c.closed {
            return Err(tierkv::Error::Closed);
        }
        if c.list.len() >= c.prune_at {
            c.list.retain(Child::alive);
            c.prune_at = (c.list.len() * 2).max(64);
        }
        c.list.push(child);
        Ok(())
    }

    /// Register an iterator's slot (`Error::Closed` if the store closed meanwhile: the
    /// caller drops the iterator).
    pub(crate) fn register_iter(&self, slot: &Arc<Mutex<Option<IterCore>>>) -> tierkv::Result<()> {
        self.register(Child::Iter(Arc::downgrade(slot)))
    }

    pub(crate) fn register_snapshot(&self, slot: &Arc<RwLock<Option<tierkv::Snapshot>>>) -> tierkv::Result<()> {
        self.register(Child::Snapshot(Arc::downgrade(slot)))
    }

    /// Close: wait for calls in flight, drop every iterator and snapshot, close the store.
    /// Idempotent. Call without the GIL.
    pub(crate) fn close(&self) -> tierkv::Result<()> {
        self.closing.store(true, Ordering::Release);
        let db = self.db.write().take();
        let children = {
            let mut c = self.children.lock();
            c.closed = true;
            std::mem::take(&mut c.list)
        };
        for child in children {
            match child {
                Child::Iter(w) => {
                    if let Some(slot) = w.upgrade() {
                        drop(slot.lock().take());
                    }
                }
                Child::Snapshot(w) => {
                    if let Some(slot) = w.upgrade() {
                        drop(slot.write().take());
                    }
                }
            }
        }
        match db {
            Some(db) => db.close(),
            None => Ok(()),
        }
    }
}
