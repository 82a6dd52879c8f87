//! A log ring in PM, used for both tiers of PMEKV's two-tier log.
//!
//! Entries are 64-byte aligned and never straddle the end of the ring: an entry that does
//! not fit before the end starts again at the beginning (the skipped tail holds nothing
//! valid). Positions (`head`, `tail`) are logical byte counts; the physical offset is the
//! position modulo the ring length. The ring's positions are not persisted: recovery scans
//! the whole ring for entries with a valid checksum and a sequence number above the last
//! checkpoint's, and after recovery the ring starts empty at position 0.

use super::layout::{LogEntry, LogKind};
use crate::pm::{Region, LINE};

/// One log ring.
#[derive(Debug)]
pub struct Ring {
    kind: LogKind,
    start: u64,
    len: u64,
    head: u64,
    tail: u64,
}

impl Ring {
    /// An empty ring over `[start, start+len)`.
    pub fn new(kind: LogKind, start: u64, len: u64) -> Self {
        Ring { kind, start, len, head: 0, tail: 0 }
    }

    /// Ring length in bytes.
    pub fn capacity(&self) -> u64 {
        self.len
    }

    /// Bytes between head and tail (including skipped tails).
    pub fn used(&self) -> u64 {
        self.tail - self.head
    }

    /// True if entries of `sizes` fit, in order, without moving the head.
    pub fn fits(&self, sizes: impl Iterator<Item = u64>) -> bool {
        let mut tail = self.tail;
        for size in sizes {
            match Self::place(tail, self.len, size) {
                Some(t) if t + size - self.head <= self.len => tail = t + size,
                _ => return false,
            }
        }
        true
    }

    /// Where an entry of `size` bytes starts if the tail is at `tail`.
    fn place(tail: u64, len: u64, size: u64) -> Option<u64> {
        if size > len {
            return None;
        }
        let phys = tail % len;
        Some(if phys + size > len { tail + (len - phys) } else { tail })
    }

    /// Reserve `size` bytes (a multiple of 64); returns the PM address, or `None` if full.
    pub fn reserve(&mut self, size: u64) -> Option<u64> {
        debug_assert!(size.is_multiple_of(LINE));
        let at = Self::place(self.tail, self.len, size)?;
        if at + size - self.head > self.len {
            return None;
        }
        self.tail = at + size;
        Some(self.start + at % self.len)
    }

    /// Forget every entry (they are all applied and covered).
    pub fn clear(&mut self) {
        self.head = self.tail;
    }

    /// Every valid entry in the ring, with its flag and address, in ring order.
    pub fn scan(&self, region: &Region) -> Vec<(LogEntry, u8, u64)> {
        let ring = region.slice(self.start, self.len as usize).unwrap_or(&[]);
        scan_bytes(self.kind, self.start, ring)
    }
}

/// Every valid entry of kind `kind` in `ring` (the bytes of a whole ring that starts at PM
/// address `start`), with its flag and address, in ring order: the scan recovery and
/// salvage share. Lines that hold no valid entry are stepped over 64 bytes at a time.
pub(crate) fn scan_bytes(kind: LogKind, start: u64, ring: &[u8]) -> Vec<(LogEntry, u8, u64)> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off < ring.len() {
        let rest = ring.get(off..).unwrap_or(&[]);
        match LogEntry::decode(rest, kind) {
            Some((e, flag)) => {
                let addr = start + off as u64;
                off += LogEntry::size(e.key.len()) as usize;
                out.push((e, flag, addr));
            }
            None => off += LINE as usize,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_without_straddling_and_refuses_overflow() {
        let mut r = Ring::new(LogKind::Key, 1000, 256);
        assert_eq!(r.reserve(128), Some(1000));
        assert_eq!(r.reserve(64), Some(1128));
        assert!(!r.fits([128].into_iter()), "only 64 bytes left");
        assert_eq!(r.reserve(128), None);
        r.clear();
        // 64 bytes remain before the end; a 128-byte entry skips them and starts at 0.
        assert_eq!(r.reserve(128), Some(1000));
        assert_eq!(r.used(), 192, "the skipped 64 bytes count as used");
        assert!(r.fits([64].into_iter()));
        assert!(!r.fits([64, 64].into_iter()));
        assert_eq!(r.reserve(512), None, "larger than the ring");
    }
}
