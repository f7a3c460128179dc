//! The Redis Streams target (`type = "redis"`): each message an `XADD` to
//! the stream the plugin's topic names, its fields the payload (`payload`)
//! and each header (the event id always among them), optionally trimmed
//! (`MAXLEN ~` or `MINID ~`). Delivered means the server answered with the
//! entry's id. Redis keeps no deduplication: a message sent again after a
//! lost answer is a second entry, which consumers drop by the
//! `Switchyard-Event-Id` field. A single server or a Redis Cluster, over
//! TLS, with an ACL user whose password is read again for each connection.

use std::sync::Arc;

use serde::Deserialize;

use crate::secret::SecretValue;
use crate::sinks::registry::{SinkSettings, TargetKind};
use crate::sinks::{Sink, SinkError};
use crate::tls::BrokerTlsConfig;

/// `[targets.NAME]` with `type = "redis"`.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedisSinkConfig {
    /// `redis://host:6379/0`, or `rediss://` for TLS. With `cluster`,
    /// several, comma-separated: the nodes to learn the cluster from.
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_URL"))]
    pub url: String,
    /// A Redis Cluster: keys (streams) are placed by their hash slot; name
    /// streams with a hash tag (`{orders}.created`) to keep related ones on
    /// one node.
    #[serde(default)]
    pub cluster: bool,
    /// An ACL user (Redis 6 and later).
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_USER"))]
    pub user: Option<String>,
    /// Its password (or the `requirepass` one without `user`), read again
    /// for each connection.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_PASSWORD"))]
    pub password: Option<SecretValue>,
    /// A CA to trust instead of the system's roots, and a client
    /// certificate (`rediss://` only).
    #[serde(default)]
    pub tls: BrokerTlsConfig,
    /// Trims each stream to about this many entries (`XADD ... MAXLEN ~ N`).
    #[serde(default)]
    pub maxlen: Option<u64>,
    /// Trims each stream of entries older than this (`XADD ... MINID ~`).
    #[serde(default)]
    pub minid_age_seconds: Option<u64>,
}

/// Never the password.
impl std::fmt::Debug for RedisSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSinkConfig")
            .field("url", &crate::redact::url(&self.url))
            .field("cluster", &self.cluster)
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// The longest stream name taken: a name is a key, and a plugin's topic
/// that runs this long is a mistake.
pub const MAX_STREAM_NAME: usize = 1024;

/// Why `stream` is no stream name the relay writes to.
pub(crate) fn stream_problem(stream: &str) -> Option<String> {
    if stream.is_empty() {
        return Some("the stream name (topic) is empty".to_string());
    }
    if stream.len() > MAX_STREAM_NAME {
        return Some(format!(
            "the stream name is {} bytes; at most {MAX_STREAM_NAME}",
            stream.len()
        ));
    }
    if stream.chars().any(char::is_control) {
        return Some("the stream name holds a control character".to_string());
    }
    None
}

impl RedisSinkConfig {
    fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let urls: Vec<&str> = self
            .url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        if urls.is_empty() {
            problems.push("url is empty".to_string());
        }
        if urls.len() > 1 && !self.cluster {
            problems.push("url lists several servers: set cluster = true for a Redis Cluster".to_string());
        }
        for url in &urls {
            match url::Url::parse(url) {
                Ok(parsed) if matches!(parsed.scheme(), "redis" | "rediss") => {
                    if parsed.password().is_some() && self.password.is_some() {
                        problems.push(
                            "url carries a password and password is set: give it in one place".to_string(),
                        );
                    }
                }
                _ => problems.push(format!(
                    "url {:?} must be redis:// or rediss://",
                    crate::redact::url(url)
                )),
            }
        }
        if self.tls.is_set() && !urls.iter().all(|u| u.starts_with("rediss://")) {
            problems.push("tls is set: the url must be rediss://".to_string());
        }
        if self.maxlen.is_some() && self.minid_age_seconds.is_some() {
            problems.push("set maxlen or minid_age_seconds, not both".to_string());
        }
        if self.maxlen == Some(0) {
            problems.push("maxlen must be at least 1".to_string());
        }
        if let Some(password) = &self.password {
            problems.extend(password.problems("password"));
        }
        problems.extend(self.tls.problems("tls"));
        problems
    }
}

impl TargetKind for RedisSinkConfig {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn validate(&self, _settings: &SinkSettings) -> Vec<String> {
        let problems = self.problems();
        #[cfg(not(feature = "redis"))]
        let problems = [
            vec![crate::features::built_without("the Redis target", "redis")],
            problems,
        ]
        .concat();
        problems
    }

    fn apply_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
        if let Some(url) = env(&format!("{prefix}URL")) {
            self.url = url;
        }
        if let Some(user) = env(&format!("{prefix}USER")) {
            self.user = Some(user);
        }
        if let Some(password) = SecretValue::from_env(env, &format!("{prefix}PASSWORD")) {
            self.password = Some(password);
        }
    }

    fn check_topic(&self, topic: &str) -> Result<(), SinkError> {
        match stream_problem(topic) {
            Some(problem) => Err(SinkError::permanent(problem)),
            None => Ok(()),
        }
    }

    #[cfg(feature = "redis")]
    async fn build(&self, name: &str, settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        let sink = sink::RedisSink::new(name, self, settings.publish_timeout);
        // A server that does not answer now starts the target deferred: the
        // relay starts, the target waits and connects when it answers.
        sink.connected().await?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    }

    #[cfg(not(feature = "redis"))]
    async fn build(&self, name: &str, _settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        Err(SinkError::permanent(format!(
            "target {name:?}: {}",
            crate::features::built_without("the Redis target", "redis")
        )))
    }
}

#[cfg(feature = "redis")]
mod sink {
    use std::time::Duration;

    use futures::future::{BoxFuture, join_all};
    use redis::aio::MultiplexedConnection;
    use redis::cluster_async::ClusterConnection;

    use super::{RedisSinkConfig, stream_problem};
    use crate::sinks::headers::AGGREGATE_ID_HEADER;
    use crate::sinks::order::in_order;
    use crate::sinks::{FailureKind, OutgoingMessage, Sink, SinkError};

    /// A connection: to one server, or to a cluster's nodes.
    #[derive(Clone)]
    enum Connection {
        Single(MultiplexedConnection),
        Cluster(ClusterConnection),
    }

    impl Connection {
        async fn query(&self, command: &redis::Cmd) -> redis::RedisResult<redis::Value> {
            match self {
                Connection::Single(connection) => command.query_async(&mut connection.clone()).await,
                Connection::Cluster(connection) => command.query_async(&mut connection.clone()).await,
            }
        }
    }

    /// Redis streams as a target.
    pub struct RedisSink {
        name: String,
        config: RedisSinkConfig,
        timeout: Duration,
        connection: tokio::sync::Mutex<Option<Connection>>,
    }

    impl RedisSink {
        /// A sink for `config`, not connected yet; a call takes at most `timeout`.
        pub fn new(name: &str, config: &RedisSinkConfig, timeout: Duration) -> RedisSink {
            RedisSink {
                name: name.to_string(),
                config: config.clone(),
                timeout,
                connection: tokio::sync::Mutex::new(None),
            }
        }

        /// Opens the connection now.
        ///
        /// # Errors
        /// The server's or the network's refusal, classified.
        pub async fn connected(&self) -> Result<(), SinkError> {
            self.connect().await.map(drop)
        }

        /// The connection, opened (with the password read now) when there is none.
        async fn connect(&self) -> Result<Connection, SinkError> {
            let mut held = self.connection.lock().await;
            if let Some(connection) = held.as_ref() {
                return Ok(connection.clone());
            }
            crate::tls::install_provider();
            let password = match &self.config.password {
                Some(password) => Some(password.read().await.map_err(|e| {
                    SinkError::new(
                        FailureKind::Unauthorized,
                        format!("the Redis password cannot be read: {e}"),
                    )
                })?),
                None => None,
            };
            let certificates = self.certificates()?;
            let urls: Vec<&str> = self
                .config
                .url
                .split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .collect();
            let opened = tokio::time::timeout(self.timeout, async {
                if self.config.cluster {
                    let mut builder =
                        redis::cluster::ClusterClientBuilder::new(urls.iter().map(|u| (*u).to_string()))
                            .connection_timeout(self.timeout)
                            .response_timeout(self.timeout);
                    if let Some(user) = &self.config.user {
                        builder = builder.username(user.clone());
                    }
                    if let Some(password) = &password {
                        builder = builder.password(password.expose());
                    }
                    if let Some(certificates) = certificates {
                        builder = builder.certs(certificates);
                    }
                    let client = builder.build()?;
                    Ok(Connection::Cluster(client.get_async_connection().await?))
                } else {
                    let mut info = redis::IntoConnectionInfo::into_connection_info(urls[0])?;
                    let mut settings = info.redis_settings().clone();
                    if let Some(user) = &self.config.user {
                        settings = settings.set_username(user);
                    }
                    if let Some(password) = &password {
                        settings = settings.set_password(password.expose());
                    }
                    info = info.set_redis_settings(settings);
                    let client = match certificates {
                        Some(certificates) => redis::Client::build_with_tls(info, certificates)?,
                        None => redis::Client::open(info)?,
                    };
                    let config = redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.timeout))
                        .set_response_timeout(Some(self.timeout));
                    Ok(Connection::Single(
                        client
                            .get_multiplexed_async_connection_with_config(&config)
                            .await?,
                    ))
                }
            })
            .await;
            let connection = match opened {
                Ok(Ok(connection)) => connection,
                Ok(Err(error)) => return Err(classify(&error, "connecting")),
                Err(_) => {
                    return Err(SinkError::timed_out(
                        "Redis did not answer the connection in time",
                    ));
                }
            };
            *held = Some(connection.clone());
            Ok(connection)
        }

        /// The TLS files, when set.
        fn certificates(&self) -> Result<Option<redis::TlsCertificates>, SinkError> {
            let tls = &self.config.tls;
            if !tls.is_set() {
                return Ok(None);
            }
            let read = |path: &std::path::Path, what: &str| {
                std::fs::read(path).map_err(|e| {
                    SinkError::permanent(format!(
                        "target {:?}: tls.{what} {}: {e}",
                        self.name,
                        path.display()
                    ))
                })
            };
            let root_cert = match &tls.root_cert {
                Some(path) => Some(read(path, "root_cert")?),
                None => None,
            };
            let client_tls = match (&tls.client_cert, &tls.client_key) {
                (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                    client_cert: read(cert, "client_cert")?,
                    client_key: read(key, "client_key")?,
                }),
                _ => None,
            };
            Ok(Some(redis::TlsCertificates {
                client_tls,
                root_cert,
            }))
        }

        /// A failure that means the connection is gone or its login stale:
        /// the next call opens a new one (reading the password again).
        async fn forget(&self, error: &SinkError) {
            if matches!(
                error.kind,
                FailureKind::Unavailable | FailureKind::TimedOut | FailureKind::Unauthorized
            ) {
                *self.connection.lock().await = None;
            }
        }

        fn command(&self, message: &OutgoingMessage) -> redis::Cmd {
            let mut command = redis::cmd("XADD");
            command.arg(&message.topic);
            if let Some(maxlen) = self.config.maxlen {
                command.arg("MAXLEN").arg("~").arg(maxlen);
            } else if let Some(age) = self.config.minid_age_seconds {
                let now = chrono::Utc::now().timestamp_millis();
                let oldest = now.saturating_sub(i64::try_from(age.saturating_mul(1000)).unwrap_or(i64::MAX));
                command.arg("MINID").arg("~").arg(oldest.max(0));
            }
            command.arg("*").arg("payload").arg(message.payload.as_ref());
            for (name, value) in &message.headers {
                command.arg(name).arg(value);
            }
            if let Some(key) = &message.key {
                command.arg(crate::sinks::KEY_HEADER).arg(key);
            }
            command
        }

        async fn add(&self, message: &OutgoingMessage) -> Result<(), SinkError> {
            if let Some(problem) = stream_problem(&message.topic) {
                return Err(SinkError::permanent(problem));
            }
            let connection = self.connect().await?;
            let answer = tokio::time::timeout(self.timeout, connection.query(&self.command(message))).await;
            let result = match answer {
                Ok(Ok(
                    redis::Value::BulkString(_)
                    | redis::Value::SimpleString(_)
                    | redis::Value::VerbatimString { .. },
                )) => Ok(()),
                Ok(Ok(other)) => Err(SinkError::unavailable(format!(
                    "Redis answered XADD to {} without an entry id: {other:?}",
                    message.topic
                ))),
                Ok(Err(error)) => Err(classify(&error, &format!("XADD to {}", message.topic))),
                Err(_) => Err(SinkError::timed_out(format!(
                    "Redis did not answer XADD to {} in time",
                    message.topic
                ))),
            };
            if let Err(error) = &result {
                self.forget(error).await;
            }
            result
        }
    }

    /// A failed call, classified: the connection's loss, a timeout, the
    /// server busy or loading pause the target; refused credentials and
    /// permissions wait; a key of another type and any other refusal of
    /// the command fail the message.
    fn classify(error: &redis::RedisError, what: &str) -> SinkError {
        let said = crate::redact::url(&error.to_string());
        if error.is_timeout() {
            return SinkError::timed_out(format!("Redis did not answer {what} in time: {said}"));
        }
        if error.is_io_error() || error.is_connection_refusal() || error.is_connection_dropped() {
            return SinkError::unavailable(format!("Redis cannot be reached ({what}): {said}"));
        }
        let code = error.code().unwrap_or_default();
        let kind = match code {
            "NOAUTH" | "WRONGPASS" | "NOPERM" => FailureKind::Unauthorized,
            "LOADING" | "BUSY" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "OOM" | "READONLY" | "MOVED"
            | "ASK" => FailureKind::Unavailable,
            _ if error.kind() == redis::ErrorKind::AuthenticationFailed => FailureKind::Unauthorized,
            "" => FailureKind::Unavailable,
            _ => FailureKind::Refused,
        };
        let message = match kind {
            FailureKind::Unauthorized => {
                format!("Redis refused the login or the permission ({what}): {said}")
            }
            FailureKind::Unavailable => format!("Redis cannot take {what} now: {said}"),
            _ => format!("Redis refused {what}: {said}"),
        };
        SinkError::new(kind, message)
    }

    impl Sink for RedisSink {
        fn kind(&self) -> &'static str {
            "redis"
        }

        fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
            Box::pin(async move {
                let mut results: Vec<Result<(), SinkError>> = (0..messages.len()).map(|_| Ok(())).collect();
                // An aggregate's entries go one after another, each after the
                // previous one's id came back; aggregates side by side.
                let keyed = messages
                    .iter()
                    .enumerate()
                    .map(|(index, m)| {
                        let aggregate = m
                            .headers
                            .iter()
                            .find(|(k, _)| k == AGGREGATE_ID_HEADER)
                            .map(|(_, v)| v.clone())
                            .unwrap_or_default();
                        (index, format!("{}\u{0}{aggregate}", m.topic), m)
                    })
                    .collect();
                let answered = in_order(keyed, |round: Vec<(usize, &OutgoingMessage)>| async move {
                    join_all(
                        round
                            .into_iter()
                            .map(|(index, message)| async move { (index, self.add(message).await) }),
                    )
                    .await
                })
                .await;
                for (index, result) in answered {
                    results[index] = result;
                }
                results
            })
        }

        fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
            Box::pin(async move {
                let connection = self.connect().await?;
                let answer = tokio::time::timeout(self.timeout, connection.query(&redis::cmd("PING"))).await;
                let result = match answer {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(error)) => Err(classify(&error, "PING")),
                    Err(_) => Err(SinkError::timed_out("Redis did not answer PING in time")),
                };
                if let Err(error) = &result {
                    tracing::debug!(sink.name = %self.name, %error, "Redis health check failed.");
                    self.forget(error).await;
                }
                result
            })
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_lost_connection_pauses_and_a_server_refusal_is_named() {
            let refused =
                redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
            assert_eq!(classify(&refused, "XADD").kind, FailureKind::Unavailable);
        }
    }
}

#[cfg(feature = "redis")]
pub use sink::RedisSink;

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> RedisSinkConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn each_problem_names_its_key() {
        assert!(config("url = \"redis://127.0.0.1:6379\"").problems().is_empty());
        for (text, says) in [
            ("url = \"http://x\"", "redis:// or rediss://"),
            ("url = \"redis://a,redis://b\"", "cluster = true"),
            (
                "url = \"redis://a\"\nmaxlen = 5\nminid_age_seconds = 9",
                "not both",
            ),
            ("url = \"redis://a\"\n[tls]\nrequired = true", "rediss://"),
        ] {
            let problems = config(text).problems().join("\n");
            assert!(problems.contains(says), "{says}: {problems}");
        }
        assert!(stream_problem("").is_some() && stream_problem("orders").is_none());
    }
}
