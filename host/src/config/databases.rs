//! `[[databases]]`: the outbox databases one relay serves, each named, and
//! the single `[database]` seen as a list of one.

use serde::Deserialize;

use super::{Config, DatabaseConfig, default_max_connections};
pub use crate::metrics::DEFAULT_DATABASE;

/// One outbox database among several.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NamedDatabase {
    /// How metrics, readiness, logs and `--database` name it: letters,
    /// digits, `-` and `_`.
    pub name: String,
    /// Connection URL, as `database.url`.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_DATABASE_<NAME>_URL"))]
    pub url: String,
    /// Pool size for this database, as `database.max_connections`.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// TLS to this database, as `database.tls`.
    #[serde(default)]
    pub tls: crate::endpoint::PgTlsConfig,
    /// A rotating password, as `database.password`.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_DATABASE_<NAME>_PASSWORD_FILE"))]
    pub password: Option<crate::secret::SecretConfig>,
}

/// The URL's password is never printed.
impl std::fmt::Debug for NamedDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamedDatabase")
            .field("name", &self.name)
            .field("url", &crate::redact::url(&self.url))
            .field("max_connections", &self.max_connections)
            .field("tls", &self.tls)
            .field("password", &self.password)
            .finish()
    }
}

/// `[catalog]`: a query, run on a timer, that lists outbox databases as
/// rows of `(name, url)`; databases appear and go as its rows do.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CatalogConfig {
    /// Where the catalog table is (PostgreSQL or SQLite).
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_CATALOG_URL"))]
    pub url: String,
    /// Returns two text columns, a database's name and its URL.
    #[serde(default = "default_catalog_query")]
    pub query: String,
    /// Seconds between two reads.
    #[serde(default = "default_catalog_interval_seconds")]
    pub interval_seconds: u64,
    /// Pool size for each database the catalog lists.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// Run `migrate` on a database the catalog lists before serving it.
    #[serde(default)]
    pub migrate: bool,
    /// TLS to the catalog, and the fleet's default for the databases it
    /// lists: a parameter in a listed URL wins, except an `sslmode` weaker
    /// than the catalog's own (that row is not served).
    #[serde(default)]
    pub tls: crate::endpoint::PgTlsConfig,
    /// A rotating password for the catalog, and for each listed database
    /// on the catalog's own server (host and port) whose URL has none;
    /// databases elsewhere bring their own credentials.
    #[serde(default)]
    pub password: Option<crate::secret::SecretConfig>,
}

impl CatalogConfig {
    /// What the catalog's own connection is made from.
    pub fn endpoint(&self) -> crate::endpoint::Endpoint {
        crate::endpoint::Endpoint::new(&self.url, &self.tls, self.password.as_ref())
    }
}

fn default_catalog_query() -> String {
    "SELECT name, url FROM switchyard_databases".to_string()
}

const fn default_catalog_interval_seconds() -> u64 {
    30
}

/// The URL's password is never printed.
impl std::fmt::Debug for CatalogConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CatalogConfig")
            .field("url", &crate::redact::url(&self.url))
            .field("query", &self.query)
            .field("interval_seconds", &self.interval_seconds)
            .field("max_connections", &self.max_connections)
            .field("migrate", &self.migrate)
            .field("tls", &self.tls)
            .field("password", &self.password)
            .finish()
    }
}

/// `[ownership]`: several relays share the databases out, each database
/// served by one relay at a time, held under a lease in the database itself.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OwnershipConfig {
    /// How long a database stays with a relay that stopped renewing (was
    /// killed): another takes it over within this plus a third of it.
    #[serde(default = "default_ownership_lease_seconds")]
    pub lease_seconds: u64,
}

const fn default_ownership_lease_seconds() -> u64 {
    15
}

/// `[connections]`: what this relay may open to one PostgreSQL server, over
/// all the databases it serves there.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConnectionsConfig {
    /// The most sessions this relay's databases hold on one server (a
    /// `host:port`) together. Each database gets an equal share, at most
    /// its `max_connections`; with a single connection it is polled
    /// instead of LISTENing. A database that finds no connection left is
    /// not served (readiness says why) until one is.
    pub per_server: u32,
}

/// Why a catalog row cannot be served (`None`: it can).
pub fn name_problem(name: &str) -> Option<String> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    (!valid).then(|| format!("name {name:?} must be 1 to 63 letters, digits, '-' or '_'"))
}

impl NamedDatabase {
    /// What every connection to this database is made from.
    pub fn endpoint(&self) -> crate::endpoint::Endpoint {
        crate::endpoint::Endpoint::new(&self.url, &self.tls, self.password.as_ref())
    }

    /// Its connection settings, as one `[database]`.
    pub fn settings(&self) -> DatabaseConfig {
        DatabaseConfig {
            url: self.url.clone(),
            max_connections: self.max_connections,
            tls: self.tls.clone(),
            password: self.password.clone(),
        }
    }
}

impl Default for DatabaseConfig {
    fn default() -> DatabaseConfig {
        DatabaseConfig {
            url: String::new(),
            max_connections: default_max_connections(),
            tls: crate::endpoint::PgTlsConfig::default(),
            password: None,
        }
    }
}

impl Config {
    /// Every database this relay serves: the `[[databases]]` list, or the
    /// one `[database]` named [`DEFAULT_DATABASE`].
    pub fn database_list(&self) -> Vec<NamedDatabase> {
        if !self.serves_many() {
            vec![NamedDatabase {
                name: DEFAULT_DATABASE.to_string(),
                url: self.database.url.clone(),
                max_connections: self.database.max_connections,
                tls: self.database.tls.clone(),
                password: self.database.password.clone(),
            }]
        } else {
            self.databases.clone()
        }
    }

    /// Whether the config lists several databases (`[[databases]]` or a
    /// `[catalog]`).
    pub fn serves_many(&self) -> bool {
        !self.databases.is_empty() || self.catalog.is_some()
    }

    /// This config narrowed to one of its databases: what a relay for that
    /// database alone is built from.
    pub fn for_database(&self, database: &NamedDatabase) -> Config {
        let mut config = self.clone();
        config.database = database.settings();
        // Many databases, most of them idle: poll those less often. Not a
        // SQLite file, which has no NOTIFY to announce a commit and whose
        // poll costs no server anything.
        if self.serves_many()
            && config.relay.idle_poll_max_ms.is_none()
            && !database.url.starts_with("sqlite:")
        {
            config.relay.idle_poll_max_ms = Some(config.relay.poll_interval_ms.saturating_mul(10));
        }
        config.databases = Vec::new();
        config.catalog = None;
        config.ownership = None;
        config
    }

    /// The database named `name` (`None` for a name the config lacks).
    pub fn database_named(&self, name: &str) -> Option<NamedDatabase> {
        self.database_list()
            .into_iter()
            .find(|database| database.name == name)
    }
}

/// Problems with the list itself: names, duplicates, and what a list
/// cannot be combined with yet. Each entry's URL is checked as `[database]`.
pub(super) fn list_problems(config: &Config) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(catalog) = &config.catalog {
        if catalog.url.is_empty() {
            problems.push("catalog.url is empty (set it or SWITCHYARD_CATALOG_URL)".to_string());
        } else if !["postgres://", "postgresql://", "sqlite:"]
            .iter()
            .any(|scheme| catalog.url.starts_with(scheme))
        {
            problems.push("catalog.url must start with postgres:// or sqlite:".to_string());
        }
        if catalog.interval_seconds == 0 {
            problems.push("catalog.interval_seconds must be at least 1".to_string());
        }
        if catalog.max_connections < 2 {
            problems.push("catalog.max_connections must be at least 2".to_string());
        }
        problems.extend(super::validate::credential_problems(
            "catalog",
            &catalog.endpoint(),
            catalog.password.as_ref(),
        ));
    }
    if config.connections.as_ref().is_some_and(|c| c.per_server == 0) {
        problems.push("connections.per_server must be at least 1".to_string());
    }
    if let Some(ownership) = &config.ownership {
        if ownership.lease_seconds < 3 {
            problems.push("ownership.lease_seconds must be at least 3".to_string());
        }
        if !config.serves_many() {
            problems.push(
                "[ownership] shares several databases out: list them under [[databases]] or [catalog]"
                    .to_string(),
            );
        }
    }
    if !config.serves_many() {
        return problems;
    }
    if !config.database.url.is_empty() {
        problems.push(
            "[database] is set beside [[databases]] or [catalog]: list every database under [[databases]]"
                .to_string(),
        );
    }
    if config.replication_feed().is_some() {
        problems.push(
            "relay.mode = \"replication\" serves one database: use [database], or claim mode with several"
                .to_string(),
        );
    }
    let mut seen = std::collections::HashSet::new();
    for (index, database) in config.databases.iter().enumerate() {
        let name = &database.name;
        if let Some(problem) = name_problem(name) {
            problems.push(format!("databases[{index}].{problem}"));
        } else if !seen.insert(name.as_str()) {
            problems.push(format!("databases[{index}].name {name:?} is used twice"));
        }
    }
    problems
}

impl Config {
    /// The database an operations command works on: `name` among the
    /// `[[databases]]` (which then need one), or the one `[database]`.
    ///
    /// # Errors
    /// No name given where several databases are listed, or a name the
    /// config does not list; the message lists the names there are.
    pub fn pick_database(&self, name: Option<&str>) -> anyhow::Result<NamedDatabase> {
        let names = || {
            self.database_list()
                .iter()
                .map(|database| database.name.clone())
                .collect::<Vec<_>>()
                .join(", ")
        };
        match name {
            None if self.serves_many() => {
                anyhow::bail!(
                    "the config lists several databases: give --database NAME (one of: {})",
                    names()
                )
            }
            None => Ok(self.database_list().remove(0)),
            Some(name) => self
                .database_named(name)
                .ok_or_else(|| anyhow::anyhow!("the config has no database {name:?} (it has: {})", names())),
        }
    }
}
