//! Why a plugin could not be loaded or a call gave no usable answer, and how
//! traps are described in logs and `last_error`: one line, with the
//! plugin's stderr when it explains the trap.

use std::path::PathBuf;
use std::time::Duration;

use wasmtime::Trap;

/// Why a plugin version could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read plugin file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not a component, or not valid wasm.
    #[error("{path} is not a valid WebAssembly component: {reason}")]
    Compile {
        /// The file.
        path: PathBuf,
        /// What wasmtime said.
        reason: String,
    },
    /// A component, but not for either WIT world (missing exports, wrong types, unknown imports).
    #[error("{path} does not implement the switchyard:plugin router or batch-router world: {reason}")]
    Contract {
        /// The file.
        path: PathBuf,
        /// What did not match.
        reason: String,
    },
    /// `init` refused the config or trapped.
    #[error("plugin {name}@{version} failed init: {reason}")]
    Init {
        /// Plugin name.
        name: String,
        /// Version hash.
        version: String,
        /// The plugin's message or the trap.
        reason: String,
    },
}

/// Why a `route` call produced no usable answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallFailure {
    /// The plugin refused: retry later.
    Transient(String),
    /// The plugin refused: dead-letter now.
    Permanent(String),
    /// The plugin trapped, ran out of time or memory (the instance was
    /// discarded), or answered a batch with the wrong number of results.
    Crashed(String),
    /// No instance could be started to make the call (the message says why).
    Unavailable(String),
}

impl From<super::Refusal> for CallFailure {
    fn from(refusal: super::Refusal) -> CallFailure {
        match refusal {
            super::Refusal::Transient(reason) => CallFailure::Transient(reason),
            super::Refusal::Permanent(reason) => CallFailure::Permanent(reason),
        }
    }
}

/// Most of a plugin's stderr quoted in `last_error` after a trap.
const STDERR_IN_ERROR: usize = 512;

/// A trap's description with what the plugin wrote to stderr before it (a
/// Rust panic's message, an uncaught exception), on one line.
pub(super) fn with_stderr(reason: String, stderr: &str) -> String {
    let stderr = one_line(stderr);
    if stderr.is_empty() {
        return reason;
    }
    let mut cut = stderr.len().min(STDERR_IN_ERROR);
    while !stderr.is_char_boundary(cut) {
        cut -= 1;
    }
    let ellipsis = if cut < stderr.len() { "..." } else { "" };
    format!("{reason}; stderr: {}{ellipsis}", &stderr[..cut])
}

/// wasmtime's parse errors embed pretty-printed byte arrays over many lines;
/// logs, `status` and `last_error` want one line.
pub(super) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

pub(super) fn describe_trap(error: &wasmtime::Error, timeout: Duration, max_memory_bytes: usize) -> String {
    match error.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => format!("exceeded its time limit of {} ms", timeout.as_millis()),
        Some(trap) => {
            let text = trap.to_string();
            format!("trapped: {}", text.strip_prefix("wasm trap: ").unwrap_or(&text))
        }
        None => {
            let text = format!("{error:#}");
            if text.contains("forcing trap when growing memory") || text.contains("memory minimum size") {
                format!("exceeded its memory limit of {max_memory_bytes} bytes")
            } else {
                format!("failed: {text}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_is_quoted_on_one_line_and_cut_at_a_char_boundary() {
        assert_eq!(
            with_stderr("trapped: unreachable".into(), ""),
            "trapped: unreachable"
        );
        assert_eq!(
            with_stderr(
                "trapped: unreachable".into(),
                "thread panicked at src/lib.rs:3:\n  boom\n"
            ),
            "trapped: unreachable; stderr: thread panicked at src/lib.rs:3: boom"
        );
        let long = "é".repeat(STDERR_IN_ERROR);
        let quoted = with_stderr("x".into(), &long);
        assert!(quoted.ends_with("..."), "{quoted}");
        assert!(quoted.len() <= "x; stderr: ".len() + STDERR_IN_ERROR + 3);
    }
}
