//! Unit tests of the routing rules.

use super::*;
use crate::store::RowId;
use std::collections::BTreeMap;

const LIMITS: Limits = Limits {
    max_payload_bytes: 64,
    max_message_bytes: 64,
    max_messages_per_event: 4,
    max_topic_bytes: 64,
};

fn row() -> OutboxRow {
    OutboxRow {
        id: RowId(7),
        event_id: uuid::Uuid::nil(),
        aggregate_type: "order".into(),
        aggregate_id: "o-1".into(),
        event_type: "OrderCreated".into(),
        payload_json: Some(r#"{"total": 5}"#.into()),
        payload_bytes: None,
        headers_json: r#"{"traceparent": "00-abc-def-01"}"#.into(),
        tenant: None,
        created_at_ms: 1,
        attempts: 2,
        deliveries: BTreeMap::new(),
        malformed: None,
        held_by: Vec::new(),
    }
}

fn message(target: &str, topic: &str) -> Message {
    Message {
        target: target.into(),
        topic: topic.into(),
        key: Some("o-1".into()),
        payload: b"{}".to_vec(),
        headers: vec![
            ("Switchyard-Event-Id".into(), "forged".into()),
            ("x".into(), "1".into()),
        ],
    }
}

#[test]
fn builds_event_with_headers_and_attempt() {
    let event = event_from_row(&row(), &LIMITS).unwrap();
    assert_eq!(event.attempt, 2);
    assert_eq!(event.payload_format, PayloadFormat::Json);
    assert_eq!(
        event.headers,
        vec![("traceparent".into(), "00-abc-def-01".into())]
    );
}

#[test]
fn rejects_null_oversized_and_malformed_rows() {
    let mut null = row();
    null.payload_json = None;
    let error = event_from_row(&null, &LIMITS).unwrap_err();
    assert_eq!(error, Unroutable::NullPayload);
    assert!(error.to_string().contains("payload is NULL"));

    let mut big = row();
    big.payload_json = Some(format!("\"{}\"", "x".repeat(100)));
    let error = event_from_row(&big, &LIMITS).unwrap_err();
    assert_eq!(error, Unroutable::PayloadTooLarge { size: 102, limit: 64 });
    assert!(error.to_string().contains("max_payload_bytes"));

    let mut bad = row();
    bad.headers_json = r#"{"n": 5}"#.into();
    let error = event_from_row(&bad, &LIMITS).unwrap_err();
    assert!(
        matches!(&error, Unroutable::Headers(HeadersProblem::NotString { name, kind: "a number" }) if name == "n"),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "headers column header \"n\" must be a string, got a number"
    );
    bad.headers_json = "[1]".into();
    assert_eq!(
        event_from_row(&bad, &LIMITS).unwrap_err().to_string(),
        "headers column must be a JSON object, got an array"
    );
}

#[test]
fn binary_payload_wins_over_json() {
    let mut binary = row();
    binary.payload_bytes = Some(vec![0, 1, 2]);
    let event = event_from_row(&binary, &LIMITS).unwrap();
    assert_eq!(event.payload_format, PayloadFormat::Binary);
    assert_eq!(event.payload, vec![0, 1, 2]);
}

#[test]
fn assembles_with_relay_headers_winning() {
    let event = event_from_row(&row(), &LIMITS).unwrap();
    let routed = assemble(
        &event,
        vec![
            message("nats", "orders"),
            message("nats", "orders"),
            message("kafka", "orders"),
        ],
        "p@abc",
        &LIMITS,
        &|_| Some(true),
        None,
    )
    .unwrap();
    let keys: Vec<_> = routed.iter().map(|r| r.delivery_key.as_str()).collect();
    assert_eq!(keys, ["nats:orders#0", "nats:orders#1", "kafka:orders#0"]);
    let headers = &routed[0].message.headers;
    let get = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    assert_eq!(get(EVENT_ID_HEADER), Some(uuid::Uuid::nil().to_string().as_str()));
    assert_eq!(get("traceparent"), Some("00-abc-def-01"));
    assert_eq!(get("x"), Some("1"));
    assert_eq!(get(PLUGIN_HEADER), Some("p@abc"));
}

#[test]
fn dedup_ids_differ_per_message_even_across_targets() {
    let event = event_from_row(&row(), &LIMITS).unwrap();
    let assembled = |messages| assemble(&event, messages, "p@abc", &LIMITS, &|_| Some(true), None).unwrap();
    let single = assembled(vec![message("nats", "orders")]);
    assert_eq!(single[0].message.dedup_id, event.event_id);

    // Two NATS targets may write into one stream: one id each.
    let two = assembled(vec![message("nats-a", "orders"), message("nats-b", "orders")]);
    let ids: Vec<_> = two.iter().map(|r| r.message.dedup_id.clone()).collect();
    assert_eq!(
        ids,
        [
            format!("{}:nats-a:orders#0", event.event_id),
            format!("{}:nats-b:orders#0", event.event_id)
        ]
    );
    // Stable across attempts: the same answer gives the same ids.
    let again = assembled(vec![message("nats-a", "orders"), message("nats-b", "orders")]);
    assert_eq!(again[1].message.dedup_id, ids[1]);

    // Targets that ignore ids (Kafka) do not count: one JetStream
    // message among them keeps the bare event id.
    let only_nats_dedups = |t: &str| Some(t == "nats");
    let fan_out = assemble(
        &event,
        vec![message("kafka", "orders"), message("nats", "audit")],
        "p@abc",
        &LIMITS,
        &only_nats_dedups,
        None,
    )
    .unwrap();
    assert_eq!(fan_out[1].message.dedup_id, event.event_id);
}

#[test]
fn the_relay_span_replaces_the_writers_traceparent() {
    let event = event_from_row(&row(), &LIMITS).unwrap();
    let relay_span = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    let mut plugin_says = message("nats", "orders");
    plugin_says
        .headers
        .push(("traceparent".into(), "00-from-the-plugin-01".into()));
    let routed = assemble(
        &event,
        vec![plugin_says],
        "p@abc",
        &LIMITS,
        &|_| Some(true),
        relay_span.as_ref(),
    )
    .unwrap();
    let values: Vec<_> = routed[0]
        .message
        .headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("traceparent"))
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(
        values,
        ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]
    );
}

#[test]
fn refuses_bad_plugin_output_with_specific_errors() {
    let event = event_from_row(&row(), &LIMITS).unwrap();
    let known = |t: &str| (t == "nats").then_some(true);
    let err = |m: Message| {
        let error = assemble(&event, vec![m], "p@abc", &LIMITS, &known, None).unwrap_err();
        assert_eq!(error.plugin, "p@abc");
        error.problem
    };

    let unknown = err(message("nope", "t"));
    assert_eq!(unknown.kind(), "unknown_target");
    assert_eq!(unknown.to_string(), "message 0: unknown target \"nope\"");
    assert_eq!(err(message("nats", " ")).kind(), "empty_topic");
    let mut big = message("nats", "t");
    big.payload = vec![0; 65];
    assert_eq!(
        err(big),
        OutputProblem::PayloadTooLarge {
            index: 0,
            size: 65,
            limit: 64
        }
    );
    let mut header = message("nats", "t");
    header.headers.push(("bad name".into(), "v".into()));
    assert_eq!(
        err(header),
        OutputProblem::BadHeader {
            index: 0,
            problem: HeaderProblem::InvalidName("bad name".into())
        }
    );
    let mut key = message("nats", "t");
    key.key = Some("k\ney".into());
    assert_eq!(
        err(key),
        OutputProblem::BadHeader {
            index: 0,
            problem: HeaderProblem::BreakInValue("key".into())
        }
    );
    for topic in ["orders\u{0}x", "orders\nx", "a\u{1b}[31m"] {
        let error = err(message("nats", topic));
        assert_eq!(error.kind(), "control_in_topic", "{topic:?}: {error}");
    }
    let error = err(message("nats", &"t".repeat(65)));
    assert!(
        matches!(error, OutputProblem::TopicTooLong { size: 65, .. }),
        "{error}"
    );
    let mut many = message("nats", "t");
    many.headers = (0..300).map(|i| (format!("h{i}"), String::new())).collect();
    assert!(matches!(
        err(many),
        OutputProblem::TooManyHeaders { count: 300, .. }
    ));
    let mut huge = message("nats", "t");
    huge.headers.push(("h".into(), "v".repeat(40)));
    assert_eq!(err(huge).kind(), "message_too_large");
    let many = vec![message("nats", "t"); 5];
    let error = assemble(&event, many, "p@abc", &LIMITS, &known, None).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "plugin p@abc returned 5 messages, more than the {} allowed per event",
            LIMITS.max_messages_per_event
        )
    );
}
