//! `relay-bench --mysql`: PostgreSQL claim mode against MariaDB claim mode
//! and MariaDB binlog mode side by side, in rounds that alternate which
//! runs first: the drain of
//! a backlog (100,000 rows by default), the database server's CPU per
//! event and commit-to-consumer latency at 100 and 500 events/s (each
//! event its own transaction, as services write), to NATS JetStream
//! through the Rust route-by-type plugin.
//!
//! ```text
//! scripts/services.sh start && eval "$(scripts/services.sh env)"
//! (cd plugins && cargo build --release)
//! cargo run --release -p switchyard-bench --bin relay-bench -- --mysql [--rows 100000 --repeat 3]
//! ```

use std::time::{Duration, Instant};

use futures::StreamExt;
use switchyard::store::{OutboxStore, PublishedRows};

use super::{
    Args, CpuMark, Running, Services, Target, admin_pool, drop_db, now_us, recreate_db, relay_config,
};

/// The two servers, MariaDB in either mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    Postgres,
    MariaDb,
    MariaDbBinlog,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::Postgres => "PostgreSQL",
            Server::MariaDb => "MariaDB",
            Server::MariaDbBinlog => "MariaDB binlog",
        }
    }

    fn binlog(self) -> bool {
        self == Server::MariaDbBinlog
    }
}

/// A fresh database on `server`, migrated; its URL.
async fn fresh(services: &Services, server: Server, name: &str) -> anyhow::Result<String> {
    let url = match server {
        Server::Postgres => {
            let admin = admin_pool(services).await?;
            recreate_db(&admin, name, None).await?;
            services.db_url(name)
        }
        Server::MariaDb | Server::MariaDbBinlog => {
            let mut admin = mariadb_admin().await?;
            sqlx::raw_sql(&format!(
                "DROP DATABASE IF EXISTS `{name}`; CREATE DATABASE `{name}`"
            ))
            .execute(&mut admin)
            .await?;
            switchyard_tests::mariadb::url_of(name)
        }
    };
    let store = OutboxStore::connect(&url, 2).await?;
    store.migrate().await?;
    if server.binlog() {
        let binlog = store
            .binlog()
            .ok_or_else(|| anyhow::anyhow!("binlog mode needs MariaDB"))?;
        let statements = binlog.feed_statements(Some("switchyard")).await?;
        binlog.run_feed_statements(&statements).await?;
    }
    Ok(url)
}

async fn mariadb_admin() -> anyhow::Result<sqlx::MySqlConnection> {
    use sqlx::Connection;
    let url = switchyard_tests::mariadb::server_url();
    sqlx::MySqlConnection::connect(&url)
        .await
        .map_err(|e| anyhow::anyhow!("MariaDB at {url} (run scripts/services.sh start): {e}"))
}

async fn drop_fresh(services: &Services, server: Server, name: &str) -> anyhow::Result<()> {
    match server {
        Server::Postgres => drop_db(services, name).await,
        Server::MariaDb | Server::MariaDbBinlog => {
            let mut admin = mariadb_admin().await?;
            sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS `{name}`"))
                .execute(&mut admin)
                .await?;
            Ok(())
        }
    }
}

/// The database server's CPU seconds between two marks.
fn server_cpu(server: Server, from: &CpuMark, to: &CpuMark) -> f64 {
    match server {
        Server::Postgres => to.clone().since(from.clone()).postgres,
        Server::MariaDb | Server::MariaDbBinlog => to.mariadb - from.mariadb,
    }
}

/// One server's pool, as a service writes through it.
#[derive(Clone)]
enum Writer {
    Postgres(sqlx::PgPool),
    MariaDb(sqlx::MySqlPool),
}

impl Writer {
    async fn connect(server: Server, url: &str, connections: u32) -> anyhow::Result<Writer> {
        Ok(match server {
            // A commit as services make it (the test server's default is
            // `synchronous_commit = off`).
            Server::Postgres => {
                let options: sqlx::postgres::PgConnectOptions = url.parse()?;
                Writer::Postgres(
                    sqlx::postgres::PgPoolOptions::new()
                        .max_connections(connections)
                        .connect_with(options.options([("synchronous_commit", "on")]))
                        .await?,
                )
            }
            Server::MariaDb | Server::MariaDbBinlog => Writer::MariaDb(
                sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(connections)
                    .connect(url)
                    .await?,
            ),
        })
    }

    /// Event `n` in a transaction of its own, carrying its send time.
    async fn write_one(&self, n: u64) -> anyhow::Result<()> {
        let n = i64::try_from(n)?;
        let payload = serde_json::json!({
            "sent_us": now_us(), "seq": n, "currency": "EUR", "total_cents": 12900, "customer_id": "cust-42"
        })
        .to_string();
        let aggregate = format!("order-{}", (n * 7919) % 10_000);
        match self {
            Writer::Postgres(pool) => {
                sqlx::query(
                    "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', $1, 'OrderCreated', $2::jsonb)",
                )
                .bind(aggregate)
                .bind(payload)
                .execute(pool)
                .await?;
            }
            Writer::MariaDb(pool) => {
                sqlx::query(
                    "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', ?, 'OrderCreated', ?)",
                )
                .bind(aggregate)
                .bind(payload)
                .execute(pool)
                .await?;
            }
        }
        Ok(())
    }

    /// `rows` events over `aggregates`, 1,000 to a statement.
    async fn load(&self, rows: u64, aggregates: u64) -> anyhow::Result<()> {
        let mut from = 0;
        while from < rows {
            let to = (from + 1_000).min(rows);
            let values: Vec<String> = (from..to)
                .map(|n| {
                    format!(
                        "('order', 'order-{:06}', 'OrderCreated', '{{\"seq\": {n}, \"currency\": \"EUR\", \"total_cents\": {}}}')",
                        n % aggregates,
                        1000 + n % 90_000
                    )
                })
                .collect();
            let sql = format!(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES {}",
                values.join(", ")
            );
            match self {
                Writer::Postgres(pool) => {
                    sqlx::raw_sql(&sql).execute(pool).await?;
                }
                Writer::MariaDb(pool) => {
                    sqlx::raw_sql(&sql).execute(pool).await?;
                }
            }
            from = to;
        }
        Ok(())
    }

    async fn unfinished(&self) -> anyhow::Result<i64> {
        let sql = "SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')";
        Ok(match self {
            Writer::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
            Writer::MariaDb(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
        })
    }

    async fn close(&self) {
        match self {
            Writer::Postgres(pool) => pool.close().await,
            Writer::MariaDb(pool) => pool.close().await,
        }
    }
}

/// A drain's figures.
struct Drained {
    events_per_second: f64,
    server_ms_per_event: f64,
    relay_ms_per_event: f64,
}

/// A relay on `url` to a fresh JetStream stream, built, not started.
async fn nats_relay(
    services: &Services,
    args: &Args,
    url: &str,
    server: Server,
) -> anyhow::Result<switchyard::Relay> {
    super::reset_brokers(services, Target::Nats).await?;
    let mut config = relay_config(
        url,
        services,
        args,
        Target::Nats,
        &super::plugin_file(),
        PublishedRows::Keep,
    )?;
    if server.binlog() {
        super::replication::configure(&mut config, "switchyard");
    }
    switchyard::runtime::build(&config).await
}

/// Messages in the bench's JetStream stream (0 before it exists).
async fn stream_len(services: &Services) -> anyhow::Result<u64> {
    let client = async_nats::connect(&services.nats_url).await?;
    let js = async_nats::jetstream::new(client);
    Ok(match js.get_stream("BENCH").await {
        Ok(mut stream) => stream.info().await?.state.messages,
        Err(_) => 0,
    })
}

/// `args.rows` rows written with the relay stopped, then drained.
async fn drain(services: &Services, args: &Args, server: Server) -> anyhow::Result<Drained> {
    let name = "sy_bench_mysql_drain";
    let url = fresh(services, server, name).await?;
    let writer = Writer::connect(server, &url, 2).await?;
    writer.load(args.rows, args.aggregates).await?;
    let relay = nats_relay(services, args, &url, server).await?;
    let cpu = CpuMark::now();
    let started = Instant::now();
    let running = Running::start(&relay);
    // In binlog mode the rows stay `streamed`: the stream says when.
    while writer.unfinished().await? > 0 || (server.binlog() && stream_len(services).await? < args.rows) {
        anyhow::ensure!(!running.task.is_finished(), "the relay stopped early");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let end = CpuMark::now();
    running.stop().await?;
    let events = args.rows.max(1) as f64;
    let figures = Drained {
        events_per_second: events / elapsed,
        server_ms_per_event: server_cpu(server, &cpu, &end) * 1000.0 / events,
        relay_ms_per_event: end.clone().since(cpu).relay * 1000.0 / events,
    };
    drop(relay);
    writer.close().await;
    drop_fresh(services, server, name).await?;
    Ok(figures)
}

/// A steady run's figures.
struct Steady {
    server_ms_per_event: f64,
    relay_ms_per_event: f64,
    p50_ms: f64,
    p99_ms: f64,
    received: usize,
}

/// `rate` events/s for `args.latency_seconds`, each its own transaction.
async fn steady(services: &Services, args: &Args, server: Server, rate: u64) -> anyhow::Result<Steady> {
    let name = "sy_bench_mysql_steady";
    let url = fresh(services, server, name).await?;
    let writer = Writer::connect(server, &url, 8).await?;
    let relay = nats_relay(services, args, &url, server).await?;
    let running = Running::start(&relay);
    let client = async_nats::connect(&services.nats_url).await?;
    let mut subscription = client.subscribe("bench.>").await?;
    client.flush().await?;
    let total = rate * args.latency_seconds;
    let consumer = tokio::spawn(async move {
        let mut latencies = Vec::new();
        while (latencies.len() as u64) < total
            && let Ok(Some(message)) =
                tokio::time::timeout(Duration::from_secs(10), subscription.next()).await
        {
            let arrived = now_us();
            if let Some(sent) = serde_json::from_slice::<serde_json::Value>(&message.payload)
                .ok()
                .and_then(|v| v["sent_us"].as_u64())
            {
                latencies.push(arrived.saturating_sub(sent));
            }
        }
        latencies
    });
    // Settled first: the relay's start (plugin compile) is not measured.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let cpu = CpuMark::now();
    let per_tick = (rate / 100).max(1);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sent = 0;
    while sent < total {
        tick.tick().await;
        let n = per_tick.min(total - sent);
        futures::future::try_join_all((sent..sent + n).map(|at| writer.write_one(at))).await?;
        sent += n;
    }
    let mut latencies = consumer.await?;
    let end = CpuMark::now();
    running.stop().await?;
    latencies.sort_unstable();
    let percentile = |p: f64| {
        latencies
            .get(((latencies.len().saturating_sub(1)) as f64 * p).round() as usize)
            .map_or(f64::NAN, |us| *us as f64 / 1000.0)
    };
    let events = total.max(1) as f64;
    let figures = Steady {
        server_ms_per_event: server_cpu(server, &cpu, &end) * 1000.0 / events,
        relay_ms_per_event: end.clone().since(cpu).relay * 1000.0 / events,
        p50_ms: percentile(0.5),
        p99_ms: percentile(0.99),
        received: latencies.len(),
    };
    drop(relay);
    writer.close().await;
    drop_fresh(services, server, name).await?;
    Ok(figures)
}

pub(super) async fn run(services: &Services, args: &Args) -> anyhow::Result<()> {
    let mut drains: Vec<(Server, Drained)> = Vec::new();
    let mut steadies: Vec<(Server, u64, Steady)> = Vec::new();
    for round in 0..args.repeat {
        let order = if round % 2 == 0 {
            [Server::Postgres, Server::MariaDb, Server::MariaDbBinlog]
        } else {
            [Server::MariaDbBinlog, Server::MariaDb, Server::Postgres]
        };
        for server in order {
            eprintln!(
                "round {}: {} drain of {} ...",
                round + 1,
                server.name(),
                args.rows
            );
            drains.push((server, drain(services, args, server).await?));
        }
        for rate in [100, 500] {
            for server in order {
                eprintln!("round {}: {} at {rate} events/s ...", round + 1, server.name());
                steadies.push((server, rate, steady(services, args, server, rate).await?));
            }
        }
    }
    println!();
    println!(
        "PostgreSQL claim mode against MariaDB claim and binlog mode; NATS JetStream, Rust route-by-type, batch {} x {}",
        args.batch_size, args.concurrency
    );
    println!("drain of {} rows over {} aggregates:", args.rows, args.aggregates);
    println!(
        "{:<15} {:>10} {:>16} {:>16}",
        "server", "events/s", "server CPU ms/ev", "relay CPU ms/ev"
    );
    for (server, run) in &drains {
        println!(
            "{:<15} {:>10.0} {:>16.3} {:>16.3}",
            server.name(),
            run.events_per_second,
            run.server_ms_per_event,
            run.relay_ms_per_event
        );
    }
    println!(
        "steady, one event per transaction, {} s per run (commit to consumer):",
        args.latency_seconds
    );
    println!(
        "{:<15} {:>6} {:>16} {:>16} {:>8} {:>8} {:>9}",
        "server", "rate", "server CPU ms/ev", "relay CPU ms/ev", "p50 ms", "p99 ms", "received"
    );
    for (server, rate, run) in &steadies {
        println!(
            "{:<15} {:>6} {:>16.3} {:>16.3} {:>8.1} {:>8.1} {:>9}",
            server.name(),
            rate,
            run.server_ms_per_event,
            run.relay_ms_per_event,
            run.p50_ms,
            run.p99_ms,
            run.received
        );
    }
    Ok(())
}
