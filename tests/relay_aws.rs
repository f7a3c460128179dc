//! The AWS targets against moto's server: SQS FIFO and standard queues,
//! SNS FIFO topics read through an SQS subscription, an EventBridge bus
//! read through a rule into a queue, Kinesis streams read shard by shard.
//! A service-shaped writer's events arrive once by event id, in order per
//! aggregate where the service keeps order; SQS and SNS keep the event id
//! readable however many headers travel; each limit fails its event alone,
//! named; a fan-out with SQS down keeps NATS going; `validate` names a
//! missing queue; credentials that rotate are taken up without a restart,
//! and a wrong secret is named and never shown.

use std::collections::HashMap;
use std::time::Duration;

use switchyard_tests::aws::{Moto, from_event, unique};
use switchyard_tests::config::{Plugin, Target, TestConfig, routes, strings};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, tally};
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{NewEvent, Outbox, all_published, count_status, fresh_db, place_event};
use switchyard_tests::relay::{InProcess, RelaySection, parse};
use switchyard_tests::workload::{Shape, write_events};
use switchyard_tests::{cli, eventually, init_logging};

const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");

/// Every event to target `aws` (`target`), topic `topic`, keyed by aggregate.
fn to_aws(db: &str, target: Target, topic: &str) -> TestConfig {
    TestConfig::new(db)
        .database("max_connections", 8)
        .tuning(RelaySection::new().set("batch_size", "100"))
        .plugin(
            Plugin::new("fanout", &plugin("fan_out"))
                .config("default", routes(&[("aws", topic, Some("{aggregate_id}"))])),
        )
        .target("aws", target)
}

/// Writes as a service does (several aggregates a transaction, one to three
/// events of each, beside its `orders` rows), runs a relay on `config`
/// until everything is published, and returns what was written.
async fn relay_a_service(
    db: &switchyard_tests::postgres::TestDb,
    config: &TestConfig,
    events: usize,
) -> HashMap<String, Expected> {
    let relay = InProcess::start(&parse(&config.toml())).await;
    let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 30, events, 2, 77).await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0, "nothing dead-lettered");
    expected
}

fn assert_once_in_order(received: &[switchyard_tests::nats::Received], expected: &HashMap<String, Expected>) {
    let tally = tally(received, expected);
    assert_eq!(
        (tally.lost, tally.duplicates, tally.reordered, tally.unknown),
        (0, 0, 0, 0),
        "{tally:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_fifo_gets_each_event_once_in_order_per_aggregate_grouped_by_it() {
    init_logging();
    let db = fresh_db().await;
    let moto = Moto::shared();
    let queue = unique("orders") + ".fifo";
    let url = moto.queue(&queue).await;
    let expected = relay_a_service(&db, &to_aws(&db.url, moto.target("sqs"), &queue), 300).await;
    let received = moto.receive(&url, expected.len(), Duration::from_secs(60)).await;
    assert_once_in_order(&received, &expected);
    for message in &received {
        let want = &expected[message
            .header("Switchyard-Event-Id")
            .expect("the event id attribute")];
        assert_eq!(
            message.header("x-message-group"),
            Some(want.aggregate_id.as_str())
        );
        assert!(
            message
                .header("traceparent")
                .is_some_and(|t| t.starts_with("00-"))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sqs_fifo_retry_within_the_window_is_dropped_by_its_deduplication_id() {
    init_logging();
    let db = fresh_db().await;
    let moto = Moto::shared();
    let queue = unique("dedup") + ".fifo";
    let url = moto.queue(&queue).await;
    let config = to_aws(&db.url, moto.target("sqs"), &queue);
    let expected = relay_a_service(&db, &config, 40).await;
    // Every event sent again, as a relay killed between the publish and
    // the ack would: SQS drops each by its deduplication id, the event id.
    sqlx::query("UPDATE switchyard_outbox SET status = 'pending', published_at = NULL, deliveries = '{}'")
        .execute(&db.pool)
        .await
        .unwrap();
    let relay = InProcess::start(&parse(&config.toml())).await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(60)).await;
    relay.stop().await;
    let received = moto
        .receive(&url, expected.len() * 2, Duration::from_secs(15))
        .await;
    assert_once_in_order(&received, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sns_fifo_gets_each_event_once_in_order_through_an_sqs_subscription() {
    init_logging();
    let db = fresh_db().await;
    let moto = Moto::shared();
    let topic = unique("orders") + ".fifo";
    let (arn, url) = moto
        .topic_into_queue(&topic, &(unique("subscriber") + ".fifo"))
        .await;
    // The plugin names the topic; the target finds its ARN in the account.
    let expected = relay_a_service(
        &db,
        &to_aws(
            &db.url,
            moto.target("sns").set("topics", strings(&[&arn])),
            &topic,
        ),
        200,
    )
    .await;
    let received = moto.receive(&url, expected.len(), Duration::from_secs(60)).await;
    assert_once_in_order(&received, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eventbridge_gets_each_event_once_with_source_detail_type_and_the_event_id() {
    init_logging();
    let db = fresh_db().await;
    let moto = Moto::shared();
    let bus = unique("orders");
    let url = moto.bus_into_queue(&bus, &unique("rule-target")).await;
    let expected = relay_a_service(&db, &to_aws(&db.url, moto.target("eventbridge"), &bus), 150).await;
    let events: Vec<_> = moto
        .receive(&url, expected.len(), Duration::from_secs(60))
        .await
        .iter()
        .map(|message| from_event(message, "switchyard"))
        .collect();
    // EventBridge keeps no order: each event once, in any order.
    let tally = tally(&events, &expected);
    assert_eq!(
        (tally.lost, tally.duplicates, tally.unknown),
        (0, 0, 0),
        "{tally:?}"
    );
    for event in &events {
        let want = &expected[event
            .header("Switchyard-Event-Id")
            .expect("the event id in detail")];
        assert_eq!(event.header("x-source"), Some("order"));
        assert_eq!(event.header("x-detail-type"), Some(want.event_type.as_str()));
        assert_eq!(event.json()["seq"], want.seq);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinesis_gets_each_event_once_in_order_per_partition_key() {
    init_logging();
    let db = fresh_db().await;
    let moto = Moto::shared();
    let stream = unique("orders");
    moto.stream(&stream, 3).await;
    let expected = relay_a_service(&db, &to_aws(&db.url, moto.target("kinesis"), &stream), 300).await;
    let received = moto
        .records(&stream, expected.len(), Duration::from_secs(60))
        .await;
    assert_once_in_order(&received, &expected);
    for record in &received {
        let want = &expected[record
            .header("Switchyard-Event-Id")
            .expect("the event id in the envelope")];
        assert_eq!(record.header("x-partition-key"), Some(want.aggregate_id.as_str()));
        assert_eq!(record.json()["seq"], want.seq);
    }
}

/// An event with `headers` and `payload`, written as a service would.
async fn write_one(
    db: &switchyard_tests::postgres::TestDb,
    id: &str,
    headers: serde_json::Value,
    payload: serde_json::Value,
) -> String {
    let event = NewEvent {
        aggregate_type: "order".into(),
        aggregate_id: id.into(),
        event_type: "OrderPlaced".into(),
        payload,
        headers,
    };
    place_event(&db.pool, Outbox::Switchyard, &event, true)
        .await
        .to_string()
}

async fn last_error(db: &switchyard_tests::postgres::TestDb, event_id: &str) -> (String, String) {
    sqlx::query_as("SELECT status, coalesce(last_error, '') FROM switchyard_outbox WHERE event_id = $1::uuid")
        .bind(event_id)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_eleventh_header_a_300_kib_message_and_a_detail_not_an_object_each_get_their_outcome() {
    init_logging();
    let db = fresh_db().await;
    let moto = Moto::shared();
    let queue = unique("limits") + ".fifo";
    let url = moto.queue(&queue).await;
    let bus = unique("limits");
    moto.bus_into_queue(&bus, &unique("limits-rule")).await;
    let config = TestConfig::new(&db.url)
        .tuning(RelaySection::quick())
        .plugin(Plugin::new("fanout", &plugin("fan_out")).config(
            "default",
            routes(&[("sqs", &queue, Some("{aggregate_id}")), ("bus", &bus, None)]),
        ))
        .target("sqs", moto.target("sqs"))
        .target("bus", moto.target("eventbridge"));
    let relay = InProcess::start(&parse(&config.toml())).await;
    // Ten headers of the row's own beside the relay's: more than SQS's ten
    // attributes, so they travel together and the event id stays readable.
    let many: serde_json::Map<String, serde_json::Value> = (0..10)
        .map(|i| (format!("x-row-{i}"), serde_json::Value::String(format!("v{i}"))))
        .collect();
    let headers_event = write_one(
        &db,
        "order-h",
        serde_json::Value::Object(many),
        serde_json::json!({"seq": 0}),
    )
    .await;
    let big = write_one(
        &db,
        "order-big",
        serde_json::json!({}),
        serde_json::json!({"blob": "x".repeat(300 * 1024)}),
    )
    .await;
    let not_object = write_one(
        &db,
        "order-array",
        serde_json::json!({}),
        serde_json::json!([1, 2, 3]),
    )
    .await;
    let fine = write_one(
        &db,
        "order-fine",
        serde_json::json!({}),
        serde_json::json!({"seq": 0}),
    )
    .await;
    eventually("the outcomes", Duration::from_secs(60), || async {
        let settled: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM switchyard_outbox WHERE status IN ('published', 'dead')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (settled == 4).then_some(())
    })
    .await;
    relay.stop().await;
    let (status, error) = last_error(&db, &big).await;
    assert_eq!(status, "dead", "{error}");
    assert!(error.contains("256 KiB") && error.contains("SQS"), "{error}");
    let (status, error) = last_error(&db, &not_object).await;
    assert_eq!(status, "dead", "{error}");
    assert!(error.contains("JSON object"), "{error}");
    assert_eq!(last_error(&db, &headers_event).await.0, "published");
    assert_eq!(last_error(&db, &fine).await.0, "published");
    let received = moto.receive(&url, 3, Duration::from_secs(20)).await;
    let ids: Vec<&str> = received
        .iter()
        .filter_map(|m| m.header("Switchyard-Event-Id"))
        .collect();
    assert!(
        ids.contains(&headers_event.as_str()) && ids.contains(&fine.as_str()),
        "{ids:?}"
    );
    let packed = received
        .iter()
        .find(|m| m.header("Switchyard-Event-Id") == Some(headers_event.as_str()))
        .unwrap();
    assert_eq!(
        packed.header("x-row-9"),
        Some("v9"),
        "every header arrives: {:?}",
        packed.headers
    );
    // The array went to the queue (SQS takes any text): only EventBridge refused it.
    assert!(ids.contains(&not_object.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sqs_down_nats_goes_on_and_sqs_gets_everything_on_its_return() {
    init_logging();
    let db = fresh_db().await;
    let mut moto = Moto::own().await;
    let queue = unique("fanout") + ".fifo";
    moto.queue(&queue).await;
    let nats = NatsServer::start().await;
    nats.create_stream("AUDIT", &["audit.>"]).await;
    let config = TestConfig::new(&db.url)
        .database("max_connections", 8)
        .tuning(RelaySection::quick().set("max_attempts", "2"))
        .plugin(Plugin::new("fanout", &plugin("fan_out")).config(
            "default",
            routes(&[
                ("sqs", &queue, Some("{aggregate_id}")),
                ("audit", "audit.orders.{event_type}", None),
            ]),
        ))
        .target("sqs", moto.target("sqs").set("queues", strings(&[&queue])))
        .target("audit", Target::nats(&nats.url()));
    let relay = InProcess::start(&parse(&config.toml())).await;
    moto.kill();
    let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 20, 150, 2, 5).await;
    // Each aggregate's first event reaches NATS while SQS is away; the
    // aggregate's later events wait behind it, on SQS alone.
    let aggregates = expected
        .values()
        .map(|e| e.aggregate_id.as_str())
        .collect::<std::collections::HashSet<_>>()
        .len();
    eventually(
        "each aggregate's first event on NATS",
        Duration::from_secs(60),
        || async { (nats.stream_len("AUDIT").await >= aggregates as u64).then_some(()) },
    )
    .await;
    eventually("rows waiting on SQS alone", Duration::from_secs(60), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM switchyard_outbox WHERE status <> 'published' AND waiting_on = ARRAY['sqs']",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (waiting > 0).then_some(())
    })
    .await;
    let spent: i64 =
        sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE attempts > 1 OR status = 'dead'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(spent, 0, "the outage spent no attempt");
    // Back, empty (moto keeps nothing): the queue is made again, and every
    // SQS delivery goes out.
    moto.start().await;
    let url = moto.queue(&queue).await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    let received = moto.receive(&url, expected.len(), Duration::from_secs(60)).await;
    assert_once_in_order(&received, &expected);
    let audit = tally(&nats.read_stream("AUDIT").await, &expected);
    assert_eq!(
        (audit.lost, audit.duplicates, audit.reordered),
        (0, 0, 0),
        "{audit:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_names_a_missing_queue_stream_topic_and_bus() {
    let db = fresh_db().await;
    let moto = Moto::shared();
    let config = TestConfig::new(&db.url)
        .plugin(
            Plugin::new("fanout", &plugin("fan_out"))
                .config("default", routes(&[("q", "nothing-here", None)])),
        )
        .target("q", moto.target("sqs").set("queues", strings(&["no-such-queue"])))
        .target(
            "s",
            moto.target("kinesis")
                .set("streams", strings(&["no-such-stream"])),
        )
        .target("t", moto.target("sns").set("topics", strings(&["no-such-topic"])))
        .target(
            "b",
            moto.target("eventbridge").set("buses", strings(&["no-such-bus"])),
        );
    let path = std::env::temp_dir().join(format!("sy-aws-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config.toml()).unwrap();
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", path.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_file(&path);
    assert_ne!(code, 0, "{out}{err}");
    for missing in [
        "queue no-such-queue",
        "stream no-such-stream",
        "topic no-such-topic",
        "bus no-such-bus",
    ] {
        assert!(
            err.contains(missing) && err.contains("does not exist"),
            "{missing}: {err}"
        );
    }
}

/// How the service goes away.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Outage {
    /// Connections refused and cut, as a killed server's are: through a
    /// front that closes (moto keeps what it took, as the service does; a
    /// killed moto would forget it).
    Refused,
    /// SIGSTOP: connections taken, nothing answers.
    Frozen,
}

/// How long the service is away: past the publish timeout, the probes'
/// backoff and a lease of the quick section.
const OUTAGE: Duration = Duration::from_secs(30);

/// A writer going on (about 90 events/s for Kinesis, 8 for SQS) while
/// the `kind` target (an SQS FIFO queue or a Kinesis stream) is away for
/// [`OUTAGE`]: nothing dead, every row one attempt at most, every event
/// there and in order per aggregate, and the first publish soon after the
/// return.
async fn away_under_load(kind: &str, outage: Outage) {
    use switchyard_tests::pubsub::Front;
    use switchyard_tests::service::ServicePool;
    init_logging();
    let _heavy = switchyard_tests::exclusive().await;
    let db = fresh_db().await;
    let moto = Moto::own().await;
    let upstream = moto.url.trim_start_matches("http://").to_string();
    let mut front = Front::to(&upstream).await;
    let endpoint = match outage {
        Outage::Refused => format!("http://{}", front.host()),
        Outage::Frozen => moto.url.clone(),
    };
    let (name, url) = if kind == "kinesis" {
        let stream = unique("away");
        moto.stream(&stream, 2).await;
        (stream, String::new())
    } else {
        let queue = unique("away") + ".fifo";
        let url = moto.queue(&queue).await;
        (queue, url)
    };
    let list = if kind == "kinesis" { "streams" } else { "queues" };
    let target = moto
        .target(kind)
        .set("endpoint_url", endpoint.as_str())
        .set(list, strings(&[&name]));
    let config = to_aws(&db.url, target, &name).tuning(
        RelaySection::quick()
            .set("max_attempts", "2")
            .set("publish_timeout_ms", "3000")
            .set("lease_duration_ms", "60000"),
    );
    let relay = InProcess::start(&parse(&config.toml())).await;
    let pool: ServicePool = (&db.pool).into();
    // A consumer reads the queue as the writer goes on, straight from moto
    // (moto's FIFO queue slows down with every message it holds).
    let consumer = (kind != "kinesis").then(|| moto.drain(&url));
    let stop = tokio_util::sync::CancellationToken::new();
    // moto's FIFO queues take some 15 messages a second, fewer as they
    // fill: the SQS writer is paced for the emulator, not for the relay.
    let per_second = if kind == "kinesis" { 20 } else { 2 };
    let writer = switchyard_tests::workload::paced_writer(
        &db.pool,
        Shape::rows(Outbox::Switchyard),
        20,
        per_second,
        stop.clone(),
    );
    eventually(
        "events published before the outage",
        Duration::from_secs(30),
        || async { (count_status(&db.pool, "published").await > 0).then_some(()) },
    )
    .await;
    match outage {
        Outage::Refused => front.close(),
        Outage::Frozen => moto.freeze(),
    }
    eventually(
        "rows waiting on the target, no attempt spent",
        Duration::from_secs(60),
        || async { (pool.waiting_without_attempts("aws").await > 0).then_some(()) },
    )
    .await;
    tokio::time::sleep(OUTAGE).await;
    let resuming = pool.now().await;
    match outage {
        Outage::Refused => front.open().await,
        Outage::Frozen => moto.thaw(),
    }
    let back = pool.now().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.cancel();
    let expected = writer.await.unwrap();
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    let first = pool
        .first_publish_since(resuming, back)
        .await
        .expect("rows published after the return");
    eprintln!(
        "{kind}: first publish {first:.3} s after the return; {} events",
        expected.len()
    );
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0, "nothing dead-lettered");
    let spent = switchyard_tests::postgres::spent_attempts(&db.pool).await;
    assert_eq!(spent, 0, "the outage spent no attempt");
    // A bound far under what waiting for a lease (60 s here) or a backoff
    // would cost; the promise's second is measured in the fault runs.
    assert!(first < 10.0, "first publish {first:.1} s after the return");
    let received = match consumer {
        Some(consumer) => consumer.wait(expected.len(), Duration::from_secs(120)).await,
        None => moto.records(&name, expected.len(), Duration::from_secs(60)).await,
    };
    let tally = tally(&received, &expected);
    assert_eq!(
        (tally.lost, tally.reordered, tally.unknown),
        (0, 0, 0),
        "{tally:?}"
    );
    // A publish cut mid-way is sent again. Kinesis keeps both copies; SQS
    // drops the second by its deduplication id for five minutes, but moto
    // forgets an id once its message is deleted (as the consumer here does
    // at once), so a copy may show. The deduplication id itself is checked
    // by `an_sqs_fifo_retry_within_the_window_is_dropped_by_its_deduplication_id`.
    assert!(tally.duplicates <= 40, "{tally:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_fifo_refusing_connections_for_30_s_under_load_costs_no_attempt_and_loses_nothing() {
    away_under_load("sqs", Outage::Refused).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_fifo_frozen_for_30_s_under_load_costs_no_attempt_and_loses_nothing() {
    away_under_load("sqs", Outage::Frozen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinesis_refusing_connections_for_30_s_under_load_costs_no_attempt_and_loses_nothing() {
    away_under_load("kinesis", Outage::Refused).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinesis_frozen_for_30_s_under_load_costs_no_attempt_and_loses_nothing() {
    away_under_load("kinesis", Outage::Frozen).await;
}

/// A moto that checks signatures (after the first three calls, which make
/// the relay's IAM user), the user's first access key, and an IAM client
/// signing with it.
async fn checking_moto() -> (Moto, aws_sdk_iam_key::Key) {
    let moto = Moto::own_with(&[("INITIAL_NO_AUTH_ACTION_COUNT", "3")]).await;
    let key = aws_sdk_iam_key::first(&moto).await;
    (moto, key)
}

/// The relay's IAM user and its access keys, made through moto's IAM API.
mod aws_sdk_iam_key {
    use switchyard_tests::aws::Moto;

    /// An access key id and its secret.
    #[derive(Clone)]
    pub struct Key {
        pub id: String,
        pub secret: String,
    }

    async fn call(moto: &Moto, key: Option<&Key>, action: &str, params: &[(&str, &str)]) -> String {
        // IAM's query API through the test's own SDK config would need the
        // IAM crate; a signed form POST through the STS-free path is
        // what the CLI does: moto reads both.
        let mut form = vec![("Action", action), ("Version", "2010-05-08")];
        form.extend_from_slice(params);
        switchyard_tests::aws::query_call(
            moto,
            "iam",
            key.map(|k| (k.id.as_str(), k.secret.as_str())),
            &form,
        )
        .await
    }

    fn field(body: &str, name: &str) -> String {
        body.split(&format!("<{name}>"))
            .nth(1)
            .and_then(|rest| rest.split(&format!("</{name}>")).next())
            .unwrap_or_default()
            .to_string()
    }

    /// The user `relay`, allowed everything, and its first key (the
    /// three calls moto takes unsigned).
    pub async fn first(moto: &Moto) -> Key {
        call(moto, None, "CreateUser", &[("UserName", "relay")]).await;
        let policy =
            r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]}"#;
        call(
            moto,
            None,
            "PutUserPolicy",
            &[
                ("UserName", "relay"),
                ("PolicyName", "all"),
                ("PolicyDocument", policy),
            ],
        )
        .await;
        let body = call(moto, None, "CreateAccessKey", &[("UserName", "relay")]).await;
        Key {
            id: field(&body, "AccessKeyId"),
            secret: field(&body, "SecretAccessKey"),
        }
    }

    /// A second key of the user, made with `with`, then `with` deleted:
    /// a rotation, as an operator or a secrets manager does it.
    pub async fn rotate(moto: &Moto, with: &Key) -> Key {
        let body = call(moto, Some(with), "CreateAccessKey", &[("UserName", "relay")]).await;
        let next = Key {
            id: field(&body, "AccessKeyId"),
            secret: field(&body, "SecretAccessKey"),
        };
        call(
            moto,
            Some(&next),
            "DeleteAccessKey",
            &[("UserName", "relay"), ("AccessKeyId", &with.id)],
        )
        .await;
        next
    }
}

fn credentials_file(path: &std::path::Path, key: &aws_sdk_iam_key::Key) {
    std::fs::write(
        path,
        format!(
            "[default]\naws_access_key_id = {}\naws_secret_access_key = {}\n",
            key.id, key.secret
        ),
    )
    .unwrap();
}

/// The relay finds its credentials in the shared credentials file (the
/// default chain, nothing in its config); the key is rotated under it (a
/// new key written to the file, the old one deleted in IAM). Its next call
/// is refused, the target waits without spending attempts, and the relay
/// finds the new key in the file: every event arrives, none dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_rotated_in_the_shared_credentials_file_is_taken_up_without_a_restart() {
    init_logging();
    let db = fresh_db().await;
    let (moto, first) = checking_moto().await;
    let queue = unique("rotated") + ".fifo";
    let url = switchyard_tests::aws::query_call(
        &moto,
        "sqs",
        Some((&first.id, &first.secret)),
        &[
            ("Action", "CreateQueue"),
            ("QueueName", &queue),
            ("Attribute.1.Name", "FifoQueue"),
            ("Attribute.1.Value", "true"),
        ],
    )
    .await;
    assert!(url.contains(&queue), "{url}");
    let dir = std::env::temp_dir().join(unique("sy-aws-credentials"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("credentials");
    credentials_file(&file, &first);
    let target = Target::of("sqs")
        .set("region", switchyard_tests::aws::REGION)
        .set("endpoint_url", moto.url.as_str())
        .set("queues", strings(&[&queue]));
    let config = to_aws(&db.url, target, &queue).tuning(RelaySection::quick().set("max_attempts", "2"));
    let log = dir.join("relay.log");
    let env = [
        ("AWS_SHARED_CREDENTIALS_FILE", file.to_str().unwrap()),
        ("AWS_CONFIG_FILE", "/nonexistent"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ];
    let mut relay = switchyard_tests::relay::Process::spawn_logged_with(
        SWITCHYARD,
        &config.toml(),
        "rotated",
        "info",
        &log,
        &env,
    );
    let before = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 10, 60, 1, 1).await;
    all_published(&db.pool, before.len() as i64, Duration::from_secs(60)).await;
    let second = aws_sdk_iam_key::rotate(&moto, &first).await;
    credentials_file(&file, &second);
    let after = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 10, 60, 1, 2).await;
    all_published(
        &db.pool,
        (before.len() + after.len()) as i64,
        Duration::from_secs(60),
    )
    .await;
    relay.terminate();
    assert_eq!(count_status(&db.pool, "dead").await, 0);
    let spent = switchyard_tests::postgres::spent_attempts(&db.pool).await;
    assert_eq!(spent, 0, "the refused key spent no attempt");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("InvalidClientTokenId"),
        "the old key was refused, and said so:\n{text}"
    );
    for secret in [&first.secret, &second.secret] {
        assert!(!text.contains(secret.as_str()), "a secret in the log");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The web identity tokens of `AssumeRoleWithWebIdentity` calls in the
/// order moto received them (its request recording, a line per request).
fn web_identity_tokens(recording: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(recording).unwrap_or_default();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|request| {
            let body = request["body"].as_str()?.to_string();
            let body = if request["body_encoded"].as_bool() == Some(true) {
                use base64::Engine;
                String::from_utf8(base64::engine::general_purpose::STANDARD.decode(body).ok()?).ok()?
            } else {
                body
            };
            let form: HashMap<String, String> = url::form_urlencoded::parse(body.as_bytes())
                .into_owned()
                .collect();
            (form.get("Action").map(String::as_str) == Some("AssumeRoleWithWebIdentity"))
                .then(|| form.get("WebIdentityToken").cloned())
                .flatten()
        })
        .collect()
}

/// A web identity token file (as a Kubernetes service account's is
/// mounted, replaced by a rename) rotated under a running relay: its next
/// `AssumeRoleWithWebIdentity` sends the new token, without a restart,
/// and no event waits for it, spends an attempt or is lost; neither token
/// is in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_identity_token_rotated_under_the_relay_is_taken_up() {
    init_logging();
    let db = fresh_db().await;
    let dir = std::env::temp_dir().join(unique("sy-aws-web-identity"));
    std::fs::create_dir_all(&dir).unwrap();
    let recording = dir.join("moto-recording");
    let moto = Moto::own_with(&[
        ("MOTO_ENABLE_RECORDING", "true"),
        ("MOTO_RECORDER_FILEPATH", recording.to_str().unwrap()),
    ])
    .await;
    let queue = unique("web-identity") + ".fifo";
    let url = moto.queue(&queue).await;
    let token_file = dir.join("token");
    let replace = |token: &str| {
        let next = dir.join("token.next");
        std::fs::write(&next, token).unwrap();
        std::fs::rename(&next, &token_file).unwrap();
    };
    let first = format!("token-one-{}", uuid::Uuid::new_v4().simple());
    let second = format!("token-two-{}", uuid::Uuid::new_v4().simple());
    replace(&first);
    let target = Target::of("sqs")
        .set("region", switchyard_tests::aws::REGION)
        .set("endpoint_url", moto.url.as_str())
        .set("queues", strings(&[&queue]))
        .set("credentials_refresh_seconds", 2);
    let config = to_aws(&db.url, target, &queue).tuning(RelaySection::quick().set("max_attempts", "2"));
    let log = dir.join("relay.log");
    let env = [
        ("AWS_WEB_IDENTITY_TOKEN_FILE", token_file.to_str().unwrap()),
        ("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/relay"),
        ("AWS_ROLE_SESSION_NAME", "relay"),
        // The SDK's own STS client for web identity takes its endpoint from
        // the SDK's variable, not from the target's sts_endpoint_url.
        ("AWS_ENDPOINT_URL_STS", moto.url.as_str()),
        ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent"),
        ("AWS_CONFIG_FILE", "/nonexistent"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ];
    let mut relay = switchyard_tests::relay::Process::spawn_logged_with(
        SWITCHYARD,
        &config.toml(),
        "web-identity",
        "info",
        &log,
        &env,
    );
    let before = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 10, 60, 1, 1).await;
    all_published(&db.pool, before.len() as i64, Duration::from_secs(60)).await;
    assert!(
        web_identity_tokens(&recording).contains(&first),
        "the relay assumed its role with the first token"
    );
    replace(&second);
    // Credentials are found again at the first call after
    // credentials_refresh_seconds: the next events' publish.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 10, 60, 1, 2).await;
    all_published(
        &db.pool,
        (before.len() + after.len()) as i64,
        Duration::from_secs(60),
    )
    .await;
    relay.terminate();
    assert_eq!(count_status(&db.pool, "dead").await, 0);
    let spent = switchyard_tests::postgres::spent_attempts(&db.pool).await;
    assert_eq!(spent, 0, "the rotation spent no attempt");
    let tokens = web_identity_tokens(&recording);
    let switched = tokens
        .iter()
        .position(|t| *t == second)
        .expect("the second token sent");
    assert!(
        tokens[switched..].iter().all(|t| *t == second),
        "after the file changed, only the new token: {tokens:?}"
    );
    let received = moto
        .receive(&url, before.len() + after.len(), Duration::from_secs(60))
        .await;
    assert_eq!(
        received.len(),
        before.len() + after.len(),
        "every event in the queue"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    for token in [&first, &second] {
        assert!(!text.contains(token.as_str()), "a token in the log");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A wrong secret: the target is not ready, `/readyz` and the log say the
/// service refused the signature, and the secret is nowhere in them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_named_and_never_shown() {
    init_logging();
    let db = fresh_db().await;
    let (moto, key) = checking_moto().await;
    let wrong = format!("wrong-{}", uuid::Uuid::new_v4().simple());
    let dir = std::env::temp_dir().join(unique("sy-aws-wrong"));
    std::fs::create_dir_all(&dir).unwrap();
    let secret_file = dir.join("secret");
    std::fs::write(&secret_file, format!("{wrong}\n")).unwrap();
    let target = Target::of("sqs")
        .set("region", switchyard_tests::aws::REGION)
        .set("endpoint_url", moto.url.as_str())
        .set("access_key_id", key.id.as_str())
        .set(
            "secret_access_key",
            switchyard_tests::config::table(&[("file", switchyard_tests::config::path(&secret_file))]),
        );
    let (config, admin) = switchyard_tests::with_admin(&to_aws(&db.url, target, "q").toml());
    let log = dir.join("relay.log");
    let mut relay =
        switchyard_tests::relay::Process::spawn_logged_with(SWITCHYARD, &config, "wrong", "debug", &log, &[]);
    let body = switchyard_tests::readyz_unready(admin, &["SignatureDoesNotMatch"]).await;
    relay.terminate();
    let text = std::fs::read_to_string(&log).unwrap();
    for shown in [&body, &text] {
        assert!(!shown.contains(&wrong), "the wrong secret shown");
    }
    assert!(body.contains("refused the credentials"), "{body}");
    let _ = std::fs::remove_dir_all(dir);
}
