//! The WAL feed's own loop under generated workloads: [`Lanes::read`] (the
//! split of each batch among lanes, a lane's merging of queued parts up to
//! its batch and the split of its report back to each batch, the table's
//! recheck behind `may_hold`, the confirm, a kill and a reopen) runs on a
//! paused clock over an in-memory change stream, outbox table and broker.
//! After every step: the stream is never confirmed past an event that is
//! neither acknowledged nor in the table, and each aggregate reaches the
//! consumer in order with no hole; in the end every event arrived or is a
//! dead letter, and the stream caught up.
//!
//! `PROPTEST_CASES` sets the number of cases (128 by default).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use proptest::prelude::*;

use super::machine::tests::{Kind, first_deliveries_in_order, transaction};
use super::*;
use crate::store::Error;
use crate::store::change_stream::{AggregateKey, StreamedText, behind_a_gap};

#[derive(Debug, Clone)]
struct Event {
    aggregate: u8,
    seq: u32,
    kind: Kind,
    delayed: bool,
}

/// A broker's answer to one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Ack,
    /// Refused for good: the event is dead-lettered in the table.
    Refused,
    /// The event's own transient failure.
    Transient,
    /// No answer in time, but the broker kept it: the consumer sees it.
    TimedOutDelivered,
    /// The connection broke mid-call and the message never arrived.
    Broken,
    /// The stages gave no outcome for it (a routing task ended early).
    NoOutcome,
}

/// A row of the outbox table as the claim path sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Written by the writer, for the stream (not the claim path's).
    Streamed,
    Pending,
    Published,
    Dead,
}

/// One item of the log: an event, or a transaction's commit.
#[derive(Debug, Clone, Copy)]
enum Wal {
    Event(usize),
    Commit,
}

#[derive(Debug, Clone)]
enum Action {
    /// A writer commits a transaction: (aggregate, kind, delayed) per event.
    Write(Vec<(u8, Kind, bool)>),
    /// Committed transactions become visible to other sessions (the log
    /// hands a commit out before that; a hand-over waits for it).
    Visible,
    /// Time passes (ms): the reader and the lanes run meanwhile.
    Wait(u16),
    /// The target goes down or comes back.
    Target(bool),
    /// The claim path publishes the head of each aggregate in the table.
    Claim,
    /// The relay is killed and starts again from the confirmed position.
    Kill,
    /// The server ends the stream; the relay reads again.
    Break,
    /// The database does not take the first row of the next `n`
    /// hand-overs, and answers so.
    DropProof(u8),
    /// The next `n` statements on the table fail.
    FailStatements(u8),
}

/// Everything outside the feed: the log, the table, the broker, the
/// consumer. Locked briefly, never across an await.
struct World {
    events: Vec<Event>,
    next_seq: HashMap<u8, u32>,
    wal: Vec<Wal>,
    /// Log items before this are visible to other sessions.
    visible: usize,
    /// The stream's confirmed position: log items before it are done.
    confirmed: usize,
    table: BTreeMap<u64, (usize, State)>,
    fresh: u64,
    consumed: Vec<usize>,
    acked: HashSet<usize>,
    up: bool,
    answers: Vec<Answer>,
    answered: usize,
    /// How many log items each read takes, in turn.
    reads: Vec<usize>,
    read_count: usize,
    /// How long each publish takes (ms), in turn.
    latencies: Vec<u8>,
    published_calls: usize,
    drop_proof: u8,
    fail_statements: u8,
    break_stream: bool,
    /// Aggregates of which the table refused a row: only their events may
    /// hold the stream.
    refused: HashSet<u8>,
    /// The first broken promise, seen where it happened.
    broken: Option<String>,
}

const FRESH_BASE: u64 = 1_000_000;

impl World {
    fn write(&mut self, events: &[(u8, Kind, bool)]) {
        for &(aggregate, kind, delayed) in events {
            let seq = self.next_seq.entry(aggregate).or_default();
            let at = self.events.len();
            self.events.push(Event {
                aggregate,
                seq: *seq,
                kind,
                delayed,
            });
            *seq += 1;
            if kind == Kind::Row {
                self.table.insert(id_of(at), (at, State::Streamed));
            }
            self.wal.push(Wal::Event(at));
        }
        self.wal.push(Wal::Commit);
    }

    fn streamed(&self, at: usize) -> StreamedRow {
        let event = &self.events[at];
        let mut row = crate::relay::plan::tests::row(i64::try_from(id_of(at)).expect("small"), &[]);
        row.event_id = uuid::Uuid::from_u128(at as u128);
        row.aggregate_type = "agg".into();
        row.aggregate_id = event.aggregate.to_string();
        StreamedRow {
            row,
            text: StreamedText::default(),
            not_before_ms: event.delayed.then_some(i64::MAX / 2),
            id_at_handover: event.kind == Kind::Source,
        }
    }

    /// The table's entry for an event: its id and state.
    fn in_table(&self, event: usize) -> Option<(u64, State)> {
        self.table
            .iter()
            .find(|(_, (e, _))| *e == event)
            .map(|(id, (_, state))| (*id, *state))
    }

    fn statement(&mut self) -> Result<(), Error> {
        if self.fail_statements > 0 {
            self.fail_statements -= 1;
            return Err(Error::Unanswered {
                what: "model statement",
                after: Duration::ZERO,
            });
        }
        Ok(())
    }

    /// The claim path: the oldest pending row of each aggregate goes out
    /// while the target is up.
    fn claim(&mut self) {
        if !self.up {
            return;
        }
        let mut seen = HashSet::new();
        let heads: Vec<u64> = self
            .table
            .iter()
            .filter(|(_, (event, state))| {
                *state == State::Pending && seen.insert(self.events[*event].aggregate)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in heads {
            let (event, _) = self.table[&id];
            self.consumed.push(event);
            self.acked.insert(event);
            self.table.insert(id, (event, State::Published));
        }
    }

    /// Never confirmed past an event that is neither acknowledged nor in
    /// the table.
    fn check_confirmed(&self) -> Result<(), String> {
        for item in &self.wal[..self.confirmed] {
            let Wal::Event(event) = *item else { continue };
            let owned = matches!(self.in_table(event), Some((_, state)) if state != State::Streamed);
            if !self.acked.contains(&event) && !owned {
                return Err(format!(
                    "the stream was confirmed to {} past event {event} ({:?}), neither acknowledged nor in the table",
                    self.confirmed, self.events[event]
                ));
            }
        }
        Ok(())
    }

    /// Per aggregate, first deliveries in order and with no hole.
    fn check_order(&self) -> Result<(), String> {
        let dead: HashSet<usize> = self
            .table
            .values()
            .filter(|(_, state)| *state == State::Dead)
            .map(|(event, _)| *event)
            .collect();
        let written: Vec<(u8, u32)> = self.events.iter().map(|e| (e.aggregate, e.seq)).collect();
        first_deliveries_in_order(&self.consumed, &written, &dead)
    }

    fn check(&self) -> Result<(), String> {
        if let Some(broken) = &self.broken {
            return Err(broken.clone());
        }
        self.check_confirmed()?;
        self.check_order()
    }
}

/// An event's id in the table (and its stand-in while streamed).
fn id_of(at: usize) -> u64 {
    at as u64 + 1
}

/// The event a streamed row is.
fn event_of(row: &StreamedRow) -> usize {
    usize::try_from(row.row.event_id.as_u128()).expect("small")
}

#[derive(Clone)]
struct Shared(Arc<Mutex<World>>);

impl Shared {
    fn lock(&self) -> MutexGuard<'_, World> {
        self.0.lock().expect("not poisoned")
    }
}

/// The log as a change stream, read from the confirmed position.
struct Stream {
    world: Shared,
    at: usize,
}

impl ChangeStream for Stream {
    type Position = usize;

    async fn next_batch(&mut self) -> Result<StreamBatch<usize>, StreamError> {
        loop {
            tokio::time::sleep(Duration::from_millis(1)).await;
            let mut world = self.world.lock();
            if std::mem::take(&mut world.break_stream) {
                return Err(StreamError::Broken("the model's server ended the stream".into()));
            }
            let take = world.reads[world.read_count % world.reads.len()];
            let mut batch = StreamBatch::default();
            for _ in 0..take {
                let Some(item) = world.wal.get(self.at).copied() else {
                    break;
                };
                self.at += 1;
                match item {
                    Wal::Event(event) => batch.rows.push(world.streamed(event)),
                    Wal::Commit => batch.done_at = Some(self.at),
                }
            }
            if !batch.rows.is_empty() || batch.done_at.is_some() {
                world.read_count += 1;
                return Ok(batch);
            }
        }
    }

    fn confirm(&self, position: usize) {
        let mut world = self.world.lock();
        world.confirmed = world.confirmed.max(position);
        if world.broken.is_none()
            && let Err(broken) = world.check_confirmed()
        {
            world.broken = Some(broken);
        }
    }

    async fn close(self) {}
}

/// The outbox table as the hand-over sees it.
#[derive(Clone)]
struct Table(Shared);

impl HandoverTable for Table {
    async fn waiting_in_table(&self, keys: &[AggregateKey]) -> Result<HashSet<AggregateKey>, Error> {
        let mut world = self.0.lock();
        world.statement()?;
        let waiting: HashSet<String> = world
            .table
            .values()
            .filter(|(_, state)| *state == State::Pending)
            .map(|(event, _)| world.events[*event].aggregate.to_string())
            .collect();
        Ok(keys
            .iter()
            .filter(|(_, id)| waiting.contains(id))
            .cloned()
            .collect())
    }

    async fn anything_waiting_in_table(&self) -> Result<bool, Error> {
        let mut world = self.0.lock();
        world.statement()?;
        Ok(world.table.values().any(|(_, state)| *state == State::Pending))
    }

    /// As the stores do: an upsert that waits for the writer's transaction
    /// to be visible, then takes each row unless one before it of its
    /// aggregate was not taken (that one is given back).
    async fn hand_over(
        &self,
        _owner: &str,
        _lease_ms: i64,
        rows: &[&StreamedRow],
        outcomes: &[RowOutcome],
    ) -> Result<Vec<bool>, Error> {
        let last = rows.iter().map(|row| event_of(row)).max().unwrap_or(0);
        loop {
            {
                let world = self.0.lock();
                let visible = world.wal[..world.visible]
                    .iter()
                    .any(|item| matches!(item, Wal::Event(e) if *e == last));
                if visible {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut world = self.0.lock();
        world.statement()?;
        let mut taken: Vec<bool> = vec![true; rows.len()];
        if world.drop_proof > 0 && !rows.is_empty() {
            world.drop_proof -= 1;
            taken[0] = false;
        }
        let keys = rows.iter().map(|row| row.row.aggregate_id.clone());
        for at in behind_a_gap(keys, &taken) {
            taken[at] = false;
        }
        for (row, taken) in rows.iter().zip(&taken) {
            if !taken {
                let aggregate = world.events[event_of(row)].aggregate;
                world.refused.insert(aggregate);
            }
        }
        for ((row, outcome), taken) in rows.iter().zip(outcomes).zip(&taken) {
            if !taken {
                continue;
            }
            let event = event_of(row);
            let state = match outcome.outcome {
                Outcome::Dead { .. } => State::Dead,
                Outcome::Published => State::Published,
                _ => State::Pending,
            };
            match world.in_table(event) {
                Some((id, State::Streamed)) => {
                    world.table.insert(id, (event, state));
                }
                Some(_) => {}
                None => {
                    let id = if row.id_at_handover {
                        world.fresh += 1;
                        world.fresh
                    } else {
                        id_of(event)
                    };
                    world.table.insert(id, (event, state));
                }
            }
        }
        Ok(taken)
    }

    async fn mode_mismatch(&self, _replication: bool) -> Result<Option<&'static str>, Error> {
        Ok(None)
    }

    /// The model's table is set up for its stream from the start.
    async fn feed_statements(
        &self,
        _feed: Option<crate::store::change_stream::FeedNames<'_>>,
    ) -> Result<Vec<String>, Error> {
        Ok(Vec::new())
    }

    async fn run_feed_statements(&self, _statements: &[String]) -> Result<(), Error> {
        Ok(())
    }
}

/// The broker behind the stages.
#[derive(Clone)]
struct Broker(Shared);

impl Stages for Broker {
    async fn publish(&self, rows: Vec<OutboxRow>) -> Vec<RowOutcome> {
        let latency = {
            let mut world = self.0.lock();
            world.published_calls += 1;
            world.latencies[world.published_calls % world.latencies.len()]
        };
        tokio::time::sleep(Duration::from_millis(u64::from(latency))).await;
        let mut world = self.0.lock();
        let mut outcomes = Vec::new();
        for row in rows {
            let event = usize::try_from(row.event_id.as_u128()).expect("small");
            let answer = if world.up {
                let answer = world.answers[world.answered % world.answers.len()];
                world.answered += 1;
                answer
            } else {
                Answer::Broken
            };
            if matches!(answer, Answer::Ack | Answer::TimedOutDelivered) {
                world.consumed.push(event);
            }
            if answer == Answer::Ack {
                world.acked.insert(event);
            }
            let outcome = match answer {
                Answer::Ack => Outcome::Published,
                Answer::Refused => Outcome::Dead {
                    error: "refused".into(),
                },
                Answer::Transient | Answer::TimedOutDelivered => Outcome::Retry {
                    after: Duration::ZERO,
                    error: "transient".into(),
                },
                Answer::Broken => Outcome::Defer {
                    after: Duration::ZERO,
                    reason: "target down".into(),
                    waiting_on: Vec::new(),
                },
                Answer::NoOutcome => continue,
            };
            outcomes.push(RowOutcome {
                id: row.id,
                outcome,
                deliveries: Default::default(),
                plugin_version: None,
            });
        }
        if world.broken.is_none()
            && let Err(broken) = world.check_order()
        {
            world.broken = Some(broken);
        }
        outcomes
    }

    fn handed_over(&self) {}

    /// Only an event the table refused, or one behind it, holds the stream.
    fn held(&self, held: &Held<uuid::Uuid>) {
        let mut world = self.0.lock();
        let unexplained: Vec<usize> = held
            .events
            .iter()
            .map(|id| usize::try_from(id.as_u128()).expect("small"))
            .filter(|&event| !world.refused.contains(&world.events[event].aggregate))
            .collect();
        if world.broken.is_none() && (held.missing > 0 || !unexplained.is_empty()) {
            world.broken = Some(format!(
                "the stream was held before events the table never refused ({unexplained:?}) or no lane \
                 accounted for ({})",
                held.missing
            ));
        }
    }
}

/// A relay: reads, and reads again after the stream ends, until killed.
fn start(world: &Shared, cap: usize) -> tokio::task::JoinHandle<()> {
    let lanes = Lanes {
        stages: Broker(world.clone()),
        lanes: 2,
        cap,
        owner: "model".into(),
        lease_ms: 30_000,
        finish_within: Duration::from_secs(5),
    };
    let world = world.clone();
    tokio::spawn(async move {
        let never = CancellationToken::new();
        loop {
            let at = world.lock().confirmed;
            let stream = Stream {
                world: world.clone(),
                at,
            };
            let table = Table(world.clone());
            lanes.read(stream, || table.clone(), "model", &never).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

fn run(
    actions: &[Action],
    answers: Vec<Answer>,
    reads: Vec<usize>,
    latencies: Vec<u8>,
    cap: usize,
) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let world = Shared(Arc::new(Mutex::new(World {
            events: Vec::new(),
            next_seq: HashMap::new(),
            wal: Vec::new(),
            visible: 0,
            confirmed: 0,
            table: BTreeMap::new(),
            fresh: FRESH_BASE,
            consumed: Vec::new(),
            acked: HashSet::new(),
            up: true,
            answers,
            answered: 0,
            reads,
            read_count: 0,
            latencies,
            published_calls: 0,
            drop_proof: 0,
            fail_statements: 0,
            break_stream: false,
            refused: HashSet::new(),
            broken: None,
        })));
        let mut relay = start(&world, cap);
        for action in actions {
            match action {
                Action::Write(events) => world.lock().write(events),
                Action::Visible => {
                    let mut w = world.lock();
                    w.visible = w.wal.len();
                }
                Action::Wait(ms) => tokio::time::sleep(Duration::from_millis(u64::from(*ms))).await,
                Action::Target(up) => world.lock().up = *up,
                Action::Claim => world.lock().claim(),
                Action::Kill => {
                    relay.abort();
                    let _ = relay.await;
                    relay = start(&world, cap);
                }
                Action::Break => world.lock().break_stream = true,
                Action::DropProof(n) => world.lock().drop_proof = *n,
                Action::FailStatements(n) => world.lock().fail_statements = *n,
            }
            world.lock().check()?;
        }
        // Everything to its end: the target up, no more failures.
        {
            let mut w = world.lock();
            w.up = true;
            w.answers = vec![Answer::Ack];
            w.drop_proof = 0;
            w.fail_statements = 0;
            w.visible = w.wal.len();
        }
        for _ in 0..2_000 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut w = world.lock();
            w.claim();
            w.check()?;
            let pending = w.table.values().any(|(_, state)| *state == State::Pending);
            if w.confirmed == w.wal.len() && !pending {
                break;
            }
        }
        relay.abort();
        let w = world.lock();
        w.check()?;
        let consumed: HashSet<usize> = w.consumed.iter().copied().collect();
        for (event, written) in w.events.iter().enumerate() {
            let dead = matches!(w.in_table(event), Some((_, State::Dead)));
            if !consumed.contains(&event) && !dead {
                return Err(format!("event {event} ({written:?}) never arrived"));
            }
        }
        if w.confirmed != w.wal.len() {
            return Err(format!(
                "the stream did not catch up: confirmed {} of {}",
                w.confirmed,
                w.wal.len()
            ));
        }
        Ok(())
    })
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => transaction().prop_map(Action::Write),
        2 => Just(Action::Visible),
        6 => prop_oneof![1u16..20, 20u16..3_000].prop_map(Action::Wait),
        1 => prop::bool::ANY.prop_map(Action::Target),
        2 => Just(Action::Claim),
        1 => Just(Action::Kill),
        1 => Just(Action::Break),
        3 => (1u8..=12).prop_map(Action::DropProof),
        1 => (1u8..=3).prop_map(Action::FailStatements),
    ]
}

fn answer() -> impl Strategy<Value = Answer> {
    prop_oneof![
        14 => Just(Answer::Ack),
        1 => Just(Answer::Refused),
        2 => Just(Answer::Transient),
        2 => Just(Answer::TimedOutDelivered),
        2 => Just(Answer::Broken),
        1 => Just(Answer::NoOutcome),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(128),
        max_shrink_iters: 1_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_lanes_never_confirm_past_an_event_neither_acknowledged_nor_in_the_table(
        actions in prop::collection::vec(action(), 1..80),
        answers in prop::collection::vec(answer(), 1..16),
        reads in prop::collection::vec(1usize..12, 1..6),
        latencies in prop::collection::vec(0u8..20, 1..6),
        cap in 1usize..6,
    ) {
        run(&actions, answers, reads, latencies, cap).map_err(TestCaseError::fail)?;
    }
}
