//! Config for the Google Cloud Pub/Sub target, and the checks Pub/Sub's
//! limits put on topics and messages before any call.

use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;

use crate::sinks::registry::{SinkSettings, TargetKind};
use crate::sinks::{Sink, SinkError};

/// What a message's ordering key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OrderingKey {
    /// The event's aggregate id: consumers of an ordering-enabled
    /// subscription get one aggregate's events in order.
    #[default]
    Aggregate,
    /// The key the plugin chose (no ordering key when it chose none).
    Key,
    /// No ordering key: Pub/Sub delivers in any order, and publishes
    /// batch across aggregates.
    None,
}

/// `[targets.NAME]` with `type = "pubsub"`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PubSubSinkConfig {
    /// The Google Cloud project whose topics the plugins name. A plugin
    /// may also name a topic in full, `projects/OTHER/topics/NAME`.
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_PROJECT"))]
    pub project: String,
    /// `host:port` of a Pub/Sub emulator: no TLS, no credentials. Without
    /// it, the environment's `PUBSUB_EMULATOR_HOST` is used when set.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_EMULATOR_HOST"))]
    pub emulator_host: Option<String>,
    /// The service's address, e.g. `https://europe-west1-pubsub.googleapis.com`.
    /// Ordering keys are kept in order only within one region: with
    /// ordering, use a regional endpoint. Default: the global endpoint.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_ENDPOINT"))]
    pub endpoint: Option<String>,
    /// A service-account key file (JSON). Without it, Application Default
    /// Credentials: `GOOGLE_APPLICATION_CREDENTIALS`, the gcloud user's
    /// login, or the metadata server of GKE and Compute Engine (workload
    /// identity). Read when the client is built; never printed.
    #[serde(default)]
    #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_CREDENTIALS_FILE"))]
    pub credentials_file: Option<PathBuf>,
    /// What each message's ordering key is.
    #[serde(default)]
    pub ordering_key: OrderingKey,
    /// Topics to check at start and in `switchyard validate` (and create,
    /// with `create_topics`). Topics the plugins name beyond these are
    /// found missing at their first publish.
    #[serde(default)]
    pub topics: Vec<String>,
    /// Creates a topic that does not exist: the listed ones at start, any
    /// other at its first publish. For the emulator and development; in
    /// production topics belong to the infrastructure's own code, and the
    /// relay's account needs only the publisher role.
    #[serde(default)]
    pub create_topics: bool,
}

/// Why Pub/Sub would refuse a topic name: 3 to 255 characters, starting
/// with a letter, of letters, digits and `-_.~+%`, not starting with `goog`.
/// `topic` is a name in the target's project or a full `projects/P/topics/T`.
pub(crate) fn topic_problem(topic: &str) -> Option<String> {
    let id = match topic.strip_prefix("projects/") {
        Some(rest) => match rest.split_once("/topics/") {
            Some((project, id)) if !project.is_empty() && !project.contains('/') => id,
            _ => {
                return Some(format!(
                    "topic {topic:?} is neither a topic name nor projects/PROJECT/topics/NAME"
                ));
            }
        },
        None => topic,
    };
    let problem = if !(3..=255).contains(&id.len()) {
        "must be 3 to 255 characters long"
    } else if !id.starts_with(|c: char| c.is_ascii_alphabetic()) {
        "must start with a letter"
    } else if id.starts_with("goog") {
        "may not start with \"goog\""
    } else if !id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.~+%".contains(c))
    {
        "may hold only letters, digits and - _ . ~ + %"
    } else {
        return None;
    };
    Some(format!("Pub/Sub topic {id:?} {problem}"))
}

impl PubSubSinkConfig {
    /// The full name of `topic` (`projects/P/topics/T`).
    pub fn topic_name(&self, topic: &str) -> String {
        if topic.starts_with("projects/") {
            topic.to_string()
        } else {
            format!("projects/{}/topics/{topic}", self.project)
        }
    }

    /// Where to connect: the emulator (plain HTTP/2), the configured
    /// endpoint, or the client's default.
    pub fn endpoint_url(&self) -> Option<String> {
        match (&self.emulator_host, &self.endpoint) {
            (Some(host), _) => Some(format!("http://{host}")),
            (None, Some(endpoint)) => Some(endpoint.clone()),
            (None, None) => None,
        }
    }

    fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let project = self.project.trim();
        if project.is_empty() {
            problems.push("project is empty".to_string());
        } else if project.contains(['/', ' ']) {
            problems.push(format!(
                "project {project:?} must be a project id such as \"my-project\""
            ));
        }
        if let Some(host) = &self.emulator_host {
            if host.contains("://") || !host.contains(':') {
                problems.push(format!(
                    "emulator_host {host:?} must be host:port, e.g. \"127.0.0.1:8085\""
                ));
            }
            if self.credentials_file.is_some() {
                problems.push(
                    "credentials_file is set with emulator_host: the emulator takes no credentials; \
                     drop one of them"
                        .to_string(),
                );
            }
        }
        if let Some(endpoint) = &self.endpoint
            && !(endpoint.starts_with("https://") || endpoint.starts_with("http://"))
        {
            problems.push(format!(
                "endpoint {endpoint:?} must be a URL, e.g. \"https://europe-west1-pubsub.googleapis.com\""
            ));
        }
        if let Some(path) = &self.credentials_file
            && let Err(error) = std::fs::metadata(path)
        {
            problems.push(format!("credentials_file {}: {error}", path.display()));
        }
        for topic in &self.topics {
            if let Some(problem) = topic_problem(topic) {
                problems.push(format!("topics: {problem}"));
            }
        }
        problems
    }
}

impl TargetKind for PubSubSinkConfig {
    fn kind(&self) -> &'static str {
        "pubsub"
    }

    fn validate(&self, _settings: &SinkSettings) -> Vec<String> {
        let problems = self.problems();
        #[cfg(not(feature = "pubsub"))]
        let problems = [
            vec![crate::features::built_without("Pub/Sub", "pubsub")],
            problems,
        ]
        .concat();
        problems
    }

    fn apply_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
        if let Some(project) = env(&format!("{prefix}PROJECT")) {
            self.project = project;
        }
        if let Some(host) = env(&format!("{prefix}EMULATOR_HOST")) {
            self.emulator_host = Some(host);
        } else if self.emulator_host.is_none()
            && self.endpoint.is_none()
            && self.credentials_file.is_none()
            && let Some(host) = env("PUBSUB_EMULATOR_HOST").filter(|h| !h.is_empty())
        {
            // The variable every Google client honours, unless the config
            // says where to go.
            self.emulator_host = Some(host);
        }
        if let Some(endpoint) = env(&format!("{prefix}ENDPOINT")) {
            self.endpoint = Some(endpoint);
        }
        if let Some(path) = env(&format!("{prefix}CREDENTIALS_FILE")) {
            self.credentials_file = Some(path.into());
        }
    }

    fn check_topic(&self, topic: &str) -> Result<(), SinkError> {
        match topic_problem(topic) {
            Some(problem) => Err(SinkError::permanent(problem)),
            None => Ok(()),
        }
    }

    #[cfg(feature = "pubsub")]
    async fn build(&self, name: &str, settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        let sink = super::PubSubSink::connect(name, self, settings.publish_timeout).await?;
        Ok(Arc::new(sink) as Arc<dyn Sink>)
    }

    #[cfg(feature = "pubsub")]
    async fn live_problems(&self, name: &str, settings: &SinkSettings) -> Result<Vec<String>, String> {
        let sink = super::PubSubSink::connect(name, self, settings.publish_timeout)
            .await
            .map_err(|e| e.to_string())?;
        sink.listed_topic_problems().await.map_err(|e| e.to_string())
    }

    #[cfg(not(feature = "pubsub"))]
    async fn build(&self, name: &str, _settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        Err(SinkError::permanent(format!(
            "target {name:?}: {}",
            crate::features::built_without("Pub/Sub", "pubsub")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_names_follow_pubsubs_rules() {
        for good in [
            "orders",
            "orders.created",
            "a-b_c~d+e%f",
            "projects/p-1/topics/orders",
        ] {
            assert_eq!(topic_problem(good), None, "{good}");
        }
        for (bad, says) in [
            ("ab", "3 to 255"),
            ("1orders", "start with a letter"),
            ("google-orders", "goog"),
            ("orders/created", "only letters"),
            ("orders created", "only letters"),
            ("projects/p/subscriptions/s", "neither"),
            ("projects//topics/orders", "neither"),
        ] {
            let problem = topic_problem(bad).unwrap_or_default();
            assert!(problem.contains(says), "{bad}: {problem}");
        }
        assert!(topic_problem(&"a".repeat(256)).is_some());
    }

    fn config(text: &str) -> PubSubSinkConfig {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn the_emulator_variable_applies_only_when_the_config_names_no_place() {
        let env = |name: &str| (name == "PUBSUB_EMULATOR_HOST").then(|| "127.0.0.1:8085".to_string());
        let mut plain = config("project = \"p\"");
        plain.apply_env("SWITCHYARD_TARGET_PS_", &env);
        assert_eq!(plain.endpoint_url().as_deref(), Some("http://127.0.0.1:8085"));
        let mut regional =
            config("project = \"p\"\nendpoint = \"https://europe-west1-pubsub.googleapis.com\"");
        regional.apply_env("SWITCHYARD_TARGET_PS_", &env);
        assert_eq!(regional.emulator_host, None);
    }

    #[test]
    fn problems_name_their_key() {
        let bad = config(
            "project = \"\"\nemulator_host = \"http://x\"\nendpoint = \"pubsub\"\ntopics = [\"goog\"]",
        );
        let problems = bad.problems().join("\n");
        for needle in ["project is empty", "emulator_host", "endpoint", "topics:"] {
            assert!(problems.contains(needle), "{needle}: {problems}");
        }
        assert_eq!(
            config("project = \"p\"").topic_name("orders"),
            "projects/p/topics/orders"
        );
    }
}
