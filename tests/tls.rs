//! TLS to PostgreSQL, on a cluster of `scripts/services.sh` that refuses
//! every plaintext connection (`hostssl` entries only), verified in full
//! against the CA the script made: every kind of session the relay and its
//! CLI open works there, certificate login works, each TLS mistake is
//! refused with its own message, and a password that rotates under a
//! running relay reaches every new session.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use switchyard_tests::config::{Plugin, Target, TestConfig, path, table};
use switchyard_tests::kafka::KafkaServer;
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::{Expected, verify, write_orders};
use switchyard_tests::postgres::{TestDb, admin_pool, fresh_tls_db, tls_file, tls_server_url};
use switchyard_tests::rabbitmq::RabbitMq;
use switchyard_tests::relay::{InProcess, Process, RelaySection, Settings, example, parse};
use switchyard_tests::{cli, eventually, fleet, init_logging};

const STREAM: &str = "ORDERS";
const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");

/// A nats-server with the orders stream.
async fn nats() -> NatsServer {
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    nats
}

/// Waits for `count` messages in the stream, then checks every expected
/// event arrived once and in order per aggregate.
async fn all_arrive(nats: &NatsServer, expected: &HashMap<String, Expected>, seconds: u64) {
    wait_for_stream(nats, expected.len() as u64, seconds).await;
    let verdict = verify(&nats.read_stream(STREAM).await, expected);
    assert_eq!(verdict.distinct, expected.len());
}

/// The example pipeline in replication mode on `url`, through a slot
/// named after the database.
fn replication_config(url: &str, slot: &str, nats: &NatsServer) -> TestConfig {
    example(&Settings::new(url, &nats.url()).relay("mode", "\"replication\""))
        .set("replication", "slot", slot)
        .set("replication", "publication", "switchyard_outbox")
}

/// `(application_name, ssl, backend_type, query)` of the relay's sessions
/// on database `name`.
async fn relay_sessions(admin: &PgPool, name: &str) -> Vec<(String, bool, String, String)> {
    sqlx::query_as(
        "SELECT a.application_name, s.ssl, a.backend_type, coalesce(a.query, '')
           FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
          WHERE a.datname = $1 AND a.application_name LIKE 'switchyard%'",
    )
    .bind(name)
    .fetch_all(admin)
    .await
    .unwrap()
}

/// Runs the CLI with `config` written to a file.
async fn cli_with(config: &str, args: &[&str]) -> (i32, String, String) {
    let path = std::env::temp_dir().join(format!("sy-tls-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).unwrap();
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--config", path.to_str().unwrap()]);
    let result = cli(SWITCHYARD, &all, &[]).await;
    let _ = std::fs::remove_file(&path);
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_mode_over_verify_full_relays_every_event_on_tls_sessions_only() {
    init_logging();
    let db = fresh_tls_db().await;
    assert!(db.url.contains("sslmode=verify-full"), "{}", db.url);
    let nats = nats().await;
    let config = example(&Settings::new(&db.url, &nats.url()));
    let relay = InProcess::start(&config.parse()).await;
    let expected = write_orders(&db.pool, 50, 4, 2).await;
    all_arrive(&nats, &expected, 60).await;

    let admin = admin_pool(&tls_server_url()).await;
    let sessions = eventually(
        "the pool's and LISTEN's sessions",
        Duration::from_secs(10),
        || async {
            let sessions = relay_sessions(&admin, &db.name).await;
            let listens = sessions.iter().any(|s| s.3.starts_with("LISTEN"));
            (listens && sessions.len() >= 2).then_some(sessions)
        },
    )
    .await;
    assert!(
        sessions.iter().all(|s| s.1),
        "a session without TLS: {sessions:?}"
    );
    // The cluster refuses plaintext: a CLI command that answers used TLS.
    let admin_off = config.set("admin", "listen", "").toml();
    for command in [&["status"][..], &["dlq", "list"], &["migrate"]] {
        let (code, out, err) = cli_with(&admin_off, command).await;
        assert_eq!(code, 0, "{command:?}: {out}{err}");
    }
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_mode_over_verify_full_reads_the_slot_on_tls() {
    init_logging();
    let db = fresh_tls_db().await;
    let nats = nats().await;
    let config = replication_config(&db.url, &db.name, &nats).toml();
    let (code, out, err) = cli_with(&config, &["migrate"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let relay = InProcess::start(&parse(&config)).await;
    let expected = write_orders(&db.pool, 40, 5, 2).await;
    all_arrive(&nats, &expected, 60).await;
    let admin = admin_pool(&tls_server_url()).await;
    let walsender: Vec<bool> = sqlx::query_scalar(
        "SELECT s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)
          JOIN pg_replication_slots p ON p.active_pid = r.pid WHERE p.slot_name = $1",
    )
    .bind(&db.name)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(walsender, vec![true], "the slot is read over TLS");
    relay.stop().await;
}

/// Creates `role` (a superuser that may replicate) unless it exists. With
/// a password it joins `switchyard_rotating`, whose members the TLS
/// cluster asks for their password (the others are trusted).
async fn ensure_role(admin: &PgPool, role: &str, password: Option<&str>) {
    let create = |role: &str, attributes: &str| {
        format!(
            "DO $$ BEGIN CREATE ROLE {role} {attributes}; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
        )
    };
    sqlx::query(&create("switchyard_rotating", "NOLOGIN"))
        .execute(admin)
        .await
        .unwrap();
    sqlx::query(&create(role, "LOGIN SUPERUSER REPLICATION"))
        .execute(admin)
        .await
        .unwrap();
    if let Some(password) = password {
        for statement in [
            format!("GRANT switchyard_rotating TO {role}"),
            format!("ALTER ROLE {role} PASSWORD '{password}'"),
        ] {
            sqlx::query(&statement).execute(admin).await.unwrap();
        }
    }
}

/// `url` logging in as `role`.
fn as_role(url: &str, role: &str) -> String {
    let mut url = url::Url::parse(url).unwrap();
    url.set_username(role).unwrap();
    url.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_the_relay_in() {
    init_logging();
    let db = fresh_tls_db().await;
    ensure_role(&admin_pool(&tls_server_url()).await, "switchyard_cert", None).await;
    let nats = nats().await;
    // The certificate from [database.tls]; the URL says only where.
    let url = format!(
        "postgres://switchyard_cert@localhost:{}/{}",
        port(&db.url),
        db.name
    );
    let config = example(&Settings::new(&url, &nats.url())).database(
        "tls",
        table(&[
            ("mode", "verify-full".into()),
            ("root_cert", tls_file("ca.pem").into()),
            ("client_cert", tls_file("client.pem").into()),
            ("client_key", tls_file("client.key").into()),
        ]),
    );
    let relay = InProcess::start(&config.parse()).await;
    let expected = write_orders(&db.pool, 20, 3, 2).await;
    all_arrive(&nats, &expected, 60).await;
    let users: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT usename::text FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE 'switchyard%'",
    )
    .bind(&db.name)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(users, vec!["switchyard_cert".to_string()]);
    relay.stop().await;
    // Without the certificate the same role is refused.
    let bare = format!("{url}?sslmode=verify-full&sslrootcert={}", tls_file("ca.pem"));
    let refused = switchyard::OutboxStore::connect(bare.as_str(), 2)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("certificate"), "{refused}");
}

fn port(url: &str) -> u16 {
    url::Url::parse(url).unwrap().port().unwrap()
}

/// What connecting to `url` says, as the relay's startup reports it.
async fn refusal(url: &str) -> String {
    switchyard::OutboxStore::connect(url, 2)
        .await
        .map(drop)
        .expect_err("refused")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tls_mistake_is_refused_with_its_own_message() {
    init_logging();
    let good = tls_server_url();
    let ca = tls_file("ca.pem");
    let wrong_ca = good.replace(&ca, &tls_file("other-ca.pem"));
    let message = refusal(&wrong_ca).await;
    assert!(message.contains("not signed by a CA in sslrootcert"), "{message}");
    assert!(message.contains("other-ca.pem"), "{message}");
    // sslmode=require with a root certificate checks the CA, as libpq does
    // (verify-ca): another CA is refused; the right one connects.
    let required = wrong_ca.replace("sslmode=verify-full", "sslmode=require");
    assert_ne!(required, wrong_ca);
    let message = refusal(&required).await;
    assert!(message.contains("not signed by a CA in sslrootcert"), "{message}");
    let store = switchyard::OutboxStore::connect(&good.replace("sslmode=verify-full", "sslmode=require"), 2)
        .await
        .expect("require with the right CA connects");
    store.close().await;

    // The certificate names localhost only.
    let by_address = good.replace("@localhost:", "@127.0.0.1:");
    let message = refusal(&by_address).await;
    assert!(message.contains("does not name 127.0.0.1"), "{message}");
    assert!(message.contains("connect by a name it lists"), "{message}");

    let expired = ExpiredServer::start().await;
    let message = refusal(&format!(
        "postgres://u@localhost:{}/db?sslmode=verify-full&sslrootcert={ca}",
        expired.port
    ))
    .await;
    assert!(message.contains("has expired"), "{message}");

    // TLS asked of the plaintext cluster.
    let plain = switchyard_tests::postgres::server_url();
    let message = refusal(&format!("{plain}?sslmode=require")).await;
    assert!(message.contains("does not offer TLS"), "{message}");
    assert!(message.contains("sslmode=require"), "{message}");

    // Plaintext offered to the TLS-only cluster.
    let message = refusal(&good.replace("sslmode=verify-full", "sslmode=disable")).await;
    assert!(message.contains("takes only TLS"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_names_every_bad_tls_file_at_once() {
    let dir = std::env::temp_dir().join(format!("sy-tls-files-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let not_pem = dir.join("not-pem.crt");
    std::fs::write(&not_pem, "hello").unwrap();
    let missing = dir.join("missing.pem");
    let pem = |name: &str| toml::Value::from(tls_file(name));
    // PostgreSQL's own recipe for a client certificate: `openssl x509 -req`
    // without extensions, which makes an X.509 v1 certificate.
    let v1 = dir.join("client-v1.pem");
    let key = dir.join("client-v1.key");
    let csr = dir.join("client-v1.csr");
    let openssl = |args: &[&str]| {
        let done = std::process::Command::new("openssl").args(args).output().unwrap();
        assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    };
    openssl(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-subj",
        "/CN=switchyard_cert",
        "-keyout",
        key.to_str().unwrap(),
        "-out",
        csr.to_str().unwrap(),
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        csr.to_str().unwrap(),
        "-CA",
        &tls_file("ca.pem"),
        "-CAkey",
        &tls_file("ca.key"),
        "-set_serial",
        "4242",
        "-days",
        "30",
        "-out",
        v1.to_str().unwrap(),
    ]);
    let config = TestConfig::fleet()
        .member(
            "missing-ca",
            &format!(
                "postgres://u@db.example.com/a?sslmode=verify-full&sslrootcert={}",
                missing.display()
            ),
            &[],
        )
        .member(
            "not-pem",
            "postgres://u@db.example.com/b",
            &[(
                "tls",
                table(&[("mode", "verify-full".into()), ("root_cert", path(&not_pem))]),
            )],
        )
        .member(
            "mismatch",
            "postgres://u@db.example.com/c",
            &[(
                "tls",
                table(&[
                    ("client_cert", pem("client.pem")),
                    ("client_key", pem("server.key")),
                ]),
            )],
        )
        .member(
            "expired",
            "postgres://u@db.example.com/d",
            &[(
                "tls",
                table(&[
                    ("client_cert", pem("expired.pem")),
                    ("client_key", pem("expired.key")),
                ]),
            )],
        )
        .member(
            "half",
            &format!("postgres://u@db.example.com/e?sslcert={}", tls_file("client.pem")),
            &[],
        )
        .member(
            "twice",
            "postgres://u:pw@db.example.com/f",
            &[("password", table(&[("file", path(&missing))]))],
        )
        .member(
            "v1",
            "postgres://u@db.example.com/g",
            &[(
                "tls",
                table(&[("client_cert", path(&v1)), ("client_key", path(&key))]),
            )],
        )
        .plugin(Plugin::new(
            "p",
            &switchyard_tests::plugins::plugin("route_by_type"),
        ))
        .target("out", Target::stdout());
    let (code, out, err) = cli_with(&config.toml(), &["validate"]).await;
    let said = format!("{out}{err}");
    assert_ne!(code, 0, "{said}");
    for expected in [
        "databases[0]: cannot read",
        "missing.pem",
        "databases[1]:",
        "not-pem.crt holds no PEM certificate",
        "databases[2]: client certificate",
        "does not go with key",
        "databases[3]: client certificate",
        "expired on",
        "databases[4]: a client certificate needs both sslcert and sslkey",
        "databases[5]: the URL has a password and databases[5].password is set too",
        "databases[5].password.file",
        "databases[6]: client certificate",
        "is an X.509 v1 certificate",
        "sign it again as v3",
    ] {
        assert!(said.contains(expected), "{expected:?} missing from:\n{said}");
    }
    assert!(!said.contains(":pw@"), "{said}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A server that answers PostgreSQL's TLS request and then presents a
/// certificate that expired yesterday (signed by the test CA, naming
/// localhost): what a server whose certificate was not renewed looks like.
struct ExpiredServer {
    port: u16,
    _task: tokio::task::JoinHandle<()>,
}

impl ExpiredServer {
    async fn start() -> ExpiredServer {
        use rustls::pki_types::pem::PemObject;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let chain = rustls::pki_types::CertificateDer::pem_file_iter(tls_file("expired.pem"))
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(tls_file("expired.key")).unwrap();
        let config =
            rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(chain, key)
                .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let mut request = [0u8; 8];
                    if socket.read_exact(&mut request).await.is_ok() && socket.write_all(b"S").await.is_ok() {
                        let _ = acceptor.accept(socket).await;
                    }
                });
            }
        });
        ExpiredServer { port, _task: task }
    }
}

/// The TLS cluster's log, where each refused login leaves a line.
fn server_log() -> std::path::PathBuf {
    std::path::Path::new(&tls_file("ca.pem"))
        .parent()
        .and_then(std::path::Path::parent)
        .map(|state| state.join("pg-tls/server.log"))
        .expect("state directory")
}

/// Logins of `role` the server refused for their password, in the log
/// past byte `from`.
fn refused_logins(role: &str, from: u64) -> usize {
    let log = std::fs::read(server_log()).unwrap_or_default();
    let since = String::from_utf8_lossy(log.get(from as usize..).unwrap_or_default()).into_owned();
    since
        .matches(&format!("password authentication failed for user \"{role}\""))
        .count()
}

/// Rotates `role`'s password: the server's, then the file the relay's
/// password command reads, then ends the role's sessions so every kind of
/// connection has to log in again. Returns where the server's log stood
/// then: from there on no login of the relay's may be refused.
async fn rotate(admin: &PgPool, role: &str, file: &std::path::Path, password: &str) -> u64 {
    sqlx::query(&format!("ALTER ROLE {role} PASSWORD '{password}'"))
        .execute(admin)
        .await
        .unwrap();
    std::fs::write(file, format!("{password}\n")).unwrap();
    // Past three refreshes of the relay's (1 s each; a loaded machine may
    // delay one), so that sessions opened from here on log in with the
    // new password.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log_at = std::fs::metadata(server_log()).map_or(0, |m| m.len());
    sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1")
        .bind(role)
        .execute(admin)
        .await
        .unwrap();
    log_at
}

/// A role with a checked password, a file holding it and the
/// `password` table that runs a command to read it.
async fn rotating_role(role: &str) -> (PgPool, std::path::PathBuf, toml::Value) {
    let admin = admin_pool(&tls_server_url()).await;
    ensure_role(&admin, role, Some("first-password")).await;
    let file = std::env::temp_dir().join(format!("sy-{role}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::write(&file, "first-password\n").unwrap();
    let command = vec![toml::Value::from("cat"), path(&file)];
    let password = table(&[("command", command.into()), ("refresh_seconds", 1.into())]);
    (admin, file, password)
}

/// The password is checked: the old one is refused after the rotation.
async fn old_password_refused(db: &TestDb, role: &str) {
    let mut url = url::Url::parse(&as_role(&db.url, role)).unwrap();
    url.set_password(Some("first-password")).unwrap();
    let refused = refusal(url.as_str()).await;
    assert!(refused.contains("password authentication failed"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_password_reaches_the_pool_listen_and_the_ownership_follower() {
    init_logging();
    let role = "switchyard_rotating_fleet";
    let (admin, file, password) = rotating_role(role).await;
    let db = fresh_tls_db().await;
    let nats = nats().await;
    let url = as_role(&db.url, role);
    let relay_section = RelaySection::new().set("concurrency", "2");
    let config = fleet::fleet(&[], &nats.url(), &relay_section)
        .member(
            "a",
            &url,
            &[("max_connections", 3.into()), ("password", password)],
        )
        .set("ownership", "lease_seconds", 3)
        .toml();
    let mut relay = Process::spawn(SWITCHYARD, &config, "relay-rotating");
    let first = fleet_orders(&db.pool, 0, 10).await;
    wait_for_stream(&nats, first, 60).await;
    let log_at = rotate(&admin, role, &file, "second-password").await;
    old_password_refused(&db, role).await;
    let second = fleet_orders(&db.pool, 10, 10).await;
    wait_for_stream(&nats, first + second, 60).await;
    // Every kind came back: the pool, LISTEN and the ownership follower.
    let sessions = eventually(
        "the relay's sessions, logged in again",
        Duration::from_secs(20),
        || async {
            let sessions = relay_sessions(&admin, &db.name).await;
            let listens = sessions.iter().any(|s| s.3.starts_with("LISTEN"));
            let follows = sessions.iter().any(|s| s.3.contains("switchyard_ownership"));
            (listens && follows).then_some(sessions)
        },
    )
    .await;
    assert!(sessions.iter().all(|s| s.1), "{sessions:?}");
    assert_eq!(
        refused_logins(role, log_at),
        1,
        "only the test's own login with the old password"
    );

    // Revoked: the server's password changes and the relay's source lags.
    // Nothing is claimed, so nothing spends an attempt; once the source
    // has the new password, the rows flow.
    for statement in [
        format!("ALTER ROLE {role} PASSWORD 'third-password'"),
        format!("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"),
    ] {
        sqlx::query(&statement).execute(&admin).await.unwrap();
    }
    let third = fleet_orders(&db.pool, 20, 10).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let untouched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM switchyard_outbox WHERE attempts = 0 AND status = 'pending'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        untouched, 10,
        "while its login is refused the relay takes nothing"
    );
    std::fs::write(&file, "third-password\n").unwrap();
    wait_for_stream(&nats, first + second + third, 60).await;
    assert_eq!(
        switchyard_tests::postgres::count_status(&db.pool, "dead").await,
        0
    );
    relay.terminate();
    let _ = std::fs::remove_file(&file);
}

/// Writes `count` orders of one event each, ids from `from`, in the
/// subjects the fleet config routes to.
async fn fleet_orders(pool: &PgPool, from: usize, count: usize) -> u64 {
    for i in from..from + count {
        switchyard_tests::postgres::place_order_event(
            pool,
            &switchyard_tests::orders::order_event(i, 0),
            true,
        )
        .await;
    }
    count as u64
}

async fn wait_for_stream(nats: &NatsServer, count: u64, seconds: u64) {
    eventually(
        "the events in the stream",
        Duration::from_secs(seconds),
        || async { (nats.stream_len(STREAM).await >= count).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_password_reaches_the_replication_session() {
    init_logging();
    let role = "switchyard_rotating_slot";
    let (admin, file, password) = rotating_role(role).await;
    let db = fresh_tls_db().await;
    let nats = nats().await;
    let url = as_role(&db.url, role);
    let config = replication_config(&url, &db.name, &nats)
        .database("password", password)
        .toml();
    let (code, out, err) = cli_with(&config, &["migrate"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let relay = InProcess::start(&parse(&config)).await;
    let expected = write_orders(&db.pool, 10, 2, 1).await;
    all_arrive(&nats, &expected, 60).await;
    let log_at = rotate(&admin, role, &file, "second-password").await;
    old_password_refused(&db, role).await;
    // New aggregates, written after the rotation.
    for i in 100..120 {
        let event = switchyard_tests::orders::order_event(i, 0);
        switchyard_tests::postgres::place_order_event(&db.pool, &event, true).await;
    }
    let total = expected.len() as u64 + 20;
    wait_for_stream(&nats, total, 60).await;
    let reader: Vec<(String, bool)> = sqlx::query_as(
        "SELECT r.usename::text, s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s USING (pid)
          JOIN pg_replication_slots p ON p.active_pid = r.pid WHERE p.slot_name = $1",
    )
    .bind(&db.name)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(
        reader,
        vec![(role.to_string(), true)],
        "the slot is read again, as {role}, on TLS"
    );
    assert_eq!(
        refused_logins(role, log_at),
        1,
        "only the test's own login with the old password"
    );
    relay.stop().await;
    let _ = std::fs::remove_file(&file);
}

/// A user nkey, and a nats-server with TLS that requires a client
/// certificate from the test CA and admits that user only.
async fn secured_nats() -> (NatsServer, nkeys::KeyPair) {
    switchyard::tls::install_provider();
    let user = nkeys::KeyPair::new_user();
    let nats = NatsServer::start_secured(
        &tls_file("ca.pem"),
        (&tls_file("client.pem"), &tls_file("client.key")),
        &user.seed().unwrap(),
        &user.public_key(),
        (&tls_file("server.pem"), &tls_file("server.key")),
    )
    .await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    (nats, user)
}

/// A relay on `db` whose one plugin sends every event to `target`, named
/// `name`, under `topic`.
fn one_target(db: &str, name: &str, topic: &str, target: Target) -> TestConfig {
    TestConfig::new(db)
        .plugin(Plugin::new("route", &switchyard_tests::plugins::plugin("route_by_type")).to(name, topic))
        .target(name, target)
}

/// Why the targets of `config` cannot be reached: the relay starts
/// without them, and their health checks (what `/readyz` shows) say why.
async fn connect_targets(config: &str) -> String {
    let config = parse(config);
    let sinks = switchyard::sinks::Sinks::connect(&config.targets, &config.sink_settings())
        .await
        .expect("an unreachable target does not stop the start");
    let checks = switchyard::admin::target_checks(&sinks).await;
    let refused: Vec<String> = checks
        .into_iter()
        .filter(|(_, check)| !check.is_ok())
        .map(|(name, check)| format!("{name}: {check}"))
        .collect();
    assert!(!refused.is_empty(), "refused");
    refused.join("\n")
}

/// A file holding `text`.
fn secret_file(text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("sy-secret-{}", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls_with_a_client_certificate_and_an_nkey_seed() {
    init_logging();
    let (nats, user) = secured_nats().await;
    let db = switchyard_tests::postgres::fresh_db().await;
    let seed = secret_file(&format!("{}\n", user.seed().unwrap()));
    let tls = table(&[
        ("root_cert", tls_file("ca.pem").into()),
        ("client_cert", tls_file("client.pem").into()),
        ("client_key", tls_file("client.key").into()),
    ]);
    let base = example(&Settings::new(&db.url, &nats.url()));
    let with = |seed: &std::path::Path, tls: toml::Value| {
        base.clone()
            .target_set("events", "nkey_seed_file", path(seed))
            .target_set("events", "tls", tls)
            .toml()
    };
    let relay = InProcess::start(&parse(&with(&seed, tls.clone()))).await;
    let expected = write_orders(&db.pool, 20, 3, 2).await;
    all_arrive(&nats, &expected, 60).await;
    relay.stop().await;

    // No client certificate: refused at the handshake, and said so.
    let without_cert = with(&seed, table(&[("root_cert", tls_file("ca.pem").into())]));
    let refused = connect_targets(&without_cert).await;
    assert!(refused.contains("cannot connect to NATS"), "{refused}");
    // Another user's seed: refused as a login.
    let stranger = secret_file(&nkeys::KeyPair::new_user().seed().unwrap());
    let wrong_seed = with(&stranger, tls);
    let refused = connect_targets(&wrong_seed).await;
    assert!(refused.to_lowercase().contains("authorization"), "{refused}");
    assert!(!refused.contains(&user.seed().unwrap()), "{refused}");
    let _ = std::fs::remove_file(&seed);
    let _ = std::fs::remove_file(&stranger);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_over_tls_logs_in_with_the_client_certificate() {
    init_logging();
    let tls_port = switchyard_tests::free_port();
    let rabbit = RabbitMq::own_with_tls(tls_port).await;
    rabbit.declare("orders", "tls-orders", "orders.#").await;
    let db = switchyard_tests::postgres::fresh_db().await;
    let target = |ca: &str, client: bool| {
        let mut tls = vec![("root_cert", tls_file(ca).into())];
        if client {
            tls.push(("client_cert", tls_file("client.pem").into()));
            tls.push(("client_key", tls_file("client.key").into()));
        }
        let url = format!("amqps://localhost:{tls_port}/%2f?auth_mechanism=external");
        one_target(
            &db.url,
            "rabbit",
            "orders.{event_type}",
            Target::rabbitmq(&url, "orders").set("tls", table(&tls)),
        )
        .toml()
    };
    let relay = InProcess::start(&parse(&target("ca.pem", true))).await;
    write_orders(&db.pool, 10, 2, 1).await;
    let received = rabbit.drain("tls-orders", 20, Duration::from_secs(60)).await;
    assert_eq!(received.len(), 20);
    relay.stop().await;

    // Without a client certificate there is nothing to log in with.
    let refused = connect_targets(&target("ca.pem", false)).await;
    assert!(
        refused.contains("cannot connect to amqps://localhost"),
        "{refused}"
    );
    // The system's roots do not know the test CA.
    let refused = connect_targets(&target("other-ca.pem", true)).await;
    assert!(refused.contains("cannot connect"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_verifies_the_brokers_certificate() {
    init_logging();
    let kafka = KafkaServer::start_behind_tls().await;
    kafka.create_topic("orders", 3).await;
    let db = switchyard_tests::postgres::fresh_db().await;
    let config = |ca: &str| {
        one_target(
            &db.url,
            "kafka",
            "orders",
            Target::kafka(&kafka.bootstrap())
                .property("security.protocol", "ssl")
                .property("ssl.ca.location", ca)
                .property("linger.ms", "2"),
        )
        .toml()
    };
    let relay = InProcess::start(&parse(&config(&tls_file("ca.pem")))).await;
    write_orders(&db.pool, 10, 2, 1).await;
    let received = kafka.read_topic("orders", 20, Duration::from_secs(60)).await;
    let ids: std::collections::HashSet<_> = received
        .iter()
        .filter_map(|m| m.header("Switchyard-Event-Id"))
        .collect();
    assert_eq!(ids.len(), 20);
    relay.stop().await;
    // A CA that did not sign the broker's certificate: not connected.
    let refused = connect_targets(&config(&tls_file("other-ca.pem"))).await;
    assert!(refused.contains("kafka"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_on_tls_lists_databases_served_with_the_fleets_tls_defaults() {
    init_logging();
    let control = fresh_tls_db().await;
    let tenant = fresh_tls_db().await;
    let nats = nats().await;
    sqlx::query("CREATE TABLE tenants (name text, url text)")
        .execute(&control.pool)
        .await
        .unwrap();
    // Neither URL says anything of TLS, and the cluster refuses plaintext:
    // only [catalog.tls], the fleet's default, lets either connect.
    let bare = |db: &TestDb| format!("postgres://postgres@localhost:{}/{}", port(&db.url), db.name);
    sqlx::query("INSERT INTO tenants VALUES ('tenant', $1)")
        .bind(bare(&tenant))
        .execute(&control.pool)
        .await
        .unwrap();
    let relay_section = RelaySection::new().set("concurrency", "2");
    let config = fleet::fleet(&[], &nats.url(), &relay_section)
        .set("catalog", "url", bare(&control))
        .set("catalog", "query", "SELECT name, url FROM tenants")
        .set("catalog", "interval_seconds", 1)
        .set("catalog", "max_connections", 3)
        .set("catalog.tls", "mode", "verify-full")
        .set("catalog.tls", "root_cert", tls_file("ca.pem"))
        .toml();
    let mut relay = Process::spawn(SWITCHYARD, &config, "relay-catalog");
    let written = fleet_orders(&tenant.pool, 0, 10).await;
    wait_for_stream(&nats, written, 60).await;
    relay.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_in_operator_mode_takes_a_creds_file() {
    init_logging();
    let (nats, creds) = NatsServer::start_operator_mode().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    let db = switchyard_tests::postgres::fresh_db().await;
    let base = example(&Settings::new(&db.url, &nats.url()));
    let config = base
        .clone()
        .target_set("events", "credentials_file", path(&creds));
    let relay = InProcess::start(&config.parse()).await;
    let expected = write_orders(&db.pool, 20, 3, 2).await;
    all_arrive(&nats, &expected, 60).await;
    relay.stop().await;
    // Without the creds there is no login.
    let refused = connect_targets(&base.toml()).await;
    assert!(refused.to_lowercase().contains("authorization"), "{refused}");
    let _ = std::fs::remove_file(&creds);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_password_that_rotates_under_a_running_relay_loses_nothing() {
    init_logging();
    let kafka = KafkaServer::start_behind_tls_with_login("relay", "password-1").await;
    kafka.create_topic("orders", 3).await;
    let db = switchyard_tests::postgres::fresh_db().await;
    let file = secret_file("password-1\n");
    let target = Target::kafka(&kafka.bootstrap())
        .set(
            "password",
            table(&[("file", path(&file)), ("refresh_seconds", 1.into())]),
        )
        .property("security.protocol", "sasl_ssl")
        .property("ssl.ca.location", &tls_file("ca.pem"))
        .property("sasl.mechanisms", "SCRAM-SHA-512")
        .property("sasl.username", "relay")
        .property("linger.ms", "2");
    let relay = InProcess::start(&one_target(&db.url, "kafka", "orders", target).parse()).await;

    // Events keep coming while the password rotates: the file first, as a
    // secret store hands the new one out, then the broker, which drops
    // every session and admits only the new password from then on.
    let writer = {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            use switchyard_tests::orders::order_event;
            use switchyard_tests::postgres::{Outbox, place_event};
            let mut written = HashMap::new();
            for seq in 0..40 {
                for aggregate in 0..5 {
                    let event = order_event(aggregate, seq);
                    let id = place_event(&pool, Outbox::Switchyard, &event, true).await;
                    written.insert(id.to_string(), (event.aggregate_id, seq));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            written
        })
    };
    kafka.read_topic("orders", 10, Duration::from_secs(60)).await;
    std::fs::write(&file, "password-2\n").unwrap();
    kafka.rotate_password("password-2");
    let expected = writer.await.unwrap();

    let received = kafka
        .read_topic("orders", expected.len(), Duration::from_secs(90))
        .await;
    let mut seen = std::collections::HashSet::new();
    let mut last: HashMap<String, usize> = HashMap::new();
    let mut duplicates = 0;
    for message in &received {
        let id = message
            .header("Switchyard-Event-Id")
            .expect("event id")
            .to_string();
        if !seen.insert(id.clone()) {
            duplicates += 1;
            continue;
        }
        let (aggregate, seq) = &expected[&id];
        // One key, one partition: offsets in order mean events in order.
        if let Some(before) = last.insert(aggregate.clone(), *seq) {
            assert!(before < *seq, "{aggregate} out of order");
        }
    }
    assert_eq!(seen.len(), expected.len(), "every event arrived");
    // A request the broker stored just before the session was cut is
    // sent again by the new producer, which the broker cannot recognise:
    // at most what was in flight, as in any Kafka outage.
    assert!(duplicates <= 5 * 2, "{duplicates} duplicates");
    assert!(
        !kafka.admits("relay", "password-1").await,
        "the broker refuses the old password: the relay logged in with the new one"
    );
    relay.stop().await;
}

/// A user of the test MariaDB that must log in over TLS with `password`,
/// with every privilege on `database`; the URL it logs in by (`host`, no
/// password, no TLS parameters).
async fn mariadb_tls_user(
    db: &switchyard_tests::outbox::TestOutbox,
    password: &str,
    host: &str,
) -> (String, String) {
    let user = format!("sy_tls_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let database = db.url.rsplit('/').next().unwrap().to_string();
    db.execute(&format!(
        "CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY '{password}' REQUIRE SSL;
         GRANT ALL PRIVILEGES ON `{database}`.* TO '{user}'@'127.0.0.1'"
    ))
    .await;
    let server = url::Url::parse(&switchyard_tests::mariadb::server_url()).unwrap();
    let url = format!("mysql://{user}@{host}:{}/{database}", server.port().unwrap());
    (user, url)
}

/// TLS to MariaDB in libpq's words, with the messages PostgreSQL's faults
/// get: the relay logs in over verified TLS (its user is refused any other
/// way); another CA, a host the certificate does not name and a refused
/// password from its source are each said as for PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_over_verify_full_and_each_mistake_said_as_for_postgresql() {
    init_logging();
    let db = switchyard_tests::outbox::TestOutbox::mariadb().await;
    let (user, url) = mariadb_tls_user(&db, "tls-password-1", "localhost").await;
    let ca = tls_file("ca.pem");
    let secret = std::env::temp_dir().join(format!("sy-{user}"));
    std::fs::write(&secret, "tls-password-1\n").unwrap();
    let password = switchyard::secret::SecretConfig::from_file(secret.clone());
    let endpoint = |url: &str, mode: switchyard::store::SslMode, root: &str| {
        let tls = switchyard::store::PgTlsConfig {
            mode: Some(mode),
            root_cert: Some(root.into()),
            ..switchyard::store::PgTlsConfig::default()
        };
        switchyard::store::Endpoint::new(url, &tls, Some(&password))
    };
    use switchyard::store::SslMode;
    let store = switchyard::OutboxStore::connect(endpoint(&url, SslMode::VerifyFull, &ca), 2)
        .await
        .expect("verify-full with the test CA connects");
    store
        .claim("tls", 10, Duration::from_secs(30))
        .await
        .expect("claims over TLS");
    store.close().await;
    // Without TLS the user is refused: what connected above was TLS.
    let plain = refusal(&format!(
        "{}?sslmode=disable",
        url.replace(&format!("{user}@"), &format!("{user}:tls-password-1@"))
    ))
    .await;
    assert!(plain.contains("Access denied"), "{plain}");

    let wrong_ca =
        switchyard::OutboxStore::connect(endpoint(&url, SslMode::VerifyFull, &tls_file("other-ca.pem")), 2)
            .await
            .map(drop)
            .unwrap_err()
            .to_string();
    assert!(
        wrong_ca.contains("not signed by a CA in sslrootcert"),
        "{wrong_ca}"
    );
    assert!(wrong_ca.contains("MySQL at localhost"), "{wrong_ca}");

    let by_address = url.replace("@localhost:", "@127.0.0.1:");
    let message = switchyard::OutboxStore::connect(endpoint(&by_address, SslMode::VerifyFull, &ca), 2)
        .await
        .map(drop)
        .unwrap_err()
        .to_string();
    assert!(message.contains("does not name 127.0.0.1"), "{message}");

    std::fs::write(&secret, "not-the-password\n").unwrap();
    let message = switchyard::OutboxStore::connect(endpoint(&url, SslMode::VerifyFull, &ca), 2)
        .await
        .map(drop)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("the password from its password source (file or command) was refused"),
        "{message}"
    );
    assert!(!message.contains("not-the-password"), "{message}");
    let _ = std::fs::remove_file(&secret);
}

/// A MariaDB password that rotates under a running relay process: the
/// server's changes, the file the relay's command reads follows, the
/// relay's sessions are killed, and events written after go through on
/// sessions logged in with the new password, none dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_mariadb_password_reaches_the_relays_new_sessions() {
    rotated_mariadb_password(false).await;
}

/// The same in binlog mode: the binary log's reader, a session of its own
/// through another driver, logs in over verified TLS and again with the
/// new password once its session is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_mariadb_password_reaches_the_binlog_reader() {
    rotated_mariadb_password(true).await;
}

async fn rotated_mariadb_password(binlog: bool) {
    init_logging();
    let db = switchyard_tests::outbox::TestOutbox::mariadb().await;
    let (user, url) = mariadb_tls_user(&db, "first-password", "localhost").await;
    if binlog {
        db.execute(&format!("GRANT REPLICATION SLAVE ON *.* TO '{user}'@'127.0.0.1'"))
            .await;
    }
    let file = std::env::temp_dir().join(format!("sy-{user}"));
    std::fs::write(&file, "first-password\n").unwrap();
    let command = vec![toml::Value::from("cat"), path(&file)];
    let password = table(&[("command", command.into()), ("refresh_seconds", 1.into())]);
    let nats = nats().await;
    let url = format!("{url}?sslmode=verify-full&sslrootcert={}", tls_file("ca.pem"));
    let settings = Settings::new(&url, &nats.url());
    let settings = if binlog {
        settings.relay("mode", "\"replication\"")
    } else {
        settings
    };
    let config = example(&settings).database("password", password).toml();
    if binlog {
        let (code, out, err) = cli_with(&config, &["migrate"]).await;
        assert_eq!(code, 0, "{out}{err}");
    }
    let mut relay = Process::spawn(SWITCHYARD, &config, "relay-rotating-mariadb");
    let reading = || {
        let pool = db.service_pool();
        let user = user.clone();
        async move {
            let sql = format!(
                "SELECT count(*) FROM information_schema.processlist WHERE user = '{user}' AND command LIKE 'Binlog Dump%'"
            );
            (pool.scalar(&sql).await > 0).then_some(())
        }
    };
    let pool = db.service_pool();
    let write = |from: usize| {
        let pool = pool.clone();
        async move {
            let mut seqs = HashMap::new();
            for i in from..from + 10 {
                let plan = vec![(i, 1, switchyard_tests::postgres::Outbox::Switchyard)];
                pool.write_committed(&plan, &mut seqs).await.unwrap();
            }
        }
    };
    write(0).await;
    wait_for_stream(&nats, 10, 60).await;
    if binlog {
        eventually(
            "the relay's user reads the binary log",
            Duration::from_secs(10),
            &reading,
        )
        .await;
    }
    db.execute(&format!(
        "ALTER USER '{user}'@'127.0.0.1' IDENTIFIED BY 'second-password'"
    ))
    .await;
    std::fs::write(&file, "second-password\n").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let sessions = pool
        .scalar(&format!(
            "SELECT count(*) FROM information_schema.processlist WHERE user = '{user}'"
        ))
        .await;
    assert!(sessions > 0, "the relay's sessions are its user's");
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM information_schema.processlist WHERE user = ?")
        .bind(&user)
        .fetch_all(&db.mysql_pool())
        .await
        .unwrap();
    for id in ids {
        let _ = sqlx::query(&format!("KILL {id}")).execute(&db.mysql_pool()).await;
    }
    write(100).await;
    wait_for_stream(&nats, 20, 60).await;
    if binlog {
        eventually(
            "the binary log read again with the new password",
            Duration::from_secs(30),
            &reading,
        )
        .await;
    }
    assert_eq!(db.count("dead").await, 0);
    relay.terminate();
    let _ = std::fs::remove_file(&file);
}
