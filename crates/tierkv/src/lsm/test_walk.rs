//! Test support: an engine iterator driven through random moves against a model (the
//! LSM's tests and HoaKV's use it).
#![allow(clippy::unwrap_used)]
use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::Rng;

use crate::error::Result;
use crate::iter::InternalIterator;

/// Live entries only: tombstones (`None`) and keys `keep` rejects are skipped, as the
/// public iterator hides tombstones.
pub(crate) struct Live<'a, F: Fn(&[u8]) -> bool> {
    pub(crate) it: &'a mut dyn InternalIterator,
    pub(crate) keep: F,
}

impl<F: Fn(&[u8]) -> bool> Live<'_, F> {
    fn hidden(&self) -> bool {
        self.it.valid() && (self.it.value().is_none() || !(self.keep)(self.it.key()))
    }
    fn fwd(&mut self) -> Result<()> {
        while self.hidden() {
            self.it.next()?;
        }
        Ok(())
    }
    fn back(&mut self) -> Result<()> {
        while self.hidden() {
            self.it.prev()?;
        }
        Ok(())
    }
    pub(crate) fn seek(&mut self, k: &[u8]) -> Result<()> {
        self.it.seek(k)?;
        self.fwd()
    }
    pub(crate) fn seek_for_prev(&mut self, k: &[u8]) -> Result<()> {
        self.it.seek_for_prev(k)?;
        self.back()
    }
    pub(crate) fn first(&mut self) -> Result<()> {
        self.it.seek_to_first()?;
        self.fwd()
    }
    pub(crate) fn last(&mut self) -> Result<()> {
        self.it.seek_to_last()?;
        self.back()
    }
    pub(crate) fn next(&mut self) -> Result<()> {
        self.it.next()?;
        self.fwd()
    }
    pub(crate) fn prev(&mut self) -> Result<()> {
        self.it.prev()?;
        self.back()
    }
    /// The current entry, if positioned.
    pub(crate) fn entry(&self) -> Option<(Vec<u8>, Vec<u8>)> {
        self.it.valid().then(|| (self.it.key().to_vec(), self.it.value().unwrap_or_default().to_vec()))
    }
}

/// Every entry forward, then backward; both must equal `model` (keys `keep` accepts).
pub(crate) fn full_walks(
    it: &mut dyn InternalIterator,
    model: &BTreeMap<Vec<u8>, Vec<u8>>,
    keep: impl Fn(&[u8]) -> bool,
) {
    let want: Vec<(Vec<u8>, Vec<u8>)> =
        model.iter().filter(|(k, _)| keep(k)).map(|(k, v)| (k.clone(), v.clone())).collect();
    let mut l = Live { it, keep };
    let mut got = Vec::new();
    l.first().unwrap();
    while let Some(e) = l.entry() {
        got.push(e);
        l.next().unwrap();
    }
    assert_eq!(got.len(), want.len(), "forward walk: entry count");
    assert!(got == want, "forward walk differs from the model");
    got.clear();
    l.last().unwrap();
    while let Some(e) = l.entry() {
        got.push(e);
        l.prev().unwrap();
    }
    got.reverse();
    assert!(got == want, "backward walk differs from the model");
}

/// `steps` random moves (seeks of every kind, next, prev) of `it` checked against
/// `model` (keys `keep` accepts) after each; seek targets come from `probe`.
pub(crate) fn walk_model(
    it: &mut dyn InternalIterator,
    model: &BTreeMap<Vec<u8>, Vec<u8>>,
    rng: &mut StdRng,
    steps: usize,
    probe: impl Fn(&mut StdRng) -> Vec<u8>,
    keep: impl Fn(&[u8]) -> bool,
) {
    let want: Vec<(&Vec<u8>, &Vec<u8>)> = model.iter().filter(|(k, _)| keep(k)).collect();
    let mut l = Live { it, keep };
    let mut pos: Option<usize> = None;
    for step in 0..steps {
        let what = rng.random_range(0..12);
        let label;
        match what {
            0..=3 if pos.is_some() => {
                l.next().unwrap();
                pos = pos.map(|p| p + 1).filter(|&p| p < want.len());
                label = "next".to_string();
            }
            4..=7 if pos.is_some() => {
                l.prev().unwrap();
                pos = pos.and_then(|p| p.checked_sub(1));
                label = "prev".to_string();
            }
            8 | 0..=3 => {
                let k = probe(rng);
                l.seek(&k).unwrap();
                let p = want.partition_point(|e| e.0.as_slice() < k.as_slice());
                pos = (p < want.len()).then_some(p);
                label = format!("seek {}", crate::escape(&k));
            }
            9 | 4..=7 => {
                let k = probe(rng);
                l.seek_for_prev(&k).unwrap();
                pos = want.partition_point(|e| e.0.as_slice() <= k.as_slice()).checked_sub(1);
                label = format!("seek_for_prev {}", crate::escape(&k));
            }
            10 => {
                l.first().unwrap();
                pos = (!want.is_empty()).then_some(0);
                label = "seek_to_first".to_string();
            }
            _ => {
                l.last().unwrap();
                pos = want.len().checked_sub(1);
                label = "seek_to_last".to_string();
            }
        }
        let got = l.entry();
        let exp = pos.map(|p| (want[p].0.clone(), want[p].1.clone()));
        assert!(
            got == exp,
            "step {step} ({label}): got {:?}, want {:?}",
            got.as_ref().map(|e| crate::escape(&e.0)),
            exp.as_ref().map(|e| crate::escape(&e.0))
        );
    }
}
