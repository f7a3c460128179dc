//! `switchyard dlq ...`: listing, showing, replaying and purging dead
//! letters.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};

use super::ops::Database;
use super::terminal::{field, terminal_safe};
use crate::store::{DeadLetterFilter, OutboxEntry, OutboxStore};

/// Which dead letters: every given filter must match.
#[derive(Debug, Args)]
pub struct Filter {
    /// Only this row id (repeatable).
    #[arg(long = "id", value_name = "ID")]
    ids: Vec<i64>,
    /// Only this event type.
    #[arg(long)]
    event_type: Option<String>,
    /// Only this aggregate type.
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Only this aggregate id.
    #[arg(long)]
    aggregate_id: Option<String>,
    /// Only events created at or after this time: RFC 3339
    /// (2026-11-22T10:00:00Z) or a duration ago (90m, 2h, 1d).
    #[arg(long, value_name = "TIME")]
    since: Option<String>,
    /// Only events created before this time (same forms as --since).
    #[arg(long, value_name = "TIME")]
    until: Option<String>,
    /// Only rows whose last error contains this text (case-insensitive).
    #[arg(long, value_name = "TEXT")]
    error: Option<String>,
    /// Only rows with a delivery to this target that was not acknowledged.
    #[arg(long, value_name = "NAME")]
    target: Option<String>,
}

impl Filter {
    fn is_empty(&self) -> bool {
        self.ids.is_empty()
            && self.event_type.is_none()
            && self.aggregate_type.is_none()
            && self.aggregate_id.is_none()
            && self.since.is_none()
            && self.until.is_none()
            && self.error.is_none()
            && self.target.is_none()
    }

    fn resolve(&self) -> anyhow::Result<DeadLetterFilter> {
        Ok(DeadLetterFilter {
            ids: self.ids.clone(),
            event_type: self.event_type.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            created_since_ms: self
                .since
                .as_deref()
                .map(parse_time)
                .transpose()
                .context("--since")?,
            created_before_ms: self
                .until
                .as_deref()
                .map(parse_time)
                .transpose()
                .context("--until")?,
            error_contains: self.error.clone(),
            target: self.target.clone(),
        })
    }
}

/// RFC 3339, or a duration before now.
fn parse_time(text: &str) -> anyhow::Result<i64> {
    DeadLetterFilter::time_ms(text).map_err(anyhow::Error::msg)
}

/// `switchyard dlq ...`
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters, oldest first.
    List {
        /// Where the outbox is.
        #[command(flatten)]
        database: Database,
        /// Which dead letters.
        #[command(flatten)]
        filter: Filter,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One row in full: payload, headers, attempts, last error, per-target state.
    Show {
        /// Row id.
        id: i64,
        /// Where the outbox is.
        #[command(flatten)]
        database: Database,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Send dead letters back through the relay: they become pending again
    /// and the next claim routes them with the plugin version current then.
    /// Targets that already acknowledged an event do not get it again.
    Replay {
        /// Where the outbox is.
        #[command(flatten)]
        database: Database,
        /// Which dead letters.
        #[command(flatten)]
        filter: Filter,
        /// Replay every dead letter (required when no filter is given).
        #[arg(long)]
        all: bool,
        /// Return once the rows are pending instead of following them until
        /// they are published or dead again.
        #[arg(long)]
        no_wait: bool,
        /// How long to follow the replayed rows.
        #[arg(long, default_value_t = 300)]
        wait_seconds: u64,
    },
    /// Delete dead letters for good.
    Purge {
        /// Where the outbox is.
        #[command(flatten)]
        database: Database,
        /// Which dead letters.
        #[command(flatten)]
        filter: Filter,
        /// Purge every dead letter (required when no filter is given).
        #[arg(long)]
        all: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
}
/// `switchyard dlq ...`
///
/// # Errors
/// Database failures, bad filters, a refused confirmation.
pub async fn dlq(command: DlqCommand) -> anyhow::Result<ExitCode> {
    match command {
        DlqCommand::List {
            database,
            filter,
            limit,
            json,
        } => {
            let (store, _) = database.open().await?;
            let filter = filter.resolve()?;
            let rows = store.dead_letters(&filter, 0, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(ExitCode::SUCCESS);
            }
            let total = store.count_dead_letters(&filter).await?;
            print!("{}", terminal_safe(&render_list(&rows)));
            if total > rows.len() as i64 {
                println!(
                    "({} of {total} shown; raise --limit or narrow the filter)",
                    rows.len()
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        DlqCommand::Show { id, database, json } => {
            let (store, _) = database.open().await?;
            let entry = store
                .entry(id, true)
                .await?
                .with_context(|| format!("no outbox row with id {id}"))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&entry)?);
            } else {
                print!("{}", terminal_safe(&render_entry(&entry)));
            }
            Ok(ExitCode::SUCCESS)
        }
        DlqCommand::Replay {
            database,
            filter,
            all,
            no_wait,
            wait_seconds,
        } => {
            let (store, _) = database.open().await?;
            let filter = selection(&filter, all)?;
            replay(&store, &filter, !no_wait, Duration::from_secs(wait_seconds)).await
        }
        DlqCommand::Purge {
            database,
            filter,
            all,
            yes,
        } => {
            let (store, _) = database.open().await?;
            let filter = selection(&filter, all)?;
            purge(&store, &filter, yes).await
        }
    }
}

fn selection(filter: &Filter, all: bool) -> anyhow::Result<DeadLetterFilter> {
    anyhow::ensure!(
        all || !filter.is_empty(),
        "say which dead letters: --id, --event-type, --aggregate-type, --aggregate-id, --since, --until, --error, or --all"
    );
    anyhow::ensure!(!all || filter.is_empty(), "--all cannot be combined with filters");
    filter.resolve()
}

fn one_line(text: &str, width: usize) -> String {
    let flat: String = text.chars().map(|c| if c == '\n' { ' ' } else { c }).collect();
    if flat.chars().count() <= width {
        flat
    } else {
        let cut: String = flat.chars().take(width.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

fn render_list(rows: &[OutboxEntry]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if rows.is_empty() {
        out.push_str("no dead letters match\n");
        return out;
    }
    let _ = writeln!(
        out,
        "{:>8}  {:<24}  {:<20}  {:<24}  {:>8}  ERROR",
        "ID", "CREATED", "EVENT TYPE", "AGGREGATE", "ATTEMPTS"
    );
    for row in rows {
        let aggregate = format!("{}/{}", row.aggregate_type, row.aggregate_id);
        let _ = writeln!(
            out,
            "{:>8}  {:<24}  {:<20}  {:<24}  {:>8}  {}",
            row.id,
            row.created_at,
            one_line(&row.event_type, 20),
            one_line(&aggregate, 24),
            row.attempts,
            one_line(row.last_error.as_deref().unwrap_or(""), 100)
        );
    }
    out
}

fn render_entry(entry: &OutboxEntry) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "row {}  ({})", entry.id, entry.status);
    let _ = writeln!(out, "  event id        {}", field(&entry.event_id));
    let _ = writeln!(out, "  event type      {}", field(&entry.event_type));
    let _ = writeln!(
        out,
        "  aggregate       {}/{}",
        field(&entry.aggregate_type),
        field(&entry.aggregate_id)
    );
    if let Some(tenant) = &entry.tenant {
        let _ = writeln!(out, "  tenant          {}", field(tenant));
    }
    let _ = writeln!(out, "  created at      {}", entry.created_at);
    let _ = writeln!(out, "  attempts        {}", entry.attempts);
    let _ = writeln!(
        out,
        "  plugin version  {}",
        entry.plugin_version.as_deref().unwrap_or("-")
    );
    let _ = writeln!(
        out,
        "  last error      {}",
        entry.last_error.as_deref().unwrap_or("-")
    );
    let _ = writeln!(out, "  deliveries");
    if entry.deliveries.is_empty() {
        let _ = writeln!(out, "    (none yet)");
    }
    for delivery in entry.deliveries.values() {
        let state = match (&delivery.acked_at, &delivery.error) {
            (Some(at), _) => format!("acknowledged {at}"),
            (None, Some(error)) => format!("failed: {error}"),
            (None, None) => "not acknowledged".to_string(),
        };
        let _ = writeln!(
            out,
            "    {:<16} {:<28} {state}",
            field(&delivery.target),
            field(&delivery.topic)
        );
    }
    let _ = writeln!(out, "  headers         {}", entry.headers);
    match (&entry.payload, entry.payload_bytes_len) {
        (Some(payload), _) => {
            let pretty = serde_json::to_string_pretty(payload).unwrap_or_default();
            let _ = writeln!(out, "  payload\n{}", indent(&pretty, 4));
        }
        (None, Some(len)) => {
            let _ = writeln!(out, "  payload         {len} bytes (binary)");
        }
        (None, None) => {
            let _ = writeln!(out, "  payload         (none)");
        }
    }
    out
}

fn indent(text: &str, by: usize) -> String {
    let pad = " ".repeat(by);
    text.lines().map(|line| format!("{pad}{line}\n")).collect()
}

const REPLAY_BATCH: u32 = 500;

async fn replay(
    store: &OutboxStore,
    filter: &DeadLetterFilter,
    wait: bool,
    wait_for: Duration,
) -> anyhow::Result<ExitCode> {
    let total = store.count_dead_letters(filter).await?;
    if total == 0 {
        println!("No dead letters match; nothing replayed.");
        return Ok(ExitCode::SUCCESS);
    }
    // The cursor keeps a row that dies again during the replay from being
    // picked up a second time.
    let mut ids = Vec::new();
    let mut after = 0;
    loop {
        let batch = store.replay_dead_letters(filter, after, REPLAY_BATCH).await?;
        let Some(&last) = batch.last() else { break };
        after = last;
        ids.extend(batch);
        eprintln!("replay: {}/{total} back to pending", ids.len());
    }
    if ids.is_empty() {
        println!("No dead letters match any more; nothing replayed.");
        return Ok(ExitCode::SUCCESS);
    }
    if !wait {
        println!(
            "Replayed {} dead letter(s); they are pending and go through the current plugin version.",
            ids.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let started = Instant::now();
    let mut last_line = String::new();
    let counts = loop {
        let counts = store.status_counts(&ids).await?;
        let get = |status: &str| counts.get(status).copied().unwrap_or(0);
        let waiting = get("pending") + get("parked") + get("held") + get("in_flight");
        let line = format!(
            "replay: {} published, {} dead again, {waiting} waiting",
            get("published"),
            get("dead")
        );
        if line != last_line {
            eprintln!("{line}");
            last_line = line;
        }
        if waiting == 0 || started.elapsed() >= wait_for {
            break counts;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let get = |status: &str| counts.get(status).copied().unwrap_or(0);
    let (published, dead) = (get("published"), get("dead"));
    let waiting = get("pending") + get("parked") + get("held") + get("in_flight");
    let gone = ids.len() as i64 - published - dead - waiting;
    let mut summary = format!(
        "Replayed {} dead letter(s): {published} published, {dead} dead again",
        ids.len()
    );
    if waiting > 0 {
        summary.push_str(&format!(
            ", {waiting} still waiting after {} s (is a relay running?)",
            wait_for.as_secs()
        ));
    }
    if gone > 0 {
        summary.push_str(&format!(", {gone} no longer in the outbox"));
    }
    println!("{summary}.");
    if dead > 0 {
        println!("See them with `switchyard dlq list`.");
    }
    Ok(if dead > 0 || waiting > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

const PURGE_BATCH: u32 = 1000;

async fn purge(store: &OutboxStore, filter: &DeadLetterFilter, yes: bool) -> anyhow::Result<ExitCode> {
    let total = store.count_dead_letters(filter).await?;
    if total == 0 {
        println!("No dead letters match; nothing deleted.");
        return Ok(ExitCode::SUCCESS);
    }
    if !yes {
        anyhow::ensure!(
            std::io::stdin().is_terminal(),
            "refusing to delete {total} dead letter(s) without --yes (no terminal to ask on)"
        );
        print!("Delete {total} dead letter(s) for good? [y/N] ");
        std::io::stdout().flush()?;
        let mut answer = String::new();
        std::io::stdin().read_line(&mut answer)?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            println!("Nothing deleted.");
            return Ok(ExitCode::FAILURE);
        }
    }
    let mut deleted = 0;
    loop {
        let n = store.purge_dead_letters(filter, PURGE_BATCH).await?;
        deleted += n;
        if n > 0 {
            eprintln!("purge: {deleted}/{total} deleted");
        }
        if n < u64::from(PURGE_BATCH) {
            break;
        }
    }
    println!("Deleted {deleted} dead letter(s).");
    Ok(ExitCode::SUCCESS)
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_or_a_duration_ago() {
        assert_eq!(parse_time("2026-11-22T10:00:00Z").ok(), Some(1_795_341_600_000));
        let two_hours_ago = parse_time("2h").unwrap_or_default();
        let expected = chrono::Utc::now().timestamp_millis() - 7_200_000;
        assert!((two_hours_ago - expected).abs() < 5_000);
        let error = parse_time("yesterday-ish")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("neither an RFC 3339 time"), "{error}");
    }

    #[test]
    fn control_characters_reach_the_terminal_escaped() {
        let entry = OutboxEntry {
            aggregate_id: "evil\u{1b}[31mred\nrow 2  (published)".into(),
            last_error: Some("boom\u{1b}[2J\u{7}".into()),
            ..OutboxEntry::default()
        };
        for rendered in [render_list(std::slice::from_ref(&entry)), render_entry(&entry)] {
            let shown = terminal_safe(&rendered);
            assert!(!shown.chars().any(|c| c.is_control() && c != '\n'), "{shown:?}");
            assert!(shown.contains("evil\\u{1b}[31mred"), "{shown}");
            assert!(!shown.lines().any(|line| line.starts_with("row 2")), "{shown}");
            assert!(shown.contains("boom\\u{1b}[2J\\u{7}"), "{shown}");
        }
        assert_eq!(terminal_safe("plain\ntext"), "plain\ntext");
    }

    #[test]
    fn long_errors_are_cut_on_one_line() {
        assert_eq!(one_line("a\nb", 10), "a b");
        assert_eq!(one_line("abcdefghij", 5), "abcd…");
    }
}
