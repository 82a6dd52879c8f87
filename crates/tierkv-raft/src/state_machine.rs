//! The state machine: the main tierkv store, which the RESP server reads.
//!
//! - **Apply**: all entries of one `apply` call become one `WriteBatch`: their writes, in log
//!   order (later ops on a key win), plus the applied-state record (last applied log id, last
//!   membership) under the reserved key `FF 72 'r' "applied"`. tierkv applies a batch
//!   atomically, so after a crash the store holds exactly the entries up to the recorded
//!   applied id: none is applied twice, none is lost (openraft re-applies from there).
//! - **Reserved keys**: `FF 'r' …` (`docs/format/raft.md`). The server keyspace never uses
//!   `FF 'r'` (a user string starting with `FF` is stored under `FF 's'`), so a replicated
//!   store stays readable by the server and the library API. Snapshots leave these keys out.
//! - **Snapshots** are built from `Db::snapshot()` (a consistent point-in-time view: the
//!   applied-state record is read from the same view as the data, so the snapshot's log id is
//!   exactly what it contains) into `<snap>/<id>.snap` ([`crate::snapshot`]), on a blocking
//!   thread, while writes continue.
//! - **Installing** a received snapshot: the stream is kept in an unnamed temporary file, then
//!   copied to `<id>.tmp`, verified end to end, `fsync`ed and renamed to `<id>.snap`; then a
//!   marker `FF 'r' "installing"` = id is written, the store's keys are replaced in batches, and
//!   the last batch writes the new applied state and removes the marker. A crash in between
//!   leaves the marker, and the next open redoes the install from the named file before Raft
//!   starts, so a half-installed store is never served as applied state.
//! - At most one `*.snap` is current: after a build or install the others are removed (under
//!   one lock, so a build finishing during an install never removes the file the install
//!   needs); if a crash left several, the one with the highest applied index is current.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use openraft::storage::RaftStateMachine;
use openraft::{
    Entry, EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder, Snapshot, SnapshotMeta, StoredMembership,
};
use std::sync::Mutex;
use tierkv::{Db, IterOptions, WriteBatch};

use crate::codec::{self, AppliedState};
use crate::snapshot::{self, SnapshotError, SnapshotReader, SnapshotWriter};
use crate::{io_err, ClusterNode, ErrKind, NodeId, Response, StorageError, TypeConfig};

/// Reserved key prefix of the replication metadata in the state machine's store.
pub const META_PREFIX: &[u8] = b"\xffr";
/// The applied-state record ([`codec::encode_applied`]).
pub const APPLIED_KEY: &[u8] = b"\xffrapplied";
/// Present (value: the snapshot id) while a snapshot is being installed.
pub const INSTALLING_KEY: &[u8] = b"\xffrinstalling";

/// Keys per batch when a snapshot replaces the store's contents.
const INSTALL_BATCH: usize = 4096;

/// The state machine; clones share the store and the snapshot directory.
#[derive(Debug, Clone)]
pub struct StateMachine {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    db: Arc<Db>,
    snap_dir: PathBuf,
    /// Serialises "put a snapshot file in place and remove the others" and installs.
    files: Mutex<()>,
    applied: Mutex<AppliedState>,
}

fn sm_err(kind: ErrKind, e: impl std::error::Error + 'static) -> StorageError {
    io_err(kind, e)
}

/// A message as an error.
#[derive(Debug)]
struct Msg(String);
impl std::fmt::Display for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Msg {}

impl StateMachine {
    /// Open the state machine on `db`, keeping snapshots in `snap_dir`. Finishes an install
    /// a crash interrupted.
    pub fn open(db: Arc<Db>, snap_dir: impl Into<PathBuf>) -> Result<StateMachine, StorageError> {
        let snap_dir = snap_dir.into();
        std::fs::create_dir_all(&snap_dir).map_err(|e| sm_err(ErrKind::ReadSnapshot, e))?;
        // Leftovers of a build or copy a crash interrupted.
        for e in std::fs::read_dir(&snap_dir).map_err(|e| sm_err(ErrKind::ReadSnapshot, e))? {
            let p = e.map_err(|e| sm_err(ErrKind::ReadSnapshot, e))?.path();
            if p.extension().is_some_and(|x| x == "tmp") {
                std::fs::remove_file(&p).map_err(|e| sm_err(ErrKind::WriteSnapshot, e))?;
            }
        }
        if let Some(id) = db.get(INSTALLING_KEY).map_err(|e| sm_err(ErrKind::ReadSm, e))? {
            let id = String::from_utf8(id).map_err(|_| sm_err(ErrKind::ReadSm, Msg("bad install marker".into())))?;
            let path = snap_dir.join(format!("{id}.snap"));
            load(&db, &path, &id).map_err(|e| sm_err(ErrKind::WriteSm, e))?;
        }
        let applied = read_applied(&db)?;
        Ok(StateMachine {
            inner: Arc::new(Inner { db, snap_dir, files: Mutex::new(()), applied: Mutex::new(applied) }),
        })
    }

    /// The store.
    pub fn db(&self) -> &Arc<Db> {
        &self.inner.db
    }

    /// The last applied state (as of the last `apply` or install).
    pub fn applied(&self) -> AppliedState {
        self.inner.applied.lock().map(|a| a.clone()).unwrap_or_default()
    }

    fn set_applied(&self, a: AppliedState) {
        if let Ok(mut g) = self.inner.applied.lock() {
            *g = a;
        }
    }
}

fn read_applied(db: &Db) -> Result<AppliedState, StorageError> {
    match db.get(APPLIED_KEY).map_err(|e| sm_err(ErrKind::ReadSm, e))? {
        None => Ok(AppliedState::default()),
        Some(b) => codec::decode_applied(&b).map_err(|e| sm_err(ErrKind::ReadSm, e)),
    }
}

/// The `*.snap` files in `dir` with their headers.
fn snapshot_files(dir: &Path) -> Result<Vec<(PathBuf, String, AppliedState)>, SnapshotError> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "snap") {
            let (_, id, applied) = SnapshotReader::open(&p)?;
            out.push((p, id, applied));
        }
    }
    Ok(out)
}

/// Remove every `*.snap` in `dir` but `keep`.
fn remove_others(dir: &Path, keep: &Path) -> Result<(), SnapshotError> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "snap") && p != keep {
            std::fs::remove_file(&p)?;
        }
    }
    Ok(())
}

/// Replace the store's contents (outside [`META_PREFIX`]) with the snapshot at `path`, whose
/// id must be `id`; the last batch records its applied state and removes the install marker.
fn load(db: &Db, path: &Path, id: &str) -> Result<AppliedState, SnapshotError> {
    let (found, applied, _) = snapshot::verify(path)?;
    if found != id {
        return Err(SnapshotError::Corrupt(format!("{} holds snapshot {found}, expected {id}", path.display())));
    }
    load_verified(db, path, &applied)?;
    Ok(applied)
}

/// [`load`] of a file already verified, whose applied state is `applied`.
fn load_verified(db: &Db, path: &Path, applied: &AppliedState) -> Result<(), SnapshotError> {
    let db_err = |e: tierkv::Error| SnapshotError::Io(std::io::Error::other(e.to_string()));
    // Delete everything, in chunks (no iterator is held across the writes).
    let mut from: Vec<u8> = Vec::new();
    loop {
        let keys = {
            let opts = IterOptions { lower: std::ops::Bound::Included(from.clone()), ..IterOptions::default() };
            let mut it = db.iter_with(&opts).map_err(db_err)?;
            let mut keys = Vec::new();
            while keys.len() < INSTALL_BATCH {
                match it.next_ref().map_err(db_err)? {
                    None => break,
                    Some((k, _)) => keys.push(k.to_vec()),
                }
            }
            keys
        };
        let Some(last) = keys.last() else { break };
        from = last.clone();
        from.push(0);
        let mut b = WriteBatch::new();
        for k in keys.iter().filter(|k| !k.starts_with(META_PREFIX)) {
            b.delete(k);
        }
        if !b.is_empty() {
            db.write(b).map_err(db_err)?;
        }
    }
    let (mut r, _, _) = SnapshotReader::open(path)?;
    let mut b = WriteBatch::new();
    while let Some((k, v)) = r.next_entry()? {
        if k.starts_with(META_PREFIX) {
            return Err(SnapshotError::Corrupt("snapshot holds a reserved key".into()));
        }
        b.put(k, v);
        if b.len() >= INSTALL_BATCH {
            db.write(std::mem::take(&mut b)).map_err(db_err)?;
        }
    }
    b.put(APPLIED_KEY, codec::encode_applied(applied));
    b.delete(INSTALLING_KEY);
    db.write(b).map_err(db_err)
}

fn meta_of(id: String, a: &AppliedState) -> SnapshotMeta<NodeId, ClusterNode> {
    SnapshotMeta { last_log_id: a.last_applied, last_membership: a.membership.clone(), snapshot_id: id }
}

/// Builds snapshots ([`RaftSnapshotBuilder`]).
#[derive(Debug)]
pub struct Builder {
    sm: StateMachine,
}

fn build(sm: &StateMachine) -> Result<(PathBuf, String, AppliedState), SnapshotError> {
    let db = &sm.inner.db;
    let db_err = |e: tierkv::Error| SnapshotError::Io(std::io::Error::other(e.to_string()));
    let view = db.snapshot().map_err(db_err)?;
    let applied = match view.get(APPLIED_KEY).map_err(db_err)? {
        None => AppliedState::default(),
        Some(b) => codec::decode_applied(&b)?,
    };
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let id = match applied.last_applied {
        Some(l) => format!("{}-{}-{}-{nanos:x}", l.leader_id.term, l.leader_id.node_id, l.index),
        None => format!("0-0-0-{nanos:x}"),
    };
    let tmp = sm.inner.snap_dir.join(format!("{id}.tmp"));
    let mut w = SnapshotWriter::new(std::fs::File::create(&tmp)?, &id, &applied)?;
    let mut it = view.iter().map_err(db_err)?;
    while let Some((k, v)) = it.next_ref().map_err(db_err)? {
        if !k.starts_with(META_PREFIX) {
            w.add(k, v)?;
        }
    }
    w.finish()?;
    drop(it);
    drop(view);
    let path = sm.inner.snap_dir.join(format!("{id}.snap"));
    let _g = sm.inner.files.lock().map_err(|_| SnapshotError::Corrupt("lock poisoned".into()))?;
    // An install that finished meanwhile may have put a newer snapshot in place: keep that.
    let newer = snapshot_files(&sm.inner.snap_dir)?
        .into_iter()
        .any(|(_, _, a)| a.last_applied.map(|l| l.index) > applied.last_applied.map(|l| l.index));
    if newer {
        std::fs::remove_file(&tmp)?;
        return Err(SnapshotError::Corrupt("a newer snapshot was installed meanwhile".into()));
    }
    std::fs::rename(&tmp, &path)?;
    snapshot::sync_dir(&sm.inner.snap_dir)?;
    remove_others(&sm.inner.snap_dir, &path)?;
    Ok((path, id, applied))
}

impl RaftSnapshotBuilder<TypeConfig> for Builder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let sm = self.sm.clone();
        let (path, id, applied) = tokio::task::spawn_blocking(move || build(&sm))
            .await
            .map_err(|e| sm_err(ErrKind::WriteSnapshot, Msg(e.to_string())))?
            .map_err(|e| sm_err(ErrKind::WriteSnapshot, e))?;
        let f = tokio::fs::File::open(&path).await.map_err(|e| sm_err(ErrKind::ReadSnapshot, e))?;
        Ok(Snapshot { meta: meta_of(id, &applied), snapshot: Box::new(f) })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = Builder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, ClusterNode>), StorageError> {
        let a = self.applied();
        Ok((a.last_applied, a.membership))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Response>, StorageError>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut applied = self.applied();
        let mut batch = WriteBatch::new();
        let mut out = Vec::new();
        for e in entries {
            match e.payload {
                EntryPayload::Blank => {}
                EntryPayload::Normal(req) => {
                    for op in req.ops {
                        match op {
                            crate::Op::Put { key, value } => batch.put(key, value),
                            crate::Op::Delete { key } => batch.delete(key),
                        };
                    }
                }
                EntryPayload::Membership(m) => applied.membership = StoredMembership::new(Some(e.log_id), m),
            }
            applied.last_applied = Some(e.log_id);
            out.push(Response { index: e.log_id.index });
        }
        if out.is_empty() {
            return Ok(out);
        }
        batch.put(APPLIED_KEY, codec::encode_applied(&applied));
        self.inner.db.write(batch).map_err(|e| sm_err(ErrKind::WriteSm, e))?;
        self.set_applied(applied);
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        Builder { sm: self.clone() }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<tokio::fs::File>, StorageError> {
        let f = tempfile::tempfile_in(&self.inner.snap_dir).map_err(|e| sm_err(ErrKind::WriteSnapshot, e))?;
        Ok(Box::new(tokio::fs::File::from_std(f)))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, ClusterNode>,
        snapshot: Box<tokio::fs::File>,
    ) -> Result<(), StorageError> {
        let mut src = snapshot.into_std().await;
        let sm = self.clone();
        let meta = meta.clone();
        let applied = tokio::task::spawn_blocking(move || -> Result<AppliedState, SnapshotError> {
            use std::io::{Seek, SeekFrom};
            let _g = sm.inner.files.lock().map_err(|_| SnapshotError::Corrupt("lock poisoned".into()))?;
            let id = meta.snapshot_id.clone();
            if id.contains(['/', '\\']) || id.starts_with('.') {
                return Err(SnapshotError::Corrupt(format!("bad snapshot id {id:?}")));
            }
            let tmp = sm.inner.snap_dir.join(format!("{id}.tmp"));
            let path = sm.inner.snap_dir.join(format!("{id}.snap"));
            src.seek(SeekFrom::Start(0))?;
            let mut dst = std::fs::File::create(&tmp)?;
            std::io::copy(&mut src, &mut dst)?;
            dst.sync_all()?;
            let (found, a, _) = snapshot::verify(&tmp)?;
            if found != id || a.last_applied != meta.last_log_id || a.membership != meta.last_membership {
                return Err(SnapshotError::Corrupt(format!("snapshot {found} does not match its metadata ({id})")));
            }
            std::fs::rename(&tmp, &path)?;
            snapshot::sync_dir(&sm.inner.snap_dir)?;
            let db_err = |e: tierkv::Error| SnapshotError::Io(std::io::Error::other(e.to_string()));
            sm.inner.db.put(INSTALLING_KEY, id.as_bytes()).map_err(db_err)?;
            load_verified(&sm.inner.db, &path, &a)?;
            remove_others(&sm.inner.snap_dir, &path)?;
            Ok(a)
        })
        .await
        .map_err(|e| sm_err(ErrKind::WriteSnapshot, Msg(e.to_string())))?
        .map_err(|e| sm_err(ErrKind::WriteSnapshot, e))?;
        self.set_applied(applied);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let dir = self.inner.snap_dir.clone();
        let files = {
            let _g = self.inner.files.lock().map_err(|_| sm_err(ErrKind::ReadSnapshot, Msg("lock poisoned".into())))?;
            snapshot_files(&dir).map_err(|e| sm_err(ErrKind::ReadSnapshot, e))?
        };
        let Some((path, id, applied)) = files.into_iter().max_by_key(|(_, _, a)| a.last_applied.map(|l| l.index))
        else {
            return Ok(None);
        };
        let f = tokio::fs::File::open(&path).await.map_err(|e| sm_err(ErrKind::ReadSnapshot, e))?;
        Ok(Some(Snapshot { meta: meta_of(id, &applied), snapshot: Box::new(f) }))
    }
}
