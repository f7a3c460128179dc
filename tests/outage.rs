//! Outages are nobody's attempt: a broker or the database stopped for a
//! while, writers going on, with `max_attempts = 2` and backoffs of 50-200
//! ms (which spent every attempt within a second before outages were told
//! apart). Each test checks what a user would: nothing dead-lettered,
//! every event at the consumer once and in order per aggregate, rows that
//! waited without spending attempts, and delivery resuming within seconds
//! of the return. The ten-minute versions are `fault-run outage-*` (by hand).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use switchyard_tests::kafka::KafkaServer;
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, order_event, tally, write_orders};
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{TestDb, all_published, count_status, fresh_db, place_order_event};
use switchyard_tests::rabbitmq::RabbitMq;
use switchyard_tests::relay::{InProcess, RelaySection, parse};
use switchyard_tests::{eventually, exclusive, init_logging};

const AGGREGATES: usize = 20;
const ROUNDS: usize = 40;

/// How long after the broker's return the first row may be published. The
/// relay probes every 250 ms; the rest is a reconnect and slack for a
/// loaded two-core machine.
const RESUME_BOUND: Duration = Duration::from_secs(5);

/// One event per aggregate every 100 ms (200 events/s) in the background.
fn write_steadily(db: &TestDb) -> tokio::task::JoinHandle<HashMap<String, Expected>> {
    let pool = db.pool.clone();
    tokio::spawn(async move {
        let mut expected = HashMap::new();
        for seq in 0..ROUNDS {
            for aggregate in 0..AGGREGATES {
                let event = order_event(aggregate, seq);
                let id = place_order_event(&pool, &event, true).await;
                let want = Expected {
                    aggregate_id: event.aggregate_id,
                    seq: seq as u64,
                    event_type: event.event_type,
                };
                expected.insert(id.to_string(), want);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        expected
    })
}

/// A relay config: the fan-out plugin sending every event to `target`
/// (`topic`, keyed by aggregate), quick retries.
fn config(db: &TestDb, topic: &str, target: &str) -> String {
    format!(
        r#"
[database]
url = "{db}"
max_connections = 8
{relay}
[[plugins]]
name = "fanout"
path = "{plugin}"
[plugins.config]
default = [{{ target = "out", topic = "{topic}", key = "{{aggregate_id}}" }}]

[targets.out]
{target}
"#,
        db = db.url,
        relay = RelaySection::quick().toml(),
        plugin = plugin("fan_out").display(),
    )
}

/// The database's clock now.
async fn db_now(db: &TestDb) -> chrono::DateTime<chrono::Utc> {
    sqlx::query_scalar("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Waits until rows record that they wait for `out` without spending attempts.
async fn rows_wait_for_the_target(db: &TestDb) {
    eventually(
        "rows waiting on the paused target",
        Duration::from_secs(30),
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM switchyard_outbox
              WHERE waiting_on = ARRAY['out'] AND status = 'pending' AND attempts = 0",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            (waiting > 0).then_some(())
        },
    )
    .await;
}

/// After the writers are done and everything is published: nothing dead,
/// no row that spent more than its one attempt, and the first row
/// published after `back` within [`RESUME_BOUND`] of it.
async fn check_outcomes(db: &TestDb, total: usize, back: chrono::DateTime<chrono::Utc>) {
    all_published(&db.pool, total as i64, Duration::from_secs(120)).await;
    assert_eq!(count_status(&db.pool, "dead").await, 0, "nothing dead-lettered");
    let most: i32 = sqlx::query_scalar("SELECT max(attempts) FROM switchyard_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(most, 1, "the outage spent no attempt");
    let first: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM min(published_at) - $1)::float8 FROM switchyard_outbox WHERE published_at > $1",
    )
    .bind(back)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let first = Duration::from_secs_f64(first.expect("rows published after the return"));
    assert!(
        first <= RESUME_BOUND,
        "first publish {first:?} after the broker's return"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_down_costs_no_attempt_and_everything_arrives_in_order() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let mut nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let target = format!(
        "type = \"nats\"\nurl = \"{}\"\nduplicate_window_seconds = 3600",
        nats.url()
    );
    let relay = InProcess::start(&parse(&config(&db, "orders.{event_type}", &target))).await;
    let writer = write_steadily(&db);

    tokio::time::sleep(Duration::from_millis(1500)).await;
    nats.stop();
    rows_wait_for_the_target(&db).await;
    let paused = relay.relay.paused_targets();
    assert!(paused.contains_key("out"), "{paused:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    nats.resume().await;
    let back = db_now(&db).await;

    let expected = writer.await.unwrap();
    check_outcomes(&db, expected.len(), back).await;
    eventually("the target resumed", Duration::from_secs(10), || async {
        relay.relay.paused_targets().is_empty().then_some(())
    })
    .await;
    relay.stop().await;
    let received = nats.read_stream("ORDERS").await;
    let tally = tally(&received, &expected);
    assert_eq!(
        (tally.lost, tally.duplicates, tally.reordered, tally.unknown),
        (0, 0, 0, 0),
        "{tally:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_down_costs_no_attempt_and_keeps_what_it_had() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let dir = std::env::temp_dir().join(format!("sy-kafka-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut kafka = KafkaServer::start_durable(&dir).await;
    kafka.create_topic("orders", 4).await;
    let target = format!(
        "type = \"kafka\"\nbootstrap_servers = \"{}\"\n[targets.out.properties]\n\"linger.ms\" = \"2\"",
        kafka.bootstrap()
    );
    let relay = InProcess::start(&parse(&config(&db, "orders", &target))).await;
    let writer = write_steadily(&db);

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = count_status(&db.pool, "published").await;
    assert!(before > 0, "some events went before the outage");
    kafka.stop();
    rows_wait_for_the_target(&db).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    kafka.resume().await;
    let back = db_now(&db).await;

    let expected = writer.await.unwrap();
    check_outcomes(&db, expected.len(), back).await;
    relay.stop().await;
    // The events published before the outage are still in the topic.
    let received = kafka
        .read_topic("orders", expected.len(), Duration::from_secs(60))
        .await;
    let extra = switchyard_tests::fanout::verify_kafka(
        &received,
        &expected,
        switchyard_tests::fanout::Copies::AtLeastOnce,
    );
    // A produce in flight when the broker died may be stored twice: the
    // idempotent producer's session did not survive the restart.
    assert!(extra <= AGGREGATES * 2, "{extra} extra copies");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_down_costs_no_attempt_and_everything_arrives_in_order() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let mut rabbit = RabbitMq::own().await;
    rabbit.declare("orders", "orders-consumer", "orders.#").await;
    let target = format!(
        "type = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"orders\"",
        rabbit.url()
    );
    let relay = InProcess::start(&parse(&config(&db, "orders.{event_type}", &target))).await;
    let writer = write_steadily(&db);

    tokio::time::sleep(Duration::from_millis(1500)).await;
    rabbit.stop();
    rows_wait_for_the_target(&db).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    rabbit.start().await;
    let back = db_now(&db).await;

    let expected = writer.await.unwrap();
    check_outcomes(&db, expected.len(), back).await;
    relay.stop().await;
    let received = rabbit
        .drain("orders-consumer", expected.len(), Duration::from_secs(60))
        .await;
    let tally = tally(&received, &expected);
    // Durable queue, persistent messages: what was queued before the kill is there.
    assert_eq!(
        (tally.lost, tally.reordered, tally.unknown),
        (0, 0, 0),
        "{tally:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_gone_for_a_while_costs_no_attempt() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let target = format!(
        "type = \"nats\"\nurl = \"{}\"\nduplicate_window_seconds = 3600",
        nats.url()
    );
    // A backlog, so that batches are in flight (claimed, publishing,
    // recording) when the database goes.
    let expected = write_orders(&db.pool, 200, 10, 4).await;
    let relay = InProcess::start(&parse(&config(&db, "orders.{event_type}", &target))).await;
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
    let tally = tally(&nats.read_stream("ORDERS").await, &expected);
    assert_eq!(
        (tally.lost, tally.reordered, tally.unknown),
        (0, 0, 0),
        "{tally:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_target_down_holds_back_only_its_own_deliveries() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let kafka = KafkaServer::start().await;
    kafka.create_topic("orders", 4).await;
    let mut nats = NatsServer::start().await;
    nats.create_stream("AUDIT", &["audit.>"]).await;
    let config = format!(
        r#"
[database]
url = "{db}"
max_connections = 8
{relay}
[[plugins]]
name = "fanout"
path = "{plugin}"
[plugins.config]
default = [
  {{ target = "kafka", topic = "orders", key = "{{aggregate_id}}" }},
  {{ target = "audit", topic = "audit.orders.{{event_type}}" }},
]

[targets.kafka]
type = "kafka"
bootstrap_servers = "{kafka}"
[targets.kafka.properties]
"linger.ms" = "2"

[targets.audit]
type = "nats"
url = "{nats}"
duplicate_window_seconds = 3600
"#,
        db = db.url,
        relay = RelaySection::quick().toml(),
        plugin = plugin("fan_out").display(),
        kafka = kafka.bootstrap(),
        nats = nats.url(),
    );
    let relay = InProcess::start(&parse(&config)).await;
    let writer = write_steadily(&db);
    tokio::time::sleep(Duration::from_millis(500)).await;
    nats.stop();
    // Longer than the bound below: a Kafka delivery held behind NATS shows.
    tokio::time::sleep(Duration::from_secs(8)).await;
    nats.resume().await;
    let expected = writer.await.unwrap();
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0);

    // Kafka took every event on time, NATS down or not.
    let (kafka_worst, audit_worst): (f64, f64) = sqlx::query_as(
        "SELECT max(CASE WHEN d.value ->> 'target' = 'kafka' THEN lag END),
                max(CASE WHEN d.value ->> 'target' = 'audit' THEN lag END)
           FROM switchyard_outbox o, jsonb_each(o.deliveries) d,
                LATERAL (SELECT extract(epoch FROM (d.value ->> 'acked_at')::timestamptz - o.created_at)::float8 AS lag) l",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(kafka_worst < 4.0, "Kafka waited {kafka_worst:.1} s for an event");
    assert!(audit_worst > 4.0, "NATS was down: {audit_worst:.1} s");
    let on_kafka = kafka
        .read_topic("orders", expected.len(), Duration::from_secs(60))
        .await;
    switchyard_tests::fanout::verify_kafka(&on_kafka, &expected, switchyard_tests::fanout::Copies::Once);
    // NATS got everything after its return, each aggregate in order.
    let tally = tally(&nats.read_stream("AUDIT").await, &expected);
    assert_eq!(
        (tally.lost, tally.duplicates, tally.reordered, tally.unknown),
        (0, 0, 0, 0),
        "{tally:?}"
    );
}
