//! Sample consumer: applies every event of a JetStream stream once (inbox
//! table keyed by event id) and prints what it did.
//!
//! ```text
//! cargo run -p nats-consumer -- --url nats://127.0.0.1:54222 --stream ORDERS --inbox sqlite:///tmp/inbox.db
//! ```

use std::time::Duration;

use async_nats::jetstream;
use clap::Parser;
use nats_consumer::{Inbox, consume, header};

/// Reads a stream from where this consumer left off.
#[derive(Parser)]
struct Args {
    /// NATS URL.
    #[arg(long, default_value = "nats://127.0.0.1:54222")]
    url: String,
    /// Stream name.
    #[arg(long, default_value = "ORDERS")]
    stream: String,
    /// Durable consumer name (its position survives restarts).
    #[arg(long, default_value = "order-view")]
    durable: String,
    /// The consumer's own database (PostgreSQL or SQLite URL).
    #[arg(long, default_value = "sqlite:///tmp/switchyard-inbox.db")]
    inbox: String,
    /// Stop after the stream has been quiet this long.
    #[arg(long, default_value_t = 1000)]
    idle_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let js = jetstream::new(async_nats::connect(&args.url).await?);
    let inbox = Inbox::open(&args.inbox).await?;
    let tally = consume(
        &js,
        &args.stream,
        &args.durable,
        &inbox,
        Duration::from_millis(args.idle_ms),
        |message, applied| {
            let header = |name: &str| header(message, name);
            println!(
                "{subject}  key={key}  event={id}  plugin={plugin}  {verdict}\n    {payload}",
                subject = message.subject,
                key = header("Switchyard-Key"),
                id = header("Switchyard-Event-Id"),
                plugin = header("Switchyard-Plugin"),
                verdict = if applied { "applied" } else { "duplicate, skipped" },
                payload = String::from_utf8_lossy(&message.payload),
            );
        },
    )
    .await?;
    println!(
        "applied {}, skipped {} redeliveries",
        tally.applied, tally.skipped
    );
    Ok(())
}
