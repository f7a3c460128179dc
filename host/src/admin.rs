//! The admin HTTP endpoint: `/metrics` (Prometheus text), `/healthz` (the
//! process answers) and `/readyz` (database reachable, every target's health
//! check passing, every plugin loaded).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::relay::Relay;

/// Bound on each readiness check, so a hung broker makes `/readyz` say
/// not-ready instead of hanging the probe.
const CHECK_TIMEOUT: Duration = Duration::from_secs(3);

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
}

/// Binds `listen` and serves the admin endpoints for `relay` until `shutdown`.
///
/// # Errors
/// The address cannot be bound (in use, not local, bad syntax).
pub async fn serve(listen: &str, relay: Relay, shutdown: CancellationToken) -> anyhow::Result<AdminServer> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen} for the admin endpoint: {e}"))?;
    let local_addr = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(relay);
    let handle = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::warn!(error = %e, "Admin endpoint stopped.");
        }
    });
    tracing::info!(%local_addr, "Admin endpoint listening (/metrics, /healthz, /readyz).");
    Ok(AdminServer { local_addr, handle })
}

async fn metrics(State(relay): State<Relay>) -> Response {
    // Backlog figures are read at scrape time, so they are as fresh as the scrape.
    match tokio::time::timeout(CHECK_TIMEOUT, relay.store().backlog()).await {
        Ok(Ok((rows, oldest))) => {
            relay.metrics().backlog.set(rows);
            relay.metrics().oldest_pending_age.set(oldest.unwrap_or(0.0));
        }
        Ok(Err(e)) => tracing::debug!(error = %e, "Backlog query failed during a scrape."),
        Err(_) => tracing::debug!("Backlog query timed out during a scrape."),
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        relay.metrics().render(),
    )
        .into_response()
}

/// The `/readyz` body: every check and its result.
#[derive(Debug, Serialize)]
pub struct Readiness {
    /// All checks passed.
    pub ready: bool,
    /// `ok` or the error.
    pub database: String,
    /// Target name to `ok` or the error.
    pub targets: BTreeMap<String, String>,
    /// Plugin name to `name@version` or `not loaded`.
    pub plugins: BTreeMap<String, String>,
}

/// Runs every readiness check at once.
pub async fn readiness(relay: &Relay) -> Readiness {
    let database = async {
        match tokio::time::timeout(CHECK_TIMEOUT, relay.store().ping()).await {
            Ok(Ok(())) => "ok".to_string(),
            Ok(Err(e)) => format!("error: {e}"),
            Err(_) => "error: no answer in time".to_string(),
        }
    };
    let targets = futures::future::join_all(relay.sinks().names().map(|name| async move {
        let sink = relay.sinks().get(name).cloned();
        let state = match sink {
            Some(sink) => match tokio::time::timeout(CHECK_TIMEOUT, sink.healthcheck()).await {
                Ok(Ok(())) => "ok".to_string(),
                Ok(Err(e)) => format!("error: {e}"),
                Err(_) => "error: health check timed out".to_string(),
            },
            None => "error: not configured".to_string(),
        };
        (name.to_string(), state)
    }));
    let (database, targets) = futures::join!(database, targets);
    let plugins: BTreeMap<String, String> = relay
        .plugins()
        .slots()
        .iter()
        .map(|slot| {
            let state = slot
                .current()
                .map_or_else(|| "not loaded".to_string(), |v| v.label());
            (slot.config().name.clone(), state)
        })
        .collect();
    let ready = database == "ok"
        && targets.iter().all(|(_, state)| state == "ok")
        && plugins.values().all(|state| state != "not loaded");
    Readiness {
        ready,
        database,
        targets: targets.into_iter().collect(),
        plugins,
    }
}

async fn readyz(State(relay): State<Relay>) -> Response {
    let readiness = readiness(&relay).await;
    let status = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(readiness)).into_response()
}
