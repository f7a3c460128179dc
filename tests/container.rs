//! The container image, as a user runs it: `demo` publishes every event, the
//! relay runs as a non-root user on a read-only root filesystem, and a relay
//! sent SIGTERM mid-stream hands over to a second container with nothing
//! lost or duplicated. Runs when `SWITCHYARD_IMAGE` names an image built by
//! `scripts/image.sh build` (CI builds it); says it skipped otherwise.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{verify, write_orders};
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{all_published, count_status, fresh_db};
use switchyard_tests::relay::{Settings, example};
use switchyard_tests::{eventually, init_logging};

/// Where the image keeps the example plugins.
const IMAGE_PLUGINS: &str = "/usr/share/switchyard/plugins";

/// The image under test, or `None` (and a line saying so) when none was built.
fn image() -> Option<String> {
    let image = std::env::var("SWITCHYARD_IMAGE").ok().filter(|i| !i.is_empty());
    if image.is_none() {
        eprintln!("skipped: no image (set SWITCHYARD_IMAGE after scripts/image.sh build)");
    }
    image
}

fn engine() -> &'static str {
    if Command::new("podman").arg("--version").output().is_ok() {
        "podman"
    } else {
        "docker"
    }
}

fn run(args: &[&str]) -> Output {
    Command::new(engine())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{} {args:?}: {e}", engine()))
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A container removed when the test ends, however it ends.
struct Container(String);

impl Container {
    /// Starts the relay in `image` on the host's network with `config`
    /// mounted, read-only root, a tmpfs for `/tmp`.
    fn relay(image: &str, name: &str, config: &std::path::Path) -> Container {
        Container::relay_with(image, name, config, &[])
    }

    /// [`Container::relay`] with more `HOST:CONTAINER:ro` mounts.
    fn relay_with(image: &str, name: &str, config: &std::path::Path, mounts: &[String]) -> Container {
        let name = format!("{name}-{}", uuid::Uuid::new_v4().simple());
        let mount = format!("{}:/etc/switchyard/switchyard.toml:ro", config.display());
        let mut args = vec![
            "run",
            "-d",
            "--name",
            &name,
            "--network",
            "host",
            "--read-only",
            "--tmpfs",
            "/tmp",
            "-v",
            &mount,
        ];
        for extra in mounts {
            args.extend(["-v", extra.as_str()]);
        }
        args.extend(["-e", "SWITCHYARD_LOG=info", image]);
        let started = run(&args);
        assert!(started.status.success(), "start {name}: {}", text(&started));
        Container(name)
    }

    fn inspect(&self, format: &str) -> String {
        let output = run(&["inspect", &self.0, "--format", format]);
        assert!(output.status.success(), "{}", text(&output));
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    }

    fn running(&self) -> bool {
        self.inspect("{{.State.Running}}") == "true"
    }

    fn logs(&self) -> String {
        text(&run(&["logs", &self.0]))
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = run(&["rm", "-f", "-v", "-t", "0", &self.0]);
    }
}

/// The example config for the image: its baked-in plugins, loopback
/// services (host network), admin on a free port.
fn config_for_image(db_url: &str, nats_url: &str) -> std::path::PathBuf {
    let host_plugins = plugin("route_by_type");
    let host_plugins = host_plugins.parent().unwrap().display().to_string();
    let config = example(&Settings::new(db_url, nats_url).relay("shutdown_timeout_ms", "20000"))
        .set("admin", "listen", "127.0.0.1:0")
        .toml()
        .replace(&host_plugins, IMAGE_PLUGINS);
    let path = std::env::temp_dir().join(format!("sy-image-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).unwrap();
    // The container's user reads it.
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    path
}

#[test]
fn the_demo_publishes_every_event_as_a_non_root_user_on_a_read_only_root() {
    let Some(image) = image() else { return };
    let demo = run(&["run", "--rm", "--read-only", "--tmpfs", "/tmp", &image, "demo"]);
    let shown = text(&demo);
    assert!(demo.status.success(), "{shown}");
    assert!(shown.contains("11 of 11"), "{shown}");

    // The root filesystem takes no write, even where the relay's user owns
    // the directory.
    let write = run(&[
        "run",
        "--rm",
        "--read-only",
        "--tmpfs",
        "/tmp",
        &image,
        "demo",
        "--dir",
        "/var/lib/switchyard/demo",
    ]);
    assert!(
        !write.status.success(),
        "wrote to a read-only root: {}",
        text(&write)
    );
    assert!(text(&write).contains("Read-only file system"), "{}", text(&write));

    let user = run(&["image", "inspect", &image, "--format", "{{.Config.User}}"]);
    assert_eq!(String::from_utf8_lossy(&user.stdout).trim(), "65532:65532");

    // The example plugins ship, not the suite's misbehaving ones built
    // beside them.
    let created = run(&["create", &image]);
    assert!(created.status.success(), "{}", text(&created));
    let id = String::from_utf8_lossy(&created.stdout).trim().to_string();
    let copy = std::env::temp_dir().join(format!("sy-image-plugins-{}", uuid::Uuid::new_v4().simple()));
    let copied = run(&["cp", &format!("{id}:{IMAGE_PLUGINS}"), copy.to_str().unwrap()]);
    run(&["rm", &id]);
    assert!(copied.status.success(), "{}", text(&copied));
    let mut shipped: Vec<String> = std::fs::read_dir(&copy)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    shipped.sort();
    assert_eq!(
        shipped,
        [
            "fan_out.wasm",
            "redact_fields.wasm",
            "route_by_type.wasm",
            "route_by_type_batch.wasm"
        ]
    );
    let _ = std::fs::remove_dir_all(&copy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_stream_hands_over_to_a_second_container() {
    let Some(image) = image() else { return };
    init_logging();
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let config = config_for_image(&db.url, &nats.url());
    let mount = format!("{}:/etc/switchyard/switchyard.toml:ro", config.display());
    let migrated = run(&[
        "run",
        "--rm",
        "--network",
        "host",
        "--read-only",
        "-v",
        &mount,
        &image,
        "migrate",
        "--config",
        "/etc/switchyard/switchyard.toml",
    ]);
    assert!(
        migrated.status.success(),
        "migrate in the image: {}",
        text(&migrated)
    );

    let expected = write_orders(&db.pool, 100, 100, 4).await;
    assert_eq!(expected.len(), 10_000);
    let first = Container::relay(&image, "sy-first", &config);
    // A process in the container, not root: what `ps` shows for it.
    let user = run(&["top", &first.0, "user"]);
    let user = text(&user);
    assert!(!user.lines().skip(1).any(|line| line.trim() == "root"), "{user}");
    assert_eq!(first.inspect("{{.HostConfig.ReadonlyRootfs}}"), "true");

    eventually("the first relay publishing", Duration::from_secs(60), || async {
        (count_status(&db.pool, "published").await >= 1_000).then_some(())
    })
    .await;
    let second = Container::relay(&image, "sy-second", &config);
    // SIGTERM mid-stream, SIGKILL only past the grace given.
    let grace = Duration::from_secs(40);
    let stopping = Instant::now();
    let stopped = run(&["stop", "-t", &grace.as_secs().to_string(), &first.0]);
    let took = stopping.elapsed();
    assert!(stopped.status.success(), "{}", text(&stopped));
    assert!(!first.running());
    // Exit code 0: the relay exited on its own within the grace (the kill
    // past it would give 137).
    assert_eq!(
        first.inspect("{{.State.ExitCode}}"),
        "0",
        "a clean exit, not the kill past the grace: {}",
        first.logs()
    );
    let left = count_status(&db.pool, "published").await;
    assert!(left < 10_000, "SIGTERM came mid-stream ({left} published)");

    all_published(&db.pool, 10_000, Duration::from_secs(120)).await;
    assert!(second.running(), "{}", second.logs());
    let verdict = verify(&nats.read_stream("ORDERS").await, &expected);
    assert_eq!((verdict.distinct, verdict.duplicates), (10_000, 0), "{verdict:?}");
    eprintln!(
        "first relay exited {took:?} after SIGTERM with {left} of 10000 published; the second took over"
    );
    let _ = std::fs::remove_file(config);
}

/// A Python plugin (12 to 18 MB: past what a ConfigMap holds) reaches the
/// container from the registry, pulled over TLS with a login, and routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_plugin_pulled_from_the_registry_routes_in_the_container() {
    use switchyard_tests::config::{Plugin, Target, TestConfig, table};
    use switchyard_tests::registry::{Registry, USER};
    let Some(image) = image() else { return };
    init_logging();
    let registry = Registry::shared();
    let python = switchyard_tests::workspace_root().join("plugins/target/python/route_by_type.wasm");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/plugin-toolchains.sh",
        python.display()
    );
    let reference = registry.reference(
        &format!("test-{}/python-router", uuid::Uuid::new_v4().simple()),
        "live",
    );
    let digest = registry.push(env!("CARGO_BIN_EXE_relay-process"), &python, &reference);

    // What the pod's Secret mounts: the login and the CA, readable by the
    // container's user.
    let secrets = std::env::temp_dir().join(format!("sy-image-registry-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&secrets).unwrap();
    std::fs::copy(registry.password_file(), secrets.join("password")).unwrap();
    std::fs::copy(
        switchyard_tests::postgres::tls_file("ca.pem"),
        secrets.join("ca.pem"),
    )
    .unwrap();
    for file in ["password", "ca.pem"] {
        std::fs::set_permissions(
            secrets.join(file),
            std::os::unix::fs::PermissionsExt::from_mode(0o644),
        )
        .unwrap();
    }
    std::fs::set_permissions(&secrets, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream("ORDERS", &["orders.>"]).await;
    let settings = table(&[
        ("username", toml::Value::String(USER.into())),
        (
            "password",
            table(&[(
                "file",
                toml::Value::String("/run/secrets/registry/password".into()),
            )]),
        ),
        (
            "ca_file",
            toml::Value::String("/run/secrets/registry/ca.pem".into()),
        ),
    ]);
    let config = TestConfig::new(&db.url)
        .database("max_connections", 8)
        .set("admin", "listen", "127.0.0.1:0")
        .plugin(
            Plugin::new("router", std::path::Path::new(&reference))
                .set("registry", settings)
                // An interpreter's first calls are slow on a loaded machine.
                .set("timeout_ms", 5000)
                .to("events", "orders.{event_type}"),
        )
        .target("events", Target::nats(&nats.url()))
        .set("relay", "lease_duration_ms", 30_000)
        .toml();
    let path = secrets.join("switchyard.toml");
    std::fs::write(&path, config).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();

    let expected = write_orders(&db.pool, 10, 5, 2).await;
    let container = Container::relay_with(
        &image,
        "sy-python",
        &path,
        &[format!("{}:/run/secrets/registry:ro", secrets.display())],
    );
    // A cold cache compiles the interpreter: a minute or more on two cores.
    eventually(
        "every event published by the pulled plugin",
        Duration::from_secs(300),
        || async {
            assert!(container.running(), "{}", container.logs());
            (count_status(&db.pool, "published").await == expected.len() as i64).then_some(())
        },
    )
    .await;
    let logs = container.logs();
    assert!(
        logs.contains("Plugin pulled.") && logs.contains(&digest),
        "{logs}"
    );
    let received = nats.read_stream("ORDERS").await;
    let counted = switchyard_tests::orders::tally(&received, &expected);
    assert_eq!(
        (
            counted.received,
            counted.lost,
            counted.duplicates,
            counted.reordered
        ),
        (expected.len(), 0, 0, 0),
        "{counted:?}"
    );
    let version = switchyard::plugin::content_hash(&std::fs::read(&python).unwrap());
    assert!(
        received
            .iter()
            .all(|m| m.header("Switchyard-Plugin") == Some(format!("router@{version}").as_str())),
        "routed by the Python build pulled from the registry"
    );
    drop(container);
    let _ = std::fs::remove_dir_all(secrets);
}
