//! The Google Cloud Pub/Sub emulator in tests: the shared one
//! `scripts/services.sh` starts (each test makes topics and subscriptions
//! of its own), or one of the test's own that it can freeze, kill and
//! start again. Subscriptions have message ordering on; a consumer pulls
//! what arrived, in the order it arrived.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use google_cloud_auth::credentials::anonymous;
use google_cloud_pubsub::client::{Subscriber, SubscriptionAdmin, TopicAdmin};
use google_cloud_pubsub::subscriber::MessageStream;

use super::nats::Received;

/// The header [`Emulator::pull`] puts a message's ordering key under (no
/// attribute can have the name: Pub/Sub reserves `goog`).
pub const ORDERING_KEY: &str = "goog-ordering-key";

/// A project name per test, so tests on the shared emulator never meet.
pub fn project() -> String {
    format!("sy-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// A Pub/Sub emulator for a test.
pub struct Emulator {
    host: String,
    child: Option<Child>,
}

impl Emulator {
    /// The emulator `scripts/services.sh start` runs
    /// (`SWITCHYARD_PUBSUB_EMULATOR_HOST`).
    ///
    /// # Panics
    /// When the variable is not set.
    pub fn shared() -> Emulator {
        // The clients use the process's rustls provider, as the relay's do.
        switchyard::tls::install_provider();
        let host = std::env::var("SWITCHYARD_PUBSUB_EMULATOR_HOST").expect(
            "SWITCHYARD_PUBSUB_EMULATOR_HOST is not set: run `eval \"$(scripts/services.sh start)\"` \
             on a machine with the Pub/Sub emulator (gcloud component pubsub-emulator)",
        );
        Emulator { host, child: None }
    }

    /// The emulator at `host` (`host:port`), started by someone else.
    pub fn at(host: &str) -> Emulator {
        switchyard::tls::install_provider();
        Emulator {
            host: host.to_string(),
            child: None,
        }
    }

    /// An emulator of this test's own on a free port, for tests that stop it.
    ///
    /// # Panics
    /// When it cannot be started.
    pub async fn own() -> Emulator {
        switchyard::tls::install_provider();
        let port = super::free_port();
        let mut emulator = Emulator {
            host: format!("127.0.0.1:{port}"),
            child: None,
        };
        emulator.start().await;
        emulator
    }

    /// `host:port`, as `emulator_host` takes it.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Starts this test's emulator (again, after [`Emulator::kill`]): a new
    /// one knows no topics.
    ///
    /// # Panics
    /// On the shared emulator, or when it does not listen within a minute.
    pub async fn start(&mut self) {
        let launcher = std::env::var("SWITCHYARD_PUBSUB_EMULATOR")
            .expect("SWITCHYARD_PUBSUB_EMULATOR is not set: run `eval \"$(scripts/services.sh start)\"`");
        let port = self.host.rsplit(':').next().unwrap().to_string();
        let child = Command::new(launcher)
            .arg("--host=127.0.0.1")
            .arg(format!("--port={port}"))
            .env("JAVA_OPTS", "-Xmx256m")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the Pub/Sub emulator");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        // Serving, not just listening: the REST side answers.
        while self
            .admin()
            .await
            .list_topics()
            .set_project("projects/probe")
            .send()
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "the Pub/Sub emulator did not start on {}",
                self.host
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn pid(&self) -> String {
        self.child
            .as_ref()
            .expect("only a test's own emulator")
            .id()
            .to_string()
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([signal, &self.pid()]).status().unwrap();
        assert!(status.success(), "kill {signal}");
    }

    /// Freezes the emulator (SIGSTOP): connections stay open, nothing answers.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen emulator go on (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    /// Kills the emulator (SIGKILL); it loses every topic and message.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.host)
    }

    /// The topic admin client.
    pub async fn admin(&self) -> TopicAdmin {
        TopicAdmin::builder()
            .with_endpoint(self.endpoint())
            .with_credentials(anonymous::Builder::new().build())
            .build()
            .await
            .expect("topic admin")
    }

    /// Makes `topic` in `project` with no subscription (what is published
    /// to it is dropped: the emulator holds nothing), and returns its name.
    ///
    /// # Panics
    /// When the emulator refuses.
    pub async fn bare_topic(&self, project: &str, topic: &str) -> String {
        let name = format!("projects/{project}/topics/{topic}");
        self.admin()
            .await
            .create_topic()
            .set_name(&name)
            .send()
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
        name
    }

    /// Makes `topic` in `project` and an ordering-enabled subscription
    /// `topic-sub` on it.
    ///
    /// # Panics
    /// When the emulator refuses.
    pub async fn topic(&self, project: &str, topic: &str) {
        let name = self.bare_topic(project, topic).await;
        SubscriptionAdmin::builder()
            .with_endpoint(self.endpoint())
            .with_credentials(anonymous::Builder::new().build())
            .build()
            .await
            .expect("subscription admin")
            .create_subscription()
            .set_name(format!("projects/{project}/subscriptions/{topic}-sub"))
            .set_topic(&name)
            .set_enable_message_ordering(true)
            // Short: an ack lost while the emulator was frozen holds the
            // rest of that ordering key back until the deadline passes.
            .set_ack_deadline_seconds(10)
            .send()
            .await
            .unwrap_or_else(|e| panic!("subscribe to {name}: {e}"));
    }

    /// A consumer of `topic`'s subscription. Keep it for the whole test:
    /// its acknowledgements go out in the background, and a message it
    /// holds unacknowledged blocks the rest of its ordering key.
    pub async fn consumer(&self, project: &str, topic: &str) -> Consumer {
        let subscriber = Subscriber::builder()
            .with_endpoint(self.endpoint())
            .with_credentials(anonymous::Builder::new().build())
            .build()
            .await
            .expect("subscriber");
        let stream = subscriber
            .subscribe(format!("projects/{project}/subscriptions/{topic}-sub"))
            .build();
        Consumer {
            topic: topic.to_string(),
            stream,
        }
    }

    /// [`Consumer::pull`] on a consumer made for the one call.
    pub async fn pull(&self, project: &str, topic: &str, count: usize, limit: Duration) -> Vec<Received> {
        self.consumer(project, topic).await.pull(count, limit).await
    }
}

/// A streaming pull on one subscription.
pub struct Consumer {
    topic: String,
    stream: MessageStream,
}

impl Consumer {
    /// What arrives until `count` distinct events did (by
    /// `Switchyard-Event-Id`) or `limit` passed, each acknowledged: in the
    /// order they arrived, as [`Received`] with the topic as subject,
    /// attributes as headers, and the ordering key under [`ORDERING_KEY`].
    /// Pub/Sub redelivers a message whose ack deadline passed while it sat
    /// in the client's buffer; such a copy has the message id of the first
    /// and is skipped, so a copy counted is one the relay published twice.
    pub async fn pull(&mut self, count: usize, limit: Duration) -> Vec<Received> {
        let mut received = Vec::new();
        let mut distinct = std::collections::HashSet::new();
        let mut delivered = std::collections::HashSet::new();
        let deadline = tokio::time::Instant::now() + limit;
        while distinct.len() < count {
            let next = tokio::time::timeout_at(deadline, self.stream.next()).await;
            let Ok(Some(Ok((message, handler)))) = next else {
                break;
            };
            handler.ack();
            if !delivered.insert(message.message_id.clone()) {
                continue;
            }
            let message = as_received(&self.topic, message);
            let id = message
                .header("Switchyard-Event-Id")
                .map_or_else(|| received.len().to_string(), str::to_string);
            distinct.insert(id);
            received.push(message);
        }
        received
    }
}

/// Reads `topic`'s subscription on the emulator at `host` into `into`
/// until aborted, with a new stream whenever one ends (the emulator was
/// killed and started again).
pub async fn consume_forever(
    host: String,
    project: String,
    topic: String,
    into: std::sync::Arc<std::sync::Mutex<Vec<Received>>>,
) {
    let emulator = Emulator { host, child: None };
    // Redeliveries (the same message id) are skipped, as in `Consumer::pull`.
    let mut delivered = std::collections::HashSet::new();
    loop {
        let mut consumer = emulator.consumer(&project, &topic).await;
        // Never cancelled mid-way: a stream's `next` dropped half done
        // loses what it had received.
        while let Some(Ok((message, handler))) = consumer.stream.next().await {
            handler.ack();
            if delivered.insert(message.message_id.clone()) {
                into.lock().unwrap().push(as_received(&topic, message));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A pulled message as [`Received`].
fn as_received(topic: &str, message: google_cloud_pubsub::model::Message) -> Received {
    let mut headers: HashMap<String, String> = message.attributes.into_iter().collect();
    headers.insert(ORDERING_KEY.to_string(), message.ordering_key);
    Received {
        subject: topic.to_string(),
        headers,
        payload: message.data.to_vec(),
    }
}

/// A loopback port in front of an emulator, for a relay: closed, it
/// refuses connections as a stopped server does; opened again once the
/// restarted emulator behind it has its topic and subscription. A real
/// Pub/Sub comes back with both; a relay that reached the emulator between
/// the two would publish to a topic no subscription yet reads.
pub struct Front {
    port: u16,
    upstream: String,
    accept: Option<tokio::task::JoinHandle<()>>,
}

impl Front {
    /// Opens a front on a free port forwarding to `upstream` (`host:port`).
    pub async fn to(upstream: &str) -> Front {
        let mut front = Front {
            port: super::free_port(),
            upstream: upstream.to_string(),
            accept: None,
        };
        front.open().await;
        front
    }

    /// `host:port`, as `emulator_host` takes it.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Stops listening and drops every connection through it.
    pub fn close(&mut self) {
        if let Some(accept) = self.accept.take() {
            accept.abort();
        }
    }

    /// Listens again on the same port.
    ///
    /// # Panics
    /// When the port cannot be bound again within ten seconds.
    pub async fn open(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match tokio::net::TcpListener::bind(("127.0.0.1", self.port)).await {
                Ok(listener) => break listener,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("bind the front port {}: {e}", self.port),
            }
        };
        let upstream = self.upstream.clone();
        self.accept = Some(tokio::spawn(async move {
            // Dropped with the accept task: every connection goes with it.
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                connections.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                while connections.try_join_next().is_some() {}
            }
        }));
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.close();
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        self.kill();
    }
}
