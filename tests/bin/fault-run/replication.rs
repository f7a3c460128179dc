//! Replication-mode runs of the long fault run: the same counting, with
//! relays reading one slot (one active, the others standing by).

use std::time::{Duration, Instant};

use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::write_orders;
use switchyard_tests::postgres::{TestDb, fresh_db};
use switchyard_tests::relay::Process;

use super::{AGGREGATES, Row, STREAM, restart_postgres, settings};

/// The fault run's config in replication mode, through a slot named after
/// the database.
fn replication_settings(db: &TestDb, nats: &NatsServer) -> String {
    settings(&db.url, &nats.url()).replacen("[relay]", "[relay]\nmode = \"replication\"", 1)
        + &format!("\n[replication]\nslot = \"{}\"\n", db.name)
}

async fn migrate(relay_bin: &str, config: &str) {
    let path = std::env::temp_dir().join(format!("sy-fault-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).expect("write config");
    let (code, out, err) =
        switchyard_tests::cli(relay_bin, &["migrate", "--config", path.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "migrate: {out}{err}");
}

/// The `application_name` of the session reading the slot, if one does.
async fn reader(db: &TestDb) -> Option<String> {
    sqlx::query_scalar(
        "SELECT a.application_name FROM pg_replication_slots s
           JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1",
    )
    .bind(&db.name)
    .fetch_optional(&db.pool)
    .await
    .ok()
    .flatten()
}

/// Rows waiting in the table for the claim path.
async fn unfinished(db: &TestDb) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending', 'in_flight', 'parked', 'held')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap_or(i64::MAX)
}

/// Two relays on one slot while writers put `events` events in; the one
/// reading it is SIGKILLed `kills` times (and started again, as a standby).
/// Each takeover's time is printed.
pub async fn kills_run(relay_bin: &str, events: usize, kills: usize) -> Row {
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = replication_settings(&db, &nats);
    migrate(relay_bin, &config).await;
    let mut relays: Vec<(String, Process)> = (0..2)
        .map(|n| {
            let name = format!("relay-{n}");
            let process = Process::spawn(relay_bin, &config, &name);
            (name, process)
        })
        .collect();
    let per_aggregate = events.div_ceil(AGGREGATES);
    let started = Instant::now();
    let writer = tokio::spawn({
        let pool = db.pool.clone();
        async move { write_orders(&pool, AGGREGATES, per_aggregate, 8).await }
    });
    let mut takeovers = Vec::new();
    let mut generation = 0;
    for kill in 1..=kills {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let Some(active) = reader(&db).await else {
            continue;
        };
        let Some(index) = relays
            .iter()
            .position(|(name, _)| active.ends_with(name.as_str()))
        else {
            continue;
        };
        relays[index].1.kill();
        let killed = Instant::now();
        generation += 1;
        let name = format!("relay-{index}-{generation}");
        relays[index] = (name.clone(), Process::spawn(relay_bin, &config, &name));
        while reader(&db).await.is_none_or(|now| now == active) && killed.elapsed() < Duration::from_secs(60)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let took = killed.elapsed().as_secs_f64();
        eprintln!("kill {kill}: {active} killed, slot read again after {took:.2} s");
        takeovers.push(took);
    }
    let expected = writer.await.expect("writer");
    let worst_takeover = takeovers.iter().copied().fold(0.0, f64::max);
    eprintln!("replication kills: takeovers (s): {takeovers:.2?}");
    let scenario = format!(
        "replication, {} SIGKILLs of the reader, 2 relays (takeover worst {worst_takeover:.1} s)",
        takeovers.len()
    );
    let processes = relays.iter_mut().map(|(_, relay)| relay).collect();
    drain_and_count(scenario, &db, &nats, &expected, processes, started).await
}

/// Waits until every event is in the stream and nothing waits in the
/// table, stops the relays, and counts what arrived.
async fn drain_and_count(
    scenario: String,
    db: &TestDb,
    nats: &NatsServer,
    expected: &std::collections::HashMap<String, switchyard_tests::orders::Expected>,
    relays: Vec<&mut Process>,
    started: Instant,
) -> Row {
    let total = expected.len() as u64;
    let limit = Instant::now() + Duration::from_secs(900);
    while (nats.stream_len(STREAM).await < total || unfinished(db).await > 0) && Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drain_s = started.elapsed().as_secs_f64();
    let counted = switchyard_tests::orders::tally(&nats.read_stream(STREAM).await, expected);
    eprintln!("{scenario}: {counted:?}");
    for relay in relays {
        relay.terminate();
    }
    Row::counted(scenario, expected.len(), counted, f64::NAN, drain_s)
}

/// Two relays in replication mode drain a backlog written before they
/// start; PostgreSQL restarts under them twice.
pub async fn pg_restart_run(relay_bin: &str, events: usize) -> Row {
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = replication_settings(&db, &nats);
    migrate(relay_bin, &config).await;
    let expected = write_orders(&db.pool, AGGREGATES, events.div_ceil(AGGREGATES), 8).await;
    let total = expected.len() as u64;
    let mut relays: Vec<Process> = (0..2)
        .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
        .collect();
    let started = Instant::now();
    for round in 1..=2u64 {
        while nats.stream_len(STREAM).await < total * round / 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        restart_postgres();
        eprintln!("replication pg-restart: PostgreSQL restarted (round {round})");
    }
    let scenario = "replication, PostgreSQL restarted twice, 2 relays".to_string();
    drain_and_count(
        scenario,
        &db,
        &nats,
        &expected,
        relays.iter_mut().collect(),
        started,
    )
    .await
}

/// One relay in replication mode, writers at 100 events/s; the relay is
/// SIGKILLed and stays down for `minutes` while the writers go on, then
/// starts again. Reports the WAL the slot kept by the end of the outage.
pub async fn relay_down_run(relay_bin: &str, minutes: u64) -> Row {
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = replication_settings(&db, &nats);
    migrate(relay_bin, &config).await;
    let mut relay = Process::spawn(relay_bin, &config, "relay-0");
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = super::outage::writer(&db, stop.clone());
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(30)).await;
    relay.kill();
    let down = Instant::now();
    eprintln!("replication relay-down: relay killed, down for {minutes} min");
    tokio::time::sleep(Duration::from_secs(minutes * 60)).await;
    let retained: Option<i64> = sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(&db.name)
    .fetch_one(&db.pool)
    .await
    .unwrap_or(None);
    let waiting_at_return = nats.stream_len(STREAM).await;
    let mut relay = Process::spawn(relay_bin, &config, "relay-1");
    eprintln!(
        "replication relay-down: back after {:.0} s; the slot kept {} bytes of WAL; {waiting_at_return} events in the stream",
        down.elapsed().as_secs_f64(),
        retained.unwrap_or(-1)
    );
    tokio::time::sleep(Duration::from_secs(30)).await;
    stop.cancel();
    let expected = writer.await.expect("writer");
    let scenario = format!(
        "replication, the relay down {minutes} min while writers went on (slot kept {:.1} MiB of WAL)",
        retained.unwrap_or(0) as f64 / 1_048_576.0
    );
    drain_and_count(scenario, &db, &nats, &expected, vec![&mut relay], started).await
}
