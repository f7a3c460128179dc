//! Why a row cannot be routed, and why a plugin's answer is refused: each
//! as a type with its facts, whose text is the dead letter's reason.

/// Why a row cannot become an event; it is dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unroutable {
    /// The store could not read it (a column of the wrong type...).
    #[error("{0}")]
    Malformed(String),
    /// Neither `payload` nor `payload_bytes` is set.
    #[error("payload is NULL (set payload or payload_bytes)")]
    NullPayload,
    /// Over `relay.max_payload_bytes`.
    #[error("payload is {size} bytes, over relay.max_payload_bytes ({limit})")]
    PayloadTooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The `headers` column.
    #[error("headers column {0}")]
    Headers(HeadersProblem),
}

/// What is wrong with a row's `headers` column.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadersProblem {
    /// Not JSON.
    #[error("is not valid JSON: {0}")]
    NotJson(String),
    /// JSON, but not an object.
    #[error("must be a JSON object, got {0}")]
    NotObject(&'static str),
    /// A value that is not a string.
    #[error("header {name:?} must be a string, got {kind}")]
    NotString {
        /// The header.
        name: String,
        /// What it is instead.
        kind: &'static str,
    },
    /// A name or value no broker can carry.
    #[error("{0}")]
    Header(HeaderProblem),
}

/// A header no broker can carry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderProblem {
    /// Empty, or not printable ASCII without ':' and spaces.
    #[error("header name {0:?} is invalid (printable ASCII without ':' or spaces)")]
    InvalidName(String),
    /// A CR, LF or NUL in the value.
    #[error("header {0:?} has a line break or NUL in its value")]
    BreakInValue(String),
}

/// A plugin's answer the relay will not send; the row is dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("plugin {plugin} {problem}")]
pub struct BadOutput {
    /// `name@version`.
    pub plugin: String,
    /// What is wrong.
    pub problem: OutputProblem,
}

/// What is wrong with a plugin's answer. Each message problem names the
/// message by its index in the answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutputProblem {
    /// More messages than one event may fan out to.
    #[error("returned {count} messages, more than the {limit} allowed per event")]
    TooManyMessages {
        /// Returned.
        count: usize,
        /// Allowed.
        limit: usize,
    },
    /// A target that is not configured.
    #[error("message {index}: unknown target {target:?}")]
    UnknownTarget {
        /// The message.
        index: usize,
        /// The target it named.
        target: String,
    },
    /// A blank topic.
    #[error("message {index}: empty topic for target {target:?}")]
    EmptyTopic {
        /// The message.
        index: usize,
        /// Its target.
        target: String,
    },
    /// A control character in the topic.
    #[error("message {index}: topic {topic:?} for target {target:?} contains a control character")]
    ControlInTopic {
        /// The message.
        index: usize,
        /// Its target.
        target: String,
        /// The topic.
        topic: String,
    },
    /// A topic over [`Limits::MAX_TOPIC_BYTES`].
    #[error("message {index}: topic for target {target:?} is {size} bytes, over the {limit} allowed")]
    TopicTooLong {
        /// The message.
        index: usize,
        /// Its target.
        target: String,
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A payload over `relay.max_message_bytes`.
    #[error("message {index}: payload is {size} bytes, over relay.max_message_bytes ({limit})")]
    PayloadTooLarge {
        /// The message.
        index: usize,
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// More headers than [`Limits::MAX_HEADERS`].
    #[error("message {index}: {count} headers, more than the {limit} allowed")]
    TooManyHeaders {
        /// The message.
        index: usize,
        /// Set.
        count: usize,
        /// Allowed.
        limit: usize,
    },
    /// Payload and headers over `relay.max_message_bytes`.
    #[error("message {index}: payload and headers are {size} bytes, over relay.max_message_bytes ({limit})")]
    MessageTooLarge {
        /// The message.
        index: usize,
        /// Payload and headers.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A header (or the key) no broker can carry.
    #[error("message {index}: {problem}")]
    BadHeader {
        /// The message.
        index: usize,
        /// What is wrong.
        problem: HeaderProblem,
    },
}

impl OutputProblem {
    /// A stable name for the problem, for reports and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            OutputProblem::TooManyMessages { .. } => "too_many_messages",
            OutputProblem::UnknownTarget { .. } => "unknown_target",
            OutputProblem::EmptyTopic { .. } => "empty_topic",
            OutputProblem::ControlInTopic { .. } => "control_in_topic",
            OutputProblem::TopicTooLong { .. } => "topic_too_long",
            OutputProblem::PayloadTooLarge { .. } => "payload_too_large",
            OutputProblem::TooManyHeaders { .. } => "too_many_headers",
            OutputProblem::MessageTooLarge { .. } => "message_too_large",
            OutputProblem::BadHeader { .. } => "bad_header",
        }
    }
}
