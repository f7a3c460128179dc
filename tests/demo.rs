//! `switchyard demo` runs to completion with nothing but the binary and the
//! example plugins, and shows the committed orders and not the rolled-back one.

use std::process::Command;

use switchyard_tests::plugins::plugin;

#[test]
fn the_demo_publishes_committed_orders_and_not_the_rolled_back_one() {
    let plugins = plugin("route_by_type").parent().unwrap().to_path_buf();
    let dir = std::env::temp_dir().join(format!("sy-demo-{}", uuid::Uuid::new_v4().simple()));
    let output = Command::new(env!("CARGO_BIN_EXE_relay-process"))
        .args(["demo", "--dir"])
        .arg(&dir)
        .arg("--plugins")
        .arg(&plugins)
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "demo failed:\n{stdout}\n{stderr}");

    // The console target printed every committed event, card numbers masked.
    for order in ["ORD-1", "ORD-2", "ORD-3", "ORD-4"] {
        assert!(
            stdout.contains(&format!("[console] orders.created  key={order}")),
            "{order} created:\n{stdout}"
        );
        assert!(
            stdout.contains(&format!("[console] payments.OrderPaid  key={order}")),
            "{order} paid"
        );
    }
    assert!(
        !stdout.contains("4111111111111111"),
        "card numbers never leave unmasked"
    );
    for order in ["ORD-1", "ORD-2", "ORD-4"] {
        assert!(
            stdout.contains(&format!("[console] orders.OrderShipped  key={order}")),
            "{order} shipped"
        );
    }
    assert!(
        !stdout.contains("orders.OrderShipped  key=ORD-3"),
        "the rolled-back shipment is never published"
    );
    assert!(stdout.contains("11 of 11 events published"), "{stdout}");

    // Fan-out: every new order also went to the archive file, as JSON lines.
    let archive = std::fs::read_to_string(dir.join("archive.jsonl")).expect("archive file");
    let lines: Vec<serde_json::Value> = archive
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for (line, order) in lines.iter().zip(["ORD-1", "ORD-2", "ORD-3", "ORD-4"]) {
        assert_eq!(line["target"], "archive");
        assert_eq!(line["topic"], "orders-archive");
        assert_eq!(line["key"], order);
        assert_eq!(line["payload"]["order_id"], order);
        assert!(line["headers"]["Switchyard-Event-Id"].is_string());
    }
    let _ = std::fs::remove_dir_all(dir);
}
