//! Types for outbox rows as the relay sees them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The outbox row id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RowId(pub i64);

impl std::fmt::Display for RowId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The token of one claim; acks must present it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub uuid::Uuid);

/// Identifies one message of a row across attempts: target, topic and the
/// message's ordinal among messages with the same target and topic.
pub type DeliveryKey = String;

/// The record of one acknowledged delivery, stored in `deliveries`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// Target name.
    pub target: String,
    /// Topic or subject.
    pub topic: String,
    /// When the target acknowledged, RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acked_at: Option<String>,
    /// The last error for this delivery, if it is not acknowledged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A claimed outbox row.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    /// Row id.
    pub id: RowId,
    /// Event id (UUID).
    pub event_id: uuid::Uuid,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// JSON text of `payload`, when the row has one.
    pub payload_json: Option<String>,
    /// `payload_bytes`, when the row has them.
    pub payload_bytes: Option<Vec<u8>>,
    /// `headers` as JSON text.
    pub headers_json: String,
    /// Tenant.
    pub tenant: Option<String>,
    /// Creation time, ms since the epoch.
    pub created_at_ms: i64,
    /// This attempt's number (1 on the first claim).
    pub attempts: i32,
    /// Deliveries acknowledged by earlier attempts.
    pub deliveries: BTreeMap<DeliveryKey, Delivery>,
    /// Why the row cannot be relayed whatever its plugin says (an event id
    /// that is not a UUID): it is dead-lettered with this reason.
    pub malformed: Option<String>,
}
