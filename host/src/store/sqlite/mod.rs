//! The outbox on SQLite, for the embedded default. SQLite has one writer at a
//! time and no SKIP LOCKED: a claim is a single `UPDATE ... RETURNING` whose
//! write lock serialises claimers, with the same head-of-line rule, lease,
//! lease token and outcome states as on PostgreSQL.

mod fleet;

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqlitePool};

use super::backend::Backend;
use super::dialect::{self, DeadLetterChange, Dialect, SQLITE_NOW_MS, lenient};
use super::types::{
    Claim, DeadLetterFilter, Generation, LeaseId, OutboxEntry, OutboxRow, OutboxStats, Outcome,
    PublishedRows, RetentionMode, RowId, RowOutcome,
};
use super::{Error, SQLITE_MIGRATOR};

const DIALECT: Dialect = Dialect::Sqlite;

/// A SQLite outbox.
#[derive(Clone, Debug)]
pub(super) struct Sqlite {
    pub(super) pool: SqlitePool,
    /// The claim statement, built once: index 0 lets later events of an
    /// aggregate pass a dead-lettered one, index 1 keeps them waiting.
    claim_sql: Arc<[String; 2]>,
}

impl Sqlite {
    pub(super) fn new(pool: SqlitePool) -> Sqlite {
        let sql = |dead_filter: &str| {
            format!(
                "UPDATE switchyard_outbox
                    SET status = 'in_flight', lease_owner = ?2, lease_id = ?3,
                        lease_expires_at = ?4 + ?5, attempts = attempts + 1
                  WHERE id IN (
                        SELECT o.id FROM switchyard_outbox o
                         WHERE o.status IN ('pending', 'in_flight')
                           AND (   (o.status = 'pending' AND o.next_attempt_at <= ?4
                                    AND (o.not_before IS NULL OR o.not_before <= ?4
                                         -- not a time: claimed, to be dead-lettered saying so
                                         OR typeof(o.not_before) NOT IN ('integer', 'real')))
                                OR (o.status = 'in_flight' AND o.lease_expires_at < ?4))
                           AND NOT EXISTS (
                                 SELECT 1 FROM switchyard_outbox e
                                  WHERE e.aggregate_type = o.aggregate_type
                                    AND e.aggregate_id = o.aggregate_id
                                    AND e.id < o.id
                                    AND e.status <> 'published' {dead_filter})
                         ORDER BY o.id
                         LIMIT ?1)
                 RETURNING {}",
                ROW_COLUMNS.replace("__MAX__", "?6")
            )
        };
        Sqlite {
            pool,
            claim_sql: Arc::new([sql("AND e.status <> 'dead'"), sql("")]),
        }
    }
}

/// The columns a claim returns. SQLite gathers a statement's RETURNING rows
/// in memory, inside this process, before the first one is read: a payload
/// over `__MAX__` bytes is left out there, and only its size returned.
const ROW_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type,
    CASE WHEN length(CAST(payload AS BLOB)) <= __MAX__ THEN payload END AS payload_json,
    CASE WHEN length(payload_bytes) <= __MAX__ THEN payload_bytes END AS payload_bytes,
    coalesce(length(payload_bytes), length(CAST(payload AS BLOB))) AS payload_len,
    headers AS headers_json, tenant, created_at AS created_at_ms, attempts,
    deliveries AS deliveries_json, typeof(not_before) AS not_before_type";

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn row_from_record(record: &SqliteRow) -> Result<OutboxRow, sqlx::Error> {
    let mut problem = None;
    let event_id: String = lenient(record, "event_id", "event_id", &mut problem);
    // Written only by the relay; unreadable means "nothing acked yet".
    let deliveries_json: String = lenient(record, "deliveries_json", "deliveries", &mut None);
    let not_before_type: String = lenient(record, "not_before_type", "not_before", &mut problem);
    if !matches!(not_before_type.as_str(), "null" | "integer" | "real") {
        problem.get_or_insert_with(|| {
            format!(
                "column not_before holds {} where INTEGER (ms since the Unix epoch) is expected",
                not_before_type.to_uppercase()
            )
        });
    }
    // An id that is not a UUID must neither stop the relay nor be replaced by
    // a shared value (brokers would deduplicate distinct events by it): the
    // row is dead-lettered saying so.
    let event_id = match uuid::Uuid::from_str(&event_id) {
        Ok(id) => id,
        Err(_) => {
            problem.get_or_insert_with(|| {
                format!(
                    "event_id {:?} is not a UUID; the event id is every broker's dedup id, so it must be unique",
                    event_id.chars().take(64).collect::<String>()
                )
            });
            uuid::Uuid::nil()
        }
    };
    let mut row = OutboxRow {
        malformed: None,
        held_by: Vec::new(),
        // INTEGER PRIMARY KEY: always an integer.
        id: RowId(record.try_get("id")?),
        event_id,
        aggregate_type: lenient(record, "aggregate_type", "aggregate_type", &mut problem),
        aggregate_id: lenient(record, "aggregate_id", "aggregate_id", &mut problem),
        event_type: lenient(record, "event_type", "event_type", &mut problem),
        payload_json: lenient(record, "payload_json", "payload", &mut problem),
        payload_bytes: lenient(record, "payload_bytes", "payload_bytes", &mut problem),
        headers_json: lenient(record, "headers_json", "headers", &mut problem),
        tenant: lenient(record, "tenant", "tenant", &mut problem),
        created_at_ms: lenient(record, "created_at_ms", "created_at", &mut problem),
        attempts: lenient(record, "attempts", "attempts", &mut problem),
        deliveries: serde_json::from_str(&deliveries_json).unwrap_or_default(),
    };
    row.malformed = problem;
    Ok(row)
}

fn duration_ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The last migration of each generation served (see [`Generation`]).
const PREVIOUS_SINCE: i64 = 20261129000000;
const CURRENT_SINCE: i64 = 20261201000000;

impl Backend for Sqlite {
    async fn migrate(&self) -> Result<(), Error> {
        SQLITE_MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    async fn applied_migrations(&self) -> Result<Vec<i64>, Error> {
        let exists: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
        )
        .fetch_one(&self.pool)
        .await?;
        if exists == 0 {
            return Ok(Vec::new());
        }
        Ok(
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    /// By the migrations applied: a SQLite outbox is only ever made by
    /// `switchyard migrate`.
    async fn generation(&self) -> Result<Generation, Error> {
        let applied = self.applied_migrations().await?;
        if applied.contains(&CURRENT_SINCE) {
            Ok(Generation::Current)
        } else if applied.contains(&PREVIOUS_SINCE) {
            Ok(Generation::Previous)
        } else {
            Err(Error::SchemaTooOld {
                missing: "20261129000000_running_relays",
            })
        }
    }

    async fn schema_exists(&self) -> Result<bool, Error> {
        let tables: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'switchyard_outbox'",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(tables > 0)
    }

    async fn count_backlog(&self) -> Result<i64, Error> {
        Ok(sqlx::query_scalar(dialect::COUNT_BACKLOG)
            .fetch_one(&self.pool)
            .await?)
    }

    async fn oldest_pending_age(&self) -> Result<Option<f64>, Error> {
        Ok(sqlx::query_scalar(&format!(
            "SELECT ({SQLITE_NOW_MS} - created_at) / 1000.0
               FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')
                AND (not_before IS NULL OR not_before <= {SQLITE_NOW_MS})
                AND typeof(created_at) = 'integer'
              ORDER BY id LIMIT 1"
        ))
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
        max_payload_bytes: usize,
    ) -> Result<Claim, Error> {
        let started = Instant::now();
        let lease_id = LeaseId(uuid::Uuid::new_v4());
        let records = sqlx::query(&self.claim_sql[usize::from(dead_letter_blocks)])
            .bind(i64::from(limit))
            .bind(owner)
            .bind(lease_id.0.to_string())
            .bind(now_ms())
            .bind(duration_ms(lease))
            .bind(i64::try_from(max_payload_bytes).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await?;
        let mut rows = Vec::with_capacity(records.len());
        for record in &records {
            let mut row = row_from_record(record)?;
            let len: Option<i64> = record.try_get("payload_len").unwrap_or_default();
            row.refuse_payload_over(max_payload_bytes, len.and_then(|len| usize::try_from(len).ok()));
            rows.push(row);
        }
        Ok(Claim::polled(lease_id, rows, started, lease))
    }

    async fn ack(
        &self,
        lease: LeaseId,
        outcomes: &[RowOutcome],
        published_rows: PublishedRows,
    ) -> Result<Vec<RowId>, Error> {
        let pool = &self.pool;
        let now = now_ms();
        let lease = lease.0.to_string();
        // One transaction for the batch: one fsync, and all-or-nothing like PostgreSQL's single statement.
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut acked = Vec::with_capacity(outcomes.len());
        for row in outcomes {
            let (backoff_ms, error, refund) = match &row.outcome {
                Outcome::Published => (0, None, false),
                Outcome::Retry { after, error } => (duration_ms(*after), Some(error.as_str()), false),
                Outcome::Defer { after, reason, .. } => (duration_ms(*after), Some(reason.as_str()), true),
                Outcome::Dead { error } => (0, Some(error.as_str()), false),
            };
            let waiting_on = match &row.outcome {
                Outcome::Defer { waiting_on, .. } if !waiting_on.is_empty() => {
                    Some(serde_json::Value::from(waiting_on.clone()).to_string())
                }
                _ => None,
            };
            let status = row.outcome.status();
            if row.outcome == Outcome::Published && published_rows != PublishedRows::Keep {
                if remove_published(&mut tx, published_rows, row, now, &lease).await? {
                    acked.push(row.id);
                }
                continue;
            }
            let done = sqlx::query(
                "UPDATE switchyard_outbox
                SET status = ?1,
                    published_at = CASE WHEN ?1 = 'published' THEN ?2 ELSE NULL END,
                    next_attempt_at = CASE WHEN ?1 = 'pending' THEN ?2 + ?3 ELSE next_attempt_at END,
                    last_error = ?4,
                    attempts = attempts - ?5,
                    deliveries = ?6,
                    plugin_version = COALESCE(?7, plugin_version),
                    lease_owner = NULL, lease_id = NULL, lease_expires_at = NULL,
                    waiting_on = ?10
              WHERE id = ?8 AND status = 'in_flight' AND lease_id = ?9",
            )
            .bind(status)
            .bind(now)
            .bind(backoff_ms)
            .bind(error)
            .bind(i64::from(refund))
            .bind(dialect::deliveries_json(&row.deliveries))
            .bind(row.plugin_version.as_deref())
            .bind(row.id.0)
            .bind(&lease)
            .bind(waiting_on)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 1 {
                acked.push(row.id);
            }
        }
        tx.commit().await?;
        Ok(acked)
    }

    async fn unpark_stranded(&self, _dead_letter_blocks: bool, _limit: u32) -> Result<u64, Error> {
        // One writer: claims never park rows here.
        Ok(0)
    }

    async fn park_followers(&self, _limit: u32) -> Result<u64, Error> {
        // One writer, one claim at a time: nothing to spare it.
        Ok(0)
    }

    async fn wake_waiting(&self, target: Option<&str>, limit: u32) -> Result<u64, Error> {
        let woken = sqlx::query(
            "UPDATE switchyard_outbox SET waiting_on = NULL, next_attempt_at = ?1
              WHERE id IN (
                    SELECT w.id FROM switchyard_outbox w
                     WHERE w.waiting_on IS NOT NULL AND w.status = 'pending'
                       AND (?2 IS NULL OR EXISTS (SELECT 1 FROM json_each(w.waiting_on) t WHERE t.value = ?2))
                     ORDER BY w.id LIMIT ?3)",
        )
        .bind(now_ms())
        .bind(target)
        .bind(i64::from(limit))
        .execute(&self.pool)
        .await?;
        Ok(woken.rows_affected())
    }

    async fn waiting_by_target(&self) -> Result<BTreeMap<String, i64>, Error> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT t.value, count(*) FROM switchyard_outbox o, json_each(o.waiting_on) t
              WHERE o.waiting_on IS NOT NULL AND o.status = 'pending' AND json_valid(o.waiting_on)
              GROUP BY t.value",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().collect())
    }

    async fn peek_pending(&self, limit: u32) -> Result<Vec<OutboxRow>, Error> {
        let sql = format!(
            "SELECT {} FROM switchyard_outbox WHERE status IN ('pending', 'in_flight') ORDER BY id LIMIT ?1",
            ROW_COLUMNS.replace("__MAX__", "?2")
        );
        let records = sqlx::query(&sql)
            .bind(i64::from(limit))
            .bind(i64::MAX)
            .fetch_all(&self.pool)
            .await?;
        Ok(records.iter().map(row_from_record).collect::<Result<_, _>>()?)
    }

    async fn release_owner(&self, owner: &str) -> Result<u64, Error> {
        Ok(sqlx::query(dialect::RELEASE_OWNER)
            .bind(owner)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    dialect_queries!(|_sqlite| DIALECT);
    returning_replay!(|_sqlite| DIALECT);

    async fn purge_dead_letters(&self, filter: &DeadLetterFilter, batch: u32) -> Result<u64, Error> {
        Ok(
            dialect::dead_letter_change_query(DIALECT, DeadLetterChange::Purge, filter, 0, batch)
                .build()
                .execute(&self.pool)
                .await?
                .rows_affected(),
        )
    }

    async fn prune_published(
        &self,
        max_age: Duration,
        mode: RetentionMode,
        batch: u32,
    ) -> Result<u64, Error> {
        let cutoff = now_ms().saturating_sub(duration_ms(max_age));
        let batch = i64::from(batch);
        let doomed = "SELECT id FROM switchyard_outbox
                       WHERE status = 'published' AND published_at < ?1
                       ORDER BY published_at LIMIT ?2";
        let mut tx = self.pool.begin().await?;
        if mode == RetentionMode::Archive {
            // The insert takes the write lock first, so the delete below
            // selects exactly the rows just copied.
            let sql = format!(
                "INSERT INTO switchyard_outbox_archive ({columns})
                 SELECT {columns} FROM switchyard_outbox WHERE id IN ({doomed})",
                columns = dialect::ARCHIVE_COLUMNS
            );
            sqlx::query(&sql)
                .bind(cutoff)
                .bind(batch)
                .execute(&mut *tx)
                .await?;
        }
        let sql = format!("DELETE FROM switchyard_outbox WHERE id IN ({doomed})");
        let done = sqlx::query(&sql)
            .bind(cutoff)
            .bind(batch)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }
}

/// Deletes a published row (after copying it to the archive in `archive`
/// mode) if its lease still holds; whether it did.
async fn remove_published(
    tx: &mut sqlx::SqliteConnection,
    published_rows: PublishedRows,
    row: &RowOutcome,
    now: i64,
    lease: &str,
) -> Result<bool, Error> {
    if published_rows == PublishedRows::Archive {
        let columns = dialect::ARCHIVE_COLUMNS;
        let values = columns
            .replace("published_at", "?1")
            .replace("deliveries", "?2")
            .replace("plugin_version", "COALESCE(?3, plugin_version)");
        sqlx::query(&format!(
            "INSERT INTO switchyard_outbox_archive ({columns})
             SELECT {values} FROM switchyard_outbox
              WHERE id = ?4 AND status = 'in_flight' AND lease_id = ?5"
        ))
        .bind(now)
        .bind(dialect::deliveries_json(&row.deliveries))
        .bind(row.plugin_version.as_deref())
        .bind(row.id.0)
        .bind(lease)
        .execute(&mut *tx)
        .await?;
    }
    let done =
        sqlx::query("DELETE FROM switchyard_outbox WHERE id = ?1 AND status = 'in_flight' AND lease_id = ?2")
            .bind(row.id.0)
            .bind(lease)
            .execute(&mut *tx)
            .await?;
    Ok(done.rows_affected() == 1)
}
