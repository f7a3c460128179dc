//! Recording outcomes on PostgreSQL: all rows of a batch in one call of
//! `switchyard_ack()`, fenced by the lease token, which also sends back to
//! the queue the parked rows the batch freed.

use sqlx::{PgConnection, Row};

use crate::store::Error;
use crate::store::dialect::deliveries_json;
use crate::store::types::{LeaseId, Outcome, PublishedRows, RowId, RowOutcome};

/// Separates target names in the `waiting` parameter.
const UNIT_SEPARATOR: char = '\u{1f}';

/// A batch's outcomes as the arrays `switchyard_ack()` reads, one element
/// per row. `waiting` joins a row's target names with the unit separator:
/// a text array per row does not fit in one array parameter.
pub(super) struct Outcomes {
    ids: Vec<i64>,
    statuses: Vec<&'static str>,
    backoffs: Vec<i64>,
    errors: Vec<Option<String>>,
    deliveries: Vec<String>,
    versions: Vec<Option<String>>,
    refunds: Vec<bool>,
    /// A row's paused targets, joined by [`UNIT_SEPARATOR`]; `None` when it
    /// waits for none.
    waiting: Vec<Option<String>>,
}

impl Outcomes {
    pub(super) fn of(outcomes: &[RowOutcome]) -> Outcomes {
        let mut arrays = Outcomes {
            ids: Vec::with_capacity(outcomes.len()),
            statuses: Vec::with_capacity(outcomes.len()),
            backoffs: Vec::with_capacity(outcomes.len()),
            errors: Vec::with_capacity(outcomes.len()),
            deliveries: Vec::with_capacity(outcomes.len()),
            versions: Vec::with_capacity(outcomes.len()),
            refunds: Vec::with_capacity(outcomes.len()),
            waiting: Vec::with_capacity(outcomes.len()),
        };
        for row in outcomes {
            arrays.ids.push(row.id.0);
            arrays.statuses.push(row.outcome.status());
            let (backoff, error) = match &row.outcome {
                Outcome::Published => (0, None),
                Outcome::Retry { after, error } => (
                    i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                    Some(error.clone()),
                ),
                Outcome::Defer { after, reason, .. } => (
                    i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                    Some(reason.clone()),
                ),
                Outcome::Dead { error } => (0, Some(error.clone())),
            };
            arrays.refunds.push(matches!(row.outcome, Outcome::Defer { .. }));
            arrays.waiting.push(match &row.outcome {
                Outcome::Defer { waiting_on, .. } if !waiting_on.is_empty() => {
                    Some(waiting_on.join(&UNIT_SEPARATOR.to_string()))
                }
                _ => None,
            });
            arrays.backoffs.push(backoff);
            // PostgreSQL text cannot hold NUL; plugin-supplied reasons might.
            arrays.errors.push(error.map(|e| e.replace('\0', "\u{FFFD}")));
            arrays.deliveries.push(deliveries_json(&row.deliveries));
            arrays.versions.push(row.plugin_version.clone());
        }
        arrays
    }

    /// Binds the arrays as `$1`..`$7` and `$9`, and `lease` as `$8`.
    fn bind<'q>(
        &'q self,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        lease: LeaseId,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        query
            .bind(&self.ids)
            .bind(&self.statuses)
            .bind(&self.backoffs)
            .bind(&self.errors)
            .bind(&self.deliveries)
            .bind(&self.versions)
            .bind(&self.refunds)
            .bind(lease.0)
            .bind(&self.waiting)
    }
}

/// Records the outcomes of a batch claimed under `lease` in one call of
/// `switchyard_ack()` (migration 20261202000000), which also moves back to
/// the queue the parked rows the batch freed; returns the ids actually
/// updated (a row whose lease was lost is left alone).
pub(super) async fn ack_in_one_call(
    session: &mut PgConnection,
    published_rows: PublishedRows,
    lease: LeaseId,
    outcomes: &Outcomes,
) -> Result<Vec<RowId>, Error> {
    let published_rows = match published_rows {
        PublishedRows::Keep => "keep",
        PublishedRows::Delete => "delete",
        PublishedRows::Archive => "archive",
    };
    let call = sqlx::query("SELECT switchyard_ack($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)");
    let acked: Vec<i64> = outcomes
        .bind(call, lease)
        .bind(published_rows)
        .fetch_one(session)
        .await?
        .try_get(0)?;
    Ok(acked.into_iter().map(RowId).collect())
}

/// The backstop for a parked row no ack will free (its predecessor was
/// purged from the dead letters, or deleted by hand): up to `limit` parked
/// rows with no earlier unfinished row in their aggregate go back to the
/// queue. Parked rows count as unfinished here, so only the first of each
/// aggregate moves.
pub(super) async fn unpark_stranded(
    session: &mut PgConnection,
    dead_letter_blocks: bool,
    limit: u32,
) -> Result<u64, Error> {
    let dead_filter = if dead_letter_blocks {
        ""
    } else {
        "AND e.queue <> 4"
    };
    let sql = format!(
        "UPDATE switchyard_outbox o
            SET status = 'pending'
          WHERE o.id IN (
                SELECT p.id FROM switchyard_outbox p
                 WHERE p.queue IN (2, 3)
                   AND NOT EXISTS (
                       SELECT 1 FROM switchyard_outbox e
                        WHERE e.aggregate_type = p.aggregate_type
                          AND e.aggregate_id = p.aggregate_id
                          AND e.id < p.id
                          AND e.published_at IS NULL
                          AND e.queue IS NOT NULL
                          {dead_filter})
                 ORDER BY p.aggregate_type, p.aggregate_id, p.id
                 LIMIT $1
                   FOR UPDATE SKIP LOCKED)
            AND o.queue IN (2, 3)"
    );
    Ok(sqlx::query(&sql)
        .bind(i64::from(limit))
        .execute(session)
        .await?
        .rows_affected())
}
