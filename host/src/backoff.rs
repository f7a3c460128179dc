//! The pause between tries of something that does not answer yet (the
//! database, a broker, the slot, LISTEN): doubling after each failure up to
//! a cap, back to the first after a success. Every retry-until-it-answers
//! loop in the relay takes its pauses from one of these, and the loops that
//! must not give up (recording what was published) are [`until_ok`].

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

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

/// Runs `attempt` until it succeeds, pausing by `pause` after each failure;
/// `failed` hears each error with the count of failures so far (1 the
/// first time: where to warn once). Returns the value, and how long it was
/// waited for when the first attempt failed.
pub async fn until_ok<T, E, F, Fut>(
    mut pause: Doubling,
    mut attempt: F,
    mut failed: impl FnMut(&E, u32),
) -> (T, Option<Duration>)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut failures = 0;
    let mut since = None;
    loop {
        match attempt().await {
            Ok(value) => return (value, since.map(|since: Instant| since.elapsed())),
            Err(error) => {
                failures += 1;
                since.get_or_insert_with(Instant::now);
                failed(&error, failures);
                tokio::time::sleep(pause.next_pause()).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn until_ok_pauses_doubling_and_says_how_long_it_waited() {
        let mut tries = 0;
        let mut heard = Vec::new();
        let (value, waited) = until_ok(
            Doubling::new(Duration::from_millis(100), Duration::from_millis(300)),
            || {
                tries += 1;
                let now = tries;
                async move { if now < 5 { Err(now) } else { Ok("answered") } }
            },
            |error, failures| heard.push((*error, failures)),
        )
        .await;
        assert_eq!(value, "answered");
        assert_eq!(heard, [(1, 1), (2, 2), (3, 3), (4, 4)]);
        // 100 + 200 + 300 + 300 ms of pauses, on tokio's paused clock.
        assert_eq!(waited, Some(Duration::from_millis(900)));

        let (value, waited) = until_ok(
            Doubling::new(Duration::from_millis(100), Duration::from_millis(300)),
            || async { Ok::<_, ()>(7) },
            |(), _| unreachable!("no failure"),
        )
        .await;
        assert_eq!((value, waited), (7, None));
    }

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
