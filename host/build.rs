//! Embeds the migrations (each directory's `<version>_<description>.sql`
//! files, as sqlx's migrator reads them) and rebuilds the crate when they or
//! the WIT contract (`bindgen!`) change. Embedding them here rather than
//! with `sqlx::migrate!` keeps sqlx's proc-macro crate, and the second copy
//! of its drivers it compiles for the build host, out of every build.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=../wit");
    let mut out = String::new();
    for (name, dir) in [
        ("POSTGRES", "../migrations/postgres"),
        ("SQLITE", "../migrations/sqlite"),
        ("MYSQL", "../migrations/mysql"),
    ] {
        println!("cargo:rerun-if-changed={dir}");
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
        let mut files: Vec<(i64, String, String)> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let file = entry.file_name().to_string_lossy().into_owned();
                let (version, rest) = file.split_once('_')?;
                let description = rest.strip_suffix(".sql")?.replace('_', " ");
                let version = version
                    .parse()
                    .unwrap_or_else(|_| panic!("{file}: a migration's name starts with its version"));
                let path = entry.path().canonicalize().expect("a migration's path");
                Some((version, description, path.display().to_string()))
            })
            .collect();
        files.sort();
        let _ = writeln!(out, "pub(crate) const {name}: &[(i64, &str, &str)] = &[");
        for (version, description, path) in files {
            let _ = writeln!(out, "    ({version}, {description:?}, include_str!({path:?})),");
        }
        out.push_str("];\n");
    }
    let target = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("migrations.rs");
    std::fs::write(target, out).expect("write the embedded migrations");
}
