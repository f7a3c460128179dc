#!/usr/bin/env bash
# Installs (if missing) the toolchains that build plugins in other languages
# and builds the repository's plugins in them:
#   Python:     componentize-py (from the Python package registry) in a
#               virtual environment under $SWITCHYARD_TOOLS_DIR;
#   JavaScript: @bytecodealliance/componentize-js (from the npm registry)
#               under $SWITCHYARD_TOOLS_DIR/node.
# Components land in plugins/target/<language>/. Idempotent: a component
# newer than its sources is not built again.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS_DIR="${SWITCHYARD_TOOLS_DIR:-$HOME/.local/share/switchyard}"
COMPONENTIZE_PY_VERSION=0.25.1
PY_ENV="$TOOLS_DIR/python"
COMPONENTIZE_JS_VERSION=0.23.0
NODE_DIR="$TOOLS_DIR/node"
COMPONENTIZE_JS="$NODE_DIR/node_modules/.bin/componentize-js"
OUT=plugins/target

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_python() {
    if [ -x "$PY_ENV/bin/componentize-py" ] &&
        "$PY_ENV/bin/componentize-py" --version 2>/dev/null | grep -q "$COMPONENTIZE_PY_VERSION"; then
        return 0
    fi
    if ! python3 -m venv --help >/dev/null 2>&1; then
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    echo "plugin-toolchains: installing componentize-py $COMPONENTIZE_PY_VERSION into $PY_ENV" >&2
    rm -rf "$PY_ENV"
    python3 -m venv "$PY_ENV"
    "$PY_ENV/bin/pip" install --quiet --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY_VERSION"
}

install_js() {
    if [ -x "$COMPONENTIZE_JS" ] &&
        grep -q "\"version\": \"$COMPONENTIZE_JS_VERSION\"" \
            "$NODE_DIR/node_modules/@bytecodealliance/componentize-js/package.json" 2>/dev/null; then
        return 0
    fi
    if ! command -v npm >/dev/null; then
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
    fi
    echo "plugin-toolchains: installing componentize-js $COMPONENTIZE_JS_VERSION into $NODE_DIR" >&2
    mkdir -p "$NODE_DIR"
    npm install --silent --no-audit --no-fund --prefix "$NODE_DIR" \
        "@bytecodealliance/componentize-js@$COMPONENTIZE_JS_VERSION" >&2
}

# build <dir> <output.wasm> <command...>: runs the command in <dir> unless the
# output is newer than everything in <dir> and the WIT.
build() {
    local dir=$1 out=$2
    shift 2
    if [ -f "$out" ] && [ -z "$(find "$dir" wit -newer "$out" -type f -not -path "*/__pycache__/*" -print -quit)" ]; then
        return 0
    fi
    mkdir -p "$(dirname "$out")"
    (cd "$dir" && PYTHONDONTWRITEBYTECODE=1 "$@")
}

# Each port is built for both worlds from one source: route_by_type.wasm
# (router) and route_by_type_batch.wasm (batch-router).
install_python
for world in router batch-router; do
    out="$OUT/python/route_by_type$([ "$world" = router ] || echo _batch).wasm"
    build plugins/python/route-by-type "$out" \
        "$PY_ENV/bin/componentize-py" -d ../../../wit -w "$world" componentize app -o "$PWD/$out"
done

# The world has no wasi:http: without `--disable http fetch-event` the
# component would import it and the relay would refuse it.
install_js
for world in router batch-router; do
    out="$OUT/js/route_by_type$([ "$world" = router ] || echo _batch).wasm"
    build plugins/js/route-by-type "$out" \
        "$COMPONENTIZE_JS" app.js --wit ../../../wit --world-name "$world" \
        --disable http fetch-event -o "$PWD/$out"
done
