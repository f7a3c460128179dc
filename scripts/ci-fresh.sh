#!/usr/bin/env bash
# `.ci/run` on a clean clone as a fresh machine runs it, by hand: an empty
# HOME and CARGO_HOME, so every crate is downloaded again and everything the
# project's scripts install under HOME is installed again (tansu and mdBook
# built from source, componentize-py and componentize-js with their
# caches empty, the Kubernetes schemas). What stays is what the machine
# image holds: the Rust toolchain and its wasm32-wasip2 target (RUSTUP_HOME),
# cargo-nextest, the Debian packages, and how the machine reaches the
# package registries (CA bundles, proxies). Prints the CI log's timing
# table and the wall time.
#
#   scripts/ci-fresh.sh [REV]     (default HEAD)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
rev="${1:-HEAD}"
work="$(mktemp -d /tmp/ci-fresh.XXXXXX)"
mkdir -p "$work/home" "$work/bin"
# PostgreSQL runs as its own user, under this directory.
chmod 755 "$work"
# The toolchain's commands without the rest of ~/.cargo/bin (mdBook there
# would not be built again).
for tool in cargo rustc rustup rustfmt cargo-fmt cargo-clippy clippy-driver rustdoc; do
    ln -s "$(command -v "$tool")" "$work/bin/$tool"
done
git clone -q "$repo" "$work/clone"
git -C "$work/clone" checkout -q "$rev"
echo "ci-fresh: $rev in $work/clone, HOME=$work/home"
# What reaches the package registries on this machine (its CA bundles,
# proxies) belongs to the machine, not to what a run installs: passed on.
machine_env=()
while IFS= read -r name; do
    machine_env+=("$name=${!name}")
done < <(compgen -e | grep -E '^([a-z]+_proxy|[A-Z]+_PROXY|NODE_EXTRA_CA_CERTS|SSL_CERT_(FILE|DIR)|CURL_CA_BUNDLE|REQUESTS_CA_BUNDLE|GIT_SSL_CAINFO|PIP_[A-Z_]+|CLOUDSDK_[A-Z_]+)$' || true)
started=$SECONDS
status=0
(
    cd "$work/clone"
    env -i \
        ${machine_env[@]+"${machine_env[@]}"} \
        HOME="$work/home" \
        CARGO_HOME="$work/home/.cargo" \
        RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}" \
        SWITCHYARD_TOOLS_DIR="$work/home/.local/share/switchyard" \
        SWITCHYARD_STATE_DIR="$work/services" \
        PATH="$work/home/.cargo/bin:$work/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        TERM=dumb CI=true LANG=C.UTF-8 \
        bash .ci/run
) >"$work/ci.log" 2>&1 || status=$?
# The clone's build, the downloads and the services' data are gigabytes a
# run; the log is what is kept.
rm -rf "$work/clone" "$work/home" "$work/services" "$work/bin"
sed -n '/^== timings/,$p' "$work/ci.log"
grep -E '^summary:|^failed:' "$work/ci.log" || true
echo "ci-fresh: exit $status after $((SECONDS - started)) s; log $work/ci.log"
exit "$status"
