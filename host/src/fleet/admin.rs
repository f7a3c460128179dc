//! The admin endpoint of a relay serving many databases: one `/metrics`
//! for all (each figure labelled with its database), and a `/readyz` that
//! says which databases are served: `ok`, `degraded` (some are not, the
//! process still serves the rest: 200) or `down` (none is, or a target or
//! plugin fails: 503), and `/status?database=NAME`, one database's status
//! as a single relay gives it. A fleet of one (a `[database]` config)
//! answers `/readyz` as that one relay.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::{DatabaseState, Fleet};
use crate::admin::{AdminServer, Check, DatabaseReadiness, Reason};

/// Databases checked at once by a scrape or a readiness probe: a fleet of
/// hundreds must not open a connection to each at the same moment.
const CHECKS_AT_ONCE: usize = 16;

/// Binds `listen` and serves the fleet's admin endpoints until `shutdown`.
///
/// # Errors
/// The address cannot be bound.
pub async fn serve(listen: &str, fleet: Fleet, shutdown: CancellationToken) -> anyhow::Result<AdminServer> {
    serve_on(crate::admin::bind(listen).await?, fleet, shutdown)
}

/// Serves the fleet's admin endpoints on a bound `listener` until `shutdown`.
///
/// # Errors
/// The listener has no local address.
pub fn serve_on(
    listener: tokio::net::TcpListener,
    fleet: Fleet,
    shutdown: CancellationToken,
) -> anyhow::Result<AdminServer> {
    serve_with(listener, fleet, axum::Router::new(), shutdown)
}

/// [`serve_on`], with more routes beside the admin endpoints (the console).
///
/// # Errors
/// The listener has no local address.
pub fn serve_with(
    listener: tokio::net::TcpListener,
    fleet: Fleet,
    more: axum::Router,
    shutdown: CancellationToken,
) -> anyhow::Result<AdminServer> {
    crate::admin::serve_listener(listener, crate::admin::router(fleet).merge(more), shutdown)
}

/// The fleet's `/readyz` body.
#[derive(Debug, Serialize)]
pub struct FleetReadiness {
    /// The process serves at least one database, and every target and
    /// plugin is ready.
    pub ready: bool,
    /// `ok` (everything ready), `degraded` (ready, but some databases are
    /// not) or `down`.
    pub state: &'static str,
    /// Each database's checks.
    pub databases: BTreeMap<String, DatabaseReadiness>,
    /// Each target's health check.
    pub targets: BTreeMap<String, Check>,
    /// Plugin name to `name@version` or `not loaded`.
    pub plugins: BTreeMap<String, String>,
    /// With `[catalog]`: whether its last read worked (while it fails, the
    /// databases it listed last are served: degraded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub catalog: Option<Check>,
}

/// Runs every readiness check: each database's (a bounded number at a
/// time) and the shared ones once.
pub async fn readiness(fleet: &Fleet) -> FleetReadiness {
    let databases = futures::stream::iter(fleet.databases())
        .map(|(name, state)| async move { (name, database_readiness(state).await) })
        .buffer_unordered(CHECKS_AT_ONCE)
        .collect::<BTreeMap<_, _>>();
    let (databases, targets) = futures::join!(databases, crate::admin::target_checks(fleet.sinks()));
    let plugins = crate::admin::plugin_states(fleet.plugins());
    let shared = crate::admin::shared_ready(&targets, &plugins);
    let serving = databases.values().filter(|database| database.ready).count();
    let catalog = fleet.catalog().map(|read| match read {
        Ok(()) => Check::Ok,
        Err(error) => Check::Failed(Reason::Catalog, error),
    });
    let catalog_ok = catalog.as_ref().is_none_or(Check::is_ok);
    let state = if !shared || (serving == 0 && !(databases.is_empty() && catalog_ok)) {
        "down"
    } else if serving < databases.len() || !catalog_ok {
        "degraded"
    } else {
        "ok"
    };
    FleetReadiness {
        ready: state != "down",
        state,
        databases,
        targets,
        plugins,
        catalog,
    }
}

async fn database_readiness(state: DatabaseState) -> DatabaseReadiness {
    match state {
        DatabaseState::Running(relay) => crate::admin::database_readiness(&relay).await,
        // Another relay's to serve: nothing to fail here.
        DatabaseState::Standby { owner } => DatabaseReadiness {
            ready: true,
            workers: Check::Ok,
            database: Check::Ok,
            paused: BTreeMap::new(),
            capture: None,
            replication: None,
            served_by: Some(owner.unwrap_or_else(|| "nobody yet".to_string())),
        },
        DatabaseState::Starting {
            since,
            attempts,
            last_error,
        } => DatabaseReadiness {
            ready: false,
            workers: Check::Failed(Reason::NotServed, "not started".to_string()),
            database: Check::Failed(
                Reason::NotServed,
                format!(
                    "not served for {} s ({attempts} tries): {}",
                    since.elapsed().as_secs(),
                    last_error.as_deref().unwrap_or("connecting")
                ),
            ),
            paused: BTreeMap::new(),
            capture: None,
            replication: None,
            served_by: None,
        },
    }
}

/// `/readyz` of a fleet of one: the single relay's body, also before the
/// relay runs (not ready, the database check saying why).
async fn alone_readyz(fleet: &Fleet, state: DatabaseState) -> Response {
    use crate::admin::Served;
    let last_error = match state {
        DatabaseState::Running(relay) => return relay.readyz().await,
        DatabaseState::Starting { last_error, .. } => last_error,
        DatabaseState::Standby { owner } => Some(format!(
            "served by {}",
            owner.as_deref().unwrap_or("no relay yet")
        )),
    };
    let readiness = crate::admin::Readiness {
        ready: false,
        workers: Check::Failed(
            Reason::NotServed,
            "not started: the database is not served yet".to_string(),
        ),
        database: Check::Failed(
            Reason::NotServed,
            last_error.unwrap_or_else(|| "connecting".to_string()),
        ),
        targets: crate::admin::target_checks(fleet.sinks()).await,
        paused: BTreeMap::new(),
        capture: None,
        plugins: crate::admin::plugin_states(fleet.plugins()),
        replication: None,
    };
    crate::admin::readyz_response(false, readiness)
}

impl crate::admin::Served for Fleet {
    async fn scrape(&self) -> String {
        let running: Vec<_> = self
            .databases()
            .into_values()
            .filter_map(|state| match state {
                DatabaseState::Running(relay) => Some(relay),
                DatabaseState::Starting { .. } | DatabaseState::Standby { .. } => None,
            })
            .collect();
        futures::stream::iter(running)
            .for_each_concurrent(CHECKS_AT_ONCE, |relay| async move {
                crate::admin::refresh_scraped(&relay).await;
            })
            .await;
        self.metrics().render()
    }

    async fn readyz(&self) -> Response {
        if self.alone()
            && let Some(state) = self.databases().into_values().next()
        {
            return alone_readyz(self, state).await;
        }
        let readiness = readiness(self).await;
        crate::admin::readyz_response(readiness.ready, readiness)
    }

    /// One database's status; the name may be left out when there is one.
    async fn status(&self, database: Option<String>) -> Response {
        let databases = self.databases();
        let names = || databases.keys().cloned().collect::<Vec<_>>().join(", ");
        let refuse = crate::admin::status_refused;
        let name = match database {
            Some(name) => name,
            None if databases.len() == 1 => databases.keys().next().cloned().unwrap_or_default(),
            None => {
                return refuse(
                    StatusCode::BAD_REQUEST,
                    format!("which database? /status?database=NAME, one of: {}", names()),
                );
            }
        };
        match databases.get(&name) {
            Some(DatabaseState::Running(relay)) => {
                axum::Json(crate::admin::relay_status(relay).await).into_response()
            }
            Some(DatabaseState::Standby { owner }) => refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "database {name:?} is served by {}, not here",
                    owner.as_deref().unwrap_or("no relay yet")
                ),
            ),
            Some(DatabaseState::Starting { last_error, .. }) => refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "database {name:?} is not served yet: {}",
                    last_error.as_deref().unwrap_or("connecting")
                ),
            ),
            None => refuse(
                StatusCode::NOT_FOUND,
                format!("no database {name:?} here; served: {}", names()),
            ),
        }
    }
}
