//! Measurements for the issue's closing note (ignored by default; they print figures and
//! assert nothing about time):
//!
//! ```text
//! cargo test --release -p tierkv-raft --test measure -- --ignored --nocapture --test-threads 1
//! ```
//!
//! - `election`: a 3-node TCP cluster on 127.0.0.1; the leader is stopped (its transport
//!   closes, as when its process dies) and the time until another node reports itself leader
//!   is taken, several rounds (the stopped node restarts between rounds).
//! - `throughput`: 50 concurrent writers, one key per write (a SET), through Raft on the
//!   leader vs `Db::write` on an unreplicated store on the same machine; ops/s and p99.
//!   Library level: no RESP parsing on either side.
//! - `snapshot_catch_up`: the leader holds 1M keys and has purged its log; a new node joins
//!   and catches up by snapshot: time from `add-node` until it has applied the leader's log.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tierkv::{Db, Options, WriteBatch};
use tierkv_raft::network::Secret;
use tierkv_raft::node::{default_config, NodeConfig, RaftNode};
use tierkv_raft::{ClusterNode, NodeId, Op, Request};
use tokio::net::TcpListener;

fn opts() -> Options {
    Options::new()
}

struct Cluster {
    dir: tempfile::TempDir,
    peers: BTreeMap<NodeId, String>,
    nodes: BTreeMap<NodeId, (Arc<RaftNode>, Arc<Db>)>,
}

impl Cluster {
    async fn new(n: u64) -> Cluster {
        let mut c = Cluster { dir: tempfile::tempdir().unwrap(), peers: BTreeMap::new(), nodes: BTreeMap::new() };
        let mut ls = BTreeMap::new();
        for id in 1..=n {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            c.peers.insert(id, l.local_addr().unwrap().to_string());
            ls.insert(id, l);
        }
        for (id, l) in ls {
            c.start(id, Some(l)).await;
        }
        c
    }

    async fn start(&mut self, id: NodeId, l: Option<TcpListener>) {
        let db = Arc::new(Db::open(self.dir.path().join(format!("n{id}")), opts()).unwrap());
        let cfg = NodeConfig {
            id,
            raft_dir: self.dir.path().join(format!("n{id}/raft")),
            raft_addr: self.peers[&id].clone(),
            resp_addr: String::new(),
            peers: self.peers.clone(),
            secret: Secret::new(b"measurement secret 0123456789").unwrap(),
            tls: None,
            log_options: opts(),
            raft: default_config(),
        };
        let l = match l {
            Some(l) => l,
            None => TcpListener::bind(&cfg.raft_addr).await.unwrap(),
        };
        let node = RaftNode::start_on(cfg, db.clone(), l).await.unwrap();
        self.nodes.insert(id, (node, db));
    }

    async fn stop(&mut self, id: NodeId) {
        let (n, db) = self.nodes.remove(&id).unwrap();
        n.shutdown().await;
        drop(n);
        db.close().unwrap();
    }

    async fn leader(&self) -> NodeId {
        loop {
            for (id, (n, _)) in &self.nodes {
                let s = n.status();
                if s.state == "Leader" && s.leader == Some(*id) {
                    return *id;
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn election() {
    let mut c = Cluster::new(3).await;
    let mut times = Vec::new();
    for _ in 0..5 {
        let l = c.leader().await;
        c.nodes[&l].0.write(Request::default()).await.unwrap();
        let t = Instant::now();
        c.stop(l).await;
        let l2 = c.leader().await;
        times.push(t.elapsed());
        assert_ne!(l, l2);
        c.start(l, None).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ms: Vec<u128> = times.iter().map(|d| d.as_millis()).collect();
    println!("election after leader stop (ms, 5 rounds; election timeout 400-800 ms): {ms:?}");
}

/// Clients of the throughput measurement.
const CLIENTS: usize = 50;

/// Wait for the clients' latencies and print throughput since `t` and p99.
async fn report(label: &str, t: Instant, tasks: Vec<tokio::task::JoinHandle<Vec<Duration>>>) {
    let mut lat = Vec::new();
    for task in tasks {
        lat.extend(task.await.unwrap());
    }
    let el = t.elapsed();
    let n = lat.len();
    println!(
        "{label}: {n} SETs by {CLIENTS} clients in {:.2} s: {:.0} ops/s, p99 {:.3} ms",
        el.as_secs_f64(),
        n as f64 / el.as_secs_f64(),
        p99(lat).as_secs_f64() * 1e3
    );
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn throughput() {
    const PER: usize = 400;
    let c = Cluster::new(3).await;
    let l = c.leader().await;
    let node = c.nodes[&l].0.clone();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let node = node.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(PER);
            for j in 0..PER {
                let op = Op::Put { key: format!("c{i}-k{j}").into_bytes(), value: vec![b'x'; 100] };
                let s = Instant::now();
                node.write(Request { ops: vec![op] }).await.unwrap();
                lat.push(s.elapsed());
            }
            lat
        }));
    }
    report("replicated (3 nodes, leader writes)", t, tasks).await;

    let d = tempfile::tempdir().unwrap();
    let db = Arc::new(Db::open(d.path().join("single"), opts()).unwrap());
    let t = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let db = db.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(PER);
            for j in 0..PER {
                let mut b = WriteBatch::new();
                b.put(format!("c{i}-k{j}"), vec![b'x'; 100]);
                let s = Instant::now();
                db.write(b).unwrap();
                lat.push(s.elapsed());
                tokio::task::yield_now().await;
            }
            lat
        }));
    }
    report("unreplicated (one store, Db::write)", t, tasks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn snapshot_catch_up() {
    const KEYS: usize = 1_000_000;
    let mut c = Cluster::new(3).await;
    let l = c.leader().await;
    let node = c.nodes[&l].0.clone();
    let t = Instant::now();
    let mut last = 0;
    for chunk in 0..KEYS / 1000 {
        let ops = (0..1000)
            .map(|i| Op::Put { key: format!("key{:08}", chunk * 1000 + i).into_bytes(), value: vec![b'v'; 32] })
            .collect();
        last = node.write(Request { ops }).await.unwrap();
    }
    println!("loaded {KEYS} keys (1,000 per entry) in {:.1} s", t.elapsed().as_secs_f64());
    let r = node.raft().clone();
    let t = Instant::now();
    r.trigger().snapshot().await.unwrap();
    while r.metrics().borrow().snapshot.map(|s| s.index) < Some(last) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("leader built its snapshot in {:.2} s", t.elapsed().as_secs_f64());
    r.trigger().purge_log(last).await.unwrap();
    while r.metrics().borrow().purged.map(|p| p.index) < Some(last) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let size: u64 = std::fs::read_dir(c.dir.path().join(format!("n{l}/raft/snapshot")))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    let l4 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    c.peers.insert(4, l4.local_addr().unwrap().to_string());
    c.start(4, Some(l4)).await;
    let t = Instant::now();
    let n4 = ClusterNode { raft_addr: c.peers[&4].clone(), resp_addr: String::new() };
    node.add_node(4, n4).await.unwrap();
    let four = c.nodes[&4].0.clone();
    while four.status().applied_index < Some(last) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let el = t.elapsed();
    let db4 = c.nodes[&4].1.clone();
    assert_eq!(db4.get("key00999999").unwrap().as_deref(), Some(&[b'v'; 32][..]));
    println!(
        "new node 1M keys behind caught up by snapshot ({:.1} MB) in {:.2} s (add-node to applied)",
        size as f64 / 1e6,
        el.as_secs_f64()
    );
    for id in c.nodes.keys().copied().collect::<Vec<_>>() {
        c.stop(id).await;
    }
}
