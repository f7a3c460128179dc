//! Where a database is and how to log in: the one value every connection
//! to it is built from (the relay's pool, LISTEN, the replication session,
//! the ownership follower, the catalog, the CLI), so that none of them ends
//! up without TLS or with a password that has since rotated.
//!
//! TLS settings travel as libpq's URL parameters (`sslmode`, `sslrootcert`,
//! `sslcert`, `sslkey`); a `[database.tls]` table fills in those the URL
//! leaves out, so a parameter in the URL always wins (a catalog row's URL
//! over the fleet's defaults).

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use serde::Deserialize;
use sqlx::mysql::MySqlConnectOptions;
use sqlx::postgres::PgConnectOptions;

use crate::secret::{Secret, SecretConfig};

/// Why the options of a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The URL does not parse.
    #[error(transparent)]
    Url(#[from] sqlx::Error),
    /// The password's source cannot be read.
    #[error("cannot connect to {at}: {reason}")]
    Password {
        /// Which server and database.
        at: String,
        /// Why.
        reason: String,
    },
}

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    /// No TLS.
    Disable,
    /// TLS when the server offers it, unverified (libpq's default).
    Prefer,
    /// TLS or no connection; the certificate is not verified, unless a
    /// root certificate is set: then it is `verify-ca`, as in libpq.
    Require,
    /// TLS with the certificate signed by a trusted CA.
    VerifyCa,
    /// As `verify-ca`, and the certificate names the host connected to.
    VerifyFull,
}

impl SslMode {
    /// The URL parameter's value.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// `[database.tls]`, `[[databases]] tls`, `[catalog.tls]`: TLS to
/// PostgreSQL (or MySQL and MariaDB, in the same words), for what the URL
/// does not say itself.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PgTlsConfig {
    /// `disable`, `prefer` (the default), `require`, `verify-ca` or
    /// `verify-full` (what a managed database should get).
    #[serde(default)]
    pub mode: Option<SslMode>,
    /// The CA certificates (PEM) that sign the server's. Without it the
    /// Mozilla roots compiled into the relay are trusted.
    #[serde(default)]
    pub root_cert: Option<PathBuf>,
    /// A client certificate (PEM), for certificate login.
    #[serde(default)]
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[serde(default)]
    pub client_key: Option<PathBuf>,
}

impl PgTlsConfig {
    /// The settings as `(parameter, value)` pairs.
    fn parameters(&self) -> Vec<(&'static str, String)> {
        let path = |p: &PathBuf| p.display().to_string();
        [
            ("sslmode", self.mode.map(|m| m.as_str().to_string())),
            ("sslrootcert", self.root_cert.as_ref().map(path)),
            ("sslcert", self.client_cert.as_ref().map(path)),
            ("sslkey", self.client_key.as_ref().map(path)),
        ]
        .into_iter()
        .filter_map(|(key, value)| value.map(|v| (key, v)))
        .collect()
    }
}

/// A database to connect to: its URL with the TLS settings folded in, and
/// where its password comes from when the URL carries none.
#[derive(Clone)]
pub struct Endpoint {
    url: String,
    password: Option<Arc<SecretConfig>>,
}

impl Endpoint {
    /// `url` with `tls` filling in the parameters it lacks, and `password`
    /// read for each new connection unless the URL has a password of its own.
    pub fn new(url: &str, tls: &PgTlsConfig, password: Option<&SecretConfig>) -> Endpoint {
        if !is_postgres(url) && !is_mysql(url) {
            return Endpoint::from(url);
        }
        let Ok(mut parsed) = url::Url::parse(url) else {
            // Left as it is: the driver names what is wrong with it.
            return Endpoint::from(url);
        };
        let present: Vec<String> = parsed.query_pairs().map(|(key, _)| key.into_owned()).collect();
        let missing: Vec<_> = tls
            .parameters()
            .into_iter()
            .filter(|(key, _)| !present.iter().any(|p| p == key))
            .collect();
        if !missing.is_empty() {
            let mut query = parsed.query_pairs_mut();
            for (key, value) in &missing {
                query.append_pair(key, value);
            }
        }
        let password = password
            .filter(|_| parsed.password().is_none())
            .cloned()
            .map(Arc::new);
        Endpoint {
            url: parsed.to_string(),
            password,
        }
    }

    /// The URL, TLS parameters included; its password, if any, is shown
    /// only through [`crate::redact::url`].
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Where the password comes from, when not from the URL.
    pub fn password_source(&self) -> Option<&SecretConfig> {
        self.password.as_deref()
    }

    /// The options for a new PostgreSQL connection, with the password read
    /// now.
    ///
    /// # Errors
    /// The URL does not parse, or the password cannot be read.
    pub async fn pg_options(&self) -> Result<PgConnectOptions, EndpointError> {
        self.pg_options_with(self.password().await?.as_ref())
    }

    /// The options for a new PostgreSQL connection with `secret` (read
    /// from the source by the caller), or the URL's own password.
    ///
    /// # Errors
    /// The URL does not parse.
    pub fn pg_options_with(&self, secret: Option<&Secret>) -> Result<PgConnectOptions, EndpointError> {
        let mut options = PgConnectOptions::from_str(&self.url)?;
        // libpq: "if a root CA file exists, sslmode=require behaves as
        // verify-ca". The driver alone would verify nothing, so a CA named
        // for checking would be silently ignored.
        if matches!(options.get_ssl_mode(), sqlx::postgres::PgSslMode::Require)
            && self.parameter("sslrootcert").is_some()
        {
            options = options.ssl_mode(sqlx::postgres::PgSslMode::VerifyCa);
        }
        Ok(match secret {
            Some(secret) => options.password(secret.expose()),
            None => options,
        })
    }

    /// The options for a new MySQL or MariaDB connection with `secret` (read
    /// from the source by the caller), or the URL's own password. The TLS
    /// parameters are read in libpq's names and values, as for PostgreSQL
    /// (`sslmode=verify-full`, `sslrootcert`, `sslcert`, `sslkey`), or in
    /// the MySQL client's (`ssl-mode=VERIFY_IDENTITY`, `ssl-ca`, ...);
    /// `mariadb://` is taken for `mysql://`.
    ///
    /// # Errors
    /// The URL does not parse, or names an unknown `sslmode`.
    pub fn mysql_options_with(&self, secret: Option<&Secret>) -> Result<MySqlConnectOptions, EndpointError> {
        use sqlx::mysql::MySqlSslMode;
        let url = match self.url.strip_prefix("mariadb://") {
            Some(rest) => format!("mysql://{rest}"),
            None => self.url.clone(),
        };
        let mut parsed =
            url::Url::parse(&url).map_err(|e| EndpointError::Url(sqlx::Error::Configuration(e.into())))?;
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        let tls_keys = [
            "sslmode",
            "ssl-mode",
            "sslrootcert",
            "ssl-ca",
            "sslca",
            "sslcert",
            "ssl-cert",
            "sslkey",
            "ssl-key",
        ];
        parsed.set_query(None);
        {
            let mut query = parsed.query_pairs_mut();
            for (key, value) in pairs.iter().filter(|(key, _)| !tls_keys.contains(&key.as_str())) {
                query.append_pair(key, value);
            }
        }
        let text = parsed.to_string();
        let mut options = MySqlConnectOptions::from_str(text.trim_end_matches('?'))?;
        let get = |keys: &[&str]| {
            pairs
                .iter()
                .find(|(key, _)| keys.contains(&key.as_str()))
                .map(|(_, value)| value.clone())
        };
        let root = get(&["sslrootcert", "ssl-ca", "sslca"]);
        if let Some(mode) = get(&["sslmode", "ssl-mode"]) {
            let mode = match mode.to_ascii_lowercase().replace('_', "-").as_str() {
                "disable" | "disabled" => MySqlSslMode::Disabled,
                "prefer" | "preferred" | "allow" => MySqlSslMode::Preferred,
                // As libpq: with a root certificate, `require` verifies it.
                "require" | "required" if root.is_some() => MySqlSslMode::VerifyCa,
                "require" | "required" => MySqlSslMode::Required,
                "verify-ca" => MySqlSslMode::VerifyCa,
                "verify-full" | "verify-identity" => MySqlSslMode::VerifyIdentity,
                other => {
                    return Err(EndpointError::Url(sqlx::Error::Configuration(
                        format!(
                            "unknown sslmode {other:?}: use disable, prefer, require, verify-ca or verify-full"
                        )
                        .into(),
                    )));
                }
            };
            options = options.ssl_mode(mode);
        }
        if let Some(root) = root {
            options = options.ssl_ca(root);
        }
        if let Some(cert) = get(&["sslcert", "ssl-cert"]) {
            options = options.ssl_client_cert(cert);
        }
        if let Some(key) = get(&["sslkey", "ssl-key"]) {
            options = options.ssl_client_key(key);
        }
        Ok(match secret {
            Some(secret) => options.password(secret.expose()),
            None => options,
        })
    }

    /// The options for a MySQL or MariaDB binary log reader (a driver of
    /// its own: sqlx reads no binary log), with the same server, account,
    /// database and TLS as [`Endpoint::mysql_options_with`].
    ///
    /// # Errors
    /// As [`Endpoint::mysql_options_with`].
    #[cfg(feature = "binlog")]
    pub fn mysql_binlog_options_with(
        &self,
        secret: Option<&Secret>,
    ) -> Result<mysql_async::Opts, EndpointError> {
        use sqlx::mysql::MySqlSslMode;
        let sqlx_options = self.mysql_options_with(secret)?;
        let url = url::Url::parse(&self.url.replacen("mariadb://", "mysql://", 1))
            .map_err(|e| EndpointError::Url(sqlx::Error::Configuration(e.into())))?;
        let password = match secret {
            Some(secret) => Some(secret.expose().to_string()),
            None => url.password().map(|p| {
                percent_encoding::percent_decode_str(p)
                    .decode_utf8_lossy()
                    .into_owned()
            }),
        };
        let get = |keys: &[&str]| keys.iter().find_map(|key| self.parameter(key));
        let ssl = match sqlx_options.get_ssl_mode() {
            MySqlSslMode::Disabled | MySqlSslMode::Preferred => None,
            mode => {
                let mut ssl = mysql_async::SslOpts::default();
                if let Some(root) = get(&["sslrootcert", "ssl-ca", "sslca"]) {
                    ssl = ssl.with_root_certs(vec![PathBuf::from(root).into()]);
                }
                if let (Some(cert), Some(key)) = (get(&["sslcert", "ssl-cert"]), get(&["sslkey", "ssl-key"]))
                {
                    ssl = ssl.with_client_identity(Some(mysql_async::ClientIdentity::new(
                        PathBuf::from(cert).into(),
                        PathBuf::from(key).into(),
                    )));
                }
                Some(match mode {
                    MySqlSslMode::Required => ssl.with_danger_accept_invalid_certs(true),
                    MySqlSslMode::VerifyCa => ssl.with_danger_skip_domain_validation(true),
                    _ => ssl,
                })
            }
        };
        let builder = mysql_async::OptsBuilder::default()
            .ip_or_hostname(sqlx_options.get_host())
            .tcp_port(sqlx_options.get_port())
            .socket(sqlx_options.get_socket().map(|p| p.display().to_string()))
            .prefer_socket(false)
            .user(Some(sqlx_options.get_username()))
            .pass(password)
            .db_name(sqlx_options.get_database())
            .ssl_opts(ssl);
        Ok(builder.into())
    }

    /// The password from its source, read now (`None`: the URL's or none).
    ///
    /// # Errors
    /// The source cannot be read.
    pub async fn password(&self) -> Result<Option<Secret>, EndpointError> {
        match &self.password {
            Some(source) => Ok(Some(source.read().await.map_err(|e| {
                EndpointError::Password {
                    at: self.describe(),
                    reason: e.to_string(),
                }
            })?)),
            None => Ok(None),
        }
    }

    /// `PostgreSQL at host:port (database "name")`, for messages.
    pub fn describe(&self) -> String {
        if self.is_mysql() {
            return match self.mysql_options_with(None) {
                Ok(options) => format!(
                    "MySQL at {}:{} (database {:?})",
                    options.get_host(),
                    options.get_port(),
                    options.get_database().unwrap_or_default()
                ),
                Err(_) => crate::redact::url(&self.url),
            };
        }
        match PgConnectOptions::from_str(&self.url) {
            Ok(options) => format!(
                "PostgreSQL at {}:{} (database {:?})",
                options.get_host(),
                options.get_port(),
                options.get_database().unwrap_or(options.get_username())
            ),
            Err(_) => crate::redact::url(&self.url),
        }
    }

    /// Whether this is a MySQL or MariaDB database.
    pub fn is_mysql(&self) -> bool {
        is_mysql(&self.url)
    }

    /// Whether this is a SQLite database.
    pub fn is_sqlite(&self) -> bool {
        self.url.starts_with("sqlite:")
    }

    /// Whether a connection may silently go without TLS: a PostgreSQL
    /// server that is not on this machine, with `sslmode` `prefer` (libpq's
    /// default, so also when unset) or `allow`, which fall back to
    /// plaintext when the server offers no TLS.
    pub fn may_fall_back_to_plaintext(&self) -> bool {
        let Ok(url) = url::Url::parse(&self.url) else {
            return false;
        };
        if !is_postgres(&self.url) && !is_mysql(&self.url) {
            return false;
        }
        // `postgres://` is not a scheme the URL standard knows, so its host
        // comes as text, an address included.
        let local = match url.host() {
            None => true,
            Some(url::Host::Domain(name)) => {
                name.eq_ignore_ascii_case("localhost")
                    || name
                        .trim_start_matches('[')
                        .trim_end_matches(']')
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip.is_loopback())
            }
            Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
            Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        };
        // `?host=/var/run/postgresql`: a Unix socket.
        let socket = self.parameter("host").is_some_and(|h| h.starts_with('/'));
        let mode = self
            .parameter("sslmode")
            .or_else(|| self.parameter("ssl-mode"))
            .map(|m| m.to_ascii_lowercase());
        !local
            && !socket
            && mode
                .as_deref()
                .is_none_or(|m| matches!(m, "prefer" | "allow" | "preferred"))
    }

    /// The value of URL parameter `key`.
    pub fn parameter(&self, key: &str) -> Option<String> {
        url::Url::parse(&self.url)
            .ok()?
            .query_pairs()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.into_owned())
    }
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

fn is_mysql(url: &str) -> bool {
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

/// The password never shows.
impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("url", &crate::redact::url(&self.url))
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

impl From<&str> for Endpoint {
    fn from(url: &str) -> Endpoint {
        Endpoint {
            url: url.to_string(),
            password: None,
        }
    }
}

impl From<String> for Endpoint {
    fn from(url: String) -> Endpoint {
        Endpoint { url, password: None }
    }
}

impl From<&String> for Endpoint {
    fn from(url: &String) -> Endpoint {
        Endpoint::from(url.as_str())
    }
}

impl From<&Endpoint> for Endpoint {
    fn from(endpoint: &Endpoint) -> Endpoint {
        endpoint.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remote_server_without_a_required_sslmode_may_fall_back_to_plaintext() {
        let tls = PgTlsConfig::default();
        for url in [
            "postgres://u@db.example.com/app",
            "postgres://u@db.example.com/app?sslmode=prefer",
            "postgres://u@10.0.0.5/app?sslmode=allow",
        ] {
            assert!(
                Endpoint::new(url, &tls, None).may_fall_back_to_plaintext(),
                "{url}"
            );
        }
        for url in [
            "postgres://u@db.example.com/app?sslmode=require",
            "postgres://u@db.example.com/app?sslmode=verify-full",
            "postgres://u@db.example.com/app?sslmode=disable",
            "postgres://u@localhost/app",
            "postgres://u@127.0.0.1:5432/app",
            "postgres://u@[::1]/app",
            "postgres://u@x/app?host=/var/run/postgresql",
            "sqlite:///tmp/outbox.db",
        ] {
            assert!(
                !Endpoint::new(url, &tls, None).may_fall_back_to_plaintext(),
                "{url}"
            );
        }
        let verified = PgTlsConfig {
            mode: Some(SslMode::VerifyFull),
            ..PgTlsConfig::default()
        };
        assert!(
            !Endpoint::new("postgres://u@db.example.com/app", &verified, None).may_fall_back_to_plaintext()
        );
    }

    #[test]
    fn the_urls_own_parameters_win_over_the_tls_table() {
        let tls = PgTlsConfig {
            mode: Some(SslMode::VerifyFull),
            root_cert: Some("/etc/ca.pem".into()),
            client_cert: None,
            client_key: None,
        };
        let endpoint = Endpoint::new("postgres://u@db.example.com/app?sslmode=require", &tls, None);
        assert_eq!(endpoint.parameter("sslmode").as_deref(), Some("require"));
        assert_eq!(endpoint.parameter("sslrootcert").as_deref(), Some("/etc/ca.pem"));
        let plain = Endpoint::new("postgres://u@db.example.com/app", &tls, None);
        assert_eq!(plain.parameter("sslmode").as_deref(), Some("verify-full"));
    }

    #[test]
    fn a_password_in_the_url_wins_over_a_password_source() {
        let source = SecretConfig::from_file("/run/secrets/pw".into());
        let with = Endpoint::new("postgres://u:pw@h/db", &PgTlsConfig::default(), Some(&source));
        assert!(with.password_source().is_none());
        let without = Endpoint::new("postgres://u@h/db", &PgTlsConfig::default(), Some(&source));
        assert!(without.password_source().is_some());
        assert!(!format!("{with:?}").contains(":pw@"));
    }

    #[test]
    fn a_mysql_url_takes_libpqs_tls_names_and_the_tls_table() {
        use sqlx::mysql::MySqlSslMode;
        let tls = PgTlsConfig {
            mode: Some(SslMode::VerifyFull),
            root_cert: Some("/etc/ca.pem".into()),
            ..PgTlsConfig::default()
        };
        let endpoint = Endpoint::new("mariadb://u@db.example.com:3306/app", &tls, None);
        let options = endpoint.mysql_options_with(None).expect("options");
        assert!(matches!(options.get_ssl_mode(), MySqlSslMode::VerifyIdentity));
        assert_eq!(options.get_database(), Some("app"));
        assert_eq!(
            endpoint.describe(),
            "MySQL at db.example.com:3306 (database \"app\")"
        );
        assert!(!endpoint.may_fall_back_to_plaintext());
        let native = Endpoint::from("mysql://u@db/app?ssl-mode=REQUIRED");
        assert!(matches!(
            native.mysql_options_with(None).expect("options").get_ssl_mode(),
            MySqlSslMode::Required
        ));
        assert!(Endpoint::from("mysql://u@db.example.com/app").may_fall_back_to_plaintext());
        let wrong = Endpoint::from("mysql://u@db/app?sslmode=sometimes");
        let error = wrong.mysql_options_with(None).expect_err("refused").to_string();
        assert!(error.contains("unknown sslmode \"sometimes\""), "{error}");
    }

    #[test]
    fn sqlite_urls_are_left_alone() {
        let tls = PgTlsConfig {
            mode: Some(SslMode::Require),
            ..PgTlsConfig::default()
        };
        assert_eq!(
            Endpoint::new("sqlite:demo.db", &tls, None).url(),
            "sqlite:demo.db"
        );
    }
}
