//! The interface every outbox backend implements. [`super::OutboxStore`]
//! dispatches to it in one place; what is common to all backends (the ack
//! fallback, the backlog figure) is written once, above it.

use std::collections::BTreeMap;
use std::time::Duration;

use super::Error;
use super::types::{
    Claim, DeadLetterFilter, Generation, LeaseId, OutboxEntry, OutboxRow, OutboxStats, PublishedRows,
    RetentionMode, RowId, RowOutcome,
};

/// One database holding the outbox table.
pub(super) trait Backend {
    /// Applies pending migrations.
    async fn migrate(&self) -> Result<(), Error>;
    /// Whether the outbox table exists.
    async fn schema_exists(&self) -> Result<bool, Error>;
    /// The schema's generation; [`Error::SchemaTooOld`] when it is older
    /// than the previous one.
    async fn generation(&self) -> Result<Generation, Error>;
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
    /// Up to `limit` pending rows behind a row of their aggregate that
    /// waits on paused targets, set waiting with it; how many.
    async fn park_followers(&self, limit: u32) -> Result<u64, Error>;
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
    /// See [`super::OutboxStore::count_dead_letters_to`].
    async fn count_dead_letters_to(&self, filter: &DeadLetterFilter, bound: i64) -> Result<i64, Error>;
    /// See [`super::OutboxStore::backlog_to`].
    async fn backlog_to(&self, bound: i64) -> Result<i64, Error>;
    /// See [`super::OutboxStore::event`].
    async fn event(&self, event_id: uuid::Uuid) -> Result<Option<OutboxEntry>, Error>;
    /// One row by id.
    async fn entry(&self, id: i64, with_payload: bool) -> Result<Option<OutboxEntry>, Error>;
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

/// The operator queries that differ between backends only in their SQL
/// dialect, written once and expanded into each `impl Backend`. `$this` names
/// the backend in `$dialect`, the expression that gives its [`Dialect`]
/// (`self` cannot be passed into a macro-made method).
///
/// [`Dialect`]: super::dialect::Dialect
macro_rules! dialect_queries {
    (|$this:ident| $dialect:expr) => {
        async fn stats(&self) -> Result<OutboxStats, Error> {
            let $this = self;
            let dialect = $dialect;
            let counts = sqlx::query_as(&dialect::status_counts_sql(dialect))
                .fetch_one(&self.pool)
                .await?;
            let by_type = sqlx::query_as(&dialect::dead_by_type_sql(dialect))
                .fetch_all(&self.pool)
                .await?;
            Ok(OutboxStats::from_counts(counts, by_type))
        }

        async fn dead_letters(
            &self,
            filter: &DeadLetterFilter,
            after: i64,
            limit: u32,
        ) -> Result<Vec<OutboxEntry>, Error> {
            let $this = self;
            let records = dialect::dead_letters_query($dialect, filter, after, limit)
                .build()
                .fetch_all(&self.pool)
                .await?;
            Ok(records
                .iter()
                .map(dialect::entry_from_record)
                .collect::<Result<_, _>>()?)
        }

        async fn count_dead_letters(&self, filter: &DeadLetterFilter) -> Result<i64, Error> {
            let $this = self;
            Ok(dialect::count_dead_letters_query($dialect, filter)
                .build_query_scalar()
                .fetch_one(&self.pool)
                .await?)
        }

        async fn count_dead_letters_to(&self, filter: &DeadLetterFilter, bound: i64) -> Result<i64, Error> {
            let $this = self;
            Ok(
                dialect::bounded_dead_count_query($dialect, filter, bound, false)
                    .build_query_scalar()
                    .fetch_one(&self.pool)
                    .await?,
            )
        }

        async fn backlog_to(&self, bound: i64) -> Result<i64, Error> {
            let $this = self;
            Ok(dialect::bounded_backlog_query($dialect, bound, false)
                .build_query_scalar()
                .fetch_one(&self.pool)
                .await?)
        }

        async fn event(&self, event_id: uuid::Uuid) -> Result<Option<OutboxEntry>, Error> {
            let $this = self;
            let record = dialect::event_query($dialect, event_id.hyphenated().to_string(), false)
                .build()
                .fetch_optional(&self.pool)
                .await?;
            Ok(record
                .as_ref()
                .map(dialect::entry_from_record)
                .transpose()?)
        }

        async fn entry(&self, id: i64, with_payload: bool) -> Result<Option<OutboxEntry>, Error> {
            let $this = self;
            let record = dialect::entry_query($dialect, id, with_payload)
                .build()
                .fetch_optional(&self.pool)
                .await?;
            Ok(record
                .as_ref()
                .map(dialect::entry_from_record)
                .transpose()?)
        }

        async fn status_counts(&self, ids: &[i64]) -> Result<BTreeMap<String, i64>, Error> {
            let $this = self;
            let rows: Vec<(String, i64)> = dialect::status_of_query($dialect, ids)
                .build_query_as()
                .fetch_all(&self.pool)
                .await?;
            Ok(rows.into_iter().collect())
        }
    };
}

/// Dead letters back to pending by one `UPDATE ... RETURNING id`, on the
/// backends that have it (MySQL has not: see `store::mysql`).
macro_rules! returning_replay {
    (|$this:ident| $dialect:expr) => {
        async fn replay_dead_letters(
            &self,
            filter: &DeadLetterFilter,
            after: i64,
            batch: u32,
        ) -> Result<Vec<i64>, Error> {
            let $this = self;
            Ok(
                dialect::dead_letter_change_query($dialect, DeadLetterChange::Replay, filter, after, batch)
                    .build_query_scalar()
                    .fetch_all(&self.pool)
                    .await?,
            )
        }
    };
}

/// The statements a fleet of relays shares a database by: the ownership
/// lease (one relay serves a database at a time) and the running relays'
/// announcements. Each backend says them in its own SQL, beside its other
/// statements.
pub(super) trait Fleet {
    /// The ownership row: its owner, whether the lease still runs, how long
    /// it has been free (ms), and how many relays announced themselves
    /// within `live_within`.
    async fn ownership_row(&self, live_within: Duration) -> Result<(Option<String>, bool, i64, i64), Error>;
    /// Takes the database for `owner` if it is free or its lease ran out;
    /// the new token.
    async fn take_ownership(&self, owner: &str, lease: Duration) -> Result<Option<i64>, Error>;
    /// Extends the lease if `owner` still holds `token`; rows changed.
    async fn renew_ownership(&self, owner: &str, token: i64, lease: Duration) -> Result<u64, Error>;
    /// Frees the database if `owner` still holds `token`.
    async fn release_ownership(&self, owner: &str, token: i64) -> Result<(), Error>;
    /// Upserts `instance_id`'s announcement and deletes those unseen for
    /// `forgotten_ms`.
    async fn announce_relay(
        &self,
        instance_id: &str,
        admin: Option<&str>,
        forgotten_ms: i64,
    ) -> Result<(), Error>;
    /// Deletes `instance_id`'s announcement.
    async fn relay_stopped(&self, instance_id: &str) -> Result<(), Error>;
    /// Whether the schema has the announcements' table (older ones do not).
    async fn has_relays_table(&self) -> Result<bool, Error>;
    /// Relays seen within `within_ms`: id, admin address, seconds since seen.
    async fn running_relays(&self, within_ms: i64) -> Result<Vec<(String, Option<String>, f64)>, Error>;
}
