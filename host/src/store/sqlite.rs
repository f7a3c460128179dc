//! The outbox on SQLite, for the embedded default. SQLite has one writer at a
//! time and no SKIP LOCKED: a claim is a single `UPDATE ... RETURNING` whose
//! write lock serialises claimers, with the same head-of-line rule, lease,
//! lease token and outcome states as on PostgreSQL.

use std::str::FromStr;
use std::time::{Duration, Instant};

use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqlitePool};

use super::Error;
use super::ack::{Outcome, RowOutcome};
use super::claim::Claim;
use super::row::{LeaseId, OutboxRow, RowId};

const ROW_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type, payload AS payload_json,
    payload_bytes, headers AS headers_json, tenant, created_at AS created_at_ms, attempts,
    deliveries AS deliveries_json";

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

fn row_from_record(record: &SqliteRow) -> Result<OutboxRow, sqlx::Error> {
    let event_id: String = record.try_get("event_id")?;
    let deliveries_json: String = record.try_get("deliveries_json")?;
    // An id that is not a UUID must neither stop the relay nor be replaced by
    // a shared value (brokers would deduplicate distinct events by it): the
    // row is dead-lettered saying so.
    let (event_id, malformed) = match uuid::Uuid::from_str(&event_id) {
        Ok(id) => (id, None),
        Err(_) => (
            uuid::Uuid::nil(),
            Some(format!(
                "event_id {:?} is not a UUID; the event id is every broker's dedup id, so it must be unique",
                event_id.chars().take(64).collect::<String>()
            )),
        ),
    };
    Ok(OutboxRow {
        malformed,
        id: RowId(record.try_get("id")?),
        event_id,
        aggregate_type: record.try_get("aggregate_type")?,
        aggregate_id: record.try_get("aggregate_id")?,
        event_type: record.try_get("event_type")?,
        payload_json: record.try_get("payload_json")?,
        payload_bytes: record.try_get("payload_bytes")?,
        headers_json: record.try_get("headers_json")?,
        tenant: record.try_get("tenant")?,
        created_at_ms: record.try_get("created_at_ms")?,
        attempts: record.try_get("attempts")?,
        deliveries: serde_json::from_str(&deliveries_json).unwrap_or_default(),
    })
}

pub(super) async fn claim(
    pool: &SqlitePool,
    dead_letter_blocks_aggregate: bool,
    owner: &str,
    limit: u32,
    lease: Duration,
) -> Result<Claim, Error> {
    let started = Instant::now();
    let lease_id = LeaseId(uuid::Uuid::new_v4());
    let now = now_ms();
    let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
    let dead_filter = if dead_letter_blocks_aggregate {
        ""
    } else {
        "AND e.status <> 'dead'"
    };
    let sql = format!(
        "UPDATE switchyard_outbox
            SET status = 'in_flight', lease_owner = ?2, lease_id = ?3,
                lease_expires_at = ?4 + ?5, attempts = attempts + 1
          WHERE id IN (
                SELECT o.id FROM switchyard_outbox o
                 WHERE o.status IN ('pending', 'in_flight')
                   AND (   (o.status = 'pending' AND o.next_attempt_at <= ?4
                            AND (o.not_before IS NULL OR o.not_before <= ?4))
                        OR (o.status = 'in_flight' AND o.lease_expires_at < ?4))
                   AND NOT EXISTS (
                         SELECT 1 FROM switchyard_outbox e
                          WHERE e.aggregate_type = o.aggregate_type
                            AND e.aggregate_id = o.aggregate_id
                            AND e.id < o.id
                            AND e.status <> 'published' {dead_filter})
                 ORDER BY o.id
                 LIMIT ?1)
         RETURNING {ROW_COLUMNS}"
    );
    let records = sqlx::query(&sql)
        .bind(i64::from(limit))
        .bind(owner)
        .bind(lease_id.0.to_string())
        .bind(now)
        .bind(lease_ms)
        .fetch_all(pool)
        .await?;
    let mut rows = records
        .iter()
        .map(row_from_record)
        .collect::<Result<Vec<_>, _>>()?;
    rows.sort_by_key(|row| row.id);
    Ok(Claim {
        lease: lease_id,
        rows,
        deadline: started + lease,
        took: started.elapsed(),
    })
}

pub(super) async fn ack(
    pool: &SqlitePool,
    lease: LeaseId,
    outcomes: &[RowOutcome],
) -> Result<Vec<RowId>, Error> {
    let now = now_ms();
    let lease = lease.0.to_string();
    // One transaction for the batch: one fsync, and all-or-nothing like PostgreSQL's single statement.
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    let mut acked = Vec::with_capacity(outcomes.len());
    for row in outcomes {
        let (backoff_ms, error, refund) = match &row.outcome {
            Outcome::Published => (0, None, false),
            Outcome::Retry { after, error } => (duration_ms(*after), Some(error.as_str()), false),
            Outcome::Defer { after, reason } => (duration_ms(*after), Some(reason.as_str()), true),
            Outcome::Dead { error } => (0, Some(error.as_str()), false),
        };
        let status = row.outcome.status();
        let done = sqlx::query(
            "UPDATE switchyard_outbox
                SET status = ?1,
                    published_at = CASE WHEN ?1 = 'published' THEN ?2 ELSE NULL END,
                    next_attempt_at = CASE WHEN ?1 = 'pending' THEN ?2 + ?3 ELSE next_attempt_at END,
                    last_error = ?4,
                    attempts = attempts - ?5,
                    deliveries = ?6,
                    plugin_version = COALESCE(?7, plugin_version),
                    lease_owner = NULL, lease_id = NULL, lease_expires_at = NULL
              WHERE id = ?8 AND status = 'in_flight' AND lease_id = ?9",
        )
        .bind(status)
        .bind(now)
        .bind(backoff_ms)
        .bind(error)
        .bind(i64::from(refund))
        .bind(super::ack::deliveries_json(&row.deliveries))
        .bind(row.plugin_version.as_deref())
        .bind(row.id.0)
        .bind(&lease)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 1 {
            acked.push(row.id);
        }
    }
    tx.commit().await?;
    Ok(acked)
}

fn duration_ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

pub(super) async fn peek_pending(pool: &SqlitePool, limit: u32) -> Result<Vec<OutboxRow>, Error> {
    let sql = format!(
        "SELECT {ROW_COLUMNS} FROM switchyard_outbox WHERE status IN ('pending', 'in_flight') ORDER BY id LIMIT ?1"
    );
    let records = sqlx::query(&sql).bind(i64::from(limit)).fetch_all(pool).await?;
    Ok(records.iter().map(row_from_record).collect::<Result<_, _>>()?)
}
