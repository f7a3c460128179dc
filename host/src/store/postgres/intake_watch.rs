//! Whether the next claim has to move intake rows, from what the LISTEN
//! session heard: a claim without the move starts half the plan (see
//! migration 20261208000000).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// No session listens: nothing says when the intake is written, so every
/// claim moves.
const UNHEARD: u8 = 0;
/// Listening, and no commit to the intake heard since the last move.
const QUIET: u8 = 1;
/// Listening, and a commit heard that may have written the intake.
const HEARD: u8 = 2;

/// A claim moves at least this often even when nothing was heard: rows
/// that reached the intake without its trigger (loaded with triggers off)
/// are moved within it.
const MOVE_AT_LEAST_EVERY: Duration = Duration::from_secs(1);

/// What the listener heard about the intake, shared with the claims.
#[derive(Debug)]
pub(super) struct IntakeWatch {
    state: AtomicU8,
    last_move: Mutex<Instant>,
}

impl Default for IntakeWatch {
    fn default() -> IntakeWatch {
        IntakeWatch {
            state: AtomicU8::new(UNHEARD),
            last_move: Mutex::new(Instant::now()),
        }
    }
}

impl IntakeWatch {
    /// A session listens (again): what was committed while none did is
    /// unknown, so the next claim moves.
    pub(super) fn listening(&self) {
        self.state.store(HEARD, Ordering::Release);
    }

    /// The session is lost: every claim moves until one listens again.
    pub(super) fn deaf(&self) {
        self.state.store(UNHEARD, Ordering::Release);
    }

    /// A notification's payload: only 'outbox' says the intake was not
    /// written.
    pub(super) fn heard(&self, payload: &str) {
        if payload != "outbox" {
            let _ = self
                .state
                .compare_exchange(QUIET, HEARD, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Whether the claim about to start moves intake rows. Called before
    /// its statement is sent: a commit heard from now on sets it again.
    pub(super) fn claim_moves(&self) -> bool {
        let mut last_move = self.last_move.lock().unwrap_or_else(PoisonError::into_inner);
        let moves = match self.state.load(Ordering::Acquire) {
            QUIET => last_move.elapsed() >= MOVE_AT_LEAST_EVERY,
            HEARD => {
                let _ = self
                    .state
                    .compare_exchange(HEARD, QUIET, Ordering::AcqRel, Ordering::Acquire);
                true
            }
            _ => true,
        };
        if moves {
            *last_move = Instant::now();
        }
        moves
    }

    /// A moving claim moved rows, or saw another claim moving: the intake
    /// may hold more, so the next claim moves too.
    pub(super) fn moved(&self) {
        let _ = self
            .state
            .compare_exchange(QUIET, HEARD, Ordering::AcqRel, Ordering::Acquire);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_move_unless_a_listener_heard_only_the_outbox() {
        let watch = IntakeWatch::default();
        assert!(watch.claim_moves(), "nobody listens");
        assert!(watch.claim_moves(), "still nobody listens");
        watch.listening();
        assert!(watch.claim_moves(), "what came before listening is unknown");
        assert!(!watch.claim_moves());
        watch.heard("outbox");
        assert!(!watch.claim_moves());
        watch.heard("intake");
        assert!(watch.claim_moves());
        assert!(!watch.claim_moves());
        watch.heard("");
        assert!(watch.claim_moves(), "an older schema's payload");
        watch.moved();
        assert!(
            watch.claim_moves(),
            "a move that found rows: the intake may hold more"
        );
        watch.deaf();
        assert!(watch.claim_moves());
        assert!(watch.claim_moves());
    }

    #[test]
    fn a_quiet_watch_still_moves_now_and_then() {
        let watch = IntakeWatch::default();
        watch.listening();
        assert!(watch.claim_moves());
        let mut last_move = watch.last_move.lock().unwrap();
        *last_move = last_move.checked_sub(MOVE_AT_LEAST_EVERY).unwrap();
        drop(last_move);
        assert!(watch.claim_moves());
        assert!(!watch.claim_moves());
    }
}
