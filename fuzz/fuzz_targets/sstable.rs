//! The SSTable reader on arbitrary bytes: footer, index, filter and every data block. Any
//! input is an error or a table whose entries read back in order; never a panic.
#![no_main]
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tierkv::fs::{FaultFs, Fs};
use tierkv::sstable::{block_entries, decode_footer, Table};

fuzz_target!(|data: &[u8]| {
    let _ = decode_footer(data);
    for e in block_entries(data) {
        if e.is_err() {
            break;
        }
    }
    let fs = FaultFs::new();
    let p = Path::new("/t.sst");
    let Ok(mut f) = fs.create(p) else { return };
    if f.append(data).is_err() {
        return;
    }
    drop(f);
    if let Ok(t) = Table::open(&fs, p) {
        let _ = t.for_each(|_, _| Ok(()));
        let _ = t.get(b"key");
    }
});
