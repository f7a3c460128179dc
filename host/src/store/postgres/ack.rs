//! Recording outcomes on PostgreSQL: all rows of a batch in one statement,
//! fenced by the lease token.

use sqlx::{PgPool, Row};

use crate::store::Error;
use crate::store::dialect::deliveries_json;
use crate::store::types::{LeaseId, Outcome, RowId, RowOutcome};

const ACK_SQL: &str = r#"
UPDATE switchyard_outbox o
   SET status = d.status,
       published_at = CASE WHEN d.status = 'published' THEN now() ELSE NULL END,
       next_attempt_at = CASE WHEN d.status = 'pending'
                              THEN now() + d.backoff_ms * interval '1 millisecond'
                              ELSE o.next_attempt_at END,
       last_error = d.error,
       attempts = o.attempts - CASE WHEN d.refund THEN 1 ELSE 0 END,
       deliveries = d.deliveries::jsonb,
       plugin_version = COALESCE(d.plugin_version, o.plugin_version),
       lease_owner = NULL,
       lease_id = NULL,
       lease_expires_at = NULL
  FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::text[], $7::bool[])
       AS d(id, status, backoff_ms, error, deliveries, plugin_version, refund)
 WHERE o.id = d.id
   AND o.status = 'in_flight'
   AND o.lease_id = $8
RETURNING o.id
"#;

/// Records the outcomes of a batch claimed under `lease`; returns the ids
/// actually updated (a row whose lease was lost is left alone).
pub(super) async fn ack(pool: &PgPool, lease: LeaseId, outcomes: &[RowOutcome]) -> Result<Vec<RowId>, Error> {
    let mut ids = Vec::with_capacity(outcomes.len());
    let mut statuses = Vec::with_capacity(outcomes.len());
    let mut backoffs = Vec::with_capacity(outcomes.len());
    let mut errors = Vec::with_capacity(outcomes.len());
    let mut deliveries = Vec::with_capacity(outcomes.len());
    let mut versions = Vec::with_capacity(outcomes.len());
    let mut refunds = Vec::with_capacity(outcomes.len());
    for row in outcomes {
        ids.push(row.id.0);
        statuses.push(row.outcome.status());
        let (backoff, error) = match &row.outcome {
            Outcome::Published => (0, None),
            Outcome::Retry { after, error } => (
                i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                Some(error.clone()),
            ),
            Outcome::Defer { after, reason } => (
                i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                Some(reason.clone()),
            ),
            Outcome::Dead { error } => (0, Some(error.clone())),
        };
        refunds.push(matches!(row.outcome, Outcome::Defer { .. }));
        backoffs.push(backoff);
        // PostgreSQL text cannot hold NUL; plugin-supplied reasons might.
        errors.push(error.map(|e| e.replace('\0', "\u{FFFD}")));
        deliveries.push(deliveries_json(&row.deliveries));
        versions.push(row.plugin_version.clone());
    }
    let updated = sqlx::query(ACK_SQL)
        .bind(&ids)
        .bind(&statuses)
        .bind(&backoffs)
        .bind(&errors)
        .bind(&deliveries)
        .bind(&versions)
        .bind(&refunds)
        .bind(lease.0)
        .fetch_all(pool)
        .await?;
    updated
        .iter()
        .map(|row| row.try_get::<i64, _>("id").map(RowId))
        .collect::<Result<_, _>>()
        .map_err(Error::from)
}
