//! `switchyard_ownership`: which relay serves this database when several
//! relays share many databases out, held under a lease its owner renews.

use std::time::Duration;

use super::backend::Fleet;
use super::{AnyBackend, Error, OutboxStore};

/// The ownership row as a relay deciding whether to take it sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Ownership {
    /// The relay holding it (its lease may have run out).
    pub owner: Option<String>,
    /// Whether its lease still runs.
    pub held: bool,
    /// How long it has been free (zero while held).
    pub free_for: Duration,
    /// Relays that said they run here within `live_within`.
    pub live_relays: u64,
}

/// The ownership row as both backends' statements select it: owner,
/// held, free for (ms), live relays.
type OwnershipRow = (Option<String>, bool, i64, i64);

impl OutboxStore {
    /// Reads the ownership row, with the relays seen here recently.
    ///
    /// # Errors
    /// The database's.
    pub async fn ownership(&self, live_within: Duration) -> Result<Ownership, Error> {
        let row = dispatch!(self, backend => backend.ownership_row(live_within).await)?;
        Ok(Ownership::from(row))
    }

    /// Takes the database for `owner` for `lease` if it is free or its
    /// lease ran out; the new token, or `None` when another relay holds it.
    ///
    /// # Errors
    /// The database's.
    pub async fn take_ownership(&self, owner: &str, lease: Duration) -> Result<Option<i64>, Error> {
        dispatch!(self, backend => backend.take_ownership(owner, lease).await)
    }

    /// Extends `owner`'s lease; false when it no longer holds `token`.
    ///
    /// # Errors
    /// The database's.
    pub async fn renew_ownership(&self, owner: &str, token: i64, lease: Duration) -> Result<bool, Error> {
        let renewed = dispatch!(self, backend => backend.renew_ownership(owner, token, lease).await)?;
        Ok(renewed == 1)
    }

    /// Gives the database up, if `owner` still holds `token`.
    ///
    /// # Errors
    /// The database's.
    pub async fn release_ownership(&self, owner: &str, token: i64) -> Result<(), Error> {
        dispatch!(self, backend => backend.release_ownership(owner, token).await)
    }
}

impl From<OwnershipRow> for Ownership {
    fn from((owner, held, free_ms, live): OwnershipRow) -> Ownership {
        Ownership {
            owner,
            held,
            free_for: Duration::from_millis(u64::try_from(free_ms).unwrap_or(0)),
            live_relays: u64::try_from(live).unwrap_or(0),
        }
    }
}
