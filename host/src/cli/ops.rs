//! `switchyard status`: the outbox's backlog, retries and dead letters,
//! and the running relay's view from its admin endpoint.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use super::terminal::{field, terminal_safe};
use crate::admin::RelayStatus;
use crate::config::Config;
use crate::store::{OutboxStats, OutboxStore, RunningRelay};
/// Where the outbox is: a config file or a database URL.
#[derive(Debug, Args)]
pub struct Database {
    /// The relay config (TOML): database URL and admin address.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The database URL (instead of --config).
    #[arg(long, env = "SWITCHYARD_DATABASE_URL")]
    database_url: Option<String>,
    /// Which of the config's `[[databases]]` (needed when it lists several).
    #[arg(long, requires = "config")]
    database: Option<String>,
}

impl Database {
    pub(super) async fn open(&self) -> anyhow::Result<(OutboxStore, Option<Config>)> {
        let config = self.config.as_deref().map(Config::load).transpose()?;
        let url = match (&config, &self.database_url) {
            (Some(config), _) => crate::fleet::catalog::pick(config, self.database.as_deref())
                .await?
                .endpoint(),
            (None, Some(url)) => url.into(),
            (None, None) => {
                anyhow::bail!("give --config FILE or --database-url URL (or SWITCHYARD_DATABASE_URL)")
            }
        };
        let store = OutboxStore::connect(url, 2)
            .await
            .context("cannot connect to the database")?;
        anyhow::ensure!(
            store.schema_exists().await.context("cannot query the database")?,
            "table switchyard_outbox does not exist: run `switchyard migrate` first"
        );
        Ok((store, config))
    }
}
/// What `status --json` prints.
#[derive(Debug, Serialize)]
struct StatusReport {
    database: &'static str,
    outbox: OutboxStats,
    /// The relays running against this outbox, most recently started first.
    relays: Vec<RunningRelay>,
    /// The admin address asked (given, from the config, or the first
    /// running relay's), if any.
    admin: Option<String>,
    relay: Option<RelayStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    relay_error: Option<String>,
    /// Replication mode (from the config): the slot, who reads it, the WAL kept for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    replication: Option<SlotReport>,
}

/// The replication slot in [`StatusReport`].
#[derive(Debug, Serialize)]
struct SlotReport {
    slot: String,
    /// `None`: the slot does not exist.
    status: Option<crate::store::replication::SlotStatus>,
}

/// `switchyard status`.
///
/// # Errors
/// The database cannot be read. An unreachable relay is reported, not an error.
pub async fn status(database: Database, admin: Option<String>, json: bool) -> anyhow::Result<ExitCode> {
    let (store, config) = database.open().await?;
    let outbox = store.stats().await.context("cannot read the outbox")?;
    let replication = match (
        config.as_ref().and_then(Config::replication_feed),
        store.postgres(),
    ) {
        (Some(feed), Some(pg)) => Some(SlotReport {
            status: pg
                .slot_status(&feed.slot)
                .await
                .context("cannot read the replication slot")?,
            slot: feed.slot,
        }),
        // SQLite has claim mode alone.
        _ => None,
    };
    // Relays record where their admin endpoint listens (a port the system
    // chose, too); a relay silent for three refreshes is gone.
    let relays = store
        .running_relays(Duration::from_secs(30))
        .await
        .unwrap_or_default();
    // With several relays sharing databases out, the first that serves
    // this one answers.
    let name = config
        .as_ref()
        .filter(|c| c.serves_many())
        .and(database.database.as_deref());
    let mut candidates: Vec<String> = admin
        .or_else(|| {
            config
                .map(|c| c.admin.listen)
                .filter(|listen| !listen.is_empty() && !listen.ends_with(":0"))
        })
        .into_iter()
        .collect();
    if candidates.is_empty() {
        candidates.extend(relays.iter().filter_map(|r| r.admin_address.clone()));
    }
    let (mut admin, mut relay, mut relay_error) = (None, None, None);
    for addr in candidates {
        match crate::admin::fetch_status(&addr, name).await {
            Ok(status) => {
                (admin, relay, relay_error) = (Some(addr), Some(status), None);
                break;
            }
            Err(e) if admin.is_none() => (admin, relay_error) = (Some(addr), Some(format!("{e:#}"))),
            Err(_) => {}
        }
    }
    let report = StatusReport {
        database: store.kind(),
        outbox,
        relays,
        admin,
        relay,
        relay_error,
        replication,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", terminal_safe(&render_status(&report)));
    }
    Ok(ExitCode::SUCCESS)
}

/// The replication slot's lines of `status`.
fn render_slot(out: &mut String, slot: &SlotReport) {
    use std::fmt::Write as _;
    let _ = writeln!(out, "Replication slot {}", field(&slot.slot));
    match &slot.status {
        None => {
            let _ = writeln!(
                out,
                "  MISSING: run `switchyard migrate` (events written meanwhile were not read)"
            );
        }
        Some(status) => {
            let reader = match (&status.reader, status.active_pid) {
                (Some(name), _) => field(name).into_owned(),
                (None, Some(pid)) => format!("pid {pid}"),
                (None, None) => "nobody (no relay reads it: WAL accumulates)".to_string(),
            };
            let _ = writeln!(out, "  read by         {reader}");
            let retained = status.retained_wal_bytes.map_or_else(
                || "-".to_string(),
                |b| format!("{:.1} MiB", b as f64 / 1_048_576.0),
            );
            let _ = writeln!(
                out,
                "  retained WAL    {retained} (wal_status {})",
                status.wal_status.as_deref().unwrap_or("-")
            );
            let _ = writeln!(
                out,
                "  confirmed to    {}",
                status.confirmed_flush_lsn.as_deref().unwrap_or("-")
            );
        }
    }
}

/// The plugins' lines of `status`: version, last load, and for a registry
/// plugin its reference, digest and registry state.
fn render_plugins(out: &mut String, plugins: &[crate::admin::PluginStatus]) {
    use std::fmt::Write as _;
    for p in plugins {
        let version = p.version.as_deref().unwrap_or("(not loaded)");
        let last = &p.last_reload;
        let detail = match (&last.version, &last.reason) {
            (_, Some(reason)) => format!("{} {}: {reason}", last.result, last.at),
            (Some(v), None) => format!("{} {} at {}", last.result, v, last.at),
            (None, None) => format!("{} at {}", last.result, last.at),
        };
        let _ = writeln!(
            out,
            "    {:<20} {version:<14} last reload: {detail} (reloads {}, rejected {})",
            p.name, p.reloads, p.rejected
        );
        if let Some(registry) = &p.registry {
            let digest = registry.digest.as_deref().unwrap_or("(never pulled)");
            let cache = if registry.from_cache {
                ", from the cache"
            } else {
                ""
            };
            let state = registry
                .error
                .as_deref()
                .map_or_else(|| "registry ok".to_string(), |e| format!("registry: {e}"));
            let _ = writeln!(
                out,
                "    {:<20} {} {digest}{cache}; {state}",
                "", registry.reference
            );
        }
    }
}

fn render_status(report: &StatusReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let o = &report.outbox;
    let _ = writeln!(out, "Outbox ({})", report.database);
    let _ = writeln!(
        out,
        "  backlog         {} rows ({} pending, {} delayed, {} in flight)",
        o.backlog, o.pending, o.delayed, o.in_flight
    );
    let oldest = o
        .oldest_pending_age_seconds
        .map_or_else(|| "-".to_string(), |s| format!("{s:.1} s"));
    let _ = writeln!(out, "  oldest pending  {oldest}");
    let _ = writeln!(out, "  in retry        {}", o.retrying);
    let _ = writeln!(out, "  dead letters    {}", o.dead);
    for (event_type, n) in &o.dead_by_event_type {
        let _ = writeln!(out, "    {:<28} {n}", field(event_type));
    }
    if !o.waiting_on_targets.is_empty() {
        let _ = writeln!(out, "  waiting on a target (outage; no attempt spent)");
        for (target, n) in &o.waiting_on_targets {
            let _ = writeln!(out, "    {:<28} {n}", field(target));
        }
    }
    if let Some(slot) = &report.replication {
        render_slot(&mut out, slot);
    }
    if !report.relays.is_empty() {
        let _ = writeln!(out, "Relays running");
        for r in &report.relays {
            let admin = r.admin_address.as_deref().unwrap_or("no admin endpoint");
            let _ = writeln!(
                out,
                "  {:<28} {admin} (seen {:.0} s ago)",
                field(&r.instance_id),
                r.seen_seconds_ago
            );
        }
    }
    match (&report.admin, &report.relay, &report.relay_error) {
        (None, _, _) => {
            let _ = writeln!(out, "Relay: no admin address (give --admin HOST:PORT)");
        }
        (Some(addr), _, Some(error)) => {
            let _ = writeln!(out, "Relay at {addr}: not reachable ({error})");
        }
        (Some(addr), Some(relay), None) => {
            let ready = if relay.ready { "ready" } else { "NOT READY" };
            let _ = writeln!(out, "Relay at {addr} ({}): {ready}", relay.owner);
            let _ = writeln!(out, "  database        {}", relay.database);
            let _ = writeln!(out, "  plugins");
            render_plugins(&mut out, &relay.plugins);
            let _ = writeln!(out, "  targets");
            for t in &relay.targets {
                let health = t
                    .error
                    .as_deref()
                    .map_or_else(|| "ok".to_string(), |e| format!("error: {e}"));
                let _ = writeln!(out, "    {:<20} {:<8} {health}", t.name, t.kind);
                if let Some(paused) = &t.paused {
                    let waiting = paused
                        .waiting_rows
                        .map_or_else(|| "?".to_string(), |n| n.to_string());
                    let _ = writeln!(
                        out,
                        "      PAUSED since {} ({} s), {waiting} rows waiting: {}",
                        paused.since,
                        paused.seconds,
                        field(&paused.reason)
                    );
                }
            }
        }
        (Some(addr), None, None) => {
            let _ = writeln!(out, "Relay at {addr}: no answer");
        }
    }
    out
}

/// Runs `switchyard validate`: the config, then what can only be checked
/// live: each listed database (reachable and migrated), a `[source]`
/// mapping, replication mode's setup, the plugins' own `init`. `offline`
/// leaves out every check that needs the network.
///
/// # Errors
/// The first part that fails, or every database that does.
pub(super) async fn validate(path: &std::path::Path, offline: bool) -> anyhow::Result<()> {
    let loaded = Config::load(path)?;
    if offline {
        crate::tls::install_provider();
        return plugins_and_warnings(path, &loaded).await;
    }
    if loaded.serves_many() {
        let mut failed = Vec::new();
        for database in crate::fleet::catalog::all_databases(&loaded).await? {
            match check_database(&loaded.for_database(&database), true).await {
                Ok(()) => println!("database {}: ok", database.name),
                Err(error) => failed.push(format!("database {}: {error:#}", database.name)),
            }
        }
        anyhow::ensure!(
            failed.is_empty(),
            "{}: {} database(s) not ready:\n  - {}",
            path.display(),
            failed.len(),
            failed.join("\n  - ")
        );
    } else if loaded.source.is_some() || loaded.replication_feed().is_some() {
        check_database(&loaded, true)
            .await
            .with_context(|| path.display().to_string())?;
    } else if !loaded.database.endpoint().is_sqlite() {
        // Claim mode: the config holds without the database, but one set
        // up for replication mode would be served silently wrong.
        match OutboxStore::connect(loaded.database.endpoint(), 1).await {
            Ok(store) => {
                let checked = match schema_if_made(&store, false).await {
                    Ok(()) => crate::runtime::check_claim_mode(&store).await,
                    Err(error) => Err(error),
                };
                store.close().await;
                checked.with_context(|| path.display().to_string())?;
            }
            Err(error) => println!(
                "warning: cannot reach the database to check which mode it is set up for: {}",
                crate::redact::url(&error.to_string())
            ),
        }
    }
    let settings = loaded.sink_settings();
    crate::tls::install_provider();
    let mut target_problems = Vec::new();
    for (name, target) in &loaded.targets {
        match target.live_problems(name, &settings).await {
            Ok(problems) => {
                target_problems.extend(problems.into_iter().map(|p| format!("target {name:?}: {p}")))
            }
            Err(why) => println!("warning: target {name:?}: cannot check it now: {why}"),
        }
    }
    anyhow::ensure!(
        target_problems.is_empty(),
        "{}: {}",
        path.display(),
        target_problems.join("\n  ")
    );
    plugins_and_warnings(path, &loaded).await
}

/// The end of `validate`, online or not: the plugins start, and the
/// config's warnings are printed.
async fn plugins_and_warnings(path: &std::path::Path, loaded: &Config) -> anyhow::Result<()> {
    // A plugin may refuse its own config (a placeholder it does
    // not know): only its `init` can say.
    let plugins = crate::runtime::load_plugins(loaded)
        .await
        .with_context(|| format!("{}: the plugins do not start", path.display()))?;
    // A route to a target the config lacks dead-letters every event it
    // takes: say so now, not at the first event.
    let config = loaded.clone();
    let (problems, notes) =
        tokio::task::spawn_blocking(move || super::plugin::sample_routes(&config, &plugins))
            .await
            .context("routing the sample events panicked")?
            .with_context(|| format!("{}: the plugins do not start", path.display()))?;
    for note in notes {
        println!("note: {note}");
    }
    anyhow::ensure!(
        problems.is_empty(),
        "{}: {}",
        path.display(),
        problems.join("\n  ")
    );
    for warning in loaded.warnings() {
        println!("warning: {warning}");
    }
    println!("{}: ok", path.display());
    Ok(())
}

/// The schema's checks, once `migrate` has made it: before, a warning
/// alone, as the book runs `validate` first (the mapping against a live
/// table, the config against the brokers) and `migrate` after it.
async fn schema_if_made(store: &OutboxStore, replication: bool) -> anyhow::Result<()> {
    if store.schema_exists().await.context("cannot query the database")? {
        crate::runtime::check_schema(store, replication).await
    } else {
        println!(
            "warning: table switchyard_outbox does not exist yet: `switchyard migrate` makes it; \
             run validate again after it to check the relay's privileges on it"
        );
        Ok(())
    }
}

/// One database's live checks; `schema` also checks what `migrate` made.
async fn check_database(config: &Config, schema: bool) -> anyhow::Result<()> {
    let store = OutboxStore::connect(config.database.endpoint(), 2)
        .await
        .map_err(|e| anyhow::anyhow!(crate::redact::url(&e.to_string())))
        .context("cannot connect to the database")?;
    if schema {
        schema_if_made(&store, config.replication_feed().is_some()).await?;
    }
    if config.source.is_some()
        && let Some((_, Some(problem))) = crate::runtime::check_source(config, &store).await?
    {
        println!("warning: {problem}");
    }
    if config.replication_feed().is_none() {
        crate::runtime::check_claim_mode(&store).await?;
    }
    crate::runtime::check_replication(config, &store).await
}
