//! Inputs the fuzz targets (fuzz/) found crashing, kept as named regression tests.
#![allow(clippy::unwrap_used)]

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// pm_layouts, 2026-11-23: a KeyNode whose checksum verifies but whose entry count is
/// 2^31-ish made `keynode_decode` allocate 34 GB (out of memory abort). Now: an error.
#[test]
fn pm_layouts_keynode_with_a_huge_checksummed_count() {
    let input = unhex(HEX_KEYNODE);
    let e = tierkv::engine::pmekv::layout::keynode_decode(&input).unwrap_err();
    assert!(e.contains("claims"), "{e}");
}

const HEX_KEYNODE: &str = "4b4e4f444229d950540000400f0000000200000000db00000000000500000dff01000039c6c63ac6c60000000000000200003500ffffffff00690000003fc6";
