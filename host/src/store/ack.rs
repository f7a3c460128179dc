//! Recording outcomes: published, retry later, or dead-lettered, all rows of a
//! batch in one statement, fenced by the lease token.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::{PgPool, Row};

use super::row::{Delivery, DeliveryKey, LeaseId, RowId};
use super::{Error, OutboxStore};

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
    /// Not this row's fault (its plugin is unloaded): try again later
    /// without spending an attempt.
    Defer {
        /// Delay before the next look.
        after: Duration,
        /// Why, for `last_error`.
        reason: String,
    },
    /// Give up; keep the row for inspection and replay.
    Dead {
        /// Why, for `last_error`.
        error: String,
    },
}

impl Outcome {
    pub(super) fn status(&self) -> &'static str {
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

const ACK_SQL: &str = r#"
UPDATE switchyard_outbox o
   SET status = d.status,
       published_at = CASE WHEN d.status = 'published' THEN now() ELSE NULL END,
       next_attempt_at = CASE WHEN d.status = 'pending'
                              THEN now() + d.backoff_ms * interval '1 millisecond'
                              ELSE o.next_attempt_at END,
       last_error = d.error,
       attempts = o.attempts - CASE WHEN d.refund THEN 1 ELSE 0 END,
       deliveries = d.deliveries::jsonb,
       plugin_version = COALESCE(d.plugin_version, o.plugin_version),
       lease_owner = NULL,
       lease_id = NULL,
       lease_expires_at = NULL
  FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::text[], $7::bool[])
       AS d(id, status, backoff_ms, error, deliveries, plugin_version, refund)
 WHERE o.id = d.id
   AND o.status = 'in_flight'
   AND o.lease_id = $8
RETURNING o.id
"#;

/// The `deliveries` column as JSON text. jsonb refuses the NUL character
/// (`\u0000`), which a topic or a broker's error text may carry.
pub(super) fn deliveries_json(deliveries: &BTreeMap<DeliveryKey, Delivery>) -> String {
    let json = serde_json::to_string(deliveries).unwrap_or_else(|_| "{}".into());
    if json.contains("\\u0000") {
        json.replace("\\u0000", "\\ufffd")
    } else {
        json
    }
}

impl OutboxStore {
    /// Records the outcomes of a batch claimed under `lease`. Rows whose lease
    /// was lost (expired and re-claimed elsewhere) are left alone; the
    /// returned list holds the ids that were actually updated.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub(super) async fn ack_pg(
        pool: &PgPool,
        lease: LeaseId,
        outcomes: &[RowOutcome],
    ) -> Result<Vec<RowId>, Error> {
        let mut ids = Vec::with_capacity(outcomes.len());
        let mut statuses = Vec::with_capacity(outcomes.len());
        let mut backoffs = Vec::with_capacity(outcomes.len());
        let mut errors = Vec::with_capacity(outcomes.len());
        let mut deliveries = Vec::with_capacity(outcomes.len());
        let mut versions = Vec::with_capacity(outcomes.len());
        let mut refunds = Vec::with_capacity(outcomes.len());
        for row in outcomes {
            ids.push(row.id.0);
            statuses.push(row.outcome.status());
            let (backoff, error) = match &row.outcome {
                Outcome::Published => (0, None),
                Outcome::Retry { after, error } => (
                    i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                    Some(error.clone()),
                ),
                Outcome::Defer { after, reason } => (
                    i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
                    Some(reason.clone()),
                ),
                Outcome::Dead { error } => (0, Some(error.clone())),
            };
            refunds.push(matches!(row.outcome, Outcome::Defer { .. }));
            backoffs.push(backoff);
            // PostgreSQL text cannot hold NUL; plugin-supplied reasons might.
            errors.push(error.map(|e| e.replace('\0', "\u{FFFD}")));
            deliveries.push(deliveries_json(&row.deliveries));
            versions.push(row.plugin_version.clone());
        }
        let updated = sqlx::query(ACK_SQL)
            .bind(&ids)
            .bind(&statuses)
            .bind(&backoffs)
            .bind(&errors)
            .bind(&deliveries)
            .bind(&versions)
            .bind(&refunds)
            .bind(lease.0)
            .fetch_all(pool)
            .await?;
        updated
            .iter()
            .map(|row| row.try_get::<i64, _>("id").map(RowId))
            .collect::<Result<_, _>>()
            .map_err(Error::from)
    }
}
