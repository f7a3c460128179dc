//! The configured plugins, in match order, and the version serving each:
//! what the relay selects from, what `status` and the metrics report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::engine::PluginEngine;
use super::error::LoadError;
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
}
