//! The PostgreSQL outbox: migrations, claiming batches under a lease, and
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
mod row;

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

pub use ack::{Outcome, RowOutcome};
pub use claim::Claim;
pub use row::{Delivery, DeliveryKey, LeaseId, OutboxRow, RowId};

/// The outbox migrations, embedded in the binary.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

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
}

/// Handle to the outbox table.
#[derive(Clone, Debug)]
pub struct OutboxStore {
    pool: PgPool,
    dead_letter_blocks_aggregate: bool,
}

impl OutboxStore {
    /// Connects a pool.
    ///
    /// # Errors
    /// [`Error::Database`] when the database is unreachable.
    pub async fn connect(url: &str, max_connections: u32) -> Result<OutboxStore, Error> {
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await?;
        Ok(OutboxStore::new(pool))
    }

    /// Wraps an existing pool.
    pub fn new(pool: PgPool) -> OutboxStore {
        OutboxStore {
            pool,
            dead_letter_blocks_aggregate: false,
        }
    }

    /// Keeps later events of an aggregate waiting behind a dead-lettered one.
    #[must_use]
    pub fn with_dead_letter_blocking(mut self, blocks: bool) -> OutboxStore {
        self.dead_letter_blocks_aggregate = blocks;
        self
    }

    /// The pool, for LISTEN and ad-hoc queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations.
    ///
    /// # Errors
    /// [`Error::Migrate`] when a migration fails or the history diverged.
    pub async fn migrate(&self) -> Result<(), Error> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// Releases every lease this owner still holds, making those rows
    /// claimable at once (used on shutdown when batches did not finish in time).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn release_owner(&self, owner: &str) -> Result<u64, Error> {
        let done = sqlx::query(
            "UPDATE switchyard_outbox
                SET status = 'pending', lease_owner = NULL, lease_id = NULL,
                    lease_expires_at = NULL, attempts = GREATEST(attempts - 1, 0)
              WHERE status = 'in_flight' AND lease_owner = $1",
        )
        .bind(owner)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
