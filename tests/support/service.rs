//! A service's database, whichever server it runs on: what the shared
//! workload writer and the relay-level checks (statuses, leases) need, so
//! that one test body runs against PostgreSQL and MariaDB alike.

use std::collections::HashMap;

use super::orders::Expected;
use super::postgres::{NewEvent, Outbox};
use super::workload::Plan;

/// A pool on the service's database.
#[derive(Clone, Debug)]
pub enum ServicePool {
    /// PostgreSQL.
    Postgres(sqlx::PgPool),
    /// MySQL or MariaDB.
    MySql(sqlx::MySqlPool),
}

impl From<&sqlx::PgPool> for ServicePool {
    fn from(pool: &sqlx::PgPool) -> ServicePool {
        ServicePool::Postgres(pool.clone())
    }
}

impl From<&sqlx::MySqlPool> for ServicePool {
    fn from(pool: &sqlx::MySqlPool) -> ServicePool {
        ServicePool::MySql(pool.clone())
    }
}

impl From<&ServicePool> for ServicePool {
    fn from(pool: &ServicePool) -> ServicePool {
        pool.clone()
    }
}

impl ServicePool {
    /// The integer a query without parameters returns (written in the SQL
    /// both servers read).
    ///
    /// # Panics
    /// When the database refuses it.
    pub async fn scalar(&self, sql: &str) -> i64 {
        match self {
            ServicePool::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
            ServicePool::MySql(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
        }
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// The text a query without parameters returns, if a row; `None`
    /// also when the database does not answer.
    pub async fn text(&self, sql: &str) -> Option<String> {
        match self {
            ServicePool::Postgres(pool) => sqlx::query_scalar(sql).fetch_optional(pool).await,
            ServicePool::MySql(pool) => sqlx::query_scalar(sql).fetch_optional(pool).await,
        }
        .ok()
        .flatten()
    }

    /// Rows in `status`.
    ///
    /// # Panics
    /// When the database refuses the query.
    pub async fn count_status(&self, status: &str) -> i64 {
        self.try_count_status(status).await.expect("count")
    }

    /// [`ServicePool::count_status`], the database's error returned.
    ///
    /// # Errors
    /// The database's (it may be restarting).
    pub async fn try_count_status(&self, status: &str) -> Result<i64, sqlx::Error> {
        match self {
            ServicePool::Postgres(pool) => {
                sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = $1")
                    .bind(status)
                    .fetch_one(pool)
                    .await
            }
            ServicePool::MySql(pool) => {
                sqlx::query_scalar("SELECT count(*) FROM switchyard_outbox WHERE status = ?")
                    .bind(status)
                    .fetch_one(pool)
                    .await
            }
        }
    }

    /// The longest any row took from its commit to its publish, in
    /// seconds (0 when none is published).
    ///
    /// # Panics
    /// When the database refuses the query.
    pub async fn worst_commit_to_publish_s(&self) -> f64 {
        match self {
            ServicePool::Postgres(pool) => sqlx::query_scalar(
                "SELECT coalesce(max(EXTRACT(EPOCH FROM published_at - created_at)), 0)::float8 FROM switchyard_outbox",
            )
            .fetch_one(pool)
            .await,
            ServicePool::MySql(pool) => sqlx::query_scalar(
                "SELECT coalesce(max(TIMESTAMPDIFF(MICROSECOND, created_at, published_at)), 0) / 1e6
                   FROM switchyard_outbox",
            )
            .fetch_one(pool)
            .await,
        }
        .expect("worst commit to publish")
    }

    /// Rows and their count of each status.
    ///
    /// # Panics
    /// When the database refuses the query.
    pub async fn statuses(&self) -> Vec<(String, i64)> {
        let sql = "SELECT status, count(*) FROM switchyard_outbox GROUP BY status ORDER BY status";
        match self {
            ServicePool::Postgres(pool) => sqlx::query_as(sql).fetch_all(pool).await,
            ServicePool::MySql(pool) => sqlx::query_as(sql).fetch_all(pool).await,
        }
        .expect("count by status")
    }

    /// The first dead rows: aggregate and error.
    ///
    /// # Panics
    /// When the database refuses the query.
    pub async fn first_dead(&self) -> Vec<(String, Option<String>)> {
        let sql = "SELECT aggregate_id, last_error FROM switchyard_outbox WHERE status = 'dead' ORDER BY id LIMIT 3";
        match self {
            ServicePool::Postgres(pool) => sqlx::query_as(sql).fetch_all(pool).await,
            ServicePool::MySql(pool) => sqlx::query_as(sql).fetch_all(pool).await,
        }
        .expect("dead rows")
    }

    /// The database's clock.
    ///
    /// # Panics
    /// When the database refuses the query.
    pub async fn now(&self) -> chrono::DateTime<chrono::Utc> {
        match self {
            ServicePool::Postgres(pool) => sqlx::query_scalar("SELECT now()").fetch_one(pool).await,
            ServicePool::MySql(pool) => {
                sqlx::query_scalar::<_, chrono::NaiveDateTime>("SELECT UTC_TIMESTAMP(6)")
                    .fetch_one(pool)
                    .await
                    .map(|at| at.and_utc())
            }
        }
        .expect("the database's clock")
    }

    /// Pending rows that wait for target `target` and spent no attempt.
    ///
    /// # Panics
    /// When the database refuses the query.
    pub async fn waiting_without_attempts(&self, target: &str) -> i64 {
        match self {
            ServicePool::Postgres(pool) => {
                sqlx::query_scalar(
                    "SELECT count(*) FROM switchyard_outbox
                  WHERE waiting_on = ARRAY[$1] AND status = 'pending' AND attempts = 0",
                )
                .bind(target)
                .fetch_one(pool)
                .await
            }
            ServicePool::MySql(pool) => {
                sqlx::query_scalar(
                    "SELECT count(*) FROM switchyard_outbox
                  WHERE JSON_CONTAINS(waiting_on, JSON_QUOTE(?)) AND status = 'pending' AND attempts = 0",
                )
                .bind(target)
                .fetch_one(pool)
                .await
            }
        }
        .expect("rows waiting")
    }

    /// Seconds from `from` to the first publish after `after` (negative
    /// when before `from`); `None` when nothing was published after it.
    ///
    /// # Panics
    /// When the database refuses the query.
    pub async fn first_publish_since(
        &self,
        after: chrono::DateTime<chrono::Utc>,
        from: chrono::DateTime<chrono::Utc>,
    ) -> Option<f64> {
        match self {
            ServicePool::Postgres(pool) => sqlx::query_scalar(
                "SELECT extract(epoch FROM min(published_at) - $2)::float8 FROM switchyard_outbox WHERE published_at > $1",
            )
            .bind(after)
            .bind(from)
            .fetch_one(pool)
            .await,
            ServicePool::MySql(pool) => sqlx::query_scalar(
                "SELECT TIMESTAMPDIFF(MICROSECOND, ?, min(published_at)) / 1e6 FROM switchyard_outbox WHERE published_at > ?",
            )
            .bind(from.naive_utc())
            .bind(after.naive_utc())
            .fetch_one(pool)
            .await,
        }
        .expect("first publish")
    }

    /// Writes one transaction of `plan` and commits it; what the consumer
    /// should see.
    ///
    /// # Errors
    /// The database's; nothing is committed then.
    pub async fn write_committed(
        &self,
        plan: &Plan,
        next_seq: &mut HashMap<usize, usize>,
    ) -> Result<Vec<(String, Expected)>, sqlx::Error> {
        self.write(plan, next_seq, false).await
    }

    /// As [`ServicePool::write_committed`], the service deleting each event
    /// in the transaction that writes it: the log still carries the insert,
    /// the table keeps nothing.
    ///
    /// # Errors
    /// The database's; nothing is committed then.
    pub async fn write_deleted(
        &self,
        plan: &Plan,
        next_seq: &mut HashMap<usize, usize>,
    ) -> Result<Vec<(String, Expected)>, sqlx::Error> {
        self.write(plan, next_seq, true).await
    }

    /// [`ServicePool::write_deleted`] when `deleted`, else
    /// [`ServicePool::write_committed`]: as a writer's shape says.
    ///
    /// # Errors
    /// The database's; nothing is committed then.
    pub async fn write(
        &self,
        plan: &Plan,
        next_seq: &mut HashMap<usize, usize>,
        deleted: bool,
    ) -> Result<Vec<(String, Expected)>, sqlx::Error> {
        match self {
            ServicePool::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                let written = super::workload::write_plan(&mut tx, plan, next_seq).await?;
                for (event_id, _) in written.iter().filter(|_| deleted) {
                    sqlx::query("DELETE FROM switchyard_outbox WHERE event_id = $1::uuid")
                        .bind(event_id)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok(written)
            }
            ServicePool::MySql(pool) => {
                let mut tx = pool.begin().await?;
                let written = super::workload::write_plan_with(&mut *tx, plan, next_seq).await?;
                for (event_id, _) in written.iter().filter(|_| deleted) {
                    sqlx::query("DELETE FROM switchyard_outbox WHERE event_id = ?")
                        .bind(event_id)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
                Ok(written)
            }
        }
    }
}

/// A connection a service writes its events on.
pub trait ServiceConn: Send {
    /// Writes `event` as the service does (its business row, then the
    /// event into `outbox`); the event id.
    fn insert_event(
        &mut self,
        outbox: Outbox,
        event: &NewEvent,
    ) -> impl std::future::Future<Output = Result<String, sqlx::Error>> + Send;
}

impl ServiceConn for sqlx::PgConnection {
    async fn insert_event(&mut self, outbox: Outbox, event: &NewEvent) -> Result<String, sqlx::Error> {
        Ok(super::postgres::insert_event(self, outbox, event)
            .await?
            .to_string())
    }
}

/// The business table beside the outbox on MariaDB.
pub const MYSQL_ORDERS: &str = "CREATE TABLE orders (
    id VARCHAR(255) PRIMARY KEY, status VARCHAR(64) NOT NULL, total_cents BIGINT NOT NULL,
    updated_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6))";

impl ServiceConn for sqlx::MySqlConnection {
    async fn insert_event(&mut self, outbox: Outbox, event: &NewEvent) -> Result<String, sqlx::Error> {
        assert_eq!(
            outbox,
            Outbox::Switchyard,
            "MySQL services write the outbox table"
        );
        sqlx::query(
            "INSERT INTO orders (id, status, total_cents) VALUES (?, ?, ?)
             ON DUPLICATE KEY UPDATE status = VALUES(status), updated_at = CURRENT_TIMESTAMP(6)",
        )
        .bind(&event.aggregate_id)
        .bind(&event.event_type)
        .bind(
            event
                .payload
                .get("total_cents")
                .and_then(serde_json::Value::as_i64)
                .unwrap_or(0),
        )
        .execute(&mut *self)
        .await?;
        // No INSERT ... RETURNING on MySQL: the service makes the id, as
        // most do.
        let event_id = uuid::Uuid::new_v4().to_string();
        sqlx::query(
            "INSERT INTO switchyard_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES (?, ?, ?, ?, ?, ?)",
        )
        .bind(&event_id)
        .bind(&event.aggregate_type)
        .bind(&event.aggregate_id)
        .bind(&event.event_type)
        .bind(event.payload.to_string())
        .bind(event.headers.to_string())
        .execute(&mut *self)
        .await?;
        Ok(event_id)
    }
}
