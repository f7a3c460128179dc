//! Text written by others (rows, plugins' output and refusals) made safe to
//! print on an operator's terminal.

use std::borrow::Cow;

/// Text for the operator's terminal. Rows, their errors and plugins' output
/// are written by others, and a control character in them (an ANSI escape
/// sequence) would be acted on by the terminal, not shown, as would a
/// bidirectional override reorder what follows it: each is shown escaped
/// (`\u{1b}`) instead. The rendering's own line breaks stay.
pub(super) fn terminal_safe(text: &str) -> Cow<'_, str> {
    escape_controls(text, true)
}

/// A one-line field (an id, a topic, a payload) with every control
/// character escaped, line breaks too: it cannot start a line of its own.
pub(super) fn field(text: &str) -> Cow<'_, str> {
    escape_controls(text, false)
}

fn escape_controls(text: &str, keep_line_breaks: bool) -> Cow<'_, str> {
    let escaped = |c: char| {
        (c.is_control() && !(keep_line_breaks && c == '\n'))
            || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !text.chars().any(escaped) {
        return text.into();
    }
    let mut safe = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if escaped(c) {
            safe.extend(c.escape_default());
        } else {
            safe.push(c);
        }
    }
    safe.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidi_overrides_are_escaped_line_breaks_kept_or_not() {
        assert_eq!(terminal_safe("plain\ntext"), "plain\ntext");
        assert_eq!(field("plain\ntext"), "plain\\ntext");
        assert_eq!(terminal_safe("a\u{1b}[2Jb\u{7}"), "a\\u{1b}[2Jb\\u{7}");
        assert_eq!(terminal_safe("x\u{202e}y"), "x\\u{202e}y");
        assert_eq!(field("ordre-été"), "ordre-été");
    }
}
