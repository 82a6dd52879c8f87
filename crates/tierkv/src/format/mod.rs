//! Shared encoding helpers: checksums and a bounds-checked decoder.
//!
//! Every decode of persistent bytes goes through [`Cursor`], whose getters return `None`
//! instead of panicking on short input; callers turn `None` into [`crate::Error::Corruption`]
//! with the file and offset. (This is how the crate keeps "no panic on data read from disk
//! or PM" without denying `clippy::indexing_slicing` crate-wide.)

pub mod crc;

/// A little-endian reader over a byte slice that never panics.
#[derive(Debug, Clone)]
pub struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    /// Read from the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }
    /// Bytes consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }
    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }
    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }
    /// Skip `n` bytes.
    pub fn skip(&mut self, n: usize) -> Option<()> {
        self.bytes(n).map(|_| ())
    }
    /// A `u8`.
    pub fn u8(&mut self) -> Option<u8> {
        self.bytes(1).and_then(|b| b.first().copied())
    }
    /// A little-endian `u16`.
    pub fn u16(&mut self) -> Option<u16> {
        self.bytes(2).and_then(|b| b.try_into().ok()).map(u16::from_le_bytes)
    }
    /// A little-endian `u32`.
    pub fn u32(&mut self) -> Option<u32> {
        self.bytes(4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes)
    }
    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Option<u64> {
        self.bytes(8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes)
    }
}

/// `v` rounded up to a multiple of `align` (a power of two).
pub fn align_up(v: u64, align: u64) -> u64 {
    (v + align - 1) & !(align - 1)
}

/// Frame a record payload: `len u32 | masked crc32c(payload) u32 | payload` (the MANIFEST's
/// records, HPDK's WAL records).
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(8 + payload.len());
    r.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    r.extend_from_slice(&crc::masked(payload).to_le_bytes());
    r.extend_from_slice(payload);
    r
}

/// Framed records with their offsets, and whether a torn last record was dropped.
pub type Frames<'a> = (Vec<(u64, &'a [u8])>, bool);

/// The page size a file system loses unsynced data in (see [`crate::fs::crash_model`]).
pub const FS_PAGE: u64 = 4096;

/// True when `data` (a file's bytes from file offset `base` on) shows, from `off` on, what a
/// crash leaves of a page that was never written back: some page-aligned range
/// `[max(page, off), min(page + FS_PAGE, end))` starting before `rec_end` is all zeros.
/// (Media damage does not zero a whole page; a crash that loses unsynced pages does.)
pub fn has_lost_page(data: &[u8], base: u64, off: usize, rec_end: usize) -> bool {
    let end = data.len();
    let file_off = base + off as u64;
    let mut page = file_off - file_off % FS_PAGE;
    loop {
        let lo = usize::try_from(page.max(file_off) - base).unwrap_or(usize::MAX);
        if lo >= rec_end.min(end) {
            return false;
        }
        let hi = usize::try_from(page + FS_PAGE - base).unwrap_or(usize::MAX).min(end);
        if data.get(lo..hi).is_some_and(|b| b.iter().all(|&x| x == 0)) {
            return true;
        }
        page += FS_PAGE;
    }
}

/// The framed records of `data` (each with its offset), and whether a torn last record was
/// dropped. `base` is the file offset of `data[0]` (page alignment).
///
/// Reading stops at the first record that is not intact. It and everything after it are a
/// torn tail, the remains of appends a crash interrupted before their sync, when it:
/// - runs past the end of the file (the file was cut inside it);
/// - fails its checksum and ends exactly at the end of the file (a torn last page); or
/// - fails its checksum (or its header is zeros) and a lost page shows from its start on
///   ([`has_lost_page`]: a file system that writes back pages out of order and commits the
///   file size first leaves zero-filled holes where unsynced pages were).
///
/// Any other bad record is `Err((offset, detail))`: damage where a crash leaves none. The
/// rule cannot tell a torn tail from damage that looks exactly like one (a checksum-failing
/// last record, or a length field damaged to point past the end); a store that must tell
/// them apart records its commit points elsewhere (slmdb's flush log, the LSM's
/// commit-in-flight word).
pub fn read_frames_at(data: &[u8], base: u64) -> Result<Frames<'_>, (u64, String)> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off < data.len() {
        let mut c = Cursor::new(data.get(off..).unwrap_or(&[]));
        let (Some(len), Some(stored)) = (c.u32(), c.u32()) else { return Ok((out, true)) };
        let Some(payload) = c.bytes(len as usize) else { return Ok((out, true)) };
        let end = off + 8 + len as usize;
        if crc::masked(payload) != stored {
            if end == data.len() || has_lost_page(data, base, off, end) {
                return Ok((out, true));
            }
            return Err((off as u64, "record checksum mismatch".into()));
        }
        out.push((off as u64, payload));
        off = end;
    }
    Ok((out, false))
}

/// [`read_frames_at`] for data that starts at file offset 0.
pub fn read_frames(data: &[u8]) -> Result<Frames<'_>, (u64, String)> {
    read_frames_at(data, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_refuses_short_input() {
        let mut c = Cursor::new(&[1, 0, 0]);
        assert_eq!(c.u16(), Some(1));
        assert_eq!(c.u16(), None, "one byte left, u16 needs two");
        assert_eq!(c.u8(), Some(0));
        assert_eq!(c.u8(), None);
        assert_eq!(Cursor::new(&[0; 4]).bytes(usize::MAX), None, "overflowing length");
    }

    /// Regression (fs page model): a synced MANIFEST record followed by an unsynced one
    /// whose page was lost (zeros up to the committed size) was reported as corruption, so
    /// slmdb could not open after a crash during a flush.
    #[test]
    fn a_zero_filled_unsynced_tail_is_torn_not_corruption() {
        let mut data = frame(b"synced");
        let synced = data.len();
        let second = frame(&[7u8; 5000]);
        data.extend_from_slice(&second);
        // The unsynced record's first page lost, its second kept: a hole inside it.
        let mut holed = data.clone();
        holed[synced..4096].fill(0);
        let (recs, torn) = read_frames(&holed).map_err(|e| e.1).unwrap_or_default();
        assert_eq!((recs.len(), torn), (1, true));
        // Only zeros after the synced record, to a size shorter than the record.
        let mut zeros = data[..synced].to_vec();
        zeros.resize(synced + 100, 0);
        let (recs, torn) = read_frames(&zeros).map_err(|e| e.1).unwrap_or_default();
        assert_eq!((recs.len(), torn), (1, true));
        // The same hole with a further record after it, at a base that moves the page
        // boundary: still torn.
        let mut more = holed.clone();
        more.extend_from_slice(&frame(b"later"));
        assert!(read_frames(&more).is_ok_and(|(r, t)| r.len() == 1 && t));
        // A flipped byte with an intact record after it is damage, not a crash.
        let mut flipped = data.clone();
        flipped[synced + 20] ^= 1;
        flipped.extend_from_slice(&frame(b"later"));
        assert!(read_frames(&flipped).is_err());
    }
}
