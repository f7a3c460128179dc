//! RabbitMQ in tests: the shared broker `scripts/services.sh` starts (each
//! test declares exchanges and queues under names of its own), or a node of
//! the test's own that it can stop and start again.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

use super::nats::Received;

/// A RabbitMQ broker for a test.
pub struct RabbitMq {
    url: String,
    node: Option<Node>,
}

/// A node this test started: its ports, files and process.
struct Node {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RabbitMq {
    /// The broker `scripts/services.sh start` runs (`SWITCHYARD_RABBITMQ_URL`).
    ///
    /// # Panics
    /// When the variable is not set.
    pub fn shared() -> RabbitMq {
        let url = std::env::var("SWITCHYARD_RABBITMQ_URL")
            .expect("SWITCHYARD_RABBITMQ_URL is not set: run `eval \"$(scripts/services.sh start)\"`");
        RabbitMq { url, node: None }
    }

    /// A node of this test's own on free ports, for tests that stop the broker.
    ///
    /// # Panics
    /// When the server cannot be started.
    pub async fn own() -> RabbitMq {
        RabbitMq::own_with(super::free_port(), "", "").await
    }

    /// A node of the test's own with a TLS listener on `tls_port` too
    /// (the test CA's server certificate, client certificates required)
    /// and EXTERNAL login, for a user `switchyard_cert` named by the test
    /// client certificate's common name.
    ///
    /// # Panics
    /// As [`RabbitMq::own`].
    pub async fn own_with_tls(tls_port: u16) -> RabbitMq {
        let file = super::postgres::tls_file;
        let conf = format!(
            "listeners.ssl.1 = 127.0.0.1:{tls_port}\n\
             ssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
             ssl_options.verify = verify_peer\nssl_options.fail_if_no_peer_cert = true\n\
             auth_mechanisms.1 = PLAIN\nauth_mechanisms.2 = AMQPLAIN\nauth_mechanisms.3 = EXTERNAL\n\
             ssl_cert_login_from = common_name\n",
            file("ca.pem"),
            file("server.pem"),
            file("server.key")
        );
        let rabbit = RabbitMq::own_with(super::free_port(), &conf, "rabbitmq_auth_mechanism_ssl").await;
        rabbit.ctl(&["add_user", "switchyard_cert", &uuid::Uuid::new_v4().to_string()]);
        rabbit.ctl(&["set_permissions", "-p", "/", "switchyard_cert", ".*", ".*", ".*"]);
        rabbit
    }

    /// Adds `user` with `password` and every permission on the default
    /// vhost to this test's node; the AMQP URL that logs in as them.
    ///
    /// # Panics
    /// On the shared broker, or when `rabbitmqctl` fails.
    pub fn add_user(&self, user: &str, password: &str) -> String {
        self.ctl(&["add_user", user, password]);
        self.ctl(&["set_permissions", "-p", "/", user, ".*", ".*", ".*"]);
        let mut url = url::Url::parse(&self.url).expect("the node's URL");
        url.set_username(user).expect("a user name");
        url.set_password(Some(password)).expect("a password");
        url.to_string()
    }

    /// Runs `rabbitmqctl` against this test's node.
    fn ctl(&self, args: &[&str]) {
        let node = self.node.as_ref().expect("only a test's own node");
        let status = Command::new("/usr/lib/rabbitmq/bin/rabbitmqctl")
            .arg("-n")
            .arg(format!("sy{}@localhost", node.port))
            .args(args)
            .env("HOME", &node.dir)
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .stdout(Stdio::null())
            .status()
            .expect("run rabbitmqctl");
        assert!(status.success(), "rabbitmqctl {args:?} failed");
    }

    async fn own_with(port: u16, conf: &str, plugin: &str) -> RabbitMq {
        let dir = std::env::temp_dir().join(format!("sy-rabbit-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("log")).expect("node directory");
        std::fs::write(dir.join("enabled_plugins"), format!("[{plugin}].\n")).expect("plugins file");
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.1 = 127.0.0.1:{port}\n{conf}"),
        )
        .expect("conf");
        let mut rabbit = RabbitMq {
            url: format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
            node: Some(Node {
                port,
                dir,
                child: None,
            }),
        };
        rabbit.start().await;
        rabbit
    }

    /// The AMQP URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Starts (again) this test's node, with the state it had.
    ///
    /// # Panics
    /// On the shared broker, or when the node does not come up.
    pub async fn start(&mut self) {
        let node = self.node.as_mut().expect("only a test's own node is started");
        let server = std::env::var("SWITCHYARD_RABBITMQ_SERVER")
            .unwrap_or_else(|_| "/usr/lib/rabbitmq/bin/rabbitmq-server".to_string());
        let dist_port = super::free_port();
        // Mnesia writes its crash dumps into the working directory.
        let child = Command::new(&server)
            .current_dir(&node.dir)
            .env("HOME", &node.dir)
            .env("RABBITMQ_NODENAME", format!("sy{}@localhost", node.port))
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", node.port.to_string())
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
            .env("RABBITMQ_MNESIA_BASE", node.dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", node.dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", node.dir.join("enabled_plugins"))
            .env("RABBITMQ_CONFIG_FILE", node.dir.join("rabbitmq"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {server} ({e}); run scripts/services.sh start to install it")
            });
        node.child = Some(child);
        let started = Instant::now();
        // Each try bounded: a connect made while the node boots was seen
        // to wait for ever (no socket left, the future never resolved).
        let connected = || async {
            tokio::time::timeout(
                Duration::from_secs(5),
                Connection::connect(&self.url, ConnectionProperties::default()),
            )
            .await
            .is_ok_and(|connection| connection.is_ok())
        };
        while !connected().await {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "RabbitMQ on port {} did not start; see {}",
                node.port,
                node.dir.join("log").display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Kills this test's node (like a crash: no goodbye to clients).
    ///
    /// # Panics
    /// On the shared broker.
    pub fn stop(&mut self) {
        let node = self.node.as_mut().expect("only a test's own node is stopped");
        if let Some(mut child) = node.child.take() {
            // The server script runs the Erlang VM as a child of its own; the
            // VM's command line names the node's directory (its HOME).
            let _ = Command::new("pkill")
                .args(["-KILL", "-f"])
                .arg(format!("home {}", node.dir.display()))
                .status();
            let _ = child.kill();
            let _ = child.wait();
            let started = Instant::now();
            while std::net::TcpStream::connect(("127.0.0.1", node.port)).is_ok() {
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "RabbitMQ on port {} did not stop",
                    node.port
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// A connection and a channel on this broker, for publishing by hand.
    ///
    /// # Panics
    /// When the broker is not reachable.
    pub async fn channel(&self) -> (Connection, Channel) {
        let connection = Connection::connect(&self.url, ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ");
        let channel = connection.create_channel().await.expect("channel");
        (connection, channel)
    }

    /// A durable topic exchange and a durable queue bound to it with `binding`.
    pub async fn declare(&self, exchange: &str, queue: &str, binding: &str) {
        let (_connection, channel) = self.channel().await;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        channel
            .exchange_declare(
                exchange.into(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await
            .expect("declare exchange");
        if queue.is_empty() {
            return;
        }
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        channel
            .queue_declare(queue.into(), durable, FieldTable::default())
            .await
            .expect("declare queue");
        channel
            .queue_bind(
                queue.into(),
                exchange.into(),
                binding.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind queue");
        if self.node.is_some() {
            // Mnesia's log holds a commit in memory for up to two seconds, so
            // a node killed right after the declaration came back without the
            // binding (and refused every publish with NO_ROUTE); a test kills
            // its own node to simulate a crash of a broker that had its
            // bindings for a long time.
            self.ctl(&["eval", "ok = mnesia:sync_log()."]);
        }
    }

    /// Deletes an exchange.
    pub async fn delete_exchange(&self, exchange: &str) {
        let (_connection, channel) = self.channel().await;
        channel
            .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
            .await
            .expect("delete exchange");
    }

    /// Takes every message from `queue`, in queue order, until at least
    /// `expected` arrived and the queue is empty, or `limit` passed; as a NATS-shaped
    /// [`Received`] (routing key as subject, headers as text, message id as
    /// `Message-Id`) so the order checks of the other brokers apply.
    pub async fn drain(&self, queue: &str, expected: usize, limit: Duration) -> Vec<Received> {
        let (_connection, channel) = self.channel().await;
        let started = Instant::now();
        let mut received = Vec::new();
        while started.elapsed() < limit {
            let got = channel
                .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                .await
                .expect("basic.get");
            let Some(message) = got else {
                // Redelivered copies count too: stop only once the queue is empty.
                if received.len() >= expected {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let delivery = message.delivery;
            // Headers as the example consumer reads them (message id included).
            let mut headers = consumer::rabbitmq::delivered(queue, &delivery).headers;
            if delivery.properties.delivery_mode() == &Some(2) {
                headers.insert("Delivery-Mode".to_string(), "2".to_string());
            }
            received.push(Received {
                subject: delivery.routing_key.to_string(),
                headers,
                payload: delivery.data,
            });
        }
        received
    }
}

impl Drop for RabbitMq {
    fn drop(&mut self) {
        if self.node.is_some() {
            self.stop();
        }
        if let Some(node) = &self.node {
            // A failed test leaves the node's own account of its restarts
            // (queue recovery, crashes) in the test's output.
            if std::thread::panicking() {
                print_log_tail(&node.dir.join("log"));
            }
            let _ = std::fs::remove_dir_all(&node.dir);
        }
    }
}

/// The last lines of each log file of a node, to stderr.
fn print_log_tail(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        let lines: Vec<&str> = text.lines().collect();
        eprintln!("== {} (last 60 lines)", entry.path().display());
        for line in &lines[lines.len().saturating_sub(60)..] {
            eprintln!("   {line}");
        }
    }
}
