//! Rows parked on a paused target, on MariaDB: claims read past none of
//! them, a relay that sees the target back wakes them, and one whose
//! backoff ran out with nobody to wake it goes back to the claims.

use std::time::Duration;

use switchyard::store::{OutboxStore, Outcome};
use switchyard_tests::outbox::TestOutbox;

use super::{LEASE, outcome, seq};

/// Parked rows a test writes: a ten-minute outage at 700 events a second
/// over many aggregates parks 420,000; the claim's cost grew with them.
const PARKED: i64 = 20_000;

/// `PARKED` rows as an outage leaves them, each the head of its own
/// aggregate, parked on `nats` with its next attempt days out, all before
/// anything due.
async fn park_many(db: &TestOutbox) {
    db.execute(&format!(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, waiting_on, next_attempt_at)
         SELECT 'order', concat('parked-', seq), 'OrderPlaced', '{{\"seq\": 0}}', '[\"nats\"]', NOW(6) + INTERVAL 7 DAY
           FROM seq_1_to_{PARKED}"
    ))
    .await;
}

/// Rows of the outbox table InnoDB handed to statements since the server
/// started (`information_schema.TABLE_STATISTICS`, counted with `userstat`
/// on): the test's own database, so no other test counts here.
async fn rows_read(db: &TestOutbox) -> i64 {
    let pool = db.mysql_pool();
    sqlx::query("SET GLOBAL userstat = ON")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT CAST(coalesce(sum(rows_read), 0) AS SIGNED) FROM information_schema.TABLE_STATISTICS
          WHERE table_schema = DATABASE() AND table_name = 'switchyard_outbox'",
    )
    .fetch_one(&pool)
    .await
    .unwrap()
}

/// The rows read by one claim of `store`, and what it took.
async fn claim_counted(db: &TestOutbox, store: &OutboxStore) -> (i64, Vec<u64>) {
    let before = rows_read(db).await;
    let claim = store.claim("a", 100, LEASE).await.unwrap();
    let read = rows_read(db).await - before;
    let taken = claim.rows.iter().map(seq).collect();
    store.release_owner("a").await.unwrap();
    (read, taken)
}

/// Three due events behind 20,000 parked rows: the claim takes the three
/// and reads a handful of rows, not the parked ones. On the previous
/// schema (no `parked` index: a relay upgraded before `switchyard
/// migrate` ran) it still takes them, reading every parked row, and
/// `migrate` brings the cheap claim back.
#[tokio::test]
async fn mariadb_claims_read_past_no_parked_row() {
    let db = TestOutbox::mariadb().await;
    park_many(&db).await;
    for seq in 1..=3 {
        db.insert(0, seq, None).await;
    }
    let (read, taken) = claim_counted(&db, &db.store).await;
    assert_eq!(taken, [1], "the due head, not a parked row");
    assert!(read < 100, "a claim read {read} rows beside {PARKED} parked ones");

    db.execute(
        "ALTER TABLE switchyard_outbox DROP INDEX switchyard_outbox_due_idx, DROP COLUMN parked;
         DELETE FROM _sqlx_migrations WHERE version = 20261209000000",
    )
    .await;
    let previous = OutboxStore::connect(&db.url, 2).await.unwrap();
    assert_eq!(
        previous.generation().await.unwrap(),
        switchyard::store::Generation::Previous
    );
    let (read, taken) = claim_counted(&db, &previous).await;
    assert_eq!(taken, [1]);
    assert!(
        read >= PARKED,
        "the previous schema's claim reads the parked rows (read {read}); if not, this test measures nothing"
    );

    previous.migrate().await.unwrap();
    let current = OutboxStore::connect(&db.url, 2).await.unwrap();
    assert_eq!(
        current.generation().await.unwrap(),
        switchyard::store::Generation::Current
    );
    let (read, taken) = claim_counted(&db, &current).await;
    assert_eq!(taken, [1]);
    assert!(read < 100, "after migrate a claim read {read} rows");
}

/// A parked row is claimed again only when woken: by the relay that sees
/// its target back, or, when none does, by the sweep once its backoff ran
/// out. Neither charges an attempt, and the events behind it wait.
#[tokio::test]
async fn mariadb_a_parked_row_comes_back_when_woken_or_its_backoff_runs_out() {
    let db = TestOutbox::mariadb().await;
    for seq in 0..2 {
        db.insert(0, seq, None).await;
    }
    let store = &db.store;
    let park = |claim: &switchyard::store::Claim| {
        assert_eq!(
            claim.rows.iter().map(seq).collect::<Vec<_>>(),
            [0],
            "the head alone"
        );
        [outcome(
            claim.rows[0].id,
            Outcome::Defer {
                after: Duration::from_secs(3600),
                reason: "target \"nats\" is paused".into(),
                waiting_on: vec!["nats".into()],
            },
        )]
    };
    let first = store.claim("a", 10, LEASE).await.unwrap();
    store.ack(first.lease, &park(&first)).await.unwrap();
    assert!(store.claim("a", 10, LEASE).await.unwrap().rows.is_empty());
    assert_eq!(
        store.unpark_stranded(1000).await.unwrap(),
        0,
        "its backoff has not run out"
    );
    assert_eq!(store.waiting_by_target().await.unwrap()["nats"], 1);

    assert_eq!(store.wake_waiting(Some("kafka")).await.unwrap(), 0);
    assert_eq!(store.wake_waiting(Some("nats")).await.unwrap(), 1);
    let woken = store.claim("a", 10, LEASE).await.unwrap();
    store.ack(woken.lease, &park(&woken)).await.unwrap();

    // Nobody sees NATS back (the relay that parked it died); the backoff
    // runs out.
    db.execute("UPDATE switchyard_outbox SET next_attempt_at = NOW(6) - INTERVAL 1 SECOND WHERE waiting_on IS NOT NULL")
        .await;
    assert!(
        store.claim("a", 10, LEASE).await.unwrap().rows.is_empty(),
        "claims never read parked rows"
    );
    assert_eq!(store.unpark_stranded(1000).await.unwrap(), 1);
    let swept = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(swept.rows.iter().map(seq).collect::<Vec<_>>(), [0]);
    assert_eq!(swept.rows[0].attempts, 1, "waiting spent no attempt");
    assert!(store.waiting_by_target().await.unwrap().is_empty());
}
