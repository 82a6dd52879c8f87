//! Shared encoding helpers: checksums and a bounds-checked decoder.
//!
//! Every decode of persistent bytes goes through [`Cursor`], whose getters return `None`
//! instead of panicking on short input; callers turn `None` into [`crate::Error::Corruption`]
//! with the file and offset. (This is how the crate keeps "no panic on data read from disk
//! or PM" without denying `clippy::indexing_slicing` crate-wide.)

pub mod crc;
pub mod log;

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

/// The framed records of `data` (each with its offset), and whether a torn last record was
/// dropped: [`log::read_log`] under [`log::WalRecovery::TolerateTornTail`] (the MANIFEST's
/// rule). `base` is the file offset of `data[0]` (page alignment). Any bad record that is
/// not a torn tail is `Err((offset, detail))`.
pub fn read_frames_at(data: &[u8], base: u64) -> Result<Frames<'_>, (u64, String)> {
    let r = log::read_log(data, base, log::WalRecovery::TolerateTornTail)?;
    Ok((r.records, r.torn))
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
