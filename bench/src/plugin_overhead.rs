//! Per-event cost of a routing plugin call, against a native router doing
//! the same work in the same run.
//!
//! ```text
//! (cd plugins && cargo build --release)
//! cargo run --release -p switchyard-bench --bin plugin-overhead [-- ITERATIONS]
//! ```
//!
//! Measures `route` on the example `route-by-type` plugin with a ~200-byte
//! JSON order document: lowering the event into the instance, the guest's
//! work, and lifting the message back, on both compilers. The native baseline
//! builds the same message in Rust; the difference is the plugin overhead.
//! The Python and JavaScript ports of route-by-type (built by
//! `scripts/plugin-toolchains.sh`) are measured too when present, with a
//! tenth of the calls: they are interpreters inside the component.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use switchyard::config::PluginConfig;
use switchyard::plugin::{Event, Message, PayloadFormat, PluginEngine, PluginVersion, Tier};

fn event() -> Event {
    let payload = serde_json::json!({
        "order_id": "order-000042",
        "customer_id": "cust-9f3a",
        "status": "created",
        "currency": "EUR",
        "total_cents": 129_900,
        "items": [{"sku": "SKU-1", "qty": 2, "price_cents": 49_950}, {"sku": "SKU-7", "qty": 1, "price_cents": 30_000}],
        "created_at": "2026-11-22T10:00:00Z"
    });
    Event {
        row_id: 42,
        event_id: uuid::Uuid::new_v4().to_string(),
        aggregate_type: "order".into(),
        aggregate_id: "order-000042".into(),
        event_type: "OrderCreated".into(),
        payload: serde_json::to_vec(&payload).unwrap_or_default(),
        payload_format: PayloadFormat::Json,
        headers: vec![(
            "traceparent".into(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        )],
        tenant: None,
        created_at_ms: 1_795_000_000_000,
        attempt: 1,
    }
}

fn native_route(event: &Event) -> Vec<Message> {
    vec![Message {
        target: "nats".to_string(),
        topic: format!("{}.{}", event.aggregate_type, event.event_type),
        key: Some(event.aggregate_id.clone()),
        payload: event.payload.clone(),
        headers: vec![("content-type".to_string(), "application/json".to_string())],
    }]
}

fn time_per_call(iterations: u32, mut call: impl FnMut()) -> Duration {
    for _ in 0..iterations / 10 {
        call();
    }
    let started = Instant::now();
    for _ in 0..iterations {
        call();
    }
    started.elapsed() / iterations
}

fn wasm(version: &PluginVersion, event: &Event, iterations: u32) -> anyhow::Result<Duration> {
    let mut instance = Some(version.checkout()?);
    let mut failed = None;
    let per_call = time_per_call(iterations, || {
        let Some(current) = instance.take() else { return };
        let (result, back) = version.route(current, event);
        if let Err(error) = &result {
            failed = Some(format!("{error:?}"));
        }
        black_box(result.ok());
        instance = back;
    });
    match failed {
        Some(error) => anyhow::bail!("plugin call failed: {error}"),
        None => Ok(per_call),
    }
}

fn main() -> anyhow::Result<()> {
    let iterations: u32 = std::env::args()
        .nth(1)
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(200_000);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let path = root.join("plugins/target/wasm32-wasip2/release/route_by_type.wasm");
    anyhow::ensure!(
        path.is_file(),
        "{} missing: run (cd plugins && cargo build --release)",
        path.display()
    );
    let config: PluginConfig = toml::from_str(&format!(
        "name = \"route-by-type\"\npath = {:?}\n[config]\ntarget = \"nats\"\ntopic = \"{{aggregate_type}}.{{event_type}}\"",
        path.display().to_string()
    ))?;
    let bytes = std::fs::read(&path)?;
    let engine = PluginEngine::new(None)?;
    let optimized = engine.load_bytes(&config, &bytes, Tier::Optimized)?;
    let baseline = engine.load_bytes(&config, &bytes, Tier::Baseline)?;
    let event = event();
    println!(
        "plugin-overhead: route-by-type@{}, payload {} bytes, {iterations} calls each",
        optimized.version(),
        event.payload.len()
    );

    let native = time_per_call(iterations, || {
        black_box(native_route(black_box(&event)));
    });
    let cranelift = wasm(&optimized, &event, iterations)?;
    let winch = wasm(&baseline, &event, iterations)?;
    let ns = |d: Duration| d.as_nanos();
    println!();
    println!("| router                                  | ns/event | overhead vs native |");
    println!("|-----------------------------------------|---------:|-------------------:|");
    println!(
        "| native Rust (baseline)                  | {:>8} |                  - |",
        ns(native)
    );
    println!(
        "| wasm, Cranelift (steady state)          | {:>8} | {:>15} ns |",
        ns(cranelift),
        ns(cranelift).saturating_sub(ns(native))
    );
    println!(
        "| wasm, Winch (just reloaded)             | {:>8} | {:>15} ns |",
        ns(winch),
        ns(winch).saturating_sub(ns(native))
    );
    for (language, file) in [("Python", "python"), ("JavaScript", "js")] {
        let path = root.join(format!("plugins/target/{file}/route_by_type.wasm"));
        if !path.is_file() {
            println!("| {language:<39} |  skipped | run scripts/plugin-toolchains.sh |");
            continue;
        }
        let config = PluginConfig {
            path: path.clone(),
            timeout_ms: 10_000,
            ..config.clone()
        };
        let started = Instant::now();
        let version = engine.load(&config)?;
        let compile = started.elapsed();
        let per_call = wasm(&version, &event, (iterations / 10).max(100))?;
        println!(
            "| {:<39} | {:>8} | {:>15} ns |",
            format!(
                "{language} ({} MB, compiled in {:.1} s)",
                std::fs::metadata(&path)?.len() / 1_000_000,
                compile.as_secs_f64()
            ),
            ns(per_call),
            ns(per_call).saturating_sub(ns(native))
        );
    }
    println!();
    let target = Duration::from_micros(3);
    println!(
        "target: at most 3 us per event on the steady-state plugin: {}",
        if cranelift <= target { "met" } else { "MISSED" }
    );
    Ok(())
}
