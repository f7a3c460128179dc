//! Retry policy: how long a failed row waits, when it is given up, which
//! failures are the event's own, and how a spent lease is explained.

use std::time::Duration;

use crate::config::{FailurePolicy, RelayConfig};
use crate::store::Outcome;

/// How long a row waiting on a paused target stays out of the queue if no
/// relay wakes it: in practice until one does (the relay that paused the
/// target when it is back, or any relay's sweep of waiting rows). A recheck
/// that made waiting rows due again would claim every one of them anew,
/// each time, for as long as the outage lasts.
pub const OUTAGE_RECHECK: Duration = Duration::from_secs(7 * 24 * 3600);

/// When a failed row is tried again, and when it is dead-lettered instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts before a row is dead-lettered.
    pub max_attempts: u32,
    /// Backoff after the first failure.
    pub initial_backoff: Duration,
    /// Upper bound of the backoff.
    pub max_backoff: Duration,
    /// Which failures spend an attempt.
    pub failures: FailurePolicy,
}

impl RetryPolicy {
    /// The policy a relay config asks for.
    pub fn from_config(config: &RelayConfig) -> RetryPolicy {
        RetryPolicy {
            max_attempts: config.max_attempts,
            initial_backoff: Duration::from_millis(config.initial_backoff_ms),
            max_backoff: Duration::from_millis(config.max_backoff_ms),
            failures: config.failures,
        }
    }

    /// The outcome of a row that cannot go on because `targets` are paused:
    /// it waits for them without spending its attempt.
    pub fn wait_for_targets(&self, targets: Vec<String>, reason: String) -> Outcome {
        Outcome::Defer {
            after: OUTAGE_RECHECK,
            reason,
            waiting_on: targets,
        }
    }

    /// The outcome of a failure that is nobody's attempt but pauses no
    /// target (an unknown topic, refused access): tried again after a delay
    /// that grows with the row's age, a quarter of it, within the backoff
    /// bounds, so a long wait is not a busy one.
    pub fn wait(&self, age: Duration, reason: String) -> Outcome {
        let quarter = (age / 4).clamp(self.initial_backoff, self.max_backoff.max(self.initial_backoff));
        Outcome::Defer {
            after: crate::backoff::spread(quarter),
            reason,
            waiting_on: Vec::new(),
        }
    }

    /// The outcome of a retryable failure on attempt number `attempts`:
    /// another try after a backoff, or dead once the attempts are used up.
    pub fn after_failure(&self, attempts: u32, error: String) -> Outcome {
        if attempts >= self.max_attempts {
            Outcome::Dead {
                error: format!("gave up after {attempts} attempts: {error}"),
            }
        } else {
            Outcome::Retry {
                after: backoff(self.initial_backoff, self.max_backoff, attempts),
                error,
            }
        }
    }

    /// The outcome of a row the lease ran out on before `stage` (see
    /// [`lease_spent`]). A slow claim is the database's doing, not the
    /// row's: the row is deferred without spending an attempt, so a slow
    /// database (a drain after an outage) never dead-letters an event.
    /// Slow plugins spend one, as a failed call does.
    pub fn after_spent_lease(
        &self,
        attempts: u32,
        claim_took: Duration,
        lease: Duration,
        reserved: Duration,
        stage: &str,
    ) -> Outcome {
        let why = lease_spent(claim_took, lease, reserved, stage);
        if claim_to_blame(claim_took, lease, reserved) {
            Outcome::Defer {
                after: backoff(self.initial_backoff, self.max_backoff, 1),
                reason: why,
                waiting_on: Vec::new(),
            }
        } else {
            self.after_failure(attempts, why)
        }
    }
}

/// Whether the claim took half of what the lease left before the stage.
pub(super) fn claim_to_blame(claim_took: Duration, lease: Duration, reserved: Duration) -> bool {
    claim_took * 2 >= lease.saturating_sub(reserved)
}

/// Exponential backoff with jitter: `initial * 2^(attempt-1)`, capped, then a
/// random point in its upper half so that retries of many rows spread out.
pub fn backoff(initial: Duration, max: Duration, attempt: u32) -> Duration {
    let initial_ms = u64::try_from(initial.as_millis()).unwrap_or(u64::MAX);
    let max_ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX);
    let exponent = attempt.saturating_sub(1).min(32);
    let full = initial_ms.saturating_mul(1u64 << exponent).min(max_ms);
    crate::backoff::spread(Duration::from_millis(full))
}

/// Why a batch ran out of lease before `stage`: the claim statement itself
/// (a slow database) or the plugin calls. Blaming the plugins for a slow
/// claim sends operators to the wrong place. `reserved` is what the lease
/// keeps after the stage (the publish timeout and the ack's reserve): the
/// claim is to blame when it took half of what was left before.
pub fn lease_spent(claim_took: Duration, lease: Duration, reserved: Duration, stage: &str) -> String {
    if claim_to_blame(claim_took, lease, reserved) {
        format!(
            "lease nearly expired before {stage}: the claim statement took {} ms, and the {} ms lease keeps {} ms \
             of it for publishing and the ack (database slow)",
            claim_took.as_millis(),
            lease.as_millis(),
            reserved.as_millis()
        )
    } else {
        format!("lease nearly expired before {stage} (plugins too slow for the lease)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: RetryPolicy = RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(5_000),
        failures: FailurePolicy::DEFAULT,
    };

    #[test]
    fn a_wait_grows_with_the_rows_age_within_the_backoff_bounds() {
        let after = |age_ms| match POLICY.wait(Duration::from_millis(age_ms), "no stream".into()) {
            Outcome::Defer {
                after, waiting_on, ..
            } => {
                assert!(waiting_on.is_empty());
                after
            }
            other => panic!("{other:?}"),
        };
        for _ in 0..50 {
            assert!(after(0) <= Duration::from_millis(100));
            let young = after(4_000);
            assert!(
                (Duration::from_millis(500)..=Duration::from_millis(1_000)).contains(&young),
                "{young:?}"
            );
            let old = after(3_600_000);
            assert!(
                (Duration::from_millis(2_500)..=Duration::from_millis(5_000)).contains(&old),
                "{old:?}"
            );
        }
    }

    #[test]
    fn a_slow_claim_is_not_blamed_on_the_plugins() {
        let (lease, reserved) = (Duration::from_secs(30), Duration::from_secs(11));
        let slow = lease_spent(Duration::from_secs(20), lease, reserved, "routing");
        assert!(
            slow.contains("claim statement took 20000 ms, and the 30000 ms lease keeps 11000 ms"),
            "{slow}"
        );
        assert!(!slow.contains("plugins"), "{slow}");
        let plugins = lease_spent(Duration::from_millis(5), lease, reserved, "publishing");
        assert!(plugins.contains("plugins too slow"), "{plugins}");
    }

    /// A claim that took less than half the lease can still have spent
    /// most of what the lease leaves before publishing: 1.6 s of a 4 s
    /// lease that keeps 2 s for the publish timeout and 1 s for the ack.
    #[test]
    fn a_claim_that_spent_the_routing_budget_is_blamed() {
        let (lease, reserved) = (Duration::from_secs(4), Duration::from_secs(3));
        let slow = lease_spent(Duration::from_millis(1_600), lease, reserved, "routing");
        assert!(slow.contains("database slow"), "{slow}");
        let plugins = lease_spent(Duration::from_millis(300), lease, reserved, "routing");
        assert!(plugins.contains("plugins too slow"), "{plugins}");
    }

    /// A drain after an outage can make claims slow; the rows they took
    /// too late must not spend attempts, or an event on its last attempt
    /// would be dead-lettered for the database's slowness.
    #[test]
    fn a_lease_spent_by_a_slow_claim_spends_no_attempt_and_never_dead_letters() {
        let (lease, reserved) = (Duration::from_secs(4), Duration::from_secs(3));
        let slow = POLICY.after_spent_lease(
            POLICY.max_attempts,
            Duration::from_millis(1_600),
            lease,
            reserved,
            "routing",
        );
        match slow {
            Outcome::Defer {
                reason, waiting_on, ..
            } => {
                assert!(reason.contains("database slow"), "{reason}");
                assert!(waiting_on.is_empty(), "it waits for no target");
            }
            other => panic!("deferred, not charged: {other:?}"),
        }
        let plugins = POLICY.after_spent_lease(1, Duration::from_millis(300), lease, reserved, "routing");
        assert!(matches!(plugins, Outcome::Retry { .. }), "{plugins:?}");
        let last = POLICY.after_spent_lease(
            POLICY.max_attempts,
            Duration::from_millis(300),
            lease,
            reserved,
            "routing",
        );
        assert!(matches!(last, Outcome::Dead { .. }), "{last:?}");
    }

    #[test]
    fn backoff_doubles_within_its_cap_with_jitter_in_the_upper_half() {
        let (initial, max) = (Duration::from_millis(100), Duration::from_millis(5_000));
        for attempt in 1..=12 {
            let full = (100u64 << (attempt - 1)).min(5_000);
            for _ in 0..50 {
                let delay = backoff(initial, max, attempt).as_millis() as u64;
                assert!(
                    (full / 2..=full).contains(&delay),
                    "attempt {attempt}: {delay} ms"
                );
            }
        }
        assert!(backoff(initial, max, u32::MAX).as_millis() <= 5_000);
        assert_eq!(backoff(Duration::ZERO, max, 4), Duration::ZERO);
    }

    #[test]
    fn failures_are_retried_until_the_last_attempt_then_dead() {
        for attempts in 1..3 {
            match POLICY.after_failure(attempts, "broker down".into()) {
                Outcome::Retry { after, error } => {
                    assert_eq!(error, "broker down");
                    assert!(after <= Duration::from_millis(100 << (attempts - 1)), "{after:?}");
                }
                other => panic!("attempt {attempts}: {other:?}"),
            }
        }
        for attempts in [3, 4, u32::MAX] {
            match POLICY.after_failure(attempts, "broker down".into()) {
                Outcome::Dead { error } => {
                    assert_eq!(error, format!("gave up after {attempts} attempts: broker down"));
                }
                other => panic!("attempt {attempts}: {other:?}"),
            }
        }
    }
}
