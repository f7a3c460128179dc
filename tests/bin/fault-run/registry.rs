//! `registry-swaps [MOVES]`: one relay serving its plugin from the loopback
//! registry by tag while writers commit about 600 events a second; the tag
//! is moved MOVES times (10 by default) across the Rust, Python and
//! JavaScript builds of `route_by_type` and its Rust batch build, each
//! pushed with `switchyard plugin push`; the last two moves (of six or
//! more) push again the very bytes of an earlier move, so the tag goes back
//! to a digest the cache holds. Counts what was lost, duplicated or
//! reordered, and prints each move's pull time, compile time, cache hit and
//! the time from the push to the first event the new digest routed.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use switchyard_tests::config::{Plugin, Target, TestConfig, strings};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::tally;
use switchyard_tests::plugins::{plugin, with_custom_section};
use switchyard_tests::postgres::{Outbox, fresh_db};
use switchyard_tests::registry::Registry;
use switchyard_tests::relay::InProcess;

use super::{Row, STREAM, outage};

/// Transactions a second: one to six aggregates of one to three events
/// each, seven events on average, so about 600 events a second (the run
/// prints the rate it reached).
const TRANSACTIONS: u64 = 86;

struct Move {
    build: &'static str,
    /// The earlier move whose digest this one brought back.
    back_to: Option<usize>,
    pull_ms: u64,
    compile_ms: u128,
    cache_hit: bool,
    first_routed_s: f64,
}

fn builds() -> Vec<(&'static str, PathBuf)> {
    let root = switchyard_tests::workspace_root();
    vec![
        ("rust", plugin("route_by_type")),
        ("python", root.join("plugins/target/python/route_by_type.wasm")),
        ("js", root.join("plugins/target/js/route_by_type.wasm")),
        ("rust-batch", plugin("route_by_type_batch")),
    ]
}

pub async fn swaps_run(relay_bin: &str, moves: usize) -> Row {
    let registry = Registry::shared();
    let builds = builds();
    for (name, path) in &builds {
        assert!(
            path.is_file(),
            "{name}: {} is missing: run scripts/plugin-toolchains.sh",
            path.display()
        );
    }
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let dir = std::env::temp_dir().join(format!("sy-fault-registry-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let reference = registry.reference(&format!("fault-{}/router", uuid::Uuid::new_v4().simple()), "live");
    // Moves that bring back an earlier digest: the same build, the same
    // bytes.
    let back_to = |n: usize| (moves >= 6 && n + 2 > moves).then(|| n - builds.len());
    let bytes_of = |n: usize| {
        let (build, path) = &builds[n % builds.len()];
        let section = u32::try_from(back_to(n).unwrap_or(n)).unwrap_or(0);
        (
            *build,
            with_custom_section(&std::fs::read(path).unwrap(), section),
        )
    };
    let push = |n: usize| {
        let (build, bytes) = bytes_of(n);
        let file = dir.join(format!("router-{n}.wasm"));
        std::fs::write(&file, &bytes).unwrap();
        registry.push(relay_bin, &file, &reference);
        (build, switchyard::plugin::content_hash(&bytes))
    };
    let routed_by = |hash: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM switchyard_outbox WHERE status = 'published' AND plugin_version = $1",
            )
            .bind(hash)
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
        }
    };
    push(0);
    let config = TestConfig::new(&db.url)
        .database("max_connections", 8)
        .set(
            "plugin_runtime",
            "cache_dir",
            dir.join("cache").display().to_string(),
        )
        .relay("lease_duration_ms", 60_000)
        .plugin(
            Plugin::new("router", std::path::Path::new(&reference))
                .set("aggregate_types", strings(&["order"]))
                .set("registry", registry.plugin_settings(&registry.password_file(), 1))
                .set("timeout_ms", 5_000)
                .to("events", "orders.{event_type}"),
        )
        .target("events", Target::nats(&nats.url()))
        .parse();
    let running = InProcess::start(&config).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = outage::writer_at(&db, Outbox::Switchyard, false, TRANSACTIONS, stop.clone());
    let writing = Instant::now();
    let mut report = Vec::new();
    for n in 1..=moves {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let slot = running.relay.plugins().slot("router").unwrap();
        let hits_before = slot.oci().unwrap().cache_hits;
        // A digest brought back has routed events before: count from here.
        let before = routed_by(switchyard::plugin::content_hash(&bytes_of(n).1)).await;
        let (build, hash) = push(n);
        let pushed = Instant::now();
        let first_routed = loop {
            if routed_by(hash.clone()).await > before {
                break pushed.elapsed();
            }
            assert!(
                pushed.elapsed() < Duration::from_secs(300),
                "move {n} ({build}) never routed an event"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let state = slot.oci().unwrap();
        let compile_ms = slot.current().map_or(0, |v| v.compile_time().as_millis());
        report.push(Move {
            build,
            back_to: back_to(n),
            pull_ms: state.last_pull_ms.unwrap_or(0),
            compile_ms,
            cache_hit: state.cache_hits > hits_before,
            first_routed_s: first_routed.as_secs_f64(),
        });
    }
    stop.cancel();
    let expected = writer.await.unwrap();
    let rate = expected.len() as f64 / writing.elapsed().as_secs_f64();
    let unfinished = "SELECT count(*) FROM switchyard_outbox WHERE status <> 'published'";
    let drain = Instant::now();
    while outage::scalar::<i64>(&db, unfinished).await > 0 {
        assert!(
            drain.elapsed() < Duration::from_secs(600),
            "the backlog never drained"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drain_s = drain.elapsed().as_secs_f64();
    // Across every swap: the longest any event waited between its commit
    // and its publish.
    let worst: f64 = outage::scalar(
        &db,
        "SELECT coalesce(max(EXTRACT(EPOCH FROM published_at - created_at)), 0)::float8 FROM switchyard_outbox",
    )
    .await;
    let slot = running.relay.plugins().slot("router").unwrap();
    let (pulls, hits, rejected) = (
        slot.oci().unwrap().pulls,
        slot.oci().unwrap().cache_hits,
        slot.rejected(),
    );
    running.stop().await;
    println!("| move | build | pull ms | cache hit | compile ms | first event routed after the push (s) |");
    println!("|---|---|---|---|---|---|");
    for (n, m) in report.iter().enumerate() {
        let build = match m.back_to {
            Some(earlier) => format!("{} (back to move {earlier})", m.build),
            None => m.build.to_string(),
        };
        println!(
            "| {} | {build} | {} | {} | {} | {:.2} |",
            n + 1,
            m.pull_ms,
            if m.cache_hit { "yes" } else { "no" },
            m.compile_ms,
            m.first_routed_s
        );
    }
    println!("pulls {pulls}, of which cache hits {hits}; refused {rejected}; written at {rate:.0} events/s");
    let counted = tally(&nats.read_stream(STREAM).await, &expected);
    let _ = std::fs::remove_dir_all(dir);
    Row::counted(
        format!("registry-swaps ({moves} tag moves)"),
        expected.len(),
        counted,
        worst,
        drain_s,
    )
}
