//! Config for the RabbitMQ target.

use std::sync::Arc;

use serde::Deserialize;

use crate::secret::SecretValue;
use crate::tls::BrokerTlsConfig;

use crate::sinks::registry::{SinkSettings, TargetKind};
use crate::sinks::{Sink, SinkError};

/// `[targets.NAME]` with `type = "rabbitmq"`.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RabbitMqSinkConfig {
    /// AMQP URL, e.g. `amqp://user:password@127.0.0.1:5672/%2f` (`amqps://`
    /// for TLS; `?auth_mechanism=external` logs in with the client
    /// certificate).
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_URL"))]
    pub url: String,
    /// The password, or where to read it for each connection, in place of
    /// the URL's.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_PASSWORD"))]
    pub password: Option<SecretValue>,
    /// A custom CA and a client certificate (`amqps://` only).
    #[serde(default)]
    pub tls: BrokerTlsConfig,
    /// The exchange every message of this target goes to; it must exist
    /// (the relay never declares it). `""` is the default exchange, where
    /// the routing key names a queue.
    pub exchange: String,
    /// Delivery mode 2: queues that are durable keep the message across a
    /// broker restart.
    #[serde(default = "default_true")]
    pub persistent: bool,
    /// Name the connection shows on the broker.
    #[serde(default = "default_connection_name")]
    pub connection_name: String,
    /// For this long after a connection replaced a lost one (or followed a
    /// failed attempt), an unroutable message is retried instead of
    /// dead-lettered: a restarted broker accepts connections before it has
    /// restored the bindings of its durable queues. 0 turns this off.
    #[serde(default = "default_unroutable_grace_ms")]
    pub unroutable_grace_ms: u64,
}

/// Five minutes: restoring bindings took 1.3 s on an idle machine, more
/// than 10 s on a loaded one, and more than a minute after a SIGKILL with
/// thousands of messages queued on a loaded two-core machine (a queue's
/// binding routes once its messages are recovered). A message that is
/// truly unroutable waits this long once; nothing is lost meanwhile.
const fn default_unroutable_grace_ms() -> u64 {
    300_000
}

const fn default_true() -> bool {
    true
}

fn default_connection_name() -> String {
    "switchyard".to_string()
}

/// AMQP short strings (exchange names, routing keys, header names) hold at most 255 bytes.
pub(super) const SHORT_STRING_MAX: usize = 255;

/// Whether AMQP can carry `topic` as a routing key (a short string: at most 255 bytes).
///
/// # Errors
/// Why not.
pub fn check_routing_key(topic: &str) -> Result<(), SinkError> {
    if topic.len() > SHORT_STRING_MAX {
        Err(SinkError::permanent(format!(
            "routing key of {} bytes; AMQP allows at most {SHORT_STRING_MAX}",
            topic.len()
        )))
    } else {
        Ok(())
    }
}

impl TargetKind for RabbitMqSinkConfig {
    fn kind(&self) -> &'static str {
        "rabbitmq"
    }

    fn validate(&self, _settings: &SinkSettings) -> Vec<String> {
        let mut problems = Vec::new();
        #[cfg(not(feature = "rabbitmq"))]
        problems.push(crate::features::built_without("RabbitMQ", "rabbitmq"));
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            problems.push(format!(
                "url {:?} must use amqp:// or amqps://",
                crate::redact::url(&self.url)
            ));
        } else if let Some(error) = url_problem(&self.url) {
            problems.push(format!(
                "url {:?} is not a valid AMQP URL: {}",
                crate::redact::url(&self.url),
                crate::redact::url(&error)
            ));
        }
        if let Some(password) = &self.password {
            problems.extend(password.problems("password"));
        }
        problems.extend(self.tls.problems("tls"));
        if self.tls.is_set() && !self.url.starts_with("amqps://") {
            problems.push("tls is set but the url is not amqps://".to_string());
        }
        if self.exchange.len() > SHORT_STRING_MAX {
            problems.push(format!("exchange is longer than {SHORT_STRING_MAX} bytes"));
        }
        if self.exchange.starts_with("amq.") && self.exchange != "amq.topic" && self.exchange != "amq.direct"
        {
            problems.push(format!(
                "exchange {:?}: publishing to the broker's reserved amq.* exchanges other than amq.topic and amq.direct is refused by RabbitMQ",
                self.exchange
            ));
        }
        problems
    }

    fn apply_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
        if let Some(url) = env(&format!("{prefix}URL")) {
            self.url = url;
        }
        if let Some(password) = SecretValue::from_env(env, &format!("{prefix}PASSWORD")) {
            self.password = Some(password);
        }
    }

    fn check_topic(&self, topic: &str) -> Result<(), SinkError> {
        check_routing_key(topic)
    }

    #[cfg(feature = "rabbitmq")]
    async fn build(&self, name: &str, settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        let sink = super::RabbitMqSink::new(name, self, settings.publish_timeout);
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    }

    #[cfg(not(feature = "rabbitmq"))]
    async fn build(&self, name: &str, _settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        Err(SinkError::permanent(format!(
            "target {name:?}: {}",
            crate::features::built_without("RabbitMQ", "rabbitmq")
        )))
    }
}

/// Why `url` is not an AMQP URL, as the client reads it.
#[cfg(feature = "rabbitmq")]
fn url_problem(url: &str) -> Option<String> {
    url.parse::<lapin::uri::AMQPUri>().err()
}

/// Without the client, a URL is checked when a build with it starts.
#[cfg(not(feature = "rabbitmq"))]
fn url_problem(_url: &str) -> Option<String> {
    None
}

#[cfg(feature = "rabbitmq")]
impl RabbitMqSinkConfig {
    /// The URL with the password read now, and the TLS settings with the
    /// files read now: what one connection is made from.
    pub(super) async fn connection(
        &self,
    ) -> Result<(lapin::uri::AMQPUri, lapin::tcp::OwnedTLSConfig), String> {
        let mut uri: lapin::uri::AMQPUri = self.url.parse().map_err(|e: String| crate::redact::url(&e))?;
        if let Some(password) = &self.password {
            uri.authority.userinfo.password = password
                .read()
                .await
                .map_err(|e| e.to_string())?
                .expose()
                .to_string();
        }
        let read = |path: &std::path::Path| {
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
        };
        let mut tls = lapin::tcp::OwnedTLSConfig::default();
        if let Some(root) = &self.tls.root_cert {
            tls.cert_chain = Some(String::from_utf8_lossy(&read(root)?).into_owned());
        }
        if let (Some(cert), Some(key)) = (&self.tls.client_cert, &self.tls.client_key) {
            tls.identity = Some(lapin::tcp::OwnedIdentity::PKCS8 {
                pem: read(cert)?,
                key: read(key)?,
            });
        }
        Ok((uri, tls))
    }
}

/// The password in the URL is never printed.
impl std::fmt::Debug for RabbitMqSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqSinkConfig")
            .field("url", &crate::redact::url(&self.url))
            .field("password", &self.password)
            .field("tls", &self.tls)
            .field("exchange", &self.exchange)
            .field("persistent", &self.persistent)
            .field("connection_name", &self.connection_name)
            .field("unroutable_grace_ms", &self.unroutable_grace_ms)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTINGS: SinkSettings = SinkSettings {
        publish_timeout: std::time::Duration::from_secs(1),
        retry_horizon: std::time::Duration::from_secs(1),
        mask_fields: Vec::new(),
    };

    fn config(url: &str, exchange: &str) -> RabbitMqSinkConfig {
        RabbitMqSinkConfig {
            url: url.to_string(),
            password: None,
            tls: BrokerTlsConfig::default(),
            exchange: exchange.to_string(),
            persistent: true,
            connection_name: default_connection_name(),
            unroutable_grace_ms: default_unroutable_grace_ms(),
        }
    }

    #[test]
    fn urls_and_exchanges_are_checked_without_showing_the_password() {
        assert!(
            config("amqp://127.0.0.1:5672/%2f", "orders")
                .validate(&SETTINGS)
                .is_empty()
        );
        assert!(
            config("amqps://user:secret@broker:5671/prod", "")
                .validate(&SETTINGS)
                .is_empty()
        );
        let problems = config("http://user:secret@broker", "orders").validate(&SETTINGS);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("must use amqp://"), "{problems:?}");
        assert!(!problems[0].contains("secret"), "{problems:?}");
        let long = config("amqp://127.0.0.1", &"x".repeat(256)).validate(&SETTINGS);
        assert!(long[0].contains("longer than 255 bytes"), "{long:?}");
        let debug = format!("{:?}", config("amqp://user:secret@broker/", "orders"));
        assert!(!debug.contains("secret"), "{debug}");
    }
}
