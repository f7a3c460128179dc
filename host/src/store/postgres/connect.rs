//! Connecting to PostgreSQL: the pool, its pings, and the settings each
//! session gets once so that the relay's statements need no transaction of
//! their own to carry them.

use std::sync::LazyLock;
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::endpoint::Endpoint;
use crate::store::Error;

/// Bound on connecting to the database.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A pooled connection idle for this long is pinged before it is used.
pub(super) const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// How long that ping may go unanswered before the session is closed and
/// another one used: a session that stalled (a link dropping packets)
/// would otherwise hold the caller for the pool's whole acquire timeout,
/// and the next stalled one again.
const PING_WITHIN: Duration = Duration::from_secs(2);

/// Whether `conn` answered a ping within [`PING_WITHIN`]: the check before
/// a session idle for [`PING_IF_IDLE_FOR`] is used again, pooled or kept.
pub(super) async fn pinged(conn: &mut PgConnection) -> bool {
    tokio::time::timeout(PING_WITHIN, conn.ping())
        .await
        .is_ok_and(|pinged| pinged.is_ok())
}

/// The planner settings, each off, that leave the claim and the ack one
/// way to run: index probes in nested loops. Statistics taken while the
/// outbox was drained must not send them into a scan of a backlog.
/// `switchyard_ack()` carries the same list in its `SET` clauses
/// (migrations 20261202000000 and 20261203000000).
const INDEX_PROBES_ONLY: [&str; 4] = [
    "enable_seqscan",
    "enable_bitmapscan",
    "enable_hashjoin",
    "enable_mergejoin",
];

/// [`INDEX_PROBES_ONLY`] as `SET LOCAL`s in a `BEGIN`, each `= off` or
/// `TO DEFAULT` (`value`).
pub(super) fn set_local_planner(value: &str) -> String {
    INDEX_PROBES_ONLY
        .iter()
        .map(|name| format!(" SET LOCAL {name} {value};"))
        .collect()
}

/// Set on every session, once, when it connects:
/// - READ COMMITTED: the statements are written for it (a row another
///   claim just changed is re-checked or skipped); a stricter default on
///   the database or role (a DBA's choice) fails them with serialization
///   errors.
/// - [`INDEX_PROBES_ONLY`]: set here, a claim is one statement, one round
///   trip, where its BEGIN, settings and COMMIT were three (at service
///   rates each event is its own claim).
///
/// - No JIT: with every scan priced at ten billion, a statement that has
///   to scan (a handful of rows in `switchyard_relays`, say) passes every
///   JIT threshold and was compiled, inlined and optimised on each run:
///   50 ms to seconds of CPU for a statement of a tenth of a millisecond.
///   No statement of the relay runs long enough to repay compiling it.
/// - `synchronous_commit` off: a claim's or an ack's commit does not wait
///   for its WAL to reach disk. Only a server crash in the next moments
///   (`wal_writer_delay`) can lose one, and the WAL is lost from some point
///   on, never in the middle: a lost claim leaves its rows to be claimed
///   again, a lost ack leaves them to be published again, in order - a
///   duplicate, as after any replay, never a lost event (the writer's
///   commit is the service's, with its own setting). A commit that waits
///   for its flush cost the server more than the claim's statement at
///   service rates.
///
/// `$1` is the statement timeout in ms, NULL to keep the server's.
///
/// A write that something outside this database relies on once it
/// returns runs in a transaction begun by [`begin_durable`] instead.
static SESSION_SETTINGS: LazyLock<String> = LazyLock::new(|| {
    let planner: String = INDEX_PROBES_ONLY
        .iter()
        .map(|name| format!(", set_config('{name}', 'off', false)"))
        .collect();
    format!(
        "SELECT set_config('default_transaction_isolation', 'read committed', false){planner},
                set_config('jit', 'off', false),
                set_config('synchronous_commit', 'off', false),
                set_config('statement_timeout', COALESCE($1, current_setting('statement_timeout')), false)"
    )
});

/// A transaction whose commit waits for its WAL to reach disk, as the
/// server's own setting says (`local` where that is `off`): for a write that
/// something outside this database relies on as soon as it returns. A
/// hand-over in replication mode is one: the slot is moved past the events
/// it took, and a crash that lost it would lose them.
pub(crate) async fn begin_durable(
    pool: &PgPool,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "SELECT set_config('synchronous_commit', CASE WHEN reset_val = 'off' THEN 'local' ELSE reset_val END, true)
           FROM pg_settings WHERE name = 'synchronous_commit'",
    )
    .execute(&mut *tx)
    .await?;
    Ok(tx)
}

/// A pool whose sessions carry [`SESSION_SETTINGS`], and each statement
/// its `statement_timeout` when given. The server is asked once first,
/// alone: a pool reports an unreachable server or a missing database only
/// as "pool timed out". With a password source, the pool's options are
/// renewed while it lives (see [`crate::store::password::renew`]); the returned guard
/// stops that when the store goes.
pub(super) async fn pool(
    endpoint: &Endpoint,
    sessions: &super::SessionOptions<'_>,
) -> Result<(PgPool, Option<DropGuard>), Error> {
    crate::tls::install_provider();
    // The relay logs slow claims itself, in one line; sqlx would add the
    // whole statement text at WARN each time.
    // Read once here, and handed to the renewal as the password in use.
    let secret = endpoint.password().await?;
    let mut options = endpoint
        .pg_options_with(secret.as_ref())?
        .log_slow_statements(log::LevelFilter::Debug, Duration::from_secs(1));
    if options.get_application_name().is_none() {
        options = options.application_name(sessions.application_name);
    }
    let connect_error = |reason: String| Error::Connect {
        at: endpoint.describe(),
        reason: crate::redact::url(&reason),
    };
    let probe = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
        .await
        .map_err(|_| connect_error(format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())))?
        .map_err(|e| connect_error(describe_connect_error(endpoint, &e)))?;
    let _ = probe.close().await;
    let timeout_ms = sessions
        .statement_timeout
        .map(|timeout| timeout.as_millis().max(1).to_string());
    let ping_idle = sessions.ping_idle;
    let pool = PgPoolOptions::new()
        .max_connections(sessions.max_connections)
        .acquire_timeout(CONNECT_TIMEOUT)
        // sqlx pings every connection it hands out, a round trip as dear
        // as a claim's statement on the server. One back in the pool for
        // under a second was pinged when it came back.
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            Box::pin(async move { Ok(!ping_idle || meta.idle_for < PING_IF_IDLE_FOR || pinged(conn).await) })
        })
        .after_connect(move |conn, _| {
            let timeout_ms = timeout_ms.clone();
            Box::pin(async move {
                sqlx::query(SESSION_SETTINGS.as_str())
                    .bind(timeout_ms)
                    .execute(conn)
                    .await
                    .map(drop)
            })
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
            |options, password| options.clone().password(password),
        ));
        stop.drop_guard()
    });
    Ok((pool, renewal))
}

/// The driver's error without its generic prefix, and for a TLS failure
/// what to do about it.
pub(crate) fn describe_connect_error(endpoint: &Endpoint, error: &sqlx::Error) -> String {
    if let Some(problem) = crate::tls::pg_problem(endpoint, error) {
        return problem;
    }
    match error {
        sqlx::Error::Database(e) => e.message().to_string(),
        sqlx::Error::Io(e) => e.to_string(),
        other => other.to_string(),
    }
}
