//! Engines and compilation: an optimising engine for steady state, a
//! baseline one so a hot reload goes live fast, a single-threaded one for
//! the upgrade after a reload; the on-disk cache of compiled components.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::{Component, HasSelf, Linker};

use super::bindings::{BatchRouterPre, Router, RouterPre};
use super::error::{LoadError, one_line};
use super::host::State;
use super::version::{PluginVersion, Pre};
use crate::config::PluginConfig;

/// How often the engine's epoch advances; the unit of plugin time limits.
pub(super) const EPOCH_TICK: Duration = Duration::from_millis(5);

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
                // A directory of its own: wasmtime's cleanup removes what it
                // does not know, and the pulled plugins live beside it.
                cache_config.with_directory(dir.join("compiled"));
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

    /// Compiles and type-checks a file against the plugin worlds without
    /// running it: what `switchyard plugin check` reports.
    ///
    /// # Errors
    /// A [`LoadError`] saying which stage failed.
    pub fn inspect(&self, path: &Path) -> Result<Inspection, LoadError> {
        let bytes = read(path)?;
        let started = Instant::now();
        let (component, pre) = compile(&self.optimized, path, &bytes)?;
        let engine = &self.optimized.engine;
        let component_type = component.component_type();
        Ok(Inspection {
            version: content_hash(&bytes),
            size: bytes.len(),
            compile_time: started.elapsed(),
            batched: matches!(pre, Pre::Batch(_)),
            exports: component_type
                .exports(engine)
                .map(|(name, _)| name.to_string())
                .collect(),
            imports: component_type
                .imports(engine)
                .map(|(name, _)| name.to_string())
                .collect(),
        })
    }

    /// Compiles, links and initialises one plugin version from its file.
    ///
    /// # Errors
    /// A [`LoadError`] saying which stage failed.
    pub fn load(&self, config: &PluginConfig) -> Result<PluginVersion, LoadError> {
        let bytes = read(&config.path)?;
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
        let (_, pre) = compile(compiler, &config.path, bytes)?;
        let plugin = PluginVersion {
            name: Arc::from(config.name.as_str()),
            version: Arc::from(content_hash(bytes).as_str()),
            path: config.path.clone(),
            pre,
            engine: compiler.engine.clone(),
            tier,
            config_json: serde_json::to_string(&config.config).unwrap_or_else(|_| "{}".to_string()),
            timeout: Duration::from_millis(config.timeout_ms),
            max_memory_bytes: config.max_memory_bytes,
            idle: Mutex::new(Vec::new()),
            compile_time: started.elapsed(),
        };
        // A version goes live only after one instance passed init.
        let instance = plugin.instantiate()?;
        plugin.put_back(instance);
        tracing::debug!(
            plugin.name = %config.name,
            plugin.version = %plugin.version,
            compile_ms = plugin.compile_time.as_millis() as u64,
            "Plugin compiled and its init passed."
        );
        Ok(plugin)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Compiles `bytes` and checks them against the world their exports name
/// (`route-batch`: batch-router, otherwise router): the steps `inspect` and
/// `load` share.
fn compile(compiler: &Compiler, path: &Path, bytes: &[u8]) -> Result<(Component, Pre), LoadError> {
    let component = Component::new(&compiler.engine, bytes).map_err(|e| LoadError::Compile {
        path: path.to_path_buf(),
        reason: one_line(&format!("{e:#}")),
    })?;
    let contract = |e: wasmtime::Error| LoadError::Contract {
        path: path.to_path_buf(),
        reason: one_line(&format!("{e:#}")),
    };
    let instance_pre = compiler.linker.instantiate_pre(&component).map_err(contract)?;
    let batched = component
        .component_type()
        .exports(&compiler.engine)
        .any(|(name, _)| name == "route-batch");
    let pre = if batched {
        Pre::Batch(BatchRouterPre::new(instance_pre).map_err(contract)?)
    } else {
        Pre::Single(RouterPre::new(instance_pre).map_err(contract)?)
    };
    Ok((component, pre))
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
    /// Whether it exports `route-batch` (the batch-router world).
    pub batched: bool,
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
