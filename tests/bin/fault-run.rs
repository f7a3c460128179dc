//! The long fault run, by hand: relays as real processes on one PostgreSQL
//! outbox, publishing to JetStream, while the run SIGKILLs relays and stops
//! NATS mid-stream. A consumer then reads the stream and counts, by event id
//! and per-aggregate sequence alone, what was lost, duplicated or reordered.
//!
//! ```sh
//! eval "$(scripts/services.sh start)"
//! cargo run --release -p switchyard-tests --bin fault-run -- [kills|claim-kills|intake-kills|intake-claim-kills|outage|pg-restart|pg-crash|stall|replication-kills|replication-kills-broker-down|upgrade|replication-outage|replication-source-kills|replication-source-outage|replication-poison|replication-pg-restart|replication-pg-crash|replication-source-pg-restart|replication-source-pg-crash|registry-swaps|mariadb-kills|mariadb-down-nats|mariadb-restart|mariadb-binlog-kills|mariadb-binlog-down-nats|mariadb-binlog-restart|aws-sqs-fifo-kills|aws-kinesis-kills|down-sqs-fifo|down-sqs-fifo-frozen|down-kinesis|down-kinesis-frozen|all] [EVENTS] [ROUNDS]
//! ```
//!
//! `kills`: three relays drain EVENTS events written while they run, and one
//! of them is SIGKILLed (and restarted) ROUNDS times. `claim-kills`: the
//! same, each SIGKILL sent the moment the victim's claim statement is seen
//! running (`pg_stat_activity`), so that it lands while the claim runs or
//! its rows are on their way. `intake-kills`, `intake-claim-kills`: the
//! same with the writers inserting into `switchyard_intake`, so the claims
//! killed are moving rows into the outbox. `outage`: two relays,
//! NATS stopped for 30 s mid-stream (JetStream store kept), ROUNDS runs.
//! `pg-restart`: two relays drain a backlog while the project's PostgreSQL
//! is restarted (fast mode: every connection cut) under them; `pg-crash`
//! the same with the server crashed instead (immediate stop: the WAL not
//! yet written, with it the relays' last asynchronous commits, is lost, and
//! the server recovers at start). `stall`: the
//! same through a proxy that stalls every open connection three times
//! (they stay open and answer nothing).
//! `down-nats`, `down-kafka`, `down-rabbitmq [MINUTES|SECONDSs] [KILLS]`:
//! one relay with the default retry settings, writers committing up to 100
//! transactions a second shaped as a service's (several aggregates each,
//! one to three events of each: `switchyard_tests::workload`), the broker
//! stopped for MINUTES (10 by default; `10s` for ten seconds) and started
//! again with its data (JetStream store, tansu on SQLite, a durable
//! RabbitMQ queue). With KILLS, two relays, and the one reading the slot
//! (in claim mode, each in turn) SIGKILLed that many times over the outage
//! and the 30 s after it. In replication mode over the outbox table,
//! `SWITCHYARD_FAULT_EMIT_PERCENT` writes that share of the aggregates
//! through `switchyard_emit`, and `SWITCHYARD_FAULT_DELETE_AS_WRITTEN=1`
//! deletes each event in the transaction that writes it. `down-pubsub-frozen`
//! freezes the Pub/Sub emulator (SIGSTOP) for MINUTES; `down-pubsub` kills
//! it and starts a new one, whose topic and subscription the run makes
//! again (what the killed one held is gone: the run counts, among the
//! lost, those acknowledged before the kill). `down-pg MINUTES`
//! (2 by default): the same with NATS up and PostgreSQL stopped.
//! `replication-down-*` runs each of them in replication mode,
//! `replication-source-down-*` in replication mode with writers into a
//! table of their own read as `[source]`, `intake-down-*` in claim mode
//! with writers into the intake. These
//! print their own table (dead letters, first delivery after the return,
//! drain rate). `replication-kills`: two relays in replication mode on
//! one slot, the one reading it SIGKILLed ROUNDS times (10 by default)
//! while EVENTS events are written; prints each takeover's time.
//! `upgrade EVENTS`: a rolling upgrade from the relay-process binary that
//! `SWITCHYARD_OLD_RELAY` names (an older version's build): two old relays
//! drain while writers go on, the new version migrates the database under
//! them, then new relays replace them one at a time.
//! `replication-kills-broker-down`: the same with NATS stopped before the
//! first kill and started after the last (5 by default), so every restart
//! meets the broker down; counts relays that exit by themselves.
//! `replication-pg-restart`: the same two relays drain a backlog from the
//! slot while PostgreSQL restarts under them twice; `replication-pg-crash`
//! while it crashes and recovers twice, the second time with NATS down
//! while the relays hand what they read over to the table;
//! `replication-source-pg-restart` and `replication-source-pg-crash` the
//! same with the writers inserting into a table of their own (`[source]`).
//! `replication-outage`: two relays in replication mode, NATS stopped for
//! 30 s mid-stream (at most 20,000 events). `replication-source-kills`,
//! `replication-source-outage`: the same with the writers inserting into a
//! table of their own (Debezium's shape) that the relays read as `[source]`. `replication-poison`: two
//! relays in replication mode, a poison event (a plugin traps on it) and 20
//! events of its aggregate among at most 10,000 others.
//! `replication-relay-down MINUTES` (5 by default): one relay in
//! replication mode SIGKILLed and kept down while writers go on at 100
//! events/s; reports the WAL the slot kept.
//! `registry-swaps [MOVES]` (10 by default): one relay whose plugin comes
//! from the loopback registry by tag, writers at about 600 events a second,
//! the tag moved MOVES times across Rust, Python, JavaScript and batch
//! builds; prints each move's pull and compile time and the time from the
//! push to the first event the new digest routed.
//! `mariadb-kills [EVENTS] [KILLS]` (100,000 and 20), `mariadb-down-nats
//! [MINUTES]` (2), `mariadb-restart [RESTARTS]` (2): the kills, a NATS
//! outage under writers and the database restarted under writers, on a
//! MariaDB outbox in claim mode; `mariadb-binlog-kills|down-nats|restart`
//! the same in binlog mode (the kills are of the binary log's reader).
//! With `SWITCHYARD_FAULT_DELETE_AS_WRITTEN=1` the binlog runs' paced
//! writers delete each event in the transaction that writes it; a service
//! transaction that fails (a deadlock the relay's write-back caused) is
//! printed and run again.
//! `fleet-kills DATABASES KILLS` (50 and 10 by default): three relays
//! share DATABASES databases out with `[ownership]`, writers in all of
//! them, a relay SIGKILLed KILLS times; prints each takeover's time.
//! `aws-sqs-fifo-kills [EVENTS] [KILLS]` (600 and 5) and
//! `aws-kinesis-kills [EVENTS] [KILLS]` (20,000 and 10): three relays
//! publish to an SQS FIFO queue (message group the aggregate id) or a
//! 4-shard Kinesis stream on a moto server of the run's own while paced
//! writers shaped as a service's commit EVENTS events, and a relay holding
//! leases is SIGKILLed (and started again) KILLS times over the writing.
//! moto's FIFO queues take a few dozen messages a second, fewer as they
//! fill, so the SQS writers are paced for moto, not for the relay: about
//! one transaction a second (some 5 events) over 50 aggregates; Kinesis
//! gets 40 transactions a second over 400. The queue is drained (received
//! and deleted) through SQS's API all along; the stream is read shard by
//! shard at the end. `down-sqs-fifo`, `down-kinesis [MINUTES|SECONDSs]
//! [KILLS]`: the same service refusing and cutting connections (a front
//! the relay goes through closes; moto keeps what it took) for MINUTES (10
//! by default), one relay with the default settings, writing going on 30 s
//! before and after; with KILLS, two relays killed in turn that many times
//! over the outage and the 30 s after it. `down-sqs-fifo-frozen`,
//! `down-kinesis-frozen`: moto frozen (SIGSTOP) instead. A relay killed
//! between a publish and its ack publishes again: Kinesis keeps both
//! copies, and so does moto's FIFO queue once the consumer deleted the
//! first (moto forgets a deduplication id with its message; SQS keeps it
//! five minutes); the AWS runs count those copies among the duplicates.
//! They print a table of their own (dead letters, worst commit-to-publish
//! and, for outages, the first delivery after the return and the drain);
//! `all` runs the two kills cells with at most their default EVENTS.
//! `SWITCHYARD_FAULT_AGGREGATES` sets how many aggregates the writers of
//! the kills, replication and MariaDB runs spread over (1,000).
//! Prints one table row per run.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use switchyard_tests::config::TestConfig;
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, Tally, tally};
use switchyard_tests::postgres::{Outbox, flush_wal, fresh_db};
use switchyard_tests::relay::{Process, Settings, example};
use switchyard_tests::service::ServicePool;
use switchyard_tests::stall::StallingProxy;
use switchyard_tests::workload::{Shape, write_events};

#[path = "fault-run/aws.rs"]
mod aws;
#[path = "fault-run/fleet.rs"]
mod fleet;
#[path = "fault-run/mariadb.rs"]
mod mariadb;
#[path = "fault-run/outage.rs"]
mod outage;
#[path = "fault-run/registry.rs"]
mod registry;
#[path = "fault-run/replication.rs"]
mod replication;

const STREAM: &str = "ORDERS";
/// Aggregates the writers spread their events over: 1,000, or
/// `SWITCHYARD_FAULT_AGGREGATES` (a service whose aggregates are orders
/// has many, each with a few events: most rows a claim meets are then
/// heads, and an outage parks most of them).
fn aggregates() -> usize {
    std::env::var("SWITCHYARD_FAULT_AGGREGATES")
        .ok()
        .and_then(|value| value.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1000)
}

struct Row {
    scenario: String,
    written: usize,
    received: usize,
    lost: usize,
    duplicates: usize,
    reordered: usize,
    worst_commit_to_publish_s: f64,
    drain_s: f64,
}

impl Row {
    /// A run's row from what the consumer counted.
    fn counted(
        scenario: String,
        written: usize,
        counted: Tally,
        worst_commit_to_publish_s: f64,
        drain_s: f64,
    ) -> Row {
        Row {
            scenario,
            written,
            received: counted.received,
            lost: counted.lost,
            duplicates: counted.duplicates,
            reordered: counted.reordered,
            worst_commit_to_publish_s,
            drain_s,
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "all".into());
    let second_raw = args.next();
    let second: Option<u64> = second_raw.as_deref().and_then(|n| n.parse().ok());
    let events = second.map_or(100_000, |n| n as usize);
    let rounds: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(0);
    let relay_bin = std::env::current_exe()
        .expect("own path")
        .with_file_name("relay-process");
    assert!(
        relay_bin.is_file(),
        "build the relay binary first: cargo build --release -p switchyard-tests --bin relay-process"
    );
    let relay_bin = relay_bin.to_string_lossy().to_string();
    if which == "fleet-kills" {
        let databases = second.map_or(50, |n| n as usize);
        let kills = if rounds == 0 { 10 } else { rounds };
        fleet::kills_run(&relay_bin, databases, kills).await;
        return;
    }
    if let Some(scenario) = which.strip_prefix("mariadb-") {
        let (mode, scenario) = match scenario.strip_prefix("binlog-") {
            Some(scenario) => (mariadb::Mode::Binlog, scenario),
            None => (mariadb::Mode::Claim, scenario),
        };
        let row = match scenario {
            "kills" => {
                mariadb::kills_run(&relay_bin, mode, events, if rounds == 0 { 20 } else { rounds }).await
            }
            "down-nats" => {
                let minutes = second.unwrap_or(2);
                mariadb::broker_down_run(&relay_bin, mode, Duration::from_secs(60 * minutes)).await
            }
            "restart" => mariadb::restart_run(&relay_bin, mode, second.map_or(2, |n| n as usize)).await,
            other => panic!("no MariaDB run {other:?}: kills, down-nats or restart (binlog-kills, ...)"),
        };
        print_rows(vec![row]);
        return;
    }
    if which == "registry-swaps" {
        let moves = second.map_or(10, |n| n as usize);
        print_rows(vec![registry::swaps_run(&relay_bin, moves).await]);
        return;
    }
    if which == "replication-relay-down" {
        let row = replication::relay_down_run(&relay_bin, second.unwrap_or(5)).await;
        print_rows(vec![row]);
        return;
    }
    // The AWS cells: `aws-sqs-fifo-kills`, `aws-kinesis-kills`,
    // `down-sqs-fifo[-frozen]`, `down-kinesis[-frozen]`.
    if let Some(service) = which
        .strip_prefix("aws-")
        .and_then(|rest| rest.strip_suffix("-kills"))
        .and_then(aws::Service::named)
    {
        let (events, kills) = aws_kills(service, second, rounds);
        aws::print(&[aws::kills_run(&relay_bin, service, events, kills).await]);
        return;
    }
    if let Some(down) = which.strip_prefix("down-") {
        let (name, away) = match down.strip_suffix("-frozen") {
            Some(name) => (name, aws::Away::Frozen),
            None => (down, aws::Away::Refused),
        };
        if let Some(service) = aws::Service::named(name) {
            let outage = outage_length(second_raw.as_deref(), second, 10);
            aws::print(&[aws::down_run(&relay_bin, service, away, outage, rounds).await]);
            return;
        }
    }
    let replication_down = which.strip_prefix("replication-down-");
    let intake_down = which.strip_prefix("intake-down-");
    let source_down = which.strip_prefix("replication-source-down-");
    if let Some(down) = which
        .strip_prefix("down-")
        .or(replication_down)
        .or(intake_down)
        .or(source_down)
    {
        let outage = outage_length(second_raw.as_deref(), second, if down == "pg" { 2 } else { 10 });
        let outbox = if intake_down.is_some() {
            Outbox::Intake
        } else if source_down.is_some() {
            Outbox::Debezium
        } else {
            Outbox::Switchyard
        };
        let replicates = replication_down.is_some() || source_down.is_some();
        // KILLS: two relays, the slot's reader (or either, in claim
        // mode) SIGKILLed that many times around the outage.
        let row = outage::down_run(&relay_bin, down, outage, replicates, outbox, rounds).await;
        outage::print(&[row]);
        return;
    }
    let mut rows = Vec::new();
    let kills = if rounds == 0 { 20 } else { rounds };
    for (outbox, prefix) in [(Outbox::Switchyard, ""), (Outbox::Intake, "intake-")] {
        if which == format!("{prefix}kills") || which == "all" {
            rows.push(kills_run(&relay_bin, outbox, events, kills).await);
        }
        if which == format!("{prefix}claim-kills") || which == "all" {
            rows.push(claim_kills_run(&relay_bin, outbox, events, kills).await);
        }
    }
    for (outbox, prefix) in [(Outbox::Switchyard, ""), (Outbox::Debezium, "source-")] {
        if which == format!("replication-{prefix}kills") || which == "all" {
            let kills = if rounds == 0 { 10 } else { rounds };
            rows.push(replication::kills_run(&relay_bin, outbox, events, kills, false).await);
        }
        if which == format!("replication-{prefix}kills-broker-down") || which == "all" {
            let kills = if rounds == 0 { 5 } else { rounds };
            rows.push(replication::kills_run(&relay_bin, outbox, events, kills, true).await);
        }
        if which == format!("replication-{prefix}outage") || which == "all" {
            rows.push(replication::outage_run(&relay_bin, outbox, events.min(20_000)).await);
        }
        if which == format!("replication-{prefix}pg-restart") || which == "all" {
            rows.push(replication::pg_restart_run(&relay_bin, outbox, events.min(20_000), false).await);
        }
        if which == format!("replication-{prefix}pg-crash") || which == "all" {
            rows.push(replication::pg_restart_run(&relay_bin, outbox, events.min(20_000), true).await);
        }
    }
    if which == "replication-poison" || which == "all" {
        rows.push(replication::poison_run(&relay_bin, events.min(10_000)).await);
    }
    if which == "upgrade" {
        let old = std::env::var("SWITCHYARD_OLD_RELAY")
            .expect("SWITCHYARD_OLD_RELAY: the relay-process binary of the older version");
        rows.push(upgrade_run(&old, &relay_bin, events.min(50_000)).await);
    }
    if which == "pg-restart" || which == "all" {
        rows.push(pg_restart_run(&relay_bin, events.min(20_000), false).await);
    }
    if which == "pg-crash" || which == "all" {
        rows.push(pg_restart_run(&relay_bin, events.min(20_000), true).await);
    }
    if which == "stall" || which == "all" {
        rows.push(stall_run(&relay_bin, events.min(20_000)).await);
    }
    if which == "outage" || which == "all" {
        let runs = if rounds == 0 { 3 } else { rounds };
        for run in 1..=runs {
            rows.push(outage_run(&relay_bin, events.min(20_000), run).await);
        }
    }
    let mut aws_rows = Vec::new();
    if which == "all" {
        for service in [aws::Service::SqsFifo, aws::Service::Kinesis] {
            let (most, kills) = aws_kills(service, None, rounds);
            aws_rows.push(aws::kills_run(&relay_bin, service, events.min(most), kills).await);
        }
    }
    print_rows(rows);
    if !aws_rows.is_empty() {
        aws::print(&aws_rows);
    }
}

/// An outage's length: MINUTES, or a length in seconds (`10s`);
/// `default_minutes` without either.
fn outage_length(raw: Option<&str>, minutes: Option<u64>, default_minutes: u64) -> Duration {
    match raw.and_then(|n| n.strip_suffix('s')) {
        Some(seconds) => Duration::from_secs(seconds.parse().expect("an outage length such as 10s")),
        None => Duration::from_secs(60 * minutes.unwrap_or(default_minutes)),
    }
}

/// An AWS kills cell's EVENTS and KILLS: as given, else 600 events and 5
/// kills to moto's SQS FIFO queue (paced for it: some 5 events a second),
/// 20,000 events and 10 kills to Kinesis.
fn aws_kills(service: aws::Service, events: Option<u64>, kills: usize) -> (usize, usize) {
    let (events_by_default, kills_by_default) = match service {
        aws::Service::SqsFifo => (600, 5),
        aws::Service::Kinesis => (20_000, 10),
    };
    (
        events.map_or(events_by_default, |n| n as usize),
        if kills == 0 { kills_by_default } else { kills },
    )
}

fn print_rows(rows: Vec<Row>) {
    println!();
    println!(
        "| scenario | written | received | lost | duplicates | reordered | worst commit-to-publish | drain |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for row in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} s |",
            row.scenario,
            row.written,
            row.received,
            row.lost,
            row.duplicates,
            row.reordered,
            // Not known when the outbox could not be read after the run.
            if row.worst_commit_to_publish_s.is_nan() {
                "-".to_string()
            } else {
                format!("{:.1} s", row.worst_commit_to_publish_s)
            },
            row.drain_s
        );
    }
}

fn settings(db_url: &str, nats_url: &str) -> TestConfig {
    // Short leases so a killed relay's rows come back quickly.
    example(
        &Settings::new(db_url, nats_url)
            .relay("lease_duration_ms", "4000")
            .relay("publish_timeout_ms", "1500")
            // Within the test streams' one-hour duplicate window.
            .relay("max_attempts", "500")
            .relay("max_backoff_ms", "2000"),
    )
}

/// Rows published; 0 while the database does not answer.
async fn published(pool: impl Into<ServicePool>) -> i64 {
    pool.into().try_count_status("published").await.unwrap_or(0)
}

/// Waits (at most 15 minutes) until every expected event is published,
/// then counts what the consumer got.
async fn finish(
    scenario: String,
    pool: impl Into<ServicePool>,
    nats: &NatsServer,
    expected: &HashMap<String, Expected>,
    started: Instant,
) -> Row {
    let pool = pool.into();
    let total = expected.len() as i64;
    let limit = Instant::now() + Duration::from_secs(900);
    while published(&pool).await < total && Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drain_s = started.elapsed().as_secs_f64();
    let worst = pool.worst_commit_to_publish_s().await;
    let dead = pool.count_status("dead").await;
    let received = nats.read_stream(STREAM).await;
    let counted = tally(&received, expected);
    eprintln!("{scenario}: {counted:?}, {dead} dead");
    Row::counted(scenario, expected.len(), counted, worst, drain_s)
}

/// A fresh outbox and stream, `relays` relay processes, and a writer task
/// putting `events` order events into `outbox` while they run.
struct Scenario {
    db: switchyard_tests::postgres::TestDb,
    nats: NatsServer,
    config: String,
    relays: Vec<Process>,
    writer: tokio::task::JoinHandle<HashMap<String, Expected>>,
    total: i64,
    started: Instant,
}

impl Scenario {
    async fn start(relay_bin: &str, outbox: Outbox, relays: usize, events: usize) -> Scenario {
        let db = fresh_db().await;
        let nats = NatsServer::start().await;
        nats.create_stream(STREAM, &["orders.>"]).await;
        let config = settings(&db.url, &nats.url()).toml();
        let relays = (0..relays)
            .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
            .collect();
        let writer = tokio::spawn({
            let pool = db.pool.clone();
            async move { write_events(&pool, Shape::rows(outbox), aggregates(), events, 8, 5).await }
        });
        Scenario {
            db,
            nats,
            config,
            relays,
            writer,
            // At least this many; the writers finish their last transactions.
            total: events as i64,
            started: Instant::now(),
        }
    }

    async fn finish(mut self, scenario: String) -> Row {
        let expected = self.writer.await.expect("writer");
        let row = finish(scenario, &self.db.pool, &self.nats, &expected, self.started).await;
        for relay in &mut self.relays {
            relay.terminate();
        }
        row
    }
}

/// A rolling upgrade: two relays of an older build (`old_bin`) drain while
/// writers go on; the new build migrates the database under them, then
/// replaces them one at a time (the new one started, then the old one sent
/// SIGTERM), as a Kubernetes rollout with one surge does.
async fn upgrade_run(old_bin: &str, relay_bin: &str, events: usize) -> Row {
    // Not migrated: the old version migrates it as it knew the schema.
    let db = switchyard_tests::postgres::fresh_db_before(0).await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let config = settings(&db.url, &nats.url()).toml();
    replication::migrate(old_bin, &config).await;
    let mut relays: Vec<Process> = (0..2)
        .map(|n| Process::spawn(old_bin, &config, &format!("old-{n}")))
        .collect();
    let started = Instant::now();
    let writer = tokio::spawn({
        let pool = db.pool.clone();
        async move { write_events(&pool, Shape::rows(Outbox::Switchyard), aggregates(), events, 8, 6).await }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    replication::migrate(relay_bin, &config).await;
    eprintln!("migrated by the new version under the old relays");
    for (n, relay) in relays.iter_mut().enumerate() {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let new = Process::spawn(relay_bin, &config, &format!("new-{n}"));
        tokio::time::sleep(Duration::from_secs(3)).await;
        relay.terminate();
        eprintln!("old-{n} stopped (SIGTERM), new-{n} serving");
        *relay = new;
    }
    let expected = writer.await.expect("writer");
    let row = finish(
        "rolling upgrade: 2 old relays, new migrate under them, replaced one by one".into(),
        &db.pool,
        &nats,
        &expected,
        started,
    )
    .await;
    for relay in &mut relays {
        relay.terminate();
    }
    row
}

/// Three relays; one at a time SIGKILLed while holding leases, then restarted.
async fn kills_run(relay_bin: &str, outbox: Outbox, events: usize, kills: usize) -> Row {
    let mut run = Scenario::start(relay_bin, outbox, 3, events).await;
    let mut done = 0;
    let mut generation = 0;
    while done < kills {
        let victim = done % run.relays.len();
        let owner = format!("relay-{victim}");
        let holds: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM switchyard_outbox WHERE status = 'in_flight' AND lease_owner LIKE $1 || '%'",
        )
        .bind(&owner)
        .fetch_one(&run.db.pool)
        .await
        .unwrap_or(0);
        if holds == 0 {
            if published(&run.db.pool).await >= run.total {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        run.relays[victim].kill();
        generation += 1;
        eprintln!("kill {}: {owner} held {holds} leases", done + 1);
        run.relays[victim] = Process::spawn(relay_bin, &run.config, &format!("{owner}-{generation}"));
        done += 1;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    run.finish(format!("{done} SIGKILLs, 3 relays{}", written_to(outbox)))
        .await
}

/// Three relays; each SIGKILL is sent the moment the victim's claim is seen
/// running, so that it lands while the claim runs or its rows are on
/// their way. The claim commits on its own, so its
/// leases may outlive the relay (the rows come back when they end), or the
/// cut connection undoes it.
async fn claim_kills_run(relay_bin: &str, outbox: Outbox, events: usize, kills: usize) -> Row {
    let mut run = Scenario::start(relay_bin, outbox, 3, events).await;
    let (mut done, mut generation, mut looks) = (0, 0, 0u64);
    while done < kills {
        looks += 1;
        if looks.is_multiple_of(200) && published(&run.db.pool).await >= run.total {
            break;
        }
        let claiming: Option<String> = sqlx::query_scalar(
            "SELECT application_name FROM pg_stat_activity
              WHERE state = 'active' AND query LIKE '%SKIP LOCKED%'
                AND application_name LIKE 'switchyard relay-%' LIMIT 1",
        )
        .fetch_optional(&run.db.pool)
        .await
        .ok()
        .flatten();
        let victim = claiming
            .as_deref()
            .and_then(|name| name.strip_prefix("switchyard relay-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|victim| *victim < run.relays.len());
        let Some(victim) = victim else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        run.relays[victim].kill();
        generation += 1;
        done += 1;
        eprintln!("kill {done}: relay-{victim} during a claim");
        run.relays[victim] = Process::spawn(relay_bin, &run.config, &format!("relay-{victim}-{generation}"));
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    run.finish(format!(
        "{done} SIGKILLs during a claim, 3 relays{}",
        written_to(outbox)
    ))
    .await
}

/// How a scenario's name says where its writers wrote.
fn written_to(outbox: Outbox) -> &'static str {
    if outbox == Outbox::Intake {
        ", writers into the intake"
    } else {
        ""
    }
}

/// Two relays; NATS stopped for 30 s while events are written and relayed.
async fn outage_run(relay_bin: &str, events: usize, round: usize) -> Row {
    let mut run = Scenario::start(relay_bin, Outbox::Switchyard, 2, events).await;
    while published(&run.db.pool).await < run.total / 4 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    run.nats.stop();
    eprintln!(
        "outage {round}: NATS stopped at {} published",
        published(&run.db.pool).await
    );
    tokio::time::sleep(Duration::from_secs(30)).await;
    run.nats.resume().await;
    eprintln!("outage {round}: NATS back");
    run.finish(format!("NATS down 30 s, run {round}")).await
}

/// Restarts the project's PostgreSQL in fast mode: every connection cut.
fn restart_postgres() {
    restart_postgres_in("fast");
}

/// Stops the project's PostgreSQL as a crash does (`immediate`: every
/// process quits at once, WAL not yet written is gone, among it the relay
/// sessions' commits made with `synchronous_commit = off`) and starts it,
/// which recovers from the WAL.
fn crash_postgres() {
    restart_postgres_in("immediate");
}

fn restart_postgres_in(mode: &str) {
    let state = std::env::var("SWITCHYARD_STATE_DIR").unwrap_or_else(|_| "/tmp/switchyard-services".into());
    let pg_ctl = std::env::var("SWITCHYARD_PG_BIN").unwrap_or_else(|_| "/usr/lib/postgresql/15/bin".into());
    let status = std::process::Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(format!("{pg_ctl}/pg_ctl"))
        // The server keeps logging to its file: without `-l` it would write
        // to this run's stderr and outlive it.
        .args([
            "-D",
            &format!("{state}/pg"),
            "-l",
            &format!("{state}/pg/server.log"),
        ])
        .args(["-m", mode, "-w", "-t", "60", "restart"])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("pg_ctl");
    assert!(status.success(), "pg_ctl restart failed");
}

/// Two relays drain a backlog through a proxy that stalls every open
/// connection three times (they stay open and answer nothing, as on a
/// link that drops every packet); connections opened after go through.
async fn stall_run(relay_bin: &str, events: usize) -> Row {
    let db = fresh_db().await;
    let proxy = StallingProxy::in_front_of(&db.url).await;
    let scenario = "every relay connection stalled 3 times, 2 relays";
    drain_under_faults(
        relay_bin,
        &db,
        &proxy.url(&db.url),
        events,
        scenario,
        3,
        |round| {
            proxy.stall_open_connections();
            eprintln!("stall: every open connection stalled (round {round})");
        },
    )
    .await
}

/// Two relays drain a backlog; PostgreSQL restarts under them twice, or
/// with `crash` crashes and recovers twice.
async fn pg_restart_run(relay_bin: &str, events: usize, crash: bool) -> Row {
    let db = fresh_db().await;
    // The harness pool loses its connections too; sqlx reconnects on use.
    let scenario = if crash {
        "PostgreSQL crashed twice, 2 relays"
    } else {
        "PostgreSQL restarted twice, 2 relays"
    };
    drain_under_faults(relay_bin, &db, &db.url, events, scenario, 2, |round| {
        if crash {
            crash_postgres();
            eprintln!("pg-crash: PostgreSQL crashed and recovered (round {round})");
        } else {
            restart_postgres();
            eprintln!("pg-restart: PostgreSQL restarted (round {round})");
        }
    })
    .await
}

/// Two relays on `relay_url` drain `events` written first into `db` (the
/// writers are not what these runs test); `fault` runs `faults` times, each
/// when another share of `faults + 1` is published.
async fn drain_under_faults(
    relay_bin: &str,
    db: &switchyard_tests::postgres::TestDb,
    relay_url: &str,
    events: usize,
    scenario: &str,
    faults: i64,
    mut fault: impl FnMut(i64),
) -> Row {
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let expected = write_events(
        &db.pool,
        Shape::rows(Outbox::Switchyard),
        aggregates(),
        events,
        8,
        7,
    )
    .await;
    flush_wal(&db.pool).await;
    let config = settings(relay_url, &nats.url()).toml();
    let mut relays: Vec<Process> = (0..2)
        .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
        .collect();
    let started = Instant::now();
    let total = expected.len() as i64;
    for round in 1..=faults {
        while published(&db.pool).await < total * round / (faults + 1) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        fault(round);
    }
    let row = finish(scenario.into(), &db.pool, &nats, &expected, started).await;
    for relay in &mut relays {
        relay.terminate();
    }
    row
}
