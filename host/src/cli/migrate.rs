//! `switchyard migrate`: the relay's schema, with `[source]` the capture
//! trigger on the services' table, and in replication mode the slot and
//! publication; `--dry-run` prints the SQL.

use anyhow::Context;

use crate::config::Config;
use crate::store::OutboxStore;
use crate::store::capture::Installed;

/// What `migrate` was asked to do.
pub struct Migrate {
    /// The config, when given (its database URL and `[source]`).
    pub config: Option<Config>,
    /// The database URL, when no config is given.
    pub database_url: Option<String>,
    /// Print, change nothing.
    pub dry_run: bool,
    /// Copy the rows already in the source table.
    pub backfill: bool,
}

/// Runs `switchyard migrate` on each database the config lists (or the
/// one named), one after the other; a database that fails does not stop
/// the others.
///
/// # Errors
/// Which databases failed, after trying them all.
pub async fn run_each(args: Migrate, database: Option<&str>) -> anyhow::Result<()> {
    let Some(config) = args.config.as_ref().filter(|config| config.serves_many()) else {
        return run(args).await;
    };
    let databases = match database {
        Some(name) => vec![crate::fleet::catalog::pick(config, Some(name)).await?],
        None => crate::fleet::catalog::all_databases(config).await?,
    };
    let mut failed = Vec::new();
    for database in &databases {
        println!("-- database {}", database.name);
        let one = Migrate {
            config: Some(config.for_database(database)),
            database_url: None,
            dry_run: args.dry_run,
            backfill: args.backfill,
        };
        if let Err(error) = run(one).await {
            eprintln!("database {}: {error:#}", database.name);
            failed.push(database.name.clone());
        }
    }
    anyhow::ensure!(
        failed.is_empty(),
        "{} of {} databases were not migrated: {}",
        failed.len(),
        databases.len(),
        failed.join(", ")
    );
    Ok(())
}

/// The database `migrate` works on: the config's, else the URL given.
fn endpoint(args: &Migrate) -> anyhow::Result<crate::endpoint::Endpoint> {
    match (&args.config, &args.database_url) {
        (Some(config), _) => Ok(config.database.endpoint()),
        (None, Some(url)) => Ok(url.into()),
        (None, None) => {
            anyhow::bail!("give --config FILE or --database-url URL (or SWITCHYARD_DATABASE_URL)")
        }
    }
}

/// `[source]` checked against its table (PostgreSQL only).
async fn checked_source(
    source: Option<&crate::config::source::SourceConfig>,
    pg: Option<&crate::store::PgOutbox>,
) -> anyhow::Result<Option<crate::store::capture::Capture>> {
    match (source, pg) {
        (Some(source), Some(pg)) => Ok(Some(pg.check_source(source).await?)),
        (Some(_), None) => anyhow::bail!("source: an existing table can be relayed from PostgreSQL only"),
        (None, _) => Ok(None),
    }
}

/// Runs `switchyard migrate`.
///
/// # Errors
/// No database given, connection, a source mapping that does not fit the
/// table, or a failed statement.
pub async fn run(args: Migrate) -> anyhow::Result<()> {
    let url = endpoint(&args)?;
    let source = args.config.as_ref().and_then(|config| config.source.as_ref());
    anyhow::ensure!(
        !args.backfill || source.is_some(),
        "--backfill copies the rows of a [source] table, and the config has no [source]"
    );
    let store = OutboxStore::connect(&url, 2)
        .await
        .context("cannot connect to the database")?;
    let pg = store.postgres();
    let capture = checked_source(source, pg.as_ref()).await?;
    let pending = store
        .pending_migrations()
        .await
        .context("cannot read the migration history")?;
    let installed = match (&capture, &pg) {
        (Some(capture), Some(pg)) if pending.is_empty() => Some(pg.capture_installed(capture).await?),
        // Before the relay's own table exists, a trigger copying into it
        // cannot be current.
        (Some(_), _) => Some(Installed::Missing),
        (None, _) => None,
    };
    let replication = args.config.as_ref().and_then(Config::replication_feed);
    anyhow::ensure!(
        !(args.backfill && replication.is_some()),
        "--backfill copies a [source] table's rows for claim mode; in replication mode new rows are read \
         from the WAL: run the backfill with relay.mode = \"claim\" first, then migrate in replication mode"
    );
    // In replication mode the table is read from the WAL, not copied.
    let install = capture
        .as_ref()
        .filter(|_| replication.is_none())
        .filter(|_| args.backfill || installed != Some(Installed::Current));
    // Without a config the mode is unknown: leave it as it is. SQLite
    // has claim mode alone.
    let feed = match &args.config {
        Some(_) => feed_statements(&store, replication.as_ref(), capture.as_ref()).await?,
        None => Vec::new(),
    };

    if args.dry_run {
        print_dry_run(&pending, install, args.backfill, &feed);
        return Ok(());
    }

    store.migrate().await.context("migration failed")?;
    println!("outbox schema is up to date");
    // What the mode takes depends on the schema just made (replication mode
    // closes the intake, which a fresh database had not got a moment ago):
    // worked out again.
    let feed = match &args.config {
        Some(_) => feed_statements(&store, replication.as_ref(), capture.as_ref()).await?,
        None => Vec::new(),
    };
    if args.config.is_none()
        && let Some(pg) = &pg
        && pg
            .mode_mismatch(false)
            .await
            .context("cannot read the outbox's relay mode")?
            .is_some()
    {
        println!(
            "replication mode kept: rows are written `streamed` for a replication slot (without a config the \
             mode is left as it is; migrate with a claim-mode config to switch)"
        );
    }
    if let (Some(capture), Some(pg)) = (install, &pg) {
        let copied = pg
            .install_capture(capture, args.backfill)
            .await
            .with_context(|| format!("installing the capture trigger on {} failed", capture.table()))?;
        println!("capture trigger on {} installed", capture.table());
        if args.backfill {
            println!("{copied} existing row(s) of {} copied", capture.table());
        }
    } else if let Some(capture) = capture.as_ref().filter(|_| replication.is_none()) {
        println!("capture trigger on {} is up to date", capture.table());
    }
    if feed.is_empty() {
        return Ok(());
    }
    store
        .run_feed_statements(&feed)
        .await
        .context("setting the outbox's relay mode failed")?;
    match (&replication, &pg) {
        (Some(r), Some(_)) => println!(
            "replication mode: rows are written for the stream; publication {} and slot {} are in place",
            r.publication, r.slot
        ),
        (Some(r), None) => println!(
            "binlog mode: rows are written for the binary log reader; position {} is recorded",
            r.slot
        ),
        (None, _) => println!("claim mode: rows are written for claiming"),
    }
    Ok(())
}

/// What puts the database into the config's mode (replication mode's
/// slot and publication on PostgreSQL, binlog mode's position on MariaDB,
/// or back to claim mode); SQLite has claim mode alone.
async fn feed_statements(
    store: &OutboxStore,
    replication: Option<&crate::config::ReplicationConfig>,
    capture: Option<&crate::store::capture::Capture>,
) -> anyhow::Result<Vec<String>> {
    let feed = replication.map(|r| crate::store::change_stream::FeedNames {
        slot: &r.slot,
        publication: &r.publication,
        source: capture,
    });
    store
        .feed_statements(feed)
        .await
        .context("cannot read the database's relay mode setup")
}

/// What `--dry-run` prints: every statement `migrate` would run, in order.
fn print_dry_run(
    pending: &[(i64, String, String)],
    install: Option<&crate::store::capture::Capture>,
    backfill: bool,
    feed: &[String],
) {
    println!("-- switchyard migrate --dry-run: nothing below has been run.");
    for (version, description, sql) in pending {
        println!("\n-- migration {version}: {description}\n{}", sql.trim_end());
    }
    if let Some(capture) = install {
        println!("\n-- capture trigger on {} (one transaction)", capture.table());
        for statement in capture.install_sql(backfill) {
            println!("{};", statement.trim_end().trim_end_matches(';'));
        }
    }
    if !feed.is_empty() {
        println!("\n-- relay mode (each statement on its own)");
        for statement in feed {
            println!("{statement};");
        }
    }
    if pending.is_empty() && install.is_none() && feed.is_empty() {
        println!("-- nothing to do: the schema is up to date.");
    }
}
