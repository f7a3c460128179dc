//! `switchyard plugin check|test`: inspect and dry-run plugins without a relay.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, bail};

use super::PluginCommand;
use std::collections::BTreeMap;

use crate::config::{Config, PluginConfig, PluginRuntimeConfig, TargetConfig};
use crate::plugin::{CallFailure, Event, PayloadFormat, PluginEngine};
use crate::router::{self, Limits};
use crate::store::OutboxStore;

pub(super) async fn run(command: PluginCommand) -> anyhow::Result<()> {
    match command {
        PluginCommand::Check { file } => check(&file),
        PluginCommand::Test {
            file,
            event,
            config,
            relay_config,
            plugin,
            from_db,
            limit,
            database_url,
        } => {
            let relay = relay_config.as_deref().map(Config::load).transpose()?;
            let plugin_config = plugin_config(&file, &config, relay.as_ref(), plugin.as_deref())?;
            // With a relay config, its targets decide which names exist and
            // which topic rules apply, and its cache is used.
            let targets = relay.as_ref().map(|relay| relay.targets.clone());
            let cache_dir = relay.as_ref().map_or_else(
                || PluginRuntimeConfig::default().cache_dir(),
                |r| r.plugin_runtime.cache_dir(),
            );
            let events = match (event, from_db) {
                (Some(path), _) => vec![Ok(event_from_file(&path)?)],
                (None, true) => {
                    let url =
                        database_url.context("--from-db needs --database-url or SWITCHYARD_DATABASE_URL")?;
                    let store = OutboxStore::connect(&url, 2)
                        .await
                        .context("cannot connect to the database")?;
                    let limits = limits();
                    store
                        .peek_pending(limit)
                        .await?
                        .iter()
                        .map(|row| {
                            router::event_from_row(row, &limits)
                                .map_err(|e| format!("row {} ({}): {e}", row.id, row.event_id))
                        })
                        .collect()
                }
                (None, false) => bail!("give --event FILE or --from-db"),
            };
            let total = events.len();
            // Plugin calls block (WASI's host side): never on a runtime thread.
            let failed = tokio::task::spawn_blocking(move || {
                test(&plugin_config, events, targets.as_ref(), cache_dir.as_deref())
            })
            .await??;
            // Non-zero exit, so that a plugin's own CI can gate on it.
            if failed > 0 {
                bail!("{failed} of {total} event(s) would not be published (refused, trapped or invalid)");
            }
            Ok(())
        }
    }
}

fn limits() -> Limits {
    Limits::from_config(&crate::config::RelayConfig::default())
}

fn check(file: &Path) -> anyhow::Result<()> {
    let engine = PluginEngine::new(None)?;
    let inspection = engine.inspect(file)?;
    println!("{}: valid switchyard:plugin/router component", file.display());
    println!("  version:  {}", inspection.version);
    println!("  size:     {} bytes", inspection.size);
    println!("  compiled: {} ms", inspection.compile_time.as_millis());
    println!("  exports:  {}", inspection.exports.join(", "));
    println!("  imports:  {}", inspection.imports.join(", "));
    Ok(())
}

fn plugin_config(
    file: &Path,
    pairs: &[String],
    relay: Option<&Config>,
    name: Option<&str>,
) -> anyhow::Result<PluginConfig> {
    // From the relay config, the whole entry: its time and memory bounds too.
    let from_relay = match (relay, name) {
        (Some(relay), Some(name)) => Some(
            relay
                .plugins
                .iter()
                .find(|p| p.name == name)
                .with_context(|| format!("no plugin named {name:?} in the relay config"))?
                .clone(),
        ),
        _ => None,
    };
    let mut table = from_relay
        .as_ref()
        .map_or_else(toml::Table::new, |plugin| plugin.config.clone());
    for pair in pairs {
        let (key, value) = pair
            .split_once('=')
            .with_context(|| format!("--config {pair:?} is not KEY=VALUE"))?;
        let value = match serde_json::from_str::<serde_json::Value>(value) {
            Ok(json) => {
                toml::Value::try_from(json).with_context(|| format!("--config {key}: not representable"))?
            }
            Err(_) => toml::Value::String(value.to_string()),
        };
        table.insert(key.to_string(), value);
    }
    let name = file
        .file_stem()
        .map_or_else(|| "plugin".into(), |s| s.to_string_lossy().into_owned());
    let mut config: PluginConfig = toml::from_str(&format!(
        "name = {name:?}\npath = {:?}",
        file.display().to_string()
    ))
    .context("internal: default plugin config")?;
    config.timeout_ms = 1_000;
    if let Some(plugin) = from_relay {
        config = PluginConfig {
            path: config.path,
            ..plugin
        };
    }
    config.config = table;
    Ok(config)
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EventFile {
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    #[serde(default)]
    payload: serde_json::Value,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    event_id: Option<uuid::Uuid>,
    #[serde(default = "one")]
    attempt: u32,
}

const fn one() -> u32 {
    1
}

fn event_from_file(path: &Path) -> anyhow::Result<Event> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let event: EventFile =
        serde_json::from_str(&text).with_context(|| format!("{} is not a valid event", path.display()))?;
    Ok(Event {
        row_id: 0,
        event_id: event.event_id.unwrap_or_else(uuid::Uuid::new_v4).to_string(),
        aggregate_type: event.aggregate_type,
        aggregate_id: event.aggregate_id,
        event_type: event.event_type,
        payload: serde_json::to_vec(&event.payload)?,
        payload_format: PayloadFormat::Json,
        headers: event.headers.into_iter().collect(),
        tenant: event.tenant,
        created_at_ms: chrono::Utc::now().timestamp_millis(),
        attempt: event.attempt,
    })
}

/// Whether a message fits its target's broker rules (with a relay config).
fn broker_check(
    targets: Option<&BTreeMap<String, TargetConfig>>,
    target: &str,
    topic: &str,
) -> Result<(), String> {
    match targets.and_then(|targets| targets.get(target)) {
        Some(TargetConfig::Nats(_)) => crate::sinks::nats::check_subject(topic).map_err(|e| e.message),
        Some(TargetConfig::Kafka(_)) => crate::sinks::kafka::check_topic(topic).map_err(|e| e.message),
        Some(TargetConfig::Rabbitmq(_)) => crate::sinks::rabbitmq::check_routing_key(topic),
        _ => Ok(()),
    }
}

/// Routes every event and prints what would be published; returns how many
/// events would not be (refused, trapped, invalid output, unroutable row).
fn test(
    config: &PluginConfig,
    events: Vec<Result<Event, String>>,
    targets: Option<&BTreeMap<String, TargetConfig>>,
    cache_dir: Option<&Path>,
) -> anyhow::Result<usize> {
    let engine = PluginEngine::new(cache_dir)?;
    let mut failed = 0;
    // Without a relay config any target name is accepted.
    let known = |name: &str| match targets {
        Some(targets) => targets.get(name).map(|target| match target {
            TargetConfig::Nats(nats) => nats.mode == crate::sinks::nats::NatsMode::Jetstream,
            _ => false,
        }),
        None => Some(false),
    };
    let version = engine.load(config)?;
    let label = version.label();
    println!(
        "plugin {label} loaded in {} ms",
        version.compile_time().as_millis()
    );
    let mut instance = Some(version.checkout()?);
    let limits = limits();
    for event in events {
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                println!("\n{error}\n  not routable: would be dead-lettered");
                failed += 1;
                continue;
            }
        };
        println!(
            "\nevent {} {}/{} {}",
            event.event_id, event.aggregate_type, event.aggregate_id, event.event_type
        );
        let current = match instance.take() {
            Some(current) => current,
            None => version.checkout()?,
        };
        let started = Instant::now();
        let (result, back) = version.route(current, &event);
        instance = back;
        let took = started.elapsed();
        match result {
            Ok(messages) if messages.is_empty() => println!("  dropped on purpose (no messages) [{took:?}]"),
            Ok(messages) => {
                match router::assemble(&event, messages, &label, &limits, &known, None).and_then(|routed| {
                    for message in &routed {
                        broker_check(targets, &message.target, &message.message.topic)
                            .map_err(|e| format!("target {:?}: {e}", message.target))?;
                    }
                    Ok(routed)
                }) {
                    Ok(routed) => {
                        for message in routed {
                            let m = &message.message;
                            println!(
                                "  -> target={} topic={} key={} [{took:?}]",
                                message.target,
                                m.topic,
                                m.key.as_deref().unwrap_or("-")
                            );
                            for (name, value) in &m.headers {
                                println!("     {name}: {value}");
                            }
                            match std::str::from_utf8(&m.payload) {
                                Ok(text) => println!("     {text}"),
                                Err(_) => println!("     <{} binary bytes>", m.payload.len()),
                            }
                        }
                    }
                    Err(error) => {
                        failed += 1;
                        println!("  invalid output, would be dead-lettered: {error}");
                    }
                }
            }
            Err(failure) => {
                failed += 1;
                match failure {
                    CallFailure::Transient(reason) => {
                        println!("  refused (transient, would retry): {reason}")
                    }
                    CallFailure::Permanent(reason) => {
                        println!("  refused (permanent, would dead-letter): {reason}")
                    }
                    CallFailure::Crashed(reason) => println!("  plugin {label} {reason}"),
                }
            }
        }
    }
    Ok(failed)
}
