//! Example plugin: fans each event out to several targets, chosen by event
//! type, e.g. `OrderCreated` to Kafka `orders` keyed by order id and to NATS
//! `audit.orders`.
//!
//! Config (the plugin's `config` table in the relay config):
//!
//! ```toml
//! [plugins.config.routes]
//! OrderCreated = [
//!   { target = "kafka", topic = "orders", key = "{aggregate_id}" },
//!   { target = "nats", topic = "audit.orders.{event_type}" },
//! ]
//! [plugins.config]
//! default = [{ target = "nats", topic = "audit.other" }]   # optional; else unlisted types are dropped
//! ```
//!
//! `topic` and `key` are templates over `{aggregate_type}`, `{aggregate_id}`,
//! `{event_type}` and `{tenant}`; `key` defaults to `{aggregate_id}`.

use std::collections::HashMap;
use std::sync::OnceLock;

use serde::Deserialize;
use switchyard_plugin_common::{Fields, Template};

wit_bindgen::generate!({ path: "../../wit", world: "router" });

use switchyard::plugin::types::PayloadFormat;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDestination {
    target: String,
    topic: String,
    #[serde(default = "default_key")]
    key: String,
}

fn default_key() -> String {
    "{aggregate_id}".to_string()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    routes: HashMap<String, Vec<RawDestination>>,
    #[serde(default)]
    default: Vec<RawDestination>,
}

struct Destination {
    target: String,
    topic: Template,
    key: Option<Template>,
}

struct Config {
    routes: HashMap<String, Vec<Destination>>,
    default: Vec<Destination>,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

fn destinations(raw: Vec<RawDestination>) -> Result<Vec<Destination>, String> {
    raw.into_iter()
        .map(|d| {
            if d.target.is_empty() {
                return Err("bad config: a destination has an empty target".to_string());
            }
            Ok(Destination {
                target: d.target,
                topic: Template::parse(&d.topic)?,
                key: if d.key.is_empty() {
                    None
                } else {
                    Some(Template::parse(&d.key)?)
                },
            })
        })
        .collect()
}

struct FanOut;

impl Guest for FanOut {
    fn init(config: String) -> Result<(), String> {
        let raw: RawConfig = serde_json::from_str(&config).map_err(|e| format!("bad config: {e}"))?;
        let routes = raw
            .routes
            .into_iter()
            .map(|(event_type, list)| Ok((event_type, destinations(list)?)))
            .collect::<Result<_, String>>()?;
        let _ = CONFIG.set(Config {
            routes,
            default: destinations(raw.default)?,
        });
        Ok(())
    }

    fn route(event: Event) -> Result<Vec<Message>, Refusal> {
        let config = CONFIG
            .get()
            .ok_or_else(|| Refusal::Permanent("route called before init".into()))?;
        let list = config.routes.get(&event.event_type).unwrap_or(&config.default);
        let database = switchyard::plugin::host::database().unwrap_or_default();
        let fields = Fields {
            aggregate_type: &event.aggregate_type,
            aggregate_id: &event.aggregate_id,
            event_type: &event.event_type,
            tenant: event.tenant.as_deref().unwrap_or(""),
            database: &database,
        };
        let content_type = match event.payload_format {
            PayloadFormat::Json => "application/json",
            PayloadFormat::Binary => "application/octet-stream",
        };
        Ok(list
            .iter()
            .map(|d| Message {
                target: d.target.clone(),
                topic: d.topic.render(&fields),
                key: d.key.as_ref().map(|k| k.render(&fields)),
                payload: event.payload.clone(),
                headers: vec![("content-type".to_string(), content_type.to_string())],
            })
            .collect())
    }
}

export!(FanOut);
