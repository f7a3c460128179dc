//! Kafka target through librdkafka: an idempotent `acks=all` producer per
//! named cluster, the plugin's key picking the partition, and each message
//! acknowledged by its delivery report.

mod config;
// The client (librdkafka, a C build) is a default feature: a build without
// it, such as the demo's, reads Kafka targets but refuses to start them.
#[cfg(feature = "kafka")]
mod sink;

pub use config::KafkaSinkConfig;
#[cfg(feature = "kafka")]
pub(crate) use sink::HEALTH_TIMEOUT;
#[cfg(feature = "kafka")]
pub use sink::{KafkaSink, classify};
