//! Command-line interface.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::store::OutboxStore;
use crate::telemetry::LogFormat;

/// Switchyard: relays outbox rows through WebAssembly routing plugins to NATS and Kafka.
#[derive(Debug, Parser)]
#[command(name = "switchyard", version, about)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Relay outbox rows until SIGINT or SIGTERM.
    Run {
        /// The relay config (TOML).
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Create or upgrade the outbox schema.
    Migrate {
        /// Take the database URL from this config file.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// The database URL.
        #[arg(long, env = "SWITCHYARD_DATABASE_URL")]
        database_url: Option<String>,
    },
    /// Check a config file and print every problem.
    Validate {
        /// The relay config (TOML).
        #[arg(long, short)]
        config: PathBuf,
    },
}

/// Parses the command line, runs the command, and maps the result to an exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    crate::telemetry::init(cli.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run { config } => crate::app::run(Config::load(&config)?).await,
        Command::Validate { config } => {
            Config::load(&config)?;
            println!("{}: ok", config.display());
            Ok(())
        }
        Command::Migrate { config, database_url } => {
            let url = match (config, database_url) {
                (Some(path), _) => Config::load(&path)?.database.url,
                (None, Some(url)) => url,
                (None, None) => {
                    anyhow::bail!("give --config FILE or --database-url URL (or SWITCHYARD_DATABASE_URL)")
                }
            };
            let store = OutboxStore::connect(&url, 2)
                .await
                .context("cannot connect to the database")?;
            store.migrate().await.context("migration failed")?;
            println!("outbox schema is up to date");
            Ok(())
        }
    }
}
