//! What the WAL carries, as rows for the stages: an insert into the
//! outbox table, an event written by `switchyard_emit` (an insert into a
//! `[source]` table: `source`). A value that cannot be read makes a malformed row
//! (dead-lettered with the reason), never a lost event or a stuck stream.

use pgwire_replication::Lsn;

use super::pgoutput::Inserted;
use super::source::position_event_id;
use crate::store::change_stream::{StreamedRow, StreamedText};
use crate::store::types::{OutboxRow, RowId};

/// An insert as an outbox row. A value that cannot be read makes the row
/// malformed (dead-lettered with the reason), as the claim does.
pub(super) fn streamed_row(mut inserted: Inserted) -> StreamedRow {
    let mut take = |column: &str| inserted.take(column);
    let mut problem: Option<String> = None;
    let id = take("id").and_then(|v| v.parse().ok()).unwrap_or_default();
    let event_id_text = take("event_id").unwrap_or_default();
    let event_id = uuid::Uuid::parse_str(&event_id_text).unwrap_or_else(|_| {
        problem.get_or_insert_with(|| format!("event_id {event_id_text:?} is not a UUID"));
        uuid::Uuid::nil()
    });
    let created_at = take("created_at");
    let created_at_ms = created_at.as_deref().and_then(timestamp_ms);
    if created_at_ms.is_none() {
        problem
            .get_or_insert_with(|| "created_at is -infinity or infinity; it must be a point in time".into());
    }
    let not_before = take("not_before");
    let payload_bytes_text = take("payload_bytes");
    let payload_bytes = match payload_bytes_text.as_deref().map(hex_bytea) {
        Some(Some(bytes)) => Some(bytes),
        Some(None) => {
            problem.get_or_insert_with(|| "payload_bytes is not in hex form".into());
            None
        }
        None => None,
    };
    let row = OutboxRow {
        id: RowId(id),
        event_id,
        aggregate_type: take("aggregate_type").unwrap_or_default(),
        aggregate_id: take("aggregate_id").unwrap_or_default(),
        event_type: take("event_type").unwrap_or_default(),
        payload_json: take("payload"),
        payload_bytes,
        headers_json: take("headers").unwrap_or_else(|| "{}".into()),
        tenant: take("tenant"),
        created_at_ms: created_at_ms.unwrap_or_default(),
        attempts: 1,
        deliveries: std::collections::BTreeMap::new(),
        held_by: Vec::new(),
        malformed: problem,
    };
    StreamedRow {
        row,
        not_before_ms: not_before.as_deref().and_then(timestamp_ms),
        text: StreamedText {
            payload_bytes: payload_bytes_text,
            created_at,
            not_before,
        },
        id_at_handover: false,
    }
}

/// An event's fields as `switchyard_emit` writes them, on the message's
/// first line.
#[derive(serde::Deserialize)]
struct Emitted<'a> {
    id: i64,
    event_id: uuid::Uuid,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    #[serde(borrow)]
    headers: Option<&'a serde_json::value::RawValue>,
    tenant: Option<String>,
    created_at: String,
    /// What follows the line: `json`, `hex` (bytes) or nothing.
    body: Option<&'a str>,
}

/// An event's fields, and its payload as JSON or bytes (`hex` kept as the
/// table takes it).
type ReadEmitted<'a> = (Emitted<'a>, i64, Option<String>, Option<(Vec<u8>, String)>);

/// Why a message under the event prefix is not an event.
#[derive(Debug, thiserror::Error)]
enum NotAnEvent {
    #[error("no line break after the fields")]
    NoFieldLine,
    #[error("{0}")]
    Fields(#[from] serde_json::Error),
    #[error("created_at {text:?}: {error}")]
    CreatedAt { text: String, error: chrono::ParseError },
    #[error("the payload is not UTF-8")]
    NotUtf8,
    #[error("the payload bytes are not hex")]
    NotHex,
}

/// Reads a `switchyard_emit` message.
fn read_emitted(content: &[u8]) -> Result<ReadEmitted<'_>, NotAnEvent> {
    let split = content
        .iter()
        .position(|&b| b == b'\n')
        .ok_or(NotAnEvent::NoFieldLine)?;
    let (fields, body) = (&content[..split], &content[split + 1..]);
    let emitted: Emitted<'_> = serde_json::from_slice(fields)?;
    let created = chrono::DateTime::parse_from_rfc3339(&emitted.created_at)
        .map_err(|error| NotAnEvent::CreatedAt {
            text: emitted.created_at.clone(),
            error,
        })?
        .timestamp_millis();
    let body = std::str::from_utf8(body).map_err(|_| NotAnEvent::NotUtf8)?;
    let (json, bytes) = match emitted.body {
        Some("json") => (Some(body.to_string()), None),
        Some("hex") => {
            let text = format!("\\x{body}");
            let bytes = hex_bytea(&text).ok_or(NotAnEvent::NotHex)?;
            (None, Some((bytes, text)))
        }
        _ => (None, None),
    };
    Ok((emitted, created, json, bytes))
}

/// An event written by `switchyard_emit`. Content that is not an event is
/// dead-lettered with the reason, its bytes kept.
pub(super) fn emitted_row(lsn: Lsn, content: &[u8]) -> StreamedRow {
    let (row, text) = match read_emitted(content) {
        Ok((emitted, created_at_ms, payload_json, bytes)) => {
            let (payload_bytes, bytes_text) = bytes.unzip();
            (
                OutboxRow {
                    id: RowId(emitted.id),
                    event_id: emitted.event_id,
                    aggregate_type: emitted.aggregate_type,
                    aggregate_id: emitted.aggregate_id,
                    event_type: emitted.event_type,
                    payload_json,
                    payload_bytes,
                    headers_json: emitted
                        .headers
                        .map_or_else(|| "{}".into(), |raw| raw.get().to_string()),
                    tenant: emitted.tenant,
                    created_at_ms,
                    attempts: 1,
                    deliveries: std::collections::BTreeMap::new(),
                    held_by: Vec::new(),
                    malformed: None,
                },
                StreamedText {
                    payload_bytes: bytes_text,
                    created_at: Some(emitted.created_at),
                    not_before: None,
                },
            )
        }
        Err(why) => {
            let (row, text) = unreadable_message(lsn, content, &why);
            return StreamedRow {
                row,
                text,
                not_before_ms: None,
                id_at_handover: true,
            };
        }
    };
    StreamedRow {
        row,
        text,
        not_before_ms: None,
        id_at_handover: false,
    }
}

/// A message under the event prefix that is not an event: an aggregate of
/// its own (it holds nothing back), its content kept as the payload bytes.
/// Its stand-in id is its position, negated so that it never meets a row's.
fn unreadable_message(lsn: Lsn, content: &[u8], why: &NotAnEvent) -> (OutboxRow, StreamedText) {
    let position = i64::try_from(lsn.as_u64()).unwrap_or(i64::MAX);
    let hex: String = content.iter().map(|b| format!("{b:02x}")).collect();
    let row = OutboxRow {
        id: RowId(-position),
        // The same id whenever the message is read again: a replay finds
        // the dead letter it left the first time.
        event_id: position_event_id(lsn.as_u64()),
        aggregate_type: super::EMIT_PREFIX.into(),
        aggregate_id: lsn.to_string(),
        event_type: "unreadable".into(),
        payload_json: None,
        payload_bytes: Some(content.to_vec()),
        headers_json: "{}".into(),
        tenant: None,
        created_at_ms: chrono::Utc::now().timestamp_millis(),
        attempts: 1,
        deliveries: std::collections::BTreeMap::new(),
        held_by: Vec::new(),
        malformed: Some(format!(
            "the message at {lsn} with prefix {:?} is not an event written by switchyard_emit: {why}",
            super::EMIT_PREFIX
        )),
    };
    let text = StreamedText {
        payload_bytes: Some(format!("\\x{hex}")),
        created_at: None,
        not_before: None,
    };
    (row, text)
}

/// A `timestamptz` in ISO form at UTC (`2026-11-25 16:55:01.123456+00`), in
/// ms since the epoch; `None` for infinities and anything else.
fn timestamp_ms(text: &str) -> Option<i64> {
    chrono::DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
        .ok()
        .map(|t| t.timestamp_millis())
}

/// A `bytea` in hex form (`\x0aff`).
pub(super) fn hex_bytea(text: &str) -> Option<Vec<u8>> {
    let hex = text.strip_prefix("\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_read_as_the_table_has_them() {
        assert_eq!(timestamp_ms("1970-01-01 00:00:01.5+00"), Some(1500));
        assert_eq!(timestamp_ms("2026-11-25 16:55:01+00"), Some(1_795_625_701_000));
        assert_eq!(timestamp_ms("infinity"), None);
        assert_eq!(hex_bytea("\\x00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(hex_bytea("\\x0"), None);
        assert_eq!(hex_bytea("00"), None);
    }

    #[test]
    fn an_unreadable_value_makes_the_row_malformed_not_lost() {
        let values = [
            ("id", Some("42")),
            ("event_id", Some("not-a-uuid")),
            ("aggregate_type", Some("order")),
            ("aggregate_id", Some("1")),
            ("event_type", Some("created")),
            ("payload", Some("{\"a\": 1}")),
            ("created_at", Some("2026-11-25 16:55:01+00")),
        ];
        let inserted = Inserted {
            relation: std::sync::Arc::new(super::super::pgoutput::RelationInfo {
                table: "public.switchyard_outbox".into(),
                columns: values.iter().map(|(k, _)| (*k).to_string()).collect(),
            }),
            values: values.iter().map(|(_, v)| v.map(str::to_string)).collect(),
        };
        let streamed = streamed_row(inserted);
        assert_eq!(streamed.row.id, RowId(42));
        assert_eq!(streamed.row.attempts, 1);
        assert_eq!(streamed.row.payload_json.as_deref(), Some("{\"a\": 1}"));
        assert_eq!(streamed.row.headers_json, "{}");
        let why = streamed.row.malformed.expect("malformed");
        assert!(why.contains("not-a-uuid"), "{why}");
    }

    #[test]
    fn an_emitted_event_is_its_fields_line_then_its_payload_unparsed() {
        let fields = r#"{"id": 7, "event_id": "0b7e2a4c-4b8e-4d0e-9a57-1f2f4e0b9c11", "aggregate_type": "order", "aggregate_id": "o-1", "event_type": "OrderPaid", "headers": {"traceparent": "00-ab"}, "tenant": null, "created_at": "2026-11-25T19:49:37.5+00:00", "body": "#;
        let json = emitted_row(
            Lsn::from_u64(9),
            format!("{fields}\"json\"}}\n{{\"total\": 1}}").as_bytes(),
        );
        assert_eq!(json.row.malformed, None);
        assert_eq!(json.row.id, RowId(7));
        assert!(!json.id_at_handover);
        assert_eq!(json.row.payload_json.as_deref(), Some("{\"total\": 1}"));
        assert_eq!(json.row.headers_json, r#"{"traceparent": "00-ab"}"#);
        assert_eq!(json.row.created_at_ms, 1_795_636_177_500);
        let bytes = emitted_row(Lsn::from_u64(9), format!("{fields}\"hex\"}}\n00ff").as_bytes());
        assert_eq!(bytes.row.payload_bytes.as_deref(), Some(&[0u8, 255][..]));
        assert_eq!(bytes.text.payload_bytes.as_deref(), Some("\\x00ff"));
        // No line break, or a body that is not what it says: a dead letter.
        for broken in [format!("{fields}\"json\"}}"), format!("{fields}\"hex\"}}\nzz")] {
            let row = emitted_row(Lsn::from_u64(9), broken.as_bytes());
            assert!(row.row.malformed.is_some(), "{broken}");
            assert!(row.id_at_handover, "a stand-in id: the table gives it one");
        }
    }
}
