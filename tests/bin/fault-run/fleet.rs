//! `fleet-kills DATABASES KILLS`: three relays share DATABASES outbox
//! databases out (`[ownership]`) while writers go on in every one of them;
//! a relay holding databases is SIGKILLed KILLS times (and started again
//! under a new name, as a restarted process would be). Prints each
//! takeover's time, then what the consumer counted and who holds what.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use switchyard_tests::fleet;
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, tally};
use switchyard_tests::postgres::{TestDb, fresh_db};
use switchyard_tests::relay::{Process, RelaySection};

use super::STREAM;

const LEASE_SECONDS: u64 = 5;
const AGGREGATES: usize = 8;

fn config(databases: &[TestDb], nats: &str) -> String {
    let listed: Vec<(String, String)> = databases
        .iter()
        .enumerate()
        .map(|(i, db)| (format!("db{i:02}"), db.url.clone()))
        .collect();
    let relay = RelaySection::new()
        .set("concurrency", "2")
        .set("lease_duration_ms", "4000")
        .set("publish_timeout_ms", "1500")
        .set("max_attempts", "500")
        .set("max_backoff_ms", "2000");
    fleet::fleet(&listed, nats, &relay)
        .set("ownership", "lease_seconds", LEASE_SECONDS as i64)
        .toml()
}

/// Who holds each database now.
async fn owners(databases: &[TestDb]) -> Vec<Option<String>> {
    let pools: Vec<&sqlx::PgPool> = databases.iter().map(|db| &db.pool).collect();
    fleet::owners(&pools).await
}

/// Writes one event per aggregate in turn into `db` until `stop`; returns
/// what it wrote.
async fn write(db: sqlx::PgPool, name: String, stop: Arc<AtomicBool>) -> Vec<(String, Expected)> {
    let mut written = Vec::new();
    let mut seq = 0;
    while !stop.load(Ordering::Relaxed) {
        for aggregate in 0..AGGREGATES {
            let aggregate_id = format!("{name}-{aggregate}");
            let inserted: Result<uuid::Uuid, _> = sqlx::query_scalar(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', $1, 'OrderUpdated', $2) RETURNING event_id",
            )
            .bind(&aggregate_id)
            .bind(serde_json::json!({ "seq": seq }))
            .fetch_one(&db)
            .await;
            let id = inserted.expect("writer insert");
            written.push((
                id.to_string(),
                Expected {
                    aggregate_id,
                    seq: seq as u64,
                    event_type: "OrderUpdated".to_string(),
                },
            ));
        }
        seq += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    written
}

pub(super) async fn kills_run(relay_bin: &str, count: usize, kills: usize) {
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let mut databases = Vec::new();
    for _ in 0..count {
        databases.push(fresh_db().await);
    }
    let config = config(&databases, &nats.url());
    let mut relays: Vec<(String, Process)> = (0..3)
        .map(|i| {
            let name = format!("relay-{i}");
            let process = Process::spawn(relay_bin, &config, &name);
            (name, process)
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = databases
        .iter()
        .enumerate()
        .map(|(i, db)| {
            // One session per writer: a test pool would open several.
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect_lazy(&db.url)
                .expect("writer pool");
            tokio::spawn(write(pool, format!("db{i:02}"), stop.clone()))
        })
        .collect();
    let mut takeovers = Vec::new();
    for round in 0..kills {
        // Wait for every database to be held and each relay to hold some.
        let limit = Instant::now() + Duration::from_secs(120);
        let before = loop {
            let now = owners(&databases).await;
            let all_held = now.iter().all(Option::is_some);
            let each_holds = relays
                .iter()
                .all(|(name, _)| now.iter().flatten().any(|o| o == name));
            if (all_held && each_holds) || Instant::now() > limit {
                break now;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let victim = (round % relays.len()).min(relays.len() - 1);
        let name = relays[victim].0.clone();
        let held: Vec<usize> = (0..before.len())
            .filter(|&i| before[i].as_deref() == Some(name.as_str()))
            .collect();
        relays[victim].1.kill();
        let killed = Instant::now();
        loop {
            let now = owners(&databases).await;
            if held.iter().all(|&i| now[i].as_ref().is_some_and(|o| *o != name)) {
                break;
            }
            if killed.elapsed() > Duration::from_secs(120) {
                println!("round {round}: not all of {name}'s databases were taken over in 120 s");
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let took = killed.elapsed();
        println!(
            "round {round}: killed {name} holding {} databases; taken over in {} ms",
            held.len(),
            took.as_millis()
        );
        takeovers.push(took);
        let restarted = format!("relay-{victim}-{}", round + 1);
        relays[victim] = (restarted.clone(), Process::spawn(relay_bin, &config, &restarted));
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut expected: HashMap<String, Expected> = HashMap::new();
    for writer in writers {
        expected.extend(writer.await.expect("writer"));
    }
    let started = Instant::now();
    loop {
        let stored = nats.stream_len(STREAM).await as usize;
        if stored >= expected.len() || started.elapsed() > Duration::from_secs(600) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Shares settle after the last restart before the ownership is read.
    tokio::time::sleep(Duration::from_secs(4 * LEASE_SECONDS)).await;
    let owners = owners(&databases).await;
    let counted = tally(&nats.read_stream(STREAM).await, &expected);
    let names: Vec<&String> = relays.iter().map(|(name, _)| name).collect();
    let by_relay: Vec<String> = names
        .iter()
        .map(|name| {
            format!(
                "{name}: {}",
                owners.iter().flatten().filter(|o| o == name).count()
            )
        })
        .collect();
    let orphans = owners.iter().filter(|o| o.is_none()).count();
    let strangers = owners.iter().flatten().filter(|o| !names.contains(o)).count();
    takeovers.sort();
    let ms = |d: &Duration| d.as_millis();
    println!();
    println!(
        "| databases | written | received | lost | duplicates | reordered | kills | takeover min / median / max | held at the end |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {count} | {} | {} | {} | {} | {} | {kills} | {} / {} / {} ms | {} ({orphans} unheld, {strangers} by a dead relay) |",
        expected.len(),
        counted.received,
        counted.lost,
        counted.duplicates,
        counted.reordered,
        takeovers.first().map_or(0, ms),
        takeovers.get(takeovers.len() / 2).map_or(0, ms),
        takeovers.last().map_or(0, ms),
        by_relay.join(", "),
    );
    for (_, mut relay) in relays {
        relay.terminate();
    }
}
