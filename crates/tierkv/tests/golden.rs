//! Golden bytes: every persistent structure's encoding is pinned here, byte for byte, and
//! the same bytes appear in docs/format/*.md. A change to an encoder fails this test; fix
//! it by bumping the structure's format version and updating the doc, never by editing the
//! expected bytes alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{hex, zeros};
use tierkv::engine::pmekv::layout::*;
use tierkv::options_file::{OptionsRecord, RecordState};
use tierkv::Preset;

#[test]
fn pm_pool_header() {
    let h = tierkv::pm::encode_pool_header(3, 1 << 20, 0x1122_3344_5566_7788);
    let want = "544b56504f4f4c00".to_string() // magic "TKVPOOL\0"
        + "01000000" // version 1
        + "03000000" // pool index
        + "0000100000000000" // pool size 1 MiB
        + "8877665544332211" // store id
        + "8812e358" // crc
        + &zeros(28);
    assert_eq!(hex(&h), want);
}

#[test]
fn pmekv_superblock() {
    let sb = Superblock::new(256 << 10, 512 << 10);
    let b = sb.encode();
    let want = "544b56504d454b56".to_string() // magic "TKVPMEKV"
        + "01000000" // format version 1
        + "05000000" // preset id 5 = pmekv
        + "0010000000000000" // kv log offset 0x1000
        + "0000040000000000" // kv log length 256 KiB
        + "0010040000000000" // key log offset 0x41000
        + "0000080000000000" // key log length 512 KiB
        + "00100c0000000000" // heap start 0xc1000
        + "539ced43" // crc
        + "00000000";
    assert_eq!(hex(&b), want);
    assert_eq!(Superblock::decode(&b), Ok(sb));
}

#[test]
fn pmekv_checkpoint_record() {
    let c = Checkpoint { generation: 7, seq: 42, dir_addr: 0x11000, dir_bytes: 64, kn_count: 2, key_count: 5 };
    let b = c.encode();
    let want = "434b5054".to_string() // "CKPT"
        + "0089ba6b" // crc of bytes 8..64
        + "0700000000000000" // generation
        + "2a00000000000000" // seq 42
        + "0010010000000000" // directory address
        + "4000000000000000" // directory bytes
        + "0200000000000000" // KeyNodes
        + "0500000000000000" // keys
        + &zeros(8);
    assert_eq!(hex(&b), want);
    assert_eq!(Checkpoint::decode(&b), Some(c));
}

#[test]
fn pmekv_value_record() {
    let h = value_header(b"key", b"value");
    assert_eq!(hex(&h), "57e8e98c".to_string() + "05000000");
    let mut rec = h.to_vec();
    rec.extend_from_slice(b"value");
    assert_eq!(value_verify(&rec, b"key", 5), Ok(&b"value"[..]));
    assert!(value_verify(&rec, b"kez", 5).is_err(), "the checksum binds the value to its key");
    assert_eq!(value_alloc_size(5), 64);
}

#[test]
fn pmekv_log_entries() {
    let e = LogEntry {
        seq: 9,
        op: Op::Update,
        value_addr: 0x12340,
        value_len: 5,
        batch_len: 2,
        batch_index: 1,
        key: b"key".to_vec(),
    };
    let tail = "03000000".to_string() // key length
        + "0900000000000000" // seq
        + "4023010000000000" // value address
        + "05000000" // value length
        + "02000000" // batch length
        + "01000000" // index in batch
        + "03000000" // op 3 = update, 3 bytes padding
        + "6b6579" // "key"
        + &zeros(13);
    let kv = e.encode(LogKind::KeyValue);
    assert_eq!(hex(&kv), "0300000000000000".to_string() + "e8c7ede2" + &tail);
    let key = e.encode(LogKind::Key);
    assert_eq!(hex(&key), "0300000000000000".to_string() + "2005f575" + &tail);
    assert_eq!(LogEntry::decode(&kv, LogKind::KeyValue), Some((e.clone(), 3)));
    assert_eq!(LogEntry::decode(&kv, LogKind::Key), None, "the tiers cannot be confused");
    // Clearing the flag word (KVFlag/KFlag := 0) keeps the entry valid.
    let mut cleared = kv.clone();
    cleared[0] = 0;
    assert_eq!(LogEntry::decode(&cleared, LogKind::KeyValue), Some((e, 0)));
}

#[test]
fn pmekv_keynode_and_directory() {
    let entries = [(&b"a"[..], ValueRef { addr: 0x20000, len: 3 }), (&b"bc"[..], ValueRef { addr: 0x20040, len: 0 })];
    let kn = keynode_encode(entries.into_iter(), 2);
    let want = "4b4e4f44".to_string() // "KNOD"
        + "c563feb8" // crc of bytes 8..47
        + "02000000" // count
        + "2f000000" // length 47
        + "0100" + "61" + "0000020000000000" + "03000000" // "a" -> 0x20000, 3 bytes
        + "0200" + "6263" + "4000020000000000" + "00000000" // "bc" -> 0x20040, 0 bytes
        + &zeros(17);
    assert_eq!(hex(&kn), want);
    let decoded = keynode_decode(&kn).unwrap();
    assert_eq!(decoded.len(), 2);
    assert_eq!(&*decoded[1].0, b"bc");

    let dir = dir_encode(&[(0x30000, 64), (0x30040, 128)]);
    let want = "4b444952".to_string() // "KDIR"
        + "0c93fde0" // crc
        + "0200000000000000" // count
        + "0000030000000000" + "40000000" + "00000000"
        + "4000030000000000" + "80000000" + "00000000"
        + &zeros(16);
    assert_eq!(hex(&dir), want);
    assert_eq!(dir_decode(&dir, 2), Ok(vec![(0x30000, 64), (0x30040, 128)]));
    assert!(dir_decode(&dir, 3).is_err());
}

#[test]
fn options_record() {
    let r = OptionsRecord { preset: Preset::Pmekv, db_id: 0x0102_0304_0506_0708, state: RecordState::Ready };
    let b = r.encode();
    let want = "544945524b564442".to_string() // "TIERKVDB"
        + "01000000" // version
        + "05000000" // preset id 5
        + "0807060504030201" // store id
        + "02000000" // state 2 = ready
        + "55b7d89a"; // crc
    assert_eq!(hex(&b), want);
    assert_eq!(OptionsRecord::decode(&b), Ok(r));
}

/// HoaKV's layouts (docs/format/hoakv.md); crcs computed independently (Python crc32c).
#[test]
fn hoakv_layouts() {
    use tierkv::engine::hoakv::layout as h;
    assert_eq!(
        hex(&h::encode_hot(9, b"key", Some(b"value"))),
        "65b3a19a".to_string() // crc
            + "01" // kind put
            + "00"
            + "0300" // klen
            + "05000000" // vlen
            + "00000000"
            + "0900000000000000" // seq 9
            + "6b6579" // key
            + "76616c7565" // value
    );
    assert_eq!(
        hex(&h::encode_superblock(2 << 20, 96)),
        "544b56484f414b01".to_string() // magic "TKVHOAK\x01"
            + "01000000" // version 1
            + "0000200000000000" // vTable size 2 MiB
            + "60000000" // 96 directory slots
            + &zeros(36)
            + "98ebf5b6" // crc
    );
    assert_eq!(
        hex(&h::encode_vtable_header(5, 1152)),
        "544b565654414201".to_string() // magic "TKVVTAB\x01"
            + "05000000" // directory slot 5
            + "80040000" // class 1152
            + &zeros(44)
            + "d6bfa8fa" // crc
    );
    assert_eq!(h::seal_word(0x1c0), 0xff1b_0000_0000_01c0);
    assert_eq!(h::open_word(0xff1b_0000_0000_01c0), Ok(Some(0x1c0)));
    assert!(h::open_word(0xff1b_0000_0000_01c1).is_err());
    assert_eq!(hex(&h::encode_vlog(b"k", b"vv")), "30bf244b0100020000006b7676");
    let p = h::Pointer { file: 3, offset: 8, len: 13 };
    assert_eq!(hex(&h::encode_pointer(p)), "01".to_string() + "0300000000000000" + "0800000000000000" + "0d000000");
    assert_eq!(hex(&h::encode_inline(b"x")), "0078");
    let g = h::GroupsRec {
        next_gid: 3,
        next_file: 9,
        groups: vec![
            h::GroupRec { gid: 0, lo: vec![], files: vec![4, 1] },
            h::GroupRec { gid: 2, lo: b"m".to_vec(), files: vec![7] },
        ],
    };
    assert_eq!(
        hex(&h::encode_groups(&g)),
        "544b564752505301".to_string() // magic "TKVGRPS\x01"
            + "03000000" // next gid
            + "0900000000000000" // next file
            + "02000000" // 2 groups
            + "00000000" + "00000000" + "02000000" + "0400000000000000" + "0100000000000000" // gid 0, lo "", files 4, 1
            + "02000000" + "01000000" + "6d" + "01000000" + "0700000000000000" // gid 2, lo "m", file 7
            + "d609e9df" // crc
    );
}

#[test]
fn native_layouts() {
    use tierkv::engine::native::layout::{
        decode_seal, encode_record, seal_word, Clean, EntryIn, Kind, SegHeader, SegTag, Superblock, Tail,
    };
    let id = 0x1122_3344_5566_7788;
    let sb = Superblock { shards: 4, stride: 0x3fc0, slots_per_pool: 64, db_id: id };
    let want = "544b564e41545600".to_string() // magic "TKVNATV\0"
        + "03000000" // format version 3
        + "04000000" // shards
        + "c03f000000000000" // stride
        + "40000000" // slots per pool
        + "00000000"
        + "8877665544332211" // store id
        + "c1c8711d" // crc
        + &zeros(20);
    assert_eq!(hex(&sb.encode()), want);
    assert_eq!(Superblock::decode(&sb.encode()), Ok(sb));

    let h = SegHeader { shard: 2, gen: 5, span: 1, salt: 0xa1b2_c3d4, db_id: id };
    let want = "544b564e53454700".to_string() // magic "TKVNSEG\0"
        + "03000000" // format version 3
        + "02000000" // shard
        + "0500000000000000" // generation
        + "8877665544332211" // store id
        + "01000000" // span
        + "d4c3b2a1" // salt
        + "dcf30698" // crc
        + &zeros(4)
        + &zeros(8) // seal word: open
        + &zeros(8);
    assert_eq!(hex(&h.encode()), want);
    assert_eq!(SegHeader::decode(&h.encode()), Ok(Some(h)));
    assert_eq!(seal_word(5, 4096), 0x3ad2_49c0_0000_1000);
    assert_eq!(decode_seal(5, 0x3ad2_49c0_0000_1000), Ok(Some(4096)));

    let entries = [
        EntryIn { kind: Kind::Put, key: b"alpha", value: b"one" },
        EntryIn { kind: Kind::Delete, key: b"beta", value: b"" },
    ];
    let want = "4cad2507".to_string() // record crc (salt 0xa1b2c3d4 mixed in)
        + "40000000" // length 64
        + "07000000" // generation
        + "02000000" // entries
        + "6400000000000000" // first sequence number 100
        + "deafcee2" + "03000000" + "0500" + "01" + "00" + "616c706861" + "6f6e65" // put alpha=one
        + "a9fe3a76" + "00000000" + "0400" + "02" + "00" + "62657461" // delete beta
        + "00000000"; // padding to 8
    let tag = SegTag { gen: 7, salt: 0xa1b2_c3d4 };
    assert_eq!(hex(&encode_record(tag, 100, &entries)), want);

    let c = Clean { next_seq: 42, tails: vec![Tail { gen: 3, len: 4096 }, Tail { gen: 0, len: 0 }] };
    let want = "544b564e434c4e00".to_string() // magic "TKVNCLN\0"
        + "02000000" // shards
        + "00000000"
        + "2a00000000000000" // next sequence number
        + "0300000000000000" + "00100000" + "00000000" // shard 0: generation 3, 4096 bytes
        + &zeros(16) // shard 1: no open segment
        + "1dcb994f" // crc
        + "00000000";
    assert_eq!(hex(&c.encode()), want);
    assert_eq!(Clean::decode(&c.encode(), 2), Some(c));

    // A moved entry (kind 3, no value) alone in its record.
    let moved = [EntryIn { kind: Kind::Moved, key: b"alpha", value: b"" }];
    let want = "d8a0d3c6".to_string() // record crc
        + "30000000" // length 48
        + "07000000" // generation
        + "01000000" // one entry
        + "6400000000000000" // its sequence number: the moved version's (100)
        + "2165e4ab" + "00000000" + "0500" + "03" + "00" + "616c706861" // moved alpha
        + "00000000000000"; // padding to 8
    assert_eq!(hex(&encode_record(tag, 100, &moved)), want);

    // A version-2 superblock is read as this version's; version 1 is refused.
    let with_version = |v: u32| {
        let mut b = sb.encode();
        b[8..12].copy_from_slice(&v.to_le_bytes());
        let c = tierkv::format::crc::masked(&b[0..40]);
        b[40..44].copy_from_slice(&c.to_le_bytes());
        b
    };
    assert_eq!(Superblock::decode(&with_version(2)), Ok(sb));
    assert!(Superblock::decode(&with_version(1)).is_err());
    assert!(Superblock::decode(&with_version(4)).is_err());
}

#[test]
fn native_index_checkpoint() {
    use tierkv::engine::native::checkpoint::{decode, encode_entry, encode_trailer, Header, Resume};
    let h = Header {
        db_id: 0x1122_3344_5566_7788,
        horizon: 42,
        resume: vec![Resume { gen: 3, seg: Some((0xa1b2_c3d4, 4096)) }, Resume { gen: 9, seg: None }],
    };
    let want_header = "544b564e434b5000".to_string() // magic "TKVNCKP\0"
        + "01000000" // format version 1
        + "02000000" // shards
        + "8877665544332211" // store id
        + "2a00000000000000" // horizon 42
        + "0300000000000000" + "00100000" + "d4c3b2a1" // shard 0: generation 3, byte 4096, salt
        + "0900000000000000" + "ffffffff" + "00000000" // shard 1: no open segment, next generation 9
        + "6db396dd" // crc
        + "00000000";
    let mut body = Vec::new();
    encode_entry(&mut body, b"alpha", 7, 0x10040, 40, false);
    encode_entry(&mut body, b"beta", 8, 0x10068, 28, true);
    let want_body = "05000000".to_string() // key length
        + "28000000" // entry size 40
        + "0700000000000000" // sequence number
        + "4000010000000000" // PM location
        + "00" // put
        + "616c706861" // "alpha"
        + "04000000" + "1c000000" + "0800000000000000" + "6800010000000000" + "01" + "62657461"; // delete "beta"
    let trailer = encode_trailer(2, crc32c::crc32c(&body));
    let want_trailer = "18e1c90d".to_string() // masked crc32c of the entries
        + "00000000"
        + "0200000000000000"; // entries
    let got = format!("{}|{}|{}", hex(&h.encode()), hex(&body), hex(&trailer));
    assert_eq!(got, format!("{want_header}|{want_body}|{want_trailer}"));
    let mut file = h.encode();
    file.extend_from_slice(&body);
    file.extend_from_slice(&trailer);
    let d = decode(&file, 2, 0x1122_3344_5566_7788).unwrap();
    assert_eq!(d.header, h);
    assert_eq!(
        d.entries,
        vec![(b"alpha".as_slice(), 7, 0x10040, 40, false), (b"beta".as_slice(), 8, 0x10068, 28, true)]
    );
}

/// A delta file of `native`'s incremental index checkpoints (docs/format/native.md, "Index
/// checkpoint delta").
#[test]
fn native_index_delta() {
    use tierkv::engine::native::checkpoint::{encode_entry_flags, encode_trailer, Resume};
    use tierkv::engine::native::delta::{decode, BaseId, Header, Point};
    let h = Header {
        db_id: 0x1122_3344_5566_7788,
        base: BaseId { horizon: 42, count: 1000, crc: 0x0dc9_e118 },
        from: Point {
            horizon: 42,
            resume: vec![Resume { gen: 3, seg: Some((0xa1b2_c3d4, 4096)) }, Resume { gen: 9, seg: None }],
        },
        to: Point {
            horizon: 50,
            resume: vec![Resume { gen: 4, seg: Some((0x0102_0304, 64)) }, Resume { gen: 9, seg: Some((0x55, 128)) }],
        },
    };
    let want_header = "544b564e444c5400".to_string() // magic "TKVNDLT\0"
        + "01000000" // format version 1
        + "02000000" // shards
        + "8877665544332211" // store id
        + "2a00000000000000" // the checkpoint's horizon 42
        + "e803000000000000" // its entry count 1000
        + "18e1c90d" // its entry checksum
        + "00000000"
        + "2a00000000000000" // from horizon 42
        + "3200000000000000" // to horizon 50
        + "0300000000000000" + "00100000" + "d4c3b2a1" // from, shard 0: generation 3, byte 4096, salt
        + "0900000000000000" + "ffffffff" + "00000000" // from, shard 1: no open segment, next generation 9
        + "0400000000000000" + "40000000" + "04030201" // to, shard 0: generation 4, byte 64
        + "0900000000000000" + "80000000" + "55000000" // to, shard 1: generation 9, byte 128
        + "d1a62cec" // crc
        + "00000000";
    let mut body = Vec::new();
    encode_entry_flags(&mut body, b"alpha", 43, 0x10040, 40, 0);
    encode_entry_flags(&mut body, b"beta", 44, 0x10068, 28, 1);
    encode_entry_flags(&mut body, b"gamma", 12, 0x20000, 17, 2);
    let want_body = "05000000".to_string() // key length
        + "28000000" // entry size 40
        + "2b00000000000000" // sequence number 43
        + "4000010000000000" // PM location
        + "00" // put
        + "616c706861" // "alpha"
        + "04000000" + "1c000000" + "2c00000000000000" + "6800010000000000" + "01" + "62657461" // delete "beta"
        + "05000000" + "11000000" + "0c00000000000000" + "0000020000000000" + "02" + "67616d6d61"; // "gamma" moved
    let trailer = encode_trailer(3, crc32c::crc32c(&body));
    let want_trailer = "8dba9fc2".to_string() // masked crc32c of the entries
        + "00000000"
        + "0300000000000000"; // entries
    let got = format!("{}|{}|{}", hex(&h.encode()), hex(&body), hex(&trailer));
    assert_eq!(got, format!("{want_header}|{want_body}|{want_trailer}"));
    let mut file = h.encode();
    file.extend_from_slice(&body);
    file.extend_from_slice(&trailer);
    let (header, entries) = decode(&file, 2, 0x1122_3344_5566_7788).unwrap();
    assert_eq!(header, h);
    assert_eq!(
        entries,
        vec![
            (b"alpha".as_slice(), 43, 0x10040, 40, 0),
            (b"beta".as_slice(), 44, 0x10068, 28, 1),
            (b"gamma".as_slice(), 12, 0x20000, 17, 2)
        ]
    );
}
