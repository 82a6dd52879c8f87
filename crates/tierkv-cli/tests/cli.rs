//! The `tierkv` command line: its contract is its output format and exit codes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn tierkv(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tierkv"));
    c.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input).unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap()
}

fn tmp() -> tempfile::TempDir {
    let base = if Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" };
    tempfile::Builder::new().prefix("tierkv-cli").tempdir_in(base).unwrap()
}

#[test]
fn put_get_delete_scan_with_exit_codes() {
    let t = tmp();
    let d = t.path().join("db");
    let d = d.to_str().unwrap();
    assert_eq!(code(&tierkv(&["put", "--dir", d, "alpha", "one"], None)), 0);
    assert_eq!(code(&tierkv(&["put", "--dir", d, "--preset", "native", "k\\x01", "-"], Some(b"bin\x00\xffval"))), 0);
    assert_eq!(code(&tierkv(&["put", "--dir", d, "zeta", "last"], None)), 0);
    let g = tierkv(&["get", "--dir", d, "k\\x01"], None);
    assert_eq!(code(&g), 0);
    assert_eq!(g.stdout, b"bin\x00\xffval", "get prints the value raw");
    let missing = tierkv(&["get", "--dir", d, "nope"], None);
    assert_eq!(code(&missing), 1);
    assert!(missing.stdout.is_empty());
    let s = tierkv(&["scan", "--dir", d], None);
    assert_eq!(code(&s), 0);
    assert_eq!(String::from_utf8(s.stdout).unwrap(), "alpha\tone\nk\\x01\tbin\\x00\\xffval\nzeta\tlast\n");
    let s = tierkv(&["scan", "--dir", d, "--start", "b", "--end", "zeta"], None);
    assert_eq!(String::from_utf8(s.stdout).unwrap(), "k\\x01\tbin\\x00\\xffval\n", "start inclusive, end exclusive");
    let s = tierkv(&["scan", "--dir", d, "--limit", "1"], None);
    assert_eq!(String::from_utf8(s.stdout).unwrap(), "alpha\tone\n");
    assert_eq!(code(&tierkv(&["delete", "--dir", d, "alpha"], None)), 0);
    assert_eq!(code(&tierkv(&["get", "--dir", d, "alpha"], None)), 1);
    let st = tierkv(&["stats", "--dir", d], None);
    assert_eq!(code(&st), 0);
    let json: serde_json::Value = serde_json::from_slice(&st.stdout).unwrap();
    assert_eq!(json["preset"], "native", "native is the default preset");
    assert_eq!(json["keys"], 2);
    let c = tierkv(&["check", "--dir", d], None);
    assert_eq!(code(&c), 0, "{}", String::from_utf8_lossy(&c.stdout));
}

#[test]
fn errors_exit_2_with_a_message() {
    let t = tmp();
    let d = t.path().join("db");
    let d = d.to_str().unwrap();
    let o = tierkv(&["get", "--dir", d, "k"], None);
    assert_eq!(code(&o), 2, "missing store");
    assert!(String::from_utf8_lossy(&o.stderr).contains("does not exist"));
    let o = tierkv(&["put", "--dir", d, "--preset", "bogus", "k", "v"], None);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown preset"));
    let o = tierkv(&["put", "--dir", d, "bad\\q", "v"], None);
    assert_eq!(code(&o), 2, "malformed escape");
    let big = "k".repeat(70_000);
    let o = tierkv(&["put", "--dir", d, &big, "v"], None);
    assert_eq!(code(&o), 2, "over-limit key");
    assert!(String::from_utf8_lossy(&o.stderr).contains("exceeds the limit"));
}

#[test]
fn check_reports_damage_with_exit_3() {
    let t = tmp();
    let d = t.path().join("db");
    let ds = d.to_str().unwrap();
    // pmekv: its PM layout (a value checksummed on every read, the superblock at 64).
    assert_eq!(code(&tierkv(&["put", "--dir", ds, "--preset", "pmekv", "k", "UNIQUE-VALUE-BYTES"], None)), 0);
    // Damage the value in the PM pool: the store opens, but check finds the bad checksum.
    let pool = d.join("pm/pool-000000");
    let mut img = std::fs::read(&pool).unwrap();
    let at = img.windows(18).position(|w| w == b"UNIQUE-VALUE-BYTES").expect("value in the pool");
    img[at] ^= 0x20;
    std::fs::write(&pool, &img).unwrap();
    let c = tierkv(&["check", "--dir", ds], None);
    assert_eq!(code(&c), 3);
    assert!(String::from_utf8_lossy(&c.stdout).contains("value checksum mismatch"));
    let g = tierkv(&["get", "--dir", ds, "k"], None);
    assert_eq!(code(&g), 2, "a damaged value is an error, never wrong data");
    assert!(String::from_utf8_lossy(&g.stderr).contains("corruption"));
    // Damage the superblock: the store does not open; check says so with exit 3.
    img[70] ^= 0xff;
    std::fs::write(&pool, &img).unwrap();
    let c = tierkv(&["check", "--dir", ds], None);
    assert_eq!(code(&c), 3);
    assert!(String::from_utf8_lossy(&c.stdout).contains("superblock"));
}

/// `tierkv bench` measures recovery after a real crash: a child process writes to the store
/// and is killed with SIGKILL; the reopen is timed and must find the child's last write.
#[test]
fn bench_measures_recovery_after_a_killed_child() {
    let d = tmp();
    let pm = tmp();
    let o = tierkv(
        &[
            "bench",
            "--engines",
            "pmekv,slmdb",
            "--num",
            "3000",
            "--workloads",
            "fillrandom",
            "--dir",
            d.path().to_str().unwrap(),
            "--pm-dir",
            pm.path().to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    for engine in ["pmekv", "slmdb"] {
        let line = out.lines().find(|l| l.trim_start().starts_with(engine) && l.contains('|')).unwrap_or_else(|| {
            panic!("no recovery line for {engine} in:\n{out}");
        });
        assert!(!line.contains("not measured"), "{line}");
    }
}

/// `--ycsb-fresh` (and `--ycsb-fresh=false`, which turns off what `--paper` sets) reaches the
/// run: the JSON's parameters record it.
#[test]
fn bench_ycsb_fresh_flag_is_recorded() {
    for (flag, want) in [("--ycsb-fresh", true), ("--ycsb-fresh=false", false)] {
        let d = tmp();
        let out = d.path().join("r.json");
        let o = tierkv(
            &[
                "bench",
                "--engines",
                "pmekv",
                "--num",
                "500",
                "--workloads",
                "fillrandom,load,c",
                flag,
                "--dir",
                d.path().to_str().unwrap(),
                "--pm-dir",
                d.path().to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
            None,
        );
        assert_eq!(code(&o), 0, "{flag}: {}", String::from_utf8_lossy(&o.stderr));
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        assert_eq!(json["params"]["ycsb_fresh"], want, "{flag}");
    }
}

/// `bench --server --server-auth --server-tls`: the YCSB client authenticates and speaks TLS
/// to a `tierkv serve` that requires a password and has only a TLS port (without either the
/// load could not write a record). redis-benchmark and redis-server are left out
/// (`--requests 0 --server-redis none`), so this needs no Redis installed.
#[test]
fn bench_server_runs_ycsb_with_auth_and_tls() {
    let d = tmp();
    let dir = d.path().to_str().unwrap();
    let out = d.path().join("r.json");
    let o = tierkv(
        &[
            "bench",
            "--server",
            "--engines",
            "native",
            "--server-redis",
            "none",
            "--requests",
            "0",
            "--ycsb-num",
            "300",
            "--workloads",
            "c",
            "--server-auth",
            "--server-tls",
            "--dir",
            dir,
            "--pm-dir",
            dir,
            "--out",
            out.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("1 client thread(s), AUTH+TLS"));
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(json["security"], serde_json::json!({"auth": true, "tls": true}));
    let runs: Vec<(String, u64, u64)> = json["ycsb"]
        .as_array()
        .unwrap()
        .iter()
        .map(|y| {
            let o = &y["outcome"];
            (o["workload"].as_str().unwrap().to_string(), o["ops"].as_u64().unwrap(), o["found"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(runs, vec![("ycsb-load".to_string(), 300, 0), ("ycsb-c".to_string(), 300, 300)]);
    for (args, msg) in [
        (&["--server-redis", "sometimes"][..], "--server-redis takes always, everysec, no or none, not 'sometimes'"),
        (&["--workloads", "fillrandom"][..], "bench --server runs YCSB workloads"),
    ] {
        let mut a = vec!["bench", "--server", "--dir", dir];
        a.extend_from_slice(args);
        let o = tierkv(&a, None);
        assert_eq!(code(&o), 2);
        assert!(String::from_utf8_lossy(&o.stderr).contains(msg), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

/// The kill -9 soak, bounded for CI (`tierkv soak --cycles 100` runs the long one): every
/// preset survives SIGKILLs of a multi-threaded writer with every acknowledged write intact.
#[test]
fn soak_survives_kill_9_cycles_for_every_preset() {
    for p in tierkv::Preset::ALL {
        let t = tmp();
        let dir = t.path().join("store");
        let o = tierkv(
            &[
                "soak",
                "--preset",
                p.name(),
                "--dir",
                dir.to_str().unwrap(),
                "--cycles",
                "3",
                "--keys",
                "3000",
                "--min-ms",
                "50",
                "--max-ms",
                "400",
            ],
            None,
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(code(&o), 0, "{p}: {out}\n{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(out.matches("every key verified, check clean").count(), 3, "{out}");
        assert!(out.contains("3 kill -9 cycles survived"), "{out}");
    }
}

#[test]
fn serve_answers_resp_and_closes_the_store_on_sigterm() {
    use std::io::{BufRead, BufReader, Read, Write};
    for preset in ["pmekv", "slmdb", "hpdk"] {
        let d = tmp();
        let dir = d.path().join("db");
        let mut child = Command::new(env!("CARGO_BIN_EXE_tierkv"))
            .args(["serve", "--port", "auto", "--preset", preset, "--dir"])
            .arg(&dir)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(line.starts_with("listening on 127.0.0.1:"), "{line}");
        let port: u16 = line.split_whitespace().nth(2).unwrap().rsplit(':').next().unwrap().parse().unwrap();
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"SET served yes\r\nGET served\r\n").unwrap();
        let want = b"+OK\r\n$3\r\nyes\r\n";
        let mut got = vec![0u8; want.len()];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got, want);
        // SAFETY: plain system call on our child's pid.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let st = child.wait().unwrap();
        assert!(st.success(), "{preset}: serve exited with {st}");
        // Closed cleanly (the lock is released) and the write is there.
        let o = tierkv(&["get", "--dir", dir.to_str().unwrap(), "served"], None);
        assert_eq!(code(&o), 0, "{preset}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(o.stdout, b"yes");
    }
}

#[test]
fn serve_refuses_bad_listener_and_password_settings() {
    let d = tmp();
    let dir = d.path().join("db");
    let dir = dir.to_str().unwrap();
    // `--port 0` turns the plain port off (Redis): without a TLS port there is nothing to serve.
    let o = tierkv(&["serve", "--dir", dir, "--port", "0"], None);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to listen on"), "{o:?}");
    // There is no option taking the password itself (it would show in `ps`).
    let o = tierkv(&["serve", "--dir", dir, "--requirepass", "secret"], None);
    assert_ne!(code(&o), 0);
    let o = tierkv(&["serve", "--dir", dir, "--requirepass-file", d.path().join("none").to_str().unwrap()], None);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot read the password file"), "{o:?}");
    let o = tierkv(&["serve", "--dir", dir, "--tls-port", "auto"], None);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("go together"), "{o:?}");
}

fn files_under(p: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(p).unwrap() {
        let e = e.unwrap().path();
        if e.is_dir() {
            files_under(&e, out);
        } else {
            out.push(e);
        }
    }
}

/// `tierkv repair`: a byte of one stored value is damaged wherever it lies (PM pool or
/// file); repair keeps every other key, names what it dropped, keeps the damaged store
/// aside, and leaves a store that `check` calls clean. Every preset.
#[test]
fn repair_salvages_a_damaged_store_for_every_preset() {
    for p in tierkv::Preset::ALL {
        let t = tmp();
        let d = t.path().join("db");
        let ds = d.to_str().unwrap();
        let value = |i: usize| format!("REPAIR-VALUE-{i:03}-{}", "r".repeat(40));
        for i in 0..20 {
            let o = tierkv(&["put", "--dir", ds, "--preset", p.name(), &format!("key-{i:03}"), &value(i)], None);
            assert_eq!(code(&o), 0, "{p}: {}", String::from_utf8_lossy(&o.stderr));
        }
        // Damage every copy of key 7's value (it may sit in a log and a table).
        let mut files = Vec::new();
        files_under(&d, &mut files);
        let needle = value(7).into_bytes();
        let mut hits = 0;
        for f in &files {
            let mut img = std::fs::read(f).unwrap();
            let mut changed = false;
            while let Some(at) = img.windows(needle.len()).position(|w| w == needle) {
                img[at + 20] ^= 0x01;
                changed = true;
                hits += 1;
            }
            if changed {
                std::fs::write(f, &img).unwrap();
            }
        }
        assert!(hits > 0, "{p}: the value is stored somewhere");
        let r = tierkv(&["repair", "--dir", ds], None);
        let out = String::from_utf8_lossy(&r.stdout);
        assert_eq!(code(&r), 0, "{p}: {out}\n{}", String::from_utf8_lossy(&r.stderr));
        assert!(out.contains(&format!("repaired {ds} ({p})")), "{p}: {out}");
        assert!(out.contains("dropped key key-007") || out.contains("dropped record"), "{p}: {out}");
        let kept = std::fs::read_dir(t.path())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("db.damaged-"))
            .count();
        assert_eq!(kept, 1, "{p}: the damaged store is kept aside");
        let c = tierkv(&["check", "--dir", ds], None);
        assert_eq!(code(&c), 0, "{p}: {}", String::from_utf8_lossy(&c.stdout));
        // Every other key is kept, unless it shared a checksummed block with the damage
        // (an SSTable data block): then a record without a readable key was reported.
        for i in (0..20).filter(|&i| i != 7) {
            let g = tierkv(&["get", "--dir", ds, &format!("key-{i:03}")], None);
            if code(&g) == 1 && (out.contains("dropped record") || out.contains(&format!("dropped key key-{i:03}"))) {
                continue;
            }
            assert_eq!(code(&g), 0, "{p}: key {i}: {out}");
            assert_eq!(g.stdout, value(i).into_bytes(), "{p}: key {i}");
        }
        let g = tierkv(&["get", "--dir", ds, "key-007"], None);
        assert_eq!(code(&g), 1, "{p}: the damaged key is gone, not wrong: {:?}", String::from_utf8_lossy(&g.stdout));
    }
}

/// A CA, and a certificate for 127.0.0.1 it signed (server and client use), as PEM files
/// `ca.crt`, `node.crt`, `node.key` in `dir`.
fn raft_tls_files(dir: &Path) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name.push(rcgen::DnType::CommonName, "tierkv cli test CA");
    let ca = p.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    p.extended_key_usages =
        vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
    std::fs::write(dir.join("ca.crt"), ca.pem()).unwrap();
    std::fs::write(dir.join("node.crt"), cert.pem()).unwrap();
    std::fs::write(dir.join("node.key"), key.serialize_pem()).unwrap();
}

#[test]
fn cluster_status_over_raft_tls() {
    use std::io::{BufRead, BufReader};
    let d = tmp();
    raft_tls_files(d.path());
    let secret = d.path().join("secret");
    std::fs::write(&secret, "cli test cluster secret 0123456789\n").unwrap();
    let p = |f: &str| d.path().join(f).to_str().unwrap().to_string();
    let tls = [
        "--raft-tls-cert-file",
        &p("node.crt"),
        "--raft-tls-key-file",
        &p("node.key"),
        "--raft-tls-ca-file",
        &p("ca.crt"),
    ];
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let peers = format!("1={addr}");
    let dir = p("db");

    // The TLS flags go together, and belong to a Raft node.
    let o = tierkv(&["serve", "--dir", &dir, "--port", "auto", "--raft-tls-ca-file", &p("ca.crt")], None);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("need --raft-id"), "{o:?}");
    let mut partial: Vec<&str> = vec!["serve", "--dir", &dir, "--port", "auto", "--raft-id", "1", "--raft-addr", &addr];
    partial.extend(["--raft-peers", &peers, "--cluster-secret-file", secret.to_str().unwrap()]);
    partial.extend(&tls[..4]);
    let o = tierkv(&partial, None);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("go together"), "{o:?}");

    // A one-node cluster over TLS.
    let mut child = Command::new(env!("CARGO_BIN_EXE_tierkv"))
        .args([
            "serve",
            "--dir",
            &dir,
            "--port",
            "auto",
            "--raft-id",
            "1",
            "--raft-addr",
            &addr,
            "--raft-peers",
            &peers,
        ])
        .args(["--cluster-secret-file", secret.to_str().unwrap()])
        .args(tls)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("serve exited before its raft line").unwrap();
        if line.starts_with("raft node 1 on") {
            break;
        }
    }
    let status = |extra: &[&str]| {
        let mut a = vec!["cluster", "status", "--raft-addr", &addr, "--cluster-secret-file", secret.to_str().unwrap()];
        a.extend(extra);
        tierkv(&a, None)
    };
    let t = std::time::Instant::now();
    let json = loop {
        let o = status(&tls);
        assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        if v["leader"] == 1 {
            break v;
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "no leader: {v}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(json["members"][0]["raft_addr"], addr.as_str(), "{json}");
    assert_eq!(json["members"][0]["reachable"], true, "{json}");
    assert_eq!(json["members"][0]["state"], "Leader", "{json}");
    // Without the TLS flags the node refuses the command's connection, and says why.
    let o = status(&[]);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("requires TLS"), "{o:?}");

    // SAFETY: plain system call on our child's pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}
