//! The console at scale, by hand: each page's queries and each page at
//! 1,000,000 outbox rows with 100,000 dead letters, the relay's CPU while a
//! console refreshes its overview every second against the same relay left
//! alone, and the overview of a fleet of 100 databases.
//!
//! ```text
//! scripts/services.sh start > /tmp/env.sh && . /tmp/env.sh
//! (cd plugins && cargo build --release)
//! cargo build --release -p switchyard -p switchyard-bench
//! target/release/console-bench [--rows 1000000] [--dead 100000] [--fleet 100] [--cpu-seconds 60]
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use switchyard::store::{DeadLetterFilter, OutboxStore};

#[derive(Parser)]
struct Args {
    /// Outbox rows in all.
    #[arg(long, default_value_t = 1_000_000)]
    rows: i64,
    /// Of them, dead letters.
    #[arg(long, default_value_t = 100_000)]
    dead: i64,
    /// Of them, waiting to be published.
    #[arg(long, default_value_t = 20_000)]
    waiting: i64,
    /// Databases in the fleet run (0 leaves it out).
    #[arg(long, default_value_t = 100)]
    fleet: usize,
    /// Seconds of each CPU measurement.
    #[arg(long, default_value_t = 60)]
    cpu_seconds: u64,
    /// Samples of each timing.
    #[arg(long, default_value_t = 20)]
    samples: usize,
}

const TOKEN: &str = "console-bench-token-0123456789";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    switchyard::telemetry::init_with_default(switchyard::telemetry::LogFormat::Text, "warn,sqlx=error");
    let server = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:55432/postgres".into());
    let nats = std::env::var("SWITCHYARD_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:54222".into());
    let binary = root().join("target/release/switchyard");
    anyhow::ensure!(
        binary.is_file(),
        "build it first: cargo build --release -p switchyard"
    );
    let admin = sqlx::PgPool::connect(&server).await?;

    let url = fresh(&admin, &server, "console_bench").await?;
    let store = OutboxStore::connect(&url, 4).await?;
    store.migrate().await?;
    let loading = Instant::now();
    fill(&url, &args).await?;
    println!(
        "outbox: {} rows ({} dead letters, {} waiting) loaded in {:.0} s",
        args.rows,
        args.dead,
        args.waiting,
        loading.elapsed().as_secs_f64()
    );

    println!("\nqueries (median / p95 of {} runs, ms):", args.samples);
    let filters: [(&str, DeadLetterFilter); 6] = [
        ("no filter", DeadLetterFilter::default()),
        (
            "event type",
            DeadLetterFilter {
                event_type: Some("OrderPaid".into()),
                ..Default::default()
            },
        ),
        (
            "aggregate",
            DeadLetterFilter {
                aggregate_type: Some("order".into()),
                aggregate_id: Some("d-777".into()),
                ..Default::default()
            },
        ),
        (
            "target",
            DeadLetterFilter {
                target: Some("audit".into()),
                ..Default::default()
            },
        ),
        (
            "error text",
            DeadLetterFilter {
                error_contains: Some("too large".into()),
                ..Default::default()
            },
        ),
        (
            "last 1 h",
            DeadLetterFilter {
                created_since_ms: Some(chrono::Utc::now().timestamp_millis() - 3_600_000),
                ..Default::default()
            },
        ),
    ];
    report(
        "backlog (bounded)",
        time(args.samples, || store.backlog_to(100_000)).await?,
    );
    report(
        "oldest waiting",
        time(args.samples, || store.oldest_pending_age()).await?,
    );
    let all = DeadLetterFilter::default();
    report(
        "dead letters (to 100,000, the overview's)",
        time(args.samples, || store.count_dead_letters_to(&all, 100_000)).await?,
    );
    let event: String = sqlx::query_scalar("SELECT event_id::text FROM switchyard_outbox WHERE id = $1")
        .bind(args.rows / 2)
        .fetch_one(&sqlx::PgPool::connect(&url).await?)
        .await?;
    let event = uuid::Uuid::parse_str(&event)?;
    report("event by id", time(args.samples, || store.event(event)).await?);
    for (name, filter) in &filters {
        report(
            &format!("dead letters page, {name}"),
            time(args.samples, || store.dead_letters(filter, 0, 51)).await?,
        );
        report(
            &format!("dead letter count to 1,000 (the list's), {name}"),
            time(args.samples, || store.count_dead_letters_to(filter, 1_000)).await?,
        );
    }
    let deep: i64 = sqlx::query_scalar(
        "SELECT id FROM switchyard_outbox WHERE status = 'dead' ORDER BY id OFFSET 90000 LIMIT 1",
    )
    .fetch_one(&sqlx::PgPool::connect(&url).await?)
    .await?;

    report(
        "dead letters page 1,801 (after a row id)",
        time(args.samples, || store.dead_letters(&all, deep, 51)).await?,
    );
    report(
        "exact count for a confirmation, no filter",
        time(args.samples, || store.count_dead_letters(&all)).await?,
    );

    let relay = Relay::start(&binary, &[("default", url.clone())], &nats, "bench-single")?;
    relay.ready("/readyz").await?;
    let cookie = relay.sign_in().await?;
    println!(
        "\npages over HTTP, signed in (median / p95 of {} runs, ms):",
        args.samples
    );
    for page in [
        "/".to_string(),
        "/dead-letters".to_string(),
        "/dead-letters?event_type=OrderPaid".to_string(),
        "/dead-letters?target=audit".to_string(),
        "/dead-letters?error=too+large".to_string(),
        format!("/dead-letters?after={deep}"),
        format!("/dead-letters/{}", args.rows - 10),
        format!("/events?id={event}"),
        "/actions/confirm?action=replay&event_type=OrderPaid".to_string(),
    ] {
        let timings = time(args.samples, || relay.get(&page, Some(&cookie))).await?;
        report(&page, timings);
    }

    // The overview reads its figures at most every 2 s: spaced requests
    // read them each time.
    report(
        "/ (figures read afresh: requests 2.1 s apart)",
        spaced(args.samples.min(8), || relay.get("/", None)).await?,
    );

    println!("\nrelay CPU, {} s each, the same process:", args.cpu_seconds);
    let alone = relay
        .cpu_over(Duration::from_secs(args.cpu_seconds), None)
        .await?;
    let open = relay
        .cpu_over(Duration::from_secs(args.cpu_seconds), Some("/"))
        .await?;
    let again = relay
        .cpu_over(Duration::from_secs(args.cpu_seconds), None)
        .await?;
    let busy = relay
        .cpu_over_at(Duration::from_secs(args.cpu_seconds), "/", 10)
        .await?;
    println!("  alone:                         {alone:.1} ms CPU per second");
    println!("  overview refreshed every 1 s:  {open:.1} ms CPU per second");
    println!("  alone again:                   {again:.1} ms CPU per second");
    println!("  overview refreshed 10 times a second: {busy:.1} ms CPU per second");
    let base = (alone + again) / 2.0;
    println!(
        "  the console's cost: {:.2} ms CPU per refresh at 10 a second; at 1 a second {:.1} ms/s, within the noise of {:.1} ms/s between the two quiet runs",
        (busy - base) / 10.0,
        open - base,
        (alone - again).abs()
    );
    drop(relay);

    if args.fleet > 0 {
        fleet(&admin, &server, &nats, &binary, &args).await?;
    }
    Ok(())
}

/// A new database `name` on the server; its URL.
async fn fresh(admin: &sqlx::PgPool, server: &str, name: &str) -> anyhow::Result<String> {
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(admin)
        .await?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(admin)
        .await?;
    Ok(switchyard_tests::postgres::on_database(server, name))
}

/// The outbox a busy service leaves: mostly published rows, dead letters of
/// a few types and targets, a backlog.
async fn fill(url: &str, args: &Args) -> anyhow::Result<()> {
    let pool = sqlx::PgPool::connect(url).await?;
    let published = args.rows - args.dead - args.waiting;
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at, attempts,
                                        created_at, deliveries)
         SELECT 'order', 'o-' || (i % 50000), 'OrderCreated', jsonb_build_object('n', i), 'published', now(), 1,
                now() - interval '1 day' + i * interval '10 ms',
                '{\"orders/orders.created\": {\"target\": \"orders\", \"topic\": \"orders.created\", \"acked_at\": \"2026-11-28T00:00:00Z\"}}'
           FROM generate_series(1, $1) i",
    )
    .bind(published)
    .execute(&pool)
    .await?;
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, attempts, last_error,
                                        created_at, deliveries)
         SELECT 'order', 'd-' || i, (ARRAY['OrderCreated', 'OrderPaid', 'OrderShipped', 'OrderCancelled'])[1 + i % 4],
                jsonb_build_object('n', i, 'note', repeat('x', 200)), 'dead', 10,
                CASE WHEN i % 10 = 0 THEN 'gave up after 10 attempts: message too large for the stream'
                     ELSE 'gave up after 10 attempts: refused by the broker' END,
                now() - interval '2 hours' + i * interval '50 ms',
                jsonb_build_object(CASE WHEN i % 3 = 0 THEN 'audit/audit.orders' ELSE 'orders/orders.created' END,
                    jsonb_build_object('target', CASE WHEN i % 3 = 0 THEN 'audit' ELSE 'orders' END,
                                       'topic', 'orders.created', 'error', 'refused'))
           FROM generate_series(1, $1) i",
    )
    .bind(args.dead)
    .execute(&pool)
    .await?;
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, next_attempt_at)
         SELECT 'order', 'w-' || i, 'OrderCreated', '{}', 'infinity' FROM generate_series(1, $1) i",
    )
    .bind(args.waiting)
    .execute(&pool)
    .await?;
    // As autovacuum leaves a table that has settled: statistics and a
    // visibility map (index-only scans).
    sqlx::query("VACUUM ANALYZE switchyard_outbox")
        .execute(&pool)
        .await?;
    Ok(())
}

/// Runs `call` `samples` times; the times in ms, sorted.
async fn time<T, E, F, Fut>(samples: usize, call: F) -> anyhow::Result<Vec<f64>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let mut times = Vec::with_capacity(samples);
    // One unmeasured run: the plan cached, the pages in memory.
    call().await.map_err(|e| anyhow::anyhow!("{e}"))?;
    for _ in 0..samples {
        let started = Instant::now();
        call().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

/// [`time`], each call 2.1 s after the last (past the figures' cache).
async fn spaced<T, E, F, Fut>(samples: usize, call: F) -> anyhow::Result<Vec<f64>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let mut times = Vec::with_capacity(samples);
    for _ in 0..samples {
        tokio::time::sleep(Duration::from_millis(2100)).await;
        let started = Instant::now();
        call().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    Ok(times)
}

fn report(name: &str, times: Vec<f64>) {
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    println!("  {name:<48} {:>7.2} / {:>7.2}", at(0.5), at(0.95));
}

/// A relay process with its console.
struct Relay {
    child: Child,
    admin: SocketAddr,
    _dir: PathBuf,
}

impl Relay {
    fn start(
        binary: &std::path::Path,
        databases: &[(&str, String)],
        nats: &str,
        name: &str,
    ) -> anyhow::Result<Relay> {
        let dir = std::env::temp_dir().join(format!("console-bench-{name}"));
        std::fs::create_dir_all(&dir)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let plugin = root().join("plugins/target/wasm32-wasip2/release/route_by_type.wasm");
        let mut config = String::new();
        if let [(_, url)] = databases {
            config.push_str(&format!("[database]\nurl = {url:?}\nmax_connections = 8\n\n"));
        } else {
            // Two connections a database: a claim worker and LISTEN.
            config.push_str("[relay]\nconcurrency = 1\n\n");
            for (name, url) in databases {
                config.push_str(&format!(
                    "[[databases]]\nname = {name:?}\nurl = {url:?}\nmax_connections = 2\n\n"
                ));
            }
        }
        config.push_str(&format!(
            "[admin]\nlisten = \"127.0.0.1:{port}\"\nconsole = true\n[admin.tokens]\nbench = {TOKEN:?}\n\n\
             [plugin_runtime]\ncache = false\n\n\
             [[plugins]]\nname = \"router\"\npath = {:?}\n[plugins.config]\ntarget = \"orders\"\n\n\
             [targets.orders]\ntype = \"nats\"\nurl = {nats:?}\n",
            plugin.display().to_string()
        ));
        let path = dir.join("relay.toml");
        std::fs::write(&path, config)?;
        let child = Command::new(binary)
            .args(["run", "--config"])
            .arg(&path)
            .env("SWITCHYARD_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()?;
        Ok(Relay {
            child,
            admin: SocketAddr::from(([127, 0, 0, 1], port)),
            _dir: dir,
        })
    }

    /// Waits until `path` answers 200.
    async fn ready(&self, path: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if matches!(self.get(path, None).await, Ok(200)) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        anyhow::bail!("{path} did not answer 200 in 120 s")
    }

    async fn sign_in(&self) -> anyhow::Result<String> {
        let (status, head) = self
            .request("POST", "/sign-in", None, &format!("token={TOKEN}"))
            .await?;
        anyhow::ensure!(status == 303, "sign-in answered {status}");
        head.lines()
            .find_map(|line| line.strip_prefix("set-cookie: "))
            .and_then(|cookie| cookie.split(';').next())
            .map(str::to_string)
            .ok_or_else(|| anyhow::anyhow!("no session cookie"))
    }

    async fn get(&self, path: &str, cookie: Option<&str>) -> anyhow::Result<u16> {
        Ok(self.request("GET", path, cookie, "").await?.0)
    }

    async fn request(
        &self,
        method: &str,
        path: &str,
        cookie: Option<&str>,
        body: &str,
    ) -> anyhow::Result<(u16, String)> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.admin).await?;
        let mut request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n",
            self.admin
        );
        if let Some(cookie) = cookie {
            request.push_str(&format!("Cookie: {cookie}\r\n"));
        }
        if method == "POST" {
            request.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
        }
        request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        let text = String::from_utf8_lossy(&response);
        let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let head = text.split("\r\n\r\n").next().unwrap_or("").to_string();
        Ok((status, head))
    }

    /// [`Relay::cpu_over`], requesting `page` `per_second` times a second.
    async fn cpu_over_at(&self, span: Duration, page: &str, per_second: u32) -> anyhow::Result<f64> {
        let before = self.cpu()?;
        let started = Instant::now();
        let mut every = tokio::time::interval(Duration::from_secs(1) / per_second);
        while started.elapsed() < span {
            every.tick().await;
            anyhow::ensure!(self.get(page, None).await? == 200, "{page} failed");
        }
        Ok((self.cpu()? - before) / started.elapsed().as_secs_f64())
    }

    /// CPU the relay used so far, ms.
    fn cpu(&self) -> anyhow::Result<f64> {
        let stat = procfs::process::Process::new(i32::try_from(self.child.id())?)?.stat()?;
        Ok((stat.utime + stat.stime) as f64 * 1000.0 / procfs::ticks_per_second() as f64)
    }

    /// The relay's CPU (ms per second) over `span`, requesting `page` once a
    /// second meanwhile when given.
    async fn cpu_over(&self, span: Duration, page: Option<&str>) -> anyhow::Result<f64> {
        let cpu = || -> anyhow::Result<f64> {
            let stat = procfs::process::Process::new(i32::try_from(self.child.id())?)?.stat()?;
            Ok((stat.utime + stat.stime) as f64 * 1000.0 / procfs::ticks_per_second() as f64)
        };
        let before = cpu()?;
        let started = Instant::now();
        let mut every = tokio::time::interval(Duration::from_secs(1));
        while started.elapsed() < span {
            every.tick().await;
            if let Some(page) = page {
                anyhow::ensure!(self.get(page, None).await? == 200, "{page} failed");
            }
        }
        Ok((cpu()? - before) / started.elapsed().as_secs_f64())
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fleet of `args.fleet` databases: the overview's time and CPU.
async fn fleet(
    admin: &sqlx::PgPool,
    server: &str,
    nats: &str,
    binary: &std::path::Path,
    args: &Args,
) -> anyhow::Result<()> {
    let template = fresh(admin, server, "console_bench_template").await?;
    let store = OutboxStore::connect(&template, 1).await?;
    store.migrate().await?;
    store.close().await;
    // A database is copied only while nobody is connected to it.
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'console_bench_template'",
    )
    .execute(admin)
    .await?;
    let mut databases = Vec::new();
    let made = Instant::now();
    for i in 0..args.fleet {
        let name = format!("console_bench_{i:03}");
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(admin)
            .await?;
        sqlx::query(&format!("CREATE DATABASE {name} TEMPLATE console_bench_template"))
            .execute(admin)
            .await?;
        databases.push((
            format!("db-{i:03}"),
            switchyard_tests::postgres::on_database(server, &name),
        ));
    }
    println!(
        "\nfleet: {} databases made in {:.0} s",
        args.fleet,
        made.elapsed().as_secs_f64()
    );
    let named: Vec<(&str, String)> = databases.iter().map(|(n, u)| (n.as_str(), u.clone())).collect();
    let relay = Relay::start(binary, &named, nats, "bench-fleet")?;
    relay.ready("/").await?;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(120) {
        let (_, body) = readyz(&relay).await?;
        if body.contains("\"state\":\"ok\"") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "  every database served after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    report(
        "overview of the fleet (ms)",
        time(args.samples, || relay.get("/", None)).await?,
    );
    report(
        "one database's page (ms)",
        time(args.samples, || relay.get("/db/db-050", None)).await?,
    );
    report(
        "overview of the fleet, figures read afresh (ms)",
        spaced(args.samples.min(8), || relay.get("/", None)).await?,
    );
    let alone = relay
        .cpu_over(Duration::from_secs(args.cpu_seconds), None)
        .await?;
    let open = relay
        .cpu_over(Duration::from_secs(args.cpu_seconds), Some("/"))
        .await?;
    println!("  relay CPU alone {alone:.1} ms/s, with the overview refreshed every second {open:.1} ms/s");
    drop(relay);
    for i in 0..args.fleet {
        sqlx::query(&format!(
            "DROP DATABASE IF EXISTS console_bench_{i:03} WITH (FORCE)"
        ))
        .execute(admin)
        .await?;
    }
    Ok(())
}

async fn readyz(relay: &Relay) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(relay.admin).await?;
    stream
        .write_all(
            format!(
                "GET /readyz HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                relay.admin
            )
            .as_bytes(),
        )
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((
        status,
        response
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default(),
    ))
}
