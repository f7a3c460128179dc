//! Command-line interface.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::telemetry::LogFormat;

mod dlq;
mod migrate;
mod ops;
mod plugin;
pub mod reference;
mod scaffold;
mod terminal;

pub use dlq::DlqCommand;

/// Switchyard: relays outbox rows through WebAssembly routing plugins to NATS and Kafka.
#[derive(Debug, Parser)]
#[command(name = "switchyard", version, about)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "SWITCHYARD_LOG_FORMAT")]
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
    /// Create or upgrade the outbox schema and, with `[source]`, install the
    /// trigger that copies the services' table into it.
    Migrate {
        /// Take the database URL (and `[source]`) from this config file.
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// The database URL.
        #[arg(long, env = "SWITCHYARD_DATABASE_URL")]
        database_url: Option<String>,
        /// Only this one of the config's `[[databases]]` (without it, all).
        #[arg(long, requires = "config")]
        database: Option<String>,
        /// Print the SQL that would run on this database; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Also copy the rows already in the `[source]` table, in the
        /// trigger's transaction (do it once: rows copied again are relayed
        /// again unless their event id is still in the outbox).
        #[arg(long, requires = "config")]
        backfill: bool,
    },
    /// Check a config file and print every problem; with `[source]`, check
    /// the mapping against the live table too.
    Validate {
        /// The relay config (TOML).
        #[arg(long, short)]
        config: PathBuf,
        /// Check only what needs no network: the config and the plugins'
        /// own `init`. For a
        /// service manager's pre-start check, which must not fail a boot
        /// while a database or broker is still coming up (the relay waits
        /// for them by itself).
        #[arg(long)]
        offline: bool,
    },
    /// Run the whole path on this machine with nothing else installed: a
    /// SQLite outbox, a sample order service, the example plugins, and the
    /// stdout and file targets.
    Demo {
        /// Directory for the SQLite file and the archive (default: a temp dir).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Directory holding the built example plugins.
        #[arg(long, env = "SWITCHYARD_PLUGINS_DIR")]
        plugins: Option<PathBuf>,
    },
    /// Check or dry-run a routing plugin.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// The config file's schema and reference.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Backlog, retries and dead letters from the database; plugins and
    /// target health from the running relay's admin endpoint.
    Status {
        /// Where the outbox is.
        #[command(flatten)]
        database: ops::Database,
        /// The relay's admin address (default: `[admin] listen` from --config).
        #[arg(long, value_name = "HOST:PORT")]
        admin: Option<String>,
        /// JSON for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Inspect, replay and purge dead letters.
    #[command(subcommand)]
    Dlq(DlqCommand),
}

/// `switchyard config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the JSON Schema of the config file, for editors that complete
    /// and check TOML (Taplo, Even Better TOML).
    Schema,
    /// Print a reference page (Markdown) the book carries, generated from
    /// the code.
    Reference {
        /// Which page: the config file's keys, the command line, or the metrics.
        #[arg(long, value_enum, default_value_t = ReferencePage::Config)]
        page: ReferencePage,
    },
}

/// The generated reference pages.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ReferencePage {
    /// `docs/src/reference/config-keys.md`.
    Config,
    /// `docs/src/reference/cli.md`.
    Cli,
    /// `docs/src/reference/metrics-list.md`.
    Metrics,
}

impl ReferencePage {
    /// Where the book keeps the page, from the repository's root.
    #[must_use]
    pub fn path(self) -> &'static str {
        match self {
            ReferencePage::Config => "docs/src/reference/config-keys.md",
            ReferencePage::Cli => "docs/src/reference/cli.md",
            ReferencePage::Metrics => "docs/src/reference/metrics-list.md",
        }
    }

    /// The page, generated now.
    #[must_use]
    pub fn markdown(self) -> String {
        match self {
            ReferencePage::Config => crate::config::reference::markdown(),
            ReferencePage::Cli => reference::cli_markdown(),
            ReferencePage::Metrics => reference::metrics_markdown(),
        }
    }
}

/// `switchyard plugin ...`
#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Start a plugin project in NAME/ that builds and passes `plugin test`
    /// as written (the WIT vendored in, a sample event).
    New {
        /// Project and plugin name (lowercase letters, digits, '-', '_').
        name: String,
        /// Language of the project.
        #[arg(long, value_enum, default_value = "rust")]
        lang: scaffold::Lang,
        /// Where to create NAME/ (default: the current directory).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Is FILE a valid component for the switchyard:plugin/router world?
    /// Prints its version hash, exports, imports and compile time.
    Check {
        /// The `.wasm` component, or an `oci://` reference to pull.
        file: PathBuf,
        /// How to reach the registry of an `oci://` reference.
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Check that FILE is a component of a world Switchyard serves, then
    /// push it to REFERENCE (`oci://REGISTRY/REPOSITORY:TAG`) as a Wasm OCI
    /// artifact (an `application/wasm` layer, as `wkg oci push` writes).
    /// Prints the pushed digest.
    Push {
        /// The `.wasm` component.
        file: PathBuf,
        /// Where: `oci://REGISTRY/REPOSITORY:TAG`.
        reference: String,
        /// How to reach the registry.
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Run FILE on events (or on pending rows) and print what it would
    /// publish. Publishes nothing and changes nothing.
    Test {
        /// The `.wasm` component, or an `oci://` reference to pull.
        file: PathBuf,
        /// How to reach the registry of an `oci://` reference.
        #[command(flatten)]
        registry: RegistryArgs,
        /// A JSON event: {"aggregate_type", "aggregate_id", "event_type",
        /// "payload", optional "headers", "tenant", "event_id", "attempt"},
        /// or an array of them. Repeatable; all events are routed together,
        /// as the relay routes a claimed batch.
        #[arg(long, required_unless_present = "from_db")]
        event: Vec<PathBuf>,
        /// Plugin config entries `key=value` (value parsed as JSON when it is JSON).
        #[arg(long = "config", value_name = "KEY=VALUE")]
        config: Vec<String>,
        /// Take the plugin config from this relay config's [[plugins]] entry...
        #[arg(long, requires = "plugin")]
        relay_config: Option<PathBuf>,
        /// ...with this name.
        #[arg(long)]
        plugin: Option<String>,
        /// Dry-run on the oldest pending rows of the outbox (then of the intake) instead.
        #[arg(long, conflicts_with = "event")]
        from_db: bool,
        /// How many rows with --from-db.
        #[arg(long, default_value_t = 10)]
        limit: u32,
        /// Database for --from-db.
        #[arg(long, env = "SWITCHYARD_DATABASE_URL")]
        database_url: Option<String>,
        /// With --from-db and --relay-config: which of its databases (by
        /// name); instead of --database-url.
        #[arg(long, requires_all = ["from_db", "relay_config"])]
        database: Option<String>,
        /// Use this file's bytes as the event's payload, as a binary event
        /// (`payload_bytes`) instead of the JSON `payload` (one event only).
        #[arg(long, requires = "event", value_name = "FILE")]
        payload_file: Option<PathBuf>,
        /// Print the report as one JSON document (binary payloads in base64).
        #[arg(long)]
        json: bool,
    },
}

/// A registry's credentials and TLS on the command line, as
/// `[plugins.registry]` holds them in a relay config.
#[derive(Debug, Clone, clap::Args)]
pub struct RegistryArgs {
    /// User name for basic authentication (with a password).
    #[arg(
        long = "registry-username",
        env = "SWITCHYARD_REGISTRY_USERNAME",
        value_name = "USER"
    )]
    pub username: Option<String>,
    /// File holding the password.
    #[arg(
        long = "registry-password-file",
        env = "SWITCHYARD_REGISTRY_PASSWORD_FILE",
        value_name = "FILE"
    )]
    pub password_file: Option<PathBuf>,
    /// File holding a bearer token.
    #[arg(
        long = "registry-token-file",
        env = "SWITCHYARD_REGISTRY_TOKEN_FILE",
        value_name = "FILE"
    )]
    pub token_file: Option<PathBuf>,
    /// A Docker config.json with the registry's credentials.
    #[arg(
        long = "registry-docker-config",
        env = "SWITCHYARD_REGISTRY_DOCKER_CONFIG",
        value_name = "FILE"
    )]
    pub docker_config: Option<PathBuf>,
    /// PEM file of the CA that signed the registry's certificate.
    #[arg(
        long = "registry-ca-file",
        env = "SWITCHYARD_REGISTRY_CA_FILE",
        value_name = "FILE"
    )]
    pub ca_file: Option<PathBuf>,
    /// Plain HTTP (a loopback registry only).
    #[arg(long = "registry-insecure")]
    pub insecure: bool,
}

impl RegistryArgs {
    /// The same settings as a relay config's `[plugins.registry]`.
    #[must_use]
    pub fn config(&self) -> crate::config::RegistryConfig {
        use crate::secret::{SecretConfig, SecretValue};
        let from_file = |file: &Option<PathBuf>| {
            file.clone()
                .map(|file| SecretValue::From(SecretConfig::from_file(file)))
        };
        crate::config::RegistryConfig {
            username: self.username.clone(),
            password: from_file(&self.password_file),
            token: from_file(&self.token_file),
            docker_config: self.docker_config.clone(),
            ca_file: self.ca_file.clone(),
            insecure: self.insecure,
            ..crate::config::RegistryConfig::default()
        }
    }
}

/// Parses the command line, runs the command, and maps the result to an exit code.
pub fn main() -> ExitCode {
    crate::tune_allocator();
    let cli = Cli::parse();
    // The demo's output is the point; keep lifecycle logs out of it.
    let default_filter = if matches!(cli.command, Command::Demo { .. }) {
        "warn"
    } else {
        "info"
    };
    crate::telemetry::init_with_default(cli.log_format, default_filter);
    crate::tls::install_provider();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Status {
            database,
            admin,
            json,
        } => ops::status(database, admin, json).await,
        Command::Dlq(command) => dlq::dlq(command).await,
        command => dispatch_unit(command).await.map(|()| ExitCode::SUCCESS),
    }
}

async fn dispatch_unit(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Status { .. } | Command::Dlq(_) => unreachable!("dispatched above"),
        Command::Run { config } => crate::app::run(Config::load(&config)?).await,
        Command::Validate { config, offline } => ops::validate(&config, offline).await,
        Command::Plugin(command) => plugin::run(command).await,
        Command::Config(ConfigCommand::Schema) => {
            println!("{:#}", crate::config::reference::schema());
            Ok(())
        }
        Command::Config(ConfigCommand::Reference { page }) => {
            print!("{}", page.markdown());
            Ok(())
        }
        Command::Demo { dir, plugins } => crate::demo::run(dir, plugins).await,
        Command::Migrate {
            config,
            database_url,
            database,
            dry_run,
            backfill,
        } => {
            let config = config.map(|path| Config::load(&path)).transpose()?;
            let migrate = migrate::Migrate {
                config,
                database_url,
                dry_run,
                backfill,
            };
            migrate::run_each(migrate, database.as_deref()).await
        }
    }
}
