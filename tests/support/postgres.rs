//! A fresh, migrated database per test on the PostgreSQL that
//! `scripts/services.sh start` runs (URL from `DATABASE_URL`).

use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};

use super::config::Source;

/// The server URL; defaults to the port the project script uses.
pub fn server_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:55432/postgres".to_string())
}

/// The cluster that takes only TLS (`scripts/services.sh` makes its
/// certificates and starts it): verify-full against its CA, by host name.
pub fn tls_server_url() -> String {
    std::env::var("SWITCHYARD_PG_TLS_URL").unwrap_or_else(|_| {
        format!(
            "postgres://postgres@localhost:55433/postgres?sslmode=verify-full&sslrootcert={}",
            tls_file("ca.pem")
        )
    })
}

/// A file among the test certificates and keys.
pub fn tls_file(name: &str) -> String {
    let dir = std::env::var("SWITCHYARD_TLS_DIR").unwrap_or_else(|_| "/tmp/switchyard-services/tls".into());
    format!("{dir}/{name}")
}

/// `server` with database `name` instead of its own, its parameters kept.
pub fn on_database(server: &str, name: &str) -> String {
    let mut url = url::Url::parse(server).unwrap_or_else(|e| panic!("{server} is not a URL: {e}"));
    url.set_path(&format!("/{name}"));
    url.to_string()
}

/// A one-connection pool on the server's default database, for admin statements.
///
/// # Panics
/// When PostgreSQL is not reachable: start it with `scripts/services.sh start`.
pub async fn server_pool() -> PgPool {
    admin_pool(&server_url()).await
}

/// [`server_pool`] on `server`.
///
/// # Panics
/// As [`server_pool`].
pub async fn admin_pool(server: &str) -> PgPool {
    let server = server.to_string();
    PgPoolOptions::new()
        .max_connections(1)
        .connect(&server)
        .await
        .unwrap_or_else(|e| {
            panic!("PostgreSQL at {server} is not reachable ({e}); run scripts/services.sh start")
        })
}

/// A database created for one test; dropped when this goes away.
pub struct TestDb {
    /// Pool on the new database.
    pub pool: PgPool,
    /// Its URL, for relays in other processes.
    pub url: String,
    /// Its name.
    pub name: String,
    /// Drops the database at the end of the test (passed or failed).
    pub guard: DropDatabase,
}

/// Drops a test database when dropped, forcing out connections still open
/// (pools, relay processes). `scripts/test.sh` also clears leftovers of
/// test runs that were killed before their guards ran.
/// Drops the replication slots of database `name` (a database with a slot
/// cannot be dropped), ending the sessions that read them first.
///
/// # Errors
/// The database's.
pub async fn drop_slots(admin: &mut sqlx::PgConnection, name: &str) -> Result<(), sqlx::Error> {
    for _ in 0..50 {
        sqlx::query("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL")
            .bind(name)
            .execute(&mut *admin)
            .await?;
        let dropped = sqlx::query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active",
        )
        .bind(name)
        .execute(&mut *admin)
        .await;
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots WHERE database = $1")
            .bind(name)
            .fetch_one(&mut *admin)
            .await?;
        if dropped.is_ok() && left == 0 {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Ok(())
}

pub struct DropDatabase {
    name: String,
    server: String,
}

impl Drop for DropDatabase {
    fn drop(&mut self) {
        let name = std::mem::take(&mut self.name);
        let server = std::mem::take(&mut self.server);
        super::clean_up_in_drop("drop a test database", async move {
            use sqlx::Connection;
            let mut admin = sqlx::PgConnection::connect(&server).await?;
            drop_slots(&mut admin, &name).await?;
            admin
                .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                .await?;
            admin.close().await?;
            Ok(())
        });
    }
}

/// Creates an empty database with the outbox schema and an `orders` table
/// standing in for an application's business data.
///
/// # Panics
/// When PostgreSQL is not reachable: start it with `scripts/services.sh start`.
pub async fn fresh_db() -> TestDb {
    fresh_db_before(i64::MAX).await
}

/// The migration that created `switchyard_intake`.
pub const INTAKE_MIGRATION: i64 = 20_261_204_000_000;

/// Makes every commit so far durable and readable from the WAL: the
/// project's PostgreSQL commits with `synchronous_commit` off, and its WAL
/// writer can leave the last page of those commits unwritten for seconds
/// (a crash then loses them; a slot and `pg_walinspect` do not read them
/// yet). One commit that waits for its flush takes all the WAL before it
/// along; it must write something, or PostgreSQL does not wait.
pub async fn flush_wal(pool: &PgPool) {
    sqlx::query("CREATE TABLE IF NOT EXISTS test_wal_flush (at timestamptz)")
        .execute(pool)
        .await
        .expect("a table to write to");
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SET LOCAL synchronous_commit = on")
        .execute(&mut *tx)
        .await
        .expect("synchronous_commit");
    sqlx::query("INSERT INTO test_wal_flush VALUES (now())")
        .execute(&mut *tx)
        .await
        .expect("a write to wait for");
    tx.commit().await.expect("a commit that flushes the WAL");
}

/// Runs the outbox migrations older than `version`: an outbox as an older
/// release left it.
///
/// # Errors
/// When a migration fails.
pub async fn migrate_before(pool: &PgPool, version: i64) -> Result<(), sqlx::migrate::MigrateError> {
    let migrations: Vec<_> = switchyard::store::MIGRATOR
        .migrations
        .iter()
        .filter(|m| m.version < version)
        .cloned()
        .collect();
    sqlx::migrate::Migrator {
        migrations: migrations.into(),
        ..sqlx::migrate::Migrator::DEFAULT
    }
    .run(pool)
    .await
}

/// Like [`fresh_db`], with only the migrations older than `version`.
///
/// # Panics
/// When PostgreSQL is not reachable: start it with `scripts/services.sh start`.
pub async fn fresh_db_before(version: i64) -> TestDb {
    fresh_db_on(&server_url(), version).await
}

/// A fresh database on the TLS cluster ([`tls_server_url`]), migrated.
///
/// # Panics
/// As [`fresh_db`].
pub async fn fresh_tls_db() -> TestDb {
    fresh_db_on(&tls_server_url(), i64::MAX).await
}

async fn fresh_db_on(server: &str, version: i64) -> TestDb {
    let admin = admin_pool(server).await;
    let name = format!("sy_{}", uuid::Uuid::new_v4().simple());
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .expect("create test database");
    admin.close().await;
    let url = on_database(server, &name);
    let pool = PgPoolOptions::new()
        .max_connections(24)
        .connect(&url)
        .await
        .expect("connect to test database");
    migrate_before(&pool, version).await.expect("migrate");
    pool.execute(
        "CREATE TABLE orders (id TEXT PRIMARY KEY, status TEXT NOT NULL, total_cents BIGINT NOT NULL, updated_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )
    .await
    .expect("create orders");
    TestDb {
        pool,
        url,
        guard: DropDatabase {
            name: name.clone(),
            server: server.to_string(),
        },
        name,
    }
}

/// One event as an application would write it.
#[derive(Debug, Clone)]
pub struct NewEvent {
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// JSON payload.
    pub payload: serde_json::Value,
    /// Headers.
    pub headers: serde_json::Value,
}

/// The outbox table a service writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outbox {
    /// `switchyard_outbox`.
    Switchyard,
    /// `switchyard_intake`: the event columns and a primary key; the claim
    /// moves its rows into `switchyard_outbox`.
    Intake,
    /// A table of the service's own in Debezium's outbox-router shape
    /// ([`DEBEZIUM_OUTBOX`]); the service knows nothing of Switchyard.
    Debezium,
    /// No row at all: `switchyard_emit` writes a logical message into the
    /// WAL (replication mode).
    Emitted,
}

/// Debezium's outbox table, as services using its outbox router create it.
pub const DEBEZIUM_OUTBOX: &str = r#"CREATE TABLE outbox (
    id                 uuid PRIMARY KEY,
    aggregatetype      varchar(255) NOT NULL,
    aggregateid        varchar(255) NOT NULL,
    type               varchar(255) NOT NULL,
    payload            jsonb,
    "timestamp"        timestamptz NOT NULL DEFAULT now(),
    tracingspancontext varchar(256)
)"#;

/// `[source]` mapping [`DEBEZIUM_OUTBOX`] (the W3C trace context travels in
/// `tracingspancontext`).
pub fn debezium_source() -> Source {
    Source::table("outbox")
        .set("order_by", "timestamp")
        .column("event_id", "id")
        .column("aggregate_type", "aggregatetype")
        .column("aggregate_id", "aggregateid")
        .column("event_type", "type")
        .column("payload", "payload")
        .header_column("traceparent", "tracingspancontext")
}

/// The sample order service: one business transaction updates the order row
/// and writes the outbox row, committing both or neither. Returns the event id.
pub async fn place_order_event(pool: &PgPool, event: &NewEvent, commit: bool) -> uuid::Uuid {
    place_event(pool, Outbox::Switchyard, event, commit).await
}

/// Moves the intake's first row into the outbox in `tx`, as a claim's move
/// does, left uncommitted for the caller to time.
pub async fn move_first_intake_row(tx: &mut sqlx::PgConnection) {
    sqlx::query(
        "WITH first AS (DELETE FROM switchyard_intake
                         WHERE id = (SELECT min(id) FROM switchyard_intake) RETURNING *)
         INSERT INTO switchyard_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
         SELECT event_id, aggregate_type, aggregate_id, event_type, payload, headers FROM first",
    )
    .execute(tx)
    .await
    .expect("move the intake's first row");
}

/// [`place_order_event`] into the given outbox table.
pub async fn place_event(pool: &PgPool, outbox: Outbox, event: &NewEvent, commit: bool) -> uuid::Uuid {
    try_place_event(pool, outbox, event, commit)
        .await
        .unwrap_or_else(|e| panic!("placing an order event: {e}"))
}

/// [`place_event`], saying why it failed instead of panicking (a writer
/// that goes on through a database outage).
pub async fn try_place_event(
    pool: &PgPool,
    outbox: Outbox,
    event: &NewEvent,
    commit: bool,
) -> Result<uuid::Uuid, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let event_id = insert_event(&mut tx, outbox, event).await?;
    if commit {
        tx.commit().await?;
    } else {
        tx.rollback().await?;
    }
    Ok(event_id)
}

/// Writes `event` inside a service's transaction: the order row updated and
/// the event written through `outbox`. Returns the event id.
///
/// # Errors
/// The database's.
pub async fn insert_event(
    conn: &mut sqlx::PgConnection,
    outbox: Outbox,
    event: &NewEvent,
) -> Result<uuid::Uuid, sqlx::Error> {
    sqlx::query(
        "INSERT INTO orders (id, status, total_cents) VALUES ($1, $2, $3)
         ON CONFLICT (id) DO UPDATE SET status = EXCLUDED.status, updated_at = now()",
    )
    .bind(&event.aggregate_id)
    .bind(&event.event_type)
    .bind(
        event
            .payload
            .get("total_cents")
            .and_then(serde_json::Value::as_i64)
            .unwrap_or(0),
    )
    .execute(&mut *conn)
    .await?;
    let event_id: uuid::Uuid = match outbox {
        Outbox::Switchyard | Outbox::Intake => sqlx::query_scalar(if outbox == Outbox::Intake {
            "INSERT INTO switchyard_intake (aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ($1, $2, $3, $4, $5) RETURNING event_id"
        } else {
            "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ($1, $2, $3, $4, $5) RETURNING event_id"
        })
        .bind(&event.aggregate_type)
        .bind(&event.aggregate_id)
        .bind(&event.event_type)
        .bind(&event.payload)
        .bind(&event.headers),
        Outbox::Debezium => sqlx::query_scalar(
            "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, tracingspancontext)
             VALUES (gen_random_uuid(), $1, $2, $3, $4, $5 ->> 'traceparent') RETURNING id",
        )
        .bind(&event.aggregate_type)
        .bind(&event.aggregate_id)
        .bind(&event.event_type)
        .bind(&event.payload)
        .bind(&event.headers),
        Outbox::Emitted => sqlx::query_scalar("SELECT switchyard_emit($1, $2, $3, $4, $5)")
            .bind(&event.aggregate_type)
            .bind(&event.aggregate_id)
            .bind(&event.event_type)
            .bind(&event.payload)
            .bind(&event.headers),
    }
    .fetch_one(&mut *conn)
    .await?;
    Ok(event_id)
}

/// Counts rows by status.
pub async fn count_status(pool: impl Into<super::service::ServicePool>, status: &str) -> i64 {
    pool.into().count_status(status).await
}

/// Rows that took more than one attempt: an outage or a refused
/// credential that should have spent none spent one on each of these.
pub async fn spent_attempts(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE attempts > 1")
        .fetch_one(pool)
        .await
        .expect("count the rows past their first attempt")
}

/// Waits until `total` rows are published, failing the test after `limit`
/// with the rows' statuses, or at once when dead rows leave `total` out
/// of reach (a dead row is never published), with their errors.
pub async fn all_published(
    pool: impl Into<super::service::ServicePool>,
    total: i64,
    limit: std::time::Duration,
) {
    let pool = pool.into();
    let started = std::time::Instant::now();
    loop {
        let statuses = pool.statuses().await;
        let count = |name: &str| statuses.iter().find(|(s, _)| s == name).map_or(0, |(_, n)| *n);
        let (published, dead) = (count("published"), count("dead"));
        if published == total {
            return;
        }
        let all: i64 = statuses.iter().map(|(_, n)| n).sum();
        if dead > 0 && all - dead < total {
            let errors = pool.first_dead().await;
            panic!(
                "{dead} rows dead-lettered, so {total} cannot be published ({statuses:?}); the first: {errors:?}"
            );
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {total} rows published: {statuses:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Holds commits between their WAL flush and their visibility, as a
/// synchronous standby that never answers does: while it lives, the
/// server names a synchronous standby nobody is, so a session with
/// `synchronous_commit = on` waits at COMMIT with its commit record
/// flushed (a WAL reader hands the transaction out) while other sessions
/// cannot see it yet. Sessions with the cluster's `synchronous_commit =
/// off` are not held. Dropping it restores the server's setting.
pub struct CommitHold {
    server: String,
}

/// The synchronous standby nobody is.
const NOBODY: &str = "switchyard_test_nobody";

impl CommitHold {
    /// Turns the hold on, and returns once the server holds commits (a
    /// probe commit is seen waiting for its standby, then let go).
    pub async fn on() -> CommitHold {
        let server = server_url();
        let admin = server_pool().await;
        let hold = CommitHold { server };
        sqlx::query(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '{NOBODY}'"
        ))
        .execute(&admin)
        .await
        .expect("alter system");
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&admin)
            .await
            .expect("reload");
        // The checkpointer reads the setting a moment after the reload.
        crate::eventually(
            "the server to hold commits",
            std::time::Duration::from_secs(30),
            || async {
                let mut probe = HeldCommit::start(&server_url(), |conn| {
                    Box::pin(async move {
                        // A commit that wrote WAL waits; an id alone writes none.
                        sqlx::query("CREATE TEMP TABLE switchyard_probe (x int)")
                            .execute(&mut *conn)
                            .await?;
                        Ok(())
                    })
                })
                .await;
                let held = probe.wait_held(std::time::Duration::from_millis(500)).await;
                let _ = probe.release().await;
                held.then_some(())
            },
        )
        .await;
        hold
    }
}

impl Drop for CommitHold {
    fn drop(&mut self) {
        for sql in [
            "ALTER SYSTEM RESET synchronous_standby_names",
            "SELECT pg_reload_conf()",
        ] {
            let _ = std::process::Command::new("psql")
                .args([self.server.as_str(), "-qAt", "-c", sql])
                .stdout(std::process::Stdio::null())
                .status();
        }
    }
}

/// A transaction whose COMMIT waits for the synchronous standby of a
/// [`CommitHold`]: written, flushed, not yet visible to other sessions.
pub struct HeldCommit {
    pid: i32,
    server: String,
    commit: Option<tokio::task::JoinHandle<Result<(), sqlx::Error>>>,
}

impl HeldCommit {
    /// Opens a session on `url` with `synchronous_commit = on`, runs
    /// `writes` in a transaction and sends its COMMIT (which the hold
    /// keeps waiting).
    pub async fn start<F>(url: &str, writes: F) -> HeldCommit
    where
        F: for<'c> FnOnce(
                &'c mut sqlx::PgConnection,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'c>,
            > + Send
            + 'static,
    {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .expect("pid");
        sqlx::query("SET synchronous_commit = on")
            .execute(&mut conn)
            .await
            .expect("set");
        let commit = tokio::spawn(async move {
            sqlx::query("BEGIN").execute(&mut conn).await?;
            writes(&mut conn).await?;
            sqlx::query("COMMIT").execute(&mut conn).await?;
            Ok(())
        });
        HeldCommit {
            pid,
            server: server_url(),
            commit: Some(commit),
        }
    }

    /// Whether the COMMIT is seen waiting for its standby within `limit`.
    pub async fn wait_held(&mut self, limit: std::time::Duration) -> bool {
        let admin = admin_pool(&self.server).await;
        let started = std::time::Instant::now();
        while started.elapsed() < limit {
            let waiting: Option<String> =
                sqlx::query_scalar("SELECT wait_event FROM pg_stat_activity WHERE pid = $1")
                    .bind(self.pid)
                    .fetch_optional(&admin)
                    .await
                    .expect("activity")
                    .flatten();
            if waiting.as_deref() == Some("SyncRep") {
                return true;
            }
            if self
                .commit
                .as_ref()
                .is_some_and(tokio::task::JoinHandle::is_finished)
            {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        false
    }

    /// Lets the COMMIT go (the wait is cancelled: the transaction is
    /// committed locally, and becomes visible); returns how it ended.
    pub async fn release(&mut self) -> Result<(), sqlx::Error> {
        let admin = admin_pool(&self.server).await;
        sqlx::query("SELECT pg_cancel_backend($1)")
            .bind(self.pid)
            .execute(&admin)
            .await
            .expect("cancel");
        match self.commit.take() {
            Some(commit) => commit.await.expect("commit task"),
            None => Ok(()),
        }
    }
}

/// Waits until a session of database `name` waits for another
/// transaction to end (a row lock, a unique-key conflict with a row not
/// committed yet); fails the test after `limit`.
pub async fn a_session_waits_on_a_transaction(name: &str, limit: std::time::Duration) {
    let admin = admin_pool(&server_url()).await;
    crate::eventually("a session waiting on another transaction", limit, || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = $1 AND wait_event_type = 'Lock' AND wait_event = 'transactionid'",
        )
        .bind(name)
        .fetch_one(&admin)
        .await
        .expect("activity");
        (waiting > 0).then_some(())
    })
    .await;
}
