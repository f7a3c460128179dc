//! Recording a batch's outcomes on MySQL and MariaDB in a few statements,
//! whatever the batch's size: the rows whose lease still holds are locked
//! and read first (the fence, and the list of what was recorded), then one
//! statement sets every outcome from a derived table of values, joined by
//! id. Row by row, a batch of 500 was 500 round trips and a fifth of a
//! drain's time.

use std::collections::HashSet;
use std::time::Duration;

use sqlx::MySqlConnection;
use sqlx::mysql::MySqlArguments;
use sqlx::query::Query;

use super::placeholders;
use crate::store::Error;
use crate::store::dialect;
use crate::store::types::{Outcome, PublishedRows, RowId, RowOutcome};

type MyQuery<'q> = Query<'q, sqlx::MySql, MySqlArguments>;

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

/// One row's values for the outcome statement.
struct Values {
    id: i64,
    status: &'static str,
    backoff_us: i64,
    error: Option<String>,
    refund: i32,
    deliveries: String,
    plugin_version: Option<String>,
    waiting_on: Option<String>,
}

impl Values {
    fn of(row: &RowOutcome) -> Values {
        let (backoff, error, refund) = match &row.outcome {
            Outcome::Published => (Duration::ZERO, None, false),
            Outcome::Retry { after, error } => (*after, Some(error.clone()), false),
            Outcome::Defer { after, reason, .. } => (*after, Some(reason.clone()), true),
            Outcome::Dead { error } => (Duration::ZERO, Some(error.clone()), false),
        };
        let waiting_on = match &row.outcome {
            Outcome::Defer { waiting_on, .. } if !waiting_on.is_empty() => {
                Some(serde_json::Value::from(waiting_on.clone()).to_string())
            }
            _ => None,
        };
        Values {
            id: row.id.0,
            status: row.outcome.status(),
            backoff_us: micros(backoff),
            error,
            refund: i32::from(refund),
            deliveries: dialect::deliveries_json(&row.deliveries),
            plugin_version: row.plugin_version.clone(),
            waiting_on,
        }
    }
}

/// `(SELECT ? AS id, ... UNION ALL SELECT ?, ...) AS v` for `n` rows.
fn derived(n: usize) -> String {
    let first = "SELECT ? AS id, ? AS status, ? AS backoff_us, ? AS error, ? AS refund, \
                 ? AS deliveries, ? AS plugin_version, ? AS waiting_on";
    let rest = " UNION ALL SELECT ?, ?, ?, ?, ?, ?, ?, ?";
    format!("({first}{}) AS v", rest.repeat(n.saturating_sub(1)))
}

fn bind_values<'q>(mut query: MyQuery<'q>, values: &'q [Values]) -> MyQuery<'q> {
    for row in values {
        query = query
            .bind(row.id)
            .bind(row.status)
            .bind(row.backoff_us)
            .bind(row.error.as_deref())
            .bind(row.refund)
            .bind(&row.deliveries)
            .bind(row.plugin_version.as_deref())
            .bind(row.waiting_on.as_deref());
    }
    query
}

/// Parks the pending events behind each of `heads` (just parked on paused
/// targets) with it: the same targets and next attempt, so that the
/// relay that wakes those targets, or the sweep when the backoff runs
/// out, brings them back together. Claims read past none of them
/// meanwhile; before, every claim read each one and its head check (most
/// of MariaDB's work during an outage when services write several events
/// of an aggregate at once). Parking only keeps rows from claims, which
/// still check each head, so it cannot reorder. Events written behind a
/// head after this are set waiting by the relay's 30-second sweep
/// (`OutboxStore::park_followers`).
async fn park_followers(tx: &mut MySqlConnection, heads: &[i64]) -> Result<(), Error> {
    let sql = format!(
        "UPDATE switchyard_outbox f FORCE INDEX (switchyard_outbox_aggregate_idx)
           JOIN switchyard_outbox h ON f.aggregate_key = h.aggregate_key AND f.id > h.id
            SET f.waiting_on = h.waiting_on, f.next_attempt_at = h.next_attempt_at
          WHERE h.id IN ({}) AND h.status = 'pending' AND h.waiting_on IS NOT NULL
            AND f.status = 'pending' AND f.waiting_on IS NULL",
        placeholders(heads.len())
    );
    let mut query = sqlx::query(&sql);
    for id in heads {
        query = query.bind(id);
    }
    query.execute(&mut *tx).await?;
    Ok(())
}

/// Records `outcomes` under `lease` in the caller's transaction; the ids
/// recorded (those whose lease still held), in the batch's order.
pub(super) async fn record(
    tx: &mut MySqlConnection,
    lease: &str,
    outcomes: &[RowOutcome],
    published_rows: PublishedRows,
) -> Result<Vec<RowId>, Error> {
    let ids: Vec<i64> = outcomes.iter().map(|row| row.id.0).collect();
    let sql = format!(
        "SELECT id FROM switchyard_outbox
          WHERE id IN ({}) AND status = 'in_flight' AND lease_id = ? FOR UPDATE",
        placeholders(ids.len())
    );
    let mut query = sqlx::query_scalar::<_, i64>(&sql);
    for id in &ids {
        query = query.bind(id);
    }
    let held: HashSet<i64> = query.bind(lease).fetch_all(&mut *tx).await?.into_iter().collect();
    let (removed, kept): (Vec<&RowOutcome>, Vec<&RowOutcome>) = outcomes
        .iter()
        .filter(|row| held.contains(&row.id.0))
        .partition(|row| row.outcome == Outcome::Published && published_rows != PublishedRows::Keep);
    if !kept.is_empty() {
        let values: Vec<Values> = kept.iter().map(|row| Values::of(row)).collect();
        // Every value comes from `v`, never from a column already set:
        // MySQL evaluates SET assignments left to right, each seeing the
        // ones before.
        let sql = format!(
            "UPDATE switchyard_outbox o JOIN {} ON o.id = v.id
                SET o.published_at = IF(v.status = 'published', NOW(6), NULL),
                    o.next_attempt_at = IF(v.status = 'pending', NOW(6) + INTERVAL v.backoff_us MICROSECOND,
                                           o.next_attempt_at),
                    o.status = v.status,
                    o.last_error = v.error,
                    o.attempts = o.attempts - v.refund,
                    o.deliveries = v.deliveries,
                    o.plugin_version = COALESCE(v.plugin_version, o.plugin_version),
                    o.lease_owner = NULL, o.lease_id = NULL, o.lease_expires_at = NULL,
                    o.waiting_on = v.waiting_on",
            derived(values.len())
        );
        bind_values(sqlx::query(&sql), &values).execute(&mut *tx).await?;
        let parked: Vec<i64> = values
            .iter()
            .filter(|row| row.waiting_on.is_some())
            .map(|row| row.id)
            .collect();
        if !parked.is_empty() {
            park_followers(tx, &parked).await?;
        }
    }
    if !removed.is_empty() {
        let values: Vec<Values> = removed.iter().map(|row| Values::of(row)).collect();
        if published_rows == PublishedRows::Archive {
            let columns = dialect::ARCHIVE_COLUMNS;
            let selected = columns
                .split(',')
                .map(|column| match column.trim() {
                    "published_at" => "NOW(6)".to_string(),
                    "deliveries" => "v.deliveries".to_string(),
                    "plugin_version" => "COALESCE(v.plugin_version, o.plugin_version)".to_string(),
                    other => format!("o.{other}"),
                })
                .collect::<Vec<_>>()
                .join(", ");
            let sql = format!(
                "INSERT INTO switchyard_outbox_archive ({columns})
                 SELECT {selected} FROM switchyard_outbox o JOIN {} ON o.id = v.id",
                derived(values.len())
            );
            bind_values(sqlx::query(&sql), &values).execute(&mut *tx).await?;
        }
        let sql = format!(
            "DELETE FROM switchyard_outbox WHERE id IN ({})",
            placeholders(values.len())
        );
        let mut query = sqlx::query(&sql);
        for row in &values {
            query = query.bind(row.id);
        }
        query.execute(&mut *tx).await?;
    }
    Ok(outcomes
        .iter()
        .filter(|row| held.contains(&row.id.0))
        .map(|row| row.id)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::derived;

    #[test]
    fn the_derived_table_has_eight_parameters_a_row() {
        for n in [1, 2, 500] {
            assert_eq!(derived(n).matches('?').count(), 8 * n);
        }
    }
}
