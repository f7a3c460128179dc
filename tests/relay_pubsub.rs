//! The Pub/Sub target against the Google Cloud Pub/Sub emulator: order per
//! aggregate on an ordering-enabled subscription, headers as attributes,
//! fan-out with NATS down, an emulator frozen under load, and the refusals
//! Pub/Sub's limits give, each with its own reason.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use switchyard_tests::config::{Plugin, Target, TestConfig, routes, strings, table};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, order_event, tally, write_orders};
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{NewEvent, all_published, count_status, fresh_db, place_order_event};
use switchyard_tests::pubsub::{Emulator, ORDERING_KEY, project};
use switchyard_tests::relay::{InProcess, RelaySection, parse};
use switchyard_tests::{cli, eventually, exclusive, init_logging};

const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");

/// Every event to Pub/Sub topic `orders` of `project`, plus `more` targets.
fn to_orders(db: &str, relay: RelaySection, project: &str, host: &str) -> TestConfig {
    TestConfig::new(db)
        .database("max_connections", 8)
        .tuning(relay)
        .plugin(
            Plugin::new("fanout", &plugin("fan_out"))
                .config("default", routes(&[("pubsub", "orders", Some("{aggregate_id}"))])),
        )
        .target("pubsub", Target::pubsub(project, host))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_aggregate_arrives_in_order_once_with_its_headers_as_attributes() {
    init_logging();
    let db = fresh_db().await;
    let emulator = Emulator::shared();
    let project = project();
    emulator.topic(&project, "orders").await;
    let relay_section = RelaySection::new().set("batch_size", "200");
    let config = to_orders(&db.url, relay_section, &project, emulator.host());
    let relay = InProcess::start(&parse(&config.toml())).await;

    let expected = write_orders(&db.pool, 100, 20, 4).await;
    all_published(&db.pool, 2000, Duration::from_secs(120)).await;
    let readiness = serde_json::to_value(switchyard::admin::readiness(&relay.relay).await).unwrap();
    assert_eq!(readiness["targets"]["pubsub"], "ok", "{readiness}");
    let metrics = relay.relay.metrics().render();
    assert!(
        metrics.contains("switchyard_messages_published_total{database=\"default\",target=\"pubsub\"} 2000"),
        "{metrics}"
    );
    relay.stop().await;

    let received = emulator
        .pull(&project, "orders", 2000, Duration::from_secs(60))
        .await;
    let tally = tally(&received, &expected);
    assert_eq!(
        (tally.lost, tally.reordered, tally.unknown),
        (0, 0, 0),
        "lost, reordered, unknown: {tally:?}"
    );
    for message in &received {
        let id = message.header("Switchyard-Event-Id").expect("event id attribute");
        let want = &expected[id];
        assert_eq!(message.header(ORDERING_KEY), Some(want.aggregate_id.as_str()));
        assert_eq!(
            message.header("Switchyard-Aggregate-Id"),
            Some(want.aggregate_id.as_str())
        );
        assert_eq!(
            message.header("Switchyard-Event-Type"),
            Some(want.event_type.as_str())
        );
        assert_eq!(message.header("Switchyard-Key"), Some(want.aggregate_id.as_str()));
        assert!(
            message
                .header("traceparent")
                .is_some_and(|t| t.starts_with("00-")),
            "the writer's trace context: {:?}",
            message.headers
        );
        assert_eq!(message.json()["seq"], want.seq);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_nats_down_only_nats_is_retried_and_pubsub_gets_each_event_once() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let emulator = Emulator::shared();
    let project = project();
    emulator.topic(&project, "orders").await;
    let mut nats = NatsServer::start().await;
    nats.create_stream("AUDIT", &["audit.>"]).await;
    let config = TestConfig::new(&db.url)
        .database("max_connections", 8)
        .tuning(RelaySection::quick().set("max_attempts", "100"))
        .plugin(Plugin::new("fanout", &plugin("fan_out")).config(
            "default",
            routes(&[
                ("pubsub", "orders", Some("{aggregate_id}")),
                ("audit", "audit.orders.{event_type}", None),
            ]),
        ))
        .target("pubsub", Target::pubsub(&project, emulator.host()))
        .target("audit", Target::nats(&nats.url()));
    let relay = InProcess::start(&parse(&config.toml())).await;

    nats.stop();
    let expected = write_orders(&db.pool, 50, 4, 2).await;
    // Each aggregate's first event reaches Pub/Sub; every row then waits,
    // spending no attempt, on NATS alone.
    let mut consumer = emulator.consumer(&project, "orders").await;
    let first = consumer.pull(50, Duration::from_secs(60)).await;
    assert_eq!(first.len(), 50, "each aggregate's first event on Pub/Sub");
    eventually("rows waiting on NATS alone", Duration::from_secs(60), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM switchyard_outbox
              WHERE status <> 'published' AND attempts = 0 AND waiting_on = ARRAY['audit']",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (waiting == 200).then_some(())
    })
    .await;
    nats.resume().await;
    all_published(&db.pool, 200, Duration::from_secs(120)).await;
    // A publish Pub/Sub itself did not answer in time (the emulator on a
    // busy machine) is published again, as it must be: a copy of one of
    // those is at-least-once, not a retry of NATS reaching Pub/Sub.
    let pubsub_failed: u64 = relay
        .relay
        .metrics()
        .render()
        .lines()
        .filter(|line| {
            line.starts_with("switchyard_messages_failed_total{") && line.contains("target=\"pubsub\"")
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum();
    relay.stop().await;

    // Every event, however slowly the emulator delivers, then a few
    // seconds more for any copy.
    let mut all = first;
    let distinct = |all: &[switchyard_tests::nats::Received]| {
        all.iter()
            .filter_map(|m| m.header("Switchyard-Event-Id"))
            .collect::<std::collections::HashSet<_>>()
            .len()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while distinct(&all) < expected.len() && std::time::Instant::now() < deadline {
        all.extend(consumer.pull(1, Duration::from_secs(1)).await);
    }
    all.extend(consumer.pull(1, Duration::from_secs(3)).await);
    let tally = tally(&all, &expected);
    assert_eq!(
        (tally.lost, tally.reordered),
        (0, 0),
        "Pub/Sub: each event, in order, though NATS was retried: {tally:?}"
    );
    // A copy only of a message whose publish failed, at most one each.
    assert!(
        tally.duplicates as u64 <= pubsub_failed,
        "Pub/Sub: {} copies, {pubsub_failed} messages Pub/Sub failed to answer: {tally:?}",
        tally.duplicates
    );
    let on_nats = tally_of(&nats.read_stream("AUDIT").await, &expected);
    assert_eq!(on_nats, (0, 0), "NATS: lost, reordered");
}

fn tally_of(
    received: &[switchyard_tests::nats::Received],
    expected: &HashMap<String, Expected>,
) -> (usize, usize) {
    let tally = tally(received, expected);
    (tally.lost, tally.reordered)
}

/// Delivery resumes once the emulator answers again: the relay's first
/// publish after the thaw comes within a margin of the test's own first
/// publish through a fresh client (the emulator's own time to come back,
/// however loaded the machine). The margin covers the relay's probe
/// (every 250 ms) and one claim, route and ack; rows left to their lease
/// (a minute here) or to the sweep of waiting rows (10 s) overshoot it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_emulator_dead_letters_nothing_and_delivery_resumes_once_it_answers() {
    init_logging();
    let _heavy = exclusive().await;
    let db = fresh_db().await;
    let emulator = Emulator::own().await;
    let project = project();
    emulator.topic(&project, "orders").await;
    let baseline_topic = "baseline";
    emulator.bare_topic(&project, baseline_topic).await;
    // Two attempts: an outage that spent them would dead-letter rows.
    let relay_section = RelaySection::quick().set("lease_duration_ms", "60000");
    let config = to_orders(&db.url, relay_section, &project, emulator.host());
    let relay = InProcess::start(&parse(&config.toml())).await;

    let writer = {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            let mut expected = HashMap::new();
            for seq in 0..40 {
                for aggregate in 0..20 {
                    let event = order_event(aggregate, seq);
                    let id = place_order_event(&pool, &event, true).await;
                    expected.insert(
                        id.to_string(),
                        Expected {
                            aggregate_id: event.aggregate_id,
                            seq: seq as u64,
                            event_type: event.event_type,
                        },
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            expected
        })
    };
    eventually(
        "deliveries before the freeze",
        Duration::from_secs(30),
        || async { (count_status(&db.pool, "published").await >= 60).then_some(()) },
    )
    .await;
    emulator.freeze();
    let frozen = Instant::now();
    eventually("the target paused", Duration::from_secs(30), || async {
        let readiness = serde_json::to_value(switchyard::admin::readiness(&relay.relay).await).unwrap();
        (readiness["targets"]["pubsub"] != "ok" && readiness["paused"]["pubsub"].is_object()).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(frozen.elapsed())).await;
    let before = count_status(&db.pool, "published").await;
    let thawed = Instant::now();
    emulator.thaw();
    let relayed = async {
        eventually("a delivery after the thaw", Duration::from_secs(60), || async {
            (count_status(&db.pool, "published").await > before).then_some(())
        })
        .await;
        thawed.elapsed()
    };
    let answered = async {
        own_publish(&project, emulator.host(), baseline_topic).await;
        thawed.elapsed()
    };
    let (resumed, answered) = tokio::join!(relayed, answered);
    eprintln!("after the thaw: the test's own publish {answered:?}, the relay's {resumed:?}");

    let expected = writer.await.unwrap();
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0, "nothing dead-lettered");
    assert!(
        resumed <= answered + Duration::from_secs(3),
        "delivery resumed {resumed:?} after SIGCONT, the emulator answered after {answered:?}"
    );
    let received = emulator
        .pull(&project, "orders", expected.len(), Duration::from_secs(60))
        .await;
    let tally = tally(&received, &expected);
    assert_eq!(
        (tally.lost, tally.reordered),
        (0, 0),
        "lost, reordered: {tally:?}"
    );
}

/// Publishes one message to `topic` through a client made now, trying
/// again until the emulator at `host` takes it.
async fn own_publish(project: &str, host: &str, topic: &str) {
    let config: switchyard::sinks::pubsub::PubSubSinkConfig =
        toml::from_str(&format!("project = {project:?}\nemulator_host = {host:?}")).unwrap();
    eventually(
        "the emulator takes a publish",
        Duration::from_secs(60),
        || async {
            let sink =
                switchyard::sinks::pubsub::PubSubSink::connect("baseline", &config, Duration::from_secs(30))
                    .await
                    .ok()?;
            let message = switchyard::sinks::OutgoingMessage {
                topic: topic.to_string(),
                payload: b"{}".to_vec().into(),
                event_id: "baseline".into(),
                dedup_id: "baseline".into(),
                ..Default::default()
            };
            let sent = switchyard::sinks::Sink::publish(&sink, vec![message]).await;
            sent[0].is_ok().then_some(())
        },
    )
    .await;
}

/// One event with `aggregate_id` and `headers`, and a payload of `size` bytes.
async fn odd_event(
    pool: &sqlx::PgPool,
    aggregate_id: &str,
    headers: serde_json::Value,
    size: usize,
) -> String {
    let event = NewEvent {
        aggregate_type: "Order".into(),
        aggregate_id: aggregate_id.into(),
        event_type: "OrderPlaced".into(),
        payload: serde_json::json!({ "pad": "x".repeat(size) }),
        headers,
    };
    place_order_event(pool, &event, true).await.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_waits_and_each_message_pubsub_would_refuse_is_dead_lettered_with_its_reason() {
    init_logging();
    let db = fresh_db().await;
    let emulator = Emulator::shared();
    let project = project();
    emulator.topic(&project, "orders").await;
    // Long aggregates get a doubled key as their ordering key.
    let config = TestConfig::new(&db.url)
        // Payloads of 10 MiB through the plugin: on a busy 2-core machine a
        // batch of them may outlast the quick lease, or one call the
        // plugin's time limit (1 s was seen to), and the attempt spent on
        // that would hide the reason under test.
        .tuning(
            RelaySection::quick()
                .set("lease_duration_ms", "15000")
                .set("max_message_bytes", "16777216")
                .set("max_payload_bytes", "16777216"),
        )
        .plugin(
            Plugin::new("fanout", &plugin("fan_out"))
                .set("max_memory_bytes", 134_217_728)
                .set("timeout_ms", 10_000)
                .config(
                    "routes",
                    table(&[
                        (
                            "OrderPlaced",
                            routes(&[("pubsub", "orders", Some("{aggregate_id}{aggregate_id}"))]),
                        ),
                        ("Lost", routes(&[("pubsub", "no-such-topic", None)])),
                    ]),
                ),
        )
        .target(
            "pubsub",
            Target::pubsub(&project, emulator.host()).set("ordering_key", "key"),
        );
    let relay = InProcess::start(&parse(&config.toml())).await;

    let many: serde_json::Map<String, serde_json::Value> =
        (0..96).map(|i| (format!("h{i}"), "v".into())).collect();
    let cases = [
        (
            odd_event(&db.pool, "big", serde_json::json!({}), 10 * 1024 * 1024 + 1).await,
            "Pub/Sub takes at most 10485760 per message",
        ),
        (
            odd_event(&db.pool, "many", serde_json::Value::Object(many), 1).await,
            "attributes (headers with Switchyard's own); Pub/Sub takes at most 100",
        ),
        (
            odd_event(
                &db.pool,
                "longname",
                serde_json::json!({ "k".repeat(300): "v" }),
                1,
            )
            .await,
            "has a 300-byte name",
        ),
        (
            odd_event(&db.pool, "goog", serde_json::json!({ "googled": "v" }), 1).await,
            "reserved by Pub/Sub",
        ),
        (
            odd_event(
                &db.pool,
                "longvalue",
                serde_json::json!({ "k": "v".repeat(1100) }),
                1,
            )
            .await,
            "has a 1100-byte value",
        ),
        (
            odd_event(&db.pool, &"a".repeat(600), serde_json::json!({}), 1).await,
            "the ordering key is 1200 bytes",
        ),
    ];
    let fine = odd_event(&db.pool, "fine", serde_json::json!({ "tenant": "acme" }), 1).await;
    let lost = place_order_event(
        &db.pool,
        &NewEvent {
            aggregate_type: "Order".into(),
            aggregate_id: "lost".into(),
            event_type: "Lost".into(),
            payload: serde_json::json!({}),
            headers: serde_json::json!({}),
        },
        true,
    )
    .await
    .to_string();

    let state = |id: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (String, Option<String>, i32)>(
                "SELECT status, last_error, attempts FROM switchyard_outbox WHERE event_id::text = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    for (id, reason) in &cases {
        let (status, error) = eventually(reason, Duration::from_secs(30), || async {
            let (status, error, _) = state(id.clone()).await;
            (status == "dead").then_some((status, error))
        })
        .await;
        let error = error.unwrap_or_default();
        assert!(
            error.contains(reason),
            "{status}: {error:?} should say {reason:?}"
        );
    }
    eventually("the missing topic named", Duration::from_secs(30), || async {
        let (status, error, attempts) = state(lost.clone()).await;
        let error = error.unwrap_or_default();
        (status != "dead"
            && attempts == 0
            && error.contains(&format!("projects/{project}/topics/no-such-topic does not exist")))
        .then_some(())
    })
    .await;
    eventually("the fine event published", Duration::from_secs(30), || async {
        (state(fine.clone()).await.0 == "published").then_some(())
    })
    .await;
    relay.stop().await;
    let received = emulator
        .pull(&project, "orders", 1, Duration::from_secs(10))
        .await;
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].header("tenant"), Some("acme"));
    assert_eq!(received[0].header(ORDERING_KEY), Some("finefine"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_topics_makes_the_listed_and_the_missing_topics() {
    init_logging();
    let db = fresh_db().await;
    let emulator = Emulator::shared();
    let project = project();
    let config = to_orders(&db.url, RelaySection::quick(), &project, emulator.host()).target_set(
        "pubsub",
        "create_topics",
        true,
    );
    let config = config.target_set("pubsub", "topics", switchyard_tests::config::strings(&["listed"]));
    let relay = InProcess::start(&parse(&config.toml())).await;
    let admin = emulator.admin().await;
    admin
        .get_topic()
        .set_topic(format!("projects/{project}/topics/listed"))
        .send()
        .await
        .expect("the listed topic was created at start");
    write_orders(&db.pool, 3, 2, 1).await;
    all_published(&db.pool, 6, Duration::from_secs(30)).await;
    relay.stop().await;
    admin
        .get_topic()
        .set_topic(format!("projects/{project}/topics/orders"))
        .send()
        .await
        .expect("the plugin's topic was created at its first publish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_names_a_listed_topic_that_does_not_exist() {
    init_logging();
    let db = fresh_db().await;
    let emulator = Emulator::shared();
    let project = project();
    emulator.topic(&project, "orders").await;
    // validate asks within the publish timeout: the quick section's second
    // was too short for the shared emulator in a loaded CI run, and validate
    // then only warned that it could not check.
    let relay = RelaySection::quick()
        .set("publish_timeout_ms", "15000")
        .set("lease_duration_ms", "60000");
    let config = to_orders(&db.url, relay, &project, emulator.host()).target_set(
        "pubsub",
        "topics",
        strings(&["orders", "refunds"]),
    );
    let dir = tempfile_dir();
    let path = dir.join("switchyard.toml");
    std::fs::write(&path, config.toml()).unwrap();
    let path = path.to_str().unwrap();
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", path], &[]).await;
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains(&format!(
            "target \"pubsub\": Pub/Sub topic projects/{project}/topics/refunds does not exist"
        )),
        "{err}"
    );
    assert!(!err.contains("topics/orders does not"), "{err}");

    std::fs::write(path, config.target_set("pubsub", "create_topics", true).toml()).unwrap();
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", path], &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    emulator
        .admin()
        .await
        .get_topic()
        .set_topic(format!("projects/{project}/topics/refunds"))
        .send()
        .await
        .expect("validate made the listed topic with create_topics");
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sy-pubsub-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
