//! TLS for every client in the relay: one crypto provider (ring), checks of
//! certificate files that name what is wrong before a connection is tried,
//! and handshake failures told as what to do about them.

use std::path::Path;

use rustls::CertificateError;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::endpoint::Endpoint;

/// Installs ring as the process's rustls provider, once. Only ring is
/// compiled in, but a client that asks rustls for "the" provider panics
/// when a dependency's features ever bring a second one: every place that
/// builds a connection calls this first.
pub fn install_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// `[targets.NAME.tls]` for NATS and RabbitMQ: whom to trust and which
/// certificate to show.
#[derive(Clone, Debug, Default, serde::Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BrokerTlsConfig {
    /// CA certificates (PEM) that sign the server's, instead of the
    /// system's roots.
    #[serde(default)]
    pub root_cert: Option<std::path::PathBuf>,
    /// A client certificate (PEM), for mutual TLS (and RabbitMQ's EXTERNAL login).
    #[serde(default)]
    pub client_cert: Option<std::path::PathBuf>,
    /// Its private key (PEM).
    #[serde(default)]
    pub client_key: Option<std::path::PathBuf>,
    /// Refuse a server that does not offer TLS (implied by `tls://` and
    /// `amqps://` URLs).
    #[serde(default)]
    pub required: bool,
}

impl BrokerTlsConfig {
    /// What is wrong with the files, `key` naming the table.
    pub fn problems(&self, key: &str) -> Vec<String> {
        let client = match (&self.client_cert, &self.client_key) {
            (Some(cert), Some(private_key)) => Some((cert.as_path(), private_key.as_path())),
            (None, None) => None,
            _ => return vec![format!("{key}: set client_cert and client_key together")],
        };
        file_problems(key, self.root_cert.as_deref(), client)
    }

    /// Whether anything is set.
    pub fn is_set(&self) -> bool {
        *self != BrokerTlsConfig::default()
    }
}

/// What is wrong with a set of TLS files, `key` naming the setting in the
/// messages: a file that is missing or holds no PEM certificate or key, a
/// client certificate that is not valid now, or one that does not match
/// its key. Empty when all is well.
pub fn file_problems(key: &str, root_cert: Option<&Path>, client: Option<(&Path, &Path)>) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(path) = root_cert
        && let Err(problem) = certificates(path)
    {
        problems.push(format!("{key}: {problem}"));
    }
    if let Some((cert, private_key)) = client {
        let chain = certificates(cert).map_err(|problem| problems.push(format!("{key}: {problem}")));
        let secret = PrivateKeyDer::from_pem_file(private_key).map_err(|e| {
            problems.push(format!(
                "{key}: client key {} holds no PEM private key ({e})",
                private_key.display()
            ));
        });
        if let (Ok(chain), Ok(secret)) = (chain, secret) {
            if let Some(problem) = validity(&chain[0]) {
                problems.push(format!("{key}: client certificate {} {problem}", cert.display()));
            }
            if let Some(version) = old_version(&chain[0]) {
                problems.push(format!(
                    "{key}: client certificate {} is an X.509 v{version} certificate, which the relay's TLS library \
                     (rustls) does not take, although psql does: sign it again as v3, for example \
                     `openssl x509 -req -in client.csr -CA root.crt -CAkey root.key -out client.crt -days 365 \
                     -extfile <(echo basicConstraints=CA:FALSE)` (an -extfile makes it v3)",
                    cert.display()
                ));
            } else if let Err(error) = client_config(chain, secret) {
                problems.push(format!(
                    "{key}: client certificate {} does not go with key {}: {error}",
                    cert.display(),
                    private_key.display()
                ));
            }
        }
    }
    problems
}

/// The PEM certificates in `path`, or what is wrong with the file.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let text = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&text)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{} is not PEM: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no PEM certificate", path.display()));
    }
    Ok(certs)
}

/// The X.509 version (1 or 2) of a certificate older than v3, the only one
/// rustls's certificate parser takes. PostgreSQL's own recipe for client
/// certificates (`openssl x509 -req` without extensions) makes v1.
fn old_version(cert: &CertificateDer<'_>) -> Option<u32> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    let version = parsed.version().0 + 1;
    (version < 3).then_some(version)
}

/// Why a certificate is not valid now: expired, or not yet valid.
fn validity(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    let validity = parsed.validity();
    let now = x509_parser::time::ASN1Time::now();
    if now > validity.not_after {
        Some(format!("expired on {}", validity.not_after))
    } else if now < validity.not_before {
        Some(format!(
            "is not valid before {} (check the clock)",
            validity.not_before
        ))
    } else {
        None
    }
}

fn client_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<(), rustls::Error> {
    install_provider();
    rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(chain, key)
        .map(drop)
}

/// A PostgreSQL, MySQL or MariaDB connection's TLS or login failure, said with what to do;
/// `None` when `error` is neither.
pub fn pg_problem(endpoint: &Endpoint, error: &sqlx::Error) -> Option<String> {
    let host = host_of(endpoint.url());
    if let Some(certificate) = find::<rustls::Error>(error) {
        return Some(handshake_problem(certificate, &host, endpoint));
    }
    let text = error.to_string();
    if text.contains("server does not support TLS") {
        return Some(no_tls(&host, endpoint));
    }
    if let sqlx::Error::Database(db) = error {
        let message = db.message();
        if message.contains("no encryption") && message.contains("pg_hba.conf") {
            return Some(format!(
                "{message}: the server takes only TLS connections here; set sslmode=verify-full (or require) in the URL or [database.tls]"
            ));
        }
        // PostgreSQL's invalid_password; MySQL's access denied.
        if matches!(db.code().as_deref(), Some("28P01" | "28000")) && endpoint.password_source().is_some() {
            return Some(format!(
                "{message}: the password from its password source (file or command) was refused; it is read again every refresh_seconds"
            ));
        }
    }
    for key in [
        "sslrootcert",
        "sslcert",
        "sslkey",
        "ssl-ca",
        "ssl-cert",
        "ssl-key",
    ] {
        if let Some(path) = endpoint.parameter(key)
            && std::fs::metadata(&path).is_err()
        {
            return Some(format!("{key} {path} cannot be read: {text}"));
        }
    }
    None
}

/// The replication client's TLS failure (a string: its error keeps no
/// source), said as [`pg_problem`] says the pool's.
pub fn wire_problem(endpoint: &Endpoint, reason: &str) -> String {
    let host = host_of(endpoint.url());
    let certificate = if reason.contains("UnknownIssuer") || reason.contains("BadSignature") {
        Some(CertificateError::UnknownIssuer)
    } else if reason.contains("NotValidForName") || reason.contains("not valid for name") {
        Some(CertificateError::NotValidForName)
    } else if reason.contains("xpired") {
        Some(CertificateError::Expired)
    } else if reason.contains("NotValidYet") || reason.contains("not valid yet") {
        Some(CertificateError::NotValidYet)
    } else {
        None
    };
    match certificate {
        Some(certificate) => {
            handshake_problem(&rustls::Error::InvalidCertificate(certificate), &host, endpoint)
        }
        None if reason.contains("does not support TLS") => no_tls(&host, endpoint),
        None => format!("TLS to {host} failed: {reason}"),
    }
}

fn no_tls(host: &str, endpoint: &Endpoint) -> String {
    let mode = endpoint.parameter("sslmode").unwrap_or_else(|| "prefer".into());
    format!(
        "the server at {host} does not offer TLS, and sslmode={mode} requires it: turn ssl on at the server, or lower sslmode"
    )
}

fn handshake_problem(error: &rustls::Error, host: &str, endpoint: &Endpoint) -> String {
    let roots = endpoint.parameter("sslrootcert").map_or_else(
        || "the built-in Mozilla roots".to_string(),
        |path| format!("sslrootcert {path}"),
    );
    let rustls::Error::InvalidCertificate(certificate) = error else {
        return format!("TLS handshake with {host} failed: {error}");
    };
    match certificate {
        CertificateError::UnknownIssuer | CertificateError::BadSignature => format!(
            "the certificate of {host} is not signed by a CA in {roots}: set sslrootcert to the CA that signed it"
        ),
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => format!(
            "the certificate of the server does not name {host} ({certificate}): connect by a name it lists \
             (sslmode=verify-ca does not help: the database driver checks the name in that mode too)"
        ),
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            format!("the certificate of {host} has expired ({certificate}): the server must renew it")
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => format!(
            "the certificate of {host} is not valid yet ({certificate}): check the clocks of both machines"
        ),
        CertificateError::Other(other) if format!("{other:?}").contains("UnsupportedCertVersion") => format!(
            "the certificate of the server at {host} is an X.509 v1 certificate, which the relay's TLS library (rustls) \
             does not take: the server must present a v3 certificate (`openssl x509 -req` with an -extfile)"
        ),
        other => format!("the certificate of {host} was refused: {other}"),
    }
}

/// The first `E` in `error`'s source chain, looking inside I/O errors too
/// (where TLS streams put theirs).
fn find<'a, E: std::error::Error + 'static>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a E> {
    let mut next = Some(error);
    while let Some(current) = next {
        if let Some(found) = current.downcast_ref::<E>() {
            return Some(found);
        }
        if let Some(io) = current.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(found) = find::<E>(inner)
        {
            return Some(found);
        }
        if let Some(sqlx::Error::Tls(inner)) = current.downcast_ref::<sqlx::Error>()
            && let Some(found) = find::<E>(inner.as_ref())
        {
            return Some(found);
        }
        next = current.source();
    }
    None
}

/// `host:port` of a URL, for messages, whatever it holds.
fn host_of(url: &str) -> String {
    use std::str::FromStr;
    sqlx::postgres::PgConnectOptions::from_str(url).map_or_else(
        |_| "the database".to_string(),
        |options| format!("{}:{}", options.get_host(), options.get_port()),
    )
}
