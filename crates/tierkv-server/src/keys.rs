//! How Redis's keyspace maps onto tierkv's ordered key space (docs/format/server-keyspace.md).
//!
//! - A **string** `k` is stored under `k` itself, so plain keys stay readable through the
//!   library API and the CLI. The one exception: a string whose first byte is `0xFF` is stored
//!   under `FF 's' k`, because every other Redis type lives under the `0xFF` prefix.
//! - A **hash or sorted set** `k` has a type record `FF 'm' k` →
//!   `version u8 = 1 | type u8 | count u64 LE` (1 = hash, 2 = sorted set; count = fields or
//!   members). The encoding's version is this byte: a server meeting another version refuses
//!   to start rather than misread the store.
//! - A **hash field**: `FF 'h' len(k) u32 BE | k | field` → value.
//! - A **sorted-set member**: `FF 'z' len(k) u32 BE | k | member` → score (f64 bits, LE), and
//!   its **score index** entry `FF 'o' len(k) u32 BE | k | sortable(score) u64 BE | member` →
//!   empty, so ZRANGEBYSCORE is one range scan in (score, member) order, Redis's order.
//!
//! The length prefix keeps `(k="a", field="bc")` and `(k="ab", field="c")` apart, and keeps
//! all of one key's entries contiguous.

/// Tag of every non-string record.
pub const META: u8 = 0xFF;
const T_ESCAPED: u8 = b's';
const T_TYPE: u8 = b'm';
const T_HASH: u8 = b'h';
const T_ZMEMBER: u8 = b'z';
const T_ZSCORE: u8 = b'o';

/// A non-string Redis type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A hash.
    Hash = 1,
    /// A sorted set.
    Zset = 2,
}

impl Kind {
    /// Redis's TYPE name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Hash => "hash",
            Kind::Zset => "zset",
        }
    }
}

/// The stored key of string `k`.
pub fn string_key(k: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if k.first() == Some(&META) {
        let mut v = vec![META, T_ESCAPED];
        v.extend_from_slice(k);
        v.into()
    } else {
        k.into()
    }
}

/// Range of escaped string keys (`FF 's' ...`).
pub fn escaped_range() -> (Vec<u8>, Vec<u8>) {
    (vec![META, T_ESCAPED], vec![META, T_ESCAPED + 1])
}

/// The string name of a stored key in the escaped range.
pub fn unescape_string(stored: &[u8]) -> &[u8] {
    &stored[2..]
}

/// The type record key of `k`.
pub fn type_key(k: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(k.len() + 2);
    v.extend_from_slice(&[META, T_TYPE]);
    v.extend_from_slice(k);
    v
}

/// Range of type records.
pub fn type_range() -> (Vec<u8>, Vec<u8>) {
    (vec![META, T_TYPE], vec![META, T_TYPE + 1])
}

/// Version of this keyspace encoding (the first byte of every type record).
pub const VERSION: u8 = 1;

/// Encode a type record.
pub fn encode_type(kind: Kind, count: u64) -> Vec<u8> {
    let mut v = vec![VERSION, kind as u8];
    v.extend_from_slice(&count.to_le_bytes());
    v
}

/// Decode a type record (`None`: not one; the server reports it as corruption).
pub fn decode_type(v: &[u8]) -> Option<(Kind, u64)> {
    if v.len() != 10 || v[0] != VERSION {
        return None;
    }
    let kind = match v[1] {
        1 => Kind::Hash,
        2 => Kind::Zset,
        _ => return None,
    };
    let mut c = [0u8; 8];
    c.copy_from_slice(&v[2..]);
    Some((kind, u64::from_le_bytes(c)))
}

fn prefixed(tag: u8, k: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(k.len() + 6);
    v.extend_from_slice(&[META, tag]);
    // Keys are at most 65,535 bytes (tierkv's limit), so the length always fits.
    v.extend_from_slice(&(k.len() as u32).to_be_bytes());
    v.extend_from_slice(k);
    v
}

/// Prefix of every field of hash `k`.
pub fn hash_prefix(k: &[u8]) -> Vec<u8> {
    prefixed(T_HASH, k)
}

/// The stored key of field `f` of hash `k`.
pub fn hash_field(k: &[u8], f: &[u8]) -> Vec<u8> {
    let mut v = hash_prefix(k);
    v.extend_from_slice(f);
    v
}

/// Prefix of every member record of sorted set `k`.
pub fn zmember_prefix(k: &[u8]) -> Vec<u8> {
    prefixed(T_ZMEMBER, k)
}

/// The member record key of `m` in sorted set `k`.
pub fn zmember(k: &[u8], m: &[u8]) -> Vec<u8> {
    let mut v = zmember_prefix(k);
    v.extend_from_slice(m);
    v
}

/// Prefix of the score index of sorted set `k`.
pub fn zscore_prefix(k: &[u8]) -> Vec<u8> {
    prefixed(T_ZSCORE, k)
}

/// The score index key of (`score`, `m`) in sorted set `k`.
pub fn zscore(k: &[u8], score: f64, m: &[u8]) -> Vec<u8> {
    let mut v = zscore_prefix(k);
    v.extend_from_slice(&sortable(score).to_be_bytes());
    v.extend_from_slice(m);
    v
}

pub use tierkv::iter::prefix_end;

/// An f64 as a u64 whose unsigned order is the numeric order (-0.0 is stored as 0.0).
pub fn sortable(score: f64) -> u64 {
    let s = if score == 0.0 { 0.0 } else { score };
    let b = s.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | (1 << 63)
    }
}

/// Inverse of [`sortable`].
pub fn unsortable(u: u64) -> f64 {
    if u >> 63 == 1 {
        f64::from_bits(u & !(1 << 63))
    } else {
        f64::from_bits(!u)
    }
}

/// A score from a member record value.
pub fn decode_score(v: &[u8]) -> Option<f64> {
    let b: [u8; 8] = v.try_into().ok()?;
    Some(f64::from_bits(u64::from_le_bytes(b)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sortable_scores_keep_numeric_order() {
        let xs =
            [f64::NEG_INFINITY, -1e300, -2.5, -1.0, -f64::MIN_POSITIVE, 0.0, 1e-300, 1.0, 3.5, 1e300, f64::INFINITY];
        for w in xs.windows(2) {
            assert!(sortable(w[0]) < sortable(w[1]), "{} < {}", w[0], w[1]);
        }
        for x in xs {
            assert_eq!(unsortable(sortable(x)), x);
        }
        assert_eq!(sortable(-0.0), sortable(0.0));
    }

    #[test]
    fn composite_keys_do_not_collide_and_stay_contiguous() {
        assert_ne!(hash_field(b"a", b"bc"), hash_field(b"ab", b"c"));
        let p = hash_prefix(b"user1");
        let end = prefix_end(&p).unwrap();
        assert!(hash_field(b"user1", b"\xff\xff") < end);
        assert!(hash_field(b"user10", b"") > end || !hash_field(b"user10", b"").starts_with(&p));
        assert_eq!(&*string_key(b"plain"), b"plain");
        assert_eq!(&*string_key(b"\xffx"), b"\xffs\xffx");
        assert_eq!(decode_type(&encode_type(Kind::Zset, 7)), Some((Kind::Zset, 7)));
        assert_eq!(decode_type(b"\x01\x03\0\0\0\0\0\0\0\0"), None);
        assert_eq!(decode_type(b"\x02\x01\0\0\0\0\0\0\0\0"), None, "unknown version");
    }
}

#[cfg(test)]
mod golden {
    #![allow(clippy::unwrap_used)]
    //! Golden bytes of docs/format/server-keyspace.md: if these change, the format changed.
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn golden_bytes() {
        assert_eq!(hex(&string_key(b"k")), "6b");
        assert_eq!(hex(&string_key(b"\xffk")), "ff73ff6b");
        assert_eq!(hex(&type_key(b"h")), "ff6d68");
        assert_eq!(hex(&encode_type(Kind::Hash, 2)), "01010200000000000000");
        assert_eq!(hex(&encode_type(Kind::Zset, 1)), "01020100000000000000");
        assert_eq!(hex(&hash_field(b"h", b"f")), "ff68000000016866");
        assert_eq!(hex(&zmember(b"z", b"m")), "ff7a000000017a6d");
        assert_eq!(hex(&1.5f64.to_bits().to_le_bytes()), "000000000000f83f");
        assert_eq!(hex(&zscore(b"z", 1.5, b"m")), "ff6f000000017abff80000000000006d");
        assert_eq!(hex(&zscore(b"z", -1.5, b"m")), "ff6f000000017a4007ffffffffffff6d");
    }
}
