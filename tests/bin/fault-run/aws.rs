//! The AWS runs: relay processes publishing to an SQS FIFO queue or a
//! Kinesis stream on a moto server of the run's own, SIGKILLed while
//! writers go on, or with the service away (its connections refused
//! through a front, or the server frozen) for a while. A consumer reads
//! through the service's API: the queue drained (received and deleted) all
//! along, as moto's FIFO queues slow down with every message they hold;
//! the stream read shard by shard at the end.
//!
//! moto's FIFO queues take a few dozen messages a second, fewer as they
//! fill: the SQS writers commit about one transaction a second (some 4 to
//! 7 events) over [`SQS_AGGREGATES`] aggregates, paced for the emulator,
//! not for the relay. The Kinesis writers commit [`KINESIS_TRANSACTIONS`]
//! a second over [`KINESIS_AGGREGATES`].
//!
//! Copies are counted, not hidden: a relay killed between a publish and
//! its ack publishes again (at least once). Kinesis keeps both records;
//! SQS drops the second by its deduplication id (the event id) for five
//! minutes, but moto forgets an id once its message is deleted, which the
//! consumer here does at once, so a copy of an event already consumed
//! shows on moto where SQS would drop it.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use switchyard_tests::aws::{Draining, Moto, unique};
use switchyard_tests::config::{Plugin, TestConfig, routes, strings};
use switchyard_tests::nats::Received;
use switchyard_tests::orders::{Expected, Tally, tally};
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{Outbox, TestDb, fresh_db};
use switchyard_tests::pubsub::Front;
use switchyard_tests::relay::{Process, RelaySection};
use switchyard_tests::workload::{Shape, paced_writer};

use super::outage::{dead_letters, scalar};

/// Aggregates the SQS writers spread over: a claim holds one event of
/// each at most, so this bounds the `SendMessageBatch` calls of one claim
/// (moto answers each in a fraction of a second).
const SQS_AGGREGATES: usize = 50;
/// Transactions a second the SQS writers commit (some 4 to 7 events).
const SQS_TRANSACTIONS: u64 = 1;
/// Aggregates the Kinesis writers spread over.
const KINESIS_AGGREGATES: usize = 400;
/// Transactions a second the Kinesis writers commit (about 7 events each).
const KINESIS_TRANSACTIONS: u64 = 40;
/// Shards of the run's stream.
const SHARDS: i32 = 4;
/// Writing goes on this long before the outage and after the return.
const AROUND: Duration = Duration::from_secs(30);
/// The longest the relays get to publish everything after the writers stop.
const DRAIN_LIMIT: Duration = Duration::from_secs(900);

/// The service a run publishes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// A FIFO queue, message group the aggregate id.
    SqsFifo,
    /// A stream of [`SHARDS`] shards, partition key the aggregate id.
    Kinesis,
}

impl Service {
    /// The service a cell names (`sqs-fifo`, `kinesis`).
    pub fn named(name: &str) -> Option<Service> {
        match name {
            "sqs-fifo" => Some(Service::SqsFifo),
            "kinesis" => Some(Service::Kinesis),
            _ => None,
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Service::SqsFifo => "sqs",
            Service::Kinesis => "kinesis",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Service::SqsFifo => "SQS FIFO",
            Service::Kinesis => "Kinesis",
        }
    }

    fn aggregates(self) -> usize {
        match self {
            Service::SqsFifo => SQS_AGGREGATES,
            Service::Kinesis => KINESIS_AGGREGATES,
        }
    }

    fn transactions(self) -> u64 {
        match self {
            Service::SqsFifo => SQS_TRANSACTIONS,
            Service::Kinesis => KINESIS_TRANSACTIONS,
        }
    }

    /// The kills runs' `[relay]`: short leases, so a killed relay's rows
    /// come back quickly, and attempts enough never to dead-letter. A
    /// claim to moto's FIFO queue takes seconds: its publish timeout is
    /// longer.
    fn kills_section(self) -> RelaySection {
        let (publish, lease) = match self {
            Service::SqsFifo => ("3000", "8000"),
            Service::Kinesis => ("1500", "4000"),
        };
        RelaySection::new()
            .set("lease_duration_ms", lease)
            .set("publish_timeout_ms", publish)
            .set("max_attempts", "500")
            .set("max_backoff_ms", "2000")
    }
}

/// One run's figures.
pub struct Row {
    scenario: String,
    written: usize,
    dead: i64,
    tally: Tally,
    worst_commit_to_publish_s: f64,
    first_after_return_s: Option<f64>,
    backlog_at_return: Option<i64>,
    drain_rate: Option<f64>,
    /// From the writers' start to the last publish.
    run_s: f64,
}

/// A moto server of the run's own holding the run's queue or stream, what
/// the relays reach it through, and the queue's consumer.
struct Aws {
    service: Service,
    moto: Moto,
    /// With [`Away::Refused`]: the relays reach moto through it.
    front: Option<Front>,
    /// The queue's or stream's name.
    name: String,
    /// The queue's consumer, receiving from the start.
    consumer: Option<Draining>,
}

/// How the service goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Away {
    /// Connections refused and cut, as a crashed service's are: the front
    /// the relays go through closes (moto keeps what it took).
    Refused,
    /// SIGSTOP: connections taken, nothing answers.
    Frozen,
}

impl Aws {
    async fn start(service: Service, front: bool) -> Aws {
        let moto = Moto::own().await;
        let front = if front {
            Some(Front::to(moto.url.trim_start_matches("http://")).await)
        } else {
            None
        };
        let (name, consumer) = match service {
            Service::SqsFifo => {
                let name = unique("fault") + ".fifo";
                let url = moto.queue(&name).await;
                // Straight from moto, front or not: the consumer is not
                // what goes away.
                let consumer = moto.drain(&url);
                (name, Some(consumer))
            }
            Service::Kinesis => {
                let name = unique("fault");
                moto.stream(&name, SHARDS).await;
                (name, None)
            }
        };
        Aws {
            service,
            moto,
            front,
            name,
            consumer,
        }
    }

    /// Every event to the run's queue or stream (keyed by aggregate)
    /// through the fan-out plugin, with `relay` as `[relay]`.
    fn config(&self, db: &TestDb, relay: RelaySection) -> String {
        let endpoint = self.front.as_ref().map_or_else(
            || self.moto.url.clone(),
            |front| format!("http://{}", front.host()),
        );
        let list = match self.service {
            Service::SqsFifo => "queues",
            Service::Kinesis => "streams",
        };
        TestConfig::new(&db.url)
            .database("max_connections", 8)
            .tuning(relay)
            .plugin(
                Plugin::new("fanout", &plugin("fan_out"))
                    .set("timeout_ms", 1000)
                    .config("default", routes(&[("out", &self.name, Some("{aggregate_id}"))])),
            )
            .target(
                "out",
                self.moto
                    .target(self.service.kind())
                    .set("endpoint_url", endpoint.as_str())
                    .set(list, strings(&[&self.name])),
            )
            .toml()
    }

    fn go_away(&mut self, away: Away) {
        match away {
            Away::Refused => self.front.as_mut().expect("a front").close(),
            Away::Frozen => self.moto.freeze(),
        }
    }

    async fn come_back(&mut self, away: Away) {
        match away {
            Away::Refused => self.front.as_mut().expect("a front").open().await,
            Away::Frozen => self.moto.thaw(),
        }
    }

    /// What the consumer got: the queue's messages once every expected
    /// event came (copies do not count toward it) or nothing more came
    /// for 30 s; the stream's records, shard by shard.
    async fn received(&mut self, expected: &HashMap<String, Expected>) -> Vec<Received> {
        match self.consumer.take() {
            Some(consumer) => {
                let limit = Instant::now() + Duration::from_secs(600);
                let (mut count, mut quiet_since) = (0, Instant::now());
                loop {
                    let so_far = consumer.so_far();
                    if so_far.len() != count {
                        count = so_far.len();
                        quiet_since = Instant::now();
                    }
                    let events: HashSet<&str> = so_far
                        .iter()
                        .filter_map(|m| m.header("Switchyard-Event-Id"))
                        .filter(|id| expected.contains_key(*id))
                        .collect();
                    if events.len() >= expected.len()
                        || quiet_since.elapsed() > Duration::from_secs(30)
                        || Instant::now() > limit
                    {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                // Copies still on their way arrive within a receive or two.
                tokio::time::sleep(Duration::from_secs(3)).await;
                consumer.wait(0, Duration::ZERO).await
            }
            None => {
                self.moto
                    .records(&self.name, expected.len(), Duration::from_secs(120))
                    .await
            }
        }
    }
}

/// Rows in the outbox: what the writers committed so far.
async fn written(db: &TestDb) -> i64 {
    scalar(db, "SELECT count(*) FROM switchyard_outbox").await
}

/// Rows neither published nor dead-lettered.
async fn unfinished(db: &TestDb) -> i64 {
    scalar(
        db,
        "SELECT count(*) FROM switchyard_outbox WHERE status NOT IN ('published', 'dead')",
    )
    .await
}

/// Waits (at most [`DRAIN_LIMIT`]) until no row is left to publish.
async fn drained(db: &TestDb) {
    let limit = Instant::now() + DRAIN_LIMIT;
    while unfinished(db).await > 0 && Instant::now() < limit {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The writers of `service`, shaped as a service's (several aggregates a
/// transaction, one to three events of each), until `stop`.
fn writer(
    db: &TestDb,
    service: Service,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<HashMap<String, Expected>> {
    paced_writer(
        &db.pool,
        Shape::rows(Outbox::Switchyard),
        service.aggregates(),
        service.transactions(),
        stop,
    )
}

/// The relay, of those not killed in the last turn, that holds leases,
/// the one in turn (`turn`) first.
async fn holding(db: &TestDb, relays: usize, turn: usize) -> Option<(usize, i64)> {
    for offset in 0..relays {
        let victim = (turn + offset) % relays;
        let holds: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM switchyard_outbox WHERE status = 'in_flight' AND lease_owner LIKE $1 || '%'",
        )
        .bind(format!("relay-{victim}"))
        .fetch_one(&db.pool)
        .await
        .unwrap_or(0);
        if holds > 0 {
            return Some((victim, holds));
        }
    }
    None
}

/// Three relays publish to `service` while paced writers commit at least
/// `events` events; a relay holding leases is SIGKILLed (and started
/// again) each time another share of `kills + 1` is written, then, when
/// the writing is over, as soon as one holds leases, until `kills` were
/// killed or everything is published.
pub async fn kills_run(relay_bin: &str, service: Service, events: usize, kills: usize) -> Row {
    let db = fresh_db().await;
    let mut aws = Aws::start(service, false).await;
    let config = aws.config(&db, service.kills_section());
    let mut relays: Vec<Process> = (0..3)
        .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
        .collect();
    let stop = tokio_util::sync::CancellationToken::new();
    let started = Instant::now();
    let writing = writer(&db, service, stop.clone());
    let (mut done, mut generation) = (0, 0);
    let label = service.label();
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let committed = written(&db).await;
        if !stop.is_cancelled() && committed >= events as i64 {
            stop.cancel();
            eprintln!(
                "{label}: {committed} events written in {} s",
                started.elapsed().as_secs()
            );
        }
        if stop.is_cancelled() && (done >= kills || unfinished(&db).await == 0) {
            break;
        }
        if done >= kills {
            continue;
        }
        // The next kill's share of the writing, or any time after it.
        if !stop.is_cancelled() && committed < events as i64 * (done as i64 + 1) / (kills as i64 + 1) {
            continue;
        }
        let Some((victim, holds)) = holding(&db, relays.len(), done).await else {
            continue;
        };
        relays[victim].kill();
        generation += 1;
        done += 1;
        eprintln!(
            "{label}: kill {done}: relay-{victim} held {holds} leases ({} s, {committed} written)",
            started.elapsed().as_secs()
        );
        relays[victim] = Process::spawn(relay_bin, &config, &format!("relay-{victim}-{generation}"));
    }
    stop.cancel();
    let expected = writing.await.expect("writer");
    drained(&db).await;
    let run_s = started.elapsed().as_secs_f64();
    for relay in &mut relays {
        relay.terminate();
    }
    let worst = worst(&db).await;
    let dead = dead_letters(&db).await;
    let received = aws.received(&expected).await;
    let counted = tally(&received, &expected);
    let scenario = format!("{label}: {done} SIGKILLs, 3 relays");
    eprintln!("{scenario}: {counted:?}, {dead} dead");
    Row {
        scenario,
        written: expected.len(),
        dead,
        tally: counted,
        worst_commit_to_publish_s: worst,
        first_after_return_s: None,
        backlog_at_return: None,
        drain_rate: None,
        run_s,
    }
}

/// The longest commit-to-publish of the run's rows.
async fn worst(db: &TestDb) -> f64 {
    switchyard_tests::service::ServicePool::from(&db.pool)
        .worst_commit_to_publish_s()
        .await
}

/// One relay with the relay's default `[relay]` settings publishes to
/// `service` while the paced writers go on; the service goes away
/// (`away`) for `outage` after [`AROUND`], and writing goes on for
/// [`AROUND`] after its return. With `kills`, two relays, one of them (in
/// turn) SIGKILLed that many times over the outage and the time after it.
pub async fn down_run(relay_bin: &str, service: Service, away: Away, outage: Duration, kills: usize) -> Row {
    let db = fresh_db().await;
    let mut aws = Aws::start(service, away == Away::Refused).await;
    let config = aws.config(&db, RelaySection::defaults());
    let count = if kills > 0 { 2 } else { 1 };
    let mut relays: Vec<Process> = (0..count)
        .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
        .collect();
    let stop = tokio_util::sync::CancellationToken::new();
    let started = Instant::now();
    let writing = writer(&db, service, stop.clone());
    tokio::time::sleep(AROUND).await;
    let length = if outage.as_secs().is_multiple_of(60) {
        format!("{} min", outage.as_secs() / 60)
    } else {
        format!("{} s", outage.as_secs())
    };
    let label = service.label();
    let how = match away {
        Away::Refused => "refusing connections",
        Away::Frozen => "frozen",
    };
    eprintln!("{label}: {how} for {length}");
    aws.go_away(away);
    let away_since = Instant::now();
    let every = (outage + AROUND) / u32::try_from(kills + 1).unwrap_or(u32::MAX);
    let (mut killed, mut generation) = (0, 0);
    let mut reported = Instant::now();
    let mut back = None;
    while away_since.elapsed() < outage + if kills > 0 { AROUND } else { Duration::ZERO } {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if back.is_none() && away_since.elapsed() >= outage {
            aws.come_back(away).await;
            let at: chrono::DateTime<chrono::Utc> = scalar(&db, "SELECT now()").await;
            let backlog = unfinished(&db).await;
            eprintln!("{label}: back; backlog {backlog}");
            back = Some((at, backlog));
        }
        if killed < kills && away_since.elapsed() >= every * u32::try_from(killed + 1).unwrap_or(u32::MAX) {
            let victim = killed % count;
            relays[victim].kill();
            generation += 1;
            relays[victim] = Process::spawn(relay_bin, &config, &format!("relay-{victim}-{generation}"));
            killed += 1;
            eprintln!("{label}: kill {killed} ({} s)", away_since.elapsed().as_secs());
        }
        if reported.elapsed() >= Duration::from_secs(30) {
            reported = Instant::now();
            let waiting: i64 = scalar(
                &db,
                "SELECT count(*) FROM switchyard_outbox WHERE waiting_on IS NOT NULL",
            )
            .await;
            eprintln!(
                "{label}: {} s, {waiting} rows waiting on it, {} dead",
                away_since.elapsed().as_secs(),
                dead_letters(&db).await
            );
        }
    }
    let (back, backlog) = match back {
        Some(back) => back,
        None => {
            aws.come_back(away).await;
            let at: chrono::DateTime<chrono::Utc> = scalar(&db, "SELECT now()").await;
            let backlog = unfinished(&db).await;
            eprintln!("{label}: back; backlog {backlog}");
            (at, backlog)
        }
    };
    tokio::time::sleep(AROUND).await;
    stop.cancel();
    let expected = writing.await.expect("writer");
    drained(&db).await;
    let run_s = started.elapsed().as_secs_f64();
    for relay in &mut relays {
        relay.terminate();
    }
    let dead = dead_letters(&db).await;
    let worst = worst(&db).await;
    // Only rows written before the return and published after it: the
    // backlog's drain.
    let (first, drained_rows, drain_s): (Option<f64>, i64, Option<f64>) = sqlx::query_as(
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
    let received = aws.received(&expected).await;
    let counted = tally(&received, &expected);
    let kills = if kills > 0 {
        format!(", 2 relays, {kills} SIGKILLs")
    } else {
        String::new()
    };
    let scenario = format!("{label} {how} {length}{kills}");
    eprintln!("{scenario}: {counted:?}, {dead} dead");
    Row {
        scenario,
        written: expected.len(),
        dead,
        tally: counted,
        worst_commit_to_publish_s: worst,
        first_after_return_s: first,
        backlog_at_return: Some(backlog),
        drain_rate: drain_s.filter(|s| *s > 0.0).map(|s| drained_rows as f64 / s),
        run_s,
    }
}

/// Prints the runs as a Markdown table.
pub fn print(rows: &[Row]) {
    println!();
    println!(
        "| scenario | written | received | dead-lettered | lost | duplicates | reordered | worst commit-to-publish | first delivery after return | backlog at return | drain rate after return | run |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for row in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} s | {} | {} | {} | {:.0} s |",
            row.scenario,
            row.written,
            row.tally.received,
            row.dead,
            row.tally.lost,
            row.tally.duplicates,
            row.tally.reordered,
            row.worst_commit_to_publish_s,
            row.first_after_return_s
                .map_or("-".into(), |s| format!("{s:.2} s")),
            row.backlog_at_return.map_or("-".into(), |b| b.to_string()),
            row.drain_rate.map_or("-".into(), |r| format!("{r:.0} events/s")),
            row.run_s,
        );
    }
}
