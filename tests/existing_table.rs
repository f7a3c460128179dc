//! An outbox table the services already write (`[source]`): a service that
//! knows nothing of Switchyard writes Debezium's outbox shape in its
//! transactions; `migrate` installs the capture trigger after `--dry-run`
//! showed it; relays publish to NATS and Kafka with order kept through a
//! SIGKILL; writers are never failed by the copy.

use std::path::PathBuf;
use std::time::Duration;

use sqlx::{Executor, PgPool};
use switchyard_tests::config::{Plugin, Source, Target, TestConfig};
use switchyard_tests::fanout::{AUDIT_STREAM, Copies, fan_out, relay_section, verify_kafka, verify_nats};
use switchyard_tests::kafka::KafkaServer;
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::write_orders_to;
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{
    DEBEZIUM_OUTBOX, Outbox, all_published, count_status, debezium_source, fresh_db, fresh_db_before,
};
use switchyard_tests::relay::{Process, kill_while_holding_leases, parse};
use switchyard_tests::stall::{StallingProxy, gives_up_unanswered};
use switchyard_tests::{cli, init_logging};

const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");

/// A copied row: payload, payload bytes, status, last error.
type Copy = (Option<serde_json::Value>, Option<Vec<u8>>, String, Option<String>);

fn write_config(text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("sy-source-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, text).expect("write config");
    path
}

/// A relay config for `[source]` checks: `source`, one plugin, the stdout
/// target.
fn stdout_config(db: &str, source: Source) -> String {
    TestConfig::new(db)
        .plugin(Plugin::new("router", &plugin("route_by_type")).to("out", "orders.{event_type}"))
        .target("out", Target::stdout())
        .source(source)
        .toml()
}

/// Checks `config`'s `[source]` against the database and installs its
/// trigger, through the store as `switchyard migrate` does.
async fn install_capture(db_url: &str, config: &switchyard::Config) -> switchyard::store::capture::Capture {
    let store = switchyard::OutboxStore::connect(db_url, 2).await.unwrap();
    let pg = store.postgres().expect("a PostgreSQL store");
    let capture = pg.check_source(config.source.as_ref().unwrap()).await.unwrap();
    pg.install_capture(&capture, false).await.unwrap();
    store.close().await;
    capture
}

/// Tables, triggers, functions and migrations: what a change would alter.
async fn catalog(pool: &PgPool) -> (i64, i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_class), (SELECT count(*) FROM pg_trigger),
                (SELECT count(*) FROM pg_proc), (SELECT count(*) FROM _sqlx_migrations)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_outbox_reaches_nats_and_kafka_in_order_through_a_relay_killed_mid_stream() {
    init_logging();
    let db = fresh_db().await;
    db.pool.execute(DEBEZIUM_OUTBOX).await.unwrap();
    let kafka = KafkaServer::start().await;
    let nats = NatsServer::start().await;
    kafka.create_topic("orders", 4).await;
    kafka.create_topic("orders-analytics", 2).await;
    nats.create_stream(AUDIT_STREAM, &["audit.>"]).await;
    // Short leases so the killed relay's rows come back quickly.
    let relay = relay_section()
        .set("lease_duration_ms", "3000")
        .set("publish_timeout_ms", "1000");
    let config = fan_out(
        &relay,
        &db.url,
        &kafka.bootstrap(),
        &kafka.bootstrap(),
        &nats.url(),
    )
    .source(debezium_source())
    .toml();
    let path = write_config(&config);
    let (code, out, err) = cli(SWITCHYARD, &["migrate", "--config", path.to_str().unwrap()], &[]).await;
    assert_eq!(code, 0, "migrate: {out}{err}");
    assert!(
        out.contains("capture trigger on \"public\".\"outbox\" installed"),
        "{out}"
    );

    // The service writes while both relays run: captures race claims.
    let writer = {
        let pool = db.pool.clone();
        tokio::spawn(async move { write_orders_to(&pool, Outbox::Debezium, 150, 20, 6).await })
    };
    let mut b = Process::spawn(SWITCHYARD, &config, "relay-b");
    let orphaned = kill_while_holding_leases(SWITCHYARD, &config, &db.pool, || {}).await;
    let expected = writer.await.unwrap();
    assert_eq!(expected.len(), 3000);
    all_published(&db.pool, 3000, Duration::from_secs(180)).await;
    b.terminate();

    assert_eq!(count_status(&db.pool, "dead").await, 0);
    let taken_over: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE attempts > 1")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        taken_over >= orphaned,
        "the killed relay's {orphaned} rows were re-claimed ({taken_over} retried)"
    );
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(kept, 3000, "the service's own table is left as it wrote it");

    verify_nats(&nats.read_stream(AUDIT_STREAM).await, &expected);
    let limit = Duration::from_secs(60);
    // The killed relay's last batch may reach Kafka twice; order is judged
    // on first copies, and the copies are bounded by what it held.
    let copies = verify_kafka(
        &kafka.read_topic("orders", 3000, limit).await,
        &expected,
        Copies::AtLeastOnce,
    );
    assert!(copies <= 400, "{copies} extra copies on Kafka");
    verify_kafka(
        &kafka.read_topic("orders-analytics", 3000, limit).await,
        &expected,
        Copies::AtLeastOnce,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_dry_run_shows_the_capture_and_changes_nothing_then_migrate_installs_it() {
    init_logging();
    // No outbox schema yet: the service's table only.
    let db = fresh_db_before(0).await;
    db.pool.execute(DEBEZIUM_OUTBOX).await.unwrap();
    // Two rows from before the relay, the later one written first.
    db.pool
        .execute(
            "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, \"timestamp\") VALUES
               (gen_random_uuid(), 'order', 'order-1', 'OrderPaid', '{\"seq\": 1}', now()),
               (gen_random_uuid(), 'order', 'order-1', 'OrderCreated', '{\"seq\": 0}', now() - interval '1 hour')",
        )
        .await
        .unwrap();
    let config = stdout_config(&db.url, debezium_source());
    let path = write_config(&config);
    let path = path.to_str().unwrap();

    let before = catalog(&db.pool).await;
    let (code, out, err) = cli(
        SWITCHYARD,
        &["migrate", "--dry-run", "--backfill", "--config", path],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    for part in [
        "CREATE TABLE switchyard_outbox",
        "CREATE TRIGGER switchyard_capture AFTER INSERT ON \"public\".\"outbox\"",
        "SECURITY DEFINER",
        "-- Backfill: the rows already in \"public\".\"outbox\"",
        "ORDER BY s.\"timestamp\"",
    ] {
        assert!(out.contains(part), "dry run lacks {part:?}:\n{out}");
    }
    assert_eq!(catalog(&db.pool).await, before, "--dry-run changed the database");
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", path], &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("warning: \"public\".\"outbox\" has no capture trigger"),
        "{out}"
    );
    // The book's order: validate, then migrate; the schema is not there yet.
    assert!(
        out.contains("warning: table switchyard_outbox does not exist yet"),
        "{out}"
    );

    let (code, out, err) = cli(SWITCHYARD, &["migrate", "--backfill", "--config", path], &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("2 existing row(s) of \"public\".\"outbox\" copied"),
        "{out}"
    );
    db.pool
        .execute(
            "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
             VALUES (gen_random_uuid(), 'order', 'order-1', 'OrderShipped', '{\"seq\": 2}')",
        )
        .await
        .unwrap();
    let copied: Vec<(String, i64)> = sqlx::query_as(
        "SELECT o.event_type, (o.payload ->> 'seq')::int8 FROM switchyard_outbox o
           JOIN outbox s ON s.id = o.event_id ORDER BY o.id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        copied,
        [
            ("OrderCreated".to_string(), 0),
            ("OrderPaid".into(), 1),
            ("OrderShipped".into(), 2)
        ],
        "backfilled in `order_by` order, then captured; each keeps the service's id"
    );
    let (code, out, _) = cli(SWITCHYARD, &["migrate", "--dry-run", "--config", path], &[]).await;
    assert_eq!(code, 0);
    assert!(out.contains("nothing to do"), "{out}");

    // Debezium's pattern, twice with the same event id: insert, delete in
    // the same transaction, then the same event again. The writer commits;
    // the event is copied once.
    for _ in 0..2 {
        db.pool
            .execute(
                "BEGIN;
                 INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
                 VALUES ('7b0f3c4e-8a9d-4c1e-9f2a-3d5e6f708192', 'order', 'order-2', 'OrderCreated', '{}');
                 DELETE FROM outbox WHERE id = '7b0f3c4e-8a9d-4c1e-9f2a-3d5e6f708192';
                 COMMIT;",
            )
            .await
            .expect("the writer's transaction commits");
    }
    let copies: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox WHERE event_id = '7b0f3c4e-8a9d-4c1e-9f2a-3d5e6f708192'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(copies, 1);

    // Another mapping: the installed trigger no longer matches, and a relay
    // refuses to start rather than relay by the old one.
    let changed = stdout_config(&db.url, debezium_source().column("tenant", "aggregatetype"));
    let error = switchyard::runtime::build(&parse(&changed))
        .await
        .err()
        .expect("a relay does not start on an outdated capture trigger");
    assert!(
        error
            .to_string()
            .contains("was made from another [source] mapping"),
        "{error}"
    );
    let changed_path = write_config(&changed);
    let changed_path = changed_path.to_str().unwrap();
    let (code, out, err) = cli(SWITCHYARD, &["migrate", "--config", changed_path], &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(switchyard::runtime::build(&parse(&changed)).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_lists_every_mismatch_with_the_live_table() {
    init_logging();
    let db = fresh_db().await;
    db.pool
        .execute("CREATE TABLE legacy_events (id text, kind integer, body integer, occurred timestamptz)")
        .await
        .unwrap();
    let source = |table: &str| {
        Source::table(table)
            .column("event_id", "id")
            .column("aggregate_type", "kind")
            .column("aggregate_id", "entity")
            .column("event_type", "name")
            .column("payload", "body")
    };
    let path = write_config(&stdout_config(&db.url, source("legacy_events")));
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", path.to_str().unwrap()], &[]).await;
    assert_ne!(code, 0, "{out}");
    for problem in [
        "source.columns.event_id: column \"id\" of \"public\".\"legacy_events\" is text; it needs uuid",
        "source.columns.aggregate_type: column \"kind\" of \"public\".\"legacy_events\" is integer; it needs a text type",
        "source.columns.aggregate_id: \"public\".\"legacy_events\" has no column \"entity\"",
        "source.columns.event_type: \"public\".\"legacy_events\" has no column \"name\"",
        "source.columns.payload: column \"body\" of \"public\".\"legacy_events\" is integer; it needs jsonb, json, a text type or bytea",
    ] {
        assert!(err.contains(problem), "missing {problem:?} in:\n{err}");
    }

    let missing = stdout_config(&db.url, source("no_such_table"));
    let path = write_config(&missing);
    let (code, _, err) = cli(SWITCHYARD, &["validate", "--config", path.to_str().unwrap()], &[]).await;
    assert_ne!(code, 0);
    assert!(err.contains("table \"no_such_table\" does not exist"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_is_never_failed_by_the_copy_and_needs_no_privilege_on_the_relay_table() {
    init_logging();
    let db = fresh_db().await;
    // A hand-rolled outbox: bigint ids, a text payload, nullable keys.
    db.pool
        .execute(
            "CREATE TABLE events (id bigserial PRIMARY KEY, aggregate_type text, aggregate_id text,
                                  event_type text, body text, processed_at timestamptz)",
        )
        .await
        .unwrap();
    let source = Source::table("events")
        .column("aggregate_type", "aggregate_type")
        .column("aggregate_id", "aggregate_id")
        .column("event_type", "event_type")
        .column("payload", "body");
    let config = parse(&stdout_config(&db.url, source));
    install_capture(&db.url, &config).await;

    // The service's role may insert into its table and nothing else.
    let role = format!("{}_writer", db.name);
    db.pool
        .execute(
            format!(
                "CREATE ROLE {role};
                 GRANT INSERT ON events TO {role};
                 GRANT USAGE ON SEQUENCE events_id_seq TO {role};"
            )
            .as_str(),
        )
        .await
        .unwrap();
    let privileged: bool = sqlx::query_scalar(&format!(
        "SELECT has_table_privilege('{role}', 'switchyard_outbox', 'INSERT')"
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(!privileged);
    let long_key = "k".repeat(2000);
    let rows: [(&str, Option<&str>, &str, &str); 7] = [
        ("a-1", Some("a-1"), "Created", r#"{"seq": 0}"#),
        ("a-1", Some("a-1"), "Paid", r#"{"seq": 1}"#),
        ("a-1", Some("a-1"), "Shipped", r#"{"seq": 2}"#),
        ("bytes", Some("b-1"), "Note", "not json at all"),
        ("nul", Some("n-1"), "Note", r#"{"text": "\u0000"}"#),
        ("null-key", None, "Note", "{}"),
        ("long-key", Some(long_key.as_str()), "Note", "{}"),
    ];
    let mut tx = db.pool.begin().await.unwrap();
    tx.execute(format!("SET LOCAL ROLE {role}").as_str())
        .await
        .unwrap();
    // One statement, several rows of one aggregate: copied in their order.
    let mut insert =
        sqlx::QueryBuilder::new("INSERT INTO events (aggregate_type, aggregate_id, event_type, body) ");
    insert.push_values(rows.iter(), |mut row, (kind, id, event_type, body)| {
        let kind = if *kind == "a-1" { "order" } else { kind };
        row.push_bind(kind)
            .push_bind(*id)
            .push_bind(*event_type)
            .push_bind(*body);
    });
    insert
        .build()
        .execute(&mut *tx)
        .await
        .expect("the service's insert");
    tx.commit().await.expect("the service's commit");

    let copies: Vec<Copy> = sqlx::query_as(
        "SELECT payload, payload_bytes, status, last_error FROM switchyard_outbox ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(copies.len(), 7);
    let seqs: Vec<_> = copies[..3]
        .iter()
        .map(|c| c.0.as_ref().unwrap()["seq"].clone())
        .collect();
    assert_eq!(seqs, [0, 1, 2], "one statement's rows keep their order");
    assert!(copies[..3].iter().all(|c| c.2 == "pending"));
    assert_eq!(
        copies[3].1.as_deref(),
        Some(&b"not json at all"[..]),
        "not JSON: carried as bytes"
    );
    assert_eq!(copies[3].2, "pending");
    assert_eq!(
        copies[4].1.as_deref(),
        Some(br#"{"text": "\u0000"}"#.as_slice()),
        "JSON jsonb refuses: carried as bytes"
    );
    assert_eq!(copies[5].2, "dead");
    assert_eq!(
        copies[5].3.as_deref(),
        Some("cannot be relayed from \"public\".\"events\": aggregate_id (column \"aggregate_id\") is NULL")
    );
    assert_eq!(copies[6].2, "dead");
    assert!(
        copies[6]
            .3
            .as_deref()
            .unwrap()
            .ends_with("aggregate_id (column \"aggregate_id\") is 2000 bytes; at most 1024"),
        "{:?}",
        copies[6].3
    );
    db.pool
        .execute(format!("DROP OWNED BY {role}; DROP ROLE {role}").as_str())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_trigger_disabled_or_dropped_while_the_relay_runs_makes_it_unready() {
    init_logging();
    let db = fresh_db().await;
    db.pool.execute(DEBEZIUM_OUTBOX).await.unwrap();
    let config = parse(&stdout_config(&db.url, debezium_source()));
    install_capture(&db.url, &config).await;
    let relay = switchyard::runtime::build(&config).await.expect("relay starts");
    let capture_check = || async {
        let readiness = switchyard::admin::readiness(&relay).await;
        let capture = readiness.capture.expect("a capture check with [source]");
        (readiness.ready, capture.to_string())
    };
    assert_eq!(capture_check().await, (true, "ok".to_string()));

    db.pool
        .execute("ALTER TABLE outbox DISABLE TRIGGER switchyard_capture")
        .await
        .unwrap();
    let (ready, check) = capture_check().await;
    assert!(!ready);
    assert!(
        check.contains("the capture trigger on \"public\".\"outbox\" is disabled"),
        "{check}"
    );
    let refused = switchyard::runtime::build(&config).await.err().expect("refused");
    assert!(refused.to_string().contains("is disabled"), "{refused}");

    db.pool
        .execute("DROP TRIGGER switchyard_capture ON outbox")
        .await
        .unwrap();
    let (ready, check) = capture_check().await;
    assert!(!ready);
    assert!(check.contains("has no capture trigger"), "{check}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_need_quoting_are_captured() {
    init_logging();
    let db = fresh_db().await;
    db.pool
        .execute(
            r#"CREATE SCHEMA "Shop Data";
               CREATE TABLE "Shop Data"."Outbox Events" (
                   "Id" uuid PRIMARY KEY, "Aggregate %s Type" text NOT NULL, "aggregate-id" text,
                   "Type" text NOT NULL, "Pay%load" jsonb)"#,
        )
        .await
        .unwrap();
    let source = Source::table("Outbox Events")
        .set("schema", "Shop Data")
        .column("event_id", "Id")
        .column("aggregate_type", "Aggregate %s Type")
        .column("aggregate_id", "aggregate-id")
        .column("event_type", "Type")
        .column("payload", "Pay%load");
    let config = parse(&stdout_config(&db.url, source));
    let capture = install_capture(&db.url, &config).await;
    assert_eq!(capture.table(), r#""Shop Data"."Outbox Events""#);
    db.pool
        .execute(
            r#"INSERT INTO "Shop Data"."Outbox Events" VALUES
                 (gen_random_uuid(), 'order', 'o-1', 'OrderCreated', '{"a": 1}'),
                 (gen_random_uuid(), 'order', NULL, 'OrderPaid', '{}'),
                 (gen_random_uuid(), repeat('t', 300), 'o-2', 'OrderPaid', '{}')"#,
        )
        .await
        .unwrap();
    let copies: Vec<(String, String, Option<String>)> =
        sqlx::query_as("SELECT aggregate_id, status, last_error FROM switchyard_outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        copies,
        [
            ("o-1".to_string(), "pending".to_string(), None),
            (
                String::new(),
                "dead".into(),
                Some(
                    r#"cannot be relayed from "Shop Data"."Outbox Events": aggregate_id (column "aggregate-id") is NULL"#
                        .into()
                )
            ),
            (
                "o-2".into(),
                "dead".into(),
                Some(
                    r#"cannot be relayed from "Shop Data"."Outbox Events": aggregate_type (column "Aggregate %s Type") is 300 bytes; at most 255"#
                        .into()
                )
            ),
        ]
    );
    assert!(
        switchyard::runtime::build(&config).await.is_ok(),
        "the installed trigger is current"
    );
}

/// Readiness checks the capture trigger under its own 3 s and drops the
/// check when that runs out; startup checks `[source]` against the table. The check's session, sent its statement just
/// before it stopped answering (a link that drops every packet), must not
/// go back to the pool: sqlx pings a session on its way back and would wait
/// there until the kernel gives up, and a pool of one would have nothing
/// left. The store gives up on it at its own bound as well.
#[tokio::test]
async fn a_capture_check_on_a_session_that_stops_answering_leaves_no_session_behind() {
    let db = fresh_db().await;
    db.pool.execute(DEBEZIUM_OUTBOX).await.unwrap();
    let config = parse(&stdout_config(&db.url, debezium_source()));
    let capture = install_capture(&db.url, &config).await;
    let proxy = StallingProxy::in_front_of(&db.url).await;
    let store = switchyard::OutboxStore::connect_bounded(
        &proxy.url(&db.url),
        1,
        "switchyard-test",
        Some(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let pg = store.postgres().expect("a PostgreSQL store");
    assert_eq!(pg.capture_problem(&capture).await.unwrap(), None);
    // Back in the pool and used less than a second ago: handed out again
    // without a ping, then stalled.
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.stall_open_connections();
    let gave_up = tokio::time::timeout(Duration::from_millis(500), pg.capture_problem(&capture)).await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    tokio::time::timeout(Duration::from_secs(5), store.ping())
        .await
        .expect("a session within 5 s")
        .expect("a new session answers");
    // Not dropped by its caller: the store's bound ends it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.stall_open_connections();
    gives_up_unanswered("the capture check", pg.capture_problem(&capture)).await;
    // The same for the check of `[source]` against the table at startup.
    store.ping().await.expect("a new session");
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.stall_open_connections();
    let started = std::time::Instant::now();
    let checked = tokio::time::timeout(
        Duration::from_secs(30),
        pg.check_source(config.source.as_ref().unwrap()),
    )
    .await
    .expect("the [source] check gives up");
    assert!(
        matches!(
            checked,
            Err(switchyard::store::capture::CheckError::Store(
                switchyard::store::Error::Unanswered { .. }
            ))
        ),
        "{checked:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    store.close().await;
}

/// The book's row trigger for a Debezium-shaped table on MariaDB, run as
/// the page shows it: each insert is copied in the writer's transaction,
/// with the writer's event id and trace context (none when the column is
/// NULL), and claimed and routed as any event; a rolled-back insert copies
/// nothing.
#[tokio::test]
async fn the_books_mysql_trigger_copies_a_debezium_outbox_in_the_writers_transaction() {
    let db = switchyard_tests::outbox::TestOutbox::mariadb().await;
    let pool = db.mysql_pool();
    sqlx::raw_sql(
        "CREATE TABLE outbox (
            id CHAR(36) PRIMARY KEY, aggregatetype VARCHAR(255) NOT NULL, aggregateid VARCHAR(255) NOT NULL,
            type VARCHAR(255) NOT NULL, payload JSON, tracingspancontext VARCHAR(512))",
    )
    .execute(&pool)
    .await
    .unwrap();
    let trigger = switchyard_tests::book::sql_block("how-to/existing-table.md", "outbox_to_switchyard");
    sqlx::raw_sql(&trigger).execute(&pool).await.unwrap();

    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let rows = [
        (
            "6f1c2a34-1111-4c39-8f5e-2b1d2c3d4e51",
            "o-1",
            "OrderCreated",
            Some(traceparent),
        ),
        ("6f1c2a34-2222-4c39-8f5e-2b1d2c3d4e52", "o-1", "OrderPaid", None),
        (
            "6f1c2a34-3333-4c39-8f5e-2b1d2c3d4e53",
            "o-2",
            "OrderCreated",
            None,
        ),
    ];
    let mut tx = pool.begin().await.unwrap();
    for (id, aggregate, kind, trace) in rows {
        sqlx::query(
            "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, tracingspancontext)
             VALUES (?, 'order', ?, ?, '{\"total_cents\": 100}', ?)",
        )
        .bind(id)
        .bind(aggregate)
        .bind(kind)
        .bind(trace)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let mut rolled_back = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
         VALUES ('6f1c2a34-4444-4c39-8f5e-2b1d2c3d4e54', 'order', 'o-3', 'OrderCreated', '{}')",
    )
    .execute(&mut *rolled_back)
    .await
    .unwrap();
    rolled_back.rollback().await.unwrap();

    let claim = db.store.claim("a", 10, Duration::from_secs(30)).await.unwrap();
    let limits = switchyard::router::Limits::from_config(&switchyard::config::RelayConfig::default());
    let mut claimed: Vec<(String, String, Option<String>)> = claim
        .rows
        .iter()
        .map(|row| {
            let event = switchyard::router::event_from_row(row, &limits).expect("routable");
            let trace = event
                .headers
                .iter()
                .find(|(key, _)| key == "traceparent")
                .map(|(_, value)| value.clone());
            (event.event_id, row.aggregate_id.clone(), trace)
        })
        .collect();
    claimed.sort();
    assert_eq!(
        claimed,
        [
            (
                rows[0].0.to_string(),
                "o-1".to_string(),
                Some(traceparent.to_string())
            ),
            (rows[2].0.to_string(), "o-2".to_string(), None),
        ],
        "the heads of both aggregates, with the writer's ids; o-1's second waits"
    );
    assert_eq!(db.scalar("SELECT count(*) FROM switchyard_outbox").await, 3);
}
