//! Replication mode on PostgreSQL: the slot and publication `migrate`
//! creates, what `validate` and startup check, the slot's state for
//! operators, and handing a streamed row over to the claim path.

mod events;
pub(crate) mod pgoutput;
mod source;
mod stream;

use std::collections::HashSet;

use sqlx::PgPool;

pub use source::SourceTable;
pub use stream::{StreamSettings, WalBatch, WalStream};

use crate::store::change_stream::{
    AggregateKey, ChangeSource, ChangeStream, FeedNames, HandoverTable, StreamBatch, StreamError,
    StreamedRow, settle_hand_over,
};
use crate::store::postgres::connect::begin_durable;
use crate::store::types::{LeaseId, RowId};
use crate::store::{Error, PgOutbox, RowOutcome};

/// The column default that makes a written row `streamed`.
const STREAMED_DEFAULT: &str = "'streamed'::text";

/// The prefix of the logical messages that carry events written without
/// a row (`switchyard_emit`).
pub const EMIT_PREFIX: &str = "switchyard.event";

/// The function services call to write an event without a row: a
/// transactional logical message, decoded only once its transaction
/// commits, and costing the writer one WAL record (no heap or index write).
/// The message is the event's fields as a JSON object on one line (`jsonb`
/// text has no line break), then the payload as it is: the relay parses
/// the small part and never the payload.
/// Its checks are the table's `NOT NULL`s, so a bad call fails in the
/// writer's transaction as an insert would. The event takes its id from
/// the table's sequence as a row would, so that rows and messages of one
/// aggregate keep their order should they meet in the table.
/// The message is written by an assignment, not `PERFORM`: PL/pgSQL
/// evaluates an assignment's expression directly, where `PERFORM` starts a
/// query each call (a tenth of the call's CPU, measured).
const EMIT_FUNCTION: &str = r"
DECLARE
    written pg_lsn;
BEGIN
    IF aggregate_type IS NULL OR aggregate_id IS NULL OR event_type IS NULL OR event_id IS NULL THEN
        RAISE EXCEPTION 'switchyard_emit: % must not be NULL',
            CASE WHEN aggregate_type IS NULL THEN 'aggregate_type'
                 WHEN aggregate_id IS NULL THEN 'aggregate_id'
                 WHEN event_type IS NULL THEN 'event_type'
                 ELSE 'event_id' END
            USING ERRCODE = 'not_null_violation';
    END IF;
    written := pg_logical_emit_message(true, 'switchyard.event', jsonb_build_object(
        'id', nextval('switchyard_outbox_id_seq'), 'event_id', event_id, 'aggregate_type', aggregate_type,
        'aggregate_id', aggregate_id, 'event_type', event_type, 'headers', COALESCE(headers, '{}'::jsonb),
        'tenant', tenant, 'created_at', now(),
        'body', CASE WHEN payload IS NOT NULL THEN 'json' WHEN payload_bytes IS NOT NULL THEN 'hex' END)::text
        || E'\n' || COALESCE(payload::text, encode(payload_bytes, 'hex'), ''));
    RETURN event_id;
END
";

/// The emit function's signature, as `to_regprocedure` reads it.
const EMIT_SIGNATURE: &str = "switchyard_emit(text,text,text,jsonb,jsonb,text,uuid,bytea)";

/// The outbox columns an event is made of, in name order: all the
/// publication sends (the relay's own columns would cost the server an
/// output conversion each, and the relay a decode, for nothing).
const OUTBOX_COLUMNS: [&str; 11] = [
    "aggregate_id",
    "aggregate_type",
    "created_at",
    "event_id",
    "event_type",
    "headers",
    "id",
    "not_before",
    "payload",
    "payload_bytes",
    "tenant",
];

/// The publication's row filter: only rows written for the stream (a copy
/// the relay writes into the table for the claim path is not read again).
const ROW_FILTER: &str = "(status = 'streamed'::text)";

/// The statements that put the outbox into replication mode, those still
/// to run: each is idempotent, run on its own (a slot cannot be created in
/// a transaction that wrote anything).
pub(crate) async fn setup_statements(
    pool: &PgPool,
    slot: &str,
    publication: &str,
    source: Option<&SourceTable>,
) -> Result<Vec<String>, Error> {
    let mut statements = Vec::new();
    if status_default(pool).await?.as_deref() != Some(STREAMED_DEFAULT) {
        statements.push(
            "ALTER TABLE switchyard_outbox ALTER COLUMN status SET DEFAULT 'streamed', \
             ALTER COLUMN published_at SET DEFAULT now()"
                .to_string(),
        );
    }
    if notify_enabled(pool).await? == Some(true) {
        // Commits reach the feed through the WAL: a NOTIFY per insert is a
        // cost to every writer (a lock at commit) that nobody listens to.
        statements.push("ALTER TABLE switchyard_outbox DISABLE TRIGGER switchyard_outbox_notify".to_string());
    }
    if intake_open(pool).await? == Some(true) {
        // Replication mode reads the outbox's inserts from the WAL and
        // claims nothing, so nothing would move a row written here.
        statements.push(format!(
            "ALTER TABLE switchyard_intake ADD CONSTRAINT {INTAKE_CLOSED} CHECK (false) NOT VALID"
        ));
    }
    statements.extend(publication_statements(pool, publication, source).await?);
    if let Some(source) = source
        && capture_enabled(pool, source).await?
    {
        // The WAL carries the table's inserts: a copy would be read twice.
        statements.push(format!(
            "ALTER TABLE {} DISABLE TRIGGER switchyard_capture",
            source.display
        ));
    }
    let emit: Option<String> =
        sqlx::query_scalar("SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure($1)")
            .bind(EMIT_SIGNATURE)
            .fetch_optional(pool)
            .await?;
    if emit.as_deref() != Some(EMIT_FUNCTION) {
        statements.push(format!(
            "CREATE OR REPLACE FUNCTION switchyard_emit(\
             \n    aggregate_type text, aggregate_id text, event_type text, payload jsonb,\
             \n    headers jsonb DEFAULT '{{}}', tenant text DEFAULT NULL,\
             \n    event_id uuid DEFAULT gen_random_uuid(), payload_bytes bytea DEFAULT NULL)\
             \nRETURNS uuid LANGUAGE plpgsql VOLATILE AS $switchyard${EMIT_FUNCTION}$switchyard$"
        ));
    }
    if slot_status(pool, slot).await?.is_none() {
        statements.push(format!(
            "SELECT 1 FROM pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ));
    }
    Ok(statements)
}

/// The statements that put an outbox written for replication mode back to
/// claim mode (rows written from then on are claimed). The slot and the
/// publication stay, for an operator to drop once the slot is drained.
pub(crate) async fn claim_mode_statements(pool: &PgPool) -> Result<Vec<String>, Error> {
    let mut statements = Vec::new();
    if status_default(pool).await?.as_deref() == Some(STREAMED_DEFAULT) {
        statements.push(
            "ALTER TABLE switchyard_outbox ALTER COLUMN status SET DEFAULT 'pending', \
             ALTER COLUMN published_at DROP DEFAULT"
                .to_string(),
        );
    }
    if notify_enabled(pool).await? == Some(false) {
        statements.push("ALTER TABLE switchyard_outbox ENABLE TRIGGER switchyard_outbox_notify".to_string());
    }
    if intake_open(pool).await? == Some(false) {
        statements.push(format!(
            "ALTER TABLE switchyard_intake DROP CONSTRAINT {INTAKE_CLOSED}"
        ));
    }
    Ok(statements)
}

/// A replication-mode relay on a database set up for claim mode.
const REPLICATION_ON_CLAIM: &str = "this database is set up for claim mode: switchyard_outbox writes its rows for \
     claiming (status defaults to 'pending'), which a replication-mode relay does not read. Run \
     `switchyard migrate` with this replication-mode config to switch the database (it sets up the slot and \
     the publication), or run the relay in claim mode";

/// A claim-mode relay on a database set up for replication mode.
const CLAIM_ON_REPLICATION: &str = "this database is set up for replication mode: switchyard_outbox writes its \
     rows `streamed`, for a replication slot, and a claim-mode relay never claims them. Run the relay in \
     replication mode (relay.mode = \"replication\" with the [replication] section that set the database up), \
     or switch the database with `switchyard migrate` on this claim-mode config once its replication-mode \
     relays have stopped and drained the slot";

/// What keeps a relay in the given mode from working on this database
/// because it is set up for the other one; `None` when the two agree (or
/// there is no outbox yet, which `migrate` is asked for first).
pub(crate) async fn mode_mismatch(pool: &PgPool, replication: bool) -> Result<Option<&'static str>, Error> {
    let Some(default) = status_default(pool).await? else {
        return Ok(None);
    };
    let streamed = default == STREAMED_DEFAULT;
    Ok(match (replication, streamed) {
        (false, true) => Some(CLAIM_ON_REPLICATION),
        (true, false) => Some(REPLICATION_ON_CLAIM),
        _ => None,
    })
}

/// The constraint that refuses writers' inserts into `switchyard_intake`
/// in replication mode; its name is what such a writer reads.
const INTAKE_CLOSED: &str = "switchyard_intake_is_closed_in_replication_mode";

/// Whether `switchyard_intake` takes rows (`None`: no intake).
async fn intake_open(pool: &PgPool) -> Result<Option<bool>, Error> {
    Ok(sqlx::query_scalar(
        "SELECT NOT EXISTS (SELECT 1 FROM pg_constraint
                             WHERE conrelid = to_regclass('switchyard_intake') AND conname = $1)
          WHERE to_regclass('switchyard_intake') IS NOT NULL",
    )
    .bind(INTAKE_CLOSED)
    .fetch_optional(pool)
    .await?)
}

/// What makes `publication` publish the inserts of the outbox's streamed
/// rows and of the `[source]` table, and nothing else.
async fn publication_statements(
    pool: &PgPool,
    publication: &str,
    source: Option<&SourceTable>,
) -> Result<Vec<String>, Error> {
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
        .bind(publication)
        .fetch_one(pool)
        .await?;
    let quoted = |columns: &[String]| {
        let quoted: Vec<String> = columns
            .iter()
            .map(|c| format!("\"{}\"", c.replace('"', "\"\"")))
            .collect();
        quoted.join(", ")
    };
    let outbox_columns: Vec<String> = OUTBOX_COLUMNS.iter().map(|c| (*c).to_string()).collect();
    let mut want = vec![(
        "public".to_string(),
        "switchyard_outbox".to_string(),
        outbox_columns.clone(),
        Some(ROW_FILTER.to_string()),
    )];
    let mut tables = format!(
        "switchyard_outbox ({}) WHERE {ROW_FILTER}",
        quoted(&outbox_columns)
    );
    if let Some(source) = source {
        let (schema, table) = source.schema_and_table();
        let columns = source.published_columns();
        tables.push_str(&format!(", {} ({})", source.display, quoted(&columns)));
        want.push((schema.to_string(), table.to_string(), columns, None));
    }
    want.sort();
    if !exists {
        return Ok(vec![format!(
            "CREATE PUBLICATION {publication} FOR TABLE {tables} WITH (publish = 'insert')"
        )]);
    }
    type Published = Vec<(String, String, Vec<String>, Option<String>)>;
    let (published, inserts_only): (Published, bool) = (
        sqlx::query_as(
            "SELECT schemaname::text, tablename::text,
                    ARRAY(SELECT a::text FROM unnest(attnames) a ORDER BY a COLLATE \"C\"), rowfilter
               FROM pg_publication_tables WHERE pubname = $1 ORDER BY 1, 2",
        )
        .bind(publication)
        .fetch_all(pool)
        .await?,
        sqlx::query_scalar(
            "SELECT pubinsert AND NOT (pubupdate OR pubdelete OR pubtruncate) FROM pg_publication WHERE pubname = $1",
        )
        .bind(publication)
        .fetch_one(pool)
        .await?,
    );
    let mut statements = Vec::new();
    if published != want {
        statements.push(format!("ALTER PUBLICATION {publication} SET TABLE {tables}"));
    }
    if !inserts_only {
        statements.push(format!(
            "ALTER PUBLICATION {publication} SET (publish = 'insert')"
        ));
    }
    Ok(statements)
}

/// Whether the `[source]` table's capture trigger copies its rows.
async fn capture_enabled(pool: &PgPool, source: &SourceTable) -> Result<bool, Error> {
    Ok(sqlx::query_scalar(
        "SELECT tgenabled <> 'D' FROM pg_trigger
          WHERE tgrelid = to_regclass($1) AND tgname = 'switchyard_capture'",
    )
    .bind(&source.display)
    .fetch_optional(pool)
    .await?
    .unwrap_or(false))
}

/// Whether the insert trigger that wakes claiming relays fires (`None`:
/// no such trigger, or no table yet).
async fn notify_enabled(pool: &PgPool) -> Result<Option<bool>, Error> {
    Ok(sqlx::query_scalar(
        "SELECT tgenabled <> 'D' FROM pg_trigger
          WHERE tgrelid = to_regclass('switchyard_outbox') AND tgname = 'switchyard_outbox_notify'",
    )
    .fetch_optional(pool)
    .await?)
}

/// Runs statements from [`setup_statements`], each on its own.
pub(crate) async fn run(pool: &PgPool, statements: &[String]) -> Result<(), Error> {
    for statement in statements {
        sqlx::query(statement).execute(pool).await?;
    }
    Ok(())
}

async fn status_default(pool: &PgPool) -> Result<Option<String>, Error> {
    Ok(sqlx::query_scalar(
        "SELECT pg_get_expr(d.adbin, d.adrelid)
           FROM pg_attrdef d
           JOIN pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
          WHERE d.adrelid = to_regclass('switchyard_outbox') AND a.attname = 'status'",
    )
    .fetch_optional(pool)
    .await?)
}

/// A replication slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SlotStatus {
    /// Its output plugin.
    pub plugin: String,
    /// The database it decodes.
    pub database: String,
    /// The session reading it, if one does.
    pub active_pid: Option<i32>,
    /// That session's `application_name` (`switchyard <instance id>`).
    pub reader: Option<String>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// WAL kept for it, in bytes.
    pub retained_wal_bytes: Option<i64>,
    /// How far it is confirmed.
    pub confirmed_flush_lsn: Option<String>,
    /// WAL written since that point, in bytes: how far its reader is behind.
    pub confirmed_lag_bytes: Option<i64>,
}

/// The slot's state; `None` when there is no such slot.
pub(crate) async fn slot_status<'e>(
    db: impl sqlx::PgExecutor<'e>,
    slot: &str,
) -> Result<Option<SlotStatus>, Error> {
    type Row = (
        String,
        String,
        Option<i32>,
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<String>,
        Option<i64>,
    );
    let row: Option<Row> = sqlx::query_as(
        "SELECT COALESCE(plugin::text, '') AS plugin, COALESCE(database::text, '') AS database,
                active_pid, (SELECT a.application_name FROM pg_stat_activity a WHERE a.pid = active_pid) AS reader,
                wal_status,
                pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint AS retained_wal_bytes,
                confirmed_flush_lsn::text AS confirmed_flush_lsn,
                pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint AS confirmed_lag_bytes
           FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(db)
    .await?;
    Ok(row.map(
        |(
            plugin,
            database,
            active_pid,
            reader,
            wal_status,
            retained_wal_bytes,
            confirmed_flush_lsn,
            confirmed_lag_bytes,
        )| {
            SlotStatus {
                plugin,
                database,
                active_pid,
                reader,
                wal_status,
                retained_wal_bytes,
                confirmed_flush_lsn,
                confirmed_lag_bytes,
            }
        },
    ))
}

/// Everything that keeps replication mode from working, each naming what
/// to do; empty when it can run.
pub(crate) async fn problems(
    pool: &PgPool,
    slot: &str,
    publication: &str,
    source: Option<&SourceTable>,
) -> Result<Vec<String>, Error> {
    let mut problems = Vec::new();
    let (wal_level, replicates, database): (String, bool, String) = sqlx::query_as(
        "SELECT current_setting('wal_level'),
                (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user),
                current_database()",
    )
    .fetch_one(pool)
    .await?;
    if wal_level != "logical" {
        problems.push(format!(
            "wal_level is {wal_level:?}: replication mode needs wal_level = logical in postgresql.conf (a restart)"
        ));
    }
    if !replicates {
        problems.push("the relay's role may not replicate: ALTER ROLE ... REPLICATION".into());
    }
    let pending = setup_statements(pool, slot, publication, source).await?;
    if pending.iter().any(|s| s.contains("SET DEFAULT 'streamed'")) {
        problems.push(REPLICATION_ON_CLAIM.into());
    }
    if pending.iter().any(|s| s.contains("PUBLICATION")) {
        let tables = match source {
            Some(source) => format!(
                "switchyard_outbox's streamed inserts and {}'s inserts",
                source.display
            ),
            None => "switchyard_outbox's streamed inserts".to_string(),
        };
        problems.push(format!(
            "publication {publication:?} is missing or does not publish {tables} (only): run `switchyard migrate`"
        ));
    }
    if pending.iter().any(|s| s.contains(INTAKE_CLOSED)) {
        problems.push(
            "switchyard_intake still takes writers' rows, which only claim mode moves: run `switchyard migrate` \
             (it closes the intake; write to switchyard_outbox)"
                .into(),
        );
    }
    if intake_open(pool).await?.is_some() {
        let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM switchyard_intake")
            .fetch_one(pool)
            .await?;
        if waiting > 0 {
            problems.push(format!(
                "switchyard_intake holds {waiting} rows written for claim mode, which replication mode does not \
                 read: run a relay in claim mode until the intake is empty"
            ));
        }
    }
    if pending
        .iter()
        .any(|s| s.contains("DISABLE TRIGGER switchyard_capture"))
    {
        problems.push(format!(
            "the capture trigger on {} copies its rows into switchyard_outbox, and replication mode reads \
             the table itself (each event would go out twice): run `switchyard migrate` (it turns the trigger off)",
            source.map_or("", |s| s.display.as_str())
        ));
    }
    match slot_status(pool, slot).await? {
        None => problems.push(format!(
            "replication slot {slot:?} does not exist: run `switchyard migrate`"
        )),
        Some(status) => {
            if status.plugin != "pgoutput" {
                problems.push(format!(
                    "replication slot {slot:?} decodes with {:?}, not pgoutput: drop it and run `switchyard migrate`",
                    status.plugin
                ));
            }
            if status.database != database {
                problems.push(format!(
                    "replication slot {slot:?} belongs to database {:?}, not {database:?}: name another slot",
                    status.database
                ));
            }
            if status.wal_status.as_deref() == Some("lost") {
                problems.push(format!(
                    "replication slot {slot:?} lost the WAL it needed (wal_status = lost): drop it, run \
                     `switchyard migrate`, and relay what it missed in claim mode"
                ));
            }
        }
    }
    Ok(problems)
}

/// What a hand-over made of its rows: which are now the claim path's,
/// and the fresh ids given to events that had none in the table.
#[derive(Debug, Default)]
pub(crate) struct TakenOver {
    /// Per row, in the order given: whether the row is in the table for
    /// the claim path now (taken over by this call, or before it: a replay).
    pub(crate) in_table: Vec<bool>,
    /// Stand-in ids and the ids the table gave those events.
    pub(crate) renamed: Vec<(RowId, RowId)>,
}

/// Hands streamed rows to the claim path, leased under `lease` as if
/// claimed (their first attempt spent), for the ack to record their
/// outcomes. A row no longer in the table (deleted by its writer after the
/// insert, or by retention) is written back from the WAL's values; one no
/// longer `streamed` was handed over before (a replay) and is left alone.
/// An event that never had a row gets one, with a fresh id in stream
/// order (returned beside its stand-in), unless its event id is in the
/// table already (a replay).
///
/// A row is taken by `INSERT … ON CONFLICT (id) DO UPDATE`, never by a
/// plain `UPDATE`: the WAL can hand out a commit before that transaction
/// is visible to other sessions (its commit record is flushed, and read by
/// the WAL sender, before the committing backend leaves the process array;
/// a synchronous standby's wait widens that window to any length). An
/// `UPDATE` does not see such a row and changes nothing; the upsert waits
/// for the writer's transaction to end and then takes the committed row.
///
/// Its commit waits for the WAL flush: the slot is confirmed past these
/// events once it returns, and a server crash that lost a hand-over made
/// without waiting (the relay's sessions commit with `synchronous_commit`
/// off) would lose them.
pub(crate) async fn take_over(
    pool: &PgPool,
    owner: &str,
    lease: LeaseId,
    lease_ms: i64,
    rows: &[&StreamedRow],
) -> Result<TakenOver, Error> {
    let needing = rows.iter().filter(|r| r.id_at_handover).count();
    let mut fresh = fresh_ids(pool, needing).await?.into_iter();
    let mut tx = begin_durable(pool).await?;
    let mut renamed = Vec::with_capacity(needing);
    let mut ids = Vec::with_capacity(rows.len());
    let mut stand_ins = Vec::with_capacity(rows.len());
    let mut event_ids = Vec::with_capacity(rows.len());
    let (mut types, mut aggregates, mut event_types) = (Vec::new(), Vec::new(), Vec::new());
    let (mut payloads, mut bytes, mut headers, mut tenants) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut created, mut not_before) = (Vec::new(), Vec::new());
    for streamed in rows {
        let row = &streamed.row;
        let id = if streamed.id_at_handover {
            fresh.next()
        } else {
            None
        };
        match id {
            Some(id) => {
                renamed.push((row.id, RowId(id)));
                ids.push(id);
            }
            None => ids.push(row.id.0),
        }
        stand_ins.push(streamed.id_at_handover);
        event_ids.push(row.event_id);
        types.push(row.aggregate_type.clone());
        aggregates.push(row.aggregate_id.clone());
        event_types.push(row.event_type.clone());
        payloads.push(row.payload_json.clone());
        bytes.push(streamed.text.payload_bytes.clone());
        headers.push(row.headers_json.clone());
        tenants.push(row.tenant.clone());
        created.push(streamed.text.created_at.clone());
        not_before.push(streamed.text.not_before.clone());
    }
    // `r.fresh`: an event with a fresh id, whose replay shows as its event
    // id in the table. Else the event's own id: its row is taken if it is
    // still `streamed`, written back if it is gone, and left alone if the
    // claim path has it already. An event id the table holds under another
    // id (a row deleted and written again by hand) counts as in the table.
    let in_table: Vec<bool> = sqlx::query_scalar(
        "WITH r AS MATERIALIZED (
            SELECT * FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[],
                                 $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $15::bool[])
                   WITH ORDINALITY
                AS r(id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes,
                     headers, tenant, created_at, not_before, fresh, n)
         ), before AS MATERIALIZED (
            SELECT r.n FROM r
             WHERE EXISTS (SELECT 1 FROM switchyard_outbox o
                            WHERE o.event_id = r.event_id AND (r.fresh OR o.id <> r.id OR o.status <> 'streamed'))
         ), taken AS (
            INSERT INTO switchyard_outbox AS o
                   (id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, headers,
                    tenant, created_at, not_before, status, attempts, lease_owner, lease_id, lease_expires_at,
                    published_at)
            OVERRIDING SYSTEM VALUE
            SELECT DISTINCT ON (r.id)
                   r.id, r.event_id, r.aggregate_type, r.aggregate_id, r.event_type, r.payload::jsonb,
                   r.payload_bytes::bytea, r.headers::jsonb, r.tenant, COALESCE(r.created_at::timestamptz, now()),
                   r.not_before::timestamptz, 'in_flight', 1, $12, $13,
                   now() + $14 * interval '1 millisecond', NULL::timestamptz
              FROM r
             WHERE r.n NOT IN (SELECT n FROM before)
             ORDER BY r.id, r.n
            ON CONFLICT (id) DO UPDATE
               SET status = 'in_flight', published_at = NULL, attempts = o.attempts + 1,
                   lease_owner = EXCLUDED.lease_owner, lease_id = EXCLUDED.lease_id,
                   lease_expires_at = EXCLUDED.lease_expires_at
             WHERE o.status = 'streamed'
            RETURNING o.id
         )
         SELECT r.n IN (SELECT n FROM before) OR r.id IN (SELECT id FROM taken)
           FROM r ORDER BY r.n",
    )
    .bind(&ids)
    .bind(&event_ids)
    .bind(&types)
    .bind(&aggregates)
    .bind(&event_types)
    .bind(&payloads)
    .bind(&bytes)
    .bind(&headers)
    .bind(&tenants)
    .bind(&created)
    .bind(&not_before)
    .bind(owner)
    .bind(lease.0)
    .bind(lease_ms)
    .bind(&stand_ins)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::debug!(
        rows = rows.len(),
        in_table = in_table.iter().filter(|t| **t).count(),
        "Rows taken over by the claim path."
    );
    Ok(TakenOver { in_table, renamed })
}

/// Gives back rows a hand-over under `lease` took but must not keep (an
/// earlier event of their aggregate in the same hand-over was not taken,
/// and the claim path would publish them before it): a row with its own
/// id is `streamed` again, one written with a fresh id is removed. Fenced
/// by the lease, which nothing else holds before the hand-over's ack.
/// Durable as [`take_over`] is: lost once the slot has moved on, the
/// claim path would publish them out of order.
pub(crate) async fn give_back(
    pool: &PgPool,
    lease: LeaseId,
    ids: &[i64],
    fresh: &[i64],
) -> Result<(), Error> {
    let mut tx = begin_durable(pool).await?;
    sqlx::query(
        "WITH streamed AS (
            UPDATE switchyard_outbox
               SET status = 'streamed', published_at = now(), attempts = greatest(attempts - 1, 0),
                   lease_owner = NULL, lease_id = NULL, lease_expires_at = NULL
             WHERE id = ANY($1) AND status = 'in_flight' AND lease_id = $3
         )
         DELETE FROM switchyard_outbox WHERE id = ANY($2) AND status = 'in_flight' AND lease_id = $3",
    )
    .bind(ids)
    .bind(fresh)
    .bind(lease.0)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(())
}

/// `count` ids from the table's sequence, in ascending order.
async fn fresh_ids(pool: &PgPool, count: usize) -> Result<Vec<i64>, Error> {
    if count == 0 {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_scalar(
        "SELECT nextval(pg_get_serial_sequence('switchyard_outbox', 'id')) FROM generate_series(1, $1) ORDER BY 1",
    )
    .bind(i64::try_from(count).unwrap_or(i64::MAX))
    .fetch_all(pool)
    .await?)
}

/// Of these aggregates, those with an unfinished row in the table (a
/// dead letter too when dead letters block): their next events must wait
/// behind it, in the table.
pub(crate) async fn waiting_in_table(
    pool: &PgPool,
    keys: &[(String, String)],
    dead_letters_block: bool,
) -> Result<HashSet<(String, String)>, Error> {
    let (types, ids): (Vec<&str>, Vec<&str>) = keys.iter().map(|(t, i)| (t.as_str(), i.as_str())).unzip();
    let dead = if dead_letters_block {
        ""
    } else {
        "AND o.queue <> 4"
    };
    let rows: Vec<(String, String)> = sqlx::query_as(&format!(
        "SELECT k.t, k.i
           FROM (SELECT DISTINCT t, i FROM unnest($1::text[], $2::text[]) AS k(t, i)) k
          WHERE EXISTS (SELECT 1 FROM switchyard_outbox o
                         WHERE o.aggregate_type = k.t AND o.aggregate_id = k.i
                           AND o.published_at IS NULL AND o.queue IS NOT NULL {dead})"
    ))
    .bind(&types)
    .bind(&ids)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Whether any aggregate waits in the table at all (see [`waiting_in_table`]).
pub(crate) async fn anything_waiting_in_table(
    pool: &PgPool,
    dead_letters_block: bool,
) -> Result<bool, Error> {
    // One EXISTS per queue, each answered by that queue's partial index.
    let last = if dead_letters_block { 4 } else { 3 };
    let probes: Vec<String> = (1..=last)
        .map(|queue| format!("EXISTS (SELECT 1 FROM switchyard_outbox WHERE queue = {queue})"))
        .collect();
    Ok(sqlx::query_scalar(&format!("SELECT {}", probes.join(" OR ")))
        .fetch_one(pool)
        .await?)
}

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
            Some((slot, publication)) => setup_statements(pool, slot, publication, source).await,
            None => claim_mode_statements(pool).await,
        }
    }

    /// Runs what [`OutboxStore::feed_statements`] returned.
    ///
    /// # Errors
    /// The database's; statements before the failing one stay done (each
    /// is idempotent, so running `migrate` again finishes the job).
    pub async fn run_feed_statements(&self, statements: &[String]) -> Result<(), Error> {
        run(&self.backend.pool, statements).await
    }

    /// A database set up for the other mode than the relay's (`replication`
    /// or claim), with what to do; `None` when they agree.
    ///
    /// # Errors
    /// The database's.
    pub async fn mode_mismatch(&self, replication: bool) -> Result<Option<&'static str>, Error> {
        mode_mismatch(&self.backend.pool, replication).await
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
        problems(&self.backend.pool, slot, publication, source).await
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
                slot_status(&mut *session, slot).await
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
        let taken = take_over(&self.backend.pool, owner, lease, lease_ms, rows).await?;
        let pool = &self.backend.pool;
        settle_hand_over(
            &self.store,
            lease,
            rows,
            outcomes,
            taken.in_table,
            taken.renamed,
            async |ids, fresh| give_back(pool, lease, ids, fresh).await,
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
        waiting_in_table(&self.backend.pool, keys, self.store.dead_letter_blocks_aggregate).await
    }

    /// Whether any aggregate waits behind a row in the table.
    ///
    /// # Errors
    /// The database's.
    pub async fn anything_waiting_in_table(&self) -> Result<bool, Error> {
        anything_waiting_in_table(&self.backend.pool, self.store.dead_letter_blocks_aggregate).await
    }
}

impl HandoverTable for PgOutbox {
    async fn waiting_in_table(&self, keys: &[AggregateKey]) -> Result<HashSet<AggregateKey>, Error> {
        PgOutbox::waiting_in_table(self, keys).await
    }

    async fn anything_waiting_in_table(&self) -> Result<bool, Error> {
        PgOutbox::anything_waiting_in_table(self).await
    }

    async fn hand_over(
        &self,
        owner: &str,
        lease_ms: i64,
        rows: &[&StreamedRow],
        outcomes: &[RowOutcome],
    ) -> Result<Vec<bool>, Error> {
        PgOutbox::hand_over(self, owner, lease_ms, rows, outcomes).await
    }

    async fn mode_mismatch(&self, replication: bool) -> Result<Option<&'static str>, Error> {
        PgOutbox::mode_mismatch(self, replication).await
    }

    async fn feed_statements(&self, feed: Option<FeedNames<'_>>) -> Result<Vec<String>, Error> {
        let source = feed.and_then(|feed| feed.source).map(SourceTable::new);
        let names = feed.map(|feed| (feed.slot, feed.publication));
        PgOutbox::feed_statements(self, names, source.as_ref()).await
    }

    async fn run_feed_statements(&self, statements: &[String]) -> Result<(), Error> {
        PgOutbox::run_feed_statements(self, statements).await
    }
}

impl ChangeStream for WalStream {
    type Position = pgwire_replication::Lsn;

    async fn next_batch(&mut self) -> Result<StreamBatch<pgwire_replication::Lsn>, StreamError> {
        WalStream::next_batch(self).await
    }

    fn confirm(&self, position: pgwire_replication::Lsn) {
        WalStream::confirm(self, position);
    }

    async fn close(self) {
        WalStream::close(self).await;
    }
}

/// A PostgreSQL slot as a feed's source.
pub struct WalSource {
    /// How to read the slot.
    pub settings: Box<StreamSettings>,
    /// The outbox it hands over to.
    pub outbox: PgOutbox,
}

impl ChangeSource for WalSource {
    type Stream = WalStream;
    type Table = PgOutbox;

    fn name(&self) -> &str {
        &self.settings.slot
    }

    fn table(&self) -> PgOutbox {
        self.outbox.clone()
    }

    async fn open(&self) -> Result<WalStream, StreamError> {
        WalStream::open(&self.settings).await
    }
}
