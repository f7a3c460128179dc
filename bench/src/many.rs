//! `relay-bench --many-databases 1,10,100,500 [--concurrency 1] [--connections-per-server N]`:
//! one relay serving N outbox
//! databases (`[[databases]]`), idle and then with every database written
//! at 10 events/s: the relay's CPU and PostgreSQL's transactions per
//! second while idle, commit-to-publish p50 and p99 under load, and the
//! sessions the relay holds.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use switchyard::store::OutboxStore;
use tokio_util::sync::CancellationToken;

use super::{CpuMark, Services, admin_pool, plugin_file, recreate_db};

/// Seconds idle, then seconds under load, per database count.
const IDLE: Duration = Duration::from_secs(20);
const LOADED: Duration = Duration::from_secs(20);
/// Events per second per database under load.
const RATE: u64 = 10;

struct Figures {
    databases: usize,
    idle_relay_cpu_pct: f64,
    idle_postgres_cpu_pct: f64,
    idle_xacts_per_s: f64,
    loaded_relay_cpu_pct: f64,
    loaded_postgres_cpu_pct: f64,
    p50_ms: f64,
    p99_ms: f64,
    events: i64,
    sessions: i64,
}

fn name(i: usize) -> String {
    format!("sy_bench_many_{i:03}")
}

/// How the relay is set up, the same for every database count.
#[derive(Clone, Copy)]
struct Setup {
    concurrency: u32,
    per_server: Option<u32>,
}

fn config(
    services: &Services,
    count: usize,
    setup: Setup,
    plugin: &std::path::Path,
) -> anyhow::Result<switchyard::Config> {
    let concurrency = setup.concurrency;
    let budget = setup
        .per_server
        .map(|n| format!("[connections]\nper_server = {n}\n"))
        .unwrap_or_default();
    let listed: String = (0..count)
        .map(|i| {
            format!(
                "[[databases]]\nname = \"db{i:03}\"\nurl = \"{}\"\nmax_connections = {}\n\n",
                services.db_url(&name(i)),
                concurrency + 1
            )
        })
        .collect();
    let text = format!(
        r#"{listed}
{budget}
[relay]
concurrency = {concurrency}
[plugin_runtime]
cache = false
[admin]
listen = ""
[[plugins]]
name = "router"
path = "{plugin}"
[plugins.config]
target = "out"
topic = "many.{{event_type}}"
[targets.out]
type = "nats"
url = "{nats}"
stream = {{ name = "MANY", subjects = ["many.>"] }}
"#,
        plugin = plugin.display(),
        nats = services.nats_url,
    );
    switchyard::Config::from_toml(&text, std::path::Path::new("."), &|_| None)
        .map_err(|e| anyhow::anyhow!("bench config: {e:?}"))
}

/// Transactions committed so far in the bench's databases.
async fn xacts(admin: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT coalesce(sum(xact_commit + xact_rollback), 0)::bigint FROM pg_stat_database
          WHERE datname LIKE 'sy_bench_many_%'",
    )
    .fetch_one(admin)
    .await?)
}

async fn sessions(admin: &PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'switchyard %'",
        )
        .fetch_one(admin)
        .await?,
    )
}

/// Writes `RATE` events/s into each database for `LOADED`.
async fn load(pools: &[PgPool]) {
    let until = Instant::now() + LOADED;
    let writers = pools.iter().cloned().map(|pool| {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE));
            let mut n = 0_u64;
            while Instant::now() < until {
                tick.tick().await;
                let _ = sqlx::query(
                    "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', $1, 'OrderPlaced', '{\"total\": 1}')",
                )
                .bind(format!("order-{}", n % 50))
                .execute(&pool)
                .await;
                n += 1;
            }
        })
    });
    futures::future::join_all(writers).await;
}

async fn one(
    services: &Services,
    count: usize,
    setup: Setup,
    plugin: &std::path::Path,
) -> anyhow::Result<Figures> {
    use futures::StreamExt;
    let admin = admin_pool(services).await?;
    for i in 0..count {
        recreate_db(&admin, &name(i), None).await?;
    }
    let migrated: Vec<anyhow::Result<()>> = futures::stream::iter(0..count)
        .map(|i| async move {
            let store = OutboxStore::connect(&services.db_url(&name(i)), 2).await?;
            store.migrate().await?;
            store.close().await;
            Ok(())
        })
        .buffer_unordered(8)
        .collect()
        .await;
    migrated.into_iter().collect::<anyhow::Result<()>>()?;
    let shutdown = CancellationToken::new();
    let fleet =
        switchyard::fleet::Fleet::start(config(services, count, setup, plugin)?, shutdown.clone()).await?;
    let started = Instant::now();
    while fleet.relay(&format!("db{:03}", count - 1)).is_none()
        || fleet
            .databases()
            .values()
            .any(|s| !matches!(s, switchyard::fleet::DatabaseState::Running(_)))
    {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(300),
            "databases not served in 5 min"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Let the start settle before measuring idle: idle polls spread out to
    // their longest pause within 7.5 s of the last claim that found rows.
    let settle = Duration::from_secs(10 + u64::try_from(count / 50).unwrap_or(0));
    tokio::time::sleep(settle).await;
    let (cpu0, x0) = (CpuMark::now(), xacts(&admin).await?);
    tokio::time::sleep(IDLE).await;
    let (idle_cpu, x1) = (CpuMark::now().since(cpu0), xacts(&admin).await?);
    let sessions = sessions(&admin).await?;
    let mut pools = Vec::new();
    for i in 0..count {
        pools.push(
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&services.db_url(&name(i)))
                .await?,
        );
    }
    let cpu1 = CpuMark::now();
    load(&pools).await;
    let loaded_cpu = CpuMark::now().since(cpu1);
    // Every event publishes (within two minutes); then read commit-to-publish
    // from every row, the slowest included.
    let waited = Instant::now();
    while waited.elapsed() < Duration::from_secs(120) {
        let mut left = 0_i64;
        for pool in &pools {
            left += sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM switchyard_outbox WHERE published_at IS NULL",
            )
            .fetch_one(pool)
            .await?;
        }
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut latencies = Vec::new();
    for pool in &pools {
        // An event still unpublished counts as the slowest there can be.
        let ms: Vec<f64> = sqlx::query_scalar(
            "SELECT coalesce(EXTRACT(EPOCH FROM published_at - created_at) * 1000, 'Infinity')::float8
               FROM switchyard_outbox",
        )
        .fetch_all(pool)
        .await?;
        latencies.extend(ms);
        pool.close().await;
    }
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    shutdown.cancel();
    fleet.stopped().await;
    for i in 0..count {
        sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", name(i)))
            .execute(&admin)
            .await?;
    }
    let pct = |seconds: f64, over: Duration| seconds * 100.0 / over.as_secs_f64();
    Ok(Figures {
        databases: count,
        idle_relay_cpu_pct: pct(idle_cpu.relay, IDLE),
        idle_postgres_cpu_pct: pct(idle_cpu.postgres, IDLE),
        idle_xacts_per_s: (x1 - x0) as f64 / IDLE.as_secs_f64(),
        loaded_relay_cpu_pct: pct(loaded_cpu.relay, LOADED),
        loaded_postgres_cpu_pct: pct(loaded_cpu.postgres, LOADED),
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        events: latencies.len() as i64,
        sessions,
    })
}

pub(super) async fn run(
    services: &Services,
    counts: &[usize],
    concurrency: u32,
    per_server: Option<u32>,
) -> anyhow::Result<()> {
    let plugin = plugin_file();
    let setup = Setup {
        concurrency,
        per_server,
    };
    let mut rows = Vec::new();
    for &count in counts {
        eprintln!("many databases: {count} ...");
        rows.push(one(services, count, setup, &plugin).await?);
    }
    println!();
    println!(
        "workers per database: {concurrency}; connections per server: {}",
        per_server.map_or("no cap".to_string(), |n| n.to_string())
    );
    println!(
        "| databases | idle: relay CPU | idle: PostgreSQL CPU | idle: transactions/s | {RATE} ev/s each: relay and writers CPU | PostgreSQL CPU | commit-to-publish p50 / p99 | events written | relay sessions |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        println!(
            "| {} | {:.1}% | {:.1}% | {:.0} | {:.1}% | {:.1}% | {:.1} / {:.1} ms | {} | {} |",
            row.databases,
            row.idle_relay_cpu_pct,
            row.idle_postgres_cpu_pct,
            row.idle_xacts_per_s,
            row.loaded_relay_cpu_pct,
            row.loaded_postgres_cpu_pct,
            row.p50_ms,
            row.p99_ms,
            row.events,
            row.sessions
        );
    }
    Ok(())
}
