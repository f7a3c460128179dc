//! Config files: the shipped example validates, and a broken file is refused
//! with every problem listed at once.

use std::path::Path;

use switchyard::config::{Config, LoadError, TargetConfig};
use switchyard_tests::plugins::plugin;
use switchyard_tests::workspace_root;

#[test]
fn every_example_config_is_valid() {
    // Validation checks that plugin files exist: build them first.
    plugin("route_by_type");
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(workspace_root().join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let config = Config::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(
                !config.plugins.is_empty() && !config.targets.is_empty(),
                "{}",
                path.display()
            );
            let kinds: Vec<&str> = config.targets.values().map(TargetConfig::kind).collect();
            let store = config
                .database
                .url
                .split(':')
                .next()
                .unwrap_or_default()
                .to_string();
            checked.push((store, kinds.join("+")));
        }
    }
    // PostgreSQL + NATS, PostgreSQL + Kafka, SQLite + stdout at least.
    for (store, kind) in [("postgres", "nats"), ("postgres", "kafka"), ("sqlite", "stdout")] {
        assert!(
            checked.iter().any(|(s, k)| s == store && k.contains(kind)),
            "no {store} + {kind} example among {checked:?}"
        );
    }
}

#[test]
fn every_problem_is_reported_at_once() {
    let text = r#"
[database]
url = "mysql://nope"
[relay]
batch_size = 0
lease_duration_ms = 1000
publish_timeout_ms = 5000
[[plugins]]
name = "a"
path = "/does/not/exist.wasm"
[[plugins]]
name = "a"
path = "/also/missing.wasm"
timeout_ms = 0
[targets.n]
type = "nats"
url = ""
[targets.k]
type = "kafka"
bootstrap_servers = "127.0.0.1:9092"
properties = { "bootstrap.servers" = "elsewhere:9092" }
[targets.k2]
type = "kafka"
bootstrap_servers = "127.0.0.1:9092"
properties = { "acks" = "all", "linger.milliseconds" = "5" }
[retention]
published_max_age_seconds = 0
batch_size = 0
"#;
    let Err(LoadError::Invalid(problems)) = Config::from_toml(text, Path::new("."), &|_| None) else {
        panic!("expected validation problems");
    };
    let all = problems.join("\n");
    for expected in [
        "database.url must start with postgres://",
        "relay.batch_size must be at least 1",
        "relay.lease_duration_ms (1000) must be at least",
        "plugins[0] (\"a\"): path /does/not/exist.wasm is not a file",
        "plugins[1] (\"a\"): duplicate plugin name",
        "plugins[1] (\"a\"): timeout_ms must be between",
        "targets.n: url is empty",
        "targets.k: properties may not set \"bootstrap.servers\"",
        "targets.k2: properties: ",
        "linger.milliseconds",
        "retention.published_max_age_seconds must be at least 1",
        "retention.batch_size must be between 1 and 100000",
    ] {
        assert!(all.contains(expected), "missing {expected:?} in:\n{all}");
    }
}

#[test]
fn an_unknown_retention_mode_is_named() {
    let text = "[database]\nurl = \"postgres://x/y\"\n[retention]\npublished_max_age_seconds = 60\nmode = \"shred\"\n";
    match Config::from_toml(text, Path::new("."), &|_| None) {
        Err(LoadError::Parse(message)) => {
            assert!(
                message.contains("shred") && message.contains("archive"),
                "{message}"
            )
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
}

#[test]
fn unknown_keys_are_rejected_by_name() {
    let text = "[database]\nurl = \"postgres://x/y\"\nmax_conections = 3\n";
    match Config::from_toml(text, Path::new("."), &|_| None) {
        Err(LoadError::Parse(message)) => assert!(message.contains("max_conections"), "{message}"),
        other => panic!("expected a parse error, got {other:?}"),
    }
}

#[test]
fn secrets_come_from_the_environment() {
    let wasm = plugin("route_by_type");
    let text = format!(
        "[database]\nurl = \"postgres://file/db\"\n[[plugins]]\nname = \"r\"\npath = \"{}\"\n[targets.main-bus]\ntype = \"nats\"\nurl = \"nats://file:4222\"\n",
        wasm.display()
    );
    let env = |name: &str| match name {
        "SWITCHYARD_DATABASE_URL" => Some("postgres://env/db".to_string()),
        "SWITCHYARD_TARGET_MAIN_BUS_USER" => Some("relay".to_string()),
        "SWITCHYARD_TARGET_MAIN_BUS_PASSWORD" => Some("s3cret".to_string()),
        _ => None,
    };
    let config = Config::from_toml(&text, Path::new("."), &env).unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(config.database.url, "postgres://env/db");
    let TargetConfig::Nats(nats) = &config.targets["main-bus"] else {
        panic!("main-bus is a NATS target");
    };
    assert_eq!(nats.user.as_deref(), Some("relay"));
    assert_eq!(nats.password.as_deref(), Some("s3cret"));
}

#[test]
fn kafka_servers_and_credentials_come_from_the_environment() {
    let wasm = plugin("route_by_type");
    let text = format!(
        "[database]\nurl = \"postgres://file/db\"\n[[plugins]]\nname = \"r\"\npath = \"{}\"\n[targets.events]\ntype = \"kafka\"\nbootstrap_servers = \"file:9092\"\nproperties = {{ \"sasl.mechanisms\" = \"PLAIN\" }}\n",
        wasm.display()
    );
    let env = |name: &str| match name {
        "SWITCHYARD_TARGET_EVENTS_URL" => Some("broker-1:9093,broker-2:9093".to_string()),
        "SWITCHYARD_TARGET_EVENTS_USER" => Some("relay".to_string()),
        "SWITCHYARD_TARGET_EVENTS_PASSWORD" => Some("s3cret".to_string()),
        _ => None,
    };
    let config = Config::from_toml(&text, Path::new("."), &env).unwrap_or_else(|e| panic!("{e:?}"));
    let TargetConfig::Kafka(kafka) = &config.targets["events"] else {
        panic!("events is a Kafka target");
    };
    assert_eq!(kafka.bootstrap_servers, "broker-1:9093,broker-2:9093");
    assert_eq!(kafka.properties["sasl.username"], "relay");
    assert_eq!(kafka.properties["sasl.password"], "s3cret");
    assert_eq!(kafka.properties["sasl.mechanisms"], "PLAIN");
}
