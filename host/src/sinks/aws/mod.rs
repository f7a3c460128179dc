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
#[cfg(feature = "aws")]
pub(crate) use crate::sinks::order::{in_order, per_topic};

pub use config::{AwsConnection, GroupId};

#[cfg(feature = "aws")]
use crate::sinks::OutgoingMessage;
#[cfg(feature = "aws")]
use crate::sinks::headers::{AGGREGATE_ID_HEADER, AGGREGATE_TYPE_HEADER, EVENT_TYPE_HEADER};

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
/// entry failed, succeeded, or (never seen) the answer left it out. An
/// entry refused for its credentials has them found again.
#[cfg(feature = "aws")]
fn entry_outcomes(
    connection: &client::Connection,
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
                let kind = client::entry_kind(failure.code, failure.sender_fault);
                if kind == crate::sinks::FailureKind::Unauthorized {
                    connection.credentials_refused();
                }
                Err(SinkError::new(
                    kind,
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
