//! A message's headers as SQS and SNS message attributes, and the checks
//! both services put on a message before any call.
//!
//! Both take at most 10 attributes, with names of letters, digits, `-`, `_`
//! and `.`. The relay's own headers, `traceparent`, the row's and the
//! plugin's often make more, or a name the services refuse. Then the
//! headers travel together, as one JSON object in the attribute
//! `Switchyard-Headers`, beside `Switchyard-Event-Id` and `traceparent` of
//! their own: a consumer always reads the event id from the same
//! attribute, and no header is lost.

use super::config::GroupId;
use super::{aggregate_id, fitted};
use crate::sinks::headers::EVENT_ID_HEADER;
use crate::sinks::{KEY_HEADER, OutgoingMessage, SinkError};

/// Attributes a message may have.
pub const MAX_ATTRIBUTES: usize = 10;
/// A message with its attributes (SQS and SNS alike), and a batch request.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// The attribute holding every header when they do not fit one each.
pub const HEADERS_ATTRIBUTE: &str = "Switchyard-Headers";

/// An attribute: name and string value.
pub type Attribute = (String, String);

/// The attributes for `headers` (and the plugin's `key`, as
/// `Switchyard-Key`), one per header when they fit the services' rules.
pub fn attributes(headers: &[(String, String)], key: Option<&str>) -> Vec<Attribute> {
    let mut all: Vec<Attribute> = headers.to_vec();
    if let Some(key) = key {
        all.push((KEY_HEADER.to_string(), key.to_string()));
    }
    if all.len() <= MAX_ATTRIBUTES && all.iter().all(|(name, _)| valid_name(name)) {
        return all;
    }
    let mut packed = Vec::with_capacity(3);
    for name in [EVENT_ID_HEADER, "traceparent"] {
        if let Some((_, value)) = all.iter().find(|(n, _)| n == name) {
            packed.push((name.to_string(), value.clone()));
        }
    }
    let object: serde_json::Map<String, serde_json::Value> = all
        .into_iter()
        .map(|(name, value)| (name, serde_json::Value::String(value)))
        .collect();
    packed.push((
        HEADERS_ATTRIBUTE.to_string(),
        serde_json::Value::Object(object).to_string(),
    ));
    packed
}

/// An attribute name both services take: 1 to 256 characters of letters,
/// digits, `-`, `_` and `.`, no leading, trailing or doubled `.`, and no
/// `AWS.` or `Amazon.` prefix.
fn valid_name(name: &str) -> bool {
    let prefixed = |prefix: &str| {
        name.get(..prefix.len())
            .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
    };
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !prefixed("aws.")
        && !prefixed("amazon.")
}

/// `payload` as the text SQS and SNS carry: UTF-8 of the characters they
/// accept (tab, line feed, carriage return and from U+0020 on, without
/// surrogates or U+FFFE/U+FFFF).
///
/// # Errors
/// A permanent failure naming what is wrong.
pub fn text_body<'p>(payload: &'p [u8], service: &str) -> Result<&'p str, SinkError> {
    let text = std::str::from_utf8(payload).map_err(|_| {
        SinkError::permanent(format!(
            "{service} carries text and the payload is not UTF-8: have the plugin encode it (base64, JSON)"
        ))
    })?;
    // Valid UTF-8 holds no surrogates: only control characters and
    // U+FFFE/U+FFFF (EF BF BE, EF BF BF) can be refused, so most payloads
    // pass a scan of their bytes.
    let suspect = |b: &u8| (*b < 0x20 && !matches!(*b, b'\t' | b'\n' | b'\r')) || *b == 0xEF;
    if text.as_bytes().iter().any(suspect)
        && let Some(bad) = text.chars().find(|c| !allowed_char(*c))
    {
        return Err(SinkError::permanent(format!(
            "{service} refuses the character U+{:04X} in a message: have the plugin drop or escape it",
            u32::from(bad)
        )));
    }
    Ok(text)
}

fn allowed_char(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..)
}

/// The size SQS and SNS count for a message: its body, and each
/// attribute's name, type (`String`) and value.
pub fn message_size(body: &str, attributes: &[Attribute]) -> usize {
    body.len()
        + attributes
            .iter()
            .map(|(name, value)| name.len() + "String".len() + value.len())
            .sum::<usize>()
}

/// Fails a message over the services' size limit, naming it.
///
/// # Errors
/// A permanent failure when `size` is over [`MAX_MESSAGE_BYTES`].
pub fn check_size(size: usize, service: &str) -> Result<(), SinkError> {
    if size > MAX_MESSAGE_BYTES {
        return Err(SinkError::permanent(format!(
            "the message is {size} bytes with its attributes; {service} takes at most {MAX_MESSAGE_BYTES} \
             (256 KiB)"
        )));
    }
    Ok(())
}

/// A message as SQS or SNS takes it, checked.
pub struct Prepared {
    /// The body.
    pub body: String,
    /// Its attributes.
    pub attributes: Vec<Attribute>,
    /// What the service counts of it.
    pub size: usize,
    /// On a FIFO queue or topic, its message group and deduplication id;
    /// empty otherwise.
    pub group: String,
    /// See `group`.
    pub dedup: String,
}

/// Characters of a message group or deduplication id.
fn id_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c.is_ascii_punctuation()
}

/// `message` for `service` (`"SQS"`, `"SNS"`), with its group (by `group`)
/// and deduplication id (the event id) when `fifo`.
///
/// # Errors
/// A permanent failure when the service would refuse the message.
pub fn prepare(
    message: &OutgoingMessage,
    service: &str,
    fifo: bool,
    group: &GroupId,
) -> Result<Prepared, SinkError> {
    let body = text_body(&message.payload, service)?.to_string();
    let attributes = attributes(&message.headers, message.key.as_deref());
    let size = message_size(&body, &attributes);
    check_size(size, service)?;
    let (group, dedup) = if fifo {
        let group = match group {
            GroupId::Aggregate => aggregate_id(message).to_string(),
            GroupId::Key => message
                .key
                .clone()
                .unwrap_or_else(|| aggregate_id(message).to_string()),
            GroupId::Fixed(group) => group.clone(),
        };
        // SQS and SNS take up to 128 characters; a longer aggregate id
        // keeps a group of its own through its digest.
        (
            fitted(&group, 128, id_char),
            fitted(&message.dedup_id, 128, id_char),
        )
    } else {
        (String::new(), String::new())
    };
    Ok(Prepared {
        body,
        attributes,
        size,
        group,
        dedup,
    })
}

/// Splits `sizes` (in message order) into runs of at most `count` messages
/// and `bytes` bytes: the batch calls' limits. A message over `bytes` on its
/// own was refused before.
pub fn batches(sizes: &[usize], count: usize, bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let (mut start, mut total) = (0, 0);
    for (index, size) in sizes.iter().enumerate() {
        if index > start && (index - start == count || total + size > bytes) {
            runs.push(start..index);
            (start, total) = (index, 0);
        }
        total += size;
    }
    if start < sizes.len() {
        runs.push(start..sizes.len());
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(n: usize) -> Vec<(String, String)> {
        let mut all = vec![
            (EVENT_ID_HEADER.to_string(), "e-1".to_string()),
            ("traceparent".to_string(), "00-abc-def-01".to_string()),
        ];
        all.extend((0..n).map(|i| (format!("h{i}"), format!("v{i}"))));
        all
    }

    #[test]
    fn ten_headers_are_ten_attributes_and_the_eleventh_packs_them_all() {
        let ten = attributes(&headers(8), None);
        assert_eq!(ten.len(), 10);
        let eleven = attributes(&headers(8), Some("k"));
        let names: Vec<&str> = eleven.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, [EVENT_ID_HEADER, "traceparent", HEADERS_ATTRIBUTE]);
        let packed: serde_json::Value = serde_json::from_str(&eleven[2].1).unwrap();
        assert_eq!(packed["h7"], "v7");
        assert_eq!(packed[KEY_HEADER], "k");
        assert_eq!(packed[EVENT_ID_HEADER], "e-1");
    }

    #[test]
    fn a_name_the_services_refuse_packs_the_headers() {
        let odd = vec![
            (EVENT_ID_HEADER.to_string(), "e-1".to_string()),
            ("x:y".to_string(), "1".to_string()),
        ];
        assert_eq!(attributes(&odd, None).len(), 2);
        assert_eq!(attributes(&odd, None)[1].0, HEADERS_ATTRIBUTE);
        for bad in ["", ".a", "a.", "a..b", "AWS.x", "amazon.y", "a b"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
        assert!(valid_name("Switchyard-Event-Id") && valid_name("a.b_c-d"));
    }

    #[test]
    fn bodies_are_text_the_services_take() {
        assert_eq!(text_body(b"{\"a\":1}", "SQS").unwrap(), "{\"a\":1}");
        assert!(
            text_body(&[0xff, 0x00], "SQS")
                .unwrap_err()
                .message
                .contains("not UTF-8")
        );
        assert!(
            text_body(b"a\x01b", "SNS")
                .unwrap_err()
                .message
                .contains("U+0001")
        );
        for (bad, named) in [("a\u{FFFE}", "U+FFFE"), ("\u{FFFF}b", "U+FFFF")] {
            let refused = text_body(bad.as_bytes(), "SQS").unwrap_err().message;
            assert!(refused.contains(named), "{refused}");
        }
        // Tab, line feed, carriage return, DEL, a BOM (EF BB BF) and U+FFFD
        // (EF BF BD) are all taken.
        let taken = "\t\n\r\u{7F}\u{FEFF}\u{FFFD}\u{10000} ok";
        assert_eq!(text_body(taken.as_bytes(), "SQS").unwrap(), taken);
    }

    #[test]
    fn batches_keep_order_within_count_and_bytes() {
        assert_eq!(batches(&[1; 25], 10, 1000), [0..10, 10..20, 20..25]);
        assert_eq!(batches(&[600, 600, 100, 900], 10, 1000), [0..1, 1..3, 3..4]);
        assert!(batches(&[], 10, 1000).is_empty());
        assert!(
            check_size(MAX_MESSAGE_BYTES + 1, "SQS")
                .unwrap_err()
                .message
                .contains("256 KiB")
        );
    }
}
