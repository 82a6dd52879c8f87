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

/// The framed records of `data` (each with its offset), and whether a torn last record was
/// dropped: one that runs past the end, or whose checksum fails and that ends exactly at the
/// end (a crash interrupted the append). Any other bad record is `Err((offset, detail))`.
pub fn read_frames(data: &[u8]) -> Result<Frames<'_>, (u64, String)> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off < data.len() {
        let mut c = Cursor::new(data.get(off..).unwrap_or(&[]));
        let (Some(len), Some(stored)) = (c.u32(), c.u32()) else { return Ok((out, true)) };
        let Some(payload) = c.bytes(len as usize) else { return Ok((out, true)) };
        let end = off + 8 + len as usize;
        if crc::masked(payload) != stored {
            if end == data.len() {
                return Ok((out, true));
            }
            return Err((off as u64, "record checksum mismatch".into()));
        }
        out.push((off as u64, payload));
        off = end;
    }
    Ok((out, false))
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
}
