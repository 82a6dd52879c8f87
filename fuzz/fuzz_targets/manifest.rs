//! MANIFEST parsing on arbitrary bytes: a version, or an error naming an offset; never a
//! panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tierkv::manifest::parse(data);
    let _ = tierkv::manifest::decode_edits(data);
});
