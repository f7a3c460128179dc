//! Plugins from an OCI registry (distribution over TLS with htpasswd login):
//! pushed with `switchyard plugin push`, pulled and verified by digest,
//! swapped by tag under load, served from the cache while the registry is
//! down, with wrong, rotated and pinned credentials and references.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_tests::config::{Plugin, Target, TestConfig, strings};
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::write_orders;
use switchyard_tests::plugins::{plugin, with_custom_section};
use switchyard_tests::postgres::{Outbox, count_status, fresh_db};
use switchyard_tests::registry::Registry;
use switchyard_tests::relay::InProcess;
use switchyard_tests::workload::{Shape, paced_writer};
use switchyard_tests::{eventually, init_logging};

const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");
const STREAM: &str = "ORDERS";

fn temp_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sy-{what}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A fresh outbox database, a NATS server with the orders stream, and a
/// scratch directory named for `what`.
async fn outbox_and_stream(what: &str) -> (switchyard_tests::postgres::TestDb, NatsServer, PathBuf) {
    let db = fresh_db().await;
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    (db, nats, temp_dir(what))
}

/// A repository name of this test's own on a shared registry.
fn repository() -> String {
    format!("test-{}/router", uuid::Uuid::new_v4().simple())
}

/// `route_by_type` (or its batch build) made distinct by a custom section,
/// written to a file to push.
fn variant(dir: &Path, n: u32) -> (PathBuf, String) {
    let base = std::fs::read(plugin(if n.is_multiple_of(2) {
        "route_by_type_batch"
    } else {
        "route_by_type"
    }))
    .unwrap();
    let bytes = with_custom_section(&base, n);
    let path = dir.join(format!("router-{n}.wasm"));
    std::fs::write(&path, &bytes).unwrap();
    (path, switchyard::plugin::content_hash(&bytes))
}

/// A relay routing orders to NATS through the plugin at `reference`, its
/// cache in `cache`.
fn config(db: &str, nats: &str, reference: &str, registry: toml::Value, cache: &Path) -> TestConfig {
    TestConfig::new(db)
        .database("max_connections", 8)
        .set("plugin_runtime", "cache_dir", cache.display().to_string())
        .plugin(
            Plugin::new("router", Path::new(reference))
                .set("aggregate_types", strings(&["order"]))
                .set("registry", registry)
                .to("events", "orders.{event_type}"),
        )
        .target("events", Target::nats(nats))
}

fn serving(relay: &switchyard::Relay) -> Option<String> {
    relay
        .plugins()
        .slot("router")?
        .current()
        .map(|v| v.version().to_string())
}

fn state(relay: &switchyard::Relay) -> switchyard::plugin::OciState {
    relay
        .plugins()
        .slot("router")
        .unwrap()
        .oci()
        .expect("a registry plugin")
}

async fn goes_live(relay: &switchyard::Relay, hash: &str, what: &str) {
    eventually(what, Duration::from_secs(30), || async {
        (serving(relay).as_deref() == Some(hash)).then_some(())
    })
    .await;
}

/// Loads the plugin at `reference` as a starting relay does (strict: one
/// never pulled is an error), logging in with the registry's password and
/// caching in `cache`; no broker is reached.
async fn load_from(
    registry: &Registry,
    db: &str,
    reference: &str,
    cache: &Path,
) -> anyhow::Result<switchyard::plugin::Plugins> {
    let settings = registry.plugin_settings(&registry.password_file(), 1);
    let config = config(db, "nats://127.0.0.1:1", reference, settings, cache).parse();
    switchyard::runtime::load_plugins(&config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_plugins_run_and_tag_moves_under_load_lose_nothing() {
    init_logging();
    let registry = Registry::shared();
    let (db, nats, dir) = outbox_and_stream("registry-load").await;
    let reference = registry.reference(&repository(), "live");
    let (first, first_hash) = variant(&dir, 1);
    let first_digest = registry.push(SWITCHYARD, &first, &reference);
    let settings = registry.plugin_settings(&registry.password_file(), 1);
    let config = config(&db.url, &nats.url(), &reference, settings, &dir.join("cache")).parse();
    let running = InProcess::start(&config).await;
    assert_eq!(serving(&running.relay).as_deref(), Some(first_hash.as_str()));
    assert_eq!(
        state(&running.relay).digest.as_deref(),
        Some(first_digest.as_str())
    );

    // A service's writes: transactions over several orders, one to three
    // events of each, 40 a second across the tag moves.
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = paced_writer(&db.pool, Shape::rows(Outbox::Switchyard), 50, 40, stop.clone());
    let mut versions = HashSet::from([first_hash]);
    let mut digest = first_digest;
    for n in 2..=4 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (file, hash) = variant(&dir, n);
        digest = registry.push(SWITCHYARD, &file, &reference);
        goes_live(&running.relay, &hash, &format!("version {n} after its tag moved")).await;
        versions.insert(hash);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    let expected = writer.await.unwrap();
    let written = expected.len();
    eventually("every row published", Duration::from_secs(120), || async {
        (count_status(&db.pool, "published").await == written as i64).then_some(())
    })
    .await;
    let source = state(&running.relay);
    assert_eq!(
        source.digest.as_deref(),
        Some(digest.as_str()),
        "status shows the digest serving"
    );
    assert_eq!(source.registry_error, None);
    assert_eq!(source.reference, reference);
    let metrics = running.relay.metrics().render();
    assert!(
        metrics.contains(&format!("switchyard_plugin_source_info{{plugin=\"router\",reference=\"{reference}\",digest=\"{digest}\"}} 1")),
        "the metrics show the reference and digest:\n{metrics}"
    );
    running.stop().await;

    let received = nats.read_stream(STREAM).await;
    assert_eq!(received.len(), written, "each event published once");
    let mut seen = HashSet::new();
    let mut next: HashMap<String, u64> = HashMap::new();
    let mut used = HashSet::new();
    for message in &received {
        let id = message.header("Switchyard-Event-Id").unwrap().to_string();
        assert!(seen.insert(id.clone()), "event {id} published twice");
        let version = message
            .header("Switchyard-Plugin")
            .unwrap()
            .strip_prefix("router@")
            .unwrap();
        assert!(versions.contains(version), "unknown version {version}");
        used.insert(version.to_string());
        let want = &expected[&id];
        let seq = next.entry(want.aggregate_id.clone()).or_insert(0);
        assert_eq!(want.seq, *seq, "order kept across tag moves");
        *seq += 1;
    }
    assert!(
        used.len() >= 3,
        "events were routed by several pulled versions: {used:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_component_under_the_tag_is_refused_and_the_old_one_kept() {
    init_logging();
    let registry = Registry::shared();
    let (db, nats, dir) = outbox_and_stream("registry-broken").await;
    let reference = registry.reference(&repository(), "live");
    let (good, good_hash) = variant(&dir, 1);
    registry.push(SWITCHYARD, &good, &reference);
    let settings = registry.plugin_settings(&registry.password_file(), 1);
    let running =
        InProcess::start(&config(&db.url, &nats.url(), &reference, settings, &dir.join("cache")).parse())
            .await;

    // A component of the right world whose `init` traps: `plugin push`
    // takes it (it compiles and type-checks), the relay must not.
    let broken = registry.push(SWITCHYARD, &plugin("init_trap"), &reference);
    let slot = || running.relay.plugins().slot("router").unwrap();
    eventually("the broken digest refused", Duration::from_secs(30), || async {
        (slot().rejected() == 1).then_some(())
    })
    .await;
    assert_eq!(
        serving(&running.relay).as_deref(),
        Some(good_hash.as_str()),
        "the old version stays"
    );
    assert_ne!(state(&running.relay).digest.as_deref(), Some(broken.as_str()));
    let (_, last) = slot().last_result();
    assert!(
        matches!(&last, switchyard::plugin::ReloadResult::Rejected { reason } if reason.contains("init")),
        "the refusal says why: {last:?}"
    );
    // Refused once, not pulled and judged again at every check.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(slot().rejected(), 1);

    let expected = write_orders(&db.pool, 5, 4, 1).await;
    eventually("the old version publishes", Duration::from_secs(60), || async {
        (count_status(&db.pool, "published").await == expected.len() as i64).then_some(())
    })
    .await;
    let (fixed, fixed_hash) = variant(&dir, 3);
    registry.push(SWITCHYARD, &fixed, &reference);
    goes_live(&running.relay, &fixed_hash, "a good push after the broken one").await;
    running.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_blob_is_refused_and_named() {
    init_logging();
    let registry = Registry::own().await;
    let db = fresh_db().await;
    let dir = temp_dir("registry-tampered");
    let reference = registry.reference("team/router", "1");
    let (file, _) = variant(&dir, 1);
    registry.push(SWITCHYARD, &file, &reference);
    let bytes = std::fs::read(&file).unwrap();
    let digest = format!("sha256:{}", sha256_hex(&bytes));
    let blob = registry.blob_file(&digest);
    let mut tampered = std::fs::read(&blob).unwrap();
    let middle = tampered.len() / 2;
    tampered[middle] ^= 0xff;
    std::fs::write(&blob, &tampered).unwrap();

    let error = load_from(&registry, &db.url, &reference, &dir.join("cache"))
        .await
        .err()
        .expect("a tampered blob is refused");
    let message = format!("{error:#}");
    assert!(
        message.contains("does not match its digest") && message.contains(&digest),
        "the refusal names the digest: {message}"
    );
    let cached = std::fs::read_dir(dir.join("cache"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert!(
        !dir.join("cache/oci/blobs/sha256")
            .join(format!("{}.wasm", &digest[7..]))
            .exists(),
        "nothing tampered is kept ({cached} entries)"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A tag moved to a blob that does not match its digest, under a running
/// relay: refused once (counted, the reason kept), the serving version
/// stays, the registry is not called unreachable, and the blob is not
/// downloaded again at each check, only once the tag moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_blob_under_a_moved_tag_is_refused_once_and_not_pulled_again() {
    init_logging();
    let registry = Registry::own().await;
    let (db, nats, dir) = outbox_and_stream("registry-tampered-moved").await;
    let reference = registry.reference("team/router", "live");
    let (good, good_hash) = variant(&dir, 1);
    registry.push(SWITCHYARD, &good, &reference);
    let settings = registry.plugin_settings(&registry.password_file(), 1);
    let running =
        InProcess::start(&config(&db.url, &nats.url(), &reference, settings, &dir.join("cache")).parse())
            .await;
    goes_live(&running.relay, &good_hash, "the first digest").await;

    let (second, _) = variant(&dir, 3);
    let bytes = std::fs::read(&second).unwrap();
    let layer = format!("sha256:{}", sha256_hex(&bytes));
    let blob = registry.blob_file(&layer);
    // Pushed, then spoiled in the registry's storage before any check can
    // pull it: the tag now names bytes that are not what it says.
    let mut tampered = bytes.clone();
    let middle = tampered.len() / 2;
    tampered[middle] ^= 0xff;
    registry.push(SWITCHYARD, &second, &reference);
    std::fs::write(&blob, &tampered).unwrap();

    let slot = || running.relay.plugins().slot("router").unwrap();
    eventually("the tampered digest refused", Duration::from_secs(30), || async {
        (slot().rejected() == 1).then_some(())
    })
    .await;
    let (_, last) = slot().last_result();
    assert!(
        matches!(&last, switchyard::plugin::ReloadResult::Rejected { reason } if reason.contains("does not match its digest")),
        "the refusal says why: {last:?}"
    );
    let downloads = registry.blob_downloads(&layer);
    assert!(downloads >= 1, "the relay downloaded the blob it refused");
    // Five tag checks later: the same count, no second download, and the
    // registry, which answered every check, is not reported unreachable.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(slot().rejected(), 1, "refused once, not at every check");
    assert_eq!(
        registry.blob_downloads(&layer),
        downloads,
        "the refused blob was downloaded again"
    );
    assert_eq!(state(&running.relay).registry_error, None);
    assert_eq!(serving(&running.relay).as_deref(), Some(good_hash.as_str()));
    assert!(
        running
            .relay
            .metrics()
            .render()
            .contains("switchyard_plugin_reloads_rejected_total{plugin=\"router\"} 1"),
        "the metric counts the refusal"
    );

    // The tag moves on: the new digest is pulled and goes live.
    let (fixed, fixed_hash) = variant(&dir, 5);
    registry.push(SWITCHYARD, &fixed, &reference);
    goes_live(&running.relay, &fixed_hash, "a good push after the tampered one").await;
    running.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Pushes `component` as another tool would: `layer_type` and a config
/// blob of `config_type`, with `annotations` on the manifest.
async fn push_as(
    registry: &Registry,
    reference: &str,
    component: Vec<u8>,
    (layer_type, config_type, config): (&str, &str, serde_json::Value),
    annotations: Option<std::collections::BTreeMap<String, String>>,
) {
    use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, Config, ImageLayer};
    switchyard::tls::install_provider();
    let client = oci_client::Client::new(ClientConfig {
        extra_root_certificates: vec![Certificate {
            encoding: CertificateEncoding::Pem,
            data: std::fs::read(switchyard_tests::postgres::tls_file("ca.pem")).unwrap(),
        }],
        ..ClientConfig::default()
    });
    let target: oci_client::Reference = reference.strip_prefix("oci://").unwrap().parse().unwrap();
    let password = std::fs::read_to_string(registry.password_file()).unwrap();
    let auth = oci_client::secrets::RegistryAuth::Basic(
        switchyard_tests::registry::USER.into(),
        password.trim().into(),
    );
    let layer = ImageLayer::new(component, layer_type.into(), None);
    let config = Config::new(serde_json::to_vec(&config).unwrap(), config_type.into(), None);
    let manifest =
        oci_client::manifest::OciImageManifest::build(std::slice::from_ref(&layer), &config, annotations);
    client
        .push(&target, &[layer], config, &auth, Some(manifest))
        .await
        .unwrap_or_else(|e| panic!("push {reference}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifacts_in_the_layouts_other_tools_write_are_pulled() {
    init_logging();
    let registry = Registry::shared();
    let db = fresh_db().await;
    let dir = temp_dir("registry-layouts");
    let repository = repository();
    let (file, hash) = variant(&dir, 1);
    let bytes = std::fs::read(&file).unwrap();
    let layer_digest = format!("sha256:{}", sha256_hex(&bytes));
    // `wkg oci push` (wasm-pkg-tools, through oci-wasm): the Wasm OCI
    // artifact layout with its config fields and the manifest annotations
    // it copies from the component's metadata.
    let wkg = (
        "application/wasm",
        "application/vnd.wasm.config.v0+json",
        serde_json::json!({
            "created": "2026-11-29T12:00:00Z",
            "author": null,
            "architecture": "wasm",
            "os": "wasip2",
            "layerDigests": [layer_digest],
            "component": {
                "exports": ["switchyard:plugin/router@0.1.0"],
                "imports": [],
                "target": null
            }
        }),
    );
    let annotations = std::collections::BTreeMap::from([
        (
            "org.opencontainers.image.version".to_string(),
            "1.4.0".to_string(),
        ),
        (
            "org.opencontainers.image.description".to_string(),
            "orders router".to_string(),
        ),
    ]);
    // The older layer type (wasm-to-oci, Krustlet), config left empty.
    let older = (
        "application/vnd.wasm.content.layer.v1+wasm",
        "application/vnd.wasm.config.v1+json",
        serde_json::json!({}),
    );
    for (tag, layout, annotations) in [("wkg", wkg, Some(annotations)), ("older", older, None)] {
        let reference = registry.reference(&repository, tag);
        push_as(&registry, &reference, bytes.clone(), layout, annotations).await;
        let plugins = load_from(&registry, &db.url, &reference, &dir.join(tag))
            .await
            .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
        let serving = plugins
            .slot("router")
            .and_then(|slot| slot.current())
            .map(|v| v.version().to_string());
        assert_eq!(serving.as_deref(), Some(hash.as_str()), "{tag}");
    }

    // An image, not a component: refused, naming the layers it has.
    let reference = registry.reference(&repository, "image");
    let image = (
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.config.v1+json",
        serde_json::json!({"architecture": "amd64", "os": "linux"}),
    );
    push_as(&registry, &reference, bytes, image, None).await;
    let error = load_from(&registry, &db.url, &reference, &dir.join("image"))
        .await
        .err()
        .expect("an image is refused");
    let message = format!("{error:#}");
    assert!(
        message.contains("has no application/wasm layer")
            && message.contains("application/vnd.oci.image.layer.v1.tar+gzip"),
        "{message}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_serves_while_the_registry_is_down_or_frozen_and_polling_says_so() {
    init_logging();
    let mut registry = Registry::own().await;
    let (db, nats, dir) = outbox_and_stream("registry-down").await;
    let cache = dir.join("cache");
    let reference = registry.reference("team/router", "live");
    let (first, first_hash) = variant(&dir, 1);
    let first_digest = registry.push(SWITCHYARD, &first, &reference);
    let mut settings = registry.plugin_settings(&registry.password_file(), 1);
    // A bound short enough to see it pass while the registry is frozen, and
    // long enough for a login and a pull by a debug build on a loaded
    // machine (up to 2 s seen).
    settings
        .as_table_mut()
        .unwrap()
        .insert("timeout_ms".into(), toml::Value::Integer(5000));
    let config = config(&db.url, &nats.url(), &reference, settings, &cache).parse();
    let first_start = InProcess::start(&config).await;
    assert_eq!(
        serving(&first_start.relay).as_deref(),
        Some(first_hash.as_str()),
        "pulled while the registry is up: {:?}",
        state(&first_start.relay)
    );
    first_start.stop().await;

    // Down at start: the last good digest serves, the relay is ready and
    // says where the plugin came from.
    registry.stop();
    let running = InProcess::start(&config).await;
    assert_eq!(serving(&running.relay).as_deref(), Some(first_hash.as_str()));
    let source = state(&running.relay);
    assert!(source.from_cache, "{source:?}");
    assert_eq!(source.digest.as_deref(), Some(first_digest.as_str()));
    assert!(source.registry_error.is_some(), "{source:?}");
    let readiness = switchyard::admin::readiness(&running.relay).await;
    assert!(
        readiness.ready,
        "ready on the cached digest: {:?}",
        readiness.plugins
    );
    let expected = write_orders(&db.pool, 5, 4, 1).await;
    eventually(
        "published while the registry is down",
        Duration::from_secs(60),
        || async { (count_status(&db.pool, "published").await == expected.len() as i64).then_some(()) },
    )
    .await;

    // A relay that never pulled the reference has nothing to serve: up,
    // not ready, until the registry answers.
    let mut never = config.clone();
    never.plugin_runtime.cache_dir = Some(dir.join("empty-cache"));
    let waiting = InProcess::start(&never).await;
    assert_eq!(serving(&waiting.relay), None);
    assert!(!switchyard::admin::readiness(&waiting.relay).await.ready);

    registry.start().await;
    let (second, second_hash) = variant(&dir, 2);
    registry.push(SWITCHYARD, &second, &reference);
    goes_live(
        &running.relay,
        &second_hash,
        "the new digest once the registry is back",
    )
    .await;
    goes_live(
        &waiting.relay,
        &second_hash,
        "the first pull once the registry is back",
    )
    .await;
    assert_eq!(state(&running.relay).registry_error, None);
    assert!(switchyard::admin::readiness(&waiting.relay).await.ready);
    waiting.stop().await;

    // Down while polling: it keeps serving and says so.
    registry.stop();
    eventually("the registry's error shown", Duration::from_secs(30), || async {
        state(&running.relay).registry_error.is_some().then_some(())
    })
    .await;
    assert!(
        running
            .relay
            .metrics()
            .render()
            .contains("switchyard_plugin_registry_up{plugin=\"router\"} 0")
    );
    let more = write_orders(&db.pool, 5, 4, 1).await;
    eventually(
        "published while polling fails",
        Duration::from_secs(60),
        || async {
            (count_status(&db.pool, "published").await == (expected.len() + more.len()) as i64).then_some(())
        },
    )
    .await;
    assert_eq!(serving(&running.relay).as_deref(), Some(second_hash.as_str()));

    // Frozen (connections taken, nothing answered): each check ends at the
    // registry's timeout, a relay starting meanwhile starts from the cache,
    // and neither is held up in stopping by a request left hanging.
    registry.start().await;
    eventually("the registry answers again", Duration::from_secs(30), || async {
        state(&running.relay).registry_error.is_none().then_some(())
    })
    .await;
    registry.freeze();
    eventually(
        "the frozen registry's timeout shown",
        Duration::from_secs(30),
        || async {
            state(&running.relay)
                .registry_error
                .filter(|error| error.contains("did not answer within 5000 ms"))
        },
    )
    .await;
    let starting = std::time::Instant::now();
    let restarted = InProcess::start(&config).await;
    assert!(
        starting.elapsed() < Duration::from_secs(20),
        "a start held {:?} by a frozen registry",
        starting.elapsed()
    );
    assert_eq!(serving(&restarted.relay).as_deref(), Some(second_hash.as_str()));
    assert!(state(&restarted.relay).from_cache);
    let frozen = write_orders(&db.pool, 5, 4, 1).await;
    let total = (expected.len() + more.len() + frozen.len()) as i64;
    eventually(
        "published while the registry is frozen",
        Duration::from_secs(60),
        || async { (count_status(&db.pool, "published").await == total).then_some(()) },
    )
    .await;
    let stopping = std::time::Instant::now();
    restarted.stop().await;
    running.stop().await;
    assert!(
        stopping.elapsed() < Duration::from_secs(15),
        "stopping took {:?} beside a frozen registry",
        stopping.elapsed()
    );
    registry.thaw();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_named_and_never_shown() {
    init_logging();
    let registry = Registry::shared();
    let dir = temp_dir("registry-credentials");
    let reference = registry.reference(&repository(), "1");
    let (file, _) = variant(&dir, 1);
    let wrong = dir.join("wrong-password");
    std::fs::write(&wrong, "not-the-password-8c1f\n").unwrap();

    let output = registry.push_with(SWITCHYARD, &file, &reference, &wrong);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("the registry refused the credentials (user name and password)"),
        "{stderr}"
    );
    assert!(!stderr.contains("not-the-password-8c1f"), "{stderr}");

    registry.push(SWITCHYARD, &file, &reference);
    let settings = registry.plugin_settings(&wrong, 1);
    let config = config(
        "postgres://127.0.0.1:1/none",
        "nats://127.0.0.1:1",
        &reference,
        settings,
        &dir.join("cache"),
    )
    .parse();
    let error = format!(
        "{:#}",
        switchyard::runtime::load_plugins(&config)
            .await
            .err()
            .expect("refused")
    );
    assert!(
        error.contains(&reference) && error.contains("refused the credentials"),
        "{error}"
    );
    assert!(!error.contains("not-the-password-8c1f"), "{error}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_password_is_read_again_and_used() {
    init_logging();
    let mut registry = Registry::own().await;
    let (db, nats, dir) = outbox_and_stream("registry-rotation").await;
    let reference = registry.reference("team/router", "live");
    let (first, first_hash) = variant(&dir, 1);
    registry.push(SWITCHYARD, &first, &reference);
    let mounted = dir.join("password");
    std::fs::copy(registry.password_file(), &mounted).unwrap();
    let settings = registry.plugin_settings(&mounted, 1);
    let running =
        InProcess::start(&config(&db.url, &nats.url(), &reference, settings, &dir.join("cache")).parse())
            .await;
    assert_eq!(serving(&running.relay).as_deref(), Some(first_hash.as_str()));

    // The registry takes only the new password now; the pipeline pushes with it.
    registry.rotate().await;
    let (second, second_hash) = variant(&dir, 2);
    let output = registry.push_with(SWITCHYARD, &second, &reference, &registry.rotated_password_file());
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    eventually("the old password refused", Duration::from_secs(30), || async {
        state(&running.relay)
            .registry_error
            .filter(|e| e.contains("refused the credentials"))
    })
    .await;
    assert_eq!(serving(&running.relay).as_deref(), Some(first_hash.as_str()));

    // The secret mount changes (as Kubernetes updates a secret's file).
    let rotated = std::fs::read(registry.rotated_password_file()).unwrap();
    std::fs::write(dir.join("password.new"), rotated).unwrap();
    std::fs::rename(dir.join("password.new"), &mounted).unwrap();
    goes_live(&running.relay, &second_hash, "the push after the rotation").await;
    assert_eq!(state(&running.relay).registry_error, None);
    running.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_bearer_token_is_read_again_and_used() {
    use switchyard_tests::config::{path, table};
    init_logging();
    let mut registry = Registry::own_with_tokens().await;
    let (db, nats, dir) = outbox_and_stream("registry-token").await;
    let repository = "team/router";
    let reference = registry.reference(repository, "live");
    // The mounted token, as a secret's file is updated: written aside,
    // renamed over.
    let token_file = dir.join("token");
    let mount = |token: String| {
        std::fs::write(dir.join("token.new"), token).unwrap();
        std::fs::rename(dir.join("token.new"), &token_file).unwrap();
    };
    mount(registry.token(repository));
    let push = |registry: &Registry, file: &Path| {
        let output = registry.push_with_token(SWITCHYARD, file, &reference, &token_file);
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    let (first, first_hash) = variant(&dir, 1);
    push(&registry, &first);
    let settings = table(&[
        ("token", table(&[("file", path(&token_file))])),
        (
            "ca_file",
            toml::Value::String(switchyard_tests::postgres::tls_file("ca.pem")),
        ),
        ("refresh_seconds", toml::Value::Integer(1)),
    ]);
    let running =
        InProcess::start(&config(&db.url, &nats.url(), &reference, settings, &dir.join("cache")).parse())
            .await;
    assert_eq!(serving(&running.relay).as_deref(), Some(first_hash.as_str()));

    // The issuer's signing key rotates: the token in the mount is refused,
    // named as a bearer token, never shown.
    let old_token = std::fs::read_to_string(&token_file).unwrap();
    registry.rotate_token_key().await;
    let refused = eventually("the old token refused", Duration::from_secs(30), || async {
        state(&running.relay)
            .registry_error
            .filter(|e| e.contains("refused the credentials (bearer token)"))
    })
    .await;
    let signature = old_token.rsplit('.').next().unwrap();
    assert!(!refused.contains(signature), "{refused}");
    assert!(
        !running.relay.metrics().render().contains(signature),
        "the token is in the metrics"
    );
    let expected = write_orders(&db.pool, 5, 4, 1).await;
    eventually(
        "published on the plugin it has",
        Duration::from_secs(60),
        || async { (count_status(&db.pool, "published").await == expected.len() as i64).then_some(()) },
    )
    .await;

    // The new token lands in the mount: the next check uses it.
    mount(registry.token(repository));
    eventually("the registry answers again", Duration::from_secs(30), || async {
        state(&running.relay).registry_error.is_none().then_some(())
    })
    .await;
    let (second, second_hash) = variant(&dir, 2);
    push(&registry, &second);
    goes_live(&running.relay, &second_hash, "the push after the rotation").await;
    running.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_digest_reference_stays_pinned_when_the_tag_moves() {
    init_logging();
    let registry = Registry::shared();
    let (db, nats, dir) = outbox_and_stream("registry-pinned").await;
    let repository = repository();
    let tag = registry.reference(&repository, "live");
    let (first, first_hash) = variant(&dir, 1);
    let digest = registry.push(SWITCHYARD, &first, &tag);
    let pinned = format!("oci://{}/{repository}@{digest}", registry.host);
    let settings = registry.plugin_settings(&registry.password_file(), 1);
    let running =
        InProcess::start(&config(&db.url, &nats.url(), &pinned, settings, &dir.join("cache")).parse()).await;

    let (second, _) = variant(&dir, 2);
    registry.push(SWITCHYARD, &second, &tag);
    // Three check intervals: a tag would have moved by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(serving(&running.relay).as_deref(), Some(first_hash.as_str()));
    assert_eq!(state(&running.relay).digest.as_deref(), Some(digest.as_str()));
    let slot = running.relay.plugins().slot("router").unwrap();
    assert_eq!((slot.reloads(), slot.rejected()), (0, 0));
    running.stop().await;

    // `plugin test` runs what the reference names, pulled and checked.
    let event = dir.join("event.json");
    std::fs::write(
        &event,
        r#"{"aggregate_type": "order", "aggregate_id": "o-1", "event_type": "OrderPlaced", "payload": {"total": 5}}"#,
    )
    .unwrap();
    let output = std::process::Command::new(SWITCHYARD)
        .args(["plugin", "test", &pinned, "--event"])
        .arg(&event)
        .args([
            "--config",
            "target=events",
            "--config",
            "topic=orders.{event_type}",
        ])
        .env("SWITCHYARD_REGISTRY_USERNAME", switchyard_tests::registry::USER)
        .env("SWITCHYARD_REGISTRY_PASSWORD_FILE", registry.password_file())
        .env(
            "SWITCHYARD_REGISTRY_CA_FILE",
            switchyard_tests::postgres::tls_file("ca.pem"),
        )
        .env("XDG_CACHE_HOME", dir.join("cli-cache"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("orders.OrderPlaced"), "{stdout}");
    let _ = std::fs::remove_dir_all(dir);
}
