//! openraft's own storage test suite (`openraft::testing::Suite`: log state, purge,
//! truncate, vote, applied state, membership recovery, snapshot transfer) against the
//! tierkv log store and state machine.

use std::sync::Arc;

use openraft::testing::{StoreBuilder, Suite};
use tierkv::{Db, Options};
use tierkv_raft::log_store::LogStore;
use tierkv_raft::state_machine::StateMachine;
use tierkv_raft::{StorageError, TypeConfig};

/// Small PM pools: the suite opens two stores per test case.
pub fn test_options() -> Options {
    Options::new().pm_pool_size(4 << 20)
}

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine, tempfile::TempDir> for Builder {
    async fn build(&self) -> Result<(tempfile::TempDir, LogStore, StateMachine), StorageError> {
        let d = tempfile::tempdir().map_err(|e| openraft::StorageIOError::write(&e))?;
        let log = LogStore::open(d.path().join("raft/log"), test_options())
            .map_err(|e| openraft::StorageIOError::write_logs(&e))?;
        let db = Db::open(d.path().join("data"), test_options())
            .map_err(|e| openraft::StorageIOError::write_state_machine(&e))?;
        let sm = StateMachine::open(Arc::new(db), d.path().join("raft/snapshot"))?;
        Ok((d, log, sm))
    }
}

#[test]
fn openraft_storage_suite() -> Result<(), String> {
    Suite::test_all(Builder).map_err(|e| e.to_string())
}
