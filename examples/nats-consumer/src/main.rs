//! A sample consumer: prints every message of a JetStream stream with its
//! subject, key, event id and payload, then exits when the stream is drained.
//!
//! ```text
//! cargo run -p nats-consumer -- --url nats://127.0.0.1:54222 --stream ORDERS
//! ```

use std::time::Duration;

use async_nats::jetstream;
use clap::Parser;
use futures::StreamExt;

/// Reads a stream from the start.
#[derive(Parser)]
struct Args {
    /// NATS URL.
    #[arg(long, default_value = "nats://127.0.0.1:54222")]
    url: String,
    /// Stream name.
    #[arg(long, default_value = "ORDERS")]
    stream: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let js = jetstream::new(async_nats::connect(&args.url).await?);
    let stream = js.get_stream(&args.stream).await?;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await?;
    let mut messages = consumer.messages().await?;
    // Stop once the stream has been quiet for a second.
    while let Ok(Some(message)) = tokio::time::timeout(Duration::from_secs(1), messages.next()).await {
        let message = message?;
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(ToString::to_string)
                .unwrap_or_default()
        };
        println!(
            "{subject}  key={key}  event={id}  plugin={plugin}\n    {payload}",
            subject = message.subject,
            key = header("Switchyard-Key"),
            id = header("Switchyard-Event-Id"),
            plugin = header("Switchyard-Plugin"),
            payload = String::from_utf8_lossy(&message.payload),
        );
    }
    Ok(())
}
