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
        .unwrap_or_else(|| EnvFilter::new(default_filter));
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
