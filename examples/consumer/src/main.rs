//! Sample consumer: applies every event of a JetStream stream, a Kafka
//! topic or a RabbitMQ queue once (inbox table keyed by event id) and prints what it did.
//!
//! ```text
//! cargo run -p consumer -- nats --url nats://127.0.0.1:54222 --stream ORDERS
//! cargo run -p consumer -- kafka --bootstrap-servers 127.0.0.1:59092 --topic orders
//! cargo run -p consumer -- rabbitmq --url amqp://guest:guest@127.0.0.1:55672/%2f --queue orders
//! ```

use std::time::Duration;

use async_nats::jetstream;
use clap::{Parser, Subcommand};
use consumer::Inbox;

/// Reads from where this consumer left off and applies each event once.
#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    source: Source,
    /// The consumer's own database (PostgreSQL or SQLite URL).
    #[arg(long, global = true, default_value = "sqlite:///tmp/switchyard-inbox.db")]
    inbox: String,
    /// Stop after the source has been quiet this long.
    #[arg(long, global = true, default_value_t = 1000)]
    idle_ms: u64,
}

#[derive(Subcommand)]
enum Source {
    /// A JetStream stream, through a durable consumer.
    Nats {
        /// NATS URL.
        #[arg(long, default_value = "nats://127.0.0.1:54222")]
        url: String,
        /// Stream name.
        #[arg(long, default_value = "ORDERS")]
        stream: String,
        /// Durable consumer name (its position survives restarts).
        #[arg(long, default_value = "order-view")]
        durable: String,
    },
    /// A Kafka topic, as a member of a consumer group.
    Kafka {
        /// `host:port` list.
        #[arg(long, default_value = "127.0.0.1:59092")]
        bootstrap_servers: String,
        /// Topic.
        #[arg(long, default_value = "orders")]
        topic: String,
        /// Consumer group (its committed offsets survive restarts).
        #[arg(long, default_value = "order-view")]
        group: String,
    },
    /// A RabbitMQ queue (acked messages leave it).
    Rabbitmq {
        /// AMQP URL.
        #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:55672/%2f")]
        url: String,
        /// Queue.
        #[arg(long, default_value = "orders")]
        queue: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let inbox = Inbox::open(&args.inbox).await?;
    let idle = Duration::from_millis(args.idle_ms);
    let print = |delivered: &consumer::Delivered, applied: bool| println!("{}", delivered.describe(applied));
    let tally = match args.source {
        Source::Nats { url, stream, durable } => {
            let js = jetstream::new(async_nats::connect(&url).await?);
            consumer::nats::consume(&js, &stream, &durable, &inbox, idle, print).await?
        }
        Source::Kafka {
            bootstrap_servers,
            topic,
            group,
        } => consumer::kafka::consume(&bootstrap_servers, &topic, &group, &inbox, idle, print).await?,
        Source::Rabbitmq { url, queue } => {
            consumer::rabbitmq::consume(&url, &queue, &inbox, idle, print).await?
        }
    };
    println!(
        "applied {}, skipped {} redeliveries",
        tally.applied, tally.skipped
    );
    Ok(())
}
