//! One outbox per test on any backend, so a test body about claiming and
//! acking runs unchanged on PostgreSQL, SQLite and MariaDB.

use std::time::Duration;

use switchyard::store::OutboxStore;

use super::postgres::fresh_db;

/// An empty, migrated outbox and a way to write rows into it.
pub struct TestOutbox {
    /// The store under test.
    pub store: OutboxStore,
    _database: Option<super::postgres::DropDatabase>,
    pg: Option<sqlx::PgPool>,
    sqlite: Option<sqlx::SqlitePool>,
    sqlite_path: Option<std::path::PathBuf>,
    mysql: Option<sqlx::MySqlPool>,
    _mariadb: Option<super::mariadb::DropMariaDb>,
    /// The database's URL.
    pub url: String,
    /// `"postgres"`, `"sqlite"` or `"mariadb"`.
    pub kind: &'static str,
}

/// Runs `$body` with `$pool` bound to whichever pool the outbox has.
macro_rules! on_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match (&$db.pg, &$db.sqlite, &$db.mysql) {
            (Some($pool), _, _) => $body,
            (_, Some($pool), _) => $body,
            (_, _, Some($pool)) => $body,
            _ => unreachable!("one backend is set"),
        }
    };
}

/// A SQLite outbox's file (and its journal) goes with it, as a PostgreSQL
/// or MariaDB outbox's database does: thousands of tests would otherwise
/// leave their files in the temporary directory.
impl Drop for TestOutbox {
    fn drop(&mut self) {
        if let Some(path) = &self.sqlite_path {
            for suffix in ["", "-wal", "-shm"] {
                let mut file = path.clone().into_os_string();
                file.push(suffix);
                let _ = std::fs::remove_file(file);
            }
        }
    }
}

impl TestOutbox {
    /// A fresh PostgreSQL database, connected as a relay connects (its
    /// sessions carry the planner settings and a statement timeout).
    pub async fn postgres() -> TestOutbox {
        let db = fresh_db().await;
        let store =
            OutboxStore::connect_bounded(&db.url, 4, "switchyard-test", Some(Duration::from_secs(30)))
                .await
                .expect("connect");
        TestOutbox {
            store,
            _database: Some(db.guard),
            pg: Some(db.pool),
            sqlite: None,
            sqlite_path: None,
            mysql: None,
            _mariadb: None,
            url: db.url,
            kind: "postgres",
        }
    }

    /// A fresh MariaDB database, migrated, connected as a relay connects
    /// (READ COMMITTED, a statement bound).
    pub async fn mariadb() -> TestOutbox {
        let db = super::mariadb::fresh_database().await;
        let store =
            OutboxStore::connect_bounded(&db.url, 4, "switchyard-test", Some(Duration::from_secs(30)))
                .await
                .expect("connect");
        store.migrate().await.expect("migrate mariadb");
        sqlx::raw_sql(super::service::MYSQL_ORDERS)
            .execute(&db.pool)
            .await
            .expect("create orders");
        TestOutbox {
            store,
            _database: None,
            pg: None,
            sqlite: None,
            sqlite_path: None,
            mysql: Some(db.pool),
            _mariadb: Some(db.guard),
            url: db.url,
            kind: "mariadb",
        }
    }

    /// The server's pool as a service writes through it (PostgreSQL or
    /// MariaDB).
    ///
    /// # Panics
    /// On SQLite.
    pub fn service_pool(&self) -> super::service::ServicePool {
        match (&self.pg, &self.mysql) {
            (Some(pool), _) => pool.into(),
            (_, Some(pool)) => pool.into(),
            _ => panic!("SQLite is no service's shared server"),
        }
    }

    /// The MariaDB pool, for a MariaDB outbox.
    ///
    /// # Panics
    /// On another backend.
    pub fn mysql_pool(&self) -> sqlx::MySqlPool {
        self.mysql.clone().expect("a MariaDB outbox")
    }

    /// A fresh SQLite file.
    pub async fn sqlite() -> TestOutbox {
        let path = std::env::temp_dir().join(format!("sy-{}.db", uuid::Uuid::new_v4().simple()));
        let url = format!("sqlite://{}", path.display());
        let store = OutboxStore::connect(&url, 4).await.expect("open sqlite");
        store.migrate().await.expect("migrate sqlite");
        let pool = sqlx::SqlitePool::connect(&url).await.expect("sqlite pool");
        TestOutbox {
            store,
            _database: None,
            pg: None,
            sqlite: Some(pool),
            sqlite_path: Some(path),
            mysql: None,
            _mariadb: None,
            url,
            kind: "sqlite",
        }
    }

    /// The SQLite pool, for a SQLite outbox.
    ///
    /// # Panics
    /// On a PostgreSQL outbox.
    pub fn sqlite_pool(&self) -> sqlx::SqlitePool {
        self.sqlite.clone().expect("a SQLite outbox")
    }

    /// The SQLite file, for a SQLite outbox.
    ///
    /// # Panics
    /// On a PostgreSQL outbox.
    pub fn sqlite_path(&self) -> &std::path::Path {
        self.sqlite_path.as_deref().expect("a SQLite outbox")
    }

    /// Runs one SQL statement without parameters.
    ///
    /// # Panics
    /// If the database refuses it.
    pub async fn execute(&self, sql: &str) {
        on_pool!(self, pool => sqlx::raw_sql(sql).execute(pool).await.map(drop))
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Writes an event with payload `{"seq": seq}` for aggregate `o-<aggregate>`,
    /// delayed by `delay_ms` when given.
    pub async fn insert(&self, aggregate: usize, seq: usize, delay_ms: Option<i64>) {
        let id = format!("o-{aggregate}");
        let payload = serde_json::json!({ "seq": seq });
        if let Some(pool) = &self.pg {
            sqlx::query(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, not_before)
                 VALUES ('order', $1, 'OrderUpdated', $2, now() + $3 * interval '1 millisecond')",
            )
            .bind(&id)
            .bind(&payload)
            .bind(delay_ms)
            .execute(pool)
            .await
            .expect("insert");
        } else if let Some(pool) = &self.sqlite {
            sqlx::query(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, not_before)
                 VALUES ('order', ?1, 'OrderUpdated', ?2, CAST(unixepoch('subsec') * 1000 AS INTEGER) + ?3)",
            )
            .bind(&id)
            .bind(payload.to_string())
            .bind(delay_ms)
            .execute(pool)
            .await
            .expect("insert");
        } else if let Some(pool) = &self.mysql {
            sqlx::query(
                "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, not_before)
                 VALUES ('order', ?, 'OrderUpdated', ?, NOW(6) + INTERVAL ? MICROSECOND)",
            )
            .bind(&id)
            .bind(payload.to_string())
            .bind(delay_ms.map(|ms| ms * 1000))
            .execute(pool)
            .await
            .expect("insert");
        }
    }

    /// Inserts an event as a service would, returning the database's error
    /// text if it refuses the row.
    ///
    /// # Errors
    /// The database's message.
    pub async fn try_insert(&self, aggregate_id: &str, event_id: Option<&str>) -> Result<(), String> {
        let result = if let Some(pool) = &self.pg {
            sqlx::query(
                "INSERT INTO switchyard_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES (coalesce($2::uuid, gen_random_uuid()), 'order', $1, 'OrderUpdated', '{}')",
            )
            .bind(aggregate_id)
            .bind(event_id)
            .execute(pool)
            .await
            .map(drop)
        } else if let Some(pool) = &self.sqlite {
            let query = match event_id {
                Some(_) => "INSERT INTO switchyard_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
                            VALUES (?2, 'order', ?1, 'OrderUpdated', '{}')",
                None => "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                         VALUES ('order', ?1, 'OrderUpdated', '{}')",
            };
            sqlx::query(query)
                .bind(aggregate_id)
                .bind(event_id)
                .execute(pool)
                .await
                .map(drop)
        } else if let Some(pool) = &self.mysql {
            let query = match event_id {
                Some(_) => "INSERT INTO switchyard_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
                            VALUES (?, 'order', ?, 'OrderUpdated', '{}')",
                None => "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload)
                         VALUES ('order', ?, 'OrderUpdated', '{}')",
            };
            let query = match event_id {
                Some(event_id) => sqlx::query(query).bind(event_id).bind(aggregate_id),
                None => sqlx::query(query).bind(aggregate_id),
            };
            query.execute(pool).await.map(drop)
        } else {
            unreachable!("one backend is set")
        };
        result.map_err(|e| e.to_string())
    }

    /// A row's status and last error.
    pub async fn status_of(&self, id: i64) -> (String, Option<String>) {
        let sql = self.numbered("SELECT status, last_error FROM switchyard_outbox WHERE id = $1");
        on_pool!(self, pool => sqlx::query_as(&sql).bind(id).fetch_one(pool).await.expect("status"))
    }

    /// Rows in a status.
    pub async fn count(&self, status: &str) -> i64 {
        let sql = self.numbered("SELECT count(*) FROM switchyard_outbox WHERE status = $1");
        on_pool!(self, pool => sqlx::query_scalar(&sql).bind(status).fetch_one(pool).await.expect("count"))
    }

    /// Runs `sql` in a transaction on a session of its own and keeps the
    /// transaction open (its locks held, its changes uncommitted) until the
    /// returned value is dropped, which rolls it back: another relay's
    /// claim, caught between its statements.
    pub async fn hold(&self, sql: &str) -> Held {
        if let Some(pool) = &self.pg {
            let mut tx = pool.begin().await.expect("begin");
            sqlx::raw_sql(sql)
                .execute(&mut *tx)
                .await
                .expect("held statement");
            Held::Postgres(tx)
        } else if let Some(pool) = &self.mysql {
            let mut tx = pool.begin().await.expect("begin");
            sqlx::raw_sql(sql)
                .execute(&mut *tx)
                .await
                .expect("held statement");
            Held::MySql(tx)
        } else {
            panic!("SQLite has one writer: a held transaction blocks every claim")
        }
    }

    /// The single integer an SQL query without parameters returns.
    pub async fn scalar(&self, sql: &str) -> i64 {
        on_pool!(self, pool => sqlx::query_scalar(sql).fetch_one(pool).await.expect("scalar"))
    }

    /// `sql` with its `$n` parameters as MySQL's `?` on MariaDB (each
    /// used once, in order).
    fn numbered(&self, sql: &str) -> String {
        if self.mysql.is_none() {
            return sql.to_string();
        }
        let mut out = sql.to_string();
        for n in (1..10).rev() {
            out = out.replace(&format!("${n}"), "?");
        }
        out
    }
}

/// A transaction left open by [`TestOutbox::hold`].
pub enum Held {
    /// On PostgreSQL.
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
    /// On MariaDB.
    MySql(sqlx::Transaction<'static, sqlx::MySql>),
}

impl Held {
    /// Rolls the transaction back and waits until the server has: a
    /// transaction merely dropped is rolled back when its session is next
    /// used, and holds its locks until then.
    ///
    /// # Panics
    /// When the server refuses the rollback.
    pub async fn release(self) {
        match self {
            Held::Postgres(tx) => tx.rollback().await,
            Held::MySql(tx) => tx.rollback().await,
        }
        .expect("rollback");
    }
}
