//! A webhook receiver of the test's own (`webhook_receiver.py` beside this
//! file, run with the Python that `scripts/services.sh` installs the
//! Standard Webhooks reference implementation into): it records every
//! request with whether each of its secrets verifies the signature, and
//! answers as the test's plan says at that moment. Killed and started
//! again on its port, or told to answer 503, 429 with `Retry-After`, or 400
//! to one event type.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::nats::Received;

/// One request the receiver recorded.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// When it arrived (Unix seconds).
    pub time: f64,
    /// `POST`, `PUT`, or `HEAD` (the relay's health check).
    pub method: String,
    /// The path.
    pub path: String,
    /// Its headers, names in lower case.
    pub headers: HashMap<String, String>,
    /// Its body.
    pub body: Vec<u8>,
    /// Whether each of the receiver's secrets verified its signature.
    pub verified: Vec<bool>,
    /// What the receiver answered.
    pub status: u16,
}

impl Recorded {
    /// As a consumer reads a single-event request: its headers and body.
    pub fn as_message(&self) -> Received {
        let headers = self
            .headers
            .iter()
            .map(|(k, v)| {
                // The relay's headers by their usual names, for the checks.
                let name = match k.as_str() {
                    "switchyard-event-id" => "Switchyard-Event-Id".to_string(),
                    "switchyard-event-type" => "Switchyard-Event-Type".to_string(),
                    "switchyard-aggregate-id" => "Switchyard-Aggregate-Id".to_string(),
                    _ => k.clone(),
                };
                (name, v.clone())
            })
            .collect();
        Received {
            subject: self.path.clone(),
            headers,
            payload: self.body.clone(),
        }
    }
}

/// A receiver process on a port of the test's own.
pub struct Receiver {
    /// `https://localhost:PORT` (or `http://127.0.0.1:PORT`).
    pub url: String,
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

fn python() -> String {
    std::env::var("SWITCHYARD_WEBHOOK_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

impl Receiver {
    /// A receiver checking signatures with `secrets`; over TLS with the
    /// test CA's `localhost` certificate when `tls`, requiring a client
    /// certificate the CA signed when `client_certificates`.
    ///
    /// # Panics
    /// When it does not start.
    pub async fn start(tls: bool, client_certificates: bool, secrets: &[&str]) -> Receiver {
        let port = super::free_port();
        let dir = std::env::temp_dir().join(format!("sy-webhook-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("receiver dir");
        let mut args = vec![
            port.to_string(),
            dir.join("requests.jsonl").display().to_string(),
            dir.join("plan.json").display().to_string(),
        ];
        if tls {
            let tls_file = |name: &str| super::postgres::tls_file(name);
            args.extend([
                "--tls".to_string(),
                tls_file("server.pem"),
                tls_file("server.key"),
            ]);
            if client_certificates {
                args.push(tls_file("ca.pem"));
            }
        }
        for secret in secrets {
            args.extend(["--secret".to_string(), (*secret).to_string()]);
        }
        let url = if tls {
            format!("https://localhost:{port}")
        } else {
            format!("http://127.0.0.1:{port}")
        };
        let mut receiver = Receiver {
            url,
            port,
            dir,
            args,
            child: None,
        };
        receiver.resume().await;
        receiver
    }

    /// Starts it again on its port (after [`Receiver::kill`]).
    ///
    /// # Panics
    /// When it does not come up within 30 s.
    pub async fn resume(&mut self) {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("support/webhook_receiver.py");
        let child = Command::new(python())
            .arg(script)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run the webhook receiver (scripts/services.sh install makes its Python)");
        self.child = Some(child);
        let started = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the webhook receiver did not start"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills it: connections are refused until [`Receiver::resume`].
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// How it answers from now on (see `webhook_receiver.py`).
    pub fn plan(&self, plan: &serde_json::Value) {
        let path = self.dir.join("plan.json");
        let tmp = self.dir.join("plan.json.tmp");
        std::fs::write(&tmp, plan.to_string()).expect("plan");
        std::fs::rename(tmp, path).expect("plan");
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<Recorded> {
        use base64::Engine as _;
        let text = std::fs::read_to_string(self.dir.join("requests.jsonl")).unwrap_or_default();
        text.lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .map(|record| Recorded {
                time: record["time"].as_f64().unwrap_or_default(),
                method: record["method"].as_str().unwrap_or_default().to_string(),
                path: record["path"].as_str().unwrap_or_default().to_string(),
                headers: record["headers"]
                    .as_object()
                    .map(|h| {
                        h.iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                            .collect()
                    })
                    .unwrap_or_default(),
                body: base64::engine::general_purpose::STANDARD
                    .decode(record["body"].as_str().unwrap_or_default())
                    .unwrap_or_default(),
                verified: record["verified"]
                    .as_array()
                    .map(|v| v.iter().map(|b| b.as_bool().unwrap_or(false)).collect())
                    .unwrap_or_default(),
                status: u16::try_from(record["status"].as_u64().unwrap_or_default()).unwrap_or_default(),
            })
            .collect()
    }

    /// The requests it answered 2xx, as a consumer's messages (health
    /// checks left out).
    pub fn delivered(&self) -> Vec<Received> {
        self.requests()
            .iter()
            .filter(|r| (200..300).contains(&r.status) && r.method != "HEAD")
            .map(Recorded::as_message)
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh `whsec_` secret.
pub fn secret() -> String {
    use base64::Engine as _;
    let bytes: Vec<u8> = (0..24).map(|_| rand_byte()).collect();
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn rand_byte() -> u8 {
    uuid::Uuid::new_v4().as_bytes()[0]
}
