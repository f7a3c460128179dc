//! The route stage: every claimed row through its plugin (or the native
//! router), giving either the messages to publish or the row's outcome.
//! Runs on a blocking thread: wasm calls are synchronous CPU work. A
//! plugin's rows are handed to it together, so a batch plugin is called
//! once per claimed batch rather than once per row.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, debug_span, warn};

use super::retry::RetryPolicy;
use super::{NativeRouter, Relay};
use crate::config::{RelayConfig, UnmatchedPolicy};
use crate::metrics::Metrics;
use crate::plugin::{CallFailure, Event, Message, PluginVersion, Plugins};
pub mod router;

use crate::sinks::Sinks;
use crate::store::{OutboxRow, Outcome};
use crate::trace::TraceParent;
use router::{Limits, Routed};

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

/// A row waiting for its plugin, with what its outcome needs.
struct Waiting {
    /// Its place in the claimed batch.
    at: usize,
    row: OutboxRow,
    attempts: u32,
    child: Option<TraceParent>,
}

/// One plugin slot's rows in a batch, in claim order, and the version the
/// batch started with: a hot reload during the batch does not change how
/// its rows are routed.
struct SlotRows {
    version: Arc<PluginVersion>,
    waiting: Vec<Waiting>,
    events: Vec<Event>,
    spans: Vec<tracing::Span>,
}

/// A row after the checks that need no plugin call.
enum Prepared {
    Done(RoutedRow),
    Wait {
        slot: usize,
        version: Arc<PluginVersion>,
        waiting: Waiting,
        event: Event,
        span: tracing::Span,
    },
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
        let route = move || relay.inner.route_stage().run(rows, deadline, claim_took);
        match tokio::task::spawn_blocking(route).await {
            Ok(routed) => routed,
            Err(join_error) => {
                // Only reachable if routing panicked: nothing is acked, the
                // leases expire and the rows are claimed again.
                warn!(error = %join_error, rows = count, "Routing task failed.");
                Vec::new()
            }
        }
    }
}

impl super::Inner {
    /// The route stage over this relay's parts.
    fn route_stage(&self) -> RouteStage<'_> {
        RouteStage {
            config: &self.config,
            limits: &self.limits,
            native_router: self.native_router.as_ref(),
            plugins: &self.plugins,
            retry: &self.retry,
            metrics: &self.metrics,
            sinks: &self.sinks,
            database: self.database.as_deref(),
        }
    }
}

/// The route stage as a value: what routing a batch reads, borrowed. Runs
/// synchronously (on a blocking thread in the relay).
pub(super) struct RouteStage<'a> {
    pub(super) config: &'a RelayConfig,
    pub(super) limits: &'a Limits,
    pub(super) native_router: Option<&'a NativeRouter>,
    pub(super) plugins: &'a Plugins,
    pub(super) retry: &'a RetryPolicy,
    pub(super) metrics: &'a Metrics,
    /// Which targets deduplicate by id (the message's dedup id).
    pub(super) sinks: &'a Sinks,
    /// The database's name for plugins (`host.database`), when the relay
    /// serves several.
    pub(super) database: Option<&'a str>,
}

impl RouteStage<'_> {
    /// Each row's state after routing, in claim order. Routing stops
    /// `publish_timeout` plus the ack reserve before `deadline`: rows not
    /// routed by then are retried, as a spent lease.
    pub(super) fn run(
        &self,
        rows: Vec<OutboxRow>,
        deadline: Instant,
        claim_took: Duration,
    ) -> Vec<RoutedRow> {
        let config = &self.config;
        let route_until = deadline
            .checked_sub(config.publish_timeout() + super::ACK_RESERVE)
            .unwrap_or(deadline);
        let mut done: Vec<Option<RoutedRow>> = Vec::new();
        done.resize_with(rows.len(), || None);
        let mut slots: BTreeMap<usize, SlotRows> = BTreeMap::new();
        for (at, row) in rows.into_iter().enumerate() {
            let pinned = |slot: usize| slots.get(&slot).map(|rows| rows.version.clone());
            match self.prepare(at, row, pinned, route_until, claim_took) {
                Prepared::Done(routed) => done[at] = Some(routed),
                Prepared::Wait {
                    slot,
                    version,
                    waiting,
                    event,
                    span,
                } => {
                    let rows = slots.entry(slot).or_insert_with(|| SlotRows {
                        version,
                        waiting: Vec::new(),
                        events: Vec::new(),
                        spans: Vec::new(),
                    });
                    rows.waiting.push(waiting);
                    rows.events.push(event);
                    rows.spans.push(span);
                }
            }
        }
        for rows in slots.into_values() {
            self.route_slot(rows, route_until, claim_took, &mut done);
        }
        done.into_iter().flatten().collect()
    }

    /// The outcome of a row not routed in time (see
    /// [`RetryPolicy::after_spent_lease`]).
    fn spent_lease(&self, attempts: u32, claim_took: Duration) -> Outcome {
        let reserved = self.config.publish_timeout() + super::ACK_RESERVE;
        self.retry.after_spent_lease(
            attempts,
            claim_took,
            self.config.lease_duration(),
            reserved,
            "routing",
        )
    }

    /// Everything up to the plugin call: the attempt limit, the event, the
    /// native router, which plugin, whether it is loaded and time is left.
    fn prepare(
        &self,
        at: usize,
        mut row: OutboxRow,
        pinned: impl Fn(usize) -> Option<Arc<PluginVersion>>,
        route_until: Instant,
        claim_took: Duration,
    ) -> Prepared {
        let inner = self;
        let attempts = u32::try_from(row.attempts).unwrap_or(u32::MAX);
        if attempts > inner.config.max_attempts {
            // Only reached when leases keep expiring (e.g. the relay crashed
            // while holding this row every time).
            let error = format!("lease expired {} times without an outcome", attempts - 1);
            return Prepared::Done(RoutedRow::failed(row, Outcome::Dead { error }, None));
        }
        let event = match router::event_from_row(&row, inner.limits) {
            Ok(event) => event,
            Err(error) => {
                let error = error.to_string();
                return Prepared::Done(RoutedRow::failed(row, Outcome::Dead { error }, None));
            }
        };
        // The event has its own copy of the payload and nothing after routing
        // reads the row's: a batch waiting for its plugins holds each once.
        row.payload_json = None;
        row.payload_bytes = None;
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
        if let Some(native) = inner.native_router {
            let started = Instant::now();
            let result = span.in_scope(|| native(&event)).map_err(CallFailure::from);
            self.observe_call("native", started);
            let state =
                span.in_scope(|| self.call_outcome(result, &event, "native", None, attempts, child.as_ref()));
            return Prepared::Done(RoutedRow { row, state, span });
        }
        let Some(slot) = inner.plugins.select(&event.aggregate_type, &event.event_type) else {
            let state = self.unmatched(&event);
            return Prepared::Done(RoutedRow { row, state, span });
        };
        if Instant::now() >= route_until {
            let outcome = inner.spent_lease(attempts, claim_took);
            return Prepared::Done(RoutedRow::failed(row, outcome, None).in_span(&span));
        }
        let Some(version) = pinned(slot).or_else(|| inner.plugins.slots()[slot].current()) else {
            let outcome = self.unloaded(slot);
            return Prepared::Done(RoutedRow::failed(row, outcome, None).in_span(&span));
        };
        Prepared::Wait {
            slot,
            version,
            waiting: Waiting {
                at,
                row,
                attempts,
                child,
            },
            event,
            span,
        }
    }

    /// What happens to an event no plugin is configured for.
    fn unmatched(&self, event: &Event) -> RowState {
        match self.config.unmatched {
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
        }
    }

    /// The wait for a plugin whose file was deleted (and so unloaded).
    fn unloaded(&self, slot: usize) -> Outcome {
        let config = self.plugins.slots()[slot].config();
        Outcome::Defer {
            after: Duration::from_millis(self.config.poll_interval_ms.max(1000)),
            reason: format!(
                "plugin {} is unloaded (its file {} was deleted); waiting for it to return",
                config.name,
                config.path.display()
            ),
            waiting_on: Vec::new(),
        }
    }

    /// One plugin's rows of the batch through as few calls as its world allows.
    fn route_slot(
        &self,
        rows: SlotRows,
        route_until: Instant,
        claim_took: Duration,
        done: &mut [Option<RoutedRow>],
    ) {
        let SlotRows {
            version,
            waiting,
            events,
            spans,
        } = rows;
        let mut calls = Vec::new();
        let (answers, instance) = version.route_many(
            None,
            self.database,
            &events,
            &spans,
            route_until,
            &mut |took, events| calls.push((took, events)),
        );
        if let Some(instance) = instance {
            version.put_back(instance);
        }
        self.observe_calls(version.name(), &calls);
        let label = version.label();
        let version_id = Some(version.version().to_string());
        for (((waiting, event), span), answer) in waiting.into_iter().zip(&events).zip(spans).zip(answers) {
            let state = match answer {
                Some(result) => span.in_scope(|| {
                    self.call_outcome(
                        result,
                        event,
                        &label,
                        version_id.clone(),
                        waiting.attempts,
                        waiting.child.as_ref(),
                    )
                }),
                None => RowState::Failed {
                    outcome: self.spent_lease(waiting.attempts, claim_took),
                    version: None,
                },
            };
            done[waiting.at] = Some(RoutedRow {
                row: waiting.row,
                state,
                span,
            });
        }
    }

    /// Each event's share of the calls that routed it: a batch call's time
    /// is split among its events.
    fn observe_calls(&self, plugin: &str, calls: &[(Duration, usize)]) {
        let histogram = self.metrics.plugin_call(plugin);
        for &(took, events) in calls {
            let each = took.as_secs_f64() / events.max(1) as f64;
            for _ in 0..events {
                histogram.observe(each);
            }
        }
    }

    fn observe_call(&self, plugin: &str, started: Instant) {
        self.metrics
            .plugin_call(plugin)
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
                .retry
                .after_failure(attempts, format!("plugin {label} refused for now: {reason}")),
            Err(CallFailure::Crashed(reason)) => self
                .retry
                .after_failure(attempts, format!("plugin {label} {reason}")),
            Err(CallFailure::Unavailable(reason)) => self.retry.after_failure(attempts, reason),
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
        let sinks = &self.sinks;
        match router::assemble(
            event,
            messages,
            label,
            self.limits,
            &|name| sinks.get(name).map(|sink| sink.deduplicates_by_id()),
            trace,
        ) {
            Ok(messages) => {
                debug!(outbox.event_id = %event.event_id, plugin.label = label, messages = messages.len(), "Routed.");
                RowState::Routed { messages, version }
            }
            Err(error) => RowState::Failed {
                outcome: Outcome::Dead {
                    error: error.to_string(),
                },
                version,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::plugin::{PluginEngine, Refusal};
    use crate::relay::plan::tests::row;
    use crate::relay::publish::tests::scripted;
    use crate::sinks::Sink;

    /// What a route stage borrows, owned by the test.
    struct Parts {
        config: RelayConfig,
        limits: Limits,
        plugins: Plugins,
        retry: RetryPolicy,
        metrics: Metrics,
        sinks: Sinks,
    }

    fn parts(unmatched: UnmatchedPolicy) -> Parts {
        let config = RelayConfig {
            unmatched,
            max_attempts: 3,
            ..RelayConfig::default()
        };
        let plugins = Plugins::load(PluginEngine::new(None).unwrap(), &[]).ok().unwrap();
        Parts {
            limits: Limits::from_config(&config),
            retry: RetryPolicy::from_config(&config),
            metrics: Metrics::new(None),
            sinks: Sinks::from_sinks([("out".to_string(), scripted(0, |_| Ok(())) as Arc<dyn Sink>)]),
            plugins,
            config,
        }
    }

    fn run(parts: &Parts, native: Option<NativeRouter>, rows: Vec<OutboxRow>) -> Vec<RoutedRow> {
        let stage = RouteStage {
            config: &parts.config,
            limits: &parts.limits,
            native_router: native.as_ref(),
            plugins: &parts.plugins,
            retry: &parts.retry,
            metrics: &parts.metrics,
            sinks: &parts.sinks,
            database: None,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        stage.run(rows, deadline, Duration::ZERO)
    }

    /// Sends each event to `target`, or refuses by event type.
    fn native(target: &'static str) -> NativeRouter {
        Arc::new(move |event: &Event| match event.event_type.as_str() {
            "Refused" => Err(Refusal::Permanent("not ours".into())),
            "Later" => Err(Refusal::Transient("busy".into())),
            _ => Ok(vec![Message {
                target: target.into(),
                topic: format!("orders.{}", event.event_type),
                key: Some(event.aggregate_id.clone()),
                payload: event.payload.clone(),
                headers: Vec::new(),
            }]),
        })
    }

    fn with_type(mut row: OutboxRow, event_type: &str) -> OutboxRow {
        row.event_type = event_type.into();
        row
    }

    fn outcome(routed: &RoutedRow) -> &Outcome {
        match &routed.state {
            RowState::Failed { outcome, .. } => outcome,
            RowState::Routed { .. } => panic!("row {} was routed", routed.row.id),
        }
    }

    #[test]
    fn every_row_keeps_its_place_and_gets_its_own_state() {
        let parts = parts(UnmatchedPolicy::DeadLetter);
        let rows = vec![
            row(1, &[]),
            with_type(row(2, &[]), "Refused"),
            with_type(row(3, &[]), "Later"),
            row(4, &[]),
        ];
        let routed = run(&parts, Some(native("out")), rows);
        let ids: Vec<i64> = routed.iter().map(|r| r.row.id.0).collect();
        assert_eq!(ids, vec![1, 2, 3, 4]);
        let RowState::Routed { messages, .. } = &routed[0].state else {
            panic!("row 1 not routed");
        };
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0].target, "out");
        assert_eq!(messages[0].message.topic, "orders.OrderCreated");
        assert_eq!(messages[0].message.key.as_deref(), Some("order-1"));
        assert!(
            matches!(outcome(&routed[1]), Outcome::Dead { error } if error.contains("refused permanently: not ours"))
        );
        assert!(
            matches!(outcome(&routed[2]), Outcome::Retry { error, .. } if error.contains("refused for now: busy"))
        );
        assert!(matches!(routed[3].state, RowState::Routed { .. }));
    }

    #[test]
    fn a_message_to_a_target_that_does_not_exist_dead_letters_its_row() {
        let parts = parts(UnmatchedPolicy::DeadLetter);
        let routed = run(&parts, Some(native("nowhere")), vec![row(1, &[])]);
        assert!(
            matches!(outcome(&routed[0]), Outcome::Dead { error } if error.contains("nowhere")),
            "{:?}",
            outcome(&routed[0])
        );
    }

    #[test]
    fn rows_past_their_attempts_or_unreadable_are_decided_before_any_call() {
        let parts = parts(UnmatchedPolicy::DeadLetter);
        let mut spent = row(1, &[]);
        spent.attempts = 4;
        let mut unreadable = row(2, &[]);
        unreadable.headers_json = "[1, 2]".into();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        let router: NativeRouter = Arc::new(move |event: &Event| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            native("out")(event)
        });
        let routed = run(&parts, Some(router), vec![spent, unreadable, row(3, &[])]);
        assert!(
            matches!(outcome(&routed[0]), Outcome::Dead { error } if error == "lease expired 3 times without an outcome")
        );
        assert!(matches!(outcome(&routed[1]), Outcome::Dead { error } if error.contains("headers")));
        assert!(matches!(routed[2].state, RowState::Routed { .. }));
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn an_event_no_plugin_matches_follows_the_unmatched_policy() {
        let dead = run(&parts(UnmatchedPolicy::DeadLetter), None, vec![row(1, &[])]);
        assert!(
            matches!(outcome(&dead[0]), Outcome::Dead { error } if error.contains("no plugin matches aggregate type \"order\""))
        );
        let dropped = run(&parts(UnmatchedPolicy::Drop), None, vec![row(1, &[])]);
        assert!(matches!(&dropped[0].state, RowState::Routed { messages, .. } if messages.is_empty()));
    }
}
