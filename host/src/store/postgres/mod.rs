//! The outbox on PostgreSQL, shared by many relays: claims lock rows with
//! SKIP LOCKED, acks are one statement per batch, and every statement that
//! changes operator-selected rows skips rows another statement holds.

mod ack;
mod claim;

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::PgPool;

use super::backend::Backend;
use super::dialect::{self, DeadLetterChange, Dialect};
use super::types::{
    Claim, DeadLetterFilter, LeaseId, OutboxEntry, OutboxRow, OutboxStats, RetentionMode, RowId, RowOutcome,
};
use super::{Error, MIGRATOR};

const DIALECT: Dialect = Dialect::Postgres;

/// A PostgreSQL outbox.
#[derive(Clone, Debug)]
pub(super) struct Postgres {
    pub(super) pool: PgPool,
}

impl Backend for Postgres {
    async fn migrate(&self) -> Result<(), Error> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    async fn schema_exists(&self) -> Result<bool, Error> {
        Ok(
            sqlx::query_scalar("SELECT to_regclass('switchyard_outbox') IS NOT NULL")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    async fn count_backlog(&self) -> Result<i64, Error> {
        Ok(sqlx::query_scalar(dialect::COUNT_BACKLOG)
            .fetch_one(&self.pool)
            .await?)
    }

    async fn oldest_pending_age(&self) -> Result<Option<f64>, Error> {
        Ok(sqlx::query_scalar(
            "SELECT EXTRACT(EPOCH FROM now() - created_at)::float8
               FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')
                AND (not_before IS NULL OR not_before <= now())
              ORDER BY id LIMIT 1",
        )
        .fetch_optional(&self.pool)
        .await?)
    }

    async fn refresh_statistics(&self) -> Result<(), Error> {
        sqlx::query("ANALYZE switchyard_outbox")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn ping(&self) -> Result<(), Error> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn claim(
        &self,
        dead_letter_blocks: bool,
        owner: &str,
        limit: u32,
        lease: Duration,
    ) -> Result<Claim, Error> {
        claim::claim(&self.pool, dead_letter_blocks, owner, limit, lease).await
    }

    async fn ack(&self, lease: LeaseId, outcomes: &[RowOutcome]) -> Result<Vec<RowId>, Error> {
        ack::ack(&self.pool, lease, outcomes).await
    }

    async fn peek_pending(&self, limit: u32) -> Result<Vec<OutboxRow>, Error> {
        claim::peek_pending(&self.pool, limit).await
    }

    async fn release_owner(&self, owner: &str) -> Result<u64, Error> {
        Ok(sqlx::query(dialect::RELEASE_OWNER)
            .bind(owner)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    async fn stats(&self) -> Result<OutboxStats, Error> {
        let counts = sqlx::query_as(&dialect::status_counts_sql(DIALECT))
            .fetch_one(&self.pool)
            .await?;
        let by_type = sqlx::query_as(dialect::DEAD_BY_TYPE)
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
        let records = dialect::dead_letters_query(DIALECT, filter, after, limit)
            .build()
            .fetch_all(&self.pool)
            .await?;
        Ok(records
            .iter()
            .map(dialect::entry_from_record)
            .collect::<Result<_, _>>()?)
    }

    async fn count_dead_letters(&self, filter: &DeadLetterFilter) -> Result<i64, Error> {
        Ok(dialect::count_dead_letters_query(DIALECT, filter)
            .build_query_scalar()
            .fetch_one(&self.pool)
            .await?)
    }

    async fn entry(&self, id: i64) -> Result<Option<OutboxEntry>, Error> {
        let sql = format!(
            "SELECT {} FROM switchyard_outbox WHERE id = $1",
            DIALECT.entry_columns()
        );
        let record = sqlx::query(&sql).bind(id).fetch_optional(&self.pool).await?;
        Ok(record.as_ref().map(dialect::entry_from_record).transpose()?)
    }

    async fn replay_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: i64,
        batch: u32,
    ) -> Result<Vec<i64>, Error> {
        Ok(
            dialect::dead_letter_change_query(DIALECT, DeadLetterChange::Replay, filter, after, batch)
                .build_query_scalar()
                .fetch_all(&self.pool)
                .await?,
        )
    }

    async fn purge_dead_letters(&self, filter: &DeadLetterFilter, batch: u32) -> Result<u64, Error> {
        Ok(
            dialect::dead_letter_change_query(DIALECT, DeadLetterChange::Purge, filter, 0, batch)
                .build()
                .execute(&self.pool)
                .await?
                .rows_affected(),
        )
    }

    async fn status_counts(&self, ids: &[i64]) -> Result<BTreeMap<String, i64>, Error> {
        let rows: Vec<(String, i64)> = dialect::status_of_query(DIALECT, ids)
            .build_query_as()
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.into_iter().collect())
    }

    async fn prune_published(
        &self,
        max_age: Duration,
        mode: RetentionMode,
        batch: u32,
    ) -> Result<u64, Error> {
        // SKIP LOCKED: several relays may run retention at once.
        let doomed = "WITH doomed AS (
            SELECT id FROM switchyard_outbox
             WHERE status = 'published'
               AND published_at < now() - $1 * interval '1 millisecond'
             ORDER BY published_at LIMIT $2
               FOR UPDATE SKIP LOCKED)";
        let sql = match mode {
            RetentionMode::Delete => {
                format!("{doomed} DELETE FROM switchyard_outbox o USING doomed WHERE o.id = doomed.id")
            }
            RetentionMode::Archive => format!(
                "{doomed}, moved AS (
                    DELETE FROM switchyard_outbox o USING doomed WHERE o.id = doomed.id
                    RETURNING o.*)
                 INSERT INTO switchyard_outbox_archive ({columns})
                 SELECT {columns} FROM moved",
                columns = dialect::ARCHIVE_COLUMNS
            ),
        };
        let done = sqlx::query(&sql)
            .bind(i64::try_from(max_age.as_millis()).unwrap_or(i64::MAX))
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
