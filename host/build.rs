//! Rebuilds the crate when migrations or the WIT contract change: both are
//! embedded at compile time (`sqlx::migrate!`, `bindgen!`).

fn main() {
    println!("cargo:rerun-if-changed=../migrations/postgres");
    println!("cargo:rerun-if-changed=../migrations/sqlite");
    println!("cargo:rerun-if-changed=../wit");
}
