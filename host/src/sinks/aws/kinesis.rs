//! The Kinesis target (`type = "kinesis"`): the plugin's topic names a data
//! stream (its name or ARN); records go in calls of up to 500 through
//! `PutRecords`, each record's answer its message's outcome. The partition
//! key is the aggregate id by default, so an aggregate's records land on
//! one shard in order. A record has no headers: by default it is an
//! envelope, a JSON object with the headers (the event id among them) and
//! the payload.

use serde::Deserialize;

#[cfg(feature = "aws")]
use crate::sinks::SinkError;
use crate::sinks::aws::config::{aws_kind, aws_target};

/// What a record's partition key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PartitionKey {
    /// The event's aggregate id.
    #[default]
    Aggregate,
    /// The key the plugin chose (the aggregate id when it chose none).
    Key,
}

/// What a record holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RecordFormat {
    /// `{"headers": {...}, "payload": ...}`: the payload as JSON when it
    /// is JSON, else as base64 text with `"payload_base64": true`.
    #[default]
    Envelope,
    /// The payload's bytes alone: consumers get no event id or header.
    Payload,
}

aws_target! {
    /// `[targets.NAME]` with `type = "kinesis"`.
    KinesisSinkConfig {
        /// Each record's partition key.
        #[serde(default)]
        pub partition_key: PartitionKey,
        /// What a record holds.
        #[serde(default)]
        pub record: RecordFormat,
        /// Streams to check at start and in `switchyard validate` (names or
        /// ARNs).
        #[serde(default)]
        pub streams: Vec<String>,
    }
}

/// A record's data and partition key.
pub const MAX_RECORD_BYTES: usize = 1024 * 1024;
/// A `PutRecords` call.
pub const MAX_CALL_BYTES: usize = 5 * 1024 * 1024;
/// Records of a `PutRecords` call.
pub const MAX_CALL_RECORDS: usize = 500;

/// Why Kinesis would refuse `stream` as a stream name or ARN.
pub(crate) fn stream_problem(stream: &str) -> Option<String> {
    if stream.starts_with("arn:") {
        return None;
    }
    let problem = if stream.is_empty() || stream.len() > 128 {
        "must be 1 to 128 characters long"
    } else if !stream
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    {
        "may hold only letters, digits and . - _"
    } else {
        return None;
    };
    Some(format!("Kinesis stream name {stream:?} {problem}"))
}

aws_kind!(
    KinesisSinkConfig,
    "kinesis",
    KinesisSink,
    streams,
    stream_problem,
    kinesis_extra,
    false
);

/// Nothing else to check.
fn kinesis_extra(_config: &KinesisSinkConfig) -> Vec<String> {
    Vec::new()
}

#[cfg(feature = "aws")]
/// A message's record: its partition key and data.
///
/// # Errors
/// A permanent failure when the record is over Kinesis's limit.
pub fn record(
    config: &KinesisSinkConfig,
    message: &crate::sinks::OutgoingMessage,
) -> Result<(String, Vec<u8>), SinkError> {
    let key = match config.partition_key {
        PartitionKey::Aggregate => super::aggregate_id(message),
        PartitionKey::Key => message
            .key
            .as_deref()
            .unwrap_or_else(|| super::aggregate_id(message)),
    };
    // Kinesis hashes the key with MD5 to choose a shard: a digest of a key
    // too long for it keeps the aggregate on one shard all the same.
    let key = super::fitted(key, 256, |_| true);
    let data = match config.record {
        RecordFormat::Payload => message.payload.to_vec(),
        RecordFormat::Envelope => crate::sinks::order::envelope(message).to_string().into_bytes(),
    };
    let size = data.len() + key.len();
    if size > MAX_RECORD_BYTES {
        return Err(SinkError::permanent(format!(
            "the record is {size} bytes with its partition key{}; Kinesis takes at most {MAX_RECORD_BYTES} \
             (1 MiB) a record",
            if config.record == RecordFormat::Envelope {
                " and its envelope"
            } else {
                ""
            }
        )));
    }
    Ok((key, data))
}

#[cfg(feature = "aws")]
mod sink {
    use std::collections::HashSet;
    use std::time::Duration;

    use aws_sdk_kinesis::Client;
    use aws_sdk_kinesis::primitives::Blob;
    use aws_sdk_kinesis::types::PutRecordsRequestEntry;
    use futures::future::BoxFuture;

    use super::{KinesisSinkConfig, MAX_CALL_BYTES, MAX_CALL_RECORDS, record};
    use crate::sinks::aws::attributes;
    use crate::sinks::aws::client::{Connection, only_denied};
    use crate::sinks::aws::{EntryFailure, entry_outcomes, in_order, per_topic};
    use crate::sinks::{FailureKind, OutgoingMessage, Sink, SinkError};

    /// Kinesis data streams as a target.
    pub struct KinesisSink {
        name: String,
        config: KinesisSinkConfig,
        connection: Connection,
        client: Client,
    }

    impl KinesisSink {
        /// A sink for `config`; a call takes at most `timeout`.
        pub async fn connect(name: &str, config: &KinesisSinkConfig, timeout: Duration) -> KinesisSink {
            let connection = Connection::new(&config.connection(), timeout).await;
            let client = Client::new(&connection.sdk);
            KinesisSink {
                name: name.to_string(),
                config: config.clone(),
                connection,
                client,
            }
        }

        async fn describe(&self, stream: &str) -> Result<(), SinkError> {
            let request = self.client.describe_stream_summary();
            let request = if stream.starts_with("arn:") {
                request.stream_arn(stream)
            } else {
                request.stream_name(stream)
            };
            request.send().await.map(|_| ()).map_err(|e| {
                self.connection
                    .classify(&e, "Kinesis", &format!("stream {stream}"))
            })
        }

        /// Each listed stream that does not exist or may not be read.
        ///
        /// # Errors
        /// Kinesis could not be asked.
        pub async fn listed_problems(&self) -> Result<Vec<String>, SinkError> {
            let mut problems = Vec::new();
            for stream in &self.config.streams {
                match self.describe(stream).await {
                    Ok(()) => {}
                    Err(e) if matches!(e.kind, FailureKind::UnknownTopic | FailureKind::Unauthorized) => {
                        problems.push(e.message);
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(problems)
        }

        async fn send_stream(
            &self,
            stream: &str,
            messages: Vec<(usize, &OutgoingMessage)>,
        ) -> Vec<(usize, Result<(), SinkError>)> {
            // A name the service would refuse fails its messages now: asked
            // for, it could read as a missing stream, which waits for ever.
            if let Some(problem) = super::stream_problem(stream) {
                let error = SinkError::permanent(problem);
                return messages
                    .into_iter()
                    .map(|(index, _)| (index, Err(error.clone())))
                    .collect();
            }
            let mut results = Vec::with_capacity(messages.len());
            let mut ready = Vec::with_capacity(messages.len());
            for (index, message) in messages {
                match record(&self.config, message) {
                    Ok((key, data)) => ready.push((index, key.clone(), (key, data))),
                    Err(e) => results.push((index, Err(e))),
                }
            }
            // Records of one key go one per call: PutRecords answers each
            // record on its own, and a throttled earlier record with a
            // stored later one would be out of order.
            results.extend(
                in_order(ready, |round: Vec<(usize, (String, Vec<u8>))>| async move {
                    let sizes: Vec<usize> = round.iter().map(|(_, (k, d))| k.len() + d.len()).collect();
                    let mut sent = Vec::with_capacity(round.len());
                    let mut round = round.into_iter();
                    for run in attributes::batches(&sizes, MAX_CALL_RECORDS, MAX_CALL_BYTES) {
                        let batch: Vec<(usize, (String, Vec<u8>))> = round.by_ref().take(run.len()).collect();
                        sent.extend(self.send_batch(stream, batch).await);
                    }
                    sent
                })
                .await,
            );
            results
        }

        async fn send_batch(
            &self,
            stream: &str,
            batch: Vec<(usize, (String, Vec<u8>))>,
        ) -> Vec<(usize, Result<(), SinkError>)> {
            let mut entries = Vec::with_capacity(batch.len());
            let mut indexes = Vec::with_capacity(batch.len());
            for (index, (key, data)) in batch {
                indexes.push(index);
                match PutRecordsRequestEntry::builder()
                    .partition_key(key)
                    .data(Blob::new(data))
                    .build()
                {
                    Ok(entry) => entries.push(entry),
                    Err(e) => {
                        let error = SinkError::permanent(format!("Kinesis record: {e}"));
                        return indexes
                            .into_iter()
                            .map(|index| (index, Err(error.clone())))
                            .collect();
                    }
                }
            }
            let request = self.client.put_records().set_records(Some(entries));
            let request = if stream.starts_with("arn:") {
                request.stream_arn(stream)
            } else {
                request.stream_name(stream)
            };
            let output = match request.send().await {
                Ok(output) => output,
                Err(e) => {
                    let error = self
                        .connection
                        .classify(&e, "Kinesis", &format!("stream {stream}"));
                    return indexes
                        .into_iter()
                        .map(|index| (index, Err(error.clone())))
                        .collect();
                }
            };
            // The answer's records are the request's, in order.
            let mut failed = Vec::new();
            let mut succeeded = HashSet::new();
            for (at, entry) in output.records().iter().enumerate() {
                match entry.error_code() {
                    Some(code) => failed.push(EntryFailure {
                        id: at.to_string(),
                        code,
                        sender_fault: None,
                        message: entry.error_message(),
                    }),
                    None if entry.sequence_number().is_some() => {
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
                "Kinesis",
                &format!("stream {stream}"),
            )
        }
    }

    impl Sink for KinesisSink {
        fn kind(&self) -> &'static str {
            "kinesis"
        }

        fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
            Box::pin(async move { per_topic(&messages, |stream, list| self.send_stream(stream, list)).await })
        }

        /// Kinesis answers and takes the credentials: the first listed
        /// stream exists, or with none listed, a one-stream list. A refused
        /// read permission still shows both.
        fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
            Box::pin(async move {
                let checked = match self.config.streams.first() {
                    Some(stream) => self.describe(stream).await,
                    None => self
                        .client
                        .list_streams()
                        .limit(1)
                        .send()
                        .await
                        .map(|_| ())
                        .map_err(|e| self.connection.classify(&e, "Kinesis", "the account's streams")),
                };
                match checked {
                    Err(e) if only_denied(&e) => {
                        tracing::debug!(sink.name = %self.name, error = %e, "Kinesis health check: a read the identity may not do; it signed in.");
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

    fn config(text: &str) -> KinesisSinkConfig {
        toml::from_str(text).unwrap()
    }

    fn message(payload: &[u8]) -> OutgoingMessage {
        OutgoingMessage {
            topic: "s".into(),
            payload: payload.to_vec().into(),
            headers: vec![
                ("Switchyard-Event-Id".into(), "e-1".into()),
                ("Switchyard-Aggregate-Id".into(), "order-7".into()),
            ],
            key: Some("k".into()),
            ..OutgoingMessage::default()
        }
    }

    #[test]
    fn a_record_is_an_envelope_keyed_by_the_aggregate() {
        let (key, data) = record(&config(""), &message(b"{\"a\":1}")).unwrap();
        assert_eq!(key, "order-7");
        let envelope: serde_json::Value = serde_json::from_slice(&data).unwrap();
        assert_eq!(envelope["headers"]["Switchyard-Event-Id"], "e-1");
        assert_eq!(envelope["payload"]["a"], 1);
        let (_, data) = record(&config(""), &message(&[0xff, 0x00])).unwrap();
        let envelope: serde_json::Value = serde_json::from_slice(&data).unwrap();
        assert_eq!(
            (envelope["payload"].as_str(), envelope["payload_base64"].as_bool()),
            (Some("/wA="), Some(true))
        );
        let (key, data) = record(
            &config("partition_key = \"key\"\nrecord = \"payload\""),
            &message(b"raw"),
        )
        .unwrap();
        assert_eq!((key.as_str(), data.as_slice()), ("k", b"raw".as_slice()));
    }

    #[test]
    fn a_record_over_a_mebibyte_is_refused_named() {
        let big = vec![b'x'; MAX_RECORD_BYTES];
        let error = record(&config("record = \"payload\""), &message(&big)).unwrap_err();
        assert!(error.message.contains("1 MiB"), "{}", error.message);
    }
}
