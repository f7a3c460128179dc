//! Connecting to MySQL or MariaDB: the pool, and the settings each session
//! gets once (UTC, READ COMMITTED, the statement bound), which differ in
//! name between the two servers.

use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{ConnectOptions, Connection, Executor, MySqlConnection, MySqlPool};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::endpoint::Endpoint;
use crate::store::Error;

/// Bound on connecting to the database.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Which server answered: the two name their statement bound differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flavor {
    MariaDb,
    MySql,
}

/// The statement that sets a new session up:
/// - READ COMMITTED: a claim's `FOR UPDATE SKIP LOCKED` then locks the rows
///   it takes and nothing else. Under REPEATABLE READ (InnoDB's default) it
///   would also lock the gaps between index entries, and a service's INSERT
///   into the outbox would wait for the relay's claim.
/// - On MariaDB, no CHECK constraints on the relay's own updates: MariaDB
///   checks every constraint of a row each time any column of it changes,
///   so one row that got past the writers' checks (written with
///   `check_constraint_checks = 0`, an import) would fail every claim that
///   reaches it, stopping the relay there. It is claimed and dead-lettered
///   saying what is wrong with it instead. The relay writes only its own
///   columns, with values it made. (MySQL cannot hold such a row.)
/// - The statement bound, when given: MariaDB's `max_statement_time`
///   bounds every statement; MySQL's `max_execution_time` bounds only
///   SELECTs, so there the lock wait bound is what stops an UPDATE waiting.
///
/// Times are read and written in UTC: sqlx sets `time_zone = '+00:00'` on
/// each session (the relay's DATETIME columns hold UTC; TIMESTAMP columns
/// are converted by the server).
fn session_settings(flavor: Flavor, statement_timeout: Option<Duration>) -> String {
    let mut settings = vec!["SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED".to_string()];
    if flavor == Flavor::MariaDb {
        settings.push("SESSION check_constraint_checks = 0".to_string());
    }
    if let Some(timeout) = statement_timeout {
        let lock_wait = timeout.as_secs().max(1);
        settings.push(format!("SESSION innodb_lock_wait_timeout = {lock_wait}"));
        settings.push(match flavor {
            Flavor::MariaDb => format!("SESSION max_statement_time = {:.3}", timeout.as_secs_f64()),
            Flavor::MySql => format!("SESSION max_execution_time = {}", timeout.as_millis().max(1)),
        });
    }
    // `SET TRANSACTION ...` must be a statement of its own.
    let mut statements = vec![format!("SET {}", settings.remove(0))];
    if !settings.is_empty() {
        statements.push(format!("SET {}", settings.join(", ")));
    }
    statements.join("; ")
}

/// A pool whose sessions carry [`session_settings`]. The server is asked
/// once first, alone, so that an unreachable server or a refused login is
/// reported as such (a pool says only "pool timed out"); the returned guard
/// stops the password's renewal when the store goes.
pub(super) async fn pool(
    endpoint: &Endpoint,
    max_connections: u32,
    statement_timeout: Option<Duration>,
) -> Result<(MySqlPool, Flavor, Option<DropGuard>), Error> {
    crate::tls::install_provider();
    let secret = endpoint.password().await?;
    let options = endpoint
        .mysql_options_with(secret.as_ref())?
        .timezone(Some("+00:00".to_string()))
        .log_slow_statements(log::LevelFilter::Debug, Duration::from_secs(1));
    let connect_error = |reason: String| Error::Connect {
        at: endpoint.describe(),
        reason: crate::redact::url(&reason),
    };
    let mut probe = tokio::time::timeout(CONNECT_TIMEOUT, MySqlConnection::connect_with(&options))
        .await
        .map_err(|_| connect_error(format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())))?
        .map_err(|e| connect_error(describe_connect_error(endpoint, &e)))?;
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(&mut probe)
        .await?;
    let _ = probe.close().await;
    let flavor = if version.contains("MariaDB") {
        Flavor::MariaDb
    } else {
        Flavor::MySql
    };
    let settings = session_settings(flavor, statement_timeout);
    let pool = MySqlPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(CONNECT_TIMEOUT)
        .after_connect(move |conn, _| {
            let settings = settings.clone();
            Box::pin(async move { conn.execute(settings.as_str()).await.map(drop) })
        })
        .connect_lazy_with(options);
    let renewal = endpoint.password_source().map(|source| {
        let stop = CancellationToken::new();
        tokio::spawn(crate::store::password::renew(
            pool.clone(),
            endpoint.clone(),
            source.refresh(),
            stop.clone(),
            secret,
            |options: &MySqlConnectOptions, password| options.clone().password(password),
        ));
        stop.drop_guard()
    });
    Ok((pool, flavor, renewal))
}

/// The driver's error without its generic prefix, and for a TLS failure
/// what to do about it, in the words used for PostgreSQL.
fn describe_connect_error(endpoint: &Endpoint, error: &sqlx::Error) -> String {
    crate::store::postgres::describe_connect_error(endpoint, error)
}

#[cfg(test)]
mod tests {
    use super::{Flavor, session_settings};
    use std::time::Duration;

    #[test]
    fn each_server_gets_its_own_statement_bound() {
        let maria = session_settings(Flavor::MariaDb, Some(Duration::from_millis(15_000)));
        assert!(maria.contains("max_statement_time = 15.000"), "{maria}");
        let mysql = session_settings(Flavor::MySql, Some(Duration::from_millis(15_000)));
        assert!(mysql.contains("max_execution_time = 15000"), "{mysql}");
        assert!(mysql.starts_with("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED; SET "));
        assert!(maria.contains("check_constraint_checks = 0"), "{maria}");
        let unbounded = session_settings(Flavor::MySql, None);
        assert_eq!(
            unbounded,
            "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"
        );
    }
}
