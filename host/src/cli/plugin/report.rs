//! What `plugin test` reports: per event, the outcome and the messages
//! that would be published, as JSON or as text safe for a terminal.

use std::collections::BTreeMap;

use crate::cli::terminal::field;

/// What `plugin test` found for one event.
#[derive(Debug, serde::Serialize)]
pub(super) struct EventReport {
    /// The event (absent when the row could not be read as an event).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) event: Option<EventSummary>,
    /// `published`, `dropped`, `invalid_output`, `refused_transient`,
    /// `refused_permanent`, `crashed` or `not_routable`.
    pub(super) outcome: &'static str,
    /// Why, unless published or dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reason: Option<String>,
    /// For `invalid_output`, what is wrong, as a stable name
    /// (`unknown_target`, `empty_topic`, `payload_too_large`...,
    /// `refused_by_target`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) problem: Option<&'static str>,
    /// How long the `route` call took, in microseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) took_us: Option<u64>,
    /// What would be published.
    pub(super) messages: Vec<MessageReport>,
}

#[derive(Debug, serde::Serialize)]
pub(super) struct EventSummary {
    pub(super) event_id: String,
    pub(super) aggregate_type: String,
    pub(super) aggregate_id: String,
    pub(super) event_type: String,
}

#[derive(Debug, serde::Serialize)]
pub(super) struct MessageReport {
    pub(super) target: String,
    pub(super) topic: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) key: Option<String>,
    pub(super) headers: BTreeMap<String, String>,
    /// The payload as text, when it is UTF-8.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) payload: Option<String>,
    /// The payload in base64, when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_base64: Option<String>,
}

impl EventReport {
    pub(super) fn published(&self) -> bool {
        matches!(self.outcome, "published" | "dropped")
    }
}

/// The whole `plugin test` run, as `--json` prints it.
#[derive(Debug, serde::Serialize)]
pub(super) struct TestReport {
    pub(super) plugin: String,
    pub(super) compile_ms: u64,
    pub(super) events: Vec<EventReport>,
    /// Events that would not be published.
    pub(super) failed: usize,
}

pub(super) fn message_report(routed: crate::relay::router::Routed) -> MessageReport {
    use base64::Engine;
    let m = routed.message;
    let (payload, payload_base64) = match String::from_utf8(m.payload.to_vec()) {
        Ok(text) => (Some(text), None),
        Err(_) => (
            None,
            Some(base64::engine::general_purpose::STANDARD.encode(&m.payload)),
        ),
    };
    MessageReport {
        target: routed.target,
        topic: m.topic,
        key: m.key,
        headers: m.headers.into_iter().collect(),
        payload,
        payload_base64,
    }
}

/// The report for people.
pub(super) fn print_human(report: &TestReport) {
    print!("{}", render_human(report));
}

/// The report as text. Everything in it but its own words comes from the
/// plugin or the events file: shown with control characters escaped, one
/// field per line, so a plugin cannot write to the terminal.
fn render_human(report: &TestReport) -> String {
    use std::fmt::Write;

    let mut out = String::new();
    let mut line = |text: std::fmt::Arguments<'_>| {
        let _ = out.write_fmt(text);
        out.push('\n');
    };
    line(format_args!(
        "plugin {} loaded in {} ms",
        field(&report.plugin),
        report.compile_ms
    ));
    for event in &report.events {
        match &event.event {
            Some(e) => line(format_args!(
                "\nevent {} {}/{} {}",
                field(&e.event_id),
                field(&e.aggregate_type),
                field(&e.aggregate_id),
                field(&e.event_type)
            )),
            None => line(format_args!("")),
        }
        let took = event.took_us.map(|us| format!(" [{us} µs]")).unwrap_or_default();
        let reason = field(event.reason.as_deref().unwrap_or_default());
        match event.outcome {
            "published" => {
                for m in &event.messages {
                    line(format_args!(
                        "  -> target={} topic={} key={}{took}",
                        field(&m.target),
                        field(&m.topic),
                        field(m.key.as_deref().unwrap_or("-"))
                    ));
                    for (name, value) in &m.headers {
                        line(format_args!("     {}: {}", field(name), field(value)));
                    }
                    match (&m.payload, &m.payload_base64) {
                        (Some(text), _) => line(format_args!("     {}", field(text))),
                        (None, Some(encoded)) => line(format_args!("     <binary, base64> {encoded}")),
                        (None, None) => {}
                    }
                }
            }
            "dropped" => line(format_args!("  dropped on purpose (no messages){took}")),
            "invalid_output" => line(format_args!("  invalid output, would be dead-lettered: {reason}")),
            "refused_transient" => line(format_args!("  refused (transient, would retry): {reason}")),
            "refused_permanent" => line(format_args!("  refused (permanent, would dead-letter): {reason}")),
            "not_routable" => line(format_args!("{reason}\n  not routable: would be dead-lettered")),
            _ => line(format_args!("  {reason}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_plugin_wrote_reaches_the_terminal_escaped() {
        let report = TestReport {
            plugin: "evil".into(),
            compile_ms: 1,
            events: vec![
                EventReport {
                    event: Some(EventSummary {
                        event_id: "e-1".into(),
                        aggregate_type: "order".into(),
                        aggregate_id: "o-1\u{1b}]0;owned\u{7}".into(),
                        event_type: "OrderPlaced".into(),
                    }),
                    outcome: "published",
                    reason: None,
                    problem: None,
                    took_us: Some(5),
                    messages: vec![MessageReport {
                        target: "out".into(),
                        topic: "orders\u{1b}[2J".into(),
                        key: Some("k\u{202e}ey".into()),
                        headers: BTreeMap::from([("x\u{1b}[31m".into(), "red\nfake line".into())]),
                        payload: Some("{\"a\":1}\r\u{1b}[1A".into()),
                        payload_base64: None,
                    }],
                },
                EventReport {
                    event: None,
                    outcome: "refused_permanent",
                    reason: Some("no\u{1b}[0m\nplugin evil loaded in 0 ms".into()),
                    problem: None,
                    took_us: None,
                    messages: Vec::new(),
                },
            ],
            failed: 1,
        };
        let text = render_human(&report);
        assert!(
            !text
                .chars()
                .any(|c| (c.is_control() && c != '\n') || c == '\u{202e}'),
            "{text:?}"
        );
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("plugin evil loaded"))
                .count(),
            1,
            "a reason cannot forge a line: {text}"
        );
        assert!(!text.lines().any(|l| l.starts_with("fake line")), "{text}");
        assert!(text.contains("topic=orders\\u{1b}[2J"), "{text}");
        assert!(text.contains("red\\nfake line"), "{text}");
    }
}
