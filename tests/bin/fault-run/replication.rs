//! Replication-mode runs of the long fault run: the same counting, with
//! relays reading one slot (one active, the others standing by).

use std::time::{Duration, Instant};

use switchyard_tests::config::{Plugin, TestConfig};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::postgres::{DEBEZIUM_OUTBOX, Outbox, TestDb, debezium_source, flush_wal, fresh_db};
use switchyard_tests::relay::Process;
use switchyard_tests::workload::{Shape, write_events};

use super::{Row, STREAM, aggregates, crash_postgres, restart_postgres, settings};

/// The fault run's config in replication mode, through a slot named after
/// the database.
fn replication_settings(db: &TestDb, nats: &NatsServer) -> TestConfig {
    settings(&db.url, &nats.url())
        .relay("mode", "replication")
        .set("replication", "slot", db.name.as_str())
}

/// [`replication_settings`] for writers into `outbox`: with
/// `Outbox::Debezium` the service's own table, created here and read from
/// the WAL as `[source]`.
async fn settings_for(db: &TestDb, nats: &NatsServer, outbox: Outbox) -> String {
    for_writers_into(db, outbox, replication_settings(db, nats)).await
}

/// `config` for writers into `outbox`: with `Outbox::Debezium` the
/// service's table is created and `[source]` added, so the relays read it
/// from the WAL.
pub(super) async fn for_writers_into(db: &TestDb, outbox: Outbox, config: TestConfig) -> String {
    if outbox != Outbox::Debezium {
        return config.toml();
    }
    sqlx::query(DEBEZIUM_OUTBOX)
        .execute(&db.pool)
        .await
        .expect("create the service's table");
    config.source(debezium_source()).toml()
}

/// How a scenario names writers into `outbox`.
pub(super) fn written_to(outbox: Outbox) -> &'static str {
    if outbox == Outbox::Debezium {
        ", writers into their own table ([source])"
    } else {
        ""
    }
}

pub(super) async fn migrate(relay_bin: &str, config: &str) {
    let path = std::env::temp_dir().join(format!("sy-fault-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).expect("write config");
    let (code, out, err) =
        switchyard_tests::cli(relay_bin, &["migrate", "--config", path.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "migrate: {out}{err}");
}

/// The `application_name` of the session reading the slot, if one does.
pub(super) async fn reader(db: &TestDb) -> Option<String> {
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

/// Two relays on one slot while writers put `events` events into
/// `outbox`; the one reading it is SIGKILLed `kills` times (and started
/// again, as a standby). Each takeover's time is printed.
/// With `broker_down`, NATS is stopped before the first kill and started
/// again after the last: every restart then meets the broker down, and a
/// relay that exits by itself (as one did on a target down at start) is
/// counted and started again.
pub async fn kills_run(
    relay_bin: &str,
    outbox: Outbox,
    events: usize,
    kills: usize,
    broker_down: bool,
) -> Row {
    let db = fresh_db().await;
    let mut nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = settings_for(&db, &nats, outbox).await;
    migrate(relay_bin, &config).await;
    let mut relays: Vec<(String, Process)> = (0..2)
        .map(|n| {
            let name = format!("relay-{n}");
            let process = Process::spawn(relay_bin, &config, &name);
            (name, process)
        })
        .collect();
    let started = Instant::now();
    let writer = tokio::spawn({
        let pool = db.pool.clone();
        async move { write_events(&pool, Shape::replicated(outbox), aggregates(), events, 8, 1).await }
    });
    let mut takeovers = Vec::new();
    let mut generation = 0;
    let mut exits = 0;
    for kill in 1..=kills {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        if broker_down && kill == 1 {
            nats.stop();
            eprintln!("NATS stopped");
        }
        for (name, relay) in &mut relays {
            if relay.has_exited() {
                exits += 1;
                eprintln!("{name} exited by itself; starting it again");
                generation += 1;
                *name = format!("{name}-{generation}");
                *relay = Process::spawn(relay_bin, &config, name);
            }
        }
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
    if broker_down {
        nats.resume().await;
        eprintln!("NATS started again");
    }
    let expected = writer.await.expect("writer");
    let worst_takeover = takeovers.iter().copied().fold(0.0, f64::max);
    eprintln!("replication kills: takeovers (s): {takeovers:.2?}");
    let scenario = if broker_down {
        format!(
            "replication, {} SIGKILLs of the reader with NATS down throughout, 2 relays{} \
             (takeover worst {worst_takeover:.1} s, {exits} relays exited by themselves)",
            takeovers.len(),
            written_to(outbox)
        )
    } else {
        format!(
            "replication, {} SIGKILLs of the reader, 2 relays{} (takeover worst {worst_takeover:.1} s)",
            takeovers.len(),
            written_to(outbox)
        )
    };
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

/// Two relays in replication mode drain a backlog written into `outbox`
/// before they start; PostgreSQL restarts under them twice, or with `crash`
/// crashes and recovers twice, the second time with NATS down, while the
/// relays hand what they read over to the table and move the slot past it.
pub async fn pg_restart_run(relay_bin: &str, outbox: Outbox, events: usize, crash: bool) -> Row {
    let db = fresh_db().await;
    let mut nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = settings_for(&db, &nats, outbox).await;
    migrate(relay_bin, &config).await;
    let expected = write_events(&db.pool, Shape::replicated(outbox), aggregates(), events, 8, 2).await;
    flush_wal(&db.pool).await;
    let total = expected.len() as u64;
    let mut relays: Vec<Process> = (0..2)
        .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
        .collect();
    let started = Instant::now();
    for round in 1..=2u64 {
        while nats.stream_len(STREAM).await < total * round / 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if crash && round == 2 {
            nats.stop();
            let before = through_table(&db).await;
            let waited = Instant::now();
            while through_table(&db).await == before && waited.elapsed() < Duration::from_secs(30) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            crash_postgres();
            eprintln!(
                "replication pg-crash: PostgreSQL crashed and recovered with NATS down, {} rows handed over before",
                through_table(&db).await
            );
            tokio::time::sleep(Duration::from_secs(5)).await;
            nats.resume().await;
        } else if crash {
            crash_postgres();
            eprintln!("replication pg-crash: PostgreSQL crashed and recovered (round {round})");
        } else {
            restart_postgres();
            eprintln!("replication pg-restart: PostgreSQL restarted (round {round})");
        }
    }
    let scenario = if crash {
        "replication, PostgreSQL crashed twice (once with NATS down), 2 relays"
    } else {
        "replication, PostgreSQL restarted twice, 2 relays"
    };
    let scenario = format!("{scenario}{}", written_to(outbox));
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
    let config = replication_settings(&db, &nats).toml();
    migrate(relay_bin, &config).await;
    let mut relay = Process::spawn(relay_bin, &config, "relay-0");
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = super::outage::writer(&db, Outbox::Switchyard, true, stop.clone());
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

/// Rows that went through the table (handed over to the claim path).
async fn through_table(db: &TestDb) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status <> 'streamed'")
        .fetch_one(&db.pool)
        .await
        .unwrap_or(-1)
}

/// Two relays in replication mode while writers put `events` events into
/// `outbox`; NATS is stopped for 30 s once a quarter of them is in the
/// stream (its JetStream store kept).
pub async fn outage_run(relay_bin: &str, outbox: Outbox, events: usize) -> Row {
    let db = fresh_db().await;
    let mut nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = settings_for(&db, &nats, outbox).await;
    migrate(relay_bin, &config).await;
    let mut relays: Vec<Process> = (0..2)
        .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
        .collect();
    let started = Instant::now();
    let writer = tokio::spawn({
        let pool = db.pool.clone();
        async move { write_events(&pool, Shape::replicated(outbox), aggregates(), events, 8, 3).await }
    });
    while nats.stream_len(STREAM).await < (events / 4) as u64 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    nats.stop();
    eprintln!("replication outage: NATS stopped");
    tokio::time::sleep(Duration::from_secs(30)).await;
    nats.resume().await;
    eprintln!("replication outage: NATS back");
    let expected = writer.await.expect("writer");
    let scenario = format!("replication, NATS down 30 s, 2 relays{}", written_to(outbox));
    let row = drain_and_count(
        scenario,
        &db,
        &nats,
        &expected,
        relays.iter_mut().collect(),
        started,
    )
    .await;
    let dead: i64 = super::outage::dead_letters(&db).await;
    eprintln!(
        "replication outage: {} events went through the table; {dead} dead-lettered",
        through_table(&db).await
    );
    Row {
        scenario: format!("{} ({dead} dead-lettered)", row.scenario),
        ..row
    }
}

/// Two relays in replication mode while writers put `events` events in;
/// one aggregate of its own starts with a poison (a plugin that traps on
/// it) followed by 20 events. Only that aggregate may go through the table;
/// the poison is dead-lettered with its reason.
pub async fn poison_run(relay_bin: &str, events: usize) -> Row {
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = replication_settings(&db, &nats)
        .relay("max_attempts", 3)
        .relay("max_backoff_ms", 400)
        .plugin_first(
            Plugin::new("poison", &switchyard_tests::plugins::plugin("misbehave"))
                .event_types(&["Poison"])
                .config("mode", "trap")
                .config("target", "events"),
        )
        .toml();
    migrate(relay_bin, &config).await;
    let mut relays: Vec<Process> = (0..2)
        .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
        .collect();
    let started = Instant::now();
    let writer = tokio::spawn({
        let pool = db.pool.clone();
        async move {
            write_events(
                &pool,
                Shape::replicated(Outbox::Switchyard),
                aggregates(),
                events,
                8,
                4,
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The poisoned aggregate: its events after the poison count from 0.
    let mut followers = std::collections::HashMap::new();
    for seq in 0..=20 {
        let mut event = switchyard_tests::orders::order_event(aggregates() + 1, seq);
        if seq == 0 {
            event.event_type = "Poison".into();
        }
        let id = switchyard_tests::postgres::place_order_event(&db.pool, &event, true).await;
        if seq > 0 {
            followers.insert(
                id.to_string(),
                switchyard_tests::orders::Expected {
                    aggregate_id: event.aggregate_id.clone(),
                    seq: seq as u64 - 1,
                    event_type: event.event_type.clone(),
                },
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut expected = writer.await.expect("writer");
    expected.extend(followers);
    let scenario = format!("replication, a poison among {events} events, 2 relays");
    let row = drain_and_count(
        scenario,
        &db,
        &nats,
        &expected,
        relays.iter_mut().collect(),
        started,
    )
    .await;
    let (aggregates, rows): (i64, i64) = sqlx::query_as(
        "SELECT count(DISTINCT aggregate_id), count(*) FROM switchyard_outbox WHERE status <> 'streamed'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap_or((-1, -1));
    let reason: Option<String> =
        sqlx::query_scalar("SELECT last_error FROM switchyard_outbox WHERE status = 'dead' LIMIT 1")
            .fetch_optional(&db.pool)
            .await
            .unwrap_or(None);
    eprintln!(
        "replication poison: {rows} rows of {aggregates} aggregate(s) went through the table; dead letter: {reason:?}"
    );
    Row {
        scenario: format!(
            "{} ({rows} rows of {aggregates} aggregate through the table; dead letter: {})",
            row.scenario,
            reason.as_deref().unwrap_or("none")
        ),
        ..row
    }
}
