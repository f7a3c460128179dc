//! `switchyard plugin new`: writes a plugin project that builds and passes
//! `switchyard plugin test` as written, with the WIT vendored in.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// The plugin contract, vendored into every new project.
const WIT: &str = include_str!("../../../wit/switchyard.wit");
const SAMPLE_EVENT: &str = include_str!("templates/sample-event.json");
const RUST_CARGO: &str = include_str!("templates/rust/Cargo.toml.in");
const RUST_LIB: &str = include_str!("templates/rust/lib.rs.in");
const PYTHON_APP: &str = include_str!("templates/python/app.py.in");
const PYTHON_BUILD: &str = include_str!("templates/python/build.sh.in");
const JS_APP: &str = include_str!("templates/js/app.js.in");
const JS_BUILD: &str = include_str!("templates/js/build.sh.in");

/// The componentize-py release new Python projects build with.
const COMPONENTIZE_PY_VERSION: &str = "0.25.1";
/// The componentize-js release new JavaScript projects build with.
const COMPONENTIZE_JS_VERSION: &str = "0.23.0";

/// A plugin language `plugin new` can start a project in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    /// Rust with wit-bindgen, built with `cargo build --target wasm32-wasip2`.
    Rust,
    /// Python, built with componentize-py (which bundles the interpreter).
    Python,
    /// JavaScript, built with componentize-js (which bundles the engine).
    Js,
}

/// Writes the project for `name` into `parent/name` and prints the next steps.
pub(super) fn new_plugin(name: &str, lang: Lang, parent: &Path) -> anyhow::Result<()> {
    if name.is_empty()
        || !name.starts_with(|c: char| c.is_ascii_lowercase())
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
    {
        bail!("plugin name {name:?}: use lowercase letters, digits, '-' and '_', starting with a letter");
    }
    let dir = parent.join(name);
    if dir.exists() {
        bail!(
            "{} already exists; choose another name or directory",
            dir.display()
        );
    }
    let files: Vec<(PathBuf, String)> = match lang {
        Lang::Rust => vec![
            ("Cargo.toml".into(), RUST_CARGO.replace("{name}", name)),
            (
                ".cargo/config.toml".into(),
                "[build]\ntarget = \"wasm32-wasip2\"\n".into(),
            ),
            ("src/lib.rs".into(), RUST_LIB.replace("{name}", name)),
            ("wit/switchyard.wit".into(), WIT.to_string()),
            ("events/sample.json".into(), SAMPLE_EVENT.to_string()),
            (".gitignore".into(), "/target\n".into()),
        ],
        Lang::Python => vec![
            ("app.py".into(), PYTHON_APP.replace("{name}", name)),
            (
                "build.sh".into(),
                PYTHON_BUILD
                    .replace("{wasm}", &wasm_name(name))
                    .replace("{componentize_py}", COMPONENTIZE_PY_VERSION),
            ),
            ("wit/switchyard.wit".into(), WIT.to_string()),
            ("events/sample.json".into(), SAMPLE_EVENT.to_string()),
            (".gitignore".into(), "/.venv\n__pycache__/\n*.wasm\n".into()),
        ],
        Lang::Js => vec![
            ("app.js".into(), JS_APP.replace("{name}", name)),
            (
                "build.sh".into(),
                JS_BUILD
                    .replace("{wasm}", &wasm_name(name))
                    .replace("{componentize_js}", COMPONENTIZE_JS_VERSION),
            ),
            ("wit/switchyard.wit".into(), WIT.to_string()),
            ("events/sample.json".into(), SAMPLE_EVENT.to_string()),
            (".gitignore".into(), "/node_modules\n*.wasm\n".into()),
        ],
    };
    for (path, text) in &files {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    #[cfg(unix)]
    if lang != Lang::Rust {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.join("build.sh"), std::fs::Permissions::from_mode(0o755))?;
    }
    let (build, wasm) = match lang {
        Lang::Rust => (
            "rustup target add wasm32-wasip2 && cargo build --release".to_string(),
            format!("target/wasm32-wasip2/release/{}", wasm_name(name)),
        ),
        Lang::Python | Lang::Js => ("./build.sh".to_string(), wasm_name(name)),
    };
    let language = match lang {
        Lang::Rust => "Rust",
        Lang::Python => "Python",
        Lang::Js => "JavaScript",
    };
    println!("Created {} ({language} plugin). Next:", dir.display());
    println!("  cd {} && {build}", dir.display());
    println!("  switchyard plugin test {wasm} --event events/sample.json --config target=events");
    Ok(())
}

/// The component's file name: `-` becomes `_`, as Cargo does.
fn wasm_name(name: &str) -> String {
    format!("{}.wasm", name.replace('-', "_"))
}
