//! Operations: the admin endpoint's metrics agree with the outbox, readiness
//! follows the database and the targets, `status --json` agrees with the
//! database, dead letters replay exactly once after a plugin fix, and
//! retention removes only old published rows.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use switchyard_tests::brokers::Broker;
use switchyard_tests::config::{Plugin, Target, TestConfig, routes, strings};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::write_orders;
use switchyard_tests::plugins::{plugin, replace_atomically};
use switchyard_tests::postgres::{all_published, count_status, fresh_db, fresh_db_before};
use switchyard_tests::relay::{InProcess, Process, RelaySection, Settings, example_config, parse};
use switchyard_tests::{cli, eventually, free_port, http_get, init_logging, readyz_answers, with_admin};

const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");
use tokio_util::sync::CancellationToken;

/// `switchyard status --json --config PATH`, parsed.
async fn status_json(config_path: &std::path::Path) -> serde_json::Value {
    let (code, out, err) = cli(
        SWITCHYARD,
        &["status", "--json", "--config", config_path.to_str().unwrap()],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    serde_json::from_str::<serde_json::Value>(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

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
        r#"switchyard_events_total{database="default",outcome="published",plugin="router"}"#,
    ) + sample(
        &metrics,
        r#"switchyard_events_total{database="default",outcome="published",plugin="redact"}"#,
    );
    let in_db: i64 = count_status(&db.pool, "published").await;
    assert_eq!(published_by_plugin, in_db as f64, "{metrics}");
    assert_eq!(
        sample(
            &metrics,
            r#"switchyard_messages_published_total{database="default",target="events"}"#
        ),
        300.0
    );
    assert_eq!(
        sample(
            &metrics,
            r#"switchyard_events_total{database="default",outcome="dead_lettered",plugin="none"}"#
        ),
        1.0
    );
    let claimed = sample(
        &metrics,
        r#"switchyard_events_claimed_total{database="default",plugin="router"}"#,
    ) + sample(
        &metrics,
        r#"switchyard_events_claimed_total{database="default",plugin="redact"}"#,
    ) + sample(
        &metrics,
        r#"switchyard_events_claimed_total{database="default",plugin="none"}"#,
    );
    assert_eq!(claimed, 301.0);
    assert_eq!(
        sample(
            &metrics,
            r#"switchyard_commit_to_publish_seconds_count{database="default"}"#
        ),
        300.0
    );
    assert!(sample(&metrics, r#"switchyard_batch_size_count{database="default"}"#) >= 1.0);
    assert_eq!(
        sample(
            &metrics,
            r#"switchyard_plugin_call_seconds_count{database="default",plugin="router"}"#
        ) + sample(
            &metrics,
            r#"switchyard_plugin_call_seconds_count{database="default",plugin="redact"}"#
        ),
        300.0
    );
    assert_eq!(
        sample(&metrics, r#"switchyard_backlog_rows{database="default"}"#),
        0.0
    );
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

/// A relay whose "router" plugin is the file at `plugin_path`, with `plugin_config`
/// as its config table, publishing to NATS target "events".
fn router_config(
    db: &str,
    nats: &str,
    plugin_path: &std::path::Path,
    plugin_config: &[(&str, &str)],
) -> TestConfig {
    let router = plugin_config
        .iter()
        .fold(Plugin::new("router", plugin_path), |router, (key, value)| {
            router.config(key, *value)
        })
        .set("aggregate_types", strings(&["order"]));
    TestConfig::new(db)
        .database("max_connections", 8)
        .tuning(
            RelaySection::new()
                .set("batch_size", "100")
                .set("concurrency", "2")
                .set("poll_interval_ms", "100")
                .set("max_attempts", "5")
                .set("max_backoff_ms", "500"),
        )
        .set("plugin_runtime", "reload_debounce_ms", 20)
        .set("plugin_runtime", "cache", false)
        .plugin(router)
        .target("events", Target::nats(nats))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_after_a_plugin_fix_publishes_each_dead_letter_exactly_once() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let env = [("SWITCHYARD_DATABASE_URL", db.url.as_str())];

    // A broken plugin: every message names a target that does not exist.
    let broken = router_config(
        &db.url,
        &nats.url(),
        &plugin("misbehave"),
        &[("mode", "unknown-target"), ("target", "events")],
    )
    .toml();
    let relay = InProcess::start(&parse(&broken)).await;
    let expected = write_orders(&db.pool, 20, 3, 2).await;
    eventually("all 60 dead-lettered", Duration::from_secs(60), || async {
        (count_status(&db.pool, "dead").await == 60).then_some(())
    })
    .await;
    relay.stop().await;
    assert_eq!(nats.stream_len("ORDERS").await, 0);

    let (code, out, err) = cli(SWITCHYARD, &["dlq", "list", "--json", "--limit", "100"], &env).await;
    assert_eq!(code, 0, "{err}");
    let listed: Vec<serde_json::Value> = serde_json::from_str(&out).expect("dlq list --json");
    assert_eq!(listed.len(), 60);
    assert!(
        listed
            .iter()
            .all(|row| row["last_error"].as_str().unwrap().contains("no-such-target")),
        "{out}"
    );
    let (code, out, _) = cli(
        SWITCHYARD,
        &[
            "dlq",
            "list",
            "--error",
            "NO-SUCH",
            "--event-type",
            "OrderCreated",
        ],
        &env,
    )
    .await;
    assert_eq!(code, 0);
    assert_eq!(
        out.lines().filter(|l| l.contains("OrderCreated")).count(),
        20,
        "{out}"
    );

    // The fix ships: the relay restarts on route-by-type.
    let fixed = router_config(
        &db.url,
        &nats.url(),
        &plugin("route_by_type"),
        &[("target", "events"), ("topic", "orders.{event_type}")],
    )
    .toml();
    let relay = InProcess::start(&parse(&fixed)).await;
    let fixed_version = relay
        .relay
        .plugins()
        .slot("router")
        .unwrap()
        .current()
        .unwrap()
        .version()
        .to_string();

    // One event type first, then the rest; each replay waits for the outcome.
    let (code, out, err) = cli(
        SWITCHYARD,
        &[
            "dlq",
            "replay",
            "--event-type",
            "OrderCreated",
            "--wait-seconds",
            "60",
        ],
        &env,
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("Replayed 20 dead letter(s): 20 published, 0 dead again"),
        "{out}"
    );
    assert!(
        err.contains("replay: 20/20 back to pending"),
        "progress on stderr: {err}"
    );
    let (code, out, err) = cli(
        SWITCHYARD,
        &["dlq", "replay", "--all", "--wait-seconds", "60"],
        &env,
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("Replayed 40 dead letter(s): 40 published, 0 dead again"),
        "{out}"
    );
    let (code, out, _) = cli(SWITCHYARD, &["dlq", "replay", "--all"], &env).await;
    assert_eq!(code, 0);
    assert!(out.contains("No dead letters match"), "{out}");
    let (code, _, err) = cli(SWITCHYARD, &["dlq", "replay"], &env).await;
    assert_ne!(code, 0, "a replay without a selection is refused");
    assert!(err.contains("say which dead letters"), "{err}");
    relay.stop().await;

    let received = nats.read_stream("ORDERS").await;
    let mut seen = HashSet::new();
    for message in &received {
        let id = message.header("Switchyard-Event-Id").expect("event id header");
        assert!(seen.insert(id.to_string()), "event {id} published twice");
        assert!(expected.contains_key(id), "unexpected event {id}");
        assert_eq!(
            message.header("Switchyard-Plugin"),
            Some(format!("router@{fixed_version}").as_str()),
            "replayed through the current plugin version"
        );
    }
    assert_eq!(seen.len(), 60, "every dead letter published once");
    let versions: Vec<(String, i64)> = sqlx::query_as(
        "SELECT plugin_version, count(*) FROM switchyard_outbox WHERE status = 'published' GROUP BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(versions, [(fixed_version, 60)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_matches_the_database_and_the_running_relay() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let dir = std::env::temp_dir().join(format!("sy-status-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let plugin_path = dir.join("router.wasm");
    let good = std::fs::read(plugin("route_by_type")).unwrap();
    std::fs::write(&plugin_path, &good).unwrap();
    let admin = format!("127.0.0.1:{}", free_port());
    let config = router_config(
        &db.url,
        &nats.url(),
        &plugin_path,
        &[("target", "events"), ("topic", "orders.{event_type}")],
    )
    .set("admin", "listen", admin.as_str())
    .toml();
    let config_path = dir.join("relay.toml");
    std::fs::write(&config_path, &config).unwrap();

    // Rows in every state the relay leaves alone while the test reads them.
    let insert = |event_type: &'static str, status: &'static str, extra: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(&format!(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status {extra_cols})
                 VALUES ('order', gen_random_uuid()::text, $1, '{{}}', $2 {extra_vals})",
                extra_cols = if extra.is_empty() { "" } else { ", attempts, next_attempt_at, not_before, created_at, last_error" },
                extra_vals = extra,
            ))
            .bind(event_type)
            .bind(status)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    let future = ", 0, '-infinity', now() + interval '1 hour', now() - interval '90 seconds', NULL";
    let retrying =
        ", 2, now() + interval '1 hour', NULL, now() - interval '30 seconds', 'target \"events\": timed out'";
    let dead =
        ", 1, '-infinity', NULL, now() - interval '10 minutes', 'plugin refused permanently: bad order'";
    for _ in 0..5 {
        insert("OrderCreated", "pending", future).await;
    }
    for _ in 0..4 {
        insert("OrderPaid", "pending", retrying).await;
    }
    for _ in 0..3 {
        insert("OrderCreated", "dead", dead).await;
    }
    for _ in 0..2 {
        insert("OrderShipped", "dead", dead).await;
    }
    let _relay = switchyard_tests::relay::Process::spawn(SWITCHYARD, &config, "status-test");
    switchyard_tests::readyz_answers(admin.parse().unwrap(), 200).await;

    let status = || status_json(&config_path);
    let report = status().await;
    let outbox = &report["outbox"];
    let count = |sql: &'static str| {
        let pool = db.pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap() }
    };
    // Rows whose not_before is still ahead are delayed, counted apart.
    assert_eq!(
        outbox["pending"],
        count("SELECT count(*) FROM switchyard_outbox WHERE status = 'pending' AND coalesce(not_before <= now(), true)").await
    );
    assert_eq!(
        outbox["delayed"],
        count("SELECT count(*) FROM switchyard_outbox WHERE status = 'pending' AND not_before > now()").await
    );
    assert_eq!(
        (outbox["pending"].as_i64(), outbox["delayed"].as_i64()),
        (Some(4), Some(5)),
        "{report}"
    );
    assert_eq!(
        outbox["in_flight"],
        count("SELECT count(*) FROM switchyard_outbox WHERE status = 'in_flight'").await
    );
    assert_eq!(
        outbox["backlog"],
        count("SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')").await
    );
    assert_eq!(
        outbox["retrying"],
        count("SELECT count(*) FROM switchyard_outbox WHERE status = 'pending' AND attempts > 0").await
    );
    assert_eq!(outbox["backlog"], 9, "{report}");
    assert_eq!(outbox["retrying"], 4, "{report}");
    assert_eq!(
        outbox["dead"],
        count("SELECT count(*) FROM switchyard_outbox WHERE status = 'dead'").await
    );
    let by_type: BTreeMap<String, i64> =
        sqlx::query_as("SELECT event_type, count(*) FROM switchyard_outbox WHERE status = 'dead' GROUP BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(outbox["dead_by_event_type"], serde_json::json!(by_type));
    assert_eq!(by_type.get("OrderCreated"), Some(&3));
    // The delayed rows (written 90 s ago) would make this grow until their
    // time comes; the oldest pending row is a retrying one, 30 s old.
    let oldest: f64 = sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM now() - min(created_at))::float8 FROM switchyard_outbox
          WHERE status IN ('pending', 'in_flight') AND coalesce(not_before <= now(), true)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let reported = outbox["oldest_pending_age_seconds"].as_f64().unwrap();
    assert!(
        (reported - oldest).abs() < 10.0 && (30.0..90.0).contains(&reported),
        "{reported} vs {oldest}"
    );

    let relay = &report["relay"];
    assert_eq!(relay["ready"], true, "{report}");
    let plugin_status = &relay["plugins"][0];
    let hash = switchyard::plugin::content_hash(&good);
    assert_eq!(plugin_status["name"], "router");
    assert_eq!(plugin_status["version"], hash.as_str());
    assert_eq!(plugin_status["last_reload"]["result"], "loaded");
    assert_eq!(relay["targets"][0]["name"], "events");
    assert_eq!(relay["targets"][0]["kind"], "nats");
    assert_eq!(relay["targets"][0]["healthy"], true);

    // A broken file is refused: the old version keeps serving, and status says why.
    replace_atomically(&plugin_path, b"not a component");
    let report = eventually(
        "the rejected reload in status",
        Duration::from_secs(30),
        || async {
            let report = status().await;
            (report["relay"]["plugins"][0]["last_reload"]["result"] == "rejected").then_some(report)
        },
    )
    .await;
    let plugin_status = &report["relay"]["plugins"][0];
    assert_eq!(plugin_status["version"], hash.as_str());
    assert_eq!(plugin_status["rejected"], 1);
    assert!(
        !plugin_status["last_reload"]["reason"]
            .as_str()
            .unwrap()
            .is_empty(),
        "{report}"
    );

    // The human form carries the same facts.
    let (code, text, _) = cli(
        SWITCHYARD,
        &["status", "--config", config_path.to_str().unwrap()],
        &[],
    )
    .await;
    assert_eq!(code, 0);
    assert!(
        text.contains("backlog         9 rows (4 pending, 5 delayed, 0 in flight)"),
        "{text}"
    );
    assert!(text.contains("in retry        4"), "{text}");
    assert!(text.contains("rejected"), "{text}");

    // Dead-letter tooling on the same rows: show, then purge (which asks first).
    let env = [("SWITCHYARD_DATABASE_URL", db.url.as_str())];
    let (_, out, _) = cli(
        SWITCHYARD,
        &["dlq", "list", "--json", "--event-type", "OrderShipped"],
        &env,
    )
    .await;
    let shipped: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(shipped.len(), 2);
    let id = shipped[0]["id"].to_string();
    let (code, out, _) = cli(SWITCHYARD, &["dlq", "show", &id], &env).await;
    assert_eq!(code, 0);
    assert!(
        out.contains(&format!("row {id}  (dead)")) && out.contains("plugin refused permanently: bad order"),
        "{out}"
    );
    let (code, _, err) = cli(
        SWITCHYARD,
        &["dlq", "purge", "--event-type", "OrderCreated"],
        &env,
    )
    .await;
    assert_ne!(code, 0);
    assert!(
        err.contains("refusing to delete 3 dead letter(s) without --yes"),
        "{err}"
    );
    assert_eq!(
        count_status(&db.pool, "dead").await,
        5,
        "nothing deleted without --yes"
    );
    let (code, out, _) = cli(
        SWITCHYARD,
        &["dlq", "purge", "--event-type", "OrderCreated", "--yes"],
        &env,
    )
    .await;
    assert_eq!(code, 0);
    assert!(out.contains("Deleted 3 dead letter(s)."), "{out}");
    let report = status().await;
    assert_eq!(
        report["outbox"]["dead_by_event_type"],
        serde_json::json!({ "OrderShipped": 2 })
    );
    assert_eq!(report["outbox"]["backlog"], 9, "purge touches dead letters only");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rows for retention: `old` published two hours ago, `recent` published
/// just now, and old rows in every other status.
async fn retention_rows(pg: Option<&sqlx::PgPool>, sqlite: Option<&sqlx::SqlitePool>) {
    let statements_pg = [
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at, created_at)
         SELECT 'order', 'old-' || n, 'OrderCreated', '{}', 'published', now() - interval '2 hours', now() - interval '3 hours'
           FROM generate_series(1, 25) n",
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at)
         SELECT 'order', 'recent-' || n, 'OrderCreated', '{}', 'published', now() - interval '10 minutes'
           FROM generate_series(1, 6) n",
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, created_at, not_before)
         SELECT 'order', 'other-' || n, 'OrderCreated', '{}', s, now() - interval '3 hours', now() + interval '1 hour'
           FROM generate_series(1, 2) n, unnest(ARRAY['dead', 'pending']) s",
    ];
    let now = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";
    let statements_sqlite = [
        format!("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 25)
         INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at, created_at)
         SELECT 'order', 'old-' || i, 'OrderCreated', '{{}}', 'published', {now} - 7200000, {now} - 10800000 FROM n"),
        format!("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 6)
         INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at)
         SELECT 'order', 'recent-' || i, 'OrderCreated', '{{}}', 'published', {now} - 600000 FROM n"),
        format!("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 2)
         INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, created_at, not_before)
         SELECT 'order', 'other-' || i || s, 'OrderCreated', '{{}}', s, {now} - 10800000, {now} + 3600000
           FROM n, (SELECT 'dead' AS s UNION ALL SELECT 'pending')"),
    ];
    if let Some(pool) = pg {
        for sql in statements_pg {
            sqlx::query(sql).execute(pool).await.unwrap();
        }
    }
    if let Some(pool) = sqlite {
        for sql in &statements_sqlite {
            sqlx::query(sql).execute(pool).await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_removes_only_published_rows_older_than_the_limit() {
    init_logging();
    let retention: switchyard::config::RetentionConfig =
        toml::from_str("published_max_age_seconds = 3600\nmode = \"archive\"\nbatch_size = 7").unwrap();
    let never = CancellationToken::new();

    // PostgreSQL, archive mode, in batches of 7.
    let db = fresh_db().await;
    let store = switchyard::OutboxStore::new(db.pool.clone());
    retention_rows(Some(&db.pool), None).await;
    let removed = switchyard::retention::pass(&store, &retention, None, &never)
        .await
        .unwrap();
    assert_eq!(removed, 25);
    let left: Vec<(String, String)> =
        sqlx::query_as("SELECT status, aggregate_id FROM switchyard_outbox ORDER BY status, aggregate_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(left.len(), 10, "{left:?}");
    assert!(left.iter().all(|(_, id)| !id.starts_with("old-")), "{left:?}");
    assert_eq!(
        left.iter().filter(|(s, _)| s == "dead").count(),
        2,
        "dead letters stay"
    );
    assert_eq!(left.iter().filter(|(s, _)| s == "pending").count(), 2);
    let archived: Vec<(String, bool)> = sqlx::query_as(
        "SELECT aggregate_id, published_at < now() - interval '1 hour' FROM switchyard_outbox_archive ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(archived.len(), 25);
    assert!(
        archived.iter().all(|(id, old)| id.starts_with("old-") && *old),
        "{archived:?}"
    );
    assert_eq!(
        switchyard::retention::pass(&store, &retention, None, &never)
            .await
            .unwrap(),
        0
    );

    // SQLite, delete mode.
    let retention = switchyard::config::RetentionConfig {
        mode: switchyard::store::RetentionMode::Delete,
        ..retention
    };
    let sqlite = switchyard_tests::outbox::TestOutbox::sqlite().await;
    let pool = sqlite.sqlite_pool();
    retention_rows(None, Some(&pool)).await;
    let removed = switchyard::retention::pass(&sqlite.store, &retention, None, &never)
        .await
        .unwrap();
    assert_eq!(removed, 25);
    let left: Vec<(String, String)> = sqlx::query_as("SELECT status, aggregate_id FROM switchyard_outbox")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left.len(), 10, "{left:?}");
    assert!(left.iter().all(|(_, id)| !id.starts_with("old-")), "{left:?}");
    let archived: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox_archive")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(archived, 0, "delete mode archives nothing");

    // MariaDB, archive mode.
    let retention = switchyard::config::RetentionConfig {
        mode: switchyard::store::RetentionMode::Archive,
        ..retention
    };
    let mariadb = switchyard_tests::outbox::TestOutbox::mariadb().await;
    mariadb
        .execute(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at, created_at)
             SELECT 'order', CONCAT('old-', seq), 'OrderCreated', '{}', 'published',
                    UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, NOW(6) - INTERVAL 3 HOUR FROM seq_1_to_25;
             INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at)
             SELECT 'order', CONCAT('recent-', seq), 'OrderCreated', '{}', 'published',
                    UTC_TIMESTAMP(6) - INTERVAL 10 MINUTE FROM seq_1_to_6;
             INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, created_at, not_before)
             SELECT 'order', CONCAT('other-', seq, s), 'OrderCreated', '{}', s,
                    NOW(6) - INTERVAL 3 HOUR, NOW(6) + INTERVAL 1 HOUR
               FROM seq_1_to_2, (SELECT 'dead' AS s UNION ALL SELECT 'pending') AS statuses",
        )
        .await;
    let removed = switchyard::retention::pass(&mariadb.store, &retention, None, &never)
        .await
        .unwrap();
    assert_eq!(removed, 25);
    assert_eq!(mariadb.scalar("SELECT count(*) FROM switchyard_outbox").await, 10);
    assert_eq!(
        mariadb
            .scalar("SELECT count(*) FROM switchyard_outbox WHERE aggregate_id LIKE 'old-%'")
            .await,
        0
    );
    assert_eq!(
        mariadb
            .scalar(
                "SELECT count(*) FROM switchyard_outbox_archive
                  WHERE aggregate_id LIKE 'old-%' AND published_at < UTC_TIMESTAMP(6) - INTERVAL 1 HOUR"
            )
            .await,
        25
    );
}

/// `validate` starts each plugin with its config, as the relay would: a
/// config only the plugin can judge (a topic template with a placeholder it
/// does not know) fails validation instead of the relay's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_runs_each_plugins_init_with_its_config() {
    let dir = std::env::temp_dir().join(format!("sy-validate-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, topic: &str| {
        let path = dir.join(name);
        let config = TestConfig::new(&format!("sqlite://{}", dir.join("outbox.db").display()))
            .plugin(
                Plugin::new("fanout", &plugin("fan_out")).config("default", routes(&[("out", topic, None)])),
            )
            .target("out", Target::stdout());
        std::fs::write(&path, config.toml()).unwrap();
        path.to_str().unwrap().to_string()
    };
    let good = write("good.toml", "orders.{event_type}");
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", &good], &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("good.toml: ok"), "{out}");

    let typo = write("typo.toml", "orders.{evnt_type}");
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", &typo], &[]).await;
    assert_ne!(code, 0, "{out}");
    assert!(!out.contains(": ok"), "{out}");
    assert!(
        err.contains("fanout") && err.contains("unknown placeholder {evnt_type}"),
        "names the plugin and what it refused: {err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `validate` compiles and starts each plugin once: the routing of its
/// sample events uses the version it loaded, not a second compile and
/// `init` (a Python plugin's start takes seconds).
#[tokio::test]
async fn validate_starts_each_plugin_once() {
    let dir = std::env::temp_dir().join(format!("sy-validate-once-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = TestConfig::new(&format!("sqlite://{}", dir.join("outbox.db").display()))
        .plugin(
            Plugin::new("fanout", &plugin("fan_out")).config("default", routes(&[("out", "orders", None)])),
        )
        .target("out", Target::stdout());
    let path = dir.join("relay.toml");
    std::fs::write(&path, config.toml()).unwrap();
    let output = tokio::process::Command::new(SWITCHYARD)
        .args(["validate", "--config", path.to_str().unwrap()])
        .env("SWITCHYARD_LOG", "switchyard=debug")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(output.status.success(), "{out}{err}");
    let started = format!("{out}{err}")
        .lines()
        .filter(|line| line.contains("Plugin compiled and its init passed") && line.contains("fanout"))
        .count();
    assert_eq!(started, 1, "the plugin started {started} times:\n{out}{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `validate` routes a sample event of each type a plugin serves, as the
/// relay would: a route to a target the config lacks fails validation,
/// naming the plugin, the event type and the target, instead of
/// dead-lettering every such event once the relay runs. A plugin that
/// refuses the sample is only noted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_names_a_target_a_plugin_routes_to_that_the_config_lacks() {
    let dir = std::env::temp_dir().join(format!("sy-routes-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, paid_target: &str| {
        let path = dir.join(name);
        let text = format!(
            "[database]\nurl = \"sqlite://{db}\"\n\n\
             [[plugins]]\nname = \"paid\"\npath = \"{route}\"\nevent_types = [\"OrderPaid\", \"OrderRefunded\"]\n\
             [plugins.config]\ntarget = \"{paid_target}\"\ntopic = \"orders.{{event_type}}\"\n\n\
             [[plugins]]\nname = \"rest\"\npath = \"{route}\"\n[plugins.config]\ntarget = \"out\"\n\n\
             [targets.out]\ntype = \"stdout\"\n",
            db = dir.join("outbox.db").display(),
            route = plugin("route_by_type").display(),
        );
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let good = write("good.toml", "out");
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--offline", "--config", &good], &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("good.toml: ok"), "{out}");

    let missing = write("missing.toml", "kafka");
    for offline in [true, false] {
        let args: &[&str] = if offline {
            &["validate", "--offline", "--config", &missing]
        } else {
            &["validate", "--config", &missing]
        };
        let (code, out, err) = cli(SWITCHYARD, args, &[]).await;
        assert_ne!(code, 0, "{out}");
        assert!(!out.contains(": ok"), "{out}");
        for event_type in ["OrderPaid", "OrderRefunded"] {
            assert!(
                err.contains(&format!("plugin \"paid\" routes {event_type} events"))
                    && err.contains("unknown target \"kafka\""),
                "names the plugin, the event type and the target: {err}"
            );
        }
        assert!(!err.contains("plugin \"rest\""), "{err}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `validate --offline`, a service manager's pre-start check, passes while
/// every database and broker is out of reach (at boot they may still be
/// coming up, and the relay waits for them) and still stops a start on a
/// plugin that refuses its config; plain `validate` names the unreachable
/// database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_offline_checks_config_and_plugins_without_the_network() {
    let dir = std::env::temp_dir().join(format!("sy-offline-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    // Port 1 on loopback: refused at once, nothing listens there.
    let write = |name: &str, topic: &str| {
        let path = dir.join(name);
        let text = format!(
            "[[databases]]\nname = \"orders\"\nurl = \"postgres://switchyard@127.0.0.1:1/orders\"\n\n\
             [[plugins]]\nname = \"route\"\npath = \"{}\"\n[plugins.config]\ntarget = \"bus\"\ntopic = \"{topic}\"\n\n\
             [targets.bus]\ntype = \"nats\"\nurl = \"nats://127.0.0.1:1\"\n",
            plugin("route_by_type").display()
        );
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let good = write("good.toml", "orders.{event_type}");
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--offline", "--config", &good], &[]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("good.toml: ok"), "{out}");

    let (code, out, err) = cli(SWITCHYARD, &["validate", "--config", &good], &[]).await;
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("database orders") && err.contains("cannot connect"),
        "{err}"
    );

    let typo = write("typo.toml", "orders.{evnt_type}");
    let (code, out, err) = cli(SWITCHYARD, &["validate", "--offline", "--config", &typo], &[]).await;
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("unknown placeholder {evnt_type}"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A relay whose admin endpoint listens on a port the system chose is found
/// by `status` all the same: running relays record their address in the
/// database, and a relay that stops removes itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_finds_a_relay_whose_admin_port_the_system_chose() {
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let config = router_config(
        &db.url,
        &nats.url(),
        &plugin("route_by_type"),
        &[("target", "events"), ("topic", "orders.{event_type}")],
    )
    .set("admin", "listen", "127.0.0.1:0")
    .toml();
    let dir = std::env::temp_dir().join(format!("sy-port-zero-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("relay.toml");
    std::fs::write(&config_path, &config).unwrap();
    let status = || status_json(&config_path);

    let mut relay = switchyard_tests::relay::Process::spawn(SWITCHYARD, &config, "port-zero");
    let report = eventually("status finds the relay", Duration::from_secs(30), || async {
        let report = status().await;
        (report["relay"]["owner"] == "port-zero").then_some(report)
    })
    .await;
    let relays = report["relays"].as_array().expect("relays");
    assert_eq!(relays.len(), 1, "{report}");
    assert_eq!(relays[0]["instance_id"], "port-zero");
    let admin: std::net::SocketAddr = relays[0]["admin_address"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("an address: {report}"));
    assert_ne!(admin.port(), 0);
    assert_eq!(report["admin"], admin.to_string());
    assert_eq!(report["relay"]["ready"], true, "{report}");

    relay.terminate();
    let report = status().await;
    assert_eq!(
        report["relays"],
        serde_json::json!([]),
        "a stopped relay removes itself"
    );
    assert!(report["relay"].is_null(), "{report}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Rows written to `switchyard_intake` wait as much as rows in the outbox:
/// with no relay running to move them, `status` counts them pending (or
/// delayed) and the oldest of them sets the oldest pending age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_rows_still_in_the_intake() {
    init_logging();
    let db = fresh_db().await;
    let config = router_config(
        &db.url,
        "nats://127.0.0.1:1",
        &plugin("route_by_type"),
        &[("target", "events"), ("topic", "orders.{event_type}")],
    )
    .toml();
    let dir = std::env::temp_dir().join(format!("sy-intake-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("relay.toml");
    std::fs::write(&config_path, &config).unwrap();
    for (created, not_before) in [
        ("2 minutes", None),
        ("1 second", None),
        ("1 second", Some("1 hour")),
    ] {
        sqlx::query(
            "INSERT INTO switchyard_intake (aggregate_type, aggregate_id, event_type, payload, created_at, not_before)
             VALUES ('order', 'order-1', 'OrderCreated', '{}', now() - $1::interval, now() + $2::interval)",
        )
        .bind(created)
        .bind(not_before)
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let report = status_json(&config_path).await;
    let outbox = &report["outbox"];
    assert_eq!(
        (outbox["pending"].as_i64(), outbox["delayed"].as_i64()),
        (Some(2), Some(1)),
        "{report}"
    );
    let oldest = outbox["oldest_pending_age_seconds"].as_f64().unwrap();
    assert!((115.0..180.0).contains(&oldest), "{report}");
}

/// `plugin test --from-db` offers what the relay would route next: the
/// outbox's unfinished rows, then the rows still in the intake, in the order
/// the claims will move them; never a published row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_test_from_db_offers_rows_still_in_the_intake() {
    init_logging();
    let db = fresh_db().await;
    let write = async |table: &str, aggregate: &str, status: &str| -> String {
        let sql = if table == "switchyard_outbox" {
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status)
             VALUES ('order', $1, 'OrderCreated', '{}', $2) RETURNING event_id::text"
        } else {
            "INSERT INTO switchyard_intake (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', $1, 'OrderCreated', '{}') RETURNING event_id::text"
        };
        sqlx::query_scalar(sql)
            .bind(aggregate)
            .bind(status)
            .fetch_one(&db.pool)
            .await
            .unwrap()
    };
    let published = write("switchyard_outbox", "order-0", "published").await;
    let intake_first = write("switchyard_intake", "order-1", "").await;
    let outbox_row = write("switchyard_outbox", "order-2", "pending").await;
    let intake_second = write("switchyard_intake", "order-3", "").await;
    let router = plugin("route_by_type");
    let offered = async |limit: &str| -> Vec<String> {
        let args = [
            "plugin",
            "test",
            router.to_str().unwrap(),
            "--from-db",
            "--database-url",
            &db.url,
            "--limit",
            limit,
            "--config",
            "target=events",
            "--json",
        ];
        let (code, out, err) = cli(SWITCHYARD, &args, &[]).await;
        assert_eq!(code, 0, "{out}{err}");
        let report: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        report["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|event| event["event"]["event_id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        offered("10").await,
        [outbox_row.clone(), intake_first.clone(), intake_second]
    );
    assert_eq!(offered("2").await, [outbox_row, intake_first]);
    assert!(!offered("10").await.contains(&published));
}

/// A relay started on a database an old release left (here: the first
/// migration alone, older than the previous generation) stays up, not
/// ready, saying to run `switchyard migrate`; once that has run it serves
/// every event written before, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_on_a_schema_too_old_waits_for_migrate_and_then_loses_nothing() {
    init_logging();
    let second = switchyard::store::MIGRATOR.migrations[1].version;
    let db = fresh_db_before(second).await;
    let broker = Broker::start("nats").await;
    let expected = write_orders(&db.pool, 10, 5, 2).await;
    let (config, admin) = with_admin(&broker.config(&db.url, RelaySection::quick()).toml());
    let mut relay = Process::spawn(SWITCHYARD, &config, "schema-too-old");
    switchyard_tests::readyz_unready(admin, &["older than this relay serves", "switchyard migrate"]).await;
    assert!(!relay.has_exited(), "the relay stays up");
    // `/status` says the same, where it used to answer 404.
    let (code, status) = http_get(admin, "/status").await;
    assert_eq!(code, 503, "{status}");
    assert!(
        status.contains("not served yet") && status.contains("switchyard migrate"),
        "{status}"
    );
    assert_eq!(count_status(&db.pool, "published").await, 0);

    let path = std::env::temp_dir().join(format!("sy-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, &config).unwrap();
    let (code, _, err) = cli(SWITCHYARD, &["migrate", "--config", path.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "{err}");
    readyz_answers(admin, 200).await;
    all_published(&db.pool, expected.len() as i64, Duration::from_secs(60)).await;
    relay.terminate();
    broker.assert_each_once_in_order(&expected).await;
}
