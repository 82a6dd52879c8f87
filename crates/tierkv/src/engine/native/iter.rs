//! The `native` iterator: a cursor over the ordered index at a snapshot.
//!
//! The index is one ordered source, so there is nothing to merge. An `InternalIterator`
//! must be `Send` and hold no lock between calls, and the index's memory guard is neither,
//! so the cursor works in **batches**: a refill takes a guard, walks the `TreeIndex` from
//! the current position (forward, or backward with its double-ended range), resolves each
//! key's version at the snapshot, copies the keys into one reused buffer and records where
//! each value lies in PM; then it drops the guard and moves within the batch without
//! touching the index. A refill takes 16 entries after a seek and doubles up to 256 along
//! a walk, so a short range read copies little and a long one re-descends the tree rarely.
//!
//! Values are not copied: `value()` borrows the log entry's value bytes in PM. A refill
//! reads no log entry for a version this process wrote or already verified (every record
//! at open was verified when it was replayed): the version's entry size minus the header
//! and the key's length is the value's length, so the walk touches only DRAM and a caller
//! that reads few values (a key-only scan, a count) pulls no value line through the cache.
//! The log entry is read and checked at refill (structure and key; its checksum too) for a
//! version loaded from an index checkpoint that no read verified yet, which is then marked
//! verified, as `get` marks it, and for every version with `NativeOptions::verify_reads`.
//! (Measured on the default bench, seekrandom at 500,000 keys, where a scan reads each
//! value's length but none of its bytes: see `docs/design/native.md`.) A segment the log
//! cleaner empties is not reused while a snapshot registered before that lives, and the
//! iterator holds one, so the borrow stays valid. Values lie in PM in write order, not key
//! order, and each entry of a batch is a chain of dependent loads (the key bytes and the
//! slot named by the tree's leaf, the slot's newest version, the log entry the version
//! names). Following one chain at a time waits for memory at every link, so a refill goes
//! link by link over the whole batch: it requests every candidate's key and slot, then
//! every slot's newest version, then reads the versions and requests every value, and
//! checks the values last; the misses of each pass overlap. (Measured on the default
//! bench, seekrandom at 500,000 keys: +17% over following each chain in turn, three A/B
//! pairs of whole runs. Larger refills after the first did not pay: growing 16 → 128
//! instead of doubling lost 10–35% on seekrandom and YCSB E, so the cost is per entry,
//! not per tree descent.)
//!
//! A key with no version at the snapshot (created after it) is left out of the batch, and
//! a deleted key shows as a tombstone, which [`crate::DbIterator`] skips.

use std::ops::Bound;

use crossbeam_epoch as epoch;

use std::sync::Arc;

use super::index::{MapGuard, Slot};
use super::layout::ENTRY_HEADER_LEN;
use super::NativeSnapshot;
use crate::error::Result;
use crate::iter::InternalIterator;
use crate::pm::flush::{prefetch, prefetch_obj};

const FIRST_BATCH: usize = 16;
const MAX_BATCH: usize = 256;

/// One entry of a batch.
#[derive(Debug, Clone, Copy)]
struct Ent {
    /// Its key's range in `keys`.
    key: (usize, usize),
    seq: u64,
    /// PM address of its log entry; `None` for a tombstone.
    loc: Option<u64>,
    /// Its value's address and length (set by the refill's checking pass).
    val: (u64, usize),
    /// Bytes of its log entry, as its version records them.
    size: u32,
    /// Its log entry is read at the refill: structure and key checked, and its checksum
    /// too when `verify`. Otherwise the value is placed from `size`.
    read: bool,
    /// Its checksum must be verified (a version loaded from a checkpoint, not read since).
    verify: bool,
}

/// See the module docs.
pub(crate) struct NativeIter {
    snap: NativeSnapshot,
    keys: Vec<u8>,
    ents: Vec<Ent>,
    /// The current entry (`ents.len()`: not positioned).
    pos: usize,
    /// Entries the next refill takes.
    batch: usize,
    /// Scratch for the bound of a refill.
    from: Vec<u8>,
}

impl NativeIter {
    pub(crate) fn new(snap: NativeSnapshot) -> NativeIter {
        NativeIter { snap, keys: Vec::new(), ents: Vec::new(), pos: 0, batch: FIRST_BATCH, from: Vec::new() }
    }

    fn key_at(&self, i: usize) -> &[u8] {
        self.ents.get(i).and_then(|e| self.keys.get(e.key.0..e.key.1)).unwrap_or(&[])
    }

    /// Refill from `from` (`None`: the start or end of the store) in one direction; the
    /// batch is kept in ascending order and the cursor put on its first (forward) or last
    /// entry.
    fn fill(&mut self, from: Bound<()>, forward: bool) -> Result<()> {
        // Before any guard is taken (a wait under a pin holds back reclamation).
        self.snap.inner.index.wait_loaded()?;
        let n = self.batch;
        self.keys.clear();
        self.ents.clear();
        let inner = &self.snap.inner;
        {
            let mg = MapGuard::new();
            let eg = epoch::pin();
            let bound: Bound<&[u8]> = match from {
                Bound::Included(()) => Bound::Included(&self.from),
                Bound::Excluded(()) => Bound::Excluded(&self.from),
                Bound::Unbounded => Bound::Unbounded,
            };
            let (keys, ents) = (&mut self.keys, &mut self.ents);
            // Versions of the batch loaded from a checkpoint and not verified yet (valid
            // while both guards are held: the map guard keeps their slots, the epoch pin
            // their chains).
            let mut unverified: Vec<&super::index::Version> = Vec::new();
            let mut walk: Box<dyn Iterator<Item = (&[u8], &Arc<Slot>)>> = if forward {
                Box::new(inner.index.ascending(bound, &mg)?)
            } else {
                Box::new(inner.index.descending(bound, &mg)?)
            };
            // Each entry is a chain of dependent loads (key bytes and slot from the leaf,
            // version from the slot, log entry from the version), and following one chain
            // at a time waits for memory at each link. So the batch goes link by link:
            // every candidate's key and slot are requested, then every slot's newest
            // version, then the versions are read and every value requested, and the
            // misses of a pass overlap.
            let mut cand: Vec<(&[u8], &Arc<Slot>)> = Vec::with_capacity(n);
            loop {
                let want = n - ents.len();
                cand.clear();
                for (k, s) in walk.by_ref() {
                    prefetch(k.get(..k.len().min(64)).unwrap_or(k));
                    prefetch_obj::<Slot>(s);
                    cand.push((k, s));
                    if cand.len() >= want {
                        break;
                    }
                }
                let walked_out = cand.len() < want;
                for (_, s) in &cand {
                    if let Some(v) = s.head(&eg) {
                        prefetch_obj(v);
                    }
                }
                for &(k, slot) in &cand {
                    let Some(v) = slot.find(self.snap.seq, &eg) else { continue };
                    let start = keys.len();
                    keys.extend_from_slice(k);
                    let loc = (!v.tomb).then_some(v.loc());
                    let verify = loc.is_some() && v.unverified();
                    // A version this process wrote or already verified names its value
                    // exactly (its entry's size minus the header and the key): the walk
                    // reads no PM, `value()` reads the bytes it is asked for.
                    let read = verify || inner.verify_reads;
                    if let (true, Some(l)) = (read, loc) {
                        inner.region.prefetch(l, 64);
                    }
                    if verify {
                        unverified.push(v);
                    }
                    ents.push(Ent {
                        key: (start, keys.len()),
                        seq: v.seq,
                        loc,
                        val: (0, 0),
                        size: v.size,
                        read,
                        verify,
                    });
                }
                if walked_out || ents.len() >= n {
                    break;
                }
            }
            drop(walk);
            if !forward {
                ents.reverse();
            }
            // Check the values (the lines of those read were prefetched above), still under
            // both guards: the versions verified here are marked so, as a `get` marks them.
            for i in 0..self.ents.len() {
                let e = self.ents[i];
                let Some(loc) = e.loc else { continue };
                let key_len = self.key_at(i).len();
                let r = if e.read {
                    // The entry must be the one the version describes, or a value placed
                    // from its size later (once it is marked verified) would be wrong.
                    inner.entry_value(self.key_at(i), e.seq, loc, e.verify).and_then(|v| {
                        inner.same_size(e.size, self.key_at(i), v, loc)?;
                        Ok((loc + (ENTRY_HEADER_LEN + key_len) as u64, v.len()))
                    })
                } else {
                    // Placed from the version: its entry size minus the header and the key.
                    (e.size as usize)
                        .checked_sub(ENTRY_HEADER_LEN + key_len)
                        .map(|len| (loc + (ENTRY_HEADER_LEN + key_len) as u64, len))
                        .filter(|&(at, len)| inner.region.contains_range(at, len))
                        .ok_or_else(|| {
                            inner.region.corruption(loc, "index version places its value outside its log entry's PM")
                        })
                };
                match r {
                    Ok(val) => self.ents[i].val = val,
                    Err(err) => {
                        self.ents.clear();
                        self.pos = 0;
                        return Err(err);
                    }
                }
            }
            // Every value of the batch verified: the checksums of the versions that were
            // unverified matched (a damaged one returned above, and its version stays
            // unverified, so the next read reports it again).
            if !unverified.is_empty() {
                inner.gc_counters.add(super::G_CKPT_VERIFIED, unverified.len() as u64);
                for v in unverified {
                    v.mark_verified();
                }
            }
        }
        self.pos = if forward { 0 } else { self.ents.len().saturating_sub(1) };
        if self.ents.is_empty() {
            self.pos = 0;
        }
        Ok(())
    }

    fn seek_from(&mut self, key: Option<&[u8]>, forward: bool) -> Result<()> {
        self.batch = FIRST_BATCH;
        self.from.clear();
        let b = match key {
            Some(k) => {
                self.from.extend_from_slice(k);
                Bound::Included(())
            }
            None => Bound::Unbounded,
        };
        self.fill(b, forward)
    }

    /// Refill past the current entry.
    fn step_out(&mut self, forward: bool) -> Result<()> {
        let mut from = std::mem::take(&mut self.from);
        from.clear();
        from.extend_from_slice(self.key_at(self.pos));
        self.from = from;
        self.batch = (self.batch * 2).min(MAX_BATCH);
        self.fill(Bound::Excluded(()), forward)
    }
}

impl InternalIterator for NativeIter {
    fn valid(&self) -> bool {
        self.pos < self.ents.len()
    }

    fn seek(&mut self, key: &[u8]) -> Result<()> {
        self.seek_from(Some(key), true)
    }

    fn seek_to_first(&mut self) -> Result<()> {
        self.seek_from(None, true)
    }

    fn seek_to_last(&mut self) -> Result<()> {
        self.seek_from(None, false)
    }

    fn next(&mut self) -> Result<()> {
        if self.pos + 1 < self.ents.len() {
            self.pos += 1;
            return Ok(());
        }
        if !self.valid() {
            return Ok(());
        }
        self.step_out(true)
    }

    fn prev(&mut self) -> Result<()> {
        if self.pos > 0 && self.valid() {
            self.pos -= 1;
            return Ok(());
        }
        if !self.valid() {
            return Ok(());
        }
        self.step_out(false)
    }

    fn key(&self) -> &[u8] {
        self.key_at(self.pos)
    }

    fn value(&self) -> Option<&[u8]> {
        let e = self.ents.get(self.pos)?;
        e.loc?;
        self.snap.inner.region.slice(e.val.0, e.val.1)
    }

    fn seek_for_prev(&mut self, key: &[u8]) -> Result<()> {
        self.seek_from(Some(key), false)
    }
}
