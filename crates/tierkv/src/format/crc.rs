//! crc32c with LevelDB's masking.
//!
//! Stored checksums are masked (rotated and offset) so that a checksum computed over data
//! that itself contains checksums does not degenerate, and so an all-zero record never
//! carries a valid checksum of zero bytes.

const MASK_DELTA: u32 = 0xa282_ead8;

/// crc32c of `data`, masked.
pub fn masked(data: &[u8]) -> u32 {
    mask(crc32c::crc32c(data))
}

/// crc32c of the concatenation of `parts`, masked.
pub fn masked_parts(parts: &[&[u8]]) -> u32 {
    let mut c = 0u32;
    for p in parts {
        c = crc32c::crc32c_append(c, p);
    }
    mask(c)
}

/// Mask a raw crc.
pub fn mask(c: u32) -> u32 {
    c.rotate_right(15).wrapping_add(MASK_DELTA)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector_and_parts() {
        // crc32c("123456789") = 0xe3069283 (RFC 3720 check value).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked(b"123456789"), mask(0xe306_9283));
        assert_eq!(masked_parts(&[b"1234", b"56789"]), masked(b"123456789"));
        assert_ne!(masked(&[]), 0, "a zeroed record must not verify");
    }
}
