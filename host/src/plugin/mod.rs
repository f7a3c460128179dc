//! The WebAssembly plugin runtime: one wasmtime `Engine`, each plugin version
//! compiled and pre-instantiated once, instances pooled and reused until one
//! traps, and every call bounded in time (epoch deadline) and memory.

mod bindings;
mod host;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Engine, Store, Trap};

use crate::config::PluginConfig;
pub use bindings::switchyard::plugin::types::{Event, Message, PayloadFormat, Refusal};
use bindings::{Router, RouterPre};
use host::State;

/// How often the engine's epoch advances; the unit of plugin time limits.
const EPOCH_TICK: Duration = Duration::from_millis(5);

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
    /// A component, but not for this WIT world (missing exports, wrong types, unknown imports).
    #[error("{path} does not implement the switchyard:plugin/router world: {reason}")]
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
    /// The plugin trapped, ran out of time or memory; the instance was discarded.
    Crashed(String),
}

/// The shared engine and linker.
#[derive(Clone)]
pub struct PluginEngine {
    engine: Engine,
    linker: Arc<Linker<State>>,
}

impl PluginEngine {
    /// Builds the engine and starts its epoch ticker thread.
    ///
    /// # Errors
    /// If wasmtime cannot be configured on this host.
    pub fn new() -> anyhow::Result<PluginEngine> {
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(true);
        config.wasm_component_model(true);
        let engine = Engine::new(&config)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
        Router::add_to_linker::<State, HasSelf<State>>(&mut linker, |state| state)?;
        spawn_epoch_ticker(engine.weak());
        Ok(PluginEngine {
            engine,
            linker: Arc::new(linker),
        })
    }

    /// Compiles, links and initialises one plugin version from its file.
    ///
    /// # Errors
    /// A [`LoadError`] saying which stage failed.
    pub fn load(&self, config: &PluginConfig) -> Result<PluginVersion, LoadError> {
        let bytes = std::fs::read(&config.path).map_err(|source| LoadError::Read {
            path: config.path.clone(),
            source,
        })?;
        self.load_bytes(config, &bytes)
    }

    /// Like [`PluginEngine::load`], from bytes already read.
    ///
    /// # Errors
    /// A [`LoadError`] saying which stage failed.
    pub fn load_bytes(&self, config: &PluginConfig, bytes: &[u8]) -> Result<PluginVersion, LoadError> {
        let started = Instant::now();
        let version = content_hash(bytes);
        let component = Component::new(&self.engine, bytes).map_err(|e| LoadError::Compile {
            path: config.path.clone(),
            reason: format!("{e:#}"),
        })?;
        let contract = |e: wasmtime::Error| LoadError::Contract {
            path: config.path.clone(),
            reason: format!("{e:#}"),
        };
        let instance_pre = self.linker.instantiate_pre(&component).map_err(contract)?;
        let pre = RouterPre::new(instance_pre).map_err(contract)?;
        let config_json = serde_json::to_string(&config.config).unwrap_or_else(|_| "{}".to_string());
        let plugin = PluginVersion {
            name: Arc::from(config.name.as_str()),
            version: Arc::from(version.as_str()),
            path: config.path.clone(),
            pre,
            engine: self.engine.clone(),
            config_json,
            timeout: Duration::from_millis(config.timeout_ms),
            max_memory_bytes: config.max_memory_bytes,
            idle: Mutex::new(Vec::new()),
            compile_time: started.elapsed(),
        };
        // A version goes live only after one instance passed init.
        let instance = plugin.instantiate()?;
        plugin.put_back(instance);
        Ok(plugin)
    }
}

fn spawn_epoch_ticker(engine: wasmtime::EngineWeak) {
    let spawned = std::thread::Builder::new()
        .name("switchyard-epoch".into())
        .spawn(move || {
            while let Some(engine) = engine.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(EPOCH_TICK);
            }
        });
    if let Err(error) = spawned {
        // Without the ticker no call would ever time out; say so loudly.
        tracing::error!(%error, "Cannot start the plugin epoch ticker; plugin time limits are off.");
    }
}

/// Short, stable version id of a plugin file: the first 12 hex digits of its SHA-256.
pub fn content_hash(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    format!("{digest:x}")[..12].to_string()
}

/// One compiled, initialised plugin version.
pub struct PluginVersion {
    name: Arc<str>,
    version: Arc<str>,
    path: PathBuf,
    pre: RouterPre<State>,
    engine: Engine,
    config_json: String,
    timeout: Duration,
    max_memory_bytes: usize,
    idle: Mutex<Vec<Instance>>,
    compile_time: Duration,
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

    fn instantiate(&self) -> Result<Instance, LoadError> {
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
        match router.call_init(&mut store, &self.config_json) {
            Ok(Ok(())) => Ok(Instance { store, router }),
            Ok(Err(reason)) => Err(init_error(reason)),
            Err(e) => Err(init_error(describe_trap(&e, self.timeout, self.max_memory_bytes))),
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
        match instance.router.call_route(&mut instance.store, event) {
            Ok(Ok(messages)) => (Ok(messages), Some(instance)),
            Ok(Err(Refusal::Transient(reason))) => (Err(CallFailure::Transient(reason)), Some(instance)),
            Ok(Err(Refusal::Permanent(reason))) => (Err(CallFailure::Permanent(reason)), Some(instance)),
            Err(e) => (
                Err(CallFailure::Crashed(describe_trap(
                    &e,
                    self.timeout,
                    self.max_memory_bytes,
                ))),
                None,
            ),
        }
    }
}

fn describe_trap(error: &wasmtime::Error, timeout: Duration, max_memory_bytes: usize) -> String {
    match error.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => format!("exceeded its time limit of {} ms", timeout.as_millis()),
        Some(trap) => format!("trapped: {trap}"),
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

/// A configured plugin and the version currently serving it.
pub struct PluginSlot {
    config: PluginConfig,
    current: RwLock<Arc<PluginVersion>>,
}

impl PluginSlot {
    /// The plugin's config.
    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    /// The version serving now.
    pub fn current(&self) -> Arc<PluginVersion> {
        match self.current.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Makes `version` the one serving from now on; batches holding the old one finish with it.
    pub fn replace(&self, version: PluginVersion) {
        let version = Arc::new(version);
        match self.current.write() {
            Ok(mut current) => *current = version,
            Err(poisoned) => *poisoned.into_inner() = version,
        }
    }
}

/// Every configured plugin, in match order.
#[derive(Clone)]
pub struct Plugins {
    engine: PluginEngine,
    slots: Arc<Vec<PluginSlot>>,
}

impl Plugins {
    /// Loads every configured plugin; all must load.
    ///
    /// # Errors
    /// Every load error, one per failing plugin.
    pub fn load(engine: PluginEngine, configs: &[PluginConfig]) -> Result<Plugins, Vec<LoadError>> {
        let mut slots = Vec::new();
        let mut errors = Vec::new();
        for config in configs {
            match engine.load(config) {
                Ok(version) => {
                    tracing::info!(
                        plugin.name = %config.name,
                        plugin.version = version.version(),
                        compile_ms = version.compile_time().as_millis() as u64,
                        "Plugin loaded."
                    );
                    slots.push(PluginSlot {
                        config: config.clone(),
                        current: RwLock::new(Arc::new(version)),
                    });
                }
                Err(e) => errors.push(e),
            }
        }
        if errors.is_empty() {
            Ok(Plugins {
                engine,
                slots: Arc::new(slots),
            })
        } else {
            Err(errors)
        }
    }

    /// The engine the plugins run on.
    pub fn engine(&self) -> &PluginEngine {
        &self.engine
    }

    /// All plugins, in match order.
    pub fn slots(&self) -> &[PluginSlot] {
        &self.slots
    }

    /// Index of the first plugin whose filters accept the event.
    pub fn select(&self, aggregate_type: &str, event_type: &str) -> Option<usize> {
        self.slots
            .iter()
            .position(|slot| slot.config.matches(aggregate_type, event_type))
    }
}
