//! `tierkv serve --raft-*` (a replicated node) and `tierkv cluster …` (issue 25; the
//! consensus is `tierkv-raft`, the server's side `tierkv_server::replica`).
//!
//! `--raft-tls-cert-file`, `--raft-tls-key-file` and `--raft-tls-ca-file` (all three or none,
//! on `serve` and on every `cluster` command) make every Raft connection mutual TLS
//! (`tierkv_raft::network`); the cluster secret stays required with or without them.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tierkv::{Db, Options};
use tierkv_raft::network::{call_once, Auth, NodeStatus, Refused, RpcReply, RpcRequest, Secret, Tls};
use tierkv_raft::node::{default_config, parse_peers, NodeConfig, RaftNode};
use tierkv_raft::resp::RaftReplicator;
use tierkv_raft::{ClusterNode, NodeId};

/// The `--raft-*` flags of `serve`.
#[derive(clap::Args, Debug)]
pub struct RaftArgs {
    /// Replicate through Raft: this node's id (with --raft-addr, --raft-peers and
    /// --cluster-secret-file). Writes are acknowledged once a majority has them; a follower
    /// answers writes (and reads, unless the connection sent READONLY) with
    /// `-MOVED <slot> <leader host:port>`.
    #[arg(long)]
    pub raft_id: Option<NodeId>,
    /// HOST:PORT this node's Raft transport listens on (and peers reach it at).
    #[arg(long)]
    pub raft_addr: Option<String>,
    /// Every node's id and Raft address: `1=HOST:PORT,2=HOST:PORT,3=HOST:PORT` (this node
    /// included). The cluster initialises once a majority of them is up.
    #[arg(long)]
    pub raft_peers: Option<String>,
    /// File holding the shared cluster secret (at least 16 bytes) that authenticates all
    /// node-to-node traffic (HMAC-SHA256).
    #[arg(long)]
    pub cluster_secret_file: Option<PathBuf>,
    /// `yes`: also msync the Raft log at each append (survives power loss, not only a crash
    /// of the process).
    #[arg(long, default_value = "no")]
    pub raft_sync: crate::YesNo,
    #[command(flatten)]
    pub tls: RaftTlsArgs,
}

/// `--raft-tls-*`: mutual TLS on the Raft port (all three or none).
#[derive(clap::Args, Debug, Default)]
pub struct RaftTlsArgs {
    /// Mutual TLS on every Raft connection (with --raft-tls-key-file and --raft-tls-ca-file):
    /// the PEM certificate chain (leaf first) presented to peers. It must chain to the CA file
    /// and name the host of this node's --raft-addr (DNS name, or IP address SAN), for both
    /// server and client use. The cluster secret stays required.
    #[arg(long, value_name = "FILE")]
    pub raft_tls_cert_file: Option<PathBuf>,
    /// The PEM private key of --raft-tls-cert-file (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "FILE")]
    pub raft_tls_key_file: Option<PathBuf>,
    /// The cluster's CA (PEM): a peer's certificate must chain to it, and the server's must
    /// name the host of the --raft-addr it is reached at. Nodes refuse plain connections.
    #[arg(long, value_name = "FILE")]
    pub raft_tls_ca_file: Option<PathBuf>,
}

impl RaftTlsArgs {
    /// Whether any of the three flags is given.
    pub fn any(&self) -> bool {
        self.raft_tls_cert_file.is_some() || self.raft_tls_key_file.is_some() || self.raft_tls_ca_file.is_some()
    }

    /// Load the certificates, if the flags are given (all three, or an error).
    fn load(&self) -> Result<Option<Tls>, tierkv::Error> {
        match (&self.raft_tls_cert_file, &self.raft_tls_key_file, &self.raft_tls_ca_file) {
            (None, None, None) => Ok(None),
            (Some(c), Some(k), Some(a)) => Tls::from_files(c, k, a).map(Some).map_err(err),
            _ => Err(err("--raft-tls-cert-file, --raft-tls-key-file and --raft-tls-ca-file go together")),
        }
    }

    /// The secret in `secret_file` and these TLS settings.
    fn auth(&self, secret_file: &Path) -> Result<Auth, tierkv::Error> {
        let tls = self.load()?;
        Ok(Auth::new(Secret::from_file(secret_file).map_err(err)?, tls))
    }
}

fn err(m: impl std::fmt::Display) -> tierkv::Error {
    tierkv::Error::InvalidArgument(m.to_string())
}

/// Serve `db` replicated: start the Raft node on its own runtime, then the RESP server.
pub fn serve(
    db: Arc<Db>,
    mut cfg: tierkv_server::ServerConfig,
    r: RaftArgs,
    dir: &Path,
    out: &mut impl Write,
) -> Result<(), tierkv::Error> {
    let (Some(id), Some(raft_addr), Some(peers), Some(secret)) =
        (r.raft_id, r.raft_addr, r.raft_peers, r.cluster_secret_file)
    else {
        return Err(err("--raft-id, --raft-addr, --raft-peers and --cluster-secret-file go together"));
    };
    let peers = parse_peers(&peers).map_err(err)?;
    if peers.get(&id).is_some_and(|a| *a != raft_addr) {
        return Err(err(format!("--raft-peers gives node {id} another address than --raft-addr {raft_addr}")));
    }
    let tls = r.tls.load()?;
    let secret = Secret::from_file(&secret).map_err(err)?;
    let host = raft_addr.rsplit_once(':').map(|(h, _)| h.to_string()).unwrap_or_default();
    // A server thread waits for each commit it proposes: enough threads that many clients'
    // writes are in flight together (openraft batches them).
    if cfg.threads == 0 {
        cfg.threads = 64;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("tierkv-raft")
        .enable_all()
        .build()
        .map_err(err)?;
    let ncfg = NodeConfig {
        id,
        raft_dir: dir.join("raft"),
        raft_addr,
        resp_addr: String::new(),
        peers,
        secret,
        tls,
        log_options: Options::new().pm_sync(r.raft_sync.0),
        raft: default_config(),
    };
    let node = rt.block_on(RaftNode::start(ncfg, db.clone())).map_err(err)?;
    let replicator = Arc::new(RaftReplicator::new(node.clone(), rt.handle().clone()));
    let preset = db.preset();
    tierkv_server::serve_with_until_signal(db, &cfg, Some(replicator), |server| {
        if let Some(a) = server.plain_addr() {
            node.set_resp_addr(format!("{host}:{}", a.port()));
            let _ = writeln!(out, "listening on {a} (preset {preset})");
        }
        if let Some(a) = server.tls_addr() {
            let _ = writeln!(out, "listening on {a} (tls, preset {preset})");
        }
        let _ = writeln!(out, "raft node {id} on {}", node.raft_addr());
        let _ = out.flush();
    })
    .map_err(|e| err(format!("serve: {e}")))?;
    rt.shutdown_timeout(Duration::from_secs(2));
    Ok(())
}

/// `tierkv cluster …`.
#[derive(clap::Subcommand, Debug)]
pub enum ClusterCmd {
    /// Print the members, the leader and each node's applied index as JSON.
    Status {
        /// Raft address of any member.
        #[arg(long)]
        raft_addr: String,
        /// The cluster secret file.
        #[arg(long)]
        cluster_secret_file: PathBuf,
        #[command(flatten)]
        tls: RaftTlsArgs,
    },
    /// Add a node (started with `serve --raft-*`): as a learner until it has caught up, then
    /// as a voter (joint consensus). Prints the index of the membership entry.
    AddNode {
        /// Raft address of any member (the request follows the leader).
        #[arg(long)]
        raft_addr: String,
        /// The cluster secret file.
        #[arg(long)]
        cluster_secret_file: PathBuf,
        #[command(flatten)]
        tls: RaftTlsArgs,
        /// The new node's id.
        #[arg(long)]
        id: NodeId,
        /// The new node's Raft address.
        #[arg(long)]
        node_raft_addr: String,
        /// The new node's RESP address (HOST:PORT), the target of `-MOVED` when it leads.
        #[arg(long, default_value = "")]
        node_resp_addr: String,
    },
    /// Remove a voter (joint consensus). Prints the index of the membership entry.
    RemoveNode {
        /// Raft address of any member (the request follows the leader).
        #[arg(long)]
        raft_addr: String,
        /// The cluster secret file.
        #[arg(long)]
        cluster_secret_file: PathBuf,
        #[command(flatten)]
        tls: RaftTlsArgs,
        /// The node to remove.
        #[arg(long)]
        id: NodeId,
    },
}

async fn status_of(addr: &str, auth: &Auth) -> Result<NodeStatus, String> {
    match call_once(addr, auth, &RpcRequest::Status, Duration::from_secs(2)).await {
        Ok(RpcReply::Status(s)) => Ok(s),
        Ok(other) => Err(format!("{addr}: unexpected reply {other:?}")),
        Err(e) => Err(format!("{addr}: {e}")),
    }
}

/// Send a membership change to `addr`, following the leader (at most 3 hops).
async fn change(mut addr: String, auth: &Auth, req: RpcRequest) -> Result<u64, String> {
    for _ in 0..3 {
        match call_once(&addr, auth, &req, Duration::from_secs(120)).await {
            Ok(RpcReply::Committed(Ok(i))) => return Ok(i),
            Ok(RpcReply::Committed(Err(Refused::NotLeader(Some((_, n)))))) if !n.raft_addr.is_empty() => {
                addr = n.raft_addr;
            }
            Ok(RpcReply::Committed(Err(e))) => return Err(e.to_string()),
            Ok(other) => return Err(format!("{addr}: unexpected reply {other:?}")),
            Err(e) => return Err(format!("{addr}: {e}")),
        }
    }
    Err("the leader kept moving".into())
}

/// Run a `cluster` command.
pub fn run(cmd: ClusterCmd, out: &mut impl Write) -> Result<(), tierkv::Error> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(err)?;
    match cmd {
        ClusterCmd::Status { raft_addr, cluster_secret_file, tls } => {
            let secret = tls.auth(&cluster_secret_file)?;
            let json = rt.block_on(async {
                let s = status_of(&raft_addr, &secret).await?;
                let voters: std::collections::BTreeSet<NodeId> = s.voters.iter().flatten().copied().collect();
                let mut members = Vec::new();
                for (id, n) in &s.nodes {
                    let live = status_of(&n.raft_addr, &secret).await;
                    members.push(serde_json::json!({
                        "id": id,
                        "raft_addr": n.raft_addr,
                        "resp_addr": live.as_ref().ok().and_then(|l| l.nodes.iter().find(|(i, _)| i == id))
                            .map_or(n.resp_addr.clone(), |(_, x)| x.resp_addr.clone()),
                        "voter": voters.contains(id),
                        "reachable": live.is_ok(),
                        "state": live.as_ref().ok().map(|l| l.state.clone()),
                        "term": live.as_ref().ok().map(|l| l.term),
                        "applied_index": live.as_ref().ok().and_then(|l| l.applied_index),
                        "last_log_index": live.as_ref().ok().and_then(|l| l.last_log_index),
                    }));
                }
                Ok::<_, String>(serde_json::json!({
                    "leader": s.leader,
                    "term": s.term,
                    "voters": s.voters,
                    "members": members,
                }))
            });
            let json = json.map_err(err)?;
            writeln!(out, "{}", serde_json::to_string_pretty(&json).map_err(err)?)?;
        }
        ClusterCmd::AddNode { raft_addr, cluster_secret_file, tls, id, node_raft_addr, node_resp_addr } => {
            let secret = tls.auth(&cluster_secret_file)?;
            let node = ClusterNode { raft_addr: node_raft_addr, resp_addr: node_resp_addr };
            let i = rt.block_on(change(raft_addr, &secret, RpcRequest::AddNode { id, node })).map_err(err)?;
            writeln!(out, "{i}")?;
        }
        ClusterCmd::RemoveNode { raft_addr, cluster_secret_file, tls, id } => {
            let secret = tls.auth(&cluster_secret_file)?;
            let i = rt.block_on(change(raft_addr, &secret, RpcRequest::RemoveNode { id })).map_err(err)?;
            writeln!(out, "{i}")?;
        }
    }
    Ok(())
}
