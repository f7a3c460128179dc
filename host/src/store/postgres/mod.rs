//! The outbox on PostgreSQL, shared by many relays: claims lock rows with
//! SKIP LOCKED, acks are one statement per batch, and every statement that
//! changes operator-selected rows skips rows another statement holds.
//!
//! Two schema generations are served (see [`Generation`]): the previous
//! one has no intake table, and its claims move nothing. An older schema
//! is refused with "run `switchyard migrate`".

mod ack;
pub(crate) mod capture;
mod claim;
pub use claim::INTAKE_LOCK;
mod connect;
mod fleet;
mod intake_watch;
pub(crate) use connect::describe_connect_error;
mod listen;
pub(crate) mod replication;
mod sessions;
mod waiting;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use sqlx::PgPool;

use super::backend::Backend;
use super::dialect::{self, DeadLetterChange, Dialect};
use super::types::{
    Claim, DeadLetterFilter, Generation, LeaseId, OutboxEntry, OutboxRow, OutboxStats, PublishedRows,
    RetentionMode, RowId, RowOutcome,
};
use super::{Error, MIGRATOR};

/// How long past its `statement_timeout` a claim or an ack may go
/// unanswered before its session is given up on: this, or the timeout
/// again if shorter (a short lease wants its held outcomes through a new
/// session before it ends).
const ANSWER_MARGIN: Duration = Duration::from_secs(5);
/// How long closing the pool waits for sessions in use; see [`Postgres::close`].
const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// How a pool opens and uses its sessions.
pub(super) struct SessionOptions<'a> {
    pub(super) max_connections: u32,
    /// What `pg_stat_activity` shows, unless the URL names one.
    pub(super) application_name: &'a str,
    /// Each statement's bound on the server; none: the server's own.
    pub(super) statement_timeout: Option<Duration>,
    /// Ping a session idle for [`connect::PING_IF_IDLE_FOR`] before use.
    pub(super) ping_idle: bool,
}

/// A PostgreSQL outbox.
#[derive(Clone, Debug)]
pub(super) struct Postgres {
    pub(super) pool: PgPool,
    /// The schema's generation, once known: [`UNKNOWN`], [`PREVIOUS`] or [`CURRENT`].
    generation: Arc<AtomicU8>,
    /// Whether every session has the planner settings the claim needs
    /// (made by [`Postgres::connect`]), so that a claim is one statement;
    /// otherwise each claim sets them in a transaction of its own.
    planner_settings: bool,
    /// Sessions the claims and acks keep out of the pool between uses.
    sessions: Arc<sessions::Sessions>,
    /// Whether a claim has to move intake rows, from what LISTEN heard.
    intake: Arc<intake_watch::IntakeWatch>,
    /// Stops the pool's password renewal when the last clone goes.
    _renewal: Option<Arc<tokio_util::sync::DropGuard>>,
}

impl Postgres {
    /// Wraps a pool made elsewhere.
    pub(super) fn new(pool: PgPool) -> Postgres {
        Postgres {
            sessions: Arc::new(sessions::Sessions::new(pool.clone(), 0, None)),
            pool,
            generation: Arc::new(AtomicU8::new(UNKNOWN)),
            intake: Arc::default(),
            planner_settings: false,
            _renewal: None,
        }
    }

    /// Claims and acks keep up to `sessions` sessions out of the pool
    /// between uses; see [`sessions`].
    pub(super) fn keeping_sessions(self, sessions: usize) -> Postgres {
        Postgres {
            sessions: Arc::new(sessions::Sessions::new(
                self.pool.clone(),
                sessions,
                self.sessions.answer_within,
            )),
            ..self
        }
    }

    /// Connects a pool whose sessions carry the relay's settings; see
    /// [`connect::pool`].
    pub(super) async fn connect(
        endpoint: &crate::endpoint::Endpoint,
        sessions: &SessionOptions<'_>,
    ) -> Result<Postgres, Error> {
        let (pool, renewal) = connect::pool(endpoint, sessions).await?;
        let statement_timeout = sessions.statement_timeout;
        // The server cancels a statement at its timeout; a session that has
        // not answered some time after that is not going to.
        let answer_within = statement_timeout.map(|timeout| timeout + timeout.min(ANSWER_MARGIN));
        Ok(Postgres {
            planner_settings: true,
            sessions: Arc::new(sessions::Sessions::new(pool.clone(), 0, answer_within)),
            _renewal: renewal.map(Arc::new),
            ..Postgres::new(pool)
        })
    }

    /// Runs a relay's background statement (a sweep, a statistics refresh,
    /// a readiness or metrics query) on a session from the pool, bounded as
    /// claims and acks are: one sent just before its session stopped
    /// answering would otherwise hold its loop, and a place in the pool,
    /// until the kernel gives up on it. A session whose statement did not
    /// finish (no answer in time, or the caller's own timeout dropped this)
    /// is closed, not pooled: sqlx's ping on its way back would wait for it.
    pub(in crate::store) async fn bounded<T>(
        &self,
        what: &'static str,
        work: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut session = sessions::Unfinished::new(self.pool.acquire().await?);
        let done = sessions::answered(&mut session.session, self.sessions.answer_within, what, work).await;
        session.finished();
        done
    }

    /// Closes the pool, the sessions kept out of it included, waiting at
    /// most [`CLOSE_WITHIN`] for sessions in use: sqlx pings a session on
    /// its way back to the pool, without a bound, and one whose server
    /// stopped answering would hold the close, and the relay's stop, for
    /// ever. Such a session is left to itself (the pool is closed: nothing
    /// takes it again).
    pub(super) async fn close(&self) {
        if tokio::time::timeout(CLOSE_WITHIN, self.sessions.close())
            .await
            .is_err()
        {
            tracing::warn!(
                waited_ms = CLOSE_WITHIN.as_millis() as u64,
                "A database session did not come back to be closed (the server does not answer); left behind."
            );
        }
    }

    /// Records whether a claim saw the intake: another process may migrate
    /// while this one runs, and each claim tells the next (asking in a
    /// round trip of its own would cost one per claim).
    fn saw_intake(&self, there: bool) {
        let generation = if there { CURRENT } else { PREVIOUS };
        self.generation.store(generation, Ordering::Relaxed);
    }

    /// The dialect for this outbox's generation.
    pub(in crate::store) async fn dialect(&self) -> Result<Dialect, Error> {
        Ok(Dialect::Postgres(self.generation().await?))
    }

    /// The schema's generation. Asked once (`migrate` and a claim that
    /// meets another make it ask again); a schema older than the previous
    /// generation is [`Error::SchemaTooOld`], asked again each time.
    async fn generation(&self) -> Result<Generation, Error> {
        match self.generation.load(Ordering::Relaxed) {
            PREVIOUS => return Ok(Generation::Previous),
            CURRENT => return Ok(Generation::Current),
            _ => {}
        }
        // `switchyard_ack()` is the last thing the previous generation
        // adds that its statements need (20261203000000 only replaces it).
        let (ack, intake): (bool, bool) = self
            .bounded("schema lookup", async |session| {
                Ok(sqlx::query_as(
                    "SELECT to_regproc('switchyard_ack') IS NOT NULL,
                            to_regclass('switchyard_intake') IS NOT NULL",
                )
                .fetch_one(session)
                .await?)
            })
            .await?;
        if !ack {
            return Err(Error::SchemaTooOld {
                missing: "20261202000000_ack_in_one_call",
            });
        }
        self.saw_intake(intake);
        Ok(if intake {
            Generation::Current
        } else {
            Generation::Previous
        })
    }
}

/// [`Postgres::generation`]'s cache.
const UNKNOWN: u8 = 0;
const PREVIOUS: u8 = 1;
const CURRENT: u8 = 2;

/// SQLSTATE of a relation that does not exist.
const UNDEFINED_TABLE: &str = "42P01";

/// Claims in a row that found another moving intake rows and took nothing,
/// before the worker waits (see `claim::Claimed::mover_busy`).
const MOVER_BUSY_TRIES: u32 = 3;

impl Backend for Postgres {
    async fn migrate(&self) -> Result<(), Error> {
        MIGRATOR.run(&self.pool).await?;
        self.generation.store(UNKNOWN, Ordering::Relaxed);
        Ok(())
    }

    async fn applied_migrations(&self) -> Result<Vec<i64>, Error> {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
            .fetch_one(&self.pool)
            .await?;
        if !exists {
            return Ok(Vec::new());
        }
        Ok(
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
                .fetch_all(&self.pool)
                .await?,
        )
    }

    async fn generation(&self) -> Result<Generation, Error> {
        Postgres::generation(self).await
    }

    async fn schema_exists(&self) -> Result<bool, Error> {
        Ok(
            sqlx::query_scalar("SELECT to_regclass('switchyard_outbox') IS NOT NULL")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    async fn count_backlog(&self) -> Result<i64, Error> {
        // Each queue has a partial index of its own; counted one by one.
        let sql = "SELECT (SELECT count(*) FROM switchyard_outbox WHERE queue = 1)
                        + (SELECT count(*) FROM switchyard_outbox WHERE queue = 2)
                        + (SELECT count(*) FROM switchyard_outbox WHERE queue = 3)";
        self.bounded("backlog count", async |session| {
            Ok(sqlx::query_scalar(sql).fetch_one(session).await?)
        })
        .await
    }

    async fn oldest_pending_age(&self) -> Result<Option<f64>, Error> {
        // The first entry of `switchyard_outbox_waiting_idx` that is not delayed.
        let sql = "SELECT EXTRACT(EPOCH FROM now() - created_at)::float8
               FROM switchyard_outbox WHERE published_at IS NULL AND queue IN (1, 2, 3)
                AND (not_before IS NULL OR not_before <= now())
                -- PostgreSQL before 17 cannot subtract an infinite time.
                AND isfinite(created_at)
              ORDER BY id LIMIT 1";
        // A row not yet moved from the intake waits too (all of them, when
        // no relay runs). GREATEST passes over a side that has none.
        let sql = if self.generation().await? == Generation::Previous {
            format!("SELECT ({sql})")
        } else {
            format!(
                "SELECT GREATEST(({sql}), (
                     SELECT EXTRACT(EPOCH FROM now() - created_at)::float8
                       FROM switchyard_intake
                      WHERE (not_before IS NULL OR not_before <= now()) AND isfinite(created_at)
                      ORDER BY id LIMIT 1))"
            )
        };
        self.bounded("oldest waiting row", async |session| {
            Ok(sqlx::query_scalar(&sql).fetch_one(session).await?)
        })
        .await
    }

    async fn refresh_statistics(&self) -> Result<(), Error> {
        self.bounded("statistics refresh", async |session| {
            sqlx::query("ANALYZE switchyard_outbox").execute(session).await?;
            Ok(())
        })
        .await
    }

    async fn ping(&self) -> Result<(), Error> {
        self.bounded("ping", async |session| {
            sqlx::query("SELECT 1").execute(session).await?;
            Ok(())
        })
        .await
    }

    async fn claim(
        &self,
        dead_letter_blocks: bool,
        owner: &str,
        limit: u32,
        lease: Duration,
        max_payload_bytes: usize,
    ) -> Result<Claim, Error> {
        let generation = self.generation().await?;
        // Without the move, a claim is the previous generation's statement.
        let plan = if generation == Generation::Current && !self.intake.claim_moves() {
            claim::Plan::of(Generation::Previous, dead_letter_blocks)
        } else {
            claim::Plan::of(generation, dead_letter_blocks)
        };
        let request = claim::Request {
            planner_settings: self.planner_settings,
            owner,
            limit,
            lease,
            max_payload_bytes,
        };
        let mut session = self.sessions.take(None).await?;
        let within = self.sessions.answer_within;
        let claimed = sessions::answered(&mut session, within, "claim", async |session| {
            // Another claim was moving intake rows: once it commits, this
            // one may find rows it left, before waiting for a wake-up. The
            // mover of a row or two commits within moments: look again at
            // once; a mover of a full batch takes milliseconds: wait for it.
            let mut tries = 0;
            loop {
                tries += 1;
                let claimed = claim::claim(session, plan, &request).await?;
                if !claimed.mover_busy || !claimed.claim.rows.is_empty() || tries == MOVER_BUSY_TRIES {
                    break Ok(claimed);
                }
                if tries > 1 && !claim::wait_for_mover(session).await? {
                    // Held past the wait: leave the rows to the holder
                    // and the worker's next look.
                    break Ok(claimed);
                }
            }
        })
        .await
        .inspect_err(|error| {
            // The intake dropped under a claim that moves: look again.
            if let Error::Database(sqlx::Error::Database(refused)) = error
                && refused.code().as_deref() == Some(UNDEFINED_TABLE)
            {
                self.generation.store(UNKNOWN, Ordering::Relaxed);
            }
        })?;
        if claimed.moved || claimed.mover_busy {
            self.intake.moved();
        }
        let claim = claimed.claim;
        if claim.rows.is_empty() {
            self.sessions.put_back(session);
        } else {
            self.sessions.keep_for(claim.lease, session, claim.deadline);
        }
        // `migrate` run by another process while this one claims: the
        // next claim moves intake rows.
        self.saw_intake(claimed.intake_there);
        Ok(claim)
    }

    async fn ack(
        &self,
        lease: LeaseId,
        outcomes: &[RowOutcome],
        published_rows: PublishedRows,
    ) -> Result<Vec<RowId>, Error> {
        self.generation().await?;
        let outcomes = ack::Outcomes::of(outcomes);
        let mut session = self.sessions.take(Some(lease)).await?;
        let within = self.sessions.answer_within;
        let acked = sessions::answered(&mut session, within, "ack", async |session| {
            ack::ack_in_one_call(session, published_rows, lease, &outcomes).await
        })
        .await?;
        self.sessions.put_back(session);
        Ok(acked)
    }

    async fn unpark_stranded(&self, dead_letter_blocks: bool, limit: u32) -> Result<u64, Error> {
        self.bounded("unpark", async |session| {
            ack::unpark_stranded(session, dead_letter_blocks, limit).await
        })
        .await
    }

    async fn park_followers(&self, _limit: u32) -> Result<u64, Error> {
        // Claims take the rows behind a waiting one, held by its targets.
        Ok(0)
    }

    async fn wake_waiting(&self, target: Option<&str>, limit: u32) -> Result<u64, Error> {
        self.bounded("wake of waiting rows", async |session| {
            waiting::wake(session, target, limit).await
        })
        .await
    }

    async fn waiting_by_target(&self) -> Result<BTreeMap<String, i64>, Error> {
        self.bounded("count of waiting rows", async |session| {
            waiting::by_target(session).await
        })
        .await
    }

    async fn peek_pending(&self, limit: u32) -> Result<Vec<OutboxRow>, Error> {
        claim::peek_pending(&self.pool, limit).await
    }

    async fn release_owner(&self, owner: &str) -> Result<u64, Error> {
        // Through the due index, not a scan of every published row.
        let sql = format!("{} AND queue = 1", dialect::RELEASE_OWNER);
        Ok(sqlx::query(&sql)
            .bind(owner)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    dialect_queries!(|postgres| postgres.dialect().await?);
    returning_replay!(|postgres| postgres.dialect().await?);

    async fn purge_dead_letters(&self, filter: &DeadLetterFilter, batch: u32) -> Result<u64, Error> {
        let dialect = self.dialect().await?;
        let purged = dialect::dead_letter_change_query(dialect, DeadLetterChange::Purge, filter, 0, batch)
            .build()
            .execute(&self.pool)
            .await?
            .rows_affected();
        // In `hold` mode rows may be parked behind the purged ones.
        if purged > 0 {
            let mut session = self.pool.acquire().await?;
            while ack::unpark_stranded(&mut session, true, 1000).await? == 1000 {}
        }
        Ok(purged)
    }

    async fn prune_published(
        &self,
        max_age: Duration,
        mode: RetentionMode,
        batch: u32,
    ) -> Result<u64, Error> {
        // SKIP LOCKED: several relays may run retention at once. There is no
        // index on published_at (every ack would extend it): rows are
        // published in about id order, so the primary key finds the oldest.
        let doomed = "WITH doomed AS (
            SELECT id FROM switchyard_outbox
             WHERE status IN ('published', 'streamed')
               AND published_at < now() - $1 * interval '1 millisecond'
             ORDER BY id LIMIT $2
               FOR UPDATE SKIP LOCKED)";
        let sql = match mode {
            RetentionMode::Delete => {
                format!("{doomed} DELETE FROM switchyard_outbox o USING doomed WHERE o.id = doomed.id")
            }
            RetentionMode::Archive => format!(
                "{doomed}, moved AS (
                    DELETE FROM switchyard_outbox o USING doomed WHERE o.id = doomed.id
                    RETURNING o.*)
                 INSERT INTO switchyard_outbox_archive ({columns})
                 SELECT {columns} FROM moved",
                columns = dialect::ARCHIVE_COLUMNS
            ),
        };
        let done = sqlx::query(&sql)
            .bind(i64::try_from(max_age.as_millis()).unwrap_or(i64::MAX))
            .bind(i64::from(batch))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
