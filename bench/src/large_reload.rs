//! `relay-bench --large-reload`: the 18 MB Python component hot-reloaded
//! while a Rust plugin carries a steady load. Prints rename-to-live for the
//! large component, and the Rust plugin's events (rate, latency, longest
//! gap between arrivals) before, during and after the compilation.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use switchyard::{Config, OutboxStore};

use super::{
    Args, Running, Services, Target, admin_pool, drop_db, now_us, plugin_file, recreate_db, reset_brokers,
};

/// Orders per second through the Rust plugin.
const RATE: u64 = 1_000;
/// Seconds of load; the rename happens at [`RENAME_AT`].
const SECONDS: u64 = 30;
const RENAME_AT: u64 = 6;

/// One message as the subscriber saw it.
struct Arrival {
    at_us: u64,
    latency_us: u64,
    audit: bool,
    plugin: String,
}

fn config(url: &str, services: &Services, python: &Path) -> anyhow::Result<Config> {
    let text = format!(
        r#"
[database]
url = "{url}"
max_connections = 12
[relay]
batch_size = 500
concurrency = 4
[plugin_runtime]
cache = false
reload_debounce_ms = 50
[admin]
listen = ""
[[plugins]]
name = "audit"
path = "{python}"
event_types = ["Audit"]
timeout_ms = 1000
[plugins.config]
target = "out"
topic = "bench.{{event_type}}"
[[plugins]]
name = "router"
path = "{rust}"
[plugins.config]
target = "out"
topic = "bench.{{event_type}}"
[targets.out]
type = "nats"
url = "{nats}"
stream = {{ name = "BENCH", subjects = ["bench.>"] }}
"#,
        python = python.display(),
        rust = plugin_file().display(),
        nats = services.nats_url,
    );
    Config::from_toml(&text, Path::new("."), &|_| None).map_err(|e| anyhow::anyhow!("bench config: {e:?}"))
}

/// Runs the measurement and prints its table.
///
/// # Errors
/// A missing Python component (run `scripts/plugin-toolchains.sh`), or any
/// service failing.
pub(crate) async fn run(services: &Services, _args: &Args) -> anyhow::Result<()> {
    let source = super::workspace_root().join("plugins/target/python/route_by_type.wasm");
    anyhow::ensure!(
        source.is_file(),
        "{} is missing: run scripts/plugin-toolchains.sh",
        source.display()
    );
    let admin = admin_pool(services).await?;
    let name = "sy_bench_large_reload";
    recreate_db(&admin, name, None).await?;
    let url = services.db_url(name);
    let store = OutboxStore::connect(&url, 4).await?;
    store.migrate().await?;
    let pool = sqlx::PgPool::connect(&url).await?;
    reset_brokers(services, Target::Nats).await?;

    let dir = std::env::temp_dir().join("sy-bench-large-reload");
    std::fs::create_dir_all(&dir)?;
    let python = dir.join("audit.wasm");
    let original = std::fs::read(&source)?;
    std::fs::write(&python, &original)?;
    eprintln!(
        "large reload: starting the relay ({} MB Python component compiles first) ...",
        original.len() / 1_000_000
    );
    let relay = switchyard::runtime::build(&config(&url, services, &python)?).await?;
    let running = Running::start(&relay);

    let client = async_nats::connect(&services.nats_url).await?;
    let mut subscription = client.subscribe("bench.>").await?;
    client.flush().await?;
    let audits = SECONDS * 10;
    let total = RATE * SECONDS + audits;
    let consumer = tokio::spawn(async move {
        let mut arrivals = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
        while let Ok(Some(message)) = tokio::time::timeout(Duration::from_secs(30), subscription.next()).await
        {
            let at_us = now_us();
            let body = serde_json::from_slice::<serde_json::Value>(&message.payload).unwrap_or_default();
            let plugin = message
                .headers
                .as_ref()
                .and_then(|h| h.get("Switchyard-Plugin"))
                .map(|v| v.as_str().to_string())
                .unwrap_or_default();
            arrivals.push(Arrival {
                at_us,
                latency_us: at_us.saturating_sub(body["sent_us"].as_u64().unwrap_or(at_us)),
                audit: message.subject.as_str() == "bench.Audit",
                plugin,
            });
            if arrivals.len() as u64 >= total {
                break;
            }
        }
        arrivals
    });

    let variant = switchyard_tests::plugins::with_custom_section(&original, 11);
    let new_version = switchyard::plugin::content_hash(&variant);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let (mut sent, mut ticks, mut renamed_us, mut audits_sent) = (0u64, 0u64, 0u64, 0u64);
    let started_us = now_us();
    while sent < RATE * SECONDS {
        tick.tick().await;
        if renamed_us == 0 && ticks >= RENAME_AT * 100 {
            renamed_us = now_us();
            switchyard_tests::plugins::replace_atomically(&python, &variant);
        }
        let audit = ticks % 10 == 0 && audits_sent < audits;
        audits_sent += u64::from(audit);
        let n = RATE / 100;
        sqlx::query(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'order-' || ((($1::bigint + n) * 7919) % 10000),
                    CASE WHEN n = 0 AND $4 THEN 'Audit' ELSE 'OrderCreated' END,
                    jsonb_build_object('sent_us', $2::bigint, 'seq', $1::bigint + n)
               FROM generate_series(0, $3::bigint - 1 + $4::int) n",
        )
        .bind(i64::try_from(sent)?)
        .bind(i64::try_from(now_us())?)
        .bind(i64::try_from(n)?)
        .bind(audit)
        .execute(&pool)
        .await?;
        sent += n;
        ticks += 1;
    }
    let arrivals = consumer.await?;
    running.stop().await?;
    drop(relay);
    pool.close().await;
    drop_db(services, name).await?;
    let _ = std::fs::remove_dir_all(&dir);

    let live_us = arrivals
        .iter()
        .filter(|a| a.audit && a.plugin.ends_with(&new_version))
        .map(|a| a.at_us)
        .min()
        .context("no event reached the reloaded Python component")?;
    let old_during = arrivals
        .iter()
        .filter(|a| {
            a.audit && a.at_us >= renamed_us && a.at_us < live_us && !a.plugin.ends_with(&new_version)
        })
        .count();
    let ended_us = arrivals.iter().map(|a| a.at_us).max().unwrap_or(live_us);
    println!(
        "Hot reload of a {} MB component under load, {} ({} events/s through the Rust plugin, 10/s through the Python one)",
        original.len() / 1_000_000,
        chrono::Utc::now().format("%Y-%m-%d"),
        RATE
    );
    println!(
        "rename to live: {:.0} ms (compiling off the relay path; {old_during} Python-routed events went through the old version meanwhile)",
        (live_us - renamed_us) as f64 / 1000.0
    );
    println!();
    println!("| Rust plugin's events | window | rate | latency p50 / p99 / max | longest gap |");
    println!("|---|---|---|---|---|");
    for (label, from, to) in [
        ("before the rename", started_us + 1_000_000, renamed_us),
        ("while it compiles", renamed_us, live_us),
        ("after it is live", live_us, ended_us),
    ] {
        let mut window: Vec<&Arrival> = arrivals
            .iter()
            .filter(|a| !a.audit && a.at_us >= from && a.at_us < to)
            .collect();
        window.sort_by_key(|a| a.at_us);
        let seconds = (to.saturating_sub(from)) as f64 / 1e6;
        let mut latencies: Vec<u64> = window.iter().map(|a| a.latency_us).collect();
        latencies.sort_unstable();
        let at = |p: f64| {
            latencies
                .get(((latencies.len().max(1) - 1) as f64 * p).round() as usize)
                .map_or(f64::NAN, |us| *us as f64 / 1000.0)
        };
        let gap = window
            .windows(2)
            .map(|pair| pair[1].at_us - pair[0].at_us)
            .max()
            .unwrap_or(0);
        println!(
            "| {label} | {seconds:.1} s | {:.0} /s | {:.1} / {:.1} / {:.1} ms | {:.1} ms |",
            window.len() as f64 / seconds,
            at(0.5),
            at(0.99),
            at(1.0),
            gap as f64 / 1000.0
        );
    }
    Ok(())
}
