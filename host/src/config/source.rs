//! `[source]`: an outbox table the services already write, and which of
//! its columns hold the event's fields. Checked here for what needs no
//! database; the PostgreSQL store checks it against the live table and
//! generates the capture trigger (`store::capture`).

use std::collections::BTreeMap;

use serde::Deserialize;

/// `[source]`: an existing outbox table and which of its columns hold what.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
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
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
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
    if ["sqlite:", "mysql://", "mariadb://"]
        .iter()
        .any(|scheme| database_url.starts_with(scheme))
    {
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
    pub(crate) fn named(&self) -> Vec<(&'static str, &str)> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_checks_name_the_key() {
        let mut source: SourceConfig = toml::from_str(
            r#"
            table = "outbox"
            [columns]
            aggregate_type = "aggregatetype"
            aggregate_id = "aggregateid"
            event_type = "type"
            payload = "payload"
            "#,
        )
        .unwrap();
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
