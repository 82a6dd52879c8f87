//! Issue 23's features through the wire, in process, with exact replies: RESP3 encodings,
//! AUTH, expiry (lazy, swept, kept across a reopen), MULTI/EXEC/WATCH semantics, scripts,
//! stores written before expiry existed, and malformed stored records (errors, not panics).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tierkv::{Db, Options, Preset};
use tierkv_server::auth::Password;
use tierkv_server::{Keyspace, Server, ServerConfig, Settings};

struct Fixture {
    server: Option<Server>,
    db: Arc<Db>,
}

fn start_at(dir: &Path, preset: Preset, cfg: ServerConfig) -> Fixture {
    let db = Arc::new(Db::open(dir, Options::new().preset(preset)).unwrap());
    let ks = Arc::new(Keyspace::new(db.clone(), Settings::from(&cfg)).unwrap());
    Fixture { server: Some(Server::start(ks, &cfg).unwrap()), db }
}

fn cfg() -> ServerConfig {
    ServerConfig { port: Some(0), threads: 2, ..ServerConfig::default() }
}

impl Fixture {
    fn conn(&self) -> Conn {
        let s = TcpStream::connect(self.server.as_ref().unwrap().addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Conn { w: s.try_clone().unwrap(), r: BufReader::new(s) }
    }
    fn stop(mut self) {
        self.server.take().unwrap().shutdown();
        self.db.close().unwrap();
    }
}

/// A raw RESP connection: `cmd` sends a multibulk and returns the whole reply as text.
struct Conn {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

impl Conn {
    fn cmd(&mut self, args: &[&str]) -> String {
        let mut out = format!("*{}\r\n", args.len());
        for a in args {
            out.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        self.w.write_all(out.as_bytes()).unwrap();
        self.reply()
    }

    fn reply(&mut self) -> String {
        let mut line = String::new();
        self.r.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "connection closed");
        let n: i64 = line[1..].trim_end().parse().unwrap_or(0);
        match line.as_bytes()[0] {
            b'$' | b'=' if n >= 0 => {
                let mut b = vec![0u8; n as usize + 2];
                self.r.read_exact(&mut b).unwrap();
                line + &String::from_utf8_lossy(&b)
            }
            b'*' | b'~' | b'>' if n > 0 => (0..n).fold(line, |acc, _| acc + &self.reply()),
            b'%' if n > 0 => (0..2 * n).fold(line, |acc, _| acc + &self.reply()),
            _ => line,
        }
    }
}

#[test]
fn resp3_after_hello_3_and_resp2_again_after_hello_2() {
    let d = tempfile::tempdir().unwrap();
    let f = start_at(d.path(), Preset::Native, cfg());
    let mut c = f.conn();
    let h = c.cmd(&["HELLO", "3"]);
    assert!(h.starts_with("%7\r\n$6\r\nserver\r\n$5\r\nredis\r\n"), "{h}");
    assert!(h.contains("$5\r\nproto\r\n:3\r\n"), "{h}");
    assert_eq!(c.cmd(&["GET", "nope"]), "_\r\n");
    c.cmd(&["HSET", "h", "f", "v"]);
    assert_eq!(c.cmd(&["HGETALL", "h"]), "%1\r\n$1\r\nf\r\n$1\r\nv\r\n");
    c.cmd(&["ZADD", "z", "2.5", "m"]);
    assert_eq!(c.cmd(&["ZSCORE", "z", "m"]), ",2.5\r\n");
    assert_eq!(c.cmd(&["ZRANGEBYSCORE", "z", "-inf", "inf", "WITHSCORES"]), "*1\r\n*2\r\n$1\r\nm\r\n,2.5\r\n");
    assert_eq!(c.cmd(&["ZADD", "z", "INCR", "1", "m"]), ",3.5\r\n");
    assert!(c.cmd(&["INFO", "server"]).starts_with('='));
    assert_eq!(c.cmd(&["CONFIG", "GET", "databases"]), "%1\r\n$9\r\ndatabases\r\n$1\r\n1\r\n");
    assert_eq!(c.cmd(&["HELLO", "4"]), "-NOPROTO unsupported protocol version\r\n");
    assert!(c.cmd(&["HELLO", "2", "SETNAME", "n1"]).starts_with("*14\r\n"));
    assert_eq!(c.cmd(&["CLIENT", "GETNAME"]), "$2\r\nn1\r\n");
    assert_eq!(c.cmd(&["GET", "nope"]), "$-1\r\n");
    assert_eq!(c.cmd(&["ZSCORE", "z", "m"]), "$3\r\n3.5\r\n");
    assert_eq!(c.cmd(&["HELLO", "3", "BOGUS"]), "-ERR Syntax error in HELLO option 'BOGUS'\r\n");
    f.stop();
}

#[test]
fn auth_noauth_wrongpass_and_hello_auth() {
    let d = tempfile::tempdir().unwrap();
    let f = start_at(d.path(), Preset::Native, ServerConfig { requirepass: Password::new(b"pw"), ..cfg() });
    let mut c = f.conn();
    assert_eq!(c.cmd(&["GET", "k"]), "-NOAUTH Authentication required.\r\n");
    assert_eq!(c.cmd(&["MULTI"]), "-NOAUTH Authentication required.\r\n");
    assert!(c.cmd(&["HELLO", "3"]).starts_with("-NOAUTH HELLO must be called with the client already authenticated"));
    let wrong = "-WRONGPASS invalid username-password pair or user is disabled.\r\n";
    assert_eq!(c.cmd(&["AUTH", "bad"]), wrong);
    assert_eq!(c.cmd(&["AUTH", "admin", "pw"]), wrong, "only the default user exists");
    assert_eq!(c.cmd(&["HELLO", "3", "AUTH", "default", "bad"]), wrong);
    assert_eq!(c.cmd(&["AUTH", "a", "b", "c"]), "-ERR syntax error\r\n");
    assert_eq!(c.cmd(&["PING"]), "-NOAUTH Authentication required.\r\n");
    assert!(c.cmd(&["HELLO", "3", "AUTH", "default", "pw", "SETNAME", "x"]).starts_with("%7\r\n"));
    assert_eq!(c.cmd(&["SET", "k", "v"]), "+OK\r\n");
    // A failed AUTH later keeps the connection authenticated, as Redis.
    assert_eq!(c.cmd(&["AUTH", "bad"]), wrong);
    assert_eq!(c.cmd(&["GET", "k"]), "$1\r\nv\r\n");
    let mut c2 = f.conn();
    assert_eq!(c2.cmd(&["AUTH", "pw"]), "+OK\r\n");
    assert_eq!(c2.cmd(&["GET", "k"]), "$1\r\nv\r\n");
    f.stop();
    // Without a password, AUTH is refused as Redis refuses it.
    let f = start_at(d.path(), Preset::Native, cfg());
    let mut c = f.conn();
    assert!(c.cmd(&["AUTH", "x"]).starts_with("-ERR AUTH <password> called without any password configured"));
    assert_eq!(c.cmd(&["AUTH", "default", "x"]), "+OK\r\n");
    f.stop();
}

#[test]
fn unauthenticated_requests_commands_and_transactions_are_bounded() {
    let d = tempfile::tempdir().unwrap();
    let limits = tierkv_server::resp::Limits { max_query_len: 20_000, ..Default::default() };
    let f = start_at(d.path(), Preset::Native, ServerConfig { requirepass: Password::new(b"pw"), limits, ..cfg() });
    let closed = |c: &mut Conn| {
        let mut b = [0u8; 1];
        matches!(c.r.read(&mut b), Ok(0))
    };
    // Only headers are sent where the server refuses: it closes without reading the rest.
    let header_only = |c: &mut Conn, h: &str| {
        c.w.write_all(h.as_bytes()).unwrap();
        c.reply()
    };
    // Before AUTH, Redis 7's limits: 10 arguments of 16 KiB; past them, an error and close.
    let eleven = vec!["x"; 11];
    let mut c = f.conn();
    assert_eq!(header_only(&mut c, "*11\r\n"), "-ERR Protocol error: unauthenticated multibulk length\r\n");
    assert!(closed(&mut c));
    let mut c = f.conn();
    let r = header_only(&mut c, "*2\r\n$4\r\nAUTH\r\n$16385\r\n");
    assert_eq!(r, "-ERR Protocol error: unauthenticated bulk length\r\n");
    assert!(closed(&mut c));
    let mut c = f.conn();
    assert_eq!(
        c.cmd(&["AUTH", &"p".repeat(16 << 10)]),
        "-WRONGPASS invalid username-password pair or user is disabled.\r\n"
    );
    assert_eq!(c.cmd(&["AUTH", "pw"]), "+OK\r\n");
    // Authenticated: more arguments pass; an unknown command quotes 128 bytes of them.
    let long = "a".repeat(300);
    assert_eq!(
        c.cmd(&["NOPE", &long, "b"]),
        format!("-ERR unknown command 'NOPE', with args beginning with: '{}' \r\n", &long[..128])
    );
    assert!(c.cmd(&eleven).starts_with("-ERR unknown command 'x', with args beginning with: 'x' 'x' "));
    // MULTI's queue is held to the query-buffer limit: past it EXEC aborts.
    let v = "v".repeat(12_000);
    assert_eq!(c.cmd(&["MULTI"]), "+OK\r\n");
    assert_eq!(c.cmd(&["SET", "k", &v]), "+QUEUED\r\n");
    assert_eq!(
        c.cmd(&["SET", "k", &v]),
        "-ERR the commands queued by MULTI exceed the query buffer limit (20000 bytes); EXEC will abort\r\n"
    );
    assert_eq!(c.cmd(&["EXEC"]), "-EXECABORT Transaction discarded because of previous errors.\r\n");
    assert_eq!(c.cmd(&["MULTI"]), "+OK\r\n");
    assert_eq!(c.cmd(&["SET", "k", &v]), "+QUEUED\r\n", "a new MULTI starts from zero");
    assert_eq!(c.cmd(&["EXEC"]), "*1\r\n+OK\r\n");
    // One command over the limit: a protocol error, and the connection is closed.
    assert_eq!(
        header_only(&mut c, "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$19997\r\n"),
        "-ERR Protocol error: command larger than the query buffer limit\r\n"
    );
    assert!(closed(&mut c));
    assert_eq!(f.conn().cmd(&["AUTH", "pw"]), "+OK\r\n", "the server still serves");
    f.stop();
}

#[test]
fn expiry_is_lazy_swept_and_kept_across_a_reopen() {
    for preset in [Preset::Native, Preset::Hpdk, Preset::Pmekv] {
        let d = tempfile::tempdir().unwrap();
        let f = start_at(d.path(), preset, cfg());
        let mut c = f.conn();
        assert_eq!(c.cmd(&["SET", "s", "v", "PX", "150"]), "+OK\r\n");
        assert_eq!(c.cmd(&["SET", "keep", "v", "EX", "1000"]), "+OK\r\n");
        assert_eq!(c.cmd(&["SET", "\u{7f}plain", "v"]), "+OK\r\n");
        assert_eq!(c.cmd(&["HSET", "h", "f", "v"]), ":1\r\n");
        assert_eq!(c.cmd(&["PEXPIRE", "h", "150"]), ":1\r\n");
        assert_eq!(c.cmd(&["ZADD", "z", "1", "m"]), ":1\r\n");
        assert_eq!(c.cmd(&["EXPIRE", "z", "1000"]), ":1\r\n");
        assert_eq!(c.cmd(&["DBSIZE"]), ":5\r\n");
        assert_eq!(c.cmd(&["PERSIST", "\u{7f}plain"]), ":0\r\n");
        assert_eq!(c.cmd(&["TTL", "\u{7f}plain"]), ":-1\r\n");
        assert_eq!(c.cmd(&["TTL", "none"]), ":-2\r\n");
        // GETEX/SET KEEPTTL/INCR/APPEND keep the expiry; SET and GETSET drop it.
        assert_eq!(c.cmd(&["SET", "keep", "w", "KEEPTTL"]), "+OK\r\n");
        assert_eq!(c.cmd(&["APPEND", "keep", "x"]), ":2\r\n");
        assert_eq!(c.cmd(&["GET", "keep"]), "$2\r\nwx\r\n");
        let ttl: i64 = c.cmd(&["TTL", "keep"])[1..].trim().parse().unwrap();
        assert!((990..=1000).contains(&ttl), "{ttl}");
        assert_eq!(c.cmd(&["SETEX", "g", "100", "1"]), "+OK\r\n");
        assert_eq!(c.cmd(&["GETSET", "g", "2"]), "$1\r\n1\r\n");
        assert_eq!(c.cmd(&["TTL", "g"]), ":-1\r\n");
        assert_eq!(c.cmd(&["GETDEL", "g"]), "$1\r\n2\r\n");
        std::thread::sleep(Duration::from_millis(250));
        // Expired: absent from every read, before or after the sweep got to them.
        assert_eq!(c.cmd(&["GET", "s"]), "_\r\n".replace('_', "$-1"));
        assert_eq!(c.cmd(&["EXISTS", "s", "h", "z", "keep"]), ":2\r\n");
        assert_eq!(c.cmd(&["HGETALL", "h"]), "*0\r\n");
        assert_eq!(c.cmd(&["TYPE", "h"]), "+none\r\n");
        assert_eq!(c.cmd(&["DBSIZE"]), ":3\r\n");
        let keys = c.cmd(&["KEYS", "*"]);
        assert!(keys.starts_with("*3\r\n") && !keys.contains("\r\ns\r\n"), "{keys}");
        // The sweep deletes them from the store (not just hides them).
        std::thread::sleep(Duration::from_millis(300));
        let mut n = 0;
        for e in f.db.scan::<std::ops::RangeFull>(..).unwrap() {
            let (k, _) = e.unwrap();
            assert!(!k.ends_with(b"s") || k == b"keep", "{preset}: {k:?} not swept");
            n += 1;
        }
        assert!(n >= 3, "{preset}");
        let pexp = c.cmd(&["PEXPIRETIME", "keep"]);
        f.stop();
        let f = start_at(d.path(), preset, cfg());
        let mut c = f.conn();
        assert_eq!(c.cmd(&["PEXPIRETIME", "keep"]), pexp, "{preset}");
        assert_eq!(c.cmd(&["GET", "keep"]), "$2\r\nwx\r\n");
        assert_eq!(c.cmd(&["ZSCORE", "z", "m"]), "$1\r\n1\r\n");
        assert_eq!(c.cmd(&["PERSIST", "z"]), ":1\r\n");
        assert_eq!(c.cmd(&["TTL", "z"]), ":-1\r\n");
        f.stop();
    }
}

#[test]
fn expire_options_as_redis() {
    let d = tempfile::tempdir().unwrap();
    let f = start_at(d.path(), Preset::Native, cfg());
    let mut c = f.conn();
    c.cmd(&["SET", "k", "v"]);
    assert_eq!(c.cmd(&["EXPIRE", "k", "100", "XX"]), ":0\r\n");
    assert_eq!(c.cmd(&["EXPIRE", "k", "100", "GT"]), ":0\r\n", "no expiry counts as infinite");
    assert_eq!(c.cmd(&["EXPIRE", "k", "100", "LT"]), ":1\r\n");
    assert_eq!(c.cmd(&["EXPIRE", "k", "50", "NX"]), ":0\r\n");
    assert_eq!(c.cmd(&["EXPIRE", "k", "200", "GT"]), ":1\r\n");
    assert_eq!(c.cmd(&["EXPIRE", "k", "300", "LT"]), ":0\r\n");
    assert_eq!(
        c.cmd(&["EXPIRE", "k", "1", "NX", "GT"]),
        "-ERR NX and XX, GT or LT options at the same time are not compatible\r\n"
    );
    assert_eq!(
        c.cmd(&["EXPIRE", "k", "1", "GT", "LT"]),
        "-ERR GT and LT options at the same time are not compatible\r\n"
    );
    assert_eq!(c.cmd(&["EXPIRE", "k", "1", "YY"]), "-ERR Unsupported option YY\r\n");
    assert_eq!(c.cmd(&["EXPIRE", "k", "x"]), "-ERR value is not an integer or out of range\r\n");
    assert_eq!(c.cmd(&["EXPIRE", "k", "9223372036854775807"]), "-ERR invalid expire time in 'expire' command\r\n");
    assert_eq!(c.cmd(&["SET", "k", "v", "EX", "10", "PX", "10"]), "-ERR syntax error\r\n");
    assert_eq!(c.cmd(&["SET", "k", "v", "EX", "10", "KEEPTTL"]), "-ERR syntax error\r\n");
    assert_eq!(c.cmd(&["SET", "k", "v", "EX"]), "-ERR syntax error\r\n");
    assert_eq!(c.cmd(&["SETEX", "k", "0", "v"]), "-ERR invalid expire time in 'setex' command\r\n");
    assert_eq!(c.cmd(&["GETEX", "k", "PERSIST", "EX", "1"]), "-ERR syntax error\r\n");
    assert_eq!(c.cmd(&["TTL", "k"]).len(), ":200\r\n".len());
    // An expiry time in the past deletes the key.
    assert_eq!(c.cmd(&["PEXPIREAT", "k", "1"]), ":1\r\n");
    assert_eq!(c.cmd(&["EXISTS", "k"]), ":0\r\n");
    assert_eq!(c.cmd(&["SET", "k", "v", "PXAT", "1"]), "+OK\r\n");
    assert_eq!(c.cmd(&["EXISTS", "k"]), ":0\r\n");
    assert_eq!(c.cmd(&["SET", "k", "v", "EXAT", "99999999999"]), "+OK\r\n");
    assert_eq!(c.cmd(&["EXPIRETIME", "k"]), ":99999999999\r\n");
    assert_eq!(
        c.cmd(&["HSET", "k", "f", "v"]),
        "-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
    );
    f.stop();
}

#[test]
fn multi_exec_discard_and_watch_as_redis() {
    let d = tempfile::tempdir().unwrap();
    let f = start_at(d.path(), Preset::Native, cfg());
    let (mut a, mut b) = (f.conn(), f.conn());
    assert_eq!(a.cmd(&["EXEC"]), "-ERR EXEC without MULTI\r\n");
    assert_eq!(a.cmd(&["DISCARD"]), "-ERR DISCARD without MULTI\r\n");
    assert_eq!(a.cmd(&["MULTI"]), "+OK\r\n");
    assert_eq!(a.cmd(&["MULTI"]), "-ERR MULTI calls can not be nested\r\n");
    assert_eq!(a.cmd(&["SET", "x", "1"]), "+QUEUED\r\n");
    assert_eq!(a.cmd(&["INCR", "x"]), "+QUEUED\r\n");
    assert_eq!(a.cmd(&["HSET", "x", "f", "v"]), "+QUEUED\r\n");
    assert_eq!(a.cmd(&["GET", "x"]), "+QUEUED\r\n");
    assert_eq!(a.cmd(&["EXPIRE", "x", "100"]), "+QUEUED\r\n");
    assert_eq!(b.cmd(&["GET", "x"]), "$-1\r\n", "nothing is visible before EXEC");
    assert_eq!(
        a.cmd(&["EXEC"]),
        "*5\r\n+OK\r\n:2\r\n-WRONGTYPE Operation against a key holding the wrong kind of value\r\n$1\r\n2\r\n:1\r\n"
    );
    assert_eq!(b.cmd(&["GET", "x"]), "$1\r\n2\r\n");
    // A queue-time error aborts the whole transaction.
    a.cmd(&["MULTI"]);
    a.cmd(&["SET", "y", "1"]);
    assert_eq!(a.cmd(&["GET"]), "-ERR wrong number of arguments for 'get' command\r\n");
    assert!(a.cmd(&["NOPE"]).starts_with("-ERR unknown command"));
    assert_eq!(a.cmd(&["EXEC"]), "-EXECABORT Transaction discarded because of previous errors.\r\n");
    assert_eq!(b.cmd(&["EXISTS", "y"]), ":0\r\n");
    a.cmd(&["MULTI"]);
    a.cmd(&["SET", "y", "1"]);
    assert_eq!(a.cmd(&["DISCARD"]), "+OK\r\n");
    assert_eq!(b.cmd(&["EXISTS", "y"]), ":0\r\n");
    // WATCH: a write by another client between WATCH and EXEC aborts it (nil).
    assert_eq!(a.cmd(&["WATCH", "x", "w2"]), "+OK\r\n");
    assert_eq!(b.cmd(&["SET", "w2", "z"]), "+OK\r\n");
    a.cmd(&["MULTI"]);
    a.cmd(&["SET", "x", "mine"]);
    assert_eq!(a.cmd(&["EXEC"]), "*-1\r\n");
    assert_eq!(b.cmd(&["GET", "x"]), "$1\r\n2\r\n");
    // After EXEC the keys are unwatched; an untouched watch lets EXEC run.
    a.cmd(&["WATCH", "x"]);
    b.cmd(&["SET", "other", "1"]);
    a.cmd(&["MULTI"]);
    a.cmd(&["SET", "x", "mine"]);
    assert_eq!(a.cmd(&["EXEC"]), "*1\r\n+OK\r\n");
    // UNWATCH forgets; a deletion and an expiry count as changes; RESP3 nil is `_`.
    a.cmd(&["WATCH", "x"]);
    a.cmd(&["UNWATCH"]);
    b.cmd(&["DEL", "x"]);
    a.cmd(&["MULTI"]);
    a.cmd(&["SET", "x", "again"]);
    assert_eq!(a.cmd(&["UNWATCH"]), "+QUEUED\r\n");
    assert_eq!(a.cmd(&["EXEC"]), "*2\r\n+OK\r\n+OK\r\n");
    a.cmd(&["HELLO", "3"]);
    a.cmd(&["SET", "e", "v", "PX", "100"]);
    a.cmd(&["WATCH", "e"]);
    std::thread::sleep(Duration::from_millis(200));
    a.cmd(&["MULTI"]);
    a.cmd(&["SET", "e", "new"]);
    assert_eq!(a.cmd(&["EXEC"]), "_\r\n", "a watched key that expired aborts EXEC");
    // A key already expired when watched is absent then and after the sweep deletes it:
    // not a change (Redis 7).
    a.cmd(&["SET", "gone", "v", "PX", "1"]);
    std::thread::sleep(Duration::from_millis(20));
    a.cmd(&["WATCH", "gone"]);
    let stored = tierkv_server::keys::expiring_key(b"gone");
    let since = std::time::Instant::now();
    while f.db.get(&stored).unwrap().is_some() {
        assert!(since.elapsed() < Duration::from_secs(10), "the sweep did not delete the key");
        std::thread::sleep(Duration::from_millis(20));
    }
    a.cmd(&["MULTI"]);
    a.cmd(&["SET", "gone", "back"]);
    assert_eq!(a.cmd(&["EXEC"]), "*1\r\n+OK\r\n", "deleting an expired key is not a change");
    a.cmd(&["SET", "gone", "v", "PX", "1"]);
    std::thread::sleep(Duration::from_millis(20));
    a.cmd(&["WATCH", "gone"]);
    b.cmd(&["SET", "gone", "new"]);
    a.cmd(&["MULTI"]);
    a.cmd(&["GET", "gone"]);
    assert_eq!(a.cmd(&["EXEC"]), "_\r\n", "writing an expired key is a change");
    assert_eq!(a.cmd(&["WATCH", "x"]), "+OK\r\n");
    a.cmd(&["MULTI"]);
    assert_eq!(a.cmd(&["WATCH", "x"]), "-ERR WATCH inside MULTI is not allowed\r\n");
    assert_eq!(
        a.cmd(&["FLUSHDB"]),
        "-ERR FLUSHDB inside MULTI is not supported by tierkv (it runs under its own exclusive lock)\r\n"
    );
    assert_eq!(a.cmd(&["EXEC"]), "-EXECABORT Transaction discarded because of previous errors.\r\n");
    f.stop();
}

#[test]
fn keys_scan_and_dbsize_inside_exec_and_scripts_see_their_own_writes() {
    let d = tempfile::tempdir().unwrap();
    let f = start_at(d.path(), Preset::Native, cfg());
    let mut c = f.conn();
    c.cmd(&["SET", "a", "1"]);
    c.cmd(&["SET", "b", "2"]);
    c.cmd(&["HSET", "gone", "f", "v"]);
    c.cmd(&["MULTI"]);
    for cmd in [
        &["SET", "c", "3"][..],
        &["HSET", "h", "f", "v"],
        &["DEL", "a", "gone"],
        &["SET", "e", "v", "PX", "100000"],
        &["KEYS", "*"],
        &["DBSIZE"],
        &["SCAN", "0", "COUNT", "1000"],
    ] {
        assert_eq!(c.cmd(cmd), "+QUEUED\r\n");
    }
    // Walk order: plain strings, then hashes and sorted sets, then strings with an expiry.
    let keys = "*4\r\n$1\r\nb\r\n$1\r\nc\r\n$1\r\nh\r\n$1\r\ne\r\n";
    assert_eq!(c.cmd(&["EXEC"]), format!("*7\r\n+OK\r\n:1\r\n:2\r\n+OK\r\n{keys}:4\r\n*2\r\n$1\r\n0\r\n{keys}"));
    assert_eq!(c.cmd(&["DBSIZE"]), ":4\r\n", "the same after the commit");
    let script =
        "redis.call('del', 'b', 'h') redis.call('set', 'z', 1) return {redis.call('dbsize'), redis.call('keys', '*')}";
    assert_eq!(c.cmd(&["EVAL", script, "0"]), "*2\r\n:3\r\n*3\r\n$1\r\nc\r\n$1\r\nz\r\n$1\r\ne\r\n");
    f.stop();
}

#[test]
fn scripts_run_commands_atomically() {
    let d = tempfile::tempdir().unwrap();
    let f = start_at(d.path(), Preset::Native, cfg());
    let mut c = f.conn();
    let s = "redis.call('set', KEYS[1], ARGV[1]); redis.call('incr', 'n'); return {redis.call('get', KEYS[1]), 7, false, redis.status_reply('fine')}";
    assert_eq!(c.cmd(&["EVAL", s, "1", "k", "v"]), "*4\r\n$1\r\nv\r\n:7\r\n$-1\r\n+fine\r\n");
    let sha = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db";
    assert_eq!(c.cmd(&["EVALSHA", sha, "0"]), "-NOSCRIPT No matching script. Please use EVAL.\r\n");
    assert_eq!(c.cmd(&["SCRIPT", "LOAD", "return 1"]), format!("$40\r\n{sha}\r\n"));
    assert_eq!(c.cmd(&["EVALSHA", &sha.to_uppercase(), "0"]), ":1\r\n");
    assert_eq!(c.cmd(&["SCRIPT", "EXISTS", sha, "ab"]), "*2\r\n:1\r\n:0\r\n");
    assert_eq!(
        c.cmd(&["EVAL", "return redis.call('hget', 'k', 'f')", "0"]),
        "-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
    );
    assert_eq!(
        c.cmd(&["EVAL", "return redis.call('multi')", "0"]),
        "-ERR This Redis command is not allowed from script\r\n"
    );
    assert!(c.cmd(&["EVAL", "return io.open('/etc/passwd')", "0"]).starts_with("-ERR Error running script"));
    assert!(c.cmd(&["SCRIPT", "LOAD", "return ("]).starts_with("-ERR Error compiling script"));
    assert_eq!(c.cmd(&["EVAL", "return 1", "2", "a"]), "-ERR Number of keys can't be greater than number of args\r\n");
    assert_eq!(c.cmd(&["GET", "n"]), "$1\r\n1\r\n");
    f.stop();
}

#[test]
fn stores_written_before_expiry_existed_still_read() {
    let d = tempfile::tempdir().unwrap();
    {
        // What the version-1 server wrote (golden bytes of docs/format/server-keyspace.md).
        let db = Db::open(d.path(), Options::new().preset(Preset::Native)).unwrap();
        db.put(b"k", b"plain").unwrap();
        db.put(b"\xffm\x68", b"\x01\x01\x01\0\0\0\0\0\0\0").unwrap();
        db.put(b"\xffh\0\0\0\x01\x68f", b"v").unwrap();
        db.close().unwrap();
    }
    let f = start_at(d.path(), Preset::Native, cfg());
    let mut c = f.conn();
    assert_eq!(c.cmd(&["GET", "k"]), "$5\r\nplain\r\n");
    assert_eq!(c.cmd(&["HGETALL", "h"]), "*2\r\n$1\r\nf\r\n$1\r\nv\r\n");
    assert_eq!(c.cmd(&["EXPIRE", "h", "1000"]), ":1\r\n");
    assert_eq!(c.cmd(&["EXPIRE", "k", "1000"]), ":1\r\n");
    let db = f.db.clone();
    let rec = db.get(b"\xffm\x68").unwrap().unwrap();
    assert_eq!(rec.len(), 18, "a hash with an expiry has a version-2 type record");
    assert_eq!(rec[0], 2);
    assert_eq!(db.get(b"k").unwrap(), None, "an expiring string moved to FF 'x' k");
    assert_eq!(&db.get(b"\xffxk").unwrap().unwrap()[9..], b"plain");
    assert_eq!(c.cmd(&["PERSIST", "k"]), ":1\r\n");
    assert_eq!(db.get(b"k").unwrap().as_deref(), Some(&b"plain"[..]), "and back without one");
    f.stop();
}

#[test]
fn malformed_stored_records_are_errors_not_panics() {
    for (key, value) in [
        (&b"\xffxk"[..], &b"\x02\x01"[..]),
        (b"\xffxk", b"\x07\0\0\0\0\0\0\0\0v"),
        (b"\xffmh", b"\x02\x01\x01\0\0\0\0\0\0\0"),
        (b"\xffmh", b""),
    ] {
        let d = tempfile::tempdir().unwrap();
        let db = Arc::new(Db::open(d.path(), Options::new().preset(Preset::Native)).unwrap());
        db.put(key, value).unwrap();
        let e = Keyspace::new(db.clone(), Settings::default()).unwrap_err();
        assert!(matches!(e, tierkv::Error::Corruption { .. }), "{e}");
        db.close().unwrap();
    }
    // A damaged member record found while serving is an error reply.
    let d = tempfile::tempdir().unwrap();
    let f = start_at(d.path(), Preset::Native, cfg());
    let mut c = f.conn();
    c.cmd(&["ZADD", "z", "1", "m"]);
    f.db.put(b"\xffz\0\0\0\x01zm", b"bad").unwrap();
    assert_eq!(c.cmd(&["ZREM", "z", "m"]), "-ERR corrupt sorted-set member record\r\n");
    assert_eq!(c.cmd(&["PING"]), "+PONG\r\n");
    f.stop();
}
