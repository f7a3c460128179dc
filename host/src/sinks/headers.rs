//! The headers the relay puts on every message: the router writes them, and
//! a sink that maps headers onto its broker's own fields (SQS attributes,
//! a Pub/Sub ordering key, a webhook's signature) reads them by name.

/// Header with the event id, on every message and every broker.
pub const EVENT_ID_HEADER: &str = "Switchyard-Event-Id";
/// Header with the event type.
pub const EVENT_TYPE_HEADER: &str = "Switchyard-Event-Type";
/// Header with the aggregate type.
pub const AGGREGATE_TYPE_HEADER: &str = "Switchyard-Aggregate-Type";
/// Header with the aggregate id.
pub const AGGREGATE_ID_HEADER: &str = "Switchyard-Aggregate-Id";
/// Header naming the plugin version (`name@hash`) that routed the event.
pub const PLUGIN_HEADER: &str = "Switchyard-Plugin";
