//! Sessions the relay's workers keep out of the pool between uses: a
//! claim's session waits for its ack, and an ack's for the next claim.
//!
//! At service rates each event is its own batch, and a server process
//! woken for a round trip costs PostgreSQL more than the claim's or the
//! ack's statement. sqlx pings a connection each time it goes back to the
//! pool, and hands out the one idle longest (its caches the coldest): a
//! claim and its ack through the pool were four wake-ups of up to four
//! processes. Kept here they are two, on the session used last.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::pool::PoolConnection;

use super::connect::{PING_IF_IDLE_FOR, pinged};
use crate::store::Error;
use crate::store::types::LeaseId;

type Connection = PoolConnection<sqlx::Postgres>;

/// Runs `work` on `session`, waiting at most `within` for it. A session
/// that did not answer in time is closed, not pooled: what it was sent may
/// still be under way, and the pool's own check when a session comes back
/// (a ping) would wait on it for ever, holding its place.
pub(super) async fn answered<T>(
    session: &mut Connection,
    within: Option<Duration>,
    what: &'static str,
    work: impl AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, Error>,
) -> Result<T, Error> {
    let Some(within) = within else {
        return work(session).await;
    };
    match tokio::time::timeout(within, work(session)).await {
        Ok(done) => done,
        Err(_) => {
            session.close_on_drop();
            Err(Error::Unanswered { what, after: within })
        }
    }
}

/// A session from the pool that is closed, not pooled, when dropped before
/// [`Unfinished::finished`]: what it was sent may still be under way.
pub(super) struct Unfinished {
    pub(super) session: Connection,
    finished: bool,
}

impl Unfinished {
    pub(super) fn new(session: Connection) -> Unfinished {
        Unfinished {
            session,
            finished: false,
        }
    }

    /// Its statement finished: the session may go back to the pool.
    pub(super) fn finished(&mut self) {
        self.finished = true;
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.finished {
            self.session.close_on_drop();
        }
    }
}

/// At most `keep` sessions held out of the pool; none when 0.
#[derive(Debug)]
pub(super) struct Sessions {
    pool: PgPool,
    keep: usize,
    /// How long a statement on a session may go unanswered; see [`answered`].
    pub(super) answer_within: Option<Duration>,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    /// A claim's session until its ack, with when it claimed and when the
    /// lease ends: one whose ack never comes (a batch aborted) is let go
    /// after that.
    claimed: HashMap<LeaseId, (Connection, Instant, Instant)>,
    /// Sessions between uses, the one used last at the end.
    idle: Vec<(Connection, Instant)>,
}

impl Sessions {
    pub(super) fn new(pool: PgPool, keep: usize, answer_within: Option<Duration>) -> Sessions {
        Sessions {
            pool,
            keep,
            answer_within,
            held: Mutex::new(Held::default()),
        }
    }

    /// The session that claimed under `lease`, else the one used last,
    /// else one from the pool. A kept session idle for a second is pinged
    /// first, as the pool would: the server may have closed it meanwhile.
    pub(super) async fn take(&self, lease: Option<LeaseId>) -> Result<Connection, Error> {
        let mut lease = lease;
        // Each kept session in turn, the one used last first, while their
        // pings fail (after a restart of the server, all of them).
        loop {
            let (kept, released) = self.take_kept(lease.take());
            // Dropped outside the lock: each goes back to the pool.
            drop(released);
            let Some((mut connection, used)) = kept else {
                break;
            };
            if used.elapsed() < PING_IF_IDLE_FOR || pinged(&mut connection).await {
                return Ok(connection);
            }
            // It may not even have answered: not back into the pool.
            connection.close_on_drop();
        }
        Ok(self.pool.acquire().await?)
    }

    /// The kept session to use and when it was last used, with the sessions
    /// of leases that ended (their acks never came), to be let go.
    fn take_kept(&self, lease: Option<LeaseId>) -> (Option<(Connection, Instant)>, Vec<Connection>) {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if let Some((connection, used, _)) = lease.and_then(|lease| held.claimed.remove(&lease)) {
            return (Some((connection, used)), Vec::new());
        }
        let expired: Vec<LeaseId> = held
            .claimed
            .iter()
            .filter(|(_, (_, _, ends))| *ends <= now)
            .map(|(lease, _)| *lease)
            .collect();
        let released = expired
            .iter()
            .filter_map(|lease| held.claimed.remove(lease))
            .map(|(connection, _, _)| connection)
            .collect();
        (held.idle.pop(), released)
    }

    /// Keeps a claim's session for its ack, until `ends`.
    pub(super) fn keep_for(&self, lease: LeaseId, connection: Connection, ends: Instant) {
        let refused = self.keep_with(connection, |held, connection| {
            held.claimed.insert(lease, (connection, Instant::now(), ends));
        });
        drop(refused);
    }

    /// Keeps a session that just did its work for the next claim or ack.
    pub(super) fn put_back(&self, connection: Connection) {
        let refused = self.keep_with(connection, |held, connection| {
            held.idle.push((connection, Instant::now()));
        });
        drop(refused);
    }

    /// Closes the pool. Sessions kept out of it would hold its close up
    /// for ever: they go back first, and none is kept once it is closing
    /// (checked under the same lock, so none slips in between).
    pub(super) async fn close(&self) {
        let closing = self.pool.close();
        let released = {
            let mut held = self
                .held
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut released: Vec<Connection> = held
                .claimed
                .drain()
                .map(|(_, (connection, _, _))| connection)
                .collect();
            released.extend(held.idle.drain(..).map(|(connection, _)| connection));
            released
        };
        drop(released);
        closing.await;
    }

    /// Stores `connection` with `store` while fewer than `keep` are held
    /// and the pool is open; otherwise hands it back, to be dropped outside
    /// the lock.
    fn keep_with(
        &self,
        connection: Connection,
        store: impl FnOnce(&mut Held, Connection),
    ) -> Option<Connection> {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.claimed.len() + held.idle.len() >= self.keep || self.pool.is_closed() {
            return Some(connection);
        }
        store(&mut held, connection);
        None
    }
}
