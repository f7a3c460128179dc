//! Consuming a Kafka topic in a consumer group, committing offsets only after
//! the inbox commit.

use std::time::Duration;

use futures::StreamExt;
use rdkafka::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};

use crate::{Delivered, Inbox, Tally};

/// The consumer's view of a Kafka message: source `topic/partition@offset`,
/// key, headers (UTF-8, lossy) and payload.
pub fn delivered(message: &impl Message) -> Delivered {
    Delivered {
        source: format!("{}/{}@{}", message.topic(), message.partition(), message.offset()),
        key: message.key().map(|k| String::from_utf8_lossy(k).into_owned()),
        headers: message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|h| {
                        let value = String::from_utf8_lossy(h.value.unwrap_or_default());
                        (h.key.to_string(), value.into_owned())
                    })
                    .collect()
            })
            .unwrap_or_default(),
        payload: message.payload().unwrap_or_default().to_vec(),
    }
}

/// Reads `topic` as member of consumer group `group` from its committed
/// position (the beginning the first time), applying each message via
/// `inbox` and committing its offset after the inbox commit, until the topic
/// has been quiet for `idle`. `print` sees each message and whether it was applied.
///
/// # Errors
/// Kafka or database errors.
pub async fn consume(
    bootstrap_servers: &str,
    topic: &str,
    group: &str,
    inbox: &Inbox,
    idle: Duration,
    mut print: impl FnMut(&Delivered, bool),
) -> anyhow::Result<Tally> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap_servers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[topic])?;
    let mut stream = consumer.stream();
    let mut tally = Tally::default();
    while let Ok(Some(message)) = tokio::time::timeout(idle, stream.next()).await {
        let message = message?;
        let delivered = delivered(&message);
        let applied = delivered.apply(inbox).await?;
        // Commit only after the inbox commit: a crash in between means a redelivery, which the inbox absorbs.
        consumer.commit_message(&message, CommitMode::Sync)?;
        print(&delivered, applied);
        tally.count(applied);
    }
    Ok(tally)
}
