//! Shared harness for the integration tests: a fresh PostgreSQL (or
//! MariaDB) database per test, nats-server processes per test, the example plugins built once, and
//! helpers to write events the way an application would.

pub mod aws;
pub mod backlog;
pub mod book;
pub mod brokers;
pub mod browser;
pub mod config;
pub mod fanout;
pub mod fleet;
pub mod kafka;
pub mod mariadb;
pub mod nats;
pub mod orders;
pub mod outbox;
pub mod plugins;
pub mod postgres;
pub mod pubsub;
pub mod rabbitmq;
pub mod redis;
pub mod registry;
pub mod relay;
pub mod service;
pub mod stall;
pub mod webhook;
pub mod workload;

use std::time::{Duration, Instant};

/// Runs `cleanup` from a `Drop`, which cannot await: on a short-lived
/// thread with a runtime of its own, waited for; a failure is printed as
/// `could not {what}`.
pub fn clean_up_in_drop<F>(what: &str, cleanup: F)
where
    F: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let done = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(cleanup)
    })
    .join();
    if let Ok(Err(error)) = done {
        eprintln!("could not {what}: {error}");
    }
}

/// Installs a log subscriber once; `SWITCHYARD_LOG=debug` shows relay logs in tests.
pub fn init_logging() {
    switchyard::telemetry::init_with_default(switchyard::telemetry::LogFormat::Text, "warn");
}

/// Polls `check` until it returns `Some`, or fails the test after `limit`.
///
/// # Panics
/// When the limit passes; the message says what was awaited.
pub async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The workspace root (tests run with the `tests/` crate as working directory).
pub fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| ".".into())
}

/// Serialises CPU-heavy tests: on a 2-core machine, tests that measure
/// latency or rely on time limits must not share the CPU with a load test.
/// Under cargo-nextest (a process per test) the runner does it: the test
/// must be in one of the groups of `.config/nextest.toml` that say how it
/// shares the machine (`heavy`: alone; `outage`, `service-outage`, `leases`: one at a time
/// beside light tests), and is failed here if it is not. Under `cargo test`
/// a lock serialises them all within one binary.
///
/// # Panics
/// Under nextest, in a test outside those groups.
pub async fn exclusive() -> tokio::sync::MutexGuard<'static, ()> {
    static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    if std::env::var_os("NEXTEST_RUN_ID").is_some() {
        let group = std::env::var("NEXTEST_TEST_GROUP").unwrap_or_default();
        assert!(
            ["heavy", "outage", "service-outage", "leases"].contains(&group.as_str()),
            "a test calling exclusive() belongs to the `heavy`, `outage`, `service-outage` or `leases` test group \
             of .config/nextest.toml, not {group:?}"
        );
    }
    HEAVY.lock().await
}

/// A plain HTTP/1.1 GET: status code and body.
///
/// # Panics
/// When the server cannot be reached or answers garbage.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    try_http_get(addr, path)
        .await
        .unwrap_or_else(|| panic!("no HTTP answer from {addr}{path}"))
}

/// [`http_get`], `None` while nothing answers (not listening yet).
pub async fn try_http_get(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let status = response.split(' ').nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((status, body))
}

/// `config` with its admin endpoint on a free loopback port, and that address.
pub fn with_admin(config: &str) -> (String, std::net::SocketAddr) {
    let port = free_port();
    (
        config::with_key(config, "admin", "listen", format!("127.0.0.1:{port}"), false),
        std::net::SocketAddr::from(([127, 0, 0, 1], port)),
    )
}

/// Waits (a minute at most) until `/readyz` at `admin` answers `status`,
/// and returns its body.
///
/// # Panics
/// When it does not in time.
pub async fn readyz_answers(admin: std::net::SocketAddr, status: u16) -> String {
    eventually(
        &format!("/readyz answering {status}"),
        Duration::from_secs(60),
        || async {
            try_http_get(admin, "/readyz")
                .await
                .and_then(|(code, body)| (code == status).then_some(body))
        },
    )
    .await
}

/// Waits (a minute at most) until `/readyz` at `admin` answers 503 with a
/// body that holds every one of `says`, and returns that body. A relay
/// answers not ready at once, before its first look at the database says
/// why; this waits for the why.
///
/// # Panics
/// When it does not in time; the message holds the last body.
pub async fn readyz_unready(admin: std::net::SocketAddr, says: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::from("(no answer)");
    while Instant::now() < deadline {
        if let Some((code, body)) = try_http_get(admin, "/readyz").await {
            if code == 503 && says.iter().all(|said| body.contains(said)) {
                return body;
            }
            last = format!("{code} {body}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("/readyz did not answer 503 saying {says:?} within 60 s; last: {last}");
}

/// Runs the `switchyard` command line to completion: exit code, stdout,
/// stderr. `binary` is the test's `env!("CARGO_BIN_EXE_relay-process")`.
///
/// # Panics
/// When the binary cannot be started.
pub async fn cli(binary: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let output = tokio::process::Command::new(binary)
        .args(args)
        .envs(env.iter().copied())
        .env("SWITCHYARD_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run the switchyard binary");
    outcome(&output)
}

/// A finished process as tests read it: exit code (-1 when killed by a
/// signal), stdout, stderr.
#[must_use]
pub fn outcome(output: &std::process::Output) -> (i32, String, String) {
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A TCP port nothing listens on right now (for configs that need a fixed
/// one), below the kernel's ephemeral range. A test stops and restarts
/// servers on these ports: while one is down, a client's connect to an
/// ephemeral port can be given that very port as its own and connect to
/// itself, and the server's restart then fails with EADDRINUSE (a RabbitMQ
/// node did, in a CI run).
///
/// # Panics
/// When no loopback port can be bound.
pub fn free_port() -> u16 {
    const LOWEST: u16 = 10_000;
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768)
        .max(LOWEST + 1_000);
    let span = u128::from(ephemeral_from - LOWEST);
    let mut dice = uuid::Uuid::new_v4().as_u128();
    for _ in 0..200 {
        let port = LOWEST + u16::try_from(dice % span).unwrap_or(0);
        dice = dice.rotate_right(17) ^ uuid::Uuid::new_v4().as_u128();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port below {ephemeral_from}")
}
