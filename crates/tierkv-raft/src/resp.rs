//! The bridge between `tierkv serve` and a [`RaftNode`]: the server's
//! [`tierkv_server::replica::Replicator`] on openraft.
//!
//! The server runs commands synchronously on its own runtime's threads; each call here
//! hands the async work to the Raft runtime (a separate tokio runtime, so a server thread
//! waiting for a commit never blocks Raft's own tasks) and waits on a channel for the
//! answer. A server thread therefore holds one write in flight: `tierkv serve` in replicated
//! mode runs more server threads (see the CLI) so that many clients' writes are in flight at
//! once and openraft batches them into its AppendEntries.

use std::sync::Arc;

use tierkv::{BatchOp, WriteBatch};
use tierkv_server::replica::{Refusal, Replicator};

use crate::network::Refused;
use crate::node::RaftNode;
use crate::{Op, Request};

/// [`Replicator`] on a [`RaftNode`].
#[derive(Debug, Clone)]
pub struct RaftReplicator {
    node: Arc<RaftNode>,
    rt: tokio::runtime::Handle,
}

impl RaftReplicator {
    /// Serve `node`, whose tasks run on `rt`.
    pub fn new(node: Arc<RaftNode>, rt: tokio::runtime::Handle) -> RaftReplicator {
        RaftReplicator { node, rt }
    }

    fn block<T: Send + 'static>(
        &self,
        f: impl std::future::Future<Output = Result<T, Refusal>> + Send + 'static,
    ) -> Result<T, Refusal> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.rt.spawn(async move {
            let _ = tx.send(f.await);
        });
        rx.recv().map_err(|_| Refusal::Failed("the raft runtime stopped".into()))?
    }
}

/// The server's refusal for `r`, with the leader's RESP address when known.
async fn refusal(node: &RaftNode, r: Refused) -> Refusal {
    match r {
        Refused::NotLeader(_) => {
            let addr = node.leader().await.map(|(_, n)| n.resp_addr).filter(|a| !a.is_empty());
            Refusal::NotLeader(addr)
        }
        Refused::Failed(m) => Refusal::Failed(m),
    }
}

impl Replicator for RaftReplicator {
    fn replicate(&self, batch: WriteBatch) -> Result<(), Refusal> {
        let ops = batch
            .ops()
            .iter()
            .map(|op| match op {
                BatchOp::Put { key, value } => Op::Put { key: key.clone(), value: value.clone() },
                BatchOp::Delete { key } => Op::Delete { key: key.clone() },
            })
            .collect();
        let node = self.node.clone();
        self.block(async move {
            match node.write(Request { ops }).await {
                Ok(_) => Ok(()),
                Err(e) => Err(refusal(&node, e).await),
            }
        })
    }

    fn barrier(&self) -> Result<u64, Refusal> {
        let node = self.node.clone();
        self.block(async move {
            // The term is the one this node led before and after the barrier: read only
            // after it, a term this node won again meanwhile would label state the barrier
            // did not cover (the new term's first entry may not be applied yet).
            let before = node.leader_term();
            match node.linearizable_barrier().await {
                Ok(()) => match (before, node.leader_term()) {
                    (Some(a), Some(b)) if a == b => Ok(a),
                    _ => Err(Refusal::Failed("leadership changed during the read-index barrier".into())),
                },
                Err(e) => Err(refusal(&node, e).await),
            }
        })
    }

    fn is_leader(&self) -> bool {
        self.node.leader_term().is_some()
    }

    fn leader_term(&self) -> Option<u64> {
        self.node.leader_term()
    }

    fn applied_index(&self) -> u64 {
        self.node.status().applied_index.unwrap_or(0)
    }

    fn shutdown(&self) {
        let node = self.node.clone();
        let _ = self.block(async move {
            node.shutdown().await;
            Ok(())
        });
    }
}
