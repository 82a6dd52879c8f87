//! The network loop: tokio, one task per connection, on a plain port, a TLS port, or both.
//!
//! Each connection reads into a buffer, parses every complete command in it (pipelining),
//! executes them in order and writes all their replies with one `write_all` before reading
//! again. Commands run inline on the runtime's worker threads: a command is a few
//! microseconds of tierkv work, and a write's reply must wait for its durability anyway, so
//! handing each one to a blocking pool would only add a thread switch. `--threads` sets the
//! worker count (default: one per CPU).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::auth::Password;
use crate::cmd::{Keyspace, Settings};
use crate::resp::{Parser, Reply};
use crate::tls::TlsConfig;

/// How `tierkv serve` listens.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to bind (default 127.0.0.1).
    pub bind: String,
    /// Plain port (default 6379; `Some(0)` picks a free one; `None`: no plain port).
    pub port: Option<u16>,
    /// TLS listener (`None`: none).
    pub tls: Option<TlsConfig>,
    /// The default user's password (`None`: none; see [`crate::auth`]).
    pub requirepass: Option<Password>,
    /// Protected mode (default on): with no password, only loopback clients are served.
    pub protected_mode: bool,
    /// Worker threads (0 = one per CPU).
    pub threads: usize,
    /// Close a connection idle this long (seconds; 0 = never), as Redis's `timeout`.
    pub timeout_secs: u64,
    /// Most simultaneous clients (Redis's `maxclients`, default 10,000); beyond it a new
    /// connection gets `-ERR max number of clients reached` and is closed.
    pub max_clients: usize,
    /// Request size limits.
    pub limits: crate::resp::Limits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            bind: "127.0.0.1".into(),
            port: Some(6379),
            tls: None,
            requirepass: None,
            protected_mode: true,
            threads: 0,
            timeout_secs: 0,
            max_clients: 10_000,
            limits: crate::resp::Limits::default(),
        }
    }
}

impl From<&ServerConfig> for Settings {
    fn from(cfg: &ServerConfig) -> Settings {
        Settings {
            port: cfg.port.unwrap_or(0),
            tls_port: cfg.tls.as_ref().map_or(0, |t| t.port),
            bind: cfg.bind.clone(),
            timeout_secs: cfg.timeout_secs,
            max_clients: cfg.max_clients,
            limits: cfg.limits,
            requirepass: cfg.requirepass.clone(),
            protected_mode: cfg.protected_mode,
        }
    }
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    addr: Option<SocketAddr>,
    tls_addr: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
    keyspace: Arc<Keyspace>,
}

/// Raise the soft open-file limit to the hard one (as Redis does for `maxclients`): a
/// thousand clients need more than the usual 1,024 descriptors.
pub fn raise_fd_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain system calls on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

impl Server {
    /// Bind and start serving `keyspace` on a thread of its own.
    pub fn start(keyspace: Arc<Keyspace>, cfg: &ServerConfig) -> std::io::Result<Server> {
        raise_fd_limit();
        let mut b = tokio::runtime::Builder::new_multi_thread();
        if cfg.threads > 0 {
            b.worker_threads(cfg.threads);
        }
        let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
        if cfg.port.is_none() && cfg.tls.is_none() {
            return Err(invalid("neither a plain port nor a TLS port to listen on".into()));
        }
        let acceptor = match &cfg.tls {
            Some(t) => Some(tokio_rustls::TlsAcceptor::from(t.server_config().map_err(invalid)?)),
            None => None,
        };
        let rt = b.enable_all().thread_name("tierkv-serve").build()?;
        let plain = match cfg.port {
            Some(p) => Some(rt.block_on(TcpListener::bind((cfg.bind.as_str(), p)))?),
            None => None,
        };
        let tls = match &cfg.tls {
            Some(t) => Some(rt.block_on(TcpListener::bind((cfg.bind.as_str(), t.port)))?),
            None => None,
        };
        let addr = plain.as_ref().map(TcpListener::local_addr).transpose()?;
        let tls_addr = tls.as_ref().map(TcpListener::local_addr).transpose()?;
        keyspace.set_ports(addr.map_or(0, |a| a.port()), tls_addr.map_or(0, |a| a.port()));
        let (stop, stop_rx) = watch::channel(false);
        let ks = keyspace.clone();
        let cfg = cfg.clone();
        let thread = std::thread::Builder::new().name("tierkv-serve-main".into()).spawn(move || {
            rt.spawn(sweeper(ks.clone(), stop_rx.clone()));
            rt.block_on(accept_loop(plain, tls.zip(acceptor), ks, cfg, stop_rx));
            // Connections still open after the grace period are dropped with the runtime.
            rt.shutdown_timeout(Duration::from_secs(1));
        })?;
        Ok(Server { addr, tls_addr, stop, thread: Some(thread), keyspace })
    }

    /// The plain port's address, or the TLS port's when there is no plain port.
    pub fn addr(&self) -> SocketAddr {
        match (self.addr, self.tls_addr) {
            (Some(a), _) | (None, Some(a)) => a,
            // `start` refuses a configuration without a listener.
            (None, None) => SocketAddr::from(([0, 0, 0, 0], 0)),
        }
    }

    /// The plain port's address.
    pub fn plain_addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// The TLS port's address.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_addr
    }

    /// The keyspace served.
    pub fn keyspace(&self) -> &Arc<Keyspace> {
        &self.keyspace
    }

    /// Stop accepting, let each connection finish the commands it has read (replies
    /// written), close them, and return once the server thread has ended.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// The expiry sweep: ten times a second, delete keys whose time has passed (up to 1,000 a
/// round, more rounds at once while a round fills up).
async fn sweeper(ks: Arc<Keyspace>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        loop {
            let n = ks.sweep(1000);
            if n < 1000 || *stop.borrow() {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
}

async fn accept_opt(l: &Option<TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match l {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

async fn accept_loop(
    plain: Option<TcpListener>,
    tls: Option<(TcpListener, tokio_rustls::TlsAcceptor)>,
    ks: Arc<Keyspace>,
    cfg: ServerConfig,
    mut stop: watch::Receiver<bool>,
) {
    let ids = AtomicU64::new(1);
    let mut tasks = tokio::task::JoinSet::new();
    let (tls_listener, acceptor) = match tls {
        Some((l, a)) => (Some(l), Some(a)),
        None => (None, None),
    };
    loop {
        let (accepted, is_tls) = tokio::select! {
            r = accept_opt(&plain) => (r, false),
            r = accept_opt(&tls_listener) => (r, true),
            _ = stop.changed() => break,
        };
        while tasks.try_join_next().is_some() {}
        let (sock, peer) = match accepted {
            Ok(x) => x,
            Err(_) => {
                // EMFILE and friends: back off briefly instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let c = &ks.counters;
        c.accepted.fetch_add(1, Ordering::Relaxed);
        if c.connected.load(Ordering::Relaxed) as usize >= cfg.max_clients {
            c.rejected.fetch_add(1, Ordering::Relaxed);
            tasks.spawn(async move {
                let mut sock = sock;
                let _ = sock.write_all(b"-ERR max number of clients reached\r\n").await;
            });
            continue;
        }
        c.connected.fetch_add(1, Ordering::Relaxed);
        let id = ids.fetch_add(1, Ordering::Relaxed);
        let (ks, cfg, stop) = (ks.clone(), cfg.clone(), stop.clone());
        let acceptor = if is_tls { acceptor.clone() } else { None };
        tasks.spawn(async move {
            let _ = sock.set_nodelay(true);
            let _ = match acceptor {
                Some(a) => match tokio::time::timeout(Duration::from_secs(10), a.accept(sock)).await {
                    Ok(Ok(s)) => connection(&ks, s, peer, id, &cfg, stop).await,
                    _ => Ok(()),
                },
                None => connection(&ks, sock, peer, id, &cfg, stop).await,
            };
            ks.counters.connected.fetch_sub(1, Ordering::Relaxed);
        });
    }
    drop(plain);
    drop(tls_listener);
    // Graceful: connections see the stop signal at their next read.
    let _ = tokio::time::timeout(Duration::from_secs(5), async { while tasks.join_next().await.is_some() {} }).await;
}

async fn connection<S: AsyncRead + AsyncWrite + Unpin>(
    ks: &Keyspace,
    mut sock: S,
    peer: SocketAddr,
    id: u64,
    cfg: &ServerConfig,
    stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    if crate::auth::denied(ks, &peer) {
        ks.counters.rejected.fetch_add(1, Ordering::Relaxed);
        let mut out = Vec::new();
        Reply::Error(crate::auth::DENIED.into()).encode(&mut out);
        sock.write_all(&out).await?;
        sock.flush().await?;
        let _ = sock.shutdown().await;
        return Ok(());
    }
    let mut session = ks.session(id, Some(peer));
    let r = serve_connection(ks, &mut sock, &mut session, cfg, stop).await;
    ks.unwatch_all(&mut session);
    r
}

async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin>(
    ks: &Keyspace,
    sock: &mut S,
    session: &mut crate::cmd::Session,
    cfg: &ServerConfig,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut buf = BytesMut::with_capacity(16 << 10);
    let mut out = Vec::with_capacity(16 << 10);
    let mut parser = Parser::new();
    let idle = (cfg.timeout_secs > 0).then(|| Duration::from_secs(cfg.timeout_secs));
    loop {
        loop {
            parser.set_authenticated(session.authed);
            match parser.next(&mut buf, &cfg.limits) {
                Ok(Some(cmd)) => {
                    let reply = ks.exec(session, &cmd);
                    reply.encode_proto(&mut out, session.proto);
                    if session.quit {
                        sock.write_all(&out).await?;
                        sock.flush().await?;
                        return Ok(());
                    }
                    if out.len() >= 1 << 20 {
                        sock.write_all(&out).await?;
                        out.clear();
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    Reply::err(e.0).encode_proto(&mut out, session.proto);
                    sock.write_all(&out).await?;
                    sock.flush().await?;
                    return Ok(());
                }
            }
        }
        if !out.is_empty() {
            sock.write_all(&out).await?;
            sock.flush().await?;
            out.clear();
            if out.capacity() > 1 << 20 {
                out = Vec::with_capacity(16 << 10);
            }
        }
        if *stop.borrow() {
            return Ok(());
        }
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(64 << 10);
        }
        let read = sock.read_buf(&mut buf);
        let n = tokio::select! {
            r = async {
                match idle {
                    Some(d) => tokio::time::timeout(d, read).await.unwrap_or(Ok(0)),
                    None => read.await,
                }
            } => r?,
            _ = stop.changed() => return Ok(()),
        };
        if n == 0 {
            return Ok(());
        }
    }
}
