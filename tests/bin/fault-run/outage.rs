//! The outage runs: a broker, or PostgreSQL, down for seconds or minutes
//! under relay processes with the default retry settings while writers go on.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use switchyard_tests::brokers::Broker;
use switchyard_tests::orders::{Expected, Tally, tally};
use switchyard_tests::postgres::{Outbox, TestDb, fresh_db};
use switchyard_tests::relay::{Process, RelaySection};
use switchyard_tests::workload::{Shape, paced_writer};

/// Transactions written per second (about 8 events each: 800 events/s).
const TRANSACTIONS: u64 = 100;
const AGGREGATES: usize = 400;
/// Writing goes on this long before the outage and after the return.
const AROUND: Duration = Duration::from_secs(30);

/// One outage run's figures.
pub struct Row {
    scenario: String,
    written: usize,
    dead: i64,
    tally: Tally,
    first_after_return_s: Option<f64>,
    backlog_at_return: i64,
    drain_rate: Option<f64>,
}

/// Writes transactions shaped as a service's ([`Shape`]: several
/// aggregates each, one to three events of each) at [`TRANSACTIONS`] a
/// second into `outbox` until `stop` is cancelled; with
/// `SWITCHYARD_FAULT_EMIT_PERCENT` (replication mode over the outbox
/// table only: the caller's), that share of the aggregates through
/// `switchyard_emit`. A
/// transaction that fails (the database is down) is written again until
/// it goes through.
pub(super) fn writer(
    db: &TestDb,
    outbox: Outbox,
    replication: bool,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<HashMap<String, Expected>> {
    writer_at(db, outbox, replication, TRANSACTIONS, stop)
}

/// [`writer`] at `per_second` transactions a second.
pub(super) fn writer_at(
    db: &TestDb,
    outbox: Outbox,
    replication: bool,
    per_second: u64,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<HashMap<String, Expected>> {
    let shape = if replication {
        Shape::replicated(outbox)
    } else {
        Shape::rows(outbox)
    };
    paced_writer(&db.pool, shape, AGGREGATES, per_second, stop)
}

fn pg_ctl(action: &str) {
    let state = std::env::var("SWITCHYARD_STATE_DIR").unwrap_or_else(|_| "/tmp/switchyard-services".into());
    let bin = std::env::var("SWITCHYARD_PG_BIN").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into());
    let mut command = std::process::Command::new("runuser");
    command
        .args(["-u", "postgres", "--"])
        .arg(format!("{bin}/pg_ctl"))
        .args(["-D", &format!("{state}/pg"), "-m", "fast", "-w"]);
    if action == "start" {
        command.args(["-l", &format!("{state}/pg/server.log")]);
    }
    let status = command
        .arg(action)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("pg_ctl");
    assert!(status.success(), "pg_ctl {action} failed");
}

/// Rows dead-lettered so far.
pub(super) async fn dead_letters(db: &TestDb) -> i64 {
    scalar(db, "SELECT count(*) FROM switchyard_outbox WHERE status = 'dead'").await
}

pub(super) async fn scalar<T>(db: &TestDb, sql: &str) -> T
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
{
    loop {
        match sqlx::query_scalar(sql).fetch_one(&db.pool).await {
            Ok(value) => return value,
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// Rows not yet published: in replication mode, rows the fast path read
/// stay `streamed`, and only what it handed over waits in the table; in
/// claim mode rows still in the intake count too.
fn unfinished_sql(replication: bool) -> &'static str {
    if replication {
        "SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending', 'in_flight', 'parked', 'held')"
    } else {
        "SELECT (SELECT count(*) FROM switchyard_outbox WHERE status <> 'published')
              + (SELECT count(*) FROM switchyard_intake)"
    }
}

/// One run: `down` is `nats`, `kafka`, `rabbitmq` (that broker down) or
/// `pg` (PostgreSQL down, NATS up), for `outage`; in claim mode (writers
/// into `outbox`) or, with `replication`, reading the WAL. With `kills`,
/// two relays, and the one reading the slot (in claim mode, each in turn)
/// is SIGKILLed and started again that many times, spread over the outage
/// and the time after it.
pub async fn down_run(
    relay_bin: &str,
    down: &str,
    outage: Duration,
    replication: bool,
    outbox: Outbox,
    kills: usize,
) -> Row {
    let db = fresh_db().await;
    let mut broker = Broker::start(if down == "pg" { "nats" } else { down }).await;
    // The default retry settings: [relay] names the mode at most.
    let config = broker
        .config(&db.url, RelaySection::defaults())
        .set("admin", "listen", "");
    let config = if replication {
        let config = config
            .relay("mode", "replication")
            .set("replication", "slot", db.name.as_str());
        let config = super::replication::for_writers_into(&db, outbox, config).await;
        super::replication::migrate(relay_bin, &config).await;
        config
    } else {
        config.toml()
    };
    let count = if kills > 0 { 2 } else { 1 };
    let mut relays: Vec<(String, Process)> = (0..count)
        .map(|n| {
            let name = format!("relay-{n}");
            (name.clone(), Process::spawn(relay_bin, &config, &name))
        })
        .collect();
    let stop = tokio_util::sync::CancellationToken::new();
    let writing = writer(&db, outbox, replication, stop.clone());
    tokio::time::sleep(AROUND).await;
    let length = if outage.as_secs().is_multiple_of(60) {
        format!("{} min", outage.as_secs() / 60)
    } else {
        format!("{} s", outage.as_secs())
    };
    eprintln!("{down}: down for {length}");
    let down_at: chrono::DateTime<chrono::Utc> = scalar(&db, "SELECT now()").await;
    if down == "pg" {
        pg_ctl("stop");
    } else {
        broker.stop();
    }
    let started = Instant::now();
    // Kills land during the outage and in the time after it.
    let every = (outage + AROUND) / u32::try_from(kills + 1).unwrap_or(u32::MAX);
    let mut killed = 0;
    let mut generation = 0;
    let mut reported = Instant::now();
    let mut back = None;
    while started.elapsed() < outage + if kills > 0 { AROUND } else { Duration::ZERO } {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if back.is_none() && started.elapsed() >= outage {
            back = Some(come_back(&mut broker, down, &db, replication).await);
        }
        if killed < kills && started.elapsed() >= every * u32::try_from(killed + 1).unwrap_or(u32::MAX) {
            let victim = if replication {
                let reading = super::replication::reader(&db).await;
                relays
                    .iter()
                    .position(|(name, _)| reading.as_deref().is_some_and(|r| r.ends_with(name.as_str())))
                    .unwrap_or(killed % count)
            } else {
                killed % count
            };
            relays[victim].1.kill();
            generation += 1;
            let name = format!("relay-{victim}-{generation}");
            relays[victim] = (name.clone(), Process::spawn(relay_bin, &config, &name));
            killed += 1;
            eprintln!("{down}: kill {killed} ({} s)", started.elapsed().as_secs());
        }
        if down != "pg" && reported.elapsed() >= Duration::from_secs(30) {
            reported = Instant::now();
            let waiting: i64 = scalar(
                &db,
                "SELECT count(*) FROM switchyard_outbox WHERE waiting_on IS NOT NULL",
            )
            .await;
            let dead: i64 = dead_letters(&db).await;
            eprintln!(
                "{down}: {} s, {waiting} rows waiting on it, {dead} dead",
                started.elapsed().as_secs()
            );
        }
    }
    let (back, backlog_at_return) = match back {
        Some(back) => back,
        None => come_back(&mut broker, down, &db, replication).await,
    };
    eprintln!("{down}: back; backlog {backlog_at_return}");
    tokio::time::sleep(AROUND).await;
    stop.cancel();
    let expected = writing.await.expect("writer");
    let total = expected.len() as i64;
    if replication {
        // A row is `streamed` from its insert on: done only once the slot
        // is confirmed past the last write (published or in the table).
        let written_to: String = scalar(&db, "SELECT pg_current_wal_insert_lsn()::text").await;
        let confirmed = format!(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}' AND confirmed_flush_lsn >= '{written_to}'::pg_lsn",
            db.name
        );
        let limit = Instant::now() + Duration::from_secs(300);
        while scalar::<i64>(&db, &confirmed).await == 0 && Instant::now() < limit {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let limit = Instant::now() + Duration::from_secs(900);
    let done_sql = if replication {
        "SELECT count(*) FROM switchyard_outbox WHERE status IN ('published', 'streamed')"
    } else {
        "SELECT count(*) FROM switchyard_outbox WHERE status = 'published'"
    };
    // Events of a `[source]` table, and events written by `switchyard_emit`,
    // published on the fast path have no row here: past the slot's
    // confirm, nothing unfinished is all there is.
    let rows_for_all = outbox != Outbox::Debezium && !(replication && emitting());
    while ((rows_for_all && scalar::<i64>(&db, done_sql).await < total)
        || scalar::<i64>(&db, unfinished_sql(replication)).await > 0)
        && Instant::now() < limit
    {
        if dead_letters(&db).await > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for (_, relay) in &mut relays {
        relay.terminate();
    }
    let dead: i64 = dead_letters(&db).await;
    // Only rows the relay marked published: a `streamed` row's
    // published_at is its insert time.
    let (first, drained, drain_s): (Option<f64>, i64, Option<f64>) = sqlx::query_as(
        "SELECT (SELECT extract(epoch FROM min(published_at) - $1)::float8
                   FROM switchyard_outbox WHERE published_at > $1 AND status = 'published'),
                count(*), extract(epoch FROM max(published_at) - $1)::float8
           FROM switchyard_outbox
          WHERE created_at < $1 AND published_at >= $1 AND status = 'published'",
    )
    .bind(back)
    .fetch_one(&db.pool)
    .await
    .expect("figures");
    let received = broker.received(expected.len()).await;
    let counted = tally(&received, &expected);
    if counted.lost > 0 {
        report_lost(&db, &received, &expected, down_at).await;
    }
    let mode = match (replication, outbox) {
        (true, _) => &format!(", replication{}", super::replication::written_to(outbox)),
        (false, Outbox::Intake) => ", writers into the intake",
        _ => "",
    };
    let kills = if kills > 0 {
        format!(", 2 relays, {kills} SIGKILLs")
    } else {
        String::new()
    };
    let scenario = match down {
        "pg" => format!("PostgreSQL down {length} (NATS{mode}{kills})"),
        broker => format!("{broker} down {length}{mode}{kills}"),
    };
    eprintln!("{scenario}: {counted:?}");
    Row {
        scenario,
        written: expected.len(),
        dead,
        tally: counted,
        first_after_return_s: first,
        backlog_at_return,
        drain_rate: drain_s.filter(|s| *s > 0.0).map(|s| drained as f64 / s),
    }
}

/// Whether the writers send a share of events through `switchyard_emit`.
fn emitting() -> bool {
    std::env::var("SWITCHYARD_FAULT_EMIT_PERCENT")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        .is_some_and(|p| p > 0)
}

/// Starts what was down again; returns when, and the backlog then.
async fn come_back(
    broker: &mut Broker,
    down: &str,
    db: &TestDb,
    replication: bool,
) -> (chrono::DateTime<chrono::Utc>, i64) {
    if down == "pg" {
        pg_ctl("start");
    } else {
        broker.resume().await;
    }
    let back: chrono::DateTime<chrono::Utc> = scalar(db, "SELECT now()").await;
    let backlog: i64 = scalar(db, unfinished_sql(replication)).await;
    (back, backlog)
}

/// What the outbox holds for each event the consumer did not get.
async fn report_lost(
    db: &TestDb,
    received: &[switchyard_tests::nats::Received],
    expected: &HashMap<String, Expected>,
    down_at: chrono::DateTime<chrono::Utc>,
) {
    let seen: std::collections::HashSet<&str> = received
        .iter()
        .filter_map(|m| m.header("Switchyard-Event-Id"))
        .collect();
    let lost: Vec<String> = expected
        .keys()
        .filter(|id| !seen.contains(id.as_str()))
        .cloned()
        .collect();
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT format('id %s, event %s, %s, created %s, published %s', id, event_id, status, created_at, published_at)
           FROM switchyard_outbox WHERE event_id::text = ANY($1) ORDER BY id",
    )
    .bind(&lost)
    .fetch_all(&db.pool)
    .await
    .unwrap_or_default();
    let last: Option<(i64, Option<String>)> =
        sqlx::query_as("SELECT max(id), max(created_at)::text FROM switchyard_outbox")
            .fetch_optional(&db.pool)
            .await
            .ok()
            .flatten();
    eprintln!("lost: {} events; the outbox's last row: {last:?}", lost.len());
    // A killed Pub/Sub emulator drops what it held: those were acknowledged
    // before the kill, and lost with it, not by the relay.
    let acknowledged_before: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox WHERE event_id::text = ANY($1) AND published_at < $2",
    )
    .bind(&lost)
    .bind(down_at)
    .fetch_one(&db.pool)
    .await
    .unwrap_or_default();
    eprintln!("lost: {acknowledged_before} of them acknowledged by the broker before it went down");
    for row in rows {
        eprintln!("  lost: {row}");
    }
}

/// Prints the runs as a Markdown table.
pub fn print(rows: &[Row]) {
    println!();
    println!(
        "| scenario | written | dead-lettered | lost | duplicates | reordered | first delivery after return | backlog at return | drain rate after return |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for row in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.scenario,
            row.written,
            row.dead,
            row.tally.lost,
            row.tally.duplicates,
            row.tally.reordered,
            row.first_after_return_s
                .map_or("-".into(), |s| format!("{s:.2} s")),
            row.backlog_at_return,
            row.drain_rate.map_or("-".into(), |r| format!("{r:.0} events/s")),
        );
    }
}
