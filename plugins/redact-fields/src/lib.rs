//! Example plugin: transforms JSON payloads before they leave the building.
//! Masks or removes configured fields and can wrap the result in a CloudEvents
//! 1.0 JSON envelope.
//!
//! Config (the plugin's `config` table in the relay config):
//!
//! | key          | default                           | meaning                                         |
//! |--------------|-----------------------------------|-------------------------------------------------|
//! | `target`     | required                          | target name for every message                   |
//! | `topic`      | `"{aggregate_type}.{event_type}"` | topic template                                  |
//! | `key`        | `"{aggregate_id}"`                | key template; `""` sends no key                 |
//! | `mask`       | `[]`                              | dotted paths whose values are replaced          |
//! | `mask_with`  | `"***"`                           | the replacement value (any JSON value)          |
//! | `remove`     | `[]`                              | dotted paths that are removed                   |
//! | `cloudevents`| `false`                           | wrap the payload as a CloudEvents envelope      |
//! | `source`     | `"/switchyard"`                   | CloudEvents `source` attribute                  |
//!
//! A payload that is not JSON is refused permanently: it cannot be redacted, and
//! passing it on unredacted would defeat the point.

use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::{Value, json};
use switchyard_plugin_common::{Fields, Template, drop_path, mask_path};

wit_bindgen::generate!({ path: "../../wit", world: "router" });

use switchyard::plugin::types::PayloadFormat;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    target: String,
    #[serde(default = "default_topic")]
    topic: String,
    #[serde(default = "default_key")]
    key: String,
    #[serde(default)]
    mask: Vec<String>,
    #[serde(default = "default_mask_with")]
    mask_with: Value,
    #[serde(default)]
    remove: Vec<String>,
    #[serde(default)]
    cloudevents: bool,
    #[serde(default = "default_source")]
    source: String,
}

fn default_topic() -> String {
    "{aggregate_type}.{event_type}".to_string()
}

fn default_key() -> String {
    "{aggregate_id}".to_string()
}

fn default_mask_with() -> Value {
    Value::String("***".to_string())
}

fn default_source() -> String {
    "/switchyard".to_string()
}

struct Config {
    target: String,
    topic: Template,
    key: Option<Template>,
    mask: Vec<String>,
    mask_with: Value,
    remove: Vec<String>,
    cloudevents: bool,
    source: String,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

fn parse_config(json: &str) -> Result<Config, String> {
    let raw: RawConfig = serde_json::from_str(json).map_err(|e| format!("bad config: {e}"))?;
    if raw.target.is_empty() {
        return Err("bad config: `target` must not be empty".to_string());
    }
    Ok(Config {
        target: raw.target,
        topic: Template::parse(&raw.topic)?,
        key: if raw.key.is_empty() {
            None
        } else {
            Some(Template::parse(&raw.key)?)
        },
        mask: raw.mask,
        mask_with: raw.mask_with,
        remove: raw.remove,
        cloudevents: raw.cloudevents,
        source: raw.source,
    })
}

fn millis_to_rfc3339(ms: i64) -> String {
    // Civil-from-days (Howard Hinnant); plugins have no clock or tz database.
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

struct RedactFields;

impl Guest for RedactFields {
    fn init(config: String) -> Result<(), String> {
        let _ = CONFIG.set(parse_config(&config)?);
        Ok(())
    }

    fn route(event: Event) -> Result<Vec<Message>, Refusal> {
        let config = CONFIG
            .get()
            .ok_or_else(|| Refusal::Permanent("route called before init".to_string()))?;
        if event.payload_format != PayloadFormat::Json {
            return Err(Refusal::Permanent(
                "redact-fields needs a JSON payload, got binary".to_string(),
            ));
        }
        let mut doc: Value = serde_json::from_slice(&event.payload)
            .map_err(|e| Refusal::Permanent(format!("payload is not valid JSON: {e}")))?;
        for path in &config.mask {
            mask_path(&mut doc, path, &config.mask_with);
        }
        for path in &config.remove {
            drop_path(&mut doc, path);
        }
        let database = switchyard::plugin::host::database().unwrap_or_default();
        let fields = Fields {
            aggregate_type: &event.aggregate_type,
            aggregate_id: &event.aggregate_id,
            event_type: &event.event_type,
            tenant: event.tenant.as_deref().unwrap_or(""),
            database: &database,
        };
        let (body, content_type) = if config.cloudevents {
            let envelope = json!({
                "specversion": "1.0",
                "id": event.event_id,
                "source": config.source,
                "type": event.event_type,
                "subject": event.aggregate_id,
                "time": millis_to_rfc3339(event.created_at_ms),
                "datacontenttype": "application/json",
                "data": doc,
            });
            (envelope, "application/cloudevents+json")
        } else {
            (doc, "application/json")
        };
        let payload = serde_json::to_vec(&body)
            .map_err(|e| Refusal::Permanent(format!("cannot encode payload: {e}")))?;
        Ok(vec![Message {
            target: config.target.clone(),
            topic: config.topic.render(&fields),
            key: config.key.as_ref().map(|key| key.render(&fields)),
            payload,
            headers: vec![("content-type".to_string(), content_type.to_string())],
        }])
    }
}

export!(RedactFields);
