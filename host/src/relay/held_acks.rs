//! Batch outcomes held back briefly to ride with the next claim, so that
//! at service rates (each event its own batch) a claim and the previous
//! batch's ack cost the database one round trip, not two.
//!
//! Whichever worker claims next takes them; the worker that held them
//! sends them alone if no claim comes within the delay. A claim that parked
//! a row behind an unfinished one means an event waits for an ack: no
//! batch claimed before it holds its outcomes, so the ack that frees the
//! row is not held back (rows parked by another relay's claim can wait up
//! to the delay). Only a batch alone in flight holds its outcomes: where
//! batches overlap (higher rates) the next claim comes at once anyway, and
//! an ack carried in front of it would only delay its events.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// Batches between their claim and their outcomes.
    in_flight: AtomicUsize,
}

/// A batch in flight, counted until it is dropped.
pub(super) struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl HeldAcks {
    pub(super) fn new(delay: Duration) -> HeldAcks {
        HeldAcks {
            delay,
            held: Mutex::new(Vec::new()),
            parked: Mutex::new(None),
            in_flight: AtomicUsize::new(0),
        }
    }

    /// Counts a claimed batch as in flight while the guard lives.
    pub(super) fn batch_started(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(&self.in_flight)
    }

    /// A claim parked rows behind unfinished ones just now.
    pub(super) fn saw_parked(&self) {
        *self
            .parked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
    }

    /// Holds the outcomes of a batch claimed at `claimed_at`, to be
    /// recorded by `ack_by` (its lease ends after that), if acks wait at
    /// all, the delay ends before `ack_by`, it is the only batch in flight,
    /// and no claim parked rows since it was claimed (they may wait behind
    /// it); otherwise gives them back, to be sent at once.
    pub(super) fn hold(
        &self,
        lease: LeaseId,
        outcomes: Vec<RowOutcome>,
        claimed_at: Instant,
        ack_by: Instant,
    ) -> Option<Vec<RowOutcome>> {
        let parked = *self
            .parked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.delay.is_zero()
            || self.in_flight.load(Ordering::Acquire) > 1
            || Instant::now() + self.delay >= ack_by
            || parked.is_some_and(|parked| parked >= claimed_at)
        {
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

    /// A lease end far off.
    fn later() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

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
        assert!(acks.hold(lease, outcomes(1), Instant::now(), later()).is_some());
        assert!(acks.take_all().is_empty());
        assert_eq!(acks.due_in(), None);
    }

    #[test]
    fn held_outcomes_are_taken_once_oldest_first_and_fall_due_after_the_delay() {
        let acks = HeldAcks::new(Duration::from_millis(40));
        let (first, second) = (LeaseId(uuid::Uuid::new_v4()), LeaseId(uuid::Uuid::new_v4()));
        assert!(acks.hold(first, outcomes(1), Instant::now(), later()).is_none());
        let due = acks.due_in().expect("held");
        assert!(
            due > Duration::from_millis(20) && due <= Duration::from_millis(40),
            "{due:?}"
        );
        std::thread::sleep(Duration::from_millis(45));
        assert!(acks.hold(second, outcomes(2), Instant::now(), later()).is_none());
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
            acks.hold(lease, outcomes(1), claimed_before, later()).is_some(),
            "a parked row may wait behind it"
        );
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            acks.hold(lease, outcomes(2), Instant::now(), later()).is_none(),
            "claimed after: held"
        );
    }

    #[test]
    fn a_batch_is_held_only_while_alone_in_flight() {
        let acks = HeldAcks::new(Duration::from_millis(40));
        let lease = LeaseId(uuid::Uuid::new_v4());
        let this = acks.batch_started();
        {
            let _other = acks.batch_started();
            assert!(acks.hold(lease, outcomes(1), Instant::now(), later()).is_some());
        }
        assert!(acks.hold(lease, outcomes(1), Instant::now(), later()).is_none());
        drop(this);
    }

    #[test]
    fn outcomes_due_before_the_delay_ends_are_not_held() {
        let acks = HeldAcks::new(Duration::from_millis(40));
        let lease = LeaseId(uuid::Uuid::new_v4());
        let soon = Instant::now() + Duration::from_millis(30);
        assert!(acks.hold(lease, outcomes(1), Instant::now(), soon).is_some());
    }
}
