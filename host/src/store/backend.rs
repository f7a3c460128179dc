//! The interface every outbox backend implements. [`super::OutboxStore`]
//! dispatches to it in one place; what is common to all backends (the ack
//! fallback, the backlog figure) is written once, above it.

use std::collections::BTreeMap;
use std::time::Duration;

use super::Error;
use super::types::{
    Claim, DeadLetterFilter, LeaseId, OutboxEntry, OutboxRow, OutboxStats, PublishedRows, RetentionMode,
    RowId, RowOutcome,
};

/// One database holding the outbox table.
pub(super) trait Backend {
    /// Applies pending migrations.
    async fn migrate(&self) -> Result<(), Error>;
    /// Whether the outbox table exists.
    async fn schema_exists(&self) -> Result<bool, Error>;
    /// Versions of the migrations applied (none when `migrate` never ran);
    /// reads only.
    async fn applied_migrations(&self) -> Result<Vec<i64>, Error>;
    /// Rows pending or in flight.
    async fn count_backlog(&self) -> Result<i64, Error>;
    /// Age in seconds of the oldest due unfinished row.
    async fn oldest_pending_age(&self) -> Result<Option<f64>, Error>;
    /// Refreshes the planner's statistics of the outbox table.
    async fn refresh_statistics(&self) -> Result<(), Error>;
    /// A trivial query.
    async fn ping(&self) -> Result<(), Error>;
    /// Leases up to `limit` heads of aggregates to `owner`; payloads over
    /// `max_payload_bytes` are refused as they are read (see
    /// [`OutboxRow::refuse_payload_over`](super::types::OutboxRow::refuse_payload_over)).
    async fn claim(
        &self,
        dead_letter_blocks: bool,
        owner: &str,
        limit: u32,
        lease: Duration,
        max_payload_bytes: usize,
    ) -> Result<Claim, Error>;
    /// Records outcomes under `lease` in one transaction; the ids updated.
    async fn ack(
        &self,
        lease: LeaseId,
        outcomes: &[RowOutcome],
        published_rows: PublishedRows,
    ) -> Result<Vec<RowId>, Error>;
    /// Parked rows no ack will free back to the queue; how many.
    async fn unpark_stranded(&self, dead_letter_blocks: bool, limit: u32) -> Result<u64, Error>;
    /// Sets up to `limit` rows waiting on `target` (on any target when
    /// `None`) due now; how many.
    async fn wake_waiting(&self, target: Option<&str>, limit: u32) -> Result<u64, Error>;
    /// Pending rows waiting on each target.
    async fn waiting_by_target(&self) -> Result<BTreeMap<String, i64>, Error>;
    /// Unfinished rows in id order, changing nothing.
    async fn peek_pending(&self, limit: u32) -> Result<Vec<OutboxRow>, Error>;
    /// Releases every lease `owner` holds.
    async fn release_owner(&self, owner: &str) -> Result<u64, Error>;
    /// Status counts (without the oldest age).
    async fn stats(&self) -> Result<OutboxStats, Error>;
    /// Dead letters matching `filter` after id `after`, oldest first.
    async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: i64,
        limit: u32,
    ) -> Result<Vec<OutboxEntry>, Error>;
    /// How many dead letters match `filter`.
    async fn count_dead_letters(&self, filter: &DeadLetterFilter) -> Result<i64, Error>;
    /// One row by id.
    async fn entry(&self, id: i64) -> Result<Option<OutboxEntry>, Error>;
    /// Up to `batch` matching dead letters back to pending; their ids.
    async fn replay_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: i64,
        batch: u32,
    ) -> Result<Vec<i64>, Error>;
    /// Deletes up to `batch` matching dead letters.
    async fn purge_dead_letters(&self, filter: &DeadLetterFilter, batch: u32) -> Result<u64, Error>;
    /// Status counts of the given rows (at most 1,000 ids).
    async fn status_counts(&self, ids: &[i64]) -> Result<BTreeMap<String, i64>, Error>;
    /// Deletes or archives up to `batch` rows published more than `max_age` ago.
    async fn prune_published(&self, max_age: Duration, mode: RetentionMode, batch: u32)
    -> Result<u64, Error>;
}
