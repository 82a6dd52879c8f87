//! `tierkv`: scripting access to a tierkv store.
//!
//! Exit codes: 0 success; `get` 1 = key not found; `check` 3 = problems found;
//! 2 = any error (message on stderr).
//!
//! Keys and `--start`/`--end` are taken as bytes with `\xNN` escapes decoded (so a literal
//! backslash is `\x5c`); `scan` prints `key<TAB>value` lines with non-printable bytes (and
//! backslash) escaped the same way, so its output can be fed back.

use std::io::{Read, Write};
use std::ops::Bound;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cluster;
use tierkv::{Db, Error, Options, Preset};

#[derive(Parser, Debug)]
#[command(name = "tierkv", version, about = "tierkv: a key-value store for DRAM + persistent memory + SSD")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Debug)]
struct Target {
    /// Store directory.
    #[arg(long)]
    dir: PathBuf,
    /// Preset (for a new store; an existing store must match). Default: the store's own,
    /// or native for a new store.
    #[arg(long)]
    preset: Option<String>,
    /// PM pool directory (default <dir>/pm).
    #[arg(long)]
    pm_path: Option<PathBuf>,
    /// What opening does with damaged write-ahead-log records: `torn-tail` drops a torn
    /// last append and fails on any other damage; `absolute` fails on any bad record;
    /// `point-in-time` replays up to the first bad record; `skip` skips damaged records.
    /// What was dropped is printed on stderr.
    #[arg(long, default_value = "torn-tail")]
    wal_recovery: tierkv::WalRecovery,
}

#[derive(clap::Args, Debug)]
struct BenchFlags {
    /// Records, and operations per load or overwrite workload [default: 500000; --paper:
    /// 524288].
    #[arg(long)]
    num: Option<u64>,
    /// Operations per read, scan and YCSB run workload, separate from --num (scans:
    /// a tenth) [default: --num; --paper: 100000].
    #[arg(long)]
    reads: Option<u64>,
    /// Stop a workload still running after this many seconds; its throughput is over the
    /// operations it completed and the table marks it `*capped` [default: none; --paper:
    /// 120].
    #[arg(long)]
    time_cap: Option<f64>,
    /// DRAM budget in MiB per engine: each engine's workloads (and its recovery) run in a
    /// child process confined to this much memory, page cache included, by a memory
    /// cgroup (v2 memory.max or v1 memory.limit_in_bytes; root or a delegated group
    /// needed). PM pools are faulted before the child joins, outside the budget. Data goes
    /// to --dir, which must not be tmpfs [default: none; --paper: 256].
    #[arg(long)]
    dram_budget: Option<u64>,
    /// PM capacity in MiB per engine: tierkv presets and `limit` get at most this much PM,
    /// preallocated (and faulted) at open [default: grow as needed; --paper: 8192].
    #[arg(long)]
    pm_budget: Option<u64>,
    /// PM device profile: `dram` (no added latency) or `optane` (first-generation Optane
    /// DC PM's added read latency, write latency and write bandwidth limit) [default: dram;
    /// --paper: optane].
    #[arg(long)]
    pm_profile: Option<String>,
    /// The papers' regime: data 8x the DRAM budget (--num 524288 --value-size 4096
    /// --dram-budget 256), --pm-budget 8192 --pm-profile optane --reads 100000 --time-cap
    /// 120 --ycsb-fresh, every engine (HoaKV as hoakv/mem=16: its 64 MB MemTables do not
    /// fit the budget), fillrandom, readrandom, seekrandom, overwrite, ycsb-load and
    /// ycsb-a..f. Explicit flags override these.
    #[arg(long)]
    paper: bool,
    /// The YCSB workloads run on a fresh, empty store instead of the one the db_bench
    /// workloads filled, so a store never holds more than --num records [default: no;
    /// --paper: yes; `--ycsb-fresh=false` turns it off].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    ycsb_fresh: Option<bool>,
    /// Value sizes in bytes, comma separated (one full run per size) [default: 1024].
    #[arg(long, value_delimiter = ',')]
    value_size: Option<Vec<usize>>,
    /// db_bench key size in bytes.
    #[arg(long, default_value_t = 16)]
    key_size: usize,
    /// Entries per seekrandom range read.
    #[arg(long, default_value_t = 100)]
    scan_len: usize,
    /// Engines, comma separated (default: every preset and `limit`, plus leveldb and
    /// rocksdb when built with them). `slmdb/<schemes>` runs SLM-DB with only the listed
    /// compaction candidate selection schemes: `none` or a `+`-joined subset of `live`,
    /// `leaf`, `seq` (e.g. `slmdb/live+leaf`), for the paper's §6.5 ablation. `hpdk/nt`
    /// (no DRAM B+-tree) and `hpdk/ngc` (no merge) are HPDK's Fig. 7 ablations. `lightkv/<settings>`
    /// sets LightKV's §VI-F knobs: a `+`-joined list of `dram` (LightKV_DRAM), `pm` (LightKV_PM), `leaves=N`
    /// (MAX_LEAF_NODES), `cs=N` (compaction size), `seg=KiB` (segment size). `hoakv/<settings>`
    /// sets HoaKV's §4.4 parameters: a `+`-joined list of `hot=MiB` (HotStore size),
    /// `group=MiB` (GroupSize), `vs=bytes` (Value_Size), `window=N` (heat window), `mem=MiB`.
    #[arg(long)]
    engines: Option<String>,
    /// Workloads in order, comma separated: fillseq, fillrandom, overwrite, readrandom,
    /// readseq, seekrandom, ycsb-load (or load), ycsb-a..ycsb-f (or a..f), ycsb-update (or
    /// update: 100% zipfian updates), ycsb-scan (or scan: 100% zipfian scans of 1..100).
    #[arg(long)]
    workloads: Option<String>,
    /// Seed of every random stream (the same key sequence for every engine).
    #[arg(long, default_value_t = 301)]
    seed: u64,
    /// Directory for disk files (default: the system temp directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Directory for PM pools (default: /dev/shm when present).
    #[arg(long)]
    pm_dir: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Client threads (the readers of readwhilewriting, which adds one writer). A comma
    /// separated list is a thread sweep: every engine runs the workloads once per count, on
    /// a fresh store, and the table adds each count's throughput relative to the first.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    threads: Vec<usize>,
    /// Power-loss durability for everyone: peers fsync every write, tierkv msyncs PM.
    #[arg(long)]
    durable: bool,
    /// Rounds of the whole comparison (every engine on a fresh store each round, rounds
    /// run one after another); the table shows each measurement's median round, ratios
    /// between medians, and lists every round's ops/s. For machines whose speed moves
    /// between runs (shared VMs). Not with --server.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Recovery after a crash: kill the writer process once this many of its writes were
    /// acknowledged, instead of after a random number up to 1000. A large count leaves a
    /// long log tail to replay (e.g. just under `native`'s checkpoint interval) [default:
    /// random].
    #[arg(long)]
    crash_writes: Option<u64>,
    /// The papers' sweep: value sizes 100, 1024, 4096, 16384 and every workload.
    #[arg(long)]
    full: bool,
    /// Server comparison instead: `tierkv serve` (each preset in --engines, default all)
    /// against redis-server (AOF always, AOF everysec, no AOF) with redis-benchmark and YCSB
    /// A-F over RESP. Needs redis-server and redis-tools (scripts/deps.sh installs them).
    #[arg(long)]
    server: bool,
    /// --server: redis-benchmark requests per test (-n; also the key space, -r).
    #[arg(long, default_value_t = 200_000)]
    requests: u64,
    /// --server: redis-benchmark clients (-c).
    #[arg(long, default_value_t = 50)]
    clients: usize,
    /// --server: YCSB records loaded and operations per workload (0: no YCSB). --workloads
    /// picks the YCSB workloads run after the load (default a,b,c,f,d,e).
    #[arg(long, default_value_t = 50_000)]
    ycsb_num: u64,
    /// --server: the redis-server configurations to compare, comma separated: `always`,
    /// `everysec` (AOF with that appendfsync), `no` (no AOF); `none` for no redis-server.
    #[arg(long, default_value = "always,everysec,no")]
    server_redis: String,
    /// --server: every server (tierkv and Redis) requires a password, and every client
    /// (redis-benchmark, the YCSB client) authenticates with it.
    #[arg(long)]
    server_auth: bool,
    /// --server: every server listens on a TLS port only (certificates made for the run),
    /// and every client speaks TLS.
    #[arg(long)]
    server_tls: bool,
}

/// A port argument: a number, or `auto` (`None`) for a free one.
#[derive(Debug, Clone, Copy)]
struct PortArg(Option<u16>);

impl std::str::FromStr for PortArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(PortArg(None));
        }
        s.parse()
            .map(|p| PortArg(Some(p)))
            .map_err(|_| format!("a port is a number from 0 to 65535 or `auto`, not '{s}'"))
    }
}

/// `yes` or `no`, as Redis's options.
#[derive(Debug, Clone, Copy)]
struct YesNo(bool);

impl std::str::FromStr for YesNo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "yes" => Ok(YesNo(true)),
            "no" => Ok(YesNo(false)),
            _ => Err(format!("expected yes or no, not '{s}'")),
        }
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Measure engines side by side (see `tierkv bench --help`).
    Bench(BenchFlags),
    /// Set KEY to VALUE (`-` reads the value from stdin).
    Put {
        #[command(flatten)]
        t: Target,
        key: std::ffi::OsString,
        value: std::ffi::OsString,
    },
    /// Print the value of KEY raw on stdout (exit 1 if absent).
    Get {
        #[command(flatten)]
        t: Target,
        key: std::ffi::OsString,
    },
    /// Remove KEY.
    Delete {
        #[command(flatten)]
        t: Target,
        key: std::ffi::OsString,
    },
    /// Print `key<TAB>value` lines for keys in [start, end).
    Scan {
        #[command(flatten)]
        t: Target,
        /// First key (inclusive).
        #[arg(long)]
        start: Option<std::ffi::OsString>,
        /// End key (exclusive).
        #[arg(long)]
        end: Option<std::ffi::OsString>,
        /// Print at most this many entries.
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Print the store's counters as JSON.
    Stats {
        #[command(flatten)]
        t: Target,
    },
    /// Serve the store over the Redis protocol (RESP2 and RESP3) until SIGINT/SIGTERM, then
    /// close it cleanly. Prints `listening on ADDR:PORT (preset P)` on stdout once it
    /// accepts connections (then `listening on ADDR:PORT (tls)` for the TLS port). A new
    /// store gets the `native` preset unless --preset says otherwise.
    Serve {
        #[command(flatten)]
        t: Target,
        /// Address to bind.
        #[arg(long, default_value = "127.0.0.1")]
        bind: String,
        /// Plain (unencrypted) port: a number, 0 for none (as Redis), or `auto` for a free one.
        #[arg(long, default_value = "6379")]
        port: PortArg,
        /// TLS port (a number or `auto`); needs --tls-cert-file and --tls-key-file.
        #[arg(long)]
        tls_port: Option<PortArg>,
        /// PEM certificate chain for the TLS port.
        #[arg(long)]
        tls_cert_file: Option<PathBuf>,
        /// PEM private key for the TLS port.
        #[arg(long)]
        tls_key_file: Option<PathBuf>,
        /// PEM CA certificates: TLS clients must present a certificate signed by one of them.
        #[arg(long)]
        tls_ca_cert_file: Option<PathBuf>,
        /// With --tls-ca-cert-file: `yes` (client certificate required), `optional`, `no`.
        #[arg(long, default_value = "yes")]
        tls_auth_clients: tierkv_server::tls::ClientAuth,
        /// File whose first line is the password clients must AUTH with (never give the
        /// password itself on the command line: `ps` shows it). Without this option the
        /// TIERKV_REQUIREPASS environment variable is used if set.
        #[arg(long)]
        requirepass_file: Option<PathBuf>,
        /// `yes`: with no password set, refuse clients from non-loopback addresses (-DENIED).
        #[arg(long, default_value = "yes")]
        protected_mode: YesNo,
        /// Worker threads (0 = one per CPU).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Close connections idle this many seconds (0 = never).
        #[arg(long, default_value_t = 0)]
        timeout: u64,
        /// Most simultaneous clients.
        #[arg(long, default_value_t = 10_000)]
        max_clients: usize,
        /// Longest bulk string (bytes; at most 512 MiB).
        #[arg(long, default_value_t = 64 << 20)]
        max_bulk_len: usize,
        /// Most arguments in one command.
        #[arg(long, default_value_t = 1 << 20)]
        max_multibulk_len: usize,
        /// Longest inline command (bytes).
        #[arg(long, default_value_t = 64 << 10)]
        max_inline_len: usize,
        #[command(flatten)]
        raft: cluster::RaftArgs,
    },
    /// A replicated cluster's members and membership changes (see `serve --raft-id`).
    Cluster {
        #[command(subcommand)]
        cmd: cluster::ClusterCmd,
    },
    /// Verify every checksum and index/data agreement (exit 3 if problems are found).
    Check {
        #[command(flatten)]
        t: Target,
    },
    /// Salvage a damaged store: keep every record that verifies, rebuild the store from
    /// them, and keep the damaged one as `<dir>.damaged-<time>`. Prints each dropped record
    /// (`dropped key K: FILE at offset O: WHY`, or `dropped record: ...` when its key is
    /// unreadable) and a summary; exit 3 if the rebuilt store does not pass `check`.
    Repair {
        #[command(flatten)]
        t: Target,
    },
    /// kill -9 soak: a stress process (writer and reader threads, verifiable values) is
    /// SIGKILLed at random moments; after each kill the store is reopened, every key checked
    /// against the acknowledged writes, and `check` run. Exit 1 on the first failure.
    Soak {
        /// Store directory (created; must be empty). Default: a temporary directory.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Preset to soak.
        #[arg(long, default_value = "native")]
        preset: String,
        /// Kill/reopen/verify cycles.
        #[arg(long, default_value_t = 10)]
        cycles: u64,
        /// Keys in the key space.
        #[arg(long, default_value_t = 20_000)]
        keys: u64,
        /// Writer threads (as many readers run beside them).
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Shortest run before a kill (ms).
        #[arg(long, default_value_t = 100)]
        min_ms: u64,
        /// Longest run before a kill (ms).
        #[arg(long, default_value_t = 1500)]
        max_ms: u64,
        /// Seed of the kill times and the stress streams.
        #[arg(long, default_value_t = 301)]
        seed: u64,
    },
    /// (Internal to `tierkv soak`.) Stress a store until killed.
    #[command(name = "soak-stress", hide = true)]
    SoakStress {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        preset: String,
        #[arg(long)]
        keys: u64,
        #[arg(long)]
        threads: usize,
        #[arg(long)]
        seed: u64,
    },
    /// (Internal to `tierkv bench`.) Open a benchmarked store, write fresh keys reporting
    /// each acknowledged one on stdout, until killed: the parent times recovery after the
    /// crash and verifies every acknowledged key.
    #[command(name = "bench-crash-child", hide = true)]
    BenchCrashChild {
        #[arg(long)]
        engine: String,
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        pm_dir: PathBuf,
        #[arg(long)]
        num: u64,
        #[arg(long)]
        key_size: usize,
        #[arg(long)]
        value_size: usize,
        #[arg(long)]
        durable: bool,
        #[arg(long)]
        pm_budget: Option<u64>,
        #[arg(long)]
        pm_profile: Option<String>,
        #[arg(long, default_value_t = tierkv_bench::child::CHILD_MAX_WRITES)]
        max_writes: u64,
    },
    /// (Internal to `tierkv bench --dram-budget`.) Run one engine's benchmark job, read as
    /// JSON from stdin, inside a memory cgroup; report events as JSON lines on stdout.
    #[command(name = "bench-job", hide = true)]
    BenchJob,
}

enum Outcome {
    Ok,
    NotFound,
    Problems,
}

fn arg_bytes(s: &std::ffi::OsStr) -> Result<Vec<u8>, Error> {
    let raw = s.as_bytes();
    let text = std::str::from_utf8(raw)
        .map_err(|_| Error::InvalidArgument("argument is not UTF-8; use \\xNN escapes".into()))?;
    tierkv::unescape(text).ok_or_else(|| Error::InvalidArgument(format!("malformed \\xNN escape in `{text}`")))
}

fn open(t: &Target, create: bool) -> Result<Db, Error> {
    let stored = Db::stored_preset(&t.dir)?;
    let preset = match (&t.preset, stored) {
        (Some(p), _) => p.parse::<Preset>()?,
        (None, Some(p)) => p,
        (None, None) => Preset::default(),
    };
    let mut opts = Options::new().preset(preset).create_if_missing(create).wal_recovery(t.wal_recovery);
    if let Some(p) = &t.pm_path {
        opts = opts.pm_path(p);
    }
    let db = Db::open(&t.dir, opts)?;
    for d in db.recovery_report() {
        eprintln!("recovery dropped {} bytes of {} at offset {} ({:?})", d.len, d.file.display(), d.offset, d.reason);
    }
    Ok(db)
}

fn run(cli: Cli) -> Result<Outcome, Error> {
    let mut out = std::io::stdout().lock();
    match cli.cmd {
        Cmd::Bench(f) if f.server => {
            if f.repeat != 1 {
                return Err(Error::InvalidArgument("bench --server: --repeat is not supported there".into()));
            }
            if f.crash_writes.is_some() {
                return Err(Error::InvalidArgument("bench --server: --crash-writes is not supported there".into()));
            }
            let exe = std::env::current_exe()?;
            let mut targets = Vec::new();
            let names: Vec<String> = match &f.engines {
                Some(e) => e.split(',').map(|s| s.trim().to_string()).collect(),
                None => Preset::ALL.iter().map(|p| p.name().to_string()).collect(),
            };
            for n in names {
                targets.push(tierkv_bench::server::Target::Tierkv(n.parse::<Preset>()?));
            }
            for r in f.server_redis.split(',').map(str::trim) {
                targets.push(tierkv_bench::server::Target::Redis(match r {
                    "always" => Some("always"),
                    "everysec" => Some("everysec"),
                    "no" => None,
                    "none" => continue,
                    _ => {
                        return Err(Error::InvalidArgument(format!(
                            "--server-redis takes always, everysec, no or none, not '{r}'"
                        )))
                    }
                }));
            }
            let ycsb = match &f.workloads {
                None => tierkv_bench::server::YCSB.to_vec(),
                Some(w) => {
                    let ws = tierkv_bench::cli::parse_workloads(w).map_err(Error::InvalidArgument)?;
                    if let Some(bad) = ws.iter().find(|w| !w.is_ycsb_run()) {
                        return Err(Error::InvalidArgument(format!(
                            "bench --server runs YCSB workloads (a-f, update, scan; after the load), not {}",
                            bad.name()
                        )));
                    }
                    ws
                }
            };
            let shm = std::path::Path::new("/dev/shm");
            let dir = f.dir.clone().unwrap_or_else(std::env::temp_dir);
            let pm_dir = f.pm_dir.clone().unwrap_or_else(|| if shm.is_dir() { shm.to_path_buf() } else { dir.clone() });
            let a = tierkv_bench::server::ServerArgs {
                tierkv_exe: exe,
                targets,
                requests: f.requests,
                clients: f.clients,
                pipelines: vec![1, 16],
                value_size: f.value_size.as_ref().and_then(|v| v.first().copied()).unwrap_or(1024),
                ycsb_num: f.ycsb_num,
                threads: f.threads.first().copied().unwrap_or(1).max(1),
                seed: f.seed,
                dir,
                pm_dir,
                ycsb,
                security: tierkv_bench::server::Security { auth: f.server_auth, tls: f.server_tls },
            };
            let rep =
                tierkv_bench::server::run(&a).map_err(|e| Error::InvalidArgument(format!("bench --server: {e}")))?;
            if let Some(out) = &f.out {
                let json = serde_json::to_string_pretty(&rep).map_err(|e| Error::InvalidArgument(e.to_string()))?;
                std::fs::write(out, json)?;
                eprintln!("wrote {}", out.display());
            }
        }
        Cmd::Bench(f) => {
            let mut a = if f.paper { tierkv_bench::cli::BenchArgs::paper() } else { Default::default() };
            a.key_size = f.key_size;
            a.scan_len = f.scan_len;
            a.seed = f.seed;
            a.dir = f.dir;
            a.pm_dir = f.pm_dir;
            a.out = f.out;
            a.threads = f.threads.iter().map(|&t| t.max(1)).collect();
            a.durable = f.durable;
            a.repeat = f.repeat;
            if let Some(v) = f.ycsb_fresh {
                a.ycsb_fresh = v;
            }
            a.crash_exe = std::env::current_exe().ok();
            a.crash_writes = f.crash_writes;
            if f.full {
                a.value_sizes = vec![100, 1024, 4096, 16384];
                a.workloads = tierkv_bench::run::Workload::ALL.to_vec();
            }
            // Explicit flags override the presets.
            if let Some(n) = f.num {
                a.num = n;
            }
            if let Some(v) = f.value_size {
                a.value_sizes = v;
            }
            if f.reads.is_some() {
                a.reads = f.reads;
            }
            if f.time_cap.is_some() {
                a.time_cap = f.time_cap;
            }
            if f.dram_budget.is_some() {
                a.dram_budget_mib = f.dram_budget;
            }
            if f.pm_budget.is_some() {
                a.pm_budget_mib = f.pm_budget;
            }
            if let Some(p) = f.pm_profile {
                a.pm_profile = p;
            }
            if let Some(e) = f.engines {
                a.engines = tierkv_bench::cli::parse_engines(&e).map_err(Error::InvalidArgument)?;
            }
            if let Some(w) = f.workloads {
                a.workloads = tierkv_bench::cli::parse_workloads(&w).map_err(Error::InvalidArgument)?;
            }
            tierkv_bench::cli::run(&a).map_err(|e| Error::InvalidArgument(format!("bench: {e}")))?;
        }
        Cmd::Soak { dir, preset, cycles, keys, threads, min_ms, max_ms, seed } => {
            let preset: Preset = preset.parse()?;
            let scratch = dir.is_none();
            let dir = dir.unwrap_or_else(|| {
                std::env::temp_dir().join(format!("tierkv-soak-{}-{preset}-{seed}", std::process::id()))
            });
            let cleanup = |d: &std::path::Path| {
                if scratch {
                    let _ = std::fs::remove_dir_all(d);
                    let mut e = d.as_os_str().to_owned();
                    e.push(".expected");
                    let _ = std::fs::remove_file(e);
                }
            };
            let a =
                tierkv_bench::soak::SoakArgs { dir: dir.clone(), preset, cycles, keys, threads, min_ms, max_ms, seed };
            let exe = std::env::current_exe()?;
            let r = tierkv_bench::soak::soak(&exe, &a, |c, cy| {
                println!(
                    "{preset} cycle {c}: killed after {} ms, {} writes acknowledged, {} in flight landed, recovery {:.3} s, every key verified, check clean",
                    cy.ran_ms, cy.acked, cy.inflight_landed, cy.recovery_s
                );
            });
            match r {
                Ok(cycles) => {
                    cleanup(&dir);
                    let mut rec: Vec<f64> = cycles.iter().map(|c| c.recovery_s).collect();
                    rec.sort_by(|a, b| a.total_cmp(b));
                    let acked: u64 = cycles.iter().map(|c| c.acked).sum();
                    writeln!(
                        out,
                        "{preset}: {} kill -9 cycles survived, {acked} acknowledged writes verified, recovery {:.3}..{:.3} s (median {:.3} s)",
                        cycles.len(),
                        rec.first().copied().unwrap_or(0.0),
                        rec.last().copied().unwrap_or(0.0),
                        rec.get(rec.len() / 2).copied().unwrap_or(0.0)
                    )?;
                }
                Err(e) => {
                    eprintln!("tierkv soak: {preset}: FAILED: {e} (store kept in {})", dir.display());
                    return Ok(Outcome::NotFound);
                }
            }
        }
        Cmd::SoakStress { dir, preset, keys, threads, seed } => {
            let preset: Preset = preset.parse()?;
            tierkv_bench::soak::stress_main(&dir, preset, keys, threads, seed)
                .map_err(|e| Error::InvalidArgument(format!("soak stress: {e}")))?;
        }
        Cmd::BenchJob => {
            tierkv_bench::job::job_main().map_err(|e| Error::InvalidArgument(format!("bench job: {e}")))?;
        }
        Cmd::BenchCrashChild {
            engine,
            dir,
            pm_dir,
            num,
            key_size,
            value_size,
            durable,
            pm_budget,
            pm_profile,
            max_writes,
        } => {
            let spec = tierkv_bench::engine::EngineSpec {
                name: engine,
                dir,
                pm_dir,
                durable,
                pm_budget,
                pm_profile,
                dram_budget: None,
            };
            tierkv_bench::child::child_main(&spec, num, key_size, value_size, max_writes)
                .map_err(|e| Error::InvalidArgument(format!("bench child: {e}")))?;
        }
        Cmd::Put { t, key, value } => {
            let key = arg_bytes(&key)?;
            let value = if value == "-" {
                let mut v = Vec::new();
                std::io::stdin().read_to_end(&mut v)?;
                v
            } else {
                value.as_bytes().to_vec()
            };
            let db = open(&t, true)?;
            db.put(&key, &value)?;
            db.close()?;
        }
        Cmd::Get { t, key } => {
            let key = arg_bytes(&key)?;
            let db = open(&t, false)?;
            let v = db.get(&key)?;
            db.close()?;
            match v {
                Some(v) => out.write_all(&v)?,
                None => return Ok(Outcome::NotFound),
            }
        }
        Cmd::Delete { t, key } => {
            let key = arg_bytes(&key)?;
            let db = open(&t, false)?;
            db.delete(&key)?;
            db.close()?;
        }
        Cmd::Scan { t, start, end, limit } => {
            let start = start.map(|s| arg_bytes(&s)).transpose()?;
            let end = end.map(|s| arg_bytes(&s)).transpose()?;
            let db = open(&t, false)?;
            let lo = start.as_deref().map_or(Bound::Unbounded, Bound::Included);
            let hi = end.as_deref().map_or(Bound::Unbounded, Bound::Excluded);
            for item in db.scan((lo, hi))?.take(limit.unwrap_or(usize::MAX)) {
                let (k, v) = item?;
                writeln!(out, "{}\t{}", tierkv::escape(&k), tierkv::escape(&v))?;
            }
            db.close()?;
        }
        Cmd::Serve {
            mut t,
            bind,
            port,
            tls_port,
            tls_cert_file,
            tls_key_file,
            tls_ca_cert_file,
            tls_auth_clients,
            requirepass_file,
            protected_mode,
            threads,
            timeout,
            max_clients,
            max_bulk_len,
            max_multibulk_len,
            max_inline_len,
            raft,
        } => {
            if max_bulk_len > 512 << 20 {
                return Err(Error::InvalidArgument("--max-bulk-len is at most 512 MiB (536870912)".into()));
            }
            let tls = match (tls_port, tls_cert_file, tls_key_file) {
                (None, None, None) => None,
                (Some(p), Some(cert_file), Some(key_file)) => Some(tierkv_server::tls::TlsConfig {
                    port: p.0.unwrap_or(0),
                    cert_file,
                    key_file,
                    ca_cert_file: tls_ca_cert_file,
                    auth_clients: tls_auth_clients,
                }),
                _ => {
                    return Err(Error::InvalidArgument(
                        "--tls-port, --tls-cert-file and --tls-key-file go together".into(),
                    ))
                }
            };
            // `--port 0` turns the plain port off (Redis); `auto` asks for a free one.
            let port = match port.0 {
                None => Some(0),
                Some(0) => None,
                Some(p) => Some(p),
            };
            if port.is_none() && tls.is_none() {
                return Err(Error::InvalidArgument("--port 0 without --tls-port: nothing to listen on".into()));
            }
            let requirepass = match requirepass_file {
                Some(f) => Some(tierkv_server::auth::Password::from_file(&f).map_err(Error::InvalidArgument)?),
                None => match std::env::var_os(tierkv_server::auth::PASSWORD_ENV) {
                    Some(v) => Some(tierkv_server::auth::Password::new(v.as_encoded_bytes()).ok_or_else(|| {
                        Error::InvalidArgument(format!("{} is set but empty", tierkv_server::auth::PASSWORD_ENV))
                    })?),
                    None => None,
                },
            };
            if raft.raft_id.is_none() && raft.tls.any() {
                return Err(Error::InvalidArgument(
                    "--raft-tls-* secure the Raft transport and need --raft-id (the RESP port's TLS is --tls-port)"
                        .into(),
                ));
            }
            if t.preset.is_none() && Db::stored_preset(&t.dir)?.is_none() {
                t.preset = Some(Preset::Native.name().to_string());
            }
            let db = std::sync::Arc::new(open(&t, true)?);
            let cfg = tierkv_server::ServerConfig {
                bind,
                port,
                tls,
                requirepass,
                protected_mode: protected_mode.0,
                threads,
                timeout_secs: timeout,
                max_clients,
                limits: tierkv_server::resp::Limits {
                    max_bulk_len,
                    max_multibulk_len,
                    max_inline_len,
                    ..tierkv_server::resp::Limits::default()
                },
            };
            if raft.raft_id.is_some() {
                cluster::serve(db, cfg, raft, &t.dir, &mut out)?;
                return Ok(Outcome::Ok);
            }
            let preset = db.preset();
            tierkv_server::serve_until_signal(db, &cfg, |server| {
                if let Some(a) = server.plain_addr() {
                    let _ = writeln!(out, "listening on {a} (preset {preset})");
                }
                if let Some(a) = server.tls_addr() {
                    let _ = writeln!(out, "listening on {a} (tls, preset {preset})");
                }
                let _ = out.flush();
            })
            .map_err(|e| Error::InvalidArgument(format!("serve: {e}")))?;
        }
        Cmd::Cluster { cmd } => cluster::run(cmd, &mut out)?,
        Cmd::Stats { t } => {
            let db = open(&t, false)?;
            let s = db.stats();
            db.close()?;
            let json = serde_json::to_string_pretty(&s).map_err(|e| Error::InvalidArgument(e.to_string()))?;
            writeln!(out, "{json}")?;
        }
        Cmd::Repair { t } => {
            let preset = t.preset.as_deref().map(str::parse::<Preset>).transpose()?;
            let mut opts = Options::new().preset(preset.unwrap_or_default());
            if let Some(p) = &t.pm_path {
                opts = opts.pm_path(p);
            }
            let r = tierkv::repair::repair(&t.dir, &opts, preset.is_some())?;
            for l in &r.lost {
                match &l.key {
                    Some(k) => write!(out, "dropped key {}", tierkv::escape(k))?,
                    None => write!(out, "dropped record")?,
                }
                writeln!(out, ": {} at offset {}: {}", l.file.display(), l.offset, l.detail)?;
            }
            let kept: Vec<String> = r.damaged_copy.iter().map(|p| p.display().to_string()).collect();
            writeln!(
                out,
                "repaired {} ({}): {} keys kept from {} intact records, {} damaged records dropped; the damaged store is kept at {}",
                t.dir.display(),
                r.preset,
                r.keys,
                r.records,
                r.lost.len(),
                kept.join(" and ")
            )?;
            for p in &r.problems {
                writeln!(out, "problem: {p}")?;
            }
            if !r.problems.is_empty() {
                return Ok(Outcome::Problems);
            }
        }
        Cmd::Check { t } => {
            let db = match open(&t, false) {
                Ok(db) => db,
                Err(e @ Error::Corruption { .. }) => {
                    writeln!(out, "problem: {e}")?;
                    return Ok(Outcome::Problems);
                }
                Err(e) => return Err(e),
            };
            let problems = db.check()?;
            let keys = db.stats().keys;
            db.close()?;
            if problems.is_empty() {
                writeln!(out, "ok: {keys} keys, no problems")?;
            } else {
                for p in &problems {
                    writeln!(out, "problem: {p}")?;
                }
                return Ok(Outcome::Problems);
            }
        }
    }
    out.flush()?;
    Ok(Outcome::Ok)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::NotFound) => ExitCode::from(1),
        Ok(Outcome::Problems) => ExitCode::from(3),
        Err(e) => {
            eprintln!("tierkv: {e}");
            ExitCode::from(2)
        }
    }
}
