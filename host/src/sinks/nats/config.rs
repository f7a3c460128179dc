//! Config for the NATS target and the client options it builds.

use std::sync::Arc;

use serde::Deserialize;

use crate::sinks::registry::{SinkSettings, TargetKind};
use crate::sinks::{Sink, SinkError};

/// How messages are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NatsMode {
    /// JetStream publish, awaiting the stream's ack (at-least-once, deduplicated).
    #[default]
    Jetstream,
    /// Core NATS publish followed by a flush: the server got it, nobody may have stored it.
    Core,
}

/// `[targets.NAME]` with `type = "nats"`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    /// Server URL(s), comma-separated, e.g. `nats://127.0.0.1:4222`.
    /// Overridden by `SWITCHYARD_TARGET_<NAME>_URL`.
    pub url: String,
    /// Core or JetStream publishing.
    #[serde(default)]
    pub mode: NatsMode,
    /// User name; overridden by `SWITCHYARD_TARGET_<NAME>_USER`.
    #[serde(default)]
    pub user: Option<String>,
    /// Password; overridden by `SWITCHYARD_TARGET_<NAME>_PASSWORD`.
    #[serde(default)]
    pub password: Option<String>,
    /// Token; overridden by `SWITCHYARD_TARGET_<NAME>_TOKEN`.
    #[serde(default)]
    pub token: Option<String>,
    /// Name the connection shows on the server.
    #[serde(default = "default_connection_name")]
    pub connection_name: String,
    /// JetStream publishes awaiting an ack at once, per target.
    #[serde(default = "default_max_ack_inflight")]
    pub max_ack_inflight: usize,
    /// A stream to create at startup if it does not exist (JetStream mode).
    /// Without it, streams are managed outside the relay.
    #[serde(default)]
    pub stream: Option<StreamSpec>,
    /// JetStream's duplicate window the relay relies on: a retry of an
    /// event whose first publish was stored but not acknowledged is dropped
    /// by the stream only within this window. `validate` requires it to
    /// cover the relay's retry horizon; the relay creates `stream` with it,
    /// refuses to start on a configured stream with a shorter one, and warns
    /// about any other stream it writes into whose window is shorter.
    #[serde(default = "default_duplicate_window_seconds")]
    pub duplicate_window_seconds: u64,
}

/// Ten minutes: covers the default retry settings' horizon (about 7.5 min).
const fn default_duplicate_window_seconds() -> u64 {
    600
}

/// A JetStream stream the relay makes sure exists.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSpec {
    /// Stream name, e.g. `ORDERS`.
    pub name: String,
    /// Subjects it captures, e.g. `["orders.>"]`.
    pub subjects: Vec<String>,
}

fn default_connection_name() -> String {
    "switchyard".to_string()
}

const fn default_max_ack_inflight() -> usize {
    4096
}

impl NatsSinkConfig {
    pub(crate) fn problems(&self, horizon: std::time::Duration) -> Vec<String> {
        let mut problems = Vec::new();
        if self.mode == NatsMode::Jetstream && self.duplicate_window() < horizon {
            problems.push(format!(
                "duplicate_window_seconds ({}) is shorter than the relay's retry horizon \
                 ({} s: relay.max_attempts backoffs at their longest plus a lease each), so a retry could \
                 store an event twice; raise it (and the streams' duplicate window) or lower \
                 relay.max_attempts, relay.max_backoff_ms or relay.lease_duration_ms",
                self.duplicate_window_seconds,
                horizon.as_secs()
            ));
        }
        if self.url.trim().is_empty() {
            problems.push("url is empty".to_string());
        }
        for url in self.url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            if !(url.starts_with("nats://") || url.starts_with("tls://") || !url.contains("://")) {
                problems.push(format!(
                    "url {:?} must use nats:// or tls://",
                    crate::redact::url(url)
                ));
            }
        }
        if self.password.is_some() && self.user.is_none() {
            problems.push("password is set but user is not".to_string());
        }
        if self.token.is_some() && self.user.is_some() {
            problems.push("set either token or user/password, not both".to_string());
        }
        if let Some(stream) = &self.stream {
            if self.mode != NatsMode::Jetstream {
                problems.push("stream is only meaningful with mode = \"jetstream\"".to_string());
            }
            if stream.name.is_empty() || stream.name.contains(['.', '*', '>', ' ']) {
                problems.push(format!(
                    "stream.name {:?} is not a valid stream name",
                    stream.name
                ));
            }
            if stream.subjects.is_empty() {
                problems.push("stream.subjects is empty".to_string());
            }
        }
        if self.max_ack_inflight == 0 {
            problems.push("max_ack_inflight must be at least 1".to_string());
        }
        problems
    }

    /// The duplicate window as a duration.
    pub fn duplicate_window(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.duplicate_window_seconds)
    }

    pub(crate) fn connect_options(&self) -> async_nats::ConnectOptions {
        let mut options = async_nats::ConnectOptions::new().name(&self.connection_name);
        if let (Some(user), Some(password)) = (&self.user, &self.password) {
            options = options.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &self.token {
            options = options.token(token.clone());
        }
        options
    }
}

impl TargetKind for NatsSinkConfig {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn validate(&self, settings: &SinkSettings) -> Vec<String> {
        self.problems(settings.retry_horizon)
    }

    fn apply_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
        if let Some(url) = env(&format!("{prefix}URL")) {
            self.url = url;
        }
        if let Some(user) = env(&format!("{prefix}USER")) {
            self.user = Some(user);
        }
        if let Some(password) = env(&format!("{prefix}PASSWORD")) {
            self.password = Some(password);
        }
        if let Some(token) = env(&format!("{prefix}TOKEN")) {
            self.token = Some(token);
        }
    }

    fn check_topic(&self, topic: &str) -> Result<(), SinkError> {
        super::sink::check_subject(topic)
    }

    fn deduplicates_by_id(&self) -> bool {
        self.mode == NatsMode::Jetstream
    }

    async fn build(&self, name: &str, settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        let sink =
            super::NatsSink::connect(name, self, settings.publish_timeout, settings.retry_horizon).await?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    }
}

/// Credentials are never printed.
impl std::fmt::Debug for NatsSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let masked = |secret: &Option<String>| secret.as_ref().map(|_| "***");
        f.debug_struct("NatsSinkConfig")
            .field("url", &crate::redact::url(&self.url))
            .field("mode", &self.mode)
            .field("user", &self.user)
            .field("password", &masked(&self.password))
            .field("token", &masked(&self.token))
            .field("connection_name", &self.connection_name)
            .field("max_ack_inflight", &self.max_ack_inflight)
            .field("stream", &self.stream)
            .field("duplicate_window_seconds", &self.duplicate_window_seconds)
            .finish()
    }
}
