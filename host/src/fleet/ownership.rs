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

/// Where the follower of one database stands.
enum Follower {
    /// No session to the database yet.
    Connecting,
    /// Connected, serving nothing: the database is another relay's, or
    /// this one may not take it yet.
    Standby { store: OutboxStore },
    /// Connected, holding the database and serving it.
    Holding { store: OutboxStore, held: Held },
}

/// What one database's follower works with.
struct Following {
    fleet: Fleet,
    database: NamedDatabase,
    state: Arc<Mutex<DatabaseState>>,
    stop: CancellationToken,
    me: String,
    started: Instant,
    lease: Duration,
    /// Connection tries so far.
    attempts: u32,
}

impl Following {
    fn set(&self, next: DatabaseState) {
        let metrics = self.fleet.metrics().for_database(&self.database.name);
        super::set_state(&self.state, &metrics, next);
    }

    fn starting(&self, error: String) {
        self.set(DatabaseState::Starting {
            since: self.started,
            attempts: self.attempts,
            last_error: Some(error),
        });
    }

    /// One tick: the state the follower moves to from `follower`.
    async fn step(&mut self, follower: Follower) -> Follower {
        match follower {
            Follower::Connecting => self.connect().await,
            Follower::Standby { store } => self.look_around(store).await,
            Follower::Holding { store, mut held } => {
                match keep(
                    &self.fleet,
                    &store,
                    &self.me,
                    &mut held,
                    self.lease,
                    self.lease / 3,
                )
                .await
                {
                    Kept::Yes => Follower::Holding { store, held },
                    Kept::No { hand_back } => {
                        // Said at once, not once its batches are done.
                        self.set(DatabaseState::Standby { owner: None });
                        stop_serving(&self.fleet, held, hand_back.then_some(&store), &self.me).await;
                        Follower::Standby { store }
                    }
                }
            }
        }
    }

    /// One session per database followed: the follower's statements are
    /// one at a time. Each is bounded by the lease (none is of use after
    /// it); `keep` stops serving sooner than that.
    async fn connect(&mut self) -> Follower {
        self.attempts += 1;
        let name = format!("switchyard {}", self.me);
        match OutboxStore::connect_unpinged(self.database.endpoint(), &name, self.lease).await {
            // Looked around at once, not a tick later.
            Ok(store) => self.look_around(store).await,
            Err(error) => {
                let error = crate::redact::url(&error.to_string());
                if self.attempts % 10 == 1 {
                    tracing::warn!(%error, attempts = self.attempts, "Cannot connect to the database; trying again.");
                }
                self.starting(error);
                Follower::Connecting
            }
        }
    }

    /// Takes the database when it may, else stands by.
    async fn look_around(&mut self, store: OutboxStore) -> Follower {
        let ownership = match look_around(&self.fleet, &store, &self.me, self.lease).await {
            Ok(ownership) => ownership,
            Err(error) => {
                let was_standing_by = matches!(
                    *self.state.lock().unwrap_or_else(PoisonError::into_inner),
                    DatabaseState::Standby { .. }
                );
                if was_standing_by {
                    tracing::warn!(%error, "Cannot read who serves the database.");
                }
                self.starting(error.to_string());
                return Follower::Standby { store };
            }
        };
        match take(
            &self.fleet,
            &store,
            &self.me,
            &ownership,
            self.started,
            self.lease,
        )
        .await
        {
            Some(token) => {
                let held = serve(&self.fleet, &self.database, &self.state, &self.stop, token);
                Follower::Holding { store, held }
            }
            None => {
                self.set(DatabaseState::Standby {
                    owner: ownership.owner.filter(|_| ownership.held),
                });
                Follower::Standby { store }
            }
        }
    }
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
    let mut following = Following {
        me: fleet.owner().to_string(),
        fleet,
        database,
        state,
        stop: stop.clone(),
        started: Instant::now(),
        lease,
        attempts: 0,
    };
    let mut follower = Follower::Connecting;
    loop {
        follower = following.step(follower).await;
        tokio::select! {
            () = tokio::time::sleep(lease / 3) => {}
            () = stop.cancelled() => break,
        }
    }
    let me = &following.me;
    let store = match follower {
        Follower::Connecting => return,
        Follower::Standby { store } => store,
        Follower::Holding { store, held } => {
            stop_serving(&following.fleet, held, Some(&store), me).await;
            store
        }
    };
    let _ = store.relay_stopped(me).await;
    store.close().await;
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
    let ends = |renewed: Instant| serve_until(renewed, lease, tick);
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

/// Until when a database renewed at `renewed` may be served without a
/// later renewal: half a tick before its lease ends. The database counts
/// the lease from when the renewal ran, after it was sent, so that is at
/// least half a tick before the lease ends as the database sees it.
fn serve_until(renewed: Instant, lease: Duration, tick: Duration) -> Instant {
    renewed + lease.saturating_sub(tick / 2)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_database_is_given_up_a_sixth_of_its_lease_before_the_lease_ends() {
        let renewed = Instant::now();
        for (lease_s, margin_ms) in [(3, 500), (12, 2000), (30, 5000)] {
            let lease = Duration::from_secs(lease_s);
            let tick = lease / 3;
            let until = serve_until(renewed, lease, tick);
            assert_eq!(
                renewed + lease - until,
                Duration::from_millis(margin_ms),
                "{lease:?}"
            );
            // The next tick's renewal, sent a tick later, has a tick and a
            // half to be answered.
            assert_eq!(until - (renewed + tick), tick * 3 / 2, "{lease:?}");
        }
    }
}
