//! The short fault suite: each test attacks one promise the way the relay
//! was broken from the outside (hostile plugins, a batch that panics, a
//! subject that makes NATS drop the connection, a broker outage with
//! publishes in flight, an unreachable Kafka probed for readiness), and
//! checks what a user would: what arrived, what `last_error` says, whether
//! the relay is still serving. The long version is the `fault-run` bench
//! binary (by hand).

// Broker and database outages.
#[path = "outage.rs"]
mod outage;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use switchyard::sinks::{OutgoingMessage, Sink, SinkError, Sinks};
use switchyard_tests::config::{Plugin, Target, TestConfig, routes, strings};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::plugins::plugin;
use switchyard_tests::relay::{InProcess, RelaySection, parse};
use switchyard_tests::{eventually, init_logging};

struct Sqlite {
    dir: std::path::PathBuf,
    url: String,
    pool: sqlx::SqlitePool,
}

impl Sqlite {
    async fn new() -> Sqlite {
        let dir = std::env::temp_dir().join(format!("sy-faults-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("outbox.db").display());
        let store = switchyard::store::OutboxStore::connect(&url, 2).await.unwrap();
        store.migrate().await.unwrap();
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        Sqlite { dir, url, pool }
    }

    async fn insert(&self, aggregate: &str, event_type: &str, seq: usize) {
        sqlx::query(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', ?1, ?2, ?3)",
        )
        .bind(aggregate)
        .bind(event_type)
        .bind(serde_json::json!({ "seq": seq }).to_string())
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn count(&self, status: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = ?1")
            .bind(status)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Status and last error of the event of `event_type`.
    async fn outcome(&self, event_type: &str) -> (String, String) {
        sqlx::query_as("SELECT status, coalesce(last_error, '') FROM switchyard_outbox WHERE event_type = ?1")
            .bind(event_type)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

impl Drop for Sqlite {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A config on `db_url` for these tests: short leases and backoff, two
/// attempts; no reload, no cache, no admin endpoint.
fn quick(db_url: &str) -> TestConfig {
    TestConfig::new(db_url).tuning(RelaySection::quick()).quiet()
}

/// One misbehaving plugin per mode, each on the event type of that name.
const HOSTILE: [(&str, &str); 9] = [
    ("print", "Print"),
    ("panic", "Panic"),
    ("unwrap", "Unwrap"),
    ("nul-topic", "NulTopic"),
    ("huge-topic", "HugeTopic"),
    ("control-header", "ControlHeader"),
    ("many-headers", "ManyHeaders"),
    ("huge-header", "HugeHeader"),
    ("init-print", "InitPrint"),
];

fn hostile_config(db_url: &str, out: &std::path::Path) -> String {
    let misbehave = plugin("misbehave");
    HOSTILE
        .iter()
        .fold(
            quick(db_url).database("max_connections", 4),
            |config, (mode, event_type)| {
                config.plugin(
                    Plugin::new(mode, &misbehave)
                        .event_types(&[event_type])
                        .config("mode", *mode)
                        .config("target", "out"),
                )
            },
        )
        .plugin(Plugin::new("router", &plugin("route_by_type")).to("out", "orders.{event_type}"))
        .target("out", Target::file(out))
        .toml()
}

/// Plugins that print, panic, fail an unwrap or return output no broker
/// would take fail their own rows with a specific `last_error`; the relay
/// keeps running and every other event is published in order. Before, any
/// print or panic killed the relay ("Cannot start a runtime from within a
/// runtime"), and a NUL in a topic made the whole batch's ack fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_plugins_fail_only_their_own_rows() {
    init_logging();
    let db = Sqlite::new().await;
    let out = db.dir.join("out.jsonl");
    let config = parse(&hostile_config(&db.url, &out));
    // init-print prints during init, on startup: the relay must start.
    let relay = InProcess::start(&config).await;

    for seq in 0..20 {
        for aggregate in 0..10 {
            db.insert(&format!("o-{aggregate}"), "OrderUpdated", seq).await;
        }
        if seq == 5 {
            for (_, event_type) in HOSTILE {
                db.insert(&format!("h-{event_type}"), event_type, 0).await;
            }
        }
    }
    eventually("every row finished", Duration::from_secs(60), || async {
        let open = db.count("pending").await + db.count("in_flight").await;
        (open == 0).then_some(())
    })
    .await;
    assert!(
        switchyard::admin::readiness(&relay.relay).await.ready,
        "the relay still serves"
    );
    relay.stop().await;

    let expect = [
        ("Print", "published", ""),
        ("InitPrint", "published", ""),
        ("Panic", "dead", "misbehave panicked on purpose for h-Panic"),
        ("Unwrap", "dead", "called `Option::unwrap()` on a `None` value"),
        ("NulTopic", "dead", "contains a control character"),
        ("HugeTopic", "dead", "over the 1024 allowed"),
        ("ControlHeader", "dead", "header name"),
        ("ManyHeaders", "dead", "5000 headers, more than the 256 allowed"),
        ("HugeHeader", "dead", "payload and headers are"),
    ];
    for (event_type, status, error) in expect {
        let (got, last_error) = db.outcome(event_type).await;
        assert_eq!(got, status, "{event_type}: {last_error}");
        assert!(last_error.contains(error), "{event_type}: {last_error}");
    }
    let (_, panic) = db.outcome("Panic").await;
    assert!(
        panic.contains("plugin panic@"),
        "names the plugin version: {panic}"
    );

    let (good, _) = published_in_order(&out, Repeats::Skipped);
    assert_eq!(good.len(), 200, "every good event published");
}

/// Whether a repeated event id on the file target is allowed (and skipped).
#[derive(Clone, Copy, PartialEq)]
enum Repeats {
    Skipped,
    Refused,
}

/// The file target's messages for the `o-*` aggregates, checked to carry
/// each aggregate's `seq` in order, and the other messages.
fn published_in_order(
    out: &std::path::Path,
    repeats: Repeats,
) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let text = std::fs::read_to_string(out).unwrap();
    let mut next: HashMap<String, u64> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    let (mut good, mut others) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let line: serde_json::Value = serde_json::from_str(line).unwrap();
        if !seen.insert(line["event_id"].as_str().unwrap().to_string()) {
            assert!(repeats == Repeats::Skipped, "published twice: {line}");
            continue;
        }
        let key = line["key"].as_str().unwrap().to_string();
        if !key.starts_with("o-") {
            others.push(line);
            continue;
        }
        let want = next.entry(key.clone()).or_insert(0);
        assert_eq!(line["payload"]["seq"].as_u64(), Some(*want), "{key} out of order");
        *want += 1;
        good.push(line);
    }
    (good, others)
}

/// Through a whole relay: a batch plugin gets each claimed batch in one
/// call, and events that trap it, spin or make it answer short are
/// dead-lettered alone. Every other event is published once, in order, on
/// its first attempt, though it shared a batch with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_plugin_fails_only_the_events_at_fault() {
    init_logging();
    let db = Sqlite::new().await;
    let out = db.dir.join("out.jsonl");
    // 200 ms an event: a machine that pauses the relay for a moment does
    // not fail a good event routed alone. Batches of 5: a spinning batch
    // call still costs 1 s.
    let text = quick(&db.url)
        .database("max_connections", 4)
        .relay("batch_size", 5)
        .plugin(
            Plugin::new("batch", &plugin("batch_probe"))
                .set("timeout_ms", 200)
                .config("target", "out")
                .config("trap", strings(&["Trap"]))
                .config("loop", strings(&["Spin"]))
                .config("short", strings(&["Short"])),
        )
        .target("out", Target::file(&out))
        .toml();
    for seq in 0..20 {
        for aggregate in 0..10 {
            db.insert(&format!("o-{aggregate}"), "OrderUpdated", seq).await;
        }
        if seq % 5 == 2 {
            for poison in ["Trap", "Spin", "Short"] {
                db.insert(&format!("p-{poison}-{seq}"), poison, 0).await;
            }
        }
    }
    let relay = InProcess::start(&parse(&text)).await;
    eventually("every row finished", Duration::from_secs(60), || async {
        let open = db.count("pending").await + db.count("in_flight").await;
        (open == 0).then_some(())
    })
    .await;
    relay.stop().await;

    for (poison, error) in [
        ("Trap", "`unreachable` instruction executed"),
        ("Spin", "exceeded its time limit of 200 ms"),
        ("Short", "returned 0 results for 1 event"),
    ] {
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT status, coalesce(last_error, '') FROM switchyard_outbox WHERE event_type = ?1",
        )
        .bind(poison)
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(rows.len(), 4);
        for (status, last_error) in rows {
            assert_eq!(status, "dead", "{poison}: {last_error}");
            assert!(
                last_error.contains(error) && last_error.contains("plugin batch@"),
                "{poison}: {last_error}"
            );
        }
    }
    let retried: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox WHERE event_type = 'OrderUpdated' AND attempts <> 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(retried, 0, "no good event needed a second attempt");

    let (good, others) = published_in_order(&out, Repeats::Refused);
    assert!(others.is_empty(), "a poisoned event was published: {others:?}");
    assert_eq!(good.len(), 200, "every good event published once");
    let largest_batch = good
        .iter()
        .map(|line| {
            line["headers"]["x-batch-size"]
                .as_str()
                .unwrap()
                .parse::<usize>()
                .unwrap()
        })
        .max();
    assert!(
        largest_batch > Some(1),
        "events were routed in batches, not one by one"
    );
}

/// `plugin test` takes several events (repeated `--event`, or a file with
/// an array) and routes them together as the relay routes a claimed batch:
/// a batch plugin sees them in one call, and an event that traps it is the
/// only one reported, in the order given.
#[tokio::test]
async fn plugin_test_routes_several_events_as_one_batch() {
    let dir = std::env::temp_dir().join(format!("sy-batch-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let array = dir.join("three.json");
    std::fs::write(
        &array,
        r#"[{"aggregate_type": "order", "aggregate_id": "o-1", "event_type": "Placed", "payload": {"n": 1}},
            {"aggregate_type": "order", "aggregate_id": "o-1", "event_type": "Poison", "payload": {"n": 2}},
            {"aggregate_type": "order", "aggregate_id": "o-2", "event_type": "Paid", "payload": {"n": 3}}]"#,
    )
    .unwrap();
    let one = switchyard_tests::workspace_root().join("examples/events/order-paid.json");
    let probe = plugin("batch_probe");
    let run = |extra: &'static [&'static str]| {
        let events = [array.clone(), one.clone()];
        let probe = probe.clone();
        async move {
            let (code, out, err) = plugin_test_json(&probe, &events, extra).await;
            let report: serde_json::Value =
                serde_json::from_str(&out).unwrap_or_else(|_| panic!("one JSON document: {out}\n{err}"));
            (code, report)
        }
    };
    let summary = |report: &serde_json::Value| -> Vec<(String, String, String)> {
        report["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|event| {
                let size = event["messages"][0]["headers"]["x-batch-size"]
                    .as_str()
                    .unwrap_or("-");
                (
                    event["event"]["event_type"].as_str().unwrap().to_string(),
                    event["outcome"].as_str().unwrap().to_string(),
                    size.to_string(),
                )
            })
            .collect()
    };
    let owned = |rows: &[(&str, &str, &str)]| -> Vec<(String, String, String)> {
        rows.iter()
            .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
            .collect()
    };

    let (code, report) = run(&[]).await;
    assert_eq!(code, 0, "{report}");
    assert_eq!(
        summary(&report),
        owned(&[
            ("Placed", "published", "4"),
            ("Poison", "published", "4"),
            ("Paid", "published", "4"),
            ("OrderPaid", "published", "4"),
        ])
    );

    let (code, report) = run(&["--config", "trap=[\"Poison\"]"]).await;
    assert_eq!(code, 1, "{report}");
    assert_eq!(report["failed"], 1);
    assert_eq!(
        summary(&report),
        owned(&[
            ("Placed", "published", "1"),
            ("Poison", "crashed", "-"),
            ("Paid", "published", "1"),
            ("OrderPaid", "published", "1"),
        ])
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A config with one misbehave plugin, `name`, limited to `timeout_ms` per
/// event, with `settings` in its `[plugins.config]`, writing to stdout.
fn misbehaving_in_init(url: &str, name: &str, timeout_ms: i64, settings: &[(&str, toml::Value)]) -> String {
    let misbehave = Plugin::new(name, &plugin("misbehave")).set("timeout_ms", timeout_ms);
    let misbehave = settings.iter().fold(misbehave, |plugin, (key, value)| {
        plugin.config(key, value.clone())
    });
    quick(url)
        .plugin(misbehave.config("target", "out"))
        .target("out", Target::stdout())
        .toml()
}

/// A plugin whose `init` never returns is refused at startup with its time
/// limit named; it neither hangs the start nor starts a relay without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_loops_in_init_is_refused() {
    init_logging();
    let db = Sqlite::new().await;
    let text = misbehaving_in_init(&db.url, "looper", 50, &[("mode", "init-loop".into())]);
    // The error names the limit that ended `init`; the bound here is only
    // against a start that hangs.
    let started = Instant::now();
    let error = tokio::time::timeout(Duration::from_secs(60), switchyard::runtime::build(&parse(&text)))
        .await
        .expect("refused, not hanging")
        .err()
        .expect("refused");
    eprintln!("refused after {:?}", started.elapsed());
    let error = format!("{error:#}");
    assert!(
        error.contains("looper@") && error.contains("failed init: exceeded its time limit of 1000 ms"),
        "{error}"
    );
}

/// `init` is not held to the per-event `timeout_ms`: a plugin whose start
/// takes several times that (or a machine busy enough to stretch it) loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_slower_than_the_per_event_limit_still_loads() {
    init_logging();
    let db = Sqlite::new().await;
    let text = misbehaving_in_init(
        &db.url,
        "slow",
        5,
        &[("mode", "init-slow".into()), ("init_spins", 50_000_000.into())],
    );
    let started = Instant::now();
    let relay = switchyard::runtime::build(&parse(&text)).await;
    let took = started.elapsed();
    let relay = relay.unwrap_or_else(|e| panic!("refused after {took:?}: {e:#}"));
    assert!(relay.plugins().slot("slow").is_some());
}

/// A sink that panics: a bug in the relay or an embedder's sink.
struct PanickingSink;

impl Sink for PanickingSink {
    fn kind(&self) -> &'static str {
        "panicking"
    }

    fn publish(&self, _: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(async { panic!("sink exploded") })
    }

    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async { Ok(()) })
    }
}

/// A batch that panics is caught: logged, counted, reported by readiness;
/// the worker goes on, other rows flow, and the poisoned row is retried,
/// then dead-lettered with the panic as its reason (not "lease expired").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_batch_is_reported_and_the_relay_goes_on() {
    init_logging();
    let db = Sqlite::new().await;
    let out = db.dir.join("out.jsonl");
    let route = plugin("route_by_type");
    let text = quick(&db.url)
        .relay("batch_size", 1)
        .relay("publish_timeout_ms", 700)
        .relay("lease_duration_ms", 2500)
        .plugin(
            Plugin::new("boom", &route)
                .event_types(&["Boom"])
                .config("target", "boom"),
        )
        .plugin(Plugin::new("router", &route).config("target", "out"))
        .target("boom", Target::stdout())
        .target("out", Target::file(&out))
        .toml();
    let config = parse(&text);
    let store = switchyard::store::OutboxStore::connect(&db.url, 4).await.unwrap();
    let engine = switchyard::plugin::PluginEngine::new(None).unwrap();
    let configs = config.plugins.clone();
    let plugins = tokio::task::spawn_blocking(move || switchyard::plugin::Plugins::load(engine, &configs))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e:?}"));
    let file = switchyard::sinks::file::FileSink::open(
        "out",
        match &config.targets["out"] {
            switchyard::config::TargetConfig::File(file) => file,
            _ => unreachable!(),
        },
    )
    .await
    .unwrap();
    let sinks = Sinks::from_sinks([
        ("boom".to_string(), Arc::new(PanickingSink) as Arc<dyn Sink>),
        ("out".to_string(), Arc::new(file) as Arc<dyn Sink>),
    ]);
    let relay = switchyard::Relay::new(store, plugins, sinks, config.relay.clone());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });

    db.insert("b-1", "Boom", 0).await;
    eventually("readiness reports the panic", Duration::from_secs(10), || async {
        let readiness = switchyard::admin::readiness(&relay).await;
        (!readiness.ready && readiness.workers.to_string().contains("sink exploded")).then_some(())
    })
    .await;
    // Counted by the time readiness reports it; the row may already have
    // panicked again on its retry.
    let panics = || {
        let text = relay.metrics().render();
        text.lines()
            .find_map(|line| line.strip_prefix("switchyard_worker_panics_total{database=\"default\"} "))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert!(panics() >= 1);
    for seq in 0..30 {
        db.insert("o-1", "OrderUpdated", seq).await;
    }
    eventually("the relay goes on", Duration::from_secs(30), || async {
        (db.count("published").await == 30).then_some(())
    })
    .await;
    eventually(
        "the poisoned row is dead-lettered",
        Duration::from_secs(30),
        || async { (db.count("dead").await == 1).then_some(()) },
    )
    .await;
    let (_, error) = db.outcome("Boom").await;
    assert!(
        error.contains("panicked") && error.contains("sink exploded"),
        "the dead letter names the panic: {error}"
    );
    assert_eq!(
        panics(),
        u64::from(config.relay.max_attempts),
        "one panic per attempt, each counted"
    );
    shutdown.cancel();
    running.await.unwrap().unwrap();
}

/// A NATS target from its TOML, with a publish timeout in ms.
async fn nats_sink(toml_text: &str, publish_timeout_ms: u64) -> switchyard::sinks::nats::NatsSink {
    let config: switchyard::sinks::nats::NatsSinkConfig = toml::from_str(toml_text).unwrap();
    switchyard::sinks::nats::NatsSink::connect(
        "nats",
        &config,
        Duration::from_millis(publish_timeout_ms),
        Duration::from_secs(60),
    )
    .await
    .unwrap()
}

/// Message `n` on `subject`, with payload and ids made from `n`.
fn outgoing(subject: String, n: usize) -> OutgoingMessage {
    OutgoingMessage {
        topic: subject,
        payload: format!("{n}").into_bytes().into(),
        event_id: format!("e-{n}"),
        dedup_id: format!("e-{n}"),
        ..Default::default()
    }
}

/// Core NATS "success" must mean the server read the message. A subject
/// over the server's control line makes it close the connection, dropping
/// whatever else was in flight; before, every message of the batch was
/// reported published after the flush and a subscriber got 1 of 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_nats_reports_published_only_what_the_server_took() {
    init_logging();
    // A small control line lets a subject the relay's checks accept (they
    // assume the default 4 KiB) still be too long for this server.
    let nats = NatsServer::start_with_config("max_control_line: 256\n").await;
    let sink = nats_sink(&format!("url = \"{}\"\nmode = \"core\"", nats.url()), 2000).await;
    let watcher = async_nats::connect(nats.url()).await.unwrap();
    let mut received = watcher.subscribe("fault.>").await.unwrap();
    watcher.flush().await.unwrap();

    let batch = vec![
        outgoing("fault.a".into(), 0),
        outgoing(format!("fault.{}", "x".repeat(600)), 1),
        outgoing("fault.b".into(), 2),
        outgoing("fault.c".into(), 3),
    ];
    let results = sink.publish(batch).await;
    let mut got = Vec::new();
    while let Ok(Some(message)) = tokio::time::timeout(
        Duration::from_millis(500),
        futures::StreamExt::next(&mut received),
    )
    .await
    {
        got.push(String::from_utf8_lossy(&message.payload).to_string());
    }
    for (n, result) in results.iter().enumerate() {
        if result.is_ok() {
            assert!(
                got.contains(&n.to_string()),
                "message {n} reported published but never arrived: {results:?}, got {got:?}"
            );
        }
    }
    assert!(
        results.iter().any(Result::is_err),
        "the dropped connection is noticed: {results:?}"
    );

    // The next batch goes through once the client is back.
    eventually("a later batch is confirmed", Duration::from_secs(20), || async {
        let results = sink.publish(vec![outgoing("fault.d".into(), 4)]).await;
        results[0].is_ok().then_some(())
    })
    .await;
}

/// While NATS is down nothing is handed to the client, and what was handed
/// to it when the connection dropped is not sent long after the relay gave
/// up: a publish the relay recorded as failed must not appear in the stream
/// when the server returns. Before, async-nats buffered those publishes and
/// sent them on reconnect, and the relay's own retry came after JetStream's
/// duplicate window: the event was stored twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_never_sends_a_publish_it_gave_up_on() {
    init_logging();
    let mut nats = NatsServer::start().await;
    nats.create_stream("FAULT", &["fault.>"]).await;
    let sink = nats_sink(&format!("url = \"{}\"", nats.url()), 500).await;
    let message = |n: usize| outgoing(format!("fault.{n}"), n);
    assert!(sink.publish(vec![message(0)]).await[0].is_ok());

    nats.stop();
    let mut failed = Vec::new();
    let down = Instant::now();
    for n in 1..=20 {
        let results = sink.publish(vec![message(n)]).await;
        let Err(error) = &results[0] else {
            panic!("fault.{n} published while the server is down");
        };
        eprintln!("fault.{n}: {:?} after {:?}: {error}", error.kind, down.elapsed());
        // Fail fast while down: once the client has seen the connection
        // go (the first publish or two may still be handed to it and wait
        // out the publish timeout), nothing is handed to it.
        if n > 2 {
            assert!(
                error.kind == switchyard::sinks::FailureKind::Unavailable
                    && error.message.contains("not connected"),
                "fault.{n} was handed to a client that is not connected: {error:?}"
            );
        }
        failed.push(n);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // Only against a hang: each publish is bounded by the publish timeout.
    assert!(down.elapsed() < Duration::from_secs(60));
    nats.resume().await;
    eventually("publishing again", Duration::from_secs(20), || async {
        sink.publish(vec![message(100)]).await[0].is_ok().then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stored: Vec<String> = nats
        .read_stream("FAULT")
        .await
        .iter()
        .map(|m| m.subject.clone())
        .collect();
    for n in failed {
        assert!(
            !stored.contains(&format!("fault.{n}")),
            "fault.{n} was reported failed but reached the stream later: {stored:?}"
        );
    }
    assert!(stored.contains(&"fault.100".to_string()));
}

/// Readiness asks Kafka for metadata on a blocking thread. With Kafka down,
/// each probe used to wait the publish timeout while `/readyz` gave up
/// after 3 s, so probes piled up threads; now one probe runs at a time and
/// is bounded by the sink's own health timeout (checked at compile time to
/// be under readiness's bound), whatever the publish timeout.
/// The threads are counted by name, on a runtime of the test's own: other
/// tests in this binary start and stop threads of their own meanwhile.
#[test]
fn kafka_health_probes_are_bounded_while_kafka_is_down() {
    init_logging();
    const NAME: &str = "kafka-probes";
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(NAME)
        .enable_all()
        .build()
        .unwrap();
    let threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .filter(|comm| comm.trim_end() == NAME)
            .count()
    };
    runtime.block_on(async {
        let port = switchyard_tests::free_port();
        let config: switchyard::sinks::kafka::KafkaSinkConfig =
            toml::from_str(&format!("bootstrap_servers = \"127.0.0.1:{port}\"")).unwrap();
        // A probe that waited the publish timeout would take a minute.
        let sink = Arc::new(
            switchyard::sinks::kafka::KafkaSink::connect("down", &config, Duration::from_secs(60))
                .await
                .unwrap(),
        );
        let started = Instant::now();
        assert!(sink.healthcheck().await.is_err());
        let took = started.elapsed();
        eprintln!("a probe with Kafka down answered in {took:?}");
        assert!(
            took < Duration::from_secs(20),
            "a probe waited {took:?}: the publish timeout, not its own bound"
        );

        let before = threads();
        let probes: Vec<_> = (0..10)
            .map(|_| {
                let sink = Arc::clone(&sink);
                tokio::spawn(
                    async move { tokio::time::timeout(Duration::from_secs(3), sink.healthcheck()).await },
                )
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let during = threads();
        for probe in probes {
            let _ = probe.await;
        }
        assert!(
            during <= before + 3,
            "probe threads piled up: {before} -> {during}"
        );
    });
}

/// `switchyard plugin test` on a plugin that prints, in `init` and in
/// `route`: it used to exit 101 ("Cannot start a runtime from within a
/// runtime"); now the output goes to the log and the answer is shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_test_survives_a_plugin_that_prints() {
    let event = switchyard_tests::workspace_root().join("examples/events/order-paid.json");
    let misbehave = plugin("misbehave");
    for mode in ["print", "init-print"] {
        let (code, stdout, stderr) = switchyard_tests::cli(
            env!("CARGO_BIN_EXE_relay-process"),
            &[
                "plugin",
                "test",
                misbehave.to_str().unwrap(),
                "--event",
                event.to_str().unwrap(),
                "--config",
                &format!("mode={mode}"),
                "--config",
                "target=out",
            ],
            &[("SWITCHYARD_LOG", "info")],
        )
        .await;
        assert_eq!(code, 0, "{mode}: {stdout}\n{stderr}");
        assert!(stdout.contains(&format!("topic=test.{mode}")), "{mode}: {stdout}");
        assert!(
            stderr.contains(&format!("{mode}:")),
            "the plugin's print is logged: {stderr}"
        );
        // Piped to a file or another program: no colour codes.
        assert!(
            !stderr.contains('\x1b'),
            "ANSI escape codes in piped logs: {stderr:?}"
        );
    }
}

/// `switchyard plugin test FILE --event E... --json --config target=out EXTRA...`.
async fn plugin_test_json(
    file: &std::path::Path,
    events: &[std::path::PathBuf],
    extra: &[&str],
) -> (i32, String, String) {
    let mut args = vec!["plugin".to_string(), "test".into(), file.display().to_string()];
    for event in events {
        args.extend(["--event".to_string(), event.display().to_string()]);
    }
    args.extend(["--json", "--config", "target=out"].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    switchyard_tests::cli(env!("CARGO_BIN_EXE_relay-process"), &args, &[]).await
}

/// `plugin test --json` reports each event's outcome for scripts, and
/// `--payload-file` sends a binary payload through the plugin.
#[tokio::test]
async fn plugin_test_reports_json_and_takes_a_binary_payload() {
    let event = switchyard_tests::workspace_root().join("examples/events/order-paid.json");
    let payload = std::env::temp_dir().join(format!("sy-payload-{}.bin", uuid::Uuid::new_v4().simple()));
    let bytes = [0u8, 0xff, 0x10, b'x', 0x80];
    std::fs::write(&payload, bytes).unwrap();
    let router = plugin("route_by_type");
    let misbehave = plugin("misbehave");
    let events = [event];

    let (code, out, err) =
        plugin_test_json(&router, &events, &["--payload-file", payload.to_str().unwrap()]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON document");
    assert_eq!(report["failed"], 0);
    let first = &report["events"][0];
    assert_eq!(first["outcome"], "published");
    assert_eq!(first["event"]["event_type"], "OrderPaid");
    let message = &first["messages"][0];
    assert_eq!(message["target"], "out");
    assert_eq!(message["key"], "order-42");
    assert_eq!(message["headers"]["content-type"], "application/octet-stream");
    assert!(message["payload"].is_null(), "not text: {message}");
    use base64::Engine;
    let sent = base64::engine::general_purpose::STANDARD
        .decode(message["payload_base64"].as_str().expect("base64 payload"))
        .unwrap();
    assert_eq!(sent, bytes, "the bytes go through unchanged");

    // A trap: still one JSON document, the outcome says why, and the exit code fails.
    let (code, out, _) = plugin_test_json(&misbehave, &events, &["--config", "mode=trap"]).await;
    assert_ne!(code, 0);
    let report: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON document");
    assert_eq!(report["failed"], 1);
    assert_eq!(report["events"][0]["outcome"], "crashed");
    assert!(
        report["events"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("trapped"),
        "{report}"
    );
    let _ = std::fs::remove_file(payload);
}

/// Credentials in a target URL never reach an error message.
#[tokio::test]
async fn an_unreachable_nats_is_reported_without_its_password() {
    let port = switchyard_tests::free_port();
    let config: switchyard::sinks::nats::NatsSinkConfig =
        toml::from_str(&format!("url = \"nats://relay:s3cr3t-pw@127.0.0.1:{port}\"")).unwrap();
    let error = switchyard::sinks::nats::NatsSink::connect(
        "events",
        &config,
        Duration::from_secs(1),
        Duration::from_secs(60),
    )
    .await
    .err()
    .expect("nothing listens there");
    assert!(
        error.message.contains(&format!("127.0.0.1:{port}")),
        "{}",
        error.message
    );
    assert!(!error.message.contains("s3cr3t-pw"), "{}", error.message);
}

/// An unreachable database or a missing one is reported with where and why,
/// once, instead of "pool timed out while waiting for an open connection".
#[tokio::test]
async fn database_connect_errors_say_where_and_why() {
    let port = switchyard_tests::free_port();
    let error = switchyard::store::OutboxStore::connect(
        &format!("postgres://app:hunter2@127.0.0.1:{port}/orders"),
        4,
    )
    .await
    .expect_err("nothing listens there")
    .to_string();
    assert!(
        error.contains(&format!("127.0.0.1:{port}")) && error.contains("\"orders\""),
        "{error}"
    );
    assert!(error.to_lowercase().contains("refused"), "says why: {error}");
    assert!(!error.contains("hunter2"), "{error}");

    let server = switchyard_tests::postgres::server_url();
    let (base, _) = server.rsplit_once('/').unwrap();
    let error = switchyard::store::OutboxStore::connect(&format!("{base}/no_such_database_here"), 4)
        .await
        .expect_err("no such database")
        .to_string();
    assert_eq!(error.matches("does not exist").count(), 1, "{error}");
    assert!(error.contains("no_such_database_here"), "{error}");
}

/// Two JetStream targets whose subjects land in one stream: each event's two
/// messages must not deduplicate each other there. Before, both carried the
/// bare event id as `Nats-Msg-Id` and the stream kept one of the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nats_targets_into_one_stream_keep_both_messages() {
    init_logging();
    let db = Sqlite::new().await;
    let nats = NatsServer::start().await;
    nats.create_stream("BOTH", &["orders.>", "audit.>"]).await;
    let text = quick(&db.url)
        .plugin(Plugin::new("fan", &plugin("fan_out")).config(
            "default",
            routes(&[
                ("main", "orders.{event_type}", None),
                ("audit", "audit.{event_type}", None),
            ]),
        ))
        .target("main", Target::nats(&nats.url()))
        .target("audit", Target::nats(&nats.url()))
        .toml();
    let relay = InProcess::start(&parse(&text)).await;
    for seq in 0..20 {
        db.insert(&format!("o-{}", seq % 4), "OrderUpdated", seq).await;
    }
    eventually("all published", Duration::from_secs(30), || async {
        (db.count("published").await == 20).then_some(())
    })
    .await;
    relay.stop().await;
    let stored = nats.read_stream("BOTH").await;
    let orders = stored.iter().filter(|m| m.subject.starts_with("orders.")).count();
    let audit = stored.iter().filter(|m| m.subject.starts_with("audit.")).count();
    assert_eq!((orders, audit), (20, 20), "one message per event and target");
    let ids: std::collections::HashSet<_> = stored.iter().filter_map(|m| m.header("Nats-Msg-Id")).collect();
    assert_eq!(ids.len(), 40, "distinct dedup ids");
}

/// Statistics taken while the outbox was drained (its normal state: every
/// row published), then a backlog of 10,000 rows behind aggregate heads
/// waiting in backoff: the planner joins without an index condition on the
/// aggregate index, and each claim that finds nothing takes about 30 s here
/// (nothing was published for minutes after a broker outage). The v2 claim
/// is planned the same way on any statistics: the relay drains the backlog
/// without a statistics refresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_recover_from_statistics_taken_on_a_drained_outbox() {
    init_logging();
    let db = switchyard_tests::postgres::fresh_db().await;
    let sql = |text: &'static str| {
        let pool = db.pool.clone();
        async move { sqlx::query(text).execute(&pool).await.unwrap() }
    };
    sql("ALTER TABLE switchyard_outbox SET (autovacuum_enabled = false)").await;
    sql("INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at)
         SELECT 'order', 'p-' || (g % 1000), 'OrderUpdated', '{}', 'published', now() FROM generate_series(1, 20000) g")
    .await;
    sql("ANALYZE switchyard_outbox").await;
    // Heads first (lowest ids), each already failed once and in backoff.
    sql("INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, attempts, next_attempt_at)
         SELECT 'order', 'o-' || a, 'OrderUpdated', jsonb_build_object('seq', 0), 1, now() + interval '4 seconds'
           FROM generate_series(1, 100) a")
    .await;
    sql(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'o-' || a, 'OrderUpdated', jsonb_build_object('seq', s)
           FROM generate_series(1, 99) s, generate_series(1, 100) a ORDER BY s, a",
    )
    .await;

    let out = std::env::temp_dir().join(format!("sy-stale-{}.jsonl", uuid::Uuid::new_v4().simple()));
    let text = quick(&db.url)
        .database("max_connections", 8)
        .relay("batch_size", 200)
        .relay("max_attempts", 5)
        .plugin(Plugin::new("router", &plugin("route_by_type")).config("target", "out"))
        .target("out", Target::file(&out).set("fsync", false))
        .toml();
    let relay = InProcess::start(&parse(&text)).await;
    let started = Instant::now();
    eventually("the backlog drains", Duration::from_secs(90), || async {
        let published: i64 =
            sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = 'published'")
                .fetch_one(&db.pool)
                .await
                .unwrap();
        (published == 30_000).then_some(())
    })
    .await;
    let drained = started.elapsed();
    relay.stop().await;
    let analyzed: Option<i64> = sqlx::query_scalar(
        "SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'switchyard_outbox'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    eprintln!("stale statistics: drained in {drained:?}, table analyzed {analyzed:?} times");
    // The claim's plan no longer depends on the statistics: it drains on
    // the stale ones, and the relay never had to refresh them (the v1 claim
    // was cancelled and the relay ran ANALYZE; that path remains for an
    // outbox not yet migrated).
    assert_eq!(analyzed, Some(1), "only the test's own ANALYZE ran");
    let _ = std::fs::remove_file(out);
}

/// What operators read: a target refusing messages for good is logged as
/// dead-lettering them, not as "only they will be retried" (it used to say
/// that with `retryable=false` while the rows were dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_refusal_is_logged_as_dead_lettered() {
    init_logging();
    let db = Sqlite::new().await;
    let nats = NatsServer::start().await;
    // A wildcard is no publish subject: NATS refuses it on every attempt.
    let text = quick(&db.url)
        .plugin(Plugin::new("router", &plugin("route_by_type")).to("events", "orders.*"))
        .target(
            "events",
            Target::of("nats").set("url", nats.url()).set("mode", "core"),
        )
        .toml();
    let config_path = db.dir.join("relay.toml");
    std::fs::write(&config_path, text).unwrap();
    let log_path = db.dir.join("relay.log");
    let mut relay = std::process::Command::new(env!("CARGO_BIN_EXE_relay-process"))
        .args(["run", "--config"])
        .arg(&config_path)
        .env("SWITCHYARD_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    db.insert("o-1", "OrderUpdated", 0).await;
    eventually("the row is dead-lettered", Duration::from_secs(30), || async {
        (db.count("dead").await == 1).then_some(())
    })
    .await;
    let _ = relay.kill();
    let _ = relay.wait();
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        log.contains("refused deliveries for good; their rows are dead-lettered"),
        "{log}"
    );
    assert!(!log.contains("will be retried"), "{log}");
    let (_, error) = db.outcome("OrderUpdated").await;
    assert!(error.contains("invalid NATS subject"), "{error}");
}

/// `plugin test` gates a plugin's CI: it exits non-zero when the plugin
/// refuses, traps or returns output the relay would dead-letter, and with
/// `--relay-config` it applies that relay's plugin bounds, targets and
/// broker topic rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_test_exit_code_follows_the_outcome() {
    let event = switchyard_tests::workspace_root().join("examples/events/order-paid.json");
    let event = event.to_str().unwrap();
    let misbehave = plugin("misbehave");
    let misbehave = misbehave.to_str().unwrap();
    let run = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        switchyard_tests::cli(env!("CARGO_BIN_EXE_relay-process"), &args, &[]).await
    };
    let test = |mode: &str| {
        [
            "plugin",
            "test",
            misbehave,
            "--event",
            event,
            "--config",
            &format!("mode={mode}"),
            "--config",
            "target=t",
        ]
        .map(String::from)
        .to_vec()
    };
    for (mode, ok) in [
        ("print", true),
        ("trap", false),
        ("panic", false),
        ("transient", false),
        ("nul-topic", false),
        ("unknown-target", true), // no relay config: any target name is accepted
    ] {
        let (code, out, err) = run(test(mode)).await;
        assert_eq!(code == 0, ok, "{mode}: exit {code}\n{out}\n{err}");
        if !ok {
            assert!(
                err.contains("1 of 1 event(s) would not be published"),
                "{mode}: {err}"
            );
        }
    }

    // With the relay's config: its targets, its topic rules, its time bound.
    let dir = std::env::temp_dir().join(format!("sy-plugin-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let relay = dir.join("relay.toml");
    let misbehaving = |name: &str, mode: &str| {
        Plugin::new(name, std::path::Path::new(misbehave))
            .config("mode", mode)
            .config("target", "events")
    };
    let text = TestConfig::new(&format!("sqlite://{}", dir.join("outbox.db").display()))
        .plugin(misbehaving("wild", "print"))
        .plugin(misbehaving("looper", "loop").set("timeout_ms", 50))
        .plugin(misbehaving("elsewhere", "unknown-target"))
        .plugin(Plugin::new("wildcard", &plugin("route_by_type")).to("events", "orders.*"))
        .target("events", Target::of("nats").set("url", "nats://127.0.0.1:4222"))
        .toml();
    std::fs::write(&relay, text).unwrap();
    let router = plugin("route_by_type");
    let with_relay = |name: &str, extra: &[&str]| {
        // The entry's config applies to the FILE under test.
        let file = if name == "wildcard" {
            router.to_str().unwrap()
        } else {
            misbehave
        };
        let mut args = [
            "plugin",
            "test",
            file,
            "--event",
            event,
            "--relay-config",
            relay.to_str().unwrap(),
            "--plugin",
            name,
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let (code, out, _) = run(with_relay("wild", &[])).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("topic=test.print"), "{out}");
    let (code, out, _) = run(with_relay("looper", &[])).await;
    assert_ne!(code, 0);
    assert!(
        out.contains("exceeded its time limit of 50 ms"),
        "the relay's timeout_ms applies: {out}"
    );
    let (code, out, _) = run(with_relay("elsewhere", &[])).await;
    assert_ne!(code, 0);
    assert!(out.contains("unknown target \"no-such-target\""), "{out}");
    // A subject NATS would refuse, caught before any broker sees it.
    let (code, out, _) = run(with_relay("wild", &["--config", "mode=huge-topic"])).await;
    assert_ne!(code, 0);
    assert!(out.contains("over the 1024 allowed"), "{out}");
    let (code, out, _) = run(with_relay("wildcard", &[])).await;
    assert_ne!(code, 0);
    assert!(
        out.contains("invalid NATS subject \"orders.*\""),
        "NATS's own rules apply: {out}"
    );
    // The JSON report names each problem by kind, for scripts.
    for (name, extra, problem) in [
        ("elsewhere", &[][..], "unknown_target"),
        ("wild", &["--config", "mode=huge-topic"][..], "topic_too_long"),
        ("wildcard", &[][..], "refused_by_target"),
    ] {
        let mut args = with_relay(name, extra);
        args.push("--json".into());
        let (code, out, err) = run(args).await;
        assert_ne!(code, 0);
        let report: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{name}: {e}: {out}{err}"));
        assert_eq!(report["events"][0]["outcome"], "invalid_output", "{out}");
        assert_eq!(report["events"][0]["problem"], problem, "{name}: {out}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
