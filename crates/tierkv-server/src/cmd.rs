//! Command execution: Redis's commands over a tierkv [`Db`], with the keyspace encoding of
//! [`crate::keys`].
//!
//! # Atomicity and concurrency
//! Every command that writes takes the lock stripe of each key it touches (4,096 stripes,
//! picked by a hash of the key; several keys are locked in stripe order, so no deadlock), and
//! commits all its changes with one atomic [`WriteBatch`]. So INCR, APPEND, GETSET, HSET's
//! field count, ZADD's score index and DEL of a hash are atomic with respect to every other
//! client of this server, and crash-atomic (a batch is all or nothing in every preset).
//! Reads take no lock: they see each batch whole or not at all. FLUSHDB takes a global lock
//! exclusively (every other command takes it shared).
//!
//! # The type directory
//! The names of all hashes and sorted sets, with their field/member counts, are kept in DRAM
//! (loaded at start from the type records, `FF 'm' key`), so SET/GET/DEL of a string need
//! no extra read to rule out a hash of the same name, and HSET/ZADD keep counts without
//! reading the type record. Strings are not in it (there can be billions).
//!
//! # A reply only after the write is durable
//! Each command's batch returns from [`Db::write`] only once durable at the preset's level
//! (SPEC §2), and the reply is produced after it.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard};
use tierkv::{Db, WriteBatch};

use crate::glob;
use crate::keys::{self, Kind};
use crate::resp::Reply;

const STRIPES: usize = 4096;
const WRONGTYPE: &str = "WRONGTYPE Operation against a key holding the wrong kind of value";
const NOT_INT: &str = "value is not an integer or out of range";
const NOT_FLOAT: &str = "value is not a valid float";
/// Most open SCAN cursors remembered; the oldest is forgotten first.
const MAX_CURSORS: usize = 65_536;

/// Server settings a client can read (CONFIG GET, INFO).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Listening port.
    pub port: u16,
    /// Bind address.
    pub bind: String,
    /// Idle timeout in seconds (0 = none).
    pub timeout_secs: u64,
    /// Most simultaneous clients.
    pub max_clients: usize,
    /// Request limits.
    pub limits: crate::resp::Limits,
}

/// Server-wide counters.
#[derive(Debug, Default)]
pub struct Counters {
    /// Connections open now.
    pub connected: AtomicU64,
    /// Connections accepted since start.
    pub accepted: AtomicU64,
    /// Connections refused (over max clients).
    pub rejected: AtomicU64,
    /// Commands executed.
    pub commands: AtomicU64,
}

/// One connection's state.
#[derive(Debug, Default)]
pub struct Session {
    /// Connection id (CLIENT ID).
    pub id: u64,
    /// CLIENT SETNAME.
    pub name: Option<Vec<u8>>,
    /// QUIT was received: reply, then close.
    pub quit: bool,
}

#[derive(Debug, Clone)]
struct ScanPos {
    phase: u8,
    after: Option<Vec<u8>>,
}

#[derive(Debug, Default)]
struct Cursors {
    map: HashMap<u64, ScanPos>,
    order: std::collections::VecDeque<u64>,
}

/// The server's view of a store.
pub struct Keyspace {
    db: Arc<Db>,
    types: RwLock<HashMap<Vec<u8>, (Kind, u64)>>,
    stripes: Box<[Mutex<()>]>,
    global: RwLock<()>,
    cursors: Mutex<Cursors>,
    /// Counters shown by INFO.
    pub counters: Counters,
    /// Settings shown by CONFIG GET and INFO.
    pub settings: Settings,
    started: Instant,
}

impl std::fmt::Debug for Keyspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyspace").field("db", &self.db).finish()
    }
}

type R = Result<Reply, Reply>;
type Entry = (Vec<u8>, Vec<u8>);

fn db_err(e: tierkv::Error) -> Reply {
    Reply::err(e)
}

fn eq(a: &[u8], b: &str) -> bool {
    a.eq_ignore_ascii_case(b.as_bytes())
}

/// Redis's `string2ll`: optional `-`, digits, no leading zeros or `+`, fits i64.
pub fn parse_int(b: &[u8]) -> Option<i64> {
    let s = std::str::from_utf8(b).ok()?;
    if s.is_empty() || s.len() > 20 || s.starts_with('+') || (s.len() > 1 && s.starts_with('0')) || s.starts_with("-0")
    {
        return None;
    }
    s.parse().ok()
}

/// A score as Redis parses one (`strtod`: decimal or exponent form — e.g. Java's
/// `-5.94971599E8` — `inf`, `+inf`, `-inf`); NaN is refused.
pub fn parse_score(b: &[u8]) -> Option<f64> {
    let s = std::str::from_utf8(b).ok()?;
    if s.is_empty() || s.trim() != s {
        return None;
    }
    let v: f64 = s.parse().ok()?;
    (!v.is_nan()).then_some(v)
}

/// A score as Redis 7.2+ prints one: shortest round-trip digits, `inf`/`-inf`, exponent form
/// (`1e+21`) outside [1e-5, 1e21).
pub fn format_score(v: f64) -> String {
    if v.is_infinite() {
        return if v > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let a = v.abs();
    if a != 0.0 && !(1e-5..1e21).contains(&a) {
        let s = format!("{v:e}");
        match s.split_once('e') {
            Some((m, e)) if !e.starts_with('-') => format!("{m}e+{e}"),
            _ => s,
        }
    } else {
        format!("{v}")
    }
}

/// Parse a ZRANGEBYSCORE bound: (value, exclusive).
fn parse_bound(b: &[u8]) -> Option<(f64, bool)> {
    match b.first() {
        Some(b'(') => parse_score(&b[1..]).map(|v| (v, true)),
        _ => parse_score(b).map(|v| (v, false)),
    }
}

/// (name, arity as Redis: n = exactly n words, -n = at least n; flags).
pub const COMMANDS: &[(&str, i64, &[&str])] = &[
    ("ping", -1, &["fast"]),
    ("echo", 2, &["fast"]),
    ("quit", -1, &["fast"]),
    ("select", 2, &["fast"]),
    ("command", -1, &["random"]),
    ("info", -1, &["random"]),
    ("config", -2, &["admin"]),
    ("client", -2, &["admin"]),
    ("hello", -1, &["fast"]),
    ("dbsize", 1, &["readonly"]),
    ("flushdb", -1, &["write"]),
    ("type", 2, &["readonly", "fast"]),
    ("get", 2, &["readonly", "fast"]),
    ("set", -3, &["write", "denyoom"]),
    ("setnx", 3, &["write", "denyoom", "fast"]),
    ("getset", 3, &["write", "denyoom", "fast"]),
    ("mget", -2, &["readonly", "fast"]),
    ("mset", -3, &["write", "denyoom"]),
    ("del", -2, &["write"]),
    ("exists", -2, &["readonly", "fast"]),
    ("incr", 2, &["write", "denyoom", "fast"]),
    ("decr", 2, &["write", "denyoom", "fast"]),
    ("incrby", 3, &["write", "denyoom", "fast"]),
    ("decrby", 3, &["write", "denyoom", "fast"]),
    ("append", 3, &["write", "denyoom", "fast"]),
    ("strlen", 2, &["readonly", "fast"]),
    ("scan", -2, &["readonly"]),
    ("hset", -4, &["write", "denyoom", "fast"]),
    ("hmset", -4, &["write", "denyoom", "fast"]),
    ("hget", 3, &["readonly", "fast"]),
    ("hmget", -3, &["readonly", "fast"]),
    ("hgetall", 2, &["readonly"]),
    ("hdel", -3, &["write", "fast"]),
    ("hlen", 2, &["readonly", "fast"]),
    ("zadd", -4, &["write", "denyoom", "fast"]),
    ("zrem", -3, &["write", "fast"]),
    ("zrangebyscore", -4, &["readonly"]),
    ("zscore", 3, &["readonly", "fast"]),
    ("zcard", 2, &["readonly", "fast"]),
];

fn command_entry(name: &str, arity: i64, flags: &[&str]) -> Reply {
    let keys = !matches!(
        name,
        "ping"
            | "echo"
            | "quit"
            | "select"
            | "command"
            | "info"
            | "config"
            | "client"
            | "hello"
            | "dbsize"
            | "flushdb"
            | "scan"
    );
    let (first, last, step) = match name {
        _ if !keys => (0, 0, 0),
        "mget" | "del" | "exists" => (1, -1, 1),
        "mset" => (1, -1, 2),
        _ => (1, 1, 1),
    };
    Reply::Array(vec![
        Reply::bulk(name),
        Reply::Int(arity),
        Reply::Array(flags.iter().map(|f| Reply::Status((*f).into())).collect()),
        Reply::Int(first),
        Reply::Int(last),
        Reply::Int(step),
    ])
}

impl Keyspace {
    /// Load the type directory of `db` and serve it.
    pub fn new(db: Arc<Db>, settings: Settings) -> tierkv::Result<Keyspace> {
        let mut types = HashMap::new();
        let (lo, hi) = keys::type_range();
        for e in db.scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Included(&lo), Bound::Excluded(&hi)))? {
            let (k, v) = e?;
            let (kind, count) = keys::decode_type(&v).ok_or_else(|| tierkv::Error::Corruption {
                file: db.path().to_path_buf(),
                offset: 0,
                detail: format!(
                    "server type record of key {} is malformed or of an unknown encoding version (this server reads version {})",
                    tierkv::escape(&k[2..]),
                    keys::VERSION
                ),
            })?;
            types.insert(k[2..].to_vec(), (kind, count));
        }
        Ok(Keyspace {
            db,
            types: RwLock::new(types),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            global: RwLock::new(()),
            cursors: Mutex::new(Cursors::default()),
            counters: Counters::default(),
            settings,
            started: Instant::now(),
        })
    }

    /// The store.
    pub fn db(&self) -> &Arc<Db> {
        &self.db
    }

    fn stripe(k: &[u8]) -> usize {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        k.hash(&mut h);
        (h.finish() as usize) % STRIPES
    }

    /// Lock the stripes of `ks` (sorted, deduplicated: no deadlock).
    fn lock_keys<'a>(&'a self, ks: impl Iterator<Item = &'a [u8]>) -> Vec<MutexGuard<'a, ()>> {
        let mut idx: Vec<usize> = ks.map(Keyspace::stripe).collect();
        idx.sort_unstable();
        idx.dedup();
        idx.into_iter().map(|i| self.stripes[i].lock()).collect()
    }

    fn kind(&self, k: &[u8]) -> Option<(Kind, u64)> {
        self.types.read().get(k).copied()
    }

    fn get_string(&self, k: &[u8]) -> Result<Option<Vec<u8>>, Reply> {
        self.db.get(keys::string_key(k)).map_err(db_err)
    }

    /// `Err(WRONGTYPE)` unless `k` is absent or a string.
    fn expect_string(&self, k: &[u8]) -> Result<(), Reply> {
        match self.kind(k) {
            Some(_) => Err(Reply::Error(WRONGTYPE.into())),
            None => Ok(()),
        }
    }

    /// `Ok(count)` if `k` is a `want` (0 if absent); `Err(WRONGTYPE)` if another type.
    fn expect_kind(&self, k: &[u8], want: Kind) -> Result<u64, Reply> {
        match self.kind(k) {
            Some((kind, n)) if kind == want => Ok(n),
            Some(_) => Err(Reply::Error(WRONGTYPE.into())),
            None => match self.get_string(k)? {
                Some(_) => Err(Reply::Error(WRONGTYPE.into())),
                None => Ok(0),
            },
        }
    }

    fn scan_prefix(&self, prefix: &[u8]) -> Result<Vec<Entry>, Reply> {
        let end = keys::prefix_end(prefix);
        let hi = end.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
        let mut out = Vec::new();
        for e in self.db.scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Included(prefix), hi)).map_err(db_err)? {
            out.push(e.map_err(db_err)?);
        }
        Ok(out)
    }

    /// Add to `b` the deletion of hash/zset `k` and all its records.
    fn delete_collection(&self, b: &mut WriteBatch, k: &[u8], kind: Kind) -> Result<(), Reply> {
        let prefixes = match kind {
            Kind::Hash => vec![keys::hash_prefix(k)],
            Kind::Zset => vec![keys::zmember_prefix(k), keys::zscore_prefix(k)],
        };
        for p in prefixes {
            for (key, _) in self.scan_prefix(&p)? {
                b.delete(key);
            }
        }
        b.delete(keys::type_key(k));
        Ok(())
    }

    fn commit(&self, b: WriteBatch) -> Result<(), Reply> {
        if b.is_empty() {
            return Ok(());
        }
        self.db.write(b).map_err(db_err)
    }

    /// Commit `b` with `k`'s type record set to `count` (removed at 0) when it changed
    /// from `was`, and mirror the change in the type directory.
    fn commit_with_count(&self, mut b: WriteBatch, k: &[u8], kind: Kind, was: u64, count: u64) -> Result<(), Reply> {
        if count != was {
            if count == 0 {
                b.delete(keys::type_key(k));
            } else {
                b.put(keys::type_key(k), keys::encode_type(kind, count));
            }
        }
        self.commit(b)?;
        if count != was {
            let mut t = self.types.write();
            if count == 0 {
                t.remove(k);
            } else {
                t.insert(k.to_vec(), (kind, count));
            }
        }
        Ok(())
    }

    /// Execute one command.
    pub fn exec(&self, s: &mut Session, args: &[Bytes]) -> Reply {
        self.counters.commands.fetch_add(1, Ordering::Relaxed);
        let Some(name) = args.first() else { return Reply::err("empty command") };
        let lname = String::from_utf8_lossy(name).to_ascii_lowercase();
        let Some(&(cname, arity, _)) = COMMANDS.iter().find(|c| c.0 == lname) else {
            let mut msg = format!("unknown command '{}', with args beginning with: ", trunc(name));
            for a in &args[1..] {
                msg.push_str(&format!("'{}' ", trunc(a)));
            }
            return Reply::err(msg);
        };
        let n = args.len() as i64;
        if (arity > 0 && n != arity) || (arity < 0 && n < -arity) {
            return Reply::err(format!("wrong number of arguments for '{cname}' command"));
        }
        let a = &args[1..];
        let _g: RwLockReadGuard<'_, ()>;
        let r = match cname {
            "flushdb" => self.flushdb(a),
            _ => {
                _g = self.global.read();
                self.dispatch(s, cname, a)
            }
        };
        r.unwrap_or_else(|e| e)
    }

    fn dispatch(&self, s: &mut Session, name: &str, a: &[Bytes]) -> R {
        match name {
            "ping" => match a.len() {
                0 => Ok(Reply::Status("PONG".into())),
                1 => Ok(Reply::bulk(&a[0])),
                _ => Err(Reply::err("wrong number of arguments for 'ping' command")),
            },
            "echo" => Ok(Reply::bulk(&a[0])),
            "quit" => {
                s.quit = true;
                Ok(Reply::Ok)
            }
            "select" => match parse_int(&a[0]) {
                Some(0) => Ok(Reply::Ok),
                Some(_) => Err(Reply::err("DB index is out of range")),
                None => Err(Reply::err(NOT_INT)),
            },
            "command" => self.command(a),
            "info" => self.info(a),
            "config" => self.config(a),
            "client" => client(s, a),
            "hello" => self.hello(s, a),
            "dbsize" => Ok(Reply::Int(self.dbsize()? as i64)),
            "type" => self.type_of(&a[0]),
            "get" => {
                self.expect_string(&a[0])?;
                Ok(self.get_string(&a[0])?.map_or(Reply::Nil, Reply::Bulk))
            }
            "set" => self.set(a),
            "setnx" => Ok(Reply::Int(i64::from(self.set_string(&a[0], &a[1], Cond::Nx, false)?.0))),
            "getset" => Ok(self.set_string(&a[0], &a[1], Cond::Always, true)?.1.map_or(Reply::Nil, Reply::Bulk)),
            "mget" => {
                let mut out = Vec::with_capacity(a.len());
                for k in a {
                    out.push(match self.kind(k) {
                        Some(_) => Reply::Nil,
                        None => self.get_string(k)?.map_or(Reply::Nil, Reply::Bulk),
                    });
                }
                Ok(Reply::Array(out))
            }
            "mset" => self.mset(a),
            "del" => self.del(a),
            "exists" => {
                let mut n = 0;
                for k in a {
                    if self.kind(k).is_some() || self.get_string(k)?.is_some() {
                        n += 1;
                    }
                }
                Ok(Reply::Int(n))
            }
            "incr" => self.incr_by(&a[0], 1),
            "decr" => self.incr_by(&a[0], -1),
            "incrby" => self.incr_by(&a[0], parse_int(&a[1]).ok_or_else(|| Reply::err(NOT_INT))?),
            "decrby" => {
                let d = parse_int(&a[1]).and_then(i64::checked_neg).ok_or_else(|| Reply::err(NOT_INT))?;
                self.incr_by(&a[0], d)
            }
            "append" => self.append(&a[0], &a[1]),
            "strlen" => {
                self.expect_string(&a[0])?;
                Ok(Reply::Int(self.get_string(&a[0])?.map_or(0, |v| v.len() as i64)))
            }
            "scan" => self.scan(a),
            "hset" | "hmset" => self.hset(name, a),
            "hget" => {
                self.expect_kind(&a[0], Kind::Hash)?;
                Ok(self.db.get(keys::hash_field(&a[0], &a[1])).map_err(db_err)?.map_or(Reply::Nil, Reply::Bulk))
            }
            "hmget" => {
                self.expect_kind(&a[0], Kind::Hash)?;
                let mut out = Vec::with_capacity(a.len() - 1);
                for f in &a[1..] {
                    out.push(self.db.get(keys::hash_field(&a[0], f)).map_err(db_err)?.map_or(Reply::Nil, Reply::Bulk));
                }
                Ok(Reply::Array(out))
            }
            "hgetall" => {
                if self.expect_kind(&a[0], Kind::Hash)? == 0 {
                    return Ok(Reply::Array(Vec::new()));
                }
                let p = keys::hash_prefix(&a[0]);
                let mut out = Vec::new();
                for (k, v) in self.scan_prefix(&p)? {
                    out.push(Reply::Bulk(k[p.len()..].to_vec()));
                    out.push(Reply::Bulk(v));
                }
                Ok(Reply::Array(out))
            }
            "hdel" => self.hdel(a),
            "hlen" => Ok(Reply::Int(self.expect_kind(&a[0], Kind::Hash)? as i64)),
            "zadd" => self.zadd(a),
            "zrem" => self.zrem(a),
            "zrangebyscore" => self.zrangebyscore(a),
            "zscore" => {
                self.expect_kind(&a[0], Kind::Zset)?;
                let v = self.db.get(keys::zmember(&a[0], &a[1])).map_err(db_err)?;
                Ok(match v.as_deref().and_then(keys::decode_score) {
                    Some(sc) => Reply::Bulk(format_score(sc).into_bytes()),
                    None => Reply::Nil,
                })
            }
            "zcard" => Ok(Reply::Int(self.expect_kind(&a[0], Kind::Zset)? as i64)),
            _ => Err(Reply::err(format!("unknown command '{name}'"))),
        }
    }

    fn type_of(&self, k: &[u8]) -> R {
        let t = match self.kind(k) {
            Some((kind, _)) => kind.name(),
            None if self.get_string(k)?.is_some() => "string",
            None => "none",
        };
        Ok(Reply::Status(t.into()))
    }

    fn set(&self, a: &[Bytes]) -> R {
        let (mut nx, mut xx, mut get) = (false, false, false);
        for o in &a[2..] {
            if eq(o, "nx") {
                nx = true;
            } else if eq(o, "xx") {
                xx = true;
            } else if eq(o, "get") {
                get = true;
            } else if eq(o, "keepttl") {
                // No key has a TTL, so keeping it changes nothing.
            } else if ["ex", "px", "exat", "pxat"].iter().any(|x| eq(o, x)) {
                return Err(Reply::err("tierkv keys do not expire: EX/PX/EXAT/PXAT are not supported"));
            } else {
                return Err(Reply::err("syntax error"));
            }
        }
        if nx && xx {
            return Err(Reply::err("syntax error"));
        }
        let cond = if nx {
            Cond::Nx
        } else if xx {
            Cond::Xx
        } else {
            Cond::Always
        };
        let (written, old) = self.set_string(&a[0], &a[1], cond, get)?;
        Ok(match (get, written) {
            // With GET the reply is the old value, whether or not the condition let it write.
            (true, _) => old.map_or(Reply::Nil, Reply::Bulk),
            (false, true) => Reply::Ok,
            (false, false) => Reply::Nil,
        })
    }

    /// SET core: (whether it wrote, the old value if `want_old`).
    fn set_string(&self, k: &[u8], v: &[u8], cond: Cond, want_old: bool) -> Result<(bool, Option<Vec<u8>>), Reply> {
        let _l = self.lock_keys(std::iter::once(k));
        let sk = keys::string_key(k);
        if let Some((kind, _)) = self.kind(k) {
            if want_old {
                return Err(Reply::Error(WRONGTYPE.into()));
            }
            if cond == Cond::Nx {
                return Ok((false, None));
            }
            // SET over a hash or sorted set replaces it.
            let mut b = WriteBatch::new();
            self.delete_collection(&mut b, k, kind)?;
            b.put(&sk, v);
            self.commit(b)?;
            self.types.write().remove(k);
            return Ok((true, None));
        }
        let old = if want_old { self.get_string(k)? } else { None };
        let wrote = match cond {
            Cond::Always => self.db.put(&sk, v).map(|_| true),
            Cond::Nx => self.db.insert_if_absent(&sk, v),
            Cond::Xx => self.db.update_if_present(&sk, v),
        }
        .map_err(db_err)?;
        Ok((wrote, old))
    }

    fn mset(&self, a: &[Bytes]) -> R {
        if !a.len().is_multiple_of(2) {
            return Err(Reply::err("wrong number of arguments for 'mset' command"));
        }
        let mut last: BTreeMap<&[u8], &[u8]> = BTreeMap::new();
        for p in a.chunks_exact(2) {
            last.insert(&p[0], &p[1]);
        }
        let _l = self.lock_keys(last.keys().copied());
        let mut b = WriteBatch::new();
        let mut replaced = Vec::new();
        for (k, v) in &last {
            if let Some((kind, _)) = self.kind(k) {
                self.delete_collection(&mut b, k, kind)?;
                replaced.push(k.to_vec());
            }
            b.put(keys::string_key(k), v);
        }
        self.commit(b)?;
        if !replaced.is_empty() {
            let mut t = self.types.write();
            for k in replaced {
                t.remove(&k);
            }
        }
        Ok(Reply::Ok)
    }

    fn del(&self, a: &[Bytes]) -> R {
        let mut ks: Vec<&[u8]> = a.iter().map(|k| &k[..]).collect();
        ks.sort_unstable();
        ks.dedup();
        let _l = self.lock_keys(ks.iter().copied());
        let mut b = WriteBatch::new();
        let mut gone = Vec::new();
        let mut n = 0;
        for k in ks {
            if let Some((kind, _)) = self.kind(k) {
                self.delete_collection(&mut b, k, kind)?;
                gone.push(k.to_vec());
                n += 1;
            } else if self.get_string(k)?.is_some() {
                b.delete(keys::string_key(k));
                n += 1;
            }
        }
        self.commit(b)?;
        let mut t = self.types.write();
        for k in gone {
            t.remove(&k);
        }
        Ok(Reply::Int(n))
    }

    fn incr_by(&self, k: &[u8], by: i64) -> R {
        let _l = self.lock_keys(std::iter::once(k));
        self.expect_string(k)?;
        let cur = match self.get_string(k)? {
            Some(v) => parse_int(&v).ok_or_else(|| Reply::err(NOT_INT))?,
            None => 0,
        };
        let new = cur.checked_add(by).ok_or_else(|| Reply::err("increment or decrement would overflow"))?;
        self.db.put(keys::string_key(k), new.to_string()).map_err(db_err)?;
        Ok(Reply::Int(new))
    }

    fn append(&self, k: &[u8], v: &[u8]) -> R {
        let _l = self.lock_keys(std::iter::once(k));
        self.expect_string(k)?;
        let mut cur = self.get_string(k)?.unwrap_or_default();
        cur.extend_from_slice(v);
        self.db.put(keys::string_key(k), &cur).map_err(db_err)?;
        Ok(Reply::Int(cur.len() as i64))
    }

    fn hset(&self, name: &str, a: &[Bytes]) -> R {
        if !(a.len() - 1).is_multiple_of(2) {
            return Err(Reply::err(format!("wrong number of arguments for '{name}' command")));
        }
        let k = &a[0];
        let _l = self.lock_keys(std::iter::once(&k[..]));
        let count = self.expect_kind(k, Kind::Hash)?;
        let mut fields: BTreeMap<&[u8], &[u8]> = BTreeMap::new();
        for p in a[1..].chunks_exact(2) {
            fields.insert(&p[0], &p[1]);
        }
        let mut b = WriteBatch::new();
        let mut added = 0u64;
        for (f, v) in &fields {
            let fk = keys::hash_field(k, f);
            if count == 0 || self.db.get(&fk).map_err(db_err)?.is_none() {
                added += 1;
            }
            b.put(fk, v);
        }
        self.commit_with_count(b, k, Kind::Hash, count, count + added)?;
        Ok(if name == "hmset" { Reply::Ok } else { Reply::Int(added as i64) })
    }

    fn hdel(&self, a: &[Bytes]) -> R {
        let k = &a[0];
        let _l = self.lock_keys(std::iter::once(&k[..]));
        let count = self.expect_kind(k, Kind::Hash)?;
        if count == 0 {
            return Ok(Reply::Int(0));
        }
        let mut fs: Vec<&[u8]> = a[1..].iter().map(|f| &f[..]).collect();
        fs.sort_unstable();
        fs.dedup();
        let mut b = WriteBatch::new();
        let mut removed = 0u64;
        for f in fs {
            let fk = keys::hash_field(k, f);
            if self.db.get(&fk).map_err(db_err)?.is_some() {
                b.delete(fk);
                removed += 1;
            }
        }
        self.commit_with_count(b, k, Kind::Hash, count, count.saturating_sub(removed))?;
        Ok(Reply::Int(removed as i64))
    }

    fn zadd(&self, a: &[Bytes]) -> R {
        let k = &a[0];
        let (mut nx, mut xx, mut gt, mut lt, mut ch, mut incr) = (false, false, false, false, false, false);
        let mut i = 1;
        while i < a.len() {
            let o = &a[i];
            if eq(o, "nx") {
                nx = true;
            } else if eq(o, "xx") {
                xx = true;
            } else if eq(o, "gt") {
                gt = true;
            } else if eq(o, "lt") {
                lt = true;
            } else if eq(o, "ch") {
                ch = true;
            } else if eq(o, "incr") {
                incr = true;
            } else {
                break;
            }
            i += 1;
        }
        let pairs = &a[i..];
        if pairs.is_empty() || !pairs.len().is_multiple_of(2) {
            return Err(Reply::err("syntax error"));
        }
        if nx && xx {
            return Err(Reply::err("XX and NX options at the same time are not compatible"));
        }
        if (nx && (gt || lt)) || (gt && lt) {
            return Err(Reply::err("GT, LT, and/or NX options at the same time are not compatible"));
        }
        if incr && pairs.len() > 2 {
            return Err(Reply::err("INCR option supports a single increment-element pair"));
        }
        let mut scored = Vec::with_capacity(pairs.len() / 2);
        for p in pairs.chunks_exact(2) {
            scored.push((parse_score(&p[0]).ok_or_else(|| Reply::err(NOT_FLOAT))?, &p[1][..]));
        }
        let _l = self.lock_keys(std::iter::once(&k[..]));
        let count = self.expect_kind(k, Kind::Zset)?;
        // Current score of each member touched, as this command changes them.
        let mut now: HashMap<&[u8], Option<f64>> = HashMap::new();
        let mut first: HashMap<&[u8], Option<f64>> = HashMap::new();
        let (mut added, mut changed) = (0i64, 0i64);
        let mut incr_result = None;
        for (score, m) in scored {
            let cur = match now.get(m) {
                Some(c) => *c,
                None => {
                    let c = if count == 0 {
                        None
                    } else {
                        self.db.get(keys::zmember(k, m)).map_err(db_err)?.as_deref().and_then(keys::decode_score)
                    };
                    first.insert(m, c);
                    c
                }
            };
            let new = match cur {
                Some(c) => {
                    if nx {
                        now.insert(m, cur);
                        continue;
                    }
                    let new = if incr { c + score } else { score };
                    if new.is_nan() {
                        return Err(Reply::err("resulting score is not a number (NaN)"));
                    }
                    if (gt && new <= c) || (lt && new >= c) {
                        now.insert(m, cur);
                        continue;
                    }
                    if new != c {
                        changed += 1;
                    }
                    new
                }
                None => {
                    if xx {
                        now.insert(m, cur);
                        continue;
                    }
                    added += 1;
                    changed += 1;
                    score
                }
            };
            incr_result = Some(new);
            now.insert(m, Some(new));
        }
        let mut b = WriteBatch::new();
        for (m, new) in &now {
            let old = first.get(m).copied().flatten();
            match (old, *new) {
                (Some(o), Some(n)) if o == n => {}
                (old, Some(n)) => {
                    if let Some(o) = old {
                        b.delete(keys::zscore(k, o, m));
                    }
                    b.put(keys::zscore(k, n, m), []);
                    b.put(keys::zmember(k, m), n.to_bits().to_le_bytes());
                }
                (_, None) => {}
            }
        }
        self.commit_with_count(b, k, Kind::Zset, count, count + added as u64)?;
        if incr {
            return Ok(incr_result.map_or(Reply::Nil, |v| Reply::Bulk(format_score(v).into_bytes())));
        }
        Ok(Reply::Int(if ch { changed } else { added }))
    }

    fn zrem(&self, a: &[Bytes]) -> R {
        let k = &a[0];
        let _l = self.lock_keys(std::iter::once(&k[..]));
        let count = self.expect_kind(k, Kind::Zset)?;
        if count == 0 {
            return Ok(Reply::Int(0));
        }
        let mut ms: Vec<&[u8]> = a[1..].iter().map(|m| &m[..]).collect();
        ms.sort_unstable();
        ms.dedup();
        let mut b = WriteBatch::new();
        let mut removed = 0u64;
        for m in ms {
            let mk = keys::zmember(k, m);
            if let Some(v) = self.db.get(&mk).map_err(db_err)? {
                let sc = keys::decode_score(&v).ok_or_else(|| Reply::err("corrupt sorted-set member record"))?;
                b.delete(mk);
                b.delete(keys::zscore(k, sc, m));
                removed += 1;
            }
        }
        self.commit_with_count(b, k, Kind::Zset, count, count.saturating_sub(removed))?;
        Ok(Reply::Int(removed as i64))
    }

    fn zrangebyscore(&self, a: &[Bytes]) -> R {
        let k = &a[0];
        let (min, minx) = parse_bound(&a[1]).ok_or_else(|| Reply::err("min or max is not a float"))?;
        let (max, maxx) = parse_bound(&a[2]).ok_or_else(|| Reply::err("min or max is not a float"))?;
        let (mut withscores, mut offset, mut limit) = (false, 0i64, -1i64);
        let mut i = 3;
        while i < a.len() {
            if eq(&a[i], "withscores") {
                withscores = true;
                i += 1;
            } else if eq(&a[i], "limit") && i + 2 < a.len() {
                offset = parse_int(&a[i + 1]).ok_or_else(|| Reply::err(NOT_INT))?;
                limit = parse_int(&a[i + 2]).ok_or_else(|| Reply::err(NOT_INT))?;
                i += 3;
            } else {
                return Err(Reply::err("syntax error"));
            }
        }
        if self.expect_kind(k, Kind::Zset)? == 0 || offset < 0 || limit == 0 {
            return Ok(Reply::Array(Vec::new()));
        }
        let p = keys::zscore_prefix(k);
        let lo_s = keys::sortable(min);
        let hi_s = keys::sortable(max);
        if lo_s > hi_s || (lo_s == hi_s && (minx || maxx)) {
            return Ok(Reply::Array(Vec::new()));
        }
        let mut lo = p.clone();
        lo.extend_from_slice(&(if minx { lo_s + 1 } else { lo_s }).to_be_bytes());
        let mut hi = p.clone();
        let hi_bound = if maxx { Some(hi_s) } else { hi_s.checked_add(1) };
        let upper = match hi_bound {
            Some(h) => {
                hi.extend_from_slice(&h.to_be_bytes());
                Bound::Excluded(&hi[..])
            }
            None => Bound::Unbounded,
        };
        let pend = keys::prefix_end(&p);
        let mut out = Vec::new();
        let mut skipped = 0i64;
        for e in self.db.scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Included(&lo[..]), upper)).map_err(db_err)? {
            let (ik, _) = e.map_err(db_err)?;
            if pend.as_deref().is_some_and(|end| ik.as_slice() >= end) || ik.len() < p.len() + 8 {
                break;
            }
            if skipped < offset {
                skipped += 1;
                continue;
            }
            let mut sb = [0u8; 8];
            sb.copy_from_slice(&ik[p.len()..p.len() + 8]);
            out.push(Reply::Bulk(ik[p.len() + 8..].to_vec()));
            if withscores {
                out.push(Reply::Bulk(format_score(keys::unsortable(u64::from_be_bytes(sb))).into_bytes()));
            }
            if limit > 0 && out.len() as i64 >= limit * if withscores { 2 } else { 1 } {
                break;
            }
        }
        Ok(Reply::Array(out))
    }

    /// Logical keys, in the order SCAN visits them: strings (raw keys below `0xFF`), then
    /// hashes and sorted sets (type records), then strings stored escaped.
    fn phase_range(phase: u8) -> Option<(Vec<u8>, Option<Vec<u8>>)> {
        match phase {
            0 => Some((Vec::new(), Some(vec![keys::META]))),
            1 => {
                let (a, b) = keys::type_range();
                Some((a, Some(b)))
            }
            2 => {
                let (a, b) = keys::escaped_range();
                Some((a, Some(b)))
            }
            _ => None,
        }
    }

    fn logical(phase: u8, stored: &[u8]) -> &[u8] {
        match phase {
            0 => stored,
            _ => &stored[2..],
        }
    }

    /// Walk logical keys from `pos`, calling `f` for each, examining at most `budget` keys
    /// (`usize::MAX`: all). Returns where to resume (`None`: done).
    fn walk(&self, mut pos: ScanPos, budget: usize, mut f: impl FnMut(u8, &[u8])) -> Result<Option<ScanPos>, Reply> {
        let mut seen = 0usize;
        while let Some((lo, hi)) = Keyspace::phase_range(pos.phase) {
            let start = match &pos.after {
                Some(a) => Bound::Excluded(&a[..]),
                None => Bound::Included(&lo[..]),
            };
            let end = hi.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
            for e in self.db.scan::<(Bound<&[u8]>, Bound<&[u8]>)>((start, end)).map_err(db_err)? {
                let (k, _) = e.map_err(db_err)?;
                f(pos.phase, Keyspace::logical(pos.phase, &k));
                seen += 1;
                if seen >= budget {
                    return Ok(Some(ScanPos { phase: pos.phase, after: Some(k) }));
                }
            }
            pos = ScanPos { phase: pos.phase + 1, after: None };
        }
        Ok(None)
    }

    fn dbsize(&self) -> Result<u64, Reply> {
        let mut n = 0u64;
        self.walk(ScanPos { phase: 0, after: None }, usize::MAX, |_, _| n += 1)?;
        Ok(n)
    }

    fn scan(&self, a: &[Bytes]) -> R {
        let cursor: u64 =
            std::str::from_utf8(&a[0]).ok().and_then(|s| s.parse().ok()).ok_or_else(|| Reply::err("invalid cursor"))?;
        let (mut pattern, mut count, mut typ) = (None, 10usize, None);
        let mut i = 1;
        while i < a.len() {
            if i + 1 >= a.len() {
                return Err(Reply::err("syntax error"));
            }
            if eq(&a[i], "match") {
                pattern = Some(&a[i + 1][..]);
            } else if eq(&a[i], "count") {
                count = match parse_int(&a[i + 1]) {
                    Some(c) if c >= 1 => c as usize,
                    Some(_) => return Err(Reply::err("syntax error")),
                    None => return Err(Reply::err(NOT_INT)),
                };
            } else if eq(&a[i], "type") {
                typ = Some(String::from_utf8_lossy(&a[i + 1]).to_ascii_lowercase());
            } else {
                return Err(Reply::err("syntax error"));
            }
            i += 2;
        }
        let pos = if cursor == 0 {
            ScanPos { phase: 0, after: None }
        } else {
            self.cursors.lock().map.get(&cursor).cloned().ok_or_else(|| Reply::err("invalid cursor"))?
        };
        let mut keys_out = Vec::new();
        let next = self.walk(pos, count, |phase, k| {
            if pattern.is_some_and(|p| !glob::matches(p, k)) {
                return;
            }
            if let Some(t) = &typ {
                let kind = match phase {
                    1 => self.kind(k).map_or("none", |(kind, _)| kind.name()),
                    _ => "string",
                };
                if kind != t {
                    return;
                }
            }
            keys_out.push(Reply::Bulk(k.to_vec()));
        })?;
        let next_cursor = match next {
            None => 0,
            Some(p) => {
                let mut c = self.cursors.lock();
                let id = loop {
                    let id = rand::random::<u64>() >> 1;
                    if id != 0 && !c.map.contains_key(&id) {
                        break id;
                    }
                };
                c.map.insert(id, p);
                c.order.push_back(id);
                while c.order.len() > MAX_CURSORS {
                    if let Some(old) = c.order.pop_front() {
                        c.map.remove(&old);
                    }
                }
                id
            }
        };
        Ok(Reply::Array(vec![Reply::Bulk(next_cursor.to_string().into_bytes()), Reply::Array(keys_out)]))
    }

    fn flushdb(&self, a: &[Bytes]) -> R {
        if a.len() > 1 || a.first().is_some_and(|o| !eq(o, "sync") && !eq(o, "async")) {
            return Err(Reply::err("syntax error"));
        }
        let _g = self.global.write();
        loop {
            let mut b = WriteBatch::new();
            for e in self
                .db
                .scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Unbounded, Bound::Unbounded))
                .map_err(db_err)?
                .take(1024)
            {
                let (k, _) = e.map_err(db_err)?;
                b.delete(k);
            }
            if b.is_empty() {
                break;
            }
            self.commit(b)?;
        }
        self.types.write().clear();
        self.cursors.lock().map.clear();
        Ok(Reply::Ok)
    }

    fn command(&self, a: &[Bytes]) -> R {
        let Some(sub) = a.first() else {
            return Ok(Reply::Array(COMMANDS.iter().map(|(n, ar, f)| command_entry(n, *ar, f)).collect()));
        };
        if eq(sub, "count") {
            Ok(Reply::Int(COMMANDS.len() as i64))
        } else if eq(sub, "docs") {
            // No documentation: clients fall back to their built-in help.
            Ok(Reply::Array(Vec::new()))
        } else if eq(sub, "info") {
            Ok(Reply::Array(
                a[1..]
                    .iter()
                    .map(|n| {
                        let n = String::from_utf8_lossy(n).to_ascii_lowercase();
                        COMMANDS.iter().find(|c| c.0 == n).map_or(Reply::Nil, |(n, ar, f)| command_entry(n, *ar, f))
                    })
                    .collect(),
            ))
        } else if eq(sub, "list") {
            Ok(Reply::Array(COMMANDS.iter().map(|c| Reply::bulk(c.0)).collect()))
        } else {
            Err(Reply::err(format!("unknown subcommand '{}'. Try COMMAND HELP.", String::from_utf8_lossy(sub))))
        }
    }

    fn config_params(&self) -> Vec<(&'static str, String)> {
        let s = &self.settings;
        vec![
            ("save", String::new()),
            ("appendonly", "no".into()),
            ("databases", "1".into()),
            ("maxmemory", "0".into()),
            ("port", s.port.to_string()),
            ("bind", s.bind.clone()),
            ("timeout", s.timeout_secs.to_string()),
            ("maxclients", s.max_clients.to_string()),
            ("proto-max-bulk-len", s.limits.max_bulk_len.to_string()),
        ]
    }

    fn config(&self, a: &[Bytes]) -> R {
        if eq(&a[0], "get") {
            if a.len() < 2 {
                return Err(Reply::err("wrong number of arguments for 'config|get' command"));
            }
            let mut out = Vec::new();
            for (name, v) in self.config_params() {
                if a[1..].iter().any(|p| glob::matches(&p.to_ascii_lowercase(), name.as_bytes())) {
                    out.push(Reply::bulk(name));
                    out.push(Reply::bulk(v));
                }
            }
            Ok(Reply::Array(out))
        } else if eq(&a[0], "resetstat") {
            self.counters.commands.store(0, Ordering::Relaxed);
            Ok(Reply::Ok)
        } else {
            Err(Reply::err(format!(
                "CONFIG {} is not supported by tierkv (settings are command-line options of `tierkv serve`)",
                String::from_utf8_lossy(&a[0]).to_ascii_uppercase()
            )))
        }
    }

    fn hello(&self, s: &mut Session, a: &[Bytes]) -> R {
        if let Some(v) = a.first() {
            match parse_int(v) {
                Some(2) => {}
                Some(_) => return Err(Reply::Error("NOPROTO sorry, this protocol version is not supported".into())),
                None => return Err(Reply::err("Protocol version is not an integer or out of range")),
            }
            if a.len() > 1 {
                return Err(Reply::err("HELLO options (AUTH, SETNAME) are not supported by tierkv"));
            }
        }
        Ok(Reply::Array(vec![
            Reply::bulk("server"),
            Reply::bulk("redis"),
            Reply::bulk("version"),
            Reply::bulk(REDIS_VERSION),
            Reply::bulk("proto"),
            Reply::Int(2),
            Reply::bulk("id"),
            Reply::Int(s.id as i64),
            Reply::bulk("mode"),
            Reply::bulk("standalone"),
            Reply::bulk("role"),
            Reply::bulk("master"),
            Reply::bulk("modules"),
            Reply::Array(Vec::new()),
        ]))
    }

    fn info(&self, a: &[Bytes]) -> R {
        let want = |sec: &str| {
            a.is_empty() || a.iter().any(|x| eq(x, sec) || eq(x, "all") || eq(x, "everything") || eq(x, "default"))
        };
        let mut t = String::new();
        let c = &self.counters;
        if want("server") {
            t.push_str(&format!(
                "# Server\r\nredis_version:{REDIS_VERSION}\r\ntierkv_version:{}\r\nredis_mode:standalone\r\nos:{}\r\narch_bits:64\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{}\r\n\r\n",
                env!("CARGO_PKG_VERSION"),
                std::env::consts::OS,
                std::process::id(),
                self.settings.port,
                self.started.elapsed().as_secs()
            ));
        }
        if want("clients") {
            t.push_str(&format!(
                "# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\n\r\n",
                c.connected.load(Ordering::Relaxed),
                self.settings.max_clients
            ));
        }
        if want("persistence") {
            t.push_str("# Persistence\r\nloading:0\r\naof_enabled:0\r\nrdb_bgsave_in_progress:0\r\n\r\n");
        }
        if want("stats") {
            t.push_str(&format!(
                "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\nrejected_connections:{}\r\n\r\n",
                c.accepted.load(Ordering::Relaxed),
                c.commands.load(Ordering::Relaxed),
                c.rejected.load(Ordering::Relaxed)
            ));
        }
        if want("keyspace") {
            let n = self.dbsize()?;
            t.push_str("# Keyspace\r\n");
            if n > 0 {
                t.push_str(&format!("db0:keys={n},expires=0,avg_ttl=0\r\n"));
            }
            t.push_str("\r\n");
        }
        if want("tierkv") {
            t.push_str(&format!("# Tierkv\r\npreset:{}\r\n", self.db.preset()));
            if let Ok(serde_json::Value::Object(m)) = serde_json::to_value(self.db.stats()) {
                for (k, v) in m {
                    if v.is_number() || v.is_boolean() {
                        t.push_str(&format!("{k}:{v}\r\n"));
                    }
                }
            }
            t.push_str("\r\n");
        }
        Ok(Reply::Bulk(t.into_bytes()))
    }
}

/// The Redis version tierkv reports to clients (INFO, HELLO): the command set and reply
/// shapes it follows.
pub const REDIS_VERSION: &str = "7.0.0";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cond {
    Always,
    Nx,
    Xx,
}

fn trunc(b: &[u8]) -> String {
    String::from_utf8_lossy(&b[..b.len().min(128)]).into_owned()
}

fn client(s: &mut Session, a: &[Bytes]) -> R {
    if eq(&a[0], "setname") && a.len() == 2 {
        if a[1].iter().any(|&c| c <= b' ' || c > b'~') {
            return Err(Reply::err("Client names cannot contain spaces, newlines or special characters."));
        }
        s.name = (!a[1].is_empty()).then(|| a[1].to_vec());
        Ok(Reply::Ok)
    } else if eq(&a[0], "getname") {
        Ok(s.name.clone().map_or(Reply::Nil, Reply::Bulk))
    } else if eq(&a[0], "id") {
        Ok(Reply::Int(s.id as i64))
    } else if eq(&a[0], "setinfo") {
        Ok(Reply::Ok)
    } else {
        Err(Reply::err(format!(
            "unknown subcommand or wrong number of arguments for '{}'. Try CLIENT HELP.",
            String::from_utf8_lossy(&a[0])
        )))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn scores_parse_and_print_as_redis() {
        assert_eq!(parse_score(b"-5.94971599E8"), Some(-594971599.0));
        assert_eq!(parse_score(b"+inf"), Some(f64::INFINITY));
        assert_eq!(parse_score(b"-inf"), Some(f64::NEG_INFINITY));
        assert_eq!(parse_score(b"nan"), None);
        assert_eq!(parse_score(b" 1"), None);
        assert_eq!(format_score(-594971599.0), "-594971599");
        assert_eq!(format_score(1.5), "1.5");
        assert_eq!(format_score(1e21), "1e+21");
        assert_eq!(format_score(f64::NEG_INFINITY), "-inf");
        assert_eq!(parse_int(b"007"), None);
        assert_eq!(parse_int(b"-12"), Some(-12));
        assert_eq!(parse_int(b"9223372036854775808"), None);
    }
}
