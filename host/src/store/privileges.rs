//! What the relay's database account may do, checked against what it does:
//! a privilege it lacks is named with the `GRANT` that gives it, at start,
//! in `/readyz` and in `validate`, instead of surfacing as a table that
//! seems not to exist (MySQL hides a table from an account with no
//! privilege on it) or as a failed claim.

use sqlx::{MySqlPool, PgPool};

use super::Error;

/// The statements the relay runs on each table, by mode: the book's grants
/// (how-to/mysql.md, how-to/deploy.md) list exactly these.
struct Needs {
    table: &'static str,
    /// A column to name in the probe of UPDATE.
    key: &'static str,
    privileges: &'static [&'static str],
    /// Only replication (binlog) mode uses the table.
    replication_only: bool,
}

const ALL: &[&str] = &["SELECT", "INSERT", "UPDATE", "DELETE"];

const MYSQL_TABLES: &[Needs] = &[
    Needs {
        table: "switchyard_outbox",
        key: "id",
        privileges: ALL,
        replication_only: false,
    },
    Needs {
        table: "switchyard_outbox_archive",
        key: "id",
        privileges: ALL,
        replication_only: false,
    },
    Needs {
        table: "switchyard_relays",
        key: "instance_id",
        privileges: ALL,
        replication_only: false,
    },
    Needs {
        table: "switchyard_ownership",
        key: "id",
        privileges: ALL,
        replication_only: false,
    },
    Needs {
        table: "switchyard_binlog_positions",
        key: "name",
        privileges: &["SELECT", "INSERT", "UPDATE"],
        replication_only: true,
    },
];

const PG_TABLES: &[&str] = &[
    "switchyard_outbox",
    "switchyard_outbox_archive",
    "switchyard_intake",
    "switchyard_relays",
    "switchyard_ownership",
];

/// MariaDB's and MySQL's "command denied" (table and column level).
const TABLE_ACCESS_DENIED: u16 = 1142;
const COLUMN_ACCESS_DENIED: u16 = 1143;
/// A table that does not exist (seen only where the account may see it).
const NO_SUCH_TABLE: u16 = 1146;

/// One finding per table: what the account lacks and the statement that
/// grants it.
pub(super) async fn mysql(pool: &MySqlPool, replication: bool) -> Result<Vec<String>, Error> {
    let (database, account): (String, String) =
        sqlx::query_as("SELECT CAST(DATABASE() AS CHAR), CAST(CURRENT_USER() AS CHAR)")
            .fetch_one(pool)
            .await?;
    let account = match account.rsplit_once('@') {
        Some((user, host)) => format!("'{user}'@'{host}'"),
        None => format!("'{account}'"),
    };
    let mut problems = Vec::new();
    for needs in MYSQL_TABLES.iter().filter(|n| replication || !n.replication_only) {
        let (table, key) = (needs.table, needs.key);
        let mut lacking = Vec::new();
        for privilege in needs.privileges {
            // EXPLAIN runs nothing and takes no row lock, but the server
            // checks the statement's privileges as it would run it.
            let probe = match *privilege {
                "SELECT" => format!("SELECT 1 FROM {table} LIMIT 0"),
                "INSERT" => format!("EXPLAIN INSERT INTO {table} () VALUES ()"),
                "UPDATE" => format!("EXPLAIN UPDATE {table} SET {key} = {key} WHERE FALSE"),
                _ => format!("EXPLAIN DELETE FROM {table} WHERE FALSE"),
            };
            match sqlx::raw_sql(&probe).execute(pool).await {
                Ok(_) => {}
                Err(sqlx::Error::Database(error)) => {
                    let number = error
                        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                        .map(sqlx::mysql::MySqlDatabaseError::number);
                    match number {
                        Some(TABLE_ACCESS_DENIED | COLUMN_ACCESS_DENIED) => lacking.push(*privilege),
                        Some(NO_SUCH_TABLE) => {
                            problems.push(format!("table {table} does not exist: run `switchyard migrate`"));
                            break;
                        }
                        _ => return Err(sqlx::Error::Database(error).into()),
                    }
                }
                Err(other) => return Err(other.into()),
            }
        }
        if lacking.is_empty() {
            continue;
        }
        let list = lacking.join(", ");
        let hidden = if lacking.contains(&"SELECT") {
            " (or the table does not exist: the server does not say which to an account without the privilege; \
             `switchyard migrate` makes it)"
        } else {
            ""
        };
        problems.push(format!(
            "the relay's account lacks {list} on `{database}`.`{table}`{hidden}: \
             GRANT {list} ON `{database}`.`{table}` TO {account}"
        ));
    }
    Ok(problems)
}

/// As [`mysql`], for PostgreSQL: the tables the migrations made that the
/// role may not use, and `switchyard_ack`.
pub(super) async fn postgres(pool: &PgPool) -> Result<Vec<String>, Error> {
    let tables: Vec<String> = PG_TABLES.iter().map(ToString::to_string).collect();
    let privileges: Vec<String> = ALL.iter().map(ToString::to_string).collect();
    let role: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(pool)
        .await?;
    let lacking: Vec<(String, Vec<String>)> = sqlx::query_as(
        "SELECT t, array_agg(p ORDER BY array_position($2::text[], p))
           FROM unnest($1::text[]) t, unnest($2::text[]) p
          WHERE to_regclass(t) IS NOT NULL AND NOT has_table_privilege(to_regclass(t), p)
          GROUP BY t ORDER BY array_position($1::text[], t)",
    )
    .bind(&tables)
    .bind(&privileges)
    .fetch_all(pool)
    .await?;
    let ack: bool = sqlx::query_scalar(
        "SELECT coalesce(bool_and(has_function_privilege(oid, 'EXECUTE')), true)
           FROM pg_proc WHERE proname = 'switchyard_ack' AND pg_function_is_visible(oid)",
    )
    .fetch_one(pool)
    .await?;
    let role = quote_ident(&role);
    let mut problems: Vec<String> = lacking
        .into_iter()
        .map(|(table, missing)| {
            let list = missing.join(", ");
            format!("the relay's role lacks {list} on {table}: GRANT {list} ON {table} TO {role}")
        })
        .collect();
    if !ack {
        problems.push(format!(
            "the relay's role may not call switchyard_ack: GRANT EXECUTE ON FUNCTION switchyard_ack TO {role}"
        ));
    }
    Ok(problems)
}

fn quote_ident(name: &str) -> String {
    if name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit())
    {
        name.to_string()
    } else {
        format!("\"{}\"", name.replace('"', "\"\""))
    }
}
