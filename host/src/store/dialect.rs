//! What differs between the SQL of the backends, in one place: the clock,
//! time columns, column lists and the dead-letter filter; and the row
//! decoding they share.

use std::collections::BTreeMap;

use sqlx::{Database, Encode, QueryBuilder, Row, Type};

use super::types::{DeadLetterFilter, Delivery, DeliveryKey, Generation, OutboxEntry};

/// Which SQL dialect a statement is written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dialect {
    /// Partial indexes select on the computed `queue` column. From the
    /// current generation on, writers may insert into `switchyard_intake`,
    /// whose rows count as pending until a claim moves them.
    Postgres(Generation),
    Sqlite,
    /// MySQL 8 and MariaDB: sessions at time zone UTC, JSON read as text.
    MySql,
}

/// SQLite's clock in milliseconds since the epoch, as its times are stored
/// (`unixepoch('subsec')` needs SQLite 3.42; services may run older ones).
pub(super) const SQLITE_NOW_MS: &str = "CAST(round((julianday('now') - 2440587.5) * 86400000) AS INTEGER)";

impl Dialect {
    /// The database's current time, as the time columns store it.
    pub(super) fn now(self) -> &'static str {
        match self {
            Dialect::Postgres(_) => "now()",
            Dialect::Sqlite => SQLITE_NOW_MS,
            Dialect::MySql => "NOW(6)",
        }
    }

    /// Which rows are dead letters. On PostgreSQL the condition also names
    /// the partial index's predicate, so that index is used.
    pub(super) fn dead(self) -> &'static str {
        match self {
            Dialect::Postgres(_) => "status = 'dead' AND queue = 4",
            Dialect::Sqlite | Dialect::MySql => "status = 'dead'",
        }
    }

    /// The columns [`entry_from_record`] reads.
    pub(super) fn entry_columns(self) -> &'static str {
        match self {
            Dialect::Postgres(_) => PG_ENTRY_COLUMNS,
            Dialect::Sqlite => SQLITE_ENTRY_COLUMNS,
            Dialect::MySql => MYSQL_ENTRY_COLUMNS,
        }
    }
}

/// Rows pending or in flight (SQLite).
pub(super) const COUNT_BACKLOG: &str =
    "SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')";

/// Every in-flight row of an owner back to pending, its attempt refunded
/// (an in-flight row was claimed at least once, so it never goes below zero).
pub(super) const RELEASE_OWNER: &str = "UPDATE switchyard_outbox
    SET status = 'pending', lease_owner = NULL, lease_id = NULL,
        lease_expires_at = NULL, attempts = attempts - 1
  WHERE status = 'in_flight' AND lease_owner = $1";

/// Dead letters per event type.
pub(super) fn dead_by_type_sql(dialect: Dialect) -> String {
    format!(
        "SELECT event_type, count(*) FROM switchyard_outbox
          WHERE {} GROUP BY event_type ORDER BY event_type",
        dialect.dead()
    )
}

/// The status counts behind `switchyard status`: pending (due), delayed,
/// in flight, retrying.
pub(super) fn status_counts_sql(dialect: Dialect) -> String {
    let delayed = format!("coalesce(not_before > {}, false)", dialect.now());
    // PostgreSQL: queued rows through the due index, and parked rows,
    // waiting behind an earlier event of their aggregate, as pending.
    let (parked, queued) = match dialect {
        Dialect::Postgres(_) => (
            " + (SELECT count(*) FROM switchyard_outbox WHERE queue = 2)
              + (SELECT count(*) FROM switchyard_outbox WHERE queue = 3)",
            "queue = 1",
        ),
        Dialect::Sqlite | Dialect::MySql => ("", "status IN ('pending', 'in_flight')"),
    };
    // Rows in the intake are pending (or delayed) until a claim moves them.
    let (intake_due, intake_delayed) = if dialect == Dialect::Postgres(Generation::Current) {
        (
            " + (SELECT count(*) FROM switchyard_intake WHERE NOT coalesce(not_before > now(), false))",
            " + (SELECT count(*) FROM switchyard_intake WHERE coalesce(not_before > now(), false))",
        )
    } else {
        ("", "")
    };
    format!(
        "SELECT count(CASE WHEN status = 'pending' AND NOT {delayed} THEN 1 END){parked}{intake_due},
                count(CASE WHEN status = 'pending' AND {delayed} THEN 1 END){intake_delayed},
                count(CASE WHEN status = 'in_flight' THEN 1 END),
                count(CASE WHEN status = 'pending' AND attempts > 0 THEN 1 END)
           FROM switchyard_outbox WHERE {queued}"
    )
}

/// Dead letters matching a filter, from id `after` on, oldest first.
pub(super) fn dead_letters_query<'a, DB>(
    dialect: Dialect,
    filter: &DeadLetterFilter,
    after: i64,
    limit: u32,
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    String: Encode<'a, DB> + Type<DB>,
{
    explained_dead_letters_query(dialect, filter, after, limit, false)
}

/// [`dead_letters_query`], as `EXPLAIN` of it when `explain`.
pub(super) fn explained_dead_letters_query<'a, DB>(
    dialect: Dialect,
    filter: &DeadLetterFilter,
    after: i64,
    limit: u32,
    explain: bool,
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    String: Encode<'a, DB> + Type<DB>,
{
    dead_letters_select(
        dialect,
        &format!("{}SELECT {}", explained(explain), dialect.entry_columns()),
        filter,
        after,
        limit,
    )
}

/// The ids of the dead letters [`dead_letters_query`] reads.
pub(super) fn dead_letter_ids_query<'a, DB>(
    dialect: Dialect,
    filter: &DeadLetterFilter,
    after: i64,
    limit: u32,
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    String: Encode<'a, DB> + Type<DB>,
{
    dead_letters_select(dialect, "SELECT id", filter, after, limit)
}

fn dead_letters_select<'a, DB>(
    dialect: Dialect,
    select: &str,
    filter: &DeadLetterFilter,
    after: i64,
    limit: u32,
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    String: Encode<'a, DB> + Type<DB>,
{
    let mut query = QueryBuilder::new(format!(
        "{select} FROM switchyard_outbox WHERE {} AND id > ",
        dialect.dead()
    ));
    query.push_bind(after);
    push_filter(&mut query, dialect, filter);
    query.push(" ORDER BY id LIMIT ").push_bind(i64::from(limit));
    query
}

fn explained(explain: bool) -> &'static str {
    if explain { "EXPLAIN " } else { "" }
}

/// How many dead letters match a filter, counting no further than `bound`
/// (a page refreshed every second must not read 100,000 rows for a figure).
pub(super) fn bounded_dead_count_query<'a, DB>(
    dialect: Dialect,
    filter: &DeadLetterFilter,
    bound: i64,
    explain: bool,
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    String: Encode<'a, DB> + Type<DB>,
{
    // `queue = 4` alone is what `status = 'dead'` computes: without a
    // filter the count reads the dead-letter index and not one row.
    let dead = match dialect {
        Dialect::Postgres(_) => "queue = 4",
        Dialect::Sqlite | Dialect::MySql => dialect.dead(),
    };
    let mut query = QueryBuilder::new(format!(
        "{}SELECT count(*) FROM (SELECT 1 FROM switchyard_outbox WHERE {dead}",
        explained(explain),
    ));
    push_filter(&mut query, dialect, filter);
    query.push(" LIMIT ").push_bind(bound).push(") AS counted");
    query
}

/// Rows waiting to be published, counted no further than `bound` per
/// queue: each count reads its partial index, at most `bound` entries.
pub(super) fn bounded_backlog_query<'a, DB>(
    dialect: Dialect,
    bound: i64,
    explain: bool,
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
{
    let mut query = QueryBuilder::new(format!("{}SELECT 0", explained(explain)));
    let sources: &[&str] = match dialect {
        Dialect::Postgres(Generation::Current) => &[
            "switchyard_outbox WHERE queue = 1",
            "switchyard_outbox WHERE queue = 2",
            "switchyard_outbox WHERE queue = 3",
            "switchyard_intake",
        ],
        Dialect::Postgres(Generation::Previous) => &[
            "switchyard_outbox WHERE queue = 1",
            "switchyard_outbox WHERE queue = 2",
            "switchyard_outbox WHERE queue = 3",
        ],
        Dialect::Sqlite => &["switchyard_outbox WHERE status IN ('pending', 'in_flight')"],
        // The claim index, one status at a time: read in order, not sorted.
        Dialect::MySql => &[
            "switchyard_outbox WHERE status = 'pending'",
            "switchyard_outbox WHERE status = 'in_flight'",
        ],
    };
    for source in sources {
        query
            .push(format!(" + (SELECT count(*) FROM (SELECT 1 FROM {source} LIMIT "))
            .push_bind(bound)
            .push(") AS counted)");
    }
    query
}

/// One row, whole, by its event id (the unique index's column).
pub(super) fn event_query<'a, DB>(dialect: Dialect, event_id: String, explain: bool) -> QueryBuilder<'a, DB>
where
    DB: Database,
    String: Encode<'a, DB> + Type<DB>,
{
    let mut query = QueryBuilder::new(format!(
        "{}SELECT {} FROM switchyard_outbox WHERE event_id = ",
        explained(explain),
        dialect.entry_columns()
    ));
    match dialect {
        Dialect::Postgres(_) => query.push("CAST(").push_bind(event_id).push(" AS uuid)"),
        Dialect::Sqlite | Dialect::MySql => query.push_bind(event_id),
    };
    query
}

/// How many dead letters match a filter.
pub(super) fn count_dead_letters_query<'a, DB>(
    dialect: Dialect,
    filter: &DeadLetterFilter,
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    String: Encode<'a, DB> + Type<DB>,
{
    let mut query = QueryBuilder::new(format!(
        "SELECT count(*) FROM switchyard_outbox WHERE {}",
        dialect.dead()
    ));
    push_filter(&mut query, dialect, filter);
    query
}

/// Status and count of the rows with the given ids.
pub(super) fn status_of_query<'a, DB>(dialect: Dialect, ids: &[i64]) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    String: Encode<'a, DB> + Type<DB>,
{
    let filter = DeadLetterFilter {
        ids: ids.to_vec(),
        ..DeadLetterFilter::default()
    };
    let mut query = QueryBuilder::new("SELECT status, count(*) FROM switchyard_outbox WHERE 1 = 1");
    push_filter(&mut query, dialect, &filter);
    query.push(" GROUP BY status");
    query
}

/// Up to `batch` dead letters matching a filter, from id `after` on, back
/// to pending (`replay`) or deleted (`purge`, `after` 0). PostgreSQL skips
/// rows another statement has locked. MySQL cannot select from the table a
/// statement changes: its statement limits itself (`ORDER BY id LIMIT`),
/// and returns nothing (its replay selects the ids first, locking them).
pub(super) fn dead_letter_change_query<'a, DB>(
    dialect: Dialect,
    change: DeadLetterChange,
    filter: &DeadLetterFilter,
    after: i64,
    batch: u32,
) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    String: Encode<'a, DB> + Type<DB>,
{
    let head = match (change, dialect) {
        (DeadLetterChange::Replay, Dialect::Postgres { .. }) => {
            "UPDATE switchyard_outbox SET status = 'pending', attempts = 0, next_attempt_at = '-infinity'"
        }
        (DeadLetterChange::Replay, Dialect::Sqlite) => {
            "UPDATE switchyard_outbox SET status = 'pending', attempts = 0, next_attempt_at = 0"
        }
        (DeadLetterChange::Replay, Dialect::MySql) => {
            "UPDATE switchyard_outbox SET status = 'pending', attempts = 0, next_attempt_at = '1970-01-01'"
        }
        (DeadLetterChange::Purge, _) => "DELETE FROM switchyard_outbox",
    };
    let mut query = QueryBuilder::new(head);
    if dialect == Dialect::MySql {
        query.push(format!(" WHERE {} AND id > ", dialect.dead()));
        query.push_bind(after);
        push_filter(&mut query, dialect, filter);
        query.push(" ORDER BY id LIMIT ").push_bind(i64::from(batch));
        return query;
    }
    query.push(format!(
        " WHERE id IN (SELECT id FROM switchyard_outbox WHERE {} AND id > ",
        dialect.dead()
    ));
    query.push_bind(after);
    push_filter(&mut query, dialect, filter);
    query.push(" ORDER BY id LIMIT ").push_bind(i64::from(batch));
    if matches!(dialect, Dialect::Postgres { .. }) {
        query.push(" FOR UPDATE SKIP LOCKED");
    }
    query.push(") AND status = 'dead'");
    if change == DeadLetterChange::Replay {
        query.push(" RETURNING id");
    }
    query
}

/// What [`dead_letter_change_query`] does to the rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DeadLetterChange {
    Replay,
    Purge,
}

const PG_ENTRY_COLUMNS: &str = "id, event_id::text AS event_id, aggregate_type, aggregate_id, event_type,
    status, attempts,
    CASE WHEN isfinite(created_at) THEN (extract(epoch FROM created_at) * 1000)::bigint END AS created_at_ms,
    last_error,
    plugin_version, tenant, headers::text AS headers_json, payload::text AS payload_json,
    octet_length(payload_bytes)::bigint AS payload_bytes_len, deliveries::text AS deliveries_json";

const SQLITE_ENTRY_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type,
    status, attempts, created_at AS created_at_ms, last_error,
    plugin_version, tenant, headers AS headers_json, payload AS payload_json,
    length(payload_bytes) AS payload_bytes_len, deliveries AS deliveries_json";

/// JSON is a type of its own on MySQL (text on MariaDB): read as text.
const MYSQL_ENTRY_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type,
    status, attempts, CAST(UNIX_TIMESTAMP(created_at) * 1000 AS SIGNED) AS created_at_ms, last_error,
    plugin_version, tenant, CAST(headers AS CHAR) AS headers_json, CAST(payload AS CHAR) AS payload_json,
    CAST(octet_length(payload_bytes) AS SIGNED) AS payload_bytes_len, CAST(deliveries AS CHAR) AS deliveries_json";

/// Columns the archive keeps (the relay's lease columns are dropped).
pub(super) const ARCHIVE_COLUMNS: &str =
    "id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes,
    headers, tenant, created_at, attempts, published_at, deliveries, plugin_version";

/// One row, whole, by id.
pub(super) fn entry_query<'a, DB>(dialect: Dialect, id: i64, with_payload: bool) -> QueryBuilder<'a, DB>
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
{
    // A page that does not show the payload does not read it: a payload
    // may be megabytes, stored out of line. (The headers stay: they carry
    // the trace context every viewer sees; a binary payload's length is its
    // stored size, not its bytes.)
    let columns = match (dialect, with_payload) {
        (_, true) => dialect.entry_columns().to_string(),
        (Dialect::Postgres(_), false) => {
            PG_ENTRY_COLUMNS.replacen("payload::text AS payload_json", "NULL::text AS payload_json", 1)
        }
        (Dialect::Sqlite, false) => {
            SQLITE_ENTRY_COLUMNS.replacen("payload AS payload_json", "CAST(NULL AS TEXT) AS payload_json", 1)
        }
        (Dialect::MySql, false) => MYSQL_ENTRY_COLUMNS.replacen(
            "CAST(payload AS CHAR) AS payload_json",
            "CAST(NULL AS CHAR) AS payload_json",
            1,
        ),
    };
    let mut query = QueryBuilder::new(format!("SELECT {columns} FROM switchyard_outbox WHERE id = "));
    query.push_bind(id);
    query
}

pub(super) fn entry_from_record<R: Row>(record: &R) -> Result<OutboxEntry, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + Type<R::Database>,
{
    // Shown whatever a service wrote: a value of the wrong type shows as
    // empty rather than failing the listing it is in.
    let ignored = &mut None;
    let created_at_ms: Option<i64> = lenient(record, "created_at_ms", "created_at", ignored);
    let headers: String = lenient(record, "headers_json", "headers", ignored);
    let payload: Option<String> = lenient(record, "payload_json", "payload", ignored);
    let deliveries: String = lenient(record, "deliveries_json", "deliveries", ignored);
    Ok(OutboxEntry {
        id: record.try_get("id")?,
        event_id: record.try_get("event_id")?,
        aggregate_type: record.try_get("aggregate_type")?,
        aggregate_id: record.try_get("aggregate_id")?,
        event_type: record.try_get("event_type")?,
        status: record.try_get("status")?,
        attempts: record.try_get("attempts")?,
        created_at: created_at_ms
            .and_then(chrono::DateTime::from_timestamp_millis)
            .map_or_else(
                || "not a point in time".into(),
                |at| at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            ),
        last_error: record.try_get("last_error")?,
        plugin_version: record.try_get("plugin_version")?,
        tenant: lenient(record, "tenant", "tenant", ignored),
        // Shown as stored; text that is not JSON is shown as a string.
        headers: serde_json::from_str(&headers).unwrap_or(serde_json::Value::String(headers)),
        payload: payload.map(|text| serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text))),
        payload_bytes_len: record.try_get("payload_bytes_len")?,
        deliveries: serde_json::from_str(&deliveries).unwrap_or_default(),
    })
}

/// Appends `AND ...` for every set field of `filter` (the caller has already
/// written the dead-letter condition).
fn push_filter<'a, DB>(query: &mut QueryBuilder<'a, DB>, dialect: Dialect, filter: &DeadLetterFilter)
where
    DB: Database,
    i64: Encode<'a, DB> + Type<DB>,
    String: Encode<'a, DB> + Type<DB>,
{
    if !filter.ids.is_empty() {
        query.push(" AND id IN (");
        let mut list = query.separated(", ");
        for id in &filter.ids {
            list.push_bind(*id);
        }
        query.push(")");
    }
    for (column, value) in [
        ("event_type", &filter.event_type),
        ("aggregate_type", &filter.aggregate_type),
        ("aggregate_id", &filter.aggregate_id),
    ] {
        if let Some(value) = value {
            query.push(format!(" AND {column} = ")).push_bind(value.clone());
        }
    }
    if matches!(dialect, Dialect::Postgres { .. })
        && filter.aggregate_type.is_some()
        && filter.aggregate_id.is_some()
    {
        // True of every dead letter, and the predicate of the index by
        // aggregate: one aggregate's rows are read, not every dead letter.
        query.push(" AND published_at IS NULL");
    }
    for (op, value) in [(">=", filter.created_since_ms), ("<", filter.created_before_ms)] {
        if let Some(ms) = value {
            match dialect {
                Dialect::Postgres { .. } => query
                    .push(format!(" AND created_at {op} to_timestamp("))
                    .push_bind(ms)
                    .push(" / 1000.0)"),
                Dialect::Sqlite => query.push(format!(" AND created_at {op} ")).push_bind(ms),
                Dialect::MySql => query
                    .push(format!(" AND created_at {op} FROM_UNIXTIME("))
                    .push_bind(ms)
                    .push(" / 1000.0)"),
            };
        }
    }
    if let Some(target) = &filter.target {
        // Read per dead row (no index: see the console's page in the book).
        match dialect {
            Dialect::Postgres { .. } => {
                // A path with the name as a JSON string literal: three times
                // faster than jsonb_each, or than passing it as a variable.
                let name = serde_json::to_string(target).unwrap_or_default();
                query
                    .push(" AND deliveries @? CAST(")
                    .push_bind(format!("$.* ? (@.target == {name} && !exists(@.acked_at))"))
                    .push(" AS jsonpath)");
            }
            Dialect::Sqlite => {
                query
                    .push(
                        " AND EXISTS (SELECT 1 FROM json_each(deliveries) AS d
                          WHERE json_extract(d.value, '$.acked_at') IS NULL AND json_extract(d.value, '$.target') = ",
                    )
                    .push_bind(target.clone())
                    .push(")");
            }
            Dialect::MySql => {
                query
                    .push(
                        " AND EXISTS (SELECT 1 FROM JSON_TABLE(JSON_EXTRACT(deliveries, '$.*'), '$[*]'
                            COLUMNS (target VARCHAR(255) PATH '$.target', acked_at VARCHAR(64) PATH '$.acked_at')) AS d
                          WHERE d.acked_at IS NULL AND d.target = ",
                    )
                    .push_bind(target.clone())
                    .push(")");
            }
        }
    }
    if let Some(text) = &filter.error_contains {
        let function = match dialect {
            Dialect::Postgres { .. } => "strpos",
            Dialect::Sqlite | Dialect::MySql => "instr",
        };
        query
            .push(format!(" AND {function}(lower(coalesce(last_error, '')), lower("))
            .push_bind(text.clone())
            .push(")) > 0");
    }
}

/// The `deliveries` column as JSON text. jsonb refuses the NUL character
/// (`\u0000`), which a topic or a broker's error text may carry.
pub(super) fn deliveries_json(deliveries: &BTreeMap<DeliveryKey, Delivery>) -> String {
    let json = serde_json::to_string(deliveries).unwrap_or_else(|_| "{}".into());
    if json.contains("\\u0000") {
        json.replace("\\u0000", "\\ufffd")
    } else {
        json
    }
}

/// Reads one column of a claimed row. A value the relay cannot read (a
/// wrong type written past the table's checks, by an UPDATE or before they
/// existed) must not fail the claim of the whole batch, which would stop
/// the relay at that row: it is noted in `problem` (the first one counts)
/// and replaced by the default, and the row is dead-lettered saying why.
pub(super) fn lenient<'r, R, I, T>(record: &'r R, index: I, column: &str, problem: &mut Option<String>) -> T
where
    R: Row,
    I: sqlx::ColumnIndex<R>,
    T: Default + sqlx::Decode<'r, R::Database> + Type<R::Database>,
{
    record.try_get(index).unwrap_or_else(|error| {
        problem.get_or_insert_with(|| {
            let detail = match &error {
                sqlx::Error::ColumnDecode { source, .. } => source.to_string(),
                other => other.to_string(),
            };
            match mismatched_types(&detail) {
                Some((expected, found)) => {
                    format!("column {column} holds {found} where {expected} is expected")
                }
                None => format!("column {column} cannot be read: {detail}"),
            }
        });
        T::default()
    })
}

/// The SQL types in sqlx's "mismatched types; Rust type `..` (as SQL type
/// `EXPECTED`) is not compatible with SQL type `FOUND`", which a user reads
/// better without the Rust part.
fn mismatched_types(detail: &str) -> Option<(&str, &str)> {
    let (_, rest) = detail.split_once("(as SQL type `")?;
    let (expected, rest) = rest.split_once('`')?;
    let (_, rest) = rest.split_once("is not compatible with SQL type `")?;
    let (found, _) = rest.split_once('`')?;
    Some((expected, found))
}

#[cfg(test)]
mod tests {
    use super::{Dialect, entry_query};
    use crate::store::Generation;

    /// An entry read without its payload selects no payload column, on
    /// either database (the column lists are edited, so a renamed
    /// expression must not silently read it again).
    #[test]
    fn an_entry_without_its_payload_does_not_select_it() {
        for dialect in [
            Dialect::Postgres(Generation::Current),
            Dialect::Sqlite,
            Dialect::MySql,
        ] {
            let with: sqlx::QueryBuilder<'_, sqlx::Any> = entry_query(dialect, 1, true);
            let without: sqlx::QueryBuilder<'_, sqlx::Any> = entry_query(dialect, 1, false);
            let (with, without) = (with.sql().to_string(), without.sql().to_string());
            assert!(
                with.contains("payload") && with.contains("AS payload_json"),
                "{with}"
            );
            assert!(
                without.contains("NULL") && without.contains("AS payload_json"),
                "{without}"
            );
            let read = |sql: &str| {
                sql.split(',')
                    .any(|column| column.contains("AS payload_json") && !column.contains("NULL"))
            };
            assert!(read(&with) && !read(&without), "{without}");
            assert!(without.contains("headers"), "the trace context stays: {without}");
        }
    }
}
