//! The relay benchmark, run by hand: drain throughput to NATS JetStream and
//! to Kafka (and to the Pub/Sub emulator) against the raw SQL claim/ack
//! ceiling measured in the same run,
//! the current schema generation against the previous one (an outbox
//! migrated only that far: no intake) and against a minimal SKIP LOCKED claim + mark-published loop,
//! PostgreSQL CPU per event, claim latency on stale statistics, the wasm
//! plugin against a native router, commit-to-consumer latency at steady
//! rates, hot reload under load, and peak memory. Prints one table and
//! writes a latency plot (SVG). `--large-reload` measures the hot reload of
//! the 18 MB Python component under load instead; `--interpreted` drains
//! through the Python and JavaScript ports, router and batch-router builds.
//!
//! ```text
//! scripts/services.sh start && eval "$(scripts/services.sh env)"
//! (cd plugins && cargo build --release)
//! cargo run --release -p switchyard-bench --bin relay-bench [-- --rows 1000000]
//! ```

// The relay runs in this process: its allocator is this binary's.
#[global_allocator]
static ALLOCATOR: switchyard::Allocator = switchyard::ALLOCATOR;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use futures::StreamExt;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use sqlx::PgPool;
use switchyard::plugin::{Event, Message};
use switchyard::store::{OutboxStore, PublishedRows};
use switchyard::{Config, Relay};
use switchyard_tests::postgres::{INTAKE_MIGRATION, migrate_before};
use tokio_util::sync::CancellationToken;

mod large_reload;
mod many;
mod mysql;
mod peer;
mod replication;
mod server_cost;
mod slot_spread;
mod steady;

#[derive(Debug, Parser)]
#[command(about = "Relay throughput, latency, plugin overhead and memory against the SQL ceiling")]
struct Args {
    /// Backlog size for the drain measurements.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Distinct aggregates in the backlog.
    #[arg(long, default_value_t = 10_000)]
    aggregates: u64,
    /// Rows per claim (relay and ceiling alike).
    #[arg(long, default_value_t = 500)]
    batch_size: u32,
    /// Concurrent batches (relay and ceiling alike).
    #[arg(long, default_value_t = 4)]
    concurrency: u32,
    /// Seconds of steady load per latency rate.
    #[arg(long, default_value_t = 15)]
    latency_seconds: u64,
    /// Skip the Kafka drain.
    #[arg(long)]
    no_kafka: bool,
    /// Skip the Pub/Sub drain (on the emulator `scripts/services.sh` runs).
    #[arg(long)]
    no_pubsub: bool,
    /// Only the latency and hot-reload runs (and the plot).
    #[arg(long)]
    latency_only: bool,
    /// Rounds of ceiling and drains; each figure is the median over the
    /// rounds, and wasm and native alternate which runs first.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Only the ceiling and the drains (no latency, reload or plot).
    #[arg(long, conflicts_with = "latency_only")]
    drains_only: bool,
    /// With --drains-only: only these drains (comma-separated keys as
    /// printed, e.g. `nats_wasm,nats_wasm_intake_backlog`); all when empty.
    #[arg(long, value_delimiter = ',', requires = "drains_only")]
    drain: Vec<String>,
    /// Only the hot reload of the large Python component under load (needs
    /// scripts/plugin-toolchains.sh).
    #[arg(long, conflicts_with_all = ["latency_only", "drains_only"])]
    large_reload: bool,
    /// Only NATS drains through the Python and JavaScript ports of
    /// route-by-type, each built for the router and the batch-router world
    /// (needs scripts/plugin-toolchains.sh).
    #[arg(long, conflicts_with_all = ["latency_only", "drains_only", "large_reload"])]
    interpreted: bool,
    /// Only replication mode against claim mode (keep and delete): drains to
    /// NATS and Kafka, PostgreSQL CPU per event, latency at 100 and 1,000
    /// events/s.
    #[arg(long, conflicts_with_all = ["latency_only", "drains_only", "large_reload", "interpreted"])]
    replication: bool,
    /// With --replication: the drains only (their rate, CPU and peak RSS).
    #[arg(long, requires = "replication")]
    no_latency: bool,
    /// Only the cost to PostgreSQL of one outbox spread over 1, 2 and 4
    /// slots with hash row filters.
    #[arg(long, conflicts_with_all = ["latency_only", "drains_only", "large_reload", "interpreted", "replication"])]
    slot_spread: bool,
    /// Only the steady-rate cost: PostgreSQL and relay CPU per event at 100
    /// and 500 one-event transactions/s in claim and replication mode,
    /// against the writes alone, and the writer's INSERT against a plain table.
    #[arg(long, conflicts_with_all = ["latency_only", "drains_only", "large_reload", "interpreted", "replication", "slot_spread"])]
    steady: bool,
    /// With --steady: also run pg-transactional-outbox (bench/peer, needs
    /// Node.js and npm) from its own table's WAL at each rate.
    #[arg(long, requires = "steady")]
    peer: bool,
    /// With --steady: only these runs (comma-separated: writes, claim,
    /// intake, replication, source, emit, peer); all when empty.
    #[arg(long, value_delimiter = ',', requires = "steady")]
    runs: Vec<String>,
    /// With --steady: the rates (events/s) to run at.
    #[arg(long, value_delimiter = ',', requires = "steady", default_value = "100,500")]
    rates: Vec<u64>,
    /// With --steady: seconds written at each run's rate before it is
    /// measured (for --latency-seconds), the relay's start left out.
    #[arg(long, requires = "steady", default_value_t = 10)]
    warmup_seconds: u64,
    /// Only one relay serving this many databases each (comma-separated):
    /// idle cost, latency at 10 events/s each, sessions.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["latency_only", "drains_only", "large_reload", "interpreted", "replication", "slot_spread", "steady"])]
    many_databases: Vec<usize>,
    /// With --many-databases: `[connections] per_server` for the relay.
    #[arg(long, requires = "many_databases")]
    connections_per_server: Option<u32>,
    /// Only PostgreSQL claim mode against MariaDB claim mode: a drain of
    /// --rows (use 100000), and the server's CPU per event and latency at
    /// 100 and 500 events/s, in --repeat rounds.
    #[arg(long, conflicts_with_all = ["latency_only", "drains_only", "large_reload", "interpreted", "replication", "slot_spread", "steady"])]
    mysql: bool,
    /// Where to write the latency plot.
    #[arg(long, default_value = "docs/src/benchmarks/latency.svg")]
    plot: PathBuf,
}

struct Services {
    server_url: String,
    nats_url: String,
    kafka: String,
    pubsub: String,
}

impl Services {
    fn from_env() -> Services {
        let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
        Services {
            server_url: var("DATABASE_URL", "postgres://postgres@127.0.0.1:55432/postgres"),
            nats_url: var("SWITCHYARD_NATS_URL", "nats://127.0.0.1:54222"),
            kafka: var("SWITCHYARD_KAFKA_BOOTSTRAP", "127.0.0.1:59092"),
            pubsub: var("SWITCHYARD_PUBSUB_EMULATOR_HOST", "127.0.0.1:58085"),
        }
    }

    /// The server's URL on database `name`, its parameters (TLS) kept.
    fn db_url(&self, name: &str) -> String {
        switchyard_tests::postgres::on_database(&self.server_url, name)
    }
}

/// Which schema generation a run uses: the previous one (migrated up to the
/// intake, not including it) or the current one.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Schema {
    Previous,
    Current,
}

impl Schema {
    fn template(self) -> &'static str {
        match self {
            Schema::Previous => "sy_bench_template_previous",
            Schema::Current => "sy_bench_template",
        }
    }

    /// Whether no unfinished row is left: index probes, unlike `backlog()`
    /// (a count over the whole backlog), which would load the database it measures.
    fn drained_sql(self) -> &'static str {
        match self {
            Schema::Previous | Schema::Current => {
                "SELECT NOT EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = 1)
                    AND NOT EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = 2)
                    AND NOT EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = 3)"
            }
        }
    }

    async fn migrate(self, pool: &PgPool) -> anyhow::Result<()> {
        let before = match self {
            Schema::Previous => INTAKE_MIGRATION,
            Schema::Current => i64::MAX,
        };
        migrate_before(pool, before).await?;
        Ok(())
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| ".".into())
}

fn plugin_file() -> PathBuf {
    workspace_root().join(format!("plugins/target/{RUST_PLUGIN}"))
}

/// The Rust route-by-type, under `plugins/target`.
const RUST_PLUGIN: &str = "wasm32-wasip2/release/route_by_type.wasm";

/// Peak resident set of this process since the last reset, in bytes.
fn peak_rss() -> u64 {
    procfs::process::Process::myself()
        .and_then(|me| me.status())
        .ok()
        .and_then(|status| status.vmhwm)
        .map_or(0, |kb| kb * 1024)
}

/// CPU seconds used between two marks, by process: where a drain's time goes.
#[derive(Debug, Clone, Copy, Default)]
struct CpuTimes {
    postgres: f64,
    nats: f64,
    tansu: f64,
    /// This process: the relay, plus the bench's own progress checks.
    relay: f64,
}

/// CPU seconds used so far, by process.
#[derive(Debug, Clone, Default)]
struct CpuMark {
    /// Each PostgreSQL process's own time and its reaped children's (the
    /// postmaster's hold the backends that have exited), by process id.
    postgres: std::collections::HashMap<i32, f64>,
    nats: f64,
    tansu: f64,
    relay: f64,
    /// MariaDB's one process.
    mariadb: f64,
}

impl CpuMark {
    fn now() -> CpuMark {
        let ticks = procfs::ticks_per_second() as f64;
        let me = i32::try_from(std::process::id()).unwrap_or(0);
        let mut mark = CpuMark::default();
        let Ok(processes) = procfs::process::all_processes() else {
            return mark;
        };
        for stat in processes.flatten().filter_map(|p| p.stat().ok()) {
            let own = (stat.utime + stat.stime) as f64 / ticks;
            match stat.comm.as_str() {
                "postgres" => {
                    let reaped = (stat.cutime + stat.cstime).max(0) as f64 / ticks;
                    mark.postgres.insert(stat.pid, own + reaped);
                }
                "nats-server" => mark.nats += own,
                "mariadbd" => mark.mariadb += own,
                "tansu" => mark.tansu += own,
                // The peer relay (bench/peer), a child, counts as the relay.
                _ if stat.pid == me || (stat.comm == "node" && stat.ppid == me) => mark.relay += own,
                _ => {}
            }
        }
        mark
    }

    /// Each PostgreSQL process's CPU since `earlier`, by process id.
    fn postgres_since(&self, earlier: &CpuMark) -> std::collections::HashMap<i32, f64> {
        self.postgres
            .iter()
            .map(|(pid, now)| (*pid, now - earlier.postgres.get(pid).copied().unwrap_or(0.0)))
            .collect()
    }

    /// What each process used since `earlier`. A PostgreSQL process that
    /// has gone unreaped (the old postmaster, after a restart) is left
    /// out rather than counted as time given back.
    fn since(self, earlier: CpuMark) -> CpuTimes {
        let postgres = self
            .postgres
            .iter()
            .map(|(pid, now)| now - earlier.postgres.get(pid).copied().unwrap_or(0.0))
            .sum();
        CpuTimes {
            postgres,
            nats: self.nats - earlier.nats,
            tansu: self.tansu - earlier.tansu,
            relay: self.relay - earlier.relay,
        }
    }
}

impl CpuTimes {
    /// "postgres 72 / broker 9 / relay 20 ms per 1,000 events".
    fn per_thousand(&self, events: u64) -> String {
        let ms = |seconds: f64| seconds * 1e6 / events.max(1) as f64;
        format!(
            "postgres {:.0} / broker {:.0} / relay {:.0} ms",
            ms(self.postgres),
            ms(self.nats + self.tansu),
            ms(self.relay)
        )
    }
}

/// Starts a new peak-RSS window (Linux: "5" to clear_refs resets VmHWM).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

async fn admin_pool(services: &Services) -> anyhow::Result<PgPool> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&services.server_url)
        .await
        .with_context(|| {
            format!(
                "PostgreSQL at {} (run scripts/services.sh start)",
                services.server_url
            )
        })
}

async fn recreate_db(admin: &PgPool, name: &str, template: Option<&str>) -> anyhow::Result<()> {
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(admin)
        .await?;
    let from = template.map(|t| format!(" TEMPLATE {t}")).unwrap_or_default();
    sqlx::query(&format!("CREATE DATABASE {name}{from}"))
        .execute(admin)
        .await?;
    Ok(())
}

/// A migrated database holding `rows` ~200-byte order documents over
/// `aggregates` orders, written in id order like real traffic.
async fn build_template(services: &Services, args: &Args, schema: Schema) -> anyhow::Result<Duration> {
    let admin = admin_pool(services).await?;
    let started = Instant::now();
    recreate_db(&admin, schema.template(), None).await?;
    let url = services.db_url(schema.template());
    let pool = PgPool::connect(&url).await?;
    schema.migrate(&pool).await?;
    load_rows(&pool, args).await?;
    sqlx::query("VACUUM ANALYZE switchyard_outbox")
        .execute(&pool)
        .await?;
    pool.close().await;
    Ok(started.elapsed())
}

/// Writes `args.rows` ~200-byte order documents over `args.aggregates`
/// orders, in id order like real traffic.
/// Event `n` of the bench backlog (aggregate `n % $3`), as the columns of
/// an insert or the arguments of `switchyard_emit`.
const EVENT_FIELDS: &str = "'order', 'order-' || lpad((n % $3)::text, 6, '0'),
    (ARRAY['OrderCreated', 'OrderPaid', 'OrderShipped'])[1 + (n / $3) % 3],
    jsonb_build_object(
        'order_id', 'order-' || lpad((n % $3)::text, 6, '0'),
        'customer_id', 'cust-' || (n % 997),
        'status', 'created', 'currency', 'EUR',
        'total_cents', 1000 + n % 90000,
        'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (n % 50), 'qty', 1 + n % 3)),
        'created_at', '2026-11-22T10:00:00Z'),
    jsonb_build_object('traceparent',
        '00-' || lpad(to_hex(n), 32, '0') || '-' || lpad(to_hex(n + 1), 16, '0') || '-01')";

async fn load_rows(pool: &PgPool, args: &Args) -> anyhow::Result<()> {
    let chunk = 100_000u64;
    let mut from = 0;
    while from < args.rows {
        let to = (from + chunk).min(args.rows);
        sqlx::query(&format!(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
             SELECT {EVENT_FIELDS} FROM generate_series($1::bigint, $2::bigint - 1) n"
        ))
        .bind(i64::try_from(from)?)
        .bind(i64::try_from(to)?)
        .bind(i64::try_from(args.aggregates)?)
        .execute(pool)
        .await?;
        from = to;
    }
    Ok(())
}

/// Drops a finished run's database: its dead rows would otherwise keep
/// autovacuum busy during the next measurement (and fill the disk).
async fn drop_db(services: &Services, name: &str) -> anyhow::Result<()> {
    let admin = admin_pool(services).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&admin)
        .await?;
    Ok(())
}

/// A fresh copy of a template (a file copy: seconds, not a reload).
async fn clone_db(services: &Services, name: &str, schema: Schema) -> anyhow::Result<String> {
    let admin = admin_pool(services).await?;
    recreate_db(&admin, name, Some(schema.template())).await?;
    Ok(services.db_url(name))
}

/// The physical reference: the least a claim + mark-published loop can do on
/// this table, with SKIP LOCKED and nothing else - no head-of-line
/// test, no lease, no outcome columns.
async fn minimal(url: &str, args: &Args) -> anyhow::Result<Drain> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(args.concurrency + 1)
        .connect(url)
        .await?;
    let cpu = CpuMark::now();
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.concurrency {
        let pool = pool.clone();
        let batch = i64::from(args.batch_size);
        workers.push(tokio::spawn(async move {
            let mut done = 0u64;
            loop {
                let mut tx = pool.begin().await?;
                let ids: Vec<i64> = sqlx::query_scalar(
                    "SELECT id FROM switchyard_outbox WHERE queue = 1
                      ORDER BY GREATEST(next_attempt_at, not_before), id
                      LIMIT $1 FOR UPDATE SKIP LOCKED",
                )
                .bind(batch)
                .fetch_all(&mut *tx)
                .await?;
                if ids.is_empty() {
                    tx.commit().await?;
                    return Ok::<_, anyhow::Error>(done);
                }
                sqlx::query(
                    "UPDATE switchyard_outbox SET status = 'published', published_at = now()
                      WHERE id = ANY($1)",
                )
                .bind(&ids)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                done += ids.len() as u64;
            }
        }));
    }
    let mut done = 0;
    for worker in workers {
        done += worker.await??;
    }
    Ok(Drain {
        rate: done as f64 / started.elapsed().as_secs_f64(),
        cpu: CpuMark::now().since(cpu),
        peak_rss: peak_rss(),
    })
}

/// The claim and ack statements the relay runs (for the schema's generation
/// says), with no plugin and no broker: what the database allows.
async fn ceiling(url: &str, args: &Args, schema: Schema) -> anyhow::Result<Drain> {
    let store = OutboxStore::connect(url, args.concurrency * 2 + 2).await?;
    let pool = sqlx::PgPool::connect(url).await?;
    let cpu = CpuMark::now();
    let started = Instant::now();
    let done = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for worker in 0..args.concurrency {
        let (store, pool) = (store.clone(), pool.clone());
        let done = done.clone();
        let batch = args.batch_size;
        workers.push(tokio::spawn(async move {
            let owner = format!("ceiling-{worker}");
            loop {
                let claim = store.claim(&owner, batch, Duration::from_secs(30)).await?;
                if claim.rows.is_empty() {
                    if claim.parked > 0 {
                        continue;
                    }
                    if drained(&pool, schema).await? {
                        return Ok::<_, anyhow::Error>(());
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                let outcomes = switchyard_tests::backlog::published_outcomes(&claim);
                let acked = store.ack(claim.lease, &outcomes).await?;
                done.fetch_add(acked.len() as u64, Ordering::Relaxed);
            }
        }));
    }
    for worker in workers {
        worker.await??;
    }
    Ok(Drain {
        rate: done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64(),
        cpu: CpuMark::now().since(cpu),
        peak_rss: peak_rss(),
    })
}

/// Whether no unfinished row is left.
async fn drained(pool: &sqlx::PgPool, schema: Schema) -> anyhow::Result<bool> {
    let intake: bool = sqlx::query_scalar("SELECT to_regclass('switchyard_intake') IS NOT NULL")
        .fetch_one(pool)
        .await?;
    if intake
        && sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM switchyard_intake)")
            .fetch_one(pool)
            .await?
    {
        return Ok(false);
    }
    Ok(sqlx::query_scalar(schema.drained_sql()).fetch_one(pool).await?)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Nats,
    Kafka,
    /// The emulator: its figures are the relay's and the emulator's on one
    /// machine, not the service's.
    PubSub,
}

fn relay_config(
    url: &str,
    services: &Services,
    args: &Args,
    target: Target,
    plugin: &Path,
    published_rows: PublishedRows,
) -> anyhow::Result<Config> {
    let (plugin_config, target_config) = match target {
        Target::Nats => (
            "target = \"out\"\ntopic = \"bench.{event_type}\"",
            format!(
                "type = \"nats\"\nurl = \"{}\"\nstream = {{ name = \"BENCH\", subjects = [\"bench.>\"] }}",
                services.nats_url
            ),
        ),
        Target::Kafka => (
            "target = \"out\"\ntopic = \"bench\"",
            format!("type = \"kafka\"\nbootstrap_servers = \"{}\"", services.kafka),
        ),
        Target::PubSub => (
            "target = \"out\"\ntopic = \"bench\"",
            format!(
                "type = \"pubsub\"\nproject = \"{}\"\nemulator_host = \"{}\"",
                pubsub_project(url),
                services.pubsub
            ),
        ),
    };
    let text = format!(
        r#"
[database]
url = "{url}"
max_connections = {max_connections}
[relay]
batch_size = {batch}
concurrency = {concurrency}
published_rows = "{published_rows}"
[plugin_runtime]
cache = false
[admin]
listen = ""
[[plugins]]
name = "router"
path = "{plugin}"
[plugins.config]
{plugin_config}
[targets.out]
{target_config}
"#,
        max_connections = args.concurrency * 2 + 4,
        batch = args.batch_size,
        concurrency = args.concurrency,
        plugin = plugin.display(),
        published_rows = match published_rows {
            PublishedRows::Keep => "keep",
            PublishedRows::Delete => "delete",
            PublishedRows::Archive => "archive",
        },
    );
    Config::from_toml(&text, Path::new("."), &|_| None).map_err(|e| anyhow::anyhow!("bench config: {e:?}"))
}

/// The native equivalent of route-by-type with this bench's config.
fn native_router(target: Target) -> switchyard::relay::NativeRouter {
    Arc::new(move |event: &Event| {
        let topic = match target {
            Target::Nats => format!("bench.{}", event.event_type),
            Target::Kafka | Target::PubSub => "bench".to_string(),
        };
        Ok(vec![Message {
            target: "out".to_string(),
            topic,
            key: Some(event.aggregate_id.clone()),
            payload: event.payload.clone(),
            headers: vec![("content-type".to_string(), "application/json".to_string())],
        }])
    })
}

/// A project per drain database: the emulator keeps what it was sent, so
/// every drain starts on an empty topic of its own.
fn pubsub_project(db_url: &str) -> String {
    let db = db_url
        .rsplit('/')
        .next()
        .unwrap_or("bench")
        .split('?')
        .next()
        .unwrap_or("bench");
    format!("{}-{}", db.replace('_', "-"), std::process::id())
}

async fn reset_brokers(services: &Services, target: Target) -> anyhow::Result<()> {
    match target {
        Target::PubSub => {}
        Target::Nats => {
            let client = async_nats::connect(&services.nats_url).await?;
            let js = async_nats::jetstream::new(client);
            let _ = js.delete_stream("BENCH").await;
            let _ = js.delete_stream("LATENCY").await;
        }
        Target::Kafka => {
            let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &services.kafka)
                .create()?;
            let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
            let _ = admin.delete_topics(&["bench"], &options).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            admin
                .create_topics(&[NewTopic::new("bench", 8, TopicReplication::Fixed(1))], &options)
                .await?;
        }
    }
    Ok(())
}

struct Drain {
    rate: f64,
    cpu: CpuTimes,
    peak_rss: u64,
}

/// The drains `--drain` chose, each round as it ran: events/s and CPU
/// per 1,000 events.
fn print_chosen_drains(runs: &BTreeMap<&str, Vec<Drain>>, rows: u64) {
    println!();
    for (key, drains) in runs {
        for drain in drains {
            println!(
                "{key:<28} {:>8.0} events/s  {}",
                drain.rate,
                drain.cpu.per_thousand(rows)
            );
        }
    }
}

/// One drain measurement: where to, through what, on which schema.
#[derive(Clone, Copy)]
struct DrainKind {
    target: Target,
    /// The plugin file, under `plugins/target`.
    plugin: &'static str,
    native: bool,
    schema: Schema,
    published_rows: PublishedRows,
    /// Where the backlog waits, and whether there is an intake at all.
    intake: Intake,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Intake {
    /// `switchyard_intake` dropped from the copy, so every claim is the
    /// statement without the move (what the move costs a backlog written
    /// into the outbox).
    Without,
    /// There, empty; the backlog in the outbox.
    Empty,
    /// The backlog in the intake (as writers into it leave it while no
    /// relay runs): every row moved before it is claimed.
    Backlog,
}

/// Runs a relay on a copy of the backlog until it is empty.
async fn drain(services: &Services, args: &Args, kind: DrainKind) -> anyhow::Result<Drain> {
    let DrainKind {
        target,
        plugin,
        native,
        schema,
        published_rows,
        intake,
    } = kind;
    let name = format!(
        "sy_bench_{}_{}",
        match target {
            Target::Nats => "nats",
            Target::Kafka => "kafka",
            Target::PubSub => "pubsub",
        },
        if native { "native" } else { "wasm" }
    );
    let url = clone_db(services, &name, schema).await?;
    let setup: &[&str] = match intake {
        Intake::Without => &["DROP TABLE IF EXISTS switchyard_intake"],
        Intake::Empty => &[],
        Intake::Backlog => &[
            "WITH taken AS (DELETE FROM switchyard_outbox RETURNING *)
             INSERT INTO switchyard_intake (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
             SELECT event_id, aggregate_type, aggregate_id, event_type, payload, headers FROM taken ORDER BY id",
            // Each on its own: VACUUM runs in no transaction block.
            "VACUUM ANALYZE switchyard_outbox",
            "VACUUM ANALYZE switchyard_intake",
        ],
    };
    if !setup.is_empty() {
        let pool = sqlx::PgPool::connect(&url).await?;
        for statement in setup {
            sqlx::raw_sql(statement).execute(&pool).await?;
        }
        pool.close().await;
    }
    reset_brokers(services, target).await?;
    if target == Target::PubSub {
        // No subscription: one would keep every message in the emulator's
        // heap, and a full heap slows it to timeouts.
        switchyard_tests::pubsub::Emulator::at(&services.pubsub)
            .bare_topic(&pubsub_project(&url), "bench")
            .await;
    }
    let plugin = workspace_root().join("plugins/target").join(plugin);
    let config = relay_config(&url, services, args, target, &plugin, published_rows)?;
    reset_peak_rss();
    let mut relay = switchyard::runtime::builder(&config).await?;
    if native {
        relay = relay.native_router(native_router(target));
    }
    let relay = relay.build();
    let cpu = CpuMark::now();
    let pool = sqlx::PgPool::connect(&url).await?;
    let rate = run_until_drained(&relay, &pool, args.rows, schema).await?;
    let result = Drain {
        rate,
        cpu: CpuMark::now().since(cpu),
        peak_rss: peak_rss(),
    };
    drop(relay);
    drop_db(services, &name).await?;
    Ok(result)
}

/// A relay running on a task of its own until [`Running::stop`].
struct Running {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    fn start(relay: &Relay) -> Running {
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let relay = relay.clone();
            let stop = stop.clone();
            async move { relay.run(stop).await }
        });
        Running { stop, task }
    }

    /// Asks the relay to finish its batches and waits for it.
    async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        self.task.await?
    }
}

async fn run_until_drained(
    relay: &Relay,
    pool: &sqlx::PgPool,
    rows: u64,
    schema: Schema,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let running = Running::start(relay);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if drained(pool, schema).await? {
            break;
        }
        if running.task.is_finished() {
            anyhow::bail!("the relay stopped early");
        }
    }
    let elapsed = started.elapsed();
    running.stop().await?;
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = 'dead'")
        .fetch_one(pool)
        .await?;
    anyhow::ensure!(dead == 0, "{dead} rows dead-lettered during the drain");
    Ok(rows as f64 / elapsed.as_secs_f64())
}

/// What one latency run saw.
struct Latency {
    rate: u64,
    sorted_us: Vec<u64>,
    sent: u64,
    reload_ms: Option<f64>,
    peak_rss: u64,
    /// CPU from the first write until the last event arrived.
    cpu: CpuTimes,
    /// PostgreSQL's part of it by what each process serves.
    pg_roles: BTreeMap<String, f64>,
    /// The run's dearest statements.
    statements: Vec<server_cost::Statement>,
}

/// A steady load: `rate` events/s for `seconds`.
#[derive(Clone, Copy)]
struct Load {
    rate: u64,
    seconds: u64,
    /// Swap the plugin file halfway and time the first event routed by it.
    reload: bool,
    /// The relay reads the WAL instead of claiming.
    replication: bool,
    /// No relay at all: what the writes alone cost.
    writer_only: bool,
    /// Each event in its own transaction (as services write), not one
    /// multi-row insert per 10 ms tick.
    one_per_transaction: bool,
    /// pg-transactional-outbox relays its own table instead (one event
    /// per transaction).
    peer: bool,
    /// Writers insert into `switchyard_intake`, not `switchyard_outbox`.
    intake: bool,
    /// Writers insert into a plain table of their own, which the relay
    /// reads from the WAL as `[source]` (with `replication`).
    source: bool,
    /// Writers call `switchyard_emit` (an event without a row) instead of
    /// inserting (with `replication`).
    emit: bool,
    /// Seconds written at the rate before the run is measured, so that a
    /// relay's start (its sessions' first plans and caches, the peer's
    /// too) is not counted as if it were paid per event.
    warmup: u64,
}

impl Load {
    /// The table the writers insert into.
    fn table(&self) -> &'static str {
        if self.source {
            replication::SERVICE_TABLE
        } else if self.intake {
            "switchyard_intake"
        } else {
            "switchyard_outbox"
        }
    }

    fn new(rate: u64, seconds: u64) -> Load {
        Load {
            rate,
            seconds,
            reload: false,
            replication: false,
            writer_only: false,
            one_per_transaction: false,
            peer: false,
            intake: false,
            source: false,
            emit: false,
            warmup: 0,
        }
    }
}

impl Latency {
    fn percentile_ms(&self, p: f64) -> f64 {
        if self.sorted_us.is_empty() {
            return f64::NAN;
        }
        let index = ((self.sorted_us.len() - 1) as f64 * p).round() as usize;
        self.sorted_us[index] as f64 / 1000.0
    }
}

fn now_us() -> u64 {
    u64::try_from(chrono::Utc::now().timestamp_micros()).unwrap_or(0)
}

/// Steady writes at `rate` events/s for `seconds`; each event's payload
/// carries its send time, and a core NATS subscriber on the relay's subjects
/// measures arrival. With `reload`, swaps the plugin file mid-run and times
/// the first event routed by the new version.
async fn latency(
    services: &Services,
    args: &Args,
    rate: u64,
    seconds: u64,
    reload: bool,
) -> anyhow::Result<Latency> {
    latency_in(
        services,
        args,
        Load {
            reload,
            ..Load::new(rate, seconds)
        },
    )
    .await
}

/// [`latency`] under any [`Load`]: claim mode, replication mode, or the
/// writer alone.
async fn latency_in(services: &Services, args: &Args, load: Load) -> anyhow::Result<Latency> {
    let Load {
        rate,
        seconds,
        reload,
        replication,
        ..
    } = load;
    let admin = admin_pool(services).await?;
    let name = format!("sy_bench_latency_{rate}");
    replication::drop_slot(&admin, &name).await?;
    replication::drop_slot(&admin, peer::SLOT).await?;
    recreate_db(&admin, &name, None).await?;
    let url = services.db_url(&name);
    let store = OutboxStore::connect(&url, 4).await?;
    store.migrate().await?;
    if replication && load.source {
        replication::set_up_service_table(&store, &url, &name).await?;
    } else if replication {
        replication::set_up(&store, &name).await?;
    }
    // The writer commits as a service does (the test server's default is
    // `synchronous_commit = off`, whose WAL reaches disk, and a WAL reader,
    // only at the WAL writer's next round, up to 200 ms later).
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    let pool = sqlx::PgPool::connect_with(
        options
            .options([("synchronous_commit", "on")])
            .application_name(server_cost::WRITER_APP),
    )
    .await?;
    reset_brokers(services, Target::Nats).await?;

    let dir = std::env::temp_dir().join(format!("sy-bench-{rate}"));
    std::fs::create_dir_all(&dir)?;
    let plugin_path = dir.join("router.wasm");
    let original = std::fs::read(plugin_file())?;
    std::fs::write(&plugin_path, &original)?;
    let mut config = relay_config(
        &url,
        services,
        args,
        Target::Nats,
        &plugin_path,
        PublishedRows::Keep,
    )?;
    if replication {
        replication::configure(&mut config, &name);
    }
    if load.source {
        config.source = Some(replication::service_source());
    }
    reset_peak_rss();
    let relay = if load.peer {
        None
    } else {
        Some(switchyard::runtime::build(&config).await?)
    };
    let running = relay.as_ref().filter(|_| !load.writer_only).map(Running::start);
    let peer = if load.peer {
        Some(peer::start(&url, &services.nats_url).await?)
    } else {
        None
    };

    let client = async_nats::connect(&services.nats_url).await?;
    let mut subscription = client.subscribe("bench.>").await?;
    client.flush().await?;
    let new_version = Arc::new(std::sync::Mutex::new(None::<String>));
    let reload_seen = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let warm = rate * load.warmup;
    let total = warm + rate * seconds;
    let expected = if load.writer_only { 0 } else { total };
    let consumer = tokio::spawn({
        let new_version = new_version.clone();
        let reload_seen = reload_seen.clone();
        async move {
            let mut latencies = Vec::with_capacity(usize::try_from(expected).unwrap_or(0));
            while (latencies.len() as u64) < expected
                && let Ok(Some(message)) =
                    tokio::time::timeout(Duration::from_secs(5), subscription.next()).await
            {
                let arrived = now_us();
                let event = serde_json::from_slice::<serde_json::Value>(&message.payload).ok();
                let sent = event.as_ref().and_then(|v| v["sent_us"].as_u64());
                // Every message counts towards the end; a warm-up event's
                // latency does not.
                let measured = event
                    .as_ref()
                    .and_then(|v| v["seq"].as_u64())
                    .is_none_or(|seq| seq >= warm);
                match sent {
                    Some(sent) if measured => latencies.push(arrived.saturating_sub(sent)),
                    _ => latencies.push(u64::MAX),
                }
                let want = new_version.lock().ok().and_then(|v| v.clone());
                if let (Some(want), Some(headers)) = (want, message.headers.as_ref())
                    && headers
                        .get("Switchyard-Plugin")
                        .is_some_and(|v| v.as_str().ends_with(want.as_str()))
                    && let Ok(mut seen) = reload_seen.lock()
                {
                    seen.get_or_insert_with(Instant::now);
                }
            }
            latencies
        }
    });

    // Writes every 10 ms; a late tick writes its share at once, so the mean rate holds.
    let per_tick = (rate / 100).max(1);
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut sent = 0u64;
    let mut reload_started = None;
    let mut started = Instant::now();
    let mut cpu = CpuMark::now();
    while sent < total {
        tick.tick().await;
        if warm > 0 && sent == warm {
            // The writers' first transactions are as warm as the relay's.
            server_cost::reset_statements(&admin, &name).await;
            started = Instant::now();
            cpu = CpuMark::now();
        }
        if reload && reload_started.is_none() && started.elapsed() >= Duration::from_secs(seconds / 2) {
            let variant = switchyard_tests::plugins::with_custom_section(&original, 7);
            if let Ok(mut v) = new_version.lock() {
                *v = Some(switchyard::plugin::content_hash(&variant));
            }
            reload_started = Some(Instant::now());
            switchyard_tests::plugins::replace_atomically(&plugin_path, &variant);
        }
        // A tick does not write across the end of the warm-up.
        let n = per_tick.min(if sent < warm { warm - sent } else { total - sent });
        if load.peer {
            let sent_us = i64::try_from(now_us())?;
            let writes =
                (sent..sent + n).map(|at| peer::write(&pool, i64::try_from(at).unwrap_or(0), sent_us));
            futures::future::try_join_all(writes).await?;
        } else if load.emit {
            let writes = (sent..sent + n).map(|at| emit_steady(&pool, at));
            futures::future::try_join_all(writes).await?;
        } else if load.one_per_transaction {
            let writes = (sent..sent + n).map(|at| write_steady(&pool, load.table(), at, 1));
            futures::future::try_join_all(writes).await?;
        } else {
            write_steady(&pool, load.table(), sent, n).await?;
        }
        sent += n;
    }
    let mut sorted_us = consumer.await?;
    sorted_us.retain(|&us| us != u64::MAX);
    let roles = server_cost::roles(&admin).await;
    let end = CpuMark::now();
    let pg_roles = server_cost::by_role(&end.postgres_since(&cpu), &roles);
    let cpu = end.since(cpu);
    if let Some(running) = running {
        running.stop().await?;
    }
    if let Some(peer) = peer {
        peer.stop().await?;
    }
    sorted_us.sort_unstable();
    let reload_ms = match (reload_started, reload_seen.lock().ok().and_then(|s| *s)) {
        (Some(from), Some(to)) => Some(to.saturating_duration_since(from).as_secs_f64() * 1000.0),
        _ => None,
    };
    let _ = std::fs::remove_dir_all(&dir);
    let peak_rss = peak_rss();
    drop(relay);
    pool.close().await;
    let statements = server_cost::statements(&admin, &name).await;
    replication::drop_slot(&admin, &name).await?;
    replication::drop_slot(&admin, peer::SLOT).await?;
    drop_db(services, &name).await?;
    Ok(Latency {
        rate,
        sorted_us,
        // What the figures are per: the events written after the warm-up.
        sent: sent - warm,
        reload_ms,
        peak_rss,
        cpu,
        pg_roles,
        statements,
    })
}

/// Events `from..from + n` in one insert, each carrying its send time.
///
/// One event is a one-row `INSERT ... VALUES`, as a service writes it: its
/// prepared statement is planned once per session. Over `generate_series`
/// PostgreSQL would plan it anew on every call (a plan for one row beats the
/// generic one for a count it cannot see), about 0.1 ms of server CPU per
/// event that no service pays.
async fn write_steady(pool: &PgPool, table: &str, from: u64, n: u64) -> anyhow::Result<()> {
    let from = i64::try_from(from)?;
    let sent_us = i64::try_from(now_us())?;
    let sql = if n == 1 {
        format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'order-' || (($1::bigint * 7919) % 10000), 'OrderCreated',
                     jsonb_build_object('sent_us', $2::bigint, 'seq', $1::bigint, 'currency', 'EUR',
                                        'total_cents', 12900, 'customer_id', 'cust-42'))"
        )
    } else {
        format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'order-' || ((($1::bigint + n) * 7919) % 10000), 'OrderCreated',
                    jsonb_build_object('sent_us', $2::bigint, 'seq', $1::bigint + n, 'currency', 'EUR',
                                       'total_cents', 12900, 'customer_id', 'cust-42')
               FROM generate_series(0, $3::bigint - 1) n"
        )
    };
    let query = sqlx::query(&sql).bind(from).bind(sent_us);
    let query = if n == 1 {
        query
    } else {
        query.bind(i64::try_from(n)?)
    };
    query.execute(pool).await?;
    Ok(())
}

/// Event `at` written without a row, as [`write_steady`] writes one.
async fn emit_steady(pool: &PgPool, at: u64) -> anyhow::Result<()> {
    sqlx::query(
        "SELECT switchyard_emit('order', 'order-' || (($1::bigint * 7919) % 10000), 'OrderCreated',
                 jsonb_build_object('sent_us', $2::bigint, 'seq', $1::bigint, 'currency', 'EUR',
                                    'total_cents', 12900, 'customer_id', 'cust-42'))",
    )
    .bind(i64::try_from(at)?)
    .bind(i64::try_from(now_us())?)
    .execute(pool)
    .await?;
    Ok(())
}

/// A cumulative latency plot, one line per rate.
fn write_plot(path: &Path, runs: &[&Latency]) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    let (width, height, margin) = (720.0, 420.0, 60.0);
    // Log scale: a rate above the drain rate measures seconds, the others milliseconds.
    let max_ms = runs.iter().map(|r| r.percentile_ms(1.0)).fold(10.0_f64, f64::max);
    let decades = max_ms.log10().ceil().max(1.0);
    let x = |ms: f64| margin + (ms.max(1.0).log10() / decades).min(1.0) * (width - 2.0 * margin);
    let y = |fraction: f64| height - margin - fraction * (height - 2.0 * margin);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{cx}" y="24" text-anchor="middle" font-size="14">Commit-to-consumer latency (relay wasm to NATS JetStream)</text>
<line x1="{margin}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>
<line x1="{margin}" y1="{y0}" x2="{margin}" y2="{margin}" stroke="black"/>
<text x="{cx}" y="{xl}" text-anchor="middle">latency (ms, log scale)</text>
<text x="16" y="{cy}" transform="rotate(-90 16 {cy})" text-anchor="middle">fraction of events</text>
"##,
        cx = width / 2.0,
        cy = height / 2.0,
        y0 = height - margin,
        x1 = width - margin,
        xl = height - 20.0,
    );
    for decade in 0..=(decades as i32) {
        let ms = 10f64.powi(decade);
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{ms}</text>"#,
            x(ms),
            height - margin + 16.0
        );
    }
    for i in 0..=5 {
        let fraction = f64::from(i) / 5.0;
        let _ = writeln!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end">{fraction:.1}</text><line x1="{margin}" y1="{yy:.1}" x2="{x1}" y2="{yy:.1}" stroke="#ddd"/>"##,
            margin - 6.0,
            y(fraction) + 4.0,
            yy = y(fraction),
            x1 = width - margin,
        );
    }
    for (run, color) in runs.iter().zip(["#1f77b4", "#d62728", "#2ca02c"]) {
        let n = run.sorted_us.len().max(1);
        let step = (n / 400).max(1);
        let points: Vec<String> = run
            .sorted_us
            .iter()
            .enumerate()
            .step_by(step)
            .map(|(i, us)| format!("{:.1},{:.1}", x(*us as f64 / 1000.0), y(i as f64 / n as f64)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            points.join(" ")
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" fill="{color}">{} events/s: p50 {:.1} ms, p99 {:.1} ms</text>"#,
            width - margin - 250.0,
            height
                - margin
                - 30.0
                - 18.0
                    * (runs.len() as f64
                        - 1.0
                        - runs.iter().position(|r| std::ptr::eq(*r, *run)).unwrap_or(0) as f64),
            run.rate,
            run.percentile_ms(0.5),
            run.percentile_ms(0.99)
        );
    }
    svg.push_str("</svg>\n");
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, svg)?;
    Ok(())
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / 1024.0 / 1024.0)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Claim times on statistics taken while the outbox was drained: 20,000
/// published rows analyzed, autovacuum off, then 10,000 rows over 1,000
/// aggregates whose heads wait in backoff and 500 fresh rows of other
/// aggregates. Claims (lease 10 s, so cancelled after 5 s) until one finds
/// nothing, at most 200 claims or 60 s.
struct StaleClaims {
    claims: usize,
    slowest: Duration,
    total: Duration,
    fresh_claimed: usize,
    cancelled: usize,
}

async fn stale_claims(services: &Services, schema: Schema) -> anyhow::Result<StaleClaims> {
    let admin = admin_pool(services).await?;
    let name = "sy_bench_stale";
    recreate_db(&admin, name, None).await?;
    let url = services.db_url(name);
    let pool = PgPool::connect(&url).await?;
    schema.migrate(&pool).await?;
    switchyard_tests::backlog::heads_in_backoff_on_stale_statistics(&pool).await;
    let store = OutboxStore::new(pool.clone());
    let mut result = StaleClaims {
        claims: 0,
        slowest: Duration::ZERO,
        total: Duration::ZERO,
        fresh_claimed: 0,
        cancelled: 0,
    };
    let started = Instant::now();
    while result.claims < 200 && started.elapsed() < Duration::from_secs(60) {
        let began = Instant::now();
        let claim = store.claim("stale", 500, Duration::from_secs(10)).await;
        let took = began.elapsed();
        result.claims += 1;
        result.slowest = result.slowest.max(took);
        result.total += took;
        match claim {
            Ok(claim) => {
                result.fresh_claimed += claim.rows.len();
                if claim.rows.is_empty() && claim.parked == 0 {
                    break;
                }
            }
            Err(switchyard::store::Error::ClaimTimedOut { .. }) => result.cancelled += 1,
            Err(other) => return Err(other.into()),
        }
    }
    pool.close().await;
    drop_db(services, name).await?;
    Ok(result)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    switchyard::tune_allocator();
    let args = Args::parse();
    // sqlx flags the bulk load as slow statements; that is the point of it.
    switchyard::telemetry::init_with_default(switchyard::telemetry::LogFormat::Text, "warn,sqlx=error");
    anyhow::ensure!(
        plugin_file().is_file(),
        "{} is missing: run (cd plugins && cargo build --release)",
        plugin_file().display()
    );
    let services = Services::from_env();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    if args.large_reload {
        return large_reload::run(&services, &args).await;
    }
    if args.replication {
        return replication::run(&services, &args).await;
    }
    if args.slot_spread {
        return slot_spread::run(&services, &args).await;
    }
    if args.steady {
        return steady::run(&services, &args).await;
    }
    if args.mysql {
        return mysql::run(&services, &args).await;
    }
    if !args.many_databases.is_empty() {
        return many::run(
            &services,
            &args.many_databases,
            args.concurrency,
            args.connections_per_server,
        )
        .await;
    }
    if args.latency_only {
        let slow = latency(&services, &args, 1_000, args.latency_seconds, true).await?;
        let fast = latency(&services, &args, 10_000, args.latency_seconds, false).await?;
        write_plot(&args.plot, &[&slow, &fast])?;
        for run in [&slow, &fast] {
            println!(
                "latency at {} events/s: p50 {:.1} / p95 {:.1} / p99 {:.1} / max {:.1} ms",
                run.rate,
                run.percentile_ms(0.5),
                run.percentile_ms(0.95),
                run.percentile_ms(0.99),
                run.percentile_ms(1.0)
            );
        }
        println!(
            "hot reload: {:?} ms; plot: {}",
            slow.reload_ms,
            args.plot.display()
        );
        return Ok(());
    }
    eprintln!(
        "building the backlog: {} rows over {} aggregates, previous and current schema generation ...",
        args.rows, args.aggregates
    );
    let load = build_template(&services, &args, Schema::Current).await?;
    build_template(&services, &args, Schema::Previous).await?;
    eprintln!("  loaded in {:.1} s", load.as_secs_f64());

    if args.interpreted {
        return interpreted(&services, &args).await;
    }
    let nats = |schema, native, published_rows| DrainKind {
        target: Target::Nats,
        plugin: RUST_PLUGIN,
        native,
        schema,
        published_rows,
        intake: Intake::Empty,
    };
    let mut plan: Vec<(&str, DrainKind)> = vec![
        (
            "nats_wasm_previous",
            nats(Schema::Previous, false, PublishedRows::Keep),
        ),
        ("nats_wasm", nats(Schema::Current, false, PublishedRows::Keep)),
        (
            "nats_wasm_no_intake",
            DrainKind {
                intake: Intake::Without,
                ..nats(Schema::Current, false, PublishedRows::Keep)
            },
        ),
        (
            "nats_wasm_intake_backlog",
            DrainKind {
                intake: Intake::Backlog,
                ..nats(Schema::Current, false, PublishedRows::Keep)
            },
        ),
        ("nats_native", nats(Schema::Current, true, PublishedRows::Keep)),
        (
            "nats_wasm_delete",
            nats(Schema::Current, false, PublishedRows::Delete),
        ),
        (
            "nats_wasm_archive",
            nats(Schema::Current, false, PublishedRows::Archive),
        ),
    ];
    if !args.no_kafka {
        for native in [false, true] {
            let key = if native { "kafka_native" } else { "kafka_wasm" };
            plan.push((
                key,
                DrainKind {
                    target: Target::Kafka,
                    ..nats(Schema::Current, native, PublishedRows::Keep)
                },
            ));
        }
    }
    if !args.no_pubsub {
        for native in [false, true] {
            let key = if native { "pubsub_native" } else { "pubsub_wasm" };
            plan.push((
                key,
                DrainKind {
                    target: Target::PubSub,
                    ..nats(Schema::Current, native, PublishedRows::Keep)
                },
            ));
        }
    }
    if !args.drain.is_empty() {
        let unknown: Vec<_> = args
            .drain
            .iter()
            .filter(|key| !plan.iter().any(|(k, _)| k == key))
            .collect();
        anyhow::ensure!(unknown.is_empty(), "no drain called {unknown:?}");
        plan.retain(|(key, _)| args.drain.iter().any(|k| k == key));
    }
    let mut runs: BTreeMap<&str, Vec<Drain>> = BTreeMap::new();
    for round in 0..args.repeat {
        eprintln!(
            "round {} of {}: SQL reference and ceilings ...",
            round + 1,
            args.repeat
        );
        for (key, schema) in [
            ("minimal", None),
            ("ceiling_previous", Some(Schema::Previous)),
            ("ceiling", Some(Schema::Current)),
        ] {
            let url = clone_db(&services, "sy_bench_ceiling", schema.unwrap_or(Schema::Current)).await?;
            let result = match schema {
                None => minimal(&url, &args).await?,
                Some(schema) => ceiling(&url, &args, schema).await?,
            };
            runs.entry(key).or_default().push(result);
            drop_db(&services, "sy_bench_ceiling").await?;
        }
        // Alternate the order so that no run always follows the same one.
        let order: Vec<_> = if round % 2 == 0 {
            plan.clone()
        } else {
            plan.iter().rev().cloned().collect()
        };
        for (key, kind) in order {
            eprintln!("round {}: {key} ...", round + 1);
            runs.entry(key)
                .or_default()
                .push(drain(&services, &args, kind).await?);
        }
    }
    if !args.drain.is_empty() {
        print_chosen_drains(&runs, args.rows);
        return Ok(());
    }
    let mut median = |key: &str| {
        let mut all = runs.remove(key)?;
        all.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        let middle = all.len() / 2;
        Some((all.swap_remove(middle), all.len() + 1))
    };
    let (minimal, rounds) = median("minimal").context("no reference run")?;
    let (ceiling_previous, _) = median("ceiling_previous").context("no ceiling run")?;
    let (ceiling, _) = median("ceiling").context("no ceiling run")?;
    let (nats_wasm_previous, _) = median("nats_wasm_previous").context("no NATS run")?;
    let (nats_wasm, _) = median("nats_wasm").context("no NATS run")?;
    let (nats_native, _) = median("nats_native").context("no NATS run")?;
    let (nats_delete, _) = median("nats_wasm_delete").context("no NATS run")?;
    let (nats_no_intake, _) = median("nats_wasm_no_intake").context("no NATS run")?;
    let (nats_intake_backlog, _) = median("nats_wasm_intake_backlog").context("no NATS run")?;
    let (nats_archive, _) = median("nats_wasm_archive").context("no NATS run")?;
    let kafka = median("kafka_wasm")
        .zip(median("kafka_native"))
        .map(|((w, _), (n, _))| (w, n));
    let pubsub = median("pubsub_wasm")
        .zip(median("pubsub_native"))
        .map(|((w, _), (n, _))| (w, n));
    for schema in [Schema::Previous, Schema::Current] {
        drop_db(&services, schema.template()).await?;
    }
    eprintln!("claims on stale statistics, previous and current generation ...");
    let stale_previous = stale_claims(&services, Schema::Previous).await?;
    let stale_current = stale_claims(&services, Schema::Current).await?;
    let latencies = if args.drains_only {
        None
    } else {
        eprintln!("latency at 1,000 events/s, with a plugin reload halfway ...");
        let slow = latency(&services, &args, 1_000, args.latency_seconds, true).await?;
        eprintln!("latency at 10,000 events/s ...");
        let fast = latency(&services, &args, 10_000, args.latency_seconds, false).await?;
        write_plot(&args.plot, &[&slow, &fast])?;
        Some((slow, fast))
    };

    let today = chrono::Utc::now().format("%Y-%m-%d");
    println!(
        "Switchyard relay benchmark, {today}, {} ({cores} cores)",
        cpu_model()
    );
    println!(
        "backlog {} rows / {} aggregates, batch_size {}, concurrency {}",
        args.rows, args.aggregates, args.batch_size, args.concurrency
    );
    if rounds > 1 {
        println!("throughput figures: median of {rounds} rounds");
    }
    println!();
    println!("{:<52} {:>14}  against", "measurement", "figure");
    println!(
        "{:<52} {:>11.0} /s  1.00",
        "SQL minimal SKIP LOCKED claim + mark-published", minimal.rate
    );
    for (label, d) in [
        ("SQL claim + ack, previous generation", &ceiling_previous),
        ("SQL claim + ack, current generation", &ceiling),
    ] {
        println!(
            "{label:<52} {:>11.0} /s  {:.2} of minimal",
            d.rate,
            d.rate / minimal.rate
        );
    }
    let drains: Vec<(&str, &Drain, String)> = [
        (
            "drain, wasm -> NATS JetStream, previous gen.",
            &nats_wasm_previous,
            String::new(),
        ),
        (
            "drain, wasm -> NATS JetStream",
            &nats_wasm,
            format!(", {:.2} x previous", nats_wasm.rate / nats_wasm_previous.rate),
        ),
        (
            "drain, wasm -> NATS, without the intake",
            &nats_no_intake,
            format!(", {:.2} x with", nats_no_intake.rate / nats_wasm.rate),
        ),
        (
            "drain, wasm -> NATS, backlog in the intake",
            &nats_intake_backlog,
            format!(
                ", {:.2} x in the outbox",
                nats_intake_backlog.rate / nats_wasm.rate
            ),
        ),
        ("drain, native -> NATS JetStream", &nats_native, String::new()),
        (
            "drain, wasm -> NATS, published_rows = delete",
            &nats_delete,
            format!(", {:.2} x keep", nats_delete.rate / nats_wasm.rate),
        ),
        (
            "drain, wasm -> NATS, published_rows = archive",
            &nats_archive,
            format!(", {:.2} x keep", nats_archive.rate / nats_wasm.rate),
        ),
    ]
    .into_iter()
    .chain(kafka.iter().flat_map(|(wasm, native)| {
        [
            ("drain, wasm -> Kafka (acks=all)", wasm, String::new()),
            ("drain, native -> Kafka (acks=all)", native, String::new()),
        ]
    }))
    .chain(pubsub.iter().flat_map(|(wasm, native)| {
        [
            ("drain, wasm -> Pub/Sub emulator", wasm, String::new()),
            ("drain, native -> Pub/Sub emulator", native, String::new()),
        ]
    }))
    .collect();
    for (label, d, extra) in &drains {
        println!(
            "{label:<52} {:>11.0} /s  {:.2} of minimal{extra}",
            d.rate,
            d.rate / minimal.rate
        );
    }
    for (label, stale) in [("previous", &stale_previous), ("current", &stale_current)] {
        println!(
            "{:<52} {:>11.1} ms  slowest of {} claims ({:.1} ms mean), {} cancelled at 5 s, {} of 500 fresh rows claimed",
            format!("claim on stale statistics, {label}"),
            stale.slowest.as_secs_f64() * 1e3,
            stale.claims,
            stale.total.as_secs_f64() * 1e3 / stale.claims.max(1) as f64,
            stale.cancelled,
            stale.fresh_claimed
        );
    }
    let mut peaks = vec![
        ("NATS wasm drain", nats_wasm.peak_rss),
        ("NATS native drain", nats_native.peak_rss),
    ];
    if let Some((slow, fast)) = &latencies {
        for run in [slow, fast] {
            println!(
                "{:<48} {:>14}  p50 {:.1} / p95 {:.1} / p99 {:.1} / max {:.1} ms ({} of {} events)",
                format!("latency at {} events/s", run.rate),
                "",
                run.percentile_ms(0.5),
                run.percentile_ms(0.95),
                run.percentile_ms(0.99),
                run.percentile_ms(1.0),
                run.sorted_us.len(),
                run.sent
            );
        }
        match slow.reload_ms {
            Some(ms) => println!(
                "{:<48} {:>11.0} ms  rename to first event on the new version",
                "hot reload under load", ms
            ),
            None => println!(
                "{:<48} {:>14}  no event reached the new version",
                "hot reload under load", "-"
            ),
        }
        peaks.push(("latency 1k/s", slow.peak_rss));
        peaks.push(("latency 10k/s", fast.peak_rss));
    }
    if let Some((wasm, native)) = &kafka {
        peaks.push(("Kafka wasm drain", wasm.peak_rss));
        peaks.push(("Kafka native drain", native.peak_rss));
    }
    if let Some((wasm, native)) = &pubsub {
        peaks.push(("Pub/Sub wasm drain", wasm.peak_rss));
        peaks.push(("Pub/Sub native drain", native.peak_rss));
    }
    let (worst, peak) = peaks.iter().max_by_key(|(_, p)| *p).copied().unwrap_or(("-", 0));
    println!(
        "{:<48} {:>14}  during the {worst} (whole process: relay and bench harness)",
        "peak resident memory",
        mib(peak)
    );
    println!();
    println!("CPU per 1,000 events, by process (2 cores = 2,000 ms per second)");
    for (label, d) in [
        ("SQL minimal SKIP LOCKED claim + mark-published", &minimal),
        ("SQL claim + ack, previous generation", &ceiling_previous),
        ("SQL claim + ack, current generation", &ceiling),
    ] {
        println!("{label:<52} {}", d.cpu.per_thousand(args.rows));
    }
    for (label, d, _) in &drains {
        println!("{label:<52} {}", d.cpu.per_thousand(args.rows));
    }
    println!(
        "{:<52} {:.2} of previous",
        "PostgreSQL CPU per event, wasm -> NATS",
        nats_wasm.cpu.postgres / nats_wasm_previous.cpu.postgres
    );
    if latencies.is_some() {
        println!();
        println!("latency plot: {}", args.plot.display());
    }
    Ok(())
}

/// NATS drains through the interpreted ports, one call per event against one
/// call per batch, beside the Rust plugin in the same run.
async fn interpreted(services: &Services, args: &Args) -> anyhow::Result<()> {
    let ports = [
        RUST_PLUGIN,
        "python/route_by_type.wasm",
        "python/route_by_type_batch.wasm",
        "js/route_by_type.wasm",
        "js/route_by_type_batch.wasm",
    ];
    for port in ports {
        let path = workspace_root().join("plugins/target").join(port);
        anyhow::ensure!(
            path.is_file(),
            "{} is missing: run scripts/plugin-toolchains.sh",
            path.display()
        );
    }
    eprintln!(
        "building the backlog: {} rows over {} aggregates ...",
        args.rows, args.aggregates
    );
    build_template(services, args, Schema::Current).await?;
    println!();
    println!(
        "| plugin (NATS JetStream, {} rows, batches of {}) | events/s | relay CPU s | peak RSS |",
        args.rows, args.batch_size
    );
    println!("|---|---:|---:|---:|");
    for plugin in ports {
        eprintln!("{plugin} ...");
        let kind = DrainKind {
            target: Target::Nats,
            plugin,
            native: false,
            schema: Schema::Current,
            published_rows: PublishedRows::Keep,
            intake: Intake::Empty,
        };
        let drain = drain(services, args, kind).await?;
        println!(
            "| {plugin} | {:.0} | {:.1} | {} MB |",
            drain.rate,
            drain.cpu.relay,
            drain.peak_rss / 1_000_000
        );
    }
    Ok(())
}
