//! `native`'s layouts: the superblock, segment headers, seal words, records and entries, the
//! clean-close record and the index checkpoint file.
//!
//! Two halves per input. The raw bytes are decoded by every decoder: no panic, no
//! allocation the bytes cannot hold, and whatever decodes re-encodes to something that
//! decodes to the same value. Then *valid* encodings are built from the input (so the
//! fuzzer gets past the checksums) and one byte of each is flipped at an input-chosen
//! place: a flip in a byte the checksums cover must be detected.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tierkv::engine::native::checkpoint as c;
use tierkv::engine::native::layout as l;

fn num(b: &[u8], i: usize) -> u64 {
    b.get(i..i + 8).map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])))
}

fn raw(data: &[u8]) {
    if let Ok(sb) = l::Superblock::decode(data) {
        assert_eq!(l::Superblock::decode(&sb.encode()), Ok(sb), "a decoded superblock round-trips");
    }
    if let Ok(Some(h)) = l::SegHeader::decode(data) {
        assert_eq!(l::SegHeader::decode(&h.encode()), Ok(Some(h)), "a decoded segment header round-trips");
    }
    let gen = num(data, 0);
    if let Ok(Some(len)) = l::decode_seal(gen, num(data, 8)) {
        assert_eq!(l::decode_seal(gen, l::seal_word(gen, len)), Ok(Some(len)));
    }
    let tag = l::SegTag { gen: gen & 0xffff, salt: num(data, 8) as u32 };
    let mut entries = Vec::new();
    if let Ok((len, seq)) = l::decode_record(data, tag, |e| entries.push((e.kind, e.key.to_vec(), e.value.to_vec()))) {
        assert!(len <= data.len());
        let ins: Vec<l::EntryIn<'_>> =
            entries.iter().map(|(kind, key, value)| l::EntryIn { kind: *kind, key, value }).collect();
        let again = l::encode_record(tag, seq, &ins);
        assert_eq!(again.len(), len, "a decoded record re-encodes to its length");
        let mut back = Vec::new();
        let r = l::decode_record(&again, tag, |e| back.push((e.kind, e.key.to_vec(), e.value.to_vec())));
        assert_eq!(r, Ok((len, seq)));
        assert_eq!(back, entries, "a decoded record round-trips");
    }
    let _ = l::parse_entry(data, gen);
    let _ = l::decode_entry(data, 0, gen);
    let shards = usize::from(data.first().copied().unwrap_or(0) % 8) + 1;
    if let Some(cl) = l::Clean::decode(data, shards) {
        assert_eq!(l::Clean::decode(&cl.encode(), shards), Some(cl));
    }
    if let Ok(d) = c::decode(data, shards, num(data, 16)) {
        let mut again = d.header.encode();
        let mut body = Vec::new();
        for e in &d.entries {
            c::encode_entry(&mut body, e.0, e.1, e.2, e.3, e.4);
        }
        again.extend_from_slice(&body);
        again.extend_from_slice(&c::encode_trailer(d.entries.len() as u64, crc32c::crc32c(&body)));
        let back = c::decode(&again, shards, d.header.db_id).expect("a re-encoded checkpoint decodes");
        assert_eq!((back.header, back.entries), (d.header, d.entries), "a decoded checkpoint round-trips");
    }
}

fuzz_target!(|data: &[u8]| {
    raw(data);
    if data.len() < 4 {
        return;
    }
    let at = usize::from(u16::from_le_bytes([data[0], data[1]]));
    let mask = data[2] | 1;
    let rest = &data[3..];
    let flip = |b: &[u8]| {
        let mut b = b.to_vec();
        let i = at % b.len().max(1);
        if let Some(x) = b.get_mut(i) {
            *x ^= mask;
        }
        (b, i)
    };
    // A record of up to three entries cut from the input.
    let tag = l::SegTag { gen: num(rest, 0) & 0xffff_ffff, salt: num(rest, 8) as u32 };
    let seq = num(rest, 16) >> 8;
    let body = rest.get(24..).unwrap_or(&[]);
    let kinds = [l::Kind::Put, l::Kind::Delete, l::Kind::Moved];
    let ins: Vec<l::EntryIn<'_>> = body
        .chunks(body.len().div_ceil(3).max(1))
        .take(3)
        .enumerate()
        .map(|(i, ch)| {
            let kind = kinds[usize::from(rest.get(i).copied().unwrap_or(0)) % 3];
            let (key, value) = ch.split_at((ch.len() / 2).min(u16::MAX as usize));
            l::EntryIn { kind, key, value: if kind == l::Kind::Put { value } else { &[] } }
        })
        .collect();
    if !ins.is_empty() {
        let rec = l::encode_record(tag, seq, &ins);
        let mut n = 0;
        assert!(l::decode_record(&rec, tag, |_| n += 1).is_ok(), "a fresh record decodes");
        assert_eq!(n, ins.len());
        let (bad, i) = flip(&rec);
        // Trailing zero padding is not covered.
        let covered: usize = 24 + ins.iter().map(|e| l::entry_len(e.key.len(), e.value.len())).sum::<usize>();
        if i < covered {
            assert!(l::decode_record(&bad, tag, |_| {}).is_err(), "record flip at {i} undetected");
        }
    }
    // A checkpoint of the input's keys.
    let shards = usize::from(data[2] % 4) + 1;
    let mut keys: Vec<&[u8]> = body.chunks(5).collect();
    keys.sort();
    keys.dedup();
    let h = c::Header {
        db_id: num(rest, 0),
        horizon: seq,
        resume: (0..shards as u64)
            .map(|s| c::Resume { gen: s + 1, seg: (s % 2 == 0).then_some((tag.salt, s as u32 * 64)) })
            .collect(),
    };
    let mut file = h.encode();
    let mut ents = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        c::encode_entry(&mut ents, k, seq + i as u64, 4096 * i as u64, 30 + k.len() as u32, i % 3 == 0);
    }
    file.extend_from_slice(&ents);
    file.extend_from_slice(&c::encode_trailer(keys.len() as u64, crc32c::crc32c(&ents)));
    let d = c::decode(&file, shards, h.db_id).expect("a fresh checkpoint decodes");
    assert_eq!(d.entries.len(), keys.len());
    let (bad, i) = flip(&file);
    let hl = c::Header::encoded_len(shards);
    let padding = (hl - 4..hl).contains(&i) || (file.len() - 12..file.len() - 8).contains(&i);
    if !padding {
        assert!(c::decode(&bad, shards, h.db_id).is_err(), "checkpoint flip at {i} undetected");
    }
});
