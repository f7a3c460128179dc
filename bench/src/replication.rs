//! `relay-bench --replication`: replication mode against claim v2 (keep
//! and delete) in the same run: drain rate and CPU per process to NATS
//! JetStream and to Kafka from the same backlog, and commit-to-consumer
//! latency at 100 and 1,000 events/s in both modes.
//!
//! A replication drain cannot start from a copy of the template (a copied
//! database has no WAL of its rows): its backlog is written after the slot
//! is created and before the relay starts, and the clock runs from the
//! relay's start until the slot is confirmed past the last row.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use switchyard::Config;
use switchyard::config::{FeedMode, ReplicationConfig};
use switchyard::store::{OutboxStore, PublishedRows};

use super::{
    Args, CpuTimes, Drain, DrainKind, Latency, RUST_PLUGIN, Running, Schema, Services, Target, admin_pool,
    build_template, drain, drop_db, latency_in, load_rows, peak_rss, recreate_db, relay_config,
    reset_brokers, reset_peak_rss, workspace_root,
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
    let statements = store.feed_statements(Some((slot, "switchyard_outbox"))).await?;
    store.run_feed_statements(&statements).await?;
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

/// One replication drain of `args.rows` rows to `target`.
async fn replication_drain(services: &Services, args: &Args, target: Target) -> anyhow::Result<Drain> {
    let admin = admin_pool(services).await?;
    let name = "sy_bench_replication";
    drop_slot(&admin, name).await?;
    recreate_db(&admin, name, None).await?;
    let url = services.db_url(name);
    let store = OutboxStore::connect(&url, 4).await?;
    store.migrate().await?;
    set_up(&store, name).await?;
    let pool = PgPool::connect(&url).await?;
    load_rows(&pool, args).await?;
    let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await?;
    reset_brokers(services, target).await?;
    let plugin = workspace_root().join("plugins/target").join(RUST_PLUGIN);
    let mut config = relay_config(&url, services, args, target, &plugin, PublishedRows::Keep)?;
    configure(&mut config, name);
    reset_peak_rss();
    let relay = switchyard::app::build(&config).await?;
    let cpu = CpuTimes::now();
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
        cpu: CpuTimes::now().since(cpu),
        peak_rss: peak_rss(),
    };
    let (untouched, dead): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'streamed'), count(*) FILTER (WHERE status = 'dead')
           FROM switchyard_outbox",
    )
    .fetch_one(&pool)
    .await?;
    anyhow::ensure!(dead == 0, "{dead} rows dead-lettered during the drain");
    anyhow::ensure!(
        u64::try_from(untouched)? == args.rows,
        "{} rows went through the table",
        args.rows - u64::try_from(untouched)?
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
    build_template(services, args, Schema::V2).await?;
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
                "claim v2 ({}), wasm -> {to}",
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
                schema: Schema::V2,
                published_rows,
            };
            rows.push((label, drain(services, args, kind).await?));
        }
        let label = format!("replication, wasm -> {to}");
        eprintln!("{label} ...");
        rows.push((label, replication_drain(services, args, target).await?));
    }
    drop_db(services, Schema::V2.template()).await?;
    let mut latencies: Vec<(String, Latency)> = Vec::new();
    for rate in [100, 1_000] {
        for replication in [false, true] {
            let mode = if replication { "replication" } else { "claim v2" };
            eprintln!("latency, {mode}, {rate} events/s ...");
            let run = latency_in(services, args, rate, args.latency_seconds, false, replication).await?;
            latencies.push((format!("{mode} at {rate} events/s"), run));
        }
    }
    print(args, &rows, &latencies);
    Ok(())
}

fn print(args: &Args, drains: &[(String, Drain)], latencies: &[(String, Latency)]) {
    println!(
        "Switchyard replication mode against claim v2, {}, {} rows / {} aggregates, batch_size {}, concurrency {}",
        chrono::Utc::now().format("%Y-%m-%d"),
        args.rows,
        args.aggregates,
        args.batch_size,
        args.concurrency
    );
    println!();
    println!(
        "{:<44} {:>12}  {:>8}  CPU per 1,000 events",
        "drain", "rate", "vs keep"
    );
    let mut keep = 0.0;
    for (label, drain) in drains {
        if label.contains("(keep)") {
            keep = drain.rate;
        }
        println!(
            "{label:<44} {:>9.0} /s  {:>7.2}x  {}",
            drain.rate,
            drain.rate / keep,
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
