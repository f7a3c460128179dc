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

/// Why a row cannot become an event; it is dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unroutable {
    /// The store could not read it (a column of the wrong type...).
    #[error("{0}")]
    Malformed(String),
    /// Neither `payload` nor `payload_bytes` is set.
    #[error("payload is NULL (set payload or payload_bytes)")]
    NullPayload,
    /// Over `relay.max_payload_bytes`.
    #[error("payload is {size} bytes, over relay.max_payload_bytes ({limit})")]
    PayloadTooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The `headers` column.
    #[error("headers column {0}")]
    Headers(HeadersProblem),
}

/// What is wrong with a row's `headers` column.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadersProblem {
    /// Not JSON.
    #[error("is not valid JSON: {0}")]
    NotJson(String),
    /// JSON, but not an object.
    #[error("must be a JSON object, got {0}")]
    NotObject(&'static str),
    /// A value that is not a string.
    #[error("header {name:?} must be a string, got {kind}")]
    NotString {
        /// The header.
        name: String,
        /// What it is instead.
        kind: &'static str,
    },
    /// A name or value no broker can carry.
    #[error("{0}")]
    Header(HeaderProblem),
}

/// A header no broker can carry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderProblem {
    /// Empty, or not printable ASCII without ':' and spaces.
    #[error("header name {0:?} is invalid (printable ASCII without ':' or spaces)")]
    InvalidName(String),
    /// A CR, LF or NUL in the value.
    #[error("header {0:?} has a line break or NUL in its value")]
    BreakInValue(String),
}

/// A plugin's answer the relay will not send; the row is dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("plugin {plugin} {problem}")]
pub struct BadOutput {
    /// `name@version`.
    pub plugin: String,
    /// What is wrong.
    pub problem: OutputProblem,
}

/// What is wrong with a plugin's answer. Each message problem names the
/// message by its index in the answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputProblem {
    /// More messages than one event may fan out to.
    #[error("returned {count} messages, more than the {limit} allowed per event")]
    TooManyMessages {
        /// Returned.
        count: usize,
        /// Allowed.
        limit: usize,
    },
    /// A target that is not configured.
    #[error("message {index}: unknown target {target:?}")]
    UnknownTarget {
        /// The message.
        index: usize,
        /// The target it named.
        target: String,
    },
    /// A blank topic.
    #[error("message {index}: empty topic for target {target:?}")]
    EmptyTopic {
        /// The message.
        index: usize,
        /// Its target.
        target: String,
    },
    /// A control character in the topic.
    #[error("message {index}: topic {topic:?} for target {target:?} contains a control character")]
    ControlInTopic {
        /// The message.
        index: usize,
        /// Its target.
        target: String,
        /// The topic.
        topic: String,
    },
    /// A topic over [`Limits::MAX_TOPIC_BYTES`].
    #[error("message {index}: topic for target {target:?} is {size} bytes, over the {limit} allowed")]
    TopicTooLong {
        /// The message.
        index: usize,
        /// Its target.
        target: String,
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A payload over `relay.max_message_bytes`.
    #[error("message {index}: payload is {size} bytes, over relay.max_message_bytes ({limit})")]
    PayloadTooLarge {
        /// The message.
        index: usize,
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// More headers than [`Limits::MAX_HEADERS`].
    #[error("message {index}: {count} headers, more than the {limit} allowed")]
    TooManyHeaders {
        /// The message.
        index: usize,
        /// Set.
        count: usize,
        /// Allowed.
        limit: usize,
    },
    /// Payload and headers over `relay.max_message_bytes`.
    #[error("message {index}: payload and headers are {size} bytes, over relay.max_message_bytes ({limit})")]
    MessageTooLarge {
        /// The message.
        index: usize,
        /// Payload and headers.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A header (or the key) no broker can carry.
    #[error("message {index}: {problem}")]
    BadHeader {
        /// The message.
        index: usize,
        /// What is wrong.
        problem: HeaderProblem,
    },
}

impl OutputProblem {
    /// A stable name for the problem, for reports and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            OutputProblem::TooManyMessages { .. } => "too_many_messages",
            OutputProblem::UnknownTarget { .. } => "unknown_target",
            OutputProblem::EmptyTopic { .. } => "empty_topic",
            OutputProblem::ControlInTopic { .. } => "control_in_topic",
            OutputProblem::TopicTooLong { .. } => "topic_too_long",
            OutputProblem::PayloadTooLarge { .. } => "payload_too_large",
            OutputProblem::TooManyHeaders { .. } => "too_many_headers",
            OutputProblem::MessageTooLarge { .. } => "message_too_large",
            OutputProblem::BadHeader { .. } => "bad_header",
        }
    }
}

/// Builds the plugin's view of a row.
///
/// # Errors
/// A specific reason when the row cannot be routed at all (NULL or oversized
/// payload, malformed headers); such rows are dead-lettered.
pub fn event_from_row(row: &OutboxRow, limits: &Limits) -> Result<Event, Unroutable> {
    if let Some(reason) = &row.malformed {
        return Err(Unroutable::Malformed(reason.clone()));
    }
    let (payload, payload_format) = match (&row.payload_bytes, &row.payload_json) {
        (Some(bytes), _) => (bytes.clone(), PayloadFormat::Binary),
        (None, Some(json)) => (json.clone().into_bytes(), PayloadFormat::Json),
        (None, None) => return Err(Unroutable::NullPayload),
    };
    if payload.len() > limits.max_payload_bytes {
        return Err(Unroutable::PayloadTooLarge {
            size: payload.len(),
            limit: limits.max_payload_bytes,
        });
    }
    Ok(Event {
        row_id: row.id.0,
        event_id: row.event_id.to_string(),
        aggregate_type: row.aggregate_type.clone(),
        aggregate_id: row.aggregate_id.clone(),
        event_type: row.event_type.clone(),
        payload,
        payload_format,
        headers: parse_row_headers(&row.headers_json).map_err(Unroutable::Headers)?,
        tenant: row.tenant.clone(),
        created_at_ms: row.created_at_ms,
        attempt: u32::try_from(row.attempts).unwrap_or(0),
    })
}

/// Parses the `headers` column: a JSON object whose values are strings.
///
/// # Errors
/// What is wrong with it.
pub fn parse_row_headers(json: &str) -> Result<Vec<(String, String)>, HeadersProblem> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| HeadersProblem::NotJson(e.to_string()))?;
    let object = value
        .as_object()
        .ok_or_else(|| HeadersProblem::NotObject(json_kind(&value)))?;
    object
        .iter()
        .map(|(name, value)| match value {
            serde_json::Value::String(text) => check_header(name, text)
                .map(|()| (name.clone(), text.clone()))
                .map_err(HeadersProblem::Header),
            other => Err(HeadersProblem::NotString {
                name: name.clone(),
                kind: json_kind(other),
            }),
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

fn check_header(name: &str, value: &str) -> Result<(), HeaderProblem> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
        return Err(HeaderProblem::InvalidName(name.to_string()));
    }
    if value.contains(['\r', '\n', '\0']) {
        return Err(HeaderProblem::BreakInValue(name.to_string()));
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
) -> Result<Vec<Routed>, BadOutput> {
    let traceparent = trace.map(ToString::to_string);
    let refuse = |problem| BadOutput {
        plugin: plugin_label.to_string(),
        problem,
    };
    if messages.len() > limits.max_messages_per_event {
        return Err(refuse(OutputProblem::TooManyMessages {
            count: messages.len(),
            limit: limits.max_messages_per_event,
        }));
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
        check_message(&message, index, limits, target).map_err(refuse)?;
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

/// The checks on one message of a plugin's answer.
fn check_message(
    message: &Message,
    index: usize,
    limits: &Limits,
    target: &dyn Fn(&str) -> Option<bool>,
) -> Result<(), OutputProblem> {
    let name = || message.target.clone();
    if target(&message.target).is_none() {
        return Err(OutputProblem::UnknownTarget {
            index,
            target: name(),
        });
    }
    if message.topic.trim().is_empty() {
        return Err(OutputProblem::EmptyTopic {
            index,
            target: name(),
        });
    }
    if message.topic.chars().any(char::is_control) {
        return Err(OutputProblem::ControlInTopic {
            index,
            target: name(),
            topic: message.topic.clone(),
        });
    }
    if message.topic.len() > limits.max_topic_bytes {
        return Err(OutputProblem::TopicTooLong {
            index,
            target: name(),
            size: message.topic.len(),
            limit: limits.max_topic_bytes,
        });
    }
    let limit = limits.max_message_bytes;
    if message.payload.len() > limit {
        return Err(OutputProblem::PayloadTooLarge {
            index,
            size: message.payload.len(),
            limit,
        });
    }
    if message.headers.len() > Limits::MAX_HEADERS {
        return Err(OutputProblem::TooManyHeaders {
            index,
            count: message.headers.len(),
            limit: Limits::MAX_HEADERS,
        });
    }
    let header_bytes: usize = message.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
    if message.payload.len() + header_bytes > limit {
        return Err(OutputProblem::MessageTooLarge {
            index,
            size: message.payload.len() + header_bytes,
            limit,
        });
    }
    let key = message.key.as_ref().map(|key| ("key", key.as_str()));
    for (name, value) in message
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .chain(key)
    {
        check_header(name, value).map_err(|problem| OutputProblem::BadHeader { index, problem })?;
    }
    Ok(())
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
        let error = event_from_row(&null, &LIMITS).unwrap_err();
        assert_eq!(error, Unroutable::NullPayload);
        assert!(error.to_string().contains("payload is NULL"));

        let mut big = row();
        big.payload_json = Some(format!("\"{}\"", "x".repeat(100)));
        let error = event_from_row(&big, &LIMITS).unwrap_err();
        assert_eq!(error, Unroutable::PayloadTooLarge { size: 102, limit: 64 });
        assert!(error.to_string().contains("max_payload_bytes"));

        let mut bad = row();
        bad.headers_json = r#"{"n": 5}"#.into();
        let error = event_from_row(&bad, &LIMITS).unwrap_err();
        assert!(
            matches!(&error, Unroutable::Headers(HeadersProblem::NotString { name, kind: "a number" }) if name == "n"),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            "headers column header \"n\" must be a string, got a number"
        );
        bad.headers_json = "[1]".into();
        assert_eq!(
            event_from_row(&bad, &LIMITS).unwrap_err().to_string(),
            "headers column must be a JSON object, got an array"
        );
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
        let err = |m: Message| {
            let error = assemble(&event, vec![m], "p@abc", &LIMITS, &known, None).unwrap_err();
            assert_eq!(error.plugin, "p@abc");
            error.problem
        };

        let unknown = err(message("nope", "t"));
        assert_eq!(unknown.kind(), "unknown_target");
        assert_eq!(unknown.to_string(), "message 0: unknown target \"nope\"");
        assert_eq!(err(message("nats", " ")).kind(), "empty_topic");
        let mut big = message("nats", "t");
        big.payload = vec![0; 65];
        assert_eq!(
            err(big),
            OutputProblem::PayloadTooLarge {
                index: 0,
                size: 65,
                limit: 64
            }
        );
        let mut header = message("nats", "t");
        header.headers.push(("bad name".into(), "v".into()));
        assert_eq!(
            err(header),
            OutputProblem::BadHeader {
                index: 0,
                problem: HeaderProblem::InvalidName("bad name".into())
            }
        );
        let mut key = message("nats", "t");
        key.key = Some("k\ney".into());
        assert_eq!(
            err(key),
            OutputProblem::BadHeader {
                index: 0,
                problem: HeaderProblem::BreakInValue("key".into())
            }
        );
        for topic in ["orders\u{0}x", "orders\nx", "a\u{1b}[31m"] {
            let error = err(message("nats", topic));
            assert_eq!(error.kind(), "control_in_topic", "{topic:?}: {error}");
        }
        let error = err(message("nats", &"t".repeat(65)));
        assert!(
            matches!(error, OutputProblem::TopicTooLong { size: 65, .. }),
            "{error}"
        );
        let mut many = message("nats", "t");
        many.headers = (0..300).map(|i| (format!("h{i}"), String::new())).collect();
        assert!(matches!(
            err(many),
            OutputProblem::TooManyHeaders { count: 300, .. }
        ));
        let mut huge = message("nats", "t");
        huge.headers.push(("h".into(), "v".repeat(40)));
        assert_eq!(err(huge).kind(), "message_too_large");
        let many = vec![message("nats", "t"); 5];
        let error = assemble(&event, many, "p@abc", &LIMITS, &known, None).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "plugin p@abc returned 5 messages, more than the {} allowed per event",
                LIMITS.max_messages_per_event
            )
        );
    }
}
