//! Config for the HTTP webhook target, and the rule that keeps a plugin's
//! topic inside the addresses the config names.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;

use crate::secret::SecretValue;
use crate::sinks::registry::{SinkSettings, TargetKind};
use crate::sinks::{Sink, SinkError};
use crate::tls::BrokerTlsConfig;

/// The request's method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum HttpMethod {
    /// `POST`.
    #[default]
    Post,
    /// `PUT`.
    Put,
}

/// What one request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BatchFormat {
    /// One event a request: the payload is the body, its headers the
    /// request's.
    #[default]
    None,
    /// Up to `max_batch` events a request, as a JSON array of
    /// `{"headers": {...}, "payload": ...}`.
    JsonArray,
    /// Up to `max_batch` events a request in CloudEvents' JSON batch format
    /// (`application/cloudevents-batch+json`).
    Cloudevents,
}

/// `[targets.NAME]` with `type = "http"`.
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HttpSinkConfig {
    /// The address the plugin's topic is a path under
    /// (`https://hooks.example.com/in/` with topic `orders` posts to
    /// `https://hooks.example.com/in/orders`; an empty topic posts to it).
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_URL"))]
    pub base_url: Option<String>,
    /// Addresses by name: the plugin's topic names one.
    #[serde(default)]
    pub endpoints: BTreeMap<String, String>,
    /// The request's method.
    #[serde(default)]
    pub method: HttpMethod,
    /// One event a request, or several.
    #[serde(default)]
    pub batch: BatchFormat,
    /// Events in one request, with `batch`.
    #[serde(default = "default_max_batch")]
    pub max_batch: usize,
    /// Requests in flight at once, per target. An aggregate has one in
    /// flight at most.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Follows a redirect, but only to an address the config names (under
    /// `base_url`, or an endpoint). Off, a redirect waits, named: it may be
    /// a way out of the addresses the config allows.
    #[serde(default)]
    pub follow_redirects: bool,
    /// Headers sent with every request.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Standard Webhooks signing secrets (`whsec_...`), each a value or
    /// read from a file or a command as it rotates; every request carries
    /// one signature per secret, so a receiver can move from one to the
    /// next.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_SIGNING_SECRET"))]
    pub signing_secrets: Vec<SecretValue>,
    /// A bearer token (`Authorization: Bearer ...`), read again as it rotates.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_TOKEN"))]
    pub bearer_token: Option<SecretValue>,
    /// A user for basic login.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_USER"))]
    pub user: Option<String>,
    /// Its password, read again as it rotates.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_PASSWORD"))]
    pub password: Option<SecretValue>,
    /// A CA to trust instead of the system's roots, and a client
    /// certificate for mutual TLS.
    #[serde(default)]
    pub tls: BrokerTlsConfig,
}

fn default_max_batch() -> usize {
    100
}

fn default_concurrency() -> usize {
    16
}

/// Never the secrets.
impl std::fmt::Debug for HttpSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpSinkConfig")
            .field("base_url", &self.base_url.as_deref().map(crate::redact::url))
            .field("endpoints", &self.endpoints.keys().collect::<Vec<_>>())
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

/// Why `topic` is no path under a base URL: only segments of letters,
/// digits and `-._~`, none of them `.` or `..`, so no topic leaves the
/// base's host or path.
pub(crate) fn path_problem(topic: &str) -> Option<String> {
    if topic.is_empty() {
        return None;
    }
    let problem = if topic.len() > 1024 {
        "is over 1,024 characters"
    } else if topic.starts_with('/') || topic.ends_with('/') || topic.contains("//") {
        "may not start or end with / or hold an empty segment"
    } else if topic.split('/').any(|segment| segment == "." || segment == "..") {
        "may not hold . or .. segments"
    } else if !topic
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '~' | '/'))
    {
        "may hold only letters, digits, -, ., _, ~ and /"
    } else {
        return None;
    };
    Some(format!(
        "topic {:?} {problem}: it names a path under the target's base_url",
        topic.chars().take(80).collect::<String>()
    ))
}

impl HttpSinkConfig {
    /// The address a message of `topic` goes to, only ever one the config
    /// names.
    ///
    /// # Errors
    /// A permanent failure naming why the topic names no such address.
    pub fn address(&self, topic: &str) -> Result<String, SinkError> {
        if let Some(address) = self.endpoints.get(topic) {
            return Ok(address.clone());
        }
        let Some(base) = &self.base_url else {
            let names: Vec<&String> = self.endpoints.keys().collect();
            return Err(SinkError::permanent(format!(
                "topic {:?} names no endpoint of the target (it has {names:?})",
                topic.chars().take(80).collect::<String>()
            )));
        };
        if let Some(problem) = path_problem(topic) {
            return Err(SinkError::permanent(problem));
        }
        Ok(if topic.is_empty() {
            base.clone()
        } else if base.ends_with('/') {
            format!("{base}{topic}")
        } else {
            format!("{base}/{topic}")
        })
    }

    /// Whether `url` is an address the config allows: an endpoint, or
    /// under `base_url` (same origin, under its path).
    pub fn allows(&self, url: &url::Url) -> bool {
        if self
            .endpoints
            .values()
            .any(|e| url::Url::parse(e).is_ok_and(|e| &e == url))
        {
            return true;
        }
        let Some(base) = self.base_url.as_deref().and_then(|b| url::Url::parse(b).ok()) else {
            return false;
        };
        let prefix = if base.path().ends_with('/') {
            base.path().to_string()
        } else {
            format!("{}/", base.path())
        };
        url.origin() == base.origin()
            && (url.path() == base.path() || url.path().starts_with(&prefix))
            && !url
                .path()
                .split('/')
                .any(|s| s == ".." || s == "." || s.contains("%2e") || s.contains("%2E"))
    }

    pub(crate) fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.base_url.is_none() && self.endpoints.is_empty() {
            problems.push("set base_url or endpoints: where the relay may send".to_string());
        }
        for (key, url) in self.base_url.iter().map(|u| ("base_url".to_string(), u)).chain(
            self.endpoints
                .iter()
                .map(|(name, u)| (format!("endpoints.{name}"), u)),
        ) {
            match url::Url::parse(url) {
                Ok(parsed) if matches!(parsed.scheme(), "https" | "http") => {
                    if parsed.query().is_some() || parsed.fragment().is_some() {
                        problems.push(format!(
                            "{key}: no query or fragment (a topic is added to the path)"
                        ));
                    }
                    if !parsed.username().is_empty() || parsed.password().is_some() {
                        problems.push(format!("{key}: no login in the URL: set user and password"));
                    }
                }
                _ => problems.push(format!(
                    "{key} {:?} must be an http:// or https:// URL",
                    crate::redact::url(url)
                )),
            }
        }
        if self.max_batch == 0 || self.max_batch > 1000 {
            problems.push("max_batch must be 1 to 1000".to_string());
        }
        if self.concurrency == 0 {
            problems.push("concurrency must be at least 1".to_string());
        }
        if self.password.is_some() && self.user.is_none() {
            problems.push("password is set but user is not".to_string());
        }
        if self.bearer_token.is_some() && self.user.is_some() {
            problems.push("set bearer_token or user and password, not both".to_string());
        }
        for (at, secret) in self.signing_secrets.iter().enumerate() {
            problems.extend(secret.problems(&format!("signing_secrets[{at}]")));
            if let crate::secret::SecretValue::Value(value) = secret
                && let Err(problem) = super::signing::secret_key(value, at + 1)
            {
                problems.push(problem);
            }
        }
        for (key, secret) in [("bearer_token", &self.bearer_token), ("password", &self.password)] {
            if let Some(secret) = secret {
                problems.extend(secret.problems(key));
            }
        }
        for name in self.headers.keys() {
            if reqwest_header_name_problem(name) {
                problems.push(format!("headers: {name:?} is not an HTTP header name"));
            }
        }
        problems.extend(self.tls.problems("tls"));
        problems
    }
}

/// Whether `name` is no HTTP header name (a token of visible ASCII without
/// separators).
pub(crate) fn reqwest_header_name_problem(name: &str) -> bool {
    name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

impl TargetKind for HttpSinkConfig {
    fn kind(&self) -> &'static str {
        "http"
    }

    fn validate(&self, _settings: &SinkSettings) -> Vec<String> {
        let problems = self.problems();
        #[cfg(not(feature = "http"))]
        let problems = [
            vec![crate::features::built_without("the HTTP target", "http")],
            problems,
        ]
        .concat();
        problems
    }

    fn apply_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
        if let Some(url) = env(&format!("{prefix}URL")) {
            self.base_url = Some(url);
        }
        if let Some(secret) = SecretValue::from_env(env, &format!("{prefix}SIGNING_SECRET")) {
            self.signing_secrets = vec![secret];
        }
        if let Some(token) = SecretValue::from_env(env, &format!("{prefix}TOKEN")) {
            self.bearer_token = Some(token);
        }
        if let Some(user) = env(&format!("{prefix}USER")) {
            self.user = Some(user);
        }
        if let Some(password) = SecretValue::from_env(env, &format!("{prefix}PASSWORD")) {
            self.password = Some(password);
        }
    }

    fn check_topic(&self, topic: &str) -> Result<(), SinkError> {
        self.address(topic).map(drop)
    }

    /// A receiver drops a repeated `webhook-id` (the event id) by the
    /// specification, but nothing makes it: the relay does not count on it.
    fn deduplicates_by_id(&self) -> bool {
        false
    }

    #[cfg(feature = "http")]
    async fn build(&self, name: &str, settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        Ok(Arc::new(super::sink::HttpSink::new(
            name,
            self,
            settings.publish_timeout,
            &settings.mask_fields,
        )?) as Arc<dyn Sink>)
    }

    #[cfg(not(feature = "http"))]
    async fn build(&self, name: &str, _settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        Err(SinkError::permanent(format!(
            "target {name:?}: {}",
            crate::features::built_without("the HTTP target", "http")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> HttpSinkConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn a_topic_is_a_path_under_the_base_or_an_endpoint_by_name() {
        let hooks =
            config("base_url = \"https://h.example/in/\"\n[endpoints]\nbilling = \"https://b.example/x\"");
        assert_eq!(
            hooks.address("orders/created").unwrap(),
            "https://h.example/in/orders/created"
        );
        assert_eq!(hooks.address("").unwrap(), "https://h.example/in/");
        assert_eq!(hooks.address("billing").unwrap(), "https://b.example/x");
        for escape in [
            "../admin",
            "a/../../x",
            "/etc",
            "a//b",
            "https://evil.example/",
            "a?b=1",
            "a#b",
            "%2e%2e/x",
            "@evil.example",
            "a\\b",
        ] {
            let error = hooks.address(escape).unwrap_err();
            assert_eq!(error.kind, crate::sinks::FailureKind::Refused, "{escape}");
        }
        let named_only = config("[endpoints]\nbilling = \"https://b.example/x\"");
        assert!(
            named_only
                .address("orders")
                .unwrap_err()
                .message
                .contains("names no endpoint")
        );
    }

    #[test]
    fn a_redirect_is_allowed_only_to_an_address_the_config_names() {
        let hooks = config("base_url = \"https://h.example/in\"\n[endpoints]\nb = \"https://b.example/x\"");
        let allowed = |u: &str| hooks.allows(&url::Url::parse(u).unwrap());
        assert!(allowed("https://h.example/in/orders"));
        assert!(allowed("https://b.example/x"));
        assert!(!allowed("https://h.example/other"));
        assert!(!allowed("https://h.example/inside"));
        assert!(!allowed("http://h.example/in/orders"));
        assert!(!allowed("https://evil.example/in/orders"));
        assert!(!allowed("https://b.example/y"));
    }

    #[test]
    fn each_problem_names_its_key() {
        let bad = config(
            "base_url = \"ftp://x\"\nmax_batch = 0\nconcurrency = 0\npassword = \"p\"\nsigning_secrets = [\"whsec_?\"]\n[headers]\n\"a b\" = \"1\"",
        );
        let problems = bad.problems().join("\n");
        for says in [
            "base_url",
            "max_batch",
            "concurrency",
            "user is not",
            "signing secret 1",
            "\"a b\"",
        ] {
            assert!(problems.contains(says), "{says}: {problems}");
        }
        assert!(config("").problems()[0].contains("set base_url or endpoints"));
    }
}
