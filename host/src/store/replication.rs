//! Replication mode through the store: setting the outbox up for it,
//! checking it, the slot's state, and handing streamed rows to the claim
//! path (PostgreSQL; SQLite is relayed by claiming only).

use std::collections::HashSet;

use super::postgres::replication as pg;
pub use super::postgres::replication::{
    SlotStatus, SourceTable, StreamError, StreamSettings, StreamedRow, WalBatch, WalStream,
};
use super::{AnyBackend, Error, LeaseId, OutboxStore, RowOutcome};

impl OutboxStore {
    /// What `migrate` runs to put the outbox (and the `[source]` table)
    /// into replication mode through `slot` and `publication` (only what is
    /// missing), or, with `None`, back to claim mode. Nothing on SQLite.
    ///
    /// # Errors
    /// The database's.
    pub async fn feed_statements(
        &self,
        replication: Option<(&str, &str)>,
        source: Option<&SourceTable>,
    ) -> Result<Vec<String>, Error> {
        let Some(pool) = self.pg_pool() else {
            return Ok(Vec::new());
        };
        match replication {
            Some((slot, publication)) => pg::setup_statements(pool, slot, publication, source).await,
            None => pg::claim_mode_statements(pool).await,
        }
    }

    /// Runs what [`OutboxStore::feed_statements`] returned.
    ///
    /// # Errors
    /// The database's; statements before the failing one stay done (each
    /// is idempotent, so running `migrate` again finishes the job).
    pub async fn run_feed_statements(&self, statements: &[String]) -> Result<(), Error> {
        match self.pg_pool() {
            Some(pool) => pg::run(pool, statements).await,
            None => Ok(()),
        }
    }

    /// A database set up for the other mode than the relay's (`replication`
    /// or claim), with what to do; `None` when they agree. SQLite has only
    /// claim mode.
    ///
    /// # Errors
    /// The database's.
    pub async fn mode_mismatch(&self, replication: bool) -> Result<Option<&'static str>, Error> {
        match self.pg_pool() {
            Some(pool) => pg::mode_mismatch(pool, replication).await,
            None => Ok(None),
        }
    }

    /// Everything that keeps replication mode from working here, each
    /// saying what to do.
    ///
    /// # Errors
    /// The database's.
    pub async fn replication_problems(
        &self,
        slot: &str,
        publication: &str,
        source: Option<&SourceTable>,
    ) -> Result<Vec<String>, Error> {
        match self.pg_pool() {
            Some(pool) => pg::problems(pool, slot, publication, source).await,
            None => Ok(vec!["replication mode needs PostgreSQL".into()]),
        }
    }

    /// The slot's state; `None` when there is no such slot. Bounded as the
    /// relay's other background statements are: readiness gives up on it
    /// after a few seconds, and a session left mid-statement is closed.
    ///
    /// # Errors
    /// The database's.
    pub async fn slot_status(&self, slot: &str) -> Result<Option<SlotStatus>, Error> {
        match &self.backend {
            AnyBackend::Postgres(backend) => {
                backend
                    .bounded("replication slot status", async |session| {
                        pg::slot_status(&mut *session, slot).await
                    })
                    .await
            }
            AnyBackend::Sqlite(_) => Ok(None),
        }
    }

    /// Hands streamed rows to the claim path with their outcomes: leased
    /// as if claimed, then acked. Returns the rows recorded; a row handed
    /// over before (a replay after a restart) is left as it is.
    ///
    /// # Errors
    /// The database's; nothing is recorded then.
    pub async fn hand_over(
        &self,
        owner: &str,
        lease_ms: i64,
        rows: &[&StreamedRow],
        outcomes: &[RowOutcome],
    ) -> Result<usize, Error> {
        let Some(pool) = self.pg_pool() else {
            return Ok(0);
        };
        let lease = LeaseId(uuid::Uuid::new_v4());
        let renamed = pg::take_over(pool, owner, lease, lease_ms, rows).await?;
        if renamed.is_empty() {
            return Ok(self.ack(lease, outcomes).await?.len());
        }
        let renamed: std::collections::HashMap<_, _> = renamed.into_iter().collect();
        let outcomes: Vec<RowOutcome> = outcomes
            .iter()
            .map(|outcome| RowOutcome {
                id: renamed.get(&outcome.id).copied().unwrap_or(outcome.id),
                ..outcome.clone()
            })
            .collect();
        Ok(self.ack(lease, &outcomes).await?.len())
    }

    /// Of these aggregates, those whose next event must wait behind an
    /// unfinished one in the table.
    ///
    /// # Errors
    /// The database's.
    pub async fn waiting_in_table(
        &self,
        keys: &[(String, String)],
    ) -> Result<HashSet<(String, String)>, Error> {
        match self.pg_pool() {
            Some(pool) if !keys.is_empty() => {
                pg::waiting_in_table(pool, keys, self.dead_letter_blocks_aggregate).await
            }
            _ => Ok(HashSet::new()),
        }
    }

    /// Whether any aggregate waits behind a row in the table.
    ///
    /// # Errors
    /// The database's.
    pub async fn anything_waiting_in_table(&self) -> Result<bool, Error> {
        match self.pg_pool() {
            Some(pool) => pg::anything_waiting_in_table(pool, self.dead_letter_blocks_aggregate).await,
            None => Ok(false),
        }
    }
}
