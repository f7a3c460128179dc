//! OCI registries in tests: Debian's distribution (`docker-registry`), over
//! TLS with the test CA's `localhost` certificate and htpasswd login; the
//! shared one `scripts/services.sh` starts, or one of the test's own that it
//! can stop, start again, freeze, move to the rotated password, or run with
//! bearer tokens (distribution's token auth) whose signing key it rotates.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use toml::Value;

use super::config::{path as path_value, table};
use super::postgres::tls_file;

/// The login user `scripts/services.sh` makes.
pub const USER: &str = "switchyard";

/// A registry for a test.
pub struct Registry {
    /// `localhost:PORT`.
    pub host: String,
    logins: PathBuf,
    own: Option<Own>,
}

/// A registry process of the test's own.
struct Own {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    /// Bearer tokens instead of the htpasswd login: the key they are
    /// signed with now.
    signer: Option<Signer>,
}

/// What distribution's token auth trusts: RS256 JWTs carrying, in `x5c`,
/// a certificate of its root bundle. Made with the openssl command, as the
/// test CA is.
struct Signer {
    key: PathBuf,
    cert: PathBuf,
    generation: u32,
}

/// The `service` and `issuer` a token names, as the registry expects them.
const TOKEN_SERVICE: &str = "switchyard-registry";
const TOKEN_ISSUER: &str = "switchyard-tests";

fn openssl(args: &[&str], input: Option<&[u8]>) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("openssl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run openssl");
    let mut stdin = child.stdin.take().expect("openssl stdin");
    if let Some(input) = input {
        stdin.write_all(input).expect("write to openssl");
    }
    drop(stdin);
    let output = child.wait_with_output().expect("openssl");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output.stdout
}

impl Signer {
    fn new(dir: &Path, generation: u32) -> Signer {
        let key = dir.join(format!("token-{generation}.key"));
        let cert = dir.join(format!("token-{generation}.pem"));
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=switchyard token signer {generation}"),
                "-keyout",
                &key.display().to_string(),
                "-out",
                &cert.display().to_string(),
            ],
            None,
        );
        Signer {
            key,
            cert,
            generation,
        }
    }

    /// A token for pulling and pushing `repository`, valid for an hour.
    fn mint(&self, repository: &str) -> String {
        use base64::Engine;
        let b64 = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let der = openssl(
            &["x509", "-in", &self.cert.display().to_string(), "-outform", "DER"],
            None,
        );
        let header = serde_json::json!({
            "typ": "JWT",
            "alg": "RS256",
            "x5c": [base64::engine::general_purpose::STANDARD.encode(der)],
        });
        let now = chrono::Utc::now().timestamp();
        let claims = serde_json::json!({
            "iss": TOKEN_ISSUER,
            "sub": USER,
            "aud": TOKEN_SERVICE,
            "iat": now,
            "nbf": now - 30,
            "exp": now + 3600,
            "jti": uuid::Uuid::new_v4().to_string(),
            "access": [{"type": "repository", "name": repository, "actions": ["pull", "push"]}],
        });
        let signed = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let signature = openssl(
            &["dgst", "-sha256", "-sign", &self.key.display().to_string()],
            Some(signed.as_bytes()),
        );
        format!("{signed}.{}", b64(&signature))
    }
}

fn logins_dir() -> PathBuf {
    std::env::var_os("SWITCHYARD_REGISTRY_DIR")
        .map_or_else(|| "/tmp/switchyard-services/registry".into(), PathBuf::from)
}

impl Registry {
    /// The registry `scripts/services.sh start` runs (`SWITCHYARD_REGISTRY`).
    ///
    /// # Panics
    /// When the variable is not set.
    pub fn shared() -> Registry {
        let host = std::env::var("SWITCHYARD_REGISTRY")
            .expect("SWITCHYARD_REGISTRY is not set: run `eval \"$(scripts/services.sh start)\"`");
        Registry {
            host,
            logins: logins_dir(),
            own: None,
        }
    }

    /// A registry of the test's own on a free port, logging in with the
    /// password in [`Registry::password_file`].
    ///
    /// # Panics
    /// When it does not start.
    pub async fn own() -> Registry {
        Registry::own_registry(false).await
    }

    /// A registry of the test's own taking bearer tokens (see
    /// [`Registry::token`]) instead of the htpasswd login.
    ///
    /// # Panics
    /// When it does not start.
    pub async fn own_with_tokens() -> Registry {
        Registry::own_registry(true).await
    }

    async fn own_registry(tokens: bool) -> Registry {
        let port = super::free_port();
        let dir = std::env::temp_dir().join(format!("sy-registry-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("storage")).expect("registry directory");
        let signer = tokens.then(|| Signer::new(&dir, 1));
        let mut registry = Registry {
            host: format!("localhost:{port}"),
            logins: logins_dir(),
            own: Some(Own {
                dir,
                port,
                child: None,
                signer,
            }),
        };
        registry.configure(false);
        registry.start().await;
        registry
    }

    /// A bearer token for `repository`, signed with the key the registry
    /// trusts now.
    ///
    /// # Panics
    /// On a registry without tokens.
    pub fn token(&self, repository: &str) -> String {
        self.own
            .as_ref()
            .and_then(|own| own.signer.as_ref())
            .expect("a registry with tokens")
            .mint(repository)
    }

    /// Restarts this test's registry trusting only a new signing key: every
    /// token made before is refused.
    ///
    /// # Panics
    /// On a registry without tokens.
    pub async fn rotate_token_key(&mut self) {
        self.stop();
        let own = self.own.as_mut().expect("own registry");
        let generation = own.signer.as_ref().expect("a registry with tokens").generation + 1;
        own.signer = Some(Signer::new(&own.dir, generation));
        self.configure(false);
        self.start().await;
    }

    /// The file holding the password the registry takes now.
    pub fn password_file(&self) -> PathBuf {
        self.logins.join("password")
    }

    /// The file holding the password [`Registry::rotate`] moves to.
    pub fn rotated_password_file(&self) -> PathBuf {
        self.logins.join("password-rotated")
    }

    fn configure(&self, rotated: bool) {
        let own = self
            .own
            .as_ref()
            .expect("only a test's own registry is configured");
        let auth = match &own.signer {
            Some(signer) => format!(
                "  token:\n    realm: https://localhost:{port}/token\n    service: {TOKEN_SERVICE}\n    \
                 issuer: {TOKEN_ISSUER}\n    rootcertbundle: {cert}\n",
                port = own.port,
                cert = signer.cert.display(),
            ),
            None => {
                let htpasswd = self
                    .logins
                    .join(if rotated { "htpasswd-rotated" } else { "htpasswd" });
                format!(
                    "  htpasswd:\n    realm: switchyard\n    path: {}\n",
                    htpasswd.display()
                )
            }
        };
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {storage}\n\
             http:\n  addr: 127.0.0.1:{port}\n  tls:\n    certificate: {cert}\n    key: {key}\n\
             auth:\n{auth}",
            storage = own.dir.join("storage").display(),
            port = own.port,
            cert = tls_file("server.pem"),
            key = tls_file("server.key"),
        );
        std::fs::write(own.dir.join("config.yml"), config).expect("registry config");
    }

    /// Starts (again) this test's registry, with what it stored.
    ///
    /// # Panics
    /// On the shared registry, or when it does not come up.
    pub async fn start(&mut self) {
        let own = self.own.as_mut().expect("only a test's own registry is started");
        let log = std::fs::File::create(own.dir.join("registry.log")).expect("registry log");
        // Its access log (one line a request, on stdout): what a test counts
        // the relay's downloads by.
        let access = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(own.dir.join("access.log"))
            .expect("registry access log");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(own.dir.join("config.yml"))
            .stdout(access)
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run docker-registry ({e}); run scripts/services.sh start to install it")
            });
        own.child = Some(child);
        let started = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", own.port))
            .await
            .is_err()
        {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the registry on port {} did not start; see {}",
                own.port,
                own.dir.join("registry.log").display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills this test's registry.
    ///
    /// # Panics
    /// On the shared registry.
    pub fn stop(&mut self) {
        let own = self.own.as_mut().expect("only a test's own registry is stopped");
        if let Some(mut child) = own.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes this test's registry (SIGSTOP): connections are accepted,
    /// nothing answers.
    ///
    /// # Panics
    /// On the shared registry, or one not running.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen registry go on (SIGCONT).
    ///
    /// # Panics
    /// As [`Registry::freeze`].
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self
            .own
            .as_ref()
            .and_then(|own| own.child.as_ref())
            .expect("only a running registry of the test's own is signalled")
            .id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// Restarts this test's registry taking only the rotated password.
    pub async fn rotate(&mut self) {
        self.stop();
        self.configure(true);
        self.start().await;
    }

    /// Where this test's registry keeps the blob with `digest`: what a
    /// tampering test overwrites.
    ///
    /// # Panics
    /// On the shared registry.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let own = self
            .own
            .as_ref()
            .expect("only a test's own registry's files are known");
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        own.dir
            .join("storage/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// How many times this test's registry served the blob with `digest`
    /// (GET requests in its access log, whatever their status).
    ///
    /// # Panics
    /// On the shared registry.
    pub fn blob_downloads(&self, digest: &str) -> usize {
        let own = self
            .own
            .as_ref()
            .expect("only a test's own registry's log is read");
        let log = std::fs::read_to_string(own.dir.join("access.log")).unwrap_or_default();
        let request = format!("/blobs/{digest} ");
        log.lines()
            .filter(|line| line.contains("\"GET ") && line.contains(&request))
            .count()
    }

    /// `oci://HOST/REPOSITORY:TAG` on this registry.
    pub fn reference(&self, repository: &str, tag: &str) -> String {
        format!("oci://{}/{repository}:{tag}", self.host)
    }

    /// `[plugins.registry]` logging in with the password in `password_file`
    /// (read again on each pull), trusting the test CA, checking tags every
    /// `refresh_seconds`.
    pub fn plugin_settings(&self, password_file: &Path, refresh_seconds: u64) -> Value {
        table(&[
            ("username", Value::String(USER.into())),
            ("password", table(&[("file", path_value(password_file))])),
            ("ca_file", Value::String(tls_file("ca.pem"))),
            (
                "refresh_seconds",
                Value::Integer(i64::try_from(refresh_seconds).unwrap_or(1)),
            ),
        ])
    }

    /// `switchyard plugin push FILE REFERENCE` as a CI pipeline runs it,
    /// trusting the test CA; the login is the caller's to add.
    fn push_command(binary: &str, file: &Path, reference: &str) -> Command {
        let mut command = Command::new(binary);
        command
            .args(["plugin", "push"])
            .arg(file)
            .arg(reference)
            .env("SWITCHYARD_REGISTRY_CA_FILE", tls_file("ca.pem"));
        command
    }

    /// Runs `switchyard plugin push FILE REFERENCE`, logging in with the
    /// password in `password_file`; its output.
    pub fn push_with(
        &self,
        binary: &str,
        file: &Path,
        reference: &str,
        password_file: &Path,
    ) -> std::process::Output {
        Registry::push_command(binary, file, reference)
            .env("SWITCHYARD_REGISTRY_USERNAME", USER)
            .env("SWITCHYARD_REGISTRY_PASSWORD_FILE", password_file)
            .output()
            .expect("run switchyard plugin push")
    }

    /// Runs `switchyard plugin push FILE REFERENCE` with the bearer token in
    /// `token_file`; its output.
    pub fn push_with_token(
        &self,
        binary: &str,
        file: &Path,
        reference: &str,
        token_file: &Path,
    ) -> std::process::Output {
        Registry::push_command(binary, file, reference)
            .env("SWITCHYARD_REGISTRY_TOKEN_FILE", token_file)
            .output()
            .expect("run switchyard plugin push")
    }

    /// Pushes `file` to `reference` and returns the manifest digest it printed.
    ///
    /// # Panics
    /// When the push fails.
    pub fn push(&self, binary: &str, file: &Path, reference: &str) -> String {
        let output = self.push_with(binary, file, reference, &self.password_file());
        assert!(
            output.status.success(),
            "plugin push {} {reference} failed: {}",
            file.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        let printed = String::from_utf8_lossy(&output.stdout);
        printed
            .trim()
            .rsplit_once('@')
            .map(|(_, digest)| digest.to_string())
            .unwrap_or_else(|| panic!("plugin push printed no digest: {printed}"))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if self.own.is_some() {
            self.stop();
        }
        if let Some(own) = &self.own {
            let _ = std::fs::remove_dir_all(&own.dir);
        }
    }
}
