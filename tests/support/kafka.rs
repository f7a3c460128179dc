//! tansu (a Kafka-protocol broker) processes owned by a test, on a free
//! loopback port with in-memory storage, plus topic setup and a reader built
//! on the rdkafka crate's bundled librdkafka.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
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
    /// The TLS-terminating proxy in front, when there is one.
    tls: Option<TlsProxy>,
}

/// A proxy that terminates TLS (the test CA's server certificate, for
/// `localhost`) in front of the broker, which advertises the proxy.
struct TlsProxy {
    port: u16,
    task: tokio::task::JoinHandle<()>,
    /// The SASL PLAIN login it lets through, when it checks one.
    login: Option<Arc<Login>>,
}

/// A SCRAM-SHA-512 user the broker checks for real. tansu refuses every
/// request on an authenticating listener before the login, its user
/// command included, so a second broker without authentication on the
/// same store sets the password.
struct Login {
    user: String,
    password: std::sync::Mutex<String>,
    admin: Box<KafkaServer>,
    /// Bumped to close every connection through the proxy.
    revoked: tokio::sync::watch::Sender<u64>,
    /// Where the store lives, removed with the login.
    dir: PathBuf,
}

impl Drop for Login {
    fn drop(&mut self) {
        self.admin.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Login {
    fn set_password(&self, password: &str) {
        let status = Command::new(tansu_binary())
            .args(["user", "create", "--mechanism", "scram512", "--broker"])
            .arg(format!("tcp://127.0.0.1:{}", self.admin.port))
            .args([&self.user, password])
            .stdout(Stdio::null())
            .status()
            .expect("tansu user create");
        assert!(status.success(), "tansu user create: {status}");
        *self.password.lock().expect("password") = password.to_string();
    }
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
        let port = super::free_port();
        let mut server = KafkaServer {
            port,
            storage,
            child: None,
            tls: None,
        };
        server.resume().await;
        server
    }

    /// A broker reached only through a TLS-terminating proxy: tansu 0.6
    /// takes `--cert` and `--key` but does not use them, so the proxy
    /// speaks TLS and tansu advertises the proxy's address, and every
    /// client (the relay's and the test's) goes through TLS.
    ///
    /// # Panics
    /// As [`KafkaServer::start`].
    pub async fn start_behind_tls() -> KafkaServer {
        let port = super::free_port();
        KafkaServer::behind(TlsProxy::start(port, None).await, port).await
    }

    /// [`KafkaServer::start_behind_tls`] with SASL SCRAM-SHA-512 on top:
    /// `user` logs in with `password` (see [`KafkaServer::rotate_password`]).
    /// Topics live in a SQLite file, which the broker that sets passwords
    /// shares.
    pub async fn start_behind_tls_with_login(user: &str, password: &str) -> KafkaServer {
        let dir = std::env::temp_dir().join(format!("sy-kafka-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("store directory");
        let storage = format!("sqlite:///{}", dir.join("tansu.db").display());
        let admin = KafkaServer::start_with_storage(storage.clone()).await;
        let login = Arc::new(Login {
            user: user.to_string(),
            password: std::sync::Mutex::default(),
            admin: Box::new(admin),
            revoked: tokio::sync::watch::Sender::new(0),
            dir,
        });
        login.set_password(password);
        let port = super::free_port();
        let proxy = TlsProxy::start(port, Some(login)).await;
        let mut server = KafkaServer {
            port,
            storage,
            child: None,
            tls: Some(proxy),
        };
        server.resume().await;
        // The credential is written through another broker on the same
        // store; a broker that started without seeing it refuses the login
        // for good (once in a few hundred runs). Started again, it reads it.
        for start in 1..=3 {
            if server.admits(user, password).await {
                return server;
            }
            eprintln!("the broker refuses the new login (start {start}); starting it again");
            server.stop();
            server.resume().await;
        }
        assert!(
            server.admits(user, password).await,
            "the broker never admitted {user} with its password"
        );
        server
    }

    async fn behind(proxy: TlsProxy, port: u16) -> KafkaServer {
        let mut server = KafkaServer {
            port,
            storage: "memory://tansu/".to_string(),
            child: None,
            tls: Some(proxy),
        };
        server.resume().await;
        server
    }

    /// The librdkafka properties a client needs for this broker: TLS
    /// verified against the test CA when behind the proxy.
    pub fn client_properties(&self) -> Vec<(&'static str, String)> {
        match &self.tls {
            Some(TlsProxy { login: None, .. }) => vec![
                ("security.protocol", "ssl".to_string()),
                ("ssl.ca.location", super::postgres::tls_file("ca.pem")),
            ],
            Some(TlsProxy {
                login: Some(login), ..
            }) => vec![
                ("security.protocol", "sasl_ssl".to_string()),
                ("ssl.ca.location", super::postgres::tls_file("ca.pem")),
                ("sasl.mechanisms", "SCRAM-SHA-512".to_string()),
                ("sasl.username", login.user.clone()),
                ("sasl.password", login.password.lock().expect("password").clone()),
            ],
            None => Vec::new(),
        }
    }

    fn client_config(&self) -> ClientConfig {
        let mut config = client_config(&self.bootstrap());
        for (key, value) in self.client_properties() {
            config.set(key, value);
        }
        config
    }

    /// Sets a new password for the user and closes every connection, as
    /// revoking a credential does: from then on only the new one logs in.
    ///
    /// # Panics
    /// Without a login.
    pub fn rotate_password(&self, password: &str) {
        let login = self.login().expect("a broker with a login");
        login.set_password(password);
        login.revoked.send_modify(|generation| *generation += 1);
    }

    /// Whether the broker lets `user` in with `password`.
    pub async fn admits(&self, user: &str, password: &str) -> bool {
        let mut config = self.client_config();
        config.set("sasl.username", user).set("sasl.password", password);
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = config.create().expect("client");
            consumer.fetch_metadata(None, Duration::from_secs(5)).is_ok()
        })
        .await
        .expect("login probe")
    }

    fn login(&self) -> Option<&Arc<Login>> {
        self.tls.as_ref().and_then(|proxy| proxy.login.as_ref())
    }

    /// Starts the broker again on its port (after [`KafkaServer::stop`]).
    pub async fn resume(&mut self) {
        let port = self.port;
        let binary = tansu_binary();
        let url = format!("tcp://127.0.0.1:{port}");
        let advertised = match &self.tls {
            Some(proxy) => format!("tcp://localhost:{}", proxy.port),
            None => url.clone(),
        };
        let child = Command::new(&binary)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &advertised,
            ])
            .args(["--storage-engine", &self.storage])
            .args(self.login().map(|_| "--authentication"))
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
        let probe = self.client_config();
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
            let consumer: BaseConsumer = probe.create().expect("client");
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

    /// The `bootstrap_servers` value: the proxy, by name, when behind TLS.
    pub fn bootstrap(&self) -> String {
        match &self.tls {
            Some(proxy) => format!("localhost:{}", proxy.port),
            None => format!("127.0.0.1:{}", self.port),
        }
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
        let admin: AdminClient<DefaultClientContext> = self.client_config().create().expect("admin client");
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
        let config = self.client_config();
        let topic = topic.to_string();
        tokio::task::spawn_blocking(move || read_blocking(&config, &topic, expected, limit))
            .await
            .expect("reader")
    }
}

impl Drop for KafkaServer {
    fn drop(&mut self) {
        self.stop();
        if let Some(proxy) = &self.tls {
            proxy.task.abort();
        }
    }
}

impl TlsProxy {
    async fn start(broker: u16, login: Option<Arc<Login>>) -> TlsProxy {
        use rustls::pki_types::pem::PemObject;
        let file = super::postgres::tls_file;
        let chain = rustls::pki_types::CertificateDer::pem_file_iter(file("server.pem"))
            .expect("server certificate")
            .collect::<Result<Vec<_>, _>>()
            .expect("server certificate");
        let key = rustls::pki_types::PrivateKeyDer::from_pem_file(file("server.key")).expect("server key");
        let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let gate = login.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let gate = gate.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(client).await else {
                        return;
                    };
                    let Ok(mut upstream) = tokio::net::TcpStream::connect(("127.0.0.1", broker)).await else {
                        return;
                    };
                    let mut revoked = gate.as_ref().map(|login| login.revoked.subscribe());
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream) => {}
                        _ = async { revoked.as_mut()?.changed().await.ok() }, if revoked.is_some() => {}
                    }
                });
            }
        });
        TlsProxy { port, task, login }
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

fn read_blocking(config: &ClientConfig, topic: &str, expected: usize, limit: Duration) -> Vec<KafkaReceived> {
    let consumer: BaseConsumer = config.create().expect("consumer");
    // A connection the broker dropped mid-request (a login revoked a
    // moment ago, a loaded machine) fails the fetch at once, where a
    // consumer would connect again: so does the reader, within the limit.
    let started = Instant::now();
    let metadata = loop {
        match consumer.fetch_metadata(Some(topic), Duration::from_secs(10)) {
            Ok(metadata) => break metadata,
            Err(error) if started.elapsed() < limit => {
                eprintln!("topic metadata: {error}; asking again");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(error) => panic!("topic metadata: {error}"),
        }
    };
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
            // What poll hands back as an error (a dropped connection, a
            // broker busy electing) is news, not the end: librdkafka
            // connects again by itself, as it does for any consumer. The
            // limit above still bounds a reader that never recovers.
            Some(Err(e)) => eprintln!("consume {topic}: {e}; reading on"),
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
