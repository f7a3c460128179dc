//! Redis for the Redis Streams target's tests: the server `scripts/services.sh`
//! starts (TLS only, ACL user `switchyard`), or a test's own on a free port
//! (plain, the same ACL user, every write appended and fsynced to a file
//! kept across a restart), killed, frozen and started again. Streams are
//! read with `XRANGE`, as a consumer would, each entry NATS-shaped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::config::{Target, path, table};
use super::nats::Received;

/// An entry as `XRANGE` gives it: its id and its fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// Entries of `stream` as messages: the `payload` field the payload,
/// every other field a header.
fn as_messages(stream: &str, entries: Vec<StreamEntry>) -> Vec<Received> {
    entries
        .into_iter()
        .map(|(_, fields)| {
            let mut payload = Vec::new();
            let mut headers = std::collections::HashMap::new();
            for (name, value) in fields {
                if name == "payload" {
                    payload = value;
                } else {
                    headers.insert(name, String::from_utf8_lossy(&value).into_owned());
                }
            }
            Received {
                subject: stream.to_string(),
                headers,
                payload,
            }
        })
        .collect()
}

/// A Redis server.
pub struct RedisServer {
    /// `redis://127.0.0.1:PORT` or `rediss://localhost:PORT`.
    pub url: String,
    /// The ACL user's password.
    pub password: String,
    password_file: PathBuf,
    tls: bool,
    own: Option<Own>,
}

struct Own {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl RedisServer {
    /// The server `scripts/services.sh` started.
    ///
    /// # Panics
    /// When its password file cannot be read.
    pub fn shared() -> RedisServer {
        let dir = PathBuf::from(
            std::env::var("SWITCHYARD_REDIS_DIR").unwrap_or_else(|_| "/tmp/switchyard-services/redis".into()),
        );
        let password_file = dir.join("password");
        RedisServer {
            url: std::env::var("SWITCHYARD_REDIS_URL").unwrap_or_else(|_| "rediss://localhost:56380".into()),
            password: std::fs::read_to_string(&password_file)
                .expect("the Redis password file: run scripts/services.sh start")
                .trim()
                .to_string(),
            password_file,
            tls: true,
            own: None,
        }
    }

    /// A server of the test's own (plain, durable across a restart).
    pub async fn own() -> RedisServer {
        let port = super::free_port();
        let dir = std::env::temp_dir().join(format!("sy-redis-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("redis dir");
        let password = format!("pw-{}", uuid::Uuid::new_v4().simple());
        let password_file = dir.join("password");
        std::fs::write(&password_file, format!("{password}\n")).expect("password file");
        let mut server = RedisServer {
            url: format!("redis://127.0.0.1:{port}"),
            password,
            password_file,
            tls: false,
            own: Some(Own {
                port,
                dir,
                child: None,
            }),
        };
        server.start().await;
        server
    }

    /// Starts (again) this test's server, with what it wrote.
    ///
    /// # Panics
    /// On the shared server, or when it does not come up.
    pub async fn start(&mut self) {
        let own = self.own.as_mut().expect("only a test's own Redis is started");
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &own.port.to_string()])
            .args(["--dir", &own.dir.display().to_string(), "--save", ""])
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .args(["--user", "default", "off"])
            .args([
                "--user",
                "switchyard",
                "on",
                &format!(">{}", self.password),
                "~*",
                "&*",
                "+@all",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run redis-server (scripts/services.sh install)");
        own.child = Some(child);
        let started = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", own.port))
            .await
            .is_err()
        {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "redis-server did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills this test's server.
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
            .expect("a running Redis of the test's own")
            .id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// SIGSTOP.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT.
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    /// A `redis` target for the relay: the ACL user, its password read
    /// from the file, the test CA for TLS.
    pub fn target(&self) -> Target {
        let target = Target::of("redis")
            .set("url", self.url.as_str())
            .set("user", "switchyard")
            .set(
                "password",
                table(&[("file", path(&self.password_file)), ("refresh_seconds", 1.into())]),
            );
        if self.tls {
            target.set(
                "tls",
                table(&[("root_cert", super::postgres::tls_file("ca.pem").into())]),
            )
        } else {
            target
        }
    }

    /// Sets the ACL user's password to `password` on the server and in
    /// the file the relay reads: a rotation.
    pub async fn rotate(&mut self, password: &str) {
        let mut connection = self.connection().await;
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("switchyard")
            .arg("resetpass")
            .arg(format!(">{password}"))
            .query_async(&mut connection)
            .await
            .expect("ACL SETUSER");
        // Sessions logged in with the old password go, as a rotation's
        // would when the old one is revoked.
        let _: redis::Value = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("USER")
            .arg("switchyard")
            .query_async(&mut connection)
            .await
            .unwrap_or(redis::Value::Nil);
        self.password = password.to_string();
        std::fs::write(&self.password_file, format!("{password}\n")).expect("password file");
    }

    async fn connection(&self) -> redis::aio::MultiplexedConnection {
        self.connection_as("switchyard", &self.password).await
    }

    /// A command sent as `user`: its answer, or the server's error as text.
    pub async fn command_as(
        &self,
        user: &str,
        password: &str,
        args: &[&str],
    ) -> Result<redis::Value, String> {
        let mut connection = self.connection_as(user, password).await;
        let mut command = redis::cmd(args[0]);
        for arg in &args[1..] {
            command.arg(*arg);
        }
        command
            .query_async(&mut connection)
            .await
            .map_err(|e| e.to_string())
    }

    /// A command sent as the services' ACL user, which may do anything.
    pub async fn command(&self, args: &[&str]) -> Result<redis::Value, String> {
        self.command_as("switchyard", &self.password, args).await
    }

    async fn connection_as(&self, user: &str, password: &str) -> redis::aio::MultiplexedConnection {
        switchyard::tls::install_provider();
        let mut info = redis::IntoConnectionInfo::into_connection_info(self.url.as_str()).expect("a url");
        let settings = info
            .redis_settings()
            .clone()
            .set_username(user)
            .set_password(password);
        info = info.set_redis_settings(settings);
        let client = if self.tls {
            let root = std::fs::read(super::postgres::tls_file("ca.pem")).expect("the test CA");
            redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root),
                },
            )
            .expect("a client")
        } else {
            redis::Client::open(info).expect("a client")
        };
        client
            .get_multiplexed_async_connection_with_config(&test_timeouts())
            .await
            .expect("Redis answers")
    }

    /// Every entry of `stream`, in stream order, as messages: the
    /// `payload` field the payload, every other field a header.
    pub async fn entries(&self, stream: &str) -> Vec<Received> {
        let mut connection = self.connection().await;
        let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(stream)
            .arg("-")
            .arg("+")
            .query_async(&mut connection)
            .await
            .expect("XRANGE");
        as_messages(stream, entries)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(own) = self.own.as_ref()
            && let Some(child) = own.child.as_ref()
        {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
        }
        self.kill();
        if let Some(own) = self.own.take() {
            let _ = std::fs::remove_dir_all(own.dir);
        }
    }
}

/// The client's own bounds (1 s to connect, 500 ms an answer) are for
/// production; a test reading thousands of entries from a server just
/// restarted, on two busy cores, waits longer.
fn test_timeouts() -> redis::AsyncConnectionConfig {
    redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(std::time::Duration::from_secs(20)))
        .set_response_timeout(Some(std::time::Duration::from_secs(60)))
}

/// A Redis Cluster of the test's own: `nodes` masters on free ports, no
/// login, the slots shared among them by `redis-cli --cluster create`.
pub struct RedisCluster {
    /// The nodes' URLs, comma-separated, as the target's `url` takes them.
    pub urls: String,
    nodes: Vec<Child>,
    dir: PathBuf,
}

impl RedisCluster {
    /// Starts it and waits until every slot is served.
    ///
    /// # Panics
    /// When a node does not start or the cluster does not form.
    pub async fn start(nodes: usize) -> RedisCluster {
        let dir = std::env::temp_dir().join(format!("sy-redis-cluster-{}", uuid::Uuid::new_v4().simple()));
        let ports: Vec<u16> = (0..nodes).map(|_| super::free_port()).collect();
        let mut children = Vec::new();
        for port in &ports {
            let node = dir.join(port.to_string());
            std::fs::create_dir_all(&node).expect("node dir");
            children.push(
                Command::new("redis-server")
                    .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                    .args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
                    .args([
                        "--dir",
                        &node.display().to_string(),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                    ])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("run redis-server"),
            );
        }
        for port in &ports {
            let started = Instant::now();
            while tokio::net::TcpStream::connect(("127.0.0.1", *port))
                .await
                .is_err()
            {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "a cluster node did not start"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let addresses: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("run redis-cli");
        assert!(
            created.status.success(),
            "{}",
            String::from_utf8_lossy(&created.stdout)
        );
        let cluster = RedisCluster {
            urls: ports
                .iter()
                .map(|p| format!("redis://127.0.0.1:{p}"))
                .collect::<Vec<_>>()
                .join(","),
            nodes: children,
            dir,
        };
        let started = Instant::now();
        loop {
            let info = Command::new("redis-cli")
                .args(["-p", &ports[0].to_string(), "cluster", "info"])
                .output()
                .expect("redis-cli");
            if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the cluster did not form"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        cluster
    }

    /// Every entry of `stream`, read through the cluster (from the node
    /// serving its slot).
    pub async fn entries(&self, stream: &str) -> Vec<Received> {
        let client = redis::cluster::ClusterClientBuilder::new(self.urls.split(',').collect::<Vec<_>>())
            .connection_timeout(Duration::from_secs(20))
            .response_timeout(Duration::from_secs(60))
            .build()
            .expect("a client");
        let mut connection = client.get_async_connection().await.expect("the cluster answers");
        let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(stream)
            .arg("-")
            .arg("+")
            .query_async(&mut connection)
            .await
            .expect("XRANGE");
        as_messages(stream, entries)
    }

    /// The hash slot of `key`, as the cluster says.
    pub fn slot_of(&self, key: &str) -> String {
        let first = self
            .urls
            .split(',')
            .next()
            .unwrap_or_default()
            .trim_start_matches("redis://");
        let port = first.rsplit(':').next().unwrap_or_default();
        let slot = Command::new("redis-cli")
            .args(["-p", port, "cluster", "keyslot", key])
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&slot.stdout).trim().to_string()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.kill();
            let _ = node.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
