//! The Redis Streams target against Debian's redis-server: over TLS with an
//! ACL user, a service's events arrive once, in order per aggregate, the
//! payload and every header as fields; killed and frozen for 30 s under
//! load, nothing is dead, lost or reordered; a password rotated under the
//! relay is taken up; a fan-out to NATS, a webhook and Redis with Redis
//! down goes on to the others; a Redis Cluster of three nodes takes streams
//! in several slots.

use std::collections::HashMap;
use std::time::Duration;

use switchyard_tests::config::{Plugin, Target, TestConfig, routes, table};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, tally};
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{Outbox, TestDb, all_published, count_status, fresh_db, tls_file};
use switchyard_tests::redis::RedisServer;
use switchyard_tests::relay::{InProcess, RelaySection, parse};
use switchyard_tests::service::ServicePool;
use switchyard_tests::webhook::Receiver;
use switchyard_tests::workload::{Shape, write_events};
use switchyard_tests::{eventually, init_logging};

fn stream() -> String {
    format!("orders-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

fn to_redis(db: &str, target: Target, stream: &str) -> TestConfig {
    TestConfig::new(db)
        .database("max_connections", 8)
        .tuning(RelaySection::new().set("batch_size", "100"))
        .plugin(
            Plugin::new("fanout", &plugin("fan_out"))
                .config("default", routes(&[("redis", stream, Some("{aggregate_id}"))])),
        )
        .target("redis", target)
}

fn assert_once_in_order(received: &[switchyard_tests::nats::Received], expected: &HashMap<String, Expected>) {
    let tally = tally(received, expected);
    assert_eq!(
        (tally.lost, tally.duplicates, tally.reordered, tally.unknown),
        (0, 0, 0, 0),
        "{tally:?}"
    );
}

async fn spent(db: &TestDb) -> i64 {
    switchyard_tests::postgres::spent_attempts(&db.pool).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_with_an_acl_user_each_event_arrives_once_in_order_with_its_fields() {
    init_logging();
    let db = fresh_db().await;
    let redis = RedisServer::shared();
    let stream = stream();
    let config = to_redis(&db.url, redis.target(), &stream);
    let relay = InProcess::start(&parse(&config.toml())).await;
    let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 30, 300, 2, 3).await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    let entries = redis.entries(&stream).await;
    assert_once_in_order(&entries, &expected);
    for entry in &entries {
        let want = &expected[entry.header("Switchyard-Event-Id").expect("the event id field")];
        assert_eq!(entry.header("Switchyard-Key"), Some(want.aggregate_id.as_str()));
        assert_eq!(entry.json()["seq"], want.seq);
        assert!(entry.header("traceparent").is_some_and(|t| t.starts_with("00-")));
    }
}

/// The ACL line of the book's page (targets/redis.md), as written there,
/// makes a user the relay needs nothing beyond, trimming included; that
/// user is refused reading the stream and writing outside `orders*`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_books_acl_user_relays_with_trimming_and_may_do_nothing_else() {
    init_logging();
    let page = std::fs::read_to_string(switchyard_tests::workspace_root().join("docs/src/targets/redis.md"))
        .expect("the Redis page");
    let line = page
        .lines()
        .find(|line| line.starts_with("ACL SETUSER "))
        .expect("the page's ACL SETUSER line");
    let user = format!("relay-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let password = format!("pw-{}", uuid::Uuid::new_v4().simple());
    let mut words: Vec<String> = line.split_whitespace().map(str::to_string).collect();
    assert_eq!(
        (words[2].as_str(), words[4].as_str()),
        ("relay", ">long-random-password"),
        "the page's line: {line}"
    );
    words[2] = user.clone();
    words[4] = format!(">{password}");
    let redis = RedisServer::shared();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    redis.command(&words).await.expect("the page's ACL line");

    let stream = stream();
    let dir = std::env::temp_dir().join(format!("sy-redis-acl-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let password_file = dir.join("password");
    std::fs::write(&password_file, format!("{password}\n")).unwrap();
    for trim in [("maxlen", 100_000), ("minid_age_seconds", 3_600)] {
        let db = fresh_db().await;
        let target = redis
            .target()
            .set("user", user.as_str())
            .set(
                "password",
                table(&[("file", password_file.display().to_string().into())]),
            )
            .set(trim.0, trim.1);
        let config =
            to_redis(&db.url, target, &stream).tuning(RelaySection::quick().set("max_attempts", "2"));
        let relay = InProcess::start(&parse(&config.toml())).await;
        let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 10, 60, 1, 1).await;
        all_published(&db.pool, expected.len() as i64, Duration::from_secs(60)).await;
        relay.stop().await;
        assert_eq!(count_status(&db.pool, "dead").await, 0, "{trim:?}");
        assert_eq!(spent(&db).await, 0, "{trim:?}: no attempt refused");
        let entries: Vec<_> = redis
            .entries(&stream)
            .await
            .into_iter()
            .filter(|entry| {
                entry
                    .header("Switchyard-Event-Id")
                    .is_some_and(|id| expected.contains_key(id))
            })
            .collect();
        assert_once_in_order(&entries, &expected);
    }
    let other = format!("ledger-{}", uuid::Uuid::new_v4().simple());
    for refused in [
        vec!["GET", stream.as_str()],
        vec!["XREAD", "COUNT", "1", "STREAMS", stream.as_str(), "0"],
        vec!["XADD", other.as_str(), "*", "payload", "x"],
    ] {
        let answer = redis.command_as(&user, &password, &refused).await;
        assert!(
            answer
                .as_ref()
                .is_err_and(|e| e.to_uppercase().contains("NOPERM")),
            "{refused:?} as the page's user: {answer:?}"
        );
    }
    let _ = redis.command(&["ACL", "DELUSER", &user]).await;
    let _ = redis.command(&["DEL", &stream]).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Redis away for 30 s under load, killed (its append-only file keeps what
/// it acknowledged) or frozen: nothing dead, no attempt spent, every event
/// there once (a write cut at the kill may be there twice: Redis keeps no
/// deduplication) and in order.
async fn away_under_load(frozen: bool) {
    init_logging();
    let _alone = switchyard_tests::exclusive().await;
    let db = fresh_db().await;
    let mut redis = RedisServer::own().await;
    let stream = stream();
    let config = to_redis(&db.url, redis.target(), &stream).tuning(
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
        20,
        stop.clone(),
    );
    eventually(
        "events published before the outage",
        Duration::from_secs(30),
        || async { (count_status(&db.pool, "published").await > 0).then_some(()) },
    )
    .await;
    if frozen {
        redis.freeze();
    } else {
        redis.kill();
    }
    eventually(
        "rows waiting on Redis, no attempt spent",
        Duration::from_secs(60),
        || async { (pool.waiting_without_attempts("redis").await > 0).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    let resuming = pool.now().await;
    if frozen {
        redis.thaw();
    } else {
        redis.start().await;
    }
    let back = pool.now().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.cancel();
    let expected = writer.await.unwrap();
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    let first = pool
        .first_publish_since(resuming, back)
        .await
        .expect("published after the return");
    eprintln!(
        "redis: first publish {first:.3} s after the return; {} events",
        expected.len()
    );
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0, "nothing dead-lettered");
    assert_eq!(spent(&db).await, 0, "the outage spent no attempt");
    assert!(first < 10.0, "first publish {first:.1} s after the return");
    let tally = tally(&redis.entries(&stream).await, &expected);
    assert_eq!(
        (tally.lost, tally.reordered, tally.unknown),
        (0, 0, 0),
        "{tally:?}"
    );
    assert!(
        tally.duplicates <= 20,
        "at most one a aggregate in flight at the cut: {tally:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_for_30_s_under_load_costs_no_attempt_and_loses_nothing() {
    away_under_load(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_frozen_for_30_s_under_load_costs_no_attempt_and_loses_nothing() {
    away_under_load(true).await;
}

/// The ACL user's password changes on the server and in the file the relay
/// reads, and the sessions of the old one are cut: the relay logs in again
/// with the new one, no event spends an attempt or is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_rotated_under_the_relay_is_taken_up() {
    init_logging();
    let db = fresh_db().await;
    let mut redis = RedisServer::own().await;
    let stream = stream();
    let config =
        to_redis(&db.url, redis.target(), &stream).tuning(RelaySection::quick().set("max_attempts", "2"));
    let relay = InProcess::start(&parse(&config.toml())).await;
    let first = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 10, 60, 1, 1).await;
    all_published(&db.pool, first.len() as i64, Duration::from_secs(60)).await;
    redis
        .rotate(&format!("pw-{}", uuid::Uuid::new_v4().simple()))
        .await;
    let second = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 10, 60, 1, 2).await;
    all_published(
        &db.pool,
        (first.len() + second.len()) as i64,
        Duration::from_secs(60),
    )
    .await;
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0);
    assert_eq!(spent(&db).await, 0, "the rotation spent no attempt");
    // Each writer's events on their own (the second writes the same
    // aggregates from their first sequence number again).
    let entries = redis.entries(&stream).await;
    for (expected, other) in [(&first, &second), (&second, &first)] {
        let tally = tally(&entries, expected);
        assert_eq!(
            (tally.lost, tally.duplicates, tally.reordered, tally.unknown),
            (0, 0, 0, other.len()),
            "{tally:?}"
        );
    }
}

/// One event to NATS, a webhook and Redis at once, Redis down: each
/// aggregate's first event reaches NATS and the webhook, its later ones wait
/// on Redis alone, spending nothing, and everything arrives on its return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fan_out_to_nats_a_webhook_and_redis_with_redis_down_gets_everything_everywhere() {
    init_logging();
    let db = fresh_db().await;
    let mut redis = RedisServer::own().await;
    let nats = NatsServer::start().await;
    nats.create_stream("AUDIT", &["audit.>"]).await;
    let receiver = Receiver::start(true, false, &[]).await;
    let stream = stream();
    let config = TestConfig::new(&db.url)
        .database("max_connections", 8)
        .tuning(RelaySection::quick().set("max_attempts", "2"))
        .plugin(Plugin::new("fanout", &plugin("fan_out")).config(
            "default",
            routes(&[
                ("redis", &stream, Some("{aggregate_id}")),
                ("audit", "audit.orders.{event_type}", None),
                ("hooks", "orders", None),
            ]),
        ))
        .target("redis", redis.target())
        .target("audit", Target::nats(&nats.url()))
        .target(
            "hooks",
            Target::of("http")
                .set("base_url", format!("{}/in", receiver.url))
                .set("tls", table(&[("root_cert", tls_file("ca.pem").into())])),
        );
    let relay = InProcess::start(&parse(&config.toml())).await;
    redis.kill();
    let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 15, 90, 1, 4).await;
    let aggregates = expected
        .values()
        .map(|e| e.aggregate_id.as_str())
        .collect::<std::collections::HashSet<_>>()
        .len();
    eventually(
        "each aggregate's first event on NATS and the webhook",
        Duration::from_secs(60),
        || async {
            (nats.stream_len("AUDIT").await >= aggregates as u64 && receiver.delivered().len() >= aggregates)
                .then_some(())
        },
    )
    .await;
    eventually("rows waiting on Redis alone", Duration::from_secs(60), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM switchyard_outbox WHERE status <> 'published' AND waiting_on = ARRAY['redis']",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        (waiting > 0).then_some(())
    })
    .await;
    redis.start().await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    assert_eq!(count_status(&db.pool, "dead").await, 0);
    assert_eq!(spent(&db).await, 0, "Redis's outage spent no attempt");
    assert_once_in_order(&redis.entries(&stream).await, &expected);
    assert_once_in_order(&nats.read_stream("AUDIT").await, &expected);
    assert_once_in_order(&receiver.delivered(), &expected);
}

/// A Redis Cluster of three nodes: the relay learns it from its nodes and
/// writes each stream (one an event type, so in several hash slots) where
/// its slot lives; every event arrives once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_of_three_nodes_takes_streams_in_several_slots() {
    init_logging();
    let db = fresh_db().await;
    let cluster = switchyard_tests::redis::RedisCluster::start(3).await;
    let prefix = stream();
    let config = to_redis(
        &db.url,
        Target::of("redis")
            .set("url", cluster.urls.as_str())
            .set("cluster", true),
        &format!("{prefix}.{{event_type}}"),
    );
    let relay = InProcess::start(&parse(&config.toml())).await;
    let expected = write_events(&db.pool, Shape::rows(Outbox::Switchyard), 20, 150, 1, 5).await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(120)).await;
    relay.stop().await;
    let types: std::collections::BTreeSet<&str> = expected.values().map(|e| e.event_type.as_str()).collect();
    let slots: std::collections::BTreeSet<String> = types
        .iter()
        .map(|t| cluster.slot_of(&format!("{prefix}.{t}")))
        .collect();
    assert!(slots.len() > 1, "the streams sit in several slots: {slots:?}");
    let mut entries = Vec::new();
    for event_type in &types {
        entries.extend(cluster.entries(&format!("{prefix}.{event_type}")).await);
    }
    // Order per aggregate holds per stream; across an aggregate's streams
    // the checker reads them one after another, so count each stream alone.
    let tally = tally(&entries, &expected);
    assert_eq!(
        (tally.lost, tally.duplicates, tally.unknown),
        (0, 0, 0),
        "{tally:?}"
    );
}
