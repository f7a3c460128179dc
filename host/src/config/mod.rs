//! The relay's configuration: one TOML file, environment overrides for
//! secrets, and validation that reports every problem at once.

pub mod databases;
mod sections;
use sections::section_errors;
mod failures;
pub mod reference;
pub mod registry;
pub mod replication;
pub mod source;
mod validate;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub use databases::{CatalogConfig, ConnectionsConfig, DEFAULT_DATABASE, NamedDatabase, OwnershipConfig};
pub use failures::{FailurePolicy, Handling};
pub use registry::RegistryConfig;
pub use replication::{FeedMode, ReplicationConfig};
pub use validate::validate;

pub use crate::sinks::TargetConfig;

/// Errors from loading a config file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML or does not match the schema.
    #[error("config file {path} is invalid: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said, with line and column.
        message: String,
    },
    /// The config parsed but some values are unusable; every problem is listed.
    #[error("config file {path} has {} problem(s):\n  - {}", problems.len(), problems.join("\n  - "))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// One line per problem.
        problems: Vec<String>,
    },
}

/// The whole relay config.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the outbox lives, for a relay that serves one database.
    #[serde(default)]
    pub database: DatabaseConfig,
    /// Several outbox databases served by one relay (instead of `[database]`):
    /// the same plugins and targets for all, each with its own workers.
    #[serde(default)]
    pub databases: Vec<NamedDatabase>,
    /// More databases, read from a table on a timer: added and removed
    /// while the relay runs.
    #[serde(default)]
    pub catalog: Option<CatalogConfig>,
    /// Several relays share the databases out, one relay per database.
    #[serde(default)]
    pub ownership: Option<OwnershipConfig>,
    /// Connections capped per PostgreSQL server rather than per database.
    #[serde(default)]
    pub connections: Option<ConnectionsConfig>,
    /// How rows are claimed, retried and dead-lettered.
    #[serde(default)]
    pub relay: RelayConfig,
    /// Routing plugins, tried in order: an event goes to the first whose
    /// filters match it.
    #[serde(default)]
    pub plugins: Vec<PluginConfig>,
    /// Named brokers that plugins publish to.
    #[serde(default)]
    pub targets: BTreeMap<String, TargetConfig>,
    /// Hot reload and the compiled-plugin cache.
    #[serde(default)]
    pub plugin_runtime: PluginRuntimeConfig,
    /// The admin HTTP endpoint (metrics, health, readiness) and the console.
    #[serde(default)]
    pub admin: AdminConfig,
    /// What happens to published rows after a while. Without this section
    /// they stay in the outbox for ever.
    #[serde(default)]
    pub retention: Option<RetentionConfig>,
    /// An outbox table the services already write, copied into the relay's
    /// own by a trigger that `switchyard migrate` installs.
    #[serde(default)]
    pub source: Option<source::SourceConfig>,
    /// The slot and publication of `relay.mode = "replication"`.
    #[serde(default)]
    pub replication: Option<ReplicationConfig>,
}

/// `[retention]`: published rows older than `published_max_age_seconds` are
/// deleted or archived by every running relay, a bounded batch at a time.
/// Dead letters are never touched (they wait for `dlq replay` or `dlq purge`).
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Age after publication, in seconds, at which a row goes.
    pub published_max_age_seconds: u64,
    /// `delete`, or `archive` to move rows to `switchyard_outbox_archive`.
    #[serde(default)]
    pub mode: RetentionMode,
    /// Seconds between retention passes.
    #[serde(default = "default_retention_interval_seconds")]
    pub interval_seconds: u64,
    /// Rows per statement: each batch is its own short transaction, so
    /// retention never holds many locks or long ones.
    #[serde(default = "default_retention_batch_size")]
    pub batch_size: u32,
}

const fn default_retention_interval_seconds() -> u64 {
    60
}

const fn default_retention_batch_size() -> u32 {
    1000
}

/// `[admin]`: where `/metrics`, `/healthz` and `/readyz` are served, and
/// the operator's console.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// `host:port`; loopback by default. Empty turns the endpoint off; port 0
    /// picks a free port (logged at startup).
    #[serde(default = "default_admin_listen")]
    pub listen: String,
    /// Serve the operator's console at `/`: the overview, dead letters and
    /// single events. Its overview pages are as open as the endpoint;
    /// payloads and actions need one of `tokens`.
    #[serde(default)]
    pub console: bool,
    /// Named tokens that let a person see payloads and replay or purge dead
    /// letters in the console: `ops = { file = "/run/secrets/ops" }` (read
    /// again at each use, so it may rotate) or a value. The name is what the
    /// log says did an action. Without any, payloads and actions are not
    /// offered. From the environment, `_FILE` names a file read at each use.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_ADMIN_TOKEN_<NAME>"))]
    pub tokens: BTreeMap<String, crate::secret::SecretValue>,
    /// Payload fields the console shows as `***`, as dotted paths
    /// (`card.number`, `customer.email`); a name matches at any depth when
    /// written alone (`ssn`). A webhook's JSON refusal, quoted in a dead
    /// letter, has them hidden too.
    #[serde(default)]
    pub mask_fields: Vec<String>,
    /// Replays and purges one token may do per minute.
    #[serde(default = "default_actions_per_minute")]
    pub actions_per_minute: u32,
    /// Host names the console answers to, beside `localhost` and any IP
    /// address (`relays.internal.example`, the name you browse it by).
    /// A request naming another host is refused: a page on another site
    /// cannot reach the console by pointing its own name at this address
    /// (DNS rebinding).
    #[serde(default)]
    pub console_hosts: Vec<String>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: default_admin_listen(),
            console: false,
            tokens: BTreeMap::new(),
            mask_fields: Vec::new(),
            actions_per_minute: default_actions_per_minute(),
            console_hosts: Vec::new(),
        }
    }
}

const fn default_actions_per_minute() -> u32 {
    10
}

fn default_admin_listen() -> String {
    "127.0.0.1:9187".to_string()
}

/// Hot reload and compiled-component caching.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginRuntimeConfig {
    /// Watch plugin directories and swap in changed files while running.
    #[serde(default = "default_true")]
    pub watch: bool,
    /// Quiet time after the last change before a file is read, so a file
    /// written in several steps is loaded once, whole.
    #[serde(default = "default_reload_debounce_ms")]
    pub reload_debounce_ms: u64,
    /// Keep compiled plugins on disk so restarts skip compilation.
    #[serde(default = "default_true")]
    pub cache: bool,
    /// Where; default `$XDG_CACHE_HOME/switchyard` or `~/.cache/switchyard`.
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
}

impl Default for PluginRuntimeConfig {
    fn default() -> Self {
        toml::from_str("").unwrap_or_else(|_| unreachable!("all plugin_runtime fields have defaults"))
    }
}

impl PluginRuntimeConfig {
    /// The cache directory in use, if caching is on and a location is known.
    pub fn cache_dir(&self) -> Option<PathBuf> {
        if !self.cache {
            return None;
        }
        self.cache_dir.clone().or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
                .map(|base| base.join("switchyard"))
        })
    }
}

/// Database connection settings.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Connection URL: `postgres://user@host/db`, `mysql://` or
    /// `mariadb://` (MySQL 8, MariaDB 10.6 and later), or `sqlite:` for a
    /// file. The environment may override it, so secrets stay out of files.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_DATABASE_URL"))]
    pub url: String,
    /// Pool size. Each relay worker holds a connection only while it claims or acks.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// TLS to the database, for what the URL's `sslmode`, `sslrootcert`,
    /// `sslcert` and `sslkey` do not say (the URL wins; on MySQL also its
    /// client's `ssl-mode`, `ssl-ca`, `ssl-cert`, `ssl-key`).
    #[serde(default)]
    pub tls: crate::endpoint::PgTlsConfig,
    /// A password that rotates, read from a file or a command, for a URL
    /// without one. The environment may name its file.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_DATABASE_PASSWORD_FILE"))]
    pub password: Option<crate::secret::SecretConfig>,
}

impl DatabaseConfig {
    /// What every connection to this database is made from.
    pub fn endpoint(&self) -> crate::endpoint::Endpoint {
        crate::endpoint::Endpoint::new(&self.url, &self.tls, self.password.as_ref())
    }
}

/// The URL's password is never printed.
impl std::fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &crate::redact::url(&self.url))
            .field("max_connections", &self.max_connections)
            .field("tls", &self.tls)
            .field("password", &self.password)
            .finish()
    }
}

/// What to do with an event that no plugin's filters match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum UnmatchedPolicy {
    /// Dead-letter it so an operator sees it (default: nothing vanishes silently).
    #[default]
    DeadLetter,
    /// Mark it published without sending anything, and count it as dropped.
    Drop,
}

/// Claiming, leasing and retry settings.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// Identity written into `lease_owner`; defaults to host name, pid and a random suffix.
    #[serde(default)]
    pub instance_id: Option<String>,
    /// Rows claimed per batch.
    #[serde(default = "default_batch_size")]
    pub batch_size: u32,
    /// Batches processed concurrently by this instance.
    #[serde(default = "default_concurrency")]
    pub concurrency: u32,
    /// Polling interval used when no notification arrives (lost NOTIFY, delayed rows, retries).
    #[serde(default = "default_poll_interval_ms")]
    pub poll_interval_ms: u64,
    /// While polls find nothing, each waits twice as long as the last, up
    /// to this: an idle database costs few queries, and rows due by time
    /// (retries, leases that ran out) or, without LISTEN, new ones are seen
    /// at most this late. Defaults to 10 times `poll_interval_ms` for a
    /// PostgreSQL database among several, else to `poll_interval_ms`.
    #[serde(default)]
    pub idle_poll_max_ms: Option<u64>,
    /// How long a claim is valid. Another instance may re-claim a row after this.
    #[serde(default = "default_lease_duration_ms")]
    pub lease_duration_ms: u64,
    /// Bound on waiting for a broker acknowledgement; must be well below the lease.
    #[serde(default = "default_publish_timeout_ms")]
    pub publish_timeout_ms: u64,
    /// Attempts before a row is dead-lettered.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// First retry delay; doubles per attempt, with jitter.
    #[serde(default = "default_initial_backoff_ms")]
    pub initial_backoff_ms: u64,
    /// Upper bound on the retry delay.
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
    /// Payloads larger than this are dead-lettered before reaching a plugin.
    #[serde(default = "default_max_payload_bytes")]
    pub max_payload_bytes: usize,
    /// Messages a plugin returns larger than this are refused.
    #[serde(default = "default_max_message_bytes")]
    pub max_message_bytes: usize,
    /// Events matched by no plugin.
    #[serde(default)]
    pub unmatched: UnmatchedPolicy,
    /// When true, a dead-lettered event keeps later events of its aggregate
    /// waiting until it is replayed or purged (strict order); when false they go on.
    #[serde(default)]
    pub dead_letter_blocks_aggregate: bool,
    /// What the ack does with a published row: `keep` it (marked published,
    /// for `[retention]`), `delete` it, or `archive` it (moved to
    /// `switchyard_outbox_archive`), in the ack's own statement.
    #[serde(default)]
    pub published_rows: PublishedRows,
    /// How long shutdown waits for in-flight batches before releasing their leases.
    #[serde(default = "default_shutdown_timeout_ms")]
    pub shutdown_timeout_ms: u64,
    /// Which delivery failures spend an attempt (`[relay.failures]`).
    #[serde(default)]
    pub failures: FailurePolicy,
    /// `claim` rows from the outbox table, or read them from the WAL
    /// (`replication`, PostgreSQL; MariaDB's binary log; see `[replication]`).
    #[serde(default)]
    pub mode: FeedMode,
}

impl Default for RelayConfig {
    fn default() -> Self {
        // Deserializing an empty table applies every serde default in one place.
        toml::from_str("").unwrap_or_else(|_| unreachable!("all relay fields have defaults"))
    }
}

impl RelayConfig {
    /// The longest pause between two polls of an idle database.
    pub fn idle_poll_max(&self) -> Duration {
        Duration::from_millis(
            self.idle_poll_max_ms
                .unwrap_or(self.poll_interval_ms)
                .max(self.poll_interval_ms),
        )
    }

    /// Lease length as a duration.
    pub fn lease_duration(&self) -> Duration {
        Duration::from_millis(self.lease_duration_ms)
    }

    /// Broker acknowledgement bound as a duration.
    pub fn publish_timeout(&self) -> Duration {
        Duration::from_millis(self.publish_timeout_ms)
    }

    /// The longest time from an event's first publish to its last retry:
    /// every backoff at its longest, plus a whole lease per attempt (a relay
    /// that crashed holding the row). A broker deduplicating by event id
    /// must remember ids at least this long.
    pub fn retry_horizon(&self) -> Duration {
        let backoffs: u64 = (1..self.max_attempts)
            .map(|attempt| {
                let exponent = attempt.saturating_sub(1).min(32);
                self.initial_backoff_ms
                    .saturating_mul(1u64 << exponent)
                    .min(self.max_backoff_ms)
            })
            .fold(0u64, u64::saturating_add);
        let leases = u64::from(self.max_attempts.saturating_sub(1)).saturating_mul(self.lease_duration_ms);
        Duration::from_millis(backoffs.saturating_add(leases))
    }
}

/// One routing plugin.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginConfig {
    /// Name used in logs, metrics and `last_error`.
    pub name: String,
    /// The component file (relative paths start at the config file's
    /// directory), or a registry reference: `oci://REGISTRY/REPOSITORY:TAG`
    /// (checked for a new digest every `registry.refresh_seconds`) or
    /// `oci://REGISTRY/REPOSITORY@sha256:DIGEST` (pinned).
    pub path: PathBuf,
    /// How an `oci://` path's registry is reached.
    #[serde(default)]
    pub registry: RegistryConfig,
    /// Only events of these types (empty: all).
    #[serde(default)]
    pub event_types: Vec<String>,
    /// Only events of these aggregate types (empty: all).
    #[serde(default)]
    pub aggregate_types: Vec<String>,
    /// Wall-clock bound on one `route` call (per event for `route-batch`);
    /// `init` gets this or 1 s, whichever is longer.
    #[serde(default = "default_plugin_timeout_ms")]
    pub timeout_ms: u64,
    /// Linear-memory bound for one plugin instance.
    #[serde(default = "default_plugin_max_memory_bytes")]
    pub max_memory_bytes: usize,
    /// Handed to the plugin's `init` as a JSON object.
    #[serde(default)]
    #[schemars(with = "serde_json::Map<String, serde_json::Value>")]
    pub config: toml::Table,
}

impl PluginConfig {
    /// The registry reference (without `oci://`) when `path` is one.
    pub fn oci_reference(&self) -> Option<&str> {
        self.path.to_str()?.strip_prefix(registry::OCI_SCHEME)
    }

    /// Whether this plugin's filters accept an event.
    pub fn matches(&self, aggregate_type: &str, event_type: &str) -> bool {
        (self.event_types.is_empty() || self.event_types.iter().any(|t| t == event_type))
            && (self.aggregate_types.is_empty() || self.aggregate_types.iter().any(|t| t == aggregate_type))
    }
}

const fn default_true() -> bool {
    true
}
const fn default_reload_debounce_ms() -> u64 {
    100
}
pub(crate) const fn default_max_connections() -> u32 {
    16
}
const fn default_batch_size() -> u32 {
    500
}
const fn default_concurrency() -> u32 {
    4
}
const fn default_poll_interval_ms() -> u64 {
    500
}
const fn default_lease_duration_ms() -> u64 {
    30_000
}
const fn default_publish_timeout_ms() -> u64 {
    10_000
}
const fn default_max_attempts() -> u32 {
    10
}
const fn default_initial_backoff_ms() -> u64 {
    500
}
const fn default_max_backoff_ms() -> u64 {
    60_000
}
const fn default_max_payload_bytes() -> usize {
    1024 * 1024
}
const fn default_max_message_bytes() -> usize {
    1024 * 1024
}
const fn default_shutdown_timeout_ms() -> u64 {
    15_000
}
const fn default_plugin_timeout_ms() -> u64 {
    100
}
const fn default_plugin_max_memory_bytes() -> usize {
    64 * 1024 * 1024
}

impl Config {
    /// What targets take from the relay's settings and the console's masks.
    pub fn sink_settings(&self) -> crate::sinks::SinkSettings {
        crate::sinks::SinkSettings {
            publish_timeout: self.relay.publish_timeout(),
            retry_horizon: self.relay.retry_horizon(),
            mask_fields: self.admin.mask_fields.clone(),
        }
    }

    /// The slot and publication to read, in replication mode.
    pub fn replication_feed(&self) -> Option<ReplicationConfig> {
        (self.relay.mode == FeedMode::Replication).then(|| self.replication.clone().unwrap_or_default())
    }

    /// Reads, parses, applies environment overrides and validates a config file.
    ///
    /// # Errors
    /// [`Error::Read`], [`Error::Parse`], or [`Error::Invalid`] listing every problem.
    pub fn load(path: &Path) -> Result<Config, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Config::from_toml(&text, base, &|name| std::env::var(name).ok()).map_err(|e| match e {
            LoadError::Parse(message) => Error::Parse {
                path: path.to_path_buf(),
                message,
            },
            LoadError::Invalid(problems) => Error::Invalid {
                path: path.to_path_buf(),
                problems,
            },
        })
    }

    /// Parses config text. `base` anchors relative plugin paths; `env` looks up
    /// override variables (injected so tests need not touch the process environment).
    ///
    /// # Errors
    /// The parse error, or every validation problem.
    pub fn from_toml(
        text: &str,
        base: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, LoadError> {
        let mut config: Config = toml::from_str(text).map_err(|whole| {
            // The parser stops at the first mistake; read each section on
            // its own so that mistakes in several sections are all listed.
            let sections = section_errors(text);
            if sections.len() > 1 {
                LoadError::Invalid(sections)
            } else {
                LoadError::Parse(parse_message(text, &whole))
            }
        })?;
        let env_problems = config.apply_env(env);
        if !env_problems.is_empty() {
            return Err(LoadError::Invalid(env_problems));
        }
        for plugin in &mut config.plugins {
            if plugin.path.is_relative() && plugin.oci_reference().is_none() {
                plugin.path = base.join(&plugin.path);
            }
        }
        for target in config.targets.values_mut() {
            if let TargetConfig::File(file) = target
                && file.path.is_relative()
            {
                file.path = base.join(&file.path);
            }
        }
        validate(&config).map_err(LoadError::Invalid)?;
        Ok(config)
    }

    /// What the config weakens that it is allowed to (Kafka targets with
    /// `allow_weaker_delivery`; a remote database whose `sslmode` lets a
    /// connection fall back to plaintext): said by `validate` and logged at
    /// start.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        let databases = std::iter::once(("database".to_string(), self.database.endpoint()))
            .filter(|_| self.databases.is_empty() && self.catalog.is_none())
            .chain(
                self.databases
                    .iter()
                    .map(|d| (format!("databases {:?}", d.name), d.endpoint())),
            )
            .chain(self.catalog.iter().map(|c| ("catalog".to_string(), c.endpoint())));
        for (what, endpoint) in databases {
            if endpoint.may_fall_back_to_plaintext() {
                warnings.push(format!(
                    "{what}: sslmode is prefer (libpq's default when unset), which connects without TLS, \
                     silently, when the server offers none: set sslmode=verify-full (or require)"
                ));
            }
        }
        for (name, target) in &self.targets {
            if let TargetConfig::Kafka(kafka) = target {
                for weakened in kafka.weakened() {
                    warnings.push(format!(
                        "targets.{name}: {weakened} (allowed by allow_weaker_delivery)"
                    ));
                }
            }
        }
        warnings
    }

    /// Environment overrides. Each variable may instead name a file that
    /// holds the value, as `NAME_FILE` (how Kubernetes and Docker hand
    /// secrets over); a file that cannot be read is a problem returned.
    fn apply_env(&mut self, env: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
        let raw_env = env;
        let problems = std::cell::RefCell::new(Vec::new());
        let env = |name: &str| env_or_file(env, name, &mut problems.borrow_mut());
        if let Some(url) = env("SWITCHYARD_DATABASE_URL") {
            self.database.url = url;
        }
        if let Some(path) = env("SWITCHYARD_DATABASE_PASSWORD_FILE") {
            self.database.password = Some(crate::secret::SecretConfig::from_file(path.into()));
        }
        if let Some(catalog) = &mut self.catalog
            && let Some(url) = env("SWITCHYARD_CATALOG_URL")
        {
            catalog.url = url;
        }
        for database in &mut self.databases {
            let prefix = format!("SWITCHYARD_DATABASE_{}_", env_name(&database.name));
            if let Some(url) = env(&format!("{prefix}URL")) {
                database.url = url;
            }
            if let Some(path) = env(&format!("{prefix}PASSWORD_FILE")) {
                database.password = Some(crate::secret::SecretConfig::from_file(path.into()));
            }
        }
        for (name, target) in &mut self.targets {
            target.apply_env(&format!("SWITCHYARD_TARGET_{}_", env_name(name)), &env);
        }
        for (name, token) in &mut self.admin.tokens {
            // `_FILE` stays a path, read at each use: the token may rotate.
            if let Some(value) = crate::secret::SecretValue::from_env(
                raw_env,
                &format!("SWITCHYARD_ADMIN_TOKEN_{}", env_name(name)),
            ) {
                *token = value;
            }
        }
        problems.into_inner()
    }
}

/// `env(name)`, or else the content of the file `env(name_FILE)` names
/// (without its trailing newline). `*_PASSWORD_FILE` variables are paths
/// themselves and are read again as the password rotates, so they are
/// not followed here.
fn env_or_file(
    env: &dyn Fn(&str) -> Option<String>,
    name: &str,
    problems: &mut Vec<String>,
) -> Option<String> {
    if let Some(value) = env(name) {
        return Some(value);
    }
    if name.ends_with("_FILE") {
        return None;
    }
    let variable = format!("{name}_FILE");
    let path = env(&variable)?;
    match std::fs::read_to_string(&path) {
        Ok(mut text) => {
            while text.ends_with(['\n', '\r']) {
                text.pop();
            }
            Some(text)
        }
        Err(error) => {
            problems.push(format!("{variable}: cannot read {path}: {error}"));
            None
        }
    }
}

/// Errors from [`Config::from_toml`].
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Not TOML, or not the schema.
    #[error("{0}")]
    Parse(String),
    /// Every validation problem.
    #[error("{} problem(s):\n  - {}", .0.len(), .0.join("\n  - "))]
    Invalid(Vec<String>),
}

/// `kafka-main` -> `KAFKA_MAIN`, for environment variable names.
pub fn env_name(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// What retention does with published rows past their age.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize, Default, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum RetentionMode {
    /// Delete them.
    #[default]
    Delete,
    /// Move them to `switchyard_outbox_archive`.
    Archive,
}

/// What an ack does with a row every target took.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize, Default, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum PublishedRows {
    /// Keeps it, marked published (for `[retention]` to remove later).
    #[default]
    Keep,
    /// Deletes it in the ack's statement.
    Delete,
    /// Moves it to `switchyard_outbox_archive` in the ack's statement.
    Archive,
}

/// A TOML error as `line L, column C: what`. The parser's own rendering
/// quotes the offending source line, which may be the one holding a
/// password or token: the position is enough to find it, and the message
/// has any URL credentials masked.
fn parse_message(text: &str, error: &toml::de::Error) -> String {
    let message = crate::redact::url(error.message().trim());
    match error.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.chars().rev().take_while(|&c| c != '\n').count() + 1;
            format!("line {line}, column {column}: {message}")
        }
        None => message,
    }
}
