//! The running relays (`switchyard_relays`): each one's admin endpoint, for
//! operators' tools to find (`switchyard status`), also when the system
//! chose its port.

use std::time::Duration;

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
        match &self.backend {
            AnyBackend::Postgres(pg) => {
                pg.bounded("relay announcement", async |session| {
                    // Its own row is left to the upsert: one statement may
                    // not change a row twice.
                    sqlx::query(
                        "WITH forgotten AS (
                             DELETE FROM switchyard_relays
                              WHERE seen_at < now() - $3 * interval '1 millisecond' AND instance_id <> $1)
                         INSERT INTO switchyard_relays (instance_id, admin_address) VALUES ($1, $2)
                         ON CONFLICT (instance_id)
                         DO UPDATE SET admin_address = EXCLUDED.admin_address, seen_at = now()",
                    )
                    .bind(instance_id)
                    .bind(admin)
                    .bind(forgotten_ms as f64)
                    .execute(session)
                    .await?;
                    Ok(())
                })
                .await?;
            }
            AnyBackend::Sqlite(lite) => {
                sqlx::query(
                    "DELETE FROM switchyard_relays
                      WHERE seen_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1",
                )
                .bind(forgotten_ms)
                .execute(&lite.pool)
                .await?;
                sqlx::query(
                    "INSERT INTO switchyard_relays (instance_id, admin_address) VALUES (?1, ?2)
                     ON CONFLICT (instance_id)
                     DO UPDATE SET admin_address = excluded.admin_address,
                                   seen_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)",
                )
                .bind(instance_id)
                .bind(admin)
                .execute(&lite.pool)
                .await?;
            }
        }
        Ok(())
    }

    /// Removes relay `instance_id` from the running ones (it stopped).
    ///
    /// # Errors
    /// The database's.
    pub async fn relay_stopped(&self, instance_id: &str) -> Result<(), Error> {
        let sql = "DELETE FROM switchyard_relays WHERE instance_id = $1";
        match &self.backend {
            // Bounded: a relay's last statement on a database, sent on a
            // session that may have stopped answering while it sat idle.
            AnyBackend::Postgres(pg) => {
                pg.bounded("relay removal", async |session| {
                    sqlx::query(sql).bind(instance_id).execute(session).await?;
                    Ok(())
                })
                .await?;
            }
            AnyBackend::Sqlite(lite) => {
                sqlx::query(sql).bind(instance_id).execute(&lite.pool).await?;
            }
        }
        Ok(())
    }

    /// The relays seen within `within`, most recently started first. None
    /// when the schema predates the table.
    ///
    /// # Errors
    /// The database's.
    pub async fn running_relays(&self, within: Duration) -> Result<Vec<RunningRelay>, Error> {
        let within_ms = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
        let rows: Vec<(String, Option<String>, f64)> = match &self.backend {
            AnyBackend::Postgres(pg) => {
                if !table_exists_pg(&pg.pool).await? {
                    return Ok(Vec::new());
                }
                sqlx::query_as(
                    "SELECT instance_id, admin_address, extract(epoch FROM now() - seen_at)::float8
                       FROM switchyard_relays
                      WHERE seen_at > now() - $1 * interval '1 millisecond'
                      ORDER BY started_at DESC, instance_id",
                )
                .bind(within_ms)
                .fetch_all(&pg.pool)
                .await?
            }
            AnyBackend::Sqlite(lite) => {
                let exists: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'switchyard_relays')",
                )
                .fetch_one(&lite.pool)
                .await?;
                if !exists {
                    return Ok(Vec::new());
                }
                sqlx::query_as(
                    "SELECT instance_id, admin_address,
                            (CAST(unixepoch('subsec') * 1000 AS INTEGER) - seen_at) / 1000.0
                       FROM switchyard_relays
                      WHERE seen_at > CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1
                      ORDER BY started_at DESC, instance_id",
                )
                .bind(within_ms)
                .fetch_all(&lite.pool)
                .await?
            }
        };
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

async fn table_exists_pg(pool: &sqlx::PgPool) -> Result<bool, Error> {
    Ok(
        sqlx::query_scalar("SELECT to_regclass('switchyard_relays') IS NOT NULL")
            .fetch_one(pool)
            .await?,
    )
}
