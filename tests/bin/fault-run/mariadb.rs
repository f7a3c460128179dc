//! The fault runs on a MariaDB outbox, in claim mode or binlog mode:
//! relays SIGKILLed while they hold leases (claim) or read the binary log
//! (binlog), NATS down for minutes, MariaDB restarted, each under writers
//! shaped as a service's (several aggregates per transaction, one to three
//! events of each), counted by the consumer as the PostgreSQL runs are.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::Expected;
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::postgres::Outbox;
use switchyard_tests::relay::Process;
use switchyard_tests::service::ServicePool;
use switchyard_tests::workload::{Shape, deleting_asked, paced_writer, write_events};

use super::{Row, STREAM, aggregates, published, settings};

/// Transactions a second of the paced writers (about 3.5 aggregates of
/// two events each: some 700 events a second).
const TRANSACTIONS: u64 = 100;

/// How the relays take events from MariaDB.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Claim,
    Binlog,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Claim => "claim",
            Mode::Binlog => "binlog",
        }
    }
}

/// [`super::finish`], the scenario named as MariaDB's. In binlog mode a
/// published event's row stays `streamed`: the consumer's stream and the
/// rows left unfinished in the table say when it is done.
async fn finish(
    mode: Mode,
    scenario: String,
    pool: &ServicePool,
    nats: &NatsServer,
    expected: &HashMap<String, Expected>,
    started: Instant,
) -> Row {
    let scenario = format!("MariaDB {}: {scenario}", mode.name());
    if mode == Mode::Claim {
        return super::finish(scenario, pool, nats, expected, started).await;
    }
    let total = expected.len() as u64;
    let limit = Instant::now() + Duration::from_secs(900);
    let unfinished = "SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')";
    while (nats.stream_len(STREAM).await < total || pool.scalar(unfinished).await > 0)
        && Instant::now() < limit
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drain_s = started.elapsed().as_secs_f64();
    let dead = pool.count_status("dead").await;
    let counted = switchyard_tests::orders::tally(&nats.read_stream(STREAM).await, expected);
    eprintln!("{scenario}: {counted:?}, {dead} dead");
    Row::counted(scenario, expected.len(), counted, f64::NAN, drain_s)
}

/// The writers' shape: a service's, each event deleted as it is written
/// in binlog mode when the run asks for it (claim mode would never see a
/// deleted event).
fn writers_shape(mode: Mode) -> Shape {
    let shape = Shape::rows(Outbox::Switchyard);
    if mode == Mode::Binlog && deleting_asked() {
        shape.deleting()
    } else {
        shape
    }
}

/// The config of `mode` for `db`, the database set up for it.
async fn config_for(relay_bin: &str, mode: Mode, db_url: &str, nats: &NatsServer) -> String {
    let config = settings(db_url, &nats.url());
    let config = match mode {
        Mode::Claim => config,
        Mode::Binlog => config.set("relay", "mode", "replication"),
    }
    .toml();
    super::replication::migrate(relay_bin, &config).await;
    config
}

/// The relay process reading the binary log: the client port of the
/// database's binlog dump session, and the process holding it.
async fn binlog_reader(pool: &ServicePool, relays: &[Process]) -> Option<usize> {
    let host = pool
        .text("SELECT host FROM information_schema.processlist WHERE command LIKE 'Binlog Dump%' AND db = DATABASE()")
        .await?;
    let port = host.rsplit_once(':')?.1.to_string();
    let out = std::process::Command::new("ss")
        .args(["-Htnp", "state", "established", &format!("( sport = :{port} )")])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let pid: u32 = text.split("pid=").nth(1)?.split(',').next()?.parse().ok()?;
    relays.iter().position(|relay| relay.pid() == pid)
}

async fn stream() -> NatsServer {
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    nats
}

/// Three relays drain `events` written while they run; one at a time is
/// SIGKILLed while it holds leases, and started again, `kills` times.
pub async fn kills_run(relay_bin: &str, mode: Mode, events: usize, kills: usize) -> Row {
    let db = TestOutbox::mariadb().await;
    let pool = db.service_pool();
    let nats = stream().await;
    let config = config_for(relay_bin, mode, &db.url, &nats).await;
    let mut relays: Vec<Process> = (0..3)
        .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
        .collect();
    let started = Instant::now();
    let writer = tokio::spawn({
        let pool = pool.clone();
        async move { write_events(&pool, writers_shape(mode), aggregates(), events, 8, 5).await }
    });
    let (mut done, mut generation) = (0, 0);
    while done < kills && mode == Mode::Binlog {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        if writer.is_finished() {
            break;
        }
        let Some(victim) = binlog_reader(&pool, &relays).await else {
            continue;
        };
        relays[victim].kill();
        generation += 1;
        done += 1;
        eprintln!("kill {done}: relay {victim}, the binary log's reader");
        relays[victim] = Process::spawn(relay_bin, &config, &format!("relay-{victim}-{generation}"));
    }
    while done < kills && mode == Mode::Claim {
        let victim = done % relays.len();
        let owner = format!("relay-{victim}");
        let holds = pool
            .scalar(&format!(
                "SELECT count(*) FROM switchyard_outbox WHERE status = 'in_flight' AND lease_owner LIKE '{owner}%'"
            ))
            .await;
        if holds == 0 {
            if writer.is_finished() && published(&pool).await >= events as i64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        relays[victim].kill();
        generation += 1;
        eprintln!("kill {}: {owner} held {holds} leases", done + 1);
        relays[victim] = Process::spawn(relay_bin, &config, &format!("{owner}-{generation}"));
        done += 1;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let expected = writer.await.expect("writer");
    let row = finish(
        mode,
        if writers_shape(mode).deleted {
            format!("{done} SIGKILLs, 3 relays, events deleted as written")
        } else {
            format!("{done} SIGKILLs, 3 relays")
        },
        &pool,
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

/// A MariaDB outbox, a stream, `relays` relay processes on it and writers
/// at [`TRANSACTIONS`] a second until the returned token is cancelled.
struct Paced {
    mode: Mode,
    /// The writers delete each event as they write it.
    deleting: bool,
    db: TestOutbox,
    pool: ServicePool,
    nats: NatsServer,
    relays: Vec<Process>,
    stop: tokio_util::sync::CancellationToken,
    writer: tokio::task::JoinHandle<HashMap<String, Expected>>,
    started: Instant,
}

impl Paced {
    async fn start(relay_bin: &str, mode: Mode, relays: usize) -> Paced {
        let db = TestOutbox::mariadb().await;
        let pool = db.service_pool();
        let nats = stream().await;
        let config = config_for(relay_bin, mode, &db.url, &nats).await;
        let relays = (0..relays)
            .map(|n| Process::spawn(relay_bin, &config, &format!("relay-{n}")))
            .collect();
        let stop = tokio_util::sync::CancellationToken::new();
        let shape = writers_shape(mode);
        let writer = paced_writer(&pool, shape, aggregates(), TRANSACTIONS, stop.clone());
        Paced {
            mode,
            deleting: shape.deleted,
            db,
            pool,
            nats,
            relays,
            stop,
            writer,
            started: Instant::now(),
        }
    }

    /// Stops the writers, waits for every event and counts.
    async fn finish(mut self, scenario: String) -> Row {
        self.stop.cancel();
        let expected = self.writer.await.expect("writer");
        let scenario = if self.deleting {
            format!("{scenario}, events deleted as written")
        } else {
            scenario
        };
        let row = finish(
            self.mode,
            scenario,
            &self.pool,
            &self.nats,
            &expected,
            self.started,
        )
        .await;
        for relay in &mut self.relays {
            relay.terminate();
        }
        drop(self.db);
        row
    }
}

/// Two relays, writers at [`TRANSACTIONS`] a second; NATS stopped for
/// `outage` after 30 s and started again with its store, writing going on
/// 30 s after its return.
pub async fn broker_down_run(relay_bin: &str, mode: Mode, outage: Duration) -> Row {
    let mut run = Paced::start(relay_bin, mode, 2).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    let before = run.nats.stream_len(STREAM).await;
    run.nats.stop();
    eprintln!("NATS down at {before} in the stream");
    tokio::time::sleep(outage).await;
    let waiting = run
        .pool
        .scalar("SELECT count(*) FROM switchyard_outbox WHERE waiting_on IS NOT NULL AND status = 'pending'")
        .await;
    run.nats.resume().await;
    eprintln!("NATS back; {waiting} rows waiting on it");
    tokio::time::sleep(Duration::from_secs(30)).await;
    run.finish(format!(
        "NATS down {} s, 2 relays, writers going on",
        outage.as_secs()
    ))
    .await
}

/// Stops the project's MariaDB (SIGTERM: a clean shutdown that cuts every
/// session) and starts it again through the services script.
fn restart_mariadb() {
    let state = std::env::var("SWITCHYARD_STATE_DIR").unwrap_or_else(|_| "/tmp/switchyard-services".into());
    let pid_file = format!("{state}/mariadb/mariadb.pid");
    let pid = std::fs::read_to_string(&pid_file).expect("MariaDB's pid file");
    let pid = pid.trim().to_string();
    let _ = std::process::Command::new("kill").arg(&pid).status();
    let gone = Instant::now() + Duration::from_secs(60);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < gone {
        std::thread::sleep(Duration::from_millis(100));
    }
    let script = switchyard_tests::workspace_root().join("scripts/services.sh");
    let status = std::process::Command::new(script)
        .arg("start")
        .stdout(std::process::Stdio::null())
        .status()
        .expect("scripts/services.sh start");
    assert!(status.success(), "MariaDB did not start again");
}

/// Two relays, writers at [`TRANSACTIONS`] a second (a transaction the
/// server drops is written again); MariaDB restarted `restarts` times,
/// 20 s apart.
pub async fn restart_run(relay_bin: &str, mode: Mode, restarts: usize) -> Row {
    let run = Paced::start(relay_bin, mode, 2).await;
    for round in 1..=restarts {
        tokio::time::sleep(Duration::from_secs(20)).await;
        let at = Instant::now();
        tokio::task::spawn_blocking(restart_mariadb)
            .await
            .expect("restart");
        eprintln!(
            "MariaDB restarted ({round}), down {:.1} s, {} in the stream",
            at.elapsed().as_secs_f64(),
            run.nats.stream_len(STREAM).await
        );
    }
    tokio::time::sleep(Duration::from_secs(20)).await;
    run.finish(format!(
        "MariaDB restarted {restarts} times under writers, 2 relays"
    ))
    .await
}
