//! An idempotent consumer, as a service receiving Switchyard's events should
//! be written. Delivery is at-least-once, so the consumer keeps an inbox
//! table keyed by the event id (`Switchyard-Event-Id`) and applies an event
//! only if inserting its id into the inbox succeeds, in the same transaction
//! as the change it makes. A redelivered event finds its id and is skipped.

use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
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

/// A header's value, or an empty string.
pub fn header(message: &async_nats::Message, name: &str) -> String {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(ToString::to_string)
        .unwrap_or_default()
}

/// What one consumer run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Events applied.
    pub applied: usize,
    /// Redeliveries skipped.
    pub skipped: usize,
}

/// Reads `stream` through a durable consumer named `durable`, applying each
/// message via `inbox` and acking it after the commit, until the stream has
/// been quiet for `idle`. `print` is called with each message and whether it
/// was applied.
///
/// # Errors
/// NATS or database errors.
pub async fn consume(
    js: &jetstream::Context,
    stream: &str,
    durable: &str,
    inbox: &Inbox,
    idle: Duration,
    mut print: impl FnMut(&jetstream::Message, bool),
) -> anyhow::Result<Tally> {
    let stream = js.get_stream(stream).await?;
    let consumer = stream
        .get_or_create_consumer(
            durable,
            jetstream::consumer::pull::Config {
                durable_name: Some(durable.to_string()),
                ..Default::default()
            },
        )
        .await?;
    let mut messages = consumer.messages().await?;
    let mut tally = Tally::default();
    while let Ok(Some(message)) = tokio::time::timeout(idle, messages.next()).await {
        let message = message.map_err(|e| anyhow::anyhow!("{e}"))?;
        let header = |name: &str| header(&message, name);
        let event_id = header("Switchyard-Event-Id");
        anyhow::ensure!(
            !event_id.is_empty(),
            "message on {} has no Switchyard-Event-Id",
            message.subject
        );
        let applied = inbox
            .apply(
                &event_id,
                &header("Switchyard-Event-Type"),
                &header("Switchyard-Aggregate-Id"),
            )
            .await?;
        // Ack only after the inbox commit: a crash in between means a redelivery, which the inbox absorbs.
        message.ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        print(&message, applied);
        if applied {
            tally.applied += 1
        } else {
            tally.skipped += 1
        }
    }
    Ok(tally)
}
