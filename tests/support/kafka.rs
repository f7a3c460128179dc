//! tansu (a Kafka-protocol broker) processes owned by a test, on a free
//! loopback port with in-memory storage, plus topic setup and a reader built
//! on the rdkafka crate's bundled librdkafka.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// Where `scripts/services.sh` installs tansu, unless `SWITCHYARD_TANSU_BIN` says otherwise.
pub fn tansu_binary() -> PathBuf {
    if let Ok(path) = std::env::var("SWITCHYARD_TANSU_BIN") {
        return path.into();
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let installed = PathBuf::from(home).join(".local/share/switchyard/bin/tansu");
    if installed.exists() {
        installed
    } else {
        "tansu".into()
    }
}

/// A running tansu broker.
pub struct KafkaServer {
    port: u16,
    storage: String,
    child: Option<Child>,
}

impl KafkaServer {
    /// Starts a broker on a free port, its topics in memory, and waits
    /// until it serves metadata.
    ///
    /// # Panics
    /// When tansu is missing (run scripts/services.sh start) or does not start.
    pub async fn start() -> KafkaServer {
        KafkaServer::start_with_storage("memory://tansu/".to_string()).await
    }

    /// Starts a broker whose topics live in a SQLite file under `dir`, so
    /// that they survive [`KafkaServer::stop`] and [`KafkaServer::resume`].
    pub async fn start_durable(dir: &std::path::Path) -> KafkaServer {
        let file = dir.join("tansu.db");
        // Four slashes: tansu reads the URL path without its leading one.
        let server = KafkaServer::start_with_storage(format!("sqlite:///{}", file.display())).await;
        // tansu's SQLite schema has no index from a record to its headers:
        // each fetched record scans every header in the store, and reading
        // back a long run's topic (60,000 messages with 5 headers each)
        // took longer than any limit. The index is the store's, not the
        // relay's: it changes no result, only how long the reader waits.
        let db = sqlx::SqlitePool::connect(&format!("sqlite://{}", file.display()))
            .await
            .expect("tansu's SQLite store");
        sqlx::query("CREATE INDEX IF NOT EXISTS sy_header_by_record ON header (topition, offset_id)")
            .execute(&db)
            .await
            .expect("index tansu's headers");
        db.close().await;
        server
    }

    async fn start_with_storage(storage: String) -> KafkaServer {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let mut server = KafkaServer {
            port,
            storage,
            child: None,
        };
        server.resume().await;
        server
    }

    /// Starts the broker again on its port (after [`KafkaServer::stop`]).
    pub async fn resume(&mut self) {
        let port = self.port;
        let binary = tansu_binary();
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(&binary)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", &self.storage])
            .env(
                "RUST_LOG",
                std::env::var("SWITCHYARD_TANSU_LOG").unwrap_or_else(|_| "error".into()),
            )
            .stdout(Stdio::null())
            .stderr(match std::env::var_os("SWITCHYARD_TANSU_LOG_FILE") {
                Some(path) => std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_or_else(|_| Stdio::null(), Stdio::from),
                None => Stdio::null(),
            })
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {} ({e}); run scripts/services.sh start to install it",
                    binary.display()
                )
            });
        self.child = Some(child);
        let bootstrap = self.bootstrap();
        let ready = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            // Connect only once the port listens: librdkafka logs every refused attempt.
            // A connect to a free port in the ephemeral range can take that
            // port as its own and reach itself: that is not tansu listening.
            let listening = || {
                std::net::TcpStream::connect(("127.0.0.1", port))
                    .is_ok_and(|stream| stream.local_addr().is_ok_and(|local| local.port() != port))
            };
            while !listening() {
                if started.elapsed() > Duration::from_secs(20) {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let consumer: BaseConsumer = client_config(&bootstrap).create().expect("client");
            while started.elapsed() < Duration::from_secs(20) {
                if consumer.fetch_metadata(None, Duration::from_secs(1)).is_ok() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            false
        })
        .await
        .expect("readiness probe");
        assert!(ready, "tansu on port {port} did not become ready");
    }

    /// The `bootstrap_servers` value.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Stops the broker (SIGKILL); in-memory topics are gone, durable ones stay.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Creates a topic with `partitions` partitions.
    ///
    /// # Panics
    /// When the broker refuses.
    pub async fn create_topic(&self, name: &str, partitions: i32) {
        let admin: AdminClient<DefaultClientContext> =
            client_config(&self.bootstrap()).create().expect("admin client");
        let results = admin
            .create_topics(
                &[NewTopic::new(name, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .expect("create topic");
        for result in results {
            result.unwrap_or_else(|(topic, code)| panic!("create topic {topic}: {code}"));
        }
    }

    /// Reads every message of `topic` from the beginning of each partition
    /// until `expected` messages arrived (or `limit` passed), then for one
    /// more quiet second, so that extra copies show up too. In offset order
    /// per partition.
    ///
    /// # Panics
    /// When fewer than `expected` arrive in time.
    pub async fn read_topic(&self, topic: &str, expected: usize, limit: Duration) -> Vec<KafkaReceived> {
        let bootstrap = self.bootstrap();
        let topic = topic.to_string();
        tokio::task::spawn_blocking(move || read_blocking(&bootstrap, &topic, expected, limit))
            .await
            .expect("reader")
    }
}

impl Drop for KafkaServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn client_config(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("sy-test-{}", uuid::Uuid::new_v4().simple()))
        .set("enable.auto.commit", "false")
        .set("log_level", "3");
    config
}

fn read_blocking(bootstrap: &str, topic: &str, expected: usize, limit: Duration) -> Vec<KafkaReceived> {
    let consumer: BaseConsumer = client_config(bootstrap).create().expect("consumer");
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("topic metadata");
    let partitions = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map(|t| t.partitions().len())
        .expect("topic exists");
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions {
        let partition = i32::try_from(partition).expect("partition number");
        assignment
            .add_partition_offset(topic, partition, Offset::Beginning)
            .expect("assign");
    }
    consumer.assign(&assignment).expect("assign");
    let mut out = Vec::with_capacity(expected);
    let started = Instant::now();
    let mut quiet_since = None;
    loop {
        if out.len() < expected {
            assert!(
                started.elapsed() < limit,
                "read {} of {expected} messages from {topic} in {limit:?}",
                out.len()
            );
        } else if quiet_since.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(1) {
            break;
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => {
                let view = consumer::kafka::delivered(&message);
                out.push(KafkaReceived {
                    partition: message.partition(),
                    offset: message.offset(),
                    key: view.key,
                    headers: view.headers,
                    payload: view.payload,
                });
            }
            Some(Err(e)) => panic!("consume {topic}: {e}"),
            None => {}
        }
    }
    out
}

/// A message as a Kafka consumer saw it.
#[derive(Debug, Clone)]
pub struct KafkaReceived {
    /// Partition it sits in.
    pub partition: i32,
    /// Offset within the partition.
    pub offset: i64,
    /// Message key.
    pub key: Option<String>,
    /// Headers.
    pub headers: HashMap<String, String>,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

impl KafkaReceived {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The payload as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload).expect("JSON payload")
    }
}
