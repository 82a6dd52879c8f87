//! A bloom filter over a table's keys (LevelDB's scheme: one 64-bit hash, double hashing,
//! `k = bits_per_key * ln 2` probes, clamped to 1..=30).
//!
//! Encoding: `k u8 | bits` (the bit array, little-endian bit order within each byte). An
//! empty bit array (0 bits per key) matches every key.

/// The hash the filter uses (FNV-1a 64, then a murmur finaliser for the high bits).
pub fn hash(key: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h
}

/// A bloom filter.
#[derive(Debug, Clone, Default)]
pub struct Bloom {
    k: u8,
    bits: Vec<u8>,
}

impl Bloom {
    /// Build a filter of `bits_per_key` bits per key over `hashes`.
    pub fn build(hashes: &[u64], bits_per_key: u32) -> Bloom {
        if bits_per_key == 0 || hashes.is_empty() {
            return Bloom { k: 0, bits: Vec::new() };
        }
        let k = ((bits_per_key as f64 * std::f64::consts::LN_2) as u8).clamp(1, 30);
        let nbits = (hashes.len() as u64 * bits_per_key as u64).max(64);
        let nbytes = nbits.div_ceil(8) as usize;
        let nbits = nbytes as u64 * 8;
        let mut bits = vec![0u8; nbytes];
        for &h in hashes {
            let (mut a, b) = (h as u32 as u64, (h >> 32) | 1);
            for _ in 0..k {
                let pos = a % nbits;
                if let Some(byte) = bits.get_mut((pos / 8) as usize) {
                    *byte |= 1 << (pos % 8);
                }
                a = a.wrapping_add(b);
            }
        }
        Bloom { k, bits }
    }

    /// False only if the key whose hash is `h` was certainly not added.
    pub fn may_contain(&self, h: u64) -> bool {
        if self.bits.is_empty() || self.k == 0 {
            return true;
        }
        let nbits = self.bits.len() as u64 * 8;
        let (mut a, b) = (h as u32 as u64, (h >> 32) | 1);
        for _ in 0..self.k {
            let pos = a % nbits;
            match self.bits.get((pos / 8) as usize) {
                Some(byte) if byte & (1 << (pos % 8)) != 0 => {}
                _ => return false,
            }
            a = a.wrapping_add(b);
        }
        true
    }

    /// Bytes of the filter's bits.
    pub fn bytes(&self) -> usize {
        self.bits.len()
    }

    /// `k u8 | bits`.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(1 + self.bits.len());
        v.push(self.k);
        v.extend_from_slice(&self.bits);
        v
    }

    /// Inverse of [`Bloom::encode`].
    pub fn decode(b: &[u8]) -> Option<Bloom> {
        let (&k, bits) = b.split_first()?;
        if k > 30 {
            return None;
        }
        Some(Bloom { k, bits: bits.to_vec() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_false_negatives_and_about_one_percent_false_positives() {
        let hs: Vec<u64> = (0..10_000u32).map(|i| hash(format!("key{i}").as_bytes())).collect();
        let f = Bloom::decode(&Bloom::build(&hs, 10).encode()).unwrap_or_default();
        assert!(hs.iter().all(|&h| f.may_contain(h)));
        let fp = (0..10_000u32).filter(|i| f.may_contain(hash(format!("other{i}").as_bytes()))).count();
        // 10 bits/key gives ~0.8% in theory; allow up to 2%.
        assert!(fp < 200, "false positives {fp} / 10000");
        assert!(Bloom::build(&hs, 0).may_contain(hash(b"anything")));
    }
}
