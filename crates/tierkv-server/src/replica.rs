//! The server's side of replication (issue 25; the consensus itself is `crates/tierkv-raft`):
//! what a replicated `tierkv serve` does differently, behind the [`Replicator`] trait.
//!
//! - **Writes** go through consensus: [`Keyspace::write_batch`] hands each command's batch
//!   (a transaction's, a script's, FLUSHDB's chunks, the expiry sweep's) to
//!   [`Replicator::replicate`], which returns once the batch is committed and applied to the
//!   local store, and only then are the DRAM directories updated. The command still holds
//!   the stripe locks of every key it read, and the leader's store is the applied state, so
//!   the batch is what the command would have written on one node and every replica applies
//!   the same bytes (`docs/design/replication.md`).
//! - **The gate** ([`Keyspace::replica_gate`]) runs before every command but the
//!   connection-local ones: a read-index barrier (the node is the leader and has applied
//!   everything committed before the command), else `-MOVED <slot> <leader host:port>` (slot:
//!   CRC16 of the first key, or of its `{hash tag}`, mod 16384, as Redis Cluster computes it)
//!   so `redis-cli -c` and cluster-aware clients follow it, or `-CLUSTERDOWN` when no leader
//!   is known. A connection that sent `READONLY` reads a follower's store without a barrier
//!   (stale reads); its writes are still moved.
//! - **Writes skip the barrier** once the node leads the term its directories were loaded
//!   in (the first command of a term, whatever it is, takes the barrier and loads them): a
//!   write is acknowledged only after it commits, so it needs no read-index of its own; the
//!   state it reads first (types, old values of INCR or SET GET, WATCH versions) is current
//!   on the leader, because every write this leader acknowledged was applied here before its
//!   acknowledgment and the command holds the stripe locks of the keys it reads across its
//!   replication; and a node that was deposed without knowing it cannot commit the write,
//!   so its client gets an error, never a result computed from stale state. A write
//!   command that ends up replicating nothing (SET NX on an existing key, DEL of missing
//!   keys, WATCH, an EXEC or script that only read) has no commit to fence it, so it takes
//!   the barrier after it ran, before its reply ([`Keyspace::confirm_unreplicated`]). The barrier
//!   per command was a quorum round trip on top of the write's own: SET with 50 clients
//!   over RESP (`scripts/bench-raft.sh`) went from 7.5k to 25k ops/s with it gone.
//! - **Directories** (the types and expiry indexes in DRAM) are maintained by commands only on
//!   the leader; entries a node applied as a follower bypass them. So they are reloaded from
//!   the store when a node starts leading in a new term (after the barrier, so every entry
//!   of earlier terms is applied), after a replication failure (the batch may still commit),
//!   and before a stale read when the node has applied entries since the last load.
//! - **Expiry**: the sweep runs on the leader only; its deletions replicate like any write.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tierkv::WriteBatch;

use crate::cmd::{Keyspace, Session, COMMANDS};
use crate::resp::Reply;

thread_local! {
    /// Batches this thread handed to consensus (a command runs on one thread from the gate
    /// to its reply, so the difference across a command is what that command replicated).
    static REPLICATED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Batches the calling thread has handed to consensus so far.
pub(crate) fn replications_here() -> u64 {
    REPLICATED.with(|c| c.get())
}

/// Why a replicated operation was not done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// This node is not the leader; the leader's RESP address (`HOST:PORT`), when known.
    NotLeader(Option<String>),
    /// Anything else (no quorum, shutting down, a storage error).
    Failed(String),
}

/// Consensus, as the server sees it. Implemented by `tierkv_raft::resp::RaftReplicator`.
/// Calls block the calling thread until done.
pub trait Replicator: Send + Sync + std::fmt::Debug {
    /// Commit `batch` through consensus and apply it to the local store.
    fn replicate(&self, batch: WriteBatch) -> Result<(), Refusal>;
    /// Read-index barrier; returns the leader's current term.
    fn barrier(&self) -> Result<u64, Refusal>;
    /// Whether this node currently leads.
    fn is_leader(&self) -> bool;
    /// The current term, when this node leads it (as far as this node knows).
    fn leader_term(&self) -> Option<u64>;
    /// Index of the last entry the local store has applied.
    fn applied_index(&self) -> u64;
    /// Stop consensus: called after the server stopped, before the store is closed.
    fn shutdown(&self) {}
}

/// A keyspace's replication state.
#[derive(Debug)]
pub(crate) struct Replica {
    pub(crate) r: Arc<dyn Replicator>,
    /// (term, applied index) the directories were loaded for; term 0: reload needed.
    loaded: Mutex<(u64, u64)>,
}

impl Replica {
    pub(crate) fn new(r: Arc<dyn Replicator>) -> Replica {
        Replica { r, loaded: Mutex::new((0, 0)) }
    }
}

/// CRC16-CCITT (XMODEM), Redis Cluster's key hash.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc
}

/// Redis Cluster's hash slot of `key`: CRC16 of the key, or of the part between the first
/// `{` and the next `}` when that part is not empty, mod 16384.
pub fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&c| c == b'{').and_then(|s| {
        let rest = &key[s + 1..];
        rest.iter().position(|&c| c == b'}').filter(|&e| e > 0).map(|e| &rest[..e])
    });
    crc16(tagged.unwrap_or(key)) % 16384
}

/// Commands that only touch the connection or the server's own state: never gated.
fn local_command(cname: &str) -> bool {
    matches!(
        cname,
        "ping"
            | "echo"
            | "quit"
            | "select"
            | "command"
            | "info"
            | "config"
            | "client"
            | "hello"
            | "auth"
            | "readonly"
            | "readwrite"
            | "multi"
            | "discard"
            | "watch"
            | "unwatch"
    )
}

fn refusal_reply(slot: u16, r: Refusal) -> Reply {
    match r {
        Refusal::NotLeader(Some(addr)) if !addr.is_empty() => Reply::Error(format!("MOVED {slot} {addr}")),
        Refusal::NotLeader(_) => Reply::Error("CLUSTERDOWN The cluster is down (no leader elected)".into()),
        Refusal::Failed(m) => Reply::Error(format!("TRYAGAIN {m}")),
    }
}

impl Keyspace {
    /// Serve replicated: writes through `r` (see the module docs). Call before serving.
    pub fn with_replicator(mut self, r: Arc<dyn Replicator>) -> Keyspace {
        self.replica = Some(Replica::new(r));
        self
    }

    /// READONLY / READWRITE.
    pub(crate) fn readonly_cmd(&self, s: &mut Session, cname: &str) -> Result<Reply, Reply> {
        if self.replica.is_none() {
            return Err(Reply::err("This instance has cluster support disabled"));
        }
        s.readonly = cname == "readonly";
        Ok(Reply::Ok)
    }

    /// The gate before a command on a replicated server; `Ok(None)` on a plain one.
    /// `Ok(Some(slot))`: a write let through without the barrier; the caller runs
    /// [`Keyspace::confirm_unreplicated`] after it.
    pub(crate) fn replica_gate(&self, s: &Session, cname: &str, args: &[Bytes]) -> Result<Option<u16>, Reply> {
        let Some(rep) = &self.replica else { return Ok(None) };
        if local_command(cname) {
            return Ok(None);
        }
        let spec = COMMANDS.iter().find(|c| c.0 == cname);
        // `args` excludes the command name: key position `i` (COMMAND INFO's) is `args[i - 1]`.
        let first_key = spec.and_then(|c| usize::try_from(c.3).ok()).filter(|&i| i > 0).and_then(|i| args.get(i - 1));
        let slot = first_key.map_or(0, |k| key_slot(k));
        let read_only = spec.is_some_and(|c| c.2.contains(&"readonly"));
        if s.readonly && read_only {
            let applied = rep.r.applied_index();
            let stale = rep.loaded.lock().1 != applied;
            if stale {
                self.reload_directories(rep, 0, applied)?;
            }
            return Ok(None);
        }
        if !read_only && rep.r.leader_term().is_some_and(|t| t == rep.loaded.lock().0) {
            // A write on the leader of the term whose directories are loaded: no barrier
            // (see "Writes skip the barrier" in the module docs).
            return Ok(Some(slot));
        }
        let term = rep.r.barrier().map_err(|e| refusal_reply(slot, e))?;
        let loaded_term = rep.loaded.lock().0;
        if loaded_term != term {
            self.reload_directories(rep, term, rep.r.applied_index())?;
        }
        Ok(None)
    }

    /// After a write command the gate let through without the barrier: if it replicated
    /// nothing (SET NX on an existing key, DEL of missing keys, WATCH, an EXEC or script
    /// that only read), its reply rests on what it read alone, with no commit to prove this
    /// node still led — so take the barrier now, as a read would, and refuse the reply if
    /// leadership moved (the command changed nothing, so the client may retry elsewhere).
    /// Called with no lock held. `replicated_before` is [`replications_here`] before the
    /// command.
    pub(crate) fn confirm_unreplicated(&self, slot: u16, replicated_before: u64) -> Result<(), Reply> {
        let Some(rep) = &self.replica else { return Ok(()) };
        if replications_here() != replicated_before {
            return Ok(());
        }
        let term = rep.r.barrier().map_err(|e| refusal_reply(slot, e))?;
        let mut loaded = rep.loaded.lock();
        if loaded.0 != term {
            // Another term began since the command read: its reads may predate entries of
            // that term. The next command reloads the directories.
            loaded.0 = 0;
            return Err(Reply::Error("TRYAGAIN leadership changed while the command ran".into()));
        }
        Ok(())
    }

    fn reload_directories(&self, rep: &Replica, term: u64, applied: u64) -> Result<(), Reply> {
        let _g = self.global.write();
        let (types, expires) = Keyspace::load_directories(self.db()).map_err(Reply::err)?;
        *self.types.write() = types;
        *self.expires.write() = expires;
        for e in self.watches.lock().values_mut() {
            e.0 += 1;
        }
        *rep.loaded.lock() = (term, applied);
        Ok(())
    }

    /// Write a batch: through consensus on a replicated server, else to the store.
    pub(crate) fn write_batch(&self, b: WriteBatch) -> Result<(), Reply> {
        let Some(rep) = &self.replica else { return self.db().write(b).map_err(Reply::err) };
        REPLICATED.with(|c| c.set(c.get() + 1));
        match rep.r.replicate(b) {
            Ok(()) => Ok(()),
            Err(e) => {
                // The batch may still commit: the directories must be reloaded before the
                // next command trusts them.
                rep.loaded.lock().0 = 0;
                Err(refusal_reply(0, e))
            }
        }
    }

    /// Whether this server may run the expiry sweep (plain servers and leaders).
    pub(crate) fn may_sweep(&self) -> bool {
        self.replica.as_ref().is_none_or(|rep| rep.r.is_leader())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    /// A one-node "cluster" that applies batches to the store itself and can be deposed
    /// without noticing (its `leader_term` keeps saying it leads, as a partitioned leader's
    /// does until its lease runs out).
    #[derive(Debug)]
    struct FakeRaft {
        db: Arc<tierkv::Db>,
        deposed: AtomicBool,
        barriers: AtomicU64,
    }

    impl Replicator for FakeRaft {
        fn replicate(&self, batch: WriteBatch) -> Result<(), Refusal> {
            if self.deposed.load(Ordering::SeqCst) {
                return Err(Refusal::NotLeader(Some("10.0.0.2:6379".into())));
            }
            self.db.write(batch).map_err(|e| Refusal::Failed(e.to_string()))
        }
        fn barrier(&self) -> Result<u64, Refusal> {
            self.barriers.fetch_add(1, Ordering::SeqCst);
            if self.deposed.load(Ordering::SeqCst) {
                return Err(Refusal::NotLeader(Some("10.0.0.2:6379".into())));
            }
            Ok(1)
        }
        fn is_leader(&self) -> bool {
            true
        }
        fn leader_term(&self) -> Option<u64> {
            Some(1)
        }
        fn applied_index(&self) -> u64 {
            0
        }
    }

    fn cmd(ks: &Keyspace, s: &mut Session, args: &[&str]) -> Reply {
        let a: Vec<Bytes> = args.iter().map(|x| Bytes::copy_from_slice(x.as_bytes())).collect();
        ks.exec(s, &a)
    }

    #[test]
    fn writes_skip_the_barrier_but_a_write_that_replicated_nothing_takes_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(tierkv::Db::open(dir.path(), tierkv::Options::new()).unwrap());
        let raft = Arc::new(FakeRaft { db: db.clone(), deposed: AtomicBool::new(false), barriers: AtomicU64::new(0) });
        let ks = Keyspace::new(db.clone(), crate::Settings::default()).unwrap().with_replicator(raft.clone());
        let mut s = ks.session(1, None);
        // The first command of the term takes the barrier (and loads the directories).
        assert_eq!(cmd(&ks, &mut s, &["SET", "k", "v1"]), Reply::Ok);
        assert_eq!(raft.barriers.load(Ordering::SeqCst), 1);
        // A write that replicates takes none; a read takes one; a write that replicated
        // nothing takes one after it ran.
        assert_eq!(cmd(&ks, &mut s, &["SET", "k", "v2"]), Reply::Ok);
        assert_eq!(raft.barriers.load(Ordering::SeqCst), 1);
        assert_eq!(cmd(&ks, &mut s, &["GET", "k"]), Reply::Bulk(b"v2".to_vec()));
        assert_eq!(raft.barriers.load(Ordering::SeqCst), 2);
        assert_eq!(cmd(&ks, &mut s, &["SET", "k", "v3", "NX"]), Reply::Nil);
        assert_eq!(raft.barriers.load(Ordering::SeqCst), 3);
        // Deposed without knowing it: a write fails at replication; a write that would
        // replicate nothing — its answer drawn from this node's possibly stale store — is
        // refused too instead of answering from it.
        raft.deposed.store(true, Ordering::SeqCst);
        let moved = Reply::Error(format!("MOVED {} 10.0.0.2:6379", key_slot(b"k")));
        assert_eq!(cmd(&ks, &mut s, &["SET", "k", "v4", "NX"]), moved);
        assert_eq!(
            cmd(&ks, &mut s, &["DEL", "missing"]),
            Reply::Error(format!("MOVED {} 10.0.0.2:6379", key_slot(b"missing")))
        );
        assert!(matches!(cmd(&ks, &mut s, &["SET", "k", "v5"]), Reply::Error(e) if e.starts_with("MOVED")));
        assert_eq!(db.get(b"k").unwrap().as_deref(), Some(&b"v2"[..]));
    }

    #[test]
    fn slots_match_redis_cluster() {
        // CRC16/XMODEM check value, and slots redis-cli's CLUSTER KEYSLOT reports.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"), "an empty tag hashes the whole key");
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
    }
}
