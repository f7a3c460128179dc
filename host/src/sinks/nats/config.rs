//! Config for the NATS target and the client options it builds.

use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;

use crate::secret::SecretValue;
use crate::tls::BrokerTlsConfig;

use crate::sinks::registry::{SinkSettings, TargetKind};
use crate::sinks::{Sink, SinkError};

/// How messages are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum NatsMode {
    /// JetStream publish, awaiting the stream's ack (at-least-once, deduplicated).
    #[default]
    Jetstream,
    /// Core NATS publish followed by a flush: the server got it, nobody may have stored it.
    Core,
}

/// `[targets.NAME]` with `type = "nats"`.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    /// Server URL(s), comma-separated, e.g. `nats://127.0.0.1:4222`. A
    /// URL may carry the login (`nats://user:password@host:4222`,
    /// `nats://token@host:4222`, percent-encoded): the relay logs in with
    /// it and gives the client the URL without it. `user`, `password` and
    /// `token` are then left out.
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_URL"))]
    pub url: String,
    /// Core or JetStream publishing.
    #[serde(default)]
    pub mode: NatsMode,
    /// User name.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_USER"))]
    pub user: Option<String>,
    /// Password, or where to read it for each connection
    /// (`{ file = "..." }`, `{ command = [...] }`).
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_PASSWORD"))]
    pub password: Option<SecretValue>,
    /// Token, or where to read it for each connection.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_TOKEN"))]
    pub token: Option<SecretValue>,
    /// A creds file (user JWT and nkey seed), as operator-mode clusters and
    /// Synadia Cloud hand out; read again for each connection.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_CREDENTIALS_FILE"))]
    pub credentials_file: Option<PathBuf>,
    /// A file holding a user nkey seed (`SU...`), for nkey login; read
    /// again for each connection.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_NKEY_SEED_FILE"))]
    pub nkey_seed_file: Option<PathBuf>,
    /// A custom CA, a client certificate, and whether TLS is required.
    #[serde(default)]
    pub tls: BrokerTlsConfig,
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
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
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
        let url_login = match self.url_login() {
            Ok((_, login)) => login,
            Err(problem) => {
                problems.push(problem);
                None
            }
        };
        if url_login.is_some() && (self.user.is_some() || self.token.is_some()) {
            problems.push(
                "url carries a login and user or token is set too: give the login in one place".to_string(),
            );
        }
        if self.password.is_some() && self.user.is_none() {
            problems.push("password is set but user is not".to_string());
        }
        let logins = [
            self.user.is_some() || url_login.is_some(),
            self.token.is_some(),
            self.credentials_file.is_some(),
            self.nkey_seed_file.is_some(),
        ];
        if logins.iter().filter(|set| **set).count() > 1 {
            problems.push(
                "set one way to log in: user/password, token, credentials_file or nkey_seed_file".to_string(),
            );
        }
        for (key, secret) in [("password", &self.password), ("token", &self.token)] {
            if let Some(secret) = secret {
                problems.extend(secret.problems(key));
            }
        }
        for (key, file) in [
            ("credentials_file", &self.credentials_file),
            ("nkey_seed_file", &self.nkey_seed_file),
        ] {
            if let Some(path) = file
                && let Err(error) = std::fs::metadata(path)
            {
                problems.push(format!("{key} {}: {error}", path.display()));
            }
        }
        problems.extend(self.tls.problems("tls"));
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

    /// The client's options, with every secret read now: each connection
    /// the sink opens logs in with the current password, token, creds or
    /// seed.
    pub(crate) async fn connect_options(&self) -> Result<async_nats::ConnectOptions, String> {
        let mut options = async_nats::ConnectOptions::new().name(&self.connection_name);
        match self.url_login()?.1 {
            Some(UrlLogin::UserPassword(user, password)) => {
                options = options.user_and_password(user, password);
            }
            Some(UrlLogin::Token(token)) => options = options.token(token),
            None => {}
        }
        if let (Some(user), Some(password)) = (&self.user, &self.password) {
            let password = password.read().await.map_err(|e| e.to_string())?;
            options = options.user_and_password(user.clone(), password.expose().to_string());
        }
        if let Some(token) = &self.token {
            let token = token.read().await.map_err(|e| e.to_string())?;
            options = options.token(token.expose().to_string());
        }
        if let Some(path) = &self.credentials_file {
            options = options
                .credentials_file(path)
                .await
                .map_err(|e| format!("credentials_file {}: {e}", path.display()))?;
        }
        if let Some(path) = &self.nkey_seed_file {
            let seed = crate::secret::SecretConfig::from_file(path.clone())
                .read()
                .await
                .map_err(|e| e.to_string())?;
            options = options.nkey(seed.expose().trim().to_string());
        }
        if let Some(root) = &self.tls.root_cert {
            options = options.add_root_certificates(root.clone());
        }
        if let (Some(cert), Some(key)) = (&self.tls.client_cert, &self.tls.client_key) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if self.tls.required || self.url.contains("tls://") {
            options = options.require_tls(true);
        }
        Ok(options)
    }
}

impl NatsSinkConfig {
    /// The server URLs without credentials, and the login they carried
    /// (`nats://user:password@host` or `nats://token@host`, as NATS clients
    /// read a URL). The client is handed the bare URLs and the login
    /// through its options, so that no line it logs (it logs the server
    /// address) can hold the secret.
    pub(crate) fn url_login(&self) -> Result<(String, Option<UrlLogin>), String> {
        let mut bare = Vec::new();
        let mut login: Option<UrlLogin> = None;
        for url in self.url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
            let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            let Some(at) = rest[..authority_end].rfind('@') else {
                bare.push(url.to_string());
                continue;
            };
            let decode = |text: &str| {
                percent_encoding::percent_decode_str(text)
                    .decode_utf8_lossy()
                    .into_owned()
            };
            let found = match rest[..at].split_once(':') {
                Some((user, password)) => UrlLogin::UserPassword(decode(user), decode(password)),
                None => UrlLogin::Token(decode(&rest[..at])),
            };
            if login.as_ref().is_some_and(|before| *before != found) {
                return Err(
                    "url: the servers carry different logins; give one login, in user and password (or token)"
                        .to_string(),
                );
            }
            login = Some(found);
            let host = &rest[at + 1..];
            bare.push(if scheme.is_empty() {
                host.to_string()
            } else {
                format!("{scheme}://{host}")
            });
        }
        Ok((bare.join(","), login))
    }
}

/// A login given in a NATS server URL.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum UrlLogin {
    /// `user:password@`.
    UserPassword(String, String),
    /// `token@`.
    Token(String),
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
        if let Some(password) = SecretValue::from_env(env, &format!("{prefix}PASSWORD")) {
            self.password = Some(password);
        }
        if let Some(token) = SecretValue::from_env(env, &format!("{prefix}TOKEN")) {
            self.token = Some(token);
        }
        if let Some(path) = env(&format!("{prefix}CREDENTIALS_FILE")) {
            self.credentials_file = Some(path.into());
        }
        if let Some(path) = env(&format!("{prefix}NKEY_SEED_FILE")) {
            self.nkey_seed_file = Some(path.into());
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
        f.debug_struct("NatsSinkConfig")
            .field("url", &crate::redact::url(&self.url))
            .field("mode", &self.mode)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("token", &self.token)
            .field("credentials_file", &self.credentials_file)
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("tls", &self.tls)
            .field("connection_name", &self.connection_name)
            .field("max_ack_inflight", &self.max_ack_inflight)
            .field("stream", &self.stream)
            .field("duplicate_window_seconds", &self.duplicate_window_seconds)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_url(url: &str) -> NatsSinkConfig {
        toml::from_str(&format!("url = {url:?}")).unwrap()
    }

    #[test]
    fn a_login_in_the_url_is_taken_out_of_it() {
        let (bare, login) = with_url("nats://app:p%40ss@a:4222, nats://app:p%40ss@b:4222")
            .url_login()
            .unwrap();
        assert_eq!(bare, "nats://a:4222,nats://b:4222");
        assert!(login == Some(UrlLogin::UserPassword("app".into(), "p@ss".into())));
        let (bare, login) = with_url("tls://s3cret@a:4222/").url_login().unwrap();
        assert_eq!(bare, "tls://a:4222/");
        assert!(login == Some(UrlLogin::Token("s3cret".into())));
        let (bare, login) = with_url("a:4222").url_login().unwrap();
        assert!(bare == "a:4222" && login.is_none());
    }

    #[test]
    fn a_login_given_twice_or_differently_is_refused() {
        let horizon = std::time::Duration::ZERO;
        let problems = with_url("nats://a:x@h1:4222,nats://b:y@h2:4222").problems(horizon);
        assert!(
            problems.iter().any(|p| p.contains("different logins")),
            "{problems:?}"
        );
        assert!(
            problems.iter().all(|p| !p.contains(":x@") && !p.contains("y@")),
            "{problems:?}"
        );
        let mut both = with_url("nats://a:x@h1:4222");
        both.user = Some("b".into());
        let problems = both.problems(horizon);
        assert!(problems.iter().any(|p| p.contains("one place")), "{problems:?}");
        assert!(with_url("nats://a:x@h1:4222").problems(horizon).is_empty());
    }
}
