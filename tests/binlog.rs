//! Binlog mode on a real MariaDB: events read from the binary log reach
//! NATS in order with no row update; a broker outage hands them to the
//! table without spending attempts; a killed reader's standby takes the
//! position over and nothing is lost; what keeps the mode from working is
//! named with what to do, at start and, by `/readyz`, while it runs.

use std::time::Duration;

use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::verify;
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::postgres::{Outbox, count_status};
use switchyard_tests::relay::{InProcess, Process, Settings, example, parse};
use switchyard_tests::workload::{Dice, Shape, plan, write_events};
use switchyard_tests::{cli, eventually, init_logging};

const STREAM: &str = "ORDERS";
const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");

/// A MariaDB outbox, a nats-server with the orders stream, and the example
/// pipeline in replication mode on it (with these `[relay]` keys).
async fn binlog_setup(relay: &[(&str, &str)]) -> (TestOutbox, NatsServer, String) {
    init_logging();
    let db = TestOutbox::mariadb().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let settings = relay.iter().fold(
        Settings::new(&db.url, &nats.url()).relay("mode", "\"replication\""),
        |settings, (key, value)| settings.relay(key, value),
    );
    let config = example(&settings).toml();
    (db, nats, config)
}

/// Runs `switchyard` with `args` and `--config` set to `config`.
async fn run_with_config(args: &[&str], config: &str) -> (i32, String, String) {
    let path = std::env::temp_dir().join(format!("sy-binlog-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).unwrap();
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--config", path.to_str().unwrap()]);
    let ran = cli(SWITCHYARD, &all, &[]).await;
    let _ = std::fs::remove_file(&path);
    ran
}

async fn migrated(relay: &[(&str, &str)]) -> (TestOutbox, NatsServer, String) {
    let (db, nats, config) = binlog_setup(relay).await;
    let (code, out, err) = run_with_config(&["migrate"], &config).await;
    assert_eq!(code, 0, "migrate: {out}{err}");
    assert!(
        out.contains("binlog mode: rows are written for the binary log reader"),
        "{out}"
    );
    (db, nats, config)
}

async fn stream_holds(nats: &NatsServer, count: u64, what: &str, seconds: u64) {
    eventually(what, Duration::from_secs(seconds), || async {
        (nats.stream_len(STREAM).await >= count).then_some(())
    })
    .await;
}

/// Every expected event is in the stream once, in order per aggregate.
async fn each_once(
    nats: &NatsServer,
    expected: &std::collections::HashMap<String, switchyard_tests::orders::Expected>,
) {
    let verdict = verify(&nats.read_stream(STREAM).await, expected);
    assert_eq!(
        (verdict.distinct, verdict.duplicates),
        (expected.len(), 0),
        "{verdict:?}"
    );
}

async fn recorded_position(db: &TestOutbox) -> String {
    sqlx::query_scalar("SELECT gtid_position FROM switchyard_binlog_positions WHERE name = 'switchyard'")
        .fetch_one(&db.mysql_pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_come_from_the_binlog_in_order_and_their_rows_are_never_updated() {
    let (db, nats, config) = migrated(&[]).await;
    let start = recorded_position(&db).await;
    let relay = InProcess::start(&parse(&config)).await;
    // As a service writes: several aggregates per transaction, one to
    // three events of each, beside its own `orders` rows.
    let expected = write_events(
        db.service_pool(),
        Shape::rows(Outbox::Switchyard),
        40,
        1500,
        2,
        31,
    )
    .await;
    stream_holds(&nats, expected.len() as u64, "every event in the stream", 60).await;
    each_once(&nats, &expected).await;
    let untouched: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM switchyard_outbox
          WHERE status = 'streamed' AND attempts = 0 AND lease_owner IS NULL AND published_at IS NOT NULL",
    )
    .fetch_one(&db.mysql_pool())
    .await
    .unwrap();
    assert_eq!(
        untouched,
        expected.len() as i64,
        "a published event's row is not written by the relay"
    );
    eventually(
        "the position recorded past the events",
        Duration::from_secs(10),
        || async { (recorded_position(&db).await != start).then_some(()) },
    )
    .await;
    relay.stop().await;
}

/// The session holding a position's lock (the reader), if one does.
async fn reader_session(db: &TestOutbox) -> Option<i64> {
    sqlx::query_scalar("SELECT IS_USED_LOCK(concat('switchyard.binlog.', DATABASE(), '.switchyard'))")
        .fetch_one(&db.mysql_pool())
        .await
        .unwrap()
}

/// With nothing written the server sends heartbeats; the reader, which
/// takes 5 s of silence for a dead session, keeps its session through 12 s
/// of quiet and relays the next commit at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_binary_log_keeps_its_reader() {
    let (db, nats, config) = migrated(&[]).await;
    let relay = InProcess::start(&parse(&config)).await;
    let session = eventually(
        "the relay reads the binary log",
        Duration::from_secs(30),
        || async { reader_session(&db).await },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        reader_session(&db).await,
        Some(session),
        "the reading session was opened again"
    );
    let expected = write_events(db.service_pool(), Shape::rows(Outbox::Switchyard), 5, 10, 1, 37).await;
    stream_holds(&nats, expected.len() as u64, "the events after the quiet", 5).await;
    relay.stop().await;
}

/// A relay stopped cleanly records where it got to; a backlog written
/// while none runs is read from there, whole and once, when one starts
/// (the catch-up reads batches back to back, while the lanes report: a
/// batch half-read when the feed turns to a report must not be dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_written_while_no_relay_runs_is_read_from_the_recorded_position() {
    let (db, nats, config) = migrated(&[]).await;
    // Other databases' transactions move the position while one runs.
    let relay = InProcess::start(&parse(&config)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    relay.stop().await;
    let stopped_at = recorded_position(&db).await;
    let expected = write_events(
        db.service_pool(),
        Shape::rows(Outbox::Switchyard),
        100,
        3000,
        2,
        35,
    )
    .await;
    assert_eq!(
        recorded_position(&db).await,
        stopped_at,
        "nothing reads while no relay runs"
    );
    let relay = InProcess::start(&parse(&config)).await;
    stream_holds(&nats, expected.len() as u64, "the backlog", 90).await;
    relay.stop().await;
    each_once(&nats, &expected).await;
}

/// The body of PostgreSQL's replication-mode outage test, on MariaDB in
/// binlog mode, with a 10 s outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_in_binlog_mode_dead_letters_nothing_and_keeps_order() {
    // Two attempts: an outage charged to the events would dead-letter them.
    let (db, mut nats, config) = migrated(&[("max_attempts", "2"), ("publish_timeout_ms", "1000")]).await;
    let shape = Shape::rows(Outbox::Switchyard);
    crate::replication::broker_outage_in_replication_mode(
        db.service_pool(),
        &mut nats,
        &config,
        shape,
        Duration::from_secs(10),
    )
    .await;
}

/// A relay started while its broker is down reads the binary log all the
/// same: the events wait in the table without spending attempts (two
/// allowed, a 1 s publish timeout), and arrive once and in order when the
/// broker comes, longer after than the publish timeout and the backoffs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_started_while_the_broker_is_down_relays_everything_when_it_comes() {
    let (db, mut nats, config) = migrated(&[("max_attempts", "2"), ("publish_timeout_ms", "1000")]).await;
    nats.stop();
    let relay = InProcess::start(&parse(&config)).await;
    let expected = write_events(db.service_pool(), Shape::rows(Outbox::Switchyard), 20, 400, 2, 38).await;
    let pool = db.service_pool();
    eventually(
        "the events wait in the table",
        Duration::from_secs(30),
        || async {
            (pool
                .scalar("SELECT count(*) FROM switchyard_outbox WHERE status = 'pending'")
                .await
                > 0)
            .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    nats.resume().await;
    stream_holds(
        &nats,
        expected.len() as u64,
        "every event after the broker came",
        60,
    )
    .await;
    relay.stop().await;
    each_once(&nats, &expected).await;
    assert_eq!(count_status(db.service_pool(), "dead").await, 0);
}

/// Services that delete their event in the transaction that wrote it (the
/// table stays empty; the log has the insert), while NATS is down: every
/// event must wait in the table, so the relay writes each back from the
/// log's values, and all arrive in order once NATS is back. Eight services
/// write at once, and none of their transactions may fail: writing an
/// event id back checks the service's delete-marked entry under next-key
/// locks, and a batch holding those made InnoDB roll services back as
/// deadlock victims about once in every 3,000 transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_deleted_as_they_are_written_are_written_back_when_they_must_wait() {
    const WRITERS: usize = 8;
    let (db, mut nats, config) = migrated(&[("max_attempts", "2"), ("publish_timeout_ms", "1000")]).await;
    let relay = InProcess::start(&parse(&config)).await;
    nats.stop();
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let pool = db.service_pool();
            tokio::spawn(async move {
                let (mut written, mut next_seq, mut dice) = (
                    Vec::new(),
                    std::collections::HashMap::new(),
                    Dice::new(36 + writer as u64),
                );
                for _ in 0..300 {
                    let plan = plan(&mut dice, Shape::rows(Outbox::Switchyard), 12, writer, WRITERS);
                    let events = pool
                        .write_deleted(&plan, &mut next_seq)
                        .await
                        .unwrap_or_else(|e| panic!("the service's transaction: {e}"));
                    written.extend(events);
                }
                written
            })
        })
        .collect();
    let mut expected = std::collections::HashMap::new();
    for writer in writers {
        expected.extend(writer.await.unwrap());
    }
    let total = expected.len() as i64;
    let pool = db.mysql_pool();
    eventually(
        "every event written back for the claim path",
        Duration::from_secs(120),
        || async {
            let back: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM switchyard_outbox")
                .fetch_one(&pool)
                .await
                .unwrap();
            (back == total).then_some(())
        },
    )
    .await;
    nats.resume().await;
    stream_holds(&nats, expected.len() as u64, "every event in the stream", 90).await;
    relay.stop().await;
    each_once(&nats, &expected).await;
    assert_eq!(count_status(db.service_pool(), "dead").await, 0);
}

/// Two relay processes on one position while events are written; the one
/// reading is SIGKILLed mid-stream, and the standby must take the position
/// over and finish with every event in the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_binlog_reader_is_replaced_by_its_standby_and_nothing_is_lost() {
    let (db, nats, config) = migrated(&[]).await;
    let reader = || async {
        let holder: Option<i64> = sqlx::query_scalar(
            "SELECT IS_USED_LOCK(concat('switchyard.binlog.', DATABASE(), '.switchyard'))",
        )
        .fetch_one(&db.mysql_pool())
        .await
        .unwrap();
        holder
    };
    let mut first = Process::spawn(SWITCHYARD, &config, "first");
    eventually(
        "the first relay reads the binary log",
        Duration::from_secs(60),
        || async { reader().await.map(|_| ()) },
    )
    .await;
    let first_session = reader().await;
    let mut second = Process::spawn(SWITCHYARD, &config, "second");
    let writer = {
        let pool = db.service_pool();
        tokio::spawn(
            async move { write_events(pool, Shape::rows(Outbox::Switchyard), 100, 3000, 2, 33).await },
        )
    };
    stream_holds(&nats, 300, "some events through", 60).await;
    first.kill();
    eventually(
        "the standby reads the binary log",
        Duration::from_secs(30),
        || async { reader().await.filter(|s| Some(*s) != first_session).map(|_| ()) },
    )
    .await;
    let expected = writer.await.unwrap();
    stream_holds(&nats, expected.len() as u64, "every event in the stream", 120).await;
    second.terminate();
    // JetStream absorbs what the killed reader published but had not confirmed.
    each_once(&nats, &expected).await;
}

/// `validate` names each thing that keeps binlog mode from working: the
/// position not recorded (no `migrate`), a claim-mode table, an account
/// without REPLICATION SLAVE; a claim-mode relay on a binlog-mode table is
/// refused with what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_keeps_binlog_mode_from_working_is_named_with_what_to_do() {
    let (db, nats, config) = binlog_setup(&[]).await;
    let (code, out, err) = run_with_config(&["validate"], &config).await;
    assert_ne!(code, 0, "{out}{err}");
    let said = format!("{out}{err}");
    assert!(
        said.contains("no binlog position named \"switchyard\" is recorded: run `switchyard migrate`"),
        "{said}"
    );
    assert!(said.contains("set up for claim mode"), "{said}");

    // An account that may use the database but not read the binary log.
    let user = format!("sy_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let database = db.url.rsplit('/').next().unwrap().to_string();
    for statement in [
        format!("CREATE USER '{user}'@'127.0.0.1'"),
        format!("GRANT ALL PRIVILEGES ON `{database}`.* TO '{user}'@'127.0.0.1'"),
    ] {
        sqlx::query(&statement).execute(&db.mysql_pool()).await.unwrap();
    }
    let (code, out, err) = run_with_config(&["migrate"], &config).await;
    assert_eq!(code, 0, "{out}{err}");
    let limited = config.replace("switchyard@127.0.0.1", &format!("{user}@127.0.0.1"));
    assert_ne!(limited, config);
    let (code, out, err) = run_with_config(&["validate"], &limited).await;
    let said = format!("{out}{err}");
    sqlx::query(&format!("DROP USER '{user}'@'127.0.0.1'"))
        .execute(&db.mysql_pool())
        .await
        .unwrap();
    assert_ne!(code, 0, "{said}");
    assert!(said.contains("lacks REPLICATION SLAVE"), "{said}");
    assert!(!said.contains("is recorded"), "{said}");

    let claim = config.replace("mode = \"replication\"", "mode = \"claim\"");
    let (code, out, err) = run_with_config(&["validate"], &claim).await;
    let said = format!("{out}{err}");
    assert_ne!(code, 0, "{said}");
    assert!(said.contains("set up for binlog mode"), "{said}");
    drop(nats);
}

/// `/readyz` asks the database which mode it is set up for now, not only
/// at start: a `migrate` to claim mode under a running binlog-mode relay
/// makes it unready, naming the mismatch and what to do; switched back,
/// it is ready again, and what was written meanwhile is relayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_switched_to_claim_mode_under_a_binlog_relay_makes_it_unready() {
    let (db, nats, config) = migrated(&[]).await;
    let (with_admin, admin) = switchyard_tests::with_admin(&config);
    let mut relay = Process::spawn(SWITCHYARD, &with_admin, "binlog-readyz");
    switchyard_tests::readyz_answers(admin, 200).await;

    let claim = config.replace("mode = \"replication\"", "mode = \"claim\"");
    assert_ne!(claim, config);
    let (code, out, err) = run_with_config(&["migrate"], &claim).await;
    assert_eq!(code, 0, "migrate to claim mode: {out}{err}");
    let said =
        switchyard_tests::readyz_unready(admin, &["set up for claim mode", "switchyard migrate"]).await;
    assert!(said.contains("mode_mismatch"), "{said}");
    assert!(!relay.has_exited(), "the relay stays up, not ready");

    let (code, out, err) = run_with_config(&["migrate"], &config).await;
    assert_eq!(code, 0, "migrate back to binlog mode: {out}{err}");
    switchyard_tests::readyz_answers(admin, 200).await;
    let expected = write_events(db.service_pool(), Shape::rows(Outbox::Switchyard), 8, 60, 2, 41).await;
    stream_holds(
        &nats,
        expected.len() as u64,
        "events written after the switch back",
        60,
    )
    .await;
    each_once(&nats, &expected).await;
    assert!(!relay.has_exited());
    relay.terminate();
}
