//! nats-server processes owned by a test: each test gets its own server (so
//! one test can stop its broker without touching the others), on a free
//! loopback port, with JetStream stored in a temp dir that survives restarts.

use std::collections::HashMap;
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

/// How a test's own client logs in to a secured server.
#[derive(Clone, Debug)]
pub enum Login {
    /// Mutual TLS and a user nkey.
    Tls {
        /// The CA that signed the server's certificate.
        root_cert: PathBuf,
        /// A client certificate and its key.
        client: (PathBuf, PathBuf),
        /// A user nkey seed.
        seed: String,
    },
    /// A creds file (user JWT and seed), on a server in operator mode.
    Creds(PathBuf),
    /// A user and a password.
    UserPassword(String, String),
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
        // Restarted on the same port: not an ephemeral one (see `free_port`).
        let port = super::free_port();
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
    pub async fn start_secured(
        root_cert: &str,
        client: (&str, &str),
        seed: &str,
        public_key: &str,
        server_cert: (&str, &str),
    ) -> NatsServer {
        let config = format!(
            "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{root_cert}\"\n  verify: true\n}}\nauthorization {{\n  users: [ {{ nkey: {public_key} }} ]\n}}\n",
            server_cert.0, server_cert.1,
        );
        let login = Login::Tls {
            root_cert: root_cert.into(),
            client: (client.0.into(), client.1.into()),
            seed: seed.to_string(),
        };
        NatsServer::start_logged_in(&config, login).await
    }

    /// A server that admits one user, `user` with `password`, and no one
    /// without a login.
    ///
    /// # Panics
    /// As [`NatsServer::start`].
    pub async fn start_with_login(user: &str, password: &str) -> NatsServer {
        let config = format!("authorization {{\n  user: {user:?}\n  password: {password:?}\n}}\n");
        NatsServer::start_logged_in(&config, Login::UserPassword(user.into(), password.into())).await
    }

    /// A server in operator mode (accounts and users as JWTs, the account
    /// preloaded, JetStream on for it) and the creds file of its one user:
    /// what operator-mode clusters and Synadia Cloud hand out.
    ///
    /// # Panics
    /// As [`NatsServer::start`].
    pub async fn start_operator_mode() -> (NatsServer, PathBuf) {
        let operator = nkeys::KeyPair::new_operator();
        let account = nkeys::KeyPair::new_account();
        // JetStream in operator mode needs a system account.
        let system = nkeys::KeyPair::new_account();
        let user = nkeys::KeyPair::new_user();
        let unlimited = serde_json::json!({
            "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": true,
            "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1
        });
        let operator_jwt = jwt(
            &operator,
            &operator.public_key(),
            serde_json::json!({"type": "operator", "version": 2}),
        );
        let account_jwt = jwt(
            &operator,
            &account.public_key(),
            serde_json::json!({"type": "account", "version": 2, "limits": unlimited}),
        );
        let user_jwt = jwt(
            &account,
            &user.public_key(),
            serde_json::json!({"type": "user", "version": 2, "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}),
        );
        let system_jwt = jwt(
            &operator,
            &system.public_key(),
            serde_json::json!({"type": "account", "version": 2}),
        );
        let config = format!(
            "operator: {operator_jwt}\nsystem_account: {system}\nresolver: MEMORY\n\
             resolver_preload: {{\n  {account}: {account_jwt}\n  {system}: {system_jwt}\n}}\n",
            account = account.public_key(),
            system = system.public_key(),
        );
        let creds = std::env::temp_dir().join(format!("sy-nats-{}.creds", uuid::Uuid::new_v4().simple()));
        std::fs::write(
            &creds,
            format!(
                "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
                 -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
                user.seed().expect("seed")
            ),
        )
        .expect("write creds");
        let server = NatsServer::start_logged_in(&config, Login::Creds(creds.clone())).await;
        (server, creds)
    }

    async fn start_logged_in(config: &str, login: Login) -> NatsServer {
        let path = std::env::temp_dir().join(format!("sy-nats-{}.conf", uuid::Uuid::new_v4().simple()));
        std::fs::write(&path, config).expect("write nats config");
        // Restarted on the same port: not an ephemeral one (see `free_port`).
        let port = super::free_port();
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
            Some(Login::Tls { .. }) => format!("tls://localhost:{}", self.port),
            _ => format!("nats://127.0.0.1:{}", self.port),
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
        let options = match login {
            Login::Tls {
                root_cert,
                client,
                seed,
            } => async_nats::ConnectOptions::new()
                .add_root_certificates(root_cert.clone())
                .add_client_certificate(client.0.clone(), client.1.clone())
                .nkey(seed.clone())
                .require_tls(true),
            Login::Creds(path) => async_nats::ConnectOptions::new()
                .credentials_file(path)
                .await
                .map_err(|e| async_nats::ConnectError::with_source(async_nats::ConnectErrorKind::Io, e))?,
            Login::UserPassword(user, password) => {
                async_nats::ConnectOptions::new().user_and_password(user.clone(), password.clone())
            }
        };
        options.connect(self.url()).await
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

/// A JWT for `subject` with `nats` claims, signed by `issuer`, as the
/// nats-server decodes them (header, claims, ed25519 signature by the
/// issuer's nkey, each base64url without padding).
fn jwt(issuer: &nkeys::KeyPair, subject: &str, nats: serde_json::Value) -> String {
    use base64::Engine;
    let encode = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let claims = serde_json::json!({
        "jti": uuid::Uuid::new_v4().simple().to_string().to_uppercase(),
        "iat": chrono::Utc::now().timestamp(),
        "iss": issuer.public_key(),
        "name": subject,
        "sub": subject,
        "nats": nats,
    });
    let signed = format!(
        "{}.{}",
        encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#),
        encode(claims.to_string().as_bytes())
    );
    let signature = issuer.sign(signed.as_bytes()).expect("sign");
    format!("{signed}.{}", encode(&signature))
}
