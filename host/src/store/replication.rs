//! Replication mode's public names, wherever they live: the change-stream
//! seam ([`super::change_stream`]), PostgreSQL's slot and MariaDB's binary
//! log. Nothing under `store` imports from here: each server's module
//! builds on the seam alone.

pub use super::change_stream::{
    AggregateKey, ChangeSource, ChangeStream, HandoverTable, StreamBatch, StreamError, StreamedRow,
};
#[cfg(not(feature = "binlog"))]
pub use super::mysql::binlog::without_binlog;
pub use super::mysql::binlog::{BinlogBatch, BinlogOutbox, BinlogSettings, BinlogSource, BinlogStream};
pub use super::postgres::replication::{
    SlotStatus, SourceTable, StreamSettings, WalBatch, WalSource, WalStream,
};
