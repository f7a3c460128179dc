//! A registry plugin's source: the registry client's requests (the
//! manifest's digest, a pull into the cache, a push) with the configured
//! credentials, TLS and time bound.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol, ImageLayer};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::OciImageManifest;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde::{Deserialize, Serialize};

use super::{MAX_COMPONENT_BYTES, OciCache, OciError, Pulled, WASM_CONFIG, WASM_LAYER};
use crate::config::RegistryConfig;
use crate::config::registry::is_loopback;

/// Layer types read as a component too: the older `wasm-to-oci` layout.
const OTHER_WASM_LAYERS: [&str; 1] = [oci_client::manifest::WASM_LAYER_MEDIA_TYPE];

/// A plugin's registry reference and how to reach the registry.
#[derive(Debug, Clone)]
pub struct OciSource {
    reference: Reference,
    text: String,
    settings: RegistryConfig,
}

impl OciSource {
    /// `reference` is the path without `oci://`.
    ///
    /// # Errors
    /// When it does not parse.
    pub fn new(reference: &str, settings: &RegistryConfig) -> Result<OciSource, OciError> {
        let parsed = reference
            .parse::<Reference>()
            .map_err(|error| OciError::Reference {
                reference: reference.to_string(),
                reason: error.to_string(),
            })?;
        Ok(OciSource {
            reference: parsed,
            text: reference.to_string(),
            settings: settings.clone(),
        })
    }

    /// The reference as configured, with `oci://`.
    pub fn display(&self) -> String {
        format!("oci://{}", self.text)
    }

    /// Whether it names a digest (never checked again) rather than a tag.
    pub fn pinned(&self) -> bool {
        self.reference.digest().is_some()
    }

    /// How often a tag is checked.
    pub fn refresh(&self) -> Duration {
        Duration::from_secs(self.settings.refresh_seconds.max(1))
    }

    fn client(&self) -> Result<Client, OciError> {
        // The HTTP client takes the process's provider, and panics without
        // one (an embedder may not have installed it).
        crate::tls::install_provider();
        let mut extra_root_certificates = Vec::new();
        if let Some(ca) = &self.settings.ca_file {
            let data = std::fs::read(ca).map_err(|error| OciError::Credentials {
                reference: self.display(),
                reason: format!("registry.ca_file {}: {error}", ca.display()),
            })?;
            extra_root_certificates.push(Certificate {
                encoding: CertificateEncoding::Pem,
                data,
            });
        }
        // Plain HTTP only where validation allowed it (a loopback registry).
        let protocol = if self.settings.insecure && is_loopback(self.reference.resolve_registry()) {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        };
        let timeout = Duration::from_millis(self.settings.timeout_ms);
        Ok(Client::new(ClientConfig {
            protocol,
            extra_root_certificates,
            connect_timeout: Some(timeout),
            read_timeout: Some(timeout),
            user_agent: concat!("switchyard/", env!("CARGO_PKG_VERSION")),
            // A component is one artifact; an index is not one of ours.
            platform_resolver: None,
            ..ClientConfig::default()
        }))
    }

    /// The credentials now: read again on every call, so rotated ones are
    /// used from the next request on.
    async fn auth(&self) -> Result<RegistryAuth, OciError> {
        let unreadable = |reason: String| OciError::Credentials {
            reference: self.display(),
            reason,
        };
        if let Some(token) = &self.settings.token {
            let token = token.read().await.map_err(|e| unreadable(e.to_string()))?;
            return Ok(RegistryAuth::Bearer(token.expose().to_string()));
        }
        if let (Some(username), Some(password)) = (&self.settings.username, &self.settings.password) {
            let password = password.read().await.map_err(|e| unreadable(e.to_string()))?;
            return Ok(RegistryAuth::Basic(
                username.clone(),
                password.expose().to_string(),
            ));
        }
        if let Some(file) = &self.settings.docker_config {
            let text = tokio::fs::read(file)
                .await
                .map_err(|e| unreadable(format!("registry.docker_config {}: {e}", file.display())))?;
            return docker_config_auth(&text, self.reference.resolve_registry()).map_err(|reason| {
                unreadable(format!("registry.docker_config {}: {reason}", file.display()))
            });
        }
        Ok(RegistryAuth::Anonymous)
    }

    fn error(&self, auth: &RegistryAuth, error: OciDistributionError) -> OciError {
        let reference = self.display();
        match error {
            OciDistributionError::UnauthorizedError { .. }
            | OciDistributionError::AuthenticationFailure(_) => OciError::Unauthorized {
                reference,
                how: auth_kind(auth),
            },
            OciDistributionError::DigestError(oci_client::errors::DigestError::VerificationError {
                expected,
                actual,
            }) => OciError::Digest {
                reference,
                expected,
                actual,
            },
            OciDistributionError::ServerError { code: 401 | 403, .. } => OciError::Unauthorized {
                reference,
                how: auth_kind(auth),
            },
            OciDistributionError::RegistryError { envelope, .. }
                if envelope.errors.iter().any(|e| {
                    matches!(
                        e.code,
                        oci_client::errors::OciErrorCode::Unauthorized
                            | oci_client::errors::OciErrorCode::Denied
                    )
                }) =>
            {
                OciError::Unauthorized {
                    reference,
                    how: auth_kind(auth),
                }
            }
            other => OciError::Registry {
                reference,
                reason: crate::redact::url(&error_chain(&other)),
            },
        }
    }

    async fn bounded<T>(&self, future: impl Future<Output = Result<T, OciError>>) -> Result<T, OciError> {
        let ms = self.settings.timeout_ms;
        tokio::time::timeout(Duration::from_millis(ms), future)
            .await
            .map_err(|_| OciError::Timeout {
                reference: self.display(),
                ms,
            })?
    }

    /// The digest the reference points at now: one manifest HEAD request.
    ///
    /// # Errors
    /// As [`OciError`].
    pub async fn head(&self) -> Result<String, OciError> {
        self.bounded(async {
            let client = self.client()?;
            let auth = self.auth().await?;
            client
                .fetch_manifest_digest(&self.reference, &auth)
                .await
                .map_err(|e| self.error(&auth, e))
        })
        .await
    }

    /// Pulls the component: the manifest, then the component layer unless
    /// the cache holds its digest already. Both are checked against their
    /// digests; a blob that does not match is refused.
    ///
    /// # Errors
    /// As [`OciError`].
    pub async fn pull(&self, cache: &OciCache) -> Result<Pulled, OciError> {
        let started = Instant::now();
        self.bounded(async {
            let client = self.client()?;
            let auth = self.auth().await?;
            let (manifest, manifest_digest) = client
                .pull_image_manifest(&self.reference, &auth)
                .await
                .map_err(|e| self.error(&auth, e))?;
            let layer = component_layer(&manifest).ok_or_else(|| OciError::NotAComponent {
                reference: self.display(),
                layers: manifest
                    .layers
                    .iter()
                    .map(|l| l.media_type.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
            let layer_digest = layer.digest.clone();
            if !(0..=MAX_COMPONENT_BYTES).contains(&layer.size) {
                return Err(OciError::TooLarge {
                    reference: self.display(),
                    size: layer.size,
                });
            }
            // Reading and hashing megabytes blocks: off the runtime.
            let cached = {
                let (cache, digest) = (cache.clone(), layer_digest.clone());
                tokio::task::spawn_blocking(move || cache.read_blob(&digest))
                    .await
                    .ok()
                    .flatten()
            };
            if let Some(bytes) = cached {
                return Ok(Pulled {
                    manifest_digest,
                    path: cache.blob_path(&layer_digest),
                    layer_digest,
                    bytes,
                    cache_hit: true,
                    elapsed: started.elapsed(),
                });
            }
            let mut bytes = Vec::with_capacity(usize::try_from(layer.size).unwrap_or(0));
            client
                .pull_blob(&self.reference, layer, &mut bytes)
                .await
                .map_err(|e| self.error(&auth, e))?;
            let (bytes, written) = {
                let (store, digest) = (cache.clone(), layer_digest.clone());
                tokio::task::spawn_blocking(move || {
                    let written = store.write_blob(&digest, &bytes);
                    (bytes, written)
                })
                .await
                .map_err(|e| OciError::Cache {
                    reference: self.display(),
                    path: cache.blob_path(&layer_digest),
                    source: std::io::Error::other(e.to_string()),
                })?
            };
            let path = written.map_err(|source| OciError::Cache {
                reference: self.display(),
                path: cache.blob_path(&layer_digest),
                source,
            })?;
            Ok(Pulled {
                manifest_digest,
                layer_digest,
                path,
                bytes,
                cache_hit: false,
                elapsed: started.elapsed(),
            })
        })
        .await
    }

    /// Pushes `component` under this reference in the Wasm OCI artifact
    /// layout; `exports` and `imports` go into its config, as `wkg` writes
    /// them. Returns the manifest's digest.
    ///
    /// # Errors
    /// As [`OciError`].
    pub async fn push(
        &self,
        component: Vec<u8>,
        exports: &[String],
        imports: &[String],
    ) -> Result<String, OciError> {
        let layer = ImageLayer::new(component, WASM_LAYER.to_string(), None);
        let config = WasmConfig {
            created: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            architecture: "wasm",
            os: "wasip2",
            layer_digests: vec![layer.sha256_digest()],
            component: ComponentSummary {
                exports: exports.to_vec(),
                imports: imports.to_vec(),
            },
        };
        let config = oci_client::client::Config::new(
            serde_json::to_vec(&config).unwrap_or_default(),
            WASM_CONFIG.to_string(),
            None,
        );
        let mut manifest = OciImageManifest::build(std::slice::from_ref(&layer), &config, None);
        manifest.artifact_type = Some(WASM_CONFIG.to_string());
        self.bounded(async {
            let client = self.client()?;
            let auth = self.auth().await?;
            client
                .push(&self.reference, &[layer], config, &auth, Some(manifest))
                .await
                .map_err(|e| self.error(&auth, e))?;
            // The digest as the registry stored the manifest.
            client
                .fetch_manifest_digest(&self.reference, &auth)
                .await
                .map_err(|e| self.error(&auth, e))
        })
        .await
    }
}

/// The config blob of the Wasm OCI artifact layout.
#[derive(Serialize)]
struct WasmConfig {
    created: String,
    architecture: &'static str,
    os: &'static str,
    #[serde(rename = "layerDigests")]
    layer_digests: Vec<String>,
    component: ComponentSummary,
}

#[derive(Serialize)]
struct ComponentSummary {
    exports: Vec<String>,
    imports: Vec<String>,
}

fn component_layer(manifest: &OciImageManifest) -> Option<&oci_client::manifest::OciDescriptor> {
    manifest
        .layers
        .iter()
        .find(|layer| layer.media_type == WASM_LAYER)
        .or_else(|| {
            manifest
                .layers
                .iter()
                .find(|layer| OTHER_WASM_LAYERS.contains(&layer.media_type.as_str()))
        })
}

const fn auth_kind(auth: &RegistryAuth) -> &'static str {
    match auth {
        RegistryAuth::Anonymous => "no credentials were configured",
        RegistryAuth::Basic(..) => "user name and password",
        RegistryAuth::Bearer(_) => "bearer token",
    }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The credentials a Docker `config.json` holds for `registry`.
fn docker_config_auth(text: &[u8], registry: &str) -> Result<RegistryAuth, String> {
    #[derive(Deserialize)]
    struct File {
        #[serde(default)]
        auths: BTreeMap<String, Entry>,
    }
    #[derive(Deserialize)]
    struct Entry {
        auth: Option<String>,
        username: Option<String>,
        password: Option<String>,
        identitytoken: Option<String>,
        registrytoken: Option<String>,
    }
    let file: File = serde_json::from_slice(text).map_err(|e| format!("not a Docker config.json ({e})"))?;
    let wanted = normalise_registry(registry);
    let Some(entry) = file
        .auths
        .iter()
        .find(|(key, _)| normalise_registry(key) == wanted)
        .map(|(_, entry)| entry)
    else {
        return Err(format!(
            "no auths entry for {registry} (entries: {})",
            file.auths.keys().cloned().collect::<Vec<_>>().join(", ")
        ));
    };
    if let Some(token) = &entry.registrytoken {
        return Ok(RegistryAuth::Bearer(token.clone()));
    }
    if let (Some(username), Some(password)) = (&entry.username, &entry.password) {
        return Ok(RegistryAuth::Basic(username.clone(), password.clone()));
    }
    if let Some(auth) = &entry.auth {
        use base64::Engine as _;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|_| format!("the auth of {registry} is not base64"))?;
        let decoded =
            String::from_utf8(decoded).map_err(|_| format!("the auth of {registry} is not UTF-8"))?;
        let (username, password) = decoded
            .split_once(':')
            .ok_or_else(|| format!("the auth of {registry} is not USER:PASSWORD"))?;
        return Ok(RegistryAuth::Basic(username.to_string(), password.to_string()));
    }
    if entry.identitytoken.is_some() {
        return Err(format!(
            "the entry for {registry} holds an identitytoken (a credential helper's refresh token), which is not read; \
             give a user name and password or a token"
        ));
    }
    Err(format!("the entry for {registry} holds no credentials"))
}

/// `https://index.docker.io/v1/`, `docker.io` and `index.docker.io` are one
/// registry; others are compared by `host[:port]`.
fn normalise_registry(key: &str) -> String {
    let key = key.trim_start_matches("https://").trim_start_matches("http://");
    let host = key.split('/').next().unwrap_or(key).to_ascii_lowercase();
    match host.as_str() {
        "docker.io" | "index.docker.io" | "registry-1.docker.io" => "docker.io".to_string(),
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_json(auths: &str) -> Vec<u8> {
        format!("{{\"auths\": {{{auths}}}}}").into_bytes()
    }

    #[test]
    fn a_docker_config_gives_the_entry_of_the_registry() {
        // base64("ci:s3cret")
        let text = config_json(
            r#""https://registry.example.com/v1/": {"auth": "Y2k6czNjcmV0"}, "other.example.com": {"auth": "eDp5"}"#,
        );
        assert_eq!(
            docker_config_auth(&text, "registry.example.com").unwrap(),
            RegistryAuth::Basic("ci".into(), "s3cret".into())
        );
        let hub = config_json(r#""https://index.docker.io/v1/": {"username": "u", "password": "p"}"#);
        assert_eq!(
            docker_config_auth(&hub, "index.docker.io").unwrap(),
            RegistryAuth::Basic("u".into(), "p".into())
        );
        let missing = docker_config_auth(&text, "localhost:5000").unwrap_err();
        assert!(missing.contains("no auths entry for localhost:5000"), "{missing}");
        assert!(!missing.contains("s3cret"), "{missing}");
        let garbled = docker_config_auth(
            &config_json(r#""localhost:5000": {"auth": "!!"}"#),
            "localhost:5000",
        );
        assert!(garbled.unwrap_err().contains("not base64"));
        assert!(
            docker_config_auth(b"{\"auths\": 1", "x")
                .unwrap_err()
                .contains("not a Docker config.json")
        );
    }
}
