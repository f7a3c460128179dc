//! The capture trigger on a `[source]` table: checked, inspected and
//! installed through the PostgreSQL handle (SQLite has no `[source]`).

pub use super::postgres::capture::{Capture, CheckError, Installed};
use super::{Error, PgOutbox, postgres};

impl PgOutbox {
    /// `[source]` checked against the live table, ready to generate the
    /// capture trigger.
    ///
    /// # Errors
    /// Every mismatch between the mapping and the table, or the database's error.
    pub async fn check_source(
        &self,
        source: &crate::config::source::SourceConfig,
    ) -> Result<Capture, CheckError> {
        self.backend
            .bounded("the [source] table's check", async |session| {
                Ok(postgres::capture::check(session, source).await)
            })
            .await?
    }

    /// What the database has installed for `capture`.
    ///
    /// # Errors
    /// The database's.
    pub async fn capture_installed(&self, capture: &Capture) -> Result<Installed, Error> {
        self.backend
            .bounded("the capture trigger's check", async |session| {
                Ok(capture.installed(session).await?)
            })
            .await
    }

    /// What is wrong with the trigger installed for `capture`, for an
    /// operator; `None` when it is current.
    ///
    /// # Errors
    /// The database's.
    pub async fn capture_problem(&self, capture: &Capture) -> Result<Option<String>, Error> {
        Ok(capture.problem(self.capture_installed(capture).await?))
    }

    /// Installs the capture trigger (and copies the table's rows with
    /// `backfill`) in one transaction; returns the rows copied.
    ///
    /// # Errors
    /// The database's; nothing is changed then.
    pub async fn install_capture(&self, capture: &Capture, backfill: bool) -> Result<u64, Error> {
        Ok(capture.install(&self.backend.pool, backfill).await?)
    }
}
