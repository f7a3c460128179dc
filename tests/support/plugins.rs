//! Builds the example plugins once per test binary and hands out their paths.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// Path to a built example plugin, e.g. `plugin("route_by_type")`.
///
/// # Panics
/// With an actionable message when the wasm32-wasip2 target is missing or the build fails.
pub fn plugin(name: &str) -> PathBuf {
    let dir = BUILT
        .get_or_init(build)
        .as_ref()
        .unwrap_or_else(|e| panic!("{e}"));
    let path = dir.join(format!("{name}.wasm"));
    assert!(path.is_file(), "plugin {} was not built", path.display());
    path
}

fn build() -> Result<PathBuf, String> {
    let plugins = super::workspace_root().join("plugins");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let output = Command::new(cargo)
        .args(["build", "--release", "--quiet"])
        // The same build as scripts/test.sh's, so it is found fresh.
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CLIPPY_ARGS")
        .current_dir(&plugins)
        .output()
        .map_err(|e| format!("cannot run cargo to build plugins: {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let hint = if stderr.contains("wasm32-wasip2") {
            "\nhint: rustup target add wasm32-wasip2 (scripts/test.sh does this)"
        } else {
            ""
        };
        return Err(format!("building plugins failed:\n{stderr}{hint}"));
    }
    Ok(plugins.join("target/wasm32-wasip2/release"))
}

/// The same component with a custom section appended: behaves identically,
/// hashes differently, so the relay sees a new version.
pub fn with_custom_section(component: &[u8], tag: u32) -> Vec<u8> {
    fn leb128(mut value: usize, out: &mut Vec<u8>) {
        loop {
            let byte = (value & 0x7f) as u8;
            value >>= 7;
            if value == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }
    let name = b"switchyard-test-version";
    let data = tag.to_le_bytes();
    let mut body = Vec::new();
    leb128(name.len(), &mut body);
    body.extend_from_slice(name);
    body.extend_from_slice(&data);
    let mut out = component.to_vec();
    out.push(0); // custom section id
    leb128(body.len(), &mut out);
    out.extend_from_slice(&body);
    out
}

/// Writes `bytes` to `path` the way deploy tools should: a temp file in the
/// same directory, then an atomic rename over the target.
pub fn replace_atomically(path: &std::path::Path, bytes: &[u8]) {
    let tmp = path.with_extension("wasm.tmp");
    std::fs::write(&tmp, bytes).expect("write temp plugin");
    std::fs::rename(&tmp, path).expect("rename plugin");
}
