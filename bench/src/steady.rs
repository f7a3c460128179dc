//! `relay-bench --steady`: what PostgreSQL pays per event at the rates
//! services run (100 and 500 events/s, each event its own transaction, so
//! each is about its own batch), in claim mode and in replication mode,
//! against the writes alone in the same run; and what a writer's INSERT
//! costs against a plain table of the same columns: into the intake, into
//! the outbox with and without the NOTIFY trigger, and into an outbox set
//! up for replication mode, and into a service's own plain table that
//! replication mode reads as `[source]`.

use super::replication::{WRITERS, print_writers, write_events};
use super::{Args, EVENT_FIELDS, Latency, Load, Services, admin_pool, drop_db, latency_in, recreate_db};
use switchyard::store::OutboxStore;

/// The writer's INSERT three ways on one claim-mode database, and once in
/// replication mode.
async fn writer_cost(services: &Services) -> anyhow::Result<Vec<super::replication::WriterCost>> {
    let admin = admin_pool(services).await?;
    let name = "sy_bench_steady_writers";
    recreate_db(&admin, name, None).await?;
    let url = services.db_url(name);
    OutboxStore::connect(&url, 2).await?.migrate().await?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(WRITERS)?)
        .connect(&url)
        .await?;
    // The same columns and defaults, a primary key, nothing else.
    sqlx::raw_sql(
        "CREATE TABLE plain_outbox (LIKE switchyard_outbox INCLUDING DEFAULTS INCLUDING IDENTITY);
         ALTER TABLE plain_outbox ADD PRIMARY KEY (id);",
    )
    .execute(&pool)
    .await?;
    let insert = |table: &str| {
        format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload, headers)
             SELECT {EVENT_FIELDS} FROM (SELECT $1::bigint AS n) s"
        )
    };
    let mut costs = Vec::new();
    costs.push(
        write_events(
            &pool,
            "switchyard_intake",
            &insert("switchyard_intake"),
            "switchyard_intake",
        )
        .await?,
    );
    costs.push(
        write_events(
            &pool,
            "switchyard_outbox",
            &insert("switchyard_outbox"),
            "switchyard_outbox",
        )
        .await?,
    );
    sqlx::query("ALTER TABLE switchyard_outbox DISABLE TRIGGER switchyard_outbox_notify")
        .execute(&pool)
        .await?;
    costs.push(
        write_events(
            &pool,
            "switchyard_outbox, no NOTIFY",
            &insert("switchyard_outbox"),
            "switchyard_outbox",
        )
        .await?,
    );
    costs.push(
        write_events(
            &pool,
            "plain table, same columns",
            &insert("plain_outbox"),
            "plain_outbox",
        )
        .await?,
    );
    pool.close().await;
    drop_db(services, name).await?;
    costs.extend(replication_writer(services, &insert("switchyard_outbox")).await?);
    Ok(costs)
}

/// The writer's INSERT into an outbox set up for replication mode (each row
/// is written `streamed`, published at insert, so it enters none of the claim
/// path's indexes, and `migrate` has turned the NOTIFY off), and into a
/// service's own plain table that the relay reads as `[source]`.
async fn replication_writer(
    services: &Services,
    insert: &str,
) -> anyhow::Result<Vec<super::replication::WriterCost>> {
    let admin = admin_pool(services).await?;
    let name = "sy_bench_steady_writers_wal";
    super::replication::drop_slot(&admin, name).await?;
    recreate_db(&admin, name, None).await?;
    let url = services.db_url(name);
    let store = OutboxStore::connect(&url, 2).await?;
    store.migrate().await?;
    super::replication::set_up_service_table(&store, &url, name).await?;
    store.close().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(WRITERS)?)
        .connect(&url)
        .await?;
    let service = super::replication::SERVICE_TABLE;
    let costs = async {
        Ok::<_, anyhow::Error>(vec![
            write_events(
                &pool,
                "switchyard_outbox, replication",
                insert,
                "switchyard_outbox",
            )
            .await?,
            write_events(
                &pool,
                "own table as [source], replication",
                &insert.replace("switchyard_outbox", service),
                service,
            )
            .await?,
        ])
    }
    .await;
    pool.close().await;
    super::replication::drop_slot(&admin, name).await?;
    drop_db(services, name).await?;
    costs
}

pub(super) async fn run(services: &Services, args: &Args) -> anyhow::Result<()> {
    if args.peer {
        super::peer::install().await?;
    }
    eprintln!("writer cost ...");
    let writers = writer_cost(services).await?;
    let mut runs: Vec<(&str, Latency)> = Vec::new();
    for rate in [100, 500] {
        let steady = Load {
            one_per_transaction: true,
            ..Load::new(rate, args.latency_seconds)
        };
        for (mode, load) in [
            (
                "writes alone",
                Load {
                    writer_only: true,
                    ..steady
                },
            ),
            ("claim mode", steady),
            (
                "claim, intake",
                Load {
                    intake: true,
                    ..steady
                },
            ),
            (
                "replication",
                Load {
                    replication: true,
                    ..steady
                },
            ),
            (
                "repl., [source]",
                Load {
                    replication: true,
                    source: true,
                    ..steady
                },
            ),
            ("peer (WAL)", Load { peer: true, ..steady }),
        ] {
            if load.peer && !args.peer {
                continue;
            }
            eprintln!("{mode}, {rate} events/s ...");
            runs.push((mode, latency_in(services, args, load).await?));
        }
    }
    println!();
    println!(
        "steady rate, one event per transaction, {} s per run; CPU per event in ms",
        args.latency_seconds
    );
    println!(
        "{:<15} {:>7} {:>10} {:>16} {:>10} {:>8} {:>8}",
        "mode", "rate", "PG CPU", "PG over writes", "relay CPU", "p50 ms", "p99 ms"
    );
    for rate in runs.chunk_by(|a, b| a.1.rate == b.1.rate) {
        let alone = rate[0].1.cpu.postgres / rate[0].1.sent.max(1) as f64;
        for (mode, run) in rate {
            let events = run.sent.max(1) as f64;
            let postgres = run.cpu.postgres / events;
            let (p50, p99) = if run.sorted_us.is_empty() {
                ("-".to_string(), "-".to_string())
            } else {
                (
                    format!("{:.1}", run.percentile_ms(0.5)),
                    format!("{:.1}", run.percentile_ms(0.99)),
                )
            };
            println!(
                "{:<15} {:>7} {:>10.3} {:>16.3} {:>10.3} {:>8} {:>8}",
                mode,
                run.rate,
                postgres * 1000.0,
                (postgres - alone) * 1000.0,
                run.cpu.relay / events * 1000.0,
                p50,
                p99
            );
        }
    }
    print_writers(&writers);
    Ok(())
}
