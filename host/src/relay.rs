//! The relay loop: workers claim batches, run them through the plugins,
//! publish to every target and record the outcome; a listener turns NOTIFY
//! into wake-ups, with polling as the fallback.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::join_all;
use rand::Rng;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, debug_span, info, warn};

use crate::config::{RelayConfig, UnmatchedPolicy};
use crate::metrics::{FailureLabels, Metrics, PluginLabel, TargetLabel};
use crate::plugin::{CallFailure, Event, Message, PluginVersion, Plugins, Refusal};
use crate::router::{self, Limits, Routed};
use crate::sinks::{SinkError, Sinks};
use crate::store::{self, Claim, Delivery, OutboxRow, OutboxStore, Outcome, RowOutcome};
use crate::trace::TraceParent;

/// A claim statement slower than this is logged with its duration.
const SLOW_CLAIM: Duration = Duration::from_secs(1);

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
    /// Recording the outcomes failed; the batch's leases expire and its rows
    /// are claimed again (targets that acknowledged are not sent again only
    /// if their state was recorded, so some messages may repeat).
    #[error("recording the batch's outcomes failed: {0}")]
    Ack(#[source] store::Error),
}

/// A batch that panicked: a bug, not the rows' fault. Its leases expire and
/// the rows are retried; readiness reports it for [`PANIC_UNREADY_FOR`].
#[derive(Default)]
struct WorkerHealth {
    last_panic: std::sync::Mutex<Option<(Instant, String)>>,
    /// When this relay last refreshed the table's statistics.
    last_analyze: std::sync::Mutex<Option<Instant>>,
}

/// Least time between two statistics refreshes triggered by slow claims.
const ANALYZE_INTERVAL: Duration = Duration::from_secs(60);

/// How long `/readyz` stays unready after a batch panicked.
const PANIC_UNREADY_FOR: Duration = Duration::from_secs(60);

struct Inner {
    health: WorkerHealth,
    watcher: Option<std::sync::Mutex<crate::plugin::watch::PluginWatcher>>,
    native_router: Option<NativeRouter>,
    store: OutboxStore,
    plugins: Plugins,
    sinks: Sinks,
    config: RelayConfig,
    owner: String,
    limits: Limits,
    metrics: Metrics,
}

/// What one batch did, for logs and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows published (including dropped ones).
    pub published: usize,
    /// Rows the plugin deliberately dropped.
    pub dropped: usize,
    /// Rows scheduled for another attempt.
    pub retried: usize,
    /// Rows dead-lettered.
    pub dead: usize,
    /// Rows whose lease was lost before the ack.
    pub lost: usize,
}

impl Relay {
    /// Assembles a relay.
    pub fn new(store: OutboxStore, plugins: Plugins, sinks: Sinks, config: RelayConfig) -> Relay {
        let owner = config.instance_id.clone().unwrap_or_else(default_owner);
        let limits = Limits::from_config(&config);
        let metrics = Metrics::new(Some(plugins.clone()));
        Relay {
            inner: Arc::new(Inner {
                health: WorkerHealth::default(),
                watcher: None,
                native_router: None,
                metrics,
                store,
                plugins,
                sinks,
                config,
                owner,
                limits,
            }),
        }
    }

    /// Keeps a plugin watcher alive as long as the relay (hot reload).
    #[must_use]
    pub fn with_watcher(self, watcher: Option<crate::plugin::watch::PluginWatcher>) -> Relay {
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => {
                inner.watcher = watcher.map(std::sync::Mutex::new);
                Relay {
                    inner: Arc::new(inner),
                }
            }
            Err(inner) => Relay { inner },
        }
    }

    /// Routes every event with `router` instead of the configured plugins.
    #[must_use]
    pub fn with_native_router(self, router: NativeRouter) -> Relay {
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => {
                inner.native_router = Some(router);
                Relay {
                    inner: Arc::new(inner),
                }
            }
            Err(inner) => Relay { inner },
        }
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
    pub fn workers_health(&self) -> Result<(), String> {
        let last = match self.inner.health.last_panic.lock() {
            Ok(last) => last.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        match last {
            Some((at, message)) if at.elapsed() < PANIC_UNREADY_FOR => Err(format!(
                "a batch panicked {} s ago: {message}",
                at.elapsed().as_secs()
            )),
            _ => Ok(()),
        }
    }

    /// A slow claim is usually a plan made on statistics taken while the
    /// outbox was empty, its normal state: refresh them (at most once per
    /// [`ANALYZE_INTERVAL`]) so the next claim is planned on the backlog
    /// that is there now.
    fn claim_was_slow(&self) {
        let due = match self.inner.health.last_analyze.lock() {
            Ok(mut last) => {
                let due = last.is_none_or(|at| at.elapsed() >= ANALYZE_INTERVAL);
                if due {
                    *last = Some(Instant::now());
                }
                due
            }
            Err(_) => false,
        };
        if !due {
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
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".to_string());
        tracing::error!(
            worker,
            panic = %message,
            "A batch panicked; its rows are retried when their leases expire. This is a bug: please report it."
        );
        self.inner.metrics.worker_panics.inc();
        if let Ok(mut last) = self.inner.health.last_panic.lock() {
            *last = Some((Instant::now(), message));
        }
    }

    /// Relays until `shutdown` is cancelled, then stops claiming, lets running
    /// batches finish within `shutdown_timeout_ms` and releases what is left.
    ///
    /// # Errors
    /// Only if the leases could not be released at the end; transient database
    /// and broker errors are retried inside.
    pub async fn run(&self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let wake = Arc::new(Notify::new());
        let listener = tokio::spawn(listen(self.inner.store.clone(), wake.clone(), shutdown.clone()));
        let mut workers = JoinSet::new();
        let mut numbers = HashMap::new();
        let spawn = |workers: &mut JoinSet<()>, numbers: &mut HashMap<tokio::task::Id, u32>, worker: u32| {
            let relay = self.clone();
            let wake = wake.clone();
            let shutdown = shutdown.clone();
            let task = workers.spawn(async move { relay.work(worker, wake, shutdown).await });
            numbers.insert(task.id(), worker);
        };
        for worker in 0..self.inner.config.concurrency {
            spawn(&mut workers, &mut numbers, worker);
        }
        info!(
            relay.owner = %self.inner.owner,
            relay.concurrency = self.inner.config.concurrency,
            "Relay started."
        );
        // Supervise: a worker ends only at shutdown; one that ends earlier
        // (a panic that escaped its batch guard) is reported and replaced.
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(ended) = workers.join_next_with_id() => {
                    if shutdown.is_cancelled() {
                        break;
                    }
                    let (id, panic) = match ended {
                        Ok((id, ())) => (id, None),
                        Err(error) => (error.id(), error.try_into_panic().ok()),
                    };
                    let worker = numbers.remove(&id).unwrap_or_default();
                    match panic {
                        Some(panic) => self.record_panic(worker, panic.as_ref()),
                        None => tracing::error!(worker, "A worker stopped unexpectedly; starting it again."),
                    }
                    spawn(&mut workers, &mut numbers, worker);
                }
            }
        }
        let started = Instant::now();
        let bound = Duration::from_millis(self.inner.config.shutdown_timeout_ms);
        let drained = tokio::time::timeout(bound, async { while workers.join_next().await.is_some() {} })
            .await
            .is_ok();
        listener.abort();
        if drained {
            info!(
                elapsed_ms = started.elapsed().as_millis() as u64,
                "Relay stopped; all batches finished."
            );
        } else {
            workers.abort_all();
            let released = self.inner.store.release_owner(&self.inner.owner).await?;
            warn!(
                released,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "Relay stopped before batches finished; released their leases."
            );
        }
        Ok(())
    }

    /// One worker. Wake-ups are handed to one idle worker at a time (a
    /// commit wakes one; a worker that claimed a full batch wakes the next),
    /// so a burst of commits does not send every idle worker into a claim
    /// scan that finds nothing.
    async fn work(&self, worker: u32, wake: Arc<Notify>, shutdown: CancellationToken) {
        let poll = Duration::from_millis(self.inner.config.poll_interval_ms);
        let full = usize::try_from(self.inner.config.batch_size).unwrap_or(usize::MAX);
        let mut db_backoff = Duration::from_millis(100);
        while !shutdown.is_cancelled() {
            // A panicking batch must not take the worker with it.
            let batch = std::panic::AssertUnwindSafe(self.run_once()).catch_unwind().await;
            let batch = match batch {
                Ok(batch) => batch,
                Err(panic) => {
                    self.record_panic(worker, panic.as_ref());
                    tokio::select! {
                        () = tokio::time::sleep(db_backoff) => {}
                        () = shutdown.cancelled() => {}
                    }
                    continue;
                }
            };
            match batch {
                Ok(report) if report.claimed > 0 => {
                    db_backoff = Duration::from_millis(100);
                    if report.claimed >= full {
                        wake.notify_one();
                    }
                    // The ack just freed the next event of each aggregate: look again now.
                    continue;
                }
                Ok(_) => {
                    db_backoff = Duration::from_millis(100);
                    tokio::select! {
                        () = wake.notified() => {}
                        () = tokio::time::sleep(poll) => {}
                        () = shutdown.cancelled() => {}
                    }
                }
                Err(error) => {
                    warn!(%error, worker, retry_ms = db_backoff.as_millis() as u64, "Batch failed, will retry.");
                    tokio::select! {
                        () = tokio::time::sleep(db_backoff) => {}
                        () = shutdown.cancelled() => {}
                    }
                    db_backoff = (db_backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Claims and processes one batch.
    ///
    /// # Errors
    /// A database error while claiming or acking; the batch's leases then
    /// expire and the rows are claimed again.
    pub async fn run_once(&self) -> Result<BatchReport, BatchError> {
        let inner = &self.inner;
        let claim = inner
            .store
            .claim(
                &inner.owner,
                inner.config.batch_size,
                inner.config.lease_duration(),
            )
            .await;
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
                rows = claim.rows.len(),
                lease_ms = inner.config.lease_duration_ms,
                "Claim statement was slow."
            );
            self.claim_was_slow();
        }
        if claim.rows.is_empty() {
            return Ok(BatchReport::default());
        }
        self.process(claim).await
    }

    async fn process(&self, claim: Claim) -> Result<BatchReport, BatchError> {
        let inner = &self.inner;
        let mut report = BatchReport {
            claimed: claim.rows.len(),
            ..BatchReport::default()
        };
        inner.metrics.batch_size.observe(claim.rows.len() as f64);
        let lease = claim.lease;
        let deadline = claim.deadline;
        let claim_took = claim.took;
        let mut routed = self.route_all(claim.rows, deadline, claim_took).await;

        // Publish everything not yet acknowledged, grouped by target.
        let mut by_target: BTreeMap<String, Vec<(usize, usize)>> = BTreeMap::new();
        let mut outgoing: BTreeMap<String, Vec<crate::sinks::OutgoingMessage>> = BTreeMap::new();
        let mut results: Vec<Vec<Option<Result<(), SinkError>>>> = Vec::with_capacity(routed.len());
        let publish_allowed = Instant::now() + inner.config.publish_timeout() + ACK_RESERVE < deadline;
        for (row_index, row) in routed.iter_mut().enumerate() {
            let mut row_results = Vec::new();
            if let RowState::Routed { messages, .. } = &mut row.state {
                for (message_index, message) in messages.iter_mut().enumerate() {
                    let acked = row
                        .row
                        .deliveries
                        .get(&message.delivery_key)
                        .is_some_and(|d| d.acked_at.is_some());
                    if acked {
                        row_results.push(Some(Ok(())));
                    } else if publish_allowed {
                        row_results.push(None);
                        by_target
                            .entry(message.target.clone())
                            .or_default()
                            .push((row_index, message_index));
                        // Moved, not copied: only the topic is read again, for the delivery record.
                        let topic = message.message.topic.clone();
                        let taken = std::mem::replace(
                            &mut message.message,
                            crate::sinks::OutgoingMessage {
                                topic,
                                ..Default::default()
                            },
                        );
                        outgoing.entry(message.target.clone()).or_default().push(taken);
                    } else {
                        row_results.push(Some(Err(SinkError::retryable(lease_spent(
                            claim_took,
                            inner.config.lease_duration(),
                            "publishing",
                        )))));
                    }
                }
            }
            results.push(row_results);
        }
        let publish_bound = inner.config.publish_timeout() + Duration::from_millis(500);
        let sends = outgoing.into_iter().map(|(target, messages)| {
            let sink = inner.sinks.get(&target).cloned();
            let count = messages.len();
            async move {
                let outcome = match sink {
                    Some(sink) => tokio::time::timeout(publish_bound, sink.publish(messages))
                        .await
                        .unwrap_or_else(|_| {
                            vec![
                                Err(SinkError::retryable(format!(
                                    "target {target:?} did not answer in time"
                                )));
                                count
                            ]
                        }),
                    None => vec![Err(SinkError::permanent(format!("unknown target {target:?}"))); count],
                };
                (target, outcome)
            }
        });
        for (target, outcome) in join_all(sends).await {
            let failed: Vec<&SinkError> = outcome.iter().filter_map(|r| r.as_ref().err()).collect();
            let metrics = &inner.metrics;
            let label = TargetLabel {
                target: target.clone(),
            };
            metrics
                .published
                .get_or_create(&label)
                .inc_by((outcome.len() - failed.len()) as u64);
            for error in &failed {
                let error = if error.retryable { "retryable" } else { "permanent" };
                metrics
                    .failed
                    .get_or_create(&FailureLabels {
                        target: target.clone(),
                        error,
                    })
                    .inc();
            }
            // One line per target, kind and batch: the per-row state is in `deliveries`.
            let (retryable, permanent): (Vec<&SinkError>, Vec<&SinkError>) =
                failed.iter().partition(|error| error.retryable);
            if let Some(first) = retryable.first() {
                warn!(
                    sink.name = %target,
                    failed = retryable.len(),
                    sent = outcome.len(),
                    error = %first.message,
                    "Deliveries to this target failed; only they will be retried."
                );
            }
            if let Some(first) = permanent.first() {
                warn!(
                    sink.name = %target,
                    refused = permanent.len(),
                    sent = outcome.len(),
                    error = %first.message,
                    "This target refused deliveries for good; their rows are dead-lettered."
                );
            }
            let slots = by_target.remove(&target).unwrap_or_default();
            for ((row_index, message_index), result) in slots.into_iter().zip(outcome) {
                results[row_index][message_index] = Some(result);
            }
        }

        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let mut outcomes = Vec::with_capacity(routed.len());
        // Failures before any target was tried (plugin trap, time limit, refusal).
        let mut unrouted = 0usize;
        let mut first_unrouted: Option<String> = None;
        let mut first_dead: Option<String> = None;
        // Counted per batch: a labelled counter lookup per row costs more than the row's ack.
        let mut tally: BTreeMap<(&str, &'static str), u64> = BTreeMap::new();
        let metrics = &inner.metrics;
        let now_ms = chrono::Utc::now().timestamp_millis();
        for (mut row, row_results) in routed.into_iter().zip(results) {
            let attempts = u32::try_from(row.row.attempts).unwrap_or(u32::MAX);
            let mut deliveries = std::mem::take(&mut row.row.deliveries);
            let (outcome, version) = match row.state {
                RowState::Failed { outcome, version } => {
                    if let Outcome::Retry { error, .. } = &outcome {
                        unrouted += 1;
                        first_unrouted.get_or_insert_with(|| error.clone());
                    }
                    (outcome, version)
                }
                RowState::Routed { messages, version } => {
                    let mut permanent = None;
                    let mut retryable = None;
                    for (message, result) in messages.iter().zip(row_results) {
                        let result = result.unwrap_or_else(|| Err(SinkError::retryable("not published")));
                        let entry =
                            deliveries
                                .entry(message.delivery_key.clone())
                                .or_insert_with(|| Delivery {
                                    target: message.target.clone(),
                                    topic: message.message.topic.clone(),
                                    acked_at: None,
                                    error: None,
                                });
                        match result {
                            Ok(()) => {
                                if entry.acked_at.is_none() {
                                    entry.acked_at = Some(now.clone());
                                }
                                entry.error = None;
                            }
                            Err(error) => {
                                let text = format!(
                                    "target {:?} topic {:?}: {}",
                                    message.target, message.message.topic, error.message
                                );
                                entry.error = Some(error.message.clone());
                                if error.retryable {
                                    retryable.get_or_insert(text);
                                } else {
                                    permanent.get_or_insert(text);
                                }
                            }
                        }
                    }
                    if messages.is_empty() {
                        report.dropped += 1;
                    }
                    let outcome = match (permanent, retryable) {
                        (Some(error), _) => Outcome::Dead { error },
                        (None, Some(error)) => self.retry_or_dead(attempts, error),
                        (None, None) => Outcome::Published,
                    };
                    (outcome, version)
                }
            };
            let plugin = inner
                .plugins
                .select(&row.row.aggregate_type, &row.row.event_type)
                .map_or("none", |index| {
                    inner.plugins.slots()[index].config().name.as_str()
                });
            let kind = match &outcome {
                Outcome::Published => {
                    report.published += 1;
                    let age_ms = now_ms - row.row.created_at_ms;
                    metrics.commit_to_publish.observe(age_ms.max(0) as f64 / 1000.0);
                    if deliveries.is_empty() {
                        "dropped"
                    } else {
                        "published"
                    }
                }
                Outcome::Retry { .. } | Outcome::Defer { .. } => {
                    report.retried += 1;
                    "retried"
                }
                Outcome::Dead { error } => {
                    report.dead += 1;
                    first_dead.get_or_insert_with(|| error.clone());
                    "dead_lettered"
                }
            };
            *tally.entry((plugin, kind)).or_default() += 1;
            row.span.in_scope(|| match &outcome {
                Outcome::Published => debug!(deliveries = deliveries.len(), "Row published."),
                Outcome::Dead { error } | Outcome::Retry { error, .. } | Outcome::Defer { reason: error, .. } => {
                    debug!(outbox.row_id = %row.row.id, outbox.attempt = attempts, %error, "Row not published.");
                }
            });
            outcomes.push(RowOutcome {
                id: row.row.id,
                outcome,
                deliveries,
                plugin_version: version,
            });
        }
        let mut claimed: BTreeMap<&str, u64> = BTreeMap::new();
        for ((plugin, kind), count) in tally {
            metrics.event(kind, plugin, count);
            *claimed.entry(plugin).or_default() += count;
        }
        for (plugin, count) in claimed {
            metrics
                .claimed
                .get_or_create(&PluginLabel {
                    plugin: plugin.to_string(),
                })
                .inc_by(count);
        }
        let acked = inner.store.ack(lease, &outcomes).await.map_err(BatchError::Ack)?;
        report.lost = outcomes.len() - acked.len();
        if report.lost > 0 {
            warn!(
                lost = report.lost,
                "Leases expired before the ack; those rows will be delivered again."
            );
        }
        if let Some(error) = first_unrouted {
            warn!(rows = unrouted, %error, "Rows failed before publishing; they will be retried.");
        }
        if let Some(error) = first_dead {
            warn!(dead = report.dead, %error, "Rows dead-lettered.");
        }
        debug!(
            batch.size = report.claimed,
            published = report.published,
            retried = report.retried,
            dead = report.dead,
            "Batch done."
        );
        Ok(report)
    }

    fn retry_or_dead(&self, attempts: u32, error: String) -> Outcome {
        let config = &self.inner.config;
        if attempts >= config.max_attempts {
            Outcome::Dead {
                error: format!("gave up after {attempts} attempts: {error}"),
            }
        } else {
            Outcome::Retry {
                after: backoff(config.initial_backoff_ms, config.max_backoff_ms, attempts),
                error,
            }
        }
    }

    /// Runs every row through its plugin on a blocking thread (wasm calls are
    /// synchronous CPU work), all with the versions current at batch start.
    async fn route_all(
        &self,
        rows: Vec<OutboxRow>,
        deadline: Instant,
        claim_took: Duration,
    ) -> Vec<RoutedRow> {
        let relay = self.clone();
        let fallback_ids: Vec<_> = rows.iter().map(|r| r.id).collect();
        match tokio::task::spawn_blocking(move || relay.route_all_blocking(rows, deadline, claim_took)).await
        {
            Ok(routed) => routed,
            Err(join_error) => {
                // Only reachable if routing panicked; keep the rows for a retry
                // instead of losing them.
                warn!(error = %join_error, rows = fallback_ids.len(), "Routing task failed.");
                Vec::new()
            }
        }
    }

    fn route_all_blocking(
        &self,
        rows: Vec<OutboxRow>,
        deadline: Instant,
        claim_took: Duration,
    ) -> Vec<RoutedRow> {
        let inner = &self.inner;
        let slots = inner.plugins.slots();
        let mut versions: HashMap<usize, Arc<PluginVersion>> = HashMap::new();
        let mut instances: HashMap<usize, crate::plugin::Instance> = HashMap::new();
        let route_until = deadline
            .checked_sub(inner.config.publish_timeout() + ACK_RESERVE)
            .unwrap_or(deadline);
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let attempts = u32::try_from(row.attempts).unwrap_or(u32::MAX);
            if attempts > inner.config.max_attempts {
                // Only reached when leases keep expiring (e.g. the relay crashed
                // while holding this row every time).
                let error = format!("lease expired {} times without an outcome", attempts - 1);
                out.push(RoutedRow::failed(row, Outcome::Dead { error }, None));
                continue;
            }
            let event = match router::event_from_row(&row, &inner.limits) {
                Ok(event) => event,
                Err(error) => {
                    out.push(RoutedRow::failed(row, Outcome::Dead { error }, None));
                    continue;
                }
            };
            // The row's span continues the writer's trace; its id is what
            // the broker message carries as `traceparent`.
            let parent = TraceParent::from_headers(&event.headers);
            let child = parent.map(|p| p.child());
            let span = debug_span!(
                "outbox.row",
                outbox.row_id = %row.id,
                outbox.event_id = %event.event_id,
                outbox.attempt = attempts,
                trace.id = parent.map(|p| p.trace_hex()),
                span.id = child.map(|c| c.span_hex()),
                parent.id = parent.map(|p| p.span_hex()),
            );
            if let Some(native) = &inner.native_router {
                let started = Instant::now();
                let result = span.in_scope(|| native(&event)).map_err(|refusal| match refusal {
                    Refusal::Transient(reason) => CallFailure::Transient(reason),
                    Refusal::Permanent(reason) => CallFailure::Permanent(reason),
                });
                self.observe_call("native", started);
                let state = span
                    .in_scope(|| self.call_outcome(result, &event, "native", None, attempts, child.as_ref()));
                out.push(RoutedRow { row, state, span });
                continue;
            }
            let Some(slot_index) = inner.plugins.select(&event.aggregate_type, &event.event_type) else {
                let outcome = match inner.config.unmatched {
                    UnmatchedPolicy::DeadLetter => Outcome::Dead {
                        error: format!(
                            "no plugin matches aggregate type {:?} and event type {:?}",
                            event.aggregate_type, event.event_type
                        ),
                    },
                    UnmatchedPolicy::Drop => {
                        out.push(RoutedRow {
                            row,
                            state: RowState::Routed {
                                messages: Vec::new(),
                                version: None,
                            },
                            span: span.clone(),
                        });
                        continue;
                    }
                };
                out.push(RoutedRow::failed(row, outcome, None).in_span(&span));
                continue;
            };
            if Instant::now() >= route_until {
                let error = lease_spent(claim_took, inner.config.lease_duration(), "routing");
                let outcome = self.retry_or_dead(attempts, error);
                out.push(RoutedRow::failed(row, outcome, None).in_span(&span));
                continue;
            }
            let version = match versions.get(&slot_index) {
                Some(version) => version.clone(),
                None => match slots[slot_index].current() {
                    Some(version) => {
                        versions.insert(slot_index, version.clone());
                        version
                    }
                    None => {
                        let reason = format!(
                            "plugin {} is unloaded (its file {} was deleted); waiting for it to return",
                            slots[slot_index].config().name,
                            slots[slot_index].config().path.display()
                        );
                        let after = Duration::from_millis(inner.config.poll_interval_ms.max(1000));
                        out.push(
                            RoutedRow::failed(row, Outcome::Defer { after, reason }, None).in_span(&span),
                        );
                        continue;
                    }
                },
            };
            let label = version.label();
            let instance = match instances.remove(&slot_index) {
                Some(instance) => instance,
                None => match version.checkout() {
                    Ok(instance) => instance,
                    Err(error) => {
                        let outcome = self.retry_or_dead(attempts, error.to_string());
                        out.push(
                            RoutedRow::failed(row, outcome, Some(version.version().to_string()))
                                .in_span(&span),
                        );
                        continue;
                    }
                },
            };
            let started = Instant::now();
            let (result, instance) = span.in_scope(|| version.route(instance, &event));
            self.observe_call(version.name(), started);
            if let Some(instance) = instance {
                instances.insert(slot_index, instance);
            }
            let version_id = Some(version.version().to_string());
            let state = span
                .in_scope(|| self.call_outcome(result, &event, &label, version_id, attempts, child.as_ref()));
            out.push(RoutedRow { row, state, span });
        }
        for (slot_index, instance) in instances {
            if let Some(version) = versions.get(&slot_index) {
                version.put_back(instance);
            }
        }
        out
    }

    fn observe_call(&self, plugin: &str, started: Instant) {
        self.inner
            .metrics
            .plugin_call
            .get_or_create(&PluginLabel {
                plugin: plugin.to_string(),
            })
            .observe(started.elapsed().as_secs_f64());
    }

    /// A routing call's result as the row's state: messages to publish, or
    /// dead-lettered (permanent refusal) or retried (transient, crash).
    fn call_outcome(
        &self,
        result: Result<Vec<Message>, CallFailure>,
        event: &Event,
        label: &str,
        version: Option<String>,
        attempts: u32,
        trace: Option<&TraceParent>,
    ) -> RowState {
        let outcome = match result {
            Ok(messages) => return self.assemble(event, messages, label, version, trace),
            Err(CallFailure::Permanent(reason)) => Outcome::Dead {
                error: format!("plugin {label} refused permanently: {reason}"),
            },
            Err(CallFailure::Transient(reason)) => {
                self.retry_or_dead(attempts, format!("plugin {label} refused for now: {reason}"))
            }
            Err(CallFailure::Crashed(reason)) => {
                self.retry_or_dead(attempts, format!("plugin {label} {reason}"))
            }
        };
        RowState::Failed { outcome, version }
    }

    fn assemble(
        &self,
        event: &Event,
        messages: Vec<Message>,
        label: &str,
        version: Option<String>,
        trace: Option<&TraceParent>,
    ) -> RowState {
        let sinks = &self.inner.sinks;
        match router::assemble(
            event,
            messages,
            label,
            &self.inner.limits,
            &|name| sinks.get(name).map(|sink| sink.deduplicates_by_id()),
            trace,
        ) {
            Ok(messages) => {
                debug!(outbox.event_id = %event.event_id, plugin.label = label, messages = messages.len(), "Routed.");
                RowState::Routed { messages, version }
            }
            Err(error) => RowState::Failed {
                outcome: Outcome::Dead { error },
                version,
            },
        }
    }
}

struct RoutedRow {
    row: OutboxRow,
    state: RowState,
    /// The row's `outbox.row` span (disabled when the row failed before
    /// its event could be read).
    span: tracing::Span,
}

enum RowState {
    Routed {
        messages: Vec<Routed>,
        version: Option<String>,
    },
    Failed {
        outcome: Outcome,
        version: Option<String>,
    },
}

impl RoutedRow {
    fn failed(row: OutboxRow, outcome: Outcome, version: Option<String>) -> RoutedRow {
        RoutedRow {
            row,
            state: RowState::Failed { outcome, version },
            span: tracing::Span::none(),
        }
    }

    fn in_span(self, span: &tracing::Span) -> RoutedRow {
        RoutedRow {
            span: span.clone(),
            ..self
        }
    }
}

/// Why a batch ran out of lease before `stage`: the claim statement itself
/// (a slow database) or the plugin calls. Blaming the plugins for a slow
/// claim sends operators to the wrong place.
fn lease_spent(claim_took: Duration, lease: Duration, stage: &str) -> String {
    if claim_took * 2 >= lease {
        format!(
            "lease nearly expired before {stage}: the claim statement took {} ms of the {} ms lease (database slow)",
            claim_took.as_millis(),
            lease.as_millis()
        )
    } else {
        format!("lease nearly expired before {stage} (plugins too slow for the lease)")
    }
}

/// Exponential backoff with jitter: `initial * 2^(attempt-1)`, capped, then a
/// random point in its upper half so that retries of many rows spread out.
pub fn backoff(initial_ms: u64, max_ms: u64, attempt: u32) -> Duration {
    let exponent = attempt.saturating_sub(1).min(32);
    let full = initial_ms.saturating_mul(1u64 << exponent).min(max_ms);
    let low = full / 2;
    Duration::from_millis(rand::rng().random_range(low..=full.max(low)))
}

fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".to_string());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    format!("{host}-{}-{suffix}", std::process::id())
}

/// Wakes a worker on every NOTIFY, and all of them after a reconnect
/// (notifications sent while disconnected are lost, so workers should look).
async fn listen(store: OutboxStore, wake: Arc<Notify>, shutdown: CancellationToken) {
    // SQLite has no NOTIFY: the embedded default relies on polling.
    let Some(pool) = store.pg_pool().cloned() else {
        return;
    };
    let mut retry = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(listener) => listener,
            Err(error) => {
                warn!(%error, retry_ms = retry.as_millis() as u64, "LISTEN connection failed; polling meanwhile.");
                tokio::select! {
                    () = tokio::time::sleep(retry) => {}
                    () = shutdown.cancelled() => return,
                }
                retry = (retry * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if let Err(error) = listener.listen(store::NOTIFY_CHANNEL).await {
            warn!(%error, "LISTEN failed; polling meanwhile.");
            tokio::select! {
                () = tokio::time::sleep(retry) => {}
                () = shutdown.cancelled() => return,
            }
            retry = (retry * 2).min(Duration::from_secs(5));
            continue;
        }
        retry = Duration::from_millis(100);
        wake.notify_waiters();
        loop {
            let received = tokio::select! {
                received = listener.try_recv() => received,
                () = shutdown.cancelled() => return,
            };
            match received {
                Ok(Some(_)) => wake.notify_one(),
                // Connection lost; the next try_recv reconnects.
                Ok(None) => wake.notify_waiters(),
                Err(error) => {
                    warn!(%error, "LISTEN connection broke; reconnecting.");
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_claim_is_not_blamed_on_the_plugins() {
        let lease = Duration::from_secs(30);
        let slow = lease_spent(Duration::from_secs(20), lease, "routing");
        assert!(
            slow.contains("claim statement took 20000 ms of the 30000 ms lease"),
            "{slow}"
        );
        assert!(!slow.contains("plugins"), "{slow}");
        let plugins = lease_spent(Duration::from_millis(5), lease, "publishing");
        assert!(plugins.contains("plugins too slow"), "{plugins}");
    }

    #[test]
    fn backoff_doubles_within_its_cap_with_jitter_in_the_upper_half() {
        for attempt in 1..=12 {
            let full = (100u64 << (attempt - 1)).min(5_000);
            for _ in 0..50 {
                let delay = backoff(100, 5_000, attempt).as_millis() as u64;
                assert!(
                    (full / 2..=full).contains(&delay),
                    "attempt {attempt}: {delay} ms"
                );
            }
        }
        assert!(backoff(100, 5_000, u32::MAX).as_millis() <= 5_000);
    }
}
