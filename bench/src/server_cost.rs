//! Where a run's PostgreSQL CPU goes: each server process's CPU put under
//! what it serves (the relay's sessions, the writers', the WAL sender,
//! the WAL writer, the checkpointer, autovacuum ...), and the run's
//! statements from `pg_stat_statements` (calls, execution time and WAL per
//! event), so that a change to the claim path is aimed at where the cost is.

use std::collections::{BTreeMap, HashMap};

use sqlx::{PgPool, Row};

/// The application name the bench's writers connect with.
pub(super) const WRITER_APP: &str = "bench writer";
/// The application name the peer relay's sessions carry (`PGAPPNAME`).
pub(super) const PEER_APP: &str = "bench peer";

/// Each server process's role, by process id, read while the run's
/// sessions are still open.
pub(super) async fn roles(admin: &PgPool) -> HashMap<i32, String> {
    let rows = sqlx::query(
        "SELECT pid, COALESCE(backend_type, ''), COALESCE(application_name, '') FROM pg_stat_activity",
    )
    .fetch_all(admin)
    .await
    .unwrap_or_default();
    rows.iter()
        .filter_map(|row| {
            let pid: i32 = row.try_get(0).ok()?;
            let kind: String = row.try_get(1).ok()?;
            let app: String = row.try_get(2).ok()?;
            Some((pid, role(&kind, &app)))
        })
        .collect()
}

fn role(backend_type: &str, application: &str) -> String {
    match backend_type {
        "client backend" if application.starts_with("switchyard") => "relay sessions".into(),
        "client backend" if application == WRITER_APP => "writers".into(),
        "client backend" if application == PEER_APP => "peer sessions".into(),
        "client backend" => "other sessions".into(),
        "walsender" => "WAL sender".into(),
        "autovacuum worker" | "autovacuum launcher" => "autovacuum".into(),
        other => other.to_string(),
    }
}

/// CPU seconds by role from per-process deltas; a process not in `roles`
/// (exited during the run, its time reaped into the postmaster's) is
/// "exited or postmaster".
pub(super) fn by_role(deltas: &HashMap<i32, f64>, roles: &HashMap<i32, String>) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (pid, seconds) in deltas {
        let role = roles
            .get(pid)
            .cloned()
            .unwrap_or_else(|| "exited or postmaster".into());
        *out.entry(role).or_insert(0.0) += seconds;
    }
    out
}

/// One statement's figures over a run.
#[derive(Debug, Clone)]
pub(super) struct Statement {
    pub(super) text: String,
    pub(super) calls: i64,
    pub(super) exec_ms: f64,
    /// Zero unless `pg_stat_statements.track_planning` is on.
    pub(super) plan_ms: f64,
    pub(super) wal_bytes: f64,
    pub(super) dirtied: i64,
}

/// Forgets what the statements on database `name` have cost so far, so
/// that [`statements`] reads a run without its warm-up.
pub(super) async fn reset_statements(admin: &PgPool, name: &str) {
    let _ = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(admin)
        .await;
    let _ =
        sqlx::query("SELECT pg_stat_statements_reset(0, d.oid, 0) FROM pg_database d WHERE d.datname = $1")
            .bind(name)
            .execute(admin)
            .await;
}

/// The statements run on database `name`, dearest first (empty when
/// `pg_stat_statements` is not loaded).
pub(super) async fn statements(admin: &PgPool, name: &str) -> Vec<Statement> {
    let _ = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(admin)
        .await;
    let rows = sqlx::query(
        "SELECT regexp_replace(left(s.query, 400), '\\s+', ' ', 'g'), s.calls, s.total_exec_time, s.total_plan_time,
                s.wal_bytes::float8, s.shared_blks_dirtied
           FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
          WHERE d.datname = $1
          ORDER BY s.total_exec_time + s.total_plan_time DESC LIMIT 5",
    )
    .bind(name)
    .fetch_all(admin)
    .await
    .unwrap_or_default();
    rows.iter()
        .filter_map(|row| {
            Some(Statement {
                text: row.try_get(0).ok()?,
                calls: row.try_get(1).ok()?,
                exec_ms: row.try_get(2).ok()?,
                plan_ms: row.try_get(3).ok()?,
                wal_bytes: row.try_get(4).ok()?,
                dirtied: row.try_get(5).ok()?,
            })
        })
        .collect()
}

/// A statement's first words, enough to tell the claim from the ack and
/// the writer's insert.
fn label(text: &str) -> String {
    let text = text.trim();
    if text.starts_with("WITH due AS") {
        return "claim".into();
    }
    if text.starts_with("SELECT switchyard_ack") {
        return "ack".into();
    }
    text.chars().take(48).collect()
}

/// Prints a run's CPU by role and its statements, per event.
pub(super) fn print(
    mode: &str,
    rate: u64,
    events: u64,
    roles: &BTreeMap<String, f64>,
    statements: &[Statement],
) {
    let per = |x: f64| x / events.max(1) as f64;
    let cpu: Vec<String> = roles
        .iter()
        .filter(|(_, s)| **s > 0.0)
        .map(|(role, seconds)| format!("{role} {:.3}", per(*seconds) * 1000.0))
        .collect();
    println!(
        "{mode} at {rate}/s, PG CPU ms per event by process: {}",
        cpu.join(", ")
    );
    for s in statements {
        println!(
            "    {:<48} {:>6.2} calls/ev {:>7.3} ms/ev run {:>7.3} planning {:>7.0} WAL B/ev {:>5.2} dirtied/ev",
            label(&s.text),
            per(s.calls as f64),
            per(s.exec_ms),
            per(s.plan_ms),
            per(s.wal_bytes),
            per(s.dirtied as f64)
        );
    }
}
