//! A store's poisoned state, shared by the presets and the LSM they build on.
//!
//! After a failure a store cannot recover from in place (a failed write after a commit
//! point, a failed fsync, a background panic), every write is refused with
//! [`crate::Error::Poisoned`] naming the first failure (as lsm-tree's `Poisoned`). Every
//! write checks it, so the check is one atomic load; the message is read only once set.

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::error::Result;

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Poison {
    /// Set after `why` is written; read by every write.
    set: AtomicBool,
    why: Mutex<Option<String>>,
}

impl Poison {
    /// Record `why`, unless an earlier failure is recorded already.
    pub(crate) fn set(&self, why: String) {
        let mut w = self.why.lock();
        if w.is_none() {
            *w = Some(why);
            self.set.store(true, Ordering::Release);
        }
    }

    /// `Err(Poisoned)` once poisoned.
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        if !self.is_set() {
            return Ok(());
        }
        Err(crate::Error::Poisoned(self.why.lock().clone().unwrap_or_default()))
    }

    /// True once poisoned.
    #[inline]
    pub(crate) fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_failure_wins_and_every_check_reports_it() {
        let p = Poison::default();
        assert!(p.check().is_ok());
        assert!(!p.is_set());
        p.set("first".into());
        p.set("second".into());
        assert!(p.is_set());
        for _ in 0..2 {
            match p.check() {
                Err(crate::Error::Poisoned(why)) => assert_eq!(why, "first"),
                other => panic!("expected Poisoned, got {other:?}"),
            }
        }
    }
}
