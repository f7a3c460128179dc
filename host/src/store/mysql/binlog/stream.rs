//! The binary log reader: one session per reader holds a named lock (the
//! relays that do not get it stand by) and reads the outbox's inserts from
//! the recorded GTID position, in batches that end on a commit; the
//! position moves as the feed confirms batches.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use mysql_async::binlog::events::{Event, EventData, RowsEventData};
use mysql_async::binlog::value::BinlogValue;
use mysql_async::prelude::Queryable;
use mysql_async::{BinlogStreamRequest, Value};
use sqlx::MySqlPool;

use super::gtid::{Boundary, GtidPos, MARIADB_GTID_EVENT, Transactions, gtid_event};
use super::{BinlogBatch, BinlogSettings};
use crate::store::change_stream::{StreamError, StreamedRow, StreamedText};
use crate::store::types::{OutboxRow, RowId};

/// The outbox table as the binary log names it.
const OUTBOX_TABLE: &str = "switchyard_outbox";

/// How often the server says it is there while the log is quiet.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// Silence after which the session is taken for dead: a few heartbeats.
const SILENCE: Duration = Duration::from_secs(5);

/// How often the position is written while it moves.
const RECORD_EVERY: Duration = Duration::from_millis(500);

/// A batch of no rows that only moves the position is handed out at most
/// this often (other tables' transactions).
const IDLE_POSITION_EVERY: Duration = Duration::from_secs(1);

/// Positions by sequence number, and the furthest confirmed.
#[derive(Default)]
struct Positions {
    read: VecDeque<(u64, String)>,
    confirmed: Option<String>,
}

/// An open binary log session.
pub struct BinlogStream {
    events: mysql_async::BinlogStream,
    database: String,
    /// The outbox's columns in table order, for a log without their names.
    columns: Vec<String>,
    batch_size: usize,
    position: GtidPos,
    transactions: Transactions,
    /// Rows of the open transaction.
    open_rows: Vec<StreamedRow>,
    /// Complete transactions read and not yet handed out.
    ready: BinlogBatch,
    sequence: u64,
    positions: Arc<Mutex<Positions>>,
    moved: Arc<tokio::sync::Notify>,
    recorder: tokio::task::JoinHandle<()>,
    stop_recording: tokio_util::sync::CancellationToken,
    last_idle_position: Instant,
}

/// The named lock one reader of a position holds.
fn lock_name(database: &str, name: &str) -> String {
    let mut lock = format!("switchyard.binlog.{database}.{name}");
    lock.truncate(64);
    lock
}

/// A replica id of its own for the session: the server drops an older
/// session with the same id, so a reader that died half-open is dropped
/// when the next one connects.
fn replica_id(database: &str, name: &str) -> u32 {
    use std::hash::BuildHasher;
    let hash = rustc_hash::FxBuildHasher.hash_one((database, name));
    // Clear of the small ids servers are usually given.
    u32::try_from(hash % 0x7fff_0000).unwrap_or(0) + 0x10000
}

fn broken(error: &mysql_async::Error) -> StreamError {
    match error {
        mysql_async::Error::Server(server) if server.code == 1236 => StreamError::Gone(format!(
            "the binary log no longer holds the recorded position ({}): the server purged it. Record a new \
             position (delete the row from switchyard_binlog_positions and run `switchyard migrate`) and \
             relay the rows written since in claim mode",
            server.message
        )),
        error => StreamError::Broken(crate::redact::url(&error.to_string())),
    }
}

impl BinlogStream {
    /// Connects, takes the position's lock and starts reading where it was
    /// last confirmed. `pool` records the position as it moves.
    ///
    /// # Errors
    /// [`StreamError::Standby`] while another relay reads the position,
    /// [`StreamError::Gone`] when it cannot be read, else `Broken`.
    pub async fn open(settings: &BinlogSettings, pool: MySqlPool) -> Result<BinlogStream, StreamError> {
        crate::tls::install_provider();
        let secret = settings
            .endpoint
            .password()
            .await
            .map_err(|e| StreamError::Broken(e.to_string()))?;
        let options = settings
            .endpoint
            .mysql_binlog_options_with(secret.as_ref())
            .map_err(|e| StreamError::Gone(e.to_string()))?;
        let mut conn = tokio::time::timeout(Duration::from_secs(10), mysql_async::Conn::new(options))
            .await
            .map_err(|_| StreamError::Broken("no answer from the database within 10 s".into()))?
            .map_err(|e| broken(&e))?;
        let database: String = conn
            .query_first("SELECT DATABASE()")
            .await
            .map_err(|e| broken(&e))?
            .unwrap_or_default();
        let lock = lock_name(&database, &settings.name);
        let held: Option<Option<i64>> = conn
            .exec_first("SELECT GET_LOCK(?, 0)", (lock.as_str(),))
            .await
            .map_err(|e| broken(&e))?;
        if held.flatten() != Some(1) {
            return Err(StreamError::Standby(format!(
                "binlog position {:?} is read by another session",
                settings.name
            )));
        }
        let recorded: Option<String> = conn
            .exec_first(
                "SELECT gtid_position FROM switchyard_binlog_positions WHERE name = ?",
                (settings.name.as_str(),),
            )
            .await
            .map_err(|e| broken(&e))?;
        let Some(recorded) = recorded else {
            return Err(StreamError::Gone(format!(
                "no binlog position named {:?} is recorded: run `switchyard migrate` with this config",
                settings.name
            )));
        };
        let position = GtidPos::parse(&recorded).map_err(|e| {
            StreamError::Gone(format!("binlog position {:?} cannot be read: {e}", settings.name))
        })?;
        let columns: Vec<String> = conn
            .exec(
                "SELECT column_name FROM information_schema.columns
                  WHERE table_schema = DATABASE() AND table_name = ? ORDER BY ordinal_position",
                (OUTBOX_TABLE,),
            )
            .await
            .map_err(|e| broken(&e))?;
        let session: u32 = conn.id();
        // MariaDB's replica protocol: GTIDs (capability 4), the position
        // to start after, heartbeats while the log is quiet.
        conn.exec_drop(
            "SET @mariadb_slave_capability = 4, @slave_connect_state = ?, @slave_gtid_strict_mode = 0, \
             @slave_gtid_ignore_duplicates = 0, @master_heartbeat_period = ?",
            (
                position.to_string(),
                u64::try_from(HEARTBEAT.as_nanos()).unwrap_or(u64::MAX),
            ),
        )
        .await
        .map_err(|e| broken(&e))?;
        let request = BinlogStreamRequest::new(replica_id(&database, &settings.name))
            .with_filename(b"")
            .with_pos(4u64);
        let events = conn.get_binlog_stream(request).await.map_err(|e| broken(&e))?;
        tracing::info!(name = %settings.name, %position, "Reading the binary log after this GTID position.");
        let positions = Arc::new(Mutex::new(Positions::default()));
        let moved = Arc::new(tokio::sync::Notify::new());
        let stop_recording = tokio_util::sync::CancellationToken::new();
        let recorder = tokio::spawn(record(
            pool,
            settings.name.clone(),
            lock,
            session,
            positions.clone(),
            moved.clone(),
            stop_recording.clone(),
        ));
        Ok(BinlogStream {
            events,
            database,
            columns,
            batch_size: settings.batch_size.max(1),
            position,
            transactions: Transactions::default(),
            open_rows: Vec::new(),
            ready: BinlogBatch::default(),
            sequence: 0,
            positions,
            moved,
            recorder,
            stop_recording,
            last_idle_position: Instant::now(),
        })
    }

    /// The next batch: complete transactions, as many as have arrived (up
    /// to the batch size), waiting for the first. Cancel-safe: what was
    /// read before a cancelled call is kept for the next one (the feed
    /// selects between this and its lanes' reports).
    ///
    /// # Errors
    /// The session broke or went silent.
    pub async fn next_batch(&mut self) -> Result<BinlogBatch, StreamError> {
        loop {
            let complete = self.ready.done_at.is_some() && self.transactions.open().is_none();
            let event = if complete && !self.ready.rows.is_empty() {
                match self.events.next().now_or_never() {
                    Some(event) => event,
                    None => return Ok(std::mem::take(&mut self.ready)),
                }
            } else {
                tokio::time::timeout(SILENCE, self.events.next())
                    .await
                    .map_err(|_| {
                        StreamError::Broken(format!(
                            "no event and no heartbeat from the binary log in {} s",
                            SILENCE.as_secs()
                        ))
                    })?
            };
            let event = event
                .ok_or_else(|| StreamError::Broken("the server ended the binary log stream".into()))?
                .map_err(|e| broken(&e))?;
            self.take(&event)?;
            let at_commit = self.transactions.open().is_none();
            if at_commit && self.ready.rows.len() >= self.batch_size {
                return Ok(std::mem::take(&mut self.ready));
            }
            if at_commit
                && self.ready.rows.is_empty()
                && self.ready.done_at.is_some()
                && self.last_idle_position.elapsed() >= IDLE_POSITION_EVERY
            {
                self.last_idle_position = Instant::now();
                return Ok(std::mem::take(&mut self.ready));
            }
        }
    }

    /// One event: a transaction begins or ends, or rows of the outbox.
    fn take(&mut self, event: &Event) -> Result<(), StreamError> {
        let header = event.header();
        let boundary = if header.event_type_raw() == MARIADB_GTID_EVENT {
            let gtid = gtid_event(event.data(), header.server_id())
                .ok_or_else(|| StreamError::Broken("a GTID event too short to read".into()))?;
            // Rows of a transaction that never committed are dropped.
            self.open_rows.clear();
            Some(Boundary::Begins(gtid))
        } else {
            match event.read_data() {
                Ok(Some(EventData::XidEvent(_))) => Some(Boundary::Xid),
                Ok(Some(EventData::QueryEvent(query))) => Some(Boundary::Query {
                    commit: query.query().trim().eq_ignore_ascii_case("COMMIT"),
                }),
                Ok(Some(EventData::RowsEvent(rows))) => {
                    self.rows(&rows)?;
                    None
                }
                Ok(_) => None,
                Err(error) => {
                    return Err(StreamError::Broken(format!(
                        "a binary log event cannot be read: {error}"
                    )));
                }
            }
        };
        if let Some(boundary) = boundary
            && let Some(gtid) = self.transactions.event(boundary)
        {
            self.position.advance(&gtid);
            self.sequence += 1;
            if let Ok(mut positions) = self.positions.lock() {
                positions
                    .read
                    .push_back((self.sequence, self.position.to_string()));
            }
            self.ready.rows.append(&mut self.open_rows);
            self.ready.done_at = Some(self.sequence);
        }
        Ok(())
    }

    /// The outbox's `streamed` inserts of a rows event.
    fn rows(&mut self, event: &RowsEventData<'_>) -> Result<(), StreamError> {
        let inserts = matches!(
            event,
            RowsEventData::WriteRowsEvent(_) | RowsEventData::WriteRowsEventV1(_)
        );
        if !inserts || self.transactions.open().is_none() {
            return Ok(());
        }
        let Some(table) = self.events.get_tme(event.table_id()) else {
            return Err(StreamError::Broken("a rows event without its table map".into()));
        };
        if table.table_name() != OUTBOX_TABLE || table.database_name() != self.database {
            return Ok(());
        }
        for row in event.rows(table) {
            let (_, after) =
                row.map_err(|e| StreamError::Broken(format!("an outbox row cannot be read: {e}")))?;
            let Some(after) = after else { continue };
            let mut values = RowValues::default();
            for (at, column) in after.columns_ref().iter().enumerate() {
                // Per column of every row read: borrowed, not copied.
                let named = column.name_str();
                let name = if named.is_empty() {
                    self.columns.get(at).map_or("", String::as_str)
                } else {
                    named.as_ref()
                };
                values.set(name, after.as_ref(at));
            }
            if values.status.as_deref() == Some("streamed") {
                self.open_rows.push(values.into_row());
            }
        }
        Ok(())
    }

    /// Every event up to batch `done_at` is published or in the table: the
    /// position may move past it.
    pub fn confirm(&self, done_at: u64) {
        if let Ok(mut positions) = self.positions.lock() {
            while positions.read.front().is_some_and(|(seq, _)| *seq <= done_at) {
                positions.confirmed = positions.read.pop_front().map(|(_, pos)| pos);
            }
        }
        self.moved.notify_one();
    }

    /// Records the confirmed position and ends the session.
    pub async fn close(self) {
        self.stop_recording.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.recorder).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.events.close()).await;
    }
}

/// Writes the confirmed position while it moves, at most every
/// [`RECORD_EVERY`], and once more when stopped. Fenced: only the session
/// holding the position's lock may move it.
async fn record(
    pool: MySqlPool,
    name: String,
    lock: String,
    session: u32,
    positions: Arc<Mutex<Positions>>,
    moved: Arc<tokio::sync::Notify>,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut written: Option<String> = None;
    loop {
        let stopping = tokio::select! {
            () = moved.notified() => false,
            () = stop.cancelled() => true,
        };
        let confirmed = positions.lock().ok().and_then(|p| p.confirmed.clone());
        if let Some(position) = confirmed
            && written.as_ref() != Some(&position)
        {
            let done = sqlx::query(
                "UPDATE switchyard_binlog_positions SET gtid_position = ?, updated_at = UTC_TIMESTAMP(6)
                  WHERE name = ? AND IS_USED_LOCK(?) = ?",
            )
            .bind(&position)
            .bind(&name)
            .bind(&lock)
            .bind(session)
            .execute(&pool)
            .await;
            match done {
                Ok(_) => written = Some(position),
                Err(error) => tracing::debug!(%error, "Cannot record the binlog position; trying again."),
            }
        }
        if stopping {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(RECORD_EVERY) => {}
            () = stop.cancelled() => {}
        }
    }
}

/// An inserted row's values by column.
#[derive(Default)]
struct RowValues {
    id: Option<i64>,
    event_id: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    event_type: Option<String>,
    payload: Option<String>,
    payload_bytes: Option<Vec<u8>>,
    headers: Option<String>,
    tenant: Option<String>,
    created_at: Option<String>,
    not_before: Option<String>,
    status: Option<String>,
}

fn bytes(value: Option<&BinlogValue<'_>>) -> Option<Vec<u8>> {
    match value? {
        BinlogValue::Value(Value::NULL) => None,
        BinlogValue::Value(Value::Bytes(bytes)) => Some(bytes.clone()),
        BinlogValue::Value(Value::Int(i)) => Some(i.to_string().into_bytes()),
        BinlogValue::Value(Value::UInt(u)) => Some(u.to_string().into_bytes()),
        other => Some(format!("{other:?}").into_bytes()),
    }
}

fn text(value: Option<&BinlogValue<'_>>) -> Option<String> {
    bytes(value).map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// `seconds[.micros]` since the epoch (a TIMESTAMP in the binary log) in ms.
fn epoch_ms(text: &str) -> Option<i64> {
    let (seconds, fraction) = text.split_once('.').unwrap_or((text, "0"));
    let seconds: i64 = seconds.parse().ok()?;
    let micros: i64 = format!("{fraction:0<6}").get(..6)?.parse().ok()?;
    Some(seconds * 1000 + micros / 1000)
}

impl RowValues {
    fn set(&mut self, column: &str, value: Option<&BinlogValue<'_>>) {
        match column {
            "id" => self.id = text(value).and_then(|t| t.parse().ok()),
            "event_id" => self.event_id = text(value),
            "aggregate_type" => self.aggregate_type = text(value),
            "aggregate_id" => self.aggregate_id = text(value),
            "event_type" => self.event_type = text(value),
            "payload" => self.payload = text(value),
            "payload_bytes" => self.payload_bytes = bytes(value),
            "headers" => self.headers = text(value),
            "tenant" => self.tenant = text(value),
            "created_at" => self.created_at = text(value),
            "not_before" => self.not_before = text(value),
            "status" => self.status = text(value),
            _ => {}
        }
    }

    /// The row for the stages; a value that cannot be read makes it
    /// malformed (dead-lettered with the reason), as the claim does.
    fn into_row(self) -> StreamedRow {
        let mut problem: Option<String> = None;
        let event_id_text = self.event_id.unwrap_or_default();
        let event_id = uuid::Uuid::parse_str(&event_id_text).unwrap_or_else(|_| {
            problem.get_or_insert_with(|| format!("event_id {event_id_text:?} is not a UUID"));
            uuid::Uuid::nil()
        });
        let created_at_ms = self.created_at.as_deref().and_then(epoch_ms);
        if created_at_ms.is_none() {
            problem.get_or_insert_with(|| format!("created_at {:?} is not a point in time", self.created_at));
        }
        StreamedRow {
            row: OutboxRow {
                id: RowId(self.id.unwrap_or_default()),
                event_id,
                aggregate_type: self.aggregate_type.unwrap_or_default(),
                aggregate_id: self.aggregate_id.unwrap_or_default(),
                event_type: self.event_type.unwrap_or_default(),
                payload_json: self.payload,
                payload_bytes: self.payload_bytes,
                headers_json: self.headers.unwrap_or_else(|| "{}".into()),
                tenant: self.tenant,
                created_at_ms: created_at_ms.unwrap_or_default(),
                attempts: 1,
                deliveries: std::collections::BTreeMap::new(),
                held_by: Vec::new(),
                malformed: problem,
            },
            not_before_ms: self.not_before.as_deref().and_then(epoch_ms),
            text: StreamedText {
                payload_bytes: None,
                created_at: self.created_at,
                not_before: self.not_before,
            },
            id_at_handover: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{epoch_ms, lock_name};

    #[test]
    fn binlog_timestamps_are_read_to_the_millisecond() {
        assert_eq!(epoch_ms("1700000000"), Some(1_700_000_000_000));
        assert_eq!(epoch_ms("1700000000.123456"), Some(1_700_000_000_123));
        assert_eq!(epoch_ms("1700000000.5"), Some(1_700_000_000_500));
        assert_eq!(epoch_ms("x"), None);
    }

    #[test]
    fn lock_names_fit_the_servers_bound() {
        assert!(lock_name(&"d".repeat(64), "switchyard").len() <= 64);
        assert_eq!(
            lock_name("shop", "switchyard"),
            "switchyard.binlog.shop.switchyard"
        );
    }
}
