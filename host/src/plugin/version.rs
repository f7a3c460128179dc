//! One compiled plugin version: its pre-instantiated component, a pool of
//! instances that passed `init`, and the bounded `route` call.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use wasmtime::{Engine, Store};

use super::bindings::{Router, RouterPre};
use super::engine::{EPOCH_TICK, Tier};
use super::error::{CallFailure, LoadError, describe_trap, with_stderr};
use super::host::State;
use super::{Event, Message, Refusal};

/// One compiled, initialised plugin version.
pub struct PluginVersion {
    pub(super) name: Arc<str>,
    pub(super) version: Arc<str>,
    pub(super) path: PathBuf,
    pub(super) pre: RouterPre<State>,
    pub(super) engine: Engine,
    pub(super) tier: Tier,
    pub(super) config_json: String,
    pub(super) timeout: Duration,
    pub(super) max_memory_bytes: usize,
    pub(super) idle: Mutex<Vec<Instance>>,
    pub(super) compile_time: Duration,
}

/// A live instance: its store and bindings. Used by one batch at a time.
pub struct Instance {
    store: Store<State>,
    router: Router,
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

    fn deadline_ticks(&self) -> u64 {
        let ticks = self.timeout.as_micros().div_ceil(EPOCH_TICK.as_micros());
        // One extra tick: the current one may be about to end.
        u64::try_from(ticks).unwrap_or(u64::MAX).saturating_add(1)
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
        let state = State::new(self.name.clone(), self.version.clone(), self.max_memory_bytes);
        let mut store = Store::new(&self.engine, state);
        store.limiter(|state| &mut state.limits);
        store.set_epoch_deadline(self.deadline_ticks());
        let router = self
            .pre
            .instantiate(&mut store)
            .map_err(|e| init_error(describe_trap(&e, self.timeout, self.max_memory_bytes)))?;
        store.set_epoch_deadline(self.deadline_ticks());
        let result = router.call_init(&mut store, &self.config_json);
        let stderr = store.data().flush_output();
        match result {
            Ok(Ok(())) => Ok(Instance { store, router }),
            Ok(Err(reason)) => Err(init_error(reason)),
            Err(e) => Err(init_error(with_stderr(
                describe_trap(&e, self.timeout, self.max_memory_bytes),
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

    /// Calls `route` for one event on `instance`. After a `Crashed` failure the
    /// instance is gone (its memory may be corrupt); otherwise it is handed back.
    pub fn route(
        &self,
        mut instance: Instance,
        event: &Event,
    ) -> (Result<Vec<Message>, CallFailure>, Option<Instance>) {
        instance.store.set_epoch_deadline(self.deadline_ticks());
        let result = instance.router.call_route(&mut instance.store, event);
        let stderr = instance.store.data().flush_output();
        match result {
            Ok(Ok(messages)) => (Ok(messages), Some(instance)),
            Ok(Err(Refusal::Transient(reason))) => (Err(CallFailure::Transient(reason)), Some(instance)),
            Ok(Err(Refusal::Permanent(reason))) => (Err(CallFailure::Permanent(reason)), Some(instance)),
            Err(e) => (
                Err(CallFailure::Crashed(with_stderr(
                    describe_trap(&e, self.timeout, self.max_memory_bytes),
                    &stderr,
                ))),
                None,
            ),
        }
    }
}
