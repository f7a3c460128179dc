//! The WAL feed (replication mode): events read from the slot go through
//! the same stages as claimed rows, in lanes by aggregate, but nothing is
//! written for an event that is published. An event that is not (a
//! refusal, a retry, a paused target, a delay) crosses the [`Handover`] to
//! the table with its outcome, and the later events of its aggregate follow
//! it there, so the claim feed retries, dead-letters and orders them as in
//! claim mode. The slot's position is confirmed past a batch only once
//! every event of it is published or proved to be in the table.
//!
//! The decisions (waves, hand-overs, how far to confirm, what the reader
//! does next) are pure values in [`machine`]; this module does their I/O,
//! in [`Lanes`], over the change-stream seam and [`Stages`], so that the
//! property test in `tests.rs` runs this same loop on a model world.

mod machine;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::Relay;
use crate::store::change_stream::{
    ChangeSource, ChangeStream, HandoverTable, StreamBatch, StreamError, StreamedRow,
};
use crate::store::{OutboxRow, Outcome, RowOutcome};
use crate::telemetry::{Occurrence, Repeats};
use machine::{Ended, Held, LaneBatch, Ledger, Reader, Step, Then, Why};

/// Parts of batches queued per lane at most.
const LANE_QUEUE: usize = 4;

/// How often a standby tries the slot.
const STANDBY_RETRY: Duration = Duration::from_secs(2);

/// The longest pause between two tries to reconnect a broken stream, or to
/// hand rows over while the database cannot take them.
const RETRY_MAX: Duration = Duration::from_secs(5);

/// How often the relay asks whether any aggregate still waits in the
/// table, while one might.
const TABLE_RECHECK: Duration = Duration::from_secs(2);

/// An aggregate: type and id.
type Key = crate::store::change_stream::AggregateKey;

fn key(row: &StreamedRow) -> Key {
    (row.row.aggregate_type.clone(), row.row.aggregate_id.clone())
}

/// A hash of an event's aggregate: its lane, its place in a wave, and
/// whether it follows its aggregate to the table. Two aggregates that
/// share one only share a lane, wait for the next wave or go to the table
/// together; order never depends on it.
fn aggregate_hash(row: &StreamedRow) -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut hasher = rustc_hash::FxBuildHasher.build_hasher();
    row.row.aggregate_type.hash(&mut hasher);
    row.row.aggregate_id.hash(&mut hasher);
    hasher.finish()
}

/// The lane of an event's aggregate.
fn lane_of(row: &StreamedRow, lanes: usize) -> usize {
    usize::try_from(aggregate_hash(row) % lanes as u64).unwrap_or(0)
}

/// What the lanes do besides reading and handing over: publish a wave of
/// events through the relay's stages. The relay is one; the model test in
/// `tests.rs` gives the same lanes a broker of its own.
trait Stages: Clone + Send + Sync + 'static {
    /// Routes and publishes rows; an outcome per row it settled, by id
    /// (a row without one is not published).
    fn publish(&self, rows: Vec<OutboxRow>) -> impl Future<Output = Vec<RowOutcome>> + Send;

    /// Rows were handed over: the claim feed has work.
    fn handed_over(&self);

    /// The slot is held before events neither published nor in the table
    /// (a bug that would have lost them).
    fn held(&self, held: &Held<uuid::Uuid>);
}

impl Stages for Relay {
    async fn publish(&self, rows: Vec<OutboxRow>) -> Vec<RowOutcome> {
        let deadline = std::time::Instant::now() + self.inner.config.lease_duration();
        self.stages(rows, deadline, Duration::ZERO).await.outcomes
    }

    fn handed_over(&self) {
        self.inner.wake.notify_one();
    }

    fn held(&self, held: &Held<uuid::Uuid>) {
        let count = held.events.len() + held.missing;
        self.inner.metrics.replication_held(count as u64);
    }
}

/// The lanes of an open stream and how they run: the stream's batches are
/// split among them by aggregate, each lane merges what waits for it up to
/// a claim's batch, and the stream is confirmed as far as the lanes have
/// settled every event.
#[derive(Clone)]
struct Lanes<P> {
    stages: P,
    /// How many lanes (the relay's `concurrency`).
    lanes: usize,
    /// The most events a lane takes into one call (`batch_size`).
    cap: usize,
    /// Who hands rows over, and the lease they are taken under.
    owner: String,
    lease_ms: i64,
    /// How long the lanes may finish what they hold once the stream ends.
    finish_within: Duration,
}

/// The bridge from the WAL feed to the table, one per lane: rows not
/// published are handed over to the claim feed there (which is woken), and
/// what the lane knows of the table between batches.
struct Handover<H, P> {
    lanes: Lanes<P>,
    table: H,
    /// Some aggregate may wait behind a row in the table: each batch's
    /// aggregates are looked up there (else none are).
    may_hold: bool,
    checked: Instant,
    /// Aggregates an earlier batch left an unresolved event of (the slot
    /// is held before it): their later events wait with it, to be read
    /// again.
    blocked: HashSet<u64>,
}

/// Reads a change stream (a PostgreSQL slot, a MariaDB binary log) and
/// relays what it reads. Generic over its source: the stream's position is
/// its own type, so a position of another kind cannot be confirmed, and
/// the one call per batch through the seam is static.
pub(super) struct WalFeed<S> {
    relay: Relay,
    source: S,
}

impl<S: ChangeSource> WalFeed<S> {
    pub(super) fn new(relay: Relay, source: S) -> WalFeed<S> {
        WalFeed { relay, source }
    }

    /// The slot's or binlog position's name, for what the relay says.
    fn name(&self) -> &str {
        self.source.name()
    }

    /// Reads the slot until `shutdown`: as its reader, or as a standby
    /// while another relay reads it.
    ///
    /// # Errors
    /// The slot cannot be read any more (dropped, invalidated): the relay
    /// cannot go on, and an operator has to act.
    pub(super) async fn run(&self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let slot = self.name();
        let broken = Repeats::default();
        let mut reader = Reader::Starting;
        // The first pause after a break is 200 ms.
        let mut pause = crate::backoff::Backoff::new(Duration::from_millis(200), RETRY_MAX);
        while !shutdown.is_cancelled() {
            let opened = tokio::select! {
                opened = self.source.open() => opened,
                () = shutdown.cancelled() => return Ok(()),
            };
            let failed = match opened {
                Ok(stream) => {
                    if reader.opened() == Reader::Starting {
                        info!(slot = %slot, "Reading the replication slot.");
                    } else {
                        info!(slot = %slot, "Reading the replication slot now.");
                    }
                    pause.reset();
                    let metrics = &self.relay.inner.metrics;
                    metrics.set_replication_reading(true);
                    let ended = self.read(stream, &shutdown).await;
                    metrics.set_replication_reading(false);
                    ended
                }
                Err(error) => error,
            };
            let (how, why) = match failed {
                StreamError::Standby(why) => (Ended::Standby, why),
                StreamError::Gone(why) => (Ended::Gone, why),
                StreamError::Broken(why) => (Ended::Broken, why),
            };
            let wait = match reader.ended(how) {
                Then::StandBy { first } => {
                    if first {
                        info!(slot = %slot, "Standing by: {why}.");
                    }
                    STANDBY_RETRY
                }
                Then::Stop => {
                    if shutdown.is_cancelled() {
                        return Ok(());
                    }
                    anyhow::bail!(why);
                }
                Then::Reconnect => {
                    match broken.occurred() {
                        Occurrence::First => {
                            warn!(slot = %slot, error = %why, "The replication stream broke; connecting again.")
                        }
                        Occurrence::Still { count, lasting } => warn!(
                            slot = %slot, error = %why, count, lasting_s = lasting.as_secs(),
                            "The replication stream still cannot be read."
                        ),
                        Occurrence::Quiet => debug!(error = %why, "Replication stream broke again."),
                    }
                    pause.next_pause()
                }
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = shutdown.cancelled() => {}
            }
        }
        Ok(())
    }

    /// Relays batches from an open stream until it fails or `shutdown`,
    /// in the relay's lanes.
    async fn read(&self, stream: S::Stream, shutdown: &CancellationToken) -> StreamError {
        let config = &self.relay.inner.config;
        let lanes = Lanes {
            stages: self.relay.clone(),
            lanes: usize::try_from(config.concurrency.max(1)).unwrap_or(1),
            cap: usize::try_from(config.batch_size).unwrap_or(usize::MAX),
            owner: self.relay.inner.owner.clone(),
            lease_ms: i64::try_from(config.lease_duration_ms).unwrap_or(i64::MAX),
            finish_within: Duration::from_millis(config.shutdown_timeout_ms),
        };
        lanes
            .read(stream, || self.source.table(), self.name(), shutdown)
            .await
    }
}

impl<P: Stages> Lanes<P> {
    /// Relays batches from an open stream until it fails or `shutdown`.
    /// Each aggregate belongs to one of `concurrency` lanes, which relay
    /// their share of each batch in stream order, side by side; the slot is
    /// confirmed up to the last batch that every lane has finished, as have
    /// all batches before it, and only while every event of them is
    /// published or in the table.
    async fn read<St: ChangeStream, H: HandoverTable>(
        &self,
        mut stream: St,
        table: impl Fn() -> H,
        name: &str,
        shutdown: &CancellationToken,
    ) -> StreamError {
        let lanes = self.lanes.max(1);
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<LaneDone>();
        let mut running = tokio::task::JoinSet::new();
        let senders: Vec<_> = (0..lanes)
            .map(|_| self.lane(table(), &mut running, done_tx.clone()))
            .collect();
        drop(done_tx);
        let mut ledger: Ledger<St::Position, uuid::Uuid> = Ledger::default();
        let mut held = false;
        let ended = loop {
            while let Ok(done) = done_rx.try_recv() {
                ledger.part_done(done.seq, done.published, done.in_table, done.unresolved);
            }
            if let Err(error) = self.confirm(&mut ledger, &stream, name) {
                held = true;
                break error;
            }
            let batch = tokio::select! {
                batch = stream.next_batch() => batch,
                Some(done) = done_rx.recv() => {
                    ledger.part_done(done.seq, done.published, done.in_table, done.unresolved);
                    continue;
                }
                () = shutdown.cancelled() => break StreamError::Gone("shut down".into()),
            };
            let StreamBatch { rows, done_at } = match batch {
                Ok(batch) => batch,
                Err(error) => break error,
            };
            let count = rows.len();
            let mut parts: Vec<Vec<StreamedRow>> = (0..lanes).map(|_| Vec::new()).collect();
            for streamed in rows {
                parts[lane_of(&streamed, lanes)].push(streamed);
            }
            let seq = ledger.push(
                count,
                parts.iter().filter(|part| !part.is_empty()).count(),
                done_at,
            );
            let mut lane_stopped = false;
            for (sender, part) in senders.iter().zip(parts) {
                if !part.is_empty() && sender.send((seq, part)).await.is_err() {
                    lane_stopped = true;
                }
            }
            if lane_stopped {
                break StreamError::Broken(
                    "a replication lane stopped (a panic?); reading again from the confirmed position".into(),
                );
            }
        };
        // What the lanes hold was read: finish it (within the shutdown
        // bound) and confirm it, so that a restart replays less.
        drop(senders);
        if tokio::time::timeout(self.finish_within, async {
            while running.join_next().await.is_some() {}
        })
        .await
        .is_err()
        {
            running.abort_all();
        }
        while let Ok(done) = done_rx.try_recv() {
            ledger.part_done(done.seq, done.published, done.in_table, done.unresolved);
        }
        if held {
            // Said once already: only what comes before it.
            if let (Some(lsn), _) = ledger.confirmable() {
                stream.confirm(lsn);
            }
        } else {
            let _ = self.confirm(&mut ledger, &stream, name);
        }
        stream.close().await;
        ended
    }

    /// Starts a lane in `running`; returns where to send it parts of
    /// batches. What it did with each part goes to `done`.
    fn lane<H: HandoverTable>(
        &self,
        table: H,
        running: &mut tokio::task::JoinSet<()>,
        done: tokio::sync::mpsc::UnboundedSender<LaneDone>,
    ) -> tokio::sync::mpsc::Sender<(u64, Vec<StreamedRow>)> {
        // A few parts queued per lane; a lane takes what waits at once,
        // up to a claim's batch, so that a busy stream is published in
        // calls as large as claim mode's (a broker's round trip per call
        // bounds a lane, not its rows). Unbounded, a stream read faster
        // than the broker acks (MariaDB's binary log, 130,000 rows/s here)
        // put four parts at once into each lane's call, JetStream did not
        // ack them within the publish timeout, and the target was paused:
        // a drain of 100,000 went at 3,900 events/s, 49,000 with the bound;
        // PostgreSQL's slot at 54,000 before, 59,000 after.
        let cap = self.cap.max(1);
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(u64, Vec<StreamedRow>)>(LANE_QUEUE);
        let mut handover = Handover {
            lanes: self.clone(),
            table,
            may_hold: true,
            checked: Instant::now() - TABLE_RECHECK,
            blocked: HashSet::new(),
        };
        running.spawn(async move {
            while let Some((seq, mut rows)) = rx.recv().await {
                let mut parts = vec![(seq, rows.len())];
                while rows.len() < cap
                    && let Ok((seq, more)) = rx.try_recv()
                {
                    parts.push((seq, more.len()));
                    rows.extend(more);
                }
                handover.refresh().await;
                let report = handover.relay_streamed(rows).await;
                // Back to each batch its own share of the report.
                let mut first = 0;
                for (seq, len) in parts {
                    let last = first + len;
                    let share = &report.fates[first..last];
                    let _ = done.send(LaneDone {
                        seq,
                        published: share.iter().filter(|f| **f == Settled::Published).count(),
                        in_table: share.iter().filter(|f| **f == Settled::InTable).count(),
                        unresolved: report
                            .unresolved
                            .iter()
                            .filter(|(at, _)| (first..last).contains(at))
                            .map(|(_, id)| *id)
                            .collect(),
                    });
                    first = last;
                }
            }
        });
        tx
    }

    /// Confirms what the ledger allows. An event the slot would pass that
    /// is neither published nor in the table is a bug that would lose it:
    /// the slot stays before it, the relay says which event it is, counts
    /// it, and reads again from the confirmed position (the event is read
    /// again and handed over anew).
    fn confirm<St: ChangeStream>(
        &self,
        ledger: &mut Ledger<St::Position, uuid::Uuid>,
        stream: &St,
        name: &str,
    ) -> Result<(), StreamError> {
        let (furthest, held) = ledger.confirmable();
        if let Some(lsn) = furthest {
            stream.confirm(lsn);
        }
        let Some(held) = held else {
            return Ok(());
        };
        self.stages.held(&held);
        let Held { events, missing } = held;
        let count = events.len() + missing;
        let named: Vec<String> = events.iter().take(10).map(ToString::to_string).collect();
        error!(
            slot = %name,
            events = count,
            event_ids = %named.join(","),
            unaccounted = missing,
            "The replication slot is held before events that are neither published nor in the outbox table; \
             reading them again. This is a bug: please report it."
        );
        Err(StreamError::Broken(format!(
            "held before {count} events neither published nor in the table"
        )))
    }
}

/// What a lane did with its share of one stream batch.
struct LaneDone {
    seq: u64,
    published: usize,
    in_table: usize,
    unresolved: Vec<uuid::Uuid>,
}

/// An event's end in a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    Published,
    InTable,
    Neither,
}

/// What a lane made of a batch, per event in the order given, and the
/// event ids of those neither published nor in the table.
struct LaneReport {
    fates: Vec<Settled>,
    unresolved: Vec<(usize, uuid::Uuid)>,
}

impl<H: HandoverTable, P: Stages> Handover<H, P> {
    /// Forgets that aggregates may wait in the table once none does.
    async fn refresh(&mut self) {
        if !self.may_hold || self.checked.elapsed() < TABLE_RECHECK {
            return;
        }
        self.checked = Instant::now();
        match self.table.anything_waiting_in_table().await {
            Ok(waiting) => self.may_hold = waiting,
            Err(error) => debug!(%error, "Cannot tell whether rows wait in the table; looking them up."),
        }
    }

    /// One batch from the stream, through the decisions of a
    /// [`LaneBatch`]: waves of at most one event per aggregate, what is
    /// not published handed over with its outcome, what follows it after.
    async fn relay_streamed(&mut self, rows: Vec<StreamedRow>) -> LaneReport {
        let now_ms = chrono::Utc::now().timestamp_millis();
        let waiting: HashSet<u64> = if self.may_hold {
            let keys: Vec<Key> = rows.iter().map(key).collect();
            let waiting = self
                .until_answered("look up waiting aggregates", || {
                    self.table.waiting_in_table(&keys)
                })
                .await;
            rows.iter()
                .filter(|row| waiting.contains(&key(row)))
                .map(aggregate_hash)
                .collect()
        } else {
            HashSet::new()
        };
        let mut batch = LaneBatch::new(
            rows.iter().map(aggregate_hash).collect(),
            rows.iter()
                .map(|row| row.not_before_ms.is_some_and(|at| at > now_ms))
                .collect(),
            waiting,
            std::mem::take(&mut self.blocked),
        );
        // The outcome a failed event is handed over with.
        let mut outcomes: Vec<Option<RowOutcome>> = vec![None; rows.len()];
        loop {
            match batch.next() {
                Step::Publish(wave) => {
                    let published = self.publish(&rows, &wave, &mut outcomes).await;
                    batch.sent(&wave, &published);
                }
                Step::HandOver(handed) => {
                    let in_table = self.hand_over(&rows, &handed, &outcomes).await;
                    batch.handed_over(&handed, &in_table);
                }
                Step::Done => break,
            }
        }
        if batch.used_the_table() {
            self.may_hold = true;
        }
        let fates: Vec<Settled> = batch
            .fates()
            .iter()
            .map(|fate| match fate {
                machine::Fate::Published => Settled::Published,
                machine::Fate::InTable => Settled::InTable,
                _ => Settled::Neither,
            })
            .collect();
        let unresolved = fates
            .iter()
            .enumerate()
            .filter(|(_, fate)| **fate == Settled::Neither)
            .map(|(at, _)| (at, rows[at].row.event_id))
            .collect();
        self.blocked = batch.blocked();
        LaneReport { fates, unresolved }
    }

    /// Runs one wave through the stages. Returns, per event of the wave,
    /// whether it was published; keeps the outcome of each that was not.
    /// Outcomes are matched to events by row id: an event the stages gave
    /// no outcome for is not published.
    async fn publish(
        &self,
        rows: &[StreamedRow],
        wave: &[usize],
        outcomes: &mut [Option<RowOutcome>],
    ) -> Vec<bool> {
        let sent = wave.iter().map(|&at| rows[at].row.clone()).collect();
        let settled = self.lanes.stages.publish(sent).await;
        let mut by_id: rustc_hash::FxHashMap<i64, RowOutcome> =
            settled.into_iter().map(|o| (o.id.0, o)).collect();
        wave.iter()
            .map(|&at| {
                let id = rows[at].row.id;
                match by_id.remove(&id.0) {
                    Some(outcome) if outcome.outcome == Outcome::Published => true,
                    Some(outcome) => {
                        outcomes[at] = Some(outcome);
                        false
                    }
                    None => {
                        outcomes[at] = Some(RowOutcome {
                            id,
                            outcome: Outcome::Defer {
                                after: Duration::ZERO,
                                reason: "the relay lost track of this event before publishing it (a routing \
                                         task ended early); it is published from the table"
                                    .into(),
                                waiting_on: Vec::new(),
                            },
                            deliveries: Default::default(),
                            plugin_version: None,
                        });
                        false
                    }
                }
            })
            .collect()
    }

    /// Hands events to the table, trying until the database answers: the
    /// slot is not confirmed past them before, so nothing is lost either
    /// way, but the stream waits meanwhile. Returns, per event, whether
    /// the table proved it holds it.
    async fn hand_over(
        &self,
        rows: &[StreamedRow],
        handed: &[(usize, Why)],
        outcomes: &[Option<RowOutcome>],
    ) -> Vec<bool> {
        let lanes = &self.lanes;
        let given: Vec<&StreamedRow> = handed.iter().map(|&(at, _)| &rows[at]).collect();
        let outcomes: Vec<RowOutcome> = handed
            .iter()
            .map(|&(at, why)| match (&outcomes[at], why) {
                (Some(outcome), _) => outcome.clone(),
                (None, why) => RowOutcome {
                    id: rows[at].row.id,
                    outcome: Outcome::Defer {
                        after: Duration::ZERO,
                        reason: match why {
                            Why::Delayed => "delayed by its writer",
                            Why::Follows | Why::Failed => {
                                "follows an earlier event of its aggregate that waits in the outbox table"
                            }
                        }
                        .into(),
                        waiting_on: Vec::new(),
                    },
                    deliveries: Default::default(),
                    plugin_version: None,
                },
            })
            .collect();
        let in_table = self
            .until_answered("hand rows over to the outbox table", || {
                self.table
                    .hand_over(&lanes.owner, lanes.lease_ms, &given, &outcomes)
            })
            .await;
        let proved = in_table.iter().filter(|t| **t).count();
        if proved < given.len() {
            warn!(
                rows = given.len(),
                proved, "The outbox table did not take every event handed over; handing the rest over again."
            );
        } else {
            debug!(rows = given.len(), "Handed rows over to the claim path.");
        }
        lanes.stages.handed_over();
        in_table
    }

    /// Runs `attempt` until the database answers.
    async fn until_answered<T, F, Fut>(&self, what: &str, attempt: F) -> T
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, crate::store::Error>>,
    {
        let pause = crate::backoff::Backoff::new(Duration::from_millis(100), RETRY_MAX);
        let (value, waited) = crate::backoff::until_ok(pause, attempt, |error, failures| {
            if failures == 1 {
                warn!(%error, "Cannot {what}; the replication stream waits until the database answers.");
            }
        })
        .await;
        if waited.is_some() {
            info!("The database answers again; the replication stream goes on.");
        }
        value
    }
}
