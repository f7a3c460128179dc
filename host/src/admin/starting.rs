//! The admin endpoint while the relay waits for its database: alive on
//! `/healthz`, not ready on `/readyz` with the reason, so an orchestrator
//! neither restarts it nor sends it work while an operator fixes the
//! database. The targets and plugins are checked as they will be served.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use super::{AdminServer, Check, Readiness, metrics_response, plugin_states, target_checks};
use crate::runtime::Shared;

/// Why the database is not served yet, shared with the loop that retries.
#[derive(Clone, Default)]
pub struct Waiting(Arc<Mutex<String>>);

impl Waiting {
    /// Says why the latest attempt failed.
    pub fn set(&self, reason: String) {
        match self.0.lock() {
            Ok(mut current) => *current = reason,
            Err(poisoned) => *poisoned.into_inner() = reason,
        }
    }

    fn reason(&self) -> String {
        match self.0.lock() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }
}

#[derive(Clone)]
struct Starting {
    shared: Arc<StartingParts>,
    waiting: Waiting,
}

struct StartingParts {
    sinks: crate::sinks::Sinks,
    plugins: crate::plugin::Plugins,
    metrics: crate::metrics::Metrics,
}

/// Serves the waiting relay's endpoints on `listener` until `shutdown`.
///
/// # Errors
/// The listener has no local address.
pub fn serve(
    listener: tokio::net::TcpListener,
    shared: &Shared,
    waiting: Waiting,
    shutdown: CancellationToken,
) -> anyhow::Result<AdminServer> {
    let state = Starting {
        shared: Arc::new(StartingParts {
            sinks: shared.sinks.clone(),
            plugins: shared.plugins.clone(),
            metrics: shared.metrics.clone(),
        }),
        waiting,
    };
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state);
    super::serve_listener(listener, app, shutdown)
}

async fn metrics(State(starting): State<Starting>) -> Response {
    metrics_response(starting.shared.metrics.render())
}

async fn readyz(State(starting): State<Starting>) -> Response {
    let targets = target_checks(&starting.shared.sinks).await;
    let readiness = Readiness {
        ready: false,
        workers: Check::Failed("not started: the database is not served yet".to_string()),
        database: Check::Failed(starting.waiting.reason()),
        targets,
        paused: std::collections::BTreeMap::new(),
        capture: None,
        plugins: plugin_states(&starting.shared.plugins),
        replication: None,
    };
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(readiness)).into_response()
}
