//! The node-to-node transport (and the cluster commands' client): TCP, optionally inside
//! mutual TLS, one request at a time per connection, each message a length-prefixed bincode
//! frame authenticated with HMAC-SHA256 under the shared cluster secret.
//!
//! Connection: with TLS ([`Tls`]), a TLS 1.3 handshake first; then, inside it (or directly on
//! TCP without TLS), the client sends `"TKVRAFT1" | client nonce (16 random bytes)` and the
//! server answers `"TKVRAFT1" | server nonce (16)`. Every later frame is
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
//! secret authenticates; it does not encrypt.
//!
//! **TLS** (`--raft-tls-cert-file`, `--raft-tls-key-file`, `--raft-tls-ca-file`) adds
//! confidentiality and a second, independent authentication: every connection is mutual TLS
//! 1.3 (rustls with the `ring` provider, as the RESP server's TLS). Both sides present their
//! certificate and verify the peer's against the cluster's CA file (one CA for the cluster:
//! whatever it signed is a member); the connecting side also checks that the server's
//! certificate names the host part of the address it dialled (the peer's `--raft-addr`: a
//! DNS name SAN, or an IP address SAN for an IP address), so a stolen certificate of one node
//! cannot impersonate another. Node certificates serve both roles, so they need the
//! `serverAuth` and `clientAuth` extended key usages (or no EKU extension). The HMAC framing
//! stays on inside TLS (defence in depth: a CA that signs too much, or a leaked key, still
//! does not admit a peer without the secret), so the secret stays mandatory. TLS 1.3 only:
//! every node runs the same build, so there is no older peer to talk to.
//!
//! A TLS node refuses plain connections and a plain node refuses TLS ones ([`WireError::Tls`],
//! logged by the refusing node, rate limited by [`LogThrottle`]): a plain client's first
//! bytes are the magic (`T`), a TLS client's a handshake record (`0x16`), so the server tells
//! them apart from the first byte. A TLS server answers a plain client with
//! `"TKVRTLS1"` and 16 zero bytes in place of its hello, so the client can say why it was
//! refused; a plain server closes a TLS client's connection (the client reports a failed
//! handshake and suggests the settings differ).
//!
//! Choices: bincode 1 for the payload (compact, and serde is what openraft's messages
//! derive); `ring`'s HMAC (already in the workspace for the server's TLS) with its
//! constant-time verification. The wire format is not persisted, so it carries no version of
//! its own beyond the magic: all nodes of a cluster run the same build. The stream is an enum
//! ([`Stream`]: plain TCP or a TLS stream) rather than a boxed trait object: two cases,
//! static dispatch, and the plain path is the same `TcpStream` calls as before.
//!
//! Client side ([`TcpNetwork`], openraft's `RaftNetworkFactory`): a connection per target,
//! opened lazily with a connect timeout, dropped on any error and reopened by the next call
//! (openraft retries with its backoff); each call is bounded by the RPC's hard TTL. A TLS
//! failure towards a target is logged (at most every 10 s per target).

use std::collections::HashMap;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{RPCTypes, RaftNetwork, RaftNetworkFactory};
use rand::RngCore;
use ring::hmac;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::{ClusterNode, NodeId, Request, TypeConfig};

/// Magic of the connection handshake.
pub const MAGIC: &[u8; 8] = b"TKVRAFT1";
/// What a TLS node answers a plain client's hello with (then it closes the connection).
pub const TLS_REQUIRED: &[u8; 8] = b"TKVRTLS1";
/// The first byte of a TLS handshake record (a TLS client's first byte).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;
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
    /// TLS failed: a handshake or certificate verification failed, or one side uses TLS and
    /// the other does not.
    Tls(String),
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Io(e) => write!(f, "{e}"),
            WireError::Protocol(m) => write!(f, "protocol error: {m}"),
            WireError::Timeout => f.write_str("timed out"),
            WireError::Tls(m) => write!(f, "tls: {m}"),
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

/// How this side secures its connections: the shared secret (always) and, optionally,
/// mutual TLS.
#[derive(Debug, Clone)]
pub struct Auth {
    /// The cluster secret (HMAC of every frame).
    pub secret: Secret,
    /// Mutual TLS around the frames, if configured.
    pub tls: Option<Tls>,
}

impl Auth {
    /// `secret`, and TLS if `tls` is given.
    pub fn new(secret: Secret, tls: Option<Tls>) -> Auth {
        Auth { secret, tls }
    }
}

impl From<Secret> for Auth {
    /// Plain TCP, frames authenticated with the secret.
    fn from(secret: Secret) -> Auth {
        Auth { secret, tls: None }
    }
}

/// Mutual TLS for the Raft transport: this side's certificate chain and key, and the
/// cluster's CA that every peer's certificate must chain to (see the module docs).
#[derive(Clone)]
pub struct Tls {
    connector: tokio_rustls::TlsConnector,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls(..)")
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Tls {
    /// Load `--raft-tls-cert-file` (PEM chain, leaf first), `--raft-tls-key-file` (PEM key:
    /// PKCS#8, PKCS#1 or SEC1) and `--raft-tls-ca-file` (PEM CA certificates).
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<Tls, String> {
        let read = |flag: &str, p: &Path| std::fs::read(p).map_err(|e| format!("{flag} {}: {e}", p.display()));
        let (c, k, a) =
            (read("--raft-tls-cert-file", cert)?, read("--raft-tls-key-file", key)?, read("--raft-tls-ca-file", ca)?);
        Tls::from_pem_labelled(
            &c,
            &k,
            &a,
            [
                format!("--raft-tls-cert-file {}", cert.display()),
                format!("--raft-tls-key-file {}", key.display()),
                format!("--raft-tls-ca-file {}", ca.display()),
            ],
        )
    }

    /// The same from PEM bytes.
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8]) -> Result<Tls, String> {
        Tls::from_pem_labelled(cert, key, ca, ["certificate".into(), "key".into(), "CA".into()])
    }

    fn from_pem_labelled(cert: &[u8], key: &[u8], ca: &[u8], [lc, lk, la]: [String; 3]) -> Result<Tls, String> {
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(cert).collect::<Result<_, _>>().map_err(|e| format!("{lc}: {e}"))?;
        if certs.is_empty() {
            return Err(format!("{lc}: no certificate in it"));
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("{lk}: {e}"))?;
        let mut roots = RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca) {
            let c = c.map_err(|e| format!("{la}: {e}"))?;
            roots.add(c).map_err(|e| format!("{la}: {e}"))?;
        }
        if roots.is_empty() {
            return Err(format!("{la}: no certificate in it"));
        }
        let roots = Arc::new(roots);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| format!("{la}: {e}"))?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(|e| format!("{lc} / {lk}: {e}"))?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(|e| format!("{lc} / {lk}: {e}"))?;
        Ok(Tls {
            connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
        })
    }
}

/// The name a server's certificate must carry when it is reached at `addr` (`HOST:PORT`,
/// `[V6]:PORT`): an IP address, or else a DNS name.
fn server_name(addr: &str) -> Result<ServerName<'static>, WireError> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    ServerName::try_from(host.to_string())
        .map_err(|_| WireError::Tls(format!("{host:?} (of {addr}) is neither an IP address nor a DNS name")))
}

/// A connection's byte stream: plain TCP or TLS over TCP.
#[derive(Debug)]
pub enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS (either side) over TCP.
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Rate limit for log lines about refused or failed connections: a misconfigured peer
/// retries every heartbeat, and one line per key (a peer's IP address, a target) every
/// 10 s says as much as ten a second.
#[derive(Debug, Default)]
pub struct LogThrottle {
    last: Mutex<HashMap<String, Instant>>,
}

impl LogThrottle {
    /// Interval between two lines for the same key.
    pub const EVERY: Duration = Duration::from_secs(10);

    /// Whether a line about `key` may be written now (and, if so, note that it was).
    pub fn allow(&self, key: &str) -> bool {
        let Ok(mut last) = self.last.lock() else { return true };
        let now = Instant::now();
        if last.get(key).is_some_and(|t| now.duration_since(*t) < Self::EVERY) {
            return false;
        }
        if last.len() >= 4096 {
            // Many addresses (a scan): forget the old ones rather than grow without bound.
            last.retain(|_, t| now.duration_since(*t) < Self::EVERY);
        }
        last.insert(key.to_string(), now);
        true
    }
}

/// One authenticated connection (either side).
#[derive(Debug)]
pub struct Conn {
    stream: Stream,
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
    /// Connect to `addr` (over TLS if `auth` has it) and handshake, within
    /// [`CONNECT_TIMEOUT`].
    pub async fn connect(addr: &str, auth: &Auth) -> Result<Conn, WireError> {
        let fut = async {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            let mut stream = match &auth.tls {
                None => Stream::Plain(tcp),
                Some(tls) => {
                    let name = server_name(addr)?;
                    let s = tls.connector.connect(name, tcp).await.map_err(|e| {
                        use std::io::ErrorKind::{ConnectionReset, UnexpectedEof};
                        let hint = if matches!(e.kind(), UnexpectedEof | ConnectionReset) {
                            " (the node closed the connection: does it run without --raft-tls-*?)"
                        } else {
                            ""
                        };
                        WireError::Tls(format!("handshake with the node failed: {e}{hint}"))
                    })?;
                    Stream::Tls(Box::new(tokio_rustls::TlsStream::Client(s)))
                }
            };
            let cn = nonce();
            let mut hello = MAGIC.to_vec();
            hello.extend_from_slice(&cn);
            let mut reply = [0u8; 24];
            let exchanged = async {
                stream.write_all(&hello).await?;
                stream.flush().await?;
                stream.read_exact(&mut reply).await?;
                Ok::<_, std::io::Error>(())
            }
            .await;
            if let Err(e) = exchanged {
                // Under TLS 1.3 the server's verdict on our certificate arrives with its
                // first data: a refusal shows here, as an alert.
                return Err(match &auth.tls {
                    Some(_) => WireError::Tls(format!("the node refused the session: {e}")),
                    None => e.into(),
                });
            }
            if &reply[..8] == TLS_REQUIRED && auth.tls.is_none() {
                return Err(WireError::Tls(
                    "the node requires TLS on its Raft port (give --raft-tls-cert-file, --raft-tls-key-file and \
                     --raft-tls-ca-file)"
                        .into(),
                ));
            }
            if &reply[..8] != MAGIC {
                return Err(WireError::Protocol("not a tierkv raft port".into()));
            }
            let mut nonces = [0u8; 32];
            nonces[..16].copy_from_slice(&cn);
            nonces[16..].copy_from_slice(&reply[8..]);
            Ok(Conn { stream, secret: auth.secret.clone(), nonces, dir: 0, sent: 0, received: 0 })
        };
        tokio::time::timeout(CONNECT_TIMEOUT, fut).await.map_err(|_| WireError::Timeout)?
    }

    /// Accept the handshake of a client on `stream` (TLS first if `auth` has it), within 5 s.
    pub async fn accept(stream: TcpStream, auth: &Auth) -> Result<Conn, WireError> {
        stream.set_nodelay(true)?;
        tokio::time::timeout(Duration::from_secs(5), Conn::accept_inner(stream, auth))
            .await
            .map_err(|_| WireError::Timeout)?
    }

    async fn accept_inner(tcp: TcpStream, auth: &Auth) -> Result<Conn, WireError> {
        let mut stream = match &auth.tls {
            None => Stream::Plain(tcp),
            Some(tls) => {
                let mut first = [0u8; 1];
                if tcp.peek(&mut first).await? == 0 {
                    return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                }
                if first[0] == MAGIC[0] {
                    // A plain client: read its hello (closing with unread data would reset
                    // the connection before our answer arrives), say why, close.
                    let mut tcp = tcp;
                    let mut hello = [0u8; 24];
                    tcp.read_exact(&mut hello).await?;
                    let mut reply = TLS_REQUIRED.to_vec();
                    reply.extend_from_slice(&[0u8; 16]);
                    tcp.write_all(&reply).await?;
                    let _ = tcp.shutdown().await;
                    return Err(WireError::Tls("a plain (non-TLS) client: this node's Raft port requires TLS".into()));
                }
                let s = tls.acceptor.accept(tcp).await.map_err(|e| WireError::Tls(format!("handshake failed: {e}")))?;
                Stream::Tls(Box::new(tokio_rustls::TlsStream::Server(s)))
            }
        };
        let mut hello = [0u8; 24];
        stream.read_exact(&mut hello).await?;
        if &hello[..8] != MAGIC {
            if auth.tls.is_none() && hello[0] == TLS_HANDSHAKE_RECORD {
                return Err(WireError::Tls(
                    "a TLS client: this node's Raft port is plain (it runs without --raft-tls-*)".into(),
                ));
            }
            return Err(WireError::Protocol("not a tierkv raft client".into()));
        }
        let sn = nonce();
        let mut reply = MAGIC.to_vec();
        reply.extend_from_slice(&sn);
        stream.write_all(&reply).await?;
        stream.flush().await?;
        let mut nonces = [0u8; 32];
        nonces[..16].copy_from_slice(&hello[8..]);
        nonces[16..].copy_from_slice(&sn);
        Ok(Conn { stream, secret: auth.secret.clone(), nonces, dir: 1, sent: 0, received: 0 })
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
        // TLS buffers records until flushed (a no-op on plain TCP).
        self.stream.flush().await?;
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
pub async fn call_once(addr: &str, auth: &Auth, req: &RpcRequest, ttl: Duration) -> Result<RpcReply, WireError> {
    let mut c = Conn::connect(addr, auth).await?;
    c.call(req, ttl).await
}

/// openraft's network factory over TCP (and TLS).
#[derive(Debug, Clone)]
pub struct TcpNetwork {
    auth: Auth,
    log: Arc<LogThrottle>,
}

impl TcpNetwork {
    /// Connections secured by `auth`.
    pub fn new(auth: Auth) -> TcpNetwork {
        TcpNetwork { auth, log: Arc::new(LogThrottle::default()) }
    }
}

/// The connection to one target.
#[derive(Debug)]
pub struct TcpClient {
    target: NodeId,
    addr: String,
    auth: Auth,
    conn: Option<Conn>,
    log: Arc<LogThrottle>,
}

impl RaftNetworkFactory<TypeConfig> for TcpNetwork {
    type Network = TcpClient;

    async fn new_client(&mut self, target: NodeId, node: &ClusterNode) -> TcpClient {
        TcpClient { target, addr: node.raft_addr.clone(), auth: self.auth.clone(), conn: None, log: self.log.clone() }
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
            match Conn::connect(&self.addr, &self.auth).await {
                Ok(c) => self.conn = Some(c),
                Err(e) => {
                    if matches!(e, WireError::Tls(_)) && self.log.allow(&self.addr) {
                        eprintln!("tierkv raft: cannot reach node {} at {}: {e}", self.target, self.addr);
                    }
                    return Err(RPCError::Unreachable(Unreachable::new(&e)));
                }
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

    /// Connect a client secured by `a` to a server secured by `b`; both sides' outcomes.
    async fn try_pair(a: &Auth, b: &Auth) -> (Result<Conn, WireError>, Result<Conn, WireError>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let b = b.clone();
        let server = tokio::spawn(async move {
            let (s, _) = l.accept().await.expect("accept");
            Conn::accept(s, &b).await
        });
        let c = Conn::connect(&addr, a).await;
        (c, server.await.expect("join"))
    }

    async fn pair(a: &Secret, b: &Secret) -> (Conn, Conn) {
        let (c, s) = try_pair(&a.clone().into(), &b.clone().into()).await;
        (c.expect("connect"), s.expect("handshake"))
    }

    /// A CA made for the test, signing node certificates (both EKUs, as the docs ask).
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

        /// (certificate PEM, key PEM) for `sans`.
        fn issue(&self, sans: &[&str]) -> (String, String) {
            let key = rcgen::KeyPair::generate().expect("key");
            let mut p =
                rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("params");
            p.extended_key_usages =
                vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
            let cert = p.signed_by(&key, &self.cert, &self.key).expect("sign");
            (cert.pem(), key.serialize_pem())
        }

        /// TLS with a certificate of this CA for `sans`, trusting `trust`.
        fn tls(&self, sans: &[&str], trust: &TestCa) -> Tls {
            let (c, k) = self.issue(sans);
            Tls::from_pem(c.as_bytes(), k.as_bytes(), trust.cert.pem().as_bytes()).expect("tls")
        }
    }

    fn tls_err(r: Result<Conn, WireError>) -> String {
        match r {
            Err(WireError::Tls(m)) => m,
            Err(e) => panic!("expected a TLS error, got {e}"),
            Ok(_) => panic!("expected a TLS error, got a connection"),
        }
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

    #[tokio::test]
    async fn tls_frames_round_trip_and_every_mismatch_is_refused() {
        let s = Secret::new(b"0123456789abcdef0123").expect("secret");
        let ca = TestCa::new("cluster CA");
        let tls = |sans: &[&str]| Auth::new(s.clone(), Some(ca.tls(sans, &ca)));
        let node = tls(&["127.0.0.1", "localhost"]);

        // Both sides TLS, one CA: the same frames as on plain TCP.
        let (c, srv) = try_pair(&tls(&["127.0.0.1"]), &node).await;
        let (mut c, mut srv) = (c.expect("connect"), srv.expect("accept"));
        assert!(matches!(c.stream, Stream::Tls(_)));
        c.send(&RpcRequest::Read(b"k".to_vec())).await.expect("send");
        assert!(matches!(srv.recv::<RpcRequest>().await, Ok(Some(RpcRequest::Read(k))) if k == b"k"));
        srv.send(&RpcReply::Value(Ok(Some(b"v".to_vec())))).await.expect("send");
        assert!(matches!(c.recv::<RpcReply>().await, Ok(Some(RpcReply::Value(Ok(Some(v))))) if v == b"v"));

        // The HMAC stays on inside TLS: a right certificate with the wrong secret is refused.
        let wrong = Auth::new(Secret::new(b"another secret of 16+ bytes").expect("secret"), node.tls.clone());
        let (c, srv) = try_pair(&wrong, &node).await;
        let (mut c, mut srv) = (c.expect("connect"), srv.expect("accept"));
        c.send(&RpcRequest::Status).await.expect("send");
        assert!(matches!(srv.recv::<RpcRequest>().await, Err(WireError::Protocol(m)) if m.contains("authentication")));

        // A plain client against a TLS node: both sides say why.
        let (c, srv) = try_pair(&s.clone().into(), &node).await;
        assert!(tls_err(c).contains("requires TLS"));
        assert!(tls_err(srv).contains("plain (non-TLS) client"));

        // A TLS client against a plain node.
        let (c, srv) = try_pair(&node, &s.clone().into()).await;
        assert!(tls_err(c).contains("handshake with"));
        assert!(tls_err(srv).contains("a TLS client"));

        // A certificate from another CA (its holder even trusts ours): the node refuses it.
        let other = TestCa::new("another CA");
        let rogue = Auth::new(s.clone(), Some(other.tls(&["127.0.0.1"], &ca)));
        let (c, srv) = try_pair(&rogue, &node).await;
        assert!(tls_err(c).contains("refused"));
        assert!(tls_err(srv).contains("handshake failed"));
        // And a node with such a certificate is not trusted as a server either.
        let rogue_server = Auth::new(s.clone(), Some(other.tls(&["127.0.0.1"], &other)));
        let (c, _) = try_pair(&node, &rogue_server).await;
        assert!(tls_err(c).contains("handshake with"));

        // The server's certificate must name the host that was dialled (127.0.0.1 here).
        let elsewhere = tls(&["10.1.2.3", "node7.example"]);
        let (c, _) = try_pair(&node, &elsewhere).await;
        assert!(tls_err(c).contains("handshake with"));
    }

    #[test]
    fn tls_settings_are_checked_when_loaded() {
        let ca = TestCa::new("cluster CA");
        let (cert, key) = ca.issue(&["127.0.0.1"]);
        let (_, other_key) = ca.issue(&["127.0.0.1"]);
        let ca_pem = ca.cert.pem();
        assert!(Tls::from_pem(cert.as_bytes(), key.as_bytes(), ca_pem.as_bytes()).is_ok());
        let e = Tls::from_pem(b"", key.as_bytes(), ca_pem.as_bytes()).expect_err("no certificate");
        assert!(e.contains("no certificate"), "{e}");
        assert!(Tls::from_pem(cert.as_bytes(), b"not a key", ca_pem.as_bytes()).is_err());
        let e = Tls::from_pem(cert.as_bytes(), key.as_bytes(), b"").expect_err("no CA");
        assert!(e.contains("CA: no certificate"), "{e}");
        // The key of another certificate.
        assert!(Tls::from_pem(cert.as_bytes(), other_key.as_bytes(), ca_pem.as_bytes()).is_err());
        let d = tempfile::tempdir().expect("tempdir");
        let e = Tls::from_files(&d.path().join("none.crt"), &d.path().join("k"), &d.path().join("ca"))
            .expect_err("missing file");
        assert!(e.starts_with("--raft-tls-cert-file"), "{e}");
        assert_eq!(server_name("[::1]:7000").ok(), ServerName::try_from("::1").ok());
        assert!(server_name("bad host:7000").is_err());
    }
}
