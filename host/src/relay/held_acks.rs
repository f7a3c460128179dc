//! Batch outcomes held back briefly to ride with the next claim, so that
//! at service rates (each event its own batch) a claim and the previous
//! batch's ack cost the database one round trip, not two.
//!
//! Whichever worker claims next takes them; the worker that held them
//! sends them alone if no claim comes within the delay. A claim that parked
//! a row behind an unfinished one means an event waits for an ack: no
//! batch claimed before it holds its outcomes, so the ack that frees the
//! row is not held back (rows parked by another relay's claim can wait up
//! to the delay).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::store::{LeaseId, RowOutcome};

/// A batch's outcomes waiting for a claim to carry them.
#[derive(Debug)]
pub(super) struct HeldAck {
    pub(super) lease: LeaseId,
    pub(super) outcomes: Vec<RowOutcome>,
    since: Instant,
}

/// The outcomes held; none when `delay` is zero.
#[derive(Debug)]
pub(super) struct HeldAcks {
    delay: Duration,
    held: Mutex<Vec<HeldAck>>,
    /// When a claim last parked rows.
    parked: Mutex<Option<Instant>>,
}

impl HeldAcks {
    pub(super) fn new(delay: Duration) -> HeldAcks {
        HeldAcks {
            delay,
            held: Mutex::new(Vec::new()),
            parked: Mutex::new(None),
        }
    }

    /// A claim parked rows behind unfinished ones just now.
    pub(super) fn saw_parked(&self) {
        *self
            .parked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
    }

    /// Holds the outcomes of a batch claimed at `claimed_at`, if acks wait
    /// at all and no claim parked rows since (they may wait behind this
    /// batch); otherwise gives them back, to be sent at once.
    pub(super) fn hold(
        &self,
        lease: LeaseId,
        outcomes: Vec<RowOutcome>,
        claimed_at: Instant,
    ) -> Option<Vec<RowOutcome>> {
        let parked = *self
            .parked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.delay.is_zero() || parked.is_some_and(|parked| parked >= claimed_at) {
            return Some(outcomes);
        }
        self.lock().push(HeldAck {
            lease,
            outcomes,
            since: Instant::now(),
        });
        None
    }

    /// Everything held, the oldest first; each is taken once.
    pub(super) fn take_all(&self) -> Vec<HeldAck> {
        std::mem::take(&mut *self.lock())
    }

    /// How long until the oldest held outcomes are due to go alone; `None`
    /// when nothing is held.
    pub(super) fn due_in(&self) -> Option<Duration> {
        self.lock()
            .first()
            .map(|oldest| self.delay.saturating_sub(oldest.since.elapsed()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<HeldAck>> {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Outcome, RowId};

    fn outcomes(id: i64) -> Vec<RowOutcome> {
        vec![RowOutcome {
            id: RowId(id),
            outcome: Outcome::Published,
            deliveries: Default::default(),
            plugin_version: None,
        }]
    }

    #[test]
    fn without_a_delay_nothing_is_held() {
        let acks = HeldAcks::new(Duration::ZERO);
        let lease = LeaseId(uuid::Uuid::new_v4());
        assert!(acks.hold(lease, outcomes(1), Instant::now()).is_some());
        assert!(acks.take_all().is_empty());
        assert_eq!(acks.due_in(), None);
    }

    #[test]
    fn held_outcomes_are_taken_once_oldest_first_and_fall_due_after_the_delay() {
        let acks = HeldAcks::new(Duration::from_millis(40));
        let (first, second) = (LeaseId(uuid::Uuid::new_v4()), LeaseId(uuid::Uuid::new_v4()));
        assert!(acks.hold(first, outcomes(1), Instant::now()).is_none());
        let due = acks.due_in().expect("held");
        assert!(
            due > Duration::from_millis(20) && due <= Duration::from_millis(40),
            "{due:?}"
        );
        std::thread::sleep(Duration::from_millis(45));
        assert!(acks.hold(second, outcomes(2), Instant::now()).is_none());
        // The oldest sets the time: it is due now.
        assert_eq!(acks.due_in(), Some(Duration::ZERO));
        let taken = acks.take_all();
        assert_eq!(taken.iter().map(|a| a.lease).collect::<Vec<_>>(), [first, second]);
        assert!(acks.take_all().is_empty());
        assert_eq!(acks.due_in(), None);
    }

    #[test]
    fn a_batch_claimed_before_a_claim_parked_rows_is_not_held() {
        let acks = HeldAcks::new(Duration::from_millis(40));
        let claimed_before = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        acks.saw_parked();
        let lease = LeaseId(uuid::Uuid::new_v4());
        assert!(
            acks.hold(lease, outcomes(1), claimed_before).is_some(),
            "a parked row may wait behind it"
        );
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            acks.hold(lease, outcomes(2), Instant::now()).is_none(),
            "claimed after: held"
        );
    }
}
