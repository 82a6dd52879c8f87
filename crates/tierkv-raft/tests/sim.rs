//! Simulation: a 3-node cluster on the real tierkv storage, connected by an in-process network
//! that a seeded RNG makes lose requests and replies, delay (and so reorder) messages, and
//! partition nodes, while nodes are killed (their stores dropped without a clean close, as by
//! `kill -9`) and restarted from their directories. Clients write unique keys throughout.
//! At the end the network heals, every node restarts, and the test checks that every
//! acknowledged write is on every node, that every node holds the same data, and that nothing
//! appeared that no client wrote.
//!
//! Time is tokio's paused clock (`start_paused`): timers fire in virtual time, so a run of
//! many simulated seconds takes a few real ones. The schedule of faults comes from the seed;
//! thread scheduling of snapshot builds (blocking threads) is the one source of
//! nondeterminism left. `TIERKV_SIM_SEEDS=N` runs N seeds (default 4), `TIERKV_SIM_STEPS`
//! the steps per seed (default 150).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{Config, RaftNetwork, RaftNetworkFactory, SnapshotPolicy};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tierkv::{Db, Options};
use tierkv_raft::log_store::LogStore;
use tierkv_raft::state_machine::{StateMachine, META_PREFIX};
use tierkv_raft::{ClusterNode, NodeId, Op, Raft, Request, TypeConfig};

#[derive(Debug)]
struct Fault(&'static str);
impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}
impl std::error::Error for Fault {}

/// The simulated network: which nodes run, who is cut off, and the fault RNG.
struct Net {
    nodes: BTreeMap<NodeId, Raft>,
    /// Nodes cut off from every other node.
    isolated: BTreeSet<NodeId>,
    rng: SmallRng,
    loss: f64,
    max_delay_ms: u64,
}

type Shared = Arc<Mutex<Net>>;

#[derive(Clone)]
struct SimNetwork {
    from: NodeId,
    net: Shared,
}

struct SimClient {
    from: NodeId,
    to: NodeId,
    net: Shared,
}

impl RaftNetworkFactory<TypeConfig> for SimNetwork {
    type Network = SimClient;
    async fn new_client(&mut self, target: NodeId, _node: &ClusterNode) -> SimClient {
        SimClient { from: self.from, to: target, net: self.net.clone() }
    }
}

type RpcErr<E> = RPCError<NodeId, ClusterNode, E>;

enum Fate {
    Deliver(Raft, u64),
    Lost,
}

impl SimClient {
    fn fate(&self) -> Fate {
        let mut n = self.net.lock().unwrap();
        let (max, loss) = (n.max_delay_ms, n.loss);
        let delay = n.rng.random_range(0..=max);
        let lost = n.rng.random_bool(loss);
        if lost || n.isolated.contains(&self.from) || n.isolated.contains(&self.to) {
            return Fate::Lost;
        }
        match n.nodes.get(&self.to) {
            Some(r) => Fate::Deliver(r.clone(), delay),
            None => Fate::Lost,
        }
    }

    /// Whether the reply is lost on the way back (after the target acted on the request).
    fn reply_lost(&self) -> (bool, u64) {
        let mut n = self.net.lock().unwrap();
        let (max, loss) = (n.max_delay_ms, n.loss);
        let delay = n.rng.random_range(0..=max);
        let cut = n.isolated.contains(&self.from) || n.isolated.contains(&self.to) || !n.nodes.contains_key(&self.from);
        (cut || n.rng.random_bool(loss), delay)
    }

    async fn go<T, E: std::error::Error>(&self, call: impl AsyncFnOnce(Raft) -> Result<T, E>) -> Result<T, RpcErr<E>> {
        let Fate::Deliver(raft, delay) = self.fate() else {
            // A lost request looks like a timeout to the sender; wait a little as one would.
            tokio::time::sleep(Duration::from_millis(20)).await;
            return Err(RPCError::Unreachable(Unreachable::new(&Fault("request lost"))));
        };
        tokio::time::sleep(Duration::from_millis(delay)).await;
        let r = call(raft).await;
        let (lost, delay) = self.reply_lost();
        tokio::time::sleep(Duration::from_millis(delay)).await;
        if lost {
            return Err(RPCError::Network(NetworkError::new(&Fault("reply lost"))));
        }
        r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.to, e)))
    }
}

impl RaftNetwork<TypeConfig> for SimClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr<RaftError<NodeId>>> {
        self.go(async move |r: Raft| r.append_entries(rpc).await).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<RaftError<NodeId, InstallSnapshotError>>> {
        self.go(async move |r: Raft| r.install_snapshot(rpc).await).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        _option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RpcErr<RaftError<NodeId>>> {
        self.go(async move |r: Raft| r.vote(rpc).await).await
    }
}

fn opts() -> Options {
    Options::new().pm_pool_size(4 << 20)
}

fn config() -> Arc<Config> {
    let c = Config {
        heartbeat_interval: 50,
        election_timeout_min: 200,
        election_timeout_max: 400,
        // Small, so snapshots, purges and snapshot installs all happen within a run.
        snapshot_policy: SnapshotPolicy::LogsSinceLast(40),
        max_in_snapshot_log_to_keep: 5,
        purge_batch_size: 1,
        snapshot_max_chunk_size: 512,
        ..Config::default()
    };
    Arc::new(c.validate().unwrap())
}

/// A node's stores (kept to be killed).
struct Stores {
    log: Arc<Db>,
    data: Arc<Db>,
}

struct Sim {
    dir: PathBuf,
    net: Shared,
    stores: BTreeMap<NodeId, Stores>,
}

impl Sim {
    async fn start(&mut self, id: NodeId) {
        let d = self.dir.join(format!("n{id}"));
        let log = LogStore::open(d.join("raft/log"), opts()).unwrap();
        let data = Arc::new(Db::open(&d, opts()).unwrap());
        let sm = StateMachine::open(data.clone(), d.join("raft/snapshot")).unwrap();
        let stores = Stores { log: log.db().clone(), data };
        let net = SimNetwork { from: id, net: self.net.clone() };
        let raft = Raft::new(id, config(), net, log, sm).await.unwrap();
        self.net.lock().unwrap().nodes.insert(id, raft);
        self.stores.insert(id, stores);
    }

    /// Kill `id`: stop its Raft task, then drop its stores without a clean close.
    async fn kill(&mut self, id: NodeId) {
        let raft = self.net.lock().unwrap().nodes.remove(&id);
        if let Some(r) = raft {
            r.shutdown().await.unwrap();
        }
        let Some(s) = self.stores.remove(&id) else { return };
        for db in [s.log, s.data] {
            // Wait for the last users (a snapshot build on a blocking thread) to let go.
            let mut db = db;
            let mut tries = 0;
            loop {
                match Arc::try_unwrap(db) {
                    Ok(d) => {
                        d.simulate_process_crash();
                        break;
                    }
                    Err(a) if tries < 200 => {
                        db = a;
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err(_) => panic!("store of node {id} still in use"),
                }
            }
        }
    }

    fn leader(&self) -> Option<Raft> {
        let n = self.net.lock().unwrap();
        n.nodes.values().find(|r| r.metrics().borrow().state == openraft::ServerState::Leader).cloned()
    }

    fn any_node(&self, pick: u64) -> Option<Raft> {
        let n = self.net.lock().unwrap();
        let v: Vec<_> = n.nodes.values().cloned().collect();
        if v.is_empty() {
            None
        } else {
            Some(v[pick as usize % v.len()].clone())
        }
    }
}

fn entries(db: &Db) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut it = db.iter().unwrap();
    let mut out = BTreeMap::new();
    while let Some((k, v)) = it.next().unwrap() {
        if !k.starts_with(META_PREFIX) {
            out.insert(k, v);
        }
    }
    out
}

struct Outcome {
    acked: usize,
    attempted: usize,
    kills: usize,
    snapshots_installed: usize,
}

async fn run(seed: u64, steps: usize) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let net = Arc::new(Mutex::new(Net {
        nodes: BTreeMap::new(),
        isolated: BTreeSet::new(),
        rng: SmallRng::seed_from_u64(seed),
        loss: 0.05,
        max_delay_ms: 30,
    }));
    let mut sim = Sim { dir: dir.path().to_path_buf(), net: net.clone(), stores: BTreeMap::new() };
    for id in 1..=3 {
        sim.start(id).await;
    }
    let members: BTreeMap<NodeId, ClusterNode> = (1..=3).map(|id| (id, ClusterNode::default())).collect();
    let first = sim.net.lock().unwrap().nodes[&1].clone();
    first.initialize(members).await.unwrap();

    let mut script = SmallRng::seed_from_u64(seed ^ 0x5eed);
    // key -> value of acknowledged writes; every attempted (key, value).
    let acked: Arc<Mutex<BTreeMap<Vec<u8>, Vec<u8>>>> = Arc::default();
    let mut attempted: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    let mut kills = 0;
    let mut down: BTreeSet<NodeId> = BTreeSet::new();
    let mut clients = Vec::new();
    let verbose = std::env::var_os("TIERKV_SIM_VERBOSE").is_some();
    for step in 0..steps {
        if verbose {
            eprintln!("seed {seed} step {step}: down {down:?} isolated {:?}", sim.net.lock().unwrap().isolated);
        }
        match script.random_range(0..100) {
            // Kill a node (at most one down at a time: a majority stays up).
            0..=5 if down.is_empty() => {
                let id = script.random_range(1..=3);
                sim.kill(id).await;
                down.insert(id);
                kills += 1;
            }
            // Restart a killed node.
            6..=15 if !down.is_empty() => {
                let id = *down.iter().next().unwrap();
                down.remove(&id);
                sim.start(id).await;
            }
            // Isolate one node, or heal.
            16..=20 => {
                let id = script.random_range(1..=3);
                sim.net.lock().unwrap().isolated.insert(id);
            }
            21..=30 => sim.net.lock().unwrap().isolated.clear(),
            _ => {}
        }
        // A few writes per step, each to the node a client believes to be the leader.
        for j in 0..3 {
            let key = format!("s{seed}-k{step:04}-{j}").into_bytes();
            let value = format!("v{}", script.random_range(0..1_000_000u32)).into_bytes();
            attempted.insert(key.clone(), value.clone());
            let target = if script.random_bool(0.8) { sim.leader() } else { sim.any_node(script.random()) };
            let Some(raft) = target else { continue };
            let acked = acked.clone();
            clients.push(tokio::spawn(async move {
                let req = Request { ops: vec![Op::Put { key: key.clone(), value: value.clone() }] };
                if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(3), raft.client_write(req)).await {
                    acked.lock().unwrap().insert(key, value);
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(script.random_range(20..150))).await;
    }
    for c in clients {
        let _ = c.await;
    }
    // Heal: network whole, every node up; wait for all to apply the leader's last entry.
    {
        let mut n = sim.net.lock().unwrap();
        n.isolated.clear();
        n.loss = 0.0;
    }
    for id in std::mem::take(&mut down) {
        sim.start(id).await;
    }
    let mut waited = 0;
    let last = loop {
        if let Some(l) = sim.leader() {
            // A write in the new term makes everything before it committed.
            if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(2), l.client_write(Request::default())).await {
                break r.log_id.index;
            }
        }
        waited += 1;
        assert!(waited < 300, "seed {seed}: no leader after healing");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let rafts: Vec<Raft> = sim.net.lock().unwrap().nodes.values().cloned().collect();
    for r in &rafts {
        r.wait(Some(Duration::from_secs(60))).applied_index_at_least(Some(last), "converge").await.unwrap();
    }
    let mut snapshots_installed = 0;
    for r in &rafts {
        if r.metrics().borrow().snapshot.is_some() {
            snapshots_installed += 1;
        }
    }
    let acked = acked.lock().unwrap().clone();
    let data: Vec<BTreeMap<Vec<u8>, Vec<u8>>> = sim.stores.values().map(|s| entries(&s.data)).collect();
    for (i, d) in data.iter().enumerate() {
        for (k, v) in &acked {
            assert_eq!(
                d.get(k),
                Some(v),
                "seed {seed}: acknowledged write {} lost on node {}",
                String::from_utf8_lossy(k),
                i + 1
            );
        }
        for (k, v) in d {
            assert_eq!(attempted.get(k), Some(v), "seed {seed}: {} was never written", String::from_utf8_lossy(k));
        }
        assert_eq!(d, &data[0], "seed {seed}: node {} differs from node 1", i + 1);
    }
    for id in 1..=3 {
        sim.kill(id).await;
    }
    Outcome { acked: acked.len(), attempted: attempted.len(), kills, snapshots_installed }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn no_acknowledged_write_is_lost_under_loss_delay_partitions_and_kills() {
    let seeds = env("TIERKV_SIM_SEEDS", 4) as u64;
    let steps = env("TIERKV_SIM_STEPS", 150);
    let mut total_acked = 0;
    for seed in 1..=seeds {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
        let o = rt.block_on(run(seed, steps));
        eprintln!(
            "seed {seed}: {} of {} writes acknowledged, {} kills, {} nodes holding a snapshot; all acknowledged writes on all nodes",
            o.acked, o.attempted, o.kills, o.snapshots_installed
        );
        assert!(o.acked > 0, "seed {seed}: no write was acknowledged at all");
        total_acked += o.acked;
    }
    assert!(total_acked > 0);
}
