//! Sample consumer: applies every event of a JetStream stream, a Kafka
//! topic, a RabbitMQ queue, a Pub/Sub subscription or an SQS queue once
//! (inbox table keyed by event id) and prints what it did.
//!
//! ```text
//! cargo run -p consumer -- nats --url nats://127.0.0.1:54222 --stream ORDERS
//! cargo run -p consumer -- kafka --bootstrap-servers 127.0.0.1:59092 --topic orders
//! cargo run -p consumer -- rabbitmq --url amqp://guest:guest@127.0.0.1:55672/%2f --queue orders
//! cargo run -p consumer -- pubsub --emulator-host 127.0.0.1:58085 --project demo --subscription orders-view
//! cargo run -p consumer -- sqs --endpoint-url http://127.0.0.1:55500 --region us-east-1 --queue orders.fifo
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
    /// A Pub/Sub subscription (ordering on); the emulator's, or the real
    /// service's with Application Default Credentials.
    Pubsub {
        /// `host:port` of a Pub/Sub emulator.
        #[arg(long, env = "PUBSUB_EMULATOR_HOST")]
        emulator_host: Option<String>,
        /// Project.
        #[arg(long)]
        project: String,
        /// Subscription.
        #[arg(long, default_value = "orders-view")]
        subscription: String,
        /// Only make the topic and an ordering subscription on it, then exit
        /// (before anything is published: a subscription gets only what
        /// comes after it).
        #[arg(long, value_name = "TOPIC")]
        create_for: Option<String>,
    },
    /// An SQS queue (deleted messages leave it; a FIFO queue hands out a
    /// group's next message once the one before is deleted). Credentials
    /// from AWS's default chain.
    Sqs {
        /// The service's address (moto, a VPC endpoint); default: the region's.
        #[arg(long, env = "AWS_ENDPOINT_URL")]
        endpoint_url: Option<String>,
        /// The region; default: AWS_REGION, then the profile's.
        #[arg(long)]
        region: Option<String>,
        /// Queue name or URL.
        #[arg(long, default_value = "orders.fifo")]
        queue: String,
        /// Only make the queue (FIFO when its name ends in `.fifo`), then
        /// exit.
        #[arg(long, value_name = "QUEUE")]
        create_for: Option<String>,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The Google clients use the process's rustls provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    if let Source::Pubsub {
        emulator_host,
        project,
        subscription,
        create_for: Some(topic),
    } = &args.source
    {
        let place = consumer::pubsub::Place {
            emulator_host: emulator_host.as_deref(),
            project,
        };
        consumer::pubsub::create(&place, topic, subscription).await?;
        println!("topic {topic} and subscription {subscription} (ordering on) ready");
        return Ok(());
    }
    if let Source::Sqs {
        endpoint_url,
        region,
        create_for: Some(queue),
        ..
    } = &args.source
    {
        let place = consumer::sqs::Place {
            endpoint_url: endpoint_url.as_deref(),
            region: region.as_deref(),
        };
        let url = consumer::sqs::create(&place, queue).await?;
        println!("queue {queue} ready: {url}");
        return Ok(());
    }
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
        Source::Pubsub {
            emulator_host,
            project,
            subscription,
            ..
        } => {
            let place = consumer::pubsub::Place {
                emulator_host: emulator_host.as_deref(),
                project: &project,
            };
            consumer::pubsub::consume(&place, &subscription, &inbox, idle, print).await?
        }
        Source::Sqs {
            endpoint_url,
            region,
            queue,
            ..
        } => {
            let place = consumer::sqs::Place {
                endpoint_url: endpoint_url.as_deref(),
                region: region.as_deref(),
            };
            consumer::sqs::consume(&place, &queue, &inbox, idle, print).await?
        }
    };
    println!(
        "applied {}, skipped {} redeliveries",
        tally.applied, tally.skipped
    );
    Ok(())
}
