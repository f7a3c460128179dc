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
