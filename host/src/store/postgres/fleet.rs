//! Ownership leases and relay announcements in PostgreSQL's SQL, each
//! statement bounded like every other a relay sends on a shared session.

use std::time::Duration;

use super::Postgres;
use crate::store::Error;
use crate::store::backend::Fleet;

impl Fleet for Postgres {
    async fn ownership_row(&self, live_within: Duration) -> Result<(Option<String>, bool, i64, i64), Error> {
        self.bounded("ownership read", async |session| {
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
        .await
    }

    async fn take_ownership(&self, owner: &str, lease: Duration) -> Result<Option<i64>, Error> {
        self.bounded("ownership take", async |session| {
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
        .await
    }

    async fn renew_ownership(&self, owner: &str, token: i64, lease: Duration) -> Result<u64, Error> {
        self.bounded("ownership renewal", async |session| {
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
        .await
    }

    async fn release_ownership(&self, owner: &str, token: i64) -> Result<(), Error> {
        self.bounded("ownership release", async |session| {
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
        .await
    }

    async fn announce_relay(
        &self,
        instance_id: &str,
        admin: Option<&str>,
        forgotten_ms: i64,
    ) -> Result<(), Error> {
        self.bounded("relay announcement", async |session| {
            // Its own row is left to the upsert: one statement may not
            // change a row twice.
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
        .await
    }

    async fn relay_stopped(&self, instance_id: &str) -> Result<(), Error> {
        // Bounded: a relay's last statement on a database, sent on a
        // session that may have stopped answering while it sat idle.
        self.bounded("relay removal", async |session| {
            sqlx::query("DELETE FROM switchyard_relays WHERE instance_id = $1")
                .bind(instance_id)
                .execute(session)
                .await?;
            Ok(())
        })
        .await
    }

    async fn has_relays_table(&self) -> Result<bool, Error> {
        Ok(
            sqlx::query_scalar("SELECT to_regclass('switchyard_relays') IS NOT NULL")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    async fn running_relays(&self, within_ms: i64) -> Result<Vec<(String, Option<String>, f64)>, Error> {
        Ok(sqlx::query_as(
            "SELECT instance_id, admin_address, extract(epoch FROM now() - seen_at)::float8
               FROM switchyard_relays
              WHERE seen_at > now() - $1 * interval '1 millisecond'
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
