//! Plugins from an OCI registry: pulling a component by tag or digest
//! (the Wasm OCI artifact layout, an `application/wasm` layer), verifying
//! what arrives against its digest, and keeping each pulled component in
//! the cache directory under its digest with the last good digest of each
//! reference, so that a relay started while the registry is down serves
//! what it served before. Also the push `switchyard plugin push` makes.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::registry::{Fetched, PluginSlot, Plugins};
use crate::config::PluginConfig;

// The registry client (oci-client) is a default feature; the demo's build
// refuses registry plugins, naming it.
#[cfg(feature = "oci")]
mod client;
#[cfg(not(feature = "oci"))]
mod unbuilt;
#[cfg(feature = "oci")]
pub use client::OciSource;
#[cfg(not(feature = "oci"))]
pub use unbuilt::OciSource;

/// The media type of a component layer (the CNCF Wasm OCI artifact layout,
/// what `wkg oci push` writes).
pub const WASM_LAYER: &str = "application/wasm";
/// The config blob's media type in that layout.
pub const WASM_CONFIG: &str = "application/vnd.wasm.config.v0+json";
/// The largest component pulled: a Python or JavaScript plugin is 12 to 18
/// MB; a layer that claims more is refused before it is downloaded, so a
/// wrong tag cannot fill the relay's memory.
pub const MAX_COMPONENT_BYTES: i64 = 256 * 1024 * 1024;

/// What went wrong with a registry; every message names the reference and
/// never a credential.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The reference does not parse.
    #[error("{reference}: not a registry reference: {reason}")]
    Reference {
        /// As configured.
        reference: String,
        /// Why.
        reason: String,
    },
    /// The credentials could not be read (a file, a command, a config.json).
    #[error("{reference}: cannot read the registry credentials: {reason}")]
    Credentials {
        /// As configured.
        reference: String,
        /// Why.
        reason: String,
    },
    /// The registry refused the credentials.
    #[error("{reference}: the registry refused the credentials ({how}); check [plugins.registry]")]
    Unauthorized {
        /// As configured.
        reference: String,
        /// Which kind of credentials were sent.
        how: &'static str,
    },
    /// A blob or manifest did not hash to its digest.
    #[error(
        "{reference}: refused a blob whose content does not match its digest: expected {expected}, got {actual}"
    )]
    Digest {
        /// As configured.
        reference: String,
        /// The digest the manifest named.
        expected: String,
        /// The digest of what arrived.
        actual: String,
    },
    /// The artifact holds no component layer.
    #[error(
        "{reference}: the artifact has no {WASM_LAYER} layer (layers: {layers}); push it with `switchyard plugin push` or `wkg oci push`"
    )]
    NotAComponent {
        /// As configured.
        reference: String,
        /// The media types found.
        layers: String,
    },
    /// The component layer is larger than any plugin should be.
    #[error(
        "{reference}: the component layer is {size} bytes, more than the {MAX_COMPONENT_BYTES} a plugin may be"
    )]
    TooLarge {
        /// As configured.
        reference: String,
        /// The size the manifest gives.
        size: i64,
    },
    /// The registry did not answer in time.
    #[error("{reference}: the registry did not answer within {ms} ms")]
    Timeout {
        /// As configured.
        reference: String,
        /// The bound.
        ms: u64,
    },
    /// Any other registry or network failure.
    #[error("{reference}: {reason}")]
    Registry {
        /// As configured.
        reference: String,
        /// The client's message.
        reason: String,
    },
    /// This build has no registry client.
    #[error("{reference}: {}", crate::features::built_without("registry plugins", "oci"))]
    Unbuilt {
        /// As configured.
        reference: String,
    },
    /// The cache directory could not be written.
    #[error("{reference}: cannot write the plugin cache {}: {source}", path.display())]
    Cache {
        /// As configured.
        reference: String,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl OciError {
    /// Whether the registry answered and what it served is refused (a blob
    /// that does not match its digest, no component layer, too large): the
    /// same digest would be refused again, so it is not pulled again until
    /// the reference moves.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            OciError::Digest { .. } | OciError::NotAComponent { .. } | OciError::TooLarge { .. }
        )
    }
}

/// A component pulled (or found in the cache by its digest).
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The manifest's digest: what a tag points at.
    pub manifest_digest: String,
    /// The component layer's digest.
    pub layer_digest: String,
    /// The component, as stored in the cache.
    pub path: PathBuf,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Whether the component's bytes came from the cache (only the manifest
    /// was asked for).
    pub cache_hit: bool,
    /// How long the pull took.
    pub elapsed: Duration,
}

/// The last digest of a reference that went live, kept in the cache.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LastGood {
    /// The reference, as configured.
    pub reference: String,
    /// Its manifest digest then.
    pub manifest_digest: String,
    /// Its component layer's digest.
    pub layer_digest: String,
    /// When it was pulled (RFC 3339).
    pub pulled_at: String,
}

/// The cache of pulled components: `oci/blobs/sha256/HEX.wasm` under the
/// plugin cache directory, and `oci/refs/HASH.json` recording the last good
/// digest of each reference.
#[derive(Debug, Clone)]
pub struct OciCache {
    dir: PathBuf,
}

impl OciCache {
    /// The cache under `cache_dir`.
    pub fn new(cache_dir: &Path) -> OciCache {
        OciCache {
            dir: cache_dir.join("oci"),
        }
    }

    /// Where a component with this layer digest is kept.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let (algorithm, hex) = digest.split_once(':').unwrap_or(("sha256", digest));
        self.dir.join("blobs").join(algorithm).join(format!("{hex}.wasm"))
    }

    /// The component with this digest, if the cache holds it intact (a file
    /// that no longer hashes to its name is removed, and pulled again).
    pub fn read_blob(&self, digest: &str) -> Option<Vec<u8>> {
        let path = self.blob_path(digest);
        let bytes = std::fs::read(&path).ok()?;
        if sha256_digest(&bytes) == digest {
            Some(bytes)
        } else {
            tracing::warn!(path = %path.display(), "Cached plugin does not match its digest; removed, to be pulled again.");
            let _ = std::fs::remove_file(&path);
            None
        }
    }

    #[cfg(any(feature = "oci", test))]
    fn write_blob(&self, digest: &str, bytes: &[u8]) -> std::io::Result<PathBuf> {
        let path = self.blob_path(digest);
        write_atomically(&path, bytes)?;
        Ok(path)
    }

    fn ref_path(&self, reference: &str) -> PathBuf {
        let name = format!("{:x}", Sha256::digest(reference.as_bytes()));
        self.dir.join("refs").join(format!("{}.json", &name[..32]))
    }

    /// The last digest of `reference` that went live, if its component is
    /// still in the cache.
    pub fn last_good(&self, reference: &str) -> Option<(LastGood, Vec<u8>)> {
        let text = std::fs::read(self.ref_path(reference)).ok()?;
        let last: LastGood = serde_json::from_slice(&text).ok()?;
        if last.reference != reference {
            return None;
        }
        let bytes = self.read_blob(&last.layer_digest)?;
        Some((last, bytes))
    }

    /// Records a digest of `reference` that went live.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn record(&self, reference: &str, pulled: &Pulled) -> std::io::Result<()> {
        let last = LastGood {
            reference: reference.to_string(),
            manifest_digest: pulled.manifest_digest.clone(),
            layer_digest: pulled.layer_digest.clone(),
            pulled_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        };
        let body = serde_json::to_vec_pretty(&last).map_err(std::io::Error::other)?;
        write_atomically(&self.ref_path(reference), &body)
    }
}

fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// A reader sees the old file or the new one, never half of one.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("blob"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// For each plugin (in order), what its start has to serve: `None` for a
/// file, else the pull (all registry plugins at once), the cache's last
/// good digest, and the registry's error.
pub async fn fetch_all(configs: &[PluginConfig], cache_dir: Option<&Path>) -> Vec<Option<Fetched>> {
    let fetches = configs.iter().map(|config| async move {
        let reference = config.oci_reference()?;
        let display = format!("{}{reference}", crate::config::registry::OCI_SCHEME);
        let Some(cache_dir) = cache_dir else {
            return Some(Fetched {
                reference: display,
                cache: OciCache::new(Path::new(".")),
                pulled: None,
                last_good: None,
                error: Some("no plugin cache directory (plugin_runtime.cache is off)".into()),
            });
        };
        let cache = OciCache::new(cache_dir);
        let (pulled, error) = match OciSource::new(reference, &config.registry) {
            Ok(source) => match source.pull(&cache).await {
                Ok(pulled) => (Some(pulled), None),
                Err(error) => (None, Some(error.to_string())),
            },
            Err(error) => (None, Some(error.to_string())),
        };
        let last_good = {
            let (cache, display) = (cache.clone(), display.clone());
            tokio::task::spawn_blocking(move || cache.last_good(&display))
                .await
                .ok()
                .flatten()
        };
        let last_good = last_good
            .filter(|(last, _)| {
                pulled
                    .as_ref()
                    .is_none_or(|p| p.manifest_digest != last.manifest_digest)
            })
            .map(|(last, bytes)| Pulled {
                manifest_digest: last.manifest_digest,
                path: cache.blob_path(&last.layer_digest),
                layer_digest: last.layer_digest,
                bytes,
                cache_hit: true,
                elapsed: Duration::ZERO,
            });
        Some(Fetched {
            reference: display,
            cache,
            pulled,
            last_good,
            error,
        })
    });
    futures::future::join_all(fetches).await
}

/// The registry plugins' tag checks; dropping it stops them.
pub struct Follower {
    _tasks: tokio::task::JoinSet<()>,
}

/// Starts checking each registry plugin for a new digest: a tag every
/// `refresh_seconds`, a plugin that has nothing to serve yet sooner, a
/// digest reference only until it has been pulled once.
pub fn follow(plugins: &Plugins, cache: &OciCache) -> Follower {
    let mut tasks = tokio::task::JoinSet::new();
    for slot in plugins.slots() {
        let Some(reference) = slot.config().oci_reference() else {
            continue;
        };
        let Ok(source) = OciSource::new(reference, &slot.config().registry) else {
            continue;
        };
        if source.pinned() && slot.current().is_some() {
            continue;
        }
        tasks.spawn(follow_one(
            plugins.clone(),
            slot.config().name.clone(),
            source,
            cache.clone(),
        ));
    }
    Follower { _tasks: tasks }
}

/// Quickest retry of a plugin that has nothing to serve.
const WAITING_RETRY: Duration = Duration::from_secs(2);

async fn follow_one(plugins: Plugins, name: String, source: OciSource, cache: OciCache) {
    // A digest that was refused is not pulled again until the tag moves.
    let mut refused: Option<String> = None;
    loop {
        let Some(slot) = plugins.slot(&name) else { return };
        let waiting = slot.current().is_none();
        let delay = if waiting {
            source.refresh().min(WAITING_RETRY)
        } else {
            source.refresh()
        };
        tokio::time::sleep(delay).await;
        let serving = slot.oci().and_then(|state| state.digest);
        let digest = match source.head().await {
            Ok(digest) => {
                registry_answered(slot, &name, &source, None);
                digest
            }
            Err(error) => {
                registry_answered(slot, &name, &source, Some(error.to_string()));
                continue;
            }
        };
        if serving.as_deref() == Some(digest.as_str()) || refused.as_deref() == Some(digest.as_str()) {
            continue;
        }
        let pulled = match source.pull(&cache).await {
            Ok(pulled) => pulled,
            Err(error) if error.is_refusal() => {
                // The registry answered; what it served is refused. Pulling
                // it again at every check would download the same bytes
                // for the same answer.
                plugins.reject(slot, error.to_string());
                refused = Some(digest);
                continue;
            }
            Err(error) => {
                registry_answered(slot, &name, &source, Some(error.to_string()));
                continue;
            }
        };
        let moved = Instant::now();
        let (manifest_digest, pull_ms, cache_hit) = (
            pulled.manifest_digest.clone(),
            pulled.elapsed.as_millis() as u64,
            pulled.cache_hit,
        );
        slot.update_oci(|state| {
            state.pulls += 1;
            state.cache_hits += u64::from(cache_hit);
            state.last_pull_ms = Some(pull_ms);
        });
        let offer = {
            let (plugins, name, cache) = (plugins.clone(), name.clone(), cache.clone());
            // Compiling and `init` block: off the runtime.
            tokio::task::spawn_blocking(move || plugins.offer_pulled(&name, &pulled, &cache))
        };
        if offer.await.unwrap_or(false) {
            refused = None;
            tracing::info!(
                plugin.name = %name,
                reference = %source.display(),
                plugin.digest = %manifest_digest,
                previous = serving.as_deref().unwrap_or("none"),
                pull_ms,
                cache_hit,
                swap_ms = moved.elapsed().as_millis() as u64,
                "Plugin swapped to the digest its reference points at now."
            );
            if source.pinned() {
                return;
            }
        } else {
            tracing::warn!(
                plugin.name = %name,
                reference = %source.display(),
                plugin.digest = %manifest_digest,
                "The digest the reference points at was refused; the serving version stays until the reference moves again."
            );
            refused = Some(manifest_digest);
        }
    }
}

/// Notes how the registry answered; says so in the log when that changes.
fn registry_answered(slot: &PluginSlot, name: &str, source: &OciSource, error: Option<String>) {
    let before = slot.oci().and_then(|state| state.registry_error);
    if before != error {
        match &error {
            Some(error) => tracing::warn!(
                plugin.name = %name,
                reference = %source.display(),
                %error,
                "Registry unreachable; the plugin keeps serving its current digest."
            ),
            None => {
                tracing::info!(plugin.name = %name, reference = %source.display(), "Registry reachable again.")
            }
        }
    }
    slot.update_oci(|state| {
        state.registry_error = error;
        state.checked_at = Some(chrono::Utc::now());
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_keeps_blobs_under_their_digest_and_drops_tampered_ones() {
        let dir = std::env::temp_dir().join(format!("sy-oci-cache-{}", uuid::Uuid::new_v4().simple()));
        let cache = OciCache::new(&dir);
        let bytes = b"\0asm component".to_vec();
        let digest = sha256_digest(&bytes);
        let path = cache.write_blob(&digest, &bytes).unwrap();
        assert_eq!(cache.read_blob(&digest).as_deref(), Some(bytes.as_slice()));
        let pulled = Pulled {
            manifest_digest: "sha256:m".into(),
            layer_digest: digest.clone(),
            path: path.clone(),
            bytes: bytes.clone(),
            cache_hit: false,
            elapsed: Duration::ZERO,
        };
        cache.record("localhost:5000/team/router:1", &pulled).unwrap();
        let (last, cached) = cache.last_good("localhost:5000/team/router:1").unwrap();
        assert_eq!((last.manifest_digest.as_str(), cached), ("sha256:m", bytes));
        assert!(cache.last_good("localhost:5000/team/router:2").is_none());
        std::fs::write(&path, b"tampered").unwrap();
        assert!(cache.read_blob(&digest).is_none());
        assert!(!path.exists(), "a tampered blob is removed");
        assert!(cache.last_good("localhost:5000/team/router:1").is_none());
        let _ = std::fs::remove_dir_all(dir);
    }
}
