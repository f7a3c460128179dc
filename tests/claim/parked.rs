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

/// The rows read by one claim of `store`, and what it took (given back
/// at once).
async fn claim_counted(db: &TestOutbox, store: &OutboxStore) -> (i64, Vec<u64>) {
    let before = rows_read(db).await;
    let claim = store.claim("counted", 100, LEASE).await.unwrap();
    let read = rows_read(db).await - before;
    let taken = claim.rows.iter().map(seq).collect();
    store.release_owner("counted").await.unwrap();
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
/// out. Neither charges an attempt, and the event behind it comes back
/// with it.
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
    assert_eq!(
        store.waiting_by_target().await.unwrap()["nats"],
        2,
        "the head and the event behind it"
    );

    assert_eq!(store.wake_waiting(Some("kafka")).await.unwrap(), 0);
    assert_eq!(store.wake_waiting(Some("nats")).await.unwrap(), 2);
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
    assert_eq!(store.unpark_stranded(1000).await.unwrap(), 2);
    let swept = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(swept.rows.iter().map(seq).collect::<Vec<_>>(), [0]);
    assert_eq!(swept.rows[0].attempts, 1, "waiting spent no attempt");
    assert!(store.waiting_by_target().await.unwrap().is_empty());
}

/// The events behind a head parked on a paused target are parked with it
/// (claims read past none of them), come back with it when its target is
/// woken, and are taken in order after it; another aggregate's events go
/// on meanwhile.
#[tokio::test]
async fn mariadb_events_behind_a_parked_head_wait_with_it_and_keep_their_order() {
    let db = TestOutbox::mariadb().await;
    for seq in 0..4 {
        db.insert(0, seq, None).await;
    }
    db.insert(1, 0, None).await;
    let store = &db.store;
    let first = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(first.rows.len(), 2, "the two heads: {:?}", first.rows);
    let outcomes: Vec<_> = first
        .rows
        .iter()
        .map(|row| {
            if row.aggregate_id == "o-0" {
                outcome(
                    row.id,
                    Outcome::Defer {
                        after: Duration::from_secs(3600),
                        reason: "target \"nats\" is paused".into(),
                        waiting_on: vec!["nats".into()],
                    },
                )
            } else {
                outcome(row.id, Outcome::Published)
            }
        })
        .collect();
    store.ack(first.lease, &outcomes).await.unwrap();
    assert_eq!(
        store.waiting_by_target().await.unwrap()["nats"],
        4,
        "the head and the three behind it"
    );
    db.insert(1, 1, None).await;
    let (read, taken) = claim_counted(&db, store).await;
    assert_eq!(taken, [1], "the other aggregate's next event");
    assert!(read < 20, "a claim read {read} rows");

    assert_eq!(store.wake_waiting(Some("nats")).await.unwrap(), 4);
    for expected in 0..4 {
        let claim = store.claim("a", 10, LEASE).await.unwrap();
        let taken: Vec<_> = claim
            .rows
            .iter()
            .filter(|row| row.aggregate_id == "o-0")
            .map(seq)
            .collect();
        assert_eq!(taken, [expected], "one at a time, in order");
        super::publish_all(store, &claim).await;
    }
    assert!(store.waiting_by_target().await.unwrap().is_empty());
}

/// Events written behind a parked head after it was parked are set
/// waiting with it by the relay's sweep (`park_followers`); events behind
/// a head in flight are not touched, nor the other aggregates'.
#[tokio::test]
async fn mariadb_events_written_behind_a_parked_head_are_set_waiting_by_the_sweep() {
    let db = TestOutbox::mariadb().await;
    db.insert(0, 0, None).await;
    db.insert(1, 0, None).await;
    let store = &db.store;
    let first = store.claim("a", 10, LEASE).await.unwrap();
    let head = first
        .rows
        .iter()
        .find(|row| row.aggregate_id == "o-0")
        .unwrap()
        .id;
    let in_flight = first
        .rows
        .iter()
        .find(|row| row.aggregate_id == "o-1")
        .unwrap()
        .id;
    store
        .ack(
            first.lease,
            &[outcome(
                head,
                Outcome::Defer {
                    after: Duration::from_secs(3600),
                    reason: "target \"nats\" is paused".into(),
                    waiting_on: vec!["nats".into()],
                },
            )],
        )
        .await
        .unwrap();
    for seq in 1..=3 {
        db.insert(0, seq, None).await;
        db.insert(1, seq, None).await;
    }
    db.insert(2, 0, None).await;
    assert_eq!(store.park_followers(2).await.unwrap(), 2, "at most the limit");
    assert_eq!(store.park_followers(1000).await.unwrap(), 1);
    assert_eq!(store.park_followers(1000).await.unwrap(), 0);
    assert_eq!(store.waiting_by_target().await.unwrap()["nats"], 4);
    let unparked: i64 = db
        .scalar("SELECT count(*) FROM switchyard_outbox WHERE waiting_on IS NULL AND status = 'pending'")
        .await;
    assert_eq!(
        unparked, 4,
        "the three behind the head in flight, and the third aggregate's"
    );
    let (read, taken) = claim_counted(&db, store).await;
    assert_eq!(taken, [0], "the third aggregate's head");
    assert!(read < 40, "a claim read {read} rows");

    // The head in flight publishes; its aggregate goes on in order.
    assert_eq!(
        store
            .ack(first.lease, &[outcome(in_flight, Outcome::Published)])
            .await
            .unwrap(),
        [in_flight]
    );
    assert_eq!(store.wake_waiting(Some("nats")).await.unwrap(), 4);
    let mut seen: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    loop {
        let claim = store.claim("a", 10, LEASE).await.unwrap();
        if claim.rows.is_empty() {
            break;
        }
        for row in &claim.rows {
            seen.entry(row.aggregate_id.clone()).or_default().push(seq(row));
        }
        super::publish_all(store, &claim).await;
    }
    assert_eq!(seen["o-0"], [0, 1, 2, 3]);
    assert_eq!(seen["o-1"], [1, 2, 3]);
    assert_eq!(seen["o-2"], [0]);
}
