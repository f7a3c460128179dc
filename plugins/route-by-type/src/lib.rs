//! Example plugin: routes each event to a topic chosen by its event type (or a
//! template over aggregate type and event type), keyed by the aggregate id.
//!
//! Config (the plugin's `config` table in the relay config):
//!
//! | key       | default                             | meaning                                        |
//! |-----------|-------------------------------------|------------------------------------------------|
//! | `target`  | required                            | target name for every message                  |
//! | `topic`   | `"{aggregate_type}.{event_type}"`   | topic template when `routes` has no entry      |
//! | `routes`  | `{}`                                | event type -> topic template                   |
//! | `key`     | `"{aggregate_id}"`                  | key template; `""` sends no key                |
//! | `drop`    | `[]`                                | event types to drop deliberately               |
//!
//! Templates name `{aggregate_type}`, `{aggregate_id}`, `{event_type}`, `{tenant}` and
//! `{database}` (the outbox database, when the relay serves several).

use std::collections::HashMap;
use std::sync::OnceLock;

use serde::Deserialize;
use switchyard_plugin_common::{Fields, Template};

// The same source builds for either world: `route-by-type` (router) and,
// with the `batch` feature, `route-by-type-batch` (batch-router).
#[cfg(not(feature = "batch"))]
wit_bindgen::generate!({ path: "../../wit", world: "router" });
#[cfg(feature = "batch")]
wit_bindgen::generate!({ path: "../../wit", world: "batch-router" });

use switchyard::plugin::host::{Level, log};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    target: String,
    #[serde(default = "default_topic")]
    topic: String,
    #[serde(default)]
    routes: HashMap<String, String>,
    #[serde(default = "default_key")]
    key: String,
    #[serde(default)]
    drop: Vec<String>,
}

fn default_topic() -> String {
    "{aggregate_type}.{event_type}".to_string()
}

fn default_key() -> String {
    "{aggregate_id}".to_string()
}

struct Config {
    target: String,
    topic: Template,
    routes: HashMap<String, Template>,
    key: Option<Template>,
    drop: Vec<String>,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

fn parse_config(json: &str) -> Result<Config, String> {
    let raw: RawConfig = serde_json::from_str(json).map_err(|e| format!("bad config: {e}"))?;
    if raw.target.is_empty() {
        return Err("bad config: `target` must not be empty".to_string());
    }
    let routes = raw
        .routes
        .iter()
        .map(|(event_type, topic)| Ok((event_type.clone(), Template::parse(topic)?)))
        .collect::<Result<_, String>>()?;
    Ok(Config {
        target: raw.target,
        topic: Template::parse(&raw.topic)?,
        routes,
        key: if raw.key.is_empty() {
            None
        } else {
            Some(Template::parse(&raw.key)?)
        },
        drop: raw.drop,
    })
}

struct RouteByType;

fn configure(config: String) -> Result<(), String> {
    let parsed = parse_config(&config)?;
    log(Level::Debug, &format!("routing to target {:?}", parsed.target));
    // A second init in the same instance keeps the first config: the
    // relay calls init once per instance.
    let _ = CONFIG.set(parsed);
    Ok(())
}

#[cfg(not(feature = "batch"))]
impl Guest for RouteByType {
    fn init(config: String) -> Result<(), String> {
        configure(config)
    }

    fn route(event: Event) -> Result<Vec<Message>, Refusal> {
        route_event(event)
    }
}

#[cfg(feature = "batch")]
impl Guest for RouteByType {
    fn init(config: String) -> Result<(), String> {
        configure(config)
    }

    fn route_batch(events: Vec<Event>) -> Vec<Result<Vec<Message>, Refusal>> {
        events.into_iter().map(route_event).collect()
    }
}

fn route_event(event: Event) -> Result<Vec<Message>, Refusal> {
    let config = CONFIG
        .get()
        .ok_or_else(|| Refusal::Permanent("route called before init".to_string()))?;
    if config.drop.contains(&event.event_type) {
        return Ok(Vec::new());
    }
    let database = switchyard::plugin::host::database().unwrap_or_default();
    let fields = Fields {
        aggregate_type: &event.aggregate_type,
        aggregate_id: &event.aggregate_id,
        event_type: &event.event_type,
        tenant: event.tenant.as_deref().unwrap_or(""),
        database: &database,
    };
    let topic = config.routes.get(&event.event_type).unwrap_or(&config.topic);
    let content_type = content_type(&event);
    Ok(vec![Message {
        target: config.target.clone(),
        topic: topic.render(&fields),
        key: config.key.as_ref().map(|key| key.render(&fields)),
        payload: event.payload,
        headers: vec![("content-type".to_string(), content_type.to_string())],
    }])
}

fn content_type(event: &Event) -> &'static str {
    match event.payload_format {
        switchyard::plugin::types::PayloadFormat::Json => "application/json",
        switchyard::plugin::types::PayloadFormat::Binary => "application/octet-stream",
    }
}

export!(RouteByType);
