//! The network loop: tokio, one task per connection.
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
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::cmd::{Keyspace, Session};
use crate::resp::{Parser, Reply};

/// How `tierkv serve` listens.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to bind (default 127.0.0.1).
    pub bind: String,
    /// Port (default 6379; 0 picks a free one).
    pub port: u16,
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
            port: 6379,
            threads: 0,
            timeout_secs: 0,
            max_clients: 10_000,
            limits: crate::resp::Limits::default(),
        }
    }
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
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
        let rt = b.enable_all().thread_name("tierkv-serve").build()?;
        let listener = rt.block_on(TcpListener::bind((cfg.bind.as_str(), cfg.port)))?;
        let addr = listener.local_addr()?;
        let (stop, stop_rx) = watch::channel(false);
        let ks = keyspace.clone();
        let cfg = cfg.clone();
        let thread = std::thread::Builder::new().name("tierkv-serve-main".into()).spawn(move || {
            rt.block_on(accept_loop(listener, ks, cfg, stop_rx));
            // Connections still open after the grace period are dropped with the runtime.
            rt.shutdown_timeout(Duration::from_secs(1));
        })?;
        Ok(Server { addr, stop, thread: Some(thread), keyspace })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
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

async fn accept_loop(listener: TcpListener, ks: Arc<Keyspace>, cfg: ServerConfig, mut stop: watch::Receiver<bool>) {
    let ids = AtomicU64::new(1);
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.changed() => break,
        };
        while tasks.try_join_next().is_some() {}
        let (sock, _) = match accepted {
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
        tasks.spawn(async move {
            let _ = connection(&ks, sock, id, &cfg, stop).await;
            ks.counters.connected.fetch_sub(1, Ordering::Relaxed);
        });
    }
    drop(listener);
    // Graceful: connections see the stop signal at their next read.
    let _ = tokio::time::timeout(Duration::from_secs(5), async { while tasks.join_next().await.is_some() {} }).await;
}

async fn connection(
    ks: &Keyspace,
    mut sock: TcpStream,
    id: u64,
    cfg: &ServerConfig,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    sock.set_nodelay(true)?;
    let mut buf = BytesMut::with_capacity(16 << 10);
    let mut out = Vec::with_capacity(16 << 10);
    let mut parser = Parser::new();
    let mut session = Session { id, ..Session::default() };
    let idle = (cfg.timeout_secs > 0).then(|| Duration::from_secs(cfg.timeout_secs));
    loop {
        loop {
            match parser.next(&mut buf, &cfg.limits) {
                Ok(Some(cmd)) => {
                    ks.exec(&mut session, &cmd).encode(&mut out);
                    if session.quit {
                        sock.write_all(&out).await?;
                        return Ok(());
                    }
                    if out.len() >= 1 << 20 {
                        sock.write_all(&out).await?;
                        out.clear();
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    Reply::err(e.0).encode(&mut out);
                    sock.write_all(&out).await?;
                    return Ok(());
                }
            }
        }
        if !out.is_empty() {
            sock.write_all(&out).await?;
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
