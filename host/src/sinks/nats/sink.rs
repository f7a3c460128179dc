//! Publishing to NATS and classifying its failures.

use std::str::FromStr;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::{self, context::PublishErrorKind};
use futures::future::{BoxFuture, join_all};

use super::config::{NatsMode, NatsSinkConfig};
use crate::sinks::{OutgoingMessage, Sink, SinkError};

/// Header carrying the message key on NATS, which has no keys of its own.
pub const KEY_HEADER: &str = "Switchyard-Key";

/// A connected NATS target.
pub struct NatsSink {
    name: String,
    client: async_nats::Client,
    jetstream: Option<jetstream::Context>,
    publish_timeout: Duration,
}

impl NatsSink {
    /// Connects to the server(s) in `config`.
    ///
    /// # Errors
    /// The connection error (unreachable server, bad credentials).
    pub async fn connect(
        name: &str,
        config: &NatsSinkConfig,
        publish_timeout: Duration,
    ) -> Result<NatsSink, SinkError> {
        let client = config
            .connect_options()
            .connection_timeout(publish_timeout)
            .connect(config.url.as_str())
            .await
            .map_err(|e| SinkError::retryable(format!("cannot connect to NATS at {}: {e}", config.url)))?;
        let jetstream = (config.mode == NatsMode::Jetstream).then(|| {
            jetstream::ContextBuilder::new()
                .timeout(publish_timeout)
                .max_ack_inflight(config.max_ack_inflight)
                .backpressure_on_inflight(true)
                .build(client.clone())
        });
        if let (Some(context), Some(stream)) = (&jetstream, &config.stream) {
            context
                .get_or_create_stream(jetstream::stream::Config {
                    name: stream.name.clone(),
                    subjects: stream.subjects.clone(),
                    ..Default::default()
                })
                .await
                .map_err(|e| {
                    SinkError::retryable(format!("cannot create JetStream stream {:?}: {e}", stream.name))
                })?;
        }
        Ok(NatsSink {
            name: name.to_string(),
            client,
            jetstream,
            publish_timeout,
        })
    }

    /// Asks the JetStream API for account info. A raw request rather than the
    /// client's typed call, whose schema follows the newest servers and fails
    /// to parse older ones (2.9) even when JetStream works.
    async fn jetstream_info(&self) -> Result<(), SinkError> {
        let reply = self
            .client
            .request("$JS.API.INFO", bytes::Bytes::new())
            .await
            .map_err(|e| SinkError::retryable(format!("{}: JetStream is not available: {e}", self.name)))?;
        let info: serde_json::Value = serde_json::from_slice(&reply.payload)
            .map_err(|e| SinkError::retryable(format!("{}: JetStream answered garbage: {e}", self.name)))?;
        match info.get("error") {
            None => Ok(()),
            Some(error) => Err(SinkError::retryable(format!(
                "{}: JetStream is not available: {}",
                self.name,
                error
                    .get("description")
                    .and_then(|d| d.as_str())
                    .unwrap_or("unknown error")
            ))),
        }
    }

    async fn publish_jetstream(
        &self,
        context: &jetstream::Context,
        messages: Vec<OutgoingMessage>,
    ) -> Vec<Result<(), SinkError>> {
        // Send everything first, then await the acks together: one round trip
        // per batch rather than per message.
        let mut pending = Vec::with_capacity(messages.len());
        for message in messages {
            let headers = match check_subject(&message.topic).and_then(|()| headers(&message)) {
                Ok(headers) => headers,
                Err(e) => {
                    pending.push(Err(e));
                    continue;
                }
            };
            let publish = jetstream::message::PublishMessage::build()
                .payload(message.payload)
                .headers(headers)
                .message_id(message.dedup_id.as_str());
            pending.push(
                context
                    .send_publish(message.topic, publish)
                    .await
                    .map_err(|e| classify_jetstream(e.kind(), &e.to_string())),
            );
        }
        join_all(pending.into_iter().map(|sent| async move {
            let ack = sent?;
            match ack.await {
                Ok(_) => Ok(()),
                Err(e) => Err(classify_jetstream(e.kind(), &e.to_string())),
            }
        }))
        .await
    }

    async fn publish_core(&self, messages: Vec<OutgoingMessage>) -> Vec<Result<(), SinkError>> {
        let mut results = Vec::with_capacity(messages.len());
        for message in messages {
            let outcome = match check_subject(&message.topic).and_then(|()| headers(&message)) {
                Ok(headers) => self
                    .client
                    .publish_with_headers(message.topic, headers, message.payload)
                    .await
                    .map_err(|e| SinkError::retryable(format!("NATS publish failed: {e}"))),
                Err(e) => Err(e),
            };
            results.push(outcome);
        }
        // Core NATS has no per-message ack: a flush that returns means the
        // server has read everything sent before it.
        let flushed = tokio::time::timeout(self.publish_timeout, self.client.flush()).await;
        let flush_error = match flushed {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(SinkError::retryable(format!("NATS flush failed: {e}"))),
            Err(_) => Some(SinkError::retryable(format!(
                "NATS flush not confirmed within {} ms",
                self.publish_timeout.as_millis()
            ))),
        };
        if let Some(error) = flush_error {
            for result in &mut results {
                if result.is_ok() {
                    *result = Err(error.clone());
                }
            }
        }
        results
    }
}

/// Publish subjects are dot-separated non-empty tokens without whitespace or
/// wildcards; anything else is refused by the server on every attempt.
fn check_subject(subject: &str) -> Result<(), SinkError> {
    let valid = !subject.is_empty()
        && subject.split('.').all(|token| {
            !token.is_empty() && token != "*" && token != ">" && !token.chars().any(char::is_whitespace)
        });
    if valid {
        Ok(())
    } else {
        Err(SinkError::permanent(format!("invalid NATS subject {subject:?}")))
    }
}

fn headers(message: &OutgoingMessage) -> Result<HeaderMap, SinkError> {
    let mut map = HeaderMap::new();
    for (name, value) in &message.headers {
        let name = HeaderName::from_str(name)
            .map_err(|e| SinkError::permanent(format!("header name {name:?} is not valid on NATS: {e}")))?;
        map.append(name, HeaderValue::from(value.as_str()));
    }
    if let Some(key) = &message.key {
        map.insert(KEY_HEADER, HeaderValue::from(key.as_str()));
    }
    Ok(map)
}

fn classify_jetstream(kind: PublishErrorKind, detail: &str) -> SinkError {
    match kind {
        // The server refuses this size on every attempt.
        PublishErrorKind::MaxPayloadExceeded => {
            SinkError::permanent(format!("NATS rejected the message as too large: {detail}"))
        }
        // Optimistic-concurrency headers are never set by the relay; if a
        // plugin set them, retrying cannot change the answer.
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            SinkError::permanent(format!("JetStream refused the message: {detail}"))
        }
        // No stream yet, server down, slow or saturated: an operator or time fixes these.
        PublishErrorKind::StreamNotFound => SinkError::retryable(format!(
            "no JetStream stream captures this subject (create one): {detail}"
        )),
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending
        | PublishErrorKind::Other => SinkError::retryable(format!("JetStream publish failed: {detail}")),
    }
}

impl Sink for NatsSink {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            match &self.jetstream {
                Some(context) => self.publish_jetstream(context, messages).await,
                None => self.publish_core(messages).await,
            }
        })
    }

    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async move {
            match &self.jetstream {
                Some(_) => tokio::time::timeout(self.publish_timeout, self.jetstream_info())
                    .await
                    .map_err(|_| SinkError::retryable(format!("{}: JetStream did not answer", self.name)))?,
                None => tokio::time::timeout(self.publish_timeout, self.client.flush())
                    .await
                    .map_err(|_| SinkError::retryable(format!("{}: NATS did not answer", self.name)))?
                    .map_err(|e| SinkError::retryable(format!("{}: NATS flush failed: {e}", self.name))),
            }
        })
    }
}
