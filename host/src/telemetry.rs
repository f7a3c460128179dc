//! Logging setup: `tracing` with an env filter, as text or JSON lines.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

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
        .and_then(|spec| EnvFilter::try_new(with_quiet_libraries(&spec)).ok())
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

/// Library lines the relay says better itself, turned down whatever the
/// level. lapin's WARN for every message RabbitMQ returned as unroutable
/// (its headers as byte arrays, one line each): the relay logs the
/// refusal, with the broker's reason, once per batch and target. lapin's
/// ERROR lines for a dropped connection (`channels`, `io_loop`): the relay
/// reconnects by itself, and pausing the target logs the cause once.
/// pgwire-replication's ERROR for every session that ends (a standby's
/// every try at a slot another relay reads): the replication feed says
/// what happened, once.
const QUIET_LIBRARIES: &[&str] = &[
    "lapin::returned_messages=error",
    "lapin::channels=off",
    "lapin::io_loop=off",
    "pgwire_replication::client::tokio_client=off",
];

/// `level` for everything, with [`QUIET_LIBRARIES`].
fn default_env_filter(level: &str) -> EnvFilter {
    EnvFilter::new(with_quiet_libraries(level))
}

/// A filter spec with [`QUIET_LIBRARIES`] added, except for the crates it
/// names itself (`SWITCHYARD_LOG=info,lapin=debug` shows all of lapin).
fn with_quiet_libraries(spec: &str) -> String {
    let mut out = spec.to_string();
    for directive in QUIET_LIBRARIES {
        let krate = directive.split("::").next().unwrap_or(directive);
        if !spec.contains(krate) {
            out.push(',');
            out.push_str(directive);
        }
    }
    out
}

/// A condition that repeats while it lasts (a broker down: an error per
/// reconnect attempt) logged as one line when it starts, one a minute while
/// it lasts with how often it recurred, and one when it ends.
#[derive(Debug, Default)]
pub struct Repeats {
    run: std::sync::Mutex<Option<Run>>,
}

#[derive(Debug, Clone, Copy)]
struct Run {
    started: Instant,
    reported: Instant,
    count: u64,
}

/// What to log for one occurrence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Occurrence {
    /// The condition started: log it.
    First,
    /// A minute since the last line: log that it lasts.
    Still {
        /// Occurrences since it started.
        count: u64,
        /// Since it started.
        lasting: Duration,
    },
    /// Already reported: nothing.
    Quiet,
}

/// How long a condition lasts between two lines about it.
const REPEAT_REPORT_EVERY: Duration = Duration::from_secs(60);

impl Repeats {
    /// Records one occurrence.
    pub fn occurred(&self) -> Occurrence {
        self.occurred_at(Instant::now())
    }

    fn occurred_at(&self, now: Instant) -> Occurrence {
        let mut run = self.run.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match run.as_mut() {
            None => {
                *run = Some(Run {
                    started: now,
                    reported: now,
                    count: 1,
                });
                Occurrence::First
            }
            Some(run) => {
                run.count += 1;
                if now.saturating_duration_since(run.reported) < REPEAT_REPORT_EVERY {
                    return Occurrence::Quiet;
                }
                run.reported = now;
                Occurrence::Still {
                    count: run.count,
                    lasting: now.saturating_duration_since(run.started),
                }
            }
        }
    }

    /// The condition is over: how many times it occurred and for how long,
    /// if it had started.
    pub fn ended(&self) -> Option<(u64, Duration)> {
        self.ended_at(Instant::now())
    }

    fn ended_at(&self, now: Instant) -> Option<(u64, Duration)> {
        let run = self
            .run
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()?;
        Some((run.count, now.saturating_duration_since(run.started)))
    }
}

/// Log capture for unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::EnvFilter;

    /// The lines `f` logs on this thread through `filter`, as text.
    pub(crate) fn capture(filter: EnvFilter, f: impl FnOnce()) -> String {
        let out = Arc::new(Mutex::new(Vec::<u8>::new()));
        let writer = {
            let out = Arc::clone(&out);
            move || Capture(Arc::clone(&out))
        };
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(writer)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let bytes = out
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_filter_drops_what_the_relay_says_better_itself_only() {
        let text = testing::capture(default_env_filter("info"), || {
            tracing::warn!(target: "lapin::returned_messages", "Server returned us a message");
            tracing::error!(target: "lapin::io_loop", "error doing IO");
            tracing::error!(target: "lapin::channels", "Connection error");
            tracing::error!(target: "lapin::connection", "Connection closed");
            tracing::error!(target: "pgwire_replication::client::tokio_client", "replication worker terminated");
            tracing::warn!(target: "switchyard::relay::publish", "This target refused deliveries for good");
        });
        assert!(!text.contains("returned us a message"), "{text}");
        assert!(!text.contains("error doing IO"), "{text}");
        assert!(!text.contains("Connection error"), "{text}");
        assert!(text.contains("Connection closed"), "{text}");
        assert!(!text.contains("replication worker terminated"), "{text}");
        assert!(text.contains("refused deliveries for good"), "{text}");
    }

    #[test]
    fn a_filter_from_the_environment_keeps_libraries_quiet_unless_it_names_them() {
        assert_eq!(
            with_quiet_libraries("warn"),
            "warn,lapin::returned_messages=error,lapin::channels=off,lapin::io_loop=off,\
             pgwire_replication::client::tokio_client=off"
        );
        let named = with_quiet_libraries("info,lapin=debug");
        assert!(!named.contains("lapin::io_loop"), "{named}");
        assert!(
            named.ends_with("pgwire_replication::client::tokio_client=off"),
            "{named}"
        );
    }

    #[test]
    fn a_repeating_condition_is_one_line_then_one_a_minute_then_its_end() {
        let repeats = Repeats::default();
        let start = Instant::now();
        assert_eq!(repeats.occurred_at(start), Occurrence::First);
        for ms in (50..60_000).step_by(50) {
            assert_eq!(
                repeats.occurred_at(start + Duration::from_millis(ms)),
                Occurrence::Quiet
            );
        }
        assert_eq!(
            repeats.occurred_at(start + Duration::from_secs(60)),
            Occurrence::Still {
                count: 1201,
                lasting: Duration::from_secs(60)
            }
        );
        assert_eq!(
            repeats.occurred_at(start + Duration::from_secs(61)),
            Occurrence::Quiet
        );
        assert_eq!(
            repeats.ended_at(start + Duration::from_secs(90)),
            Some((1202, Duration::from_secs(90)))
        );
        assert_eq!(repeats.ended_at(start + Duration::from_secs(91)), None);
        // The next one starts afresh.
        assert_eq!(repeats.occurred(), Occurrence::First);
    }
}
