//! Fencing: leases, ownership and cancellation. A relay that lost its
//! lease or its database cannot record outcomes, and a cancelled statement
//! loses nothing.

use super::*;

on_every_backend!(
    a_worker_that_lost_its_lease_cannot_ack,
    shutdown_release_makes_rows_claimable_without_counting_an_attempt,
    a_database_is_owned_by_one_relay_at_a_time,
);

/// A fleet's ownership of a database: taken when free, renewed and given
/// up only with its token, read back as each backend stores it.
async fn a_database_is_owned_by_one_relay_at_a_time(db: TestOutbox) {
    let free = db.store.ownership(LEASE).await.unwrap();
    assert_eq!((free.owner, free.held), (None, false));
    let token = db
        .store
        .take_ownership("relay-a", LEASE)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(db.store.take_ownership("relay-b", LEASE).await.unwrap(), None);
    assert!(
        !db.store
            .renew_ownership("relay-a", token + 1, LEASE)
            .await
            .unwrap()
    );
    assert!(db.store.renew_ownership("relay-a", token, LEASE).await.unwrap());
    let held = db.store.ownership(LEASE).await.unwrap();
    assert_eq!((held.owner.as_deref(), held.held), (Some("relay-a"), true));
    assert_eq!(held.free_for, Duration::ZERO);
    db.store.release_ownership("relay-a", token).await.unwrap();
    assert!(!db.store.ownership(LEASE).await.unwrap().held);
    assert!(db.store.take_ownership("relay-b", LEASE).await.unwrap().is_some());
}

async fn a_worker_that_lost_its_lease_cannot_ack(db: TestOutbox) {
    db.insert(0, 0, None).await;
    let slow = db
        .store
        .claim("slow", 10, Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(slow.rows.len(), 1);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let fast = db.store.claim("fast", 10, LEASE).await.unwrap();
    assert_eq!(fast.rows.len(), 1, "an expired lease is claimable again");
    assert_eq!(fast.rows[0].attempts, 2);

    let id = slow.rows[0].id;
    let stale = db
        .store
        .ack(
            slow.lease,
            &[outcome(
                id,
                Outcome::Dead {
                    error: "stale".into(),
                },
            )],
        )
        .await
        .unwrap();
    assert!(stale.is_empty(), "the stale worker's ack must not land");
    let fresh = db
        .store
        .ack(fast.lease, &[outcome(id, Outcome::Published)])
        .await
        .unwrap();
    assert_eq!(fresh, vec![id]);
    assert_eq!(db.status_of(id.0).await.0, "published");
}

async fn shutdown_release_makes_rows_claimable_without_counting_an_attempt(db: TestOutbox) {
    db.insert(0, 0, None).await;
    assert_eq!(db.store.claim("leaving", 10, LEASE).await.unwrap().rows.len(), 1);
    assert_eq!(db.store.release_owner("leaving").await.unwrap(), 1);
    let again = db.store.claim("other", 10, LEASE).await.unwrap();
    assert_eq!(again.rows.len(), 1);
    assert_eq!(again.rows[0].attempts, 1);
}

/// A claim that cannot finish in half its lease is of no use: its rows could
/// not be published in time. It is cancelled there, whether the bound comes
/// with the relay's sessions (a claim is then one statement) or with the
/// claim's own transaction (a pool made elsewhere), and the next claim, once
/// the table is free, takes the row.
#[tokio::test]
async fn a_claim_stuck_past_half_the_lease_is_cancelled_on_either_path() {
    let db = fresh_db().await;
    place_order_event(&db.pool, &event(1, 0), true).await;
    let lease = Duration::from_millis(800);
    let relays = [
        (
            "relay sessions",
            OutboxStore::connect_bounded(&db.url, 2, "switchyard-test", Some(lease / 2))
                .await
                .unwrap(),
        ),
        ("a pool made elsewhere", OutboxStore::new(db.pool.clone())),
    ];
    for (what, store) in &relays {
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("LOCK TABLE switchyard_outbox IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *holder)
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let stuck = store.claim("a", 10, lease).await;
        let took = started.elapsed();
        holder.rollback().await.unwrap();
        assert!(
            matches!(stuck, Err(switchyard::store::Error::ClaimTimedOut { .. })),
            "{what}: {stuck:?}"
        );
        assert!(took < Duration::from_secs(10), "{what}: cancelled after {took:?}");
    }
    let (_, store) = &relays[0];
    let claim = store.claim("a", 10, Duration::from_secs(60)).await.unwrap();
    assert_eq!(claim.rows.len(), 1, "the row is claimed once the table is free");
}

/// A DBA may set `lock_timeout` or `statement_timeout` on the relay's role,
/// and then an ack is cancelled now and then: here, waiting for a session
/// that holds its row `FOR SHARE` (as a claim does, briefly, with the row
/// an event waits behind). That is not the database refusing the row's
/// outcome: the row was published and must not be dead-lettered. The ack
/// is tried again; if the row is held longer than that, the ack fails and
/// the row comes back when its lease ends.
#[tokio::test]
async fn a_cancelled_ack_does_not_dead_letter_a_published_row() {
    let db = fresh_db().await;
    sqlx::query(&format!("ALTER DATABASE {} SET lock_timeout = '300ms'", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let store = OutboxStore::connect(&db.url, 4).await.unwrap();
    for (aggregate, held_ms, recorded) in [(1, 500, "published"), (2, 3_000, "in_flight")] {
        place_order_event(&db.pool, &event(aggregate, 0), true).await;
        let claim = store.claim("a", 10, LEASE).await.unwrap();
        assert_eq!(claim.rows.len(), 1);
        let id = claim.rows[0].id;
        let mut holder = db.pool.begin().await.unwrap();
        sqlx::query("SET LOCAL lock_timeout = 0")
            .execute(&mut *holder)
            .await
            .unwrap();
        sqlx::query("SELECT 1 FROM switchyard_outbox WHERE id = $1 FOR SHARE")
            .bind(id.0)
            .execute(&mut *holder)
            .await
            .unwrap();
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(held_ms)).await;
            holder.commit().await.unwrap();
        });
        let acked = store.ack(claim.lease, &[outcome(id, Outcome::Published)]).await;
        release.await.unwrap();
        let (status, error) = sqlx::query_as::<_, (String, Option<String>)>(
            "SELECT status, last_error FROM switchyard_outbox WHERE id = $1",
        )
        .bind(id.0)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(status, recorded, "held {held_ms} ms: {error:?}, ack {acked:?}");
        match acked {
            Ok(ids) => assert_eq!(ids, [id]),
            Err(error) => assert!(error.to_string().contains("lock timeout"), "{error}"),
        }
    }
}

/// A statement cancelled in the row-by-row pass (a row refused, the next
/// one locked past `lock_timeout`) is tried again alone. Sending the whole
/// batch again found the rows recorded before it no longer under the
/// lease, and reported them lost.
#[tokio::test]
async fn a_cancelled_statement_in_the_row_by_row_pass_keeps_what_was_recorded() {
    let db = fresh_db().await;
    sqlx::query(&format!("ALTER DATABASE {} SET lock_timeout = '300ms'", db.name))
        .execute(&db.pool)
        .await
        .unwrap();
    let store = OutboxStore::connect(&db.url, 4).await.unwrap();
    for aggregate in 0..3 {
        place_order_event(&db.pool, &event(aggregate, 0), true).await;
    }
    let claim = store.claim("a", 10, LEASE).await.unwrap();
    let mut ids: Vec<RowId> = claim.rows.iter().map(|row| row.id).collect();
    ids.sort_unstable_by_key(|id| id.0);
    let mut outcomes: Vec<_> = ids.iter().map(|id| outcome(*id, Outcome::Published)).collect();
    // PostgreSQL text refuses NUL: the batch falls back to row by row.
    outcomes[1].plugin_version = Some("bad\u{0}version".into());
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = 0")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query("SELECT 1 FROM switchyard_outbox WHERE id = $1 FOR SHARE")
        .bind(ids[2].0)
        .execute(&mut *holder)
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        holder.commit().await.unwrap();
    });
    let mut acked = store.ack(claim.lease, &outcomes).await.unwrap();
    release.await.unwrap();
    acked.sort_unstable_by_key(|id| id.0);
    assert_eq!(acked, ids, "every row recorded is reported recorded");
    let statuses: Vec<String> = sqlx::query_scalar("SELECT status FROM switchyard_outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(statuses, ["published", "dead", "published"]);
}

/// A relay's announcement forgets relays unseen for a day (killed ones, or
/// fleets restarted under new names, leave their rows) and keeps the rest.
#[tokio::test]
async fn an_announcement_forgets_relays_unseen_for_a_day() {
    for outbox in [TestOutbox::postgres().await, TestOutbox::sqlite().await] {
        let day_ms = switchyard::store::FORGOTTEN_AFTER.as_millis();
        let ago = |ms: u128| match outbox.kind {
            "sqlite" => format!("CAST(unixepoch('subsec') * 1000 AS INTEGER) - {ms}"),
            _ => format!("now() - {ms} * interval '1 millisecond'"),
        };
        outbox
            .execute(&format!(
                "INSERT INTO switchyard_relays (instance_id, seen_at) VALUES
                 ('killed-long-ago', {}), ('quiet-an-hour', {})",
                ago(day_ms + 60_000),
                ago(3_600_000)
            ))
            .await;
        outbox.store.announce_relay("me", None).await.unwrap();
        let left: Vec<String> = outbox
            .store
            .running_relays(switchyard::store::FORGOTTEN_AFTER * 2)
            .await
            .unwrap()
            .into_iter()
            .map(|relay| relay.instance_id)
            .collect();
        let mut left = left;
        left.sort();
        assert_eq!(left, ["me", "quiet-an-hour"], "{}", outbox.kind);
    }
}
