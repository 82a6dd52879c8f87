//! HoaKV's layouts: the superblock, vTable headers, sealed words (directory entries, slot
//! selectors), hot record halves, cold value-log records, LSM values (inline or pointer) and
//! the `GROUPS` file.
//!
//! Two halves per input. The raw bytes are decoded by every decoder: no panic, no
//! allocation the bytes cannot hold, and whatever decodes must round-trip. Then a *valid*
//! encoding of each layout is built from the input (so the fuzzer gets past the checksums)
//! and one byte of it is flipped at an input-chosen place: a flip inside a checksummed
//! region whose extent the flip cannot move must be detected.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tierkv::engine::hoakv::layout as h;

fn raw(data: &[u8]) {
    let _ = h::decode_superblock(data);
    let _ = h::decode_vtable_header(data);
    if data.len() >= 8 {
        let w = u64::from_le_bytes(data[..8].try_into().unwrap_or([0; 8]));
        if let Ok(Some(v)) = h::open_word(w) {
            assert_eq!(h::seal_word(v), w, "an opened word re-seals to itself");
        }
    }
    if let Some(r) = h::decode_hot(data) {
        let again = h::encode_hot(r.seq, r.key, r.value);
        assert_eq!(h::decode_hot(&again), Some(r), "a decoded hot record round-trips");
    }
    if let Ok((k, v)) = h::decode_vlog(data) {
        let again = h::encode_vlog(k, v);
        assert_eq!(&data[..again.len()], &again[..], "a decoded value-log record re-encodes to its bytes");
    }
    match h::decode_cold(data) {
        Ok(h::ColdValue::Inline(v)) => assert_eq!(h::encode_inline(&v), data),
        Ok(h::ColdValue::Pointer(p)) => assert_eq!(h::encode_pointer(p), data),
        Err(_) => {}
    }
    if let Ok(g) = h::decode_groups(data) {
        assert_eq!(h::encode_groups(&g), data, "a decoded GROUPS file re-encodes to its bytes");
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
    let flip = |b: &[u8], at: usize| {
        let mut b = b.to_vec();
        let i = at % b.len().max(1);
        if let Some(x) = b.get_mut(i) {
            *x ^= mask;
        }
        (b, i)
    };
    let num = |i: usize| rest.get(i..i + 8).map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])));
    // Superblock and vTable header: every byte of the first 64 is covered or is the crc.
    let sb = h::encode_superblock(4096 + (num(0) % 1024) * 64, (num(8) % 65_535) as u32 + 1);
    assert!(h::decode_superblock(&sb).is_ok());
    let (bad, _) = flip(&sb, at);
    assert!(h::decode_superblock(&bad).is_err(), "superblock flip undetected");
    let vt = h::encode_vtable_header(num(16) as u32, 64 * (1 + (num(24) % 1024) as u32));
    assert!(h::decode_vtable_header(&vt).is_ok());
    let (bad, _) = flip(&vt, at);
    assert!(h::decode_vtable_header(&bad).is_err(), "vTable header flip undetected");
    // Sealed words: any damaged byte makes the word neither 0 nor valid.
    let w = h::seal_word(num(32) & ((1 << 48) - 1));
    let (bad, _) = flip(&w.to_le_bytes(), at);
    let bw = u64::from_le_bytes(bad.try_into().unwrap_or([0; 8]));
    assert!(h::open_word(bw).is_err(), "sealed word flip undetected");
    // A hot record half (with slack after it, as in a slot) and a value-log record built
    // from the input; flips outside the length fields keep the covered extent.
    let split = rest.len() / 3;
    let (key, value) = rest.split_at(split.min(u16::MAX as usize));
    let seq = num(40);
    let tomb = data[2] & 0x80 != 0;
    let rec = h::encode_hot(seq, key, (!tomb).then_some(value));
    let mut half = rec.clone();
    half.resize(h::class_for(rec.len()) as usize, 0);
    let got = h::decode_hot(&half).expect("a fresh hot record decodes");
    assert_eq!((got.seq, got.key, got.value), (seq, key, (!tomb).then_some(value)));
    let (bad, i) = flip(&rec, at);
    if !(6..12).contains(&i) {
        assert!(h::decode_hot(&bad).is_none(), "hot record flip at {i} undetected");
    }
    let vl = h::encode_vlog(key, value);
    assert_eq!(h::decode_vlog(&vl), Ok((key, value)));
    let (bad, i) = flip(&vl, at);
    if !(4..10).contains(&i) {
        assert!(h::decode_vlog(&bad).is_err(), "value-log flip at {i} undetected");
    }
    // GROUPS: groups cut from the input at sorted boundaries.
    let mut los: Vec<Vec<u8>> = key.chunks(3).map(<[u8]>::to_vec).collect();
    los.push(Vec::new());
    los.sort();
    los.dedup();
    let g = h::GroupsRec {
        next_gid: los.len() as u32,
        next_file: seq,
        groups: los
            .into_iter()
            .enumerate()
            .map(|(i, lo)| h::GroupRec { gid: i as u32, lo, files: vec![i as u64, seq ^ i as u64] })
            .collect(),
    };
    let enc = h::encode_groups(&g);
    assert_eq!(h::decode_groups(&enc).as_ref(), Ok(&g));
    let (bad, i) = flip(&enc, at);
    assert!(h::decode_groups(&bad).is_err(), "GROUPS flip at {i} undetected");
});
