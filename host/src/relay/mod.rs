//! The relay: one pipeline value ([`Relay`]) owns the stages every event
//! goes through, and its feeds bring the events to them.
//!
//! | stage | module | does |
//! |---|---|---|
//! | route | [`route`] | runs each row through its plugin (blocking thread) |
//! | plan | [`plan`] | groups messages by target, skips what was acknowledged |
//! | publish | [`publish`] | one call per target, all at once, bounded |
//! | settle | [`settle`] | each row's outcome and delivery state |
//!
//! | feed | module | brings |
//! |---|---|---|
//! | claim | [`claim_feed`] | batches leased from the outbox table; their outcomes acked, fenced by the lease |
//! | WAL | [`wal_feed`] | events read from a replication slot, in lanes; what is not published crosses the hand-over to the table, for the claim feed |
//!
//! [`retry`] holds the retry policy, [`outage`] the paused targets and
//! [`health`] what workers report for readiness.

mod builder;
pub use builder::RelayBuilder;
mod claim_feed;
mod health;
pub use health::RecentPanic;
mod outage;
mod plan;
mod publish;
mod retry;
mod route;
pub use route::router;
mod settle;
mod wal_feed;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

pub use outage::Paused;
pub use retry::{RetryPolicy, backoff};

use crate::config::RelayConfig;
use crate::metrics::Metrics;
use crate::plugin::{Event, Message, Plugins, Refusal};
use crate::relay::router::Limits;
use crate::sinks::{SinkError, Sinks};
use crate::store::change_stream::ChangeSource;
use crate::store::{self, OutboxRow, OutboxStore};
use health::WorkerHealth;
use retry::lease_spent;

/// Time kept in reserve at the end of a lease for recording the outcome.
const ACK_RESERVE: Duration = Duration::from_secs(1);

/// Everything a relay instance needs.
#[derive(Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

/// A router compiled into the host instead of a plugin: same input, same
/// output, no sandbox. For embedding the relay as a library, and for the
/// benchmark that prices the sandbox against it.
pub type NativeRouter = Arc<dyn Fn(&Event) -> Result<Vec<Message>, Refusal> + Send + Sync>;

/// Why a batch could not run to its end.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// The claim statement failed; nothing was claimed.
    #[error("claim failed: {0}")]
    Claim(#[source] store::Error),
}

/// Where a relay's events come from.
#[derive(Clone)]
pub enum Feed {
    /// Claimed from the outbox table.
    Claim {
        /// Whether a session LISTENs for commits (else the poll alone
        /// finds new rows).
        listen: bool,
    },
    /// Read from a replication slot; what is not published there is handed
    /// over to the table and claimed from it.
    Wal {
        /// The slot, and how to read it.
        slot: Box<crate::store::replication::StreamSettings>,
        /// Whether a session LISTENs for the acks that free parked rows.
        listen: bool,
    },
    /// Read from a MariaDB binary log, as from a slot (MySQL has no LISTEN:
    /// the claim path polls).
    Binlog {
        /// The position, and how to read it.
        settings: Box<crate::store::replication::BinlogSettings>,
    },
}

impl Feed {
    fn listens(&self) -> bool {
        match self {
            Feed::Claim { listen } | Feed::Wal { listen, .. } => *listen,
            Feed::Binlog { .. } => false,
        }
    }
}

struct Inner {
    health: WorkerHealth,
    /// Targets paused because they cannot be reached.
    outages: outage::Outages,
    /// Wakes idle workers: a commit (NOTIFY), a resumed target, rows
    /// handed over by the WAL feed.
    wake: Arc<tokio::sync::Notify>,
    /// Batches whose outcomes wait for the database to record them.
    held: claim_feed::HeldOutcomes,
    /// Spaces the claims wake-ups start.
    claim_gate: claim_feed::ClaimGate,
    /// Kept alive as long as the relay: hot reload.
    _watcher: Option<crate::plugin::watch::PluginWatcher>,
    /// Routes instead of the plugins when set.
    native_router: Option<NativeRouter>,
    /// The `[source]` capture trigger `/readyz` watches.
    capture: Option<crate::store::capture::Capture>,
    feed: Feed,
    store: OutboxStore,
    plugins: Plugins,
    sinks: Sinks,
    config: RelayConfig,
    retry: RetryPolicy,
    owner: String,
    limits: Limits,
    metrics: Metrics,
    /// The database's name for plugins, when the relay is one of several.
    database: Option<String>,
}

/// What one batch did, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows the claim set aside behind an unfinished event of their aggregate.
    pub parked: usize,
    /// Rows published (including dropped ones).
    pub published: usize,
    /// Rows the plugin deliberately dropped.
    pub dropped: usize,
    /// Rows scheduled for another attempt.
    pub retried: usize,
    /// Rows waiting, without spending an attempt, for a target to come
    /// back (or a topic to appear, or their plugin to return).
    pub waiting: usize,
    /// Rows dead-lettered.
    pub dead: usize,
    /// Rows whose lease was lost before the ack.
    pub lost: usize,
    /// Whether claiming again at once may find rows no wake-up announces
    /// (see [`Claim::look_again`]).
    pub look_again: bool,
}

impl Relay {
    /// Assembles a relay with nothing beyond its parts; see [`Relay::builder`].
    pub fn new(store: OutboxStore, plugins: Plugins, sinks: Sinks, config: RelayConfig) -> Relay {
        Relay::builder(store, plugins, sinks, config).build()
    }

    /// Starts assembling a relay: what it may also have (a plugin watcher,
    /// a native router, a capture trigger, a replication slot) is given to
    /// the builder, once, before the relay exists.
    pub fn builder(store: OutboxStore, plugins: Plugins, sinks: Sinks, config: RelayConfig) -> RelayBuilder {
        RelayBuilder {
            store,
            plugins,
            sinks,
            config,
            watcher: None,
            native_router: None,
            capture: None,
            replication: None,
            binlog: None,
            metrics: None,
            database: None,
            listen: true,
        }
    }

    /// The replication slot this relay reads, in replication mode.
    pub fn replication(&self) -> Option<&crate::store::replication::StreamSettings> {
        match &self.inner.feed {
            Feed::Wal { slot, .. } => Some(slot),
            Feed::Claim { .. } | Feed::Binlog { .. } => None,
        }
    }

    /// Whether this relay reads a change stream (a slot, a binary log):
    /// replication mode, on either server.
    pub fn reads_a_change_stream(&self) -> bool {
        !matches!(self.inner.feed, Feed::Claim { .. })
    }

    /// Relays until `shutdown` is cancelled: the claim feed, and in
    /// replication mode the WAL feed beside it. Then stops taking events,
    /// lets running batches finish within `shutdown_timeout_ms` and
    /// releases what is left.
    ///
    /// # Errors
    /// The slot cannot be read any more (dropped, invalidated), or the
    /// leases could not be released at the end; transient database and
    /// broker errors are retried inside.
    pub async fn run(&self, shutdown: CancellationToken) -> anyhow::Result<()> {
        self.wake_rows_waiting_on_targets().await;
        let claim = claim_feed::ClaimFeed::new(self.clone(), self.inner.feed.listens());
        match &self.inner.feed {
            Feed::Claim { .. } => claim.run(shutdown).await,
            Feed::Wal { slot, .. } => match self.inner.store.postgres() {
                Some(outbox) => {
                    let source = crate::store::replication::WalSource {
                        settings: slot.clone(),
                        outbox,
                    };
                    self.run_fed(claim, source, shutdown).await
                }
                // The configuration refuses replication mode on SQLite.
                None => anyhow::bail!(
                    "relay.mode = \"replication\" needs PostgreSQL or MariaDB; SQLite is relayed by claiming"
                ),
            },
            Feed::Binlog { settings } => match self.inner.store.binlog() {
                Some(outbox) => {
                    let source = crate::store::replication::BinlogSource {
                        settings: settings.as_ref().clone(),
                        outbox,
                    };
                    self.run_fed(claim, source, shutdown).await
                }
                None => anyhow::bail!("binlog mode needs MariaDB"),
            },
        }
    }

    /// The claim feed, and beside it the change stream read from `source`.
    async fn run_fed<S: ChangeSource>(
        &self,
        claim: claim_feed::ClaimFeed,
        source: S,
        shutdown: CancellationToken,
    ) -> anyhow::Result<()> {
        let wal = wal_feed::WalFeed::new(self.clone(), source);
        // A WAL feed that ends on its own (its slot is gone) stops the
        // claim feed too; its error is the relay's.
        let stop = shutdown.child_token();
        let reading = AbortOnDropHandle::new(tokio::spawn({
            let stop = stop.clone();
            async move {
                let read = wal.run(stop.clone()).await;
                if let Err(error) = &read {
                    tracing::error!(%error, "The replication feed stopped; the relay stops.");
                    stop.cancel();
                }
                read
            }
        }));
        let claimed = claim.run(stop).await;
        let read = reading
            .await
            .unwrap_or_else(|panic| Err(anyhow::anyhow!("the replication feed panicked: {panic}")));
        claimed.and(read)
    }

    /// Targets are up (the relay connected them): rows a relay left waiting
    /// on one that was down go now, not at their late recheck.
    async fn wake_rows_waiting_on_targets(&self) {
        match self.inner.store.wake_waiting(None).await {
            Ok(0) => {}
            Ok(woken) => info!(woken, "Rows waiting on targets that are up now are due."),
            Err(error) => {
                warn!(%error, "Could not wake rows waiting on targets; they are tried at their recheck.")
            }
        }
    }

    /// The capture trigger of `[source]`, if the relay has one.
    pub fn capture(&self) -> Option<&crate::store::capture::Capture> {
        self.inner.capture.as_ref()
    }

    /// The plugins this relay routes with (for status and tests).
    pub fn plugins(&self) -> &Plugins {
        &self.inner.plugins
    }

    /// This relay's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The outbox store.
    pub fn store(&self) -> &OutboxStore {
        &self.inner.store
    }

    /// The targets.
    pub fn sinks(&self) -> &Sinks {
        &self.inner.sinks
    }

    /// The lease owner name of this instance.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// Whether the workers are sound: `Err` with the latest panic while one
    /// happened within the last minute.
    ///
    /// # Errors
    /// The panic's age and message.
    pub fn workers_health(&self) -> Result<(), RecentPanic> {
        self.inner.health.check()
    }

    fn record_panic(&self, worker: u32, panic: &(dyn std::any::Any + Send)) {
        // Counted before readiness reports it: whoever sees /readyz turn
        // unready finds the panic in /metrics too.
        self.inner.metrics.worker_panic();
        let message = self.inner.health.panicked(panic);
        tracing::error!(
            worker,
            panic = %message,
            "A batch panicked; its rows are retried when their leases expire. This is a bug: please report it."
        );
    }

    /// Route, plan, publish and settle: what every feed's batch goes
    /// through, whatever records its outcomes. `deadline` bounds the work
    /// (a lease's end); `took` is what taking the batch already cost.
    async fn stages(&self, rows: Vec<OutboxRow>, deadline: Instant, took: Duration) -> settle::Settled<'_> {
        let inner = &self.inner;
        inner.metrics.batch_size(rows.len());
        let mut routed = self.route(rows, deadline, took).await;
        let reserved = inner.config.publish_timeout() + ACK_RESERVE;
        let may_publish = Instant::now() + reserved < deadline;
        if !may_publish {
            let lease = inner.config.lease_duration();
            plan::defer_if_the_claim_was_slow(&mut routed, &inner.retry, lease, took, reserved);
        }
        let not_sent = || {
            SinkError::retryable(lease_spent(
                took,
                inner.config.lease_duration(),
                reserved,
                "publishing",
            ))
        };
        let held_back = |target: &str| inner.outages.hold_back(target);
        let plan = plan::plan(&mut routed, may_publish, &not_sent, &held_back);
        let mut results = plan.results;
        self.publish(plan.sends, &mut results).await;
        let now = chrono::Utc::now();
        let plugin_of = |row: &OutboxRow| {
            inner
                .plugins
                .select(&row.aggregate_type, &row.event_type)
                .map_or("none", |slot| inner.plugins.slots()[slot].config().name.as_str())
        };
        let settled = settle::settle(routed, results, &inner.retry, now, &plugin_of);
        self.count(&settled);
        if let (rows, Some(error)) = &settled.unrouted {
            warn!(rows, %error, "Rows failed before publishing; they will be retried.");
        }
        if let Some(error) = &settled.first_dead {
            warn!(dead = settled.report.dead, %error, "Rows dead-lettered.");
        }
        debug!(
            batch.size = settled.outcomes.len(),
            published = settled.report.published,
            retried = settled.report.retried,
            dead = settled.report.dead,
            "Batch done."
        );
        settled
    }

    /// A settled batch's metrics, counted per batch: a labelled counter
    /// lookup per row costs more than the row's ack.
    fn count(&self, settled: &settle::Settled<'_>) {
        let metrics = &self.inner.metrics;
        let now_ms = chrono::Utc::now().timestamp_millis();
        let commit_to_publish = metrics.commit_to_publish();
        let recent = metrics.recent();
        for created_at_ms in &settled.published_created_at_ms {
            let seconds = (now_ms - created_at_ms).max(0) as f64 / 1000.0;
            commit_to_publish.observe(seconds);
            recent.observe(seconds);
        }
        recent.published(settled.published_created_at_ms.len() as u64);
        let mut claimed: BTreeMap<&str, u64> = BTreeMap::new();
        for (&(plugin, kind), &count) in &settled.tally {
            metrics.event(kind, plugin, count);
            *claimed.entry(plugin).or_default() += count;
        }
        for (plugin, count) in claimed {
            metrics.claimed(plugin, count);
        }
    }
}

/// A relay's identity when the config names none: host name, process id
/// and a random suffix, so that a restarted process is a new owner.
pub(crate) fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".to_string());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    format!("{host}-{}-{suffix}", std::process::id())
}
