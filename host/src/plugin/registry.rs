//! The configured plugins, in match order, and the version serving each:
//! what the relay selects from, what `status` and the metrics report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::engine::PluginEngine;
use super::error::LoadError;
use super::oci::{OciCache, Pulled};
use super::version::PluginVersion;
use crate::config::PluginConfig;

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
    pub(super) config: PluginConfig,
    pub(super) current: RwLock<Option<Arc<PluginVersion>>>,
    pub(super) last: Mutex<(chrono::DateTime<chrono::Utc>, ReloadResult)>,
    pub(super) reloads: AtomicU64,
    pub(super) rejected: AtomicU64,
    /// Hash of the file content last judged, good or bad.
    pub(super) seen: Mutex<Option<String>>,
    /// For a plugin from a registry: its reference, the digest serving and
    /// how the registry answered last.
    pub(super) oci: Option<Mutex<OciState>>,
}

/// A registry plugin's reference, the digest serving it, and how its
/// registry answered last: what `/status`, the metrics and the console show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OciState {
    /// `oci://...`, as configured.
    pub reference: String,
    /// The manifest digest of the version serving; `None` before the first pull.
    pub digest: Option<String>,
    /// Whether the serving version came from the cache because the registry
    /// could not be reached at start.
    pub from_cache: bool,
    /// The registry's last error; `None` when its last answer was good.
    pub registry_error: Option<String>,
    /// When the registry was last asked.
    pub checked_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Components pulled since start (a component found in the cache by
    /// its digest counts, as a cache hit too).
    pub pulls: u64,
    /// Pulls whose component was in the cache already.
    pub cache_hits: u64,
    /// How long the latest pull took.
    pub last_pull_ms: Option<u64>,
    /// Where the serving component is kept in the cache.
    pub component: Option<std::path::PathBuf>,
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
            oci: None,
        }
    }

    /// A registry plugin that has nothing to serve yet: never pulled, and the
    /// registry could not give it. Its events wait; the relay is not ready.
    fn waiting(config: PluginConfig, reason: String) -> PluginSlot {
        PluginSlot {
            seen: Mutex::new(None),
            config,
            current: RwLock::new(None),
            last: Mutex::new((chrono::Utc::now(), ReloadResult::Rejected { reason })),
            reloads: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            oci: None,
        }
    }

    /// A registry plugin's reference, digest and registry state.
    pub fn oci(&self) -> Option<OciState> {
        self.oci.as_ref().map(|state| match state.lock() {
            Ok(state) => state.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        })
    }

    pub(super) fn update_oci(&self, change: impl FnOnce(&mut OciState)) {
        if let Some(state) = &self.oci {
            match state.lock() {
                Ok(mut state) => change(&mut state),
                Err(poisoned) => change(&mut poisoned.into_inner()),
            }
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

    pub(super) fn set(&self, version: Option<Arc<PluginVersion>>) {
        match self.current.write() {
            Ok(mut current) => *current = version,
            Err(poisoned) => *poisoned.into_inner() = version,
        }
    }

    /// Swaps in another build of the version serving now, if `hash` is still
    /// the one serving (checked under the write lock, so a newer file that
    /// went live meanwhile is never replaced by an older one).
    pub(super) fn upgrade(&self, hash: &str, version: PluginVersion) -> bool {
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

    pub(super) fn record(&self, result: ReloadResult) {
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
    pub(super) engine: PluginEngine,
    pub(super) slots: Arc<Vec<PluginSlot>>,
}

impl Plugins {
    /// Loads every configured plugin; all must load.
    ///
    /// # Errors
    /// Every load error, one per failing plugin.
    pub fn load(engine: PluginEngine, configs: &[PluginConfig]) -> Result<Plugins, Vec<LoadError>> {
        let none: Vec<Option<Fetched>> = configs.iter().map(|_| None).collect();
        Plugins::load_fetched(engine, configs, none)
    }

    /// Like [`Plugins::load`], with what was fetched for each registry
    /// plugin (`None` for a file). A registry plugin whose pull gave a
    /// component that does not load falls back to its last good digest.
    ///
    /// # Errors
    /// Every load error, one per failing plugin.
    pub fn load_fetched(
        engine: PluginEngine,
        configs: &[PluginConfig],
        fetched: Vec<Option<Fetched>>,
    ) -> Result<Plugins, Vec<LoadError>> {
        let mut slots = Vec::new();
        let mut errors = Vec::new();
        for (config, fetched) in configs.iter().zip(fetched) {
            let loaded = match fetched {
                None => engine
                    .load(config)
                    .map(|version| PluginSlot::new(config.clone(), version)),
                Some(fetched) => Ok(fetched.into_slot(&engine, config)),
            };
            match loaded {
                Ok(slot) => {
                    if let Some(version) = slot.current() {
                        tracing::info!(
                            plugin.name = %config.name,
                            plugin.version = version.version(),
                            compile_ms = version.compile_time().as_millis() as u64,
                            "Plugin loaded."
                        );
                    }
                    slots.push(slot);
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
}

/// What a registry plugin's start found: a pull, the cache's last good
/// digest (the registry down), or nothing to serve.
#[derive(Debug)]
pub struct Fetched {
    /// `oci://...`, as configured.
    pub reference: String,
    /// The cache to record a version that went live in.
    pub cache: OciCache,
    /// The component pulled now, if the registry answered.
    pub pulled: Option<Pulled>,
    /// The last good digest's component, from the cache.
    pub last_good: Option<Pulled>,
    /// Why the registry could not give a component, if it could not.
    pub error: Option<String>,
}

impl Fetched {
    fn into_slot(self, engine: &PluginEngine, config: &PluginConfig) -> PluginSlot {
        let name = &config.name;
        let mut refused = None;
        let mut chosen = None;
        for (candidate, from_cache) in [(self.pulled, false), (self.last_good, true)] {
            let Some(candidate) = candidate else { continue };
            if chosen.is_some() {
                break;
            }
            match engine.load_bytes(config, &candidate.bytes, super::engine::Tier::Optimized) {
                Ok(version) => chosen = Some((candidate, version, from_cache)),
                Err(error) => {
                    tracing::warn!(plugin.name = %name, plugin.digest = %candidate.manifest_digest, %error, "Pulled plugin refused.");
                    refused = Some(error.to_string());
                }
            }
        }
        let now = chrono::Utc::now();
        let registry_error = self.error.clone();
        let Some((pulled, version, from_cache)) = chosen else {
            let reason = refused
                .or(self.error)
                .unwrap_or_else(|| "nothing pulled".to_string());
            tracing::warn!(plugin.name = %name, reference = %self.reference, %reason, "Plugin has never been pulled; its events wait and the relay is not ready until it is.");
            let mut slot = PluginSlot::waiting(config.clone(), reason);
            slot.oci = Some(Mutex::new(OciState {
                reference: self.reference,
                digest: None,
                from_cache: false,
                registry_error,
                checked_at: Some(now),
                pulls: 0,
                cache_hits: 0,
                last_pull_ms: None,
                component: None,
            }));
            return slot;
        };
        if from_cache {
            tracing::warn!(
                plugin.name = %name,
                reference = %self.reference,
                plugin.digest = %pulled.manifest_digest,
                reason = registry_error.as_deref().unwrap_or("the pulled component was refused"),
                "Serving the last good digest from the cache."
            );
        } else {
            tracing::info!(
                plugin.name = %name,
                reference = %self.reference,
                plugin.digest = %pulled.manifest_digest,
                pull_ms = pulled.elapsed.as_millis() as u64,
                cache_hit = pulled.cache_hit,
                "Plugin pulled."
            );
            if let Err(error) = self.cache.record(&self.reference, &pulled) {
                tracing::warn!(plugin.name = %name, %error, "Cannot record the pulled digest in the cache; a start while the registry is down would not find it.");
            }
        }
        let mut slot = PluginSlot::new(config.clone(), version);
        if let Some(reason) = refused {
            slot.record(ReloadResult::Rejected { reason });
            slot.rejected.fetch_add(1, Ordering::Relaxed);
        }
        slot.oci = Some(Mutex::new(OciState {
            reference: self.reference,
            component: Some(pulled.path.clone()),
            digest: Some(pulled.manifest_digest),
            from_cache,
            registry_error,
            checked_at: Some(now),
            pulls: u64::from(!from_cache),
            cache_hits: u64::from(!from_cache && pulled.cache_hit),
            last_pull_ms: (!from_cache).then_some(pulled.elapsed.as_millis() as u64),
        }));
        slot
    }
}
