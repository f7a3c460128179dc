//! The workers and their supervisor: each worker claims and processes
//! batches until shutdown, waiting for a wake-up when there is nothing to
//! do; a panicking batch is caught, and a worker that ends anyway is
//! replaced. At shutdown running batches get `shutdown_timeout_ms` to finish.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

use super::Relay;

impl Relay {
    /// Relays until `shutdown` is cancelled, then stops claiming, lets running
    /// batches finish within `shutdown_timeout_ms` and releases what is left.
    ///
    /// # Errors
    /// Only if the leases could not be released at the end; transient database
    /// and broker errors are retried inside.
    pub async fn run(&self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let wake = self.inner.wake.clone();
        self.wake_rows_waiting_on_targets().await;
        // Ended with this future even when it is dropped rather than shut
        // down: a detached listener or sweeper would outlive its relay.
        // In replication mode `migrate` turns the per-commit NOTIFY off
        // (commits reach the feed, which wakes a worker when it hands rows
        // over); what is heard then is an ack that freed a parked row.
        // Without LISTEN (a connection budget too small for it) the poll
        // alone finds new rows.
        // SQLite has no NOTIFY: the poll alone finds new rows there.
        let listener = self
            .inner
            .store
            .postgres()
            .filter(|_| self.inner.listen)
            .map(|pg| {
                let (wake, shutdown) = (wake.clone(), shutdown.clone());
                AbortOnDropHandle::new(tokio::spawn(async move {
                    pg.wake_on_commits(wake, shutdown).await;
                }))
            });
        // A feed that ends on its own (its slot is gone) stops the relay.
        let feed_failed = CancellationToken::new();
        let mut feed = self.spawn_feed(&shutdown, &feed_failed);
        let sweeper = AbortOnDropHandle::new(tokio::spawn(sweep_parked(
            self.inner.store.clone(),
            wake.clone(),
            shutdown.clone(),
        )));
        let waiting_sweeper = AbortOnDropHandle::new(tokio::spawn(super::outage::sweep_waiting(
            std::sync::Arc::downgrade(&self.inner),
            shutdown.clone(),
        )));
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
                () = feed_failed.cancelled() => break,
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
        let feed_error = if feed_failed.is_cancelled() {
            match feed.take() {
                Some(feed) => feed.await.ok().and_then(Result::err),
                None => None,
            }
        } else {
            None
        };
        if let Some(error) = &feed_error {
            tracing::error!(%error, "The replication feed stopped; the relay stops.");
            shutdown.cancel();
        }
        self.stop_workers(workers).await?;
        if let Some(feed) = feed {
            let _ = feed.await;
        }
        if let Some(listener) = listener {
            listener.abort();
        }
        sweeper.abort();
        waiting_sweeper.abort();
        match feed_error {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Lets running batches finish within `shutdown_timeout_ms`, then
    /// releases the leases of those that did not.
    async fn stop_workers(&self, mut workers: JoinSet<()>) -> anyhow::Result<()> {
        let started = Instant::now();
        let bound = Duration::from_millis(self.inner.config.shutdown_timeout_ms);
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
            let released = self.inner.store.release_owner(&self.inner.owner).await?;
            warn!(
                released,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "Relay stopped before batches finished; released their leases."
            );
        }
        Ok(())
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

    /// In replication mode, the task that reads the slot; `failed` is
    /// cancelled when it ends with an error.
    fn spawn_feed(
        &self,
        shutdown: &CancellationToken,
        failed: &CancellationToken,
    ) -> Option<AbortOnDropHandle<anyhow::Result<()>>> {
        let settings = self.inner.replication.clone()?;
        let (relay, shutdown, failed) = (self.clone(), shutdown.clone(), failed.clone());
        Some(AbortOnDropHandle::new(tokio::spawn(async move {
            let result = relay.replicate(settings, shutdown).await;
            if result.is_err() {
                failed.cancel();
            }
            result
        })))
    }

    /// One worker. Wake-ups are handed to one idle worker at a time (a
    /// commit wakes one; a worker that claimed a full batch wakes the next),
    /// so a burst of commits does not send every idle worker into a claim
    /// scan that finds nothing.
    async fn work(&self, worker: u32, wake: Arc<Notify>, shutdown: CancellationToken) {
        let poll = Duration::from_millis(self.inner.config.poll_interval_ms);
        let idle_poll_max = self.inner.config.idle_poll_max();
        let mut idle_poll = crate::backoff::Backoff::new(poll, idle_poll_max).exact();
        let full = usize::try_from(self.inner.config.batch_size).unwrap_or(usize::MAX);
        let mut db_backoff = crate::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        while !shutdown.is_cancelled() {
            // A panicking batch must not take the worker with it.
            let batch = std::panic::AssertUnwindSafe(self.run_once()).catch_unwind().await;
            let batch = match batch {
                Ok(batch) => batch,
                Err(panic) => {
                    self.record_panic(worker, panic.as_ref());
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
                    tokio::select! {
                        () = wake.notified() => idle_poll.reset(),
                        () = tokio::time::sleep(idle_poll.peek()) => {
                            idle_poll.next_pause();
                        }
                        () = shutdown.cancelled() => {}
                    }
                }
                Ok(_) => {
                    db_backoff.reset();
                    tokio::select! {
                        () = wake.notified() => {}
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

/// How often parked rows that no ack will free are looked for.
const PARKED_SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// The backstop behind parking: now and then, parked rows whose
/// predecessors are all gone without an ack (`dlq purge`, a delete by hand)
/// go back to the queue.
async fn sweep_parked(store: crate::store::OutboxStore, wake: Arc<Notify>, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(PARKED_SWEEP_INTERVAL) => {}
            () = shutdown.cancelled() => return,
        }
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
