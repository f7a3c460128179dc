//! Retention: removes published rows past their age, so the outbox stays the
//! size of its recent history. Every relay runs it; SKIP LOCKED keeps them
//! out of each other's way, and each batch is one short statement.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::RetentionConfig;
use crate::metrics::Metrics;
use crate::store::{self, OutboxStore, RetentionMode};

/// Pause between batches of one pass, so retention yields to the relay's
/// own statements on a busy database.
const BATCH_PAUSE: Duration = Duration::from_millis(20);

fn mode_name(mode: RetentionMode) -> &'static str {
    match mode {
        RetentionMode::Delete => "delete",
        RetentionMode::Archive => "archive",
    }
}

/// One pass: batches until no published row is past its age (or `shutdown`).
/// Returns how many rows went.
///
/// # Errors
/// [`store::Error`] from the first batch that failed; earlier batches stay done.
pub async fn pass(
    store: &OutboxStore,
    config: &RetentionConfig,
    metrics: Option<&Metrics>,
    shutdown: &CancellationToken,
) -> Result<u64, store::Error> {
    let max_age = Duration::from_secs(config.published_max_age_seconds);
    let mut total = 0;
    loop {
        let removed = store
            .prune_published(max_age, config.mode, config.batch_size)
            .await?;
        total += removed;
        if let Some(metrics) = metrics {
            metrics.retention(mode_name(config.mode), removed);
        }
        if removed < u64::from(config.batch_size) || shutdown.is_cancelled() {
            return Ok(total);
        }
        tokio::time::sleep(BATCH_PAUSE).await;
    }
}

/// Runs a pass every `interval_seconds` until `shutdown`.
pub async fn run(store: OutboxStore, config: RetentionConfig, metrics: Metrics, shutdown: CancellationToken) {
    let interval = Duration::from_secs(config.interval_seconds);
    let mode = mode_name(config.mode);
    info!(
        retention.max_age_seconds = config.published_max_age_seconds,
        retention.mode = mode,
        "Retention on for published rows."
    );
    loop {
        match pass(&store, &config, Some(&metrics), &shutdown).await {
            Ok(0) => debug!("Retention pass found nothing to remove."),
            Ok(rows) => info!(
                rows,
                retention.mode = mode,
                "Retention pass removed published rows."
            ),
            Err(error) => warn!(%error, "Retention pass failed; will try again next interval."),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}
