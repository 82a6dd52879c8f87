//! PMEKV's and SLM-DB's PM layouts on arbitrary bytes: superblocks, checkpoint and root
//! slots, log entries, KeyNodes, directories, value records, compaction-log entries.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tierkv::engine::pmekv::layout as p;
use tierkv::engine::slmdb::{complog, layout as s};

fuzz_target!(|data: &[u8]| {
    let _ = p::Superblock::decode(data);
    let _ = p::Checkpoint::decode(data);
    for kind in [p::LogKind::KeyValue, p::LogKind::Key] {
        let _ = p::LogEntry::decode(data, kind);
    }
    let _ = p::keynode_decode(data);
    if let Some((&n, rest)) = data.split_first() {
        let _ = p::dir_decode(rest, u64::from(n));
        let _ = p::value_verify(rest, b"key", u32::from(n));
    }
    let _ = s::decode_superblock(data);
    let _ = s::Root::decode(data);
    let _ = complog::decode_entry(data, 7);
});
