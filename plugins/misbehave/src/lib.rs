//! Test plugin that misbehaves on purpose, so tests can show that the relay's
//! sandbox contains it. The `mode` config key picks the misbehaviour:
//!
//! | mode             | what `route` (or `init`) does                                   |
//! |------------------|------------------------------------------------------------------|
//! | `loop`           | spins forever                                                    |
//! | `alloc`          | allocates until memory runs out                                  |
//! | `trap`           | hits `unreachable`                                               |
//! | `huge`           | returns a 50 MiB payload                                         |
//! | `unknown-target` | names a target that is not configured                           |
//! | `empty-topic`    | returns an empty topic                                           |
//! | `probe`          | reports what the sandbox lets it see (env, files, clock)         |
//! | `transient`      | refuses with a transient error (retry later)                     |
//! | `print`          | prints to stdout and stderr, then routes normally                |
//! | `panic`          | panics with a message                                            |
//! | `unwrap`         | unwraps a `None` (a failed `unwrap` is a panic too)              |
//! | `nul-topic`      | returns a topic with a NUL in it                                 |
//! | `huge-topic`     | returns a 100 KB topic                                           |
//! | `control-header` | returns a header whose name has a control character              |
//! | `many-headers`   | returns 5,000 headers                                            |
//! | `huge-header`    | returns a 4 MB header value                                      |
//! | `init-trap`      | traps in `init`                                                  |
//! | `init-fail`      | returns an error from `init`                                     |
//! | `init-loop`      | spins forever in `init`                                          |
//! | `init-slow`      | spins `init_spins` times in `init` (the clock is frozen), then routes |
//! | `init-print`     | prints in `init`, then routes normally                           |
//!
//! Every message goes to the target named by the `target` key, topic `test.<mode>`.

use std::sync::OnceLock;

wit_bindgen::generate!({ path: "../../wit", world: "router" });

struct Config {
    mode: String,
    target: String,
}

static CONFIG: OnceLock<Config> = OnceLock::new();

struct Misbehave;

impl Guest for Misbehave {
    fn init(config: String) -> Result<(), String> {
        let value: serde_json::Value = serde_json::from_str(&config).map_err(|e| e.to_string())?;
        let get = |key: &str| value.get(key).and_then(|v| v.as_str()).unwrap_or("").to_string();
        let config = Config {
            mode: get("mode"),
            target: get("target"),
        };
        match config.mode.as_str() {
            "init-trap" => core::arch::wasm32::unreachable(),
            "init-fail" => return Err("init-fail mode refuses to start".to_string()),
            "init-loop" => {
                let mut n: u64 = 0;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "init-slow" => {
                let spins = value
                    .get("init_spins")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or(0);
                let mut n: u64 = 0;
                for _ in 0..spins {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "init-print" => {
                println!("init-print: hello from init on stdout");
                eprintln!("init-print: hello from init on stderr");
            }
            _ => {}
        }
        let _ = CONFIG.set(config);
        Ok(())
    }

    fn route(event: Event) -> Result<Vec<Message>, Refusal> {
        let config = CONFIG.get().ok_or_else(|| Refusal::Permanent("no init".into()))?;
        let mut message = Message {
            target: config.target.clone(),
            topic: format!("test.{}", config.mode),
            key: Some(event.aggregate_id.clone()),
            payload: event.payload,
            headers: Vec::new(),
        };
        match config.mode.as_str() {
            "loop" => {
                let mut n: u64 = 0;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            "alloc" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            "trap" => core::arch::wasm32::unreachable(),
            "huge" => message.payload = vec![b'x'; 50 * 1024 * 1024],
            "unknown-target" => message.target = "no-such-target".to_string(),
            "empty-topic" => message.topic = String::new(),
            "transient" => return Err(Refusal::Transient("downstream lookup unavailable".to_string())),
            "print" => {
                println!("print: routing {}", event.event_id);
                eprintln!("print: a line on stderr for {}", event.event_id);
            }
            "panic" => panic!("misbehave panicked on purpose for {}", event.aggregate_id),
            "unwrap" => {
                let missing: Option<u32> = std::hint::black_box(None);
                message.topic = missing.unwrap().to_string();
            }
            "nul-topic" => message.topic = "test.nul\u{0}topic".to_string(),
            "huge-topic" => message.topic = format!("test.{}", "x".repeat(100 * 1024)),
            "control-header" => message.headers.push(("x-bad\u{7}".to_string(), "v".to_string())),
            "many-headers" => {
                message.headers = (0..5000).map(|i| (format!("x-h{i}"), "v".to_string())).collect();
            }
            "huge-header" => message
                .headers
                .push(("x-huge".to_string(), "v".repeat(4 * 1024 * 1024))),
            "probe" => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(u64::MAX);
                let report = serde_json::json!({
                    "env_vars": std::env::vars().count(),
                    "read_root": std::fs::read_dir("/").is_ok(),
                    "read_tmp": std::fs::read("/etc/hostname").is_ok(),
                    "clock_secs": now,
                });
                message.payload = report.to_string().into_bytes();
            }
            _ => {}
        }
        Ok(vec![message])
    }
}

export!(Misbehave);
