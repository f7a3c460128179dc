//! RabbitMQ target (AMQP 0-9-1): one exchange per target, the plugin's topic
//! as routing key, `mandatory` so that an unroutable message is refused
//! instead of dropped, persistent delivery, and publisher confirms awaited
//! before a delivery counts as done.

mod config;
mod sink;

pub use config::RabbitMqSinkConfig;
pub use sink::{RabbitMqSink, check_routing_key};
