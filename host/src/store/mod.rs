//! The outbox store: PostgreSQL or MySQL/MariaDB (shared by many relays)
//! or SQLite (the embedded default), migrations, claiming batches under a
//! lease, and recording each row's outcome.
//!
//! # Ordering
//! A row is claimed only when it is the *head* of its aggregate: no earlier row
//! of the same `(aggregate_type, aggregate_id)` is unfinished (pending, in
//! flight, or - in strict mode - dead). The next event of an aggregate
//! therefore becomes claimable only after the previous one was acknowledged by
//! every target, whichever instance or worker holds it. SKIP LOCKED cannot
//! reorder anything: the row it skips is still unfinished, so everything
//! behind it stays ineligible. The cost is one in-flight event per aggregate;
//! throughput comes from many aggregates being in flight at once. Rows are
//! found by status, never by a high-water mark, so a row whose id was assigned
//! early but committed late is still picked up.

#[macro_use]
mod backend;
mod dialect;
mod mysql;
mod password;
mod postgres;
mod privileges;
mod sqlite;
mod types;

pub mod capture;
pub mod change_stream;
pub mod replication;

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::LazyLock;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

pub use crate::endpoint::{Endpoint, PgTlsConfig, SslMode};
use backend::Backend;
pub use types::{
    Claim, DeadLetterFilter, Delivery, DeliveryKey, Generation, LeaseId, OutboxEntry, OutboxRow, OutboxStats,
    Outcome, PublishedRows, RetentionMode, RowId, RowOutcome, payload_over_limit,
};

/// `migrations/*/`: (version, description, SQL), embedded by `build.rs`.
mod embedded {
    include!(concat!(env!("OUT_DIR"), "/migrations.rs"));
}

/// The PostgreSQL outbox migrations, embedded in the binary.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| migrator(embedded::POSTGRES));

/// The SQLite outbox migrations (embedded default), embedded in the binary.
pub static SQLITE_MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| migrator(embedded::SQLITE));

/// The MySQL and MariaDB outbox migrations, embedded in the binary.
pub static MYSQL_MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| migrator(embedded::MYSQL));

/// A migrator as `sqlx::migrate!` builds one: simple (up-only) migrations,
/// each in a transaction unless its SQL starts with `-- no-transaction`,
/// checksummed over its SQL.
fn migrator(files: &'static [(i64, &'static str, &'static str)]) -> Migrator {
    Migrator {
        migrations: files
            .iter()
            .map(|&(version, description, sql)| {
                sqlx::migrate::Migration::new(
                    version,
                    description.into(),
                    sqlx::migrate::MigrationType::Simple,
                    sql.into(),
                    sql.starts_with("-- no-transaction"),
                )
            })
            .collect(),
        ..Migrator::DEFAULT
    }
}

/// The channel the insert trigger notifies.
pub const NOTIFY_CHANNEL: &str = "switchyard_outbox";

/// Errors from the outbox store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database failed or is unreachable; worth retrying.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A migration failed.
    #[error(transparent)]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The claim statement ran past half the lease and was cancelled.
    #[error("the claim statement was cancelled after {} ms (half the lease)", after.as_millis())]
    ClaimTimedOut {
        /// How long it ran.
        after: Duration,
    },
    /// The database did not answer a statement in time (a link that drops
    /// packets, a frozen server): the session was closed, not pooled.
    #[error("the database did not answer the {what} within {} ms; its session was closed", after.as_millis())]
    Unanswered {
        /// Which statement.
        what: &'static str,
        /// How long it waited.
        after: Duration,
    },
    /// The outbox's schema is older than the generations this relay serves.
    #[error("the outbox's schema is older than this relay serves ({missing}): run `switchyard migrate`")]
    SchemaTooOld {
        /// The first migration it lacks that this relay needs.
        missing: &'static str,
    },
    /// The database could not be reached at startup.
    #[error("cannot connect to {at}: {reason}")]
    Connect {
        /// Which server and database.
        at: String,
        /// Why, as the driver or server said.
        reason: String,
    },
}

impl From<crate::endpoint::EndpointError> for Error {
    fn from(error: crate::endpoint::EndpointError) -> Error {
        match error {
            crate::endpoint::EndpointError::Url(error) => Error::Database(error),
            crate::endpoint::EndpointError::Password { at, reason } => Error::Connect { at, reason },
        }
    }
}

#[derive(Clone, Debug)]
enum AnyBackend {
    Postgres(postgres::Postgres),
    Sqlite(sqlite::Sqlite),
    MySql(mysql::MySql),
}

/// Runs `$call` on whichever backend the store has: the one place that
/// tells the backends apart.
macro_rules! dispatch {
    ($store:expr, $backend:ident => $call:expr) => {
        match &$store.backend {
            AnyBackend::Postgres($backend) => $call,
            AnyBackend::Sqlite($backend) => $call,
            AnyBackend::MySql($backend) => $call,
        }
    };
}

// After `dispatch!`, which it uses.
mod operations;

mod ownership;
mod relays;
pub use mysql::ServerReport;
pub use ownership::Ownership;
pub use postgres::INTAKE_LOCK;
pub(crate) use postgres::describe_connect_error;
pub use relays::{FORGOTTEN_AFTER, RunningRelay};

/// The PostgreSQL-only parts of an outbox: replication mode, the `[source]`
/// capture trigger and LISTEN. Only a PostgreSQL store hands one out
/// ([`OutboxStore::postgres`]): SQLite code cannot reach them, and none of
/// them answers "nothing" to mean "not supported here".
#[derive(Clone, Debug)]
pub struct PgOutbox {
    store: OutboxStore,
    backend: postgres::Postgres,
}

/// Handle to the outbox table, on PostgreSQL (production: many relays share
/// it) or SQLite (the embedded default: one relay, one file).
#[derive(Clone, Debug)]
pub struct OutboxStore {
    backend: AnyBackend,
    dead_letter_blocks_aggregate: bool,
    published_rows: PublishedRows,
    max_payload_bytes: usize,
}

impl OutboxStore {
    /// Connects a pool; the URL scheme picks the backend (`postgres://`,
    /// `postgresql://`, `mysql://`, `mariadb://` or `sqlite:`). A SQLite
    /// file is created if missing.
    ///
    /// # Errors
    /// [`Error::Database`] when the database is unreachable or the URL is bad.
    pub async fn connect(url: impl Into<Endpoint>, max_connections: u32) -> Result<OutboxStore, Error> {
        OutboxStore::connect_as(url, max_connections, "switchyard").await
    }

    /// [`OutboxStore::connect`], with the `application_name` PostgreSQL
    /// shows for each connection (`pg_stat_activity`, logs) unless the URL
    /// sets one: a relay passes its instance id, so that an operator can
    /// tell which relay a session, a lock or a slow statement belongs to.
    ///
    /// # Errors
    /// As [`OutboxStore::connect`].
    pub async fn connect_as(
        url: impl Into<Endpoint>,
        max_connections: u32,
        application_name: &str,
    ) -> Result<OutboxStore, Error> {
        OutboxStore::connect_bounded(url, max_connections, application_name, None).await
    }

    /// [`OutboxStore::connect_as`] for a relay: on PostgreSQL each of its
    /// statements is bounded by `statement_timeout` (half the lease: a claim
    /// that takes longer is of no use, its rows could not be published in
    /// time).
    ///
    /// # Errors
    /// As [`OutboxStore::connect`].
    pub async fn connect_bounded(
        url: impl Into<Endpoint>,
        max_connections: u32,
        application_name: &str,
        statement_timeout: Option<Duration>,
    ) -> Result<OutboxStore, Error> {
        OutboxStore::connect_with(url, max_connections, application_name, statement_timeout, true).await
    }

    /// One session for the few small statements a fleet's ownership needs,
    /// each bounded by `statement_timeout`. It is not pinged after a pause,
    /// as the relay's sessions are: a statement that fails or goes
    /// unanswered costs its caller no more than the ping's would, and a
    /// session given up on while the server is only slow costs the server a
    /// new one when it can least afford it.
    ///
    /// # Errors
    /// As [`OutboxStore::connect`].
    pub async fn connect_unpinged(
        url: impl Into<Endpoint>,
        application_name: &str,
        statement_timeout: Duration,
    ) -> Result<OutboxStore, Error> {
        OutboxStore::connect_with(url, 1, application_name, Some(statement_timeout), false).await
    }

    /// The store for `url`; `ping_idle`: see [`postgres::SessionOptions`].
    async fn connect_with(
        endpoint: impl Into<Endpoint>,
        max_connections: u32,
        application_name: &str,
        statement_timeout: Option<Duration>,
        ping_idle: bool,
    ) -> Result<OutboxStore, Error> {
        let endpoint = endpoint.into();
        if endpoint.is_sqlite() {
            let options = SqliteConnectOptions::from_str(endpoint.url())?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(Duration::from_secs(10));
            let pool = SqlitePoolOptions::new()
                .max_connections(max_connections.clamp(1, 8))
                .connect_with(options)
                .await?;
            return Ok(OutboxStore::new_sqlite(pool));
        }
        if endpoint.is_mysql() {
            let backend = mysql::MySql::connect(&endpoint, max_connections, statement_timeout).await?;
            return Ok(OutboxStore::with_backend(AnyBackend::MySql(backend)));
        }
        let backend = postgres::Postgres::connect(
            &endpoint,
            &postgres::SessionOptions {
                max_connections,
                application_name,
                statement_timeout,
                ping_idle,
            },
        )
        .await?;
        Ok(OutboxStore::with_backend(AnyBackend::Postgres(backend)))
    }

    /// Wraps an existing PostgreSQL pool, whose connections must run READ
    /// COMMITTED (PostgreSQL's default; [`OutboxStore::connect`] sees to it).
    pub fn new(pool: PgPool) -> OutboxStore {
        OutboxStore::with_backend(AnyBackend::Postgres(postgres::Postgres::new(pool)))
    }

    fn with_backend(backend: AnyBackend) -> OutboxStore {
        OutboxStore {
            backend,
            dead_letter_blocks_aggregate: false,
            published_rows: PublishedRows::Keep,
            max_payload_bytes: usize::MAX,
        }
    }

    /// Wraps an existing SQLite pool.
    pub fn new_sqlite(pool: SqlitePool) -> OutboxStore {
        OutboxStore::with_backend(AnyBackend::Sqlite(sqlite::Sqlite::new(pool)))
    }

    /// Keeps later events of an aggregate waiting behind a dead-lettered one.
    #[must_use]
    pub fn with_dead_letter_blocking(mut self, blocks: bool) -> OutboxStore {
        self.dead_letter_blocks_aggregate = blocks;
        self
    }

    /// Claims refuse payloads over `bytes` as they read them, so that a
    /// batch of oversized rows is never held in memory at once (the relay
    /// would refuse each of them anyway: `relay.max_payload_bytes`).
    #[must_use]
    pub fn with_max_payload_bytes(mut self, bytes: usize) -> OutboxStore {
        self.max_payload_bytes = bytes;
        self
    }

    /// What acks do with published rows: keep, delete or archive them.
    #[must_use]
    pub fn with_published_rows(mut self, published_rows: PublishedRows) -> OutboxStore {
        self.published_rows = published_rows;
        self
    }

    /// On PostgreSQL, claims and acks keep up to `sessions` of the pool's
    /// sessions between uses instead of handing them back (a claim's session
    /// then serves its ack, and an ack's the next claim): at service rates
    /// each event is its own batch, and each session handed back is pinged,
    /// which costs the server as much as the statements. The rest of the
    /// pool serves LISTEN and everything else.
    #[must_use]
    pub fn keeping_sessions(self, sessions: usize) -> OutboxStore {
        match self.backend {
            AnyBackend::Postgres(backend) => OutboxStore {
                backend: AnyBackend::Postgres(backend.keeping_sessions(sessions)),
                ..self
            },
            AnyBackend::Sqlite(_) | AnyBackend::MySql(_) => self,
        }
    }

    /// The PostgreSQL-only parts, when this is a PostgreSQL store.
    pub fn postgres(&self) -> Option<PgOutbox> {
        match &self.backend {
            AnyBackend::Postgres(backend) => Some(PgOutbox {
                store: self.clone(),
                backend: backend.clone(),
            }),
            AnyBackend::Sqlite(_) | AnyBackend::MySql(_) => None,
        }
    }

    /// A database set up for the other mode than the relay's (`replication`
    /// or claim), with what to do; `None` when they agree. SQLite has claim
    /// mode alone.
    ///
    /// # Errors
    /// The database's.
    pub async fn mode_mismatch(&self, replication: bool) -> Result<Option<&'static str>, Error> {
        match (self.postgres(), self.binlog()) {
            (Some(pg), _) => pg.mode_mismatch(replication).await,
            (None, Some(binlog)) => binlog.mode_mismatch(replication).await,
            (None, None) => Ok(None),
        }
    }

    /// What `migrate` runs to set the database up for the change stream
    /// `feed` names (only what is missing), or with `None` back to claim
    /// mode; nothing on SQLite, which has claim mode alone.
    ///
    /// # Errors
    /// The database's.
    pub async fn feed_statements(
        &self,
        feed: Option<change_stream::FeedNames<'_>>,
    ) -> Result<Vec<String>, Error> {
        use change_stream::HandoverTable;
        match (self.postgres(), self.binlog()) {
            (Some(pg), _) => HandoverTable::feed_statements(&pg, feed).await,
            (None, Some(binlog)) => HandoverTable::feed_statements(&binlog, feed).await,
            (None, None) => Ok(Vec::new()),
        }
    }

    /// Runs what [`OutboxStore::feed_statements`] returned.
    ///
    /// # Errors
    /// The database's; a failed statement leaves the earlier ones run.
    pub async fn run_feed_statements(&self, statements: &[String]) -> Result<(), Error> {
        use change_stream::HandoverTable;
        match (self.postgres(), self.binlog()) {
            (Some(pg), _) => HandoverTable::run_feed_statements(&pg, statements).await,
            (None, Some(binlog)) => HandoverTable::run_feed_statements(&binlog, statements).await,
            (None, None) => Ok(()),
        }
    }

    /// The MySQL or MariaDB pool, and whether the server is MariaDB.
    pub(crate) fn mysql_pool(&self) -> Option<(sqlx::MySqlPool, bool)> {
        match &self.backend {
            AnyBackend::MySql(backend) => {
                Some((backend.pool.clone(), backend.flavor() == mysql::Flavor::MariaDb))
            }
            AnyBackend::Postgres(_) | AnyBackend::Sqlite(_) => None,
        }
    }

    /// The privileges the relay's account lacks on the tables it uses
    /// (`replication`: in replication or binlog mode), each with the
    /// `GRANT` that gives it; none on SQLite.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn privilege_problems(&self, replication: bool) -> Result<Vec<String>, Error> {
        match &self.backend {
            AnyBackend::MySql(backend) => privileges::mysql(&backend.pool, replication).await,
            AnyBackend::Postgres(backend) => privileges::postgres(&backend.pool).await,
            AnyBackend::Sqlite(_) => Ok(Vec::new()),
        }
    }

    /// On MySQL and MariaDB, what the server and the outbox table lack
    /// for the relay; nothing on the other databases, which their
    /// migrations and the claim-mode check cover.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn server_report(&self) -> Result<ServerReport, Error> {
        match &self.backend {
            AnyBackend::MySql(backend) => backend.server_report().await,
            AnyBackend::Postgres(_) | AnyBackend::Sqlite(_) => Ok(ServerReport::default()),
        }
    }

    /// Closes the pool: connections in use are closed as they come back,
    /// which ends any transaction a dropped task left open on them.
    pub async fn close(&self) {
        match &self.backend {
            AnyBackend::Postgres(backend) => backend.close().await,
            AnyBackend::Sqlite(backend) => backend.pool.close().await,
            AnyBackend::MySql(backend) => backend.pool.close().await,
        }
    }

    /// `"postgres"`, `"sqlite"`, `"mariadb"` or `"mysql"`.
    pub fn kind(&self) -> &'static str {
        match &self.backend {
            AnyBackend::Postgres(_) => "postgres",
            AnyBackend::Sqlite(_) => "sqlite",
            AnyBackend::MySql(backend) => match backend.flavor() {
                mysql::Flavor::MariaDb => "mariadb",
                mysql::Flavor::MySql => "mysql",
            },
        }
    }

    /// Applies pending migrations.
    ///
    /// # Errors
    /// [`Error::Migrate`] when a migration fails or the history diverged.
    pub async fn migrate(&self) -> Result<(), Error> {
        dispatch!(self, backend => backend.migrate().await)
    }

    /// The migrations `migrate` would apply, in order: `(version,
    /// description, SQL)`. Reads only.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn pending_migrations(&self) -> Result<Vec<(i64, String, String)>, Error> {
        let applied = dispatch!(self, backend => backend.applied_migrations().await)?;
        let migrator = match &self.backend {
            AnyBackend::Postgres(_) => &MIGRATOR,
            AnyBackend::Sqlite(_) => &SQLITE_MIGRATOR,
            AnyBackend::MySql(_) => &MYSQL_MIGRATOR,
        };
        Ok(migrator
            .iter()
            .filter(|migration| !applied.contains(&migration.version))
            .map(|migration| {
                (
                    migration.version,
                    migration.description.to_string(),
                    migration.sql.to_string(),
                )
            })
            .collect())
    }

    /// The schema's generation (see [`Generation`]).
    ///
    /// # Errors
    /// [`Error::SchemaTooOld`] when `switchyard migrate` must run first;
    /// [`Error::Database`].
    pub async fn generation(&self) -> Result<Generation, Error> {
        dispatch!(self, backend => backend.generation().await)
    }

    /// Whether the outbox table exists (i.e. `migrate` ran).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn schema_exists(&self) -> Result<bool, Error> {
        dispatch!(self, backend => backend.schema_exists().await)
    }

    /// Rows pending or in flight, and the age in seconds of the oldest of them.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn backlog(&self) -> Result<(i64, Option<f64>), Error> {
        let rows = dispatch!(self, backend => backend.count_backlog().await)?;
        Ok((rows, self.oldest_pending_age().await?))
    }

    /// Age in seconds of the oldest row pending or in flight, delayed rows
    /// (`not_before` still ahead) aside: the lowest such id, an index probe
    /// (`min(created_at)` would read every backlog row).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn oldest_pending_age(&self) -> Result<Option<f64>, Error> {
        dispatch!(self, backend => backend.oldest_pending_age().await)
    }

    /// Refreshes the planner's statistics of the outbox table. Claims are
    /// planned on them; taken while the outbox was empty (its normal state),
    /// they can make a claim over a sudden backlog take minutes.
    ///
    /// # Errors
    /// [`Error::Database`] (e.g. the relay's role does not own the table).
    pub async fn refresh_statistics(&self) -> Result<(), Error> {
        dispatch!(self, backend => backend.refresh_statistics().await)
    }

    /// Whether the database answers a trivial query.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn ping(&self) -> Result<(), Error> {
        dispatch!(self, backend => backend.ping().await)
    }

    /// Claims up to `limit` rows for `owner`, leased for `lease`: at most one
    /// per aggregate, each the oldest unfinished row of its aggregate.
    ///
    /// # Errors
    /// [`Error::Database`]; [`Error::ClaimTimedOut`] on PostgreSQL when the
    /// statement ran past half the lease.
    pub async fn claim(&self, owner: &str, limit: u32, lease: Duration) -> Result<Claim, Error> {
        let blocks = self.dead_letter_blocks_aggregate;
        let max_payload = self.max_payload_bytes;
        dispatch!(self, backend => backend.claim(blocks, owner, limit, lease, max_payload).await)
    }

    /// Records the outcomes of a batch claimed under `lease`. Rows whose lease
    /// was lost (expired and re-claimed elsewhere) are left alone; the
    /// returned list holds the ids that were actually updated.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// No row's content can make the others' ack fail: when the database
    /// refuses the batch statement itself (not a lost connection, not a
    /// cancelled statement or a busy database), the rows are recorded one by
    /// one, and a row refused on its own is dead-lettered with the
    /// database's reason and no delivery state. A statement cancelled by a
    /// timeout, a deadlock or a busy database is tried again twice, that
    /// statement alone: rows an earlier statement recorded are not sent
    /// again, where the lease would no longer match and they would be
    /// reported as lost. Each statement is fenced by the lease, so trying
    /// it again cannot record anything twice.
    pub async fn ack(&self, lease: LeaseId, outcomes: &[RowOutcome]) -> Result<Vec<RowId>, Error> {
        if outcomes.is_empty() {
            return Ok(Vec::new());
        }
        match self.ack_batch_retrying(lease, outcomes).await {
            Err(Error::Database(sqlx::Error::Database(refused)))
                if outcomes.len() > 1 && !self.transient(refused.as_ref()) =>
            {
                tracing::warn!(
                    error = %refused,
                    rows = outcomes.len(),
                    "The database refused a batch's outcomes; recording them row by row."
                );
                let mut acked = Vec::with_capacity(outcomes.len());
                for row in outcomes {
                    acked.extend(self.ack_alone(lease, row).await?);
                }
                Ok(acked)
            }
            // One row refused: sending it again alone would be refused again.
            Err(Error::Database(sqlx::Error::Database(refused))) if !self.transient(refused.as_ref()) => {
                self.ack_dead(lease, &outcomes[0], refused.as_ref()).await
            }
            other => other,
        }
    }

    /// One ack statement, tried again after 0.1 and 0.5 s while it fails
    /// with an error that says nothing about the rows.
    async fn ack_batch_retrying(&self, lease: LeaseId, outcomes: &[RowOutcome]) -> Result<Vec<RowId>, Error> {
        let mut pauses = [Duration::from_millis(100), Duration::from_millis(500)].into_iter();
        loop {
            match self.ack_batch(lease, outcomes).await {
                Err(Error::Database(sqlx::Error::Database(e))) if self.transient(e.as_ref()) => {
                    let Some(pause) = pauses.next() else {
                        return Err(Error::Database(sqlx::Error::Database(e)));
                    };
                    tracing::debug!(error = %e, "Recording outcomes was interrupted; trying again.");
                    tokio::time::sleep(pause).await;
                }
                done => return done,
            }
        }
    }

    /// Whether a database error says nothing about the rows: a cancelled
    /// statement (statement or lock timeout, an operator), a deadlock or
    /// serialization failure, a busy or locked database, resources or the
    /// connection running out. Only other errors are the database refusing
    /// what a row holds.
    fn transient(&self, error: &dyn sqlx::error::DatabaseError) -> bool {
        if let AnyBackend::MySql(_) = self.backend {
            return mysql::transient(error);
        }
        let Some(code) = error.code() else {
            return false;
        };
        match self.backend {
            // SQLSTATE classes: 08 connection, 40 transaction rollback, 53
            // insufficient resources, 55 lock not available, 57 operator
            // intervention (query_canceled among them), 58 system error.
            AnyBackend::Postgres(_) => matches!(code.get(..2), Some("08" | "40" | "53" | "55" | "57" | "58")),
            // Primary result codes: BUSY, LOCKED, IOERR, FULL.
            AnyBackend::Sqlite(_) => code
                .parse::<i32>()
                .is_ok_and(|code| matches!(code & 0xff, 5 | 6 | 10 | 13)),
            AnyBackend::MySql(_) => false,
        }
    }

    async fn ack_batch(&self, lease: LeaseId, outcomes: &[RowOutcome]) -> Result<Vec<RowId>, Error> {
        let published_rows = self.published_rows;
        dispatch!(self, backend => backend.ack(lease, outcomes, published_rows).await)
    }

    /// Moves back to the queue up to `limit` parked rows that nothing will
    /// free any more: on PostgreSQL, their predecessor was removed by hand
    /// or by `dlq purge`; on MySQL and MariaDB, rows waiting on a paused
    /// target whose backoff ran out with no relay to wake them. The relay
    /// runs it now and then; normally it finds nothing. Returns how many
    /// moved.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn unpark_stranded(&self, limit: u32) -> Result<u64, Error> {
        let blocks = self.dead_letter_blocks_aggregate;
        dispatch!(self, backend => backend.unpark_stranded(blocks, limit).await)
    }

    /// Sets waiting, with it, up to `limit` pending rows behind a row of
    /// their aggregate that waits on paused targets (MySQL and MariaDB,
    /// whose claims would otherwise read each of them at every poll; they
    /// come back when those targets are woken). The relay runs it now and
    /// then. Returns how many.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn park_followers(&self, limit: u32) -> Result<u64, Error> {
        dispatch!(self, backend => backend.park_followers(limit).await)
    }

    /// Sets every row waiting on `target` (on any target when `None`) due
    /// now, oldest first, in statements of at most 5,000 rows (the first
    /// of 500, so that delivery starts at once); how many. Run when a
    /// paused target is back, and at start for the targets that are up.
    ///
    /// # Errors
    /// [`Error::Database`]; rows woken before it stay woken.
    pub async fn wake_waiting(&self, target: Option<&str>) -> Result<u64, Error> {
        let mut chunk = 500;
        let mut woken = 0;
        loop {
            let moved = dispatch!(self, backend => backend.wake_waiting(target, chunk).await)?;
            woken += moved;
            if moved < u64::from(chunk) {
                return Ok(woken);
            }
            chunk = 5_000;
        }
    }

    /// How many pending rows wait on each paused target.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn waiting_by_target(&self) -> Result<BTreeMap<String, i64>, Error> {
        dispatch!(self, backend => backend.waiting_by_target().await)
    }

    /// Records one row; if the database refuses its outcome, records it dead
    /// with the reason instead, so that the row cannot come back every lease.
    async fn ack_alone(&self, lease: LeaseId, row: &RowOutcome) -> Result<Vec<RowId>, Error> {
        match self.ack_batch_retrying(lease, std::slice::from_ref(row)).await {
            Err(Error::Database(sqlx::Error::Database(refused))) if !self.transient(refused.as_ref()) => {
                self.ack_dead(lease, row, refused.as_ref()).await
            }
            other => other,
        }
    }

    /// Records `row` dead with the database's reason for refusing its outcome.
    async fn ack_dead(
        &self,
        lease: LeaseId,
        row: &RowOutcome,
        refused: &dyn sqlx::error::DatabaseError,
    ) -> Result<Vec<RowId>, Error> {
        let dead = RowOutcome {
            id: row.id,
            outcome: Outcome::Dead {
                error: format!(
                    "the database refused this row's outcome ({}): {}",
                    row.outcome.status(),
                    refused.message().replace('\0', "\u{FFFD}")
                ),
            },
            deliveries: std::collections::BTreeMap::new(),
            plugin_version: None,
        };
        self.ack_batch(lease, std::slice::from_ref(&dead)).await
    }

    /// Reads up to `limit` unfinished rows in id order without claiming or
    /// changing anything (for dry runs).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn peek_pending(&self, limit: u32) -> Result<Vec<OutboxRow>, Error> {
        dispatch!(self, backend => backend.peek_pending(limit).await)
    }

    /// Releases every lease this owner still holds, making those rows
    /// claimable at once (used on shutdown when batches did not finish in time).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn release_owner(&self, owner: &str) -> Result<u64, Error> {
        dispatch!(self, backend => backend.release_owner(owner).await)
    }
}
