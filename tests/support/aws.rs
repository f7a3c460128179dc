//! moto's server as the AWS services the AWS targets publish to: the one
//! `scripts/services.sh` starts (`SWITCHYARD_MOTO_URL`), or a test's own on
//! a free port, killed and frozen by outage tests. What arrived is read
//! through each service's own API, as a consumer would: SQS by receiving
//! (FIFO queues group by group, in order), SNS and EventBridge through an
//! SQS queue subscribed or targeted, Kinesis by `GetRecords` over every
//! shard. Each message comes back NATS-shaped ([`Received`]), its headers
//! read the way the book tells a consumer to, so the orders checks apply.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_credential_types::Credentials;
use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};

use super::config::Target;
use super::nats::Received;

/// The region and keys every test uses (moto takes any unless told to check).
pub const REGION: &str = "us-east-1";
/// The access key id moto is given.
pub const ACCESS_KEY_ID: &str = "testing-key-id";
/// Its secret.
pub const SECRET_ACCESS_KEY: &str = "testing-secret";

/// A moto server.
pub struct Moto {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    own: Option<Own>,
}

struct Own {
    port: u16,
    child: Option<Child>,
    env: Vec<(String, String)>,
}

fn moto_binary() -> String {
    std::env::var("SWITCHYARD_MOTO_SERVER").unwrap_or_else(|_| "moto_server".to_string())
}

impl Moto {
    /// The server `scripts/services.sh` started.
    pub fn shared() -> Moto {
        Moto {
            url: std::env::var("SWITCHYARD_MOTO_URL").unwrap_or_else(|_| "http://127.0.0.1:55500".into()),
            own: None,
        }
    }

    /// The server at `url` (`http://HOST:PORT`), started by someone else.
    pub fn at(url: &str) -> Moto {
        Moto {
            url: url.to_string(),
            own: None,
        }
    }

    /// A server of the test's own, started with `env` (moto's settings).
    ///
    /// # Panics
    /// When it does not start.
    pub async fn own_with(env: &[(&str, &str)]) -> Moto {
        let port = super::free_port();
        let mut moto = Moto {
            url: format!("http://127.0.0.1:{port}"),
            own: Some(Own {
                port,
                child: None,
                env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            }),
        };
        moto.start().await;
        moto
    }

    /// A server of the test's own.
    pub async fn own() -> Moto {
        Moto::own_with(&[]).await
    }

    /// Starts (again) this test's server: empty, as moto keeps nothing.
    ///
    /// # Panics
    /// On the shared server, or when it does not come up.
    pub async fn start(&mut self) {
        let own = self.own.as_mut().expect("only a test's own moto is started");
        let child = Command::new(moto_binary())
            .args(["-H", "127.0.0.1", "-p", &own.port.to_string()])
            .envs(own.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run moto_server ({e}); run scripts/services.sh start to install it")
            });
        own.child = Some(child);
        let started = Instant::now();
        loop {
            if let Some(answer) = super::try_http_get(([127, 0, 0, 1], own.port).into(), "/moto-api/").await
                && answer.0 < 500
            {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "moto on port {} did not start",
                own.port
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills this test's server (what it held is gone).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.own.as_mut().and_then(|own| own.child.take()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn signal(&self, signal: &str) {
        let pid = self
            .own
            .as_ref()
            .and_then(|own| own.child.as_ref())
            .expect("a running moto of the test's own")
            .id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal}");
    }

    /// SIGSTOP: connections are taken, nothing answers.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT.
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    /// The SDK's config for a consumer of this server.
    pub async fn sdk(&self) -> SdkConfig {
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        aws_config::defaults(BehaviorVersion::latest())
            .http_client(http)
            .region(Region::new(REGION))
            .endpoint_url(&self.url)
            .credentials_provider(Credentials::new(
                ACCESS_KEY_ID,
                SECRET_ACCESS_KEY,
                None,
                None,
                "test",
            ))
            .load()
            .await
    }

    /// A target of `kind` (`sqs`, `sns`, `eventbridge`, `kinesis`) on this
    /// server, with the test's keys.
    pub fn target(&self, kind: &str) -> Target {
        Target::of(kind)
            .set("region", REGION)
            .set("endpoint_url", self.url.as_str())
            .set("sts_endpoint_url", self.url.as_str())
            .set("access_key_id", ACCESS_KEY_ID)
            .set("secret_access_key", SECRET_ACCESS_KEY)
    }

    /// Makes queue `name` (FIFO when it ends `.fifo`) and returns its URL.
    pub async fn queue(&self, name: &str) -> String {
        let sqs = aws_sdk_sqs::Client::new(&self.sdk().await);
        let mut request = sqs.create_queue().queue_name(name);
        if name.ends_with(".fifo") {
            request = request.attributes(QueueAttributeName::FifoQueue, "true");
        }
        request
            .send()
            .await
            .expect("create queue")
            .queue_url()
            .unwrap_or_default()
            .to_string()
    }

    async fn queue_arn(&self, url: &str) -> String {
        let sqs = aws_sdk_sqs::Client::new(&self.sdk().await);
        let answer = sqs
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::QueueArn)
            .send()
            .await
            .expect("queue attributes");
        answer
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::QueueArn))
            .cloned()
            .expect("a queue ARN")
    }

    /// Makes topic `name` (FIFO when it ends `.fifo`) with queue `queue`
    /// subscribed to it (raw delivery: the message and its attributes as
    /// published); returns the topic's ARN and the queue's URL.
    pub async fn topic_into_queue(&self, name: &str, queue: &str) -> (String, String) {
        let sdk = self.sdk().await;
        let sns = aws_sdk_sns::Client::new(&sdk);
        let mut request = sns.create_topic().name(name);
        if name.ends_with(".fifo") {
            request = request.attributes("FifoTopic", "true");
        }
        let arn = request
            .send()
            .await
            .expect("create topic")
            .topic_arn()
            .unwrap_or_default()
            .to_string();
        let url = self.queue(queue).await;
        let queue_arn = self.queue_arn(&url).await;
        sns.subscribe()
            .topic_arn(&arn)
            .protocol("sqs")
            .endpoint(queue_arn)
            .attributes("RawMessageDelivery", "true")
            .send()
            .await
            .expect("subscribe");
        (arn, url)
    }

    /// Makes bus `name` with a rule sending every event of it to queue
    /// `queue`; returns the queue's URL.
    pub async fn bus_into_queue(&self, name: &str, queue: &str) -> String {
        let sdk = self.sdk().await;
        let events = aws_sdk_eventbridge::Client::new(&sdk);
        events
            .create_event_bus()
            .name(name)
            .send()
            .await
            .expect("create bus");
        let url = self.queue(queue).await;
        let queue_arn = self.queue_arn(&url).await;
        events
            .put_rule()
            .name(format!("{name}-all"))
            .event_bus_name(name)
            .event_pattern(r#"{"account": [{"exists": true}]}"#)
            .send()
            .await
            .expect("put rule");
        events
            .put_targets()
            .rule(format!("{name}-all"))
            .event_bus_name(name)
            .targets(
                aws_sdk_eventbridge::types::Target::builder()
                    .id("queue")
                    .arn(queue_arn)
                    .build()
                    .expect("a rule target"),
            )
            .send()
            .await
            .expect("put targets");
        url
    }

    /// Makes stream `name` with `shards` shards.
    pub async fn stream(&self, name: &str, shards: i32) {
        let kinesis = aws_sdk_kinesis::Client::new(&self.sdk().await);
        kinesis
            .create_stream()
            .stream_name(name)
            .shard_count(shards)
            .send()
            .await
            .expect("create stream");
    }

    /// Receives from queue `url` until `expected` messages came or `limit`
    /// passed, deleting each as a consumer does (a FIFO queue then gives
    /// each group's next message). Headers are read from the attributes,
    /// or from `Switchyard-Headers` when they travel together.
    pub async fn receive(&self, url: &str, expected: usize, limit: Duration) -> Vec<Received> {
        let sqs = aws_sdk_sqs::Client::new(&self.sdk().await);
        let mut received = Vec::new();
        let until = Instant::now() + limit;
        while received.len() < expected && Instant::now() < until {
            let answer = sqs
                .receive_message()
                .queue_url(url)
                .max_number_of_messages(10)
                .wait_time_seconds(1)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                .send()
                .await;
            let Ok(answer) = answer else {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            };
            for message in answer.messages() {
                let mut headers: HashMap<String, String> = message
                    .message_attributes()
                    .map(|attributes| {
                        attributes
                            .iter()
                            .filter_map(|(name, value)| {
                                Some((name.clone(), value.string_value()?.to_string()))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                unpack_headers(&mut headers);
                if let Some(group) = message
                    .attributes()
                    .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
                {
                    headers.insert("x-message-group".into(), group.clone());
                }
                received.push(Received {
                    subject: url.rsplit('/').next().unwrap_or_default().to_string(),
                    headers,
                    payload: message.body().unwrap_or_default().as_bytes().to_vec(),
                });
                if let Some(handle) = message.receipt_handle() {
                    let _ = sqs
                        .delete_message()
                        .queue_url(url)
                        .receipt_handle(handle)
                        .send()
                        .await;
                }
            }
        }
        received
    }

    /// A consumer receiving from queue `url` in the background (and
    /// deleting, so a FIFO queue gives each group's next message) until it
    /// is dropped; through an outage it keeps asking.
    pub fn drain(&self, url: &str) -> Draining {
        let moto = Moto {
            url: self.url.clone(),
            own: None,
        };
        let url = url.to_string();
        let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let into = std::sync::Arc::clone(&received);
        let task = tokio::spawn(async move {
            loop {
                let got = moto.receive(&url, 1_000_000, Duration::from_secs(2)).await;
                into.lock().unwrap().extend(got);
            }
        });
        Draining { task, received }
    }

    /// Every record of stream `name`, shard by shard (each shard's in
    /// sequence order), until `expected` came or `limit` passed. An
    /// envelope's headers are the message's headers, its payload the
    /// payload.
    pub async fn records(&self, name: &str, expected: usize, limit: Duration) -> Vec<Received> {
        let kinesis = aws_sdk_kinesis::Client::new(&self.sdk().await);
        let until = Instant::now() + limit;
        loop {
            let mut received = Vec::new();
            let shards = kinesis
                .list_shards()
                .stream_name(name)
                .send()
                .await
                .expect("list shards");
            for shard in shards.shards() {
                let mut iterator = kinesis
                    .get_shard_iterator()
                    .stream_name(name)
                    .shard_id(shard.shard_id())
                    .shard_iterator_type(aws_sdk_kinesis::types::ShardIteratorType::TrimHorizon)
                    .send()
                    .await
                    .expect("shard iterator")
                    .shard_iterator()
                    .map(ToString::to_string);
                while let Some(current) = iterator.take() {
                    let page = kinesis
                        .get_records()
                        .shard_iterator(current)
                        .limit(1000)
                        .send()
                        .await
                        .expect("get records");
                    let empty = page.records().is_empty();
                    for record in page.records() {
                        received.push(from_envelope(
                            name,
                            record.data().as_ref(),
                            record.partition_key().unwrap_or_default(),
                        ));
                    }
                    if !empty {
                        iterator = page.next_shard_iterator().map(ToString::to_string);
                    }
                }
            }
            if received.len() >= expected || Instant::now() >= until {
                return received;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

/// A consumer of a queue, receiving in the background.
pub struct Draining {
    task: tokio::task::JoinHandle<()>,
    received: std::sync::Arc<std::sync::Mutex<Vec<Received>>>,
}

impl Draining {
    /// What it received so far, copies included; it goes on receiving.
    pub fn so_far(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// What it received, once that is `expected` messages or `limit` passed.
    pub async fn wait(self, expected: usize, limit: Duration) -> Vec<Received> {
        let until = Instant::now() + limit;
        while self.received.lock().unwrap().len() < expected && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.task.abort();
        self.received.lock().unwrap().clone()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        if let Some(own) = self.own.as_ref()
            && let Some(child) = own.child.as_ref()
        {
            // A frozen server does not die of SIGKILL's delivery until woken.
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
        self.kill();
    }
}

/// Headers that travelled together (`Switchyard-Headers`, more than ten or
/// with names SQS and SNS refuse) read back one by one.
fn unpack_headers(headers: &mut HashMap<String, String>) {
    if let Some(packed) = headers.remove("Switchyard-Headers")
        && let Ok(serde_json::Value::Object(all)) = serde_json::from_str(&packed)
    {
        for (name, value) in all {
            if let serde_json::Value::String(value) = value {
                headers.insert(name, value);
            }
        }
    }
}

/// A Kinesis record as a message: an envelope's headers and payload, or
/// the record's bytes alone; the partition key as `x-partition-key`.
fn from_envelope(stream: &str, data: &[u8], partition_key: &str) -> Received {
    let mut headers = HashMap::from([("x-partition-key".to_string(), partition_key.to_string())]);
    let mut payload = data.to_vec();
    if let Ok(serde_json::Value::Object(envelope)) = serde_json::from_slice::<serde_json::Value>(data)
        && let Some(serde_json::Value::Object(carried)) = envelope.get("headers")
    {
        for (name, value) in carried {
            if let serde_json::Value::String(value) = value {
                headers.insert(name.clone(), value.clone());
            }
        }
        payload = match envelope.get("payload") {
            Some(serde_json::Value::String(text)) if envelope.get("payload_base64").is_some() => {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD
                    .decode(text)
                    .unwrap_or_default()
            }
            Some(json) => json.to_string().into_bytes(),
            None => Vec::new(),
        };
    }
    Received {
        subject: stream.to_string(),
        headers,
        payload,
    }
}

/// An EventBridge event delivered to a queue, as a message: its `detail`
/// is the payload, the member holding the relay's headers its headers,
/// `source` and `detail-type` as `x-source` and `x-detail-type`.
pub fn from_event(message: &Received, metadata_member: &str) -> Received {
    let event: serde_json::Value = serde_json::from_slice(&message.payload).unwrap_or_default();
    let mut detail = event.get("detail").cloned().unwrap_or_default();
    let mut headers = HashMap::new();
    if let Some(serde_json::Value::Object(carried)) =
        detail.as_object_mut().and_then(|d| d.remove(metadata_member))
    {
        for (name, value) in carried {
            if let serde_json::Value::String(value) = value {
                headers.insert(name, value);
            }
        }
    }
    for (field, header) in [("source", "x-source"), ("detail-type", "x-detail-type")] {
        if let Some(value) = event.get(field).and_then(|v| v.as_str()) {
            headers.insert(header.into(), value.into());
        }
    }
    Received {
        subject: message.subject.clone(),
        headers,
        payload: detail.to_string().into_bytes(),
    }
}

/// A call of an AWS query API (`service` is `iam`, `sqs`...) on `moto`,
/// its `form` POSTed, signed with `key` (id, secret), or with anything
/// before moto checks signatures: what
/// the services' own SDKs do, for the calls whose crates the tests do not
/// build (IAM). Returns the body, failing on an error answer.
///
/// # Panics
/// When the call fails or is refused.
pub async fn query_call(
    moto: &Moto,
    service: &str,
    key: Option<(&str, &str)>,
    form: &[(&str, &str)],
) -> String {
    use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
    use http_body_util::BodyExt as _;
    let body: String = form
        .iter()
        .map(|(k, v)| format!("{}={}", urlencode(k), urlencode(v)))
        .collect::<Vec<_>>()
        .join("&");
    let uri = format!("{}/", moto.url);
    let mut request = hyper::Request::post(&uri)
        .header("content-type", "application/x-www-form-urlencoded")
        .header("host", moto.url.trim_start_matches("http://"))
        .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())))
        .expect("a request");
    // moto tells the services apart by the signature's scope: a call
    // before it checks signatures is signed with anything.
    {
        let (id, secret) = key.unwrap_or(("unchecked", "unchecked"));
        let identity = Credentials::new(id, secret, None, None, "test").into();
        let params = aws_sigv4::sign::v4::SigningParams::builder()
            .identity(&identity)
            .region(REGION)
            .name(service)
            .time(std::time::SystemTime::now())
            .settings(SigningSettings::default())
            .build()
            .expect("signing params")
            .into();
        let headers: Vec<(String, String)> = request
            .headers()
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or_default().to_string()))
            .collect();
        let signable = SignableRequest::new(
            "POST",
            &uri,
            headers.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            SignableBody::Bytes(body.as_bytes()),
        )
        .expect("signable");
        let (instructions, _) = sign(signable, &params).expect("signed").into_parts();
        instructions.apply_to_request_http1x(&mut request);
    }
    let client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let answer = client.request(request).await.expect("moto answers");
    let status = answer.status();
    let text =
        String::from_utf8_lossy(&answer.into_body().collect().await.expect("a body").to_bytes()).to_string();
    assert!(status.is_success(), "{service} {form:?}: {status} {text}");
    text
}

fn urlencode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A name of this test's own for a queue, topic, bus or stream.
pub fn unique(what: &str) -> String {
    format!("{what}-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}
