//! Google Cloud Pub/Sub target: the plugin names the topic, headers become
//! attributes, the aggregate id is the ordering key, and a message counts
//! as delivered once the service returned its message id.

mod config;
// The client (gRPC through tonic) is a default feature; the demo's build
// reads Pub/Sub targets but refuses to start them.
#[cfg(feature = "pubsub")]
mod sink;

pub use config::{OrderingKey, PubSubSinkConfig};
#[cfg(feature = "pubsub")]
pub use sink::PubSubSink;
