//! The EventBridge target (`type = "eventbridge"`): the plugin's topic
//! names an event bus (its name or ARN); events go in batches of up to 10
//! through `PutEvents`, each entry's answer its message's outcome. An
//! event's `Detail` is the payload, which must be a JSON object, with the
//! relay's headers (the event id among them) in one member of it;
//! `Source` and `DetailType` are the aggregate type and the event type
//! unless the config or the plugin says otherwise. EventBridge keeps no
//! order.

#[cfg(feature = "aws")]
use crate::sinks::SinkError;
use crate::sinks::aws::config::{aws_kind, aws_target};

/// The header a plugin sets to choose an event's `Source`.
pub const SOURCE_HEADER: &str = "EventBridge-Source";
/// The header a plugin sets to choose an event's `DetailType`.
pub const DETAIL_TYPE_HEADER: &str = "EventBridge-Detail-Type";

aws_target! {
    /// `[targets.NAME]` with `type = "eventbridge"`.
    EventBridgeSinkConfig {
        /// Every event's `Source`. Default: the event's aggregate type. A
        /// plugin's `EventBridge-Source` header wins over both.
        #[serde(default)]
        pub source: Option<String>,
        /// Every event's `DetailType`. Default: the event type. A plugin's
        /// `EventBridge-Detail-Type` header wins over both.
        #[serde(default)]
        pub detail_type: Option<String>,
        /// The member of `Detail` that carries the relay's headers (the
        /// event id, `traceparent`, the row's and the plugin's headers) as
        /// an object; `""` sends the payload as it is, and consumers then
        /// get no event id.
        #[serde(default = "default_metadata_member")]
        pub metadata_member: String,
        /// Buses to check at start and in `switchyard validate` (names or
        /// ARNs).
        #[serde(default)]
        pub buses: Vec<String>,
    }
}

fn default_metadata_member() -> String {
    "switchyard".to_string()
}

/// Why EventBridge would refuse `bus` as a bus name or ARN.
pub(crate) fn bus_problem(bus: &str) -> Option<String> {
    if bus.starts_with("arn:") {
        return None;
    }
    let problem = if bus.is_empty() || bus.len() > 256 {
        "must be 1 to 256 characters long"
    } else if !bus
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '/'))
    {
        "may hold only letters, digits and . - _ /"
    } else {
        return None;
    };
    Some(format!("EventBridge bus name {bus:?} {problem}"))
}

aws_kind!(
    EventBridgeSinkConfig,
    "eventbridge",
    EventBridgeSink,
    buses,
    bus_problem,
    eventbridge_extra,
    false
);

/// What else is wrong with the settings: `source` and `detail_type`.
fn eventbridge_extra(config: &EventBridgeSinkConfig) -> Vec<String> {
    [("source", &config.source), ("detail_type", &config.detail_type)]
        .into_iter()
        .filter(|(_, value)| value.as_deref().is_some_and(|v| v.is_empty() || v.len() > 256))
        .map(|(key, _)| format!("{key} must be 1 to 256 characters"))
        .collect()
}

/// What EventBridge counts of an entry (its `Source`, `DetailType` and
/// `Detail`), and the most an entry and a `PutEvents` call may be.
pub const MAX_ENTRY_BYTES: usize = 256 * 1024;

#[cfg(feature = "aws")]
/// An event's `Source`, `DetailType` and `Detail` for `message`.
///
/// # Errors
/// A permanent failure naming what EventBridge would refuse: a payload
/// that is not a JSON object, a member the metadata would overwrite, an
/// entry over the size limit.
pub fn entry_parts(
    config: &EventBridgeSinkConfig,
    message: &crate::sinks::OutgoingMessage,
) -> Result<(String, String, String), SinkError> {
    use super::header;
    let mut detail: serde_json::Map<String, serde_json::Value> =
        match serde_json::from_slice(&message.payload) {
            Ok(serde_json::Value::Object(object)) => object,
            Ok(_) | Err(_) => {
                return Err(SinkError::permanent(
                    "EventBridge's Detail must be a JSON object and the payload is not one: have the plugin \
                 return an object",
                ));
            }
        };
    let source = header(message, SOURCE_HEADER)
        .map(ToString::to_string)
        .or_else(|| config.source.clone())
        .unwrap_or_else(|| super::aggregate_type(message).to_string());
    let detail_type = header(message, DETAIL_TYPE_HEADER)
        .map(ToString::to_string)
        .or_else(|| config.detail_type.clone())
        .unwrap_or_else(|| super::event_type(message).to_string());
    if !config.metadata_member.is_empty() {
        if detail.contains_key(&config.metadata_member) {
            return Err(SinkError::permanent(format!(
                "the payload has a member {:?}, where the relay puts the event's headers: set the target's \
                 metadata_member to another name",
                config.metadata_member
            )));
        }
        let mut headers: serde_json::Map<String, serde_json::Value> = message
            .headers
            .iter()
            .filter(|(name, _)| name != SOURCE_HEADER && name != DETAIL_TYPE_HEADER)
            .map(|(name, value)| (name.clone(), serde_json::Value::String(value.clone())))
            .collect();
        if let Some(key) = &message.key {
            headers.insert(
                crate::sinks::KEY_HEADER.to_string(),
                serde_json::Value::String(key.clone()),
            );
        }
        detail.insert(config.metadata_member.clone(), serde_json::Value::Object(headers));
    }
    let detail = serde_json::Value::Object(detail).to_string();
    let size = source.len() + detail_type.len() + detail.len();
    if size > MAX_ENTRY_BYTES {
        return Err(SinkError::permanent(format!(
            "the event is {size} bytes (Source, DetailType and Detail with the headers); EventBridge takes at \
             most {MAX_ENTRY_BYTES} (256 KiB) an entry"
        )));
    }
    if source.is_empty() || detail_type.is_empty() {
        return Err(SinkError::permanent(
            "EventBridge needs a Source and a DetailType: the event has no aggregate type or event type; set \
             source and detail_type on the target",
        ));
    }
    Ok((source, detail_type, detail))
}

#[cfg(feature = "aws")]
mod sink {
    use std::collections::HashSet;
    use std::time::Duration;

    use aws_sdk_eventbridge::Client;
    use aws_sdk_eventbridge::types::PutEventsRequestEntry;
    use futures::future::BoxFuture;

    use super::{EventBridgeSinkConfig, MAX_ENTRY_BYTES, entry_parts};
    use crate::sinks::aws::attributes;
    use crate::sinks::aws::client::{Connection, only_denied};
    use crate::sinks::aws::{EntryFailure, entry_outcomes, per_topic};
    use crate::sinks::{FailureKind, OutgoingMessage, Sink, SinkError};

    /// Entries of one `PutEvents`.
    const BATCH: usize = 10;

    /// EventBridge buses as a target.
    pub struct EventBridgeSink {
        name: String,
        config: EventBridgeSinkConfig,
        connection: Connection,
        client: Client,
    }

    impl EventBridgeSink {
        /// A sink for `config`; a call takes at most `timeout`.
        pub async fn connect(
            name: &str,
            config: &EventBridgeSinkConfig,
            timeout: Duration,
        ) -> EventBridgeSink {
            let connection = Connection::new(&config.connection(), timeout).await;
            let client = Client::new(&connection.sdk);
            EventBridgeSink {
                name: name.to_string(),
                config: config.clone(),
                connection,
                client,
            }
        }

        async fn describe(&self, bus: &str) -> Result<(), SinkError> {
            self.client
                .describe_event_bus()
                .name(bus)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| self.connection.classify(&e, "EventBridge", &format!("bus {bus}")))
        }

        /// Each listed bus that does not exist or may not be read.
        ///
        /// # Errors
        /// EventBridge could not be asked.
        pub async fn listed_problems(&self) -> Result<Vec<String>, SinkError> {
            let mut problems = Vec::new();
            for bus in &self.config.buses {
                match self.describe(bus).await {
                    Ok(()) => {}
                    Err(e) if matches!(e.kind, FailureKind::UnknownTopic | FailureKind::Unauthorized) => {
                        problems.push(e.message);
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(problems)
        }

        async fn send_bus(
            &self,
            bus: &str,
            messages: Vec<(usize, &OutgoingMessage)>,
        ) -> Vec<(usize, Result<(), SinkError>)> {
            // A name the service would refuse fails its messages now: asked
            // for, it could read as a missing bus, which waits for ever.
            if let Some(problem) = super::bus_problem(bus) {
                let error = SinkError::permanent(problem);
                return messages
                    .into_iter()
                    .map(|(index, _)| (index, Err(error.clone())))
                    .collect();
            }
            let mut results = Vec::with_capacity(messages.len());
            let mut ready = Vec::with_capacity(messages.len());
            for (index, message) in messages {
                match entry_parts(&self.config, message) {
                    Ok(parts) => ready.push((index, parts)),
                    Err(e) => results.push((index, Err(e))),
                }
            }
            let sizes: Vec<usize> = ready
                .iter()
                .map(|(_, (s, t, d))| s.len() + t.len() + d.len())
                .collect();
            let mut ready = ready.into_iter();
            for run in attributes::batches(&sizes, BATCH, MAX_ENTRY_BYTES) {
                let batch: Vec<(usize, (String, String, String))> = ready.by_ref().take(run.len()).collect();
                results.extend(self.send_batch(bus, batch).await);
            }
            results
        }

        async fn send_batch(
            &self,
            bus: &str,
            batch: Vec<(usize, (String, String, String))>,
        ) -> Vec<(usize, Result<(), SinkError>)> {
            let entries: Vec<PutEventsRequestEntry> = batch
                .iter()
                .map(|(_, (source, detail_type, detail))| {
                    PutEventsRequestEntry::builder()
                        .event_bus_name(bus)
                        .source(source)
                        .detail_type(detail_type)
                        .detail(detail)
                        .build()
                })
                .collect();
            let indexes: Vec<usize> = batch.into_iter().map(|(index, _)| index).collect();
            let output = match self.client.put_events().set_entries(Some(entries)).send().await {
                Ok(output) => output,
                Err(e) => {
                    let error = self.connection.classify(&e, "EventBridge", &format!("bus {bus}"));
                    return indexes
                        .into_iter()
                        .map(|index| (index, Err(error.clone())))
                        .collect();
                }
            };
            // The answer's entries are the request's, in order.
            let mut failed = Vec::new();
            let mut succeeded = HashSet::new();
            for (at, entry) in output.entries().iter().enumerate() {
                match entry.error_code() {
                    Some(code) => failed.push(EntryFailure {
                        id: at.to_string(),
                        code,
                        sender_fault: None,
                        message: entry.error_message(),
                    }),
                    None if entry.event_id().is_some() => {
                        succeeded.insert(at.to_string());
                    }
                    None => {}
                }
            }
            entry_outcomes(
                &self.connection,
                indexes,
                &failed,
                &succeeded,
                "EventBridge",
                &format!("bus {bus}"),
            )
        }
    }

    impl Sink for EventBridgeSink {
        fn kind(&self) -> &'static str {
            "eventbridge"
        }

        fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
            Box::pin(async move { per_topic(&messages, |bus, list| self.send_bus(bus, list)).await })
        }

        /// EventBridge answers and takes the credentials: the first listed
        /// bus (or the default one) exists. A refused read permission still
        /// shows both.
        fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
            Box::pin(async move {
                let bus = self.config.buses.first().map_or("default", String::as_str);
                match self.describe(bus).await {
                    Err(e) if only_denied(&e) => {
                        tracing::debug!(sink.name = %self.name, error = %e, "EventBridge health check: a read the identity may not do; it signed in.");
                        Ok(())
                    }
                    other => other,
                }
            })
        }
    }
}

#[cfg(all(test, feature = "aws"))]
mod tests {
    use super::*;
    use crate::sinks::OutgoingMessage;

    fn config(text: &str) -> EventBridgeSinkConfig {
        toml::from_str(text).unwrap()
    }

    fn message(payload: &str, headers: &[(&str, &str)]) -> OutgoingMessage {
        OutgoingMessage {
            topic: "bus".into(),
            payload: payload.as_bytes().to_vec().into(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..OutgoingMessage::default()
        }
    }

    #[test]
    fn detail_is_the_payload_object_with_the_headers_in_one_member() {
        let headers = [
            ("Switchyard-Event-Id", "e-1"),
            ("Switchyard-Aggregate-Type", "order"),
            ("Switchyard-Event-Type", "OrderPlaced"),
        ];
        let (source, detail_type, detail) =
            entry_parts(&config(""), &message("{\"total\":3}", &headers)).unwrap();
        assert_eq!((source.as_str(), detail_type.as_str()), ("order", "OrderPlaced"));
        let detail: serde_json::Value = serde_json::from_str(&detail).unwrap();
        assert_eq!(detail["total"], 3);
        assert_eq!(detail["switchyard"]["Switchyard-Event-Id"], "e-1");
        let chosen = [("EventBridge-Source", "shop"), ("Switchyard-Event-Type", "X")];
        let (source, detail_type, _) =
            entry_parts(&config("detail_type = \"Fixed\""), &message("{}", &chosen)).unwrap();
        assert_eq!((source.as_str(), detail_type.as_str()), ("shop", "Fixed"));
    }

    #[test]
    fn what_eventbridge_refuses_is_named() {
        let headers = [("Switchyard-Aggregate-Type", "a"), ("Switchyard-Event-Type", "b")];
        for (payload, says) in [
            ("[1]", "must be a JSON object"),
            ("not json", "must be a JSON object"),
            ("{\"switchyard\":1}", "metadata_member"),
        ] {
            let error = entry_parts(&config(""), &message(payload, &headers)).unwrap_err();
            assert!(error.message.contains(says), "{payload}: {}", error.message);
        }
        let big = format!("{{\"x\":\"{}\"}}", "y".repeat(MAX_ENTRY_BYTES));
        assert!(
            entry_parts(&config(""), &message(&big, &headers))
                .unwrap_err()
                .message
                .contains("256 KiB")
        );
        let plain = entry_parts(
            &config("metadata_member = \"\""),
            &message("{\"switchyard\":1}", &headers),
        );
        assert!(plain.is_ok());
    }
}
