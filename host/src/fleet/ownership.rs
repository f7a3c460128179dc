//! `[ownership]`: several relays share the databases out. For each database
//! it knows, a relay follows the ownership row in that database: it takes a
//! free one while it holds fewer than its share (or any left free for a
//! whole lease), renews what it holds, stops serving a database the moment
//! it cannot renew in time, and gives one up now and then while it holds
//! more than its share, so a relay that joins gets databases without them
//! changing hands back and forth.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{DatabaseState, Fleet};
use crate::config::NamedDatabase;
use crate::store::{OutboxStore, Ownership};

/// A database this relay holds and serves.
struct Held {
    token: i64,
    since: Instant,
    renewed: Instant,
    stop: CancellationToken,
    serving: JoinHandle<()>,
}

/// Follows database `database`'s ownership until `stop`, serving it while
/// this relay holds it.
pub(super) async fn follow(
    fleet: Fleet,
    database: NamedDatabase,
    state: Arc<Mutex<DatabaseState>>,
    stop: CancellationToken,
    lease: Duration,
) {
    let tick = lease / 3;
    let me = fleet.owner().to_string();
    let started = Instant::now();
    let metrics = fleet.metrics().for_database(&database.name);
    let set = |next: DatabaseState| super::set_state(&state, &metrics, next);
    let mut store: Option<OutboxStore> = None;
    let mut held: Option<Held> = None;
    let mut attempts = 0;
    loop {
        if store.is_none() {
            attempts += 1;
            // One session per database followed: the follower's statements
            // are one at a time. Each is bounded by the lease (none is of
            // use after it); `keep` stops serving sooner than that.
            match OutboxStore::connect_unpinged(database.endpoint(), &format!("switchyard {me}"), lease).await
            {
                Ok(connected) => store = Some(connected),
                Err(error) => {
                    let error = crate::redact::url(&error.to_string());
                    if attempts % 10 == 1 {
                        tracing::warn!(%error, attempts, "Cannot connect to the database; trying again.");
                    }
                    set(DatabaseState::Starting {
                        since: started,
                        attempts,
                        last_error: Some(error),
                    });
                }
            }
        }
        if let Some(store) = &store {
            held = match held.take() {
                Some(mut mine) => match keep(&fleet, store, &me, &mut mine, lease, tick).await {
                    Kept::Yes => Some(mine),
                    Kept::No { hand_back } => {
                        // Said at once, not once its batches are done.
                        set(DatabaseState::Standby { owner: None });
                        stop_serving(&fleet, mine, hand_back.then_some(store), &me).await;
                        None
                    }
                },
                None => match look_around(&fleet, store, &me, lease).await {
                    Ok(ownership) => {
                        let taken = take(&fleet, store, &me, &ownership, started, lease).await;
                        match taken {
                            Some(token) => Some(serve(&fleet, &database, &state, &stop, token)),
                            None => {
                                set(DatabaseState::Standby {
                                    owner: ownership.owner.filter(|_| ownership.held),
                                });
                                None
                            }
                        }
                    }
                    Err(error) => {
                        if attempts == 0
                            || matches!(
                                *state.lock().unwrap_or_else(PoisonError::into_inner),
                                DatabaseState::Standby { .. }
                            )
                        {
                            tracing::warn!(%error, "Cannot read who serves the database.");
                        }
                        set(DatabaseState::Starting {
                            since: started,
                            attempts,
                            last_error: Some(error.to_string()),
                        });
                        None
                    }
                },
            };
        }
        tokio::select! {
            () = tokio::time::sleep(tick) => {}
            () = stop.cancelled() => break,
        }
    }
    if let Some(mine) = held {
        stop_serving(&fleet, mine, store.as_ref(), &me).await;
    }
    if let Some(store) = &store {
        let _ = store.relay_stopped(&me).await;
        store.close().await;
    }
}

/// Takes the database if it is free and this relay is under its share, or
/// it has been left free for a whole lease (once this relay has run that
/// long, so that the count of relays has settled).
async fn take(
    fleet: &Fleet,
    store: &OutboxStore,
    me: &str,
    ownership: &Ownership,
    started: Instant,
    lease: Duration,
) -> Option<i64> {
    if ownership.held {
        return None;
    }
    let under_share = fleet.owned() < fleet.fair_share();
    let orphaned = ownership.free_for >= lease && started.elapsed() >= lease;
    if !(under_share || orphaned) {
        return None;
    }
    match store.take_ownership(me, lease).await {
        Ok(Some(token)) => Some(token),
        Ok(None) => None,
        Err(error) => {
            tracing::debug!(%error, "Cannot take the database.");
            None
        }
    }
}

/// Starts serving a database just taken.
fn serve(
    fleet: &Fleet,
    database: &NamedDatabase,
    state: &Arc<Mutex<DatabaseState>>,
    stop: &CancellationToken,
    token: i64,
) -> Held {
    fleet.inner.owned.fetch_add(1, Ordering::Relaxed);
    tracing::info!(token, "This relay now serves the database.");
    let child = stop.child_token();
    let serving = tokio::spawn(
        super::serve(
            fleet.clone(),
            database.clone(),
            state.clone(),
            child.clone(),
            None,
        )
        .in_current_span(),
    );
    let now = Instant::now();
    Held {
        token,
        since: now,
        renewed: now,
        stop: child,
        serving,
    }
}

/// Says this relay runs here, for the others' count of relays, and reads
/// the ownership row, which counts the relays that said so lately (one
/// silent for a whole lease is gone).
async fn look_around(
    fleet: &Fleet,
    store: &OutboxStore,
    me: &str,
    lease: Duration,
) -> Result<Ownership, crate::store::Error> {
    let _ = store.announce_relay(me, fleet.admin_address().as_deref()).await;
    let read = store.ownership(lease).await;
    if let Ok(ownership) = &read {
        fleet.saw_relays(ownership.live_relays);
    }
    read
}

/// Whether a held database stays held after a tick.
enum Kept {
    Yes,
    /// Stop serving it, then hand it back (`hand_back`) unless another
    /// relay is known to have taken it: the release names this relay's
    /// token, so it is harmless where the lease was lost unseen.
    No {
        hand_back: bool,
    },
}

/// Renews a held database; stops serving it when another relay has it or
/// the lease would run out before a renewal gets through, and gives it up
/// when this relay holds more than its share.
///
/// The renewal, and then the tick's other statements, get until shortly
/// before the lease ends, counted from when the last renewal was sent (the
/// database counts from when it ran): each statement has a bound of its
/// own, but three of them in a row on a stalled session outlast a lease,
/// and serving past the lease could overlap the next owner (harmless to
/// order, thanks to row leases, but not what was promised).
async fn keep(
    fleet: &Fleet,
    store: &OutboxStore,
    me: &str,
    mine: &mut Held,
    lease: Duration,
    tick: Duration,
) -> Kept {
    let ends = |renewed: Instant| renewed + lease.saturating_sub(tick / 2);
    let sent = Instant::now();
    let renewal = {
        let (store, me, token) = (store.clone(), me.to_string(), mine.token);
        async move { store.renew_ownership(&me, token, lease).await }
    };
    match until(ends(mine.renewed), renewal).await {
        Some(Ok(true)) => mine.renewed = sent,
        Some(Ok(false)) => {
            tracing::warn!("Another relay took the database over; no longer serving it.");
            return Kept::No { hand_back: false };
        }
        Some(Err(error)) if mine.renewed.elapsed() + tick >= lease => {
            tracing::warn!(%error, "Cannot renew the database's lease in time; no longer serving it.");
            return Kept::No { hand_back: true };
        }
        Some(Err(error)) => tracing::debug!(%error, "Cannot renew the database's lease; trying again."),
        None => {
            tracing::warn!(
                lease_ms = lease.as_millis() as u64,
                "Cannot renew the database's lease in time (no answer); no longer serving it."
            );
            // Handed back once serving has stopped, in case the renewal
            // lands late: the token keeps that from touching a lease
            // another relay took since.
            return Kept::No { hand_back: true };
        }
    }
    // Within the lease as it stands now: a slow answer here only delays
    // the next renewal, which the deadline bounds in turn.
    let looked = {
        let (fleet, store, me) = (fleet.clone(), store.clone(), me.to_string());
        async move { look_around(&fleet, &store, &me, lease).await }
    };
    let _ = until(ends(mine.renewed), looked).await;
    let over_share = fleet.owned() > fleet.fair_share();
    if over_share && mine.since.elapsed() >= 2 * lease && fleet.may_give_up(tick) {
        tracing::info!("Giving the database up: this relay holds more than its share.");
        return Kept::No { hand_back: true };
    }
    Kept::Yes
}

/// `work`'s result if it finishes by `deadline`. It runs on a task of its
/// own that goes on past the deadline, unwatched: dropped mid-statement it
/// would cost the follower its session, and the database a new one just
/// when it is slowest to answer (under load, sessions given up on and
/// opened again kept the CPU busy and every answer late). The follower's
/// next statement waits for the session behind it.
async fn until<T: Send + 'static>(
    deadline: Instant,
    work: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    let task = tokio::spawn(work.in_current_span());
    tokio::time::timeout_at(deadline.into(), task).await.ok()?.ok()
}

/// Stops the relay of a held database (its batches finish or their row
/// leases are released) and, with a store, hands the database back.
async fn stop_serving(fleet: &Fleet, mine: Held, store: Option<&OutboxStore>, me: &str) {
    mine.stop.cancel();
    let _ = mine.serving.await;
    fleet.inner.owned.fetch_sub(1, Ordering::Relaxed);
    if let Some(store) = store
        && let Err(error) = store.release_ownership(me, mine.token).await
    {
        tracing::debug!(%error, "Cannot hand the database back; its lease will run out.");
    }
}
