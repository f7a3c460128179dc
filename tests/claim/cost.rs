//! What claims and acks cost the database: sessions kept between a claim
//! and its ack, statements prepared once, sessions given up on when the
//! server stops answering, and no read of published rows.

use super::*;

/// Rows of the outbox table read so far, by scans and index fetches, as
/// the statistics have it. `session` is a pool of one session, the one
/// that did the reading: what it counted is flushed to the statistics
/// first (a backend otherwise reports at most once a second, and an idle
/// one after 10 s).
async fn outbox_rows_read(session: &sqlx::PgPool) -> i64 {
    // Flushed as this statement ends.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(session)
        .await
        .unwrap();
    sqlx::query_scalar::<_, i64>(
        "SELECT (COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0))::bigint
           FROM pg_stat_user_tables WHERE relname = 'switchyard_outbox'",
    )
    .fetch_one(session)
    .await
    .unwrap()
}

/// The oldest-pending age is read at every scrape. Published rows kept for
/// retention are most of the table; the figure must not read them.
#[tokio::test]
async fn the_oldest_pending_age_reads_no_published_rows() {
    let db = fresh_db().await;
    let insert = |created: &str, not_before: &str| {
        format!(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, created_at, not_before)
             VALUES ('order', 'o-' || gen_random_uuid(), 'OrderPaid', '{{}}', {created}, {not_before})"
        )
    };
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, status, published_at)
         SELECT 'order', 'kept-' || g, 'OrderPaid', '{}', 'published', now() FROM generate_series(1, 5000) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Delayed rows are not waiting yet, whatever their age.
    for _ in 0..3 {
        sqlx::query(&insert("now() - interval '5 hours'", "now() + interval '1 hour'"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    sqlx::query(&insert("now() - interval '1 hour'", "NULL"))
        .execute(&db.pool)
        .await
        .unwrap();
    // A backlog as large as what is kept, with fresh statistics: walking
    // the primary key from the lowest id looks cheap to a planner that
    // expects waiting rows spread among the published ones.
    sqlx::query(
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'queued-' || g, 'OrderPaid', '{}' FROM generate_series(1, 5000) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE switchyard_outbox")
        .execute(&db.pool)
        .await
        .unwrap();

    let session = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    let store = OutboxStore::new(session.clone());
    let before = outbox_rows_read(&session).await;
    let age = store.oldest_pending_age().await.unwrap().unwrap();
    let read = outbox_rows_read(&session).await - before;
    assert!(
        (3590.0..3700.0).contains(&age),
        "the row written an hour ago: {age}"
    );
    assert!(
        (1..10).contains(&read),
        "with 5,000 published rows kept, the oldest-pending age read {read} rows"
    );
}

/// A relay's store on `url` (its sessions' settings, a statement timeout of
/// half [`LEASE`]) named `application_name`, `max` connections, keeping
/// `keep` sessions between claims and acks.
async fn keeping(url: &str, max: u32, application_name: &str, keep: usize) -> OutboxStore {
    OutboxStore::connect_bounded(url, max, application_name, Some(LEASE / 2))
        .await
        .unwrap()
        .keeping_sessions(keep)
}

/// The last statement of each of the sessions named `application_name`,
/// by process id.
async fn last_statements(pool: &sqlx::PgPool, application_name: &str) -> BTreeMap<i32, String> {
    sqlx::query_as::<_, (i32, String)>("SELECT pid, query FROM pg_stat_activity WHERE application_name = $1")
        .bind(application_name)
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// The process whose last statement starts with `start`.
fn ran(statements: &BTreeMap<i32, String>, start: &str) -> Option<i32> {
    statements
        .iter()
        .find(|(_, query)| query.trim_start().starts_with(start))
        .map(|(pid, _)| *pid)
}

/// At service rates each event is its own claim and ack: a relay's claim
/// and its ack run on one server session, the next claim on that same one
/// (through the pool each took the session idle longest, and each went
/// back to be pinged).
#[tokio::test]
async fn a_claim_its_ack_and_the_next_claim_share_one_session() {
    let db = fresh_db().await;
    let name = format!("switchyard-sessions-{}", db.name);
    let store = keeping(&db.url, 6, &name, 4).await;
    // Sessions the pool opened earlier, idle: the first-in-first-out pool
    // would hand them out in turn.
    let (a, b, c) = tokio::join!(store.backlog(), store.backlog(), store.backlog());
    for backlog in [a, b, c] {
        backlog.unwrap();
    }
    for seq in 0..5 {
        place_order_event(&db.pool, &event(1, seq), true).await;
        let claim = store.claim("a", 10, LEASE).await.unwrap();
        assert_eq!(claim.rows.len(), 1);
        let claimed = last_statements(&db.pool, &name).await;
        let claimer =
            ran(&claimed, "WITH").unwrap_or_else(|| panic!("no session shows the claim: {claimed:?}"));
        let outcomes = [outcome(claim.rows[0].id, Outcome::Published)];
        assert_eq!(store.ack(claim.lease, &outcomes).await.unwrap().len(), 1);
        let acked = last_statements(&db.pool, &name).await;
        assert_eq!(
            ran(&acked, "SELECT switchyard_ack"),
            Some(claimer),
            "event {seq}: the ack runs where the claim ran, and nothing since: {acked:?}"
        );
        let nothing = store.claim("a", 10, LEASE).await.unwrap();
        assert!(nothing.rows.is_empty());
        let after = last_statements(&db.pool, &name).await;
        assert_eq!(
            ran(&after, "WITH"),
            Some(claimer),
            "event {seq}: the next claim runs on the same session: {after:?}"
        );
    }
}

/// A batch whose ack never comes (its relay task aborted) keeps its
/// session only until its lease ends: then the next claim lets it go, and
/// a pool with no other session goes on.
#[tokio::test]
async fn a_session_held_for_an_ack_that_never_comes_is_let_go_when_the_lease_ends() {
    let db = fresh_db().await;
    let store = keeping(&db.url, 1, "switchyard-test", 1).await;
    place_order_event(&db.pool, &event(1, 0), true).await;
    let lease = Duration::from_millis(300);
    let abandoned = store.claim("a", 10, lease).await.unwrap();
    assert_eq!(abandoned.rows.len(), 1);
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    // A session kept for good fails the claim: the pool gives up waiting
    // for one after its 10 s. The bound here is only against a hang.
    let again = tokio::time::timeout(Duration::from_secs(30), store.claim("b", 10, LEASE))
        .await
        .expect("the abandoned claim's session came back to the pool")
        .expect("a session for the next claim");
    assert_eq!(
        again.rows.len(),
        1,
        "its row is claimed again once the lease ended"
    );
    let taken = [outcome(again.rows[0].id, Outcome::Published)];
    assert_eq!(store.ack(again.lease, &taken).await.unwrap().len(), 1);
    let late = [outcome(abandoned.rows[0].id, Outcome::Published)];
    assert!(
        store.ack(abandoned.lease, &late).await.unwrap().is_empty(),
        "the abandoned lease is fenced"
    );
}

/// A kept session the server closed meanwhile (a restart, an idle
/// timeout, an operator) is found out by its ping when it has been idle for
/// a second: the claim that takes it next does not fail.
#[tokio::test]
async fn a_kept_session_the_server_closed_is_replaced_without_an_error() {
    let db = fresh_db().await;
    let name = format!("switchyard-closed-{}", db.name);
    let store = keeping(&db.url, 4, &name, 2).await;
    place_order_event(&db.pool, &event(1, 0), true).await;
    let claim = store.claim("a", 10, LEASE).await.unwrap();
    let outcomes = [outcome(claim.rows[0].id, Outcome::Published)];
    assert_eq!(store.ack(claim.lease, &outcomes).await.unwrap().len(), 1);
    let closed: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(&name)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(closed >= 1, "the kept session was closed");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    place_order_event(&db.pool, &event(2, 0), true).await;
    let next = store
        .claim("a", 10, LEASE)
        .await
        .expect("the claim after the session closed");
    assert_eq!(next.rows.len(), 1);
    let outcomes = [outcome(next.rows[0].id, Outcome::Published)];
    assert_eq!(store.ack(next.lease, &outcomes).await.unwrap().len(), 1);
}

/// Closing a store waits for every session to come back to its pool: the
/// sessions kept for an ack and for the next claim come back at once (a
/// relay that starts over closes its store before it opens another).
///
/// A close that gave up on them (after its 5 s) would leave them open:
/// the check is that none of the store's sessions is left on the server,
/// while the store is still there to hold them.
#[tokio::test]
async fn a_store_keeping_sessions_closes_at_once() {
    let db = fresh_db().await;
    let name = format!("switchyard-close-{}", db.name);
    let store = keeping(&db.url, 4, &name, 3).await;
    for aggregate in 0..3 {
        place_order_event(&db.pool, &event(aggregate, 0), true).await;
    }
    let acked = store.claim("a", 1, LEASE).await.unwrap();
    let outcomes = [outcome(acked.rows[0].id, Outcome::Published)];
    assert_eq!(store.ack(acked.lease, &outcomes).await.unwrap().len(), 1);
    // Two batches waiting for their acks, on two sessions.
    let (first, second) = tokio::join!(store.claim("a", 1, LEASE), store.claim("b", 1, LEASE));
    assert_eq!(first.unwrap().rows.len() + second.unwrap().rows.len(), 2);
    let open = last_statements(&db.pool, &name).await;
    assert!(
        open.len() >= 2,
        "the store's sessions, as the server shows them: {open:?}"
    );
    tokio::time::timeout(Duration::from_secs(30), store.close())
        .await
        .expect("the store closed with sessions kept");
    // A closed session's server process ends a moment after the close.
    switchyard_tests::eventually("the store's sessions gone", Duration::from_secs(30), || async {
        let left = last_statements(&db.pool, &name).await;
        left.is_empty().then_some(())
    })
    .await;
    drop(store);
}

/// A relay stops even when its database stopped answering: a session
/// whose statement was answered just before the link went is pinged by
/// sqlx on its way back to the pool, without a bound, and closing the
/// store (a relay's last step) waited for that ping for ever.
#[tokio::test]
async fn a_store_closes_when_its_server_stopped_answering() {
    let db = fresh_db().await;
    let proxy = StallingProxy::in_front_of(&db.url).await;
    let store = OutboxStore::connect_bounded(&proxy.url(&db.url), 1, "switchyard-test", Some(LEASE / 2))
        .await
        .unwrap();
    store.refresh_statistics().await.unwrap();
    // Its session's ping on the way back is answered by now; within a
    // second of its use the pool hands it out again without one.
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.black_hole_after_the_next_answer();
    store.refresh_statistics().await.unwrap();
    // Its session is on its way back to the pool, its ping unanswered.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Closing gives such a session 5 s, then leaves it behind; the bound
    // here is against the close that waited for ever.
    let started = std::time::Instant::now();
    tokio::time::timeout(Duration::from_secs(30), store.close())
        .await
        .expect("the store closes, its server cut off");
    eprintln!("closed after {:?}", started.elapsed());
}

/// A store of one pooled session, reached through a proxy that can stall
/// it, its statements cancelled by the server after `statement_timeout`.
async fn one_session_behind_a_proxy(
    statement_timeout: Duration,
) -> (switchyard_tests::postgres::TestDb, StallingProxy, OutboxStore) {
    let db = fresh_db().await;
    let proxy = StallingProxy::in_front_of(&db.url).await;
    let store =
        OutboxStore::connect_bounded(&proxy.url(&db.url), 1, "switchyard-test", Some(statement_timeout))
            .await
            .unwrap();
    (db, proxy, store)
}

/// Stalls the store's session once it is back in the pool (sqlx pings a
/// session as it comes back, and waits for ever on one that stalled then),
/// used less than a second ago: the pool hands it out again without a ping.
async fn stall_after_its_return(proxy: &StallingProxy) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.stall_open_connections();
}

/// A sweep or a statistics refresh sent on a pooled session just before it
/// stopped answering (a link that drops every packet, no reset) gives up
/// within the bound a claim has, instead of holding its loop and a place in
/// the pool until the kernel gives up, and the next one gets a new session.
#[tokio::test]
async fn background_statements_give_up_on_a_session_that_stops_answering() {
    // Given up 1 s after the server's own cancel.
    let (_db, proxy, store) = one_session_behind_a_proxy(Duration::from_secs(1)).await;
    store.refresh_statistics().await.unwrap();
    stall_after_its_return(&proxy).await;
    gives_up_unanswered("the refresh", store.refresh_statistics()).await;
    store.refresh_statistics().await.expect("a new session");
    // The same for the sweeps.
    stall_after_its_return(&proxy).await;
    let swept = tokio::time::timeout(Duration::from_secs(30), store.wake_waiting(None))
        .await
        .expect("the sweep gives up");
    assert!(swept.is_err(), "{swept:?}");
    assert_eq!(store.unpark_stranded(10).await.unwrap(), 0);
    // And for a fleet's ownership of the database: a renewal that waited
    // for ever would let the lease run out while its relay went on serving.
    let token = store
        .take_ownership("relay-a", LEASE)
        .await
        .unwrap()
        .expect("free");
    stall_after_its_return(&proxy).await;
    let renewed = tokio::time::timeout(
        Duration::from_secs(30),
        store.renew_ownership("relay-a", token, LEASE),
    )
    .await
    .expect("the renewal gives up");
    assert!(renewed.is_err(), "{renewed:?}");
    assert!(store.ownership(LEASE).await.unwrap().held);
    store.close().await;
}

/// Runs `statement` once, then again on its session just stalled, gives
/// up on it after 500 ms, and needs the pool to answer on a new session
/// within 5 s.
async fn gives_up_on_a_stalled_session(statement: impl AsyncFn(&OutboxStore)) {
    let (_db, proxy, store) = one_session_behind_a_proxy(Duration::from_secs(5)).await;
    statement(&store).await;
    stall_after_its_return(&proxy).await;
    let gave_up = tokio::time::timeout(Duration::from_millis(500), statement(&store)).await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    tokio::time::timeout(Duration::from_secs(5), store.ping())
        .await
        .expect("a session within 5 s")
        .expect("a new session answers");
    store.close().await;
}

/// A readiness check gives up after its own 3 s, before the store's bound,
/// and drops the statement it was waiting for. Its session, stalled, must
/// not go back to the pool: sqlx pings a session on its way back and would
/// wait there for ever, and a pool of one would have nothing left.
#[tokio::test]
async fn a_statement_its_caller_gave_up_on_leaves_no_session_behind() {
    gives_up_on_a_stalled_session(async |store| store.ping().await.unwrap()).await;
}

/// The same for the replication slot's status, which readiness reads
/// under the same 3 s bound.
#[tokio::test]
async fn a_slot_status_its_caller_gave_up_on_leaves_no_session_behind() {
    gives_up_on_a_stalled_session(async |store| {
        let pg = store.postgres().expect("a PostgreSQL store");
        assert!(pg.slot_status("switchyard_none").await.unwrap().is_none());
    })
    .await;
}

/// CPU time (user and system) the server process `pid` has used so far.
fn cpu_of(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the session's process");
    // utime and stime are the 14th and 15th fields; the command's name
    // (second, in parentheses) may hold spaces.
    let after_name = &stat[stat.rfind(')').expect("a stat line") + 1..];
    let fields: Vec<u64> = after_name
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|field| field.parse().expect("a tick count"))
        .collect();
    let per_second: u64 = String::from_utf8(
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .expect("getconf")
            .stdout,
    )
    .expect("a number")
    .trim()
    .parse()
    .expect("a number");
    Duration::from_millis((fields[0] + fields[1]) * 1000 / per_second)
}

/// A relay's sessions leave the planner only index probes, which prices
/// any scan at ten billion; PostgreSQL then JIT-compiled, with inlining
/// and optimisation, each statement that has to scan (the fleet's
/// ownership read scans the few rows of `switchyard_relays`): a second or
/// more of CPU for a statement that runs in a tenth of a millisecond, on
/// every follower of every database each renewal period.
#[tokio::test]
async fn a_relay_session_does_not_compile_its_statements() {
    let db = fresh_db().await;
    let name = format!("switchyard-jit-{}", uuid::Uuid::new_v4().simple());
    let store = OutboxStore::connect_bounded(&db.url, 1, &name, Some(LEASE / 2))
        .await
        .unwrap();
    for _ in 0..20 {
        store.ownership(Duration::from_secs(5)).await.unwrap();
    }
    let pid: i32 = sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
        .bind(&name)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // Each read takes well under a millisecond; compiled, well over ten.
    let cpu = cpu_of(pid);
    assert!(
        cpu < Duration::from_millis(500),
        "20 ownership reads cost the server {cpu:?} of CPU"
    );
}
