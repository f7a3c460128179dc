//! `relay-bench --replication`: replication mode against claim mode (keep
//! and delete) in the same run: drain rate and CPU per process to NATS
//! JetStream and to Kafka from the same backlog (in replication mode also
//! one written with `switchyard_emit`, no rows), commit-to-consumer latency
//! at 100 and 1,000 events/s in both modes, and what a writer pays for an
//! event written as a row or as a logical message.
//!
//! A replication drain cannot start from a copy of the template (a copied
//! database has no WAL of its rows): its backlog is written after the slot
//! is created and before the relay starts, and the clock runs from the
//! relay's start until the slot is confirmed past the last row.

use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::PgPool;
use switchyard::Config;
use switchyard::config::source::{SourceColumns, SourceConfig};
use switchyard::config::{FeedMode, ReplicationConfig};
use switchyard::store::replication::SourceTable;
use switchyard::store::{OutboxStore, PublishedRows};

use super::{
    Args, CpuMark, Drain, DrainKind, EVENT_FIELDS, Latency, Load, RUST_PLUGIN, Running, Schema, Services,
    Target, admin_pool, build_template, drain, drop_db, latency_in, load_rows, peak_rss, recreate_db,
    relay_config, reset_brokers, reset_peak_rss, workspace_root,
};

/// Drops slot `name` if it exists (a database with a slot cannot be dropped).
pub(super) async fn drop_slot(admin: &PgPool, name: &str) -> anyhow::Result<()> {
    sqlx::query("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1")
        .bind(name)
        .execute(admin)
        .await?;
    Ok(())
}

/// Puts a migrated outbox into replication mode through slot `slot`.
pub(super) async fn set_up(store: &OutboxStore, slot: &str) -> anyhow::Result<()> {
    let pg = store.postgres().context("replication mode needs PostgreSQL")?;
    let statements = pg
        .feed_statements(Some((slot, "switchyard_outbox")), None)
        .await?;
    pg.run_feed_statements(&statements).await?;
    Ok(())
}

/// The table a service writes its events into when the relay reads it as
/// `[source]`: the intake's columns and defaults, a primary key, nothing
/// else (a plain table, as a service's own outbox is).
pub(super) const SERVICE_TABLE: &str = "service_outbox";

/// `[source]` for [`SERVICE_TABLE`].
pub(super) fn service_source() -> SourceConfig {
    SourceConfig {
        table: SERVICE_TABLE.to_string(),
        schema: None,
        columns: SourceColumns {
            // Ids from WAL positions: a mapped event id column needs a
            // unique index of its own, and the table has its key only.
            event_id: None,
            aggregate_type: "aggregate_type".into(),
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            payload: "payload".into(),
            headers: Some("headers".into()),
            tenant: Some("tenant".into()),
        },
        header_columns: std::collections::BTreeMap::new(),
        order_by: None,
    }
}

/// Creates [`SERVICE_TABLE`] and puts a migrated outbox into replication
/// mode through slot `slot`, reading that table as `[source]`.
pub(super) async fn set_up_service_table(store: &OutboxStore, url: &str, slot: &str) -> anyhow::Result<()> {
    let pool = PgPool::connect(url).await?;
    sqlx::raw_sql(&format!(
        "CREATE TABLE {SERVICE_TABLE} (LIKE switchyard_intake INCLUDING DEFAULTS INCLUDING IDENTITY);
         ALTER TABLE {SERVICE_TABLE} ADD PRIMARY KEY (id);"
    ))
    .execute(&pool)
    .await?;
    pool.close().await;
    let pg = store.postgres().context("replication mode needs PostgreSQL")?;
    let capture = pg.check_source(&service_source()).await?;
    let table = SourceTable::new(&capture);
    let statements = pg
        .feed_statements(Some((slot, "switchyard_outbox")), Some(&table))
        .await?;
    pg.run_feed_statements(&statements).await?;
    Ok(())
}

/// Makes a bench config read slot `slot`.
pub(super) fn configure(config: &mut Config, slot: &str) {
    config.relay.mode = FeedMode::Replication;
    config.replication = Some(ReplicationConfig {
        slot: slot.to_string(),
        ..ReplicationConfig::default()
    });
}

/// How a backlog is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    /// Rows of `switchyard_outbox`.
    Rows,
    /// Logical messages, through `switchyard_emit`.
    Emitted,
}

/// One replication drain of `args.rows` events to `target`.
async fn replication_drain(
    services: &Services,
    args: &Args,
    target: Target,
    written: Written,
) -> anyhow::Result<Drain> {
    let admin = admin_pool(services).await?;
    let name = "sy_bench_replication";
    drop_slot(&admin, name).await?;
    recreate_db(&admin, name, None).await?;
    let url = services.db_url(name);
    let store = OutboxStore::connect(&url, 4).await?;
    store.migrate().await?;
    set_up(&store, name).await?;
    let pool = PgPool::connect(&url).await?;
    match written {
        Written::Rows => load_rows(&pool, args).await?,
        Written::Emitted => emit_events(&pool, args).await?,
    }
    let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await?;
    reset_brokers(services, target).await?;
    let plugin = workspace_root().join("plugins/target").join(RUST_PLUGIN);
    let mut config = relay_config(&url, services, args, target, &plugin, PublishedRows::Keep)?;
    configure(&mut config, name);
    reset_peak_rss();
    let relay = switchyard::runtime::build(&config).await?;
    let cpu = CpuMark::now();
    let started = Instant::now();
    let running = Running::start(&relay);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let past: bool = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(name)
        .bind(&end)
        .fetch_one(&pool)
        .await?;
        if past {
            break;
        }
        anyhow::ensure!(!running.task.is_finished(), "the relay stopped early");
    }
    let elapsed = started.elapsed();
    running.stop().await?;
    let result = Drain {
        rate: args.rows as f64 / elapsed.as_secs_f64(),
        cpu: CpuMark::now().since(cpu),
        peak_rss: peak_rss(),
    };
    let (untouched, dead): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'streamed'), count(*) FILTER (WHERE status = 'dead')
           FROM switchyard_outbox",
    )
    .fetch_one(&pool)
    .await?;
    anyhow::ensure!(dead == 0, "{dead} rows dead-lettered during the drain");
    let streamed = if written == Written::Rows { args.rows } else { 0 };
    anyhow::ensure!(
        u64::try_from(untouched)? == streamed,
        "{} rows went through the table",
        streamed.abs_diff(u64::try_from(untouched)?)
    );
    drop(relay);
    pool.close().await;
    drop_slot(&admin, name).await?;
    drop_db(services, name).await?;
    Ok(result)
}

/// Runs the comparison and prints its table.
pub(super) async fn run(services: &Services, args: &Args) -> anyhow::Result<()> {
    eprintln!(
        "building the claim backlog: {} rows over {} aggregates ...",
        args.rows, args.aggregates
    );
    build_template(services, args, Schema::Current).await?;
    let mut targets = vec![Target::Nats];
    if !args.no_kafka {
        targets.push(Target::Kafka);
    }
    let mut rows: Vec<(String, Drain)> = Vec::new();
    for target in targets {
        let to = if target == Target::Nats {
            "NATS JetStream"
        } else {
            "Kafka"
        };
        for published_rows in [PublishedRows::Keep, PublishedRows::Delete] {
            let label = format!(
                "claim mode ({}), wasm -> {to}",
                if published_rows == PublishedRows::Keep {
                    "keep"
                } else {
                    "delete"
                }
            );
            eprintln!("{label} ...");
            let kind = DrainKind {
                target,
                plugin: RUST_PLUGIN,
                native: false,
                schema: Schema::Current,
                published_rows,
                intake: super::Intake::Empty,
            };
            rows.push((label, drain(services, args, kind).await?));
        }
        let label = format!("replication, wasm -> {to}");
        eprintln!("{label} ...");
        rows.push((
            label,
            replication_drain(services, args, target, Written::Rows).await?,
        ));
        if target == Target::Nats {
            let label = format!("replication (switchyard_emit), wasm -> {to}");
            eprintln!("{label} ...");
            rows.push((
                label,
                replication_drain(services, args, target, Written::Emitted).await?,
            ));
        }
    }
    drop_db(services, Schema::Current.template()).await?;
    let mut latencies: Vec<(String, Latency)> = Vec::new();
    if args.no_latency {
        print(args, &rows, &latencies);
        return Ok(());
    }
    for rate in [100, 1_000] {
        for replication in [false, true] {
            let mode = if replication { "replication" } else { "claim mode" };
            eprintln!("latency, {mode}, {rate} events/s ...");
            let load = Load {
                replication,
                ..Load::new(rate, args.latency_seconds)
            };
            let run = latency_in(services, args, load).await?;
            latencies.push((format!("{mode} at {rate} events/s"), run));
        }
    }
    print(args, &rows, &latencies);
    eprintln!("writer cost, rows and switchyard_emit ...");
    print_writers(&writer_cost(services).await?);
    Ok(())
}

/// The bench backlog's events, written with `switchyard_emit` in
/// transactions of 10,000.
async fn emit_events(pool: &PgPool, args: &Args) -> anyhow::Result<()> {
    let chunk = 10_000u64;
    let mut from = 0;
    while from < args.rows {
        let to = (from + chunk).min(args.rows);
        sqlx::query(&format!(
            "SELECT count(switchyard_emit({})) FROM generate_series($1::bigint, $2::bigint - 1) n",
            EVENT_FIELDS
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

/// Events each way in the writer comparison, and writers side by side.
pub(super) const WRITER_EVENTS: u64 = 20_000;
pub(super) const WRITERS: u64 = 4;

/// What writers paid for their events written one way.
pub(super) struct WriterCost {
    how: &'static str,
    rate: f64,
    /// Each transaction's time, BEGIN to COMMIT, sorted.
    sorted_us: Vec<u64>,
    /// Each INSERT statement's own round trip, sorted: a NOTIFY costs its
    /// transaction at COMMIT, not here.
    insert_us: Vec<u64>,
    postgres_ms_per_thousand: f64,
    wal_bytes_per_event: f64,
    table_bytes_per_event: f64,
}

/// Writers in replication mode, one event per transaction, each way in
/// turn on the same database: as a row, and through `switchyard_emit`.
async fn writer_cost(services: &Services) -> anyhow::Result<Vec<WriterCost>> {
    let admin = admin_pool(services).await?;
    let name = "sy_bench_writers";
    drop_slot(&admin, name).await?;
    recreate_db(&admin, name, None).await?;
    let url = services.db_url(name);
    let store = OutboxStore::connect(&url, 2).await?;
    store.migrate().await?;
    set_up(&store, name).await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(WRITERS)?)
        .connect(&url)
        .await?;
    let mut costs = Vec::new();
    for (how, statement) in [
        (
            "INSERT INTO switchyard_outbox",
            format!(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
                 SELECT {EVENT_FIELDS} FROM (SELECT $1::bigint AS n) s"
            ),
        ),
        (
            "SELECT switchyard_emit(...)",
            format!("SELECT switchyard_emit({EVENT_FIELDS}) FROM (SELECT $1::bigint AS n) s"),
        ),
    ] {
        costs.push(write_events(&pool, how, &statement, "switchyard_outbox").await?);
    }
    pool.close().await;
    drop_slot(&admin, name).await?;
    drop_db(services, name).await?;
    Ok(costs)
}

/// `WRITER_EVENTS` one-event transactions by `WRITERS` writers; the
/// growth measured is `table`'s.
pub(super) async fn write_events(
    pool: &PgPool,
    how: &'static str,
    statement: &str,
    table: &str,
) -> anyhow::Result<WriterCost> {
    let position = || async {
        let (lsn, table): (i64, i64) = sqlx::query_as(
            "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint, pg_total_relation_size($1::regclass)",
        )
        .bind(table)
        .fetch_one(pool)
        .await?;
        anyhow::Ok((lsn, table))
    };
    let (wal_before, table_before) = position().await?;
    let cpu = CpuMark::now();
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for writer in 0..WRITERS {
        let (pool, statement) = (pool.clone(), statement.to_string());
        tasks.spawn(async move {
            let (mut took, mut inserts) = (Vec::new(), Vec::new());
            let mut n = writer;
            while n < WRITER_EVENTS {
                let began = Instant::now();
                let mut tx = pool.begin().await?;
                let insert_began = Instant::now();
                sqlx::query(&statement)
                    .bind(i64::try_from(n)?)
                    .bind(i64::try_from(n + 1)?)
                    .bind(1000i64)
                    .execute(&mut *tx)
                    .await?;
                inserts.push(u64::try_from(insert_began.elapsed().as_micros())?);
                tx.commit().await?;
                took.push(u64::try_from(began.elapsed().as_micros())?);
                n += WRITERS;
            }
            anyhow::Ok((took, inserts))
        });
    }
    let (mut sorted_us, mut insert_us) = (Vec::new(), Vec::new());
    while let Some(took) = tasks.join_next().await {
        let (took, inserts) = took??;
        sorted_us.extend(took);
        insert_us.extend(inserts);
    }
    let elapsed = started.elapsed();
    let cpu = CpuMark::now().since(cpu);
    let (wal_after, table_after) = position().await?;
    sorted_us.sort_unstable();
    insert_us.sort_unstable();
    let events = WRITER_EVENTS as f64;
    Ok(WriterCost {
        how,
        rate: events / elapsed.as_secs_f64(),
        sorted_us,
        insert_us,
        postgres_ms_per_thousand: cpu.postgres * 1000.0 / events * 1000.0,
        wal_bytes_per_event: (wal_after - wal_before) as f64 / events,
        table_bytes_per_event: (table_after - table_before) as f64 / events,
    })
}

pub(super) fn print_writers(costs: &[WriterCost]) {
    println!();
    println!(
        "{:<32} {:>9} {:>8} {:>8} {:>11} {:>11}  {:>12}  {:>9}  {:>11}",
        format!("writer, {WRITERS} x one-event transactions"),
        "tx/s",
        "p50 ms",
        "p99 ms",
        "INSERT p50",
        "INSERT mean",
        "PG CPU/1000",
        "WAL/event",
        "table/event"
    );
    let percentile = |sorted: &[u64], p: f64| {
        let index = ((sorted.len().max(1) - 1) as f64 * p).round() as usize;
        sorted.get(index).copied().unwrap_or_default() as f64 / 1000.0
    };
    for cost in costs {
        let insert_mean =
            cost.insert_us.iter().sum::<u64>() as f64 / cost.insert_us.len().max(1) as f64 / 1000.0;
        println!(
            "{:<32} {:>9.0} {:>8.2} {:>8.2} {:>8.3} ms {:>8.3} ms  {:>9.0} ms  {:>7.0} B  {:>9.0} B",
            cost.how,
            cost.rate,
            percentile(&cost.sorted_us, 0.5),
            percentile(&cost.sorted_us, 0.99),
            percentile(&cost.insert_us, 0.5),
            insert_mean,
            cost.postgres_ms_per_thousand,
            cost.wal_bytes_per_event,
            cost.table_bytes_per_event
        );
    }
}

fn print(args: &Args, drains: &[(String, Drain)], latencies: &[(String, Latency)]) {
    println!(
        "Switchyard replication mode against claim mode, {}, {} rows / {} aggregates, batch_size {}, concurrency {}",
        chrono::Utc::now().format("%Y-%m-%d"),
        args.rows,
        args.aggregates,
        args.batch_size,
        args.concurrency
    );
    println!();
    println!(
        "{:<44} {:>12}  {:>8}  {:>8}  CPU per 1,000 events",
        "drain", "rate", "vs keep", "peak RSS"
    );
    let mut keep = 0.0;
    for (label, drain) in drains {
        if label.contains("(keep)") {
            keep = drain.rate;
        }
        println!(
            "{label:<44} {:>9.0} /s  {:>7.2}x  {:>4} MiB  {}",
            drain.rate,
            drain.rate / keep,
            drain.peak_rss >> 20,
            drain.cpu.per_thousand(args.rows)
        );
    }
    println!();
    println!(
        "{:<44} {:>8} {:>8} {:>8} {:>8}  events",
        "commit to consumer", "p50 ms", "p95 ms", "p99 ms", "max ms"
    );
    for (label, run) in latencies {
        println!(
            "{label:<44} {:>8.1} {:>8.1} {:>8.1} {:>8.1}  {} of {}",
            run.percentile_ms(0.5),
            run.percentile_ms(0.95),
            run.percentile_ms(0.99),
            run.percentile_ms(1.0),
            run.sorted_us.len(),
            run.sent
        );
    }
}
