//! Logging setup: `tracing` with an env filter, as text or JSON lines.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// Installs the global subscriber. The filter comes from `SWITCHYARD_LOG`
/// (then `RUST_LOG`), default `info`. Logs go to stderr so that command output
/// on stdout stays clean for scripts.
pub fn init(format: LogFormat) {
    init_with_default(format, "info");
}

/// Like [`init`] with another default filter (tests default to `warn`).
pub fn init_with_default(format: LogFormat, default_filter: &str) {
    let filter = std::env::var("SWITCHYARD_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .ok()
        .and_then(|spec| EnvFilter::try_new(spec).ok())
        .unwrap_or_else(|| default_env_filter(default_filter));
    // Colour only for a person at a terminal: a file, a pipe or a log
    // shipper gets plain text, and NO_COLOR is honoured.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    // A second init (tests) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// `level` for everything, except lapin's WARN for every message RabbitMQ
/// returned as unroutable (its headers as byte arrays, one line each): the
/// relay logs the refusal itself, with the broker's reason, once per batch
/// and target. A filter set in the environment replaces all of this.
fn default_env_filter(level: &str) -> EnvFilter {
    EnvFilter::new(format!("{level},lapin::returned_messages=error"))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn the_default_filter_drops_lapins_returned_message_lines_only() {
        let out = Arc::new(Mutex::new(Vec::<u8>::new()));
        let writer = {
            let out = Arc::clone(&out);
            move || Capture(Arc::clone(&out))
        };
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(default_env_filter("info"))
            .with_ansi(false)
            .with_writer(writer)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "lapin::returned_messages", "Server returned us a message");
            tracing::warn!(target: "lapin::io_loop", "error doing IO");
            tracing::warn!(target: "switchyard::relay::publish", "This target refused deliveries for good");
        });
        let text = String::from_utf8(out.lock().unwrap().clone()).unwrap();
        assert!(!text.contains("returned us a message"), "{text}");
        assert!(text.contains("error doing IO"), "{text}");
        assert!(text.contains("refused deliveries for good"), "{text}");
    }

    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
