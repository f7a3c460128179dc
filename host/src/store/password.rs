//! A rotating database password: read again now and then and handed to the
//! pool for the sessions it opens next, whichever database the pool is for.

use std::time::Duration;

use sqlx::{Connection, Database, Pool};
use tokio_util::sync::CancellationToken;

use crate::endpoint::Endpoint;
use crate::secret::Secret;

/// A pool's connect options with another password.
pub(super) type WithPassword<DB> = fn(
    &<<DB as Database>::Connection as Connection>::Options,
    &str,
) -> <<DB as Database>::Connection as Connection>::Options;

/// Reads the password again every `every` and hands a changed one to the
/// pool, for the sessions it opens next (LISTEN's too: it takes the pool's
/// options). sqlx has no hook for each new connection; this is the one
/// `Pool::set_connect_options` allows. A failed read is logged once per
/// spell and the last good password kept.
pub(super) async fn renew<DB: Database>(
    pool: Pool<DB>,
    endpoint: Endpoint,
    every: Duration,
    stop: CancellationToken,
    mut current: Option<Secret>,
    with_password: WithPassword<DB>,
) {
    let mut failing = false;
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stop.cancelled() => return,
        }
        match endpoint.password().await {
            Ok(Some(secret)) => {
                failing = false;
                if current.as_ref() != Some(&secret) {
                    let options = with_password(&pool.connect_options(), secret.expose());
                    pool.set_connect_options(options);
                    tracing::info!(database = %endpoint.describe(), "Password renewed for new sessions.");
                    current = Some(secret);
                }
            }
            Ok(None) => return,
            Err(error) if !failing => {
                failing = true;
                tracing::warn!(%error, "Cannot read the database password again; new sessions use the last one read.");
            }
            Err(_) => {}
        }
    }
}
