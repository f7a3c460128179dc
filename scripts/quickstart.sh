#!/usr/bin/env bash
# One command from a fresh machine with Rust to a relay publishing sample
# order events: installs and starts PostgreSQL, NATS, tansu (Kafka
# protocol) and moto (the AWS services) on loopback, builds the plugins,
# creates the outbox, lets the sample order service write a few orders,
# relays them and prints what the example consumer received.
#
#   scripts/quickstart.sh          # examples/relay.toml: NATS JetStream
#   scripts/quickstart.sh kafka    # examples/relay-kafka.toml: Kafka, plus new orders to a NATS audit stream
#   scripts/quickstart.sh pubsub   # examples/relay-pubsub.toml: the Google Cloud Pub/Sub emulator
#   scripts/quickstart.sh sqs      # examples/relay-sqs.toml: an Amazon SQS FIFO queue, on moto
set -euo pipefail
cd "$(dirname "$0")/.."

broker="${1:-nats}"
case "$broker" in
    nats) config=examples/relay.toml ;;
    kafka) config=examples/relay-kafka.toml ;;
    pubsub) config=examples/relay-pubsub.toml ;;
    sqs) config=examples/relay-sqs.toml ;;
    *) echo "usage: $0 [nats|kafka|pubsub|sqs]" >&2; exit 2 ;;
esac

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2
fi
# Assigned first so that a failed start stops this script (set -e).
services_env="$(scripts/services.sh start)"
eval "$services_env"
export SWITCHYARD_DATABASE_URL="$DATABASE_URL"

(cd plugins && cargo build --release --quiet)
cargo build --quiet -p switchyard -p order-service -p consumer
bin=target/debug

if [ "$broker" = kafka ]; then
    # The cluster does not create topics on use; a second create is refused, harmlessly.
    "$SWITCHYARD_TANSU_BIN" topic create --broker "tcp://$SWITCHYARD_KAFKA_BOOTSTRAP" --partitions 3 orders \
        >/dev/null 2>&1 || true
fi
if [ "$broker" = pubsub ]; then
    if [ -z "${SWITCHYARD_PUBSUB_EMULATOR_HOST:-}" ]; then
        echo "quickstart: this machine has no Pub/Sub emulator (gcloud component pubsub-emulator)" >&2
        exit 1
    fi
    # A subscription gets only what is published after it exists: make it first.
    pubsub_args=(pubsub --emulator-host "$SWITCHYARD_PUBSUB_EMULATOR_HOST" --project switchyard-demo)
    "$bin/consumer" "${pubsub_args[@]}" --create-for orders
    export SWITCHYARD_TARGET_EVENTS_EMULATOR_HOST="$SWITCHYARD_PUBSUB_EMULATOR_HOST"
fi
if [ "$broker" = sqs ]; then
    # The relay never creates queues: make the FIFO queue first. moto takes
    # any key; the consumer finds these in the environment (AWS's default
    # chain), the relay in the example config.
    export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_REGION=us-east-1
    export SWITCHYARD_TARGET_EVENTS_ENDPOINT_URL="$SWITCHYARD_MOTO_URL"
    sqs_args=(sqs --endpoint-url "$SWITCHYARD_MOTO_URL" --queue orders.fifo)
    "$bin/consumer" "${sqs_args[@]}" --create-for orders.fifo
fi
"$bin/switchyard" migrate --config "$config"
"$bin/order-service" --orders "${ORDERS:-5}"

"$bin/switchyard" run --config "$config" &
relay=$!
trap 'kill $relay 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
    left=$(psql "$DATABASE_URL" -Atc "SELECT count(*) FROM switchyard_outbox WHERE status IN ('pending','in_flight')")
    [ "$left" = 0 ] && break
    sleep 0.1
done
kill -TERM $relay && wait $relay || true
trap - EXIT

inbox="sqlite:///tmp/switchyard-inbox-$broker.db"
if [ "$broker" = pubsub ]; then
    echo "== published to Pub/Sub topic orders (subscription orders-view)"
    "$bin/consumer" "${pubsub_args[@]}" --inbox "$inbox" --idle-ms 3000 | tail -n 30
elif [ "$broker" = sqs ]; then
    echo "== published to SQS FIFO queue orders.fifo"
    "$bin/consumer" "${sqs_args[@]}" --inbox "$inbox" --idle-ms 3000 | tail -n 30
elif [ "$broker" = kafka ]; then
    echo "== published to Kafka topic orders"
    "$bin/consumer" kafka --bootstrap-servers "$SWITCHYARD_KAFKA_BOOTSTRAP" --topic orders --inbox "$inbox" \
        --idle-ms 3000 | tail -n 30
    echo "== published to NATS stream AUDIT"
    "$bin/consumer" nats --url "$SWITCHYARD_NATS_URL" --stream AUDIT --inbox "$inbox-audit" | tail -n 12
else
    echo "== published to NATS stream ORDERS"
    "$bin/consumer" nats --url "$SWITCHYARD_NATS_URL" --stream ORDERS --inbox "$inbox" | tail -n 30
fi
echo "== outbox"
psql "$DATABASE_URL" -c "SELECT status, count(*) FROM switchyard_outbox GROUP BY status"
