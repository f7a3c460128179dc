#!/usr/bin/env bash
# Installs (if missing) and starts or stops the local services the tests and
# the relay use: PostgreSQL 15 (and a second cluster that takes only TLS,
# with certificates this script makes), nats-server with JetStream, tansu (a
# Kafka-protocol broker), RabbitMQ, the Google Cloud Pub/Sub emulator, an
# OCI registry (distribution, TLS and htpasswd login), MariaDB 10.11 (TLS
# offered, binlog in row format) and moto's server (SQS, SNS, EventBridge,
# Kinesis and STS, from a virtual environment of its own) and Redis 7.0
# (TLS only, an ACL user), as plain processes on loopback.
# Idempotent: `start` on a running set is a no-op.
#
#   scripts/services.sh install|start|stop|status|env|durable
#
# `durable` starts (alone) a PostgreSQL cluster with the server's durability
# defaults for benchmarks by hand and prints its DATABASE_URL.
#
# Ports and directories can be moved with SWITCHYARD_PG_PORT, SWITCHYARD_PG_TLS_PORT,
# SWITCHYARD_NATS_PORT, SWITCHYARD_KAFKA_PORT, SWITCHYARD_RABBITMQ_PORT
# (AMQP; the next port is its Erlang distribution port), SWITCHYARD_PUBSUB_PORT,
# SWITCHYARD_REGISTRY_PORT, SWITCHYARD_MARIADB_PORT, SWITCHYARD_MOTO_PORT,
# SWITCHYARD_REDIS_TLS_PORT,
# SWITCHYARD_PG_DURABLE_PORT,
# SWITCHYARD_STATE_DIR and
# SWITCHYARD_TOOLS_DIR (where tansu and moto are installed).
set -euo pipefail

STATE_DIR="${SWITCHYARD_STATE_DIR:-/tmp/switchyard-services}"
PG_PORT="${SWITCHYARD_PG_PORT:-55432}"
NATS_PORT="${SWITCHYARD_NATS_PORT:-54222}"
KAFKA_PORT="${SWITCHYARD_KAFKA_PORT:-59092}"
RABBIT_PORT="${SWITCHYARD_RABBITMQ_PORT:-55672}"
PUBSUB_PORT="${SWITCHYARD_PUBSUB_PORT:-58085}"
REGISTRY_PORT="${SWITCHYARD_REGISTRY_PORT:-55000}"
MARIADB_PORT="${SWITCHYARD_MARIADB_PORT:-53306}"
MOTO_PORT="${SWITCHYARD_MOTO_PORT:-55500}"
REDIS_TLS_PORT="${SWITCHYARD_REDIS_TLS_PORT:-56380}"
TOOLS_DIR="${SWITCHYARD_TOOLS_DIR:-$HOME/.local/share/switchyard}"
TANSU_BIN="$TOOLS_DIR/bin/tansu"
TANSU_VERSION=0.6.0
PG_BIN="${SWITCHYARD_PG_BIN:-/usr/lib/postgresql/15/bin}"
PG_DATA="$STATE_DIR/pg"
PG_TLS_PORT="${SWITCHYARD_PG_TLS_PORT:-55433}"
PG_TLS_DATA="$STATE_DIR/pg-tls"
PG_DURABLE_PORT="${SWITCHYARD_PG_DURABLE_PORT:-55434}"
PG_DURABLE_DATA="$STATE_DIR/pg-durable"
TLS_DIR="$STATE_DIR/tls"
NATS_DIR="$STATE_DIR/nats"
KAFKA_DIR="$STATE_DIR/kafka"
RABBIT_DIR="$STATE_DIR/rabbitmq"
PUBSUB_DIR="$STATE_DIR/pubsub"
REGISTRY_DIR="$STATE_DIR/registry"
MARIADB_DIR="$STATE_DIR/mariadb"
MOTO_DIR="$STATE_DIR/moto"
REDIS_DIR="$STATE_DIR/redis"
# moto's server in a virtual environment: its pins do not meet the system's
# Python packages. The version is pinned; a new one is installed beside.
MOTO_VERSION=5.2.6
MOTO_VENV="$TOOLS_DIR/moto-$MOTO_VERSION"
MOTO_BIN="$MOTO_VENV/bin/moto_server"
# The Standard Webhooks reference implementation, which the HTTP target's
# tests check every signature with (not the project's own code).
WEBHOOKS_VERSION=1.3.0
WEBHOOKS_VENV="$TOOLS_DIR/standardwebhooks-$WEBHOOKS_VERSION"
# The server script that runs as the calling user (the one in /usr/sbin
# switches to the `rabbitmq` user and its fixed directories).
RABBIT_SERVER=/usr/lib/rabbitmq/bin/rabbitmq-server

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
    # The console's browser tests drive Debian's chromium through chromedriver.
    command -v chromedriver >/dev/null || pkgs+=(chromium chromium-driver)
    # Plugins pulled from an OCI registry: distribution 2.8.
    command -v docker-registry >/dev/null || pkgs+=(docker-registry)
    # The MySQL-family outbox: Debian's MariaDB 10.11.
    command -v mariadbd >/dev/null || pkgs+=(mariadb-server)
    # The Redis Streams target's tests: Debian's Redis 7.0 (built with TLS).
    command -v redis-server >/dev/null || pkgs+=(redis-server)
    if [ ${#pkgs[@]} -gt 0 ]; then
        echo "services: installing ${pkgs[*]}" >&2
        apt_install "${pkgs[@]}"
    fi
    install_rabbitmq
    install_tansu
    install_moto
    install_webhooks
}

install_webhooks() {
    [ -x "$WEBHOOKS_VENV/bin/python" ] && return 0
    echo "services: installing standardwebhooks $WEBHOOKS_VERSION into $WEBHOOKS_VENV" >&2
    rm -rf "$WEBHOOKS_VENV"
    python3 -m venv "$WEBHOOKS_VENV"
    "$WEBHOOKS_VENV/bin/pip" install --quiet --disable-pip-version-check "standardwebhooks==$WEBHOOKS_VERSION"
}

# moto (from PyPI, about 45 s the first time) serves the AWS targets' tests.
install_moto() {
    [ -x "$MOTO_BIN" ] && return 0
    echo "services: installing moto $MOTO_VERSION into $MOTO_VENV" >&2
    rm -rf "$MOTO_VENV"
    python3 -m venv "$MOTO_VENV"
    "$MOTO_VENV/bin/pip" install --quiet --disable-pip-version-check "moto[server]==$MOTO_VERSION"
}

# tansu has no Debian package: it is built from the crate registry once
# (tens of minutes on 2 cores) and reused from $TOOLS_DIR afterwards. Its
# default features have no storage engine; `dynostore` brings memory:// (the
# shared test broker) and `libsql` brings sqlite://, a broker whose topics
# survive its restart (the outage tests count what was delivered before).
# opt-level 0 halves the build and is plenty for a test broker.
TANSU_FEATURES="dynostore,libsql"
install_tansu() {
    if [ -x "$TANSU_BIN" ] && "$TANSU_BIN" --version 2>/dev/null | grep -q "$TANSU_VERSION" \
        && [ "$(cat "$TOOLS_DIR/tansu.features" 2>/dev/null)" = "$TANSU_FEATURES" ]; then
        return 0
    fi
    echo "services: building tansu $TANSU_VERSION into $TOOLS_DIR (once; this takes a while)" >&2
    local started=$SECONDS
    CARGO_PROFILE_RELEASE_OPT_LEVEL=0 CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_INCREMENTAL=false \
        cargo install --quiet --root "$TOOLS_DIR" tansu --version "$TANSU_VERSION" \
        --features "$TANSU_FEATURES" --locked >&2
    echo "$TANSU_FEATURES" >"$TOOLS_DIR/tansu.features"
    echo "services: tansu built in $((SECONDS - started)) s" >&2
}

# The package's post-install script would start a system node listening on
# every interface; a policy-rc.d answering 101 stops that (only ours runs,
# on loopback).
install_rabbitmq() {
    [ -x "$RABBIT_SERVER" ] && return 0
    echo "services: installing rabbitmq-server" >&2
    local policy=/usr/sbin/policy-rc.d added=""
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
        as_root chmod +x "$policy"
        added=1
    fi
    apt_install rabbitmq-server
    if [ -n "$added" ]; then as_root rm -f "$policy"; fi
}

# PostgreSQL refuses to run as root: run it as the `postgres` user when root.
pg_run() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# A data directory for a cluster on loopback, made once: a test server,
# durability off. Returns false when it existed already.
pg_init() { # data-directory port max-connections
    mkdir -p "$STATE_DIR"
    if [ "$(id -u)" = 0 ]; then chown postgres "$STATE_DIR"; fi
    [ -f "$1/PG_VERSION" ] && return 1
    pg_run "$PG_BIN/initdb" -D "$1" -U postgres --auth=trust -E UTF8 >/dev/null
    cat >>"$1/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $2
unix_socket_directories = '$1'
max_connections = $3
fsync = off
synchronous_commit = off
full_page_writes = off
CONF
}

# Appends the setting line $1 to the data directory's postgresql.conf unless
# it is there, and marks a running server for a restart.
pg_setting() {
    grep -qxF "$1" "$PG_DATA/postgresql.conf" && return 0
    echo "$1" >>"$PG_DATA/postgresql.conf"
    restart=1
}

pg_start() {
    if pg_init "$PG_DATA" "$PG_PORT" 200; then
        echo "shared_buffers = 256MB" >>"$PG_DATA/postgresql.conf"
    fi
    # Replication mode reads the WAL: added to a data directory made before
    # it too, and a server running without it is restarted.
    local restart=""
    if ! grep -q '^wal_level = logical' "$PG_DATA/postgresql.conf"; then
        cat >>"$PG_DATA/postgresql.conf" <<CONF
wal_level = logical
max_replication_slots = 40
max_wal_senders = 40
CONF
        restart=1
    fi
    # Many outbox databases need more sessions than the 200 of older data
    # directories: tests and fault runs of several relays sharing 50, and the
    # 500-database benchmark (a session or two per database for the relay,
    # one for its writers).
    pg_setting "max_connections = 1600"
    # Statement figures (calls, buffers, time) per database: the claim-cost
    # tests count the buffers each claim touches, and a benchmark reads where
    # the server's CPU goes.
    pg_setting "shared_preload_libraries = 'pg_stat_statements'"
    # Its entries are per database and statement, and the suite makes
    # hundreds of databases: at the default 5,000 the claim's entry was
    # evicted mid-test (a CI run).
    pg_setting "pg_stat_statements.max = 100000"
    # Not kept across restarts: a read that shows query texts reads every
    # entry's text, and entries kept from earlier runs (32,000, 17 MB of
    # text, after one afternoon) made each read 0.1 s and the claim-cost
    # test, which reads after each of its 2,400 claims, 433 s long.
    pg_setting "pg_stat_statements.save = off"
    if pg_run "$PG_BIN/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; then
        if [ -n "$restart" ]; then
            pg_run "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_DATA/server.log" -m fast -w -t 60 restart >/dev/null
        fi
        return 0
    fi
    pg_run "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_DATA/server.log" -w -t 60 start >/dev/null
}

# Test certificates, made once: a CA; a server certificate that names
# `localhost` only (so verify-full to 127.0.0.1 fails, as it should); one
# that expired yesterday; a client certificate for the role
# `switchyard_cert`; and a second CA that signed none of them.
make_certificates() {
    [ -f "$TLS_DIR/complete" ] && return 0
    command -v openssl >/dev/null || apt_install openssl
    mkdir -p "$TLS_DIR"
    local ec=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
    (
        cd "$TLS_DIR"
        for ca in ca other-ca; do
            openssl req -x509 "${ec[@]}" -keyout "$ca.key" -out "$ca.pem" -subj "/CN=switchyard test $ca" -days 3650 2>/dev/null
        done
        sign() { # name subject days [extensions]
            openssl req "${ec[@]}" -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
            printf '%s\n' "${4:-basicConstraints=CA:FALSE}" >"$1.ext"
            openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$1.pem" \
                -days "$3" -extfile "$1.ext" 2>/dev/null
            rm -f "$1.csr" "$1.ext"
        }
        sign server /CN=localhost 3650 "subjectAltName=DNS:localhost"
        sign expired /CN=localhost -1 "subjectAltName=DNS:localhost"
        sign client /CN=switchyard_cert 3650
        chmod 600 ./*.key
    )
    touch "$TLS_DIR/complete"
}

# The TLS cluster: `hostssl` entries only (a plaintext connection is
# refused), certificate login for `switchyard_cert`, passwords checked for
# members of the role `switchyard_rotating` (scram-sha-256), trust for the rest.
pg_tls_start() {
    make_certificates
    if [ "$(id -u)" = 0 ]; then chown -R postgres "$TLS_DIR"; fi
    if pg_init "$PG_TLS_DATA" "$PG_TLS_PORT" 300; then
        cat >>"$PG_TLS_DATA/postgresql.conf" <<CONF
wal_level = logical
max_replication_slots = 20
max_wal_senders = 20
ssl = on
ssl_cert_file = '$TLS_DIR/server.pem'
ssl_key_file = '$TLS_DIR/server.key'
ssl_ca_file = '$TLS_DIR/ca.pem'
password_encryption = 'scram-sha-256'
CONF
        cat >"$PG_TLS_DATA/pg_hba.conf" <<HBA
local   all          all                                   trust
hostssl all          switchyard_cert      127.0.0.1/32     cert
hostssl replication  switchyard_cert      127.0.0.1/32     cert
hostssl all          +switchyard_rotating 127.0.0.1/32     scram-sha-256
hostssl replication  +switchyard_rotating 127.0.0.1/32     scram-sha-256
hostssl all          all                  127.0.0.1/32     trust
hostssl replication  all                  127.0.0.1/32     trust
HBA
    fi
    pg_run "$PG_BIN/pg_ctl" -D "$PG_TLS_DATA" status >/dev/null 2>&1 && return 0
    pg_run "$PG_BIN/pg_ctl" -D "$PG_TLS_DATA" -l "$PG_TLS_DATA/server.log" -w -t 60 start >/dev/null
}

# A cluster for benchmarks by hand (`durable`), never for tests: the
# server's durability defaults (fsync, synchronous_commit, full_page_writes
# on), as production runs, so that what a commit or a page's first change
# after a checkpoint costs is counted; the test server turns them off.
pg_durable_start() {
    mkdir -p "$STATE_DIR"
    if [ "$(id -u)" = 0 ]; then chown postgres "$STATE_DIR"; fi
    if [ ! -f "$PG_DURABLE_DATA/PG_VERSION" ]; then
        pg_run "$PG_BIN/initdb" -D "$PG_DURABLE_DATA" -U postgres --auth=trust -E UTF8 >/dev/null
        cat >>"$PG_DURABLE_DATA/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PG_DURABLE_PORT
unix_socket_directories = '$PG_DURABLE_DATA'
max_connections = 200
shared_buffers = 256MB
wal_level = logical
max_replication_slots = 20
max_wal_senders = 20
shared_preload_libraries = 'pg_stat_statements'
pg_stat_statements.save = off
CONF
    fi
    pg_run "$PG_BIN/pg_ctl" -D "$PG_DURABLE_DATA" status >/dev/null 2>&1 && return 0
    pg_run "$PG_BIN/pg_ctl" -D "$PG_DURABLE_DATA" -l "$PG_DURABLE_DATA/server.log" -w -t 60 start >/dev/null
}

pg_stop() { # data-directory
    if [ -f "$1/PG_VERSION" ] && pg_run "$PG_BIN/pg_ctl" -D "$1" status >/dev/null 2>&1; then
        pg_run "$PG_BIN/pg_ctl" -D "$1" -m fast -w stop >/dev/null
    fi
}

# Processes tracked by a pid file: running?, wait for the port, stop. A pid
# file left by a killed run (or a machine restarted since) may name a pid now
# reused by another program, so the command line must match too.
pid_running() { # pidfile [command-name]
    [ -f "$1" ] || return 1
    local pid
    pid="$(cat "$1")"
    kill -0 "$pid" 2>/dev/null || return 1
    [ -z "${2:-}" ] || tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$2"
}

# Whether something listens on a TCP port. Not by connecting: the service
# ports lie in the kernel's ephemeral range, and a connect to a port nobody
# listens on can pick that very port as its own and connect to itself. The
# check then passes, and the server's bind fails with EADDRINUSE (RabbitMQ
# did, once, in a clean CI run).
listening() { # port
    awk -v port="$(printf ':%04X' "$1")" \
        '$4 == "0A" && substr($2, length($2) - 4) == port { found = 1 } END { exit !found }' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

wait_port() { # port name log
    for _ in $(seq 1 100); do
        if listening "$1"; then return 0; fi
        sleep 0.1
    done
    echo "services: $2 did not start, see $3" >&2
    return 1
}

pid_stop() { # pidfile command-name
    if pid_running "$1" "$2"; then
        kill "$(cat "$1")"
        for _ in $(seq 1 50); do pid_running "$1" "$2" || break; sleep 0.1; done
    fi
    rm -f "$1"
}

nats_start() {
    mkdir -p "$NATS_DIR"
    pid_running "$NATS_DIR/nats.pid" nats-server && return 0
    nohup nats-server -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$NATS_DIR/js" \
        -P "$NATS_DIR/nats.pid" -l "$NATS_DIR/nats.log" </dev/null >/dev/null 2>&1 &
    wait_port "$NATS_PORT" nats-server "$NATS_DIR/nats.log"
}

kafka_start() {
    mkdir -p "$KAFKA_DIR"
    pid_running "$KAFKA_DIR/tansu.pid" tansu && return 0
    local url="tcp://127.0.0.1:$KAFKA_PORT"
    RUST_LOG=warn nohup "$TANSU_BIN" broker --listener-url "$url" --advertised-listener-url "$url" \
        --storage-engine memory://tansu/ </dev/null >"$KAFKA_DIR/tansu.log" 2>&1 &
    echo $! >"$KAFKA_DIR/tansu.pid"
    wait_port "$KAFKA_PORT" tansu "$KAFKA_DIR/tansu.log"
}

# One node, no plugins, its state under $RABBIT_DIR; epmd, the node and its
# Erlang distribution port listen on loopback only. HOME holds the Erlang
# cookie rabbitmqctl needs.
rabbit_exports() {
    export HOME="$RABBIT_DIR" RABBITMQ_NODENAME="switchyard@localhost" \
        RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$RABBIT_PORT" \
        RABBITMQ_DIST_PORT="$((RABBIT_PORT + 1))" ERL_EPMD_ADDRESS=127.0.0.1 \
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}" \
        RABBITMQ_MNESIA_BASE="$RABBIT_DIR/mnesia" RABBITMQ_LOG_BASE="$RABBIT_DIR/log" \
        RABBITMQ_ENABLED_PLUGINS_FILE="$RABBIT_DIR/enabled_plugins" \
        RABBITMQ_CONFIG_FILE="$RABBIT_DIR/rabbitmq" RABBITMQ_PID_FILE="$RABBIT_DIR/rabbit.pid"
}

rabbit_start() {
    mkdir -p "$RABBIT_DIR/log"
    pid_running "$RABBIT_DIR/rabbit.pid" beam && return 0
    # A node whose pid file went missing still answers on its port.
    listening "$RABBIT_PORT" && return 0
    echo "[]." >"$RABBIT_DIR/enabled_plugins"
    printf 'listeners.tcp.1 = 127.0.0.1:%s\n' "$RABBIT_PORT" >"$RABBIT_DIR/rabbitmq.conf"
    # Not `(exports && server &)`: bash runs that list in the foreground of
    # the subshell and this script would wait for the server to exit.
    # In its own directory: Mnesia writes crash dumps into the working one.
    (rabbit_exports && cd "$RABBIT_DIR" && exec "$RABBIT_SERVER") </dev/null >"$RABBIT_DIR/server.log" 2>&1 &
    for _ in $(seq 1 600); do
        if listening "$RABBIT_PORT"; then return 0; fi
        sleep 0.1
    done
    echo "services: rabbitmq-server did not start, see $RABBIT_DIR/server.log and $RABBIT_DIR/log" >&2
    return 1
}

rabbit_stop() {
    if pid_running "$RABBIT_DIR/rabbit.pid" beam; then
        (rabbit_exports && /usr/lib/rabbitmq/bin/rabbitmqctl stop >/dev/null 2>&1) || pid_stop "$RABBIT_DIR/rabbit.pid" beam
    fi
}

# The Pub/Sub emulator is a component of Google's Cloud SDK (package
# google-cloud-cli-pubsub-emulator from Google's own package source, not in
# Debian): it cannot be installed from here, so a machine without it is
# told so and the Pub/Sub tests fail saying the same. Its launcher is run
# directly (`gcloud beta emulators pubsub start` wraps it in a Python
# process): one Java process whose pid the tests can stop and kill.
pubsub_emulator() {
    local gcloud candidates=()
    if gcloud="$(command -v gcloud 2>/dev/null)"; then
        candidates+=("$(dirname "$(readlink -f "$gcloud")")/../platform/pubsub-emulator/bin/cloud-pubsub-emulator")
    fi
    candidates+=(/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator)
    for candidate in "${candidates[@]}"; do
        if [ -x "$candidate" ]; then readlink -f "$candidate"; return 0; fi
    done
    return 1
}

pubsub_start() {
    mkdir -p "$PUBSUB_DIR"
    pid_running "$PUBSUB_DIR/emulator.pid" java && return 0
    local emulator
    if ! emulator="$(pubsub_emulator)"; then
        echo "services: the Pub/Sub emulator is not installed (gcloud component pubsub-emulator, package" \
            "google-cloud-cli-pubsub-emulator from Google's package source); the Pub/Sub tests need it" >&2
        return 0
    fi
    # Its heap holds every message a subscription has not acknowledged.
    JAVA_OPTS="-Xmx1g" nohup "$emulator" --host=127.0.0.1 --port="$PUBSUB_PORT" \
        </dev/null >"$PUBSUB_DIR/emulator.log" 2>&1 &
    echo $! >"$PUBSUB_DIR/emulator.pid"
    for _ in $(seq 1 600); do
        if listening "$PUBSUB_PORT"; then return 0; fi
        sleep 0.1
    done
    echo "services: the Pub/Sub emulator did not start, see $PUBSUB_DIR/emulator.log" >&2
    return 1
}

# `switchyard:HASH`, the bcrypt hash of the password in file $1, by the
# system's libcrypt (libxcrypt) through ctypes: Python's own `crypt` module
# is gone from 3.13 on, and apache2-utils' htpasswd would be one more
# package.
bcrypt_login() {
    python3 - "$1" <<'PY'
import ctypes, ctypes.util, sys
lib = ctypes.CDLL(ctypes.util.find_library("crypt") or "libcrypt.so.1")
lib.crypt_gensalt.restype = ctypes.c_char_p
lib.crypt_gensalt.argtypes = [ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int]
lib.crypt.restype = ctypes.c_char_p
lib.crypt.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
password = open(sys.argv[1], "rb").read().strip()
# bcrypt's lowest cost: the registry checks every request a test makes
# against it (at cost 12, a quarter of a second of CPU each). No random
# bytes given: libxcrypt takes them from the kernel.
hashed = lib.crypt(password, lib.crypt_gensalt(b"$2b$", 4, None, 0))
if not hashed or not hashed.startswith(b"$2b$04$"):
    sys.exit("services: libcrypt made no bcrypt hash for the registry login")
print("switchyard:" + hashed.decode())
PY
}

# Login files for the registries: `htpasswd` for the user `switchyard` and
# the password in `password`, and `htpasswd-rotated` for the same user and
# `password-rotated` (what a rotation moves to). distribution reads bcrypt
# hashes only.
registry_logins() {
    mkdir -p "$REGISTRY_DIR"
    local suffix
    for suffix in "" -rotated; do
        [ -s "$REGISTRY_DIR/password$suffix" ] ||
            head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$REGISTRY_DIR/password$suffix"
        # Hashed again (same password) when made at a higher cost before.
        grep -qs '^switchyard:\$2b\$04\$' "$REGISTRY_DIR/htpasswd$suffix" ||
            bcrypt_login "$REGISTRY_DIR/password$suffix" >"$REGISTRY_DIR/htpasswd$suffix"
    done
    chmod 600 "$REGISTRY_DIR"/password*
}

# The shared registry: TLS with the test CA's `localhost` certificate,
# htpasswd login, blobs under $REGISTRY_DIR/storage.
registry_start() {
    make_certificates
    registry_logins
    pid_running "$REGISTRY_DIR/registry.pid" docker-registry && return 0
    cat >"$REGISTRY_DIR/config.yml" <<CONF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $REGISTRY_DIR/storage
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$REGISTRY_PORT
  tls:
    certificate: $TLS_DIR/server.pem
    key: $TLS_DIR/server.key
auth:
  htpasswd:
    realm: switchyard
    path: $REGISTRY_DIR/htpasswd
CONF
    nohup docker-registry serve "$REGISTRY_DIR/config.yml" </dev/null >"$REGISTRY_DIR/registry.log" 2>&1 &
    echo $! >"$REGISTRY_DIR/registry.pid"
    wait_port "$REGISTRY_PORT" docker-registry "$REGISTRY_DIR/registry.log"
}


# MariaDB: one server on loopback, made once, a test server whose commits
# are not flushed to disk one by one (as the PostgreSQL one's: fsync off),
# so the benchmark compares the two on equal terms. TLS is offered with the test certificates and
# required of the users made to need it; the binlog is on in row format
# with full images and metadata, as binlog mode needs. Users, all from
# 127.0.0.1: `switchyard` (every privilege, no password: tests make a
# database each), `switchyard_rotating` (password `rotating-1`, TLS
# required) and `switchyard_cert` (a client certificate signed by the test
# CA, no password).
mariadb_start() {
    make_certificates
    mkdir -p "$MARIADB_DIR"
    pid_running "$MARIADB_DIR/mariadb.pid" mariadbd && return 0
    local fresh=""
    if [ ! -d "$MARIADB_DIR/data/mysql" ]; then
        mariadb-install-db --user="$(id -un)" --datadir="$MARIADB_DIR/data" \
            --auth-root-authentication-method=normal --skip-test-db >"$MARIADB_DIR/install.log" 2>&1
        fresh=1
    fi
    cat >"$MARIADB_DIR/my.cnf" <<CONF
[mariadbd]
datadir = $MARIADB_DIR/data
socket = $MARIADB_DIR/mariadb.sock
pid-file = $MARIADB_DIR/mariadb.pid
log-error = $MARIADB_DIR/server.log
bind-address = 127.0.0.1
port = $MARIADB_PORT
skip-name-resolve
max_connections = 800
innodb_buffer_pool_size = 256M
innodb_flush_log_at_trx_commit = 2
ssl-cert = $TLS_DIR/server.pem
ssl-key = $TLS_DIR/server.key
ssl-ca = $TLS_DIR/ca.pem
server_id = 1
log-bin = $MARIADB_DIR/data/binlog
binlog_format = ROW
binlog_row_image = FULL
binlog_row_metadata = FULL
# Bounded: every test and fault run writes here, and a binlog of 1 GiB
# files kept for a day grew to 14 GiB on a developer's machine. A file is
# purged at the next rotation once it is an hour old, unless a connected
# binlog reader still needs it.
max_binlog_size = 64M
binlog_expire_logs_seconds = 3600
CONF
    nohup mariadbd --defaults-file="$MARIADB_DIR/my.cnf" --user="$(id -un)" </dev/null >/dev/null 2>&1 &
    wait_port "$MARIADB_PORT" mariadbd "$MARIADB_DIR/server.log"
    [ -n "$fresh" ] || return 0
    mariadb --socket="$MARIADB_DIR/mariadb.sock" -uroot <<SQL
CREATE USER 'switchyard'@'127.0.0.1';
GRANT ALL PRIVILEGES ON *.* TO 'switchyard'@'127.0.0.1' WITH GRANT OPTION;
CREATE USER 'switchyard_rotating'@'127.0.0.1' IDENTIFIED BY 'rotating-1' REQUIRE SSL;
GRANT ALL PRIVILEGES ON *.* TO 'switchyard_rotating'@'127.0.0.1';
CREATE USER 'switchyard_cert'@'127.0.0.1' REQUIRE ISSUER '/CN=switchyard test ca';
GRANT ALL PRIVILEGES ON *.* TO 'switchyard_cert'@'127.0.0.1';
SQL
}

# The AWS services the AWS targets' tests publish to, in memory (a restart
# forgets every queue, topic, bus and stream: each test makes its own).
moto_start() {
    mkdir -p "$MOTO_DIR"
    pid_running "$MOTO_DIR/moto.pid" moto_server && return 0
    nohup "$MOTO_BIN" -H 127.0.0.1 -p "$MOTO_PORT" </dev/null >"$MOTO_DIR/moto.log" 2>&1 &
    echo $! >"$MOTO_DIR/moto.pid"
    # Python's start, on two busy cores: longer than wait_port's 10 s.
    for _ in $(seq 1 600); do
        if listening "$MOTO_PORT"; then return 0; fi
        sleep 0.1
    done
    echo "services: moto did not start, see $MOTO_DIR/moto.log" >&2
    return 1
}

# Redis over TLS only (the test CA's `localhost` certificate), with the ACL
# user `switchyard` whose password is in $REDIS_DIR/password; the default
# user is off.
redis_start() {
    make_certificates
    mkdir -p "$REDIS_DIR"
    [ -s "$REDIS_DIR/password" ] || head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$REDIS_DIR/password"
    chmod 600 "$REDIS_DIR/password"
    pid_running "$REDIS_DIR/redis.pid" redis-server && return 0
    cat >"$REDIS_DIR/redis.conf" <<CONF
bind 127.0.0.1
port 0
tls-port $REDIS_TLS_PORT
tls-cert-file $TLS_DIR/server.pem
tls-key-file $TLS_DIR/server.key
tls-ca-cert-file $TLS_DIR/ca.pem
tls-auth-clients optional
dir $REDIS_DIR
save ""
appendonly no
user default off
user switchyard on >$(cat "$REDIS_DIR/password") ~* &* +@all
daemonize no
CONF
    nohup redis-server "$REDIS_DIR/redis.conf" </dev/null >"$REDIS_DIR/redis.log" 2>&1 &
    echo $! >"$REDIS_DIR/redis.pid"
    wait_port "$REDIS_TLS_PORT" redis "$REDIS_DIR/redis.log"
}

print_env() {
    echo "export DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres"
    echo "export SWITCHYARD_PG_TLS_URL='postgres://postgres@localhost:$PG_TLS_PORT/postgres?sslmode=verify-full&sslrootcert=$TLS_DIR/ca.pem'"
    echo "export SWITCHYARD_TLS_DIR=$TLS_DIR"
    echo "export SWITCHYARD_NATS_URL=nats://127.0.0.1:$NATS_PORT"
    echo "export SWITCHYARD_KAFKA_BOOTSTRAP=127.0.0.1:$KAFKA_PORT"
    echo "export SWITCHYARD_TANSU_BIN=$TANSU_BIN"
    echo "export SWITCHYARD_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:$RABBIT_PORT/%2f"
    echo "export SWITCHYARD_RABBITMQ_SERVER=$RABBIT_SERVER"
    echo "export SWITCHYARD_REGISTRY=localhost:$REGISTRY_PORT"
    echo "export SWITCHYARD_REGISTRY_DIR=$REGISTRY_DIR"
    echo "export SWITCHYARD_MARIADB_URL=mysql://switchyard@127.0.0.1:$MARIADB_PORT/mysql"
    echo "export SWITCHYARD_MARIADB_SOCKET=$MARIADB_DIR/mariadb.sock"
    echo "export SWITCHYARD_MOTO_URL=http://127.0.0.1:$MOTO_PORT"
    echo "export SWITCHYARD_MOTO_SERVER=$MOTO_BIN"
    echo "export SWITCHYARD_WEBHOOK_PYTHON=$WEBHOOKS_VENV/bin/python"
    echo "export SWITCHYARD_REDIS_URL=rediss://localhost:$REDIS_TLS_PORT"
    echo "export SWITCHYARD_REDIS_DIR=$REDIS_DIR"
    if pubsub_emulator >/dev/null; then
        echo "export SWITCHYARD_PUBSUB_EMULATOR=$(pubsub_emulator)"
        echo "export SWITCHYARD_PUBSUB_EMULATOR_HOST=127.0.0.1:$PUBSUB_PORT"
    fi
}

# One install at a time: .ci/run installs in the background while the tree
# builds, and the test script's `start` waits for it here. `-o`: a daemon
# an install starts (a package's post-install script may) must not hold
# the lock for ever.
install_locked() {
    mkdir -p "$TOOLS_DIR"
    flock -o "$TOOLS_DIR/install.lock" "${BASH_SOURCE[0]}" install-now
}

case "${1:-}" in
    install)
        install_locked
        ;;
    install-now)
        install_missing
        ;;
    start)
        install_locked
        # One start at a time: two at once (two terminals, a test script
        # beside a by-hand start) would each launch a server on the same
        # port, and the loser's exit takes the winner's pid file with it.
        mkdir -p "$STATE_DIR"
        flock -o "$STATE_DIR/start.lock" "${BASH_SOURCE[0]}" start-now
        ;;
    start-now)
        pg_start
        pg_tls_start
        nats_start
        kafka_start
        rabbit_start
        pubsub_start
        registry_start
        mariadb_start
        moto_start
        redis_start
        print_env
        ;;
    stop)
        pid_stop "$REDIS_DIR/redis.pid" redis-server
        pid_stop "$MOTO_DIR/moto.pid" moto_server
        pid_stop "$MARIADB_DIR/mariadb.pid" mariadbd
        pid_stop "$REGISTRY_DIR/registry.pid" docker-registry
        pid_stop "$PUBSUB_DIR/emulator.pid" java
        rabbit_stop
        pid_stop "$KAFKA_DIR/tansu.pid" tansu
        pid_stop "$NATS_DIR/nats.pid" nats-server
        pg_stop "$PG_DATA"
        pg_stop "$PG_TLS_DATA"
        pg_stop "$PG_DURABLE_DATA"
        ;;
    durable)
        pg_durable_start
        echo "export DATABASE_URL=postgres://postgres@127.0.0.1:$PG_DURABLE_PORT/postgres"
        ;;
    status)
        pg_run "$PG_BIN/pg_ctl" -D "$PG_DATA" status || true
        for service in "nats-server:nats-server:$NATS_DIR/nats.pid" "tansu:tansu:$KAFKA_DIR/tansu.pid" "rabbitmq:beam:$RABBIT_DIR/rabbit.pid" "pubsub-emulator:java:$PUBSUB_DIR/emulator.pid" "registry:docker-registry:$REGISTRY_DIR/registry.pid" "mariadb:mariadbd:$MARIADB_DIR/mariadb.pid" "moto:moto_server:$MOTO_DIR/moto.pid" "redis:redis-server:$REDIS_DIR/redis.pid"; do
            pidfile="${service##*:}" command="${service#*:}" command="${command%%:*}"
            if pid_running "$pidfile" "$command"; then echo "${service%%:*} running (pid $(cat "$pidfile"))"; else echo "${service%%:*} stopped"; fi
        done
        ;;
    env)
        print_env
        ;;
    *)
        echo "usage: $0 install|start|stop|status|env|durable" >&2
        exit 2
        ;;
esac
