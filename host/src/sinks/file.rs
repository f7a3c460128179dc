//! The `file` target: appends one JSON object per message to a file (JSON
//! lines), for demos, debugging and tests. A batch is acknowledged once
//! written and, by default, synced to disk.

use std::path::PathBuf;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde::Deserialize;
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

use super::registry::{SinkSettings, TargetKind};
use super::{OutgoingMessage, Sink, SinkError, render_json_line};

/// `[targets.NAME]` with `type = "file"`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FileSinkConfig {
    /// The file to append to; created if missing.
    pub path: PathBuf,
    /// Sync to disk before acknowledging (an ack then survives a power cut).
    #[serde(default = "default_fsync")]
    pub fsync: bool,
}

const fn default_fsync() -> bool {
    true
}

/// Appends JSON lines to a file.
pub struct FileSink {
    name: String,
    path: PathBuf,
    fsync: bool,
    file: Arc<Mutex<tokio::fs::File>>,
}

impl FileSink {
    /// Opens (creating) the file for appending.
    ///
    /// # Errors
    /// When the file cannot be opened.
    pub async fn open(name: &str, config: &FileSinkConfig) -> Result<FileSink, SinkError> {
        if let Some(parent) = config.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| SinkError::permanent(format!("cannot create {}: {e}", parent.display())))?;
        }
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&config.path)
            .await
            .map_err(|e| SinkError::permanent(format!("cannot open {}: {e}", config.path.display())))?;
        Ok(FileSink {
            name: name.to_string(),
            path: config.path.clone(),
            fsync: config.fsync,
            file: Arc::new(Mutex::new(file)),
        })
    }
}

impl Sink for FileSink {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let text: String = messages
                .iter()
                .map(|m| render_json_line(&self.name, m) + "\n")
                .collect();
            let mut file = self.file.lock().await;
            let mut written = file.write_all(text.as_bytes()).await;
            if written.is_ok() {
                written = file.flush().await;
            }
            if written.is_ok() && self.fsync {
                written = file.sync_data().await;
            }
            let result = written
                .map_err(|e| SinkError::unavailable(format!("cannot write to {}: {e}", self.path.display())));
            vec![result; messages.len()]
        })
    }

    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async { Ok(()) })
    }
}
impl TargetKind for FileSinkConfig {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn validate(&self, _settings: &SinkSettings) -> Vec<String> {
        if self.path.as_os_str().is_empty() {
            vec!["path is empty".into()]
        } else {
            Vec::new()
        }
    }

    async fn build(&self, name: &str, _settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        Ok(Arc::new(FileSink::open(name, self).await?) as Arc<dyn Sink>)
    }
}
