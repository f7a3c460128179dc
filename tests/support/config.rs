//! Test configs built from typed parts: a database, the shared `[relay]`
//! test tuning, plugins, targets and any other section, written out as
//! TOML by the `toml` crate. Tests of the config parser write their TOML by
//! hand; every other test builds it here.

use std::path::Path;

use toml::{Table, Value};

use super::relay::RelaySection;

/// A whole config: `[database]`, `[relay]`, `[[plugins]]`, `[targets.*]`
/// and whatever other section a test sets.
#[derive(Debug, Clone)]
pub struct TestConfig {
    relay: RelaySection,
    plugins: Vec<Plugin>,
    targets: Vec<(String, Target)>,
    sections: Table,
}

impl TestConfig {
    /// The database at `url`, the shared test tuning of [`RelaySection::new`].
    pub fn new(url: &str) -> TestConfig {
        TestConfig::fleet().database("url", url)
    }

    /// No `[database]`: a fleet's databases come from
    /// [`TestConfig::member`] or a `[catalog]`.
    pub fn fleet() -> TestConfig {
        TestConfig {
            relay: RelaySection::new(),
            plugins: Vec::new(),
            targets: Vec::new(),
            sections: Table::new(),
        }
    }

    /// Sets a `[database]` key, e.g. `.database("max_connections", 4)`.
    #[must_use]
    pub fn database(self, key: &str, value: impl Into<Value>) -> TestConfig {
        self.set("database", key, value)
    }

    /// Adds a `[[databases]]` entry: `name` at `url`, with `keys` beside.
    #[must_use]
    pub fn member(mut self, name: &str, url: &str, keys: &[(&str, Value)]) -> TestConfig {
        let mut entry = Table::new();
        entry.insert("name".into(), name.into());
        entry.insert("url".into(), url.into());
        for (key, value) in keys {
            entry.insert((*key).into(), value.clone());
        }
        match self
            .sections
            .entry("databases")
            .or_insert_with(|| Value::Array(Vec::new()))
        {
            Value::Array(entries) => entries.push(Value::Table(entry)),
            _ => panic!("databases is not a list"),
        }
        self
    }

    /// Replaces the `[relay]` section (e.g. [`RelaySection::quick`]).
    #[must_use]
    pub fn tuning(mut self, relay: RelaySection) -> TestConfig {
        self.relay = relay;
        self
    }

    /// Sets a `[relay]` key, e.g. `.relay("max_attempts", 2)`.
    #[must_use]
    pub fn relay(mut self, key: &str, value: impl Into<Value>) -> TestConfig {
        self.relay = self.relay.set(key, &value.into().to_string());
        self
    }

    /// Adds a `[[plugins]]` entry.
    #[must_use]
    pub fn plugin(mut self, plugin: Plugin) -> TestConfig {
        self.plugins.push(plugin);
        self
    }

    /// Adds a `[[plugins]]` entry before the others: the first whose
    /// filters match an event routes it.
    #[must_use]
    pub fn plugin_first(mut self, plugin: Plugin) -> TestConfig {
        self.plugins.insert(0, plugin);
        self
    }

    /// Adds the target `[targets.NAME]`.
    #[must_use]
    pub fn target(mut self, name: &str, target: Target) -> TestConfig {
        self.targets.push((name.to_string(), target));
        self
    }

    /// Sets `key` of the target `name`, added before.
    ///
    /// # Panics
    /// When there is no such target.
    #[must_use]
    pub fn target_set(mut self, name: &str, key: &str, value: impl Into<Value>) -> TestConfig {
        let (_, target) = self
            .targets
            .iter_mut()
            .find(|(target, _)| target == name)
            .unwrap_or_else(|| panic!("no target {name:?}"));
        target.0.insert(key.into(), value.into());
        self
    }

    /// Reads events from a table of the service's own (`[source]`).
    #[must_use]
    pub fn source(mut self, source: Source) -> TestConfig {
        self.sections.insert("source".into(), Value::Table(source.0));
        self
    }

    /// Sets `key` of the section `[section]` (`admin`, `replication`,
    /// `source`, `plugin_runtime`, ...); a dotted section name (`relay.failures`)
    /// nests.
    #[must_use]
    pub fn set(mut self, section: &str, key: &str, value: impl Into<Value>) -> TestConfig {
        let mut table = &mut self.sections;
        for part in section.split('.') {
            table = table
                .entry(part)
                .or_insert_with(|| Value::Table(Table::new()))
                .as_table_mut()
                .unwrap_or_else(|| panic!("[{section}] is not a table"));
        }
        table.insert(key.into(), value.into());
        self
    }

    /// Leaves the section `[section]` out.
    #[must_use]
    pub fn unset(mut self, section: &str) -> TestConfig {
        self.sections.remove(section);
        self
    }

    /// No admin endpoint, no plugin watching or compiled cache: what an
    /// in-process test relay wants.
    #[must_use]
    pub fn quiet(self) -> TestConfig {
        self.set("plugin_runtime", "watch", false)
            .set("plugin_runtime", "cache", false)
            .set("admin", "listen", "")
    }

    /// The config as TOML.
    pub fn toml(&self) -> String {
        let mut root = Table::new();
        let plugins: Vec<Value> = self.plugins.iter().map(|p| Value::Table(p.0.clone())).collect();
        if !plugins.is_empty() {
            root.insert("plugins".into(), Value::Array(plugins));
        }
        let targets: Table = self
            .targets
            .iter()
            .map(|(name, target)| (name.clone(), Value::Table(target.0.clone())))
            .collect();
        if !targets.is_empty() {
            root.insert("targets".into(), Value::Table(targets));
        }
        let tuning: Table = toml::from_str(&self.relay.toml()).expect("[relay] tuning");
        root.extend(tuning);
        for (key, value) in &self.sections {
            match (root.get_mut(key), value) {
                // `[relay.failures]` beside the tuning's keys.
                (Some(Value::Table(present)), Value::Table(more)) => present.extend(more.clone()),
                _ => {
                    root.insert(key.clone(), value.clone());
                }
            }
        }
        toml::to_string(&root).expect("config as TOML")
    }

    /// The config, parsed and validated.
    ///
    /// # Panics
    /// When it is invalid.
    pub fn parse(&self) -> switchyard::Config {
        super::relay::parse(&self.toml())
    }
}

/// One `[[plugins]]` entry.
#[derive(Debug, Clone)]
pub struct Plugin(Table);

impl Plugin {
    /// The plugin `name` at `path`, for every event.
    pub fn new(name: &str, path: &Path) -> Plugin {
        let mut table = Table::new();
        table.insert("name".into(), name.into());
        table.insert("path".into(), path.display().to_string().into());
        Plugin(table)
    }

    /// Sets a key of the entry (`event_types`, `aggregate_types`, `timeout_ms`, ...).
    #[must_use]
    pub fn set(mut self, key: &str, value: impl Into<Value>) -> Plugin {
        self.0.insert(key.into(), value.into());
        self
    }

    /// Only for these event types.
    #[must_use]
    pub fn event_types(self, types: &[&str]) -> Plugin {
        self.set("event_types", strings(types))
    }

    /// Sets a key of its `[plugins.config]`.
    #[must_use]
    pub fn config(mut self, key: &str, value: impl Into<Value>) -> Plugin {
        self.0
            .entry("config")
            .or_insert_with(|| Value::Table(Table::new()))
            .as_table_mut()
            .expect("[plugins.config] is a table")
            .insert(key.into(), value.into());
        self
    }

    /// The entry as the relay reads it.
    ///
    /// # Panics
    /// When it is not a valid entry.
    pub fn entry(&self) -> switchyard::config::PluginConfig {
        Value::Table(self.0.clone())
            .try_into()
            .unwrap_or_else(|e| panic!("plugin entry: {e}"))
    }

    /// Routes to `target`, on `topic` (which may hold `{event_type}`).
    #[must_use]
    pub fn to(self, target: &str, topic: &str) -> Plugin {
        self.config("target", target).config("topic", topic)
    }
}

/// A `[source]` mapping: a table of the service's own, its columns.
#[derive(Debug, Clone)]
pub struct Source(Table);

impl Source {
    /// The table `name` (in the default schema).
    pub fn table(name: &str) -> Source {
        let mut table = Table::new();
        table.insert("table".into(), name.into());
        Source(table)
    }

    /// Sets a key of `[source]` (`schema`, `order_by`, ...).
    #[must_use]
    pub fn set(mut self, key: &str, value: impl Into<Value>) -> Source {
        self.0.insert(key.into(), value.into());
        self
    }

    /// Maps the event's `field` to `column` (`[source.columns]`).
    #[must_use]
    pub fn column(self, field: &str, column: &str) -> Source {
        self.nested("columns", field, column)
    }

    /// Reads the header `name` from `column` (`[source.header_columns]`).
    #[must_use]
    pub fn header_column(self, name: &str, column: &str) -> Source {
        self.nested("header_columns", name, column)
    }

    fn nested(mut self, section: &str, key: &str, value: &str) -> Source {
        self.0
            .entry(section)
            .or_insert_with(|| Value::Table(Table::new()))
            .as_table_mut()
            .expect("a table")
            .insert(key.into(), value.into());
        self
    }
}

/// One `[targets.NAME]` section.
#[derive(Debug, Clone)]
pub struct Target(Table);

impl Target {
    /// A target of `kind` with nothing set yet.
    pub fn of(kind: &str) -> Target {
        let mut table = Table::new();
        table.insert("type".into(), kind.into());
        Target(table)
    }

    /// NATS at `url` (JetStream, a one-hour duplicate window).
    pub fn nats(url: &str) -> Target {
        Target::of("nats")
            .set("url", url)
            .set("duplicate_window_seconds", 3600)
    }

    /// Kafka at `bootstrap_servers`.
    pub fn kafka(bootstrap_servers: &str) -> Target {
        Target::of("kafka").set("bootstrap_servers", bootstrap_servers)
    }

    /// A RabbitMQ exchange.
    pub fn rabbitmq(url: &str, exchange: &str) -> Target {
        Target::of("rabbitmq").set("url", url).set("exchange", exchange)
    }

    /// Pub/Sub topics of `project` on the emulator at `emulator_host`.
    pub fn pubsub(project: &str, emulator_host: &str) -> Target {
        Target::of("pubsub")
            .set("project", project)
            .set("emulator_host", emulator_host)
    }

    /// A JSON-lines file.
    pub fn file(path: &Path) -> Target {
        Target::of("file").set("path", path.display().to_string())
    }

    /// Standard output.
    pub fn stdout() -> Target {
        Target::of("stdout")
    }

    /// Sets a key of the target.
    #[must_use]
    pub fn set(mut self, key: &str, value: impl Into<Value>) -> Target {
        self.0.insert(key.into(), value.into());
        self
    }

    /// Sets a librdkafka property (`[targets.NAME.properties]`).
    #[must_use]
    pub fn property(mut self, key: &str, value: &str) -> Target {
        self.0
            .entry("properties")
            .or_insert_with(|| Value::Table(Table::new()))
            .as_table_mut()
            .expect("properties is a table")
            .insert(key.into(), value.into());
        self
    }
}

/// `text` (a whole config) with `key` of `[section]` set to `value`, or
/// left as it is when `keep` and the key is there already.
///
/// # Panics
/// When `text` is not TOML.
pub fn with_key(text: &str, section: &str, key: &str, value: impl Into<Value>, keep: bool) -> String {
    let mut root: Table = toml::from_str(text).unwrap_or_else(|e| panic!("config: {e}\n{text}"));
    let table = root
        .entry(section)
        .or_insert_with(|| Value::Table(Table::new()))
        .as_table_mut()
        .unwrap_or_else(|| panic!("[{section}] is not a table"));
    if !(keep && table.contains_key(key)) {
        table.insert(key.into(), value.into());
    }
    toml::to_string(&root).expect("config as TOML")
}

/// The fan-out plugin's routes: `(target, topic, key)` each.
pub fn routes(routes: &[(&str, &str, Option<&str>)]) -> Value {
    Value::Array(
        routes
            .iter()
            .map(|(target, topic, key)| {
                let mut route = Table::new();
                route.insert("target".into(), (*target).into());
                route.insert("topic".into(), (*topic).into());
                if let Some(key) = key {
                    route.insert("key".into(), (*key).into());
                }
                Value::Table(route)
            })
            .collect(),
    )
}

/// An inline TOML table, e.g. `password = { file = "..." }`.
pub fn table(entries: &[(&str, Value)]) -> Value {
    Value::Table(
        entries
            .iter()
            .map(|(key, value)| ((*key).to_string(), value.clone()))
            .collect(),
    )
}

/// A path as a TOML string.
pub fn path(path: &Path) -> Value {
    Value::String(path.display().to_string())
}

/// A TOML array of strings.
pub fn strings(items: &[&str]) -> Value {
    Value::Array(items.iter().map(|item| Value::from(*item)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_config_parses_to_what_was_set() {
        let text = TestConfig::new("sqlite://x.db")
            .database("max_connections", 4)
            .relay("max_attempts", 2)
            .set("relay.failures", "unknown_topic", "wait")
            .plugin(
                Plugin::new("router", Path::new("/p/route.wasm"))
                    .event_types(&["OrderPaid"])
                    .to("out", "orders.{event_type}"),
            )
            .target("out", Target::stdout())
            .quiet()
            .toml();
        let value: Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(value["database"]["max_connections"].as_integer(), Some(4));
        assert_eq!(value["relay"]["max_attempts"].as_integer(), Some(2));
        assert_eq!(value["relay"]["batch_size"].as_integer(), Some(200));
        assert_eq!(value["relay"]["failures"]["unknown_topic"].as_str(), Some("wait"));
        assert_eq!(
            value["plugins"][0]["config"]["topic"].as_str(),
            Some("orders.{event_type}")
        );
        assert_eq!(value["targets"]["out"]["type"].as_str(), Some("stdout"));
        assert_eq!(value["admin"]["listen"].as_str(), Some(""));
    }
}
