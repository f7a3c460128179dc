//! Consuming a RabbitMQ queue, acking each message only after the inbox
//! commit.

use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

use crate::{Delivered, Inbox, Tally};

/// The consumer's view of a delivery: source `queue:routing-key`, key
/// (`Switchyard-Key`), string headers, and the message id (the event id) as
/// `Message-Id`.
pub fn delivered(queue: &str, delivery: &lapin::message::Delivery) -> Delivered {
    let mut headers = std::collections::HashMap::new();
    if let Some(table) = delivery.properties.headers() {
        for (name, value) in table.inner() {
            if let AMQPValue::LongString(text) = value {
                headers.insert(
                    name.to_string(),
                    String::from_utf8_lossy(text.as_bytes()).into_owned(),
                );
            }
        }
    }
    if let Some(id) = delivery.properties.message_id() {
        headers.insert("Message-Id".to_string(), id.to_string());
    }
    Delivered {
        source: format!("{queue}:{}", delivery.routing_key),
        key: headers.get("Switchyard-Key").cloned(),
        headers,
        payload: delivery.data.clone(),
    }
}

/// Reads `queue`, applying each message via `inbox` and acking it after the
/// commit, until the queue has been quiet for `idle`. `print` sees each
/// message and whether it was applied.
///
/// # Errors
/// AMQP or database errors (an unacked message goes back to the queue).
pub async fn consume(
    url: &str,
    queue: &str,
    inbox: &Inbox,
    idle: Duration,
    mut print: impl FnMut(&Delivered, bool),
) -> anyhow::Result<Tally> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel.basic_qos(100, BasicQosOptions::default()).await?;
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "switchyard-consumer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut tally = Tally::default();
    while let Ok(Some(delivery)) = tokio::time::timeout(idle, deliveries.next()).await {
        let delivery = delivery?;
        let message = delivered(queue, &delivery);
        let applied = message.apply(inbox).await?;
        delivery.ack(BasicAckOptions::default()).await?;
        print(&message, applied);
        tally.count(applied);
    }
    connection.close(200, "done".into()).await?;
    Ok(tally)
}
