//! The admin HTTP endpoint: `/metrics` (Prometheus text), `/healthz` (the
//! process answers), `/readyz` (database reachable, every target's health
//! check passing, every plugin loaded) and `/status` (plugins with their
//! versions and last reload, targets with their health: what `switchyard
//! status` shows next to the outbox counts).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::relay::Relay;

mod serve;

/// Bound on each readiness check, so a hung broker makes `/readyz` say
/// not-ready instead of hanging the probe.
pub(crate) const CHECK_TIMEOUT: Duration = Duration::from_secs(3);
#[cfg(feature = "kafka")]
const _: () = assert!(
    crate::sinks::kafka::HEALTH_TIMEOUT.as_millis() < CHECK_TIMEOUT.as_millis(),
    "a Kafka health probe must end within readiness's bound on it"
);

/// A running admin server.
pub struct AdminServer {
    /// The address it listens on (useful with port 0).
    pub local_addr: SocketAddr,
    handle: tokio::task::JoinHandle<()>,
}

impl AdminServer {
    /// Waits for the server to stop (after the shutdown token fires).
    pub async fn stopped(self) {
        let _ = self.handle.await;
    }

    /// Waits up to `bound` for the server to stop (after its shutdown
    /// token fires), then drops the connections a client keeps open: its
    /// address is free again either way.
    pub async fn stopped_within(mut self, bound: Duration) {
        if tokio::time::timeout(bound, &mut self.handle).await.is_err() {
            self.handle.abort();
            let _ = self.handle.await;
        }
    }
}

/// Binds `listen` and serves the admin endpoints for `relay` until `shutdown`.
///
/// # Errors
/// The address cannot be bound (in use, not local, bad syntax).
pub async fn serve(listen: &str, relay: Relay, shutdown: CancellationToken) -> anyhow::Result<AdminServer> {
    serve_on(bind(listen).await?, relay, shutdown)
}

/// [`serve`] on a bound listener.
///
/// # Errors
/// The listener has no local address.
pub fn serve_on(
    listener: tokio::net::TcpListener,
    relay: Relay,
    shutdown: CancellationToken,
) -> anyhow::Result<AdminServer> {
    serve_listener(listener, router(relay), shutdown)
}

/// What the admin endpoint serves: one database's relay, a database not
/// served yet, or a fleet of many. One router ([`router`]) serves each.
pub(crate) trait Served: Clone + Send + Sync + 'static {
    /// The `/metrics` text, with the figures read at scrape time fresh.
    fn scrape(&self) -> impl Future<Output = String> + Send;
    /// The `/readyz` answer: 200 or 503, and the checks as JSON.
    fn readyz(&self) -> impl Future<Output = Response> + Send;
    /// The `/status` answer, for `database` when the query names one.
    fn status(&self, database: Option<String>) -> impl Future<Output = Response> + Send;
}

/// `/status?database=NAME`.
#[derive(serde::Deserialize)]
struct StatusQuery {
    database: Option<String>,
}

/// The admin endpoints over `served`.
pub(crate) fn router<S: Served>(served: S) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(served): State<S>| async move { metrics_response(served.scrape().await) }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|State(served): State<S>| async move { served.readyz().await }))
        .route(
            "/status",
            get(
                |State(served): State<S>, axum::extract::Query(query): axum::extract::Query<StatusQuery>| async move {
                    served.status(query.database).await
                },
            ),
        )
        .with_state(served)
}

/// `readiness` as `/readyz` answers it: 200 when ready, else 503.
pub(crate) fn readyz_response(ready: bool, readiness: impl Serialize) -> Response {
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(readiness)).into_response()
}

/// A `/status` that cannot be answered: `{"error": ...}`.
pub(crate) fn status_refused(status: StatusCode, error: String) -> Response {
    (status, axum::Json(serde_json::json!({ "error": error }))).into_response()
}

impl Served for Relay {
    async fn scrape(&self) -> String {
        refresh_scraped(self).await;
        self.metrics().render()
    }

    async fn readyz(&self) -> Response {
        let readiness = readiness(self).await;
        readyz_response(readiness.ready, readiness)
    }

    async fn status(&self, _database: Option<String>) -> Response {
        axum::Json(relay_status(self).await).into_response()
    }
}

/// Binds the admin endpoint's address (port 0: one the system chooses).
///
/// # Errors
/// The address cannot be bound.
pub async fn bind(listen: &str) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen} for the admin endpoint: {e}"))
}

/// Serves `app` on a bound `listener` until `shutdown`.
pub(crate) fn serve_listener(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<AdminServer> {
    let local_addr = listener.local_addr()?;
    // Bounded: a request's header within 10 s, 256 connections at once;
    // each request carries the peer's address (the console limits failed
    // sign-ins per client).
    let handle = tokio::spawn(serve::run(listener, app, shutdown, serve::HEADER_READ_TIMEOUT));
    tracing::info!(%local_addr, "Admin endpoint listening (/metrics, /healthz, /readyz, /status).");
    Ok(AdminServer { local_addr, handle })
}

/// Sets the figures read at scrape time (backlog, retained WAL, rows
/// waiting per target) for `relay`'s database.
pub(crate) async fn refresh_scraped(relay: &Relay) {
    // Backlog figures are read at scrape time, so they are as fresh as the scrape.
    match tokio::time::timeout(CHECK_TIMEOUT, relay.store().backlog()).await {
        Ok(Ok((rows, oldest))) => {
            relay.metrics().set_backlog(rows, oldest.unwrap_or(0.0));
        }
        Ok(Err(e)) => tracing::debug!(error = %e, "Backlog query failed during a scrape."),
        Err(_) => tracing::debug!("Backlog query timed out during a scrape."),
    }
    if let Some(settings) = relay.replication()
        && let Some(pg) = relay.store().postgres()
        && let Ok(Ok(Some(slot))) = tokio::time::timeout(CHECK_TIMEOUT, pg.slot_status(&settings.slot)).await
    {
        relay.metrics().set_retained_wal(
            slot.retained_wal_bytes.unwrap_or(0),
            settings.max_retained_wal_bytes,
        );
    }
    if let Ok(Ok(waiting)) = tokio::time::timeout(CHECK_TIMEOUT, relay.store().waiting_by_target()).await {
        for name in relay.sinks().names() {
            let rows = waiting.get(name).copied().unwrap_or(0);
            relay.metrics().set_target_waiting_rows(name, rows);
        }
    }
}

/// A Prometheus text answer.
pub(crate) fn metrics_response(text: String) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Why a readiness check fails. Each has a section of the book's
/// troubleshooting page (`docs/src/how-to/troubleshooting.md`) headed by
/// its [`Reason::title`], saying what to do; a test fails on one without.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The database answered with an error, or cannot be reached.
    Database,
    /// A check's statement got no answer within its bound.
    NoAnswer,
    /// The database is set up for the other mode.
    ModeMismatch,
    /// Batch outcomes wait for the database to record them.
    OutcomesWaiting,
    /// A batch panicked within the last minute.
    WorkerPanicked,
    /// The `[source]` capture trigger is missing, disabled or stale.
    Capture,
    /// The replication slot does not exist.
    SlotMissing,
    /// The replication slot lost WAL it needed.
    SlotLost,
    /// The server keeps more WAL for the slot than allowed.
    SlotRetainsTooMuch,
    /// A target failed its health check.
    Target,
    /// A fleet's database is not served yet.
    NotServed,
    /// A fleet's catalog could not be read.
    Catalog,
    /// The console has not checked yet.
    NotChecked,
}

impl Reason {
    /// Every reason (a test checks each has its section).
    pub const ALL: [Reason; 13] = [
        Reason::Database,
        Reason::NoAnswer,
        Reason::ModeMismatch,
        Reason::OutcomesWaiting,
        Reason::WorkerPanicked,
        Reason::Capture,
        Reason::SlotMissing,
        Reason::SlotLost,
        Reason::SlotRetainsTooMuch,
        Reason::Target,
        Reason::NotServed,
        Reason::Catalog,
        Reason::NotChecked,
    ];

    /// Its name in `/readyz` and `/status`: a failed check reads `error
    /// (NAME): why`, and the troubleshooting page's section names it too.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Database => "database",
            Reason::NoAnswer => "no_answer",
            Reason::ModeMismatch => "mode_mismatch",
            Reason::OutcomesWaiting => "outcomes_waiting",
            Reason::WorkerPanicked => "worker_panicked",
            Reason::Capture => "capture",
            Reason::SlotMissing => "slot_missing",
            Reason::SlotLost => "slot_lost",
            Reason::SlotRetainsTooMuch => "slot_retains_too_much",
            Reason::Target => "target",
            Reason::NotServed => "not_served",
            Reason::Catalog => "catalog",
            Reason::NotChecked => "not_checked",
        }
    }

    /// The heading of its section on the troubleshooting page.
    pub fn title(self) -> &'static str {
        match self {
            Reason::Database => "The database refuses or cannot be reached",
            Reason::NoAnswer => "No answer in time",
            Reason::ModeMismatch => "Set up for the other mode",
            Reason::OutcomesWaiting => "Batch outcomes wait for the database",
            Reason::WorkerPanicked => "A batch panicked",
            Reason::Capture => "The capture trigger is missing, disabled or stale",
            Reason::SlotMissing => "The slot does not exist",
            Reason::SlotLost => "The slot lost the WAL it needed",
            Reason::SlotRetainsTooMuch => "The slot keeps too much WAL",
            Reason::Target => "A target fails its health check",
            Reason::NotServed => "A database not served yet",
            Reason::Catalog => "The catalog cannot be read",
            Reason::NotChecked => "Not checked yet",
        }
    }
}

/// The result of one readiness check; shown as `ok` or `error: <why>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// Passed.
    Ok,
    /// Failed: which kind of failure, and why.
    Failed(Reason, String),
}

impl Check {
    fn from_result<E: std::fmt::Display>(reason: Reason, result: Result<(), E>) -> Check {
        match result {
            Ok(()) => Check::Ok,
            Err(e) => Check::Failed(reason, e.to_string()),
        }
    }

    /// What kind of failure, if it failed.
    pub fn reason(&self) -> Option<Reason> {
        match self {
            Check::Ok => None,
            Check::Failed(reason, _) => Some(*reason),
        }
    }

    /// Whether the check passed.
    pub fn is_ok(&self) -> bool {
        matches!(self, Check::Ok)
    }

    /// Why the check failed.
    pub fn error(&self) -> Option<&str> {
        match self {
            Check::Ok => None,
            Check::Failed(_, why) => Some(why),
        }
    }
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Check::Ok => f.write_str("ok"),
            Check::Failed(reason, why) => write!(f, "error ({}): {why}", reason.name()),
        }
    }
}

impl Serialize for Check {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// The `/readyz` body: every check and its result.
#[derive(Debug, Serialize)]
pub struct Readiness {
    /// All checks passed.
    pub ready: bool,
    /// Failed while a batch panicked within the last minute.
    pub workers: Check,
    /// The database answers.
    pub database: Check,
    /// Each target's health check.
    pub targets: BTreeMap<String, Check>,
    /// Targets paused because they cannot be reached: since when, why, and
    /// how many rows wait for each.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub paused: BTreeMap<String, PausedTarget>,
    /// With `[source]`: the capture trigger is there, enabled, and made
    /// from this mapping (someone may drop or disable it while we run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capture: Option<Check>,
    /// Plugin name to `name@version` or `not loaded`.
    pub plugins: BTreeMap<String, String>,
    /// Replication mode: the slot, whether this relay reads it, and the
    /// WAL kept for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replication: Option<SlotReadiness>,
}

/// The replication slot, as `/readyz` shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SlotReadiness {
    /// Its name.
    pub slot: String,
    /// This relay reads it (else it stands by).
    pub reading: bool,
    /// WAL the server keeps for it, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retained_wal_bytes: Option<i64>,
    /// `ok`, or what is wrong: the slot is gone or lost its WAL, or keeps
    /// more than `replication.max_retained_wal_bytes`.
    pub check: Check,
}

/// The slot's state for readiness.
async fn slot_readiness(relay: &Relay) -> Option<SlotReadiness> {
    let settings = relay.replication()?;
    let pg = relay.store().postgres()?;
    let reading = relay.metrics().replication_reading();
    let (retained, check) = match tokio::time::timeout(CHECK_TIMEOUT, pg.slot_status(&settings.slot)).await {
        Ok(Ok(Some(slot))) => {
            let retained = slot.retained_wal_bytes;
            let check = if slot.wal_status.as_deref() == Some("lost") {
                Check::Failed(
                    Reason::SlotLost,
                    "the slot lost the WAL it needed (wal_status = lost)".into(),
                )
            } else if retained
                .is_some_and(|bytes| u64::try_from(bytes).unwrap_or(0) > settings.max_retained_wal_bytes)
            {
                Check::Failed(
                    Reason::SlotRetainsTooMuch,
                    format!(
                        "the server keeps {} bytes of WAL for the slot, over replication.max_retained_wal_bytes ({})",
                        retained.unwrap_or(0),
                        settings.max_retained_wal_bytes
                    ),
                )
            } else {
                Check::Ok
            };
            (retained, check)
        }
        Ok(Ok(None)) => (
            None,
            Check::Failed(Reason::SlotMissing, "the slot does not exist".into()),
        ),
        Ok(Err(error)) => (None, Check::Failed(Reason::Database, error.to_string())),
        Err(_) => (None, Check::Failed(Reason::NoAnswer, "no answer in time".into())),
    };
    Some(SlotReadiness {
        slot: settings.slot.clone(),
        reading,
        retained_wal_bytes: retained,
        check,
    })
}

/// A paused target, as `/readyz` and `/status` show it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PausedTarget {
    /// Since when (RFC 3339).
    pub since: String,
    /// For how long, in seconds.
    pub seconds: u64,
    /// The failure that paused it.
    pub reason: String,
    /// Rows waiting for it in the outbox (all relays'), when the database answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_rows: Option<i64>,
}

/// The paused targets with their waiting rows.
async fn paused_targets(relay: &Relay) -> BTreeMap<String, PausedTarget> {
    let paused = relay.paused_targets();
    if paused.is_empty() {
        return BTreeMap::new();
    }
    let waiting = match tokio::time::timeout(CHECK_TIMEOUT, relay.store().waiting_by_target()).await {
        Ok(Ok(waiting)) => Some(waiting),
        _ => None,
    };
    paused
        .into_iter()
        .map(|(name, state)| {
            let since: chrono::DateTime<chrono::Utc> = state.since.into();
            let target = PausedTarget {
                since: since.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                seconds: state.since.elapsed().map_or(0, |d| d.as_secs()),
                reason: state.reason,
                waiting_rows: waiting.as_ref().map(|w| w.get(&name).copied().unwrap_or(0)),
            };
            (name, target)
        })
        .collect()
}

/// What readiness checks of one database (the rest is shared by all the
/// databases of a process: targets and plugins).
#[derive(Debug, Clone, Serialize)]
pub struct DatabaseReadiness {
    /// All of this database's checks passed.
    pub ready: bool,
    /// Failed while a batch panicked within the last minute.
    pub workers: Check,
    /// The database answers.
    pub database: Check,
    /// Targets paused for this database's rows, as in [`Readiness`].
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub paused: BTreeMap<String, PausedTarget>,
    /// The `[source]` capture trigger, as in [`Readiness`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capture: Option<Check>,
    /// The replication slot, as in [`Readiness`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replication: Option<SlotReadiness>,
    /// With `[ownership]`, on a database another relay serves: that relay.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_by: Option<String>,
}

/// Runs one database's readiness checks at once.
pub async fn database_readiness(relay: &Relay) -> DatabaseReadiness {
    let database = async {
        // The database answers, and is still set up for this relay's mode
        // (a `migrate` for the other one may have run since it started).
        let checked = async {
            relay.store().ping().await?;
            relay.store().mode_mismatch(relay.reads_a_change_stream()).await
        };
        match tokio::time::timeout(CHECK_TIMEOUT, checked).await {
            Ok(Ok(None)) => Check::Ok,
            Ok(Ok(Some(mismatch))) => Check::Failed(Reason::ModeMismatch, mismatch.to_string()),
            Ok(Err(error)) => Check::Failed(Reason::Database, error.to_string()),
            Err(_) => Check::Failed(Reason::NoAnswer, "no answer in time".to_string()),
        }
    };
    let capture = async {
        let capture = relay.capture()?;
        let pg = relay.store().postgres()?;
        Some(
            match tokio::time::timeout(CHECK_TIMEOUT, pg.capture_problem(capture)).await {
                Ok(Ok(None)) => Check::Ok,
                Ok(Ok(Some(problem))) => Check::Failed(Reason::Capture, problem),
                Ok(Err(error)) => Check::Failed(Reason::Database, error.to_string()),
                Err(_) => Check::Failed(Reason::NoAnswer, "no answer in time".to_string()),
            },
        )
    };
    let (database, capture, paused, replication) =
        futures::join!(database, capture, paused_targets(relay), slot_readiness(relay));
    let database = match (database, relay.outcomes_waiting()) {
        (Check::Ok, Some(since)) => Check::Failed(
            Reason::OutcomesWaiting,
            format!(
                "batch outcomes have waited {} s for the database to record them",
                since.as_secs()
            ),
        ),
        (database, _) => database,
    };
    let workers = Check::from_result(Reason::WorkerPanicked, relay.workers_health());
    let ready = database.is_ok()
        && workers.is_ok()
        && capture.as_ref().is_none_or(Check::is_ok)
        && replication.as_ref().is_none_or(|slot| slot.check.is_ok());
    DatabaseReadiness {
        ready,
        workers,
        database,
        paused,
        capture,
        replication,
        served_by: None,
    }
}

/// Each target's health check, at once.
pub async fn target_checks(sinks: &crate::sinks::Sinks) -> BTreeMap<String, Check> {
    futures::future::join_all(sinks.names().map(|name| async move {
        let state = match sinks.recent_health(name, CHECK_TIMEOUT).await {
            Some(result) => Check::from_result(Reason::Target, result),
            None => Check::Failed(Reason::Target, "not configured".to_string()),
        };
        (name.to_string(), state)
    }))
    .await
    .into_iter()
    .collect()
}

/// Plugin name to `name@version` or `not loaded`.
pub fn plugin_states(plugins: &crate::plugin::Plugins) -> BTreeMap<String, String> {
    plugins
        .slots()
        .iter()
        .map(|slot| {
            let state = slot
                .current()
                .map_or_else(|| "not loaded".to_string(), |v| v.label());
            (slot.config().name.clone(), state)
        })
        .collect()
}

/// Whether targets and plugins are all ready.
pub fn shared_ready(targets: &BTreeMap<String, Check>, plugins: &BTreeMap<String, String>) -> bool {
    targets.values().all(Check::is_ok) && plugins.values().all(|state| state != "not loaded")
}

/// Runs every readiness check at once.
pub async fn readiness(relay: &Relay) -> Readiness {
    let (own, targets) = futures::join!(database_readiness(relay), target_checks(relay.sinks()));
    let plugins = plugin_states(relay.plugins());
    Readiness {
        ready: own.ready && shared_ready(&targets, &plugins),
        workers: own.workers,
        database: own.database,
        targets,
        paused: own.paused,
        capture: own.capture,
        plugins,
        replication: own.replication,
    }
}

/// The `/status` body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RelayStatus {
    /// This relay's lease owner name.
    pub owner: String,
    /// Same as `/readyz`.
    pub ready: bool,
    /// `ok` or the database error.
    pub database: String,
    /// Every configured plugin, in match order.
    pub plugins: Vec<PluginStatus>,
    /// Every configured target.
    pub targets: Vec<TargetStatus>,
}

/// One plugin in [`RelayStatus`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PluginStatus {
    /// Name from the config.
    pub name: String,
    /// The component file.
    pub path: String,
    /// Content hash of the version serving now; `None` while unloaded.
    pub version: Option<String>,
    /// Versions that went live after startup.
    pub reloads: u64,
    /// Files refused since startup.
    pub rejected: u64,
    /// The latest load attempt.
    pub last_reload: LastReload,
    /// For a plugin from a registry: its reference, digest and registry state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<RegistrySource>,
}

/// Where a registry plugin's version came from, in [`PluginStatus`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RegistrySource {
    /// `oci://...`, as configured.
    pub reference: String,
    /// The manifest digest serving; `None` before the first pull.
    pub digest: Option<String>,
    /// Whether it came from the cache because the registry was down at start.
    pub from_cache: bool,
    /// The registry's last error; `None` when its last answer was good.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When the registry was last asked (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked_at: Option<String>,
    /// Components pulled since start.
    #[serde(default)]
    pub pulls: u64,
    /// Of those, found in the cache by their digest.
    #[serde(default)]
    pub cache_hits: u64,
    /// How long the latest pull took.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_pull_ms: Option<u64>,
}

/// How the latest load attempt of a plugin file ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LastReload {
    /// When (RFC 3339).
    pub at: String,
    /// `loaded`, `rejected` or `unloaded`.
    pub result: String,
    /// The version that went live, for `loaded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Why the file was refused, for `rejected`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One target in [`RelayStatus`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TargetStatus {
    /// Name from the config.
    pub name: String,
    /// `nats`, `kafka`, `stdout` or `file`.
    pub kind: String,
    /// The health check passed.
    pub healthy: bool,
    /// The health check's error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Set while the relay holds the target paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<PausedTarget>,
}

/// Every configured plugin's state, in match order.
pub fn plugin_statuses(plugins: &crate::plugin::Plugins) -> Vec<PluginStatus> {
    plugins
        .slots()
        .iter()
        .map(|slot| {
            let (at, result) = slot.last_result();
            let (result, version, reason) = match result {
                crate::plugin::ReloadResult::Loaded { version } => ("loaded", Some(version), None),
                crate::plugin::ReloadResult::Rejected { reason } => ("rejected", None, Some(reason)),
                crate::plugin::ReloadResult::Unloaded => ("unloaded", None, None),
            };
            PluginStatus {
                registry: slot.oci().map(|state| RegistrySource {
                    reference: state.reference,
                    digest: state.digest,
                    from_cache: state.from_cache,
                    error: state.registry_error,
                    checked_at: state
                        .checked_at
                        .map(|at| at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
                    pulls: state.pulls,
                    cache_hits: state.cache_hits,
                    last_pull_ms: state.last_pull_ms,
                }),
                name: slot.config().name.clone(),
                path: slot.config().path.display().to_string(),
                version: slot.current().map(|v| v.version().to_string()),
                reloads: slot.reloads(),
                rejected: slot.rejected(),
                last_reload: LastReload {
                    at: at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                    result: result.to_string(),
                    version,
                    reason,
                },
            }
        })
        .collect()
}

/// Collects [`RelayStatus`] (runs the same checks as `/readyz`).
pub async fn relay_status(relay: &Relay) -> RelayStatus {
    let readiness = readiness(relay).await;
    let plugins = plugin_statuses(relay.plugins());
    let targets = readiness
        .targets
        .iter()
        .map(|(name, state)| TargetStatus {
            name: name.clone(),
            kind: relay
                .sinks()
                .get(name)
                .map_or("unknown", |s| s.kind())
                .to_string(),
            healthy: state.is_ok(),
            error: state.error().map(str::to_string),
            paused: readiness.paused.get(name).cloned(),
        })
        .collect();
    RelayStatus {
        owner: relay.owner().to_string(),
        ready: readiness.ready,
        database: readiness.database.to_string(),
        plugins,
        targets,
    }
}

/// Fetches `/status` from a relay's admin endpoint at `addr` (`host:port`),
/// for `database` when the relay serves several.
///
/// # Errors
/// Nothing listens there, the answer is not a status, or it took over 10 s.
pub async fn fetch_status(addr: &str, database: Option<&str>) -> anyhow::Result<RelayStatus> {
    use http_body_util::BodyExt;
    let path = match database {
        Some(name) => {
            if let Some(problem) = crate::config::databases::name_problem(name) {
                anyhow::bail!("database {problem}");
            }
            format!("/status?database={name}")
        }
        None => "/status".to_string(),
    };
    let fetch = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let request = axum::http::Request::get(path.as_str())
            .header(header::HOST, addr)
            .body(http_body_util::Empty::<bytes::Bytes>::new())?;
        let response = sender.send_request(request).await?;
        let status = response.status();
        let body = response.into_body().collect().await?.to_bytes();
        // A fleet's endpoint says why it has no status for a database.
        anyhow::ensure!(
            status.is_success(),
            "the admin endpoint answered {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(300)]).trim()
        );
        Ok::<_, anyhow::Error>(serde_json::from_slice(&body)?)
    };
    tokio::time::timeout(Duration::from_secs(10), fetch)
        .await
        .map_err(|_| anyhow::anyhow!("no answer in 10 s"))?
}

#[cfg(test)]
mod tests {
    use super::Reason;

    /// Each reason a readiness check can fail for has a section of the
    /// troubleshooting page under its title, and the page's table links to
    /// it; a variant added to the enum but not to `Reason::ALL` fails here
    /// too.
    #[test]
    fn every_readiness_reason_has_a_troubleshooting_section() {
        let source = include_str!("mod.rs");
        let body = source
            .split_once("pub enum Reason {")
            .and_then(|(_, rest)| rest.split_once("\n}"))
            .map(|(body, _)| body)
            .expect("the enum");
        let variants = body
            .lines()
            .filter(|line| {
                let line = line.trim();
                line.ends_with(',') && line.starts_with(|c: char| c.is_ascii_uppercase())
            })
            .count();
        assert_eq!(variants, Reason::ALL.len(), "Reason::ALL lists every variant");
        let page = include_str!("../../../docs/src/how-to/troubleshooting.md");
        for reason in Reason::ALL {
            let title = reason.title();
            assert!(
                page.lines().any(|line| line == format!("### {title}")),
                "docs/src/how-to/troubleshooting.md has no section \"### {title}\" for {reason:?}"
            );
            let section = page
                .split(&format!("### {title}\n"))
                .nth(1)
                .and_then(|rest| rest.split("\n#").next())
                .unwrap_or_default();
            assert!(
                section.contains(&format!("`error ({}): ...`", reason.name())),
                "the section \"### {title}\" does not give the name /readyz shows, `{}`",
                reason.name()
            );
            let anchor: String = title
                .to_lowercase()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == ' ' || *c == '-')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect();
            assert!(
                page.contains(&format!("](#{anchor})")),
                "the troubleshooting page's table links to #{anchor}"
            );
        }
    }
}
