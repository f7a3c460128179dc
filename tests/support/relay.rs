//! Running relays in tests: in-process (a task that can be stopped or
//! aborted) or as a real `switchyard` process (that can be SIGKILLed).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use switchyard::Config;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::config::{Plugin, Target, TestConfig, strings, with_key};
use super::plugins::plugin;

/// Settings that vary between tests.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Database URL.
    pub database_url: String,
    /// NATS URL.
    pub nats_url: String,
    /// `jetstream` or `core`.
    pub nats_mode: &'static str,
    /// `[relay]` keys overriding the test defaults.
    pub relay: Vec<(String, String)>,
}

impl Settings {
    /// JetStream, default relay tuning for tests.
    pub fn new(database_url: &str, nats_url: &str) -> Settings {
        Settings {
            database_url: database_url.to_string(),
            nats_url: nats_url.to_string(),
            nats_mode: "jetstream",
            relay: Vec::new(),
        }
    }

    /// Sets a `[relay]` key, e.g. `.relay("max_attempts", "2")`.
    #[must_use]
    pub fn relay(mut self, key: &str, value: &str) -> Settings {
        self.relay.push((key.to_string(), value.to_string()));
        self
    }
}

/// The `[relay]` section of a test config: the shared test tuning (short
/// leases, polls and backoff) with any key replaced or added by [`RelaySection::set`].
#[derive(Debug, Clone)]
pub struct RelaySection {
    keys: Vec<(String, String)>,
}

impl RelaySection {
    /// Batches of 200 over 3 workers, 6 s leases, 2 s publish timeout,
    /// backoff from 100 ms to 1 s.
    pub fn new() -> RelaySection {
        let keys = [
            ("batch_size", "200"),
            ("concurrency", "3"),
            ("poll_interval_ms", "200"),
            ("lease_duration_ms", "6000"),
            ("publish_timeout_ms", "2000"),
            ("initial_backoff_ms", "100"),
            ("max_backoff_ms", "1000"),
        ];
        RelaySection {
            keys: keys.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    /// No keys: the relay's own defaults, as a user's config without
    /// `[relay]` has them.
    pub fn defaults() -> RelaySection {
        RelaySection { keys: Vec::new() }
    }

    /// For fault tests that want outcomes fast: batches of 50 over 2 workers,
    /// 20 ms polls, 3 s leases, 1 s publish timeout, two attempts 50-200 ms apart.
    pub fn quick() -> RelaySection {
        RelaySection::new()
            .set("batch_size", "50")
            .set("concurrency", "2")
            .set("poll_interval_ms", "20")
            .set("lease_duration_ms", "3000")
            .set("publish_timeout_ms", "1000")
            .set("max_attempts", "2")
            .set("initial_backoff_ms", "50")
            .set("max_backoff_ms", "200")
    }

    /// Sets `key` to `value` (TOML), replacing the default if there is one.
    #[must_use]
    pub fn set(mut self, key: &str, value: &str) -> RelaySection {
        match self.keys.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value.to_string(),
            None => self.keys.push((key.to_string(), value.to_string())),
        }
        self
    }

    /// The section as TOML, header included.
    pub fn toml(&self) -> String {
        let keys: String = self.keys.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
        format!("[relay]\n{keys}")
    }
}

impl Default for RelaySection {
    fn default() -> RelaySection {
        RelaySection::new()
    }
}

/// The example pipeline: OrderPaid goes through redact-fields (card number
/// masked, internal note removed, CloudEvents envelope), everything else
/// through route-by-type; both publish to `orders.<EventType>` on NATS, keyed
/// by aggregate id.
pub fn example(settings: &Settings) -> TestConfig {
    let relay = settings.relay.iter().fold(
        RelaySection::new()
            .set("max_attempts", "8")
            .set("shutdown_timeout_ms", "5000"),
        |section, (key, value)| section.set(key, value),
    );
    TestConfig::new(&settings.database_url)
        .database("max_connections", 8)
        .tuning(relay)
        .plugin(
            Plugin::new("redact", &plugin("redact_fields"))
                .event_types(&["OrderPaid"])
                .to("events", "orders.{event_type}")
                .config("mask", strings(&["card.number"]))
                .config("remove", strings(&["internal_note"]))
                .config("cloudevents", true)
                .config("source", "/order-service"),
        )
        .plugin(
            Plugin::new("router", &plugin("route_by_type"))
                .set("aggregate_types", strings(&["order"]))
                .to("events", "orders.{event_type}"),
        )
        .target(
            "events",
            Target::nats(&settings.nats_url).set("mode", settings.nats_mode),
        )
}

/// [`example`] as TOML.
pub fn example_config(settings: &Settings) -> String {
    example(settings).toml()
}

/// Parses and validates config text.
///
/// # Panics
/// When the config is invalid.
pub fn parse(text: &str) -> Config {
    Config::from_toml(text, Path::new("."), &|_| None).unwrap_or_else(|e| panic!("config: {e:?}"))
}

/// Past the relay's own bound on its batches: releasing their leases (a
/// session from the pool, then a bounded statement) and ending its tasks.
const STOP_MARGIN: Duration = Duration::from_secs(20);

/// A relay running as a task in this process.
pub struct InProcess {
    /// The relay, for its plugin registry and status.
    pub relay: switchyard::Relay,
    shutdown: CancellationToken,
    handle: JoinHandle<anyhow::Result<()>>,
    /// How long a graceful stop may take: the relay's own bound on its
    /// batches, and [`STOP_MARGIN`] for its leases and sessions.
    stops_within: Duration,
}

impl InProcess {
    /// Builds (connects targets, loads plugins) and starts a relay.
    ///
    /// # Panics
    /// On startup failure.
    pub async fn start(config: &Config) -> InProcess {
        let relay = switchyard::runtime::build(config).await.expect("relay starts");
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let running = relay.clone();
        let handle = tokio::spawn(async move { running.run(token).await });
        let stops_within = Duration::from_millis(config.relay.shutdown_timeout_ms) + STOP_MARGIN;
        InProcess {
            relay,
            shutdown,
            handle,
            stops_within,
        }
    }

    /// A crash: the task is dropped mid-batch, nothing is finished or
    /// released. As when a process dies, its database connections are then
    /// closed: a SQLite write lock held by a dropped transaction ends with
    /// them, not whenever the pool next uses the connection.
    pub async fn abort(self) {
        self.handle.abort();
        let _ = self.handle.await;
        self.relay.store().close().await;
    }

    /// Graceful stop: a relay must stop within its `shutdown_timeout_ms`
    /// (and the margin for releasing what it held), never hang a test.
    ///
    /// # Panics
    /// If the relay returned an error or did not stop in time.
    pub async fn stop(self) {
        self.shutdown.cancel();
        match tokio::time::timeout(self.stops_within, self.handle).await {
            Ok(ended) => ended.expect("relay task").expect("relay run"),
            Err(_) => panic!(
                "the relay did not stop within {} s of its shutdown",
                self.stops_within.as_secs()
            ),
        }
    }
}

/// A relay running as its own OS process.
pub struct Process {
    child: Child,
    _config: PathBuf,
}

impl Process {
    /// Writes `config` to a temp file and starts `BINARY run` on it, where
    /// `binary` is the test's `env!("CARGO_BIN_EXE_relay-process")`.
    ///
    /// # Panics
    /// If the process cannot be started.
    pub fn spawn(binary: &str, config: &str, instance_id: &str) -> Process {
        let level = std::env::var("SWITCHYARD_LOG").unwrap_or_else(|_| "warn".into());
        Process::start(binary, config, instance_id, &level, Stdio::inherit(), &[])
    }

    /// Like [`Process::spawn`], logging at `level` (a `SWITCHYARD_LOG`
    /// filter) into the file `log` instead of the test's stderr: its whole
    /// log, for a test to read.
    ///
    /// # Panics
    /// If the file cannot be created or the process started.
    pub fn spawn_logged(binary: &str, config: &str, instance_id: &str, level: &str, log: &Path) -> Process {
        Process::spawn_logged_with(binary, config, instance_id, level, log, &[])
    }

    /// [`Process::spawn_logged`] with `env` in the process's environment
    /// (what a container or a unit would set: credentials files, a region).
    ///
    /// # Panics
    /// As [`Process::spawn_logged`].
    pub fn spawn_logged_with(
        binary: &str,
        config: &str,
        instance_id: &str,
        level: &str,
        log: &Path,
        env: &[(&str, &str)],
    ) -> Process {
        let file = std::fs::File::create(log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
        Process::start(binary, config, instance_id, level, Stdio::from(file), env)
    }

    fn start(
        binary: &str,
        config: &str,
        instance_id: &str,
        level: &str,
        stderr: Stdio,
        env: &[(&str, &str)],
    ) -> Process {
        let path = std::env::temp_dir().join(format!("sy-relay-{}.toml", uuid::Uuid::new_v4().simple()));
        let config = with_key(config, "relay", "instance_id", instance_id, false);
        // Several processes run at once: each takes a free admin port.
        let config = with_key(&config, "admin", "listen", "127.0.0.1:0", true);
        std::fs::write(&path, config).expect("write config");
        let child = Command::new(binary)
            .args(["run", "--config"])
            .arg(&path)
            .env("SWITCHYARD_LOG", level)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn relay process");
        Process { child, _config: path }
    }

    /// Sends `signal` (a `kill` name: STOP, CONT, ...).
    ///
    /// # Panics
    /// If `kill` cannot be run.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{signal}");
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has exited by itself.
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// SIGKILL: no chance to finish or release anything.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    ///
    /// # Panics
    /// If the process does not exit successfully.
    pub fn terminate(&mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(status.success());
        let exit = self.child.wait().expect("wait");
        assert!(exit.success(), "relay exited with {exit}");
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self._config);
    }
}

/// SIGKILLs a relay process `relay-a` on `config` while it holds leases:
/// spawns it, waits until it holds some, then stops it (SIGSTOP) and, once
/// the statements it had sent are done, kills it if it still holds some;
/// else lets it go on and looks again. An ack is one statement, which
/// completes on the server after its sender dies: killed unseen, A could
/// die between sending its last ack and claiming again as often as not.
/// `after_spawn` runs once each spawned A holds leases (to start a
/// companion relay once A has met the backlog). Returns the rows A held
/// when it died.
///
/// # Panics
/// When A never holds leases, or is never caught holding them.
pub async fn kill_while_holding_leases(
    binary: &str,
    config: &str,
    pool: impl Into<crate::service::ServicePool>,
    mut after_spawn: impl FnMut(),
) -> i64 {
    use crate::service::ServicePool;
    let pool = pool.into();
    let held_by_a = || {
        pool.scalar(
            "SELECT count(*) FROM switchyard_outbox WHERE lease_owner = 'relay-a' AND status = 'in_flight'",
        )
    };
    // Sessions of A that are still running a statement (`busy`), or at
    // all. MySQL sessions carry no name: there the server gets a while to
    // finish what A sent, and to notice its sessions closed.
    let sessions_of_a = |busy: bool| {
        let pool = pool.clone();
        async move {
            match pool {
                ServicePool::Postgres(pool) => sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'switchyard relay-a'
                        AND datname = current_database() AND (NOT $1 OR state = 'active')",
                )
                .bind(busy)
                .fetch_one(&pool)
                .await
                .unwrap(),
                ServicePool::MySql(_) => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    0
                }
            }
        }
    };
    let named = matches!(pool, ServicePool::Postgres(_));
    for _ in 0..5 {
        let mut a = Process::spawn(binary, config, "relay-a");
        crate::eventually("relay-a holds leases", Duration::from_secs(60), || async {
            (held_by_a().await > 0).then_some(())
        })
        .await;
        // Not before: a companion started with A could take every head of
        // a backlog of few aggregates at each turn (on MariaDB A's claim,
        // reading past the heads B holds, lost every race for 60 s).
        after_spawn();
        // Each relay names its connections after its instance id.
        assert!(
            !named || sessions_of_a(false).await > 0,
            "relay-a's sessions carry its name"
        );
        for _ in 0..100 {
            a.signal("STOP");
            // A statement of A's waiting for a lock another of its own
            // transactions holds stays active until A goes on: look again.
            let mut settled = false;
            for _ in 0..100 {
                if sessions_of_a(true).await == 0 {
                    settled = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if !settled || held_by_a().await == 0 {
                a.signal("CONT");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
            a.kill();
            crate::eventually("relay-a's sessions end", Duration::from_secs(60), || async {
                (sessions_of_a(false).await == 0).then_some(())
            })
            .await;
            // A claim A had not committed is gone with it.
            let orphaned = held_by_a().await;
            if orphaned > 0 {
                return orphaned;
            }
            break;
        }
        a.kill();
    }
    panic!("relay-a was never killed holding leases");
}
