//! Wake-ups from PostgreSQL: the outbox's insert trigger NOTIFYs, a listener
//! turns each notification into a worker wake-up. Polling stays the fallback
//! (SQLite, a lost connection).

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{NOTIFY_CHANNEL, OutboxStore};

/// Longest wait between two attempts to (re)connect the listener.
const MAX_RETRY: Duration = Duration::from_secs(5);

impl OutboxStore {
    /// Wakes a worker on every NOTIFY, and all of them after a reconnect
    /// (notifications sent while disconnected are lost, so workers should
    /// look), until `shutdown`. Returns at once on SQLite, which has no NOTIFY.
    pub async fn wake_on_commits(&self, wake: Arc<Notify>, shutdown: CancellationToken) {
        let Some(pool) = self.pg_pool().cloned() else {
            return;
        };
        listen(pool, wake, shutdown).await;
    }
}

async fn listen(pool: sqlx::PgPool, wake: Arc<Notify>, shutdown: CancellationToken) {
    let mut retry = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        let listening = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let mut listener = match listening.await {
            Ok(listener) => listener,
            Err(error) => {
                warn!(%error, retry_ms = retry.as_millis() as u64, "LISTEN failed; polling meanwhile.");
                tokio::select! {
                    () = tokio::time::sleep(retry) => {}
                    () = shutdown.cancelled() => return,
                }
                retry = (retry * 2).min(MAX_RETRY);
                continue;
            }
        };
        retry = Duration::from_millis(100);
        wake.notify_waiters();
        loop {
            let received = tokio::select! {
                received = listener.try_recv() => received,
                () = shutdown.cancelled() => return,
            };
            match received {
                Ok(Some(_)) => wake.notify_one(),
                // Connection lost; the next try_recv reconnects.
                Ok(None) => wake.notify_waiters(),
                Err(error) => {
                    warn!(%error, "LISTEN connection broke; reconnecting.");
                    break;
                }
            }
        }
    }
}
