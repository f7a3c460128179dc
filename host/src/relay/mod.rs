//! The relay: workers claim batches and take each through named stages,
//! a listener turns NOTIFY into wake-ups, a supervisor restarts workers.
//!
//! | stage | module | does |
//! |---|---|---|
//! | claim | [`crate::store`] | leases the heads of aggregates |
//! | route | [`route`] | runs each row through its plugin (blocking thread) |
//! | plan | [`plan`] | groups messages by target, skips what was acknowledged |
//! | publish | [`publish`] | one call per target, all at once, bounded |
//! | settle | [`settle`] | each row's outcome and delivery state |
//! | ack | [`crate::store`] | records the outcomes, fenced by the lease |
//!
//! [`workers`] runs and supervises the workers, [`retry`] holds the retry
//! policy, [`listen`] the LISTEN loop and [`health`] what workers report
//! for readiness.

mod builder;
pub use builder::RelayBuilder;
mod health;
pub use health::RecentPanic;
mod outage;
mod plan;
mod publish;
mod replicate;
mod retry;
mod route;
pub use route::router;
mod settle;
mod workers;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tracing::{debug, info, warn};

pub use outage::Paused;
pub use retry::{RetryPolicy, backoff};

use crate::config::RelayConfig;
use crate::metrics::Metrics;
use crate::plugin::{Event, Message, Plugins, Refusal};
use crate::relay::router::Limits;
use crate::sinks::{SinkError, Sinks};
use crate::store::{self, Claim, OutboxRow, OutboxStore};
use health::WorkerHealth;
use retry::lease_spent;

/// A claim statement slower than this is logged with its duration.
const SLOW_CLAIM: Duration = Duration::from_secs(1);

/// Time kept in reserve at the end of a lease for recording the outcome.
const ACK_RESERVE: Duration = Duration::from_secs(1);

/// The longest pause between two tries to record a batch's outcomes while
/// the database cannot take them.
const ACK_RETRY_MAX: Duration = Duration::from_secs(1);

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

struct Inner {
    health: WorkerHealth,
    /// Targets paused because they cannot be reached.
    outages: outage::Outages,
    /// Wakes idle workers: a commit (NOTIFY), a resumed target.
    wake: Arc<tokio::sync::Notify>,
    /// Batches whose outcomes wait for the database to record them; no
    /// worker claims meanwhile (a claim could take their expired leases).
    acks_pending: std::sync::atomic::AtomicUsize,
    /// When the oldest of those began waiting.
    acks_waiting_since: std::sync::Mutex<Option<Instant>>,
    /// Kept alive as long as the relay: hot reload.
    _watcher: Option<crate::plugin::watch::PluginWatcher>,
    /// Routes instead of the plugins when set.
    native_router: Option<NativeRouter>,
    /// The `[source]` capture trigger `/readyz` watches.
    capture: Option<crate::store::capture::Capture>,
    /// In replication mode, the slot events are read from.
    replication: Option<crate::store::replication::StreamSettings>,
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
    /// Whether a session LISTENs for commits (else the poll alone finds rows).
    listen: bool,
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
            metrics: None,
            database: None,
            listen: true,
        }
    }

    /// The replication slot this relay reads, in replication mode.
    pub fn replication(&self) -> Option<&crate::store::replication::StreamSettings> {
        self.inner.replication.as_ref()
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

    /// A slow claim is usually a plan made on statistics taken while the
    /// outbox was empty, its normal state: refresh them (at most once a
    /// minute) so the next claim is planned on the backlog that is there now.
    fn claim_was_slow(&self) {
        if !self.inner.health.analyze_due() {
            return;
        }
        let store = self.inner.store.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            match store.refresh_statistics().await {
                Ok(()) => warn!(
                    analyze_ms = started.elapsed().as_millis() as u64,
                    "Claims were slow; refreshed the outbox table's statistics (ANALYZE)."
                ),
                Err(error) => {
                    warn!(%error, "Claims were slow; refreshing the outbox table's statistics failed.")
                }
            }
        });
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

    /// Claims and processes one batch. Outcomes the database cannot take
    /// are held (and tried again) until it can.
    ///
    /// # Errors
    /// A database error while claiming; nothing was claimed.
    pub async fn run_once(&self) -> Result<BatchReport, BatchError> {
        let inner = &self.inner;
        // A claim now could take the leases of rows whose outcomes are on
        // their way: they would go round again, their attempt spent.
        while self.acks_pending() {
            tokio::time::sleep(ACK_RETRY_MAX / 4).await;
        }
        let claim = inner
            .store
            .claim(
                &inner.owner,
                inner.config.batch_size,
                inner.config.lease_duration(),
            )
            .await;
        inner.metrics.claim();
        let claim = match claim {
            Err(error @ store::Error::ClaimTimedOut { .. }) => {
                self.claim_was_slow();
                return Err(BatchError::Claim(error));
            }
            claim => claim.map_err(BatchError::Claim)?,
        };
        if claim.took >= SLOW_CLAIM {
            warn!(
                claim_ms = claim.took.as_millis() as u64,
                statement_ms = claim.statement.map(|s| s.as_millis() as u64),
                rows = claim.rows.len(),
                lease_ms = inner.config.lease_duration_ms,
                "Claim statement was slow."
            );
            self.claim_was_slow();
        }
        if claim.rows.is_empty() {
            return Ok(BatchReport {
                parked: claim.parked,
                look_again: claim.look_again,
                ..BatchReport::default()
            });
        }
        // A panic past this point would leave the rows to their leases,
        // and rows that keep panicking to be dead-lettered as "lease
        // expired": record the panic as their outcome, then let it go on
        // to the worker, which reports it.
        let lease = claim.lease;
        let claimed: Vec<_> = claim
            .rows
            .iter()
            .map(|row| (row.id, row.attempts, row.deliveries.clone()))
            .collect();
        match std::panic::AssertUnwindSafe(self.process(claim))
            .catch_unwind()
            .await
        {
            Ok(report) => report,
            Err(panic) => {
                let error = format!(
                    "the relay panicked processing this row's batch: {}",
                    health::panic_message(panic.as_ref())
                );
                let outcomes: Vec<store::RowOutcome> = claimed
                    .into_iter()
                    .map(|(id, attempts, deliveries)| store::RowOutcome {
                        id,
                        outcome: inner
                            .retry
                            .after_failure(u32::try_from(attempts).unwrap_or(u32::MAX), error.clone()),
                        deliveries,
                        plugin_version: None,
                    })
                    .collect();
                self.record(lease, &outcomes).await;
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// The stages after the claim: route, plan, publish, settle, ack.
    async fn process(&self, claim: Claim) -> Result<BatchReport, BatchError> {
        let claimed = claim.rows.len();
        let (parked, look_again) = (claim.parked, claim.look_again);
        let lease = claim.lease;
        let settled = self.stages(claim.rows, claim.deadline, claim.took).await;
        let acked = self.record(lease, &settled.outcomes).await;
        let report = BatchReport {
            claimed,
            parked,
            look_again,
            lost: settled.outcomes.len() - acked.len(),
            ..settled.report
        };
        if report.lost > 0 {
            warn!(
                lost = report.lost,
                "Leases expired before the ack; those rows will be delivered again."
            );
        }
        Ok(report)
    }

    /// Route, plan, publish and settle: what every feed's batch goes
    /// through, whatever records its outcomes. `deadline` bounds the work
    /// (a lease's end); `took` is what taking the batch already cost.
    async fn stages(&self, rows: Vec<OutboxRow>, deadline: Instant, took: Duration) -> settle::Settled<'_> {
        let inner = &self.inner;
        inner.metrics.batch_size(rows.len());
        let mut routed = self.route(rows, deadline, took).await;
        let may_publish = Instant::now() + inner.config.publish_timeout() + ACK_RESERVE < deadline;
        let not_sent =
            || SinkError::retryable(lease_spent(took, inner.config.lease_duration(), "publishing"));
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

    /// Records a batch's outcomes, trying again for as long as the
    /// database cannot take them (a restart, a failover, a network cut):
    /// an outage is nobody's attempt, and outcomes dropped here would send
    /// the rows round again with an attempt spent. Late is safe: the lease
    /// fences the ack, so rows another relay took meanwhile are left alone.
    async fn record(&self, lease: store::LeaseId, outcomes: &[store::RowOutcome]) -> Vec<store::RowId> {
        let inner = &self.inner;
        let pause = crate::backoff::Backoff::new(Duration::from_millis(100), ACK_RETRY_MAX);
        let (acked, waited) = crate::backoff::until_ok(
            pause,
            || inner.store.ack(lease, outcomes),
            |error, failures| {
                if failures > 1 {
                    debug!(%error, "Recording outcomes failed again.");
                    return;
                }
                let mut waiting_since = inner
                    .acks_waiting_since
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                inner.acks_pending.fetch_add(1, Ordering::AcqRel);
                waiting_since.get_or_insert_with(Instant::now);
                drop(waiting_since);
                warn!(
                    %error,
                    rows = outcomes.len(),
                    "Cannot record the batch's outcomes; holding them until the database takes them. No batch is claimed meanwhile."
                );
            },
        )
        .await;
        if let Some(waited) = waited {
            // The last batch held clears the time: another may still wait.
            let mut waiting_since = inner
                .acks_waiting_since
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if inner.acks_pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                *waiting_since = None;
            }
            drop(waiting_since);
            info!(
                rows = outcomes.len(),
                waited_ms = waited.as_millis() as u64,
                "The database took the batch's outcomes."
            );
        }
        acked
    }

    /// Whether a batch's outcomes are waiting for the database.
    fn acks_pending(&self) -> bool {
        self.inner.acks_pending.load(Ordering::Acquire) > 0
    }

    /// For how long batch outcomes have waited for the database, if any do.
    pub fn outcomes_waiting(&self) -> Option<Duration> {
        let since = *self
            .inner
            .acks_waiting_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        since.filter(|_| self.acks_pending()).map(|since| since.elapsed())
    }

    /// A settled batch's metrics, counted per batch: a labelled counter
    /// lookup per row costs more than the row's ack.
    fn count(&self, settled: &settle::Settled<'_>) {
        let metrics = &self.inner.metrics;
        let now_ms = chrono::Utc::now().timestamp_millis();
        let commit_to_publish = metrics.commit_to_publish();
        for created_at_ms in &settled.published_created_at_ms {
            commit_to_publish.observe((now_ms - created_at_ms).max(0) as f64 / 1000.0);
        }
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
