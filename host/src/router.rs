//! Pure, synchronous routing logic around the plugin call: turning a claimed
//! row into the plugin's `event`, checking what the plugin returned, and
//! assembling broker messages with the relay's headers. No I/O here, so every
//! rule is unit-tested directly.

use bytes::Bytes;

use crate::plugin::{Event, Message, PayloadFormat};
use crate::sinks::OutgoingMessage;
use crate::store::{DeliveryKey, OutboxRow};
use crate::trace::TraceParent;

/// Header with the event id, on every message and every broker.
pub const EVENT_ID_HEADER: &str = "Switchyard-Event-Id";
/// Header with the event type.
pub const EVENT_TYPE_HEADER: &str = "Switchyard-Event-Type";
/// Header with the aggregate type.
pub const AGGREGATE_TYPE_HEADER: &str = "Switchyard-Aggregate-Type";
/// Header with the aggregate id.
pub const AGGREGATE_ID_HEADER: &str = "Switchyard-Aggregate-Id";
/// Header naming the plugin version (`name@hash`) that routed the event.
pub const PLUGIN_HEADER: &str = "Switchyard-Plugin";

/// Limits applied to rows and plugin output.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest payload passed to a plugin.
    pub max_payload_bytes: usize,
    /// Largest message payload a plugin may return.
    pub max_message_bytes: usize,
    /// Most messages a plugin may return for one event.
    pub max_messages_per_event: usize,
    /// Longest topic or subject a plugin may return, in bytes. Brokers
    /// refuse longer ones (NATS closes the connection on a control line
    /// over 4 KiB, dropping whatever else it carried).
    pub max_topic_bytes: usize,
}

impl Limits {
    /// Most messages one event may fan out to.
    pub const MAX_MESSAGES_PER_EVENT: usize = 64;
    /// Longest topic or subject, in bytes.
    pub const MAX_TOPIC_BYTES: usize = 1024;
    /// Most headers a plugin may set on one message.
    pub const MAX_HEADERS: usize = 256;

    /// The limits a relay with `config` enforces.
    pub fn from_config(config: &crate::config::RelayConfig) -> Limits {
        Limits {
            max_payload_bytes: config.max_payload_bytes,
            max_message_bytes: config.max_message_bytes,
            max_messages_per_event: Self::MAX_MESSAGES_PER_EVENT,
            max_topic_bytes: Self::MAX_TOPIC_BYTES,
        }
    }
}

/// Builds the plugin's view of a row.
///
/// # Errors
/// A specific reason when the row cannot be routed at all (NULL or oversized
/// payload, malformed headers); such rows are dead-lettered.
pub fn event_from_row(row: &OutboxRow, limits: &Limits) -> Result<Event, String> {
    if let Some(reason) = &row.malformed {
        return Err(reason.clone());
    }
    let (payload, payload_format) = match (&row.payload_bytes, &row.payload_json) {
        (Some(bytes), _) => (bytes.clone(), PayloadFormat::Binary),
        (None, Some(json)) => (json.clone().into_bytes(), PayloadFormat::Json),
        (None, None) => {
            return Err("payload is NULL (set payload or payload_bytes)".to_string());
        }
    };
    if payload.len() > limits.max_payload_bytes {
        return Err(crate::store::payload_over_limit(
            payload.len(),
            limits.max_payload_bytes,
        ));
    }
    Ok(Event {
        row_id: row.id.0,
        event_id: row.event_id.to_string(),
        aggregate_type: row.aggregate_type.clone(),
        aggregate_id: row.aggregate_id.clone(),
        event_type: row.event_type.clone(),
        payload,
        payload_format,
        headers: parse_row_headers(&row.headers_json)?,
        tenant: row.tenant.clone(),
        created_at_ms: row.created_at_ms,
        attempt: u32::try_from(row.attempts).unwrap_or(0),
    })
}

/// Parses the `headers` column: a JSON object whose values are strings.
///
/// # Errors
/// What is wrong with it.
pub fn parse_row_headers(json: &str) -> Result<Vec<(String, String)>, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("headers column is not valid JSON: {e}"))?;
    let object = value
        .as_object()
        .ok_or_else(|| format!("headers column must be a JSON object, got {}", json_kind(&value)))?;
    object
        .iter()
        .map(|(name, value)| match value {
            serde_json::Value::String(text) => {
                check_header(name, text).map(|()| (name.clone(), text.clone()))
            }
            other => Err(format!(
                "headers column: header {name:?} must be a string, got {}",
                json_kind(other)
            )),
        })
        .collect()
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn check_header(name: &str, value: &str) -> Result<(), String> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
        return Err(format!(
            "header name {name:?} is invalid (printable ASCII without ':' or spaces)"
        ));
    }
    if value.contains(['\r', '\n', '\0']) {
        return Err(format!("header {name:?} has a line break or NUL in its value"));
    }
    Ok(())
}

/// A checked message with the key that tracks its delivery across attempts.
#[derive(Debug, Clone)]
pub struct Routed {
    /// Target name.
    pub target: String,
    /// Stable across attempts as long as the plugin answers the same way.
    pub delivery_key: DeliveryKey,
    /// The message for the sink.
    pub message: OutgoingMessage,
}

impl Routed {
    /// Moves the message out for sending, leaving its topic behind for the
    /// delivery record (the payload is not copied).
    pub fn take_message(&mut self) -> OutgoingMessage {
        let topic = self.message.topic.clone();
        std::mem::replace(
            &mut self.message,
            OutgoingMessage {
                topic,
                ..OutgoingMessage::default()
            },
        )
    }
}

/// Checks a plugin's answer and assembles broker messages.
///
/// `target` answers for a target name: `None` when no such target is
/// configured, else whether it deduplicates by message id (JetStream), so
/// that messages sharing such a broker get distinct ids. `plugin_label` is
/// `name@version`, used in errors and the plugin header.
///
/// # Errors
/// A reason naming the plugin and the offending message; the row is dead-lettered.
pub fn assemble(
    event: &Event,
    messages: Vec<Message>,
    plugin_label: &str,
    limits: &Limits,
    target: &dyn Fn(&str) -> Option<bool>,
    trace: Option<&TraceParent>,
) -> Result<Vec<Routed>, String> {
    let traceparent = trace.map(ToString::to_string);
    if messages.len() > limits.max_messages_per_event {
        return Err(format!(
            "plugin {plugin_label} returned {} messages, more than the {} allowed per event",
            messages.len(),
            limits.max_messages_per_event
        ));
    }
    // A message keeps the bare event id as its broker dedup id unless the
    // event sends several messages to deduplicating targets: those may share
    // one stream (two targets, or two subjects it captures), so each gets its
    // delivery key appended.
    let deduplicated = messages
        .iter()
        .filter(|m| target(&m.target).unwrap_or(false))
        .count();
    let several = deduplicated > 1;
    // Plugins return a handful of messages; counting by scanning beats maps.
    let ordinals: Vec<usize> = messages
        .iter()
        .enumerate()
        .map(|(index, m)| {
            messages[..index]
                .iter()
                .filter(|earlier| earlier.target == m.target && earlier.topic == m.topic)
                .count()
        })
        .collect();
    let mut routed = Vec::with_capacity(messages.len());
    for ((index, message), ordinal) in messages.into_iter().enumerate().zip(ordinals) {
        let at = || format!("plugin {plugin_label} message {index}");
        if target(&message.target).is_none() {
            return Err(format!("{}: unknown target {:?}", at(), message.target));
        }
        if message.topic.trim().is_empty() {
            return Err(format!("{}: empty topic for target {:?}", at(), message.target));
        }
        if message.topic.chars().any(char::is_control) {
            return Err(format!(
                "{}: topic {:?} for target {:?} contains a control character",
                at(),
                message.topic,
                message.target
            ));
        }
        if message.topic.len() > limits.max_topic_bytes {
            return Err(format!(
                "{}: topic for target {:?} is {} bytes, over the {} allowed",
                at(),
                message.target,
                message.topic.len(),
                limits.max_topic_bytes
            ));
        }
        if message.payload.len() > limits.max_message_bytes {
            return Err(format!(
                "{}: payload is {} bytes, over relay.max_message_bytes ({})",
                at(),
                message.payload.len(),
                limits.max_message_bytes
            ));
        }
        if message.headers.len() > Limits::MAX_HEADERS {
            return Err(format!(
                "{}: {} headers, more than the {} allowed",
                at(),
                message.headers.len(),
                Limits::MAX_HEADERS
            ));
        }
        let header_bytes: usize = message.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        if message.payload.len() + header_bytes > limits.max_message_bytes {
            return Err(format!(
                "{}: payload and headers are {} bytes, over relay.max_message_bytes ({})",
                at(),
                message.payload.len() + header_bytes,
                limits.max_message_bytes
            ));
        }
        for (name, value) in &message.headers {
            check_header(name, value).map_err(|e| format!("{}: {e}", at()))?;
        }
        if let Some(key) = &message.key {
            check_header("key", key).map_err(|e| format!("{}: {e}", at()))?;
        }
        let delivery_key = format!("{}:{}#{}", message.target, message.topic, ordinal);
        let dedup_id = if several {
            format!("{}:{delivery_key}", event.event_id)
        } else {
            event.event_id.clone()
        };
        routed.push(Routed {
            target: message.target,
            delivery_key,
            message: OutgoingMessage {
                headers: merge_headers(event, message.headers, plugin_label, traceparent.as_deref()),
                topic: message.topic,
                key: message.key,
                payload: Bytes::from(message.payload),
                event_id: event.event_id.clone(),
                dedup_id,
            },
        });
    }
    Ok(routed)
}

/// Row headers, then the plugin's (which win on a name clash), then the
/// relay's own, which always win: consumers rely on the event id being true,
/// and on `traceparent` naming the relay's span when the row carried one.
fn merge_headers(
    event: &Event,
    plugin: Vec<(String, String)>,
    plugin_label: &str,
    traceparent: Option<&str>,
) -> Vec<(String, String)> {
    let relay = [
        (EVENT_ID_HEADER, event.event_id.as_str()),
        (EVENT_TYPE_HEADER, event.event_type.as_str()),
        (AGGREGATE_TYPE_HEADER, event.aggregate_type.as_str()),
        (AGGREGATE_ID_HEADER, event.aggregate_id.as_str()),
        (PLUGIN_HEADER, plugin_label),
    ];
    let mut merged: Vec<(String, String)> =
        Vec::with_capacity(event.headers.len() + plugin.len() + relay.len());
    let mut put =
        |name: &str, value: &str| match merged.iter_mut().find(|(n, _)| n.eq_ignore_ascii_case(name)) {
            Some(slot) => slot.1 = value.to_string(),
            None => merged.push((name.to_string(), value.to_string())),
        };
    for (name, value) in &event.headers {
        put(name, value);
    }
    for (name, value) in &plugin {
        put(name, value);
    }
    for (name, value) in relay {
        put(name, value);
    }
    if let Some(traceparent) = traceparent {
        put(TraceParent::HEADER, traceparent);
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RowId;
    use std::collections::BTreeMap;

    const LIMITS: Limits = Limits {
        max_payload_bytes: 64,
        max_message_bytes: 64,
        max_messages_per_event: 4,
        max_topic_bytes: 64,
    };

    fn row() -> OutboxRow {
        OutboxRow {
            id: RowId(7),
            event_id: uuid::Uuid::nil(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            event_type: "OrderCreated".into(),
            payload_json: Some(r#"{"total": 5}"#.into()),
            payload_bytes: None,
            headers_json: r#"{"traceparent": "00-abc-def-01"}"#.into(),
            tenant: None,
            created_at_ms: 1,
            attempts: 2,
            deliveries: BTreeMap::new(),
            malformed: None,
            held_by: Vec::new(),
        }
    }

    fn message(target: &str, topic: &str) -> Message {
        Message {
            target: target.into(),
            topic: topic.into(),
            key: Some("o-1".into()),
            payload: b"{}".to_vec(),
            headers: vec![
                ("Switchyard-Event-Id".into(), "forged".into()),
                ("x".into(), "1".into()),
            ],
        }
    }

    #[test]
    fn builds_event_with_headers_and_attempt() {
        let event = event_from_row(&row(), &LIMITS).unwrap();
        assert_eq!(event.attempt, 2);
        assert_eq!(event.payload_format, PayloadFormat::Json);
        assert_eq!(
            event.headers,
            vec![("traceparent".into(), "00-abc-def-01".into())]
        );
    }

    #[test]
    fn rejects_null_oversized_and_malformed_rows() {
        let mut null = row();
        null.payload_json = None;
        assert!(
            event_from_row(&null, &LIMITS)
                .unwrap_err()
                .contains("payload is NULL")
        );

        let mut big = row();
        big.payload_json = Some(format!("\"{}\"", "x".repeat(100)));
        assert!(
            event_from_row(&big, &LIMITS)
                .unwrap_err()
                .contains("max_payload_bytes")
        );

        let mut bad = row();
        bad.headers_json = r#"{"n": 5}"#.into();
        assert!(
            event_from_row(&bad, &LIMITS)
                .unwrap_err()
                .contains("must be a string")
        );
        bad.headers_json = "[1]".into();
        assert!(event_from_row(&bad, &LIMITS).unwrap_err().contains("JSON object"));
    }

    #[test]
    fn binary_payload_wins_over_json() {
        let mut binary = row();
        binary.payload_bytes = Some(vec![0, 1, 2]);
        let event = event_from_row(&binary, &LIMITS).unwrap();
        assert_eq!(event.payload_format, PayloadFormat::Binary);
        assert_eq!(event.payload, vec![0, 1, 2]);
    }

    #[test]
    fn assembles_with_relay_headers_winning() {
        let event = event_from_row(&row(), &LIMITS).unwrap();
        let routed = assemble(
            &event,
            vec![
                message("nats", "orders"),
                message("nats", "orders"),
                message("kafka", "orders"),
            ],
            "p@abc",
            &LIMITS,
            &|_| Some(true),
            None,
        )
        .unwrap();
        let keys: Vec<_> = routed.iter().map(|r| r.delivery_key.as_str()).collect();
        assert_eq!(keys, ["nats:orders#0", "nats:orders#1", "kafka:orders#0"]);
        let headers = &routed[0].message.headers;
        let get = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        assert_eq!(get(EVENT_ID_HEADER), Some(uuid::Uuid::nil().to_string().as_str()));
        assert_eq!(get("traceparent"), Some("00-abc-def-01"));
        assert_eq!(get("x"), Some("1"));
        assert_eq!(get(PLUGIN_HEADER), Some("p@abc"));
    }

    #[test]
    fn dedup_ids_differ_per_message_even_across_targets() {
        let event = event_from_row(&row(), &LIMITS).unwrap();
        let assembled =
            |messages| assemble(&event, messages, "p@abc", &LIMITS, &|_| Some(true), None).unwrap();
        let single = assembled(vec![message("nats", "orders")]);
        assert_eq!(single[0].message.dedup_id, event.event_id);

        // Two NATS targets may write into one stream: one id each.
        let two = assembled(vec![message("nats-a", "orders"), message("nats-b", "orders")]);
        let ids: Vec<_> = two.iter().map(|r| r.message.dedup_id.clone()).collect();
        assert_eq!(
            ids,
            [
                format!("{}:nats-a:orders#0", event.event_id),
                format!("{}:nats-b:orders#0", event.event_id)
            ]
        );
        // Stable across attempts: the same answer gives the same ids.
        let again = assembled(vec![message("nats-a", "orders"), message("nats-b", "orders")]);
        assert_eq!(again[1].message.dedup_id, ids[1]);

        // Targets that ignore ids (Kafka) do not count: one JetStream
        // message among them keeps the bare event id.
        let only_nats_dedups = |t: &str| Some(t == "nats");
        let fan_out = assemble(
            &event,
            vec![message("kafka", "orders"), message("nats", "audit")],
            "p@abc",
            &LIMITS,
            &only_nats_dedups,
            None,
        )
        .unwrap();
        assert_eq!(fan_out[1].message.dedup_id, event.event_id);
    }

    #[test]
    fn the_relay_span_replaces_the_writers_traceparent() {
        let event = event_from_row(&row(), &LIMITS).unwrap();
        let relay_span = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let mut plugin_says = message("nats", "orders");
        plugin_says
            .headers
            .push(("traceparent".into(), "00-from-the-plugin-01".into()));
        let routed = assemble(
            &event,
            vec![plugin_says],
            "p@abc",
            &LIMITS,
            &|_| Some(true),
            relay_span.as_ref(),
        )
        .unwrap();
        let values: Vec<_> = routed[0]
            .message
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("traceparent"))
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(
            values,
            ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]
        );
    }

    #[test]
    fn refuses_bad_plugin_output_with_specific_errors() {
        let event = event_from_row(&row(), &LIMITS).unwrap();
        let known = |t: &str| (t == "nats").then_some(true);
        let err = |m: Message| assemble(&event, vec![m], "p@abc", &LIMITS, &known, None).unwrap_err();

        assert!(err(message("nope", "t")).contains("unknown target \"nope\""));
        assert!(err(message("nats", " ")).contains("empty topic"));
        let mut big = message("nats", "t");
        big.payload = vec![0; 65];
        assert!(err(big).contains("max_message_bytes"));
        let mut header = message("nats", "t");
        header.headers.push(("bad name".into(), "v".into()));
        assert!(err(header).contains("invalid"));
        for topic in ["orders\u{0}x", "orders\nx", "a\u{1b}[31m"] {
            let error = err(message("nats", topic));
            assert!(error.contains("control character"), "{topic:?}: {error}");
        }
        let error = err(message("nats", &"t".repeat(65)));
        assert!(error.contains("65 bytes"), "{error}");
        let mut many = message("nats", "t");
        many.headers = (0..300).map(|i| (format!("h{i}"), String::new())).collect();
        assert!(err(many).contains("300 headers"));
        let mut huge = message("nats", "t");
        huge.headers.push(("h".into(), "v".repeat(40)));
        assert!(err(huge).contains("payload and headers are"));
        let many = vec![message("nats", "t"); 5];
        assert!(
            assemble(&event, many, "p@abc", &LIMITS, &known, None)
                .unwrap_err()
                .contains("5 messages")
        );
    }
}
