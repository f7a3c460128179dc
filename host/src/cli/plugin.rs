//! `switchyard plugin check|test`: inspect and dry-run plugins without a relay.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, bail};

use super::PluginCommand;
use crate::config::{Config, PluginConfig};
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
            let plugin_config = plugin_config(&file, &config, relay_config.as_deref(), plugin.as_deref())?;
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
            // Plugin calls block (WASI's host side): never on a runtime thread.
            tokio::task::spawn_blocking(move || test(&plugin_config, events)).await?
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
    relay_config: Option<&Path>,
    name: Option<&str>,
) -> anyhow::Result<PluginConfig> {
    let mut table = match (relay_config, name) {
        (Some(path), Some(name)) => {
            let config = Config::load(path)?;
            config
                .plugins
                .into_iter()
                .find(|p| p.name == name)
                .with_context(|| format!("no plugin named {name:?} in {}", path.display()))?
                .config
        }
        _ => toml::Table::new(),
    };
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
    config.config = table;
    config.timeout_ms = 1_000;
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

fn test(config: &PluginConfig, events: Vec<Result<Event, String>>) -> anyhow::Result<()> {
    let engine = PluginEngine::new(None)?;
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
            Ok(messages) => match router::assemble(&event, messages, &label, &limits, &|_| Some(false), None)
            {
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
                Err(error) => println!("  invalid output, would be dead-lettered: {error}"),
            },
            Err(CallFailure::Transient(reason)) => println!("  refused (transient, would retry): {reason}"),
            Err(CallFailure::Permanent(reason)) => {
                println!("  refused (permanent, would dead-letter): {reason}")
            }
            Err(CallFailure::Crashed(reason)) => println!("  plugin {label} {reason}"),
        }
    }
    Ok(())
}
