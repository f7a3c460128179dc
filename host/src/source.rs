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

use serde::Deserialize;
use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};

/// `[source]`: an existing outbox table and which of its columns hold what.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// The table's name, as written in its `CREATE TABLE` (case matters).
    pub table: String,
    /// Its schema; default: the first on the relay role's `search_path`.
    #[serde(default)]
    pub schema: Option<String>,
    /// Event field -> column.
    pub columns: SourceColumns,
    /// Header name -> column whose value (as text) becomes that header, e.g.
    /// `traceparent = "tracingspancontext"`. NULL values send no header.
    #[serde(default)]
    pub header_columns: BTreeMap<String, String>,
    /// Column that orders the rows already in the table when
    /// `migrate --backfill` copies them (default: no particular order).
    #[serde(default)]
    pub order_by: Option<String>,
}

/// Event field -> column of the source table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceColumns {
    /// A unique `uuid` column used as the event id (consumers deduplicate on
    /// it); without it each copy gets a fresh id.
    #[serde(default)]
    pub event_id: Option<String>,
    /// Text column.
    pub aggregate_type: String,
    /// Text, uuid or integer column.
    pub aggregate_id: String,
    /// Text column.
    pub event_type: String,
    /// `jsonb`, `json` or text (JSON when it parses, bytes otherwise), or
    /// `bytea` (a binary event).
    pub payload: String,
    /// A `jsonb` object of string headers.
    #[serde(default)]
    pub headers: Option<String>,
    /// Text column.
    #[serde(default)]
    pub tenant: Option<String>,
}

/// Problems with `[source]` found without a database.
pub fn static_problems(source: &SourceConfig, database_url: &str) -> Vec<String> {
    let mut problems = Vec::new();
    if database_url.starts_with("sqlite:") {
        problems.push("source: an existing table can be relayed from PostgreSQL only".into());
    }
    let mut names = vec![("source.table", source.table.as_str())];
    if let Some(schema) = &source.schema {
        names.push(("source.schema", schema));
    }
    for (field, column) in source.columns.named() {
        names.push((field, column));
    }
    if let Some(order_by) = &source.order_by {
        names.push(("source.order_by", order_by));
    }
    for (key, name) in names {
        if let Err(why) = check_identifier(name) {
            problems.push(format!("{key}: {why}"));
        }
    }
    for (header, column) in &source.header_columns {
        if header.is_empty() || header.chars().any(|c| c.is_control() || c == ':') {
            problems.push(format!(
                "source.header_columns: {header:?} is not a header name (empty, a colon or a control character)"
            ));
        }
        if let Err(why) = check_identifier(column) {
            problems.push(format!("source.header_columns.{header}: {why}"));
        }
    }
    problems
}

fn check_identifier(name: &str) -> Result<(), String> {
    if name.contains("$switchyard$") {
        // The trigger's body is quoted with it.
        Err(format!("{name:?} contains $switchyard$"))
    } else if name.is_empty() {
        Err("is empty".into())
    } else if name.len() > 63 {
        Err(format!("{name:?} is longer than PostgreSQL's 63-byte names"))
    } else if name.chars().any(|c| c.is_control()) {
        Err(format!("{name:?} has a control character"))
    } else {
        Ok(())
    }
}

impl SourceColumns {
    /// `(config key, column)` for every mapped field.
    fn named(&self) -> Vec<(&'static str, &str)> {
        let mut named = vec![
            ("source.columns.aggregate_type", self.aggregate_type.as_str()),
            ("source.columns.aggregate_id", self.aggregate_id.as_str()),
            ("source.columns.event_type", self.event_type.as_str()),
            ("source.columns.payload", self.payload.as_str()),
        ];
        for (key, column) in [
            ("source.columns.event_id", &self.event_id),
            ("source.columns.headers", &self.headers),
            ("source.columns.tenant", &self.tenant),
        ] {
            if let Some(column) = column {
                named.push((key, column.as_str()));
            }
        }
        named
    }
}

/// How a payload column is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PayloadKind {
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
}

const TEXT_TYPES: &[&str] = &["text", "character varying", "character", "name", "citext"];
const KEY_TYPES: &[&str] = &["uuid", "smallint", "integer", "bigint", "numeric"];

/// Checks `[source]` against the database: the table exists, every mapped
/// column exists with a usable type, the event id column is unique.
///
/// # Errors
/// Every mismatch, one line each; or the database error that stopped the check.
pub async fn check(pool: &PgPool, source: &SourceConfig) -> Result<Capture, CheckError> {
    // The bare name (regnamespace's text form would come quoted already).
    let outbox_schema: String = sqlx::query_scalar(
        "SELECT coalesce((SELECT n.nspname::text FROM pg_class c
                            JOIN pg_namespace n ON n.oid = c.relnamespace
                           WHERE c.oid = to_regclass('switchyard_outbox')),
                         current_schema())",
    )
    .fetch_one(pool)
    .await?;
    let qualified = match &source.schema {
        Some(schema) => format!("{}.{}", ident(schema), ident(&source.table)),
        None => ident(&source.table),
    };
    let table = sqlx::query(
        "SELECT c.oid::int8, c.relkind::text, n.nspname::text FROM pg_class c
           JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)",
    )
    .bind(&qualified)
    .fetch_optional(pool)
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
    .fetch_all(pool)
    .await?;
    let mut columns = BTreeMap::new();
    for row in rows {
        let name: String = row.try_get(0)?;
        let kind: String = row.try_get(1)?;
        let unique: bool = row.try_get(2)?;
        columns.insert(name, (kind, unique));
    }

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
    if !problems.is_empty() {
        return Err(CheckError::Mismatch(problems));
    }
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
    })
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

const TRIGGER: &str = "switchyard_capture";
const TRANSITION: &str = "switchyard_captured";

impl Capture {
    /// `schema.table`, quoted.
    pub fn table(&self) -> &str {
        &self.display
    }

    fn function(&self) -> String {
        let digest = Sha256::digest(self.display.as_bytes());
        let suffix: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
        format!("{}.switchyard_capture_{suffix}", ident(&self.outbox_schema))
    }

    fn try_jsonb(&self) -> String {
        format!("{}.switchyard_try_jsonb", ident(&self.outbox_schema))
    }

    /// `INSERT INTO switchyard_outbox ... SELECT ... FROM <from> AS s`: the
    /// copy of each row, as the trigger and the backfill make it.
    fn copy_sql(&self, from: &str, order_by: Option<&str>) -> String {
        let cols = &self.source.columns;
        let col = |name: &str| format!("s.{}", ident(name));
        let limit = |field: &str, name: &str, bytes: usize| {
            format!(
                "WHEN {c} IS NULL THEN {null}\n                        \
                 WHEN octet_length({c}::text) > {bytes} THEN format({long}, octet_length({c}::text))",
                c = col(name),
                null = literal(&format!("{field} (column {}) is NULL", ident(name))),
                // `format` reads `%` in the name as a placeholder.
                long = literal(&format!(
                    "{field} (column {}) is %s bytes; at most {bytes}",
                    ident(name).replace('%', "%%")
                )),
            )
        };
        let problem = format!(
            "CASE {}\n                        {}\n                        WHEN {et} IS NULL THEN {et_null} END",
            limit("aggregate_type", &cols.aggregate_type, 255),
            limit("aggregate_id", &cols.aggregate_id, 1024),
            et = col(&cols.event_type),
            et_null = literal(&format!(
                "event_type (column {}) is NULL",
                ident(&cols.event_type)
            )),
        );
        let (payload, payload_bytes) = match self.payload {
            PayloadKind::Jsonb => (col(&cols.payload), "NULL::bytea".to_string()),
            PayloadKind::Bytea => ("NULL::jsonb".to_string(), col(&cols.payload)),
            // Bytes only when it does not parse (see the outer SELECT).
            PayloadKind::JsonText => (
                format!("{}({}::text)", self.try_jsonb(), col(&cols.payload)),
                format!("convert_to({}::text, 'UTF8')", col(&cols.payload)),
            ),
        };
        let mut headers = match &cols.headers {
            Some(name) => format!("coalesce({}, '{{}}'::jsonb)", col(name)),
            None => "'{}'::jsonb".to_string(),
        };
        if !self.source.header_columns.is_empty() {
            let pairs: Vec<String> = self
                .source
                .header_columns
                .iter()
                .map(|(header, name)| format!("{}, {}::text", literal(header), col(name)))
                .collect();
            headers = format!(
                "{headers} || jsonb_strip_nulls(jsonb_build_object({}))",
                pairs.join(", ")
            );
        }
        let event_id = match &cols.event_id {
            Some(name) => format!("coalesce({}, gen_random_uuid())", col(name)),
            None => "gen_random_uuid()".to_string(),
        };
        let tenant = cols
            .tenant
            .as_deref()
            .map_or("NULL::text".to_string(), |name| format!("{}::text", col(name)));
        let order = order_by.map_or(String::new(), |name| format!("\n     ORDER BY {}", col(name)));
        // A row that cannot be relayed keeps its place as a dead letter
        // (keys cut to fit the outbox's bounds) rather than fail the writer.
        // OFFSET 0 keeps the subquery whole: the parse attempt, a
        // subtransaction, runs once per row, not once per reference. An
        // event id already copied is the same event (a writer that deleted
        // its row and wrote it again, or a second backfill): not copied
        // twice, and the writer's INSERT does not fail on it.
        format!(
            "INSERT INTO {outbox}.switchyard_outbox
        (event_id, aggregate_type, aggregate_id, event_type, payload, payload_bytes,
         headers, tenant, status, last_error)
    SELECT c.event_id,
           CASE WHEN c.problem IS NULL THEN c.aggregate_type ELSE left(coalesce(c.aggregate_type, ''), 60) END,
           CASE WHEN c.problem IS NULL THEN c.aggregate_id ELSE left(coalesce(c.aggregate_id, ''), 250) END,
           coalesce(c.event_type, ''), c.payload,
           CASE WHEN c.payload IS NULL THEN c.payload_bytes END, c.headers, c.tenant,
           CASE WHEN c.problem IS NULL THEN 'pending' ELSE 'dead' END,
           {where_from} || c.problem
      FROM (SELECT {event_id} AS event_id,
                   {aggregate_type}::text AS aggregate_type,
                   {aggregate_id}::text AS aggregate_id,
                   {event_type}::text AS event_type,
                   {payload} AS payload,
                   {payload_bytes} AS payload_bytes,
                   {headers} AS headers,
                   {tenant} AS tenant,
                   {problem} AS problem
              FROM {from} AS s{order}
            OFFSET 0) AS c
    ON CONFLICT (event_id) DO NOTHING",
            outbox = ident(&self.outbox_schema),
            where_from = literal(&format!("cannot be relayed from {}: ", self.display)),
            aggregate_type = col(&cols.aggregate_type),
            aggregate_id = col(&cols.aggregate_id),
            event_type = col(&cols.event_type),
        )
    }

    /// The trigger and its functions, without the version comment.
    fn definition(&self) -> String {
        let outbox = ident(&self.outbox_schema);
        // A subtransaction per row, only for payloads that may not parse.
        let try_jsonb = if self.payload == PayloadKind::JsonText {
            format!(
                "-- JSON text that jsonb refuses (malformed, or \\u0000) is carried as bytes.
CREATE OR REPLACE FUNCTION {}(value text) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $switchyard$
BEGIN
    RETURN value::jsonb;
EXCEPTION WHEN others THEN
    RETURN NULL;
END;
$switchyard$;

",
                self.try_jsonb()
            )
        } else {
            String::new()
        };
        format!(
            "-- Capture: every row inserted into {table} is copied into
-- {outbox}.switchyard_outbox in the same transaction, once per statement.
-- SECURITY DEFINER: writers need no privilege on the relay's table.
{try_jsonb}CREATE OR REPLACE FUNCTION {function}() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $switchyard$
BEGIN
    {copy};
    RETURN NULL;
END;
$switchyard$;

DROP TRIGGER IF EXISTS {TRIGGER} ON {table};
CREATE TRIGGER {TRIGGER} AFTER INSERT ON {table}
    REFERENCING NEW TABLE AS {TRANSITION}
    FOR EACH STATEMENT EXECUTE FUNCTION {function}();
",
            table = self.display,
            function = self.function(),
            copy = self.copy_sql(TRANSITION, None),
        )
    }

    /// Identifies the installed trigger's mapping: a hash of its SQL.
    fn version(&self) -> String {
        let digest = Sha256::digest(self.definition().as_bytes());
        digest[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    fn comment(&self) -> String {
        format!("switchyard capture {}", self.version())
    }

    /// The statements `migrate` runs, in one transaction: lock out writers
    /// for the instant of the swap, so no row is copied twice or missed
    /// between the trigger and a backfill; then the trigger; then, with
    /// `backfill`, a copy of the rows already there.
    pub fn install_sql(&self, backfill: bool) -> Vec<String> {
        let mut statements = vec![
            format!(
                "-- Writers wait for this transaction (a moment), so the backfill and the\n\
                 -- trigger see every row exactly once.\n\
                 LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE",
                self.display
            ),
            self.definition(),
            format!(
                "COMMENT ON TRIGGER {TRIGGER} ON {} IS {}",
                self.display,
                literal(&self.comment())
            ),
        ];
        if backfill {
            statements.push(format!(
                "-- Backfill: the rows already in {}.\n{}",
                self.display,
                self.copy_sql(&self.display, self.source.order_by.as_deref())
            ));
        }
        statements
    }

    /// Whether the trigger this mapping makes is the one installed.
    ///
    /// # Errors
    /// The database's.
    pub async fn installed(&self, pool: &PgPool) -> Result<Installed, sqlx::Error> {
        let trigger: Option<(Option<String>, bool)> = sqlx::query_as(
            "SELECT obj_description(t.oid, 'pg_trigger'), t.tgenabled <> 'D' FROM pg_trigger t
              WHERE t.tgrelid = to_regclass($1) AND t.tgname = $2",
        )
        .bind(&self.display)
        .bind(TRIGGER)
        .fetch_optional(pool)
        .await?;
        Ok(match trigger {
            None => Installed::Missing,
            Some((_, false)) => Installed::Disabled,
            Some((Some(comment), true)) if comment == self.comment() => Installed::Current,
            Some(_) => Installed::Outdated,
        })
    }

    /// What is wrong with the installed trigger, said for an operator
    /// (`None`: nothing). Rows written meanwhile stay in the services' table
    /// and are not relayed.
    ///
    /// # Errors
    /// The database's.
    pub async fn problem(&self, pool: &PgPool) -> Result<Option<String>, sqlx::Error> {
        let fix = "review `switchyard migrate --dry-run --config FILE`, then run `switchyard migrate --config FILE`";
        let table = &self.display;
        Ok(match self.installed(pool).await? {
            Installed::Current => None,
            Installed::Missing => Some(format!(
                "{table} has no capture trigger, so no row written there is relayed: {fix}"
            )),
            Installed::Outdated => Some(format!(
                "the capture trigger on {table} was made from another [source] mapping: {fix}"
            )),
            Installed::Disabled => Some(format!(
                "the capture trigger on {table} is disabled, so no row written there is relayed: \
                 ALTER TABLE {table} ENABLE TRIGGER {TRIGGER}, then copy what was written \
                 meanwhile (rows inserted while it was off are not in switchyard_outbox)"
            )),
        })
    }

    /// Installs (or replaces) the trigger, with an optional backfill, in one
    /// transaction. Returns the rows backfilled.
    ///
    /// # Errors
    /// The database's (e.g. the role does not own the table).
    pub async fn install(&self, pool: &PgPool, backfill: bool) -> Result<u64, sqlx::Error> {
        let mut tx = pool.begin().await?;
        // Not "trigger ... does not exist, skipping" on every first install.
        sqlx::query("SET LOCAL client_min_messages = warning")
            .execute(&mut *tx)
            .await?;
        let mut copied = 0;
        for (index, statement) in self.install_sql(backfill).iter().enumerate() {
            // The definition is several statements: the simple protocol.
            let done = sqlx::raw_sql(statement).execute(&mut *tx).await?;
            if backfill && index == 3 {
                copied = done.rows_affected();
            }
        }
        tx.commit().await?;
        Ok(copied)
    }
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

    #[test]
    fn static_checks_name_the_key() {
        let mut source = debezium();
        source.columns.aggregate_id = String::new();
        source.header_columns.insert("bad:name".into(), "x".repeat(64));
        let problems = static_problems(&source, "sqlite:x.db");
        assert_eq!(problems.len(), 4, "{problems:?}");
        assert!(problems[0].contains("PostgreSQL only"));
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("source.columns.aggregate_id: is empty"))
        );
        assert!(problems.iter().any(|p| p.contains("not a header name")));
        assert!(
            problems
                .iter()
                .any(|p| p.contains("longer than PostgreSQL's 63-byte names"))
        );
    }
}
