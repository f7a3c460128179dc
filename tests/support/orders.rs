//! The sample workload: order aggregates each emitting a sequence of events,
//! written by concurrent "service" tasks, and the checks a consumer makes.

use std::collections::{HashMap, HashSet};

use sqlx::PgPool;

use super::nats::Received;
use super::postgres::{NewEvent, Outbox, place_event};

/// What the test expects for one event.
#[derive(Debug, Clone)]
pub struct Expected {
    /// Aggregate id.
    pub aggregate_id: String,
    /// Position within the aggregate.
    pub seq: u64,
    /// Event type.
    pub event_type: String,
}

/// A broker message's `traceparent` continues the writer's trace (the row
/// carries trace id `aggregate + 1`, span id `seq + 1`, sampled) from the
/// relay's own span.
pub fn assert_trace_continued(traceparent: Option<&str>, want: &Expected) {
    let trace = traceparent.expect("a row with a traceparent gives its messages one");
    let parsed = switchyard::trace::TraceParent::parse(trace)
        .unwrap_or_else(|| panic!("malformed traceparent {trace:?}"));
    let aggregate: u128 = want
        .aggregate_id
        .trim_start_matches("order-")
        .parse()
        .unwrap_or_else(|_| panic!("unexpected aggregate id {}", want.aggregate_id));
    assert_eq!(
        parsed.trace_id,
        aggregate + 1,
        "same trace as the writer: {trace}"
    );
    assert_eq!(parsed.flags, 1, "sampled flag kept: {trace}");
    assert_ne!(
        u128::from(parsed.span_id),
        u128::from(want.seq) + 1,
        "the relay's span, not the writer's: {trace}"
    );
}

/// The `seq`-th event of order `aggregate`: created, then alternately paid
/// (carries a card number that must be masked) and shipped.
pub fn order_event(aggregate: usize, seq: usize) -> NewEvent {
    let id = format!("order-{aggregate}");
    let (event_type, payload) = match seq {
        0 => (
            "OrderCreated",
            serde_json::json!({ "order_id": id, "seq": seq, "total_cents": 1000 + aggregate }),
        ),
        s if s % 2 == 1 => (
            "OrderPaid",
            serde_json::json!({
                "order_id": id, "seq": seq,
                "card": { "number": "4111111111111111", "brand": "visa" },
                "internal_note": "fraud score 0.01",
            }),
        ),
        _ => (
            "OrderShipped",
            serde_json::json!({ "order_id": id, "seq": seq, "carrier": "dhl" }),
        ),
    };
    NewEvent {
        aggregate_type: "order".into(),
        aggregate_id: id,
        event_type: event_type.into(),
        payload,
        headers: serde_json::json!({
            "traceparent": format!("00-{:032x}-{:016x}-01", aggregate + 1, seq + 1),
        }),
    }
}

/// Writes `per_aggregate` events for each of `aggregates` orders from
/// `writers` concurrent tasks, each owning a share of the aggregates so that
/// one aggregate's events are committed in sequence. Returns what to expect.
pub async fn write_orders(
    pool: &PgPool,
    aggregates: usize,
    per_aggregate: usize,
    writers: usize,
) -> HashMap<String, Expected> {
    write_orders_to(pool, Outbox::Switchyard, aggregates, per_aggregate, writers).await
}

/// [`write_orders`] into the given outbox table.
pub async fn write_orders_to(
    pool: &PgPool,
    outbox: Outbox,
    aggregates: usize,
    per_aggregate: usize,
    writers: usize,
) -> HashMap<String, Expected> {
    let mut tasks = Vec::new();
    for writer in 0..writers {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let mut written = Vec::new();
            for seq in 0..per_aggregate {
                for aggregate in (writer..aggregates).step_by(writers) {
                    let event = order_event(aggregate, seq);
                    let id = place_event(&pool, outbox, &event, true).await;
                    written.push((
                        id.to_string(),
                        Expected {
                            aggregate_id: event.aggregate_id,
                            seq: seq as u64,
                            event_type: event.event_type,
                        },
                    ));
                }
            }
            written
        }));
    }
    let mut expected = HashMap::new();
    for task in tasks {
        expected.extend(task.await.expect("writer task"));
    }
    expected
}

/// What a consumer found.
#[derive(Debug, Default)]
pub struct Verdict {
    /// Distinct events received.
    pub distinct: usize,
    /// Extra copies received (at-least-once redeliveries).
    pub duplicates: usize,
}

/// Checks every received message against the expectation: all events there,
/// none unknown, subject, key and headers right, payload transformed as the
/// plugins say, and per aggregate the first copies arrive in order.
///
/// # Panics
/// On the first violation, saying what it was.
pub fn verify(received: &[Received], expected: &HashMap<String, Expected>) -> Verdict {
    let mut seen = HashSet::new();
    let mut next_seq: HashMap<&str, u64> = HashMap::new();
    let mut verdict = Verdict::default();
    for message in received {
        let id = message
            .header("Switchyard-Event-Id")
            .expect("event id header on every message");
        let want = expected
            .get(id)
            .unwrap_or_else(|| panic!("unexpected event {id}"));
        assert_eq!(
            message.header("Nats-Msg-Id"),
            Some(id),
            "JetStream dedup id is the event id"
        );
        if !seen.insert(id.to_string()) {
            verdict.duplicates += 1;
            continue;
        }
        assert_eq!(message.subject, format!("orders.{}", want.event_type));
        assert_eq!(message.header("Switchyard-Key"), Some(want.aggregate_id.as_str()));
        assert_eq!(
            message.header("Switchyard-Event-Type"),
            Some(want.event_type.as_str())
        );
        assert_trace_continued(message.header("traceparent"), want);
        let plugin = message
            .header("Switchyard-Plugin")
            .expect("plugin version header");
        let json = message.json();
        let data = if want.event_type == "OrderPaid" {
            assert!(plugin.starts_with("redact@"), "{plugin}");
            assert_eq!(json["specversion"], "1.0");
            assert_eq!(json["id"], id);
            assert_eq!(json["source"], "/order-service");
            assert_eq!(json["data"]["card"]["number"], "***", "card number masked");
            assert_eq!(json["data"]["card"]["brand"], "visa");
            assert!(
                json["data"].get("internal_note").is_none(),
                "internal note removed"
            );
            json["data"].clone()
        } else {
            assert!(plugin.starts_with("router@"), "{plugin}");
            json
        };
        assert_eq!(data["seq"], want.seq);
        let next = next_seq.entry(want.aggregate_id.as_str()).or_insert(0);
        assert_eq!(
            want.seq, *next,
            "aggregate {} out of order: got seq {} expecting {}",
            want.aggregate_id, want.seq, *next
        );
        *next += 1;
    }
    verdict.distinct = seen.len();
    assert_eq!(verdict.distinct, expected.len(), "every event arrives");
    verdict
}

/// What a consumer counted, without judging: for runs that report figures
/// (the long fault run) rather than fail at the first violation.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    /// Messages received, copies included.
    pub received: usize,
    /// Expected events never received.
    pub lost: usize,
    /// Extra copies of events already received.
    pub duplicates: usize,
    /// First copies that arrived before an earlier event of their aggregate.
    pub reordered: usize,
    /// Messages for events nobody wrote.
    pub unknown: usize,
}

/// Counts lost, duplicated, reordered and unknown events in what a consumer
/// received, by event id and per-aggregate sequence alone: independent of
/// what the relay believes it did.
pub fn tally(received: &[Received], expected: &HashMap<String, Expected>) -> Tally {
    let mut seen = HashSet::new();
    let mut last_seq: HashMap<&str, u64> = HashMap::new();
    let mut tally = Tally {
        received: received.len(),
        ..Tally::default()
    };
    for message in received {
        let Some(want) = message
            .header("Switchyard-Event-Id")
            .and_then(|id| expected.get_key_value(id))
        else {
            tally.unknown += 1;
            continue;
        };
        if !seen.insert(want.0.as_str()) {
            tally.duplicates += 1;
            continue;
        }
        let want = want.1;
        // The next sequence number this aggregate should show.
        let next = last_seq.entry(want.aggregate_id.as_str()).or_insert(0);
        if want.seq != *next {
            tally.reordered += 1;
        }
        *next = want.seq + 1;
    }
    tally.lost = expected.len() - seen.len();
    tally
}
