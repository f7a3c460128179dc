//! One broker of each kind behind one interface, for the outage tests and
//! the long outage runs: started with its data kept across a restart
//! (JetStream store, tansu on SQLite, a durable RabbitMQ queue), stopped
//! like a crash, started again, and read by a consumer. The Pub/Sub
//! emulator keeps nothing across a restart: a consumer reads it while it
//! runs, and its topic, subscription and consumer are made again when it
//! comes back (a consumer left retrying a dead emulator backs off for up
//! to a minute).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use super::config::{Plugin, Target, TestConfig, routes};
use super::kafka::KafkaServer;
use super::nats::{NatsServer, Received};
use super::orders::{Expected, tally};
use super::plugins::plugin;
use super::pubsub::{Emulator, Front, consume_forever};
use super::rabbitmq::RabbitMq;
use super::relay::RelaySection;

/// A broker under test.
pub enum Broker {
    /// JetStream, stream `ORDERS` on `orders.>`.
    Nats(NatsServer),
    /// tansu on SQLite, topic `orders` with 4 partitions, and its directory.
    Kafka(KafkaServer, PathBuf),
    /// A node of the test's own, exchange `orders` bound to queue `orders-consumer`.
    Rabbit(RabbitMq),
    /// A Pub/Sub emulator of the test's own, topic `orders` with an
    /// ordering-enabled subscription.
    PubSub(PubSub),
}

/// The Pub/Sub emulator as a broker under test.
pub struct PubSub {
    emulator: Emulator,
    project: String,
    /// Stopped by SIGSTOP (frozen, keeping its state) rather than SIGKILL.
    freezes: bool,
    received: std::sync::Arc<std::sync::Mutex<Vec<Received>>>,
    consumer: tokio::task::JoinHandle<()>,
    /// What the relay reaches a killed emulator through: it opens only
    /// once the new emulator has the topic and subscription again.
    front: Option<Front>,
}

impl PubSub {
    async fn start(freezes: bool) -> PubSub {
        let emulator = Emulator::own().await;
        let project = super::pubsub::project();
        emulator.topic(&project, "orders").await;
        let received = std::sync::Arc::default();
        let consumer = Self::consume(&emulator, &project, &received);
        let front = if freezes {
            None
        } else {
            Some(Front::to(emulator.host()).await)
        };
        PubSub {
            emulator,
            project,
            freezes,
            received,
            consumer,
            front,
        }
    }

    fn consume(
        emulator: &Emulator,
        project: &str,
        into: &std::sync::Arc<std::sync::Mutex<Vec<Received>>>,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(consume_forever(
            emulator.host().to_string(),
            project.to_string(),
            "orders".into(),
            std::sync::Arc::clone(into),
        ))
    }

    /// Where the relay finds it.
    fn relay_host(&self) -> String {
        self.front
            .as_ref()
            .map_or_else(|| self.emulator.host().to_string(), Front::host)
    }
}

impl Broker {
    /// Starts a broker of `kind` (`nats`, `kafka`, `rabbitmq`, `pubsub`
    /// or `pubsub-frozen`, stopped by freezing it) with its stream, topic
    /// or queue.
    pub async fn start(kind: &str) -> Broker {
        match kind {
            "pubsub" | "pubsub-frozen" => Broker::PubSub(PubSub::start(kind == "pubsub-frozen").await),
            "kafka" => {
                let dir = std::env::temp_dir().join(format!("sy-kafka-{}", uuid::Uuid::new_v4().simple()));
                std::fs::create_dir_all(&dir).expect("broker dir");
                let kafka = KafkaServer::start_durable(&dir).await;
                kafka.create_topic("orders", 4).await;
                Broker::Kafka(kafka, dir)
            }
            "rabbitmq" => {
                let rabbit = RabbitMq::own().await;
                rabbit.declare("orders", "orders-consumer", "orders.#").await;
                Broker::Rabbit(rabbit)
            }
            _ => {
                let nats = NatsServer::start().await;
                nats.create_stream("ORDERS", &["orders.>"]).await;
                Broker::Nats(nats)
            }
        }
    }

    /// A relay config sending every event to this broker as target `out`
    /// (keyed by aggregate) through the fan-out plugin, with `relay` as the
    /// `[relay]` section ([`RelaySection::defaults`] for the relay's own).
    pub fn config(&self, db_url: &str, relay: RelaySection) -> TestConfig {
        let (target, topic) = match self {
            Broker::Nats(nats) => (Target::nats(&nats.url()), "orders.{event_type}"),
            Broker::Kafka(kafka, _) => (Target::kafka(&kafka.bootstrap()), "orders"),
            Broker::Rabbit(rabbit) => (Target::rabbitmq(rabbit.url(), "orders"), "orders.{event_type}"),
            // Listed, so the health check finds a restarted emulator not
            // ready until the run made the topic again.
            Broker::PubSub(pubsub) => (
                Target::pubsub(&pubsub.project, &pubsub.relay_host())
                    .set("topics", super::config::strings(&["orders"])),
                "orders",
            ),
        };
        TestConfig::new(db_url)
            .database("max_connections", 8)
            .tuning(relay)
            .plugin(
                Plugin::new("fanout", &plugin("fan_out"))
                    // Generous: a plugin call past its limit spends an
                    // attempt, and a loaded two-core machine can stall one;
                    // these runs count attempts.
                    .set("timeout_ms", 1000)
                    .config("default", routes(&[("out", topic, Some("{aggregate_id}"))])),
            )
            .target("out", target)
    }

    /// Stops it like a crash.
    pub fn stop(&mut self) {
        match self {
            Broker::Nats(nats) => nats.stop(),
            Broker::Kafka(kafka, _) => kafka.stop(),
            Broker::Rabbit(rabbit) => rabbit.stop(),
            Broker::PubSub(pubsub) if pubsub.freezes => pubsub.emulator.freeze(),
            Broker::PubSub(pubsub) => {
                if let Some(front) = &mut pubsub.front {
                    front.close();
                }
                // What the emulator held dies with it.
                pubsub.consumer.abort();
                pubsub.emulator.kill();
            }
        }
    }

    /// Starts it again, with what it had.
    pub async fn resume(&mut self) {
        match self {
            Broker::Nats(nats) => nats.resume().await,
            Broker::Kafka(kafka, _) => kafka.resume().await,
            Broker::Rabbit(rabbit) => rabbit.start().await,
            Broker::PubSub(pubsub) if pubsub.freezes => pubsub.emulator.thaw(),
            Broker::PubSub(pubsub) => {
                pubsub.emulator.start().await;
                pubsub.emulator.topic(&pubsub.project, "orders").await;
                pubsub.consumer = PubSub::consume(&pubsub.emulator, &pubsub.project, &pubsub.received);
                if let Some(front) = &mut pubsub.front {
                    front.open().await;
                }
            }
        }
    }

    /// How many copies of an event a consumer may see: JetStream drops them
    /// by `Nats-Msg-Id`; a publish in flight when Kafka or RabbitMQ died
    /// may have been stored without its ack reaching the relay.
    pub fn deduplicates(&self) -> bool {
        matches!(self, Broker::Nats(_))
    }

    /// What a consumer finds (up to `expected` messages), as NATS-shaped
    /// messages, each aggregate's in the order the broker keeps them.
    pub async fn received(&self, expected: usize) -> Vec<Received> {
        let limit = Duration::from_secs(120);
        match self {
            Broker::Nats(nats) => nats.read_stream("ORDERS").await,
            Broker::Kafka(kafka, _) => {
                let mut messages = kafka.read_topic("orders", expected, limit).await;
                // An aggregate's messages sit in one partition, in offset order.
                messages.sort_by_key(|m| (m.partition, m.offset));
                messages
                    .into_iter()
                    .map(|m| Received {
                        subject: "orders".into(),
                        headers: m.headers,
                        payload: m.payload,
                    })
                    .collect()
            }
            Broker::Rabbit(rabbit) => rabbit.drain("orders-consumer", expected, limit).await,
            Broker::PubSub(pubsub) => {
                let deadline = std::time::Instant::now() + limit;
                // Until every event (redelivered copies do not count: with
                // them the count reaches `expected` while events are still
                // on their way), or nothing more for longer than the
                // subscription's ack deadline (an ack lost in a freeze
                // holds its key back that long).
                let mut events = std::collections::HashSet::new();
                let mut read = 0;
                let mut quiet_since = std::time::Instant::now();
                loop {
                    {
                        let received = pubsub.received.lock().unwrap();
                        if received.len() != read {
                            quiet_since = std::time::Instant::now();
                        }
                        for message in &received[read..] {
                            events.insert(
                                message
                                    .header("Switchyard-Event-Id")
                                    .unwrap_or_default()
                                    .to_string(),
                            );
                        }
                        read = received.len();
                    }
                    if events.len() >= expected
                        || quiet_since.elapsed() > Duration::from_secs(15)
                        || std::time::Instant::now() > deadline
                    {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                pubsub.received.lock().unwrap().clone()
            }
        }
    }

    /// Fails the test unless a consumer finds every `expected` event once,
    /// each aggregate's in order, and nothing else.
    pub async fn assert_each_once_in_order(&self, expected: &HashMap<String, Expected>) {
        let tally = tally(&self.received(expected.len()).await, expected);
        assert_eq!(
            (tally.lost, tally.duplicates, tally.reordered, tally.unknown),
            (0, 0, 0, 0),
            "{tally:?}"
        );
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        match self {
            Broker::Kafka(kafka, dir) => {
                kafka.stop();
                let _ = std::fs::remove_dir_all(dir);
            }
            Broker::PubSub(pubsub) => pubsub.consumer.abort(),
            _ => {}
        }
    }
}
