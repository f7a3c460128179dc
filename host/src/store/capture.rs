//! The capture trigger on a `[source]` table: checked, inspected and
//! installed through the store (PostgreSQL; SQLite has no `[source]`).

pub use super::postgres::capture::{Capture, CheckError, Installed};
use super::{Error, OutboxStore, postgres};

impl OutboxStore {
    /// `[source]` checked against the live table, ready to generate the
    /// capture trigger; `None` on SQLite, which has no `[source]`.
    ///
    /// # Errors
    /// Every mismatch between the mapping and the table, or the database's error.
    pub async fn check_source(
        &self,
        source: &crate::config::source::SourceConfig,
    ) -> Result<Option<Capture>, CheckError> {
        match self.postgres() {
            Some(backend) => {
                let checked = backend
                    .bounded("the [source] table's check", async |session| {
                        Ok(postgres::capture::check(session, source).await)
                    })
                    .await?;
                checked.map(Some)
            }
            None => Ok(None),
        }
    }

    /// What the database has installed for `capture` (`Missing` on SQLite).
    ///
    /// # Errors
    /// The database's.
    pub async fn capture_installed(&self, capture: &Capture) -> Result<Installed, Error> {
        match self.postgres() {
            Some(backend) => {
                backend
                    .bounded("the capture trigger's check", async |session| {
                        Ok(capture.installed(session).await?)
                    })
                    .await
            }
            None => Ok(Installed::Missing),
        }
    }

    /// What is wrong with the trigger installed for `capture`, for an
    /// operator; `None` when it is current.
    ///
    /// # Errors
    /// The database's.
    pub async fn capture_problem(&self, capture: &Capture) -> Result<Option<String>, Error> {
        match self.postgres() {
            Some(_) => Ok(capture.problem(self.capture_installed(capture).await?)),
            None => Ok(None),
        }
    }

    /// Installs the capture trigger (and copies the table's rows with
    /// `backfill`) in one transaction; returns the rows copied.
    ///
    /// # Errors
    /// The database's; nothing is changed then.
    pub async fn install_capture(&self, capture: &Capture, backfill: bool) -> Result<u64, Error> {
        match self.pg_pool() {
            Some(pool) => Ok(capture.install(pool, backfill).await?),
            None => Ok(0),
        }
    }
}
