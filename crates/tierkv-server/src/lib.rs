//! `tierkv serve`: tierkv behind the Redis protocol, so redis-cli, redis-benchmark, YCSB's
//! Redis binding and stock client libraries (redis-py, go-redis, ... with their default
//! settings) drive it unchanged.
//!
//! - [`resp`]: the request parser (multibulk and inline, Redis's limits and error messages)
//!   and reply encoding in RESP2 and RESP3 (`HELLO 3`: maps, doubles, nulls, verbatim
//!   strings where Redis 7 sends them).
//! - [`keys`]: how strings, hashes and sorted sets map onto tierkv's ordered key space
//!   (plain string keys stay plain: the library API reads them directly; a key with an
//!   expiry carries its absolute expiry time in the same record as its value).
//! - [`txn`]: staged changes, one atomic durable `WriteBatch` per command, `EXEC` or script.
//! - [`cmd`]: dispatch and server commands; [`strings`] (with expiry), [`collections`],
//!   [`multi`] (MULTI/EXEC/WATCH), [`script`] (Lua: EVAL/EVALSHA/SCRIPT).
//! - [`auth`]: AUTH (password from a file or the environment, compared in constant time) and
//!   protected mode; [`tls`]: rustls, plain and TLS ports side by side.
//! - [`replica`]: a replicated server (`--raft-*`): writes through consensus, `-MOVED` on
//!   followers, read-index reads, `READONLY`.
//! - [`net`]: the tokio server (pipelining, many connections, idle timeout, graceful stop,
//!   the expiry sweep).
//!
//! Choices, where Redis leaves room or tierkv differs:
//! - tokio + tokio-rustls (the server was already async, one task per connection), rustls
//!   with the `ring` provider (no cmake/NASM needed to build, unlike aws-lc-rs), `subtle` for
//!   the constant-time comparison of SHA-256 digests of passwords, `mlua` (Lua 5.1 built from
//!   source) for scripts: redis-py's `Lock` releases and extends with EVALSHA.
//! - A transaction is stronger than Redis's: its writes are one atomic batch, so a crash
//!   never leaves part of one (Redis's AOF can, until redis-check-aof cuts it).
//! - Expiry: lazy on every read plus a background sweep (Redis also samples; tierkv walks
//!   its DRAM expiry index in time order, so every expired key is found in one pass).
//!
//! What is deliberately not Redis: one database (SELECT 0 only), no pub/sub (so RESP3 push
//! messages never occur), no Redis replication (tierkv replicates on Raft instead: [`replica`]), no ACL users but `default`, CONFIG SET refused
//! (settings are command-line options); FLUSHDB and EVAL are refused inside MULTI (each runs
//! under its own exclusive lock); scripts are aborted after 5 s instead of making the server
//! `-BUSY`. DBSIZE and INFO's keyspace line count by scanning (O(n)): a counter would need
//! every plain SET to read the key first (a plain SET reads nothing now), which on the LSM
//! presets can mean an SSTable probe per write. SCAN cursors are server-side handles (the
//! last 65,536 stay valid) rather than stateless hash-table positions.

pub mod auth;
pub mod cmd;
pub mod collections;
pub mod glob;
pub mod keys;
pub mod multi;
pub mod net;
pub mod replica;
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
    serve_with_until_signal(db, cfg, None, ready)
}

/// [`serve_until_signal`], replicated through `replicator` when given ([`replica`]).
pub fn serve_with_until_signal(
    db: Arc<tierkv::Db>,
    cfg: &ServerConfig,
    replicator: Option<Arc<dyn replica::Replicator>>,
    ready: impl FnOnce(&Server),
) -> Result<(), String> {
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
    let mut ks = Keyspace::new(db.clone(), settings).map_err(|e| e.to_string())?;
    if let Some(r) = &replicator {
        ks = ks.with_replicator(r.clone());
    }
    let ks = Arc::new(ks);
    let server = Server::start(ks, cfg).map_err(|e| format!("cannot listen on {}: {e}", cfg.bind))?;
    ready(&server);
    rt.block_on(async {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    });
    server.shutdown();
    if let Some(r) = &replicator {
        r.shutdown();
    }
    db.close().map_err(|e| e.to_string())
}
