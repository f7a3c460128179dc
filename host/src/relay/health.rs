//! What the workers report about themselves: batches that panicked (for
//! `/readyz`) and the throttle on statistics refreshes after slow claims.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long `/readyz` stays unready after a batch panicked.
pub(super) const PANIC_UNREADY_FOR: Duration = Duration::from_secs(60);

/// Least time between two statistics refreshes triggered by slow claims.
pub(super) const ANALYZE_INTERVAL: Duration = Duration::from_secs(60);

/// Shared by a relay's workers.
#[derive(Default)]
pub(super) struct WorkerHealth {
    last_panic: Mutex<Option<(Instant, String)>>,
    last_analyze: Mutex<Option<Instant>>,
}

/// A batch panicked lately: the workers are unready for a while.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a batch panicked {seconds_ago} s ago: {message}")]
pub struct RecentPanic {
    /// How long ago.
    pub seconds_ago: u64,
    /// What the panic said.
    pub message: String,
}

/// What a panic said, when it said it with a string.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_string())
}

impl WorkerHealth {
    /// Remembers a panic for readiness; returns its message.
    pub(super) fn panicked(&self, panic: &(dyn std::any::Any + Send)) -> String {
        let message = panic_message(panic);
        if let Ok(mut last) = self.last_panic.lock() {
            *last = Some((Instant::now(), message.clone()));
        }
        message
    }

    /// `Err` with the latest panic while one happened within [`PANIC_UNREADY_FOR`].
    pub(super) fn check(&self) -> Result<(), RecentPanic> {
        let last = match self.last_panic.lock() {
            Ok(last) => last.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        match last {
            Some((at, message)) if at.elapsed() < PANIC_UNREADY_FOR => Err(RecentPanic {
                seconds_ago: at.elapsed().as_secs(),
                message,
            }),
            _ => Ok(()),
        }
    }

    /// Whether a statistics refresh is due now (and, if so, counts it as done).
    pub(super) fn analyze_due(&self) -> bool {
        match self.last_analyze.lock() {
            Ok(mut last) => {
                let due = last.is_none_or(|at| at.elapsed() >= ANALYZE_INTERVAL);
                if due {
                    *last = Some(Instant::now());
                }
                due
            }
            Err(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_makes_the_workers_unready_with_its_message() {
        let health = WorkerHealth::default();
        assert_eq!(health.check(), Ok(()));
        let panic: Box<dyn std::any::Any + Send> = Box::new(String::from("index out of bounds"));
        assert_eq!(health.panicked(panic.as_ref()), "index out of bounds");
        let unready = health.check().unwrap_err();
        assert_eq!(unready.message, "index out of bounds");
        assert!(unready.to_string().contains("index out of bounds"), "{unready}");
    }

    #[test]
    fn statistics_are_refreshed_at_most_once_per_interval() {
        let health = WorkerHealth::default();
        assert!(health.analyze_due());
        assert!(!health.analyze_due());
    }
}
