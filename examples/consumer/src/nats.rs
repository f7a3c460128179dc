//! Consuming a JetStream stream through a durable pull consumer.

use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;

use crate::{Delivered, Inbox, Tally};

fn delivered(message: &async_nats::Message) -> Delivered {
    let headers: std::collections::HashMap<String, String> = message
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .filter_map(|(name, values)| Some((name.to_string(), values.first()?.to_string())))
        .collect();
    Delivered {
        source: message.subject.to_string(),
        key: headers.get("Switchyard-Key").cloned(),
        headers,
        payload: message.payload.to_vec(),
    }
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
    mut print: impl FnMut(&Delivered, bool),
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
        let delivered = delivered(&message);
        let applied = delivered.apply(inbox).await?;
        // Ack only after the inbox commit: a crash in between means a redelivery, which the inbox absorbs.
        message.ack().await.map_err(|e| anyhow::anyhow!("{e}"))?;
        print(&delivered, applied);
        tally.count(applied);
    }
    Ok(tally)
}
