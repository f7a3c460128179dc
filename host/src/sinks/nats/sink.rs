//! Publishing to NATS and classifying its failures.
//!
//! Two rules keep "acknowledged" honest:
//! - A publish is never handed to a client that is not connected. async-nats
//!   buffers commands while it reconnects and sends them when the server is
//!   back, long after the relay gave up on them and scheduled its own retry;
//!   a retry that comes after JetStream's duplicate window then stores the
//!   event twice. The client makes one reconnect attempt of its own (so a
//!   publish caught in the moment the connection dropped goes out at once
//!   or never); past that the sink connects a new client in the background,
//!   and publishes fail fast (retryable) meanwhile.
//! - Core NATS has no ack. A batch counts as taken only when a marker sent
//!   after it comes back through the server on the same connection: the
//!   server handles a connection's messages in order, so it read all of
//!   them. A flush proves only that bytes left this process.

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_nats::connection::State;
use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::{self, context::PublishErrorKind};
use async_nats::{HeaderMap, client::PublishErrorKind as CorePublishErrorKind};
use futures::StreamExt;
use futures::future::{BoxFuture, join_all};

use super::config::{NatsMode, NatsSinkConfig};
use crate::sinks::{FailureKind, KEY_HEADER, OutgoingMessage, Sink, SinkError};

/// The server's default `max_control_line`: a publish whose protocol line
/// (subject, reply, sizes) is longer makes the server close the connection,
/// taking every message still in flight on it along.
const MAX_CONTROL_LINE: usize = 4096;

/// Room kept in the control line for the verb, reply subject and sizes.
const CONTROL_LINE_OVERHEAD: usize = 128;

/// One client and what was built on it; replaced whole after it gives up.
struct Connection {
    client: async_nats::Client,
    jetstream: Option<jetstream::Context>,
}

/// A connected NATS target.
pub struct NatsSink {
    name: String,
    config: NatsSinkConfig,
    publish_timeout: Duration,
    /// How long after a first attempt the relay may still retry an event:
    /// the duplicate window every stream written to must cover.
    retry_horizon: Duration,
    connection: Arc<RwLock<Arc<Connection>>>,
    /// Set while a background task is connecting a replacement client.
    reconnecting: Arc<AtomicBool>,
    /// Streams whose duplicate window was already checked.
    checked_streams: Arc<Mutex<HashSet<String>>>,
}

impl NatsSink {
    /// Connects to the server(s) in `config`.
    ///
    /// # Errors
    /// The connection error (unreachable server, bad credentials), or a
    /// configured stream that cannot be created or deduplicates over less
    /// than `duplicate_window_seconds`.
    pub async fn connect(
        name: &str,
        config: &NatsSinkConfig,
        publish_timeout: Duration,
        retry_horizon: Duration,
    ) -> Result<NatsSink, SinkError> {
        let connection = open(config, publish_timeout).await?;
        if let (Some(context), Some(stream)) = (&connection.jetstream, &config.stream) {
            let window = config.duplicate_window();
            let created = context
                .get_or_create_stream(jetstream::stream::Config {
                    name: stream.name.clone(),
                    subjects: stream.subjects.clone(),
                    duplicate_window: window,
                    ..Default::default()
                })
                .await
                .map_err(|e| {
                    SinkError::unavailable(format!("cannot create JetStream stream {:?}: {e}", stream.name))
                })?;
            let found = created.cached_info().config.duplicate_window;
            if found < window {
                return Err(SinkError::permanent(format!(
                    "JetStream stream {:?} deduplicates over {} s, less than duplicate_window_seconds ({} s): \
                     raise the stream's duplicate window (nats stream edit {} --dupe-window {}s)",
                    stream.name,
                    found.as_secs(),
                    window.as_secs(),
                    stream.name,
                    window.as_secs()
                )));
            }
        }
        Ok(NatsSink {
            name: name.to_string(),
            config: config.clone(),
            publish_timeout,
            retry_horizon,
            connection: Arc::new(RwLock::new(Arc::new(connection))),
            reconnecting: Arc::new(AtomicBool::new(false)),
            checked_streams: Arc::new(Mutex::new(HashSet::new())),
        })
    }

    fn current(&self) -> Arc<Connection> {
        match self.connection.read() {
            Ok(connection) => Arc::clone(&connection),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// The current client if it is connected; otherwise starts connecting a
    /// replacement (once) and says why nothing can be sent now.
    fn connected(&self) -> Result<Arc<Connection>, SinkError> {
        let connection = self.current();
        if connection.client.connection_state() == State::Connected {
            return Ok(connection);
        }
        self.replace_in_background(&connection);
        Err(SinkError::unavailable(format!(
            "not connected to NATS ({}); reconnecting",
            self.name
        )))
    }

    fn replace_in_background(&self, stale: &Arc<Connection>) {
        if self.reconnecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let (name, config, timeout) = (self.name.clone(), self.config.clone(), self.publish_timeout);
        let (slot, flag, stale) = (
            Arc::clone(&self.connection),
            Arc::clone(&self.reconnecting),
            Arc::clone(stale),
        );
        tokio::spawn(async move {
            // Short: the target is paused meanwhile and resumes only once
            // connected; a refused connect costs nothing.
            let mut delay =
                crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
            let mut failures = 0u64;
            loop {
                // The old client's own single attempt may have worked.
                if stale.client.connection_state() == State::Connected {
                    break;
                }
                match open(&config, timeout).await {
                    Ok(fresh) => {
                        tracing::info!(sink.name = %name, "Connected to NATS again.");
                        match slot.write() {
                            Ok(mut current) => *current = Arc::new(fresh),
                            Err(poisoned) => *poisoned.into_inner() = Arc::new(fresh),
                        }
                        break;
                    }
                    Err(error) => {
                        // One line a minute, not one a try.
                        if failures.is_multiple_of(120) {
                            tracing::warn!(sink.name = %name, %error, failures, "NATS is still unreachable; reconnecting.");
                        }
                        failures += 1;
                        tokio::time::sleep(delay.next_pause()).await;
                    }
                }
            }
            flag.store(false, Ordering::Release);
        });
    }

    /// Asks the JetStream API for account info. A raw request rather than the
    /// client's typed call, whose schema follows the newest servers and fails
    /// to parse older ones (2.9) even when JetStream works.
    async fn jetstream_info(&self, client: &async_nats::Client) -> Result<(), SinkError> {
        let reply = client
            .request("$JS.API.INFO", bytes::Bytes::new())
            .await
            .map_err(|e| SinkError::unavailable(format!("{}: JetStream is not available: {e}", self.name)))?;
        let info: serde_json::Value = serde_json::from_slice(&reply.payload)
            .map_err(|e| SinkError::unavailable(format!("{}: JetStream answered garbage: {e}", self.name)))?;
        match info.get("error") {
            None => Ok(()),
            Some(error) => Err(SinkError::unavailable(format!(
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
        connection: &Connection,
        context: &jetstream::Context,
        messages: Vec<OutgoingMessage>,
    ) -> Vec<Result<(), SinkError>> {
        // Send everything first, then await the acks together: one round trip
        // per batch rather than per message.
        let mut pending = Vec::with_capacity(messages.len());
        for message in messages {
            if connection.client.connection_state() != State::Connected {
                // Dropped mid-batch: hand nothing more to a reconnecting client.
                pending.push(Err(SinkError::unavailable(
                    "NATS connection lost during the batch",
                )));
                continue;
            }
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
                    .map_err(|e| classify_jetstream(e.kind(), &e.to_string()).with_source(e)),
            );
        }
        let results = join_all(pending.into_iter().map(|sent| async move {
            let ack = sent?;
            match ack.await {
                Ok(ack) => Ok(Some(ack.stream)),
                Err(e) => Err(classify_jetstream(e.kind(), &e.to_string()).with_source(e)),
            }
        }))
        .await;
        let mut streams = HashSet::new();
        let results = results
            .into_iter()
            .map(|result| {
                result.map(|stream| {
                    if let Some(stream) = stream {
                        streams.insert(stream);
                    }
                })
            })
            .collect();
        for stream in streams {
            self.check_stream_window(&connection.client, stream);
        }
        results
    }

    /// Once per stream the target writes into: warn if its duplicate window
    /// is shorter than the relay's retry horizon.
    fn check_stream_window(&self, client: &async_nats::Client, stream: String) {
        let first = match self.checked_streams.lock() {
            Ok(mut checked) => checked.insert(stream.clone()),
            Err(_) => false,
        };
        if !first {
            return;
        }
        let (client, name, wanted) = (client.clone(), self.name.clone(), self.retry_horizon);
        tokio::spawn(async move {
            let Ok(reply) = client
                .request(format!("$JS.API.STREAM.INFO.{stream}"), bytes::Bytes::new())
                .await
            else {
                return;
            };
            let info: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap_or_default();
            let Some(nanos) = info["config"]["duplicate_window"].as_u64() else {
                return;
            };
            let window = Duration::from_nanos(nanos);
            if window < wanted {
                tracing::warn!(
                    sink.name = %name,
                    nats.stream = %stream,
                    stream_window_s = window.as_secs(),
                    retry_horizon_s = wanted.as_secs(),
                    "This stream deduplicates over less than the relay's retry horizon: a late retry may store an event twice. Raise the stream's duplicate window."
                );
            }
        });
    }

    async fn publish_core(
        &self,
        connection: &Connection,
        messages: Vec<OutgoingMessage>,
    ) -> Vec<Result<(), SinkError>> {
        let client = &connection.client;
        let statistics = client.statistics();
        let connects = statistics.connects.load(Ordering::Acquire);
        // The marker comes back on this subscription once the server has
        // read everything published before it.
        let inbox = client.new_inbox();
        let mut marker = match client.subscribe(inbox.clone()).await {
            Ok(subscription) => subscription,
            Err(e) => {
                let error =
                    SinkError::unavailable(format!("NATS subscribe for the publish check failed: {e}"));
                return vec![Err(error); messages.len()];
            }
        };
        let mut results = Vec::with_capacity(messages.len());
        for message in messages {
            let outcome = match check_subject(&message.topic).and_then(|()| headers(&message)) {
                Ok(headers) => client
                    .publish_with_headers(message.topic, headers, message.payload)
                    .await
                    .map_err(|e| classify_core(e.kind(), &e.to_string()).with_source(e)),
                Err(e) => Err(e),
            };
            results.push(outcome);
        }
        let confirmed = async {
            client
                .publish(inbox, bytes::Bytes::new())
                .await
                .map_err(|e| format!("NATS publish failed: {e}"))?;
            client
                .flush()
                .await
                .map_err(|e| format!("NATS flush failed: {e}"))?;
            marker
                .next()
                .await
                .map(drop)
                .ok_or_else(|| "NATS connection closed before the server confirmed".to_string())
        };
        let confirmed = match tokio::time::timeout(self.publish_timeout, confirmed).await {
            Ok(Ok(())) if statistics.connects.load(Ordering::Acquire) == connects => Ok(()),
            // A reconnect in between: messages sent on the old connection
            // after the server stopped reading it are gone.
            Ok(Ok(())) => Err(SinkError::unavailable(
                "NATS connection was lost during the batch",
            )),
            Ok(Err(error)) => Err(SinkError::unavailable(error)),
            Err(_) => Err(SinkError::timed_out(format!(
                "NATS server did not confirm within {} ms",
                self.publish_timeout.as_millis()
            ))),
        };
        let _ = marker.unsubscribe().await;
        if let Err(error) = confirmed {
            for result in &mut results {
                if result.is_ok() {
                    *result = Err(error.clone());
                }
            }
        }
        results
    }
}

/// Connects one client: a single reconnect attempt of its own, so that
/// publishes it buffered while the connection dropped go out promptly or
/// never (see the module docs).
async fn open(config: &NatsSinkConfig, publish_timeout: Duration) -> Result<Connection, SinkError> {
    let options = config
        .connect_options()
        .await
        .map_err(|reason| SinkError::new(FailureKind::Unauthorized, format!("NATS login: {reason}")))?;
    // The URLs without the login they may carry: that went into `options`.
    let (servers, _) = config
        .url_login()
        .map_err(|reason| SinkError::new(FailureKind::Unauthorized, format!("NATS login: {reason}")))?;
    let client = options
        .connection_timeout(publish_timeout)
        .max_reconnects(Some(1))
        .connect(servers.as_str())
        .await
        .map_err(|e| {
            let kind = match e.kind() {
                async_nats::ConnectErrorKind::AuthorizationViolation
                | async_nats::ConnectErrorKind::Authentication => FailureKind::Unauthorized,
                _ => FailureKind::Unavailable,
            };
            SinkError::new(
                kind,
                crate::redact::url(&format!("cannot connect to NATS at {}: {e}", config.url)),
            )
        })?;
    let jetstream = (config.mode == NatsMode::Jetstream).then(|| {
        jetstream::ContextBuilder::new()
            .timeout(publish_timeout)
            .max_ack_inflight(config.max_ack_inflight)
            .backpressure_on_inflight(true)
            .build(client.clone())
    });
    Ok(Connection { client, jetstream })
}

/// What the server accepts as a publish subject: dot-separated non-empty
/// tokens without whitespace, control characters or wildcards, short enough
/// for its control line. Anything else is refused on every attempt, and a
/// too-long one closes the connection under the batch's other messages.
pub(crate) fn check_subject(subject: &str) -> Result<(), SinkError> {
    if subject.len() > MAX_CONTROL_LINE - CONTROL_LINE_OVERHEAD {
        return Err(SinkError::permanent(format!(
            "NATS subject is {} bytes, over the {} the server's control line allows",
            subject.len(),
            MAX_CONTROL_LINE - CONTROL_LINE_OVERHEAD
        )));
    }
    let valid = !subject.is_empty()
        && subject.split('.').all(|token| {
            !token.is_empty()
                && token != "*"
                && token != ">"
                && !token.chars().any(|c| c.is_whitespace() || c.is_control())
        });
    if valid {
        Ok(())
    } else {
        Err(SinkError::permanent(format!("invalid NATS subject {subject:?}")))
    }
}

/// The message's headers and key as a NATS header map. The relay's own
/// headers carry the row's aggregate type and id, which a service may have
/// written with a line break; NATS headers cannot carry one (async-nats
/// panics on it unchecked), so such a message is refused for good, naming
/// the header.
fn headers(message: &OutgoingMessage) -> Result<HeaderMap, SinkError> {
    let checked = |name: &str, value: &str| {
        HeaderValue::from_str(value).map_err(|_| {
            SinkError::permanent(format!(
                "header {name:?} has a line break in its value, which NATS headers cannot carry"
            ))
        })
    };
    let mut map = HeaderMap::new();
    for (name, text) in &message.headers {
        let value = checked(name, text)?;
        let name = HeaderName::from_str(name)
            .map_err(|e| SinkError::permanent(format!("header name {name:?} is not valid on NATS: {e}")))?;
        map.append(name, value);
    }
    if let Some(key) = &message.key {
        map.insert(KEY_HEADER, checked(KEY_HEADER, key)?);
    }
    Ok(map)
}

fn classify_core(kind: CorePublishErrorKind, detail: &str) -> SinkError {
    match kind {
        CorePublishErrorKind::MaxPayloadExceeded => {
            SinkError::permanent(format!("NATS rejected the message as too large: {detail}"))
        }
        CorePublishErrorKind::InvalidSubject => {
            SinkError::permanent(format!("invalid NATS subject: {detail}"))
        }
        CorePublishErrorKind::Send => SinkError::unavailable(format!("NATS publish failed: {detail}")),
    }
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
        // No stream yet, server down, slow or saturated: an operator or time
        // fixes these, not another attempt of the event.
        PublishErrorKind::StreamNotFound => SinkError::new(
            FailureKind::UnknownTopic,
            format!("no JetStream stream captures this subject (create one): {detail}"),
        ),
        PublishErrorKind::TimedOut => SinkError::timed_out(format!("JetStream publish timed out: {detail}")),
        PublishErrorKind::BrokenPipe | PublishErrorKind::MaxAckPending => {
            SinkError::unavailable(format!("JetStream publish failed: {detail}"))
        }
        PublishErrorKind::Other => SinkError::retryable(format!("JetStream publish failed: {detail}")),
    }
}

impl Sink for NatsSink {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let connection = match self.connected() {
                Ok(connection) => connection,
                Err(error) => return vec![Err(error); messages.len()],
            };
            match &connection.jetstream {
                Some(context) => self.publish_jetstream(&connection, context, messages).await,
                None => self.publish_core(&connection, messages).await,
            }
        })
    }

    fn deduplicates_by_id(&self) -> bool {
        crate::sinks::TargetKind::deduplicates_by_id(&self.config)
    }

    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async move {
            let connection = self.connected()?;
            let client = &connection.client;
            match &connection.jetstream {
                Some(_) => tokio::time::timeout(self.publish_timeout, self.jetstream_info(client))
                    .await
                    .map_err(|_| SinkError::timed_out(format!("{}: JetStream did not answer", self.name)))?,
                None => tokio::time::timeout(self.publish_timeout, client.flush())
                    .await
                    .map_err(|_| SinkError::timed_out(format!("{}: NATS did not answer", self.name)))?
                    .map_err(|e| SinkError::unavailable(format!("{}: NATS flush failed: {e}", self.name))),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_checked_as_the_server_would() {
        assert!(check_subject("orders.created.v1").is_ok());
        for bad in [
            "",
            "orders..x",
            "orders.*",
            "orders.>",
            "orders x",
            "orders\tx",
            "orders\u{0}x",
            "orders\r\nPUB evil 1",
        ] {
            let error = check_subject(bad).unwrap_err();
            assert_eq!(error.kind, FailureKind::Refused, "{bad:?}");
        }
        let long = format!("a.{}", "b".repeat(100 * 1024));
        let error = check_subject(&long).unwrap_err();
        assert!(
            error.kind == FailureKind::Refused && error.message.contains("control line"),
            "{}",
            error.message
        );
        assert!(check_subject(&"a".repeat(MAX_CONTROL_LINE - CONTROL_LINE_OVERHEAD)).is_ok());
    }

    #[test]
    fn errors_are_sorted_by_whose_fault_they_are() {
        let core = [
            (CorePublishErrorKind::MaxPayloadExceeded, FailureKind::Refused),
            (CorePublishErrorKind::InvalidSubject, FailureKind::Refused),
            (CorePublishErrorKind::Send, FailureKind::Unavailable),
        ];
        for (error, kind) in core {
            assert_eq!(classify_core(error, "x").kind, kind, "{error:?}");
        }
        let jetstream = [
            (PublishErrorKind::StreamNotFound, FailureKind::UnknownTopic),
            (PublishErrorKind::BrokenPipe, FailureKind::Unavailable),
            (PublishErrorKind::TimedOut, FailureKind::TimedOut),
            (PublishErrorKind::MaxPayloadExceeded, FailureKind::Refused),
        ];
        for (error, kind) in jetstream {
            assert_eq!(classify_jetstream(error, "x").kind, kind, "{error:?}");
        }
    }
}
