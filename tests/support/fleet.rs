//! Relays serving many outbox databases: their config, and who holds which
//! database when several relays share them out.

use sqlx::PgPool;

use super::plugins::plugin;
use super::relay::RelaySection;

/// `databases` (name, URL) behind one relay: every order goes to
/// `orders.<database>.<aggregate id>` on NATS at `nats`; a `Poison` event
/// goes to a plugin that traps. `extra` is appended (`[catalog]`,
/// `[ownership]`).
pub fn config(databases: &[(String, String)], nats: &str, relay: &RelaySection, extra: &str) -> String {
    let listed: String = databases
        .iter()
        .map(|(name, url)| {
            format!("[[databases]]\nname = \"{name}\"\nurl = \"{url}\"\nmax_connections = 3\n\n")
        })
        .collect();
    format!(
        r#"{listed}
{relay}
[admin]
listen = ""

[[plugins]]
name = "poison"
path = "{misbehave}"
event_types = ["Poison"]
[plugins.config]
mode = "trap"

[[plugins]]
name = "router"
path = "{route}"
aggregate_types = ["order"]
[plugins.config]
target = "events"
topic = "orders.{{database}}.{{aggregate_id}}"

[targets.events]
type = "nats"
url = "{nats}"
mode = "jetstream"
duplicate_window_seconds = 3600
{extra}"#,
        relay = relay.toml(),
        misbehave = plugin("misbehave").display(),
        route = plugin("route_by_type").display(),
    )
}

/// Who holds each database now (`None`: nobody, or a lease that ran out).
pub async fn owners(pools: &[&PgPool]) -> Vec<Option<String>> {
    let mut owners = Vec::new();
    for pool in pools {
        let owner: Option<String> =
            sqlx::query_scalar("SELECT owner FROM switchyard_ownership WHERE expires_at > now()")
                .fetch_optional(*pool)
                .await
                .ok()
                .flatten()
                .flatten();
        owners.push(owner);
    }
    owners
}
