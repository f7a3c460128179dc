//! Semantic checks on a parsed config, collecting every problem instead of
//! stopping at the first, so an operator fixes the file in one pass.

use std::collections::HashSet;

use super::Config;

/// Every problem found, each naming the offending key.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    fn check(&mut self, ok: bool, message: impl Into<String>) {
        if !ok {
            self.0.push(message.into());
        }
    }
}

/// Checks a parsed config.
///
/// # Errors
/// One message per problem, each naming the offending key.
pub fn validate(config: &Config) -> Result<(), Vec<String>> {
    let mut problems = Problems::default();
    database(&mut problems, config);
    if let Some(source) = &config.source {
        let mut found = Vec::new();
        for database in config.database_list() {
            for problem in super::source::static_problems(source, &database.url) {
                if !found.contains(&problem) {
                    found.push(problem);
                }
            }
        }
        problems.0.extend(found);
    }
    problems.0.extend(super::replication::static_problems(
        config.relay.mode,
        config.replication.as_ref(),
        &config.database.url,
    ));
    if let Some(retention) = &config.retention {
        self::retention(&mut problems, retention);
    }
    relay(&mut problems, config);
    plugins(&mut problems, config);
    targets(&mut problems, config);
    let listen = &config.admin.listen;
    problems.check(
        listen.is_empty() || listen.parse::<std::net::SocketAddr>().is_ok(),
        format!("admin.listen {listen:?} must be ip:port (e.g. 127.0.0.1:9187) or empty to turn it off"),
    );
    admin(&mut problems, &config.admin);
    if problems.0.is_empty() {
        Ok(())
    } else {
        Err(problems.0)
    }
}

fn admin(problems: &mut Problems, admin: &super::AdminConfig) {
    for (name, token) in &admin.tokens {
        if let Some(problem) = super::databases::name_problem(name) {
            problems.0.push(format!("admin.tokens: token {problem}"));
        }
        problems.0.extend(token.problems(&format!("admin.tokens.{name}")));
        if let crate::secret::SecretValue::Value(value) = token {
            // A token a person could guess is no lock.
            problems.check(
                value.chars().count() >= 16,
                format!("admin.tokens.{name} must be at least 16 characters"),
            );
        }
    }
    problems.check(
        admin.actions_per_minute >= 1,
        "admin.actions_per_minute must be at least 1".to_string(),
    );
    for field in &admin.mask_fields {
        problems.check(
            !field.is_empty() && field.split('.').all(|part| !part.is_empty()),
            format!("admin.mask_fields: {field:?} is not a dotted field path"),
        );
    }
}

fn database(problems: &mut Problems, config: &Config) {
    problems.0.extend(super::databases::list_problems(config));
    if config.serves_many() {
        for (index, database) in config.databases.iter().enumerate() {
            let key = format!("databases[{index}]");
            let env = format!("SWITCHYARD_DATABASE_{}_URL", super::env_name(&database.name));
            connection(problems, config, &key, &env, &database.settings());
        }
    } else {
        connection(
            problems,
            config,
            "database",
            "SWITCHYARD_DATABASE_URL",
            &config.database,
        );
    }
}

/// One database's URL and pool size; `key` names it in the messages.
fn connection(problems: &mut Problems, config: &Config, key: &str, env: &str, db: &super::DatabaseConfig) {
    problems.check(
        !db.url.is_empty(),
        format!("{key}.url is empty (set it or {env})"),
    );
    problems.check(
        db.url.is_empty()
            || db.url.starts_with("postgres://")
            || db.url.starts_with("postgresql://")
            || db.url.starts_with("mysql://")
            || db.url.starts_with("mariadb://")
            || db.url.starts_with("sqlite:"),
        format!(
            "{key}.url must start with postgres://, mysql://, mariadb:// or sqlite: (got {:?})",
            scheme(&db.url)
        ),
    );
    if let Err(problem) = check_database_url(key, &db.url) {
        problems.check(false, problem);
    }
    problems
        .0
        .extend(credential_problems(key, &db.endpoint(), db.password.as_ref()));
    problems.check(
        db.max_connections >= 2,
        format!("{key}.max_connections must be at least 2"),
    );
    problems.check(
        usize::try_from(db.max_connections).unwrap_or(usize::MAX)
            > usize::try_from(config.relay.concurrency).unwrap_or(usize::MAX),
        format!("{key}.max_connections must exceed relay.concurrency (one is kept for LISTEN)"),
    );
}

fn retention(problems: &mut Problems, retention: &super::RetentionConfig) {
    problems.check(
        retention.published_max_age_seconds >= 1,
        "retention.published_max_age_seconds must be at least 1",
    );
    problems.check(
        retention.interval_seconds >= 1,
        "retention.interval_seconds must be at least 1",
    );
    problems.check(
        (1..=100_000).contains(&retention.batch_size),
        "retention.batch_size must be between 1 and 100000",
    );
}

fn relay(problems: &mut Problems, config: &Config) {
    let relay = &config.relay;
    if let Some(id) = &relay.instance_id {
        // It goes into lease_owner and the connections' application_name:
        // PostgreSQL refuses a NUL in text, and a control character would
        // garble the status output and logs it appears in.
        problems.check(
            !id.trim().is_empty() && id.len() <= 128 && !id.chars().any(char::is_control),
            format!("relay.instance_id must be 1 to 128 bytes with no control characters (got {id:?})"),
        );
    }
    let at_least = [
        ("batch_size", u64::from(relay.batch_size), 1),
        ("concurrency", u64::from(relay.concurrency), 1),
        ("poll_interval_ms", relay.poll_interval_ms, 10),
        ("max_attempts", u64::from(relay.max_attempts), 1),
        ("initial_backoff_ms", relay.initial_backoff_ms, 1),
        ("publish_timeout_ms", relay.publish_timeout_ms, 1),
        ("max_payload_bytes", relay.max_payload_bytes as u64, 1),
        ("max_message_bytes", relay.max_message_bytes as u64, 1),
    ];
    for (key, value, least) in at_least {
        problems.check(value >= least, format!("relay.{key} must be at least {least}"));
    }
    if let Some(max) = relay.idle_poll_max_ms {
        problems.check(
            max >= relay.poll_interval_ms,
            format!(
                "relay.idle_poll_max_ms ({max}) must be at least relay.poll_interval_ms ({})",
                relay.poll_interval_ms
            ),
        );
    }
    problems.check(
        relay.batch_size <= 10_000,
        "relay.batch_size must be at most 10000",
    );
    problems.check(
        relay.max_backoff_ms >= relay.initial_backoff_ms,
        "relay.max_backoff_ms must not be below relay.initial_backoff_ms",
    );
    // A batch must be able to finish (plugin calls plus publish) well inside its
    // lease, or another instance could re-claim rows that are still being sent.
    problems.check(
        relay.lease_duration_ms >= 2 * relay.publish_timeout_ms + 1_000,
        format!(
            "relay.lease_duration_ms ({}) must be at least 2 * relay.publish_timeout_ms + 1000 ({})",
            relay.lease_duration_ms,
            2 * relay.publish_timeout_ms + 1_000
        ),
    );
}

fn plugins(problems: &mut Problems, config: &Config) {
    let relay = &config.relay;
    problems.check(
        !config.plugins.is_empty(),
        "no [[plugins]] configured: nothing would route events",
    );
    let mut plugin_names = HashSet::new();
    for (index, plugin) in config.plugins.iter().enumerate() {
        let at = format!("plugins[{index}] ({:?})", plugin.name);
        problems.check(!plugin.name.is_empty(), format!("{at}: name is empty"));
        problems.check(
            plugin_names.insert(&plugin.name),
            format!("{at}: duplicate plugin name"),
        );
        match plugin.oci_reference() {
            Some(reference) => {
                for problem in plugin.registry.problems(&at, reference) {
                    problems.check(false, problem);
                }
                problems.check(
                    config.plugin_runtime.cache_dir().is_some(),
                    format!(
                        "{at}: a plugin from a registry needs plugin_runtime.cache on and a cache_dir \
                         (or HOME): the relay starts from its last pulled digest when the registry is down"
                    ),
                );
            }
            None => {
                problems.check(
                    plugin.path.is_file(),
                    format!("{at}: path {} is not a file", plugin.path.display()),
                );
                problems.check(
                    plugin.registry == crate::config::RegistryConfig::default(),
                    format!("{at}: [plugins.registry] applies to an oci:// path only"),
                );
            }
        }
        problems.check(
            (1..=60_000).contains(&plugin.timeout_ms),
            format!("{at}: timeout_ms must be between 1 and 60000"),
        );
        // One slow call must not outlive the lease with the publish still to come.
        problems.check(
            plugin.timeout_ms + relay.publish_timeout_ms + 1_000 <= relay.lease_duration_ms,
            format!(
                "{at}: timeout_ms + relay.publish_timeout_ms + 1000 must not exceed relay.lease_duration_ms ({})",
                relay.lease_duration_ms
            ),
        );
        problems.check(
            plugin.max_memory_bytes >= 1024 * 1024,
            format!("{at}: max_memory_bytes must be at least 1 MiB"),
        );
    }
}

fn targets(problems: &mut Problems, config: &Config) {
    problems.check(
        !config.targets.is_empty(),
        "no [targets.*] configured: nothing to publish to",
    );
    for (name, target) in &config.targets {
        problems.check(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
            format!("targets.{name}: a target name may use letters, digits, '-' and '_' only"),
        );
        for problem in target.validate(&config.sink_settings()) {
            problems.check(false, format!("targets.{name}: {problem}"));
        }
    }
}

/// What is wrong with a database's TLS files and password source: files
/// that are missing or hold no certificate or key, a client certificate
/// that is expired or does not match its key, a password set twice.
pub(super) fn credential_problems(
    key: &str,
    endpoint: &crate::endpoint::Endpoint,
    password: Option<&crate::secret::SecretConfig>,
) -> Vec<String> {
    let mut problems = Vec::new();
    if endpoint.is_sqlite() {
        return problems;
    }
    // libpq's names, or the MySQL client's on a MySQL URL.
    let either = |a: &str, b: &str| endpoint.parameter(a).or_else(|| endpoint.parameter(b));
    let root = either("sslrootcert", "ssl-ca").map(std::path::PathBuf::from);
    let (cert, private_key) = (either("sslcert", "ssl-cert"), either("sslkey", "ssl-key"));
    let client = match (&cert, &private_key) {
        (Some(cert), Some(private_key)) => {
            Some((std::path::Path::new(cert), std::path::Path::new(private_key)))
        }
        (None, None) => None,
        _ => {
            problems.push(format!("{key}: a client certificate needs both sslcert and sslkey (tls.client_cert and tls.client_key)"));
            None
        }
    };
    problems.extend(crate::tls::file_problems(key, root.as_deref(), client));
    if let Some(password) = password {
        problems.extend(password.problems(&format!("{key}.password")));
        if endpoint.password_source().is_none() {
            problems.push(format!(
                "{key}: the URL has a password and {key}.password is set too; keep one"
            ));
        }
    }
    problems
}

/// Parses the URL as the driver will, so a malformed one (`host:notaport`,
/// a bad parameter) is reported with the others instead of at connect time.
fn check_database_url(key: &str, url: &str) -> Result<(), String> {
    use std::str::FromStr;
    let parsed = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        sqlx::postgres::PgConnectOptions::from_str(url).map(drop)
    } else if url.starts_with("sqlite:") {
        sqlx::sqlite::SqliteConnectOptions::from_str(url).map(drop)
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        crate::endpoint::Endpoint::from(url)
            .mysql_options_with(None)
            .map(drop)
            .map_err(|e| match e {
                crate::endpoint::EndpointError::Url(e) => e,
                other => sqlx::Error::Configuration(other.to_string().into()),
            })
    } else {
        return Ok(());
    };
    parsed.map_err(|e| {
        crate::redact::url(&format!(
            "{key}.url {:?} is not a valid URL: {e}",
            crate::redact::url(url)
        ))
    })
}

fn scheme(url: &str) -> &str {
    url.split_once("://").map_or(url, |(scheme, _)| scheme)
}
