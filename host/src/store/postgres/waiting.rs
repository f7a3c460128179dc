//! Rows waiting for a paused target on PostgreSQL: woken in bounded
//! statements when it is back, and counted per target for operators.

use std::collections::BTreeMap;

use sqlx::PgConnection;

use crate::store::Error;

/// Sets up to `limit` rows waiting on `target` (any target when `None`)
/// due now, and forgets what they waited for. Through the waiting index;
/// rows a claim holds are skipped (its ack decides for them).
pub(super) async fn wake(session: &mut PgConnection, target: Option<&str>, limit: u32) -> Result<u64, Error> {
    let woken = sqlx::query(
        "UPDATE switchyard_outbox o
            SET waiting_on = NULL, next_attempt_at = now()
          WHERE o.id = ANY (ARRAY(
                SELECT w.id FROM switchyard_outbox w
                 WHERE w.waiting_on IS NOT NULL
                   AND w.status = 'pending'
                   AND ($1::text IS NULL OR $1 = ANY (w.waiting_on))
                 ORDER BY w.id
                 LIMIT $2
                   FOR UPDATE SKIP LOCKED))
            AND o.waiting_on IS NOT NULL",
    )
    .bind(target)
    .bind(i64::from(limit))
    .execute(session)
    .await?;
    Ok(woken.rows_affected())
}

/// How many pending rows wait on each target.
pub(super) async fn by_target(session: &mut PgConnection) -> Result<BTreeMap<String, i64>, Error> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT t, count(*) FROM switchyard_outbox o, unnest(o.waiting_on) AS t
          WHERE o.waiting_on IS NOT NULL AND o.status = 'pending'
          GROUP BY t",
    )
    .fetch_all(session)
    .await?;
    Ok(rows.into_iter().collect())
}
