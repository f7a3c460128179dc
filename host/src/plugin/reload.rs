//! Hot reload: a changed file is read, judged once per content, compiled on
//! the baseline tier to go live at once, then swapped for the optimised
//! build of the same bytes after a quiet second. A bad file never replaces
//! a good version; a deleted one unloads the plugin.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::engine::{Tier, content_hash};
use super::oci::{OciCache, Pulled};
use super::registry::{PluginSlot, Plugins, ReloadResult};

/// Quiet time after a reload before the optimising compile starts.
const OPTIMIZE_AFTER: Duration = Duration::from_secs(1);

impl Plugins {
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
        self.judge(slot, bytes);
    }

    /// Offers a component pulled from the registry to the plugin `name`:
    /// judged as a changed file is. Returns whether it is the one serving
    /// now; records its digest if so.
    pub fn offer_pulled(&self, name: &str, pulled: &Pulled, cache: &OciCache) -> bool {
        let Some(slot) = self.slot(name) else { return false };
        let live = self.judge(slot, pulled.bytes.clone()) != Some(false)
            && slot
                .current()
                .is_some_and(|current| current.version() == content_hash(&pulled.bytes));
        if live {
            let reference = slot.oci().map(|state| state.reference).unwrap_or_default();
            if let Err(error) = cache.record(&reference, pulled) {
                tracing::warn!(plugin.name = %name, %error, "Cannot record the pulled digest in the cache.");
            }
            slot.update_oci(|state| {
                state.digest = Some(pulled.manifest_digest.clone());
                state.component = Some(pulled.path.clone());
                state.from_cache = false;
            });
        }
        live
    }

    /// Makes `bytes` the plugin's version if they compile, type-check and
    /// initialise: `Some(true)` when they went live, `Some(false)` when
    /// refused, `None` when this content was judged already.
    fn judge(&self, slot: &PluginSlot, bytes: Vec<u8>) -> Option<bool> {
        let name = &slot.config.name;
        let hash = content_hash(&bytes);
        if slot
            .seen
            .lock()
            .is_ok_and(|seen| seen.as_deref() == Some(hash.as_str()))
        {
            // Watchers report one write several times; judge each content once.
            return None;
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
                Some(true)
            }
            Err(error) => {
                self.reject(slot, error.to_string());
                Some(false)
            }
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

    pub(super) fn reject(&self, slot: &PluginSlot, reason: String) {
        tracing::warn!(plugin.name = %slot.config.name, %reason, "Plugin refused; the previous version keeps serving.");
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
