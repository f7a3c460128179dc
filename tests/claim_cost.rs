//! What a claim costs where the v1 claim degraded: statistics taken while
//! the outbox was drained (its normal state) and then a backlog whose
//! aggregate heads wait in backoff; and 100,000 rows queued behind 100
//! in-flight heads; and 100,000 rows waiting in the intake. Rows of other
//! aggregates must still be reached, and no claim may pass over the
//! backlog to reach them.
//!
//! The cost is counted, not timed: the shared buffers each claim statement
//! touched, from `pg_stat_statements` (loaded by `scripts/services.sh`),
//! read before and after it. A claim that stepped over each blocked row
//! once would touch at least a buffer per row: 100,000. One that probes
//! indexes touches a few per row it claims, parks or moves, and a handful
//! more, at any backlog depth. So a bound per claim of
//! [`BUFFERS_PER_ROW`] per such row plus [`BUFFERS_BASE`] fails a claim
//! that walks the backlog through an index, and no machine's speed moves
//! the count (the times are printed beside it; `relay-bench` measures
//! them). A sequential scan touches a page, not a row, and is what the
//! claim sessions' planner settings rule out (`INDEX_PROBES_ONLY` in
//! `store::postgres::connect`): part 1 claims through a pool of its own,
//! with the settings in the claim's transaction, parts 2 and 3 through the
//! relay's sessions.

use std::time::Duration;
use switchyard::store::{Claim, OutboxStore};
use switchyard_tests::backlog::{
    drained_statistics, heads_in_backoff_on_stale_statistics, published_outcomes, write_backlog,
};
use switchyard_tests::postgres::fresh_db;

/// Longer than any part of the test runs on a loaded machine: the 100
/// in-flight heads of part 2 must stay in flight while it parks the rows
/// behind them (with a minute, their leases ran out in a CI run and their
/// rows were rightly claimed again).
const LEASE: Duration = Duration::from_secs(3_600);
const BATCH: u32 = 500;
/// Buffers a claim may touch for each row it claims or parks (a row moved
/// from the intake is claimed in the same statement): index probes, the
/// heap tuple, the new version and its index entries, and the dead
/// versions earlier claims left in the index until vacuum. Measured: 25
/// to 95 for a parked row (claims of 50 touched 1,700 to 5,300), about 24
/// for a moved and claimed one.
const BUFFERS_PER_ROW: i64 = 150;
/// Buffers a claim may touch however few rows it returns: the index roots
/// and the first pages of each probe. Measured: about 500.
const BUFFERS_BASE: i64 = 1_000;
/// The backlog behind heads in backoff (part 1) and behind in-flight heads
/// (part 2): a claim that touched each of its rows once would pass any
/// bound below it.
const STALE_ROWS: i64 = 10_000;
const DEEP_ROWS: i64 = 100_000;
/// Rows a claim sets aside at most beside a backlog (what part 1's claims
/// return: none claimed, these parked).
const PARKED_PER_CLAIM: i64 = 50;
// The bound of a claim beside each backlog stays below it: the count tells
// a claim that probes from one that walks.
const _: () = assert!(BUFFERS_BASE + BUFFERS_PER_ROW * PARKED_PER_CLAIM < STALE_ROWS);
const _: () = assert!(BUFFERS_BASE + BUFFERS_PER_ROW * (BATCH as i64) < DEEP_ROWS);

/// A fresh outbox whose planner statistics say it is drained.
async fn outbox_with_drained_statistics() -> (switchyard_tests::postgres::TestDb, OutboxStore) {
    let db = fresh_db().await;
    drained_statistics(&db.pool).await;
    // Connected as a relay connects: the settings are its sessions'.
    let store = OutboxStore::connect(&db.url, 4).await.unwrap();
    (db, store)
}

/// The claim statement's figures in one database's `pg_stat_statements`.
/// Reading its query texts reads the file that holds every entry's text,
/// whole: once the suite's databases have filled the table, tens of MB and
/// most of a second per read, thousands of reads per test. So the claim's
/// entries are found by their text once, then read by `queryid` without
/// texts. (A `queryid` is per database, as it hashes the table's oid; it
/// stays the same when an evicted entry is made again.)
struct ClaimFigures {
    entries: Vec<i64>,
}

impl ClaimFigures {
    fn new() -> ClaimFigures {
        ClaimFigures { entries: Vec::new() }
    }

    /// The shared buffers the claim statement has touched in this database
    /// so far (hit or read), and its calls.
    async fn read(&mut self, db: &switchyard_tests::postgres::TestDb) -> (i64, i64) {
        const THIS_DATABASE: &str = "(SELECT oid FROM pg_database WHERE datname = current_database())";
        if self.entries.is_empty() {
            self.entries = sqlx::query_scalar(&format!(
                "SELECT queryid FROM pg_stat_statements WHERE dbid = {THIS_DATABASE} AND query LIKE $1"
            ))
            .bind("%AS statement_s%")
            .fetch_all(&db.pool)
            .await
            .expect("pg_stat_statements is loaded (scripts/services.sh sets shared_preload_libraries)");
        }
        sqlx::query_as(&format!(
            "SELECT COALESCE(sum(shared_blks_hit + shared_blks_read), 0)::bigint, COALESCE(sum(calls), 0)::bigint
               FROM pg_stat_statements(false)
              WHERE dbid = {THIS_DATABASE} AND queryid = ANY($1)"
        ))
        .bind(&self.entries)
        .fetch_one(&db.pool)
        .await
        .expect("pg_stat_statements is loaded (scripts/services.sh sets shared_preload_libraries)")
    }
}

/// Makes `pg_stat_statements` readable in the test's database.
async fn statement_figures(db: &switchyard_tests::postgres::TestDb) {
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&db.pool)
        .await
        .unwrap();
}

/// Claims until a claim neither claims nor parks anything, counting each
/// claim's buffers against the bound (see the module doc), and with `ack`
/// publishes each batch; returns the claims.
async fn claim_until_quiet(
    db: &switchyard_tests::postgres::TestDb,
    store: &OutboxStore,
    owner: &str,
    ack: bool,
) -> Vec<Claim> {
    let mut claims: Vec<Claim> = Vec::new();
    let mut buffers: Vec<i64> = Vec::new();
    let mut times: Vec<Duration> = Vec::new();
    let mut figures = ClaimFigures::new();
    let mut before = figures.read(db).await;
    let mut unseen = 0;
    loop {
        let claim = store.claim(owner, BATCH, LEASE).await.unwrap();
        let after = figures.read(db).await;
        let (touched, calls) = (after.0 - before.0, after.1 - before.1);
        before = after;
        let rows = i64::try_from(claim.rows.len() + claim.parked as usize).unwrap();
        let bound = BUFFERS_BASE + BUFFERS_PER_ROW * rows;
        if calls != 1 {
            // The statement's entry was evicted and made again (another
            // database's statements filled the table): this claim was not
            // measured. Rare with scripts/services.sh's pg_stat_statements.max.
            unseen += 1;
            assert!(
                unseen <= 3,
                "pg_stat_statements lost the claim's figures {unseen} times"
            );
            if ack {
                store.ack(claim.lease, &published_outcomes(&claim)).await.unwrap();
            }
            let quiet = claim.rows.is_empty() && claim.parked == 0;
            claims.push(claim);
            if quiet {
                break;
            }
            continue;
        }
        assert!(
            touched > 0,
            "pg_stat_statements saw claim {} (it counts the claim statement)",
            claims.len() + 1
        );
        assert!(
            touched <= bound,
            "claim {} touched {touched} buffers, over {bound} for {rows} rows claimed or parked \
             (a moved row is claimed): it passed over the backlog",
            claims.len() + 1
        );
        buffers.push(touched);
        times.extend(claim.statement);
        let quiet = claim.rows.is_empty() && claim.parked == 0;
        if ack {
            store.ack(claim.lease, &published_outcomes(&claim)).await.unwrap();
        }
        claims.push(claim);
        if quiet || claims.len() > 3_000 {
            break;
        }
    }
    buffers.sort_unstable();
    times.sort_unstable();
    eprintln!(
        "{} claims: buffers p50 {}, max {}; statement p50 {:?}, max {:?}",
        claims.len(),
        buffers[buffers.len() / 2],
        buffers[buffers.len() - 1],
        times.get(times.len() / 2),
        times.last()
    );
    claims
}

#[tokio::test]
async fn claims_touch_what_they_claim_not_the_backlog_on_stale_statistics_and_deep_blocked_backlogs() {
    // 1. Statistics from a drained outbox, then 10,000 rows whose aggregate
    //    heads wait in backoff (the broker was down), then 500 fresh rows of
    //    other aggregates that must still be claimed.
    let db = fresh_db().await;
    statement_figures(&db).await;
    heads_in_backoff_on_stale_statistics(&db.pool).await;
    let store = OutboxStore::new(db.pool.clone());
    let claims = claim_until_quiet(&db, &store, "stale", false).await;
    let claimed: Vec<_> = claims.iter().flat_map(|c| &c.rows).collect();
    assert_eq!(
        claimed.len(),
        500,
        "every fresh row and nothing behind a head in backoff"
    );
    assert!(claimed.iter().all(|row| row.aggregate_id.starts_with("fresh-")));

    // 2. 100 in-flight heads with 100,000 rows behind them, then 500 rows of
    //    other aggregates at the end of the queue.
    let (db, store) = outbox_with_drained_statistics().await;
    statement_figures(&db).await;
    write_backlog(&db.pool, "deep", 100, 1_000).await;
    let heads = store.claim("heads", 100, LEASE).await.unwrap();
    assert_eq!(heads.rows.len(), 100);
    write_backlog(&db.pool, "fresh", 500, 1).await;
    let claims = claim_until_quiet(&db, &store, "deep", false).await;
    let claimed: Vec<_> = claims.iter().flat_map(|c| &c.rows).collect();
    assert_eq!(claimed.len(), 500);
    assert!(claimed.iter().all(|row| row.aggregate_id.starts_with("fresh-")));
    // Once parked, the blocked rows cost nothing: an empty claim touches
    // no more than the base.
    let mut figures = ClaimFigures::new();
    for _ in 0..5 {
        let before = figures.read(&db).await;
        let idle = store.claim("idle", BATCH, LEASE).await.unwrap();
        assert!(idle.rows.is_empty() && idle.parked == 0);
        let after = figures.read(&db).await;
        let touched = after.0 - before.0;
        assert!(
            after.1 != before.1 + 1 || touched <= BUFFERS_BASE,
            "an empty claim touched {touched} buffers behind 100,000 parked rows"
        );
    }
    // Rows of other aggregates arriving through the intake behind those
    // 100,000: each moved row's test for an unfinished predecessor is a
    // probe, not a pass over the unfinished rows (as NOT EXISTS, planned
    // as one, the first claim here ran 66 ms).
    sqlx::query(
        "INSERT INTO switchyard_intake (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'moved-' || n, 'OrderCreated', '{}' FROM generate_series(1, 100) n",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let claims = claim_until_quiet(&db, &store, "moved", false).await;
    let claimed: Vec<_> = claims.iter().flat_map(|c| &c.rows).collect();
    assert_eq!(claimed.len(), 100);
    assert!(claimed.iter().all(|row| row.aggregate_id.starts_with("moved-")));

    // 3. 100,000 rows in the intake (writers went on while no relay ran),
    //    its statistics taken while it was empty, each row the head of its
    //    aggregate: every claim moves rows and leases a full batch, oldest
    //    first, within the bound; each batch is acked, as a relay's is.
    let (db, store) = outbox_with_drained_statistics().await;
    statement_figures(&db).await;
    sqlx::query("ANALYZE switchyard_intake")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO switchyard_intake (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'intake-' || n, 'OrderCreated', jsonb_build_object('n', n)
           FROM generate_series(1, 100000) n",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let claims = claim_until_quiet(&db, &store, "intake", true).await;
    let order: Vec<i64> = claims
        .iter()
        .flat_map(|c| &c.rows)
        .map(|row| {
            let payload: serde_json::Value =
                serde_json::from_str(row.payload_json.as_deref().unwrap()).unwrap();
            payload["n"].as_i64().unwrap()
        })
        .collect();
    assert!(
        order.iter().copied().eq(1..=100_000),
        "claimed in the intake's order, each once"
    );
}
