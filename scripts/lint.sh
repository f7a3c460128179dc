#!/usr/bin/env bash
# Formatting and lints, as CI runs them: rustfmt on both workspaces, the
# book's links and module map (seconds), clippy with warnings as errors on
# the host workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
(cd plugins && cargo fmt --all --check)
python3 scripts/docs-check.py
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "lint: ok"
