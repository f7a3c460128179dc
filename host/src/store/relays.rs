//! The running relays (`switchyard_relays`): each one's admin endpoint, for
//! operators' tools to find (`switchyard status`), also when the system
//! chose its port.

use std::time::Duration;

use super::backend::Fleet;
use super::{AnyBackend, Error, OutboxStore};

/// How long a relay may go unseen before another one's announcement
/// removes its row (`status` lists only those seen lately anyway).
pub const FORGOTTEN_AFTER: Duration = Duration::from_secs(24 * 3600);

/// A relay that said it is running.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RunningRelay {
    /// Its `instance_id`.
    pub instance_id: String,
    /// Where its admin endpoint listens, if it has one.
    pub admin_address: Option<String>,
    /// Seconds since it last said so.
    pub seen_seconds_ago: f64,
}

impl OutboxStore {
    /// Records (or refreshes) that relay `instance_id` runs, with its admin
    /// endpoint's address, and forgets relays unseen for [`FORGOTTEN_AFTER`]:
    /// a relay killed, or a database given up, leaves its row behind, and a
    /// fleet that restarts under new names would otherwise grow the table
    /// that every ownership read counts, without end.
    ///
    /// # Errors
    /// The database's (a schema not yet migrated has no such table).
    pub async fn announce_relay(&self, instance_id: &str, admin: Option<&str>) -> Result<(), Error> {
        let forgotten_ms = FORGOTTEN_AFTER.as_millis() as i64;
        dispatch!(self, backend => backend.announce_relay(instance_id, admin, forgotten_ms).await)
    }

    /// Removes relay `instance_id` from the running ones (it stopped).
    ///
    /// # Errors
    /// The database's.
    pub async fn relay_stopped(&self, instance_id: &str) -> Result<(), Error> {
        dispatch!(self, backend => backend.relay_stopped(instance_id).await)
    }

    /// The relays seen within `within`, most recently started first. None
    /// when the schema predates the table.
    ///
    /// # Errors
    /// The database's.
    pub async fn running_relays(&self, within: Duration) -> Result<Vec<RunningRelay>, Error> {
        let within_ms = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
        if !dispatch!(self, backend => backend.has_relays_table().await)? {
            return Ok(Vec::new());
        }
        let rows = dispatch!(self, backend => backend.running_relays(within_ms).await)?;
        Ok(rows
            .into_iter()
            .map(|(instance_id, admin_address, seen_seconds_ago)| RunningRelay {
                instance_id,
                admin_address,
                seen_seconds_ago,
            })
            .collect())
    }
}
