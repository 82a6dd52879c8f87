//! [`MergingIterator`]: the union of several sources, newest first.
//!
//! As LevelDB's `MergingIterator` (table/merger.cc): children are searched linearly for the
//! smallest (forward) or largest (reverse) key — stores have a handful of sources, and a
//! linear pass over them beats a heap's bookkeeping at that size (Pebble switches to a heap
//! for many children; a preset with many sources, an LSM's level 0, merges them in a
//! child `MergingIterator` first).
//!
//! Unlike LevelDB's internal keys, a key can sit in several children (a memtable and an
//! SSTable): the child with the lowest index wins ties, and every other child at that key
//! is stepped past it when the merge moves on.
//!
//! Invariants: moving forward, every valid child is at its first entry `>=` the current
//! key; moving backward, at its last entry `<=` it. A change of direction re-seeks every
//! child but the current one, as LevelDB does.
//!
//! A step in one direction makes one pass over the children at most, often a single
//! comparison: the pass that finds the smallest (largest) key also records the children
//! *tied* with it, and the next step moves exactly those past the key — no second pass of
//! comparisons (after a change of direction, which re-seeks every other child, the ties are
//! found by a comparing pass first). The pass also records the runner-up (the child with
//! the next key: a second comparison for a child behind the best); when the current child
//! had no ties and its next key still comes before the runner-up's, it stays current after
//! one comparison — LSM walks take runs of keys from one source (the deepest level holds
//! most of them; slmdb's tree holds nearly all), and the pass touched every child's key.

use std::cmp::Ordering;

use super::{BoxedIter, InternalIterator};
use crate::error::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Forward,
    Reverse,
}

/// Merges children; `children[0]` is the newest source.
pub struct MergingIterator {
    children: Vec<BoxedIter>,
    current: Option<usize>,
    dir: Dir,
    /// The children other than `current` positioned at the current key (found by the last
    /// `find_smallest`/`find_largest`).
    ties: Vec<usize>,
    /// The current key, copied only when the direction changes.
    scratch: Vec<u8>,
    /// The child with the nearest key after the current one's (forward: the smallest
    /// key above it; reverse: the largest below), found by the same pass; `None` when
    /// no other child holds a different key. Valid until a child other than `current`
    /// moves.
    runner: Option<usize>,
}

impl std::fmt::Debug for MergingIterator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MergingIterator").field("children", &self.children.len()).finish()
    }
}

impl MergingIterator {
    /// Merge `children`, newest first. Unpositioned until a seek.
    pub fn new(children: Vec<BoxedIter>) -> MergingIterator {
        MergingIterator {
            children,
            current: None,
            dir: Dir::Forward,
            ties: Vec::new(),
            scratch: Vec::new(),
            runner: None,
        }
    }

    /// Index of the child the current entry comes from (`None` when invalid): lets a
    /// preset resolve an entry whose value its cursor does not hold (hoakv's hot keys).
    pub fn current_child(&self) -> Option<usize> {
        self.current
    }

    /// Make the child with the smallest key (`want == Less`) or the largest (`Greater`)
    /// current, the lowest index winning ties, and record the tied children.
    /// The same pass records the runner-up: the child whose key comes next after the
    /// best one's.
    fn find(&mut self, want: Ordering) {
        let MergingIterator { children, current, ties, runner, .. } = self;
        ties.clear();
        let mut best: Option<usize> = None;
        let mut second: Option<usize> = None;
        for (i, c) in children.iter().enumerate() {
            if !c.valid() {
                continue;
            }
            match best {
                None => best = Some(i),
                Some(b) => match c.key().cmp(children[b].key()) {
                    Ordering::Equal => ties.push(i),
                    o if o == want => {
                        // Every child seen so far is at or beyond the old best.
                        second = Some(b);
                        best = Some(i);
                        ties.clear();
                    }
                    _ => {
                        if second.is_none_or(|s| c.key().cmp(children[s].key()) == want) {
                            second = Some(i);
                        }
                    }
                },
            }
        }
        *current = best;
        *runner = second;
    }

    /// After the current child alone moved on (no ties, no turn), it is still the merge's
    /// entry when its new key comes before the runner-up's: one comparison instead of a
    /// pass over every child (a walk often takes runs of keys from one source — a
    /// deeper level holds most of them).
    fn still_current(&self, cur: usize, want: Ordering) -> bool {
        let Some(c) = self.children.get(cur).filter(|c| c.valid()) else { return false };
        match self.runner {
            None => true,
            Some(r) => self.children.get(r).is_some_and(|r| c.key().cmp(r.key()) == want),
        }
    }

    fn find_smallest(&mut self) {
        self.find(Ordering::Less);
    }

    fn find_largest(&mut self) {
        self.find(Ordering::Greater);
    }

    /// Run `f` on every child; on an error the merge becomes invalid.
    fn each(&mut self, mut f: impl FnMut(&mut BoxedIter) -> Result<()>) -> Result<()> {
        for c in &mut self.children {
            if let Err(e) = f(c) {
                self.current = None;
                return Err(e);
            }
        }
        Ok(())
    }

    fn fail<T>(&mut self, e: crate::Error) -> Result<T> {
        self.current = None;
        Err(e)
    }

    /// Step every child other than `cur` that sits at `cur`'s key, forward or back: the
    /// recorded ties, or (`compare`, after a change of direction re-seeked the children)
    /// the ones found by comparing keys.
    fn step_ties(&mut self, cur: usize, forward: bool, compare: bool) -> Result<()> {
        if compare {
            self.ties.clear();
            for i in 0..self.children.len() {
                if i != cur && self.children[i].valid() && self.children[i].key() == self.children[cur].key() {
                    self.ties.push(i);
                }
            }
        }
        for t in 0..self.ties.len() {
            let i = self.ties[t];
            let r = if forward { self.children[i].next() } else { self.children[i].prev() };
            if let Err(e) = r {
                return self.fail(e);
            }
        }
        Ok(())
    }

    /// Move forward or back from the current entry.
    fn step(&mut self, forward: bool) -> Result<()> {
        let Some(cur) = self.current else { return Ok(()) };
        let want = if forward { Dir::Forward } else { Dir::Reverse };
        let turned = self.dir != want;
        if turned {
            // Every other child sits on the far side of the current key: move each to its
            // first entry >= it (forward) or last <= it (back); ties are stepped below.
            self.scratch.clear();
            self.scratch.extend_from_slice(self.children[cur].key());
            for i in 0..self.children.len() {
                if i == cur {
                    continue;
                }
                let r = if forward {
                    self.children[i].seek(&self.scratch)
                } else {
                    self.children[i].seek_for_prev(&self.scratch)
                };
                if let Err(e) = r {
                    return self.fail(e);
                }
            }
            self.dir = want;
        }
        let alone = !turned && self.ties.is_empty();
        self.step_ties(cur, forward, turned)?;
        let r = if forward { self.children[cur].next() } else { self.children[cur].prev() };
        if let Err(e) = r {
            return self.fail(e);
        }
        if alone && self.still_current(cur, if forward { Ordering::Less } else { Ordering::Greater }) {
            return Ok(());
        }
        if forward {
            self.find_smallest();
        } else {
            self.find_largest();
        }
        Ok(())
    }
}

impl InternalIterator for MergingIterator {
    fn valid(&self) -> bool {
        self.current.is_some()
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.each(|c| c.seek(key))?;
        self.dir = Dir::Forward;
        self.find_smallest();
        Ok(())
    }

    fn seek_to_first(&mut self) -> Result<()> {
        self.each(|c| c.seek_to_first())?;
        self.dir = Dir::Forward;
        self.find_smallest();
        Ok(())
    }

    fn seek_to_last(&mut self) -> Result<()> {
        self.each(|c| c.seek_to_last())?;
        self.dir = Dir::Reverse;
        self.find_largest();
        Ok(())
    }

    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.each(|c| c.seek_for_prev(key))?;
        self.dir = Dir::Reverse;
        self.find_largest();
        Ok(())
    }

    fn next(&mut self) -> Result<()> {
        self.step(true)
    }

    fn prev(&mut self) -> Result<()> {
        self.step(false)
    }

    fn key(&self) -> &[u8] {
        self.current.map_or(&[], |c| self.children[c].key())
    }

    fn value(&self) -> Option<&[u8]> {
        self.current.and_then(|c| self.children[c].value())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::iter::VecIter;

    type Src = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

    fn model(srcs: &[Src]) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let mut m: Src = BTreeMap::new();
        for s in srcs.iter().rev() {
            for (k, v) in s {
                m.insert(k.clone(), v.clone());
            }
        }
        m.into_iter().collect()
    }

    fn merged(srcs: &[Src]) -> MergingIterator {
        MergingIterator::new(
            srcs.iter().map(|s| Box::new(VecIter::from_vec(s.clone().into_iter().collect())) as BoxedIter).collect(),
        )
    }

    fn src() -> impl Strategy<Value = Src> {
        proptest::collection::btree_map(
            proptest::collection::vec(0u8..6, 0..3),
            proptest::option::weighted(0.8, proptest::collection::vec(any::<u8>(), 0..3)),
            0..12,
        )
    }

    #[derive(Debug, Clone)]
    enum Step {
        Next,
        Prev,
        Seek(Vec<u8>),
        SeekForPrev(Vec<u8>),
        First,
        Last,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => Just(Step::Next),
            4 => Just(Step::Prev),
            1 => proptest::collection::vec(0u8..6, 0..3).prop_map(Step::Seek),
            1 => proptest::collection::vec(0u8..6, 0..3).prop_map(Step::SeekForPrev),
            1 => Just(Step::First),
            1 => Just(Step::Last),
        ]
    }

    proptest! {
        /// Any interleaving of moves over 0..4 sources matches a position in the model.
        #[test]
        fn merge_matches_model(srcs in proptest::collection::vec(src(), 0..4), steps in proptest::collection::vec(step(), 1..40)) {
            let want = model(&srcs);
            let mut it = merged(&srcs);
            let mut pos: Option<usize> = None;
            for s in steps {
                match s {
                    Step::Next => { if pos.is_some() { it.next().unwrap(); pos = pos.map(|p| p + 1).filter(|&p| p < want.len()); } }
                    Step::Prev => { if pos.is_some() { it.prev().unwrap(); pos = pos.and_then(|p| p.checked_sub(1)); } }
                    Step::Seek(k) => { it.seek(&k).unwrap(); let p = want.partition_point(|e| e.0 < k); pos = (p < want.len()).then_some(p); }
                    Step::SeekForPrev(k) => { it.seek_for_prev(&k).unwrap(); pos = want.partition_point(|e| e.0 <= k).checked_sub(1); }
                    Step::First => { it.seek_to_first().unwrap(); pos = (!want.is_empty()).then_some(0); }
                    Step::Last => { it.seek_to_last().unwrap(); pos = want.len().checked_sub(1); }
                }
                prop_assert_eq!(it.valid(), pos.is_some());
                if let Some(p) = pos {
                    prop_assert_eq!(it.key(), want[p].0.as_slice());
                    prop_assert_eq!(it.value(), want[p].1.as_deref());
                }
            }
        }
    }

    /// A child that counts how often its key is read (Send: an atomic).
    struct Counting(VecIter, Arc<std::sync::atomic::AtomicUsize>);

    impl InternalIterator for Counting {
        fn valid(&self) -> bool {
            self.0.valid()
        }
        fn seek(&mut self, key: &[u8]) -> Result<()> {
            self.0.seek(key)
        }
        fn seek_to_first(&mut self) -> Result<()> {
            self.0.seek_to_first()
        }
        fn seek_to_last(&mut self) -> Result<()> {
            self.0.seek_to_last()
        }
        fn next(&mut self) -> Result<()> {
            self.0.next()
        }
        fn prev(&mut self) -> Result<()> {
            self.0.prev()
        }
        fn key(&self) -> &[u8] {
            self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.0.key()
        }
        fn value(&self) -> Option<&[u8]> {
            self.0.value()
        }
    }

    use std::sync::Arc;

    /// While one child holds the next keys, steps compare it with the runner-up only: a
    /// third child beyond the runner-up is not read at each step, in either direction.
    #[test]
    fn a_run_from_one_child_reads_only_the_runner_up() {
        let run: Src = (0..100u32).map(|i| (format!("a{i:03}").into_bytes(), Some(b"v".to_vec()))).collect();
        // Forward, "m" is the runner-up and "z" beyond it; backward, "5" and "0".
        let near: Src =
            [(b"5".to_vec(), Some(b"near".to_vec())), (b"m".to_vec(), Some(b"near".to_vec()))].into_iter().collect();
        let far: Src =
            [(b"z".to_vec(), Some(b"far".to_vec())), (b"0".to_vec(), Some(b"far".to_vec()))].into_iter().collect();
        let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let far_it = Counting(VecIter::from_vec(far.clone().into_iter().collect()), reads.clone());
        let mut it = MergingIterator::new(vec![
            Box::new(VecIter::from_vec(near.clone().into_iter().collect())) as BoxedIter,
            Box::new(far_it),
            Box::new(VecIter::from_vec(run.clone().into_iter().collect())),
        ]);
        it.seek(b"a").unwrap();
        let at_seek = reads.load(std::sync::atomic::Ordering::Relaxed);
        for (k, _) in run.iter().skip(1) {
            it.next().unwrap();
            assert_eq!(it.key(), k.as_slice());
        }
        let walked = reads.load(std::sync::atomic::Ordering::Relaxed) - at_seek;
        assert!(walked <= 2, "the far child's key was read {walked} times over 99 steps");
        // Backward from the run's last key.
        it.seek_for_prev(b"a099").unwrap();
        let at_seek = reads.load(std::sync::atomic::Ordering::Relaxed);
        for (k, _) in run.iter().rev().skip(1) {
            it.prev().unwrap();
            assert_eq!(it.key(), k.as_slice());
        }
        let walked = reads.load(std::sync::atomic::Ordering::Relaxed) - at_seek;
        assert!(walked <= 2, "backward: the far child's key was read {walked} times over 99 steps");
        // The merge still returns the other children's keys in order.
        it.next().unwrap();
        assert_eq!(it.key(), b"a001");
    }

    #[test]
    fn newest_source_wins_ties_in_both_directions() {
        let a: Src = [(b"k".to_vec(), None), (b"m".to_vec(), Some(b"new".to_vec()))].into_iter().collect();
        let b: Src =
            [(b"k".to_vec(), Some(b"old".to_vec())), (b"m".to_vec(), Some(b"old".to_vec()))].into_iter().collect();
        let mut it = merged(&[a, b]);
        it.seek_to_first().unwrap();
        assert_eq!((it.key(), it.value()), (&b"k"[..], None));
        it.next().unwrap();
        assert_eq!((it.key(), it.value()), (&b"m"[..], Some(&b"new"[..])));
        it.prev().unwrap();
        assert_eq!((it.key(), it.value()), (&b"k"[..], None));
        it.prev().unwrap();
        assert!(!it.valid());
    }
}
