//! `switchyard_ownership`: which relay serves this database when several
//! relays share many databases out, held under a lease its owner renews.

use std::time::Duration;

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

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

impl OutboxStore {
    /// Reads the ownership row, with the relays seen here recently.
    ///
    /// # Errors
    /// The database's.
    pub async fn ownership(&self, live_within: Duration) -> Result<Ownership, Error> {
        let row: OwnershipRow = match &self.backend {
            AnyBackend::Postgres(pg) => {
                pg.bounded("ownership read", async |session| {
                    Ok(sqlx::query_as(
                        "SELECT owner, expires_at > now() AS held,
                                least(greatest(0, (extract(epoch FROM now()) - extract(epoch FROM expires_at)) * 1000), 9e15)::bigint
                                  AS free_ms,
                                (SELECT count(*) FROM switchyard_relays
                                  WHERE seen_at > now() - $1 * interval '1 millisecond') AS live
                         FROM switchyard_ownership WHERE id = 1",
                    )
                    .bind(millis(live_within) as f64)
                    .fetch_one(session)
                    .await?)
                })
                .await?
            }
            AnyBackend::Sqlite(lite) => {
                sqlx::query_as(
                    "SELECT owner, expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER) AS held,
                        max(0, CAST(unixepoch('subsec') * 1000 AS INTEGER) - expires_at) AS free_ms,
                        (SELECT count(*) FROM switchyard_relays
                          WHERE seen_at > CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1) AS live
                 FROM switchyard_ownership WHERE id = 1",
                )
                .bind(millis(live_within))
                .fetch_one(&lite.pool)
                .await?
            }
        };
        Ok(Ownership::from(row))
    }

    /// Takes the database for `owner` for `lease` if it is free or its
    /// lease ran out; the new token, or `None` when another relay holds it.
    ///
    /// # Errors
    /// The database's.
    pub async fn take_ownership(&self, owner: &str, lease: Duration) -> Result<Option<i64>, Error> {
        let token = match &self.backend {
            AnyBackend::Postgres(pg) => {
                pg.bounded("ownership take", async |session| {
                    Ok(sqlx::query_scalar(
                        "UPDATE switchyard_ownership
                            SET owner = $1, token = token + 1, expires_at = now() + $2 * interval '1 millisecond'
                          WHERE id = 1 AND (owner IS NULL OR expires_at <= now())
                          RETURNING token",
                    )
                    .bind(owner)
                    .bind(millis(lease) as f64)
                    .fetch_optional(session)
                    .await?)
                })
                .await?
            }
            AnyBackend::Sqlite(lite) => {
                sqlx::query_scalar(
                    "UPDATE switchyard_ownership
                        SET owner = ?1, token = token + 1,
                            expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?2
                      WHERE id = 1 AND (owner IS NULL OR expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER))
                      RETURNING token",
                )
                .bind(owner)
                .bind(millis(lease))
                .fetch_optional(&lite.pool)
                .await?
            }
        };
        Ok(token)
    }

    /// Extends `owner`'s lease; false when it no longer holds `token`.
    ///
    /// # Errors
    /// The database's.
    pub async fn renew_ownership(&self, owner: &str, token: i64, lease: Duration) -> Result<bool, Error> {
        let renewed = match &self.backend {
            AnyBackend::Postgres(pg) => {
                pg.bounded("ownership renewal", async |session| {
                    Ok(sqlx::query(
                        "UPDATE switchyard_ownership SET expires_at = now() + $3 * interval '1 millisecond'
                          WHERE id = 1 AND owner = $1 AND token = $2",
                    )
                    .bind(owner)
                    .bind(token)
                    .bind(millis(lease) as f64)
                    .execute(session)
                    .await?
                    .rows_affected())
                })
                .await?
            }
            AnyBackend::Sqlite(lite) => sqlx::query(
                "UPDATE switchyard_ownership SET expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?3
                  WHERE id = 1 AND owner = ?1 AND token = ?2",
            )
            .bind(owner)
            .bind(token)
            .bind(millis(lease))
            .execute(&lite.pool)
            .await?
            .rows_affected(),
        };
        Ok(renewed == 1)
    }

    /// Gives the database up, if `owner` still holds `token`.
    ///
    /// # Errors
    /// The database's.
    pub async fn release_ownership(&self, owner: &str, token: i64) -> Result<(), Error> {
        match &self.backend {
            AnyBackend::Postgres(pg) => {
                pg.bounded("ownership release", async |session| {
                    sqlx::query(
                        "UPDATE switchyard_ownership SET owner = NULL, expires_at = now()
                          WHERE id = 1 AND owner = $1 AND token = $2",
                    )
                    .bind(owner)
                    .bind(token)
                    .execute(session)
                    .await?;
                    Ok(())
                })
                .await?;
            }
            AnyBackend::Sqlite(lite) => {
                sqlx::query(
                    "UPDATE switchyard_ownership SET owner = NULL,
                            expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)
                      WHERE id = 1 AND owner = ?1 AND token = ?2",
                )
                .bind(owner)
                .bind(token)
                .execute(&lite.pool)
                .await?;
            }
        }
        Ok(())
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
