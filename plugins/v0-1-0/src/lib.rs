//! Test plugin built against `switchyard:plugin@0.1.0`, whose WIT is kept
//! here as it was released: a relay that speaks a later 0.1.x must still
//! load it. Its config names the `target`; every event goes to topic
//! `v0-1-0.<event type>`, keyed by its aggregate id.

use std::sync::OnceLock;

wit_bindgen::generate!({ path: "wit", world: "router" });

static TARGET: OnceLock<String> = OnceLock::new();

struct Frozen;

impl Guest for Frozen {
    fn init(config: String) -> Result<(), String> {
        let value: serde_json::Value = serde_json::from_str(&config).map_err(|e| e.to_string())?;
        let target = value
            .get("target")
            .and_then(|v| v.as_str())
            .ok_or("bad config: missing `target`")?;
        switchyard::plugin::host::log(
            switchyard::plugin::host::Level::Debug,
            &format!("routing to {target}"),
        );
        let _ = TARGET.set(target.to_string());
        Ok(())
    }

    fn route(event: Event) -> Result<Vec<Message>, Refusal> {
        let target = TARGET.get().ok_or_else(|| Refusal::Permanent("no init".into()))?;
        Ok(vec![Message {
            target: target.clone(),
            topic: format!("v0-1-0.{}", event.event_type),
            key: Some(event.aggregate_id),
            payload: event.payload,
            headers: Vec::new(),
        }])
    }
}

export!(Frozen);
