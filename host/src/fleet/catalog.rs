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
        } else if !["postgres://", "postgresql://", "sqlite:"]
            .iter()
            .any(|scheme| url.starts_with(scheme))
        {
            listing.refused.push(format!(
                "catalog row {name:?}: the URL must start with postgres:// or sqlite:"
            ));
        } else {
            listing.databases.insert(
                name.clone(),
                NamedDatabase {
                    name,
                    url,
                    max_connections: catalog.max_connections,
                    tls: catalog.tls.clone(),
                    password: catalog.password.clone(),
                },
            );
        }
    }
    Ok(listing)
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
