//! HPDK's persistent records on arbitrary bytes: WAL, B+-tree recovery file, merge log,
//! directory slots, superblock. Decoded records re-encode to the same bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tierkv::engine::hpdk::layout::*;

fuzz_target!(|data: &[u8]| {
    if let Ok(recs) = decode_wal(data) {
        for ops in recs {
            let ops: Vec<(&[u8], Option<u64>)> = ops.iter().map(|(k, a)| (k.as_slice(), *a)).collect();
            let _ = encode_wal(&ops);
        }
    }
    if let Ok(d) = decode_dump(data) {
        assert_eq!(encode_dump(&d), data, "a recovery file decodes and re-encodes to itself");
    }
    if let Ok((ins, out)) = decode_merge_log(data) {
        assert_eq!(encode_merge_log(&ins, out), data);
    }
    let _ = decode_superblock(data);
    for (i, c) in data.chunks(32).enumerate() {
        let _ = decode_slot(c, i as u16);
    }
});
