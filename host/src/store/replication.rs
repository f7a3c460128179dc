//! Replication mode through the PostgreSQL handle: setting the outbox up
//! for it, checking it, the slot's state, and handing streamed rows to the
//! claim path (SQLite is relayed by claiming only).

use std::collections::HashSet;

use super::mysql::binlog;
#[cfg(not(feature = "binlog"))]
pub use super::mysql::binlog::without_binlog;
pub use super::mysql::binlog::{BinlogSettings, BinlogStream};
use super::postgres::replication as pg;
pub use super::postgres::replication::{
    SlotStatus, SourceTable, StreamError, StreamSettings, StreamedRow, WalBatch, WalStream,
};
use super::{Error, LeaseId, OutboxStore, PgOutbox, RowId, RowOutcome};

impl PgOutbox {
    /// What `migrate` runs to put the outbox (and the `[source]` table)
    /// into replication mode through `slot` and `publication` (only what is
    /// missing), or, with `None`, back to claim mode.
    ///
    /// # Errors
    /// The database's.
    pub async fn feed_statements(
        &self,
        replication: Option<(&str, &str)>,
        source: Option<&SourceTable>,
    ) -> Result<Vec<String>, Error> {
        let pool = &self.backend.pool;
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
        pg::run(&self.backend.pool, statements).await
    }

    /// A database set up for the other mode than the relay's (`replication`
    /// or claim), with what to do; `None` when they agree.
    ///
    /// # Errors
    /// The database's.
    pub async fn mode_mismatch(&self, replication: bool) -> Result<Option<&'static str>, Error> {
        pg::mode_mismatch(&self.backend.pool, replication).await
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
        pg::problems(&self.backend.pool, slot, publication, source).await
    }

    /// The slot's state; `None` when there is no such slot. Bounded as the
    /// relay's other background statements are: readiness gives up on it
    /// after a few seconds, and a session left mid-statement is closed.
    ///
    /// # Errors
    /// The database's.
    pub async fn slot_status(&self, slot: &str) -> Result<Option<SlotStatus>, Error> {
        self.backend
            .bounded("replication slot status", async |session| {
                pg::slot_status(&mut *session, slot).await
            })
            .await
    }

    /// Hands streamed rows to the claim path with their outcomes: leased
    /// as if claimed, then acked. Returns, per row, whether the table now
    /// holds it for the claim path (taken over now, or before: a replay).
    /// A row taken over whose outcome is not recorded (the ack failed) is
    /// held under a lease, and claimed again when it expires.
    ///
    /// # Errors
    /// The database's; nothing is recorded then.
    pub async fn hand_over(
        &self,
        owner: &str,
        lease_ms: i64,
        rows: &[&StreamedRow],
        outcomes: &[RowOutcome],
    ) -> Result<Vec<bool>, Error> {
        let lease = LeaseId(uuid::Uuid::new_v4());
        let taken = pg::take_over(&self.backend.pool, owner, lease, lease_ms, rows).await?;
        let pool = &self.backend.pool;
        settle_hand_over(
            &self.store,
            lease,
            rows,
            outcomes,
            taken.in_table,
            taken.renamed,
            async |ids, fresh| pg::give_back(pool, lease, ids, fresh).await,
        )
        .await
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
        if keys.is_empty() {
            return Ok(HashSet::new());
        }
        pg::waiting_in_table(&self.backend.pool, keys, self.store.dead_letter_blocks_aggregate).await
    }

    /// Whether any aggregate waits behind a row in the table.
    ///
    /// # Errors
    /// The database's.
    pub async fn anything_waiting_in_table(&self) -> Result<bool, Error> {
        pg::anything_waiting_in_table(&self.backend.pool, self.store.dead_letter_blocks_aggregate).await
    }
}

/// The end of a hand-over on either server: rows taken after an earlier
/// event of their aggregate that was not are given back (the claim path
/// would publish them before it) and not proved; the rest are acked with
/// their outcomes under the hand-over's lease.
async fn settle_hand_over(
    store: &OutboxStore,
    lease: LeaseId,
    rows: &[&StreamedRow],
    outcomes: &[RowOutcome],
    mut in_table: Vec<bool>,
    renamed: Vec<(RowId, RowId)>,
    give_back: impl AsyncFnOnce(&[i64], &[i64]) -> Result<(), Error>,
) -> Result<Vec<bool>, Error> {
    let renamed: std::collections::HashMap<_, _> = renamed.into_iter().collect();
    let keys = rows
        .iter()
        .map(|r| (r.row.aggregate_type.as_str(), r.row.aggregate_id.as_str()));
    let behind = behind_a_gap(keys, &in_table);
    if !behind.is_empty() {
        let (mut ids, mut fresh) = (Vec::new(), Vec::new());
        for &at in &behind {
            let id = rows[at].row.id;
            match renamed.get(&id) {
                Some(new) => fresh.push(new.0),
                None => ids.push(id.0),
            }
            in_table[at] = false;
        }
        give_back(&ids, &fresh).await?;
    }
    let outcomes: Vec<RowOutcome> = outcomes
        .iter()
        .enumerate()
        .filter(|(at, _)| !behind.contains(at))
        .map(|(_, outcome)| RowOutcome {
            id: renamed.get(&outcome.id).copied().unwrap_or(outcome.id),
            ..outcome.clone()
        })
        .collect();
    store.ack(lease, &outcomes).await?;
    Ok(in_table)
}

/// The outbox on MariaDB set up for binlog mode, the MySQL form of
/// replication mode.
#[derive(Clone, Debug)]
pub struct BinlogOutbox {
    store: OutboxStore,
    pool: sqlx::MySqlPool,
    mariadb: bool,
}

impl OutboxStore {
    /// The MySQL or MariaDB outbox, for binlog mode.
    pub fn binlog(&self) -> Option<BinlogOutbox> {
        self.mysql_pool().map(|(pool, mariadb)| BinlogOutbox {
            store: self.clone(),
            pool,
            mariadb,
        })
    }
}

impl BinlogOutbox {
    /// The pool the position is recorded through.
    pub(crate) fn pool(&self) -> sqlx::MySqlPool {
        self.pool.clone()
    }

    /// What `migrate` runs to put the outbox into binlog mode, reading from
    /// position `name`, or with `None` back to claim mode.
    ///
    /// # Errors
    /// The database's.
    pub async fn feed_statements(&self, name: Option<&str>) -> Result<Vec<String>, Error> {
        binlog::feed_statements(&self.pool, name).await
    }

    /// Runs what [`BinlogOutbox::feed_statements`] returned.
    ///
    /// # Errors
    /// The database's.
    pub async fn run_feed_statements(&self, statements: &[String]) -> Result<(), Error> {
        binlog::run(&self.pool, statements).await
    }

    /// A database set up for the other mode than the relay's, with what to
    /// do; `None` when they agree.
    ///
    /// # Errors
    /// The database's.
    pub async fn mode_mismatch(&self, binlog: bool) -> Result<Option<&'static str>, Error> {
        binlog::mode_mismatch(&self.pool, binlog).await
    }

    /// Everything that keeps binlog mode from working here, each saying
    /// what to do, and what works but less well.
    ///
    /// # Errors
    /// The database's.
    pub async fn binlog_report(&self, name: &str) -> Result<(Vec<String>, Vec<String>), Error> {
        let problems = binlog::problems(&self.pool, self.mariadb, name).await?;
        let warnings = binlog::warnings(&self.pool).await?;
        Ok((problems, warnings))
    }

    /// As [`PgOutbox::hand_over`].
    ///
    /// # Errors
    /// The database's; nothing is recorded then.
    pub async fn hand_over(
        &self,
        owner: &str,
        lease_ms: i64,
        rows: &[&StreamedRow],
        outcomes: &[RowOutcome],
    ) -> Result<Vec<bool>, Error> {
        let lease = LeaseId(uuid::Uuid::new_v4());
        let in_table = binlog::take_over(&self.pool, owner, lease, lease_ms, rows).await?;
        let pool = &self.pool;
        settle_hand_over(
            &self.store,
            lease,
            rows,
            outcomes,
            in_table,
            Vec::new(),
            async |ids, _| binlog::give_back(pool, lease, ids).await,
        )
        .await
    }

    /// As [`PgOutbox::waiting_in_table`].
    ///
    /// # Errors
    /// The database's.
    pub async fn waiting_in_table(
        &self,
        keys: &[(String, String)],
    ) -> Result<HashSet<(String, String)>, Error> {
        if keys.is_empty() {
            return Ok(HashSet::new());
        }
        binlog::waiting_in_table(&self.pool, keys, self.store.dead_letter_blocks_aggregate).await
    }

    /// As [`PgOutbox::anything_waiting_in_table`].
    ///
    /// # Errors
    /// The database's.
    pub async fn anything_waiting_in_table(&self) -> Result<bool, Error> {
        binlog::anything_waiting_in_table(&self.pool, self.store.dead_letter_blocks_aggregate).await
    }
}

/// Of rows handed over together (in stream order, by their aggregates)
/// with whether the table took each, those taken after an earlier row of
/// their aggregate that was not.
fn behind_a_gap<K: Eq + std::hash::Hash>(keys: impl Iterator<Item = K>, in_table: &[bool]) -> Vec<usize> {
    let mut gaps: HashSet<K> = HashSet::new();
    let mut behind = Vec::new();
    for (at, key) in keys.enumerate() {
        if !in_table.get(at).copied().unwrap_or(false) {
            gaps.insert(key);
        } else if gaps.contains(&key) {
            behind.push(at);
        }
    }
    behind
}

#[cfg(test)]
mod tests {
    use super::behind_a_gap;

    #[test]
    fn rows_taken_behind_an_untaken_row_of_their_aggregate_are_named() {
        let keys = ["a", "b", "a", "a", "b", "c"];
        let taken = [false, true, true, false, true, true];
        assert_eq!(behind_a_gap(keys.iter(), &taken), vec![2]);
        assert_eq!(behind_a_gap(keys.iter(), &[true; 6]), Vec::<usize>::new());
        assert_eq!(behind_a_gap(["a", "a"].iter(), &[false, true]), vec![1]);
    }
}
