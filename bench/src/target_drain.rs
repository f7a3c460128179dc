//! The relay's CPU per event for each kind of target against NATS
//! JetStream, by hand: a relay process (the release `relay-process`, beside
//! this binary) drains the same backlog to JetStream, to a standard SQS
//! queue and a FIFO queue on a moto server of the bench's own, to a webhook
//! receiver in this process, and to a Redis stream on the services' Redis
//! (TLS, the ACL user), the targets in turn (NATS, SQS, FIFO, HTTP, Redis,
//! NATS...), and the relay process's CPU time (utime + stime from
//! /proc/PID/stat) from the backlog's commit until it is drained is printed
//! per event, with the events/s, for each drain.
//!
//! ```text
//! eval "$(scripts/services.sh start)"
//! (cd plugins && cargo build --release)
//! cargo build --release -p switchyard-tests --bin relay-process
//! cargo run --release -p switchyard-bench --bin target-drain [-- --rows 20000 --fifo-rows 5000 --rounds 2 --targets nats,http,redis]
//! ```
//!
//! The relay starts on an empty outbox and is measured from a few seconds
//! after, when its plugin is compiled and its targets are connected; the
//! backlog (`--rows` events over `--aggregates` aggregates, so that FIFO
//! groups do not serialise the drain) is then committed in one statement.
//! Its CPU while idle is measured before, and shown as a share of each
//! drain's figure. Every drain has the same `[relay]`, the relay's defaults
//! but for a publish timeout long enough for moto (60 s).
//!
//! moto is no SQS: one Python process, slower with every message a queue
//! holds. The bench purges the queue every 200 ms (moto started with
//! strict purging off), so that the queue stays short; the relay does the
//! same work for each event either way. The events/s to SQS are moto's,
//! not the service's: the CPU per event is the figure. FIFO queues are
//! slower still on moto: their drains are `--fifo-rows` events. At that
//! pace the relay's costs that go by time (its idle ticks, lease
//! extensions of the claims held while moto answers) weigh on each event,
//! so SQS is drained a second time to SQS's API answered at once by this
//! process (`sqs-local`, `fifo-local`), at NATS's pace: that is the
//! relay's own CPU per event. The webhook receiver answers `200` to every
//! request at once without checking its signature (the relay signs each
//! all the same).

// The same allocator as the shipped relay's (the relay is another process;
// this keeps the bench's own build in line with the others).
#[global_allocator]
static ALLOCATOR: switchyard::Allocator = switchyard::ALLOCATOR;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use sqlx::PgPool;
use switchyard_tests::aws::{Moto, query_call, unique};
use switchyard_tests::relay::Process;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    about = "Relay CPU per event: SQS (standard and FIFO, on moto), a webhook and Redis Streams against NATS JetStream"
)]
struct Args {
    /// Events of each NATS and standard SQS drain.
    #[arg(long, default_value_t = 20_000)]
    rows: u64,
    /// Events of each FIFO drain (0: none).
    #[arg(long, default_value_t = 5_000)]
    fifo_rows: u64,
    /// Distinct aggregates in a backlog.
    #[arg(long, default_value_t = 10_000)]
    aggregates: u64,
    /// Rounds: each drains to every target once, in turn.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Only these targets (comma-separated: nats, sqs, fifo, sqs-local,
    /// fifo-local, http, redis); all when empty.
    #[arg(long, value_delimiter = ',')]
    targets: Vec<String>,
    /// Rows per claim.
    #[arg(long, default_value_t = 500)]
    batch_size: u32,
    /// Concurrent batches.
    #[arg(long, default_value_t = 4)]
    concurrency: u32,
    /// Seconds the relay runs idle before it is measured (its start left out).
    #[arg(long, default_value_t = 5)]
    settle_seconds: u64,
    /// The relay binary (the `relay-process` beside this one by default).
    #[arg(long)]
    relay: Option<PathBuf>,
}

/// Where a drain publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Nats,
    Sqs,
    Fifo,
    /// SQS's API answered at once by this process: the relay's own cost.
    SqsLocal,
    FifoLocal,
    Http,
    Redis,
}

const TARGETS: [Target; 7] = [
    Target::Nats,
    Target::Sqs,
    Target::Fifo,
    Target::SqsLocal,
    Target::FifoLocal,
    Target::Http,
    Target::Redis,
];

impl Target {
    fn key(self) -> &'static str {
        match self {
            Target::Nats => "nats",
            Target::Sqs => "sqs",
            Target::Fifo => "fifo",
            Target::SqsLocal => "sqs-local",
            Target::FifoLocal => "fifo-local",
            Target::Http => "http",
            Target::Redis => "redis",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Target::Nats => "NATS JetStream",
            Target::Sqs => "SQS standard (moto)",
            Target::Fifo => "SQS FIFO (moto)",
            Target::SqsLocal => "SQS standard (answered at once)",
            Target::FifoLocal => "SQS FIFO (answered at once)",
            Target::Http => "HTTP webhook (local receiver)",
            Target::Redis => "Redis Streams (TLS, ACL user)",
        }
    }
}

/// One drain's figures.
struct Drain {
    target: Target,
    rows: u64,
    seconds: f64,
    /// The relay process's CPU seconds over the drain.
    cpu: f64,
    /// Its CPU seconds a second while idle, before the drain.
    idle_per_second: f64,
}

impl Drain {
    fn cpu_us_per_event(&self) -> f64 {
        self.cpu * 1e6 / self.rows as f64
    }

    /// The CPU per event less what the relay spends idle over as long.
    fn busy_us_per_event(&self) -> f64 {
        (self.cpu - self.idle_per_second * self.seconds).max(0.0) * 1e6 / self.rows as f64
    }
}

struct Bench {
    args: Args,
    server_url: String,
    nats_url: String,
    relay: String,
    moto: Moto,
    /// The webhook receiver's address.
    receiver: String,
    /// The address of the SQS API answered at once.
    sqs_local: String,
    admin: PgPool,
}

const TEMPLATE: &str = "sy_drainbench_template";

/// Event `n` (aggregate `n % $3`): ~200-byte order documents with a
/// traceparent, as the relay bench's.
const INSERT: &str =
    "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
    SELECT 'order', 'order-' || lpad((n % $3)::text, 6, '0'),
        (ARRAY['OrderCreated', 'OrderPaid', 'OrderShipped'])[1 + (n / $3) % 3],
        jsonb_build_object(
            'order_id', 'order-' || lpad((n % $3)::text, 6, '0'),
            'customer_id', 'cust-' || (n % 997),
            'status', 'created', 'currency', 'EUR',
            'total_cents', 1000 + n % 90000,
            'items', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (n % 50), 'qty', 1 + n % 3)),
            'created_at', '2026-11-22T10:00:00Z'),
        jsonb_build_object('traceparent',
            '00-' || lpad(to_hex(n), 32, '0') || '-' || lpad(to_hex(n + 1), 16, '0') || '-01')
    FROM generate_series($1::bigint, $2::bigint - 1) n";

/// The CPU seconds process `pid` has used.
fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = procfs::process::Process::new(i32::try_from(pid)?)?.stat()?;
    Ok((stat.utime + stat.stime) as f64 / procfs::ticks_per_second() as f64)
}

impl Bench {
    fn db_url(&self, name: &str) -> String {
        switchyard_tests::postgres::on_database(&self.server_url, name)
    }

    async fn recreate(&self, name: &str, template: Option<&str>) -> anyhow::Result<()> {
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&self.admin)
            .await?;
        let from = template.map(|t| format!(" TEMPLATE {t}")).unwrap_or_default();
        sqlx::query(&format!("CREATE DATABASE {name}{from}"))
            .execute(&self.admin)
            .await?;
        Ok(())
    }

    /// An empty, migrated outbox to copy for each drain.
    async fn template(&self) -> anyhow::Result<()> {
        self.recreate(TEMPLATE, None).await?;
        let pool = PgPool::connect(&self.db_url(TEMPLATE)).await?;
        switchyard_tests::postgres::migrate_before(&pool, i64::MAX).await?;
        pool.close().await;
        Ok(())
    }

    fn config(&self, url: &str, target: Target, queue: &str) -> String {
        let (topic, target_config) = match target {
            Target::Nats => (
                "bench.{event_type}".to_string(),
                format!(
                    "type = \"nats\"\nurl = \"{}\"\nstream = {{ name = \"BENCH\", subjects = [\"bench.>\"] }}\n\
                     duplicate_window_seconds = 3600",
                    self.nats_url
                ),
            ),
            Target::Sqs | Target::Fifo | Target::SqsLocal | Target::FifoLocal => (
                queue.to_string(),
                format!(
                    "type = \"sqs\"\nregion = \"{}\"\nendpoint_url = \"{}\"\naccess_key_id = \"{}\"\n\
                     secret_access_key = \"{}\"\nqueues = [\"{queue}\"]",
                    switchyard_tests::aws::REGION,
                    if matches!(target, Target::Sqs | Target::Fifo) {
                        &self.moto.url
                    } else {
                        &self.sqs_local
                    },
                    switchyard_tests::aws::ACCESS_KEY_ID,
                    switchyard_tests::aws::SECRET_ACCESS_KEY,
                ),
            ),
            Target::Http => (
                "orders".to_string(),
                format!(
                    "type = \"http\"\nbase_url = \"{}\"\nsigning_secrets = [\"whsec_{}\"]",
                    self.receiver,
                    base64_secret()
                ),
            ),
            Target::Redis => {
                let redis = switchyard_tests::redis::RedisServer::shared();
                (
                    queue.to_string(),
                    format!(
                        "type = \"redis\"\nurl = \"{}\"\nuser = \"switchyard\"\npassword = \"{}\"\n\
                         tls = {{ root_cert = \"{}\" }}",
                        redis.url,
                        redis.password,
                        switchyard_tests::postgres::tls_file("ca.pem"),
                    ),
                )
            }
        };
        let plugin = switchyard_tests::workspace_root()
            .join("plugins/target/wasm32-wasip2/release/route_by_type.wasm");
        format!(
            r#"
[database]
url = "{url}"
max_connections = {max_connections}
[relay]
batch_size = {batch}
concurrency = {concurrency}
publish_timeout_ms = 60000
lease_duration_ms = 150000
[[plugins]]
name = "router"
path = "{plugin}"
[plugins.config]
target = "out"
topic = "{topic}"
[targets.out]
{target_config}
"#,
            max_connections = self.args.concurrency * 2 + 4,
            batch = self.args.batch_size,
            concurrency = self.args.concurrency,
            plugin = plugin.display(),
        )
    }

    async fn reset_nats(&self) -> anyhow::Result<()> {
        let client = async_nats::connect(&self.nats_url).await?;
        let _ = async_nats::jetstream::new(client).delete_stream("BENCH").await;
        Ok(())
    }

    /// Drains `rows` events to `target` with a relay process of its own.
    async fn drain(&self, target: Target, rows: u64) -> anyhow::Result<Drain> {
        let name = format!("sy_drainbench_{}", target.key().replace('-', "_"));
        self.recreate(&name, Some(TEMPLATE)).await?;
        let url = self.db_url(&name);
        let queue = match target {
            Target::Nats => {
                self.reset_nats().await?;
                String::new()
            }
            Target::Sqs | Target::SqsLocal | Target::Redis => unique("bench"),
            Target::Fifo | Target::FifoLocal => unique("bench") + ".fifo",
            Target::Http => String::new(),
        };
        let queue_url = if !matches!(target, Target::Sqs | Target::Fifo) {
            String::new()
        } else {
            self.moto.queue(&queue).await
        };
        let mut relay = Process::spawn(&self.relay, &self.config(&url, target, &queue), "bench");
        let pid = relay.pid();
        tokio::time::sleep(Duration::from_secs(self.args.settle_seconds)).await;
        anyhow::ensure!(!relay.has_exited(), "the relay exited (see its log above)");
        let idle_from = (Instant::now(), cpu_seconds(pid)?);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let idle_per_second = (cpu_seconds(pid)? - idle_from.1) / idle_from.0.elapsed().as_secs_f64();
        let purging = CancellationToken::new();
        let purger = (!queue_url.is_empty()).then(|| self.purge(&queue_url, purging.clone()));
        let pool = PgPool::connect(&url).await?;
        eprintln!("{}: relay pid {pid}, {rows} events", target.label());
        let cpu_before = cpu_seconds(pid)?;
        let started = Instant::now();
        sqlx::query(INSERT)
            .bind(0i64)
            .bind(i64::try_from(rows)?)
            .bind(i64::try_from(self.args.aggregates)?)
            .execute(&pool)
            .await?;
        let limit = started + Duration::from_secs(3600);
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let published: i64 =
                sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = 'published'")
                    .fetch_one(&pool)
                    .await?;
            if published >= i64::try_from(rows)? {
                break;
            }
            anyhow::ensure!(
                Instant::now() < limit,
                "not drained within an hour: {published} published"
            );
            anyhow::ensure!(!relay.has_exited(), "the relay exited mid-drain");
        }
        let seconds = started.elapsed().as_secs_f64();
        let cpu = cpu_seconds(pid)? - cpu_before;
        purging.cancel();
        if let Some(purger) = purger {
            let _ = purger.await;
        }
        let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = 'dead'")
            .fetch_one(&pool)
            .await?;
        anyhow::ensure!(dead == 0, "{dead} rows dead-lettered");
        relay.terminate();
        pool.close().await;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&self.admin)
            .await?;
        if target == Target::Nats {
            self.reset_nats().await?;
        }
        if target == Target::Redis {
            let _ = switchyard_tests::redis::RedisServer::shared()
                .command(&["DEL", &queue])
                .await;
        }
        let drain = Drain {
            target,
            rows,
            seconds,
            cpu,
            idle_per_second,
        };
        eprintln!(
            "{}: {:.0} events/s, relay CPU {:.1} µs/event ({:.1} less idle)",
            target.label(),
            rows as f64 / seconds,
            drain.cpu_us_per_event(),
            drain.busy_us_per_event()
        );
        Ok(drain)
    }

    /// Purges queue `url` every 200 ms until `stop`: moto slows with every
    /// message a queue holds.
    fn purge(&self, url: &str, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
        let (moto, url) = (self.moto.url.clone(), url.to_string());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                // A failed purge (the call panics) is the next one's to do.
                let call = {
                    let (moto, url) = (Moto::at(&moto), url.clone());
                    tokio::spawn(async move {
                        query_call(
                            &moto,
                            "sqs",
                            None,
                            &[("Action", "PurgeQueue"), ("QueueUrl", &url)],
                        )
                        .await;
                    })
                };
                let _ = call.await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    }
}

/// A webhook receiver on a loopback port of its own, answering `200` to
/// every request once its body is read; its `http://` address.
async fn receiver() -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let app = axum::Router::new().fallback(|_body: axum::body::Bytes| async { axum::http::StatusCode::OK });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(format!("http://{address}/hooks"))
}

/// SQS's JSON API on a loopback port, each call answered at once as SQS
/// would: a queue's URL and attributes, every entry of a batch sent. What
/// the relay spends per event is then its own, not the pace of an
/// emulator (moto answers some hundreds of messages a second).
async fn sqs_answered_at_once() -> anyhow::Result<String> {
    use axum::http::{HeaderMap, StatusCode, header};
    use serde_json::{Value, json};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let base = format!("http://{address}");
    let own = base.clone();
    let app = axum::Router::new().fallback(move |headers: HeaderMap, body: axum::body::Bytes| {
        let base = own.clone();
        async move {
            let target = headers
                .get("x-amz-target")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let answer = match target.as_str() {
                "AmazonSQS.GetQueueUrl" => {
                    json!({"QueueUrl": format!("{base}/123456789012/{}", request["QueueName"].as_str().unwrap_or("q"))})
                }
                "AmazonSQS.GetQueueAttributes" => {
                    json!({"Attributes": {"QueueArn": "arn:aws:sqs:us-east-1:123456789012:bench"}})
                }
                "AmazonSQS.SendMessageBatch" => {
                    let fifo = request["QueueUrl"].as_str().is_some_and(|u| u.ends_with(".fifo"));
                    let sent: Vec<Value> = request["Entries"]
                        .as_array()
                        .map(Vec::as_slice)
                        .unwrap_or_default()
                        .iter()
                        .map(|entry| {
                            let mut sent = json!({
                                "Id": entry["Id"],
                                "MessageId": uuid::Uuid::new_v4().to_string(),
                                "MD5OfMessageBody": "d41d8cd98f00b204e9800998ecf8427e",
                            });
                            if fifo {
                                sent["SequenceNumber"] = json!("18849496460467696128");
                            }
                            sent
                        })
                        .collect();
                    json!({"Successful": sent, "Failed": []})
                }
                _ => json!({}),
            };
            (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/x-amz-json-1.0")],
                answer.to_string(),
            )
        }
    });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(base)
}

/// A signing secret's key, as Standard Webhooks secrets are written: 32
/// hex characters are base64's alphabet, a 24-byte key.
fn base64_secret() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
    let server_url = var("DATABASE_URL", "postgres://postgres@127.0.0.1:55432/postgres");
    let relay = match &args.relay {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("relay-process"),
    };
    anyhow::ensure!(
        relay.is_file(),
        "no relay at {}: cargo build --release -p switchyard-tests --bin relay-process",
        relay.display()
    );
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&server_url)
        .await
        .with_context(|| format!("PostgreSQL at {server_url} (run scripts/services.sh start)"))?;
    // moto purges a queue at any time when strict purging is off.
    let moto = Moto::own_with(&[("MOTO_SQS_ENFORCE_STRICT_QUEUE_PURGE_BEHAVIOUR", "false")]).await;
    let receiver = receiver().await?;
    let sqs_local = sqs_answered_at_once().await?;
    let bench = Bench {
        receiver,
        sqs_local,
        nats_url: var("SWITCHYARD_NATS_URL", "nats://127.0.0.1:54222"),
        server_url,
        relay: relay.to_string_lossy().to_string(),
        moto,
        admin,
        args,
    };
    bench.template().await?;
    let wanted = |target: Target| {
        bench.args.targets.is_empty() || bench.args.targets.iter().any(|t| t == target.key())
    };
    let mut drains = Vec::new();
    for round in 1..=bench.args.rounds {
        eprintln!("round {round}");
        for target in TARGETS {
            let rows = if target == Target::Fifo {
                bench.args.fifo_rows
            } else {
                bench.args.rows
            };
            if wanted(target) && rows > 0 {
                drains.push(bench.drain(target, rows).await?);
            }
        }
    }
    sqlx::query(&format!("DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)"))
        .execute(&bench.admin)
        .await?;
    print(&drains);
    Ok(())
}

/// One line a drain, in the order they ran, then each target's median and
/// its ratio to NATS's.
fn print(drains: &[Drain]) {
    println!();
    println!("| drain | events | events/s | relay CPU µs/event | less idle | idle CPU |");
    println!("|---|---|---|---|---|---|");
    for drain in drains {
        println!(
            "| {} | {} | {:.0} | {:.1} | {:.1} | {:.1} ms/s |",
            drain.target.label(),
            drain.rows,
            drain.rows as f64 / drain.seconds,
            drain.cpu_us_per_event(),
            drain.busy_us_per_event(),
            drain.idle_per_second * 1e3,
        );
    }
    let median = |target: Target, of: fn(&Drain) -> f64| {
        let mut values: Vec<f64> = drains.iter().filter(|d| d.target == target).map(of).collect();
        values.sort_by(f64::total_cmp);
        match values.len() {
            0 => None,
            n if n % 2 == 1 => Some(values[n / 2]),
            n => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
        }
    };
    let Some(nats) = median(Target::Nats, Drain::cpu_us_per_event) else {
        return;
    };
    let nats_busy = median(Target::Nats, Drain::busy_us_per_event).unwrap_or(nats);
    println!();
    for target in &TARGETS[1..] {
        let target = *target;
        if let (Some(cpu), Some(busy)) = (
            median(target, Drain::cpu_us_per_event),
            median(target, Drain::busy_us_per_event),
        ) {
            println!(
                "{}: {cpu:.1} µs/event against NATS's {nats:.1}: {:.2}x ({:.2}x less idle)",
                target.label(),
                cpu / nats,
                busy / nats_busy.max(f64::MIN_POSITIVE)
            );
        }
    }
}
