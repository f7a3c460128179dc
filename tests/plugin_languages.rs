//! The same plugin in several languages behaves the same: route-by-type in
//! Rust and its ports in Python and JavaScript (built by
//! `scripts/plugin-toolchains.sh`, each for the router and the batch-router
//! world) give identical messages for the same events and configs, and
//! refuse the same bad configs.

use std::path::{Path, PathBuf};

use switchyard::config::PluginConfig;
use switchyard::plugin::{Event, PayloadFormat, PluginEngine, Tier};
use switchyard_tests::plugins::plugin;
use switchyard_tests::workspace_root;

/// The ports of route-by-type, by language and world, and the Rust one
/// built for the batch-router world.
fn ports() -> Vec<(String, PathBuf)> {
    let rust_batch = ("rust_batch".to_string(), plugin("route_by_type_batch"));
    let ports = ["python", "js"]
        .into_iter()
        .flat_map(|language| [(language, ""), (language, "_batch")])
        .map(|(language, world)| {
            let path = workspace_root().join(format!("plugins/target/{language}/route_by_type{world}.wasm"));
            assert!(
                path.is_file(),
                "{} is missing: run scripts/plugin-toolchains.sh",
                path.display()
            );
            (format!("{language}{world}"), path)
        });
    std::iter::once(rust_batch).chain(ports).collect()
}

fn plugin_config(path: &Path, config: &str) -> PluginConfig {
    let mut entry: PluginConfig = toml::from_str(&format!(
        "name = \"conformance\"\npath = {:?}",
        path.display().to_string()
    ))
    .unwrap();
    // Interpreted plugins start slower; the per-call bound is not what this test checks.
    entry.timeout_ms = 10_000;
    entry.config = toml::from_str(config).unwrap();
    entry
}

fn event(
    event_type: &str,
    aggregate_id: &str,
    tenant: Option<&str>,
    payload: &[u8],
    format: PayloadFormat,
) -> Event {
    Event {
        row_id: 7,
        event_id: "0b6e1f6c-3c1c-4a59-9d7a-2f6f2b0f6a11".into(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate_id.into(),
        event_type: event_type.into(),
        payload: payload.to_vec(),
        payload_format: format,
        headers: vec![(
            "traceparent".into(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        )],
        tenant: tenant.map(str::to_string),
        created_at_ms: 1_763_856_000_000,
        attempt: 1,
    }
}

fn events() -> Vec<Event> {
    vec![
        event(
            "OrderCreated",
            "order-1",
            None,
            br#"{"total":1}"#,
            PayloadFormat::Json,
        ),
        event(
            "OrderPaid",
            "order-2",
            Some("acme"),
            br#"{"card":"4111"}"#,
            PayloadFormat::Json,
        ),
        event("OrderShipped", "order-3", None, b"{}", PayloadFormat::Json),
        event(
            "OrderCreated",
            "ordre-\u{e9}t\u{e9}",
            Some("\u{fc}ber"),
            &[0, 159, 146, 150, 255],
            PayloadFormat::Binary,
        ),
        event("", "", None, b"", PayloadFormat::Json),
    ]
}

const CONFIGS: [&str; 5] = [
    r#"target = "out""#,
    r#"target = "out"
topic = "orders.{event_type}"
key = """#,
    r#"target = "out"
routes = { OrderPaid = "payments.{tenant}.{aggregate_id}" }
drop = ["OrderShipped"]"#,
    r#"target = "kafka"
key = "{tenant}-{aggregate_id}"
topic = "{tenant}/{aggregate_type}/{event_type}/{aggregate_id}""#,
    r#"target = "out"
routes = { OrderCreated = "created", OrderShipped = "shipped" }
drop = ["OrderPaid"]"#,
];

const BAD_CONFIGS: [&str; 6] = [
    "",
    r#"target = """#,
    r#"target = "out"
topic = "{nope}""#,
    r#"target = "out"
topic = "{unclosed""#,
    r#"target = "out"
extra = 1"#,
    r#"target = "out"
drop = "OrderPaid""#,
];

/// What a plugin answered, as text (the bindings' types have no equality),
/// all events routed as the relay routes a claimed batch.
fn answers(engine: &PluginEngine, path: &Path, config: &str) -> Result<Vec<String>, String> {
    // The baseline compiler (Winch), which a hot reload goes live on: what
    // is compared is each language's behaviour, and Cranelift would spend
    // most of a minute of the suite on the 18 MB Python and JavaScript
    // ports. `plugin test` on them (below) goes through Cranelift.
    let bytes = std::fs::read(path).unwrap();
    let version = engine
        .load_bytes(&plugin_config(path, config), &bytes, Tier::Baseline)
        .map_err(|e| e.to_string())?;
    let batch = path.to_string_lossy().ends_with("_batch.wasm");
    assert_eq!(version.batched(), batch, "{}", path.display());
    let events = events();
    let mut calls = 0;
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let (answers, _) = version.route_many(None, None, &events, &[], until, &mut |_, _| calls += 1);
    let expected_calls = if batch { 1 } else { events.len() };
    assert_eq!(calls, expected_calls, "{}", path.display());
    Ok(answers.iter().map(|answer| format!("{answer:?}")).collect())
}

#[test]
fn route_by_type_gives_the_same_messages_in_every_language() {
    let cache = std::env::temp_dir().join("sy-conformance-cache");
    let engine = PluginEngine::new(Some(&cache)).unwrap();
    let rust = plugin("route_by_type");
    for (language, port) in ports() {
        for config in CONFIGS {
            let want = answers(&engine, &rust, config).expect("the Rust plugin accepts the config");
            let got = answers(&engine, &port, config)
                .unwrap_or_else(|e| panic!("{language} refused config {config:?}: {e}"));
            for ((want, got), event) in want.iter().zip(&got).zip(events()) {
                assert_eq!(
                    got, want,
                    "{language}, config {config:?}, event {} {:?}",
                    event.event_type, event.aggregate_id
                );
            }
        }
        for config in BAD_CONFIGS {
            assert!(
                answers(&engine, &rust, config).is_err(),
                "Rust accepted {config:?}"
            );
            let refused = answers(&engine, &port, config);
            assert!(refused.is_err(), "{language} accepted bad config {config:?}");
            assert!(
                refused.unwrap_err().contains("failed init"),
                "{language}: {config:?}"
            );
        }
    }
}

/// A newcomer's path in Python and JavaScript, as the book's first-plugin
/// page gives it: `plugin new --lang ...`, `./build.sh`, `plugin test`,
/// with nothing edited.
#[tokio::test]
async fn new_python_and_js_plugin_projects_build_and_pass_plugin_test_unchanged() {
    use switchyard_tests::book;
    let tools = std::env::var("SWITCHYARD_TOOLS_DIR").map_or_else(
        |_| PathBuf::from(std::env::var("HOME").unwrap()).join(".local/share/switchyard"),
        PathBuf::from,
    );
    let switchyard = env!("CARGO_BIN_EXE_relay-process");
    for (lang, variable, toolchain) in [
        (
            "python",
            "COMPONENTIZE_PY",
            tools.join("python/bin/componentize-py"),
        ),
        (
            "js",
            "COMPONENTIZE_JS",
            tools.join("node/node_modules/.bin/componentize-js"),
        ),
    ] {
        assert!(toolchain.is_file(), "run scripts/plugin-toolchains.sh");
        let parent = std::env::temp_dir().join(format!("sy-plugin-new-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&parent).unwrap();
        let snippet = book::snippet("plugins/writing.md", &format!("--lang {lang} "));
        let (code, out, err) = book::run(&snippet, &parent, switchyard, &[(variable, &toolchain)]).await;
        assert_eq!(
            code, 0,
            "{lang}: the page's commands run as written:\n{snippet}\n{out}\n{err}"
        );
        assert!(
            out.contains("-> target=events topic=order.OrderPlaced key=order-42"),
            "{lang}: {out}"
        );
        let wasm = parent.join("my-router/my_router.wasm");
        let (code, out, err) =
            switchyard_tests::cli(switchyard, &["plugin", "check", wasm.to_str().unwrap()], &[]).await;
        assert_eq!(code, 0, "{out}\n{err}");
        assert!(
            out.contains("valid switchyard:plugin/batch-router"),
            "{lang}: a batch plugin: {out}"
        );
        let _ = std::fs::remove_dir_all(parent);
    }
}

/// `plugin check` compiles through the compiled cache, so checking a large
/// component again does not compile it again. The Python and JavaScript
/// ports are what make that matter; the small Rust build shows it without
/// spending half a minute of the suite compiling one of them.
#[tokio::test]
async fn plugin_check_uses_the_compiled_cache() {
    let cache = std::env::temp_dir().join(format!("sy-check-cache-{}", uuid::Uuid::new_v4().simple()));
    let component = plugin("route_by_type");
    let check = || async {
        switchyard_tests::cli(
            env!("CARGO_BIN_EXE_relay-process"),
            &["plugin", "check", component.to_str().unwrap()],
            &[("XDG_CACHE_HOME", cache.to_str().unwrap())],
        )
        .await
    };
    let (code, out, err) = check().await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("valid switchyard:plugin/router (route: one call per event) component"),
        "{out}"
    );
    let cached = compiled(&cache.join("switchyard"));
    assert!(!cached.is_empty(), "the compiled component is in the cache");
    let (code, out, _) = check().await;
    assert_eq!(code, 0);
    assert_eq!(
        compiled(&cache.join("switchyard")),
        cached,
        "the second check reuses it: {out}"
    );
    let _ = std::fs::remove_dir_all(cache);
}

/// Compiled artifacts under `dir` with their modification times. wasmtime's
/// cache worker writes `.stats` files and cleanup markers in the background,
/// possibly after the process has exited, so those are left out.
fn compiled(dir: &Path) -> Vec<(PathBuf, std::time::SystemTime)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            found.extend(compiled(&path));
        } else if !name.starts_with('.')
            && !name.ends_with(".stats")
            && let Ok(modified) = entry.metadata().and_then(|meta| meta.modified())
        {
            found.push((path, modified));
        }
    }
    found.sort();
    found
}
