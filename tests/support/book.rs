//! The book's shell snippets, read from its pages and run as a reader would
//! type them, so a getting-started page cannot drift from what works.

use std::path::{Path, PathBuf};

/// Every ```` ```sh ```` block of `page` (a path under `docs/src`), in order.
///
/// # Panics
/// When the page cannot be read.
#[must_use]
pub fn snippets(page: &str) -> Vec<String> {
    fenced(page, &["```sh", "```bash", "```shell"])
}

/// The blocks of `page` opened by one of `fences`, each line without the
/// indentation of its fence.
fn fenced(page: &str, fences: &[&str]) -> Vec<String> {
    let path = crate::workspace_root().join("docs/src").join(page);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        match &mut current {
            None if fences.contains(&trimmed) => current = Some((line.len() - trimmed.len(), String::new())),
            Some((_, block)) if trimmed == "```" => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            Some((indent, block)) => {
                let cut = line.len() - line.trim_start().len();
                block.push_str(&line[cut.min(*indent)..]);
                block.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// The one ```` ```sql ```` block of `page` that contains `marker` (a
/// block in a list item may be indented: its lines are read without it).
///
/// # Panics
/// When no block, or more than one, contains it.
#[must_use]
pub fn sql_block(page: &str, marker: &str) -> String {
    let found: Vec<String> = fenced(page, &["```sql"])
        .into_iter()
        .filter(|block| block.contains(marker))
        .collect();
    assert_eq!(found.len(), 1, "{page}: one sql block with {marker:?}");
    found.into_iter().next().unwrap_or_default()
}

/// The one snippet of `page` that contains `marker`.
///
/// # Panics
/// When no snippet, or more than one, contains it.
#[must_use]
pub fn snippet(page: &str, marker: &str) -> String {
    let found: Vec<String> = snippets(page)
        .into_iter()
        .filter(|s| s.contains(marker))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{page}: one sh snippet with {marker:?}, found {found:?}"
    );
    found.into_iter().next().unwrap_or_default()
}

/// Runs `script` with bash (`-euo pipefail`) in `dir`, with `switchyard`
/// on the PATH as the binary `switchyard` names (the test's
/// `env!("CARGO_BIN_EXE_relay-process")`): exit code, stdout, stderr.
///
/// # Panics
/// When bash cannot be started.
pub async fn run(script: &str, dir: &Path, switchyard: &str, env: &[(&str, &Path)]) -> (i32, String, String) {
    let bin = dir.join(".book-bin");
    std::fs::create_dir_all(&bin).expect("a bin directory");
    let link = bin.join("switchyard");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(switchyard, &link).expect("switchyard on the PATH");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths: Vec<PathBuf> = vec![bin];
    paths.extend(std::env::split_paths(&path));
    let output = tokio::process::Command::new("bash")
        .args(["-euo", "pipefail", "-c", script])
        .current_dir(dir)
        .env("PATH", std::env::join_paths(paths).expect("a PATH"))
        .env("SWITCHYARD_LOG", "warn")
        // A user's shell lints nothing: CI's clippy settings for this
        // workspace must not reach a project a page builds.
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CLIPPY_ARGS")
        .envs(env.iter().map(|(k, v)| (*k, *v)))
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("bash runs");
    crate::outcome(&output)
}
