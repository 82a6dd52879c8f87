//! The server driven by a real Redis client (the `redis` crate) and by raw sockets, on every
//! preset: every command, pipelining, binary-safe keys and values, Redis's error replies, a
//! thousand concurrent connections, hostile input, and a clean shutdown that keeps the data.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use redis::{Commands, Value};
use tierkv::{Db, Options, Preset};
use tierkv_server::{Keyspace, Server, ServerConfig, Settings};

struct Fixture {
    server: Option<Server>,
    db: Arc<Db>,
    _dir: tempfile::TempDir,
}

fn options(preset: Preset) -> Options {
    Options::new().preset(preset)
}

fn settings(cfg: &ServerConfig) -> Settings {
    Settings::from(cfg)
}

fn start_with(preset: Preset, cfg: ServerConfig) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let db = Arc::new(Db::open(dir.path(), options(preset)).unwrap());
    let ks = Arc::new(Keyspace::new(db.clone(), settings(&cfg)).unwrap());
    let server = Server::start(ks, &cfg).unwrap();
    Fixture { server: Some(server), db, _dir: dir }
}

fn start(preset: Preset) -> Fixture {
    start_with(preset, ServerConfig { port: Some(0), threads: 2, ..ServerConfig::default() })
}

impl Fixture {
    fn port(&self) -> u16 {
        self.server.as_ref().unwrap().addr().port()
    }
    fn client(&self) -> redis::Connection {
        let c = redis::Client::open(format!("redis://127.0.0.1:{}/", self.port())).unwrap();
        c.get_connection().unwrap()
    }
    fn raw(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port())).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s
    }
}

fn err_text<T: std::fmt::Debug>(r: redis::RedisResult<T>) -> String {
    let e = r.expect_err("expected an error reply");
    // "<code>: <detail>" in the redis crate; rebuild Redis's "<CODE> <detail>" line.
    let code = e.code().unwrap_or("").to_string();
    let detail = e.detail().unwrap_or("").to_string();
    format!("{code} {detail}").trim().to_string()
}

/// Send raw bytes, read until `want` replies' worth of bytes equal `expect` (or EOF).
fn raw_exchange(s: &mut TcpStream, send: &[u8], expect_len: usize) -> Vec<u8> {
    s.write_all(send).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    while got.len() < expect_len {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => panic!("read: {e} after {:?}", String::from_utf8_lossy(&got)),
        }
    }
    got
}

#[test]
fn strings_counters_and_keyspace_commands() {
    for &preset in Preset::ALL {
        let f = start(preset);
        let mut c = f.client();
        let ctx = preset.to_string();
        assert_eq!(redis::cmd("PING").query::<String>(&mut c).unwrap(), "PONG", "{ctx}");
        assert_eq!(redis::cmd("PING").arg("hi").query::<String>(&mut c).unwrap(), "hi");
        assert_eq!(redis::cmd("ECHO").arg("e\r\nx").query::<Vec<u8>>(&mut c).unwrap(), b"e\r\nx");
        assert_eq!(redis::cmd("SELECT").arg(0).query::<String>(&mut c).unwrap(), "OK");
        assert_eq!(err_text(redis::cmd("SELECT").arg(1).query::<String>(&mut c)), "ERR DB index is out of range");
        let _: () = c.set("s", "v1").unwrap();
        assert_eq!(c.get::<_, String>("s").unwrap(), "v1");
        // SET NX / XX: conditional on the key (under its stripe lock).
        assert_eq!(redis::cmd("SET").arg("s").arg("v2").arg("NX").query::<Option<String>>(&mut c).unwrap(), None);
        assert_eq!(
            redis::cmd("SET").arg("s").arg("v2").arg("xx").query::<Option<String>>(&mut c).unwrap(),
            Some("OK".into())
        );
        assert_eq!(redis::cmd("SET").arg("new").arg("n").arg("XX").query::<Option<String>>(&mut c).unwrap(), None);
        assert_eq!(
            redis::cmd("SET").arg("new").arg("n").arg("NX").query::<Option<String>>(&mut c).unwrap(),
            Some("OK".into())
        );
        assert_eq!(
            redis::cmd("SET").arg("s").arg("v3").arg("GET").query::<Option<String>>(&mut c).unwrap(),
            Some("v2".into())
        );
        assert_eq!(
            err_text(redis::cmd("SET").arg("s").arg("x").arg("EX").arg(0).query::<String>(&mut c)),
            "ERR invalid expire time in 'set' command"
        );
        assert_eq!(
            err_text(redis::cmd("SET").arg("s").arg("x").arg("NX").arg("XX").query::<String>(&mut c)),
            "ERR syntax error"
        );
        assert_eq!(redis::cmd("SETNX").arg("s").arg("z").query::<i64>(&mut c).unwrap(), 0);
        assert_eq!(redis::cmd("SETNX").arg("s2").arg("z").query::<i64>(&mut c).unwrap(), 1);
        assert_eq!(redis::cmd("GETSET").arg("s2").arg("y").query::<Option<String>>(&mut c).unwrap(), Some("z".into()));
        assert_eq!(redis::cmd("GETSET").arg("s3").arg("y").query::<Option<String>>(&mut c).unwrap(), None);
        let _: () = redis::cmd("MSET").arg("m1").arg("a").arg("m2").arg("b").arg("m1").arg("c").query(&mut c).unwrap();
        let got: Vec<Option<String>> = redis::cmd("MGET").arg("m1").arg("m2").arg("nope").query(&mut c).unwrap();
        assert_eq!(got, vec![Some("c".into()), Some("b".into()), None]);
        assert_eq!(redis::cmd("EXISTS").arg("m1").arg("m1").arg("nope").query::<i64>(&mut c).unwrap(), 2);
        assert_eq!(redis::cmd("DEL").arg("m1").arg("m1").arg("nope").query::<i64>(&mut c).unwrap(), 1);
        // Counters.
        assert_eq!(c.incr::<_, _, i64>("n", 1).unwrap(), 1);
        assert_eq!(redis::cmd("INCRBY").arg("n").arg(41).query::<i64>(&mut c).unwrap(), 42);
        assert_eq!(redis::cmd("DECR").arg("n").query::<i64>(&mut c).unwrap(), 41);
        assert_eq!(redis::cmd("DECRBY").arg("n").arg(-9).query::<i64>(&mut c).unwrap(), 50);
        assert_eq!(
            err_text(redis::cmd("INCR").arg("s").query::<i64>(&mut c)),
            "ERR value is not an integer or out of range"
        );
        let _: () = c.set("big", i64::MAX).unwrap();
        assert_eq!(
            err_text(redis::cmd("INCR").arg("big").query::<i64>(&mut c)),
            "ERR increment or decrement would overflow"
        );
        assert_eq!(redis::cmd("APPEND").arg("ap").arg("ab").query::<i64>(&mut c).unwrap(), 2);
        assert_eq!(redis::cmd("APPEND").arg("ap").arg("cd").query::<i64>(&mut c).unwrap(), 4);
        assert_eq!(redis::cmd("STRLEN").arg("ap").query::<i64>(&mut c).unwrap(), 4);
        assert_eq!(redis::cmd("STRLEN").arg("none").query::<i64>(&mut c).unwrap(), 0);
        assert_eq!(redis::cmd("TYPE").arg("ap").query::<String>(&mut c).unwrap(), "string");
        // A plain string key is readable through the library API as it is.
        assert_eq!(f.db.get(b"ap").unwrap().as_deref(), Some(&b"abcd"[..]), "{ctx}");
        // Keyspace commands.
        let n: i64 = redis::cmd("DBSIZE").query(&mut c).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        let mut cursor = 0u64;
        loop {
            let (next, ks): (u64, Vec<String>) =
                redis::cmd("SCAN").arg(cursor).arg("COUNT").arg(3).query(&mut c).unwrap();
            seen.extend(ks);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        assert_eq!(seen.len() as i64, n, "{ctx}: SCAN visits every key once");
        let (_, m): (u64, Vec<String>) =
            redis::cmd("SCAN").arg(0).arg("MATCH").arg("s*").arg("COUNT").arg(1000).query(&mut c).unwrap();
        assert_eq!(m, vec!["s", "s2", "s3"]);
        assert_eq!(err_text(redis::cmd("SCAN").arg(12345).query::<Value>(&mut c)), "ERR invalid cursor");
        let info: String = redis::cmd("INFO").query(&mut c).unwrap();
        assert!(info.contains(&format!("db0:keys={n},")), "{info}");
        assert!(info.contains(&format!("preset:{preset}")), "{info}");
        let cfg: Vec<String> = redis::cmd("CONFIG").arg("GET").arg("save").arg("appendonly").query(&mut c).unwrap();
        assert_eq!(cfg, vec!["save", "", "appendonly", "no"]);
        let count: i64 = redis::cmd("COMMAND").arg("COUNT").query(&mut c).unwrap();
        let all: Vec<Value> = redis::cmd("COMMAND").query(&mut c).unwrap();
        assert_eq!(all.len() as i64, count);
        let _: Value = redis::cmd("COMMAND").arg("DOCS").query(&mut c).unwrap();
        assert_eq!(redis::cmd("FLUSHDB").query::<String>(&mut c).unwrap(), "OK");
        assert_eq!(redis::cmd("DBSIZE").query::<i64>(&mut c).unwrap(), 0, "{ctx}");
        assert_eq!(redis::cmd("QUIT").query::<String>(&mut c).unwrap(), "OK");
    }
}

#[test]
fn hashes_and_sorted_sets_as_ycsb_uses_them() {
    for &preset in Preset::ALL {
        let f = start(preset);
        let mut c = f.client();
        let ctx = preset.to_string();
        // YCSB insert: HMSET key field0 v0 ... + ZADD _indices <hash> key.
        let _: () =
            redis::cmd("HMSET").arg("user1").arg("field0").arg("a").arg("field1").arg("b").query(&mut c).unwrap();
        assert_eq!(
            redis::cmd("HSET").arg("user1").arg("field1").arg("B").arg("field2").arg("c").query::<i64>(&mut c).unwrap(),
            1
        );
        assert_eq!(redis::cmd("HGET").arg("user1").arg("field1").query::<String>(&mut c).unwrap(), "B");
        assert_eq!(redis::cmd("HGET").arg("user1").arg("nope").query::<Option<String>>(&mut c).unwrap(), None);
        let m: Vec<Option<String>> = redis::cmd("HMGET").arg("user1").arg("field0").arg("zz").query(&mut c).unwrap();
        assert_eq!(m, vec![Some("a".into()), None]);
        let all: Vec<String> = redis::cmd("HGETALL").arg("user1").query(&mut c).unwrap();
        assert_eq!(all, vec!["field0", "a", "field1", "B", "field2", "c"], "{ctx}");
        assert_eq!(redis::cmd("HLEN").arg("user1").query::<i64>(&mut c).unwrap(), 3);
        assert_eq!(redis::cmd("TYPE").arg("user1").query::<String>(&mut c).unwrap(), "hash");
        assert_eq!(
            redis::cmd("HDEL").arg("user1").arg("field0").arg("field0").arg("x").query::<i64>(&mut c).unwrap(),
            1
        );
        // Wrong types.
        let wt = "WRONGTYPE Operation against a key holding the wrong kind of value";
        assert_eq!(err_text(redis::cmd("GET").arg("user1").query::<Value>(&mut c)), wt);
        assert_eq!(err_text(redis::cmd("INCR").arg("user1").query::<Value>(&mut c)), wt);
        let _: () = c.set("str", "x").unwrap();
        assert_eq!(err_text(redis::cmd("HSET").arg("str").arg("f").arg("v").query::<Value>(&mut c)), wt);
        assert_eq!(err_text(redis::cmd("ZADD").arg("user1").arg(1).arg("m").query::<Value>(&mut c)), wt);
        // Sorted sets with Java double text, -inf/+inf and LIMIT in any case.
        for (score, key) in
            [("-5.94971599E8", "user1"), ("1.5E2", "user2"), ("3", "user3"), ("-inf", "user0"), ("150", "user2b")]
        {
            assert_eq!(redis::cmd("ZADD").arg("_indices").arg(score).arg(key).query::<i64>(&mut c).unwrap(), 1);
        }
        assert_eq!(redis::cmd("ZADD").arg("_indices").arg("4").arg("user3").query::<i64>(&mut c).unwrap(), 0);
        assert_eq!(redis::cmd("ZADD").arg("_indices").arg("CH").arg("5").arg("user3").query::<i64>(&mut c).unwrap(), 1);
        assert_eq!(redis::cmd("ZADD").arg("_indices").arg("NX").arg("9").arg("user3").query::<i64>(&mut c).unwrap(), 0);
        assert_eq!(
            redis::cmd("ZADD").arg("_indices").arg("INCR").arg("2").arg("user3").query::<String>(&mut c).unwrap(),
            "7"
        );
        assert_eq!(
            err_text(redis::cmd("ZADD").arg("_indices").arg("x1").arg("m").query::<Value>(&mut c)),
            "ERR value is not a valid float"
        );
        assert_eq!(redis::cmd("ZSCORE").arg("_indices").arg("user1").query::<String>(&mut c).unwrap(), "-594971599");
        assert_eq!(redis::cmd("ZCARD").arg("_indices").query::<i64>(&mut c).unwrap(), 5);
        let r: Vec<String> = redis::cmd("ZRANGEBYSCORE").arg("_indices").arg("-inf").arg("+inf").query(&mut c).unwrap();
        assert_eq!(r, vec!["user0", "user1", "user3", "user2", "user2b"], "{ctx}: (score, member) order");
        let r: Vec<String> = redis::cmd("ZRANGEBYSCORE")
            .arg("_indices")
            .arg("-5.94971599E8")
            .arg("+inf")
            .arg("limit")
            .arg(1)
            .arg(2)
            .query(&mut c)
            .unwrap();
        assert_eq!(r, vec!["user3", "user2"]);
        let r: Vec<String> =
            redis::cmd("ZRANGEBYSCORE").arg("_indices").arg("(7").arg("150").arg("WITHSCORES").query(&mut c).unwrap();
        assert_eq!(r, vec!["user2", "150", "user2b", "150"]);
        assert_eq!(
            err_text(redis::cmd("ZRANGEBYSCORE").arg("_indices").arg("a").arg("1").query::<Value>(&mut c)),
            "ERR min or max is not a float"
        );
        assert_eq!(redis::cmd("ZREM").arg("_indices").arg("user2").arg("nope").query::<i64>(&mut c).unwrap(), 1);
        let r: Vec<String> = redis::cmd("ZRANGEBYSCORE").arg("_indices").arg(150).arg(150).query(&mut c).unwrap();
        assert_eq!(r, vec!["user2b"]);
        // DEL of a hash and of a sorted set removes every record; SET replaces a hash.
        assert_eq!(redis::cmd("DEL").arg("user1").arg("_indices").query::<i64>(&mut c).unwrap(), 2);
        assert_eq!(redis::cmd("HGETALL").arg("user1").query::<Vec<String>>(&mut c).unwrap(), Vec::<String>::new());
        let _: () = redis::cmd("HSET").arg("h2").arg("f").arg("v").query(&mut c).unwrap();
        let _: () = c.set("h2", "now a string").unwrap();
        assert_eq!(c.get::<_, String>("h2").unwrap(), "now a string");
        // Only "str" and "h2" remain: no stray field, member or index record.
        let mut rest: Vec<Vec<u8>> = f.db.scan::<std::ops::RangeFull>(..).unwrap().map(|e| e.unwrap().0).collect();
        rest.sort();
        assert_eq!(rest, vec![b"h2".to_vec(), b"str".to_vec()], "{ctx}");
    }
}

#[test]
fn pipelining_and_binary_safe_keys_and_values() {
    let f = start(Preset::Pmekv);
    let mut c = f.client();
    let mut p = redis::pipe();
    for i in 0..2000u32 {
        p.cmd("SET").arg(format!("p{i}")).arg(i).ignore();
    }
    for i in (0..2000u32).step_by(100) {
        p.cmd("GET").arg(format!("p{i}"));
    }
    let got: Vec<u32> = p.query(&mut c).unwrap();
    assert_eq!(got, (0..2000).step_by(100).collect::<Vec<_>>());
    // Binary keys and values: NUL, CR/LF, 0xFF (the prefix of hashes), empty.
    let keys: Vec<Vec<u8>> = vec![b"\0".to_vec(), b"a\r\nb".to_vec(), vec![0xff], vec![0xff, b'm', b'x'], Vec::new()];
    for (i, k) in keys.iter().enumerate() {
        let v: Vec<u8> = (0..=255u8).cycle().skip(i).take(1000 + i).collect();
        let _: () = c.set(k, &v).unwrap();
        assert_eq!(c.get::<_, Vec<u8>>(k).unwrap(), v);
    }
    assert_eq!(redis::cmd("TYPE").arg(&[0xffu8, b'm', b'x'][..]).query::<String>(&mut c).unwrap(), "string");
    let _: () = c.set(b"empty-value", b"").unwrap();
    assert_eq!(c.get::<_, Vec<u8>>(b"empty-value").unwrap(), b"");
    // Raw pipelined bytes, with inline and multibulk mixed, in one write.
    let mut s = f.raw();
    let want = b"+PONG\r\n+OK\r\n$2\r\nv1\r\n:1\r\n";
    let got =
        raw_exchange(&mut s, b"PING\r\n*3\r\n$3\r\nSET\r\n$2\r\nk1\r\n$2\r\nv1\r\nget k1\r\nEXISTS k1\r\n", want.len());
    assert_eq!(got, want);
}

#[test]
fn errors_are_redis_errors() {
    let f = start(Preset::Hpdk);
    let mut c = f.client();
    assert_eq!(err_text(redis::cmd("GET").query::<Value>(&mut c)), "ERR wrong number of arguments for 'get' command");
    assert_eq!(
        err_text(redis::cmd("NOPE").arg("a").arg("b").query::<Value>(&mut c)),
        "ERR unknown command 'NOPE', with args beginning with: 'a' 'b'"
    );
    assert_eq!(err_text(redis::cmd("HELLO").arg(4).query::<Value>(&mut c)), "NOPROTO unsupported protocol version");
    // Protocol errors: -ERR and the connection is closed, as Redis does.
    for (input, msg) in [
        (&b"*abc\r\n"[..], "-ERR Protocol error: invalid multibulk length\r\n"),
        (b"*1\r\n$-7\r\n", "-ERR Protocol error: invalid bulk length\r\n"),
        (b"*1\r\n:5\r\n", "-ERR Protocol error: expected '$', got ':'\r\n"),
        (b"SET \"k\r\n", "-ERR Protocol error: unbalanced quotes in request\r\n"),
        (b"*1\r\n$999999999999\r\n", "-ERR Protocol error: invalid bulk length\r\n"),
    ] {
        let mut s = f.raw();
        let got = raw_exchange(&mut s, input, usize::MAX);
        assert_eq!(String::from_utf8_lossy(&got), msg);
    }
    // A bulk over the limit (64 MiB, tierkv's value limit) is refused at its header.
    let mut s = f.raw();
    let req = format!("*3\r\n$3\r\nSET\r\n$1\r\nk\r\n${}\r\n", (64 << 20) + 1).into_bytes();
    let got = raw_exchange(&mut s, &req, usize::MAX);
    assert_eq!(String::from_utf8_lossy(&got), "-ERR Protocol error: invalid bulk length\r\n");
    let mut c2 = f.client();
    assert_eq!(redis::cmd("PING").query::<String>(&mut c2).unwrap(), "PONG");
}

#[test]
fn a_thousand_concurrent_connections_are_served() {
    let f = start(Preset::Slmdb);
    let mut socks: Vec<TcpStream> = (0..1000).map(|_| f.raw()).collect();
    for (i, s) in socks.iter_mut().enumerate() {
        let cmd = format!("*3\r\n$3\r\nSET\r\n${}\r\nconn{i}\r\n$1\r\nx\r\n", format!("conn{i}").len());
        s.write_all(cmd.as_bytes()).unwrap();
    }
    for s in socks.iter_mut() {
        let mut b = [0u8; 5];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"+OK\r\n");
    }
    let mut c = f.client();
    let info: String = redis::cmd("INFO").arg("clients").query(&mut c).unwrap();
    let n: u64 =
        info.lines().find_map(|l| l.strip_prefix("connected_clients:")).and_then(|v| v.trim().parse().ok()).unwrap();
    assert!(n >= 1001, "connected_clients {n}");
    assert_eq!(redis::cmd("DBSIZE").query::<i64>(&mut c).unwrap(), 1000);
}

#[test]
fn garbage_truncated_frames_huge_headers_and_disconnects_do_not_hurt_the_server() {
    let f = start(Preset::Pmekv);
    let mut c = f.client();
    let _: () = c.set("keep", "me").unwrap();
    let mut rng = 0x9e3779b97f4a7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let frames: Vec<Vec<u8>> = vec![
        b"*2147483647\r\n$2147483647\r\n".to_vec(),
        b"*3\r\n$3\r\nSET\r\n$1\r\nk".to_vec(),
        b"*1\r\n$4\r\nPI".to_vec(),
        b"$5\r\nhello\r\n".to_vec(),
        vec![b'*'; 100_000],
        b"\"unterminated".to_vec(),
        b"*-1\r\n*0\r\n".to_vec(),
        b"*1\r\n$67108864\r\n".to_vec(),
    ];
    for round in 0..300 {
        let mut s = f.raw();
        let input: Vec<u8> = if round < frames.len() {
            frames[round].clone()
        } else {
            (0..(next() % 512)).map(|_| next() as u8).collect()
        };
        let _ = s.write_all(&input);
        if round % 2 == 0 {
            // Abrupt disconnect without reading.
            drop(s);
        } else {
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            let mut sink = [0u8; 4096];
            let _ = s.read(&mut sink);
        }
    }
    assert_eq!(redis::cmd("PING").query::<String>(&mut c).unwrap(), "PONG");
    assert_eq!(c.get::<_, String>("keep").unwrap(), "me");
    assert_eq!(f.db.check().unwrap(), Vec::<String>::new());
}

#[test]
fn limits_idle_timeout_max_clients_and_clean_shutdown() {
    let cfg = ServerConfig { port: Some(0), threads: 1, timeout_secs: 1, max_clients: 3, ..ServerConfig::default() };
    let mut f = start_with(Preset::Hpdk, cfg);
    let mut c = f.client();
    let _: () = c.set("durable", "yes").unwrap();
    let _a = f.raw();
    let _b = f.raw();
    let mut over = f.raw();
    let got = raw_exchange(&mut over, b"", b"-ERR max number of clients reached\r\n".len());
    assert_eq!(got, b"-ERR max number of clients reached\r\n");
    // An idle connection is closed after the timeout (EOF on read).
    std::thread::sleep(Duration::from_millis(2500));
    let mut idle = f.raw();
    idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(idle.read(&mut b).unwrap(), 0, "idle connection not closed");
    // Shutdown, close, reopen: the acknowledged write is there.
    f.server.take().unwrap().shutdown();
    let Fixture { db, _dir: dir, .. } = f;
    db.close().unwrap();
    drop(db);
    let db = Db::open(dir.path(), options(Preset::Hpdk)).unwrap();
    assert_eq!(db.get(b"durable").unwrap().as_deref(), Some(&b"yes"[..]));
}
