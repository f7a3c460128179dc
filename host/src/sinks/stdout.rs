//! The `stdout` target: prints each message, for demos and debugging.
//! Acknowledged once written to the process's standard output.

use std::io::Write;

use std::sync::Arc;

use futures::future::BoxFuture;
use serde::Deserialize;

use super::registry::{SinkSettings, TargetKind};
use super::{OutgoingMessage, Sink, SinkError, render_json_line};

/// How the `stdout` target prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StdoutFormat {
    /// One readable line per message plus the payload.
    #[default]
    Text,
    /// One JSON object per line, as the `file` target writes.
    Json,
}

/// `[targets.NAME]` with `type = "stdout"`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StdoutSinkConfig {
    /// Output format.
    #[serde(default)]
    pub format: StdoutFormat,
}

/// Prints messages.
pub struct StdoutSink {
    name: String,
    format: StdoutFormat,
}

impl StdoutSink {
    /// A sink printing as `config` says; `name` labels its lines.
    pub fn new(name: &str, config: &StdoutSinkConfig) -> StdoutSink {
        StdoutSink {
            name: name.to_string(),
            format: config.format,
        }
    }

    fn render(&self, message: &OutgoingMessage) -> String {
        match self.format {
            StdoutFormat::Json => render_json_line(&self.name, message),
            StdoutFormat::Text => {
                let payload = String::from_utf8_lossy(&message.payload);
                format!(
                    "[{}] {}  key={}  event={}\n    {}",
                    self.name,
                    message.topic,
                    message.key.as_deref().unwrap_or("-"),
                    message.event_id,
                    payload
                )
            }
        }
    }
}

impl Sink for StdoutSink {
    fn kind(&self) -> &'static str {
        "stdout"
    }

    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            let text: String = messages.iter().map(|m| self.render(m) + "\n").collect();
            let written = {
                let mut out = std::io::stdout().lock();
                out.write_all(text.as_bytes()).and_then(|()| out.flush())
            };
            let result = written.map_err(|e| SinkError::unavailable(format!("cannot write to stdout: {e}")));
            vec![result; messages.len()]
        })
    }

    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async { Ok(()) })
    }
}
impl TargetKind for StdoutSinkConfig {
    fn kind(&self) -> &'static str {
        "stdout"
    }

    async fn build(&self, name: &str, _settings: &SinkSettings) -> Result<Arc<dyn Sink>, SinkError> {
        Ok(Arc::new(StdoutSink::new(name, self)) as Arc<dyn Sink>)
    }
}
