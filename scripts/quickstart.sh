#!/usr/bin/env bash
# One command from a fresh machine with Rust to a relay publishing sample
# order events: installs and starts PostgreSQL and NATS on loopback, builds
# the plugins, creates the outbox, lets the sample order service write a few
# orders, relays them to NATS JetStream and prints what a consumer received.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2
fi
eval "$(scripts/services.sh start)"
export SWITCHYARD_DATABASE_URL="$DATABASE_URL"

(cd plugins && cargo build --release --quiet)
cargo build --quiet -p switchyard -p order-service -p nats-consumer
bin=target/debug

"$bin/switchyard" migrate --config examples/relay.toml
"$bin/order-service" --orders "${ORDERS:-5}"

"$bin/switchyard" run --config examples/relay.toml &
relay=$!
trap 'kill $relay 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
    left=$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending','in_flight')")
    [ "$left" = 0 ] && break
    sleep 0.1
done
kill -TERM $relay && wait $relay || true
trap - EXIT

echo "== published to NATS stream ORDERS"
"$bin/nats-consumer" --url "$SWITCHYARD_NATS_URL" --stream ORDERS | tail -n 30
echo "== outbox"
psql "$DATABASE_URL" -c "SELECT status, count(*) FROM switchyard_outbox GROUP BY status"
