//! The claim and ack logic against real databases: disjoint concurrent
//! claims, head-of-line order per aggregate, lease fencing, retries that hold
//! back one aggregate only, dead-letter modes, delayed rows and shutdown
//! release. Each body runs on PostgreSQL and on SQLite; late commits, which
//! SQLite's single writer cannot produce, on PostgreSQL only.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use switchyard::store::{OutboxRow, OutboxStore, Outcome, RowId, RowOutcome};
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::postgres::{NewEvent, fresh_db, place_order_event};

const LEASE: Duration = Duration::from_secs(30);

/// Runs a test body on both backends.
macro_rules! on_both_backends {
    ($($body:ident),* $(,)?) => {$(
        mod $body {
            #[tokio::test]
            async fn postgres() {
                super::$body(switchyard_tests::outbox::TestOutbox::postgres().await).await;
            }
            #[tokio::test]
            async fn sqlite() {
                super::$body(switchyard_tests::outbox::TestOutbox::sqlite().await).await;
            }
        }
    )*};
}

on_both_backends!(
    concurrent_claims_are_disjoint_and_take_only_heads,
    next_event_of_an_aggregate_waits_for_the_ack,
    a_retrying_event_holds_back_only_its_own_aggregate,
    a_worker_that_lost_its_lease_cannot_ack,
    dead_letters_block_the_aggregate_only_in_strict_mode,
    delayed_rows_wait_for_not_before,
    shutdown_release_makes_rows_claimable_without_counting_an_attempt,
);

fn event(aggregate: usize, seq: usize) -> NewEvent {
    NewEvent {
        aggregate_type: "order".into(),
        aggregate_id: format!("o-{aggregate}"),
        event_type: "OrderUpdated".into(),
        payload: serde_json::json!({ "seq": seq }),
        headers: serde_json::json!({}),
    }
}

fn outcome(id: RowId, outcome: Outcome) -> RowOutcome {
    RowOutcome {
        id,
        outcome,
        deliveries: BTreeMap::new(),
        plugin_version: None,
    }
}

fn seq(row: &OutboxRow) -> u64 {
    let payload: serde_json::Value = serde_json::from_str(row.payload_json.as_deref().unwrap()).unwrap();
    payload["seq"].as_u64().unwrap()
}

async fn concurrent_claims_are_disjoint_and_take_only_heads(db: TestOutbox) {
    for seq in 0..5 {
        for aggregate in 0..100 {
            db.insert(aggregate, seq, None).await;
        }
    }
    let store = &db.store;
    let (a, b) = tokio::join!(store.claim("a", 70, LEASE), store.claim("b", 70, LEASE));
    let (a, b) = (a.unwrap(), b.unwrap());
    let ids_a: HashSet<_> = a.rows.iter().map(|r| r.id).collect();
    let ids_b: HashSet<_> = b.rows.iter().map(|r| r.id).collect();
    assert!(ids_a.is_disjoint(&ids_b), "two claimers got the same row");
    assert_eq!(
        ids_a.len() + ids_b.len(),
        100,
        "every aggregate's head is claimed once"
    );
    for row in a.rows.iter().chain(&b.rows) {
        assert_eq!(seq(row), 0, "only the first event of each aggregate is claimable");
        assert_eq!(row.attempts, 1);
    }
    assert!(
        store.claim("c", 1000, LEASE).await.unwrap().rows.is_empty(),
        "the rest wait behind in-flight heads"
    );
}

async fn next_event_of_an_aggregate_waits_for_the_ack(db: TestOutbox) {
    for seq in 0..3 {
        for aggregate in 0..2 {
            db.insert(aggregate, seq, None).await;
        }
    }
    let mut expected_seq = 0;
    loop {
        let claim = db.store.claim("a", 100, LEASE).await.unwrap();
        if claim.rows.is_empty() {
            break;
        }
        assert_eq!(claim.rows.len(), 2);
        assert!(claim.rows.iter().all(|r| seq(r) == expected_seq));
        let outcomes: Vec<_> = claim
            .rows
            .iter()
            .map(|r| outcome(r.id, Outcome::Published))
            .collect();
        assert_eq!(db.store.ack(claim.lease, &outcomes).await.unwrap().len(), 2);
        expected_seq += 1;
    }
    assert_eq!(expected_seq, 3);
    assert_eq!(db.count("published").await, 6);
}

async fn a_retrying_event_holds_back_only_its_own_aggregate(db: TestOutbox) {
    for seq in 0..2 {
        for aggregate in 0..2 {
            db.insert(aggregate, seq, None).await;
        }
    }
    let claim = db.store.claim("a", 100, LEASE).await.unwrap();
    let (failing, ok): (Vec<_>, Vec<_>) = claim.rows.iter().partition(|r| r.aggregate_id == "o-0");
    let outcomes = vec![
        outcome(
            failing[0].id,
            Outcome::Retry {
                after: Duration::from_secs(3600),
                error: "broker down".into(),
            },
        ),
        outcome(ok[0].id, Outcome::Published),
    ];
    db.store.ack(claim.lease, &outcomes).await.unwrap();

    let next = db.store.claim("a", 100, LEASE).await.unwrap();
    assert_eq!(next.rows.len(), 1, "only the healthy aggregate moves on");
    assert_eq!(next.rows[0].aggregate_id, "o-1");
    assert_eq!(seq(&next.rows[0]), 1);
    let (status, error) = db.status_of(failing[0].id.0).await;
    assert_eq!(
        (status.as_str(), error.as_deref()),
        ("pending", Some("broker down"))
    );
}

async fn a_worker_that_lost_its_lease_cannot_ack(db: TestOutbox) {
    db.insert(0, 0, None).await;
    let slow = db
        .store
        .claim("slow", 10, Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(slow.rows.len(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let fast = db.store.claim("fast", 10, LEASE).await.unwrap();
    assert_eq!(fast.rows.len(), 1, "an expired lease is claimable again");
    assert_eq!(fast.rows[0].attempts, 2);

    let id = slow.rows[0].id;
    let stale = db
        .store
        .ack(
            slow.lease,
            &[outcome(
                id,
                Outcome::Dead {
                    error: "stale".into(),
                },
            )],
        )
        .await
        .unwrap();
    assert!(stale.is_empty(), "the stale worker's ack must not land");
    let fresh = db
        .store
        .ack(fast.lease, &[outcome(id, Outcome::Published)])
        .await
        .unwrap();
    assert_eq!(fresh, vec![id]);
    assert_eq!(db.status_of(id.0).await.0, "published");
}

async fn dead_letters_block_the_aggregate_only_in_strict_mode(db: TestOutbox) {
    db.insert(0, 0, None).await;
    db.insert(0, 1, None).await;
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    db.store
        .ack(
            claim.lease,
            &[outcome(
                claim.rows[0].id,
                Outcome::Dead {
                    error: "poison".into(),
                },
            )],
        )
        .await
        .unwrap();

    let strict = db.store.clone().with_dead_letter_blocking(true);
    assert!(strict.claim("a", 10, LEASE).await.unwrap().rows.is_empty());
    let lenient = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(lenient.rows.len(), 1);
    assert_eq!(seq(&lenient.rows[0]), 1);
}

async fn delayed_rows_wait_for_not_before(db: TestOutbox) {
    db.insert(1, 0, Some(3_600_000)).await;
    db.insert(2, 0, Some(-1_000)).await;
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(claim.rows.len(), 1);
    assert_eq!(claim.rows[0].aggregate_id, "o-2");
}

async fn shutdown_release_makes_rows_claimable_without_counting_an_attempt(db: TestOutbox) {
    db.insert(0, 0, None).await;
    assert_eq!(db.store.claim("leaving", 10, LEASE).await.unwrap().rows.len(), 1);
    assert_eq!(db.store.release_owner("leaving").await.unwrap(), 1);
    let again = db.store.claim("other", 10, LEASE).await.unwrap();
    assert_eq!(again.rows.len(), 1);
    assert_eq!(again.rows[0].attempts, 1);
}

#[tokio::test]
async fn a_row_committed_after_a_later_id_is_still_claimed() {
    let db = fresh_db().await;
    let store = OutboxStore::new(db.pool.clone());
    // The first transaction takes the lower id but commits last.
    let mut early = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'late', 'OrderCreated', '{}')")
        .execute(&mut *early)
        .await
        .unwrap();
    place_order_event(&db.pool, &event(1, 0), true).await;

    let first = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(first.rows.len(), 1);
    assert_eq!(first.rows[0].aggregate_id, "o-1");
    store
        .ack(first.lease, &[outcome(first.rows[0].id, Outcome::Published)])
        .await
        .unwrap();

    early.commit().await.unwrap();
    let second = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(
        second.rows.len(),
        1,
        "a row with a lower id that committed late is not skipped"
    );
    assert_eq!(second.rows[0].aggregate_id, "late");
    assert!(second.rows[0].id < first.rows[0].id);
}
