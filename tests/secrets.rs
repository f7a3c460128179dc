//! Secrets never reach the relay's output. A NATS URL's login logs the
//! relay in; and a relay process whose every client logs in with a
//! password of its own, run at `trace` (and `debug`), writes none of them
//! into its log: not as typed, not percent-encoded, not in an HTTP basic
//! login. The clients: NATS (async-nats), Kafka SASL (librdkafka, its own
//! debug output on), RabbitMQ (lapin), PostgreSQL (sqlx), MariaDB (sqlx,
//! and mysql_async reading the binary log), the plugin registry
//! (oci-client). Pub/Sub is not among them: its emulator takes no
//! credentials.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_tests::config::{Plugin, Target, TestConfig, routes};
use switchyard_tests::kafka::KafkaServer;
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{verify, write_orders};
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::plugins::plugin;
use switchyard_tests::postgres::{Outbox, admin_pool, fresh_tls_db, tls_file, tls_server_url};
use switchyard_tests::rabbitmq::RabbitMq;
use switchyard_tests::registry::{self, Registry};
use switchyard_tests::relay::{InProcess, Process, Settings, example};
use switchyard_tests::{cli, eventually, init_logging};

const STREAM: &str = "ORDERS";
const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");

/// A secret no other run holds: `what`, then a fresh uuid.
fn unique(what: &str) -> String {
    format!("{what}-{}", uuid::Uuid::new_v4().simple())
}

/// `password` percent-encoded as a URL's userinfo carries it.
fn percent_encoded(password: &str) -> String {
    let mut url = url::Url::parse("x://host").unwrap();
    url.set_password(Some(password)).unwrap();
    url.password().unwrap().to_string()
}

/// `url` logging in as `user` with `password`.
fn with_login(url: &str, user: &str, password: &str) -> String {
    let mut url = url::Url::parse(url).unwrap();
    url.set_username(user).unwrap();
    url.set_password(Some(password)).unwrap();
    url.to_string()
}

/// A nats-server that admits `user` with a password of its own only, with
/// the orders stream; the password.
async fn nats_with_login(user: &str) -> (NatsServer, String) {
    // Characters a URL must percent-encode: the relay decodes them.
    let password = format!("{}/p@ss", unique("nats"));
    let nats = NatsServer::start_with_login(user, &password).await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    (nats, password)
}

async fn stream_holds(nats: &NatsServer, count: u64, seconds: u64) {
    eventually(
        "the events in the stream",
        Duration::from_secs(seconds),
        || async { (nats.stream_len(STREAM).await >= count).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_in_the_nats_url_logs_the_relay_in() {
    init_logging();
    let (nats, password) = nats_with_login("relay").await;
    let db = switchyard_tests::postgres::fresh_db().await;
    let url = with_login(&nats.url(), "relay", &password);
    assert!(url.contains(&percent_encoded(&password)), "{url}");
    let relay = InProcess::start(&example(&Settings::new(&db.url, &url)).parse()).await;
    let expected = write_orders(&db.pool, 20, 3, 2).await;
    stream_holds(&nats, expected.len() as u64, 60).await;
    let verdict = verify(&nats.read_stream(STREAM).await, &expected);
    assert_eq!(verdict.distinct, expected.len());
    relay.stop().await;
}

/// A secret planted in a relay's config: which client it is for, and each
/// form a log line could show it in.
struct Planted {
    client: &'static str,
    forms: Vec<(&'static str, String)>,
}

impl Planted {
    /// `user`'s `password`: as typed, percent-encoded, its unique part
    /// alone (any encoding of the rest), and `user:password` in base64 (an
    /// HTTP basic login).
    fn login(client: &'static str, user: &str, password: &str) -> Planted {
        use base64::Engine;
        let basic = format!("{user}:{password}");
        let mut forms = vec![
            ("as typed", password.to_string()),
            ("percent-encoded", percent_encoded(password)),
            (
                "base64 of user:password",
                base64::engine::general_purpose::STANDARD.encode(&basic),
            ),
            (
                "base64url of user:password",
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&basic),
            ),
        ];
        if let Some(core) = password
            .split(|c: char| !c.is_ascii_alphanumeric())
            .find(|part| part.len() == 32)
        {
            forms.push(("its unique part", core.to_string()));
        }
        Planted { client, forms }
    }
}

/// Fails naming each client whose secret is in the log at `path`, with
/// the lines that hold it; or when the log holds no line of one of
/// `heard` (the clients' targets): then it was not captured whole.
fn assert_no_secret_in(path: &Path, heard: &[&str], planted: &[Planted]) {
    let log = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    for target in heard {
        assert!(
            log.lines().any(|line| line.contains(target)),
            "no line of {target} in the relay's log {}",
            path.display()
        );
    }
    let mut found = Vec::new();
    for secret in planted {
        for (form, text) in &secret.forms {
            for (number, line) in log.lines().enumerate() {
                if line.contains(text.as_str()) {
                    let shown: String = line.chars().take(600).collect();
                    found.push(format!(
                        "{}: its password {form} on line {}: {shown}",
                        secret.client,
                        number + 1
                    ));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "{} lines of the relay's log hold a secret (log: {}):\n{}",
        found.len(),
        path.display(),
        found.join("\n")
    );
}

/// `SWITCHYARD_LOG` for a run at `level`: every client at `level`, the
/// lines of lapin and pgwire-replication the relay turns down by default
/// too; the plugins' compiler (cranelift, in wasmtime), which holds no
/// secret and writes hundreds of megabytes at `trace`, at `info`.
fn filter(level: &str) -> String {
    format!("{level},lapin={level},pgwire_replication={level},cranelift=info,wasmtime=info")
}

/// Runs `switchyard migrate` on `config`, as a deployment does before a
/// relay in replication or binlog mode starts.
async fn migrate(config: &str) {
    let path = std::env::temp_dir().join(format!("sy-secrets-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).unwrap();
    let (code, out, err) = cli(SWITCHYARD, &["migrate", "--config", path.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, 0, "migrate: {out}{err}");
}

/// Where a run's log goes: kept after a failure, for a look.
fn log_file(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("sy-secrets-{what}-{}.log", uuid::Uuid::new_v4().simple()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_reaches_a_trace_log_postgresql_replication_nats_kafka_rabbitmq_registry() {
    every_client_on_postgresql("trace", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_reaches_a_debug_log_postgresql_claim_nats_kafka_rabbitmq_registry() {
    every_client_on_postgresql("debug", false).await;
}

/// A relay process on the TLS cluster as a role with a password (in
/// replication mode its slot's reader too), its one plugin pulled from the
/// registry with its password, sending every event to NATS, Kafka (SASL
/// over TLS) and RabbitMQ, each logging in with a password in the URL or
/// the target: none is in its log at `level`.
async fn every_client_on_postgresql(level: &str, replication: bool) {
    init_logging();
    let db = fresh_tls_db().await;
    // One role per level: the two runs may go at once.
    let role = format!("switchyard_secret_{level}");
    let pg_password = unique("pg");
    let admin = admin_pool(&tls_server_url()).await;
    for statement in [
        "DO $$ BEGIN CREATE ROLE switchyard_rotating NOLOGIN; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$".to_string(),
        format!("DO $$ BEGIN CREATE ROLE {role}; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"),
        // Its members log in with their password (the others are trusted).
        format!("GRANT switchyard_rotating TO {role}"),
        format!("ALTER ROLE {role} LOGIN SUPERUSER REPLICATION PASSWORD '{pg_password}'"),
    ] {
        sqlx::query(&statement).execute(&admin).await.unwrap();
    }
    // The brokers start at once: a RabbitMQ node takes a while.
    let kafka_password = unique("kafka");
    let rabbit_password = unique("rabbit");
    let ((nats, nats_password), kafka, (rabbit, rabbit_url)) = tokio::join!(
        nats_with_login("relay"),
        async {
            let kafka = KafkaServer::start_behind_tls_with_login("relay", &kafka_password).await;
            kafka.create_topic("orders", 3).await;
            kafka
        },
        async {
            let rabbit = RabbitMq::own().await;
            let url = rabbit.add_user("relay", &rabbit_password);
            rabbit.declare("orders", "secret-orders", "orders.#").await;
            (rabbit, url)
        },
    );
    let registry = Registry::shared();
    let registry_password = std::fs::read_to_string(registry.password_file())
        .unwrap()
        .trim()
        .to_string();
    let reference = registry.reference(&format!("test-{}/fanout", uuid::Uuid::new_v4().simple()), "live");
    registry.push(SWITCHYARD, &plugin("fan_out"), &reference);
    let cache = std::env::temp_dir().join(format!("sy-secrets-cache-{}", uuid::Uuid::new_v4().simple()));

    let config = TestConfig::new(&with_login(&db.url, &role, &pg_password))
        .set("plugin_runtime", "cache_dir", cache.display().to_string())
        .plugin(
            Plugin::new("fanout", Path::new(&reference))
                // Tags looked at every second: a login each time.
                .set("registry", registry.plugin_settings(&registry.password_file(), 1))
                .config(
                    "default",
                    routes(&[
                        ("nats", "orders.{event_type}", None),
                        ("kafka", "orders", Some("{aggregate_id}")),
                        ("rabbit", "orders.{event_type}", None),
                    ]),
                ),
        )
        .target(
            "nats",
            Target::nats(&with_login(&nats.url(), "relay", &nats_password)),
        )
        .target(
            "kafka",
            Target::kafka(&kafka.bootstrap())
                .set("password", kafka_password.as_str())
                .property("security.protocol", "sasl_ssl")
                .property("ssl.ca.location", &tls_file("ca.pem"))
                .property("sasl.mechanisms", "SCRAM-SHA-512")
                .property("sasl.username", "relay")
                // Every context of librdkafka's own debug output.
                .property("debug", "all")
                .property("linger.ms", "2"),
        )
        .target("rabbit", Target::rabbitmq(&rabbit_url, "orders"));
    let config = if replication {
        let config = config
            .relay("mode", "replication")
            .set("replication", "slot", db.name.as_str())
            .set("replication", "publication", "switchyard_outbox")
            .toml();
        migrate(&config).await;
        config
    } else {
        config.toml()
    };
    let log = log_file(level);
    let mut relay = Process::spawn_logged(SWITCHYARD, &config, "relay-secrets", &filter(level), &log);
    let expected = write_orders(&db.pool, 10, 2, 2).await;
    let count = expected.len();
    stream_holds(&nats, count as u64, 60).await;
    assert_eq!(
        kafka
            .read_topic("orders", count, Duration::from_secs(60))
            .await
            .len(),
        count
    );
    assert_eq!(
        rabbit
            .drain("secret-orders", count, Duration::from_secs(60))
            .await
            .len(),
        count
    );
    // A few more looks at the registry's tag.
    tokio::time::sleep(Duration::from_secs(2)).await;
    relay.terminate();
    assert_no_secret_in(
        &log,
        // librdkafka's lines carry their facility.
        &[
            "sqlx::",
            "async_nats::",
            "kafka.facility",
            "lapin::",
            "oci_client::",
        ],
        &[
            Planted::login("PostgreSQL (sqlx)", &role, &pg_password),
            Planted::login("NATS (async-nats)", "relay", &nats_password),
            Planted::login("Kafka SASL (librdkafka)", "relay", &kafka_password),
            Planted::login("RabbitMQ (lapin)", "relay", &rabbit_password),
            Planted::login(
                "the plugin registry (oci-client)",
                registry::USER,
                &registry_password,
            ),
        ],
    );
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_dir_all(&cache);
}

/// A relay process in binlog mode on MariaDB, as a user with a password
/// (the pool through sqlx, the binary log's reader through mysql_async),
/// publishing to NATS with the login in the URL: no password in its log
/// at `trace`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_password_reaches_a_trace_log_mariadb_binlog_nats() {
    init_logging();
    let db = TestOutbox::mariadb().await;
    let user = format!("sy_secret_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let maria_password = unique("maria");
    let database = db.url.rsplit('/').next().unwrap().to_string();
    db.execute(&format!(
        "CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY '{maria_password}';
         GRANT ALL PRIVILEGES ON `{database}`.* TO '{user}'@'127.0.0.1';
         GRANT REPLICATION SLAVE ON *.* TO '{user}'@'127.0.0.1'"
    ))
    .await;
    let (nats, nats_password) = nats_with_login("relay").await;
    let settings = Settings::new(
        &with_login(&db.url, &user, &maria_password),
        &with_login(&nats.url(), "relay", &nats_password),
    )
    .relay("mode", "\"replication\"");
    let config = example(&settings).toml();
    migrate(&config).await;

    let log = log_file("binlog");
    let mut relay = Process::spawn_logged(
        SWITCHYARD,
        &config,
        "relay-secrets-binlog",
        &filter("trace"),
        &log,
    );
    let pool = db.service_pool();
    let mut seqs = HashMap::new();
    for i in 0..20 {
        let plan = vec![(i, 1, Outbox::Switchyard)];
        pool.write_committed(&plan, &mut seqs).await.unwrap();
    }
    stream_holds(&nats, 20, 60).await;
    let dumps = pool
        .scalar(&format!(
            "SELECT count(*) FROM information_schema.processlist WHERE user = '{user}' AND command LIKE 'Binlog Dump%'"
        ))
        .await;
    assert!(dumps > 0, "the binary log is read as {user}");
    relay.terminate();
    db.execute(&format!("DROP USER '{user}'@'127.0.0.1'")).await;
    // mysql_async is built without its `tracing` feature: no line of its own.
    assert_no_secret_in(
        &log,
        &["sqlx::", "async_nats::"],
        &[
            Planted::login("MariaDB (sqlx, mysql_async)", &user, &maria_password),
            Planted::login("NATS (async-nats)", "relay", &nats_password),
        ],
    );
    let _ = std::fs::remove_file(&log);
}

/// The webhook target with a bearer token and a signing secret, and the
/// Redis target with an ACL user's password, at `trace`: reqwest, hyper
/// and rustls log, and none of the three secrets is in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_a_trace_log_webhook_and_redis() {
    use switchyard_tests::config::{Plugin, Target, TestConfig, routes, table};
    init_logging();
    let db = switchyard_tests::postgres::fresh_db().await;
    let redis = switchyard_tests::redis::RedisServer::own().await;
    let signing = switchyard_tests::webhook::secret();
    let receiver = switchyard_tests::webhook::Receiver::start(true, false, &[&signing]).await;
    let token = unique("bearer");
    let config = TestConfig::new(&db.url)
        .plugin(
            Plugin::new("fanout", &switchyard_tests::plugins::plugin("fan_out")).config(
                "default",
                routes(&[
                    ("hooks", "orders", None),
                    ("redis", "orders", Some("{aggregate_id}")),
                ]),
            ),
        )
        .target(
            "hooks",
            Target::of("http")
                .set("base_url", format!("{}/in", receiver.url))
                .set("bearer_token", token.as_str())
                .set(
                    "signing_secrets",
                    toml::Value::Array(vec![signing.clone().into()]),
                )
                .set(
                    "tls",
                    table(&[("root_cert", switchyard_tests::postgres::tls_file("ca.pem").into())]),
                ),
        )
        .target("redis", redis.target())
        .toml();
    let log = log_file("webhook-redis");
    let mut relay = Process::spawn_logged(SWITCHYARD, &config, "relay-secrets-http", &filter("trace"), &log);
    let expected = switchyard_tests::orders::write_orders(&db.pool, 5, 2, 1).await;
    switchyard_tests::postgres::all_published(&db.pool, expected.len() as i64, Duration::from_secs(60)).await;
    relay.terminate();
    assert!(
        receiver.requests().iter().any(|r| r.verified == [true]),
        "signed requests arrived"
    );
    let key = signing.trim_start_matches("whsec_").to_string();
    // redis-rs logs only in its cluster code: no line of its own here.
    assert_no_secret_in(
        &log,
        &["reqwest::", "hyper_util::"],
        &[
            Planted::login("HTTP (reqwest) bearer token", "", &token),
            Planted {
                client: "HTTP signing secret",
                forms: vec![("as configured", signing.clone()), ("its key", key)],
            },
            Planted::login("Redis (redis-rs)", "switchyard", &redis.password),
        ],
    );
    let _ = std::fs::remove_file(&log);
}
