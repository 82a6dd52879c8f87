//! Encodings of everything this crate persists: raft log entries, the vote, the last purged
//! log id (log store, `docs/format/raft.md`), and the state machine's applied-state record.
//!
//! Hand-written rather than serde-derived: the bytes on disk must not change when openraft
//! or serde change how they derive, and every record carries its own version and a masked
//! crc32c (LevelDB's masking, as the rest of tierkv) on top of the preset's own checksums.
//! All integers are little-endian except the log keys (big-endian, so key order is log order).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Membership, StoredMembership, Vote};

use crate::{ClusterNode, NodeId, Op, Request, TypeConfig};

/// Version byte of every record below.
pub const VERSION: u8 = 1;

/// Log store key of the entry at `index`: `"e" | index u64 BE`.
pub fn log_key(index: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = b'e';
    k[1..].copy_from_slice(&index.to_be_bytes());
    k
}

/// The index in a log key, if `key` is one.
pub fn log_key_index(key: &[u8]) -> Option<u64> {
    if key.len() != 9 || key[0] != b'e' {
        return None;
    }
    let mut b = [0u8; 8];
    b.copy_from_slice(&key[1..]);
    Some(u64::from_be_bytes(b))
}

/// Log store key of the vote.
pub const VOTE_KEY: &[u8] = b"mvote";
/// Log store key of the last purged log id.
pub const PURGED_KEY: &[u8] = b"mpurged";

/// A record that failed to decode: what and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "corrupt raft record: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Masked crc32c of `data` (`tierkv::format::crc`).
pub fn crc(data: &[u8]) -> u32 {
    tierkv::format::crc::masked(data)
}

/// Append-only encoder.
#[derive(Debug, Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        // Keys and values are bounded by tierkv's limits (64 MiB), far below u32::MAX.
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
    fn log_id(&mut self, id: &LogId<NodeId>) {
        self.u64(id.leader_id.term);
        self.u64(id.leader_id.node_id);
        self.u64(id.index);
    }
    fn opt_log_id(&mut self, id: &Option<LogId<NodeId>>) {
        match id {
            None => self.u8(0),
            Some(id) => {
                self.u8(1);
                self.log_id(id);
            }
        }
    }
    /// Finish a record: append the masked crc32c of everything before it.
    fn seal(mut self) -> Vec<u8> {
        let c = crc(&self.0);
        self.u32(c);
        self.0
    }
}

/// Checked decoder.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// Verify the trailing crc and version of the record `buf` (a `what`).
    fn open(buf: &'a [u8], what: &'static str) -> Result<Reader<'a>, DecodeError> {
        if buf.len() < 5 {
            return Err(DecodeError(format!("{what}: {} bytes, too short", buf.len())));
        }
        let (body, tail) = buf.split_at(buf.len() - 4);
        let stored = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
        if stored != crc(body) {
            return Err(DecodeError(format!("{what}: checksum mismatch")));
        }
        if body[0] != VERSION {
            return Err(DecodeError(format!("{what}: unknown version {}", body[0])));
        }
        Ok(Reader { buf: &body[1..], what })
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError(format!("{}: truncated", self.what)));
        }
        let (h, t) = self.buf.split_at(n);
        self.buf = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> Result<String, DecodeError> {
        let b = self.bytes()?;
        String::from_utf8(b).map_err(|_| DecodeError(format!("{}: address is not UTF-8", self.what)))
    }
    fn log_id(&mut self) -> Result<LogId<NodeId>, DecodeError> {
        let term = self.u64()?;
        let node = self.u64()?;
        let index = self.u64()?;
        Ok(LogId::new(CommittedLeaderId::new(term, node), index))
    }
    fn opt_log_id(&mut self) -> Result<Option<LogId<NodeId>>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.log_id()?)),
            t => Err(DecodeError(format!("{}: bad option tag {t}", self.what))),
        }
    }
    /// A count that must fit the remaining bytes at `min` bytes per item (so a corrupt count
    /// cannot make us allocate gigabytes).
    fn count(&mut self, min: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min) > self.buf.len() {
            return Err(DecodeError(format!("{}: count {n} exceeds the record", self.what)));
        }
        Ok(n)
    }
    fn end(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError(format!("{}: {} trailing bytes", self.what, self.buf.len())))
        }
    }
}

fn put_request(w: &mut Writer, r: &Request) {
    w.u32(r.ops.len() as u32);
    for op in &r.ops {
        match op {
            Op::Put { key, value } => {
                w.u8(1);
                w.bytes(key);
                w.bytes(value);
            }
            Op::Delete { key } => {
                w.u8(2);
                w.bytes(key);
            }
        }
    }
}

fn get_request(r: &mut Reader<'_>) -> Result<Request, DecodeError> {
    let n = r.count(5)?;
    let mut ops = Vec::with_capacity(n);
    for _ in 0..n {
        ops.push(match r.u8()? {
            1 => Op::Put { key: r.bytes()?, value: r.bytes()? },
            2 => Op::Delete { key: r.bytes()? },
            t => return Err(DecodeError(format!("{}: unknown op {t}", r.what))),
        });
    }
    Ok(Request { ops })
}

fn put_membership(w: &mut Writer, m: &Membership<NodeId, ClusterNode>) {
    let configs = m.get_joint_config();
    w.u32(configs.len() as u32);
    for c in configs {
        w.u32(c.len() as u32);
        for id in c {
            w.u64(*id);
        }
    }
    let nodes: Vec<_> = m.nodes().collect();
    w.u32(nodes.len() as u32);
    for (id, n) in nodes {
        w.u64(*id);
        w.bytes(n.raft_addr.as_bytes());
        w.bytes(n.resp_addr.as_bytes());
    }
}

fn get_membership(r: &mut Reader<'_>) -> Result<Membership<NodeId, ClusterNode>, DecodeError> {
    let nc = r.count(4)?;
    let mut configs = Vec::with_capacity(nc);
    for _ in 0..nc {
        let n = r.count(8)?;
        let mut set = BTreeSet::new();
        for _ in 0..n {
            set.insert(r.u64()?);
        }
        configs.push(set);
    }
    let nn = r.count(16)?;
    let mut nodes = BTreeMap::new();
    for _ in 0..nn {
        let id = r.u64()?;
        let raft_addr = r.string()?;
        let resp_addr = r.string()?;
        nodes.insert(id, ClusterNode { raft_addr, resp_addr });
    }
    Ok(Membership::new(configs, nodes))
}

/// Encode a log entry: `version | log id | kind (0 blank, 1 normal, 2 membership) | body | crc`.
pub fn encode_entry(e: &Entry<TypeConfig>) -> Vec<u8> {
    let mut w = Writer::default();
    w.u8(VERSION);
    w.log_id(&e.log_id);
    match &e.payload {
        EntryPayload::Blank => w.u8(0),
        EntryPayload::Normal(r) => {
            w.u8(1);
            put_request(&mut w, r);
        }
        EntryPayload::Membership(m) => {
            w.u8(2);
            put_membership(&mut w, m);
        }
    }
    w.seal()
}

/// Decode a log entry written by [`encode_entry`].
pub fn decode_entry(buf: &[u8]) -> Result<Entry<TypeConfig>, DecodeError> {
    let mut r = Reader::open(buf, "log entry")?;
    let log_id = r.log_id()?;
    let payload = match r.u8()? {
        0 => EntryPayload::Blank,
        1 => EntryPayload::Normal(get_request(&mut r)?),
        2 => EntryPayload::Membership(get_membership(&mut r)?),
        t => return Err(DecodeError(format!("log entry: unknown kind {t}"))),
    };
    r.end()?;
    Ok(Entry { log_id, payload })
}

/// Encode a vote: `version | term | node | committed u8 | crc`.
pub fn encode_vote(v: &Vote<NodeId>) -> Vec<u8> {
    let mut w = Writer::default();
    w.u8(VERSION);
    w.u64(v.leader_id.term);
    w.u64(v.leader_id.node_id);
    w.u8(u8::from(v.committed));
    w.seal()
}

/// Decode a vote written by [`encode_vote`].
pub fn decode_vote(buf: &[u8]) -> Result<Vote<NodeId>, DecodeError> {
    let mut r = Reader::open(buf, "vote")?;
    let term = r.u64()?;
    let node = r.u64()?;
    let committed = match r.u8()? {
        0 => false,
        1 => true,
        t => return Err(DecodeError(format!("vote: bad committed flag {t}"))),
    };
    r.end()?;
    let mut v = Vote::new(term, node);
    v.committed = committed;
    Ok(v)
}

/// Encode a log id record (the last purged one): `version | term | node | index | crc`.
pub fn encode_log_id(id: &LogId<NodeId>) -> Vec<u8> {
    let mut w = Writer::default();
    w.u8(VERSION);
    w.log_id(id);
    w.seal()
}

/// Decode a record written by [`encode_log_id`].
pub fn decode_log_id(buf: &[u8]) -> Result<LogId<NodeId>, DecodeError> {
    let mut r = Reader::open(buf, "log id")?;
    let id = r.log_id()?;
    r.end()?;
    Ok(id)
}

/// What the state machine has applied: the last applied log id and the last membership
/// (with the id of the entry that carried it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AppliedState {
    /// Last applied log id.
    pub last_applied: Option<LogId<NodeId>>,
    /// Last applied membership.
    pub membership: StoredMembership<NodeId, ClusterNode>,
}

/// Encode the applied state: `version | opt log id | opt membership log id | membership | crc`
/// (an option is `0` or `1 | term | node | index`).
pub fn encode_applied(a: &AppliedState) -> Vec<u8> {
    let mut w = Writer::default();
    w.u8(VERSION);
    w.opt_log_id(&a.last_applied);
    w.opt_log_id(a.membership.log_id());
    put_membership(&mut w, a.membership.membership());
    w.seal()
}

/// Decode a record written by [`encode_applied`].
pub fn decode_applied(buf: &[u8]) -> Result<AppliedState, DecodeError> {
    let mut r = Reader::open(buf, "applied state")?;
    let last_applied = r.opt_log_id()?;
    let mlog = r.opt_log_id()?;
    let m = get_membership(&mut r)?;
    r.end()?;
    Ok(AppliedState { last_applied, membership: StoredMembership::new(mlog, m) })
}

/// Encode a snapshot file's header: `version | snapshot id (u32 length + UTF-8) | opt last
/// applied log id | opt membership log id | membership | crc`.
pub fn encode_snapshot_header(id: &str, a: &AppliedState) -> Vec<u8> {
    let mut w = Writer::default();
    w.u8(VERSION);
    w.bytes(id.as_bytes());
    w.opt_log_id(&a.last_applied);
    w.opt_log_id(a.membership.log_id());
    put_membership(&mut w, a.membership.membership());
    w.seal()
}

/// Decode a header written by [`encode_snapshot_header`].
pub fn decode_snapshot_header(buf: &[u8]) -> Result<(String, AppliedState), DecodeError> {
    let mut r = Reader::open(buf, "snapshot header")?;
    let id = r.string()?;
    let last_applied = r.opt_log_id()?;
    let mlog = r.opt_log_id()?;
    let m = get_membership(&mut r)?;
    r.end()?;
    Ok((id, AppliedState { last_applied, membership: StoredMembership::new(mlog, m) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn lid(t: u64, n: u64, i: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(t, n), i)
    }

    fn membership() -> Membership<NodeId, ClusterNode> {
        let mut nodes = BTreeMap::new();
        nodes.insert(1, ClusterNode { raft_addr: "h:1".into(), resp_addr: "h:2".into() });
        Membership::new(vec![BTreeSet::from([1])], nodes)
    }

    /// Golden bytes: the same as in docs/format/raft.md. A change here is a format change.
    #[test]
    fn golden_entry_normal() {
        let e = Entry::<TypeConfig> {
            log_id: lid(2, 1, 7),
            payload: EntryPayload::Normal(Request {
                ops: vec![Op::Put { key: b"k".to_vec(), value: b"v".to_vec() }, Op::Delete { key: b"d".to_vec() }],
            }),
        };
        let b = encode_entry(&e);
        assert_eq!(
            hex(&b),
            "01020000000000000001000000000000000700000000000000010200000001010000006b01000000760201000000649a4c8ab8"
        );
        assert_eq!(decode_entry(&b), Ok(e));
    }

    #[test]
    fn golden_entry_membership_and_blank() {
        let e = Entry::<TypeConfig> { log_id: lid(1, 1, 1), payload: EntryPayload::Membership(membership()) };
        let b = encode_entry(&e);
        assert_eq!(
            hex(&b),
            "010100000000000000010000000000000001000000000000000201000000010000000100000000000000010000000100000000000000030000\
             00683a3103000000683a3290576dcd"
        );
        assert_eq!(decode_entry(&b), Ok(e));
        let blank = Entry::<TypeConfig> { log_id: lid(3, 2, 9), payload: EntryPayload::Blank };
        let b = encode_entry(&blank);
        assert_eq!(hex(&b), "01030000000000000002000000000000000900000000000000009be441dd");
        assert_eq!(decode_entry(&b), Ok(blank));
    }

    #[test]
    fn golden_vote_log_id_applied() {
        let mut v = Vote::new(5, 3);
        v.committed = true;
        let b = encode_vote(&v);
        assert_eq!(hex(&b), "010500000000000000030000000000000001fffa70da");
        assert_eq!(decode_vote(&b), Ok(v));
        let b = encode_log_id(&lid(4, 2, 100));
        assert_eq!(hex(&b), "01040000000000000002000000000000006400000000000000eff79a46");
        assert_eq!(decode_log_id(&b), Ok(lid(4, 2, 100)));
        let a = AppliedState {
            last_applied: Some(lid(1, 1, 3)),
            membership: StoredMembership::new(Some(lid(1, 1, 1)), membership()),
        };
        let b = encode_applied(&a);
        assert_eq!(
            hex(&b),
            "0101010000000000000001000000000000000300000000000000010100000000000000010000000000000001000000000000000100000001\
             000000010000000000000001000000010000000000000003000000683a3103000000683a320a348fec"
        );
        assert_eq!(decode_applied(&b), Ok(a));
        assert_eq!(decode_applied(&encode_applied(&AppliedState::default())), Ok(AppliedState::default()));
    }

    #[test]
    fn damage_is_an_error_never_a_panic() {
        let e = Entry::<TypeConfig> { log_id: lid(1, 1, 1), payload: EntryPayload::Membership(membership()) };
        let good = encode_entry(&e);
        for i in 0..good.len() {
            let mut b = good.clone();
            b[i] ^= 0x40;
            assert!(decode_entry(&b).is_err(), "flip at {i} accepted");
            assert!(decode_entry(&good[..i]).is_err(), "truncation at {i} accepted");
        }
        // A huge count behind a valid checksum is refused, not allocated.
        let mut w = Writer::default();
        w.u8(VERSION);
        w.log_id(&lid(1, 1, 1));
        w.u8(1);
        w.u32(u32::MAX);
        let b = w.seal();
        assert!(decode_entry(&b).is_err());
        let mut b = encode_vote(&Vote::new(1, 1));
        b[0] = 9;
        let n = b.len();
        let c = crc(&b[..n - 4]);
        b[n - 4..].copy_from_slice(&c.to_le_bytes());
        assert_eq!(decode_vote(&b), Err(DecodeError("vote: unknown version 9".into())));
    }

    #[test]
    fn log_keys_sort_in_log_order() {
        assert!(log_key(255) < log_key(256));
        assert!(log_key(u64::MAX - 1) < log_key(u64::MAX));
        assert_eq!(log_key_index(&log_key(123_456)), Some(123_456));
        assert_eq!(log_key_index(b"mvote"), None);
    }
}
