//! The pause between tries of something that does not answer yet (the
//! database, a broker, the slot, LISTEN): doubling after each failure up to
//! a cap, with jitter, back to the first after a success. Every retry-until-it-answers
//! loop in the relay takes its pauses from one of these, and the loops that
//! must not give up (recording what was published) are [`until_ok`].

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Pauses that double after each failure, up to a cap, each drawn at
/// random from the upper half of its step: relays that lost the same
/// database or broker at the same moment do not all come back to it at the
/// same moment. An endless iterator of pauses.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    step: Duration,
    jitter: bool,
}

impl Backoff {
    /// Pauses of about `first`, then twice as long each time, at most `max`.
    #[must_use]
    pub const fn new(first: Duration, max: Duration) -> Backoff {
        Backoff {
            first,
            max,
            step: first,
            jitter: true,
        }
    }

    /// The same steps, exactly: a poll interval that grows while it finds
    /// nothing, where only one process polls.
    #[must_use]
    pub const fn exact(self) -> Backoff {
        Backoff {
            jitter: false,
            ..self
        }
    }

    /// The pause to take now; the next step is twice as long, up to the cap.
    pub fn next_pause(&mut self) -> Duration {
        let step = self.step;
        self.step = (self.step * 2).min(self.max);
        if self.jitter { spread(step) } else { step }
    }

    /// The current step, without jitter and without moving on.
    #[must_use]
    pub const fn peek(&self) -> Duration {
        self.step
    }

    /// After a success: the next step is the first again.
    pub fn reset(&mut self) {
        self.step = self.first;
    }
}

impl Iterator for Backoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_pause())
    }
}

/// A random point in the upper half of `step`: the jitter of every backoff
/// in the relay, these pauses and a row's retry delay alike.
#[must_use]
pub fn spread(step: Duration) -> Duration {
    use rand::Rng;
    let millis = u64::try_from(step.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis(rand::rng().random_range(millis / 2..=millis))
}

/// Runs `attempt` until it succeeds, pausing by `pause` after each failure;
/// `failed` hears each error with the count of failures so far (1 the
/// first time: where to warn once). Returns the value, and how long it was
/// waited for when the first attempt failed.
pub async fn until_ok<T, E, F, Fut>(
    mut pause: Backoff,
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
            Backoff::new(Duration::from_millis(100), Duration::from_millis(300)).exact(),
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
            Backoff::new(Duration::from_millis(100), Duration::from_millis(300)),
            || async { Ok::<_, ()>(7) },
            |(), _| unreachable!("no failure"),
        )
        .await;
        assert_eq!((value, waited), (7, None));
    }

    #[test]
    fn doubles_up_to_its_cap_and_starts_over_after_a_reset() {
        let mut pause = Backoff::new(Duration::from_millis(100), Duration::from_millis(500)).exact();
        let taken: Vec<u128> = pause.by_ref().take(5).map(|pause| pause.as_millis()).collect();
        assert_eq!(taken, [100, 200, 400, 500, 500]);
        assert_eq!(pause.peek(), Duration::from_millis(500));
        pause.reset();
        assert_eq!(pause.next_pause(), Duration::from_millis(100));
    }

    #[test]
    fn each_pause_lies_in_the_upper_half_of_its_step_and_they_spread() {
        let steps = [100, 200, 400, 500, 500];
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let pauses = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
            for (pause, step) in pauses.zip(steps) {
                let pause = pause.as_millis();
                assert!(
                    (step / 2..=step).contains(&pause),
                    "{pause} ms for a step of {step} ms"
                );
                if step == 500 {
                    seen.insert(pause);
                }
            }
        }
        // 400 draws from 251 values: a constant would be one.
        assert!(seen.len() > 50, "{} distinct pauses", seen.len());
    }
}
