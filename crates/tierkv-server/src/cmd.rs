//! Command execution: Redis's commands over a tierkv [`Db`], with the keyspace encoding of
//! [`crate::keys`]. The commands themselves are in [`crate::strings`] (strings, the
//! keyspace, expiry), [`crate::collections`] (hashes, sorted sets), [`crate::multi`]
//! (MULTI/EXEC/WATCH), [`crate::script`] (EVAL) and here (connection and server commands).
//!
//! # Atomicity and concurrency
//! Every command runs through a [`Txn`] (see [`crate::txn`]): a command that writes locks the
//! stripe of each key it touches (4,096 stripes, picked by a hash of the key; several keys
//! are locked in stripe order, so no deadlock), stages its changes, and commits them with one
//! atomic [`tierkv::WriteBatch`]. So INCR, APPEND, GETSET, HSET's field count, ZADD's score
//! index and DEL of a hash are atomic with respect to every other client of this server, and
//! crash-atomic (a batch is all or nothing in every preset). Reads of plain strings take no
//! lock. `EXEC`, scripts and `FLUSHDB` take a global lock exclusively (every other command
//! takes it shared).
//!
//! # The directories
//! The names of all hashes and sorted sets, with their field/member counts, and the expiry
//! time of every key that has one are kept in DRAM (loaded at start from the type records
//! and the expiring-string records), so SET/GET/DEL of a string need no extra read to rule
//! out a hash of the same name or to find its expiry. Strings without expiry are not in them
//! (there can be billions).
//!
//! # A reply only after the write is durable
//! Each command's batch returns from [`Db::write`] only once durable at the preset's level
//! (SPEC §2), and the reply is produced after it.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::ops::Bound;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use parking_lot::{Mutex, MutexGuard, RwLock};
use tierkv::Db;

use crate::auth::Password;
use crate::keys::{self, Kind};
use crate::resp::Reply;
use crate::txn::{now_ms, Changes, Expires, Txn};

const STRIPES: usize = 4096;
pub(crate) const WRONGTYPE: &str = "WRONGTYPE Operation against a key holding the wrong kind of value";
pub(crate) const NOT_INT: &str = "value is not an integer or out of range";
pub(crate) const NOT_FLOAT: &str = "value is not a valid float";
/// Most open SCAN cursors remembered; the oldest is forgotten first.
pub(crate) const MAX_CURSORS: usize = 65_536;

/// Server settings a client can read (CONFIG GET, INFO), and the password.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// Listening port (0: none).
    pub port: u16,
    /// TLS port (0: none).
    pub tls_port: u16,
    /// Bind address.
    pub bind: String,
    /// Idle timeout in seconds (0 = none).
    pub timeout_secs: u64,
    /// Most simultaneous clients.
    pub max_clients: usize,
    /// Request limits.
    pub limits: crate::resp::Limits,
    /// The default user's password (`None`: no AUTH needed).
    pub requirepass: Option<Password>,
    /// Protected mode: without a password, only loopback clients are served.
    pub protected_mode: bool,
}

/// Server-wide counters.
#[derive(Debug, Default)]
pub struct Counters {
    /// Connections open now.
    pub connected: AtomicU64,
    /// Connections accepted since start.
    pub accepted: AtomicU64,
    /// Connections refused (over max clients, or protected mode).
    pub rejected: AtomicU64,
    /// Commands executed.
    pub commands: AtomicU64,
    /// Keys deleted because they expired (by the sweep or lazily).
    pub expired: AtomicU64,
    /// Failed AUTH attempts.
    pub auth_failures: AtomicU64,
}

/// A key watched by a connection: its version and its expiry when WATCH ran.
#[derive(Debug, Clone)]
pub struct Watched {
    pub(crate) key: Vec<u8>,
    pub(crate) version: u64,
    pub(crate) deadline: Option<u64>,
}

/// One connection's state.
#[derive(Debug)]
pub struct Session {
    /// Connection id (CLIENT ID).
    pub id: u64,
    /// CLIENT SETNAME.
    pub name: Option<Vec<u8>>,
    /// QUIT was received: reply, then close.
    pub quit: bool,
    /// Protocol version of replies (2 or 3; HELLO switches).
    pub proto: u8,
    /// Authenticated (always, when no password is set).
    pub authed: bool,
    /// The client's address (for the log of failed AUTH).
    pub peer: Option<std::net::SocketAddr>,
    /// Commands queued since MULTI.
    pub(crate) multi: Option<Vec<Vec<Bytes>>>,
    /// A command was refused while queuing: EXEC will abort.
    pub(crate) multi_dirty: bool,
    /// Bytes of the commands queued since MULTI (held to the query-buffer limit).
    pub(crate) multi_bytes: usize,
    pub(crate) watched: Vec<Watched>,
    /// READONLY: stale reads on a replica (see [`crate::replica`]).
    pub(crate) readonly: bool,
}

impl Default for Session {
    fn default() -> Self {
        Session {
            id: 0,
            name: None,
            quit: false,
            proto: 2,
            authed: true,
            peer: None,
            multi: None,
            multi_dirty: false,
            multi_bytes: 0,
            watched: Vec::new(),
            readonly: false,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ScanPos {
    pub(crate) phase: u8,
    pub(crate) after: Option<Vec<u8>>,
}

#[derive(Debug, Default)]
pub(crate) struct Cursors {
    pub(crate) map: HashMap<u64, ScanPos>,
    pub(crate) order: std::collections::VecDeque<u64>,
}

/// The server's view of a store.
pub struct Keyspace {
    db: Arc<Db>,
    pub(crate) types: RwLock<HashMap<Vec<u8>, (Kind, u64)>>,
    pub(crate) expires: RwLock<Expires>,
    stripes: Box<[Mutex<()>]>,
    pub(crate) global: RwLock<()>,
    pub(crate) cursors: Mutex<Cursors>,
    /// WATCHed keys: version (bumped by every write) and number of watchers.
    pub(crate) watches: Mutex<HashMap<Vec<u8>, (u64, usize)>>,
    pub(crate) watching: AtomicUsize,
    pub(crate) scripts: crate::script::Scripts,
    /// The ports actually bound (plain, TLS; 0: none), shown by CONFIG GET and INFO.
    ports: Mutex<(u16, u16)>,
    /// Counters shown by INFO.
    pub counters: Counters,
    /// Settings shown by CONFIG GET and INFO.
    pub settings: Settings,
    started: Instant,
    /// Set on a replicated server ([`crate::replica`]).
    pub(crate) replica: Option<crate::replica::Replica>,
}

impl std::fmt::Debug for Keyspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyspace").field("db", &self.db).finish()
    }
}

pub(crate) type R = Result<Reply, Reply>;

pub(crate) fn db_err(e: tierkv::Error) -> Reply {
    Reply::err(e)
}

pub(crate) fn eq(a: &[u8], b: &str) -> bool {
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
    if v.is_nan() {
        return "nan".into();
    }
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

/// A command table entry: (name, arity as Redis: n = exactly n words, -n = at least n;
/// flags; first key, last key, step), as COMMAND INFO reports it.
pub type CommandSpec = (&'static str, i64, &'static [&'static str], i64, i64, i64);

/// Every command tierkv serves.
pub const COMMANDS: &[CommandSpec] = &[
    ("ping", -1, &["fast"], 0, 0, 0),
    ("echo", 2, &["fast"], 0, 0, 0),
    ("quit", -1, &["fast", "no_auth"], 0, 0, 0),
    ("select", 2, &["fast"], 0, 0, 0),
    ("command", -1, &["random"], 0, 0, 0),
    ("info", -1, &["random"], 0, 0, 0),
    ("config", -2, &["admin"], 0, 0, 0),
    ("client", -2, &["admin"], 0, 0, 0),
    ("hello", -1, &["fast", "no_auth"], 0, 0, 0),
    ("auth", -2, &["fast", "no_auth"], 0, 0, 0),
    ("readonly", 1, &["fast"], 0, 0, 0),
    ("readwrite", 1, &["fast"], 0, 0, 0),
    ("dbsize", 1, &["readonly"], 0, 0, 0),
    ("flushdb", -1, &["write"], 0, 0, 0),
    ("keys", 2, &["readonly"], 0, 0, 0),
    ("scan", -2, &["readonly"], 0, 0, 0),
    ("type", 2, &["readonly", "fast"], 1, 1, 1),
    ("get", 2, &["readonly", "fast"], 1, 1, 1),
    ("set", -3, &["write", "denyoom"], 1, 1, 1),
    ("setnx", 3, &["write", "denyoom", "fast"], 1, 1, 1),
    ("setex", 4, &["write", "denyoom"], 1, 1, 1),
    ("psetex", 4, &["write", "denyoom"], 1, 1, 1),
    ("getset", 3, &["write", "denyoom", "fast"], 1, 1, 1),
    ("getex", -2, &["write", "fast"], 1, 1, 1),
    ("getdel", 2, &["write", "fast"], 1, 1, 1),
    ("mget", -2, &["readonly", "fast"], 1, -1, 1),
    ("mset", -3, &["write", "denyoom"], 1, -1, 2),
    ("del", -2, &["write"], 1, -1, 1),
    ("unlink", -2, &["write", "fast"], 1, -1, 1),
    ("exists", -2, &["readonly", "fast"], 1, -1, 1),
    ("incr", 2, &["write", "denyoom", "fast"], 1, 1, 1),
    ("decr", 2, &["write", "denyoom", "fast"], 1, 1, 1),
    ("incrby", 3, &["write", "denyoom", "fast"], 1, 1, 1),
    ("decrby", 3, &["write", "denyoom", "fast"], 1, 1, 1),
    ("append", 3, &["write", "denyoom", "fast"], 1, 1, 1),
    ("strlen", 2, &["readonly", "fast"], 1, 1, 1),
    ("expire", -3, &["write", "fast"], 1, 1, 1),
    ("pexpire", -3, &["write", "fast"], 1, 1, 1),
    ("expireat", -3, &["write", "fast"], 1, 1, 1),
    ("pexpireat", -3, &["write", "fast"], 1, 1, 1),
    ("ttl", 2, &["readonly", "fast"], 1, 1, 1),
    ("pttl", 2, &["readonly", "fast"], 1, 1, 1),
    ("expiretime", 2, &["readonly", "fast"], 1, 1, 1),
    ("pexpiretime", 2, &["readonly", "fast"], 1, 1, 1),
    ("persist", 2, &["write", "fast"], 1, 1, 1),
    ("hset", -4, &["write", "denyoom", "fast"], 1, 1, 1),
    ("hmset", -4, &["write", "denyoom", "fast"], 1, 1, 1),
    ("hget", 3, &["readonly", "fast"], 1, 1, 1),
    ("hmget", -3, &["readonly", "fast"], 1, 1, 1),
    ("hgetall", 2, &["readonly"], 1, 1, 1),
    ("hdel", -3, &["write", "fast"], 1, 1, 1),
    ("hlen", 2, &["readonly", "fast"], 1, 1, 1),
    ("zadd", -4, &["write", "denyoom", "fast"], 1, 1, 1),
    ("zrem", -3, &["write", "fast"], 1, 1, 1),
    ("zrangebyscore", -4, &["readonly"], 1, 1, 1),
    ("zscore", 3, &["readonly", "fast"], 1, 1, 1),
    ("zcard", 2, &["readonly", "fast"], 1, 1, 1),
    ("multi", 1, &["fast", "no_multi"], 0, 0, 0),
    ("exec", 1, &["no_multi"], 0, 0, 0),
    ("discard", 1, &["fast", "no_multi"], 0, 0, 0),
    ("watch", -2, &["fast", "no_multi"], 1, -1, 1),
    ("unwatch", 1, &["fast"], 0, 0, 0),
    ("eval", -3, &["noscript", "no_multi"], 0, 0, 0),
    ("evalsha", -3, &["noscript", "no_multi"], 0, 0, 0),
    ("script", -2, &["noscript", "no_multi"], 0, 0, 0),
];

fn command_entry(c: &CommandSpec) -> Reply {
    let (name, arity, flags, first, last, step) = *c;
    Reply::Array(vec![
        Reply::bulk(name),
        Reply::Int(arity),
        Reply::Array(flags.iter().map(|f| Reply::Status((*f).into())).collect()),
        Reply::Int(first),
        Reply::Int(last),
        Reply::Int(step),
    ])
}

/// Look a command up and check its arity: (canonical name, the `COMMANDS` entry).
pub(crate) fn lookup(args: &[Bytes]) -> Result<&'static str, Reply> {
    let Some(name) = args.first() else { return Err(Reply::err("empty command")) };
    let lname = String::from_utf8_lossy(name).to_ascii_lowercase();
    let Some(&(cname, arity, ..)) = COMMANDS.iter().find(|c| c.0 == lname) else {
        // As Redis: the arguments are quoted until 128 bytes of them are (so the error stays
        // short whatever the command's size).
        let mut shown = String::new();
        for a in &args[1..] {
            if shown.len() >= 128 {
                break;
            }
            let room = 128 - shown.len();
            shown.push_str(&format!("'{}' ", String::from_utf8_lossy(&a[..a.len().min(room)])));
        }
        return Err(Reply::err(format!("unknown command '{}', with args beginning with: {shown}", trunc(name))));
    };
    let n = args.len() as i64;
    if (arity > 0 && n != arity) || (arity < 0 && n < -arity) {
        return Err(Reply::err(format!("wrong number of arguments for '{cname}' command")));
    }
    Ok(cname)
}

fn corrupt_at_start(db: &Db, what: &str, k: &[u8]) -> tierkv::Error {
    tierkv::Error::Corruption {
        file: db.path().to_path_buf(),
        offset: 0,
        detail: format!(
            "server {what} of key {} is malformed or of an unknown encoding version (this server reads versions 1 and {})",
            tierkv::escape(k),
            keys::VERSION
        ),
    }
}

impl Keyspace {
    /// Load the directories of `db` (type records, expiry times) and serve it.
    pub fn new(db: Arc<Db>, settings: Settings) -> tierkv::Result<Keyspace> {
        let (types, expires) = Keyspace::load_directories(&db)?;
        Ok(Keyspace {
            db,
            types: RwLock::new(types),
            expires: RwLock::new(expires),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            global: RwLock::new(()),
            cursors: Mutex::new(Cursors::default()),
            watches: Mutex::new(HashMap::new()),
            watching: AtomicUsize::new(0),
            scripts: crate::script::Scripts::default(),
            ports: Mutex::new((settings.port, settings.tls_port)),
            counters: Counters::default(),
            settings,
            started: Instant::now(),
            replica: None,
        })
    }

    /// The DRAM directories of `db`: type records and expiry times.
    #[allow(clippy::type_complexity)]
    pub(crate) fn load_directories(db: &Db) -> tierkv::Result<(HashMap<Vec<u8>, (Kind, u64)>, Expires)> {
        let mut types = HashMap::new();
        let mut expires = Expires::default();
        let (lo, hi) = keys::type_range();
        for e in db.scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Included(&lo), Bound::Excluded(&hi)))? {
            let (k, v) = e?;
            let name = k.get(2..).unwrap_or_default();
            let (kind, count, at) = keys::decode_type(&v).ok_or_else(|| corrupt_at_start(db, "type record", name))?;
            types.insert(name.to_vec(), (kind, count));
            if at.is_some() {
                expires.set(name, at);
            }
        }
        let (lo, hi) = keys::expiring_range();
        for e in db.scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Included(&lo), Bound::Excluded(&hi)))? {
            let (k, v) = e?;
            let name = k.get(2..).unwrap_or_default();
            let (at, _) = keys::decode_expiring(&v).ok_or_else(|| corrupt_at_start(db, "expiring string", name))?;
            expires.set(name, Some(at));
        }
        Ok((types, expires))
    }

    /// The store.
    pub fn db(&self) -> &Arc<Db> {
        &self.db
    }

    /// Record the ports the server bound (a requested port 0 picks one).
    pub fn set_ports(&self, plain: u16, tls: u16) {
        *self.ports.lock() = (plain, tls);
    }

    pub(crate) fn stripe(k: &[u8]) -> usize {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        k.hash(&mut h);
        (h.finish() as usize) % STRIPES
    }

    pub(crate) fn stripe_lock_at(&self, i: usize) -> MutexGuard<'_, ()> {
        self.stripes[i % STRIPES].lock()
    }

    /// A new connection's session: authenticated at once when no password is set.
    pub fn session(&self, id: u64, peer: Option<std::net::SocketAddr>) -> Session {
        Session { id, peer, authed: self.settings.requirepass.is_none(), ..Session::default() }
    }

    /// Apply staged changes: one atomic durable write, then the directories, then WATCH.
    pub(crate) fn apply(&self, c: Changes) -> Result<(), Reply> {
        match c.writes.len() {
            0 => {}
            _ if self.replica.is_some() => self.write_batch(Txn::batch(c.writes))?,
            1 => {
                if let Some((k, v)) = c.writes.into_iter().next() {
                    match v {
                        Some(v) => self.db.put(k, v),
                        None => self.db.delete(k),
                    }
                    .map_err(db_err)?;
                }
            }
            _ => self.db.write(Txn::batch(c.writes)).map_err(db_err)?,
        }
        if !c.types.is_empty() {
            let mut t = self.types.write();
            for (k, v) in c.types {
                match v {
                    Some(x) => t.insert(k, x),
                    None => t.remove(&k),
                };
            }
        }
        if !c.expires.is_empty() {
            let mut e = self.expires.write();
            for (k, v) in c.expires {
                e.set(&k, v);
            }
        }
        if c.reaped > 0 {
            self.counters.expired.fetch_add(c.reaped, Ordering::Relaxed);
        }
        if self.watching.load(Ordering::SeqCst) > 0 && !c.touched.is_empty() {
            let mut w = self.watches.lock();
            for k in c.touched {
                if let Some(e) = w.get_mut(&k) {
                    e.0 += 1;
                }
            }
        }
        Ok(())
    }

    /// Execute one command.
    pub fn exec(&self, s: &mut Session, args: &[Bytes]) -> Reply {
        self.counters.commands.fetch_add(1, Ordering::Relaxed);
        let cname = match lookup(args) {
            Ok(c) => c,
            Err(e) => {
                if s.multi.is_some() {
                    s.multi_dirty = true;
                }
                return e;
            }
        };
        if !s.authed && !matches!(cname, "auth" | "hello" | "quit") {
            if s.multi.is_some() {
                s.multi_dirty = true;
            }
            return Reply::Error("NOAUTH Authentication required.".into());
        }
        let a = &args[1..];
        if let Some(q) = s.multi.as_mut() {
            match cname {
                "exec" | "discard" | "multi" | "watch" | "quit" => {}
                "flushdb" | "eval" | "evalsha" | "script" => {
                    s.multi_dirty = true;
                    return Reply::err(format!(
                        "{} inside MULTI is not supported by tierkv (it runs under its own exclusive lock)",
                        cname.to_ascii_uppercase()
                    ));
                }
                _ => {
                    // A transaction's queue is held to the query-buffer limit too: past it
                    // the queue is dropped (its memory freed) and EXEC will abort.
                    s.multi_bytes = s.multi_bytes.saturating_add(args.iter().map(|a| a.len()).sum());
                    if s.multi_bytes > self.settings.limits.max_query_len {
                        s.multi_dirty = true;
                        *q = Vec::new();
                        return Reply::err(format!(
                            "the commands queued by MULTI exceed the query buffer limit ({} bytes); EXEC will abort",
                            self.settings.limits.max_query_len
                        ));
                    }
                    q.push(args.to_vec());
                    return Reply::Status("QUEUED".into());
                }
            }
        }
        let unfenced = match self.replica_gate(s, cname, a) {
            Ok(u) => u,
            Err(e) => return e,
        };
        let replicated_before = crate::replica::replications_here();
        let r = match cname {
            "readonly" | "readwrite" => self.readonly_cmd(s, cname),
            "multi" | "exec" | "discard" | "watch" | "unwatch" => self.multi_cmd(s, cname, a),
            "flushdb" => self.flushdb(a),
            "eval" | "evalsha" | "script" => self.script_cmd(s, cname, a),
            _ => {
                let _g = self.global.read();
                let mut t = Txn::new(self, now_ms());
                self.dispatch(s, &mut t, cname, a).and_then(|r| t.commit().map(|()| r))
            }
        };
        if let Some(slot) = unfenced {
            if let Err(e) = self.confirm_unreplicated(slot, replicated_before) {
                return e;
            }
        }
        r.unwrap_or_else(|e| e)
    }

    /// Run a command inside a transaction or a script (the global lock held exclusively),
    /// on top of `acc`; its changes join `acc` if it succeeds.
    pub(crate) fn exec_in(&self, s: &mut Session, acc: &mut Changes, now: u64, args: &[Bytes]) -> Reply {
        self.counters.commands.fetch_add(1, Ordering::Relaxed);
        let cname = match lookup(args) {
            Ok(c) => c,
            Err(e) => return e,
        };
        let mut t = Txn::layered(self, acc, now);
        let r = self.dispatch(s, &mut t, cname, &args[1..]);
        let c = t.into_changes();
        match r {
            Ok(r) => {
                acc.merge(c);
                r
            }
            Err(e) => e,
        }
    }

    pub(crate) fn dispatch(&self, s: &mut Session, t: &mut Txn<'_>, name: &str, a: &[Bytes]) -> R {
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
            "info" => self.info(s, a, t.now, &t.overlay()),
            "config" => self.config(a),
            "client" => client(s, a),
            "hello" => self.hello(s, a),
            "auth" => self.auth(s, a),
            // Queued inside MULTI: EXEC unwatches everything anyway (Redis replies OK too).
            "unwatch" => Ok(Reply::Ok),
            "multi" | "exec" | "discard" | "watch" | "flushdb" | "eval" | "evalsha" | "script" => {
                Err(Reply::err("This Redis command is not allowed from script"))
            }
            _ => {
                if let Some(r) = self.string_cmd(s, t, name, a) {
                    return r;
                }
                self.collection_cmd(s, t, name, a)
            }
        }
    }

    pub(crate) fn flushdb(&self, a: &[Bytes]) -> R {
        if a.len() > 1 || a.first().is_some_and(|o| !eq(o, "sync") && !eq(o, "async")) {
            return Err(Reply::err("syntax error"));
        }
        let _g = self.global.write();
        loop {
            let mut b = tierkv::WriteBatch::new();
            for e in self
                .db
                .scan::<(Bound<&[u8]>, Bound<&[u8]>)>((Bound::Unbounded, Bound::Unbounded))
                .map_err(db_err)?
                .take(1024)
            {
                let (k, _) = e.map_err(db_err)?;
                // Replication's own records (`FF 'r'`, docs/format/raft.md) are not data.
                if !k.starts_with(&[keys::META, b'r']) {
                    b.delete(k);
                }
            }
            if b.is_empty() {
                break;
            }
            self.write_batch(b)?;
        }
        self.types.write().clear();
        self.expires.write().clear();
        self.cursors.lock().map.clear();
        for e in self.watches.lock().values_mut() {
            e.0 += 1;
        }
        Ok(Reply::Ok)
    }

    /// Delete up to `max` keys whose expiry has passed (the background sweep), 100 to a
    /// batch; returns how many were deleted.
    pub fn sweep(&self, max: usize) -> usize {
        if !self.may_sweep() {
            return 0;
        }
        let now = now_ms();
        let due = self.expires.read().due(now, max);
        let mut n = 0;
        for chunk in due.chunks(100) {
            let _g = self.global.read();
            let mut t = Txn::new(self, now);
            // Locking reaps each key that is still expired (it may have been rewritten).
            if t.lock_keys(chunk.iter().map(|k| &k[..])).is_ok() {
                let reaped = t.reaped();
                if t.commit().is_ok() {
                    n += reaped as usize;
                }
            }
        }
        n
    }

    fn command(&self, a: &[Bytes]) -> R {
        let Some(sub) = a.first() else {
            return Ok(Reply::Array(COMMANDS.iter().map(command_entry).collect()));
        };
        if eq(sub, "count") {
            Ok(Reply::Int(COMMANDS.len() as i64))
        } else if eq(sub, "docs") {
            // No documentation: clients fall back to their built-in help.
            Ok(Reply::Map(Vec::new()))
        } else if eq(sub, "info") {
            Ok(Reply::Array(
                a[1..]
                    .iter()
                    .map(|n| {
                        let n = String::from_utf8_lossy(n).to_ascii_lowercase();
                        COMMANDS.iter().find(|c| c.0 == n).map_or(Reply::Nil, command_entry)
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
        let (port, tls_port) = *self.ports.lock();
        vec![
            ("save", String::new()),
            ("appendonly", "no".into()),
            ("databases", "1".into()),
            ("maxmemory", "0".into()),
            ("port", port.to_string()),
            ("tls-port", tls_port.to_string()),
            ("bind", s.bind.clone()),
            ("timeout", s.timeout_secs.to_string()),
            ("maxclients", s.max_clients.to_string()),
            ("proto-max-bulk-len", s.limits.max_bulk_len.to_string()),
            ("protected-mode", if s.protected_mode { "yes" } else { "no" }.into()),
            // As Redis: CONFIG GET requirepass never shows a password it was not given.
            ("requirepass", String::new()),
        ]
    }

    fn config(&self, a: &[Bytes]) -> R {
        if eq(&a[0], "get") {
            if a.len() < 2 {
                return Err(Reply::err("wrong number of arguments for 'config|get' command"));
            }
            let mut out = Vec::new();
            for (name, v) in self.config_params() {
                if a[1..].iter().any(|p| crate::glob::matches(&p.to_ascii_lowercase(), name.as_bytes())) {
                    out.push((Reply::bulk(name), Reply::bulk(v)));
                }
            }
            Ok(Reply::Map(out))
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

    fn info(&self, s: &Session, a: &[Bytes], now: u64, overlay: &crate::txn::Overlay) -> R {
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
                self.ports.lock().0,
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
                "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\nrejected_connections:{}\r\nexpired_keys:{}\r\nauth_failures:{}\r\n\r\n",
                c.accepted.load(Ordering::Relaxed),
                c.commands.load(Ordering::Relaxed),
                c.rejected.load(Ordering::Relaxed),
                c.expired.load(Ordering::Relaxed),
                c.auth_failures.load(Ordering::Relaxed)
            ));
        }
        if want("keyspace") {
            let n = self.dbsize(now, overlay)?;
            let (expires, avg) = self.expires.read().stats(now);
            t.push_str("# Keyspace\r\n");
            if n > 0 {
                t.push_str(&format!("db0:keys={n},expires={expires},avg_ttl={avg}\r\n"));
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
        Ok(if s.proto >= 3 { Reply::Verbatim(t.into_bytes()) } else { Reply::Bulk(t.into_bytes()) })
    }

    fn hello(&self, s: &mut Session, a: &[Bytes]) -> R {
        let mut proto = None;
        let mut i = 0;
        if let Some(v) = a.first() {
            match parse_int(v) {
                Some(p @ 2..=3) => proto = Some(p as u8),
                Some(_) => return Err(Reply::Error("NOPROTO unsupported protocol version".into())),
                None => return Err(Reply::err("Protocol version is not an integer or out of range")),
            }
            i = 1;
        }
        let (mut auth, mut setname) = (None, None);
        while i < a.len() {
            let more = a.len() - 1 - i;
            if eq(&a[i], "auth") && more >= 2 {
                auth = Some((&a[i + 1], &a[i + 2]));
                i += 3;
            } else if eq(&a[i], "setname") && more >= 1 {
                check_client_name(&a[i + 1])?;
                setname = Some(&a[i + 1]);
                i += 2;
            } else {
                return Err(Reply::err(format!("Syntax error in HELLO option '{}'", String::from_utf8_lossy(&a[i]))));
            }
        }
        if let Some((user, pass)) = auth {
            self.authenticate(s, Some(user), pass)?;
        }
        if !s.authed {
            return Err(Reply::Error("NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time".into()));
        }
        if let Some(n) = setname {
            s.name = (!n.is_empty()).then(|| n.to_vec());
        }
        if let Some(p) = proto {
            s.proto = p;
        }
        Ok(Reply::Map(vec![
            (Reply::bulk("server"), Reply::bulk("redis")),
            (Reply::bulk("version"), Reply::bulk(REDIS_VERSION)),
            (Reply::bulk("proto"), Reply::Int(i64::from(s.proto))),
            (Reply::bulk("id"), Reply::Int(s.id as i64)),
            (Reply::bulk("mode"), Reply::bulk("standalone")),
            (Reply::bulk("role"), Reply::bulk("master")),
            (Reply::bulk("modules"), Reply::Array(Vec::new())),
        ]))
    }
}

/// The Redis version tierkv reports to clients (INFO, HELLO): the command set and reply
/// shapes it follows.
pub const REDIS_VERSION: &str = "7.0.0";

pub(crate) fn trunc(b: &[u8]) -> String {
    String::from_utf8_lossy(&b[..b.len().min(128)]).into_owned()
}

fn check_client_name(n: &[u8]) -> Result<(), Reply> {
    if n.iter().any(|&c| c <= b' ' || c > b'~') {
        return Err(Reply::err("Client names cannot contain spaces, newlines or special characters."));
    }
    Ok(())
}

fn client(s: &mut Session, a: &[Bytes]) -> R {
    if eq(&a[0], "setname") && a.len() == 2 {
        check_client_name(&a[1])?;
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
