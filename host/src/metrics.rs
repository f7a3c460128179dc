//! Prometheus metrics: counters and histograms the relay updates per batch,
//! plus values read at scrape time (backlog, plugin reloads).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Metric names (the text format adds `_total` to counters).
pub mod names {
    /// Rows claimed, by the plugin that routed them (`none` when none matched).
    pub const EVENTS_CLAIMED: &str = "switchyard_events_claimed";
    /// Rows finished, by outcome (`published`, `retried`, `waiting`, `dead_lettered`, `dropped`) and plugin.
    pub const EVENTS: &str = "switchyard_events";
    /// Broker messages acknowledged, by target.
    pub const MESSAGES_PUBLISHED: &str = "switchyard_messages_published";
    /// Broker messages that failed, by target and kind (`unavailable`,
    /// `timed_out`, `unknown_topic`, `unauthorized`, `transient`, `refused`).
    pub const MESSAGES_FAILED: &str = "switchyard_messages_failed";
    /// 1 while a target is paused because it cannot be reached, else 0.
    pub const TARGET_PAUSED: &str = "switchyard_target_paused";
    /// Rows waiting for a paused target (set at scrape).
    pub const TARGET_WAITING_ROWS: &str = "switchyard_target_waiting_rows";
    /// Rows per claimed batch.
    pub const BATCH_SIZE: &str = "switchyard_batch_size";
    /// From the row's commit (`created_at`) to the ack of its last delivery.
    pub const COMMIT_TO_PUBLISH: &str = "switchyard_commit_to_publish_seconds";
    /// Plugin time per event: a `route` call, or an event's share of a `route-batch` call.
    pub const PLUGIN_CALL: &str = "switchyard_plugin_call_seconds";
    /// Rows pending or in flight.
    pub const BACKLOG: &str = "switchyard_backlog_rows";
    /// Age of the oldest unfinished row.
    pub const OLDEST_PENDING_AGE: &str = "switchyard_oldest_pending_age_seconds";
    /// Plugin versions that went live after a file change.
    pub const PLUGIN_RELOADS: &str = "switchyard_plugin_reloads";
    /// Plugin files refused on reload.
    pub const PLUGIN_RELOADS_REJECTED: &str = "switchyard_plugin_reloads_rejected";
    /// A registry plugin's reference and the digest serving it (value 1).
    pub const PLUGIN_SOURCE: &str = "switchyard_plugin_source_info";
    /// Whether a registry plugin's registry answered its last request (1) or not (0).
    pub const PLUGIN_REGISTRY_UP: &str = "switchyard_plugin_registry_up";
    /// Published rows removed by retention, by mode (`delete` or `archive`).
    pub const RETENTION_ROWS: &str = "switchyard_retention_rows";
    /// Batches that panicked.
    pub const WORKER_PANICS: &str = "switchyard_worker_panics";
    /// Claim statements run, those that found nothing included.
    pub const CLAIMS: &str = "switchyard_claims";
    /// Replication mode: WAL the server keeps for the slot (set at scrape).
    pub const REPLICATION_RETAINED_WAL: &str = "switchyard_replication_retained_wal_bytes";
    /// Replication mode: 1 while this relay reads the slot, 0 on a standby.
    pub const REPLICATION_READING: &str = "switchyard_replication_reading";
    /// Replication mode: events the slot was held before because they were
    /// neither published nor in the table when it would have passed them.
    pub const REPLICATION_HELD_EVENTS: &str = "switchyard_replication_held_events";
    /// 1 while the database is served, 0 while the relay cannot serve it
    /// (unreachable, not migrated, set up for the other mode).
    pub const DATABASE_SERVED: &str = "switchyard_database_served";
    /// 1 while a LISTEN session hears the outbox's commits, 0 while the
    /// poll alone finds new rows (a lost session, SQLite, no room for it).
    pub const LISTENING: &str = "switchyard_listening";
    /// LISTEN sessions that started hearing commits: more than one means
    /// the session was lost and replaced.
    pub const LISTEN_SESSIONS: &str = "switchyard_listen_sessions";
    /// With `[catalog]`: 1 while its last read worked, 0 while it fails
    /// (the databases it listed last are served meanwhile).
    pub const CATALOG_UP: &str = "switchyard_catalog_up";
    /// Replication mode: `replication.max_retained_wal_bytes`, for alerts
    /// on the retained WAL nearing it.
    pub const REPLICATION_MAX_RETAINED_WAL: &str = "switchyard_replication_max_retained_wal_bytes";
}

/// `database` label: the outbox database a figure is about (`default`
/// with a single `[database]`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DatabaseLabel {
    /// Database name from the config.
    pub database: String,
}

/// `database` and `mode` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    /// Database name.
    pub database: String,
    /// `delete` or `archive`.
    pub mode: &'static str,
}

/// `database` and `plugin` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    /// Database name.
    pub database: String,
    /// Plugin name from the config, or `none`.
    pub plugin: String,
}

/// `plugin` label, for what all databases share (plugin reloads).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabel {
    /// Plugin name from the config.
    pub plugin: String,
}

/// `database`, `outcome` and `plugin` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// Database name.
    pub database: String,
    /// `published`, `retried`, `dead_lettered` or `dropped`.
    pub outcome: &'static str,
    /// Plugin name, or `none`.
    pub plugin: String,
}

/// `database` and `target` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabels {
    /// Database name.
    pub database: String,
    /// Target name from the config.
    pub target: String,
}

/// `database`, `target` and `error` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// Database name.
    pub database: String,
    /// Target name.
    pub target: String,
    /// The failure's kind (a sink's `FailureKind::as_str`).
    pub error: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~16 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

fn call_histogram() -> Histogram {
    // 5 µs .. ~160 ms.
    Histogram::new(exponential_buckets(0.000_005, 2.0, 16))
}

fn batch_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 12))
}

/// Every metric family, shared by the databases of one relay process.
struct Families {
    claimed: Family<PluginLabels, Counter>,
    events: Family<OutcomeLabels, Counter>,
    published: Family<TargetLabels, Counter>,
    failed: Family<FailureLabels, Counter>,
    batch_size: HistogramFamily<DatabaseLabel>,
    commit_to_publish: HistogramFamily<DatabaseLabel>,
    plugin_call: HistogramFamily<PluginLabels>,
    backlog: Family<DatabaseLabel, Gauge>,
    retention: Family<ModeLabels, Counter>,
    oldest_pending_age: Family<DatabaseLabel, Gauge<f64, AtomicU64>>,
    worker_panics: Family<DatabaseLabel, Counter>,
    claims: Family<DatabaseLabel, Counter>,
    target_paused: Family<TargetLabels, Gauge>,
    target_waiting_rows: Family<TargetLabels, Gauge>,
    replication_retained_wal: Family<DatabaseLabel, Gauge>,
    replication_reading: Family<DatabaseLabel, Gauge>,
    replication_held_events: Family<DatabaseLabel, Counter>,
    database_served: Family<DatabaseLabel, Gauge>,
    replication_max_retained_wal: Family<DatabaseLabel, Gauge>,
    listening: Family<DatabaseLabel, Gauge>,
    listen_sessions: Family<DatabaseLabel, Counter>,
    // Keyed by no label: a series only once a catalog was read.
    catalog_up: Family<Vec<(String, String)>, Gauge>,
    /// What the console's charts sample, per database.
    recent: std::sync::Mutex<rustc_hash::FxHashMap<String, Arc<Recent>>>,
}

impl Families {
    fn new() -> Families {
        Families {
            claimed: Family::default(),
            events: Family::default(),
            published: Family::default(),
            failed: Family::default(),
            batch_size: Family::new_with_constructor(batch_histogram),
            commit_to_publish: Family::new_with_constructor(latency_histogram),
            plugin_call: Family::new_with_constructor(call_histogram),
            backlog: Family::default(),
            oldest_pending_age: Family::default(),
            retention: Family::default(),
            worker_panics: Family::default(),
            claims: Family::default(),
            target_paused: Family::default(),
            target_waiting_rows: Family::default(),
            replication_retained_wal: Family::default(),
            replication_reading: Family::default(),
            replication_held_events: Family::default(),
            database_served: Family::default(),
            replication_max_retained_wal: Family::default(),
            listening: Family::default(),
            listen_sessions: Family::default(),
            catalog_up: Family::default(),
            recent: std::sync::Mutex::default(),
        }
    }

    fn register(&self, registry: &mut Named<'_>) {
        use names::*;
        let f = self;
        registry.register(
            EVENTS_CLAIMED,
            "Rows claimed, by routing plugin",
            f.claimed.clone(),
        );
        registry.register(EVENTS, "Rows finished, by outcome and plugin", f.events.clone());
        registry.register(
            MESSAGES_PUBLISHED,
            "Broker messages acknowledged, by target",
            f.published.clone(),
        );
        registry.register(
            MESSAGES_FAILED,
            "Broker messages failed, by target and error kind",
            f.failed.clone(),
        );
        registry.register(BATCH_SIZE, "Rows per claimed batch", f.batch_size.clone());
        registry.register(
            COMMIT_TO_PUBLISH,
            "Time from the outbox row's commit to the ack of its last delivery",
            f.commit_to_publish.clone(),
        );
        registry.register(
            PLUGIN_CALL,
            "Plugin time per event: one route call, or an equal share of a route-batch call",
            f.plugin_call.clone(),
        );
        registry.register(BACKLOG, "Outbox rows pending or in flight", f.backlog.clone());
        registry.register(
            OLDEST_PENDING_AGE,
            "Age of the oldest pending or in-flight row",
            f.oldest_pending_age.clone(),
        );
        registry.register(
            RETENTION_ROWS,
            "Published rows removed by retention, by mode",
            f.retention.clone(),
        );
        registry.register(
            WORKER_PANICS,
            "Batches that panicked; their rows are retried when the leases expire",
            f.worker_panics.clone(),
        );
        registry.register(
            CLAIMS,
            "Claim statements run, those that found nothing included: what an idle database costs",
            f.claims.clone(),
        );
        registry.register(
            TARGET_PAUSED,
            "1 while a target is paused because it cannot be reached",
            f.target_paused.clone(),
        );
        registry.register(
            TARGET_WAITING_ROWS,
            "Outbox rows waiting for a paused target to come back",
            f.target_waiting_rows.clone(),
        );
        registry.register(
            REPLICATION_RETAINED_WAL,
            "WAL the server keeps for the replication slot (replication mode)",
            f.replication_retained_wal.clone(),
        );
        registry.register(
            REPLICATION_READING,
            "1 while this relay reads the replication slot, 0 while it stands by",
            f.replication_reading.clone(),
        );
        registry.register(
            REPLICATION_HELD_EVENTS,
            "Events the replication slot was held before, neither published nor in the outbox table (a bug; \
             each is read again)",
            f.replication_held_events.clone(),
        );
        self.register_health(registry);
    }

    /// What says whether a database is served and heard, and the catalog read.
    fn register_health(&self, registry: &mut Named<'_>) {
        use names::*;
        let f = self;
        registry.register(
            DATABASE_SERVED,
            "1 while the database is served, 0 while the relay cannot serve it yet",
            f.database_served.clone(),
        );
        registry.register(
            REPLICATION_MAX_RETAINED_WAL,
            "replication.max_retained_wal_bytes: past it the relay reports not ready",
            f.replication_max_retained_wal.clone(),
        );
        registry.register(
            LISTENING,
            "1 while a LISTEN session hears commits, 0 while polling alone finds new rows",
            f.listening.clone(),
        );
        registry.register(
            LISTEN_SESSIONS,
            "LISTEN sessions that started hearing commits (more than one: one was replaced)",
            f.listen_sessions.clone(),
        );
        registry.register(
            CATALOG_UP,
            "1 while [catalog] was last read, 0 while not",
            f.catalog_up.clone(),
        );
    }
}

/// The name of the only database of a `[database]` config, in metrics
/// and readiness.
pub const DEFAULT_DATABASE: &str = "default";

/// One database's view of the relay's metrics: every figure it records
/// carries its `database` label. Cheap to clone; [`Metrics::for_database`]
/// gives another database's view of the same registry.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    families: Arc<Families>,
    described: Arc<[Described]>,
    database: String,
}

/// A metric as the reference lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    /// Its name (a counter is exported with `_total` after it).
    pub name: &'static str,
    /// `counter`, `gauge` or `histogram`.
    pub kind: String,
    /// Its help text.
    pub help: &'static str,
}

/// The plugin reload counters, read from the plugins at scrape time (by
/// the plugin module's collector).
pub(crate) const RELOAD_COUNTERS: [(&str, &str); 2] = [
    (
        names::PLUGIN_RELOADS,
        "Plugin versions that went live after a file change",
    ),
    (names::PLUGIN_RELOADS_REJECTED, "Plugin files refused on reload"),
];

/// The registry plugins' gauges, read from the plugins at scrape time.
pub(crate) const REGISTRY_GAUGES: [(&str, &str); 2] = [
    (
        names::PLUGIN_SOURCE,
        "A registry plugin's reference and the digest serving it (value 1)",
    ),
    (
        names::PLUGIN_REGISTRY_UP,
        "Whether a registry plugin's registry answered its last request",
    ),
];

/// `plugin`, `reference` and `digest` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SourceLabels {
    pub(crate) plugin: String,
    pub(crate) reference: String,
    pub(crate) digest: String,
}

/// The registry, noting each metric registered: what [`Metrics::described`] lists.
struct Named<'a> {
    registry: &'a mut Registry,
    described: Vec<Described>,
}

impl Named<'_> {
    fn register(
        &mut self,
        name: &'static str,
        help: &'static str,
        metric: impl prometheus_client::registry::Metric,
    ) {
        self.described.push(Described {
            name,
            kind: metric.metric_type().as_str().to_string(),
            help,
        });
        self.registry.register(name, help, metric);
    }
}

impl Metrics {
    /// Registers every metric, for the database [`DEFAULT_DATABASE`];
    /// `scraped` reads the figures a part keeps itself (the plugins' reload
    /// counts and registry states) at scrape time.
    pub fn new(scraped: Option<Box<dyn Collector>>) -> Metrics {
        let mut registry = Registry::default();
        let families = Families::new();
        let mut named = Named {
            registry: &mut registry,
            described: RELOAD_COUNTERS
                .iter()
                .map(|(name, help)| Described {
                    name,
                    kind: "counter".into(),
                    help,
                })
                .chain(REGISTRY_GAUGES.iter().map(|(name, help)| Described {
                    name,
                    kind: "gauge".into(),
                    help,
                }))
                .collect(),
        };
        families.register(&mut named);
        let described = named.described.into();
        if let Some(scraped) = scraped {
            registry.register_collector(scraped);
        }
        Metrics {
            registry: Arc::new(registry),
            families: Arc::new(families),
            described,
            database: DEFAULT_DATABASE.to_string(),
        }
    }

    /// Every metric: name (without the `_total` a counter is exported
    /// with), kind and help, in registration order.
    pub fn described(&self) -> &[Described] {
        &self.described
    }

    /// The same metrics, recorded for `database`.
    pub fn for_database(&self, database: &str) -> Metrics {
        Metrics {
            registry: self.registry.clone(),
            families: self.families.clone(),
            described: self.described.clone(),
            database: database.to_string(),
        }
    }

    /// The database this view records for.
    pub fn database(&self) -> &str {
        &self.database
    }

    fn label(&self) -> DatabaseLabel {
        DatabaseLabel {
            database: self.database.clone(),
        }
    }

    fn target(&self, target: &str) -> TargetLabels {
        TargetLabels {
            database: self.database.clone(),
            target: target.to_string(),
        }
    }

    /// The Prometheus text exposition of every metric, every database's.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Counts `count` finished rows with one outcome.
    pub fn event(&self, outcome: &'static str, plugin: &str, count: u64) {
        self.families
            .events
            .get_or_create(&OutcomeLabels {
                database: self.database.clone(),
                outcome,
                plugin: plugin.to_string(),
            })
            .inc_by(count);
    }

    /// Counts `count` rows claimed and routed by `plugin`.
    pub fn claimed(&self, plugin: &str, count: u64) {
        self.families
            .claimed
            .get_or_create(&PluginLabels {
                database: self.database.clone(),
                plugin: plugin.to_string(),
            })
            .inc_by(count);
    }

    /// Counts messages acknowledged by `target`.
    pub fn published(&self, target: &str, count: u64) {
        self.families
            .published
            .get_or_create(&self.target(target))
            .inc_by(count);
    }

    /// Counts a message `target` failed, by the failure's kind.
    pub fn failed(&self, target: &str, error: &'static str) {
        self.families
            .failed
            .get_or_create(&FailureLabels {
                database: self.database.clone(),
                target: target.to_string(),
                error,
            })
            .inc();
    }

    /// Records a claimed batch's size.
    pub fn batch_size(&self, rows: usize) {
        self.families
            .batch_size
            .get_or_create(&self.label())
            .observe(rows as f64);
    }

    /// The commit-to-publish histogram of this database.
    pub fn commit_to_publish(&self) -> Histogram {
        self.families
            .commit_to_publish
            .get_or_create(&self.label())
            .clone()
    }

    /// This database's running tally of published events and their
    /// commit-to-publish times, which the console samples for its charts.
    pub fn recent(&self) -> Arc<Recent> {
        let mut recent = self
            .families
            .recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        recent.entry(self.database.clone()).or_default().clone()
    }

    /// The plugin-time histogram of `plugin` in this database.
    pub fn plugin_call(&self, plugin: &str) -> Histogram {
        self.families
            .plugin_call
            .get_or_create(&PluginLabels {
                database: self.database.clone(),
                plugin: plugin.to_string(),
            })
            .clone()
    }

    /// Sets the backlog figures read at scrape time.
    pub fn set_backlog(&self, rows: i64, oldest_age_seconds: f64) {
        self.families.backlog.get_or_create(&self.label()).set(rows);
        self.families
            .oldest_pending_age
            .get_or_create(&self.label())
            .set(oldest_age_seconds);
    }

    /// Counts rows removed by retention.
    pub fn retention(&self, mode: &'static str, rows: u64) {
        self.families
            .retention
            .get_or_create(&ModeLabels {
                database: self.database.clone(),
                mode,
            })
            .inc_by(rows);
    }

    /// Counts a batch that panicked.
    pub fn worker_panic(&self) {
        self.families.worker_panics.get_or_create(&self.label()).inc();
    }

    /// Counts a claim statement.
    pub fn claim(&self) {
        self.families.claims.get_or_create(&self.label()).inc();
    }

    /// Marks `target` paused or running.
    pub fn set_target_paused(&self, target: &str, paused: bool) {
        self.families
            .target_paused
            .get_or_create(&self.target(target))
            .set(i64::from(paused));
    }

    /// Sets the rows waiting for `target` (read at scrape time).
    pub fn set_target_waiting_rows(&self, target: &str, rows: i64) {
        self.families
            .target_waiting_rows
            .get_or_create(&self.target(target))
            .set(rows);
    }

    /// Sets the WAL the server keeps for the slot (read at scrape time) and the configured limit.
    pub fn set_retained_wal(&self, bytes: i64, limit: u64) {
        self.families
            .replication_retained_wal
            .get_or_create(&self.label())
            .set(bytes);
        self.families
            .replication_max_retained_wal
            .get_or_create(&self.label())
            .set(i64::try_from(limit).unwrap_or(i64::MAX));
    }

    /// Records that a LISTEN session hears commits (`true`, counted) or
    /// was lost.
    pub fn set_listening(&self, listening: bool) {
        let label = self.label();
        if listening {
            self.families.listening.get_or_create(&label).set(1);
            self.families.listen_sessions.get_or_create(&label).inc();
        } else if let Some(gauge) = self.families.listening.get(&label) {
            // Not made again by a listener that ends after its database
            // left the fleet (and its figures /metrics).
            gauge.set(0);
        }
    }

    /// Whether a LISTEN session hears commits now.
    pub fn listening(&self) -> bool {
        self.families.listening.get_or_create(&self.label()).get() > 0
    }

    /// LISTEN sessions that started hearing commits so far.
    pub fn listen_sessions(&self) -> u64 {
        self.families.listen_sessions.get_or_create(&self.label()).get()
    }

    /// Claim statements run so far.
    pub fn claims(&self) -> u64 {
        self.families.claims.get_or_create(&self.label()).get()
    }

    /// Records whether this relay reads the slot.
    pub fn set_replication_reading(&self, reading: bool) {
        self.families
            .replication_reading
            .get_or_create(&self.label())
            .set(i64::from(reading));
    }

    /// Counts events the slot was held before (see
    /// [`names::REPLICATION_HELD_EVENTS`]).
    pub fn replication_held(&self, events: u64) {
        self.families
            .replication_held_events
            .get_or_create(&self.label())
            .inc_by(events);
    }

    /// Records whether the database is served.
    pub fn set_database_served(&self, served: bool) {
        self.families
            .database_served
            .get_or_create(&self.label())
            .set(i64::from(served));
    }

    /// Whether the catalog's last read worked.
    pub fn set_catalog_up(&self, up: bool) {
        self.families
            .catalog_up
            .get_or_create(&Vec::new())
            .set(i64::from(up));
    }

    /// Whether this relay reads the slot.
    pub fn replication_reading(&self) -> bool {
        self.families
            .replication_reading
            .get_or_create(&self.label())
            .get()
            == 1
    }

    /// Removes every figure of this database (it left the relay), so the
    /// scrape does not keep reporting its last values. `plugins`,
    /// `targets` and `failures` (the kinds of failure) are the names its
    /// figures may carry.
    pub fn forget_database(&self, plugins: &[String], targets: &[String], failures: &[&'static str]) {
        const OUTCOMES: [&str; 5] = ["published", "retried", "waiting", "dead_lettered", "dropped"];
        let f = &self.families;
        f.recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.database);
        let database = || self.database.clone();
        for plugin in plugins.iter().map(String::as_str).chain(["none"]) {
            let labels = PluginLabels {
                database: database(),
                plugin: plugin.to_string(),
            };
            f.claimed.remove(&labels);
            f.plugin_call.remove(&labels);
            for outcome in OUTCOMES {
                f.events.remove(&OutcomeLabels {
                    database: database(),
                    outcome,
                    plugin: plugin.to_string(),
                });
            }
        }
        for target in targets {
            let labels = self.target(target);
            f.published.remove(&labels);
            f.target_paused.remove(&labels);
            f.target_waiting_rows.remove(&labels);
            for &kind in failures {
                f.failed.remove(&FailureLabels {
                    database: database(),
                    target: target.clone(),
                    error: kind,
                });
            }
        }
        for mode in ["delete", "archive"] {
            f.retention.remove(&ModeLabels {
                database: database(),
                mode,
            });
        }
        let label = self.label();
        f.batch_size.remove(&label);
        f.commit_to_publish.remove(&label);
        f.backlog.remove(&label);
        f.oldest_pending_age.remove(&label);
        f.worker_panics.remove(&label);
        f.claims.remove(&label);
        f.replication_retained_wal.remove(&label);
        f.replication_reading.remove(&label);
        f.replication_held_events.remove(&label);
        f.database_served.remove(&label);
        f.replication_max_retained_wal.remove(&label);
        f.listening.remove(&label);
        f.listen_sessions.remove(&label);
    }
}

/// Bounds (seconds) of [`Recent`]'s latency buckets: those of the
/// commit-to-publish histogram, the last one open.
pub const RECENT_BOUNDS: [f64; 16] = {
    let mut bounds = [0.0005; 16];
    let mut i = 1;
    while i < 16 {
        bounds[i] = bounds[i - 1] * 2.0;
        i += 1;
    }
    bounds
};

/// A database's published events and their commit-to-publish times as
/// plain counters, which Prometheus' histogram does not let a reader see.
/// Read by differences between two samples.
#[derive(Debug, Default)]
pub struct Recent {
    published: AtomicU64,
    buckets: [AtomicU64; 17],
}

/// One reading of a [`Recent`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecentSample {
    /// Events published so far.
    pub published: u64,
    /// Events per latency bucket so far ([`RECENT_BOUNDS`], then above them).
    pub buckets: [u64; 17],
}

impl Recent {
    /// Counts `count` events published.
    pub fn published(&self, count: u64) {
        self.published
            .fetch_add(count, std::sync::atomic::Ordering::Relaxed);
    }

    /// Counts one commit-to-publish time.
    pub fn observe(&self, seconds: f64) {
        let bucket = RECENT_BOUNDS
            .iter()
            .position(|&bound| seconds <= bound)
            .unwrap_or(16);
        self.buckets[bucket].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The counts now.
    pub fn sample(&self) -> RecentSample {
        let load = |n: &AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
        RecentSample {
            published: load(&self.published),
            buckets: std::array::from_fn(|i| load(&self.buckets[i])),
        }
    }
}

impl RecentSample {
    /// The `q` quantile (0 to 1) of the times counted between `earlier`
    /// and this one, in seconds, interpolated within its bucket; `None`
    /// when nothing was.
    pub fn quantile_since(&self, earlier: &RecentSample, q: f64) -> Option<f64> {
        let counts: Vec<u64> = (0..17)
            .map(|i| self.buckets[i].saturating_sub(earlier.buckets[i]))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut seen = 0.0;
        for (i, &count) in counts.iter().enumerate() {
            let next = seen + count as f64;
            if count > 0 && next >= rank {
                let low = if i == 0 { 0.0 } else { RECENT_BOUNDS[i - 1] };
                // Above the last bound nothing says how far: its lower bound.
                let Some(&high) = RECENT_BOUNDS.get(i) else {
                    return Some(low);
                };
                return Some(low + (high - low) * ((rank - seen) / count as f64));
            }
            seen = next;
        }
        Some(RECENT_BOUNDS[15])
    }
}

#[cfg(test)]
mod recent_tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_times_between_two_samples() {
        let recent = Recent::default();
        for _ in 0..1000 {
            recent.observe(10.0);
        }
        let before = recent.sample();
        // 99 fast, 1 slow: p50 is fast, p99 is at the slow one's bucket edge.
        for _ in 0..99 {
            recent.observe(0.003);
        }
        recent.observe(2.0);
        recent.published(100);
        let after = recent.sample();
        assert_eq!(after.published - before.published, 100);
        let p50 = after.quantile_since(&before, 0.5).unwrap();
        assert!((0.002..=0.004).contains(&p50), "{p50}");
        let p99 = after.quantile_since(&before, 0.99).unwrap();
        assert!(p99 <= 0.004, "the 99th of 100 is still fast: {p99}");
        let max = after.quantile_since(&before, 1.0).unwrap();
        assert!((1.024..=2.048).contains(&max), "{max}");
        assert_eq!(after.quantile_since(&after, 0.5), None);
    }
}
