//! The settle stage: each row's outcome from its routing and its deliveries'
//! results. Published when every message is acknowledged, dead on a
//! permanent failure, retried on a retryable one; the delivery state records
//! what each target took, so a retry sends only what is missing.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tracing::debug;

use super::BatchReport;
use super::plan::Results;
use super::retry::RetryPolicy;
use super::route::{RoutedRow, RowState};
use crate::config::Handling;
use crate::relay::router::Routed;
use crate::sinks::SinkError;
use crate::store::{Delivery, DeliveryKey, OutboxRow, Outcome, RowOutcome};

/// A settled batch.
pub(super) struct Settled<'a> {
    /// What to record, one per row, in batch order.
    pub(super) outcomes: Vec<RowOutcome>,
    /// Counts for the batch report (`claimed` and `lost` are not set here).
    pub(super) report: BatchReport,
    /// Rows per plugin and outcome kind, for the metrics.
    pub(super) tally: BTreeMap<(&'a str, &'static str), u64>,
    /// Creation times (ms since the epoch) of the published rows.
    pub(super) published_created_at_ms: Vec<i64>,
    /// Rows that failed before any target was tried and will be retried, and the first reason.
    pub(super) unrouted: (usize, Option<String>),
    /// The first dead-letter reason.
    pub(super) first_dead: Option<String>,
}

/// The failed deliveries of one row, by what they do to it.
#[derive(Default)]
struct Failed {
    dead: Option<String>,
    attempt: Option<String>,
    paused: BTreeSet<String>,
    pause: Option<String>,
    wait: Option<String>,
}

impl Failed {
    fn add(&mut self, handling: Handling, target: &str, text: String) {
        match handling {
            Handling::DeadLetter => self.dead.get_or_insert(text),
            Handling::Attempt => self.attempt.get_or_insert(text),
            Handling::Pause => {
                self.paused.insert(target.to_string());
                self.pause.get_or_insert(text)
            }
            Handling::Wait => self.wait.get_or_insert(text),
        };
    }

    /// A refusal dead-letters; else the event's own failure spends the
    /// attempt; else the row waits, on its paused targets when it has any.
    fn outcome(self, policy: &RetryPolicy, attempts: u32, age: Duration) -> Outcome {
        if let Some(error) = self.dead {
            Outcome::Dead { error }
        } else if let Some(error) = self.attempt {
            policy.after_failure(attempts, error)
        } else if let Some(reason) = self.pause {
            policy.wait_for_targets(self.paused.into_iter().collect(), reason)
        } else if let Some(reason) = self.wait {
            policy.wait(age, reason)
        } else {
            Outcome::Published
        }
    }
}

/// Records each message's result in the row's per-target delivery state;
/// returns the failures by what they do to the row.
fn record(
    messages: &[Routed],
    results: Vec<Option<Result<(), SinkError>>>,
    deliveries: &mut BTreeMap<DeliveryKey, Delivery>,
    policy: &RetryPolicy,
    now: &str,
) -> Failed {
    let mut failed = Failed::default();
    for (message, result) in messages.iter().zip(results) {
        let entry = deliveries
            .entry(message.delivery_key.clone())
            .or_insert_with(|| Delivery {
                target: message.target.clone(),
                topic: message.message.topic.clone(),
                acked_at: None,
                error: None,
            });
        match result.unwrap_or_else(|| Err(SinkError::retryable("not published"))) {
            Ok(()) => {
                if entry.acked_at.is_none() {
                    entry.acked_at = Some(now.to_string());
                }
                entry.error = None;
            }
            Err(error) => {
                let text = format!(
                    "target {:?} topic {:?}: {}",
                    message.target, message.message.topic, error.message
                );
                failed.add(policy.failures.handling(error.kind), &message.target, text);
                entry.error = Some(error.message);
            }
        }
    }
    failed
}

impl Settled<'_> {
    /// Counts a row's outcome in the report; returns its metrics label.
    fn count(&mut self, outcome: &Outcome, created_at_ms: i64, nothing_sent: bool) -> &'static str {
        match outcome {
            Outcome::Published => {
                self.report.published += 1;
                self.published_created_at_ms.push(created_at_ms);
                if nothing_sent { "dropped" } else { "published" }
            }
            Outcome::Retry { .. } => {
                self.report.retried += 1;
                "retried"
            }
            Outcome::Defer { .. } => {
                self.report.waiting += 1;
                "waiting"
            }
            Outcome::Dead { error } => {
                self.report.dead += 1;
                self.first_dead.get_or_insert_with(|| error.clone());
                "dead_lettered"
            }
        }
    }
}

/// Settles a batch. `results` holds every message's result (see
/// [`super::plan`]); one still missing counts as a retryable failure.
/// `now` (RFC 3339) stamps new acknowledgements and dates waits;
/// `plugin_of` names the plugin a row counts under.
pub(super) fn settle<'a>(
    routed: Vec<RoutedRow>,
    results: Results,
    policy: &RetryPolicy,
    now: chrono::DateTime<chrono::Utc>,
    plugin_of: &dyn Fn(&OutboxRow) -> &'a str,
) -> Settled<'a> {
    let mut settled = Settled {
        outcomes: Vec::with_capacity(routed.len()),
        report: BatchReport::default(),
        tally: BTreeMap::new(),
        published_created_at_ms: Vec::new(),
        unrouted: (0, None),
        first_dead: None,
    };
    let (now_ms, now) = (
        now.timestamp_millis(),
        now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    );
    let now = now.as_str();
    for (mut row, row_results) in routed.into_iter().zip(results) {
        let attempts = u32::try_from(row.row.attempts).unwrap_or(u32::MAX);
        let mut deliveries = std::mem::take(&mut row.row.deliveries);
        let (outcome, version) = match row.state {
            RowState::Failed { outcome, version } => {
                if let Outcome::Retry { error, .. } = &outcome {
                    settled.unrouted.0 += 1;
                    settled.unrouted.1.get_or_insert_with(|| error.clone());
                }
                (outcome, version)
            }
            RowState::Routed { messages, version } => {
                if messages.is_empty() {
                    settled.report.dropped += 1;
                }
                let mut failed = record(&messages, row_results, &mut deliveries, policy, now);
                if failed.pause.is_some() {
                    // The targets its earlier events wait for stay in its
                    // set, so the next row of its aggregate learns them all.
                    failed.paused.extend(row.row.held_by.iter().cloned());
                }
                let age = Duration::from_millis(u64::try_from(now_ms - row.row.created_at_ms).unwrap_or(0));
                let outcome = failed.outcome(policy, attempts, age);
                (outcome, version)
            }
        };
        let kind = settled.count(&outcome, row.row.created_at_ms, deliveries.is_empty());
        *settled.tally.entry((plugin_of(&row.row), kind)).or_default() += 1;
        row.span.in_scope(|| match &outcome {
            Outcome::Published => debug!(deliveries = deliveries.len(), "Row published."),
            Outcome::Dead { error } | Outcome::Retry { error, .. } | Outcome::Defer { reason: error, .. } => {
                debug!(outbox.row_id = %row.row.id, outbox.attempt = attempts, %error, "Row not published.");
            }
        });
        settled.outcomes.push(RowOutcome {
            id: row.row.id,
            outcome,
            deliveries,
            plugin_version: version,
        });
    }
    settled
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::relay::plan::tests::{routed, row};
    use crate::relay::plan::{Slot, plan};
    use crate::sinks::SinkError;

    const POLICY: RetryPolicy = RetryPolicy {
        max_attempts: 5,
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_millis(1_000),
        failures: crate::config::FailurePolicy::DEFAULT,
    };
    const NOW: &str = "2026-11-23T01:00:00.000Z";

    fn now() -> chrono::DateTime<chrono::Utc> {
        NOW.parse().unwrap()
    }

    fn settle_with(
        mut batch: Vec<RoutedRow>,
        answer: impl Fn(&str, Slot) -> Result<(), SinkError>,
    ) -> Settled<'static> {
        let mut plan = plan(&mut batch, true, &|| SinkError::retryable("lease spent"), &|_| {
            None
        });
        for (target, sends) in &plan.sends {
            for (slot, _) in sends {
                plan.results[slot.row][slot.message] = Some(answer(target, *slot));
            }
        }
        settle(batch, plan.results, &POLICY, now(), &|_| "route-by-type")
    }

    #[test]
    fn a_row_is_published_when_every_target_acknowledged() {
        let settled = settle_with(
            vec![routed(1, &[], &[("nats", "a.1"), ("kafka", "k.1")])],
            |_, _| Ok(()),
        );
        let outcome = &settled.outcomes[0];
        assert_eq!(outcome.outcome, Outcome::Published);
        assert_eq!(outcome.deliveries.len(), 2);
        assert!(
            outcome
                .deliveries
                .values()
                .all(|d| d.acked_at.as_deref() == Some(NOW))
        );
        assert_eq!(settled.report.published, 1);
        assert_eq!(settled.tally[&("route-by-type", "published")], 1);
    }

    #[test]
    fn a_failed_target_is_retried_and_the_acknowledged_one_is_remembered() {
        let settled = settle_with(
            vec![routed(1, &[], &[("nats", "a.1"), ("kafka", "k.1")])],
            |target, _| {
                if target == "kafka" {
                    Err(SinkError::retryable("broker down"))
                } else {
                    Ok(())
                }
            },
        );
        let outcome = &settled.outcomes[0];
        match &outcome.outcome {
            Outcome::Retry { error, after } => {
                assert_eq!(error, r#"target "kafka" topic "k.1": broker down"#);
                assert!(*after <= Duration::from_millis(100));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(outcome.deliveries["a.1"].acked_at.as_deref(), Some(NOW));
        assert_eq!(outcome.deliveries["k.1"].acked_at, None);
        assert_eq!(outcome.deliveries["k.1"].error.as_deref(), Some("broker down"));
        assert_eq!(settled.report.retried, 1);
    }

    #[test]
    fn a_permanent_refusal_wins_over_a_retryable_failure() {
        let settled = settle_with(
            vec![routed(1, &[], &[("nats", "a.1"), ("kafka", "k.1")])],
            |target, _| {
                Err(if target == "kafka" {
                    SinkError::retryable("broker down")
                } else {
                    SinkError::permanent("subject refused")
                })
            },
        );
        assert!(
            matches!(&settled.outcomes[0].outcome, Outcome::Dead { error } if error.contains("subject refused"))
        );
        assert_eq!(settled.report.dead, 1);
        assert!(settled.first_dead.unwrap().contains("subject refused"));
    }

    #[test]
    fn an_earlier_acknowledgement_keeps_its_time() {
        let settled = settle_with(
            vec![routed(1, &["a.1"], &[("nats", "a.1"), ("kafka", "k.1")])],
            |_, _| Ok(()),
        );
        let deliveries = &settled.outcomes[0].deliveries;
        assert_eq!(
            deliveries["a.1"].acked_at.as_deref(),
            Some("2026-11-23T00:00:00.000Z")
        );
        assert_eq!(deliveries["k.1"].acked_at.as_deref(), Some(NOW));
    }

    #[test]
    fn the_last_attempt_dead_letters_instead_of_retrying() {
        let mut last = routed(1, &[], &[("nats", "a.1")]);
        last.row.attempts = 5;
        let settled = settle_with(vec![last], |_, _| Err(SinkError::retryable("broker down")));
        assert!(
            matches!(&settled.outcomes[0].outcome, Outcome::Dead { error } if error.starts_with("gave up after 5 attempts"))
        );
    }

    #[test]
    fn dropped_and_unrouted_rows_are_counted_apart() {
        let retry = Outcome::Retry {
            after: Duration::from_secs(1),
            error: "plugin trapped".into(),
        };
        let settled = settle_with(
            vec![
                routed(1, &[], &[]),
                RoutedRow::failed(row(2, &[]), retry, None),
                routed(3, &[], &[("nats", "a.3")]),
            ],
            |_, _| Ok(()),
        );
        assert_eq!(settled.report.dropped, 1);
        assert_eq!(settled.report.published, 2);
        assert_eq!(settled.report.retried, 1);
        assert_eq!(settled.unrouted, (1, Some("plugin trapped".to_string())));
        assert_eq!(settled.tally[&("route-by-type", "dropped")], 1);
        assert!(settled.outcomes[0].deliveries.is_empty());
        assert_eq!(
            settled.outcomes.iter().map(|o| o.id.0).collect::<Vec<_>>(),
            [1, 2, 3]
        );
    }

    #[test]
    fn a_message_without_a_result_is_retried() {
        let mut batch = vec![routed(1, &[], &[("nats", "a.1")])];
        let results = plan(&mut batch, true, &|| SinkError::retryable("x"), &|_| None).results;
        let settled = settle(batch, results, &POLICY, now(), &|_| "p");
        assert!(
            matches!(&settled.outcomes[0].outcome, Outcome::Retry { error, .. } if error.ends_with("not published"))
        );
    }

    #[test]
    fn an_unreachable_target_makes_the_row_wait_without_spending_its_attempt() {
        let mut last = routed(1, &[], &[("nats", "a.1"), ("kafka", "k.1")]);
        last.row.attempts = 5;
        let settled = settle_with(vec![last], |target, _| {
            if target == "kafka" {
                Err(SinkError::unavailable("all brokers down"))
            } else {
                Ok(())
            }
        });
        let outcome = &settled.outcomes[0];
        match &outcome.outcome {
            Outcome::Defer {
                waiting_on, reason, ..
            } => {
                assert_eq!(waiting_on, &["kafka".to_string()]);
                assert!(reason.contains("all brokers down"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(outcome.deliveries["a.1"].acked_at.as_deref(), Some(NOW));
        assert_eq!(settled.report.waiting, 1);
        assert_eq!(settled.report.dead, 0);
        assert_eq!(settled.tally[&("route-by-type", "waiting")], 1);
    }

    #[test]
    fn the_events_own_failure_spends_the_attempt_even_beside_an_outage() {
        let mut last = routed(1, &[], &[("nats", "a.1"), ("kafka", "k.1")]);
        last.row.attempts = 5;
        let settled = settle_with(vec![last], |target, _| {
            Err(if target == "kafka" {
                SinkError::unavailable("all brokers down")
            } else {
                SinkError::retryable("stream answered an error")
            })
        });
        assert!(
            matches!(&settled.outcomes[0].outcome, Outcome::Dead { error } if error.contains("stream answered an error"))
        );
    }

    #[test]
    fn an_unknown_topic_waits_without_pausing_its_target() {
        let mut last = routed(1, &[], &[("nats", "a.1")]);
        last.row.attempts = 5;
        let settled = settle_with(vec![last], |_, _| {
            Err(SinkError::new(
                crate::sinks::FailureKind::UnknownTopic,
                "no stream",
            ))
        });
        assert!(
            matches!(&settled.outcomes[0].outcome, Outcome::Defer { waiting_on, .. } if waiting_on.is_empty())
        );
    }

    #[test]
    fn a_held_row_waits_on_every_target_its_predecessors_wait_on() {
        // Its predecessor waits on kafka and audit; it sends to nats and kafka.
        let mut held = routed(2, &[], &[("nats", "a.2"), ("kafka", "k.2")]);
        held.row.held_by = vec!["audit".into(), "kafka".into()];
        let mut batch = vec![held];
        let mut plan = plan(&mut batch, true, &|| SinkError::retryable("x"), &|_| None);
        for sends in plan.sends.values() {
            for (slot, _) in sends {
                plan.results[slot.row][slot.message] = Some(Ok(()));
            }
        }
        let settled = settle(batch, plan.results, &POLICY, now(), &|_| "p");
        let outcome = &settled.outcomes[0];
        assert!(
            matches!(&outcome.outcome, Outcome::Defer { waiting_on, .. } if waiting_on == &["audit".to_string(), "kafka".to_string()]),
            "{:?}",
            outcome.outcome
        );
        assert_eq!(outcome.deliveries["a.2"].acked_at.as_deref(), Some(NOW));
    }
}
