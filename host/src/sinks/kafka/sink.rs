//! Publishing to Kafka and classifying its failures.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, join_all};
use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};

use tokio_util::sync::{CancellationToken, DropGuard};

use super::config::{KafkaSinkConfig, check_topic};
use crate::secret::{Secret, SecretValue};
use crate::sinks::{FailureKind, OutgoingMessage, Sink, SinkError};
use crate::telemetry::{Occurrence, Repeats};

/// Sends librdkafka's log lines and client errors to `tracing`, tagged
/// with the target; every producer of a target shares one.
#[derive(Clone)]
struct LogContext {
    target: String,
    /// Connection trouble, which librdkafka reports on every reconnect
    /// attempt while a broker is down: one line when it starts, one a
    /// minute, one when a delivery or health check gets through.
    unreachable: Arc<Repeats>,
    /// Wakes the password renewal: the cluster refused the login.
    refused: Arc<tokio::sync::Notify>,
}

impl LogContext {
    fn unreachable(&self, message: &dyn std::fmt::Display) {
        let target = self.target.as_str();
        match self.unreachable.occurred() {
            Occurrence::First => {
                tracing::warn!(sink.name = target, "Kafka brokers unreachable: {message}");
            }
            Occurrence::Still { count, lasting } => tracing::warn!(
                sink.name = target,
                errors = count,
                lasting_s = lasting.as_secs(),
                "Kafka brokers still unreachable: {message}"
            ),
            Occurrence::Quiet => {
                tracing::debug!(sink.name = target, "Kafka brokers unreachable: {message}");
            }
        }
    }
}

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        let target = self.target.as_str();
        // librdkafka's own "error" lines (connection refused, broker down)
        // are recovered from by retrying: WARN. ERROR is kept for what it
        // cannot recover from.
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical => {
                tracing::error!(sink.name = target, kafka.facility = facility, "{message}");
            }
            RDKafkaLogLevel::Error | RDKafkaLogLevel::Warning if facility == "FAIL" => {
                self.unreachable(&message);
            }
            RDKafkaLogLevel::Error | RDKafkaLogLevel::Warning => {
                tracing::warn!(sink.name = target, kafka.facility = facility, "{message}");
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(sink.name = target, kafka.facility = facility, "{message}");
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(sink.name = target, kafka.facility = facility, "{message}")
            }
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        use RDKafkaErrorCode as C;
        match error.rdkafka_error_code() {
            Some(C::AllBrokersDown | C::BrokerTransportFailure | C::Resolve | C::BrokerNotAvailable) => {
                self.unreachable(&format_args!("{reason} ({error})"));
            }
            Some(C::Authentication | C::SaslAuthenticationFailed) => {
                tracing::warn!(sink.name = %self.target, %error, "Kafka refused the login: {reason}");
                self.refused.notify_one();
            }
            _ => tracing::warn!(sink.name = %self.target, %error, "Kafka client error: {reason}"),
        }
    }
}

type Client = FutureProducer<LogContext>;

/// Bound on one health probe (a metadata request): under `/readyz`'s own
/// bound (the admin module asserts it), so a probe never outlives the
/// request that asked for it.
pub(crate) const HEALTH_TIMEOUT: Duration = Duration::from_millis(2500);

/// A Kafka cluster as a target.
pub struct KafkaSink {
    name: String,
    /// What every new producer is built from; the SASL password in it
    /// changes when the password rotates (see [`renew_password`]).
    client_config: Arc<RwLock<ClientConfig>>,
    /// Shared with the blocking thread that replaces a failed producer.
    producer: Arc<RwLock<Arc<Client>>>,
    publish_timeout: Duration,
    /// One metadata probe at a time: each holds a blocking thread while
    /// Kafka is down, and readiness probes keep coming.
    probe: tokio::sync::Mutex<()>,
    /// The producer lost its brokers mid-request (see [`KafkaSink::renew`]).
    /// Shared with the health check's blocking thread, which sets it even
    /// when the caller stopped waiting for the check.
    lost_brokers: Arc<std::sync::atomic::AtomicBool>,
    /// Shared with every producer of this target.
    context: LogContext,
    /// Stops the password renewal with the sink.
    _renewal: Option<DropGuard>,
}

impl KafkaSink {
    /// Reads the SASL password, if the target has one, and builds the
    /// producer. librdkafka connects lazily, so an unreachable cluster
    /// shows in the health check, not here. A password read from a file or
    /// a command is read again while the sink lives (see [`renew_password`]).
    ///
    /// # Errors
    /// A property librdkafka rejects; a password that cannot be read.
    pub async fn connect(
        name: &str,
        config: &KafkaSinkConfig,
        publish_timeout: Duration,
    ) -> Result<KafkaSink, SinkError> {
        let mut client_config = config.client_config(publish_timeout);
        let password = match &config.password {
            Some(source) => {
                let secret = source
                    .read()
                    .await
                    .map_err(|e| SinkError::unavailable(format!("{name}: {e}")))?;
                client_config.set("sasl.password", secret.expose());
                Some((source.clone(), secret))
            }
            None => None,
        };
        let context = LogContext {
            target: name.to_string(),
            unreachable: Arc::new(Repeats::default()),
            refused: Arc::new(tokio::sync::Notify::new()),
        };
        let producer = create(&client_config, &context)?;
        let mut sink = KafkaSink {
            name: name.to_string(),
            client_config: Arc::new(RwLock::new(client_config)),
            producer: Arc::new(RwLock::new(Arc::new(producer))),
            publish_timeout,
            probe: tokio::sync::Mutex::new(()),
            lost_brokers: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            context,
            _renewal: None,
        };
        if let Some((SecretValue::From(source), secret)) = password {
            let stop = CancellationToken::new();
            tokio::spawn(renew_password(
                Renewal {
                    config: Arc::clone(&sink.client_config),
                    producer: Arc::clone(&sink.producer),
                    context: sink.context.clone(),
                    every: source.refresh(),
                    source,
                    stop: stop.clone(),
                },
                secret,
            ));
            sink._renewal = Some(stop.drop_guard());
        }
        Ok(sink)
    }

    /// The config a new producer is built from.
    fn client_config(&self) -> ClientConfig {
        match self.client_config.read() {
            Ok(config) => config.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn producer(&self) -> Arc<Client> {
        match self.producer.read() {
            Ok(producer) => Arc::clone(&producer),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Replaces a producer that lost its brokers mid-request, once they
    /// answer again: the first request back is a fresh producer id rather
    /// than sequence numbers a restarted broker may no longer know (Kafka
    /// fences them; tansu's SQLite store failed on them for good).
    /// Nothing is in flight then: every message of those requests failed.
    async fn renew(&self) {
        if !self.lost_brokers.swap(false, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        let renewed = swap(&self.producer, self.client_config(), &self.context, None).await;
        match renewed {
            Ok(()) => {
                tracing::info!(sink.name = %self.name, "Kafka is back; publishing with a new producer.")
            }
            Err(e) => {
                tracing::error!(sink.name = %self.name, error = %e, "Cannot create a new Kafka producer.")
            }
        }
    }

    /// An idempotent producer that hit a fatal error (fenced, sequence lost)
    /// refuses everything from then on: replace it so the next attempt can
    /// go. Creating one starts librdkafka's threads, and dropping the old
    /// one flushes and joins them: both on a blocking thread.
    async fn replace_if_fatal(&self, producer: &Arc<Client>) {
        let Some((code, reason)) = producer.client().fatal_error() else {
            return;
        };
        tracing::warn!(sink.name = %self.name, ?code, %reason, "Kafka producer failed fatally; creating a new one.");
        let replaced = swap(
            &self.producer,
            self.client_config(),
            &self.context,
            Some(Arc::clone(producer)),
        )
        .await;
        if let Err(e) = replaced {
            tracing::error!(sink.name = %self.name, error = %e, "Cannot create a new Kafka producer.");
        }
    }

    /// A delivery or health check got through: ends a run of connection errors.
    fn reached(&self) {
        if let Some((errors, lasted)) = self.context.unreachable.ended() {
            tracing::info!(
                sink.name = %self.name,
                errors,
                lasted_s = lasted.as_secs(),
                "Kafka brokers reachable again."
            );
        }
    }

    /// Queues one message, waiting out a full local queue until `deadline`.
    async fn enqueue(
        &self,
        producer: &Client,
        message: &OutgoingMessage,
        deadline: Instant,
    ) -> Result<DeliveryFuture, SinkError> {
        check_topic(&message.topic)?;
        let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
        for (key, value) in &message.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(&message.topic)
            .payload(&message.payload[..])
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key.as_bytes());
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), returned))
                    if Instant::now() < deadline =>
                {
                    record = returned;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((error, _)) => return Err(classify(&error)),
            }
        }
    }
}

/// The shortest time between two reads of the password that refused
/// logins ask for.
const REREAD_AFTER_REFUSAL: Duration = Duration::from_secs(5);

/// What the password renewal works on: the sink's shared parts.
struct Renewal {
    config: Arc<RwLock<ClientConfig>>,
    producer: Arc<RwLock<Arc<Client>>>,
    context: LogContext,
    source: crate::secret::SecretConfig,
    every: Duration,
    stop: CancellationToken,
}

/// Reads the SASL password every `every`, and at once when a login was
/// refused. librdkafka reads `sasl.password` only when a producer is built,
/// so a changed password means a new producer: it takes every message from
/// then on, while publishes that hold the old one await their delivery
/// reports from it; the old one is flushed and closed when the last of them
/// lets go (see [`release`]). Nothing in flight is lost or sent twice. A
/// failed read keeps the last good password and says so once per spell.
async fn renew_password(renewal: Renewal, mut current: Secret) {
    let mut failing = false;
    let mut read_at = Instant::now();
    loop {
        tokio::select! {
            () = tokio::time::sleep(renewal.every) => {}
            () = renewal.context.refused.notified() => {
                // librdkafka retries a refused login every second: a
                // password command (a token service) runs at most once in
                // REREAD_AFTER_REFUSAL for them.
                let wait = REREAD_AFTER_REFUSAL.saturating_sub(read_at.elapsed());
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = renewal.stop.cancelled() => return,
                }
            }
            () = renewal.stop.cancelled() => return,
        }
        read_at = Instant::now();
        let secret = match renewal.source.read().await {
            Ok(secret) => {
                failing = false;
                secret
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(sink.name = %renewal.context.target, %error, "Cannot read the Kafka password again; new connections keep the last one.");
                }
                failing = true;
                continue;
            }
        };
        if secret == current {
            continue;
        }
        let config = {
            let mut shared = match renewal.config.write() {
                Ok(config) => config,
                Err(poisoned) => poisoned.into_inner(),
            };
            shared.set("sasl.password", secret.expose());
            shared.clone()
        };
        let replaced = swap(&renewal.producer, config, &renewal.context, None).await;
        match replaced {
            Ok(()) => {
                tracing::info!(sink.name = %renewal.context.target, "Kafka password renewed; publishing with a new producer.");
                current = secret;
            }
            Err(error) => {
                tracing::error!(sink.name = %renewal.context.target, %error, "Cannot create a Kafka producer with the renewed password.");
            }
        }
    }
}

/// Builds a producer from `config` and puts it in `slot`, unless `only_if`
/// names a producer that is no longer the one there (another swap came
/// first). On a blocking thread: creating a producer starts librdkafka's
/// threads, and dropping the last handle of the old one flushes and joins
/// them. Publishes still holding the old one release it last (see
/// [`release`]), after their delivery reports.
async fn swap(
    slot: &Arc<RwLock<Arc<Client>>>,
    config: ClientConfig,
    context: &LogContext,
    only_if: Option<Arc<Client>>,
) -> Result<(), SinkError> {
    let (slot, context) = (Arc::clone(slot), context.clone());
    tokio::task::spawn_blocking(move || {
        let fresh = Arc::new(create(&config, &context)?);
        let mut current = match slot.write() {
            Ok(current) => current,
            Err(poisoned) => poisoned.into_inner(),
        };
        if only_if.is_none_or(|expected| Arc::ptr_eq(&current, &expected)) {
            let old = std::mem::replace(&mut *current, fresh);
            drop(current);
            drop(old);
        }
        Ok(())
    })
    .await
    .map_err(|e| SinkError::permanent(format!("replacing the Kafka producer failed: {e}")))?
}

fn create(config: &ClientConfig, context: &LogContext) -> Result<Client, SinkError> {
    config
        .create_with_context(context.clone())
        .map_err(|e| SinkError::permanent(format!("cannot create a Kafka producer: {e}")))
}

/// Lets go of a producer handle. The last handle of a replaced producer
/// flushes and joins librdkafka's thread when dropped: never on a runtime thread.
fn release(producer: Arc<Client>) {
    if let Some(last) = Arc::into_inner(producer) {
        tokio::task::spawn_blocking(move || drop(last));
    }
}

/// Sorts a producer error by whose fault it is, with a message for `last_error`.
pub fn classify(error: &KafkaError) -> SinkError {
    use RDKafkaErrorCode as C;
    let code = error.rdkafka_error_code();
    let kind = match code {
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::MessageBatchTooLarge
            | C::InvalidTopic
            | C::UnsupportedForMessageFormat
            | C::UnsupportedCompressionType
            | C::InvalidRequiredAcks,
        ) => FailureKind::Refused,
        Some(C::UnknownTopic | C::UnknownTopicOrPartition | C::UnknownPartition) => FailureKind::UnknownTopic,
        Some(
            C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::TransactionalIdAuthorizationFailed
            | C::SaslAuthenticationFailed
            | C::Authentication,
        ) => FailureKind::Unauthorized,
        // librdkafka retries a message until `message.timeout.ms`; past it,
        // the broker was out of reach for the whole of that time.
        Some(C::MessageTimedOut | C::RequestTimedOut | C::OperationTimedOut) => FailureKind::TimedOut,
        Some(
            C::AllBrokersDown
            | C::BrokerTransportFailure
            | C::BrokerNotAvailable
            | C::NetworkException
            | C::Resolve
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::KafkaStorageError
            | C::QueueFull
            | C::Fatal
            // The broker failed inside (a restarted one answered this for
            // its first produce requests): its fault, not the event's.
            | C::Unknown
            | C::CoordinatorNotAvailable
            | C::NotCoordinator,
        ) => FailureKind::Unavailable,
        _ => FailureKind::Transient,
    };
    let text = match code {
        Some(code) => format!("Kafka refused the message: {code}"),
        None => format!("Kafka refused the message: {error}"),
    };
    SinkError::new(kind, text).with_source(error.clone())
}

impl Sink for KafkaSink {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let producer = self.producer();
            let deadline = Instant::now() + self.publish_timeout;
            // Queue everything, then await the delivery reports together:
            // librdkafka batches per partition, and the relay acks rows only
            // after the reports arrive.
            let mut pending = Vec::with_capacity(messages.len());
            for message in &messages {
                pending.push(self.enqueue(&producer, message, deadline).await);
            }
            let results = join_all(pending.into_iter().map(|queued| async move {
                match queued?.await {
                    Ok(Ok(_delivery)) => Ok(()),
                    Ok(Err((error, _message))) => Err(classify(&error)),
                    Err(_canceled) => Err(SinkError::unavailable(
                        "Kafka producer closed before the delivery report",
                    )),
                }
            }))
            .await;
            if results.iter().any(Result::is_ok) {
                self.reached();
            }
            if results
                .iter()
                .any(|r| matches!(r, Err(e) if e.kind == FailureKind::Unauthorized))
            {
                self.context.refused.notify_one();
            }
            if results.iter().any(Result::is_err) {
                let lost = results.iter().any(|r| {
                    matches!(r, Err(e) if matches!(e.kind, FailureKind::Unavailable | FailureKind::TimedOut))
                });
                if lost {
                    self.lost_brokers
                        .store(true, std::sync::atomic::Ordering::Release);
                }
                self.replace_if_fatal(&producer).await;
            }
            release(producer);
            results
        })
    }

    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async move {
            let _one_at_a_time = self.probe.lock().await;
            let producer = self.producer();
            let timeout = HEALTH_TIMEOUT.min(self.publish_timeout);
            let name = self.name.clone();
            let lost_brokers = Arc::clone(&self.lost_brokers);
            // Metadata requests block: keep them off the runtime's threads.
            let checked = tokio::task::spawn_blocking(move || {
                let metadata = producer.client().fetch_metadata(None, timeout).map_err(|e| {
                    // Also when a publish never got to say so (the relay's
                    // own bound dropped it), and when the caller stopped
                    // waiting for this check: checks fail all outage long.
                    lost_brokers.store(true, std::sync::atomic::Ordering::Release);
                    SinkError::unavailable(format!("{name}: Kafka cluster is not reachable: {e}"))
                })?;
                if metadata.brokers().is_empty() {
                    return Err(SinkError::unavailable(format!(
                        "{name}: Kafka cluster reports no brokers"
                    )));
                }
                Ok(())
            })
            .await
            .map_err(|e| SinkError::unavailable(format!("Kafka health check failed: {e}")))?;
            checked?;
            self.reached();
            self.renew().await;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_down_is_one_line_not_one_per_reconnect_attempt() {
        let context = LogContext {
            target: "orders".into(),
            unreachable: Arc::new(Repeats::default()),
            refused: Arc::new(tokio::sync::Notify::new()),
        };
        let text = crate::telemetry::testing::capture("info".parse().unwrap(), || {
            // What librdkafka reports in a few seconds of a broker down.
            for _ in 0..100 {
                context.error(
                    KafkaError::Global(RDKafkaErrorCode::AllBrokersDown),
                    "1/1 brokers are down",
                );
                context.log(
                    RDKafkaLogLevel::Error,
                    "FAIL",
                    "127.0.0.1:9092/1: Connect to ipv4#127.0.0.1:9092 failed: Connection refused",
                );
            }
            context.error(
                KafkaError::Global(RDKafkaErrorCode::MessageSizeTooLarge),
                "something else",
            );
        });
        assert_eq!(text.matches("unreachable").count(), 1, "{text}");
        assert!(text.contains("orders"), "{text}");
        assert!(text.contains("1/1 brokers are down"), "{text}");
        assert_eq!(text.matches("something else").count(), 1, "{text}");
        assert_eq!(context.unreachable.ended().map(|(n, _)| n), Some(200));
    }

    #[test]
    fn a_failure_keeps_the_client_error_it_came_from() {
        use std::error::Error as _;
        let error = classify(&KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageSizeTooLarge,
        ));
        assert_eq!(error.kind, FailureKind::Refused);
        let source = error.source().expect("a source");
        let kafka = source.downcast_ref::<KafkaError>().expect("the KafkaError");
        assert_eq!(
            kafka.rdkafka_error_code(),
            Some(RDKafkaErrorCode::MessageSizeTooLarge)
        );
        // Each message of a failed call gets a copy; the source is shared.
        let copy = error.clone();
        assert!(copy.source().is_some());
    }

    #[test]
    fn errors_are_sorted_by_whose_fault_they_are() {
        let kind = |code| classify(&KafkaError::MessageProduction(code)).kind;
        let too_large = classify(&KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageSizeTooLarge,
        ));
        assert_eq!(too_large.kind, FailureKind::Refused);
        assert!(too_large.message.contains("too large"), "{}", too_large.message);
        assert_eq!(
            kind(RDKafkaErrorCode::UnknownTopicOrPartition),
            FailureKind::UnknownTopic
        );
        assert_eq!(
            kind(RDKafkaErrorCode::TopicAuthorizationFailed),
            FailureKind::Unauthorized
        );
        assert_eq!(kind(RDKafkaErrorCode::MessageTimedOut), FailureKind::TimedOut);
        for code in [
            RDKafkaErrorCode::QueueFull,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::LeaderNotAvailable,
            RDKafkaErrorCode::NotEnoughReplicas,
        ] {
            assert_eq!(kind(code), FailureKind::Unavailable, "{code:?}");
        }
        assert_eq!(
            kind(RDKafkaErrorCode::InvalidProducerEpoch),
            FailureKind::Transient
        );
    }

    #[test]
    fn topic_names_follow_kafka_rules() {
        assert!(check_topic("orders.created-v1_x").is_ok());
        for bad in ["", ".", "..", "orders created", "orders/x", &"t".repeat(250)] {
            assert!(check_topic(bad).is_err(), "{bad:?}");
        }
    }
}
