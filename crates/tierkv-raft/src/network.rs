//! The node-to-node transport (and the cluster commands' client): TCP, one request at a time
//! per connection, each message a length-prefixed bincode frame authenticated with
//! HMAC-SHA256 under the shared cluster secret.
//!
//! Connection: the client sends `"TKVRAFT1" | client nonce (16 random bytes)`, the server
//! answers `"TKVRAFT1" | server nonce (16)`. Every later frame is
//!
//! ```text
//! length u32 LE | bincode payload | HMAC-SHA256(secret, client nonce | server nonce |
//!                                               direction u8 | sequence u64 LE | payload)
//! ```
//!
//! with direction 0 for requests and 1 for replies and a sequence number counting the
//! connection's frames in each direction from 0. A peer without the secret can neither send a
//! request that is accepted nor forge a reply; a recorded frame cannot be replayed on another
//! connection (other nonces) or at another place in this one (other sequence number). The
//! secret authenticates; it does not encrypt (TLS is not implemented yet).
//!
//! Choices: bincode 1 for the payload (compact, and serde is what openraft's messages
//! derive); `ring`'s HMAC (already in the workspace for the server's TLS) with its
//! constant-time verification. The wire format is not persisted, so it carries no version of
//! its own beyond the magic: all nodes of a cluster run the same build.
//!
//! Client side ([`TcpNetwork`], openraft's `RaftNetworkFactory`): a connection per target,
//! opened lazily with a connect timeout, dropped on any error and reopened by the next call
//! (openraft retries with its backoff); each call is bounded by the RPC's hard TTL.

use std::time::Duration;

use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{RPCTypes, RaftNetwork, RaftNetworkFactory};
use rand::RngCore;
use ring::hmac;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::{ClusterNode, NodeId, Request, TypeConfig};

/// Magic of the connection handshake.
pub const MAGIC: &[u8; 8] = b"TKVRAFT1";
/// Largest frame accepted (a snapshot chunk or a batch of entries).
pub const MAX_FRAME: usize = 256 << 20;
/// How long a connection attempt may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A request to a node.
#[derive(Debug, Serialize, Deserialize)]
pub enum RpcRequest {
    /// Raft: append entries / heartbeat.
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    /// Raft: a chunk of a snapshot.
    InstallSnapshot(InstallSnapshotRequest<TypeConfig>),
    /// Raft: request a vote.
    Vote(VoteRequest<NodeId>),
    /// Bootstrap probe: who are you, is your Raft state initialised.
    Hello,
    /// This node's view ([`NodeStatus`]).
    Status,
    /// Propose a write (leader only).
    Write(Request),
    /// Linearizable read of a key (leader only: read-index, then the local store).
    Read(Vec<u8>),
    /// Add a node: as a learner (catches up), then as a voter (joint consensus).
    AddNode {
        /// Its id.
        id: NodeId,
        /// Its addresses.
        node: ClusterNode,
    },
    /// Remove a voter (joint consensus).
    RemoveNode {
        /// Its id.
        id: NodeId,
    },
}

/// Why a client request was not done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refused {
    /// This node is not the leader; the leader, if known.
    NotLeader(Option<(NodeId, ClusterNode)>),
    /// Anything else.
    Failed(String),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::NotLeader(Some((id, n))) => write!(f, "not the leader; the leader is node {id} ({n})"),
            Refused::NotLeader(None) => write!(f, "not the leader; no leader known"),
            Refused::Failed(m) => f.write_str(m),
        }
    }
}

/// A node's view of itself and the cluster (`tierkv cluster status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Its id.
    pub id: NodeId,
    /// Leader, Follower, Candidate, Learner or Shutdown.
    pub state: String,
    /// Current term.
    pub term: u64,
    /// The leader it knows of.
    pub leader: Option<NodeId>,
    /// Index of its last log entry.
    pub last_log_index: Option<u64>,
    /// Index of the last entry its state machine applied.
    pub applied_index: Option<u64>,
    /// Voter sets (two while a membership change is in joint consensus).
    pub voters: Vec<Vec<NodeId>>,
    /// Every member (voters and learners) with its addresses.
    pub nodes: Vec<(NodeId, ClusterNode)>,
}

/// A reply.
#[derive(Debug, Serialize, Deserialize)]
pub enum RpcReply {
    /// To [`RpcRequest::AppendEntries`].
    AppendEntries(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    /// To [`RpcRequest::InstallSnapshot`].
    InstallSnapshot(Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>),
    /// To [`RpcRequest::Vote`].
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    /// To [`RpcRequest::Hello`].
    Hello {
        /// The node's id.
        id: NodeId,
        /// Whether its Raft state is initialised (it has a log or a vote).
        initialized: bool,
    },
    /// To [`RpcRequest::Status`].
    Status(NodeStatus),
    /// To [`RpcRequest::Write`], `AddNode`, `RemoveNode`: the index of the committed entry.
    Committed(Result<u64, Refused>),
    /// To [`RpcRequest::Read`].
    Value(Result<Option<Vec<u8>>, Refused>),
    /// The request could not be decoded or served.
    Error(String),
}

/// A transport failure.
#[derive(Debug)]
pub enum WireError {
    /// Socket error.
    Io(std::io::Error),
    /// The peer sent something that is not a valid frame (or failed authentication).
    Protocol(String),
    /// No answer in time.
    Timeout,
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Io(e) => write!(f, "{e}"),
            WireError::Protocol(m) => write!(f, "protocol error: {m}"),
            WireError::Timeout => f.write_str("timed out"),
        }
    }
}

impl std::error::Error for WireError {}

impl From<std::io::Error> for WireError {
    fn from(e: std::io::Error) -> Self {
        WireError::Io(e)
    }
}

/// The HMAC key of the shared cluster secret.
#[derive(Clone)]
pub struct Secret(hmac::Key);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// The key for `secret` (the contents of the cluster secret file, surrounding whitespace
    /// removed by the caller). At least 16 bytes.
    pub fn new(secret: &[u8]) -> Result<Secret, String> {
        if secret.len() < 16 {
            return Err(format!("the cluster secret has {} bytes; at least 16 are required", secret.len()));
        }
        Ok(Secret(hmac::Key::new(hmac::HMAC_SHA256, secret)))
    }

    /// Read the secret from a file (trailing newline and surrounding whitespace ignored).
    pub fn from_file(path: &std::path::Path) -> Result<Secret, String> {
        let b = std::fs::read(path).map_err(|e| format!("cannot read the cluster secret {}: {e}", path.display()))?;
        let s = String::from_utf8_lossy(&b);
        Secret::new(s.trim().as_bytes())
    }
}

/// One authenticated connection (either side).
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    secret: Secret,
    nonces: [u8; 32],
    /// This side's direction byte for frames it sends (0 client, 1 server).
    dir: u8,
    sent: u64,
    received: u64,
}

fn nonce() -> [u8; 16] {
    let mut n = [0u8; 16];
    rand::rng().fill_bytes(&mut n);
    n
}

impl Conn {
    /// Connect to `addr` and handshake, within [`CONNECT_TIMEOUT`].
    pub async fn connect(addr: &str, secret: &Secret) -> Result<Conn, WireError> {
        let fut = async {
            let mut stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let cn = nonce();
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&cn);
            stream.write_all(&hello).await?;
            let mut reply = [0u8; 24];
            stream.read_exact(&mut reply).await?;
            if &reply[..8] != MAGIC {
                return Err(WireError::Protocol("not a tierkv raft port".into()));
            }
            let mut nonces = [0u8; 32];
            nonces[..16].copy_from_slice(&cn);
            nonces[16..].copy_from_slice(&reply[8..]);
            Ok(Conn { stream, secret: secret.clone(), nonces, dir: 0, sent: 0, received: 0 })
        };
        tokio::time::timeout(CONNECT_TIMEOUT, fut).await.map_err(|_| WireError::Timeout)?
    }

    /// Accept the handshake of a client on `stream`.
    pub async fn accept(mut stream: TcpStream, secret: &Secret) -> Result<Conn, WireError> {
        stream.set_nodelay(true)?;
        let mut hello = [0u8; 24];
        tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut hello))
            .await
            .map_err(|_| WireError::Timeout)??;
        if &hello[..8] != MAGIC {
            return Err(WireError::Protocol("not a tierkv raft client".into()));
        }
        let sn = nonce();
        let mut reply = MAGIC.to_vec();
        reply.extend_from_slice(&sn);
        stream.write_all(&reply).await?;
        let mut nonces = [0u8; 32];
        nonces[..16].copy_from_slice(&hello[8..]);
        nonces[16..].copy_from_slice(&sn);
        Ok(Conn { stream, secret: secret.clone(), nonces, dir: 1, sent: 0, received: 0 })
    }

    fn tag(&self, dir: u8, seq: u64, payload: &[u8]) -> hmac::Tag {
        let mut ctx = hmac::Context::with_key(&self.secret.0);
        ctx.update(&self.nonces);
        ctx.update(&[dir]);
        ctx.update(&seq.to_le_bytes());
        ctx.update(payload);
        ctx.sign()
    }

    /// Send one message.
    pub async fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), WireError> {
        let payload = bincode::serialize(msg).map_err(|e| WireError::Protocol(e.to_string()))?;
        if payload.len() > MAX_FRAME {
            return Err(WireError::Protocol(format!("message of {} bytes exceeds the frame limit", payload.len())));
        }
        let tag = self.tag(self.dir, self.sent, &payload);
        let mut frame = Vec::with_capacity(4 + payload.len() + 32);
        frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        frame.extend_from_slice(&payload);
        frame.extend_from_slice(tag.as_ref());
        self.stream.write_all(&frame).await?;
        self.sent += 1;
        Ok(())
    }

    /// Receive one message (`None`: the peer closed the connection between frames).
    pub async fn recv<T: for<'de> Deserialize<'de>>(&mut self) -> Result<Option<T>, WireError> {
        let mut len = [0u8; 4];
        match self.stream.read_exact(&mut len).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_FRAME {
            return Err(WireError::Protocol(format!("frame of {n} bytes exceeds the limit")));
        }
        let mut buf = vec![0u8; n + 32];
        self.stream.read_exact(&mut buf).await?;
        let (payload, tag) = buf.split_at(n);
        let mut ctx_data = Vec::with_capacity(32 + 9 + n);
        ctx_data.extend_from_slice(&self.nonces);
        ctx_data.push(1 - self.dir);
        ctx_data.extend_from_slice(&self.received.to_le_bytes());
        ctx_data.extend_from_slice(payload);
        hmac::verify(&self.secret.0, &ctx_data, tag)
            .map_err(|_| WireError::Protocol("authentication failed (wrong cluster secret?)".into()))?;
        self.received += 1;
        let msg = bincode::deserialize(payload).map_err(|e| WireError::Protocol(format!("bad message: {e}")))?;
        Ok(Some(msg))
    }

    /// Send a request and wait for its reply, within `ttl`.
    pub async fn call(&mut self, req: &RpcRequest, ttl: Duration) -> Result<RpcReply, WireError> {
        let fut = async {
            self.send(req).await?;
            match self.recv::<RpcReply>().await? {
                Some(r) => Ok(r),
                None => Err(WireError::Protocol("connection closed before the reply".into())),
            }
        };
        tokio::time::timeout(ttl, fut).await.map_err(|_| WireError::Timeout)?
    }
}

/// One request to `addr` on a fresh connection (the cluster commands' client).
pub async fn call_once(addr: &str, secret: &Secret, req: &RpcRequest, ttl: Duration) -> Result<RpcReply, WireError> {
    let mut c = Conn::connect(addr, secret).await?;
    c.call(req, ttl).await
}

/// openraft's network factory over TCP.
#[derive(Debug, Clone)]
pub struct TcpNetwork {
    secret: Secret,
}

impl TcpNetwork {
    /// Connections authenticated with `secret`.
    pub fn new(secret: Secret) -> TcpNetwork {
        TcpNetwork { secret }
    }
}

/// The connection to one target.
#[derive(Debug)]
pub struct TcpClient {
    target: NodeId,
    addr: String,
    secret: Secret,
    conn: Option<Conn>,
}

impl RaftNetworkFactory<TypeConfig> for TcpNetwork {
    type Network = TcpClient;

    async fn new_client(&mut self, target: NodeId, node: &ClusterNode) -> TcpClient {
        TcpClient { target, addr: node.raft_addr.clone(), secret: self.secret.clone(), conn: None }
    }
}

type RpcErr<E> = RPCError<NodeId, ClusterNode, E>;

impl TcpClient {
    async fn rpc<E: std::error::Error>(
        &mut self,
        action: RPCTypes,
        req: RpcRequest,
        option: &RPCOption,
    ) -> Result<RpcReply, RpcErr<E>> {
        let ttl = option.hard_ttl();
        if self.conn.is_none() {
            match Conn::connect(&self.addr, &self.secret).await {
                Ok(c) => self.conn = Some(c),
                Err(e) => return Err(RPCError::Unreachable(Unreachable::new(&e))),
            }
        }
        let Some(conn) = self.conn.as_mut() else {
            return Err(RPCError::Unreachable(Unreachable::new(&WireError::Protocol("no connection".into()))));
        };
        match conn.call(&req, ttl).await {
            Ok(r) => Ok(r),
            Err(e) => {
                // The stream is in an unknown state: reconnect on the next call.
                self.conn = None;
                Err(match e {
                    WireError::Timeout => {
                        RPCError::Timeout(Timeout { action, id: 0, target: self.target, timeout: ttl })
                    }
                    e => RPCError::Network(NetworkError::new(&e)),
                })
            }
        }
    }

    fn unexpected<E: std::error::Error>(&mut self, r: RpcReply) -> RpcErr<E> {
        self.conn = None;
        let msg = match r {
            RpcReply::Error(m) => m,
            other => format!("unexpected reply {other:?}"),
        };
        RPCError::Network(NetworkError::new(&WireError::Protocol(msg)))
    }
}

impl RaftNetwork<TypeConfig> for TcpClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr<RaftError<NodeId>>> {
        match self.rpc(RPCTypes::AppendEntries, RpcRequest::AppendEntries(rpc), &option).await? {
            RpcReply::AppendEntries(Ok(r)) => Ok(r),
            RpcReply::AppendEntries(Err(e)) => Err(RPCError::RemoteError(RemoteError::new(self.target, e))),
            other => Err(self.unexpected(other)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<RaftError<NodeId, InstallSnapshotError>>> {
        match self.rpc(RPCTypes::InstallSnapshot, RpcRequest::InstallSnapshot(rpc), &option).await? {
            RpcReply::InstallSnapshot(Ok(r)) => Ok(r),
            RpcReply::InstallSnapshot(Err(e)) => Err(RPCError::RemoteError(RemoteError::new(self.target, e))),
            other => Err(self.unexpected(other)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RpcErr<RaftError<NodeId>>> {
        match self.rpc(RPCTypes::Vote, RpcRequest::Vote(rpc), &option).await? {
            RpcReply::Vote(Ok(r)) => Ok(r),
            RpcReply::Vote(Err(e)) => Err(RPCError::RemoteError(RemoteError::new(self.target, e))),
            other => Err(self.unexpected(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(a: &Secret, b: &Secret) -> (Conn, Conn) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let b = b.clone();
        let server = tokio::spawn(async move {
            let (s, _) = l.accept().await.expect("accept");
            Conn::accept(s, &b).await.expect("handshake")
        });
        let c = Conn::connect(&addr, a).await.expect("connect");
        (c, server.await.expect("join"))
    }

    #[tokio::test]
    async fn frames_round_trip_and_wrong_secret_is_refused() {
        let s = Secret::new(b"0123456789abcdef0123").expect("secret");
        let (mut c, mut srv) = pair(&s, &s).await;
        c.send(&RpcRequest::Read(b"k".to_vec())).await.expect("send");
        match srv.recv::<RpcRequest>().await.expect("recv") {
            Some(RpcRequest::Read(k)) => assert_eq!(k, b"k"),
            other => panic!("got {other:?}"),
        }
        srv.send(&RpcReply::Value(Ok(Some(b"v".to_vec())))).await.expect("send");
        match c.recv::<RpcReply>().await.expect("recv") {
            Some(RpcReply::Value(Ok(Some(v)))) => assert_eq!(v, b"v"),
            other => panic!("got {other:?}"),
        }
        let other = Secret::new(b"another secret of 16+ bytes").expect("secret");
        let (mut c, mut srv) = pair(&other, &s).await;
        c.send(&RpcRequest::Status).await.expect("send");
        match srv.recv::<RpcRequest>().await {
            Err(WireError::Protocol(m)) => assert!(m.contains("authentication"), "{m}"),
            other => panic!("accepted a frame under the wrong secret: {other:?}"),
        }
        assert!(Secret::new(b"short").is_err());
    }

    #[tokio::test]
    async fn replayed_or_tampered_frames_are_refused() {
        let s = Secret::new(b"0123456789abcdef0123").expect("secret");
        let (mut c, mut srv) = pair(&s, &s).await;
        // Capture a frame as the client would send it, then send it twice: the second copy
        // carries sequence 0 again, so it fails authentication.
        let payload = bincode::serialize(&RpcRequest::Status).expect("ser");
        let tag = c.tag(0, 0, &payload);
        let mut frame = (payload.len() as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&payload);
        frame.extend_from_slice(tag.as_ref());
        c.stream.write_all(&frame).await.expect("write");
        c.stream.write_all(&frame).await.expect("write");
        assert!(matches!(srv.recv::<RpcRequest>().await, Ok(Some(RpcRequest::Status))));
        assert!(matches!(srv.recv::<RpcRequest>().await, Err(WireError::Protocol(_))));
        // A flipped payload byte fails too.
        let (mut c, mut srv) = pair(&s, &s).await;
        let mut bad = frame.clone();
        bad[4] ^= 1;
        // Sequence 0 on a new connection, but the nonces differ: refused as well.
        c.stream.write_all(&bad).await.expect("write");
        assert!(matches!(srv.recv::<RpcRequest>().await, Err(WireError::Protocol(_))));
    }
}
