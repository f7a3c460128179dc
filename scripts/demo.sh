#!/usr/bin/env bash
# One command on a fresh machine with Rust: adds the wasm32-wasip2 target if
# missing, builds the three example plugins the demo runs and a demo build
# of switchyard (profile `demo`: every crate unoptimised, no broker client
# the demo does not use, so a first build takes minutes, not a quarter of
# an hour), and runs
# `switchyard demo` (SQLite outbox, stdout and file targets: no database or
# broker needed). Arguments go to `switchyard demo`.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2
fi
binary=target/demo/switchyard
started=$SECONDS
# CI walks this script on the binary its test build made already
# (scripts/test.sh), rather than compiling the tree a second time.
if [ -n "${SWITCHYARD_DEMO_BINARY:-}" ]; then
    binary="$SWITCHYARD_DEMO_BINARY"
elif [ ! -x "$binary" ]; then
    echo "Building the demo: the example plugins, then switchyard (the first time about 5 minutes on 2 cores; cargo shows its progress)." >&2
fi
# The plugins build beside switchyard's, at the lowest priority: switchyard's
# build leaves a core idle for a while now and then (a crate compiled
# alone, a link), and the plugins' fills those gaps without slowing it.
(cd plugins && nice -n 19 cargo build --release --quiet -p route-by-type -p redact-fields -p fan-out) &
plugins=$!
trap 'kill "$plugins" 2>/dev/null || true' EXIT
[ -n "${SWITCHYARD_DEMO_BINARY:-}" ] || cargo build --profile demo --no-default-features -p switchyard
wait "$plugins"
trap - EXIT
if [ $((SECONDS - started)) -gt 5 ]; then
    echo "Built in $((SECONDS - started)) s." >&2
fi
exec "$binary" demo "$@"
