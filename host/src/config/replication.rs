//! `[relay] mode` and `[replication]`: whether the relay claims rows from
//! the outbox table or reads the events from PostgreSQL's WAL (MariaDB's
//! binary log), and the replication slot and publication it reads through
//! (the binlog position's name).

use serde::Deserialize;

/// How the relay finds new events.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FeedMode {
    /// Claim rows from the outbox table under a lease (every database).
    #[default]
    Claim,
    /// Read inserts from a logical replication slot (PostgreSQL) or the
    /// binary log (MariaDB): no row update per event. Events that fail go to
    /// the table and the claim path.
    Replication,
}

/// `[replication]`: the slot and publication of `mode = "replication"`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplicationConfig {
    /// The logical replication slot (`pgoutput`); one relay reads it at a
    /// time, the others stand by. On MariaDB, the name of the binary log
    /// position (in `switchyard_binlog_positions`), read the same way.
    #[serde(default = "default_slot")]
    pub slot: String,
    /// The publication of the outbox table's inserts (PostgreSQL).
    #[serde(default = "default_publication")]
    pub publication: String,
    /// Retained WAL above this makes the relay unready (`/readyz`).
    #[serde(default = "default_max_retained_wal_bytes")]
    pub max_retained_wal_bytes: u64,
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        ReplicationConfig {
            slot: default_slot(),
            publication: default_publication(),
            max_retained_wal_bytes: default_max_retained_wal_bytes(),
        }
    }
}

fn default_slot() -> String {
    "switchyard".into()
}

fn default_publication() -> String {
    "switchyard_outbox".into()
}

fn default_max_retained_wal_bytes() -> u64 {
    1 << 30
}

/// A slot or publication name PostgreSQL takes unquoted: lower-case
/// letters, digits and underscores, at most 63 bytes. Slot names allow
/// nothing else anyway.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// Why a build without the binary log reader (cargo feature `binlog` off,
/// as in the demo's build) cannot run binlog mode.
#[cfg(not(feature = "binlog"))]
pub fn without_binlog() -> String {
    crate::features::built_without("the binary log reader that binlog mode needs", "binlog")
}

/// Problems with the mode and `[replication]` found without a database.
pub fn static_problems(
    mode: FeedMode,
    replication: Option<&ReplicationConfig>,
    database_url: &str,
) -> Vec<String> {
    let mut problems = Vec::new();
    if mode == FeedMode::Claim {
        if replication.is_some() {
            problems.push("replication: this section is read only with relay.mode = \"replication\"".into());
        }
        return problems;
    }
    if database_url.starts_with("sqlite:") {
        problems.push(
            "relay.mode = \"replication\" needs PostgreSQL or MariaDB; SQLite is relayed by claiming".into(),
        );
    }
    #[cfg(not(feature = "binlog"))]
    if database_url.starts_with("mysql://") || database_url.starts_with("mariadb://") {
        problems.push(format!(
            "relay.mode = \"replication\" on MariaDB: {}",
            without_binlog()
        ));
    }
    let replication = replication.cloned().unwrap_or_default();
    for (key, name) in [
        ("slot", &replication.slot),
        ("publication", &replication.publication),
    ] {
        if !is_plain_name(name) {
            problems.push(format!(
                "replication.{key} {name:?} must be lower-case letters, digits and underscores, at most 63 bytes"
            ));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replication_needs_postgres_and_plain_names() {
        let bad = ReplicationConfig {
            slot: "My-Slot".into(),
            ..ReplicationConfig::default()
        };
        let problems = static_problems(FeedMode::Replication, Some(&bad), "sqlite:x.db");
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("needs PostgreSQL"));
        assert!(problems[1].contains("replication.slot \"My-Slot\""));
        assert!(static_problems(FeedMode::Replication, None, "postgres://h/db").is_empty());
        let stray = static_problems(
            FeedMode::Claim,
            Some(&ReplicationConfig::default()),
            "postgres://h/db",
        );
        assert_eq!(stray.len(), 1);
    }
}
