//! Reading a segment's records back: at open, in `check`, and in salvage.
//!
//! Appends to a shard's log are sequential: a writer starts a record only after the
//! previous one is persisted (its fence returned), and it writes nothing else into the
//! segment. So after a crash the only bad record a log can hold is the last one of its
//! newest (unsealed) segment, and nothing intact can follow it: records of an earlier life
//! of a reused slot carry another generation or salt and do not verify, and neither does a
//! record that a value happens to contain (it cannot know the segment's random salt).
//! Hence:
//! - in a segment whose end is known (sealed, or named by the clean-close record), every
//!   record up to that end must verify: any other outcome is **damage**;
//! - in the newest unsealed segment after a crash, the first bad record ends the log. It is
//!   a **torn tail** (dropped and reported) unless an intact record follows it somewhere in
//!   the segment, which only damage can produce.

use super::layout::{claimed_len, decode_record, EntryOut, SegTag, RECORD_HEADER_LEN};

/// How a scan ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum End {
    /// At the known end, or (unknown end) at bytes that hold no record at all.
    Complete,
    /// At the remains of an interrupted append (unknown end only).
    Torn,
    /// At a record that fails its checks where a crash leaves none.
    Damaged(String),
}

/// Scan the records of `data` (a segment's record area, segment `tag`) from offset
/// `start`, up to `limit` when the end is known. `f` gets each intact record's offset and
/// its entries. Returns where the intact records end and how the scan ended.
pub(crate) fn scan<'a>(
    data: &'a [u8],
    start: usize,
    tag: SegTag,
    limit: Option<usize>,
    f: &mut dyn FnMut(usize, EntryOut<'a>),
) -> (usize, End) {
    let end = match limit {
        Some(l) if l > data.len() => {
            return (
                start,
                End::Damaged(format!("the segment's recorded end {l} lies beyond its {} bytes", data.len())),
            )
        }
        Some(l) => l,
        None => data.len(),
    };
    let mut pos = start;
    while pos < end {
        let Some(rest) = data.get(pos..end) else { break };
        let r = decode_record(rest, tag, |e| f(pos, e));
        match r {
            Ok((len, _)) => pos += len,
            Err(detail) => {
                if limit.is_some() {
                    return (pos, End::Damaged(detail));
                }
                if intact_after(data, pos, tag).is_some() {
                    return (pos, End::Damaged(format!("{detail}, and intact records follow it")));
                }
                let untouched =
                    rest.iter().take(RECORD_HEADER_LEN).all(|&b| b == 0) && claimed_len(rest, tag.gen).is_none();
                return (pos, if untouched { End::Complete } else { End::Torn });
            }
        }
    }
    if pos != end {
        return (pos, End::Damaged(format!("records end at {pos}, but the segment's recorded end is {end}")));
    }
    (pos, End::Complete)
}

/// The offset of the first intact record of segment `tag` after `from`, if any.
pub(crate) fn intact_after(data: &[u8], from: usize, tag: SegTag) -> Option<usize> {
    let mut p = from + 8;
    while p + RECORD_HEADER_LEN <= data.len() {
        if let Some(rest) = data.get(p..) {
            if claimed_len(rest, tag.gen).is_some() && decode_record(rest, tag, |_| {}).is_ok() {
                return Some(p);
            }
        }
        p += 8;
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::layout::{encode_record, EntryIn, Kind};

    const T: SegTag = SegTag { gen: 1, salt: 99 };
    use super::*;

    fn seg(records: &[Vec<u8>], size: usize) -> Vec<u8> {
        let mut d: Vec<u8> = records.concat();
        d.resize(size, 0);
        d
    }

    fn rec(seq: u64, v: &[u8]) -> Vec<u8> {
        encode_record(T, seq, &[EntryIn { kind: Kind::Put, key: b"k", value: v }])
    }

    #[test]
    fn torn_tail_damage_and_known_ends_are_told_apart() {
        let (a, b, c) = (rec(1, b"one"), rec(2, b"two"), rec(3, b"three"));
        let ab = a.len() + b.len();
        let good = seg(&[a.clone(), b.clone(), c.clone()], 512);
        let mut n = 0;
        assert_eq!(scan(&good, 0, T, None, &mut |_, _| n += 1), (ab + c.len(), End::Complete));
        assert_eq!(n, 3);
        // The last record torn: dropped, reported as torn.
        let mut torn = good.clone();
        torn[ab + 30] ^= 1;
        assert_eq!(scan(&torn, 0, T, None, &mut |_, _| {}), (ab, End::Torn));
        // The middle record damaged while the last is intact: damage.
        let mut mid = good.clone();
        mid[a.len() + 30] ^= 1;
        assert!(matches!(scan(&mid, 0, T, None, &mut |_, _| {}).1, End::Damaged(_)));
        // A known end: the torn-looking last record is damage too.
        assert!(matches!(scan(&torn, 0, T, Some(ab + c.len()), &mut |_, _| {}).1, End::Damaged(_)));
        // A known end that disagrees with the records.
        assert!(matches!(scan(&good, 0, T, Some(ab + 8), &mut |_, _| {}).1, End::Damaged(_)));
        assert_eq!(scan(&good, 0, T, Some(ab), &mut |_, _| {}), (ab, End::Complete));
        // Salvage resynchronises after damage.
        assert_eq!(intact_after(&mid, a.len(), T), Some(ab));
        // A torn last write whose value holds an encoded record (of this very segment's
        // generation, without its salt) is still a torn tail, not damage.
        let inner = encode_record(SegTag { salt: 0, ..T }, 9, &[EntryIn { kind: Kind::Put, key: b"x", value: b"y" }]);
        let mut val = vec![0u8; 16];
        val.extend_from_slice(&inner);
        let mut last = rec(4, &val);
        last[0] ^= 1;
        let with_fake = seg(&[a.clone(), last], 512);
        assert_eq!(scan(&with_fake, 0, T, None, &mut |_, _| {}), (a.len(), End::Torn));
    }
}
