//! Per-instance host state: the empty WASI context, resource limits, and the
//! `host` interface plugins import (logging).

use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::ResourceTable;
use wasmtime::{StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::bindings::switchyard::plugin::host::{Host, Level};
use super::bindings::switchyard::plugin::types;
use super::output::Capture;

/// Longest plugin log line kept; the rest is cut so a chatty plugin cannot flood the log.
const MAX_LOG_LINE: usize = 4096;

/// `host.log` lines kept per plugin call; later ones are dropped and counted.
const MAX_LOG_LINES_PER_CALL: u32 = 32;

/// `host.log` bytes kept per plugin call, like stdout and stderr's 4 KiB each.
const MAX_LOG_BYTES_PER_CALL: usize = 8 * 1024;

/// What `host.log` used of its bound during the current call.
#[derive(Debug, Default)]
struct LogBudget {
    lines: u32,
    bytes: usize,
    dropped_lines: u64,
    dropped_bytes: u64,
}

impl LogBudget {
    /// Whether a line of `len` bytes fits; counts it either way.
    fn admit(&mut self, len: usize) -> bool {
        if self.lines < MAX_LOG_LINES_PER_CALL && self.bytes + len <= MAX_LOG_BYTES_PER_CALL {
            self.lines += 1;
            self.bytes += len;
            true
        } else {
            self.dropped_lines += 1;
            self.dropped_bytes += len as u64;
            false
        }
    }
}

/// Data owned by one plugin instance's store.
pub struct State {
    /// What the plugin printed to stdout during the current call.
    pub(crate) stdout: Capture,
    /// What the plugin printed to stderr (panic messages land here).
    pub(crate) stderr: Capture,
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limits: StoreLimits,
    plugin: Arc<str>,
    version: Arc<str>,
    log_budget: LogBudget,
    /// The database the current call's events come from (`host.database`).
    database: Option<String>,
}

impl State {
    pub(crate) fn new(plugin: Arc<str>, version: Arc<str>, max_memory_bytes: usize) -> State {
        // No preopened dirs, no sockets, no env, no args, no stdin; clocks
        // frozen at the epoch so a plugin cannot time anything or behave by
        // the hour. stdout and stderr are captured for the relay's log.
        let (stdout, stderr) = (Capture::default(), Capture::default());
        let wasi = WasiCtxBuilder::new()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .wall_clock(FrozenClock)
            .monotonic_clock(FrozenClock)
            .allow_blocking_current_thread(false)
            .build();
        State {
            stdout,
            stderr,
            wasi,
            table: ResourceTable::new(),
            limits: StoreLimitsBuilder::new()
                .memory_size(max_memory_bytes)
                .instances(64)
                .tables(64)
                .memories(16)
                .trap_on_grow_failure(true)
                .build(),
            plugin,
            version,
            log_budget: LogBudget::default(),
            database: None,
        }
    }
}

impl State {
    /// Logs what the plugin printed during the call that just ended, tagged
    /// `plugin@version`, and returns the stderr text (a panic's message).
    /// Sets what `host.database` answers during the next calls.
    pub(crate) fn set_database(&mut self, database: Option<&str>) {
        if self.database.as_deref() != database {
            self.database = database.map(str::to_string);
        }
    }

    pub(crate) fn flush_output(&mut self) -> String {
        let (plugin, version) = (&*self.plugin, &*self.version);
        let budget = std::mem::take(&mut self.log_budget);
        if budget.dropped_lines > 0 {
            tracing::warn!(
                plugin.name = plugin,
                plugin.version = version,
                dropped_lines = budget.dropped_lines,
                dropped_bytes = budget.dropped_bytes,
                "The plugin logged more than {MAX_LOG_LINES_PER_CALL} lines or {MAX_LOG_BYTES_PER_CALL} bytes through host.log in one call; the rest was dropped."
            );
        }
        let stdout = self.stdout.take();
        if !stdout.text.is_empty() {
            tracing::info!(
                plugin.name = plugin,
                plugin.version = version,
                plugin.stream = "stdout",
                dropped_bytes = stdout.dropped,
                "{}",
                stdout.text
            );
        }
        let stderr = self.stderr.take();
        if !stderr.text.is_empty() {
            tracing::warn!(
                plugin.name = plugin,
                plugin.version = version,
                plugin.stream = "stderr",
                dropped_bytes = stderr.dropped,
                "{}",
                stderr.text
            );
        }
        stderr.text
    }
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl Host for State {
    fn database(&mut self) -> Option<String> {
        self.database.clone()
    }

    fn log(&mut self, level: Level, message: String) {
        let mut message = message;
        if message.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str("...");
        }
        if !self.log_budget.admit(message.len()) {
            return;
        }
        let (plugin, version) = (&*self.plugin, &*self.version);
        match level {
            Level::Trace => tracing::trace!(plugin.name = plugin, plugin.version = version, "{message}"),
            Level::Debug => tracing::debug!(plugin.name = plugin, plugin.version = version, "{message}"),
            Level::Info => tracing::info!(plugin.name = plugin, plugin.version = version, "{message}"),
            Level::Warn => tracing::warn!(plugin.name = plugin, plugin.version = version, "{message}"),
            Level::Error => tracing::error!(plugin.name = plugin, plugin.version = version, "{message}"),
        }
    }
}

impl types::Host for State {}

/// A clock that always reads zero.
struct FrozenClock;

impl HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }

    fn now(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_log_keeps_a_bounded_number_of_lines_and_bytes_per_call() {
        let mut budget = LogBudget::default();
        let kept = (0..100_000).filter(|_| budget.admit(10)).count();
        assert_eq!(kept, MAX_LOG_LINES_PER_CALL as usize);
        assert_eq!(budget.dropped_lines, 100_000 - u64::from(MAX_LOG_LINES_PER_CALL));
        let mut budget = LogBudget::default();
        assert!(budget.admit(MAX_LOG_BYTES_PER_CALL - 1));
        assert!(!budget.admit(MAX_LOG_LINE));
        assert!(budget.admit(1));
        assert_eq!(budget.dropped_bytes, MAX_LOG_LINE as u64);
    }
}
