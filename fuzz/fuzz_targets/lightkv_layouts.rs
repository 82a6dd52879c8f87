//! LightKV's PM layouts on arbitrary bytes: write-buffer segments (header, record scan, entry
//! decode), PM leaves, chain records, the clean-shutdown image and the superblock. Decoding
//! must never panic or allocate what the bytes cannot hold; what decodes must round-trip.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tierkv::engine::lightkv::{leaf, pwb, store};

fuzz_target!(|data: &[u8]| {
    let id = data.first().map_or(0, |&b| u64::from(b));
    let _ = pwb::decode_header(data);
    let _ = pwb::decode_entry(data);
    if let Ok((recs, end)) = pwb::scan(data, id) {
        assert!(end <= data.len().max(pwb::HEADER_LEN));
        for r in recs {
            assert!(!r.entries.is_empty());
        }
    }
    if let Ok((l, meta)) = leaf::decode_leaf(data) {
        // Header padding is not checked, so compare decoded values, not bytes.
        let again = leaf::encode_leaf(&l, l.normal(), meta);
        assert_eq!(leaf::decode_leaf(&again).ok(), Some((l, meta)), "a decoded leaf round-trips");
    }
    if let Ok((c, len)) = leaf::decode_chain(data) {
        assert_eq!(&data[..len], &leaf::encode_chain(&c)[..], "a decoded chain re-encodes to its bytes");
    }
    if let Ok(img) = leaf::decode_image(data) {
        let again = leaf::encode_image(&img);
        assert_eq!(leaf::decode_image(&again).ok(), Some(img));
    }
    let _ = leaf::image_len(data);
    let _ = leaf::leaf_len(data);
    let _ = store::decode_superblock(data);
});
