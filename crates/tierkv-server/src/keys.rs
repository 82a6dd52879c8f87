//! How Redis's keyspace maps onto tierkv's ordered key space (docs/format/server-keyspace.md).
//!
//! - A **string** `k` is stored under `k` itself, so plain keys stay readable through the
//!   library API and the CLI. The one exception: a string whose first byte is `0xFF` is stored
//!   under `FF 's' k`, because every other Redis type lives under the `0xFF` prefix.
//! - A **string with an expiry** `k` is stored under `FF 'x' k` →
//!   `version u8 = 2 | expire-at u64 LE (Unix ms) | value`, and nowhere else: a string lives
//!   in exactly one of the two places, so a string without expiry keeps the plain layout
//!   (stores written before expiry existed read unchanged) and the deadline is in the same
//!   record as the value (one write sets both; a crash cannot separate them).
//! - A **hash or sorted set** `k` has a type record `FF 'm' k` →
//!   `version u8 = 1 | type u8 | count u64 LE` (1 = hash, 2 = sorted set; count = fields or
//!   members), or, when it has an expiry, `version u8 = 2 | type u8 | count u64 LE |
//!   expire-at u64 LE`. The version byte says which: a server meeting another version
//!   refuses to start rather than misread the store.
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
const T_EXPIRING: u8 = b'x';

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

/// Version of this keyspace encoding: the newest record version this server writes (type
/// records with an expiry and expiring strings). Version 1 type records (no expiry) are
/// still written for keys without one, so older servers keep reading such stores.
pub const VERSION: u8 = 2;
const V1: u8 = 1;

/// Encode a type record (version 1 without an expiry, version 2 with one).
pub fn encode_type(kind: Kind, count: u64, expire_at: Option<u64>) -> Vec<u8> {
    let mut v = vec![if expire_at.is_some() { VERSION } else { V1 }, kind as u8];
    v.extend_from_slice(&count.to_le_bytes());
    if let Some(t) = expire_at {
        v.extend_from_slice(&t.to_le_bytes());
    }
    v
}

fn u64_le(b: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(b.try_into().ok()?))
}

/// Decode a type record: (kind, count, expire-at ms). `None`: not one (the server reports
/// it as corruption).
pub fn decode_type(v: &[u8]) -> Option<(Kind, u64, Option<u64>)> {
    let (ver, kind) = (*v.first()?, *v.get(1)?);
    let kind = match kind {
        1 => Kind::Hash,
        2 => Kind::Zset,
        _ => return None,
    };
    match (ver, v.len()) {
        (V1, 10) => Some((kind, u64_le(v.get(2..10)?)?, None)),
        (VERSION, 18) => Some((kind, u64_le(v.get(2..10)?)?, Some(u64_le(v.get(10..18)?)?))),
        _ => None,
    }
}

/// The stored key of string `k` while it has an expiry.
pub fn expiring_key(k: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(k.len() + 2);
    v.extend_from_slice(&[META, T_EXPIRING]);
    v.extend_from_slice(k);
    v
}

/// Range of expiring strings.
pub fn expiring_range() -> (Vec<u8>, Vec<u8>) {
    (vec![META, T_EXPIRING], vec![META, T_EXPIRING + 1])
}

/// Encode an expiring string's record.
pub fn encode_expiring(expire_at: u64, value: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(value.len() + 9);
    v.push(VERSION);
    v.extend_from_slice(&expire_at.to_le_bytes());
    v.extend_from_slice(value);
    v
}

/// Decode an expiring string's record: (expire-at ms, value). `None`: malformed.
pub fn decode_expiring(v: &[u8]) -> Option<(u64, &[u8])> {
    if *v.first()? != VERSION {
        return None;
    }
    Some((u64_le(v.get(1..9)?)?, v.get(9..)?))
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
        assert_eq!(decode_type(&encode_type(Kind::Zset, 7, None)), Some((Kind::Zset, 7, None)));
        assert_eq!(decode_type(&encode_type(Kind::Hash, 3, Some(99))), Some((Kind::Hash, 3, Some(99))));
        assert_eq!(decode_type(b"\x01\x03\0\0\0\0\0\0\0\0"), None);
        assert_eq!(decode_type(b"\x02\x01\0\0\0\0\0\0\0\0"), None, "version 2 without its expiry");
        assert_eq!(decode_type(b"\x03\x01\0\0\0\0\0\0\0\0"), None, "unknown version");
        assert_eq!(decode_type(b""), None);
        assert_eq!(decode_type(b"\x01"), None);
        assert_eq!(decode_expiring(&encode_expiring(5, b"v")), Some((5, &b"v"[..])));
        assert_eq!(decode_expiring(&encode_expiring(5, b"")), Some((5, &b""[..])));
        for bad in [&b""[..], b"\x02", b"\x02\0\0\0\0\0\0\0", b"\x01\0\0\0\0\0\0\0\0v"] {
            assert_eq!(decode_expiring(bad), None, "{bad:?}");
        }
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
        assert_eq!(hex(&encode_type(Kind::Hash, 2, None)), "01010200000000000000");
        assert_eq!(hex(&encode_type(Kind::Zset, 1, None)), "01020100000000000000");
        // Version 2: with an expiry (2026-01-01T00:00:00Z = 1767225600000 ms).
        assert_eq!(hex(&encode_type(Kind::Hash, 2, Some(1_767_225_600_000))), "0201020000000000000000a8da769b010000");
        assert_eq!(hex(&expiring_key(b"k")), "ff786b");
        assert_eq!(hex(&encode_expiring(1_767_225_600_000, b"v")), "0200a8da769b01000076");
        assert_eq!(hex(&hash_field(b"h", b"f")), "ff68000000016866");
        assert_eq!(hex(&zmember(b"z", b"m")), "ff7a000000017a6d");
        assert_eq!(hex(&1.5f64.to_bits().to_le_bytes()), "000000000000f83f");
        assert_eq!(hex(&zscore(b"z", 1.5, b"m")), "ff6f000000017abff80000000000006d");
        assert_eq!(hex(&zscore(b"z", -1.5, b"m")), "ff6f000000017a4007ffffffffffff6d");
    }
}
