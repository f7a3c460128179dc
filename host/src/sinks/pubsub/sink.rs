//! Publishing to Pub/Sub through Google's client: one publisher per topic,
//! each message acknowledged when the service returned its message id.
//!
//! Order: the relay has at most one event per aggregate in flight, so a
//! later event of an aggregate is never handed over before the earlier one
//! was acknowledged (or dead-lettered). The client adds its own rule: after
//! a failed publish with an ordering key, it refuses that key until told to
//! resume. Each call resumes its keys before publishing, which is the first
//! moment the relay may send that key again.

use std::collections::HashMap;
use std::time::Duration;

use futures::future::{BoxFuture, join_all};
use google_cloud_auth::credentials::{Credentials, anonymous, service_account};
use google_cloud_gax::error::rpc::Code;
use google_cloud_gax::retry_policy::{NeverRetry, RetryPolicyExt};
use google_cloud_pubsub::client::{BasePublisher, Publisher, TopicAdmin};
use google_cloud_pubsub::error::PublishError;
use google_cloud_pubsub::model::{Message, Topic};

use super::config::{OrderingKey, PubSubSinkConfig};
use crate::sinks::headers::AGGREGATE_ID_HEADER;
use crate::sinks::{FailureKind, KEY_HEADER, OutgoingMessage, Sink, SinkError};

/// The client starts a task per ordering key and keeps it for the life
/// of the publisher; a topic's publisher is replaced after this many keyed
/// messages so memory stays bounded with millions of aggregates.
const KEYED_MESSAGES_PER_PUBLISHER: usize = 10_000;

/// Topics with a publisher of their own; past this many (plugins that
/// name a topic per tenant or per day) the idle ones are let go.
const PUBLISHERS: usize = 1_000;

/// How long the client waits to fill a batch: a relay batch arrives all at
/// once, so this only gathers its messages into one call per key.
const BATCH_DELAY: Duration = Duration::from_millis(1);

/// Pub/Sub's limits on one message, checked before it is sent
/// (<https://cloud.google.com/pubsub/quotas#resource_limits>).
mod limits {
    /// A message: data, attributes and ordering key.
    pub const MESSAGE_BYTES: usize = 10 * 1024 * 1024;
    /// Attributes per message.
    pub const ATTRIBUTES: usize = 100;
    /// An attribute's key.
    pub const ATTRIBUTE_KEY_BYTES: usize = 256;
    /// An attribute's value.
    pub const ATTRIBUTE_VALUE_BYTES: usize = 1024;
    /// An ordering key.
    pub const ORDERING_KEY_BYTES: usize = 1024;
}

/// A Pub/Sub project's topics as a target.
pub struct PubSubSink {
    name: String,
    config: PubSubSinkConfig,
    base: BasePublisher,
    admin: TopicAdmin,
    publishers: std::sync::Mutex<HashMap<String, TopicPublisher>>,
}

/// One topic's publisher and how many keyed messages went through it.
struct TopicPublisher {
    publisher: Publisher,
    keyed: usize,
}

/// One message, checked and ready.
struct Ready {
    topic: String,
    ordering_key: String,
    message: Message,
}

impl PubSubSink {
    /// A sink for `config`. The client connects on first use; an RPC takes
    /// at most `publish_timeout` and is never retried by the client (the
    /// relay decides what a failure means).
    ///
    /// # Errors
    /// Credentials that cannot be read or built, refused: they will not
    /// mend by waiting.
    pub async fn connect(
        name: &str,
        config: &PubSubSinkConfig,
        publish_timeout: Duration,
    ) -> Result<PubSubSink, SinkError> {
        let credentials = credentials(config).await?;
        let policy = || NeverRetry.with_time_limit(publish_timeout);
        let mut base = BasePublisher::builder()
            .with_credentials(credentials.clone())
            .with_retry_policy(policy());
        let mut admin = TopicAdmin::builder()
            .with_credentials(credentials)
            .with_retry_policy(policy());
        if let Some(endpoint) = config.endpoint_url() {
            base = base.with_endpoint(&endpoint);
            admin = admin.with_endpoint(&endpoint);
        }
        let refused = |e: google_cloud_gax::client_builder::Error| {
            SinkError::permanent(format!(
                "target {name:?}: the Pub/Sub client cannot be built: {e}"
            ))
        };
        let sink = PubSubSink {
            name: name.to_string(),
            config: config.clone(),
            base: base.build().await.map_err(refused)?,
            admin: admin.build().await.map_err(refused)?,
            publishers: std::sync::Mutex::new(HashMap::new()),
        };
        sink.ensure_listed_topics().await?;
        Ok(sink)
    }

    /// Creates the listed topics that do not exist, with `create_topics`.
    async fn ensure_listed_topics(&self) -> Result<(), SinkError> {
        if !self.config.create_topics {
            return Ok(());
        }
        for topic in &self.config.topics {
            self.create_topic(&self.config.topic_name(topic)).await?;
        }
        Ok(())
    }

    /// Each listed topic that does not exist (made at connect with
    /// `create_topics`). A topic the account may not read is not a
    /// problem: the publisher role cannot.
    ///
    /// # Errors
    /// Pub/Sub could not be asked.
    pub async fn listed_topic_problems(&self) -> Result<Vec<String>, SinkError> {
        let mut problems = Vec::new();
        for topic in &self.config.topics {
            let name = self.config.topic_name(topic);
            match self.admin.get_topic().set_topic(&name).send().await {
                Ok(_) => {}
                Err(e) => match classify_rpc(&e, &name) {
                    missing if missing.kind == FailureKind::UnknownTopic => problems.push(missing.message),
                    _ if e.status().is_some_and(|s| s.code == Code::PermissionDenied) => {}
                    other => return Err(other),
                },
            }
        }
        Ok(problems)
    }

    /// Creates `name`; one that exists already is fine.
    async fn create_topic(&self, name: &str) -> Result<(), SinkError> {
        match self.admin.create_topic().set_name(name).send().await {
            Ok(_) => {
                tracing::info!(sink.name = %self.name, topic = %name, "Created the Pub/Sub topic (create_topics).");
                Ok(())
            }
            Err(e) if e.status().is_some_and(|s| s.code == Code::AlreadyExists) => Ok(()),
            Err(e) => Err(classify_rpc(&e, name)),
        }
    }

    /// Why Pub/Sub would refuse `message`, if it would; else the message.
    fn prepare(&self, message: OutgoingMessage) -> Result<Ready, SinkError> {
        let ordering_key = match self.config.ordering_key {
            OrderingKey::Aggregate => message
                .headers
                .iter()
                .find(|(name, _)| name == AGGREGATE_ID_HEADER)
                .map(|(_, value)| value.clone())
                .unwrap_or_default(),
            OrderingKey::Key => message.key.clone().unwrap_or_default(),
            OrderingKey::None => String::new(),
        };
        if ordering_key.len() > limits::ORDERING_KEY_BYTES {
            return Err(SinkError::permanent(format!(
                "the ordering key is {} bytes; Pub/Sub takes at most {} (ordering_key = {:?})",
                ordering_key.len(),
                limits::ORDERING_KEY_BYTES,
                self.config.ordering_key
            )));
        }
        let mut attributes: Vec<(String, String)> = message.headers;
        if let Some(key) = message.key {
            attributes.push((KEY_HEADER.to_string(), key));
        }
        check_attributes(&attributes)?;
        let size = message.payload.len()
            + ordering_key.len()
            + attributes.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        if size > limits::MESSAGE_BYTES {
            return Err(SinkError::permanent(format!(
                "the message is {size} bytes with its attributes; Pub/Sub takes at most {} per message",
                limits::MESSAGE_BYTES
            )));
        }
        Ok(Ready {
            topic: self.config.topic_name(&message.topic),
            message: Message::new()
                .set_data(message.payload)
                .set_attributes(attributes)
                .set_ordering_key(ordering_key.clone()),
            ordering_key,
        })
    }

    /// `topic`'s publisher, replaced once it has seen enough keys.
    fn publisher(&self, topic: &str, keyed: usize) -> Publisher {
        let mut publishers = self
            .publishers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let current = publishers
            .get_mut(topic)
            .filter(|p| p.keyed < KEYED_MESSAGES_PER_PUBLISHER);
        if let Some(current) = current {
            current.keyed += keyed;
            return current.publisher.clone();
        }
        if publishers.len() >= PUBLISHERS {
            // Calls in flight keep theirs until they are answered.
            publishers.clear();
        }
        let publisher = self
            .base
            .publisher(topic)
            .set_delay_threshold(BATCH_DELAY)
            .build();
        publishers.insert(
            topic.to_string(),
            TopicPublisher {
                publisher: publisher.clone(),
                keyed,
            },
        );
        publisher
    }

    async fn publish_checked(&self, ready: Vec<(usize, Ready)>, results: &mut [Result<(), SinkError>]) {
        let mut by_topic: HashMap<String, Vec<(usize, String, Message)>> = HashMap::new();
        for (index, ready) in ready {
            by_topic
                .entry(ready.topic)
                .or_default()
                .push((index, ready.ordering_key, ready.message));
        }
        let mut pending = Vec::new();
        // Held until every answer is in: a publisher replaced meanwhile
        // would otherwise shut down with these messages in it.
        let mut publishers = Vec::new();
        for (topic, messages) in by_topic {
            let keyed = messages.iter().filter(|(_, key, _)| !key.is_empty()).count();
            let publisher = self.publisher(&topic, keyed);
            let mut resumed = std::collections::HashSet::new();
            for (index, key, message) in messages {
                if !key.is_empty() && resumed.insert(key.clone()) {
                    publisher.resume_publish(key.clone());
                }
                pending.push((index, topic.clone(), key, publisher.publish(message)));
            }
            publishers.push(publisher);
        }
        let (places, futures): (Vec<_>, Vec<_>) = pending
            .into_iter()
            .map(|(index, topic, key, future)| ((index, topic, key), future))
            .unzip();
        let answers = join_all(futures).await;
        drop(publishers);
        // The client fails the messages after a failed one of the same key
        // as "paused": they carry the first failure's kind.
        let mut first_failure: HashMap<(String, String), SinkError> = HashMap::new();
        let mut missing_topics = Vec::new();
        for ((index, topic, key), answer) in places.into_iter().zip(answers) {
            results[index] = match answer {
                Ok(_message_id) => Ok(()),
                Err(PublishError::OrderingKeyPaused) => {
                    Err(first_failure.get(&(topic, key)).cloned().unwrap_or_else(|| {
                        SinkError::timed_out(
                            "an earlier publish of this ordering key did not succeed (it had timed out); \
                             the key is resumed for the next try",
                        )
                    }))
                }
                Err(error) => {
                    let error = classify(&error, &topic);
                    if error.kind == FailureKind::UnknownTopic && !missing_topics.contains(&topic) {
                        missing_topics.push(topic.clone());
                    }
                    first_failure.entry((topic, key)).or_insert_with(|| error.clone());
                    Err(error)
                }
            };
        }
        if self.config.create_topics {
            for topic in missing_topics {
                // Its messages wait (unknown_topic) and go at the next try.
                if let Err(e) = self.create_topic(&topic).await {
                    tracing::warn!(sink.name = %self.name, topic = %topic, error = %e, "Could not create the Pub/Sub topic.");
                }
            }
        }
    }
}

impl Sink for PubSubSink {
    fn kind(&self) -> &'static str {
        "pubsub"
    }

    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let mut results: Vec<Result<(), SinkError>> = Vec::with_capacity(messages.len());
            let mut ready = Vec::with_capacity(messages.len());
            for (index, message) in messages.into_iter().enumerate() {
                match self.prepare(message) {
                    Ok(message) => {
                        ready.push((index, message));
                        results.push(Ok(()));
                    }
                    Err(e) => results.push(Err(e)),
                }
            }
            self.publish_checked(ready, &mut results).await;
            results
        })
    }

    /// The service answers for the listed topics (each exists), or for the
    /// project when none are listed. An account with only the publisher
    /// role may not read topics: a refusal still shows the service is up
    /// and took the credentials.
    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async move {
            let checked = if let Some(topic) = self.config.topics.first() {
                let name = self.config.topic_name(topic);
                self.admin
                    .get_topic()
                    .set_topic(&name)
                    .send()
                    .await
                    .map(|_: Topic| ())
                    .map_err(|e| (e, name))
            } else {
                let project = format!("projects/{}", self.config.project);
                self.admin
                    .list_topics()
                    .set_project(&project)
                    .set_page_size(1)
                    .send()
                    .await
                    .map(|_| ())
                    .map_err(|e| (e, project))
            };
            match checked {
                Ok(()) => Ok(()),
                Err((e, _)) if e.status().is_some_and(|s| s.code == Code::PermissionDenied) => Ok(()),
                Err((e, name)) => Err(classify_rpc(&e, &name)),
            }
        })
    }
}

/// The credentials: none for the emulator, the key file, or Application
/// Default Credentials.
async fn credentials(config: &PubSubSinkConfig) -> Result<Credentials, SinkError> {
    if config.emulator_host.is_some() {
        return Ok(anonymous::Builder::new().build());
    }
    let Some(path) = &config.credentials_file else {
        return google_cloud_auth::credentials::Builder::default()
            .build()
            .map_err(|e| {
                SinkError::permanent(format!(
                    "no Application Default Credentials ({e}): set credentials_file, \
                 GOOGLE_APPLICATION_CREDENTIALS, or run where a metadata server answers"
                ))
            });
    };
    let unreadable =
        |what: String| SinkError::permanent(format!("credentials_file {}: {what}", path.display()));
    let text = tokio::fs::read(path)
        .await
        .map_err(|e| unreadable(e.to_string()))?;
    // serde_json's message names a line and column, never the content.
    let key: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| unreadable(format!("not a JSON key file ({e})")))?;
    service_account::Builder::new(key)
        .build()
        .map_err(|e| unreadable(format!("not a service-account key ({e})")))
}

/// Pub/Sub's rules for attributes.
fn check_attributes(attributes: &[(String, String)]) -> Result<(), SinkError> {
    if attributes.len() > limits::ATTRIBUTES {
        return Err(SinkError::permanent(format!(
            "the message has {} attributes (headers with Switchyard's own); Pub/Sub takes at most {}",
            attributes.len(),
            limits::ATTRIBUTES
        )));
    }
    for (key, value) in attributes {
        let shown: String = key.chars().take(64).collect();
        if key.is_empty() {
            return Err(SinkError::permanent("an attribute (header) has an empty name"));
        }
        if key.len() > limits::ATTRIBUTE_KEY_BYTES {
            return Err(SinkError::permanent(format!(
                "attribute {shown:?} has a {}-byte name; Pub/Sub takes at most {}",
                key.len(),
                limits::ATTRIBUTE_KEY_BYTES
            )));
        }
        if key.starts_with("goog") {
            return Err(SinkError::permanent(format!(
                "attribute {shown:?}: names starting with \"goog\" are reserved by Pub/Sub"
            )));
        }
        if value.len() > limits::ATTRIBUTE_VALUE_BYTES {
            return Err(SinkError::permanent(format!(
                "attribute {shown:?} has a {}-byte value; Pub/Sub takes at most {}",
                value.len(),
                limits::ATTRIBUTE_VALUE_BYTES
            )));
        }
    }
    Ok(())
}

/// A failed publish of a message to `topic`, classified.
fn classify(error: &PublishError, topic: &str) -> SinkError {
    match error {
        PublishError::Rpc(e) => classify_rpc(e, topic),
        PublishError::OrderingKeyPaused => {
            SinkError::timed_out("publishing is paused for this ordering key after a failed publish")
        }
        other => SinkError::unavailable(format!("the Pub/Sub publisher stopped: {other}")),
    }
}

/// A failed call about `name` (a topic or project), classified by its
/// gRPC or HTTP status; without one, by what failed on the way.
pub(crate) fn classify_rpc(error: &google_cloud_gax::error::Error, name: &str) -> SinkError {
    let message = |what: &str| format!("Pub/Sub {what}: {error}");
    let kind = match error.status().map(|s| s.code) {
        Some(Code::NotFound) => {
            return SinkError::new(
                FailureKind::UnknownTopic,
                format!(
                    "Pub/Sub topic {name} does not exist: create it (or set create_topics = true for \
                     development)"
                ),
            );
        }
        Some(Code::PermissionDenied) => {
            return SinkError::new(
                FailureKind::Unauthorized,
                format!(
                    "Pub/Sub refused the permission for {name}: the account needs roles/pubsub.publisher \
                     on it ({error})"
                ),
            );
        }
        Some(Code::Unauthenticated) => FailureKind::Unauthorized,
        Some(Code::DeadlineExceeded) => FailureKind::TimedOut,
        // What Google's clients retry: the service is down, busy or over
        // quota, never the message's fault.
        Some(
            Code::Unavailable
            | Code::Aborted
            | Code::Cancelled
            | Code::Internal
            | Code::Unknown
            | Code::ResourceExhausted,
        ) => FailureKind::Unavailable,
        Some(Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange) => FailureKind::Refused,
        Some(_) => FailureKind::Transient,
        None if error.is_timeout() => FailureKind::TimedOut,
        None if error.is_authentication() => FailureKind::Unauthorized,
        None if error.is_connect() || error.is_io() || error.is_transport() => FailureKind::Unavailable,
        None => FailureKind::Transient,
    };
    let what = match kind {
        FailureKind::Unavailable => "is unavailable",
        FailureKind::TimedOut => "did not answer in time",
        FailureKind::Unauthorized => "refused the credentials",
        FailureKind::Refused => "refused the message",
        _ => "failed",
    };
    SinkError::new(kind, message(what))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attributes(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn each_attribute_limit_has_its_own_message() {
        let long_key = "k".repeat(257);
        let long_value = "v".repeat(1025);
        for (attrs, says) in [
            (attributes(&[(long_key.as_str(), "v")]), "257-byte name"),
            (attributes(&[("googthing", "v")]), "reserved by Pub/Sub"),
            (attributes(&[("k", long_value.as_str())]), "1025-byte value"),
        ] {
            let error = check_attributes(&attrs).unwrap_err();
            assert_eq!(error.kind, FailureKind::Refused);
            assert!(error.message.contains(says), "{says}: {}", error.message);
        }
        let many: Vec<(String, String)> = (0..101).map(|i| (format!("h{i}"), String::new())).collect();
        assert!(
            check_attributes(&many)
                .unwrap_err()
                .message
                .contains("101 attributes")
        );
        assert!(check_attributes(&many[..100]).is_ok());
    }

    #[test]
    fn statuses_map_to_the_relays_kinds() {
        use google_cloud_gax::error::Error;
        use google_cloud_gax::error::rpc::Status;
        let status = |code| Error::service(Status::default().set_code(code).set_message("m"));
        for (code, kind) in [
            (Code::NotFound, FailureKind::UnknownTopic),
            (Code::PermissionDenied, FailureKind::Unauthorized),
            (Code::Unauthenticated, FailureKind::Unauthorized),
            (Code::Unavailable, FailureKind::Unavailable),
            (Code::ResourceExhausted, FailureKind::Unavailable),
            (Code::DeadlineExceeded, FailureKind::TimedOut),
            (Code::InvalidArgument, FailureKind::Refused),
        ] {
            assert_eq!(
                classify_rpc(&status(code), "projects/p/topics/t").kind,
                kind,
                "{code:?}"
            );
        }
        assert!(
            classify_rpc(&status(Code::NotFound), "projects/p/topics/t")
                .message
                .contains("projects/p/topics/t does not exist")
        );
    }
}
