//! An outbox table the services already write (`[source]`): the mapping of
//! its columns to event fields, the check of that mapping against the live
//! schema, and the capture trigger that copies each inserted row into
//! `switchyard_outbox` in the writer's own transaction.
//!
//! The relay never writes the services' table. Everything it needs to keep
//! its promises (leases, per-aggregate order, retries, dead letters, replay,
//! retention) lives in the copy, so the claim path is the one every outbox
//! uses. The trigger is SQL the operator reviews (`migrate --dry-run`) and
//! installs (`migrate`); a relay refuses to start while the installed one is
//! missing or was made from another mapping.
//!
//! A writer's transaction never fails because of the copy: a NULL or
//! oversized key becomes a dead letter saying which column, and a text or
//! `json` payload that is not valid `jsonb` is carried as bytes.

use std::collections::BTreeMap;

use sqlx::{PgConnection, Row};

use crate::config::source::SourceConfig;

mod sql;

/// How a payload column is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PayloadKind {
    Jsonb,
    /// `json` or text: parsed as `jsonb` when it is valid, bytes otherwise.
    JsonText,
    Bytea,
}

/// The mapping checked against the live schema: ready to generate SQL.
#[derive(Debug, Clone)]
pub struct Capture {
    source: SourceConfig,
    /// The schema `switchyard_outbox` is (or will be) in.
    outbox_schema: String,
    payload: PayloadKind,
    /// The table's name for messages, `schema.table`.
    display: String,
    /// Its schema, unquoted.
    schema: String,
}

impl Capture {
    /// The mapping this capture was checked from.
    pub(crate) fn source(&self) -> &SourceConfig {
        &self.source
    }

    /// How the payload column is read.
    pub(crate) fn payload_kind(&self) -> PayloadKind {
        self.payload
    }

    /// Schema and table, unquoted (as the WAL and the catalogs name them).
    pub(crate) fn schema_and_table(&self) -> (&str, &str) {
        (&self.schema, &self.source.table)
    }
}

const TEXT_TYPES: &[&str] = &["text", "character varying", "character", "name", "citext"];
const KEY_TYPES: &[&str] = &["uuid", "smallint", "integer", "bigint", "numeric"];

/// Checks `[source]` against the database: the table exists, every mapped
/// column exists with a usable type, the event id column is unique.
///
/// # Errors
/// Every mismatch, one line each; or the database error that stopped the check.
pub async fn check(session: &mut PgConnection, source: &SourceConfig) -> Result<Capture, CheckError> {
    // The bare name (regnamespace's text form would come quoted already).
    let outbox_schema: String = sqlx::query_scalar(
        "SELECT coalesce((SELECT n.nspname::text FROM pg_class c
                            JOIN pg_namespace n ON n.oid = c.relnamespace
                           WHERE c.oid = to_regclass('switchyard_outbox')),
                         current_schema())",
    )
    .fetch_one(&mut *session)
    .await?;
    let (oid, display, schema) = locate(session, source).await?;
    let columns = columns(session, oid).await?;
    let payload = mismatches(source, &columns, &display).map_err(CheckError::Mismatch)?;
    let payload = match payload.as_deref() {
        Some("jsonb") => PayloadKind::Jsonb,
        Some("bytea") => PayloadKind::Bytea,
        _ => PayloadKind::JsonText,
    };
    Ok(Capture {
        source: source.clone(),
        outbox_schema,
        payload,
        display,
        schema,
    })
}

/// The table's oid, its `schema.table` for messages, and its schema.
async fn locate(
    session: &mut PgConnection,
    source: &SourceConfig,
) -> Result<(i64, String, String), CheckError> {
    let qualified = match &source.schema {
        Some(schema) => format!("{}.{}", ident(schema), ident(&source.table)),
        None => ident(&source.table),
    };
    let table = sqlx::query(
        "SELECT c.oid::int8, c.relkind::text, n.nspname::text FROM pg_class c
           JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)",
    )
    .bind(&qualified)
    .fetch_optional(session)
    .await?;
    let Some(table) = table else {
        return Err(CheckError::Mismatch(vec![format!(
            "source.table: table {qualified} does not exist (or the relay's role cannot see it)"
        )]));
    };
    let (oid, kind, schema): (i64, String, String) =
        (table.try_get(0)?, table.try_get(1)?, table.try_get(2)?);
    let display = format!("{}.{}", ident(&schema), ident(&source.table));
    if kind != "r" && kind != "p" {
        return Err(CheckError::Mismatch(vec![format!(
            "source.table: {display} is not a table (views and foreign tables cannot carry the capture trigger)"
        )]));
    }
    Ok((oid, display, schema))
}

/// Each column's type (a domain's base type) and whether a unique index
/// covers it alone.
async fn columns(
    session: &mut PgConnection,
    oid: i64,
) -> Result<BTreeMap<String, (String, bool)>, CheckError> {
    let rows = sqlx::query(
        "SELECT a.attname::text,
                format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END, NULL),
                EXISTS (SELECT 1 FROM pg_index i
                         WHERE i.indrelid = a.attrelid AND i.indisunique AND i.indnatts = 1
                           AND i.indkey[0] = a.attnum AND i.indpred IS NULL)
           FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
          WHERE a.attrelid = $1::oid AND a.attnum > 0 AND NOT a.attisdropped",
    )
    .bind(oid)
    .fetch_all(session)
    .await?;
    let mut columns = BTreeMap::new();
    for row in rows {
        let name: String = row.try_get(0)?;
        let kind: String = row.try_get(1)?;
        let unique: bool = row.try_get(2)?;
        columns.insert(name, (kind, unique));
    }
    Ok(columns)
}

/// Every mapped column that is missing or has a type the trigger cannot
/// read; else the payload column's type.
fn mismatches(
    source: &SourceConfig,
    columns: &BTreeMap<String, (String, bool)>,
    display: &str,
) -> Result<Option<String>, Vec<String>> {
    let mut problems = Vec::new();
    let mut column = |key: &str, name: &str, allowed: &[&[&str]], need: &str| -> Option<String> {
        match columns.get(name) {
            None => {
                problems.push(format!("{key}: {display} has no column {}", ident(name)));
                None
            }
            Some((kind, _))
                if !allowed.is_empty() && !allowed.iter().any(|set| set.contains(&kind.as_str())) =>
            {
                problems.push(format!(
                    "{key}: column {} of {display} is {kind}; {need}",
                    ident(name)
                ));
                None
            }
            Some((kind, _)) => Some(kind.clone()),
        }
    };
    let cols = &source.columns;
    column(
        "source.columns.aggregate_type",
        &cols.aggregate_type,
        &[TEXT_TYPES],
        "it needs a text type",
    );
    column(
        "source.columns.aggregate_id",
        &cols.aggregate_id,
        &[TEXT_TYPES, KEY_TYPES],
        "it needs a text, uuid or integer type",
    );
    column(
        "source.columns.event_type",
        &cols.event_type,
        &[TEXT_TYPES],
        "it needs a text type",
    );
    let payload = column(
        "source.columns.payload",
        &cols.payload,
        &[&["jsonb", "json", "bytea"], TEXT_TYPES],
        "it needs jsonb, json, a text type or bytea",
    );
    if let Some(headers) = &cols.headers {
        column(
            "source.columns.headers",
            headers,
            &[&["jsonb"]],
            "it needs jsonb (an object of strings)",
        );
    }
    if let Some(tenant) = &cols.tenant {
        column(
            "source.columns.tenant",
            tenant,
            &[TEXT_TYPES],
            "it needs a text type",
        );
    }
    for (header, name) in &source.header_columns {
        column(&format!("source.header_columns.{header}"), name, &[], "");
    }
    if let Some(order_by) = &source.order_by {
        column("source.order_by", order_by, &[], "");
    }
    if let Some(event_id) = &cols.event_id
        && column("source.columns.event_id", event_id, &[&["uuid"]], "it needs uuid").is_some()
        && !columns.get(event_id).is_some_and(|(_, unique)| *unique)
    {
        problems.push(format!(
            "source.columns.event_id: column {} of {display} has no unique index of its own; \
             a repeated value would fail the writer's INSERT",
            ident(event_id)
        ));
    }
    if problems.is_empty() {
        Ok(payload)
    } else {
        Err(problems)
    }
}

/// Why [`check`] failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The mapping does not fit the table: every mismatch.
    #[error("[source] does not match the table:\n  - {}", .0.join("\n  - "))]
    Mismatch(Vec<String>),
    /// The database could not be asked.
    #[error("cannot read the source table's schema: {0}")]
    Database(#[from] sqlx::Error),
    /// The database did not answer in time (or no session could be had).
    #[error("cannot read the source table's schema: {0}")]
    Store(#[from] crate::store::Error),
}

/// What the database has installed for a [`Capture`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Installed {
    /// The trigger, made from this mapping.
    Current,
    /// No capture trigger on the table.
    Missing,
    /// A capture trigger made from another mapping (or edited by hand).
    Outdated,
    /// The trigger is there but disabled (`ALTER TABLE ... DISABLE TRIGGER`).
    Disabled,
}

/// A quoted identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A quoted string literal (`standard_conforming_strings` is on since 9.1).
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn debezium() -> SourceConfig {
        toml::from_str(
            r#"
            table = "outbox"
            [columns]
            event_id = "id"
            aggregate_type = "aggregatetype"
            aggregate_id = "aggregateid"
            event_type = "type"
            payload = "payload"
            [header_columns]
            traceparent = "tracingspancontext"
            "#,
        )
        .unwrap()
    }

    fn capture(source: SourceConfig, payload: PayloadKind) -> Capture {
        Capture {
            display: format!("\"public\".{}", ident(&source.table)),
            source,
            outbox_schema: "public".into(),
            payload,
            schema: "public".into(),
        }
    }

    #[test]
    fn names_are_quoted_so_a_column_cannot_inject_sql() {
        let mut source = debezium();
        source.columns.payload = "p\"; DROP TABLE x; --".into();
        source.header_columns.insert("it's".into(), "span".into());
        let sql = capture(source, PayloadKind::Jsonb).definition();
        assert!(sql.contains(r#"s."p""; DROP TABLE x; --""#), "{sql}");
        assert!(sql.contains("'it''s', s.\"span\"::text"), "{sql}");
    }

    #[test]
    fn the_version_follows_the_mapping() {
        let one = capture(debezium(), PayloadKind::Jsonb);
        let mut other = debezium();
        other.columns.event_type = "kind".into();
        let two = capture(other, PayloadKind::Jsonb);
        assert_eq!(one.version(), capture(debezium(), PayloadKind::Jsonb).version());
        assert_ne!(one.version(), two.version());
        assert_ne!(
            one.version(),
            capture(debezium(), PayloadKind::JsonText).version()
        );
    }
}
