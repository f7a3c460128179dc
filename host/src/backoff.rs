//! The pause between tries of something that does not answer yet (the
//! database, a broker, the slot, LISTEN): doubling after each failure up to
//! a cap, back to the first after a success. Every retry-until-it-answers
//! loop in the relay takes its pauses from one of these.

use std::time::Duration;

/// A doubling pause, capped.
#[derive(Debug, Clone, Copy)]
pub struct Doubling {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Doubling {
    /// Pauses of `first`, then twice as long each time, at most `max`.
    #[must_use]
    pub const fn new(first: Duration, max: Duration) -> Doubling {
        Doubling {
            first,
            max,
            next: first,
        }
    }

    /// The pause to take now; the next one is twice as long, up to the cap.
    pub fn next_pause(&mut self) -> Duration {
        let now = self.next;
        self.next = (self.next * 2).min(self.max);
        now
    }

    /// The pause [`Doubling::next_pause`] would give, without moving on.
    #[must_use]
    pub const fn peek(&self) -> Duration {
        self.next
    }

    /// After a success: the next pause is the first again.
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_its_cap_and_starts_over_after_a_reset() {
        let mut pause = Doubling::new(Duration::from_millis(100), Duration::from_millis(500));
        let taken: Vec<u128> = (0..5).map(|_| pause.next_pause().as_millis()).collect();
        assert_eq!(taken, [100, 200, 400, 500, 500]);
        assert_eq!(pause.peek(), Duration::from_millis(500));
        pause.reset();
        assert_eq!(pause.next_pause(), Duration::from_millis(100));
    }
}
