//! The publish stage: each target gets its messages in one call, all targets
//! at once, each bounded in time; results are counted and logged per target.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::join_all;
use tracing::warn;

use super::Relay;
use super::plan::{Results, Slot};
use crate::config::{FailurePolicy, Handling};
use crate::sinks::{OutgoingMessage, SinkError, Sinks};

/// Messages to send, per target, each with its place in the batch.
pub(super) type Sends = BTreeMap<String, Vec<(Slot, OutgoingMessage)>>;

/// One target's answer to a publish call: a result per message, in order.
pub(super) struct TargetOutcome {
    pub(super) target: String,
    pub(super) slots: Vec<Slot>,
    pub(super) results: Vec<Result<(), SinkError>>,
}

/// The publish stage as a value: the targets and the longest a call may
/// take. It sends and reports; what a failure means is the caller's.
pub(super) struct Publisher<'a> {
    pub(super) sinks: &'a Sinks,
    /// The sink enforces the publish timeout itself; this bounds a sink
    /// that does not.
    pub(super) bound: Duration,
}

impl Publisher<'_> {
    /// One call per target, all at once. A target that is not configured,
    /// or does not answer within the bound, fails each of its messages.
    pub(super) async fn send(&self, sends: Sends) -> Vec<TargetOutcome> {
        let bound = self.bound;
        let calls = sends.into_iter().map(|(target, sends)| {
            let sink = self.sinks.get(&target).cloned();
            let (slots, messages): (Vec<Slot>, Vec<OutgoingMessage>) = sends.into_iter().unzip();
            async move {
                let count = messages.len();
                let results = match sink {
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
                TargetOutcome {
                    target,
                    slots,
                    results,
                }
            }
        });
        join_all(calls).await
    }
}

/// A target's failures grouped by how they are handled: how many, and the
/// first one's error (one log line per group, not per message).
pub(super) fn by_handling<'a>(
    failures: &FailurePolicy,
    results: &'a [Result<(), SinkError>],
) -> BTreeMap<Handling, (usize, &'a SinkError)> {
    let mut groups: BTreeMap<Handling, (usize, &SinkError)> = BTreeMap::new();
    for error in results.iter().filter_map(|r| r.as_ref().err()) {
        groups
            .entry(failures.handling(error.kind))
            .or_insert((0, error))
            .0 += 1;
    }
    groups
}

impl Relay {
    /// Sends `sends` and writes each message's result into `results`.
    pub(super) async fn publish(&self, sends: Sends, results: &mut Results) {
        let publisher = Publisher {
            sinks: &self.inner.sinks,
            bound: self.inner.config.publish_timeout() + Duration::from_millis(500),
        };
        for outcome in publisher.send(sends).await {
            self.count_and_log(&outcome.target, &outcome.results);
            for (slot, result) in outcome.slots.into_iter().zip(outcome.results) {
                results[slot.row][slot.message] = Some(result);
            }
        }
    }

    /// Metrics per target, and one log line per target and kind of failure:
    /// the per-row state is in `deliveries`. A failure that says the target
    /// cannot be reached pauses it (one line then, not one per batch).
    fn count_and_log(&self, target: &str, outcome: &[Result<(), SinkError>]) {
        let metrics = &self.inner.metrics;
        let mut failed = 0;
        for error in outcome.iter().filter_map(|r| r.as_ref().err()) {
            failed += 1;
            metrics.failed(target, error.kind.as_str());
        }
        metrics.published(target, (outcome.len() - failed) as u64);
        for (handling, (count, first)) in by_handling(&self.inner.retry.failures, outcome) {
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

#[cfg(test)]
pub(super) mod tests {
    use std::sync::{Arc, Mutex};

    use futures::future::BoxFuture;

    use super::*;
    use crate::sinks::{FailureKind, Sink};

    /// Answers each message from `answer` (by topic), after `delay`, and
    /// records what it was sent.
    pub(in crate::relay) struct Scripted {
        delay: Duration,
        answer: fn(&OutgoingMessage) -> Result<(), SinkError>,
        seen: Mutex<Vec<String>>,
    }

    impl Sink for Scripted {
        fn kind(&self) -> &'static str {
            "scripted"
        }

        fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
            Box::pin(async move {
                tokio::time::sleep(self.delay).await;
                let mut seen = self.seen.lock().unwrap();
                messages
                    .iter()
                    .map(|m| {
                        seen.push(m.event_id.clone());
                        (self.answer)(m)
                    })
                    .collect()
            })
        }

        fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
            Box::pin(async { Ok(()) })
        }
    }

    pub(in crate::relay) fn scripted(
        delay_ms: u64,
        answer: fn(&OutgoingMessage) -> Result<(), SinkError>,
    ) -> Arc<Scripted> {
        Arc::new(Scripted {
            delay: Duration::from_millis(delay_ms),
            answer,
            seen: Mutex::new(Vec::new()),
        })
    }

    fn message(event_id: &str, topic: &str) -> OutgoingMessage {
        OutgoingMessage {
            topic: topic.into(),
            key: None,
            payload: bytes::Bytes::from_static(b"{}"),
            headers: Vec::new(),
            event_id: event_id.into(),
            dedup_id: event_id.into(),
        }
    }

    fn sends(list: &[(&str, usize, &str, &str)]) -> Sends {
        let mut sends = Sends::new();
        for &(target, row, event, topic) in list {
            sends
                .entry(target.to_string())
                .or_default()
                .push((Slot { row, message: 0 }, message(event, topic)));
        }
        sends
    }

    fn kinds(outcome: &TargetOutcome) -> Vec<Option<FailureKind>> {
        outcome
            .results
            .iter()
            .map(|r| r.as_ref().err().map(|e| e.kind))
            .collect()
    }

    #[tokio::test]
    async fn each_target_answers_for_its_own_messages_in_order() {
        let ok = scripted(0, |_| Ok(()));
        let picky = scripted(0, |m| match m.topic.as_str() {
            "missing" => Err(SinkError::new(FailureKind::UnknownTopic, "no such topic")),
            _ => Ok(()),
        });
        let sinks = Sinks::from_sinks([
            ("a".to_string(), ok.clone() as Arc<dyn Sink>),
            ("b".to_string(), picky.clone() as Arc<dyn Sink>),
        ]);
        let publisher = Publisher {
            sinks: &sinks,
            bound: Duration::from_secs(5),
        };
        let outcomes = publisher
            .send(sends(&[
                ("a", 0, "e0", "t"),
                ("b", 0, "e0", "t"),
                ("b", 1, "e1", "missing"),
                ("a", 2, "e2", "t"),
            ]))
            .await;
        assert_eq!(outcomes.len(), 2);
        let a = outcomes.iter().find(|o| o.target == "a").unwrap();
        let b = outcomes.iter().find(|o| o.target == "b").unwrap();
        assert_eq!(kinds(a), vec![None, None]);
        assert_eq!(a.slots.iter().map(|s| s.row).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(kinds(b), vec![None, Some(FailureKind::UnknownTopic)]);
        assert_eq!(b.slots.iter().map(|s| s.row).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(*ok.seen.lock().unwrap(), vec!["e0", "e2"]);
        assert_eq!(*picky.seen.lock().unwrap(), vec!["e0", "e1"]);
    }

    #[tokio::test]
    async fn an_unknown_target_is_refused_and_a_silent_one_times_out_alone() {
        let silent = scripted(60_000, |_| Ok(()));
        let quick = scripted(0, |_| Ok(()));
        let sinks = Sinks::from_sinks([
            ("silent".to_string(), silent as Arc<dyn Sink>),
            ("quick".to_string(), quick as Arc<dyn Sink>),
        ]);
        let publisher = Publisher {
            sinks: &sinks,
            bound: Duration::from_millis(200),
        };
        let started = std::time::Instant::now();
        let outcomes = publisher
            .send(sends(&[
                ("silent", 0, "e0", "t"),
                ("silent", 1, "e1", "t"),
                ("quick", 0, "e0", "t"),
                ("gone", 2, "e2", "t"),
            ]))
            .await;
        // Bounded by the publisher, not by the silent sink's minute.
        assert!(started.elapsed() < Duration::from_secs(30));
        let by_target: BTreeMap<_, _> = outcomes.iter().map(|o| (o.target.as_str(), kinds(o))).collect();
        assert_eq!(by_target["silent"], vec![Some(FailureKind::TimedOut); 2]);
        assert_eq!(by_target["quick"], vec![None]);
        assert_eq!(by_target["gone"], vec![Some(FailureKind::Refused)]);
        let gone = outcomes.iter().find(|o| o.target == "gone").unwrap();
        let error = gone.results[0].as_ref().unwrap_err();
        assert!(
            error.message.contains("unknown target \"gone\""),
            "{}",
            error.message
        );
    }

    #[test]
    fn failures_group_by_handling_with_the_first_error_of_each() {
        let results = vec![
            Ok(()),
            Err(SinkError::new(FailureKind::Transient, "first transient")),
            Err(SinkError::new(FailureKind::Unavailable, "down")),
            Err(SinkError::new(FailureKind::Transient, "second transient")),
            Err(SinkError::new(FailureKind::Refused, "too large")),
        ];
        let groups = by_handling(&FailurePolicy::DEFAULT, &results);
        let summary: Vec<(Handling, usize, &str)> = groups
            .iter()
            .map(|(handling, (count, first))| (*handling, *count, first.message.as_str()))
            .collect();
        assert_eq!(
            summary,
            vec![
                (Handling::Pause, 1, "down"),
                (Handling::Attempt, 2, "first transient"),
                (Handling::DeadLetter, 1, "too large"),
            ]
        );
        assert!(by_handling(&FailurePolicy::DEFAULT, &[Ok(()), Ok(())]).is_empty());
    }
}
