//! The RESP parser and the command layer on arbitrary bytes: parsing the input whole and in
//! input-chosen chunks gives the same commands (or the same protocol error), and executing
//! every parsed command against a store never panics; the store stays sound.
#![no_main]
use std::sync::Arc;

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tierkv::fs::FaultFs;
use tierkv::pm::sim::SimDevice;
use tierkv::{Db, Preset};
use tierkv_server::cmd::Session;
use tierkv_server::resp::{Limits, Parser};
use tierkv_server::{Keyspace, Settings};

fn parse_all(chunks: &[&[u8]], lim: &Limits) -> (Vec<Vec<Vec<u8>>>, Option<String>) {
    let mut p = Parser::new();
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for c in chunks {
        buf.extend_from_slice(c);
        loop {
            match p.next(&mut buf, lim) {
                Ok(Some(cmd)) => out.push(cmd.iter().map(|b| b.to_vec()).collect()),
                Ok(None) => break,
                Err(e) => return (out, Some(e.0)),
            }
        }
    }
    (out, None)
}

fuzz_target!(|data: &[u8]| {
    let Some((&split, input)) = data.split_first() else { return };
    let lim = Limits { max_bulk_len: 4096, max_multibulk_len: 64, max_inline_len: 256 };
    let (whole, whole_err) = parse_all(&[input], &lim);
    let step = (split as usize % 7) + 1;
    let chunks: Vec<&[u8]> = input.chunks(step).collect();
    let (parts, parts_err) = parse_all(&chunks, &lim);
    assert_eq!(whole, parts, "chunked parsing differs");
    assert_eq!(whole_err.is_some(), parts_err.is_some(), "chunked parsing differs in error");
    if whole.is_empty() {
        return;
    }
    let dev = SimDevice::new();
    let fs = FaultFs::new();
    let opts = tierkv::testing::sim_options(Preset::Pmekv, &dev, &fs);
    let Ok(db) = Db::open("/db", opts) else { return };
    let db = Arc::new(db);
    let settings = Settings { port: 0, bind: "fuzz".into(), timeout_secs: 0, max_clients: 1, limits: lim };
    let Ok(ks) = Keyspace::new(db.clone(), settings) else { return };
    let mut s = Session::default();
    for cmd in whole.iter().take(64) {
        let args: Vec<bytes::Bytes> = cmd.iter().map(|a| bytes::Bytes::copy_from_slice(a)).collect();
        if args.first().is_some_and(|n| n.eq_ignore_ascii_case(b"flushdb") || n.eq_ignore_ascii_case(b"info")) {
            continue;
        }
        let mut out = Vec::new();
        ks.exec(&mut s, &args).encode(&mut out);
    }
    assert_eq!(db.check().ok(), Some(Vec::new()), "store unsound after commands");
});
