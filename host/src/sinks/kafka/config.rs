//! Config for the Kafka target and the librdkafka client config it builds.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::ClientConfig;
use serde::Deserialize;

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
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSinkConfig {
    /// `host:port` list, comma-separated. Overridden by `SWITCHYARD_TARGET_<NAME>_URL`.
    pub bootstrap_servers: String,
    /// librdkafka producer properties, passed through as given (TLS, SASL,
    /// compression, batching, ...). They override the relay's defaults.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

impl KafkaSinkConfig {
    pub(crate) fn apply_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
        if let Some(url) = env(&format!("{prefix}URL")) {
            self.bootstrap_servers = url;
        }
        if let Some(user) = env(&format!("{prefix}USER")) {
            self.properties.insert("sasl.username".into(), user);
        }
        if let Some(password) = env(&format!("{prefix}PASSWORD")) {
            self.properties.insert("sasl.password".into(), password);
        }
    }

    pub(crate) fn validate(&self) -> Vec<String> {
        let mut problems = Vec::new();
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
        for (name, reason) in OWNED {
            if self.properties.contains_key(*name) {
                problems.push(format!("properties may not set {name:?}: {reason}"));
            }
        }
        if problems.is_empty() {
            // librdkafka checks every name and value without connecting.
            if let Err(e) = self.client_config(Duration::from_secs(10)).create_native_config() {
                problems.push(format!("properties: {e}"));
            }
        }
        problems
    }

    /// The producer config: the relay's safe defaults, then the user's
    /// properties on top.
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
            // Report a missing topic (a permanent error) before the message
            // times out (a retryable one).
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
