//! Golden bytes of the SSTable format, the MANIFEST record and every SLM-DB PM structure.
//! The same bytes appear in docs/format/{sstable,manifest,slmdb}.md; change an encoder only
//! together with its format version and its document.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{hex, zeros};
use std::path::Path;

use tierkv::engine::slmdb::{complog, layout, memtable};
use tierkv::fs::{FaultFs, Fs};
use tierkv::index::pbtree;
use tierkv::manifest::{self, Edit, FileMeta};
use tierkv::sstable::{self, Handle, Kind, Table, TableBuilder};

#[test]
fn sstable_file() {
    let fs = FaultFs::new();
    fs.create_dir_all(Path::new("/d")).unwrap();
    let mut b = TableBuilder::create(&fs, Path::new("/d/t.sst"), 256, 10).unwrap();
    b.add(Kind::Put, b"ab", b"xyz").unwrap();
    b.add(Kind::Delete, b"b", b"").unwrap();
    let meta = b.finish().unwrap();
    let want = String::new()
        // data block 0 (offset 0, 24 bytes)
        + "00" + "0200" + "03000000" + "6162" + "78797a" // put "ab" = "xyz"
        + "01" + "0100" + "00000000" + "62" // delete "b"
        + "2ff6d93d" // crc of the block
        // index block (offset 24, 19 bytes): last key "b" -> block at 0, 24 bytes
        + "0100" + "62" + "0000000000000000" + "18000000" + "c56b972b"
        // filter block (offset 43, 13 bytes): k = 6, 64 bits
        + "06" + "1204091080a00801" + "d2c43b46"
        // footer (48 bytes)
        + "544b565353540000" // magic "TKVSST\0\0"
        + "01000000" // version 1
        + "1800000000000000" + "13000000" // index handle
        + "2b00000000000000" + "0d000000" // filter handle
        + "0200000000000000" // entries
        + "ef631da1"; // crc of the footer's first 44 bytes
    assert_eq!(hex(&fs.read_all(Path::new("/d/t.sst")).unwrap()), want);
    assert_eq!(meta.blocks, vec![Handle { offset: 0, size: 24 }]);
    let t = Table::open(&fs, Path::new("/d/t.sst")).unwrap();
    assert_eq!(t.get(b"ab").unwrap(), Some((Kind::Put, b"xyz".to_vec())));
    assert_eq!(t.get(b"b").unwrap(), Some((Kind::Delete, Vec::new())));
    assert_eq!(t.get(b"c").unwrap(), None);
    let f = sstable::encode_footer(Handle { offset: 0x1000, size: 0x20 }, Handle { offset: 0x1020, size: 9 }, 7);
    assert_eq!(
        sstable::decode_footer(&f),
        Ok((Handle { offset: 0x1000, size: 0x20 }, Handle { offset: 0x1020, size: 9 }, 7))
    );
}

#[test]
fn manifest_record() {
    let e = vec![
        Edit::NextFile(9),
        Edit::AddFile(
            4,
            FileMeta { total: 10, live: 7, size: 4096, smallest: b"a".to_vec(), largest: b"m".to_vec(), level: 0 },
        ),
        Edit::SetLive(4, 6),
        Edit::RemoveFile(3),
        Edit::Candidates(vec![4]),
        Edit::Counter(2),
    ];
    let want = "64000000".to_string() // payload length 100
        + "a088607b" // crc of the payload
        + "05" + "0900000000000000" // NextFile 9
        + "01" + "0400000000000000" + "0a00000000000000" + "0700000000000000" + "0010000000000000" // AddFile 4: total 10, live 7, 4096 bytes
        + "01000000" + "61" + "01000000" + "6d" // smallest "a", largest "m"
        + "03" + "0400000000000000" + "0600000000000000" // SetLive 4 = 6
        + "02" + "0300000000000000" // RemoveFile 3
        + "04" + "01000000" + "0400000000000000" // Candidates [4]
        + "06" + "0200000000000000"; // Counter 2
    let rec = manifest::frame(&manifest::encode_edits(&e));
    assert_eq!(hex(&rec), want);
    assert_eq!(manifest::decode_edits(&rec[8..]), Ok(e));
    assert_eq!(hex(manifest::MAGIC), "544b564d414e0001"); // "TKVMAN\0\x01"
}

#[test]
fn slmdb_superblock_and_root() {
    let want = "544b56534c4d4442".to_string() // "TKVSLMDB"
        + "01000000" + "00000000" // version 1
        + "0000000400000000" // memtable size 64 MiB
        + &zeros(36)
        + "ce945b1a"; // crc of bytes 0..60
                      // Version 1 (before leaf records named their entry's offset): still read.
    let sb = layout::encode_superblock_version(64 << 20, 1);
    assert_eq!(hex(&sb), want);
    assert_eq!(layout::decode_superblock(&sb), Ok((64 << 20, 1)));
    let want = "544b56534c4d4442".to_string() // "TKVSLMDB"
        + "02000000" + "00000000" // version 2
        + "0000000400000000" // memtable size 64 MiB
        + &zeros(36)
        + "20664a44"; // crc of bytes 0..60
    let sb = layout::encode_superblock(64 << 20);
    assert_eq!(hex(&sb), want);
    assert_eq!(layout::decode_superblock(&sb), Ok((64 << 20, 2)));
    let v3 = layout::encode_superblock_version(64 << 20, 3);
    assert!(layout::decode_superblock(&v3).unwrap_err().contains("version 3"));
    let root = layout::Root { gen: 3, active: 0x1000, imm: 0x2000, log: 0x3000, next_mem_gen: 5, flush_log: 0x4000 };
    let want = "524f4f54".to_string() // "ROOT"
        + "403e4068" // crc of bytes 8..56
        + "0300000000000000" // generation
        + "0010000000000000" // MemTable arena
        + "0020000000000000" // Immutable MemTable arena
        + "0030000000000000" // compaction log
        + "0500000000000000" // next MemTable generation
        + "0040000000000000" // flush log
        + &zeros(8);
    assert_eq!(hex(&root.encode()), want);
    assert_eq!(layout::Root::decode(&root.encode()), Some(root));
}

#[test]
fn slmdb_memtable_arena_and_node() {
    let want = "534c4d4d4152454e".to_string() // magic "SLMMAREN"
        + "0200000000000000" // generation 2
        + "0000010000000000" // size 64 KiB
        + "0000000000000000" // head (bottom-level first node)
        + "591a2609" // crc of bytes 0..24
        + &zeros(28);
    assert_eq!(hex(&memtable::encode_arena_header(2, 65536)), want);
    let want = "4010000000000000".to_string() // next
        + "2a00000000000000" // seq 42
        + "02000000" + "01000000" // batch of 2, index 1
        + "03000000" + "03000000" // klen 3, vlen 3
        + "00000000" // kind put
        + "64cfef38" // crc of bytes 8..36 + key + value
        + "6b6579" + "76616c" // "key" "val"
        + "0000"; // pad to 8
    assert_eq!(hex(&memtable::encode_node(0x1040, 42, 2, 1, 0, b"key", b"val")), want);
}

#[test]
fn slmdb_btree_node_and_record() {
    let want = "f5a2c808".to_string() // crc of bytes 4.. (header rest + key)
        + "01" + "00" + "0300" // kind leaf, klen 3
        + "0300000000000000" // file 3
        + "0020000000000000" // block offset 0x2000
        + "00100000" + "00000000" // block size 4096
        + "6b6579"; // "key"
    assert_eq!(hex(&pbtree::encode_record(1, b"key", 3, 0x2000, 4096, 0)), want);
    // The same location with its entry's offset in the block (0x30, stored + 1).
    let want = "f3146570".to_string() // crc of bytes 4.. (header rest + key)
        + "01" + "00" + "0300" // kind leaf, klen 3
        + "0300000000000000" // file 3
        + "0020000000000000" // block offset 0x2000
        + "00100000" + "31000000" // block size 4096, entry offset 0x30 + 1
        + "6b6579"; // "key"
    assert_eq!(hex(&pbtree::encode_record(1, b"key", 3, 0x2000, 4096, 0x31)), want);
    let want = "5042544e".to_string() // magic "PBTN"
        + "01" + "000000" // level 1
        + "11054ea2" + "00000000" // crc of magic, level, leftmost, low
        + "0040000000000000" // sibling
        + "0050000000000000" // leftmost child
        + "0060000000000000" // low (separator record)
        + &zeros(24);
    assert_eq!(hex(&pbtree::encode_header(1, 0x4000, 0x5000, 0x6000)), want);
}

#[test]
fn slmdb_compaction_log() {
    let want = "4c434f4d504c4f47".to_string() // "LCOMPLOG"
        + "7700000000000000" // log id
        + "0000000000000000" // next segment
        + "0000010000000000" // segment size 64 KiB
        + "5201a0b9" // crc of magic, id, size
        + &zeros(28);
    assert_eq!(hex(&complog::encode_seg_header(0x77, 65536)), want);
    let want = "f500724e".to_string() // crc
        + "04" + "00" + "0300" // Moved, klen 3
        + "0500000000000000" // old file 5
        + "7700000000000000" // log id
        + "6b6579" + "0000000000"; // "key", pad to 8
    let e = complog::encode_entry(0x77, &complog::LogEntry::Moved(5, b"key".to_vec()));
    assert_eq!(hex(&e), want);
    assert_eq!(complog::decode_entry(&e, 0x77), Some((complog::LogEntry::Moved(5, b"key".to_vec()), 32)));
    assert_eq!(complog::decode_entry(&e, 0x78), None, "another log's entry");
}
