#!/usr/bin/env bash
# Installs (if missing) and starts or stops the local services the tests and
# the relay use: PostgreSQL 15 and nats-server with JetStream, as plain
# processes on loopback. Idempotent: `start` on a running set is a no-op.
#
#   scripts/services.sh start|stop|status|env
#
# Ports and the state directory can be moved with SWITCHYARD_PG_PORT,
# SWITCHYARD_NATS_PORT and SWITCHYARD_STATE_DIR.
set -euo pipefail

STATE_DIR="${SWITCHYARD_STATE_DIR:-/tmp/switchyard-services}"
PG_PORT="${SWITCHYARD_PG_PORT:-55432}"
NATS_PORT="${SWITCHYARD_NATS_PORT:-54222}"
PG_BIN="${SWITCHYARD_PG_BIN:-/usr/lib/postgresql/15/bin}"
PG_DATA="$STATE_DIR/pg"
NATS_DIR="$STATE_DIR/nats"

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_updated=""
apt_install() {
    if [ -z "$apt_updated" ]; then as_root apt-get update -qq; apt_updated=1; fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

install_missing() {
    local pkgs=()
    [ -x "$PG_BIN/pg_ctl" ] || pkgs+=(postgresql-15)
    command -v psql >/dev/null || pkgs+=(postgresql-client-15)
    command -v nats-server >/dev/null || pkgs+=(nats-server)
    if [ ${#pkgs[@]} -gt 0 ]; then
        echo "services: installing ${pkgs[*]}"
        apt_install "${pkgs[@]}"
    fi
}

# PostgreSQL refuses to run as root: run it as the `postgres` user when root.
pg_run() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

pg_start() {
    mkdir -p "$STATE_DIR"
    if [ "$(id -u)" = 0 ]; then chown postgres "$STATE_DIR"; fi
    if [ ! -f "$PG_DATA/PG_VERSION" ]; then
        pg_run "$PG_BIN/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 >/dev/null
        cat >>"$PG_DATA/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_DATA'
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 256MB
CONF
    fi
    if pg_run "$PG_BIN/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; then
        return 0
    fi
    pg_run "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_DATA/server.log" -w -t 60 start >/dev/null
}

pg_stop() {
    if [ -f "$PG_DATA/PG_VERSION" ] && pg_run "$PG_BIN/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; then
        pg_run "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast -w stop >/dev/null
    fi
}

nats_running() {
    [ -f "$NATS_DIR/nats.pid" ] && kill -0 "$(cat "$NATS_DIR/nats.pid")" 2>/dev/null
}

nats_start() {
    mkdir -p "$NATS_DIR"
    nats_running && return 0
    nohup nats-server -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$NATS_DIR/js" \
        -P "$NATS_DIR/nats.pid" -l "$NATS_DIR/nats.log" >/dev/null 2>&1 &
    for _ in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$NATS_PORT") 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    echo "services: nats-server did not start, see $NATS_DIR/nats.log" >&2
    return 1
}

nats_stop() {
    if nats_running; then
        kill "$(cat "$NATS_DIR/nats.pid")"
        for _ in $(seq 1 50); do nats_running || break; sleep 0.1; done
    fi
    rm -f "$NATS_DIR/nats.pid"
}

print_env() {
    echo "export DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres"
    echo "export SWITCHYARD_NATS_URL=nats://127.0.0.1:$NATS_PORT"
}

case "${1:-}" in
    start)
        install_missing
        pg_start
        nats_start
        print_env
        ;;
    stop)
        nats_stop
        pg_stop
        ;;
    status)
        pg_run "$PG_BIN/pg_ctl" -D "$PG_DATA" status || true
        if nats_running; then echo "nats-server running (pid $(cat "$NATS_DIR/nats.pid"))"; else echo "nats-server stopped"; fi
        ;;
    env)
        print_env
        ;;
    *)
        echo "usage: $0 start|stop|status|env" >&2
        exit 2
        ;;
esac
