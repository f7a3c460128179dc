//! Several outbox databases behind one relay process: a relay per database,
//! all sharing the plugins, the targets and the metrics registry, each
//! started, retried and stopped on its own so that one database that is
//! down, slow or full of poison rows holds back only itself.

pub mod admin;
mod budget;
pub mod catalog;
mod ownership;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::config::{Config, NamedDatabase};
use crate::relay::Relay;
use crate::runtime::Shared;

/// The longest pause between two tries to start serving a database that
/// cannot be reached (or is not migrated): short for a process of one
/// database, which is all down meanwhile, longer for a fleet, where a
/// hundred databases down must not mean a hundred connects a second.
const CONNECT_RETRY_MAX: Duration = Duration::from_secs(30);
const CONNECT_RETRY_MAX_ALONE: Duration = Duration::from_secs(5);

/// Where one database of the fleet stands.
#[derive(Clone)]
pub enum DatabaseState {
    /// Not served yet: the database cannot be reached or checked.
    Starting {
        /// Since when it has not been served.
        since: Instant,
        /// Tries so far.
        attempts: u32,
        /// Why the last try failed.
        last_error: Option<String>,
    },
    /// Its relay runs (claims may still fail while the database is down:
    /// readiness says so).
    Running(Relay),
    /// Another relay serves it (`[ownership]`), or nobody does yet.
    Standby {
        /// The relay holding it, if one does.
        owner: Option<String>,
    },
}

struct Member {
    /// What it was started from, to tell a changed entry from the same one.
    entry: NamedDatabase,
    state: Arc<Mutex<DatabaseState>>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

/// A relay process serving many databases. Cheap to clone.
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<FleetInner>,
}

struct FleetInner {
    config: Config,
    /// The config's single `[database]`: the fleet of one that every
    /// process of one database is, answering as a relay, not as a fleet.
    alone: bool,
    shared: Shared,
    members: Mutex<BTreeMap<String, Member>>,
    /// The last catalog read's outcome (`None` before the first, or
    /// without a catalog).
    catalog: Mutex<Option<Result<(), String>>>,
    /// With `[ownership]`: databases this relay holds.
    owned: std::sync::atomic::AtomicUsize,
    /// With `[ownership]`: relays running, as last counted in a database.
    relays: std::sync::atomic::AtomicU64,
    /// With `[ownership]`: when this relay last gave a database up.
    gave_up: Mutex<Option<Instant>>,
    /// `[connections] per_server`, shared out among the databases.
    budget: budget::Budget,
    /// Where the admin endpoint listens (for `switchyard_relays`).
    admin: Option<String>,
    shutdown: CancellationToken,
}

impl Fleet {
    /// Loads the shared parts and starts serving every database `config`
    /// lists. A database that cannot be reached does not stop the start:
    /// it is tried again in the background (readiness says so).
    ///
    /// # Errors
    /// A shared part fails: plugins that do not load, a target that cannot
    /// be reached.
    pub async fn start(config: Config, shutdown: CancellationToken) -> anyhow::Result<Fleet> {
        Fleet::start_announcing(config, None, shutdown).await
    }

    /// [`Fleet::start`], saying in each database's `switchyard_relays` row
    /// that the admin endpoint listens at `admin` (for `status`).
    ///
    /// # Errors
    /// As [`Fleet::start`].
    pub async fn start_announcing(
        config: Config,
        admin: Option<String>,
        shutdown: CancellationToken,
    ) -> anyhow::Result<Fleet> {
        let shared = Shared::start(&config).await?;
        let fleet = Fleet {
            inner: Arc::new(FleetInner {
                alone: !config.serves_many(),
                config: config.clone(),
                shared,
                members: Mutex::new(BTreeMap::new()),
                catalog: Mutex::new(None),
                owned: std::sync::atomic::AtomicUsize::new(0),
                relays: std::sync::atomic::AtomicU64::new(1),
                gave_up: Mutex::new(None),
                budget: budget::Budget::new(config.connections.as_ref().map(|c| c.per_server)),
                admin,
                shutdown,
            }),
        };
        fleet.add_all(config.database_list());
        if let Some(catalog) = config.catalog.clone() {
            tokio::spawn(follow_catalog(fleet.clone(), catalog).in_current_span());
        }
        Ok(fleet)
    }

    /// The last catalog read: `None` before the first or without a
    /// catalog, else whether it worked.
    pub fn catalog(&self) -> Option<Result<(), String>> {
        self.inner
            .catalog
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Starts serving `database` (replacing a database of that name that
    /// was started from other settings). Nothing happens for one already
    /// served as it is.
    pub fn add(&self, database: NamedDatabase) {
        self.add_all(vec![database]);
    }

    /// [`Fleet::add`] for several databases, their places in the connection
    /// budget taken together first: the first to start does not take the
    /// share of one that starts a moment later (and then give it back).
    pub fn add_all(&self, databases: Vec<NamedDatabase>) {
        let databases: Vec<NamedDatabase> = {
            let members = self.members();
            databases
                .into_iter()
                .filter(|database| {
                    members.get(&database.name).is_none_or(|member| {
                        member.entry.url != database.url
                            || member.entry.max_connections != database.max_connections
                    })
                })
                .collect()
        };
        let wants: Vec<Option<budget::Want>> = databases
            .iter()
            .map(|database| {
                self.inner
                    .config
                    .ownership
                    .is_none()
                    .then(|| self.inner.budget.want(&database.url))
            })
            .collect();
        for (database, want) in databases.into_iter().zip(wants) {
            self.add_one(database, want);
        }
    }

    fn add_one(&self, database: NamedDatabase, want: Option<budget::Want>) {
        let mut members = self.members();
        // Changed settings: the old relay stops in the background (its
        // leases are released) while the new one starts.
        if let Some(member) = members.get(&database.name) {
            member.stop.cancel();
        }
        let state = Arc::new(Mutex::new(DatabaseState::Starting {
            since: Instant::now(),
            attempts: 0,
            last_error: None,
        }));
        let stop = self.inner.shutdown.child_token();
        let span = tracing::info_span!("database", name = %database.name);
        let task = match &self.inner.config.ownership {
            Some(ownership) => tokio::spawn(
                ownership::follow(
                    self.clone(),
                    database.clone(),
                    state.clone(),
                    stop.clone(),
                    Duration::from_secs(ownership.lease_seconds),
                )
                .instrument(span),
            ),
            None => tokio::spawn(
                serve(self.clone(), database.clone(), state.clone(), stop.clone(), want).instrument(span),
            ),
        };
        members.insert(
            database.name.clone(),
            Member {
                entry: database,
                state,
                stop,
                task,
            },
        );
    }

    /// Stops serving the database `name`: its batches finish (or their
    /// leases are released) and its figures leave the metrics. False when
    /// it was not served.
    pub async fn remove(&self, name: &str) -> bool {
        let Some(member) = self.members().remove(name) else {
            return false;
        };
        member.stop.cancel();
        let _ = member.task.await;
        self.forget_metrics(name);
        tracing::info!(database = name, "Stopped serving the database.");
        true
    }

    fn forget_metrics(&self, name: &str) {
        let plugins: Vec<String> = self
            .plugins()
            .slots()
            .iter()
            .map(|slot| slot.config().name.clone())
            .collect();
        let targets: Vec<String> = self.sinks().names().map(str::to_string).collect();
        let failures = crate::sinks::FailureKind::ALL.map(crate::sinks::FailureKind::as_str);
        self.inner
            .shared
            .metrics
            .for_database(name)
            .forget_database(&plugins, &targets, &failures);
    }

    /// Every database served, by name, with where it stands.
    pub fn databases(&self) -> BTreeMap<String, DatabaseState> {
        self.members()
            .iter()
            .map(|(name, member)| {
                let state = member
                    .state
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                (name.clone(), state)
            })
            .collect()
    }

    /// The relay serving `name`, once it runs.
    pub fn relay(&self, name: &str) -> Option<Relay> {
        match self.databases().remove(name)? {
            DatabaseState::Running(relay) => Some(relay),
            DatabaseState::Starting { .. } | DatabaseState::Standby { .. } => None,
        }
    }

    /// Whether this is the fleet of one of a `[database]` config, whose
    /// endpoints answer as a single relay's.
    pub fn alone(&self) -> bool {
        self.inner.alone
    }

    /// Where the admin endpoint listens, as given at start.
    pub fn admin_address(&self) -> Option<String> {
        self.inner.admin.clone()
    }

    /// With `[ownership]`: how many databases this relay holds.
    pub fn owned(&self) -> usize {
        self.inner.owned.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// With `[ownership]`: the databases one relay should hold, all the
    /// known databases shared among the relays running.
    pub fn fair_share(&self) -> usize {
        let relays =
            usize::try_from(self.inner.relays.load(std::sync::atomic::Ordering::Relaxed)).unwrap_or(1);
        self.members().len().div_ceil(relays.max(1))
    }

    fn saw_relays(&self, relays: u64) {
        self.inner
            .relays
            .store(relays.max(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether this relay may give a database up now: at most one per
    /// `every`, so that shares move gradually.
    fn may_give_up(&self, every: Duration) -> bool {
        let mut last = self.inner.gave_up.lock().unwrap_or_else(PoisonError::into_inner);
        if last.is_some_and(|at| at.elapsed() < every) {
            return false;
        }
        *last = Some(Instant::now());
        true
    }

    /// The shared plugins.
    pub fn plugins(&self) -> &crate::plugin::Plugins {
        &self.inner.shared.plugins
    }

    /// The shared targets.
    pub fn sinks(&self) -> &crate::sinks::Sinks {
        &self.inner.shared.sinks
    }

    /// The shared metrics registry.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.inner.shared.metrics
    }

    /// This process's lease owner name.
    pub fn owner(&self) -> &str {
        &self.inner.shared.owner
    }

    /// Waits until shutdown has stopped every database.
    pub async fn stopped(&self) {
        self.inner.shutdown.cancelled().await;
        let members: Vec<Member> = std::mem::take(&mut *self.members()).into_values().collect();
        for member in members {
            let _ = member.task.await;
        }
    }

    fn members(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Member>> {
        self.inner.members.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Reads the catalog every `interval_seconds` until shutdown, serving the
/// databases it lists and no longer serving those it stopped listing
/// (`[[databases]]` entries stay whatever it says).
async fn follow_catalog(fleet: Fleet, catalog: crate::config::CatalogConfig) {
    let fixed: std::collections::BTreeSet<String> = fleet
        .inner
        .config
        .databases
        .iter()
        .map(|d| d.name.clone())
        .collect();
    let mut listed = std::collections::BTreeSet::new();
    let mut told = std::collections::BTreeSet::new();
    let mut failing = false;
    loop {
        match catalog::read(&catalog).await {
            Ok(mut listing) => {
                if failing {
                    tracing::info!("The catalog answers again.");
                    failing = false;
                }
                for name in &fixed {
                    if listing.databases.remove(name).is_some() {
                        listing.refused.push(format!(
                            "catalog row {name:?} is also under [[databases]], which wins"
                        ));
                    }
                }
                for problem in listing.refused {
                    if told.insert(problem.clone()) {
                        tracing::warn!(%problem, "A catalog row is not served.");
                    }
                }
                for gone in listed
                    .difference(&listing.databases.keys().cloned().collect())
                    .cloned()
                    .collect::<Vec<_>>()
                {
                    fleet.remove(&gone).await;
                    listed.remove(&gone);
                }
                let mut listing_now = Vec::new();
                for (name, database) in listing.databases {
                    if !listed.contains(&name) {
                        tracing::info!(database = %name, "The catalog lists a new database.");
                    }
                    listed.insert(name);
                    listing_now.push(database);
                }
                fleet.add_all(listing_now);
                fleet.metrics().set_catalog_up(true);
                *fleet.inner.catalog.lock().unwrap_or_else(PoisonError::into_inner) = Some(Ok(()));
            }
            Err(error) => {
                if !failing {
                    tracing::warn!(%error, "Cannot read the catalog; serving the databases it listed last.");
                    failing = true;
                }
                fleet.metrics().set_catalog_up(false);
                *fleet.inner.catalog.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(Err(format!("{error:#}")));
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(catalog.interval_seconds)) => {}
            () = fleet.inner.shutdown.cancelled() => return,
        }
    }
}

/// Sets a database's state, and the served gauge with it.
fn set_state(state: &Mutex<DatabaseState>, metrics: &crate::metrics::Metrics, next: DatabaseState) {
    metrics.set_database_served(matches!(next, DatabaseState::Running(_)));
    *state.lock().unwrap_or_else(PoisonError::into_inner) = next;
}

/// Serves one database until `stop`: builds its relay (trying again, with
/// a growing pause, while it cannot), runs it, and starts over if the relay
/// ends on its own, or smaller when the connection budget needs room.
async fn serve(
    fleet: Fleet,
    database: NamedDatabase,
    state: Arc<Mutex<DatabaseState>>,
    stop: CancellationToken,
    want: Option<budget::Want>,
) {
    let config = fleet.inner.config.for_database(&database);
    let want = want.unwrap_or_else(|| fleet.inner.budget.want(&database.url));
    let metrics = fleet.metrics().for_database(&database.name);
    let set = |next: DatabaseState| set_state(&state, &metrics, next);
    let mut attempts = 0_u32;
    let mut since = Instant::now();
    let most = if fleet.alone() {
        CONNECT_RETRY_MAX_ALONE
    } else {
        CONNECT_RETRY_MAX
    };
    let mut pause = crate::backoff::Backoff::new(Duration::from_millis(500), most);
    while !stop.is_cancelled() {
        attempts += 1;
        let round = stop.child_token();
        let error = match want.grant(database.max_connections, round.clone()) {
            Ok(grant) => {
                let sized = sized(&config, grant.connections);
                let built = tokio::select! {
                    built = build(&fleet, &sized, &database) => built,
                    () = stop.cancelled() => return,
                };
                match built {
                    Ok(builder) => {
                        let listen = crate::runtime::listens(&sized);
                        let relay = builder.build();
                        set(DatabaseState::Running(relay.clone()));
                        tracing::info!(
                            attempts,
                            connections = grant.connections,
                            listen,
                            "Serving the database."
                        );
                        let result = run_relay(&fleet, &relay, &sized, round.clone()).await;
                        relay.store().close().await;
                        drop(grant);
                        if stop.is_cancelled() {
                            return;
                        }
                        (attempts, since) = (0, Instant::now());
                        pause.reset();
                        if round.is_cancelled() {
                            tracing::info!(
                                "Starting over with fewer connections: another database needs room."
                            );
                            continue;
                        }
                        match result {
                            Ok(()) => "its relay stopped".to_string(),
                            Err(error) => error.to_string(),
                        }
                    }
                    Err(error) => crate::redact::url(&format!("{error:#}")),
                }
            }
            Err(error) => error,
        };
        // The first failure and then every tenth: a database down for hours
        // is one line per few minutes, not one per try.
        let wait = pause.next_pause();
        if attempts % 10 == 1 {
            tracing::warn!(attempts, error = %error, retry_in_ms = wait.as_millis() as u64, "Cannot serve the database; trying again.");
        }
        set(DatabaseState::Starting {
            since,
            attempts,
            last_error: Some(error),
        });
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// `config` for a relay granted `connections`: its pool holds them all,
/// one of them LISTENs when there are two or more, and the workers use
/// the rest.
fn sized(config: &Config, connections: u32) -> Config {
    let mut sized = config.clone();
    if connections < sized.database.max_connections {
        sized.database.max_connections = connections;
        sized.relay.concurrency = sized.relay.concurrency.min(connections.saturating_sub(1).max(1));
    }
    sized
}

/// One database's relay, migrated first when the catalog says so.
async fn build(
    fleet: &Fleet,
    config: &Config,
    database: &NamedDatabase,
) -> anyhow::Result<crate::relay::RelayBuilder> {
    let listed = !fleet
        .inner
        .config
        .databases
        .iter()
        .any(|d| d.name == database.name);
    if listed
        && fleet
            .inner
            .config
            .catalog
            .as_ref()
            .is_some_and(|catalog| catalog.migrate)
    {
        let store = crate::store::OutboxStore::connect(database.endpoint(), 2).await?;
        store.migrate().await?;
        store.close().await;
    }
    let builder = crate::runtime::database_builder(config, &database.name, &fleet.inner.shared).await?;
    // Plugins learn the database's name only where there are several.
    Ok(if fleet.alone() {
        builder
    } else {
        builder.database(&database.name)
    })
}

/// Runs one database's relay with what runs beside it in a single-database
/// process: its row in `switchyard_relays` and retention.
async fn run_relay(
    fleet: &Fleet,
    relay: &Relay,
    config: &Config,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    // With `[ownership]` the ownership follower says this relay runs here.
    let announcer = fleet.inner.config.ownership.is_none().then(|| {
        tokio::spawn(
            crate::runtime::announce(
                relay.store().clone(),
                relay.owner().to_string(),
                fleet.admin_address(),
                stop.clone(),
            )
            .in_current_span(),
        )
    });
    let retention = config.retention.clone().map(|retention| {
        tokio::spawn(
            crate::retention::run(
                relay.store().clone(),
                retention,
                relay.metrics().clone(),
                stop.clone(),
            )
            .in_current_span(),
        )
    });
    let result = relay.run(stop.clone()).await;
    if stop.is_cancelled() {
        // Shutdown or removal: the announcer takes this relay's row out.
        if let Some(announcer) = announcer {
            let _ = announcer.await;
        }
        if let Some(retention) = retention {
            let _ = retention.await;
        }
    } else {
        for task in announcer.into_iter().chain(retention) {
            task.abort();
        }
    }
    result
}
