//! Pure, synchronous routing logic around the plugin call: turning a claimed
//! row into the plugin's `event`, checking what the plugin returned, and
//! assembling broker messages with the relay's headers. No I/O here, so every
//! rule is unit-tested directly.

use bytes::Bytes;

use crate::plugin::{Event, Message, PayloadFormat};
use crate::sinks::OutgoingMessage;
use crate::store::{DeliveryKey, OutboxRow};
use crate::trace::TraceParent;

mod problems;
pub use problems::{BadOutput, HeaderProblem, HeadersProblem, OutputProblem, Unroutable};

pub use crate::sinks::headers::{
    AGGREGATE_ID_HEADER, AGGREGATE_TYPE_HEADER, EVENT_ID_HEADER, EVENT_TYPE_HEADER, PLUGIN_HEADER,
};

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
mod tests;
