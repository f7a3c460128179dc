//! Publishing to RabbitMQ with publisher confirms. One connection and one
//! confirm-mode channel per target, made lazily and replaced when the broker
//! closes them; a batch is sent in order on one channel, so a queue receives
//! each aggregate's messages in order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, join_all};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind, ExchangeKind,
};
use tokio::sync::Mutex;

use super::config::{RabbitMqSinkConfig, SHORT_STRING_MAX, check_routing_key};
use crate::sinks::{FailureKind, KEY_HEADER, OutgoingMessage, Sink, SinkError};

/// Upper bound on connecting; a broker that does not answer fails the batch fast.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A RabbitMQ exchange as a target.
pub struct RabbitMqSink {
    name: String,
    config: RabbitMqSinkConfig,
    publish_timeout: Duration,
    link: Mutex<Option<Link>>,
    /// A connection was lost or could not be made: the next one may be to a
    /// broker that is still starting.
    after_trouble: AtomicBool,
}

/// A connection and its confirm-mode channel.
struct Link {
    connection: Connection,
    channel: Channel,
    /// Until when an unroutable message counts as retryable (see
    /// `unroutable_grace_ms`).
    grace_until: Option<Instant>,
}

impl RabbitMqSink {
    /// A sink for `config`; it connects on first use (and the health check at startup).
    pub fn new(name: &str, config: &RabbitMqSinkConfig, publish_timeout: Duration) -> RabbitMqSink {
        RabbitMqSink {
            name: name.to_string(),
            config: config.clone(),
            publish_timeout,
            link: Mutex::new(None),
            after_trouble: AtomicBool::new(false),
        }
    }

    /// The channel to publish on: the current one while it is open, a new
    /// one on the same connection after the broker closed the channel (a
    /// missing exchange does), a new connection after it was lost. With it,
    /// until when an unroutable message is retried.
    async fn channel(&self) -> Result<(Channel, Option<Instant>), SinkError> {
        let mut link = self.link.lock().await;
        if let Some(current) = link.as_ref() {
            if current.channel.status().connected() {
                return Ok((current.channel.clone(), current.grace_until));
            }
            if current.connection.status().connected() {
                let channel = confirm_channel(&current.connection).await?;
                if let Some(current) = link.as_mut() {
                    current.channel = channel.clone();
                }
                return Ok((channel, link.as_ref().and_then(|l| l.grace_until)));
            }
            self.after_trouble.store(true, Ordering::Relaxed);
        }
        match self.connect().await {
            Ok((connection, channel)) => {
                let grace = Duration::from_millis(self.config.unroutable_grace_ms);
                let grace_until = (self.after_trouble.swap(false, Ordering::Relaxed) && !grace.is_zero())
                    .then(|| Instant::now() + grace);
                *link = Some(Link {
                    connection,
                    channel: channel.clone(),
                    grace_until,
                });
                Ok((channel, grace_until))
            }
            Err(error) => {
                self.after_trouble.store(true, Ordering::Relaxed);
                Err(error)
            }
        }
    }

    async fn connect(&self) -> Result<(Connection, Channel), SinkError> {
        let properties =
            ConnectionProperties::default().with_connection_name(self.config.connection_name.as_str().into());
        let (uri, tls) = self.config.connection().await.map_err(|reason| {
            SinkError::new(FailureKind::Unauthorized, format!("RabbitMQ login: {reason}"))
        })?;
        let runtime = lapin::runtime::default_runtime()
            .map_err(|e| SinkError::new(FailureKind::Unavailable, format!("no runtime for RabbitMQ: {e}")))?;
        let connection = tokio::time::timeout(
            CONNECT_TIMEOUT,
            Connection::connect_uri_with_config(uri, properties, tls, runtime),
        )
        .await
        .map_err(|_| {
            SinkError::timed_out(format!(
                "cannot connect to {}: no answer within {} s",
                crate::redact::url(&self.config.url),
                CONNECT_TIMEOUT.as_secs()
            ))
        })?
        .map_err(|error| {
            let text = format!(
                "cannot connect to {}: {}",
                crate::redact::url(&self.config.url),
                crate::redact::url(&error.to_string())
            );
            SinkError::new(kind_of(&error), text)
        })?;
        let channel = confirm_channel(&connection).await?;
        Ok((connection, channel))
    }

    fn properties(&self, message: &OutgoingMessage) -> BasicProperties {
        let mut headers = FieldTable::default();
        for (name, value) in &message.headers {
            headers.insert(
                name.as_str().into(),
                AMQPValue::LongString(LongString::from(value.as_str())),
            );
        }
        if let Some(key) = &message.key {
            headers.insert(
                KEY_HEADER.into(),
                AMQPValue::LongString(LongString::from(key.as_str())),
            );
        }
        let properties = BasicProperties::default()
            .with_message_id(message_id(message))
            .with_headers(headers);
        if self.config.persistent {
            properties.with_delivery_mode(2)
        } else {
            properties
        }
    }

    async fn publish_all(&self, messages: Vec<OutgoingMessage>) -> Vec<Result<(), SinkError>> {
        let (channel, grace_until) = match self.channel().await {
            Ok(link) => link,
            Err(error) => return vec![Err(error); messages.len()],
        };
        let deadline = tokio::time::Instant::now() + self.publish_timeout;
        let exchange: ShortString = self.config.exchange.as_str().into();
        let mut sent = Vec::with_capacity(messages.len());
        let mut broken: Option<SinkError> = None;
        for message in &messages {
            if let Some(error) = &broken {
                sent.push(Err(error.clone()));
                continue;
            }
            if let Some(problem) = unsendable(message) {
                sent.push(Err(SinkError::permanent(problem)));
                continue;
            }
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            let publish = channel.basic_publish(
                exchange.clone(),
                message.topic.as_str().into(),
                options,
                &message.payload,
                self.properties(message),
            );
            match publish.await {
                Ok(confirm) => sent.push(Ok(confirm)),
                Err(error) => {
                    // The channel or connection is gone: the rest of the batch cannot go out on it.
                    let error = self.classify(&error);
                    broken = Some(error.clone());
                    sent.push(Err(error));
                }
            }
        }
        let confirmed = sent.into_iter().map(|sent| async move {
            let confirm = sent?;
            match tokio::time::timeout_at(deadline, confirm).await {
                Err(_) => Err(SinkError::timed_out(format!(
                    "not confirmed by the broker within {} ms",
                    self.publish_timeout.as_millis()
                ))),
                Ok(Err(error)) => Err(self.classify(&error)),
                Ok(Ok(confirmation)) => self.confirmation(confirmation, grace_until),
            }
        });
        join_all(confirmed).await
    }

    fn confirmation(
        &self,
        confirmation: Confirmation,
        grace_until: Option<Instant>,
    ) -> Result<(), SinkError> {
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                let problem = format!(
                    "unroutable: {} has no queue bound for routing key {:?} ({} {})",
                    message_route(&self.config.exchange),
                    returned.delivery.routing_key.as_str(),
                    returned.reply_code,
                    returned.reply_text.as_str()
                );
                Err(unroutable(problem, grace_until, Instant::now()))
            }
            Confirmation::Nack(None) => Err(SinkError::retryable(
                "the broker did not take the message (nack)".to_string(),
            )),
            Confirmation::NotRequested => Err(SinkError::unavailable(format!(
                "target {:?}: the channel is not in confirm mode",
                self.name
            ))),
        }
    }

    fn classify(&self, error: &lapin::Error) -> SinkError {
        let text = format!("{}: {}", message_route(&self.config.exchange), error);
        SinkError::new(kind_of(error), text).with_source(error.clone())
    }
}

/// A precondition the broker insists on or a message too large fail the
/// same way every time; a missing exchange or refused access until an
/// operator acts; a lost connection or channel, or a broker shutting down,
/// until it is back.
fn kind_of(error: &lapin::Error) -> FailureKind {
    match error.kind() {
        ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => FailureKind::UnknownTopic,
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => FailureKind::Unauthorized,
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED | AMQPSoftError::CONTENTTOOLARGE) => {
                FailureKind::Refused
            }
            _ => FailureKind::Unavailable,
        },
        ErrorKind::AuthProviderError(_) => FailureKind::Unauthorized,
        ErrorKind::ParsingError(_) | ErrorKind::SerialisationError(_) => FailureKind::Transient,
        _ => FailureKind::Unavailable,
    }
}

/// An unroutable message is refused for good, except shortly after the
/// connection came back: a restarted broker answers before it has restored
/// its bindings (RabbitMQ returned NO_ROUTE for about 1.3 s after a SIGKILL
/// and restart, with the durable queue and binding in place).
fn unroutable(problem: String, grace_until: Option<Instant>, now: Instant) -> SinkError {
    match grace_until {
        // The binding this topic needs is not back yet: waits like a
        // topic that does not exist, without pausing the target.
        Some(until) if now < until => SinkError::new(
            FailureKind::UnknownTopic,
            format!(
                "{problem}; retried: the connection was re-established moments ago and the broker may still be restoring its bindings"
            ),
        ),
        _ => SinkError::permanent(problem),
    }
}

fn message_route(exchange: &str) -> String {
    if exchange.is_empty() {
        "the default exchange".to_string()
    } else {
        format!("exchange {exchange:?}")
    }
}

/// A channel with publisher confirms, within [`CONNECT_TIMEOUT`]: a broker
/// that took the connection but does not answer (one still booting) must
/// not hold the link's lock, and with it every publish and probe, forever.
async fn confirm_channel(connection: &Connection) -> Result<Channel, SinkError> {
    let open = async {
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| SinkError::unavailable(format!("cannot open a channel: {e}")))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| SinkError::unavailable(format!("cannot enable publisher confirms: {e}")))?;
        Ok(channel)
    };
    tokio::time::timeout(CONNECT_TIMEOUT, open).await.map_err(|_| {
        SinkError::timed_out(format!(
            "cannot open a channel with publisher confirms: no answer within {} s",
            CONNECT_TIMEOUT.as_secs()
        ))
    })?
}

/// The AMQP message id: the message's dedup id, unless that is longer than a
/// short string can be (the event id suffixed with target, a long routing key
/// and ordinal, when the event also sends several messages to JetStream);
/// then the event id and a hash of the whole, as stable across attempts.
fn message_id(message: &OutgoingMessage) -> ShortString {
    use sha2::{Digest, Sha256};
    if message.dedup_id.len() <= SHORT_STRING_MAX {
        return message.dedup_id.as_str().into();
    }
    let digest = Sha256::digest(message.dedup_id.as_bytes());
    format!("{}:{digest:x}", message.event_id).into()
}

/// Why AMQP cannot carry this message at all: routing keys and header
/// names are short strings (at most 255 bytes).
fn unsendable(message: &OutgoingMessage) -> Option<String> {
    if let Err(SinkError { message: problem, .. }) = check_routing_key(&message.topic) {
        return Some(problem);
    }
    message
        .headers
        .iter()
        .find(|(name, _)| name.len() > SHORT_STRING_MAX)
        .map(|(name, _)| {
            format!(
                "header name of {} bytes; AMQP allows at most {SHORT_STRING_MAX}",
                name.len()
            )
        })
}

impl Sink for RabbitMqSink {
    fn kind(&self) -> &'static str {
        "rabbitmq"
    }

    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(self.publish_all(messages))
    }

    /// Connected, and the exchange exists (a passive declare, on a channel
    /// of its own: a missing exchange closes the channel it was asked on).
    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async move {
            self.channel().await?;
            if self.config.exchange.is_empty() {
                return Ok(());
            }
            let declare = async {
                let connection = {
                    let link = self.link.lock().await;
                    match link.as_ref() {
                        Some(link) => link
                            .connection
                            .create_channel()
                            .await
                            .map_err(|e| self.classify(&e))?,
                        None => return Err(SinkError::unavailable("not connected")),
                    }
                };
                let options = ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                };
                let declared = connection
                    .exchange_declare(
                        self.config.exchange.as_str().into(),
                        ExchangeKind::Topic,
                        options,
                        FieldTable::default(),
                    )
                    .await;
                let _ = connection.close(200, "".into()).await;
                declared.map_err(|e| self.classify(&e))
            };
            tokio::time::timeout(CONNECT_TIMEOUT, declare)
                .await
                .map_err(|_| {
                    SinkError::timed_out(format!(
                        "the exchange check got no answer within {} s",
                        CONNECT_TIMEOUT.as_secs()
                    ))
                })?
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_id_too_long_for_amqp_is_shortened_the_same_way_every_time() {
        let message = |dedup_id: String| OutgoingMessage {
            event_id: "0b5d1e8e-7f0e-4c2a-9a43-3b9c1f6a2d10".into(),
            dedup_id,
            ..OutgoingMessage::default()
        };
        let short = message("0b5d1e8e-7f0e-4c2a-9a43-3b9c1f6a2d10:nats:a.b#0".into());
        assert_eq!(message_id(&short).as_str(), short.dedup_id);
        let long = |key: &str| message(format!("0b5d1e8e-7f0e-4c2a-9a43-3b9c1f6a2d10:rabbit:{key}#0"));
        let (one, two) = (long(&"x".repeat(250)), long(&"y".repeat(250)));
        let id = message_id(&one);
        assert!(id.as_str().len() <= SHORT_STRING_MAX, "{id}");
        assert!(
            id.as_str().starts_with("0b5d1e8e-7f0e-4c2a-9a43-3b9c1f6a2d10:"),
            "{id}"
        );
        assert_eq!(message_id(&one), id, "stable across attempts");
        assert_ne!(message_id(&two), id, "distinct per message");
    }

    #[test]
    fn amqp_limits_are_refused_per_message() {
        let message = |topic: &str, header: &str| OutgoingMessage {
            topic: topic.to_string(),
            headers: vec![(header.to_string(), "v".to_string())],
            ..OutgoingMessage::default()
        };
        assert_eq!(unsendable(&message("orders.created", "traceparent")), None);
        let long_key = unsendable(&message(&"k".repeat(256), "traceparent")).unwrap();
        assert!(long_key.contains("routing key of 256 bytes"), "{long_key}");
        let long_header = unsendable(&message("orders", &"h".repeat(300))).unwrap();
        assert!(long_header.contains("header name of 300 bytes"), "{long_header}");
    }

    #[test]
    fn unroutable_is_retried_only_within_the_grace_after_a_reconnect() {
        let now = Instant::now();
        let problem = || "unroutable: exchange \"orders\" ...".to_string();
        let first_connection = unroutable(problem(), None, now);
        assert_eq!(
            first_connection.kind,
            FailureKind::Refused,
            "{}",
            first_connection.message
        );
        let soon_after = unroutable(problem(), Some(now + Duration::from_secs(10)), now);
        assert_eq!(soon_after.kind, FailureKind::UnknownTopic);
        assert!(
            soon_after.message.contains("restoring its bindings"),
            "{}",
            soon_after.message
        );
        let later = unroutable(problem(), Some(now), now + Duration::from_millis(1));
        assert_eq!(later.kind, FailureKind::Refused, "{}", later.message);
        assert_eq!(later.message, problem());
    }
}
