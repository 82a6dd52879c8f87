//! Replication for tierkv on Raft, with [openraft](https://docs.rs/openraft) as the consensus
//! library (issue 25).
//!
//! - [`log_store`]: the Raft log and the vote, durable in a tierkv store of their own
//!   (`<dir>/raft/log`), keys big-endian by index so iteration is log order.
//! - [`state_machine`]: the main tierkv store as the state machine; each committed entry is
//!   one atomic `WriteBatch` that also carries the applied log id and membership, so a crash
//!   never applies an entry twice or loses one; snapshots from `Db::snapshot()`.
//! - [`snapshot`]: the snapshot file (built from a point-in-time view, streamed to followers
//!   in chunks by openraft, installed crash-safely).
//! - [`network`]: the node-to-node transport: TCP, optionally mutual TLS 1.3 (one CA for
//!   the cluster), length-prefixed bincode frames authenticated with HMAC-SHA256 under a
//!   shared cluster secret (with or without TLS), timeouts, reconnects.
//! - [`node`]: one running node (store + Raft + transport), cluster bootstrap.
//! - [`resp`]: the bridge to `tierkv serve` (the server's `Replicator` on a [`node::RaftNode`]).
//! - [`codec`]: the persisted encodings (`docs/format/raft.md`).
//!
//! Choices:
//! - **openraft 0.9.25**, the newest *release* on crates.io (0.10 is still alpha:
//!   `0.10.0-alpha.37` at the time of writing, with an API that still changes between
//!   alphas). Its storage-v2 traits (`RaftLogStorage` + `RaftStateMachine`, feature
//!   `storage-v2`) separate the log from the state machine, which is what lets the log live in
//!   its own store; its storage test suite (`openraft::testing::Suite`) runs against ours.
//! - **Snapshot data is a file** (`tokio::fs::File`) rather than an in-memory buffer:
//!   openraft 0.9 streams `AsyncRead + AsyncSeek` snapshot data in chunks
//!   (`Config::snapshot_max_chunk_size`), so a snapshot of a large store never has to fit in
//!   memory on either side.
//! - **What is replicated**: a [`Request`] is a list of blind writes (`Put`/`Delete`), applied
//!   as one batch. Read-modify-write commands must be turned into blind writes by the leader
//!   on state nothing else can change before they commit (see
//!   `docs/design/replication.md`).
//! - **NodeId** is `u64` (the `--raft-id`), a node's record carries its Raft address and its
//!   RESP address (the `-MOVED` target).

// openraft's traits fix the error type (`StorageError`, ~224 bytes); helpers return it too
// rather than boxing and unboxing at every trait boundary.
#![allow(clippy::result_large_err)]

pub mod codec;
pub mod log_store;
pub mod network;
pub mod node;
pub mod resp;
pub mod snapshot;
pub mod state_machine;

use std::fmt;

use serde::{Deserialize, Serialize};

/// A node's id in the cluster (`--raft-id`).
pub type NodeId = u64;

/// One blind write of a replicated batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// Set `key` to `value`.
    Put {
        /// Key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
    },
    /// Remove `key`.
    Delete {
        /// Key.
        key: Vec<u8>,
    },
}

/// The application data of a Raft entry: writes applied as one atomic batch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// The writes, in order (a later op on the same key wins).
    pub ops: Vec<Op>,
}

/// The state machine's answer to an applied [`Request`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// The index of the entry that carried the request.
    pub index: u64,
}

/// What the cluster knows of a node: where to reach it.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClusterNode {
    /// `HOST:PORT` of its Raft transport.
    pub raft_addr: String,
    /// `HOST:PORT` of its RESP server (the target of `-MOVED`), empty if none.
    pub resp_addr: String,
}

impl fmt::Display for ClusterNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "raft={} resp={}", self.raft_addr, self.resp_addr)
    }
}

openraft::declare_raft_types!(
    /// The Raft type configuration of tierkv.
    pub TypeConfig:
        D = Request,
        R = Response,
        NodeId = NodeId,
        Node = ClusterNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = tokio::fs::File,
        AsyncRuntime = openraft::TokioRuntime,
        Responder = openraft::impls::OneshotResponder<TypeConfig>,
);

/// openraft's handle, for this crate's types.
pub type Raft = openraft::Raft<TypeConfig>;

/// Storage errors, for this crate's types.
pub type StorageError = openraft::StorageError<NodeId>;

/// Map any displayable error into a [`StorageError`] on the given subject.
pub(crate) fn io_err(kind: ErrKind, e: impl std::error::Error + 'static) -> StorageError {
    use openraft::StorageIOError as S;
    let any = openraft::AnyError::new(&e);
    match kind {
        ErrKind::ReadLogs => S::read_logs(any),
        ErrKind::WriteLogs => S::write_logs(any),
        ErrKind::ReadVote => S::read_vote(any),
        ErrKind::WriteVote => S::write_vote(any),
        ErrKind::ReadSm => S::read_state_machine(any),
        ErrKind::WriteSm => S::write_state_machine(any),
        ErrKind::ReadSnapshot => S::read_snapshot(None, any),
        ErrKind::WriteSnapshot => S::write_snapshot(None, any),
    }
    .into()
}

/// What failed, for [`io_err`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum ErrKind {
    ReadLogs,
    WriteLogs,
    ReadVote,
    WriteVote,
    ReadSm,
    WriteSm,
    ReadSnapshot,
    WriteSnapshot,
}
