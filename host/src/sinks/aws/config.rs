//! The settings every AWS target shares (region, endpoint, credentials),
//! written once and given to each kind's config by [`aws_target!`], and
//! the checks they share.

use serde::Deserialize;

use crate::secret::SecretValue;

/// What a FIFO queue's or topic's message group is.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum GroupId {
    /// The event's aggregate id: each aggregate's events in order, and
    /// different aggregates delivered side by side.
    #[default]
    Aggregate,
    /// The key the plugin chose (the aggregate id when it chose none).
    Key,
    /// One group for every message (`{ fixed = "all" }`): one consumer at a
    /// time, the messages in the order the relay sent them (each
    /// aggregate's in order; across aggregates, not the order they were
    /// written), one message a call.
    Fixed(String),
}

/// Where an AWS target connects and as whom, borrowed from its config.
#[derive(Clone, Copy)]
pub struct AwsConnection<'c> {
    /// `region`.
    pub region: Option<&'c str>,
    /// `endpoint_url`.
    pub endpoint_url: Option<&'c str>,
    /// `sts_endpoint_url`.
    pub sts_endpoint_url: Option<&'c str>,
    /// `profile`.
    pub profile: Option<&'c str>,
    /// `role_arn`.
    pub role_arn: Option<&'c str>,
    /// `external_id`.
    pub external_id: Option<&'c str>,
    /// `role_session_name`.
    pub role_session_name: &'c str,
    /// `access_key_id`.
    pub access_key_id: Option<&'c str>,
    /// `secret_access_key`.
    pub secret_access_key: Option<&'c SecretValue>,
    /// `credentials_refresh_seconds`.
    pub credentials_refresh_seconds: u64,
}

impl AwsConnection<'_> {
    /// What is wrong with the shared settings, each naming its key.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(region) = self.region
            && (region.is_empty()
                || !region
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
        {
            problems.push(format!(
                "region {region:?} is not a region name such as \"eu-west-1\""
            ));
        }
        for (key, url) in [
            ("endpoint_url", self.endpoint_url),
            ("sts_endpoint_url", self.sts_endpoint_url),
        ] {
            if let Some(url) = url
                && !(url.starts_with("https://") || url.starts_with("http://"))
            {
                problems.push(format!(
                    "{key} {:?} must be a URL, e.g. \"https://sqs.eu-west-1.amazonaws.com\"",
                    crate::redact::url(url)
                ));
            }
        }
        match (self.access_key_id, self.secret_access_key) {
            (Some(_), None) => problems.push("access_key_id is set but secret_access_key is not".to_string()),
            (None, Some(_)) => problems.push("secret_access_key is set but access_key_id is not".to_string()),
            (Some(_), Some(_)) if self.profile.is_some() => problems.push(
                "profile and access_key_id are both set: give the keys, or a profile of the shared files"
                    .to_string(),
            ),
            _ => {}
        }
        if let Some(secret) = self.secret_access_key {
            problems.extend(secret.problems("secret_access_key"));
        }
        if let Some(arn) = self.role_arn
            && !arn.starts_with("arn:")
        {
            problems.push(format!(
                "role_arn {arn:?} is not an ARN (arn:aws:iam::ACCOUNT:role/NAME)"
            ));
        }
        if self.external_id.is_some() && self.role_arn.is_none() {
            problems.push("external_id is only meaningful with role_arn".to_string());
        }
        if self.credentials_refresh_seconds == 0 {
            problems.push("credentials_refresh_seconds must be at least 1".to_string());
        }
        problems
    }
}

/// The default of `credentials_refresh_seconds`.
pub(crate) const fn default_credentials_refresh_seconds() -> u64 {
    900
}

/// The default of `role_session_name`.
pub(crate) fn default_role_session_name() -> String {
    "switchyard".to_string()
}

/// Declares the config of one AWS kind: the shared settings, then the
/// kind's own fields, and `connection()` to borrow the shared ones. (One
/// struct with `#[serde(flatten)]` would lose `deny_unknown_fields`, which
/// serde does not support beside it.)
macro_rules! aws_target {
    ($(#[$meta:meta])* $name:ident { $($body:tt)* }) => {
        $(#[$meta])*
        #[derive(Clone, serde::Deserialize, schemars::JsonSchema)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            /// The AWS region, e.g. `eu-west-1`. Default: the environment's
            /// (`AWS_REGION`) or the profile's.
            #[serde(default)]
            #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_REGION"))]
            pub region: Option<String>,
            /// The service's address: a VPC endpoint, or an emulator.
            /// Default: the region's public endpoint.
            #[serde(default)]
            #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_ENDPOINT_URL"))]
            pub endpoint_url: Option<String>,
            /// The STS address of the relay's own calls (`role_arn`'s
            /// `AssumeRole`, an SNS topic's account): a VPC endpoint of STS,
            /// or an emulator. Default: the region's. `endpoint_url` is the
            /// target's service's alone; a web identity's exchange follows
            /// `AWS_ENDPOINT_URL_STS`.
            #[serde(default)]
            pub sts_endpoint_url: Option<String>,
            /// A profile of the shared config and credentials files. Default:
            /// `AWS_PROFILE`, else `default`.
            #[serde(default)]
            pub profile: Option<String>,
            /// A role to assume with the credentials found (`sts:AssumeRole`).
            #[serde(default)]
            pub role_arn: Option<String>,
            /// The external id the role's trust policy asks for.
            #[serde(default)]
            pub external_id: Option<String>,
            /// The session name of the assumed role.
            #[serde(default = "crate::sinks::aws::config::default_role_session_name")]
            pub role_session_name: String,
            /// An access key id. Without it, the AWS default chain:
            /// environment, shared files (and SSO), a web identity token file
            /// (EKS), container credentials (ECS), the instance's IMDSv2.
            #[serde(default)]
            #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_ACCESS_KEY_ID"))]
            pub access_key_id: Option<String>,
            /// The secret of `access_key_id`, as a value or from a file or a
            /// command, read again as credentials are.
            #[serde(default)]
            #[schemars(extend("x-env" = "SWITCHYARD_TARGET_<NAME>_SECRET_ACCESS_KEY"))]
            pub secret_access_key: Option<crate::secret::SecretValue>,
            /// Credentials are found again at least this often, before they
            /// expire, and at once after the service refused them: a rotated
            /// key, profile file or web identity token is taken up without a
            /// restart.
            #[serde(default = "crate::sinks::aws::config::default_credentials_refresh_seconds")]
            pub credentials_refresh_seconds: u64,
            $($body)*
        }

        impl $name {
            /// The shared settings.
            pub fn connection(&self) -> crate::sinks::aws::AwsConnection<'_> {
                crate::sinks::aws::AwsConnection {
                    region: self.region.as_deref(),
                    endpoint_url: self.endpoint_url.as_deref(),
                    sts_endpoint_url: self.sts_endpoint_url.as_deref(),
                    profile: self.profile.as_deref(),
                    role_arn: self.role_arn.as_deref(),
                    external_id: self.external_id.as_deref(),
                    role_session_name: &self.role_session_name,
                    access_key_id: self.access_key_id.as_deref(),
                    secret_access_key: self.secret_access_key.as_ref(),
                    credentials_refresh_seconds: self.credentials_refresh_seconds,
                }
            }

            /// The shared environment overrides.
            fn apply_connection_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
                if let Some(region) = env(&format!("{prefix}REGION")) {
                    self.region = Some(region);
                }
                if let Some(url) = env(&format!("{prefix}ENDPOINT_URL")) {
                    self.endpoint_url = Some(url);
                }
                if let Some(id) = env(&format!("{prefix}ACCESS_KEY_ID")) {
                    self.access_key_id = Some(id);
                }
                if let Some(secret) =
                    crate::secret::SecretValue::from_env(env, &format!("{prefix}SECRET_ACCESS_KEY"))
                {
                    self.secret_access_key = Some(secret);
                }
            }
        }

        // Never the secret: the derived form would print a key given as a value.
        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("region", &self.region)
                    .field("endpoint_url", &self.endpoint_url.as_deref().map(crate::redact::url))
                    .field("profile", &self.profile)
                    .field("role_arn", &self.role_arn)
                    .field("access_key_id", &self.access_key_id)
                    .finish_non_exhaustive()
            }
        }
    };
}
pub(crate) use aws_target;

/// The `TargetKind` of one AWS kind: its `type`, the shared settings' and
/// the kind's own checks (`$extra`), the names it lists (`$listed`, each
/// checked by `$problem`, as every topic a plugin returns is), the shared
/// environment overrides, and the sink `sink::$sink` built and asked about
/// its listed names (`listed_problems`).
macro_rules! aws_kind {
    ($config:ident, $kind:literal, $sink:ident, $listed:ident, $problem:path, $extra:path, $dedup:expr) => {
        impl crate::sinks::registry::TargetKind for $config {
            fn kind(&self) -> &'static str {
                $kind
            }

            fn validate(&self, _settings: &crate::sinks::registry::SinkSettings) -> Vec<String> {
                let mut problems = self.connection().problems();
                for name in &self.$listed {
                    if let Some(problem) = $problem(name) {
                        problems.push(format!("{}: {problem}", stringify!($listed)));
                    }
                }
                problems.extend($extra(self));
                #[cfg(not(feature = "aws"))]
                problems.insert(0, crate::features::built_without("the AWS targets", "aws"));
                problems
            }

            fn apply_env(&mut self, prefix: &str, env: &dyn Fn(&str) -> Option<String>) {
                self.apply_connection_env(prefix, env);
            }

            fn check_topic(&self, topic: &str) -> Result<(), crate::sinks::SinkError> {
                match $problem(topic) {
                    Some(problem) => Err(crate::sinks::SinkError::permanent(problem)),
                    None => Ok(()),
                }
            }

            fn deduplicates_by_id(&self) -> bool {
                $dedup
            }

            #[cfg(feature = "aws")]
            async fn build(
                &self,
                name: &str,
                settings: &crate::sinks::registry::SinkSettings,
            ) -> Result<std::sync::Arc<dyn crate::sinks::Sink>, crate::sinks::SinkError> {
                let sink = sink::$sink::connect(name, self, settings.publish_timeout).await;
                Ok(std::sync::Arc::new(sink) as std::sync::Arc<dyn crate::sinks::Sink>)
            }

            #[cfg(feature = "aws")]
            async fn live_problems(
                &self,
                name: &str,
                settings: &crate::sinks::registry::SinkSettings,
            ) -> Result<Vec<String>, String> {
                let sink = sink::$sink::connect(name, self, settings.publish_timeout).await;
                sink.listed_problems().await.map_err(|e| e.to_string())
            }

            #[cfg(not(feature = "aws"))]
            async fn build(
                &self,
                name: &str,
                _settings: &crate::sinks::registry::SinkSettings,
            ) -> Result<std::sync::Arc<dyn crate::sinks::Sink>, crate::sinks::SinkError> {
                Err(crate::sinks::SinkError::permanent(format!(
                    "target {name:?}: {}",
                    crate::features::built_without("the AWS targets", "aws")
                )))
            }
        }
    };
}
pub(crate) use aws_kind;

/// A fixed message group SQS and SNS would refuse.
pub(crate) fn group_problems(group: &GroupId) -> Vec<String> {
    match group {
        GroupId::Fixed(group) if group.is_empty() || group.len() > 128 => {
            vec!["message_group: a fixed group is 1 to 128 characters".to_string()]
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connection<'c>(secret: Option<&'c SecretValue>) -> AwsConnection<'c> {
        AwsConnection {
            region: Some("eu-west-1"),
            endpoint_url: None,
            sts_endpoint_url: None,
            profile: None,
            role_arn: None,
            external_id: None,
            role_session_name: "switchyard",
            access_key_id: None,
            secret_access_key: secret,
            credentials_refresh_seconds: 900,
        }
    }

    #[test]
    fn each_connection_problem_names_its_key() {
        assert!(connection(None).problems().is_empty());
        let secret = SecretValue::Value("s".into());
        let cases: Vec<(AwsConnection<'_>, &str)> = vec![
            (
                AwsConnection {
                    region: Some("EU West"),
                    ..connection(None)
                },
                "region",
            ),
            (
                AwsConnection {
                    endpoint_url: Some("sqs.local"),
                    ..connection(None)
                },
                "endpoint_url",
            ),
            (connection(Some(&secret)), "access_key_id is not"),
            (
                AwsConnection {
                    access_key_id: Some("AKIA"),
                    ..connection(None)
                },
                "secret_access_key is not",
            ),
            (
                AwsConnection {
                    role_arn: Some("role/x"),
                    ..connection(None)
                },
                "role_arn",
            ),
            (
                AwsConnection {
                    external_id: Some("x"),
                    ..connection(None)
                },
                "external_id",
            ),
            (
                AwsConnection {
                    credentials_refresh_seconds: 0,
                    ..connection(None)
                },
                "credentials_refresh_seconds",
            ),
        ];
        for (bad, says) in cases {
            let problems = bad.problems().join("\n");
            assert!(problems.contains(says), "{says}: {problems}");
        }
    }
}
