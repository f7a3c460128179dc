//! Operator queries on the outbox: the counts behind `switchyard status`, the
//! dead-letter list, replay and purge, and retention of published rows.
//!
//! Every statement that changes rows works in bounded batches, so none of
//! them holds locks on more than `batch` rows or for longer than one short
//! statement.

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::{Database, Encode, QueryBuilder, Row, Type};

use super::row::Delivery;
use super::{Backend, Error, OutboxStore};

/// What `switchyard status` reports from the database.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OutboxStats {
    /// Rows not yet finished: pending, delayed and in flight.
    pub backlog: i64,
    /// Rows waiting for a claim (first try or a scheduled retry), not delayed.
    pub pending: i64,
    /// Rows whose writer set `not_before` in the future. Each holds back the
    /// later events of its aggregate until then.
    pub delayed: i64,
    /// Rows leased by a relay right now.
    pub in_flight: i64,
    /// Pending rows that already failed at least once.
    pub retrying: i64,
    /// Age of the oldest unfinished row, in seconds.
    pub oldest_pending_age_seconds: Option<f64>,
    /// Dead letters in total.
    pub dead: i64,
    /// Dead letters per event type.
    pub dead_by_event_type: BTreeMap<String, i64>,
}

/// Selects dead letters. Empty fields match everything; set fields must all match.
#[derive(Debug, Clone, Default)]
pub struct DeadLetterFilter {
    /// Only these row ids.
    pub ids: Vec<i64>,
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this aggregate type.
    pub aggregate_type: Option<String>,
    /// Only this aggregate id.
    pub aggregate_id: Option<String>,
    /// Only events created at or after this time (ms since the epoch).
    pub created_since_ms: Option<i64>,
    /// Only events created before this time (ms since the epoch).
    pub created_before_ms: Option<i64>,
    /// Only rows whose `last_error` contains this text (case-insensitive).
    pub error_contains: Option<String>,
}

/// One outbox row as an operator sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutboxEntry {
    /// Row id.
    pub id: i64,
    /// Event id.
    pub event_id: String,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// `pending`, `in_flight`, `published` or `dead`.
    pub status: String,
    /// Claims so far.
    pub attempts: i32,
    /// When the service wrote the event (RFC 3339).
    pub created_at: String,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// Content hash of the plugin version that last routed it.
    pub plugin_version: Option<String>,
    /// Tenant.
    pub tenant: Option<String>,
    /// Headers.
    pub headers: serde_json::Value,
    /// JSON payload, when the row has one.
    pub payload: Option<serde_json::Value>,
    /// Size of the binary payload, when the row has one.
    pub payload_bytes_len: Option<i64>,
    /// Per-target delivery state.
    pub deliveries: BTreeMap<String, Delivery>,
}

/// What retention does with published rows past their age.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RetentionMode {
    /// Delete them.
    #[default]
    Delete,
    /// Move them to `switchyard_outbox_archive`.
    Archive,
}

#[derive(Clone, Copy)]
enum Dialect {
    Postgres,
    Sqlite,
}

const PG_ENTRY_COLUMNS: &str = "id, event_id::text AS event_id, aggregate_type, aggregate_id, event_type,
    status, attempts, (extract(epoch FROM created_at) * 1000)::bigint AS created_at_ms, last_error,
    plugin_version, tenant, headers::text AS headers_json, payload::text AS payload_json,
    octet_length(payload_bytes)::bigint AS payload_bytes_len, deliveries::text AS deliveries_json";

const SQLITE_ENTRY_COLUMNS: &str = "id, event_id, aggregate_type, aggregate_id, event_type,
    status, attempts, created_at AS created_at_ms, last_error,
    plugin_version, tenant, headers AS headers_json, payload AS payload_json,
    length(payload_bytes) AS payload_bytes_len, deliveries AS deliveries_json";

/// Columns the archive keeps (the relay's lease columns are dropped).
const ARCHIVE_COLUMNS: &str =
    "id, event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes,
    headers, tenant, created_at, attempts, published_at, deliveries, plugin_version";

fn entry_from_record<R: Row>(record: &R) -> Result<OutboxEntry, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + Type<R::Database>,
{
    let created_at_ms: i64 = record.try_get("created_at_ms")?;
    let headers: String = record.try_get("headers_json")?;
    let payload: Option<String> = record.try_get("payload_json")?;
    let deliveries: String = record.try_get("deliveries_json")?;
    Ok(OutboxEntry {
        id: record.try_get("id")?,
        event_id: record.try_get("event_id")?,
        aggregate_type: record.try_get("aggregate_type")?,
        aggregate_id: record.try_get("aggregate_id")?,
        event_type: record.try_get("event_type")?,
        status: record.try_get("status")?,
        attempts: record.try_get("attempts")?,
        created_at: chrono::DateTime::from_timestamp_millis(created_at_ms)
            .unwrap_or_default()
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        last_error: record.try_get("last_error")?,
        plugin_version: record.try_get("plugin_version")?,
        tenant: record.try_get("tenant")?,
        // Shown as stored; text that is not JSON is shown as a string.
        headers: serde_json::from_str(&headers).unwrap_or(serde_json::Value::String(headers)),
        payload: payload.map(|text| serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text))),
        payload_bytes_len: record.try_get("payload_bytes_len")?,
        deliveries: serde_json::from_str(&deliveries).unwrap_or_default(),
    })
}

/// Appends `AND ...` for every set field of `filter` (the caller has already
/// written `WHERE status = 'dead'`).
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
    for (op, value) in [(">=", filter.created_since_ms), ("<", filter.created_before_ms)] {
        if let Some(ms) = value {
            match dialect {
                Dialect::Postgres => query
                    .push(format!(" AND created_at {op} to_timestamp("))
                    .push_bind(ms)
                    .push(" / 1000.0)"),
                Dialect::Sqlite => query.push(format!(" AND created_at {op} ")).push_bind(ms),
            };
        }
    }
    if let Some(text) = &filter.error_contains {
        let function = match dialect {
            Dialect::Postgres => "strpos",
            Dialect::Sqlite => "instr",
        };
        query
            .push(format!(" AND {function}(lower(coalesce(last_error, '')), lower("))
            .push_bind(text.clone())
            .push(")) > 0");
    }
}

impl OutboxStore {
    fn dialect(&self) -> Dialect {
        match &self.backend {
            Backend::Postgres(_) => Dialect::Postgres,
            Backend::Sqlite(_) => Dialect::Sqlite,
        }
    }

    /// Backlog, retries and dead letters, read from the partial indexes (none
    /// of these counts scans published rows).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn stats(&self) -> Result<OutboxStats, Error> {
        let counts = |now: &str| {
            format!(
                "SELECT count(CASE WHEN status = 'pending' AND NOT {delayed} THEN 1 END),
                        count(CASE WHEN status = 'pending' AND {delayed} THEN 1 END),
                        count(CASE WHEN status = 'in_flight' THEN 1 END),
                        count(CASE WHEN status = 'pending' AND attempts > 0 THEN 1 END)
                   FROM switchyard_outbox WHERE status IN ('pending', 'in_flight')",
                delayed = format!("coalesce(not_before > {now}, false)")
            )
        };
        let by_type = "SELECT event_type, count(*) FROM switchyard_outbox
                        WHERE status = 'dead' GROUP BY event_type ORDER BY event_type";
        type Counts = (i64, i64, i64, i64);
        let ((pending, delayed, in_flight, retrying), dead_by_type): (Counts, Vec<(String, i64)>) =
            match &self.backend {
                Backend::Postgres(pool) => (
                    sqlx::query_as(&counts("now()")).fetch_one(pool).await?,
                    sqlx::query_as(by_type).fetch_all(pool).await?,
                ),
                Backend::Sqlite(pool) => (
                    sqlx::query_as(&counts(super::SQLITE_NOW_MS))
                        .fetch_one(pool)
                        .await?,
                    sqlx::query_as(by_type).fetch_all(pool).await?,
                ),
            };
        let oldest = self.oldest_pending_age().await?;
        Ok(OutboxStats {
            backlog: pending + delayed + in_flight,
            pending,
            delayed,
            in_flight,
            retrying,
            oldest_pending_age_seconds: oldest,
            dead: dead_by_type.iter().map(|(_, n)| n).sum(),
            dead_by_event_type: dead_by_type.into_iter().collect(),
        })
    }

    /// Dead letters matching `filter`, oldest first, at most `limit`, starting
    /// after row id `after` (for paging).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: i64,
        limit: u32,
    ) -> Result<Vec<OutboxEntry>, Error> {
        let dialect = self.dialect();
        Ok(match &self.backend {
            Backend::Postgres(pool) => {
                let mut query = QueryBuilder::new(format!(
                    "SELECT {PG_ENTRY_COLUMNS} FROM switchyard_outbox WHERE status = 'dead' AND id > "
                ));
                query.push_bind(after);
                push_filter(&mut query, dialect, filter);
                query.push(" ORDER BY id LIMIT ").push_bind(i64::from(limit));
                let records = query.build().fetch_all(pool).await?;
                records.iter().map(entry_from_record).collect::<Result<_, _>>()?
            }
            Backend::Sqlite(pool) => {
                let mut query = QueryBuilder::new(format!(
                    "SELECT {SQLITE_ENTRY_COLUMNS} FROM switchyard_outbox WHERE status = 'dead' AND id > "
                ));
                query.push_bind(after);
                push_filter(&mut query, dialect, filter);
                query.push(" ORDER BY id LIMIT ").push_bind(i64::from(limit));
                let records = query.build().fetch_all(pool).await?;
                records.iter().map(entry_from_record).collect::<Result<_, _>>()?
            }
        })
    }

    /// How many dead letters match `filter`.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn count_dead_letters(&self, filter: &DeadLetterFilter) -> Result<i64, Error> {
        let dialect = self.dialect();
        let head = "SELECT count(*) FROM switchyard_outbox WHERE status = 'dead'";
        Ok(match &self.backend {
            Backend::Postgres(pool) => {
                let mut query = QueryBuilder::new(head);
                push_filter(&mut query, dialect, filter);
                query.build_query_scalar().fetch_one(pool).await?
            }
            Backend::Sqlite(pool) => {
                let mut query = QueryBuilder::new(head);
                push_filter(&mut query, dialect, filter);
                query.build_query_scalar().fetch_one(pool).await?
            }
        })
    }

    /// One row by id, whatever its status.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn entry(&self, id: i64) -> Result<Option<OutboxEntry>, Error> {
        Ok(match &self.backend {
            Backend::Postgres(pool) => {
                let sql = format!("SELECT {PG_ENTRY_COLUMNS} FROM switchyard_outbox WHERE id = $1");
                let record = sqlx::query(&sql).bind(id).fetch_optional(pool).await?;
                record.as_ref().map(entry_from_record).transpose()?
            }
            Backend::Sqlite(pool) => {
                let sql = format!("SELECT {SQLITE_ENTRY_COLUMNS} FROM switchyard_outbox WHERE id = ?1");
                let record = sqlx::query(&sql).bind(id).fetch_optional(pool).await?;
                record.as_ref().map(entry_from_record).transpose()?
            }
        })
    }

    /// Sends up to `batch` dead letters matching `filter` with id above
    /// `after` back to pending, in id order: attempts start again from zero
    /// and the next claim routes them through the plugin version current
    /// then. Acknowledged deliveries are kept, so targets that already have
    /// an event do not get it twice. Returns the ids replayed.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn replay_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: i64,
        batch: u32,
    ) -> Result<Vec<i64>, Error> {
        let dialect = self.dialect();
        let mut ids: Vec<i64> = match &self.backend {
            Backend::Postgres(pool) => {
                let mut query = QueryBuilder::new(
                    "UPDATE switchyard_outbox SET status = 'pending', attempts = 0,
                            next_attempt_at = '-infinity'
                      WHERE id IN (SELECT id FROM switchyard_outbox WHERE status = 'dead' AND id > ",
                );
                query.push_bind(after);
                push_filter(&mut query, dialect, filter);
                query
                    .push(" ORDER BY id LIMIT ")
                    .push_bind(i64::from(batch))
                    .push(" FOR UPDATE SKIP LOCKED) AND status = 'dead' RETURNING id");
                query.build_query_scalar().fetch_all(pool).await?
            }
            Backend::Sqlite(pool) => {
                let mut query = QueryBuilder::new(
                    "UPDATE switchyard_outbox SET status = 'pending', attempts = 0, next_attempt_at = 0
                      WHERE id IN (SELECT id FROM switchyard_outbox WHERE status = 'dead' AND id > ",
                );
                query.push_bind(after);
                push_filter(&mut query, dialect, filter);
                query
                    .push(" ORDER BY id LIMIT ")
                    .push_bind(i64::from(batch))
                    .push(") AND status = 'dead' RETURNING id");
                query.build_query_scalar().fetch_all(pool).await?
            }
        };
        ids.sort_unstable();
        Ok(ids)
    }

    /// Deletes up to `batch` dead letters matching `filter`; returns how many.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn purge_dead_letters(&self, filter: &DeadLetterFilter, batch: u32) -> Result<u64, Error> {
        let dialect = self.dialect();
        let head = "DELETE FROM switchyard_outbox
                     WHERE id IN (SELECT id FROM switchyard_outbox WHERE status = 'dead'";
        Ok(match &self.backend {
            Backend::Postgres(pool) => {
                let mut query = QueryBuilder::new(head);
                push_filter(&mut query, dialect, filter);
                query
                    .push(" ORDER BY id LIMIT ")
                    .push_bind(i64::from(batch))
                    .push(" FOR UPDATE SKIP LOCKED) AND status = 'dead'");
                query.build().execute(pool).await?.rows_affected()
            }
            Backend::Sqlite(pool) => {
                let mut query = QueryBuilder::new(head);
                push_filter(&mut query, dialect, filter);
                query
                    .push(" ORDER BY id LIMIT ")
                    .push_bind(i64::from(batch))
                    .push(") AND status = 'dead'");
                query.build().execute(pool).await?.rows_affected()
            }
        })
    }

    /// Status counts of the given rows (to follow a replay).
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn status_counts(&self, ids: &[i64]) -> Result<BTreeMap<String, i64>, Error> {
        let mut counts = BTreeMap::new();
        for chunk in ids.chunks(1000) {
            let dialect = self.dialect();
            let filter = DeadLetterFilter {
                ids: chunk.to_vec(),
                ..DeadLetterFilter::default()
            };
            let rows: Vec<(String, i64)> = match &self.backend {
                Backend::Postgres(pool) => {
                    let mut query =
                        QueryBuilder::new("SELECT status, count(*) FROM switchyard_outbox WHERE true");
                    push_filter(&mut query, dialect, &filter);
                    query.push(" GROUP BY status");
                    query.build_query_as().fetch_all(pool).await?
                }
                Backend::Sqlite(pool) => {
                    let mut query =
                        QueryBuilder::new("SELECT status, count(*) FROM switchyard_outbox WHERE 1");
                    push_filter(&mut query, dialect, &filter);
                    query.push(" GROUP BY status");
                    query.build_query_as().fetch_all(pool).await?
                }
            };
            for (status, n) in rows {
                *counts.entry(status).or_insert(0) += n;
            }
        }
        Ok(counts)
    }

    /// Removes up to `batch` published rows whose `published_at` is more than
    /// `max_age` ago, oldest first: deleted, or moved to
    /// `switchyard_outbox_archive`. Returns how many. Rows in any other
    /// status (dead letters included) are never touched.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn prune_published(
        &self,
        max_age: std::time::Duration,
        mode: RetentionMode,
        batch: u32,
    ) -> Result<u64, Error> {
        let max_age_ms = i64::try_from(max_age.as_millis()).unwrap_or(i64::MAX);
        let batch = i64::from(batch);
        match &self.backend {
            Backend::Postgres(pool) => {
                // SKIP LOCKED: several relays may run retention at once.
                let doomed = "WITH doomed AS (
                    SELECT id FROM switchyard_outbox
                     WHERE status = 'published'
                       AND published_at < now() - $1 * interval '1 millisecond'
                     ORDER BY published_at LIMIT $2
                       FOR UPDATE SKIP LOCKED)";
                let sql = match mode {
                    RetentionMode::Delete => format!(
                        "{doomed} DELETE FROM switchyard_outbox o USING doomed WHERE o.id = doomed.id"
                    ),
                    RetentionMode::Archive => format!(
                        "{doomed}, moved AS (
                            DELETE FROM switchyard_outbox o USING doomed WHERE o.id = doomed.id
                            RETURNING o.*)
                         INSERT INTO switchyard_outbox_archive ({ARCHIVE_COLUMNS})
                         SELECT {ARCHIVE_COLUMNS} FROM moved"
                    ),
                };
                let done = sqlx::query(&sql)
                    .bind(max_age_ms)
                    .bind(batch)
                    .execute(pool)
                    .await?;
                Ok(done.rows_affected())
            }
            Backend::Sqlite(pool) => {
                let cutoff = chrono::Utc::now().timestamp_millis().saturating_sub(max_age_ms);
                let doomed = "SELECT id FROM switchyard_outbox
                               WHERE status = 'published' AND published_at < ?1
                               ORDER BY published_at LIMIT ?2";
                let mut tx = pool.begin().await?;
                if mode == RetentionMode::Archive {
                    // The insert takes the write lock first, so the delete
                    // below selects exactly the rows just copied.
                    let sql = format!(
                        "INSERT INTO switchyard_outbox_archive ({ARCHIVE_COLUMNS})
                         SELECT {ARCHIVE_COLUMNS} FROM switchyard_outbox WHERE id IN ({doomed})"
                    );
                    sqlx::query(&sql)
                        .bind(cutoff)
                        .bind(batch)
                        .execute(&mut *tx)
                        .await?;
                }
                let sql = format!("DELETE FROM switchyard_outbox WHERE id IN ({doomed})");
                let done = sqlx::query(&sql)
                    .bind(cutoff)
                    .bind(batch)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(done.rows_affected())
            }
        }
    }
}
