//! `[relay.failures]`: which delivery failures spend one of an event's
//! attempts and which are the target's trouble, for the kinds where that
//! depends on the deployment (a timeout, an unknown topic, refused access).

use serde::Deserialize;

use crate::sinks::FailureKind;

/// What a failed delivery does to its row.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Handling {
    /// The target is paused: nothing more is sent to it, its rows wait in
    /// the table without spending attempts, and the relay probes it and
    /// wakes them within a second of its return.
    Pause,
    /// The row waits and is tried again later (its delay grows with its
    /// age, up to `max_backoff_ms`) without spending an attempt.
    Wait,
    /// The attempt counts: retried with backoff, dead-lettered after
    /// `max_attempts`.
    Attempt,
    /// Dead-lettered at once.
    DeadLetter,
}

/// The handling of the kinds whose fault depends on the deployment. The
/// others are fixed: a target that cannot be reached pauses, an event's
/// own transient failure spends an attempt, a refusal dead-letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FailurePolicy {
    /// No answer within `publish_timeout_ms`: almost always a target in
    /// trouble, rarely a message it chokes on.
    #[serde(default = "pause")]
    pub timed_out: Handling,
    /// The topic, the subject's stream or the exchange does not exist:
    /// until an operator creates it, or for good when a plugin made a
    /// typo. Waiting loses nothing either way.
    #[serde(default = "wait")]
    pub unknown_topic: Handling,
    /// Credentials or permissions refused: usually a rotation in progress.
    #[serde(default = "wait")]
    pub unauthorized: Handling,
}

fn pause() -> Handling {
    Handling::Pause
}

fn wait() -> Handling {
    Handling::Wait
}

impl Default for FailurePolicy {
    fn default() -> Self {
        FailurePolicy::DEFAULT
    }
}

impl FailurePolicy {
    /// The defaults: nothing but the event's own failures spends an attempt.
    pub const DEFAULT: FailurePolicy = FailurePolicy {
        timed_out: Handling::Pause,
        unknown_topic: Handling::Wait,
        unauthorized: Handling::Wait,
    };

    /// What a failure of `kind` does.
    pub fn handling(&self, kind: FailureKind) -> Handling {
        match kind {
            FailureKind::Unavailable => Handling::Pause,
            FailureKind::TimedOut => self.timed_out,
            FailureKind::UnknownTopic => self.unknown_topic,
            FailureKind::Unauthorized => self.unauthorized,
            FailureKind::Transient => Handling::Attempt,
            FailureKind::Refused => Handling::DeadLetter,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_events_own_failures_spend_attempts_by_default() {
        let policy = FailurePolicy::default();
        let spends = |kind| matches!(policy.handling(kind), Handling::Attempt | Handling::DeadLetter);
        for kind in [
            FailureKind::Unavailable,
            FailureKind::TimedOut,
            FailureKind::UnknownTopic,
            FailureKind::Unauthorized,
        ] {
            assert!(!spends(kind), "{kind:?}");
        }
        assert!(spends(FailureKind::Transient));
        assert_eq!(policy.handling(FailureKind::Refused), Handling::DeadLetter);
    }

    #[test]
    fn the_ambiguous_kinds_are_configurable() {
        let policy: FailurePolicy =
            toml::from_str("timed_out = \"attempt\"\nunknown_topic = \"dead_letter\"").unwrap();
        assert_eq!(policy.handling(FailureKind::TimedOut), Handling::Attempt);
        assert_eq!(policy.handling(FailureKind::UnknownTopic), Handling::DeadLetter);
        assert_eq!(policy.handling(FailureKind::Unauthorized), Handling::Wait);
        let typo = toml::from_str::<FailurePolicy>("timeout = \"pause\"").unwrap_err();
        assert!(typo.to_string().contains("unknown field `timeout`"), "{typo}");
        let bad = toml::from_str::<FailurePolicy>("unauthorized = \"ignore\"").unwrap_err();
        assert!(bad.to_string().contains("unknown variant `ignore`"), "{bad}");
    }
}
