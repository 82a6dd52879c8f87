//! [`WriteBatch`]: a group of writes applied atomically.

/// One operation inside a [`WriteBatch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOp {
    /// Set `key` to `value`.
    Put {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
    },
    /// Remove `key` (a no-op if absent).
    Delete {
        /// The key.
        key: Vec<u8>,
    },
}

impl BatchOp {
    /// The key this operation touches.
    pub fn key(&self) -> &[u8] {
        match self {
            BatchOp::Put { key, .. } | BatchOp::Delete { key } => key,
        }
    }

    /// User bytes this operation writes: key and value, or the key of a delete.
    pub fn user_bytes(&self) -> u64 {
        match self {
            BatchOp::Put { key, value } => (key.len() + value.len()) as u64,
            BatchOp::Delete { key } => key.len() as u64,
        }
    }
}

/// A group of puts and deletes that [`crate::Db::write`] applies atomically: after a crash
/// either all of them are visible or none is. Later operations on the same key win.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteBatch {
    pub(crate) ops: Vec<BatchOp>,
}

impl WriteBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queue `key = value`.
    pub fn put(&mut self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> &mut Self {
        self.ops.push(BatchOp::Put { key: key.as_ref().to_vec(), value: value.as_ref().to_vec() });
        self
    }

    /// Queue the removal of `key`.
    pub fn delete(&mut self, key: impl AsRef<[u8]>) -> &mut Self {
        self.ops.push(BatchOp::Delete { key: key.as_ref().to_vec() });
        self
    }

    /// Number of queued operations.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Remove every queued operation.
    pub fn clear(&mut self) {
        self.ops.clear();
    }

    /// The queued operations, in order.
    pub fn ops(&self) -> &[BatchOp] {
        &self.ops
    }

    /// Bytes of user data in the batch (keys + values), the "user bytes written" of
    /// write amplification.
    pub fn user_bytes(&self) -> u64 {
        self.ops.iter().map(BatchOp::user_bytes).sum()
    }
}
