//! The schema: older generations are brought forward by `migrate`, test
//! databases go away, and the database's defaults do not reach the
//! relay's statements.

use super::*;

/// Each test's database goes away with the test, instead of piling up.
#[tokio::test]
async fn test_databases_are_dropped_when_the_test_ends() {
    let db = fresh_db().await;
    let name = db.name.clone();
    drop(db);
    let admin = switchyard_tests::postgres::server_pool().await;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(&name)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(!exists, "database {name} is still there");
}

/// Every schema an older release could have left, on both backends: one
/// older than the previous generation is refused with what to do, the
/// previous generation is served as it is, and `migrate` brings each to the
/// current generation with its events claimed in order.
#[tokio::test]
async fn migrate_brings_every_older_schema_forward_and_serves_its_events() {
    for migration in switchyard::store::MIGRATOR.iter().skip(1) {
        let db = fresh_db_before(migration.version).await;
        for (aggregate, seq) in [(0, 0), (1, 0), (0, 1)] {
            place_order_event(&db.pool, &event(aggregate, seq), true).await;
        }
        let store = OutboxStore::new(db.pool.clone());
        let what = format!("PostgreSQL before {}", migration.version);
        serve_then_migrate(&store, migration.version > 20_261_202_000_000, &what).await;
    }
    for migration in switchyard::store::SQLITE_MIGRATOR.iter().skip(1) {
        let path = std::env::temp_dir().join(format!("sy-{}.db", uuid::Uuid::new_v4().simple()));
        let url = format!("sqlite://{}", path.display());
        let store = OutboxStore::connect(&url, 2).await.unwrap();
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        let older: Vec<_> = switchyard::store::SQLITE_MIGRATOR
            .iter()
            .filter(|m| m.version < migration.version)
            .cloned()
            .collect();
        sqlx::migrate::Migrator {
            migrations: older.into(),
            ..sqlx::migrate::Migrator::DEFAULT
        }
        .run(&pool)
        .await
        .unwrap();
        for (aggregate, seq) in [(0, 0), (1, 0), (0, 1)] {
            sqlx::query(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', $1, 'OrderUpdated', $2)",
            )
            .bind(format!("o-{aggregate}"))
            .bind(format!("{{\"seq\": {seq}}}"))
            .execute(&pool)
            .await
            .unwrap();
        }
        let what = format!("SQLite before {}", migration.version);
        serve_then_migrate(&store, migration.version > 20_261_129_000_000, &what).await;
        pool.close().await;
        let _ = std::fs::remove_file(&path);
    }
}

/// Claims from `store` before `migrate` when it is `served` (else checks
/// the refusal), migrates, and claims the rest: three events, two
/// aggregates, each once and in order.
async fn serve_then_migrate(store: &OutboxStore, served: bool, what: &str) {
    let mut claimed = Vec::new();
    match store.generation().await {
        Ok(generation) => {
            assert!(served, "{what}: served as {generation:?}");
            claimed.extend(claim_and_publish(store).await);
            assert_eq!(claimed.len(), 2, "{what}: the two heads");
        }
        Err(refused) => {
            assert!(!served, "{what}: {refused}");
            assert!(
                refused.to_string().contains("run `switchyard migrate`"),
                "{what}: {refused}"
            );
            // SQLite's one relay checks before it starts; PostgreSQL's
            // claims pick their statement by the generation, and refuse.
            if store.kind() == "postgres" {
                let claim = store.claim("upgrade", 10, LEASE).await.unwrap_err();
                assert!(
                    claim.to_string().contains("older than this relay serves"),
                    "{what}: {claim}"
                );
            }
        }
    }
    store.migrate().await.unwrap();
    assert_eq!(store.generation().await.unwrap(), Generation::Current, "{what}");
    for _ in 0..3 {
        claimed.extend(claim_and_publish(store).await);
    }
    let first_aggregate: Vec<u64> = claimed
        .iter()
        .filter(|(id, _)| id == "o-0")
        .map(|(_, seq)| *seq)
        .collect();
    assert_eq!(first_aggregate, [0, 1], "{what}: in order");
    claimed.sort();
    let want = [
        ("o-0".to_string(), 0),
        ("o-0".to_string(), 1),
        ("o-1".to_string(), 0),
    ];
    assert_eq!(claimed, want, "{what}: each event once");
}

/// One claim, acked as published: (aggregate, seq) of each row.
async fn claim_and_publish(store: &OutboxStore) -> Vec<(String, u64)> {
    let claim = store.claim("upgrade", 10, LEASE).await.unwrap();
    publish_all(store, &claim).await;
    claim
        .rows
        .iter()
        .map(|row| (row.aggregate_id.clone(), seq(row)))
        .collect()
}

/// A DBA may make SERIALIZABLE (or REPEATABLE READ) the database's default
/// isolation. The claim and ack are written for READ COMMITTED, where a row
/// another claim just changed is re-checked or skipped; at a stricter level
/// PostgreSQL fails such statements with serialization errors instead.
#[tokio::test]
async fn a_stricter_default_isolation_does_not_reach_the_relays_statements() {
    let db = fresh_db().await;
    sqlx::query(&format!(
        "ALTER DATABASE {} SET default_transaction_isolation = 'serializable'",
        db.name
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    const AGGREGATES: usize = 12;
    const EVENTS: usize = 30;
    for seq in 0..EVENTS {
        for aggregate in 0..AGGREGATES {
            place_order_event(&db.pool, &event(aggregate, seq), true).await;
        }
    }
    let store = OutboxStore::connect(&db.url, 12).await.unwrap();
    let errors = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut workers = Vec::new();
    for worker in 0..4 {
        let store = store.clone();
        let errors = errors.clone();
        workers.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < deadline {
                let claim = match store.claim(&format!("w{worker}"), 5, LEASE).await {
                    Ok(claim) => claim,
                    Err(error) => {
                        errors.lock().unwrap().push(format!("claim: {error}"));
                        continue;
                    }
                };
                if claim.rows.is_empty() {
                    if store.backlog().await.unwrap().0 == 0 {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                let outcomes: Vec<RowOutcome> = claim
                    .rows
                    .iter()
                    .map(|row| outcome(row.id, Outcome::Published))
                    .collect();
                if let Err(error) = store.ack(claim.lease, &outcomes).await {
                    errors.lock().unwrap().push(format!("ack: {error}"));
                }
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    let errors = std::mem::take(&mut *errors.lock().unwrap());
    assert!(
        errors.is_empty(),
        "{} errors, first: {:?}",
        errors.len(),
        errors.first()
    );
    assert_eq!(store.backlog().await.unwrap().0, 0);
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status <> 'published'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(dead, 0);
}

/// A MariaDB outbox the relay cannot claim from is refused at start (and
/// by `validate`, which runs the same check), naming what to change: a
/// table without the transactions and row locks claims need, and one made
/// by hand without the columns the relay reads. The migrated table passes.
#[tokio::test]
async fn a_mariadb_table_the_relay_cannot_claim_from_is_named() {
    let db = TestOutbox::mariadb().await;
    let report = db.store.server_report().await.unwrap();
    assert!(
        report.problems.is_empty() && report.warnings.is_empty(),
        "{report:?}"
    );
    switchyard::runtime::check_claim_mode(&db.store).await.unwrap();

    db.execute("ALTER TABLE switchyard_outbox ENGINE = MyISAM").await;
    let refused = switchyard::runtime::check_claim_mode(&db.store)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("switchyard_outbox is a MyISAM table"),
        "{refused}"
    );
    assert!(refused.contains("ENGINE = InnoDB"), "{refused}");

    db.execute(
        "ALTER TABLE switchyard_outbox ENGINE = InnoDB, DROP COLUMN parked, DROP COLUMN waiting_on, DROP COLUMN aggregate_key",
    )
    .await;
    let refused = switchyard::runtime::check_claim_mode(&db.store)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("has no column waiting_on, aggregate_key"),
        "{refused}"
    );
}

/// Each MariaDB test database goes away with its test, even when the test
/// left a transaction open in it.
#[tokio::test]
async fn mariadb_test_databases_are_dropped_when_the_test_ends() {
    let db = TestOutbox::mariadb().await;
    let name = db.url.rsplit('/').next().unwrap().to_string();
    let held = db.hold("SELECT id FROM switchyard_outbox FOR UPDATE").await;
    std::mem::forget(held);
    drop(db);
    let admin = switchyard_tests::outbox::TestOutbox::mariadb().await;
    let left = admin
        .scalar(&format!(
            "SELECT count(*) FROM information_schema.schemata WHERE schema_name = '{name}'"
        ))
        .await;
    assert_eq!(left, 0, "database {name} is still there");
}
