//! The replication connection: reads the outbox's inserts from a logical
//! slot (`pgoutput`), hands them out in batches that end, when they can, on
//! a transaction's commit, and reports back how far they are done.

use std::time::Duration;

use futures::FutureExt;
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};

use super::events::{emitted_row, streamed_row};
use super::pgoutput::Decoder;
use super::source::{SourceTable, source_row};
use crate::store::change_stream::{StreamBatch, StreamError};

/// The outbox table as the WAL names it.
const OUTBOX_TABLE: &str = "public.switchyard_outbox";

impl StreamError {
    fn from_wire(error: PgWireError, slot: &str) -> StreamError {
        let text = error.to_string();
        if text.contains("is active for PID") {
            StreamError::Standby(format!("replication slot {slot:?} is read by another session"))
        } else if text.contains("does not exist") && text.contains("slot") {
            StreamError::Gone(format!(
                "replication slot {slot:?} does not exist (dropped?): run `switchyard migrate` to create it \
                 again; events committed while it was gone were not read and must be replayed from the table"
            ))
        } else if text.contains("can no longer be") || text.contains("invalidated") {
            StreamError::Gone(format!(
                "replication slot {slot:?} was invalidated ({text}): the WAL it needed is gone. Drop it, run \
                 `switchyard migrate` to create it again, and relay the rows it missed in claim mode"
            ))
        } else {
            StreamError::Broken(crate::redact::url(&text))
        }
    }
}

/// How to reach the slot.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    /// The database: URL, TLS and password source.
    pub endpoint: crate::endpoint::Endpoint,
    /// The slot and publication.
    pub slot: String,
    /// The publication read.
    pub publication: String,
    /// `application_name` of the replication session.
    pub application_name: String,
    /// Rows per batch at most.
    pub batch_size: usize,
    /// Retained WAL above this makes the relay unready.
    pub max_retained_wal_bytes: u64,
    /// The `[source]` table, read beside the outbox.
    pub source: Option<SourceTable>,
}

/// Rows read from the slot, done at the end of a transaction's WAL.
pub type WalBatch = StreamBatch<Lsn>;

/// An open replication session.
pub struct WalStream {
    client: ReplicationClient,
    decoder: Decoder,
    slot: String,
    batch_size: usize,
    source: Option<SourceTable>,
    in_transaction: bool,
    /// The open transaction's commit time, ms since the epoch.
    committed_ms: i64,
    /// The last stand-in id's position: each is unique in the session.
    last_position: u64,
}

impl WalStream {
    /// Opens the session and starts reading where the slot was confirmed.
    ///
    /// # Errors
    /// [`StreamError::Standby`] while another relay reads the slot,
    /// [`StreamError::Gone`] when it cannot be read, else `Broken`.
    pub async fn open(settings: &StreamSettings) -> Result<WalStream, StreamError> {
        let config = replication_config(settings).await?;
        let mut client = ReplicationClient::connect(config).await.map_err(|e| match e {
            // Connecting again may succeed once the server or the
            // settings are mended: the feed waits, as for any outage.
            PgWireError::Tls(reason) => {
                StreamError::Broken(crate::tls::wire_problem(&settings.endpoint, &reason))
            }
            e => StreamError::from_wire(e, &settings.slot),
        })?;
        client
            .wait_started()
            .await
            .map_err(|e| StreamError::from_wire(e, &settings.slot))?;
        Ok(WalStream {
            client,
            decoder: Decoder::default(),
            slot: settings.slot.clone(),
            batch_size: settings.batch_size.max(1),
            source: settings.source.clone(),
            in_transaction: false,
            committed_ms: 0,
            last_position: 0,
        })
    }

    /// Waits for the stream to move, then takes what has arrived, up to
    /// the batch size. A batch may have no rows: transactions without
    /// outbox rows, or a keepalive, moved the position only.
    ///
    /// # Errors
    /// The session ended or sent what cannot be read.
    pub async fn next_batch(&mut self) -> Result<WalBatch, StreamError> {
        let mut batch = WalBatch::default();
        let first = self.client.recv().await;
        self.take(first, &mut batch)?;
        while batch.rows.len() < self.batch_size {
            let Some(next) = self.client.recv().now_or_never() else {
                break;
            };
            self.take(next, &mut batch)?;
        }
        Ok(batch)
    }

    fn take(
        &mut self,
        event: Result<Option<ReplicationEvent>, PgWireError>,
        batch: &mut WalBatch,
    ) -> Result<(), StreamError> {
        let event = event
            .map_err(|e| StreamError::from_wire(e, &self.slot))?
            .ok_or_else(|| StreamError::Broken("the server ended the replication stream".into()))?;
        match event {
            ReplicationEvent::Begin {
                commit_time_micros, ..
            } => {
                self.in_transaction = true;
                // PostgreSQL's epoch is 2000-01-01.
                self.committed_ms = commit_time_micros / 1000 + 946_684_800_000;
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.in_transaction = false;
                batch.done_at = batch.done_at.max(Some(end_lsn));
            }
            ReplicationEvent::Message {
                transactional: true,
                lsn,
                prefix,
                content,
            } if prefix == super::EMIT_PREFIX => batch.rows.push(emitted_row(lsn, &content)),
            ReplicationEvent::XLogData { data, wal_start, .. } => {
                let inserted = self
                    .decoder
                    .decode(&data)
                    .map_err(|e| StreamError::Broken(e.to_string()))?;
                let Some(inserted) = inserted else {
                    return Ok(());
                };
                if inserted.relation.table == OUTBOX_TABLE {
                    batch.rows.push(streamed_row(inserted));
                } else if let Some(source) = self
                    .source
                    .as_ref()
                    .filter(|s| s.relation == inserted.relation.table)
                {
                    let position = wal_start.as_u64().max(self.last_position + 1);
                    self.last_position = position;
                    batch
                        .rows
                        .push(source_row(&inserted, source, position, self.committed_ms));
                }
            }
            // Between transactions every row before it is handed out (in
            // this batch or an earlier one): the slot may move on with the
            // batch, so that an outbox with no new rows retains no WAL.
            ReplicationEvent::KeepAlive { wal_end, .. } if !self.in_transaction => {
                batch.done_at = batch.done_at.max(Some(wal_end));
            }
            _ => {}
        }
        Ok(())
    }

    /// Everything before `lsn` is published or in the table: the slot may
    /// release it. Reported to the server within a second.
    pub fn confirm(&self, lsn: Lsn) {
        self.client.update_applied_lsn(lsn);
    }

    /// Ends the session, reporting what was confirmed.
    pub async fn close(self) {
        self.client.stop();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.client.join()).await;
    }
}

/// The session's settings from the endpoint: the same host, login and TLS
/// as the relay's pool, the password read now.
async fn replication_config(
    settings: &StreamSettings,
) -> Result<pgwire_replication::ReplicationConfig, StreamError> {
    use pgwire_replication::{SslMode as Wire, TlsConfig};
    use sqlx::postgres::PgSslMode;
    crate::tls::install_provider();
    let options = settings
        .endpoint
        .pg_options()
        .await
        .map_err(|e| StreamError::Broken(crate::redact::url(&e.to_string())))?;
    let password = match settings.endpoint.password().await {
        Ok(Some(secret)) => secret.expose().to_string(),
        _ => url_password(settings.endpoint.url())
            .or_else(|| std::env::var("PGPASSWORD").ok())
            .unwrap_or_default(),
    };
    let host = match options.get_socket() {
        Some(dir) => dir.display().to_string(),
        None => options.get_host().to_string(),
    };
    let path = |key: &str| settings.endpoint.parameter(key).map(std::path::PathBuf::from);
    let tls = TlsConfig {
        mode: match options.get_ssl_mode() {
            PgSslMode::Disable | PgSslMode::Allow => Wire::Disable,
            PgSslMode::Prefer => Wire::Prefer,
            PgSslMode::Require => Wire::Require,
            PgSslMode::VerifyCa => Wire::VerifyCa,
            PgSslMode::VerifyFull => Wire::VerifyFull,
        },
        ca_pem_path: path("sslrootcert"),
        sni_hostname: None,
        client_cert_pem_path: path("sslcert"),
        client_key_pem_path: path("sslkey"),
    };
    let mut config = pgwire_replication::ReplicationConfig::new(
        host,
        options.get_username(),
        password,
        options.get_database().unwrap_or(options.get_username()),
        settings.slot.clone(),
        settings.publication.clone(),
    )
    .with_port(options.get_port())
    .with_tls(tls)
    .with_status_interval(Duration::from_secs(1))
    .with_wakeup_interval(Duration::from_secs(10))
    // Bounded: a paused relay leaves the rest in the WAL, not in memory.
    .with_buffer_size(settings.batch_size.clamp(64, 4096) * 2)
    // Values rendered as the table reads them back.
    .with_options("-c datestyle=ISO -c timezone=UTC -c bytea_output=hex -c extra_float_digits=3")
    .with_application_name(settings.application_name.clone());
    config.max_message_size = 256 << 20;
    Ok(config)
}

/// The password in a URL, percent-decoded.
fn url_password(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok()?;
    let password = parsed.password()?;
    Some(
        percent_encoding::percent_decode_str(password)
            .decode_utf8_lossy()
            .into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_another_session_reads_means_standing_by() {
        let active = PgWireError::Server("ERROR 55006: replication slot \"s\" is active for PID 7".into());
        assert!(matches!(
            StreamError::from_wire(active, "s"),
            StreamError::Standby(_)
        ));
        let gone = PgWireError::Server("ERROR 42704: replication slot \"s\" does not exist".into());
        assert!(matches!(StreamError::from_wire(gone, "s"), StreamError::Gone(_)));
        let io = PgWireError::Io(std::sync::Arc::new(std::io::Error::other("reset")));
        assert!(matches!(StreamError::from_wire(io, "s"), StreamError::Broken(_)));
    }
}
