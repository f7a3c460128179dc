//! A `[source]` table read from the WAL: the services' own outbox
//! published as it is, each insert made an event with the capture
//! trigger's checks and messages, and a stand-in id until the table gives
//! it one.

use std::collections::BTreeMap;

use super::events::hex_bytea;
use super::pgoutput::Inserted;
use crate::config::source::SourceColumns;
use crate::store::change_stream::{StreamedRow, StreamedText};
use crate::store::postgres::capture::{Capture, PayloadKind};
use crate::store::types::{OutboxRow, RowId};

/// A `[source]` table as replication mode reads it: the services' own
/// outbox, published as it is, with no trigger and no copy.
#[derive(Debug, Clone)]
pub struct SourceTable {
    /// `schema.table` as the WAL names it (unquoted).
    pub(crate) relation: String,
    /// The same, quoted, for messages and SQL.
    pub(crate) display: String,
    columns: SourceColumns,
    header_columns: BTreeMap<String, String>,
    payload: PayloadKind,
}

impl SourceTable {
    /// The table of a checked `[source]` mapping.
    pub fn new(capture: &Capture) -> SourceTable {
        let (schema, table) = capture.schema_and_table();
        SourceTable {
            relation: format!("{schema}.{table}"),
            display: capture.table().to_string(),
            columns: capture.source().columns.clone(),
            header_columns: capture.source().header_columns.clone(),
            payload: capture.payload_kind(),
        }
    }

    /// Schema and table, unquoted.
    pub(crate) fn schema_and_table(&self) -> (&str, &str) {
        self.relation.split_once('.').unwrap_or(("", &self.relation))
    }

    /// The columns an event is made of, each once, in name order: all the
    /// publication sends of the table.
    pub(crate) fn published_columns(&self) -> Vec<String> {
        let mut columns: Vec<String> = self
            .columns
            .named()
            .into_iter()
            .map(|(_, column)| column.to_string())
            .chain(self.header_columns.values().cloned())
            .collect();
        columns.sort();
        columns.dedup();
        columns
    }
}

/// An insert into the `[source]` table. Its stand-in id is `position`
/// negated (unique in the stream, never a row's); its event id is its
/// event id column, else one made from its position, the same whenever it
/// is read again. Checks and messages are the capture trigger's: a row
/// that cannot be relayed is a dead letter that says which column, with its
/// keys cut to fit the table.
pub(super) fn source_row(
    inserted: &Inserted,
    source: &SourceTable,
    position: u64,
    committed_ms: i64,
) -> StreamedRow {
    let columns = &source.columns;
    let value = |name: &str| inserted.get(name).map(str::to_string);
    let mut problems: Vec<String> = Vec::new();
    let mut key = |field: &str, name: &str, bytes: usize| match value(name) {
        None => {
            problems.push(format!("{field} (column {name:?}) is NULL"));
            String::new()
        }
        Some(text) if text.len() > bytes => {
            problems.push(format!(
                "{field} (column {name:?}) is {} bytes; at most {bytes}",
                text.len()
            ));
            text
        }
        Some(text) => text,
    };
    let mut aggregate_type = key("aggregate_type", &columns.aggregate_type, 255);
    let mut aggregate_id = key("aggregate_id", &columns.aggregate_id, 1024);
    let event_type = key("event_type", &columns.event_type, usize::MAX);
    let event_id = columns
        .event_id
        .as_deref()
        .and_then(value)
        .and_then(|text| uuid::Uuid::parse_str(&text).ok())
        .unwrap_or_else(|| position_event_id(position));
    let (payload_json, payload_bytes) = source_payload(value(&columns.payload), source.payload);
    let headers = match source_headers(
        columns.headers.as_deref().and_then(value),
        &source.header_columns,
        &value,
    ) {
        Ok(headers) => headers,
        Err(why) => {
            problems.push(why.to_string());
            "{}".into()
        }
    };
    let malformed = (!problems.is_empty()).then(|| {
        format!(
            "cannot be relayed from {}: {}",
            source.display,
            problems.join("; ")
        )
    });
    if malformed.is_some() {
        // What the table takes: a dead letter must fit to be recorded.
        aggregate_type = aggregate_type.chars().take(60).collect();
        aggregate_id = aggregate_id.chars().take(250).collect();
    }
    let created_at = chrono::DateTime::from_timestamp_millis(committed_ms)
        .unwrap_or_default()
        .to_rfc3339();
    let bytes_text = payload_bytes.as_ref().map(|bytes| {
        format!(
            "\\x{}",
            bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
        )
    });
    StreamedRow {
        row: OutboxRow {
            id: RowId(-i64::try_from(position).unwrap_or(i64::MAX)),
            event_id,
            aggregate_type,
            aggregate_id,
            event_type,
            payload_json,
            payload_bytes,
            headers_json: headers,
            tenant: columns.tenant.as_deref().and_then(value),
            created_at_ms: committed_ms,
            attempts: 1,
            deliveries: std::collections::BTreeMap::new(),
            held_by: Vec::new(),
            malformed,
        },
        text: StreamedText {
            payload_bytes: bytes_text,
            created_at: Some(created_at),
            not_before: None,
        },
        not_before_ms: None,
        id_at_handover: true,
    }
}

/// An event id made from a WAL position.
pub(super) fn position_event_id(position: u64) -> uuid::Uuid {
    uuid::Uuid::from_u64_pair(0x7377_6974_6368_7964, position)
}

/// The payload column's text as JSON or bytes, as the trigger reads it: a
/// `json` or text value that `jsonb` would not take is carried as bytes.
fn source_payload(text: Option<String>, kind: PayloadKind) -> (Option<String>, Option<Vec<u8>>) {
    let Some(text) = text else {
        return (None, None);
    };
    match kind {
        PayloadKind::Jsonb => (Some(text), None),
        PayloadKind::Bytea => (None, hex_bytea(&text)),
        PayloadKind::JsonText => {
            let json = serde_json::from_str::<&serde_json::value::RawValue>(&text).is_ok()
                && !text.contains("\\u0000");
            if json {
                (Some(text), None)
            } else {
                (None, Some(text.into_bytes()))
            }
        }
    }
}

/// The headers column holds something other than a JSON object.
#[derive(Debug, thiserror::Error)]
#[error("headers is not a JSON object")]
struct HeadersNotAnObject;

/// The headers column's object with the header columns' values added
/// (NULLs send no header).
fn source_headers(
    column: Option<String>,
    header_columns: &BTreeMap<String, String>,
    value: &dyn Fn(&str) -> Option<String>,
) -> Result<String, HeadersNotAnObject> {
    if header_columns.is_empty() {
        return Ok(column.unwrap_or_else(|| "{}".into()));
    }
    let mut headers = match column {
        Some(text) => serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&text)
            .map_err(|_| HeadersNotAnObject)?,
        None => serde_json::Map::new(),
    };
    for (header, name) in header_columns {
        if let Some(text) = value(name) {
            headers.insert(header.clone(), serde_json::Value::String(text));
        }
    }
    Ok(serde_json::Value::Object(headers).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn debezium_table(payload: PayloadKind) -> SourceTable {
        SourceTable {
            relation: "public.outbox".into(),
            display: "\"public\".\"outbox\"".into(),
            columns: SourceColumns {
                event_id: None,
                aggregate_type: "aggregatetype".into(),
                aggregate_id: "aggregateid".into(),
                event_type: "type".into(),
                payload: "payload".into(),
                headers: None,
                tenant: None,
            },
            header_columns: [("traceparent".to_string(), "span".to_string())].into(),
            payload,
        }
    }

    fn insert(values: &[(&str, Option<&str>)]) -> Inserted {
        Inserted {
            relation: std::sync::Arc::new(super::super::pgoutput::RelationInfo {
                table: "public.outbox".into(),
                columns: values.iter().map(|(k, _)| (*k).to_string()).collect(),
            }),
            values: values.iter().map(|(_, v)| v.map(str::to_string)).collect(),
        }
    }

    #[test]
    fn a_source_row_is_read_as_the_capture_trigger_copies_it() {
        let table = debezium_table(PayloadKind::JsonText);
        let row = insert(&[
            ("aggregatetype", Some("order")),
            ("aggregateid", Some("o-1")),
            ("type", Some("OrderPaid")),
            ("payload", Some("not json")),
            ("span", Some("00-ab-cd-01")),
        ]);
        let first = source_row(&row, &table, 100, 1_000);
        assert_eq!(first.row.malformed, None);
        assert_eq!(
            first.row.payload_json, None,
            "text that is not JSON travels as bytes"
        );
        assert_eq!(first.row.payload_bytes.as_deref(), Some(&b"not json"[..]));
        assert_eq!(first.text.payload_bytes.as_deref(), Some("\\x6e6f74206a736f6e"));
        assert_eq!(first.row.headers_json, r#"{"traceparent":"00-ab-cd-01"}"#);
        assert_eq!(first.row.id, RowId(-100));
        assert!(first.id_at_handover);
        // Read again (a replay), the same event id: consumers and the table deduplicate it.
        assert_eq!(
            source_row(&row, &table, 100, 1_000).row.event_id,
            first.row.event_id
        );
        assert_ne!(
            source_row(&row, &table, 101, 1_000).row.event_id,
            first.row.event_id
        );
    }

    #[test]
    fn a_source_row_that_cannot_be_relayed_is_a_dead_letter_that_fits_the_table() {
        let table = debezium_table(PayloadKind::Jsonb);
        let long = "x".repeat(2000);
        let row = insert(&[
            ("aggregatetype", None),
            ("aggregateid", Some(long.as_str())),
            ("type", Some("OrderPaid")),
            ("payload", Some("{}")),
            ("span", None),
        ]);
        let streamed = source_row(&row, &table, 7, 0);
        let why = streamed.row.malformed.expect("malformed");
        assert!(
            why.starts_with("cannot be relayed from \"public\".\"outbox\": "),
            "{why}"
        );
        assert!(
            why.contains("aggregate_type (column \"aggregatetype\") is NULL"),
            "{why}"
        );
        assert!(
            why.contains("aggregate_id (column \"aggregateid\") is 2000 bytes; at most 1024"),
            "{why}"
        );
        assert_eq!(streamed.row.aggregate_id.len(), 250);
        assert_eq!(
            streamed.row.headers_json, "{}",
            "a NULL header column sends no header"
        );
    }
}
