#!/usr/bin/env bash
# The whole test suite, from a fresh machine with Rust: builds the tree
# once (the tests, and the relay binary every later step runs; with
# SWITCHYARD_CLIPPY=1 clippy lints that same build), installs what is
# missing (apt packages, the wasm32-wasip2 target, the tansu broker),
# starts PostgreSQL, nats-server, tansu, RabbitMQ and the Pub/Sub emulator
# on loopback, builds the example plugins (Rust, and the Python and
# JavaScript ports through scripts/plugin-toolchains.sh), walks the demo on
# the test build, checks deploy/ (scripts/deploy-check.sh) and the book
# (scripts/docs.sh), walks the README's production lines on a container
# image assembled from that same build (scripts/production-walk.sh;
# SWITCHYARD_IMAGE names a ready image instead) and runs every test: with cargo-nextest when it is installed (a
# process per test, all binaries in one pool, .config/nextest.toml), else
# with cargo test. Arguments go to the test runner.
#
#   scripts/test.sh [ARGS]         everything, as CI runs it
#   scripts/test.sh quick [ARGS]   the contributor's loop: unit tests and the
#                                  core promises on SQLite, PostgreSQL and NATS
#                                  (claims, replication mode, the relay end to
#                                  end, the config); no demo, deploy, book or
#                                  image steps
set -euo pipefail
cd "$(dirname "$0")/.."
quick=""
if [ "${1:-}" = quick ]; then
    quick=1
    shift
fi

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
mark build
# The services and the plugins (wasm32-wasip2, a workspace of their own)
# need nothing from the host build: they go on beside it, on the core its
# serial stretches leave idle, and are waited for after it.
beside="$(mktemp -d)"
scripts/services.sh start >"$beside/services.env" 2>"$beside/services.log" &
services_pid=$!
(
    set -e
    if ! rustup target list --installed | grep -qx wasm32-wasip2; then
        rustup target add wasm32-wasip2
    fi
    (cd plugins && cargo build --release --quiet)
    [ -n "$quick" ] || scripts/plugin-toolchains.sh
    host="$(rustc -vV | sed -n 's/^host: //p')"
    (cd plugins && cargo test --quiet -p switchyard-plugin-common --target "$host")
) >"$beside/plugins.log" 2>&1 &
plugins_pid=$!
trap 'kill "$plugins_pid" 2>/dev/null || true; rm -rf "$beside"' EXIT
echo "== build (once: the tests, and the relay binary the next steps run)"
# No binary holds a test: `--bins` would only compile each one again as a
# test harness. The tests package's own binaries (relay-process) are built
# for its integration tests all the same.
targets=(--workspace --lib --tests)
# .config/nextest.toml needs nextest 0.9.91 (test priorities); an older
# one, or none, means cargo test.
runner=cargo
nextest_version="$(cargo nextest --version 2>/dev/null | awk 'NR == 1 { print $2 }')" || true
if [ -n "$nextest_version" ] && [ "$(printf '0.9.91\n%s\n' "$nextest_version" | sort -V | sed -n 1p)" = 0.9.91 ]; then
    runner=nextest
fi
# With SWITCHYARD_CLIPPY, every cargo command of this script that builds
# the workspace runs with these: clippy-driver records CLIPPY_ARGS as an
# input of each crate it compiles, so a cargo command without it would
# compile the workspace's crates again (80 s in CI).
cargo_env=()
if [ -n "${SWITCHYARD_CLIPPY:-}" ]; then
    cargo_env=(RUSTC_WORKSPACE_WRAPPER="$(rustc --print sysroot)/bin/clippy-driver"
        CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__")
    # Clippy as the compiler of the workspace's own crates, warnings as
    # errors: this one build is also `scripts/lint.sh`'s clippy run, every
    # target included, instead of a second pass over the dependency tree.
    # A crate built before without it is not linted again (CI builds from
    # a clean clone).
    echo "   (clippy -D warnings on every workspace target)"
    env "${cargo_env[@]}" cargo build --workspace --all-targets --quiet --timings
    echo "   clippy build done at $((SECONDS - step_started)) s"
    python3 scripts/build-units.py target/cargo-timings/cargo-timing.html
fi
env ${cargo_env[@]+"${cargo_env[@]}"} cargo test "${targets[@]}" --no-run --quiet
echo "   test build done at $((SECONDS - step_started)) s"
# The build scripts/demo.sh makes (no default features) compiles, and with
# SWITCHYARD_CLIPPY lints clean; checked only, no code generated. It goes
# on beside the light steps below (demo, deploy, docs, the walk) and is
# waited for before the tests, which it must not slow.
check_pid=""
if [ -z "$quick" ]; then
    (env ${cargo_env[@]+"${cargo_env[@]}"} cargo check -p switchyard --no-default-features --lib --bins --quiet) \
        >"$beside/no-default.log" 2>&1 &
    check_pid=$!
fi
relay="$PWD/target/debug/relay-process"

mark services
services_status=0
wait "$services_pid" || services_status=$?
cat "$beside/services.log" >&2
[ "$services_status" = 0 ] || { echo "test: the services did not start" >&2; exit 1; }
eval "$(cat "$beside/services.env")"

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
echo "== plugins (wasm32-wasip2; built beside the host build)"
plugins_status=0
wait "$plugins_pid" || plugins_status=$?
cat "$beside/plugins.log"
[ "$plugins_status" = 0 ] || { echo "test: the plugins did not build" >&2; exit 1; }


# What the demo and the tests write to the temporary directory (SQLite
# outboxes, configs, brokers' stores: thousands of files a run) goes under
# one directory removed at the end, so that runs do not fill the disk. Not
# for the services: they outlive this script on a developer's machine.
scratch="$(mktemp -d /tmp/switchyard-run.XXXXXX)"
trap 'kill "$plugins_pid" 2>/dev/null || true; rm -rf "$beside" "$scratch"' EXIT

if [ -n "$quick" ]; then
    export SWITCHYARD_IMAGE=""
    # The core promises: what users lose if they break.
    core='kind(lib) | test(/^(claim|replication|relay_sqlite|relay_nats|config)::/)'
    if [ "$runner" = nextest ]; then set -- -E "$core" "$@"; else set -- -- claim:: replication:: relay_sqlite:: relay_nats:: config:: "$@"; fi
else
    mark demo
    echo "== demo (the README's first command, on the test build's binary)"
    SWITCHYARD_DEMO_BINARY="$relay" scripts/demo.sh --dir "$scratch/demo" | tail -3

    mark deploy
    echo "== deploy (manifests, alert rules, systemd unit)"
    SWITCHYARD_BIN="$relay" scripts/deploy-check.sh

    mark docs
    echo "== docs (the book: links, module map, the names it uses; mdBook)"
    SWITCHYARD_BIN="$relay" scripts/docs.sh

    # The README's production lines, for each overlay (as written, but for
    # the $EDITOR edit and the lines that need a cluster), on the image
    # tests/container.rs runs: assembled from the same build and left as
    # switchyard:test, unless one is named.
    mark production
    echo "== the README's production lines (scripts/production-walk.sh)"
    if [ -z "${SWITCHYARD_IMAGE:-}" ]; then
        IMAGE=switchyard:test scripts/production-walk.sh --binary "$relay"
        export SWITCHYARD_IMAGE=switchyard:test
    else
        scripts/production-walk.sh --image "$SWITCHYARD_IMAGE"
    fi
fi

if [ -n "$check_pid" ]; then
    mark no-default
    if ! wait "$check_pid"; then
        cat "$beside/no-default.log" >&2
        echo "test: the build without default features (scripts/demo.sh's) does not check" >&2
        exit 1
    fi
fi

mark tests
echo "== relay ($runner)"
log="$(mktemp)"
trap 'rm -rf "$log" "$log.tests" "$beside" "$scratch"' EXIT
# Every test runs even after one fails, and the summary is printed either
# way: a red run says everything that failed, not the first failure.
status=0
args=()
for arg in "$@"; do [ "$arg" = --no-fail-fast ] || args+=("$arg"); done
if [ "$runner" = nextest ]; then
    env ${cargo_env[@]+"${cargo_env[@]}"} TMPDIR="$scratch" cargo nextest run "${targets[@]}" --no-fail-fast --status-level pass ${args[@]+"${args[@]}"} 2>&1 | tee "$log" || status=$?
    awk '/^ *Summary \[/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p = $i; if ($(i+1) ~ /^failed/) f = $i } }
         /^ *(FAIL|TIMEOUT|SIGSEGV|SIGABRT) \[/ { name = $NF; bin = $(NF-1); if (!seen[bin " " name]++) failed[++n] = bin " " name }
         END { printf "summary: %d passed, %d failed\n", p, f; for (i = 1; i <= n; i++) printf "failed: %s\n", failed[i] }' "$log"
    # Why each one failed, after the summary: a CI log is often read from
    # its end, and the panic sits above thousands of lines of output.
    awk '/^ *(FAIL|TIMEOUT|SIGSEGV|SIGABRT) \[/ { name = $NF; next }
         /^ *PASS \[/ { name = "" }
         name != "" && / panicked at / { print "why " name ":"; shown = 0; grab = 1 }
         grab && /^$/ { grab = 0 }
         grab && shown < 6 { print "  " $0; shown++ }' "$log" | cut -c1-400
    # Each test module's time (the sum of its tests': one binary holds them
    # all, so a binary's time would say nothing) and the slowest tests.
    awk '/^ *PASS \[/ { t = $0; sub(/.*\[ */, "", t); sub(/s\].*/, "", t); bin = $(NF-1); sub(/.*::/, "", bin); mod = $NF; sub(/::.*/, "", mod); sum[bin "/" mod] += t; printf "  %-70s %8.1f s\n", bin " " $NF, t > "/dev/stderr" }
         END { for (b in sum) printf "  %-32s %8.1f s\n", b, sum[b] }' "$log" 2>"$log.tests" | sort -k2 -n -r | sed -n 1,25p
    echo "== slowest tests"
    sort -k3 -n -r "$log.tests" | sed -n 1,15p
    rm -f "$log.tests"
else
    env ${cargo_env[@]+"${cargo_env[@]}"} TMPDIR="$scratch" cargo test "${targets[@]}" --no-fail-fast ${args[@]+"${args[@]}"} 2>&1 | tee "$log" || status=$?
    awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
         /^test .* \.\.\. FAILED$/ { failed[++n] = $2 }
         END { printf "summary: %d passed, %d failed\n", p, f; for (i = 1; i <= n; i++) printf "failed: %s\n", failed[i] }' "$log"
    awk '/^---- .* stdout ----$/ { name = $2; next }
         name != "" && / panicked at / { print "why " name ":"; shown = 0; grab = 1 }
         grab && /^$/ { grab = 0 }
         grab && shown < 6 { print "  " $0; shown++ }
         /^failures:$/ { name = "" }' "$log" | cut -c1-400
    # Each test binary's own time, as its runner reports it.
    awk '/^     Running / { name = $NF; gsub(/[()]/, "", name); sub(/.*\//, "", name); sub(/-[0-9a-f]+$/, "", name) } /^test result:/ { for (i = 1; i <= NF; i++) if ($i == "in") t = $(i+1); sub(/s$/, "", t); if (name != "") printf "  %-32s %8.1f s\n", name, t; name = "" }' "$log" \
        | sort -k2 -n -r | sed -n 1,30p
fi
print_timings
exit "$status"
