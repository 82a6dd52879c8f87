//! `tierkv bench --server`: `tierkv serve` (each preset) against `redis-server` (AOF with
//! `appendfsync always`, AOF with `everysec`, no AOF) on loopback, in one run.
//!
//! 1. **redis-benchmark** (Redis's own load generator, from `redis-tools`):
//!    `-t set,get -n N -c 50 -d <value size> -r N`, with and without `-P 16`; its CSV output
//!    gives ops/s, p50 and p99 per test.
//! 2. **YCSB A–F over RESP** with the harness's own YCSB generator (the same seeded
//!    scrambled-zipfian / latest streams the in-process runs use) driving a Rust client (the
//!    `redis` crate) that issues what YCSB's Redis binding issues: insert = `HMSET key field0
//!    <value>` + `ZADD _indices <Java hashCode(key)> key`; update = `HMSET`; read =
//!    `HGETALL`; scan = `ZRANGEBYSCORE _indices <hashCode(start)> +inf LIMIT 0 n` then
//!    `HGETALL` per key. One field of `--value-size` bytes (YCSB's default is ten fields of
//!    100 B) keeps these runs comparable with the in-process ones. YCSB's Java core was not
//!    used: its Redis binding is not published on Maven Central.
//!
//! Security (`--server-auth`, `--server-tls`): every server of the run, tierkv and Redis
//! alike, then requires a password (a random one per run, given to `tierkv serve` in a
//! `--requirepass-file` and to `redis-server` in a configuration file, so neither shows it
//! in `ps`; redis-benchmark gets it with `-a`) and/or listens only on a TLS port (a CA and a
//! server certificate for `localhost`/`127.0.0.1` made for the run with `rcgen`; ECDSA
//! P-256; clients are not asked for certificates, Redis's `--tls-auth-clients no`). The
//! YCSB client (the `redis` crate with rustls) and redis-benchmark (`--tls --cacert`) then
//! authenticate and/or speak TLS, so each figure includes the cost of both on both sides.
//!
//! Durability levels: tierkv's presets reply once a write survives a process crash (kill -9),
//! as Redis with AOF does (`everysec` writes the AOF before replying and fsyncs each second;
//! `always` also fsyncs before replying, so it survives power loss; no AOF keeps nothing). So
//! `redis/aof-everysec` is the like-for-like peer; the other two bracket it.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::api::{BenchEngine, Result, Usage};
use crate::run::{self, Loaded, Params, Workload};

/// One server under test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `tierkv serve --preset P`.
    Tierkv(tierkv::Preset),
    /// `redis-server` with this `appendfsync` (`None`: `appendonly no`).
    Redis(Option<&'static str>),
}

impl Target {
    /// Display name.
    pub fn name(&self) -> String {
        match self {
            Target::Tierkv(p) => format!("tierkv/{p}"),
            Target::Redis(Some(f)) => format!("redis/aof-{f}"),
            Target::Redis(None) => "redis/no-aof".into(),
        }
    }
}

/// `tierkv bench --server` settings.
#[derive(Debug, Clone)]
pub struct ServerArgs {
    /// The `tierkv` executable (for `tierkv serve`).
    pub tierkv_exe: PathBuf,
    /// Servers, in report order.
    pub targets: Vec<Target>,
    /// redis-benchmark `-n` (and `-r`: the key space).
    pub requests: u64,
    /// redis-benchmark `-c`.
    pub clients: usize,
    /// redis-benchmark `-P` values (1 = no pipelining).
    pub pipelines: Vec<usize>,
    /// Value size (redis-benchmark `-d`, YCSB field size).
    pub value_size: usize,
    /// YCSB records loaded, and operations per workload.
    pub ycsb_num: u64,
    /// YCSB client threads.
    pub threads: usize,
    /// Seed of the YCSB streams.
    pub seed: u64,
    /// Where server data goes (a fresh subdirectory per server).
    pub dir: PathBuf,
    /// Where tierkv's PM pools go.
    pub pm_dir: PathBuf,
    /// YCSB workloads run after the load, in order (empty: no YCSB).
    pub ycsb: Vec<Workload>,
    /// How every server is secured.
    pub security: Security,
}

/// How every server of a run is secured (`--server-auth`, `--server-tls`; see the module
/// docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Security {
    /// Clients must AUTH with a password.
    pub auth: bool,
    /// The servers listen on a TLS port only.
    pub tls: bool,
}

impl Security {
    /// `plain`, `AUTH`, `TLS` or `AUTH+TLS`.
    pub fn label(&self) -> &'static str {
        match (self.auth, self.tls) {
            (false, false) => "plain",
            (true, false) => "AUTH",
            (false, true) => "TLS",
            (true, true) => "AUTH+TLS",
        }
    }
}

/// A run's credentials: its password and TLS files, in a private temporary directory.
struct Creds {
    dir: tempfile::TempDir,
    password: Option<String>,
    tls: Option<TlsFiles>,
}

struct TlsFiles {
    ca_pem: Vec<u8>,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(data).map_err(|e| format!("{}: {e}", path.display()))
}

impl Creds {
    fn new(sec: Security) -> Result<Creds> {
        let dir = tempfile::Builder::new().prefix("tierkv-bench-creds-").tempdir().map_err(|e| e.to_string())?;
        let password = if sec.auth {
            let mut b = [0u8; 16];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
                .map_err(|_| "no system randomness for the password")?;
            let pw: String = b.iter().map(|x| format!("{x:02x}")).collect();
            write_private(&dir.path().join("password"), format!("{pw}\n").as_bytes())?;
            Some(pw)
        } else {
            None
        };
        let tls = if sec.tls { Some(TlsFiles::new(dir.path())?) } else { None };
        Ok(Creds { dir, password, tls })
    }

    /// A client of the server on `port`, authenticating and speaking TLS as the run says.
    fn client(&self, port: u16) -> Result<redis::Client> {
        let auth = self.password.as_ref().map_or(String::new(), |p| format!(":{p}@"));
        match &self.tls {
            None => redis::Client::open(format!("redis://{auth}127.0.0.1:{port}/")),
            Some(t) => redis::Client::build_with_tls(
                format!("rediss://{auth}127.0.0.1:{port}/"),
                redis::TlsCertificates { client_tls: None, root_cert: Some(t.ca_pem.clone()) },
            ),
        }
        .map_err(|e| format!("client of port {port}: {e}"))
    }

    /// `tierkv serve`'s listener and password options.
    fn tierkv_args(&self) -> Vec<OsString> {
        let mut v: Vec<OsString> = Vec::new();
        match &self.tls {
            None => v.extend(["--port".into(), "auto".into()]),
            Some(t) => {
                v.extend(["--port".into(), "0".into(), "--tls-port".into(), "auto".into()]);
                v.extend(["--tls-cert-file".into(), t.cert.clone().into()]);
                v.extend(["--tls-key-file".into(), t.key.clone().into()]);
            }
        }
        if self.password.is_some() {
            v.extend(["--requirepass-file".into(), self.dir.path().join("password").into()]);
        }
        v
    }

    /// redis-server's configuration file (the password stays out of the process list) and
    /// its listener options.
    fn redis_args(&self, name: &str, port: u16) -> Result<Vec<OsString>> {
        let conf = self.dir.path().join(format!("{}.conf", name.replace('/', "-")));
        let text = self.password.as_ref().map_or(String::new(), |p| format!("requirepass {p}\n"));
        write_private(&conf, text.as_bytes())?;
        let mut v: Vec<OsString> = vec![conf.into()];
        match &self.tls {
            None => v.extend(["--port".into(), port.to_string().into()]),
            Some(t) => {
                v.extend(["--port".into(), "0".into(), "--tls-port".into(), port.to_string().into()]);
                v.extend(["--tls-cert-file".into(), t.cert.clone().into()]);
                v.extend(["--tls-key-file".into(), t.key.clone().into()]);
                v.extend(["--tls-ca-cert-file".into(), t.ca.clone().into()]);
                v.extend(["--tls-auth-clients".into(), "no".into()]);
            }
        }
        Ok(v)
    }

    /// redis-benchmark's options.
    fn benchmark_args(&self) -> Vec<OsString> {
        let mut v: Vec<OsString> = Vec::new();
        if let Some(p) = &self.password {
            v.extend(["-a".into(), p.into()]);
        }
        if let Some(t) = &self.tls {
            v.extend(["--tls".into(), "--cacert".into(), t.ca.clone().into()]);
        }
        v
    }
}

impl TlsFiles {
    /// A CA and a server certificate for localhost and 127.0.0.1 signed by it, in `dir`.
    fn new(dir: &Path) -> Result<TlsFiles> {
        let e = |e: rcgen::Error| format!("making the TLS certificates: {e}");
        let ca_key = rcgen::KeyPair::generate().map_err(e)?;
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, "tierkv bench CA");
        let ca_cert = ca_params.self_signed(&ca_key).map_err(e)?;
        let key = rcgen::KeyPair::generate().map_err(e)?;
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).map_err(e)?;
        params.distinguished_name.push(rcgen::DnType::CommonName, "localhost");
        let cert = params.signed_by(&key, &ca_cert, &ca_key).map_err(e)?;
        let t = TlsFiles {
            ca_pem: ca_cert.pem().into_bytes(),
            ca: dir.join("ca.crt"),
            cert: dir.join("server.crt"),
            key: dir.join("server.key"),
        };
        write_private(&t.ca, &t.ca_pem)?;
        write_private(&t.cert, cert.pem().as_bytes())?;
        write_private(&t.key, key.serialize_pem().as_bytes())?;
        Ok(t)
    }
}

/// One redis-benchmark line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RedisBench {
    /// Server.
    pub target: String,
    /// `SET` or `GET`.
    pub test: String,
    /// Pipeline depth.
    pub pipeline: usize,
    /// Requests per second.
    pub ops_per_sec: f64,
    /// Median latency (ms).
    pub p50_ms: f64,
    /// 99th percentile latency (ms).
    pub p99_ms: f64,
}

/// One YCSB workload over RESP.
#[derive(Debug, Clone, serde::Serialize)]
pub struct YcsbResp {
    /// Server.
    pub target: String,
    /// The harness's measurement.
    pub outcome: run::Outcome,
}

/// Everything `--server` measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ServerReport {
    /// redis-benchmark results.
    pub redis_benchmark: Vec<RedisBench>,
    /// YCSB results.
    pub ycsb: Vec<YcsbResp>,
    /// How the servers were secured.
    pub security: Security,
}

struct Running {
    child: Child,
    port: u16,
}

impl Drop for Running {
    fn drop(&mut self) {
        // SIGTERM: both servers shut down cleanly on it (tierkv closes the store).
        // SAFETY: plain system call on our child's pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

fn wait_ready(r: &mut Running, creds: &Creds) -> Result<()> {
    let port = r.port;
    let client = creds.client(port)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = String::new();
    while Instant::now() < deadline {
        if let Ok(Some(st)) = r.child.try_wait() {
            return Err(format!("server on port {port} exited: {st}"));
        }
        match client.get_connection().and_then(|mut con| redis::cmd("PING").query::<String>(&mut con)) {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("server on port {port} did not answer PING ({last})"))
}

fn start(a: &ServerArgs, creds: &Creds, t: &Target, dir: &Path, pm: &Path) -> Result<Running> {
    match t {
        Target::Tierkv(p) => {
            let mut child = Command::new(&a.tierkv_exe)
                .args(["serve", "--preset", p.name()])
                .args(creds.tierkv_args())
                .arg("--dir")
                .arg(dir)
                .arg("--pm-path")
                .arg(pm)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("{}: {e}", a.tierkv_exe.display()))?;
            let mut line = String::new();
            let out = child.stdout.take().ok_or("no stdout")?;
            BufReader::new(out).read_line(&mut line).map_err(|e| e.to_string())?;
            // "listening on 127.0.0.1:PORT (preset P)" or "... (tls, preset P)"
            let port = line
                .split_whitespace()
                .nth(2)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("tierkv serve did not report its port: `{}`", line.trim()))?;
            let mut r = Running { child, port };
            wait_ready(&mut r, creds)?;
            Ok(r)
        }
        Target::Redis(fsync) => {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            let port = free_port()?;
            let mut c = Command::new("redis-server");
            c.args(creds.redis_args(&t.name(), port)?)
                .args(["--bind", "127.0.0.1", "--save", "", "--daemonize", "no"])
                .args(["--protected-mode", "no", "--logfile", ""])
                .arg("--dir")
                .arg(dir);
            match fsync {
                Some(f) => c.args(["--appendonly", "yes", "--appendfsync", f]),
                None => c.args(["--appendonly", "no"]),
            };
            let child = c
                .stdout(Stdio::null())
                .spawn()
                .map_err(|e| format!("redis-server: {e} (install redis-server: scripts/deps.sh does)"))?;
            let mut r = Running { child, port };
            wait_ready(&mut r, creds)?;
            Ok(r)
        }
    }
}

/// Run redis-benchmark against `port`; parse its CSV.
fn redis_benchmark(a: &ServerArgs, creds: &Creds, target: &str, port: u16, pipeline: usize) -> Result<Vec<RedisBench>> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", "set,get", "--csv"])
        .args(creds.benchmark_args())
        .args(["-n", &a.requests.to_string(), "-r", &a.requests.to_string()])
        .args(["-c", &a.clients.to_string(), "-P", &pipeline.to_string(), "-d", &a.value_size.to_string()])
        .output()
        .map_err(|e| format!("redis-benchmark: {e} (install redis-tools: scripts/deps.sh does)"))?;
    if !out.status.success() {
        return Err(format!("redis-benchmark failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    parse_csv(&String::from_utf8_lossy(&out.stdout), target, pipeline)
}

/// Parse redis-benchmark's `--csv` output (Redis 7: test, rps, avg, min, p50, p95, p99, max).
pub fn parse_csv(text: &str, target: &str, pipeline: usize) -> Result<Vec<RedisBench>> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<String> = lines.next().ok_or("empty redis-benchmark output")?.split(',').map(unquote).collect();
    let col = |name: &str| header.iter().position(|h| h == name).ok_or(format!("no `{name}` column in {header:?}"));
    let (rps, p50, p99) = (col("rps")?, col("p50_latency_ms")?, col("p99_latency_ms")?);
    let mut out = Vec::new();
    for l in lines {
        let f: Vec<String> = l.split(',').map(unquote).collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).ok_or(format!("bad line `{l}`"));
        out.push(RedisBench {
            target: target.into(),
            test: f.first().cloned().unwrap_or_default(),
            pipeline,
            ops_per_sec: num(rps)?,
            p50_ms: num(p50)?,
            p99_ms: num(p99)?,
        });
    }
    Ok(out)
}

fn unquote(s: &str) -> String {
    s.trim().trim_matches('"').to_string()
}

/// Java's `String.hashCode` of `key` (YCSB's score for the `_indices` sorted set).
pub fn java_hash(key: &[u8]) -> i32 {
    key.iter().fold(0i32, |h, &b| h.wrapping_mul(31).wrapping_add(b as i32))
}

/// A bench engine that speaks to a server over RESP the way YCSB's Redis binding does.
pub struct RespEngine {
    name: String,
    client: redis::Client,
    pool: Mutex<Vec<redis::Connection>>,
}

impl std::fmt::Debug for RespEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RespEngine").field("name", &self.name).finish()
    }
}

impl RespEngine {
    /// Connect to `127.0.0.1:port`.
    pub fn connect(name: String, port: u16) -> Result<RespEngine> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).map_err(|e| e.to_string())?;
        Ok(RespEngine::with_client(name, client))
    }

    /// Use `client` (its URL and TLS settings say how to connect and authenticate).
    pub fn with_client(name: String, client: redis::Client) -> RespEngine {
        RespEngine { name, client, pool: Mutex::new(Vec::new()) }
    }

    fn with<T>(&self, f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>) -> Result<T> {
        let con = self.pool.lock().pop();
        let mut con = match con {
            Some(c) => c,
            None => self.client.get_connection().map_err(|e| e.to_string())?,
        };
        let r = f(&mut con).map_err(|e| format!("{}: {e}", self.name));
        self.pool.lock().push(con);
        r
    }

    fn hgetall_len(con: &mut redis::Connection, key: &[u8]) -> redis::RedisResult<Option<usize>> {
        let v: Vec<Vec<u8>> = redis::cmd("HGETALL").arg(key).query(con)?;
        Ok((!v.is_empty()).then(|| v.iter().skip(1).step_by(2).map(Vec::len).sum()))
    }
}

impl BenchEngine for RespEngine {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn put(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.with(|c| redis::cmd("HMSET").arg(key).arg("field0").arg(value).query::<()>(c))
    }
    fn insert(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.with(|c| {
            redis::cmd("HMSET").arg(key).arg("field0").arg(value).query::<()>(c)?;
            redis::cmd("ZADD").arg("_indices").arg(f64::from(java_hash(key))).arg(key).query::<()>(c)
        })
    }
    fn get(&self, key: &[u8]) -> Result<Option<usize>> {
        self.with(|c| RespEngine::hgetall_len(c, key))
    }
    fn get_value(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        // HGETALL (the server has no HGET): field0's value.
        self.with(|c| {
            let v: Vec<Vec<u8>> = redis::cmd("HGETALL").arg(key).query(c)?;
            Ok(v.chunks(2).find(|p| p.first().is_some_and(|f| f == b"field0")).and_then(|p| p.get(1).cloned()))
        })
    }
    fn scan(&self, start: &[u8], n: usize) -> Result<usize> {
        self.with(|c| {
            let keys: Vec<Vec<u8>> = redis::cmd("ZRANGEBYSCORE")
                .arg("_indices")
                .arg(f64::from(java_hash(start)))
                .arg("+inf")
                .arg("LIMIT")
                .arg(0)
                .arg(n)
                .query(c)?;
            let mut found = 0;
            for k in &keys {
                found += usize::from(RespEngine::hgetall_len(c, k)?.is_some());
            }
            Ok(found)
        })
    }
    fn usage(&self) -> Usage {
        Usage::default()
    }
    fn reopen(&mut self) -> Result<f64> {
        Err("a server is not reopened by the client".into())
    }
}

/// The YCSB workloads run after the load by default, in this order (D and E insert, so
/// they come last, as in YCSB's own guidance).
pub const YCSB: [Workload; 6] =
    [Workload::YcsbA, Workload::YcsbB, Workload::YcsbC, Workload::YcsbF, Workload::YcsbD, Workload::YcsbE];

/// Run everything; print the tables; return the report.
pub fn run(a: &ServerArgs) -> Result<ServerReport> {
    let mut rep = ServerReport { security: a.security, ..ServerReport::default() };
    let params = Params {
        num: a.ycsb_num,
        value_size: a.value_size,
        key_size: 16,
        scan_len: 100,
        seed: a.seed,
        threads: a.threads.max(1),
        reads: None,
        time_cap_seconds: None,
        ycsb_fresh: false,
        crash_writes: None,
    };
    let creds = Creds::new(a.security)?;
    for t in &a.targets {
        let name = t.name();
        let disk =
            tempfile::Builder::new().prefix("tierkv-serve-bench-").tempdir_in(&a.dir).map_err(|e| e.to_string())?;
        let pm =
            tempfile::Builder::new().prefix("tierkv-serve-pm-").tempdir_in(&a.pm_dir).map_err(|e| e.to_string())?;
        if a.requests > 0 && !a.pipelines.is_empty() {
            eprintln!("{name} ({}): redis-benchmark", a.security.label());
            let srv = start(a, &creds, t, &disk.path().join("bench"), &pm.path().join("bench"))?;
            for &p in &a.pipelines {
                rep.redis_benchmark.extend(redis_benchmark(a, &creds, &name, srv.port, p)?);
            }
        }
        if a.ycsb_num > 0 && !a.ycsb.is_empty() {
            let names: Vec<&str> = a.ycsb.iter().map(|w| w.name()).collect();
            eprintln!("{name} ({}): YCSB load, {}", a.security.label(), names.join(", "));
            let srv = start(a, &creds, t, &disk.path().join("ycsb"), &pm.path().join("ycsb"))?;
            let e = RespEngine::with_client(name.clone(), creds.client(srv.port)?);
            let mut loaded = Loaded::default();
            for &w in std::iter::once(&Workload::YcsbLoad).chain(&a.ycsb) {
                if let Some(o) = run::run(&e, w, &params, &mut loaded)? {
                    rep.ycsb.push(YcsbResp { target: name.clone(), outcome: o });
                }
            }
        }
    }
    print!("{}", table(&rep, a));
    Ok(rep)
}

/// The side-by-side tables; ratios are against `redis/aof-everysec` when it ran.
pub fn table(rep: &ServerReport, a: &ServerArgs) -> String {
    let mut s = format!(
        "redis-benchmark -t set,get -n {} -r {} -c {} -d {}, {} (ops/s, p50/p99 ms; x = vs redis/aof-everysec)\n",
        a.requests,
        a.requests,
        a.clients,
        a.value_size,
        a.security.label()
    );
    s.push_str(&format!(
        "{:<22} {:>3} {:>5} {:>11} {:>7} {:>8} {:>8}\n",
        "server", "P", "test", "ops/s", "x", "p50", "p99"
    ));
    let base = |test: &str, p: usize| {
        rep.redis_benchmark
            .iter()
            .find(|r| r.target == "redis/aof-everysec" && r.test == test && r.pipeline == p)
            .map(|r| r.ops_per_sec)
    };
    for &p in &a.pipelines {
        for test in ["SET", "GET"] {
            for r in rep.redis_benchmark.iter().filter(|r| r.pipeline == p && r.test == test) {
                let x = base(test, p).map_or("-".into(), |b| format!("{:.2}", r.ops_per_sec / b));
                s.push_str(&format!(
                    "{:<22} {:>3} {:>5} {:>11.0} {:>7} {:>8.3} {:>8.3}\n",
                    r.target, p, r.test, r.ops_per_sec, x, r.p50_ms, r.p99_ms
                ));
            }
        }
    }
    s.push_str(&format!(
        "\nYCSB over RESP: {} records, {} ops per workload, {} B values, {} client thread(s), {} (ops/s, p50/p99 us)\n",
        a.ycsb_num,
        a.ycsb_num,
        a.value_size,
        a.threads,
        a.security.label()
    ));
    s.push_str(&format!("{:<22} {:>9} {:>11} {:>7} {:>9} {:>9}\n", "server", "workload", "ops/s", "x", "p50", "p99"));
    for &w in std::iter::once(&Workload::YcsbLoad).chain(&a.ycsb) {
        let b = rep
            .ycsb
            .iter()
            .find(|y| y.target == "redis/aof-everysec" && y.outcome.workload == w)
            .map(|y| y.outcome.ops_per_sec);
        for y in rep.ycsb.iter().filter(|y| y.outcome.workload == w) {
            let o = &y.outcome;
            let x = b.map_or("-".into(), |b| format!("{:.2}", o.ops_per_sec / b));
            s.push_str(&format!(
                "{:<22} {:>9} {:>11.0} {:>7} {:>9.1} {:>9.1}\n",
                y.target,
                w.name(),
                o.ops_per_sec,
                x,
                o.latency.p50_ns as f64 / 1e3,
                o.latency.p99_ns as f64 / 1e3
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn credentials_reach_every_server_and_client_but_never_a_command_line_password_for_servers() {
        use std::os::unix::fs::PermissionsExt;
        let c = Creds::new(Security { auth: true, tls: true }).unwrap();
        let pw = c.password.clone().unwrap();
        assert_eq!(pw.len(), 32);
        let text = |v: &[OsString]| v.iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        let tierkv = text(&c.tierkv_args());
        assert!(tierkv.starts_with("--port 0 --tls-port auto --tls-cert-file "), "{tierkv}");
        assert!(tierkv.contains("--requirepass-file ") && !tierkv.contains(&pw), "{tierkv}");
        let redis = c.redis_args("redis/aof-always", 7000).unwrap();
        let conf = PathBuf::from(&redis[0]);
        assert_eq!(std::fs::read_to_string(&conf).unwrap(), format!("requirepass {pw}\n"));
        assert_eq!(std::fs::metadata(&conf).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(!text(&redis).contains(&pw));
        assert!(text(&redis).contains("--port 0 --tls-port 7000 "));
        assert!(text(&c.benchmark_args()).starts_with(&format!("-a {pw} --tls --cacert ")));
        let tls = c.tls.as_ref().unwrap();
        assert!(std::fs::read_to_string(&tls.key).unwrap().contains("PRIVATE KEY"));
        assert!(String::from_utf8_lossy(&tls.ca_pem).contains("BEGIN CERTIFICATE"));
        // Plain: no options at all but the port.
        let p = Creds::new(Security::default()).unwrap();
        assert_eq!(text(&p.tierkv_args()), "--port auto");
        assert!(p.benchmark_args().is_empty());
        assert_eq!(std::fs::read_to_string(&p.redis_args("r", 1).unwrap()[0]).unwrap(), "");
    }

    #[test]
    fn parses_redis_benchmark_csv_and_java_hashes() {
        let csv = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\"SET\",\"55555.56\",\"0.119\",\"0.024\",\"0.087\",\"0.231\",\"0.375\",\"4.359\"\n\"GET\",\"39215.69\",\"0.168\",\"0.048\",\"0.167\",\"0.231\",\"0.319\",\"2.039\"\n";
        let r = parse_csv(csv, "t", 16).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].test.as_str(), r[0].ops_per_sec, r[0].p50_ms, r[0].p99_ms), ("SET", 55555.56, 0.087, 0.375));
        assert_eq!(r[1].pipeline, 16);
        assert!(parse_csv("\"test\",\"x\"\n", "t", 1).is_err());
        // Java: "user1".hashCode() == 111578566; "".hashCode() == 0.
        assert_eq!(java_hash(b"user1"), 111578566);
        assert_eq!(java_hash(b""), 0);
    }
}
