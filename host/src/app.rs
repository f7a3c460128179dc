//! The relay process: loads the config, handles signals and runs one
//! database (waiting, not ready, until it can be served) or a fleet of
//! many, built by [`crate::runtime`].

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::relay::RelayBuilder;
use crate::runtime::{Shared, announce, database_builder};

/// Runs the relay until SIGINT or SIGTERM.
///
/// What is unreachable or not set up yet (the database, a target) does not
/// stop it: the relay starts, says on `/readyz` why it is not ready, and
/// serves what it can as soon as it can. Only its own configuration (a
/// plugin that does not load, a refused target setting, an admin address
/// it cannot bind) stops the start.
///
/// # Errors
/// Those configuration failures, or a failure to release leases at the end.
pub async fn run(config: Config) -> anyhow::Result<()> {
    if config.serves_many() {
        return run_fleet(config).await;
    }
    let shutdown = CancellationToken::new();
    cancel_on_signal(shutdown.clone());
    let mut shared = Shared::start(&config).await?;
    let watcher = shared.watcher.take();
    let listener = if config.admin.listen.is_empty() {
        None
    } else {
        Some(crate::admin::bind(&config.admin.listen).await?)
    };
    let Some((builder, listener)) = wait_for_database(&config, &shared, listener, &shutdown).await? else {
        return Ok(());
    };
    let relay = builder.watcher(watcher).build();
    let admin = match listener {
        Some(listener) => Some(crate::admin::serve_on(listener, relay.clone(), shutdown.clone())?),
        None => None,
    };
    let announcer = tokio::spawn(announce(
        relay.store().clone(),
        relay.owner().to_string(),
        admin.as_ref().map(|admin| admin.local_addr.to_string()),
        shutdown.clone(),
    ));
    let retention = config.retention.clone().map(|retention| {
        tokio::spawn(crate::retention::run(
            relay.store().clone(),
            retention,
            relay.metrics().clone(),
            shutdown.clone(),
        ))
    });
    let result = relay.run(shutdown).await;
    let _ = announcer.await;
    if let Some(retention) = retention {
        let _ = retention.await;
    }
    if let Some(admin) = admin {
        admin.stopped().await;
    }
    result
}

/// Longest pause between two tries at a database that cannot be served.
const DATABASE_RETRY_MAX: Duration = Duration::from_secs(5);

/// The relay for the database, once it can be served: tried at once, then
/// again with a growing pause while it is unreachable, not migrated or set
/// up for the other mode, the admin endpoint meanwhile answering not ready
/// with the reason. `None` when shut down first. The listener comes back
/// for the relay's own admin endpoint (bound again, on the same address,
/// when the waiting one served it).
async fn wait_for_database(
    config: &Config,
    shared: &Shared,
    mut listener: Option<tokio::net::TcpListener>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<(RelayBuilder, Option<tokio::net::TcpListener>)>> {
    let waiting = crate::admin::starting::Waiting::default();
    let mut endpoint = None;
    let mut attempts = 0u32;
    let mut pause = crate::backoff::Backoff::new(Duration::from_millis(500), DATABASE_RETRY_MAX);
    let builder = loop {
        attempts += 1;
        let error = match database_builder(config, crate::metrics::DEFAULT_DATABASE, shared).await {
            Ok(builder) => break builder,
            Err(error) => crate::redact::url(&format!("{error:#}")),
        };
        // The first failure and then every tenth: a database down for
        // hours is a line every few minutes.
        let wait = pause.next_pause();
        if attempts % 10 == 1 {
            tracing::warn!(attempts, %error, retry_in_ms = wait.as_millis() as u64, "Cannot serve the database yet; not ready, trying again.");
        }
        waiting.set(error);
        shared
            .metrics
            .for_database(crate::metrics::DEFAULT_DATABASE)
            .set_database_served(false);
        if endpoint.is_none()
            && let Some(bound) = listener.take()
        {
            let stop = shutdown.child_token();
            let address = bound.local_addr()?;
            let server = crate::admin::starting::serve(bound, shared, waiting.clone(), stop.clone())?;
            endpoint = Some((server, stop, address));
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shutdown.cancelled() => return Ok(None),
        }
    };
    if attempts > 1 {
        tracing::info!(attempts, "The database can be served now.");
    }
    shared
        .metrics
        .for_database(crate::metrics::DEFAULT_DATABASE)
        .set_database_served(true);
    if let Some((server, stop, address)) = endpoint {
        stop.cancel();
        server.stopped_within(Duration::from_secs(2)).await;
        listener = Some(crate::admin::bind(&address.to_string()).await?);
    }
    Ok(Some((builder, listener)))
}

/// Serves every database of a `[[databases]]` config until SIGINT or SIGTERM.
async fn run_fleet(config: Config) -> anyhow::Result<()> {
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
    let fleet = crate::fleet::Fleet::start_announcing(config, address, shutdown.clone()).await?;
    let admin = match listener
        .map(|listener| crate::fleet::admin::serve_on(listener, fleet.clone(), shutdown.clone()))
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
