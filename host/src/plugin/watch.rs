//! Hot reload: watches the directories holding plugin files (debounced, so a
//! file written in several steps is read once it is quiet) and hands changed
//! paths to [`Plugins::reload_paths`], which only swaps in versions that
//! compiled, type-checked and initialised. It also keeps the registry
//! plugins' tag checks ([`super::oci::follow`]) alive.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use notify::RecursiveMode;
use notify_debouncer_full::{DebounceEventResult, Debouncer, RecommendedCache, new_debouncer};

use super::Plugins;
use super::oci::Follower;

/// Keeps the watcher (and the registry plugins' tag checks) alive;
/// dropping it stops both.
pub struct PluginWatcher {
    _debouncer: Option<Debouncer<notify::RecommendedWatcher, RecommendedCache>>,
    _follower: Option<Follower>,
}

impl PluginWatcher {
    /// The directory watcher, if any, with the registry tag checks, if any.
    pub fn with_follower(
        watcher: Option<PluginWatcher>,
        follower: Option<Follower>,
    ) -> Option<PluginWatcher> {
        match (watcher, follower) {
            (None, None) => None,
            (Some(watcher), None) => Some(watcher),
            (watcher, follower) => Some(PluginWatcher {
                _debouncer: watcher.and_then(|w| w._debouncer),
                _follower: follower,
            }),
        }
    }
}

/// Starts watching every directory that holds a configured plugin file.
///
/// # Errors
/// When the OS watcher cannot be created or a directory cannot be watched.
pub fn watch(plugins: Plugins, debounce: Duration) -> notify::Result<PluginWatcher> {
    let handler_plugins = plugins.clone();
    let mut debouncer = new_debouncer(debounce, None, move |result: DebounceEventResult| match result {
        Ok(events) => {
            let changed: Vec<PathBuf> = events
                .iter()
                .flat_map(|event| event.paths.iter().cloned())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            if !changed.is_empty() {
                handler_plugins.reload_paths(&changed);
            }
        }
        Err(errors) => {
            for error in errors {
                tracing::warn!(%error, "Plugin directory watch error.");
            }
        }
    })?;
    let dirs: BTreeSet<PathBuf> = plugins
        .slots()
        .iter()
        // A registry plugin is followed by its tag, not by a file.
        .filter(|slot| slot.config().oci_reference().is_none())
        .filter_map(|slot| slot.config().path.parent().map(PathBuf::from))
        .map(|dir| {
            if dir.as_os_str().is_empty() {
                PathBuf::from(".")
            } else {
                dir
            }
        })
        .collect();
    for dir in &dirs {
        debouncer.watch(dir, RecursiveMode::NonRecursive)?;
        tracing::info!(dir = %dir.display(), "Watching plugin directory.");
    }
    Ok(PluginWatcher {
        _debouncer: Some(debouncer),
        _follower: None,
    })
}
