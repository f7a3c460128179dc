//! The WebAssembly plugin runtime: one wasmtime `Engine`, each plugin version
//! compiled and pre-instantiated once, instances pooled and reused until one
//! traps, and every call bounded in time (epoch deadline) and memory.

mod bindings;
mod host;
mod output;
pub mod watch;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker};
use wasmtime::{Engine, Store, Trap};

use crate::config::PluginConfig;
pub use bindings::switchyard::plugin::types::{Event, Message, PayloadFormat, Refusal};
use bindings::{Router, RouterPre};
use host::State;

/// Quiet time after a reload before the optimising compile starts.
const OPTIMIZE_AFTER: Duration = Duration::from_secs(1);

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

/// Which compiler produced a plugin version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Winch, wasmtime's baseline compiler: compiles several times faster,
    /// runs slower. Used to make a reloaded file live quickly.
    Baseline,
    /// Cranelift: slower to compile, fast code. Every version ends up here.
    Optimized,
    /// Cranelift on a single thread, for the upgrade after a reload.
    Background,
}

/// An engine and the linker for it.
struct Compiler {
    engine: Engine,
    linker: Arc<Linker<State>>,
}

impl Compiler {
    fn new(
        strategy: wasmtime::Strategy,
        cache: Option<wasmtime::Cache>,
        background: bool,
    ) -> anyhow::Result<Compiler> {
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(true);
        config.wasm_component_model(true);
        config.strategy(strategy);
        // The optimising tier compiles in the background after a reload; on
        // its own thread it cannot hold up the rayon pool the baseline tier
        // (or the relay) needs right now.
        config.parallel_compilation(strategy != wasmtime::Strategy::Cranelift || !background);
        config.cache(cache);
        let engine = Engine::new(&config)?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
        Router::add_to_linker::<State, HasSelf<State>>(&mut linker, |state| state)?;
        spawn_epoch_ticker(engine.weak());
        Ok(Compiler {
            engine,
            linker: Arc::new(linker),
        })
    }
}

/// The shared engines and linkers: an optimising one for steady state and a
/// baseline one so that a hot reload goes live fast.
#[derive(Clone)]
pub struct PluginEngine {
    optimized: Arc<Compiler>,
    /// Cranelift without parallel compilation, for upgrades after a reload.
    background: Arc<Compiler>,
    baseline: Arc<Compiler>,
    cache: Option<wasmtime::Cache>,
}

impl PluginEngine {
    /// Builds the engines and starts their epoch ticker threads. With
    /// `cache_dir`, compiled components are kept on disk (wasmtime's cache:
    /// keyed by the file's hash, the wasmtime version and the compiler
    /// settings, holding only artifacts this relay wrote), so a restart does
    /// not recompile.
    ///
    /// # Errors
    /// If wasmtime cannot be configured on this host or the cache directory is unusable.
    pub fn new(cache_dir: Option<&Path>) -> anyhow::Result<PluginEngine> {
        let cache = match cache_dir {
            Some(dir) => {
                let mut cache_config = wasmtime::CacheConfig::new();
                cache_config.with_directory(dir);
                Some(wasmtime::Cache::new(cache_config)?)
            }
            None => None,
        };
        Ok(PluginEngine {
            optimized: Arc::new(Compiler::new(
                wasmtime::Strategy::Cranelift,
                cache.clone(),
                false,
            )?),
            background: Arc::new(Compiler::new(wasmtime::Strategy::Cranelift, cache.clone(), true)?),
            baseline: Arc::new(Compiler::new(wasmtime::Strategy::Winch, cache.clone(), false)?),
            cache,
        })
    }

    /// Compiled-component cache hits and misses since start, if caching is on.
    pub fn cache_stats(&self) -> Option<(usize, usize)> {
        self.cache
            .as_ref()
            .map(|cache| (cache.cache_hits(), cache.cache_misses()))
    }

    /// Compiles and type-checks a file against the router world without
    /// running it: what `switchyard plugin check` reports.
    ///
    /// # Errors
    /// A [`LoadError`] saying which stage failed.
    pub fn inspect(&self, path: &Path) -> Result<Inspection, LoadError> {
        let bytes = std::fs::read(path).map_err(|source| LoadError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let started = Instant::now();
        let engine = &self.optimized.engine;
        let component = Component::new(engine, &bytes).map_err(|e| LoadError::Compile {
            path: path.to_path_buf(),
            reason: one_line(&format!("{e:#}")),
        })?;
        let compile_time = started.elapsed();
        let component_type = component.component_type();
        let exports = component_type
            .exports(engine)
            .map(|(name, _)| name.to_string())
            .collect();
        let imports = component_type
            .imports(engine)
            .map(|(name, _)| name.to_string())
            .collect();
        let contract = |e: wasmtime::Error| LoadError::Contract {
            path: path.to_path_buf(),
            reason: one_line(&format!("{e:#}")),
        };
        let instance_pre = self
            .optimized
            .linker
            .instantiate_pre(&component)
            .map_err(contract)?;
        RouterPre::new(instance_pre).map_err(contract)?;
        Ok(Inspection {
            version: content_hash(&bytes),
            size: bytes.len(),
            compile_time,
            exports,
            imports,
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
        self.load_bytes(config, &bytes, Tier::Optimized)
    }

    /// Like [`PluginEngine::load`], from bytes already read, with the chosen compiler.
    ///
    /// # Errors
    /// A [`LoadError`] saying which stage failed.
    pub fn load_bytes(
        &self,
        config: &PluginConfig,
        bytes: &[u8],
        tier: Tier,
    ) -> Result<PluginVersion, LoadError> {
        let compiler = match tier {
            Tier::Optimized => &self.optimized,
            Tier::Background => &self.background,
            Tier::Baseline => &self.baseline,
        };
        let started = Instant::now();
        let version = content_hash(bytes);
        let component = Component::new(&compiler.engine, bytes).map_err(|e| LoadError::Compile {
            path: config.path.clone(),
            reason: one_line(&format!("{e:#}")),
        })?;
        let contract = |e: wasmtime::Error| LoadError::Contract {
            path: config.path.clone(),
            reason: one_line(&format!("{e:#}")),
        };
        let instance_pre = compiler.linker.instantiate_pre(&component).map_err(contract)?;
        let pre = RouterPre::new(instance_pre).map_err(contract)?;
        let config_json = serde_json::to_string(&config.config).unwrap_or_else(|_| "{}".to_string());
        let plugin = PluginVersion {
            name: Arc::from(config.name.as_str()),
            version: Arc::from(version.as_str()),
            path: config.path.clone(),
            pre,
            engine: compiler.engine.clone(),
            tier,
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

/// What `inspect` found out about a component file.
#[derive(Debug, Clone)]
pub struct Inspection {
    /// Content hash.
    pub version: String,
    /// File size in bytes.
    pub size: usize,
    /// Compile time (near zero on a cache hit).
    pub compile_time: Duration,
    /// Export names.
    pub exports: Vec<String>,
    /// Import names (WASI interfaces and `switchyard:plugin/host`).
    pub imports: Vec<String>,
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
    tier: Tier,
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
    fn instantiate(&self) -> Result<Instance, LoadError> {
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

/// Most of a plugin's stderr quoted in `last_error` after a trap.
const STDERR_IN_ERROR: usize = 512;

/// A trap's description with what the plugin wrote to stderr before it (a
/// Rust panic's message, an uncaught exception), on one line.
fn with_stderr(reason: String, stderr: &str) -> String {
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
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn describe_trap(error: &wasmtime::Error, timeout: Duration, max_memory_bytes: usize) -> String {
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

/// The result of the latest load attempt of a plugin file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadResult {
    /// A version went live.
    Loaded {
        /// Its content hash.
        version: String,
    },
    /// The file was refused; the previous version (if any) keeps serving.
    Rejected {
        /// Why.
        reason: String,
    },
    /// The file was deleted; its events wait until a file is back.
    Unloaded,
}

/// A configured plugin and the version currently serving it.
pub struct PluginSlot {
    config: PluginConfig,
    current: RwLock<Option<Arc<PluginVersion>>>,
    last: Mutex<(chrono::DateTime<chrono::Utc>, ReloadResult)>,
    reloads: AtomicU64,
    rejected: AtomicU64,
    /// Hash of the file content last judged, good or bad.
    seen: Mutex<Option<String>>,
}

impl PluginSlot {
    fn new(config: PluginConfig, version: PluginVersion) -> PluginSlot {
        let result = ReloadResult::Loaded {
            version: version.version().to_string(),
        };
        let seen = Mutex::new(Some(version.version().to_string()));
        PluginSlot {
            seen,
            config,
            current: RwLock::new(Some(Arc::new(version))),
            last: Mutex::new((chrono::Utc::now(), result)),
            reloads: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    /// The plugin's config.
    pub fn config(&self) -> &PluginConfig {
        &self.config
    }

    /// The version serving now; `None` while the file is deleted.
    pub fn current(&self) -> Option<Arc<PluginVersion>> {
        match self.current.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn set(&self, version: Option<Arc<PluginVersion>>) {
        match self.current.write() {
            Ok(mut current) => *current = version,
            Err(poisoned) => *poisoned.into_inner() = version,
        }
    }

    /// Swaps in another build of the version serving now, if `hash` is still
    /// the one serving (checked under the write lock, so a newer file that
    /// went live meanwhile is never replaced by an older one).
    fn upgrade(&self, hash: &str, version: PluginVersion) -> bool {
        let mut current = match self.current.write() {
            Ok(current) => current,
            Err(poisoned) => poisoned.into_inner(),
        };
        if current.as_ref().is_some_and(|c| c.version() == hash) {
            *current = Some(Arc::new(version));
            true
        } else {
            false
        }
    }

    fn record(&self, result: ReloadResult) {
        if let Ok(mut last) = self.last.lock() {
            *last = (chrono::Utc::now(), result);
        }
    }

    /// When the latest load attempt happened and how it ended.
    pub fn last_result(&self) -> (chrono::DateTime<chrono::Utc>, ReloadResult) {
        match self.last.lock() {
            Ok(last) => last.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Versions that went live after startup.
    pub fn reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// Files refused since startup.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
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
                    slots.push(PluginSlot::new(config.clone(), version));
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

    /// The plugin called `name`.
    pub fn slot(&self, name: &str) -> Option<&PluginSlot> {
        self.slots.iter().find(|slot| slot.config.name == name)
    }

    /// Index of the first plugin whose filters accept the event.
    pub fn select(&self, aggregate_type: &str, event_type: &str) -> Option<usize> {
        self.slots
            .iter()
            .position(|slot| slot.config.matches(aggregate_type, event_type))
    }

    /// Re-reads the file of every plugin whose path is in `changed` and makes
    /// a good new version live. A file that fails any stage (read, compile,
    /// type check, init) is refused and the serving version stays. A missing
    /// file unloads the plugin: its events wait, no attempt is spent.
    pub fn reload_paths(&self, changed: &[PathBuf]) {
        for slot in self.slots.iter() {
            if changed.iter().any(|path| same_file_path(path, &slot.config.path)) {
                self.reload(slot);
            }
        }
    }

    fn reload(&self, slot: &PluginSlot) {
        let name = &slot.config.name;
        let bytes = match std::fs::read(&slot.config.path) {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                if let Ok(mut seen) = slot.seen.lock() {
                    *seen = None;
                }
                if slot.current().is_some() {
                    slot.set(None);
                    slot.record(ReloadResult::Unloaded);
                    tracing::warn!(plugin.name = %name, path = %slot.config.path.display(), "Plugin file deleted; its events wait until it returns.");
                }
                return;
            }
            Err(error) => {
                self.reject(
                    slot,
                    format!("cannot read {}: {error}", slot.config.path.display()),
                );
                return;
            }
        };
        let hash = content_hash(&bytes);
        if slot
            .seen
            .lock()
            .is_ok_and(|seen| seen.as_deref() == Some(hash.as_str()))
        {
            // Watchers report one write several times; judge each content once.
            return;
        }
        if let Ok(mut seen) = slot.seen.lock() {
            *seen = Some(hash.clone());
        }
        // Go live on the baseline compiler at once, then swap in the optimised
        // build of the same file when it is ready: same bytes, same behaviour.
        match self.engine.load_bytes(&slot.config, &bytes, Tier::Baseline) {
            Ok(version) => {
                tracing::info!(
                    plugin.name = %name,
                    plugin.version = %hash,
                    compile_ms = version.compile_time().as_millis() as u64,
                    "Plugin reloaded."
                );
                slot.set(Some(Arc::new(version)));
                slot.reloads.fetch_add(1, Ordering::Relaxed);
                slot.record(ReloadResult::Loaded {
                    version: hash.clone(),
                });
                self.optimize_later(&slot.config.name, bytes, hash);
            }
            Err(error) => self.reject(slot, error.to_string()),
        }
    }

    fn optimize_later(&self, name: &str, bytes: Vec<u8>, hash: String) {
        let plugins = self.clone();
        let name = name.to_string();
        let spawned = std::thread::Builder::new()
            .name("switchyard-optimize".into())
            .spawn(move || {
                // Deploys often write several versions in a row; only the one
                // still serving after a quiet second is worth optimising.
                std::thread::sleep(OPTIMIZE_AFTER);
                let Some(slot) = plugins.slot(&name) else { return };
                if slot.current().is_none_or(|current| current.version() != hash) {
                    return;
                }
                let Ok(version) = plugins.engine.load_bytes(&slot.config, &bytes, Tier::Background) else {
                    return;
                };
                if slot.upgrade(&hash, version) {
                    tracing::debug!(plugin.name = %name, plugin.version = %hash, "Optimised build live.");
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "Cannot start the optimising compile; the baseline build keeps serving.");
        }
    }

    fn reject(&self, slot: &PluginSlot, reason: String) {
        tracing::warn!(plugin.name = %slot.config.name, %reason, "Plugin file refused; the previous version keeps serving.");
        slot.rejected.fetch_add(1, Ordering::Relaxed);
        slot.record(ReloadResult::Rejected { reason });
    }
}

fn same_file_path(a: &Path, b: &Path) -> bool {
    if a == b {
        return true;
    }
    // Watchers report absolute paths; configs may hold relative ones.
    let canonical_dir = |p: &Path| {
        let dir = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::canonicalize(dir)
            .ok()
            .map(|d| (d, p.file_name().map(ToOwned::to_owned)))
    };
    matches!((canonical_dir(a), canonical_dir(b)), (Some(x), Some(y)) if x == y)
}
