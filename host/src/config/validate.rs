//! Semantic checks on a parsed config, collecting every problem instead of
//! stopping at the first, so an operator fixes the file in one pass.

use std::collections::HashSet;

use super::{Config, TargetConfig};

/// Checks a parsed config.
///
/// # Errors
/// One message per problem, each naming the offending key.
pub fn validate(config: &Config) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    let mut check = |ok: bool, message: String| {
        if !ok {
            problems.push(message);
        }
    };

    let db = &config.database;
    check(
        !db.url.is_empty(),
        "database.url is empty (set it or SWITCHYARD_DATABASE_URL)".into(),
    );
    check(
        db.url.is_empty()
            || db.url.starts_with("postgres://")
            || db.url.starts_with("postgresql://")
            || db.url.starts_with("sqlite:"),
        format!(
            "database.url must start with postgres:// or sqlite: (got {:?})",
            scheme(&db.url)
        ),
    );
    if let Err(problem) = check_database_url(&db.url) {
        check(false, problem);
    }
    check(
        db.max_connections >= 2,
        "database.max_connections must be at least 2".into(),
    );

    if let Some(source) = &config.source {
        for problem in crate::source::static_problems(source, &db.url) {
            check(false, problem);
        }
    }

    if let Some(retention) = &config.retention {
        check(
            retention.published_max_age_seconds >= 1,
            "retention.published_max_age_seconds must be at least 1".into(),
        );
        check(
            retention.interval_seconds >= 1,
            "retention.interval_seconds must be at least 1".into(),
        );
        check(
            (1..=100_000).contains(&retention.batch_size),
            "retention.batch_size must be between 1 and 100000".into(),
        );
    }

    let relay = &config.relay;
    if let Some(id) = &relay.instance_id {
        // It goes into lease_owner and the connections' application_name:
        // PostgreSQL refuses a NUL in text, and a control character would
        // garble the status output and logs it appears in.
        check(
            !id.trim().is_empty() && id.len() <= 128 && !id.chars().any(char::is_control),
            format!("relay.instance_id must be 1 to 128 bytes with no control characters (got {id:?})"),
        );
    }
    check(
        relay.batch_size >= 1,
        "relay.batch_size must be at least 1".into(),
    );
    check(
        relay.batch_size <= 10_000,
        "relay.batch_size must be at most 10000".into(),
    );
    check(
        relay.concurrency >= 1,
        "relay.concurrency must be at least 1".into(),
    );
    check(
        relay.poll_interval_ms >= 10,
        "relay.poll_interval_ms must be at least 10".into(),
    );
    check(
        relay.max_attempts >= 1,
        "relay.max_attempts must be at least 1".into(),
    );
    check(
        relay.initial_backoff_ms >= 1,
        "relay.initial_backoff_ms must be at least 1".into(),
    );
    check(
        relay.max_backoff_ms >= relay.initial_backoff_ms,
        "relay.max_backoff_ms must not be below relay.initial_backoff_ms".into(),
    );
    check(
        relay.publish_timeout_ms >= 1,
        "relay.publish_timeout_ms must be at least 1".into(),
    );
    // A batch must be able to finish (plugin calls plus publish) well inside its
    // lease, or another instance could re-claim rows that are still being sent.
    check(
        relay.lease_duration_ms >= 2 * relay.publish_timeout_ms + 1_000,
        format!(
            "relay.lease_duration_ms ({}) must be at least 2 * relay.publish_timeout_ms + 1000 ({})",
            relay.lease_duration_ms,
            2 * relay.publish_timeout_ms + 1_000
        ),
    );
    check(
        usize::try_from(config.database.max_connections).unwrap_or(usize::MAX)
            > usize::try_from(relay.concurrency).unwrap_or(usize::MAX),
        "database.max_connections must exceed relay.concurrency (one is kept for LISTEN)".into(),
    );
    check(
        relay.max_payload_bytes >= 1,
        "relay.max_payload_bytes must be at least 1".into(),
    );
    check(
        relay.max_message_bytes >= 1,
        "relay.max_message_bytes must be at least 1".into(),
    );

    check(
        !config.plugins.is_empty(),
        "no [[plugins]] configured: nothing would route events".into(),
    );
    let mut plugin_names = HashSet::new();
    for (index, plugin) in config.plugins.iter().enumerate() {
        let at = format!("plugins[{index}] ({:?})", plugin.name);
        check(!plugin.name.is_empty(), format!("{at}: name is empty"));
        check(
            plugin_names.insert(&plugin.name),
            format!("{at}: duplicate plugin name"),
        );
        check(
            plugin.path.is_file(),
            format!("{at}: path {} is not a file", plugin.path.display()),
        );
        check(
            (1..=60_000).contains(&plugin.timeout_ms),
            format!("{at}: timeout_ms must be between 1 and 60000"),
        );
        // One slow call must not outlive the lease with the publish still to come.
        check(
            plugin.timeout_ms + relay.publish_timeout_ms + 1_000 <= relay.lease_duration_ms,
            format!(
                "{at}: timeout_ms + relay.publish_timeout_ms + 1000 must not exceed relay.lease_duration_ms ({})",
                relay.lease_duration_ms
            ),
        );
        check(
            plugin.max_memory_bytes >= 1024 * 1024,
            format!("{at}: max_memory_bytes must be at least 1 MiB"),
        );
    }

    check(
        !config.targets.is_empty(),
        "no [targets.*] configured: nothing to publish to".into(),
    );
    for (name, target) in &config.targets {
        check(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            format!("targets.{name}: a target name may use letters, digits, '-' and '_' only"),
        );
        match target {
            TargetConfig::Nats(nats) => {
                for problem in nats.validate() {
                    problems_push(&mut check, format!("targets.{name}: {problem}"));
                }
                let horizon = relay.retry_horizon();
                check(
                    nats.mode != crate::sinks::nats::NatsMode::Jetstream
                        || nats.duplicate_window() >= horizon,
                    format!(
                        "targets.{name}: duplicate_window_seconds ({}) is shorter than the relay's retry horizon \
                         ({} s: relay.max_attempts backoffs at their longest plus a lease each), so a retry could \
                         store an event twice; raise it (and the streams' duplicate window) or lower \
                         relay.max_attempts, relay.max_backoff_ms or relay.lease_duration_ms",
                        nats.duplicate_window_seconds,
                        horizon.as_secs()
                    ),
                );
            }
            TargetConfig::Kafka(kafka) => {
                for problem in kafka.validate() {
                    problems_push(&mut check, format!("targets.{name}: {problem}"));
                }
            }
            TargetConfig::Rabbitmq(rabbitmq) => {
                for problem in rabbitmq.validate() {
                    problems_push(&mut check, format!("targets.{name}: {problem}"));
                }
            }
            TargetConfig::Stdout(_) => {}
            TargetConfig::File(file) => check(
                !file.path.as_os_str().is_empty(),
                format!("targets.{name}: path is empty"),
            ),
        }
    }

    let listen = &config.admin.listen;
    check(
        listen.is_empty() || listen.parse::<std::net::SocketAddr>().is_ok(),
        format!("admin.listen {listen:?} must be ip:port (e.g. 127.0.0.1:9187) or empty to turn it off"),
    );

    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

fn problems_push(check: &mut impl FnMut(bool, String), message: String) {
    check(false, message);
}

/// Parses the URL as the driver will, so a malformed one (`host:notaport`,
/// a bad parameter) is reported with the others instead of at connect time.
fn check_database_url(url: &str) -> Result<(), String> {
    use std::str::FromStr;
    let parsed = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        sqlx::postgres::PgConnectOptions::from_str(url).map(drop)
    } else if url.starts_with("sqlite:") {
        sqlx::sqlite::SqliteConnectOptions::from_str(url).map(drop)
    } else {
        return Ok(());
    };
    parsed.map_err(|e| {
        crate::redact::url(&format!(
            "database.url {:?} is not a valid URL: {e}",
            crate::redact::url(url)
        ))
    })
}

fn scheme(url: &str) -> &str {
    url.split_once("://").map_or(url, |(scheme, _)| scheme)
}
