//! The outbox store: PostgreSQL (shared by many relays) or SQLite (the
//! embedded default), migrations, claiming batches under a lease, and
//! recording each row's outcome.
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

mod ack;
mod claim;
mod ops;
mod row;
mod sqlite;

use std::time::Duration;

use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};

pub use ack::{Outcome, RowOutcome};
pub use claim::Claim;
pub use ops::{DeadLetterFilter, OutboxEntry, OutboxStats, RetentionMode};
pub use row::{Delivery, DeliveryKey, LeaseId, OutboxRow, RowId};

/// The PostgreSQL outbox migrations, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/postgres");

/// The SQLite outbox migrations (embedded default), embedded in the binary.
pub static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");

/// SQLite's clock in milliseconds since the epoch, as its times are stored.
const SQLITE_NOW_MS: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

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
    /// The database could not be reached at startup.
    #[error("cannot connect to {at}: {reason}")]
    Connect {
        /// Which server and database.
        at: String,
        /// Why, as the driver or server said.
        reason: String,
    },
}

/// Bound on connecting to the database.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The driver's error without its generic prefix.
fn describe_connect_error(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(e) => e.message().to_string(),
        sqlx::Error::Io(e) => e.to_string(),
        other => other.to_string(),
    }
}

#[derive(Clone, Debug)]
enum Backend {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

/// Handle to the outbox table, on PostgreSQL (production: many relays share
/// it) or SQLite (the embedded default: one relay, one file).
#[derive(Clone, Debug)]
pub struct OutboxStore {
    backend: Backend,
    dead_letter_blocks_aggregate: bool,
}

impl OutboxStore {
    /// Connects a pool; the URL scheme picks the backend (`postgres://`,
    /// `postgresql://` or `sqlite:`). A SQLite file is created if missing.
    ///
    /// # Errors
    /// [`Error::Database`] when the database is unreachable or the URL is bad.
    pub async fn connect(url: &str, max_connections: u32) -> Result<OutboxStore, Error> {
        if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url)?
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
        // The relay logs slow claims itself, in one line; sqlx would add the
        // whole statement text at WARN each time.
        let options = PgConnectOptions::from_str(url)?
            .log_slow_statements(log::LevelFilter::Debug, Duration::from_secs(1));
        // One connection first, alone: a pool reports an unreachable server
        // or a missing database only as "pool timed out".
        let at = format!(
            "PostgreSQL at {}:{} (database {:?})",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or(options.get_username())
        );
        let connect_error = |reason: String| Error::Connect {
            at: at.clone(),
            reason: crate::redact::url(&reason),
        };
        let probe = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
            .await
            .map_err(|_| connect_error(format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())))?
            .map_err(|e| connect_error(describe_connect_error(&e)))?;
        let _ = probe.close().await;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(CONNECT_TIMEOUT)
            .connect_lazy_with(options);
        Ok(OutboxStore::new(pool))
    }

    /// Wraps an existing PostgreSQL pool.
    pub fn new(pool: PgPool) -> OutboxStore {
        OutboxStore {
            backend: Backend::Postgres(pool),
            dead_letter_blocks_aggregate: false,
        }
    }

    /// Wraps an existing SQLite pool.
    pub fn new_sqlite(pool: SqlitePool) -> OutboxStore {
        OutboxStore {
            backend: Backend::Sqlite(pool),
            dead_letter_blocks_aggregate: false,
        }
    }

    /// Keeps later events of an aggregate waiting behind a dead-lettered one.
    #[must_use]
    pub fn with_dead_letter_blocking(mut self, blocks: bool) -> OutboxStore {
        self.dead_letter_blocks_aggregate = blocks;
        self
    }

    /// The PostgreSQL pool, when this is a PostgreSQL store (LISTEN, ad-hoc queries).
    pub fn pg_pool(&self) -> Option<&PgPool> {
        match &self.backend {
            Backend::Postgres(pool) => Some(pool),
            Backend::Sqlite(_) => None,
        }
    }

    /// `"postgres"` or `"sqlite"`.
    pub fn kind(&self) -> &'static str {
        match &self.backend {
            Backend::Postgres(_) => "postgres",
            Backend::Sqlite(_) => "sqlite",
        }
    }

    /// Applies pending migrations.
    ///
    /// # Errors
    /// [`Error::Migrate`] when a migration fails or the history diverged.
    pub async fn migrate(&self) -> Result<(), Error> {
        match &self.backend {
            Backend::Postgres(pool) => MIGRATOR.run(pool).await?,
            Backend::Sqlite(pool) => SQLITE_MIGRATOR.run(pool).await?,
        }
        Ok(())
    }

    /// Whether the outbox table exists (i.e. `migrate` ran).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn schema_exists(&self) -> Result<bool, Error> {
        Ok(match &self.backend {
            Backend::Postgres(pool) => {
                sqlx::query_scalar("SELECT to_regclass('switchyard_outbox') IS NOT NULL")
                    .fetch_one(pool)
                    .await?
            }
            Backend::Sqlite(pool) => {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'switchyard_outbox'",
                )
                .fetch_one(pool)
                .await?
                    > 0
            }
        })
    }

    /// Rows pending or in flight, and the age in seconds of the oldest of them.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn backlog(&self) -> Result<(i64, Option<f64>), Error> {
        let count = "SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')";
        let rows = match &self.backend {
            Backend::Postgres(pool) => sqlx::query_scalar(count).fetch_one(pool).await?,
            Backend::Sqlite(pool) => sqlx::query_scalar(count).fetch_one(pool).await?,
        };
        Ok((rows, self.oldest_pending_age().await?))
    }

    /// Age in seconds of the oldest row pending or in flight, delayed rows
    /// (`not_before` still ahead) aside: the lowest such id, an index probe
    /// (`min(created_at)` would read every backlog row).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn oldest_pending_age(&self) -> Result<Option<f64>, Error> {
        Ok(match &self.backend {
            Backend::Postgres(pool) => {
                sqlx::query_scalar(
                    "SELECT EXTRACT(EPOCH FROM now() - created_at)::float8
                       FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')
                        AND (not_before IS NULL OR not_before <= now())
                      ORDER BY id LIMIT 1",
                )
                .fetch_optional(pool)
                .await?
            }
            Backend::Sqlite(pool) => {
                sqlx::query_scalar(&format!(
                    "SELECT ({SQLITE_NOW_MS} - created_at) / 1000.0
                       FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')
                        AND (not_before IS NULL OR not_before <= {SQLITE_NOW_MS})
                      ORDER BY id LIMIT 1"
                ))
                .fetch_optional(pool)
                .await?
            }
        })
    }

    /// Refreshes the planner's statistics of the outbox table. Claims are
    /// planned on them; taken while the outbox was empty (its normal state),
    /// they can make a claim over a sudden backlog take minutes.
    ///
    /// # Errors
    /// [`Error::Database`] (e.g. the relay's role does not own the table).
    pub async fn refresh_statistics(&self) -> Result<(), Error> {
        match &self.backend {
            Backend::Postgres(pool) => sqlx::query("ANALYZE switchyard_outbox")
                .execute(pool)
                .await
                .map(drop)?,
            Backend::Sqlite(pool) => sqlx::query("ANALYZE switchyard_outbox")
                .execute(pool)
                .await
                .map(drop)?,
        }
        Ok(())
    }

    /// Whether the database answers a trivial query.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn ping(&self) -> Result<(), Error> {
        match &self.backend {
            Backend::Postgres(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop)?,
            Backend::Sqlite(pool) => sqlx::query("SELECT 1").execute(pool).await.map(drop)?,
        }
        Ok(())
    }

    /// Claims up to `limit` rows for `owner`, leased for `lease`: at most one
    /// per aggregate, each the oldest unfinished row of its aggregate.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn claim(&self, owner: &str, limit: u32, lease: Duration) -> Result<Claim, Error> {
        match &self.backend {
            Backend::Postgres(pool) => {
                OutboxStore::claim_pg(pool, self.dead_letter_blocks_aggregate, owner, limit, lease).await
            }
            Backend::Sqlite(pool) => {
                sqlite::claim(pool, self.dead_letter_blocks_aggregate, owner, limit, lease).await
            }
        }
    }

    /// Records the outcomes of a batch claimed under `lease`. Rows whose lease
    /// was lost (expired and re-claimed elsewhere) are left alone; the
    /// returned list holds the ids that were actually updated.
    ///
    /// # Errors
    /// [`Error::Database`].
    ///
    /// No row's content can make the others' ack fail: when the database
    /// refuses the batch statement itself (not a lost connection), the rows
    /// are recorded one by one, and a row refused on its own is dead-lettered
    /// with the database's reason and no delivery state.
    pub async fn ack(&self, lease: LeaseId, outcomes: &[RowOutcome]) -> Result<Vec<RowId>, Error> {
        if outcomes.is_empty() {
            return Ok(Vec::new());
        }
        match self.ack_batch(lease, outcomes).await {
            Err(Error::Database(sqlx::Error::Database(refused))) if outcomes.len() > 1 => {
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
            Err(Error::Database(sqlx::Error::Database(refused))) => {
                self.ack_dead(lease, &outcomes[0], refused.as_ref()).await
            }
            other => other,
        }
    }

    async fn ack_batch(&self, lease: LeaseId, outcomes: &[RowOutcome]) -> Result<Vec<RowId>, Error> {
        match &self.backend {
            Backend::Postgres(pool) => OutboxStore::ack_pg(pool, lease, outcomes).await,
            Backend::Sqlite(pool) => sqlite::ack(pool, lease, outcomes).await,
        }
    }

    /// Records one row; if the database refuses its outcome, records it dead
    /// with the reason instead, so that the row cannot come back every lease.
    async fn ack_alone(&self, lease: LeaseId, row: &RowOutcome) -> Result<Vec<RowId>, Error> {
        match self.ack_batch(lease, std::slice::from_ref(row)).await {
            Err(Error::Database(sqlx::Error::Database(refused))) => {
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
        match &self.backend {
            Backend::Postgres(pool) => OutboxStore::peek_pending_pg(pool, limit).await,
            Backend::Sqlite(pool) => sqlite::peek_pending(pool, limit).await,
        }
    }

    /// Releases every lease this owner still holds, making those rows
    /// claimable at once (used on shutdown when batches did not finish in time).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn release_owner(&self, owner: &str) -> Result<u64, Error> {
        let sql = "UPDATE switchyard_outbox
                      SET status = 'pending', lease_owner = NULL, lease_id = NULL,
                          lease_expires_at = NULL, attempts = attempts - 1
                    WHERE status = 'in_flight' AND lease_owner = $1";
        // An in-flight row was claimed at least once, so the refund never goes below zero.
        Ok(match &self.backend {
            Backend::Postgres(pool) => sqlx::query(sql).bind(owner).execute(pool).await?.rows_affected(),
            Backend::Sqlite(pool) => sqlx::query(sql).bind(owner).execute(pool).await?.rows_affected(),
        })
    }
}
