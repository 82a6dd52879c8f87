//! A 3-node cluster in one process over real TCP on 127.0.0.1 (authenticated transport):
//! election, replication, refusals on followers, linearizable reads, a leader stopped and
//! restarted from its directories, and a new node that catches up by snapshot.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tierkv::{Db, Options};
use tierkv_raft::network::{call_once, Refused, RpcReply, RpcRequest, Secret};
use tierkv_raft::node::{default_config, NodeConfig, RaftNode};
use tierkv_raft::{ClusterNode, NodeId, Op, Request};
use tokio::net::TcpListener;

fn opts() -> Options {
    Options::new().pm_pool_size(8 << 20)
}

fn secret() -> Secret {
    Secret::new(b"test cluster secret, 16+ bytes").expect("secret")
}

struct Cluster {
    dir: tempfile::TempDir,
    peers: BTreeMap<NodeId, String>,
    nodes: BTreeMap<NodeId, (Arc<RaftNode>, Arc<Db>)>,
}

impl Cluster {
    fn cfg(&self, id: NodeId) -> NodeConfig {
        NodeConfig {
            id,
            raft_dir: self.dir.path().join(format!("n{id}/raft")),
            raft_addr: self.peers[&id].clone(),
            resp_addr: format!("127.0.0.1:{}", 7000 + id),
            peers: self.peers.clone(),
            secret: secret(),
            tls: None,
            log_options: opts(),
            raft: default_config(),
        }
    }

    async fn start(&mut self, id: NodeId, listener: Option<TcpListener>) {
        let db = Arc::new(Db::open(self.dir.path().join(format!("n{id}")), opts()).expect("open"));
        let cfg = self.cfg(id);
        let listener = match listener {
            Some(l) => l,
            None => TcpListener::bind(&cfg.raft_addr).await.expect("rebind"),
        };
        let node = RaftNode::start_on(cfg, db.clone(), listener).await.expect("start");
        self.nodes.insert(id, (node, db));
    }

    async fn stop(&mut self, id: NodeId) {
        let (node, db) = self.nodes.remove(&id).expect("running");
        node.shutdown().await;
        drop(node);
        db.close().expect("close");
    }

    async fn leader(&self) -> NodeId {
        let t = Instant::now();
        loop {
            for (id, (n, _)) in &self.nodes {
                let s = n.status();
                if s.state == "Leader" && s.leader == Some(*id) {
                    return *id;
                }
            }
            assert!(t.elapsed() < Duration::from_secs(30), "no leader elected");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until every running node has applied at least `index`.
    async fn converge(&self, index: u64) {
        let t = Instant::now();
        while !self.nodes.values().all(|(n, _)| n.status().applied_index >= Some(index)) {
            assert!(t.elapsed() < Duration::from_secs(30), "nodes did not catch up to {index}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn three_nodes() -> (Cluster, BTreeMap<NodeId, TcpListener>) {
    let mut listeners = BTreeMap::new();
    let mut peers = BTreeMap::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        peers.insert(id, l.local_addr().expect("addr").to_string());
        listeners.insert(id, l);
    }
    let c = Cluster { dir: tempfile::tempdir().expect("tempdir"), peers, nodes: BTreeMap::new() };
    (c, listeners)
}

fn put(k: String, v: String) -> Request {
    Request { ops: vec![Op::Put { key: k.into_bytes(), value: v.into_bytes() }] }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_replicate_survive_a_leader_restart_and_snapshot_a_new_node() {
    let (mut c, mut listeners) = three_nodes().await;
    for id in 1..=3u64 {
        let l = listeners.remove(&id);
        c.start(id, l).await;
    }
    let leader = c.leader().await;
    let mut acked = BTreeMap::new();
    let mut last = 0;
    for i in 0..200 {
        let (k, v) = (format!("k{i:04}"), format!("v{i}"));
        last = c.nodes[&leader].0.write(put(k.clone(), v.clone())).await.expect("write on the leader");
        acked.insert(k, v);
    }
    // A follower refuses writes and reads, naming the leader.
    let follower = *c.nodes.keys().find(|id| **id != leader).expect("a follower");
    match c.nodes[&follower].0.write(put("x".into(), "y".into())).await {
        Err(Refused::NotLeader(Some((id, n)))) => {
            assert_eq!(id, leader);
            assert_eq!(n.raft_addr, c.peers[&leader]);
        }
        other => panic!("follower accepted or refused oddly: {other:?}"),
    }
    assert!(matches!(c.nodes[&follower].0.read(b"k0001").await, Err(Refused::NotLeader(Some(_)))));
    assert_eq!(c.nodes[&leader].0.read(b"k0001").await, Ok(Some(b"v1".to_vec())));
    // The leader's RESP address is learnt (it is not in the initial membership).
    let (lid, lnode) = c.nodes[&follower].0.leader().await.expect("leader known");
    assert_eq!((lid, lnode.resp_addr), (leader, format!("127.0.0.1:{}", 7000 + leader)));
    // Over the wire: status, and the same refusal.
    match call_once(&c.peers[&follower], &secret().into(), &RpcRequest::Status, Duration::from_secs(2)).await {
        Ok(RpcReply::Status(s)) => {
            assert_eq!((s.id, s.leader), (follower, Some(leader)));
            assert_eq!(s.voters, vec![vec![1, 2, 3]]);
        }
        other => panic!("status: {other:?}"),
    }
    let wrong = Secret::new(b"not the cluster secret at all").expect("secret");
    assert!(call_once(&c.peers[&follower], &wrong.into(), &RpcRequest::Status, Duration::from_secs(2)).await.is_err());

    // Stop the leader; the others elect a new one and keep accepting writes.
    c.converge(last).await;
    c.stop(leader).await;
    let leader2 = c.leader().await;
    assert_ne!(leader2, leader);
    for i in 200..300 {
        let (k, v) = (format!("k{i:04}"), format!("v{i}"));
        last = c.nodes[&leader2].0.write(put(k.clone(), v.clone())).await.expect("write on the new leader");
        acked.insert(k, v);
    }
    // The old leader restarts from its directories and catches up.
    c.start(leader, None).await;
    c.converge(last).await;
    for (_, db) in c.nodes.values() {
        for (k, v) in &acked {
            assert_eq!(db.get(k).expect("get").as_deref(), Some(v.as_bytes()), "{k} missing");
        }
    }

    // Compact the log behind a snapshot, then add node 4: it can only catch up by snapshot.
    let r = c.nodes[&leader2].0.raft().clone();
    r.trigger().snapshot().await.expect("snapshot");
    let t = Instant::now();
    while r.metrics().borrow().snapshot.map(|s| s.index) < Some(last) {
        assert!(t.elapsed() < Duration::from_secs(30), "snapshot not built");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    r.trigger().purge_log(last).await.expect("purge");
    let t = Instant::now();
    while r.metrics().borrow().purged.map(|p| p.index) < Some(last) {
        assert!(t.elapsed() < Duration::from_secs(30), "log not purged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let l4 = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    c.peers.insert(4, l4.local_addr().expect("addr").to_string());
    c.start(4, Some(l4)).await;
    let node4 = ClusterNode { raft_addr: c.peers[&4].clone(), resp_addr: "127.0.0.1:7004".into() };
    match call_once(
        &c.peers[&leader2],
        &secret().into(),
        &RpcRequest::AddNode { id: 4, node: node4 },
        Duration::from_secs(30),
    )
    .await
    {
        Ok(RpcReply::Committed(Ok(i))) => last = i,
        other => panic!("add-node: {other:?}"),
    }
    c.converge(last).await;
    let s4 = c.nodes[&4].0.status();
    assert_eq!(s4.voters, vec![vec![1, 2, 3, 4]]);
    assert!(c.nodes[&4].0.raft().metrics().borrow().snapshot.is_some(), "node 4 did not install a snapshot");
    for (k, v) in &acked {
        assert_eq!(c.nodes[&4].1.get(k).expect("get").as_deref(), Some(v.as_bytes()), "{k} missing on node 4");
    }
    // Remove it again (joint consensus back to three voters).
    match call_once(&c.peers[&leader2], &secret().into(), &RpcRequest::RemoveNode { id: 4 }, Duration::from_secs(30))
        .await
    {
        Ok(RpcReply::Committed(Ok(_))) => {}
        other => panic!("remove-node: {other:?}"),
    }
    let s = c.nodes[&leader2].0.status();
    assert_eq!(s.voters, vec![vec![1, 2, 3]]);
    for id in c.nodes.keys().copied().collect::<Vec<_>>() {
        c.stop(id).await;
    }
}
