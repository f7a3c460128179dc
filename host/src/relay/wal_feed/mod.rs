//! The WAL feed (replication mode): events read from the slot go through
//! the same stages as claimed rows, in lanes by aggregate, but nothing is
//! written for an event that is published. An event that is not (a
//! refusal, a retry, a paused target, a delay) crosses the [`Handover`] to
//! the table with its outcome, and the later events of its aggregate follow
//! it there, so the claim feed retries, dead-letters and orders them as in
//! claim mode. The slot's position is confirmed past a batch only once
//! every event of it is published or in the table ([`Progress`]).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::Relay;
use crate::store::replication::{StreamError, StreamSettings, StreamedRow, WalBatch, WalStream};
use crate::store::{Outcome, PgOutbox, RowOutcome};
use crate::telemetry::{Occurrence, Repeats};

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
type Key = (String, String);

fn key(row: &StreamedRow) -> Key {
    (row.row.aggregate_type.clone(), row.row.aggregate_id.clone())
}

/// A hash of an event's aggregate: its lane, and its place in a wave.
/// Two aggregates that share one only share a lane or wait for the next
/// wave; order never depends on it.
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

/// Batches in flight, in stream order: a batch's position may be
/// confirmed once every part of it and of every earlier batch is done.
struct Progress<P> {
    next: u64,
    /// Sequence number, parts not yet done, position it completes.
    pending: std::collections::VecDeque<(u64, usize, Option<P>)>,
}

impl<P> Default for Progress<P> {
    fn default() -> Self {
        Progress {
            next: 0,
            pending: std::collections::VecDeque::new(),
        }
    }
}

impl<P: Ord + Copy> Progress<P> {
    /// A batch handed to `parts` lanes; returns its sequence number.
    fn push(&mut self, parts: usize, done_at: Option<P>) -> u64 {
        let seq = self.next;
        self.next += 1;
        self.pending.push_back((seq, parts, done_at));
        seq
    }

    /// One lane finished its part of batch `seq`.
    fn part_done(&mut self, seq: u64) {
        if let Some(entry) = self.pending.iter_mut().find(|(s, _, _)| *s == seq) {
            entry.1 = entry.1.saturating_sub(1);
        }
    }

    /// The furthest position every finished batch at the front completes.
    fn confirmable(&mut self) -> Option<P> {
        let mut furthest = None;
        while let Some(&(_, 0, done_at)) = self.pending.front() {
            self.pending.pop_front();
            furthest = furthest.max(done_at);
        }
        furthest
    }
}

/// The bridge from the WAL feed to the table, one per lane: rows not
/// published are handed over to the claim feed there (which is woken), and
/// what the lane knows of the table between batches.
struct Handover {
    relay: Relay,
    pg: PgOutbox,
    /// Some aggregate may wait behind a row in the table: each batch's
    /// aggregates are looked up there (else none are).
    may_hold: bool,
    checked: Instant,
}

/// Reads a replication slot and relays what it reads.
pub(super) struct WalFeed {
    relay: Relay,
    settings: StreamSettings,
    pg: PgOutbox,
}

impl WalFeed {
    pub(super) fn new(relay: Relay, settings: StreamSettings, pg: PgOutbox) -> WalFeed {
        WalFeed { relay, settings, pg }
    }

    /// Reads the slot until `shutdown`: as its reader, or as a standby
    /// while another relay reads it.
    ///
    /// # Errors
    /// The slot cannot be read any more (dropped, invalidated): the relay
    /// cannot go on, and an operator has to act.
    pub(super) async fn run(&self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let settings = &self.settings;
        let broken = Repeats::default();
        let mut standing_by = false;
        // The first pause after a break is 200 ms.
        let mut pause = crate::backoff::Backoff::new(Duration::from_millis(200), RETRY_MAX);
        while !shutdown.is_cancelled() {
            let opened = tokio::select! {
                opened = WalStream::open(settings) => opened,
                () = shutdown.cancelled() => return Ok(()),
            };
            let failed = match opened {
                Ok(stream) => {
                    if standing_by || broken.ended().is_some() {
                        info!(slot = %settings.slot, "Reading the replication slot now.");
                    } else {
                        info!(slot = %settings.slot, "Reading the replication slot.");
                    }
                    standing_by = false;
                    pause.reset();
                    let metrics = &self.relay.inner.metrics;
                    metrics.set_replication_reading(true);
                    let ended = self.read(stream, &shutdown).await;
                    metrics.set_replication_reading(false);
                    ended
                }
                Err(error) => error,
            };
            let wait = match failed {
                StreamError::Standby(why) => {
                    if !standing_by {
                        info!(slot = %settings.slot, "Standing by: {why}.");
                        standing_by = true;
                    }
                    STANDBY_RETRY
                }
                StreamError::Gone(why) => {
                    if shutdown.is_cancelled() {
                        return Ok(());
                    }
                    anyhow::bail!(why);
                }
                StreamError::Broken(why) => {
                    match broken.occurred() {
                        Occurrence::First => {
                            warn!(slot = %settings.slot, error = %why, "The replication stream broke; connecting again.")
                        }
                        Occurrence::Still { count, lasting } => warn!(
                            slot = %settings.slot, error = %why, count, lasting_s = lasting.as_secs(),
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

    /// Relays batches from an open stream until it fails or `shutdown`.
    /// Each aggregate belongs to one of `concurrency` lanes, which relay
    /// their share of each batch in stream order, side by side; the slot is
    /// confirmed up to the last batch that every lane has finished, as have
    /// all batches before it.
    async fn read(&self, mut stream: WalStream, shutdown: &CancellationToken) -> StreamError {
        let lanes = usize::try_from(self.relay.inner.config.concurrency.max(1)).unwrap_or(1);
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
        let mut senders = Vec::with_capacity(lanes);
        let mut running = tokio::task::JoinSet::new();
        for _ in 0..lanes {
            // A few parts queued per lane; a lane takes all that wait at
            // once, so that a busy stream is published in large calls (a
            // broker's round trip per call bounds a lane, not its rows).
            let (tx, mut rx) = tokio::sync::mpsc::channel::<(u64, Vec<StreamedRow>)>(LANE_QUEUE);
            senders.push(tx);
            let done = done_tx.clone();
            let mut handover = Handover {
                relay: self.relay.clone(),
                pg: self.pg.clone(),
                may_hold: true,
                checked: Instant::now() - TABLE_RECHECK,
            };
            running.spawn(async move {
                while let Some((seq, mut rows)) = rx.recv().await {
                    let mut seqs = vec![seq];
                    while let Ok((seq, more)) = rx.try_recv() {
                        seqs.push(seq);
                        rows.extend(more);
                    }
                    handover.refresh().await;
                    handover.relay_streamed(rows).await;
                    for seq in seqs {
                        let _ = done.send(seq);
                    }
                }
            });
        }
        drop(done_tx);
        let mut progress = Progress::default();
        let ended = loop {
            while let Ok(seq) = done_rx.try_recv() {
                progress.part_done(seq);
            }
            if let Some(lsn) = progress.confirmable() {
                stream.confirm(lsn);
            }
            let batch = tokio::select! {
                batch = stream.next_batch() => batch,
                Some(seq) = done_rx.recv() => {
                    progress.part_done(seq);
                    continue;
                }
                () = shutdown.cancelled() => break StreamError::Gone("shut down".into()),
            };
            let WalBatch { rows, done_at } = match batch {
                Ok(batch) => batch,
                Err(error) => break error,
            };
            let mut parts: Vec<Vec<StreamedRow>> = (0..lanes).map(|_| Vec::new()).collect();
            for streamed in rows {
                parts[lane_of(&streamed, lanes)].push(streamed);
            }
            let seq = progress.push(parts.iter().filter(|part| !part.is_empty()).count(), done_at);
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
        let bound = Duration::from_millis(self.relay.inner.config.shutdown_timeout_ms);
        if tokio::time::timeout(bound, async { while running.join_next().await.is_some() {} })
            .await
            .is_err()
        {
            running.abort_all();
        }
        while let Ok(seq) = done_rx.try_recv() {
            progress.part_done(seq);
        }
        if let Some(lsn) = progress.confirmable() {
            stream.confirm(lsn);
        }
        stream.close().await;
        ended
    }
}

impl Handover {
    /// Forgets that aggregates may wait in the table once none does.
    async fn refresh(&mut self) {
        if !self.may_hold || self.checked.elapsed() < TABLE_RECHECK {
            return;
        }
        self.checked = Instant::now();
        match self.pg.anything_waiting_in_table().await {
            Ok(waiting) => self.may_hold = waiting,
            Err(error) => debug!(%error, "Cannot tell whether rows wait in the table; looking them up."),
        }
    }

    /// One batch from the stream. Its events go in waves of at most one per
    /// aggregate, so that an aggregate's later event is never published
    /// before an earlier one has its outcome.
    async fn relay_streamed(&mut self, rows: Vec<StreamedRow>) {
        let now_ms = chrono::Utc::now().timestamp_millis();
        let mut waiting = if self.may_hold {
            let keys: Vec<Key> = rows.iter().map(key).collect();
            self.until_answered("look up waiting aggregates", || self.pg.waiting_in_table(&keys))
                .await
        } else {
            HashSet::new()
        };
        let mut follow = Vec::new();
        let mut remaining = rows;
        loop {
            let mut wave = Vec::new();
            let mut later = Vec::new();
            let mut in_wave = rustc_hash::FxHashSet::default();
            for streamed in remaining {
                if !waiting.is_empty() && waiting.contains(&key(&streamed)) {
                    follow.push(streamed);
                } else if streamed.not_before_ms.is_some_and(|at| at > now_ms) {
                    // Delayed by its writer: the claim path holds it until then.
                    waiting.insert(key(&streamed));
                    follow.push(streamed);
                } else if in_wave.insert(aggregate_hash(&streamed)) {
                    wave.push(streamed);
                } else {
                    later.push(streamed);
                }
            }
            if wave.is_empty() {
                break;
            }
            let failed = self.relay_wave(wave).await;
            if !failed.is_empty() {
                self.may_hold = true;
                waiting.extend(failed);
            }
            remaining = later;
        }
        if !follow.is_empty() {
            self.may_hold = true;
            let outcomes: Vec<RowOutcome> = follow
                .iter()
                .map(|streamed| RowOutcome {
                    id: streamed.row.id,
                    outcome: Outcome::Defer {
                        after: Duration::ZERO,
                        reason: "follows an earlier event of its aggregate that waits in the outbox table, or was delayed by its writer".into(),
                        waiting_on: Vec::new(),
                    },
                    deliveries: Default::default(),
                    plugin_version: None,
                })
                .collect();
            let rows: Vec<&StreamedRow> = follow.iter().collect();
            self.hand_over(&rows, &outcomes).await;
        }
    }

    /// Runs one wave through the stages; hands what was not published to
    /// the table. Returns the aggregates that now wait there.
    async fn relay_wave(&self, wave: Vec<StreamedRow>) -> HashSet<Key> {
        let deadline = Instant::now() + self.relay.inner.config.lease_duration();
        let rows = wave.iter().map(|streamed| streamed.row.clone()).collect();
        let settled = self.relay.stages(rows, deadline, Duration::ZERO).await;
        let (mut rows, mut outcomes) = (Vec::new(), Vec::new());
        for (streamed, outcome) in wave.iter().zip(settled.outcomes) {
            if outcome.outcome != Outcome::Published {
                rows.push(streamed);
                outcomes.push(outcome);
            }
        }
        if rows.is_empty() {
            return HashSet::new();
        }
        self.hand_over(&rows, &outcomes).await;
        rows.into_iter().map(key).collect()
    }

    /// Hands rows to the table, trying until the database takes them: the
    /// slot is not confirmed past them before, so nothing is lost either
    /// way, but the stream waits meanwhile.
    async fn hand_over(&self, rows: &[&StreamedRow], outcomes: &[RowOutcome]) {
        let inner = &self.relay.inner;
        let lease_ms = i64::try_from(inner.config.lease_duration_ms).unwrap_or(i64::MAX);
        let recorded = self
            .until_answered("hand rows over to the outbox table", || {
                self.pg.hand_over(&inner.owner, lease_ms, rows, outcomes)
            })
            .await;
        debug!(rows = rows.len(), recorded, "Handed rows over to the claim path.");
        inner.wake.notify_one();
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

#[cfg(test)]
mod tests {
    use super::Progress;

    #[test]
    fn a_position_is_confirmed_only_when_every_earlier_batch_is_done() {
        let mut progress = Progress::default();
        let first = progress.push(2, Some(10u64));
        let second = progress.push(1, Some(20));
        let empty = progress.push(0, Some(25));
        let third = progress.push(1, None);
        // The second batch finishing first confirms nothing.
        progress.part_done(second);
        assert_eq!(progress.confirmable(), None);
        progress.part_done(first);
        assert_eq!(
            progress.confirmable(),
            None,
            "one lane of the first batch is still at work"
        );
        progress.part_done(first);
        // The first three are done: the furthest of their positions.
        assert_eq!(progress.confirmable(), Some(25));
        assert_eq!(progress.confirmable(), None);
        // A batch that ends inside a transaction moves nothing.
        progress.part_done(third);
        assert_eq!(progress.confirmable(), None);
        let _ = empty;
    }
}
