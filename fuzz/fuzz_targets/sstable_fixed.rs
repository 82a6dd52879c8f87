//! The SSTable reader on *valid-checksum* damage: build a real table from the input's
//! entries, apply the input's byte edits, then recompute every checksum (footer, index,
//! filter, each data block the index names) so that the decoders behind the checksums —
//! index entries, block entries, filter, handles — see the damaged bytes. Undetectable
//! damage may change what is read, but nothing may panic or hang; with no edits, every
//! entry must read back exactly.
#![no_main]
use std::collections::BTreeMap;
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tierkv::format::crc;
use tierkv::fs::{FaultFs, Fs};
use tierkv::sstable::{Kind, Table, TableBuilder};

const FOOTER: usize = 48;

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Recompute the crc of the block at `off..off+size` if it lies inside `end`.
fn fix_block(t: &mut [u8], off: u64, size: u32, end: usize) -> Option<(usize, usize)> {
    let (off, size) = (usize::try_from(off).ok()?, size as usize);
    if size < 4 || off.checked_add(size)? > end {
        return None;
    }
    let c = crc::masked(&t[off..off + size - 4]);
    t[off + size - 4..off + size].copy_from_slice(&c.to_le_bytes());
    Some((off, size))
}

fn fix_checksums(t: &mut [u8]) {
    if t.len() < FOOTER {
        return;
    }
    let f = t.len() - FOOTER;
    let (io, is) = (le64(t, f + 12), le32(t, f + 20));
    let (fo, fs) = (le64(t, f + 24), le32(t, f + 32));
    let c = crc::masked(&t[f..f + 44]);
    t[f + 44..f + 48].copy_from_slice(&c.to_le_bytes());
    fix_block(t, fo, fs, f);
    let Some((io, is)) = fix_block(t, io, is, f) else { return };
    let mut handles = Vec::new();
    let mut p = io;
    let end = io + is - 4;
    while p + 2 <= end {
        let klen = u16::from_le_bytes([t[p], t[p + 1]]) as usize;
        p += 2 + klen;
        if p + 12 > end {
            break;
        }
        handles.push((le64(t, p), le32(t, p + 8)));
        p += 12;
    }
    for (o, s) in handles {
        fix_block(t, o, s, io);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut it = data.iter().copied();
    let n = it.next().unwrap_or(0) % 64;
    let mut entries = BTreeMap::new();
    for _ in 0..n {
        let (Some(kl), Some(vl)) = (it.next(), it.next()) else { break };
        let key: Vec<u8> = it.by_ref().take(kl as usize % 24).collect();
        let del = vl & 0x80 != 0;
        let val: Vec<u8> = if del { Vec::new() } else { it.by_ref().take(vl as usize % 96).collect() };
        entries.insert(key, (del, val));
    }
    let mut b = TableBuilder::in_memory(64, 10);
    for (k, (del, v)) in &entries {
        let kind = if *del { Kind::Delete } else { Kind::Put };
        if b.add(kind, k, v).is_err() {
            return;
        }
    }
    let Ok((_, mut table)) = b.finish_mem() else { return };
    let rest: Vec<u8> = it.collect();
    let edited = rest.len() >= 3;
    for e in rest.chunks_exact(3) {
        if table.is_empty() {
            break;
        }
        let at = u16::from_le_bytes([e[0], e[1]]) as usize % table.len();
        table[at] ^= e[2];
    }
    // An edit may also cut the table short: the last edit byte's high bit truncates.
    if let Some(&last) = rest.last() {
        if last & 0x80 != 0 && last & 0x7f != 0 {
            let cut = (last & 0x7f) as usize;
            table.truncate(table.len().saturating_sub(cut));
        }
    }
    fix_checksums(&mut table);
    let fs = FaultFs::new();
    let p = Path::new("/t.sst");
    let Ok(mut f) = fs.create(p) else { return };
    if f.append(&table).is_err() {
        return;
    }
    drop(f);
    match Table::open(&fs, p) {
        Ok(t) => {
            let mut seen = Vec::new();
            let scan = t.for_each(|e, _| {
                seen.push(e.key.to_vec());
                Ok(())
            });
            for k in entries.keys() {
                let got = t.get(k);
                if !edited {
                    let (del, v) = &entries[k];
                    let want = if *del { (Kind::Delete, Vec::new()) } else { (Kind::Put, v.clone()) };
                    assert_eq!(got.ok().flatten(), Some(want), "clean table lost a key");
                }
            }
            if !edited {
                assert!(scan.is_ok());
                assert_eq!(seen, entries.keys().cloned().collect::<Vec<_>>());
            }
        }
        Err(e) => assert!(edited, "a clean table failed to open: {e}"),
    }
});
