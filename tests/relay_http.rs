//! The HTTP webhook target against a real receiver over TLS with the test
//! CA's certificate, which checks every signature with the Standard
//! Webhooks reference implementation: a service's events arrive once, in
//! order per aggregate, signed; a receiver down, then answering 503, then
//! 429 with `Retry-After` costs no attempt and the wait is honoured; a 400
//! fails its events alone, named; two secrets sign every request during a
//! rotation; a topic outside the target's base URL fails its event and no
//! request is made; a client certificate and a rotated bearer token log in.

use std::collections::HashMap;
use std::time::Duration;

use switchyard_tests::config::{Plugin, Target, TestConfig, path, routes, table};
use switchyard_tests::orders::{Expected, tally};
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{Outbox, TestDb, all_published, count_status, fresh_db, tls_file};
use switchyard_tests::relay::{InProcess, RelaySection, parse};
use switchyard_tests::service::ServicePool;
use switchyard_tests::webhook::{Receiver, secret};
use switchyard_tests::workload::{Shape, write_events};
use switchyard_tests::{eventually, init_logging};

/// Every event to `topic` under the receiver, signed with `secrets`.
fn to_hooks(db: &str, receiver: &Receiver, topic: &str, target: Target) -> TestConfig {
    TestConfig::new(db)
        .database("max_connections", 8)
        .tuning(RelaySection::new().set("batch_size", "100"))
        .plugin(
            Plugin::new("fanout", &plugin("fan_out"))
                .config("default", routes(&[("hooks", topic, Some("{aggregate_id}"))])),
        )
        .target(
            "hooks",
            target
                .set("base_url", format!("{}/in", receiver.url))
                .set("tls", table(&[("root_cert", tls_file("ca.pem").into())])),
        )
}

fn secrets(values: &[&str]) -> toml::Value {
    toml::Value::Array(
        values
            .iter()
            .map(|s| toml::Value::String((*s).to_string()))
            .collect(),
    )
}

async fn spent(db: &TestDb) -> i64 {
    switchyard_tests::postgres::spent_attempts(&db.pool).await
}

fn assert_once_in_order(receiver: &Receiver, expected: &HashMap<String, Expected>) {
    let tally = tally(&receiver.delivered(), expected);
    assert_eq!(
        (tally.lost, tally.duplicates, tally.reordered, tally.unknown),
        (0, 0, 0, 0),
        "{tally:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_services_events_arrive_once_in_order_each_signed_as_the_specification_says() {
    init_logging();
    let db = fresh_db().await;
    let key = secret();
    let receiver = Receiver::start(true, false, &[&key]).await;
    let config = to_hooks(
        &db.url,
        &receiver,
        "orders",
        Target::of("http").set("signing_secrets", secrets(&[&key])),
    );
    let relay = InProcess::start(&parse(&config.toml())).await;
    let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 30, 300, 2, 3).await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_once_in_order(&receiver, &expected);
    for request in receiver.requests().into_iter().filter(|r| r.method != "HEAD") {
        assert_eq!(
            (request.method.as_str(), request.path.as_str()),
            ("POST", "/in/orders")
        );
        assert_eq!(
            request.verified,
            [true],
            "the reference implementation verifies it: {:?}",
            request.headers
        );
        assert_eq!(
            request.headers.get("webhook-id"),
            request.headers.get("switchyard-event-id")
        );
        assert_eq!(
            request.headers.get("content-type").map(String::as_str),
            Some("application/json")
        );
        assert!(
            request
                .headers
                .get("traceparent")
                .is_some_and(|t| t.starts_with("00-"))
        );
    }
}

/// The receiver killed for 30 s, then answering 503 for 30 s, then 429
/// with `Retry-After: 5` once, while a service writes: nothing dead, no
/// attempt spent, every event once and in order, no request within the
/// five seconds the receiver asked for, and the first delivery soon after
/// it answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_then_503_then_429_with_retry_after_costs_no_attempt_and_the_wait_is_kept() {
    init_logging();
    let _alone = switchyard_tests::exclusive().await;
    let db = fresh_db().await;
    let key = secret();
    let mut receiver = Receiver::start(true, false, &[&key]).await;
    let config = to_hooks(
        &db.url,
        &receiver,
        "orders",
        Target::of("http").set("signing_secrets", secrets(&[&key])),
    )
    .tuning(
        RelaySection::quick()
            .set("max_attempts", "2")
            .set("publish_timeout_ms", "3000")
            .set("lease_duration_ms", "60000"),
    );
    let relay = InProcess::start(&parse(&config.toml())).await;
    let pool: ServicePool = (&db.pool).into();
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = switchyard_tests::workload::paced_writer(
        &db.pool,
        Shape::rows(Outbox::Switchyard),
        20,
        10,
        stop.clone(),
    );
    eventually(
        "events delivered before the outage",
        Duration::from_secs(30),
        || async { (count_status(&db.pool, "published").await > 0).then_some(()) },
    )
    .await;
    receiver.kill();
    tokio::time::sleep(Duration::from_secs(30)).await;
    receiver.plan(&serde_json::json!({"status": 503}));
    receiver.resume().await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    receiver.plan(&serde_json::json!({"status": 429, "retry_after": 5}));
    eventually("a 429 answered", Duration::from_secs(30), || async {
        receiver.requests().iter().any(|r| r.status == 429).then_some(())
    })
    .await;
    receiver.plan(&serde_json::json!({"status": 200}));
    let back = pool.now().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    let expected = writer.await.unwrap();
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0, "nothing dead-lettered");
    assert_eq!(spent(&db).await, 0, "the outage spent no attempt");
    // A request the receiver took as it was killed, its answer lost, is
    // sent again: at least once, the receiver drops it by webhook-id.
    let tally = tally(&receiver.delivered(), &expected);
    assert_eq!(
        (tally.lost, tally.reordered, tally.unknown),
        (0, 0, 0),
        "{tally:?}"
    );
    assert!(
        tally.duplicates <= 16,
        "at most the requests in flight at the kill: {tally:?}"
    );
    let requests = receiver.requests();
    let last_429 = requests
        .iter()
        .filter(|r| r.status == 429)
        .map(|r| r.time)
        .fold(0.0, f64::max);
    let next = requests
        .iter()
        .filter(|r| r.time > last_429)
        .map(|r| r.time)
        .fold(f64::MAX, f64::min);
    eprintln!("the request after the 429 came {:.2} s later", next - last_429);
    // A whole second of slack: the receiver's clock stamps its end of the
    // request, and Retry-After counts whole seconds.
    assert!(
        next - last_429 >= 4.0,
        "Retry-After 5 kept: {:.2} s",
        next - last_429
    );
    let first = pool
        .first_publish_since(back, back)
        .await
        .expect("delivered after the return");
    eprintln!("first delivery {first:.3} s after the receiver answered 200 again");
    assert!(first < 15.0, "first delivery {first:.1} s after the return");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_to_one_event_type_dead_letters_those_with_status_and_body_and_the_rest_flow() {
    init_logging();
    let db = fresh_db().await;
    let receiver = Receiver::start(true, false, &[]).await;
    receiver.plan(&serde_json::json!({"rules": [
        {"header": "Switchyard-Event-Type", "equals": "OrderShipped", "status": 400,
         "body": "{\"error\":\"shipping is not ours\",\"order\":{\"customer\":{\"email\":\"ada@example.com\"}}}"}
    ]}));
    // The refusal quotes the event: a masked field is hidden in the dead letter.
    let config = to_hooks(&db.url, &receiver, "orders", Target::of("http")).set(
        "admin",
        "mask_fields",
        switchyard_tests::config::strings(&["email"]),
    );
    let relay = InProcess::start(&parse(&config.toml())).await;
    let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 20, 150, 1, 9).await;
    eventually("every event settled", Duration::from_secs(120), || async {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM switchyard_outbox WHERE status NOT IN ('published', 'dead')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (open == 0).then_some(())
    })
    .await;
    relay.stop().await;
    let dead: Vec<(String, String)> = sqlx::query_as(
        "SELECT event_type, coalesce(last_error, '') FROM switchyard_outbox WHERE status = 'dead'",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(!dead.is_empty());
    let shipped = expected
        .values()
        .filter(|e| e.event_type == "OrderShipped")
        .count();
    // An aggregate's later events go on past its dead one (the default): none of another type is dead.
    for (event_type, error) in &dead {
        assert_eq!(event_type, "OrderShipped", "{error}");
        assert!(
            error.contains("400") && error.contains("shipping is not ours"),
            "{error}"
        );
        assert!(
            error.contains(r#""email":"***""#) && !error.contains("ada@example.com"),
            "the masked field hidden: {error}"
        );
    }
    assert_eq!(
        dead.len(),
        shipped,
        "every OrderShipped dead-lettered, nothing else"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_secret_rotation_each_request_carries_both_signatures() {
    init_logging();
    let db = fresh_db().await;
    let (old, new) = (secret(), secret());
    // Two receivers' views of one endpoint: one verifies with the old
    // secret, one with the new; both must accept every request.
    let receiver = Receiver::start(true, false, &[&old, &new]).await;
    let dir = std::env::temp_dir().join(format!("sy-hook-secret-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("next");
    std::fs::write(&file, format!("{new}\n")).unwrap();
    let rotating = table(&[("file", path(&file)), ("refresh_seconds", 1.into())]);
    let config = to_hooks(
        &db.url,
        &receiver,
        "orders",
        Target::of("http").set(
            "signing_secrets",
            toml::Value::Array(vec![old.clone().into(), rotating]),
        ),
    );
    let relay = InProcess::start(&parse(&config.toml())).await;
    let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 10, 60, 1, 4).await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(60)).await;
    // The rotation ends: the file's secret changes, the old one is dropped
    // by the receiver.
    let newest = secret();
    std::fs::write(&file, format!("{newest}\n")).unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 10, 30, 1, 5).await;
    all_published(
        &db.pool,
        (expected.len() + after.len()) as i64,
        Duration::from_secs(60),
    )
    .await;
    relay.stop().await;
    let requests: Vec<_> = receiver
        .requests()
        .into_iter()
        .filter(|r| r.method != "HEAD")
        .collect();
    let (during, later): (Vec<_>, Vec<_>) = requests.iter().partition(|r| {
        expected.contains_key(
            r.headers
                .get("switchyard-event-id")
                .map(String::as_str)
                .unwrap_or_default(),
        )
    });
    assert!(
        during.iter().all(|r| r.verified == [true, true]),
        "both secrets verify every request"
    );
    // After the file changed, the second signature is made with the newest
    // secret: the receiver's `new` no longer verifies, `old` still does.
    assert!(!later.is_empty() && later.iter().all(|r| r.verified == [true, false]));
    assert!(
        later
            .iter()
            .all(|r| r.headers["webhook-signature"].split(' ').count() == 2)
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_outside_the_base_url_fails_its_event_named_and_no_request_is_made() {
    init_logging();
    let db = fresh_db().await;
    let receiver = Receiver::start(true, false, &[]).await;
    let config = to_hooks(&db.url, &receiver, "../admin/{event_type}", Target::of("http"));
    let relay = InProcess::start(&parse(&config.toml())).await;
    let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 3, 6, 1, 6).await;
    eventually("the events dead-lettered", Duration::from_secs(60), || async {
        (count_status(&db.pool, "dead").await > 0).then_some(())
    })
    .await;
    relay.stop().await;
    let error: String =
        sqlx::query_scalar("SELECT last_error FROM switchyard_outbox WHERE status = 'dead' LIMIT 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(
        error.contains(".. segments") && error.contains("base_url"),
        "{error}"
    );
    assert!(!expected.is_empty());
    assert!(
        receiver.requests().iter().all(|r| r.method == "HEAD"),
        "no request was made but the health check's"
    );
}

/// mTLS with the test CA's client certificate, and a bearer token read
/// from a file that rotates under the running relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_and_a_rotated_bearer_token_log_the_relay_in() {
    init_logging();
    let db = fresh_db().await;
    let receiver = Receiver::start(true, true, &[]).await;
    let dir = std::env::temp_dir().join(format!("sy-hook-token-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "token-one\n").unwrap();
    let target = Target::of("http").set(
        "bearer_token",
        table(&[("file", path(&file)), ("refresh_seconds", 1.into())]),
    );
    let config = to_hooks(&db.url, &receiver, "orders", target).target_set(
        "hooks",
        "tls",
        table(&[
            ("root_cert", tls_file("ca.pem").into()),
            ("client_cert", tls_file("client.pem").into()),
            ("client_key", tls_file("client.key").into()),
        ]),
    );
    let relay = InProcess::start(&parse(&config.toml())).await;
    let first = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 5, 20, 1, 7).await;
    all_published(&db.pool, first.len() as i64, Duration::from_secs(60)).await;
    std::fs::write(&file, "token-two\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 5, 20, 1, 8).await;
    all_published(
        &db.pool,
        (first.len() + second.len()) as i64,
        Duration::from_secs(60),
    )
    .await;
    relay.stop().await;
    let tokens: Vec<String> = receiver
        .requests()
        .iter()
        .filter(|r| r.method != "HEAD")
        .map(|r| r.headers.get("authorization").cloned().unwrap_or_default())
        .collect();
    assert!(
        tokens.iter().take(first.len()).all(|t| t == "Bearer token-one"),
        "{tokens:?}"
    );
    assert_eq!(tokens.last().map(String::as_str), Some("Bearer token-two"));
    let _ = std::fs::remove_dir_all(dir);
}

/// Batches: a JSON array of envelopes, then CloudEvents' batch format, each
/// request signed and answering for all of its events; every event once, in
/// order per aggregate, as a consumer reads the batches one after another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_as_a_json_array_and_as_cloudevents_carry_every_event_once_in_order() {
    init_logging();
    for format in ["json_array", "cloudevents"] {
        let db = fresh_db().await;
        let key = secret();
        let receiver = Receiver::start(true, false, &[&key]).await;
        let config = to_hooks(
            &db.url,
            &receiver,
            "orders",
            Target::of("http")
                .set("batch", format)
                .set("max_batch", 20)
                .set("signing_secrets", secrets(&[&key])),
        );
        let relay = InProcess::start(&parse(&config.toml())).await;
        let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 30, 200, 2, 11).await;
        all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
        relay.stop().await;
        let requests: Vec<_> = receiver
            .requests()
            .into_iter()
            .filter(|r| r.method == "POST")
            .collect();
        assert!(
            requests.iter().all(|r| r.verified == [true]),
            "{format}: every batch signed"
        );
        assert!(
            requests.len() < expected.len(),
            "{format}: several events a request"
        );
        // Each batch's items as messages, in the order they were sent.
        let mut messages = Vec::new();
        for request in &requests {
            let items: Vec<serde_json::Value> = serde_json::from_slice(&request.body).unwrap();
            assert!(items.len() <= 20, "{format}: at most max_batch");
            for item in items {
                let (id, payload) = if format == "cloudevents" {
                    (item["id"].as_str().unwrap().to_string(), item["data"].clone())
                } else {
                    (
                        item["headers"]["Switchyard-Event-Id"]
                            .as_str()
                            .unwrap()
                            .to_string(),
                        item["payload"].clone(),
                    )
                };
                messages.push(switchyard_tests::nats::Received {
                    subject: "orders".into(),
                    headers: HashMap::from([("Switchyard-Event-Id".to_string(), id)]),
                    payload: payload.to_string().into_bytes(),
                });
            }
        }
        let tally = tally(&messages, &expected);
        assert_eq!(
            (tally.lost, tally.duplicates, tally.reordered, tally.unknown),
            (0, 0, 0, 0),
            "{format}: {tally:?}"
        );
    }
}
