//! A 3-node cluster in one process over mutual TLS on 127.0.0.1 (certificates made for the
//! run with rcgen): election and replication; a client with the secret but without TLS is
//! refused; a node whose certificate comes from another CA can neither talk to the cluster
//! nor be replicated to, and the cluster keeps committing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tierkv::{Db, Options};
use tierkv_raft::network::{call_once, Auth, RpcReply, RpcRequest, Secret, Tls, WireError};
use tierkv_raft::node::{default_config, NodeConfig, RaftNode};
use tierkv_raft::{ClusterNode, NodeId, Op, Request};
use tokio::net::TcpListener;

fn opts() -> Options {
    Options::new().pm_pool_size(8 << 20)
}

fn secret() -> Secret {
    Secret::new(b"test cluster secret, 16+ bytes").expect("secret")
}

/// A CA made for the test.
struct TestCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        TestCa { cert: p.self_signed(&key).expect("self-signed"), key }
    }

    /// A node certificate for 127.0.0.1 signed by this CA (server and client use), with
    /// `trust`'s certificate as the CA file, written as files and loaded as the CLI does.
    fn node_tls(&self, dir: &std::path::Path, name: &str, trust: &TestCa) -> Tls {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut p = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        p.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = p.signed_by(&key, &self.cert, &self.key).expect("sign");
        let (c, k, a) =
            (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")), dir.join(format!("{name}-ca.crt")));
        std::fs::write(&c, cert.pem()).expect("write");
        std::fs::write(&k, key.serialize_pem()).expect("write");
        std::fs::write(&a, trust.cert.pem()).expect("write");
        Tls::from_files(&c, &k, &a).expect("load")
    }
}

fn put(k: String, v: String) -> Request {
    Request { ops: vec![Op::Put { key: k.into_bytes(), value: v.into_bytes() }] }
}

struct Node {
    raft: Arc<RaftNode>,
    db: Arc<Db>,
}

async fn start(
    dir: &std::path::Path,
    id: NodeId,
    listener: TcpListener,
    peers: &BTreeMap<NodeId, String>,
    tls: Tls,
) -> Node {
    let db = Arc::new(Db::open(dir.join(format!("n{id}")), opts()).expect("open"));
    let cfg = NodeConfig {
        id,
        raft_dir: dir.join(format!("n{id}/raft")),
        raft_addr: listener.local_addr().expect("addr").to_string(),
        resp_addr: String::new(),
        peers: peers.clone(),
        secret: secret(),
        tls: Some(tls),
        log_options: opts(),
        raft: default_config(),
    };
    let raft = RaftNode::start_on(cfg, db.clone(), listener).await.expect("start");
    Node { raft, db }
}

async fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(30), "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_cluster_replicates_and_refuses_plain_clients_and_foreign_certificates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new("tierkv test cluster CA");
    let mut listeners = BTreeMap::new();
    let mut peers = BTreeMap::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        peers.insert(id, l.local_addr().expect("addr").to_string());
        listeners.insert(id, l);
    }
    let mut nodes = BTreeMap::new();
    for (id, l) in listeners {
        let tls = ca.node_tls(dir.path(), &format!("node{id}"), &ca);
        nodes.insert(id, start(dir.path(), id, l, &peers, tls).await);
    }

    // Election and replication over TLS.
    let mut leader = 0;
    wait_for("a leader", || {
        leader = nodes.iter().find(|(id, n)| n.raft.status().leader == Some(**id)).map_or(0, |(id, _)| *id);
        leader != 0
    })
    .await;
    let mut last = 0;
    for i in 0..100 {
        last = nodes[&leader].raft.write(put(format!("k{i:03}"), format!("v{i}"))).await.expect("write on the leader");
    }
    wait_for("replication", || nodes.values().all(|n| n.raft.status().applied_index >= Some(last))).await;
    for n in nodes.values() {
        assert_eq!(n.db.get(b"k042").expect("get"), Some(b"v42".to_vec()));
    }
    assert_eq!(nodes[&leader].raft.read(b"k099").await, Ok(Some(b"v99".to_vec())));

    // A client with a certificate of the cluster's CA (as `tierkv cluster status` would be).
    let admin = Auth::new(secret(), Some(ca.node_tls(dir.path(), "admin", &ca)));
    let follower = *peers.keys().find(|id| **id != leader).expect("a follower");
    match call_once(&peers[&follower], &admin, &RpcRequest::Status, Duration::from_secs(2)).await {
        Ok(RpcReply::Status(s)) => {
            assert_eq!((s.id, s.leader, s.voters), (follower, Some(leader), vec![vec![1, 2, 3]]))
        }
        other => panic!("status over TLS: {other:?}"),
    }
    // The right secret without TLS: refused, saying why.
    match call_once(&peers[&follower], &secret().into(), &RpcRequest::Status, Duration::from_secs(2)).await {
        Err(WireError::Tls(m)) => assert!(m.contains("requires TLS"), "{m}"),
        other => panic!("a plain client was not refused: {other:?}"),
    }

    // Another CA's certificate (its holder has the secret and trusts the cluster's CA).
    let other = TestCa::new("another CA");
    let stranger = Auth::new(secret(), Some(other.node_tls(dir.path(), "stranger", &ca)));
    for addr in peers.values() {
        match call_once(addr, &stranger, &RpcRequest::Status, Duration::from_secs(2)).await {
            Err(WireError::Tls(_)) => {}
            other => panic!("{addr} answered a foreign certificate: {other:?}"),
        }
    }
    // A node 4 with such a certificate: its bootstrap probes are refused, and when it is
    // added as a learner the leader cannot replicate to it (it does not trust its server
    // certificate).
    let l4 = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr4 = l4.local_addr().expect("addr").to_string();
    let mut peers4 = peers.clone();
    peers4.insert(4, addr4.clone());
    let n4 = start(dir.path(), 4, l4, &peers4, other.node_tls(dir.path(), "node4", &ca)).await;
    nodes[&leader]
        .raft
        .raft()
        .add_learner(4, ClusterNode { raft_addr: addr4, resp_addr: String::new() }, false)
        .await
        .expect("learner entry committed");
    for i in 100..150 {
        last = nodes[&leader].raft.write(put(format!("k{i:03}"), format!("v{i}"))).await.expect("write on the leader");
    }
    wait_for("replication", || nodes.values().all(|n| n.raft.status().applied_index >= Some(last))).await;
    // Bounded wait for something that must not happen: a second of heartbeats and retries.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let replication = nodes[&leader].raft.raft().metrics().borrow().replication.clone().expect("leader metrics");
    assert_eq!(replication.get(&4), Some(&None), "the leader matched entries on node 4: {replication:?}");
    assert_eq!(n4.raft.status().applied_index, None);
    assert_eq!(n4.db.get(b"k001").expect("get"), None);
    // The cluster is unaffected: same leader, every voter applied everything.
    assert_eq!(nodes[&leader].raft.status().leader, Some(leader));
    assert_eq!(nodes[&leader].raft.read(b"k149").await, Ok(Some(b"v149".to_vec())));

    n4.raft.shutdown().await;
    n4.db.close().expect("close");
    for n in nodes.into_values() {
        n.raft.shutdown().await;
        n.db.close().expect("close");
    }
}
