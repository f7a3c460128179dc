//! Kafka and fan-out end to end: application transactions write the outbox,
//! the fan-out plugin sends each event to two Kafka clusters (tansu brokers)
//! and a NATS server, and consumers on each check what arrived.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use switchyard_tests::config::{Plugin, Target, TestConfig, routes};
use switchyard_tests::fanout::{AUDIT_STREAM, Copies, fan_out, relay_section, verify_kafka, verify_nats};
use switchyard_tests::kafka::KafkaServer;
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, order_event, write_orders};
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{NewEvent, all_published, count_status, fresh_db, place_order_event};
use switchyard_tests::relay::InProcess;
use switchyard_tests::{eventually, exclusive, init_logging};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_events_fan_out_to_two_kafka_clusters_and_nats() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let kafka = KafkaServer::start().await;
    let analytics = KafkaServer::start().await;
    let nats = NatsServer::start().await;
    kafka.create_topic("orders", 8).await;
    analytics.create_topic("orders-analytics", 3).await;
    nats.create_stream(AUDIT_STREAM, &["audit.>"]).await;
    let config = fan_out(
        &relay_section(),
        &db.url,
        &kafka.bootstrap(),
        &analytics.bootstrap(),
        &nats.url(),
    );
    let relay = InProcess::start(&config.parse()).await;

    let expected = write_orders(&db.pool, 500, 20, 8).await;
    assert_eq!(expected.len(), 10_000);
    all_published(&db.pool, 10_000, Duration::from_secs(240)).await;
    relay.stop().await;

    let orders = kafka.read_topic("orders", 10_000, Duration::from_secs(60)).await;
    verify_kafka(&orders, &expected, Copies::Once);
    let partitions: HashSet<i32> = orders.iter().map(|m| m.partition).collect();
    assert!(
        partitions.len() > 4,
        "keys spread over the partitions: {partitions:?}"
    );
    let copies = analytics
        .read_topic("orders-analytics", 10_000, Duration::from_secs(60))
        .await;
    verify_kafka(&copies, &expected, Copies::Once);
    verify_nats(&nats.read_stream(AUDIT_STREAM).await, &expected);

    // Every row records one acknowledged delivery per target.
    let incomplete: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox
          WHERE (SELECT count(*) FROM jsonb_each(deliveries) d WHERE d.value ->> 'acked_at' IS NOT NULL) <> 3",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(incomplete, 0, "three acknowledged deliveries per row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_down_is_retried_alone_and_the_healthy_ones_get_no_duplicates() {
    a_target_down_alone(false).await;
}

/// The same in replication mode: each event leaves the fast path with its
/// per-target state (two targets done), and the claim path finishes only
/// the third.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_replication_mode_a_target_down_is_retried_alone_from_the_table() {
    a_target_down_alone(true).await;
}

async fn a_target_down_alone(replication: bool) {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let kafka = KafkaServer::start().await;
    let analytics = KafkaServer::start().await;
    let mut nats = NatsServer::start().await;
    kafka.create_topic("orders", 4).await;
    analytics.create_topic("orders-analytics", 2).await;
    nats.create_stream(AUDIT_STREAM, &["audit.>"]).await;
    let config = fan_out(
        &relay_section(),
        &db.url,
        &kafka.bootstrap(),
        &analytics.bootstrap(),
        &nats.url(),
    );
    let config = if replication {
        let store = switchyard::store::OutboxStore::connect(&db.url, 2).await.unwrap();
        let pg = store.postgres().expect("a PostgreSQL store");
        let statements = pg
            .feed_statements(Some((&db.name, "switchyard_outbox")), None)
            .await
            .unwrap();
        pg.run_feed_statements(&statements).await.unwrap();
        config
            .relay("mode", "replication")
            .set("replication", "slot", db.name.as_str())
    } else {
        config
    };
    let relay = InProcess::start(&config.parse()).await;

    nats.stop();
    let expected = write_orders(&db.pool, 100, 5, 4).await;
    // Every event reaches both Kafka clusters and waits for NATS alone;
    // NATS will get each aggregate in order later.
    let waiting: i64 = eventually(
        "every event on Kafka and waiting for NATS",
        Duration::from_secs(180),
        || async {
            let rows: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM switchyard_outbox
              WHERE status <> 'published' AND waiting_on = ARRAY['audit']",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap();
            (rows == 500).then_some(rows)
        },
    )
    .await;
    assert_eq!(count_status(&db.pool, "published").await, 0);
    assert_eq!(count_status(&db.pool, "dead").await, 0);
    let (last_error, deliveries): (String, serde_json::Value) = sqlx::query_as(
        "SELECT last_error, deliveries FROM switchyard_outbox WHERE waiting_on IS NOT NULL ORDER BY id LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        last_error.contains("\"audit\""),
        "last_error names the target: {last_error}"
    );
    let deliveries = deliveries.as_object().expect("deliveries object");
    let state: BTreeMap<&str, bool> = deliveries
        .values()
        .map(|d| (d["target"].as_str().unwrap(), !d["acked_at"].is_null()))
        .collect();
    assert_eq!(
        state,
        BTreeMap::from([("analytics", true), ("audit", false), ("kafka", true)]),
        "per-target state in {deliveries:?}"
    );
    assert!(
        deliveries
            .values()
            .any(|d| d["target"] == "audit" && d["error"].is_string())
    );
    // A while later, Kafka still holds one copy of each.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let limit = Duration::from_secs(30);
    let waiting = usize::try_from(waiting).unwrap();
    let on_kafka = kafka.read_topic("orders", waiting, limit).await;
    assert_eq!(on_kafka.len(), waiting, "one copy of each on Kafka");
    let on_analytics = analytics.read_topic("orders-analytics", waiting, limit).await;
    assert_eq!(on_analytics.len(), waiting);

    nats.resume().await;
    all_published(&db.pool, 500, Duration::from_secs(120)).await;
    relay.stop().await;
    // verify_kafka fails on any event seen twice.
    verify_kafka(
        &kafka.read_topic("orders", 500, limit).await,
        &expected,
        Copies::Once,
    );
    verify_kafka(
        &analytics.read_topic("orders-analytics", 500, limit).await,
        &expected,
        Copies::Once,
    );
    verify_nats(&nats.read_stream(AUDIT_STREAM).await, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_size_limit_is_dead_lettered_while_others_flow() {
    init_logging();
    let db = fresh_db().await;
    let kafka = KafkaServer::start().await;
    kafka.create_topic("orders", 2).await;
    let config = TestConfig::new(&db.url)
        .tuning(
            relay_section()
                .set("max_payload_bytes", "4194304")
                .set("max_message_bytes", "4194304"),
        )
        .plugin(
            Plugin::new("fanout", &plugin("fan_out"))
                // Reading 1.5 MB can pass the default 100 ms on a loaded
                // machine; this test is about the broker's size limit, so
                // the plugin gets time to spare.
                .set("timeout_ms", 2000)
                .config("default", routes(&[("kafka", "orders", None)])),
        )
        .target("kafka", Target::kafka(&kafka.bootstrap()));
    let relay = InProcess::start(&config.parse()).await;

    let big = NewEvent {
        payload: serde_json::json!({ "seq": 0, "blob": "x".repeat(1_500_000) }),
        ..order_event(0, 0)
    };
    let big_id = place_order_event(&db.pool, &big, true).await;
    let mut expected = HashMap::new();
    for aggregate in 1..=20 {
        let event = order_event(aggregate, 0);
        let id = place_order_event(&db.pool, &event, true).await;
        expected.insert(
            id.to_string(),
            Expected {
                aggregate_id: event.aggregate_id,
                seq: 0,
                event_type: event.event_type,
            },
        );
    }
    all_published(&db.pool, 20, Duration::from_secs(60)).await;
    let (status, attempts, last_error): (String, i32, String) = eventually(
        "the oversized row dead-lettered",
        Duration::from_secs(30),
        || async {
            sqlx::query_as(
                "SELECT status, attempts, last_error FROM switchyard_outbox
                  WHERE event_id = $1 AND status = 'dead'",
            )
            .bind(big_id)
            .fetch_optional(&db.pool)
            .await
            .unwrap()
        },
    )
    .await;
    relay.stop().await;
    assert_eq!(status, "dead");
    assert_eq!(attempts, 1, "a permanent error is not retried: {last_error}");
    assert!(
        last_error.contains("\"kafka\"") && last_error.contains("too large"),
        "specific error: {last_error}"
    );
    verify_kafka(
        &kafka.read_topic("orders", 20, Duration::from_secs(30)).await,
        &expected,
        Copies::Once,
    );
}
