//! The WAL feed's decisions, apart from its I/O: which events of a batch
//! are published at once and which go to the table ([`LaneBatch`]), how far
//! the slot may be confirmed ([`Ledger`]), and what the reader does when its
//! stream ends ([`Reader`]). Nothing here awaits, reads a clock or talks to
//! a database: the feed asks for the next step, does it, and reports what
//! happened. The property test in `tests.rs` drives these same values
//! against a model of the world (the broker, the table, the slot).
//!
//! The invariant they keep: the slot is never confirmed past an event that
//! is neither acknowledged by every target it routes to nor proved to be in
//! the table, where the claim path owns it.

use std::collections::{HashSet, VecDeque};
use std::hash::Hash;

/// How many times a lane hands an event over before it stops trying and
/// the slot is held before it (a hand-over that the database answers
/// without proving the row is in the table: never expected).
pub(super) const HANDOVER_TRIES: u32 = 3;

/// Why an event goes to the table instead of out of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Why {
    /// It was sent and not published (refused, timed out, paused target).
    Failed,
    /// An earlier event of its aggregate waits in the table.
    Follows,
    /// Its writer delayed it (`not_before` ahead).
    Delayed,
}

/// Where one event of a lane's batch stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fate {
    /// Not decided yet: it goes in a later wave, or to the table.
    Open,
    /// Sent in the current wave; its outcome is awaited.
    Sending,
    /// Every target it routes to acknowledged it (or it routes nowhere).
    Published,
    /// To be handed over to the table; `tries` hand-overs did not prove it.
    ToTable { why: Why, tries: u32 },
    /// Being handed over; the proof is awaited.
    HandingOver { why: Why, tries: u32 },
    /// The hand-over proved it is in the table.
    InTable,
    /// Handed over [`HANDOVER_TRIES`] times without proof, or behind such
    /// an event of its aggregate: it goes neither out nor to the table
    /// (the slot is held before it and it is read again).
    Unresolved,
}

/// What a lane does next with its batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// Send these events (at most one per aggregate), then report each
    /// one's result with [`LaneBatch::sent`].
    Publish(Vec<usize>),
    /// Hand these events over to the table, then report with
    /// [`LaneBatch::handed_over`] which of them the table proved it holds.
    HandOver(Vec<(usize, Why)>),
    /// Every event is published, in the table, or unresolved.
    Done,
}

/// One lane's share of a stream batch, in stream order. Events go out in
/// waves of at most one per aggregate, so that an aggregate's later event
/// is never sent before an earlier one has its outcome; an event that is
/// not published, and every later event of its aggregate, go to the table.
#[derive(Debug)]
pub(super) struct LaneBatch<K> {
    keys: Vec<K>,
    delayed: Vec<bool>,
    fates: Vec<Fate>,
    /// Aggregates that wait in the table: their events follow there.
    waiting: HashSet<K>,
    /// Aggregates with an unresolved event: nothing more of them moves.
    blocked: HashSet<K>,
}

impl<K: Eq + Hash + Clone> LaneBatch<K> {
    /// A batch whose events have these aggregates and delays; `waiting`:
    /// the aggregates the table holds unfinished events of; `blocked`: the
    /// aggregates an earlier batch of the lane left an unresolved event of
    /// (their events here are unresolved too, so that none overtakes it).
    pub(super) fn new(
        keys: Vec<K>,
        delayed: Vec<bool>,
        waiting: HashSet<K>,
        blocked: HashSet<K>,
    ) -> LaneBatch<K> {
        let fates = keys
            .iter()
            .map(|key| {
                if blocked.contains(key) {
                    Fate::Unresolved
                } else {
                    Fate::Open
                }
            })
            .collect();
        LaneBatch {
            keys,
            delayed,
            fates,
            waiting,
            blocked,
        }
    }

    /// Aggregates with an unresolved event, for the lane's next batch.
    pub(super) fn blocked(self) -> HashSet<K> {
        self.blocked
    }

    /// Each event's fate so far.
    pub(super) fn fates(&self) -> &[Fate] {
        &self.fates
    }

    /// Whether any event of this batch went, or goes, to the table.
    pub(super) fn used_the_table(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// The next step. What failed is handed over before the next wave is
    /// sent (its aggregate's later events then follow it); what follows or
    /// was delayed goes after the last wave, in stream order.
    pub(super) fn next(&mut self) -> Step {
        debug_assert!(
            !self
                .fates
                .iter()
                .any(|f| matches!(f, Fate::Sending | Fate::HandingOver { .. })),
            "a step's report is missing"
        );
        let urgent = self.take_to_table(|why, tries| why == Why::Failed || tries > 0);
        if !urgent.is_empty() {
            return Step::HandOver(urgent);
        }
        let mut wave = Vec::new();
        let mut in_wave = HashSet::new();
        for at in 0..self.keys.len() {
            if self.fates[at] != Fate::Open {
                continue;
            }
            let key = &self.keys[at];
            if self.waiting.contains(key) {
                self.fates[at] = Fate::ToTable {
                    why: Why::Follows,
                    tries: 0,
                };
            } else if self.delayed[at] {
                self.waiting.insert(key.clone());
                self.fates[at] = Fate::ToTable {
                    why: Why::Delayed,
                    tries: 0,
                };
            } else if in_wave.insert(key.clone()) {
                self.fates[at] = Fate::Sending;
                wave.push(at);
            }
        }
        if !wave.is_empty() {
            return Step::Publish(wave);
        }
        let rest = self.take_to_table(|_, _| true);
        if !rest.is_empty() {
            return Step::HandOver(rest);
        }
        Step::Done
    }

    fn take_to_table(&mut self, pick: impl Fn(Why, u32) -> bool) -> Vec<(usize, Why)> {
        let mut taken = Vec::new();
        for (at, fate) in self.fates.iter_mut().enumerate() {
            if let Fate::ToTable { why, tries } = *fate
                && pick(why, tries)
            {
                *fate = Fate::HandingOver { why, tries };
                taken.push((at, why));
            }
        }
        taken
    }

    /// The results of a [`Step::Publish`]: `published[i]` for the `i`th
    /// event sent. An event without a result is taken as not published.
    pub(super) fn sent(&mut self, wave: &[usize], published: &[bool]) {
        for (i, &at) in wave.iter().enumerate() {
            if published.get(i).copied().unwrap_or(false) {
                self.fates[at] = Fate::Published;
            } else {
                self.waiting.insert(self.keys[at].clone());
                self.fates[at] = Fate::ToTable {
                    why: Why::Failed,
                    tries: 0,
                };
            }
        }
    }

    /// The results of a [`Step::HandOver`]: `in_table[i]` for the `i`th
    /// event handed over; an event without proof is handed over again, at
    /// most [`HANDOVER_TRIES`] times in all.
    pub(super) fn handed_over(&mut self, handed: &[(usize, Why)], in_table: &[bool]) {
        for (i, &(at, _)) in handed.iter().enumerate() {
            let Fate::HandingOver { why, tries } = self.fates[at] else {
                continue;
            };
            self.fates[at] = if in_table.get(i).copied().unwrap_or(false) {
                Fate::InTable
            } else if tries + 1 >= HANDOVER_TRIES {
                self.block(at);
                Fate::Unresolved
            } else {
                Fate::ToTable {
                    why,
                    tries: tries + 1,
                }
            };
        }
    }

    /// The event at `at` is unresolved: every later event of its aggregate
    /// not yet out or in the table stays where it is too.
    fn block(&mut self, at: usize) {
        let key = self.keys[at].clone();
        for later in at + 1..self.keys.len() {
            if self.keys[later] == key && matches!(self.fates[later], Fate::Open | Fate::ToTable { .. }) {
                self.fates[later] = Fate::Unresolved;
            }
        }
        self.blocked.insert(key);
    }
}

/// Why the slot is held where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Held<E> {
    /// Events of the batch that are neither published nor in the table, as
    /// the lanes named them.
    pub(super) events: Vec<E>,
    /// Events of the batch no lane accounted for at all.
    pub(super) missing: usize,
}

/// One stream batch, from the reader's count of its events.
#[derive(Debug)]
struct Entry<P, E> {
    seq: u64,
    rows: usize,
    parts: usize,
    published: usize,
    in_table: usize,
    unresolved: Vec<E>,
    done_at: Option<P>,
}

/// Batches in flight, in stream order, and the position the slot may be
/// confirmed to: a batch's position once it and every batch before it are
/// done, and every one of their events is published or in the table. The
/// counts come from the reader (how many events it handed to the lanes)
/// and from the lanes (what each event came to), so an event a lane lost
/// track of holds the slot too.
#[derive(Debug)]
pub(super) struct Ledger<P, E> {
    next: u64,
    pending: VecDeque<Entry<P, E>>,
}

impl<P, E> Default for Ledger<P, E> {
    fn default() -> Self {
        Ledger {
            next: 0,
            pending: VecDeque::new(),
        }
    }
}

impl<P: Ord + Copy, E: Clone> Ledger<P, E> {
    /// A batch of `rows` events handed to `parts` lanes, which completes
    /// position `done_at`; returns its sequence number.
    pub(super) fn push(&mut self, rows: usize, parts: usize, done_at: Option<P>) -> u64 {
        let seq = self.next;
        self.next += 1;
        self.pending.push_back(Entry {
            seq,
            rows,
            parts,
            published: 0,
            in_table: 0,
            unresolved: Vec::new(),
            done_at,
        });
        seq
    }

    /// A lane finished its part of batch `seq`.
    pub(super) fn part_done(&mut self, seq: u64, published: usize, in_table: usize, unresolved: Vec<E>) {
        if let Some(entry) = self.pending.iter_mut().find(|e| e.seq == seq) {
            entry.parts = entry.parts.saturating_sub(1);
            entry.published += published;
            entry.in_table += in_table;
            entry.unresolved.extend(unresolved);
        }
    }

    /// Batches in flight.
    #[cfg(test)]
    pub(super) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The furthest position the finished batches at the front complete,
    /// and, when a finished batch holds an event that is neither published
    /// nor in the table, why the slot stops before it.
    pub(super) fn confirmable(&mut self) -> (Option<P>, Option<Held<E>>) {
        let mut furthest = None;
        while let Some(front) = self.pending.front() {
            if front.parts > 0 {
                break;
            }
            let accounted = front.published + front.in_table;
            if accounted < front.rows || !front.unresolved.is_empty() {
                let held = Held {
                    events: front.unresolved.clone(),
                    missing: front.rows.saturating_sub(accounted + front.unresolved.len()),
                };
                return (furthest, Some(held));
            }
            furthest = furthest.max(front.done_at);
            self.pending.pop_front();
        }
        (furthest, None)
    }
}

/// The reader of the slot, between connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reader {
    /// Opening the stream for the first time.
    Starting,
    /// Reading the slot.
    Reading,
    /// Another session reads the slot; this relay tries it now and then.
    StandingBy,
    /// The stream broke (or the slot was held back): connecting again
    /// after a pause that grows.
    Broken,
}

/// How a stream ended, as the reader's decisions need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// Another session reads the slot.
    Standby,
    /// The slot cannot be read again.
    Gone,
    /// The connection broke, or the slot was held before an event.
    Broken,
}

/// What the reader does after a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Then {
    /// Say that it stands by (first time only), try again in a while.
    StandBy { first: bool },
    /// Try again after the next pause of the backoff.
    Reconnect,
    /// Stop the relay: an operator has to act.
    Stop,
}

impl Reader {
    /// The stream is open: whether to say it was read before by another.
    pub(super) fn opened(&mut self) -> Reader {
        std::mem::replace(self, Reader::Reading)
    }

    /// The stream ended this way.
    pub(super) fn ended(&mut self, how: Ended) -> Then {
        let then = match how {
            Ended::Standby => Then::StandBy {
                first: *self != Reader::StandingBy,
            },
            Ended::Gone => Then::Stop,
            Ended::Broken => Then::Reconnect,
        };
        *self = match how {
            Ended::Standby => Reader::StandingBy,
            Ended::Gone | Ended::Broken => Reader::Broken,
        };
        then
    }
}

#[cfg(test)]
pub(super) mod tests;
