//! Kafka target through librdkafka: an idempotent `acks=all` producer per
//! named cluster, the plugin's key picking the partition, and each message
//! acknowledged by its delivery report.

mod config;
mod sink;

pub use config::KafkaSinkConfig;
pub use sink::{KafkaSink, classify};
