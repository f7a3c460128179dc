//! The book's database grants, given as written: `migrate` runs as the
//! schema's owner, then a relay runs as an account with exactly the
//! privileges how-to/mysql.md (MariaDB) and how-to/deploy.md (PostgreSQL)
//! list, in claim mode and in replication (binlog) mode. `validate` says ok
//! and the relay publishes a service's events. Without one privilege,
//! `validate` and `/readyz` name it with the `GRANT` that gives it, never
//! "run migrate".

use std::time::Duration;

use switchyard_tests::book;
use switchyard_tests::nats::NatsServer;
use switchyard_tests::orders::verify;
use switchyard_tests::outbox::TestOutbox;
use switchyard_tests::postgres::{Outbox, TestDb, fresh_db, on_database, server_url};
use switchyard_tests::relay::{InProcess, Process, Settings, example, parse};
use switchyard_tests::workload::{Shape, write_events};
use switchyard_tests::{cli, eventually, init_logging, readyz_answers, readyz_unready, with_admin};

const STREAM: &str = "ORDERS";
const SWITCHYARD: &str = env!("CARGO_BIN_EXE_relay-process");
const PASSWORD: &str = "book-grants-1";

/// The book's SQL block holding `marker`, without its comment lines, with
/// `replace` applied.
fn book_sql(page: &str, marker: &str, replace: &[(&str, &str)]) -> Vec<String> {
    let block = book::sql_block(page, marker);
    let text: String = block
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .collect::<Vec<_>>()
        .join("\n");
    let text = replace
        .iter()
        .fold(text, |text, (from, to)| text.replace(from, to));
    text.split(';')
        .map(str::trim)
        .filter(|statement| !statement.is_empty())
        .map(ToString::to_string)
        .collect()
}

/// Runs `switchyard ARGS --config CONFIG`.
async fn run_with_config(args: &[&str], config: &str) -> (i32, String, String) {
    let path = std::env::temp_dir().join(format!("sy-grants-{}.toml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, config).unwrap();
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--config", path.to_str().unwrap()]);
    let ran = cli(SWITCHYARD, &all, &[]).await;
    let _ = std::fs::remove_file(&path);
    ran
}

fn config_on(url: &str, nats: &NatsServer, replication: Option<&str>) -> String {
    let settings = Settings::new(url, &nats.url());
    let settings = match replication {
        Some(_) => settings.relay("mode", "\"replication\""),
        None => settings,
    };
    let config = example(&settings);
    match replication {
        Some(slot) => config
            .set("replication", "slot", slot)
            .set("replication", "publication", "switchyard_outbox")
            .toml(),
        None => config.toml(),
    }
}

/// The relay, as the book's account, validates and publishes what a
/// service writes: every event once, in order per aggregate (`verify`
/// fails on the first out of order).
async fn relays_as_the_account(
    config: &str,
    service: switchyard_tests::service::ServicePool,
    nats: &NatsServer,
) {
    let (code, out, err) = run_with_config(&["validate"], config).await;
    assert_eq!(code, 0, "validate as the book's account: {out}{err}");
    let relay = InProcess::start(&parse(config)).await;
    let ready = switchyard::admin::readiness(&relay.relay).await;
    assert!(ready.ready, "ready as the book's account: {ready:?}");
    let expected = write_events(service, Shape::rows(Outbox::Switchyard), 12, 120, 2, 7).await;
    eventually("every event in the stream", Duration::from_secs(60), || async {
        (nats.stream_len(STREAM).await >= expected.len() as u64).then_some(())
    })
    .await;
    relay.stop().await;
    let verdict = verify(&nats.read_stream(STREAM).await, &expected);
    assert_eq!(
        (verdict.distinct, verdict.duplicates),
        (expected.len(), 0),
        "{verdict:?}"
    );
}

/// With `revoked` run, `validate` fails and `/readyz` says 503, each
/// naming what `says` holds; after `granted`, the relay becomes ready.
async fn a_missing_privilege_is_named(config: &str, says: &[&str], restore: impl AsyncFnOnce()) {
    let (code, out, err) = run_with_config(&["validate"], config).await;
    let said = format!("{out}{err}");
    assert_ne!(code, 0, "validate without the privilege: {said}");
    for text in says {
        assert!(said.contains(text), "validate names {text:?}: {said}");
    }
    assert!(!said.contains("run `switchyard migrate`"), "{said}");
    let (config, admin) = with_admin(config);
    let mut relay = Process::spawn(SWITCHYARD, &config, "grants");
    let body = readyz_unready(admin, says).await;
    assert!(!body.contains("run `switchyard migrate`"), "{body}");
    restore().await;
    readyz_answers(admin, 200).await;
    relay.terminate();
}

async fn nats_stream() -> NatsServer {
    let nats = NatsServer::start().await;
    nats.create_stream(STREAM, &["orders.>"]).await;
    nats
}

/// A MariaDB account of this test's own, from the book's blocks.
async fn mariadb_account(db: &TestOutbox, markers: &[&str]) -> (String, String) {
    let database = db.url.rsplit('/').next().unwrap().to_string();
    let user = format!("sy_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let account = format!("'{user}'@'127.0.0.1'");
    let replace = [
        ("'relay'@'%'", account.as_str()),
        ("orders.", &*format!("`{database}`.")),
        ("'change-me'", &*format!("'{PASSWORD}'")),
    ];
    let admin = db.mysql_pool();
    for marker in markers {
        for statement in book_sql("how-to/mysql.md", marker, &replace) {
            sqlx::raw_sql(&statement)
                .execute(&admin)
                .await
                .unwrap_or_else(|e| panic!("{statement}: {e}"));
        }
    }
    let base = db.url.split_once("://").unwrap().1;
    let host = base.split_once('@').map_or(base, |(_, host)| host);
    (format!("mysql://{user}:{PASSWORD}@{host}"), account)
}

async fn drop_mariadb_account(db: &TestOutbox, account: &str) {
    let _ = sqlx::raw_sql(&format!("DROP USER IF EXISTS {account}"))
        .execute(&db.mysql_pool())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_claim_mode_runs_with_the_books_grants() {
    init_logging();
    let db = TestOutbox::mariadb().await;
    let nats = nats_stream().await;
    let (url, account) = mariadb_account(&db, &["claim mode and binlog mode"]).await;
    let config = config_on(&url, &nats, None);
    relays_as_the_account(&config, db.service_pool(), &nats).await;

    let database = db.url.rsplit('/').next().unwrap().to_string();
    let table = format!("`{database}`.`switchyard_outbox`");
    let admin = db.mysql_pool();
    sqlx::raw_sql(&format!("REVOKE UPDATE ON {table} FROM {account}"))
        .execute(&admin)
        .await
        .unwrap();
    let grant = format!("GRANT UPDATE ON {table} TO {account}");
    a_missing_privilege_is_named(&config, &["lacks UPDATE on", grant.as_str()], async || {
        sqlx::raw_sql(&grant).execute(&admin).await.unwrap();
    })
    .await;
    drop_mariadb_account(&db, &account).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_binlog_mode_runs_with_the_books_grants() {
    init_logging();
    let db = TestOutbox::mariadb().await;
    let nats = nats_stream().await;
    // `migrate` as the schema's owner records the position.
    let owner = config_on(&db.url, &nats, Some("switchyard"));
    let (code, out, err) = run_with_config(&["migrate"], &owner).await;
    assert_eq!(code, 0, "migrate: {out}{err}");
    let (url, account) = mariadb_account(&db, &["claim mode and binlog mode", "Binlog mode, besides"]).await;
    let config = config_on(&url, &nats, Some("switchyard"));
    relays_as_the_account(&config, db.service_pool(), &nats).await;

    let database = db.url.rsplit('/').next().unwrap().to_string();
    let table = format!("`{database}`.`switchyard_binlog_positions`");
    let admin = db.mysql_pool();
    sqlx::raw_sql(&format!(
        "REVOKE SELECT, INSERT, UPDATE ON {table} FROM {account}"
    ))
    .execute(&admin)
    .await
    .unwrap();
    let grant = format!("GRANT SELECT, INSERT, UPDATE ON {table} TO {account}");
    a_missing_privilege_is_named(
        &config,
        &["lacks SELECT, INSERT, UPDATE on", grant.as_str()],
        async || {
            sqlx::raw_sql(&grant).execute(&admin).await.unwrap();
        },
    )
    .await;
    drop_mariadb_account(&db, &account).await;
}

/// A PostgreSQL role of this test's own (roles belong to the server), from
/// the book's blocks.
async fn postgres_role(db: &TestDb, markers: &[&str]) -> (String, String) {
    let role = format!("sy_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    for marker in markers {
        let block = book_sql(
            "how-to/deploy.md",
            marker,
            &[("'change-me'", &*format!("'{PASSWORD}'"))],
        );
        for statement in block {
            // The role's name, wherever the book writes `relay` as one.
            let statement = statement
                .replace("ROLE relay ", &format!("ROLE {role} "))
                .replace(" TO relay", &format!(" TO {role}"));
            let (pool, statement) =
                if statement.starts_with("CREATE ROLE") || statement.starts_with("ALTER ROLE") {
                    (switchyard_tests::postgres::server_pool().await, statement)
                } else {
                    (db.pool.clone(), statement)
                };
            sqlx::raw_sql(&statement)
                .execute(&pool)
                .await
                .unwrap_or_else(|e| panic!("{statement}: {e}"));
        }
    }
    let url = on_database(&server_url(), &db.name).replacen("postgres@", &format!("{role}:{PASSWORD}@"), 1);
    (url, role)
}

async fn drop_postgres_role(db: &TestDb, role: &str) {
    let server = switchyard_tests::postgres::server_pool().await;
    let _ = sqlx::raw_sql(&format!(
        "REASSIGN OWNED BY {role} TO postgres; DROP OWNED BY {role}"
    ))
    .execute(&db.pool)
    .await;
    let _ = sqlx::raw_sql(&format!("DROP ROLE IF EXISTS {role}"))
        .execute(&server)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_claim_mode_runs_with_the_books_grants() {
    init_logging();
    let db = fresh_db().await;
    let nats = nats_stream().await;
    let (url, role) = postgres_role(&db, &["claim mode and replication mode"]).await;
    let config = config_on(&url, &nats, None);
    relays_as_the_account(&config, (&db.pool).into(), &nats).await;

    sqlx::raw_sql(&format!("REVOKE UPDATE ON switchyard_outbox FROM {role}"))
        .execute(&db.pool)
        .await
        .unwrap();
    let grant = format!("GRANT UPDATE ON switchyard_outbox TO {role}");
    let pool = db.pool.clone();
    a_missing_privilege_is_named(
        &config,
        &["lacks UPDATE on switchyard_outbox", grant.as_str()],
        async || {
            sqlx::raw_sql(&grant).execute(&pool).await.unwrap();
        },
    )
    .await;
    drop_postgres_role(&db, &role).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_replication_mode_runs_with_the_books_grants() {
    init_logging();
    let db = fresh_db().await;
    let nats = nats_stream().await;
    let owner = config_on(&db.url, &nats, Some(&db.name));
    let (code, out, err) = run_with_config(&["migrate"], &owner).await;
    assert_eq!(code, 0, "migrate: {out}{err}");
    let (url, role) = postgres_role(
        &db,
        &["claim mode and replication mode", "Replication mode, besides"],
    )
    .await;
    let config = config_on(&url, &nats, Some(&db.name));
    relays_as_the_account(&config, (&db.pool).into(), &nats).await;
    drop_postgres_role(&db, &role).await;
}
