//! The capacity tier of `native`: cold keys move from the PM logs to SSTables on disk.
//!
//! # What moves, and when
//! - **Heat**: every slot of the DRAM index has a CLOCK reference bit, set by reads and
//!   writes of its key ([`super::index::Slot::touch`]). The tier's *hand* walks the ordered
//!   index in key order from where it stopped last; a key whose bit is set gets a second
//!   chance (the bit is cleared); a key whose bit is clear has not been used for a whole
//!   turn and is *cold*. Keys loaded by recovery start cold; keys written start hot.
//! - **Trigger**: the DRAM index of PM-resident keys past
//!   [`crate::options::NativeOptions::dram_budget`], or the live log data past
//!   `pm_watermark` × [`crate::Options::pm_capacity`]. Moves continue, a batch at a time,
//!   until 10 % below the bound. A background thread checks every 100 ms and whenever a
//!   shard starts a segment; without it (`background: false`) a writer that starts a
//!   segment moves a batch itself, and [`crate::Db::compact`] moves until below the bound.
//! - **Eligible**: a cold key whose newest version is at or below the store's `keep`
//!   number (every current and future snapshot reads that version or a newer one), puts
//!   and deletes alike. Hot keys stay in PM.
//!
//! # How a batch moves (the commit protocol)
//! 1. The batch's newest versions, in key order, are read from PM (checksums verified)
//!    and written as one new level-0 table of the shared LSM ([`crate::lsm::Lsm::ingest`]:
//!    table fsynced, MANIFEST edit fsynced — the commit point on disk). The table is
//!    installed as the newest, so it shadows older disk copies of the same keys.
//! 2. For every key a *moved* entry (log entry kind 3, the moved version's sequence
//!    number, no value) is appended to a PM log and fenced. At replay a moved entry wins
//!    over a put or delete of the same sequence number, and a key whose newest entry is
//!    one gets no index slot: it is read from disk. A put of the key written meanwhile has
//!    a higher sequence number and wins over both.
//! 3. When no snapshot or iterator that pinned the disk tables *before* step 1 lives any
//!    more, each key's slot leaves the index if its newest version is still the one that
//!    moved ([`super::index::Index::remove`]); its PM entry then counts as dead and the
//!    log cleaner reclaims it. A key written since keeps its slot (it shadows the disk
//!    copy, which the LSM's compactions drop once a newer copy of the key lands below).
//!
//! A crash between any two steps is safe: before 2 the PM entry is still the key's newest
//! and the disk copy (if committed) holds the same value; after 2 the disk copy is
//! durable. Moved entries are kept by the cleaner while they can matter (the key has no
//! slot, or its newest version is the one that moved), like deletes of keys without a
//! slot: older entries of the key may still lie in segments not yet cleaned.
//!
//! # Reads
//! A point read goes to disk when the key has no slot, or (for a snapshot) no version at
//! or below the snapshot: bloom filters, then at most one table per level, usually one
//! block read. A snapshot pins the table set it was taken with (and its *generation*,
//! counted up by every committed batch), so removals that would hide a key from it wait
//! for it (step 3). Iterators merge the index cursor (newest) with the pinned tables.
//!
//! # Costs
//! A PM-resident key costs its index slot in DRAM (about 292 bytes + the key for 16-byte
//! keys: an estimate from the parts, `PER_SLOT_BYTES`, not measured in isolation). A disk-resident key costs no slot: its share of a table's index
//! block (one entry per 4 KiB block) and 10 bits of bloom filter, 15.3 bytes measured for
//! 1 KiB values and 16-byte keys ([`TablesView::dram_bytes`] counts it), plus a moved entry
//! in PM (12 + key bytes, in a record of its own: 24 more) until the cleaner drops it.
//!
//! `Stats::keys` is exact while the tier is empty; with keys on disk it is the PM-resident
//! live keys plus the disk tables' entries, an estimate from above (a key rewritten in PM
//! or deleted is counted until compaction merges its disk copies away): an exact count
//! would need a disk lookup on every write of a key without a slot.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_epoch as epoch;
use parking_lot::Mutex;

use crate::engine::EngineCtx;
use crate::error::{Error, Result};
use crate::fs::Fs;
use crate::jobs::Cancel;
use crate::lsm::{Lsm, LsmOptions, TablesView};
use crate::poison::Poison;

use super::index::MapGuard;
use super::layout::{entry_len, record_len, EntryIn, Kind, RECORD_HEADER_LEN};
use super::log::ShardLog;
use super::Inner;

/// The directory of the disk tier, inside the store directory.
pub const COLD_DIR: &str = "cold";
/// Most value bytes one batch moves (one level-0 table).
const BATCH_BYTES: u64 = 4 << 20;
/// Most keys one batch moves.
const BATCH_KEYS: usize = 16 << 10;
/// Most slots the hand visits for one batch (bounds a pass over hot keys).
const VISIT_PER_BATCH: usize = 64 << 10;

/// A moved batch whose slots wait for older snapshots to end.
struct Pending {
    /// The table generation that holds the batch.
    gen: u64,
    /// Key, moved sequence number, PM address and size of the moved entry written.
    keys: Vec<(Box<[u8]>, u64, u64, u32)>,
}

/// The disk tier and its bookkeeping.
pub(crate) struct Cold {
    pub lsm: Arc<Lsm>,
    /// Generation of the table set: counted up after each committed batch.
    gen: AtomicU64,
    /// Any table committed (reads skip the disk tier while false).
    nonempty: AtomicBool,
    /// Generations pinned by live snapshots and iterators → count.
    pins: Mutex<BTreeMap<u64, usize>>,
    pending: Mutex<VecDeque<Pending>>,
    /// The CLOCK hand: the key after which the next pass starts (`None`: the start).
    hand: Mutex<Option<Vec<u8>>>,
    /// One mover at a time.
    moving: Mutex<()>,
    pub moved_keys: AtomicU64,
    pub moved_batches: AtomicU64,
    pub removed_slots: AtomicU64,
    /// Keys moved whose slots wait for removal (not counted against the DRAM budget).
    pub pending_keys: AtomicU64,
    /// Slots removed whose moved version was a put (PM-resident live keys that left).
    pub removed_puts: AtomicU64,
    pub disk_reads: AtomicU64,
    /// Moves that failed in a writer or the background thread (skipped; see
    /// `last_failure`): the store goes on with the keys in PM.
    pub failures: AtomicU64,
    pub last_failure: Mutex<Option<String>>,
}

/// A snapshot's pin of the disk tier.
pub(crate) struct ColdPin {
    pub gen: u64,
    pub view: TablesView,
}

impl Cold {
    /// Open (or create) the disk tier in `<dir>/cold`, with the store's poison and
    /// shutdown token. A store made before the tier existed gets an empty one.
    /// The tier has a poison of its own: a failed background compaction stops further
    /// moves (and is reported by `check`), while reads of the committed tables go on.
    ///
    /// `create`: the store is new or of a format version before the tier existed; else a
    /// missing tier is [`Error::Corruption`] (keys whose newest entry is a moved entry
    /// would read as absent).
    pub fn open(ctx: &EngineCtx, create: bool, poison: Arc<Poison>, cancel: Arc<Cancel>) -> Result<Cold> {
        let dir = ctx.dir.join(COLD_DIR);
        let fresh = create && !ctx.fs.exists(&dir.join("CURRENT"));
        if fresh {
            ctx.fs.create_dir_all(&dir)?;
            ctx.fs.sync_dir(&ctx.dir)?;
        }
        let opts = LsmOptions {
            background: ctx.opts.native.background,
            wal_recovery: ctx.opts.wal_recovery,
            recovery_log: ctx.recovery.clone(),
            ..LsmOptions::default()
        };
        // Nothing is ever written through the LSM's WAL, so a torn last MANIFEST record can
        // only be a commit cut by the crash (`ingest` and compactions fsync their tables
        // before the record): dropping it loses nothing that was acknowledged.
        let (lsm, batches) = Lsm::open(ctx.fs.clone(), &dir, opts, fresh, poison, cancel, &|| true)?;
        if !batches.is_empty() {
            return Err(Error::corruption(dir, 0, "the capacity tier's WAL holds records (it is never written)"));
        }
        let lsm = Arc::new(lsm);
        lsm.finish_recovery(Vec::new())?;
        let nonempty = !lsm.tables().is_empty();
        Ok(Cold {
            lsm,
            gen: AtomicU64::new(1),
            nonempty: AtomicBool::new(nonempty),
            pins: Mutex::new(BTreeMap::new()),
            pending: Mutex::new(VecDeque::new()),
            hand: Mutex::new(None),
            moving: Mutex::new(()),
            moved_keys: AtomicU64::new(0),
            moved_batches: AtomicU64::new(0),
            removed_slots: AtomicU64::new(0),
            removed_puts: AtomicU64::new(0),
            pending_keys: AtomicU64::new(0),
            disk_reads: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            last_failure: Mutex::new(None),
        })
    }

    /// Whether any table exists.
    #[inline]
    pub fn nonempty(&self) -> bool {
        self.nonempty.load(Ordering::Acquire)
    }

    /// Note a move that failed and was skipped.
    pub fn failed(&self, e: &Error) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        *self.last_failure.lock() = Some(e.to_string());
    }

    /// Moved batches whose slots are still in the index.
    pub fn has_pending(&self) -> bool {
        !self.pending.lock().is_empty()
    }

    /// Pin the current table set for a snapshot.
    pub fn pin(&self) -> ColdPin {
        let mut pins = self.pins.lock();
        let gen = self.gen.load(Ordering::Acquire);
        *pins.entry(gen).or_insert(0) += 1;
        ColdPin { gen, view: self.lsm.tables() }
    }

    /// Another pin of `p`'s generation (an iterator of a snapshot).
    pub fn pin_again(&self, p: &ColdPin) -> ColdPin {
        *self.pins.lock().entry(p.gen).or_insert(0) += 1;
        ColdPin { gen: p.gen, view: p.view.clone() }
    }

    pub fn unpin(&self, gen: u64) {
        let mut pins = self.pins.lock();
        if let Some(n) = pins.get_mut(&gen) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&gen);
            }
        }
    }

    /// `key` on disk as of the current tables (`view` for a snapshot): `Some(None)` for a
    /// delete, `None` when the disk has no entry.
    pub fn get(&self, key: &[u8], view: Option<&TablesView>) -> Result<Option<Option<Vec<u8>>>> {
        if !self.nonempty() {
            return Ok(None);
        }
        self.disk_reads.fetch_add(1, Ordering::Relaxed);
        match view {
            Some(v) => {
                let r = v.get(key);
                self.lsm.wake_for_seeks(); // the read may have spent a table's seek allowance
                r
            }
            None => self.lsm.get(key),
        }
    }
}

/// A key picked for a move.
struct Pick {
    key: Vec<u8>,
    seq: u64,
    loc: u64,
    tomb: bool,
}

impl Inner {
    /// Whether the capacity tier's bound is passed: `slack` = 0 for the trigger, 0.1 for
    /// the level moves continue to.
    pub(super) fn over_budget(&self, slack: f64) -> bool {
        let dram = self.dram_budget;
        let pending = self.cold.pending_keys.load(Ordering::Relaxed) * (super::PER_SLOT_BYTES + 16);
        if dram > 0 && (self.index_dram_bytes().saturating_sub(pending) as f64) > dram as f64 * (1.0 - slack) {
            return true;
        }
        let cap = self.region.capacity();
        if cap > 0 {
            let limit = cap as f64 * (self.pm_watermark - slack);
            if (self.live_log_bytes() as f64) > limit {
                return true;
            }
        }
        false
    }

    /// Bytes of log records in segments minus the dead ones.
    pub(super) fn live_log_bytes(&self) -> u64 {
        let segs: Vec<(u64, super::SegMeta)> = self.segs.lock().iter().map(|(&a, &m)| (a, m)).collect();
        let mut live = 0u64;
        for (a, m) in segs {
            let used = m.sealed.unwrap_or_else(|| self.geo.capacity(m.span));
            live += used.saturating_sub(self.dead_bytes(a, m.span).min(used));
        }
        live
    }

    /// Move cold keys to disk until the bound is 10 % away (`all`) or one batch (not
    /// `all`); then take the slots whose snapshots have ended out of the index. Appends
    /// the moved entries to the owned shard `log`. One mover at a time: with `wait` the
    /// call waits for a running one (`compact`), else it returns at once. Returns the
    /// keys moved.
    pub(super) fn move_cold(&self, log: &mut ShardLog, all: bool, wait: bool) -> Result<u64> {
        // Coldness and removal are judged by the index: not before it holds every key.
        self.index.wait_loaded()?;
        let _one = if wait {
            self.cold.moving.lock()
        } else {
            match self.cold.moving.try_lock() {
                Some(g) => g,
                None => return Ok(0),
            }
        };
        let mut moved = 0;
        // At most two turns of the hand per call: the first may only clear reference bits.
        let mut wraps = 0;
        if self.over_budget(0.0) {
            loop {
                let (n, wrapped) = self.move_batch(log)?;
                self.remove_moved();
                moved += n;
                wraps += usize::from(wrapped);
                // Each batch is committed: a close (`stop`, set before the worker is
                // joined) ends the loop between two.
                if !all
                    || wraps >= 2
                    || !self.over_budget(0.1)
                    || self.closed.load(Ordering::Acquire)
                    || self.stop.load(Ordering::Acquire)
                {
                    break;
                }
            }
        }
        self.remove_moved();
        Ok(moved)
    }

    /// Pick cold keys from the hand on and move them (one table). Returns the keys moved
    /// and whether the hand passed the end of the index.
    fn move_batch(&self, log: &mut ShardLog) -> Result<(u64, bool)> {
        let keep = self.keep();
        // The picks and their values under one epoch pin (the log cleaner does not reuse a
        // segment while a pinned thread may read it), copied out; the table is written
        // after the pin is dropped (a pin held across file I/O would hold back every
        // retired segment of the store).
        let (picks, wrapped, entries) = {
            let guard = epoch::pin();
            let (picks, wrapped) = self.pick_cold(keep, &guard)?;
            let mut entries = Vec::with_capacity(picks.len());
            for p in &picks {
                if p.tomb {
                    entries.push((p.key.clone(), None));
                    continue;
                }
                let e = self.read_entry(p.seq, p.loc, true)?;
                if e.key != p.key.as_slice() {
                    return Err(self.region.corruption(p.loc, "index entry points at another key's log entry"));
                }
                entries.push((p.key.clone(), Some(e.value.to_vec())));
            }
            (picks, wrapped, entries)
        };
        if picks.is_empty() {
            return Ok((0, wrapped));
        }
        // 1. The table. A failure here (the disk) is counted and the batch skipped: the
        // keys stay in PM.
        let mut it = entries.into_iter().map(Ok);
        if let Err(e) = self.cold.lsm.ingest(&mut it) {
            self.cold.failed(&e);
            return Ok((0, wrapped));
        }
        let gen = {
            let _pins = self.cold.pins.lock();
            self.cold.nonempty.store(true, Ordering::Release);
            self.cold.gen.fetch_add(1, Ordering::AcqRel) + 1
        };
        // 2. The moved entries, each its own record (its sequence number is the moved
        // version's: a record's entries are numbered consecutively).
        // Keys whose moved entry is written wait for removal even if a later append fails
        // (the others keep their slots and are picked again).
        let mut keys = Vec::with_capacity(picks.len());
        let mut failed = None;
        for p in &picks {
            let size = entry_len(p.key.len(), 0) as u64;
            let len = record_len(size as usize) as u64;
            let mut one = std::iter::once(EntryIn { kind: Kind::Moved, key: &p.key, value: &[] });
            match self.append(log, p.seq, 1, len, &mut one, false) {
                Ok(at) => {
                    keys.push((p.key.clone().into_boxed_slice(), p.seq, at + RECORD_HEADER_LEN as u64, size as u32));
                    self.index.mark_moved(&p.key, p.seq);
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let n = keys.len() as u64;
        self.cold.pending_keys.fetch_add(n, Ordering::Relaxed);
        self.cold.pending.lock().push_back(Pending { gen, keys });
        if let Some(e) = failed {
            return Err(e);
        }
        self.cold.moved_keys.fetch_add(n, Ordering::Relaxed);
        self.cold.moved_batches.fetch_add(1, Ordering::Relaxed);
        Ok((n, wrapped))
    }

    /// Walk the hand over the ordered index: up to one batch of cold keys whose newest
    /// version is at or below `keep` (and not moved already), in key order; and whether
    /// the hand passed the end (the next pass starts at the beginning).
    fn pick_cold(&self, keep: u64, eg: &epoch::Guard) -> Result<(Vec<Pick>, bool)> {
        let mut hand = self.cold.hand.lock();
        let mut picks = Vec::new();
        let mut bytes = 0u64;
        let mut visited = 0usize;
        let mut last: Option<Vec<u8>> = None;
        let mut wrapped = false;
        {
            let mg = MapGuard::new();
            let lower: Bound<&[u8]> = match hand.as_deref() {
                Some(h) => Bound::Excluded(h),
                None => Bound::Unbounded,
            };
            let mut reached_end = true;
            for (k, slot) in self.index.ascending(lower, &mg)? {
                visited += 1;
                if visited > VISIT_PER_BATCH || picks.len() >= BATCH_KEYS || bytes >= BATCH_BYTES {
                    reached_end = false;
                    break;
                }
                last = Some(k.to_vec());
                if slot.second_chance() {
                    continue;
                }
                let Some(h) = slot.head(eg) else { continue };
                if h.seq > keep || !h.visible() || slot.moved.load(Ordering::Relaxed) == h.seq {
                    continue;
                }
                bytes += u64::from(h.size);
                picks.push(Pick { key: k.to_vec(), seq: h.seq, loc: h.loc(), tomb: h.tomb });
            }
            if reached_end {
                wrapped = true;
            }
        }
        // The next pass starts after the last key visited, or at the start after the end.
        *hand = if wrapped { None } else { last };
        Ok((picks, wrapped))
    }

    /// Take out of the index the slots of moved batches that no live snapshot can need.
    pub(super) fn remove_moved(&self) {
        let oldest_pin = self.cold.pins.lock().keys().next().copied().unwrap_or(u64::MAX);
        loop {
            let batch = {
                let mut p = self.cold.pending.lock();
                match p.front() {
                    Some(b) if b.gen <= oldest_pin => p.pop_front(),
                    _ => None,
                }
            };
            let Some(batch) = batch else { break };
            self.cold.pending_keys.fetch_sub(batch.keys.len() as u64, Ordering::Relaxed);
            for (key, seq, marker_loc, marker_size) in batch.keys {
                match self.index.remove(&key, seq) {
                    Some((loc, size, tomb)) => {
                        if !tomb {
                            self.add_dead(loc, u64::from(size));
                            self.cold.removed_puts.fetch_add(1, Ordering::Relaxed);
                        }
                        self.cold.removed_slots.fetch_add(1, Ordering::Relaxed);
                    }
                    // Written since: the slot stays, the moved entry is dead.
                    None => self.add_dead(marker_loc, u64::from(marker_size)),
                }
            }
        }
    }
}
