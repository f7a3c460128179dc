//! Config files: the shipped example validates, and a broken file is refused
//! with every problem listed at once.

use std::path::Path;
use std::time::Duration;

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
fn every_kubernetes_overlay_config_is_valid() {
    // Their secrets are mounted in the pod: stand-ins here. Their plugin
    // comes from a registry, which validation does not reach.
    let secrets = std::env::temp_dir().join(format!("sy-k8s-secrets-{}", std::process::id()));
    std::fs::create_dir_all(&secrets).unwrap();
    for (file, text) in [
        ("nats.creds", "-----BEGIN NATS USER JWT-----\n"),
        ("kafka-password", "secret\n"),
        ("database-password", "secret\n"),
        (".dockerconfigjson", "{\"auths\": {}}\n"),
    ] {
        std::fs::write(secrets.join(file), text).unwrap();
    }
    let overlays = workspace_root().join("deploy/kubernetes/overlays");
    let mut modes = Vec::new();
    for entry in std::fs::read_dir(&overlays).unwrap() {
        let path = entry.unwrap().path().join("switchyard.toml");
        let text = std::fs::read_to_string(&path)
            .unwrap()
            .replace("/run/secrets/switchyard/", &format!("{}/", secrets.display()))
            .replace("/run/secrets/registry/", &format!("{}/", secrets.display()));
        let config = Config::from_toml(&text, Path::new("."), &|_| None)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            config.admin.listen,
            "0.0.0.0:9187",
            "{}: probes reach it",
            path.display()
        );
        assert!(
            config.plugins.iter().all(|p| p.oci_reference().is_some()),
            "{}: a pod has no plugin files; its plugins come from a registry",
            path.display()
        );
        modes.push((config.replication_feed().is_some(), config.serves_many()));
    }
    let _ = std::fs::remove_dir_all(&secrets);
    modes.sort_unstable();
    assert_eq!(
        modes,
        [(false, false), (false, true), (true, false)],
        "claim, fleet, replication"
    );
}

#[test]
fn every_problem_is_reported_at_once() {
    let text = r#"
[database]
url = "mongodb://nope"
[relay]
instance_id = "relay\u0000a"
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
        "relay.instance_id must be 1 to 128 bytes with no control characters (got \"relay\\0a\")",
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

/// A TOML mistake is named by its line and column, never by quoting the
/// line: the line may be the one holding a secret.
#[test]
fn a_parse_error_names_the_place_and_not_the_secret_beside_it() {
    for text in [
        "[database]\nurl = \"postgres://app:hunter2@db/app\" extra\n",
        "[admin.tokens]\nops = \"hunter2hunter2hunter2\"x\n",
        "[targets.k]\ntype = \"kafka\"\nbootstrap_servers = \"b:9092\"\npassword = \"hunter2\n",
    ] {
        match Config::from_toml(text, Path::new("."), &|_| None) {
            Err(LoadError::Parse(message)) => {
                assert!(!message.contains("hunter2"), "{message}");
                assert!(message.starts_with("line "), "{message}");
            }
            other => panic!("expected a parse error, got {other:?}"),
        }
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
    assert_eq!(
        nats.password,
        Some(switchyard::secret::SecretValue::Value("s3cret".into()))
    );
}

#[tokio::test]
async fn secrets_come_from_files_named_by_the_environment() {
    let wasm = plugin("route_by_type");
    let text = format!(
        "[database]\nurl = \"postgres://file/db\"\n[[plugins]]\nname = \"r\"\npath = \"{}\"\n[targets.main-bus]\ntype = \"nats\"\nurl = \"nats://file:4222\"\nuser = \"relay\"\n",
        wasm.display()
    );
    let dir = std::env::temp_dir().join(format!("sy-env-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let url_file = dir.join("url");
    std::fs::write(&url_file, "postgres://relay@from-file/db\n").unwrap();
    let password_file = dir.join("nats-password");
    std::fs::write(&password_file, "first\n").unwrap();
    let (url_path, password_path) = (
        url_file.display().to_string(),
        password_file.display().to_string(),
    );
    let env = |name: &str| match name {
        "SWITCHYARD_DATABASE_URL_FILE" => Some(url_path.clone()),
        "SWITCHYARD_DATABASE_PASSWORD_FILE" => Some(password_path.clone()),
        "SWITCHYARD_TARGET_MAIN_BUS_PASSWORD_FILE" => Some(password_path.clone()),
        _ => None,
    };
    let config = Config::from_toml(&text, Path::new("."), &env).unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(config.database.url, "postgres://relay@from-file/db");
    let TargetConfig::Nats(nats) = &config.targets["main-bus"] else {
        panic!("main-bus is a NATS target");
    };
    // Read for each connection: a rotated password is seen.
    let password = nats.password.clone().expect("password from a file");
    assert_eq!(password.read().await.unwrap().expose(), "first");
    std::fs::write(&password_file, "rotated-pw-2\n").unwrap();
    assert_eq!(password.read().await.unwrap().expose(), "rotated-pw-2");
    let database = config.database.endpoint();
    assert_eq!(
        database.password().await.unwrap().unwrap().expose(),
        "rotated-pw-2"
    );
    assert!(!format!("{config:?}").contains("rotated-pw-2"));

    // A variable naming a file that is not there is a problem, named.
    let missing =
        |name: &str| (name == "SWITCHYARD_DATABASE_URL_FILE").then(|| "/nonexistent/url".to_string());
    let problems = Config::from_toml(&text, Path::new("."), &missing)
        .unwrap_err()
        .to_string();
    assert!(
        problems.contains("SWITCHYARD_DATABASE_URL_FILE: cannot read /nonexistent/url"),
        "{problems}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
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
    assert_eq!(
        kafka.password,
        Some(switchyard::secret::SecretValue::Value("s3cret".into()))
    );
    assert_eq!(kafka.properties["sasl.mechanisms"], "PLAIN");
}

#[test]
fn schema_mistakes_in_several_sections_and_keys_are_all_listed() {
    let text = r#"
[database]
url = "postgres://x/y"
max_conections = 3
[relay]
batch_size = "many"
lease_duration = 3000
max_attempts = -1
[[plugins]]
name = "a"
path = "a.wasm"
timeout = 5
[targets.n]
type = "natz"
url = "nats://127.0.0.1:4222"
[targets.k]
type = "kafka"
bootstrap_servers = 9092
acks = "all"
"#;
    let Err(LoadError::Invalid(problems)) = Config::from_toml(text, Path::new("."), &|_| None) else {
        panic!("expected every section's problem");
    };
    let all = problems.join("\n");
    let listed = |at: &str, says: &str| {
        assert!(
            problems.iter().any(|p| p.starts_with(at) && p.contains(says)),
            "missing {at:?} saying {says:?} in:\n{all}"
        );
    };
    listed("database.max_conections: ", "unknown field");
    listed("relay.batch_size: ", "\"many\"");
    listed("relay.lease_duration: ", "unknown field");
    listed("relay.max_attempts: ", "-1");
    listed("plugins[0].timeout: ", "unknown field");
    listed("targets.n: ", "natz");
    listed("targets.k.bootstrap_servers: ", "integer");
    // librdkafka properties go under `properties`.
    listed("targets.k.acks: ", "unknown field");
    assert_eq!(problems.len(), 8, "one line per mistake:\n{all}");
}

#[test]
fn a_malformed_database_url_is_refused_without_its_password() {
    let text = r#"
[database]
url = "postgres://app:hunter2@db:notaport/orders"
"#;
    let Err(LoadError::Invalid(problems)) = Config::from_toml(text, Path::new("."), &|_| None) else {
        panic!("expected validation problems");
    };
    let all = problems.join("\n");
    assert!(
        all.contains("database.url") && all.contains("not a valid URL"),
        "{all}"
    );
    assert!(all.contains("port"), "says what is wrong: {all}");
    assert!(!all.contains("hunter2"), "the password is printed: {all}");
}

#[test]
fn secrets_never_appear_in_debug_output() {
    let text = r#"
[database]
url = "postgres://app:hunter2@db:5432/orders"
[targets.n]
type = "nats"
url = "nats://relay:natspass@127.0.0.1:4222"
[targets.k]
type = "kafka"
bootstrap_servers = "127.0.0.1:9092"
properties = { "sasl.password" = "kafkapass", "sasl.username" = "relay" }
"#;
    // Parsing succeeds up to validation (no plugins): the parsed config is what gets logged.
    let config: switchyard::Config = toml::from_str(text).unwrap();
    let shown = format!("{config:?}");
    for secret in ["hunter2", "natspass", "kafkapass"] {
        assert!(!shown.contains(secret), "{secret} printed in {shown}");
    }
}

#[test]
fn the_jetstream_duplicate_window_must_cover_the_retry_horizon() {
    let relay = switchyard::config::RelayConfig::default();
    // 0.5+1+2+4+8+16+32+60+60 s of backoff and nine 30 s leases.
    assert_eq!(relay.retry_horizon(), Duration::from_millis(183_500 + 270_000));

    let config = |relay: &str, window: &str| {
        format!(
            "[database]\nurl = \"postgres://x/y\"\n[relay]\n{relay}\n[targets.n]\ntype = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\n{window}\n"
        )
    };
    let problems = |text: String| match Config::from_toml(&text, Path::new("."), &|_| None) {
        Err(LoadError::Invalid(problems)) => problems,
        other => panic!("expected problems, got {other:?}"),
    };
    // Defaults fit: only the missing plugin is reported.
    let defaults = problems(config("", ""));
    assert!(
        !defaults.iter().any(|p| p.contains("duplicate_window")),
        "{defaults:?}"
    );

    let long = problems(config("max_attempts = 30", ""));
    let problem = long
        .iter()
        .find(|p| p.starts_with("targets.n: duplicate_window_seconds (600) is shorter"))
        .unwrap_or_else(|| panic!("{long:?}"));
    let (horizon, rest) = problem
        .strip_prefix("targets.n: duplicate_window_seconds (600) is shorter than the relay's retry horizon (")
        .and_then(|rest| rest.split_once(" s: "))
        .unwrap_or_else(|| panic!("{problem}"));
    assert!(horizon.parse::<u64>().is_ok_and(|s| s > 600), "{problem}");
    assert_eq!(
        rest,
        "relay.max_attempts backoffs at their longest plus a lease each), so a retry could store an \
         event twice; raise it (and the streams' duplicate window) or lower relay.max_attempts, \
         relay.max_backoff_ms or relay.lease_duration_ms"
    );

    let raised = problems(config("max_attempts = 30", "duplicate_window_seconds = 3600"));
    assert!(
        !raised.iter().any(|p| p.contains("duplicate_window")),
        "{raised:?}"
    );

    // Core NATS does not deduplicate: nothing to cover.
    let core = problems(config("max_attempts = 30", "mode = \"core\""));
    assert!(!core.iter().any(|p| p.contains("duplicate_window")), "{core:?}");
}

#[test]
fn a_list_of_databases_is_checked_name_by_name() {
    let text = r#"
[database]
url = "postgres://relay:hunter2@db/one"
[[databases]]
name = "tenant a"
url = "postgres://relay:hunter2@db/a"
[[databases]]
name = "b"
url = "mongodb://db/b"
[[databases]]
name = "b"
url = "postgres://db/b2"
max_connections = 1
[catalog]
url = ""
[ownership]
lease_seconds = 1
[connections]
per_server = 0
[relay]
poll_interval_ms = 500
idle_poll_max_ms = 100
[[plugins]]
name = "router"
path = "/does/not/exist.wasm"
[targets.out]
type = "stdout"
"#;
    let Err(LoadError::Invalid(problems)) = Config::from_toml(text, Path::new("."), &|_| None) else {
        panic!("a bad list of databases must be refused");
    };
    let all = problems.join("\n");
    for expected in [
        "[database] is set beside [[databases]] or [catalog]",
        "databases[0].name \"tenant a\" must be 1 to 63 letters, digits, '-' or '_'",
        "databases[2].name \"b\" is used twice",
        "databases[1].url must start with postgres://, mysql://, mariadb:// or sqlite: (got \"mongodb\")",
        "databases[2].max_connections must be at least 2",
        "catalog.url is empty (set it or SWITCHYARD_CATALOG_URL)",
        "ownership.lease_seconds must be at least 3",
        "connections.per_server must be at least 1",
        "relay.idle_poll_max_ms (100) must be at least relay.poll_interval_ms (500)",
    ] {
        assert!(all.contains(expected), "missing {expected:?} in:\n{all}");
    }
    assert!(!all.contains("hunter2"), "a password in a message:\n{all}");
}

#[test]
fn each_database_url_comes_from_its_own_variable_and_never_shows() {
    plugin("route_by_type");
    let text = format!(
        r#"
[[databases]]
name = "tenant-a"
[[databases]]
name = "b"
url = "sqlite:///tmp/b.db"
[catalog]
url = "postgres://db/control"
[[plugins]]
name = "router"
path = "{}"
[plugins.config]
target = "out"
[targets.out]
type = "stdout"
"#,
        plugin("route_by_type").display()
    );
    let env = |name: &str| match name {
        "SWITCHYARD_DATABASE_TENANT_A_URL" => Some("postgres://relay:s3cret@db/a".to_string()),
        "SWITCHYARD_CATALOG_URL" => Some("postgres://relay:s3cret@db/control".to_string()),
        _ => None,
    };
    let config = Config::from_toml(&text, Path::new("."), &env).expect("valid");
    assert_eq!(config.databases[0].url, "postgres://relay:s3cret@db/a");
    assert!(config.serves_many());
    let shown = format!("{:?} {:?}", config.databases, config.catalog);
    assert!(!shown.contains("s3cret"), "{shown}");
    let names: Vec<String> = config.database_list().into_iter().map(|d| d.name).collect();
    assert_eq!(names, ["tenant-a", "b"]);
    let picked = config.pick_database(None).unwrap_err().to_string();
    assert!(
        picked.contains("give --database NAME (one of: tenant-a, b)"),
        "{picked}"
    );
    let one = config.for_database(&config.databases[1]);
    assert!(!one.serves_many());
    assert_eq!(one.database.url, "sqlite:///tmp/b.db");
}

#[test]
fn every_metric_the_alerts_and_the_dashboard_use_is_exported() {
    let metrics = switchyard::metrics::Metrics::new(None);
    let exported: Vec<&str> = metrics.described().iter().map(|m| m.name).collect();
    let mut used = std::collections::BTreeSet::new();
    for file in [
        "deploy/prometheus/switchyard-alerts.yml",
        "deploy/grafana/switchyard.json",
    ] {
        let text = std::fs::read_to_string(workspace_root().join(file)).unwrap();
        for (at, _) in text.match_indices("switchyard_") {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            used.insert((file, name));
        }
    }
    assert!(used.len() > 10, "{used:?}");
    for (file, name) in &used {
        // Counters and histograms are exported under their base name.
        let base = ["_total", "_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(name);
        assert!(
            exported.contains(&base),
            "{file} uses {name}, which the relay does not export ({exported:?})"
        );
    }
}

#[test]
fn every_toml_snippet_in_the_book_is_a_valid_config() {
    let route = plugin("route_by_type");
    let mut checked = 0;
    let mut pages = vec![workspace_root().join("docs/src")];
    while let Some(dir) = pages.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pages.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "md") {
                continue;
            }
            let page = std::fs::read_to_string(&path).unwrap();
            for block in page.split("```toml\n").skip(1) {
                let snippet = block.split("\n```").next().unwrap();
                if snippet.starts_with("{{#include ") {
                    // A repository file, validated as such (examples/*.toml).
                    continue;
                }
                let has = |section: &str| snippet.lines().any(|l| l.trim_start().starts_with(section));
                // A snippet shows part of a config: the smallest rest completes it.
                let mut text = String::new();
                if !has("[database]") && !has("[[databases]]") && !has("[catalog]") {
                    text.push_str("[database]\nurl = \"postgres://relay@db.example.com/app\"\n");
                }
                text.push_str(snippet);
                if !has("[[plugins]]") {
                    text.push_str(&format!(
                        "\n[[plugins]]\nname = \"book\"\npath = \"{}\"\n",
                        route.display()
                    ));
                }
                if !has("[targets.") {
                    text.push_str("\n[targets.book]\ntype = \"stdout\"\n");
                }
                // A relative plugin path in a snippet is one in this
                // repository, for a config written at its root.
                match Config::from_toml(&text, &workspace_root(), &|_| None) {
                    Ok(_) => {}
                    // Files on the user's machine (secrets, certificates, plugins) are not here.
                    Err(LoadError::Invalid(problems)) => {
                        let wrong: Vec<_> = problems
                            .iter()
                            .filter(|p| !p.contains("No such file or directory"))
                            .collect();
                        assert!(wrong.is_empty(), "{}: {wrong:?}\n{text}", path.display());
                    }
                    Err(error) => panic!("{}: {error}\n{text}", path.display()),
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 9, "{checked} snippets");
}

#[test]
fn the_generated_reference_pages_are_current() {
    use switchyard::cli::ReferencePage;
    let bless = std::env::var_os("SWITCHYARD_BLESS").is_some();
    for page in [ReferencePage::Config, ReferencePage::Cli, ReferencePage::Metrics] {
        let path = workspace_root().join(page.path());
        let generated = page.markdown();
        if bless {
            std::fs::write(&path, &generated).unwrap();
            continue;
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == generated,
            "{} is stale: regenerate it with `SWITCHYARD_BLESS=1 cargo test -p switchyard-tests --test suite config::\
             the_generated_reference_pages_are_current`",
            path.display()
        );
    }
}

#[test]
fn the_schema_takes_every_example_config_and_names_a_misspelt_key_by_its_path() {
    let mut schemas = boon::Schemas::new();
    let mut compiler = boon::Compiler::new();
    compiler
        .add_resource("switchyard.json", switchyard::config::reference::schema())
        .expect("the schema is JSON");
    let schema = compiler
        .compile("switchyard.json", &mut schemas)
        .unwrap_or_else(|e| panic!("not a valid JSON Schema: {e:#}"));
    let mut checked = 0;
    for entry in std::fs::read_dir(workspace_root().join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let config: serde_json::Value = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            if let Err(error) = schemas.validate(&config, schema) {
                panic!("{}: {error}", path.display());
            }
            checked += 1;
        }
    }
    assert!(checked >= 5);
    let misspelt: serde_json::Value =
        toml::from_str("[database]\nurl = \"postgres://db/app\"\n[relay]\nbatch_sise = 10\n").unwrap();
    let error = schemas
        .validate(&misspelt, schema)
        .expect_err("a misspelt key is refused")
        .to_string();
    assert!(
        error.contains("at '/relay'") && error.contains("batch_sise"),
        "{error}"
    );
}

/// Every `x-env` beside a field names a variable the loader reads, and the
/// loader reads no variable that no field names: the reference page, made
/// from the annotations, lists exactly the overrides there are.
#[test]
fn the_environment_overrides_are_the_ones_the_fields_name() {
    fn annotated(value: &serde_json::Value, into: &mut std::collections::BTreeSet<String>) {
        match value {
            serde_json::Value::Object(map) => {
                if let Some(name) = map
                    .get(switchyard::config::reference::ENV_KEY)
                    .and_then(|n| n.as_str())
                {
                    into.insert(name.to_string());
                }
                map.values().for_each(|v| annotated(v, into));
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| annotated(v, into)),
            _ => {}
        }
    }
    let mut named = std::collections::BTreeSet::new();
    annotated(&switchyard::config::reference::schema(), &mut named);

    // One of everything the loader overrides: both database forms, the
    // catalog and a target of each kind that has overrides.
    let text = r#"
        [database]
        url = "postgres://db/app"
        [catalog]
        url = "postgres://db/catalog"
        [[databases]]
        name = "orders-eu"
        url = "postgres://db/orders"
        [targets.bus]
        type = "nats"
        url = "nats://127.0.0.1:4222"
        [targets.log-k]
        type = "kafka"
        bootstrap_servers = "127.0.0.1:9092"
        [targets.rabbit]
        type = "rabbitmq"
        url = "amqp://127.0.0.1:5672/%2f"
        exchange = "events"
        [targets.gcp]
        type = "pubsub"
        project = "p"
        [targets.queue]
        type = "sqs"
        [targets.hooks]
        type = "http"
        base_url = "https://hooks.example.internal/in"
        [targets.cache]
        type = "redis"
        url = "redis://127.0.0.1:6379"
        [admin.tokens]
        ops = "an-admin-token-of-length"
    "#;
    let asked = std::cell::RefCell::new(std::collections::BTreeSet::new());
    let loaded = Config::from_toml(text, Path::new("."), &|name| {
        asked.borrow_mut().insert(name.to_string());
        None
    });
    assert!(!matches!(loaded, Err(LoadError::Parse(_))), "{:?}", loaded.err());
    let asked = asked.into_inner();
    let read: std::collections::BTreeSet<String> = asked
        .iter()
        // `X_FILE` beside `X` is the file form every variable has.
        .filter(|name| {
            !name
                .strip_suffix("_FILE")
                .is_some_and(|bare| asked.contains(bare))
        })
        // Every Google client's own variable, named in emulator_host's text.
        .filter(|name| !name.starts_with("PUBSUB_EMULATOR_HOST"))
        .map(|name| {
            [
                "ORDERS_EU",
                "BUS",
                "LOG_K",
                "RABBIT",
                "GCP",
                "QUEUE",
                "HOOKS",
                "CACHE",
                "OPS",
            ]
            .iter()
            .fold(name.clone(), |name, each| {
                let name = name.replace(&format!("_{each}_"), "_<NAME>_");
                match name.strip_suffix(&format!("_{each}")) {
                    Some(bare) => format!("{bare}_<NAME>"),
                    None => name,
                }
            })
        })
        .collect();
    assert_eq!(read, named);
}

/// Every shell snippet of the getting-started pages is run as written: by
/// a test (the first-plugin pages), or by the test command itself.
#[test]
fn every_getting_started_snippet_is_run_somewhere() {
    use switchyard_tests::book;
    let test_command = std::fs::read_to_string(workspace_root().join("scripts/test.sh")).unwrap();
    let ci = std::fs::read_to_string(workspace_root().join(".ci/run")).unwrap();
    // The marker a snippet carries, and who runs it.
    let run_by: [(&str, &str); 5] = [
        (
            "--lang rust",
            "plugin_runtime: a_new_rust_plugin_project_builds_and_passes_plugin_test_unchanged",
        ),
        (
            "--lang python ",
            "plugin_languages: new_python_and_js_plugin_projects_build_and_pass_plugin_test_unchanged",
        ),
        (
            "--lang js ",
            "plugin_languages: new_python_and_js_plugin_projects_build_and_pass_plugin_test_unchanged",
        ),
        ("scripts/test.sh", ".ci/run"),
        ("scripts/demo.sh", "scripts/test.sh"),
    ];
    // A line of its own, perhaps after `NAME=value` settings.
    let runs = |script: &str, command: &str| {
        script
            .lines()
            .any(|line| line.split_whitespace().find(|word| !word.contains('=')) == Some(command))
    };
    assert!(runs(&ci, "scripts/test.sh"), ".ci/run runs the test command");
    assert!(
        runs(&test_command, "scripts/demo.sh"),
        "scripts/test.sh runs the demo script"
    );
    let mut seen = 0;
    for page in [
        "getting-started/demo.md",
        "getting-started/examples.md",
        "plugins/writing.md",
    ] {
        for snippet in book::snippets(page) {
            let runner = run_by.iter().find(|(marker, _)| snippet.contains(marker));
            assert!(runner.is_some(), "{page}: no test runs this snippet:\n{snippet}");
            seen += 1;
        }
    }
    assert!(seen >= 5, "{seen} snippets");
}

/// The book and the README name only config keys, variables, metrics and
/// flags the code has (scripts/docs-claims.py, CI's docs step); the check
/// itself names a planted wrong one of each kind.
#[test]
fn the_docs_claims_check_passes_on_the_book_and_names_planted_mistakes() {
    let binary = env!("CARGO_BIN_EXE_relay-process");
    let script = workspace_root().join("scripts/docs-claims.py");
    let run = |files: &[&std::path::Path]| {
        let out = std::process::Command::new("python3")
            .arg(&script)
            .arg(binary)
            .args(files)
            .output()
            .expect("python3 runs");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (code, said) = run(&[]);
    assert_eq!(code, Some(0), "{said}");

    let dir = std::env::temp_dir().join(format!("sy-docs-claims-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("planted.md");
    // Made here, not written out: the check reads this file's names as
    // ones the code has.
    let (variable, metric) = (
        ["SWITCHYARD", "DATABSE_URL"].join("_"),
        ["switchyard", "backlog_rowz"].join("_"),
    );
    std::fs::write(
        &page,
        format!(
            "Set `relay.publish_timeout_mss` or `{variable}`; watch `{metric}`.\n\
             Run `switchyard run --confg x.toml`.\n\n```toml\n[relay]\nbatch_sise = 3\n```\n"
        ),
    )
    .unwrap();
    let (code, said) = run(&[&page]);
    assert_eq!(code, Some(1), "{said}");
    for planted in [
        "config key relay.publish_timeout_mss".to_string(),
        format!("variable {variable}"),
        format!("name {metric}"),
        "switchyard flag --confg".to_string(),
        "config key relay.batch_sise (a TOML block)".to_string(),
    ] {
        assert!(said.contains(&planted), "{planted:?} not named:\n{said}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
