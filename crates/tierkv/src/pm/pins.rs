//! [`Pins`]: PM extents whose free waits for the iterators that may still read them.
//!
//! Presets whose iterators borrow bytes from PM without a lock (pmekv's value slots,
//! slmdb's MemTable arenas) register each iterator here when it is created and *park* the
//! extents a background job frees while an older iterator lives; the last such iterator to
//! be dropped returns them. An iterator registered after the free cannot reach the extent:
//! it left the structures the iterator reads from before the free was parked (the caller's
//! obligation, argued in each preset's module docs). Parking delays only the DRAM heap's
//! reuse of space no durable state refers to, so crash consistency is unchanged: a crash
//! forgets the parked list and open rebuilds the heap.

use std::collections::{BTreeMap, VecDeque};

/// Live iterators and the PM extents `(address, length)` whose free waits for them.
///
/// # Invariants
/// - `readers` counts the live iterators by the epoch they registered at; epochs grow.
/// - A parked batch tagged `t` was taken out of every structure iterators read before it
///   was parked, when `epoch` was `t`: only iterators registered at an epoch `<= t` can
///   hold its addresses, so it is freed once every live iterator is newer than `t`.
#[derive(Debug, Default)]
pub(crate) struct Pins {
    epoch: u64,
    readers: BTreeMap<u64, usize>,
    parked: VecDeque<(u64, Vec<(u64, u64)>)>,
    ever_held: u64,
}

impl Pins {
    /// Register a new iterator; returns its epoch (to [`Pins::deregister`] when dropped).
    /// Call it before the iterator reads any address.
    pub(crate) fn register(&mut self) -> u64 {
        self.epoch += 1;
        *self.readers.entry(self.epoch).or_insert(0) += 1;
        self.epoch
    }

    /// Deregister epoch `e`; returns the extents now free of readers.
    pub(crate) fn deregister(&mut self, e: u64) -> Vec<(u64, u64)> {
        if let Some(n) = self.readers.get_mut(&e) {
            *n -= 1;
            if *n == 0 {
                self.readers.remove(&e);
            }
        }
        let oldest = self.readers.keys().next().copied();
        let mut out = Vec::new();
        while let Some((t, _)) = self.parked.front() {
            if oldest.is_some_and(|o| o <= *t) {
                break;
            }
            if let Some((_, v)) = self.parked.pop_front() {
                out.extend(v);
            }
        }
        out
    }

    /// A job releases `frees` (extents no structure an iterator reads refers to any
    /// more): returns those that may be freed now, and keeps the others until the
    /// iterators that may read them are gone.
    pub(crate) fn park(&mut self, frees: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
        if self.readers.is_empty() || frees.is_empty() {
            return frees;
        }
        self.ever_held += frees.len() as u64;
        self.parked.push_back((self.epoch, frees));
        Vec::new()
    }

    /// Live iterators.
    pub(crate) fn live(&self) -> usize {
        self.readers.values().sum()
    }

    /// Extents held back now.
    pub(crate) fn held(&self) -> usize {
        self.parked.iter().map(|p| p.1.len()).sum()
    }

    /// Extents ever held back.
    pub(crate) fn ever_held(&self) -> u64 {
        self.ever_held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parked_free_waits_for_every_older_iterator_only() {
        let mut p = Pins::default();
        assert_eq!(p.park(vec![(1, 8)]), vec![(1, 8)], "no iterator: freed at once");
        let a = p.register();
        let b = p.register();
        assert!(p.park(vec![(2, 8)]).is_empty());
        let c = p.register(); // newer than the free: does not hold it
        assert_eq!((p.live(), p.held(), p.ever_held()), (3, 1, 1));
        assert!(p.deregister(b).is_empty(), "a is older and still lives");
        assert!(p.deregister(c).is_empty());
        assert_eq!(p.deregister(a), vec![(2, 8)]);
        assert_eq!((p.live(), p.held()), (0, 0));
    }
}
