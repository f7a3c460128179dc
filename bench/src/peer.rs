//! `relay-bench --steady --peer`: pg-transactional-outbox (bench/peer, a
//! Node.js package) relaying its own outbox table from the WAL to the same
//! NATS stream, with the same payloads and subscriber, so that the two
//! relays' PostgreSQL cost is compared on one machine in one run.

use std::path::PathBuf;
use std::process::Stdio;

use anyhow::Context;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The replication slot the peer reads; dropped with its database.
pub(super) const SLOT: &str = "peer_outbox_slot";

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("peer")
}

/// Installs the peer's pinned packages once.
pub(super) async fn install() -> anyhow::Result<()> {
    if dir().join("node_modules").exists() {
        return Ok(());
    }
    let status = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund"])
        .current_dir(dir())
        .status()
        .await
        .context("cannot run npm (the peer needs Node.js)")?;
    anyhow::ensure!(status.success(), "npm ci in {} failed", dir().display());
    Ok(())
}

/// A running peer relay, stopped (SIGTERM, then waited for) by [`Peer::stop`].
pub(super) struct Peer {
    child: Child,
}

/// Creates the peer's table, publication and slot in the database at `url`,
/// then starts it publishing to NATS at `nats_url`.
pub(super) async fn start(url: &str, nats_url: &str) -> anyhow::Result<Peer> {
    let node = |command: &str| {
        let mut node = Command::new("node");
        node.arg("relay.js")
            .arg(command)
            .current_dir(dir())
            .env("DATABASE_URL", url)
            .env("NATS_URL", nats_url)
            .env("PGAPPNAME", super::server_cost::PEER_APP)
            .kill_on_drop(true);
        node
    };
    let status = node("setup").status().await?;
    anyhow::ensure!(status.success(), "the peer's setup failed");
    let mut child = node("run").stdout(Stdio::piped()).spawn()?;
    let stdout = child.stdout.take().context("the peer's stdout")?;
    let ready = BufReader::new(stdout).lines().next_line().await?;
    anyhow::ensure!(
        ready.as_deref() == Some("ready"),
        "the peer did not start: {ready:?}"
    );
    Ok(Peer { child })
}

impl Peer {
    pub(super) async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill").arg(pid.to_string()).status().await;
        }
        self.child.wait().await?;
        Ok(())
    }
}

/// One event into the peer's table, as its `initializeMessageStorage` writes
/// it (a client-made id there), carrying its send time.
pub(super) async fn write(pool: &PgPool, seq: i64, sent_us: i64) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO public.outbox (id, aggregate_type, aggregate_id, message_type, segment, payload, metadata)
         VALUES (gen_random_uuid(), 'order', 'order-' || (($1::bigint * 7919) % 10000), 'OrderCreated',
                 'order-' || (($1::bigint * 7919) % 10000),
                 jsonb_build_object('sent_us', $2::bigint, 'seq', $1::bigint, 'currency', 'EUR',
                                    'total_cents', 12900, 'customer_id', 'cust-42'), NULL)
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(seq)
    .bind(sent_us)
    .execute(pool)
    .await?;
    Ok(())
}
