//! What operators ask of the outbox: counts, dead letters (list, show,
//! replay, purge) and retention.

use std::collections::BTreeMap;
use std::time::Duration;

use super::backend::Backend;
use super::{
    AnyBackend, DeadLetterFilter, Error, OutboxEntry, OutboxStats, OutboxStore, PgOutbox, RetentionMode,
    dialect,
};

impl OutboxStore {
    /// Backlog, retries and dead letters, read from the partial indexes (none
    /// of these counts scans published rows).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn stats(&self) -> Result<OutboxStats, Error> {
        let mut stats = dispatch!(self, backend => backend.stats().await)?;
        stats.oldest_pending_age_seconds = self.oldest_pending_age().await?;
        stats.waiting_on_targets = self.waiting_by_target().await?;
        Ok(stats)
    }

    /// Dead letters matching `filter`, oldest first, at most `limit`, starting
    /// after row id `after` (for paging).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: i64,
        limit: u32,
    ) -> Result<Vec<OutboxEntry>, Error> {
        dispatch!(self, backend => backend.dead_letters(filter, after, limit).await)
    }

    /// How many dead letters match `filter`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn count_dead_letters(&self, filter: &DeadLetterFilter) -> Result<i64, Error> {
        dispatch!(self, backend => backend.count_dead_letters(filter).await)
    }

    /// How many dead letters match `filter`, counting no further than
    /// `bound` (a figure for a page, read from the dead-letter index).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn count_dead_letters_to(&self, filter: &DeadLetterFilter, bound: i64) -> Result<i64, Error> {
        dispatch!(self, backend => backend.count_dead_letters_to(filter, bound).await)
    }

    /// Rows waiting to be published, counted no further than `bound` in
    /// each queue: at least `bound` when it returns `bound` or more. Its
    /// cost does not grow with the backlog, unlike [`OutboxStore::backlog`].
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn backlog_to(&self, bound: i64) -> Result<i64, Error> {
        dispatch!(self, backend => backend.backlog_to(bound).await)
    }

    /// One row by its event id, whatever its status; `None` when the
    /// outbox has no such row (never written, still in the intake, or
    /// removed by retention).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn event(&self, event_id: uuid::Uuid) -> Result<Option<OutboxEntry>, Error> {
        dispatch!(self, backend => backend.event(event_id).await)
    }

    /// One row by id, whatever its status.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn entry(&self, id: i64, with_payload: bool) -> Result<Option<OutboxEntry>, Error> {
        dispatch!(self, backend => backend.entry(id, with_payload).await)
    }

    /// Sends up to `batch` dead letters matching `filter` with id above
    /// `after` back to pending, in id order: attempts start again from zero
    /// and the next claim routes them through the plugin version current
    /// then. Acknowledged deliveries are kept, so targets that already have
    /// an event do not get it twice. Returns the ids replayed.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn replay_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: i64,
        batch: u32,
    ) -> Result<Vec<i64>, Error> {
        let mut ids = dispatch!(self, backend => backend.replay_dead_letters(filter, after, batch).await)?;
        ids.sort_unstable();
        Ok(ids)
    }

    /// Deletes up to `batch` dead letters matching `filter`; returns how many.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn purge_dead_letters(&self, filter: &DeadLetterFilter, batch: u32) -> Result<u64, Error> {
        dispatch!(self, backend => backend.purge_dead_letters(filter, batch).await)
    }

    /// Status counts of the given rows (to follow a replay).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn status_counts(&self, ids: &[i64]) -> Result<BTreeMap<String, i64>, Error> {
        let mut counts = BTreeMap::new();
        for chunk in ids.chunks(1000) {
            for (status, n) in dispatch!(self, backend => backend.status_counts(chunk).await)? {
                *counts.entry(status).or_insert(0) += n;
            }
        }
        Ok(counts)
    }

    /// Removes up to `batch` published rows whose `published_at` is more than
    /// `max_age` ago, oldest first: deleted, or moved to
    /// `switchyard_outbox_archive`. Returns how many. Rows in any other
    /// status (dead letters included) are never touched.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn prune_published(
        &self,
        max_age: Duration,
        mode: RetentionMode,
        batch: u32,
    ) -> Result<u64, Error> {
        dispatch!(self, backend => backend.prune_published(max_age, mode, batch).await)
    }
}

impl PgOutbox {
    /// The plans of the queries the console's pages run, by name (`dead
    /// letters`, `dead letter count`, `backlog`, `event`), for `filter`:
    /// what shows that each reads an index, not the table.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn explain_console_queries(
        &self,
        filter: &DeadLetterFilter,
    ) -> Result<Vec<(String, String)>, Error> {
        let dialect = self.backend.dialect().await?;
        let pool = &self.backend.pool;
        let mut plans = Vec::new();
        let queries: [(&str, sqlx::QueryBuilder<'_, sqlx::Postgres>); 4] = [
            (
                "dead letters",
                dialect::explained_dead_letters_query(dialect, filter, 0, 50, true),
            ),
            (
                "dead letter count",
                dialect::bounded_dead_count_query(dialect, filter, 100_000, true),
            ),
            ("backlog", dialect::bounded_backlog_query(dialect, 100_000, true)),
            (
                "event",
                dialect::event_query(dialect, uuid::Uuid::nil().to_string(), true),
            ),
        ];
        for (name, mut query) in queries {
            let lines: Vec<String> = query.build_query_scalar().fetch_all(pool).await?;
            plans.push((name.to_string(), lines.join("\n")));
        }
        Ok(plans)
    }
}
