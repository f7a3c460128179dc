//! Claiming a batch on PostgreSQL: one statement that picks the heads of
//! aggregates, locks them with SKIP LOCKED and stamps a fresh lease on them.

use std::time::{Duration, Instant};

use sqlx::{PgPool, Row};

use crate::store::Error;
use crate::store::types::{Claim, LeaseId, OutboxRow, RowId};

/// The columns every row query returns, in the order [`row_from_record`] reads.
const ROW_COLUMNS: &str = "o.id, o.event_id, o.aggregate_type, o.aggregate_id, o.event_type,
          o.payload::text AS payload_json, o.payload_bytes, o.headers::text AS headers_json,
          o.tenant, (extract(epoch FROM o.created_at) * 1000)::bigint AS created_at_ms,
          o.attempts, o.deliveries::text AS deliveries_json";

/// Reads a row selected with [`ROW_COLUMNS`] first. By position: a lookup by
/// name hashes the column name, per column and row, on the claim path.
fn row_from_record(record: &sqlx::postgres::PgRow) -> Result<OutboxRow, sqlx::Error> {
    let deliveries_json: String = record.try_get(11)?;
    Ok(OutboxRow {
        // The column is a uuid: PostgreSQL refuses anything else at insert.
        malformed: None,
        id: RowId(record.try_get(0)?),
        event_id: record.try_get(1)?,
        aggregate_type: record.try_get(2)?,
        aggregate_id: record.try_get(3)?,
        event_type: record.try_get(4)?,
        payload_json: record.try_get(5)?,
        payload_bytes: record.try_get(6)?,
        headers_json: record.try_get(7)?,
        tenant: record.try_get(8)?,
        created_at_ms: record.try_get(9)?,
        attempts: record.try_get(10)?,
        // Written only by the relay; an unreadable value means "nothing acked yet".
        deliveries: serde_json::from_str(&deliveries_json).unwrap_or_default(),
    })
}

/// SQLSTATE of a statement cancelled by `statement_timeout`.
const QUERY_CANCELED: &str = "57014";

/// The claim statement, assembled once: index 0 lets later events of an
/// aggregate pass a dead-lettered one, index 1 keeps them waiting.
static CLAIM_STATEMENTS: std::sync::LazyLock<[String; 2]> = std::sync::LazyLock::new(|| {
    let base = CLAIM_SQL.replace("__ROW_COLUMNS__", ROW_COLUMNS);
    [
        base.replace("__DEAD_FILTER__", "AND e.status <> 'dead'"),
        base.replace("__DEAD_FILTER__", ""),
    ]
});

// `$1` limit, `$2` owner, `$3` lease id, `$4` lease in ms.
// The head-of-line test reads the aggregate index; its predicate
// (`status <> 'published'`) appears verbatim so the planner can use it.
const CLAIM_SQL: &str = r#"
WITH heads AS (
    SELECT o.id
      FROM switchyard_outbox o
     WHERE o.status IN ('pending', 'in_flight')
       AND (   (o.status = 'pending' AND o.next_attempt_at <= now()
                AND (o.not_before IS NULL OR o.not_before <= now()))
            OR (o.status = 'in_flight' AND o.lease_expires_at < now()))
       AND NOT EXISTS (
             SELECT 1 FROM switchyard_outbox e
              WHERE e.aggregate_type = o.aggregate_type
                AND e.aggregate_id = o.aggregate_id
                AND e.id < o.id
                AND e.status <> 'published'
                __DEAD_FILTER__)
     ORDER BY o.id
     LIMIT $1
       FOR UPDATE SKIP LOCKED
)
UPDATE switchyard_outbox o
   SET status = 'in_flight',
       lease_owner = $2,
       lease_id = $3,
       lease_expires_at = now() + $4 * interval '1 millisecond',
       attempts = o.attempts + 1
  FROM heads
 WHERE o.id = heads.id
RETURNING __ROW_COLUMNS__
"#;

/// Reads up to `limit` unfinished rows in id order without claiming or
/// changing anything, in a read-only transaction (for dry runs).
pub(super) async fn peek_pending(pool: &PgPool, limit: u32) -> Result<Vec<OutboxRow>, Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION READ ONLY").execute(&mut *tx).await?;
    let sql = format!(
        "SELECT {ROW_COLUMNS} FROM switchyard_outbox o
          WHERE o.status IN ('pending', 'in_flight') ORDER BY o.id LIMIT $1"
    );
    let records = sqlx::query(&sql)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
    tx.rollback().await?;
    Ok(records.iter().map(row_from_record).collect::<Result<_, _>>()?)
}

/// Claims up to `limit` rows for `owner`, leased for `lease`.
pub(super) async fn claim(
    pool: &PgPool,
    dead_letter_blocks_aggregate: bool,
    owner: &str,
    limit: u32,
    lease: Duration,
) -> Result<Claim, Error> {
    let started = Instant::now();
    let lease_id = LeaseId(uuid::Uuid::new_v4());
    let sql = &CLAIM_STATEMENTS[usize::from(dead_letter_blocks_aggregate)];
    let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
    // A claim slower than half the lease is of no use: its rows could not
    // be published before the lease ends. Bounding it stops a plan gone
    // wrong (statistics taken while the outbox was drained) from running
    // for minutes; the relay then refreshes the statistics.
    let mut tx = pool.begin().await?;
    sqlx::query(&format!(
        "SET LOCAL statement_timeout = {}",
        (lease_ms / 2).max(1)
    ))
    .execute(&mut *tx)
    .await?;
    let records = match sqlx::query(sql)
        .bind(i64::from(limit))
        .bind(owner)
        .bind(lease_id.0)
        .bind(lease_ms)
        .fetch_all(&mut *tx)
        .await
    {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(QUERY_CANCELED) => {
            return Err(Error::ClaimTimedOut {
                after: started.elapsed(),
            });
        }
        records => records?,
    };
    tx.commit().await?;
    let mut rows = records
        .iter()
        .map(row_from_record)
        .collect::<Result<Vec<_>, _>>()?;
    // UPDATE ... RETURNING gives no order guarantee.
    rows.sort_by_key(|row| row.id);
    Ok(Claim {
        lease: lease_id,
        rows,
        deadline: started + lease,
        took: started.elapsed(),
    })
}
