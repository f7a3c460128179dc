//! The relay on the embedded SQLite outbox: per-aggregate order, retry with
//! backoff then dead-letter, at-least-once delivery after a crash, and rows
//! it cannot read or hold refused alone, checked in what the file target
//! wrote.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use switchyard_tests::config::{Plugin, Target, TestConfig};
use switchyard_tests::plugins::plugin;
use switchyard_tests::relay::{InProcess, RelaySection, parse};
use switchyard_tests::{eventually, exclusive, init_logging};

fn config(db_url: &str, out: &std::path::Path) -> String {
    TestConfig::new(db_url)
        .database("max_connections", 4)
        .tuning(RelaySection::quick().set("batch_size", "100"))
        .set("plugin_runtime", "watch", false)
        .set("plugin_runtime", "cache", false)
        .plugin(
            Plugin::new("slow", &plugin("misbehave"))
                .event_types(&["Slow"])
                .set("timeout_ms", 50)
                .config("mode", "loop")
                .config("target", "out"),
        )
        .plugin(Plugin::new("router", &plugin("route_by_type")).to("out", "orders.{event_type}"))
        .target("out", Target::file(out))
        .toml()
}

/// A migrated SQLite outbox in a directory of its own, beside the file
/// target's output.
struct Outbox {
    dir: std::path::PathBuf,
    url: String,
    out: std::path::PathBuf,
    pool: sqlx::SqlitePool,
}

impl Outbox {
    async fn fresh() -> Outbox {
        let dir = std::env::temp_dir().join(format!("sy-sqlite-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("outbox.db").display());
        let store = switchyard::store::OutboxStore::connect(&url, 2).await.unwrap();
        store.migrate().await.unwrap();
        Outbox {
            out: dir.join("out.jsonl"),
            pool: sqlx::SqlitePool::connect(&url).await.unwrap(),
            url,
            dir,
        }
    }
}

/// Rows in a status.
async fn count(pool: &sqlx::SqlitePool, status: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = ?1")
        .bind(status)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_relay_keeps_order_retries_dead_letters_and_survives_a_crash() {
    init_logging();
    let _heavy = exclusive().await;
    let Outbox { dir, url, out, pool } = Outbox::fresh().await;

    let mut expected = HashMap::new();
    for seq in 0..40 {
        for aggregate in 0..50 {
            let id: String = sqlx::query_scalar(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', ?1, 'OrderUpdated', ?2) RETURNING event_id",
            )
            .bind(format!("o-{aggregate}"))
            .bind(serde_json::json!({ "seq": seq }).to_string())
            .fetch_one(&pool)
            .await
            .unwrap();
            expected.insert(id, (format!("o-{aggregate}"), seq));
        }
    }
    let count = |status: &'static str| count(&pool, status);

    let config = parse(&config(&url, &out));
    // Crash mid-batch: an abort between batches leaves no lease behind, so
    // crash again (further on) until one catches rows in flight.
    let mut caught = 0;
    for round in 1..=20 {
        let first = InProcess::start(&config).await;
        eventually("some published", Duration::from_secs(30), || async {
            (count("published").await >= 100 * round).then_some(())
        })
        .await;
        first.abort().await; // crash: in-flight leases stay behind
        tokio::time::sleep(Duration::from_millis(50)).await;
        caught = count("in_flight").await;
        if caught > 0 {
            break;
        }
    }
    assert!(caught > 0, "no crash caught a batch in flight");
    let second = InProcess::start(&config).await;
    // Written after the crash: a crash during its plugin call would expire
    // its lease and spend an attempt, which is not what this part checks.
    sqlx::query("INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'slow', 'Slow', '{}')")
        .execute(&pool)
        .await
        .unwrap();
    eventually("all published", Duration::from_secs(60), || async {
        (count("published").await == 2000).then_some(())
    })
    .await;
    eventually("slow event dead", Duration::from_secs(30), || async {
        (count("dead").await == 1).then_some(())
    })
    .await;
    second.stop().await;

    let (attempts, error): (i64, String) =
        sqlx::query_as("SELECT attempts, last_error FROM switchyard_outbox WHERE status = 'dead'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(attempts, 2, "retried once with backoff, then dead-lettered");
    assert!(
        error.starts_with("gave up after 2 attempts: plugin slow@"),
        "{error}"
    );
    assert!(error.contains("exceeded its time limit of 50 ms"), "{error}");

    let taken_over: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox WHERE status = 'published' AND attempts > 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        taken_over > 0,
        "the crashed relay's leases expired and its rows were claimed again"
    );

    let text = std::fs::read_to_string(&out).unwrap();
    let mut seen = HashSet::new();
    let mut next: HashMap<String, u64> = HashMap::new();
    let mut duplicates = 0;
    for line in text.lines() {
        let line: serde_json::Value = serde_json::from_str(line).unwrap();
        let id = line["event_id"].as_str().unwrap().to_string();
        if !seen.insert(id.clone()) {
            duplicates += 1;
            continue;
        }
        let (aggregate, seq) = &expected[&id];
        assert_eq!(line["key"], aggregate.as_str());
        let want = next.entry(aggregate.clone()).or_insert(0);
        assert_eq!(*seq as u64, *want, "aggregate {aggregate} out of order");
        *want += 1;
    }
    assert_eq!(seen.len(), 2000, "nothing lost across the crash");
    assert!(
        duplicates <= 200,
        "duplicates bounded by the crashed batches: {duplicates}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Rows the relay cannot read or would not hold (a text `created_at` set by
/// an UPDATE, payloads over `max_payload_bytes`) are dead-lettered alone,
/// naming why, while the relay publishes everything around them in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_relay_refuses_unreadable_and_oversized_rows_alone() {
    init_logging();
    let Outbox { dir, url, out, pool } = Outbox::fresh().await;
    let big = format!("{{\"blob\": \"{}\"}}", "x".repeat(2 << 20));
    for seq in 0..10 {
        for aggregate in ["a", "b", "c"] {
            let payload = if aggregate == "c" && seq % 3 == 0 {
                big.clone()
            } else {
                serde_json::json!({ "seq": seq }).to_string()
            };
            sqlx::query(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', ?1, 'OrderUpdated', ?2)",
            )
            .bind(aggregate)
            .bind(payload)
            .execute(&pool)
            .await
            .unwrap();
        }
    }
    sqlx::query("UPDATE switchyard_outbox SET created_at = 'yesterday' WHERE aggregate_id = 'b' AND payload = '{\"seq\":4}'")
        .execute(&pool)
        .await
        .unwrap();

    let relay = InProcess::start(&parse(&config(&url, &out))).await;
    let count = |status: &'static str| count(&pool, status);
    eventually("all settled", Duration::from_secs(30), || async {
        (count("published").await + count("dead").await == 30).then_some(())
    })
    .await;
    relay.stop().await;

    let dead: Vec<(String, String)> = sqlx::query_as(
        "SELECT aggregate_id, last_error FROM switchyard_outbox WHERE status = 'dead' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(dead.len(), 5, "{dead:?}");
    for (aggregate, error) in &dead {
        let expected = if aggregate == "b" {
            "column created_at holds TEXT where INTEGER is expected"
        } else {
            "over relay.max_payload_bytes (1048576)"
        };
        assert!(error.contains(expected), "{aggregate}: {error}");
    }
    let text = std::fs::read_to_string(&out).unwrap();
    let mut last: HashMap<String, i64> = HashMap::new();
    for line in text.lines() {
        let line: serde_json::Value = serde_json::from_str(line).unwrap();
        let aggregate = line["key"].as_str().unwrap().to_string();
        let seq = line["payload"]["seq"].as_i64().unwrap();
        let previous = last.insert(aggregate.clone(), seq);
        assert!(previous < Some(seq), "{aggregate}: {previous:?} then {seq}");
    }
    assert_eq!(text.lines().count(), 25, "everything else published once");
    let _ = std::fs::remove_dir_all(dir);
}
