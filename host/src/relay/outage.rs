//! Paused targets: a target that cannot be reached is paused instead of
//! being tried row by row. Nothing more is sent to it; its rows wait in the
//! table without spending attempts; a probe runs its health check several
//! times a second and, once it passes, wakes the waiting rows so the
//! backlog drains at full speed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use tracing::{info, warn};

use super::Inner;

/// How often a paused target's health check runs.
const PROBE_INTERVAL: Duration = Duration::from_millis(250);

/// The bound on one probe: a target that answers slower is not back.
/// Longer than the sinks' own check bounds (Kafka's is 2.5 s), so that a
/// check ends by itself rather than being dropped.
const PROBE_TIMEOUT: Duration = Duration::from_secs(4);

/// How often a probe that cannot reach the database tries to wake the rows again.
const WAKE_RETRY: Duration = Duration::from_millis(500);
/// The longest pause between two tries at that.
const WAKE_RETRY_MAX: Duration = Duration::from_secs(5);

/// A target paused now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paused {
    /// Since when (wall clock).
    pub since: SystemTime,
    /// The failure that paused it.
    pub reason: String,
    /// Sends refused without being tried since it was paused.
    pub held_back: u64,
}

/// The paused targets of one relay.
#[derive(Default)]
pub(super) struct Outages {
    paused: Mutex<BTreeMap<String, (Instant, Paused)>>,
}

impl Outages {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (Instant, Paused)>> {
        self.paused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Why `target` is paused, when it is; counts the send held back.
    pub(super) fn hold_back(&self, target: &str) -> Option<String> {
        let mut paused = self.lock();
        let (since, state) = paused.get_mut(target)?;
        state.held_back += 1;
        Some(format!(
            "target {target:?} is paused (unreachable for {} s: {}); the row waits for it",
            since.elapsed().as_secs(),
            state.reason
        ))
    }

    /// Whether `target` is paused.
    fn is_paused(&self, target: &str) -> bool {
        self.lock().contains_key(target)
    }

    /// Pauses `target`; true when it was not paused yet.
    fn pause(&self, target: &str, reason: &str) -> bool {
        let mut paused = self.lock();
        if paused.contains_key(target) {
            return false;
        }
        let state = Paused {
            since: SystemTime::now(),
            reason: reason.to_string(),
            held_back: 0,
        };
        paused.insert(target.to_string(), (Instant::now(), state));
        true
    }

    /// Resumes `target`; how long it was paused and how many sends were held back.
    fn resume(&self, target: &str) -> Option<(Duration, u64)> {
        self.lock()
            .remove(target)
            .map(|(since, state)| (since.elapsed(), state.held_back))
    }

    /// Every paused target.
    pub(super) fn snapshot(&self) -> BTreeMap<String, Paused> {
        self.lock()
            .iter()
            .map(|(name, (_, state))| (name.clone(), state.clone()))
            .collect()
    }
}

impl super::Relay {
    /// Pauses `target` after a failure that says it cannot be reached, and
    /// starts its probe. A target already paused is left as it is.
    pub(super) fn pause_target(&self, target: &str, reason: &str) {
        let inner = &self.inner;
        if !inner.outages.pause(target, reason) {
            return;
        }
        warn!(
            sink.name = %target,
            error = %reason,
            "Target unreachable: paused. Its rows wait in the outbox without spending attempts; probing it until it is back."
        );
        inner.metrics.set_target_paused(target, true);
        tokio::spawn(probe(Arc::downgrade(&self.inner), target.to_string()));
    }

    /// The targets paused now.
    pub fn paused_targets(&self) -> BTreeMap<String, Paused> {
        self.inner.outages.snapshot()
    }
}

/// Runs `target`'s health check until it passes, then resumes the target
/// and wakes its rows. Ends with the relay (it holds no strong reference).
async fn probe(relay: Weak<Inner>, target: String) {
    loop {
        tokio::time::sleep(PROBE_INTERVAL).await;
        let Some(inner) = relay.upgrade() else { return };
        let Some(sink) = inner.sinks.get(&target).cloned() else {
            return;
        };
        drop(inner);
        if let Ok(Ok(())) = tokio::time::timeout(PROBE_TIMEOUT, sink.healthcheck()).await {
            break;
        }
    }
    let Some(inner) = relay.upgrade() else { return };
    let Some((paused_for, held_back)) = inner.outages.resume(&target) else {
        return;
    };
    inner.metrics.set_target_paused(&target, false);
    // Woken rows are claimable at once; tell the workers before the wake
    // is done, so the first rows go while later ones are still being woken.
    inner.wake.notify_waiters();
    let woken = wake(&inner, Some(&target)).await;
    info!(
        sink.name = %target,
        paused_s = paused_for.as_secs(),
        held_back,
        woken,
        "Target reachable again: resumed; its waiting rows are due now."
    );
    inner.wake.notify_waiters();
}

/// How often every relay looks for rows waiting on targets it has not
/// paused itself.
const WAITING_SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// The backstop behind the probe: rows wait, out of the queue, until a
/// relay wakes them, and the relay that paused their target may have died
/// meanwhile. Every relay, now and then, health-checks each target that
/// has waiting rows and that it has not paused, and wakes them when it
/// passes. A relay that has it paused leaves it to its probe.
pub(super) async fn sweep_waiting(relay: Weak<Inner>, shutdown: tokio_util::sync::CancellationToken) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(WAITING_SWEEP_INTERVAL) => {}
            () = shutdown.cancelled() => return,
        }
        let Some(inner) = relay.upgrade() else { return };
        let targets = match inner.store.waiting_by_target().await {
            Ok(targets) => targets,
            Err(error) => {
                warn!(%error, "Looking for rows waiting on targets failed; will try again.");
                continue;
            }
        };
        for target in targets.keys() {
            let Some(sink) = inner.sinks.get(target).cloned() else {
                continue;
            };
            if inner.outages.is_paused(target) {
                continue;
            }
            if let Ok(Ok(())) = tokio::time::timeout(PROBE_TIMEOUT, sink.healthcheck()).await {
                let woken = wake(&inner, Some(target)).await;
                info!(sink.name = %target, woken, "Rows waiting on a target that is up are due now.");
                inner.wake.notify_waiters();
            }
        }
    }
}

/// Sets the rows waiting on `target` (on any target when `None`) due,
/// trying again while the database cannot be reached; how many.
pub(super) async fn wake(inner: &Inner, target: Option<&str>) -> u64 {
    let pause = crate::backoff::Backoff::new(WAKE_RETRY, WAKE_RETRY_MAX);
    let (woken, waited) = crate::backoff::until_ok(
        pause,
        || inner.store.wake_waiting(target),
        |error, failures| {
            if failures == 1 {
                warn!(%error, sink.name = target, "Waking the rows that wait on a target failed; trying again.");
            }
        },
    )
    .await;
    if let Some(waited) = waited {
        info!(
            sink.name = target,
            waited_ms = waited.as_millis() as u64,
            "Woke the rows that wait on a target."
        );
    }
    woken
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_target_is_paused_once_and_counts_what_it_held_back() {
        let outages = Outages::default();
        assert_eq!(outages.hold_back("kafka"), None);
        assert!(outages.pause("kafka", "all brokers down"));
        assert!(!outages.pause("kafka", "again"));
        let why = outages.hold_back("kafka").unwrap();
        assert!(why.contains("all brokers down"), "{why}");
        outages.hold_back("kafka");
        assert_eq!(outages.snapshot()["kafka"].held_back, 2);
        assert_eq!(outages.snapshot()["kafka"].reason, "all brokers down");
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(outages.resume("kafka"), Some((Duration::from_secs(90), 2)));
        assert!(outages.snapshot().is_empty());
        assert_eq!(outages.resume("kafka"), None);
    }
}
