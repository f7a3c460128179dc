//! `[[databases]]`: the outbox databases one relay serves, each named, and
//! the single `[database]` seen as a list of one.

use serde::Deserialize;

use super::{Config, DatabaseConfig, default_max_connections};
use crate::metrics::DEFAULT_DATABASE;

/// One outbox database among several.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedDatabase {
    /// How metrics, readiness, logs and `--database` name it: letters,
    /// digits, `-` and `_`.
    pub name: String,
    /// Connection URL, as `database.url`. Overridden by
    /// `SWITCHYARD_DATABASE_<NAME>_URL` (`<NAME>` upper-cased, `-` as `_`).
    #[serde(default)]
    pub url: String,
    /// Pool size for this database, as `database.max_connections`.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
}

/// The URL's password is never printed.
impl std::fmt::Debug for NamedDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamedDatabase")
            .field("name", &self.name)
            .field("url", &crate::redact::url(&self.url))
            .field("max_connections", &self.max_connections)
            .finish()
    }
}

impl NamedDatabase {
    /// Its connection settings, as one `[database]`.
    pub fn settings(&self) -> DatabaseConfig {
        DatabaseConfig {
            url: self.url.clone(),
            max_connections: self.max_connections,
        }
    }
}

impl Default for DatabaseConfig {
    fn default() -> DatabaseConfig {
        DatabaseConfig {
            url: String::new(),
            max_connections: default_max_connections(),
        }
    }
}

impl Config {
    /// Every database this relay serves: the `[[databases]]` list, or the
    /// one `[database]` named [`DEFAULT_DATABASE`].
    pub fn database_list(&self) -> Vec<NamedDatabase> {
        if self.databases.is_empty() {
            vec![NamedDatabase {
                name: DEFAULT_DATABASE.to_string(),
                url: self.database.url.clone(),
                max_connections: self.database.max_connections,
            }]
        } else {
            self.databases.clone()
        }
    }

    /// Whether the config lists several databases (`[[databases]]`).
    pub fn serves_many(&self) -> bool {
        !self.databases.is_empty()
    }

    /// This config narrowed to one of its databases: what a relay for that
    /// database alone is built from.
    pub fn for_database(&self, database: &NamedDatabase) -> Config {
        let mut config = self.clone();
        config.database = database.settings();
        config.databases = Vec::new();
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
    if config.databases.is_empty() {
        return problems;
    }
    if !config.database.url.is_empty() {
        problems.push(
            "both [database] and [[databases]] are set: list every database under [[databases]]".to_string(),
        );
    }
    if config.replication_feed().is_some() {
        problems.push(
            "relay.mode = \"replication\" serves one database: use [database], or claim mode with [[databases]]"
                .to_string(),
        );
    }
    let mut seen = std::collections::HashSet::new();
    for (index, database) in config.databases.iter().enumerate() {
        let name = &database.name;
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            problems.push(format!(
                "databases[{index}].name {name:?} must be letters, digits, '-' or '_'"
            ));
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
