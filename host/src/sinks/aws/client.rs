//! The AWS SDK as the targets use it: one `SdkConfig` per target with the
//! HTTP client on rustls and ring, the SDK's retries off and its time
//! bounded by the publish timeout, credentials found again as they expire
//! or are refused; and AWS's answers classified into the relay's failure
//! kinds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use aws_config::identity::IdentityCache;
use aws_config::retry::RetryConfig;
use aws_config::stalled_stream_protection::StalledStreamProtectionConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_credential_types::Credentials;
use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider, future};
use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use aws_smithy_runtime_api::client::result::SdkError;
use aws_smithy_types::error::metadata::ProvideErrorMetadata;

use super::AwsConnection;
use crate::secret::SecretValue;
use crate::sinks::{FailureKind, SinkError};

/// Credentials are found again this long before they expire.
const EXPIRY_MARGIN: Duration = Duration::from_secs(300);

/// The connection of a target: its service's `SdkConfig`, the one of the
/// relay's own STS calls, and the credentials both sign with, to be found
/// again after a refusal.
pub(super) struct Connection {
    pub sdk: SdkConfig,
    pub sts: SdkConfig,
    credentials: Arc<Rotating>,
}

impl Connection {
    /// The SDK's config for `connection`; a call takes at most `timeout`.
    pub async fn new(connection: &AwsConnection<'_>, timeout: Duration) -> Connection {
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
            .build_https();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http)
            // The relay decides what a failure means and when to try again.
            .retry_config(RetryConfig::disabled())
            // The operation timeout bounds every call; the SDK's watch over
            // a body's throughput only costs each request its clock reads.
            .stalled_stream_protection(StalledStreamProtectionConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .operation_timeout(timeout)
                    .connect_timeout(timeout.min(Duration::from_secs(5)))
                    .build(),
            );
        if let Some(region) = connection.region {
            loader = loader.region(Region::new(region.to_string()));
        }
        if let Some(profile) = connection.profile {
            loader = loader.profile_name(profile);
        }
        // The base config is STS's: `endpoint_url` is the service's alone (a
        // VPC endpoint of SQS does not answer AssumeRole).
        if let Some(url) = connection.sts_endpoint_url {
            loader = loader.endpoint_url(url);
        }
        // The chain as the SDK builds it, to resolve from; the targets'
        // clients sign with `Rotating` (no cache of the SDK's own: it would
        // keep a refused key until it expires).
        let base = loader.load().await;
        let mut refresh = Duration::from_secs(connection.credentials_refresh_seconds.max(1));
        if let (Some(_), Some(SecretValue::From(source))) =
            (connection.access_key_id, connection.secret_access_key)
        {
            // A secret from a file or a command is read as often as its
            // source says, as every other secret is.
            refresh = refresh.min(source.refresh());
        }
        let credentials = Arc::new(Rotating {
            base: base.clone(),
            profile: connection.profile.map(ToString::to_string),
            keys: connection
                .access_key_id
                .map(|id| (id.to_string(), connection.secret_access_key.cloned())),
            role: connection.role_arn.map(|arn| {
                (
                    arn.to_string(),
                    connection.external_id.map(ToString::to_string),
                    connection.role_session_name.to_string(),
                )
            }),
            refresh,
            held: tokio::sync::Mutex::new(None),
            refused: AtomicBool::new(false),
        });
        let sts = base
            .into_builder()
            .identity_cache(IdentityCache::no_cache())
            .credentials_provider(SharedCredentialsProvider::new(SharedRotating(
                credentials.clone(),
            )))
            .build();
        let mut service = sts.clone().into_builder();
        service.set_endpoint_url(connection.endpoint_url.map(ToString::to_string));
        Connection {
            sdk: service.build(),
            sts,
            credentials,
        }
    }

    /// The service refused the credentials: the next call finds them again.
    pub fn credentials_refused(&self) {
        self.credentials.refused.store(true, Ordering::Relaxed);
    }

    /// Classifies `error` from a call about `what` (a queue, topic, stream
    /// or bus), and lets credentials the service refused be found again.
    pub fn classify<E>(&self, error: &SdkError<E, HttpResponse>, service: &str, what: &str) -> SinkError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let classified = classify(error, service, what);
        if classified.kind == FailureKind::Unauthorized {
            self.credentials_refused();
        }
        classified
    }
}

/// Credentials found from the config's keys or the default chain (and a
/// role assumed with them), held until they near their expiry, until
/// `refresh` has passed, or until a service refused them.
struct Rotating {
    base: SdkConfig,
    profile: Option<String>,
    keys: Option<(String, Option<SecretValue>)>,
    role: Option<(String, Option<String>, String)>,
    refresh: Duration,
    held: tokio::sync::Mutex<Option<(Credentials, Instant)>>,
    refused: AtomicBool,
}

impl std::fmt::Debug for Rotating {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rotating").finish_non_exhaustive()
    }
}

impl Rotating {
    async fn credentials(&self) -> Result<Credentials, CredentialsError> {
        let mut held = self.held.lock().await;
        let refused = self.refused.swap(false, Ordering::Relaxed);
        if let Some((credentials, found)) = held.as_ref()
            && !refused
            && found.elapsed() < self.refresh
            && credentials
                .expiry()
                .is_none_or(|expiry| expiry > SystemTime::now() + EXPIRY_MARGIN)
        {
            return Ok(credentials.clone());
        }
        let found = self.find().await?;
        *held = Some((found.clone(), Instant::now()));
        Ok(found)
    }

    /// Finds credentials anew: the key's secret read again, or a new
    /// default chain (which reads the shared files and the web identity
    /// token file again), then the role assumed with them.
    async fn find(&self) -> Result<Credentials, CredentialsError> {
        let source: SharedCredentialsProvider = match &self.keys {
            Some((id, secret)) => {
                let secret = match secret {
                    Some(secret) => secret.read().await.map_err(CredentialsError::provider_error)?,
                    None => {
                        return Err(CredentialsError::invalid_configuration(
                            "secret_access_key is not set",
                        ));
                    }
                };
                SharedCredentialsProvider::new(Credentials::new(
                    id.clone(),
                    secret.expose().to_string(),
                    None,
                    None,
                    "switchyard config",
                ))
            }
            None => {
                let mut chain = aws_config::default_provider::credentials::DefaultCredentialsChain::builder()
                    .configure(provider_config(&self.base));
                if let Some(profile) = &self.profile {
                    chain = chain.profile_name(profile);
                }
                chain.set_region(self.base.region().cloned());
                SharedCredentialsProvider::new(chain.build().await)
            }
        };
        let Some((arn, external_id, session)) = &self.role else {
            return source.provide_credentials().await;
        };
        let mut role = aws_config::sts::AssumeRoleProvider::builder(arn.clone())
            .session_name(session.clone())
            .configure(&self.base);
        if let Some(id) = external_id {
            role = role.external_id(id.clone());
        }
        role.build_from_provider(source).await.provide_credentials().await
    }
}

/// The provider config the default chain reads its sources with: the
/// target's HTTP client, region and time bounds.
fn provider_config(base: &SdkConfig) -> aws_config::provider_config::ProviderConfig {
    let mut config =
        aws_config::provider_config::ProviderConfig::default().with_region(base.region().cloned());
    if let Some(http) = base.http_client() {
        config = config.with_http_client(http);
    }
    config
}

/// Shares one [`Rotating`] between the SDK's clients and the sink.
#[derive(Debug, Clone)]
struct SharedRotating(Arc<Rotating>);

impl ProvideCredentials for SharedRotating {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::new(self.0.credentials())
    }
}

/// Codes AWS answers when it sheds load: the target pauses, nobody's
/// attempt is spent.
const THROTTLED: &[&str] = &[
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "ProvisionedThroughputExceededException",
    "RequestLimitExceeded",
    "LimitExceededException",
    "KMSThrottlingException",
    "KMSThrottling",
    "KMS.ThrottlingException",
    "Throttled",
    "SlowDown",
    "ServiceUnavailable",
    "InternalFailure",
    "InternalError",
    "InternalErrorException",
    "InternalServerError",
    "KinesisInternalFailure",
];

/// Codes of refused credentials or permissions.
const REFUSED: &[&str] = &[
    "AccessDenied",
    "AccessDeniedException",
    "AuthorizationError",
    "UnrecognizedClientException",
    "UnrecognizedClient",
    "InvalidClientTokenId",
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidSignatureException",
    "SignatureDoesNotMatch",
    "IncompleteSignature",
    "MissingAuthenticationToken",
    "InvalidAccessKeyId",
    "KMSAccessDeniedException",
    "KMSDisabledException",
    "KMSInvalidStateException",
    "KMSNotFoundException",
    "KMS.AccessDeniedException",
    "KMS.DisabledException",
    "KMS.NotFoundException",
    "KMS.InvalidStateException",
    "KMS.InvalidKeyUsageException",
    "KMS.OptInRequired",
    "KMSAccessDenied",
    "KMSDisabled",
    "KMSNotFound",
    "KMSInvalidState",
    "KMSOptInRequired",
    "KMSInvalidStateException",
];

/// Codes of a permission refused to an identity the service took.
const DENIED: &[&str] = &["AccessDenied", "AccessDeniedException", "AuthorizationError"];

/// Whether `error` is a permission refused to credentials the service took
/// (a health check's read the relay's identity need not have), not
/// credentials it refused.
pub(super) fn only_denied(error: &SinkError) -> bool {
    error.kind == FailureKind::Unauthorized
        && DENIED
            .iter()
            .any(|code| error.message.contains(&format!("({code}")))
}

/// Codes of a queue, topic, stream or bus that does not exist.
const MISSING: &[&str] = &[
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
    "NonExistentQueue",
    "NotFound",
    "NotFoundException",
    "ResourceNotFoundException",
];

/// The relay's kind for an answer `code` of AWS (with HTTP `status` when
/// known): throttling and the service's own faults pause the target,
/// refused credentials or permissions and missing resources wait named,
/// anything else about the message is its own permanent failure.
pub(super) fn kind_of(code: Option<&str>, status: Option<u16>) -> FailureKind {
    match code {
        Some(code) if THROTTLED.contains(&code) => FailureKind::Unavailable,
        Some(code) if REFUSED.contains(&code) => FailureKind::Unauthorized,
        Some(code) if MISSING.contains(&code) => FailureKind::UnknownTopic,
        _ => match status {
            Some(429 | 500..=599) => FailureKind::Unavailable,
            Some(401 | 403) => FailureKind::Unauthorized,
            Some(404) => FailureKind::UnknownTopic,
            Some(408) => FailureKind::TimedOut,
            Some(400..=499) => FailureKind::Refused,
            _ => FailureKind::Unavailable,
        },
    }
}

/// The relay's kind for one entry of a batch call that failed with `code`
/// (`sender_fault`: SQS and SNS say whether the entry was at fault): the
/// service's own faults and throttling pause the target; anything else the
/// entry carried is that event's permanent failure.
pub(super) fn entry_kind(code: &str, sender_fault: Option<bool>) -> FailureKind {
    match kind_of(Some(code), None) {
        FailureKind::Unavailable if THROTTLED.contains(&code) => FailureKind::Unavailable,
        kind @ (FailureKind::Unauthorized | FailureKind::UnknownTopic) => kind,
        _ if sender_fault == Some(false) => FailureKind::Unavailable,
        _ => FailureKind::Refused,
    }
}

/// A failed call about `what`, classified.
pub(super) fn classify<E>(error: &SdkError<E, HttpResponse>, service: &str, what: &str) -> SinkError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match error {
        SdkError::TimeoutError(_) => {
            SinkError::timed_out(format!("{service} did not answer in time ({what})"))
        }
        SdkError::DispatchFailure(failure) => {
            let text = chain(error);
            // No credentials or no region found is the environment's
            // setup, said as such, not an unreachable service.
            if text.contains("credentials") || text.contains("region") || text.contains("identity") {
                return SinkError::new(
                    FailureKind::Unauthorized,
                    format!("{service}: the relay has no usable credentials or region ({what}): {text}"),
                );
            }
            let kind = if failure.is_timeout() {
                FailureKind::TimedOut
            } else {
                FailureKind::Unavailable
            };
            SinkError::new(kind, format!("{service} cannot be reached ({what}): {text}"))
        }
        SdkError::ResponseError(_) => SinkError::unavailable(format!(
            "{service} answered what the client cannot read ({what}): {}",
            chain(error)
        )),
        SdkError::ConstructionFailure(_) => {
            // Signing needs credentials: one the chain cannot find is the
            // environment's fault, never the event's.
            let text = chain(error);
            let kind = if text.contains("credentials") || text.contains("identity") {
                FailureKind::Unauthorized
            } else {
                FailureKind::Refused
            };
            SinkError::new(
                kind,
                format!("{service}: the request cannot be made ({what}): {text}"),
            )
        }
        _ => {
            let status = error.raw_response().map(|r| r.status().as_u16());
            // A body the protocol's parser could not read (a proxy's page,
            // an XML error where JSON was due) may still name the code.
            let body_code = error
                .raw_response()
                .and_then(|r| r.body().bytes())
                .and_then(|body| xml_code(&String::from_utf8_lossy(body)));
            let code = error.code().or(body_code.as_deref());
            let kind = kind_of(code, status);
            let said = match (code, error.message()) {
                (Some(code), Some(message)) => format!("{code}: {message}"),
                (Some(code), None) => code.to_string(),
                (None, _) => format!("HTTP {}", status.unwrap_or_default()),
            };
            let message = match kind {
                FailureKind::Unauthorized => format!(
                    "{service} refused the credentials or the permission for {what} ({said}); the relay's \
                     identity needs the permission the target's page lists"
                ),
                FailureKind::UnknownTopic => format!("{service}: {what} does not exist ({said})"),
                FailureKind::Unavailable => format!("{service} is throttling or unavailable ({said})"),
                _ => format!("{service} refused the request for {what} ({said})"),
            };
            SinkError::new(kind, message)
        }
    }
}

/// The `<Code>` of an XML error body.
fn xml_code(body: &str) -> Option<String> {
    let code = body.split("<Code>").nth(1)?.split("</Code>").next()?;
    (!code.is_empty() && code.len() < 100 && code.chars().all(|c| c.is_ascii_alphanumeric() || c == '.'))
        .then(|| code.to_string())
}

/// An error and its sources on one line (the SDK's top-level message is
/// often only "dispatch failure").
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(next) = source {
        text.push_str(": ");
        text.push_str(&next.to_string());
        source = next.source();
    }
    crate::redact::url(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_xml_error_body_names_its_code() {
        let body = "<ErrorResponse><Errors><Error><Code>SignatureDoesNotMatch</Code><Message>m</Message>";
        assert_eq!(xml_code(body).as_deref(), Some("SignatureDoesNotMatch"));
        assert_eq!(xml_code("<html>502 Bad Gateway</html>"), None);
        assert_eq!(xml_code("<Code><script></Code>"), None);
    }

    #[test]
    fn answers_map_to_the_relays_kinds() {
        for (code, status, kind) in [
            (Some("ThrottlingException"), Some(400), FailureKind::Unavailable),
            (
                Some("ProvisionedThroughputExceededException"),
                Some(400),
                FailureKind::Unavailable,
            ),
            (
                Some("AWS.SimpleQueueService.NonExistentQueue"),
                Some(400),
                FailureKind::UnknownTopic,
            ),
            (
                Some("ResourceNotFoundException"),
                Some(400),
                FailureKind::UnknownTopic,
            ),
            (Some("AccessDenied"), Some(403), FailureKind::Unauthorized),
            (Some("InvalidClientTokenId"), Some(403), FailureKind::Unauthorized),
            (Some("AuthorizationError"), Some(403), FailureKind::Unauthorized),
            (Some("InvalidParameterValue"), Some(400), FailureKind::Refused),
            (None, Some(503), FailureKind::Unavailable),
            (None, Some(429), FailureKind::Unavailable),
            (None, Some(408), FailureKind::TimedOut),
            (None, None, FailureKind::Unavailable),
        ] {
            assert_eq!(kind_of(code, status), kind, "{code:?} {status:?}");
        }
        for (code, fault, kind) in [
            ("MalformedDetail", None, FailureKind::Refused),
            ("InvalidParameterValue", Some(true), FailureKind::Refused),
            ("InternalError", Some(false), FailureKind::Unavailable),
            ("SomethingNew", Some(false), FailureKind::Unavailable),
            (
                "ProvisionedThroughputExceededException",
                None,
                FailureKind::Unavailable,
            ),
            ("KMSAccessDeniedException", None, FailureKind::Unauthorized),
        ] {
            assert_eq!(entry_kind(code, fault), kind, "{code} {fault:?}");
        }
    }
}
