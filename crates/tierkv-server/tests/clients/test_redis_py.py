"""`tierkv serve` driven by stock clients: redis-py 8 with its default settings (RESP3),
redis-cli (also over TLS), plus the security and crash tests that need a real process:
NOAUTH / WRONGPASS / DENIED from a non-loopback address, no password in `ps`, expiry across
kill -9, and a transaction interrupted by kill -9 being all or nothing.

Run by scripts/client-tests.sh (which installs redis-py, redis-tools and openssl) with
TIERKV_BIN pointing at the built `tierkv` binary.
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest
import redis

BIN = os.environ.get("TIERKV_BIN", "target/debug/tierkv")


class Served:
    def __init__(self, proc, port, tls_port, log):
        self.proc, self.port, self.tls_port, self.log = proc, port, tls_port, log

    def client(self, **kw):
        return redis.Redis(port=self.port, socket_timeout=20, **kw)

    def stderr(self):
        with open(self.log) as f:
            return f.read()


def serve(dir_, *args, env=None, wait=True):
    """Start `tierkv serve` on a free port; return a Served once it listens."""
    log = str(dir_) + ".stderr"
    e = dict(os.environ)
    e.pop("TIERKV_REQUIREPASS", None)
    e.update(env or {})
    args = list(args)
    if "--port" not in args:
        args += ["--port", "auto"]
    p = subprocess.Popen([BIN, "serve", "--dir", str(dir_), *args], stdout=subprocess.PIPE,
                         stderr=open(log, "w"), env=e, text=True)
    port = tls_port = None
    deadline = time.time() + 30
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        addr = line.split()[2]
        if "(tls" in line:
            tls_port = int(addr.rsplit(":", 1)[1])
        else:
            port = int(addr.rsplit(":", 1)[1])
        want_tls = "--tls-port" in args
        want_plain = args[args.index("--port") + 1] != "0"
        if (tls_port or not want_tls) and (port or not want_plain):
            return Served(p, port, tls_port, log)
    p.kill()
    raise RuntimeError("tierkv serve did not start: " + open(log).read())


@pytest.fixture
def srv(tmp_path):
    s = serve(tmp_path / "db")
    yield s
    s.proc.terminate()
    s.proc.wait(30)


def stop(s, sig=signal.SIGTERM):
    s.proc.send_signal(sig)
    s.proc.wait(30)


# --- redis-py with default settings -------------------------------------------------------


def test_default_client_speaks_resp3_and_gets_resp3_types(srv):
    r = srv.client()
    assert r.set("a", "1") is True
    assert r.get("a") == b"1"
    conn = r.connection_pool.get_connection()
    try:
        assert conn.protocol == 3, "redis-py 8 defaults to RESP3 (HELLO 3)"
    finally:
        r.connection_pool.release(conn)
    hello = r.execute_command("HELLO", "3")
    assert hello[b"proto"] == 3 and hello[b"server"] == b"redis"
    r.hset("h", mapping={"f": "v", "g": "w"})
    assert r.hgetall("h") == {b"f": b"v", b"g": b"w"}
    r.zadd("z", {"m": 1.5, "n": -2})
    score = r.zscore("z", "m")
    assert score == 1.5 and isinstance(score, float)
    assert r.zrangebyscore("z", "-inf", "+inf", withscores=True) == [(b"n", -2.0), (b"m", 1.5)]
    assert r.zadd("z", {"m": 1}, incr=True) == 2.5
    assert r.get("missing") is None
    assert r.config_get("port") in ({"port": str(srv.port)}, {b"port": str(srv.port).encode()})
    assert r.info()["redis_version"] == "7.0.0"
    # HELLO with SETNAME names the connection.
    raw = r.connection_pool.get_connection()
    try:
        raw.send_command("HELLO", "3", "SETNAME", "svc1")
        assert raw.read_response()[b"proto"] == 3
        raw.send_command("CLIENT", "GETNAME")
        assert raw.read_response() == b"svc1"
    finally:
        r.connection_pool.release(raw)


def test_resp2_clients_still_work(srv):
    r = srv.client(protocol=2)
    r.set("k", "v")
    assert r.get("k") == b"v"
    r.hset("h", "f", "v")
    assert r.hgetall("h") == {b"f": b"v"}
    r.zadd("z", {"m": 1.5})
    assert r.zscore("z", "m") == 1.5


def test_pipelines_with_and_without_transaction(srv):
    r = srv.client()
    p = r.pipeline()  # transaction=True: MULTI ... EXEC
    p.set("x", 1).incr("x").get("x").hset("hx", "f", "1").expire("x", 100)
    assert p.execute() == [True, 2, b"2", 1, True]
    assert 0 < r.ttl("x") <= 100
    p = r.pipeline(transaction=False)
    for i in range(100):
        p.set(f"k{i}", i)
    p.mget([f"k{i}" for i in range(100)])
    out = p.execute()
    assert out[:100] == [True] * 100 and out[100] == [str(i).encode() for i in range(100)]
    # A run-time error inside EXEC fails that command only, as Redis.
    p = r.pipeline()
    p.set("s", "str").hset("s", "f", "v").set("after", "yes")
    out = p.execute(raise_on_error=False)
    assert out[0] is True and isinstance(out[1], redis.ResponseError) and out[2] is True
    assert r.get("after") == b"yes"


def test_queue_time_error_aborts_the_transaction(srv):
    r = srv.client()
    p = r.pipeline()
    p.set("never", "1")
    p.execute_command("NOSUCHCOMMAND", "x")
    with pytest.raises(redis.ResponseError) as e:
        p.execute()
    assert "EXECABORT" in str(e.value) or "unknown command" in str(e.value)
    assert r.get("never") is None


def test_watch_aborts_exec_when_another_client_writes(srv):
    r, other = srv.client(), srv.client()
    r.set("bal", 10)
    with r.pipeline() as p:
        p.watch("bal")
        v = int(p.get("bal"))
        other.set("bal", 99)  # a change by someone else since WATCH
        p.multi()
        p.set("bal", v - 1)
        with pytest.raises(redis.WatchError):
            p.execute()
    assert r.get("bal") == b"99"

    def incr(pipe):
        v = int(pipe.get("bal"))
        pipe.multi()
        pipe.set("bal", v + 1)

    assert r.transaction(incr, "bal") == [True]
    assert r.get("bal") == b"100"


def test_concurrent_optimistic_increments_lose_nothing(srv):
    def worker():
        r = srv.client()
        for _ in range(50):
            r.transaction(lambda p: (lambda v: (p.multi(), p.set("ctr", v + 1)))(int(p.get("ctr") or 0)), "ctr")

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert srv.client().get("ctr") == b"200"


def test_lock_acquire_release_extend_and_contention(srv):
    r = srv.client()
    lock = r.lock("res", timeout=5, blocking_timeout=0.2)
    assert lock.acquire()
    assert 0 < r.pttl("res") <= 5000
    other = srv.client().lock("res", timeout=5, blocking_timeout=0.2)
    assert not other.acquire(), "a held lock must not be acquired twice"
    assert lock.extend(10)
    assert 5000 < r.pttl("res") <= 15000
    assert lock.owned()
    lock.release()
    assert r.get("res") is None
    assert other.acquire()
    other.release()
    # A lock that timed out and was taken by someone else cannot be released by its first
    # owner: the release script compares tokens.
    first = r.lock("res2", timeout=0.3)
    assert first.acquire()
    time.sleep(0.5)
    second = srv.client().lock("res2", timeout=5)
    assert second.acquire()
    with pytest.raises(redis.exceptions.LockNotOwnedError):
        first.extend(5)
    with pytest.raises(redis.exceptions.LockNotOwnedError):
        first.release()
    assert second.locked() and second.owned()
    second.release()
    with r.lock("ctx", timeout=2):
        assert r.exists("ctx") == 1
    assert r.exists("ctx") == 0
    # A lock with a timeout frees itself.
    short = r.lock("short", timeout=0.3)
    assert short.acquire()
    time.sleep(0.6)
    assert r.get("short") is None


def test_scripts_as_redis(srv):
    r = srv.client()
    assert r.eval("return redis.call('set', KEYS[1], ARGV[1])", 1, "sk", "sv") == b"OK"
    assert r.eval("return {1, 'two', redis.call('get', KEYS[1]), false}", 1, "sk") == [1, b"two", b"sv", None]
    sha = r.script_load("return tonumber(ARGV[1]) * 2")
    assert r.evalsha(sha, 0, 21) == 42
    assert r.script_exists(sha, "0" * 40) == [True, False]
    with pytest.raises(redis.exceptions.NoScriptError):
        r.evalsha("0" * 40, 0)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        r.eval("redis.call('hset', 'hh', 'f', 'v'); return redis.call('get', 'hh')", 0)
    assert r.eval("return redis.pcall('get', 'hh')['err'] ~= nil", 0) == 1
    with pytest.raises(redis.ResponseError):
        r.eval("return os.exit(1)", 0)


def test_expiry_commands(srv):
    r = srv.client()
    now = time.time()
    assert r.set("ex", "v", ex=100)
    assert 99 <= r.ttl("ex") <= 100
    assert r.set("px", "v", px=100000) and 99000 < r.pttl("px") <= 100000
    assert r.set("exat", "v", exat=int(now) + 100) and abs(r.expiretime("exat") - (int(now) + 100)) <= 1
    assert r.set("pxat", "v", pxat=int(now * 1000) + 100000) and r.pexpiretime("pxat") == int(now * 1000) + 100000
    assert r.set("ex", "v2", keepttl=True) and r.ttl("ex") > 90
    assert r.set("ex", "v3") and r.ttl("ex") == -1  # plain SET clears the expiry
    assert r.ttl("nope") == -2 and r.pttl("nope") == -2
    assert r.setex("se", 100, "v") and 0 < r.ttl("se") <= 100
    assert r.psetex("pse", 100000, "v") and 0 < r.pttl("pse") <= 100000
    assert r.getex("se", persist=True) == b"v" and r.ttl("se") == -1
    assert r.getex("se", ex=50) == b"v" and 0 < r.ttl("se") <= 50
    assert r.persist("se") and r.ttl("se") == -1 and not r.persist("se")
    r.set("k", "v")
    assert r.expire("k", 100, xx=True) is False
    assert r.expire("k", 100, nx=True) is True
    assert r.expire("k", 50, nx=True) is False
    assert r.expire("k", 50, gt=True) is False
    assert r.expire("k", 200, gt=True) is True and r.ttl("k") > 150
    assert r.expire("k", 10, lt=True) is True and r.ttl("k") <= 10
    assert r.pexpire("k", 100000) and r.pttl("k") > 10000
    assert r.expireat("k", int(now) + 300) and r.ttl("k") > 250
    assert r.pexpireat("k", int(now * 1000) + 400000) and r.ttl("k") > 350
    assert r.incr("cnt") == 1 and r.expire("cnt", 100) and r.incr("cnt") == 2 and r.ttl("cnt") > 90  # INCR keeps it
    with pytest.raises(redis.ResponseError, match="invalid expire time"):
        r.set("bad", "v", ex=0)
    with pytest.raises(redis.ResponseError, match="not compatible"):
        r.execute_command("EXPIRE", "k", 10, "NX", "XX")
    # Expiry in the past deletes.
    assert r.expire("k", -1) is True and r.exists("k") == 0
    # Short expiries: gone from every read path.
    r.set("short", "v", px=300)
    r.hset("hshort", "f", "v")
    r.pexpire("hshort", 300)
    r.zadd("zshort", {"m": 1})
    r.pexpire("zshort", 300)
    assert r.exists("short", "hshort", "zshort") == 3
    time.sleep(0.5)
    for k in ("short", "hshort", "zshort"):
        assert r.exists(k) == 0 and r.type(k) == b"none" and r.ttl(k) == -2, k
    assert r.get("short") is None and r.hgetall("hshort") == {} and r.zscore("zshort", "m") is None
    keys = set(r.keys("*"))
    assert not keys & {b"short", b"hshort", b"zshort"}
    assert not set(r.scan_iter(count=3)) & {b"short", b"hshort", b"zshort"}
    assert r.dbsize() == len(keys)
    # A new hash under an expired name starts empty.
    r.hset("hshort", "new", "1")
    assert r.hgetall("hshort") == {b"new": b"1"} and r.ttl("hshort") == -1


def test_background_sweep_deletes_expired_keys(srv):
    r = srv.client()
    for i in range(200):
        r.set(f"sw{i}", "v", px=200)
    time.sleep(1.0)
    info = r.info("stats")
    assert info["expired_keys"] >= 200, info
    assert r.info("keyspace").get("db0", {}).get("expires", 0) == 0


# --- persistence across kill -9 ------------------------------------------------------------


def test_expiry_survives_kill9_and_restart(tmp_path):
    d = tmp_path / "db"
    s = serve(d)
    r = s.client()
    r.set("long", "v", ex=1000)
    r.set("soon", "v", px=1500)
    r.hset("hlong", "f", "v")
    r.expire("hlong", 1000)
    r.set("plain", "v")
    r.set("was", "v", ex=1000)
    r.persist("was")
    deadline = r.pexpiretime("long")
    stop(s, signal.SIGKILL)
    s = serve(d)
    try:
        r = s.client()
        assert r.pexpiretime("long") == deadline, "the absolute expiry time is stored with the value"
        assert 990 < r.ttl("hlong") <= 1000
        assert r.ttl("plain") == -1 and r.ttl("was") == -1 and r.get("was") == b"v"
        assert r.get("soon") == b"v"
        time.sleep(1.6)
        assert r.get("soon") is None
        stop(s, signal.SIGKILL)
        s = serve(d)
        r = s.client()
        assert r.exists("soon") == 0 and r.get("long") == b"v"
        assert sorted(r.keys("*")) == [b"hlong", b"long", b"plain", b"was"]
    finally:
        stop(s)


def test_transactions_interrupted_by_kill9_are_all_or_nothing(tmp_path):
    """Each transaction writes 200 keys (1 KB each), a hash and a counter; the server is
    killed at random moments while transactions stream in, five times over. After each
    restart every acknowledged transaction is whole and the one in flight is whole or
    absent: never partial."""
    d = tmp_path / "db"
    value = "x" * 1000
    width = 200
    for round_ in range(5):
        s = serve(d)
        r = s.client()
        start = int(r.get("committed") or 0)
        acked, errors = [], []

        def writer():
            w = s.client()
            i = start
            try:
                while True:
                    p = w.pipeline()
                    for j in range(width):
                        p.set(f"t{i}:{j}", value)
                    p.hset(f"t{i}:h", mapping={str(j): j for j in range(10)})
                    p.incr("committed")
                    p.execute()
                    acked.append(i)
                    i += 1
            except (redis.ConnectionError, ConnectionResetError, OSError):
                pass
            except Exception as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        t = threading.Thread(target=writer)
        t.start()
        time.sleep(random.uniform(0.4, 1.0))
        stop(s, signal.SIGKILL)
        t.join(30)
        assert not errors, errors
        assert len(acked) > 2, "the writer made too little progress for the test to mean anything"
        s = serve(d)
        try:
            r = s.client()
            committed = int(r.get("committed") or 0)
            assert committed >= start + len(acked), f"round {round_}: an acknowledged transaction was lost"
            assert committed <= start + len(acked) + 1
            for i in list(range(max(start, committed - 3), committed + 2)):
                present = r.exists(*[f"t{i}:{j}" for j in range(width)]) + r.exists(f"t{i}:h")
                if i < committed:
                    assert present == width + 1 and r.hlen(f"t{i}:h") == 10, f"transaction {i} is partial: {present}"
                else:
                    assert present == 0, f"round {round_}: transaction {i} is partial after the crash: {present}"
        finally:
            stop(s)


# --- security --------------------------------------------------------------------------------


def test_auth_noauth_wrongpass_log_and_no_password_in_ps(tmp_path):
    pw = "correct horse battery staple %d" % random.randrange(10**9)
    f = tmp_path / "pw"
    f.write_text(pw + "\n")
    s = serve(tmp_path / "db", "--requirepass-file", str(f))
    try:
        with pytest.raises(redis.AuthenticationError):  # NOAUTH
            s.client().get("k")
        with pytest.raises(redis.AuthenticationError):  # WRONGPASS
            s.client(password="wrong").get("k")
        raw = socket.create_connection(("127.0.0.1", s.port))
        raw.sendall(b"GET k\r\nAUTH nope\r\nAUTH default nope\r\nPING\r\n")
        time.sleep(0.3)
        got = raw.recv(65536).decode()
        assert got.count("-NOAUTH Authentication required.") == 2, got
        assert got.count("-WRONGPASS invalid username-password pair or user is disabled.") == 2, got
        raw.close()
        r = s.client(password=pw)  # redis-py: HELLO 3 AUTH default <pw>
        assert r.set("k", "v") and r.get("k") == b"v"
        assert s.client(username="default", password=pw, protocol=2).get("k") == b"v"
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert "tierkv serve" in ps and pw not in ps
        assert r.config_get("requirepass") in ({"requirepass": ""}, {b"requirepass": b""})
        time.sleep(0.2)
        assert "failed AUTH" in s.stderr() and pw not in s.stderr()
    finally:
        stop(s)
    s = serve(tmp_path / "db", env={"TIERKV_REQUIREPASS": pw})
    try:
        with pytest.raises(redis.AuthenticationError):
            s.client().get("k")
        assert s.client(password=pw).get("k") == b"v"
        assert pw not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    finally:
        stop(s)


NETNS_SCRIPT = r"""
set -e
ip link set lo up
ip addr add 198.18.0.1/32 dev lo
"$BIN" serve --dir "$DIR" --bind 0.0.0.0 --port 16390 $EXTRA > "$DIR.out" 2>&1 &
pid=$!
for i in $(seq 100); do redis-cli -h 127.0.0.1 -p 16390 ping >/dev/null 2>&1 && break; sleep 0.1; done
echo "loopback: $(redis-cli -h 127.0.0.1 -p 16390 ping 2>&1)"
echo "external: $(redis-cli -h 198.18.0.1 -p 16390 ping 2>&1)"
kill $pid; wait $pid || true
"""


def run_in_netns(tmp_path, extra, env=None):
    """Run a server and two redis-cli clients inside a new network namespace, in which
    198.18.0.1 (a benchmarking-range address) is a non-loopback address of the machine."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed for the DENIED test")
    e = dict(os.environ, BIN=os.path.abspath(BIN), DIR=str(tmp_path / f"ns{random.randrange(10**6)}"), EXTRA=extra)
    e.update(env or {})
    p = subprocess.run(["unshare", "--net", "--", "bash", "-c", NETNS_SCRIPT], capture_output=True, text=True, env=e,
                       timeout=60)
    if p.returncode != 0 and "Operation not permitted" in p.stderr:
        # Not root: a user namespace gives the same power over a private network namespace.
        p = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "--", "bash", "-c", NETNS_SCRIPT],
                           capture_output=True, text=True, env=e, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_protected_mode_denies_non_loopback_clients(tmp_path):
    out = run_in_netns(tmp_path, "")
    assert "loopback: PONG" in out, out
    assert "external: DENIED Redis is running in protected mode" in out, out
    out = run_in_netns(tmp_path, "--protected-mode no")
    assert "external: PONG" in out, out
    f = tmp_path / "pw"
    f.write_text("pw1\n")
    out = run_in_netns(tmp_path, f"--requirepass-file {f}")
    assert "external: NOAUTH Authentication required." in out, out


# --- redis-cli, TLS ----------------------------------------------------------------------------


def cli(*args, input=None):
    return subprocess.run(["redis-cli", *args], capture_output=True, text=True, input=input, timeout=30).stdout


def test_redis_cli_resp2_and_resp3(srv):
    p = str(srv.port)
    assert cli("-p", p, "set", "greeting", "hello").strip() == "OK"
    assert cli("-p", p, "get", "greeting").strip() == "hello"
    cli("-p", p, "hset", "h", "f", "v")
    assert cli("-3", "--no-raw", "-p", p, "hgetall", "h").strip() == '1# "f" => "v"'
    cli("-p", p, "zadd", "z", "1.5", "m")
    assert cli("-3", "--no-raw", "-p", p, "zscore", "z", "m").strip() == "(double) 1.5"
    assert cli("-p", p, "set", "e", "v", "ex", "100").strip() == "OK"
    assert 0 < int(cli("-p", p, "ttl", "e")) <= 100
    out = cli("-p", p, input="MULTI\nSET a 1\nINCR a\nEXEC\n")
    assert out.split() == ["OK", "QUEUED", "QUEUED", "OK", "2"], out


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    def ssl(*a):
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tierkv test CA",
        "-keyout", "ca.key", "-out", "ca.crt")
    (d / "ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
            "-out", f"{name}.csr")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "ext", "-out", f"{name}.crt")
    return d


def test_tls_with_redis_cli_and_redis_py(tmp_path, certs):
    c = certs
    s = serve(tmp_path / "db", "--port", "0", "--tls-port", "auto", "--tls-cert-file", str(c / "server.crt"),
              "--tls-key-file", str(c / "server.key"), "--tls-ca-cert-file", str(c / "ca.crt"))
    try:
        assert s.port is None, "--port 0 turns the plain port off"
        tp = str(s.tls_port)
        tls = ["--tls", "--cacert", str(c / "ca.crt"), "--cert", str(c / "client.crt"), "--key", str(c / "client.key")]
        assert cli(*tls, "-p", tp, "set", "secure", "yes").strip() == "OK"
        assert cli(*tls, "-p", tp, "get", "secure").strip() == "yes"
        # Without a client certificate the handshake is refused (tls-auth-clients yes).
        assert cli("--tls", "--cacert", str(c / "ca.crt"), "-p", tp, "get", "secure").strip() != "yes"
        # Not TLS at all: no reply.
        assert cli("-p", tp, "get", "secure").strip() != "yes"
        r = redis.Redis(port=s.tls_port, ssl=True, ssl_ca_certs=str(c / "ca.crt"), ssl_certfile=str(c / "client.crt"),
                        ssl_keyfile=str(c / "client.key"), socket_timeout=20)
        assert r.get("secure") == b"yes"
        p = r.pipeline()
        p.set("t1", 1).incr("t1")
        assert p.execute() == [True, 2]
        with r.lock("tls-lock", timeout=5):
            pass
    finally:
        stop(s)
