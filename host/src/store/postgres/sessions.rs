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

use crate::store::Error;
use crate::store::types::LeaseId;

type Connection = PoolConnection<sqlx::Postgres>;

/// A kept session idle this long goes back to the pool, which pings it
/// before handing it out again (the server may have closed it meanwhile).
const FRESH_FOR: Duration = super::connect::PING_IF_IDLE_FOR;

/// At most `keep` sessions held out of the pool; none when 0.
#[derive(Debug)]
pub(super) struct Sessions {
    pool: PgPool,
    keep: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    /// A claim's session until its ack, with the lease's end: one whose
    /// ack never comes (a batch aborted) is let go after it.
    claimed: HashMap<LeaseId, (Connection, Instant)>,
    /// Sessions between uses, the one used last at the end.
    idle: Vec<(Connection, Instant)>,
}

impl Sessions {
    pub(super) fn new(pool: PgPool, keep: usize) -> Sessions {
        Sessions {
            pool,
            keep,
            held: Mutex::new(Held::default()),
        }
    }

    /// The session that claimed under `lease`, else the one used last,
    /// else one from the pool.
    pub(super) async fn take(&self, lease: Option<LeaseId>) -> Result<Connection, Error> {
        if self.keep > 0 {
            let (kept, released) = self.take_kept(lease);
            // Dropped outside the lock: each goes back to the pool.
            drop(released);
            if let Some(connection) = kept {
                return Ok(connection);
            }
        }
        Ok(self.pool.acquire().await?)
    }

    fn take_kept(&self, lease: Option<LeaseId>) -> (Option<Connection>, Vec<Connection>) {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if let Some((connection, _)) = lease.and_then(|lease| held.claimed.remove(&lease)) {
            return (Some(connection), Vec::new());
        }
        let expired: Vec<LeaseId> = held
            .claimed
            .iter()
            .filter(|(_, (_, ends))| *ends <= now)
            .map(|(lease, _)| *lease)
            .collect();
        let mut released: Vec<Connection> = expired
            .iter()
            .filter_map(|lease| held.claimed.remove(lease))
            .map(|(connection, _)| connection)
            .collect();
        // The idle list is in order of use: all before the first fresh one are stale.
        let stale = held
            .idle
            .partition_point(|(_, since)| now.duration_since(*since) >= FRESH_FOR);
        released.extend(held.idle.drain(..stale).map(|(connection, _)| connection));
        (held.idle.pop().map(|(connection, _)| connection), released)
    }

    /// Keeps a claim's session for its ack, until `ends`.
    pub(super) fn keep_for(&self, lease: LeaseId, connection: Connection, ends: Instant) {
        let refused = self.keep_with(connection, |held, connection| {
            held.claimed.insert(lease, (connection, ends));
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

    /// Stores `connection` with `store` while fewer than `keep` are held;
    /// otherwise hands it back, to be dropped outside the lock.
    fn keep_with(
        &self,
        connection: Connection,
        store: impl FnOnce(&mut Held, Connection),
    ) -> Option<Connection> {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.claimed.len() + held.idle.len() >= self.keep {
            return Some(connection);
        }
        store(&mut held, connection);
        None
    }
}
