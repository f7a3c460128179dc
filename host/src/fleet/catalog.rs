//! `[catalog]`: the databases a table lists, read on a timer, so that a
//! tenant's database is served from the moment its row appears and stops
//! being served when its row goes, without a restart.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use sqlx::Row;

use crate::config::{CatalogConfig, NamedDatabase, databases::name_problem};

/// How long one read of the catalog may take.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What one read found.
#[derive(Debug, Default)]
pub struct Listing {
    /// The rows that can be served, by name.
    pub databases: BTreeMap<String, NamedDatabase>,
    /// Rows left out, each with why (URLs never shown).
    pub refused: Vec<String>,
}

/// Runs the catalog query once.
///
/// # Errors
/// The catalog cannot be reached or the query fails (or takes over 10 s);
/// the message never shows the catalog's password.
pub async fn read(catalog: &CatalogConfig) -> anyhow::Result<Listing> {
    let rows = tokio::time::timeout(READ_TIMEOUT, query(catalog))
        .await
        .map_err(|_| anyhow::anyhow!("the catalog did not answer in {} s", READ_TIMEOUT.as_secs()))?
        .map_err(|e| anyhow::anyhow!(crate::redact::url(&format!("cannot read the catalog: {e}"))))?;
    let mut listing = Listing::default();
    let mut seen = BTreeSet::new();
    for (name, url) in rows {
        if let Some(problem) = name_problem(&name) {
            listing.refused.push(format!("catalog row {problem}"));
        } else if !seen.insert(name.clone()) {
            listing
                .refused
                .push(format!("catalog lists {name:?} twice; the first row is served"));
        } else {
            match listed(catalog, &name, url) {
                Ok(database) => {
                    listing.databases.insert(name, database);
                }
                Err(problem) => listing.refused.push(format!("catalog row {name:?}: {problem}")),
            }
        }
    }
    Ok(listing)
}

/// A catalog row as a database to serve, or why it is refused. A row is
/// data anyone with write access to the catalog table can set, so it cannot
/// turn the catalog's settings against it: the catalog's password goes
/// only to databases on the catalog's own server, a row cannot ask for
/// less TLS than the catalog's, and only a SQLite catalog may name SQLite
/// files (which `migrate = true` would create on the relay's machine).
fn listed(catalog: &CatalogConfig, name: &str, url: String) -> Result<NamedDatabase, String> {
    let postgres = ["postgres://", "postgresql://"]
        .iter()
        .any(|s| url.starts_with(s));
    let local_catalog = catalog.url.starts_with("sqlite:");
    if url.starts_with("sqlite:") {
        if !local_catalog {
            return Err(
                "a PostgreSQL catalog lists servers' databases, not sqlite: files on the relay's machine"
                    .to_string(),
            );
        }
    } else if !postgres {
        return Err("the URL must start with postgres:// (or sqlite: in a SQLite catalog)".to_string());
    }
    let password = if postgres && same_server(&catalog.url, &url) {
        catalog.password.clone()
    } else {
        None
    };
    if postgres {
        let required = catalog
            .endpoint()
            .parameter("sslmode")
            .is_some_and(|mode| !matches!(mode.as_str(), "disable" | "allow" | "prefer"));
        let row = crate::endpoint::Endpoint::new(&url, &catalog.tls, None).parameter("sslmode");
        if required
            && row
                .as_deref()
                .is_some_and(|mode| matches!(mode, "disable" | "allow" | "prefer"))
        {
            return Err(format!(
                "sslmode={} is weaker than the catalog's own; the row is not served",
                row.unwrap_or_default()
            ));
        }
    }
    Ok(NamedDatabase {
        name: name.to_string(),
        url,
        max_connections: catalog.max_connections,
        tls: catalog.tls.clone(),
        password,
    })
}

/// Whether two PostgreSQL URLs name the same server (host and port).
fn same_server(a: &str, b: &str) -> bool {
    let server = |url: &str| {
        let parsed = url::Url::parse(url).ok()?;
        Some((
            parsed.host_str()?.to_ascii_lowercase(),
            parsed.port().unwrap_or(5432),
        ))
    };
    matches!((server(a), server(b)), (Some(a), Some(b)) if a == b)
}

/// The query's `(name, url)` rows, from either kind of database.
async fn query(catalog: &CatalogConfig) -> Result<Vec<(String, String)>, sqlx::Error> {
    let pair = |row: &dyn Fn(usize) -> Result<String, sqlx::Error>| Ok::<_, sqlx::Error>((row(0)?, row(1)?));
    if catalog.url.starts_with("sqlite:") {
        use sqlx::ConnectOptions;
        let options: sqlx::sqlite::SqliteConnectOptions = catalog.url.parse()?;
        let mut connection = options.read_only(true).connect().await?;
        let rows = sqlx::query(&catalog.query).fetch_all(&mut connection).await?;
        rows.iter()
            .map(|row| pair(&|i| row.try_get::<String, _>(i)))
            .collect()
    } else {
        use sqlx::ConnectOptions;
        crate::tls::install_provider();
        let endpoint = catalog.endpoint();
        let options = endpoint
            .pg_options()
            .await
            .map_err(|e| sqlx::Error::Configuration(e.to_string().into()))?;
        let mut connection = options
            .application_name("switchyard catalog")
            .connect()
            .await
            .map_err(|e| {
                sqlx::Error::Configuration(crate::store::describe_connect_error(&endpoint, &e).into())
            })?;
        let rows = sqlx::query(&catalog.query).fetch_all(&mut connection).await?;
        rows.iter()
            .map(|row| pair(&|i| row.try_get::<String, _>(i)))
            .collect()
    }
}

/// Every database a config names: `[[databases]]`, then what the catalog
/// lists (a name under `[[databases]]` wins), or the one `[database]`. For
/// the commands that go through them all (`migrate`, `validate`).
///
/// # Errors
/// The catalog cannot be read.
pub async fn all_databases(config: &crate::Config) -> anyhow::Result<Vec<NamedDatabase>> {
    let mut all = config.database_list();
    if let Some(catalog) = &config.catalog {
        let listing = read(catalog).await?;
        for problem in listing.refused {
            eprintln!("warning: {problem}");
        }
        for (name, database) in listing.databases {
            if !all.iter().any(|fixed| fixed.name == name) {
                all.push(database);
            }
        }
    }
    Ok(all)
}

/// The database named `name`, among `[[databases]]` or else in the
/// catalog; see [`crate::Config::pick_database`].
///
/// # Errors
/// As `pick_database`, or the catalog cannot be read.
pub async fn pick(config: &crate::Config, name: Option<&str>) -> anyhow::Result<NamedDatabase> {
    match (name, &config.catalog) {
        (Some(name), Some(_)) if config.database_named(name).is_none() => all_databases(config)
            .await?
            .into_iter()
            .find(|database| database.name == name)
            .ok_or_else(|| anyhow::anyhow!("neither [[databases]] nor the catalog has a database {name:?}")),
        _ => config.pick_database(name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalog(url: &str, tls: &str) -> CatalogConfig {
        toml::from_str(&format!(
            "url = {url:?}\nquery = \"SELECT name, url FROM tenants\"\npassword = {{ file = \"/run/secrets/catalog\" }}\n{tls}"
        ))
        .unwrap()
    }

    #[test]
    fn a_row_cannot_turn_the_catalogs_password_or_tls_against_it() {
        let verified = catalog(
            "postgres://fleet@db.internal:5432/control",
            "tls = { mode = \"verify-full\" }",
        );
        // The catalog's server: the password goes with the row.
        let same = listed(&verified, "a", "postgres://fleet@DB.internal/tenant_a".into()).unwrap();
        assert!(same.password.is_some());
        // Another host, or another port: no password.
        for url in [
            "postgres://fleet@attacker.example/x",
            "postgres://fleet@db.internal:6543/x",
        ] {
            assert!(
                listed(&verified, "b", url.into()).unwrap().password.is_none(),
                "{url}"
            );
        }
        // Less TLS than the catalog's own is refused, however the row asks.
        for weaker in ["disable", "allow", "prefer"] {
            let url = format!("postgres://fleet@db.internal/x?sslmode={weaker}");
            let problem = listed(&verified, "c", url).unwrap_err();
            assert!(problem.contains("weaker than the catalog"), "{problem}");
        }
        assert!(
            listed(
                &verified,
                "d",
                "postgres://fleet@db.internal/x?sslmode=verify-ca".into()
            )
            .is_ok()
        );
        // A file on the relay's machine, named by a server's catalog.
        let problem = listed(&verified, "e", "sqlite:///var/lib/x.db".into()).unwrap_err();
        assert!(problem.contains("not sqlite: files"), "{problem}");
        let local = catalog("sqlite:///var/lib/switchyard/catalog.db", "");
        assert!(listed(&local, "f", "sqlite:///var/lib/switchyard/f.db".into()).is_ok());
        assert!(listed(&local, "g", "mysql://x/y".into()).is_err());
        // A catalog that asks for no TLS itself lets rows choose.
        let plain = catalog("postgres://fleet@127.0.0.1/control", "");
        assert!(listed(&plain, "h", "postgres://fleet@127.0.0.1/x?sslmode=disable".into()).is_ok());
    }
}
