//! The types the store speaks in, whatever the backend: rows as claimed,
//! claims, outcomes, and what operators see.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use crate::config::{PublishedRows, RetentionMode};

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
    /// Targets an earlier event of its aggregate waits for (they are
    /// paused): this row's messages to them wait too, so that each target
    /// still gets the aggregate's events in order, while its messages to
    /// other targets go now (PostgreSQL; empty elsewhere).
    pub held_by: Vec<String>,
    /// Why the row cannot be relayed whatever its plugin says (an event id
    /// that is not a UUID): it is dead-lettered with this reason.
    pub malformed: Option<String>,
}

impl OutboxRow {
    /// Refuses a payload over `max` bytes, as `relay.max_payload_bytes`
    /// does at routing, as soon as the claim reads it, and lets it go: a
    /// batch of such rows must never be held in memory at once. `len` is
    /// the payload's size when the claim left the payload itself out.
    pub fn refuse_payload_over(&mut self, max: usize, len: Option<usize>) {
        let len = len.or_else(|| match (&self.payload_bytes, &self.payload_json) {
            (Some(bytes), _) => Some(bytes.len()),
            (None, json) => json.as_ref().map(String::len),
        });
        if let Some(len) = len
            && len > max
        {
            self.payload_json = None;
            self.payload_bytes = None;
            self.malformed.get_or_insert_with(|| payload_over_limit(len, max));
        }
    }
}

/// Why a payload of `len` bytes is refused.
pub fn payload_over_limit(len: usize, max: usize) -> String {
    format!("payload is {len} bytes, over relay.max_payload_bytes ({max})")
}

/// A claimed batch.
#[derive(Debug)]
pub struct Claim {
    /// The lease token every ack of this batch presents.
    pub lease: LeaseId,
    /// The rows, in id order; at most one per aggregate.
    pub rows: Vec<OutboxRow>,
    /// Local time after which the lease may already have been taken over.
    /// Work that would finish later must not start.
    pub deadline: Instant,
    /// How long the claim took, from the pool to the commit (it eats into the lease).
    pub took: Duration,
    /// How long the claim statement ran in the database, when it says
    /// (PostgreSQL): a slow claim with a short statement waited for a
    /// connection or the network, not for the database.
    pub statement: Option<Duration>,
    /// Rows the claim found waiting behind an earlier unfinished event of
    /// their aggregate and set aside (PostgreSQL). When it set some aside
    /// and claimed nothing, claiming again at once finds other rows.
    pub parked: usize,
    /// Whether claiming again right after this batch may find rows no
    /// wake-up will announce. On SQLite, whenever rows were claimed (an
    /// ack frees the next event of each aggregate). On PostgreSQL only when a row was left queued behind a predecessor another
    /// relay was acking: an ack that frees a parked row notifies by itself.
    pub look_again: bool,
}

impl Claim {
    /// A claim of `rows` (sorted here by id) under `lease`, made in one
    /// statement or transaction that started at `started`, on a backend
    /// where claiming again at once may find what no wake-up announces
    /// whenever rows were claimed (an ack frees the next event of each
    /// aggregate, and nothing notifies): SQLite, MySQL.
    pub(super) fn polled(
        lease: LeaseId,
        mut rows: Vec<OutboxRow>,
        started: Instant,
        length: Duration,
    ) -> Claim {
        rows.sort_by_key(|row| row.id);
        let look_again = !rows.is_empty();
        Claim {
            lease,
            rows,
            deadline: started + length,
            took: started.elapsed(),
            statement: None,
            parked: 0,
            look_again,
        }
    }
}

/// What happened to a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every target acknowledged (or the plugin dropped the event).
    Published,
    /// Try again after the delay.
    Retry {
        /// Backoff before the next attempt.
        after: Duration,
        /// Why, for `last_error`.
        error: String,
    },
    /// Not this row's fault (a target is down, its plugin is unloaded):
    /// try again later without spending an attempt.
    Defer {
        /// Delay before the next look; rows waiting on a target are woken
        /// sooner, when it is back.
        after: Duration,
        /// Why, for `last_error`.
        reason: String,
        /// The paused targets the row waits for (`waiting_on`).
        waiting_on: Vec<String>,
    },
    /// Give up; keep the row for inspection and replay.
    Dead {
        /// Why, for `last_error`.
        error: String,
    },
}

impl Outcome {
    pub(crate) fn status(&self) -> &'static str {
        match self {
            Outcome::Published => "published",
            Outcome::Retry { .. } | Outcome::Defer { .. } => "pending",
            Outcome::Dead { .. } => "dead",
        }
    }
}

/// The outcome of one row with the delivery state to store.
#[derive(Debug, Clone)]
pub struct RowOutcome {
    /// The row.
    pub id: RowId,
    /// What happened.
    pub outcome: Outcome,
    /// Per-target delivery state after this attempt.
    pub deliveries: BTreeMap<DeliveryKey, Delivery>,
    /// Content hash of the plugin version that routed it, if any did.
    pub plugin_version: Option<String>,
}

/// What `switchyard status` reports from the database.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OutboxStats {
    /// Rows not yet finished: pending, delayed and in flight.
    pub backlog: i64,
    /// Rows waiting for a claim (first try or a scheduled retry), not delayed.
    pub pending: i64,
    /// Rows whose writer set `not_before` in the future. Each holds back the
    /// later events of its aggregate until then.
    pub delayed: i64,
    /// Rows leased by a relay right now.
    pub in_flight: i64,
    /// Pending rows that already failed at least once.
    pub retrying: i64,
    /// Age of the oldest unfinished row, in seconds.
    pub oldest_pending_age_seconds: Option<f64>,
    /// Dead letters in total.
    pub dead: i64,
    /// Dead letters per event type.
    pub dead_by_event_type: BTreeMap<String, i64>,
    /// Pending rows waiting for each paused target to come back.
    pub waiting_on_targets: BTreeMap<String, i64>,
}

impl OutboxStats {
    /// From the status counts (pending, delayed, in flight, retrying) and
    /// dead letters per event type; the oldest age is left for the caller.
    pub(super) fn from_counts(counts: (i64, i64, i64, i64), dead_by_type: Vec<(String, i64)>) -> OutboxStats {
        let (pending, delayed, in_flight, retrying) = counts;
        OutboxStats {
            backlog: pending + delayed + in_flight,
            pending,
            delayed,
            in_flight,
            retrying,
            oldest_pending_age_seconds: None,
            dead: dead_by_type.iter().map(|(_, n)| n).sum(),
            dead_by_event_type: dead_by_type.into_iter().collect(),
            waiting_on_targets: BTreeMap::new(),
        }
    }
}

/// Selects dead letters. Empty fields match everything; set fields must all match.
#[derive(Debug, Clone, Default)]
pub struct DeadLetterFilter {
    /// Only these row ids.
    pub ids: Vec<i64>,
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this aggregate type.
    pub aggregate_type: Option<String>,
    /// Only this aggregate id.
    pub aggregate_id: Option<String>,
    /// Only events created at or after this time (ms since the epoch).
    pub created_since_ms: Option<i64>,
    /// Only events created before this time (ms since the epoch).
    pub created_before_ms: Option<i64>,
    /// Only rows whose `last_error` contains this text (case-insensitive).
    pub error_contains: Option<String>,
    /// Only rows with a delivery to this target that was not acknowledged.
    pub target: Option<String>,
}

impl DeadLetterFilter {
    /// A time bound as the filters take it: RFC 3339
    /// (`2026-11-22T10:00:00Z`) or a duration before now (`90m`, `2h`,
    /// `1d`), in milliseconds since the epoch.
    ///
    /// # Errors
    /// Neither form, said with both.
    pub fn time_ms(text: &str) -> Result<i64, String> {
        if let Ok(time) = chrono::DateTime::parse_from_rfc3339(text) {
            return Ok(time.timestamp_millis());
        }
        let ago = humantime::parse_duration(text).map_err(|_| {
            format!(
                "{text:?} is neither an RFC 3339 time (2026-11-22T10:00:00Z) nor a duration (90m, 2h, 1d)"
            )
        })?;
        let ago = i64::try_from(ago.as_millis()).unwrap_or(i64::MAX);
        Ok(chrono::Utc::now().timestamp_millis().saturating_sub(ago))
    }
}

/// One outbox row as an operator sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OutboxEntry {
    /// Row id.
    pub id: i64,
    /// Event id.
    pub event_id: String,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// `pending`, `in_flight`, `published` or `dead`.
    pub status: String,
    /// Claims so far.
    pub attempts: i32,
    /// When the service wrote the event (RFC 3339).
    pub created_at: String,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// Content hash of the plugin version that last routed it.
    pub plugin_version: Option<String>,
    /// Tenant.
    pub tenant: Option<String>,
    /// Headers.
    pub headers: serde_json::Value,
    /// JSON payload, when the row has one.
    pub payload: Option<serde_json::Value>,
    /// Size of the binary payload, when the row has one.
    pub payload_bytes_len: Option<i64>,
    /// Per-target delivery state.
    pub deliveries: BTreeMap<String, Delivery>,
}

/// A schema generation: the schema one release of the relay writes and
/// reads. A relay serves the current generation and the one before it, so
/// that old and new relays share a database during a rolling upgrade; an
/// older schema is not served until `switchyard migrate` brings it forward.
///
/// On PostgreSQL the previous generation is every migration up to
/// `20261203000000_ack_plans_what_it_uses`, the current one adds
/// `20261204000000_intake`. On SQLite the previous generation is every
/// migration up to `20261129000000_running_relays`, the current one adds
/// `20261201000000_database_ownership`. On MySQL and MariaDB the previous
/// generation is every migration up to `20261207000000_binlog_mode`, the
/// current one adds `20261209000000_parked_rows_apart`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generation {
    /// The schema of the release before this one.
    Previous,
    /// The schema every migration this build carries makes.
    Current,
}
