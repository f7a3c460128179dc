//! What a MySQL or MariaDB server must offer the relay, checked at start
//! and by `validate`, each finding saying what to do.

use sqlx::Executor;

use super::{Flavor, MySql};
use crate::store::Error;

/// What a check of the server found: `problems` stop the relay (a claim or
/// an ack would fail), `warnings` do not (the writers' data is at risk).
#[derive(Debug, Default)]
pub struct ServerReport {
    /// Each stops the relay.
    pub problems: Vec<String>,
    /// Each is printed and logged.
    pub warnings: Vec<String>,
}

/// The columns the relay reads and writes.
const COLUMNS: &[&str] = &[
    "id",
    "event_id",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "payload",
    "payload_bytes",
    "headers",
    "tenant",
    "created_at",
    "not_before",
    "status",
    "attempts",
    "next_attempt_at",
    "lease_owner",
    "lease_id",
    "lease_expires_at",
    "published_at",
    "last_error",
    "deliveries",
    "plugin_version",
    "waiting_on",
    "aggregate_key",
];

/// `major.minor` of a `VERSION()` string.
fn major_minor(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// What is wrong with a server of `flavor` at `version`, with `sql_mode`,
/// binary log `log_bin` in `binlog_format`.
fn settings_report(
    flavor: Flavor,
    version: &str,
    sql_mode: &str,
    log_bin: bool,
    binlog_format: &str,
) -> ServerReport {
    let mut report = ServerReport::default();
    let (name, least) = match flavor {
        Flavor::MariaDb => ("MariaDB", (10, 6)),
        Flavor::MySql => ("MySQL", (8, 0)),
    };
    if major_minor(version).is_some_and(|found| found < least) {
        report.problems.push(format!(
            "{name} {version} has no FOR UPDATE SKIP LOCKED, which claims are made with: {name} {}.{} or later is needed",
            least.0, least.1
        ));
    }
    if log_bin && binlog_format.eq_ignore_ascii_case("STATEMENT") {
        report.problems.push(
            "the binary log is in STATEMENT format, which InnoDB refuses for the relay's READ COMMITTED transactions \
             (every claim would fail with error 1665): set binlog_format = ROW (MIXED works too)"
                .to_string(),
        );
    }
    let strict = sql_mode
        .split(',')
        .any(|mode| mode == "STRICT_TRANS_TABLES" || mode == "STRICT_ALL_TABLES");
    if !strict {
        report.warnings.push(format!(
            "the server's sql_mode ({sql_mode:?}) is not strict: a value too long for its column is cut short instead of \
             refused, so a writer's aggregate id could be shortened into another aggregate's; add STRICT_TRANS_TABLES"
        ));
    }
    report
}

impl MySql {
    /// Checks the server and the outbox table.
    ///
    /// # Errors
    /// The database's.
    pub(crate) async fn server_report(&self) -> Result<ServerReport, Error> {
        let (version, sql_mode, log_bin, binlog_format): (String, String, String, String) = sqlx::query_as(
            "SELECT VERSION(), CAST(@@global.sql_mode AS CHAR), CAST(@@global.log_bin AS CHAR),
                    CAST(@@global.binlog_format AS CHAR)",
        )
        .fetch_one(&self.pool)
        .await?;
        let log_bin = matches!(log_bin.as_str(), "1" | "ON");
        let mut report = settings_report(self.flavor, &version, &sql_mode, log_bin, &binlog_format);
        let engine: Option<String> = sqlx::query_scalar(
            "SELECT CAST(engine AS CHAR) FROM information_schema.tables
              WHERE table_schema = DATABASE() AND table_name = 'switchyard_outbox'",
        )
        .fetch_optional(&self.pool)
        .await?;
        let Some(engine) = engine else {
            return Ok(report);
        };
        if !engine.eq_ignore_ascii_case("InnoDB") {
            report.problems.push(format!(
                "switchyard_outbox is a {engine} table: claims need InnoDB's row locks and transactions \
                 (ALTER TABLE switchyard_outbox ENGINE = InnoDB)"
            ));
        }
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT CAST(column_name AS CHAR), CAST(data_type AS CHAR) FROM information_schema.columns
              WHERE table_schema = DATABASE() AND table_name = 'switchyard_outbox'",
        )
        .fetch_all(&self.pool)
        .await?;
        let missing: Vec<&str> = COLUMNS
            .iter()
            .copied()
            .filter(|wanted| !columns.iter().any(|(name, _)| name.eq_ignore_ascii_case(wanted)))
            .collect();
        if !missing.is_empty() {
            report.problems.push(format!(
                "switchyard_outbox has no column {}: it was not made by `switchyard migrate` \
                 (the book's MySQL page shows the table the relay reads)",
                missing.join(", ")
            ));
        }
        let created_at = columns
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case("created_at"))
            .map(|(_, kind)| kind.to_ascii_lowercase());
        if created_at.as_deref() == Some("datetime")
            && let Some(offset) = self.writers_offset_minutes().await?
            && offset != 0
        {
            report.warnings.push(format!(
                "created_at is DATETIME and the server's time zone is {offset:+} minutes from UTC: a writer's \
                 CURRENT_TIMESTAMP stores local time, which is read as UTC; make it TIMESTAMP(6) (as \
                 `switchyard migrate` does), or set the server's time_zone = '+00:00'"
            ));
        }
        Ok(report)
    }

    /// How far from UTC a writer's session runs by the server's default
    /// time zone, in minutes; `None` when the server cannot say.
    async fn writers_offset_minutes(&self) -> Result<Option<i64>, Error> {
        let mut conn = self.pool.acquire().await?;
        conn.execute("SET time_zone = @@global.time_zone").await?;
        let offset = sqlx::query_scalar("SELECT TIMESTAMPDIFF(MINUTE, UTC_TIMESTAMP(), NOW())")
            .fetch_one(&mut *conn)
            .await;
        // Back to the relay's setting before the session goes back to the pool.
        if conn.execute("SET time_zone = '+00:00'").await.is_err() {
            conn.close_on_drop();
        }
        Ok(offset?)
    }
}

#[cfg(test)]
mod tests {
    use super::{Flavor, settings_report};

    #[test]
    fn each_setting_that_stops_claims_or_endangers_writers_is_named() {
        let fine = settings_report(
            Flavor::MariaDb,
            "10.11.19-MariaDB-0+deb12u1-log",
            "STRICT_TRANS_TABLES,ERROR_FOR_DIVISION_BY_ZERO",
            true,
            "ROW",
        );
        assert!(fine.problems.is_empty() && fine.warnings.is_empty(), "{fine:?}");
        let old = settings_report(
            Flavor::MariaDb,
            "10.5.22-MariaDB",
            "STRICT_TRANS_TABLES",
            false,
            "ROW",
        );
        assert!(old.problems[0].contains("MariaDB 10.6 or later"), "{old:?}");
        let old = settings_report(Flavor::MySql, "5.7.44-log", "STRICT_TRANS_TABLES", false, "ROW");
        assert!(old.problems[0].contains("MySQL 8.0 or later"), "{old:?}");
        let statement = settings_report(Flavor::MySql, "8.0.36", "STRICT_ALL_TABLES", true, "STATEMENT");
        assert!(
            statement.problems[0].contains("binlog_format = ROW"),
            "{statement:?}"
        );
        let loose = settings_report(Flavor::MySql, "8.4.0", "NO_ENGINE_SUBSTITUTION", false, "ROW");
        assert!(loose.warnings[0].contains("STRICT_TRANS_TABLES"), "{loose:?}");
    }
}
