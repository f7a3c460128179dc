//! Test plugin for the `batch-router` world. Every event goes to the target
//! named by `target`, topic `batch.<event type>`, keyed by its aggregate id,
//! with a header `x-batch-size` saying how many events the call that routed
//! it carried. Config keys name event types that make the whole call fail,
//! so tests can show that one event cannot fail its batch:
//!
//! | key        | a call holding such an event...                        |
//! |------------|--------------------------------------------------------|
//! | `trap`     | hits `unreachable`                                     |
//! | `loop`     | spins forever                                          |
//! | `short`    | returns one result fewer than it was given events      |
//! | `transient`| (per event) refuses that event for now                 |

use std::sync::OnceLock;

wit_bindgen::generate!({ path: "../../wit", world: "batch-router" });

struct Config {
    target: String,
    trap: Vec<String>,
    spin: Vec<String>,
    short: Vec<String>,
    transient: Vec<String>,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

struct BatchProbe;

impl Guest for BatchProbe {
    fn init(config: String) -> Result<(), String> {
        let value: serde_json::Value = serde_json::from_str(&config).map_err(|e| e.to_string())?;
        let list = |key: &str| -> Vec<String> {
            value
                .get(key)
                .and_then(|v| v.as_array())
                .map(|types| {
                    types
                        .iter()
                        .filter_map(|t| t.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        let target = value
            .get("target")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .to_string();
        if target.is_empty() {
            return Err("bad config: missing `target`".to_string());
        }
        let _ = CONFIG.set(Config {
            target,
            trap: list("trap"),
            spin: list("loop"),
            short: list("short"),
            transient: list("transient"),
        });
        Ok(())
    }

    fn route_batch(events: Vec<Event>) -> Vec<Result<Vec<Message>, Refusal>> {
        let Some(config) = CONFIG.get() else {
            return events
                .iter()
                .map(|_| Err(Refusal::Permanent("no init".into())))
                .collect();
        };
        let holds = |types: &[String]| events.iter().any(|e| types.contains(&e.event_type));
        if holds(&config.trap) {
            core::arch::wasm32::unreachable();
        }
        if holds(&config.spin) {
            let mut n: u64 = 0;
            loop {
                n = std::hint::black_box(n.wrapping_add(1));
            }
        }
        let short = holds(&config.short);
        let size = events.len().to_string();
        let mut answers: Vec<Result<Vec<Message>, Refusal>> = events
            .into_iter()
            .map(|event| {
                if config.transient.contains(&event.event_type) {
                    return Err(Refusal::Transient(format!(
                        "{} refused for now",
                        event.event_type
                    )));
                }
                Ok(vec![Message {
                    target: config.target.clone(),
                    topic: format!("batch.{}", event.event_type),
                    key: Some(event.aggregate_id),
                    payload: event.payload,
                    headers: vec![("x-batch-size".to_string(), size.clone())],
                }])
            })
            .collect();
        if short {
            answers.pop();
        }
        answers
    }
}

export!(BatchProbe);
