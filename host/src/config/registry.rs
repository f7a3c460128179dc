//! `[plugins.registry]`: how a plugin whose `path` is an `oci://` reference
//! reaches its registry (credentials, TLS, how often a tag is checked).

use std::path::PathBuf;

use serde::Deserialize;

use crate::secret::SecretValue;

/// The prefix that makes a plugin's `path` a registry reference.
pub const OCI_SCHEME: &str = "oci://";

/// Registry settings of one plugin; every field has a default, so an
/// anonymous registry needs no section.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RegistryConfig {
    /// How often a tag reference is checked for a new digest (one manifest
    /// HEAD request). A digest reference is never checked again.
    #[serde(default = "default_refresh_seconds")]
    pub refresh_seconds: u64,
    /// Bound on one request to the registry (a pull as a whole).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Basic authentication: the user name, with `password`.
    #[serde(default)]
    pub username: Option<String>,
    /// Basic authentication: the password, its value or
    /// `{ file = "..." }` / `{ command = [...] }`, read again for each pull.
    #[serde(default)]
    pub password: Option<SecretValue>,
    /// A bearer token, sent as `Authorization: Bearer`, read again for each pull.
    #[serde(default)]
    pub token: Option<SecretValue>,
    /// A Docker `config.json` (the `.dockerconfigjson` key of a Kubernetes
    /// `imagePullSecrets` secret), read again for each pull; its `auths`
    /// entry for the reference's registry is used.
    #[serde(default)]
    pub docker_config: Option<PathBuf>,
    /// PEM file of the CA that signed the registry's certificate, trusted
    /// besides the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// Plain HTTP. Refused for any registry but a loopback one.
    #[serde(default)]
    pub insecure: bool,
}

const fn default_refresh_seconds() -> u64 {
    30
}

const fn default_timeout_ms() -> u64 {
    30_000
}

impl Default for RegistryConfig {
    fn default() -> Self {
        toml::from_str("").unwrap_or_else(|_| unreachable!("all registry fields have defaults"))
    }
}

impl RegistryConfig {
    /// What is wrong with these settings for `reference` (without
    /// `oci://`), `at` naming the plugin; empty when fine.
    pub fn problems(&self, at: &str, reference: &str) -> Vec<String> {
        #[cfg(not(feature = "oci"))]
        // The words of the plugin loader's own refusal (`OciError::Unbuilt`),
        // without reaching up into it.
        return vec![format!(
            "{at}: path {OCI_SCHEME}{reference}: {}",
            crate::features::built_without("registry plugins", "oci")
        )];
        #[cfg(feature = "oci")]
        self.problems_of(at, reference)
    }

    #[cfg(feature = "oci")]
    fn problems_of(&self, at: &str, reference: &str) -> Vec<String> {
        let mut problems = Vec::new();
        let parsed = match reference.parse::<oci_client::Reference>() {
            Ok(parsed) => Some(parsed),
            Err(error) => {
                problems.push(format!(
                    "{at}: path {OCI_SCHEME}{reference} is not a registry reference ({error}); \
                     write oci://REGISTRY/REPOSITORY:TAG or oci://REGISTRY/REPOSITORY@sha256:DIGEST"
                ));
                None
            }
        };
        if self.refresh_seconds == 0 {
            problems.push(format!("{at}: registry.refresh_seconds must be at least 1"));
        }
        if !(100..=600_000).contains(&self.timeout_ms) {
            problems.push(format!(
                "{at}: registry.timeout_ms must be between 100 and 600000"
            ));
        }
        let basic = self.username.is_some() || self.password.is_some();
        if self.username.is_some() != self.password.is_some() {
            problems.push(format!(
                "{at}: registry.username and registry.password go together"
            ));
        }
        let ways = [basic, self.token.is_some(), self.docker_config.is_some()];
        if ways.iter().filter(|&&way| way).count() > 1 {
            problems.push(format!(
                "{at}: set one of registry.username/password, registry.token and registry.docker_config"
            ));
        }
        if let Some(password) = &self.password {
            problems.extend(password.problems(&format!("{at}: registry.password")));
        }
        if let Some(token) = &self.token {
            problems.extend(token.problems(&format!("{at}: registry.token")));
        }
        for (key, file) in [("docker_config", &self.docker_config), ("ca_file", &self.ca_file)] {
            if let Some(file) = file
                && let Err(error) = std::fs::metadata(file)
            {
                problems.push(format!("{at}: registry.{key} {}: {error}", file.display()));
            }
        }
        if self.insecure
            && let Some(parsed) = parsed
            && !is_loopback(parsed.resolve_registry())
        {
            problems.push(format!(
                "{at}: registry.insecure (plain HTTP) is allowed for a loopback registry only, not {}",
                parsed.resolve_registry()
            ));
        }
        problems
    }
}

/// Whether a registry's `host[:port]` is this machine.
pub fn is_loopback(registry: &str) -> bool {
    let host = match registry.rsplit_once(':') {
        // `[::1]:5000`, `127.0.0.1:5000`, `localhost:5000`; a bare IPv6
        // address has several colons and no brackets.
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) && !host.ends_with(':') => host,
        _ => registry,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_registries_are_told_apart_from_remote_ones() {
        for local in [
            "localhost:5000",
            "127.0.0.1:5000",
            "[::1]:5000",
            "localhost",
            "127.0.0.2",
        ] {
            assert!(is_loopback(local), "{local}");
        }
        for remote in [
            "registry.example.com",
            "ghcr.io:443",
            "10.0.0.1:5000",
            "localhost.example.com",
        ] {
            assert!(!is_loopback(remote), "{remote}");
        }
    }

    #[test]
    fn each_mistake_is_named() {
        let config: RegistryConfig = toml::from_str(
            "refresh_seconds = 0\nusername = \"ci\"\ntoken = \"t\"\ninsecure = true\nca_file = \"/nonexistent/ca.pem\"",
        )
        .unwrap();
        let problems = config
            .problems("plugins[0] (\"r\")", "registry.example.com/team/router:1.4")
            .join("\n");
        for expected in [
            "refresh_seconds must be at least 1",
            "registry.username and registry.password go together",
            "set one of registry.username/password, registry.token and registry.docker_config",
            "registry.ca_file /nonexistent/ca.pem",
            "allowed for a loopback registry only, not registry.example.com",
        ] {
            assert!(
                problems.contains(expected),
                "{expected} missing from:\n{problems}"
            );
        }
        let bad = RegistryConfig::default().problems("p", "UPPER/Case::bad");
        assert!(bad[0].contains("is not a registry reference"), "{bad:?}");
        assert!(RegistryConfig::default().problems("p", "localhost:5000/team/router@sha256:0123456789012345678901234567890123456789012345678901234567890123").is_empty());
    }
}
