//! The claim and ack logic against real databases: disjoint concurrent
//! claims, head-of-line order per aggregate, lease fencing, retries that hold
//! back one aggregate only, dead-letter modes, delayed rows and shutdown
//! release. Each body runs on PostgreSQL and on SQLite; late commits, which
//! SQLite's single writer cannot produce, on PostgreSQL only.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use switchyard::store::{
    Delivery, Generation, OutboxRow, OutboxStore, Outcome, PublishedRows, RowId, RowOutcome,
};
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::postgres::{
    INTAKE_MIGRATION, NewEvent, Outbox, fresh_db, fresh_db_before, place_event, place_order_event,
};
use switchyard_tests::stall::{StallingProxy, gives_up_unanswered};

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
    no_single_rows_content_can_fail_the_batch_ack,
    writers_get_a_specific_error_for_oversized_keys,
    concurrent_workers_keep_each_aggregate_in_order_and_strand_nothing,
    published_rows_can_be_deleted_or_archived_by_the_ack,
    a_row_the_relay_cannot_read_is_refused_alone,
    payloads_over_the_limit_are_let_go_as_the_claim_reads_them,
    a_writers_created_at_in_the_future_delays_nothing,
    a_database_is_owned_by_one_relay_at_a_time,
);

/// A fleet's ownership of a database: taken when free, renewed and given
/// up only with its token, read back as each backend stores it.
async fn a_database_is_owned_by_one_relay_at_a_time(db: TestOutbox) {
    let free = db.store.ownership(LEASE).await.unwrap();
    assert_eq!((free.owner, free.held), (None, false));
    let token = db
        .store
        .take_ownership("relay-a", LEASE)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(db.store.take_ownership("relay-b", LEASE).await.unwrap(), None);
    assert!(
        !db.store
            .renew_ownership("relay-a", token + 1, LEASE)
            .await
            .unwrap()
    );
    assert!(db.store.renew_ownership("relay-a", token, LEASE).await.unwrap());
    let held = db.store.ownership(LEASE).await.unwrap();
    assert_eq!((held.owner.as_deref(), held.held), (Some("relay-a"), true));
    assert_eq!(held.free_for, Duration::ZERO);
    db.store.release_ownership("relay-a", token).await.unwrap();
    assert!(!db.store.ownership(LEASE).await.unwrap().held);
    assert!(db.store.take_ownership("relay-b", LEASE).await.unwrap().is_some());
}

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
    // Written after the delayed one: held back by it, not delayed itself.
    db.insert(1, 1, None).await;
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(claim.rows.len(), 1);
    assert_eq!(claim.rows[0].aggregate_id, "o-2");

    let stats = db.store.stats().await.unwrap();
    assert_eq!(
        (stats.backlog, stats.pending, stats.delayed, stats.in_flight),
        (3, 1, 1, 1),
        "status counts the delayed row apart: {stats:?}"
    );
    // The oldest pending row is the in-flight o-2, not the delayed one,
    // whose age would otherwise grow until its time comes.
    let oldest_id: i64 = claim.rows[0].id.0;
    assert!(oldest_id > 1);
    assert!(stats.oldest_pending_age_seconds.is_some());
    db.store
        .ack(claim.lease, &[outcome(claim.rows[0].id, Outcome::Published)])
        .await
        .unwrap();
    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.delayed), (1, 1));
    assert!(
        stats.oldest_pending_age_seconds.is_some(),
        "the row held behind the delayed one is pending"
    );
}

/// `created_at` is the writer's: many set it from the application's clock,
/// which may run ahead, or write local time where UTC is read (nine hours
/// ahead at UTC+9). Only `not_before` delays an event.
async fn a_writers_created_at_in_the_future_delays_nothing(db: TestOutbox) {
    let ahead = |aggregate: &str| {
        if db.kind == "postgres" {
            format!(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
                 VALUES ('order', '{aggregate}', 'OrderUpdated', '{{}}', now() + interval '9 hours')"
            )
        } else {
            format!(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
                 VALUES ('order', '{aggregate}', 'OrderUpdated', '{{}}',
                         CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) + 9 * 3600000)"
            )
        }
    };
    db.execute(&ahead("o-1")).await;
    db.insert(1, 1, None).await;
    db.insert(2, 0, None).await;
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    let mut claimed: Vec<_> = claim.rows.iter().map(|row| row.aggregate_id.as_str()).collect();
    claimed.sort_unstable();
    assert_eq!(claimed, ["o-1", "o-2"], "the heads of both aggregates, at once");
    let first_of_o1 = claim.rows.iter().find(|row| row.aggregate_id == "o-1").unwrap();
    assert_eq!(
        first_of_o1.payload_json.as_deref(),
        Some("{}"),
        "o-1's first event, not the one behind it"
    );
    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.delayed), (1, 0), "{stats:?}");
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

/// A NUL in a topic or a broker's error text (jsonb refuses `\u0000`), or
/// any other value the database refuses, must not make the whole batch's ack
/// fail: that batch would be claimed again every lease and its other rows
/// published again each time.
async fn no_single_rows_content_can_fail_the_batch_ack(db: TestOutbox) {
    for aggregate in 0..3 {
        db.insert(aggregate, 0, None).await;
    }
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(claim.rows.len(), 3);
    let nul_topic = "orders\u{0}x".to_string();
    let mut outcomes: Vec<_> = claim
        .rows
        .iter()
        .map(|r| outcome(r.id, Outcome::Published))
        .collect();
    outcomes[0].deliveries.insert(
        format!("nats:{nul_topic}#0"),
        Delivery {
            target: "nats".into(),
            topic: nul_topic.clone(),
            acked_at: None,
            error: Some("server said \u{0}".into()),
        },
    );
    outcomes[0].outcome = Outcome::Retry {
        after: Duration::from_secs(3600),
        error: "broker \u{0} down".into(),
    };
    // PostgreSQL text refuses NUL outright; SQLite stores it.
    outcomes[1].plugin_version = Some("bad\u{0}version".into());

    let acked = db.store.ack(claim.lease, &outcomes).await.unwrap();
    assert_eq!(acked.len(), 3, "every row of the batch is recorded");
    assert_eq!(db.status_of(claim.rows[2].id.0).await.0, "published");
    let (status, error) = db.status_of(claim.rows[0].id.0).await;
    assert_eq!(status, "pending", "{error:?}");
    assert!(error.unwrap().contains("broker"));
    let (status, error) = db.status_of(claim.rows[1].id.0).await;
    match db.kind {
        "postgres" => {
            assert_eq!(status, "dead");
            let error = error.unwrap();
            assert!(error.contains("database refused this row's outcome"), "{error}");
        }
        _ => assert_eq!(status, "published"),
    }
    assert!(
        db.store.claim("b", 10, LEASE).await.unwrap().rows.is_empty(),
        "nothing comes back after the ack"
    );

    // A batch of one refused row is recorded too.
    db.insert(9, 0, None).await;
    let claim = db.store.claim("c", 10, LEASE).await.unwrap();
    let mut alone = outcome(claim.rows[0].id, Outcome::Published);
    alone.plugin_version = Some("bad\u{0}version".into());
    assert_eq!(db.store.ack(claim.lease, &[alone]).await.unwrap().len(), 1);
    let expected = if db.kind == "postgres" {
        "dead"
    } else {
        "published"
    };
    assert_eq!(db.status_of(claim.rows[0].id.0).await.0, expected);
}

/// An aggregate id past the aggregate index's row limit used to fail the
/// writer's INSERT with an index-row error naming no column.
async fn writers_get_a_specific_error_for_oversized_keys(db: TestOutbox) {
    db.try_insert(&"a".repeat(1024), None)
        .await
        .expect("1024 bytes are allowed");
    let error = db.try_insert(&"a".repeat(3000), None).await.unwrap_err();
    assert!(error.contains("aggregate_id"), "{error}");
    assert!(error.contains("1024"), "{error}");
}

/// SQLite keeps event ids as text: one that is not a UUID is refused at the
/// writer's INSERT, and one that got in anyway is dead-lettered, never
/// relayed under a shared stand-in id (brokers deduplicate by it).
#[tokio::test]
async fn sqlite_event_ids_must_be_uuids() {
    let db = TestOutbox::sqlite().await;
    let error = db.try_insert("o-1", Some("order-42")).await.unwrap_err();
    assert!(error.contains("event_id must be a UUID"), "{error}");
    db.try_insert("o-1", Some("0b9e4a4e-5f6a-4c39-8f5e-2b1d2c3d4e5f"))
        .await
        .unwrap();

    // Rows written before the check existed, or changed by hand.
    db.insert(2, 0, None).await;
    db.insert(3, 0, None).await;
    let pool = db.sqlite_pool();
    sqlx::query("UPDATE switchyard_outbox SET event_id = 'legacy-' || aggregate_id WHERE aggregate_id IN ('o-2', 'o-3')")
        .execute(&pool)
        .await
        .unwrap();
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(claim.rows.len(), 3);
    let limits = switchyard::router::Limits::from_config(&switchyard::config::RelayConfig::default());
    let mut refused = 0;
    for row in &claim.rows {
        match switchyard::router::event_from_row(row, &limits) {
            Ok(event) => assert_eq!(event.event_id, "0b9e4a4e-5f6a-4c39-8f5e-2b1d2c3d4e5f"),
            Err(error) => {
                let error = error.to_string();
                assert!(error.contains("is not a UUID"), "{error}");
                assert!(error.contains("legacy-o-"), "names the id: {error}");
                refused += 1;
            }
        }
    }
    assert_eq!(
        refused, 2,
        "both unreadable ids are refused, not mapped to one shared id"
    );
}

/// A value of the wrong type, written past the table's checks (an UPDATE
/// by hand, a row older than the checks), used to fail the claim of its
/// whole batch, lease after lease: the relay stopped at that row. It is
/// claimed and refused alone, naming the column, and the operations that
/// read rows (backlog age, entries) still work.
async fn a_row_the_relay_cannot_read_is_refused_alone(db: TestOutbox) {
    for aggregate in 0..4 {
        db.insert(aggregate, 0, None).await;
    }
    let broken: &[(&str, &str)] = if db.kind == "postgres" {
        &[(
            "UPDATE switchyard_outbox SET created_at = '-infinity' WHERE aggregate_id = 'o-0'",
            "created_at is -infinity or infinity",
        )]
    } else {
        &[
            (
                "UPDATE switchyard_outbox SET created_at = '2026-11-23 10:00:00' WHERE aggregate_id = 'o-0'",
                "column created_at holds TEXT where INTEGER is expected",
            ),
            (
                "UPDATE switchyard_outbox SET headers = X'00ff' WHERE aggregate_id = 'o-1'",
                "column headers holds BLOB where TEXT is expected",
            ),
            (
                "UPDATE switchyard_outbox SET not_before = 'tomorrow' WHERE aggregate_id = 'o-2'",
                "column not_before holds TEXT where INTEGER",
            ),
        ]
    };
    for (sql, _) in broken {
        db.execute(sql).await;
    }
    db.store.oldest_pending_age().await.expect("the backlog's age");

    let claim = db.store.claim("a", 10, LEASE).await.expect("the claim goes on");
    assert_eq!(
        claim.rows.len(),
        4,
        "every row is claimed, the one delayed by text too"
    );
    let limits = switchyard::router::Limits::from_config(&switchyard::config::RelayConfig::default());
    let refused: Vec<String> = claim
        .rows
        .iter()
        .filter_map(|row| {
            switchyard::router::event_from_row(row, &limits)
                .err()
                .map(|e| e.to_string())
        })
        .collect();
    assert_eq!(refused.len(), broken.len(), "only the broken rows: {refused:?}");
    for ((_, expected), error) in broken.iter().zip(&refused) {
        assert!(error.contains(expected), "{error}");
    }
    for row in &claim.rows {
        db.store.entry(row.id.0).await.expect("entry").expect("the row");
    }
}

/// A payload over `relay.max_payload_bytes` is refused at routing anyway;
/// the claim used to read every such payload of the batch into memory
/// first (500 rows of 20 MB: 10 GB, an out-of-memory crash, the same claim
/// again after the restart). The claim keeps only the size and the reason.
async fn payloads_over_the_limit_are_let_go_as_the_claim_reads_them(db: TestOutbox) {
    let store = db.store.clone().with_max_payload_bytes(1000);
    let big = format!("{{\"blob\": \"{}\"}}", "x".repeat(4000));
    for aggregate in 0..3 {
        db.execute(&format!(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'big-{aggregate}', 'OrderUpdated', '{big}')"
        ))
        .await;
    }
    let ten_bytes = if db.kind == "postgres" {
        "'\\x00112233445566778899'::bytea"
    } else {
        "X'00112233445566778899'"
    };
    db.execute(&format!(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload_bytes)
         VALUES ('order', 'big-bytes', 'OrderUpdated', {ten_bytes})"
    ))
    .await;
    db.insert(0, 0, None).await;

    let small = store.clone().with_max_payload_bytes(8);
    let claim = small.claim("a", 10, LEASE).await.unwrap();
    let refused: BTreeMap<&str, Option<&str>> = claim
        .rows
        .iter()
        .map(|row| (row.aggregate_id.as_str(), row.malformed.as_deref()))
        .collect();
    assert_eq!(
        refused.get("big-bytes"),
        Some(&Some("payload is 10 bytes, over relay.max_payload_bytes (8)"))
    );
    assert!(
        refused["o-0"]
            .unwrap()
            .contains("over relay.max_payload_bytes (8)")
    );
    // Claimed again, under a limit of 1,000 bytes.
    db.execute("UPDATE switchyard_outbox SET status = 'pending', lease_id = NULL, attempts = 0")
        .await;

    let claim = store.claim("b", 10, LEASE).await.unwrap();
    assert_eq!(claim.rows.len(), 5);
    for row in &claim.rows {
        if row.aggregate_id.starts_with("big-") && row.aggregate_id != "big-bytes" {
            assert_eq!(
                row.malformed.as_deref(),
                Some(
                    format!(
                        "payload is {} bytes, over relay.max_payload_bytes (1000)",
                        big.len()
                    )
                    .as_str()
                ),
            );
            assert!(
                row.payload_json.is_none() && row.payload_bytes.is_none(),
                "let go"
            );
        } else {
            assert_eq!(row.malformed, None, "{}", row.aggregate_id);
        }
    }
}

/// SQLite stores a value of any type in any column. A service that writes
/// an ISO date into created_at, or text into payload_bytes, is told so at
/// its INSERT, as PostgreSQL's column types would tell it.
#[tokio::test]
async fn sqlite_writers_get_a_specific_error_for_mistyped_columns() {
    let db = TestOutbox::sqlite().await;
    let pool = db.sqlite_pool();
    for (column, value, expected) in [
        (
            "created_at",
            "'2026-11-23 10:00:00'",
            "created_at and not_before must be INTEGER",
        ),
        (
            "not_before",
            "'tomorrow'",
            "created_at and not_before must be INTEGER",
        ),
        ("headers", "X'00ff'", "headers must be a JSON object as TEXT"),
        ("headers", "'not json'", "headers must be a JSON object as TEXT"),
        ("payload", "X'7b7d'", "payload must be JSON as TEXT"),
        ("payload_bytes", "'text'", "payload_bytes a BLOB"),
        ("tenant", "X'00'", "tenant TEXT"),
        // The unit, not the type: seconds and microseconds.
        (
            "created_at",
            "1795458299",
            "this looks like seconds or microseconds",
        ),
        (
            "created_at",
            "1795458299678000",
            "this looks like seconds or microseconds",
        ),
        (
            "not_before",
            "1795458299",
            "this looks like seconds or microseconds",
        ),
        (
            "not_before",
            "1795458299678000",
            "this looks like seconds or microseconds",
        ),
    ] {
        let sql = format!(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, {column})
             VALUES ('order', 'o-1', 'OrderUpdated', {value})"
        );
        let error = sqlx::query(&sql).execute(&pool).await.unwrap_err().to_string();
        assert!(error.contains(expected), "{column} = {value}: {error}");
    }
    // What SQLite converts to the column's type on its own is fine.
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, created_at, tenant)
         VALUES ('order', 7, 'OrderUpdated', '1795458299678', 42)",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(db.count("pending").await, 1);
}

/// PostgreSQL's identity column refuses an id from the writer. SQLite took
/// one: an id below the last one claimed an aggregate's later event ahead
/// of the events before it.
#[tokio::test]
async fn sqlite_writers_cannot_choose_the_id() {
    let db = TestOutbox::sqlite().await;
    let pool = db.sqlite_pool();
    let insert = |id: &str| {
        format!(
            "INSERT INTO switchyard_outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ({id}, 'order', 'o-1', 'OrderUpdated', '{{}}')"
        )
    };
    for _ in 0..3 {
        db.insert(1, 0, None).await;
    }
    for id in ["1", "2", "100", "0", "-1", "-5"] {
        let error = sqlx::query(&insert(id))
            .execute(&pool)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("switchyard_outbox.id is assigned by the outbox"),
            "id {id}: {error}"
        );
    }
    let error = sqlx::query("UPDATE switchyard_outbox SET id = 50 WHERE id = 3")
        .execute(&pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("switchyard_outbox.id is assigned by the outbox"),
        "{error}"
    );
    // An explicit NULL is the default, as SQLite has it.
    sqlx::query(&insert("NULL")).execute(&pool).await.unwrap();
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM switchyard_outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ids, [1, 2, 3, 4]);
}

/// Services write the SQLite outbox with their own SQLite library, often
/// older than the relay's (Debian 12 and its Python ship 3.40). The first
/// schema's created_at default needed 3.42: every INSERT that left
/// created_at out failed there with "NOT NULL constraint failed".
#[tokio::test]
async fn a_service_on_the_systems_sqlite_can_write_the_outbox() {
    let db = TestOutbox::sqlite().await;
    let script = r#"
import sqlite3, sys
con = sqlite3.connect(sys.argv[1])
con.execute("INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'o-1', 'OrderPlaced', '{}')")
con.commit()
print(sqlite3.sqlite_version)
"#;
    let before = now_ms();
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(db.sqlite_path())
        .output()
        .expect("python3 (installed with the plugin toolchains)");
    let after = now_ms();
    assert!(
        out.status.success(),
        "a Python service's INSERT: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let created = db.scalar("SELECT created_at FROM switchyard_outbox").await;
    assert!(
        (before - 1000..=after + 1000).contains(&created),
        "created_at {created} is the insert's time ({before}..{after}), SQLite {}",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(claim.rows.len(), 1);
    assert_eq!(claim.rows[0].malformed, None);
}

fn now_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    i64::try_from(since.expect("after 1970").as_millis()).expect("ms fit")
}

/// Each test's database goes away with the test, instead of piling up.
#[tokio::test]
async fn test_databases_are_dropped_when_the_test_ends() {
    let db = fresh_db().await;
    let name = db.name.clone();
    drop(db);
    let admin = switchyard_tests::postgres::server_pool().await;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(&name)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(!exists, "database {name} is still there");
}

/// Four workers claim and ack at once, with retries in the mix, over
/// aggregates with deep backlogs, so claims park rows behind heads another
/// worker is acking at that moment. Every row must be published, each
/// aggregate in order, by the acks alone: no sweep runs here, so a row
/// parked behind a predecessor whose ack missed it would never come back.
async fn concurrent_workers_keep_each_aggregate_in_order_and_strand_nothing(db: TestOutbox) {
    const AGGREGATES: usize = 12;
    const EVENTS: usize = 40;
    for seq in 0..EVENTS {
        for aggregate in 0..AGGREGATES {
            db.insert(aggregate, seq, None).await;
        }
    }
    let published = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::<String, Vec<u64>>::new()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut workers = Vec::new();
    for worker in 0..4u64 {
        let store = db.store.clone();
        let published = published.clone();
        workers.push(tokio::spawn(async move {
            let mut round = 0u64;
            while tokio::time::Instant::now() < deadline {
                round += 1;
                let claim = store.claim(&format!("w{worker}"), 5, LEASE).await.unwrap();
                if claim.rows.is_empty() {
                    if store.backlog().await.unwrap().0 == 0 {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                let outcomes: Vec<RowOutcome> = claim
                    .rows
                    .iter()
                    .enumerate()
                    .map(|(i, row)| {
                        // About one row in seven fails once, for no time.
                        let retry = (round + i as u64 + worker).is_multiple_of(7) && row.attempts == 1;
                        let result = if retry {
                            Outcome::Retry {
                                after: Duration::ZERO,
                                error: "flaky".into(),
                            }
                        } else {
                            Outcome::Published
                        };
                        outcome(row.id, result)
                    })
                    .collect();
                // Recorded before the ack: once it commits, the next event
                // of the aggregate may be acked by another worker.
                {
                    let mut order = published.lock().unwrap();
                    for (row, done) in claim.rows.iter().zip(&outcomes) {
                        if done.outcome == Outcome::Published {
                            order.entry(row.aggregate_id.clone()).or_default().push(seq(row));
                        }
                    }
                }
                let acked = store.ack(claim.lease, &outcomes).await.unwrap();
                assert_eq!(acked.len(), outcomes.len());
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    assert_eq!(
        db.store.backlog().await.unwrap().0,
        0,
        "rows left behind: {:?}",
        db.store.stats().await.unwrap()
    );
    let order = published.lock().unwrap();
    assert_eq!(order.len(), AGGREGATES);
    for (aggregate, seqs) in order.iter() {
        let expected: Vec<u64> = (0..EVENTS as u64).collect();
        assert_eq!(
            seqs, &expected,
            "aggregate {aggregate} published out of order or incompletely"
        );
    }
}

/// `published_rows = delete | archive`: the ack removes a published row (and
/// in `archive` mode moves it to the archive, as published) in its own
/// statement; other outcomes are recorded as always, and the next event of
/// the aggregate is claimable at once.
async fn published_rows_can_be_deleted_or_archived_by_the_ack(db: TestOutbox) {
    for aggregate in 0..4 {
        db.insert(aggregate, 0, None).await;
        db.insert(aggregate, 1, None).await;
    }
    for (round, mode) in [PublishedRows::Delete, PublishedRows::Archive]
        .into_iter()
        .enumerate()
    {
        let store = db.store.clone().with_published_rows(mode);
        let claim = store.claim("a", 10, LEASE).await.unwrap();
        let heads: Vec<_> = claim
            .rows
            .iter()
            .filter(|r| r.aggregate_id == "o-0" || r.aggregate_id == "o-1")
            .collect();
        assert_eq!(heads.len(), 2, "{mode:?}: {:?}", claim.rows);
        let outcomes: Vec<RowOutcome> = claim
            .rows
            .iter()
            .map(|row| {
                if heads.iter().any(|h| h.id == row.id) {
                    outcome(row.id, Outcome::Published)
                } else {
                    outcome(
                        row.id,
                        Outcome::Retry {
                            after: Duration::ZERO,
                            error: "later".into(),
                        },
                    )
                }
            })
            .collect();
        assert_eq!(
            store.ack(claim.lease, &outcomes).await.unwrap().len(),
            outcomes.len()
        );
        for head in &heads {
            let id = head.id.0;
            assert_eq!(
                db.scalar(&format!("SELECT count(*) FROM switchyard_outbox WHERE id = {id}"))
                    .await,
                0,
                "{mode:?}: a published row stays in the outbox"
            );
            let archived = db
                .scalar(&format!(
                    "SELECT count(*) FROM switchyard_outbox_archive WHERE id = {id} AND published_at IS NOT NULL"
                ))
                .await;
            assert_eq!(archived, i64::from(mode == PublishedRows::Archive), "{mode:?}");
        }
        assert_eq!(db.count("published").await, 0);
        let waiting = db
            .scalar("SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending', 'parked')")
            .await;
        assert_eq!(
            waiting,
            8 - 2 * (round as i64 + 1),
            "{mode:?}: the other rows are kept"
        );
        if round == 1 {
            break;
        }
        // The next event of each published aggregate is its head now; it is
        // put back (no attempt counted) for the archive round to publish.
        let next = store.claim("b", 10, LEASE).await.unwrap();
        for aggregate in ["o-0", "o-1"] {
            assert!(
                next.rows
                    .iter()
                    .any(|r| r.aggregate_id == aggregate && seq(r) == 1),
                "{mode:?}: {aggregate}'s next event"
            );
        }
        let release: Vec<RowOutcome> = next
            .rows
            .iter()
            .map(|row| {
                outcome(
                    row.id,
                    Outcome::Defer {
                        after: Duration::ZERO,
                        reason: "next round".into(),
                        waiting_on: Vec::new(),
                    },
                )
            })
            .collect();
        store.ack(next.lease, &release).await.unwrap();
    }
}

/// A row waiting for a paused target keeps its attempt and lets the next
/// event of its aggregate be claimed, held by that target (its messages to
/// other targets go now); the one after learns the target from its nearest
/// predecessor. Waking the target makes the waiting rows due again, in order.
#[tokio::test]
async fn a_row_waiting_on_a_paused_target_lets_the_next_through_held_by_it() {
    let db = fresh_db().await;
    for seq in 0..3 {
        place_order_event(&db.pool, &event(0, seq), true).await;
    }
    let store = OutboxStore::new(db.pool.clone());
    let waiting = |id: RowId| {
        outcome(
            id,
            Outcome::Defer {
                after: Duration::from_secs(30),
                reason: "target \"kafka\" is paused".into(),
                waiting_on: vec!["kafka".into()],
            },
        )
    };
    let first = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(first.rows.len(), 1, "the head alone: {:?}", first.rows);
    assert!(first.rows[0].held_by.is_empty());
    let head = first.rows[0].id;
    store.ack(first.lease, &[waiting(head)]).await.unwrap();
    let (attempts, waiting_on): (i32, Vec<String>) =
        sqlx::query_as("SELECT attempts, waiting_on FROM switchyard_outbox WHERE id = $1")
            .bind(head.0)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((attempts, waiting_on), (0, vec!["kafka".to_string()]));

    let second = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(second.rows.len(), 1, "{:?}", second.rows);
    assert_eq!(seq(&second.rows[0]), 1);
    assert_eq!(second.rows[0].held_by, ["kafka"]);
    store
        .ack(second.lease, &[waiting(second.rows[0].id)])
        .await
        .unwrap();

    let third = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(third.rows.len(), 1, "{:?}", third.rows);
    assert_eq!(seq(&third.rows[0]), 2);
    assert_eq!(third.rows[0].held_by, ["kafka"]);
    store
        .ack(third.lease, &[outcome(third.rows[0].id, Outcome::Published)])
        .await
        .unwrap();

    assert_eq!(store.waiting_by_target().await.unwrap()["kafka"], 2);
    assert_eq!(store.wake_waiting(Some("nats")).await.unwrap(), 0);
    assert_eq!(store.wake_waiting(Some("kafka")).await.unwrap(), 2);
    assert!(store.waiting_by_target().await.unwrap().is_empty());
    // Woken, the two are ordinary pending rows again: the head first.
    let again = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(again.rows.len(), 1, "{:?}", again.rows);
    assert_eq!(again.rows[0].id, head);
    assert!(again.rows[0].held_by.is_empty());
}

/// Every schema an older release could have left, on both backends: one
/// older than the previous generation is refused with what to do, the
/// previous generation is served as it is, and `migrate` brings each to the
/// current generation with its events claimed in order.
#[tokio::test]
async fn migrate_brings_every_older_schema_forward_and_serves_its_events() {
    for migration in switchyard::store::MIGRATOR.iter().skip(1) {
        let db = fresh_db_before(migration.version).await;
        for (aggregate, seq) in [(0, 0), (1, 0), (0, 1)] {
            place_order_event(&db.pool, &event(aggregate, seq), true).await;
        }
        let store = OutboxStore::new(db.pool.clone());
        let what = format!("PostgreSQL before {}", migration.version);
        serve_then_migrate(&store, migration.version > 20_261_202_000_000, &what).await;
    }
    for migration in switchyard::store::SQLITE_MIGRATOR.iter().skip(1) {
        let path = std::env::temp_dir().join(format!("sy-{}.db", uuid::Uuid::new_v4().simple()));
        let url = format!("sqlite://{}", path.display());
        let store = OutboxStore::connect(&url, 2).await.unwrap();
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        let older: Vec<_> = switchyard::store::SQLITE_MIGRATOR
            .iter()
            .filter(|m| m.version < migration.version)
            .cloned()
            .collect();
        sqlx::migrate::Migrator {
            migrations: older.into(),
            ..sqlx::migrate::Migrator::DEFAULT
        }
        .run(&pool)
        .await
        .unwrap();
        for (aggregate, seq) in [(0, 0), (1, 0), (0, 1)] {
            sqlx::query(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', $1, 'OrderUpdated', $2)",
            )
            .bind(format!("o-{aggregate}"))
            .bind(format!("{{\"seq\": {seq}}}"))
            .execute(&pool)
            .await
            .unwrap();
        }
        let what = format!("SQLite before {}", migration.version);
        serve_then_migrate(&store, migration.version > 20_261_129_000_000, &what).await;
        pool.close().await;
        let _ = std::fs::remove_file(&path);
    }
}

/// Claims from `store` before `migrate` when it is `served` (else checks
/// the refusal), migrates, and claims the rest: three events, two
/// aggregates, each once and in order.
async fn serve_then_migrate(store: &OutboxStore, served: bool, what: &str) {
    let mut claimed = Vec::new();
    match store.generation().await {
        Ok(generation) => {
            assert!(served, "{what}: served as {generation:?}");
            claimed.extend(claim_and_publish(store).await);
            assert_eq!(claimed.len(), 2, "{what}: the two heads");
        }
        Err(refused) => {
            assert!(!served, "{what}: {refused}");
            assert!(
                refused.to_string().contains("run `switchyard migrate`"),
                "{what}: {refused}"
            );
            // SQLite's one relay checks before it starts; PostgreSQL's
            // claims pick their statement by the generation, and refuse.
            if store.kind() == "postgres" {
                let claim = store.claim("upgrade", 10, LEASE).await.unwrap_err();
                assert!(
                    claim.to_string().contains("older than this relay serves"),
                    "{what}: {claim}"
                );
            }
        }
    }
    store.migrate().await.unwrap();
    assert_eq!(store.generation().await.unwrap(), Generation::Current, "{what}");
    for _ in 0..3 {
        claimed.extend(claim_and_publish(store).await);
    }
    let first_aggregate: Vec<u64> = claimed
        .iter()
        .filter(|(id, _)| id == "o-0")
        .map(|(_, seq)| *seq)
        .collect();
    assert_eq!(first_aggregate, [0, 1], "{what}: in order");
    claimed.sort();
    let want = [
        ("o-0".to_string(), 0),
        ("o-0".to_string(), 1),
        ("o-1".to_string(), 0),
    ];
    assert_eq!(claimed, want, "{what}: each event once");
}

/// One claim, acked as published: (aggregate, seq) of each row.
async fn claim_and_publish(store: &OutboxStore) -> Vec<(String, u64)> {
    let claim = store.claim("upgrade", 10, LEASE).await.unwrap();
    let outcomes: Vec<_> = claim
        .rows
        .iter()
        .map(|row| outcome(row.id, Outcome::Published))
        .collect();
    store.ack(claim.lease, &outcomes).await.unwrap();
    claim
        .rows
        .iter()
        .map(|row| (row.aggregate_id.clone(), seq(row)))
        .collect()
}

/// Another process runs `migrate`, creating the intake, while this store
/// claims: the claim that sees the table tells the next, which moves its
/// rows (a relay deployed before the migration would otherwise never move
/// them). An intake dropped under it costs one failed claim, not all.
#[tokio::test]
async fn claims_move_intake_rows_once_another_process_creates_the_intake() {
    let db = fresh_db_before(INTAKE_MIGRATION).await;
    let store = OutboxStore::new(db.pool.clone());
    assert!(store.claim("a", 10, LEASE).await.unwrap().rows.is_empty());
    OutboxStore::new(db.pool.clone()).migrate().await.unwrap();
    place_event(&db.pool, Outbox::Intake, &event(1, 0), true).await;
    let mut claimed = Vec::new();
    for _ in 0..2 {
        claimed.extend(store.claim("a", 10, LEASE).await.unwrap().rows);
    }
    assert_eq!(claimed.len(), 1, "the intake row moved and claimed");

    sqlx::query("DROP TABLE switchyard_intake")
        .execute(&db.pool)
        .await
        .unwrap();
    place_order_event(&db.pool, &event(2, 0), true).await;
    let refused = store.claim("a", 10, LEASE).await.unwrap_err().to_string();
    assert!(refused.contains("switchyard_intake"), "{refused}");
    assert_eq!(store.claim("a", 10, LEASE).await.unwrap().rows.len(), 1);
}

/// A claim that cannot finish in half its lease is of no use: its rows could
/// not be published in time. It is cancelled there, whether the bound comes
/// with the relay's sessions (a claim is then one statement) or with the
/// claim's own transaction (a pool made elsewhere), and the next claim, once
/// the table is free, takes the row.
#[tokio::test]
async fn a_claim_stuck_past_half_the_lease_is_cancelled_on_either_path() {
    let db = fresh_db().await;
    place_order_event(&db.pool, &event(1, 0), true).await;
    let lease = Duration::from_millis(800);
    let relays = [
        (
            "relay sessions",
            OutboxStore::connect_bounded(&db.url, 2, "switchyard-test", Some(lease / 2))
                .await
                .unwrap(),
        ),
        ("a pool made elsewhere", OutboxStore::new(db.pool.clone())),
    ];
    for (what, store) in &relays {
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("LOCK TABLE switchyard_outbox IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *holder)
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let stuck = store.claim("a", 10, lease).await;
        let took = started.elapsed();
        holder.rollback().await.unwrap();
        assert!(
            matches!(stuck, Err(switchyard::store::Error::ClaimTimedOut { .. })),
            "{what}: {stuck:?}"
        );
        assert!(took < Duration::from_secs(10), "{what}: cancelled after {took:?}");
    }
    let (_, store) = &relays[0];
    let claim = store.claim("a", 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(claim.rows.len(), 1, "the row is claimed once the table is free");
}

/// A DBA may set `lock_timeout` or `statement_timeout` on the relay's role,
/// and then an ack is cancelled now and then: here, waiting for a session
/// that holds its row `FOR SHARE` (as a claim does, briefly, with the row
/// an event waits behind). That is not the database refusing the row's
/// outcome: the row was published and must not be dead-lettered. The ack
/// is tried again; if the row is held longer than that, the ack fails and
/// the row comes back when its lease ends.
#[tokio::test]
async fn a_cancelled_ack_does_not_dead_letter_a_published_row() {
    let db = fresh_db().await;
    sqlx::query(&format!("ALTER DATABASE {} SET lock_timeout = '300ms'", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let store = OutboxStore::connect(&db.url, 4).await.unwrap();
    for (aggregate, held_ms, recorded) in [(1, 500, "published"), (2, 3_000, "in_flight")] {
        place_order_event(&db.pool, &event(aggregate, 0), true).await;
        let claim = store.claim("a", 10, LEASE).await.unwrap();
        assert_eq!(claim.rows.len(), 1);
        let id = claim.rows[0].id;
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = 0")
            .execute(&mut *holder)
            .await
            .unwrap();
        sqlx::query("SELECT 1 FROM switchyard_outbox WHERE id = $1 FOR SHARE")
            .bind(id.0)
            .execute(&mut *holder)
            .await
            .unwrap();
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(held_ms)).await;
            holder.commit().await.unwrap();
        });
        let acked = store.ack(claim.lease, &[outcome(id, Outcome::Published)]).await;
        release.await.unwrap();
        let (status, error) = sqlx::query_as::<_, (String, Option<String>)>(
            "SELECT status, last_error FROM switchyard_outbox WHERE id = $1",
        )
        .bind(id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(status, recorded, "held {held_ms} ms: {error:?}, ack {acked:?}");
        match acked {
            Ok(ids) => assert_eq!(ids, [id]),
            Err(error) => assert!(error.to_string().contains("lock timeout"), "{error}"),
        }
    }
}

/// A DBA may make SERIALIZABLE (or REPEATABLE READ) the database's default
/// isolation. The claim and ack are written for READ COMMITTED, where a row
/// another claim just changed is re-checked or skipped; at a stricter level
/// PostgreSQL fails such statements with serialization errors instead.
#[tokio::test]
async fn a_stricter_default_isolation_does_not_reach_the_relays_statements() {
    let db = fresh_db().await;
    sqlx::query(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'serializable'",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    const AGGREGATES: usize = 12;
    const EVENTS: usize = 30;
    for seq in 0..EVENTS {
        for aggregate in 0..AGGREGATES {
            place_order_event(&db.pool, &event(aggregate, seq), true).await;
        }
    }
    let store = OutboxStore::connect(&db.url, 12).await.unwrap();
    let errors = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut workers = Vec::new();
    for worker in 0..4 {
        let store = store.clone();
        let errors = errors.clone();
        workers.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < deadline {
                let claim = match store.claim(&format!("w{worker}"), 5, LEASE).await {
                    Ok(claim) => claim,
                    Err(error) => {
                        errors.lock().unwrap().push(format!("claim: {error}"));
                        continue;
                    }
                };
                if claim.rows.is_empty() {
                    if store.backlog().await.unwrap().0 == 0 {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                let outcomes: Vec<RowOutcome> = claim
                    .rows
                    .iter()
                    .map(|row| outcome(row.id, Outcome::Published))
                    .collect();
                if let Err(error) = store.ack(claim.lease, &outcomes).await {
                    errors.lock().unwrap().push(format!("ack: {error}"));
                }
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    let errors = std::mem::take(&mut *errors.lock().unwrap());
    assert!(
        errors.is_empty(),
        "{} errors, first: {:?}",
        errors.len(),
        errors.first()
    );
    assert_eq!(store.backlog().await.unwrap().0, 0);
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status <> 'published'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dead, 0);
}

/// Rows of the outbox table read so far, by scans and index fetches, as
/// the statistics have it once the reading backend has reported.
async fn outbox_rows_read_since(pool: &sqlx::PgPool, before: Option<i64>) -> i64 {
    let read = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT (COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0))::bigint
               FROM pg_stat_user_tables WHERE relname = 'switchyard_outbox'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    let Some(before) = before else {
        return read().await;
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let now = read().await;
        if now > before || std::time::Instant::now() > deadline {
            return now - before;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The oldest-pending age is read at every scrape. Published rows kept for
/// retention are most of the table; the figure must not read them.
#[tokio::test]
async fn the_oldest_pending_age_reads_no_published_rows() {
    let db = fresh_db().await;
    let insert = |created: &str, not_before: &str| {
        format!(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, created_at, not_before)
             VALUES ('order', 'o-' || gen_random_uuid(), 'OrderPaid', '{{}}', {created}, {not_before})"
        )
    };
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at)
         SELECT 'order', 'kept-' || g, 'OrderPaid', '{}', 'published', now() FROM generate_series(1, 5000) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Delayed rows are not waiting yet, whatever their age.
    for _ in 0..3 {
        sqlx::query(&insert("now() - interval '5 hours'", "now() + interval '1 hour'"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    sqlx::query(&insert("now() - interval '1 hour'", "NULL"))
        .execute(&db.pool)
        .await
        .unwrap();
    // A backlog as large as what is kept, with fresh statistics: walking
    // the primary key from the lowest id looks cheap to a planner that
    // expects waiting rows spread among the published ones.
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'queued-' || g, 'OrderPaid', '{}' FROM generate_series(1, 5000) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE switchyard_outbox")
        .execute(&db.pool)
        .await
        .unwrap();

    let store = OutboxStore::new(db.pool.clone());
    let before = outbox_rows_read_since(&db.pool, None).await;
    let age = store.oldest_pending_age().await.unwrap().unwrap();
    let read = outbox_rows_read_since(&db.pool, Some(before)).await;
    assert!(
        (3590.0..3700.0).contains(&age),
        "the row written an hour ago: {age}"
    );
    assert!(
        (1..10).contains(&read),
        "with 5,000 published rows kept, the oldest-pending age read {read} rows"
    );
}

/// A statement cancelled in the row-by-row pass (a row refused, the next
/// one locked past `lock_timeout`) is tried again alone. Sending the whole
/// batch again found the rows recorded before it no longer under the
/// lease, and reported them lost.
#[tokio::test]
async fn a_cancelled_statement_in_the_row_by_row_pass_keeps_what_was_recorded() {
    let db = fresh_db().await;
    sqlx::query(&format!("ALTER DATABASE {} SET lock_timeout = '300ms'", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let store = OutboxStore::connect(&db.url, 4).await.unwrap();
    for aggregate in 0..3 {
        place_order_event(&db.pool, &event(aggregate, 0), true).await;
    }
    let claim = store.claim("a", 10, LEASE).await.unwrap();
    let mut ids: Vec<RowId> = claim.rows.iter().map(|row| row.id).collect();
    ids.sort_unstable_by_key(|id| id.0);
    let mut outcomes: Vec<_> = ids.iter().map(|id| outcome(*id, Outcome::Published)).collect();
    // PostgreSQL text refuses NUL: the batch falls back to row by row.
    outcomes[1].plugin_version = Some("bad\u{0}version".into());
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = 0")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM switchyard_outbox WHERE id = $1 FOR SHARE")
        .bind(ids[2].0)
        .execute(&mut *holder)
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        holder.commit().await.unwrap();
    });
    let mut acked = store.ack(claim.lease, &outcomes).await.unwrap();
    release.await.unwrap();
    acked.sort_unstable_by_key(|id| id.0);
    assert_eq!(acked, ids, "every row recorded is reported recorded");
    let statuses: Vec<String> = sqlx::query_scalar("SELECT status FROM switchyard_outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(statuses, ["published", "dead", "published"]);
}

/// A relay's store on `url` (its sessions' settings, a statement timeout of
/// half [`LEASE`]) named `application_name`, `max` connections, keeping
/// `keep` sessions between claims and acks.
async fn keeping(url: &str, max: u32, application_name: &str, keep: usize) -> OutboxStore {
    OutboxStore::connect_bounded(url, max, application_name, Some(LEASE / 2))
        .await
        .unwrap()
        .keeping_sessions(keep)
}

/// The last statement of each of the sessions named `application_name`,
/// by process id.
async fn last_statements(pool: &sqlx::PgPool, application_name: &str) -> BTreeMap<i32, String> {
    sqlx::query_as::<_, (i32, String)>("SELECT pid, query FROM pg_stat_activity WHERE application_name = $1")
        .bind(application_name)
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// The process whose last statement starts with `start`.
fn ran(statements: &BTreeMap<i32, String>, start: &str) -> Option<i32> {
    statements
        .iter()
        .find(|(_, query)| query.trim_start().starts_with(start))
        .map(|(pid, _)| *pid)
}

/// At service rates each event is its own claim and ack: a relay's claim
/// and its ack run on one server session, the next claim on that same one
/// (through the pool each took the session idle longest, and each went
/// back to be pinged).
#[tokio::test]
async fn a_claim_its_ack_and_the_next_claim_share_one_session() {
    let db = fresh_db().await;
    let name = format!("switchyard-sessions-{}", db.name);
    let store = keeping(&db.url, 6, &name, 4).await;
    // Sessions the pool opened earlier, idle: the first-in-first-out pool
    // would hand them out in turn.
    let (a, b, c) = tokio::join!(store.backlog(), store.backlog(), store.backlog());
    for backlog in [a, b, c] {
        backlog.unwrap();
    }
    for seq in 0..5 {
        place_order_event(&db.pool, &event(1, seq), true).await;
        let claim = store.claim("a", 10, LEASE).await.unwrap();
        assert_eq!(claim.rows.len(), 1);
        let claimed = last_statements(&db.pool, &name).await;
        let claimer =
            ran(&claimed, "WITH").unwrap_or_else(|| panic!("no session shows the claim: {claimed:?}"));
        let outcomes = [outcome(claim.rows[0].id, Outcome::Published)];
        assert_eq!(store.ack(claim.lease, &outcomes).await.unwrap().len(), 1);
        let acked = last_statements(&db.pool, &name).await;
        assert_eq!(
            ran(&acked, "SELECT switchyard_ack"),
            Some(claimer),
            "event {seq}: the ack runs where the claim ran, and nothing since: {acked:?}"
        );
        let nothing = store.claim("a", 10, LEASE).await.unwrap();
        assert!(nothing.rows.is_empty());
        let after = last_statements(&db.pool, &name).await;
        assert_eq!(
            ran(&after, "WITH"),
            Some(claimer),
            "event {seq}: the next claim runs on the same session: {after:?}"
        );
    }
}

/// A batch whose ack never comes (its relay task aborted) keeps its
/// session only until its lease ends: then the next claim lets it go, and
/// a pool with no other session goes on.
#[tokio::test]
async fn a_session_held_for_an_ack_that_never_comes_is_let_go_when_the_lease_ends() {
    let db = fresh_db().await;
    let store = keeping(&db.url, 1, "switchyard-test", 1).await;
    place_order_event(&db.pool, &event(1, 0), true).await;
    let lease = Duration::from_millis(300);
    let abandoned = store.claim("a", 10, lease).await.unwrap();
    assert_eq!(abandoned.rows.len(), 1);
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let again = tokio::time::timeout(Duration::from_secs(5), store.claim("b", 10, LEASE))
        .await
        .expect("the abandoned claim's session came back to the pool")
        .unwrap();
    assert_eq!(
        again.rows.len(),
        1,
        "its row is claimed again once the lease ended"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    let taken = [outcome(again.rows[0].id, Outcome::Published)];
    assert_eq!(store.ack(again.lease, &taken).await.unwrap().len(), 1);
    let late = [outcome(abandoned.rows[0].id, Outcome::Published)];
    assert!(
        store.ack(abandoned.lease, &late).await.unwrap().is_empty(),
        "the abandoned lease is fenced"
    );
}

/// A kept session the server closed meanwhile (a restart, an idle
/// timeout, an operator) is found out by its ping when it has been idle for
/// a second: the claim that takes it next does not fail.
#[tokio::test]
async fn a_kept_session_the_server_closed_is_replaced_without_an_error() {
    let db = fresh_db().await;
    let name = format!("switchyard-closed-{}", db.name);
    let store = keeping(&db.url, 4, &name, 2).await;
    place_order_event(&db.pool, &event(1, 0), true).await;
    let claim = store.claim("a", 10, LEASE).await.unwrap();
    let outcomes = [outcome(claim.rows[0].id, Outcome::Published)];
    assert_eq!(store.ack(claim.lease, &outcomes).await.unwrap().len(), 1);
    let closed: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(&name)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(closed >= 1, "the kept session was closed");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    place_order_event(&db.pool, &event(2, 0), true).await;
    let next = store
        .claim("a", 10, LEASE)
        .await
        .expect("the claim after the session closed");
    assert_eq!(next.rows.len(), 1);
    let outcomes = [outcome(next.rows[0].id, Outcome::Published)];
    assert_eq!(store.ack(next.lease, &outcomes).await.unwrap().len(), 1);
}

/// Closing a store waits for every session to come back to its pool: the
/// sessions kept for an ack and for the next claim come back at once (a
/// relay that starts over closes its store before it opens another).
#[tokio::test]
async fn a_store_keeping_sessions_closes_at_once() {
    let db = fresh_db().await;
    let store = keeping(&db.url, 4, "switchyard-test", 3).await;
    for aggregate in 0..3 {
        place_order_event(&db.pool, &event(aggregate, 0), true).await;
    }
    let acked = store.claim("a", 1, LEASE).await.unwrap();
    let outcomes = [outcome(acked.rows[0].id, Outcome::Published)];
    assert_eq!(store.ack(acked.lease, &outcomes).await.unwrap().len(), 1);
    // Two batches waiting for their acks, on two sessions.
    let (first, second) = tokio::join!(store.claim("a", 1, LEASE), store.claim("b", 1, LEASE));
    assert_eq!(first.unwrap().rows.len() + second.unwrap().rows.len(), 2);
    tokio::time::timeout(Duration::from_secs(5), store.close())
        .await
        .expect("the store closed with sessions kept");
}

/// A relay stops even when its database stopped answering: a session
/// whose statement was answered just before the link went is pinged by
/// sqlx on its way back to the pool, without a bound, and closing the
/// store (a relay's last step) waited for that ping for ever.
#[tokio::test]
async fn a_store_closes_when_its_server_stopped_answering() {
    let db = fresh_db().await;
    let proxy = StallingProxy::in_front_of(&db.url).await;
    let store = OutboxStore::connect_bounded(&proxy.url(&db.url), 1, "switchyard-test", Some(LEASE / 2))
        .await
        .unwrap();
    store.refresh_statistics().await.unwrap();
    // Its session's ping on the way back is answered by now; within a
    // second of its use the pool hands it out again without one.
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.black_hole_after_the_next_answer();
    store.refresh_statistics().await.unwrap();
    // Its session is on its way back to the pool, its ping unanswered.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(30), store.close())
        .await
        .expect("the store closes, its server cut off");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "closed after {:?}",
        started.elapsed()
    );
}

/// A store of one pooled session, reached through a proxy that can stall
/// it, its statements cancelled by the server after `statement_timeout`.
async fn one_session_behind_a_proxy(
    statement_timeout: Duration,
) -> (switchyard_tests::postgres::TestDb, StallingProxy, OutboxStore) {
    let db = fresh_db().await;
    let proxy = StallingProxy::in_front_of(&db.url).await;
    let store =
        OutboxStore::connect_bounded(&proxy.url(&db.url), 1, "switchyard-test", Some(statement_timeout))
            .await
            .unwrap();
    (db, proxy, store)
}

/// Stalls the store's session once it is back in the pool (sqlx pings a
/// session as it comes back, and waits for ever on one that stalled then),
/// used less than a second ago: the pool hands it out again without a ping.
async fn stall_after_its_return(proxy: &StallingProxy) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.stall_open_connections();
}

/// A sweep or a statistics refresh sent on a pooled session just before it
/// stopped answering (a link that drops every packet, no reset) gives up
/// within the bound a claim has, instead of holding its loop and a place in
/// the pool until the kernel gives up, and the next one gets a new session.
#[tokio::test]
async fn background_statements_give_up_on_a_session_that_stops_answering() {
    // Given up 1 s after the server's own cancel.
    let (_db, proxy, store) = one_session_behind_a_proxy(Duration::from_secs(1)).await;
    store.refresh_statistics().await.unwrap();
    stall_after_its_return(&proxy).await;
    gives_up_unanswered("the refresh", store.refresh_statistics()).await;
    store.refresh_statistics().await.expect("a new session");
    // The same for the sweeps.
    stall_after_its_return(&proxy).await;
    let swept = tokio::time::timeout(Duration::from_secs(30), store.wake_waiting(None))
        .await
        .expect("the sweep gives up");
    assert!(swept.is_err(), "{swept:?}");
    assert_eq!(store.unpark_stranded(10).await.unwrap(), 0);
    // And for a fleet's ownership of the database: a renewal that waited
    // for ever would let the lease run out while its relay went on serving.
    let token = store
        .take_ownership("relay-a", LEASE)
        .await
        .unwrap()
        .expect("free");
    stall_after_its_return(&proxy).await;
    let renewed = tokio::time::timeout(
        Duration::from_secs(30),
        store.renew_ownership("relay-a", token, LEASE),
    )
    .await
    .expect("the renewal gives up");
    assert!(renewed.is_err(), "{renewed:?}");
    assert!(store.ownership(LEASE).await.unwrap().held);
    store.close().await;
}

/// Runs `statement` once, then again on its session just stalled, gives
/// up on it after 500 ms, and needs the pool to answer on a new session
/// within 5 s.
async fn gives_up_on_a_stalled_session(statement: impl AsyncFn(&OutboxStore)) {
    let (_db, proxy, store) = one_session_behind_a_proxy(Duration::from_secs(5)).await;
    statement(&store).await;
    stall_after_its_return(&proxy).await;
    let gave_up = tokio::time::timeout(Duration::from_millis(500), statement(&store)).await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    tokio::time::timeout(Duration::from_secs(5), store.ping())
        .await
        .expect("a session within 5 s")
        .expect("a new session answers");
    store.close().await;
}

/// A readiness check gives up after its own 3 s, before the store's bound,
/// and drops the statement it was waiting for. Its session, stalled, must
/// not go back to the pool: sqlx pings a session on its way back and would
/// wait there for ever, and a pool of one would have nothing left.
#[tokio::test]
async fn a_statement_its_caller_gave_up_on_leaves_no_session_behind() {
    gives_up_on_a_stalled_session(async |store| store.ping().await.unwrap()).await;
}

/// The same for the replication slot's status, which readiness reads
/// under the same 3 s bound.
#[tokio::test]
async fn a_slot_status_its_caller_gave_up_on_leaves_no_session_behind() {
    gives_up_on_a_stalled_session(async |store| {
        assert!(store.slot_status("switchyard_none").await.unwrap().is_none());
    })
    .await;
}

/// CPU time (user and system) the server process `pid` has used so far.
fn cpu_of(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the session's process");
    // utime and stime are the 14th and 15th fields; the command's name
    // (second, in parentheses) may hold spaces.
    let after_name = &stat[stat.rfind(')').expect("a stat line") + 1..];
    let fields: Vec<u64> = after_name
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|field| field.parse().expect("a tick count"))
        .collect();
    let per_second: u64 = String::from_utf8(
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .expect("getconf")
            .stdout,
    )
    .expect("a number")
    .trim()
    .parse()
    .expect("a number");
    Duration::from_millis((fields[0] + fields[1]) * 1000 / per_second)
}

/// A relay's sessions leave the planner only index probes, which prices
/// any scan at ten billion; PostgreSQL then JIT-compiled, with inlining
/// and optimisation, each statement that has to scan (the fleet's
/// ownership read scans the few rows of `switchyard_relays`): a second or
/// more of CPU for a statement that runs in a tenth of a millisecond, on
/// every follower of every database each renewal period.
#[tokio::test]
async fn a_relay_session_does_not_compile_its_statements() {
    let db = fresh_db().await;
    let name = format!("switchyard-jit-{}", uuid::Uuid::new_v4().simple());
    let store = OutboxStore::connect_bounded(&db.url, 1, &name, Some(LEASE / 2))
        .await
        .unwrap();
    for _ in 0..20 {
        store.ownership(Duration::from_secs(5)).await.unwrap();
    }
    let pid: i32 = sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
        .bind(&name)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // Each read takes well under a millisecond; compiled, well over ten.
    let cpu = cpu_of(pid);
    assert!(
        cpu < Duration::from_millis(500),
        "20 ownership reads cost the server {cpu:?} of CPU"
    );
}

/// A relay's announcement forgets relays unseen for a day (killed ones, or
/// fleets restarted under new names, leave their rows) and keeps the rest.
#[tokio::test]
async fn an_announcement_forgets_relays_unseen_for_a_day() {
    for outbox in [TestOutbox::postgres().await, TestOutbox::sqlite().await] {
        let day_ms = switchyard::store::FORGOTTEN_AFTER.as_millis();
        let ago = |ms: u128| match outbox.kind {
            "sqlite" => format!("CAST(unixepoch('subsec') * 1000 AS INTEGER) - {ms}"),
            _ => format!("now() - {ms} * interval '1 millisecond'"),
        };
        outbox
            .execute(&format!(
                "INSERT INTO switchyard_relays (instance_id, seen_at) VALUES
                 ('killed-long-ago', {}), ('quiet-an-hour', {})",
                ago(day_ms + 60_000),
                ago(3_600_000)
            ))
            .await;
        outbox.store.announce_relay("me", None).await.unwrap();
        let left: Vec<String> = outbox
            .store
            .running_relays(switchyard::store::FORGOTTEN_AFTER * 2)
            .await
            .unwrap()
            .into_iter()
            .map(|relay| relay.instance_id)
            .collect();
        let mut left = left;
        left.sort();
        assert_eq!(left, ["me", "quiet-an-hour"], "{}", outbox.kind);
    }
}
