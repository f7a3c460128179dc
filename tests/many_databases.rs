//! One relay serving many outbox databases: 20 PostgreSQL databases and 5
//! SQLite files behind one process, one database stopped mid-run and
//! another given a poison row, databases added and removed while it runs;
//! a connection budget per server and idle polls; relays sharing databases
//! out, one killed, one database down for longer than the ownership lease,
//! one relay cut off from its database by the network.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use sqlx::Executor;
use switchyard::fleet::{DatabaseState, Fleet};
use switchyard_tests::config::TestConfig;
use switchyard_tests::fleet;
use switchyard_tests::nats::{NatsServer, Received};
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::postgres::{TestDb, fresh_db, fresh_db_before, server_pool};
use switchyard_tests::relay::{RelaySection, parse};
use switchyard_tests::stall::StallingProxy;
use switchyard_tests::{cli, eventually, exclusive, init_logging};
use tokio_util::sync::CancellationToken;

const STREAM: &str = "ORDERS";
const AGGREGATES: usize = 8;

/// The outbox databases under test, written the same way whatever their kind.
enum Outbox {
    Postgres(TestDb),
    Sqlite(TestOutbox),
}

struct Database {
    name: String,
    outbox: Outbox,
}

impl Database {
    fn url(&self) -> String {
        match &self.outbox {
            Outbox::Postgres(db) => db.url.clone(),
            Outbox::Sqlite(outbox) => format!("sqlite://{}", outbox.sqlite_path().display()),
        }
    }

    /// Writes event `seq` of each of this database's aggregates, each in
    /// its own transaction.
    async fn write(&self, seq: usize) {
        for aggregate in 0..AGGREGATES {
            self.insert(&format!("{}-{aggregate}", self.name), "OrderUpdated", seq)
                .await;
        }
    }

    async fn insert(&self, aggregate_id: &str, event_type: &str, seq: usize) {
        let payload = serde_json::json!({ "seq": seq, "aggregate": aggregate_id });
        match &self.outbox {
            Outbox::Postgres(db) => {
                sqlx::query(
                    "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', $1, $2, $3)",
                )
                .bind(aggregate_id)
                .bind(event_type)
                .bind(&payload)
                .execute(&db.pool)
                .await
                .expect("insert");
            }
            Outbox::Sqlite(outbox) => {
                sqlx::query(
                    "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', ?1, ?2, ?3)",
                )
                .bind(aggregate_id)
                .bind(event_type)
                .bind(payload.to_string())
                .execute(&outbox.sqlite_pool())
                .await
                .expect("insert");
            }
        }
    }
}

/// A NATS server with the stream every test's events go to.
async fn nats() -> NatsServer {
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    nats
}

async fn databases(postgres: usize, sqlite: usize) -> Vec<Database> {
    let pg = futures::future::join_all((0..postgres).map(|_| fresh_db())).await;
    let mut all: Vec<Database> = pg
        .into_iter()
        .enumerate()
        .map(|(i, db)| Database {
            name: format!("pg{i:02}"),
            outbox: Outbox::Postgres(db),
        })
        .collect();
    for i in 0..sqlite {
        all.push(Database {
            name: format!("lite{i}"),
            outbox: Outbox::Sqlite(TestOutbox::sqlite().await),
        });
    }
    all
}

/// The test's databases behind one relay (see [`fleet::fleet`]).
fn config(databases: &[&Database], nats: &str) -> TestConfig {
    let listed: Vec<(String, String)> = databases.iter().map(|db| (db.name.clone(), db.url())).collect();
    let relay = RelaySection::new()
        .set("concurrency", "2")
        .set("max_attempts", "3")
        .set("initial_backoff_ms", "50")
        .set("max_backoff_ms", "200")
        .set("shutdown_timeout_ms", "5000");
    fleet::fleet(&listed, nats, &relay)
}

/// Waits until every listed database is served.
async fn all_running(fleet: &Fleet, count: usize) {
    eventually("every database is served", Duration::from_secs(60), || async {
        let states = fleet.databases();
        (states.len() == count && states.values().all(|s| matches!(s, DatabaseState::Running(_))))
            .then_some(())
    })
    .await;
}

/// Per aggregate, the sequence numbers received (first copies, in order).
fn sequences(received: &[Received]) -> BTreeMap<String, Vec<u64>> {
    let mut seen = HashSet::new();
    let mut by_aggregate: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for message in received {
        let id = message
            .header("Switchyard-Event-Id")
            .expect("event id")
            .to_string();
        if !seen.insert(id) {
            continue;
        }
        let json = message.json();
        let aggregate = json["aggregate"].as_str().expect("aggregate").to_string();
        // The plugin names the database it was told the event came from.
        let database = aggregate.split('-').next().expect("database prefix");
        assert_eq!(message.subject, format!("orders.{database}.{aggregate}"));
        by_aggregate
            .entry(aggregate)
            .or_default()
            .push(json["seq"].as_u64().expect("seq"));
    }
    by_aggregate
}

/// Waits for `events` events of every aggregate of every database, then
/// checks that each came once, in order.
async fn every_event_in_order(nats: &NatsServer, databases: &[Database], events: u64) {
    let total = databases.len() * AGGREGATES * usize::try_from(events).expect("events");
    eventually("every event arrives", Duration::from_secs(90), || async {
        (nats.stream_len(STREAM).await as usize >= total).then_some(())
    })
    .await;
    let sequences = sequences(&nats.read_stream(STREAM).await);
    let want: Vec<u64> = (0..events).collect();
    for db in databases {
        for aggregate in 0..AGGREGATES {
            let key = format!("{}-{aggregate}", db.name);
            assert_eq!(sequences.get(&key), Some(&want), "{key}: every event, in order");
        }
    }
}

/// `database`'s `switchyard_commit_to_publish_seconds` buckets: each
/// bound (`le`) and how many events were within it, `+Inf` last.
fn latency(metrics: &str, database: &str) -> Vec<(String, u64)> {
    let labels = format!(",database=\"{database}\"}} ");
    metrics
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("switchyard_commit_to_publish_seconds_bucket{le=\"")?;
            let (bound, rest) = rest.split_once('"')?;
            let count = rest.strip_prefix(&labels)?.trim().parse().ok()?;
            Some((bound.to_string(), count))
        })
        .collect()
}

/// How many commit-to-publish observations `database` has.
fn latency_count(metrics: &str, database: &str) -> u64 {
    latency(metrics, database).last().map_or(0, |(_, count)| *count)
}

async fn set_connections(name: &str, allowed: bool) {
    let admin = server_pool().await;
    admin
        .execute(format!("ALTER DATABASE {name} WITH ALLOW_CONNECTIONS {allowed}").as_str())
        .await
        .expect("alter database");
    if !allowed {
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
            .bind(name)
            .execute(&admin)
            .await
            .expect("terminate sessions");
    }
}

/// "Holds back only itself" is asserted without a clock: every other
/// database's events are all published while pg05 is still down (it comes
/// back only after) and while pg03's poison, tried and failed, is still
/// short of its third and last attempt, 15 s or more after its first (two
/// backoffs of 7.5 to 15 s). A fault that held the others back until it
/// cleared shows as a poison dead by then, or a wait that runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_serves_25_databases_and_a_failing_one_holds_back_only_itself() {
    let _heavy = exclusive().await;
    init_logging();
    let nats = nats().await;
    let databases = databases(20, 5).await;
    let all: Vec<&Database> = databases.iter().collect();
    let shutdown = CancellationToken::new();
    let config = config(&all, &nats.url())
        .relay("initial_backoff_ms", 15_000)
        .relay("max_backoff_ms", 15_000);
    let fleet = Fleet::start(config.parse(), shutdown.clone())
        .await
        .expect("fleet starts");
    all_running(&fleet, 25).await;

    // Three events per aggregate everywhere, then a poison event in pg03.
    for seq in 0..3 {
        futures::future::join_all(databases.iter().map(|db| db.write(seq))).await;
    }
    let poisoned = &databases[3];
    poisoned.insert("pg03-poison", "Poison", 0).await;
    let poison_written = Instant::now();
    let stopped = &databases[5];
    let Outbox::Postgres(stopped_db) = &stopped.outbox else {
        unreachable!("pg05 is PostgreSQL")
    };
    // pg05 goes away with rows of its own still to relay.
    stopped.write(3).await;
    set_connections(&stopped_db.name, false).await;
    for seq in 3..6 {
        futures::future::join_all(
            databases
                .iter()
                .filter(|db| db.name != stopped.name)
                .map(|db| db.write(seq)),
        )
        .await;
    }
    let others = (databases.len() - 1) * AGGREGATES * 6;
    eventually(
        "the other databases publish everything",
        Duration::from_secs(90),
        || async {
            let stored = nats.stream_len(STREAM).await;
            (stored as usize >= others).then_some(())
        },
    )
    .await;
    eprintln!(
        "every other database's events published {:?} after the poison was written",
        poison_written.elapsed()
    );
    let Outbox::Postgres(poisoned_db) = &poisoned.outbox else {
        unreachable!("pg03 is PostgreSQL")
    };
    let (status, attempts): (String, i32) =
        sqlx::query_as("SELECT status, attempts FROM switchyard_outbox WHERE aggregate_id = 'pg03-poison'")
            .fetch_one(&poisoned_db.pool)
            .await
            .expect("the poison row");
    assert!(
        status != "dead" && attempts >= 1,
        "the poison, tried, waits for its next attempt: {status}, {attempts} attempts"
    );
    let readiness = eventually("readiness says degraded", Duration::from_secs(30), || async {
        let readiness = switchyard::fleet::admin::readiness(&fleet).await;
        (readiness.state == "degraded" && readiness.databases.values().filter(|db| db.ready).count() == 24)
            .then_some(readiness)
    })
    .await;
    assert!(readiness.ready, "degraded still serves: {readiness:?}");
    assert!(!readiness.databases["pg05"].ready, "{readiness:?}");

    // The other databases' commit-to-publish times, for the log. A batch
    // is counted once its outcomes are recorded, just after its messages
    // reach the stream.
    let healthy: Vec<&Database> = databases.iter().filter(|db| db.name != stopped.name).collect();
    let metrics = eventually("every publish is counted", Duration::from_secs(30), || async {
        let metrics = fleet.metrics().render();
        healthy
            .iter()
            .all(|db| latency_count(&metrics, &db.name) >= (AGGREGATES * 6) as u64)
            .then_some(metrics)
    })
    .await;
    let mut all_within: BTreeMap<String, u64> = BTreeMap::new();
    for db in &healthy {
        for (bound, count) in latency(&metrics, &db.name) {
            *all_within.entry(bound).or_default() += count;
        }
    }
    let mut buckets: Vec<(f64, u64)> = all_within
        .into_iter()
        .map(|(bound, count)| (bound.parse().unwrap_or(f64::INFINITY), count))
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    eprintln!(
        "commit to publish, {} databases while pg05 was down and pg03 poisoned (le s: events within): {buckets:?}",
        healthy.len()
    );

    // pg05 comes back and relays what it kept.
    set_connections(&stopped_db.name, true).await;
    let total = databases.len() * AGGREGATES * 6 - AGGREGATES * 2;
    eventually("pg05 catches up", Duration::from_secs(90), || async {
        (nats.stream_len(STREAM).await as usize >= total).then_some(())
    })
    .await;
    let received = nats.read_stream(STREAM).await;
    let sequences = sequences(&received);
    for db in &databases {
        let events = if db.name == stopped.name { 4 } else { 6 };
        for aggregate in 0..AGGREGATES {
            let key = format!("{}-{aggregate}", db.name);
            let want: Vec<u64> = (0..events as u64).collect();
            assert_eq!(sequences.get(&key), Some(&want), "{key}: every event, in order");
        }
    }
    assert!(
        !sequences.contains_key("pg03-poison"),
        "the poison was not published"
    );
    // Its three attempts take 30 s at most.
    eventually("the poison is dead-lettered", Duration::from_secs(60), || async {
        let reason: Option<String> = sqlx::query_scalar(
            "SELECT last_error FROM switchyard_outbox WHERE aggregate_id = 'pg03-poison' AND status = 'dead'",
        )
        .fetch_optional(&poisoned_db.pool)
        .await
        .expect("query");
        reason
    })
    .await;
    // pg05's held-back outcomes are recorded, and it is ready again.
    eventually("every database is ready", Duration::from_secs(30), || async {
        let readiness = switchyard::fleet::admin::readiness(&fleet).await;
        (readiness.state == "ok").then_some(())
    })
    .await;
    shutdown.cancel();
    fleet.stopped().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn databases_come_and_go_with_the_catalog_while_the_relay_runs() {
    let _heavy = exclusive().await;
    init_logging();
    let nats = nats().await;
    let mut databases = databases(2, 0).await;
    // A tenant database the catalog lists before anyone migrated it.
    databases.push(Database {
        name: "pg02".to_string(),
        outbox: Outbox::Postgres(fresh_db_before(0).await),
    });
    let control = fresh_db().await;
    control
        .pool
        .execute("CREATE TABLE tenants (name text, url text)")
        .await
        .expect("catalog table");
    let shutdown = CancellationToken::new();
    let fleet = Fleet::start(
        config(&[&databases[0]], &nats.url())
            .set("catalog", "url", control.url.as_str())
            .set("catalog", "query", "SELECT name, url FROM tenants")
            .set("catalog", "interval_seconds", 1)
            .set("catalog", "max_connections", 3)
            .set("catalog", "migrate", true)
            .parse(),
        shutdown.clone(),
    )
    .await
    .expect("fleet starts");
    all_running(&fleet, 1).await;
    for (name, url) in [
        ("pg01", databases[1].url()),
        ("pg02", databases[2].url()),
        ("bad name", "postgres://nowhere/x".to_string()),
    ] {
        sqlx::query("INSERT INTO tenants VALUES ($1, $2)")
            .bind(name)
            .bind(url)
            .execute(&control.pool)
            .await
            .expect("catalog row");
    }
    all_running(&fleet, 3).await;
    for db in &databases {
        db.write(0).await;
    }
    eventually("three databases publish", Duration::from_secs(30), || async {
        (nats.stream_len(STREAM).await as usize >= 3 * AGGREGATES).then_some(())
    })
    .await;
    assert!(fleet.metrics().render().contains("database=\"pg02\""));
    let readiness = switchyard::fleet::admin::readiness(&fleet).await;
    assert_eq!(readiness.state, "ok", "{readiness:?}");
    // `/status` answers for a database by name, and says which names there are.
    let admin = switchyard::fleet::admin::serve("127.0.0.1:0", fleet.clone(), shutdown.clone())
        .await
        .expect("admin endpoint");
    let addr = admin.local_addr.to_string();
    let status = switchyard::admin::fetch_status(&addr, Some("pg02"))
        .await
        .expect("pg02's status");
    assert_eq!(status.owner, fleet.owner());
    for (name, answer) in [
        (
            None,
            "400 Bad Request: {\"error\":\"which database? /status?database=NAME, one of: pg00, pg01, pg02\"}",
        ),
        (
            Some("nope"),
            "404 Not Found: {\"error\":\"no database \\\"nope\\\" here; served: pg00, pg01, pg02\"}",
        ),
    ] {
        let error = switchyard::admin::fetch_status(&addr, name)
            .await
            .expect_err("no status");
        assert_eq!(error.to_string(), format!("the admin endpoint answered {answer}"));
    }

    // Its row goes: its relay stops, its rows stay, its figures leave /metrics.
    sqlx::query("DELETE FROM tenants WHERE name = 'pg02'")
        .execute(&control.pool)
        .await
        .expect("delete row");
    eventually("pg02 is no longer served", Duration::from_secs(30), || async {
        (fleet.databases().len() == 2).then_some(())
    })
    .await;
    // Its figures go once its relay has stopped (batches finished or their
    // leases released), a moment after it leaves the list.
    eventually(
        "pg02's figures leave /metrics",
        Duration::from_secs(30),
        || async { (!fleet.metrics().render().contains("database=\"pg02\"")).then_some(()) },
    )
    .await;
    let started = Instant::now();
    databases[2].write(1).await;
    databases[0].write(1).await;
    eventually(
        "the served database publishes",
        Duration::from_secs(30),
        || async { (nats.stream_len(STREAM).await as usize >= 4 * AGGREGATES).then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1).saturating_sub(started.elapsed())).await;
    assert_eq!(
        nats.stream_len(STREAM).await as usize,
        4 * AGGREGATES,
        "nothing relayed from the removed database"
    );
    let Outbox::Postgres(removed) = &databases[2].outbox else {
        unreachable!("pg02 is PostgreSQL")
    };
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = 'pending'")
        .fetch_one(&removed.pool)
        .await
        .expect("count");
    assert_eq!(pending, AGGREGATES as i64);

    // A catalog that cannot be read keeps what it listed last, degraded.
    set_connections(&control.name, false).await;
    eventually(
        "readiness reports the catalog",
        Duration::from_secs(30),
        || async {
            let readiness = switchyard::fleet::admin::readiness(&fleet).await;
            (readiness.state == "degraded" && readiness.ready).then_some(())
        },
    )
    .await;
    assert_eq!(fleet.databases().len(), 2);
    let catalog_up = |value: &str| {
        let text = fleet.metrics().render();
        text.contains(&format!("switchyard_catalog_up {value}"))
            || text.contains(&format!("switchyard_catalog_up{{}} {value}"))
    };
    assert!(catalog_up("0"), "the catalog's failure is a metric too");
    set_connections(&control.name, true).await;
    eventually("the catalog read again", Duration::from_secs(30), || async {
        catalog_up("1").then_some(())
    })
    .await;
    shutdown.cancel();
    fleet.stopped().await;
}

const RELAY_BIN: &str = env!("CARGO_BIN_EXE_relay-process");

/// Who holds each database (an owner whose lease ran out holds nothing).
async fn owners(databases: &[Database]) -> Vec<Option<String>> {
    let pools: Vec<&sqlx::PgPool> = databases
        .iter()
        .map(|db| match &db.outbox {
            Outbox::Postgres(pg) => &pg.pool,
            Outbox::Sqlite(_) => unreachable!("PostgreSQL only"),
        })
        .collect();
    fleet::owners(&pools).await
}

fn held_by(owners: &[Option<String>], relay: &str) -> usize {
    owners
        .iter()
        .filter(|owner| owner.as_deref() == Some(relay))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_share_the_databases_out_and_take_over_a_killed_ones() {
    let _heavy = exclusive().await;
    init_logging();
    let nats = nats().await;
    let databases = databases(6, 0).await;
    for db in &databases {
        record_takeovers(&db.pg().pool).await;
    }
    let all: Vec<&Database> = databases.iter().collect();
    // Each relay's admin endpoint on a port of its own, found by `status`.
    let config = config(&all, &nats.url())
        .set("ownership", "lease_seconds", 3)
        .set("admin", "listen", "127.0.0.1:0")
        .toml();
    let mut a = switchyard_tests::relay::Process::spawn(RELAY_BIN, &config, "relay-a");
    eventually(
        "relay-a holds every database",
        Duration::from_secs(30),
        || async { (held_by(&owners(&databases).await, "relay-a") == 6).then_some(()) },
    )
    .await;
    for db in &databases {
        db.write(0).await;
    }

    // A second relay gets its share, and the shares then hold still.
    let mut b = switchyard_tests::relay::Process::spawn(RELAY_BIN, &config, "relay-b");
    eventually("the relays hold three each", Duration::from_secs(60), || async {
        let owners = owners(&databases).await;
        (held_by(&owners, "relay-a") == 3 && held_by(&owners, "relay-b") == 3).then_some(())
    })
    .await;
    let settled = owners(&databases).await;
    for seq in 1..3 {
        for db in &databases {
            db.write(seq).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert_eq!(owners(&databases).await, settled, "ownership flapped");
    // `status --database` reaches the relay that serves it, whichever
    // relay's row it finds first.
    let path = std::env::temp_dir().join(format!("sy-status-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, &config).expect("write config");
    for (db, owner) in databases.iter().zip(&settled) {
        let args = [
            "status",
            "--json",
            "--config",
            path.to_str().expect("path"),
            "--database",
            &db.name,
        ];
        let (code, out, err) = cli(RELAY_BIN, &args, &[]).await;
        assert_eq!(code, 0, "{err}");
        let status: serde_json::Value = serde_json::from_str(&out).expect("status JSON");
        assert_eq!(
            status["relay"]["owner"].as_str(),
            owner.as_deref(),
            "{}: {out}",
            db.name
        );
    }
    let _ = std::fs::remove_file(&path);

    // relay-b is killed: relay-a takes its databases over when their leases run out.
    b.kill();
    let killed = Instant::now();
    for db in &databases {
        db.write(3).await;
    }
    eventually(
        "relay-a takes relay-b's databases over",
        Duration::from_secs(30),
        || async { (held_by(&owners(&databases).await, "relay-a") == 6).then_some(()) },
    )
    .await;
    eprintln!("takeover after SIGKILL: {} ms", killed.elapsed().as_millis());
    // Safe, on the database's clock: relay-a took each of relay-b's
    // databases only once relay-b's lease on it had run out.
    for (db, owner) in databases.iter().zip(&settled) {
        let taken: Vec<(String, f64)> = sqlx::query_as(
            "SELECT new_owner, extract(epoch FROM at - old_expires)::float8 FROM test_takeovers
              WHERE old_owner = 'relay-b'",
        )
        .fetch_all(&db.pg().pool)
        .await
        .expect("the takeovers");
        if owner.as_deref() != Some("relay-b") {
            assert!(taken.is_empty(), "{}: {taken:?}", db.name);
            continue;
        }
        let [(new_owner, after)] = taken.as_slice() else {
            panic!("{}: one takeover from relay-b: {taken:?}", db.name)
        };
        assert_eq!(new_owner, "relay-a", "{}", db.name);
        assert!(
            *after >= 0.0,
            "{}: taken {:.3} s before relay-b's lease ran out",
            db.name,
            -after
        );
        eprintln!(
            "{}: taken over {} ms after relay-b's lease ran out",
            db.name,
            (after * 1000.0) as i64
        );
    }
    every_event_in_order(&nats, &databases, 4).await;
    a.terminate();
    // A clean stop hands every database back.
    assert_eq!(owners(&databases).await, vec![None; 6]);
}

/// Records in `test_takeovers` each change of the database's owner by a
/// take (a new token): when, on the database's clock, and until when the
/// lease taken over ran.
async fn record_takeovers(pool: &sqlx::PgPool) {
    pool.execute(
        "CREATE TABLE test_takeovers (at timestamptz, old_owner text, old_expires timestamptz, new_owner text);
         CREATE FUNCTION test_record_takeover() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.token <> OLD.token THEN
                 INSERT INTO test_takeovers VALUES (now(), OLD.owner, OLD.expires_at, NEW.owner);
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER test_record_takeover AFTER UPDATE ON switchyard_ownership
             FOR EACH ROW EXECUTE FUNCTION test_record_takeover();",
    )
    .await
    .expect("the takeover record");
}

/// Sessions the relay `owner` holds on the test server now.
async fn sessions(admin: &sqlx::PgPool, owner: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
        .bind(format!("switchyard {owner}"))
        .fetch_one(admin)
        .await
        .expect("count sessions")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_budget_per_server_is_shared_out_and_never_exceeded() {
    const PER_SERVER: i64 = 8;
    let _heavy = exclusive().await;
    init_logging();
    let nats = nats().await;
    let databases = databases(6, 0).await;
    let shutdown = CancellationToken::new();
    let fleet = Fleet::start(
        config(&[&databases[0], &databases[1]], &nats.url())
            .set("connections", "per_server", PER_SERVER)
            .parse(),
        shutdown.clone(),
    )
    .await
    .expect("fleet starts");
    all_running(&fleet, 2).await;
    // The sessions this relay holds, sampled all along.
    let admin = server_pool().await;
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(0));
    let sampler = tokio::spawn({
        let (admin, owner, peak, stop) = (
            admin.clone(),
            fleet.owner().to_string(),
            peak.clone(),
            shutdown.clone(),
        );
        async move {
            while !stop.is_cancelled() {
                let now = sessions(&admin, &owner).await;
                peak.fetch_max(now, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    for db in &databases[..2] {
        db.write(0).await;
    }
    eventually("two databases publish", Duration::from_secs(30), || async {
        (nats.stream_len(STREAM).await as usize >= 2 * AGGREGATES).then_some(())
    })
    .await;

    // Four more on the same server: a share of one connection each (polled,
    // no LISTEN), and the first two start over with theirs while events
    // are written everywhere.
    for db in &databases[2..] {
        fleet.add(switchyard::config::NamedDatabase {
            name: db.name.clone(),
            url: db.url(),
            max_connections: 3,
            tls: Default::default(),
            password: None,
        });
    }
    for db in &databases[2..] {
        db.write(0).await;
    }
    for seq in 1..3 {
        futures::future::join_all(databases.iter().map(|db| db.write(seq))).await;
    }
    all_running(&fleet, 6).await;
    every_event_in_order(&nats, &databases, 3).await;
    // Ready, once the load is over: a database whose one connection a
    // claim holds through a stall of the machine misses a 3 s probe (a CI
    // run's did, with connections waited for 3 s), and is unready until
    // the next probe answers.
    eventually("the fleet ready again", Duration::from_secs(30), || async {
        let readiness = switchyard::fleet::admin::readiness(&fleet).await;
        (readiness.state == "ok").then_some(())
    })
    .await;
    shutdown.cancel();
    fleet.stopped().await;
    let _ = sampler.await;
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    assert!(peak > 0, "the sampler saw the relay's sessions");
    assert!(
        peak <= PER_SERVER,
        "{peak} sessions on one server, over the budget of {PER_SERVER}"
    );
}

/// Claims the relay ran in `database` so far (`switchyard_claims_total`).
fn claims(fleet: &Fleet, database: &str) -> u64 {
    let prefix = format!("switchyard_claims_total{{database=\"{database}\"}} ");
    fleet
        .metrics()
        .render()
        .lines()
        .find_map(|line| line.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_database_is_polled_less_and_less_often_but_still_relays_at_once() {
    let _heavy = exclusive().await;
    init_logging();
    let nats = nats().await;
    let databases = databases(1, 0).await;
    let listed = vec![(databases[0].name.clone(), databases[0].url())];
    let polling = |interval_ms: &str, idle_max_ms: &str| {
        let relay = RelaySection::new()
            .set("concurrency", "2")
            .set("poll_interval_ms", interval_ms)
            .set("idle_poll_max_ms", idle_max_ms);
        fleet::fleet(&listed, &nats.url(), &relay).parse()
    };
    let shutdown = CancellationToken::new();
    let fleet = Fleet::start(polling("100", "1600"), shutdown.clone())
        .await
        .expect("fleet starts");
    all_running(&fleet, 1).await;
    // Polls come 100, 200, 400, 800 ms apart, then every 1.6 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = claims(&fleet, "pg00");
    let window = Duration::from_secs(8);
    tokio::time::sleep(window).await;
    let idle = claims(&fleet, "pg00") - before;
    // At the poll interval it would be 80.
    assert!(idle <= 10, "{idle} claims in {window:?} of an idle database");
    shutdown.cancel();
    fleet.stopped().await;

    // A commit still wakes an idle worker at once (LISTEN), not at its
    // next poll: polled once a minute, what is relayed within the wait
    // below came through NOTIFY.
    let shutdown = CancellationToken::new();
    let fleet = Fleet::start(polling("60000", "60000"), shutdown.clone())
        .await
        .expect("fleet starts");
    all_running(&fleet, 1).await;
    eventually("the relay listens", Duration::from_secs(30), || async {
        let relay = fleet.relay("pg00")?;
        (relay.metrics().listening() && claims(&fleet, "pg00") > 0).then_some(())
    })
    .await;
    let started = Instant::now();
    databases[0].write(0).await;
    eventually("the database relays", Duration::from_secs(30), || async {
        (nats.stream_len(STREAM).await as usize >= AGGREGATES).then_some(())
    })
    .await;
    eprintln!("relayed {:?} after the commits", started.elapsed());
    shutdown.cancel();
    fleet.stopped().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_unreachable_for_longer_than_the_ownership_lease_is_served_again_when_it_returns() {
    let _heavy = exclusive().await;
    init_logging();
    let nats = nats().await;
    let databases = databases(4, 0).await;
    let all: Vec<&Database> = databases.iter().collect();
    let config = config(&all, &nats.url())
        .set("ownership", "lease_seconds", 3)
        .toml();
    let mut a = switchyard_tests::relay::Process::spawn(RELAY_BIN, &config, "relay-a");
    let mut b = switchyard_tests::relay::Process::spawn(RELAY_BIN, &config, "relay-b");
    eventually("the relays hold two each", Duration::from_secs(60), || async {
        let owners = owners(&databases).await;
        (held_by(&owners, "relay-a") == 2 && held_by(&owners, "relay-b") == 2).then_some(())
    })
    .await;
    for db in &databases {
        db.write(0).await;
    }
    let (down, others) = databases.split_first().expect("four databases");
    let Outbox::Postgres(down_db) = &down.outbox else {
        unreachable!("pg00 is PostgreSQL")
    };
    // Down for three leases: its owner cannot renew and stops serving it,
    // and nobody can take it meanwhile. The other databases go on.
    set_connections(&down_db.name, false).await;
    let went_down = Instant::now();
    for seq in 1..4 {
        for db in others {
            db.write(seq).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    eventually(
        "the other databases relay everything",
        Duration::from_secs(30),
        || async {
            let sequences = sequences(&nats.read_stream(STREAM).await);
            let want: Vec<u64> = (0..4).collect();
            others
                .iter()
                .all(|db| (0..AGGREGATES).all(|i| sequences.get(&format!("{}-{i}", db.name)) == Some(&want)))
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(9).saturating_sub(went_down.elapsed())).await;
    set_connections(&down_db.name, true).await;
    let back = Instant::now();
    for seq in 1..4 {
        down.write(seq).await;
    }
    // A follower tries each third of a lease (1 s); the wait bounds a hang.
    eventually("a relay serves it again", Duration::from_secs(60), || async {
        fleet::owners(&[&down_db.pool]).await[0].clone()
    })
    .await;
    eprintln!("served again {} ms after it returned", back.elapsed().as_millis());
    every_event_in_order(&nats, &databases, 4).await;
    // Whichever relay took it back may now hold more than its share and
    // hand one database over, which is free until the other takes it.
    eventually(
        "every database held by one of the relays",
        Duration::from_secs(30),
        || async {
            let owners = owners(&databases).await;
            (held_by(&owners, "relay-a") + held_by(&owners, "relay-b") == 4).then_some(())
        },
    )
    .await;
    a.terminate();
    b.terminate();
}

/// One relay serving one PostgreSQL database through a [`StallingProxy`],
/// with `[ownership]` at `lease_seconds`, once its first events are
/// through.
struct Proxied {
    nats: NatsServer,
    databases: Vec<Database>,
    proxy: StallingProxy,
    fleet: Fleet,
    shutdown: CancellationToken,
}

impl Proxied {
    async fn start(lease_seconds: u64) -> Proxied {
        let nats = nats().await;
        let databases = databases(1, 0).await;
        let proxy = StallingProxy::in_front_of(&databases[0].pg().url).await;
        let listed = vec![(databases[0].name.clone(), proxy.url(&databases[0].pg().url))];
        let relay = RelaySection::new()
            .set("concurrency", "2")
            .set("shutdown_timeout_ms", "2000");
        let shutdown = CancellationToken::new();
        let config = fleet::fleet(&listed, &nats.url(), &relay)
            .set(
                "ownership",
                "lease_seconds",
                i64::try_from(lease_seconds).unwrap(),
            )
            .toml();
        let fleet = Fleet::start(parse(&config), shutdown.clone())
            .await
            .expect("fleet starts");
        all_running(&fleet, 1).await;
        databases[0].write(0).await;
        eventually("the database relays", Duration::from_secs(30), || async {
            (nats.stream_len(STREAM).await as usize >= AGGREGATES).then_some(())
        })
        .await;
        Proxied {
            nats,
            databases,
            proxy,
            fleet,
            shutdown,
        }
    }

    fn serving(&self) -> bool {
        matches!(
            self.fleet.databases().get("pg00"),
            Some(DatabaseState::Running(_))
        )
    }

    /// Stops the relay. Cut off from its database, its last statements
    /// there each wait out their bounds, which grow with the lease (about
    /// 30 s in all with a 12 s lease); the bound here is against a hang.
    async fn stop(self) {
        self.shutdown.cancel();
        let started = Instant::now();
        tokio::time::timeout(Duration::from_secs(180), self.fleet.stopped())
            .await
            .expect("the relay stops");
        eprintln!("stopped in {} ms", started.elapsed().as_millis());
    }
}

impl Database {
    fn pg(&self) -> &TestDb {
        let Outbox::Postgres(db) = &self.outbox else {
            unreachable!("{} is not PostgreSQL", self.name)
        };
        db
    }
}

/// A relay cut off from a database by the network (every session stops
/// answering, new ones never get a first answer) stops serving it before
/// its ownership lease ends, as the database counts it: from then on
/// another relay may take the database. Each statement has a bound of its
/// own, but a tick's three in a row outlast a lease.
///
/// The relay gives up half a tick (a sixth of the lease) before the lease
/// ends: 2 s with this 12 s lease, room for a loaded machine to notice.
/// That arithmetic is unit-tested in `fleet::ownership`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cut_off_from_its_database_stops_serving_it_before_its_lease_ends() {
    let _heavy = exclusive().await;
    init_logging();
    let run = Proxied::start(12).await;
    run.proxy.black_hole();
    // What the database holds now is the relay's last renewal, or one it
    // sent as the link went (then the relay believes its lease ends sooner).
    let left: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 FROM switchyard_ownership",
    )
    .fetch_one(&run.databases[0].pg().pool)
    .await
    .expect("the lease");
    let lease_ends = Instant::now() + Duration::from_secs_f64(left.max(0.0));
    let stopped = loop {
        if !run.serving() {
            break Instant::now();
        }
        assert!(
            Instant::now() < lease_ends + Duration::from_secs(60),
            "still serving a minute after the lease ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        stopped <= lease_ends,
        "stopped serving {:?} after the lease ended",
        stopped - lease_ends
    );
    eprintln!(
        "stopped serving {} ms before the lease ended",
        (lease_ends - stopped).as_millis()
    );
    // Still cut off while it stops.
    run.stop().await;
}

/// The sessions on database `name` seen running ownership statements over
/// `window`: the relay's ownership follower's.
async fn ownership_sessions(admin: &sqlx::PgPool, name: &str, window: Duration) -> HashSet<i32> {
    let mut seen = HashSet::new();
    let until = Instant::now() + window;
    while Instant::now() < until {
        let pids: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND query LIKE '%switchyard_ownership%'",
        )
        .bind(name)
        .fetch_all(admin)
        .await
        .expect("the database's sessions");
        seen.extend(pids);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    seen
}

/// A database whose answers come too slowly for a renewal to land in time
/// (a server short of CPU) is given up in time, and served again once it
/// answers promptly, on the same ownership session: a statement the relay
/// stopped waiting for is left to finish, not dropped with its session,
/// so slowness does not cost the server a new session each tick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_answering_too_slowly_is_given_up_and_served_again_on_the_same_session() {
    let _heavy = exclusive().await;
    init_logging();
    // Ticks of 2 s; a renewal has until 5 s after the one before it, so
    // answers held 4 s (a ping's and the renewal's) miss that by 1 s or more.
    let run = Proxied::start(6).await;
    let admin = server_pool().await;
    let name = &run.databases[0].pg().name;
    let before = ownership_sessions(&admin, name, Duration::from_secs(5)).await;
    assert_eq!(before.len(), 1, "one ownership session: {before:?}");

    run.proxy.delay_answers(Duration::from_secs(4));
    eventually(
        "the relay gives the slow database up",
        Duration::from_secs(30),
        || async { (!run.serving()).then_some(()) },
    )
    .await;
    run.proxy.delay_answers(Duration::ZERO);
    eventually("the relay serves it again", Duration::from_secs(60), || async {
        run.serving().then_some(())
    })
    .await;
    run.databases[0].write(1).await;
    eventually("its new events relay", Duration::from_secs(30), || async {
        (run.nats.stream_len(STREAM).await as usize >= 2 * AGGREGATES).then_some(())
    })
    .await;
    let after = ownership_sessions(&admin, name, Duration::from_secs(5)).await;
    assert_eq!(after, before, "the ownership follower's session changed");
    // Nothing is left of the first spell of serving: the follower's
    // session and at most the database's `max_connections` (3).
    let relay_sessions: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE 'switchyard %'",
    )
    .bind(name)
    .fetch_one(&admin)
    .await
    .expect("the relay's sessions");
    assert!(relay_sessions <= 4, "{relay_sessions} sessions of the relay");
    run.stop().await;
}

/// A relay following a database another relay serves stops promptly when
/// that database stopped answering while its session sat idle between two
/// ticks: the follower's last statement (taking itself off the running
/// relays) is bounded like the others, as its session is not pinged
/// before use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_relay_stops_when_its_database_stopped_answering() {
    let _heavy = exclusive().await;
    init_logging();
    let nats = nats().await;
    let databases = databases(1, 0).await;
    let db = databases[0].pg();
    let proxy = StallingProxy::in_front_of(&db.url).await;
    let start = async |id: &str, url: String| {
        let relay = RelaySection::new()
            .set("concurrency", "2")
            .set("shutdown_timeout_ms", "2000")
            .set("instance_id", &format!("\"{id}\""));
        let listed = vec![(databases[0].name.clone(), url)];
        let config = fleet::fleet(&listed, &nats.url(), &relay)
            .set("ownership", "lease_seconds", 3)
            .toml();
        let shutdown = CancellationToken::new();
        let fleet = Fleet::start(parse(&config), shutdown.clone())
            .await
            .expect("fleet starts");
        (fleet, shutdown)
    };
    let (serving, serving_shutdown) = start("serving", db.url.clone()).await;
    all_running(&serving, 1).await;
    let (standby, standby_shutdown) = start("standby", proxy.url(&db.url)).await;
    eventually(
        "the second relay follows the database",
        Duration::from_secs(30),
        || async {
            matches!(
                standby.databases().get("pg00"),
                Some(DatabaseState::Standby { .. })
            )
            .then_some(())
        },
    )
    .await;

    proxy.black_hole();
    standby_shutdown.cancel();
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), standby.stopped())
        .await
        .expect("the standby relay stops, its database silent");
    eprintln!("stopped in {} ms", started.elapsed().as_millis());
    serving_shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(60), serving.stopped())
        .await
        .expect("the serving relay stops");
}
