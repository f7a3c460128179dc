//! Publishing to HTTP endpoints through reqwest on rustls: one request per
//! event (or per batch of events), at most `concurrency` at once and one
//! per aggregate, each signed, its answer classified.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use futures::future::{BoxFuture, join_all};
use tokio::sync::Semaphore;

use super::config::{BatchFormat, HttpMethod, HttpSinkConfig, reqwest_header_name_problem};
use super::signing::Signer;
use crate::secret::Held;
use crate::sinks::headers::{AGGREGATE_ID_HEADER, AGGREGATE_TYPE_HEADER, EVENT_ID_HEADER, EVENT_TYPE_HEADER};
use crate::sinks::order::{envelope, in_order};
use crate::sinks::{FailureKind, OutgoingMessage, Sink, SinkError};

/// Bytes of an answer kept in a dead letter.
const BODY_KEPT: usize = 256;
/// Bytes of an answer read to mask it as JSON before it is cut.
const BODY_READ: usize = 64 * 1024;
/// The longest `Retry-After` honoured: a longer one is taken as this.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);
/// Headers the relay sets itself: a message's own of these names are not sent.
const OWN_HEADERS: &[&str] = &[
    "authorization",
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
];

/// HTTP endpoints as a target.
pub struct HttpSink {
    name: String,
    config: Arc<HttpSinkConfig>,
    client: reqwest::Client,
    signer: Signer,
    bearer: Option<Held>,
    password: Option<Held>,
    in_flight: Semaphore,
    /// Until when the endpoint asked the relay to wait (`Retry-After`).
    not_before: std::sync::Mutex<Option<Instant>>,
    /// `[admin] mask_fields`: hidden in a quoted JSON answer.
    masks: Vec<String>,
}

/// One request: where, what, and for which messages.
struct Request {
    address: String,
    id: String,
    content_type: String,
    headers: Vec<(String, String)>,
    body: Bytes,
}

impl HttpSink {
    /// A sink for `config`; a request takes at most `timeout`.
    ///
    /// # Errors
    /// TLS files that cannot be read or used, named: they will not mend by
    /// waiting.
    pub fn new(
        name: &str,
        config: &HttpSinkConfig,
        timeout: Duration,
        masks: &[String],
    ) -> Result<HttpSink, SinkError> {
        crate::tls::install_provider();
        let config = Arc::new(config.clone());
        let allowed = Arc::clone(&config);
        let redirect = if config.follow_redirects {
            reqwest::redirect::Policy::custom(move |attempt| {
                if attempt.previous().len() < 5 && allowed.allows(attempt.url()) {
                    attempt.follow()
                } else {
                    attempt.stop()
                }
            })
        } else {
            reqwest::redirect::Policy::none()
        };
        let mut builder = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .redirect(redirect)
            .pool_max_idle_per_host(config.concurrency)
            .user_agent(concat!("switchyard/", env!("CARGO_PKG_VERSION")));
        let unusable = |what: &str, e: &dyn std::fmt::Display| {
            SinkError::permanent(format!("target {name:?}: tls.{what} cannot be used: {e}"))
        };
        if let Some(path) = &config.tls.root_cert {
            let pem = std::fs::read(path).map_err(|e| unusable("root_cert", &e))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| unusable("root_cert", &e))?;
            builder = builder.tls_certs_only(certs);
        }
        if let (Some(cert), Some(key)) = (&config.tls.client_cert, &config.tls.client_key) {
            let mut pem = std::fs::read(cert).map_err(|e| unusable("client_cert", &e))?;
            pem.extend(std::fs::read(key).map_err(|e| unusable("client_key", &e))?);
            builder =
                builder.identity(reqwest::Identity::from_pem(&pem).map_err(|e| unusable("client_cert", &e))?);
        }
        let client = builder.build().map_err(|e| {
            SinkError::permanent(format!("target {name:?}: the HTTP client cannot be built: {e}"))
        })?;
        Ok(HttpSink {
            name: name.to_string(),
            signer: Signer::new(&config.signing_secrets),
            bearer: config.bearer_token.clone().map(Held::new),
            password: config.password.clone().map(Held::new),
            in_flight: Semaphore::new(config.concurrency.max(1)),
            not_before: std::sync::Mutex::new(None),
            masks: masks.to_vec(),
            client,
            config,
        })
    }

    /// The time left of a `Retry-After`, if one is running.
    fn waiting(&self) -> Option<Duration> {
        let until = (*self
            .not_before
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))?;
        until.checked_duration_since(Instant::now())
    }

    fn wait_until(&self, after: Duration) {
        let until = Instant::now() + after.min(MAX_RETRY_AFTER);
        let mut not_before = self
            .not_before
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if not_before.is_none_or(|current| current < until) {
            *not_before = Some(until);
        }
    }

    /// One event's request.
    fn single(&self, message: &OutgoingMessage) -> Result<Request, SinkError> {
        let address = self.config.address(&message.topic)?;
        let content_type = header(message, "content-type").map_or_else(
            || {
                if serde_json::from_slice::<serde::de::IgnoredAny>(&message.payload).is_ok() {
                    "application/json".to_string()
                } else {
                    "application/octet-stream".to_string()
                }
            },
            ToString::to_string,
        );
        let mut headers: Vec<(String, String)> = message
            .headers
            .iter()
            .filter(|(name, _)| !OWN_HEADERS.contains(&name.to_ascii_lowercase().as_str()))
            .cloned()
            .collect();
        if let Some(key) = &message.key {
            headers.push((crate::sinks::KEY_HEADER.to_string(), key.clone()));
        }
        if let Some((name, _)) = headers.iter().find(|(name, _)| reqwest_header_name_problem(name)) {
            return Err(SinkError::permanent(format!(
                "header {:?} is not an HTTP header name: the plugin or the row must name it otherwise",
                name.chars().take(64).collect::<String>()
            )));
        }
        Ok(Request {
            address,
            id: message.event_id.clone(),
            content_type,
            headers,
            body: message.payload.clone(),
        })
    }

    /// One request for `messages`, all to `address`, as a JSON array or a
    /// CloudEvents batch.
    fn batch(&self, address: &str, messages: &[&OutgoingMessage]) -> Request {
        let (items, content_type): (Vec<serde_json::Value>, &str) = match self.config.batch {
            BatchFormat::Cloudevents => (
                messages.iter().map(|m| cloudevent(m)).collect(),
                "application/cloudevents-batch+json",
            ),
            _ => (messages.iter().map(|m| envelope(m)).collect(), "application/json"),
        };
        use sha2::Digest as _;
        let mut digest = sha2::Sha256::new();
        for message in messages {
            digest.update(message.dedup_id.as_bytes());
            digest.update(b"\n");
        }
        Request {
            address: address.to_string(),
            // The same events give the same id, so a receiver may drop a
            // batch sent again.
            id: format!("batch_{:x}", digest.finalize())[..38].to_string(),
            content_type: content_type.to_string(),
            headers: Vec::new(),
            body: Bytes::from(serde_json::Value::Array(items).to_string()),
        }
    }

    /// Sends `request` and classifies the answer.
    async fn send(&self, request: Request) -> Result<(), SinkError> {
        if let Some(left) = self.waiting() {
            return Err(SinkError::unavailable(format!(
                "the endpoint asked to wait (Retry-After); {} s left",
                left.as_secs() + 1
            )));
        }
        let _permit = self
            .in_flight
            .acquire()
            .await
            .map_err(|_| SinkError::unavailable("the target is closing"))?;
        let method = match self.config.method {
            HttpMethod::Post => reqwest::Method::POST,
            HttpMethod::Put => reqwest::Method::PUT,
        };
        let mut builder = self
            .client
            .request(method, &request.address)
            .header(reqwest::header::CONTENT_TYPE, &request.content_type);
        for (name, value) in self
            .config
            .headers
            .iter()
            .chain(request.headers.iter().map(|(name, value)| (name, value)))
        {
            builder = builder.header(name.as_str(), value.as_str());
        }
        if self.signer.signs() {
            let timestamp = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
            let signature = self
                .signer
                .signature(&request.id, timestamp, &request.body)
                .await
                .map_err(|e| SinkError::new(FailureKind::Unauthorized, e))?;
            builder = builder
                .header("webhook-id", &request.id)
                .header("webhook-timestamp", timestamp.to_string())
                .header("webhook-signature", signature);
        } else {
            builder = builder.header("webhook-id", &request.id);
        }
        builder = self.authorize(builder).await?;
        let answer = builder.body(request.body).send().await;
        match answer {
            Ok(response) => self.judge(response, &request.address).await,
            Err(error) => Err(transport(&error, &request.address)),
        }
    }

    async fn authorize(
        &self,
        builder: reqwest::RequestBuilder,
    ) -> Result<reqwest::RequestBuilder, SinkError> {
        let unreadable = |what: &str, e: crate::secret::Error| {
            SinkError::new(
                FailureKind::Unauthorized,
                format!("the target's {what} cannot be read: {e}"),
            )
        };
        if let Some(token) = &self.bearer {
            let token = token.get().await.map_err(|e| unreadable("bearer_token", e))?;
            return Ok(builder.bearer_auth(token.expose()));
        }
        if let (Some(user), Some(password)) = (&self.config.user, &self.password) {
            let password = password.get().await.map_err(|e| unreadable("password", e))?;
            return Ok(builder.basic_auth(user, Some(password.expose())));
        }
        if let Some(user) = &self.config.user {
            return Ok(builder.basic_auth(user, None::<&str>));
        }
        Ok(builder)
    }

    /// What an answer means: 2xx delivered; 408, 429 and 5xx the endpoint
    /// unavailable for now (its `Retry-After` kept); 401 and 403 refused
    /// credentials; 410 an endpoint removed; a redirect not followed; any
    /// other 4xx the event's own permanent failure, with its status and the
    /// first bytes of the answer.
    async fn judge(&self, response: reqwest::Response, address: &str) -> Result<(), SinkError> {
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let shown = crate::redact::url(address);
        let code = status.as_u16();
        if matches!(code, 408 | 429) || status.is_server_error() {
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(retry_after);
            if let Some(after) = retry_after {
                self.wait_until(after);
            }
            return Err(SinkError::unavailable(format!(
                "{shown} answered {status}{}",
                retry_after
                    .map(|a| format!(", Retry-After {} s", a.as_secs()))
                    .unwrap_or_default()
            )));
        }
        if status.is_redirection() {
            let location = response
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .map(crate::redact::url)
                .unwrap_or_default();
            return Err(SinkError::new(
                FailureKind::UnknownTopic,
                format!(
                    "{shown} answered {status} to {location:?}: redirects are followed only to addresses the \
                     target names (follow_redirects): move base_url or the endpoint there"
                ),
            ));
        }
        let body = first_bytes(response, &self.masks).await;
        match code {
            401 | 403 => Err(SinkError::new(
                FailureKind::Unauthorized,
                format!("{shown} refused the credentials ({status}): {body}"),
            )),
            410 => Err(SinkError::new(
                FailureKind::UnknownTopic,
                format!(
                    "{shown} answered 410 Gone: the receiver removed this endpoint; the events wait until the target's address changes or the endpoint answers again: {body}"
                ),
            )),
            _ => Err(SinkError::permanent(format!(
                "{shown} refused the event with {status}: {body}"
            ))),
        }
    }
}

/// A request that got no answer, classified.
fn transport(error: &reqwest::Error, address: &str) -> SinkError {
    let shown = crate::redact::url(address);
    // The error's text names the URL: masked as every URL in a message is.
    let said = crate::redact::url(&error.to_string());
    let mut source = std::error::Error::source(error);
    let mut chain = said;
    while let Some(next) = source {
        chain.push_str(": ");
        chain.push_str(&crate::redact::url(&next.to_string()));
        source = next.source();
    }
    if error.is_timeout() {
        SinkError::timed_out(format!("{shown} did not answer in time: {chain}"))
    } else if error.is_builder() {
        SinkError::permanent(format!("the request to {shown} cannot be made: {chain}"))
    } else {
        // Refused, reset or cut mid-request: the endpoint's state, never
        // the event's.
        SinkError::unavailable(format!("{shown} cannot be reached: {chain}"))
    }
}

/// `Retry-After` as seconds or an HTTP date.
fn retry_after(value: &str) -> Option<Duration> {
    if let Ok(seconds) = value.trim().parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let date = chrono::DateTime::parse_from_rfc2822(value.trim()).ok()?;
    let seconds = (date.timestamp() - chrono::Utc::now().timestamp()).max(0);
    Some(Duration::from_secs(u64::try_from(seconds).unwrap_or(0)))
}

/// The first bytes of an answer's body, on one line. A JSON answer (a
/// receiver's refusal often quotes the event) has the fields of
/// `[admin] mask_fields` hidden, as the console hides them in payloads; one
/// that cannot be read whole to mask it is not quoted.
async fn first_bytes(mut response: reqwest::Response, masks: &[String]) -> String {
    let json = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().contains("json"));
    let wanted = if masks.is_empty() {
        BODY_KEPT + 1
    } else {
        BODY_READ + 1
    };
    let mut body = Vec::new();
    while body.len() < wanted {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    quoted(&body, json, masks)
}

/// What a dead letter quotes of `body`: masked when it is JSON, cut to
/// [`BODY_KEPT`] bytes, control characters as spaces.
fn quoted(body: &[u8], json: bool, masks: &[String]) -> String {
    let looks_json = json || matches!(body.trim_ascii_start().first(), Some(b'{' | b'['));
    let masked;
    let body = if masks.is_empty() || !looks_json {
        body
    } else {
        match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(mut value) => {
                crate::mask::mask(&mut value, masks);
                masked = value.to_string().into_bytes();
                &masked
            }
            Err(_) => {
                return format!(
                    "({}{} bytes of JSON that cannot be read whole to hide mask_fields: not shown)",
                    if body.len() > BODY_READ { "over " } else { "" },
                    body.len().min(BODY_READ)
                );
            }
        }
    };
    let cut = body.len() > BODY_KEPT;
    let text: String = String::from_utf8_lossy(&body[..body.len().min(BODY_KEPT)])
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if text.trim().is_empty() {
        "(no body)".to_string()
    } else if cut {
        format!("{}...", text.trim())
    } else {
        text.trim().to_string()
    }
}

fn header<'m>(message: &'m OutgoingMessage, name: &str) -> Option<&'m str> {
    message
        .headers
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case(name))
        .map(|(_, value)| value.as_str())
}

/// A message as a CloudEvent in JSON: the event id, its type and
/// aggregate, the payload as `data` (or `data_base64`), and
/// `traceparent`.
fn cloudevent(message: &OutgoingMessage) -> serde_json::Value {
    let mut event = serde_json::json!({
        "specversion": "1.0",
        "id": header(message, EVENT_ID_HEADER).unwrap_or(&message.event_id),
        "source": format!("switchyard/{}", header(message, AGGREGATE_TYPE_HEADER).unwrap_or_default()),
        "type": header(message, EVENT_TYPE_HEADER).unwrap_or_default(),
        "subject": header(message, AGGREGATE_ID_HEADER).unwrap_or_default(),
    });
    match serde_json::from_slice::<serde_json::Value>(&message.payload) {
        Ok(data) => {
            event["datacontenttype"] = "application/json".into();
            event["data"] = data;
        }
        Err(_) => {
            use base64::Engine as _;
            event["data_base64"] = base64::engine::general_purpose::STANDARD
                .encode(&message.payload)
                .into();
        }
    }
    if let Some(traceparent) = header(message, "traceparent") {
        event["traceparent"] = traceparent.into();
    }
    event
}

impl Sink for HttpSink {
    fn kind(&self) -> &'static str {
        "http"
    }

    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let mut results: Vec<Result<(), SinkError>> = (0..messages.len()).map(|_| Ok(())).collect();
            // An aggregate's messages go one round after another: one request
            // in flight per aggregate, in order.
            let keyed = messages
                .iter()
                .enumerate()
                .map(|(index, m)| {
                    (
                        index,
                        header(m, AGGREGATE_ID_HEADER).unwrap_or_default().to_string(),
                        m,
                    )
                })
                .collect();
            let answered = in_order(keyed, |round: Vec<(usize, &OutgoingMessage)>| async move {
                if self.config.batch == BatchFormat::None {
                    let sends = round.into_iter().map(|(index, message)| async move {
                        let result = match self.single(message) {
                            Ok(request) => self.send(request).await,
                            Err(e) => Err(e),
                        };
                        (index, result)
                    });
                    return join_all(sends).await;
                }
                // Batches per address, each request answering for all of its events.
                let mut by_address: Vec<(String, Vec<(usize, &OutgoingMessage)>)> = Vec::new();
                let mut refused = Vec::new();
                for (index, message) in round {
                    match self.config.address(&message.topic) {
                        Ok(address) => match by_address.iter_mut().find(|(a, _)| *a == address) {
                            Some((_, list)) => list.push((index, message)),
                            None => by_address.push((address, vec![(index, message)])),
                        },
                        Err(e) => refused.push((index, Err(e))),
                    }
                }
                let sends = by_address.into_iter().flat_map(|(address, list)| {
                    list.chunks(self.config.max_batch.max(1))
                        .map(|chunk| {
                            let indexes: Vec<usize> = chunk.iter().map(|(i, _)| *i).collect();
                            let messages: Vec<&OutgoingMessage> = chunk.iter().map(|(_, m)| *m).collect();
                            (indexes, self.batch(&address, &messages))
                        })
                        .collect::<Vec<_>>()
                });
                let answers = join_all(
                    sends.map(|(indexes, request)| async move { (indexes, self.send(request).await) }),
                )
                .await;
                for (indexes, result) in answers {
                    refused.extend(indexes.into_iter().map(|index| (index, result.clone())));
                }
                refused
            })
            .await;
            for (index, result) in answered {
                results[index] = result;
            }
            results
        })
    }

    /// Not within a `Retry-After`, and the first address answers a `HEAD`
    /// with anything but 408, 429 or 5xx (a receiver may refuse `HEAD`: it
    /// answered), whose `Retry-After` is kept as a request's is.
    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async move {
            if let Some(left) = self.waiting() {
                return Err(SinkError::unavailable(format!(
                    "the endpoint asked to wait (Retry-After); {} s left",
                    left.as_secs() + 1
                )));
            }
            let Some(address) = self
                .config
                .base_url
                .clone()
                .or_else(|| self.config.endpoints.values().next().cloned())
            else {
                return Ok(());
            };
            let request = self.authorize(self.client.head(&address)).await?;
            match request.send().await {
                Ok(response) => {
                    let code = response.status().as_u16();
                    if matches!(code, 408 | 429) || response.status().is_server_error() {
                        if let Some(after) = response
                            .headers()
                            .get(reqwest::header::RETRY_AFTER)
                            .and_then(|v| v.to_str().ok())
                            .and_then(retry_after)
                        {
                            self.wait_until(after);
                        }
                        Err(SinkError::unavailable(format!(
                            "{} answered {}",
                            crate::redact::url(&address),
                            response.status()
                        )))
                    } else {
                        tracing::trace!(sink.name = %self.name, status = code, "HTTP health check answered.");
                        Ok(())
                    }
                }
                Err(error) => Err(transport(&error, &address)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_seconds_or_a_date() {
        assert_eq!(retry_after("5"), Some(Duration::from_secs(5)));
        let later = (chrono::Utc::now() + chrono::Duration::seconds(30)).to_rfc2822();
        let after = retry_after(&later).unwrap();
        assert!((28..=30).contains(&after.as_secs()), "{after:?}");
        assert_eq!(retry_after("soon"), None);
    }

    #[test]
    fn a_quoted_json_answer_hides_the_masked_fields_and_one_unreadable_is_not_quoted() {
        let masks = vec!["card.number".to_string(), "ssn".to_string()];
        let answer =
            br#"{"error":"invalid","card":{"number":"4111111111111111"},"rows":[{"ssn":"078-05-1120"}]}"#;
        let quoted_answer = quoted(answer, true, &masks);
        assert!(
            !quoted_answer.contains("4111") && !quoted_answer.contains("078-05"),
            "{quoted_answer}"
        );
        assert!(quoted_answer.contains(r#""error":"invalid""#), "{quoted_answer}");
        // Cut JSON cannot be masked: not quoted at all, whatever its type says.
        let cut = quoted(&answer[..40], false, &masks);
        assert!(cut.contains("not shown") && !cut.contains("4111"), "{cut}");
        // Text is quoted as it is, cut; without masks JSON is too.
        let text = "no\nsuch order ".repeat(40);
        let quoted_text = quoted(text.as_bytes(), false, &masks);
        assert!(quoted_text.starts_with("no such order") && quoted_text.ends_with("..."));
        assert!(quoted_text.len() <= BODY_KEPT + 3);
        assert!(quoted(answer, true, &[]).contains("4111"));
        assert_eq!(quoted(b"  ", false, &masks), "(no body)");
    }

    #[test]
    fn a_cloudevent_carries_the_event_id_type_and_payload() {
        let message = OutgoingMessage {
            event_id: "e-1".into(),
            payload: Bytes::from_static(b"{\"a\":1}"),
            headers: vec![
                (EVENT_ID_HEADER.into(), "e-1".into()),
                (EVENT_TYPE_HEADER.into(), "OrderPlaced".into()),
                (AGGREGATE_TYPE_HEADER.into(), "order".into()),
                (AGGREGATE_ID_HEADER.into(), "o-1".into()),
            ],
            ..OutgoingMessage::default()
        };
        let event = cloudevent(&message);
        assert_eq!(
            (
                event["id"].as_str(),
                event["type"].as_str(),
                event["subject"].as_str()
            ),
            (Some("e-1"), Some("OrderPlaced"), Some("o-1"))
        );
        assert_eq!(event["data"]["a"], 1);
    }
}
