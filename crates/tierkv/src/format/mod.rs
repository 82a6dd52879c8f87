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
