//! Replication mode on real services: events read from PostgreSQL's WAL
//! through a logical slot reach NATS in order with no row update; a failing
//! event takes only its own aggregate to the table and the claim path; a
//! killed reader's standby takes over and nothing is lost.

use std::collections::HashMap;
use std::time::Duration;

use switchyard_tests::config::{Plugin, TestConfig};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, order_event, verify, write_orders, write_orders_to};
use switchyard_tests::postgres::{
    DEBEZIUM_OUTBOX, Outbox, TestDb, count_status, debezium_source, fresh_db, place_event, place_order_event,
};
use switchyard_tests::relay::{InProcess, Process, Settings, example, example_config, parse};
use switchyard_tests::workload::{Shape, write_events};
use switchyard_tests::{cli, eventually, init_logging};

const STREAM: &str = "ORDERS";
const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");

/// The example pipeline in replication mode, through a slot of this
/// database's own (slot names are unique in the whole server).
fn replication(db: &TestDb, nats: &NatsServer, relay: &[(&str, &str)]) -> TestConfig {
    let settings = relay.iter().fold(
        Settings::new(&db.url, &nats.url()).relay("mode", "\"replication\""),
        |settings, (key, value)| settings.relay(key, value),
    );
    example(&settings)
        .set("replication", "slot", db.name.as_str())
        .set("replication", "publication", "switchyard_outbox")
}

/// [`replication`] as TOML.
fn replication_config(db: &TestDb, nats: &NatsServer, relay: &[(&str, &str)]) -> String {
    replication(db, nats, relay).toml()
}

/// Waits until the stream holds `count` messages, failing after `seconds`.
async fn stream_holds(nats: &NatsServer, count: u64, what: &str, seconds: u64) {
    eventually(what, Duration::from_secs(seconds), || async {
        (nats.stream_len(STREAM).await >= count).then_some(())
    })
    .await;
}

/// A fresh outbox migrated to replication mode, a nats-server with the
/// orders stream, and the config (with these `[relay]` keys).
async fn migrated(relay: &[(&str, &str)]) -> (TestDb, NatsServer, String) {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = replication_config(&db, &nats, relay);
    migrate(&config).await;
    (db, nats, config)
}

/// A fresh database holding a service's own outbox table in Debezium's
/// shape (not migrated yet), and a nats-server with the orders stream.
async fn with_a_services_table() -> (TestDb, NatsServer) {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    sqlx::query(DEBEZIUM_OUTBOX).execute(&db.pool).await.unwrap();
    (db, nats)
}

/// Runs `switchyard migrate` on `config` and fails the test if it does.
async fn migrate(config: &str) -> String {
    let path = std::env::temp_dir().join(format!("sy-migrate-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).unwrap();
    let (code, out, err) = cli(SWITCHYARD, &["migrate", "--config", path.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "migrate: {out}{err}");
    out
}

/// `config` with a plugin that traps on `Poison` events: the event's own
/// fault, retried and then dead-lettered.
fn with_poison_plugin(config: TestConfig) -> TestConfig {
    config.plugin_first(
        Plugin::new("poison", &switchyard_tests::plugins::plugin("misbehave"))
            .event_types(&["Poison"])
            .config("mode", "trap")
            .config("target", "events"),
    )
}

/// Waits for every `expected` event in the stream (a minute at most),
/// stops `relay`, and checks that each arrived once.
async fn each_streamed_once(
    nats: &NatsServer,
    relay: &mut Process,
    expected: &HashMap<String, Expected>,
    what: &str,
) {
    stream_holds(nats, expected.len() as u64, what, 60).await;
    relay.terminate();
    let verdict = verify(&nats.read_stream(STREAM).await, expected);
    assert_eq!(
        (verdict.distinct, verdict.duplicates),
        (expected.len(), 0),
        "{verdict:?}"
    );
}

/// What `switchyard migrate --dry-run` prints for `config`; fails the
/// test if it fails.
async fn dry_run(config: &str) -> String {
    let path = std::env::temp_dir().join(format!("sy-dry-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).unwrap();
    let (code, out, err) = cli(
        SWITCHYARD,
        &["migrate", "--dry-run", "--config", path.to_str().unwrap()],
        &[],
    )
    .await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "{out}{err}");
    out
}

/// Whether the slot of `db` is confirmed to at least `lsn` (`strictly`: past it).
async fn slot_confirmed(db: &TestDb, lsn: &str, strictly: bool) -> bool {
    let op = if strictly { ">" } else { ">=" };
    sqlx::query_scalar(&format!(
        "SELECT confirmed_flush_lsn {op} $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1"
    ))
    .bind(&db.name)
    .bind(lsn)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

async fn streamed_untouched(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox
          WHERE status = 'streamed' AND attempts = 0 AND lease_owner IS NULL AND deliveries = '{}'::jsonb",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_come_from_the_wal_in_order_and_their_rows_are_never_updated() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let built = replication(&db, &nats, &[]);
    let config = built.toml();

    // Before migrate, startup names what is missing.
    let refused = switchyard::runtime::build(&parse(&config))
        .await
        .err()
        .expect("refused");
    let refused = format!("{refused:#}");
    assert!(refused.contains("status defaults to 'pending'"), "{refused}");
    assert!(
        refused.contains(&format!("replication slot {:?} does not exist", db.name)),
        "{refused}"
    );
    // --dry-run shows every step and changes nothing.
    let out = dry_run(&config).await;
    for step in [
        "SET DEFAULT 'streamed'",
        "DISABLE TRIGGER switchyard_outbox_notify",
        "CREATE PUBLICATION switchyard_outbox FOR TABLE switchyard_outbox (\"aggregate_id\", \"aggregate_type\", \"created_at\", \"event_id\", \"event_type\", \"headers\", \"id\", \"not_before\", \"payload\", \"payload_bytes\", \"tenant\") WHERE (status = 'streamed'::text)",
        "pg_create_logical_replication_slot",
    ] {
        assert!(out.contains(step), "{step} missing from:\n{out}");
    }
    let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1")
        .bind(&db.name)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(slots, 0, "--dry-run created nothing");
    let migrated = migrate(&config).await;
    let notifies: bool = sqlx::query_scalar(
        "SELECT tgenabled <> 'D' FROM pg_trigger WHERE tgname = 'switchyard_outbox_notify'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(!notifies, "commits send no NOTIFY in replication mode");
    assert!(migrated.contains("replication mode"), "{migrated}");
    // Idempotent: nothing left to do the second time.
    assert!(!migrate(&config).await.contains("replication mode"));

    let relay = InProcess::start(&parse(&config)).await;
    let expected = write_orders(&db.pool, 200, 10, 4).await;
    // Everything written so far ends before this position; one more event after.
    let written: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let last = place_order_event(&db.pool, &order_event(999, 0), true).await;
    stream_holds(&nats, 2001, "every event in the stream", 120).await;
    // The slot is confirmed past what was published (other databases of
    // the server write WAL too: compare with our own position only).
    eventually(
        "the slot confirmed past the last event",
        Duration::from_secs(30),
        || async { slot_confirmed(&db, &written, true).await.then_some(()) },
    )
    .await;
    // `status` shows the slot and who reads it.
    let path = std::env::temp_dir().join(format!("sy-status-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, built.set("admin", "listen", "").toml()).unwrap();
    let (code, out, err) = cli(SWITCHYARD, &["status", "--config", path.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("Replication slot {}", db.name)), "{out}");
    assert!(out.contains("read by         switchyard "), "{out}");
    relay.stop().await;

    let received: Vec<_> = nats
        .read_stream(STREAM)
        .await
        .into_iter()
        .filter(|m| m.header("Switchyard-Event-Id") != Some(last.to_string().as_str()))
        .collect();
    let verdict = verify(&received, &expected);
    assert_eq!(verdict.duplicates, 0);
    assert_eq!(
        streamed_untouched(&db).await,
        2001,
        "no row was written by the relay"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_event_takes_only_its_own_aggregate_to_the_table() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = with_poison_plugin(replication(
        &db,
        &nats,
        &[
            ("max_attempts", "3"),
            ("initial_backoff_ms", "200"),
            ("max_backoff_ms", "400"),
        ],
    ))
    .toml();
    migrate(&config).await;
    let relay = InProcess::start(&parse(&config)).await;

    // order-0: events 0..3, the poison, then 3 more; order-1..19: 8 each.
    let mut expected = std::collections::HashMap::new();
    for seq in 0..8 {
        for aggregate in 0..20 {
            let mut event = order_event(aggregate, seq);
            if aggregate == 0 && seq == 4 {
                event.event_type = "Poison".into();
                place_order_event(&db.pool, &event, true).await;
                continue;
            }
            let id = place_order_event(&db.pool, &event, true).await;
            expected.insert(
                id.to_string(),
                Expected {
                    aggregate_id: event.aggregate_id.clone(),
                    seq: seq as u64,
                    event_type: event.event_type.clone(),
                },
            );
        }
    }
    eventually(
        "every good event in the stream",
        Duration::from_secs(120),
        || async { (nats.stream_len(STREAM).await >= 159).then_some(()) },
    )
    .await;
    eventually("the poison dead-lettered", Duration::from_secs(30), || async {
        (count_status(&db.pool, "dead").await == 1).then_some(())
    })
    .await;
    relay.stop().await;

    let received = nats.read_stream(STREAM).await;
    let mut seqs: std::collections::HashMap<String, Vec<u64>> = std::collections::HashMap::new();
    for message in &received {
        let want = &expected[message.header("Switchyard-Event-Id").unwrap()];
        seqs.entry(want.aggregate_id.clone()).or_default().push(want.seq);
    }
    assert_eq!(
        seqs["order-0"],
        vec![0, 1, 2, 3, 5, 6, 7],
        "order-0 in order, the poison missing"
    );
    for aggregate in 1..20 {
        assert_eq!(seqs[&format!("order-{aggregate}")], (0..8).collect::<Vec<_>>());
    }
    let reason: String = sqlx::query_scalar("SELECT last_error FROM switchyard_outbox WHERE status = 'dead'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(reason.contains("poison"), "the dead letter says why: {reason}");
    // Only the poison's aggregate went through the table, from the poison on.
    let through_table: Vec<(String, String)> = sqlx::query_as(
        "SELECT aggregate_id, event_type FROM switchyard_outbox WHERE status <> 'streamed' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    // The poison first; then those of the three after it the reader met
    // while the aggregate still had a row waiting (all three when writers
    // outpace the poison's retries; fewer on a busy machine, where they
    // arrive once it is dead and the table is empty again).
    assert!(
        through_table.iter().all(|(aggregate, _)| aggregate == "order-0"),
        "{through_table:?}"
    );
    assert_eq!(
        through_table.first().map(|(_, kind)| kind.as_str()),
        Some("Poison"),
        "the poison went to the table first: {through_table:?}"
    );
    assert!(
        through_table.len() <= 4,
        "the poison and at most the three after it: {through_table:?}"
    );
    assert_eq!(streamed_untouched(&db).await, 160 - through_table.len() as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_reader_is_replaced_by_its_standby_and_nothing_is_lost() {
    let (db, nats, config) = migrated(&[]).await;
    killed_reader_replaced(&db, &nats, &config, Outbox::Switchyard).await;
}

/// The same with writers into a plain table of their own read as
/// `[source]`, the cheapest way to write an event at service rates: its
/// events have no row of the relay's unless they need the claim path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_reader_of_a_services_own_table_is_replaced_and_nothing_is_lost() {
    let (db, nats) = with_a_services_table().await;
    let config = replication(&db, &nats, &[]).source(debezium_source()).toml();
    migrate(&config).await;
    killed_reader_replaced(&db, &nats, &config, Outbox::Debezium).await;
}

/// Two relays on one slot while 3,000 events are written into `outbox`;
/// the one reading it is SIGKILLed mid-stream, and the standby must take
/// the slot over and finish with every event in the stream once.
async fn killed_reader_replaced(db: &TestDb, nats: &NatsServer, config: &str, outbox: Outbox) {
    let mut first = Process::spawn(SWITCHYARD, config, "first");
    let active = |pid_of: &'static str| {
        let (pool, slot) = (db.pool.clone(), db.name.clone());
        async move {
            let reader: Option<String> = sqlx::query_scalar(
                "SELECT a.application_name FROM pg_replication_slots s
                   JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1",
            )
            .bind(&slot)
            .fetch_optional(&pool)
            .await
            .unwrap();
            reader.filter(|name| name.ends_with(pid_of)).map(|_| ())
        }
    };
    eventually("the first relay reads the slot", Duration::from_secs(60), || {
        active("first")
    })
    .await;
    let mut second = Process::spawn(SWITCHYARD, config, "second");

    let writer = {
        let pool = db.pool.clone();
        let shape = Shape::rows(outbox).emitting(if outbox == Outbox::Switchyard { 30 } else { 0 });
        tokio::spawn(async move { write_events(&pool, shape, 100, 3000, 2, 22).await })
    };
    stream_holds(nats, 300, "some events through", 60).await;
    first.kill();
    eventually("the standby reads the slot", Duration::from_secs(30), || {
        active("second")
    })
    .await;
    let expected = writer.await.unwrap();
    stream_holds(nats, expected.len() as u64, "every event in the stream", 120).await;
    second.terminate();

    // JetStream absorbs what the killed reader published but had not confirmed.
    let verdict = verify(&nats.read_stream(STREAM).await, &expected);
    assert_eq!(verdict.duplicates, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_in_replication_mode_dead_letters_nothing_and_keeps_order() {
    // Two attempts: any outage charged to the events would dead-letter them.
    let (db, mut nats, config) = migrated(&[("max_attempts", "2"), ("publish_timeout_ms", "1000")]).await;
    // A third of the aggregates written by `switchyard_emit`.
    let shape = Shape::rows(Outbox::Switchyard).emitting(30);
    broker_outage_in_replication_mode(&db.pool, &mut nats, &config, shape, Duration::from_secs(5)).await;
}

/// A service that deletes each event in the transaction that writes it
/// (the table keeps nothing, the WAL has the insert), a third of its
/// aggregates through `switchyard_emit`, through a broker outage: what
/// must wait is written back from the WAL's copy, and every event arrives
/// once and in order, none dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_deleted_as_they_are_written_come_through_a_broker_outage() {
    let (db, mut nats, config) = migrated(&[("max_attempts", "2"), ("publish_timeout_ms", "1000")]).await;
    let shape = Shape::rows(Outbox::Switchyard).emitting(30).deleting();
    broker_outage_in_replication_mode(&db.pool, &mut nats, &config, shape, Duration::from_secs(5)).await;
}

/// A relay in replication mode (PostgreSQL's slot or MariaDB's binary
/// log) on `pool`'s database while NATS is stopped for `outage` under a
/// writer shaped as a service's (several aggregates per transaction, one
/// to three events of each): every event arrives once and in order,
/// nothing is dead-lettered, the outage handed events over to the table,
/// and nothing is left unfinished there.
pub(crate) async fn broker_outage_in_replication_mode(
    pool: impl Into<switchyard_tests::service::ServicePool>,
    nats: &mut NatsServer,
    config: &str,
    shape: Shape,
    outage: Duration,
) {
    let pool = pool.into();
    let relay = InProcess::start(&parse(config)).await;
    let writer = {
        let pool = pool.clone();
        tokio::spawn(async move { write_events(&pool, shape, 50, 2000, 2, 21).await })
    };
    stream_holds(nats, 200, "some events through", 60).await;
    nats.stop();
    tokio::time::sleep(outage).await;
    nats.resume().await;
    let expected = writer.await.unwrap();
    stream_holds(nats, expected.len() as u64, "every event in the stream", 120).await;
    relay.stop().await;

    let verdict = verify(&nats.read_stream(STREAM).await, &expected);
    assert_eq!(
        (verdict.distinct, verdict.duplicates),
        (expected.len(), 0),
        "{verdict:?}"
    );
    assert_eq!(
        pool.count_status("dead").await,
        0,
        "an outage is not the events' fault"
    );
    assert!(
        pool.count_status("published").await > 0,
        "the outage handed events over to the table"
    );
    let unfinished = pool
        .scalar("SELECT count(*) FROM switchyard_outbox WHERE status NOT IN ('streamed', 'published')")
        .await;
    assert_eq!(unfinished, 0);
}

/// A slot dropped under a running relay: the relay stays up and is not
/// ready, `/readyz` naming the missing slot and what to do; once `migrate`
/// makes the slot again, it serves what is written from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_dropped_under_the_relay_makes_it_unready_with_what_to_do() {
    let (db, nats, config) = migrated(&[]).await;
    let (with_admin, admin) = switchyard_tests::with_admin(&config);
    let mut relay = Process::spawn(SWITCHYARD, &with_admin, "slot-dropped");
    switchyard_tests::readyz_answers(admin, 200).await;
    let active = || async {
        let pid: Option<Option<i32>> =
            sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
                .bind(&db.name)
                .fetch_optional(&db.pool)
                .await
                .unwrap();
        pid.flatten()
    };
    eventually("the relay reads the slot", Duration::from_secs(60), active).await;
    // End the reader's session and drop the slot before it comes back.
    eventually("the slot dropped", Duration::from_secs(30), || async {
        sqlx::query("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&db.name)
            .execute(&db.pool)
            .await
            .unwrap();
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(&db.name)
            .execute(&db.pool)
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    // The feed ends, and the relay is built again: both say what to do.
    let missing = format!("replication slot \\\"{}\\\" does not exist", db.name);
    switchyard_tests::readyz_unready(admin, &[&missing, "switchyard migrate"]).await;
    assert!(!relay.has_exited(), "the relay stays up, not ready");

    migrate(&config).await;
    switchyard_tests::readyz_answers(admin, 200).await;
    let expected = write_orders(&db.pool, 10, 3, 2).await;
    each_streamed_once(&nats, &mut relay, &expected, "served once migrated").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_written_without_a_row_keep_their_order_among_rows_and_fail_alone() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = with_poison_plugin(replication(
        &db,
        &nats,
        &[
            ("max_attempts", "2"),
            ("initial_backoff_ms", "200"),
            ("max_backoff_ms", "400"),
        ],
    ))
    .toml();
    migrate(&config).await;
    // The function refuses what the table would.
    let refused = sqlx::query("SELECT switchyard_emit(NULL, 'o-1', 'OrderCreated', '{}')")
        .execute(&db.pool)
        .await
        .expect_err("a NULL aggregate type is refused");
    assert!(
        refused.to_string().contains("aggregate_type must not be NULL"),
        "{refused}"
    );
    let relay = InProcess::start(&parse(&config)).await;

    // Each aggregate's events alternate between a row and a message; a
    // poisoned message in order-0 and a message that is not an event.
    let mut expected = std::collections::HashMap::new();
    let mut rows = 0;
    for seq in 0..8 {
        for aggregate in 0..20 {
            let mut event = order_event(aggregate, seq);
            let outbox = if (seq + aggregate) % 2 == 0 && !(aggregate == 0 && seq == 4) {
                rows += 1;
                Outbox::Switchyard
            } else {
                Outbox::Emitted
            };
            if aggregate == 0 && seq == 4 {
                event.event_type = "Poison".into();
            }
            let id = place_event(&db.pool, outbox, &event, true).await;
            if event.event_type != "Poison" {
                expected.insert(
                    id.to_string(),
                    Expected {
                        aggregate_id: event.aggregate_id.clone(),
                        seq: seq as u64,
                        event_type: event.event_type.clone(),
                    },
                );
            }
        }
        if seq == 2 {
            sqlx::query("SELECT pg_logical_emit_message(true, 'switchyard.event', 'not an event')")
                .execute(&db.pool)
                .await
                .unwrap();
        }
    }
    stream_holds(&nats, 159, "every good event in the stream", 120).await;
    eventually(
        "the poison and the stray message dead-lettered",
        Duration::from_secs(30),
        || async { (count_status(&db.pool, "dead").await == 2).then_some(()) },
    )
    .await;
    relay.stop().await;

    let received = nats.read_stream(STREAM).await;
    assert_eq!(received.len(), 159);
    let mut seqs: std::collections::HashMap<String, Vec<u64>> = std::collections::HashMap::new();
    for message in &received {
        let want = &expected[message.header("Switchyard-Event-Id").unwrap()];
        seqs.entry(want.aggregate_id.clone()).or_default().push(want.seq);
    }
    assert_eq!(
        seqs["order-0"],
        vec![0, 1, 2, 3, 5, 6, 7],
        "order-0 in order, the poison missing"
    );
    let order_0: std::collections::HashMap<String, u64> = expected
        .iter()
        .filter(|(_, want)| want.aggregate_id == "order-0")
        .map(|(id, want)| (id.clone(), want.seq))
        .collect();
    expected.retain(|_, want| want.aggregate_id != "order-0");
    let others: Vec<_> = received
        .into_iter()
        .filter(|m| expected.contains_key(m.header("Switchyard-Event-Id").unwrap()))
        .collect();
    assert_eq!(verify(&others, &expected).duplicates, 0);
    let reasons: Vec<(String, String)> = sqlx::query_as(
        "SELECT event_type, last_error FROM switchyard_outbox WHERE status = 'dead' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let reason = |event_type: &str| {
        reasons
            .iter()
            .find(|(t, _)| t == event_type)
            .map(|(_, why)| why.clone())
            .unwrap_or_else(|| panic!("no dead letter of type {event_type}: {reasons:?}"))
    };
    assert!(reason("Poison").contains("poison"), "{reasons:?}");
    assert!(
        reason("unreadable").contains("not an event written by switchyard_emit"),
        "{reasons:?}"
    );
    // Messages leave no row unless handed over: the poison, the stray
    // message, and those of order-0's later events that the reader met
    // while the poison was still on its way to the table (none if it was
    // dead-lettered first: a dead letter does not hold its aggregate).
    let handed: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT event_id::text, aggregate_id, event_type FROM switchyard_outbox
          WHERE status <> 'streamed' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        handed
            .iter()
            .filter(|(_, _, t)| t == "Poison" || t == "unreadable")
            .count(),
        2,
        "{handed:?}"
    );
    for (id, aggregate_id, event_type) in &handed {
        if event_type != "Poison" && event_type != "unreadable" {
            assert!(
                aggregate_id == "order-0" && order_0.get(id).is_some_and(|seq| *seq > 4),
                "only order-0's events after the poison are handed over: {handed:?}"
            );
        }
    }
    let in_table: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // Of order-0's last three, those written as rows stay `streamed` rows
    // handed over in place, the rest are new rows.
    assert!(in_table <= rows + 5, "{in_table} rows for {rows} inserts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_services_own_outbox_table_is_read_from_the_wal_with_its_trigger_turned_off() {
    let (db, nats) = with_a_services_table().await;
    let built = with_poison_plugin(replication(
        &db,
        &nats,
        &[
            ("max_attempts", "2"),
            ("initial_backoff_ms", "1000"),
            ("max_backoff_ms", "1000"),
        ],
    ))
    .source(debezium_source());
    let config = built.toml();
    // The table was relayed in claim mode before: its capture trigger is on.
    migrate(&in_claim_mode(built)).await;
    let out = dry_run(&config).await;
    for step in [
        "WHERE (status = 'streamed'::text), \"public\".\"outbox\" (\"aggregateid\", \"aggregatetype\", \"id\", \"payload\", \"tracingspancontext\", \"type\") WITH (publish = 'insert')",
        "ALTER TABLE \"public\".\"outbox\" DISABLE TRIGGER switchyard_capture",
    ] {
        assert!(out.contains(step), "{step} missing from:\n{out}");
    }
    assert!(!out.contains("CREATE TRIGGER"), "{out}");
    migrate(&config).await;
    let relay = InProcess::start(&parse(&config)).await;

    let writer = {
        let pool = db.pool.clone();
        tokio::spawn(async move { write_orders_to(&pool, Outbox::Debezium, 50, 20, 4).await })
    };
    // An aggregate of its own: a poison, then two events that follow it.
    let mut poisoned = std::collections::HashMap::new();
    for seq in 0..3 {
        let mut event = order_event(999, seq);
        if seq == 0 {
            event.event_type = "Poison".into();
        }
        let id = place_event(&db.pool, Outbox::Debezium, &event, true).await;
        poisoned.insert(id.to_string(), seq as u64);
    }
    let expected = writer.await.unwrap();
    stream_holds(&nats, 1002, "every good event in the stream", 120).await;
    eventually("the poison dead-lettered", Duration::from_secs(30), || async {
        (count_status(&db.pool, "dead").await == 1).then_some(())
    })
    .await;
    relay.stop().await;

    let received = nats.read_stream(STREAM).await;
    let followers: Vec<u64> = received
        .iter()
        .filter_map(|m| poisoned.get(m.header("Switchyard-Event-Id").unwrap()).copied())
        .collect();
    assert_eq!(followers, vec![1, 2], "the poison's aggregate went on in order");
    let others: Vec<_> = received
        .into_iter()
        .filter(|m| !poisoned.contains_key(m.header("Switchyard-Event-Id").unwrap()))
        .collect();
    assert_eq!(verify(&others, &expected).duplicates, 0);
    // Nothing was copied: only the poison's aggregate went through the
    // relay's table, the poison dead-lettered with its reason. Its
    // followers follow it there while it waits out its backoff; one the
    // slot hands over after the poison was dead goes straight out (a
    // loaded machine can be that slow), which is as right.
    let copied: Vec<(String, String, Option<String>)> =
        sqlx::query_as("SELECT aggregate_id, status, last_error FROM switchyard_outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert!((1..=3).contains(&copied.len()), "{copied:?}");
    assert!(
        copied.iter().all(|(aggregate, _, _)| aggregate == "order-999"),
        "{copied:?}"
    );
    assert!(
        copied[0].2.as_deref().is_some_and(|why| why.contains("poison")),
        "{copied:?}"
    );
}

/// Replication mode reads the outbox's inserts and claims nothing, so
/// nothing would move a row written to `switchyard_intake`. Rows already
/// there keep replication mode from starting, with what to do; `migrate`
/// closes the intake (a writer's insert fails, naming why) and going back
/// to claim mode opens it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_mode_closes_the_intake_and_will_not_start_over_rows_in_it() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let built = replication(&db, &nats, &[]);
    let config = built.toml();
    let write = || place_event_result(&db.pool, Outbox::Intake);
    write().await.expect("claim mode: the intake is open");
    migrate(&config).await;
    let refused = write().await.expect_err("replication mode: the intake is closed");
    assert!(
        refused
            .to_string()
            .contains("switchyard_intake_is_closed_in_replication_mode"),
        "{refused}"
    );
    let refused = switchyard::runtime::build(&parse(&config))
        .await
        .err()
        .expect("refused");
    let refused = format!("{refused:#}");
    assert!(
        refused.contains("switchyard_intake holds 1 rows written for claim mode"),
        "{refused}"
    );
    migrate(&in_claim_mode(built)).await;
    write().await.expect("claim mode again: the intake is open");
}

/// `config` from [`replication`], in claim mode.
fn in_claim_mode(config: TestConfig) -> String {
    config.relay("mode", "claim").unset("replication").toml()
}

async fn place_event_result(pool: &sqlx::PgPool, outbox: Outbox) -> Result<uuid::Uuid, sqlx::Error> {
    switchyard_tests::postgres::try_place_event(pool, outbox, &order_event(1, 0), true).await
}

/// A replication-mode relay started while its database refuses
/// connections: up, not ready with the reason, and reading the slot as
/// soon as the database is back, every event in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_the_database_is_down_reads_the_slot_on_its_return() {
    let (db, nats, config) = migrated(&[]).await;
    let expected = write_orders(&db.pool, 10, 5, 2).await;
    let server = switchyard_tests::postgres::server_pool().await;
    let allow = |allowed: bool| format!("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {allowed}", db.name);
    sqlx::query(&allow(false)).execute(&server).await.unwrap();
    let (config, admin) = switchyard_tests::with_admin(&config);
    let mut relay = Process::spawn(SWITCHYARD, &config, "started-without-db");
    switchyard_tests::readyz_unready(admin, &["not currently accepting connections"]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !relay.has_exited(),
        "the relay stays up while its database is down"
    );

    sqlx::query(&allow(true)).execute(&server).await.unwrap();
    switchyard_tests::readyz_answers(admin, 200).await;
    each_streamed_once(&nats, &mut relay, &expected, "every event streamed").await;
}

/// `config` as a file, for the command line.
fn config_file(config: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("sy-mode-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).unwrap();
    path
}

/// A relay process on `config` whose database is set up for the other
/// mode: `validate` names the mismatch and fails; the relay starts, stays
/// up and is not ready, naming it; once `migrate` on `config` switches the
/// database, it serves what is written from then on, and `/readyz` is ready.
async fn mismatch_named_then_served(db: &TestDb, nats: &NatsServer, config: &str, says: &str) {
    let file = config_file(config);
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", file.to_str().unwrap()], &[]).await;
    assert_ne!(
        code, 0,
        "validate passes a database set up for the other mode: {out}"
    );
    assert!(err.contains(says), "validate names the mismatch: {err}");

    let (with_admin, admin) = switchyard_tests::with_admin(config);
    let mut relay = Process::spawn(SWITCHYARD, &with_admin, "mismatched");
    // The mismatch named, and what to do.
    switchyard_tests::readyz_unready(admin, &[says, "switchyard migrate"]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!relay.has_exited(), "the relay stays up, not ready");

    migrate(config).await;
    let expected = write_orders(&db.pool, 10, 3, 2).await;
    switchyard_tests::readyz_answers(admin, 200).await;
    each_streamed_once(nats, &mut relay, &expected, "served once migrated").await;
    let _ = std::fs::remove_file(file);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_mode_relay_on_a_replication_mode_database_names_the_mismatch() {
    let (db, nats, _replication) = migrated(&[]).await;
    let claim = example_config(&Settings::new(&db.url, &nats.url()));
    // Without a config, migrate keeps the mode and says which it is.
    let (code, out, err) = cli(SWITCHYARD, &["migrate", "--database-url", &db.url], &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("replication mode kept"), "{out}");
    mismatch_named_then_served(&db, &nats, &claim, "set up for replication mode").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_mode_relay_on_a_claim_mode_database_names_the_mismatch() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    migrate(&example_config(&Settings::new(&db.url, &nats.url()))).await;
    let replication = replication_config(&db, &nats, &[]);
    mismatch_named_then_served(&db, &nats, &replication, "set up for claim mode").await;
}

/// A database the relay's tables are not in yet, set up by one `migrate`
/// with a replication-mode config, as a newcomer does: `validate` says ok
/// and the relay streams. The mode's statements were worked out before the
/// schema existed, and the intake, made by the same run, stayed open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_migrate_sets_up_an_empty_database_for_replication_mode() {
    init_logging();
    let db = switchyard_tests::postgres::fresh_db_before(0).await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = replication_config(&db, &nats, &[]);
    migrate(&config).await;
    let path = config_file(&config);
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", path.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "validate after one migrate: {out}{err}");
    let relay = InProcess::start(&parse(&config)).await;
    let expected = write_orders(&db.pool, 5, 3, 1).await;
    stream_holds(&nats, expected.len() as u64, "every event in the stream", 60).await;
    relay.stop().await;
}

/// A transaction the WAL hands out before it is visible to other sessions
/// (its commit record flushed, the committing backend not yet out of the
/// process array: a synchronous standby's wait holds it there for as long
/// as the test likes), met while the broker is down. Its events are handed
/// over to the table, and every one of them arrives once the broker is
/// back. The transaction writes as a service does: several aggregates, one
/// to three events each, one of them already waiting in the table, one
/// through `switchyard_emit`. A hand-over by plain `UPDATE` did not see
/// such rows: they stayed `streamed` and the slot moved past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_read_before_it_is_visible_is_handed_over_whole() {
    use switchyard_tests::postgres::{CommitHold, HeldCommit, a_session_waits_on_a_transaction};
    use switchyard_tests::workload::write_plan;

    let (db, mut nats, config) = migrated(&[("publish_timeout_ms", "1000")]).await;
    let relay = InProcess::start(&parse(&config)).await;
    let mut seqs = HashMap::new();
    let mut expected = HashMap::new();
    let commit = async |plan: Vec<(usize, usize, Outbox)>, seqs: &mut HashMap<usize, usize>| {
        let mut tx = db.pool.begin().await.unwrap();
        let written = write_plan(&mut tx, &plan, seqs).await.unwrap();
        tx.commit().await.unwrap();
        written
    };
    expected.extend(
        commit(
            vec![(0, 2, Outbox::Switchyard), (1, 1, Outbox::Switchyard)],
            &mut seqs,
        )
        .await,
    );
    stream_holds(&nats, 3, "the first transaction", 60).await;

    nats.stop();
    expected.extend(
        commit(
            vec![(0, 1, Outbox::Switchyard), (2, 2, Outbox::Switchyard)],
            &mut seqs,
        )
        .await,
    );
    eventually(
        "the outage's first events handed over",
        Duration::from_secs(30),
        || async { (count_status(&db.pool, "streamed").await == 3).then_some(()) },
    )
    .await;

    // Aggregate 0 waits in the table and goes on through `switchyard_emit`;
    // 3 and 4 are new rows; 5 is new and has no row.
    let hold = CommitHold::on().await;
    let plan = vec![
        (0, 2, Outbox::Emitted),
        (3, 3, Outbox::Switchyard),
        (4, 1, Outbox::Switchyard),
        (5, 2, Outbox::Emitted),
    ];
    let (sent_plan, mut held_seqs) = (plan.clone(), seqs.clone());
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut held = HeldCommit::start(&db.url, move |conn| {
        Box::pin(async move {
            let written = write_plan(conn, &sent_plan, &mut held_seqs).await?;
            let _ = tx.send((written, held_seqs));
            Ok(())
        })
    })
    .await;
    assert!(
        held.wait_held(Duration::from_secs(30)).await,
        "the transaction's COMMIT waits for the standby"
    );
    // The relay read it from the WAL and its hand-over waits for the
    // writer's transaction: a row the hand-over cannot see yet.
    a_session_waits_on_a_transaction(&db.name, Duration::from_secs(30)).await;
    held.release()
        .await
        .expect("committed locally when the wait is cancelled");
    drop(hold);
    let (written, _) = rx.await.unwrap();
    expected.extend(written);

    nats.resume().await;
    let total = expected.len() as u64;
    let arrived = tokio::time::timeout(Duration::from_secs(60), async {
        while nats.stream_len(STREAM).await < total {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    if arrived.is_err() {
        let left: Vec<(i64, String, String)> = sqlx::query_as(
            "SELECT id, aggregate_id, status FROM switchyard_outbox WHERE status NOT IN ('published') ORDER BY id",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        panic!(
            "{} of {total} events arrived; rows not published: {left:?}",
            nats.stream_len(STREAM).await
        );
    }
    relay.stop().await;
    let verdict = verify(&nats.read_stream(STREAM).await, &expected);
    assert_eq!((verdict.distinct, verdict.duplicates), (expected.len(), 0));
}

/// An event the table does not take when it is handed over (here a
/// trigger of the operator's skips the update) is never passed by the
/// slot: the relay holds the slot before it, names it in an error, counts
/// it in `switchyard_replication_held_events_total` and reads it again
/// until the table takes it; then it arrives, in order, and the slot
/// moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_table_does_not_take_holds_the_slot_until_it_does() {
    use switchyard_tests::workload::write_plan;

    let (db, mut nats, config) = migrated(&[("publish_timeout_ms", "1000")]).await;
    sqlx::query(
        "CREATE FUNCTION skip_order_7() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF OLD.status = 'streamed' AND NEW.aggregate_id = 'order-7' THEN RETURN NULL; END IF;
             RETURN NEW;
         END $$",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "CREATE TRIGGER skip_order_7 BEFORE UPDATE ON switchyard_outbox
         FOR EACH ROW EXECUTE FUNCTION skip_order_7()",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let relay = InProcess::start(&parse(&config)).await;
    nats.stop();
    let mut seqs = HashMap::new();
    let mut tx = db.pool.begin().await.unwrap();
    let plan = vec![(7, 2, Outbox::Switchyard), (8, 1, Outbox::Switchyard)];
    let expected: HashMap<String, Expected> = write_plan(&mut tx, &plan, &mut seqs)
        .await
        .unwrap()
        .into_iter()
        .collect();
    tx.commit().await.unwrap();
    // Where the WAL is inserted, not written: with synchronous_commit off
    // (the test server's) the written position can lag the commit, and the
    // slot rightly held at the transaction's first record would look past it.
    let written_to: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();

    eventually(
        "the slot held before order-7",
        Duration::from_secs(60),
        || async {
            let metrics = relay.relay.metrics().render();
            metrics
                .lines()
                .any(|line| {
                    line.starts_with("switchyard_replication_held_events_total") && !line.ends_with(" 0")
                })
                .then_some(())
        },
    )
    .await;
    assert!(
        !slot_confirmed(&db, &written_to, false).await,
        "the slot stays before the events the table did not take"
    );
    let untaken: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox WHERE aggregate_id = 'order-7' AND status = 'streamed'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(untaken, 2);

    sqlx::query("DROP TRIGGER skip_order_7 ON switchyard_outbox")
        .execute(&db.pool)
        .await
        .unwrap();
    nats.resume().await;
    stream_holds(&nats, 3, "every event once the table takes them", 60).await;
    eventually(
        "the slot past the transaction",
        Duration::from_secs(30),
        || async { slot_confirmed(&db, &written_to, false).await.then_some(()) },
    )
    .await;
    relay.stop().await;
    let verdict = verify(&nats.read_stream(STREAM).await, &expected);
    assert_eq!((verdict.distinct, verdict.duplicates), (3, 0));
}

/// A hand-over has reached disk when it returns. The relay confirms the
/// slot past the events it took as soon as it does, and its sessions
/// commit with `synchronous_commit` off: a server crash before the WAL
/// writer's next flush would lose a hand-over that did not wait, and the
/// slot would not give its events again. The WAL is read back
/// (`pg_walinspect`) for the hand-over's commit, which the flush position
/// read the moment it returned must have passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_has_reached_disk_when_the_slot_may_pass_it() {
    use switchyard::store::replication::{StreamSettings, WalStream};
    use switchyard::store::{OutboxStore, Outcome, RowOutcome};
    use switchyard_tests::workload::write_plan;

    let (db, _nats, _config) = migrated(&[]).await;
    sqlx::query("CREATE EXTENSION pg_walinspect")
        .execute(&db.pool)
        .await
        .unwrap();
    let store = OutboxStore::connect(db.url.as_str(), 2).await.unwrap();
    let outbox = store.postgres().expect("a PostgreSQL outbox");
    let mut stream = WalStream::open(&StreamSettings {
        endpoint: db.url.as_str().into(),
        slot: db.name.clone(),
        publication: "switchyard_outbox".into(),
        application_name: "hand-over test".into(),
        batch_size: 100,
        max_retained_wal_bytes: u64::MAX,
        source: None,
    })
    .await
    .unwrap();
    // A service's transaction: two events of one aggregate, one without a
    // row, one of another aggregate.
    let plan = vec![
        (0, 2, Outbox::Switchyard),
        (1, 1, Outbox::Emitted),
        (2, 1, Outbox::Switchyard),
    ];
    let mut tx = db.pool.begin().await.unwrap();
    let written = write_plan(&mut tx, &plan, &mut HashMap::new()).await.unwrap();
    tx.commit().await.unwrap();
    let mut rows = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while rows.len() < written.len() {
            rows.extend(stream.next_batch().await.unwrap().rows);
        }
    })
    .await
    .expect("the transaction read from the slot");

    let start: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let outcomes: Vec<RowOutcome> = rows
        .iter()
        .map(|r| RowOutcome {
            id: r.row.id,
            outcome: Outcome::Retry {
                after: Duration::from_secs(60),
                error: "the broker is down".into(),
            },
            deliveries: Default::default(),
            plugin_version: None,
        })
        .collect();
    let taken = outbox
        .hand_over(
            "hand-over test",
            30_000,
            &rows.iter().collect::<Vec<_>>(),
            &outcomes,
        )
        .await
        .unwrap();
    let flushed: String = sqlx::query_scalar("SELECT pg_current_wal_flush_lsn()::text")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(taken, vec![true; rows.len()], "every event taken over");
    stream.close().await;

    // Everything written so far flushed, so that the WAL can be read.
    switchyard_tests::postgres::flush_wal(&db.pool).await;
    // The first transaction to change the outbox after `start` is the
    // hand-over's (its ack comes after it).
    let commit: Option<String> = sqlx::query_scalar(
        "WITH w AS MATERIALIZED (SELECT * FROM pg_get_wal_records_info_till_end_of_wal($1::pg_lsn)),
              outbox AS (SELECT format('rel %s/%s/%s ', t.spcoid, d.oid, pg_relation_filenode('switchyard_outbox'))
                                AS rel
                           FROM pg_database d,
                                (SELECT COALESCE(NULLIF(reltablespace, 0),
                                                 (SELECT dattablespace FROM pg_database
                                                   WHERE datname = current_database())) AS spcoid
                                   FROM pg_class WHERE oid = 'switchyard_outbox'::regclass) t
                          WHERE d.datname = current_database()),
              hand_over AS (SELECT w.xid FROM w, outbox
                             WHERE w.resource_manager = 'Heap' AND w.xid <> '0'
                               AND position(outbox.rel IN w.block_ref) > 0
                             ORDER BY w.start_lsn LIMIT 1)
         SELECT w.end_lsn::text FROM w, hand_over
          WHERE w.xid = hand_over.xid AND w.resource_manager = 'Transaction' AND w.record_type LIKE 'COMMIT%'",
    )
    .bind(&start)
    .fetch_optional(&db.pool)
    .await
    .unwrap();
    let commit = commit.expect("the hand-over's commit in the WAL");
    let durable: bool = sqlx::query_scalar("SELECT $1::pg_lsn >= $2::pg_lsn")
        .bind(&flushed)
        .bind(&commit)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        durable,
        "the hand-over's commit ends at {commit}, but the WAL was flushed only to {flushed} when it returned"
    );
    store.close().await;
}
