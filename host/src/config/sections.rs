//! Reading a config that does not parse section by section, so that every
//! mistake in it is listed at once instead of only the parser's first.

use super::{
    AdminConfig, CatalogConfig, DatabaseConfig, NamedDatabase, OwnershipConfig, PluginConfig,
    PluginRuntimeConfig, RelayConfig, ReplicationConfig, RetentionConfig, TargetConfig, source,
};

/// Each top-level section (and each plugin and target) deserialized alone,
/// one message per section that fails. Empty when the text is not TOML.
pub(super) fn section_errors(text: &str) -> Vec<String> {
    use serde::de::DeserializeOwned;
    // A section stops at its first mistake too: read each key on its own,
    // beside the keys that say what the table is (a target's `type`...),
    // to list them all. A missing field is the whole table's to report.
    fn check<T: DeserializeOwned>(at: &str, value: &toml::Value, problems: &mut Vec<String>) {
        const ANCHORS: [&str; 4] = ["type", "name", "path", "url"];
        let fails = |table: toml::Table| {
            toml::Value::Table(table)
                .try_into::<T>()
                .err()
                .map(|e| e.message().trim().to_string())
                .filter(|message| !message.starts_with("missing field"))
        };
        let Err(whole) = value.clone().try_into::<T>() else {
            return;
        };
        let whole = whole.message().trim().to_string();
        let mut found = Vec::new();
        if let Some(table) = value.as_table() {
            let anchors: toml::Table = table
                .iter()
                .filter(|(key, _)| ANCHORS.contains(&key.as_str()))
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect();
            if fails(anchors.clone()).is_none() {
                for (key, value) in table.iter().filter(|(key, _)| !anchors.contains_key(*key)) {
                    let mut alone = anchors.clone();
                    alone.insert(key.clone(), value.clone());
                    if let Some(message) = fails(alone) {
                        found.push(format!("{at}.{key}: {message}"));
                    }
                }
            }
        }
        if found.is_empty() || whole.starts_with("missing field") {
            found.push(format!("{at}: {whole}"));
        }
        problems.extend(found);
    }
    let Ok(table) = text.parse::<toml::Table>() else {
        return Vec::new();
    };
    let mut problems = Vec::new();
    for (key, value) in &table {
        match key.as_str() {
            "database" => check::<DatabaseConfig>(key, value, &mut problems),
            "catalog" => check::<CatalogConfig>(key, value, &mut problems),
            "ownership" => check::<OwnershipConfig>(key, value, &mut problems),
            "databases" => match value.as_array() {
                Some(databases) => {
                    for (index, database) in databases.iter().enumerate() {
                        check::<NamedDatabase>(&format!("databases[{index}]"), database, &mut problems);
                    }
                }
                None => problems.push("databases: must be an array of tables ([[databases]])".into()),
            },
            "relay" => check::<RelayConfig>(key, value, &mut problems),
            "plugin_runtime" => check::<PluginRuntimeConfig>(key, value, &mut problems),
            "admin" => check::<AdminConfig>(key, value, &mut problems),
            "retention" => check::<RetentionConfig>(key, value, &mut problems),
            "source" => check::<source::SourceConfig>(key, value, &mut problems),
            "replication" => check::<ReplicationConfig>(key, value, &mut problems),
            "plugins" => match value.as_array() {
                Some(plugins) => {
                    for (index, plugin) in plugins.iter().enumerate() {
                        check::<PluginConfig>(&format!("plugins[{index}]"), plugin, &mut problems);
                    }
                }
                None => problems.push("plugins: must be an array of tables ([[plugins]])".into()),
            },
            "targets" => match value.as_table() {
                Some(targets) => {
                    for (name, target) in targets {
                        check::<TargetConfig>(&format!("targets.{name}"), target, &mut problems);
                    }
                }
                None => problems.push("targets: must be a table of targets ([targets.NAME])".into()),
            },
            other => problems.push(format!("unknown section {other:?}")),
        }
    }
    problems
}
