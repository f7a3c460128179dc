//! Rows as writers leave them: malformed, oversized or mistyped rows fail
//! alone with a specific error, and the ack keeps, deletes or archives
//! published ones.

use super::*;

on_every_backend!(
    no_single_rows_content_can_fail_the_batch_ack,
    writers_get_a_specific_error_for_oversized_keys,
    published_rows_can_be_deleted_or_archived_by_the_ack,
    a_row_the_relay_cannot_read_is_refused_alone,
    payloads_over_the_limit_are_let_go_as_the_claim_reads_them,
);

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
    } else if db.kind == "mariadb" {
        // Typed columns and checks: only a row written with the checks
        // off (an import, a restore) gets past them.
        &[
            (
                "SET SESSION check_constraint_checks = 0;
                 UPDATE switchyard_outbox SET event_id = 'legacy-o-0' WHERE aggregate_id = 'o-0'",
                "event_id \"legacy-o-0\" is not a UUID",
            ),
            (
                "SET SESSION check_constraint_checks = 0;
                 UPDATE switchyard_outbox SET headers = 'not json' WHERE aggregate_id = 'o-1'",
                "headers",
            ),
        ]
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
        db.store
            .entry(row.id.0, true)
            .await
            .expect("entry")
            .expect("the row");
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
