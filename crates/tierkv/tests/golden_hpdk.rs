//! Golden bytes of HPDK's persistent layouts (docs/format/hpdk.md): a change to any of them
//! is a format change and must bump a version.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::hex;
use tierkv::engine::hpdk::layout::*;

#[test]
fn hpdk_layouts_have_stable_bytes() {
    let got = [
        ("superblock", hex(&encode_superblock(128 << 20))),
        ("vslot", hex(&encode_vslot(&VSlot { no: 3, gen: 7, addr: 0x1_0000_0040, cap: 1 << 20 }))),
        ("tslot", hex(&encode_tslot(&TSlot { slot: 5, number: 42, addr: 0x40_0000, size: 4096 }))),
        ("record", {
            let mut b = Vec::new();
            encode_record(7, b"value", &mut b);
            hex(&b)
        }),
        ("wal", hex(&encode_wal(&[(b"k1", Some(vaddr(3, 0x100))), (b"k2", None)]))),
        (
            "dump",
            hex(&encode_dump(&Dump {
                covered: 9,
                tables: vec![4, 9],
                pools: vec![(0, 1, 200, 3)],
                entries: vec![(b"a".to_vec(), vaddr(0, 16), 4), (b"b".to_vec(), vaddr(0, 40), 9)],
            })),
        ),
        ("merge", hex(&encode_merge_log(&[2, 3], 11))),
    ];
    for (name, h) in &got {
        println!("{name} {h}");
    }
    let want = include_str!("golden_hpdk.txt");
    let want: Vec<(&str, &str)> = want.lines().filter_map(|l| l.split_once(' ')).collect();
    assert_eq!(want.len(), got.len());
    for ((wn, wh), (gn, gh)) in want.iter().zip(got.iter()) {
        assert_eq!(wn, gn);
        assert_eq!(wh, gh, "{gn} bytes changed");
    }
    // The decoders read back what the encoders wrote.
    assert_eq!(decode_superblock(&encode_superblock(128 << 20)), Ok(128 << 20));
    let d = Dump { covered: 1, tables: vec![1], pools: vec![], entries: vec![(b"k".to_vec(), 5, 1)] };
    assert_eq!(decode_dump(&encode_dump(&d)), Ok(d));
    assert_eq!(decode_merge_log(&encode_merge_log(&[2, 3], 11)), Ok((vec![2, 3], 11)));
    let rec = encode_wal(&[(b"k1", Some(9)), (b"k2", None)]);
    assert_eq!(decode_wal_payload(&rec[8..]), Some(vec![(b"k1".to_vec(), Some(9)), (b"k2".to_vec(), None)]));
    // A flipped byte is caught by every checksum.
    let mut b = encode_dump(&Dump::default());
    b[10] ^= 1;
    assert!(decode_dump(&b).is_err());
    let mut s = encode_vslot(&VSlot { no: 0, gen: 1, addr: 64, cap: 64 });
    s[9] ^= 1;
    assert_eq!(decode_slot(&s, 0), Slot::Free, "a torn or damaged slot never names an extent");
}
