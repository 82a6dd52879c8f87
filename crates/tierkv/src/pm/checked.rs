//! Records this process has already checked: a bounded, lossy DRAM memo of the PM records
//! whose checksums a reader verified, so a range read that walks the same records again
//! (every scan of a hot range does) does not pull each whole record through the cache and
//! checksum it on every visit.
//!
//! # What a hit promises
//! An entry is a record's region address (exact), a 24-bit *tag* and a 32-bit check hash,
//! both hashes of the record's length and of a *salt* the design passes — what the record's checksum binds it
//! to besides its own bytes (pmekv: the key the index names; hpdk: the value pool's
//! generation). An entry is set only after a reader verified the record at that address on
//! this [`super::Region`] (one per open store: a reopen, or a reopen of a crash image,
//! starts empty). The presets that use it write a record only into space no reader can
//! reach, publish its address after the bytes are written, and never change a published
//! record's bytes in place, so while this process runs the bytes at a memoised address are
//! either the ones verified or a newer record this process wrote there, whole, after the
//! space was freed. The tag keeps the checks a stale pointer would have failed: an index
//! entry naming a record verified for another key (pmekv) or of an earlier generation of a
//! reused pool (hpdk), or with another length, misses the memo and is verified — except
//! when 56 bits of hash collide. What the memo gives up is the re-check
//! of bytes that change under a running process by other means (a stray store, media
//! decay after the first read): the trade the SSTable reader makes when it verifies a
//! mapped block once per open table (`docs/design/read-path.md`). LevelDB, by default,
//! checks neither.
//!
//! # Cost
//! A table of [`SLOTS`] 16-byte entries (16 MiB), allocated zeroed on the first insert (a
//! store whose iterators never run pays nothing; with glibc a block this large is a fresh
//! mapping, whose pages the kernel backs only once touched — not measured here); each
//! design counts it in its `dram_index_bytes`. An entry is a word (address and
//! tag) and a check (the record's length, which [`Checked::lookup`] returns to a design
//! whose index lacks it, and a second 32-bit hash). The table is 4-way set-associative: a record maps by a hash of its address to
//! one set of 4 entries in one cache line, so a lookup costs at most one DRAM miss, and
//! records that share a set do not evict each other until the set is full (with one entry
//! per set, two records whose hashes collide evict each other on every visit and are
//! re-verified each time). A full set overwrites an entry picked by the hash; the evicted
//! record is verified again on its next read. The memo carries no data but lengths (each
//! vouched for by its tag): the record's bytes are reached through the design's own
//! published index.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Entries per set: one 64-byte cache line of four 16-byte entries.
const WAYS: usize = 4;
/// log2 of the set count.
const SETS_LOG2: u32 = 18;
/// Entries in the table (16 bytes each).
pub const SLOTS: usize = WAYS << SETS_LOG2;
/// Bits of a word holding the address; addresses at or past `1 << ADDR_BITS` are not
/// memoised (always verified).
const ADDR_BITS: u32 = 40;
/// The address bits of a word.
const ADDR_MASK: u64 = (1 << ADDR_BITS) - 1;

/// One entry: the word (address and tag; 0 = empty) and the *check*: the record's length
/// (low 32 bits), which [`Checked::lookup`] hands back, and a second 32-bit hash of the
/// address, length and salt. A record matches only when both halves do.
#[derive(Default)]
struct Entry {
    word: AtomicU64,
    check: AtomicU64,
}

/// One set: a cache line of entries.
#[repr(align(64))]
struct Set([Entry; WAYS]);

/// The memo (see the module docs).
#[derive(Default)]
pub struct Checked {
    sets: OnceLock<Box<[Set]>>,
    /// Checks [`Checked::verify_once`] ran and passed (`PmStats::records_checked`).
    runs: AtomicU64,
}

impl std::fmt::Debug for Checked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checked").field("allocated", &self.sets.get().is_some()).finish()
    }
}

#[inline]
fn mix(x: u64) -> u64 {
    let x = (x ^ (x >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// The word for a record: its address in the low bits, the tag of (`len`, `salt`) above
/// (never 0, so a word is never an empty slot). `None` for an address that does not fit.
#[inline]
fn word(addr: u64, len: usize, salt: u64) -> Option<u64> {
    if addr & !ADDR_MASK != 0 {
        return None;
    }
    let tag = (mix(mix(len as u64) ^ salt) >> ADDR_BITS).max(1);
    Some(addr | (tag << ADDR_BITS))
}

/// The check half of an entry for a record (see [`Entry`]); `None` for a length that does
/// not fit in 32 bits.
#[inline]
fn check(addr: u64, len: usize, salt: u64) -> Option<u64> {
    let len = u32::try_from(len).ok()?;
    let h = mix(mix(addr ^ salt.rotate_left(17)) ^ u64::from(len).rotate_left(40)) >> 32;
    Some(u64::from(len) | (h << 32))
}

/// The set of address `addr`, and the way a full set gives up for it.
#[inline]
fn place(addr: u64) -> (usize, usize) {
    let h = addr.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((h >> (64 - SETS_LOG2)) as usize, (h >> 20) as usize % WAYS)
}

/// `n` empty sets, from zeroed memory (no pass that writes every set: a large zeroed
/// block is usually a fresh mapping the kernel backs page by page as it is touched).
fn zeroed_sets(n: usize) -> Box<[Set]> {
    let Ok(layout) = std::alloc::Layout::array::<Set>(n) else {
        return (0..n).map(|_| Set(Default::default())).collect();
    };
    if layout.size() == 0 {
        return Box::default();
    }
    // SAFETY: the layout has a non-zero size; a null result is handled; an all-zero
    // `AtomicU64` is a valid `AtomicU64` (0) and a `Set` is only `AtomicU64`s, so the
    // zeroed block is `n` initialised `Set`s;
    // and the block came from the global allocator with exactly the layout of `[Set; n]`,
    // which is what `Box<[Set]>` frees it with.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout).cast::<Set>();
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n))
    }
}

impl Checked {
    /// An empty memo (no table until the first insert).
    pub fn new() -> Checked {
        Checked::default()
    }

    #[inline]
    fn set(&self, addr: u64) -> Option<(&Set, usize)> {
        let (set, way) = place(addr);
        Some((self.sets.get()?.get(set)?, way))
    }

    /// Whether the record of `len` bytes at `addr` with `salt` was verified by this process.
    #[inline]
    pub fn contains(&self, addr: u64, len: usize, salt: u64) -> bool {
        let (Some(w), Some(c)) = (word(addr, len, salt), check(addr, len, salt)) else { return false };
        self.set(addr).is_some_and(|(s, _)| {
            s.0.iter().any(|e| e.word.load(Ordering::Acquire) == w && e.check.load(Ordering::Acquire) == c)
        })
    }

    /// The length of the record at `addr` with `salt` this process verified, if the memo
    /// holds it: for a design whose DRAM index does not hold lengths (hpdk), a known record
    /// is then placed without reading PM. The length must reproduce both the word's 24-bit
    /// tag and the check's 32-bit hash, so an entry of another record at the address (an
    /// earlier generation, another length), or one torn by racing inserts, is not taken
    /// for this one but for a 56-bit collision.
    #[inline]
    pub fn lookup(&self, addr: u64, salt: u64) -> Option<usize> {
        if addr & !ADDR_MASK != 0 {
            return None;
        }
        let (s, _) = self.set(addr)?;
        s.0.iter().find_map(|e| {
            let w = e.word.load(Ordering::Acquire);
            if w == 0 || w & ADDR_MASK != addr {
                return None;
            }
            let c = e.check.load(Ordering::Acquire);
            let len = (c & u64::from(u32::MAX)) as usize;
            (word(addr, len, salt) == Some(w) && check(addr, len, salt) == Some(c)).then_some(len)
        })
    }

    /// Whether some record at `addr` was verified (a hint for prefetching: it does not say
    /// the record there now is that one).
    #[inline]
    pub fn knows(&self, addr: u64) -> bool {
        if addr & !ADDR_MASK != 0 {
            return false;
        }
        self.set(addr).is_some_and(|(s, _)| {
            s.0.iter().any(|e| {
                let v = e.word.load(Ordering::Relaxed);
                v != 0 && v & ADDR_MASK == addr
            })
        })
    }

    /// Note that the record of `len` bytes at `addr` with `salt` was just verified.
    #[inline]
    pub fn insert(&self, addr: u64, len: usize, salt: u64) {
        let (Some(w), Some(c)) = (word(addr, len, salt), check(addr, len, salt)) else { return };
        self.sets.get_or_init(|| zeroed_sets(1 << SETS_LOG2));
        let Some((s, way)) = self.set(addr) else { return };
        let free = s.0.iter().find(|e| {
            let v = e.word.load(Ordering::Relaxed);
            v == 0 || v == w
        });
        if let Some(e) = free.or_else(|| s.0.get(way)) {
            // Two inserts racing on one entry may leave one's word with the other's check:
            // that entry then matches neither record (both halves must), so each is
            // verified again at its next read and re-inserted here, which rewrites both.
            e.check.store(c, Ordering::Release);
            e.word.store(w, Ordering::Release);
        }
    }

    /// Start loading the set `contains` and `knows` read for `addr` (a hint).
    #[inline]
    pub fn prefetch(&self, addr: u64) {
        if let Some((s, _)) = self.set(addr) {
            super::flush::prefetch_obj(s);
        }
    }

    /// Checks [`Checked::verify_once`] ran and passed since this memo was made.
    pub fn verified(&self) -> u64 {
        self.runs.load(Ordering::Relaxed)
    }

    /// DRAM the memo holds (0 until its first insert).
    pub fn dram_bytes(&self) -> u64 {
        self.sets.get().map_or(0, |t| std::mem::size_of_val::<[Set]>(t) as u64)
    }

    /// Run `verify` for the record of `len` bytes at `addr` with `salt` unless this process
    /// already verified it; memoise a success.
    #[inline]
    pub fn verify_once(
        &self,
        addr: u64,
        len: usize,
        salt: u64,
        verify: impl FnOnce() -> crate::error::Result<()>,
    ) -> crate::error::Result<()> {
        if self.contains(addr, len, salt) {
            return Ok(());
        }
        verify()?;
        self.insert(addr, len, salt);
        self.runs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_address_length_and_salt() {
        let c = Checked::new();
        assert!(!c.contains(4096, 100, 7));
        assert!(!c.knows(4096));
        assert_eq!(c.dram_bytes(), 0, "no table before the first insert");
        c.insert(4096, 100, 7);
        assert!(c.contains(4096, 100, 7));
        assert!(c.knows(4096));
        assert!(!c.contains(4096, 101, 7), "another length at the same address is another record");
        assert!(!c.contains(4096, 100, 8), "another salt (key, generation) is another record");
        assert!(!c.contains(4097, 100, 7));
        assert!(!c.knows(4097));
        assert_eq!(c.dram_bytes(), (SLOTS * 16) as u64);
        assert_eq!(c.lookup(4096, 7), Some(100), "the length comes back under the same salt");
        assert_eq!(c.lookup(4096, 8), None, "and not under another");
        assert_eq!(c.lookup(4097, 7), None);
    }

    #[test]
    fn addresses_that_do_not_fit_are_never_remembered() {
        let c = Checked::new();
        let far = 1u64 << ADDR_BITS;
        c.insert(far, 10, 0);
        assert!(!c.contains(far, 10, 0));
        assert!(!c.knows(far));
        c.insert(0, 0, 0);
        assert!(c.contains(0, 0, 0), "address 0 is a valid key: the tag is never 0");
    }

    #[test]
    fn a_full_set_evicts_one_word_and_mistakes_none() {
        let c = Checked::new();
        // WAYS + 1 records that share a set.
        let first = place(64).0;
        let same: Vec<u64> =
            (0..1u64 << 32).map(|i| 64 + i * 8).filter(|&a| place(a).0 == first).take(WAYS + 1).collect();
        assert_eq!(same.len(), WAYS + 1);
        for &a in &same[..WAYS] {
            c.insert(a, 10, 1);
        }
        assert!(same[..WAYS].iter().all(|&a| c.contains(a, 10, 1)), "a set holds {WAYS} records");
        assert!(!c.contains(same[WAYS], 10, 1));
        c.insert(same[WAYS], 10, 1);
        assert!(c.contains(same[WAYS], 10, 1));
        let kept = same[..WAYS].iter().filter(|&&a| c.contains(a, 10, 1)).count();
        assert_eq!(kept, WAYS - 1, "exactly one word was given up");
    }

    #[test]
    fn an_entry_torn_by_racing_inserts_matches_neither_record_and_heals() {
        let c = Checked::new();
        c.insert(4096, 100, 1);
        // Another record at the same address (say, a reused pool's next generation), whose
        // insert raced with the first: the first's word, the second's check.
        let other = check(4096, 60, 2);
        let (s, _) = c.set(4096).expect("allocated");
        let e = s.0.iter().find(|e| e.word.load(Ordering::Relaxed) != 0).expect("the entry");
        e.check.store(other.expect("fits"), Ordering::Relaxed);
        assert!(!c.contains(4096, 100, 1));
        assert!(!c.contains(4096, 60, 2));
        assert_eq!(c.lookup(4096, 1), None);
        assert_eq!(c.lookup(4096, 2), None);
        assert!(c.knows(4096), "a hint only");
        c.insert(4096, 100, 1);
        assert!(c.contains(4096, 100, 1), "re-inserting rewrites both halves");
        assert_eq!(c.lookup(4096, 1), Some(100));
    }

    #[test]
    fn verify_once_runs_the_check_until_it_succeeds() {
        let c = Checked::new();
        let mut runs = 0;
        let bad = c.verify_once(128, 8, 3, || Err(crate::error::Error::InvalidArgument("bad".into())));
        assert!(bad.is_err());
        assert_eq!(c.verified(), 0);
        for _ in 0..3 {
            let r = c.verify_once(128, 8, 3, || {
                runs += 1;
                Ok(())
            });
            assert!(r.is_ok());
        }
        assert_eq!(runs, 1, "a failed check is not memoised; a passed one is, once");
        assert_eq!(c.verified(), 1);
        // The same address under another salt is checked again.
        let mut again = false;
        let r = c.verify_once(128, 8, 4, || {
            again = true;
            Ok(())
        });
        assert!(r.is_ok() && again);
        assert_eq!(c.verified(), 2);
    }
}
