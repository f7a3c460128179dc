//! The replication connection: reads the outbox's inserts from a logical
//! slot (`pgoutput`), hands them out in batches that end, when they can, on
//! a transaction's commit, and reports back how far they are done.

use std::time::Duration;

use futures::FutureExt;
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};

use super::pgoutput::{Decoder, Inserted};
use crate::store::types::{OutboxRow, RowId};

/// The outbox table as the WAL names it.
const OUTBOX_TABLE: &str = "public.switchyard_outbox";

/// Why the stream ended.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// Another session reads the slot: this relay stands by.
    #[error("{0}")]
    Standby(String),
    /// The slot cannot be read again (dropped, invalidated): an operator
    /// has to act.
    #[error("{0}")]
    Gone(String),
    /// The connection failed or the server ended the stream; worth
    /// connecting again.
    #[error("{0}")]
    Broken(String),
}

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
    /// The database URL (its credentials too).
    pub url: String,
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
}

/// An insert read from the WAL, ready for the stages.
#[derive(Debug, Clone)]
pub struct StreamedRow {
    /// The row as the stages take it (`attempts` 1: this is its first).
    pub row: OutboxRow,
    /// Its values as the WAL had them, to copy it into the table should it
    /// be deleted before it is handed over.
    pub(crate) text: StreamedText,
    /// When the writer delayed it to (`not_before`), ms since the epoch.
    pub not_before_ms: Option<i64>,
    /// Not a row of the outbox table (a logical message): `row.id` is a
    /// stand-in, unique in the stream, and the table gives the event an id
    /// of its own should it be handed over.
    pub(crate) id_at_handover: bool,
}

/// The column values a copy of the row needs, as text.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamedText {
    pub(crate) payload_bytes: Option<String>,
    pub(crate) created_at: Option<String>,
    pub(crate) not_before: Option<String>,
}

/// Rows read, and the position that is done once they are.
#[derive(Debug, Default)]
pub struct WalBatch {
    /// Inserts in commit order.
    pub rows: Vec<StreamedRow>,
    /// The end of the last transaction the batch completes: confirm it
    /// once every row is published or in the table (rows after it, of a
    /// transaction not yet complete, are done by then too, and confirmed
    /// with their commit). `None`: no transaction ended.
    pub done_at: Option<Lsn>,
}

/// An open replication session.
pub struct WalStream {
    client: ReplicationClient,
    decoder: Decoder,
    slot: String,
    batch_size: usize,
    in_transaction: bool,
}

impl WalStream {
    /// Opens the session and starts reading where the slot was confirmed.
    ///
    /// # Errors
    /// [`StreamError::Standby`] while another relay reads the slot,
    /// [`StreamError::Gone`] when it cannot be read, else `Broken`.
    pub async fn open(settings: &StreamSettings) -> Result<WalStream, StreamError> {
        let config = replication_config(settings)?;
        let mut client = ReplicationClient::connect(config)
            .await
            .map_err(|e| StreamError::from_wire(e, &settings.slot))?;
        client
            .wait_started()
            .await
            .map_err(|e| StreamError::from_wire(e, &settings.slot))?;
        Ok(WalStream {
            client,
            decoder: Decoder::default(),
            slot: settings.slot.clone(),
            batch_size: settings.batch_size.max(1),
            in_transaction: false,
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
            ReplicationEvent::Begin { .. } => self.in_transaction = true,
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
            ReplicationEvent::XLogData { data, .. } => {
                let inserted = self
                    .decoder
                    .decode(&data)
                    .map_err(|e| StreamError::Broken(e.to_string()))?;
                if let Some(inserted) = inserted.filter(|i| i.relation.table == OUTBOX_TABLE) {
                    batch.rows.push(streamed_row(inserted));
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

/// The session's settings from the database URL.
fn replication_config(
    settings: &StreamSettings,
) -> Result<pgwire_replication::ReplicationConfig, StreamError> {
    use std::str::FromStr;
    let options = sqlx::postgres::PgConnectOptions::from_str(&settings.url)
        .map_err(|e| StreamError::Gone(format!("database.url cannot be read: {e}")))?;
    if matches!(
        options.get_ssl_mode(),
        sqlx::postgres::PgSslMode::Require
            | sqlx::postgres::PgSslMode::VerifyCa
            | sqlx::postgres::PgSslMode::VerifyFull
    ) {
        return Err(StreamError::Gone(
            "replication mode connects without TLS; database.url asks for sslmode=require or stricter".into(),
        ));
    }
    let password = url_password(&settings.url)
        .or_else(|| std::env::var("PGPASSWORD").ok())
        .unwrap_or_default();
    let host = match options.get_socket() {
        Some(dir) => dir.display().to_string(),
        None => options.get_host().to_string(),
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
    .with_tls(pgwire_replication::TlsConfig::disabled())
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

/// An insert as an outbox row. A value that cannot be read makes the row
/// malformed (dead-lettered with the reason), as the claim does.
fn streamed_row(mut inserted: Inserted) -> StreamedRow {
    let mut take = |column: &str| inserted.take(column);
    let mut problem: Option<String> = None;
    let id = take("id").and_then(|v| v.parse().ok()).unwrap_or_default();
    let event_id_text = take("event_id").unwrap_or_default();
    let event_id = uuid::Uuid::parse_str(&event_id_text).unwrap_or_else(|_| {
        problem.get_or_insert_with(|| format!("event_id {event_id_text:?} is not a UUID"));
        uuid::Uuid::nil()
    });
    let created_at = take("created_at");
    let created_at_ms = created_at.as_deref().and_then(timestamp_ms);
    if created_at_ms.is_none() {
        problem
            .get_or_insert_with(|| "created_at is -infinity or infinity; it must be a point in time".into());
    }
    let not_before = take("not_before");
    let payload_bytes_text = take("payload_bytes");
    let payload_bytes = match payload_bytes_text.as_deref().map(hex_bytea) {
        Some(Some(bytes)) => Some(bytes),
        Some(None) => {
            problem.get_or_insert_with(|| "payload_bytes is not in hex form".into());
            None
        }
        None => None,
    };
    let row = OutboxRow {
        id: RowId(id),
        event_id,
        aggregate_type: take("aggregate_type").unwrap_or_default(),
        aggregate_id: take("aggregate_id").unwrap_or_default(),
        event_type: take("event_type").unwrap_or_default(),
        payload_json: take("payload"),
        payload_bytes,
        headers_json: take("headers").unwrap_or_else(|| "{}".into()),
        tenant: take("tenant"),
        created_at_ms: created_at_ms.unwrap_or_default(),
        attempts: 1,
        deliveries: std::collections::BTreeMap::new(),
        held_by: Vec::new(),
        malformed: problem,
    };
    StreamedRow {
        row,
        not_before_ms: not_before.as_deref().and_then(timestamp_ms),
        text: StreamedText {
            payload_bytes: payload_bytes_text,
            created_at,
            not_before,
        },
        id_at_handover: false,
    }
}

/// An event as `switchyard_emit` writes it into its message.
#[derive(serde::Deserialize)]
struct Emitted<'a> {
    id: i64,
    event_id: uuid::Uuid,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    #[serde(borrow)]
    payload: Option<&'a serde_json::value::RawValue>,
    payload_bytes: Option<String>,
    #[serde(borrow)]
    headers: Option<&'a serde_json::value::RawValue>,
    tenant: Option<String>,
    created_at: String,
}

/// An event written by `switchyard_emit`. Content that is not an event is
/// dead-lettered with the reason, its bytes kept.
fn emitted_row(lsn: Lsn, content: &[u8]) -> StreamedRow {
    let read = serde_json::from_slice::<Emitted<'_>>(content)
        .map_err(|e| e.to_string())
        .and_then(|emitted| {
            let created = chrono::DateTime::parse_from_rfc3339(&emitted.created_at)
                .map_err(|e| format!("created_at {:?}: {e}", emitted.created_at))?;
            let bytes = match &emitted.payload_bytes {
                Some(hex) => Some(hex_bytea(&format!("\\x{hex}")).ok_or("payload_bytes is not hex")?),
                None => None,
            };
            Ok((emitted, created, bytes))
        });
    let (row, text) = match read {
        Ok((emitted, created, payload_bytes)) => (
            OutboxRow {
                id: RowId(emitted.id),
                event_id: emitted.event_id,
                aggregate_type: emitted.aggregate_type,
                aggregate_id: emitted.aggregate_id,
                event_type: emitted.event_type,
                payload_json: emitted
                    .payload
                    .filter(|raw| raw.get() != "null")
                    .map(|raw| raw.get().to_string()),
                payload_bytes,
                headers_json: emitted
                    .headers
                    .map_or_else(|| "{}".into(), |raw| raw.get().to_string()),
                tenant: emitted.tenant,
                created_at_ms: created.timestamp_millis(),
                attempts: 1,
                deliveries: std::collections::BTreeMap::new(),
                held_by: Vec::new(),
                malformed: None,
            },
            StreamedText {
                payload_bytes: emitted.payload_bytes.map(|hex| format!("\\x{hex}")),
                created_at: Some(emitted.created_at),
                not_before: None,
            },
        ),
        Err(why) => {
            let (row, text) = unreadable_message(lsn, content, why);
            return StreamedRow {
                row,
                text,
                not_before_ms: None,
                id_at_handover: true,
            };
        }
    };
    StreamedRow {
        row,
        text,
        not_before_ms: None,
        id_at_handover: false,
    }
}

/// A message under the event prefix that is not an event: an aggregate of
/// its own (it holds nothing back), its content kept as the payload bytes.
/// Its stand-in id is its position, negated so that it never meets a row's.
fn unreadable_message(lsn: Lsn, content: &[u8], why: String) -> (OutboxRow, StreamedText) {
    let position = i64::try_from(lsn.as_u64()).unwrap_or(i64::MAX);
    let hex: String = content.iter().map(|b| format!("{b:02x}")).collect();
    let row = OutboxRow {
        id: RowId(-position),
        // The same id whenever the message is read again: a replay finds
        // the dead letter it left the first time.
        event_id: uuid::Uuid::from_u64_pair(0x7377_6974_6368_7964, lsn.as_u64()),
        aggregate_type: super::EMIT_PREFIX.into(),
        aggregate_id: lsn.to_string(),
        event_type: "unreadable".into(),
        payload_json: None,
        payload_bytes: Some(content.to_vec()),
        headers_json: "{}".into(),
        tenant: None,
        created_at_ms: chrono::Utc::now().timestamp_millis(),
        attempts: 1,
        deliveries: std::collections::BTreeMap::new(),
        held_by: Vec::new(),
        malformed: Some(format!(
            "the message at {lsn} with prefix {:?} is not an event written by switchyard_emit: {why}",
            super::EMIT_PREFIX
        )),
    };
    let text = StreamedText {
        payload_bytes: Some(format!("\\x{hex}")),
        created_at: None,
        not_before: None,
    };
    (row, text)
}

/// A `timestamptz` in ISO form at UTC (`2026-11-25 16:55:01.123456+00`), in
/// ms since the epoch; `None` for infinities and anything else.
fn timestamp_ms(text: &str) -> Option<i64> {
    chrono::DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%#z")
        .ok()
        .map(|t| t.timestamp_millis())
}

/// A `bytea` in hex form (`\x0aff`).
fn hex_bytea(text: &str) -> Option<Vec<u8>> {
    let hex = text.strip_prefix("\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_read_as_the_table_has_them() {
        assert_eq!(timestamp_ms("1970-01-01 00:00:01.5+00"), Some(1500));
        assert_eq!(timestamp_ms("2026-11-25 16:55:01+00"), Some(1_795_625_701_000));
        assert_eq!(timestamp_ms("infinity"), None);
        assert_eq!(hex_bytea("\\x00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(hex_bytea("\\x0"), None);
        assert_eq!(hex_bytea("00"), None);
    }

    #[test]
    fn an_unreadable_value_makes_the_row_malformed_not_lost() {
        let values = [
            ("id", Some("42")),
            ("event_id", Some("not-a-uuid")),
            ("aggregate_type", Some("order")),
            ("aggregate_id", Some("1")),
            ("event_type", Some("created")),
            ("payload", Some("{\"a\": 1}")),
            ("created_at", Some("2026-11-25 16:55:01+00")),
        ];
        let inserted = Inserted {
            relation: std::sync::Arc::new(super::super::pgoutput::RelationInfo {
                table: OUTBOX_TABLE.into(),
                columns: values.iter().map(|(k, _)| (*k).to_string()).collect(),
            }),
            values: values.iter().map(|(_, v)| v.map(str::to_string)).collect(),
        };
        let streamed = streamed_row(inserted);
        assert_eq!(streamed.row.id, RowId(42));
        assert_eq!(streamed.row.attempts, 1);
        assert_eq!(streamed.row.payload_json.as_deref(), Some("{\"a\": 1}"));
        assert_eq!(streamed.row.headers_json, "{}");
        let why = streamed.row.malformed.expect("malformed");
        assert!(why.contains("not-a-uuid"), "{why}");
    }

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
