//! `switchyard plugin check|test|push`: inspect, dry-run and publish plugins without a relay
//! (`plugin new` is in [`super::scaffold`]).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::PluginCommand;
use std::collections::BTreeMap;

mod report;
use report::{EventReport, EventSummary, MessageReport, TestReport, message_report, print_human};

use crate::config::{Config, PluginConfig, PluginRuntimeConfig, TargetConfig};
use crate::plugin::oci::{OciCache, OciSource};
use crate::plugin::{CallFailure, Event, PayloadFormat, PluginEngine, PluginVersion, Plugins};
use crate::relay::router::{self, Limits};
use crate::store::OutboxStore;

pub(super) async fn run(command: PluginCommand) -> anyhow::Result<()> {
    match command {
        PluginCommand::New { name, lang, dir } => super::scaffold::new_plugin(&name, lang, &dir),
        PluginCommand::Check { file, registry } => {
            let file = local_component(&file, &registry).await?;
            check(&file)
        }
        PluginCommand::Push {
            file,
            reference,
            registry,
        } => push(&file, &reference, &registry).await,
        PluginCommand::Test {
            file,
            registry,
            event,
            config,
            relay_config,
            plugin,
            from_db,
            limit,
            database_url,
            database,
            payload_file,
            json,
        } => {
            let relay = relay_config.as_deref().map(Config::load).transpose()?;
            let file = local_component(&file, &registry).await?;
            let plugin_config = plugin_config(&file, &config, relay.as_ref(), plugin.as_deref())?;
            // With a relay config, its targets decide which names exist and
            // which topic rules apply, and its cache is used.
            let targets = relay.as_ref().map(|relay| relay.targets.clone());
            let cache_dir = relay.as_ref().map_or_else(
                || PluginRuntimeConfig::default().cache_dir(),
                |r| r.plugin_runtime.cache_dir(),
            );
            let events: Vec<Result<Event, UnreadableRow>> = match (event.is_empty(), from_db) {
                (false, _) => events_from_files(&event, payload_file.as_deref())?
                    .into_iter()
                    .map(Ok)
                    .collect(),
                (true, true) => {
                    let url: crate::endpoint::Endpoint = match (&database, &relay) {
                        (Some(name), Some(relay)) => {
                            crate::fleet::catalog::pick(relay, Some(name)).await?.endpoint()
                        }
                        _ => database_url
                            .context("--from-db needs --database-url or SWITCHYARD_DATABASE_URL")?
                            .into(),
                    };
                    let store = OutboxStore::connect(url, 2)
                        .await
                        .context("cannot connect to the database")?;
                    let limits = limits();
                    store
                        .peek_pending(limit)
                        .await?
                        .iter()
                        .map(|row| {
                            router::event_from_row(row, &limits).map_err(|error| UnreadableRow {
                                id: row.id,
                                event_id: row.event_id,
                                error,
                            })
                        })
                        .collect()
                }
                (true, false) => bail!("give --event FILE or --from-db"),
            };
            let total = events.len();
            // Plugin calls block (WASI's host side): never on a runtime thread.
            let report = tokio::task::spawn_blocking(move || {
                test(&plugin_config, events, targets.as_ref(), cache_dir.as_deref())
            })
            .await??;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print_human(&report);
            }
            // Non-zero exit, so that a plugin's own CI can gate on it.
            if report.failed > 0 {
                bail!(
                    "{} of {total} event(s) would not be published (refused, trapped or invalid)",
                    report.failed
                );
            }
            Ok(())
        }
    }
}

/// `file` itself, or for an `oci://` reference the component pulled into
/// the default cache (checked against its digest).
async fn local_component(file: &Path, registry: &super::RegistryArgs) -> anyhow::Result<PathBuf> {
    let Some(reference) = file
        .to_str()
        .and_then(|f| f.strip_prefix(crate::config::registry::OCI_SCHEME))
    else {
        return Ok(file.to_path_buf());
    };
    let settings = registry.config();
    let problems = settings.problems("the registry options", reference);
    anyhow::ensure!(problems.is_empty(), "{}", problems.join("\n"));
    let cache_dir = PluginRuntimeConfig::default()
        .cache_dir()
        .context("no cache directory for the pulled component: set HOME or XDG_CACHE_HOME")?;
    let source = OciSource::new(reference, &settings)?;
    let pulled = source.pull(&OciCache::new(&cache_dir)).await?;
    eprintln!(
        "pulled {} ({}{})",
        source.display(),
        pulled.manifest_digest,
        if pulled.cache_hit {
            ", component from the cache"
        } else {
            ""
        }
    );
    Ok(pulled.path)
}

async fn push(file: &Path, reference: &str, registry: &super::RegistryArgs) -> anyhow::Result<()> {
    let reference = reference
        .strip_prefix(crate::config::registry::OCI_SCHEME)
        .with_context(|| format!("{reference}: write the reference as oci://REGISTRY/REPOSITORY:TAG"))?;
    let settings = registry.config();
    let problems = settings.problems("the registry options", reference);
    anyhow::ensure!(problems.is_empty(), "{}", problems.join("\n"));
    let source = OciSource::new(reference, &settings)?;
    anyhow::ensure!(
        !source.pinned(),
        "{}: push to a tag; the registry gives the digest",
        source.display()
    );
    // The relay would refuse what does not compile or serves no world of
    // ours: refuse it before it reaches the registry.
    let path = file.to_path_buf();
    let inspection = tokio::task::spawn_blocking(move || {
        let engine = PluginEngine::new(PluginRuntimeConfig::default().cache_dir().as_deref())?;
        anyhow::Ok(engine.inspect(&path)?)
    })
    .await
    .context("checking the component panicked")??;
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let digest = source
        .push(bytes, &inspection.exports, &inspection.imports)
        .await?;
    println!("{}@{digest}", source.display());
    Ok(())
}

fn limits() -> Limits {
    Limits::from_config(&crate::config::RelayConfig::default())
}

fn check(file: &Path) -> anyhow::Result<()> {
    // The relay's default cache: a large component (an interpreter inside)
    // compiles once, for `check`, `test` and the relay alike.
    let engine = PluginEngine::new(PluginRuntimeConfig::default().cache_dir().as_deref())?;
    let inspection = engine.inspect(file)?;
    let world = if inspection.batched {
        "batch-router (route-batch: one call per batch of events)"
    } else {
        "router (route: one call per event)"
    };
    println!("{}: valid switchyard:plugin/{world} component", file.display());
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

/// The events in `paths` (each file one event or an array of them), in
/// order; with `payload_file`, that file's bytes are the single event's
/// payload, as a binary event (`payload_bytes`).
fn events_from_files(paths: &[PathBuf], payload_file: Option<&Path>) -> anyhow::Result<Vec<Event>> {
    let mut events = Vec::new();
    for path in paths {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
        let files = match value {
            serde_json::Value::Array(items) => items
                .into_iter()
                .enumerate()
                .map(|(at, item)| {
                    serde_json::from_value(item)
                        .with_context(|| format!("{} item {at} is not a valid event", path.display()))
                })
                .collect::<anyhow::Result<Vec<EventFile>>>()?,
            value => vec![
                serde_json::from_value(value)
                    .with_context(|| format!("{} is not a valid event", path.display()))?,
            ],
        };
        events.extend(files);
    }
    if payload_file.is_some() && events.len() != 1 {
        bail!(
            "--payload-file gives one event its payload, but there are {} events",
            events.len()
        );
    }
    events
        .into_iter()
        .enumerate()
        .map(|(at, event)| event_from(event, i64::try_from(at).unwrap_or(i64::MAX) + 1, payload_file))
        .collect()
}

fn event_from(event: EventFile, row_id: i64, payload_file: Option<&Path>) -> anyhow::Result<Event> {
    let (payload, payload_format) = match payload_file {
        Some(file) => (
            std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?,
            PayloadFormat::Binary,
        ),
        None => (serde_json::to_vec(&event.payload)?, PayloadFormat::Json),
    };
    Ok(Event {
        row_id,
        event_id: event.event_id.unwrap_or_else(uuid::Uuid::new_v4).to_string(),
        aggregate_type: event.aggregate_type,
        aggregate_id: event.aggregate_id,
        event_type: event.event_type,
        payload,
        payload_format,
        headers: event.headers.into_iter().collect(),
        tenant: event.tenant,
        created_at_ms: chrono::Utc::now().timestamp_millis(),
        attempt: event.attempt,
    })
}

/// What `validate` learns by routing, through each plugin, a sample event
/// of each type it serves (its `event_types`; without them one of a type no
/// plugin names), as `plugin test --relay-config` would: every target a
/// plugin routes to that `[targets]` lacks, which would dead-letter each
/// such event (`problems`), and the samples a plugin refused or failed on
/// (`notes`: a sample is not a real event, so that alone fails nothing).
/// Only samples the plugin would get are tried: an earlier plugin whose
/// filters match takes the event.
///
/// # Errors
/// When a plugin cannot be loaded.
pub(super) fn sample_routes(
    config: &Config,
    plugins: &Plugins,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    const UNNAMED: &str = "SwitchyardSample";
    let (mut problems, mut notes) = (Vec::new(), Vec::new());
    for ((at, plugin), slot) in config.plugins.iter().enumerate().zip(plugins.slots()) {
        let event_types: Vec<&str> = if plugin.event_types.is_empty() {
            vec![UNNAMED]
        } else {
            plugin.event_types.iter().map(String::as_str).collect()
        };
        let aggregate_type = plugin.aggregate_types.first().map_or("sample", String::as_str);
        let samples: Vec<Result<Event, UnreadableRow>> = event_types
            .iter()
            .filter(|event_type| {
                config
                    .plugins
                    .iter()
                    .position(|p| p.matches(aggregate_type, event_type))
                    == Some(at)
            })
            .zip(1..)
            .map(|(event_type, row_id)| {
                Ok(Event {
                    row_id,
                    event_id: uuid::Uuid::new_v4().to_string(),
                    aggregate_type: aggregate_type.to_string(),
                    aggregate_id: "sample-1".to_string(),
                    event_type: (*event_type).to_string(),
                    payload: b"{}".to_vec(),
                    payload_format: PayloadFormat::Json,
                    headers: Vec::new(),
                    tenant: None,
                    created_at_ms: chrono::Utc::now().timestamp_millis(),
                    attempt: 1,
                })
            })
            .collect();
        if samples.is_empty() {
            continue;
        }
        // The version `validate` loaded (a registry plugin as pulled): not
        // compiled and started a second time.
        let version = slot
            .current()
            .ok_or_else(|| anyhow::anyhow!("plugin {:?} is not loaded", plugin.name))?;
        let report = test_version(&version, plugin, samples, Some(&config.targets))?;
        for event in report.events {
            let event_type = event.event.map(|e| e.event_type).unwrap_or_default();
            let what = if event_type == UNNAMED {
                "events".to_string()
            } else {
                format!("{event_type} events")
            };
            let reason = event.reason.unwrap_or_default();
            match (event.outcome, event.problem) {
                ("published" | "dropped", _) => {}
                (_, Some("unknown_target")) => problems.push(format!(
                    "plugin {:?} routes {what} to a target [targets] does not have, so each would be \
                     dead-lettered: {reason}",
                    plugin.name
                )),
                (outcome, _) => notes.push(format!(
                    "plugin {:?} did not route a sample of its {what} with an empty JSON payload \
                     ({outcome}): {reason}",
                    plugin.name
                )),
            }
        }
    }
    Ok((problems, notes))
}

/// A pending row that cannot be read as an event.
#[derive(Debug, thiserror::Error)]
#[error("row {id} ({event_id}): {error}")]
struct UnreadableRow {
    id: crate::store::RowId,
    event_id: uuid::Uuid,
    error: router::Unroutable,
}

/// Whether a message fits its target's broker rules (with a relay config).
fn broker_check(
    targets: Option<&BTreeMap<String, TargetConfig>>,
    target: &str,
    topic: &str,
) -> Result<(), crate::sinks::SinkError> {
    match targets.and_then(|targets| targets.get(target)) {
        Some(target) => target.check_topic(topic),
        None => Ok(()),
    }
}

/// Routes every event and reports what would be published.
fn test(
    config: &PluginConfig,
    events: Vec<Result<Event, UnreadableRow>>,
    targets: Option<&BTreeMap<String, TargetConfig>>,
    cache_dir: Option<&Path>,
) -> anyhow::Result<TestReport> {
    let version = PluginEngine::new(cache_dir)?.load(config)?;
    test_version(&version, config, events, targets)
}

/// [`test`] with the plugin loaded already.
fn test_version(
    version: &PluginVersion,
    config: &PluginConfig,
    events: Vec<Result<Event, UnreadableRow>>,
    targets: Option<&BTreeMap<String, TargetConfig>>,
) -> anyhow::Result<TestReport> {
    // Without a relay config any target name is accepted.
    let known = |name: &str| match targets {
        Some(targets) => targets.get(name).map(TargetConfig::deduplicates_by_id),
        None => Some(false),
    };
    let label = version.label();
    let instance = version.checkout()?;
    let limits = limits();
    // Every routable event in one `route_many`, as the relay routes a
    // claimed batch: a batch plugin gets them in one `route-batch` call.
    let (routable, unroutable): (Vec<_>, Vec<_>) =
        events.into_iter().enumerate().partition(|(_, e)| e.is_ok());
    let (positions, routable): (Vec<usize>, Vec<Event>) = routable
        .into_iter()
        .filter_map(|(at, e)| Some((at, e.ok()?)))
        .unzip();
    let count = u32::try_from(routable.len()).unwrap_or(u32::MAX);
    let mut calls = Vec::new();
    let started = Instant::now();
    // No lease here. A batch call may take at most half the time left, so
    // twice the events' time limits (plus room for new instances after a
    // trap) lets every call run to its own limit, fallback included.
    let until = started
        + Duration::from_secs(60)
        + Duration::from_millis(config.timeout_ms).saturating_mul(count.saturating_mul(2));
    let (answers, _) = version.route_many(Some(instance), None, &routable, &[], until, &mut |took, _| {
        calls.push(took)
    });
    // A batch call's time is shared by its events.
    let shared = started.elapsed() / count.max(1);
    let per_call = !version.batched() && calls.len() == routable.len();
    let mut reports: Vec<(usize, EventReport)> = unroutable
        .into_iter()
        .filter_map(|(at, e)| e.err().map(|error| (at, error)))
        .map(|(at, error)| {
            let report = EventReport {
                event: None,
                outcome: "not_routable",
                reason: Some(error.to_string()),
                problem: None,
                took_us: None,
                messages: Vec::new(),
            };
            (at, report)
        })
        .collect();
    for (at, (event, (answer, position))) in routable
        .into_iter()
        .zip(answers.into_iter().zip(positions))
        .enumerate()
    {
        let took = if per_call { calls[at] } else { shared };
        let took_us = Some(u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
        let result =
            answer.unwrap_or_else(|| Err(CallFailure::Unavailable("not routed in time".to_string())));
        let judged = judge(result, &event, &label, &limits, &known, targets);
        let report = EventReport {
            event: Some(EventSummary {
                event_id: event.event_id,
                aggregate_type: event.aggregate_type,
                aggregate_id: event.aggregate_id,
                event_type: event.event_type,
            }),
            outcome: judged.outcome,
            reason: judged.reason,
            problem: judged.problem,
            took_us,
            messages: judged.messages,
        };
        reports.push((position, report));
    }
    reports.sort_by_key(|(at, _)| *at);
    let reports: Vec<EventReport> = reports.into_iter().map(|(_, report)| report).collect();
    Ok(TestReport {
        plugin: label,
        compile_ms: u64::try_from(version.compile_time().as_millis()).unwrap_or(u64::MAX),
        failed: reports.iter().filter(|r| !r.published()).count(),
        events: reports,
    })
}

/// What the relay would do with one plugin answer.
struct Judged {
    outcome: &'static str,
    reason: Option<String>,
    problem: Option<&'static str>,
    messages: Vec<MessageReport>,
}

impl Judged {
    fn not_published(outcome: &'static str, reason: String, problem: Option<&'static str>) -> Judged {
        Judged {
            outcome,
            reason: Some(reason),
            problem,
            messages: Vec::new(),
        }
    }
}

/// Checks one answer as the relay would: its messages assembled, each
/// topic against its target's own rule.
fn judge(
    result: Result<Vec<crate::plugin::Message>, CallFailure>,
    event: &Event,
    label: &str,
    limits: &Limits,
    known: &dyn Fn(&str) -> Option<bool>,
    targets: Option<&BTreeMap<String, TargetConfig>>,
) -> Judged {
    let messages = match result {
        Ok(messages) => messages,
        Err(CallFailure::Transient(reason)) => {
            return Judged::not_published("refused_transient", reason, None);
        }
        Err(CallFailure::Permanent(reason)) => {
            return Judged::not_published("refused_permanent", reason, None);
        }
        Err(CallFailure::Crashed(reason)) => {
            return Judged::not_published("crashed", format!("plugin {label} {reason}"), None);
        }
        Err(CallFailure::Unavailable(reason)) => return Judged::not_published("crashed", reason, None),
    };
    if messages.is_empty() {
        return Judged {
            outcome: "dropped",
            reason: None,
            problem: None,
            messages: Vec::new(),
        };
    }
    let routed = match router::assemble(event, messages, label, limits, known, None) {
        Ok(routed) => routed,
        Err(error) => {
            return Judged::not_published("invalid_output", error.to_string(), Some(error.problem.kind()));
        }
    };
    let refused = routed.iter().find_map(|message| {
        broker_check(targets, &message.target, &message.message.topic)
            .err()
            .map(|e| format!("target {:?}: {}", message.target, e.message))
    });
    match refused {
        Some(refused) => Judged::not_published("invalid_output", refused, Some("refused_by_target")),
        None => Judged {
            outcome: "published",
            reason: None,
            problem: None,
            messages: routed.into_iter().map(message_report).collect(),
        },
    }
}
