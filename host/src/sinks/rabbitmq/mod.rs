//! RabbitMQ target (AMQP 0-9-1): one exchange per target, the plugin's topic
//! as routing key, `mandatory` so that an unroutable message is refused
//! instead of dropped, persistent delivery, and publisher confirms awaited
//! before a delivery counts as done.

mod config;
// The client (lapin) is a default feature; the demo's build reads RabbitMQ
// targets but refuses to start them.
#[cfg(feature = "rabbitmq")]
mod sink;

pub use config::{RabbitMqSinkConfig, check_routing_key};
#[cfg(feature = "rabbitmq")]
pub use sink::RabbitMqSink;
