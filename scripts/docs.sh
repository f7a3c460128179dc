#!/usr/bin/env bash
# The book: checks its links, its SUMMARY and the module map
# (scripts/docs-check.py) and that every config key, variable, metric and
# flag it names exists (scripts/docs-claims.py), then builds it with mdBook
# into target/book.
# Installs mdBook (from the crate registry, without its server and watcher:
# about 2.5 minutes on 2 cores) when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

mdbook_version=0.5.4
if ! mdbook --version 2>/dev/null | grep -q "v$mdbook_version"; then
    echo "docs: installing mdBook $mdbook_version"
    cargo install --locked --quiet mdbook --version "$mdbook_version" --no-default-features --features search
fi
python3 scripts/docs-check.py
# Every config key, variable, metric and flag the pages name exists (the
# config schema comes from a built binary: CI passes the test build's).
binary="${SWITCHYARD_BIN:-$PWD/target/debug/switchyard}"
[ -x "$binary" ] || cargo build --quiet -p switchyard --bin switchyard
python3 scripts/docs-claims.py "$binary"
mdbook build docs 2>&1 | grep -v "^ INFO" || true
test -f target/book/index.html
echo "docs: book built in target/book"
