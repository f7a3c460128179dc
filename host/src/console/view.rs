//! What the console's pages show, gathered from the fleet: each database's
//! figures (bounded counts through indexes, cached a few seconds so a
//! fleet of a hundred is not asked a hundred times a second), each
//! target's state, the plugins, the replication slot.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::admin::{Check, PausedTarget, PluginStatus, Reason};
use crate::fleet::{DatabaseState, Fleet};
use crate::relay::Relay;
use crate::store::DeadLetterFilter;

/// The overview's counts stop here ("100,000 or more"): each reads at
/// most this many index entries, whatever the outbox holds.
pub const COUNT_BOUND: i64 = 100_000;

/// The dead-letter list's count of matching rows stops here: a filter on a
/// target or an error text reads each dead letter until it counts this many.
pub const MATCHING_BOUND: i64 = 1_000;

/// Bound on each query a page runs: a database that does not answer makes
/// its part of the page say so, not the page hang.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(3);

/// A database's figures are read again after this long.
const FIGURES_FRESH_FOR: Duration = Duration::from_secs(2);

/// Databases read at once for the fleet's list.
const READS_AT_ONCE: usize = 16;

/// One database's figures from its outbox.
#[derive(Debug, Clone, PartialEq)]
pub struct Figures {
    /// Rows waiting to be published, up to about [`COUNT_BOUND`] per queue.
    pub backlog: i64,
    /// Age of the oldest waiting row, seconds.
    pub oldest_seconds: Option<f64>,
    /// Dead letters, up to [`COUNT_BOUND`].
    pub dead: i64,
}

/// How a database is served, as the console shows it.
#[derive(Clone)]
pub enum Served {
    /// This process serves it.
    Here(Relay),
    /// Another relay does.
    Elsewhere(Option<String>),
    /// Not yet: why, since when.
    Starting {
        /// Seconds since the first try.
        seconds: u64,
        /// Tries so far.
        attempts: u32,
        /// The last failure.
        last_error: Option<String>,
    },
}

impl From<DatabaseState> for Served {
    fn from(state: DatabaseState) -> Served {
        match state {
            DatabaseState::Running(relay) => Served::Here(relay),
            DatabaseState::Standby { owner } => Served::Elsewhere(owner),
            DatabaseState::Starting {
                since,
                attempts,
                last_error,
            } => Served::Starting {
                seconds: since.elapsed().as_secs(),
                attempts,
                last_error,
            },
        }
    }
}

/// A database's line in the overview.
#[derive(Clone)]
pub struct DatabaseLine {
    /// Its name.
    pub name: String,
    /// How it is served.
    pub served: Served,
    /// Its figures, or why they could not be read (`None` when it is not
    /// served here).
    pub figures: Option<Result<Figures, String>>,
}

/// A target's state across the databases.
#[derive(Debug, Clone)]
pub enum TargetState {
    /// Its health check passes and no database holds it paused.
    Up,
    /// Paused for the rows of these databases.
    Paused(BTreeMap<String, PausedTarget>),
    /// Its health check fails.
    Down(String),
}

/// A target's line in the overview.
#[derive(Debug, Clone)]
pub struct TargetLine {
    /// Its name.
    pub name: String,
    /// `nats`, `kafka`, ...
    pub kind: String,
    /// Its state.
    pub state: TargetState,
}

/// The replication slot of a database, as the overview shows it.
#[derive(Debug, Clone)]
pub struct SlotLine {
    /// The slot's name.
    pub slot: String,
    /// The session reading it (`switchyard <instance>`), if any.
    pub reader: Option<String>,
    /// WAL kept for it, bytes.
    pub retained_wal_bytes: Option<i64>,
    /// How far its reader confirmed.
    pub confirmed_flush_lsn: Option<String>,
    /// WAL written since, bytes.
    pub confirmed_lag_bytes: Option<i64>,
    /// This process reads it.
    pub reading_here: bool,
    /// `ok` or what is wrong.
    pub check: Check,
}

/// Figures read, by database, with when.
type Kept = HashMap<String, (Instant, Result<Figures, String>)>;

/// Reads database figures, keeping each for a moment.
#[derive(Default, Clone)]
pub struct FigureCache {
    kept: Arc<Mutex<Kept>>,
}

impl FigureCache {
    /// `relay`'s figures, read again when older than a moment.
    pub async fn figures(&self, name: &str, relay: &Relay) -> Result<Figures, String> {
        if let Some((at, figures)) = self.lock().get(name)
            && at.elapsed() < FIGURES_FRESH_FOR
        {
            return figures.clone();
        }
        let figures = read_figures(relay).await;
        self.lock()
            .insert(name.to_string(), (Instant::now(), figures.clone()));
        figures
    }

    /// Forgets the databases not in `present`.
    pub fn keep_only(&self, present: &BTreeMap<String, DatabaseState>) {
        self.lock().retain(|name, _| present.contains_key(name));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

async fn read_figures(relay: &Relay) -> Result<Figures, String> {
    let store = relay.store();
    let all = DeadLetterFilter::default();
    let read = async {
        let (backlog, oldest, dead) = futures::try_join!(
            store.backlog_to(COUNT_BOUND),
            store.oldest_pending_age(),
            store.count_dead_letters_to(&all, COUNT_BOUND),
        )?;
        Ok::<_, crate::store::Error>(Figures {
            backlog,
            oldest_seconds: oldest,
            dead,
        })
    };
    match tokio::time::timeout(QUERY_TIMEOUT, read).await {
        Ok(Ok(figures)) => Ok(figures),
        Ok(Err(error)) => Err(crate::redact::url(&error.to_string())),
        Err(_) => Err(format!("no answer within {} s", QUERY_TIMEOUT.as_secs())),
    }
}

/// Every database's line, a bounded number read at once.
pub async fn databases(fleet: &Fleet, cache: &FigureCache) -> Vec<DatabaseLine> {
    let all = fleet.databases();
    cache.keep_only(&all);
    futures::stream::iter(all)
        .map(|(name, state)| async move {
            let served = Served::from(state);
            let figures = match &served {
                Served::Here(relay) => Some(cache.figures(&name, relay).await),
                Served::Elsewhere(_) | Served::Starting { .. } => None,
            };
            DatabaseLine {
                name,
                served,
                figures,
            }
        })
        .buffered(READS_AT_ONCE)
        .collect()
        .await
}

/// The targets' latest health checks, run in the background: a broker that
/// hangs its check delays no page.
#[derive(Default, Clone)]
pub struct TargetChecks {
    latest: Arc<Mutex<Option<BTreeMap<String, Check>>>>,
    running: Arc<std::sync::atomic::AtomicBool>,
}

impl TargetChecks {
    /// Starts a round of checks unless one is still running.
    pub fn refresh(&self, fleet: &Fleet) {
        if self.running.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        let (this, fleet) = (self.clone(), fleet.clone());
        tokio::spawn(async move {
            let checks = crate::admin::target_checks(fleet.sinks()).await;
            *this
                .latest
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(checks);
            this.running.store(false, std::sync::atomic::Ordering::Release);
        });
    }

    fn latest(&self) -> Option<BTreeMap<String, Check>> {
        self.latest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Every target's state: the databases that hold it paused (from memory),
/// else its latest health check.
pub fn targets(fleet: &Fleet, checks: &TargetChecks) -> Vec<TargetLine> {
    let checks = checks.latest().unwrap_or_else(|| {
        fleet
            .sinks()
            .names()
            .map(|name| {
                (
                    name.to_string(),
                    Check::Failed(Reason::NotChecked, "not checked yet".into()),
                )
            })
            .collect()
    });
    let mut paused: BTreeMap<String, BTreeMap<String, PausedTarget>> = BTreeMap::new();
    for (database, state) in fleet.databases() {
        if let DatabaseState::Running(relay) = state {
            for (target, state) in relay.paused_targets() {
                let since: chrono::DateTime<chrono::Utc> = state.since.into();
                paused.entry(target).or_default().insert(
                    database.clone(),
                    PausedTarget {
                        since: since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                        seconds: state.since.elapsed().map_or(0, |d| d.as_secs()),
                        reason: state.reason,
                        waiting_rows: None,
                    },
                );
            }
        }
    }
    checks
        .into_iter()
        .map(|(name, check)| {
            let kind = fleet
                .sinks()
                .get(&name)
                .map_or("unknown", |s| s.kind())
                .to_string();
            let state = match (paused.remove(&name), check) {
                (Some(databases), _) => TargetState::Paused(databases),
                (None, Check::Ok) => TargetState::Up,
                (None, Check::Failed(_, why)) => TargetState::Down(why),
            };
            TargetLine { name, kind, state }
        })
        .collect()
}

/// The plugins' states.
pub fn plugins(fleet: &Fleet) -> Vec<PluginStatus> {
    crate::admin::plugin_statuses(fleet.plugins())
}

/// The database's replication slot, in replication mode.
pub async fn slot(relay: &Relay) -> Option<SlotLine> {
    let settings = relay.replication()?;
    let pg = relay.store().postgres()?;
    let reading_here = relay.metrics().replication_reading();
    let line = match tokio::time::timeout(QUERY_TIMEOUT, pg.slot_status(&settings.slot)).await {
        Ok(Ok(Some(status))) => SlotLine {
            slot: settings.slot.clone(),
            reader: status.reader,
            retained_wal_bytes: status.retained_wal_bytes,
            confirmed_flush_lsn: status.confirmed_flush_lsn,
            confirmed_lag_bytes: status.confirmed_lag_bytes,
            reading_here,
            check: if status.wal_status.as_deref() == Some("lost") {
                Check::Failed(Reason::SlotLost, "the slot lost the WAL it needed".into())
            } else {
                Check::Ok
            },
        },
        Ok(Ok(None)) => empty_slot(
            &settings.slot,
            reading_here,
            Reason::SlotMissing,
            "the slot does not exist".into(),
        ),
        Ok(Err(error)) => empty_slot(&settings.slot, reading_here, Reason::Database, error.to_string()),
        Err(_) => empty_slot(
            &settings.slot,
            reading_here,
            Reason::NoAnswer,
            "no answer in time".into(),
        ),
    };
    Some(line)
}

fn empty_slot(slot: &str, reading_here: bool, reason: Reason, why: String) -> SlotLine {
    SlotLine {
        slot: slot.to_string(),
        reader: None,
        retained_wal_bytes: None,
        confirmed_flush_lsn: None,
        confirmed_lag_bytes: None,
        reading_here,
        check: Check::Failed(reason, why),
    }
}
