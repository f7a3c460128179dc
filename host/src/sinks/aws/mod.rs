//! The AWS targets: SQS queues (standard and FIFO), SNS topics, an
//! EventBridge bus and Kinesis data streams, each a kind of its own
//! (`sqs`, `sns`, `eventbridge`, `kinesis`) over one connection setup:
//! region, endpoint and credentials from the AWS default chain (or keys
//! the config names, read again as they rotate), the SDK's own retries off
//! (the relay decides what a failure means), and one classification of
//! AWS's answers into the relay's failure kinds.
//!
//! Order: the relay has at most one event per aggregate in flight, so an
//! aggregate's next event reaches a FIFO queue or topic (its message group)
//! or a Kinesis shard (its partition key) only after the previous one was
//! acknowledged.

#[cfg(feature = "aws")]
mod attributes;
mod config;
pub mod eventbridge;
pub mod kinesis;
pub mod sns;
pub mod sqs;

#[cfg(feature = "aws")]
mod client;

pub use config::{AwsConnection, GroupId};

#[cfg(feature = "aws")]
use crate::relay::router::{AGGREGATE_ID_HEADER, AGGREGATE_TYPE_HEADER, EVENT_TYPE_HEADER};
#[cfg(feature = "aws")]
use crate::sinks::OutgoingMessage;

#[cfg(feature = "aws")]
/// The value of the relay's header `name` on `message`.
fn header<'m>(message: &'m OutgoingMessage, name: &str) -> Option<&'m str> {
    message
        .headers
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}

#[cfg(feature = "aws")]
/// The event's aggregate id, as the relay's header carries it.
fn aggregate_id(message: &OutgoingMessage) -> &str {
    header(message, AGGREGATE_ID_HEADER).unwrap_or_default()
}

#[cfg(feature = "aws")]
/// The event's aggregate type.
fn aggregate_type(message: &OutgoingMessage) -> &str {
    header(message, AGGREGATE_TYPE_HEADER).unwrap_or_default()
}

#[cfg(feature = "aws")]
/// The event's type.
fn event_type(message: &OutgoingMessage) -> &str {
    header(message, EVENT_TYPE_HEADER).unwrap_or_default()
}

#[cfg(feature = "aws")]
/// `value` if it fits `max` bytes of `allowed` characters, else a stable
/// stand-in for it (its SHA-256, 64 hex digits): an aggregate id too long
/// for a message group or a partition key still maps to one group or
/// shard of its own.
fn fitted(value: &str, max: usize, allowed: impl Fn(char) -> bool) -> String {
    if !value.is_empty() && value.len() <= max && value.chars().all(allowed) {
        return value.to_string();
    }
    use sha2::Digest;
    format!("{:x}", sha2::Sha256::digest(value.as_bytes()))
}

/// Publishes `messages` topic by topic (queue, topic, stream, bus), the
/// topics at once and each topic's messages in order through `send`, which
/// answers for each message it was given by its index.
#[cfg(feature = "aws")]
async fn per_topic<'m, F, Fut>(
    messages: &'m [OutgoingMessage],
    send: F,
) -> Vec<Result<(), crate::sinks::SinkError>>
where
    F: Fn(&'m str, Vec<(usize, &'m OutgoingMessage)>) -> Fut,
    Fut: std::future::Future<Output = Vec<(usize, Result<(), crate::sinks::SinkError>)>>,
{
    let mut by_topic: Vec<(&str, Vec<(usize, &OutgoingMessage)>)> = Vec::new();
    for (index, message) in messages.iter().enumerate() {
        match by_topic.iter_mut().find(|(topic, _)| *topic == message.topic) {
            Some((_, list)) => list.push((index, message)),
            None => by_topic.push((message.topic.as_str(), vec![(index, message)])),
        }
    }
    let sent = futures::future::join_all(by_topic.into_iter().map(|(topic, list)| send(topic, list))).await;
    let mut results: Vec<Result<(), crate::sinks::SinkError>> = (0..messages.len()).map(|_| Ok(())).collect();
    for (index, result) in sent.into_iter().flatten() {
        results[index] = result;
    }
    results
}

/// Sends `items` (index, order key, message) through `send` in rounds: a
/// round holds at most one message per key (an empty key is unordered: all
/// go in the first round), so a service that answers each entry on its own
/// cannot store an aggregate's later message while failing its earlier one;
/// after a failure, the key's later messages fail with it, unsent.
#[cfg(feature = "aws")]
async fn in_order<T, F, Fut>(
    items: Vec<(usize, String, T)>,
    mut send: F,
) -> Vec<(usize, Result<(), crate::sinks::SinkError>)>
where
    F: FnMut(Vec<(usize, T)>) -> Fut,
    Fut: std::future::Future<Output = Vec<(usize, Result<(), crate::sinks::SinkError>)>>,
{
    let mut rounds: Vec<Vec<(usize, String, T)>> = Vec::new();
    let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for (index, key, item) in items {
        let round = if key.is_empty() {
            0
        } else {
            let count = seen.entry(key.clone()).or_insert(0);
            *count += 1;
            *count - 1
        };
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push((index, key, item));
    }
    let mut results = Vec::new();
    let mut failed: std::collections::HashMap<String, crate::sinks::SinkError> =
        std::collections::HashMap::new();
    for round in rounds {
        let mut keys = std::collections::HashMap::new();
        let mut sending = Vec::with_capacity(round.len());
        for (index, key, item) in round {
            match failed.get(&key) {
                Some(error) => results.push((index, Err(error.clone()))),
                None => {
                    keys.insert(index, key);
                    sending.push((index, item));
                }
            }
        }
        for (index, result) in send(sending).await {
            if let (Err(error), Some(key)) = (&result, keys.get(&index))
                && !key.is_empty()
            {
                failed.entry(key.clone()).or_insert_with(|| error.clone());
            }
            results.push((index, result));
        }
    }
    results
}

/// One failed entry of a batch call.
#[cfg(feature = "aws")]
struct EntryFailure<'a> {
    /// The entry's id (SQS, SNS) or position (EventBridge, Kinesis).
    id: String,
    code: &'a str,
    sender_fault: Option<bool>,
    message: Option<&'a str>,
}

/// Each of `indexes` (the batch's messages, in entry order) answered: its
/// entry failed, succeeded, or (never seen) the answer left it out.
#[cfg(feature = "aws")]
fn entry_outcomes(
    indexes: Vec<usize>,
    failed: &[EntryFailure<'_>],
    succeeded: &std::collections::HashSet<String>,
    service: &str,
    what: &str,
) -> Vec<(usize, Result<(), crate::sinks::SinkError>)> {
    use crate::sinks::SinkError;
    indexes
        .into_iter()
        .enumerate()
        .map(|(at, index)| {
            let id = at.to_string();
            let result = if let Some(failure) = failed.iter().find(|f| f.id == id) {
                Err(SinkError::new(
                    client::entry_kind(failure.code, failure.sender_fault),
                    format!(
                        "{service} refused the message for {what} ({}{})",
                        failure.code,
                        failure.message.map(|m| format!(": {m}")).unwrap_or_default()
                    ),
                ))
            } else if succeeded.contains(&id) {
                Ok(())
            } else {
                Err(SinkError::unavailable(format!(
                    "{service} answered the batch for {what} without this message"
                )))
            };
            (index, result)
        })
        .collect()
}

#[cfg(all(test, feature = "aws"))]
mod tests {
    use super::*;

    #[test]
    fn a_value_that_does_not_fit_becomes_its_digest_and_stays_the_same() {
        let plain = |c: char| c.is_ascii_alphanumeric();
        assert_eq!(fitted("order42", 128, plain), "order42");
        let long = "o".repeat(300);
        let digest = fitted(&long, 128, plain);
        assert_eq!(digest.len(), 64);
        assert_eq!(digest, fitted(&long, 128, plain));
        assert_ne!(digest, fitted(&"p".repeat(300), 128, plain));
        assert_eq!(fitted("with space", 128, plain).len(), 64);
        assert_eq!(fitted("", 128, plain).len(), 64);
    }
}
