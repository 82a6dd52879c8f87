//! `tierkv serve`: tierkv behind the Redis protocol (RESP2), so redis-cli, redis-benchmark,
//! YCSB's Redis binding and any Redis client library drive it unchanged.
//!
//! - [`resp`]: the request parser (multibulk and inline, Redis's limits and error messages)
//!   and reply encoding.
//! - [`keys`]: how strings, hashes and sorted sets map onto tierkv's ordered key space
//!   (plain string keys stay plain: the library API reads them directly).
//! - [`cmd`]: the commands, atomic per command, replying only once durable.
//! - [`net`]: the tokio server (pipelining, many connections, idle timeout, graceful stop).
//!
//! What is deliberately not Redis: no key expiry (SET EX/PX are refused), one database
//! (SELECT 0 only), no transactions, pub/sub, scripting or replication, CONFIG SET refused
//! (settings are command-line options), DBSIZE and INFO keyspace count by scanning (O(n), not
//! O(1)), SCAN cursors are server-side handles (the last 65,536 stay valid) rather than
//! stateless hash-table positions.

pub mod auth;
pub mod cmd;
pub mod collections;
pub mod glob;
pub mod keys;
pub mod multi;
pub mod net;
pub mod resp;
pub mod script;
pub mod strings;
pub mod tls;
pub mod txn;

pub use cmd::{Keyspace, Settings};
pub use net::{Server, ServerConfig};

use std::sync::Arc;

/// Serve `db` with `cfg` until SIGINT or SIGTERM, then stop the server and close the store
/// cleanly. `ready` is called with the bound address once the server accepts connections.
pub fn serve_until_signal(db: Arc<tierkv::Db>, cfg: &ServerConfig, ready: impl FnOnce(&Server)) -> Result<(), String> {
    let settings = Settings::from(cfg);
    // Handlers first: a SIGTERM that arrives as soon as `ready` has announced the server
    // must stop it cleanly, not kill the process with the default action.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let (mut term, mut int) = rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
        let int = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
        Ok::<_, String>((term, int))
    })?;
    let ks = Arc::new(Keyspace::new(db.clone(), settings).map_err(|e| e.to_string())?);
    let server = Server::start(ks, cfg).map_err(|e| format!("cannot listen on {}: {e}", cfg.bind))?;
    ready(&server);
    rt.block_on(async {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    });
    server.shutdown();
    db.close().map_err(|e| e.to_string())
}
