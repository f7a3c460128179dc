#!/usr/bin/env bash
# The container image, built from this machine's release build (no base
# image is pulled: deploy/image/Containerfile starts from scratch).
#
#   scripts/image.sh build    release build, assemble target/image/rootfs, build the image
#   scripts/image.sh build --binary PATH
#                             the same from a binary built already: the test
#                             suite assembles its image from its own dev build
#                             (tests/bin/relay-process, the same code and
#                             allocator), so CI compiles the tree once
#   scripts/image.sh tools    install and configure podman (Debian) if no engine is there
#
# IMAGE names the image (default switchyard:VERSION, the version in
# host/Cargo.toml and the tag the manifests run). SWITCHYARD_IMAGE_BINARY
# does what --binary does: scripts/production-walk.sh runs the README's
# `scripts/image.sh build` as written, on the test build. Uses podman, or
# docker when podman is missing and docker answers. Prints the image's size
# and how long each step took.
set -euo pipefail
cd "$(dirname "$0")/.."

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' host/Cargo.toml | sed -n 1p)"
image="${IMAGE:-switchyard:$version}"

engine() {
    if command -v podman >/dev/null; then
        echo podman
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        echo docker
    fi
}

tools() {
    if [ -n "$(engine)" ]; then
        return
    fi
    echo "image: installing podman (runc, cgroupfs)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        podman runc uidmap fuse-overlayfs slirp4netns >/dev/null
    # crun fails on hybrid cgroups and on setting rlimits on these machines.
    if [ ! -f /etc/containers/containers.conf ]; then
        mkdir -p /etc/containers
        cat >/etc/containers/containers.conf <<'CONF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
CONF
    fi
}

build() {
    tools
    local started step root bin="${1:-}"
    started=$(date +%s)
    if [ -z "$bin" ]; then
        echo "== release build"
        cargo build --release --locked --quiet -p switchyard --bin switchyard
        bin=target/release/switchyard
    fi
    [ -x "$bin" ] || { echo "image: $bin is not an executable" >&2; exit 2; }
    (cd plugins && cargo build --release --quiet)
    step=$(date +%s)
    echo "build: $((step - started)) s ($bin)"

    echo "== rootfs"
    root=target/image/rootfs
    rm -rf target/image
    mkdir -p "$root/usr/local/bin" "$root/etc/ssl/certs" "$root/usr/share/switchyard/plugins" \
        "$root/etc/switchyard" "$root/tmp" target/image/writable/var/cache/switchyard \
        target/image/writable/var/lib/switchyard
    chmod 1777 "$root/tmp"
    # Symbols go to a debug file beside the image (for a backtrace from a
    # core), not into it.
    objcopy --only-keep-debug "$bin" target/image/switchyard.debug
    objcopy --strip-all --add-gnu-debuglink=target/image/switchyard.debug "$bin" "$root/usr/local/bin/switchyard"
    # The shared libraries it links, at the paths the loader looks in.
    ldd "$bin" | awk '/=> \// { print $3 } /^\t\/lib/ { print $1 }' | while read -r lib; do
        cp --parents -L "$lib" "$root/"
    done
    cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
    # The example plugins (the demo's, and what examples/*.toml name); not
    # the test suite's misbehaving ones built beside them.
    for plugin in route_by_type route_by_type_batch redact_fields fan_out; do
        cp "plugins/target/wasm32-wasip2/release/$plugin.wasm" "$root/usr/share/switchyard/plugins/"
    done
    printf 'root:x:0:0:root:/root:/sbin/nologin\nswitchyard:x:65532:65532:switchyard:/var/lib/switchyard:/sbin/nologin\n' \
        >"$root/etc/passwd"
    printf 'root:x:0:\nswitchyard:x:65532:\n' >"$root/etc/group"

    echo "== image $image"
    local replaced
    replaced="$("$(engine)" image inspect "$image" --format '{{.Id}}' 2>/dev/null || true)"
    "$(engine)" build --quiet -t "$image" -f deploy/image/Containerfile target/image >/dev/null
    # The image the tag named before is left without a name: removed, or
    # every build (each CI run's) keeps another 100 MB. One a container
    # still runs stays.
    if [ -n "$replaced" ] && [ "$replaced" != "$("$(engine)" image inspect "$image" --format '{{.Id}}')" ]; then
        "$(engine)" rmi "$replaced" >/dev/null 2>&1 || true
    fi
    echo "image build: $(($(date +%s) - step)) s"
    "$(engine)" image inspect "$image" --format 'image size: {{.Size}} bytes' |
        awk '{ printf "%s %s %.1f MB\n", $1, $2, $3 / 1000000 }'
    echo "symbols: target/image/switchyard.debug ($(du -h target/image/switchyard.debug | cut -f1))"
}

case "${1:-build}" in
build)
    if [ "${2:-}" = --binary ] && [ -n "${3:-}" ]; then
        build "$3"
    elif [ -n "${2:-}" ]; then
        echo "usage: scripts/image.sh build [--binary PATH]" >&2
        exit 2
    else
        build "${SWITCHYARD_IMAGE_BINARY:-}"
    fi
    ;;
tools) tools ;;
*)
    echo "usage: scripts/image.sh [build|tools]" >&2
    exit 2
    ;;
esac
