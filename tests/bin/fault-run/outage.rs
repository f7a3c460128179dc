//! The long outage runs: a broker, or PostgreSQL, down for minutes under a
//! relay process with the default retry settings while writers go on.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use switchyard_tests::brokers::Broker;
use switchyard_tests::orders::{Expected, Tally, order_event, tally};
use switchyard_tests::postgres::{Outbox, TestDb, fresh_db, try_place_event};
use switchyard_tests::relay::{Process, RelaySection};

/// Events written per second, one aggregate after another.
const RATE: u64 = 100;
const AGGREGATES: usize = 200;
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

/// Writes at [`RATE`] into `outbox` until `stop` is cancelled; a write
/// that fails (the database is down) is tried again until it goes through.
pub(super) fn writer(
    db: &TestDb,
    outbox: Outbox,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<HashMap<String, Expected>> {
    let pool = db.pool.clone();
    tokio::spawn(async move {
        let mut expected = HashMap::new();
        let mut seqs = vec![0usize; AGGREGATES];
        let mut tick = tokio::time::interval(Duration::from_millis(1000 / RATE));
        let mut n = 0usize;
        while !stop.is_cancelled() {
            tick.tick().await;
            let aggregate = n % AGGREGATES;
            let event = order_event(aggregate, seqs[aggregate]);
            let id = loop {
                match try_place_event(&pool, outbox, &event, true).await {
                    Ok(id) => break id,
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            };
            expected.insert(
                id.to_string(),
                Expected {
                    aggregate_id: event.aggregate_id,
                    seq: seqs[aggregate] as u64,
                    event_type: event.event_type,
                },
            );
            seqs[aggregate] += 1;
            n += 1;
        }
        expected
    })
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
/// `pg` (PostgreSQL down, NATS up), for `minutes`; in claim mode (writers
/// into `outbox`) or, with `replication`, reading the WAL.
pub async fn down_run(relay_bin: &str, down: &str, minutes: u64, replication: bool, outbox: Outbox) -> Row {
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
    let mut relay = Process::spawn(relay_bin, &config, "relay-0");
    let stop = tokio_util::sync::CancellationToken::new();
    let writing = writer(&db, outbox, stop.clone());
    tokio::time::sleep(AROUND).await;
    let outage = Duration::from_secs(minutes * 60);
    eprintln!("{down}: down for {minutes} min");
    let down_at: chrono::DateTime<chrono::Utc> = scalar(&db, "SELECT now()").await;
    if down == "pg" {
        pg_ctl("stop");
    } else {
        broker.stop();
    }
    let started = Instant::now();
    while started.elapsed() < outage {
        tokio::time::sleep(Duration::from_secs(30)).await;
        if down != "pg" {
            let waiting: i64 = scalar(
                &db,
                "SELECT count(*) FROM switchyard_outbox WHERE waiting_on IS NOT NULL",
            )
            .await;
            let dead: i64 = dead_letters(&db).await;
            eprintln!(
                "{down}: {} s down, {waiting} rows waiting on it, {dead} dead",
                started.elapsed().as_secs()
            );
        }
    }
    if down == "pg" {
        pg_ctl("start");
    } else {
        broker.resume().await;
    }
    let back: chrono::DateTime<chrono::Utc> = scalar(&db, "SELECT now()").await;
    let backlog_at_return: i64 = scalar(&db, unfinished_sql(replication)).await;
    eprintln!("{down}: back; backlog {backlog_at_return}");
    tokio::time::sleep(AROUND).await;
    stop.cancel();
    let expected = writing.await.expect("writer");
    let total = expected.len() as i64;
    if replication {
        // A row is `streamed` from its insert on: done only once the slot
        // is confirmed past the last write (published or in the table).
        let written_to: String = scalar(&db, "SELECT pg_current_wal_lsn()::text").await;
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
    // Events of a `[source]` table published on the fast path have no row
    // here: past the slot's confirm, nothing unfinished is all there is.
    let rows_for_all = outbox != Outbox::Debezium;
    while ((rows_for_all && scalar::<i64>(&db, done_sql).await < total)
        || scalar::<i64>(&db, unfinished_sql(replication)).await > 0)
        && Instant::now() < limit
    {
        if dead_letters(&db).await > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    relay.terminate();
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
    let scenario = match down {
        "pg" => format!("PostgreSQL down {minutes} min (NATS{mode})"),
        broker => format!("{broker} down {minutes} min{mode}"),
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
