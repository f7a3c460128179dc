//! Per-event cost of a routing plugin call, against a native router doing
//! the same work in the same run.
//!
//! ```text
//! (cd plugins && cargo build --release)
//! cargo run --release -p switchyard-bench --bin plugin-overhead [-- ITERATIONS]
//! ```
//!
//! Measures the example `route-by-type` plugin with a ~200-byte JSON order
//! document: lowering the event into the instance, the guest's work, and
//! lifting the message back, on both compilers. The native baseline builds
//! the same message in Rust; the difference is the plugin overhead. Each
//! plugin is measured single (its router build, one `route` call per event)
//! and batched (its batch-router build, one `route-batch` call per 500
//! events, as the relay calls it for a claimed batch). The Python and
//! JavaScript ports (built by `scripts/plugin-toolchains.sh`) are measured
//! too when present, with a tenth of the calls: they are interpreters
//! inside the component.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use switchyard::config::PluginConfig;
use switchyard::plugin::{Event, Message, PayloadFormat, PluginEngine, PluginVersion, Tier};

/// Events per `route-batch` call: the relay's default batch size.
const BATCH: usize = 500;

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

/// Per-event time when `events` events go through batch calls of [`BATCH`].
fn wasm_batched(version: &PluginVersion, event: &Event, events: u32) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        version.batched(),
        "{} does not export route-batch",
        version.path().display()
    );
    let batch = vec![event.clone(); BATCH];
    let mut instance = Some(version.checkout()?);
    let mut failed = None;
    let calls = (events / BATCH as u32).max(20);
    let until = Instant::now() + Duration::from_secs(3600);
    let per_call = time_per_call(calls, || {
        let mut plugin_calls = 0;
        let (answers, back) = version.route_many(instance.take(), None, &batch, &[], until, &mut |_, _| {
            plugin_calls += 1
        });
        if plugin_calls != 1 || answers.iter().any(|a| !matches!(a, Some(Ok(_)))) {
            failed = Some(format!(
                "{plugin_calls} calls; first answer {:?}",
                answers.first()
            ));
        }
        black_box(answers);
        instance = back;
    });
    match failed {
        Some(error) => anyhow::bail!("batch call failed: {error}"),
        None => Ok(per_call / BATCH as u32),
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
    let batch_path = root.join("plugins/target/wasm32-wasip2/release/route_by_type_batch.wasm");
    let batch_bytes = std::fs::read(&batch_path)?;
    let batch_config = PluginConfig {
        path: batch_path,
        ..config.clone()
    };
    let engine = PluginEngine::new(None)?;
    let optimized = engine.load_bytes(&config, &bytes, Tier::Optimized)?;
    let baseline = engine.load_bytes(&config, &bytes, Tier::Baseline)?;
    let optimized_batch = engine.load_bytes(&batch_config, &batch_bytes, Tier::Optimized)?;
    let baseline_batch = engine.load_bytes(&batch_config, &batch_bytes, Tier::Baseline)?;
    let event = event();
    println!(
        "plugin-overhead: route-by-type@{}, payload {} bytes, {iterations} events each (a tenth for Python and JavaScript), batches of {BATCH}",
        optimized.version(),
        event.payload.len()
    );

    let native = time_per_call(iterations, || {
        black_box(native_route(black_box(&event)));
    });
    let cranelift = wasm(&optimized, &event, iterations)?;
    let cranelift_batched = wasm_batched(&optimized_batch, &event, iterations)?;
    let winch = wasm(&baseline, &event, iterations)?;
    let winch_batched = wasm_batched(&baseline_batch, &event, iterations)?;
    let ns = |d: Duration| d.as_nanos();
    println!();
    println!(
        "| router                                  | single: ns/event | batched: ns/event | single / batched |"
    );
    println!(
        "|-----------------------------------------|-----------------:|------------------:|-----------------:|"
    );
    let row = |name: &str, single: Duration, batched: Duration| {
        println!(
            "| {name:<39} | {:>16} | {:>17} | {:>15.1}x |",
            ns(single),
            ns(batched),
            single.as_secs_f64() / batched.as_secs_f64().max(1e-12)
        );
    };
    println!(
        "| {:<39} | {:>16} | {:>17} | {:>16} |",
        "native Rust (baseline)",
        ns(native),
        "-",
        "-"
    );
    row(
        "Rust wasm, Cranelift (steady state)",
        cranelift,
        cranelift_batched,
    );
    row("Rust wasm, Winch (just reloaded)", winch, winch_batched);
    let mut python_batched = None;
    for (language, file) in [("Python", "python"), ("JavaScript", "js")] {
        let single_path = root.join(format!("plugins/target/{file}/route_by_type.wasm"));
        let batch_path = root.join(format!("plugins/target/{file}/route_by_type_batch.wasm"));
        if !single_path.is_file() || !batch_path.is_file() {
            println!("| {language:<39} | skipped: run scripts/plugin-toolchains.sh |");
            continue;
        }
        let load = |path: &PathBuf| -> anyhow::Result<(PluginVersion, Duration)> {
            let config = PluginConfig {
                path: path.clone(),
                timeout_ms: 10_000,
                ..config.clone()
            };
            let started = Instant::now();
            let version = engine.load(&config)?;
            Ok((version, started.elapsed()))
        };
        let (single, compile) = load(&single_path)?;
        let (batch, _) = load(&batch_path)?;
        let events = (iterations / 10).max(BATCH as u32 * 20);
        let per_call = wasm(&single, &event, (iterations / 10).max(100))?;
        let per_event = wasm_batched(&batch, &event, events)?;
        if language == "Python" {
            python_batched = Some(per_event);
        }
        row(
            &format!(
                "{language} ({} MB, compiled in {:.1} s)",
                std::fs::metadata(&single_path)?.len() / 1_000_000,
                compile.as_secs_f64()
            ),
            per_call,
            per_event,
        );
    }
    println!();
    let target = Duration::from_micros(3);
    println!(
        "target: at most 3 us per event on the steady-state plugin: {}",
        if cranelift <= target { "met" } else { "MISSED" }
    );
    if let Some(python) = python_batched {
        println!(
            "target: Python at most 50 us per event batched: {} ({:.1} us)",
            if python <= Duration::from_micros(50) {
                "met"
            } else {
                "MISSED"
            },
            python.as_secs_f64() * 1e6
        );
    }
    Ok(())
}
