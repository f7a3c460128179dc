//! The claim feed: workers claim batches from the outbox table and take
//! each through the relay's stages, a LISTEN session turns commits into
//! wake-ups, sweepers find what no wake-up announces, and each batch's
//! outcomes are recorded by an ack fenced by its lease (held and tried
//! again while the database cannot take them). A panicking batch is
//! caught, and a worker that ends anyway is replaced. At shutdown running
//! batches get `shutdown_timeout_ms` to finish.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use super::{BatchError, BatchReport, Relay, health};
use crate::store::{self, Claim};

/// How soon a relay without NOTIFY polls again after a claim found rows.
const POLL_UNDER_LOAD: Duration = Duration::from_millis(20);

/// A claim statement slower than this is logged with its duration.
const SLOW_CLAIM: Duration = Duration::from_secs(1);

/// The longest pause between two tries to record a batch's outcomes while
/// the database cannot take them.
const ACK_RETRY_MAX: Duration = Duration::from_secs(1);

/// The workers that claim from the outbox table, and what runs beside
/// them. In replication mode it relays what the WAL feed handed over.
#[derive(Clone)]
pub(super) struct ClaimFeed {
    relay: Relay,
    /// Whether a session LISTENs for commits (else the poll alone finds rows).
    listen: bool,
}

impl ClaimFeed {
    pub(super) fn new(relay: Relay, listen: bool) -> ClaimFeed {
        ClaimFeed { relay, listen }
    }

    /// Claims until `shutdown` is cancelled, then stops claiming, lets running
    /// batches finish within `shutdown_timeout_ms` and releases what is left.
    ///
    /// # Errors
    /// Only if the leases could not be released at the end; transient database
    /// and broker errors are retried inside.
    pub(super) async fn run(&self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let relay = &self.relay;
        let wake = relay.inner.wake.clone();
        // Ended with this future even when it is dropped rather than shut
        // down: a detached listener or sweeper would outlive its relay.
        // In replication mode `migrate` turns the per-commit NOTIFY off
        // (commits reach the WAL feed, which wakes a worker when it hands
        // rows over); what is heard then is an ack that freed a parked row.
        // Without LISTEN (a connection budget too small for it) the poll
        // alone finds new rows.
        // SQLite has no NOTIFY: the poll alone finds new rows there.
        let _listener = relay.inner.store.postgres().filter(|_| self.listen).map(|pg| {
            let (wake, shutdown) = (wake.clone(), shutdown.clone());
            let metrics = relay.inner.metrics.clone();
            AbortOnDropHandle::new(tokio::spawn(async move {
                pg.wake_on_commits(wake, shutdown, move |on| metrics.set_listening(on))
                    .await;
            }))
        });
        let _sweeper = AbortOnDropHandle::new(tokio::spawn(sweep_parked(
            relay.inner.store.clone(),
            wake.clone(),
            shutdown.clone(),
        )));
        let _waiting_sweeper = AbortOnDropHandle::new(tokio::spawn(super::outage::sweep_waiting(
            std::sync::Arc::downgrade(&relay.inner),
            shutdown.clone(),
        )));
        let mut workers = JoinSet::new();
        let mut numbers = HashMap::new();
        let spawn = |workers: &mut JoinSet<()>, numbers: &mut HashMap<tokio::task::Id, u32>, worker: u32| {
            let feed = self.clone();
            let wake = wake.clone();
            let shutdown = shutdown.clone();
            let task = workers.spawn(async move { feed.work(worker, wake, shutdown).await });
            numbers.insert(task.id(), worker);
        };
        for worker in 0..relay.inner.config.concurrency {
            spawn(&mut workers, &mut numbers, worker);
        }
        info!(
            relay.owner = %relay.inner.owner,
            relay.concurrency = relay.inner.config.concurrency,
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
                        Some(panic) => relay.record_panic(worker, panic.as_ref()),
                        None => tracing::error!(worker, "A worker stopped unexpectedly; starting it again."),
                    }
                    spawn(&mut workers, &mut numbers, worker);
                }
            }
        }
        self.stop_workers(workers).await
    }

    /// Lets running batches finish within `shutdown_timeout_ms`, then
    /// releases the leases of those that did not.
    async fn stop_workers(&self, mut workers: JoinSet<()>) -> anyhow::Result<()> {
        let started = Instant::now();
        let bound = Duration::from_millis(self.relay.inner.config.shutdown_timeout_ms);
        let drained = tokio::time::timeout(bound, async { while workers.join_next().await.is_some() {} })
            .await
            .is_ok();
        if drained {
            info!(
                elapsed_ms = started.elapsed().as_millis() as u64,
                "Relay stopped; all batches finished."
            );
        } else {
            workers.abort_all();
            let released = self
                .relay
                .inner
                .store
                .release_owner(&self.relay.inner.owner)
                .await?;
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
        let poll = Duration::from_millis(self.relay.inner.config.poll_interval_ms);
        let idle_poll_max = self.relay.inner.config.idle_poll_max();
        // Without NOTIFY (SQLite, MySQL, a relay told not to LISTEN) the
        // poll is the only wake-up: right after a claim found rows, the
        // next looks again soon, and polls that find nothing come further
        // apart up to the interval. A steady writer's events wait tens of
        // milliseconds; an idle database is asked twice a second.
        let first_poll = if self.listen && self.relay.inner.store.postgres().is_some() {
            poll
        } else {
            poll.min(POLL_UNDER_LOAD)
        };
        let mut idle_poll = crate::backoff::Backoff::new(first_poll, idle_poll_max).exact();
        let full = usize::try_from(self.relay.inner.config.batch_size).unwrap_or(usize::MAX);
        let mut db_backoff = crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        while !shutdown.is_cancelled() {
            // A panicking batch must not take the worker with it.
            let batch = std::panic::AssertUnwindSafe(self.relay.run_once())
                .catch_unwind()
                .await;
            let batch = match batch {
                Ok(batch) => batch,
                Err(panic) => {
                    self.relay.record_panic(worker, panic.as_ref());
                    tokio::select! {
                        () = tokio::time::sleep(db_backoff.peek()) => {}
                        () = shutdown.cancelled() => {}
                    }
                    continue;
                }
            };
            match batch {
                // A full batch: more may be due. Rows set aside: others may
                // be claimable behind them. Otherwise a partial batch left
                // nothing to find that a NOTIFY (a commit, an ack that freed a
                // parked row) or the poll will not announce, unless the store
                // says so.
                Ok(report)
                    if report.claimed >= full
                        || report.parked > 0
                        || (report.claimed > 0 && report.look_again) =>
                {
                    db_backoff.reset();
                    idle_poll.reset();
                    if report.claimed >= full {
                        wake.notify_one();
                    }
                    continue;
                }
                // Nothing taken: rows behind a predecessor being acked right
                // now. Its ack commits within moments.
                Ok(report) if report.look_again => {
                    db_backoff.reset();
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(2)) => {}
                        () = shutdown.cancelled() => {}
                    }
                }
                // Idle. One worker polls for what no wake-up announces (rows
                // due by time, leases that ran out); the others wait to be
                // woken (a commit, a full batch), so an idle relay costs one
                // poll per interval, not one per worker. Polls that keep
                // finding nothing come further apart, up to `idle_poll_max`.
                Ok(report) if worker == 0 => {
                    db_backoff.reset();
                    if report.claimed > 0 {
                        idle_poll.reset();
                    }
                    let pause = idle_poll.peek();
                    tokio::select! {
                        () = self.woken(&wake) => idle_poll.reset(),
                        () = tokio::time::sleep(pause) => {
                            idle_poll.next_pause();
                        }
                        () = shutdown.cancelled() => {}
                    }
                }
                Ok(_) => {
                    db_backoff.reset();
                    tokio::select! {
                        () = self.woken(&wake) => {}
                        () = shutdown.cancelled() => {}
                    }
                }
                Err(error) => {
                    let wait = db_backoff.next_pause();
                    warn!(%error, worker, retry_ms = wait.as_millis() as u64, "Batch failed, will retry.");
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = shutdown.cancelled() => {}
                    }
                }
            }
        }
    }
}

impl ClaimFeed {
    /// Returns at a wake-up this worker is to claim for (see [`ClaimGate`]).
    async fn woken(&self, wake: &Notify) {
        loop {
            wake.notified().await;
            if self.relay.inner.claim_gate.admit().await {
                return;
            }
        }
    }
}

impl Relay {
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

    /// Claims and processes one batch. Outcomes the database cannot take
    /// are held (and tried again) until it can.
    ///
    /// # Errors
    /// A database error while claiming; nothing was claimed.
    pub async fn run_once(&self) -> Result<BatchReport, BatchError> {
        let inner = &self.inner;
        // A claim now could take the leases of rows whose outcomes are on
        // their way: they would go round again, their attempt spent.
        while inner.held.any() {
            tokio::time::sleep(ACK_RETRY_MAX / 4).await;
        }
        inner.claim_gate.claiming();
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
                inner.held.hold();
                warn!(
                    %error,
                    rows = outcomes.len(),
                    "Cannot record the batch's outcomes; holding them until the database takes them. No batch is claimed meanwhile."
                );
            },
        )
        .await;
        if let Some(waited) = waited {
            inner.held.release();
            info!(
                rows = outcomes.len(),
                waited_ms = waited.as_millis() as u64,
                "The database took the batch's outcomes."
            );
        }
        acked
    }

    /// For how long batch outcomes have waited for the database, if any do.
    pub fn outcomes_waiting(&self) -> Option<Duration> {
        self.inner.held.waited()
    }
}

/// Claims started by wake-ups come at most one per [`CLAIM_SPACING`]: a
/// commit heard within that time of the last claim's start waits out the
/// rest of it, and every commit heard meanwhile joins that one claim. At a
/// steady 100 events/s commits come 10 ms apart and none waits; at 500/s,
/// the five or so commits of a few milliseconds were five claims and five
/// acks of one row each, and each statement's fixed cost on the server
/// (starting a plan of a dozen nodes, a commit, a round trip) is most of
/// what the relay costs it.
#[derive(Default)]
pub(super) struct ClaimGate {
    /// A woken worker is about to claim; a wake-up heard now is covered by
    /// that claim, whose statement has not begun yet.
    due: std::sync::atomic::AtomicBool,
    /// When the last claim statement was sent.
    last: Mutex<Option<Instant>>,
}

/// See [`ClaimGate`]. At 500 commits/s, 1 ms put 0.46 claims and 0.43
/// acks on the server per event, 2 ms about half that; a commit waits at
/// most this long, and only one heard right after another claim began.
const CLAIM_SPACING: Duration = Duration::from_millis(2);

impl ClaimGate {
    /// A claim statement is about to be sent: whatever committed before
    /// now is in its snapshot.
    fn claiming(&self) {
        self.due.store(false, Ordering::Release);
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
    }

    /// After a wake-up: whether this worker should claim (after waiting out
    /// the spacing), or go back to waiting because a claim that has not
    /// begun yet covers the wake-up.
    async fn admit(&self) -> bool {
        if self.due.swap(true, Ordering::AcqRel) {
            return false;
        }
        let last = *self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(wait) =
            last.and_then(|last| (last + CLAIM_SPACING).checked_duration_since(Instant::now()))
        {
            tokio::time::sleep(wait).await;
        }
        true
    }
}

/// Batches whose outcomes wait for the database to record them. No worker
/// claims meanwhile: a claim could take their expired leases, and the rows
/// would go round again with an attempt spent.
#[derive(Default)]
pub(super) struct HeldOutcomes {
    batches: AtomicUsize,
    /// When the oldest of them began waiting.
    since: Mutex<Option<Instant>>,
}

impl HeldOutcomes {
    fn hold(&self) {
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        self.batches.fetch_add(1, Ordering::AcqRel);
        since.get_or_insert_with(Instant::now);
    }

    /// One batch's outcomes recorded; the last clears the time, since
    /// another may still wait.
    fn release(&self) {
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        if self.batches.fetch_sub(1, Ordering::AcqRel) == 1 {
            *since = None;
        }
    }

    fn any(&self) -> bool {
        self.batches.load(Ordering::Acquire) > 0
    }

    fn waited(&self) -> Option<Duration> {
        let since = *self.since.lock().unwrap_or_else(PoisonError::into_inner);
        since.filter(|_| self.any()).map(|since| since.elapsed())
    }
}

/// How often parked rows that no ack will free are looked for.
const PARKED_SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// Rows one statement sets waiting behind their aggregate's waiting row.
const FOLLOWERS_PER_STATEMENT: u32 = 5_000;

/// Sets waiting the rows behind their aggregate's row that waits on a
/// paused target (MySQL and MariaDB), a statement at a time until one
/// finds fewer than it may take, at most 20 of them a sweep.
async fn park_followers(store: &crate::store::OutboxStore) {
    let mut parked = 0;
    for _ in 0..20 {
        match store.park_followers(FOLLOWERS_PER_STATEMENT).await {
            Ok(moved) => {
                parked += moved;
                if moved < u64::from(FOLLOWERS_PER_STATEMENT) {
                    break;
                }
            }
            Err(error) => {
                warn!(%error, "Setting rows waiting behind their aggregate's waiting row failed; will try again.");
                break;
            }
        }
    }
    if parked > 0 {
        info!(
            parked,
            "Rows behind a row waiting on a paused target wait with it."
        );
    }
}

/// The backstop behind parking: now and then, parked rows whose
/// predecessors are all gone without an ack (`dlq purge`, a delete by hand)
/// go back to the queue.
async fn sweep_parked(store: crate::store::OutboxStore, wake: Arc<Notify>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(PARKED_SWEEP_INTERVAL) => {}
            () = shutdown.cancelled() => return,
        }
        park_followers(&store).await;
        match store.unpark_stranded(1000).await {
            Ok(0) => {}
            Ok(moved) => {
                info!(
                    moved,
                    "Parked rows whose predecessors are gone went back to the queue."
                );
                wake.notify_one();
            }
            Err(error) => warn!(%error, "Looking for stranded parked rows failed; will try again."),
        }
    }
}
