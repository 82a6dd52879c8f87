//! The Raft log and vote, durable in a tierkv store of their own (`<dir>/raft/log`).
//!
//! Keys (`docs/format/raft.md`): `"e" | index u64 BE` for each entry, so the store's key
//! order is log order and the first/last entries are one seek away; `"mvote"` for the vote;
//! `"mpurged"` for the last purged log id. Values are the [`crate::codec`] records.
//!
//! Every call writes synchronously before it returns and acknowledges (tierkv's `write` is
//! durable on return, against a process crash; with `pm_sync` also against power loss), so
//! writes are serialised in call order as openraft requires, a vote is durable before it is
//! acknowledged, and an append's flush callback is called after its batch is written.
//! Purge and truncate are each one atomic batch: a purge deletes the entries and records the
//! purged id together, so a crash leaves no hole at the front of the log.
//!
//! A separate store (rather than a key range of the state machine's store) keeps the log's
//! append-and-trim traffic out of the user data's index, and lets a snapshot of the user data
//! be taken without filtering log keys out of it.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{Entry, LogId, LogState, OptionalSend, RaftLogReader, Vote};
use tierkv::{Db, IterOptions, Options, WriteBatch};

use crate::codec::{self, log_key, log_key_index, PURGED_KEY, VOTE_KEY};
use crate::{io_err, ErrKind, NodeId, StorageError, TypeConfig};

/// The log store; clones share the store (the clone is openraft's log reader).
#[derive(Debug, Clone)]
pub struct LogStore {
    db: Arc<Db>,
}

impl LogStore {
    /// Open (or create) the log store in `dir`.
    pub fn open(dir: impl AsRef<Path>, opts: Options) -> tierkv::Result<LogStore> {
        Ok(LogStore { db: Arc::new(Db::open(dir, opts)?) })
    }

    /// The underlying store.
    pub fn db(&self) -> &Arc<Db> {
        &self.db
    }

    fn last_purged(&self) -> Result<Option<LogId<NodeId>>, StorageError> {
        match self.db.get(PURGED_KEY).map_err(|e| io_err(ErrKind::ReadLogs, e))? {
            None => Ok(None),
            Some(b) => Ok(Some(codec::decode_log_id(&b).map_err(|e| io_err(ErrKind::ReadLogs, e))?)),
        }
    }

    /// The entry with the largest index, if any.
    fn last_entry(&self) -> Result<Option<Entry<TypeConfig>>, StorageError> {
        let mut it = self.db.iter_with(&IterOptions::prefix(b"e")).map_err(|e| io_err(ErrKind::ReadLogs, e))?;
        it.seek_to_last();
        match it.prev_ref().map_err(|e| io_err(ErrKind::ReadLogs, e))? {
            None => Ok(None),
            Some((_, v)) => Ok(Some(codec::decode_entry(v).map_err(|e| io_err(ErrKind::ReadLogs, e))?)),
        }
    }

    /// Indices in `[from, to)` present in the log, in order.
    fn keys_in(&self, from: u64, to: Bound<u64>) -> Result<Vec<Vec<u8>>, StorageError> {
        let upper = match to {
            Bound::Excluded(t) => Bound::Excluded(log_key(t).to_vec()),
            Bound::Included(t) => Bound::Included(log_key(t).to_vec()),
            Bound::Unbounded => Bound::Unbounded,
        };
        let opts = IterOptions { lower: Bound::Included(log_key(from).to_vec()), upper, prefix: Some(b"e".to_vec()) };
        let mut it = self.db.iter_with(&opts).map_err(|e| io_err(ErrKind::ReadLogs, e))?;
        let mut keys = Vec::new();
        while let Some((k, _)) = it.next_ref().map_err(|e| io_err(ErrKind::ReadLogs, e))? {
            keys.push(k.to_vec());
        }
        Ok(keys)
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError> {
        let from = match range.start_bound() {
            Bound::Included(s) => *s,
            Bound::Excluded(s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let upper = match range.end_bound() {
            Bound::Included(e) => Bound::Included(log_key(*e).to_vec()),
            Bound::Excluded(e) => Bound::Excluded(log_key(*e).to_vec()),
            Bound::Unbounded => Bound::Unbounded,
        };
        let opts = IterOptions { lower: Bound::Included(log_key(from).to_vec()), upper, prefix: Some(b"e".to_vec()) };
        let mut it = self.db.iter_with(&opts).map_err(|e| io_err(ErrKind::ReadLogs, e))?;
        let mut out = Vec::new();
        while let Some((k, v)) = it.next_ref().map_err(|e| io_err(ErrKind::ReadLogs, e))? {
            let e = codec::decode_entry(v).map_err(|e| io_err(ErrKind::ReadLogs, e))?;
            if log_key_index(k) != Some(e.log_id.index) {
                let msg = format!("log entry {} stored under another index", e.log_id.index);
                return Err(io_err(ErrKind::ReadLogs, codec::DecodeError(msg)));
            }
            out.push(e);
        }
        Ok(out)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id = self.last_purged()?;
        let last = self.last_entry()?.map(|e| e.log_id);
        Ok(LogState { last_purged_log_id, last_log_id: last.or(last_purged_log_id) })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.db.put(VOTE_KEY, codec::encode_vote(vote)).map_err(|e| io_err(ErrKind::WriteVote, e))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        match self.db.get(VOTE_KEY).map_err(|e| io_err(ErrKind::ReadVote, e))? {
            None => Ok(None),
            Some(b) => Ok(Some(codec::decode_vote(&b).map_err(|e| io_err(ErrKind::ReadVote, e))?)),
        }
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut batch = WriteBatch::new();
        for e in entries {
            batch.put(log_key(e.log_id.index), codec::encode_entry(&e));
        }
        match self.db.write(batch) {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(io_err(ErrKind::WriteLogs, e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        let mut batch = WriteBatch::new();
        for k in self.keys_in(log_id.index, Bound::Unbounded)? {
            batch.delete(k);
        }
        self.db.write(batch).map_err(|e| io_err(ErrKind::WriteLogs, e))
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        let mut batch = WriteBatch::new();
        for k in self.keys_in(0, Bound::Included(log_id.index))? {
            batch.delete(k);
        }
        batch.put(PURGED_KEY, codec::encode_log_id(&log_id));
        self.db.write(batch).map_err(|e| io_err(ErrKind::WriteLogs, e))
    }
}
