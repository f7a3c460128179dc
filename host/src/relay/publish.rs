//! The publish stage: each target gets its messages in one call, all targets
//! at once, each bounded in time; results are counted and logged per target.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::join_all;
use tracing::warn;

use super::Relay;
use super::plan::{Results, Slot};
use crate::config::Handling;
use crate::metrics::{FailureLabels, TargetLabel};
use crate::sinks::{OutgoingMessage, SinkError};

impl Relay {
    /// Sends `sends` and writes each message's result into `results`.
    pub(super) async fn publish(
        &self,
        sends: std::collections::BTreeMap<String, Vec<(Slot, OutgoingMessage)>>,
        results: &mut Results,
    ) {
        let inner = &self.inner;
        // The sink enforces the publish timeout itself; this bounds a sink that does not.
        let bound = inner.config.publish_timeout() + Duration::from_millis(500);
        let calls = sends.into_iter().map(|(target, sends)| {
            let sink = inner.sinks.get(&target).cloned();
            let (slots, messages): (Vec<Slot>, Vec<OutgoingMessage>) = sends.into_iter().unzip();
            async move {
                let count = messages.len();
                let outcome = match sink {
                    Some(sink) => tokio::time::timeout(bound, sink.publish(messages))
                        .await
                        .unwrap_or_else(|_| {
                            vec![
                                Err(SinkError::timed_out(format!(
                                    "target {target:?} did not answer in time"
                                )));
                                count
                            ]
                        }),
                    None => vec![Err(SinkError::permanent(format!("unknown target {target:?}"))); count],
                };
                (target, slots, outcome)
            }
        });
        for (target, slots, outcome) in join_all(calls).await {
            self.count_and_log(&target, &outcome);
            for (slot, result) in slots.into_iter().zip(outcome) {
                results[slot.row][slot.message] = Some(result);
            }
        }
    }

    /// Metrics per target, and one log line per target and kind of failure:
    /// the per-row state is in `deliveries`. A failure that says the target
    /// cannot be reached pauses it (one line then, not one per batch).
    fn count_and_log(&self, target: &str, outcome: &[Result<(), SinkError>]) {
        let metrics = &self.inner.metrics;
        let failures = &self.inner.retry.failures;
        let failed: Vec<&SinkError> = outcome.iter().filter_map(|r| r.as_ref().err()).collect();
        metrics
            .published
            .get_or_create(&TargetLabel {
                target: target.to_string(),
            })
            .inc_by((outcome.len() - failed.len()) as u64);
        let mut by_handling: BTreeMap<Handling, (usize, &SinkError)> = BTreeMap::new();
        for error in &failed {
            metrics
                .failed
                .get_or_create(&FailureLabels {
                    target: target.to_string(),
                    error: error.kind.as_str(),
                })
                .inc();
            by_handling
                .entry(failures.handling(error.kind))
                .or_insert((0, error))
                .0 += 1;
        }
        for (handling, (count, first)) in by_handling {
            match handling {
                Handling::Pause => self.pause_target(target, &first.message),
                Handling::Wait => warn!(
                    sink.name = %target,
                    waiting = count,
                    sent = outcome.len(),
                    error = %first.message,
                    "Deliveries to this target cannot go yet; their rows wait without spending attempts."
                ),
                Handling::Attempt => warn!(
                    sink.name = %target,
                    failed = count,
                    sent = outcome.len(),
                    error = %first.message,
                    "Deliveries to this target failed; only they will be retried."
                ),
                Handling::DeadLetter => warn!(
                    sink.name = %target,
                    refused = count,
                    sent = outcome.len(),
                    error = %first.message,
                    "This target refused deliveries for good; their rows are dead-lettered."
                ),
            }
        }
    }
}
