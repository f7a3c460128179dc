//! Targets that messages are published to. Every sink takes a batch of
//! messages and answers per message, so one slow or failing message does not
//! decide the fate of its neighbours, and classifies failures as retryable or
//! permanent.

pub mod aws;
mod deferred;
pub mod file;
pub mod headers;
pub mod http;
pub mod kafka;
pub mod nats;
#[cfg(any(feature = "aws", feature = "http", feature = "redis"))]
pub(crate) mod order;
pub mod pubsub;
pub mod rabbitmq;
pub mod redis;
pub mod registry;
pub mod stdout;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;

pub(crate) use registry::TargetKind;
pub use registry::{SinkSettings, TargetConfig};

/// Header carrying the message key on brokers with no keys of their own
/// (NATS, RabbitMQ).
pub const KEY_HEADER: &str = "Switchyard-Key";

/// One message, ready for a broker.
#[derive(Debug, Clone, Default)]
pub struct OutgoingMessage {
    /// Topic or subject.
    pub topic: String,
    /// Partition key; NATS carries it as a header.
    pub key: Option<String>,
    /// The bytes to send.
    pub payload: Bytes,
    /// Every header, relay and plugin ones merged.
    pub headers: Vec<(String, String)>,
    /// The event this message came from.
    pub event_id: String,
    /// Broker-side deduplication id (`Nats-Msg-Id`): the event id, suffixed
    /// with topic and ordinal when one event sends several messages to one target.
    pub dedup_id: String,
}

/// Why a delivery failed, and so whose fault it is. The relay decides from
/// the kind (through `[relay.failures]` for the ambiguous ones) whether a
/// failure spends one of the event's attempts; see the book's Failures page (docs/src/concepts/failures.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The target cannot be reached or is not serving: connection refused
    /// or lost, broker restarting, no leader. Never the event's fault: the
    /// target is paused and its rows wait.
    Unavailable,
    /// The target did not answer in time. Usually an outage; configurable.
    TimedOut,
    /// The topic, subject's stream, or exchange does not exist (yet).
    UnknownTopic,
    /// The target refused the credentials or the permission.
    Unauthorized,
    /// A failure of this message that a later attempt may not repeat; it
    /// spends one of the event's attempts.
    Transient,
    /// Refused for good (too large, invalid subject or header, refused by
    /// policy): the row is dead-lettered.
    Refused,
}

impl FailureKind {
    /// Every kind.
    pub const ALL: [FailureKind; 6] = [
        FailureKind::Unavailable,
        FailureKind::TimedOut,
        FailureKind::UnknownTopic,
        FailureKind::Unauthorized,
        FailureKind::Transient,
        FailureKind::Refused,
    ];

    /// The label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Unavailable => "unavailable",
            FailureKind::TimedOut => "timed_out",
            FailureKind::UnknownTopic => "unknown_topic",
            FailureKind::Unauthorized => "unauthorized",
            FailureKind::Transient => "transient",
            FailureKind::Refused => "refused",
        }
    }
}

/// A failed delivery, classified.
#[derive(Debug, Clone)]
pub struct SinkError {
    /// Why it failed.
    pub kind: FailureKind,
    /// What went wrong, for `last_error`.
    pub message: String,
    /// The client library's own error, when there is one (shared: one
    /// failed call fails each of its messages).
    pub source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl std::fmt::Display for SinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SinkError {
    // The client's error itself, not the Arc around it: callers downcast it.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl SinkError {
    /// A failure of the given kind.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        SinkError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// The same failure, carrying the error that caused it.
    #[must_use]
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The event's own failure that a later attempt may not repeat.
    pub fn retryable(message: impl Into<String>) -> Self {
        SinkError::new(FailureKind::Transient, message)
    }

    /// A failure that will happen again on every attempt.
    pub fn permanent(message: impl Into<String>) -> Self {
        SinkError::new(FailureKind::Refused, message)
    }

    /// The target is down or unreachable.
    pub fn unavailable(message: impl Into<String>) -> Self {
        SinkError::new(FailureKind::Unavailable, message)
    }

    /// The target did not answer in time.
    pub fn timed_out(message: impl Into<String>) -> Self {
        SinkError::new(FailureKind::TimedOut, message)
    }

    /// Whether a later attempt can succeed (every kind but [`FailureKind::Refused`]).
    pub fn retryable_kind(&self) -> bool {
        self.kind != FailureKind::Refused
    }
}

/// A broker connection that can publish batches.
pub trait Sink: Send + Sync {
    /// `"nats"`, `"kafka"`, ...
    fn kind(&self) -> &'static str;

    /// Publishes `messages` and resolves once each is acknowledged or failed.
    /// The result has one entry per message, in order.
    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>>;

    /// Checks that the broker is reachable and usable.
    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>>;

    /// Whether the broker drops a message whose dedup id it has seen
    /// recently (JetStream's `Nats-Msg-Id`).
    fn deduplicates_by_id(&self) -> bool {
        false
    }
}

/// How long a target may take to answer its health check at startup. Each
/// kind bounds its own connect; this bounds what comes after, a broker that
/// took the connection and then stalled.
const STARTUP_CHECK_TIMEOUT: Duration = Duration::from_secs(15);

/// `sink`'s health check, answered within `bound`.
async fn ready(name: &str, sink: &dyn Sink, bound: Duration) -> anyhow::Result<()> {
    match tokio::time::timeout(bound, sink.healthcheck()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(anyhow::anyhow!("target {name:?} failed its health check: {e}")),
        Err(_) => Err(anyhow::anyhow!(
            "target {name:?} did not answer its health check within {bound:?}"
        )),
    }
}

/// All configured targets by name.
#[derive(Clone, Default)]
pub struct Sinks {
    by_name: BTreeMap<String, Arc<dyn Sink>>,
    health: Arc<HealthCache>,
}

/// How long a target's health check answers `/readyz`, `/status` and the
/// console before it runs again.
pub const HEALTH_FRESH_FOR: Duration = Duration::from_secs(2);

/// Each target's latest health check. A check is a broker round trip (a
/// Kafka metadata fetch, a RabbitMQ declare, Pub/Sub admin calls that
/// spend project quota): whoever can reach the admin port must not be able
/// to multiply them, so one runs at most every [`HEALTH_FRESH_FOR`] per
/// target, and callers that arrive while it runs wait for its answer.
#[derive(Default)]
struct HealthCache {
    by_name: std::sync::Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<Option<Checked>>>>>,
}

// Tokio's clock, so that a test can move it.
type Checked = (tokio::time::Instant, Result<(), String>);

impl Sinks {
    /// Connects every configured target and runs its health check. A
    /// target that cannot be reached (down, refusing the login, failing its
    /// check) does not stop the start: the relay serves the others, pauses
    /// that one as after any outage, and connects it when it answers.
    ///
    /// # Errors
    /// A target whose settings its client refuses outright.
    pub async fn connect(
        targets: &BTreeMap<String, TargetConfig>,
        settings: &SinkSettings,
    ) -> anyhow::Result<Sinks> {
        crate::tls::install_provider();
        let mut by_name = BTreeMap::new();
        for (name, target) in targets {
            let sink: Arc<dyn Sink> = match target.build(name, settings).await {
                Ok(sink) => sink,
                Err(e) if e.kind == FailureKind::Refused => {
                    return Err(anyhow::anyhow!("target {name:?}: {e}"));
                }
                Err(e) => {
                    tracing::warn!(
                        sink.name = %name,
                        error = %e,
                        "Target unreachable at start: starting without it; its events wait until it answers."
                    );
                    let deferred = Arc::new(deferred::Deferred::new(name, target, settings, e));
                    by_name.insert(name.clone(), deferred as Arc<dyn Sink>);
                    continue;
                }
            };
            match ready(name, sink.as_ref(), STARTUP_CHECK_TIMEOUT).await {
                Ok(()) => tracing::info!(sink.name = %name, sink.kind = sink.kind(), "Target ready."),
                Err(e) => tracing::warn!(sink.name = %name, "{e:#}; its events wait until it answers."),
            }
            by_name.insert(name.clone(), sink);
        }
        Ok(Sinks {
            by_name,
            health: Arc::default(),
        })
    }

    /// Builds from ready-made sinks (tests, embedding).
    pub fn from_sinks(sinks: impl IntoIterator<Item = (String, Arc<dyn Sink>)>) -> Sinks {
        Sinks {
            by_name: sinks.into_iter().collect(),
            health: Arc::default(),
        }
    }

    /// Target `name`'s health, from a check at most [`HEALTH_FRESH_FOR`]
    /// old, else from one run now (bounded by `timeout`); `None` for a
    /// name not configured. The recovery probes of a paused target do not
    /// come here: they must see the broker as it is.
    pub async fn recent_health(&self, name: &str, timeout: Duration) -> Option<Result<(), String>> {
        let sink = self.by_name.get(name)?.clone();
        let slot = self
            .health
            .by_name
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(name.to_string())
            .or_default()
            .clone();
        let mut latest = slot.lock().await;
        if let Some((at, result)) = latest.as_ref()
            && at.elapsed() < HEALTH_FRESH_FOR
        {
            return Some(result.clone());
        }
        let result = match tokio::time::timeout(timeout, sink.healthcheck()).await {
            Ok(result) => result.map_err(|e| e.to_string()),
            Err(_) => Err("health check timed out".to_string()),
        };
        *latest = Some((tokio::time::Instant::now(), result.clone()));
        Some(result)
    }

    /// The sink called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Sink>> {
        self.by_name.get(name)
    }

    /// Whether a target of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Target names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }
}

/// One message as a JSON object (the `file` target's line format): target,
/// topic, key, event id, headers, and the payload as JSON when it is JSON,
/// else as text, else as hex.
pub fn render_json_line(target: &str, message: &OutgoingMessage) -> String {
    let headers: serde_json::Map<String, serde_json::Value> = message
        .headers
        .iter()
        .map(|(name, value)| (name.clone(), serde_json::Value::String(value.clone())))
        .collect();
    let mut line = serde_json::json!({
        "target": target,
        "topic": message.topic,
        "key": message.key,
        "event_id": message.event_id,
        "headers": headers,
    });
    let payload = match serde_json::from_slice::<serde_json::Value>(&message.payload) {
        Ok(json) => ("payload", json),
        Err(_) => match std::str::from_utf8(&message.payload) {
            Ok(text) => ("payload_text", serde_json::Value::String(text.to_string())),
            Err(_) => (
                "payload_hex",
                serde_json::Value::String(message.payload.iter().map(|b| format!("{b:02x}")).collect()),
            ),
        },
    };
    line[payload.0] = payload.1;
    line.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A broker that took the connection and answers nothing.
    struct Stalled;

    impl Sink for Stalled {
        fn kind(&self) -> &'static str {
            "stalled"
        }

        fn publish(&self, _messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
            Box::pin(std::future::pending())
        }

        fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
            Box::pin(std::future::pending())
        }
    }

    /// A broker whose health checks are counted, each taking 50 ms.
    #[derive(Default)]
    struct Counted(std::sync::atomic::AtomicUsize);

    impl Sink for Counted {
        fn kind(&self) -> &'static str {
            "counted"
        }

        fn publish(&self, _messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
            Box::pin(async { Vec::new() })
        }

        fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok(())
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_hundred_askers_cost_the_broker_one_check_per_freshness_period() {
        let counted = Arc::new(Counted::default());
        let sinks = Sinks::from_sinks([("bus".to_string(), counted.clone() as Arc<dyn Sink>)]);
        let answers =
            futures::future::join_all((0..100).map(|_| sinks.recent_health("bus", Duration::from_secs(3))))
                .await;
        assert!(answers.iter().all(|a| a == &Some(Ok(()))));
        assert_eq!(
            counted.0.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "one check for all of them"
        );
        tokio::time::advance(HEALTH_FRESH_FOR / 2).await;
        sinks.recent_health("bus", Duration::from_secs(3)).await;
        assert_eq!(
            counted.0.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "still fresh"
        );
        tokio::time::advance(HEALTH_FRESH_FOR).await;
        sinks.recent_health("bus", Duration::from_secs(3)).await;
        assert_eq!(
            counted.0.load(std::sync::atomic::Ordering::SeqCst),
            2,
            "checked again once stale"
        );
        assert_eq!(sinks.recent_health("nope", Duration::from_secs(3)).await, None);
    }

    #[tokio::test]
    async fn a_target_that_never_answers_fails_startup_by_name() {
        let started = std::time::Instant::now();
        let error = ready("orders", &Stalled, Duration::from_millis(100))
            .await
            .expect_err("a stalled target is not ready");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            error.to_string(),
            "target \"orders\" did not answer its health check within 100ms"
        );
    }
}
