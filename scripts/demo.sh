#!/usr/bin/env bash
# One command on a fresh machine with Rust: adds the wasm32-wasip2 target if
# missing, builds the example plugins and runs `switchyard demo` (SQLite
# outbox, stdout and file targets: no database or broker needed).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2
fi
(cd plugins && cargo build --release --quiet)
exec cargo run --quiet -p switchyard -- demo "$@"
