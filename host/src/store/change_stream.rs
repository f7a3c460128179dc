//! The change-stream seam: what replication mode reads (a stream of
//! committed inserts with a position of its own) and where it hands over
//! what it does not publish (the outbox table), as traits that PostgreSQL's
//! slot and MariaDB's binary log implement, and the types both share. The
//! WAL feed is written once, against these.

use std::collections::{HashMap, HashSet};
use std::future::Future;

use super::{Error, LeaseId, OutboxStore, RowId, RowOutcome};
use crate::store::capture::Capture;
use crate::store::types::OutboxRow;

/// An insert read from the stream, ready for the stages.
#[derive(Debug, Clone)]
pub struct StreamedRow {
    /// The row as the stages take it (`attempts` 1: this is its first).
    pub row: OutboxRow,
    /// Its values as the stream had them, to copy it into the table should
    /// it be deleted before it is handed over.
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

/// Rows read, and the position that is done once they are.
#[derive(Debug)]
pub struct StreamBatch<P> {
    /// Inserts in commit order.
    pub rows: Vec<StreamedRow>,
    /// The end of the last transaction the batch completes: confirm it
    /// once every row is published or in the table (rows after it, of a
    /// transaction not yet complete, are done by then too, and confirmed
    /// with their commit). `None`: no transaction ended.
    pub done_at: Option<P>,
}

impl<P> Default for StreamBatch<P> {
    fn default() -> Self {
        StreamBatch {
            rows: Vec::new(),
            done_at: None,
        }
    }
}

/// An open stream of committed inserts.
pub trait ChangeStream: Send + 'static {
    /// How far the stream is: a WAL position, a binary log transaction's
    /// number in its session. Only this stream's own can be confirmed.
    type Position: Copy + Ord + std::fmt::Debug + Send + Sync + 'static;

    /// The next rows, waiting for some.
    fn next_batch(&mut self)
    -> impl Future<Output = Result<StreamBatch<Self::Position>, StreamError>> + Send;

    /// Everything up to `position` is published or in the table: the
    /// server may forget it.
    fn confirm(&self, position: Self::Position);

    /// Ends the session, saying the confirmed position a last time.
    fn close(self) -> impl Future<Output = ()> + Send;
}

/// An aggregate: type and id.
pub type AggregateKey = (String, String);

/// The names a change stream is read through, for the statements that set
/// a database up for it.
#[derive(Debug, Clone, Copy)]
pub struct FeedNames<'a> {
    /// The slot (PostgreSQL) or the recorded position (MariaDB).
    pub slot: &'a str,
    /// The publication (PostgreSQL).
    pub publication: &'a str,
    /// The `[source]` table read from the stream instead of the outbox.
    pub source: Option<&'a Capture>,
}

/// The outbox table a stream hands events over to: what is not published
/// from the stream goes there, with its outcome, and the claim path
/// retries, dead-letters and orders it.
pub trait HandoverTable: Clone + Send + Sync + 'static {
    /// Of these aggregates, those whose next event must wait behind an
    /// unfinished one in the table.
    fn waiting_in_table(
        &self,
        keys: &[AggregateKey],
    ) -> impl Future<Output = Result<HashSet<AggregateKey>, Error>> + Send;

    /// Whether any aggregate waits behind a row in the table.
    fn anything_waiting_in_table(&self) -> impl Future<Output = Result<bool, Error>> + Send;

    /// Hands streamed rows to the claim path with their outcomes: leased
    /// as if claimed, then acked. Returns, per row, whether the table now
    /// holds it for the claim path; rows taken behind an earlier row of
    /// their aggregate that was not are given back (see [`settle_hand_over`]).
    fn hand_over(
        &self,
        owner: &str,
        lease_ms: i64,
        rows: &[&StreamedRow],
        outcomes: &[RowOutcome],
    ) -> impl Future<Output = Result<Vec<bool>, Error>> + Send;

    /// A database set up for the other mode than the relay's (`replication`
    /// or claim), with what to do; `None` when they agree.
    fn mode_mismatch(
        &self,
        replication: bool,
    ) -> impl Future<Output = Result<Option<&'static str>, Error>> + Send;

    /// What `migrate` runs to set the database up for this stream read
    /// through `feed` (only what is missing), or with `None` back to claim
    /// mode.
    fn feed_statements(
        &self,
        feed: Option<FeedNames<'_>>,
    ) -> impl Future<Output = Result<Vec<String>, Error>> + Send;

    /// Runs what [`HandoverTable::feed_statements`] returned.
    fn run_feed_statements(&self, statements: &[String]) -> impl Future<Output = Result<(), Error>> + Send;
}

/// Where a feed's stream comes from, and the table it hands over to.
pub trait ChangeSource: Send + Sync + 'static {
    /// The open stream.
    type Stream: ChangeStream;
    /// The table.
    type Table: HandoverTable;

    /// The slot's or position's name, for what the relay says.
    fn name(&self) -> &str;

    /// The table the stream hands over to.
    fn table(&self) -> Self::Table;

    /// Opens a session, reading from the confirmed position.
    fn open(&self) -> impl Future<Output = Result<Self::Stream, StreamError>> + Send;
}

/// The end of a hand-over on any server: rows taken after an earlier
/// event of their aggregate that was not are given back (the claim path
/// would publish them before it) and not proved; the rest are acked with
/// their outcomes under the hand-over's lease. `renamed` maps stand-in ids
/// to the ids the table gave; `give_back` takes table ids and renamed ones.
pub(crate) async fn settle_hand_over(
    store: &OutboxStore,
    lease: LeaseId,
    rows: &[&StreamedRow],
    outcomes: &[RowOutcome],
    mut in_table: Vec<bool>,
    renamed: Vec<(RowId, RowId)>,
    give_back: impl AsyncFnOnce(&[i64], &[i64]) -> Result<(), Error>,
) -> Result<Vec<bool>, Error> {
    let renamed: HashMap<_, _> = renamed.into_iter().collect();
    let keys = rows
        .iter()
        .map(|r| (r.row.aggregate_type.as_str(), r.row.aggregate_id.as_str()));
    let behind = behind_a_gap(keys, &in_table);
    if !behind.is_empty() {
        let (mut ids, mut fresh) = (Vec::new(), Vec::new());
        for &at in &behind {
            let id = rows[at].row.id;
            match renamed.get(&id) {
                Some(new) => fresh.push(new.0),
                None => ids.push(id.0),
            }
            in_table[at] = false;
        }
        give_back(&ids, &fresh).await?;
    }
    let outcomes: Vec<RowOutcome> = outcomes
        .iter()
        .enumerate()
        .filter(|(at, _)| !behind.contains(at))
        .map(|(_, outcome)| RowOutcome {
            id: renamed.get(&outcome.id).copied().unwrap_or(outcome.id),
            ..outcome.clone()
        })
        .collect();
    store.ack(lease, &outcomes).await?;
    Ok(in_table)
}

/// Of rows handed over together (in stream order, by their aggregates)
/// with whether the table took each, those taken after an earlier row of
/// their aggregate that was not.
pub(crate) fn behind_a_gap<K: Eq + std::hash::Hash>(
    keys: impl Iterator<Item = K>,
    in_table: &[bool],
) -> Vec<usize> {
    let mut gaps: HashSet<K> = HashSet::new();
    let mut behind = Vec::new();
    for (at, key) in keys.enumerate() {
        if !in_table.get(at).copied().unwrap_or(false) {
            gaps.insert(key);
        } else if gaps.contains(&key) {
            behind.push(at);
        }
    }
    behind
}

#[cfg(test)]
mod tests {
    use super::behind_a_gap;

    #[test]
    fn rows_taken_behind_an_untaken_row_of_their_aggregate_are_named() {
        let keys = ["a", "b", "a", "a", "b", "c"];
        let taken = [false, true, true, false, true, true];
        assert_eq!(behind_a_gap(keys.iter(), &taken), vec![2]);
        assert_eq!(behind_a_gap(keys.iter(), &[true; 6]), Vec::<usize>::new());
        assert_eq!(behind_a_gap(["a", "a"].iter(), &[false, true]), vec![1]);
    }
}
