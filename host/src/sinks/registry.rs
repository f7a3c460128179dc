//! The target kinds: what a `[targets.NAME]` table may be, and the one
//! place that dispatches on it. A kind is a module under `sinks/` whose
//! config implements [`TargetKind`] (its validation, environment overrides,
//! topic rule, deduplication and connection), plus one line in
//! [`TargetConfig`] and one in `each_kind!`.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use super::aws::{eventbridge, kinesis, sns, sqs};
use super::{Sink, SinkError, file, http, kafka, nats, pubsub, rabbitmq, redis, stdout};

/// What a target takes from the relay's settings.
#[derive(Debug, Clone)]
pub struct SinkSettings {
    /// Bound on one publish.
    pub publish_timeout: Duration,
    /// How long the relay may retry one event (JetStream's duplicate window
    /// must cover it).
    pub retry_horizon: Duration,
    /// `[admin] mask_fields`: what a target quoting a JSON answer hides.
    pub mask_fields: Vec<String>,
}

/// What every target kind's config provides.
pub(crate) trait TargetKind {
    /// Its `type`, as written in the config.
    fn kind(&self) -> &'static str;

    /// What is wrong with these settings, each naming its key.
    fn validate(&self, _settings: &SinkSettings) -> Vec<String> {
        Vec::new()
    }

    /// Takes addresses and secrets from `{prefix}URL`, `{prefix}PASSWORD`...
    fn apply_env(&mut self, _prefix: &str, _env: &dyn Fn(&str) -> Option<String>) {}

    /// Whether the broker accepts `topic` (subject, routing key) at all.
    ///
    /// # Errors
    /// A permanent [`SinkError`] saying why not.
    fn check_topic(&self, _topic: &str) -> Result<(), SinkError> {
        Ok(())
    }

    /// Whether the broker drops a second message with the same id.
    fn deduplicates_by_id(&self) -> bool {
        false
    }

    /// Builds the sink called `name` (its health check is the caller's).
    async fn build(&self, name: &str, settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError>;

    /// What `switchyard validate` finds wrong on the broker itself (a
    /// listed topic missing), or why it could not look.
    ///
    /// # Errors
    /// The broker could not be asked (a warning, not a problem).
    async fn live_problems(&self, _name: &str, _settings: &SinkSettings) -> Result<Vec<String>, String> {
        Ok(Vec::new())
    }
}

/// A broker plugins can publish to, picked by `type`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TargetConfig {
    /// A NATS server, core or JetStream.
    Nats(nats::NatsSinkConfig),
    /// A Kafka cluster.
    Kafka(kafka::KafkaSinkConfig),
    /// A RabbitMQ exchange.
    Rabbitmq(rabbitmq::RabbitMqSinkConfig),
    /// Google Cloud Pub/Sub topics of one project.
    Pubsub(pubsub::PubSubSinkConfig),
    /// Amazon SQS queues, standard or FIFO.
    Sqs(sqs::SqsSinkConfig),
    /// Amazon SNS topics, standard or FIFO.
    Sns(sns::SnsSinkConfig),
    /// Amazon EventBridge event buses.
    Eventbridge(eventbridge::EventBridgeSinkConfig),
    /// Amazon Kinesis data streams.
    Kinesis(kinesis::KinesisSinkConfig),
    /// HTTP endpoints (webhooks).
    Http(http::HttpSinkConfig),
    /// Redis streams.
    Redis(redis::RedisSinkConfig),
    /// Standard output, for demos and debugging.
    Stdout(stdout::StdoutSinkConfig),
    /// A JSON-lines file, for demos, debugging and tests.
    File(file::FileSinkConfig),
}

/// `$body` with `$config` bound to the kind's own config.
macro_rules! each_kind {
    ($target:expr, $config:ident => $body:expr) => {
        match $target {
            TargetConfig::Nats($config) => $body,
            TargetConfig::Kafka($config) => $body,
            TargetConfig::Rabbitmq($config) => $body,
            TargetConfig::Pubsub($config) => $body,
            TargetConfig::Sqs($config) => $body,
            TargetConfig::Sns($config) => $body,
            TargetConfig::Eventbridge($config) => $body,
            TargetConfig::Kinesis($config) => $body,
            TargetConfig::Http($config) => $body,
            TargetConfig::Redis($config) => $body,
            TargetConfig::Stdout($config) => $body,
            TargetConfig::File($config) => $body,
        }
    };
}

impl TargetConfig {
    /// The kind, as written in `type`.
    pub fn kind(&self) -> &'static str {
        each_kind!(self, config => config.kind())
    }

    /// What is wrong with this target's settings, each naming its key.
    pub fn validate(&self, settings: &SinkSettings) -> Vec<String> {
        each_kind!(self, config => config.validate(settings))
    }

    /// Takes addresses and secrets from the environment, under `prefix`.
    pub fn apply_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
        each_kind!(self, config => config.apply_env(prefix, env));
    }

    /// Whether the broker accepts `topic` at all.
    ///
    /// # Errors
    /// A permanent [`SinkError`] saying why not.
    pub fn check_topic(&self, topic: &str) -> Result<(), SinkError> {
        each_kind!(self, config => config.check_topic(topic))
    }

    /// Whether the broker drops a second message with the same id.
    pub fn deduplicates_by_id(&self) -> bool {
        each_kind!(self, config => config.deduplicates_by_id())
    }

    /// Builds the sink called `name`.
    ///
    /// # Errors
    /// What the kind's constructor refused.
    pub async fn build(&self, name: &str, settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        each_kind!(self, config => config.build(name, settings).await)
    }

    /// What `switchyard validate` finds wrong on the broker itself.
    ///
    /// # Errors
    /// The broker could not be asked.
    pub async fn live_problems(&self, name: &str, settings: &SinkSettings) -> Result<Vec<String>, String> {
        each_kind!(self, config => config.live_problems(name, settings).await)
    }
}
