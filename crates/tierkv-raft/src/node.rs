//! One running node: its stores, openraft, the transport's server side, cluster bootstrap,
//! and the client operations (write, linearizable read, membership changes) that the RESP
//! server and the `tierkv cluster` commands use.
//!
//! Layout under the node's directory `D` (the same directory `tierkv serve --dir D` opens as
//! its store): the main store is the state machine; `D/raft/log` is the log store (a tierkv
//! store of its own); `D/raft/snapshot` holds the current snapshot file.
//!
//! Bootstrap ("the cluster initialises once when a majority of the listed peers is up"):
//! every 300 ms an uninitialised node asks each listed peer `Hello`. If any peer already has
//! Raft state, it waits to be contacted by the leader (this is also how a node started for
//! `cluster add-node` joins). Otherwise, once a majority of the listed peers answer, the
//! answering node with the smallest id calls `initialize` with all listed peers as voters.
//! openraft accepts the same initial membership proposed by more than one node, so a race
//! (two nodes seeing different majorities) is still safe.
//!
//! Transport security ([`NodeConfig::secret`], [`NodeConfig::tls`]): the same [`Auth`] secures
//! the node's listener, its connections to peers and its bootstrap probes. A connection
//! refused for a TLS reason (mismatch, failed handshake, untrusted certificate) is logged to
//! stderr, at most once per peer address and reason every 10 s; other failed handshakes (probes, closed
//! sockets) stay quiet.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::error::{ClientWriteError, RaftError};
use openraft::{ChangeMembers, Config, ServerState, SnapshotPolicy};
use tierkv::{Db, Options};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::log_store::LogStore;
use crate::network::{
    call_once, Auth, Conn, LogThrottle, NodeStatus, Refused, RpcReply, RpcRequest, Secret, TcpNetwork, Tls, WireError,
};
use crate::state_machine::StateMachine;
use crate::{ClusterNode, NodeId, Raft, Request};

/// How to start a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// `--raft-id`.
    pub id: NodeId,
    /// `D/raft`: the log store and snapshots.
    pub raft_dir: PathBuf,
    /// Address to listen on for Raft traffic (`--raft-addr`); also what peers are told.
    pub raft_addr: String,
    /// This node's RESP address (`HOST:PORT`, the target of `-MOVED`); may be empty.
    pub resp_addr: String,
    /// Every listed peer's Raft address, this node included (`--raft-peers`).
    pub peers: BTreeMap<NodeId, String>,
    /// The shared cluster secret.
    pub secret: Secret,
    /// Mutual TLS on every Raft connection (`--raft-tls-*`), in addition to the secret.
    pub tls: Option<Tls>,
    /// Options of the log store (its PM pool, `pm_sync`).
    pub log_options: Options,
    /// openraft's settings ([`default_config`]).
    pub raft: Config,
}

/// How long a proposed write may wait for its commit ([`RaftNode::write`]).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// tierkv's openraft settings: 100 ms heartbeats, 400–800 ms election timeouts (loopback
/// and LAN clusters; a leader's death is noticed within a second), a snapshot every 100,000
/// entries (as etcd's default; a snapshot reads the whole store, so every 10,000 entries
/// made snapshots most of a write-heavy node's work: 50 SET clients over RESP got 13.8k
/// ops/s at 300,000 keys with 10,000) keeping 1,000 behind it for followers that are only a
/// little behind, 1 MiB snapshot chunks.
pub fn default_config() -> Config {
    Config {
        cluster_name: "tierkv".into(),
        heartbeat_interval: 100,
        election_timeout_min: 400,
        election_timeout_max: 800,
        install_snapshot_timeout: 5_000,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(100_000),
        max_in_snapshot_log_to_keep: 1_000,
        snapshot_max_chunk_size: 1 << 20,
        ..Config::default()
    }
}

/// Parse `--raft-peers`: `1=HOST:PORT,2=HOST:PORT,...`.
pub fn parse_peers(s: &str) -> Result<BTreeMap<NodeId, String>, String> {
    let mut peers = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part.split_once('=').ok_or_else(|| format!("--raft-peers: {part:?} is not ID=HOST:PORT"))?;
        let id: NodeId = id.trim().parse().map_err(|_| format!("--raft-peers: {id:?} is not a node id"))?;
        let addr = addr.trim();
        if addr.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok()).is_none() {
            return Err(format!("--raft-peers: {addr:?} is not HOST:PORT"));
        }
        if peers.insert(id, addr.to_string()).is_some() {
            return Err(format!("--raft-peers: node {id} listed twice"));
        }
    }
    if peers.is_empty() {
        return Err("--raft-peers: no peers".into());
    }
    Ok(peers)
}

/// A running node.
pub struct RaftNode {
    id: NodeId,
    raft: Raft,
    sm: StateMachine,
    log_db: Arc<Db>,
    auth: Auth,
    addr: SocketAddr,
    resp_addr: Mutex<String>,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Leaders' RESP addresses learnt by asking them (`Hello` has none; `Status` has).
    leader_resp: Mutex<BTreeMap<NodeId, String>>,
    /// Rate limit of the log lines about refused connections and failed bootstrap probes.
    log: LogThrottle,
}

impl std::fmt::Debug for RaftNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftNode").field("id", &self.id).field("raft_addr", &self.addr).finish()
    }
}

fn refused_from(e: RaftError<NodeId, ClientWriteError<NodeId, ClusterNode>>) -> Refused {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            Refused::NotLeader(f.leader_id.map(|id| (id, f.leader_node.unwrap_or_default())))
        }
        other => Refused::Failed(other.to_string()),
    }
}

impl RaftNode {
    /// Open the log store and the state machine on `db`, start openraft, listen on
    /// `cfg.raft_addr`, and start bootstrapping.
    pub async fn start(cfg: NodeConfig, db: Arc<Db>) -> Result<Arc<RaftNode>, String> {
        let listener =
            TcpListener::bind(&cfg.raft_addr).await.map_err(|e| format!("cannot listen on {}: {e}", cfg.raft_addr))?;
        RaftNode::start_on(cfg, db, listener).await
    }

    /// [`RaftNode::start`] on a listener the caller bound (tests bind port 0 first, so the
    /// peers' addresses are known before any node starts).
    pub async fn start_on(cfg: NodeConfig, db: Arc<Db>, listener: TcpListener) -> Result<Arc<RaftNode>, String> {
        let log = LogStore::open(cfg.raft_dir.join("log"), cfg.log_options.clone())
            .map_err(|e| format!("cannot open the raft log in {}: {e}", cfg.raft_dir.display()))?;
        let log_db = log.db().clone();
        let sm = StateMachine::open(db, cfg.raft_dir.join("snapshot")).map_err(|e| e.to_string())?;
        let config = Arc::new(cfg.raft.clone().validate().map_err(|e| e.to_string())?);
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let auth = Auth::new(cfg.secret.clone(), cfg.tls.clone());
        let raft = Raft::new(cfg.id, config, TcpNetwork::new(auth.clone()), log, sm.clone())
            .await
            .map_err(|e| format!("cannot start raft: {e}"))?;
        let (stop, stop_rx) = watch::channel(false);
        let node = Arc::new(RaftNode {
            id: cfg.id,
            raft,
            sm,
            log_db,
            auth,
            addr,
            resp_addr: Mutex::new(cfg.resp_addr.clone()),
            stop,
            tasks: Mutex::new(Vec::new()),
            leader_resp: Mutex::new(BTreeMap::new()),
            log: LogThrottle::default(),
        });
        let serve = tokio::spawn(serve(node.clone(), listener, stop_rx.clone()));
        let boot = tokio::spawn(bootstrap(node.clone(), cfg, stop_rx));
        if let Ok(mut t) = node.tasks.lock() {
            t.push(serve);
            t.push(boot);
        }
        Ok(node)
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The bound Raft address.
    pub fn raft_addr(&self) -> SocketAddr {
        self.addr
    }

    /// This node's RESP address (`HOST:PORT`; empty if none).
    pub fn resp_addr(&self) -> String {
        self.resp_addr.lock().map(|a| a.clone()).unwrap_or_default()
    }

    /// Set the RESP address once the server has bound its port (`--port auto`).
    pub fn set_resp_addr(&self, addr: String) {
        if let Ok(mut a) = self.resp_addr.lock() {
            *a = addr;
        }
    }

    /// openraft's handle.
    pub fn raft(&self) -> &Raft {
        &self.raft
    }

    /// The state machine's store.
    pub fn db(&self) -> &Arc<Db> {
        self.sm.db()
    }

    /// Stop: the transport, bootstrap and openraft; then close the log store. The state
    /// machine's store belongs to the caller.
    pub async fn shutdown(&self) {
        let _ = self.stop.send(true);
        let tasks = self.tasks.lock().map(|mut t| std::mem::take(&mut *t)).unwrap_or_default();
        for t in tasks {
            t.abort();
            let _ = t.await;
        }
        let _ = self.raft.shutdown().await;
        let _ = self.log_db.close();
    }

    /// Propose `req`; returns the index of its entry once it is committed and applied here.
    /// Gives up after [`WRITE_TIMEOUT`]: openraft 0.9 keeps a leader that lost its quorum
    /// leading (no check-quorum step-down), so without a bound a partitioned leader's
    /// writers would wait until the partition heals, each holding a server thread. The
    /// entry may still commit after that: the refusal says so.
    pub async fn write(&self, req: Request) -> Result<u64, Refused> {
        match tokio::time::timeout(WRITE_TIMEOUT, self.raft.client_write(req)).await {
            Err(_) => Err(Refused::Failed(format!(
                "not committed within {} s (no quorum?); it may still commit",
                WRITE_TIMEOUT.as_secs()
            ))),
            Ok(Ok(r)) => Ok(r.log_id.index),
            Ok(Err(e)) => Err(refused_from(e)),
        }
    }

    /// Read-index: confirm leadership with a quorum and wait until this node has applied
    /// everything committed before the call; a read of the store after it is linearizable.
    pub async fn linearizable_barrier(&self) -> Result<(), Refused> {
        match tokio::time::timeout(Duration::from_secs(5), self.raft.ensure_linearizable()).await {
            Err(_) => Err(Refused::Failed("no quorum confirmed leadership in 5 s".into())),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(RaftError::APIError(openraft::error::CheckIsLeaderError::ForwardToLeader(f)))) => {
                Err(Refused::NotLeader(f.leader_id.map(|id| (id, f.leader_node.unwrap_or_default()))))
            }
            Ok(Err(e)) => Err(Refused::Failed(e.to_string())),
        }
    }

    /// Linearizable read of `key`.
    pub async fn read(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Refused> {
        self.linearizable_barrier().await?;
        self.db().get(key).map_err(|e| Refused::Failed(e.to_string()))
    }

    /// The leader this node knows of, with its addresses (its RESP address asked from the
    /// leader itself when the membership record has none).
    pub async fn leader(&self) -> Option<(NodeId, ClusterNode)> {
        let m = self.raft.metrics().borrow().clone();
        let id = m.current_leader?;
        let mut node = m.membership_config.membership().get_node(&id).cloned().unwrap_or_default();
        if node.resp_addr.is_empty() {
            let cached = self.leader_resp.lock().ok().and_then(|c| c.get(&id).cloned());
            if id == self.id {
                node.resp_addr = self.resp_addr();
            } else if let Some(a) = cached {
                node.resp_addr = a;
            } else if let Ok(RpcReply::Status(s)) =
                call_once(&node.raft_addr, &self.auth, &RpcRequest::Status, Duration::from_secs(1)).await
            {
                if let Some((_, n)) = s.nodes.iter().find(|(i, _)| *i == id) {
                    node.resp_addr = n.resp_addr.clone();
                    if let (false, Ok(mut c)) = (n.resp_addr.is_empty(), self.leader_resp.lock()) {
                        c.insert(id, n.resp_addr.clone());
                    }
                }
            }
        }
        Some((id, node))
    }

    /// The current term when this node leads it (as far as it knows), without copying the
    /// metrics.
    pub fn leader_term(&self) -> Option<u64> {
        let m = self.raft.metrics();
        let m = m.borrow();
        (m.state == ServerState::Leader).then_some(m.current_term)
    }

    /// This node's view.
    pub fn status(&self) -> NodeStatus {
        let m = self.raft.metrics().borrow().clone();
        let state = match m.state {
            ServerState::Leader => "Leader",
            ServerState::Follower => "Follower",
            ServerState::Candidate => "Candidate",
            ServerState::Learner => "Learner",
            ServerState::Shutdown => "Shutdown",
        };
        let membership = m.membership_config.membership();
        let mut nodes: Vec<(NodeId, ClusterNode)> = membership.nodes().map(|(i, n)| (*i, n.clone())).collect();
        for (i, n) in nodes.iter_mut() {
            if *i == self.id && n.resp_addr.is_empty() {
                n.resp_addr = self.resp_addr();
            }
        }
        NodeStatus {
            id: self.id,
            state: state.into(),
            term: m.current_term,
            leader: m.current_leader,
            last_log_index: m.last_log_index,
            applied_index: m.last_applied.map(|l| l.index),
            voters: membership.get_joint_config().iter().map(|c| c.iter().copied().collect()).collect(),
            nodes,
        }
    }

    /// Add `id` as a learner (returns once it has caught up), then make it a voter.
    pub async fn add_node(&self, id: NodeId, node: ClusterNode) -> Result<u64, Refused> {
        self.raft.add_learner(id, node, true).await.map_err(refused_from)?;
        let r = self
            .raft
            .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), false)
            .await
            .map_err(refused_from)?;
        Ok(r.log_id.index)
    }

    /// Remove voter `id` (and forget it).
    pub async fn remove_node(&self, id: NodeId) -> Result<u64, Refused> {
        let r = self
            .raft
            .change_membership(ChangeMembers::RemoveVoters(BTreeSet::from([id])), false)
            .await
            .map_err(refused_from)?;
        Ok(r.log_id.index)
    }

    async fn handle(&self, req: RpcRequest) -> RpcReply {
        match req {
            RpcRequest::AppendEntries(r) => RpcReply::AppendEntries(self.raft.append_entries(r).await),
            RpcRequest::InstallSnapshot(r) => RpcReply::InstallSnapshot(self.raft.install_snapshot(r).await),
            RpcRequest::Vote(r) => RpcReply::Vote(self.raft.vote(r).await),
            RpcRequest::Hello => match self.raft.is_initialized().await {
                Ok(initialized) => RpcReply::Hello { id: self.id, initialized },
                Err(e) => RpcReply::Error(e.to_string()),
            },
            RpcRequest::Status => RpcReply::Status(self.status()),
            RpcRequest::Write(r) => RpcReply::Committed(self.write(r).await),
            RpcRequest::Read(k) => RpcReply::Value(self.read(&k).await),
            RpcRequest::AddNode { id, node } => RpcReply::Committed(self.add_node(id, node).await),
            RpcRequest::RemoveNode { id } => RpcReply::Committed(self.remove_node(id).await),
        }
    }
}

async fn serve(node: Arc<RaftNode>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let node = node.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let mut conn = match Conn::accept(stream, &node.auth).await {
                Ok(c) => c,
                Err(e) => {
                    // A TLS mismatch or a failed handshake is a misconfiguration worth a line;
                    // other failures (a probe, a closed socket) stay quiet as before.
                    if matches!(e, WireError::Tls(_)) && node.log.allow(&format!("{} {e}", peer.ip())) {
                        eprintln!("tierkv raft: node {}: refused a connection from {peer}: {e}", node.id);
                    }
                    return;
                }
            };
            loop {
                let req = tokio::select! {
                    r = conn.recv::<RpcRequest>() => r,
                    _ = stop.changed() => return,
                };
                let Ok(Some(req)) = req else { return };
                let reply = node.handle(req).await;
                if conn.send(&reply).await.is_err() {
                    return;
                }
            }
        });
    }
}

async fn bootstrap(node: Arc<RaftNode>, cfg: NodeConfig, mut stop: watch::Receiver<bool>) {
    loop {
        match node.raft.is_initialized().await {
            Ok(false) => {}
            _ => return,
        }
        let mut up = BTreeSet::from([node.id]);
        let mut someone_initialized = false;
        for (&id, addr) in cfg.peers.iter().filter(|(id, _)| **id != node.id) {
            match call_once(addr, &node.auth, &RpcRequest::Hello, Duration::from_millis(500)).await {
                Ok(RpcReply::Hello { id: got, initialized }) if got == id => {
                    up.insert(id);
                    someone_initialized |= initialized;
                }
                Err(e @ WireError::Tls(_)) if node.log.allow(addr) => {
                    eprintln!("tierkv raft: node {}: cannot reach peer {id} at {addr}: {e}", node.id);
                }
                _ => {}
            }
        }
        if someone_initialized {
            return;
        }
        if up.len() * 2 > cfg.peers.len() && up.first() == Some(&node.id) && cfg.peers.contains_key(&node.id) {
            let members: BTreeMap<NodeId, ClusterNode> = cfg
                .peers
                .iter()
                .map(|(&id, addr)| {
                    let resp_addr = if id == node.id { node.resp_addr() } else { String::new() };
                    (id, ClusterNode { raft_addr: addr.clone(), resp_addr })
                })
                .collect();
            // An error here means another node initialised first: fine.
            let _ = node.raft.initialize(members).await;
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            _ = stop.changed() => return,
        }
    }
}
