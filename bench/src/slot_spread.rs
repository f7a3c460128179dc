//! `relay-bench --slot-spread`: what it costs PostgreSQL to spread one
//! outbox over N slots, each with a publication whose row filter takes a
//! share of the aggregates (`hashtext` of the aggregate id), so that N
//! relays could read it side by side. Every slot's walsender decodes the
//! whole WAL and drops what its filter refuses: the measurement is the
//! server's CPU per event and the time until every slot has read the same
//! backlog, for N = 1, 2 and 4 readers (`pg_recvlogical`, which does no
//! work of its own per event, stands in for the relays).

use std::time::{Duration, Instant};

use sqlx::PgPool;
use switchyard::store::OutboxStore;

use super::{Args, CpuMark, Services, admin_pool, drop_db, load_rows, recreate_db};

/// One spread: readers, seconds until all caught up, PostgreSQL CPU.
struct Spread {
    slots: usize,
    seconds: f64,
    postgres_ms_per_thousand: f64,
}

/// Runs the spreads and prints their table.
pub(super) async fn run(services: &Services, args: &Args) -> anyhow::Result<()> {
    let mut spreads = Vec::new();
    for slots in [1, 2, 4] {
        eprintln!("{slots} slot(s) over {} rows ...", args.rows);
        spreads.push(spread(services, args, slots).await?);
    }
    println!(
        "One outbox over N filtered slots, {}, {} rows / {} aggregates, readers: pg_recvlogical",
        chrono::Utc::now().format("%Y-%m-%d"),
        args.rows,
        args.aggregates
    );
    println!();
    println!(
        "{:<8} {:>12} {:>16} {:>24}",
        "slots", "all read in", "events/s", "PostgreSQL CPU / 1,000"
    );
    for spread in &spreads {
        println!(
            "{:<8} {:>10.2} s {:>16.0} {:>21.1} ms",
            spread.slots,
            spread.seconds,
            args.rows as f64 / spread.seconds,
            spread.postgres_ms_per_thousand
        );
    }
    Ok(())
}

fn slot_name(slots: usize, n: usize) -> String {
    format!("sy_spread_{slots}_{n}")
}

async fn spread(services: &Services, args: &Args, slots: usize) -> anyhow::Result<Spread> {
    let admin = admin_pool(services).await?;
    let name = "sy_bench_spread";
    for n in 0..slots {
        super::replication::drop_slot(&admin, &slot_name(slots, n)).await?;
    }
    recreate_db(&admin, name, None).await?;
    let url = services.db_url(name);
    let store = OutboxStore::connect(&url, 2).await?;
    store.migrate().await?;
    super::replication::set_up(&store, &slot_name(slots, 0)).await?;
    let pool = PgPool::connect(&url).await?;
    for n in 0..slots {
        sqlx::query(&format!(
            "CREATE PUBLICATION sy_spread_{n} FOR TABLE switchyard_outbox
               WHERE (status = 'streamed' AND abs(hashtext(aggregate_id) % {slots}) = {n})
               WITH (publish = 'insert')"
        ))
        .execute(&pool)
        .await?;
        if n > 0 {
            sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
                .bind(slot_name(slots, n))
                .execute(&pool)
                .await?;
        }
    }
    load_rows(&pool, args).await?;
    let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await?;
    let pg_bin = std::env::var("SWITCHYARD_PG_BIN").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into());
    let cpu = CpuMark::now();
    let started = Instant::now();
    let mut readers = Vec::new();
    for n in 0..slots {
        readers.push(
            tokio::process::Command::new(format!("{pg_bin}/pg_recvlogical"))
                .args(["-d", &url, "--slot", &slot_name(slots, n), "--start", "--no-loop"])
                .args([
                    "-o",
                    "proto_version=1",
                    "-o",
                    &format!("publication_names=sy_spread_{n}"),
                ])
                .args(["-f", "/dev/null", "-F", "0", "-s", "1"])
                .kill_on_drop(true)
                .spawn()?,
        );
    }
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let behind: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_replication_slots
              WHERE slot_name LIKE $1 AND (confirmed_flush_lsn IS NULL OR confirmed_flush_lsn < $2::pg_lsn)",
        )
        .bind(format!("sy_spread_{slots}_%"))
        .bind(&end)
        .fetch_one(&pool)
        .await?;
        if behind == 0 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "the readers did not catch up"
        );
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = CpuMark::now().since(cpu);
    for mut reader in readers {
        reader.kill().await?;
    }
    pool.close().await;
    for n in 0..slots {
        super::replication::drop_slot(&admin, &slot_name(slots, n)).await?;
    }
    drop_db(services, name).await?;
    Ok(Spread {
        slots,
        seconds,
        postgres_ms_per_thousand: cpu.postgres * 1_000_000.0 / args.rows as f64,
    })
}
