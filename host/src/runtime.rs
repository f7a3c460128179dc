//! Building a database's relay from a config, and what every database of
//! one process shares (plugins, targets, metrics, identity): used by the
//! single-database run and by the fleet alike, and by `validate`.

use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::plugin::watch::PluginWatcher;
use crate::plugin::{PluginEngine, Plugins, watch};
use crate::relay::{Relay, RelayBuilder};
use crate::sinks::Sinks;
use crate::store::OutboxStore;
use crate::store::replication::SourceTable;

/// Connects to the database and the targets, loads the plugins and builds a relay.
///
/// # Errors
/// Any startup failure, with which part failed: unreachable database or
/// target, missing migrations, plugins that do not load.
pub async fn build(config: &Config) -> anyhow::Result<Relay> {
    Ok(builder(config).await?.build())
}

/// [`build`], stopping short of the relay: for an embedder that gives it
/// more (a native router) before it exists.
///
/// # Errors
/// As [`build`].
pub async fn builder(config: &Config) -> anyhow::Result<RelayBuilder> {
    let mut shared = Shared::start(config).await?;
    let watcher = shared.watcher.take();
    Ok(
        database_builder(config, crate::metrics::DEFAULT_DATABASE, &shared)
            .await?
            .watcher(watcher),
    )
}

/// What every database of one relay process shares: the plugins (and
/// their hot reload), the targets, the metrics registry and the identity.
pub struct Shared {
    /// The plugins, loaded.
    pub plugins: Plugins,
    /// The targets, connected.
    pub sinks: Sinks,
    /// The registry every database records into, each with its label.
    pub metrics: Metrics,
    /// This process's lease owner name, the same in every database.
    pub owner: String,
    /// Hot reload (files watched, registry tags followed), alive as long as
    /// this value keeps it.
    pub watcher: Option<PluginWatcher>,
}

impl Shared {
    /// Loads the plugins, watches their files and connects the targets.
    ///
    /// # Errors
    /// Plugins that do not load, a plugin directory that cannot be
    /// watched, a target that cannot be reached.
    pub async fn start(config: &Config) -> anyhow::Result<Shared> {
        for warning in config.warnings() {
            tracing::warn!(%warning, "Config weakens a delivery guarantee.");
        }
        let owner = config
            .relay
            .instance_id
            .clone()
            .unwrap_or_else(crate::relay::default_owner);
        let plugins = load_plugins_waiting(config).await?;
        let watcher = if config.plugin_runtime.watch {
            let debounce = Duration::from_millis(config.plugin_runtime.reload_debounce_ms);
            Some(watch::watch(plugins.clone(), debounce).context("cannot watch the plugin directories")?)
        } else {
            None
        };
        // Registry plugins are followed by their tags whether or not files are watched.
        let follower = config
            .plugin_runtime
            .cache_dir()
            .map(|dir| crate::plugin::oci::follow(&plugins, &crate::plugin::oci::OciCache::new(&dir)));
        let watcher = PluginWatcher::with_follower(watcher, follower);
        let sinks = Sinks::connect(&config.targets, &config.sink_settings()).await?;
        let metrics = Metrics::new(Some(plugins.scraped()));
        Ok(Shared {
            plugins,
            sinks,
            metrics,
            owner,
            watcher,
        })
    }
}

/// A relay for the one database of `config` (narrowed with
/// [`Config::for_database`] when it lists several), named `database` in
/// metrics, from `shared` parts.
///
/// # Errors
/// The database cannot be reached, is not migrated, or its `[source]` or
/// replication setup is wrong.
pub async fn database_builder(
    config: &Config,
    database: &str,
    shared: &Shared,
) -> anyhow::Result<RelayBuilder> {
    let owner = shared.owner.clone();
    let mut relay_config = config.relay.clone();
    relay_config.instance_id = Some(owner.clone());
    let listens = listens(config);
    // LISTEN's session is not the pool's (see `wake_on_commits`).
    let pooled = config.database.max_connections.saturating_sub(u32::from(listens));
    let store = OutboxStore::connect_bounded(
        config.database.endpoint(),
        pooled,
        &format!("switchyard {owner}"),
        Some(config.relay.lease_duration() / 2),
    )
    .await
    .map_err(|e| anyhow::anyhow!(crate::redact::url(&e.to_string())))?
    .with_dead_letter_blocking(config.relay.dead_letter_blocks_aggregate)
    .with_published_rows(config.relay.published_rows)
    .with_max_payload_bytes(config.relay.max_payload_bytes)
    .keeping_sessions(kept_sessions(config, pooled));
    check_schema(&store, config.replication_feed().is_some()).await?;
    if config.replication_feed().is_none() {
        check_claim_mode(&store).await?;
    }
    let capture = match check_source(config, &store).await? {
        Some((_, Some(problem))) => anyhow::bail!(problem),
        Some((capture, None)) => Some(capture),
        None => None,
    };
    // In replication mode the table is read from the WAL: no trigger to watch.
    let (capture, source) = match config.replication_feed() {
        Some(_) => (None, capture.as_ref().map(SourceTable::new)),
        None => (capture, None),
    };
    // A WAL batch or a binary log batch is shared out to the lanes: each
    // lane's share is then about a claim's batch, and a broker gets
    // requests as large as in claim mode.
    let stream_batch = usize::try_from(
        config
            .relay
            .batch_size
            .saturating_mul(config.relay.concurrency.max(1)),
    )
    .unwrap_or(usize::MAX);
    let (replication, binlog) = match config.replication_feed() {
        Some(replication) => {
            check_replication(config, &store).await?;
            if store.binlog().is_some() {
                let binlog = crate::store::replication::BinlogSettings {
                    endpoint: config.database.endpoint(),
                    name: replication.slot,
                    batch_size: stream_batch,
                };
                (None, Some(binlog))
            } else {
                let slot = crate::store::replication::StreamSettings {
                    endpoint: config.database.endpoint(),
                    slot: replication.slot,
                    publication: replication.publication,
                    application_name: format!("switchyard {owner}"),
                    batch_size: stream_batch,
                    max_retained_wal_bytes: replication.max_retained_wal_bytes,
                    source,
                };
                (Some(slot), None)
            }
        }
        None => (None, None),
    };
    Ok(
        Relay::builder(store, shared.plugins.clone(), shared.sinks.clone(), relay_config)
            .metrics(shared.metrics.for_database(database))
            .listen(listens)
            .capture(capture)
            .replication(replication)
            .binlog(binlog),
    )
}

/// Whether a relay on `config` (its share of the connection budget, in a
/// fleet) listens for NOTIFY: when the budget has a connection beyond one
/// per worker. Without it the poll alone finds new rows.
pub(crate) fn listens(config: &Config) -> bool {
    config.database.max_connections > config.relay.concurrency
}

/// How many sessions a relay's claims and acks keep out of a pool of
/// `pooled`: one per worker, as long as one stays in it for metrics, sweeps
/// and the rest; fewer on a smaller budget, the others' workers then taking
/// theirs from the pool each time.
fn kept_sessions(config: &Config, pooled: u32) -> usize {
    let budget = pooled.saturating_sub(1);
    usize::try_from(config.relay.concurrency.min(budget)).unwrap_or(0)
}

/// Compiles every configured plugin (through the compiled cache) and runs
/// its `init` with its config: what the relay does at start, and what
/// `validate` checks.
///
/// # Errors
/// Every plugin that does not load, each saying why (a refused config too).
pub async fn load_plugins(config: &Config) -> anyhow::Result<Plugins> {
    let plugins = load_plugins_waiting(config).await?;
    let waiting: Vec<String> = plugins
        .slots()
        .iter()
        .filter(|slot| slot.current().is_none())
        .map(|slot| match slot.last_result().1 {
            crate::plugin::ReloadResult::Rejected { reason } => format!("{}: {reason}", slot.config().name),
            _ => slot.config().name.clone(),
        })
        .collect();
    anyhow::ensure!(
        waiting.is_empty(),
        "{} plugin(s) could not be pulled:\n  - {}",
        waiting.len(),
        waiting.join("\n  - ")
    );
    Ok(plugins)
}

/// Like [`load_plugins`], but a registry plugin that was never pulled and
/// cannot be now is loaded empty: the relay runs, not ready, and pulls it
/// as soon as the registry answers.
///
/// # Errors
/// As [`load_plugins`], but for such plugins.
pub async fn load_plugins_waiting(config: &Config) -> anyhow::Result<Plugins> {
    let cache_dir = config.plugin_runtime.cache_dir();
    let engine = PluginEngine::new(cache_dir.as_deref()).context("cannot start the WebAssembly engine")?;
    let fetched = crate::plugin::oci::fetch_all(&config.plugins, cache_dir.as_deref()).await;
    // Compiling and running `init` is blocking work: keep it off the runtime.
    let configs = config.plugins.clone();
    let loaded = tokio::task::spawn_blocking(move || Plugins::load_fetched(engine, &configs, fetched))
        .await
        .context("loading the plugins panicked")?;
    loaded.map_err(|errors| {
        let list: Vec<String> = errors.iter().map(ToString::to_string).collect();
        anyhow::anyhow!(
            "{} plugin(s) failed to load:\n  - {}",
            list.len(),
            list.join("\n  - ")
        )
    })
}

/// The account's privileges (each missing one named with its `GRANT`),
/// then the schema: made by `migrate`, of a generation this relay serves.
///
/// # Errors
/// What is missing, or the database's error.
pub async fn check_schema(store: &OutboxStore, replication: bool) -> anyhow::Result<()> {
    let missing = store
        .privilege_problems(replication)
        .await
        .context("cannot check the relay's privileges")?;
    anyhow::ensure!(
        missing.is_empty(),
        "the relay's database account lacks privileges it uses:\n  - {}",
        missing.join("\n  - ")
    );
    let exists = store.schema_exists().await.context("cannot query the database")?;
    anyhow::ensure!(
        exists,
        "table switchyard_outbox does not exist: run `switchyard migrate` first"
    );
    match store.generation().await {
        Ok(_) => Ok(()),
        Err(too_old @ crate::store::Error::SchemaTooOld { .. }) => Err(too_old.into()),
        Err(e) => Err(anyhow::Error::new(e).context("cannot query the database")),
    }
}

/// What the server lacks for the relay (MySQL and MariaDB: version,
/// binary log format, engine, columns); its warnings are logged.
async fn check_server(store: &OutboxStore) -> anyhow::Result<()> {
    let report = store
        .server_report()
        .await
        .context("cannot read the database server's settings")?;
    for warning in &report.warnings {
        tracing::warn!("{warning}");
    }
    anyhow::ensure!(report.problems.is_empty(), "{}", report.problems.join("\n  - "));
    Ok(())
}

/// In claim mode: the database is not set up for replication mode, whose
/// rows a claiming relay would never see.
///
/// # Errors
/// The mismatch, saying what to do, or the database's error.
pub async fn check_claim_mode(store: &OutboxStore) -> anyhow::Result<()> {
    check_server(store).await?;
    match store
        .mode_mismatch(false)
        .await
        .context("cannot read the outbox's relay mode")?
    {
        Some(problem) => anyhow::bail!(problem),
        None => Ok(()),
    }
}

/// How often a running relay says so in `switchyard_relays`.
const ANNOUNCE_EVERY: Duration = Duration::from_secs(10);

/// Keeps this relay's row in `switchyard_relays` (its admin address) fresh
/// until `shutdown`, then removes it. Best effort: a database that is down
/// or not yet migrated costs a warning, never the relay.
pub(crate) async fn announce(
    store: OutboxStore,
    owner: String,
    admin: Option<String>,
    shutdown: CancellationToken,
) {
    let mut warned = false;
    loop {
        match store.announce_relay(&owner, admin.as_deref()).await {
            Ok(()) => warned = false,
            Err(error) if !warned => {
                warned = true;
                tracing::warn!(%error, "Cannot record this relay in switchyard_relays; `status` may not find its admin endpoint.");
            }
            Err(_) => {}
        }
        tokio::select! {
            () = tokio::time::sleep(ANNOUNCE_EVERY) => {}
            () = shutdown.cancelled() => break,
        }
    }
    if let Err(error) = store.relay_stopped(&owner).await {
        tracing::debug!(%error, "Cannot remove this relay from switchyard_relays.");
    }
}

/// In replication mode: everything that keeps it from working (wal_level,
/// privilege, publication, slot), for `validate` and relay startup.
///
/// # Errors
/// Every problem found, each saying what to do, or the database's error.
pub async fn check_replication(config: &Config, store: &OutboxStore) -> anyhow::Result<()> {
    let Some(replication) = config.replication_feed() else {
        return Ok(());
    };
    if let Some(binlog) = store.binlog() {
        check_server(store).await?;
        return check_binlog(&binlog, &replication.slot).await;
    }
    // The configuration refuses replication mode on SQLite; a database
    // URL that says otherwise is the same mistake.
    let Some(pg) = store.postgres() else {
        anyhow::bail!(
            "relay.mode = \"replication\" needs PostgreSQL or MariaDB; SQLite is relayed by claiming"
        );
    };
    let source = match &config.source {
        Some(source) => Some(pg.check_source(source).await?),
        None => None,
    };
    let source = source.as_ref().map(SourceTable::new);
    let problems = pg
        .replication_problems(&replication.slot, &replication.publication, source.as_ref())
        .await
        .context("cannot check the replication setup")?;
    anyhow::ensure!(
        problems.is_empty(),
        "replication mode cannot start:\n  - {}",
        problems.join("\n  - ")
    );
    Ok(())
}

/// Binlog mode on MariaDB: the server's binary log settings, the account's
/// privilege, the recorded position and the outbox's mode.
async fn check_binlog(binlog: &crate::store::replication::BinlogOutbox, name: &str) -> anyhow::Result<()> {
    let (mut problems, warnings) = binlog
        .binlog_report(name)
        .await
        .context("cannot check the binlog setup")?;
    for warning in &warnings {
        tracing::warn!("{warning}");
    }
    if let Some(mismatch) = binlog
        .mode_mismatch(true)
        .await
        .context("cannot read the outbox's relay mode")?
    {
        problems.push(mismatch.to_string());
    }
    anyhow::ensure!(
        problems.is_empty(),
        "binlog mode cannot start:\n  - {}",
        problems.join("\n  - ")
    );
    Ok(())
}

/// With `[source]`: the mapping checked against the live table, and what
/// is wrong with the trigger installed from it (`None`: nothing). For
/// `validate` (a warning) and relay startup (an error).
///
/// # Errors
/// Every mismatch between the mapping and the table.
pub async fn check_source(
    config: &Config,
    store: &OutboxStore,
) -> anyhow::Result<Option<(crate::store::capture::Capture, Option<String>)>> {
    let Some(source) = &config.source else {
        return Ok(None);
    };
    let Some(pg) = store.postgres() else {
        anyhow::bail!("source: an existing table can be relayed from PostgreSQL only");
    };
    let capture = pg.check_source(source).await?;
    if config.replication_feed().is_some() {
        // Read from the WAL; `check_replication` checks that.
        return Ok(Some((capture, None)));
    }
    let problem = pg
        .capture_problem(&capture)
        .await
        .context("cannot read the source table's triggers")?;
    Ok(Some((capture, problem)))
}
