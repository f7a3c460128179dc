//! The outbox on MySQL 8 and MariaDB 10.6+, shared by many relays as on
//! PostgreSQL: a claim locks the heads of aggregates with `FOR UPDATE SKIP
//! LOCKED` and stamps a lease on them, an ack is fenced by that lease.
//!
//! Neither server has `UPDATE ... RETURNING`, so a claim is a transaction
//! of a few statements: find the heads (a consistent read), lock them,
//! update them, read them; see [`Heads`] for why finding and locking are
//! two steps. The head-of-aggregate check is a `NOT EXISTS` subquery, a
//! consistent read: an earlier row another relay holds (locked, changed
//! but not committed) is still unfinished there, so the row behind it is
//! not taken (the first tests of `tests/claim/order.rs` hold the server to
//! both).

mod ack;
pub(crate) mod binlog;
mod checks;
mod connect;
mod fleet;

pub use checks::ServerReport;
pub(crate) use connect::Flavor;

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::mysql::{MySqlDatabaseError, MySqlRow};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, MySql as Db, MySqlConnection, MySqlPool, QueryBuilder, Row};

use super::backend::Backend;
use super::dialect::{self, DeadLetterChange, Dialect, lenient};
use super::types::{
    Claim, DeadLetterFilter, Generation, LeaseId, OutboxEntry, OutboxRow, OutboxStats, PublishedRows,
    RetentionMode, RowId, RowOutcome,
};
use super::{Error, MYSQL_MIGRATOR};

const DIALECT: Dialect = Dialect::MySql;

/// [`MySql::generation`] not asked yet, or its answer. A MySQL outbox is
/// only ever made by `switchyard migrate`: the previous generation is the
/// table of `20261205000000_create_outbox`, the current one has the
/// `parked` column of `20261209000000_parked_rows_apart`. Relays serve
/// both, so that relays and `migrate` can be upgraded in either order.
const UNKNOWN: u8 = 0;
const PREVIOUS: u8 = 1;
const CURRENT: u8 = 2;

/// How long past its statement bound a claim or an ack may go unanswered
/// before its session is closed (the server stops the statement at the
/// bound; a session silent after that is not going to answer).
const ANSWER_MARGIN: Duration = Duration::from_secs(5);

/// A MySQL or MariaDB outbox.
#[derive(Clone, Debug)]
pub(super) struct MySql {
    pub(super) pool: MySqlPool,
    flavor: Flavor,
    /// The head-selecting statements, built once, by schema generation
    /// (0: previous, 1: current) and dead letters (0 lets later events of
    /// an aggregate pass a dead-lettered one, 1 keeps them waiting).
    heads: Arc<[[Heads; 2]; 2]>,
    /// The schema's generation once known ([`UNKNOWN`], [`PREVIOUS`],
    /// [`CURRENT`]), shared by the clones.
    generation: Arc<std::sync::atomic::AtomicU8>,
    /// How long a claim or an ack may go unanswered (none: as long as it takes).
    answer_within: Option<Duration>,
    /// Stops the pool's password renewal when the last clone goes.
    _renewal: Option<Arc<tokio_util::sync::DropGuard>>,
}

/// How a claim finds and takes heads of aggregates, in two steps.
///
/// First the candidates, by plain (consistent) reads: rows whose lease ran
/// out, then pending rows that are due, each in id order through the claim
/// index (one status at a time: read in order, never sorted), each with no
/// earlier unfinished row of its aggregate. A consistent read sees one
/// committed state throughout, the subquery included.
///
/// Then the candidates are locked, `FOR UPDATE SKIP LOCKED`, by primary
/// key, their state checked again as last committed (another relay may
/// have taken one). Heads cannot be found by the locking read itself: in
/// InnoDB a locking read sees rows committed after its statement began,
/// and its subquery does not, so a claim could take the second event of a
/// transaction committed mid-scan without seeing the first (a reorder,
/// caught by `claims_racing_writers_...` in `tests/claim/order.rs`).
#[derive(Debug)]
struct Heads {
    expired: String,
    due: String,
    /// The head check, again, for the locking step.
    head: String,
}

/// A row's state that lets a claim take it: due and pending, or in flight
/// with its lease run out.
const CLAIMABLE: &str = "((o.status = 'pending' AND o.next_attempt_at <= NOW(6)
                          AND (o.not_before IS NULL OR o.not_before <= NOW(6)))
                      OR (o.status = 'in_flight' AND o.lease_expires_at < NOW(6)))";

/// Candidates read per row a claim may take: other relays' claims take
/// some of the same heads at the same time, and those are skipped.
const CANDIDATES_PER_ROW: u32 = 3;

impl Heads {
    /// With `parked_apart` (the current schema) the due rows are read
    /// through `switchyard_outbox_due_idx`, past none of the parked ones.
    fn new(dead_letter_blocks: bool, parked_apart: bool) -> Heads {
        let unfinished = if dead_letter_blocks {
            "'pending', 'in_flight', 'dead'"
        } else {
            "'pending', 'in_flight'"
        };
        let head = format!(
            "NOT EXISTS (SELECT 1 FROM switchyard_outbox e
                          WHERE e.aggregate_key = o.aggregate_key
                            AND e.status IN ({unfinished})
                            AND e.id < o.id)"
        );
        Heads {
            expired: format!(
                "SELECT o.id FROM switchyard_outbox o FORCE INDEX (switchyard_outbox_claim_idx)
                  WHERE o.status = 'in_flight' AND o.lease_expires_at < NOW(6) AND {head}
                  ORDER BY o.id LIMIT ?"
            ),
            due: if parked_apart {
                format!(
                    "SELECT o.id FROM switchyard_outbox o FORCE INDEX (switchyard_outbox_due_idx)
                      WHERE o.status = 'pending' AND o.parked = 0 AND o.next_attempt_at <= NOW(6)
                        AND (o.not_before IS NULL OR o.not_before <= NOW(6)) AND {head}
                      ORDER BY o.id LIMIT ?"
                )
            } else {
                format!(
                    "SELECT o.id FROM switchyard_outbox o FORCE INDEX (switchyard_outbox_claim_idx)
                      WHERE o.status = 'pending' AND o.next_attempt_at <= NOW(6)
                        AND (o.not_before IS NULL OR o.not_before <= NOW(6)) AND {head}
                      ORDER BY o.id LIMIT ?"
                )
            },
            head,
        }
    }
}

/// The columns a claim reads, in the order [`row_from_record`] reads them:
/// a payload over `max` bytes (the first two parameters) is left on the
/// server, and only its size read.
const ROW_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type,
    CASE WHEN octet_length(payload) <= ? THEN CAST(payload AS CHAR) END AS payload_json,
    CASE WHEN octet_length(payload_bytes) <= ? THEN payload_bytes END AS payload_bytes,
    CAST(coalesce(octet_length(payload_bytes), octet_length(payload)) AS SIGNED) AS payload_len,
    CAST(headers AS CHAR) AS headers_json, tenant,
    CAST(UNIX_TIMESTAMP(created_at) * 1000 AS SIGNED) AS created_at_ms, attempts,
    CAST(deliveries AS CHAR) AS deliveries_json";

fn row_from_record(record: &MySqlRow) -> Result<OutboxRow, sqlx::Error> {
    let mut problem = None;
    let event_id: String = lenient(record, 1, "event_id", &mut problem);
    // Written only by the relay; unreadable means "nothing acked yet".
    let deliveries_json: String = lenient(record, 12, "deliveries", &mut None);
    // CHAR(36) and a CHECK on its form; an id made before the CHECK (or
    // by a table mapped from elsewhere) is dead-lettered saying so.
    let event_id = uuid::Uuid::from_str(&event_id).unwrap_or_else(|_| {
        problem.get_or_insert_with(|| {
            format!(
                "event_id {:?} is not a UUID; the event id is every broker's dedup id, so it must be unique",
                event_id.chars().take(64).collect::<String>()
            )
        });
        uuid::Uuid::nil()
    });
    let created_at_ms: Option<i64> = lenient(record, 10, "created_at", &mut problem);
    let mut row = OutboxRow {
        malformed: None,
        held_by: Vec::new(),
        id: RowId(record.try_get(0)?),
        event_id,
        aggregate_type: lenient(record, 2, "aggregate_type", &mut problem),
        aggregate_id: lenient(record, 3, "aggregate_id", &mut problem),
        event_type: lenient(record, 4, "event_type", &mut problem),
        payload_json: lenient(record, 5, "payload", &mut problem),
        payload_bytes: lenient(record, 6, "payload_bytes", &mut problem),
        headers_json: lenient(record, 8, "headers", &mut problem),
        tenant: lenient(record, 9, "tenant", &mut problem),
        created_at_ms: created_at_ms.unwrap_or_default(),
        attempts: lenient(record, 11, "attempts", &mut problem),
        deliveries: serde_json::from_str(&deliveries_json).unwrap_or_default(),
    };
    row.malformed = problem;
    Ok(row)
}

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

/// `?, ?, ...` for `n` parameters.
pub(super) fn placeholders(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// The error numbers that say nothing about the rows: a lock wait or
/// statement bound reached, a deadlock, an interrupted or killed
/// statement, too many connections, a server shutting down or read-only
/// (a fail-over), a lost connection.
pub(super) fn transient(error: &dyn sqlx::error::DatabaseError) -> bool {
    error.try_downcast_ref::<MySqlDatabaseError>().is_some_and(|e| {
        matches!(
            e.number(),
            1040 | 1053 | 1205 | 1213 | 1290 | 1317 | 1792 | 1927 | 1969 | 2006 | 2013 | 3024 | 4031
        )
    })
}

impl MySql {
    /// Connects a pool whose sessions carry the relay's settings; see
    /// [`connect::pool`].
    pub(super) async fn connect(
        endpoint: &crate::endpoint::Endpoint,
        max_connections: u32,
        statement_timeout: Option<Duration>,
    ) -> Result<MySql, Error> {
        let (pool, flavor, renewal) = connect::pool(endpoint, max_connections, statement_timeout).await?;
        Ok(MySql {
            pool,
            flavor,
            heads: Arc::new([
                [Heads::new(false, false), Heads::new(true, false)],
                [Heads::new(false, true), Heads::new(true, true)],
            ]),
            generation: Arc::new(std::sync::atomic::AtomicU8::new(UNKNOWN)),
            answer_within: statement_timeout.map(|timeout| timeout + timeout.min(ANSWER_MARGIN)),
            _renewal: renewal.map(Arc::new),
        })
    }

    /// Which server this is.
    pub(crate) fn flavor(&self) -> Flavor {
        self.flavor
    }

    /// Runs `work` on a session of its own, bounded by `answer_within`: a
    /// session that does not answer in time is closed, not pooled (its
    /// statement may still run; the next one must not read its answer).
    async fn bounded<T>(
        &self,
        what: &'static str,
        work: impl AsyncFnOnce(&mut MySqlConnection) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut conn: PoolConnection<Db> = self.pool.acquire().await?;
        let Some(within) = self.answer_within else {
            return work(&mut conn).await;
        };
        match tokio::time::timeout(within, work(&mut conn)).await {
            Ok(done) => done,
            Err(_) => {
                conn.close_on_drop();
                Err(Error::Unanswered { what, after: within })
            }
        }
    }

    /// Whether the schema keeps parked rows apart (the current generation).
    async fn parked_apart(&self) -> Result<bool, Error> {
        Ok(matches!(Backend::generation(self).await?, Generation::Current))
    }

    /// The heads of aggregates due now, locked, at most `limit`.
    async fn select_heads(
        &self,
        tx: &mut MySqlConnection,
        parked_apart: bool,
        dead_letter_blocks: bool,
        limit: u32,
    ) -> Result<Vec<i64>, Error> {
        let heads = &self.heads[usize::from(parked_apart)][usize::from(dead_letter_blocks)];
        let wanted = i64::from(limit.saturating_mul(CANDIDATES_PER_ROW));
        let mut candidates: Vec<i64> = sqlx::query_scalar(&heads.expired)
            .bind(wanted)
            .fetch_all(&mut *tx)
            .await?;
        let room = wanted - i64::try_from(candidates.len()).unwrap_or(i64::MAX);
        if room > 0 {
            candidates.extend(
                sqlx::query_scalar::<_, i64>(&heads.due)
                    .bind(room)
                    .fetch_all(&mut *tx)
                    .await?,
            );
        }
        if candidates.is_empty() {
            return Ok(candidates);
        }
        let sql = format!(
            "SELECT o.id FROM switchyard_outbox o
              WHERE o.id IN ({}) AND {CLAIMABLE} AND {}
              ORDER BY o.id LIMIT ? FOR UPDATE SKIP LOCKED",
            placeholders(candidates.len()),
            heads.head
        );
        let mut query = sqlx::query_scalar::<_, i64>(&sql);
        for id in &candidates {
            query = query.bind(id);
        }
        Ok(query.bind(i64::from(limit)).fetch_all(&mut *tx).await?)
    }
}

impl Backend for MySql {
    async fn migrate(&self) -> Result<(), Error> {
        MYSQL_MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    async fn schema_exists(&self) -> Result<bool, Error> {
        table_exists(&self.pool, "switchyard_outbox").await
    }

    async fn generation(&self) -> Result<Generation, Error> {
        match self.generation.load(Ordering::Relaxed) {
            CURRENT => return Ok(Generation::Current),
            PREVIOUS => return Ok(Generation::Previous),
            _ => {}
        }
        // Read off the table itself, as on PostgreSQL: the relay's account
        // needs no privilege on `_sqlx_migrations` (MySQL shows a table
        // only to an account with a privilege on it).
        let parked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.columns
              WHERE table_schema = DATABASE() AND table_name = 'switchyard_outbox' AND column_name = 'parked'",
        )
        .fetch_one(&self.pool)
        .await?;
        let (generation, known) = if parked > 0 {
            (Generation::Current, CURRENT)
        } else if table_exists(&self.pool, "switchyard_outbox").await? {
            (Generation::Previous, PREVIOUS)
        } else {
            return Err(Error::SchemaTooOld {
                missing: "20261205000000_create_outbox",
            });
        };
        // Previous stays previous until the relay starts again: its
        // statements are right on the current schema too, only slower.
        self.generation.store(known, Ordering::Relaxed);
        Ok(generation)
    }

    async fn applied_migrations(&self) -> Result<Vec<i64>, Error> {
        if !table_exists(&self.pool, "_sqlx_migrations").await? {
            return Ok(Vec::new());
        }
        Ok(
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    async fn count_backlog(&self) -> Result<i64, Error> {
        Ok(sqlx::query_scalar(dialect::COUNT_BACKLOG)
            .fetch_one(&self.pool)
            .await?)
    }

    async fn oldest_pending_age(&self) -> Result<Option<f64>, Error> {
        // The lowest unfinished id of each status, through the claim index.
        let age: Option<Option<f64>> = sqlx::query_scalar(
            "SELECT TIMESTAMPDIFF(MICROSECOND, created_at, NOW(6)) / 1e6 FROM switchyard_outbox
              WHERE id = LEAST(
                    coalesce((SELECT min(id) FROM switchyard_outbox WHERE status = 'pending'
                                 AND (not_before IS NULL OR not_before <= NOW(6))), 9223372036854775807),
                    coalesce((SELECT min(id) FROM switchyard_outbox WHERE status = 'in_flight'), 9223372036854775807))",
        )
        .fetch_optional(&self.pool)
        .await?;
        Ok(age.flatten())
    }

    async fn refresh_statistics(&self) -> Result<(), Error> {
        sqlx::raw_sql("ANALYZE TABLE switchyard_outbox")
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn ping(&self) -> Result<(), Error> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn claim(
        &self,
        dead_letter_blocks: bool,
        owner: &str,
        limit: u32,
        lease: Duration,
        max_payload_bytes: usize,
    ) -> Result<Claim, Error> {
        let started = Instant::now();
        let lease_id = LeaseId(uuid::Uuid::new_v4());
        let max = i64::try_from(max_payload_bytes).unwrap_or(i64::MAX);
        // Known before the claim holds a session: asking the first time
        // takes another from the pool.
        let parked_apart = self.parked_apart().await?;
        let records = self
            .bounded("claim", async |conn| {
                let mut tx = conn.begin().await?;
                let ids = self
                    .select_heads(&mut tx, parked_apart, dead_letter_blocks, limit)
                    .await?;
                if ids.is_empty() {
                    tx.commit().await?;
                    return Ok(Vec::new());
                }
                let list = placeholders(ids.len());
                let sql = format!(
                    "UPDATE switchyard_outbox
                        SET status = 'in_flight', lease_owner = ?, lease_id = ?,
                            lease_expires_at = NOW(6) + INTERVAL ? MICROSECOND, attempts = attempts + 1
                      WHERE id IN ({list})"
                );
                let mut query = sqlx::query(&sql)
                    .bind(owner)
                    .bind(lease_id.0.hyphenated().to_string())
                    .bind(micros(lease));
                for id in &ids {
                    query = query.bind(id);
                }
                query.execute(&mut *tx).await?;
                let sql =
                    format!("SELECT {ROW_COLUMNS} FROM switchyard_outbox WHERE id IN ({list}) ORDER BY id");
                let mut query = sqlx::query(&sql).bind(max).bind(max);
                for id in &ids {
                    query = query.bind(id);
                }
                let records = query.fetch_all(&mut *tx).await?;
                tx.commit().await?;
                Ok(records)
            })
            .await?;
        let mut rows = Vec::with_capacity(records.len());
        for record in &records {
            let mut row = row_from_record(record)?;
            let len: Option<i64> = record.try_get(7).unwrap_or_default();
            row.refuse_payload_over(max_payload_bytes, len.and_then(|len| usize::try_from(len).ok()));
            rows.push(row);
        }
        Ok(Claim::polled(lease_id, rows, started, lease))
    }

    async fn ack(
        &self,
        lease: LeaseId,
        outcomes: &[RowOutcome],
        published_rows: PublishedRows,
    ) -> Result<Vec<RowId>, Error> {
        let lease = lease.0.hyphenated().to_string();
        self.bounded("ack", async |conn| {
            // One transaction for the batch: one commit, all or nothing.
            let mut tx = conn.begin().await?;
            let acked = ack::record(&mut tx, &lease, outcomes, published_rows).await?;
            tx.commit().await?;
            Ok(acked)
        })
        .await
    }

    /// Rows parked on a target nobody saw come back, whose backoff ran out:
    /// claims read only unparked rows, so they go back to them here (the
    /// previous schema's claims read parked rows as well).
    async fn unpark_stranded(&self, _dead_letter_blocks: bool, limit: u32) -> Result<u64, Error> {
        if !self.parked_apart().await? {
            return Ok(0);
        }
        // Found by a plain read, then set by primary key: an UPDATE that
        // walked the index would lock each parked row it read, and wait on
        // those a relay is waking (past the statement bound in the drain
        // after an outage).
        let moved = sqlx::query(
            "UPDATE switchyard_outbox f JOIN (
                SELECT id FROM switchyard_outbox FORCE INDEX (switchyard_outbox_due_idx)
                 WHERE status = 'pending' AND parked = 1 AND next_attempt_at <= NOW(6)
                 ORDER BY id LIMIT ?) AS s ON s.id = f.id
                SET f.waiting_on = NULL
              WHERE f.status = 'pending' AND f.waiting_on IS NOT NULL AND f.next_attempt_at <= NOW(6)",
        )
        .bind(i64::from(limit))
        .execute(&self.pool)
        .await?;
        Ok(moved.rows_affected())
    }

    /// The rows behind their aggregate's first pending row when that one
    /// waits: safe by construction, since none can be claimed before it
    /// anyway. Read from a snapshot, then set by primary key: a
    /// row whose predecessor was woken meanwhile waits on targets that are
    /// up, which the relays' waiting sweep wakes within seconds.
    async fn park_followers(&self, limit: u32) -> Result<u64, Error> {
        if !self.parked_apart().await? {
            return Ok(0);
        }
        let parked = sqlx::query(
            "UPDATE switchyard_outbox f JOIN (
                SELECT o.id, h.waiting_on, h.next_attempt_at
                  FROM switchyard_outbox o FORCE INDEX (switchyard_outbox_due_idx)
                  JOIN switchyard_outbox h ON h.id = (
                       SELECT min(e.id) FROM switchyard_outbox e
                        WHERE e.aggregate_key = o.aggregate_key AND e.status = 'pending' AND e.id < o.id)
                 WHERE o.status = 'pending' AND o.parked = 0
                   AND h.status = 'pending' AND h.waiting_on IS NOT NULL
                 ORDER BY o.id LIMIT ?) AS p ON p.id = f.id
                SET f.waiting_on = p.waiting_on, f.next_attempt_at = p.next_attempt_at
              WHERE f.status = 'pending' AND f.waiting_on IS NULL",
        )
        .bind(i64::from(limit))
        .execute(&self.pool)
        .await?;
        Ok(parked.rows_affected())
    }

    async fn wake_waiting(&self, target: Option<&str>, limit: u32) -> Result<u64, Error> {
        let sql = if self.parked_apart().await? {
            "UPDATE switchyard_outbox FORCE INDEX (switchyard_outbox_due_idx)
                SET waiting_on = NULL, next_attempt_at = NOW(6)
              WHERE status = 'pending' AND parked = 1
                AND (? IS NULL OR JSON_CONTAINS(waiting_on, JSON_QUOTE(?)))
              ORDER BY id LIMIT ?"
        } else {
            "UPDATE switchyard_outbox FORCE INDEX (switchyard_outbox_claim_idx)
                SET waiting_on = NULL, next_attempt_at = NOW(6)
              WHERE status = 'pending' AND waiting_on IS NOT NULL
                AND (? IS NULL OR JSON_CONTAINS(waiting_on, JSON_QUOTE(?)))
              ORDER BY id LIMIT ?"
        };
        let woken = sqlx::query(sql)
            .bind(target)
            .bind(target)
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await?;
        Ok(woken.rows_affected())
    }

    async fn waiting_by_target(&self) -> Result<BTreeMap<String, i64>, Error> {
        let parked = if self.parked_apart().await? {
            "o.parked = 1"
        } else {
            "o.waiting_on IS NOT NULL"
        };
        let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT t.target, count(*) FROM switchyard_outbox o,
                    JSON_TABLE(o.waiting_on, '$[*]' COLUMNS (target VARCHAR(255) PATH '$')) AS t
              WHERE o.status = 'pending' AND {parked} AND json_valid(o.waiting_on)
              GROUP BY t.target"
        ))
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().collect())
    }

    async fn peek_pending(&self, limit: u32) -> Result<Vec<OutboxRow>, Error> {
        let sql = format!(
            "SELECT {ROW_COLUMNS} FROM switchyard_outbox
              WHERE status IN ('pending', 'in_flight') ORDER BY id LIMIT ?"
        );
        let records = sqlx::query(&sql)
            .bind(i64::MAX)
            .bind(i64::MAX)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        Ok(records.iter().map(row_from_record).collect::<Result<_, _>>()?)
    }

    async fn release_owner(&self, owner: &str) -> Result<u64, Error> {
        Ok(sqlx::query(
            "UPDATE switchyard_outbox
                SET status = 'pending', lease_owner = NULL, lease_id = NULL,
                    lease_expires_at = NULL, attempts = attempts - 1
              WHERE status = 'in_flight' AND lease_owner = ?",
        )
        .bind(owner)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    dialect_queries!(|_mysql| DIALECT);

    /// The ids first, locked (MySQL cannot select from the table an UPDATE
    /// changes), then the update, in one transaction.
    async fn replay_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: i64,
        batch: u32,
    ) -> Result<Vec<i64>, Error> {
        let mut tx = self.pool.begin().await?;
        let mut select: QueryBuilder<'_, Db> = dialect::dead_letter_ids_query(DIALECT, filter, after, batch);
        select.push(" FOR UPDATE SKIP LOCKED");
        let ids: Vec<i64> = select.build_query_scalar().fetch_all(&mut *tx).await?;
        if !ids.is_empty() {
            let sql = format!(
                "UPDATE switchyard_outbox SET status = 'pending', attempts = 0, next_attempt_at = '1970-01-01'
                  WHERE id IN ({}) AND status = 'dead'",
                placeholders(ids.len())
            );
            let mut query = sqlx::query(&sql);
            for id in &ids {
                query = query.bind(id);
            }
            query.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(ids)
    }

    async fn purge_dead_letters(&self, filter: &DeadLetterFilter, batch: u32) -> Result<u64, Error> {
        Ok(
            dialect::dead_letter_change_query(DIALECT, DeadLetterChange::Purge, filter, 0, batch)
                .build()
                .execute(&self.pool)
                .await?
                .rows_affected(),
        )
    }

    async fn prune_published(
        &self,
        max_age: Duration,
        mode: RetentionMode,
        batch: u32,
    ) -> Result<u64, Error> {
        let mut tx = self.pool.begin().await?;
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM switchyard_outbox
              WHERE published_at < NOW(6) - INTERVAL ? MICROSECOND AND status IN ('published', 'streamed')
              ORDER BY published_at LIMIT ? FOR UPDATE SKIP LOCKED",
        )
        .bind(micros(max_age))
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await?;
        if ids.is_empty() {
            tx.commit().await?;
            return Ok(0);
        }
        let list = placeholders(ids.len());
        if mode == RetentionMode::Archive {
            let sql = format!(
                "INSERT INTO switchyard_outbox_archive ({columns})
                 SELECT {columns} FROM switchyard_outbox WHERE id IN ({list})",
                columns = dialect::ARCHIVE_COLUMNS
            );
            let mut query = sqlx::query(&sql);
            for id in &ids {
                query = query.bind(id);
            }
            query.execute(&mut *tx).await?;
        }
        let sql = format!("DELETE FROM switchyard_outbox WHERE id IN ({list})");
        let mut query = sqlx::query(&sql);
        for id in &ids {
            query = query.bind(id);
        }
        let done = query.execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }
}

/// Whether the current database has `table`.
async fn table_exists(pool: &MySqlPool, table: &str) -> Result<bool, Error> {
    let found: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables
          WHERE table_schema = DATABASE() AND table_name = ?",
    )
    .bind(table)
    .fetch_one(pool)
    .await?;
    Ok(found > 0)
}
