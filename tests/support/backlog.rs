//! Backlogs that once defeated the claim, built on purpose: statistics
//! taken while the outbox was drained, then rows whose aggregate heads wait
//! in backoff. Shared by the claim-cost test and relay-bench.

use sqlx::PgPool;

/// Writes `aggregates` x `per_aggregate` rows, aggregate by aggregate
/// interleaved as real traffic is, under aggregate ids `<prefix>-<n>`.
///
/// # Panics
/// When the database refuses the insert.
pub async fn write_backlog(pool: &PgPool, prefix: &str, aggregates: i64, per_aggregate: i64) {
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', $1 || '-' || (n % $2), 'OrderUpdated', jsonb_build_object('seq', n / $2)
           FROM generate_series(0, $2 * $3 - 1) n",
    )
    .bind(prefix)
    .bind(aggregates)
    .bind(per_aggregate)
    .execute(pool)
    .await
    .expect("write the backlog");
}

/// Planner statistics that say the outbox is drained: 20,000 published
/// rows, analyzed, and autovacuum off so that nothing refreshes them.
///
/// # Panics
/// When the database refuses a statement.
pub async fn drained_statistics(pool: &PgPool) {
    execute(
        pool,
        "ALTER TABLE switchyard_outbox SET (autovacuum_enabled = false)",
    )
    .await;
    write_backlog(pool, "history", 2_000, 10).await;
    execute(
        pool,
        "UPDATE switchyard_outbox SET status = 'published', published_at = now(), attempts = 1",
    )
    .await;
    execute(pool, "VACUUM ANALYZE switchyard_outbox").await;
}

/// On top of [`drained_statistics`]: 10,000 rows over 1,000 aggregates
/// whose heads wait an hour in backoff (the broker was down), then 500
/// fresh rows of other aggregates (`fresh-<n>`) that a claim must reach.
///
/// # Panics
/// When the database refuses a statement.
pub async fn heads_in_backoff_on_stale_statistics(pool: &PgPool) {
    drained_statistics(pool).await;
    write_backlog(pool, "backoff", 1_000, 10).await;
    execute(
        pool,
        "UPDATE switchyard_outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour'
          WHERE id IN (SELECT min(id) FROM switchyard_outbox
                        WHERE aggregate_id LIKE 'backoff-%' GROUP BY aggregate_id)",
    )
    .await;
    write_backlog(pool, "fresh", 500, 1).await;
}

async fn execute(pool: &PgPool, sql: &str) {
    sqlx::query(sql)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Every row of `claim` as published, the outcomes a relay acks when each
/// of a batch's messages arrived.
pub fn published_outcomes(claim: &switchyard::store::Claim) -> Vec<switchyard::store::RowOutcome> {
    claim
        .rows
        .iter()
        .map(|row| switchyard::store::RowOutcome {
            id: row.id,
            outcome: switchyard::store::Outcome::Published,
            deliveries: Default::default(),
            plugin_version: None,
        })
        .collect()
}
