//! The binary log reader in a build without it (cargo feature `binlog`
//! off, as in the demo's build): `validate` refuses binlog mode with
//! [`without_binlog`], and a stream opened anyway refuses with it too.

use sqlx::MySqlPool;

use super::{BinlogBatch, BinlogSettings};
use crate::store::change_stream::StreamError;

pub use crate::config::replication::without_binlog;

/// A binary log session, of which this build can open none.
pub struct BinlogStream {
    never: std::convert::Infallible,
}

impl BinlogStream {
    /// Refuses: this build has no binary log reader.
    ///
    /// # Errors
    /// Always, [`StreamError::Gone`] with [`without_binlog`].
    pub async fn open(_settings: &BinlogSettings, _pool: MySqlPool) -> Result<BinlogStream, StreamError> {
        Err(StreamError::Gone(without_binlog()))
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
