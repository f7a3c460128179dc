//! The admin endpoint while the relay waits for its database: alive on
//! `/healthz`, not ready on `/readyz` and unavailable on `/status`, each
//! with the reason, so an orchestrator neither restarts it nor sends it work
//! while an operator fixes the database. The targets and plugins are
//! checked as they will be served.

use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::Response;
use tokio_util::sync::CancellationToken;

use super::{AdminServer, Check, Readiness, plugin_states, target_checks};
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
    super::serve_listener(listener, super::router(state), shutdown)
}

impl super::Served for Starting {
    async fn scrape(&self) -> String {
        self.shared.metrics.render()
    }

    async fn readyz(&self) -> Response {
        let readiness = Readiness {
            ready: false,
            workers: Check::Failed("not started: the database is not served yet".to_string()),
            database: Check::Failed(self.waiting.reason()),
            targets: target_checks(&self.shared.sinks).await,
            paused: std::collections::BTreeMap::new(),
            capture: None,
            plugins: plugin_states(&self.shared.plugins),
            replication: None,
        };
        super::readyz_response(false, readiness)
    }

    async fn status(&self, _database: Option<String>) -> Response {
        super::status_refused(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the database is not served yet: {}", self.waiting.reason()),
        )
    }
}
