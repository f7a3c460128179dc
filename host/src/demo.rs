//! `switchyard demo`: the whole path on one machine with nothing else
//! installed. A SQLite outbox, a sample order service writing business rows
//! and events in one transaction (one of them rolled back), the real example
//! plugins, and the stdout and file targets.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sqlx::SqlitePool;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::store::OutboxStore;

/// Where the example plugins are looked for when `--plugins` is not given.
fn plugin_dir_candidates() -> Vec<PathBuf> {
    let release = Path::new("plugins/target/wasm32-wasip2/release");
    let mut dirs = vec![release.to_path_buf()];
    if let Ok(exe) = std::env::current_exe() {
        // target/{debug,release}/switchyard -> the workspace root.
        if let Some(root) = exe.parent().and_then(Path::parent).and_then(Path::parent) {
            dirs.push(root.join(release));
        }
    }
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(release));
    dirs
}

fn find_plugins(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let candidates = match explicit {
        Some(dir) => vec![dir],
        None => plugin_dir_candidates(),
    };
    for dir in &candidates {
        if dir.join("route_by_type.wasm").is_file() {
            return Ok(std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone()));
        }
    }
    bail!(
        "the example plugins are not built (looked in {}); build them with:\n  \
         rustup target add wasm32-wasip2 && (cd plugins && cargo build --release)\n\
         or run scripts/demo.sh, which does both",
        candidates
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

fn demo_config(db_url: &str, plugins: &Path, archive: &Path) -> String {
    let plugin = |name: &str| plugins.join(format!("{name}.wasm")).display().to_string();
    format!(
        r#"
[database]
url = "{db_url}"
max_connections = 4

[relay]
batch_size = 100
concurrency = 2
poll_interval_ms = 50
lease_duration_ms = 10000
publish_timeout_ms = 2000
max_attempts = 3
initial_backoff_ms = 100

[plugin_runtime]
watch = false

# Payments: card number masked, internal note removed, CloudEvents envelope.
[[plugins]]
name = "redact"
path = "{redact}"
event_types = ["OrderPaid"]
[plugins.config]
target = "console"
topic = "payments.{{event_type}}"
mask = ["card.number"]
remove = ["internal_note"]
cloudevents = true
source = "/demo/order-service"

# New orders go to the console and to the archive file.
[[plugins]]
name = "fan-out"
path = "{fan_out}"
event_types = ["OrderCreated"]
[plugins.config.routes]
OrderCreated = [
  {{ target = "console", topic = "orders.created" }},
  {{ target = "archive", topic = "orders-archive" }},
]

# Everything else about orders: one topic per event type.
[[plugins]]
name = "router"
path = "{router}"
aggregate_types = ["order"]
[plugins.config]
target = "console"
topic = "orders.{{event_type}}"

[targets.console]
type = "stdout"

[targets.archive]
type = "file"
path = "{archive}"
"#,
        redact = plugin("redact_fields"),
        fan_out = plugin("fan_out"),
        router = plugin("route_by_type"),
        archive = archive.display(),
    )
}

/// One business change: the order row and its event, in one transaction.
async fn change(
    pool: &SqlitePool,
    order: &str,
    event_type: &str,
    payload: serde_json::Value,
    commit: bool,
) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO orders (id, status) VALUES (?1, ?2)
         ON CONFLICT (id) DO UPDATE SET status = excluded.status",
    )
    .bind(order)
    .bind(event_type)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('order', ?1, ?2, ?3, ?4)",
    )
    .bind(order)
    .bind(event_type)
    .bind(payload.to_string())
    .bind(
        serde_json::json!({ "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" })
            .to_string(),
    )
    .execute(&mut *tx)
    .await?;
    if commit {
        tx.commit().await?;
    } else {
        tx.rollback().await?;
    }
    Ok(())
}

/// The sample order service: four orders created and paid; three shipped,
/// and one shipment whose transaction fails and rolls back.
async fn place_orders(pool: &SqlitePool) -> anyhow::Result<()> {
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, status TEXT NOT NULL)")
        .execute(pool)
        .await?;
    for n in 1..=4 {
        let order = format!("ORD-{n}");
        let total = 1000 * n + 99;
        change(
            pool,
            &order,
            "OrderCreated",
            serde_json::json!({ "order_id": order, "total_cents": total }),
            true,
        )
        .await?;
        change(
            pool,
            &order,
            "OrderPaid",
            serde_json::json!({
                "order_id": order, "total_cents": total,
                "card": { "number": "4111111111111111", "brand": "visa" },
                "internal_note": "manual review skipped",
            }),
            true,
        )
        .await?;
        let shipped = n != 3;
        change(
            pool,
            &order,
            "OrderShipped",
            serde_json::json!({ "order_id": order, "carrier": "dhl" }),
            shipped,
        )
        .await?;
        println!(
            "order service: {order} created, paid, {}",
            if shipped {
                "shipped"
            } else {
                "shipment FAILED and rolled back"
            }
        );
    }
    Ok(())
}

/// Runs the demo in `dir` (a fresh temp directory when `None`).
///
/// # Errors
/// Missing plugins, or any failure along the way, with what failed.
pub async fn run(dir: Option<PathBuf>, plugins: Option<PathBuf>) -> anyhow::Result<()> {
    let plugins = find_plugins(plugins)?;
    let dir =
        dir.unwrap_or_else(|| std::env::temp_dir().join(format!("switchyard-demo-{}", std::process::id())));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let db = dir.join("outbox.db");
    let archive = dir.join("archive.jsonl");
    for stale in [&db, &archive] {
        let _ = std::fs::remove_file(stale);
    }
    let url = format!("sqlite://{}", db.display());
    println!("== switchyard demo: SQLite outbox {}", db.display());

    let store = OutboxStore::connect(&url, 4).await?;
    store.migrate().await?;
    let pool = SqlitePool::connect(&url).await?;
    place_orders(&pool).await?;

    let config = Config::from_toml(&demo_config(&url, &plugins, &archive), &dir, &|_| None)
        .map_err(|e| anyhow::anyhow!("demo config: {e}"))?;
    println!(
        "\n== relaying through the example plugins ({})\n",
        plugins.display()
    );
    let relay = crate::runtime::build(&config).await?;
    let shutdown = CancellationToken::new();
    let running = {
        let relay = relay.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    let started = Instant::now();
    loop {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')",
        )
        .fetch_one(&pool)
        .await?;
        if open == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            shutdown.cancel();
            bail!("{open} events still unpublished after 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    running.await.context("relay task")??;

    println!("\n== what was published where");
    let rows: Vec<(String, String, String, String, Option<String>)> = sqlx::query_as(
        "SELECT aggregate_id, event_type, status, deliveries, last_error FROM switchyard_outbox ORDER BY id",
    )
    .fetch_all(&pool)
    .await?;
    println!("{:<8} {:<14} {:<10} targets", "order", "event", "status");
    for (order, event_type, status, deliveries, error) in &rows {
        let deliveries: std::collections::BTreeMap<String, crate::store::Delivery> =
            serde_json::from_str(deliveries).unwrap_or_default();
        let targets: Vec<String> = deliveries
            .values()
            .map(|d| format!("{} -> {}", d.target, d.topic))
            .collect();
        let detail = match error {
            Some(error) => error.clone(),
            None => targets.join(", "),
        };
        println!("{order:<8} {event_type:<14} {status:<10} {detail}");
    }
    let published = rows.iter().filter(|r| r.2 == "published").count();
    println!(
        "\n{published} of {} events published (the rolled-back shipment of ORD-3 never reached the outbox).",
        rows.len()
    );
    println!("archive file: {}", archive.display());
    Ok(())
}
