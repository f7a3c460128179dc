//! NATS target: core publish (acknowledged by a flush) or JetStream publish
//! (acknowledged by the stream, deduplicated on `Nats-Msg-Id`, the event id).

mod config;
mod sink;

pub use config::{NatsMode, NatsSinkConfig, StreamSpec};
pub use sink::NatsSink;
