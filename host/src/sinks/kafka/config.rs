//! Config for the Kafka target and the librdkafka client config it builds.

use std::collections::BTreeMap;
use std::sync::Arc;
#[cfg(feature = "kafka")]
use std::time::Duration;

#[cfg(feature = "kafka")]
use rdkafka::ClientConfig;
use serde::Deserialize;

use crate::secret::SecretValue;
use crate::sinks::registry::{SinkSettings, TargetKind};
use crate::sinks::{Sink, SinkError};

/// Properties the relay sets itself; `properties` may not name them.
const OWNED: &[(&str, &str)] = &[
    ("bootstrap.servers", "set bootstrap_servers instead"),
    (
        "message.timeout.ms",
        "the relay sets it from relay.publish_timeout_ms so a delivery report never outlives the lease",
    ),
    (
        "delivery.timeout.ms",
        "the relay sets message.timeout.ms from relay.publish_timeout_ms",
    ),
];

/// `[targets.NAME]` with `type = "kafka"`.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkConfig {
    /// `host:port` list, comma-separated.
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_URL"))]
    pub bootstrap_servers: String,
    /// librdkafka producer properties, passed through as given (TLS, SASL,
    /// compression, batching, ...). They override the relay's defaults,
    /// except the delivery guarantees (see `allow_weaker_delivery`). The
    /// environment may set `sasl.username`.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_USER"))]
    pub properties: BTreeMap<String, String>,
    /// Lets `properties` weaken `acks = all` or turn the idempotent producer
    /// off. Without it such a config is refused: with `acks = 1` a broker
    /// failure can lose messages the relay already marked published, and
    /// without idempotence librdkafka's own retries can duplicate or reorder.
    #[serde(default)]
    pub allow_weaker_delivery: bool,
    /// The SASL password (`sasl.password`), as a value or from a file or a
    /// command read again every `refresh_seconds`: when it changes, the
    /// relay builds a new producer with it and lets the old one finish its
    /// deliveries.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_PASSWORD"))]
    pub password: Option<SecretValue>,
}

impl KafkaSinkConfig {
    /// What `properties` weakens of the relay's delivery guarantees, one line each.
    #[must_use]
    pub fn weakened(&self) -> Vec<String> {
        let mut weakened = Vec::new();
        let acks = self
            .properties
            .get("acks")
            .or_else(|| self.properties.get("request.required.acks"));
        if let Some(acks) = acks
            && !matches!(acks.trim(), "all" | "-1")
        {
            weakened.push(format!(
                "properties sets acks = {acks:?}: a message acknowledged by the leader alone is lost if that broker fails before replicating it"
            ));
        }
        if self
            .properties
            .get("enable.idempotence")
            .is_some_and(|value| matches!(value.trim(), "false" | "0"))
        {
            weakened.push(
                "properties sets enable.idempotence = false: librdkafka's internal retries may duplicate or reorder messages of one key"
                    .to_string(),
            );
        }
        weakened
    }

    /// The producer config: the relay's safe defaults, then the user's
    /// properties on top.
    #[cfg(feature = "kafka")]
    pub(crate) fn client_config(&self, publish_timeout: Duration) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.bootstrap_servers)
            // No duplicates or reordering from librdkafka's own retries.
            .set("enable.idempotence", "true")
            .set("acks", "all")
            // The Java client's partitioner, so a key lands where other
            // producers of the same topic put it.
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "5")
            .set("message.timeout.ms", publish_timeout.as_millis().to_string())
            // A broker back from an outage is reconnected to within a
            // second (librdkafka's default backs off up to 10 s).
            .set("reconnect.backoff.max.ms", "1000")
            // Report a missing topic (unknown_topic) before the message
            // times out (timed_out).
            .set(
                "topic.metadata.propagation.max.ms",
                (publish_timeout / 2).as_millis().to_string(),
            )
            .set("client.id", "switchyard");
        for (name, value) in &self.properties {
            config.set(name, value);
        }
        config
    }
}

impl TargetKind for KafkaSinkConfig {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    fn validate(&self, _settings: &SinkSettings) -> Vec<String> {
        let mut problems = Vec::new();
        #[cfg(not(feature = "kafka"))]
        problems.push(crate::features::built_without("Kafka", "kafka"));
        if self.bootstrap_servers.trim().is_empty() {
            problems.push("bootstrap_servers is empty".to_string());
        }
        for server in self.bootstrap_servers.split(',').map(str::trim) {
            if server.contains("://") && !server.starts_with("PLAINTEXT://") && !server.starts_with("SSL://")
            {
                problems.push(format!(
                    "bootstrap server {server:?} must be host:port (optionally PLAINTEXT:// or SSL://)"
                ));
            }
        }
        if self.password.is_some() && self.properties.contains_key("sasl.password") {
            problems.push(
                "the SASL password is set twice (password and properties.\"sasl.password\"): keep one"
                    .to_string(),
            );
        }
        if let Some(password) = &self.password {
            problems.extend(password.problems("password"));
        }
        for (name, reason) in OWNED {
            if self.properties.contains_key(*name) {
                problems.push(format!("properties may not set {name:?}: {reason}"));
            }
        }
        let weakened = self.weakened();
        if !self.allow_weaker_delivery {
            for what in weakened {
                problems.push(format!("{what}; set allow_weaker_delivery = true to accept this"));
            }
        }
        #[cfg(feature = "kafka")]
        if problems.is_empty() {
            // librdkafka checks every name and value without connecting.
            if let Err(e) = self.client_config(Duration::from_secs(10)).create_native_config() {
                problems.push(format!("properties: {e}"));
            }
        }
        problems
    }

    fn apply_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
        if let Some(url) = env(&format!("{prefix}URL")) {
            self.bootstrap_servers = url;
        }
        if let Some(user) = env(&format!("{prefix}USER")) {
            self.properties.insert("sasl.username".into(), user);
        }
        if let Some(password) = SecretValue::from_env(env, &format!("{prefix}PASSWORD")) {
            self.properties.remove("sasl.password");
            self.password = Some(password);
        }
    }

    fn check_topic(&self, topic: &str) -> Result<(), SinkError> {
        check_topic(topic)
    }

    #[cfg(feature = "kafka")]
    async fn build(&self, name: &str, settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        let sink = super::KafkaSink::connect(name, self, settings.publish_timeout).await?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    }

    #[cfg(not(feature = "kafka"))]
    async fn build(&self, name: &str, _settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        Err(SinkError::permanent(format!(
            "target {name:?}: {}",
            crate::features::built_without("Kafka", "kafka")
        )))
    }
}

/// Properties are printed with secrets masked: `sasl.password` and anything
/// else whose name says it holds a secret.
impl std::fmt::Debug for KafkaSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let properties: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(name, value)| {
                let secret = ["password", "secret", "token", "key.pem", "jaas"]
                    .iter()
                    .any(|s| name.contains(s));
                (name.as_str(), if secret { "***" } else { value.as_str() })
            })
            .collect();
        f.debug_struct("KafkaSinkConfig")
            .field("bootstrap_servers", &crate::redact::url(&self.bootstrap_servers))
            .field("properties", &properties)
            .field("allow_weaker_delivery", &self.allow_weaker_delivery)
            .field("password", &self.password)
            .finish()
    }
}

/// Kafka topic names: 1 to 249 of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub(crate) fn check_topic(topic: &str) -> Result<(), SinkError> {
    let valid = !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(SinkError::permanent(format!(
            "invalid Kafka topic name {topic:?} (1-249 characters of a-z, A-Z, 0-9, '.', '_', '-')"
        )))
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

    fn config(properties: &[(&str, &str)], allow: bool) -> KafkaSinkConfig {
        KafkaSinkConfig {
            bootstrap_servers: "127.0.0.1:9092".into(),
            properties: properties
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            allow_weaker_delivery: allow,
            password: None,
        }
    }

    #[test]
    fn weaker_acks_or_idempotence_are_refused_unless_allowed() {
        let problems = config(&[("acks", "1"), ("enable.idempotence", "false")], false).validate(&SETTINGS);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("acks = \"1\"") && problems[0].contains("allow_weaker_delivery"));
        assert!(problems[1].contains("enable.idempotence = false"));
        assert!(config(&[("request.required.acks", "0")], false).validate(&SETTINGS)[0].contains("acks"));

        let allowed = config(&[("acks", "1"), ("enable.idempotence", "false")], true);
        assert!(
            allowed.validate(&SETTINGS).is_empty(),
            "{:?}",
            allowed.validate(&SETTINGS)
        );
        assert_eq!(allowed.weakened().len(), 2, "still reported as weakened");

        assert!(
            config(&[("acks", "all"), ("enable.idempotence", "true")], false)
                .validate(&SETTINGS)
                .is_empty()
        );
        assert!(config(&[("acks", "-1")], false).validate(&SETTINGS).is_empty());
    }

    #[test]
    fn debug_output_hides_secrets() {
        let shown = format!(
            "{:?}",
            config(&[("sasl.password", "hunter2"), ("sasl.username", "relay")], false)
        );
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("relay"));
        let mut with_password = config(&[], false);
        with_password.password = Some(SecretValue::Value("hunter2".into()));
        assert!(!format!("{with_password:?}").contains("hunter2"));
    }

    #[test]
    fn the_password_comes_from_one_place_and_its_file_is_read_again() {
        let mut target = config(&[("sasl.password", "inline")], false);
        target.password = Some(SecretValue::Value("also".into()));
        let problems = target.validate(&SETTINGS);
        assert!(problems.iter().any(|p| p.contains("set twice")), "{problems:?}");

        // The environment's file replaces an inline password, and is a
        // source read again, not a value read once.
        let mut target = config(&[("sasl.password", "inline")], false);
        target.apply_env("SWITCHYARD_TARGET_KAFKA_", &|name| {
            (name == "SWITCHYARD_TARGET_KAFKA_PASSWORD_FILE").then(|| "/run/secrets/kafka".to_string())
        });
        assert!(!target.properties.contains_key("sasl.password"));
        assert!(matches!(&target.password, Some(SecretValue::From(source)) if source.file.is_some()));
        let problems = target.validate(&SETTINGS);
        assert!(
            problems.iter().any(|p| p.contains("/run/secrets/kafka")),
            "a missing file is named: {problems:?}"
        );
    }
}
