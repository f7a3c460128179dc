//! The claim and ack logic against real databases, one file per promise:
//! order, fencing, rows as writers leave them, dead letters, the schema,
//! and cost. Each
//! body runs on PostgreSQL, SQLite and MariaDB where each can show it;
//! late commits, which SQLite's single writer cannot produce, on the
//! servers only.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use switchyard::store::{
    Delivery, Generation, OutboxRow, OutboxStore, Outcome, PublishedRows, RowId, RowOutcome,
};
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::postgres::{
    INTAKE_MIGRATION, NewEvent, Outbox, fresh_db, fresh_db_before, move_first_intake_row, place_event,
    place_order_event,
};
use switchyard_tests::stall::{StallingProxy, gives_up_unanswered};

const LEASE: Duration = Duration::from_secs(30);

/// Runs a test body on every backend: PostgreSQL, SQLite and MariaDB.
macro_rules! on_every_backend {
    ($($body:ident),* $(,)?) => {$(
        mod $body {
            #[tokio::test]
            async fn postgres() {
                super::$body(switchyard_tests::outbox::TestOutbox::postgres().await).await;
            }
            #[tokio::test]
            async fn sqlite() {
                super::$body(switchyard_tests::outbox::TestOutbox::sqlite().await).await;
            }
            #[tokio::test]
            async fn mariadb() {
                super::$body(switchyard_tests::outbox::TestOutbox::mariadb().await).await;
            }
        }
    )*};
}

/// Runs a test body on the backends many relays share: PostgreSQL and
/// MariaDB (SQLite has one writer; what it shows needs concurrent ones).
macro_rules! on_shared_backends {
    ($($body:ident),* $(,)?) => {$(
        mod $body {
            #[tokio::test]
            async fn postgres() {
                super::$body(switchyard_tests::outbox::TestOutbox::postgres().await).await;
            }
            #[tokio::test]
            async fn mariadb() {
                super::$body(switchyard_tests::outbox::TestOutbox::mariadb().await).await;
            }
        }
    )*};
}

mod cost;
mod dead_letters;
mod fencing;
mod order;
mod parked;
mod rows;
mod schema;

fn event(aggregate: usize, seq: usize) -> NewEvent {
    NewEvent {
        aggregate_type: "order".into(),
        aggregate_id: format!("o-{aggregate}"),
        event_type: "OrderUpdated".into(),
        payload: serde_json::json!({ "seq": seq }),
        headers: serde_json::json!({}),
    }
}

/// Acks every row of `claim` as published.
async fn publish_all(store: &OutboxStore, claim: &switchyard::store::Claim) {
    let outcomes: Vec<_> = claim
        .rows
        .iter()
        .map(|row| outcome(row.id, Outcome::Published))
        .collect();
    store.ack(claim.lease, &outcomes).await.unwrap();
}

fn outcome(id: RowId, outcome: Outcome) -> RowOutcome {
    RowOutcome {
        id,
        outcome,
        deliveries: BTreeMap::new(),
        plugin_version: None,
    }
}

fn seq(row: &OutboxRow) -> u64 {
    let payload: serde_json::Value = serde_json::from_str(row.payload_json.as_deref().unwrap()).unwrap();
    payload["seq"].as_u64().unwrap()
}
