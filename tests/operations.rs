//! Operations: the admin endpoint's metrics agree with the outbox, and
//! readiness follows the database and the targets.

use std::time::Duration;

use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::write_orders;
use switchyard_tests::postgres::{count_status, fresh_db};
use switchyard_tests::relay::{InProcess, Settings, example_config, parse};
use switchyard_tests::{eventually, http_get, init_logging};
use tokio_util::sync::CancellationToken;

/// The value of one sample line `name{labels} value` (labels as written), or 0.
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |value| value.trim().parse().expect("sample value"))
}

/// The example relay, with its admin endpoint on a free port.
async fn start_with_admin(
    db: &str,
    nats: &str,
) -> (InProcess, switchyard::admin::AdminServer, CancellationToken) {
    let relay = InProcess::start(&parse(&example_config(&Settings::new(db, nats)))).await;
    let stop = CancellationToken::new();
    let admin = switchyard::admin::serve("127.0.0.1:0", relay.relay.clone(), stop.clone())
        .await
        .unwrap();
    (relay, admin, stop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_was_published() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let (relay, admin, stop) = start_with_admin(&db.url, &nats.url()).await;

    write_orders(&db.pool, 30, 10, 3).await;
    sqlx::query("INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('invoice', 'i-1', 'InvoiceSent', '{}')")
        .execute(&db.pool)
        .await
        .unwrap();
    eventually("300 published and 1 dead", Duration::from_secs(60), || async {
        (count_status(&db.pool, "published").await == 300 && count_status(&db.pool, "dead").await == 1)
            .then_some(())
    })
    .await;

    // Scraped while the relay runs.
    let (status, metrics) = http_get(admin.local_addr, "/metrics").await;
    assert_eq!(status, 200);
    let published_by_plugin = sample(
        &metrics,
        r#"switchyard_events_total{outcome="published",plugin="router"}"#,
    ) + sample(
        &metrics,
        r#"switchyard_events_total{outcome="published",plugin="redact"}"#,
    );
    let in_db: i64 = count_status(&db.pool, "published").await;
    assert_eq!(published_by_plugin, in_db as f64, "{metrics}");
    assert_eq!(
        sample(
            &metrics,
            r#"switchyard_messages_published_total{target="events"}"#
        ),
        300.0
    );
    assert_eq!(
        sample(
            &metrics,
            r#"switchyard_events_total{outcome="dead_lettered",plugin="none"}"#
        ),
        1.0
    );
    let claimed = sample(&metrics, r#"switchyard_events_claimed_total{plugin="router"}"#)
        + sample(&metrics, r#"switchyard_events_claimed_total{plugin="redact"}"#)
        + sample(&metrics, r#"switchyard_events_claimed_total{plugin="none"}"#);
    assert_eq!(claimed, 301.0);
    assert_eq!(
        sample(&metrics, "switchyard_commit_to_publish_seconds_count"),
        300.0
    );
    assert!(sample(&metrics, "switchyard_batch_size_count") >= 1.0);
    assert_eq!(
        sample(
            &metrics,
            r#"switchyard_plugin_call_seconds_count{plugin="router"}"#
        ) + sample(
            &metrics,
            r#"switchyard_plugin_call_seconds_count{plugin="redact"}"#
        ),
        300.0
    );
    assert_eq!(sample(&metrics, "switchyard_backlog_rows"), 0.0);
    assert_eq!(
        sample(&metrics, r#"switchyard_plugin_reloads_total{plugin="router"}"#),
        0.0
    );
    assert!(
        metrics.contains(r#"switchyard_plugin_reloads_rejected_total{plugin="redact"} 0"#),
        "{metrics}"
    );

    let (status, body) = http_get(admin.local_addr, "/healthz").await;
    assert_eq!((status, body.trim()), (200, "ok"));
    stop.cancel();
    admin.stopped().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_database_and_the_targets() {
    init_logging();
    let db = fresh_db().await;
    let mut nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let (relay, admin, stop) = start_with_admin(&db.url, &nats.url()).await;
    let readyz = || async {
        let (status, body) = http_get(admin.local_addr, "/readyz").await;
        (
            status,
            serde_json::from_str::<serde_json::Value>(&body).expect("JSON body"),
        )
    };

    let (status, body) = readyz().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["targets"]["events"], "ok");
    assert!(body["plugins"]["router"].as_str().unwrap().starts_with("router@"));

    nats.stop();
    let body = eventually("not ready without NATS", Duration::from_secs(30), || async {
        let (status, body) = readyz().await;
        (status == 503).then_some(body)
    })
    .await;
    assert_eq!(body["database"], "ok");
    assert!(
        body["targets"]["events"].as_str().unwrap().starts_with("error"),
        "{body}"
    );
    nats.resume().await;
    eventually("ready again with NATS", Duration::from_secs(30), || async {
        (readyz().await.0 == 200).then_some(())
    })
    .await;

    // The database goes away: no new connections, existing ones cut.
    let admin_pool = switchyard_tests::postgres::server_pool().await;
    sqlx::query(&format!(
        "ALTER DATABASE {} WITH ALLOW_CONNECTIONS false",
        db.name
    ))
    .execute(&admin_pool)
    .await
    .unwrap();
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
        .bind(&db.name)
        .execute(&admin_pool)
        .await
        .unwrap();
    let body = eventually(
        "not ready without the database",
        Duration::from_secs(30),
        || async {
            let (status, body) = readyz().await;
            (status == 503).then_some(body)
        },
    )
    .await;
    assert!(body["database"].as_str().unwrap().starts_with("error"), "{body}");
    sqlx::query(&format!("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true", db.name))
        .execute(&admin_pool)
        .await
        .unwrap();
    eventually(
        "ready again with the database",
        Duration::from_secs(30),
        || async { (readyz().await.0 == 200).then_some(()) },
    )
    .await;

    stop.cancel();
    admin.stopped().await;
    relay.stop().await;
}
