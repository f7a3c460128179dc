//! Recording outcomes on PostgreSQL: all rows of a batch in one statement,
//! fenced by the lease token, then the parked rows the batch freed.

use sqlx::{Connection, PgConnection, Row};

use crate::store::Error;
use crate::store::dialect::{ARCHIVE_COLUMNS, deliveries_json};
use crate::store::types::{LeaseId, Outcome, PublishedRows, RowId, RowOutcome};

/// The batch's outcomes as arrays, bound as `$1`..`$7` and `$9` and read
/// back with `unnest` (one statement whatever the batch size). `waiting`
/// joins a row's target names with the unit separator: a text array per
/// row does not fit in one array parameter.
const OUTCOMES: &str = "unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::text[],
              $7::bool[], $9::text[])
       AS d(id, status, backoff_ms, error, deliveries, plugin_version, refund, waiting)";

/// Separates target names in the `waiting` parameter.
const UNIT_SEPARATOR: char = '\u{1f}';

/// The columns every outcome sets.
const SET_OUTCOME: &str = "status = d.status,
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
       lease_expires_at = NULL__WAITING__";

/// What sets `waiting_on`, when the schema has it.
const SET_WAITING: &str = ",
       waiting_on = string_to_array(d.waiting, chr(31))";

/// The ack statements keeping, deleting and archiving published rows, for
/// an outbox without and with `waiting_on`. Each returns `id, status,
/// aggregate_type, aggregate_id` of the rows it changed.
static ACK_STATEMENTS: std::sync::LazyLock<[[String; 3]; 2]> =
    std::sync::LazyLock::new(|| [ack_statements(""), ack_statements(SET_WAITING)]);

fn ack_statements(set_waiting: &str) -> [String; 3] {
    let set_outcome = SET_OUTCOME.replace("__WAITING__", set_waiting);
    let update = |published: &str| {
        format!(
            "UPDATE switchyard_outbox o SET {set_outcome}
               FROM d
              WHERE o.id = d.id {published}
                AND o.status = 'in_flight'
                AND o.lease_id = $8
             RETURNING o.id, o.status, o.aggregate_type, o.aggregate_id"
        )
    };
    let removing = |archive: &str| {
        format!(
            "WITH d AS MATERIALIZED (SELECT * FROM {OUTCOMES}),
             gone AS (
                DELETE FROM switchyard_outbox o USING d
                 WHERE o.id = d.id AND d.status = 'published'
                   AND o.status = 'in_flight' AND o.lease_id = $8
                RETURNING o.*, d.deliveries AS new_deliveries, d.plugin_version AS new_plugin_version
             ){archive},
             kept AS ({})
             SELECT id, 'published' AS status, aggregate_type, aggregate_id FROM gone
             UNION ALL SELECT * FROM kept",
            update("AND d.status <> 'published'")
        )
    };
    let archive = format!(
        ", archived AS (
            INSERT INTO switchyard_outbox_archive ({ARCHIVE_COLUMNS})
            SELECT {}
              FROM gone)",
        ARCHIVE_COLUMNS
            .replace("published_at", "now()")
            .replace("deliveries", "new_deliveries::jsonb")
            .replace("plugin_version", "COALESCE(new_plugin_version, plugin_version)")
    );
    [
        format!("WITH d AS (SELECT * FROM {OUTCOMES}) {}", update("")),
        removing(""),
        removing(&archive),
    ]
}

/// Opens the ack's transaction. Its two statements are planned once per
/// session: each call's custom plan (0.3 ms for the unpark) cost more than
/// the statement, and the one generic plan may only probe indexes (with a
/// seq scan allowed, one planned while the outbox was nearly empty scans
/// it whole on every ack as it grows).
fn ack_begin() -> String {
    format!(
        "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan;{}",
        super::connect::set_local_planner("= off")
    )
}

/// Moves the first parked row of each given aggregate back to the queue.
/// Its predecessor has just finished; if another one is still unfinished,
/// the next claim parks the row again behind that one. One probe into each
/// parked index (behind an event, behind a dead letter) per aggregate, when
/// any row is parked at all.
const UNPARK_SQL: &str = "
UPDATE switchyard_outbox o
   SET status = 'pending'
 WHERE o.id = ANY (ARRAY(
       SELECT LEAST(
                (SELECT p.id FROM switchyard_outbox p
                  WHERE p.aggregate_type = f.t AND p.aggregate_id = f.i AND p.queue = 2
                  ORDER BY p.id LIMIT 1),
                (SELECT p.id FROM switchyard_outbox p
                  WHERE p.aggregate_type = f.t AND p.aggregate_id = f.i AND p.queue = 3
                  ORDER BY p.id LIMIT 1))
         FROM (SELECT DISTINCT t, i FROM unnest($1::text[], $2::text[]) AS f(t, i)) f
        -- Evaluated once: most of the time nothing is parked anywhere.
        WHERE EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = 2)
           OR EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = 3)))
   AND o.queue IN (2, 3)";

/// A batch's outcomes as the arrays [`OUTCOMES`] and `switchyard_ack()`
/// read, one element per row.
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

/// Records the outcomes of a batch claimed under `lease` on an outbox
/// migrated before `switchyard_ack()`; returns the ids actually updated (a
/// row whose lease was lost is left alone). On the v2 schema, in the same
/// transaction, the next parked row of every aggregate whose row finished
/// goes back to the queue: a later statement, so it sees what claims that
/// waited for these rows' locks committed.
pub(super) async fn ack(
    session: &mut PgConnection,
    v2: bool,
    waiting_column: bool,
    published_rows: PublishedRows,
    lease: LeaseId,
    outcomes: &Outcomes,
) -> Result<Vec<RowId>, Error> {
    // The v1 schema predates deleting in the ack (and parking).
    let statements = &ACK_STATEMENTS[usize::from(waiting_column)];
    let statement = match (v2, published_rows) {
        (false, _) | (true, PublishedRows::Keep) => &statements[0],
        (true, PublishedRows::Delete) => &statements[1],
        (true, PublishedRows::Archive) => &statements[2],
    };
    // The v1 statements keep the plans they were measured with.
    let mut tx = if v2 {
        session.begin_with(ack_begin()).await?
    } else {
        session.begin().await?
    };
    let updated = outcomes
        .bind(sqlx::query(statement), lease)
        .fetch_all(&mut *tx)
        .await?;
    // A row now waiting for a paused target lets the next one of its
    // aggregate through, as a finished one does (see the claim's `held_by`).
    let waiting_rows: std::collections::HashSet<i64> = outcomes
        .ids
        .iter()
        .zip(&outcomes.waiting)
        .filter(|(_, waiting)| waiting.is_some())
        .map(|(id, _)| *id)
        .collect();
    let mut acked = Vec::with_capacity(updated.len());
    let (mut types, mut aggregates) = (Vec::new(), Vec::new());
    for row in &updated {
        let id: i64 = row.try_get(0)?;
        acked.push(RowId(id));
        let status: &str = row.try_get(1)?;
        if v2 && (status != "pending" || (waiting_column && waiting_rows.contains(&id))) {
            types.push(row.try_get::<String, _>(2)?);
            aggregates.push(row.try_get::<String, _>(3)?);
        }
    }
    // A freed row is announced at commit like a new one: workers do not
    // claim again after every batch on the chance that one was freed.
    if !types.is_empty() && unpark(&mut tx, &types, &aggregates).await? > 0 {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(crate::store::NOTIFY_CHANNEL)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(acked)
}

/// Runs [`UNPARK_SQL`] for the given aggregates.
pub(super) async fn unpark(
    conn: &mut sqlx::PgConnection,
    types: &[String],
    aggregates: &[String],
) -> Result<u64, Error> {
    Ok(sqlx::query(UNPARK_SQL)
        .bind(types)
        .bind(aggregates)
        .execute(conn)
        .await?
        .rows_affected())
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
