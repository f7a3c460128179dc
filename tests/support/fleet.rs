//! Relays serving many outbox databases: their config, and who holds which
//! database when several relays share them out.

use sqlx::PgPool;

use super::config::{Plugin, Target, TestConfig, strings};
use super::plugins::plugin;
use super::relay::RelaySection;

/// `databases` (name, URL) behind one relay: every order goes to
/// `orders.<database>.<aggregate id>` on NATS at `nats`; a `Poison` event
/// goes to a plugin that traps. Add `[catalog]`, `[ownership]` with
/// [`TestConfig::set`].
pub fn fleet(databases: &[(String, String)], nats: &str, relay: &RelaySection) -> TestConfig {
    let config = databases.iter().fold(TestConfig::fleet(), |config, (name, url)| {
        config.member(name, url, &[("max_connections", 3.into())])
    });
    config
        .tuning(relay.clone())
        .set("admin", "listen", "")
        .plugin(
            Plugin::new("poison", &plugin("misbehave"))
                .event_types(&["Poison"])
                .config("mode", "trap"),
        )
        .plugin(
            Plugin::new("router", &plugin("route_by_type"))
                .set("aggregate_types", strings(&["order"]))
                .to("events", "orders.{database}.{aggregate_id}"),
        )
        .target("events", Target::nats(nats).set("mode", "jetstream"))
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
