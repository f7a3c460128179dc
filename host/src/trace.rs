//! W3C Trace Context: continues the `traceparent` a service wrote into the
//! row's headers. Each row gets a relay span (trace id kept, fresh span id,
//! parent = the writer's span), and the broker message carries that span as
//! its `traceparent`, so a consumer's span is a child of the relay's.
//!
//! Spans are `tracing` spans with `trace.id` / `span.id` / `parent.id`
//! fields, which puts the ids on every log line of the row. No collector is
//! linked in; the ids are the standard ones, so an OpenTelemetry layer can be
//! added without changing what goes over the wire.

use std::fmt;

/// A parsed `traceparent` (version 00).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// 16-byte trace id.
    pub trace_id: u128,
    /// 8-byte id of the span this one continues.
    pub span_id: u64,
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceParent {
    /// The header name.
    pub const HEADER: &'static str = "traceparent";

    /// Parses a header value; `None` for anything the spec says to ignore
    /// (wrong shape, upper-case hex, all-zero ids, version ff).
    pub fn parse(value: &str) -> Option<TraceParent> {
        let value = value.trim();
        let mut parts = value.split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let lower_hex = |s: &str, len: usize| {
            s.len() == len
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        if !lower_hex(version, 2)
            || version == "ff"
            || !lower_hex(trace, 32)
            || !lower_hex(span, 16)
            || !lower_hex(flags, 2)
        {
            return None;
        }
        // Version 00 has exactly four fields; later versions may append more.
        if version == "00" && parts.next().is_some() {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok()?;
        let span_id = u64::from_str_radix(span, 16).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        (trace_id != 0 && span_id != 0).then_some(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Finds and parses `traceparent` among headers (name case-insensitive).
    pub fn from_headers(headers: &[(String, String)]) -> Option<TraceParent> {
        headers
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(Self::HEADER))
            .and_then(|(_, value)| TraceParent::parse(value))
    }

    /// A child: same trace and flags, a fresh random span id.
    pub fn child(&self) -> TraceParent {
        let span_id = loop {
            let id: u64 = rand::random();
            if id != 0 {
                break id;
            }
        };
        TraceParent { span_id, ..*self }
    }

    /// The trace id as 32 hex digits.
    pub fn trace_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The span id as 16 hex digits.
    pub fn span_hex(&self) -> String {
        format!("{:016x}", self.span_id)
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_prints_the_spec_example() {
        let parent = TraceParent::parse(SAMPLE).expect("valid");
        assert_eq!(parent.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parent.span_hex(), "00f067aa0ba902b7");
        assert_eq!(parent.flags, 1);
        assert_eq!(parent.to_string(), SAMPLE);
    }

    #[test]
    fn a_child_keeps_trace_and_flags_with_a_new_span() {
        let parent = TraceParent::parse(SAMPLE).expect("valid");
        let child = parent.child();
        assert_eq!(child.trace_id, parent.trace_id);
        assert_eq!(child.flags, parent.flags);
        assert_ne!(child.span_id, parent.span_id);
        assert_eq!(TraceParent::parse(&child.to_string()), Some(child));
    }

    #[test]
    fn ignores_what_the_spec_says_to_ignore() {
        for bad in [
            "",
            "00-abc-def-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        // A later version may carry more fields; its first four still count.
        assert!(TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz").is_some());
    }
}
