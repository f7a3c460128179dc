//! Assembling a relay: its parts, and what it may also have, given once
//! before it exists (no setter can race a running worker).

use std::sync::Arc;

use super::{Feed, Inner, NativeRouter, Relay, RetryPolicy, default_owner, outage};
use crate::config::RelayConfig;
use crate::metrics::Metrics;
use crate::plugin::Plugins;
use crate::plugin::watch::PluginWatcher;
use crate::relay::router::Limits;
use crate::sinks::Sinks;
use crate::store::OutboxStore;
use crate::store::capture::Capture;
use crate::store::replication::{BinlogSettings, StreamSettings};

/// A relay being assembled; [`Relay::builder`] starts one.
#[must_use = "a builder does nothing until `build`"]
pub struct RelayBuilder {
    pub(super) store: OutboxStore,
    pub(super) plugins: Plugins,
    pub(super) sinks: Sinks,
    pub(super) config: RelayConfig,
    pub(super) watcher: Option<PluginWatcher>,
    pub(super) native_router: Option<NativeRouter>,
    pub(super) capture: Option<Capture>,
    pub(super) replication: Option<StreamSettings>,
    pub(super) binlog: Option<BinlogSettings>,
    pub(super) metrics: Option<Metrics>,
    pub(super) database: Option<String>,
    pub(super) listen: bool,
}

impl RelayBuilder {
    /// Keeps a plugin watcher alive as long as the relay (hot reload).
    pub fn watcher(mut self, watcher: Option<PluginWatcher>) -> Self {
        self.watcher = watcher;
        self
    }

    /// Routes every event with `router` instead of the configured plugins.
    pub fn native_router(mut self, router: NativeRouter) -> Self {
        self.native_router = Some(router);
        self
    }

    /// The `[source]` capture trigger this relay depends on: `/readyz`
    /// checks that it is still there and enabled.
    pub fn capture(mut self, capture: Option<Capture>) -> Self {
        self.capture = capture;
        self
    }

    /// Reads new events from this replication slot instead of waiting for
    /// commits to claim them; the claim path keeps relaying what the feed
    /// hands over to the table.
    pub fn replication(mut self, settings: Option<StreamSettings>) -> Self {
        self.replication = settings;
        self
    }

    /// Reads new events from the MariaDB binary log (binlog mode), the
    /// MySQL form of [`RelayBuilder::replication`].
    pub fn binlog(mut self, settings: Option<BinlogSettings>) -> Self {
        self.binlog = settings;
        self
    }

    /// Records into `metrics` (one database's view of a registry shared
    /// with others) instead of a registry of its own.
    pub fn metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Tells plugins (`host.database`) that the events come from the
    /// database `name`, one of several this process serves.
    pub fn database(mut self, name: &str) -> Self {
        self.database = Some(name.to_string());
        self
    }

    /// Whether a session LISTENs for commits (the default) or the poll
    /// alone finds new rows, which saves that session.
    pub fn listen(mut self, listen: bool) -> Self {
        self.listen = listen;
        self
    }

    /// The relay, ready to run.
    pub fn build(self) -> Relay {
        let config = self.config;
        let owner = config.instance_id.clone().unwrap_or_else(default_owner);
        let limits = Limits::from_config(&config);
        let metrics = self
            .metrics
            .unwrap_or_else(|| Metrics::new(Some(self.plugins.scraped())));
        Relay {
            inner: Arc::new(Inner {
                health: super::WorkerHealth::default(),
                outages: outage::Outages::default(),
                wake: Arc::new(tokio::sync::Notify::new()),
                held: super::claim_feed::HeldOutcomes::default(),
                claim_gate: super::claim_feed::ClaimGate::default(),
                _watcher: self.watcher,
                native_router: self.native_router,
                capture: self.capture,
                feed: match (self.replication, self.binlog) {
                    (Some(slot), _) => Feed::Wal {
                        slot: Box::new(slot),
                        listen: self.listen,
                    },
                    (None, Some(binlog)) => Feed::Binlog {
                        settings: Box::new(binlog),
                    },
                    (None, None) => Feed::Claim { listen: self.listen },
                },
                retry: RetryPolicy::from_config(&config),
                metrics,
                store: self.store,
                plugins: self.plugins,
                sinks: self.sinks,
                config,
                owner,
                limits,
                database: self.database,
            }),
        }
    }
}
