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

/// The runs at one rate, by key, with their names.
fn loads(rate: u64, seconds: u64, warmup: u64) -> [(&'static str, &'static str, Load); 7] {
    let steady = Load {
        one_per_transaction: true,
        warmup,
        ..Load::new(rate, seconds)
    };
    [
        (
            "writes",
            "writes alone",
            Load {
                writer_only: true,
                ..steady
            },
        ),
        ("claim", "claim mode", steady),
        (
            "intake",
            "claim, intake",
            Load {
                intake: true,
                ..steady
            },
        ),
        (
            "replication",
            "replication",
            Load {
                replication: true,
                ..steady
            },
        ),
        (
            "source",
            "repl., [source]",
            Load {
                replication: true,
                source: true,
                ..steady
            },
        ),
        (
            "emit",
            "repl., emit",
            Load {
                replication: true,
                emit: true,
                ..steady
            },
        ),
        ("peer", "peer (WAL)", Load { peer: true, ..steady }),
    ]
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

pub(super) async fn run(services: &Services, args: &Args) -> anyhow::Result<()> {
    if args.peer {
        super::peer::install().await?;
    }
    let writers = if args.runs.is_empty() {
        eprintln!("writer cost ...");
        writer_cost(services).await?
    } else {
        Vec::new()
    };
    // Round by round, each rate's runs in turn, every other round in the
    // reverse order (ABBA): a drift of the machine over the rounds falls on
    // every mode alike.
    let mut runs: Vec<(u32, &str, Latency)> = Vec::new();
    for round in 0..args.repeat {
        for &rate in &args.rates {
            let mut order: Vec<_> = loads(rate, args.latency_seconds, args.warmup_seconds)
                .into_iter()
                .filter(|(key, _, load)| {
                    (args.peer || !load.peer) && (args.runs.is_empty() || args.runs.iter().any(|r| r == key))
                })
                .collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for (_, mode, load) in order {
                eprintln!("round {}: {mode}, {rate} events/s ...", round + 1);
                runs.push((round, mode, latency_in(services, args, load).await?));
            }
        }
    }
    println!();
    println!(
        "steady rate, one event per transaction, {} s per run after {} s of warm-up, {} round(s); CPU per event in ms, medians (each round's PG CPU after it)",
        args.latency_seconds, args.warmup_seconds, args.repeat
    );
    println!(
        "{:<15} {:>5} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7}  rounds",
        "mode", "rate", "PG CPU", "x peer", "- writes", "relay", "p50 ms", "p99 ms"
    );
    for &rate in &args.rates {
        let at: Vec<_> = runs.iter().filter(|r| r.2.rate == rate).collect();
        let per_event = |mode: &str, f: &dyn Fn(&Latency) -> f64| {
            let mut values: Vec<f64> = at
                .iter()
                .filter(|r| r.1 == mode)
                .map(|r| f(&r.2) / r.2.sent.max(1) as f64 * 1000.0)
                .collect();
            (median(&mut values.clone()), std::mem::take(&mut values))
        };
        let (peer, _) = per_event("peer (WAL)", &|l| l.cpu.postgres);
        let (alone, _) = per_event("writes alone", &|l| l.cpu.postgres);
        for (_, mode, _) in loads(rate, 0, 0) {
            let (postgres, rounds) = per_event(mode, &|l| l.cpu.postgres);
            if rounds.is_empty() {
                continue;
            }
            let (relay, _) = per_event(mode, &|l| l.cpu.relay);
            let percentile = |p: f64| {
                let mut values: Vec<f64> = at
                    .iter()
                    .filter(|r| r.1 == mode && !r.2.sorted_us.is_empty())
                    .map(|r| r.2.percentile_ms(p))
                    .collect();
                if values.is_empty() {
                    "-".to_string()
                } else {
                    format!("{:.1}", median(&mut values))
                }
            };
            let rounds: Vec<String> = rounds.iter().map(|v| format!("{v:.3}")).collect();
            println!(
                "{:<15} {:>5} {:>8.3} {:>8.2} {:>8.3} {:>8.3} {:>7} {:>7}  {}",
                mode,
                rate,
                postgres,
                postgres / peer,
                postgres - alone,
                relay,
                percentile(0.5),
                percentile(0.99),
                rounds.join(" ")
            );
        }
    }
    println!();
    for (round, mode, run) in &runs {
        let mode = format!("round {}, {mode}", round + 1);
        super::server_cost::print(&mode, run.rate, run.sent, &run.pg_roles, &run.statements);
    }
    if !writers.is_empty() {
        print_writers(&writers);
    }
    Ok(())
}
