#!/usr/bin/env bash
# Formatting and lints, as CI runs them: rustfmt on both workspaces, clippy
# with warnings as errors on the host workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all --check
(cd plugins && cargo fmt --all --check)
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "lint: ok"
