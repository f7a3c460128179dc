//! A target that could not be connected when the relay started: the relay
//! starts without it and connects it when it answers, so a broker outage
//! at start pauses that target instead of stopping the relay.
//!
//! Until it connects, every publish fails as `unavailable` (which, by
//! default, spends no attempt and pauses the target) and every health
//! check tries to connect once, which is how the outage probe and
//! `/readyz` find it back.

use std::sync::{Arc, Mutex, OnceLock};

use futures::future::BoxFuture;

use super::{OutgoingMessage, Sink, SinkError, SinkSettings, TargetConfig};

/// A target connected on first success.
pub(crate) struct Deferred {
    name: String,
    kind: &'static str,
    deduplicates: bool,
    config: TargetConfig,
    settings: SinkSettings,
    connected: OnceLock<Arc<dyn Sink>>,
    /// One connection attempt at a time; callers that find one under way
    /// do not wait for it.
    connecting: tokio::sync::Mutex<()>,
    /// Why the latest attempt failed.
    reason: Mutex<SinkError>,
}

impl Deferred {
    pub(crate) fn new(
        name: &str,
        config: &TargetConfig,
        settings: &SinkSettings,
        first: SinkError,
    ) -> Deferred {
        Deferred {
            name: name.to_string(),
            kind: config.kind(),
            deduplicates: config.deduplicates_by_id(),
            config: config.clone(),
            settings: settings.clone(),
            connected: OnceLock::new(),
            connecting: tokio::sync::Mutex::new(()),
            reason: Mutex::new(first),
        }
    }

    fn reason(&self) -> SinkError {
        let reason = match self.reason.lock() {
            Ok(reason) => reason.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        // Whatever the connection said, nothing was sent: the target is
        // not there yet, which is no fault of the event's.
        SinkError::unavailable(format!("target {:?} not connected yet: {reason}", self.name))
    }

    /// The sink, connecting it if no attempt is under way.
    async fn sink(&self) -> Result<&Arc<dyn Sink>, SinkError> {
        if let Some(sink) = self.connected.get() {
            return Ok(sink);
        }
        let Ok(_attempt) = self.connecting.try_lock() else {
            return Err(self.reason());
        };
        if let Some(sink) = self.connected.get() {
            return Ok(sink);
        }
        match self.config.build(&self.name, &self.settings).await {
            Ok(sink) => {
                tracing::info!(sink.name = %self.name, sink.kind = self.kind, "Target connected.");
                Ok(self.connected.get_or_init(|| sink))
            }
            Err(error) => {
                tracing::debug!(sink.name = %self.name, %error, "Target still not connected.");
                match self.reason.lock() {
                    Ok(mut reason) => *reason = error,
                    Err(poisoned) => *poisoned.into_inner() = error,
                }
                Err(self.reason())
            }
        }
    }
}

impl Sink for Deferred {
    fn kind(&self) -> &'static str {
        self.kind
    }

    fn publish(&self, messages: Vec<OutgoingMessage>) -> BoxFuture<'_, Vec<Result<(), SinkError>>> {
        Box::pin(async move {
            match self.sink().await {
                Ok(sink) => sink.publish(messages).await,
                Err(error) => messages.iter().map(|_| Err(error.clone())).collect(),
            }
        })
    }

    fn healthcheck(&self) -> BoxFuture<'_, Result<(), SinkError>> {
        Box::pin(async move { self.sink().await?.healthcheck().await })
    }

    fn deduplicates_by_id(&self) -> bool {
        self.deduplicates
    }
}
