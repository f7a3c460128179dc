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
use std::time::Instant;

use sqlx::pool::PoolConnection;
use sqlx::{Connection as _, PgPool};

use super::connect::PING_IF_IDLE_FOR;
use crate::store::Error;
use crate::store::types::LeaseId;

type Connection = PoolConnection<sqlx::Postgres>;

/// A session as the claims and acks use it.
#[derive(Debug)]
pub(super) struct Session {
    connection: Connection,
    /// The claim statements prepared on it by name (see
    /// [`super::claim::ack_then_claim`]), a bit each; `None` until looked
    /// at. A session from the pool may have been kept before.
    pub(super) prepared: Option<u8>,
}

impl Session {
    fn new(connection: Connection) -> Session {
        Session {
            connection,
            prepared: None,
        }
    }
}

impl Session {
    /// The connection, and what is prepared on it.
    pub(super) fn parts(&mut self) -> (&mut sqlx::PgConnection, &mut Option<u8>) {
        (&mut self.connection, &mut self.prepared)
    }
}

impl std::ops::Deref for Session {
    type Target = sqlx::PgConnection;

    fn deref(&self) -> &sqlx::PgConnection {
        &self.connection
    }
}

impl std::ops::DerefMut for Session {
    fn deref_mut(&mut self) -> &mut sqlx::PgConnection {
        &mut self.connection
    }
}

/// At most `keep` sessions held out of the pool; none when 0.
#[derive(Debug)]
pub(super) struct Sessions {
    pool: PgPool,
    keep: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    /// A claim's session until its ack, with when it claimed and when the
    /// lease ends: one whose ack never comes (a batch aborted) is let go
    /// after that.
    claimed: HashMap<LeaseId, (Session, Instant, Instant)>,
    /// Sessions between uses, the one used last at the end.
    idle: Vec<(Session, Instant)>,
}

impl Sessions {
    pub(super) fn new(pool: PgPool, keep: usize) -> Sessions {
        Sessions {
            pool,
            keep,
            held: Mutex::new(Held::default()),
        }
    }

    /// Whether sessions are kept at all.
    pub(super) fn keeps(&self) -> bool {
        self.keep > 0
    }

    /// The session that claimed under `lease`, else the one used last,
    /// else one from the pool. A kept session idle for a second is pinged
    /// first, as the pool would: the server may have closed it meanwhile.
    pub(super) async fn take(&self, lease: Option<LeaseId>) -> Result<Session, Error> {
        let mut lease = lease;
        // Each kept session in turn, the one used last first, while their
        // pings fail (after a restart of the server, all of them).
        loop {
            let (kept, released) = self.take_kept(lease.take());
            // Dropped outside the lock: each goes back to the pool.
            drop(released);
            let Some((mut session, used)) = kept else {
                break;
            };
            if used.elapsed() < PING_IF_IDLE_FOR || session.connection.ping().await.is_ok() {
                return Ok(session);
            }
        }
        Ok(Session::new(self.pool.acquire().await?))
    }

    /// The kept session to use and when it was last used, with the sessions
    /// of leases that ended (their acks never came), to be let go.
    fn take_kept(&self, lease: Option<LeaseId>) -> (Option<(Session, Instant)>, Vec<Session>) {
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
    pub(super) fn keep_for(&self, lease: LeaseId, session: Session, ends: Instant) {
        let refused = self.keep_with(session, |held, session| {
            held.claimed.insert(lease, (session, Instant::now(), ends));
        });
        drop(refused);
    }

    /// Keeps a session that just did its work for the next claim or ack.
    pub(super) fn put_back(&self, session: Session) {
        let refused = self.keep_with(session, |held, session| {
            held.idle.push((session, Instant::now()));
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
            let mut released: Vec<Session> = held
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

    /// Stores `session` with `store` while fewer than `keep` are held and
    /// the pool is open; otherwise hands it back, to be dropped outside the
    /// lock.
    fn keep_with(&self, session: Session, store: impl FnOnce(&mut Held, Session)) -> Option<Session> {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.claimed.len() + held.idle.len() >= self.keep || self.pool.is_closed() {
            return Some(session);
        }
        store(&mut held, session);
        None
    }
}
