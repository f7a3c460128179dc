//! The binary log reader in a build without it (cargo feature `binlog`
//! off, as in the demo's build): a relay refuses binlog mode at start with
//! [`WITHOUT_BINLOG`], so no stream is ever opened.

use sqlx::MySqlPool;

use super::{BinlogBatch, BinlogSettings};
use crate::store::replication::StreamError;

/// Why this build reads no binary log.
pub const WITHOUT_BINLOG: &str = "this switchyard was built without the binary log reader that binlog mode \
     needs (cargo feature `binlog`, on by default)";

/// A binary log session, of which this build can open none.
pub struct BinlogStream {
    never: std::convert::Infallible,
}

impl BinlogStream {
    /// Refuses: this build has no binary log reader.
    ///
    /// # Errors
    /// Always, [`StreamError::Gone`] with [`WITHOUT_BINLOG`].
    pub async fn open(_settings: &BinlogSettings, _pool: MySqlPool) -> Result<BinlogStream, StreamError> {
        Err(StreamError::Gone(WITHOUT_BINLOG.to_string()))
    }

    /// Never called: no stream is opened.
    ///
    /// # Errors
    /// None.
    pub async fn next_batch(&mut self) -> Result<BinlogBatch, StreamError> {
        match self.never {}
    }

    /// Never called: no stream is opened.
    pub fn confirm(&self, _done_at: u64) {
        match self.never {}
    }

    /// Never called: no stream is opened.
    pub async fn close(self) {
        match self.never {}
    }
}
