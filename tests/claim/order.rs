//! Order: one head per aggregate at a time, across concurrent claims and
//! workers; retries, dead letters, delays and paused targets hold back only
//! their own aggregate.

use super::*;

on_every_backend!(
    concurrent_claims_are_disjoint_and_take_only_heads,
    next_event_of_an_aggregate_waits_for_the_ack,
    a_retrying_event_holds_back_only_its_own_aggregate,
    dead_letters_block_the_aggregate_only_in_strict_mode,
    delayed_rows_wait_for_not_before,
    concurrent_workers_keep_each_aggregate_in_order_and_strand_nothing,
    a_writers_created_at_in_the_future_delays_nothing,
);

on_shared_backends!(
    a_claim_never_passes_an_event_whose_predecessor_another_session_holds,
    claims_racing_writers_never_take_an_event_before_its_predecessor_is_done,
);

/// Claims racing a service's commits: writers commit transactions of one
/// to six aggregates, one to three events of each, while three workers
/// claim and ack (some rows retried once), and a checker reads, again and
/// again, whether any row in flight has an unfinished earlier row of its
/// aggregate. None may, in any committed state. A claim statement that
/// began before a writer's commit and reached its rows after must not see
/// the later event of an aggregate without the earlier one (on MariaDB a
/// locking read sees rows committed after its statement began, and its
/// subquery does not).
async fn claims_racing_writers_never_take_an_event_before_its_predecessor_is_done(db: TestOutbox) {
    use switchyard_tests::workload::{Dice, Shape, plan};
    let pool = db.service_pool();
    let writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut writers = Vec::new();
    for writer in 0..2 {
        let pool = pool.clone();
        writers.push(tokio::spawn(async move {
            let mut dice = Dice::new(40 + writer as u64);
            let mut seqs = HashMap::new();
            let mut written = 0;
            for _ in 0..250 {
                let plan = plan(
                    &mut dice,
                    Shape::rows(switchyard_tests::postgres::Outbox::Switchyard),
                    60,
                    writer,
                    2,
                );
                written += pool.write_committed(&plan, &mut seqs).await.unwrap().len();
            }
            written
        }));
    }
    let mut workers = Vec::new();
    for worker in 0..3u64 {
        let store = db.store.clone();
        let writing = writing.clone();
        workers.push(tokio::spawn(async move {
            let mut round = 0u64;
            loop {
                round += 1;
                let claim = store.claim(&format!("w{worker}"), 20, LEASE).await.unwrap();
                if claim.rows.is_empty() {
                    if !writing.load(std::sync::atomic::Ordering::SeqCst)
                        && store.backlog().await.unwrap().0 == 0
                    {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                let outcomes = flaky_outcomes(&claim, round + worker, 5);
                store.ack(claim.lease, &outcomes).await.unwrap();
            }
        }));
    }
    let checking = {
        let pool = pool.clone();
        let writing = writing.clone();
        tokio::spawn(async move {
            let (mut checks, mut worst) = (0, 0);
            while writing.load(std::sync::atomic::Ordering::SeqCst) {
                let passed = pool
                    .scalar(
                        "SELECT count(*) FROM switchyard_outbox o
                          WHERE o.status = 'in_flight' AND EXISTS (
                                SELECT 1 FROM switchyard_outbox e
                                 WHERE e.aggregate_type = o.aggregate_type AND e.aggregate_id = o.aggregate_id
                                   AND e.id < o.id AND e.status IN ('pending', 'in_flight'))",
                    )
                    .await;
                worst = worst.max(passed);
                checks += 1;
            }
            (checks, worst)
        })
    };
    let mut written = 0;
    for writer in writers {
        written += writer.await.unwrap();
    }
    writing.store(false, std::sync::atomic::Ordering::SeqCst);
    let (checks, worst) = checking.await.unwrap();
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(checks > 10, "the checker ran {checks} times");
    assert_eq!(
        worst, 0,
        "rows claimed while an earlier event of their aggregate was unfinished ({checks} checks)"
    );
    assert_eq!(db.count("published").await, written as i64);
}

/// What per-aggregate order rests on where relays share a server: a claim
/// skips rows another session has locked (SKIP LOCKED), and must not take
/// the row behind a skipped one as if the skipped one were gone. Another
/// session holds the head of aggregate 1 as a claim does, locked, and then
/// also changed but not committed; each time the next claim takes the head
/// of aggregate 2 and nothing of aggregate 1, at once.
async fn a_claim_never_passes_an_event_whose_predecessor_another_session_holds(db: TestOutbox) {
    for (aggregate, seq) in [(1, 0), (1, 1), (2, 0), (1, 2), (2, 1)] {
        db.insert(aggregate, seq, None).await;
    }
    let head = db
        .scalar("SELECT min(id) FROM switchyard_outbox WHERE aggregate_id = 'o-1'")
        .await;
    for held in [
        format!("SELECT id FROM switchyard_outbox WHERE id = {head} FOR UPDATE"),
        format!("UPDATE switchyard_outbox SET status = 'in_flight' WHERE id = {head}"),
        format!("UPDATE switchyard_outbox SET status = 'published' WHERE id = {head}"),
    ] {
        let holder = db.hold(&held).await;
        let started = std::time::Instant::now();
        let claim = db.store.claim("b", 10, LEASE).await.unwrap();
        let taken: Vec<_> = claim
            .rows
            .iter()
            .map(|row| (row.aggregate_id.clone(), seq(row)))
            .collect();
        assert_eq!(
            taken,
            [("o-2".to_string(), 0)],
            "with the head of o-1 held by another session ({held}), only o-2's head is claimed"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the claim waited {:?} for the held row",
            started.elapsed()
        );
        holder.release().await;
        // o-2's head back, as if its relay had stopped: the next round
        // starts from the same rows.
        db.store.release_owner("b").await.unwrap();
    }
    // Nothing held: o-1's head is claimable again, and still only it.
    let claim = db.store.claim("c", 10, LEASE).await.unwrap();
    let mut taken: Vec<_> = claim
        .rows
        .iter()
        .map(|row| (row.aggregate_id.clone(), seq(row)))
        .collect();
    taken.sort();
    assert_eq!(taken, [("o-1".to_string(), 0), ("o-2".to_string(), 0)]);
}

/// Each row of `claim` published, but about one in `every` (by `seed`)
/// retried at once on its first attempt.
fn flaky_outcomes(claim: &switchyard::store::Claim, seed: u64, every: u64) -> Vec<RowOutcome> {
    claim
        .rows
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let retry = (seed + i as u64).is_multiple_of(every) && row.attempts == 1;
            let result = if retry {
                Outcome::Retry {
                    after: Duration::ZERO,
                    error: "flaky".into(),
                }
            } else {
                Outcome::Published
            };
            outcome(row.id, result)
        })
        .collect()
}

async fn concurrent_claims_are_disjoint_and_take_only_heads(db: TestOutbox) {
    for seq in 0..5 {
        for aggregate in 0..100 {
            db.insert(aggregate, seq, None).await;
        }
    }
    let store = &db.store;
    let (a, b) = tokio::join!(store.claim("a", 70, LEASE), store.claim("b", 70, LEASE));
    let (a, b) = (a.unwrap(), b.unwrap());
    let ids_a: HashSet<_> = a.rows.iter().map(|r| r.id).collect();
    let ids_b: HashSet<_> = b.rows.iter().map(|r| r.id).collect();
    assert!(ids_a.is_disjoint(&ids_b), "two claimers got the same row");
    assert_eq!(
        ids_a.len() + ids_b.len(),
        100,
        "every aggregate's head is claimed once"
    );
    for row in a.rows.iter().chain(&b.rows) {
        assert_eq!(seq(row), 0, "only the first event of each aggregate is claimable");
        assert_eq!(row.attempts, 1);
    }
    assert!(
        store.claim("c", 1000, LEASE).await.unwrap().rows.is_empty(),
        "the rest wait behind in-flight heads"
    );
}

async fn next_event_of_an_aggregate_waits_for_the_ack(db: TestOutbox) {
    for seq in 0..3 {
        for aggregate in 0..2 {
            db.insert(aggregate, seq, None).await;
        }
    }
    let mut expected_seq = 0;
    loop {
        let claim = db.store.claim("a", 100, LEASE).await.unwrap();
        if claim.rows.is_empty() {
            break;
        }
        assert_eq!(claim.rows.len(), 2);
        assert!(claim.rows.iter().all(|r| seq(r) == expected_seq));
        let outcomes: Vec<_> = claim
            .rows
            .iter()
            .map(|r| outcome(r.id, Outcome::Published))
            .collect();
        assert_eq!(db.store.ack(claim.lease, &outcomes).await.unwrap().len(), 2);
        expected_seq += 1;
    }
    assert_eq!(expected_seq, 3);
    assert_eq!(db.count("published").await, 6);
}

async fn a_retrying_event_holds_back_only_its_own_aggregate(db: TestOutbox) {
    for seq in 0..2 {
        for aggregate in 0..2 {
            db.insert(aggregate, seq, None).await;
        }
    }
    let claim = db.store.claim("a", 100, LEASE).await.unwrap();
    let (failing, ok): (Vec<_>, Vec<_>) = claim.rows.iter().partition(|r| r.aggregate_id == "o-0");
    let outcomes = vec![
        outcome(
            failing[0].id,
            Outcome::Retry {
                after: Duration::from_secs(3600),
                error: "broker down".into(),
            },
        ),
        outcome(ok[0].id, Outcome::Published),
    ];
    db.store.ack(claim.lease, &outcomes).await.unwrap();

    let next = db.store.claim("a", 100, LEASE).await.unwrap();
    assert_eq!(next.rows.len(), 1, "only the healthy aggregate moves on");
    assert_eq!(next.rows[0].aggregate_id, "o-1");
    assert_eq!(seq(&next.rows[0]), 1);
    let (status, error) = db.status_of(failing[0].id.0).await;
    assert_eq!(
        (status.as_str(), error.as_deref()),
        ("pending", Some("broker down"))
    );
}

async fn dead_letters_block_the_aggregate_only_in_strict_mode(db: TestOutbox) {
    db.insert(0, 0, None).await;
    db.insert(0, 1, None).await;
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    db.store
        .ack(
            claim.lease,
            &[outcome(
                claim.rows[0].id,
                Outcome::Dead {
                    error: "poison".into(),
                },
            )],
        )
        .await
        .unwrap();

    let strict = db.store.clone().with_dead_letter_blocking(true);
    assert!(strict.claim("a", 10, LEASE).await.unwrap().rows.is_empty());
    let lenient = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(lenient.rows.len(), 1);
    assert_eq!(seq(&lenient.rows[0]), 1);
}

async fn delayed_rows_wait_for_not_before(db: TestOutbox) {
    db.insert(1, 0, Some(3_600_000)).await;
    db.insert(2, 0, Some(-1_000)).await;
    // Written after the delayed one: held back by it, not delayed itself.
    db.insert(1, 1, None).await;
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(claim.rows.len(), 1);
    assert_eq!(claim.rows[0].aggregate_id, "o-2");

    let stats = db.store.stats().await.unwrap();
    assert_eq!(
        (stats.backlog, stats.pending, stats.delayed, stats.in_flight),
        (3, 1, 1, 1),
        "status counts the delayed row apart: {stats:?}"
    );
    // The oldest pending row is the in-flight o-2, not the delayed one,
    // whose age would otherwise grow until its time comes.
    let oldest_id: i64 = claim.rows[0].id.0;
    assert!(oldest_id > 1);
    assert!(stats.oldest_pending_age_seconds.is_some());
    db.store
        .ack(claim.lease, &[outcome(claim.rows[0].id, Outcome::Published)])
        .await
        .unwrap();
    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.delayed), (1, 1));
    assert!(
        stats.oldest_pending_age_seconds.is_some(),
        "the row held behind the delayed one is pending"
    );
}

/// `created_at` is the writer's: many set it from the application's clock,
/// which may run ahead, or write local time where UTC is read (nine hours
/// ahead at UTC+9). Only `not_before` delays an event.
async fn a_writers_created_at_in_the_future_delays_nothing(db: TestOutbox) {
    let ahead = |aggregate: &str| match db.kind {
        "postgres" => format!(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ('order', '{aggregate}', 'OrderUpdated', '{{}}', now() + interval '9 hours')"
        ),
        "mariadb" => format!(
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ('order', '{aggregate}', 'OrderUpdated', '{{}}', NOW(6) + INTERVAL 9 HOUR)"
        ),
        _ => {
            format!(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
                 VALUES ('order', '{aggregate}', 'OrderUpdated', '{{}}',
                         CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) + 9 * 3600000)"
            )
        }
    };
    db.execute(&ahead("o-1")).await;
    db.insert(1, 1, None).await;
    db.insert(2, 0, None).await;
    let claim = db.store.claim("a", 10, LEASE).await.unwrap();
    let mut claimed: Vec<_> = claim.rows.iter().map(|row| row.aggregate_id.as_str()).collect();
    claimed.sort_unstable();
    assert_eq!(claimed, ["o-1", "o-2"], "the heads of both aggregates, at once");
    let first_of_o1 = claim.rows.iter().find(|row| row.aggregate_id == "o-1").unwrap();
    assert_eq!(
        first_of_o1.payload_json.as_deref(),
        Some("{}"),
        "o-1's first event, not the one behind it"
    );
    let stats = db.store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.delayed), (1, 0), "{stats:?}");
}

#[tokio::test]
async fn a_row_committed_after_a_later_id_is_still_claimed() {
    let db = fresh_db().await;
    let store = OutboxStore::new(db.pool.clone());
    // The first transaction takes the lower id but commits last.
    let mut early = db.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'late', 'OrderCreated', '{}')")
        .execute(&mut *early)
        .await
        .unwrap();
    place_order_event(&db.pool, &event(1, 0), true).await;

    let first = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(first.rows.len(), 1);
    assert_eq!(first.rows[0].aggregate_id, "o-1");
    store
        .ack(first.lease, &[outcome(first.rows[0].id, Outcome::Published)])
        .await
        .unwrap();

    early.commit().await.unwrap();
    let second = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(
        second.rows.len(),
        1,
        "a row with a lower id that committed late is not skipped"
    );
    assert_eq!(second.rows[0].aggregate_id, "late");
    assert!(second.rows[0].id < first.rows[0].id);
}

/// Four workers claim and ack at once, with retries in the mix, over
/// aggregates with deep backlogs, so claims park rows behind heads another
/// worker is acking at that moment. Every row must be published, each
/// aggregate in order, by the acks alone: no sweep runs here, so a row
/// parked behind a predecessor whose ack missed it would never come back.
async fn concurrent_workers_keep_each_aggregate_in_order_and_strand_nothing(db: TestOutbox) {
    const AGGREGATES: usize = 12;
    const EVENTS: usize = 40;
    for seq in 0..EVENTS {
        for aggregate in 0..AGGREGATES {
            db.insert(aggregate, seq, None).await;
        }
    }
    let published = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::<String, Vec<u64>>::new()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut workers = Vec::new();
    for worker in 0..4u64 {
        let store = db.store.clone();
        let published = published.clone();
        workers.push(tokio::spawn(async move {
            let mut round = 0u64;
            while tokio::time::Instant::now() < deadline {
                round += 1;
                let claim = store.claim(&format!("w{worker}"), 5, LEASE).await.unwrap();
                if claim.rows.is_empty() {
                    if store.backlog().await.unwrap().0 == 0 {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                // About one row in seven fails once, for no time.
                let outcomes = flaky_outcomes(&claim, round + worker, 7);
                // Recorded before the ack: once it commits, the next event
                // of the aggregate may be acked by another worker.
                {
                    let mut order = published.lock().unwrap();
                    for (row, done) in claim.rows.iter().zip(&outcomes) {
                        if done.outcome == Outcome::Published {
                            order.entry(row.aggregate_id.clone()).or_default().push(seq(row));
                        }
                    }
                }
                let acked = store.ack(claim.lease, &outcomes).await.unwrap();
                assert_eq!(acked.len(), outcomes.len());
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    assert_eq!(
        db.store.backlog().await.unwrap().0,
        0,
        "rows left behind: {:?}",
        db.store.stats().await.unwrap()
    );
    let order = published.lock().unwrap();
    assert_eq!(order.len(), AGGREGATES);
    for (aggregate, seqs) in order.iter() {
        let expected: Vec<u64> = (0..EVENTS as u64).collect();
        assert_eq!(
            seqs, &expected,
            "aggregate {aggregate} published out of order or incompletely"
        );
    }
}

/// A row waiting for a paused target keeps its attempt and lets the next
/// event of its aggregate be claimed, held by that target (its messages to
/// other targets go now); the one after learns the target from its nearest
/// predecessor. Waking the target makes the waiting rows due again, in order.
#[tokio::test]
async fn a_row_waiting_on_a_paused_target_lets_the_next_through_held_by_it() {
    let db = fresh_db().await;
    for seq in 0..3 {
        place_order_event(&db.pool, &event(0, seq), true).await;
    }
    let store = OutboxStore::new(db.pool.clone());
    let waiting = |id: RowId| {
        outcome(
            id,
            Outcome::Defer {
                after: Duration::from_secs(30),
                reason: "target \"kafka\" is paused".into(),
                waiting_on: vec!["kafka".into()],
            },
        )
    };
    let first = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(first.rows.len(), 1, "the head alone: {:?}", first.rows);
    assert!(first.rows[0].held_by.is_empty());
    let head = first.rows[0].id;
    store.ack(first.lease, &[waiting(head)]).await.unwrap();
    let (attempts, waiting_on): (i32, Vec<String>) =
        sqlx::query_as("SELECT attempts, waiting_on FROM switchyard_outbox WHERE id = $1")
            .bind(head.0)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((attempts, waiting_on), (0, vec!["kafka".to_string()]));

    let second = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(second.rows.len(), 1, "{:?}", second.rows);
    assert_eq!(seq(&second.rows[0]), 1);
    assert_eq!(second.rows[0].held_by, ["kafka"]);
    store
        .ack(second.lease, &[waiting(second.rows[0].id)])
        .await
        .unwrap();

    let third = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(third.rows.len(), 1, "{:?}", third.rows);
    assert_eq!(seq(&third.rows[0]), 2);
    assert_eq!(third.rows[0].held_by, ["kafka"]);
    store
        .ack(third.lease, &[outcome(third.rows[0].id, Outcome::Published)])
        .await
        .unwrap();

    assert_eq!(store.waiting_by_target().await.unwrap()["kafka"], 2);
    assert_eq!(store.wake_waiting(Some("nats")).await.unwrap(), 0);
    assert_eq!(store.wake_waiting(Some("kafka")).await.unwrap(), 2);
    assert!(store.waiting_by_target().await.unwrap().is_empty());
    // Woken, the two are ordinary pending rows again: the head first.
    let again = store.claim("a", 10, LEASE).await.unwrap();
    assert_eq!(again.rows.len(), 1, "{:?}", again.rows);
    assert_eq!(again.rows[0].id, head);
    assert!(again.rows[0].held_by.is_empty());
}

/// Another process runs `migrate`, creating the intake, while this store
/// claims: the claim that sees the table tells the next, which moves its
/// rows (a relay deployed before the migration would otherwise never move
/// them). An intake dropped under it costs one failed claim, not all.
#[tokio::test]
async fn claims_move_intake_rows_once_another_process_creates_the_intake() {
    let db = fresh_db_before(INTAKE_MIGRATION).await;
    let store = OutboxStore::new(db.pool.clone());
    assert!(store.claim("a", 10, LEASE).await.unwrap().rows.is_empty());
    OutboxStore::new(db.pool.clone()).migrate().await.unwrap();
    place_event(&db.pool, Outbox::Intake, &event(1, 0), true).await;
    let mut claimed = Vec::new();
    for _ in 0..2 {
        claimed.extend(store.claim("a", 10, LEASE).await.unwrap().rows);
    }
    assert_eq!(claimed.len(), 1, "the intake row moved and claimed");

    sqlx::query("DROP TABLE switchyard_intake")
        .execute(&db.pool)
        .await
        .unwrap();
    place_order_event(&db.pool, &event(2, 0), true).await;
    let refused = store.claim("a", 10, LEASE).await.unwrap_err().to_string();
    assert!(refused.contains("switchyard_intake"), "{refused}");
    assert_eq!(store.claim("a", 10, LEASE).await.unwrap().rows.len(), 1);
}

/// The movers' lock is taken inside the claim's statement, after its
/// snapshot: another mover can commit in between. Its first row of an
/// aggregate is then in the outbox where this claim cannot see it, and the
/// next row, still in the intake as this claim sees it, would look like the
/// aggregate's head and be leased beside the first. Here the claim takes
/// the lock first and the other move's row lock holds it on the first row
/// until that move commits: the same order of events, made certain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_snapshot_predates_another_move_leases_nothing_it_moves() {
    let db = fresh_db().await;
    let store = OutboxStore::new(db.pool.clone());
    for seq in 0..2 {
        place_event(&db.pool, Outbox::Intake, &event(7, seq), true).await;
    }
    place_event(&db.pool, Outbox::Intake, &event(8, 0), true).await;
    let mut mover = db.pool.begin().await.unwrap();
    move_first_intake_row(&mut mover).await;

    let claiming = {
        let store = store.clone();
        tokio::spawn(async move { store.claim("late", 10, LEASE).await })
    };
    // The claim has its snapshot and waits on the first intake row (the
    // only session here that can wait on a lock).
    let waiting = "SELECT count(*) FROM pg_stat_activity
                    WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let started = std::time::Instant::now();
    while sqlx::query_scalar::<_, i64>(waiting)
        .fetch_one(&db.pool)
        .await
        .unwrap()
        == 0
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the claim never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    mover.commit().await.unwrap();
    let late = claiming.await.unwrap().unwrap();
    let leased: Vec<_> = late.rows.iter().map(|row| row.aggregate_id.as_str()).collect();
    assert!(
        !leased.contains(&"o-7"),
        "o-7's second event leased beside its first: {leased:?}"
    );
    publish_all(&store, &late).await;

    // The next claims take o-7's events one at a time, in order; none is lost.
    let mut seen = Vec::new();
    for _ in 0..4 {
        let claim = store.claim("next", 10, LEASE).await.unwrap();
        let o7: Vec<_> = claim
            .rows
            .iter()
            .filter(|row| row.aggregate_id == "o-7")
            .collect();
        assert!(o7.len() <= 1, "{o7:?}");
        seen.extend(o7.iter().map(|row| row.payload_json.clone().unwrap_or_default()));
        publish_all(&store, &claim).await;
    }
    assert_eq!(seen, ["{\"seq\": 0}", "{\"seq\": 1}"]);
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.delayed), (0, 0), "{stats:?}");
    let published: i64 =
        sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = 'published'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(published, 3, "o-7's two events and o-8's");
}
