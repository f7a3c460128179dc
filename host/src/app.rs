//! The relay process: handles signals and runs the fleet of the config's
//! databases (one or many) until told to stop.

use tokio_util::sync::CancellationToken;

use crate::config::Config;

/// Runs the relay until SIGINT or SIGTERM: one database or many, each a
/// member of the [`crate::fleet::Fleet`] (one database is a fleet of one).
///
/// What is unreachable or not set up yet (a database, a target) does not
/// stop it: the relay starts, says on `/readyz` why it is not ready, and
/// serves what it can as soon as it can. Only its own configuration (a
/// plugin that does not load, a refused target setting, an admin address
/// it cannot bind) stops the start.
///
/// # Errors
/// Those configuration failures.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    // Bound first, so that each database's first `switchyard_relays` row
    // already says where `status` finds it.
    let listener = if config.admin.listen.is_empty() {
        None
    } else {
        Some(crate::admin::bind(&config.admin.listen).await?)
    };
    let address = listener
        .as_ref()
        .and_then(|listener| listener.local_addr().ok())
        .map(|addr| addr.to_string());
    let admin_config = config.admin.clone();
    let fleet = crate::fleet::Fleet::start_announcing(config, address, shutdown.clone()).await?;
    let console = if admin_config.console {
        crate::console::router(fleet.clone(), &admin_config, shutdown.clone())
    } else {
        axum::Router::new()
    };
    let admin = match listener
        .map(|listener| crate::fleet::admin::serve_with(listener, fleet.clone(), console, shutdown.clone()))
    {
        Some(Err(error)) => {
            shutdown.cancel();
            fleet.stopped().await;
            return Err(error);
        }
        Some(Ok(admin)) => Some(admin),
        None => None,
    };
    cancel_on_signal(shutdown.clone());
    fleet.stopped().await;
    if let Some(admin) = admin {
        admin.stopped().await;
    }
    Ok(())
}

/// Cancels `shutdown` at SIGINT or SIGTERM.
fn cancel_on_signal(shutdown: CancellationToken) {
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("Shutdown requested; no new batches will be claimed.");
        shutdown.cancel();
    });
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
