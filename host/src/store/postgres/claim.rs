//! Claiming a batch on PostgreSQL: one statement that picks the heads of
//! aggregates, locks them with SKIP LOCKED, stamps a fresh lease on them and
//! parks the rows it found waiting behind an unfinished event.

use std::time::{Duration, Instant};

use futures::TryStreamExt;
use sqlx::{Connection, PgConnection, PgPool, Row};

use super::connect::set_local_planner;
use crate::store::Error;
use crate::store::dialect::lenient;
use crate::store::types::{Claim, Generation, LeaseId, OutboxRow, RowId};

/// The columns every row query returns, in the order [`row_from_record`] reads.
const ROW_COLUMNS: &str = "o.id, o.event_id, o.aggregate_type, o.aggregate_id, o.event_type,
          o.payload::text AS payload_json, o.payload_bytes, o.headers::text AS headers_json,
          o.tenant, CASE WHEN isfinite(o.created_at)
                         THEN (extract(epoch FROM o.created_at) * 1000)::bigint END AS created_at_ms,
          o.attempts, o.deliveries::text AS deliveries_json";

/// Reads a row selected with [`ROW_COLUMNS`] first. By position: a lookup by
/// name hashes the column name, per column and row, on the claim path.
fn row_from_record(record: &sqlx::postgres::PgRow) -> Result<OutboxRow, sqlx::Error> {
    let mut problem = None;
    // Written only by the relay; unreadable means "nothing acked yet".
    let deliveries_json: String = lenient(record, 11, "deliveries", &mut None);
    let created_at_ms: Option<i64> = lenient(record, 9, "created_at", &mut problem);
    if created_at_ms.is_none() {
        // Due at once, and its age cannot be computed: not an event time.
        problem
            .get_or_insert_with(|| "created_at is -infinity or infinity; it must be a point in time".into());
    }
    let mut row = OutboxRow {
        malformed: None,
        held_by: Vec::new(),
        id: RowId(record.try_get(0)?),
        // The column is a uuid: PostgreSQL refuses anything else at insert.
        event_id: lenient(record, 1, "event_id", &mut problem),
        aggregate_type: lenient(record, 2, "aggregate_type", &mut problem),
        aggregate_id: lenient(record, 3, "aggregate_id", &mut problem),
        event_type: lenient(record, 4, "event_type", &mut problem),
        payload_json: lenient(record, 5, "payload", &mut problem),
        payload_bytes: lenient(record, 6, "payload_bytes", &mut problem),
        headers_json: lenient(record, 7, "headers", &mut problem),
        tenant: lenient(record, 8, "tenant", &mut problem),
        created_at_ms: created_at_ms.unwrap_or_default(),
        attempts: lenient(record, 10, "attempts", &mut problem),
        deliveries: serde_json::from_str(&deliveries_json).unwrap_or_default(),
    };
    row.malformed = problem;
    Ok(row)
}

/// What taking a row's lease sets, in both claim statements: `$2` owner,
/// `$3` lease id, `$4` lease in ms. The lease id fences the ack.
const TAKE_LEASE: &str = "status = 'in_flight',
           lease_owner = $2,
           lease_id = $3,
           lease_expires_at = now() + $4 * interval '1 millisecond',
           attempts = o.attempts + 1";

/// SQLSTATE of a statement cancelled by `statement_timeout`.
const QUERY_CANCELED: &str = "57014";

/// When a queued row is due, as `switchyard_outbox_due_since_insert_idx` has it.
const DUE: &str = "GREATEST(o.next_attempt_at, o.not_before)";

/// What a blocker that waits for paused targets lets through: its
/// `waiting_on` while it is pending.
const BLOCKER_WAITING_ON: &str = "CASE WHEN e.status = 'pending' THEN e.waiting_on END";

/// A claim statement, assembled once per generation and dead-letter
/// policy.
#[derive(Clone, Copy)]
pub(super) struct Plan(&'static str);

/// The plans, by [generation][dead letters block]: without blocking, later
/// events of an aggregate pass a dead-lettered one; blocking keeps them
/// waiting behind it.
static PLANS: std::sync::LazyLock<[[String; 2]; 2]> =
    std::sync::LazyLock::new(|| [Generation::Previous, Generation::Current].map(claim_statements));

impl Plan {
    /// The claim statement for an outbox of `generation`.
    pub(super) fn of(generation: Generation, dead_letter_blocks: bool) -> Plan {
        let by_generation = match generation {
            Generation::Previous => &PLANS[0],
            Generation::Current => &PLANS[1],
        };
        Plan(&by_generation[usize::from(dead_letter_blocks)])
    }
}

/// The previous generation has no intake: its claims move nothing, and
/// say whether the intake has appeared since.
fn claim_statements(generation: Generation) -> [String; 2] {
    let (moves, moved_rows, moved_figures) = match generation {
        Generation::Current => (MOVE_SQL, MOVED_ROWS, MOVED_FIGURES),
        Generation::Previous => ("", "", NOTHING_MOVED),
    };
    let base = CLAIM_SQL
        .replace("__MOVE__", moves)
        .replace("__OR_MOVED__", moved_rows)
        .replace("__MOVED_FIGURES__", moved_figures)
        .replace("__INTAKE_LOCK__", &INTAKE_LOCK.to_string())
        .replace("__WAITING_ON__", BLOCKER_WAITING_ON)
        .replace("__DUE__", DUE)
        .replace("__TAKE_LEASE__", TAKE_LEASE)
        .replace("__ROW_COLUMNS__", ROW_COLUMNS)
        .replace("__PARK_LIMIT__", &PARK_LIMIT.to_string());
    [
        base.replace("__DEAD_FILTER__", "AND e.queue <> 4")
            .replace("__HELD__", HELD_CANDIDATES)
            .replace("__OR_HELD__", "UNION ALL SELECT * FROM held_rows"),
        base.replace("__DEAD_FILTER__", "")
            .replace("__HELD__", "")
            .replace("__OR_HELD__", ""),
    ]
}

/// Rows one claim parks at most. Parking writes each row's index entries
/// anew; a backlog of blocked rows is parked over several claims, each kept
/// short, instead of in one long one.
const PARK_LIMIT: u32 = 50;

/// When dead letters do not block, rows parked behind one (while they did)
/// are candidates too.
const HELD_CANDIDATES: &str = "held_rows AS MATERIALIZED (
    SELECT o.id, o.aggregate_type, o.aggregate_id
      FROM switchyard_outbox o
     WHERE o.queue = 3
     LIMIT $1
       FOR UPDATE SKIP LOCKED
), ";

// `$1` limit, `$2` owner, `$3` lease id, `$4` lease in ms.
//
// Every step is an index probe per row - a LATERAL subquery, or `= ANY` of
// an array - in a shape the planner cannot turn into a join over the
// backlog, whatever its statistics say:
// 1. `cand`: up to `$1` queued rows in the order they became due, from the
//    due index (in-flight rows are passed over unless their lease expired;
//    there are at most batch size times workers of them).
// 2. `probe`: for each, an earlier unfinished row of its aggregate: the
//    previous candidate of the same aggregate if there is one (locked here
//    already), else the nearest such row (a LATERAL ... LIMIT 1 on the
//    unfinished index; one probe per aggregate, not per candidate).
//    A nearest row that waits for paused targets (`waiting_on`, pending)
//    does not block: the candidate is claimed `held_by` those targets, and
//    its messages to them wait too. Every row that waits so has every
//    earlier unfinished row of its aggregate waiting on a subset of its
//    targets, so the nearest one names them all.
// 3. Candidates with none are heads: leased (`claimed`). The others are
//    parked (`held` behind a dead letter), out of the due index, so no
//    later claim walks them again - but only behind a predecessor locked
//    here (a candidate, or FOR SHARE) and still unfinished (`held`, which
//    lists the rows to park). The ack that finishes that predecessor has
//    to wait for this statement, and the unpark it runs next sees the row
//    parked. A predecessor locked elsewhere (being acked right now) is
//    skipped: its followers stay queued for the next claim to look at.
//    One whose ack committed after this statement began is locked in its
//    new version, which must still pass: one that now waits for a paused
//    target is not a blocker (its ack unparked before this parks), so its
//    follower stays queued and the next claim takes it `held_by`.
const CLAIM_SQL: &str = r#"
WITH due AS MATERIALIZED (
    SELECT o.id, o.aggregate_type, o.aggregate_id
      FROM switchyard_outbox o
     WHERE o.queue = 1
       AND __DUE__ <= now()
       AND (o.status = 'pending' OR o.lease_expires_at < now())
     ORDER BY __DUE__, o.id
     LIMIT $1
       FOR UPDATE SKIP LOCKED
), __HELD__cand AS (
    SELECT * FROM due __OR_HELD__
), ranked AS (
    SELECT c.*, lag(c.id) OVER (PARTITION BY c.aggregate_type, c.aggregate_id ORDER BY c.id) AS previous
      FROM cand c
), probe AS MATERIALIZED (
    SELECT r.id, r.aggregate_type, r.aggregate_id,
           r.previous IS NOT NULL AS own,
           COALESCE(r.previous, b.id) AS blocker,
           b.waiting_on AS held_by
      FROM ranked r
      LEFT JOIN LATERAL (
           SELECT e.id, __WAITING_ON__ AS waiting_on FROM switchyard_outbox e
            WHERE r.previous IS NULL
              AND e.aggregate_type = r.aggregate_type
              AND e.aggregate_id = r.aggregate_id
              AND e.id < r.id
              AND e.published_at IS NULL
              AND e.queue IS NOT NULL
              __DEAD_FILTER__
            ORDER BY e.id DESC
            LIMIT 1) b ON true
), held AS MATERIALIZED (
    SELECT p.id, COALESCE(l.dead, false) AS dead
      FROM probe p
      LEFT JOIN LATERAL (
           SELECT e.queue = 4 AS dead FROM switchyard_outbox e
            WHERE NOT p.own
              AND e.aggregate_type = p.aggregate_type
              AND e.aggregate_id = p.aggregate_id
              AND e.id = p.blocker
              AND e.published_at IS NULL
              AND e.queue IS NOT NULL
              AND __WAITING_ON__ IS NULL
              __DEAD_FILTER__
              FOR SHARE SKIP LOCKED) l ON true
     WHERE p.blocker IS NOT NULL AND p.held_by IS NULL AND (p.own OR l.dead IS NOT NULL)
     LIMIT __PARK_LIMIT__
), parked AS (
    UPDATE switchyard_outbox o
       SET status = CASE WHEN o.id = ANY (ARRAY(SELECT h.id FROM held h WHERE h.dead))
                         THEN 'held' ELSE 'parked' END
     WHERE o.id = ANY (ARRAY(SELECT h.id FROM held h))
    RETURNING o.id
), claimed AS (
    UPDATE switchyard_outbox o
       SET __TAKE_LEASE__
     WHERE o.id = ANY (ARRAY(SELECT p.id FROM probe p WHERE p.blocker IS NULL OR p.held_by IS NOT NULL))
    RETURNING __ROW_COLUMNS__
), held_by AS MATERIALIZED (
    -- Empty unless a target is paused.
    SELECT p.id, p.held_by FROM probe p WHERE p.held_by IS NOT NULL
)__MOVE__
SELECT c.*, h.held_by, (SELECT count(*) FROM parked) AS parked,
       (SELECT count(*) FROM probe p WHERE p.blocker IS NOT NULL AND p.held_by IS NULL) AS blocked,
       extract(epoch FROM clock_timestamp() - statement_timestamp())::float8 AS statement_s__MOVED_FIGURES__
  FROM (SELECT 1) AS one
  LEFT JOIN (SELECT * FROM claimed__OR_MOVED__) c ON true
  LEFT JOIN held_by h ON h.id = c.id
"#;

/// The advisory lock a claim that moves intake rows holds to its commit:
/// one mover at a time, so no claim leases a row of an aggregate while an
/// earlier row of it is on its way from the intake in another transaction.
/// A claim that does not get it moves nothing and claims as before. Public
/// so that whatever else moves intake rows can take its turn too.
pub const INTAKE_LOCK: i64 = 0x5357_494e_5441_4b45;

// Moving committed intake rows into the outbox, oldest first, up to `$1`
// (see migration 20261204000000). A moved row is leased at once when it
// is due, heads its aggregate (no unfinished row of the aggregate in the
// outbox, none earlier among the moved) and there is room left under `$1`
// after the claimed rows; the others enter the outbox pending, for the
// next claim. A row whose `event_id` is already in the outbox (or earlier
// in the same move) would fail the whole statement on the unique index:
// it is dead-lettered under a fresh id, the writer's id in its reason.
// Both tests are LATERAL ... LIMIT 1 probes: as NOT EXISTS the planner
// may make the second one pass over every unfinished row (14,500 rows
// read for one claim, found with auto_explain).
//
// The movers' lock is taken inside the statement, after its snapshot: a
// mover that committed in between moved rows this statement cannot see in
// the outbox, so the head test above would pass the next row of their
// aggregate. Such a claim finds rows it saw in the intake already gone
// (`wanted` against `taken`), and then leases none of what it moves: they
// enter the outbox pending, and the next claim's fresh snapshot judges
// them. Writers commit an aggregate's events in order, so a row this
// snapshot sees has its predecessors either in the outbox as it sees it
// or still in the intake, wanted before it.
//
// `guard` marks the transaction so the outbox's notification passes over
// this insert (otherwise every claim would wake every relay). It must run
// even when the intake is empty: the DELETE reads it in a condition of
// its own (a one-time filter, evaluated before the intake is scanned), not
// in a join that an empty intake would end before reaching it.
const MOVE_SQL: &str = r#", mover AS MATERIALIZED (
    SELECT set_config('switchyard.moving', 'on', true) AS guard,
           pg_try_advisory_xact_lock(__INTAKE_LOCK__) AS moves
), wanted AS MATERIALIZED (
    SELECT x.id FROM switchyard_intake x
     WHERE (SELECT m.moves AND m.guard = 'on' FROM mover m)
     ORDER BY x.id LIMIT $1
), taken AS (
    DELETE FROM switchyard_intake i
     WHERE i.id = ANY (ARRAY(SELECT w.id FROM wanted w))
    RETURNING i.*
), move_plan AS MATERIALIZED (
    SELECT t.id,
           row_number() OVER (PARTITION BY t.event_id ORDER BY t.id) > 1
           OR COALESCE(d.taken, false) AS duplicate,
           (t.not_before IS NULL OR t.not_before <= now())
           AND lag(t.id) OVER (PARTITION BY t.aggregate_type, t.aggregate_id ORDER BY t.id) IS NULL
           AND b.id IS NULL
           AND (SELECT count(*) FROM taken) = (SELECT count(*) FROM wanted) AS head
      FROM taken t
      LEFT JOIN LATERAL (
           SELECT true AS taken FROM switchyard_outbox e WHERE e.event_id = t.event_id LIMIT 1) d ON true
      LEFT JOIN LATERAL (
           SELECT e.id FROM switchyard_outbox e
            WHERE e.aggregate_type = t.aggregate_type
              AND e.aggregate_id = t.aggregate_id
              AND e.published_at IS NULL
              AND e.queue IS NOT NULL
              __DEAD_FILTER__
            LIMIT 1) b ON true
), leasing AS MATERIALIZED (
    SELECT p.id, p.duplicate,
           p.head AND NOT p.duplicate
           AND row_number() OVER (PARTITION BY p.head AND NOT p.duplicate ORDER BY p.id)
               <= $1 - (SELECT count(*) FROM probe q WHERE q.blocker IS NULL OR q.held_by IS NOT NULL)
           AS lease
      FROM move_plan p
), moved AS (
    INSERT INTO switchyard_outbox AS o
           (event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers,
            tenant, created_at, not_before, status, lease_owner, lease_id, lease_expires_at,
            attempts, last_error)
    SELECT CASE WHEN l.duplicate THEN gen_random_uuid() ELSE t.event_id END,
           t.aggregate_type, t.aggregate_id, t.event_type, t.payload, t.payload_bytes, t.headers,
           t.tenant, t.created_at, t.not_before,
           CASE WHEN l.duplicate THEN 'dead' WHEN l.lease THEN 'in_flight' ELSE 'pending' END,
           CASE WHEN l.lease THEN $2 END,
           CASE WHEN l.lease THEN $3 END,
           CASE WHEN l.lease THEN now() + $4 * interval '1 millisecond' END,
           CASE WHEN l.lease THEN 1 ELSE 0 END,
           CASE WHEN l.duplicate THEN format(
               'event_id %s is already in the outbox: moved from switchyard_intake (row %s) under a new event_id',
               t.event_id, t.id) END
      FROM taken t JOIN leasing l ON l.id = t.id
     ORDER BY t.id
    RETURNING __ROW_COLUMNS__, o.status = 'in_flight' AS leased
)"#;

/// The moved rows that were leased, in the claimed rows' columns.
const MOVED_ROWS: &str = "
    UNION ALL
    SELECT m.id, m.event_id, m.aggregate_type, m.aggregate_id, m.event_type, m.payload_json,
           m.payload_bytes, m.headers_json, m.tenant, m.created_at_ms, m.attempts, m.deliveries_json
      FROM moved m WHERE m.leased";

/// How many rows moved, and were leased; `mover_busy`: another claim held
/// the movers' lock while this one saw rows in the intake. That claim's
/// statement may have begun before they were committed, and the commit's
/// wake-up was this claim: look again, or they wait for the next poll.
const MOVED_FIGURES: &str = ",
       (SELECT count(*) FROM moved) AS moved,
       (SELECT count(*) FROM moved m WHERE m.leased) AS moved_leased,
       (SELECT NOT m.moves AND EXISTS (SELECT 1 FROM switchyard_intake) FROM mover m) AS mover_busy,
       true AS intake_there";
/// A claim without the move says whether the intake has appeared since.
const NOTHING_MOVED: &str = ", 0::bigint AS moved, 0::bigint AS moved_leased, false AS mover_busy,
       to_regclass('switchyard_intake') IS NOT NULL AS intake_there";

/// Opens a claim transaction that carries the claim's settings, in the one
/// round trip of its BEGIN (a claim on the relay's own sessions needs none;
/// see [`claim`]). The statement timeout bounds a claim to half the lease;
/// the planner settings leave the statement one way to run - index probes
/// in nested loops - so statistics taken while the outbox was drained
/// cannot send it into a scan of the backlog.
fn claim_begin(lease_ms: i64) -> String {
    let timeout = (lease_ms / 2).max(1);
    let planner = set_local_planner("= off");
    format!("BEGIN; SET LOCAL statement_timeout = {timeout};{planner}")
}

/// Reads up to `limit` unfinished rows without claiming or changing
/// anything, in a read-only transaction (for dry runs): the outbox's in id
/// order, then the intake's in the order the claims will move them.
pub(super) async fn peek_pending(pool: &PgPool, limit: u32) -> Result<Vec<OutboxRow>, Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION READ ONLY").execute(&mut *tx).await?;
    let intake: bool = sqlx::query_scalar("SELECT to_regclass('switchyard_intake') IS NOT NULL")
        .fetch_one(&mut *tx)
        .await?;
    let outbox = format!(
        "SELECT {ROW_COLUMNS}, 0 AS place FROM switchyard_outbox o
          WHERE o.status IN ('pending', 'parked', 'held', 'in_flight') ORDER BY o.id LIMIT $1"
    );
    let sql = if intake {
        // Not moved yet: no attempt, no delivery.
        let columns = ROW_COLUMNS
            .replace("o.attempts", "0 AS attempts")
            .replace("o.deliveries::text", "'{}'::text");
        format!(
            "SELECT * FROM (({outbox})
                UNION ALL
                (SELECT {columns}, 1 AS place FROM switchyard_intake o ORDER BY o.id LIMIT $1)) r
              ORDER BY r.place, r.id LIMIT $1"
        )
    } else {
        outbox
    };
    let records = sqlx::query(&sql)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
    tx.rollback().await?;
    Ok(records.iter().map(row_from_record).collect::<Result<_, _>>()?)
}

/// Waits until no claim holds the movers' lock (taken and let go in one
/// statement): the claim after it sees what that mover moved, and moves
/// what it left. A claim that spun instead would run again and again while
/// a large move commits. Returns whether the lock came free within
/// [`MOVER_WAIT`]: a lock held longer (a mover stuck, a session holding it
/// by hand) must not hold up claims of rows already in the outbox.
pub(super) async fn wait_for_mover(session: &mut PgConnection) -> Result<bool, Error> {
    let waited = sqlx::query("SELECT set_config('lock_timeout', $2, true), pg_advisory_xact_lock($1)")
        .bind(INTAKE_LOCK)
        .bind(format!("{}ms", MOVER_WAIT.as_millis()))
        .execute(session)
        .await;
    match waited {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(LOCK_NOT_AVAILABLE) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// How long a claim waits for another claim's move (one of 500 rows takes
/// about 15 ms).
const MOVER_WAIT: Duration = Duration::from_millis(100);

/// SQLSTATE of a lock wait cut by `lock_timeout`.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// What a claim asks for.
pub(super) struct Request<'a> {
    /// Whether the session carries the planner settings and the statement
    /// timeout (the relay's sessions do): the claim is then its one
    /// statement, committed on its own; otherwise it runs in a transaction
    /// that sets them.
    pub(super) planner_settings: bool,
    /// Who takes the leases.
    pub(super) owner: &'a str,
    /// Rows at most.
    pub(super) limit: u32,
    /// How long the leases last.
    pub(super) lease: Duration,
    /// A payload over this is let go as it is read.
    pub(super) max_payload_bytes: usize,
}

/// A claim, with what the statement saw beside it.
pub(super) struct Claimed {
    pub(super) claim: Claim,
    /// Another claim held the movers' lock while this one saw intake rows.
    pub(super) mover_busy: bool,
    /// Whether `switchyard_intake` exists.
    pub(super) intake_there: bool,
    /// Whether it moved intake rows.
    pub(super) moved: bool,
}

/// The statement-wide figures every row of a claim carries.
#[derive(Default)]
struct Figures {
    parked: usize,
    blocked: usize,
    statement: Option<Duration>,
    moved: i64,
    moved_leased: i64,
    mover_busy: bool,
    intake_there: bool,
}

impl Figures {
    fn read(record: &sqlx::postgres::PgRow) -> Result<Figures, sqlx::Error> {
        let count = |name: &str| {
            record
                .try_get::<i64, _>(name)
                .map(|n| usize::try_from(n).unwrap_or(0))
        };
        let seconds: f64 = record.try_get("statement_s")?;
        Ok(Figures {
            parked: count("parked")?,
            blocked: count("blocked")?,
            statement: Some(Duration::try_from_secs_f64(seconds).unwrap_or_default()),
            moved: record.try_get("moved")?,
            moved_leased: record.try_get("moved_leased")?,
            mover_busy: record.try_get("mover_busy")?,
            intake_there: record.try_get("intake_there")?,
        })
    }

    /// Whether rows may be claimable right after this claim: rows behind a
    /// predecessor that were neither taken nor parked (it was being acked),
    /// rows moved from the intake and not leased (the next claim parks or
    /// takes them; the move did not wake anyone), a full move (the intake
    /// may hold more) or intake rows another mover may not have seen.
    fn look_again(&self, limit: u32) -> bool {
        self.blocked > self.parked
            || self.moved > self.moved_leased
            || self.moved >= i64::from(limit)
            || self.mover_busy
    }
}

/// Claims up to `request.limit` rows with `plan`. Rows are read one at a
/// time as they arrive, and a payload over the limit is let go at once.
pub(super) async fn claim(
    session: &mut PgConnection,
    plan: Plan,
    request: &Request<'_>,
) -> Result<Claimed, Error> {
    let started = Instant::now();
    let lease = LeaseId(uuid::Uuid::new_v4());
    let lease_ms = i64::try_from(request.lease.as_millis()).unwrap_or(i64::MAX);
    let mut tx: Option<sqlx::Transaction<'_, sqlx::Postgres>> = None;
    let executor: &mut PgConnection = if request.planner_settings {
        session
    } else {
        tx.insert(session.begin_with(claim_begin(lease_ms)).await?)
    };
    let (mut rows, figures) = match read(executor, plan, request, lease, lease_ms).await {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(QUERY_CANCELED) => {
            return Err(Error::ClaimTimedOut {
                after: started.elapsed(),
            });
        }
        read => read?,
    };
    if let Some(tx) = tx {
        tx.commit().await?;
    }
    // UPDATE ... RETURNING gives no order guarantee.
    rows.sort_by_key(|row| row.id);
    let claim = Claim {
        lease,
        rows,
        deadline: started + request.lease,
        took: started.elapsed(),
        statement: figures.statement,
        parked: figures.parked,
        look_again: figures.look_again(request.limit),
    };
    Ok(Claimed {
        claim,
        mover_busy: figures.mover_busy,
        intake_there: figures.intake_there,
        moved: figures.moved > 0,
    })
}

/// Runs the claim statement and reads its rows and figures.
async fn read(
    executor: &mut PgConnection,
    plan: Plan,
    request: &Request<'_>,
    lease: LeaseId,
    lease_ms: i64,
) -> Result<(Vec<OutboxRow>, Figures), sqlx::Error> {
    let mut figures = None;
    let mut rows = Vec::with_capacity(usize::try_from(request.limit).unwrap_or(0));
    let mut records = sqlx::query(plan.0)
        .bind(i64::from(request.limit))
        .bind(request.owner)
        .bind(lease.0)
        .bind(lease_ms)
        .fetch(executor);
    while let Some(record) = records.try_next().await? {
        // One row even when it claimed none, each with the same figures.
        if figures.is_none() {
            figures = Some(Figures::read(&record)?);
        }
        if record.try_get::<Option<i64>, _>(0)?.is_none() {
            continue;
        }
        let mut row = row_from_record(&record)?;
        row.held_by = record.try_get::<Option<Vec<String>>, _>(12)?.unwrap_or_default();
        row.refuse_payload_over(request.max_payload_bytes, None);
        rows.push(row);
    }
    Ok((rows, figures.unwrap_or_default()))
}
