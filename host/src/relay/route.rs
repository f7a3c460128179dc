//! The route stage: every claimed row through its plugin (or the native
//! router), giving either the messages to publish or the row's outcome.
//! Runs on a blocking thread: wasm calls are synchronous CPU work.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, debug_span, warn};

use super::Relay;
use super::retry::lease_spent;
use crate::config::UnmatchedPolicy;
use crate::metrics::PluginLabel;
use crate::plugin::{CallFailure, Event, Instance, Message, PluginVersion, Refusal};
use crate::router::{self, Routed};
use crate::store::{OutboxRow, Outcome};
use crate::trace::TraceParent;

/// A claimed row after routing.
pub(super) struct RoutedRow {
    pub(super) row: OutboxRow,
    pub(super) state: RowState,
    /// The row's `outbox.row` span (disabled when the row failed before
    /// its event could be read).
    pub(super) span: tracing::Span,
}

/// What routing made of a row.
pub(super) enum RowState {
    /// Messages to publish (none: the plugin dropped the event).
    Routed {
        messages: Vec<Routed>,
        version: Option<String>,
    },
    /// Decided without publishing anything (refused, trapped, malformed...).
    Failed {
        outcome: Outcome,
        version: Option<String>,
    },
}

impl RoutedRow {
    pub(super) fn failed(row: OutboxRow, outcome: Outcome, version: Option<String>) -> RoutedRow {
        RoutedRow {
            row,
            state: RowState::Failed { outcome, version },
            span: tracing::Span::none(),
        }
    }

    fn in_span(self, span: &tracing::Span) -> RoutedRow {
        RoutedRow {
            span: span.clone(),
            ..self
        }
    }
}

/// The plugin versions a batch started with, and one instance of each:
/// a hot reload during the batch does not change how its rows are routed.
#[derive(Default)]
struct Pinned {
    versions: HashMap<usize, Arc<PluginVersion>>,
    instances: HashMap<usize, Instance>,
}

impl Pinned {
    fn put_back(self) {
        for (slot, instance) in self.instances {
            if let Some(version) = self.versions.get(&slot) {
                version.put_back(instance);
            }
        }
    }
}

impl Relay {
    /// Routes a claimed batch on a blocking thread.
    pub(super) async fn route(
        &self,
        rows: Vec<OutboxRow>,
        deadline: Instant,
        claim_took: Duration,
    ) -> Vec<RoutedRow> {
        let relay = self.clone();
        let count = rows.len();
        match tokio::task::spawn_blocking(move || relay.route_blocking(rows, deadline, claim_took)).await {
            Ok(routed) => routed,
            Err(join_error) => {
                // Only reachable if routing panicked: nothing is acked, the
                // leases expire and the rows are claimed again.
                warn!(error = %join_error, rows = count, "Routing task failed.");
                Vec::new()
            }
        }
    }

    fn route_blocking(
        &self,
        rows: Vec<OutboxRow>,
        deadline: Instant,
        claim_took: Duration,
    ) -> Vec<RoutedRow> {
        let config = &self.inner.config;
        let route_until = deadline
            .checked_sub(config.publish_timeout() + super::ACK_RESERVE)
            .unwrap_or(deadline);
        let mut pinned = Pinned::default();
        let routed = rows
            .into_iter()
            .map(|row| self.route_row(row, &mut pinned, route_until, claim_took))
            .collect();
        pinned.put_back();
        routed
    }

    fn route_row(
        &self,
        row: OutboxRow,
        pinned: &mut Pinned,
        route_until: Instant,
        claim_took: Duration,
    ) -> RoutedRow {
        let inner = &self.inner;
        let attempts = u32::try_from(row.attempts).unwrap_or(u32::MAX);
        if attempts > inner.config.max_attempts {
            // Only reached when leases keep expiring (e.g. the relay crashed
            // while holding this row every time).
            let error = format!("lease expired {} times without an outcome", attempts - 1);
            return RoutedRow::failed(row, Outcome::Dead { error }, None);
        }
        let event = match router::event_from_row(&row, &inner.limits) {
            Ok(event) => event,
            Err(error) => return RoutedRow::failed(row, Outcome::Dead { error }, None),
        };
        // The row's span continues the writer's trace; its id is what the
        // broker message carries as `traceparent`.
        let parent = TraceParent::from_headers(&event.headers);
        let child = parent.map(|p| p.child());
        let span = debug_span!(
            "outbox.row",
            outbox.row_id = %row.id,
            outbox.event_id = %event.event_id,
            outbox.attempt = attempts,
            trace.id = parent.map(|p| p.trace_hex()),
            span.id = child.map(|c| c.span_hex()),
            parent.id = parent.map(|p| p.span_hex()),
        );
        if let Some(native) = inner.native_router.get() {
            let started = Instant::now();
            let result = span.in_scope(|| native(&event)).map_err(|refusal| match refusal {
                Refusal::Transient(reason) => CallFailure::Transient(reason),
                Refusal::Permanent(reason) => CallFailure::Permanent(reason),
            });
            self.observe_call("native", started);
            let state =
                span.in_scope(|| self.call_outcome(result, &event, "native", None, attempts, child.as_ref()));
            return RoutedRow { row, state, span };
        }
        let Some(slot) = inner.plugins.select(&event.aggregate_type, &event.event_type) else {
            let state = match inner.config.unmatched {
                UnmatchedPolicy::DeadLetter => RowState::Failed {
                    outcome: Outcome::Dead {
                        error: format!(
                            "no plugin matches aggregate type {:?} and event type {:?}",
                            event.aggregate_type, event.event_type
                        ),
                    },
                    version: None,
                },
                UnmatchedPolicy::Drop => RowState::Routed {
                    messages: Vec::new(),
                    version: None,
                },
            };
            return RoutedRow { row, state, span };
        };
        if Instant::now() >= route_until {
            let error = lease_spent(claim_took, inner.config.lease_duration(), "routing");
            let outcome = self.inner.retry.after_failure(attempts, error);
            return RoutedRow::failed(row, outcome, None).in_span(&span);
        }
        let version = match pinned.versions.get(&slot) {
            Some(version) => version.clone(),
            None => match inner.plugins.slots()[slot].current() {
                Some(version) => pinned.versions.entry(slot).or_insert(version).clone(),
                None => {
                    let config = inner.plugins.slots()[slot].config();
                    let reason = format!(
                        "plugin {} is unloaded (its file {} was deleted); waiting for it to return",
                        config.name,
                        config.path.display()
                    );
                    let after = Duration::from_millis(inner.config.poll_interval_ms.max(1000));
                    return RoutedRow::failed(row, Outcome::Defer { after, reason }, None).in_span(&span);
                }
            },
        };
        let version_id = Some(version.version().to_string());
        let instance = match pinned.instances.remove(&slot) {
            Some(instance) => instance,
            None => match version.checkout() {
                Ok(instance) => instance,
                Err(error) => {
                    let outcome = self.inner.retry.after_failure(attempts, error.to_string());
                    return RoutedRow::failed(row, outcome, version_id).in_span(&span);
                }
            },
        };
        let label = version.label();
        let started = Instant::now();
        let (result, instance) = span.in_scope(|| version.route(instance, &event));
        self.observe_call(version.name(), started);
        if let Some(instance) = instance {
            pinned.instances.insert(slot, instance);
        }
        let state =
            span.in_scope(|| self.call_outcome(result, &event, &label, version_id, attempts, child.as_ref()));
        RoutedRow { row, state, span }
    }

    fn observe_call(&self, plugin: &str, started: Instant) {
        self.inner
            .metrics
            .plugin_call
            .get_or_create(&PluginLabel {
                plugin: plugin.to_string(),
            })
            .observe(started.elapsed().as_secs_f64());
    }

    /// A routing call's result as the row's state: messages to publish, or
    /// dead-lettered (permanent refusal) or retried (transient, crash).
    fn call_outcome(
        &self,
        result: Result<Vec<Message>, CallFailure>,
        event: &Event,
        label: &str,
        version: Option<String>,
        attempts: u32,
        trace: Option<&TraceParent>,
    ) -> RowState {
        let outcome = match result {
            Ok(messages) => return self.assemble(event, messages, label, version, trace),
            Err(CallFailure::Permanent(reason)) => Outcome::Dead {
                error: format!("plugin {label} refused permanently: {reason}"),
            },
            Err(CallFailure::Transient(reason)) => self
                .inner
                .retry
                .after_failure(attempts, format!("plugin {label} refused for now: {reason}")),
            Err(CallFailure::Crashed(reason)) => self
                .inner
                .retry
                .after_failure(attempts, format!("plugin {label} {reason}")),
        };
        RowState::Failed { outcome, version }
    }

    fn assemble(
        &self,
        event: &Event,
        messages: Vec<Message>,
        label: &str,
        version: Option<String>,
        trace: Option<&TraceParent>,
    ) -> RowState {
        let sinks = &self.inner.sinks;
        match router::assemble(
            event,
            messages,
            label,
            &self.inner.limits,
            &|name| sinks.get(name).map(|sink| sink.deduplicates_by_id()),
            trace,
        ) {
            Ok(messages) => {
                debug!(outbox.event_id = %event.event_id, plugin.label = label, messages = messages.len(), "Routed.");
                RowState::Routed { messages, version }
            }
            Err(error) => RowState::Failed {
                outcome: Outcome::Dead { error },
                version,
            },
        }
    }
}
