#!/usr/bin/env bash
# Formatting and lints, as CI runs them: rustfmt on both workspaces, the
# book's links and module map (seconds), clippy with warnings as errors on
# the host workspace, with and without its default features.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
(cd plugins && cargo fmt --all --check)
python3 scripts/docs-check.py
cargo clippy --workspace --all-targets --quiet -- -D warnings
# The demo's build leaves the Kafka client out (scripts/demo.sh).
cargo clippy -p switchyard --no-default-features --all-targets --quiet -- -D warnings
echo "lint: ok"
