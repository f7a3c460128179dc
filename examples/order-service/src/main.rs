//! A sample order service. Each order change updates the `orders` table and
//! inserts its event into `switchyard_outbox` in the same transaction: both
//! commit or neither does, which is the whole point of an outbox.
//!
//! Works on PostgreSQL and on the SQLite outbox of the embedded default; the
//! URL scheme decides.
//!
//! ```text
//! cargo run -p order-service -- --database-url postgres://postgres@127.0.0.1:55432/postgres --orders 5
//! cargo run -p order-service -- --database-url sqlite:///tmp/outbox.db --orders 5
//! ```

use clap::Parser;
use serde_json::json;
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, Executor};

/// Places orders, pays and ships them, writing outbox events transactionally.
#[derive(Parser)]
struct Args {
    /// PostgreSQL URL (the database `switchyard migrate` prepared).
    #[arg(long, env = "SWITCHYARD_DATABASE_URL")]
    database_url: String,
    /// How many orders to place.
    #[arg(long, default_value_t = 5)]
    orders: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    sqlx::any::install_default_drivers();
    let pool = AnyPoolOptions::new()
        .max_connections(2)
        .connect(&args.database_url)
        .await?;
    // Placeholders differ: $1 on PostgreSQL, ?1 on SQLite.
    let sqlite = args.database_url.starts_with("sqlite:");
    pool.execute(
        "CREATE TABLE IF NOT EXISTS orders (
            id TEXT PRIMARY KEY, status TEXT NOT NULL, total_cents BIGINT NOT NULL,
            updated_at TEXT)",
    )
    .await?;
    let run = uuid::Uuid::new_v4().simple().to_string();
    for n in 0..args.orders {
        let order = format!("order-{}-{n}", &run[..6]);
        let total = 1999 + 100 * n as i64;
        change(
            &pool,
            sqlite,
            &order,
            "OrderCreated",
            total,
            json!({"order_id": order, "total_cents": total, "items": n + 1}),
            true,
        )
        .await?;
        change(
            &pool,
            sqlite,
            &order,
            "OrderPaid",
            total,
            json!({"order_id": order, "card": {"number": "4111111111111111", "brand": "visa"}, "internal_note": "manual review skipped"}),
            true,
        )
        .await?;
        // Every third shipment fails in the business logic and rolls back:
        // its event must never be published.
        let ok = n % 3 != 2;
        change(
            &pool,
            sqlite,
            &order,
            "OrderShipped",
            total,
            json!({"order_id": order, "carrier": "dhl"}),
            ok,
        )
        .await?;
        println!(
            "{order}: created, paid, {}",
            if ok { "shipped" } else { "shipping rolled back" }
        );
    }
    Ok(())
}

async fn change(
    pool: &AnyPool,
    sqlite: bool,
    order: &str,
    event_type: &str,
    total: i64,
    payload: serde_json::Value,
    commit: bool,
) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    let sql = |pg: &'static str| {
        if sqlite {
            pg.replace('$', "?")
        } else {
            pg.to_string()
        }
    };
    sqlx::query(&sql(
        "INSERT INTO orders (id, status, total_cents) VALUES ($1, $2, $3)
         ON CONFLICT (id) DO UPDATE SET status = EXCLUDED.status",
    ))
    .bind(order)
    .bind(event_type)
    .bind(total)
    .execute(&mut *tx)
    .await?;
    // JSON goes in as text and is cast on PostgreSQL: the Any driver has no json type.
    let outbox = if sqlite {
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('order', ?1, ?2, ?3, ?4)"
    } else {
        "INSERT INTO switchyard_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('order', $1, $2, $3::jsonb, $4::jsonb)"
    };
    let trace = format!(
        "00-{}-{}-01",
        uuid::Uuid::new_v4().simple(),
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    );
    sqlx::query(outbox)
        .bind(order)
        .bind(event_type)
        .bind(payload.to_string())
        .bind(json!({ "traceparent": trace }).to_string())
        .execute(&mut *tx)
        .await?;
    if commit {
        tx.commit().await?;
    } else {
        tx.rollback().await?;
    }
    Ok(())
}
