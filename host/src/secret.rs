//! Secrets that rotate: a password read from a file (a Kubernetes or
//! Docker secret mount) or printed by a command (an RDS IAM token, a Vault
//! lease), read again while the relay runs so that new connections log in
//! with the current one. A secret's value never reaches a log, an error or
//! `Debug` output.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// Where a password comes from (`[database.password]`, `[catalog.password]`):
/// exactly one of `file` and `command`.
#[derive(Clone, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SecretConfig {
    /// A file whose content (without its trailing newline) is the password.
    #[serde(default)]
    pub file: Option<PathBuf>,
    /// A program and its arguments, run without a shell, whose standard
    /// output (without its trailing newline) is the password, e.g.
    /// `["aws", "rds", "generate-db-auth-token", "--hostname", "db.example.com", "--port", "5432", "--username", "relay"]`.
    #[serde(default)]
    pub command: Vec<String>,
    /// Bound on one run of `command`; past it the run is killed and the
    /// connection waits for the next try.
    #[serde(default = "default_command_timeout_ms")]
    pub command_timeout_ms: u64,
    /// How often a running relay reads the password again, for the
    /// connections it opens next (sessions already open keep theirs, as
    /// PostgreSQL allows). Defaults to 5 s for a file and 300 s for a
    /// command (RDS IAM tokens live 15 minutes).
    #[serde(default)]
    pub refresh_seconds: Option<u64>,
}

/// The command's arguments may carry a token of their own (`--token=...`):
/// only the program is shown.
impl std::fmt::Debug for SecretConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretConfig")
            .field("file", &self.file)
            .field("program", &self.command.first())
            .field("arguments", &self.command.len().saturating_sub(1))
            .field("refresh_seconds", &self.refresh_seconds)
            .finish()
    }
}

const fn default_command_timeout_ms() -> u64 {
    10_000
}

impl SecretConfig {
    /// The password in `path`, for `*_FILE` environment variables.
    pub fn from_file(path: PathBuf) -> SecretConfig {
        SecretConfig {
            file: Some(path),
            command: Vec::new(),
            command_timeout_ms: default_command_timeout_ms(),
            refresh_seconds: None,
        }
    }

    /// How often the secret is read again.
    pub fn refresh(&self) -> Duration {
        let default = if self.file.is_some() { 5 } else { 300 };
        Duration::from_secs(self.refresh_seconds.unwrap_or(default).max(1))
    }

    /// What is wrong with the settings, `key` naming them; empty when fine.
    /// A file is checked for being readable, a command is not run.
    pub fn problems(&self, key: &str) -> Vec<String> {
        let mut problems = Vec::new();
        match (&self.file, self.command.is_empty()) {
            (Some(_), false) => problems.push(format!("{key}: set file or command, not both")),
            (None, true) => problems.push(format!("{key}: set file or command")),
            (Some(path), true) => {
                if let Err(error) = std::fs::metadata(path) {
                    problems.push(format!("{key}.file {}: {error}", path.display()));
                }
            }
            (None, false) => {}
        }
        if self.command_timeout_ms == 0 {
            problems.push(format!("{key}.command_timeout_ms must be at least 1"));
        }
        problems
    }

    /// Reads the secret now.
    ///
    /// # Errors
    /// The file cannot be read or is empty; the command cannot start,
    /// fails, times out or prints nothing. The message names the file or
    /// program and carries the command's standard error, cut short; never
    /// the secret.
    pub async fn read(&self) -> Result<Secret, Error> {
        match &self.file {
            Some(path) => {
                let text = tokio::fs::read_to_string(path)
                    .await
                    .map_err(|source| Error::File {
                        path: path.clone(),
                        source,
                    })?;
                non_empty(text, || Error::Empty(format!("password file {}", path.display())))
            }
            None => self.run().await,
        }
    }

    async fn run(&self) -> Result<Secret, Error> {
        let Some((program, args)) = self.command.split_first() else {
            return Err(Error::Empty("password command (none set)".into()));
        };
        let child = tokio::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .output();
        let timeout = Duration::from_millis(self.command_timeout_ms);
        let output = tokio::time::timeout(timeout, child)
            .await
            .map_err(|_| Error::Timeout {
                program: program.clone(),
                ms: self.command_timeout_ms,
            })?
            .map_err(|source| Error::Spawn {
                program: program.clone(),
                source,
            })?;
        if !output.status.success() {
            return Err(Error::Failed {
                program: program.clone(),
                status: output.status.to_string(),
                stderr: cut(&String::from_utf8_lossy(&output.stderr)),
            });
        }
        let text = String::from_utf8(output.stdout).map_err(|_| Error::Failed {
            program: program.clone(),
            status: "success".into(),
            stderr: "its output is not UTF-8".into(),
        })?;
        non_empty(text, || Error::Empty(format!("password command {program:?}")))
    }
}

/// A broker's secret: the value itself, or where to read it each time a
/// connection is made (`password = { file = "/run/secrets/nats" }`).
#[derive(Clone, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(untagged)]
pub enum SecretValue {
    /// The value, in the file or from the environment.
    Value(String),
    /// Read from a file or a command for each new connection.
    From(SecretConfig),
}

impl SecretValue {
    /// From the environment: `NAME_FILE` names a file read again for each
    /// connection (so the secret may rotate), else `NAME` holds the value.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<SecretValue> {
        match env(&format!("{name}_FILE")) {
            Some(path) => Some(SecretValue::From(SecretConfig::from_file(path.into()))),
            None => env(name).map(SecretValue::Value),
        }
    }

    /// The secret now.
    ///
    /// # Errors
    /// As [`SecretConfig::read`].
    pub async fn read(&self) -> Result<Secret, Error> {
        match self {
            SecretValue::Value(value) => Ok(Secret(value.clone())),
            SecretValue::From(source) => source.read().await,
        }
    }

    /// What is wrong with a source, `key` naming it.
    pub fn problems(&self, key: &str) -> Vec<String> {
        match self {
            SecretValue::Value(_) => Vec::new(),
            SecretValue::From(source) => source.problems(key),
        }
    }
}

/// A secret read for each use, but at most once per its source's
/// `refresh_seconds` (a value given inline never changes): a client that
/// sends it with every request (a bearer token, a signing secret) takes up
/// a rotated one within that time, without a file read per request.
#[derive(Debug)]
pub struct Held {
    source: SecretValue,
    held: tokio::sync::Mutex<Option<(Secret, std::time::Instant)>>,
}

impl Held {
    /// Holds `source`.
    pub fn new(source: SecretValue) -> Held {
        Held {
            source,
            held: tokio::sync::Mutex::new(None),
        }
    }

    /// The secret, read again when its source's refresh time has passed.
    ///
    /// # Errors
    /// As [`SecretConfig::read`]; an earlier value is not served instead.
    pub async fn get(&self) -> Result<Secret, Error> {
        let mut held = self.held.lock().await;
        let refresh = match &self.source {
            SecretValue::Value(_) => Duration::MAX,
            SecretValue::From(source) => source.refresh(),
        };
        if let Some((secret, read)) = held.as_ref()
            && read.elapsed() < refresh
        {
            return Ok(secret.clone());
        }
        let secret = self.source.read().await?;
        *held = Some((secret.clone(), std::time::Instant::now()));
        Ok(secret)
    }
}

/// A value shows as `***`; a source's file or command is no secret.
impl std::fmt::Debug for SecretValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretValue::Value(_) => f.write_str("***"),
            SecretValue::From(source) => source.fmt(f),
        }
    }
}

fn non_empty(mut text: String, empty: impl FnOnce() -> Error) -> Result<Secret, Error> {
    while text.ends_with(['\n', '\r']) {
        text.pop();
    }
    if text.is_empty() {
        return Err(empty());
    }
    Ok(Secret(text))
}

/// A command's standard error as a log line: one line, at most 300
/// characters, URL credentials masked.
fn cut(stderr: &str) -> String {
    let line: String = stderr.split_whitespace().collect::<Vec<_>>().join(" ");
    let short: String = line.chars().take(300).collect();
    let short = if short.len() < line.len() {
        format!("{short}...")
    } else {
        short
    };
    crate::redact::url(&short)
}

/// A secret's value: shown as `***` by `Debug`; read with [`Secret::expose`].
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The value, for the one call that sends it to a server.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Why a secret could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file is missing or unreadable.
    #[error("cannot read password file {}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file or the command's output held nothing.
    #[error("{0} is empty")]
    Empty(String),
    /// The program could not be started.
    #[error("password command {program:?} could not start: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The program exited with a failure.
    #[error("password command {program:?} failed ({status}): {stderr}")]
    Failed {
        /// The program.
        program: String,
        /// Its exit status.
        status: String,
        /// Its standard error, cut short.
        stderr: String,
    },
    /// The program did not finish in time.
    #[error("password command {program:?} gave no answer within {ms} ms (command_timeout_ms)")]
    Timeout {
        /// The program.
        program: String,
        /// The bound.
        ms: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(argv: &[&str]) -> SecretConfig {
        SecretConfig {
            file: None,
            command: argv.iter().map(|s| s.to_string()).collect(),
            command_timeout_ms: 2_000,
            refresh_seconds: None,
        }
    }

    #[tokio::test]
    async fn a_command_prints_the_secret_and_its_newline_is_dropped() {
        let secret = command(&["printf", "s3cret\n"]).read().await.unwrap();
        assert_eq!(secret.expose(), "s3cret");
        assert_eq!(format!("{secret:?}"), "Secret(***)");
    }

    #[tokio::test]
    async fn a_failing_command_says_its_stderr_and_not_its_stdout() {
        let error = command(&["sh", "-c", "echo leaked-value; echo 'token expired' >&2; exit 3"])
            .read()
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("token expired"), "{error}");
        assert!(error.contains("exit status: 3"), "{error}");
        assert!(!error.contains("leaked-value"), "{error}");
    }

    #[tokio::test]
    async fn a_command_that_hangs_is_killed_at_its_timeout() {
        let mut slow = command(&["sleep", "30"]);
        slow.command_timeout_ms = 200;
        let started = std::time::Instant::now();
        let error = slow.read().await.unwrap_err();
        assert!(matches!(error, Error::Timeout { ms: 200, .. }), "{error}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn a_missing_or_empty_file_is_named() {
        let dir = std::env::temp_dir().join(format!("switchyard-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let error = SecretConfig::from_file(empty)
            .read()
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("empty"), "{error}");
        let missing = SecretConfig::from_file(dir.join("missing"));
        let error = missing.read().await.unwrap_err().to_string();
        assert!(error.contains("missing"), "{error}");
        assert_eq!(missing.problems("database.password").len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn debug_output_shows_the_program_but_not_its_arguments() {
        let shown = format!(
            "{:?}",
            command(&["vault", "read", "--token=s.hunter2", "secret/db"])
        );
        assert!(shown.contains("vault"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn exactly_one_source_is_set() {
        let mut both = command(&["true"]);
        both.file = Some("/x".into());
        assert!(both.problems("k")[0].contains("not both"));
        assert!(command(&[]).problems("k")[0].contains("set file or command"));
        assert!(command(&["true"]).problems("k").is_empty());
    }
}
