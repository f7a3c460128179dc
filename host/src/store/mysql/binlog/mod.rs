//! Binlog mode, the MariaDB form of replication mode: rows a writer inserts
//! are `streamed`, read from the binary log by one relay at a time and
//! published without a row update; what is not published is handed over to
//! the table, where the claim path takes it as in claim mode. Here: what
//! `migrate` runs, what `validate` and startup check, and the hand-over.

#[cfg(feature = "binlog")]
pub(crate) mod gtid;
#[cfg(feature = "binlog")]
mod stream;
#[cfg(not(feature = "binlog"))]
mod unbuilt;

#[cfg(feature = "binlog")]
pub use stream::BinlogStream;
#[cfg(not(feature = "binlog"))]
pub use unbuilt::{BinlogStream, without_binlog};

use std::collections::HashSet;

use sqlx::{MySqlPool, QueryBuilder, Row};

use super::placeholders;
use crate::store::change_stream::{
    AggregateKey, ChangeSource, ChangeStream, FeedNames, HandoverTable, StreamBatch, StreamError,
    StreamedRow, settle_hand_over,
};
use crate::store::{Error, LeaseId, OutboxStore, RowOutcome};

/// How to reach the binary log.
#[derive(Debug, Clone)]
pub struct BinlogSettings {
    /// The database: URL, TLS and password source.
    pub endpoint: crate::endpoint::Endpoint,
    /// The position's name (`[replication] slot`): one reader at a time.
    pub name: String,
    /// Rows per batch at most (a transaction is never split).
    pub batch_size: usize,
}

/// Rows read from the binary log: complete transactions only, done at the
/// last one's sequence number in this session.
pub type BinlogBatch = StreamBatch<u64>;

/// A relay in binlog mode on a database set up for claim mode.
const BINLOG_ON_CLAIM: &str = "this database is set up for claim mode: switchyard_outbox writes its rows for \
     claiming (status defaults to 'pending'), which a binlog-mode relay does not read. Run `switchyard migrate` \
     with this replication-mode config to switch the database (it records the binary log position to start \
     from), or run the relay in claim mode";

/// A claim-mode relay on a database set up for binlog mode.
const CLAIM_ON_BINLOG: &str = "this database is set up for binlog mode: switchyard_outbox writes its rows \
     `streamed`, for a relay reading the binary log, and a claim-mode relay never claims them. Run the relay \
     in replication mode (relay.mode = \"replication\"), or switch the database with `switchyard migrate` on \
     this claim-mode config once its binlog-mode relays have stopped";

/// Whether the outbox writes its rows `streamed` (`None`: no outbox).
async fn streamed_default(pool: &MySqlPool) -> Result<Option<bool>, Error> {
    let default: Option<Option<String>> = sqlx::query_scalar(
        "SELECT CAST(column_default AS CHAR) FROM information_schema.columns
          WHERE table_schema = DATABASE() AND table_name = 'switchyard_outbox' AND column_name = 'status'",
    )
    .fetch_optional(pool)
    .await?;
    Ok(default.map(|d| d.is_some_and(|d| d.contains("streamed"))))
}

/// The statements that put the outbox into binlog mode, reading from
/// position `name` (only what is missing), or with `None` back to claim
/// mode. The position is recorded before rows are written `streamed`, so
/// the reader starts before the first of them.
pub(crate) async fn feed_statements(pool: &MySqlPool, name: Option<&str>) -> Result<Vec<String>, Error> {
    let streamed = streamed_default(pool).await?.unwrap_or(false);
    let mut statements = Vec::new();
    let Some(name) = name else {
        if streamed {
            statements.push(
                "ALTER TABLE switchyard_outbox ALTER COLUMN status SET DEFAULT 'pending', \
                 ALTER COLUMN published_at DROP DEFAULT"
                    .to_string(),
            );
        }
        return Ok(statements);
    };
    // Before `migrate` made the table (a dry run), nothing is recorded.
    let recorded: Option<String> = if positions_table(pool).await? {
        sqlx::query_scalar("SELECT gtid_position FROM switchyard_binlog_positions WHERE name = ?")
            .bind(name)
            .fetch_optional(pool)
            .await?
    } else {
        None
    };
    if recorded.is_none() {
        statements.push(format!(
            "INSERT IGNORE INTO switchyard_binlog_positions (name, gtid_position, updated_at) \
             VALUES ('{}', @@global.gtid_binlog_pos, UTC_TIMESTAMP(6))",
            name.replace('\'', "''")
        ));
    }
    if !streamed {
        // A streamed row is published when it is read: `published_at` is
        // when it was written, so that retention removes it like any
        // published row. UTC_TIMESTAMP, not NOW(): a writer's session may
        // run in any time zone.
        statements.push(
            "ALTER TABLE switchyard_outbox ALTER COLUMN status SET DEFAULT 'streamed', \
             ALTER COLUMN published_at SET DEFAULT (UTC_TIMESTAMP(6))"
                .to_string(),
        );
    }
    Ok(statements)
}

/// Whether the binlog position table exists (its migration ran).
async fn positions_table(pool: &MySqlPool) -> Result<bool, Error> {
    let count: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables
          WHERE table_schema = DATABASE() AND table_name = 'switchyard_binlog_positions'",
    )
    .fetch_one(pool)
    .await?;
    Ok(count > 0)
}

/// Runs what [`feed_statements`] returned, each on its own.
pub(crate) async fn run(pool: &MySqlPool, statements: &[String]) -> Result<(), Error> {
    for statement in statements {
        sqlx::query(statement).execute(pool).await?;
    }
    Ok(())
}

/// What keeps a relay in the given mode from working on this database
/// because it is set up for the other one.
pub(crate) async fn mode_mismatch(pool: &MySqlPool, binlog: bool) -> Result<Option<&'static str>, Error> {
    Ok(match (binlog, streamed_default(pool).await?) {
        (false, Some(true)) => Some(CLAIM_ON_BINLOG),
        (true, Some(false)) => Some(BINLOG_ON_CLAIM),
        _ => None,
    })
}

/// Everything that keeps binlog mode from working here, each saying what
/// to do: the server, its binary log settings, the account's privilege,
/// the migration and the recorded position.
pub(crate) async fn problems(pool: &MySqlPool, mariadb: bool, name: &str) -> Result<Vec<String>, Error> {
    if !mariadb {
        return Ok(vec![
            "binlog mode reads MariaDB's GTIDs; MySQL 8 writes GTIDs of another form, which this relay does \
             not read yet: run claim mode (relay.mode = \"claim\") on MySQL"
                .into(),
        ]);
    }
    let mut problems = Vec::new();
    let (log_bin, format, image): (i64, String, String) =
        sqlx::query_as("SELECT @@global.log_bin, @@global.binlog_format, @@global.binlog_row_image")
            .fetch_one(pool)
            .await?;
    if log_bin == 0 {
        problems.push(
            "the binary log is off: start the server with log_bin (and binlog_format = ROW, \
             binlog_row_image = FULL), which takes a restart"
                .to_string(),
        );
    } else {
        if !format.eq_ignore_ascii_case("ROW") {
            problems.push(format!(
                "binlog_format is {format}: binlog mode reads row events; set binlog_format = ROW \
                 (SET GLOBAL binlog_format = 'ROW', and in the server's configuration)"
            ));
        }
        if !image.eq_ignore_ascii_case("FULL") {
            problems.push(format!(
                "binlog_row_image is {image}: an event needs every column of its row; set \
                 binlog_row_image = FULL (SET GLOBAL, and in the server's configuration)"
            ));
        }
    }
    let grants: Vec<String> = sqlx::query_scalar("SHOW GRANTS").fetch_all(pool).await?;
    let granted = |privilege: &str| {
        grants.iter().any(|g| {
            let g = g.to_ascii_uppercase();
            g.contains("ALL PRIVILEGES ON *.*") || (g.contains(privilege) && g.contains(" ON *.*"))
        })
    };
    if !granted("REPLICATION SLAVE") {
        problems.push(
            "the relay's account lacks REPLICATION SLAVE (REPLICATION REPLICA), which reading the binary log \
             takes: GRANT REPLICATION SLAVE ON *.* TO the account"
                .to_string(),
        );
    }
    if !positions_table(pool).await? {
        problems.push("the outbox has no binlog position table: run `switchyard migrate`".to_string());
    } else {
        let recorded: Option<String> =
            sqlx::query_scalar("SELECT gtid_position FROM switchyard_binlog_positions WHERE name = ?")
                .bind(name)
                .fetch_optional(pool)
                .await?;
        if recorded.is_none() {
            problems.push(format!(
                "no binlog position named {name:?} is recorded: run `switchyard migrate` with this config, \
                 which records where reading starts"
            ));
        }
    }
    Ok(problems)
}

/// Warnings about binlog mode: what works, but less well.
pub(crate) async fn warnings(pool: &MySqlPool) -> Result<Vec<String>, Error> {
    let metadata: Option<String> = sqlx::query_scalar("SELECT CAST(@@global.binlog_row_metadata AS CHAR)")
        .fetch_optional(pool)
        .await
        .unwrap_or(None);
    Ok(match metadata {
        Some(m) if !m.eq_ignore_ascii_case("FULL") => vec![format!(
            "binlog_row_metadata is {m}: the relay reads the outbox's column order once at start, and an \
             ALTER TABLE while it runs would be read wrongly until it restarts; set binlog_row_metadata = FULL"
        )],
        _ => Vec::new(),
    })
}

/// Takes streamed rows over for the claim path under `lease`: a row still
/// `streamed` is leased as if claimed, a row no longer in the table is
/// written back, a row the claim path has already is left alone. Returns,
/// per row, whether the table now holds it for the claim path.
///
/// Rows are written back one statement at a time, each its own
/// transaction, after the leasing transaction has committed. A row its
/// service deleted as it wrote it leaves a delete-marked index entry until
/// purge; writing its event id again makes InnoDB check that entry under
/// next-key locks, which service inserts beside it wait on. A batch held
/// such locks across many rows while waiting on a service's new row, and
/// InnoDB rolled services back as deadlock victims (once in about 3,000
/// transactions with eight writers). One row's locks close a cycle only if
/// one service transaction inserts on both sides of that very entry.
pub(crate) async fn take_over(
    pool: &MySqlPool,
    owner: &str,
    lease: LeaseId,
    lease_ms: i64,
    rows: &[&StreamedRow],
) -> Result<Vec<bool>, Error> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let lease_text = lease.0.to_string();
    let lease_us = lease_ms.saturating_mul(1000);
    let mut tx = pool.begin().await?;
    let ids: Vec<i64> = rows.iter().map(|r| r.row.id.0).collect();
    let found: Vec<(i64, String)> = {
        let sql = format!(
            "SELECT id, status FROM switchyard_outbox WHERE id IN ({}) FOR UPDATE",
            placeholders(ids.len())
        );
        let mut query = sqlx::query_as(&sql);
        for id in &ids {
            query = query.bind(id);
        }
        query.fetch_all(&mut *tx).await?
    };
    let found: std::collections::HashMap<i64, String> = found.into_iter().collect();
    let streamed: Vec<i64> = ids
        .iter()
        .copied()
        .filter(|id| found.get(id).is_some_and(|s| s == "streamed"))
        .collect();
    if !streamed.is_empty() {
        let sql = format!(
            "UPDATE switchyard_outbox
                SET status = 'in_flight', published_at = NULL, attempts = attempts + 1,
                    lease_owner = ?, lease_id = ?, lease_expires_at = NOW(6) + INTERVAL ? MICROSECOND
              WHERE id IN ({}) AND status = 'streamed'",
            placeholders(streamed.len())
        );
        let mut query = sqlx::query(&sql).bind(owner).bind(&lease_text).bind(lease_us);
        for id in &streamed {
            query = query.bind(id);
        }
        query.execute(&mut *tx).await?;
    }
    tx.commit().await?;
    // Gone from the table before the hand-over (deleted by its writer, by
    // hand or by retention): written back from what the binary log carried.
    let mut seen = HashSet::new();
    let missing: Vec<&StreamedRow> = rows
        .iter()
        .copied()
        .filter(|r| !found.contains_key(&r.row.id.0) && seen.insert(r.row.id.0))
        .collect();
    let mut conn = pool.acquire().await?;
    for row in missing {
        write_back(&mut conn, owner, &lease_text, lease_us, row).await?;
    }
    in_table(&mut conn, rows).await
}

/// Writes a row back into the table, taken over under the lease; a row
/// already there (another relay wrote it back) is left as it is.
async fn write_back(
    conn: &mut sqlx::MySqlConnection,
    owner: &str,
    lease_text: &str,
    lease_us: i64,
    missing: &StreamedRow,
) -> Result<(), Error> {
    let mut insert = QueryBuilder::new(
        "INSERT IGNORE INTO switchyard_outbox
            (id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers, tenant,
             created_at, not_before, status, attempts, lease_owner, lease_id, lease_expires_at, published_at) ",
    );
    insert.push_values([missing], |mut values, r| {
        let row = &r.row;
        values
            .push_bind(row.id.0)
            .push_bind(row.event_id.to_string())
            .push_bind(row.aggregate_type.clone())
            .push_bind(row.aggregate_id.clone())
            .push_bind(row.event_type.clone())
            .push_bind(row.payload_json.clone())
            .push_bind(row.payload_bytes.clone())
            .push_bind(row.headers_json.clone())
            .push_bind(row.tenant.clone())
            .push("FROM_UNIXTIME(")
            .push_bind_unseparated(r.text.created_at.clone())
            .push_unseparated(")")
            .push("FROM_UNIXTIME(")
            .push_bind_unseparated(r.text.not_before.clone())
            .push_unseparated(")")
            .push("'in_flight'")
            .push("1")
            .push_bind(owner.to_string())
            .push_bind(lease_text.to_string())
            .push("NOW(6) + INTERVAL ")
            .push_bind_unseparated(lease_us)
            .push_unseparated(" MICROSECOND")
            .push("NULL");
    });
    insert.build().execute(&mut *conn).await?;
    Ok(())
}

/// Per row: whether the table holds it for the claim path, by its id
/// (taken now or before), or by its event id under another id (a row
/// written again by hand).
async fn in_table(conn: &mut sqlx::MySqlConnection, rows: &[&StreamedRow]) -> Result<Vec<bool>, Error> {
    let sql = format!(
        "SELECT id, event_id, status FROM switchyard_outbox
          WHERE id IN ({0}) OR event_id IN ({0})",
        placeholders(rows.len())
    );
    let mut query = sqlx::query(&sql);
    for r in rows {
        query = query.bind(r.row.id.0);
    }
    for r in rows {
        query = query.bind(r.row.event_id.to_string());
    }
    let held = query.fetch_all(&mut *conn).await?;
    let mut by_id = std::collections::HashMap::new();
    let mut by_event = std::collections::HashMap::new();
    for row in &held {
        let id: i64 = row.try_get(0)?;
        let event_id: String = row.try_get(1)?;
        let status: String = row.try_get(2)?;
        by_id.insert(id, status);
        by_event.insert(event_id, id);
    }
    Ok(rows
        .iter()
        .map(|r| {
            let own = by_id.get(&r.row.id.0).is_some_and(|s| s != "streamed");
            let elsewhere = by_event
                .get(&r.row.event_id.to_string())
                .is_some_and(|&id| id != r.row.id.0);
            own || elsewhere
        })
        .collect())
}

/// Gives back rows a hand-over under `lease` took but must not keep (see
/// the PostgreSQL side): `streamed` again, fenced by the lease.
pub(crate) async fn give_back(pool: &MySqlPool, lease: LeaseId, ids: &[i64]) -> Result<(), Error> {
    if ids.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "UPDATE switchyard_outbox
            SET status = 'streamed', published_at = UTC_TIMESTAMP(6), attempts = greatest(attempts - 1, 0),
                lease_owner = NULL, lease_id = NULL, lease_expires_at = NULL
          WHERE id IN ({}) AND status = 'in_flight' AND lease_id = ?",
        placeholders(ids.len())
    );
    let mut query = sqlx::query(&sql);
    for id in ids {
        query = query.bind(id);
    }
    query.bind(lease.0.to_string()).execute(pool).await?;
    Ok(())
}

/// The unfinished states, with dead letters when they block.
fn unfinished(dead_letters_block: bool) -> &'static str {
    if dead_letters_block {
        "'pending', 'in_flight', 'dead'"
    } else {
        "'pending', 'in_flight'"
    }
}

/// Of these aggregates, those with an unfinished row in the table: their
/// next events wait behind it, in the table.
pub(crate) async fn waiting_in_table(
    pool: &MySqlPool,
    keys: &[(String, String)],
    dead_letters_block: bool,
) -> Result<HashSet<(String, String)>, Error> {
    let distinct: Vec<&(String, String)> = keys.iter().collect::<HashSet<_>>().into_iter().collect();
    let mut found = HashSet::new();
    // Bounded statements: a batch's keys in parts.
    for part in distinct.chunks(500) {
        let sql = format!(
            "SELECT DISTINCT aggregate_type, aggregate_id FROM switchyard_outbox
              WHERE aggregate_key IN ({}) AND status IN ({})",
            vec!["unhex(md5(concat(?, char(0), ?)))"; part.len()].join(", "),
            unfinished(dead_letters_block)
        );
        let mut query = sqlx::query_as::<_, (String, String)>(&sql);
        for (t, i) in part {
            query = query.bind(t).bind(i);
        }
        found.extend(query.fetch_all(pool).await?);
    }
    // Two aggregates may share a hash: only those asked for.
    let asked: HashSet<&(String, String)> = keys.iter().collect();
    Ok(found.into_iter().filter(|k| asked.contains(k)).collect())
}

/// Whether any aggregate waits in the table at all.
pub(crate) async fn anything_waiting_in_table(
    pool: &MySqlPool,
    dead_letters_block: bool,
) -> Result<bool, Error> {
    // One EXISTS per state, each answered by the claim index.
    let probes: Vec<String> = unfinished(dead_letters_block)
        .split(", ")
        .map(|status| format!("EXISTS (SELECT 1 FROM switchyard_outbox WHERE status = {status})"))
        .collect();
    let any: i64 = sqlx::query_scalar(&format!("SELECT {}", probes.join(" OR ")))
        .fetch_one(pool)
        .await?;
    Ok(any != 0)
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
        feed_statements(&self.pool, name).await
    }

    /// Runs what [`BinlogOutbox::feed_statements`] returned.
    ///
    /// # Errors
    /// The database's.
    pub async fn run_feed_statements(&self, statements: &[String]) -> Result<(), Error> {
        run(&self.pool, statements).await
    }

    /// A database set up for the other mode than the relay's, with what to
    /// do; `None` when they agree.
    ///
    /// # Errors
    /// The database's.
    pub async fn mode_mismatch(&self, binlog: bool) -> Result<Option<&'static str>, Error> {
        mode_mismatch(&self.pool, binlog).await
    }

    /// Everything that keeps binlog mode from working here, each saying
    /// what to do, and what works but less well.
    ///
    /// # Errors
    /// The database's.
    pub async fn binlog_report(&self, name: &str) -> Result<(Vec<String>, Vec<String>), Error> {
        let problems = problems(&self.pool, self.mariadb, name).await?;
        let warnings = warnings(&self.pool).await?;
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
        let in_table = take_over(&self.pool, owner, lease, lease_ms, rows).await?;
        let pool = &self.pool;
        settle_hand_over(
            &self.store,
            lease,
            rows,
            outcomes,
            in_table,
            Vec::new(),
            async |ids, _| give_back(pool, lease, ids).await,
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
        waiting_in_table(&self.pool, keys, self.store.dead_letter_blocks_aggregate).await
    }

    /// As [`PgOutbox::anything_waiting_in_table`].
    ///
    /// # Errors
    /// The database's.
    pub async fn anything_waiting_in_table(&self) -> Result<bool, Error> {
        anything_waiting_in_table(&self.pool, self.store.dead_letter_blocks_aggregate).await
    }
}

impl HandoverTable for BinlogOutbox {
    async fn waiting_in_table(&self, keys: &[AggregateKey]) -> Result<HashSet<AggregateKey>, Error> {
        BinlogOutbox::waiting_in_table(self, keys).await
    }

    async fn anything_waiting_in_table(&self) -> Result<bool, Error> {
        BinlogOutbox::anything_waiting_in_table(self).await
    }

    async fn hand_over(
        &self,
        owner: &str,
        lease_ms: i64,
        rows: &[&StreamedRow],
        outcomes: &[RowOutcome],
    ) -> Result<Vec<bool>, Error> {
        BinlogOutbox::hand_over(self, owner, lease_ms, rows, outcomes).await
    }

    async fn mode_mismatch(&self, replication: bool) -> Result<Option<&'static str>, Error> {
        BinlogOutbox::mode_mismatch(self, replication).await
    }

    /// The position's name alone: binlog mode has no publication, and a
    /// `[source]` table is relayed from PostgreSQL only (refused before).
    async fn feed_statements(&self, feed: Option<FeedNames<'_>>) -> Result<Vec<String>, Error> {
        BinlogOutbox::feed_statements(self, feed.map(|feed| feed.slot)).await
    }

    async fn run_feed_statements(&self, statements: &[String]) -> Result<(), Error> {
        BinlogOutbox::run_feed_statements(self, statements).await
    }
}

impl ChangeStream for BinlogStream {
    type Position = u64;

    async fn next_batch(&mut self) -> Result<BinlogBatch, StreamError> {
        BinlogStream::next_batch(self).await
    }

    fn confirm(&self, position: u64) {
        BinlogStream::confirm(self, position);
    }

    async fn close(self) {
        BinlogStream::close(self).await;
    }
}

/// A MariaDB binary log as a feed's source.
pub struct BinlogSource {
    /// How to read the binary log.
    pub settings: BinlogSettings,
    /// The outbox it hands over to.
    pub outbox: BinlogOutbox,
}

impl ChangeSource for BinlogSource {
    type Stream = BinlogStream;
    type Table = BinlogOutbox;

    fn name(&self) -> &str {
        &self.settings.name
    }

    fn table(&self) -> BinlogOutbox {
        self.outbox.clone()
    }

    async fn open(&self) -> Result<BinlogStream, StreamError> {
        BinlogStream::open(&self.settings, self.outbox.pool()).await
    }
}
