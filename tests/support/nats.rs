//! nats-server processes owned by a test: each test gets its own server (so
//! one test can stop its broker without touching the others), on a free
//! loopback port, with JetStream stored in a temp dir that survives restarts.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;

/// The duplicate window of test streams, and what test relay configs
/// declare in `duplicate_window_seconds`.
pub const TEST_DUPLICATE_WINDOW: Duration = Duration::from_secs(3600);

/// A running (or stopped) nats-server.
pub struct NatsServer {
    port: u16,
    store_dir: PathBuf,
    child: Option<Child>,
    /// A server config file (`-c`), for limits the command line cannot set.
    config_file: Option<PathBuf>,
    /// How the test's own clients log in, on a server that asks.
    login: Option<Login>,
}

/// A test client's TLS files and nkey seed, for a secured server.
#[derive(Clone, Debug)]
pub struct Login {
    /// The CA that signed the server's certificate.
    pub root_cert: PathBuf,
    /// A client certificate and its key.
    pub client: (PathBuf, PathBuf),
    /// A user nkey seed.
    pub seed: String,
}

impl NatsServer {
    /// Starts a JetStream-enabled server on a free port.
    ///
    /// # Panics
    /// When nats-server is missing (run scripts/services.sh start) or does not start.
    pub async fn start() -> NatsServer {
        NatsServer::start_with_config("").await
    }

    /// Like [`NatsServer::start`], with extra server config lines (e.g.
    /// `max_control_line: 512`).
    ///
    /// # Panics
    /// As [`NatsServer::start`].
    pub async fn start_with_config(config: &str) -> NatsServer {
        let config_file = (!config.is_empty()).then(|| {
            let path = std::env::temp_dir().join(format!("sy-nats-{}.conf", uuid::Uuid::new_v4().simple()));
            std::fs::write(&path, config).expect("write nats config");
            path
        });
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let store_dir = std::env::temp_dir().join(format!("sy-nats-{}", uuid::Uuid::new_v4().simple()));
        let mut server = NatsServer {
            port,
            store_dir,
            child: None,
            config_file,
            login: None,
        };
        server.resume().await;
        server
    }

    /// A server with TLS that requires a client certificate signed by the
    /// test CA and admits one user, by nkey: `login` is how to reach it.
    ///
    /// # Panics
    /// As [`NatsServer::start`].
    pub async fn start_secured(login: Login, public_key: &str, server_cert: (&str, &str)) -> NatsServer {
        let config = format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: true\n}}\nauthorization {{\n  users: [ {{ nkey: {public_key} }} ]\n}}\n",
            server_cert.0,
            server_cert.1,
            login.root_cert.display()
        );
        let path = std::env::temp_dir().join(format!("sy-nats-{}.conf", uuid::Uuid::new_v4().simple()));
        std::fs::write(&path, config).expect("write nats config");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        let mut server = NatsServer {
            port,
            store_dir: std::env::temp_dir().join(format!("sy-nats-{}", uuid::Uuid::new_v4().simple())),
            child: None,
            config_file: Some(path),
            login: Some(login),
        };
        server.resume().await;
        server
    }

    /// The client URL: by name over TLS on a secured server (its
    /// certificate names localhost), else by address.
    pub fn url(&self) -> String {
        match self.login {
            Some(_) => format!("tls://localhost:{}", self.port),
            None => format!("nats://127.0.0.1:{}", self.port),
        }
    }

    /// A client of the test's own, logged in as the server asks.
    ///
    /// # Errors
    /// When the server cannot be reached.
    pub async fn client(&self) -> Result<async_nats::Client, async_nats::ConnectError> {
        let Some(login) = &self.login else {
            return async_nats::connect(self.url()).await;
        };
        switchyard::tls::install_provider();
        async_nats::ConnectOptions::new()
            .add_root_certificates(login.root_cert.clone())
            .add_client_certificate(login.client.0.clone(), login.client.1.clone())
            .nkey(login.seed.clone())
            .require_tls(true)
            .connect(self.url())
            .await
    }

    /// Stops the server (kill), keeping its JetStream data.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and data.
    pub async fn resume(&mut self) {
        let binary = std::env::var("NATS_SERVER_BIN").unwrap_or_else(|_| "nats-server".to_string());
        let mut command = Command::new(&binary);
        if let Some(config) = &self.config_file {
            command.arg("-c").arg(config);
        }
        let child = command
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(&self.store_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {binary} ({e}); run scripts/services.sh start to install it")
            });
        self.child = Some(child);
        for _ in 0..200 {
            if let Ok(client) = self.client().await {
                // JetStream is ready once its API answers without an error.
                if let Ok(reply) = client.request("$JS.API.INFO", "".into()).await {
                    let info: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap_or_default();
                    if info.get("error").is_none() && info.get("type").is_some() {
                        return;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("nats-server on port {} did not become ready", self.port);
    }

    /// Creates a stream capturing `subjects`.
    pub async fn create_stream(&self, name: &str, subjects: &[&str]) {
        let client = self.client().await.expect("connect");
        jetstream::new(client)
            .create_stream(jetstream::stream::Config {
                name: name.to_string(),
                subjects: subjects.iter().map(|s| (*s).to_string()).collect(),
                // Covers every test config's retry horizon (they set
                // `duplicate_window_seconds` to the same), as a deployment's
                // streams must.
                duplicate_window: TEST_DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await
            .expect("create stream");
    }

    /// Reads every message in a stream, in stream order.
    pub async fn read_stream(&self, name: &str) -> Vec<Received> {
        let client = self.client().await.expect("connect");
        let js = jetstream::new(client);
        let mut stream = js.get_stream(name).await.expect("stream");
        let total = stream.info().await.expect("stream info").state.messages;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
            .await
            .expect("consumer");
        let mut messages = consumer.messages().await.expect("messages");
        let mut out = Vec::new();
        while (out.len() as u64) < total {
            let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                .await
                .expect("stream read timed out")
                .expect("stream ended")
                .expect("message");
            let headers = message
                .headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| {
                            (
                                k.to_string(),
                                v.first().map(|v| v.to_string()).unwrap_or_default(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(Received {
                subject: message.subject.to_string(),
                headers,
                payload: message.payload.to_vec(),
            });
        }
        out
    }

    /// Number of messages in a stream.
    pub async fn stream_len(&self, name: &str) -> u64 {
        let client = self.client().await.expect("connect");
        let js = jetstream::new(client);
        let mut stream = js.get_stream(name).await.expect("stream");
        stream.info().await.expect("stream info").state.messages
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.store_dir);
    }
}

/// A message as a consumer saw it.
#[derive(Debug, Clone)]
pub struct Received {
    /// Subject.
    pub subject: String,
    /// Headers (first value of each).
    pub headers: HashMap<String, String>,
    /// Payload bytes.
    pub payload: Vec<u8>,
}

impl Received {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The payload as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload).expect("JSON payload")
    }
}
