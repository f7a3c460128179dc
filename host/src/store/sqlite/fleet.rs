//! Ownership leases and relay announcements in SQLite's SQL: times are
//! integer milliseconds since the epoch, as in the rest of its schema.

use std::time::Duration;

use super::Sqlite;
use crate::store::Error;
use crate::store::backend::Fleet;

impl Fleet for Sqlite {
    async fn ownership_row(&self, live_within: Duration) -> Result<(Option<String>, bool, i64, i64), Error> {
        Ok(sqlx::query_as(
            "SELECT owner, expires_at > CAST(unixepoch('subsec') * 1000 AS INTEGER) AS held,
                max(0, CAST(unixepoch('subsec') * 1000 AS INTEGER) - expires_at) AS free_ms,
                (SELECT count(*) FROM switchyard_relays
                  WHERE seen_at > CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1) AS live
             FROM switchyard_ownership WHERE id = 1",
        )
        .bind(millis(live_within))
        .fetch_one(&self.pool)
        .await?)
    }

    async fn take_ownership(&self, owner: &str, lease: Duration) -> Result<Option<i64>, Error> {
        Ok(sqlx::query_scalar(
            "UPDATE switchyard_ownership
                SET owner = ?1, token = token + 1,
                    expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?2
              WHERE id = 1 AND (owner IS NULL OR expires_at <= CAST(unixepoch('subsec') * 1000 AS INTEGER))
              RETURNING token",
        )
        .bind(owner)
        .bind(millis(lease))
        .fetch_optional(&self.pool)
        .await?)
    }

    async fn renew_ownership(&self, owner: &str, token: i64, lease: Duration) -> Result<u64, Error> {
        Ok(sqlx::query(
            "UPDATE switchyard_ownership SET expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?3
              WHERE id = 1 AND owner = ?1 AND token = ?2",
        )
        .bind(owner)
        .bind(token)
        .bind(millis(lease))
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    async fn release_ownership(&self, owner: &str, token: i64) -> Result<(), Error> {
        sqlx::query(
            "UPDATE switchyard_ownership SET owner = NULL,
                    expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)
              WHERE id = 1 AND owner = ?1 AND token = ?2",
        )
        .bind(owner)
        .bind(token)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn announce_relay(
        &self,
        instance_id: &str,
        admin: Option<&str>,
        forgotten_ms: i64,
    ) -> Result<(), Error> {
        sqlx::query(
            "DELETE FROM switchyard_relays
              WHERE seen_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1",
        )
        .bind(forgotten_ms)
        .execute(&self.pool)
        .await?;
        sqlx::query(
            "INSERT INTO switchyard_relays (instance_id, admin_address) VALUES (?1, ?2)
             ON CONFLICT (instance_id)
             DO UPDATE SET admin_address = excluded.admin_address,
                           seen_at = CAST(unixepoch('subsec') * 1000 AS INTEGER)",
        )
        .bind(instance_id)
        .bind(admin)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn relay_stopped(&self, instance_id: &str) -> Result<(), Error> {
        sqlx::query("DELETE FROM switchyard_relays WHERE instance_id = ?1")
            .bind(instance_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn has_relays_table(&self) -> Result<bool, Error> {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'switchyard_relays')",
        )
        .fetch_one(&self.pool)
        .await?)
    }

    async fn running_relays(&self, within_ms: i64) -> Result<Vec<(String, Option<String>, f64)>, Error> {
        Ok(sqlx::query_as(
            "SELECT instance_id, admin_address,
                    (CAST(unixepoch('subsec') * 1000 AS INTEGER) - seen_at) / 1000.0
               FROM switchyard_relays
              WHERE seen_at > CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1
              ORDER BY started_at DESC, instance_id",
        )
        .bind(within_ms)
        .fetch_all(&self.pool)
        .await?)
    }
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
