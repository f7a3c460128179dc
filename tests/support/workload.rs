//! A writer shaped like a service: each transaction touches several
//! aggregates and writes one to three events of each (an order, its lines,
//! its payment), some through `switchyard_emit` instead of a row, some into
//! a `[source]` table of the service's own. The outage and kill tests and
//! the fault runs write through it, so that the hand-over to the table is
//! tested the way services write.

use std::collections::HashMap;

use super::orders::{Expected, order_event};
use super::postgres::Outbox;
use super::service::{ServiceConn, ServicePool};

/// How a service writes.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// The table its rows go to: the outbox (`Switchyard`), the intake, or
    /// a `[source]` table (`Debezium`).
    pub rows: Outbox,
    /// Percent of (transaction, aggregate) pairs written with
    /// `switchyard_emit` instead of rows (outbox only: an aggregate's
    /// events come through one table).
    pub emit_percent: u32,
    /// Aggregates per transaction, at most.
    pub aggregates_per_transaction: usize,
    /// The service deletes each event in the transaction that writes it
    /// (replication and binlog mode relay it from the log).
    pub deleted: bool,
}

impl Shape {
    /// Rows into `rows`, several aggregates per transaction, 1 to 3 events each.
    pub fn rows(rows: Outbox) -> Shape {
        Shape {
            rows,
            emit_percent: 0,
            aggregates_per_transaction: 6,
            deleted: false,
        }
    }

    /// Replication mode's shape for runs by hand: with the share of
    /// aggregates `SWITCHYARD_FAULT_EMIT_PERCENT` names (0 by default)
    /// written by `switchyard_emit`, and each event deleted as it is
    /// written with `SWITCHYARD_FAULT_DELETE_AS_WRITTEN=1`, when the rows go
    /// to the outbox table.
    pub fn replicated(rows: Outbox) -> Shape {
        let emit = std::env::var("SWITCHYARD_FAULT_EMIT_PERCENT")
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        let shape = Shape::rows(rows).emitting(if rows == Outbox::Switchyard { emit } else { 0 });
        if rows == Outbox::Switchyard && deleting_asked() {
            shape.deleting()
        } else {
            shape
        }
    }

    /// With every event deleted in the transaction that writes it.
    pub fn deleting(self) -> Shape {
        Shape {
            deleted: true,
            ..self
        }
    }

    /// With this share of aggregates written by `switchyard_emit`.
    pub fn emitting(self, percent: u32) -> Shape {
        Shape {
            emit_percent: percent,
            ..self
        }
    }
}

/// Whether a run by hand asks for services that delete each event as they
/// write it (`SWITCHYARD_FAULT_DELETE_AS_WRITTEN=1`).
pub fn deleting_asked() -> bool {
    std::env::var("SWITCHYARD_FAULT_DELETE_AS_WRITTEN").is_ok_and(|v| v == "1")
}

/// A small deterministic generator (xorshift): the same seed writes the
/// same transactions.
#[derive(Debug, Clone)]
pub struct Dice(u64);

impl Dice {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Dice {
        Dice(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// One transaction's plan: (aggregate, events of it, through `outbox`).
pub type Plan = Vec<(usize, usize, Outbox)>;

/// A transaction's plan over `aggregates` (those `of` this writer owns:
/// `aggregate % writers == writer`).
pub fn plan(dice: &mut Dice, shape: Shape, aggregates: usize, writer: usize, writers: usize) -> Plan {
    let owned = (aggregates + writers - 1 - writer) / writers;
    let touched = 1 + dice.below(shape.aggregates_per_transaction.max(1) as u64) as usize;
    let mut plan: Plan = Vec::new();
    for _ in 0..touched.min(owned) {
        let aggregate = writer + writers * dice.below(owned as u64) as usize;
        if plan.iter().any(|(a, _, _)| *a == aggregate) {
            continue;
        }
        let count = 1 + dice.below(3) as usize;
        let outbox = if shape.rows == Outbox::Switchyard && dice.below(100) < u64::from(shape.emit_percent) {
            Outbox::Emitted
        } else {
            shape.rows
        };
        plan.push((aggregate, count, outbox));
    }
    plan
}

/// Writes one transaction on `conn` as `plan` says, the events of its
/// aggregates interleaved as a service's code writes them (an order, then
/// its lines, then the next order...), without committing. Returns what
/// the consumer should see.
///
/// # Errors
/// The database's; the caller's transaction is then to be rolled back.
pub async fn write_plan(
    conn: &mut sqlx::PgConnection,
    plan: &Plan,
    next_seq: &mut HashMap<usize, usize>,
) -> Result<Vec<(String, Expected)>, sqlx::Error> {
    write_plan_with(conn, plan, next_seq).await
}

/// [`write_plan`] on a service connection of any database.
///
/// # Errors
/// The database's; the caller's transaction is then to be rolled back.
pub async fn write_plan_with<C: ServiceConn + ?Sized>(
    conn: &mut C,
    plan: &Plan,
    next_seq: &mut HashMap<usize, usize>,
) -> Result<Vec<(String, Expected)>, sqlx::Error> {
    let mut written = Vec::new();
    let most = plan.iter().map(|(_, count, _)| *count).max().unwrap_or(0);
    for round in 0..most {
        for &(aggregate, count, outbox) in plan {
            if round >= count {
                continue;
            }
            let seq = next_seq.entry(aggregate).or_default();
            let event = order_event(aggregate, *seq);
            let id = conn.insert_event(outbox, &event).await?;
            written.push((
                id,
                Expected {
                    aggregate_id: event.aggregate_id,
                    seq: *seq as u64,
                    event_type: event.event_type,
                },
            ));
            *seq += 1;
        }
    }
    Ok(written)
}

/// `writers` concurrent writers, each committing `transactions` of
/// `shape` over its share of `aggregates` (so one aggregate's events are
/// committed in sequence). Returns what the consumer should see.
pub async fn write_transactions(
    pool: impl Into<ServicePool>,
    shape: Shape,
    aggregates: usize,
    transactions: usize,
    writers: usize,
    seed: u64,
) -> HashMap<String, Expected> {
    write(
        pool,
        shape,
        aggregates,
        Until::Transactions(transactions),
        writers,
        seed,
    )
    .await
}

/// [`write_transactions`] until at least `events` events are written.
pub async fn write_events(
    pool: impl Into<ServicePool>,
    shape: Shape,
    aggregates: usize,
    events: usize,
    writers: usize,
    seed: u64,
) -> HashMap<String, Expected> {
    write(
        pool,
        shape,
        aggregates,
        Until::Events(events.div_ceil(writers.max(1))),
        writers,
        seed,
    )
    .await
}

/// How much each writer writes.
#[derive(Debug, Clone, Copy)]
enum Until {
    Transactions(usize),
    Events(usize),
}

async fn write(
    pool: impl Into<ServicePool>,
    shape: Shape,
    aggregates: usize,
    until: Until,
    writers: usize,
    seed: u64,
) -> HashMap<String, Expected> {
    let pool: ServicePool = pool.into();
    let mut tasks = Vec::new();
    for writer in 0..writers {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let mut dice = Dice::new(seed + writer as u64);
            let mut next_seq = HashMap::new();
            let mut written = Vec::new();
            let mut transactions = 0;
            while match until {
                Until::Transactions(n) => transactions < n,
                Until::Events(n) => written.len() < n,
            } {
                let plan = plan(&mut dice, shape, aggregates, writer, writers);
                let mut seqs = next_seq.clone();
                let events = pool.write(&plan, &mut seqs, shape.deleted).await.expect("write");
                next_seq = seqs;
                written.extend(events);
                transactions += 1;
            }
            written
        }));
    }
    let mut expected = HashMap::new();
    for task in tasks {
        expected.extend(task.await.expect("writer task"));
    }
    expected
}

/// How many connections a paced service writes on at once.
const PACED_WRITERS: usize = 4;

/// A service committing `per_second` transactions of `shape` a second over
/// `aggregates` until `stop` is cancelled, on [`PACED_WRITERS`] connections
/// at once, as a service's handlers write: each owns a share of the
/// aggregates, so an aggregate's order is one connection's. A transaction
/// that fails (the database is down) is printed and written again until
/// it goes through. Returns what the consumer should see.
pub fn paced_writer(
    pool: impl Into<ServicePool>,
    shape: Shape,
    aggregates: usize,
    per_second: u64,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<HashMap<String, Expected>> {
    let pool: ServicePool = pool.into();
    let writers = PACED_WRITERS
        .min(aggregates)
        .min(usize::try_from(per_second).unwrap_or(usize::MAX))
        .max(1);
    let each_per_second = (per_second / writers as u64).max(1);
    let tasks: Vec<_> = (0..writers)
        .map(|writer| {
            let (pool, stop) = (pool.clone(), stop.clone());
            tokio::spawn(async move {
                let mut expected = HashMap::new();
                let mut dice = Dice::new(0x5eed + writer as u64);
                let mut next_seq = HashMap::new();
                let mut tick =
                    tokio::time::interval(std::time::Duration::from_millis(1000 / each_per_second));
                while !stop.is_cancelled() {
                    tick.tick().await;
                    let plan = plan(&mut dice, shape, aggregates, writer, writers);
                    let written = loop {
                        let mut seqs = next_seq.clone();
                        match pool.write(&plan, &mut seqs, shape.deleted).await {
                            Ok(written) => {
                                next_seq = seqs;
                                break written;
                            }
                            Err(error) => {
                                // Told, not hidden: a relay that makes
                                // services fail (a deadlock it causes)
                                // shows here.
                                eprintln!("a service transaction failed and runs again: {error}");
                                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                            }
                        }
                    };
                    expected.extend(written);
                }
                expected
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut expected = HashMap::new();
        for task in tasks {
            expected.extend(task.await.expect("a paced writer"));
        }
        expected
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_touches_several_owned_aggregates_with_one_to_three_events_each() {
        let mut dice = Dice::new(7);
        let shape = Shape::rows(Outbox::Switchyard).emitting(30);
        let mut several = 0;
        let mut emitted = 0;
        for _ in 0..200 {
            let plan = plan(&mut dice, shape, 40, 1, 4);
            assert!(!plan.is_empty());
            several += usize::from(plan.len() > 1);
            for (aggregate, count, outbox) in plan {
                assert_eq!(aggregate % 4, 1, "only this writer's aggregates");
                assert!((1..=3).contains(&count));
                emitted += usize::from(outbox == Outbox::Emitted);
            }
        }
        assert!(several > 100, "most transactions touch several aggregates");
        assert!(emitted > 0, "some aggregates are written by switchyard_emit");
    }
}
