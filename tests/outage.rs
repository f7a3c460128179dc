//! Outages are nobody's attempt: a broker or the database stopped for a
//! while, writers going on, with `max_attempts = 2` and backoffs of 50-200
//! ms (which spent every attempt within a second before outages were told
//! apart). Each test checks what a user would: nothing dead-lettered,
//! every event at the consumer once and in order per aggregate, rows that
//! waited without spending attempts, and delivery resuming within seconds
//! of the return. The ten-minute versions are `fault-run down-*` (by hand).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use switchyard_tests::brokers::Broker;
use switchyard_tests::fanout::{AUDIT_STREAM, Copies, fan_out_config, verify_kafka};
use switchyard_tests::kafka::KafkaServer;
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, tally, write_orders};
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::postgres::{Outbox, all_published, count_status, fresh_db};
use switchyard_tests::relay::{InProcess, Process, RelaySection, parse};
use switchyard_tests::service::ServicePool;
use switchyard_tests::workload::{Dice, Shape, plan};
use switchyard_tests::{eventually, exclusive, init_logging, readyz_answers, with_admin};

const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");

const AGGREGATES: usize = 20;
const ROUNDS: usize = 40;

/// How long after the broker's return the first row may be published. The
/// relay probes every 250 ms and resumes within about a second; this bound
/// is only far below what a relay that left the rows to their leases
/// ([`LEASE_MS`]) would take, so a loaded machine cannot reach it.
const RESUME_BOUND: Duration = Duration::from_secs(20);

/// The row leases of these tests: rows in flight when the broker went must
/// not wait for theirs to run out.
const LEASE_MS: &str = "60000";

/// Two transactions every 100 ms in the background, into `outbox`, shaped
/// as a service writes them: several aggregates each, one to three events
/// of each (about 140 events/s).
fn write_steadily(pool: &ServicePool, outbox: Outbox) -> tokio::task::JoinHandle<HashMap<String, Expected>> {
    let pool = pool.clone();
    tokio::spawn(async move {
        let mut expected = HashMap::new();
        let mut dice = Dice::new(11);
        let mut next_seq = HashMap::new();
        for _ in 0..ROUNDS {
            for _ in 0..2 {
                let plan = plan(&mut dice, Shape::rows(outbox), AGGREGATES, 0, 1);
                expected.extend(pool.write_committed(&plan, &mut next_seq).await.unwrap());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        expected
    })
}

/// Waits until rows record that they wait for `out` without spending attempts.
async fn rows_wait_for_the_target(pool: &ServicePool) {
    eventually(
        "rows waiting on the paused target",
        Duration::from_secs(30),
        || async { (pool.waiting_without_attempts("out").await > 0).then_some(()) },
    )
    .await;
}

/// After the writers are done and everything is published: nothing dead
/// (two attempts each: the outage spent none), and the first row published
/// after the broker was being started (`resuming`) went out within
/// [`RESUME_BOUND`] of it answering (`back`). A probe may connect while the
/// test still waits for the broker, so that row may even precede `back`.
async fn check_outcomes(
    pool: &ServicePool,
    total: usize,
    resuming: chrono::DateTime<chrono::Utc>,
    back: chrono::DateTime<chrono::Utc>,
) {
    all_published(pool, total as i64, Duration::from_secs(120)).await;
    assert_eq!(count_status(pool, "dead").await, 0, "nothing dead-lettered");
    let first = pool.first_publish_since(resuming, back).await;
    let first = Duration::from_secs_f64(first.expect("rows published after the return").max(0.0));
    eprintln!("first publish {first:?} after the broker's return");
    assert!(
        first <= RESUME_BOUND,
        "first publish {first:?} after the broker's return"
    );
}

/// The broker of `kind` stopped for a few seconds while writers go on
/// (into `outbox`): rows wait on it, the relay reports it paused, and when
/// it is back every event arrives, in order per aggregate, with no attempt
/// spent.
async fn broker_down(kind: &str, outbox: Outbox) {
    let db = fresh_db().await;
    broker_down_on(kind, &db.url, &(&db.pool).into(), outbox).await;
    if outbox == Outbox::Intake {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_intake")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(left, 0, "rows left in the intake");
    }
}

async fn broker_down_on(kind: &str, db_url: &str, pool: &ServicePool, outbox: Outbox) {
    init_logging();
    let _heavy = exclusive().await;
    let mut broker = Broker::start(kind).await;
    // The default publish timeout: Kafka's health check then outlives a
    // short bound on it, and must still see the outage.
    let relay_section = RelaySection::quick()
        .set("publish_timeout_ms", "5000")
        .set("lease_duration_ms", LEASE_MS);
    let config = broker.config(db_url, relay_section).toml();
    let relay = InProcess::start(&parse(&config)).await;
    let writer = write_steadily(pool, outbox);

    eventually(
        "some events published before the outage",
        Duration::from_secs(30),
        || async { (count_status(pool, "published").await > 0).then_some(()) },
    )
    .await;
    broker.stop();
    rows_wait_for_the_target(pool).await;
    let readiness = switchyard::admin::readiness(&relay.relay).await;
    let paused = &readiness.paused["out"];
    assert!(paused.waiting_rows.unwrap_or(0) > 0, "{paused:?}");
    assert!(
        relay
            .relay
            .metrics()
            .render()
            .contains("switchyard_target_paused{database=\"default\",target=\"out\"} 1"),
        "the paused gauge"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let resuming = pool.now().await;
    broker.resume().await;
    let back = pool.now().await;

    let expected = writer.await.unwrap();
    check_outcomes(pool, expected.len(), resuming, back).await;
    eventually("the target resumed", Duration::from_secs(10), || async {
        relay.relay.paused_targets().is_empty().then_some(())
    })
    .await;
    relay.stop().await;
    // Durable stream, topic and queue: what went before the outage is there.
    let tally = tally(&broker.received(expected.len()).await, &expected);
    assert_eq!(
        (tally.lost, tally.reordered, tally.unknown),
        (0, 0, 0),
        "{tally:?}"
    );
    if broker.deduplicates() {
        assert_eq!(tally.duplicates, 0, "{tally:?}");
    } else {
        // A publish in flight when the broker died may be stored twice.
        assert!(tally.duplicates <= 2 * AGGREGATES, "{tally:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_down_over_mariadb_costs_no_attempt_and_everything_arrives_in_order() {
    let db = TestOutbox::mariadb().await;
    broker_down_on("nats", &db.url, &db.service_pool(), Outbox::Switchyard).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_down_costs_no_attempt_and_everything_arrives_in_order() {
    broker_down("nats", Outbox::Switchyard).await;
}

/// Rows moved out of the intake while the broker is down wait as the
/// outbox's own do; the intake itself empties.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_down_with_writers_into_the_intake_costs_no_attempt() {
    broker_down("nats", Outbox::Intake).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_down_costs_no_attempt_and_keeps_what_it_had() {
    broker_down("kafka", Outbox::Switchyard).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_down_costs_no_attempt_and_everything_arrives_in_order() {
    broker_down("rabbitmq", Outbox::Switchyard).await;
}

/// Frozen, not killed: a killed emulator loses what it held, which the
/// real service does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_frozen_costs_no_attempt_and_everything_arrives_in_order() {
    broker_down("pubsub-frozen", Outbox::Switchyard).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_gone_for_a_while_costs_no_attempt() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let nats = Broker::start("nats").await;
    // A backlog, so that batches are in flight (claimed, publishing,
    // recording) when the database goes.
    let expected = write_orders(&db.pool, 200, 10, 4).await;
    let config = nats.config(&db.url, RelaySection::quick()).toml();
    let relay = InProcess::start(&parse(&config)).await;
    eventually("draining", Duration::from_secs(30), || async {
        (count_status(&db.pool, "published").await > 0).then_some(())
    })
    .await;
    // The database goes away mid-drain: no new connections, existing ones
    // cut (a restart as the relay sees it), for longer than a lease.
    let admin = switchyard_tests::postgres::server_pool().await;
    let allow = |allowed: bool| format!("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {allowed}", db.name);
    sqlx::query(&allow(false)).execute(&admin).await.unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(&db.name)
        .execute(&admin)
        .await
        .unwrap();
    let cut = Instant::now();
    let mut held = false;
    while cut.elapsed() < Duration::from_secs(4) {
        held |= relay.relay.outcomes_waiting().is_some();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sqlx::query(&allow(true)).execute(&admin).await.unwrap();
    eprintln!(
        "database back after {:?}; a batch's outcomes were held: {held}",
        cut.elapsed()
    );
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0, "nothing dead-lettered");
    let tally = tally(&nats.received(expected.len()).await, &expected);
    assert_eq!(
        (tally.lost, tally.reordered, tally.unknown),
        (0, 0, 0),
        "{tally:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_target_down_holds_back_only_its_own_deliveries() {
    fan_out_with_nats_down(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_target_down_at_start_holds_back_only_its_own_deliveries() {
    fan_out_with_nats_down(true).await;
}

/// Fan-out to two Kafka targets and NATS, NATS down while writers go on
/// (from before the relay starts, with `at_start`): Kafka is not held
/// behind NATS, and NATS gets every event once it is back.
///
/// "Not held behind" is asserted without a clock: NATS comes back only
/// after every Kafka delivery of every event written has been
/// acknowledged, and while it was down no NATS delivery was. A relay that
/// made Kafka wait for NATS never gets there (the wait below has a bound
/// only against a hang), however loaded the machine.
async fn fan_out_with_nats_down(at_start: bool) {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    // One broker stands for both Kafka clusters of the fan-out.
    let kafka = KafkaServer::start().await;
    kafka.create_topic("orders", 4).await;
    kafka.create_topic("orders-analytics", 2).await;
    let mut nats = NatsServer::start().await;
    nats.create_stream(AUDIT_STREAM, &["audit.>"]).await;
    let config = fan_out_config(
        &RelaySection::quick(),
        &db.url,
        &kafka.bootstrap(),
        &kafka.bootstrap(),
        &nats.url(),
    );
    if at_start {
        nats.stop();
    }
    let relay = InProcess::start(&parse(&config)).await;
    let writer = write_steadily(&(&db.pool).into(), Outbox::Switchyard);
    if !at_start {
        tokio::time::sleep(Duration::from_millis(500)).await;
        nats.stop();
    }
    let expected = writer.await.unwrap();
    let (rows, kafka_acked, audit_acked) = eventually(
        "every Kafka delivery acknowledged while NATS is down",
        Duration::from_secs(90),
        || async {
            let counts = deliveries_acked(&db.pool).await;
            (counts.1 == 2 * counts.0 && counts.0 == expected.len() as i64).then_some(counts)
        },
    )
    .await;
    // Kafka got there while NATS deliveries were outstanding (none at all
    // when NATS was down from the start): the check above saw Kafka's own
    // progress, not a NATS that was up.
    if at_start {
        assert_eq!(audit_acked, 0, "NATS deliveries acknowledged while it was down");
    } else {
        assert!(
            audit_acked < rows,
            "every NATS delivery acknowledged: was it down?"
        );
    }
    eprintln!("{rows} events, {kafka_acked} Kafka deliveries acknowledged with NATS down");
    nats.resume().await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0);
    let limit = Duration::from_secs(60);
    verify_kafka(
        &kafka.read_topic("orders", expected.len(), limit).await,
        &expected,
        Copies::Once,
    );
    let copies = kafka.read_topic("orders-analytics", expected.len(), limit).await;
    verify_kafka(&copies, &expected, Copies::Once);
    // NATS got everything after its return, each aggregate in order.
    let tally = tally(&nats.read_stream(AUDIT_STREAM).await, &expected);
    assert_eq!(
        (tally.lost, tally.duplicates, tally.reordered, tally.unknown),
        (0, 0, 0, 0),
        "{tally:?}"
    );
}

/// Rows, acknowledged Kafka deliveries (two targets) and acknowledged NATS
/// (`audit`) deliveries of the fan-out's outbox.
async fn deliveries_acked(pool: &sqlx::PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM switchyard_outbox),
                count(*) FILTER (WHERE d.value ->> 'target' <> 'audit'),
                count(*) FILTER (WHERE d.value ->> 'target' = 'audit')
           FROM switchyard_outbox o, jsonb_each(o.deliveries) d
          WHERE d.value ->> 'acked_at' IS NOT NULL",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A relay process started while the broker of `kind` is down: it starts
/// and stays up, says why it is not ready, and once the broker is back
/// becomes ready and publishes everything written meanwhile, in order,
/// with no attempt spent.
async fn started_with_the_broker_down(kind: &str) {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let mut broker = Broker::start(kind).await;
    broker.stop();
    let relay_section = RelaySection::quick().set("lease_duration_ms", LEASE_MS);
    let (config, admin) = with_admin(&broker.config(&db.url, relay_section).toml());
    let mut relay = Process::spawn(SWITCHYARD, &config, "started-while-down");
    switchyard_tests::readyz_unready(admin, &["\"out\""]).await;
    let expected = write_orders(&db.pool, 10, 5, 2).await;
    rows_wait_for_the_target(&(&db.pool).into()).await;
    assert!(!relay.has_exited(), "the relay stays up while its broker is down");

    let resuming = ServicePool::from(&db.pool).now().await;
    broker.resume().await;
    let returned = Instant::now();
    let back = ServicePool::from(&db.pool).now().await;
    readyz_answers(admin, 200).await;
    let ready = returned.elapsed();
    check_outcomes(&(&db.pool).into(), expected.len(), resuming, back).await;
    eprintln!(
        "{kind}: ready {ready:?} and everything published {:?} after the broker's return",
        returned.elapsed()
    );
    relay.terminate();
    broker.assert_each_once_in_order(&expected).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_nats_is_down_waits_and_publishes_on_its_return() {
    started_with_the_broker_down("nats").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_kafka_is_down_waits_and_publishes_on_its_return() {
    started_with_the_broker_down("kafka").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_rabbitmq_is_down_waits_and_publishes_on_its_return() {
    started_with_the_broker_down("rabbitmq").await;
}

/// The emulator comes back empty; the run makes the topic again, and the
/// relay (which lists it) waits for that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_pubsub_is_down_waits_and_publishes_on_its_return() {
    started_with_the_broker_down("pubsub").await;
}

/// A relay process started while its database refuses connections: up,
/// not ready with the database's error, and serving as soon as it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_the_database_is_down_waits_and_serves_on_its_return() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let broker = Broker::start("nats").await;
    let expected = write_orders(&db.pool, 10, 5, 2).await;
    let server = switchyard_tests::postgres::server_pool().await;
    let allow = |allowed: bool| format!("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {allowed}", db.name);
    sqlx::query(&allow(false)).execute(&server).await.unwrap();
    let (config, admin) = with_admin(&broker.config(&db.url, RelaySection::quick()).toml());
    let mut relay = Process::spawn(SWITCHYARD, &config, "started-without-db");
    switchyard_tests::readyz_unready(admin, &["not currently accepting connections"]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !relay.has_exited(),
        "the relay stays up while its database is down"
    );

    sqlx::query(&allow(true)).execute(&server).await.unwrap();
    let returned = Instant::now();
    readyz_answers(admin, 200).await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(60)).await;
    eprintln!("served {:?} after the database's return", returned.elapsed());
    relay.terminate();
    broker.assert_each_once_in_order(&expected).await;
}
