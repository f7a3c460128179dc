//! A fresh MariaDB database per test, on the server `scripts/services.sh`
//! starts (`SWITCHYARD_MARIADB_URL`), dropped when the test ends.

use sqlx::{Connection, Executor, MySqlConnection};

/// The server's URL as the services script prints it.
pub fn server_url() -> String {
    std::env::var("SWITCHYARD_MARIADB_URL")
        .unwrap_or_else(|_| "mysql://switchyard@127.0.0.1:53306/mysql".to_string())
}

/// The URL of database `name` on the test server.
pub fn url_of(name: &str) -> String {
    let server = server_url();
    let base = server.rsplit_once('/').map_or(server.as_str(), |(base, _)| base);
    format!("{base}/{name}")
}

/// An empty database, and the guard that drops it.
pub struct TestMariaDb {
    /// Its URL.
    pub url: String,
    /// A pool of the test's own, for writing rows as a service does.
    pub pool: sqlx::MySqlPool,
    /// Drops the database when the test is done.
    pub guard: DropMariaDb,
}

/// Drops a test database.
pub struct DropMariaDb {
    name: String,
}

impl Drop for DropMariaDb {
    fn drop(&mut self) {
        let name = std::mem::take(&mut self.name);
        super::clean_up_in_drop("drop a test database", async move {
            let mut admin = MySqlConnection::connect(&server_url()).await?;
            // A test that failed mid-transaction leaves sessions whose
            // runtime is gone, holding locks the DROP would wait on for a
            // day (lock_wait_timeout's default).
            let sessions: Vec<i64> = sqlx::query_scalar(
                "SELECT id FROM information_schema.processlist WHERE db = ? AND id <> CONNECTION_ID()",
            )
            .bind(&name)
            .fetch_all(&mut admin)
            .await?;
            for session in sessions {
                let _ = admin.execute(format!("KILL {session}").as_str()).await;
            }
            admin.execute("SET SESSION lock_wait_timeout = 30").await?;
            admin
                .execute(format!("DROP DATABASE IF EXISTS `{name}`").as_str())
                .await?;
            admin.close().await?;
            Ok(())
        });
    }
}

/// Creates an empty database (no schema).
///
/// # Panics
/// When MariaDB is not reachable: start it with `scripts/services.sh start`.
pub async fn fresh_database() -> TestMariaDb {
    let name = format!("sy_{}", uuid::Uuid::new_v4().simple());
    let mut admin = MySqlConnection::connect(&server_url())
        .await
        .unwrap_or_else(|e| panic!("MariaDB at {} ({e}): run scripts/services.sh start", server_url()));
    admin
        .execute(format!("CREATE DATABASE `{name}`").as_str())
        .await
        .expect("create database");
    let _ = admin.close().await;
    let url = url_of(&name);
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .expect("connect to the test database");
    TestMariaDb {
        url,
        pool,
        guard: DropMariaDb { name },
    }
}
