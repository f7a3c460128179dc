#!/usr/bin/env bash
# The whole test suite, from a fresh machine with Rust: installs what is
# missing (apt packages, the wasm32-wasip2 target, the tansu broker), starts
# PostgreSQL, nats-server, tansu and RabbitMQ on loopback, builds the example
# plugins (Rust, and the Python port through scripts/plugin-toolchains.sh),
# checks deploy/ (scripts/deploy-check.sh) and the book (scripts/docs.sh),
# builds the container image
# (scripts/image.sh; SWITCHYARD_IMAGE names a ready one instead) and runs
# every test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's time, printed as a table at the end (every change to the
# suite is judged on it): `mark NAME` ends the step before and starts NAME.
timings=()
step_name=""
step_started=$SECONDS
mark() {
    if [ -n "$step_name" ]; then timings+=("$step_name $((SECONDS - step_started))"); fi
    step_name="$1"
    step_started=$SECONDS
}
print_timings() {
    mark ""
    echo "== timings (s)"
    printf '%s\n' "${timings[@]}" | awk '{ printf "  %-22s %6d\n", $1, $2; total += $2 } END { printf "  %-22s %6d\n", "total", total }'
}
mark services

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2
fi

# Assigned first so that a failed start stops this script (set -e).
services_env="$(scripts/services.sh start)"
eval "$services_env"

# A run killed midway may leave the commit hold of tests/replication.rs
# (a synchronous standby nobody is) on the shared server.
psql "$DATABASE_URL" -qAt -c "ALTER SYSTEM RESET synchronous_standby_names" >/dev/null
psql "$DATABASE_URL" -qAt -c "SELECT pg_reload_conf()" >/dev/null

# Test databases are dropped by the tests; a run killed midway leaves some,
# and their replication slots (a database with a slot cannot be dropped).
for server in "$DATABASE_URL" "$SWITCHYARD_PG_TLS_URL"; do
    psql "$server" -qAt -c "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database LIKE 'sy\_%' AND active_pid IS NOT NULL" >/dev/null
    sleep 0.5
    psql "$server" -qAt -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database LIKE 'sy\_%' AND NOT active" >/dev/null
    psql "$server" -qAt -c "SELECT 'DROP DATABASE IF EXISTS ' || quote_ident(datname) || ' WITH (FORCE);' FROM pg_database WHERE datname LIKE 'sy\_%'" \
        | psql "$server" -q >/dev/null
done

mark plugins
echo "== plugins (wasm32-wasip2)"
(cd plugins && cargo build --release --quiet)
scripts/plugin-toolchains.sh
host="$(rustc -vV | sed -n 's/^host: //p')"
(cd plugins && cargo test --quiet -p switchyard-plugin-common --target "$host")

mark demo
echo "== demo (the README's first command, on its own build)"
scripts/demo.sh --dir "$(mktemp -d)" | tail -3

mark deploy
echo "== deploy (manifests, alert rules, systemd unit)"
scripts/deploy-check.sh

mark docs
echo "== docs (the book, its links and module map)"
scripts/docs.sh

# The image tests/container.rs runs (a release build), unless one is named.
if [ -z "${SWITCHYARD_IMAGE:-}" ]; then
    mark image
    echo "== image"
    scripts/image.sh build
    export SWITCHYARD_IMAGE=switchyard:dev
fi

mark tests
echo "== relay"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# Every test binary runs even after one fails, and the summary is printed
# either way: a red run says everything that failed, not the first binary.
status=0
args=()
for arg in "$@"; do [ "$arg" = --no-fail-fast ] || args+=("$arg"); done
cargo test --workspace --lib --bins --tests --no-fail-fast ${args[@]+"${args[@]}"} 2>&1 | tee "$log" || status=$?
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     /^test .* \.\.\. FAILED$/ { failed[++n] = $2 }
     END { printf "summary: %d passed, %d failed\n", p, f; for (i = 1; i <= n; i++) printf "failed: %s\n", failed[i] }' "$log"
# Why each one failed, after the summary: a CI log is often read from its
# end, and the panic sits above thousands of lines of other tests' output.
awk '/^---- .* stdout ----$/ { name = $2; next }
     name != "" && / panicked at / { print "why " name ":"; shown = 0; grab = 1 }
     grab && /^$/ { grab = 0 }
     grab && shown < 6 { print "  " $0; shown++ }
     /^failures:$/ { name = "" }' "$log" | cut -c1-400
# Each test binary's own time, as its runner reports it (the build is the
# rest of the tests step).
awk '/^     Running / { name = $NF; gsub(/[()]/, "", name); sub(/.*\//, "", name); sub(/-[0-9a-f]+$/, "", name) } /^test result:/ { for (i = 1; i <= NF; i++) if ($i == "in") t = $(i+1); sub(/s$/, "", t); if (name != "") printf "  %-32s %8.1f s\n", name, t; name = "" }' "$log" \
    | sort -k2 -n -r | head -30
print_timings
exit "$status"
