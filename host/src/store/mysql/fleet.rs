//! Ownership leases and relay announcements in MySQL's SQL: times are
//! DATETIME(6) in UTC, by the server's clock, as the leases of claims.

use std::time::Duration;

use sqlx::Connection;

use super::MySql;
use crate::store::Error;
use crate::store::backend::Fleet;

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

impl Fleet for MySql {
    async fn ownership_row(&self, live_within: Duration) -> Result<(Option<String>, bool, i64, i64), Error> {
        let (owner, held, free_ms, live): (Option<String>, i64, i64, i64) = sqlx::query_as(
            "SELECT owner, CAST(expires_at > NOW(6) AS SIGNED),
                    CAST(GREATEST(0, TIMESTAMPDIFF(MICROSECOND, expires_at, NOW(6)) DIV 1000) AS SIGNED),
                    (SELECT count(*) FROM switchyard_relays WHERE seen_at > NOW(6) - INTERVAL ? MICROSECOND)
               FROM switchyard_ownership WHERE id = 1",
        )
        .bind(micros(live_within))
        .fetch_one(&self.pool)
        .await?;
        Ok((owner, held != 0, free_ms, live))
    }

    async fn take_ownership(&self, owner: &str, lease: Duration) -> Result<Option<i64>, Error> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let taken = sqlx::query(
            "UPDATE switchyard_ownership
                SET owner = ?, token = token + 1, expires_at = NOW(6) + INTERVAL ? MICROSECOND
              WHERE id = 1 AND (owner IS NULL OR expires_at <= NOW(6))",
        )
        .bind(owner)
        .bind(micros(lease))
        .execute(&mut *tx)
        .await?;
        // The row stays locked by the update until the commit: the token
        // read is the one just written.
        let token = if taken.rows_affected() == 1 {
            Some(
                sqlx::query_scalar("SELECT token FROM switchyard_ownership WHERE id = 1")
                    .fetch_one(&mut *tx)
                    .await?,
            )
        } else {
            None
        };
        tx.commit().await?;
        Ok(token)
    }

    async fn renew_ownership(&self, owner: &str, token: i64, lease: Duration) -> Result<u64, Error> {
        Ok(sqlx::query(
            "UPDATE switchyard_ownership SET expires_at = NOW(6) + INTERVAL ? MICROSECOND
              WHERE id = 1 AND owner = ? AND token = ?",
        )
        .bind(micros(lease))
        .bind(owner)
        .bind(token)
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    async fn release_ownership(&self, owner: &str, token: i64) -> Result<(), Error> {
        sqlx::query(
            "UPDATE switchyard_ownership SET owner = NULL, expires_at = NOW(6)
              WHERE id = 1 AND owner = ? AND token = ?",
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
        sqlx::query("DELETE FROM switchyard_relays WHERE seen_at < NOW(6) - INTERVAL ? MICROSECOND")
            .bind(forgotten_ms.saturating_mul(1000))
            .execute(&self.pool)
            .await?;
        sqlx::query(
            "INSERT INTO switchyard_relays (instance_id, admin_address) VALUES (?, ?)
             ON DUPLICATE KEY UPDATE admin_address = VALUES(admin_address), seen_at = NOW(6)",
        )
        .bind(instance_id)
        .bind(admin)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn relay_stopped(&self, instance_id: &str) -> Result<(), Error> {
        sqlx::query("DELETE FROM switchyard_relays WHERE instance_id = ?")
            .bind(instance_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn has_relays_table(&self) -> Result<bool, Error> {
        super::table_exists(&self.pool, "switchyard_relays").await
    }

    async fn running_relays(&self, within_ms: i64) -> Result<Vec<(String, Option<String>, f64)>, Error> {
        Ok(sqlx::query_as(
            "SELECT instance_id, admin_address, TIMESTAMPDIFF(MICROSECOND, seen_at, NOW(6)) / 1e6
               FROM switchyard_relays
              WHERE seen_at > NOW(6) - INTERVAL ? MICROSECOND
              ORDER BY started_at DESC, instance_id",
        )
        .bind(within_ms.saturating_mul(1000))
        .fetch_all(&self.pool)
        .await?)
    }
}
