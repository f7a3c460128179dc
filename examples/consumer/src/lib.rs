//! An idempotent consumer, as a service receiving Switchyard's events should
//! be written, for NATS JetStream, Kafka, RabbitMQ, Pub/Sub and SQS. Delivery is at-least-once,
//! so the consumer keeps an inbox table keyed by the event id
//! (`Switchyard-Event-Id`, or the AMQP message id) and applies an event only if inserting its id into
//! the inbox succeeds, in the same transaction as the change it makes. A
//! redelivered event finds its id and is skipped.

pub mod kafka;
pub mod nats;
pub mod pubsub;
pub mod rabbitmq;
pub mod sqs;

use std::collections::HashMap;

use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;

/// The consumer's database: the inbox and the read model it maintains.
pub struct Inbox {
    pool: AnyPool,
    sqlite: bool,
}

impl Inbox {
    /// Opens (and on SQLite creates) the database and its tables.
    ///
    /// # Errors
    /// Connection or DDL errors.
    pub async fn open(url: &str) -> anyhow::Result<Inbox> {
        sqlx::any::install_default_drivers();
        let sqlite = url.starts_with("sqlite:");
        let url = if sqlite && !url.contains("mode=") {
            format!("{url}{}mode=rwc", if url.contains('?') { '&' } else { '?' })
        } else {
            url.to_string()
        };
        let pool = AnyPoolOptions::new().max_connections(2).connect(&url).await?;
        for ddl in [
            "CREATE TABLE IF NOT EXISTS inbox (event_id TEXT PRIMARY KEY, event_type TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS order_view (order_id TEXT PRIMARY KEY, status TEXT NOT NULL, events INTEGER NOT NULL)",
        ] {
            sqlx::query(ddl).execute(&pool).await?;
        }
        Ok(Inbox { pool, sqlite })
    }

    fn sql(&self, pg: &str) -> String {
        if self.sqlite {
            pg.replace('$', "?")
        } else {
            pg.to_string()
        }
    }

    /// Applies one event unless its id was applied before. Returns whether it was applied.
    ///
    /// # Errors
    /// Database errors; nothing is applied then, and the message should not be acked.
    pub async fn apply(&self, event_id: &str, event_type: &str, order_id: &str) -> anyhow::Result<bool> {
        let mut tx = self.pool.begin().await?;
        let fresh = sqlx::query(&self.sql(
            "INSERT INTO inbox (event_id, event_type) VALUES ($1, $2) ON CONFLICT (event_id) DO NOTHING",
        ))
        .bind(event_id)
        .bind(event_type)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if fresh {
            sqlx::query(&self.sql(
                "INSERT INTO order_view (order_id, status, events) VALUES ($1, $2, 1)
                 ON CONFLICT (order_id) DO UPDATE SET status = excluded.status, events = order_view.events + 1",
            ))
            .bind(order_id)
            .bind(event_type)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(fresh)
    }

    /// How many events were applied to an order's view (0 if none).
    ///
    /// # Errors
    /// Database errors.
    pub async fn events_applied(&self, order_id: &str) -> anyhow::Result<i64> {
        let events: Option<i64> =
            sqlx::query_scalar(&self.sql("SELECT events FROM order_view WHERE order_id = $1"))
                .bind(order_id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(events.unwrap_or(0))
    }
}

/// What one consumer run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Events applied.
    pub applied: usize,
    /// Redeliveries skipped.
    pub skipped: usize,
}

/// One received message, whichever broker it came from.
#[derive(Debug, Clone)]
pub struct Delivered {
    /// Where it was read: a NATS subject, or `topic/partition@offset` on Kafka.
    pub source: String,
    /// Message key (`Switchyard-Key` on NATS).
    pub key: Option<String>,
    /// Headers, first value of each.
    pub headers: HashMap<String, String>,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

impl Delivered {
    /// A header's value, or an empty string.
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }

    /// Applies the message through `inbox`, refusing one without an event id.
    ///
    /// # Errors
    /// A missing event id or a database error; nothing is applied then.
    pub async fn apply(&self, inbox: &Inbox) -> anyhow::Result<bool> {
        let event_id = match self.header("Switchyard-Event-Id") {
            "" => self.header("Message-Id"),
            id => id,
        };
        anyhow::ensure!(
            !event_id.is_empty(),
            "message on {} has no Switchyard-Event-Id",
            self.source
        );
        inbox
            .apply(
                event_id,
                self.header("Switchyard-Event-Type"),
                self.header("Switchyard-Aggregate-Id"),
            )
            .await
    }

    /// One readable line plus the payload.
    pub fn describe(&self, applied: bool) -> String {
        format!(
            "{source}  key={key}  event={id}  plugin={plugin}  {verdict}\n    {payload}",
            source = self.source,
            key = self.key.as_deref().unwrap_or(""),
            id = match self.header("Switchyard-Event-Id") {
                "" => self.header("Message-Id"),
                id => id,
            },
            plugin = self.header("Switchyard-Plugin"),
            verdict = if applied { "applied" } else { "duplicate, skipped" },
            payload = String::from_utf8_lossy(&self.payload),
        )
    }
}

impl Tally {
    fn count(&mut self, applied: bool) {
        if applied {
            self.applied += 1;
        } else {
            self.skipped += 1;
        }
    }
}
