//! Prometheus metrics: counters and histograms the relay updates per batch,
//! plus values read at scrape time (backlog, plugin reloads).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::plugin::Plugins;

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
    /// Published rows removed by retention, by mode (`delete` or `archive`).
    pub const RETENTION_ROWS: &str = "switchyard_retention_rows";
    /// Batches that panicked.
    pub const WORKER_PANICS: &str = "switchyard_worker_panics";
    /// Replication mode: WAL the server keeps for the slot (set at scrape).
    pub const REPLICATION_RETAINED_WAL: &str = "switchyard_replication_retained_wal_bytes";
    /// Replication mode: 1 while this relay reads the slot, 0 on a standby.
    pub const REPLICATION_READING: &str = "switchyard_replication_reading";
}

/// `mode` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    /// `delete` or `archive`.
    pub mode: &'static str,
}

/// `plugin` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabel {
    /// Plugin name from the config, or `none`.
    pub plugin: String,
}

/// `outcome` and `plugin` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `published`, `retried`, `dead_lettered` or `dropped`.
    pub outcome: &'static str,
    /// Plugin name, or `none`.
    pub plugin: String,
}

/// `target` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabel {
    /// Target name from the config.
    pub target: String,
}

/// `target` and `error` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// Target name.
    pub target: String,
    /// The failure's kind (see [`crate::sinks::FailureKind::as_str`]).
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

/// The relay's metrics. Cheap to clone; every clone updates the same values.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// Rows claimed, by plugin.
    pub claimed: Family<PluginLabel, Counter>,
    /// Rows finished, by outcome and plugin.
    pub events: Family<OutcomeLabels, Counter>,
    /// Messages acknowledged, by target.
    pub published: Family<TargetLabel, Counter>,
    /// Messages failed, by target and kind.
    pub failed: Family<FailureLabels, Counter>,
    /// Rows per batch.
    pub batch_size: Histogram,
    /// Commit to publish, seconds.
    pub commit_to_publish: Histogram,
    /// Plugin call duration, by plugin.
    pub plugin_call: HistogramFamily<PluginLabel>,
    /// Backlog rows (set at scrape).
    pub backlog: Gauge,
    /// Rows removed by retention, by mode.
    pub retention: Family<ModeLabel, Counter>,
    /// Oldest unfinished row's age in seconds (set at scrape).
    pub oldest_pending_age: Gauge<f64, AtomicU64>,
    /// Batches that panicked (a bug: the rows' leases expire and they are retried).
    pub worker_panics: Counter,
    /// 1 while a target is paused, by target.
    pub target_paused: Family<TargetLabel, Gauge>,
    /// Rows waiting for a paused target, by target (set at scrape).
    pub target_waiting_rows: Family<TargetLabel, Gauge>,
    /// WAL retained for the replication slot (set at scrape).
    pub replication_retained_wal: Gauge,
    /// 1 while this relay reads the replication slot.
    pub replication_reading: Gauge,
}

impl Metrics {
    /// Registers every metric; plugin reload counts are read from `plugins` at scrape time.
    pub fn new(plugins: Option<Plugins>) -> Metrics {
        let mut registry = Registry::default();
        let metrics = Metrics {
            registry: Arc::new(Registry::default()),
            claimed: Family::default(),
            events: Family::default(),
            published: Family::default(),
            failed: Family::default(),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            commit_to_publish: latency_histogram(),
            plugin_call: Family::new_with_constructor(call_histogram),
            backlog: Gauge::default(),
            oldest_pending_age: Gauge::default(),
            retention: Family::default(),
            worker_panics: Counter::default(),
            target_paused: Family::default(),
            target_waiting_rows: Family::default(),
            replication_retained_wal: Gauge::default(),
            replication_reading: Gauge::default(),
        };
        use names::*;
        registry.register(
            EVENTS_CLAIMED,
            "Rows claimed, by routing plugin",
            metrics.claimed.clone(),
        );
        registry.register(
            EVENTS,
            "Rows finished, by outcome and plugin",
            metrics.events.clone(),
        );
        registry.register(
            MESSAGES_PUBLISHED,
            "Broker messages acknowledged, by target",
            metrics.published.clone(),
        );
        registry.register(
            MESSAGES_FAILED,
            "Broker messages failed, by target and error kind",
            metrics.failed.clone(),
        );
        registry.register(BATCH_SIZE, "Rows per claimed batch", metrics.batch_size.clone());
        registry.register(
            COMMIT_TO_PUBLISH,
            "Time from the outbox row's commit to the ack of its last delivery",
            metrics.commit_to_publish.clone(),
        );
        registry.register(
            PLUGIN_CALL,
            "Plugin time per event: one route call, or an equal share of a route-batch call",
            metrics.plugin_call.clone(),
        );
        registry.register(
            BACKLOG,
            "Outbox rows pending or in flight",
            metrics.backlog.clone(),
        );
        registry.register(
            OLDEST_PENDING_AGE,
            "Age of the oldest pending or in-flight row",
            metrics.oldest_pending_age.clone(),
        );
        registry.register(
            RETENTION_ROWS,
            "Published rows removed by retention, by mode",
            metrics.retention.clone(),
        );
        registry.register(
            WORKER_PANICS,
            "Batches that panicked; their rows are retried when the leases expire",
            metrics.worker_panics.clone(),
        );
        registry.register(
            TARGET_PAUSED,
            "1 while a target is paused because it cannot be reached",
            metrics.target_paused.clone(),
        );
        registry.register(
            TARGET_WAITING_ROWS,
            "Outbox rows waiting for a paused target to come back",
            metrics.target_waiting_rows.clone(),
        );
        registry.register(
            REPLICATION_RETAINED_WAL,
            "WAL the server keeps for the replication slot (replication mode)",
            metrics.replication_retained_wal.clone(),
        );
        registry.register(
            REPLICATION_READING,
            "1 while this relay reads the replication slot, 0 while it stands by",
            metrics.replication_reading.clone(),
        );
        if let Some(plugins) = plugins {
            registry.register_collector(Box::new(ReloadCollector { plugins }));
        }
        Metrics {
            registry: Arc::new(registry),
            ..metrics
        }
    }

    /// Marks `target` paused or running.
    pub fn set_target_paused(&self, target: &str, paused: bool) {
        self.target_paused
            .get_or_create(&TargetLabel {
                target: target.to_string(),
            })
            .set(i64::from(paused));
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Counts `count` finished rows with one outcome.
    pub fn event(&self, outcome: &'static str, plugin: &str, count: u64) {
        self.events
            .get_or_create(&OutcomeLabels {
                outcome,
                plugin: plugin.to_string(),
            })
            .inc_by(count);
    }
}

/// Reads the plugin slots' reload counters at scrape time.
struct ReloadCollector {
    plugins: Plugins,
}

impl std::fmt::Debug for ReloadCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReloadCollector")
    }
}

impl Collector for ReloadCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, read) in [
            (
                names::PLUGIN_RELOADS,
                "Plugin versions that went live after a file change",
                crate::plugin::PluginSlot::reloads as fn(&crate::plugin::PluginSlot) -> u64,
            ),
            (
                names::PLUGIN_RELOADS_REJECTED,
                "Plugin files refused on reload",
                crate::plugin::PluginSlot::rejected,
            ),
        ] {
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for slot in self.plugins.slots() {
                let counter = ConstCounter::new(read(slot));
                let labels = PluginLabel {
                    plugin: slot.config().name.clone(),
                };
                counter.encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
