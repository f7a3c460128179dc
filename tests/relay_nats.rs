//! End to end on real services: application transactions write the outbox,
//! the relay runs the example plugins and publishes to a real nats-server
//! with JetStream, and a consumer checks what arrived.

use std::time::Duration;

use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, order_event, verify, write_orders, write_orders_to};
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::postgres::{
    Outbox, all_published, count_status, fresh_db, move_first_intake_row, place_event, place_order_event,
};
use switchyard_tests::relay::{
    InProcess, Process, Settings, example_config, kill_while_holding_leases, parse,
};
use switchyard_tests::service::ServicePool;
use switchyard_tests::stall::StallingProxy;
use switchyard_tests::workload::{Shape, write_events};
use switchyard_tests::{eventually, init_logging};

const STREAM: &str = "ORDERS";
const RELAY_BIN: &str = env!("CARGO_BIN_EXE_relay-process");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_written_while_the_relay_runs_arrive_once_in_order_and_transformed() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let relay = InProcess::start(&parse(&example_config(&Settings::new(&db.url, &nats.url())))).await;

    // The relay runs while the services write: this exercises NOTIFY wake-ups
    // and claims racing commits, not just draining a backlog. 5,000 events
    // over 250 aggregates show it; volume is fault-run's (`kills`, `outage`,
    // the `down-*` runs: 20,000 to 150,000 events, release build).
    let expected = write_orders(&db.pool, 250, 20, 8).await;
    assert_eq!(expected.len(), 5_000);
    all_published(&db.pool, 5_000, Duration::from_secs(240)).await;
    relay.stop().await;

    let received = nats.read_stream(STREAM).await;
    let verdict = verify(&received, &expected);
    assert_eq!(verdict.duplicates, 0, "a healthy run publishes every event once");
    let leftovers: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox WHERE status <> 'published' OR lease_owner IS NOT NULL OR published_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(leftovers, 0);
    let versions: i64 = sqlx::query_scalar("SELECT count(DISTINCT plugin_version) FROM switchyard_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(versions, 2, "each row records the plugin version that routed it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_publishes_nothing() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let relay = InProcess::start(&parse(&example_config(&Settings::new(&db.url, &nats.url())))).await;

    let rolled_back = place_order_event(&db.pool, &order_event(1, 0), false).await;
    let committed = place_order_event(&db.pool, &order_event(2, 0), true).await;
    all_published(&db.pool, 1, Duration::from_secs(30)).await;
    relay.stop().await;

    let received = nats.read_stream(STREAM).await;
    let ids: Vec<_> = received
        .iter()
        .filter_map(|m| m.header("Switchyard-Event-Id"))
        .collect();
    assert_eq!(ids, vec![committed.to_string()]);
    assert!(!ids.contains(&rolled_back.to_string().as_str()));
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(orders, 1, "the business write rolled back with its event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_outage_of_ten_seconds_loses_nothing() {
    init_logging();
    let db = fresh_db().await;
    let mut nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let settings = Settings::new(&db.url, &nats.url()).relay("max_attempts", "100");
    let relay = InProcess::start(&parse(&example_config(&settings))).await;

    let first = write_orders(&db.pool, 100, 10, 4).await;
    all_published(&db.pool, 1000, Duration::from_secs(60)).await;

    nats.stop();
    let writer = {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            let mut expected = std::collections::HashMap::new();
            for seq in 10..20 {
                for aggregate in 0..100 {
                    let event = order_event(aggregate, seq);
                    let id = place_order_event(&pool, &event, true).await;
                    expected.insert(
                        id.to_string(),
                        switchyard_tests::orders::Expected {
                            aggregate_id: event.aggregate_id,
                            seq: seq as u64,
                            event_type: event.event_type,
                        },
                    );
                }
            }
            expected
        })
    };
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during: i64 = count_status(&db.pool, "published").await;
    assert_eq!(
        during, 1000,
        "nothing is marked published while the broker is down"
    );
    let retried: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox WHERE last_error IS NOT NULL AND status = 'pending'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        retried > 0,
        "failed publishes are recorded and scheduled for retry"
    );
    nats.resume().await;

    let mut expected = first;
    expected.extend(writer.await.unwrap());
    all_published(&db.pool, 2000, Duration::from_secs(90)).await;
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0);
    let received = nats.read_stream(STREAM).await;
    verify(&received, &expected);
}

/// A fresh database and a nats-server with the orders stream.
async fn with_stream() -> (switchyard_tests::postgres::TestDb, NatsServer) {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    (db, nats)
}

/// A stream and the config of relays on `db_url` with short leases, so a
/// killed instance's rows come back quickly.
async fn for_two_relays_and_a_kill(db_url: &str) -> (NatsServer, String) {
    init_logging();
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let settings = Settings::new(db_url, &nats.url())
        .relay("lease_duration_ms", "3000")
        .relay("publish_timeout_ms", "1000");
    let config = example_config(&settings);
    (nats, config)
}

/// Relay A, then relay B beside it once A runs; A SIGKILLed while it holds
/// leases; B left to publish `total` rows, then stopped. Returns how many
/// leases A held when it died.
async fn two_relays_one_killed(config: &str, pool: &ServicePool, total: i64) -> i64 {
    let mut b = None;
    let orphaned = kill_while_holding_leases(RELAY_BIN, config, pool, || {
        if b.is_none() {
            b = Some(Process::spawn(RELAY_BIN, config, "relay-b"));
        }
    })
    .await;
    all_published(pool, total, Duration::from_secs(180)).await;
    if let Some(mut b) = b {
        b.terminate();
    }
    orphaned
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relay_processes_share_a_table_and_survive_a_kill() {
    let db = fresh_db().await;
    two_relay_processes_share_a_table_and_survive_a_kill_on(&db.url, (&db.pool).into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relay_processes_share_a_mariadb_table_and_survive_a_kill() {
    let db = TestOutbox::mariadb().await;
    two_relay_processes_share_a_table_and_survive_a_kill_on(&db.url, db.service_pool()).await;
}

async fn two_relay_processes_share_a_table_and_survive_a_kill_on(db_url: &str, pool: ServicePool) {
    let (nats, config) = for_two_relays_and_a_kill(db_url).await;
    // A service's transactions: several aggregates, one to three events each.
    let shape = Shape::rows(Outbox::Switchyard);
    let expected = write_events(&pool, shape, 200, 10_000, 8, 31).await;

    // A starts first so that it meets a full backlog: started after B, it
    // could find B had drained most of it and never be caught holding leases.
    let orphaned = two_relays_one_killed(&config, &pool, expected.len() as i64).await;

    let taken_over = pool
        .scalar("SELECT count(*) FROM switchyard_outbox WHERE attempts > 1")
        .await;
    assert!(
        taken_over >= orphaned,
        "the killed relay's rows were re-claimed after their leases expired"
    );
    let received = nats.read_stream(STREAM).await;
    let verdict = verify(&received, &expected);
    // JetStream drops duplicates by Nats-Msg-Id within its window, so even the
    // killed instance's in-flight batch shows up at most once here.
    assert!(
        verdict.duplicates <= 200,
        "duplicates bounded by one batch: {}",
        verdict.duplicates
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_are_dead_lettered_with_a_reason_while_others_flow() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    // Captures the three order event types only; anything else finds no stream.
    nats.create_stream(
        STREAM,
        &["orders.OrderCreated", "orders.OrderPaid", "orders.OrderShipped"],
    )
    .await;
    let settings = Settings::new(&db.url, &nats.url()).relay("max_attempts", "2");
    let relay = InProcess::start(&parse(&example_config(&settings))).await;

    let insert = |aggregate_type: &'static str,
                  aggregate_id: &'static str,
                  event_type: &'static str,
                  payload: Option<&'static str>,
                  bytes: Option<&'static [u8]>,
                  headers: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers)
                 VALUES ($1, $2, $3, $4::jsonb, $5, $6::jsonb)",
            )
            .bind(aggregate_type)
            .bind(aggregate_id)
            .bind(event_type)
            .bind(payload)
            .bind(bytes)
            .bind(headers)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    insert("order", "null-payload", "OrderCreated", None, None, "{}").await;
    insert("order", "binary-paid", "OrderPaid", None, Some(b"\x00\x01"), "{}").await;
    insert("invoice", "unmatched", "InvoiceSent", Some("{}"), None, "{}").await;
    insert(
        "order",
        "bad-headers",
        "OrderCreated",
        Some("{}"),
        None,
        r#"{"retries": 3}"#,
    )
    .await;
    insert("order", "bad-subject", "Order Weird", Some("{}"), None, "{}").await;
    // Text columns may hold line breaks, which NATS headers cannot carry:
    // the aggregate type goes out as a relay header (async-nats panics on it).
    insert("ord\r\ner", "line-break", "OrderPaid", Some("{}"), None, "{}").await;
    // No stream captures this subject: not the event's fault. It waits,
    // spending no attempt, until an operator creates one.
    insert("order", "no-stream", "OrderRefunded", Some("{}"), None, "{}").await;
    let good = write_orders(&db.pool, 20, 3, 2).await;

    all_published(&db.pool, 60, Duration::from_secs(60)).await;
    eventually("bad rows dead-lettered", Duration::from_secs(60), || async {
        (count_status(&db.pool, "dead").await == 6).then_some(())
    })
    .await;
    let waiting = || async {
        sqlx::query_as::<_, (String, i32, String)>(
            "SELECT status, attempts, coalesce(last_error, '') FROM switchyard_outbox WHERE aggregate_id = 'no-stream'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    // Between its tries (in flight, a try counts until its outcome refunds it).
    let between_tries = || async {
        eventually("the no-stream row tried", Duration::from_secs(30), || async {
            let row = waiting().await;
            (!row.2.is_empty() && row.0 != "in_flight").then_some(row)
        })
        .await
    };
    let (status, attempts, last_error) = between_tries().await;
    assert_eq!((status.as_str(), attempts), ("pending", 0), "{last_error}");
    assert!(last_error.contains("no JetStream stream"), "{last_error}");
    // Several claims later it is still pending, with no attempt spent.
    claims_reach(&relay, relay.relay.metrics().claims() + 10).await;
    let (status, attempts, _) = between_tries().await;
    assert_eq!((status.as_str(), attempts), ("pending", 0));
    nats.create_stream("REFUNDS", &["orders.OrderRefunded"]).await;
    eventually(
        "the waiting row published once its stream exists",
        Duration::from_secs(30),
        || async { (waiting().await.0 == "published").then_some(()) },
    )
    .await;
    relay.stop().await;

    let errors: std::collections::HashMap<String, String> =
        sqlx::query_as("SELECT aggregate_id, last_error FROM switchyard_outbox WHERE status = 'dead'")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let error = |id: &str| {
        errors
            .get(id)
            .unwrap_or_else(|| panic!("{id} not dead: {errors:?}"))
            .as_str()
    };
    assert!(
        error("null-payload").contains("payload is NULL"),
        "{}",
        error("null-payload")
    );
    assert!(
        error("binary-paid").contains("redact@") && error("binary-paid").contains("needs a JSON payload")
    );
    assert!(error("unmatched").contains("no plugin matches aggregate type \"invoice\""));
    assert!(error("bad-headers").contains("header \"retries\" must be a string"));
    assert!(
        error("bad-subject").contains("invalid NATS subject \"orders.Order Weird\""),
        "{}",
        error("bad-subject")
    );
    assert!(
        error("line-break").contains("header \"Switchyard-Aggregate-Type\" has a line break"),
        "{}",
        error("line-break")
    );
    verify(&nats.read_stream(STREAM).await, &good);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_nats_mode_publishes_with_headers() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut subscription = client.subscribe("orders.>").await.unwrap();
    client.flush().await.unwrap();
    let mut settings = Settings::new(&db.url, &nats.url());
    settings.nats_mode = "core";
    let relay = InProcess::start(&parse(&example_config(&settings))).await;

    let id = place_order_event(&db.pool, &order_event(7, 0), true).await;
    let message = tokio::time::timeout(
        Duration::from_secs(10),
        futures::StreamExt::next(&mut subscription),
    )
    .await
    .expect("message within 10 s")
    .expect("subscription open");
    assert_eq!(message.subject.as_str(), "orders.OrderCreated");
    let headers = message.headers.expect("headers");
    assert_eq!(
        headers.get("Switchyard-Event-Id").map(|v| v.to_string()),
        Some(id.to_string())
    );
    assert_eq!(
        headers.get("Switchyard-Key").map(|v| v.to_string()),
        Some("order-7".to_string())
    );
    all_published(&db.pool, 1, Duration::from_secs(10)).await;
    relay.stop().await;
}

/// A database, a stream and a relay that polls once a minute: anything
/// faster than that came through NOTIFY.
async fn polling_once_a_minute() -> (switchyard_tests::postgres::TestDb, NatsServer, InProcess) {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let settings = Settings::new(&db.url, &nats.url()).relay("poll_interval_ms", "60000");
    let relay = InProcess::start(&parse(&example_config(&settings))).await;
    listening(&relay, 1).await;
    (db, nats, relay)
}

/// Waits until the relay's `sessions`-th LISTEN session hears commits.
async fn listening(relay: &InProcess, sessions: u64) {
    let metrics = relay.relay.metrics();
    eventually("the relay listens", Duration::from_secs(30), || async {
        (metrics.listening() && metrics.listen_sessions() >= sessions).then_some(())
    })
    .await;
}

/// Waits until the relay has run `total` claims.
async fn claims_reach(relay: &InProcess, total: u64) {
    let metrics = relay.relay.metrics();
    eventually("the relay claims", Duration::from_secs(30), || async {
        (metrics.claims() >= total).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_the_relay_and_survives_a_dropped_listen_connection() {
    let (db, _nats, relay) = polling_once_a_minute().await;

    place_order_event(&db.pool, &order_event(1, 0), true).await;
    all_published(&db.pool, 1, Duration::from_secs(10)).await;

    // Kill the LISTEN connection server-side; the relay must reconnect and listen again.
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND query ILIKE 'LISTEN%' AND pid <> pg_backend_pid()) t",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "one LISTEN connection");
    listening(&relay, 2).await;
    place_order_event(&db.pool, &order_event(2, 0), true).await;
    all_published(&db.pool, 2, Duration::from_secs(10)).await;
    relay.stop().await;
}

/// A database reached through a proxy whose connections can be stalled,
/// and a stream for the relay's events.
async fn behind_a_stalling_proxy() -> (switchyard_tests::postgres::TestDb, NatsServer, StallingProxy) {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let proxy = StallingProxy::in_front_of(&db.url).await;
    (db, nats, proxy)
}

/// A LISTEN session behind a link that stops answering hears nothing, and
/// nothing tells it so: a black hole sends no reset, and a session that only
/// listens sends nothing the kernel could time out. Polling once a minute,
/// an event committed after the stall arrives within seconds only if the
/// relay found the session dead and listens on a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listen_session_that_stops_answering_is_replaced() {
    let (db, nats, proxy) = behind_a_stalling_proxy().await;
    let settings = Settings::new(&proxy.url(&db.url), &nats.url()).relay("poll_interval_ms", "60000");
    let relay = InProcess::start(&parse(&example_config(&settings))).await;
    listening(&relay, 1).await;
    place_order_event(&db.pool, &order_event(1, 0), true).await;
    all_published(&db.pool, 1, Duration::from_secs(10)).await;

    proxy.stall_open_connections();
    place_order_event(&db.pool, &order_event(2, 0), true).await;
    // The poll would find it after 60 s.
    all_published(&db.pool, 2, Duration::from_secs(30)).await;
    tokio::time::timeout(Duration::from_secs(30), relay.stop())
        .await
        .expect("the relay stops though sessions hang");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_covers_lost_notifications() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    sqlx::query("ALTER TABLE switchyard_outbox DISABLE TRIGGER switchyard_outbox_notify")
        .execute(&db.pool)
        .await
        .unwrap();
    let settings = Settings::new(&db.url, &nats.url()).relay("poll_interval_ms", "200");
    let relay = InProcess::start(&parse(&example_config(&settings))).await;
    let expected = write_orders(&db.pool, 10, 3, 2).await;
    all_published(&db.pool, 30, Duration::from_secs(30)).await;
    relay.stop().await;
    verify(&nats.read_stream(STREAM).await, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freed_event_is_announced_not_polled_for() {
    // A worker does not claim again after a partial batch: an event that
    // waited behind its predecessor (parked by a claim) goes out this fast
    // only if the ack that frees it says so.
    let (db, nats, relay) = polling_once_a_minute().await;
    // Two hot aggregates, each event committed right after the one before.
    let expected = write_orders(&db.pool, 2, 40, 2).await;
    all_published(&db.pool, 80, Duration::from_secs(30)).await;
    relay.stop().await;
    verify(&nats.read_stream(STREAM).await, &expected);
}

/// A link to the database that drops every packet without a reset (a
/// firewall, a dead NAT entry, a frozen server) leaves each open session
/// waiting for an answer that never comes, and the kernel's own timeout is
/// many minutes away. The relay bounds each claim and ack, closes the
/// session that did not answer, and goes on with a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_that_stop_answering_are_replaced() {
    let (db, nats, proxy) = behind_a_stalling_proxy().await;
    // Leases of 6 s: statements are cancelled by the server after 3 s.
    let settings = Settings::new(&proxy.url(&db.url), &nats.url());
    let relay = InProcess::start(&parse(&example_config(&settings))).await;
    for aggregate in 0..5 {
        place_order_event(&db.pool, &order_event(aggregate, 0), true).await;
    }
    all_published(&db.pool, 5, Duration::from_secs(30)).await;

    proxy.stall_open_connections();
    let stalled = std::time::Instant::now();
    for aggregate in 0..10 {
        place_order_event(
            &db.pool,
            &order_event(aggregate, usize::from(aggregate < 5)),
            true,
        )
        .await;
    }
    all_published(&db.pool, 15, Duration::from_secs(60)).await;
    let recovered = stalled.elapsed();
    assert!(
        recovered < Duration::from_secs(30),
        "published again {recovered:?} after the stall"
    );
    tokio::time::timeout(Duration::from_secs(30), relay.stop())
        .await
        .expect("the relay stops though sessions hang");
    let received = nats.read_stream(STREAM).await;
    let ids: std::collections::HashSet<_> = received
        .iter()
        .filter_map(|m| m.header("Switchyard-Event-Id"))
        .collect();
    assert_eq!(ids.len(), 15, "every event arrived");
}

/// Writers insert into `switchyard_intake` while two relay processes claim
/// (each claim moving rows into the outbox) and one is killed holding
/// leases: every event arrives, each aggregate in order, and the intake
/// ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_written_to_the_intake_arrive_in_order_across_two_relays_and_a_kill() {
    let db = fresh_db().await;
    let (nats, config) = for_two_relays_and_a_kill(&db.url).await;
    let mut expected = write_orders_to(&db.pool, Outbox::Intake, 200, 30, 8).await;
    // Written while the relays run, one task per aggregate: moves race
    // the writers' commits.
    let writers: Vec<_> = (0..7)
        .map(|aggregate| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                let mut written = Vec::new();
                for seq in 30..330 {
                    let event = order_event(aggregate, seq);
                    let id = place_event(&pool, Outbox::Intake, &event, true).await;
                    let want = Expected {
                        aggregate_id: event.aggregate_id,
                        seq: seq as u64,
                        event_type: event.event_type,
                    };
                    written.push((id.to_string(), want));
                }
                written
            })
        })
        .collect();
    assert!(two_relays_one_killed(&config, &(&db.pool).into(), 8_100).await > 0);
    for writer in writers {
        expected.extend(writer.await.unwrap());
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_intake")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "every intake row moved");
    let received = nats.read_stream(STREAM).await;
    let verdict = verify(&received, &expected);
    assert_eq!(verdict.distinct, 8_100);
}

/// A transaction holding the movers' lock, as a claim moving intake rows
/// holds it, until it ends.
async fn holding_the_movers_lock(pool: &sqlx::PgPool) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut mover = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(switchyard::store::INTAKE_LOCK)
        .execute(&mut *mover)
        .await
        .unwrap();
    mover
}

/// A row on its way from the intake in a transaction not yet committed
/// keeps the next row of its aggregate in the intake: a claim that cannot
/// take the movers' lock moves nothing, so it cannot lease that next row
/// as the head of its aggregate (its statement would not see the first
/// row in the outbox) and publish it first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_in_progress_keeps_later_rows_of_its_aggregate_waiting() {
    let (db, nats) = with_stream().await;
    let mut expected = std::collections::HashMap::new();
    for seq in 0..2 {
        let event = order_event(900, seq);
        let id = place_event(&db.pool, Outbox::Intake, &event, true).await;
        let want = Expected {
            aggregate_id: event.aggregate_id,
            seq: seq as u64,
            event_type: event.event_type,
        };
        expected.insert(id.to_string(), want);
    }
    // Another mover, part way: the first row taken out of the intake and
    // into the outbox, uncommitted.
    let mut mover = holding_the_movers_lock(&db.pool).await;
    move_first_intake_row(&mut mover).await;
    let settings = Settings::new(&db.url, &nats.url()).relay("poll_interval_ms", "100");
    let relay = InProcess::start(&parse(&example_config(&settings))).await;
    // Twenty claims find nothing to take meanwhile.
    claims_reach(&relay, relay.relay.metrics().claims() + 20).await;
    assert_eq!(count_status(&db.pool, "published").await, 0);
    mover.commit().await.unwrap();
    all_published(&db.pool, 2, Duration::from_secs(30)).await;
    relay.stop().await;
    let received = nats.read_stream(STREAM).await;
    assert_eq!(verify(&received, &expected).distinct, 2);
}

/// Counts the notifications on the relays' channel within `window`.
async fn notifications_within(listener: &mut sqlx::postgres::PgListener, window: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + window;
    let mut heard = 0;
    while let Ok(received) = tokio::time::timeout_at(deadline, listener.recv()).await {
        received.unwrap();
        heard += 1;
    }
    heard
}

/// A claim inserts into the outbox whenever it moves rows, and PostgreSQL
/// runs the outbox's statement trigger even for an insert of none: a claim
/// that woke every relay would keep them all claiming. Claiming ten times
/// a second, the relay makes no notification of its own; a writer's
/// insert into the intake makes one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_that_move_rows_wake_nobody() {
    let (db, nats) = with_stream().await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool).await.unwrap();
    listener.listen("switchyard_outbox").await.unwrap();
    let settings = Settings::new(&db.url, &nats.url()).relay("poll_interval_ms", "100");
    let relay = InProcess::start(&parse(&example_config(&settings))).await;
    assert_eq!(
        notifications_within(&mut listener, Duration::from_secs(2)).await,
        0
    );
    place_event(&db.pool, Outbox::Intake, &order_event(1, 0), true).await;
    all_published(&db.pool, 1, Duration::from_secs(10)).await;
    assert_eq!(
        notifications_within(&mut listener, Duration::from_secs(2)).await,
        1,
        "the writer's insert wakes the relays; moving and publishing it wakes nobody"
    );
    relay.stop().await;
}

/// An intake row whose `event_id` is already in the outbox cannot enter it
/// under that id (the claim would fail on the unique index, every time):
/// it is dead-lettered under a fresh id with the writer's in its reason,
/// and the rows around it flow. A key over the outbox's bound is refused
/// at the writer's own insert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intake_row_with_a_taken_event_id_is_dead_lettered_and_others_flow() {
    let (db, nats) = with_stream().await;
    let taken = place_event(&db.pool, Outbox::Switchyard, &order_event(1, 0), true).await;
    let insert = "INSERT INTO switchyard_intake (event_id, aggregate_type, aggregate_id, event_type, payload)
                  VALUES (COALESCE($1, gen_random_uuid()), 'order', $2, 'OrderCreated', '{}')";
    for (event_id, aggregate) in [(None, "order-2"), (Some(taken), "order-3"), (None, "order-4")] {
        sqlx::query(insert)
            .bind(event_id)
            .bind(aggregate)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let too_long = sqlx::query(insert)
        .bind(None::<uuid::Uuid>)
        .bind("x".repeat(1025))
        .execute(&db.pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        too_long.contains("switchyard_intake_aggregate_id_at_most_1024_bytes"),
        "{too_long}"
    );
    let relay = InProcess::start(&parse(&example_config(&Settings::new(&db.url, &nats.url())))).await;
    all_published(&db.pool, 3, Duration::from_secs(30)).await;
    let (aggregate, reason): (String, String) = eventually_dead(&db.pool).await;
    relay.stop().await;
    assert_eq!(aggregate, "order-3");
    assert!(
        reason.contains(&format!("event_id {taken} is already in the outbox")),
        "{reason}"
    );
}

async fn eventually_dead(pool: &sqlx::PgPool) -> (String, String) {
    switchyard_tests::eventually("a dead-lettered row", Duration::from_secs(10), || async {
        sqlx::query_as("SELECT aggregate_id, last_error FROM switchyard_outbox WHERE status = 'dead'")
            .fetch_optional(pool)
            .await
            .unwrap()
    })
    .await
}

/// A claim that finds another holding the movers' lock moves nothing. The
/// holder's statement may have begun before a row's commit whose wake-up
/// was this claim, and then nothing else would announce the row. Polling
/// once a minute, the row still arrives within seconds of the lock's
/// release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_committed_while_another_claim_moves_is_not_left_for_the_poll() {
    let (db, _nats, relay) = polling_once_a_minute().await;
    let mover = holding_the_movers_lock(&db.pool).await;
    let before = relay.relay.metrics().claims();
    place_event(&db.pool, Outbox::Intake, &order_event(1, 0), true).await;
    // The claim its commit woke moved nothing.
    claims_reach(&relay, before + 1).await;
    assert_eq!(count_status(&db.pool, "published").await, 0);
    mover.rollback().await.unwrap();
    all_published(&db.pool, 1, Duration::from_secs(10)).await;
    relay.stop().await;
}

/// A row written to the intake with `not_before` ahead moves into the
/// outbox with the next claim but is not leased on the way: it goes out
/// when its time comes, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_intake_row_waits_for_its_time() {
    let (db, nats) = with_stream().await;
    let settings = Settings::new(&db.url, &nats.url()).relay("poll_interval_ms", "100");
    let relay = InProcess::start(&parse(&example_config(&settings))).await;
    let due_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "INSERT INTO switchyard_intake (aggregate_type, aggregate_id, event_type, payload, not_before)
         VALUES ('order', 'order-1', 'OrderCreated', '{\"order_id\": \"order-1\", \"seq\": 0}',
                 now() + interval '3 seconds')
         RETURNING not_before",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    switchyard_tests::eventually("the row moved", Duration::from_secs(10), || async {
        (count_status(&db.pool, "pending").await == 1).then_some(())
    })
    .await;
    all_published(&db.pool, 1, Duration::from_secs(15)).await;
    relay.stop().await;
    let published_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT published_at FROM switchyard_outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(published_at >= due_at, "published {published_at}, due {due_at}");
}

/// The movers' lock held far longer than a move takes (a session holding
/// it by hand, a mover stuck): each intake commit wakes a worker whose
/// claim finds the lock taken. Those workers wait for it a moment, not
/// until their statements time out, so an event written to the outbox
/// still goes out within seconds while the lock is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_movers_lock_held_for_long_does_not_hold_up_the_outbox() {
    let (db, nats) = with_stream().await;
    // Statements bounded at 15 s (half the lease): a claim that waited for
    // the lock until then would keep its worker that long.
    let settings = Settings::new(&db.url, &nats.url())
        .relay("poll_interval_ms", "60000")
        .relay("lease_duration_ms", "30000");
    let relay = InProcess::start(&parse(&example_config(&settings))).await;
    let mover = holding_the_movers_lock(&db.pool).await;
    for aggregate in 0..8 {
        place_event(&db.pool, Outbox::Intake, &order_event(aggregate, 0), true).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    place_event(&db.pool, Outbox::Switchyard, &order_event(100, 0), true).await;
    all_published(&db.pool, 1, Duration::from_secs(5)).await;
    mover.rollback().await.unwrap();
    all_published(&db.pool, 9, Duration::from_secs(10)).await;
    relay.stop().await;
}
