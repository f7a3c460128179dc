//! The plan stage: which messages of a routed batch go to which target.
//! A message a target already acknowledged in an earlier attempt is not sent
//! again, nor one to a paused target; when the lease is nearly spent nothing
//! is sent at all, and if the claim spent it the rows wait uncharged.

use std::collections::BTreeMap;
use std::time::Duration;

use super::retry::{RetryPolicy, claim_to_blame};
use super::route::{RoutedRow, RowState};
use crate::sinks::{OutgoingMessage, SinkError};

/// A message's place in the batch: its row and its index among the row's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) row: usize,
    pub(super) message: usize,
}

/// Each message's delivery result, by row and message; `None` until known.
pub(super) type Results = Vec<Vec<Option<Result<(), SinkError>>>>;

/// What to send, and what is already known.
pub(super) struct Plan {
    /// Messages to send, per target, in batch order.
    pub(super) sends: BTreeMap<String, Vec<(Slot, OutgoingMessage)>>,
    /// Results known before sending (acknowledged earlier, or not sent).
    pub(super) results: Results,
}

/// Plans a routed batch. With `may_publish` false (the lease would run out
/// before the brokers answer) every message not yet acknowledged gets
/// `not_sent()` as its result; a message to a target for which `held_back`
/// says why (it is paused) gets that as an unavailable target. Messages to
/// send are moved out of `routed`, which keeps their topics for the
/// delivery records.
pub(super) fn plan(
    routed: &mut [RoutedRow],
    may_publish: bool,
    not_sent: &dyn Fn() -> SinkError,
    held_back: &dyn Fn(&str) -> Option<String>,
) -> Plan {
    let mut sends: BTreeMap<String, Vec<(Slot, OutgoingMessage)>> = BTreeMap::new();
    let mut results = Vec::with_capacity(routed.len());
    for (row_index, row) in routed.iter_mut().enumerate() {
        let RowState::Routed { messages, .. } = &mut row.state else {
            results.push(Vec::new());
            continue;
        };
        let mut known = Vec::with_capacity(messages.len());
        for (message_index, message) in messages.iter_mut().enumerate() {
            let acked = row
                .row
                .deliveries
                .get(&message.delivery_key)
                .is_some_and(|d| d.acked_at.is_some());
            if acked {
                known.push(Some(Ok(())));
            } else if row.row.held_by.contains(&message.target) {
                known.push(Some(Err(SinkError::unavailable(format!(
                    "an earlier event of this aggregate waits for target {:?}; this one waits behind it",
                    message.target
                )))));
            } else if let Some(why) = held_back(&message.target) {
                known.push(Some(Err(SinkError::unavailable(why))));
            } else if may_publish {
                known.push(None);
                let slot = Slot {
                    row: row_index,
                    message: message_index,
                };
                sends
                    .entry(message.target.clone())
                    .or_default()
                    .push((slot, message.take_message()));
            } else {
                known.push(Some(Err(not_sent())));
            }
        }
        results.push(known);
    }
    Plan { sends, results }
}

/// Rows of a batch the lease no longer lets publish: when the claim
/// statement used the time up, each row with a message still to send
/// waits a backoff without spending an attempt (a slow database is not the
/// event's fault; see [`RetryPolicy::after_spent_lease`]). After slow
/// plugins the rows are left to [`plan`], which charges them.
pub(super) fn defer_if_the_claim_was_slow(
    routed: &mut [RoutedRow],
    retry: &RetryPolicy,
    lease: Duration,
    took: Duration,
    reserved: Duration,
) {
    if !claim_to_blame(took, lease, reserved) {
        return;
    }
    for row in routed {
        let RowState::Routed { messages, version } = &mut row.state else {
            continue;
        };
        let unsent = messages.iter().any(|message| {
            row.row
                .deliveries
                .get(&message.delivery_key)
                .is_none_or(|delivery| delivery.acked_at.is_none())
        });
        if unsent {
            let attempts = u32::try_from(row.row.attempts).unwrap_or(u32::MAX);
            row.state = RowState::Failed {
                outcome: retry.after_spent_lease(attempts, took, lease, reserved, "publishing"),
                version: version.take(),
            };
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::relay::router::Routed;
    use crate::store::{Delivery, OutboxRow, Outcome, RowId};

    pub(in crate::relay) fn row(id: i64, acked: &[&str]) -> OutboxRow {
        OutboxRow {
            id: RowId(id),
            event_id: uuid::Uuid::new_v4(),
            aggregate_type: "order".into(),
            aggregate_id: format!("order-{id}"),
            event_type: "OrderCreated".into(),
            payload_json: Some("{}".into()),
            payload_bytes: None,
            headers_json: "{}".into(),
            tenant: None,
            created_at_ms: 0,
            attempts: 1,
            deliveries: acked
                .iter()
                .map(|key| {
                    let delivery = Delivery {
                        target: "nats".into(),
                        topic: (*key).into(),
                        acked_at: Some("2026-11-23T00:00:00.000Z".into()),
                        error: None,
                    };
                    ((*key).to_string(), delivery)
                })
                .collect::<BTreeMap<_, _>>(),
            malformed: None,
            held_by: Vec::new(),
        }
    }

    pub(in crate::relay) fn routed(id: i64, acked: &[&str], messages: &[(&str, &str)]) -> RoutedRow {
        RoutedRow {
            row: row(id, acked),
            state: RowState::Routed {
                messages: messages
                    .iter()
                    .map(|(target, topic)| Routed {
                        target: (*target).into(),
                        delivery_key: (*topic).into(),
                        message: OutgoingMessage {
                            topic: (*topic).into(),
                            payload: format!("payload of {id}").into_bytes().into(),
                            ..OutgoingMessage::default()
                        },
                    })
                    .collect(),
                version: None,
            },
            span: tracing::Span::none(),
        }
    }

    fn not_sent() -> SinkError {
        SinkError::retryable("lease spent")
    }

    #[test]
    fn messages_are_grouped_by_target_in_batch_order() {
        let mut batch = vec![
            routed(1, &[], &[("nats", "a.1"), ("kafka", "k.1")]),
            RoutedRow::failed(
                row(2, &[]),
                Outcome::Dead {
                    error: "refused".into(),
                },
                None,
            ),
            routed(3, &[], &[("nats", "a.3")]),
        ];
        let plan = plan(&mut batch, true, &not_sent, &|_| None);
        let nats: Vec<_> = plan.sends["nats"]
            .iter()
            .map(|(slot, m)| (*slot, m.topic.clone()))
            .collect();
        assert_eq!(
            nats,
            [
                (Slot { row: 0, message: 0 }, "a.1".to_string()),
                (Slot { row: 2, message: 0 }, "a.3".to_string()),
            ]
        );
        assert_eq!(plan.sends["kafka"].len(), 1);
        assert_eq!(&plan.sends["kafka"][0].1.payload[..], b"payload of 1");
        assert_eq!(plan.results.len(), 3);
        assert!(plan.results[0].iter().all(Option::is_none));
        assert!(plan.results[1].is_empty());
        // Moved out, topic kept for the delivery record.
        let RowState::Routed { messages, .. } = &batch[0].state else {
            panic!()
        };
        assert!(messages[0].message.payload.is_empty());
        assert_eq!(messages[0].message.topic, "a.1");
    }

    #[test]
    fn a_message_acknowledged_earlier_is_not_sent_again() {
        let mut batch = vec![routed(1, &["a.1"], &[("nats", "a.1"), ("kafka", "k.1")])];
        let plan = plan(&mut batch, true, &not_sent, &|_| None);
        assert!(!plan.sends.contains_key("nats"));
        assert_eq!(plan.sends["kafka"].len(), 1);
        assert!(matches!(plan.results[0][0], Some(Ok(()))));
        assert!(plan.results[0][1].is_none());
    }

    #[test]
    fn nothing_is_sent_when_the_lease_is_spent() {
        let mut batch = vec![routed(1, &["a.1"], &[("nats", "a.1"), ("kafka", "k.1")])];
        let plan = plan(&mut batch, false, &not_sent, &|_| None);
        assert!(plan.sends.is_empty());
        assert!(matches!(plan.results[0][0], Some(Ok(()))));
        assert!(
            matches!(&plan.results[0][1], Some(Err(e)) if e.kind == crate::sinks::FailureKind::Transient && e.message == "lease spent")
        );
    }

    #[test]
    fn nothing_is_sent_to_a_paused_target() {
        let mut batch = vec![routed(1, &[], &[("nats", "a.1"), ("kafka", "k.1")])];
        let held_back = |target: &str| (target == "kafka").then(|| "kafka is paused".to_string());
        let plan = plan(&mut batch, true, &not_sent, &held_back);
        assert!(!plan.sends.contains_key("kafka"));
        assert_eq!(plan.sends["nats"].len(), 1);
        assert!(matches!(
            &plan.results[0][1],
            Some(Err(e)) if e.kind == crate::sinks::FailureKind::Unavailable && e.message == "kafka is paused"
        ));
    }

    #[test]
    fn a_message_held_behind_its_aggregate_is_not_sent_but_the_others_are() {
        let mut held = routed(2, &[], &[("nats", "a.2"), ("kafka", "k.2")]);
        held.row.held_by = vec!["kafka".into()];
        let mut batch = vec![held];
        let plan = plan(&mut batch, true, &not_sent, &|_| None);
        assert!(!plan.sends.contains_key("kafka"));
        assert_eq!(plan.sends["nats"].len(), 1);
        assert!(matches!(
            &plan.results[0][1],
            Some(Err(e)) if e.kind == crate::sinks::FailureKind::Unavailable && e.message.contains("waits behind it")
        ));
    }

    /// A batch whose claim used up the lease: its rows with a message still
    /// to send wait without spending an attempt, even on their last one; a
    /// row every target acknowledged earlier and a row already decided keep
    /// what they had. After a fast claim the plan charges them as before.
    #[test]
    fn a_batch_the_claim_made_late_waits_without_spending_attempts() {
        let retry = RetryPolicy::from_config(&crate::config::RelayConfig {
            max_attempts: 1,
            ..crate::config::RelayConfig::default()
        });
        let (lease, reserved) = (Duration::from_secs(4), Duration::from_secs(3));
        let batch = || {
            vec![
                routed(1, &[], &[("nats", "a.1")]),
                routed(2, &["a.2"], &[("nats", "a.2")]),
                RoutedRow::failed(
                    row(3, &[]),
                    Outcome::Dead {
                        error: "refused".into(),
                    },
                    None,
                ),
            ]
        };
        let mut late = batch();
        defer_if_the_claim_was_slow(&mut late, &retry, lease, Duration::from_millis(1_600), reserved);
        assert!(
            matches!(&late[0].state, RowState::Failed { outcome: Outcome::Defer { reason, .. }, .. }
                if reason.contains("before publishing") && reason.contains("database slow")),
            "row 1"
        );
        assert!(
            matches!(late[1].state, RowState::Routed { .. }),
            "row 2 was acknowledged"
        );
        assert!(
            matches!(
                &late[2].state,
                RowState::Failed {
                    outcome: Outcome::Dead { .. },
                    ..
                }
            ),
            "row 3"
        );
        let mut plugins_slow = batch();
        defer_if_the_claim_was_slow(
            &mut plugins_slow,
            &retry,
            lease,
            Duration::from_millis(300),
            reserved,
        );
        assert!(
            matches!(plugins_slow[0].state, RowState::Routed { .. }),
            "left to the plan"
        );
    }
}
