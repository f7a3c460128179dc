//! What operators ask of the outbox: counts, dead letters (list, show,
//! replay, purge) and retention.

use std::collections::BTreeMap;
use std::time::Duration;

use super::backend::Backend;
use super::{AnyBackend, DeadLetterFilter, Error, OutboxEntry, OutboxStats, OutboxStore, RetentionMode};

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

    /// One row by id, whatever its status.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn entry(&self, id: i64) -> Result<Option<OutboxEntry>, Error> {
        dispatch!(self, backend => backend.entry(id).await)
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
