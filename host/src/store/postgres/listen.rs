//! Wake-ups from PostgreSQL: the outbox's insert trigger NOTIFYs, a listener
//! turns each notification into a worker wake-up. Polling stays the fallback
//! (SQLite, a lost connection).

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::{Acquire, PgPool};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::connect::{CONNECT_TIMEOUT, pinged};
use super::intake_watch::IntakeWatch;
use crate::store::{NOTIFY_CHANNEL, PgOutbox};
use crate::telemetry::{Occurrence, Repeats};

/// Longest wait between two attempts to (re)connect the listener.
const MAX_RETRY: Duration = Duration::from_secs(5);

/// How long the listener may hear nothing before it asks its session for an
/// answer. Behind a link that stopped answering (no reset ever comes) a
/// session that only listens sends nothing the kernel could time out: it
/// would hear nothing for good, and every commit would wait for the poll.
const QUIET_FOR: Duration = Duration::from_secs(5);

impl PgOutbox {
    /// Wakes a worker on every NOTIFY, and all of them after a reconnect
    /// (notifications sent while disconnected are lost, so workers should
    /// look), until `shutdown`. `listening` hears `true` each time a session
    /// starts hearing commits and `false` when it is lost (polling alone
    /// finds rows meanwhile).
    ///
    /// The session is one more than the store's pool holds: a relay that
    /// listens connects its store with one connection fewer.
    pub async fn wake_on_commits(
        &self,
        wake: Arc<Notify>,
        shutdown: CancellationToken,
        listening: impl Fn(bool) + Send + Sync,
    ) {
        let intake = &self.backend.intake;
        listen(&self.backend.pool, intake, &wake, &shutdown, &listening).await;
        intake.deaf();
        listening(false);
    }
}

async fn listen(
    pool: &PgPool,
    intake: &IntakeWatch,
    wake: &Notify,
    shutdown: &CancellationToken,
    listening: &(dyn Fn(bool) + Send + Sync),
) {
    let mut retry = crate::backoff::Backoff::new(Duration::from_millis(100), MAX_RETRY);
    // A database down for an hour is a line when LISTEN fails, one a
    // minute while it still does, and one when it listens again.
    let failing = Repeats::default();
    while !shutdown.is_cancelled() {
        // A pool of its own, one session, new for each listener: sqlx sends
        // UNLISTEN from a dropped listener and pools the session after, so
        // one that stopped answering would hold a place in the relay's pool
        // until the kernel gives up on it, many minutes later.
        let own = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(CONNECT_TIMEOUT)
            .connect_lazy_with((*pool.connect_options()).clone());
        let connecting = async {
            let mut listener = PgListener::connect_with(&own).await?;
            // A lost session ends `hear`; the next comes from the pool's
            // options as they are then (see `hear`).
            listener.eager_reconnect(false);
            listener.listen(NOTIFY_CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let mut listener = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
            Ok(Ok(listener)) => listener,
            failed => {
                let error = match failed {
                    Ok(Err(error)) => error.to_string(),
                    _ => format!("no answer within {} s", CONNECT_TIMEOUT.as_secs()),
                };
                let wait = retry.next_pause();
                match failing.occurred() {
                    Occurrence::First => {
                        warn!(%error, retry_ms = wait.as_millis() as u64, "LISTEN failed; polling meanwhile.")
                    }
                    Occurrence::Still { count, lasting } => warn!(
                        %error, count, lasting_s = lasting.as_secs(),
                        "LISTEN still fails; polling meanwhile."
                    ),
                    Occurrence::Quiet => {}
                }
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = shutdown.cancelled() => return,
                }
                continue;
            }
        };
        retry.reset();
        if let Some((failures, lasted)) = failing.ended() {
            info!(failures, failed_for_s = lasted.as_secs(), "LISTEN works again.");
        }
        intake.listening();
        listening(true);
        wake.notify_waiters();
        hear(&mut listener, intake, wake, shutdown).await;
        intake.deaf();
        listening(false);
    }
}

/// Turns notifications into wake-ups until the session breaks or stops
/// answering, or `shutdown`.
async fn hear(listener: &mut PgListener, intake: &IntakeWatch, wake: &Notify, shutdown: &CancellationToken) {
    loop {
        let received = tokio::select! {
            received = tokio::time::timeout(QUIET_FOR, listener.try_recv()) => received,
            () = shutdown.cancelled() => return,
        };
        match received {
            Ok(Ok(Some(notification))) => {
                intake.heard(notification.payload());
                wake.notify_one();
            }
            // Connection lost. Not left to the listener's own reconnect:
            // its pool has the options of when it was made, and a password
            // that rotated since would be refused.
            Ok(Ok(None)) => {
                wake.notify_waiters();
                return;
            }
            Ok(Err(error)) => {
                warn!(%error, "LISTEN connection broke; reconnecting.");
                return;
            }
            Err(_quiet) => {
                let answered = match listener.acquire().await {
                    Ok(session) => pinged(session).await,
                    Err(_) => false,
                };
                if !answered {
                    warn!(
                        quiet_s = QUIET_FOR.as_secs(),
                        "The LISTEN session stopped answering; listening on a new one."
                    );
                    return;
                }
            }
        }
    }
}
