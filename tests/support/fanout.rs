//! The fan-out pipeline the Kafka and existing-table tests share: every
//! event to Kafka `orders`, a second cluster's `orders-analytics` and NATS
//! `audit.orders.<EventType>`, and the checks a consumer of each makes.

use std::collections::{HashMap, HashSet};

use super::config::{Plugin, Target, TestConfig, routes};
use super::kafka::KafkaReceived;
use super::nats::Received;
use super::orders::{Expected, assert_trace_continued};
use super::plugins::plugin;
use super::relay::RelaySection;

/// The NATS stream holding `audit.>`.
pub const AUDIT_STREAM: &str = "AUDIT";

/// Relay tuning for these tests: many attempts (a broker is stopped on purpose), short backoff.
pub fn relay_section() -> RelaySection {
    RelaySection::new()
        .set("max_attempts", "100")
        .set("max_backoff_ms", "500")
        .set("shutdown_timeout_ms", "5000")
}

/// Every event goes to Kafka `orders` (keyed by order id), to the second
/// cluster's `orders-analytics`, and to NATS `audit.orders.<EventType>`.
pub fn fan_out(relay: &RelaySection, db: &str, kafka: &str, analytics: &str, nats: &str) -> TestConfig {
    TestConfig::new(db)
        .database("max_connections", 8)
        .tuning(relay.clone())
        .plugin(Plugin::new("fanout", &plugin("fan_out")).config(
            "default",
            routes(&[
                ("kafka", "orders", Some("{aggregate_id}")),
                ("analytics", "orders-analytics", None),
                ("audit", "audit.orders.{event_type}", None),
            ]),
        ))
        .target("kafka", Target::kafka(kafka).property("linger.ms", "2"))
        .target("analytics", Target::kafka(analytics))
        .target("audit", Target::nats(nats))
}

/// [`fan_out`] as TOML.
pub fn fan_out_config(relay: &RelaySection, db: &str, kafka: &str, analytics: &str, nats: &str) -> String {
    fan_out(relay, db, kafka, analytics, nats).toml()
}

/// How many copies of an event a check accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copies {
    /// Exactly one (a run without crashes).
    Once,
    /// At least one (a relay was killed between publish and ack); order is
    /// judged on first copies, as a deduplicating consumer sees them.
    AtLeastOnce,
}

/// Checks one Kafka topic: every event there, each aggregate in a single
/// partition in offset order, key and headers as the row had them. Returns
/// the extra copies.
///
/// # Panics
/// On the first violation.
pub fn verify_kafka(
    received: &[KafkaReceived],
    expected: &HashMap<String, Expected>,
    copies: Copies,
) -> usize {
    let mut seen = HashSet::new();
    let mut duplicates = 0;
    let mut by_aggregate: HashMap<&str, Vec<&KafkaReceived>> = HashMap::new();
    for message in received {
        let id = message.header("Switchyard-Event-Id").expect("event id header");
        let want = expected
            .get(id)
            .unwrap_or_else(|| panic!("unexpected event {id}"));
        if !seen.insert(id) {
            assert_eq!(copies, Copies::AtLeastOnce, "event {id} arrived twice on Kafka");
            duplicates += 1;
        }
        assert_eq!(
            message.header("Switchyard-Event-Type"),
            Some(want.event_type.as_str())
        );
        assert_trace_continued(message.header("traceparent"), want);
        assert_eq!(message.json()["seq"], want.seq);
        assert_eq!(message.key.as_deref(), Some(want.aggregate_id.as_str()));
        by_aggregate
            .entry(want.aggregate_id.as_str())
            .or_default()
            .push(message);
    }
    assert_eq!(seen.len(), expected.len(), "every event on Kafka");
    for (aggregate, mut messages) in by_aggregate {
        let partitions: HashSet<i32> = messages.iter().map(|m| m.partition).collect();
        assert_eq!(
            partitions.len(),
            1,
            "{aggregate} spread over partitions {partitions:?}"
        );
        messages.sort_by_key(|m| m.offset);
        let mut first = HashSet::new();
        let seqs: Vec<u64> = messages
            .iter()
            .filter(|m| first.insert(m.header("Switchyard-Event-Id")))
            .map(|m| m.json()["seq"].as_u64().unwrap())
            .collect();
        let ordered: Vec<u64> = (0..seqs.len() as u64).collect();
        assert_eq!(seqs, ordered, "{aggregate} out of offset order");
    }
    duplicates
}

/// Checks the NATS audit stream: every event once (JetStream drops copies
/// by `Nats-Msg-Id`), per aggregate in stream order.
///
/// # Panics
/// On the first violation.
pub fn verify_nats(received: &[Received], expected: &HashMap<String, Expected>) {
    let mut seen = HashSet::new();
    let mut next: HashMap<&str, u64> = HashMap::new();
    for message in received {
        let id = message.header("Switchyard-Event-Id").expect("event id header");
        let want = expected
            .get(id)
            .unwrap_or_else(|| panic!("unexpected event {id}"));
        assert!(seen.insert(id), "event {id} arrived twice on NATS");
        assert_eq!(message.subject, format!("audit.orders.{}", want.event_type));
        assert_eq!(message.header("Nats-Msg-Id"), Some(id));
        assert_trace_continued(message.header("traceparent"), want);
        let slot = next.entry(want.aggregate_id.as_str()).or_insert(0);
        assert_eq!(
            message.json()["seq"],
            *slot,
            "{} out of order on NATS",
            want.aggregate_id
        );
        *slot += 1;
    }
    assert_eq!(seen.len(), expected.len(), "every event on NATS");
}
