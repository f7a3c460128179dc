//! One compiled plugin version: its pre-instantiated component, a pool of
//! instances that passed `init`, and the bounded calls: `route` one event at
//! a time, or `route-batch` many at once with a fallback that isolates the
//! event at fault.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wasmtime::{Engine, Store};

use super::bindings::{BatchRouter, BatchRouterPre, Router, RouterPre};
use super::engine::{EPOCH_TICK, Tier};
use super::error::{CallFailure, LoadError, describe_trap, with_stderr};
use super::host::State;
use super::{Event, Message};

/// One compiled, initialised plugin version.
pub struct PluginVersion {
    pub(super) name: Arc<str>,
    pub(super) version: Arc<str>,
    pub(super) path: PathBuf,
    pub(super) pre: Pre,
    pub(super) engine: Engine,
    pub(super) tier: Tier,
    pub(super) config_json: String,
    pub(super) timeout: Duration,
    pub(super) max_memory_bytes: usize,
    pub(super) idle: Mutex<Vec<Instance>>,
    pub(super) compile_time: Duration,
}

/// A component checked against one of the two worlds, ready to instantiate.
pub(super) enum Pre {
    /// Exports `route`.
    Single(RouterPre<State>),
    /// Exports `route-batch`.
    Batch(BatchRouterPre<State>),
}

enum Exports {
    Single(Router),
    Batch(BatchRouter),
}

/// A live instance: its store and bindings. Used by one batch at a time.
pub struct Instance {
    store: Store<State>,
    exports: Exports,
}

/// What a plugin made of one event: messages to publish, or why none.
pub type Answer = Result<Vec<Message>, CallFailure>;

/// Answers for one call's events, or why the call as a whole gave none.
type BatchAnswer = Result<Vec<Answer>, BatchFailure>;

/// Why a `route-batch` call gave no answers (its events are then routed one
/// at a time). Said after "A route-batch call".
#[derive(Debug, thiserror::Error)]
enum BatchFailure {
    #[error("was called as a batch plugin but exports `route`")]
    NotBatch,
    #[error("returned {} for {}", counted(*answers, "result"), counted(*events, "event"))]
    WrongCount { answers: usize, events: usize },
    /// Trapped, out of time or memory: the instance is discarded.
    #[error("{0}")]
    Trapped(String),
}

/// The least time an instance's `init` gets; see [`PluginVersion::init_limit`].
const INIT_TIME_FLOOR: Duration = Duration::from_secs(1);

/// Most event bytes handed to one `route-batch` call, as a share of the
/// plugin's memory limit: a batch of large payloads is split so that
/// copying it in cannot exhaust the instance's memory.
const BATCH_MEMORY_SHARE: usize = 8;

/// Tries at making a component's memory image before its load fails.
const IMAGE_TRIES: u64 = 5;

/// Whether an instantiation failed only because the kernel was busy
/// sealing the memory image wasmtime builds at a module's first instance
/// (`F_ADD_SEALS` answers EBUSY while pages of the fresh memfd are still
/// referenced). Seen under load; the image is not cached after a failure,
/// so another try builds it again.
fn image_busy(error: &wasmtime::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ResourceBusy)
    })
}

impl PluginVersion {
    /// The plugin's configured name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The content hash of the file this version came from.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Which compiler built this version.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// How long compiling, linking and the first init took.
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }

    /// `name@version`, as used in errors and logs.
    pub fn label(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    /// Whether this version exports `route-batch`.
    pub fn batched(&self) -> bool {
        matches!(self.pre, Pre::Batch(_))
    }

    fn deadline_ticks(&self) -> u64 {
        ticks(self.timeout)
    }

    /// `init` runs once per instance and may build tables or parse rules,
    /// so it gets at least [`INIT_TIME_FLOOR`] even when `route` gets 100 ms:
    /// a busy machine must not turn a working plugin's start into a refusal.
    fn init_limit(&self) -> Duration {
        self.timeout.max(INIT_TIME_FLOOR)
    }

    /// A fresh instance that passed `init`. WASI's host calls block on a
    /// tokio runtime, which panics on a runtime thread, so on one this runs
    /// on a short-lived thread of its own (instances are made rarely: at
    /// load, and after a trap).
    pub(super) fn instantiate(&self) -> Result<Instance, LoadError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return self.instantiate_here();
        }
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("switchyard-plugin-init".into())
                .spawn_scoped(scope, || self.instantiate_here())
                .map_err(|e| LoadError::Init {
                    name: self.name.to_string(),
                    version: self.version.to_string(),
                    reason: format!("cannot start a thread for init: {e}"),
                })?
                .join()
                .unwrap_or_else(|_| {
                    Err(LoadError::Init {
                        name: self.name.to_string(),
                        version: self.version.to_string(),
                        reason: "init panicked in the host".to_string(),
                    })
                })
        })
    }

    fn instantiate_here(&self) -> Result<Instance, LoadError> {
        let init_error = |reason: String| LoadError::Init {
            name: self.name.to_string(),
            version: self.version.to_string(),
            reason,
        };
        let limit = self.init_limit();
        let trap = |e: wasmtime::Error| init_error(describe_trap(&e, limit, self.max_memory_bytes));
        let mut tries = 0;
        let (mut store, exports) = loop {
            let state = State::new(self.name.clone(), self.version.clone(), self.max_memory_bytes);
            let mut store = Store::new(&self.engine, state);
            store.limiter(|state| &mut state.limits);
            store.set_epoch_deadline(ticks(limit));
            let made = match &self.pre {
                Pre::Single(pre) => pre.instantiate(&mut store).map(Exports::Single),
                Pre::Batch(pre) => pre.instantiate(&mut store).map(Exports::Batch),
            };
            match made {
                Ok(exports) => break (store, exports),
                Err(e) if tries < IMAGE_TRIES && image_busy(&e) => {
                    tries += 1;
                    tracing::warn!(plugin = %self.name, error = %format!("{e:#}"), tries, "The kernel was busy sealing the plugin's memory image; trying again.");
                    std::thread::sleep(std::time::Duration::from_millis(20 * tries));
                }
                Err(e) => return Err(trap(e)),
            }
        };
        store.set_epoch_deadline(ticks(limit));
        let result = match &exports {
            Exports::Single(router) => router.call_init(&mut store, &self.config_json),
            Exports::Batch(router) => router.call_init(&mut store, &self.config_json),
        };
        let stderr = store.data_mut().flush_output();
        match result {
            Ok(Ok(())) => Ok(Instance { store, exports }),
            Ok(Err(reason)) => Err(init_error(reason)),
            Err(e) => Err(init_error(with_stderr(
                describe_trap(&e, limit, self.max_memory_bytes),
                &stderr,
            ))),
        }
    }

    /// Takes an idle instance or makes a new one.
    ///
    /// # Errors
    /// [`LoadError::Init`] when a new instance fails to start.
    pub fn checkout(&self) -> Result<Instance, LoadError> {
        let idle = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        match idle {
            Some(instance) => Ok(instance),
            None => self.instantiate(),
        }
    }

    /// Returns a healthy instance to the pool.
    pub fn put_back(&self, instance: Instance) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(instance);
        }
    }

    /// Routes one event on `instance` (a batch plugin gets a batch of one).
    /// After a trap the instance is gone (its memory may be corrupt);
    /// otherwise it is handed back.
    pub fn route(
        &self,
        mut instance: Instance,
        event: &Event,
    ) -> (Result<Vec<Message>, CallFailure>, Option<Instance>) {
        let Exports::Single(router) = &instance.exports else {
            let (answer, back) = self.call_batch(instance, std::slice::from_ref(event), self.timeout);
            let answer = answer
                .map_err(|failure| CallFailure::Crashed(failure.to_string()))
                .and_then(|mut answers| answers.pop().unwrap_or_else(|| Ok(Vec::new())));
            return (answer, back);
        };
        instance.store.set_epoch_deadline(self.deadline_ticks());
        let result = router.call_route(&mut instance.store, event);
        let stderr = instance.store.data_mut().flush_output();
        match result {
            Ok(answer) => (answer.map_err(CallFailure::from), Some(instance)),
            Err(e) => (
                Err(CallFailure::Crashed(with_stderr(
                    describe_trap(&e, self.timeout, self.max_memory_bytes),
                    &stderr,
                ))),
                None,
            ),
        }
    }

    /// Routes `events` with as few calls as the plugin's world allows: one
    /// `route-batch` call per chunk (split by size), or one `route` call per
    /// event. A batch call gets `timeout_ms` per event, but at most half the
    /// time left before `until`, so that after it traps, runs out of time or
    /// answers with the wrong number of results there is time to route its
    /// events one at a time: only the event at fault fails, not its batch.
    /// An event on a later attempt is routed on its own: if it made a batch
    /// fail before, it does not cost a whole batch call again.
    ///
    /// Answers are in the order of `events`; `None` for an event not reached
    /// before `until`. A call for one event runs in that event's span from
    /// `spans`, if given. `observe` is told each call's duration and event count.
    pub fn route_many(
        &self,
        instance: Option<Instance>,
        database: Option<&str>,
        events: &[Event],
        spans: &[tracing::Span],
        until: Instant,
        observe: &mut dyn FnMut(Duration, usize),
    ) -> (Vec<Option<Answer>>, Option<Instance>) {
        let mut calls = Calls {
            version: self,
            instance,
            database,
            events,
            spans,
            until,
            observe,
            answers: Vec::with_capacity(events.len()),
        };
        let mut at = 0;
        while at < events.len() {
            if !self.batched() || events[at].attempt > 1 {
                calls.one_at_a_time(at);
                at += 1;
                continue;
            }
            let end = (at..events.len())
                .find(|&i| events[i].attempt > 1)
                .unwrap_or(events.len());
            calls.batched(at..end);
            at = end;
        }
        (calls.answers, calls.instance)
    }
    fn route_one(
        &self,
        instance: &mut Option<Instance>,
        database: Option<&str>,
        event: &Event,
        observe: &mut dyn FnMut(Duration, usize),
    ) -> Result<Vec<Message>, CallFailure> {
        let mut current = match instance.take().map_or_else(|| self.checkout(), Ok) {
            Ok(current) => current,
            Err(error) => return Err(CallFailure::Unavailable(error.to_string())),
        };
        current.store.data_mut().set_database(database);
        let started = Instant::now();
        let (answer, back) = self.route(current, event);
        observe(started.elapsed(), 1);
        *instance = back;
        answer
    }

    /// One `route-batch` call within `limit`. The instance is handed back
    /// unless the call trapped.
    fn call_batch(
        &self,
        mut instance: Instance,
        events: &[Event],
        limit: Duration,
    ) -> (BatchAnswer, Option<Instance>) {
        let Exports::Batch(router) = &instance.exports else {
            return (Err(BatchFailure::NotBatch), Some(instance));
        };
        instance.store.set_epoch_deadline(ticks(limit));
        let result = router.call_route_batch(&mut instance.store, events);
        let stderr = instance.store.data_mut().flush_output();
        match result {
            Ok(answers) if answers.len() == events.len() => (
                Ok(answers
                    .into_iter()
                    .map(|answer| answer.map_err(CallFailure::from))
                    .collect()),
                Some(instance),
            ),
            Ok(answers) => (
                Err(BatchFailure::WrongCount {
                    answers: answers.len(),
                    events: events.len(),
                }),
                Some(instance),
            ),
            Err(e) => (
                Err(BatchFailure::Trapped(with_stderr(
                    describe_trap(&e, limit, self.max_memory_bytes),
                    &stderr,
                ))),
                None,
            ),
        }
    }
}

/// One `route_many`: the instance in use and the answers so far.
struct Calls<'a> {
    version: &'a PluginVersion,
    instance: Option<Instance>,
    database: Option<&'a str>,
    events: &'a [Event],
    spans: &'a [tracing::Span],
    until: Instant,
    observe: &'a mut dyn FnMut(Duration, usize),
    answers: Vec<Option<Answer>>,
}

impl Calls<'_> {
    fn one_at_a_time(&mut self, at: usize) {
        let answer = (Instant::now() < self.until).then(|| {
            let span = self.spans.get(at).cloned().unwrap_or_else(tracing::Span::none);
            span.in_scope(|| {
                self.version.route_one(
                    &mut self.instance,
                    self.database,
                    &self.events[at],
                    &mut *self.observe,
                )
            })
        });
        self.answers.push(answer);
    }

    /// `events[range]` in `route-batch` calls, each chunk one at a time
    /// again if its call fails as a whole.
    fn batched(&mut self, range: std::ops::Range<usize>) {
        let version = self.version;
        let budget = version.max_memory_bytes / BATCH_MEMORY_SHARE;
        let mut first = range.start;
        for chunk in chunks(&self.events[range], budget) {
            let chunk_range = first..first + chunk.len();
            first = chunk_range.end;
            let left = self.until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.answers.extend(chunk.iter().map(|_| None));
                continue;
            }
            let mut current = match self.instance.take().map_or_else(|| version.checkout(), Ok) {
                Ok(current) => current,
                Err(error) => {
                    let error = CallFailure::Unavailable(error.to_string());
                    self.answers
                        .extend(chunk.iter().map(|_| Some(Err(error.clone()))));
                    continue;
                }
            };
            current.store.data_mut().set_database(self.database);
            let per_event = version
                .timeout
                .saturating_mul(u32::try_from(chunk.len()).unwrap_or(u32::MAX));
            let limit = per_event.min(left / 2).max(version.timeout);
            let started = Instant::now();
            let (answer, back) = version.call_batch(current, chunk, limit);
            (self.observe)(started.elapsed(), chunk.len());
            self.instance = back;
            match answer {
                Ok(chunk_answers) => self.answers.extend(chunk_answers.into_iter().map(Some)),
                Err(reason) => {
                    tracing::warn!(
                        plugin.name = &*version.name,
                        plugin.version = &*version.version,
                        events = chunk.len(),
                        "A route-batch call {reason}; routing its events one at a time."
                    );
                    for at in chunk_range {
                        self.one_at_a_time(at);
                    }
                }
            }
        }
    }
}

fn counted(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Epoch ticks for a time limit.
fn ticks(limit: Duration) -> u64 {
    let ticks = limit.as_micros().div_ceil(EPOCH_TICK.as_micros());
    // One extra tick: the current one may be about to end.
    u64::try_from(ticks).unwrap_or(u64::MAX).saturating_add(1)
}

/// Consecutive runs of `events` whose bytes stay under `budget` (at least one event each).
fn chunks(events: &[Event], budget: usize) -> impl Iterator<Item = &[Event]> {
    let mut rest = events;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut used = 0usize;
        let mut end = 0;
        while end < rest.len() {
            used = used.saturating_add(event_bytes(&rest[end]));
            if end > 0 && used > budget {
                break;
            }
            end += 1;
        }
        let (chunk, tail) = rest.split_at(end);
        rest = tail;
        Some(chunk)
    })
}

fn event_bytes(event: &Event) -> usize {
    let headers: usize = event
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    event.payload.len()
        + headers
        + event.event_id.len()
        + event.aggregate_type.len()
        + event.aggregate_id.len()
        + event.event_type.len()
        + event.tenant.as_ref().map_or(0, String::len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_memory_image_is_tried_again_and_nothing_else_is() {
        let busy = wasmtime::Error::new(std::io::Error::from(std::io::ErrorKind::ResourceBusy))
            .context("cannot add seals to the memfd")
            .context("failed to instantiate");
        assert!(image_busy(&busy));
        let trap = wasmtime::Error::msg("wasm trap: unreachable");
        assert!(!image_busy(&trap));
        let refused = wasmtime::Error::new(std::io::Error::from(std::io::ErrorKind::PermissionDenied));
        assert!(!image_busy(&refused));
    }
    use crate::plugin::PayloadFormat;

    fn event(payload: usize) -> Event {
        Event {
            row_id: 1,
            event_id: String::new(),
            aggregate_type: String::new(),
            aggregate_id: String::new(),
            event_type: String::new(),
            payload: vec![0; payload],
            payload_format: PayloadFormat::Binary,
            headers: Vec::new(),
            tenant: None,
            created_at_ms: 0,
            attempt: 1,
        }
    }

    fn sizes(events: &[Event], budget: usize) -> Vec<usize> {
        chunks(events, budget).map(<[Event]>::len).collect()
    }

    #[test]
    fn chunks_keep_under_the_budget_and_give_an_oversized_event_its_own() {
        assert_eq!(sizes(&[], 100), Vec::<usize>::new());
        let small: Vec<Event> = (0..10).map(|_| event(30)).collect();
        assert_eq!(sizes(&small, 100), vec![3, 3, 3, 1]);
        assert_eq!(sizes(&small, usize::MAX), vec![10]);
        let mixed = vec![event(30), event(500), event(30), event(30)];
        assert_eq!(
            sizes(&mixed, 100),
            vec![1, 1, 2],
            "an event over the budget goes alone"
        );
    }
}
